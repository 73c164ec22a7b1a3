//! Typed work requests for the safe posting level.

use std::fmt;
use std::ops::RangeBounds;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::ah::AddressHandle;
use crate::error::{Error, Result};
use crate::memory::{
    check_range, AccessFlags, BoundWindow, Chunk, DmabufRegion, ExposedRegion, MemoryRegion, MemoryWindow,
    MrInner, MwType, Pending, RemoteMemoryRegion, RemoteSlice,
};
use crate::pd::PdInner;

/// Most scatter/gather entries one safe work request carries.
pub const MAX_SGE: usize = 4;

/// A registered buffer handed to a safe post, kept alive by the queue pair until the request's
/// completion hands it back (see [`Completion::take_buffers`](crate::Completion::take_buffers)).
pub enum LocalBuf {
    /// A local-only region, moved in: the device may read or write it, nothing else can touch it
    /// until it comes back.
    Owned(MemoryRegion),
    /// A shared local-only region: the device only reads it (sends, RDMA Write sources), as may
    /// every other holder of the `Arc`.
    Shared(Arc<MemoryRegion>),
    /// A remote-exposed region: it is racy by nature (only copied out of in safe code), so the
    /// device may read or write it while others hold the `Arc`.
    Remote(Arc<RemoteMemoryRegion>),
    /// An owned piece of a local-only region, moved in like [`LocalBuf::Owned`].
    Chunk(Chunk),
    /// A memory window held by a bind or invalidate request (with the registration it is bound
    /// to) until the completion: take it back with
    /// [`Completion::take_bound_window`](crate::Completion::take_bound_window) or
    /// [`take_invalidated_window`](crate::Completion::take_invalidated_window).
    Window(Box<BoundWindow>),
    /// A registered range of a dma-buf (`ibv_reg_dmabuf_mr`, e.g. GPU memory): memory of another
    /// driver that Rust never references, so the device may read or write it (if registered
    /// with [`AccessFlags::LOCAL_WRITE`]) while others hold the `Arc`; the `Arc` keeps it
    /// registered until the completion. Never posted inline (the CPU does not read it).
    Dmabuf(Arc<DmabufRegion>),
}

impl LocalBuf {
    /// The region of process memory the buffer lies in; `None` for a dma-buf, which is none.
    #[inline]
    fn host_mr(&self) -> Option<&MrInner> {
        match self {
            LocalBuf::Owned(m) => Some(&m.inner),
            LocalBuf::Shared(m) => Some(&m.inner),
            LocalBuf::Remote(m) => Some(&m.inner),
            LocalBuf::Chunk(c) => Some(&c.mr),
            LocalBuf::Window(w) => Some(w.mr()),
            LocalBuf::Dmabuf(_) => None,
        }
    }

    /// The local key of the buffer's registration.
    #[inline]
    pub(crate) fn lkey(&self) -> u32 {
        match (self.host_mr(), self) {
            (Some(mr), _) => mr.lkey(),
            (None, LocalBuf::Dmabuf(d)) => d.lkey(),
            (None, _) => 0,
        }
    }

    /// Whether the buffer's registration belongs to the protection domain `pd`.
    #[inline]
    pub(crate) fn in_pd(&self, pd: &Arc<PdInner>) -> bool {
        match (self.host_mr(), self) {
            (Some(mr), _) => mr.in_pd(pd),
            (None, LocalBuf::Dmabuf(d)) => d.in_pd(pd),
            (None, _) => false,
        }
    }

    /// The region of an [`Owned`](LocalBuf::Owned) or [`Remote`](LocalBuf::Remote) buffer:
    /// a whole region of process memory (its bounds are the region's) that the device may
    /// write ([`device_writable`](Self::device_writable)), what a receive's one entry usually
    /// is. `None` for the other kinds.
    #[inline(always)]
    pub(crate) fn writable_region(&self) -> Option<&MrInner> {
        match self {
            LocalBuf::Owned(m) => Some(&m.inner),
            LocalBuf::Remote(m) => Some(&m.inner),
            _ => None,
        }
    }

    /// The region of an [`Owned`](LocalBuf::Owned), [`Shared`](LocalBuf::Shared) or
    /// [`Remote`](LocalBuf::Remote) buffer: a whole region of process memory (its bounds are
    /// the region's), what a send's one entry usually is. `None` for the other kinds.
    #[inline(always)]
    pub(crate) fn whole_region(&self) -> Option<&MrInner> {
        match self {
            LocalBuf::Owned(m) => Some(&m.inner),
            LocalBuf::Shared(m) => Some(&m.inner),
            LocalBuf::Remote(m) => Some(&m.inner),
            _ => None,
        }
    }

    /// Start address and length of the buffer (the whole region, or the chunk). A dma-buf has
    /// no host address: null, with its length.
    #[inline]
    pub(crate) fn bounds(&self) -> (*mut u8, usize) {
        match self {
            LocalBuf::Chunk(c) => (c.addr(), c.len()),
            LocalBuf::Dmabuf(d) => (std::ptr::null_mut(), d.len()),
            _ => self.host_mr().map_or((std::ptr::null_mut(), 0), |mr| (mr.addr(), mr.len())),
        }
    }

    /// The device address of the buffer's first byte (its virtual address unless the region
    /// was registered with an IOVA; a dma-buf's IOVA).
    #[inline]
    pub(crate) fn device_start(&self) -> u64 {
        match (self.host_mr(), self) {
            (Some(mr), _) => mr.device_addr(self.bounds().0),
            (None, LocalBuf::Dmabuf(d)) => d.iova(),
            (None, _) => 0,
        }
    }

    /// Whether the device may write into it through this handle.
    pub(crate) fn device_writable(&self) -> bool {
        match self {
            LocalBuf::Shared(_) => false,
            LocalBuf::Dmabuf(d) => d.access().contains(AccessFlags::LOCAL_WRITE),
            _ => true,
        }
    }

    /// The owned region back, if this is [`LocalBuf::Owned`].
    #[inline]
    pub fn into_region(self) -> Option<MemoryRegion> {
        match self {
            LocalBuf::Owned(m) => Some(m),
            _ => None,
        }
    }

    /// The chunk back, if this is [`LocalBuf::Chunk`].
    pub fn into_chunk(self) -> Option<Chunk> {
        match self {
            LocalBuf::Chunk(c) => Some(c),
            _ => None,
        }
    }
}

impl fmt::Debug for LocalBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LocalBuf::Owned(m) => f.debug_tuple("Owned").field(m).finish(),
            LocalBuf::Shared(m) => f.debug_tuple("Shared").field(m).finish(),
            LocalBuf::Remote(m) => f.debug_tuple("Remote").field(m).finish(),
            LocalBuf::Chunk(c) => f.debug_tuple("Chunk").field(c).finish(),
            LocalBuf::Window(w) => f.debug_tuple("Window").field(w).finish(),
            LocalBuf::Dmabuf(d) => f.debug_tuple("Dmabuf").field(d).finish(),
        }
    }
}

impl From<MemoryRegion> for LocalBuf {
    fn from(m: MemoryRegion) -> Self {
        LocalBuf::Owned(m)
    }
}
impl From<Arc<MemoryRegion>> for LocalBuf {
    fn from(m: Arc<MemoryRegion>) -> Self {
        LocalBuf::Shared(m)
    }
}
impl From<Chunk> for LocalBuf {
    fn from(c: Chunk) -> Self {
        LocalBuf::Chunk(c)
    }
}
impl From<Arc<RemoteMemoryRegion>> for LocalBuf {
    fn from(m: Arc<RemoteMemoryRegion>) -> Self {
        LocalBuf::Remote(m)
    }
}
impl From<Arc<DmabufRegion>> for LocalBuf {
    fn from(d: Arc<DmabufRegion>) -> Self {
        LocalBuf::Dmabuf(d)
    }
}

/// A bounds-checked range of a registered buffer: one scatter/gather entry (`struct ibv_sge`).
///
/// A range of 0 bytes can be built, but no post takes it ([`Error::InvalidArgument`]): Mellanox
/// devices read an entry's length of 0 as 2 GiB, and mlx4 passes a receive entry's length to the
/// device as is. A message of no bytes is a request with no entry
/// ([`SendRequest::send_inline`] of an empty slice, [`RecvRequest::empty`]; siw refuses a
/// receive with no entry, so there a receive of any length takes it).
#[derive(Debug)]
pub struct Local {
    pub(crate) buf: LocalBuf,
    pub(crate) offset: usize,
    pub(crate) len: u32,
}

impl Local {
    /// The bytes `range` of `buf`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the region, [`Error::InvalidArgument`] for a
    /// range of 4 GiB or more (the limit of one `ibv_sge`). The buffer is lost on error only if it
    /// was moved in: check ranges of owned regions before, or use [`Local::whole`].
    pub fn new(buf: impl Into<LocalBuf>, range: impl RangeBounds<usize>) -> Result<Local> {
        let buf = buf.into();
        let (offset, len) = check_range("Local::new", range, buf.bounds().1)?;
        let len = u32::try_from(len).map_err(|_| Error::InvalidArgument {
            verb: "Local::new",
            reason: "a scatter/gather entry is at most 4 GiB - 1",
        })?;
        Ok(Local { buf, offset, len })
    }

    /// The whole of `buf` (regions of 4 GiB or more are truncated to the first 4 GiB - 1 bytes).
    #[inline]
    pub fn whole(buf: impl Into<LocalBuf>) -> Local {
        let buf = buf.into();
        let len = u32::try_from(buf.bounds().1).unwrap_or(u32::MAX);
        Local { buf, offset: 0, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer back.
    #[inline]
    pub fn into_buf(self) -> LocalBuf {
        self.buf
    }

    /// Why no post takes this entry as a data buffer, if none does: a memory window, or a
    /// range of 0 bytes ([`EMPTY_ENTRY`]). Sends and receives both check it.
    #[inline]
    pub(crate) fn unusable(&self) -> Option<&'static str> {
        if matches!(self.buf, LocalBuf::Window(_)) {
            Some("a memory window is not a data buffer")
        } else if self.len == 0 {
            Some(EMPTY_ENTRY)
        } else {
            None
        }
    }

    pub(crate) fn sge(&self) -> ffi::ibv_sge {
        let start = self.buf.device_start();
        ffi::ibv_sge { addr: start.wrapping_add(self.offset as u64), length: self.len, lkey: self.buf.lkey() }
    }

    /// [`sge`](Self::sge) given the buffer's region `mr`, from
    /// [`LocalBuf::whole_region`] (or `writable_region`): the same SGE, without matching on the
    /// buffer's kind again for each field.
    #[inline(always)]
    pub(crate) fn sge_in(&self, mr: &MrInner) -> ffi::ibv_sge {
        // A whole region's buffer starts at the region's first byte (`bounds`).
        let start = mr.device_addr(mr.addr());
        ffi::ibv_sge { addr: start.wrapping_add(self.offset as u64), length: self.len, lkey: mr.lkey() }
    }
}

/// A request's entries as the post path sees them: up to the first empty one.
///
/// Entries are compact (the constructors fill entry 0, [`push_sge`] the first empty one, a
/// withdrawn slot puts them back where they were), so this is all of them; stopping at the first
/// empty entry costs a request without any (inline data, a window) one test instead of
/// `MAX_SGE`. The checks, the SGEs the device is given and the buffers moved into the slot all
/// come from this one iterator, so they agree even if an entry were left out.
#[inline]
pub(crate) fn entries(sges: &[Option<Local>; MAX_SGE]) -> impl Iterator<Item = &Local> {
    sges.iter().map_while(Option::as_ref)
}

/// Writes the `ibv_sge`s of a request's [`entries`], in order; returns how many.
#[inline]
fn pack_sges(locals: &[Option<Local>; MAX_SGE], sges: &mut [ffi::ibv_sge; MAX_SGE]) -> usize {
    let mut n = 0;
    for (out, local) in sges.iter_mut().zip(entries(locals)) {
        *out = local.sge();
        n += 1;
    }
    n
}

/// Appends `local` to a request's scatter/gather entries.
fn push_sge(sges: &mut [Option<Local>; MAX_SGE], local: Local, verb: &'static str) -> Result<()> {
    match sges.iter_mut().find(|s| s.is_none()) {
        Some(s) => {
            *s = Some(local);
            Ok(())
        }
        None => Err(Error::InvalidArgument { verb, reason: "more than MAX_SGE entries" }),
    }
}

/// What a request's scatter/gather entries are, for its checks.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct EntryFacts {
    pub(crate) count: usize,
    /// Their total length.
    pub(crate) len: u64,
    /// One of them is read-only for the device.
    pub(crate) read_only: bool,
    /// One of them is owned (released only by its own completion).
    pub(crate) owned: bool,
    /// One of them belongs to another protection domain.
    pub(crate) foreign: bool,
    /// Why one of them cannot be a data buffer at all: a memory window, or 0 bytes
    /// ([`EMPTY_ENTRY`]). One field for both keeps the passing post at one test.
    pub(crate) unusable: Option<&'static str>,
}

/// Why a request with an entry of 0 bytes is refused (both directions): Mellanox data
/// segments read a byte count of 0 as 2 GiB, and mlx4's receive path passes the length as is,
/// so the device could write past the entry, up to the end of its region, behind other borrows.
pub(crate) const EMPTY_ENTRY: &str =
    "a scatter/gather entry of 0 bytes (some devices read a length of 0 as 2 GiB): leave it out";

/// The operation of a [`SendRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Send,
    Write(RemoteSlice),
    Read(RemoteSlice),
    CompareSwap {
        remote: RemoteSlice,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote: RemoteSlice,
        add: u64,
    },
    /// Type 2 bind of the request's window (`IBV_WR_BIND_MW`).
    BindMw,
    /// Local invalidate of the request's window (`IBV_WR_LOCAL_INV`).
    LocalInv,
    /// Send with Invalidate of a peer's rkey (`IBV_WR_SEND_WITH_INV`).
    SendInv(u32),
}

/// A typed send-queue work request (`struct ibv_send_wr`): Send, RDMA Write, RDMA Read or an
/// atomic, with optional immediate data, inline data, and signaling.
///
/// Required arguments go in the constructor, options are setters:
///
/// ```no_run
/// # fn f(mr: ibverbs::MemoryRegion, peer: ibverbs::RemoteSlice) -> ibverbs::Result<()> {
/// use ibverbs::{Local, SendRequest};
/// let wr = SendRequest::write(Local::new(mr, 0..64)?, peer).imm(7).wr_id(42);
/// # let _ = wr; Ok(()) }
/// ```
pub struct SendRequest<'a> {
    pub(crate) op: Op,
    pub(crate) sges: [Option<Local>; MAX_SGE],
    pub(crate) inline: Option<&'a [u8]>,
    pub(crate) imm: Option<u32>,
    pub(crate) wr_id: u64,
    pub(crate) signaled: bool,
    pub(crate) fence: bool,
    pub(crate) solicited: bool,
    pub(crate) ud: Option<(AddressHandle, u32, u32)>,
    /// The remote XRC SRQ number of a send on an XRC initiator.
    pub(crate) xrc_srqn: Option<u32>,
    /// The window a bind or local invalidate moves in. Boxed: the request stays 80 bytes smaller
    /// (it is moved by value into every post), and the slot takes the box as it is
    /// ([`LocalBuf::Window`]) instead of allocating one while posting.
    pub(crate) window: Option<Box<BoundWindow>>,
}

impl fmt::Debug for SendRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendRequest")
            .field("op", &self.op)
            .field("sges", &self.sges.iter().flatten().collect::<Vec<_>>())
            .field("inline_len", &self.inline.map(<[u8]>::len))
            .field("imm", &self.imm)
            .field("wr_id", &self.wr_id)
            .field("signaled", &self.signaled)
            .finish_non_exhaustive()
    }
}

/// A light send request's fields ([`SendRequest::light`]): a Send or RDMA Write with inline
/// data or none, that holds nothing until its completion; or those of a one-entry Send or
/// RDMA Write whose entry was taken out.
#[derive(Clone, Copy)]
pub(crate) struct LightSend<'a> {
    op: Op,
    inline: Option<&'a [u8]>,
    imm: Option<u32>,
    pub(crate) wr_id: u64,
    signaled: bool,
    fence: bool,
    solicited: bool,
}

impl<'a> LightSend<'a> {
    /// The request again (a light post that failed gives it back): the same fields, no
    /// entries, no window, address handle or XRC SRQ, as [`SendRequest::is_light`] found it.
    #[cold]
    pub(crate) fn into_request(self) -> SendRequest<'a> {
        self.into_request_with(None)
    }

    /// The request again with `first` as its only entry (a one-entry post that failed gives it
    /// back, its buffer back in `first` unless the provider queued it).
    #[cold]
    pub(crate) fn into_request_with(self, first: Option<Local>) -> SendRequest<'a> {
        let mut wr = SendRequest::with(self.op, first);
        wr.inline = self.inline;
        wr.imm = self.imm;
        wr.wr_id = self.wr_id;
        wr.signaled = self.signaled;
        wr.fence = self.fence;
        wr.solicited = self.solicited;
        wr
    }

    /// [`SendRequest::fill`] of the request these fields came from: the same fields, written
    /// for a Send or RDMA Write without entries of its own.
    #[inline(always)]
    pub(crate) fn fill(&self, wr: &mut ffi::ibv_send_wr, sge: &mut ffi::ibv_sge, device_wr_id: u64) {
        let mut flags = send_flags(self.signaled, self.fence, self.solicited);
        let mut n = 0;
        if let Some(d) = self.inline {
            flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            n = inline_sge(d, sge);
        }
        wr.wr_id = device_wr_id;
        wr.next = std::ptr::null_mut();
        wr.sg_list = sge;
        wr.num_sge = n;
        wr.send_flags = flags;
        if let Some(imm) = self.imm {
            wr.__bindgen_anon_1.imm_data = imm.to_be();
        }
        let write_to = match self.op {
            Op::Write(r) => Some(r),
            _ => None,
        };
        wr.opcode = send_or_write_opcode(wr, write_to, self.imm.is_some());
    }
}

/// A request's `send_flags` but `IBV_SEND_INLINE`: `IBV_SEND_SIGNALED`, `IBV_SEND_FENCE` and
/// `IBV_SEND_SOLICITED` as asked.
#[inline(always)]
pub(crate) fn send_flags(signaled: bool, fence: bool, solicited: bool) -> u32 {
    (u32::from(signaled) * ffi::ibv_send_flags::IBV_SEND_SIGNALED.0)
        | (u32::from(fence) * ffi::ibv_send_flags::IBV_SEND_FENCE.0)
        | (u32::from(solicited) * ffi::ibv_send_flags::IBV_SEND_SOLICITED.0)
}

/// Points `sge` at inline data `d` and returns the request's `num_sge` (none for no bytes). The
/// provider copies inline data during `ibv_post_send`, reading it through the SGE.
#[inline(always)]
fn inline_sge(d: &[u8], sge: &mut ffi::ibv_sge) -> i32 {
    *sge = ffi::ibv_sge { addr: d.as_ptr() as u64, length: d.len() as u32, lkey: 0 };
    i32::from(!d.is_empty())
}

/// The opcode of a Send (`write_to` `None`) or of an RDMA Write into `write_to`, with immediate
/// data or not; a Write's remote address goes into `wr` (the immediate data is the caller's).
#[inline(always)]
pub(crate) fn send_or_write_opcode(
    wr: &mut ffi::ibv_send_wr,
    write_to: Option<RemoteSlice>,
    imm: bool,
) -> ffi::ibv_wr_opcode {
    use ffi::ibv_wr_opcode as O;
    match (write_to, imm) {
        (Some(r), imm) => {
            wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: r.addr, rkey: r.rkey };
            if imm {
                O::IBV_WR_RDMA_WRITE_WITH_IMM
            } else {
                O::IBV_WR_RDMA_WRITE
            }
        }
        (None, true) => O::IBV_WR_SEND_WITH_IMM,
        (None, false) => O::IBV_WR_SEND,
    }
}

impl<'a> SendRequest<'a> {
    #[inline]
    fn with(op: Op, first: Option<Local>) -> Self {
        SendRequest {
            op,
            sges: [first, None, None, None],
            inline: None,
            imm: None,
            wr_id: 0,
            signaled: true,
            fence: false,
            solicited: false,
            ud: None,
            xrc_srqn: None,
            window: None,
        }
    }

    /// The operations without their local entries (a scope adds borrowed ones).
    pub(crate) fn send_op() -> Self {
        Self::with(Op::Send, None)
    }
    pub(crate) fn write_op(remote: RemoteSlice) -> Self {
        Self::with(Op::Write(remote), None)
    }
    pub(crate) fn read_op(remote: RemoteSlice) -> Self {
        Self::with(Op::Read(remote), None)
    }
    pub(crate) fn compare_swap_op(remote: RemoteSlice, compare: u64, swap: u64) -> Self {
        Self::with(Op::CompareSwap { remote, compare, swap }, None)
    }
    pub(crate) fn fetch_add_op(remote: RemoteSlice, add: u64) -> Self {
        Self::with(Op::FetchAdd { remote, add }, None)
    }

    /// Binds the type 2 window `mw` to the bytes `range` of `region`, granting `access`
    /// (`IBV_WR_BIND_MW`; a subset of [`WINDOW_ACCESS`](crate::WINDOW_ACCESS)). The window gets
    /// its next rkey (`ibv_inc_rkey()`); the completion
    /// ([`Completion::take_bound_window`](crate::Completion::take_bound_window)) hands it back
    /// bound to this queue pair, holding the region's registration. Posted on a QP of the
    /// window's protection domain; a peer reaches the window only through that QP.
    ///
    /// # Errors
    /// The window back, with [`Error::InvalidArgument`] (not type 2, region of another
    /// protection domain, rights the region cannot give — it lacks `MW_BIND`, or `LOCAL_WRITE`
    /// for remote write and atomics —, an empty range, [`MAX_BINDS`](crate::MAX_BINDS) reached)
    /// or [`Error::OutOfBounds`] (range outside the region).
    #[doc(alias = "IBV_WR_BIND_MW")]
    #[allow(clippy::result_large_err)]
    pub fn bind_window(
        mw: MemoryWindow,
        region: &ExposedRegion,
        range: impl RangeBounds<usize>,
        access: AccessFlags,
    ) -> std::result::Result<Self, (MemoryWindow, Error)> {
        if mw.mw_type() != MwType::Type2 {
            let e = Error::InvalidArgument {
                verb: "ibv_post_send",
                reason: "type 1 windows are bound with QueuePair::bind_mw",
            };
            return Err((mw, e));
        }
        let w = mw.prepare_bind("ibv_post_send", region, range, access)?;
        let mut wr = Self::with(Op::BindMw, None);
        wr.window = Some(Box::new(w));
        Ok(wr)
    }

    /// Invalidates the type 2 window `w` (`IBV_WR_LOCAL_INV` of its rkey): once the completion
    /// succeeded, [`Completion::take_invalidated_window`](crate::Completion::take_invalidated_window)
    /// hands the window back unbound (and gives up its hold on the region); a failed one hands it
    /// back still bound ([`Completion::take_bound_window`](crate::Completion::take_bound_window)).
    ///
    /// # Errors
    /// The window back, with [`Error::InvalidArgument`], for a type 1 window (unbind it with
    /// [`QueuePair::unbind_mw`](crate::QueuePair::unbind_mw)); with [`Error::Unsupported`] on a
    /// device whose kernel panics when it invalidates a window a peer already invalidated (rxe:
    /// see [the guide](crate::guide::device_bugs)): a peer's Send with Invalidate may come at any
    /// moment, so no local invalidation of a type 2 window is safe there. End the window's access
    /// with [`BoundWindow::revoke`] (or by dropping it) instead.
    #[doc(alias = "IBV_WR_LOCAL_INV")]
    #[allow(clippy::result_large_err)]
    pub fn local_invalidate(mut w: BoundWindow) -> std::result::Result<Self, (BoundWindow, Error)> {
        if w.mw_type() != MwType::Type2 {
            let e = Error::InvalidArgument {
                verb: "ibv_post_send",
                reason: "type 1 windows are unbound with QueuePair::unbind_mw",
            };
            return Err((w, e));
        }
        if w.window().quirks().mw_local_invalidate_panics {
            let e = Error::Unsupported {
                verb: "ibv_post_send",
                capability: "a local invalidation (IBV_WR_LOCAL_INV) of a type 2 window: this rxe \
                             kernel dereferences NULL and panics when the window is no longer valid, \
                             as after a peer's Send with Invalidate; use BoundWindow::revoke",
            };
            return Err((w, e));
        }
        w.pending = Pending::Invalidate;
        let mut wr = Self::with(Op::LocalInv, None);
        wr.window = Some(Box::new(w));
        Ok(wr)
    }

    /// A Send of `local` that also invalidates the peer's type 2 window `rkey`
    /// (`IBV_WR_SEND_WITH_INV`): the peer's receive completion reports it
    /// ([`Completion::invalidated_rkey`](crate::Completion::invalidated_rkey)).
    #[doc(alias = "IBV_WR_SEND_WITH_INV")]
    pub fn send_with_invalidate(local: Local, rkey: u32) -> Self {
        Self::with(Op::SendInv(rkey), Some(local))
    }

    /// [`send_with_invalidate`](Self::send_with_invalidate) of inline `data` (`IBV_SEND_INLINE`).
    pub fn send_inline_with_invalidate(data: &'a [u8], rkey: u32) -> Self {
        let mut wr = Self::with(Op::SendInv(rkey), None);
        wr.inline = Some(data);
        wr
    }

    /// Records the QP a type 2 bind is posted on.
    pub(crate) fn bind_to(&mut self, qp_id: u64, qp_num: u32) {
        if let (Op::BindMw, Some(w)) = (self.op, self.window.as_mut()) {
            w.qp = Some((qp_id, qp_num));
            w.hold_qp();
        }
    }

    /// A Send of `local` (`IBV_WR_SEND`; with [`imm`](Self::imm), `IBV_WR_SEND_WITH_IMM`).
    #[inline]
    pub fn send(local: Local) -> Self {
        Self::with(Op::Send, Some(local))
    }

    /// A Send of `data`, copied into the work queue while posting (`IBV_SEND_INLINE`): `data` is
    /// free again when the post returns. At most the QP's `max_inline_data` bytes; may be empty.
    pub fn send_inline(data: &'a [u8]) -> Self {
        let mut wr = Self::with(Op::Send, None);
        wr.inline = Some(data);
        wr
    }

    /// An RDMA Write of `local` to `remote` (`IBV_WR_RDMA_WRITE`; with [`imm`](Self::imm),
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`). `local` must fit in `remote`.
    #[inline]
    pub fn write(local: Local, remote: RemoteSlice) -> Self {
        Self::with(Op::Write(remote), Some(local))
    }

    /// An RDMA Write of inline `data` to `remote` (`IBV_SEND_INLINE`).
    pub fn write_inline(data: &'a [u8], remote: RemoteSlice) -> Self {
        let mut wr = Self::with(Op::Write(remote), None);
        wr.inline = Some(data);
        wr
    }

    /// An RDMA Read of `remote` into `local` (`IBV_WR_RDMA_READ`). `local` must be writable by
    /// the device: an owned [`MemoryRegion`] or a [`RemoteMemoryRegion`].
    pub fn read(local: Local, remote: RemoteSlice) -> Self {
        Self::with(Op::Read(remote), Some(local))
    }

    /// A 0-byte RDMA Read (`IBV_WR_RDMA_READ` with no scatter/gather entry): transfers nothing,
    /// but completes only once the responder answered it, which on a reliable connection it does
    /// after the earlier requests of this queue pair — the usual way to learn that RDMA Writes
    /// reached the peer (a flush). `remote` names the peer's memory as for
    /// [`read`](Self::read); no byte of it is transferred. The request holds no buffer, so it may
    /// be [`unsignaled`](Self::unsignaled).
    ///
    /// (A scatter/gather entry of 0 bytes is refused: some devices read a length of 0 as 2 GiB.
    /// Leaving the entry out, as here, is the 0-byte form, as for [`send_inline`](Self::send_inline)
    /// and [`write_inline`](Self::write_inline) with empty data.)
    #[doc(alias = "IBV_WR_RDMA_READ")]
    pub fn read_empty(remote: RemoteSlice) -> Self {
        Self::with(Op::Read(remote), None)
    }

    /// An atomic compare-and-swap of the 8 bytes at `remote` (`IBV_WR_ATOMIC_CMP_AND_SWP`): if
    /// they equal `compare` they become `swap`; the old value lands in `local` (8 bytes, device
    /// writable), in the byte order of the remote host.
    pub fn compare_swap(local: Local, remote: RemoteSlice, compare: u64, swap: u64) -> Self {
        Self::with(Op::CompareSwap { remote, compare, swap }, Some(local))
    }

    /// An atomic fetch-and-add on the 8 bytes at `remote` (`IBV_WR_ATOMIC_FETCH_AND_ADD`); the old
    /// value lands in `local` (8 bytes, device writable).
    pub fn fetch_add(local: Local, remote: RemoteSlice, add: u64) -> Self {
        Self::with(Op::FetchAdd { remote, add }, Some(local))
    }

    /// Adds a scatter/gather entry: more local data gathered into the Send or Write, or more
    /// room scattered into by the Read (at most [`MAX_SGE`] and the QP's `max_send_sge`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (with the entry dropped) when the request already has
    /// [`MAX_SGE`] entries or carries inline data.
    pub fn gather(mut self, local: Local) -> Result<Self> {
        if self.inline.is_some() {
            return Err(Error::InvalidArgument {
                verb: "ibv_post_send",
                reason: "inline requests take no SGEs",
            });
        }
        push_sge(&mut self.sges, local, "ibv_post_send")?;
        Ok(self)
    }

    /// Immediate data delivered with a Send or RDMA Write to the peer's receive completion.
    #[inline]
    pub fn imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
        self
    }

    /// The caller's identifier, returned in the completion.
    #[inline]
    pub fn wr_id(mut self, wr_id: u64) -> Self {
        self.wr_id = wr_id;
        self
    }

    /// Requests no completion (clears `IBV_SEND_SIGNALED`). Its buffers are released by the next
    /// signaled completion of the queue, so they must be shared (`Arc`) handles: posting an
    /// unsignaled request holding an owned region or chunk is refused. As in C, a send queue
    /// whose requests are all unsignaled fills up for good (every post then fails with
    /// [`Error::QueueFull`]): signal one request at least every `max_send_wr`, before the queue
    /// is full.
    #[inline]
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// Waits for earlier RDMA Reads and atomics to finish first (`IBV_SEND_FENCE`).
    pub fn fence(mut self) -> Self {
        self.fence = true;
        self
    }

    /// Sets the solicited-event bit (`IBV_SEND_SOLICITED`) for Sends and Writes with immediate.
    pub fn solicited(mut self) -> Self {
        self.solicited = true;
        self
    }

    /// The destination of a Send on a UD queue pair: an address handle, the remote QP number
    /// and Q_Key. The handle is kept alive until the completion.
    pub fn ud(mut self, ah: &AddressHandle, remote_qpn: u32, remote_qkey: u32) -> Self {
        self.ud = Some((ah.clone(), remote_qpn, remote_qkey));
        self
    }

    /// The destination XRC SRQ (its number, [`SharedReceiveQueue::srq_num`](crate::SharedReceiveQueue::srq_num)
    /// on the remote side) of a request on an XRC initiator ([`QpType::XRC_SEND`](crate::QpType::XRC_SEND));
    /// required there, refused elsewhere.
    #[doc(alias = "remote_srqn")]
    pub fn xrc_srqn(mut self, srqn: u32) -> Self {
        self.xrc_srqn = Some(srqn);
        self
    }

    /// Total bytes the request moves (inline length, or the sum of its SGEs).
    pub fn len(&self) -> u64 {
        match self.inline {
            Some(d) => d.len() as u64,
            None => self.sges.iter().flatten().map(|s| u64::from(s.len)).sum(),
        }
    }

    /// Whether it moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffers back (when a request is abandoned).
    pub fn into_buffers(self) -> impl Iterator<Item = LocalBuf> {
        let window = self.window.map(|mut w| {
            // Not posted: whatever it was to do did not happen.
            w.pending = Pending::None;
            LocalBuf::Window(w)
        });
        self.sges.into_iter().flatten().map(Local::into_buf).chain(window)
    }

    /// Lets go of what a posted request still holds, its address handle (the slot has a clone):
    /// `write_slot` moved its entries and window into the slot, so all that dropping it would do
    /// is test those empty fields (about 30 instructions a post), and the caller forgets it
    /// instead. The exhaustive pattern makes a new field a compile error here until it is
    /// considered.
    #[inline]
    pub(crate) fn release_posted(&mut self) {
        let SendRequest {
            op: _,
            sges,
            inline: _,
            imm: _,
            wr_id: _,
            signaled: _,
            fence: _,
            solicited: _,
            ud,
            xrc_srqn: _,
            window,
        } = self;
        debug_assert!(
            sges.iter().all(Option::is_none) && window.is_none(),
            "a posted request's entries and window are in its slot"
        );
        *ud = None;
    }

    /// Whether this is a *light* request that passes every check of [`validate`](Self::validate)
    /// and of the queue pair's (`send_fits`) on a connected (RC or UC) queue pair whose
    /// `max_inline_data` is `max_inline`: a Send or RDMA Write that holds nothing until its
    /// completion (no scatter/gather entry, window or address handle: inline data or no data),
    /// names no XRC SRQ, and whose inline data fits both `max_inline` and the remote slice.
    /// Such a request is posted from its [`light`](Self::light) fields and a slot that holds
    /// nothing, and dropping it drops nothing. `false` sends it down the general path, which
    /// makes every check again and says why.
    #[inline(always)]
    pub(crate) fn is_light(&self, max_inline: u32) -> bool {
        // Entries are compact (see `entries`): none when the first is empty.
        if self.sges[0].is_some() || self.window.is_some() || self.ud.is_some() || self.xrc_srqn.is_some() {
            return false;
        }
        let len = match self.inline {
            Some(d) if d.len() > max_inline as usize => return false,
            Some(d) => d.len() as u64,
            None => 0,
        };
        match self.op {
            Op::Send => true,
            Op::Write(r) => len <= r.len,
            _ => false,
        }
    }

    /// The fields of a light request ([`is_light`](Self::is_light) holds), read out: all its
    /// post needs, and all it takes to build the request again ([`LightSend::into_request`]).
    /// The light paths take these and forget the request (it holds nothing), so that a request
    /// built in the caller's frame need not be written to memory at all: only what is read here.
    /// Also the fields of a one-entry request once its entry was taken out.
    #[inline(always)]
    pub(crate) fn light(&self) -> LightSend<'a> {
        // Every field named: one added to `SendRequest` must be given a place here (or in
        // the checks), or the rebuilt request would silently lose it.
        let SendRequest { op, sges, inline, imm, wr_id, signaled, fence, solicited, ud, xrc_srqn, window } =
            self;
        debug_assert!(sges.iter().all(Option::is_none) && window.is_none() && ud.is_none());
        debug_assert!(xrc_srqn.is_none() && matches!(op, Op::Send | Op::Write(_)));
        LightSend {
            op: *op,
            inline: *inline,
            imm: *imm,
            wr_id: *wr_id,
            signaled: *signaled,
            fence: *fence,
            solicited: *solicited,
        }
    }

    /// Checks everything that does not depend on the queue pair. Always inlined, as its callers
    /// (`#[inline]` alone left it a call whose `Result` went through memory).
    #[inline(always)]
    pub(crate) fn validate(&self, pd: &Arc<PdInner>) -> Result<usize> {
        // One pass over the entries (this runs on every safe post).
        let mut f = EntryFacts::default();
        for s in entries(&self.sges) {
            f.count += 1;
            f.len += u64::from(s.len);
            f.read_only |= !s.buf.device_writable();
            f.owned |= matches!(s.buf, LocalBuf::Owned(_) | LocalBuf::Chunk(_) | LocalBuf::Window(_));
            f.foreign |= !s.buf.in_pd(pd);
            if let Some(reason) = s.unusable() {
                f.unusable = Some(reason);
            }
        }
        self.check_entries(f, pd)
    }

    /// The checks of [`validate`](Self::validate), given what its entries are (owned ones, or a
    /// scope's borrowed ones); returns the entry count. Always inlined: one instance per
    /// caller keeps the owned post's code as it was before the scoped level shared it (17
    /// instructions per post under callgrind otherwise).
    #[inline(always)]
    pub(crate) fn check_entries(&self, f: EntryFacts, pd: &Arc<PdInner>) -> Result<usize> {
        let bad = |reason| Err(Error::InvalidArgument { verb: "ibv_post_send", reason });
        let EntryFacts { count, len: sge_len, read_only, owned, foreign, unusable } = f;
        if let Some(reason) = unusable {
            return bad(reason);
        }
        if foreign {
            return bad("a buffer's memory region belongs to another protection domain");
        }
        if let Some(w) = &self.window {
            if count != 0 || self.inline.is_some() || self.imm.is_some() {
                return bad("a window bind or invalidate carries no data");
            }
            if !self.signaled {
                return bad(
                    "a window bind or invalidate must be signaled (its completion returns the window)",
                );
            }
            if !w.window().in_pd(pd) || !w.mr().in_pd(pd) {
                return bad("the window or its memory region belongs to another protection domain");
            }
        }
        let device_writes = matches!(self.op, Op::Read(_) | Op::CompareSwap { .. } | Op::FetchAdd { .. });
        if device_writes && read_only {
            return bad("the device writes this buffer: pass an owned MemoryRegion or a RemoteMemoryRegion");
        }
        if !self.signaled && owned {
            return bad("an unsignaled request can only hold shared (Arc) buffers");
        }
        if self.imm.is_some() && !matches!(self.op, Op::Send | Op::Write(_)) {
            return bad("immediate data only goes with Send and RDMA Write");
        }
        if self.inline.is_some() && !matches!(self.op, Op::Send | Op::Write(_) | Op::SendInv(_)) {
            return bad("inline data only goes with Send and RDMA Write");
        }
        let len = self.inline.map_or(sge_len, |d| d.len() as u64);
        match self.op {
            Op::Send | Op::SendInv(_) => {}
            Op::BindMw | Op::LocalInv => {
                if self.window.is_none() {
                    return bad("a window operation without its window");
                }
            }
            Op::Write(r) | Op::Read(r) => {
                if len > r.len {
                    return Err(Error::OutOfBounds { verb: "ibv_post_send", offset: 0, len, size: r.len });
                }
            }
            Op::CompareSwap { remote, .. } | Op::FetchAdd { remote, .. } => {
                if len != 8 || count != 1 {
                    return bad("an atomic's local buffer is exactly one 8-byte entry");
                }
                if remote.len < 8 {
                    return Err(Error::OutOfBounds {
                        verb: "ibv_post_send",
                        offset: 0,
                        len: 8,
                        size: remote.len,
                    });
                }
                if remote.addr % 8 != 0 {
                    return bad("atomic remote address not 8-byte aligned");
                }
            }
        }
        Ok(count)
    }

    /// Fills `wr` and `sges` (the caller links `next`). Always inlined: the owned post, the
    /// scoped post and `prepare_send` each get their own instance (shared, it cost the owned
    /// post 30 instructions under callgrind).
    #[inline(always)]
    pub(crate) fn fill(
        &self,
        wr: &mut ffi::ibv_send_wr,
        sges: &mut [ffi::ibv_sge; MAX_SGE],
        device_wr_id: u64,
    ) {
        use ffi::ibv_wr_opcode as O;
        let mut flags = send_flags(self.signaled, self.fence, self.solicited);
        // An inline request has no entries (`gather` refuses them, no constructor gives one).
        let n = if let Some(d) = self.inline {
            flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            inline_sge(d, &mut sges[0]) as usize
        } else {
            pack_sges(&self.sges, sges)
        };
        wr.wr_id = device_wr_id;
        wr.next = std::ptr::null_mut();
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = n as i32;
        wr.send_flags = flags;
        if let Some(imm) = self.imm {
            wr.__bindgen_anon_1.imm_data = imm.to_be();
        }
        wr.opcode = match self.op {
            Op::Send => send_or_write_opcode(wr, None, self.imm.is_some()),
            Op::Write(r) => send_or_write_opcode(wr, Some(r), self.imm.is_some()),
            Op::Read(r) => {
                wr.wr.rdma =
                    ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: r.addr, rkey: r.rkey };
                O::IBV_WR_RDMA_READ
            }
            Op::CompareSwap { remote, compare, swap } => {
                wr.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                    remote_addr: remote.addr,
                    compare_add: compare,
                    swap,
                    rkey: remote.rkey,
                };
                O::IBV_WR_ATOMIC_CMP_AND_SWP
            }
            Op::FetchAdd { remote, add } => {
                wr.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                    remote_addr: remote.addr,
                    compare_add: add,
                    swap: 0,
                    rkey: remote.rkey,
                };
                O::IBV_WR_ATOMIC_FETCH_AND_ADD
            }
            Op::SendInv(rkey) => {
                wr.__bindgen_anon_1.invalidate_rkey = rkey;
                O::IBV_WR_SEND_WITH_INV
            }
            Op::BindMw => {
                if let Some(w) = &self.window {
                    let r = w.remote();
                    wr.__bindgen_anon_2.bind_mw = ffi::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
                        mw: w.as_raw(),
                        rkey: r.rkey,
                        bind_info: ffi::ibv_mw_bind_info {
                            mr: w.mr_raw(),
                            addr: r.addr,
                            length: r.len,
                            mw_access_flags: w.access().bits(),
                        },
                    };
                }
                O::IBV_WR_BIND_MW
            }
            Op::LocalInv => {
                if let Some(w) = &self.window {
                    wr.__bindgen_anon_1.invalidate_rkey = w.rkey();
                }
                O::IBV_WR_LOCAL_INV
            }
        };
        if let Some(srqn) = self.xrc_srqn {
            wr.qp_type.xrc.remote_srqn = srqn;
        }
        if let Some((ah, qpn, qkey)) = &self.ud {
            wr.wr.ud = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
                ah: ah.as_raw(),
                remote_qpn: *qpn,
                remote_qkey: *qkey,
            };
        }
    }
}

/// A chain posted from an iterator by
/// [`QueuePair::post_send_iter`](crate::QueuePair::post_send_iter) stopped short: the first
/// `posted` requests reached the device (their completions come as usual), the rest did not.
pub struct SendIterError<'a> {
    /// How many requests, from the first, reached the device: 0 when a request failed its
    /// checks or found no room, since then nothing is posted.
    pub posted: usize,
    /// Why the rest did not.
    pub error: Error,
    /// The request refused by a check or for want of room, handed back whole. `None` when the
    /// provider refused the chain (the requests it did not take are dropped, buffers and all).
    pub request: Option<SendRequest<'a>>,
}

impl fmt::Debug for SendIterError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendIterError")
            .field("posted", &self.posted)
            .field("error", &self.error)
            .field("request", &self.request)
            .finish()
    }
}

impl fmt::Display for SendIterError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (after {} posted)", self.error, self.posted)
    }
}

impl std::error::Error for SendIterError<'_> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<SendIterError<'_>> for Error {
    fn from(e: SendIterError<'_>) -> Error {
        e.error
    }
}

/// A receive-queue work request (`struct ibv_recv_wr`): where an incoming Send lands.
///
/// Every buffer must be writable by the device: owned [`MemoryRegion`]s or
/// [`RemoteMemoryRegion`]s.
pub struct RecvRequest {
    pub(crate) sges: [Option<Local>; MAX_SGE],
    pub(crate) wr_id: u64,
}

impl fmt::Debug for RecvRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvRequest")
            .field("sges", &self.sges.iter().flatten().collect::<Vec<_>>())
            .field("wr_id", &self.wr_id)
            .finish()
    }
}

impl RecvRequest {
    /// A receive into `local`.
    #[inline]
    pub fn new(local: Local) -> Self {
        RecvRequest { sges: [Some(local), None, None, None], wr_id: 0 }
    }

    /// A one-entry request again (a single post that failed gives it back: its buffer is back
    /// in `first` unless the provider queued it).
    #[cold]
    pub(crate) fn again(first: Option<Local>, wr_id: u64) -> Self {
        RecvRequest { sges: [first, None, None, None], wr_id }
    }

    /// A receive with no buffer: takes a zero-length Send or an RDMA Write with immediate.
    /// siw's provider refuses it ([`Error::Verb`], `EINVAL`): there, receive into a buffer.
    pub fn empty() -> Self {
        RecvRequest { sges: [None, None, None, None], wr_id: 0 }
    }

    /// Adds a scatter entry: the message fills the entries in order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the request already has [`MAX_SGE`] entries.
    pub fn scatter(mut self, local: Local) -> Result<Self> {
        push_sge(&mut self.sges, local, "ibv_post_recv")?;
        Ok(self)
    }

    /// The caller's identifier, returned in the completion.
    #[inline]
    pub fn wr_id(mut self, wr_id: u64) -> Self {
        self.wr_id = wr_id;
        self
    }

    /// The buffers back (when a request is abandoned).
    pub fn into_buffers(self) -> impl Iterator<Item = LocalBuf> {
        self.sges.into_iter().flatten().map(Local::into_buf)
    }

    pub(crate) fn validate(&self, pd: &Arc<PdInner>) -> Result<usize> {
        let bad = |reason| Err(Error::InvalidArgument { verb: "ibv_post_recv", reason });
        let mut count = 0;
        for s in entries(&self.sges) {
            count += 1;
            if !s.buf.device_writable() {
                return bad(
                    "the device writes receive buffers: pass an owned MemoryRegion or a RemoteMemoryRegion",
                );
            }
            if !s.buf.in_pd(pd) {
                return bad("a buffer's memory region belongs to another protection domain");
            }
            if let Some(reason) = s.unusable() {
                return bad(reason);
            }
        }
        Ok(count)
    }

    pub(crate) fn fill(
        &self,
        wr: &mut ffi::ibv_recv_wr,
        sges: &mut [ffi::ibv_sge; MAX_SGE],
        device_wr_id: u64,
    ) {
        let n = pack_sges(&self.sges, sges);
        wr.wr_id = device_wr_id;
        wr.next = std::ptr::null_mut();
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = n as i32;
    }
}
