//! The posting engine: a typed request moves its buffers into a slot of its work queue's
//! [`Ring`] and becomes a raw work request whose `wr_id` names that slot; the provider's post call
//! takes it from there. On failure the slot is withdrawn and the buffers go back to the request.

use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::error::{Error, Result};
use crate::post::prepared::{
    light_slot, write_light_slot, PreparedChainError, PreparedPost, PreparedRecv, PreparedScratch,
    PreparedSend,
};
use crate::post::registry::{RegisterError, Registry};
use crate::post::ring::Ring;
use crate::post::slot::{Request, Slot, SlotBufs};
use crate::post::wr::{LightSend, Local, LocalBuf, RecvRequest, SendIterError, SendRequest, MAX_SGE};

/// Registers a queue pair's send and receive rings (`[send, recv]`) in their CQs' registries:
/// all or nothing, and with the CQ room of both checked before either is registered.
pub(crate) fn register_rings(
    send_cq: &Registry<Slot>,
    recv_cq: &Registry<Slot>,
    send_cap: u32,
    recv_cap: u32,
    verb: &'static str,
) -> Result<[Arc<Ring<Slot>>; 2]> {
    let err = |e| match e {
        RegisterError::CqTooSmall { needed, capacity } => Error::CqTooSmall { verb, needed, capacity },
        RegisterError::Full => Error::TooManyQueuePairs { verb },
    };
    if std::ptr::eq(send_cq, recv_cq) {
        return send_cq.register([(send_cap, false), (recv_cap, true)]).map_err(err);
    }
    let [send] = send_cq.register([(send_cap, false)]).map_err(err)?;
    match recv_cq.register([(recv_cap, true)]) {
        Ok([recv]) => Ok([send, recv]),
        Err(e) => {
            // Never posted to: no completion can name it.
            send_cq.unregister(&send);
            Err(err(e))
        }
    }
}

/// Registers only a send ring (a queue pair whose receives come from a shared receive queue).
pub(crate) fn register_send_ring(
    send_cq: &Registry<Slot>,
    send_cap: u32,
    verb: &'static str,
) -> Result<Arc<Ring<Slot>>> {
    match send_cq.register([(send_cap, false)]) {
        Ok([send]) => Ok(send),
        Err(RegisterError::CqTooSmall { needed, capacity }) => {
            Err(Error::CqTooSmall { verb, needed, capacity })
        }
        Err(RegisterError::Full) => Err(Error::TooManyQueuePairs { verb }),
    }
}

/// A provider's `post_send` or `post_recv` entry point.
pub(crate) type RawPost<W> = unsafe extern "C" fn(*mut ffi::ibv_qp, *mut W, *mut *mut W) -> i32;

impl Request for SendRequest<'_> {
    type Raw = ffi::ibv_send_wr;
    const VERB: &'static str = "ibv_post_send";
    // Always: with `#[inline]` alone it stayed a call (and its setup) on every post.
    #[inline(always)]
    fn fill_raw(&self, raw: &mut Self::Raw, sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64) {
        self.fill(raw, sges, device_wr_id);
    }
    fn link(raw: &mut Self::Raw, next: *mut Self::Raw) {
        raw.next = next;
    }
    fn take_slot(&mut self) -> Slot {
        let ah = self.ud.as_ref().map(|(ah, _, _)| ah.inner.clone());
        let mut bufs = take_bufs(&mut self.sges);
        if let Some(w) = self.window.take() {
            // A window request has no SGEs (checked): entry 0 is free.
            debug_assert!(bufs[0].is_none());
            bufs[0] = Some(LocalBuf::Window(w));
        }
        Slot { wr_id: self.wr_id, bufs: SlotBufs::new(bufs), _ah: ah }
    }
    #[inline]
    unsafe fn write_slot(&mut self, ring: &Ring<Slot>, pos: u32) {
        if self.window.is_some() {
            // Rare (a bind or invalidate): built on the stack and moved in.
            // SAFETY: the caller's contract.
            return unsafe { ring.write(pos, self.take_slot()) };
        }
        // What take_slot does, written into the slot where it lies.
        let ah = self.ud.as_ref().map(|(ah, _, _)| ah.inner.clone());
        let (wr_id, sges) = (self.wr_id, &mut self.sges);
        // Heavy when it holds a buffer or an address handle (an inline send from a borrowed
        // slice holds neither).
        let heavy = ah.is_some() || sges[0].is_some();
        let init = |slot: *mut Slot| {
            // SAFETY: `slot` points to the free slot (uninitialised, ours alone); every field
            // and every buffer entry is written exactly once (k counts the entries written,
            // k < MAX_SGE at each write), so the slot's buffers are all initialised
            // (MaybeUninit<T> is laid out as T).
            unsafe {
                std::ptr::addr_of_mut!((*slot).wr_id).write(wr_id);
                std::ptr::addr_of_mut!((*slot)._ah).write(ah);
                let bufs = std::ptr::addr_of_mut!((*slot).bufs).cast::<Option<LocalBuf>>();
                // Compact, in SGE order: slot entry k is the buffer of `ibv_sge` k, up to the
                // first empty entry, where `entries` (the SGEs the device gets) stops too.
                let mut k = 0;
                while k < MAX_SGE {
                    let Some(l) = sges[k].take() else { break };
                    bufs.add(k).write(Some(l.into_buf()));
                    k += 1;
                }
                while k < MAX_SGE {
                    bufs.add(k).write(None);
                    k += 1;
                }
            }
        };
        // SAFETY: the caller's contract; `init` initialises the whole slot.
        unsafe { ring.write_in_place(pos, heavy, init) };
    }
    fn give_back(&mut self, mut slot: Slot, sges: &[ffi::ibv_sge; MAX_SGE]) {
        if matches!(slot.bufs.first_mut(), Some(LocalBuf::Window(_))) {
            if let Some(LocalBuf::Window(w)) = slot.bufs.first_mut().take() {
                self.window = Some(w);
            }
        }
        restore(&mut self.sges, slot, sges);
    }
    fn clear_posted(wrs: &mut Vec<Self>) {
        for wr in wrs.iter_mut() {
            wr.release_posted();
        }
        // SAFETY: shortening a Vec is memory-safe whatever its elements; the requests left
        // undropped hold nothing (see release_posted), so nothing leaks either.
        unsafe { wrs.set_len(0) };
    }
}

impl Request for RecvRequest {
    type Raw = ffi::ibv_recv_wr;
    const VERB: &'static str = "ibv_post_recv";
    fn fill_raw(&self, raw: &mut Self::Raw, sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64) {
        self.fill(raw, sges, device_wr_id);
    }
    fn link(raw: &mut Self::Raw, next: *mut Self::Raw) {
        raw.next = next;
    }
    fn take_slot(&mut self) -> Slot {
        Slot { wr_id: self.wr_id, bufs: SlotBufs::new(take_bufs(&mut self.sges)), _ah: None }
    }
    fn give_back(&mut self, slot: Slot, sges: &[ffi::ibv_sge; MAX_SGE]) {
        restore(&mut self.sges, slot, sges);
    }
}

/// Posts one checked request on `ring`'s work queue of `qp`; on error the request keeps its
/// buffers (taken by reference: the request is not moved again on the post path).
#[inline]
pub(crate) fn post_one<R: Request>(
    qp: *mut ffi::ibv_qp,
    ring: &Ring<Slot>,
    post: Option<RawPost<R::Raw>>,
    wr: &mut R,
) -> Result<()> {
    let (head, free) = ring.producer_state();
    if free == 0 {
        return Err(Error::QueueFull { verb: R::VERB, capacity: ring.capacity() });
    }
    let mut raw = R::Raw::default();
    let mut sges = [ffi::ibv_sge::default(); MAX_SGE];
    wr.fill_raw(&mut raw, &mut sges, ring.device_wr_id(head));
    // Publish the slot before posting: the completion may be polled before the post returns.
    // SAFETY: we are the producer (the caller holds &mut QueuePair) and `head` is free.
    unsafe { wr.write_slot(ring, head) };
    ring.set_head(head.wrapping_add(1));
    let mut bad = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: valid QP; `raw` and `sges` describe registered memory of the QP's PD held by the
        // slot until its completion (or inline data borrowed by `wr`, copied during this call; or,
        // for a scope's request, memory its borrow keeps until the scope's drain saw this position
        // released).
        Some(f) => unsafe { f(qp, &mut raw, &mut bad) },
        None => {
            bad = std::ptr::addr_of_mut!(raw); // names it as not posted
            libc::ENOSYS
        }
    };
    single_post_result(R::VERB, ret, &raw, bad, || {
        ring.set_head(head);
        // SAFETY: the producer withdrew `head`; the provider named it as not posted.
        let slot = unsafe { ring.take_back(head) };
        wr.give_back(slot, &sges);
    })
}

/// Posts one light send request ([`SendRequest::is_light`], its fields read out by
/// [`SendRequest::light`]): [`post_one`]'s work without the buffers, whose slot holds only the
/// `wr_id` (as a prepared post's), built on the stack.
///
/// # Safety
/// `qp` is a live queue pair whose send queue is `ring` (its producer is the caller) and whose
/// provider call is `post`; `wr.is_light(max_inline)` holds for that queue pair's
/// `max_inline_data` for the request `wr` was read from, and the queue pair is connected (RC or
/// UC) and may post sends: the request passed every check of the general path, and holds
/// nothing the slot must keep.
#[inline(always)]
pub(crate) unsafe fn post_light_one(
    qp: *mut ffi::ibv_qp,
    ring: &Ring<Slot>,
    post: Option<RawPost<ffi::ibv_send_wr>>,
    wr: &LightSend<'_>,
) -> Result<()> {
    let verb = "ibv_post_send";
    let (head, free) = ring.producer_state();
    if free == 0 {
        return Err(Error::QueueFull { verb, capacity: ring.capacity() });
    }
    let mut raw = ffi::ibv_send_wr::default();
    let mut sge = ffi::ibv_sge::default();
    wr.fill(&mut raw, &mut sge, ring.device_wr_id(head));
    // Publish the slot before posting: the completion may be polled before the post returns.
    // SAFETY: we are the producer (contract) and `head` is free (free > 0); a light request
    // holds nothing that must live until its completion (contract), so the slot holds nothing.
    unsafe { write_light_slot(ring, head, wr.wr_id) };
    ring.set_head(head.wrapping_add(1));
    let mut bad = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: valid QP (contract); `raw` and `sge` describe inline data borrowed by `wr`
        // (copied during this call) or none.
        Some(f) => unsafe { f(qp, &mut raw, &mut bad) },
        None => {
            bad = std::ptr::addr_of_mut!(raw); // names it as not posted
            libc::ENOSYS
        }
    };
    if ret != 0 {
        let (posted, error) = Error::from_post(verb, ret, std::ptr::addr_of!(raw), 1, bad);
        // Queued after all (see Error::QueuedWithError): the slot stays published.
        if posted == 0 {
            ring.set_head(head);
            // SAFETY: the producer withdrew `head`; the provider named it as not posted.
            drop(unsafe { ring.take_back(head) });
        }
        return Err(error);
    }
    Ok(())
}

/// Posts a receive request whose only entry is `entry` (taken out of the request, which the
/// caller forgets), with `sge` its scatter/gather entry: [`post_one`]'s work for the
/// common one-buffer receive, without the request's other entries. On error the entry comes
/// back with its buffer (unless the provider queued the request: [`Error::QueuedWithError`]).
///
/// # Safety
/// `qp` is a live queue pair whose receive queue is `ring` (its producer is the caller) and
/// whose provider call is `post`; the request passed every check of the general path
/// (`QueuePair::check_recv`) as a request whose only entry is `entry`, and `sge` is that
/// entry's [`Local::sge`].
#[allow(clippy::result_large_err)] // the entry comes back by value: inlined, no allocation
#[inline(always)]
pub(crate) unsafe fn post_recv_single(
    qp: *mut ffi::ibv_qp,
    ring: &Ring<Slot>,
    post: Option<RawPost<ffi::ibv_recv_wr>>,
    entry: Option<Local>,
    wr_id: u64,
    sge: ffi::ibv_sge,
) -> SingleResult {
    let raw = |device_wr_id, sg_list| ffi::ibv_recv_wr {
        wr_id: device_wr_id,
        next: std::ptr::null_mut(),
        sg_list,
        num_sge: 1,
    };
    // SAFETY: the caller's contract is post_single's, `raw` builds the receive's work request.
    unsafe { post_single("ibv_post_recv", qp, ring, post, entry, wr_id, sge, raw) }
}

/// Posts a send request whose only local buffer is `entry`, with `raw` its filled work request
/// (its `sg_list` names `sge`, written here): [`post_one`]'s work for the common one-buffer
/// Send or RDMA Write, without the request's other fields. On error the entry comes back with
/// its buffer (unless the provider queued the request: [`Error::QueuedWithError`]).
///
/// # Safety
/// `qp` is a live queue pair whose send queue is `ring` (its producer is the caller) and whose
/// provider call is `post`; the request passed every check of the general path
/// (`QueuePair::check_send`) as a request whose only entry is `entry` and that holds nothing
/// else until its completion (no window, no address handle); `raw` is that request's work
/// request as [`SendRequest::fill`] writes it, but for `wr_id`, `next` and `sg_list`, and
/// `sge` is the entry's [`Local::sge`].
#[allow(clippy::result_large_err)] // the entry comes back by value: inlined, no allocation
#[inline(always)]
pub(crate) unsafe fn post_send_single(
    qp: *mut ffi::ibv_qp,
    ring: &Ring<Slot>,
    post: Option<RawPost<ffi::ibv_send_wr>>,
    entry: Option<Local>,
    wr_id: u64,
    mut raw: ffi::ibv_send_wr,
    sge: ffi::ibv_sge,
) -> SingleResult {
    let raw = move |device_wr_id, sg_list| {
        raw.wr_id = device_wr_id;
        raw.next = std::ptr::null_mut();
        raw.sg_list = sg_list;
        raw.num_sge = 1;
        raw
    };
    // SAFETY: the caller's contract is post_single's, `raw` completes the send's work request.
    unsafe { post_single("ibv_post_send", qp, ring, post, entry, wr_id, sge, raw) }
}

/// The work of [`post_recv_single`] and [`post_send_single`]: the work request `raw` builds
/// (from the ring position's device `wr_id` and a pointer to `sge`, its only entry) is posted
/// with a slot that holds `entry`'s buffer and the caller's `wr_id`. The entry is taken by
/// value and comes back only with an error, so that it need not live in memory on the way.
///
/// # Safety
/// `qp` is a live queue pair whose work queue of `W` is `ring` (its producer is the caller)
/// and whose provider call for it is `post`; the request passed every check of the general
/// path as a request whose only entry is `entry` and that holds nothing else until its
/// completion; `sge` is the entry's [`Local::sge`], and `raw` builds that request's work
/// request, naming the device `wr_id` and the SGE pointer it gets and nothing else to hold.
#[allow(clippy::result_large_err)] // the entry comes back by value: inlined, no allocation
#[inline(always)]
#[allow(clippy::too_many_arguments)] // the single posts' state, passed as it lies
unsafe fn post_single<W>(
    verb: &'static str,
    qp: *mut ffi::ibv_qp,
    ring: &Ring<Slot>,
    post: Option<RawPost<W>>,
    entry: Option<Local>,
    wr_id: u64,
    mut sge: ffi::ibv_sge,
    raw: impl FnOnce(u64, *mut ffi::ibv_sge) -> W,
) -> SingleResult {
    let (head, free) = ring.producer_state();
    if free == 0 {
        return Err((Error::QueueFull { verb, capacity: ring.capacity() }, entry));
    }
    let mut raw = raw(ring.device_wr_id(head), &mut sge);
    // Publish the slot before posting: the completion may be polled before the post returns.
    // SAFETY: we are the producer (contract) and `head` is free (free > 0).
    unsafe { write_single_slot(ring, head, wr_id, entry.map(Local::into_buf)) };
    ring.set_head(head.wrapping_add(1));
    let mut bad = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: valid QP (contract); `raw` and `sge` describe registered memory of the QP's PD
        // (checked, contract) that the slot holds until the completion.
        Some(f) => unsafe { f(qp, &mut raw, &mut bad) },
        None => {
            bad = std::ptr::addr_of_mut!(raw); // names it as not posted
            libc::ENOSYS
        }
    };
    if ret != 0 {
        return Err(single_refused(verb, ring, head, ret, std::ptr::addr_of!(raw), bad, &sge));
    }
    Ok(())
}

/// Writes the slot at `pos` for a request whose only buffer is `buf`, moved in where the slot
/// lies (no `Slot` built and copied): the caller's `wr_id`, no address handle, the buffer in
/// entry 0 and the other entries empty.
///
/// # Safety
/// As [`Ring::write_in_place`]: the producer, for a free position.
#[inline(always)]
unsafe fn write_single_slot(ring: &Ring<Slot>, pos: u32, wr_id: u64, buf: Option<LocalBuf>) {
    let init = |slot: *mut Slot| {
        // SAFETY: `slot` points to the free slot (uninitialised, ours alone); every field and
        // every buffer entry is written exactly once, so the slot's buffers are all initialised
        // and compact (entry 0 may hold a buffer, the others none) as `SlotBufs` requires
        // (MaybeUninit<T> is laid out as T).
        unsafe {
            std::ptr::addr_of_mut!((*slot).wr_id).write(wr_id);
            std::ptr::addr_of_mut!((*slot)._ah).write(None);
            let bufs = std::ptr::addr_of_mut!((*slot).bufs).cast::<Option<LocalBuf>>();
            bufs.write(buf);
            for k in 1..MAX_SGE {
                bufs.add(k).write(None);
            }
        }
    };
    // SAFETY: the caller's contract; `init` initialises the whole slot. Heavy: it may hold a
    // buffer.
    unsafe { ring.write_in_place(pos, true, init) };
}

/// A single post of one buffer ([`post_recv_single`], [`post_send_single`]) that the provider
/// refused (`ret`, `bad`): unless it queued the request anyway (see
/// [`Error::QueuedWithError`]: the slot stays published), withdraws the slot at `head` and gives
/// its buffer back as the entry over the range `sge` named. Out of line: only failures get here.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)] // the single posts' state, passed as it lies
fn single_refused<W>(
    verb: &'static str,
    ring: &Ring<Slot>,
    head: u32,
    ret: i32,
    raw: *const W,
    bad: *const W,
    sge: &ffi::ibv_sge,
) -> (Error, Option<Local>) {
    let (posted, error) = Error::from_post(verb, ret, raw, 1, bad);
    if posted != 0 {
        return (error, None);
    }
    ring.set_head(head);
    // SAFETY: the producer withdrew `head`; the provider named it as not posted.
    let slot = unsafe { ring.take_back(head) };
    let [first, ..] = slot.bufs.into_array();
    // The SGE was built from this buffer: addr lies in it.
    let entry = first.map(|buf| {
        let offset = sge.addr.wrapping_sub(buf.device_start()) as usize;
        Local { buf, offset, len: sge.length }
    });
    (error, entry)
}

/// What a one-entry post ([`post_recv_single`], [`post_send_single`]) returns: on error, the
/// error and the entry with its buffer (`None` when the provider queued the request).
pub(crate) type SingleResult = std::result::Result<(), (Error, Option<Local>)>;

/// The ring position the first of a batch of `n` requests gets, when the ring has `n` free slots
/// and the scratch arrays (`scratch` entries each) hold `n` requests; else [`Error::QueueFull`].
#[inline]
pub(crate) fn batch_head(ring: &Ring<Slot>, n: usize, scratch: usize, verb: &'static str) -> Result<u32> {
    let (head, free) = ring.producer_state();
    if n > free as usize || n > scratch {
        return Err(Error::QueueFull { verb, capacity: ring.capacity() });
    }
    Ok(head)
}

/// Posts checked requests as one chain (one doorbell), built in the QP's `scratch` arrays; see
/// `QueuePair::post_send_chain`. On error, `wrs` keeps the requests not posted, with their
/// buffers.
pub(crate) fn post_chain<R: Request>(
    qp: *mut ffi::ibv_qp,
    ring: &Ring<Slot>,
    post: Option<RawPost<R::Raw>>,
    scratch: &mut [R::Raw],
    scratch_sges: &mut [[ffi::ibv_sge; MAX_SGE]],
    wrs: &mut Vec<R>,
) -> Result<()> {
    let n = wrs.len();
    if n == 0 {
        return Ok(());
    }
    let head = batch_head(ring, n, scratch.len().min(scratch_sges.len()), R::VERB)?;
    // Every access to the scratch arrays below goes through these two pointers: the provider
    // follows `next` and `sg_list` pointers derived from them, which a later `&mut scratch[i]`
    // would invalidate (Stacked/Tree Borrows).
    let base = scratch.as_mut_ptr();
    let sge_base = scratch_sges.as_mut_ptr();
    for (i, wr) in wrs.iter_mut().enumerate() {
        let pos = head.wrapping_add(i as u32);
        // SAFETY: i < n <= both lengths; each element is borrowed only for this iteration.
        let (raw, sges) = unsafe { (&mut *base.add(i), &mut *sge_base.add(i)) };
        wr.fill_raw(raw, sges, ring.device_wr_id(pos));
        if i + 1 < n {
            // SAFETY: i + 1 < n <= scratch.len().
            R::link(raw, unsafe { base.add(i + 1) });
        }
        // SAFETY: producer; positions head..head + n are free (n <= free).
        unsafe { wr.write_slot(ring, pos) };
    }
    ring.set_head(head.wrapping_add(n as u32));
    let mut bad: *mut R::Raw = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: a valid NULL-terminated chain of n requests in QP-owned scratch, describing
        // memory held by the slots (or inline data borrowed by the requests in `wrs`).
        Some(f) => unsafe { f(qp, base, &mut bad) },
        None => {
            bad = base; // none posted
            libc::ENOSYS
        }
    };
    if ret == 0 {
        R::clear_posted(wrs);
        return Ok(());
    }
    // Requests from `bad` on were not posted (all were when `bad` names none of them).
    let (posted, error) = Error::from_post(R::VERB, ret, base, n, bad);
    if posted == n {
        R::clear_posted(wrs);
        return Err(error);
    }
    ring.set_head(head.wrapping_add(posted as u32));
    for (i, wr) in wrs.iter_mut().enumerate().skip(posted) {
        // SAFETY: withdrawn positions; the provider named them as not posted.
        let slot = unsafe { ring.take_back(head.wrapping_add(i as u32)) };
        // SAFETY: i < n; the provider is done with the chain.
        wr.give_back(slot, unsafe { &*sge_base.add(i) });
    }
    wrs.drain(..posted);
    Err(Error::from_ret(R::VERB, ret))
}

/// Posts the send requests an iterator yields as one chain (one doorbell), each checked by
/// `check`, filled into the QP's `scratch` arrays and moved into its slot as it comes: no
/// request is moved into a `Vec` first. See `QueuePair::post_send_iter`.
///
/// When a request fails `check` or finds no room, nothing is posted: the requests written
/// before it are withdrawn and dropped (with their buffers), and it comes back in the error.
/// If the iterator panics, the requests it yielded before are leaked (never published, their
/// slots are overwritten by later posts): nothing is posted, nothing freed under the device.
///
/// `light` is the queue pair's `max_inline_data` where light requests may skip `check`
/// ([`SendRequest::is_light`]: a connected queue pair that may post sends, classic data path),
/// `None` elsewhere: a light request is written from its [`SendRequest::light`] fields into a slot
/// that holds nothing.
#[inline]
#[allow(clippy::result_large_err)] // the refused request comes back whole, with no allocation
#[allow(clippy::too_many_arguments)] // the queue pair's parts, borrowed apart (as post_chain's)
pub(crate) fn post_send_iter<'a>(
    qp: *mut ffi::ibv_qp,
    ring: &Ring<Slot>,
    post: Option<RawPost<ffi::ibv_send_wr>>,
    scratch: &mut [ffi::ibv_send_wr],
    scratch_sges: &mut [[ffi::ibv_sge; MAX_SGE]],
    wrs: impl IntoIterator<Item = SendRequest<'a>>,
    light: Option<u32>,
    mut check: impl FnMut(&mut SendRequest<'a>) -> Result<()>,
) -> std::result::Result<(), SendIterError<'a>> {
    let verb = "ibv_post_send";
    let (head, free) = ring.producer_state();
    let room = (free as usize).min(scratch.len()).min(scratch_sges.len());
    // As in post_chain: every access to the scratch arrays goes through these two pointers.
    let base = scratch.as_mut_ptr();
    let sge_base = scratch_sges.as_mut_ptr();
    let mut n = 0;
    // The request refused and why (`None`: no room); the error is built after the loop.
    let mut refused = None;
    let mut wrs = wrs.into_iter();
    loop {
        // Each request is worked on where the iterator put it (`next`): moving it out into a
        // binding of its own cost a copy of the whole request per post (callgrind).
        let mut next = wrs.next();
        let Some(wr) = next.as_mut() else { break };
        if n == room {
            refused = next.map(|wr| (None, wr));
            break;
        }
        let pos = head.wrapping_add(n as u32);
        if light.is_some_and(|max_inline| wr.is_light(max_inline)) {
            // SAFETY: as below; a light request passed every check (`light` is the queue
            // pair's `max_inline_data` only where light posts are allowed) and holds nothing
            // the slot must keep, so its slot holds nothing.
            unsafe {
                let (raw, sges) = (&mut *base.add(n), &mut *sge_base.add(n));
                wr.light().fill(raw, &mut sges[0], ring.device_wr_id(pos));
                if n > 0 {
                    (*base.add(n - 1)).next = base.add(n);
                }
                write_light_slot(ring, pos, wr.wr_id);
            }
            // Holds nothing (light): forgetting it skips only tests of its empty fields.
            std::mem::forget(next);
            n += 1;
            continue;
        }
        if let Err(e) = check(wr) {
            refused = next.map(|wr| (Some(e), wr));
            break;
        }
        // SAFETY: n < room <= both lengths; each element is borrowed only for this iteration,
        // and entry n - 1 (linked to this one) was filled in the previous one.
        unsafe {
            let (raw, sges) = (&mut *base.add(n), &mut *sge_base.add(n));
            wr.fill_raw(raw, sges, ring.device_wr_id(pos));
            if n > 0 {
                (*base.add(n - 1)).next = base.add(n);
            }
            // Producer; positions head..head + room are free (room <= free).
            wr.write_slot(ring, pos);
        }
        wr.release_posted();
        // Holds nothing now (its entries and window are in the slot, its address handle let
        // go): forgetting it skips only tests of its empty fields.
        std::mem::forget(next);
        n += 1;
    }
    if let Some((error, request)) = refused {
        for k in 0..n {
            // SAFETY: producer; written above and never published (head not yet moved).
            drop(unsafe { ring.take_back(head.wrapping_add(k as u32)) });
        }
        let error = error.unwrap_or(Error::QueueFull { verb, capacity: ring.capacity() });
        return Err(SendIterError { posted: 0, error, request: Some(request) });
    }
    if n == 0 {
        return Ok(());
    }
    // The last entry's `next` is NULL (fill_raw), so the chain ends there.
    ring.set_head(head.wrapping_add(n as u32));
    let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: a valid NULL-terminated chain of n requests in QP-owned scratch, describing
        // memory held by the slots (or inline data borrowed for 'a, which outlives this call).
        Some(f) => unsafe { f(qp, base, &mut bad) },
        None => {
            bad = base; // none posted
            libc::ENOSYS
        }
    };
    if ret == 0 {
        return Ok(());
    }
    // Requests from `bad` on were not posted (all were when `bad` names none of them).
    let (posted, error) = Error::from_post(verb, ret, base, n, bad);
    ring.set_head(head.wrapping_add(posted as u32));
    for i in posted..n {
        // SAFETY: withdrawn positions; the provider named them as not posted.
        drop(unsafe { ring.take_back(head.wrapping_add(i as u32)) });
    }
    Err(SendIterError { posted, error, request: None })
}

/// Posts prepared requests as one chain (one doorbell; a single post is a chain of one) from the
/// QP's [`PreparedScratch`], checking each (prepared for `qp_id`, ranges in bounds, room in the
/// ring and the scratch) as it is written: a failed check withdraws the ones written before it,
/// so nothing is posted. On a provider error, the number of posts that reached the device comes
/// with it. See `QueuePair::post_prepared_chain` and `post_prepared_iter`.
///
/// `posts` yields the chain's posts, taken as they are written: an iterator that builds them
/// lets them go from registers to the scratch, with no array in between.
#[inline]
pub(crate) fn post_prepared_chain<'p>(
    qp: *mut ffi::ibv_qp,
    qp_id: u64,
    ring: &Ring<Slot>,
    post: Option<RawPost<ffi::ibv_send_wr>>,
    scratch: &mut PreparedScratch,
    posts: impl IntoIterator<Item = PreparedPost<'p>>,
) -> std::result::Result<(), PreparedChainError> {
    let verb = "ibv_post_send";
    let (head, free) = ring.producer_state();
    let room = (free as usize).min(scratch.len());
    let wr_id_base = ring.wr_id_base();
    let slots = ring.light_writer();
    let mut checked: *const PreparedSend = std::ptr::null();
    let mut written = 0;
    // The post refused, if any (`Some(None)`: one post more than there is room for); the error
    // is built after the loop, which keeps the posts in registers.
    let mut refused = None;
    for p in posts {
        let i = written;
        if i == room {
            refused = Some(None);
            break;
        }
        let pr = p.prepared;
        // The queue pair is checked once per run of posts of one request.
        if (!std::ptr::eq(pr, checked) && pr.qp != qp_id) || !pr.limits.fits(p.offset, p.len, p.remote_offset)
        {
            refused = Some(Some(p));
            break;
        }
        checked = pr;
        let pos = head.wrapping_add(i as u32);
        // SAFETY: i < room <= scratch.len(); the entries are used only within this call.
        let entry = unsafe { scratch.entry(i) };
        // SAFETY: one entry's pointers; producer, and positions head..head + room are free
        // (room <= free).
        unsafe {
            p.fill_entry(entry, wr_id_base | u64::from(pos));
            slots.write(pos, |slot| light_slot(slot, p.wr_id));
        }
        written += 1;
    }
    if let Some(p) = refused {
        return Err(refuse_prepared(ring, head, written, p, qp_id));
    }
    let n = written;
    if n == 0 {
        return Ok(());
    }
    // SAFETY: 1 <= n <= scratch.len(); relinked right after the provider's call.
    unsafe { scratch.terminate(n) };
    ring.set_head(head.wrapping_add(n as u32));
    // SAFETY: entry 0 exists (n >= 1).
    let first = unsafe { scratch.entry(0).0 };
    let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: a valid NULL-terminated chain of n requests in QP-owned scratch (linked since
        // its creation, ended at n - 1), describing memory the queue pair's pins hold (checked
        // ranges).
        Some(f) => unsafe { f(qp, first, &mut bad) },
        None => {
            bad = first; // none posted
            libc::ENOSYS
        }
    };
    // SAFETY: as for terminate.
    unsafe { scratch.relink(n) };
    if ret == 0 {
        return Ok(());
    }
    // Requests from `bad` on were not posted (all were when `bad` names none of them).
    let (posted, error) = Error::from_post(verb, ret, first, n, bad);
    ring.set_head(head.wrapping_add(posted as u32));
    for i in posted..n {
        // SAFETY: withdrawn positions; the provider named them as not posted.
        drop(unsafe { ring.take_back(head.wrapping_add(i as u32)) });
    }
    Err(PreparedChainError { posted, error })
}

/// Posts one checked prepared receive into bytes `offset..offset + len` of its buffer
/// (`QueuePair::post_prepared_recv`): built on the stack, its slot light.
#[inline]
pub(crate) fn post_prepared_recv_one(
    qp: *mut ffi::ibv_qp,
    ring: &Ring<Slot>,
    post: Option<RawPost<ffi::ibv_recv_wr>>,
    p: &PreparedRecv,
    wr_id: u64,
    offset: usize,
    len: u32,
) -> Result<()> {
    let verb = "ibv_post_recv";
    let (head, free) = ring.producer_state();
    if free == 0 {
        return Err(Error::QueueFull { verb, capacity: ring.capacity() });
    }
    let mut raw = std::mem::MaybeUninit::<ffi::ibv_recv_wr>::uninit();
    let mut sge = std::mem::MaybeUninit::<ffi::ibv_sge>::uninit();
    // SAFETY: both are valid for writes; producer, and `head` is free (free > 0).
    unsafe {
        p.fill_one(raw.as_mut_ptr(), sge.as_mut_ptr(), ring.device_wr_id(head), offset, len);
        write_light_slot(ring, head, wr_id);
    }
    // Publish the slot before posting: the completion may be polled before the post returns.
    ring.set_head(head.wrapping_add(1));
    let mut bad = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: valid QP; every field of the request and its SGE was written (fill_one),
        // describing a checked range of a device-writable region the queue pair's pin holds.
        Some(f) => unsafe { f(qp, raw.as_mut_ptr(), &mut bad) },
        None => {
            bad = raw.as_mut_ptr(); // names it as not posted
            libc::ENOSYS
        }
    };
    single_post_result(verb, ret, raw.as_ptr(), bad, || {
        ring.set_head(head);
        // SAFETY: the producer withdrew `head`; the provider named it as not posted.
        drop(unsafe { ring.take_back(head) });
    })
}

/// The outcome of a single request built on the stack and posted (`ret` the provider's return,
/// `bad` its `bad_wr`): `Ok` when the provider took it. Otherwise its error, after `withdraw`
/// takes the published slot back, unless the provider queued the request anyway
/// ([`Error::QueuedWithError`]: the slot stays published for its completion).
#[inline(always)]
pub(crate) fn single_post_result<W>(
    verb: &'static str,
    ret: i32,
    raw: *const W,
    bad: *const W,
    withdraw: impl FnOnce(),
) -> Result<()> {
    if ret != 0 {
        let (posted, error) = Error::from_post(verb, ret, raw, 1, bad);
        if posted == 0 {
            withdraw();
        }
        return Err(error);
    }
    Ok(())
}

/// Posts one checked prepared post (`QueuePair::post_prepared` on a classic QP): its request's
/// staged request, with only the post's variable parts written ([`PreparedPost::stage`]).
///
/// # Safety
/// `qp` is a live queue pair whose send queue is `ring` (its producer is the caller) and whose
/// provider call is `post`; the caller holds `&mut` that queue pair, and `p` was checked for it
/// (`p.prepared.qp` is its id, the ranges fit), as [`PreparedPost::stage`] requires.
#[inline(always)] // in each of its callers: outlined, it cost ~20 instructions per post (callgrind)
pub(crate) unsafe fn post_prepared_one(
    qp: *mut ffi::ibv_qp,
    ring: &Ring<Slot>,
    post: Option<RawPost<ffi::ibv_send_wr>>,
    p: &PreparedPost<'_>,
) -> Result<()> {
    let verb = "ibv_post_send";
    let (head, free) = ring.producer_state();
    if free == 0 {
        return Err(Error::QueueFull { verb, capacity: ring.capacity() });
    }
    // SAFETY: the caller's contract (the queue pair's `&mut`, `p` checked for it); producer,
    // and `head` is free (free > 0).
    let raw = unsafe {
        p.write_slot_at(ring, head);
        p.stage(ring.device_wr_id(head))
    };
    // Publish the slot before posting: the completion may be polled before the post returns.
    ring.set_head(head.wrapping_add(1));
    let mut bad = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: valid QP; the staged request is initialised, its variable parts just written
        // (stage), describing memory the queue pair's pins hold (a checked range), or inline
        // bytes the caller lends for this call (`QueuePair::post_prepared_inline`).
        Some(f) => unsafe { f(qp, raw, &mut bad) },
        None => {
            bad = raw; // names it as not posted
            libc::ENOSYS
        }
    };
    // single_post_result's work, spelled out: through its closure this measured path cost 3
    // instructions more per post (callgrind, `post_poll` Prepared:1).
    if ret != 0 {
        let (posted, error) = Error::from_post(verb, ret, raw.cast_const(), 1, bad);
        // Queued after all (see Error::QueuedWithError): the slot stays published.
        if posted == 0 {
            ring.set_head(head);
            // SAFETY: the producer withdrew `head`; the provider named it as not posted.
            drop(unsafe { ring.take_back(head) });
        }
        return Err(error);
    }
    Ok(())
}

/// A prepared chain's post `i` failed its check (`p`, or no room for it when `None`): withdraws
/// the slots written for the posts before it (never published) and returns the error.
#[cold]
#[inline(never)]
fn refuse_prepared(
    ring: &Ring<Slot>,
    head: u32,
    i: usize,
    // By value: a reference would make the chain loop store every post on the stack first.
    p: Option<PreparedPost<'_>>,
    qp_id: u64,
) -> PreparedChainError {
    for k in 0..i {
        // SAFETY: producer; written by the caller and never published (head not yet moved).
        drop(unsafe { ring.take_back(head.wrapping_add(k as u32)) });
    }
    let error = match p {
        Some(p) => p.error(qp_id),
        None => Error::QueueFull { verb: "ibv_post_send", capacity: ring.capacity() },
    };
    PreparedChainError { posted: 0, error }
}

#[inline]
fn take_bufs(sges: &mut [Option<Local>; MAX_SGE]) -> [Option<LocalBuf>; MAX_SGE] {
    // Compact, in SGE order: slot entry i is the buffer of `ibv_sge` i, up to the first empty
    // entry, where `entries` (the SGEs the device gets) stops too.
    let mut out: [Option<LocalBuf>; MAX_SGE] = Default::default();
    for (o, s) in out.iter_mut().zip(sges.iter_mut().map_while(Option::take)) {
        *o = Some(s.into_buf());
    }
    out
}

/// Puts a withdrawn slot's buffers back into the request they came from.
fn restore(dst: &mut [Option<Local>; MAX_SGE], slot: Slot, sges: &[ffi::ibv_sge; MAX_SGE]) {
    for ((d, b), sge) in dst.iter_mut().zip(slot.bufs.into_array()).zip(sges) {
        if let Some(buf) = b {
            // The SGE was built from this buffer: addr lies in it.
            let offset = sge.addr.wrapping_sub(buf.device_start()) as usize;
            *d = Some(Local { buf, offset, len: sge.length });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::post::ring::TAG;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static SEEN: AtomicUsize = AtomicUsize::new(0);

    /// A provider that walks the chain the way a real one does: through `next` and `sg_list`.
    unsafe extern "C" fn walking_provider(
        _qp: *mut ffi::ibv_qp,
        mut wr: *mut ffi::ibv_recv_wr,
        bad: *mut *mut ffi::ibv_recv_wr,
    ) -> i32 {
        let mut count = 0;
        // SAFETY: the engine hands a valid NULL-terminated chain.
        unsafe {
            while !wr.is_null() {
                let w = &*wr;
                assert_ne!(w.wr_id & TAG, 0);
                for k in 0..w.num_sge as usize {
                    let _ = *w.sg_list.add(k);
                }
                count += 1;
                if count == 3 {
                    *bad = wr; // refuse the fourth and later ones
                    SEEN.store(count, Ordering::SeqCst);
                    return libc::ENOMEM;
                }
                wr = w.next;
            }
        }
        SEEN.store(count, Ordering::SeqCst);
        0
    }

    unsafe extern "C" fn refusing_third_send(
        _qp: *mut ffi::ibv_qp,
        mut wr: *mut ffi::ibv_send_wr,
        bad: *mut *mut ffi::ibv_send_wr,
    ) -> i32 {
        let mut count = 0;
        // SAFETY: the engine hands a valid NULL-terminated chain.
        unsafe {
            while !wr.is_null() {
                let w = &*wr;
                assert_eq!(w.num_sge, 1, "8 inline bytes: one SGE");
                assert_eq!((*w.sg_list).length, 8);
                count += 1;
                if count == 3 {
                    *bad = wr;
                    return libc::ENOMEM;
                }
                wr = w.next;
            }
        }
        0
    }

    // A posted chain of send requests is emptied without dropping them one by one
    // (`clear_posted`); a partial post hands the rest back intact.
    #[test]
    fn a_send_chain_is_emptied_when_posted_and_handed_back_from_the_refused_one() {
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(16, false)]).unwrap();
        let mut scratch = vec![ffi::ibv_send_wr::default(); 16];
        let mut sges = vec![[ffi::ibv_sge::default(); MAX_SGE]; 16];
        let data = [7u8; 8];
        let qp = std::ptr::null_mut();
        let mut wrs: Vec<SendRequest<'_>> =
            (0..2).map(|i| SendRequest::send_inline(&data).wr_id(i)).collect();
        post_chain(qp, &ring, Some(refusing_third_send), &mut scratch, &mut sges, &mut wrs).unwrap();
        assert!(wrs.is_empty());
        assert_eq!(ring.outstanding(), 2);

        let mut wrs: Vec<SendRequest<'_>> =
            (10..14).map(|i| SendRequest::send_inline(&data).wr_id(i)).collect();
        let e =
            post_chain(qp, &ring, Some(refusing_third_send), &mut scratch, &mut sges, &mut wrs).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM));
        assert_eq!(ring.outstanding(), 4);
        assert_eq!(wrs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![12, 13]);
        assert!(wrs.iter().all(|w| w.inline.is_some_and(|d| d.len() == 8)));
    }

    // post_send_iter: requests written as they come and posted as one chain; a request that
    // fails its check or finds no room comes back and nothing is posted (the iterator is taken
    // up to it); a provider's refusal keeps the ones before it posted. Under Miri the provider
    // walks the chain through the pointers the loop linked.
    #[test]
    fn requests_from_an_iterator_are_checked_and_written_as_they_come() {
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(16, false)]).unwrap();
        let mut scratch = vec![ffi::ibv_send_wr::default(); 16];
        let mut sges = vec![[ffi::ibv_sge::default(); MAX_SGE]; 16];
        let data = [7u8; 8];
        let qp = std::ptr::null_mut();
        let post = Some(refusing_third_send as RawPost<ffi::ibv_send_wr>);
        let inline = |i| SendRequest::send_inline(&data).wr_id(i);
        let ok = |_: &mut SendRequest<'_>| Ok(());
        // Inline Sends of 8 bytes are light where 8 bytes go inline: those calls take the light
        // path (the refusing check's call the general one).
        let light = Some(8);

        post_send_iter(qp, &ring, post, &mut scratch, &mut sges, (0..2).map(inline), light, ok).unwrap();
        assert_eq!(ring.outstanding(), 2);
        post_send_iter(qp, &ring, post, &mut scratch, &mut sges, std::iter::empty(), light, ok).unwrap();
        assert_eq!(ring.outstanding(), 2);

        // The check refuses wr_id 22: nothing posted, 22 handed back, 23 never taken.
        let taken = std::cell::Cell::new(0);
        let wrs = (20..24).map(|i| {
            taken.set(taken.get() + 1);
            inline(i)
        });
        let refuse_22 = |wr: &mut SendRequest<'_>| {
            if wr.wr_id == 22 {
                return Err(Error::InvalidArgument { verb: "ibv_post_send", reason: "test" });
            }
            Ok(())
        };
        let e = post_send_iter(qp, &ring, post, &mut scratch, &mut sges, wrs, None, refuse_22).unwrap_err();
        assert_eq!(e.posted, 0);
        assert!(matches!(e.error, Error::InvalidArgument { reason: "test", .. }));
        assert_eq!(e.request.as_ref().map(|w| w.wr_id), Some(22));
        assert_eq!(taken.get(), 3);
        assert_eq!(ring.outstanding(), 2, "the two written before it were withdrawn");

        // The provider refuses the third: the two before it stay posted.
        let e = post_send_iter(qp, &ring, post, &mut scratch, &mut sges, (30..34).map(inline), light, ok)
            .unwrap_err();
        assert_eq!(e.posted, 2);
        assert_eq!(e.error.raw_os_error(), Some(libc::ENOMEM));
        assert!(e.request.is_none());
        assert_eq!(ring.outstanding(), 4);

        // 12 free positions: the 13th finds no room and comes back.
        let e = post_send_iter(qp, &ring, post, &mut scratch, &mut sges, (40..60).map(inline), light, ok)
            .unwrap_err();
        assert!(matches!(e.error, Error::QueueFull { capacity: 16, .. }), "{e}");
        assert_eq!((e.posted, e.request.as_ref().map(|w| w.wr_id)), (0, Some(52)));
        assert_eq!(ring.outstanding(), 4);
    }

    // Regression (soundness hole 10): the chain was linked through `scratch[i]` after taking
    // `scratch.as_mut_ptr()`, so the provider followed invalidated pointers (Miri: Stacked
    // Borrows violation).
    #[test]
    fn a_chain_is_walked_through_valid_pointers_and_a_partial_post_hands_the_rest_back() {
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(16, true)]).unwrap();
        let mut scratch = vec![ffi::ibv_recv_wr::default(); 16];
        let mut sges = vec![[ffi::ibv_sge::default(); MAX_SGE]; 16];
        let mut wrs: Vec<RecvRequest> = (0..2).map(|i| RecvRequest::empty().wr_id(i)).collect();
        let qp = std::ptr::null_mut();
        post_chain(qp, &ring, Some(walking_provider), &mut scratch, &mut sges, &mut wrs).unwrap();
        assert!(wrs.is_empty());
        assert_eq!(SEEN.load(Ordering::SeqCst), 2);
        assert_eq!(ring.outstanding(), 2);

        let mut wrs: Vec<RecvRequest> = (10..15).map(|i| RecvRequest::empty().wr_id(i)).collect();
        let e = post_chain(qp, &ring, Some(walking_provider), &mut scratch, &mut sges, &mut wrs).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM));
        assert_eq!(ring.outstanding(), 4, "the two before the refused one stay posted");
        assert_eq!(wrs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![12, 13, 14]);

        let mut wrs: Vec<RecvRequest> = (0..13).map(|_| RecvRequest::empty()).collect();
        assert!(matches!(
            post_chain(qp, &ring, Some(walking_provider), &mut scratch, &mut sges, &mut wrs),
            Err(Error::QueueFull { .. })
        ));
        assert_eq!(wrs.len(), 13, "nothing taken from a chain that does not fit");
    }

    /// What libsiw does when the system call of its doorbell fails after it queued every
    /// request (rxe alike, with a positive errno): an error with `bad_wr` left NULL; libsiw
    /// returns `write(2)`'s -1, the error in `errno`.
    unsafe extern "C" fn queueing_then_failing(
        _qp: *mut ffi::ibv_qp,
        _wr: *mut ffi::ibv_recv_wr,
        _bad: *mut *mut ffi::ibv_recv_wr,
    ) -> i32 {
        // SAFETY: this thread's errno.
        unsafe { *libc::__errno_location() = libc::ENOTCONN };
        -1
    }

    // Regression: requests a provider queued before failing (a NULL `bad_wr`) were counted as
    // not posted and their buffers handed back, while the device could still use them.
    #[test]
    fn requests_queued_before_a_failed_doorbell_stay_posted() {
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(16, true)]).unwrap();
        let mut scratch = vec![ffi::ibv_recv_wr::default(); 16];
        let mut sges = vec![[ffi::ibv_sge::default(); MAX_SGE]; 16];
        let qp = std::ptr::null_mut();
        let queued = |e: &Error| {
            matches!(e, Error::QueuedWithError { verb: "ibv_post_recv", .. })
                && e.raw_os_error() == Some(libc::ENOTCONN)
        };
        let mut wrs: Vec<RecvRequest> = (0..3).map(|i| RecvRequest::empty().wr_id(i)).collect();
        let e = post_chain(qp, &ring, Some(queueing_then_failing), &mut scratch, &mut sges, &mut wrs)
            .unwrap_err();
        assert!(queued(&e), "{e:?}");
        assert!(wrs.is_empty(), "all three stay posted");
        assert_eq!(ring.outstanding(), 3);
        let mut one = RecvRequest::empty().wr_id(9);
        let e = post_one(qp, &ring, Some(queueing_then_failing), &mut one).unwrap_err();
        assert!(queued(&e), "{e:?}");
        assert_eq!(ring.outstanding(), 4);

        // Without a post function nothing is posted.
        let e = post_one(qp, &ring, None, &mut one).unwrap_err();
        assert!(matches!(e, Error::Verb { .. }) && e.raw_os_error() == Some(libc::ENOSYS), "{e:?}");
        let mut wrs = vec![RecvRequest::empty(), RecvRequest::empty()];
        let e = post_chain(qp, &ring, None, &mut scratch, &mut sges, &mut wrs).unwrap_err();
        assert!(matches!(e, Error::Verb { .. }) && e.raw_os_error() == Some(libc::ENOSYS), "{e:?}");
        assert_eq!((wrs.len(), ring.outstanding()), (2, 4));
    }

    /// A provider that reads a single receive through `sg_list` and refuses one of 5 bytes.
    unsafe extern "C" fn reading_recv(
        _qp: *mut ffi::ibv_qp,
        wr: *mut ffi::ibv_recv_wr,
        bad: *mut *mut ffi::ibv_recv_wr,
    ) -> i32 {
        // SAFETY: the engine hands a valid request with `num_sge` entries at `sg_list`.
        unsafe {
            let w = &*wr;
            assert!(w.next.is_null() && w.num_sge == 1 && w.wr_id & TAG != 0);
            if (*w.sg_list).length == 5 {
                *bad = wr;
                return libc::ENOMEM;
            }
        }
        0
    }

    // The single paths (a request of one entry): the slot is written where it lies, taken back
    // when the provider refuses, kept when it queued the request before failing; the completion
    // finds the caller's wr_id. Under Miri the providers read the SGE through the pointer the
    // path built, and a slot entry left uninitialised fails.
    #[test]
    fn single_posts_write_their_slot_in_place_and_withdraw_it_when_refused() {
        let reg = Registry::<Slot>::for_tests(64);
        let [recv, send] = reg.register([(4, true), (4, false)]).unwrap();
        let qp = std::ptr::null_mut();
        let sge = |length| ffi::ibv_sge { addr: 0x1000, length, lkey: 3 };
        // The entry holds no buffer (that takes a device); an error hands it back as it came.
        let recv_post = |post, _: &mut Option<Local>, wr_id, sge| {
            // SAFETY: no queue pair behind it (the providers ignore it); the test is the ring's
            // only producer; the entry holds no buffer, nothing to check.
            unsafe { post_recv_single(qp, &recv, post, None, wr_id, sge) }.map_err(|(e, entry)| {
                assert!(entry.is_none());
                e
            })
        };
        let send_post = |post, _: &mut Option<Local>, wr_id, raw, sge| {
            // SAFETY: as above, for the send ring.
            unsafe { post_send_single(qp, &send, post, None, wr_id, raw, sge) }.map_err(|(e, entry)| {
                assert!(entry.is_none());
                e
            })
        };
        let mut entry: Option<Local> = None;
        recv_post(Some(reading_recv), &mut entry, 7, sge(8)).unwrap();
        assert_eq!(recv.outstanding(), 1);
        let e = recv_post(Some(reading_recv), &mut entry, 8, sge(5)).unwrap_err();
        assert!(matches!(e, Error::Verb { .. }) && e.raw_os_error() == Some(libc::ENOMEM), "{e:?}");
        assert_eq!(recv.outstanding(), 1, "withdrawn");
        let e = recv_post(Some(queueing_then_failing), &mut entry, 9, sge(8)).unwrap_err();
        assert!(matches!(e, Error::QueuedWithError { .. }), "{e:?}");
        let e = recv_post(None, &mut entry, 10, sge(8)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSYS));
        assert_eq!(recv.outstanding(), 2, "the queued one stays posted");
        for _ in 0..2 {
            let e = recv_post(Some(reading_recv), &mut entry, 11, sge(8));
            assert!(e.is_ok());
        }
        let e = recv_post(Some(reading_recv), &mut entry, 12, sge(8)).unwrap_err();
        assert!(matches!(e, Error::QueueFull { capacity: 4, .. }), "{e:?}");

        let mut raw =
            ffi::ibv_send_wr { opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, ..Default::default() };
        raw.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: 0x2000, rkey: 9 };
        raw.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        send_post(Some(reading_send), &mut entry, 21, raw, sge(8)).unwrap();
        let seen = LAST_SEND.take().expect("posted");
        let want = (send.device_wr_id(0), raw.opcode.0, raw.send_flags, 1, 0x1000, 8, 3, 0x2000, 9);
        assert_eq!(seen, want);
        let e = send_post(Some(reading_send), &mut entry, 22, raw, sge(5)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM));
        assert_eq!(send.outstanding(), 1);

        // The completions find the callers' wr_ids (and no buffer).
        let mut c = crate::Completion::default();
        let wc = ffi::ibv_wc { wr_id: recv.device_wr_id(0), ..Default::default() };
        // SAFETY: the registry's only consumer; the entry is fresh.
        unsafe { c.fill(&wc, &reg) };
        assert_eq!((c.wr_id(), c.take_buffers().count()), (7, 0));
        c.clear();
        let wc = ffi::ibv_wc { wr_id: send.device_wr_id(0), ..Default::default() };
        // SAFETY: as above; cleared.
        unsafe { c.fill(&wc, &reg) };
        assert_eq!(c.wr_id(), 21);
        assert_eq!((recv.outstanding(), send.outstanding()), (3, 0));
    }

    /// What [`reading_send`] read from the last request it was handed: `wr_id`, opcode, flags,
    /// SGE count, the SGE's address, length and lkey (zeros without one), remote address and
    /// rkey.
    type Seen = (u64, u32, u32, i32, u64, u32, u32, u64, u32);

    thread_local! {
        static LAST_SEND: std::cell::Cell<Option<Seen>> = const { std::cell::Cell::new(None) };
    }

    /// A provider that reads a single send request as a real one does (through `sg_list`),
    /// records it, and refuses one of 5 bytes.
    unsafe extern "C" fn reading_send(
        _qp: *mut ffi::ibv_qp,
        wr: *mut ffi::ibv_send_wr,
        bad: *mut *mut ffi::ibv_send_wr,
    ) -> i32 {
        // SAFETY: the engine hands a valid request with `num_sge` entries at `sg_list`.
        unsafe {
            let w = &*wr;
            assert!(w.next.is_null(), "a single post");
            let sge = if w.num_sge > 0 { *w.sg_list } else { ffi::ibv_sge::default() };
            let r = w.wr.rdma;
            LAST_SEND.set(Some((
                w.wr_id,
                w.opcode.0,
                w.send_flags,
                w.num_sge,
                sge.addr,
                sge.length,
                sge.lkey,
                r.remote_addr,
                r.rkey,
            )));
            if sge.length == 5 {
                *bad = wr;
                return libc::ENOMEM;
            }
        }
        0
    }

    // A single prepared post hands the provider its request's staged request with this post's
    // variable parts written, the fixed ones kept: from a request moved since its last post
    // too (the SGE pointer is rewritten each time; under Miri a stale one fails). A refused
    // post takes its slot back.
    #[test]
    fn single_prepared_posts_write_only_their_variable_parts() {
        use crate::memory::RemoteSlice;
        use crate::post::prepared::PreparedSend;
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(4, false)]).unwrap();
        let qp = std::ptr::null_mut();
        let remote = RemoteSlice { addr: 0x1000, len: 64, rkey: 7 };
        let write = PreparedSend::from_checked(5, 16, &SendRequest::write_inline(b"abc", remote)).unwrap();
        let (opcode, signaled, inline) = (
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE.0,
            ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ffi::ibv_send_flags::IBV_SEND_INLINE.0,
        );
        let data = [9u8; 16];
        let post = write.inline_post(5, 11, &data, 48).unwrap();
        // SAFETY: no queue pair behind it (the provider ignores it); `post` checked for id 5,
        // the only poster of `write`.
        unsafe { post_prepared_one(qp, &ring, Some(reading_send), &post) }.unwrap();
        let addr = data.as_ptr() as u64;
        let seen = LAST_SEND.take().expect("posted");
        assert_eq!(seen, (ring.device_wr_id(0), opcode, signaled | inline, 1, addr, 16, 0, 0x1030, 7));
        assert_eq!(ring.outstanding(), 1);

        // Moved, then posted empty at the end of the remote range.
        let moved = Box::new(write);
        let post = moved.inline_post(5, 12, &[], 64).unwrap();
        // SAFETY: as above.
        unsafe { post_prepared_one(qp, &ring, Some(reading_send), &post) }.unwrap();
        let seen = LAST_SEND.take().expect("posted");
        assert_eq!((seen.0, seen.3, seen.5, seen.7, seen.8), (ring.device_wr_id(1), 0, 0, 0x1040, 7));
        assert_eq!(ring.outstanding(), 2);

        // Refused: the slot is taken back; without a provider call nothing is posted.
        let post = moved.inline_post(5, 13, &data[..5], 0).unwrap();
        // SAFETY: as above.
        let e = unsafe { post_prepared_one(qp, &ring, Some(reading_send), &post) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM));
        assert_eq!(LAST_SEND.take().map(|s| (s.0, s.5)), Some((ring.device_wr_id(2), 5)));
        // SAFETY: as above.
        let e = unsafe { post_prepared_one(qp, &ring, None, &post) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSYS));
        assert_eq!(ring.outstanding(), 2);
    }
}
