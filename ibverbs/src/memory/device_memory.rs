//! On-device memory (`ibv_alloc_dm`): a few KiB to MiB inside the adapter, reached by copies
//! (`ibv_memcpy_to_dm`, `ibv_memcpy_from_dm`) and, once registered (`ibv_reg_dm_mr`), by local
//! and remote RDMA like a memory region, without a PCIe round trip to host memory.
//!
//! The memory is not in the process's address space as far as Rust is concerned: the crate never
//! hands out a reference into it, only copies, so a peer writing it while the process copies
//! out gives torn bytes, never undefined behaviour.

use std::fmt;
use std::ops::RangeBounds;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::device::{Context, ContextInner};
use crate::error::{cvt, cvt_p, Error, Result};
use crate::memory::keyed::KeyedMr;
use crate::memory::mr::{check_range, AccessFlags};
use crate::memory::remote::RemoteSlice;
use crate::pd::ProtectionDomain;

struct DmInner {
    raw: NonNull<ffi::ibv_dm>,
    len: usize,
    _ctx: Arc<ContextInner>,
}

// SAFETY: an opaque provider object; rdma-core's copy verbs and registration may be called on it
// from any thread (the device serialises its own accesses).
unsafe impl Send for DmInner {}
// SAFETY: as above.
unsafe impl Sync for DmInner {}

impl Drop for DmInner {
    fn drop(&mut self) {
        // SAFETY: allocated once, freed once, after every region over it (each holds an Arc).
        unsafe { ffi::ibv_free_dm(self.raw.as_ptr()) };
    }
}

/// A block of on-device memory (`struct ibv_dm`). Freed (`ibv_free_dm()`) once it and every
/// [`DeviceMemoryRegion`] over it are dropped.
#[derive(Clone)]
pub struct DeviceMemory {
    inner: Arc<DmInner>,
}

impl fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMemory").field("len", &self.inner.len).finish()
    }
}

impl Context {
    /// Allocates `len` bytes of on-device memory aligned to `2^log_align` bytes
    /// (`ibv_alloc_dm()`), after checking the device's `max_dm_size`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device has no on-device memory (`max_dm_size` 0),
    /// [`Error::InvalidArgument`] for a length of 0 or above `max_dm_size`, [`Error::Verb`]
    /// from the verb (e.g. `ENOMEM` when the device's memory is taken).
    #[doc(alias = "ibv_alloc_dm")]
    pub fn alloc_dm(&self, len: usize, log_align: u32) -> Result<DeviceMemory> {
        const VERB: &str = "ibv_alloc_dm";
        let max = self.query_device_ex()?.max_dm_size();
        if max == 0 {
            return Err(Error::Unsupported { verb: VERB, capability: "on-device memory (max_dm_size is 0)" });
        }
        if len == 0 || len as u64 > max {
            return Err(Error::InvalidArgument {
                verb: VERB,
                reason: "length 0 or above the device's max_dm_size",
            });
        }
        let mut attr = ffi::ibv_alloc_dm_attr { length: len, log_align_req: log_align, comp_mask: 0 };
        // SAFETY: valid context; attr is a valid, initialised attribute struct.
        let raw = unsafe { ffi::ibv_alloc_dm(self.as_raw(), &mut attr) };
        let raw = cvt_p(VERB, raw).map_err(|e| e.or_unsupported("on-device memory"))?;
        Ok(DeviceMemory { inner: Arc::new(DmInner { raw, len, _ctx: self.inner.clone() }) })
    }
}

/// Bytes per call of a copy through the aligned bounce buffer.
const BOUNCE: usize = 256;

/// The bounce buffer: 4-byte aligned.
#[repr(C, align(4))]
struct Bounce([u8; BOUNCE]);

/// The host side of a device-memory copy: the bytes to copy in, or the slice to copy out to.
enum Host<'a> {
    In(&'a [u8]),
    Out(&'a mut [u8]),
}

/// Runs a device-memory copy of the host side's bytes at device offset `off` through `copy(dm_off,
/// host, n)`, with `host` 4-byte aligned: the slice itself when it is, else pieces of [`BOUNCE`]
/// bytes through an aligned stack buffer, filled from the slice before each call (copy in) or
/// copied to it after (copy out). `host` is valid for reads of `n` bytes copying in (it may
/// point into a shared slice: the provider only reads it), for writes copying out.
fn copy_in_words(
    off: usize,
    host: Host<'_>,
    mut copy: impl FnMut(usize, *mut u8, usize) -> Result<()>,
) -> Result<()> {
    match host {
        Host::In(src) if src.as_ptr() as usize % 4 == 0 => copy(off, src.as_ptr().cast_mut(), src.len()),
        Host::Out(dst) if dst.as_ptr() as usize % 4 == 0 => copy(off, dst.as_mut_ptr(), dst.len()),
        Host::In(src) => {
            let mut bounce = Bounce([0; BOUNCE]);
            for (i, piece) in src.chunks(BOUNCE).enumerate() {
                bounce.0[..piece.len()].copy_from_slice(piece);
                copy(off + i * BOUNCE, bounce.0.as_mut_ptr(), piece.len())?;
            }
            Ok(())
        }
        Host::Out(dst) => {
            let mut bounce = Bounce([0; BOUNCE]);
            for (i, piece) in dst.chunks_mut(BOUNCE).enumerate() {
                copy(off + i * BOUNCE, bounce.0.as_mut_ptr(), piece.len())?;
                piece.copy_from_slice(&bounce.0[..piece.len()]);
            }
            Ok(())
        }
    }
}

impl DeviceMemory {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether it is empty (never: a zero-length allocation is refused).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Copies `src` into the device memory at `offset` (`ibv_memcpy_to_dm()`).
    ///
    /// Providers read the host side as 4-byte words (mlx5): a `src` that does not start on a
    /// 4-byte boundary is copied through an aligned buffer on the stack, 256 bytes per call.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the allocation; [`Error::Verb`] from the
    /// verb (providers may require 4-byte aligned offsets and lengths: `EINVAL`). Copied in
    /// pieces, a failure may leave the pieces before it copied.
    #[doc(alias = "ibv_memcpy_to_dm")]
    pub fn copy_from_slice(&self, offset: usize, src: &[u8]) -> Result<()> {
        const VERB: &str = "ibv_memcpy_to_dm";
        let (off, _) = check_range(VERB, offset..offset.saturating_add(src.len()), self.inner.len)?;
        let dm = self.inner.raw.as_ptr();
        copy_in_words(off, Host::In(src), |dm_off, host, n| {
            // SAFETY: valid DM; the piece lies in the checked range; `host` is readable for `n`
            // bytes (`copy_in_words`).
            cvt(VERB, unsafe { ffi::ibv_memcpy_to_dm(dm, dm_off as u64, host.cast_const().cast(), n) })
        })
    }

    /// Copies `dst.len()` bytes at `offset` out of the device memory (`ibv_memcpy_from_dm()`),
    /// through an aligned buffer on the stack when `dst` does not start on a 4-byte boundary (as
    /// [`copy_from_slice`](Self::copy_from_slice)).
    ///
    /// # Errors
    /// As [`copy_from_slice`](Self::copy_from_slice).
    #[doc(alias = "ibv_memcpy_from_dm")]
    pub fn copy_to_slice(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        const VERB: &str = "ibv_memcpy_from_dm";
        let (off, _) = check_range(VERB, offset..offset.saturating_add(dst.len()), self.inner.len)?;
        let dm = self.inner.raw.as_ptr();
        copy_in_words(off, Host::Out(dst), |dm_off, host, n| {
            // SAFETY: valid DM; the piece lies in the checked range; `host` is writable for `n`
            // bytes (`copy_in_words`).
            cvt(VERB, unsafe { ffi::ibv_memcpy_from_dm(host.cast(), dm, dm_off as u64, n) })
        })
    }

    /// The raw `struct ibv_dm *`; valid while this value (or a clone, or a region over it) lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_dm {
        self.inner.raw.as_ptr()
    }

    /// Registers bytes `range` of the device memory as a memory region of `pd`
    /// (`ibv_reg_dm_mr()`); `IBV_ACCESS_ZERO_BASED` is added, so work requests and peers address
    /// it from 0.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::InvalidArgument`] for an empty range or a `pd` of
    /// another device; [`Error::Unsupported`] where the provider cannot register device memory
    /// (`EOPNOTSUPP`); [`Error::Verb`] from the verb otherwise.
    #[doc(alias = "ibv_reg_dm_mr")]
    pub fn register(
        &self,
        pd: &ProtectionDomain,
        range: impl RangeBounds<usize>,
        access: AccessFlags,
    ) -> Result<DeviceMemoryRegion> {
        const VERB: &str = "ibv_reg_dm_mr";
        let (off, len) = check_range(VERB, range, self.inner.len)?;
        if len == 0 {
            return Err(Error::InvalidArgument { verb: VERB, reason: "empty range" });
        }
        if !Arc::ptr_eq(&pd.inner.ctx, &self.inner._ctx) {
            return Err(Error::InvalidArgument {
                verb: VERB,
                reason: "the protection domain is of another context",
            });
        }
        let access = access | AccessFlags::from_bits_retain(ffi::ibv_access_flags::IBV_ACCESS_ZERO_BASED.0);
        // SAFETY: valid PD and DM of one context (checked); the range lies in the allocation,
        // which outlives the region (it holds an Arc).
        let raw = unsafe {
            ffi::ibv_reg_dm_mr(pd.as_raw(), self.inner.raw.as_ptr(), off as u64, len, access.bits())
        };
        let raw = cvt_p(VERB, raw).map_err(|e| e.or_unsupported("registering on-device memory"))?;
        Ok(DeviceMemoryRegion {
            mr: KeyedMr::new(raw, pd.inner.clone()),
            len,
            access,
            _dm: self.inner.clone(),
        })
    }
}

/// A registered range of [`DeviceMemory`] (`ibv_reg_dm_mr()`), zero-based: the keys address
/// it from 0. For the `unsafe` raw level (an SGE of `addr` = offset, `lkey`) and for peers
/// ([`remote`](Self::remote)). Deregistered when dropped.
pub struct DeviceMemoryRegion {
    // Deregistered before the device memory is freed: fields drop in declaration order.
    mr: KeyedMr,
    len: usize,
    access: AccessFlags,
    _dm: Arc<DmInner>,
}

impl DeviceMemoryRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    /// The rights it was registered with (`ZERO_BASED` included).
    pub fn access(&self) -> AccessFlags {
        self.access
    }
    /// A descriptor for a peer: address 0 (zero-based), length and rkey.
    pub fn remote(&self) -> RemoteSlice {
        RemoteSlice { addr: 0, len: self.len as u64, rkey: self.rkey() }
    }
    /// The raw `struct ibv_mr *`; valid while this value lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.mr.as_raw()
    }
}

impl fmt::Debug for DeviceMemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMemoryRegion").field("len", &self.len).field("lkey", &self.lkey()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake device memory: copies at `dm_off` through the host pointer, recording each call.
    fn run(dm: &mut [u8], off: usize, host: Host<'_>, into_dm: bool) -> Vec<(usize, usize, usize)> {
        let mut calls = Vec::new();
        copy_in_words(off, host, |dm_off, p, n| {
            calls.push((dm_off, p as usize % 4, n));
            if into_dm {
                // SAFETY: `p` is readable for `n` bytes (copy_in_words's promise, checked here by
                // Miri); it may come from a shared slice.
                let host = unsafe { std::slice::from_raw_parts(p, n) };
                dm[dm_off..dm_off + n].copy_from_slice(host);
            } else {
                // SAFETY: `p` is writable for `n` bytes copying out (as above).
                let host = unsafe { std::slice::from_raw_parts_mut(p, n) };
                host.copy_from_slice(&dm[dm_off..dm_off + n]);
            }
            Ok(())
        })
        .unwrap();
        calls
    }

    #[test]
    fn unaligned_host_slices_are_copied_through_aligned_pieces() {
        let data: Vec<u8> = (0..700u32).map(|i| (i * 7) as u8).collect();
        let mut backing = vec![0u32; 200];
        // SAFETY: 800 initialised bytes, 4-byte aligned.
        let bytes = unsafe { std::slice::from_raw_parts_mut(backing.as_mut_ptr().cast::<u8>(), 800) };
        bytes[1..701].copy_from_slice(&data);
        let mut dm = vec![0u8; 1024];

        // Aligned: one call with the slice itself.
        assert_eq!(run(&mut dm, 8, Host::In(&bytes[4..704]), true), [(8, 0, 700)]);
        // Unaligned: 256-byte pieces from an aligned buffer, at the matching device offsets.
        let calls = run(&mut dm, 12, Host::In(&bytes[1..701]), true);
        assert_eq!(calls, [(12, 0, 256), (268, 0, 256), (524, 0, 188)]);
        assert_eq!(&dm[12..712], &data[..]);

        // Copied back out into an unaligned slice, and into an aligned one.
        bytes.fill(0);
        let calls = run(&mut dm, 12, Host::Out(&mut bytes[3..703]), false);
        assert_eq!(calls, [(12, 0, 256), (268, 0, 256), (524, 0, 188)]);
        assert_eq!(&bytes[3..703], &data[..]);
        assert_eq!(run(&mut dm, 12, Host::Out(&mut bytes[0..700]), false), [(12, 0, 700)]);
        assert_eq!(&bytes[..700], &data[..]);

        // An error ends the copy at the piece that failed.
        let mut n = 0;
        let r = copy_in_words(0, Host::In(&bytes[1..701]), |_, _, _| {
            n += 1;
            if n == 2 {
                Err(Error::InvalidArgument { verb: "test", reason: "refused" })
            } else {
                Ok(())
            }
        });
        assert!(r.is_err());
        assert_eq!(n, 2);
    }
}
