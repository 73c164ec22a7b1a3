//! Memory windows (`ibv_alloc_mw`, `ibv_bind_mw`, `IBV_WR_BIND_MW`, `IBV_WR_LOCAL_INV`) and the
//! regions exposed only through them ([`WindowedRegion`], [`ExposedRegion`]). Binding goes through
//! a queue pair: type 1 binds in `queue/qp/window.rs`, type 2 binds and invalidations as send
//! requests (`post/wr.rs`).
//!
//! The soundness argument (why [`WindowedRegion`] may hand out `&[u8]` of memory peers wrote) is in
//! the crate's *Safety model*, section *Memory exposed through windows*. In short: every window
//! that may be bound to a region, and every posted request that may bind one, holds an `Arc` of
//! the region's registration; a window gives its `Arc` up only when it is proven unbound (its
//! invalidation completed, or it was deallocated). [`ExposedRegion::into_private`] succeeds only
//! when it holds the last `Arc`, so no window can be bound to the memory then, and the region
//! itself grants peers nothing.

use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::RangeBounds;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::device::Context;
use crate::error::{cvt_p, Error, Result};
use crate::memory::buffer::OwnedBuffer;
use crate::memory::hold::QpHoldToken;
use crate::memory::mr::{check_range, AccessFlags, MrInner};
use crate::memory::racy::RacyBytes;
use crate::memory::remote::RemoteSlice;
use crate::pd::{PdInner, ProtectionDomain};

/// The type of a memory window (`enum ibv_mw_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[doc(alias = "ibv_mw_type")]
pub enum MwType {
    /// Type 1 (`IBV_MW_TYPE_1`): bound with `ibv_bind_mw()` ([`QueuePair::bind_mw`]), usable
    /// through any QP of its protection domain; unbound by a zero-length bind
    /// ([`QueuePair::unbind_mw`]) or deallocation. Needs `IBV_DEVICE_MEM_WINDOW`.
    ///
    /// [`QueuePair::bind_mw`]: crate::QueuePair::bind_mw
    /// [`QueuePair::unbind_mw`]: crate::QueuePair::unbind_mw
    Type1,
    /// Type 2 (`IBV_MW_TYPE_2`): bound by a work request ([`SendRequest::bind_window`]) to one
    /// QP, usable only through it; invalidated locally ([`SendRequest::local_invalidate`]), by
    /// the peer (a Send with Invalidate), or by deallocation. Needs `IBV_DEVICE_MEM_WINDOW_TYPE_2A`
    /// or `_2B`.
    ///
    /// [`SendRequest::bind_window`]: crate::SendRequest::bind_window
    /// [`SendRequest::local_invalidate`]: crate::SendRequest::local_invalidate
    Type2,
}

impl MwType {
    fn raw(self) -> ffi::ibv_mw_type {
        match self {
            MwType::Type1 => ffi::ibv_mw_type::IBV_MW_TYPE_1,
            MwType::Type2 => ffi::ibv_mw_type::IBV_MW_TYPE_2,
        }
    }

    /// The capability (`device_cap_flags`) this type needs, or `None` when `flags` has it.
    pub(crate) fn missing_capability(self, flags: u32) -> Option<&'static str> {
        use ffi::ibv_device_cap_flags as F;
        match self {
            MwType::Type1 if flags & F::IBV_DEVICE_MEM_WINDOW.0 == 0 => Some("IBV_DEVICE_MEM_WINDOW"),
            MwType::Type2
                if flags & (F::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0 | F::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0) == 0 =>
            {
                Some("IBV_DEVICE_MEM_WINDOW_TYPE_2A or IBV_DEVICE_MEM_WINDOW_TYPE_2B")
            }
            _ => None,
        }
    }
}

/// Access rights a window may grant: remote read, write and atomics, nothing else.
pub const WINDOW_ACCESS: AccessFlags =
    AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE).union(AccessFlags::REMOTE_ATOMIC);

/// The most binds one type 2 window takes: its rkey's 8-bit key is incremented per bind, and is
/// never repeated, so that no invalidation of an earlier binding can be mistaken for one of the
/// current binding ([`BoundWindow::remote_invalidated`]). Allocate a new window after that.
pub const MAX_BINDS: u16 = 255;

/// Checks a bind of `range` with `access` into a region of `mr_len` bytes registered with
/// `mr_access`; returns (offset, len). Pure logic (tested under Miri).
pub(crate) fn check_bind(
    verb: &'static str,
    mr_len: usize,
    mr_access: AccessFlags,
    range: impl RangeBounds<usize>,
    access: AccessFlags,
) -> Result<(usize, usize)> {
    let bad = |reason| Err(Error::InvalidArgument { verb, reason });
    if !WINDOW_ACCESS.contains(access) {
        return bad("a window grants only REMOTE_READ, REMOTE_WRITE and REMOTE_ATOMIC");
    }
    if !mr_access.contains(AccessFlags::MW_BIND) {
        return bad("the memory region was not registered with MW_BIND");
    }
    if access.intersects(AccessFlags::REMOTE_MODIFY) && !mr_access.contains(AccessFlags::LOCAL_WRITE) {
        return bad("a window granting remote write or atomics needs a region with LOCAL_WRITE");
    }
    let (off, len) = check_range(verb, range, mr_len)?;
    if len == 0 {
        return bad("an empty window: unbind instead");
    }
    Ok((off, len))
}

/// Whether a type 2 window that was bound `binds` times may be bound again (see [`MAX_BINDS`]).
pub(crate) fn may_bind_again(binds: u16) -> bool {
    binds < MAX_BINDS
}

/// An allocated memory window that is bound to nothing (`struct ibv_mw`).
///
/// From [`ProtectionDomain::alloc_mw`]. Binding moves it into a request
/// ([`SendRequest::bind_window`](crate::SendRequest::bind_window),
/// [`QueuePair::bind_mw`](crate::QueuePair::bind_mw)) whose completion hands back a
/// [`BoundWindow`]. Dropping it deallocates it (`ibv_dealloc_mw()`).
#[doc(alias = "ibv_mw", alias = "ibv_dealloc_mw")]
pub struct MemoryWindow {
    raw: NonNull<ffi::ibv_mw>,
    ty: MwType,
    binds: u16,
    pd: Arc<PdInner>,
    /// Held while a type 1 bind's `ibv_bind_mw()` runs: mlx5 and rxe write `mw->rkey` after the
    /// request is posted, when its completion may already have handed the window to a poller
    /// on another thread. Every read of `mw->rkey`, the next bind and the deallocation wait for
    /// it ([`settle`](Self::settle), [`in_provider`](Self::in_provider)).
    busy: Arc<ProviderGate>,
}

// SAFETY: an MW is a kernel object handle; libibverbs allows using it from any thread. Its one
// mutable field (`rkey`) is written only through `&mut`/owned access (binding consumes the
// window), or by the provider during a type 1 bind's `ibv_bind_mw()`, which `busy` covers (one
// such call at a time: the next bind's `in_provider` waits for the last one to return).
unsafe impl Send for MemoryWindow {}
// SAFETY: `&MemoryWindow` only reads plain fields.
unsafe impl Sync for MemoryWindow {}

impl fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow").field("type", &self.ty).field("rkey", &self.rkey()).finish()
    }
}

impl ProtectionDomain {
    /// Allocates a memory window of type `ty` (`ibv_alloc_mw()`), after checking the device's
    /// capability flags (`ibv_query_device()`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the missing `device_cap_flags` bit; [`Error::Verb`] from
    /// `ibv_query_device()` or `ibv_alloc_mw()`.
    #[doc(alias = "ibv_alloc_mw")]
    pub fn alloc_mw(&self, ty: MwType) -> Result<MemoryWindow> {
        let attr = self.context().query_device()?;
        if let Some(capability) = ty.missing_capability(attr.0.device_cap_flags) {
            return Err(Error::Unsupported { verb: "ibv_alloc_mw", capability });
        }
        // SAFETY: valid PD; the returned MW is deallocated once, in Drop.
        let raw = unsafe { ffi::ibv_alloc_mw(self.as_raw(), ty.raw()) };
        let raw = cvt_p("ibv_alloc_mw", raw)?;
        Ok(MemoryWindow {
            raw,
            ty,
            binds: 0,
            pd: self.inner.clone(),
            busy: Arc::new(ProviderGate::default()),
        })
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them to be exposed only through
    /// memory windows: `access` may hold [`AccessFlags::LOCAL_WRITE`] and
    /// [`AccessFlags::RELAXED_ORDERING`]; [`AccessFlags::MW_BIND`] is always added, and no remote
    /// right of the region's own is (its rkey grants nothing).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for other flags or a length of 0; [`Error::Verb`] from
    /// `ibv_reg_mr()`.
    #[doc(alias = "ibv_reg_mr")]
    pub fn allocate_windowed(&self, len: usize, access: AccessFlags) -> Result<WindowedRegion> {
        self.register_windowed(OwnedBuffer::zeroed(len)?, access)
    }

    /// Registers memory the caller owns to be exposed only through memory windows; see
    /// [`allocate_windowed`](Self::allocate_windowed).
    ///
    /// # Errors
    /// As [`allocate_windowed`](Self::allocate_windowed).
    #[doc(alias = "ibv_reg_mr")]
    pub fn register_windowed(
        &self,
        buf: impl Into<OwnedBuffer>,
        access: AccessFlags,
    ) -> Result<WindowedRegion> {
        let allowed = AccessFlags::LOCAL_WRITE | AccessFlags::RELAXED_ORDERING | AccessFlags::MW_BIND;
        if !allowed.contains(access) {
            return Err(Error::InvalidArgument {
                verb: "ibv_reg_mr",
                reason: "a windowed region takes only LOCAL_WRITE, RELAXED_ORDERING and MW_BIND: \
                         peers reach it through windows only",
            });
        }
        let inner = MrInner::register_raw(self, buf.into(), access | AccessFlags::MW_BIND)?;
        Ok(WindowedRegion { inner: Box::new(inner) })
    }
}

impl MemoryWindow {
    /// The window's type.
    pub fn mw_type(&self) -> MwType {
        self.ty
    }

    /// The window's current rkey (`mw->rkey`; unbound: it grants nothing).
    pub fn rkey(&self) -> u32 {
        self.settle();
        // SAFETY: valid MW while self lives; rkey is written only by a bind, which owns the
        // window, or by the provider inside a type 1 bind's ibv_bind_mw, which settle waited for.
        unsafe { (*self.raw.as_ptr()).rkey }
    }

    /// Waits until no `ibv_bind_mw()` of this window is running (a type 1 bind's poster may
    /// still be in the provider, about to write `mw->rkey`, when the completion already handed
    /// the window back). Bounded by that call: a few microseconds.
    fn settle(&self) {
        self.busy.settle();
    }

    /// Marks a type 1 bind's `ibv_bind_mw()` as running until the returned guard is dropped
    /// (right after the call returns). Waits first for an earlier bind's call to return: its
    /// completion can hand the window on (to another thread, which binds or unbinds it again)
    /// while its poster is still in the provider, about to write `mw->rkey`, which the next
    /// `ibv_bind_mw()` reads.
    pub(crate) fn in_provider(&self) -> InProvider {
        ProviderGate::enter(&self.busy)
    }

    /// How many times it was bound (at most [`MAX_BINDS`] for a type 2 window).
    pub fn binds(&self) -> u16 {
        self.binds
    }

    /// The raw `struct ibv_mw *`; valid while this window lives. Binding it through `ffi`
    /// (outside the crate's tracking) would expose a region the crate believes private: raw
    /// code may read it only.
    pub fn as_raw(&self) -> *mut ffi::ibv_mw {
        self.raw.as_ptr()
    }

    /// The provider and kernel bugs of the window's device ([`crate::quirks`]).
    pub(crate) fn quirks(&self) -> crate::quirks::Quirks {
        Context { inner: self.pd.ctx.clone() }.quirks()
    }

    pub(crate) fn in_pd(&self, pd: &Arc<PdInner>) -> bool {
        Arc::ptr_eq(&self.pd, pd)
    }

    /// Deallocates the window (`ibv_dealloc_mw()`) and returns its result (0 on success); on
    /// failure it is leaked (with its PD).
    fn release(self) -> i32 {
        self.settle();
        let me = ManuallyDrop::new(self);
        // SAFETY: allocated once, deallocated once (Drop does not run: ManuallyDrop).
        let ret = unsafe { ffi::ibv_dealloc_mw(me.raw.as_ptr()) };
        // SAFETY: read once out of the ManuallyDrop, which is not used again.
        drop(unsafe { std::ptr::read(&me.busy) });
        if ret == 0 {
            // SAFETY: read once out of the ManuallyDrop, which is not used again.
            drop(unsafe { std::ptr::read(&me.pd) });
        }
        ret
    }

    /// Prepares a bind: checks `range` and `access` against `region`, moves the rkey to its next
    /// key (`ibv_inc_rkey()`) and returns the window as bound (not yet posted).
    #[allow(clippy::result_large_err)] // the window comes back
    pub(crate) fn prepare_bind(
        mut self,
        verb: &'static str,
        region: &ExposedRegion,
        range: impl RangeBounds<usize>,
        access: AccessFlags,
    ) -> std::result::Result<BoundWindow, (MemoryWindow, Error)> {
        if !region.mr.in_pd(&self.pd) {
            let e = Error::InvalidArgument {
                verb,
                reason: "the memory region belongs to another protection domain than the window",
            };
            return Err((self, e));
        }
        let (off, len) = match check_bind(verb, region.mr.len(), region.mr.access, range, access) {
            Ok(r) => r,
            Err(e) => return Err((self, e)),
        };
        if self.ty == MwType::Type2 && !may_bind_again(self.binds) {
            let e =
                Error::InvalidArgument { verb, reason: "window bound MAX_BINDS times: allocate a new one" };
            return Err((self, e));
        }
        // Type 1: ibv_bind_mw computes the next rkey itself and writes it into mw->rkey (read by
        // BoundWindow::rkey). Type 2: the application chooses it; the provider identifies the
        // window by its current mw->rkey, which takes the new value once the bind succeeded
        // (Completion::take_bound_window).
        let new_rkey = (self.ty == MwType::Type2).then(|| {
            // SAFETY: a pure function.
            unsafe { ffi::ibv_inc_rkey(self.rkey()) }
        });
        self.binds = self.binds.saturating_add(1);
        Ok(BoundWindow {
            mw: ManuallyDrop::new(self),
            mr: ManuallyDrop::new(region.mr.clone()),
            offset: off,
            len,
            access,
            new_rkey,
            qp: None,
            pending: Pending::Bind,
            hold: None,
        })
    }
}

/// Whether a type 1 bind's `ibv_bind_mw()` of a window is running: at most one at a time.
#[derive(Default)]
struct ProviderGate(AtomicBool);

impl ProviderGate {
    /// Waits until no `ibv_bind_mw()` of the window is running. Bounded by that call: a few
    /// microseconds (it posts one request).
    fn settle(&self) {
        while self.0.load(Ordering::Acquire) {
            std::hint::spin_loop();
            std::thread::yield_now();
        }
    }

    /// Waits until no `ibv_bind_mw()` of the window is running, then marks one as running until
    /// the guard is dropped. The acquire pairs with the last call's release: what its provider
    /// wrote (`mw->rkey`) happens before the next call reads it.
    fn enter(gate: &Arc<ProviderGate>) -> InProvider {
        while gate.0.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
            std::thread::yield_now();
        }
        InProvider(gate.clone())
    }
}

/// A type 1 bind's `ibv_bind_mw()` is running ([`MemoryWindow::in_provider`]); dropped when it
/// returned, which lets the window's readers, its next bind and its deallocation go on.
pub(crate) struct InProvider(Arc<ProviderGate>);

impl Drop for InProvider {
    fn drop(&mut self) {
        (self.0).0.store(false, Ordering::Release);
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        self.settle();
        // SAFETY: allocated once, deallocated once. A failure leaves the kernel object (and the PD
        // it references, through our Arc that is dropped anyway: the PD's own drop then fails
        // and leaks it).
        unsafe { ffi::ibv_dealloc_mw(self.raw.as_ptr()) };
    }
}

/// What a bound window's request is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pending {
    /// Nothing posted: bound (as far as the device said).
    None,
    /// A bind request holds it.
    Bind,
    /// An invalidation (local invalidate, or a type 1 zero-length bind) holds it.
    Invalidate,
}

/// A memory window that may be bound to (part of) an [`ExposedRegion`]: peers may access those
/// bytes with [`rkey`](Self::rkey) until it is invalidated or deallocated.
///
/// It holds the region's registration (an `Arc`), so the region cannot become private again
/// ([`ExposedRegion::into_private`]) while it exists, and the memory is never freed under it:
/// `mem::forget` of it only leaks. It comes back from a bind's completion
/// ([`Completion::take_bound_window`](crate::Completion::take_bound_window)); it goes back to an
/// unbound [`MemoryWindow`], giving the registration up, only when its unbinding is proven:
/// [`Completion::take_invalidated_window`](crate::Completion::take_invalidated_window) after a
/// local invalidate or a type 1 unbind completed, or
/// [`remote_invalidated`](Self::remote_invalidated). Dropping it deallocates the window
/// (`ibv_dealloc_mw()`, which ends every access through it) and only then gives the registration
/// up; if deallocation fails, the registration is leaked.
///
/// It is not `Clone` (so no two handles claim one binding):
///
/// ```compile_fail,E0599
/// fn f(w: ibverbs::BoundWindow) -> (ibverbs::BoundWindow, ibverbs::BoundWindow) {
///     (w.clone(), w)
/// }
/// ```
#[doc(alias = "ibv_mw_bind", alias = "ibv_bind_mw")]
pub struct BoundWindow {
    mw: ManuallyDrop<MemoryWindow>,
    mr: ManuallyDrop<Arc<MrInner>>,
    offset: usize,
    len: usize,
    access: AccessFlags,
    /// Type 2: the rkey of this binding (mw->rkey holds it once the bind succeeded).
    new_rkey: Option<u32>,
    /// Type 2: the QP it is bound to (id, number).
    pub(crate) qp: Option<(u64, u32)>,
    pub(crate) pending: Pending,
    /// Type 2, on devices whose `ibv_destroy_qp` waits for the windows bound through the queue
    /// pair (rxe): holds back that queue pair's destruction until this window is deallocated or
    /// proven unbound (see `memory/hold.rs`).
    hold: Option<QpHoldToken>,
}

impl fmt::Debug for BoundWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoundWindow")
            .field("type", &self.mw.ty)
            .field("remote", &self.remote())
            .field("access", &self.access)
            .field("pending", &self.pending)
            .finish()
    }
}

impl BoundWindow {
    /// The window's type.
    pub fn mw_type(&self) -> MwType {
        self.mw.ty
    }
    /// The rkey peers use.
    pub fn rkey(&self) -> u32 {
        self.new_rkey.unwrap_or_else(|| self.mw.rkey())
    }

    /// A type 2 bind succeeded: the window's rkey is the new one from now on.
    pub(crate) fn commit_rkey(&mut self) {
        if let Some(rkey) = self.new_rkey {
            self.mw.settle();
            // SAFETY: we own the window (the completion handed it back); the provider reads
            // mw->rkey only while posting a request that holds the window.
            unsafe { (*self.mw.raw.as_ptr()).rkey = rkey };
        }
    }
    /// A type 2 bind of this window is being posted through queue pair `qp_id` (`self.qp` was
    /// just set): on a device whose `ibv_destroy_qp` waits for the windows bound through the
    /// queue pair, the window now holds that queue pair's destruction back until it is
    /// deallocated or proven unbound (`memory/hold.rs`). Taken at the post, not at the
    /// completion: the device may execute the bind (and take its reference on the queue pair)
    /// before the queue pair is dropped and its completion polled. A request recorded for one
    /// queue pair and then posted on another (a chain whose later request failed its check)
    /// moves its token to the new one. Only bind posts come here (never the data path).
    pub(crate) fn hold_qp(&mut self) {
        let Some((qp_id, _)) = self.qp else { return };
        if self.mw.ty != MwType::Type2 || self.hold.as_ref().is_some_and(|h| h.qp_id() == qp_id) {
            return;
        }
        if !self.mw.quirks().destroy_qp_waits_for_type2_windows {
            return;
        }
        // The old token (of a queue pair this request was never posted on) goes after the new
        // one is taken; its drop may run that queue pair's parked destruction.
        drop(self.hold.replace(QpHoldToken::new(qp_id)));
    }

    /// Offset of the window in its region.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length of the window in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the window is empty (never: empty binds are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The rights it grants.
    pub fn access(&self) -> AccessFlags {
        self.access
    }
    /// The descriptor a peer needs (address, length, rkey): usable wherever a [`RemoteSlice`]
    /// is, e.g. as the target of [`SendRequest::write`](crate::SendRequest::write) or
    /// [`read`](crate::SendRequest::read), and exchanged with [`RemoteSlice::encode`].
    pub fn remote(&self) -> RemoteSlice {
        RemoteSlice { addr: self.device_addr(), len: self.len as u64, rkey: self.rkey() }
    }

    /// The device address of the window's first byte (no read of `mw->rkey`: a type 1 bind
    /// fills its request with it while its `ibv_bind_mw()` is marked running).
    pub(crate) fn device_addr(&self) -> u64 {
        self.mr.device_addr(self.mr.addr()).wrapping_add(self.offset as u64)
    }
    /// The raw `struct ibv_mw *`; valid while this window lives. Binding, invalidating or
    /// deallocating it through `ffi` defeats the crate's tracking of the region's state: raw
    /// code may read it only.
    pub fn as_raw(&self) -> *mut ffi::ibv_mw {
        self.mw.as_raw()
    }

    pub(crate) fn mr(&self) -> &MrInner {
        &self.mr
    }
    pub(crate) fn mr_raw(&self) -> *mut ffi::ibv_mr {
        self.mr.raw_ptr()
    }
    pub(crate) fn window(&self) -> &MemoryWindow {
        &self.mw
    }

    /// A bind that was never posted: the window is as unbound as before.
    pub(crate) fn into_unposted(self) -> MemoryWindow {
        self.into_unbound()
    }

    /// The window, unbound: gives the registration up. Only for proven unbinding (or a bind never
    /// posted).
    pub(crate) fn into_unbound(mut self) -> MemoryWindow {
        // A type 2 window's key becomes this binding's however the window came back
        // (`take_bound_window` commits it, `Completion::take_buffers` does not): the next bind
        // moves on from it, so no key of the window repeats. A bind never posted skips a key.
        self.commit_rkey();
        let mut me = ManuallyDrop::new(self);
        // SAFETY: each field is taken once out of the ManuallyDrop, which is not used again.
        let (mw, mr) = unsafe { (ManuallyDrop::take(&mut me.mw), ManuallyDrop::take(&mut me.mr)) };
        drop(mr);
        // Unbound: the kernel dropped its reference on the queue pair (invalidation), or never
        // took one (a bind never posted). May run the queue pair's parked destruction.
        drop(me.hold.take());
        mw
    }

    /// Deallocates the window (`ibv_dealloc_mw()`): every access through it ends, whatever QP it
    /// was bound to (also one that was destroyed since).
    #[doc(alias = "ibv_dealloc_mw")]
    pub fn dealloc(self) {
        drop(self);
    }

    /// Ends every access through the window at once and hands back a new, unbound window of the
    /// same type on the same protection domain: deallocates this one (`ibv_dealloc_mw()`, which,
    /// unlike a local invalidation, no kernel bug turns into a crash when a peer's Send with
    /// Invalidate got there first) and allocates another (`ibv_alloc_mw()`), whose rkey differs.
    /// Unlike [`SendRequest::local_invalidate`](crate::SendRequest::local_invalidate) it is not
    /// ordered with the queue pair's requests: it takes effect when it returns. The region's hold
    /// is given up as by [`dealloc`](Self::dealloc).
    ///
    /// # Errors
    /// [`Error::Verb`] of `ibv_dealloc_mw` when the window cannot be deallocated: its access may
    /// not have ended, and, as when a dropped window's deallocation fails, its memory stays
    /// registered and allocated for ever. [`Error::Verb`] (or [`Error::Unsupported`]) of
    /// `ibv_alloc_mw` when the new window cannot be allocated: the old one is deallocated then.
    #[doc(alias = "ibv_dealloc_mw", alias = "ibv_alloc_mw")]
    pub fn revoke(self) -> Result<MemoryWindow> {
        let pd = ProtectionDomain { inner: self.mw.pd.clone() };
        let ty = self.mw.ty;
        // The other fields are plain values: nothing is lost by not dropping them.
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is used no more, and its Drop does not run (ManuallyDrop).
        let ret = unsafe { me.dealloc_fields() };
        if ret != 0 {
            return Err(Error::from_ret("ibv_dealloc_mw", ret));
        }
        pd.alloc_mw(ty)
    }

    /// Deallocates the window and gives up the region's hold, or, when `ibv_dealloc_mw()` fails
    /// (the window may still be bound), keeps the memory registered and allocated for ever.
    /// Returns `ibv_dealloc_mw()`'s result. The body of `Drop` and of [`revoke`](Self::revoke).
    ///
    /// # Safety
    /// Called once per window: `self.mw` and `self.mr` are taken out, and must not be used, nor
    /// dropped, afterwards.
    unsafe fn dealloc_fields(&mut self) -> i32 {
        // SAFETY: each field is taken once (contract).
        let (mw, mr) = unsafe { (ManuallyDrop::take(&mut self.mw), ManuallyDrop::take(&mut self.mr)) };
        let hold = self.hold.take();
        let ret = mw.release();
        if ret == 0 {
            drop(mr);
            // Deallocated: the kernel's reference on the queue pair went with it. May run the
            // queue pair's parked destruction.
            drop(hold);
        } else {
            std::mem::forget(mr);
            // It may still be bound: the queue pair it references is never destroyed.
            std::mem::forget(hold);
        }
        ret
    }
}

impl Drop for BoundWindow {
    fn drop(&mut self) {
        // SAFETY: Drop runs once; self is not used afterwards.
        unsafe { self.dealloc_fields() };
    }
}

/// A registered region that peers reach only through memory windows, in its *private* state:
/// no window is bound to it (every window that ever was is proven unbound), and the region
/// grants no remote right of its own, so it derefs to `[u8]`/`mut [u8]` — the in-place read of
/// what peers wrote while it was exposed.
///
/// From [`ProtectionDomain::allocate_windowed`]; [`expose`](Self::expose) moves it into the
/// [`ExposedRegion`] state, where windows can be bound and reads are copies. Dropping it
/// deregisters it and frees the memory.
#[doc(alias = "ibv_reg_mr", alias = "IBV_ACCESS_MW_BIND")]
pub struct WindowedRegion {
    inner: Box<MrInner>,
}

/// A windowed region in its *exposed* state: windows may be bound to it, so peers may write it
/// at any moment, and safe code only copies out of it ([`read`](Self::read),
/// [`to_vec`](Self::to_vec)). An exposed region gives no `&[u8]`:
///
/// ```compile_fail,E0608
/// fn f(r: &ibverbs::ExposedRegion) -> u8 {
///     r[0]
/// }
/// ```
///
/// [`into_private`](Self::into_private) returns to [`WindowedRegion`] once every window bound to
/// it has been proven unbound. Dropping it keeps the memory registered until the last window
/// holding it is gone.
#[doc(alias = "ibv_mr")]
pub struct ExposedRegion {
    mr: Arc<MrInner>,
}

impl fmt::Debug for WindowedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Windowed")?;
        self.inner.fmt(f)
    }
}

impl fmt::Debug for ExposedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExposedRegion")
            .field("region", &*self.mr)
            .field("holders", &Arc::strong_count(&self.mr))
            .finish()
    }
}

impl WindowedRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }
    /// Whether the region is empty (never).
    pub fn is_empty(&self) -> bool {
        self.inner.len() == 0
    }
    /// The access rights it was registered with.
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }
    /// Moves the region into the exposed state, where windows can be bound to it. The private
    /// handle is gone, so no slice of it survives:
    ///
    /// ```compile_fail,E0505
    /// fn f(r: ibverbs::WindowedRegion) {
    ///     let bytes: &[u8] = &r;
    ///     let exposed = r.expose(); // error: cannot move out of `r` because it is borrowed
    ///     println!("{}", bytes[0]);
    /// }
    /// ```
    pub fn expose(self) -> ExposedRegion {
        ExposedRegion { mr: Arc::from(self.inner) }
    }
    /// The region's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: valid memory owned by self. No window is bound to it (windows bind only to an
        // ExposedRegion, and the region came back private only when no window held it); its
        // registration grants no remote access; it cannot be posted as a local buffer. So
        // nothing but this process writes it.
        unsafe { std::slice::from_raw_parts(self.inner.addr(), self.inner.len()) }
    }
    /// The region's bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.inner.addr(), self.inner.len()) }
    }
}

impl std::ops::Deref for WindowedRegion {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for WindowedRegion {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl ExposedRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mr.len()
    }
    /// Whether the region is empty (never).
    pub fn is_empty(&self) -> bool {
        self.mr.len() == 0
    }
    /// The access rights it was registered with.
    pub fn access(&self) -> AccessFlags {
        self.mr.access
    }
    /// How many windows (bound, or held by a posted bind or invalidation) still hold the region.
    pub fn windows(&self) -> usize {
        Arc::strong_count(&self.mr) - 1
    }

    fn racy(&self) -> RacyBytes {
        // SAFETY: valid for len bytes while self lives; this process accesses it only through
        // RacyBytes while exposed.
        unsafe { RacyBytes::new(self.mr.addr(), self.mr.len()) }
    }

    /// Copies `dst.len()` bytes at `offset` out of the region (torn if a peer writes meanwhile,
    /// never undefined behaviour).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let (off, _) = self.mr.range("read", offset..offset.saturating_add(dst.len()))?;
        self.racy().read(off, dst);
        Ok(())
    }

    /// Copies the whole region into a new `Vec`.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.racy().read(0, &mut v);
        v
    }

    /// Returns to the private state, where the bytes are borrowed in place: succeeds when no
    /// window holds the region any more (each was proven unbound, or deallocated).
    ///
    /// # Errors
    /// The region back, still exposed, when a window (bound, forgotten, or held by a posted
    /// request) still holds it; [`windows`](Self::windows) says how many.
    #[allow(clippy::result_large_err)]
    pub fn into_private(self) -> std::result::Result<WindowedRegion, ExposedRegion> {
        match Arc::try_unwrap(self.mr) {
            Ok(inner) => Ok(WindowedRegion { inner: Box::new(inner) }),
            Err(mr) => Err(ExposedRegion { mr }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RW: AccessFlags = AccessFlags::REMOTE_WRITE;

    #[test]
    fn binds_are_checked_against_the_region() {
        let mr = AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND;
        assert_eq!(check_bind("b", 4096, mr, 0..4096, RW).unwrap(), (0, 4096));
        assert_eq!(check_bind("b", 4096, mr, 100..200, WINDOW_ACCESS).unwrap(), (100, 100));
        assert!(matches!(
            check_bind("b", 4096, mr, 4000..4097, RW),
            Err(Error::OutOfBounds { offset: 4000, len: 97, size: 4096, .. })
        ));
        assert!(matches!(check_bind("b", 4096, mr, 10..10, RW), Err(Error::InvalidArgument { .. })));
        assert!(matches!(check_bind("b", 4096, mr, usize::MAX.., RW), Err(Error::OutOfBounds { .. })));
        // The region lacks MW_BIND.
        assert!(check_bind("b", 4096, AccessFlags::LOCAL_WRITE, .., AccessFlags::REMOTE_READ).is_err());
        // Remote write needs LOCAL_WRITE on the region; remote read does not.
        assert!(check_bind("b", 4096, AccessFlags::MW_BIND, .., RW).is_err());
        assert!(check_bind("b", 4096, AccessFlags::MW_BIND, .., AccessFlags::REMOTE_ATOMIC).is_err());
        assert!(check_bind("b", 4096, AccessFlags::MW_BIND, .., AccessFlags::REMOTE_READ).is_ok());
        // A window grants nothing but remote rights.
        assert!(check_bind("b", 4096, mr, .., AccessFlags::MW_BIND).is_err());
        assert!(check_bind("b", 4096, mr, .., AccessFlags::from_bits_retain(1 << 30)).is_err());
    }

    #[test]
    fn capabilities_are_named() {
        use ffi::ibv_device_cap_flags as F;
        assert_eq!(MwType::Type1.missing_capability(0), Some("IBV_DEVICE_MEM_WINDOW"));
        assert_eq!(MwType::Type1.missing_capability(F::IBV_DEVICE_MEM_WINDOW.0), None);
        assert!(MwType::Type2.missing_capability(F::IBV_DEVICE_MEM_WINDOW.0).is_some());
        assert_eq!(MwType::Type2.missing_capability(F::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0), None);
        assert_eq!(MwType::Type2.missing_capability(F::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0), None);
    }

    #[test]
    fn a_bind_waits_for_the_last_one_to_leave_the_provider() {
        use std::sync::atomic::AtomicUsize;
        use std::time::Duration;
        let gate = Arc::new(ProviderGate::default());
        // The first poster is still in the provider (its completion handed the window on).
        let first = ProviderGate::enter(&gate);
        let entered = Arc::new(AtomicUsize::new(0));
        let second = {
            let (gate, entered) = (gate.clone(), entered.clone());
            std::thread::spawn(move || {
                let _g = ProviderGate::enter(&gate);
                entered.store(1, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(entered.load(Ordering::SeqCst), 0, "a second bind entered the provider during the first");
        drop(first);
        second.join().unwrap();
        assert_eq!(entered.load(Ordering::SeqCst), 1);
        // Both left: readers do not wait.
        gate.settle();
        assert!(!gate.0.load(Ordering::SeqCst));
    }

    #[test]
    fn keys_never_repeat_within_a_window() {
        // 255 binds move the 8-bit key through 255 distinct values after the initial one.
        let mut seen = std::collections::HashSet::new();
        let mut key = 0x37u8;
        let mut binds = 0u16;
        while may_bind_again(binds) {
            key = key.wrapping_add(1);
            binds += 1;
            assert!(key != 0x37 && seen.insert(key), "key repeated after {binds} binds");
        }
        assert_eq!(binds, MAX_BINDS);
    }
}
