//! [`Endpoint`]: what a peer needs to connect to a queue pair, and its wire encoding.

use crate::attr::{Gid, Mtu};
use crate::error::{Error, Result};

/// What a peer needs to connect to a queue pair: QP number, initial PSN, LID, GID and active MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Endpoint {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID (zero when LID-addressed).
    pub gid: Gid,
    /// The port's active MTU.
    pub mtu: Mtu,
}

impl Endpoint {
    /// Size of [`encode`](Self::encode)'s output.
    pub const ENCODED_LEN: usize = 30;
    const MAGIC: u8 = b'V';
    const VERSION: u8 = 1;

    /// A stable byte encoding for out-of-band exchange: magic `'V'`, version 1, MTU enum, 0,
    /// LID (2 bytes), QPN (4), PSN (4), GID (16); integers big-endian.
    ///
    /// The fields are public, so an endpoint built by hand may hold values no queue pair has: a
    /// QPN or PSN above 24 bits, an MTU outside `IBV_MTU_256..=IBV_MTU_4096`. They are encoded as
    /// they are (an MTU above 255 as 0), and the peer's [`decode`](Self::decode) refuses them:
    /// the error surfaces there, not here. Endpoints from
    /// [`QueuePair::endpoint`](crate::QueuePair::endpoint) are always in range.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0; Self::ENCODED_LEN];
        b[0] = Self::MAGIC;
        b[1] = Self::VERSION;
        b[2] = u8::try_from(self.mtu.0).unwrap_or(0);
        b[4..6].copy_from_slice(&self.lid.to_be_bytes());
        b[6..10].copy_from_slice(&self.qpn.to_be_bytes());
        b[10..14].copy_from_slice(&self.psn.to_be_bytes());
        b[14..30].copy_from_slice(&self.gid.0);
        b
    }

    /// Decodes [`encode`](Self::encode)'s output, checking every field.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong length, magic or version, a non-zero reserved byte,
    /// a QPN or PSN wider than 24 bits, or an invalid MTU.
    pub fn decode(bytes: &[u8]) -> Result<Endpoint> {
        let bad = |reason| Error::InvalidArgument { verb: "Endpoint::decode", reason };
        let b: &[u8; Self::ENCODED_LEN] =
            bytes.try_into().map_err(|_| bad("an endpoint encodes to 30 bytes"))?;
        if b[0] != Self::MAGIC || b[1] != Self::VERSION {
            return Err(bad("not an endpoint (bad magic or version)"));
        }
        if b[3] != 0 {
            return Err(bad("reserved byte is not zero"));
        }
        let mtu = Mtu(u32::from(b[2]));
        if mtu.bytes().is_none() {
            return Err(bad("invalid MTU"));
        }
        let be32 = |r: &[u8]| u32::from_be_bytes([r[0], r[1], r[2], r[3]]);
        let ep = Endpoint {
            lid: u16::from_be_bytes([b[4], b[5]]),
            qpn: be32(&b[6..10]),
            psn: be32(&b[10..14]),
            gid: Gid(b[14..30].try_into().unwrap_or_default()),
            mtu,
        };
        if ep.qpn > 0x00ff_ffff || ep.psn > 0x00ff_ffff {
            return Err(bad("QPN and PSN are 24-bit values"));
        }
        Ok(ep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_encoding_round_trips_and_checks_fields() {
        let mut gid = [0u8; 16];
        gid[15] = 9;
        let ep = Endpoint { qpn: 0x12_3456, psn: 0xab_cdef, lid: 7, gid: Gid(gid), mtu: Mtu::MTU_1024 };
        let b = ep.encode();
        assert_eq!(b.len(), Endpoint::ENCODED_LEN);
        assert_eq!(Endpoint::decode(&b).unwrap(), ep);
        assert!(Endpoint::decode(&b[..29]).is_err());
        let mut bad = b;
        bad[0] = b'X';
        assert!(Endpoint::decode(&bad).is_err());
        let mut bad = b;
        bad[2] = 9;
        assert!(Endpoint::decode(&bad).is_err());
        let mut bad = b;
        bad[6] = 1; // QPN above 24 bits
        assert!(Endpoint::decode(&bad).is_err());
        // Regression (soundness hole 10): the reserved byte was ignored.
        let mut bad = b;
        bad[3] = 1;
        assert!(Endpoint::decode(&bad).is_err());
    }

    use crate::tests_support::xorshift;

    #[test]
    fn hostile_bytes_never_panic_and_only_valid_endpoints_are_accepted() {
        let mut seed = 0x1234_5678_9abc_def0u64;
        let rounds = if cfg!(miri) { 200 } else { 200_000 };
        let valid = Endpoint { qpn: 5, psn: 6, lid: 7, gid: Gid([3; 16]), mtu: Mtu::MTU_1024 }.encode();
        let mut accepted = 0;
        for round in 0..rounds {
            let r = xorshift(&mut seed);
            let len = if round % 2 == 0 { Endpoint::ENCODED_LEN } else { (r % 40) as usize };
            let mut b: Vec<u8> = (0..len).map(|_| xorshift(&mut seed) as u8).collect();
            if round % 3 == 0 && len == Endpoint::ENCODED_LEN {
                // Mutate a valid encoding in one byte: mostly still plausible.
                b = valid.to_vec();
                b[(r % 30) as usize] = (r >> 8) as u8;
            }
            if let Ok(ep) = Endpoint::decode(&b) {
                accepted += 1;
                assert_eq!(ep.encode().as_slice(), b.as_slice(), "accepted bytes are canonical");
                assert!(ep.qpn <= 0xff_ffff && ep.psn <= 0xff_ffff && ep.mtu.bytes().is_some());
            }
        }
        assert!(accepted > 0);
    }
}
