//! [`RemoteSlice`]: a range of registered memory as a peer names it.

use crate::error::{Error, Result};

/// A range of a peer's (or our own) registered memory: address, length and rkey, as exchanged out
/// of band before RDMA Write, Read or atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RemoteSlice {
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The owner's remote key.
    pub rkey: u32,
}

impl RemoteSlice {
    /// Size of [`encode`](Self::encode)'s output.
    pub const ENCODED_LEN: usize = 20;

    /// The sub-range `offset..offset + len`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when it leaves this slice, or when the address would wrap around
    /// (the fields are public, so a slice may come from anywhere).
    pub fn slice(&self, offset: u64, len: u64) -> Result<RemoteSlice> {
        let addr = self.addr.checked_add(offset);
        match (offset.checked_add(len), addr) {
            (Some(end), Some(addr)) if end <= self.len && addr.checked_add(len).is_some() => {
                Ok(RemoteSlice { addr, len, rkey: self.rkey })
            }
            _ => Err(Error::OutOfBounds { verb: "RemoteSlice::slice", offset, len, size: self.len }),
        }
    }

    /// A stable byte encoding for out-of-band exchange: `addr` (8 bytes), `len` (8), `rkey` (4),
    /// all big-endian.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0; Self::ENCODED_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..16].copy_from_slice(&self.len.to_be_bytes());
        b[16..].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    /// Decodes [`encode`](Self::encode)'s output.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `bytes` has the wrong length or the range wraps around.
    pub fn decode(bytes: &[u8]) -> Result<RemoteSlice> {
        let b: &[u8; Self::ENCODED_LEN] = bytes.try_into().map_err(|_| Error::InvalidArgument {
            verb: "RemoteSlice::decode",
            reason: "a remote slice encodes to exactly 20 bytes",
        })?;
        let addr = u64::from_be_bytes(b[..8].try_into().unwrap_or_default());
        let len = u64::from_be_bytes(b[8..16].try_into().unwrap_or_default());
        let rkey = u32::from_be_bytes(b[16..].try_into().unwrap_or_default());
        if addr.checked_add(len).is_none() {
            return Err(Error::InvalidArgument { verb: "RemoteSlice::decode", reason: "range wraps around" });
        }
        Ok(RemoteSlice { addr, len, rkey })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_slice_encoding_round_trips() {
        let r = RemoteSlice { addr: 0x1122_3344_5566_7788, len: 4096, rkey: 0xdead_beef };
        let b = r.encode();
        assert_eq!(&b[..8], &[0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88]);
        assert_eq!(RemoteSlice::decode(&b).unwrap(), r);
        assert!(matches!(RemoteSlice::decode(&b[..19]), Err(Error::InvalidArgument { .. })));
        let mut wrap = RemoteSlice { addr: u64::MAX - 1, len: 8, rkey: 1 }.encode();
        assert!(RemoteSlice::decode(&wrap).is_err());
        wrap[0] = 0;
        assert!(RemoteSlice::decode(&wrap).is_ok());
    }

    #[test]
    fn remote_slice_subranges_are_bounds_checked() {
        let r = RemoteSlice { addr: 1000, len: 100, rkey: 7 };
        assert_eq!(r.slice(10, 90).unwrap(), RemoteSlice { addr: 1010, len: 90, rkey: 7 });
        assert!(matches!(r.slice(10, 91), Err(Error::OutOfBounds { offset: 10, len: 91, size: 100, .. })));
        assert!(r.slice(u64::MAX, 2).is_err());
        // Regression (soundness hole 7): the address was added unchecked.
        let hostile = RemoteSlice { addr: u64::MAX - 4, len: 100, rkey: 7 };
        assert!(hostile.slice(10, 1).is_err());
        assert!(hostile.slice(0, 5).is_err(), "addr + len would wrap");
        assert_eq!(r.slice(100, 0).unwrap().len, 0);
    }

    #[test]
    fn hostile_descriptors_never_panic_or_wrap() {
        let mut seed = 0x0bad_cafe_f00d_1234u64;
        let rounds = if cfg!(miri) { 200 } else { 200_000 };
        for _ in 0..rounds {
            let mut b = [0u8; RemoteSlice::ENCODED_LEN];
            for x in b.iter_mut() {
                *x = crate::tests_support::xorshift(&mut seed) as u8;
            }
            // Bias some towards the edges of the address space.
            if seed % 4 == 0 {
                b[..7].fill(0xff);
            }
            if let Ok(r) = RemoteSlice::decode(&b) {
                assert_eq!(r.encode(), b);
                assert!(r.addr.checked_add(r.len).is_some());
                let span = r.len.saturating_mul(2).max(1);
                let (off, len) = (seed % span, seed.rotate_left(17) % span);
                if let Ok(sub) = r.slice(off, len) {
                    assert!(sub.addr >= r.addr && sub.addr - r.addr + sub.len <= r.len);
                }
            }
        }
    }
}
