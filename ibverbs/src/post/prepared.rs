//! Prepared requests: the fixed parts of a send-queue request (opcode, flags, remote key,
//! immediate data, UD address, local key) built and checked once, then posted many times with
//! only the `wr_id`, the local range and the remote offset changing, checked cheaply.

use std::cell::UnsafeCell;
use std::fmt;
use std::ptr::{addr_of_mut, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::ah::AhInner;
use crate::error::{Error, Result};
use crate::memory::{MemoryRegion, RemoteMemoryRegion, RemoteSlice};
use crate::post::ring::Ring;
use crate::post::slot::{Request, Slot, SlotBufs};
use crate::post::wr::{LocalBuf, Op, RecvRequest, SendRequest, MAX_SGE};

/// A send-queue request prepared for one queue pair by
/// [`QueuePair::prepare_send`](crate::QueuePair::prepare_send), posted with
/// [`QueuePair::post_prepared`](crate::QueuePair::post_prepared).
///
/// It holds a *shared* buffer (`Arc<MemoryRegion>` read by the device, or
/// `Arc<RemoteMemoryRegion>`), because it is posted again and again. Preparing *pins* the buffer
/// (and a UD request's address handle) to the queue pair: the queue pair keeps one handle of
/// its own, so a post's slot holds nothing and its completion hands no buffer back. The pin
/// goes when the queue pair is dropped (after `ibv_destroy_qp`), or earlier, at a later
/// [`prepare_send`](crate::QueuePair::prepare_send) that finds no post of the queue pair
/// outstanding and nobody else holding the buffer.
///
/// A Send or RDMA Write from an `Arc<MemoryRegion>` goes inline (`IBV_SEND_INLINE`: the CPU
/// copies the bytes during the post, as perftest does for small messages) when a post's length
/// is at most the queue pair's `max_inline_data`
/// ([`QueuePairBuilder::max_inline_data`](crate::QueuePairBuilder::max_inline_data); none, not even
/// an empty one, where that is 0). Nothing can
/// write such a region while it is shared. An `Arc<RemoteMemoryRegion>`'s bytes are never copied
/// inline: another thread may be writing them, and the provider's copy is not atomic.
///
/// A Send or RDMA Write with inline data ([`SendRequest::send_inline`],
/// [`SendRequest::write_inline`]) prepares too: it holds no buffer, and each post brings its
/// bytes, copied by the provider during the post
/// ([`QueuePair::post_prepared_inline`](crate::QueuePair::post_prepared_inline)), as the
/// unsafe level posts one prebuilt inline request again and again. The data given at
/// preparation only sets the request's kind; it is not kept.
pub struct PreparedSend {
    /// The queue pair it was checked for (its process-unique id: an `ibv_qp` address could be
    /// reused by a queue pair of another type or PD once the first is gone).
    pub(crate) qp: u64,
    /// Process-unique and never 0 (never reused): which template a [`PreparedScratch`] entry
    /// holds.
    id: u64,
    /// The work request with everything but `wr_id`, the SGE and the remote address filled in.
    template: ffi::ibv_send_wr,
    lkey: u32,
    /// Start address and length of the local buffer.
    base: u64,
    buf: SharedBuf,
    /// What the variable parts of a post must fit.
    pub(crate) limits: Limits,
    ah: Option<Arc<AhInner>>,
    /// Posts of fewer bytes than this go inline: `max_inline_data + 1`, or 0 for none (see the
    /// type's docs).
    inline_below: u64,
    /// The template's `send_flags` with `IBV_SEND_INLINE`: a post picks these or the
    /// template's, one select.
    inline_flags: u32,
    /// For a request prepared with inline data: the most bytes a post may bring (the queue
    /// pair's `max_inline_data`). `None` for a request over a buffer.
    inline_cap: Option<u32>,
    /// The request a single post hands the provider, kept from post to post so that a post
    /// writes only what changes, as a C program reposts one prebuilt request. Written and read
    /// only by [`PreparedPost::stage`], whose caller holds `&mut` the queue pair this request was
    /// prepared for.
    staged: UnsafeCell<Staged>,
}

/// A [`PreparedSend`]'s staged request: the template and its one SGE (`sg_list` is set by each
/// post: the value may have moved since the last one).
struct Staged {
    wr: ffi::ibv_send_wr,
    sge: ffi::ibv_sge,
}

impl Staged {
    fn new(template: &ffi::ibv_send_wr, lkey: u32) -> UnsafeCell<Staged> {
        UnsafeCell::new(Staged { wr: *template, sge: ffi::ibv_sge { addr: 0, length: 0, lkey } })
    }
}

// SAFETY: the raw pointers in `template` and `staged` (the UD address handle) point to objects
// this value keeps alive through its own `Arc`s, and are only read (copied into posts, or by
// the provider during a post); `staged.wr.sg_list` points into the value itself, rewritten
// before each use. The rest is owned data and Send + Sync handles.
unsafe impl Send for PreparedSend {}
// SAFETY: as above; shared access only reads, except `staged`, which only
// `PreparedPost::stage` touches, and its caller holds `&mut` the one queue pair the request was
// prepared for (queue pair ids are unique in the process): one thread at a time.
unsafe impl Sync for PreparedSend {}

impl fmt::Debug for PreparedSend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedSend")
            .field("opcode", &self.template.opcode.0)
            .field("buf_len", &self.limits.buf_len)
            .field("remote", &self.limits.remote)
            .finish_non_exhaustive()
    }
}

/// The buffer of a prepared request.
enum SharedBuf {
    Local(Arc<MemoryRegion>),
    Remote(Arc<RemoteMemoryRegion>),
    /// None: prepared with inline data, each post brings its bytes.
    Inline,
}

/// A handle a queue pair keeps for the posts of its prepared requests (see [`PreparedSend`]).
pub(crate) type Pin = Arc<dyn std::any::Any + Send + Sync>;

/// Keeps `new` in `pins`, the pin list of one queue (a queue pair's send or receive queue, an
/// SRQ). `idle` is whether none of that queue's posts is outstanding: then pins nobody else holds
/// (their requests are dropped, and no slot relies on them) are let go first, so the list stays
/// as long as the buffers in use. The caller must hold the queue's producer side off while this
/// runs (posting takes `&mut`, this `&`), so that `idle` stays true.
pub(crate) fn keep_pins(pins: &std::sync::Mutex<Vec<Pin>>, idle: bool, new: impl IntoIterator<Item = Pin>) {
    let mut pins = pins.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if idle {
        pins.retain(|p| Arc::strong_count(p) > 1);
    }
    for p in new {
        if !pins.iter().any(|q| std::ptr::addr_eq(Arc::as_ptr(q), Arc::as_ptr(&p))) {
            pins.push(p);
        }
    }
}

/// Source of [`PreparedSend::id`] (starts at 1: 0 marks an empty scratch entry; 2^64 requests
/// would take centuries).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl PreparedSend {
    /// What the queue pair pins for this request's posts: its buffer and its address handle.
    pub(crate) fn pins(&self) -> [Option<Pin>; 2] {
        let buf: Option<Pin> = match &self.buf {
            SharedBuf::Local(m) => Some(m.clone()),
            SharedBuf::Remote(m) => Some(m.clone()),
            SharedBuf::Inline => None,
        };
        [buf, self.ah.as_ref().map(|a| -> Pin { a.clone() })]
    }

    /// Builds the template from a request the queue pair already checked, on a queue pair whose
    /// `max_inline_data` is `max_inline`. `None` unless it has inline data (and so no entry:
    /// the checks refused any), or exactly one entry, over a shared buffer.
    pub(crate) fn from_checked(qp: u64, max_inline: u32, wr: &SendRequest<'_>) -> Option<PreparedSend> {
        if wr.inline.is_some() {
            return Some(PreparedSend::inline_from_checked(qp, max_inline, wr));
        }
        let mut entries = wr.sges.iter().flatten();
        let (local, rest) = (entries.next()?, entries.next());
        if rest.is_some() {
            return None;
        }
        let (start, buf_len) = (local.buf.device_start(), local.buf.bounds().1);
        let buf = match &local.buf {
            LocalBuf::Shared(m) => SharedBuf::Local(m.clone()),
            LocalBuf::Remote(m) => SharedBuf::Remote(m.clone()),
            // A dma-buf is not prepared: its posts would need a pin of their own, and it must
            // never be copied inline (the CPU does not read it).
            LocalBuf::Owned(_) | LocalBuf::Chunk(_) | LocalBuf::Window(_) | LocalBuf::Dmabuf(_) => {
                return None
            }
        };
        let mut template = ffi::ibv_send_wr::default();
        let mut sges = [ffi::ibv_sge::default(); MAX_SGE];
        wr.fill(&mut template, &mut sges, 0);
        template.sg_list = std::ptr::null_mut();
        let (remote, atomic) = match wr.op {
            Op::Send | Op::SendInv(_) => (None, false),
            // Window operations carry no entry: refused above.
            Op::BindMw | Op::LocalInv => return None,
            Op::Write(r) | Op::Read(r) => (Some(r), false),
            Op::CompareSwap { remote, .. } | Op::FetchAdd { remote, .. } => (Some(remote), true),
        };
        // Inline copies read the bytes with the CPU: only from a region nobody can write, and
        // only where the entry's address is the bytes' host address (the provider copies from
        // it; a region registered with an IOVA names its bytes by the IOVA).
        let inlines =
            matches!(wr.op, Op::Send | Op::SendInv(_) | Op::Write(_)) && local.buf.bounds().0 as u64 == start;
        // None at all on a queue pair without inline room, not even an empty post.
        let inline_below = if inlines && max_inline > 0 && matches!(buf, SharedBuf::Local(_)) {
            u64::from(max_inline) + 1
        } else {
            0
        };
        let inline_flags = template.send_flags | ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        Some(PreparedSend {
            qp,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            staged: Staged::new(&template, sges[0].lkey),
            template,
            lkey: sges[0].lkey,
            base: start,
            buf,
            limits: Limits { buf_len, remote, atomic },
            ah: wr.ud.as_ref().map(|(ah, _, _)| ah.inner.clone()),
            inline_below,
            inline_flags,
            inline_cap: None,
        })
    }

    /// [`from_checked`](Self::from_checked) of a request with inline data (a Send or RDMA
    /// Write, as the checks made sure): no buffer, no local range (a post with a length
    /// through [`at`](Self::at) is refused; posts bring their bytes through
    /// [`QueuePair::post_prepared_inline`](crate::QueuePair::post_prepared_inline)).
    fn inline_from_checked(qp: u64, max_inline: u32, wr: &SendRequest<'_>) -> PreparedSend {
        let mut template = ffi::ibv_send_wr::default();
        let mut sges = [ffi::ibv_sge::default(); MAX_SGE];
        // Sets IBV_SEND_INLINE in the flags; the SGE it points at the preparation's data is
        // dropped with `sges`.
        wr.fill(&mut template, &mut sges, 0);
        template.sg_list = std::ptr::null_mut();
        let remote = match wr.op {
            Op::Write(r) => Some(r),
            _ => None,
        };
        PreparedSend {
            qp,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            staged: Staged::new(&template, 0),
            template,
            lkey: 0,
            // A post's SGE address is `base + offset`: `post_prepared_inline` passes the data's
            // address as the offset.
            base: 0,
            buf: SharedBuf::Inline,
            limits: Limits { buf_len: 0, remote, atomic: false },
            ah: wr.ud.as_ref().map(|(ah, _, _)| ah.inner.clone()),
            inline_below: 0,
            inline_flags: template.send_flags,
            inline_cap: Some(max_inline),
        }
    }

    /// Length of the local buffer the request draws its ranges from (0 for a request prepared
    /// with inline data).
    pub fn buffer_len(&self) -> usize {
        self.limits.buf_len
    }

    /// For a request prepared with inline data, the most bytes one of its posts may bring (the
    /// queue pair's `max_inline_data`); `None` for a request over a buffer.
    pub fn inline_capacity(&self) -> Option<usize> {
        self.inline_cap.map(|n| n as usize)
    }

    /// The post of `data` (inline) with `wr_id` at remote bytes
    /// `remote_offset..remote_offset + data.len()`, checked for the queue pair whose id is
    /// `qp`. Its offset is `data`'s address (the request's base is 0), so the post borrows
    /// `data` as long as it borrows the request.
    #[inline]
    pub(crate) fn inline_post<'a>(
        &'a self,
        qp: u64,
        wr_id: u64,
        data: &'a [u8],
        remote_offset: u64,
    ) -> Result<PreparedPost<'a>> {
        let len = data.len();
        let ok = self.qp == qp
            && self.inline_cap.is_some_and(|cap| len <= cap as usize)
            && Limits { buf_len: len, ..self.limits }.fits(0, len as u32, remote_offset);
        if !ok {
            return Err(self.inline_error(qp, len, remote_offset));
        }
        let flags = self.template.send_flags;
        Ok(PreparedPost {
            prepared: self,
            wr_id,
            offset: data.as_ptr() as usize,
            len: len as u32,
            remote_offset,
            flags,
        })
    }

    /// Why [`inline_post`](Self::inline_post) refused a post.
    #[cold]
    fn inline_error(&self, qp: u64, len: usize, remote_offset: u64) -> Error {
        let bad = |reason| Error::InvalidArgument { verb: "ibv_post_send", reason };
        if self.qp != qp {
            return bad("the request was prepared for another queue pair");
        }
        match self.inline_cap {
            None => bad("the request was prepared over a buffer: post it with post_prepared"),
            Some(cap) if len > cap as usize => bad("inline data larger than the QP's max_inline_data"),
            Some(_) => match (Limits { buf_len: len, ..self.limits }).check(0, len as u32, remote_offset) {
                Err(e) => e,
                Ok(()) => bad("the post does not fit its request"),
            },
        }
    }
}

/// The bounds a prepared request's posts are checked against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Length of the local buffer.
    pub(crate) buf_len: usize,
    /// The remote range of RDMA Write/Read and atomics.
    pub(crate) remote: Option<RemoteSlice>,
    /// Whether the request is an atomic (8 bytes at an 8-byte aligned remote address).
    pub(crate) atomic: bool,
}

impl Limits {
    /// Whether one post's variable parts pass [`check`](Self::check): the same conditions,
    /// as one expression without the error (the chain loop's fast path; a `false` goes to
    /// `check` for the error).
    #[inline]
    pub(crate) fn fits(&self, offset: usize, len: u32, remote_offset: u64) -> bool {
        let local = offset <= self.buf_len && len as usize <= self.buf_len - offset;
        match self.remote {
            None => local && remote_offset == 0,
            Some(r) => {
                local
                    && remote_offset <= r.len
                    && u64::from(len) <= r.len - remote_offset
                    && (!self.atomic || (len == 8 && r.addr.wrapping_add(remote_offset) % 8 == 0))
            }
        }
    }

    /// Checks one post's variable parts.
    pub(crate) fn check(&self, offset: usize, len: u32, remote_offset: u64) -> Result<()> {
        let end = offset.checked_add(len as usize);
        if end.map_or(true, |e| e > self.buf_len) {
            return Err(Error::OutOfBounds {
                verb: "ibv_post_send",
                offset: offset as u64,
                len: u64::from(len),
                size: self.buf_len as u64,
            });
        }
        if let Some(r) = self.remote {
            let end = remote_offset.checked_add(u64::from(len));
            if end.map_or(true, |e| e > r.len) {
                return Err(Error::OutOfBounds {
                    verb: "ibv_post_send",
                    offset: remote_offset,
                    len: u64::from(len),
                    size: r.len,
                });
            }
            if self.atomic && (len != 8 || r.addr.wrapping_add(remote_offset) % 8 != 0) {
                return Err(Error::InvalidArgument {
                    verb: "ibv_post_send",
                    reason: "an atomic moves 8 bytes at an 8-byte aligned remote address",
                });
            }
        } else if remote_offset != 0 {
            return Err(Error::InvalidArgument {
                verb: "ibv_post_send",
                reason: "a Send has no remote offset",
            });
        }
        Ok(())
    }
}

/// One post of a [`PreparedSend`] in a chain: the request, its `wr_id`, its local range
/// `offset..offset + len` and (RDMA Write/Read, atomics) its remote offset; built with
/// [`PreparedSend::at`], posted with
/// [`QueuePair::post_prepared_chain`](crate::QueuePair::post_prepared_chain).
#[derive(Clone, Copy)]
pub struct PreparedPost<'p> {
    pub(crate) prepared: &'p PreparedSend,
    pub(crate) wr_id: u64,
    pub(crate) offset: usize,
    pub(crate) len: u32,
    pub(crate) remote_offset: u64,
    /// `send_flags` of the template with `IBV_SEND_SIGNALED` cleared when the post is
    /// unsignaled.
    pub(crate) flags: u32,
}

impl fmt::Debug for PreparedPost<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedPost")
            .field("wr_id", &self.wr_id)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("remote_offset", &self.remote_offset)
            .field("signaled", &(self.flags & ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 != 0))
            .field("inline", &(self.flags & ffi::ibv_send_flags::IBV_SEND_INLINE.0 != 0))
            .finish_non_exhaustive()
    }
}

impl PreparedSend {
    /// One post of this request with `wr_id`, local bytes `offset..offset + len` and remote
    /// bytes `remote_offset..remote_offset + len`, for
    /// [`QueuePair::post_prepared_chain`](crate::QueuePair::post_prepared_chain) (the ranges
    /// are checked when it is posted). Signaled as the request was prepared; inline when `len`
    /// allows (see [`PreparedSend`]).
    #[inline]
    pub fn at(&self, wr_id: u64, offset: usize, len: u32, remote_offset: u64) -> PreparedPost<'_> {
        let flags =
            if u64::from(len) < self.inline_below { self.inline_flags } else { self.template.send_flags };
        PreparedPost { prepared: self, wr_id, offset, len, remote_offset, flags }
    }
}

impl PreparedPost<'_> {
    /// Clears `IBV_SEND_SIGNALED`: the post produces no completion of its own; its slot is
    /// released by the next signaled completion of the queue pair (a prepared request holds
    /// only shared buffers, so that is always allowed).
    pub fn unsignaled(mut self) -> Self {
        self.flags &= !ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        self
    }
}

/// A chain of prepared posts stopped short:
/// [`QueuePair::post_prepared_chain`](crate::QueuePair::post_prepared_chain) posted the first
/// `posted` of them (their completions come as usual) and not the rest.
#[derive(Debug)]
pub struct PreparedChainError {
    /// How many posts, from the first, reached the device.
    pub posted: usize,
    /// Why the rest did not.
    pub error: Error,
}

impl fmt::Display for PreparedChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (after {} posted)", self.error, self.posted)
    }
}

impl std::error::Error for PreparedChainError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl PreparedPost<'_> {
    /// The slot of a post: its `wr_id` only. The buffer and address handle are pinned to the
    /// queue pair, which the caller checked the request was prepared for.
    #[inline]
    pub(crate) fn slot(&self) -> Slot {
        Slot { wr_id: self.wr_id, bufs: SlotBufs::default(), _ah: None }
    }

    /// [`slot`](Self::slot), written field by field into the ring's slot at `pos`.
    ///
    /// # Safety
    /// As [`Ring::write`]: the producer, for a free position.
    #[inline]
    pub(crate) unsafe fn write_slot_at(&self, ring: &Ring<Slot>, pos: u32) {
        // SAFETY: the caller's contract.
        unsafe { write_light_slot(ring, pos, self.wr_id) };
    }
}

/// Writes the slot of a post whose buffers the queue pair pins (a prepared send or receive):
/// the caller's `wr_id`, no buffer, no address handle, into the ring's slot at `pos`.
///
/// # Safety
/// As [`Ring::write`]: the producer, for a free position.
#[inline]
pub(crate) unsafe fn write_light_slot(ring: &Ring<Slot>, pos: u32, wr_id: u64) {
    // SAFETY: the caller's contract; `light_slot` initialises the whole slot, which holds
    // nothing to drop (light).
    unsafe { ring.write_in_place(pos, false, |slot| light_slot(slot, wr_id)) };
}

/// Initialises the slot at `slot` as a light one: `wr_id`, no buffer, no address handle.
///
/// # Safety
/// `slot` points to a free slot (uninitialised, the caller's alone).
#[inline]
pub(crate) unsafe fn light_slot(slot: *mut Slot, wr_id: u64) {
    // SAFETY: the caller's contract; every field is written once, the buffers as `SlotBufs`
    // allows (an empty first entry), so the value is initialised on return.
    unsafe {
        addr_of_mut!((*slot).wr_id).write(wr_id);
        SlotBufs::write_empty(addr_of_mut!((*slot).bufs));
        addr_of_mut!((*slot)._ah).write(None);
    }
}

/// A receive prepared for one queue pair by
/// [`QueuePair::prepare_recv`](crate::QueuePair::prepare_recv), posted with
/// [`QueuePair::post_prepared_recv`](crate::QueuePair::post_prepared_recv) into any range of its
/// buffer; or for one shared receive queue by
/// [`SharedReceiveQueue::prepare_recv`](crate::SharedReceiveQueue::prepare_recv), posted with
/// [`SharedReceiveQueue::post_prepared_recv`](crate::SharedReceiveQueue::post_prepared_recv).
///
/// Its buffer is an `Arc<RemoteMemoryRegion>`: the one buffer type the device may write while
/// others hold it (safe code only copies in and out of it, never borrows its bytes), so many
/// receives may be posted into it at once, as C servers post into one registered buffer.
/// Preparing *pins* the buffer to the queue pair (or SRQ), as [`PreparedSend`] does: a post's
/// slot holds nothing and its completion hands no buffer back; the bytes that arrived are read
/// from the region at the offset posted. The pin goes when the queue pair is dropped (after
/// `ibv_destroy_qp`; an SRQ's once it is destroyed, after every queue pair on it), or at a later
/// `prepare_recv` that finds no receive of that queue outstanding and nobody else holding the
/// buffer.
pub struct PreparedRecv {
    /// The queue pair or SRQ it was checked for (its process-unique id: both draw from one
    /// counter).
    qp: u64,
    lkey: u32,
    /// Start address and length of the buffer.
    base: u64,
    buf_len: usize,
    buf: Arc<RemoteMemoryRegion>,
}

impl fmt::Debug for PreparedRecv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedRecv").field("buf_len", &self.buf_len).finish_non_exhaustive()
    }
}

impl PreparedRecv {
    /// Builds it from a request the queue pair (or SRQ) already checked (validated for its PD),
    /// for the queue pair or SRQ whose id is `qp`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `verb` unless the request has exactly one entry, over
    /// an `Arc<RemoteMemoryRegion>`.
    pub(crate) fn from_checked(qp: u64, wr: &RecvRequest, verb: &'static str) -> Result<PreparedRecv> {
        let refused = Error::InvalidArgument {
            verb,
            reason: "a prepared receive has one entry over an Arc<RemoteMemoryRegion>",
        };
        let mut entries = wr.sges.iter().flatten();
        let (Some(local), None) = (entries.next(), entries.next()) else { return Err(refused) };
        let LocalBuf::Remote(buf) = &local.buf else { return Err(refused) };
        Ok(PreparedRecv {
            qp,
            lkey: local.buf.lkey(),
            base: local.buf.device_start(),
            buf_len: local.buf.bounds().1,
            buf: buf.clone(),
        })
    }

    /// What the queue pair pins for this receive's posts.
    pub(crate) fn pin(&self) -> Pin {
        self.buf.clone()
    }

    /// Length of the buffer the receive draws its ranges from.
    pub fn buffer_len(&self) -> usize {
        self.buf_len
    }

    /// Checks one post: prepared for the queue pair or SRQ whose id is `qp`, bytes
    /// `offset..offset + len` inside the buffer; errors name `verb`.
    #[inline]
    pub(crate) fn check(&self, qp: u64, offset: usize, len: u32, verb: &'static str) -> Result<()> {
        if self.qp != qp {
            return Err(Error::InvalidArgument {
                verb,
                reason: "the receive was prepared for another queue pair or SRQ",
            });
        }
        if offset > self.buf_len || len as usize > self.buf_len - offset {
            return Err(Error::OutOfBounds {
                verb,
                offset: offset as u64,
                len: u64::from(len),
                size: self.buf_len as u64,
            });
        }
        Ok(())
    }

    /// Fills `raw` (every field) and its one SGE `sge` for a post into bytes
    /// `offset..offset + len` (checked) at device `wr_id`.
    ///
    /// # Safety
    /// `raw` and `sge` are valid for writes.
    #[inline]
    pub(crate) unsafe fn fill_one(
        &self,
        raw: *mut ffi::ibv_recv_wr,
        sge: *mut ffi::ibv_sge,
        device_wr_id: u64,
        offset: usize,
        len: u32,
    ) {
        // SAFETY: valid for writes (contract); every field written once through raw pointers.
        unsafe {
            raw.write(ffi::ibv_recv_wr {
                wr_id: device_wr_id,
                next: std::ptr::null_mut(),
                sg_list: sge,
                num_sge: i32::from(len != 0),
            });
            sge.write(ffi::ibv_sge {
                addr: self.base.wrapping_add(offset as u64),
                length: len,
                lkey: self.lkey,
            });
        }
    }
}

/// A queue pair's scratch for posts of prepared requests (allocated at its first one): entry
/// `i` keeps the template of the request last posted at index `i` of a chain (`ids[i]` names
/// it), so that posting the same request there again writes only what changes per post.
/// Between posts, every entry's `sg_list` points to its SGE and its `next` to the entry after
/// it (NULL for the last): a chain of `n` sets entry `n - 1`'s `next` to NULL for its post and
/// links it again afterwards ([`PreparedScratch::terminate`], [`PreparedScratch::relink`]).
///
/// The three arrays are allocated once and reached only through the pointers kept here: the
/// provider follows `next` and `sg_list` pointers derived from them, which a reborrow of the
/// allocation would invalidate (Stacked/Tree Borrows).
pub(crate) struct PreparedScratch {
    wrs: NonNull<ffi::ibv_send_wr>,
    sges: NonNull<ffi::ibv_sge>,
    ids: NonNull<u64>,
    len: usize,
}

// SAFETY: the arrays are owned by this value alone (freed in Drop) and hold plain data; the
// AH pointers a template may hold are only copied into posts of the request that keeps the AH
// alive.
unsafe impl Send for PreparedScratch {}
// SAFETY: every access takes &mut self.
unsafe impl Sync for PreparedScratch {}

impl PreparedScratch {
    /// Room for chains of `len` posts (at least 1).
    pub(crate) fn new(len: usize) -> PreparedScratch {
        let len = len.max(1);
        let scratch = PreparedScratch {
            wrs: leak(vec![ffi::ibv_send_wr::default(); len]),
            sges: leak(vec![ffi::ibv_sge::default(); len]),
            ids: leak(vec![0u64; len]),
            len,
        };
        for i in 0..len {
            // SAFETY: i < len: entry i of both arrays, reached through the kept pointers.
            unsafe {
                let wr = scratch.wrs.as_ptr().add(i);
                (*wr).sg_list = scratch.sges.as_ptr().add(i);
                (*wr).next = if i + 1 < len { wr.add(1) } else { std::ptr::null_mut() };
            }
        }
        scratch
    }

    /// Ends the chain at entry `n - 1` (its `next` becomes NULL) for a post of `n` entries.
    ///
    /// # Safety
    /// `1 <= n <= len()`; [`relink`](Self::relink) with the same `n` follows once the provider
    /// returned.
    #[inline]
    pub(crate) unsafe fn terminate(&mut self, n: usize) {
        // SAFETY: n - 1 < len (contract).
        unsafe { (*self.wrs.as_ptr().add(n - 1)).next = std::ptr::null_mut() };
    }

    /// Links entry `n - 1` to entry `n` again after a post of `n` entries (the last entry's
    /// `next` stays NULL).
    ///
    /// # Safety
    /// `1 <= n <= len()`.
    #[inline]
    pub(crate) unsafe fn relink(&mut self, n: usize) {
        if n < self.len {
            // SAFETY: n < len: entries n - 1 and n exist.
            unsafe { (*self.wrs.as_ptr().add(n - 1)).next = self.wrs.as_ptr().add(n) };
        }
    }

    /// How many posts a chain may have.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Entry `i`: its work request, its SGE and the id of the template it holds.
    ///
    /// # Safety
    /// `i < len()`; the pointers are used only until the next call that takes `&mut self`.
    #[inline]
    pub(crate) unsafe fn entry(&mut self, i: usize) -> (*mut ffi::ibv_send_wr, *mut ffi::ibv_sge, *mut u64) {
        // SAFETY: i < len (contract): in bounds of the three arrays.
        unsafe { (self.wrs.as_ptr().add(i), self.sges.as_ptr().add(i), self.ids.as_ptr().add(i)) }
    }
}

/// The first element of `v`'s allocation, given up (freed by [`PreparedScratch`]'s `Drop`).
fn leak<T>(v: Vec<T>) -> NonNull<T> {
    let ptr = Box::into_raw(v.into_boxed_slice()).cast::<T>();
    // SAFETY: Box::into_raw never returns null.
    unsafe { NonNull::new_unchecked(ptr) }
}

impl Drop for PreparedScratch {
    fn drop(&mut self) {
        let len = self.len;
        // SAFETY: the three arrays came from boxed slices of `len` elements (new) and are freed
        // only here.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.wrs.as_ptr(), len)));
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.sges.as_ptr(), len)));
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ids.as_ptr(), len)));
        }
    }
}

impl PreparedPost<'_> {
    /// The error of a post that failed [`PreparedSend::fits`] or was prepared for another
    /// queue pair than `qp` (the chain loop's slow path).
    #[cold]
    pub(crate) fn error(&self, qp: u64) -> Error {
        if self.prepared.qp != qp {
            return Error::InvalidArgument {
                verb: "ibv_post_send",
                reason: "the request was prepared for another queue pair",
            };
        }
        if self.prepared.inline_cap.is_some() && (self.offset, self.len) != (0, 0) {
            return Error::InvalidArgument {
                verb: "ibv_post_send",
                reason: "the request was prepared with inline data: post it with post_prepared_inline",
            };
        }
        match self.prepared.limits.check(self.offset, self.len, self.remote_offset) {
            Err(e) => e,
            // `fits` and `check` test the same conditions (a unit test compares them).
            Ok(()) => {
                Error::InvalidArgument { verb: "ibv_post_send", reason: "the post does not fit its request" }
            }
        }
    }

    /// Fills scratch entry (`raw`, `sge`, `id`) for this post at device `wr_id`: the template's
    /// fields only when the entry holds another request's template (its `next` and `sg_list`
    /// are the scratch's: see [`PreparedScratch`]).
    ///
    /// # Safety
    /// The three pointers come from one [`PreparedScratch::entry`] call and are valid.
    #[inline]
    pub(crate) unsafe fn fill_entry(
        &self,
        (raw, sge, id): (*mut ffi::ibv_send_wr, *mut ffi::ibv_sge, *mut u64),
        wr_id: u64,
    ) {
        let p = self.prepared;
        // SAFETY: valid, exclusive pointers (contract); plain data written field by field (a
        // whole-struct copy is a `memcpy` call on the post path).
        unsafe {
            if *id != p.id {
                let t = &p.template;
                (*raw).opcode = t.opcode;
                (*raw).__bindgen_anon_1 = t.__bindgen_anon_1;
                (*raw).wr = t.wr;
                (*raw).qp_type = t.qp_type;
                (*raw).__bindgen_anon_2 = t.__bindgen_anon_2;
                (*sge).lkey = p.lkey;
                *id = p.id;
            }
            self.write_variable(raw, sge, wr_id);
        }
    }

    /// Writes this post's variable parts (`wr_id`, flags, local range, remote address) into
    /// `raw` and its SGE `sge`, whose other fields hold its request's template: a chain's
    /// scratch entry or a single post's staged request.
    ///
    /// # Safety
    /// `raw` and `sge` are valid for writes, and nothing else accesses them meanwhile.
    #[inline(always)]
    unsafe fn write_variable(&self, raw: *mut ffi::ibv_send_wr, sge: *mut ffi::ibv_sge, wr_id: u64) {
        let p = self.prepared;
        // SAFETY: the caller's contract; plain data written field by field.
        unsafe {
            (*raw).wr_id = wr_id;
            (*raw).num_sge = i32::from(self.len != 0);
            (*raw).send_flags = self.flags;
            (*sge).addr = p.base.wrapping_add(self.offset as u64);
            (*sge).length = self.len;
            if let Some(r) = p.limits.remote {
                // Checked: remote_offset + len <= r.len, and r.addr + r.len does not wrap (a
                // RemoteSlice from decode or slice; a hand-made one at worst names a bad address,
                // which the peer refuses). `remote_addr` is the first field of both `rdma` and
                // `atomic`: one store serves either (asserted below).
                (*raw).wr.rdma.remote_addr = r.addr.wrapping_add(self.remote_offset);
            }
        }
    }
}

impl PreparedPost<'_> {
    /// Writes this post's variable parts (`device_wr_id`, flags, local range, remote address)
    /// into its request's staged request, whose fixed parts were written when it was prepared;
    /// returns the staged request, ready for `ibv_post_send` (a single post: `next` is null).
    ///
    /// # Safety
    /// Nothing else accesses the request's staged request from the call until the caller's
    /// last use of the returned pointer: the caller holds `&mut` the queue pair the request was
    /// prepared for (it checked `self.prepared.qp` against that queue pair's id), and uses the
    /// pointer only within that borrow.
    #[inline]
    pub(crate) unsafe fn stage(&self, device_wr_id: u64) -> *mut ffi::ibv_send_wr {
        let staged = self.prepared.staged.get();
        // SAFETY: the caller's contract makes this the only access; plain data, written through
        // raw pointers into an initialised value.
        unsafe {
            let (wr, sge) = (addr_of_mut!((*staged).wr), addr_of_mut!((*staged).sge));
            (*wr).sg_list = sge;
            self.write_variable(wr, sge, device_wr_id);
            wr
        }
    }
}

// `write_variable` writes an atomic's remote address through `wr.rdma`.
const _: () = assert!(
    std::mem::offset_of!(ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1, remote_addr) == 0
        && std::mem::offset_of!(ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2, remote_addr) == 0
);

impl Request for PreparedPost<'_> {
    type Raw = ffi::ibv_send_wr;
    const VERB: &'static str = "ibv_post_send";

    /// The template's fields, then the post's (as a chain's scratch entry is filled), pointing
    /// `raw` at `sges[0]`.
    #[inline]
    fn fill_raw(&self, raw: &mut Self::Raw, sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64) {
        let p = self.prepared;
        let t = &p.template;
        raw.next = std::ptr::null_mut();
        raw.opcode = t.opcode;
        raw.__bindgen_anon_1 = t.__bindgen_anon_1;
        raw.wr = t.wr;
        raw.qp_type = t.qp_type;
        raw.__bindgen_anon_2 = t.__bindgen_anon_2;
        // One pointer for the link and the writes below, so that none invalidates the link.
        let sge = sges.as_mut_ptr();
        raw.sg_list = sge;
        // SAFETY: `raw` and `sge` come from references we hold exclusively.
        unsafe {
            (*sge).lkey = p.lkey;
            self.write_variable(raw, sge, device_wr_id);
        }
    }

    fn link(raw: &mut Self::Raw, next: *mut Self::Raw) {
        raw.next = next;
    }

    #[inline]
    fn take_slot(&mut self) -> Slot {
        self.slot()
    }

    #[inline]
    unsafe fn write_slot(&mut self, ring: &Ring<Slot>, pos: u32) {
        // SAFETY: the caller's contract.
        unsafe { self.write_slot_at(ring, pos) };
    }

    fn give_back(&mut self, slot: Slot, _sges: &[ffi::ibv_sge; MAX_SGE]) {
        drop(slot); // holds nothing (see slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request prepared with inline data holds no buffer; its posts bring their bytes (the
    /// post's offset is their address), checked against the queue pair, `max_inline_data` and
    /// the remote range; a local range through `at` is refused but the empty one.
    #[test]
    fn inline_requests_take_each_posts_bytes_and_check_them() {
        let remote = RemoteSlice { addr: 0x1000, len: 64, rkey: 7 };
        let write = PreparedSend::from_checked(5, 16, &SendRequest::write_inline(b"abc", remote)).unwrap();
        assert_eq!((write.inline_capacity(), write.buffer_len()), (Some(16), 0));
        assert!(write.pins().iter().all(Option::is_none), "nothing to pin");
        let data = [9u8; 17];
        let post = write.inline_post(5, 11, &data[..16], 48).unwrap();
        assert_eq!(
            (post.wr_id, post.offset, post.len, post.remote_offset),
            (11, data.as_ptr() as usize, 16, 48)
        );
        let inline = ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        assert_ne!(post.flags & inline, 0);
        assert!(write.inline_post(5, 0, &[], 64).is_ok(), "empty, at the end of the range");
        let refused = |r: Result<PreparedPost<'_>>| r.map(|_| ()).unwrap_err();
        assert!(matches!(refused(write.inline_post(6, 0, &data[..1], 0)), Error::InvalidArgument { .. }));
        assert!(matches!(refused(write.inline_post(5, 0, &data, 0)), Error::InvalidArgument { .. }));
        assert!(matches!(refused(write.inline_post(5, 0, &data[..8], 57)), Error::OutOfBounds { .. }));
        assert!(matches!(refused(write.inline_post(5, 0, &data[..1], u64::MAX)), Error::OutOfBounds { .. }));
        // Through `at`: only the empty range fits, and the refusal says how to post it.
        assert!(write.limits.fits(0, 0, 8));
        assert!(!write.limits.fits(0, 4, 0));
        assert!(matches!(write.at(0, 0, 4, 0).error(5), Error::InvalidArgument { .. }));
        assert!(matches!(write.at(0, 0, 0, 65).error(5), Error::OutOfBounds { .. }));

        let send = PreparedSend::from_checked(5, 16, &SendRequest::send_inline(&[]).imm(3)).unwrap();
        assert!(send.inline_post(5, 0, &data[..16], 0).is_ok());
        assert!(matches!(refused(send.inline_post(5, 0, &data[..1], 1)), Error::InvalidArgument { .. }));
    }

    /// `Request::fill_raw` (an extended queue pair's post) writes the template's fields and the
    /// post's over whatever the entry held before, and points the request at its first SGE,
    /// read back through that pointer (under Miri, a stale pointer fails).
    #[test]
    fn fill_raw_writes_the_whole_request_over_an_old_one() {
        let remote = RemoteSlice { addr: 0x1000, len: 64, rkey: 7 };
        let write = PreparedSend::from_checked(5, 16, &SendRequest::write_inline(b"abc", remote)).unwrap();
        let data = [9u8; 8];
        let post = write.inline_post(5, 11, &data, 8).unwrap();
        let mut raw = ffi::ibv_send_wr {
            wr_id: 1,
            next: NonNull::dangling().as_ptr(),
            num_sge: 3,
            opcode: ffi::ibv_wr_opcode::IBV_WR_SEND,
            send_flags: !0,
            ..Default::default()
        };
        let mut sges = [ffi::ibv_sge { addr: 1, length: 2, lkey: 3 }; MAX_SGE];
        post.fill_raw(&mut raw, &mut sges, 77);
        assert_eq!((raw.wr_id, raw.num_sge, raw.opcode), (77, 1, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE));
        assert!(raw.next.is_null());
        assert_eq!(raw.send_flags, write.template.send_flags);
        // SAFETY: `rdma` is the union member of an RDMA Write; `sg_list` points into `sges`.
        let (rdma, sge) = unsafe { (raw.wr.rdma, *raw.sg_list) };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0x1008, 7));
        assert_eq!((sge.addr, sge.length, sge.lkey), (data.as_ptr() as u64, 8, 0));
    }

    /// `fits` (the chain loop's fast path) and `check` agree, at and around every boundary,
    /// including offsets near the top of their types and remote ranges that end at 2^64.
    #[test]
    fn fits_agrees_with_check() {
        let remote = |addr, len| Some(RemoteSlice { addr, len, rkey: 7 });
        let limits = [
            Limits { buf_len: 64, remote: None, atomic: false },
            Limits { buf_len: 0, remote: None, atomic: false },
            Limits { buf_len: 64, remote: remote(0x1000, 64), atomic: false },
            Limits { buf_len: 64, remote: remote(0x1004, 16), atomic: true },
            Limits { buf_len: 64, remote: remote(u64::MAX - 15, 16), atomic: false },
            Limits { buf_len: usize::MAX, remote: remote(0, u64::MAX), atomic: false },
            Limits { buf_len: 8, remote: remote(u64::MAX - 7, 8), atomic: true },
        ];
        let offsets = [0, 1, 4, 7, 8, 56, 63, 64, 65, usize::MAX - 8, usize::MAX];
        let lens = [0, 1, 4, 8, 9, 64, 65, u32::MAX];
        let remote_offsets = [0, 1, 4, 8, 12, 16, 56, 64, 65, u64::MAX - 8, u64::MAX];
        let mut accepted = 0;
        for l in &limits {
            for &o in &offsets {
                for &n in &lens {
                    for &r in &remote_offsets {
                        let ok = l.check(o, n, r).is_ok();
                        assert_eq!(l.fits(o, n, r), ok, "{l:?} offset {o} len {n} remote offset {r}");
                        accepted += usize::from(ok);
                    }
                }
            }
        }
        assert!(accepted > 100, "the inputs reach the accepting side too ({accepted})");
    }
}
