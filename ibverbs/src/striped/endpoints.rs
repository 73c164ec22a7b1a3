//! [`EndpointList`]: the endpoints of a striped connection's queue pairs, and their wire encoding.

use crate::connect::Endpoint;
use crate::error::{Error, Result};

/// The [`Endpoint`]s of all queue pairs of a [`StripedConnection`](super::StripedConnection), in
/// order, as exchanged out of band.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(transparent))]
pub struct EndpointList(pub Vec<Endpoint>);

impl EndpointList {
    /// Most endpoints in a list (and queue pairs per striped connection).
    pub const MAX: usize = 64;
    const MAGIC: u8 = b'M';
    const VERSION: u8 = 1;
    const HEADER: usize = 4;

    /// Byte encoding: magic `'M'`, version 1, the count, 0, then each endpoint's
    /// [`Endpoint::encode`] (30 bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::HEADER + self.0.len() * Endpoint::ENCODED_LEN);
        b.extend_from_slice(&[Self::MAGIC, Self::VERSION, u8::try_from(self.0.len()).unwrap_or(0), 0]);
        for ep in &self.0 {
            b.extend_from_slice(&ep.encode());
        }
        b
    }

    /// Decodes [`encode`](Self::encode)'s output, strictly.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad magic, version or reserved byte, a count of 0 or above
    /// [`MAX`](Self::MAX), a length that does not match the count, or any invalid endpoint
    /// (see [`Endpoint::decode`]). Never panics.
    pub fn decode(bytes: &[u8]) -> Result<EndpointList> {
        let bad = |reason| Error::InvalidArgument { verb: "EndpointList::decode", reason };
        let Some((head, body)) = bytes.split_first_chunk::<4>() else {
            return Err(bad("shorter than the 4-byte header"));
        };
        if head[0] != Self::MAGIC || head[1] != Self::VERSION || head[3] != 0 {
            return Err(bad("not an endpoint list (bad magic, version or reserved byte)"));
        }
        let n = usize::from(head[2]);
        if n == 0 || n > Self::MAX {
            return Err(bad("endpoint count is not in 1..=64"));
        }
        if body.len() != n * Endpoint::ENCODED_LEN {
            return Err(bad("length does not match the endpoint count"));
        }
        body.chunks_exact(Endpoint::ENCODED_LEN)
            .map(Endpoint::decode)
            .collect::<Result<_>>()
            .map(EndpointList)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attr::{Gid, Mtu};
    use crate::tests_support::xorshift;

    fn list(n: u32) -> EndpointList {
        EndpointList(
            (0..n)
                .map(|i| Endpoint {
                    qpn: i + 1,
                    psn: i * 3,
                    lid: 0,
                    gid: Gid([i as u8; 16]),
                    mtu: Mtu::MTU_1024,
                })
                .collect(),
        )
    }

    #[test]
    fn round_trips_and_rejects_bad_headers() {
        for n in [1, 2, 8, 64] {
            let l = list(n);
            assert_eq!(EndpointList::decode(&l.encode()).unwrap(), l);
        }
        let b = list(2).encode();
        assert!(EndpointList::decode(&b[..b.len() - 1]).is_err());
        assert!(EndpointList::decode(&[]).is_err());
        for (i, v) in [(0, b'X'), (1, 2), (2, 0), (2, 3), (3, 1)] {
            let mut bad = b.clone();
            bad[i] = v;
            assert!(EndpointList::decode(&bad).is_err(), "byte {i} = {v}");
        }
        let mut bad = b.clone();
        bad[4 + 30 + 6] = 1; // second endpoint's QPN above 24 bits
        assert!(EndpointList::decode(&bad).is_err());
    }

    #[test]
    fn hostile_bytes_never_panic() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let valid = list(3).encode();
        let rounds = if cfg!(miri) { 200 } else { 50_000 };
        for round in 0..rounds {
            let r = xorshift(&mut seed);
            let mut b = if round % 2 == 0 {
                valid.clone()
            } else {
                (0..(r % 130) as usize).map(|_| xorshift(&mut seed) as u8).collect()
            };
            if round % 2 == 0 {
                let i = (r % b.len() as u64) as usize;
                b[i] = (r >> 16) as u8;
            }
            if let Ok(l) = EndpointList::decode(&b) {
                assert_eq!(l.encode(), b, "accepted bytes are canonical");
            }
        }
    }
}
