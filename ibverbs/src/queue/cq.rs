//! Completion queues and polling.

use std::collections::VecDeque;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;

use crate::device::{next_queue_id, Context, ContextInner, CqId, ObjectKind};
use crate::error::{cvt, cvt_p, Error, Result};
use crate::post::registry::{RegisterError, Registry};
use crate::post::Slot;
use crate::queue::channel::{ChannelInner, CompletionChannel, CqEvents};
use crate::queue::completion::{Completion, WorkCompletion};
use crate::queue::cq_ex::{poll_into_ex, ExCq, WcFlags};

/// A provider's `poll_cq` entry point.
type PollFn = unsafe extern "C" fn(*mut ffi::ibv_cq, i32, *mut ffi::ibv_wc) -> i32;

pub(crate) struct CqInner {
    pub(crate) raw: NonNull<ffi::ibv_cq>,
    poll_fn: PollFn,
    /// The poll table of an extended CQ ([`Context::create_cq_ex`]): `poll` goes through it.
    ex: Option<ExCq>,
    pub(crate) registry: Registry<Slot>,
    channel: Option<Arc<ChannelInner>>,
    /// The event bookkeeping `cq_context` points to (see `queue/channel.rs`): freed only after
    /// `ibv_destroy_cq` returned, or never if it failed.
    events: Arc<CqEvents>,
    /// The completion vector it was created on.
    comp_vector: u32,
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: libibverbs CQs may be polled and armed from any thread (providers lock internally); the
// registry is designed for one consumer (enforced by &mut CompletionQueue) and many registrars.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // From here on, readers of this CQ's events acknowledge them themselves; what was
        // counted before is acknowledged now, so ibv_destroy_cq waits at most for readers that
        // are between ibv_get_cq_event and their bookkeeping (see `queue/channel.rs`).
        let pending = self.events.begin_drop();
        if pending > 0 {
            // SAFETY: the CQ is alive; these events were read and not acknowledged yet.
            unsafe { ffi::ibv_ack_cq_events(self.raw.as_ptr(), pending) };
        }
        // SAFETY: every QP using this CQ holds an Arc of this inner, so all are destroyed; every
        // event read is acknowledged or about to be. After this the registry drops the
        // remaining buffers.
        let ret = unsafe { ffi::ibv_destroy_cq(self.raw.as_ptr()) };
        if ret == 0 {
            self.ctx.serials.remove(ObjectKind::Cq, self.raw.as_ptr() as usize, self.events.serial);
        } else {
            // Should not happen (no QP is left). The CQ lives on in the kernel and may still
            // report events through `cq_context`: leak the bookkeeping they will touch. The
            // buffers in the registry are not touched by a destroyed QP, so dropping them stays
            // sound.
            std::mem::forget(self.events.clone());
        }
    }
}

/// A completion queue (`struct ibv_cq`).
///
/// Not `Clone`: exactly one owner polls it with [`poll`](Self::poll) (`&mut self`), which returns
/// the buffers of safely posted work requests; queue pairs keep the CQ itself alive.
/// Shared by any number of queue pairs, and by both queues of a QP.
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
    /// Completions a scope's drain polled (see [`QueuePair::scope`](crate::QueuePair::scope)):
    /// the next polls return them first. Empty (and unallocated) unless a drain found some.
    kept: VecDeque<Completion>,
    /// The array the provider writes completions into (see [`WcScratch`]).
    wcs: WcScratch,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("capacity", &self.capacity()).finish()
    }
}

impl CompletionQueue {
    pub(crate) fn new(ctx: &Context, depth: u32, channel: Option<&CompletionChannel>) -> Result<Self> {
        Self::new_with(ctx, depth, channel, None, 0)
    }

    /// Creates a classic CQ (`wc_flags` `None`) or an extended one, its events on completion
    /// vector `comp_vector`.
    fn new_with(
        ctx: &Context,
        depth: u32,
        channel: Option<&CompletionChannel>,
        wc_flags: Option<WcFlags>,
        comp_vector: u32,
    ) -> Result<Self> {
        let verb = if wc_flags.is_some() { "ibv_create_cq_ex" } else { "ibv_create_cq" };
        let cqe = i32::try_from(depth)
            .ok()
            .filter(|&d| d > 0)
            .ok_or(Error::InvalidArgument { verb, reason: "depth must be in 1..=i32::MAX" })?;
        if channel.is_some_and(|c| !Arc::ptr_eq(&c.inner.ctx, &ctx.inner)) {
            return Err(Error::InvalidArgument {
                verb,
                reason: "the completion channel belongs to another device context",
            });
        }
        // The kernel refuses a vector at or above num_comp_vectors with EINVAL; said before
        // the verb, by name. (The count is at least 1 on every device; 0 is accepted whatever
        // it says, as C does.)
        if comp_vector != 0 && comp_vector >= ctx.num_comp_vectors() {
            return Err(Error::InvalidArgument {
                verb,
                reason: "comp_vector must be below the context's num_comp_vectors",
            });
        }
        let comp_vector_c = comp_vector as i32;
        if wc_flags.is_some_and(|f| f.contains(WcFlags::COMPLETION_TIMESTAMP))
            && ctx.query_device_ex()?.0.completion_timestamp_mask == 0
        {
            return Err(Error::Unsupported {
                verb,
                capability: "completion timestamps (IBV_WC_EX_WITH_COMPLETION_TIMESTAMP; completion_timestamp_mask is 0)",
            });
        }
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.inner.raw.as_ptr());
        let events = Arc::new(CqEvents::new(next_queue_id()));
        let cq_context = Arc::as_ptr(&events).cast_mut().cast();
        crate::error::clear_errno();
        let (raw, ex) = match wc_flags {
            None => {
                // SAFETY: valid context and (optional) channel, which the CQ keeps alive via its
                // Arc; `cq_context` points to `events`, which the CQ keeps until after
                // ibv_destroy_cq.
                let raw = unsafe { ffi::ibv_create_cq(ctx.as_raw(), cqe, cq_context, ch, comp_vector_c) };
                (cvt_p(verb, raw).map_err(|e| ctx.explain_queue_failure(e))?, None)
            }
            Some(flags) => {
                let flags = flags & WcFlags::all();
                let mut attr = ffi::ibv_cq_init_attr_ex {
                    cqe: cqe as u32,
                    cq_context,
                    channel: ch,
                    comp_vector,
                    wc_flags: flags.bits(),
                    ..Default::default()
                };
                // SAFETY: as for ibv_create_cq; `attr` is a valid attribute struct (comp_mask 0).
                let rawx = cvt_p(verb, unsafe { ffi::ibv_create_cq_ex(ctx.as_raw(), &mut attr) })
                    .map_err(|e| ctx.explain_queue_failure(e).or_unsupported("extended CQs"))?;
                // SAFETY: an extended CQ starts with its `struct ibv_cq` (ibv_cq_ex_to_cq is a cast).
                let raw = unsafe { NonNull::new_unchecked(ffi::ibv_cq_ex_to_cq(rawx.as_ptr())) };
                // SAFETY: the ibv_cq_ex lives as long as the CQ, which holds the table.
                match unsafe { ExCq::new(rawx.as_ptr(), flags, ctx.quirks().ex_poll_one_per_start) } {
                    Some(t) => (raw, Some(t)),
                    None => {
                        // SAFETY: created above, destroyed once; no QP uses it yet.
                        unsafe { ffi::ibv_destroy_cq(raw.as_ptr()) };
                        return Err(Error::Unsupported {
                            verb,
                            capability: "the poll calls of struct ibv_cq_ex for the wc_flags asked for",
                        });
                    }
                }
            }
        };
        // SAFETY: the CQ is valid; cqe is the real capacity, context->ops a table of the provider.
        let (capacity, poll_fn) = unsafe {
            let cap = u32::try_from((*raw.as_ptr()).cqe).unwrap_or(depth);
            (cap, (*(*raw.as_ptr()).context).ops.poll_cq)
        };
        let Some(poll_fn) = poll_fn else {
            // SAFETY: created above, destroyed once.
            unsafe { ffi::ibv_destroy_cq(raw.as_ptr()) };
            return Err(Error::InvalidArgument { verb: "ibv_poll_cq", reason: "provider has no poll_cq" });
        };
        ctx.inner.serials.insert(ObjectKind::Cq, raw.as_ptr() as usize, events.serial);
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                raw,
                poll_fn,
                ex,
                registry: Registry::new(capacity),
                channel: channel.map(|c| c.inner.clone()),
                events,
                comp_vector,
                ctx: ctx.inner.clone(),
            }),
            kept: VecDeque::new(),
            wcs: WcScratch::new(),
        })
    }

    /// How many completions it holds (at least the depth asked for).
    pub fn capacity(&self) -> u32 {
        self.inner.registry.cq_capacity()
    }

    /// The completion vector its events are signalled on (`comp_vector` of `ibv_create_cq`):
    /// 0 unless set with [`CqBuilder::comp_vector`].
    pub fn comp_vector(&self) -> u32 {
        self.inner.comp_vector
    }

    /// Resizes the CQ to hold at least `depth` completions (`ibv_resize_cq()`) and returns its
    /// new [`capacity`](Self::capacity), the size the device reports (it may round up).
    ///
    /// The safe level's accounting stays whole: the queue pairs and shared receive queues using
    /// this CQ have reserved room for every completion they can produce (the CQ's capacity minus
    /// [`unreserved`](Self::unreserved)), and a resize below that room is refused before the
    /// verb. While the verb runs, queue pairs created on other threads may reserve only what both
    /// the old and the new size hold. Requests of the `unsafe` level must keep within the new
    /// [`unreserved`](Self::unreserved) room.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] for a depth of 0 or above `i32::MAX`;
    /// - [`Error::CqTooSmall`] (verb `ibv_resize_cq`, `needed` the room reserved, `capacity` the
    ///   depth asked for) when the queues using the CQ reserved more than `depth`; nothing
    ///   changed;
    /// - [`Error::Unsupported`] where the provider has no resize (`EOPNOTSUPP`/`ENOSYS`: siw);
    /// - [`Error::Verb`] otherwise, e.g. `EINVAL` for a depth above the device's `max_cqe` or
    ///   below the completions the CQ holds right now. The CQ keeps its old size then.
    #[doc(alias = "ibv_resize_cq")]
    pub fn resize(&mut self, depth: u32) -> Result<u32> {
        const VERB: &str = "ibv_resize_cq";
        let cqe = i32::try_from(depth)
            .ok()
            .filter(|&d| d > 0)
            .ok_or(Error::InvalidArgument { verb: VERB, reason: "depth must be in 1..=i32::MAX" })?;
        let registry = &self.inner.registry;
        let to_cq_too_small = |e| match e {
            RegisterError::CqTooSmall { needed, capacity } => {
                Error::CqTooSmall { verb: VERB, needed, capacity }
            }
            RegisterError::Full => Error::TooManyQueuePairs { verb: VERB },
        };
        // Lowered first (a shrink): from here no reservation counts on entries past `depth`.
        let old = registry.cq_capacity();
        registry.set_capacity(old.min(depth)).map_err(to_cq_too_small)?;
        // SAFETY: the CQ is alive (we hold it); `&mut self` excludes every poll of it, which is
        // what providers need around a resize (they swap the queue's buffer); posts of queue
        // pairs on other threads are serialised by the provider. The new size holds every
        // completion the safe level can have outstanding (checked above).
        let ret = unsafe { ffi::ibv_resize_cq(self.inner.raw.as_ptr(), cqe) };
        if let Err(e) = cvt(VERB, ret) {
            // Back to the old size, which nothing could have reserved beyond (the capacity was
            // at most the old one meanwhile).
            let _ = registry.set_capacity(old);
            return Err(e.or_unsupported("ibv_resize_cq"));
        }
        // SAFETY: the CQ is valid; the provider wrote its new size to `cqe`.
        let got = unsafe { (*self.inner.raw.as_ptr()).cqe };
        let got = u32::try_from(got).unwrap_or(0);
        // What the device reports. It holds at least `depth` (the verb's contract), hence the
        // room reserved, which is at most `old.min(depth)`; a provider that reported less would
        // leave `unreserved` at 0 and every new reservation refused, never an overflow counted on.
        if registry.set_capacity(got).is_err() {
            let _ = registry.set_capacity(old.min(depth));
        }
        Ok(registry.cq_capacity())
    }

    /// Identifies this CQ in [`CompletionChannel::get_event`] results and
    /// [`AsyncEvent`](crate::AsyncEvent)s: a number unique in the process (see [`CqId`]).
    pub fn id(&self) -> CqId {
        CqId(self.inner.events.serial)
    }

    /// The raw `struct ibv_cq *`; valid while this CQ (or a QP using it) lives. What `ffi` calls
    /// may not do with it: see the crate's *Safety model* (raw handles).
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.raw.as_ptr()
    }

    /// Arms the CQ: the next completion (only solicited ones — a Send with the solicited flag,
    /// or a completion in error — if `solicited_only`) raises an event on its channel
    /// (`ibv_req_notify_cq()`). Also acknowledges the events of this CQ read so far
    /// (`ibv_ack_cq_events()`, one call for all of them).
    ///
    /// A completion that arrives between an empty poll and the arming raises no event: poll
    /// again after arming, or use [`poll_wait`](Self::poll_wait), which does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the CQ has no channel; [`Error::Verb`] when the verb
    /// fails.
    #[doc(alias = "ibv_req_notify_cq")]
    #[doc(alias = "ibv_ack_cq_events")]
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.inner.channel.is_none() {
            return Err(Error::InvalidArgument {
                verb: "ibv_req_notify_cq",
                reason: "the CQ was created without a completion channel",
            });
        }
        let pending = self.inner.events.take_pending();
        if pending > 0 {
            // SAFETY: the CQ is alive (&self); these events were read and not acknowledged.
            unsafe { ffi::ibv_ack_cq_events(self.as_raw(), pending) };
        }
        // SAFETY: valid CQ.
        cvt("ibv_req_notify_cq", unsafe { ffi::ibv_req_notify_cq(self.as_raw(), i32::from(solicited_only)) })
    }

    /// Polls completions into `out` like [`poll`](Self::poll), waiting up to `timeout` for at
    /// least one: the bounded, event-driven wait (no busy polling). Returns an empty slice when
    /// `timeout` passed without a completion.
    ///
    /// It polls; if nothing came, it arms the CQ ([`req_notify`](Self::req_notify)) and polls
    /// *again* — a completion that arrived between the first poll and the arming raises no
    /// event, the second poll finds it — and only then waits on the CQ's channel for the time
    /// left, polling again after each event. Events are acknowledged by the crate (in batches).
    /// Several CQs may share the channel and be waited on from different threads at once: an
    /// event read by one waiter for another's CQ wakes that other waiter. The CQ may stay armed
    /// after a timeout; the event that arming raises later is absorbed by the next wait.
    ///
    /// This is the way to wait for completions with a deadline (e.g. for a peer that may be
    /// gone). Mixing it with another reader of the same channel
    /// ([`CompletionChannel::try_get_event`]) is allowed; wake-ups are not lost either way.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the CQ has no channel; [`Error::Verb`] when
    /// `ibv_poll_cq()` (`ibv_start_poll()` on an extended CQ), `ibv_req_notify_cq()`, `poll(2)`
    /// or `ibv_get_cq_event()` fails.
    ///
    /// # Panics
    /// As [`poll`](Self::poll): a buffer's panicking drop propagates, and loses no completion.
    #[doc(alias = "ibv_req_notify_cq")]
    #[doc(alias = "ibv_get_cq_event")]
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_wait<'c>(
        &mut self,
        out: &'c mut [Completion],
        timeout: Duration,
    ) -> Result<&'c mut [Completion]> {
        self.poll_wait_with(out, timeout, false)
    }

    /// [`poll_wait`](Self::poll_wait), arming for solicited completions only when
    /// `solicited_only` (see [`req_notify`](Self::req_notify)): unsolicited completions that
    /// arrive meanwhile do not end the wait, but they are returned with the next solicited one
    /// (or by the polls before the wait).
    ///
    /// # Errors
    /// As for [`poll_wait`](Self::poll_wait).
    #[doc(alias = "ibv_req_notify_cq")]
    pub fn poll_wait_with<'c>(
        &mut self,
        out: &'c mut [Completion],
        timeout: Duration,
        solicited_only: bool,
    ) -> Result<&'c mut [Completion]> {
        if !self.kept.is_empty() {
            let n = self.take_kept(out);
            return Ok(&mut out[..n]);
        }
        let inner = self.inner.clone();
        let scratch = &mut self.wcs;
        // SAFETY: &mut self makes us the registry's only consumer.
        let n = wait_loop(&inner, timeout, solicited_only, || unsafe {
            match &inner.ex {
                None => poll_into(&inner.registry, out, scratch, |n, wcs| {
                    (inner.poll_fn)(inner.raw.as_ptr(), n, wcs)
                }),
                Some(ex) => poll_into_ex(ex, &inner.registry, out),
            }
        })?;
        self.resume_deferred(&mut out[..n]);
        Ok(&mut out[..n])
    }

    /// [`poll_raw`](Self::poll_raw) with the bounded wait of [`poll_wait_with`](Self::poll_wait_with):
    /// no buffer tracking. When several threads wait on the same CQ at once, one event wakes
    /// only one of them; the others wait until a later event or their timeout.
    ///
    /// # Errors
    /// As for [`poll_wait`](Self::poll_wait), with `ibv_poll_cq()` on any CQ (also an extended
    /// one).
    #[doc(alias = "ibv_req_notify_cq")]
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_raw_wait<'c>(
        &self,
        out: &'c mut [WorkCompletion],
        timeout: Duration,
        solicited_only: bool,
    ) -> Result<&'c mut [WorkCompletion]> {
        let n = wait_loop(&self.inner, timeout, solicited_only, || self.poll_raw(out).map(|c| c.len()))?;
        Ok(&mut out[..n])
    }

    /// Polls up to `out.len()` completions into `out` (`ibv_poll_cq()`) and returns the filled
    /// part. Completions of safely posted work requests carry the caller's `wr_id` and hand the
    /// request's buffers back ([`Completion::take_buffers`]); earlier unsignaled requests of the
    /// same queue are released at the same time. Buffers of queue pairs dropped (or reset) with
    /// work outstanding are released here too. Allocates nothing, takes no lock.
    ///
    /// Completions kept by a scope's drain ([`kept`](Self::kept), see
    /// [`QueuePair::scope`](crate::QueuePair::scope)) come first: a call that returns kept ones
    /// does not poll the device.
    ///
    /// Whatever the entries of `out` still held (buffers not taken from earlier completions) is
    /// dropped first. A call that returns fewer completions than `out` has room for has seen the
    /// CQ empty: only then do the registry index and CQ room of dropped or reset queue pairs
    /// come back (see the crate's *Safety model*), so a program that creates and drops queue
    /// pairs on a CQ must sometimes poll it dry.
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_poll_cq()` (`ibv_start_poll()` on an extended CQ) fails.
    ///
    /// # Panics
    /// Only if dropping a buffer panics (an [`OwnedBuffer`](crate::OwnedBuffer) free callback):
    /// the panic propagates, and every buffer is still dropped at most once. No completion is
    /// lost with it: a buffer dropped before the device is polled (one left in `out`, or one
    /// of a dropped queue pair) panics before any completion is taken; one released by a
    /// completion (an earlier unsignaled request's) panics once the poll has finished its
    /// batch and kept its completions, which the next polls return first ([`kept`](Self::kept)).
    ///
    /// On an extended CQ ([`Context::create_cq_ex`]) it polls with `ibv_start_poll`,
    /// `ibv_next_poll`, the `ibv_wc_read_*` accessors of the fields asked for, and
    /// `ibv_end_poll`, with the same hand-back of buffers; a call that ends on `ENOENT` has
    /// seen the CQ empty. Buffers released there are dropped between `ibv_start_poll` and
    /// `ibv_end_poll`, while the provider holds the CQ's lock: an [`OwnedBuffer`](crate::OwnedBuffer)
    /// free callback must not make the provider take it again (mlx5's `ibv_destroy_qp` of a
    /// queue pair that completes into this CQ does: the thread would spin on its own lock).
    #[doc(alias = "ibv_poll_cq")]
    #[doc(alias = "ibv_start_poll")]
    #[doc(alias = "ibv_next_poll")]
    #[doc(alias = "ibv_end_poll")]
    #[inline]
    pub fn poll<'c>(&mut self, out: &'c mut [Completion]) -> Result<&'c mut [Completion]> {
        // Room for one completion (a latency loop's poll) on a classic CQ: a function of its
        // own, whose frame holds only what that path needs.
        if let [c] = out {
            if self.kept.is_empty() && self.inner.ex.is_none() {
                // The provider's result in a register (a `Result<usize>` came back through
                // memory), the error built here; a `bool` needs no bounds check below.
                let n = self.poll_one(c);
                if n >= 0 {
                    return Ok(&mut out[..usize::from(n != 0)]);
                }
                if n == DEFERRED {
                    // Resumes the panic; had none been kept, the completion comes next.
                    self.keep_and_resume(out);
                    return Ok(&mut out[..0]);
                }
                return Err(Error::from_ret("ibv_poll_cq", n));
            }
        }
        self.poll_many(out)
    }

    /// [`poll`](Self::poll) with room for one completion on a classic CQ with nothing kept:
    /// `poll_into`'s one-entry path. Returns what [`poll_into_one`] does.
    #[inline(never)]
    fn poll_one(&mut self, c: &mut Completion) -> i32 {
        let inner = &*self.inner;
        // SAFETY: &mut self makes us the registry's only consumer; the provider's poll_cq on
        // this live CQ.
        unsafe { poll_into_one(&inner.registry, c, |n, wc| (inner.poll_fn)(inner.raw.as_ptr(), n, wc)) }
    }

    /// [`poll`](Self::poll)'s general path.
    #[inline(never)]
    fn poll_many<'c>(&mut self, out: &'c mut [Completion]) -> Result<&'c mut [Completion]> {
        if !self.kept.is_empty() {
            let n = self.take_kept(out);
            return Ok(&mut out[..n]);
        }
        let (inner, scratch) = (&*self.inner, &mut self.wcs);
        // The classic call is spelled out here (not shared with poll_wait_with or the scope's
        // poll_device through a helper): one instance of poll_into per caller, as before the
        // extended path existed, keeps the classic poll's code as it was (a shared instance cost
        // 11 instructions per released slot under callgrind).
        let n = match &inner.ex {
            // SAFETY: &mut self makes us the registry's only consumer; the provider's poll_cq on
            // this live CQ.
            None => unsafe {
                poll_into(&inner.registry, out, scratch, |n, wcs| (inner.poll_fn)(inner.raw.as_ptr(), n, wcs))
            }?,
            // SAFETY: as above; the poll table of this live CQ.
            Some(ex) => unsafe { poll_into_ex(ex, &inner.registry, out) }?,
        };
        self.resume_deferred(&mut out[..n]);
        Ok(&mut out[..n])
    }

    /// Resumes the panic of a buffer's drop caught while this poll took completions from the
    /// device (an earlier unsignaled request's buffer, released by a completion: see
    /// `Deferred`), once `filled`, the completions the poll took, are kept for the next polls:
    /// the panic loses none of them.
    #[inline(always)]
    fn resume_deferred(&mut self, filled: &mut [Completion]) {
        // SAFETY: &mut self makes us the registry's only consumer.
        if unsafe { self.inner.registry.deferred().is_set() } {
            self.keep_and_resume(filled);
        }
    }

    /// [`resume_deferred`](Self::resume_deferred)'s work.
    #[cold]
    #[inline(never)]
    fn keep_and_resume(&mut self, filled: &mut [Completion]) {
        for c in filled {
            self.kept.push_back(std::mem::take(c));
        }
        // SAFETY: &mut self makes us the registry's only consumer.
        if let Some(payload) = unsafe { self.inner.registry.deferred().take() } {
            std::panic::resume_unwind(payload)
        }
    }

    /// Whether this CQ was created on `channel`.
    pub(crate) fn is_on(&self, channel: &CompletionChannel) -> bool {
        self.inner.channel.as_ref().is_some_and(|c| Arc::ptr_eq(c, &channel.inner))
    }

    /// Completions kept for the caller and not returned by [`poll`](Self::poll) yet: those a
    /// scope's drain polled (see [`QueuePair::scope`](crate::QueuePair::scope)), and those of a
    /// poll that a buffer's panicking drop interrupted (see `poll`'s *Panics*).
    pub fn kept(&self) -> usize {
        self.kept.len()
    }

    /// Keeps a completion polled by a scope's drain for the next polls.
    pub(crate) fn keep(&mut self, c: Completion) {
        self.kept.push_back(c);
    }

    /// Moves kept completions into `out` (what its entries held is dropped first, as in `poll`);
    /// returns how many.
    #[cold]
    #[inline(never)]
    fn take_kept(&mut self, out: &mut [Completion]) -> usize {
        take_kept(&mut self.kept, out)
    }

    /// [`poll`](Self::poll) of the device itself, past the kept completions (a scope's drain):
    /// returns how many entries of `out` it filled.
    #[inline(never)]
    pub(crate) fn poll_device(&mut self, out: &mut [Completion]) -> Result<usize> {
        let (inner, scratch) = (&*self.inner, &mut self.wcs);
        let n = match &inner.ex {
            // SAFETY: &mut self makes us the registry's only consumer; the provider's poll_cq on
            // this live CQ.
            None => unsafe {
                poll_into(&inner.registry, out, scratch, |n, wcs| (inner.poll_fn)(inner.raw.as_ptr(), n, wcs))
            }?,
            // SAFETY: as above; the poll table of this live CQ.
            Some(ex) => unsafe { poll_into_ex(ex, &inner.registry, out) }?,
        };
        self.resume_deferred(&mut out[..n]);
        Ok(n)
    }

    /// Polls completions as the device reports them (`ibv_poll_cq()`), at exactly C's cost: no
    /// buffer tracking. Use it with [`QueuePair::post_send_unchecked`](crate::QueuePair::post_send_unchecked)
    /// and friends. Completions of safely posted requests polled this way do not release their
    /// buffers until a later completion of the same queue is polled with [`poll`](Self::poll), or
    /// the QP is dropped; their `wr_id`s are the crate's internal encoding. It takes `&self`:
    /// concurrent calls rely on the provider's own locking of the CQ, which every provider does
    /// for CQs created without `IBV_CREATE_CQ_ATTR_SINGLE_THREADED` (this crate never sets it).
    /// The fields of each entry that the provider does not write for a completion keep the
    /// values `out` held.
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_poll_cq()` fails.
    #[doc(alias = "ibv_poll_cq")]
    // Inlined into the caller, as C's `ibv_poll_cq` is (`static inline`): a call of its own cost
    // 35 instructions per poll, at C's cost now (callgrind, `post_poll` Unsafe:1: ours 72 -> 37,
    // raw ffi 39).
    #[inline]
    pub fn poll_raw<'c>(&self, out: &'c mut [WorkCompletion]) -> Result<&'c mut [WorkCompletion]> {
        let len = out.len();
        let want = i32::try_from(len).unwrap_or(i32::MAX);
        // SAFETY: valid CQ; WorkCompletion is a transparent ibv_wc; `out` has room for `want`.
        let n = unsafe { (self.inner.poll_fn)(self.as_raw(), want, out.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(Error::from_ret("ibv_poll_cq", n));
        }
        Ok(&mut out[..(n as usize).min(len)])
    }

    /// The raw `struct ibv_cq_ex *` of an extended CQ ([`Context::create_cq_ex`]); `None` for a
    /// classic one. Valid while this CQ (or a QP using it) lives.
    ///
    /// Getting the pointer is safe; polling through it (`ffi::ibv_start_poll` and friends) is
    /// `unsafe` and has the contract of [`poll_raw`](Self::poll_raw): completions of safely
    /// posted requests consumed that way do not hand their buffers back until a later completion
    /// of the same queue is polled with [`poll`](Self::poll) or the QP is dropped; and a
    /// `start_poll` ... `end_poll` sequence must not overlap any other poll of this CQ, on any
    /// thread ([`poll`](Self::poll), [`poll_raw`](Self::poll_raw), `poll_raw_wait`: on the same
    /// thread the provider would spin on the CQ lock `ibv_start_poll` holds), nor call an
    /// accessor of a field not asked for at creation.
    #[doc(alias = "ibv_cq_ex")]
    pub fn cq_ex_raw(&self) -> Option<*mut ffi::ibv_cq_ex> {
        self.inner.ex.as_ref().map(|e| e.raw)
    }

    /// The fields an extended CQ reports ([`Context::create_cq_ex`]); `None` for a classic one.
    pub fn wc_flags(&self) -> Option<WcFlags> {
        self.inner.ex.as_ref().map(|e| e.flags)
    }

    /// Whether completions carry their queue pair's number: always on a classic CQ, on an
    /// extended one only with [`WcFlags::QP_NUM`] (what matches a completion to its queue pair
    /// where several share the CQ: the async driver, striped connections).
    pub(crate) fn reports_qp_num(&self) -> bool {
        self.wc_flags().map_or(true, |f| f.contains(WcFlags::QP_NUM))
    }

    /// Completion entries not reserved by the safe level: the CQ's capacity minus the depths of
    /// the work queues it tracks (including those of dropped queue pairs not yet reclaimed by a
    /// poll that found the CQ empty). Requests posted with the `unsafe` level whose completions
    /// land in this CQ must keep their outstanding completions within this room; beyond it the CQ
    /// overflows and completions are lost (never unsound: buffers of lost completions are
    /// released by a later completion of their queue or when their queue pair goes).
    pub fn unreserved(&self) -> u32 {
        self.inner.registry.unreserved()
    }
}

/// The arm–poll–wait loop of [`CompletionQueue::poll_wait`]: `poll` returns how many
/// completions it got.
fn wait_loop(
    inner: &CqInner,
    timeout: Duration,
    solicited_only: bool,
    mut poll: impl FnMut() -> Result<usize>,
) -> Result<usize> {
    let deadline = crate::fd::deadline(Some(timeout));
    let channel = inner.channel.as_ref().ok_or(Error::InvalidArgument {
        verb: "ibv_req_notify_cq",
        reason: "the CQ was created without a completion channel",
    })?;
    let n = poll()?;
    if n > 0 {
        return Ok(n);
    }
    loop {
        // An event that is still to come from an earlier arming sets the bit again: a
        // spurious wake-up, answered by a poll and a re-arm.
        inner.events.take_notified();
        let pending = inner.events.take_pending();
        if pending > 0 {
            // SAFETY: the CQ is alive (the caller holds it); these events were read and not
            // acknowledged.
            unsafe { ffi::ibv_ack_cq_events(inner.raw.as_ptr(), pending) };
        }
        // SAFETY: valid CQ.
        cvt("ibv_req_notify_cq", unsafe {
            ffi::ibv_req_notify_cq(inner.raw.as_ptr(), i32::from(solicited_only))
        })?;
        let n = poll()?;
        if n > 0 {
            return Ok(n);
        }
        if !channel.wait_notified(&inner.events, deadline)? {
            return Ok(0);
        }
        let n = poll()?;
        if n > 0 {
            return Ok(n);
        }
    }
}

/// Moves completions from `kept` into `out`, oldest first; what the entries of `out` held is
/// dropped first (if a buffer's drop panics, no kept completion has been taken yet). Returns how
/// many.
fn take_kept(kept: &mut VecDeque<Completion>, out: &mut [Completion]) -> usize {
    let n = out.len().min(kept.len());
    for c in &mut out[..n] {
        c.clear();
    }
    for c in &mut out[..n] {
        if let Some(k) = kept.pop_front() {
            *c = k;
        }
    }
    n
}

/// Completions fetched from the device per provider call of [`CompletionQueue::poll`].
const POLL_BATCH: usize = 16;

/// The array a CQ's provider writes completions into: zeroed when created, and each entry zeroed
/// again once its completion was copied out, so it is all zeros at every poll's start.
/// Providers do not write every field of every completion (mlx5 leaves byte_len, src_qp, slid,
/// sl, pkey_index and vendor_err alone for a successful Send or Write): those read as zero,
/// never as memory of another kind, and an empty poll (the common case of a busy loop) costs
/// no zeroing at all. Should a completion's processing unwind half-way, its entries hold
/// earlier completions of the same CQ (initialised data) until they are zeroed again.
pub(crate) struct WcScratch(Box<[ffi::ibv_wc; POLL_BATCH]>);

impl WcScratch {
    pub(crate) fn new() -> WcScratch {
        WcScratch(Box::new([ffi::ibv_wc::default(); POLL_BATCH]))
    }
}

/// [`poll_into_one`]'s result when it took a completion and a buffer's drop panicked meanwhile
/// (the registry's `Deferred` holds the panic): never a provider's result (a negative errno).
const DEFERRED: i32 = i32::MIN;

/// [`poll_into`] with room for one completion: the provider writes the work completion into
/// the entry itself (zeroed first), with no scratch array to copy from and zero again. Returns
/// how many completions it got (0 or 1), or the provider's negative result, or [`DEFERRED`] when
/// it got one and a buffer's drop panicked (the caller keeps the completion and resumes the
/// panic): one register, no `Result` to pack.
///
/// # Safety
/// As [`poll_into`].
#[inline(always)]
unsafe fn poll_into_one(
    registry: &Registry<Slot>,
    c: &mut Completion,
    mut poll: impl FnMut(i32, *mut ffi::ibv_wc) -> i32,
) -> i32 {
    // SAFETY: consumer (contract).
    unsafe { registry.release_retired() };
    c.clear();
    let n = poll(1, c.zeroed_wc());
    if n <= 0 {
        // Asked only now (not kept across the provider call): only the consumer marks rings
        // draining, and it did so above, before the provider call.
        if n == 0 && registry.is_draining() {
            // SAFETY: consumer; the provider found the CQ empty after the rings were marked.
            unsafe { registry.drained() };
        }
        return n;
    }
    // SAFETY: consumer (contract); the entry was cleared, its work completion zeroed, then
    // written by the provider. (A tail call: this frame is gone by then.)
    unsafe { took_one(registry, c) }
}

/// [`poll_into_one`]'s work once the provider wrote a completion into `c`: finds and takes its
/// slot. Out of line, so that a poll that finds nothing (a busy loop's common case) saves and
/// restores only the registers its own path needs.
///
/// # Safety
/// Called only by the registry's consumer, with `c` cleared, then its work completion zeroed
/// and written by the provider.
#[inline(never)]
unsafe fn took_one(registry: &Registry<Slot>, c: &mut Completion) -> i32 {
    // The common case makes no call, so this frame saves no register; the rest is a tail call.
    // SAFETY: the caller's contract.
    if unsafe { c.take_slot_quiet(registry) } {
        // Nothing was dropped: no panic can have been deferred.
        return 1;
    }
    // SAFETY: the caller's contract (the quiet path changed nothing).
    unsafe { took_one_slow(registry, c) }
}

/// [`took_one`]'s cases that may drop something (earlier buffers, an address handle) or that
/// the quiet path declined (a shared receive queue's request, a stale `wr_id`).
///
/// # Safety
/// As [`took_one`].
#[cold]
#[inline(never)]
unsafe fn took_one_slow(registry: &Registry<Slot>, c: &mut Completion) -> i32 {
    // SAFETY: the caller's contract.
    unsafe { c.take_slot(registry) };
    // SAFETY: consumer (contract).
    if unsafe { registry.deferred().is_set() } {
        return DEFERRED;
    }
    1
}

/// The body of [`CompletionQueue::poll`], over any provider `poll` (so that it is tested under
/// Miri with providers that write only some fields): returns how many entries of `out` it filled.
///
/// # Safety
/// Called only by the registry's consumer; `poll(n, wcs)` behaves as a provider's `poll_cq`:
/// it writes at most `n` entries at `wcs` (not necessarily every field) and returns how many, or
/// a negative errno.
unsafe fn poll_into(
    registry: &Registry<Slot>,
    out: &mut [Completion],
    scratch: &mut WcScratch,
    mut poll: impl FnMut(i32, *mut ffi::ibv_wc) -> i32,
) -> Result<usize> {
    // One entry (a latency loop's poll): the loop below without its batching.
    if let [c] = out {
        // SAFETY: the caller's contract.
        return match unsafe { poll_into_one(registry, c, poll) } {
            // The caller resumes the panic (`resume_deferred`).
            DEFERRED => Ok(1),
            n if n >= 0 => Ok(usize::from(n != 0)),
            ret => Err(Error::from_ret("ibv_poll_cq", ret)),
        };
    }
    // SAFETY: consumer (contract).
    unsafe { registry.release_retired() };
    // Drop what the caller left in the entries *before* taking any completion from the
    // device: if a buffer's drop panics, no completion is lost with it.
    for c in out.iter_mut() {
        c.clear();
    }
    let wcs = &mut *scratch.0;
    let mut filled = 0;
    while filled < out.len() {
        let want = (out.len() - filled).min(POLL_BATCH);
        let dst = &mut out[filled..filled + want];
        let n = poll(want as i32, wcs.as_mut_ptr());
        if n < 0 {
            if filled > 0 {
                // The completions taken are returned; the next poll meets the error.
                break;
            }
            return Err(Error::from_ret("ibv_poll_cq", n));
        }
        let n = (n as usize).min(want);
        for (c, wc) in dst[..n].iter_mut().zip(wcs.iter_mut()) {
            // SAFETY: consumer (contract); the entry was zero, then written by the provider.
            unsafe { c.fill(wc, registry) };
            *wc = ffi::ibv_wc::default();
        }
        filled += n;
        if n < want {
            // Asked only now, as in `poll_into_one`: only the consumer marks rings draining,
            // and it did so above, before the provider calls.
            if registry.is_draining() {
                // The provider found the CQ empty, after the retired rings were marked.
                // SAFETY: consumer; the condition of `drained` holds.
                unsafe { registry.drained() };
            }
            break;
        }
    }
    Ok(filled)
}

impl Context {
    /// Creates an *extended* completion queue (`ibv_create_cq_ex()`) with room for at least
    /// `depth` completions, optionally reporting to a completion `channel`, whose completions
    /// carry the fields in `wc_flags` (besides `wr_id`, status, opcode, flags and vendor error).
    ///
    /// It is a [`CompletionQueue`] like any other: queue pairs, channels, [`poll_wait`](CompletionQueue::poll_wait)
    /// and the buffer hand-back work unchanged. Only [`poll`](CompletionQueue::poll) differs: it
    /// reads completions with `ibv_start_poll`/`ibv_next_poll`/`ibv_end_poll` and the
    /// `ibv_wc_read_*` accessors, and fills [`Completion::timestamp`] when `wc_flags` has
    /// [`WcFlags::COMPLETION_TIMESTAMP`]. [`poll_raw`](CompletionQueue::poll_raw) stays
    /// `ibv_poll_cq`, which providers serve on extended CQs too.
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the provider has no extended CQs (`EOPNOTSUPP`, e.g. siw;
    /// capability "extended CQs"), for [`WcFlags::COMPLETION_TIMESTAMP`] on a device whose
    /// `completion_timestamp_mask` is 0 (SoftRoCE), or when the provider leaves out a poll call
    /// or an accessor asked for; otherwise as [`create_cq`](Self::create_cq), with
    /// `ibv_create_cq_ex` as the verb.
    #[doc(alias = "ibv_create_cq_ex")]
    #[doc(alias = "ibv_cq_init_attr_ex")]
    pub fn create_cq_ex(
        &self,
        depth: u32,
        channel: Option<&CompletionChannel>,
        wc_flags: WcFlags,
    ) -> Result<CompletionQueue> {
        CompletionQueue::new_with(self, depth, channel, Some(wc_flags), 0)
    }

    /// A builder of a completion queue with room for at least `depth` completions, for the
    /// options [`create_cq`](Self::create_cq) and [`create_cq_ex`](Self::create_cq_ex) leave at
    /// their defaults: the completion vector (`comp_vector`), besides the channel and the
    /// extended CQ's `wc_flags`.
    pub fn cq_builder(&self, depth: u32) -> CqBuilder<'_> {
        CqBuilder { ctx: self, depth, channel: None, wc_flags: None, comp_vector: 0 }
    }

    /// Creates a completion queue with room for at least `depth` completions
    /// (`ibv_create_cq()`), optionally reporting to a completion `channel`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a depth of 0, [`Error::Verb`] (`EINVAL`) for a depth above
    /// the device's `max_cqe`.
    #[doc(alias = "ibv_create_cq")]
    pub fn create_cq(&self, depth: u32, channel: Option<&CompletionChannel>) -> Result<CompletionQueue> {
        CompletionQueue::new(self, depth, channel)
    }
}

/// The options of a new completion queue ([`Context::cq_builder`]): `ibv_create_cq()`, or
/// `ibv_create_cq_ex()` once [`wc_flags`](Self::wc_flags) is set.
#[derive(Debug)]
#[must_use = "a builder does nothing until build() is called"]
pub struct CqBuilder<'a> {
    ctx: &'a Context,
    depth: u32,
    channel: Option<&'a CompletionChannel>,
    wc_flags: Option<WcFlags>,
    comp_vector: u32,
}

impl<'a> CqBuilder<'a> {
    /// Reports completion events to `channel` (`channel` of `ibv_create_cq`).
    pub fn channel(mut self, channel: &'a CompletionChannel) -> Self {
        self.channel = Some(channel);
        self
    }

    /// Signals the CQ's events on completion vector `vector` (`comp_vector` of `ibv_create_cq` /
    /// `ibv_cq_init_attr_ex`), one of the context's
    /// [`num_comp_vectors`](Context::num_comp_vectors) (each is an interrupt, which HPC code
    /// spreads over cores). Default 0. A vector out of range is refused by
    /// [`build`](Self::build) before the verb.
    pub fn comp_vector(mut self, vector: u32) -> Self {
        self.comp_vector = vector;
        self
    }

    /// Makes it an extended CQ (`ibv_create_cq_ex`) whose completions carry `flags`, as
    /// [`Context::create_cq_ex`] does.
    pub fn wc_flags(mut self, flags: WcFlags) -> Self {
        self.wc_flags = Some(flags);
        self
    }

    /// Creates the completion queue (`ibv_create_cq()` or `ibv_create_cq_ex()`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a vector at or above the context's
    /// [`num_comp_vectors`](Context::num_comp_vectors) (other than 0), before the verb;
    /// otherwise as [`Context::create_cq`] or [`Context::create_cq_ex`].
    #[doc(alias = "ibv_create_cq")]
    #[doc(alias = "ibv_create_cq_ex")]
    pub fn build(self) -> Result<CompletionQueue> {
        CompletionQueue::new_with(self.ctx, self.depth, self.channel, self.wc_flags, self.comp_vector)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::post::registry::posted_ring;
    use crate::post::ring::{RECV, TAG};
    use crate::post::SlotBufs;
    use crate::queue::completion::{WcOpcode, WcStatus};

    #[test]
    fn kept_completions_come_back_oldest_first_in_as_many_calls_as_needed() {
        let mut kept: VecDeque<Completion> = (0..5u64)
            .map(|i| {
                let mut c = Completion::default();
                c.set_wr_id(100 + i);
                c
            })
            .collect();
        let mut out: [Completion; 2] = Default::default();
        out[0].set_wr_id(9);
        let mut seen = Vec::new();
        loop {
            let n = take_kept(&mut kept, &mut out);
            if n == 0 {
                break;
            }
            seen.extend(out[..n].iter().map(Completion::wr_id));
        }
        assert_eq!(seen, [100, 101, 102, 103, 104]);
        assert!(kept.is_empty());
        assert_eq!(take_kept(&mut kept, &mut out[..0]), 0);
    }

    /// Writes a completion the way mlx5 does for a successful Send/RDMA Write: wr_id, status,
    /// opcode, qp_num and wc_flags only.
    fn mlx5_like(wr_ids: &[u64]) -> impl FnMut(i32, *mut ffi::ibv_wc) -> i32 + '_ {
        let mut next = 0;
        move |n, wcs| {
            let mut k = 0;
            while k < n as usize && next < wr_ids.len() {
                // SAFETY: the engine handed room for n entries; only these fields are written.
                unsafe {
                    let wc = wcs.add(k);
                    std::ptr::addr_of_mut!((*wc).wr_id).write(wr_ids[next]);
                    std::ptr::addr_of_mut!((*wc).status).write(ffi::ibv_wc_status::IBV_WC_SUCCESS);
                    std::ptr::addr_of_mut!((*wc).opcode).write(ffi::ibv_wc_opcode::IBV_WC_SEND);
                    std::ptr::addr_of_mut!((*wc).qp_num).write(7);
                    std::ptr::addr_of_mut!((*wc).wc_flags).write(0);
                }
                k += 1;
                next += 1;
            }
            k as i32
        }
    }

    // Regression (soundness hole 4): whole entries were copied out of a batch the provider had
    // only partly written; the accessors then returned stack garbage (Miri: uninitialised read).
    #[test]
    fn fields_a_provider_does_not_write_read_as_zero() {
        let reg = Registry::<Slot>::for_tests(64);
        let mut out: [Completion; 20] = Default::default();
        let ids: Vec<u64> = (0..18).collect();
        // SAFETY: single consumer; the closure behaves as a provider.
        let n = unsafe { poll_into(&reg, &mut out, &mut WcScratch::new(), mlx5_like(&ids)) }.unwrap();
        assert_eq!(n, 18, "two batches, the second cut short");
        for (i, c) in out[..n].iter().enumerate() {
            assert_eq!(c.wr_id(), i as u64);
            assert_eq!(c.status(), WcStatus::SUCCESS);
            assert_eq!(c.opcode(), WcOpcode::SEND);
            assert_eq!((c.byte_len(), c.src_qp(), c.vendor_err(), c.imm_data()), (0, 0, 0, None));
            assert!(!c.is_tracked());
        }
    }

    // The scratch is reused from poll to poll: a field one completion had must not show up in
    // the next one's, when the provider leaves it alone there.
    #[test]
    fn a_reused_scratch_reads_as_zero_where_the_provider_does_not_write() {
        let reg = Registry::<Slot>::for_tests(64);
        let mut scratch = WcScratch::new();
        let mut out: [Completion; 4] = Default::default();
        let full = |n: i32, wcs: *mut ffi::ibv_wc| {
            assert!(n >= 2);
            for k in 0..2 {
                // SAFETY: room for n >= 2 entries.
                unsafe {
                    let wc = &mut *wcs.add(k);
                    (wc.wr_id, wc.byte_len, wc.src_qp, wc.vendor_err) = (k as u64, 4096, 9, 3);
                    wc.opcode = ffi::ibv_wc_opcode::IBV_WC_RECV;
                    wc.wc_flags = ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0;
                    wc.__bindgen_anon_1.imm_data = 0x0100_0000;
                }
            }
            2
        };
        // SAFETY: single consumer; the closures behave as providers.
        let n = unsafe { poll_into(&reg, &mut out, &mut scratch, full) }.unwrap();
        assert_eq!((n, out[1].byte_len(), out[1].src_qp(), out[1].imm_data()), (2, 4096, 9, Some(1)));
        // SAFETY: as above.
        let n = unsafe { poll_into(&reg, &mut out, &mut scratch, mlx5_like(&[7, 8])) }.unwrap();
        assert_eq!(n, 2);
        for c in &out[..2] {
            assert_eq!((c.byte_len(), c.src_qp(), c.vendor_err(), c.imm_data()), (0, 0, 0, None), "{c:?}");
        }
    }

    #[test]
    fn tagged_completions_find_their_slots_and_stale_ones_are_skipped() {
        let reg = Registry::<Slot>::for_tests(64);
        let ring = posted_ring(&reg, 4, true, &[100, 101]);
        let ids = [ring.device_wr_id(1), ring.device_wr_id(1), TAG | RECV | (77 << 32), 5];
        let mut out: [Completion; 8] = Default::default();
        // SAFETY: single consumer.
        let n = unsafe { poll_into(&reg, &mut out, &mut WcScratch::new(), mlx5_like(&ids)) }.unwrap();
        assert_eq!(n, 4);
        assert!(out[0].is_tracked() && out[0].wr_id() == 101, "{:?}", out[0]);
        assert_eq!(ring.outstanding(), 0, "position 0 released with 1");
        assert!(!out[1].is_tracked(), "a repeated wr_id is stale");
        assert!(!out[2].is_tracked(), "a key naming no ring is skipped");
        assert_eq!(out[3].wr_id(), 5, "untagged completions pass through");
    }

    #[test]
    fn a_provider_error_is_typed() {
        let reg = Registry::<Slot>::for_tests(8);
        let mut out: [Completion; 2] = Default::default();
        // SAFETY: single consumer.
        let e = unsafe { poll_into(&reg, &mut out, &mut WcScratch::new(), |_, _| -libc::EIO) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
    }

    // Completions taken from the device before a provider error are returned, not dropped
    // with an error: the next poll meets the error.
    #[test]
    fn a_provider_error_after_a_full_batch_returns_what_was_taken() {
        let reg = Registry::<Slot>::for_tests(64);
        let ring = posted_ring(&reg, 32, false, &[100; POLL_BATCH]);
        let ids: Vec<u64> = (0..POLL_BATCH as u32).map(|p| ring.device_wr_id(p)).collect();
        let mut batch = mlx5_like(&ids);
        let mut calls = 0;
        let mut provider = |n: i32, wcs: *mut ffi::ibv_wc| {
            calls += 1;
            if calls == 1 {
                batch(n, wcs)
            } else {
                -libc::EIO
            }
        };
        let mut out: [Completion; POLL_BATCH + 4] = Default::default();
        // SAFETY: single consumer; the closure behaves as a provider.
        let n = unsafe { poll_into(&reg, &mut out, &mut WcScratch::new(), &mut provider) }.unwrap();
        assert_eq!(n, POLL_BATCH);
        assert!(out[..n].iter().all(|c| c.is_tracked() && c.wr_id() == 100));
        assert_eq!(ring.outstanding(), 0);
        // SAFETY: as above.
        let e = unsafe { poll_into(&reg, &mut out, &mut WcScratch::new(), &mut provider) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
    }

    // A buffer's drop that panics while completions are taken (caught into the registry's
    // `Deferred`; set here by the provider, as a released slot's drop would) leaves every
    // completion of the poll to the caller, who keeps them and resumes the panic
    // (`CompletionQueue::resume_deferred`), with room for one or for a batch.
    #[test]
    fn a_deferred_panic_leaves_the_polls_completions_to_the_caller() {
        let reg = Registry::<Slot>::for_tests(16);
        let ring = posted_ring(&reg, 8, false, &[10, 11, 12]);
        let ids: Vec<u64> = (0..3).map(|p| ring.device_wr_id(p)).collect();
        let mut provider = mlx5_like(&ids);
        let mut panicking = |n: i32, wcs: *mut ffi::ibv_wc| {
            // SAFETY: the test is the consumer.
            unsafe { reg.deferred().catch(|| panic!("a buffer's drop")) };
            provider(n, wcs)
        };
        let mut scratch = WcScratch::new();
        let mut one = [Completion::default()];
        // SAFETY: single consumer; the closure behaves as a provider.
        let n = unsafe { poll_into(&reg, &mut one, &mut scratch, &mut panicking) }.unwrap();
        assert_eq!((n, one[0].wr_id(), one[0].is_tracked()), (1, 10, true));
        // SAFETY: the test is the consumer.
        unsafe {
            let payload = reg.deferred().take().expect("the panic waits for the caller");
            assert_eq!(payload.downcast_ref::<&str>(), Some(&"a buffer's drop"));
        }
        let mut out: [Completion; 4] = Default::default();
        // SAFETY: as above.
        let n = unsafe { poll_into(&reg, &mut out, &mut scratch, &mut panicking) }.unwrap();
        let got: Vec<_> = out[..n].iter().map(|c| (c.wr_id(), c.is_tracked())).collect();
        assert_eq!(got, [(11, true), (12, true)], "the whole batch");
        // SAFETY: the test is the consumer.
        assert!(unsafe { reg.deferred().take() }.is_some());
        assert_eq!(ring.outstanding(), 0);
    }

    #[test]
    fn only_a_poll_that_finds_the_cq_empty_reclaims_retired_rings() {
        let reg = Registry::<Slot>::for_tests(8);
        let ring = posted_ring(&reg, 8, false, &[0, 0]);
        reg.retire(&ring);
        drop(ring);
        assert_eq!(reg.unreserved(), 6, "room of the two outstanding requests kept");
        let mut out: [Completion; 2] = Default::default();
        let ids = [1, 2, 3];
        let mut provider = mlx5_like(&ids);
        // SAFETY: single consumer.
        unsafe {
            assert_eq!(
                poll_into(&reg, &mut out, &mut WcScratch::new(), &mut provider).unwrap(),
                2,
                "full: not seen empty"
            );
            assert_eq!(reg.unreserved(), 6);
            assert_eq!(
                poll_into(&reg, &mut out[..0], &mut WcScratch::new(), &mut provider).unwrap(),
                0,
                "asked for none"
            );
            assert_eq!(reg.unreserved(), 6);
            assert_eq!(
                poll_into(&reg, &mut out, &mut WcScratch::new(), &mut provider).unwrap(),
                1,
                "seen empty"
            );
        }
        assert_eq!(reg.unreserved(), 8);
    }

    // A poll with room for one completion (a latency loop's) takes its own path: the same
    // results as the batched one, entry by entry, and the same reclaim when it finds the CQ
    // empty.
    #[test]
    fn a_poll_with_room_for_one_behaves_as_the_batched_one() {
        let reg = Registry::<Slot>::for_tests(16);
        let ring = posted_ring(&reg, 4, true, &[100, 101]);
        let ids = [ring.device_wr_id(1), ring.device_wr_id(1), 5];
        let mut provider = mlx5_like(&ids);
        let mut scratch = WcScratch::new();
        let mut out = [Completion::default()];
        let mut seen = Vec::new();
        // SAFETY: single consumer; the closures behave as providers.
        unsafe {
            while poll_into(&reg, &mut out, &mut scratch, &mut provider).unwrap() == 1 {
                let c = &out[0];
                assert_eq!((c.byte_len(), c.src_qp(), c.imm_data()), (0, 0, None), "{c:?}");
                seen.push((c.is_tracked(), c.wr_id()));
            }
        }
        assert_eq!(seen, [(true, 101), (false, ring.device_wr_id(1)), (false, 5)]);
        assert_eq!(ring.outstanding(), 0, "position 0 released with 1");
        // SAFETY: as above.
        let e = unsafe { poll_into(&reg, &mut out, &mut scratch, |_, _| -libc::EIO) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        // A retired ring's room comes back only when a poll finds the CQ empty.
        let other = posted_ring(&reg, 4, false, &[0]);
        reg.retire(&other);
        drop(other);
        let before = reg.unreserved();
        let mut one = mlx5_like(&[9]);
        // SAFETY: as above.
        unsafe {
            assert_eq!(poll_into(&reg, &mut out, &mut scratch, &mut one).unwrap(), 1, "full: not seen empty");
            assert_eq!(reg.unreserved(), before);
            assert_eq!(poll_into(&reg, &mut out, &mut scratch, &mut one).unwrap(), 0, "seen empty");
        }
        assert_eq!(reg.unreserved(), before + 1, "the retired ring's one outstanding request");
        // The provider writes into the entry itself, zeroed first: a field the previous
        // completion had and this provider leaves unwritten reads 0.
        let full = |_: i32, wc: *mut ffi::ibv_wc| {
            // SAFETY: room for one entry; these fields are written.
            unsafe {
                std::ptr::addr_of_mut!((*wc).wr_id).write(3);
                std::ptr::addr_of_mut!((*wc).status).write(ffi::ibv_wc_status::IBV_WC_SUCCESS);
                std::ptr::addr_of_mut!((*wc).byte_len).write(99);
            }
            1
        };
        // SAFETY: as above.
        unsafe { assert_eq!(poll_into(&reg, &mut out, &mut scratch, full).unwrap(), 1) };
        assert_eq!((out[0].wr_id(), out[0].byte_len()), (3, 99));
        // SAFETY: as above.
        unsafe { assert_eq!(poll_into(&reg, &mut out, &mut scratch, mlx5_like(&[4])).unwrap(), 1) };
        assert_eq!((out[0].wr_id(), out[0].byte_len()), (4, 0), "not the previous completion's");
    }

    fn srq_slot(wr_id: u64) -> Slot {
        Slot { wr_id, bufs: SlotBufs::default(), _ah: None }
    }

    #[test]
    fn srq_completions_find_their_slots_on_any_attached_cq_in_any_order() {
        use crate::post::table::SlotTable;
        let table = Arc::new(SlotTable::<Slot>::new(4, 99));
        let reg_a = Registry::<Slot>::for_tests(8);
        let reg_b = Registry::<Slot>::for_tests(8);
        let att_a = reg_a.attach_srq(table.clone()).unwrap();
        let att_b = reg_b.attach_srq(table.clone()).unwrap();
        assert_eq!((reg_a.unreserved(), reg_b.unreserved()), (4, 4), "the SRQ's depth reserved in each CQ");
        let ids: Vec<u64> = (0..3)
            .map(|k| {
                // SAFETY: the test is the only producer.
                unsafe {
                    let i = table.claim().unwrap();
                    table.publish(i, srq_slot(100 + k))
                }
            })
            .collect();
        let mut out: [Completion; 4] = Default::default();
        // QP B took the second request and completed first, on CQ B.
        // SAFETY: single consumer of each registry.
        unsafe {
            assert_eq!(poll_into(&reg_b, &mut out, &mut WcScratch::new(), mlx5_like(&ids[1..2])).unwrap(), 1);
            assert!(out[0].is_tracked() && out[0].wr_id() == 101);
            let on_a = [ids[2], ids[0], ids[2]];
            assert_eq!(poll_into(&reg_a, &mut out, &mut WcScratch::new(), mlx5_like(&on_a)).unwrap(), 3);
        }
        assert_eq!((out[0].wr_id(), out[1].wr_id()), (102, 100));
        assert!(out[0].is_tracked() && out[1].is_tracked());
        assert!(!out[2].is_tracked(), "a repeated wr_id is stale");
        assert_eq!(table.outstanding(), 0);
        // A ring's wr_id with the same key bits is not an SRQ's, and the reverse.
        let [ring] = reg_a.register([(1, true)]).unwrap();
        assert_ne!(ring.wr_id_base() & crate::post::table::SRQ, crate::post::table::SRQ);
        reg_a.unregister(&ring);

        // The SRQ is destroyed with one request still posted: retire, then release.
        // SAFETY: producer.
        let last = unsafe {
            let i = table.claim().unwrap();
            table.publish(i, srq_slot(7))
        };
        reg_a.retire_srq(&att_a);
        reg_b.retire_srq(&att_b);
        // SAFETY: "ibv_destroy_srq succeeded".
        unsafe { table.release_all() };
        let weak = Arc::downgrade(&table);
        drop((table, att_a, att_b));
        // A stale completion of the released request, still in CQ A: found, skipped.
        // SAFETY: single consumer.
        unsafe {
            assert_eq!(poll_into(&reg_a, &mut out, &mut WcScratch::new(), mlx5_like(&[last])).unwrap(), 1);
            assert!(!out[0].is_tracked());
            assert_eq!(reg_a.unreserved(), 8, "seen empty: the SRQ's room is back");
            assert!(weak.upgrade().is_some(), "CQ B still holds the table");
            assert_eq!(poll_into(&reg_b, &mut out, &mut WcScratch::new(), |_, _| 0).unwrap(), 0);
        }
        assert_eq!(reg_b.unreserved(), 8);
        assert!(weak.upgrade().is_none(), "every CQ let go of the table");
    }

    #[test]
    fn attaching_an_srq_reports_the_whole_need() {
        use crate::post::registry::RegisterError;
        use crate::post::table::SlotTable;
        let reg = Registry::<Slot>::for_tests(10);
        let [_ring] = reg.register([(6, false)]).unwrap();
        let table = Arc::new(SlotTable::<Slot>::new(8, 1));
        assert_eq!(
            reg.attach_srq(table).err().map(|e| format!("{e:?}")),
            Some(format!("{:?}", RegisterError::CqTooSmall { needed: 14, capacity: 10 }))
        );
        assert_eq!(reg.unreserved(), 4);
    }

    #[test]
    fn srq_destroy_races_a_poller_on_another_thread() {
        use crate::post::table::SlotTable;
        const N: u64 = 12;
        let table = Arc::new(SlotTable::<Slot>::new(16, 5));
        let reg = Arc::new(Registry::<Slot>::for_tests(32));
        let att = reg.attach_srq(table.clone()).unwrap();
        let ids: Vec<u64> = (0..N)
            .map(|k| {
                // SAFETY: the test is the only producer.
                unsafe {
                    let i = table.claim().unwrap();
                    table.publish(i, srq_slot(k))
                }
            })
            .collect();
        // The poller: completions of half the requests, still in the CQ when the SRQ goes.
        let poller = {
            let reg = reg.clone();
            let done: Vec<u64> = ids.iter().copied().step_by(2).collect();
            std::thread::spawn(move || {
                let mut out: [Completion; 4] = Default::default();
                let mut provider = mlx5_like(&done);
                let mut tracked = 0;
                loop {
                    // SAFETY: this thread is the registry's only consumer.
                    let n =
                        unsafe { poll_into(&reg, &mut out, &mut WcScratch::new(), &mut provider) }.unwrap();
                    tracked += out[..n].iter().filter(|c| c.is_tracked()).count();
                    if n < out.len() {
                        return tracked;
                    }
                }
            })
        };
        // "ibv_destroy_srq succeeded" on this thread, racing the poller.
        reg.retire_srq(&att);
        // SAFETY: destroyed.
        unsafe { table.release_all() };
        let tracked = poller.join().unwrap();
        assert!(tracked <= (N as usize).div_ceil(2));
        assert_eq!(table.outstanding(), 0, "every slot taken exactly once, by one party or the other");
        let weak = Arc::downgrade(&table);
        drop((table, att));
        let mut out: [Completion; 1] = Default::default();
        // SAFETY: the only consumer now.
        unsafe { poll_into(&reg, &mut out, &mut WcScratch::new(), |_, _| 0) }.unwrap();
        assert_eq!(reg.unreserved(), 32, "seen empty: the room is back");
        assert!(weak.upgrade().is_none());
    }
}
