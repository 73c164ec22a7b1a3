//! Shared receive queues: one pool of receive requests that many queue pairs consume.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use ibverbs_sys as ffi;

use crate::device::{next_queue_id, ObjectKind};
use crate::error::{cvt, cvt_p, Error, PostError, Result};
use crate::pd::{PdInner, ProtectionDomain};
use crate::post::engine::single_post_result;
use crate::post::prepared::{keep_pins, Pin, PreparedRecv};
use crate::post::registry::{RegisterError, SrqAttachment};
use crate::post::slot::Request;
use crate::post::table::{SlotTable, MAX_SLOTS, SRQ_ID_BITS};
use crate::post::{RecvRequest, Slot, SlotBufs, MAX_SGE};
use crate::queue::cq::{CompletionQueue, CqInner};
use crate::queue::xrc::{check_xrc, XrcDomain};

/// A provider's `post_srq_recv` entry point.
type PostSrqFn =
    unsafe extern "C" fn(*mut ffi::ibv_srq, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32;

const POST: &str = "ibv_post_srq_recv";

/// A CQ this SRQ's queue pairs complete into, with the SRQ's attachment there.
type Attached = (Arc<CqInner>, Arc<SrqAttachment<Slot>>);

pub(crate) struct SrqInner {
    pub(crate) raw: NonNull<ffi::ibv_srq>,
    pub(crate) table: Arc<SlotTable<Slot>>,
    /// The CQs this SRQ's queue pairs complete receives into, each with its attachment there.
    /// Not on the data path: taken when a queue pair is built and when the SRQ goes.
    cqs: Mutex<Vec<Attached>>,
    pub(crate) pd: Arc<PdInner>,
    /// Kept alive for an XRC SRQ.
    pub(crate) _xrcd: Option<Arc<crate::queue::xrc::XrcdInner>>,
    /// The process-unique id prepared receives are checked against (from the queue pairs'
    /// counter: an SRQ never shares one with a queue pair).
    prepared_id: u64,
    /// The buffers of prepared receives, held until the SRQ is destroyed (or pruned at a
    /// `prepare_recv` that finds nothing posted): their slots hold nothing.
    pins: Mutex<Vec<Pin>>,
}

// SAFETY: an SRQ may be used from any thread (providers lock it for posts); the slot table's
// protocol is designed for one producer (enforced by &mut SharedReceiveQueue) and any number of
// consumers on any threads; the CQ list is behind a Mutex.
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl SrqInner {
    /// Attaches this SRQ to `cq` (once per CQ): the CQ's poller then finds the SRQ's slots from
    /// its completions. Reserves the SRQ's depth in the CQ.
    pub(crate) fn attach_to(&self, cq: &Arc<CqInner>, verb: &'static str) -> Result<()> {
        let mut cqs = self.cqs.lock().unwrap_or_else(|e| e.into_inner());
        if cqs.iter().any(|(c, _)| Arc::ptr_eq(c, cq)) {
            return Ok(());
        }
        let att = cq.registry.attach_srq(self.table.clone()).map_err(|e| match e {
            RegisterError::CqTooSmall { needed, capacity } => Error::CqTooSmall { verb, needed, capacity },
            RegisterError::Full => Error::TooManyQueuePairs { verb },
        })?;
        cqs.push((cq.clone(), att));
        Ok(())
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: every queue pair on this SRQ holds an Arc of this inner, so all are destroyed;
        // destroyed once.
        let ret = unsafe { ffi::ibv_destroy_srq(self.raw.as_ptr()) };
        if ret == 0 {
            self.pd.ctx.serials.remove(ObjectKind::Srq, self.raw.as_ptr() as usize, self.prepared_id);
        } else {
            // The SRQ may still be live in the device: never release its buffers (the CQs'
            // attachments keep the table too; this extra count is never given back), nor the
            // prepared receives' pinned regions.
            std::mem::forget(self.table.clone());
            std::mem::forget(std::mem::take(self.pins.get_mut().unwrap_or_else(|e| e.into_inner())));
            return;
        }
        // The device no longer touches the buffers and no new completion names the SRQ. Retire
        // the attachments first (each CQ's poller then finishes the release if a drop below
        // panics), then take back every posted slot: CAS per slot, so pollers taking stale
        // completions on other threads right now are no problem.
        let cqs = std::mem::take(self.cqs.get_mut().unwrap_or_else(|e| e.into_inner()));
        for (cq, att) in &cqs {
            cq.registry.retire_srq(att);
        }
        // SAFETY: ibv_destroy_srq succeeded.
        unsafe { self.table.release_all() };
    }
}

/// What [`SharedReceiveQueue::query`] reports (`struct ibv_srq_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[doc(alias = "ibv_srq_attr")]
pub struct SrqAttr {
    /// Receive requests the SRQ holds (as granted by the device: at least what was asked).
    pub max_wr: u32,
    /// Scatter/gather entries per receive request.
    pub max_sge: u32,
    /// The armed limit (0: not armed).
    pub srq_limit: u32,
}

/// A shared receive queue (`struct ibv_srq`): receive requests that any queue pair built on it
/// ([`QueuePairBuilder::srq`](crate::QueuePairBuilder::srq)) consumes, in whatever order they
/// take them.
///
/// Posting takes `&mut self`: the SRQ keeps each posted buffer until the completion (on the
/// receive CQ of whichever queue pair took the request) hands it back. Dropping the handle
/// destroys the SRQ (`ibv_destroy_srq()`) once every queue pair on it is gone too (each holds
/// it); buffers still posted are released then.
///
/// Drain a queue pair's receive completions before dropping or resetting it: mlx4 and mlx5
/// erase the completions of a destroyed or reset queue pair still in its CQ and give their
/// receives back to the SRQ inside the provider, which this crate does not see, so those
/// receives' slots (and buffers) stay taken until the SRQ goes. (Move the queue pair to ERROR
/// with [`QueuePair::set_error`](crate::QueuePair::set_error) and poll until its flushed
/// completions are in.)
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
    post_fn: Option<PostSrqFn>,
    max_sge: u32,
    chain: Box<[ffi::ibv_recv_wr]>,
    chain_sges: Box<[[ffi::ibv_sge; MAX_SGE]]>,
    /// The slots a post claimed, per request of the chain.
    claimed: Box<[u32]>,
}

// SAFETY: see SrqInner; the scratch arrays are touched only under &mut self.
unsafe impl Send for SharedReceiveQueue {}
// SAFETY: &self methods only query the SRQ or modify its limit, which providers make thread-safe.
unsafe impl Sync for SharedReceiveQueue {}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("capacity", &self.capacity())
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

/// A process-wide SRQ number for `wr_id`s (29 bits). Never reused: two SRQs attached to one CQ
/// must never share a number (a completion of one could then take a slot of the other), so after
/// 2^29 − 1 SRQs in one process, creating more fails instead of wrapping. Taken only once the
/// device made the SRQ ([`srq_id_for`]): failed attempts use none up.
fn next_srq_id(verb: &'static str) -> Result<u32> {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < (1 << SRQ_ID_BITS) - 1).then_some(n + 1))
        .map_err(|_| Error::InvalidArgument {
            verb,
            reason: "this process has created 2^29 - 1 shared receive queues, the most the safe level can tell apart",
        })
}

/// The number of the SRQ `raw`, just created: on failure (the numbers ran out) it is destroyed.
fn srq_id_for(raw: NonNull<ffi::ibv_srq>, verb: &'static str) -> Result<u32> {
    next_srq_id(verb).inspect_err(|_| {
        // SAFETY: created by the caller and not handed out; nothing was posted to it. A failure
        // leaks it.
        unsafe { ffi::ibv_destroy_srq(raw.as_ptr()) };
    })
}

impl ProtectionDomain {
    /// Creates a shared receive queue of `max_wr` receive requests of up to `max_sge`
    /// scatter/gather entries each (`ibv_create_srq()`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a depth of 0 or above 65536 (the safe level's slot table
    /// names a slot in 16 bits of the `wr_id`); [`Error::Verb`] from `ibv_create_srq()` (e.g.
    /// `EINVAL` above the device's `max_srq_wr`/`max_srq_sge`).
    #[doc(alias = "ibv_create_srq")]
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        check_depth(max_wr, "ibv_create_srq")?;
        // libibverbs copies the whole struct, padding included, over the head of an
        // `ibv_srq_init_attr_ex` (its 4 trailing padding bytes land in `comp_mask`), so the
        // padding must be initialised (valgrind: conditional jump on an uninitialised value in
        // ibv_cmd_create_srq). Kept in a zeroed MaybeUninit and written through its pointer, so
        // no typed copy can make the padding uninitialised again.
        let mut init = std::mem::MaybeUninit::<ffi::ibv_srq_init_attr>::zeroed();
        let p = init.as_mut_ptr();
        crate::error::clear_errno();
        // SAFETY: all-zero is a valid ibv_srq_init_attr (a null pointer and integers); the field
        // writes go through `p`, leaving the padding zero. Valid PD (kept alive by the SRQ's Arc).
        let raw = unsafe {
            (*p).attr.max_wr = max_wr;
            (*p).attr.max_sge = max_sge;
            ffi::ibv_create_srq(self.as_raw(), p)
        };
        let raw = cvt_p("ibv_create_srq", raw).map_err(|e| self.context().explain_queue_failure(e))?;
        let id = srq_id_for(raw, "ibv_create_srq")?;
        Ok(SharedReceiveQueue::from_raw(id, raw, max_wr, max_sge, self.inner.clone(), None))
    }

    /// Creates an XRC shared receive queue in `xrcd` whose completions go to `cq`
    /// (`ibv_create_srq_ex()` with `IBV_SRQT_XRC`). Posting and buffer ownership are those of
    /// any [`SharedReceiveQueue`]; remote XRC senders name it by its SRQ number.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device lacks `IBV_DEVICE_XRC`;
    /// [`Error::InvalidArgument`] for a `cq` or `xrcd` of another device context than the
    /// protection domain; otherwise as [`create_srq`](Self::create_srq), or
    /// [`Error::CqTooSmall`] when `cq` cannot hold the
    /// SRQ's completions, [`Error::TooManyQueuePairs`] when `cq` already serves the most queues
    /// it can track.
    #[doc(alias = "ibv_create_srq_ex")]
    pub fn create_xrc_srq(
        &self,
        xrcd: &XrcDomain,
        cq: &CompletionQueue,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<SharedReceiveQueue> {
        const VERB: &str = "ibv_create_srq_ex";
        check_xrc(&self.context(), VERB)?;
        check_depth(max_wr, VERB)?;
        if !Arc::ptr_eq(&cq.inner.ctx, &self.inner.ctx) || !Arc::ptr_eq(&xrcd.inner._ctx, &self.inner.ctx) {
            return Err(Error::InvalidArgument {
                verb: VERB,
                reason: "the CQ or XRC domain belongs to another device context than the protection domain",
            });
        }
        use ffi::ibv_srq_init_attr_mask as M;
        // Written through the pointer of a zeroed MaybeUninit: the padding stays initialised (see
        // `create_srq`).
        let mut init = std::mem::MaybeUninit::<ffi::ibv_srq_init_attr_ex>::zeroed();
        let p = init.as_mut_ptr();
        // SAFETY: all-zero is a valid ibv_srq_init_attr_ex (null pointers and integers); valid
        // context, PD, XRC domain and CQ (all kept alive by the SRQ's Arcs).
        let raw = unsafe {
            (*p).attr.max_wr = max_wr;
            (*p).attr.max_sge = max_sge;
            (*p).comp_mask = M::IBV_SRQ_INIT_ATTR_TYPE.0
                | M::IBV_SRQ_INIT_ATTR_PD.0
                | M::IBV_SRQ_INIT_ATTR_XRCD.0
                | M::IBV_SRQ_INIT_ATTR_CQ.0;
            (*p).srq_type = ffi::ibv_srq_type::IBV_SRQT_XRC;
            (*p).pd = self.as_raw();
            (*p).xrcd = xrcd.as_raw();
            (*p).cq = cq.as_raw();
            ffi::ibv_create_srq_ex(self.inner.ctx.raw.as_ptr(), p)
        };
        let raw = cvt_p(VERB, raw)?;
        let id = srq_id_for(raw, VERB)?;
        let srq = SharedReceiveQueue::from_raw(
            id,
            raw,
            max_wr,
            max_sge,
            self.inner.clone(),
            Some(xrcd.inner.clone()),
        );
        // Its completions go to `cq`: attach there (dropping `srq` on failure destroys it).
        srq.inner.attach_to(&cq.inner, VERB)?;
        Ok(srq)
    }
}

fn check_depth(max_wr: u32, verb: &'static str) -> Result<()> {
    if max_wr == 0 || max_wr > MAX_SLOTS {
        return Err(Error::InvalidArgument {
            verb,
            reason: "a shared receive queue holds 1..=65536 requests at the safe level",
        });
    }
    Ok(())
}

impl SharedReceiveQueue {
    pub(crate) fn from_raw(
        id: u32,
        raw: NonNull<ffi::ibv_srq>,
        max_wr: u32,
        max_sge: u32,
        pd: Arc<PdInner>,
        xrcd: Option<Arc<crate::queue::xrc::XrcdInner>>,
    ) -> SharedReceiveQueue {
        // SAFETY: the SRQ is valid; its context's ops table belongs to the provider.
        let post_fn = unsafe { (*(*raw.as_ptr()).context).ops.post_srq_recv };
        let chain_len = max_wr as usize;
        let prepared_id = next_queue_id();
        pd.ctx.serials.insert(ObjectKind::Srq, raw.as_ptr() as usize, prepared_id);
        SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                raw,
                table: Arc::new(SlotTable::new(max_wr, id)),
                cqs: Mutex::new(Vec::new()),
                pd,
                _xrcd: xrcd,
                prepared_id,
                pins: Mutex::new(Vec::new()),
            }),
            post_fn,
            max_sge,
            chain: vec![ffi::ibv_recv_wr::default(); chain_len].into_boxed_slice(),
            chain_sges: vec![[ffi::ibv_sge::default(); MAX_SGE]; chain_len].into_boxed_slice(),
            claimed: vec![0; chain_len].into_boxed_slice(),
        }
    }

    /// Identifies this SRQ in [`AsyncEvent`](crate::AsyncEvent)s: compare with
    /// [`AsyncObject::SharedReceiveQueue`](crate::AsyncObject::SharedReceiveQueue). A number
    /// unique in the process, never given to another SRQ (the `struct ibv_srq` address of a
    /// dropped SRQ may be a later one's: an event kept after its SRQ was dropped is not taken
    /// for that later SRQ).
    pub fn id(&self) -> u64 {
        self.inner.prepared_id
    }

    /// The raw `struct ibv_srq *`; valid while this SRQ (or a queue pair on it) lives. What
    /// `ffi` calls may not do with it: see the crate's *Safety model* (raw handles).
    pub fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.inner.raw.as_ptr()
    }

    /// The SRQ number (`ibv_get_srq_num()`): what remote XRC initiators name an XRC SRQ by.
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails (e.g. for an SRQ that is not an XRC SRQ).
    #[doc(alias = "ibv_get_srq_num")]
    pub fn srq_num(&self) -> Result<u32> {
        let mut n = 0;
        // SAFETY: valid SRQ and out-pointer.
        cvt("ibv_get_srq_num", unsafe { ffi::ibv_get_srq_num(self.as_raw(), &mut n) })?;
        Ok(n)
    }

    /// Receive requests the safe level keeps at most (the depth asked for).
    pub fn capacity(&self) -> u32 {
        self.inner.table.capacity()
    }

    /// Receive requests posted through the safe level and not yet completed.
    pub fn outstanding(&self) -> u32 {
        self.inner.table.outstanding()
    }

    /// Arms the SRQ limit (`ibv_modify_srq()` with `IBV_SRQ_LIMIT`): when fewer than `limit`
    /// receive requests remain posted, the device raises
    /// [`AsyncEventType::SRQ_LIMIT_REACHED`](crate::AsyncEventType::SRQ_LIMIT_REACHED) once
    /// (read it with [`Context::async_events`](crate::Context::async_events)) and disarms.
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails (e.g. `EINVAL` for a limit above the depth).
    #[doc(alias = "ibv_modify_srq")]
    pub fn modify_limit(&self, limit: u32) -> Result<()> {
        let mut attr = ffi::ibv_srq_attr { max_wr: 0, max_sge: 0, srq_limit: limit };
        // SAFETY: valid SRQ and attribute struct.
        let ret = unsafe {
            ffi::ibv_modify_srq(self.as_raw(), &mut attr, ffi::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32)
        };
        cvt("ibv_modify_srq", ret)
    }

    /// Queries the SRQ's attributes (`ibv_query_srq()`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the provider does not answer the query (`EOPNOTSUPP`, e.g.
    /// siw; capability "querying an SRQ"); [`Error::Verb`] when the verb fails otherwise.
    #[doc(alias = "ibv_query_srq")]
    pub fn query(&self) -> Result<SrqAttr> {
        let mut attr = ffi::ibv_srq_attr::default();
        // SAFETY: valid SRQ and out-pointer.
        cvt("ibv_query_srq", unsafe { ffi::ibv_query_srq(self.as_raw(), &mut attr) })
            .map_err(|e| e.or_unsupported("querying an SRQ"))?;
        Ok(SrqAttr { max_wr: attr.max_wr, max_sge: attr.max_sge, srq_limit: attr.srq_limit })
    }

    fn check(&self, wr: &RecvRequest) -> Result<()> {
        if wr.validate(&self.inner.pd)? > self.max_sge as usize {
            return Err(Error::InvalidArgument {
                verb: POST,
                reason: "more scatter/gather entries than the SRQ's max_sge",
            });
        }
        Ok(())
    }

    /// Posts one receive request (`ibv_post_srq_recv()`), safely: the SRQ keeps its buffers
    /// until the completion — on the receive CQ of whichever queue pair takes it — hands them
    /// back.
    ///
    /// # Errors
    /// A [`PostError`] handing the request back: [`Error::QueueFull`] when
    /// [`capacity`](Self::capacity) requests are outstanding, [`Error::InvalidArgument`] for a
    /// buffer the device may not write (or of another protection domain), [`Error::Verb`] when
    /// the provider refuses it; [`Error::QueuedWithError`] when it queued the request and then
    /// failed (it stays posted; the `PostError` holds the request without its buffers).
    #[doc(alias = "ibv_post_srq_recv")]
    #[allow(clippy::result_large_err)] // as QueuePair::post_recv: no allocation on the post path
    pub fn post_recv(&mut self, wr: RecvRequest) -> Result<(), PostError<RecvRequest>> {
        if let Err(error) = self.check(&wr) {
            return Err(PostError { error, request: wr });
        }
        let mut wrs = [wr];
        let res = self.post_checked(&mut wrs);
        let [request] = wrs;
        match res {
            Ok(()) => Ok(()),
            Err((_, error)) => Err(PostError { error, request }),
        }
    }

    /// Posts a chain of receive requests with one `ibv_post_srq_recv()` call, safely. On success
    /// `wrs` is empty; on error it holds the requests not posted, with their buffers.
    ///
    /// # Errors
    /// As [`post_recv`](Self::post_recv); [`Error::QueueFull`] is reported before posting when
    /// the chain does not fit.
    #[doc(alias = "ibv_post_srq_recv")]
    pub fn post_recv_chain(&mut self, wrs: &mut Vec<RecvRequest>) -> Result<()> {
        for wr in wrs.iter() {
            self.check(wr)?;
        }
        let posted = self.post_checked(wrs.as_mut_slice());
        match posted {
            Ok(()) => {
                wrs.clear();
                Ok(())
            }
            Err((n, e)) => {
                wrs.drain(..n);
                Err(e)
            }
        }
    }

    /// The posting engine for SRQs: claims a slot per request, publishes them, posts the chain
    /// from the scratch arrays; on failure withdraws what the device did not take and gives the
    /// buffers back. Returns, on error, how many requests were posted.
    fn post_checked(&mut self, wrs: &mut [RecvRequest]) -> std::result::Result<(), (usize, Error)> {
        let n = wrs.len();
        if n == 0 {
            return Ok(());
        }
        let full = Error::QueueFull { verb: POST, capacity: self.capacity() };
        if n > self.chain.len() {
            return Err((0, full));
        }
        let table = &*self.inner.table;
        let slots = &mut self.claimed[..n];
        for k in 0..n {
            // SAFETY: we are the producer (&mut self).
            match unsafe { table.claim() } {
                Some(i) => slots[k] = i,
                None => {
                    for &i in &slots[..k] {
                        table.unclaim(i);
                    }
                    return Err((0, full));
                }
            }
        }
        let base = self.chain.as_mut_ptr();
        let sge_base = self.chain_sges.as_mut_ptr();
        for (k, wr) in wrs.iter_mut().enumerate() {
            // SAFETY: k < n <= both lengths; each element is borrowed only for this iteration.
            let (raw, sges) = unsafe { (&mut *base.add(k), &mut *sge_base.add(k)) };
            // SAFETY: producer; claimed above and not published.
            let wr_id = unsafe { table.wr_id_of(slots[k]) };
            wr.fill_raw(raw, sges, wr_id);
            if k + 1 < n {
                // SAFETY: k + 1 < n <= chain.len().
                RecvRequest::link(raw, unsafe { base.add(k + 1) });
            }
            // SAFETY: producer; claimed and not published. Published before the post: the
            // completion may be polled (on any CQ) before the post returns.
            unsafe { table.publish(slots[k], wr.take_slot()) };
        }
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        let ret = match self.post_fn {
            // SAFETY: valid SRQ; a NULL-terminated chain of n requests in SRQ-owned scratch,
            // describing registered memory of the SRQ's PD held by the published slots until
            // their completions (or the SRQ's destroy).
            Some(f) => unsafe { f(self.inner.raw.as_ptr(), base, &mut bad) },
            None => {
                bad = base; // none posted
                libc::ENOSYS
            }
        };
        if ret == 0 {
            return Ok(());
        }
        // Requests from `bad` on were not posted (all were when `bad` names none of them).
        let (posted, error) = Error::from_post(POST, ret, base, n, bad);
        for (k, wr) in wrs.iter_mut().enumerate().skip(posted) {
            // SAFETY: producer; the provider named these requests as not posted.
            if let Some(slot) = unsafe { table.withdraw(slots[k]) } {
                // SAFETY: k < n; the provider is done with the chain.
                wr.give_back(slot, unsafe { &*sge_base.add(k) });
            }
        }
        Err((posted, error))
    }

    /// Checks `wr` once for this SRQ and keeps its buffer for
    /// [`post_prepared_recv`](Self::post_prepared_recv), as
    /// [`QueuePair::prepare_recv`](crate::QueuePair::prepare_recv) does for a queue pair: exactly
    /// one scatter/gather entry over an `Arc<RemoteMemoryRegion>`, which the SRQ keeps a handle
    /// of until it is destroyed (see [`PreparedRecv`]). A server posts thousands of receives
    /// into one registered region this way, each completion saying (by its `wr_id`) which range
    /// to read.
    ///
    /// # Errors
    /// A [`PostError`] handing the request back: [`Error::InvalidArgument`] for a buffer of
    /// another protection domain or one the device may not write, more scatter/gather entries
    /// than the SRQ's `max_sge`, or a request with more or fewer than one entry or another
    /// buffer type.
    #[allow(clippy::result_large_err)] // the request comes back whole
    pub fn prepare_recv(&self, wr: RecvRequest) -> Result<PreparedRecv, PostError<RecvRequest>> {
        if let Err(error) = self.check(&wr) {
            return Err(PostError { error, request: wr });
        }
        let p = PreparedRecv::from_checked(self.inner.prepared_id, &wr, POST)
            .map_err(|error| PostError { error, request: wr })?;
        // Posting takes &mut self, so nothing is posted while we look: a count of 0 stays 0
        // (completions only lower it).
        keep_pins(&self.inner.pins, self.inner.table.outstanding() == 0, [p.pin()]);
        Ok(p)
    }

    /// Posts a prepared receive (`ibv_post_srq_recv()`) with `wr_id` into bytes
    /// `offset..offset + len` of its buffer, the only check left per post. Its completion comes
    /// on the receive CQ of whichever queue pair takes it and hands no buffer back: read what
    /// arrived from the `RemoteMemoryRegion` at the offset posted (the completion's `wr_id`
    /// says which post it was).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a receive prepared for another SRQ or a queue pair,
    /// [`Error::OutOfBounds`] for a range outside the buffer, [`Error::QueueFull`] when
    /// [`capacity`](Self::capacity) receives are outstanding, or [`Error::Verb`] when the
    /// provider refuses it ([`Error::QueuedWithError`] when it queued the receive and then
    /// failed: it stays posted).
    #[doc(alias = "ibv_post_srq_recv")]
    pub fn post_prepared_recv(
        &mut self,
        prepared: &PreparedRecv,
        wr_id: u64,
        offset: usize,
        len: u32,
    ) -> Result<()> {
        prepared.check(self.inner.prepared_id, offset, len, POST)?;
        let table = &*self.inner.table;
        // SAFETY: we are the producer (&mut self).
        let Some(idx) = (unsafe { table.claim() }) else {
            return Err(Error::QueueFull { verb: POST, capacity: self.capacity() });
        };
        let mut raw = std::mem::MaybeUninit::<ffi::ibv_recv_wr>::uninit();
        let mut sge = std::mem::MaybeUninit::<ffi::ibv_sge>::uninit();
        // The slot holds nothing: the SRQ pins the buffer.
        let slot = Slot { wr_id, bufs: SlotBufs::default(), _ah: None };
        // SAFETY: producer, for the slot just claimed; `raw` and `sge` are valid for writes.
        // Published before the post: the completion may be polled (on any CQ) before the post
        // returns.
        unsafe {
            prepared.fill_one(raw.as_mut_ptr(), sge.as_mut_ptr(), table.wr_id_of(idx), offset, len);
            table.publish(idx, slot);
        }
        let mut bad = std::ptr::null_mut();
        let ret = match self.post_fn {
            // SAFETY: valid SRQ; every field of the request and its SGE was written (fill_one),
            // describing a checked range of a device-writable region of the SRQ's PD that the
            // SRQ's pin holds until it is destroyed.
            Some(f) => unsafe { f(self.inner.raw.as_ptr(), raw.as_mut_ptr(), &mut bad) },
            None => {
                bad = raw.as_mut_ptr(); // names it as not posted
                libc::ENOSYS
            }
        };
        single_post_result(POST, ret, raw.as_ptr(), bad, || {
            // SAFETY: producer; the provider named it as not posted.
            drop(unsafe { table.withdraw(idx) });
        })
    }

    /// Posts a raw chain of receive requests (`ibv_post_srq_recv()`) at exactly C's cost: no
    /// checks, no buffer tracking.
    ///
    /// # Errors
    /// [`Error::Verb`] with the provider's error; `bad_wr` then points at the first request not
    /// posted. [`Error::InvalidArgument`] when the provider has no `post_srq_recv`.
    ///
    /// # Safety
    /// - `wr` heads a valid, `NULL`-terminated chain of `ibv_recv_wr`s whose SGEs name memory
    ///   registered (with the `lkey` given) in this SRQ's protection domain;
    /// - that memory stays registered, allocated and untouched by Rust references until the
    ///   request's completion is polled (on the receive CQ of whichever queue pair takes it) or
    ///   this SRQ is destroyed (its handle and every queue pair on it dropped) — never memory of
    ///   a [`MemoryRegion`](crate::MemoryRegion) that safe code can borrow;
    /// - every `wr_id` has bit 63 clear (bit 63 marks the safe level's requests: a raw request
    ///   carrying one could hand a safe request's buffers back while the device still writes
    ///   them);
    /// - an SGE of length 0 counts as naming the 2 GiB from its address up to the end of its
    ///   memory region (Mellanox devices read a byte count of 0 so, and mlx4 passes a receive's
    ///   as is): the conditions above hold for that memory too, or the chain has no such SGE.
    ///
    /// Not a safety condition, but the caller's duty: the safe level reserves room for
    /// [`capacity`](Self::capacity) completions in each CQ this SRQ's queue pairs complete into;
    /// raw requests beyond it need [`CompletionQueue::unreserved`](crate::CompletionQueue::unreserved)
    /// room there, or completions are lost.
    #[doc(alias = "ibv_post_srq_recv")]
    pub unsafe fn post_recv_raw(
        &mut self,
        wr: *mut ffi::ibv_recv_wr,
        bad_wr: &mut *mut ffi::ibv_recv_wr,
    ) -> Result<()> {
        // Not `ok_or(Error::...)`: that builds (and drops) the error on every call.
        let Some(f) = self.post_fn else {
            return Err(Error::InvalidArgument { verb: POST, reason: "no post_srq_recv" });
        };
        // SAFETY: the caller's contract.
        cvt(POST, unsafe { f(self.as_raw(), wr, bad_wr) })
    }
}
