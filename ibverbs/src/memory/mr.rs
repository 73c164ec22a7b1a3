//! Memory regions: registered memory, local-only or exposed to remote peers.

use std::fmt;
use std::ops::{Bound, RangeBounds};
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::attr::OdpCaps;
use crate::device::Context;
use crate::error::{cvt_p, Error, Result};
use crate::memory::buffer::OwnedBuffer;
use crate::memory::racy::{ByteUnit, RacyBytes};
use crate::memory::remote::RemoteSlice;
use crate::pd::{PdInner, ProtectionDomain};

/// The ODP capabilities of the device `pd` belongs to.
pub(crate) fn odp_caps(pd: &ProtectionDomain, verb: &'static str) -> Result<OdpCaps> {
    let ctx = Context { inner: pd.inner.ctx.clone() };
    ctx.query_device_ex().map(|a| a.odp()).map_err(|e| match e {
        Error::Verb { source, .. } => Error::Verb { verb, source },
        e => e,
    })
}

/// Refuses an ODP registration on a device without ODP.
pub(crate) fn check_odp(pd: &ProtectionDomain, verb: &'static str) -> Result<()> {
    if odp_caps(pd, verb)?.supported() {
        Ok(())
    } else {
        Err(Error::Unsupported { verb, capability: "on-demand paging (IBV_ODP_SUPPORT)" })
    }
}

/// The capability [`ProtectionDomain::register_iova`] and
/// [`register_remote_iova`](ProtectionDomain::register_remote_iova) name in
/// [`Error::Unsupported`] for an IOVA other than the buffer's address on a device that ignores
/// it (siw).
pub const IOVA_ELSEWHERE: &str = "an IOVA other than the buffer's address (siw registers at the address)";

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
        /// Memory windows may be bound to the region (`IBV_ACCESS_MW_BIND`): a window can grant
        /// remote write or atomic access, so only a [`RemoteMemoryRegion`] takes this flag.
        const MW_BIND = ffi::ibv_access_flags::IBV_ACCESS_MW_BIND.0;
        /// Relaxed ordering of PCIe writes, where supported (optional: ignored elsewhere).
        const RELAXED_ORDERING = ffi::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
        /// On-demand paging (`IBV_ACCESS_ON_DEMAND`): the device faults pages in as it touches
        /// them instead of the registration pinning them all. The crate checks the device's
        /// ODP capability first and refuses with [`Error::Unsupported`] where it is missing.
        const ON_DEMAND = ffi::ibv_access_flags::IBV_ACCESS_ON_DEMAND.0;
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
    /// The only flags a local-only [`MemoryRegion`] takes: none of them lets anyone but this
    /// process change its bytes. Everything else (remote write and atomics, memory-window
    /// binding, flags this crate does not know) needs a [`RemoteMemoryRegion`].
    pub const LOCAL_ONLY: AccessFlags =
        AccessFlags::LOCAL_WRITE.union(AccessFlags::REMOTE_READ).union(AccessFlags::RELAXED_ORDERING);

    /// What a local-only [`MemoryRegion`] may be registered with: [`LOCAL_ONLY`](Self::LOCAL_ONLY)
    /// plus [`ON_DEMAND`](Self::ON_DEMAND), which changes how the memory is pinned, not who may
    /// write it.
    pub(crate) const LOCAL_REGISTRATION: AccessFlags = Self::LOCAL_ONLY.union(AccessFlags::ON_DEMAND);
}

/// What both region types share.
pub(crate) struct MrInner {
    raw: NonNull<ffi::ibv_mr>,
    // Deregistered (in Drop) before the buffer is freed: field order does not matter, Drop does it.
    buf: std::mem::ManuallyDrop<OwnedBuffer>,
    pub(crate) access: AccessFlags,
    /// The device address of the first byte minus its virtual address (wrapping): 0 unless
    /// registered with an IOVA (`ibv_reg_mr_iova2`), whose keys then take IOVAs locally too.
    iova_delta: u64,
    _pd: Arc<PdInner>,
    /// What an `ibv_rereg_mr` that failed half-way may have left the region using (buffers it
    /// was asked to map, protection domains it was asked to move to): kept until after
    /// `ibv_dereg_mr`. Empty (unallocated) unless such a failure happened.
    retained: Retained,
}

/// See [`MrInner::retained`].
#[derive(Default)]
struct Retained {
    bufs: Vec<OwnedBuffer>,
    pds: Vec<Arc<PdInner>>,
}

/// Which of `ibv_rereg_mr`'s failures left the region as it was: an input error libibverbs found,
/// a failed `madvise` of the new range, or a provider without the verb (`EOPNOTSUPP`/`ENOSYS`,
/// nothing done). On any other failure (`IBV_REREG_MR_ERR_CMD*`: "MR shouldn't be used") the
/// region may have the old or the new setting.
fn rereg_left_unchanged(ret: i32, err: &Error) -> bool {
    matches!(err, Error::Unsupported { .. })
        || ret == ffi::ibv_rereg_mr_err_code::IBV_REREG_MR_ERR_INPUT.0
        || ret == ffi::ibv_rereg_mr_err_code::IBV_REREG_MR_ERR_DONT_FORK_NEW.0
}

// SAFETY: the MR handle is an immutable kernel object; the buffer is Send (see OwnedBuffer).
unsafe impl Send for MrInner {}
// SAFETY: &MrInner only reads plain fields; access to the bytes is governed by the wrapper types.
unsafe impl Sync for MrInner {}

impl MrInner {
    /// Registers `buf` (`ibv_reg_mr`) with `access` as it is (no check of which region type may
    /// take it: the caller's).
    pub(crate) fn register_raw(
        pd: &ProtectionDomain,
        buf: OwnedBuffer,
        access: AccessFlags,
    ) -> Result<MrInner> {
        Self::register(pd, buf, access, None)
    }

    /// Registers `buf` (`ibv_reg_mr`, or `ibv_reg_mr_iova2` with an `iova`).
    fn register(
        pd: &ProtectionDomain,
        buf: OwnedBuffer,
        access: AccessFlags,
        iova: Option<u64>,
    ) -> Result<MrInner> {
        let verb = if iova.is_some() { "ibv_reg_mr_iova2" } else { "ibv_reg_mr" };
        if buf.len == 0 {
            return Err(Error::InvalidArgument { verb, reason: "zero-length memory region" });
        }
        let flags = libc::c_int::try_from(access.bits())
            .map_err(|_| Error::InvalidArgument { verb, reason: "unknown access flag bits" })?;
        if access.contains(AccessFlags::ON_DEMAND) {
            check_odp(pd, verb)?;
        }
        let addr = buf.ptr.as_ptr();
        if let Some(iova) = iova {
            if iova != addr as u64 && pd.context().is_siw() {
                return Err(Error::Unsupported { verb, capability: IOVA_ELSEWHERE });
            }
        }
        let raw = match iova {
            // SAFETY: the PD is valid; the buffer is valid for `len` bytes and stays allocated
            // (owned by the returned MrInner) until after ibv_dereg_mr in Drop.
            None => unsafe { ffi::ibv_reg_mr(pd.as_raw(), addr.cast(), buf.len, flags) },
            // SAFETY: as above; the IOVA only names the memory to the device.
            Some(iova) => unsafe {
                ffi::ibv_reg_mr_iova2(pd.as_raw(), addr.cast(), buf.len, iova, flags as u32)
            },
        };
        let on_demand = access.contains(AccessFlags::ON_DEMAND);
        let raw = cvt_p(verb, raw).map_err(|e| {
            if on_demand {
                e.or_unsupported("on-demand paging for this transport or access")
            } else {
                e
            }
        })?;
        let iova_delta = iova.map_or(0, |iova| iova.wrapping_sub(addr as u64));
        Ok(MrInner {
            raw,
            buf: std::mem::ManuallyDrop::new(buf),
            access,
            iova_delta,
            _pd: pd.inner.clone(),
            retained: Retained::default(),
        })
    }

    /// The address the device (local keys and peers alike) uses for the byte at `ptr` of this
    /// region: `ptr` itself unless the region was registered with an IOVA.
    #[inline]
    pub(crate) fn device_addr(&self, ptr: *const u8) -> u64 {
        (ptr as u64).wrapping_add(self.iova_delta)
    }

    /// `ibv_rereg_mr(IBV_REREG_MR_CHANGE_ACCESS)`. The caller holds the region exclusively (no
    /// post holds it). The memory stays owned and registered to this region whatever happens.
    fn rereg_access(&mut self, access: AccessFlags) -> Result<()> {
        const VERB: &str = "ibv_rereg_mr";
        let flags = libc::c_int::try_from(access.bits())
            .map_err(|_| Error::InvalidArgument { verb: VERB, reason: "unknown access flag bits" })?;
        if access.contains(AccessFlags::ON_DEMAND) != self.access.contains(AccessFlags::ON_DEMAND) {
            return Err(Error::InvalidArgument {
                verb: VERB,
                reason: "on-demand paging is chosen at registration; register the memory again",
            });
        }
        // SAFETY: a valid MR registered once; CHANGE_ACCESS alone keeps its PD and translation
        // (the pd, addr and length arguments are ignored). Exclusive access (&mut self) means no
        // posted request uses its keys meanwhile.
        let ret = unsafe {
            ffi::ibv_rereg_mr(
                self.raw.as_ptr(),
                ffi::ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0 as libc::c_int,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                flags,
            )
        };
        if ret == 0 {
            self.access = access;
            return Ok(());
        }
        let err = Error::last_os(VERB).or_unsupported("changing a memory region's access (ibv_rereg_mr)");
        // libibverbs reports any provider failure as IBV_REREG_MR_ERR_CMD, a provider without
        // the verb (EOPNOTSUPP, nothing done) included.
        if !rereg_left_unchanged(ret, &err) {
            // The region may now have either set of rights (the man page: "MR shouldn't be
            // used", or the new one is valid): both are allowed for this type, and its keys
            // still reach only its own memory. Remember the wider set.
            self.access |= access;
        }
        Err(err)
    }

    /// `ibv_rereg_mr(IBV_REREG_MR_CHANGE_PD)`: moves the region to `pd` (of the same context),
    /// keeping its memory and rights. The caller holds the region exclusively (no post holds it).
    fn rereg_pd(&mut self, pd: &ProtectionDomain) -> Result<()> {
        const VERB: &str = "ibv_rereg_mr";
        if !Arc::ptr_eq(&pd.inner.ctx, &self._pd.ctx) {
            return Err(Error::InvalidArgument {
                verb: VERB,
                reason: "the protection domain belongs to another device context",
            });
        }
        if Arc::ptr_eq(&pd.inner, &self._pd) {
            return Ok(());
        }
        crate::error::clear_errno();
        // SAFETY: a valid MR registered once and a valid PD of its context, which the region
        // keeps alive from here on whatever the outcome (below). CHANGE_PD alone keeps the
        // translation and the rights (addr, length and access are ignored). Exclusive access
        // (&mut self): no posted request uses the region's keys meanwhile.
        let ret = unsafe {
            ffi::ibv_rereg_mr(
                self.raw.as_ptr(),
                ffi::ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_PD.0 as libc::c_int,
                pd.as_raw(),
                std::ptr::null_mut(),
                0,
                0,
            )
        };
        if ret == 0 {
            self._pd = pd.inner.clone();
            return Ok(());
        }
        let err = Error::last_os(VERB).or_unsupported("moving a memory region to another PD (ibv_rereg_mr)");
        if !rereg_left_unchanged(ret, &err) {
            // It may be in either PD: both stay allocated until the region is deregistered.
            self.retained.pds.push(pd.inner.clone());
        }
        Err(err)
    }

    /// `ibv_rereg_mr(IBV_REREG_MR_CHANGE_TRANSLATION)`: the region maps `buf` instead of its
    /// memory, which is returned. The caller holds the region exclusively (no post holds it).
    #[allow(clippy::result_large_err)] // the buffer comes back whole, as bind_window's window
    fn rereg_buffer(
        &mut self,
        buf: OwnedBuffer,
    ) -> std::result::Result<OwnedBuffer, (Option<OwnedBuffer>, Error)> {
        const VERB: &str = "ibv_rereg_mr";
        if buf.len == 0 {
            return Err((
                Some(buf),
                Error::InvalidArgument { verb: VERB, reason: "zero-length memory region" },
            ));
        }
        crate::error::clear_errno();
        // SAFETY: a valid MR registered once; `buf` is valid for `len` bytes and, whatever the
        // outcome, stays allocated until the device can no longer reach it (owned by the region,
        // or handed back only when the verb left the region as it was). CHANGE_TRANSLATION alone
        // keeps the PD and the rights. Exclusive access (&mut self): no posted request uses the
        // region's keys meanwhile.
        let ret = unsafe {
            ffi::ibv_rereg_mr(
                self.raw.as_ptr(),
                ffi::ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_TRANSLATION.0 as libc::c_int,
                std::ptr::null_mut(),
                buf.ptr.as_ptr().cast(),
                buf.len,
                0,
            )
        };
        // IBV_REREG_MR_ERR_DO_FORK_OLD: the region maps the new range; only the old range's
        // fork state could not be restored.
        let done = ret == 0 || ret == ffi::ibv_rereg_mr_err_code::IBV_REREG_MR_ERR_DO_FORK_OLD.0;
        if done {
            // The device no longer maps the old memory: it is the caller's again. The new
            // translation's device address is the buffer's own.
            // (With IBV_REREG_MR_ERR_DO_FORK_OLD the old range stays excluded from fork
            // children, as registered memory is: harmless to the parent.)
            let old = std::mem::replace(&mut *self.buf, buf);
            self.iova_delta = 0;
            return Ok(old);
        }
        let err = Error::last_os(VERB).or_unsupported("changing a memory region's memory (ibv_rereg_mr)");
        if rereg_left_unchanged(ret, &err) {
            return Err((Some(buf), err));
        }
        // It may map either range: both stay allocated until the region is deregistered, and
        // the region keeps its old memory as its bytes.
        self.retained.bufs.push(buf);
        Err((None, err))
    }

    pub(crate) fn addr(&self) -> *mut u8 {
        self.buf.ptr.as_ptr()
    }
    pub(crate) fn raw_ptr(&self) -> *mut ffi::ibv_mr {
        self.raw.as_ptr()
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
        check_range(verb, range, self.len())
    }

    pub(crate) fn access(&self) -> AccessFlags {
        self.access
    }

    pub(crate) fn pd(&self) -> &Arc<PdInner> {
        &self._pd
    }

    /// Whether the region belongs to protection domain `pd`.
    pub(crate) fn in_pd(&self, pd: &Arc<PdInner>) -> bool {
        Arc::ptr_eq(&self._pd, pd)
    }

    fn remote(&self) -> RemoteSlice {
        RemoteSlice { addr: self.device_addr(self.addr()), len: self.len() as u64, rkey: self.rkey() }
    }
}

/// Checks that `range` lies in `0..size`; returns (offset, len).
pub(crate) fn check_range(
    verb: &'static str,
    range: impl RangeBounds<usize>,
    size: usize,
) -> Result<(usize, usize)> {
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

impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: the MR was registered once and is deregistered once; no posted work request
        // references it (a posted request holds the region itself, so it cannot be dropping).
        let ret = unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
        if ret == 0 {
            // SAFETY: the device no longer has the memory registered; dropped exactly once.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.buf) };
        } else {
            // As `buf`: memory the device may still reach is never freed.
            std::mem::forget(std::mem::take(&mut self.retained.bufs));
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
/// copies in and out with atomic accesses ([`read`](Self::read), [`write`](Self::write),
/// [`load_u64`](Self::load_u64), [`byte`](Self::byte)). [`as_slice`](Self::as_slice) is
/// `unsafe` and its contract is that the application's protocol keeps peers away meanwhile.
/// Share it with `Arc`.
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
    /// [`Error::InvalidArgument`] for an empty buffer or for any flag outside
    /// [`AccessFlags::LOCAL_ONLY`] and [`AccessFlags::ON_DEMAND`] (remote write, atomics,
    /// memory-window binding: use
    /// [`register_remote`](Self::register_remote)); [`Error::Unsupported`] for
    /// [`AccessFlags::ON_DEMAND`] on a device (or transport) without on-demand paging;
    /// [`Error::Verb`] from `ibv_reg_mr()`.
    #[doc(alias = "ibv_reg_mr")]
    pub fn register(&self, buf: impl Into<OwnedBuffer>, access: AccessFlags) -> Result<MemoryRegion> {
        if !AccessFlags::LOCAL_REGISTRATION.contains(access) {
            return Err(Error::InvalidArgument {
                verb: "ibv_reg_mr",
                reason:
                    "a local-only MemoryRegion takes only LOCAL_WRITE, REMOTE_READ and RELAXED_ORDERING; \
                         remote write, atomics and memory-window binding need register_remote",
            });
        }
        Ok(MemoryRegion { inner: Box::new(MrInner::register(self, buf.into(), access, None)?) })
    }

    /// Registers memory the caller owns as a local-only region whose first byte the device
    /// knows as `iova` (`ibv_reg_mr_iova2()`): peers address it from `iova`, and the crate's
    /// scatter/gather entries over it carry IOVAs too. [`remote`](MemoryRegion::remote) and
    /// [`iova`](MemoryRegion::iova) report it.
    ///
    /// # Errors
    /// As [`register`](Self::register); `EINVAL` or `EFAULT` from the provider for an IOVA it
    /// cannot map (e.g. not page-aligned like the buffer); [`Error::Unsupported`] (capability
    /// [`IOVA_ELSEWHERE`]) for an IOVA other than the buffer's address on siw, which registers
    /// every region at its virtual address and ignores the IOVA (Linux 6.1 `siw_reg_user_mr`),
    /// so that peers addressing it by IOVA would be refused.
    #[doc(alias = "ibv_reg_mr_iova2")]
    #[doc(alias = "ibv_reg_mr_iova")]
    pub fn register_iova(
        &self,
        buf: impl Into<OwnedBuffer>,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        if !AccessFlags::LOCAL_REGISTRATION.contains(access) {
            return Err(Error::InvalidArgument {
                verb: "ibv_reg_mr_iova2",
                reason:
                    "a local-only MemoryRegion takes only LOCAL_WRITE, REMOTE_READ, RELAXED_ORDERING and \
                         ON_DEMAND; use register_remote_iova",
            });
        }
        Ok(MemoryRegion { inner: Box::new(MrInner::register(self, buf.into(), access, Some(iova))?) })
    }

    /// Registers memory the caller owns as a region peers may modify, addressed from `iova`
    /// (`ibv_reg_mr_iova2()`); local write access is always added.
    ///
    /// # Errors
    /// As [`register_remote`](Self::register_remote), with the IOVA errors of
    /// [`register_iova`](Self::register_iova).
    #[doc(alias = "ibv_reg_mr_iova2")]
    pub fn register_remote_iova(
        &self,
        buf: impl Into<OwnedBuffer>,
        iova: u64,
        access: AccessFlags,
    ) -> Result<RemoteMemoryRegion> {
        let access = access | AccessFlags::LOCAL_WRITE;
        Ok(RemoteMemoryRegion { inner: Box::new(MrInner::register(self, buf.into(), access, Some(iova))?) })
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them with `access` (which may
    /// include remote write and atomic rights; local write is always added).
    ///
    /// # Errors
    /// As [`register_remote`](Self::register_remote).
    #[doc(alias = "ibv_reg_mr")]
    pub fn allocate_remote(&self, len: usize, access: AccessFlags) -> Result<RemoteMemoryRegion> {
        self.register_remote(OwnedBuffer::zeroed(len)?, access)
    }

    /// Registers memory the caller owns as a region peers may modify (`ibv_reg_mr()`); local
    /// write access is always added.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty buffer; [`Error::Unsupported`] for
    /// [`AccessFlags::ON_DEMAND`] on a device (or transport) without on-demand paging;
    /// [`Error::Verb`] from `ibv_reg_mr()`.
    #[doc(alias = "ibv_reg_mr")]
    pub fn register_remote(
        &self,
        buf: impl Into<OwnedBuffer>,
        access: AccessFlags,
    ) -> Result<RemoteMemoryRegion> {
        let access = access | AccessFlags::LOCAL_WRITE;
        Ok(RemoteMemoryRegion { inner: Box::new(MrInner::register(self, buf.into(), access, None)?) })
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
        /// The address the device and peers use for the region's first byte: its virtual
        /// address, or the IOVA it was registered with
        /// ([`register_iova`](ProtectionDomain::register_iova)).
        pub fn iova(&self) -> u64 {
            self.inner.device_addr(self.inner.addr())
        }
        /// A descriptor of the whole region for a peer: address, length and rkey.
        pub fn remote(&self) -> RemoteSlice {
            self.inner.remote()
        }
        /// The raw `struct ibv_mr *`; valid while this region lives. What `ffi` calls may not do
        /// with it: see the crate's *Safety model* (raw handles).
        pub fn as_raw(&self) -> *mut ffi::ibv_mr {
            self.inner.raw.as_ptr()
        }
    };
}

impl MemoryRegion {
    common_region_methods!();

    /// Changes the region's access rights in place (`ibv_rereg_mr()` with
    /// `IBV_REREG_MR_CHANGE_ACCESS`), keeping its memory, length and protection domain. `&mut
    /// self` proves that no post holds the region meanwhile.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a flag outside [`AccessFlags::LOCAL_ONLY`] and
    /// [`AccessFlags::ON_DEMAND`], or for adding or
    /// removing [`AccessFlags::ON_DEMAND`]; [`Error::Unsupported`] where the provider does not
    /// implement it (rxe); [`Error::Verb`] otherwise. On error the region stays usable and
    /// [`access`](Self::access) reports every right it may now have.
    #[doc(alias = "ibv_rereg_mr")]
    pub fn rereg_access(&mut self, access: AccessFlags) -> Result<()> {
        if !AccessFlags::LOCAL_REGISTRATION.contains(access) {
            return Err(Error::InvalidArgument {
                verb: "ibv_rereg_mr",
                reason:
                    "a local-only MemoryRegion takes only LOCAL_WRITE, REMOTE_READ, RELAXED_ORDERING and \
                         ON_DEMAND",
            });
        }
        self.inner.rereg_access(access)
    }

    /// Moves the region to protection domain `pd` of the same context (`ibv_rereg_mr()` with
    /// `IBV_REREG_MR_CHANGE_PD`), keeping its memory and rights; its keys may change. `&mut self`
    /// proves that no post holds the region meanwhile; the region keeps `pd` alive from then on
    /// (and the old one no longer).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a PD of another context; [`Error::Unsupported`] where the
    /// provider does not implement the verb (rxe, siw); [`Error::Verb`] otherwise. After a
    /// failure the provider reports as `IBV_REREG_MR_ERR_CMD` the region may be in either PD:
    /// it keeps both alive until it is dropped, and stays safe to use (a post through the wrong
    /// PD completes with a protection error).
    #[doc(alias = "ibv_rereg_mr")]
    #[doc(alias = "IBV_REREG_MR_CHANGE_PD")]
    pub fn rereg_pd(&mut self, pd: &ProtectionDomain) -> Result<()> {
        self.inner.rereg_pd(pd)
    }

    /// Makes the region map `buf` instead of its memory (`ibv_rereg_mr()` with
    /// `IBV_REREG_MR_CHANGE_TRANSLATION`), keeping its PD and rights, and hands back the memory
    /// it had: the device no longer reaches it. The region's length and address become `buf`'s
    /// (an IOVA it was registered with is dropped); its keys may change. `&mut self` proves that
    /// no post holds the region meanwhile.
    ///
    /// # Errors
    /// The error with `Some(buf)` when the region was left as it was: [`Error::InvalidArgument`]
    /// for an empty buffer, [`Error::Unsupported`] where the provider does not implement the
    /// verb (rxe, siw), [`Error::Verb`] for an input error libibverbs found. With `None` after a
    /// failure the provider reports as `IBV_REREG_MR_ERR_CMD`: the region may map either
    /// memory, so it keeps `buf` until it is dropped, and its bytes stay its old memory.
    #[doc(alias = "ibv_rereg_mr")]
    #[doc(alias = "IBV_REREG_MR_CHANGE_TRANSLATION")]
    #[allow(clippy::result_large_err)] // the buffer comes back whole, as bind_window's window
    pub fn rereg_buffer(
        &mut self,
        buf: impl Into<OwnedBuffer>,
    ) -> std::result::Result<OwnedBuffer, (Option<OwnedBuffer>, Error)> {
        self.inner.rereg_buffer(buf.into())
    }

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

    /// Changes the region's access rights in place (`ibv_rereg_mr()` with
    /// `IBV_REREG_MR_CHANGE_ACCESS`); local write access is always kept. `&mut self` (no other
    /// `Arc` of it, so no post holds it) proves nothing uses its keys meanwhile; a peer that
    /// still has its rkey is refused once the new rights exclude it.
    ///
    /// # Errors
    /// As [`MemoryRegion::rereg_access`], without the restriction to local-only flags.
    #[doc(alias = "ibv_rereg_mr")]
    pub fn rereg_access(&mut self, access: AccessFlags) -> Result<()> {
        self.inner.rereg_access(access | AccessFlags::LOCAL_WRITE)
    }

    /// Moves the region to protection domain `pd` of the same context (`ibv_rereg_mr()` with
    /// `IBV_REREG_MR_CHANGE_PD`), keeping its memory and rights; its keys may change. `&mut self`
    /// proves that no other `Arc` of it, so no post holds it; the region keeps `pd` alive from then on
    /// (and the old one no longer).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a PD of another context; [`Error::Unsupported`] where the
    /// provider does not implement the verb (rxe, siw); [`Error::Verb`] otherwise. After a
    /// failure the provider reports as `IBV_REREG_MR_ERR_CMD` the region may be in either PD:
    /// it keeps both alive until it is dropped, and stays safe to use (a post through the wrong
    /// PD completes with a protection error).
    #[doc(alias = "ibv_rereg_mr")]
    #[doc(alias = "IBV_REREG_MR_CHANGE_PD")]
    pub fn rereg_pd(&mut self, pd: &ProtectionDomain) -> Result<()> {
        self.inner.rereg_pd(pd)
    }

    /// Makes the region map `buf` instead of its memory (`ibv_rereg_mr()` with
    /// `IBV_REREG_MR_CHANGE_TRANSLATION`), keeping its PD and rights, and hands back the memory
    /// it had: the device no longer reaches it. The region's length and address become `buf`'s
    /// (an IOVA it was registered with is dropped); its keys may change. `&mut self` (no other `Arc`
    /// of it) proves that no post holds the region meanwhile; a peer that still has its old rkey
    /// reaches the new memory or is refused, never the old memory.
    ///
    /// # Errors
    /// The error with `Some(buf)` when the region was left as it was: [`Error::InvalidArgument`]
    /// for an empty buffer, [`Error::Unsupported`] where the provider does not implement the
    /// verb (rxe, siw), [`Error::Verb`] for an input error libibverbs found. With `None` after a
    /// failure the provider reports as `IBV_REREG_MR_ERR_CMD`: the region may map either
    /// memory, so it keeps `buf` until it is dropped, and its bytes stay its old memory.
    #[doc(alias = "ibv_rereg_mr")]
    #[doc(alias = "IBV_REREG_MR_CHANGE_TRANSLATION")]
    #[allow(clippy::result_large_err)] // the buffer comes back whole, as bind_window's window
    pub fn rereg_buffer(
        &mut self,
        buf: impl Into<OwnedBuffer>,
    ) -> std::result::Result<OwnedBuffer, (Option<OwnedBuffer>, Error)> {
        self.inner.rereg_buffer(buf.into())
    }

    fn racy(&self) -> RacyBytes {
        // SAFETY: the region's memory is valid for len bytes while self lives; this process
        // accesses it only through RacyBytes (or the unsafe slices, whose contract excludes
        // concurrent writers).
        unsafe { RacyBytes::new(self.inner.addr(), self.inner.len()) }
    }

    /// Copies `dst.len()` bytes at `offset` out of the region. A peer, the device or another
    /// thread may be writing them meanwhile: the copy is then torn, never undefined behaviour
    /// (every access is atomic).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let (off, _) = self.inner.range("read", offset..offset.saturating_add(dst.len()))?;
        self.racy().read(off, dst);
        Ok(())
    }

    /// Copies `src` into the region at `offset` (atomic accesses: other threads may read or
    /// write the region at the same time).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the region.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let (off, _) = self.inner.range("write", offset..offset.saturating_add(src.len()))?;
        self.racy().write(off, src);
        Ok(())
    }

    /// Fills the region with `byte`.
    pub fn fill(&self, byte: u8) {
        self.racy().fill(byte);
    }

    /// Copies the whole region into a new `Vec`.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.racy().read(0, &mut v);
        v
    }

    /// Reads the native-endian `u64` at `offset` (8-byte aligned, as atomics require) in one
    /// atomic access: the value a peer's atomic operation left there.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or [`Error::InvalidArgument`] for a misaligned address.
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        let (off, _) = self.inner.range("load_u64", offset..offset.saturating_add(8))?;
        self.racy()
            .load_u64(off)
            .ok_or(Error::InvalidArgument { verb: "load_u64", reason: "address not 8-byte aligned" })
    }

    /// The byte at `offset`, its bounds checked once here: each [`RemoteByte::load`] and
    /// [`RemoteByte::store`] is then one atomic access with no check. For the flag a peer's
    /// RDMA Write sets, polled in a spin loop (the last byte of a message, as `ib_write_lat`
    /// polls it), where [`read`](Self::read) would check the range and copy on every turn.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when `offset` is not inside the region.
    pub fn byte(&self, offset: usize) -> Result<RemoteByte<'_>> {
        let (off, _) = self.inner.range("byte", offset..offset.saturating_add(1))?;
        Ok(RemoteByte { unit: self.racy().byte_unit(off), offset, _region: std::marker::PhantomData })
    }

    /// The region's bytes as a slice.
    ///
    /// # Safety
    /// While the slice lives, nothing may write the region: no peer (the application's protocol
    /// must keep them away), no local RDMA Read, atomic or receive into it may be outstanding,
    /// and no thread may call [`write`](Self::write) or [`fill`](Self::fill) on it, or
    /// [`RemoteByte::store`] on one of its bytes.
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

/// One byte of a [`RemoteMemoryRegion`], from [`RemoteMemoryRegion::byte`]: bounds-checked
/// once, then loaded and stored with one atomic access each (relaxed, of the size every other
/// access to that byte uses), so a peer's write or another thread's store is never undefined
/// behaviour.
///
/// ```no_run
/// # fn demo(region: &ibverbs::RemoteMemoryRegion, n: usize) -> ibverbs::Result<()> {
/// // Wait for the peer's RDMA Write whose last byte carries the counter 7.
/// let flag = region.byte(n - 1)?;
/// while flag.load() != 7 {
///     std::hint::spin_loop();
/// }
/// # Ok(()) }
/// ```
///
/// It borrows the region: the region cannot be dropped (deregistered and freed) while it lives.
///
/// ```compile_fail,E0505
/// fn demo(region: ibverbs::RemoteMemoryRegion) -> ibverbs::Result<()> {
///     let flag = region.byte(0)?;
///     drop(region); // moved out while `flag` borrows it
///     flag.load();
///     Ok(())
/// }
/// ```
#[derive(Clone, Copy)]
pub struct RemoteByte<'a> {
    unit: ByteUnit,
    offset: usize,
    _region: std::marker::PhantomData<&'a RemoteMemoryRegion>,
}

// SAFETY: it only reaches the byte through atomic accesses, and borrows the region (which is
// Sync) for as long as it lives.
unsafe impl Send for RemoteByte<'_> {}
// SAFETY: as above; `load` and `store` take `&self` and are atomic.
unsafe impl Sync for RemoteByte<'_> {}

impl RemoteByte<'_> {
    /// The byte's value now (one relaxed atomic load).
    #[inline]
    pub fn load(&self) -> u8 {
        // SAFETY: the unit lies in the borrowed region, alive and registered while 'a lasts, and
        // accessed only through RacyBytes-sized atomics (or the unsafe slices' contract).
        unsafe { self.unit.load() }
    }

    /// Sets the byte to `value`, leaving the bytes around it as they are (an atomic
    /// compare-and-swap of the 8-byte word holding it, or one byte store at the region's ends).
    #[inline]
    pub fn store(&self, value: u8) {
        // SAFETY: as in `load`.
        unsafe { self.unit.store(value) }
    }

    /// Its offset in the region.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl fmt::Debug for RemoteByte<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteByte").field("offset", &self.offset).field("value", &self.load()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_default_to_least_privilege_and_keep_unknown_bits() {
        assert_eq!(AccessFlags::default(), AccessFlags::LOCAL_WRITE);
        assert_eq!(AccessFlags::from_bits_retain(1 << 30).bits(), 1 << 30);
        assert!(AccessFlags::REMOTE_MODIFY.contains(AccessFlags::REMOTE_ATOMIC));
        // Regression (soundness hole 9): MW_BIND on a local-only region let a window grant a peer
        // write access behind a live `&[u8]`.
        assert!(!AccessFlags::LOCAL_ONLY.contains(AccessFlags::MW_BIND));
        assert!(!AccessFlags::LOCAL_ONLY.intersects(AccessFlags::REMOTE_MODIFY));
        assert!(!AccessFlags::LOCAL_ONLY.contains(AccessFlags::from_bits_retain(1 << 30)));
        // ON_DEMAND is accepted on a local-only region but is no part of LOCAL_ONLY, a value
        // every device takes.
        assert!(!AccessFlags::LOCAL_ONLY.contains(AccessFlags::ON_DEMAND));
        assert!(
            !AccessFlags::LOCAL_REGISTRATION.intersects(AccessFlags::REMOTE_MODIFY | AccessFlags::MW_BIND)
        );
    }
}
