//! Memory regions: registered memory, local-only or exposed to remote peers.

use std::alloc::Layout;
use std::fmt;
use std::ops::{Bound, RangeBounds};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{cvt_p, Error, Result};
use crate::ffi;
use crate::pd::{PdInner, ProtectionDomain};

bitflags::bitflags! {
    /// Access rights of a memory region (`enum ibv_access_flags`).
    ///
    /// The default is least privilege: [`LOCAL_WRITE`](AccessFlags::LOCAL_WRITE) only. Remote
    /// access is opted into, and regions with [`REMOTE_WRITE`](AccessFlags::REMOTE_WRITE) or
    /// [`REMOTE_ATOMIC`](AccessFlags::REMOTE_ATOMIC) are typed apart as [`RemoteMemoryRegion`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AccessFlags: u32 {
        /// The local device may write the region (needed for receives, RDMA Read targets and
        /// atomic results).
        const LOCAL_WRITE = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        /// Remote peers may RDMA Write to the region.
        const REMOTE_WRITE = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        /// Remote peers may RDMA Read from the region.
        const REMOTE_READ = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        /// Remote peers may run atomic operations on the region.
        const REMOTE_ATOMIC = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        /// Relaxed ordering of PCIe writes, where supported (optional: ignored elsewhere).
        const RELAXED_ORDERING = ffi::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
        // Unknown bits survive a round trip.
        const _ = !0;
    }
}

impl Default for AccessFlags {
    fn default() -> Self {
        AccessFlags::LOCAL_WRITE
    }
}

impl AccessFlags {
    /// The flags that let a peer modify the region.
    pub const REMOTE_MODIFY: AccessFlags = AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_ATOMIC);
}

/// Memory a [`MemoryRegion`] owns: the crate's page-aligned allocation, a `Vec<u8>`, a
/// `Box<[u8]>`, or foreign memory (mmap, hugepages...) through [`OwnedBuffer::from_raw_parts`].
pub struct OwnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    kind: BufferKind,
}

enum BufferKind {
    Aligned(Layout),
    Vec(usize),
    Raw(Option<Box<dyn FnOnce(*mut u8, usize) + Send + Sync>>),
}

// SAFETY: the buffer is uniquely owned heap memory (or foreign memory whose owner promised, in
// from_raw_parts, that it may be used and freed from any thread).
unsafe impl Send for OwnedBuffer {}
// SAFETY: shared access only reads through &self methods of the region that owns it.
unsafe impl Sync for OwnedBuffer {}

impl OwnedBuffer {
    /// `len` zeroed bytes, aligned to the page size (what the device likes best).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a length of 0; [`Error::Verb`] (`ENOMEM`) when the
    /// allocation fails.
    pub fn zeroed(len: usize) -> Result<OwnedBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument { verb: "ibv_reg_mr", reason: "zero-length memory region" });
        }
        let page = page_size();
        let layout = Layout::from_size_align(len.div_ceil(page) * page, page).map_err(|_| {
            Error::InvalidArgument { verb: "ibv_reg_mr", reason: "length too large for an allocation" }
        })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(Error::Verb {
            verb: "ibv_reg_mr",
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        })?;
        Ok(OwnedBuffer { ptr, len, kind: BufferKind::Aligned(layout) })
    }

    /// Takes foreign memory: `len` bytes at `ptr`, released by `free(ptr, len)` (if given) after
    /// the region is deregistered.
    ///
    /// # Safety
    /// `ptr` is valid for reads and writes of `len` bytes, is used by nothing else from now until
    /// `free` is called (or forever, without `free`), and `free` may run on any thread.
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        free: Option<Box<dyn FnOnce(*mut u8, usize) + Send + Sync>>,
    ) -> OwnedBuffer {
        OwnedBuffer { ptr, len, kind: BufferKind::Raw(free) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl From<Vec<u8>> for OwnedBuffer {
    fn from(v: Vec<u8>) -> Self {
        let mut v = std::mem::ManuallyDrop::new(v);
        let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
        // SAFETY: a Vec's pointer is never null (dangling but non-null when empty).
        OwnedBuffer { ptr: unsafe { NonNull::new_unchecked(ptr) }, len, kind: BufferKind::Vec(cap) }
    }
}

impl From<Box<[u8]>> for OwnedBuffer {
    fn from(b: Box<[u8]>) -> Self {
        OwnedBuffer::from(Vec::from(b))
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        match &mut self.kind {
            // SAFETY: allocated in `zeroed` with this layout.
            BufferKind::Aligned(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) },
            // SAFETY: rebuilt from the parts taken in `From<Vec<u8>>`.
            BufferKind::Vec(cap) => drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, *cap) }),
            BufferKind::Raw(free) => {
                if let Some(free) = free.take() {
                    free(self.ptr.as_ptr(), self.len);
                }
            }
        }
    }
}

impl fmt::Debug for OwnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedBuffer").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

/// The system's page size (what [`OwnedBuffer::zeroed`] aligns to).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// What both region types share.
pub(crate) struct MrInner {
    raw: NonNull<ffi::ibv_mr>,
    // Deregistered (in Drop) before the buffer is freed: field order does not matter, Drop does it.
    buf: std::mem::ManuallyDrop<OwnedBuffer>,
    access: AccessFlags,
    _pd: Arc<PdInner>,
}

// SAFETY: the MR handle is an immutable kernel object; the buffer is Send (see OwnedBuffer).
unsafe impl Send for MrInner {}
// SAFETY: &MrInner only reads plain fields; access to the bytes is governed by the wrapper types.
unsafe impl Sync for MrInner {}

impl MrInner {
    fn register(pd: &ProtectionDomain, buf: OwnedBuffer, access: AccessFlags) -> Result<MrInner> {
        if buf.len == 0 {
            return Err(Error::InvalidArgument { verb: "ibv_reg_mr", reason: "zero-length memory region" });
        }
        let flags = libc::c_int::try_from(access.bits())
            .map_err(|_| Error::InvalidArgument { verb: "ibv_reg_mr", reason: "unknown access flag bits" })?;
        // SAFETY: the PD is valid; the buffer is valid for `len` bytes and stays allocated (owned
        // by the returned MrInner) until after ibv_dereg_mr in Drop.
        let raw = unsafe { ffi::ibv_reg_mr(pd.as_raw(), buf.ptr.as_ptr().cast(), buf.len, flags) };
        let raw = cvt_p("ibv_reg_mr", raw)?;
        Ok(MrInner { raw, buf: std::mem::ManuallyDrop::new(buf), access, _pd: pd.inner.clone() })
    }

    pub(crate) fn addr(&self) -> *mut u8 {
        self.buf.ptr.as_ptr()
    }
    pub(crate) fn len(&self) -> usize {
        self.buf.len
    }
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the MR is valid while self lives; lkey is a plain field written at registration.
        unsafe { (*self.raw.as_ptr()).lkey }
    }
    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.raw.as_ptr()).rkey }
    }

    /// Checks that `range` lies in the region; returns (offset, len).
    pub(crate) fn range(&self, verb: &'static str, range: impl RangeBounds<usize>) -> Result<(usize, usize)> {
        let size = self.len();
        let start = match range.start_bound() {
            Bound::Included(&s) => Some(s),
            Bound::Excluded(&s) => s.checked_add(1),
            Bound::Unbounded => Some(0),
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.checked_add(1),
            Bound::Excluded(&e) => Some(e),
            Bound::Unbounded => Some(size),
        };
        match (start, end) {
            (Some(s), Some(e)) if s <= e && e <= size => Ok((s, e - s)),
            (s, e) => {
                let s = s.unwrap_or(usize::MAX);
                let e = e.unwrap_or(usize::MAX);
                Err(Error::OutOfBounds {
                    verb,
                    offset: s as u64,
                    len: e.saturating_sub(s) as u64,
                    size: size as u64,
                })
            }
        }
    }

    /// Whether the region belongs to protection domain `pd`.
    pub(crate) fn in_pd(&self, pd: &Arc<PdInner>) -> bool {
        Arc::ptr_eq(&self._pd, pd)
    }

    fn remote(&self) -> RemoteSlice {
        RemoteSlice { addr: self.addr() as u64, len: self.len() as u64, rkey: self.rkey() }
    }
}

impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: the MR was registered once and is deregistered once; no posted work request
        // references it (a posted request holds the region itself, so it cannot be dropping).
        let ret = unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
        if ret == 0 {
            // SAFETY: the device no longer has the memory registered; dropped exactly once.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.buf) };
        }
        // On failure the memory may still be registered: leak it rather than free it under the
        // device.
    }
}

impl fmt::Debug for MrInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.addr())
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .field("access", &self.access)
            .finish()
    }
}

/// A registered memory region that only this process modifies (`struct ibv_mr` without remote
/// write or atomic access).
///
/// It owns its memory and hands out `&[u8]`/`&mut [u8]` freely: while a safe post uses it, the
/// queue pair owns it (it is moved into the post and handed back by the completion), so no slice
/// can alias memory the device is accessing. Peers may RDMA Read it if it was registered with
/// [`AccessFlags::REMOTE_READ`] (reading never changes it).
///
/// Dropping it deregisters the region (`ibv_dereg_mr()`) and then frees the memory.
pub struct MemoryRegion {
    pub(crate) inner: Box<MrInner>,
}

/// A registered memory region that may change under the program at any moment: remote peers
/// may modify it (registered with [`AccessFlags::REMOTE_WRITE`] or
/// [`AccessFlags::REMOTE_ATOMIC`]), or the local device may write it through several outstanding
/// requests at once (one buffer shared by many posted receives, as rdma-core's pingpong tools do:
/// `pd.allocate_remote(len, AccessFlags::LOCAL_WRITE)` registers it with no remote rights at all).
///
/// A peer can change its bytes at any moment, so safe code never gets a reference into it: it
/// copies in and out with volatile accesses ([`read`](Self::read), [`write`](Self::write),
/// [`load_u64`](Self::load_u64)). [`as_slice`](Self::as_slice) is `unsafe` and its contract is
/// that the application's protocol keeps peers away meanwhile. Share it with `Arc`.
pub struct RemoteMemoryRegion {
    pub(crate) inner: Box<MrInner>,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl fmt::Debug for RemoteMemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Remote")?;
        self.inner.fmt(f)
    }
}

impl ProtectionDomain {
    /// Allocates `len` zeroed, page-aligned bytes and registers them for local write access.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a length of 0, [`Error::Verb`] from `ibv_reg_mr()`
    /// (e.g. `ENOMEM` beyond the locked-memory limit, `EINVAL` above `max_mr_size`).
    #[doc(alias = "ibv_reg_mr")]
    pub fn allocate(&self, len: usize) -> Result<MemoryRegion> {
        self.register(OwnedBuffer::zeroed(len)?, AccessFlags::LOCAL_WRITE)
    }

    /// Registers memory the caller owns (`Vec<u8>`, `Box<[u8]>`, or an [`OwnedBuffer`]) as a
    /// local-only region (`ibv_reg_mr()`). The region takes ownership of the memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty buffer or for remote write/atomic access (use
    /// [`register_remote`](Self::register_remote)); [`Error::Verb`] from `ibv_reg_mr()`.
    #[doc(alias = "ibv_reg_mr")]
    pub fn register(&self, buf: impl Into<OwnedBuffer>, access: AccessFlags) -> Result<MemoryRegion> {
        if access.intersects(AccessFlags::REMOTE_MODIFY) {
            return Err(Error::InvalidArgument {
                verb: "ibv_reg_mr",
                reason: "remote write/atomic access needs a RemoteMemoryRegion: use register_remote",
            });
        }
        Ok(MemoryRegion { inner: Box::new(MrInner::register(self, buf.into(), access)?) })
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them with `access` (which may
    /// include remote write and atomic rights; local write is always added).
    ///
    /// # Errors
    /// As [`allocate`](Self::allocate).
    #[doc(alias = "ibv_reg_mr")]
    pub fn allocate_remote(&self, len: usize, access: AccessFlags) -> Result<RemoteMemoryRegion> {
        self.register_remote(OwnedBuffer::zeroed(len)?, access)
    }

    /// Registers memory the caller owns as a region peers may modify (`ibv_reg_mr()`); local
    /// write access is always added.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty buffer; [`Error::Verb`] from `ibv_reg_mr()`.
    #[doc(alias = "ibv_reg_mr")]
    pub fn register_remote(
        &self,
        buf: impl Into<OwnedBuffer>,
        access: AccessFlags,
    ) -> Result<RemoteMemoryRegion> {
        let access = access | AccessFlags::LOCAL_WRITE;
        Ok(RemoteMemoryRegion { inner: Box::new(MrInner::register(self, buf.into(), access)?) })
    }
}

macro_rules! common_region_methods {
    () => {
        /// Length in bytes.
        pub fn len(&self) -> usize {
            self.inner.len()
        }
        /// Whether the region is empty (never: zero-length registration is refused).
        pub fn is_empty(&self) -> bool {
            self.inner.len() == 0
        }
        /// Start address of the registered memory.
        pub fn addr(&self) -> *mut u8 {
            self.inner.addr()
        }
        /// The local key, for scatter/gather entries.
        pub fn lkey(&self) -> u32 {
            self.inner.lkey()
        }
        /// The remote key, for peers' RDMA operations.
        pub fn rkey(&self) -> u32 {
            self.inner.rkey()
        }
        /// The access rights it was registered with.
        pub fn access(&self) -> AccessFlags {
            self.inner.access
        }
        /// A descriptor of the whole region for a peer: address, length and rkey.
        pub fn remote(&self) -> RemoteSlice {
            self.inner.remote()
        }
        /// The raw `struct ibv_mr *`; valid while this region lives.
        pub fn as_raw(&self) -> *mut ffi::ibv_mr {
            self.inner.raw.as_ptr()
        }
    };
}

impl MemoryRegion {
    common_region_methods!();

    /// The region's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the memory is valid for len bytes, owned by self; only this process modifies it
        // (no remote write access) and never while a post holds it (the post owns the region).
        unsafe { std::slice::from_raw_parts(self.inner.addr(), self.inner.len()) }
    }

    /// The region's bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.inner.addr(), self.inner.len()) }
    }
}

impl std::ops::Deref for MemoryRegion {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for MemoryRegion {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl RemoteMemoryRegion {
    common_region_methods!();

    /// Copies `dst.len()` bytes at `offset` out of the region with volatile reads (a peer may be
    /// writing them meanwhile; the copy is then torn, never undefined behaviour).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let (off, len) = self.inner.range("read", offset..offset.saturating_add(dst.len()))?;
        // SAFETY: the range is inside the region, which is valid memory owned by self.
        unsafe { volatile_copy(self.inner.addr().add(off), dst.as_mut_ptr(), len) };
        Ok(())
    }

    /// Copies `src` into the region at `offset` with volatile writes.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the region.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let (off, len) = self.inner.range("write", offset..offset.saturating_add(src.len()))?;
        // SAFETY: the range is inside the region; volatile writes to memory others may also write.
        unsafe { volatile_copy(src.as_ptr(), self.inner.addr().add(off), len) };
        Ok(())
    }

    /// Fills the region with `byte`.
    pub fn fill(&self, byte: u8) {
        for i in 0..self.len() {
            // SAFETY: i < len, inside the region.
            unsafe { self.inner.addr().add(i).write_volatile(byte) };
        }
    }

    /// Copies the whole region into a new `Vec`.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        // SAFETY: same length as the region.
        unsafe { volatile_copy(self.inner.addr(), v.as_mut_ptr(), v.len()) };
        v
    }

    /// Reads the native-endian `u64` at `offset` (8-byte aligned, as atomics require) in one
    /// volatile access: the value a peer's atomic operation left there.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or [`Error::InvalidArgument`] for a misaligned address.
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        let (off, _) = self.inner.range("load_u64", offset..offset.saturating_add(8))?;
        // SAFETY: in bounds.
        let p = unsafe { self.inner.addr().add(off) };
        if (p as usize) % 8 != 0 {
            return Err(Error::InvalidArgument { verb: "load_u64", reason: "address not 8-byte aligned" });
        }
        // SAFETY: in bounds and aligned.
        Ok(unsafe { p.cast::<u64>().read_volatile() })
    }

    /// The region's bytes as a slice.
    ///
    /// # Safety
    /// No peer may write the region (and no local RDMA Read/receive into it may be posted) while
    /// the slice lives: the application's protocol must guarantee it.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: valid memory; freedom from concurrent writes is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.inner.addr(), self.inner.len()) }
    }

    /// The region's bytes as a mutable slice.
    ///
    /// # Safety
    /// As [`as_slice`](Self::as_slice), and no peer may read it meanwhile either if torn data
    /// matters to the protocol.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: valid memory; &mut self excludes local aliases; peers per the contract.
        unsafe { std::slice::from_raw_parts_mut(self.inner.addr(), self.inner.len()) }
    }
}

/// Copies `len` bytes with volatile accesses, 8 bytes at a time where both sides are aligned.
///
/// # Safety
/// Both ranges are valid for `len` bytes and do not overlap.
unsafe fn volatile_copy(src: *const u8, dst: *mut u8, len: usize) {
    let mut i = 0;
    if (src as usize) % 8 == (dst as usize) % 8 {
        // SAFETY: every access is inside [0, len) of both ranges, per the contract.
        unsafe {
            while i < len && (src as usize + i) % 8 != 0 {
                dst.add(i).write_volatile(src.add(i).read_volatile());
                i += 1;
            }
            while i + 8 <= len {
                dst.add(i).cast::<u64>().write_volatile(src.add(i).cast::<u64>().read_volatile());
                i += 8;
            }
        }
    }
    while i < len {
        // SAFETY: i < len.
        unsafe { dst.add(i).write_volatile(src.add(i).read_volatile()) };
        i += 1;
    }
}

/// A range of a peer's (or our own) registered memory: address, length and rkey, as exchanged out
/// of band before RDMA Write, Read or atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    /// [`Error::OutOfBounds`] when it leaves this slice.
    pub fn slice(&self, offset: u64, len: u64) -> Result<RemoteSlice> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                Ok(RemoteSlice { addr: self.addr + offset, len, rkey: self.rkey })
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
        assert_eq!(r.slice(100, 0).unwrap().len, 0);
    }

    #[test]
    fn owned_buffers() {
        assert!(OwnedBuffer::zeroed(0).is_err());
        let b = OwnedBuffer::zeroed(10).unwrap();
        assert_eq!(b.len(), 10);
        assert_eq!(b.ptr.as_ptr() as usize % page_size(), 0);
        let v = OwnedBuffer::from(vec![1u8, 2, 3]);
        assert_eq!(v.len(), 3);
        let b = OwnedBuffer::from(vec![9u8; 5].into_boxed_slice());
        assert_eq!(b.len(), 5);
        let freed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f2 = freed.clone();
        let mut mem = vec![0u8; 4];
        // SAFETY: mem outlives the buffer; the closure only records the call.
        let raw = unsafe {
            OwnedBuffer::from_raw_parts(
                NonNull::new(mem.as_mut_ptr()).unwrap(),
                4,
                Some(Box::new(move |_, n| {
                    assert_eq!(n, 4);
                    f2.store(true, std::sync::atomic::Ordering::SeqCst)
                })),
            )
        };
        drop(raw);
        assert!(freed.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn volatile_copy_handles_alignments() {
        let src: Vec<u8> = (0..100).collect();
        for (s, d, n) in [(0, 0, 100), (1, 1, 50), (3, 5, 40), (0, 7, 93), (8, 8, 0)] {
            let mut dst = vec![0u8; 100];
            // SAFETY: in bounds of both vectors.
            unsafe { volatile_copy(src.as_ptr().add(s), dst.as_mut_ptr().add(d), n) };
            assert_eq!(&dst[d..d + n], &src[s..s + n]);
        }
    }

    #[test]
    fn access_flags_default_to_least_privilege_and_keep_unknown_bits() {
        assert_eq!(AccessFlags::default(), AccessFlags::LOCAL_WRITE);
        assert_eq!(AccessFlags::from_bits_retain(1 << 30).bits(), 1 << 30);
        assert!(AccessFlags::REMOTE_MODIFY.contains(AccessFlags::REMOTE_ATOMIC));
    }
}
