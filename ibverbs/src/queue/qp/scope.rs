//! [`QueuePair::scope`]: the scope's entry points, the [`Scope`] handed to the closure, and its
//! drain (the scoped requests are in `post/scope.rs`).

use std::fmt;
use std::io::Write as _;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::attr::QpState;
use crate::error::{Error, PostError, Result};
use crate::memory::{Chunk, MemoryRegion, RemoteMemoryRegion};
use crate::post::ring::{drop_payload, keep_first, Payload, Ring};
use crate::post::{RecvRequest, ScopedLocal, ScopedRecv, ScopedSend, SendRequest, Slot};
use crate::queue::completion::Completion;
use crate::queue::cq::{CompletionQueue, CqInner};
use crate::queue::qp::QueuePair;

/// Longest bound the drain takes from the caller (an `Instant` plus any `Duration` may overflow).
const MAX_BOUND: Duration = Duration::from_secs(365 * 24 * 3600);

/// How long the drain at the end of a scope waits: for the scope's requests to complete, then
/// (after moving the queue pair to ERR) for the device to flush them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DrainBounds {
    pub(crate) complete: Duration,
    pub(crate) flush: Duration,
}

/// The default drain bounds: 10 s for the requests to complete, 10 s for the flush.
pub(crate) const DEFAULT_DRAIN: DrainBounds =
    DrainBounds { complete: Duration::from_secs(10), flush: Duration::from_secs(10) };

/// The posting scope of [`QueuePair::scope`]: posts requests over memory borrowed for the
/// scope ([`ScopedSend`], [`ScopedRecv`]) and owned requests, and polls the queue pair's CQs.
///
/// `'s` is the scope's own lifetime (invariant, so no two scopes' types ever match), `'env`
/// what the scope may borrow from: a borrowed request must outlive `'s`, which the closure
/// cannot see the end of, so only memory borrowed from outside the closure can be posted, and it
/// stays borrowed until `QueuePair::scope` has drained and returned.
pub struct Scope<'s, 'env: 's> {
    pub(crate) qp: &'s mut QueuePair,
    pub(crate) send_cq: &'s mut CompletionQueue,
    /// The receive CQ when it is another CQ than the send CQ ([`QueuePair::scope_split`]).
    pub(crate) recv_cq: Option<&'s mut CompletionQueue>,
    /// The send ring's position after the last scoped send, until the ring released it.
    pub(crate) send_end: Option<u32>,
    /// The receive ring's position after the last scoped receive, until the ring released it.
    pub(crate) recv_end: Option<u32>,
    pub(crate) bounds: DrainBounds,
    _scope: PhantomData<fn(&'s ()) -> &'s ()>,
    _env: PhantomData<fn(&'env ()) -> &'env ()>,
}

impl fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("qp", &self.qp)
            .field("send_end", &self.send_end)
            .field("recv_end", &self.recv_end)
            .field("bounds", &self.bounds)
            .finish_non_exhaustive()
    }
}

impl<'s, 'env> Scope<'s, 'env> {
    pub(crate) fn new(
        qp: &'s mut QueuePair,
        send_cq: &'s mut CompletionQueue,
        recv_cq: Option<&'s mut CompletionQueue>,
    ) -> Self {
        Scope {
            qp,
            send_cq,
            recv_cq,
            send_end: None,
            recv_end: None,
            bounds: DEFAULT_DRAIN,
            _scope: PhantomData,
            _env: PhantomData,
        }
    }

    /// The bytes `range` of `mr`, borrowed (shared) for sends and RDMA Write sources: the device
    /// only reads them, and nothing can write them while the scope runs.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the region, [`Error::InvalidArgument`] for a
    /// range of 4 GiB or more.
    pub fn local<'b>(&self, mr: &'b MemoryRegion, range: impl RangeBounds<usize>) -> Result<ScopedLocal<'b>> {
        ScopedLocal::new(&mr.inner, mr.inner.addr(), mr.inner.len(), range, false)
    }

    /// The bytes `range` of `mr`, borrowed exclusively: the device may write them (receives,
    /// RDMA Reads, atomics), and nothing else can read or write the region until the scope has
    /// drained. Split it with [`ScopedLocal::split_at`] or [`ScopedLocal::chunks`] for several
    /// requests.
    ///
    /// # Errors
    /// As [`local`](Self::local).
    pub fn local_mut<'b>(
        &self,
        mr: &'b mut MemoryRegion,
        range: impl RangeBounds<usize>,
    ) -> Result<ScopedLocal<'b>> {
        let mr: &'b MemoryRegion = mr;
        ScopedLocal::new(&mr.inner, mr.inner.addr(), mr.inner.len(), range, true)
    }

    /// [`local`](Self::local) of a [`Chunk`] (`range` within the chunk).
    ///
    /// # Errors
    /// As [`local`](Self::local).
    pub fn local_chunk<'b>(
        &self,
        chunk: &'b Chunk,
        range: impl RangeBounds<usize>,
    ) -> Result<ScopedLocal<'b>> {
        ScopedLocal::new(&chunk.mr, chunk.addr(), chunk.len(), range, false)
    }

    /// [`local_mut`](Self::local_mut) of a [`Chunk`] (`range` within the chunk).
    ///
    /// # Errors
    /// As [`local`](Self::local).
    pub fn local_chunk_mut<'b>(
        &self,
        chunk: &'b mut Chunk,
        range: impl RangeBounds<usize>,
    ) -> Result<ScopedLocal<'b>> {
        let chunk: &'b Chunk = chunk;
        ScopedLocal::new(&chunk.mr, chunk.addr(), chunk.len(), range, true)
    }

    /// The bytes `range` of a remote-exposed region, borrowed (shared) and device writable: peers
    /// may write it at any moment anyway, so it only ever gives copies
    /// ([`RemoteMemoryRegion`]'s rules), and a scope may let the device write it too.
    ///
    /// # Errors
    /// As [`local`](Self::local).
    pub fn local_remote<'b>(
        &self,
        mr: &'b RemoteMemoryRegion,
        range: impl RangeBounds<usize>,
    ) -> Result<ScopedLocal<'b>> {
        ScopedLocal::new(&mr.inner, mr.inner.addr(), mr.inner.len(), range, true)
    }

    /// Posts a send request over borrowed memory (`ibv_post_send()`, or the `ibv_wr_*` builders
    /// on an extended queue pair), with the checks of [`QueuePair::post_send`]. The scope will
    /// not return before its completion (or the queue pair's failure, see
    /// [`QueuePair::scope`]). No allocation, no lock.
    ///
    /// # Errors
    /// A [`PostError`] handing the request back, as for [`QueuePair::post_send`].
    #[doc(alias = "ibv_post_send")]
    #[allow(clippy::result_large_err)] // the request comes back whole, without boxing
    pub fn post_send(&mut self, wr: ScopedSend<'s>) -> Result<(), PostError<ScopedSend<'s>>> {
        let mut wr = wr;
        let (end, r) = self.qp.post_scoped_send(&mut wr);
        if let Some(end) = end {
            // Posted, also when the provider failed after queuing it (Error::QueuedWithError).
            self.send_end = Some(end);
        }
        r.map_err(|error| PostError { error, request: wr })
    }

    /// Posts a chain of send requests over borrowed memory with one `ibv_post_send()` (one
    /// doorbell; on an extended queue pair one `ibv_wr_start` ... `ibv_wr_complete` batch), with
    /// the checks of [`QueuePair::post_send_chain`]. On success `wrs` is empty; on error it holds
    /// the requests not posted (those before the one the provider refused are posted, and the
    /// drain waits for them). `wrs` keeps its capacity: reused (it may be declared outside the
    /// closure, holding borrows that outlive the scope), it allocates nothing.
    ///
    /// # Errors
    /// As [`QueuePair::post_send_chain`].
    #[doc(alias = "ibv_post_send")]
    pub fn post_send_chain<'b: 's>(&mut self, wrs: &mut Vec<ScopedSend<'b>>) -> Result<()> {
        let (end, r) = self.qp.post_scoped_send_chain(wrs);
        if let Some(end) = end {
            // Every request of the chain that reached the device is before `end`.
            self.send_end = Some(end);
        }
        r
    }

    /// Posts a receive request over borrowed memory (`ibv_post_recv()`), with the checks of
    /// [`QueuePair::post_recv`]. The scope will not return before its completion (or the queue
    /// pair's failure). No allocation, no lock.
    ///
    /// # Errors
    /// A [`PostError`] handing the request back, as for [`QueuePair::post_recv`].
    #[doc(alias = "ibv_post_recv")]
    #[allow(clippy::result_large_err)]
    pub fn post_recv(&mut self, wr: ScopedRecv<'s>) -> Result<(), PostError<ScopedRecv<'s>>> {
        let mut wr = wr;
        let (end, r) = self.qp.post_scoped_recv(&mut wr);
        if let Some(end) = end {
            // Posted, also when the provider failed after queuing it (Error::QueuedWithError).
            self.recv_end = Some(end);
        }
        r.map_err(|error| PostError { error, request: wr })
    }

    /// Posts an owned request ([`QueuePair::post_send`]): its buffers come back with its
    /// completion as usual, and the drain does not wait for it.
    ///
    /// # Errors
    /// As [`QueuePair::post_send`].
    #[doc(alias = "ibv_post_send")]
    #[allow(clippy::result_large_err)]
    pub fn post_send_owned<'a>(&mut self, wr: SendRequest<'a>) -> Result<(), PostError<SendRequest<'a>>> {
        self.qp.post_send(wr)
    }

    /// Posts an owned receive ([`QueuePair::post_recv`]); the drain does not wait for it.
    ///
    /// # Errors
    /// As [`QueuePair::post_recv`].
    #[doc(alias = "ibv_post_recv")]
    #[allow(clippy::result_large_err)]
    pub fn post_recv_owned(&mut self, wr: RecvRequest) -> Result<(), PostError<RecvRequest>> {
        self.qp.post_recv(wr)
    }

    /// Polls the queue pair's CQ ([`CompletionQueue::poll`]; with two CQs, the send CQ first,
    /// then the receive CQ into the rest of `out`). Completions of scoped requests carry the
    /// caller's `wr_id` and no buffer; owned requests' hand their buffers back; completions of
    /// other queue pairs sharing the CQ come as they would from `poll`. No allocation, no lock.
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_poll_cq()` fails.
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll<'c>(&mut self, out: &'c mut [Completion]) -> Result<&'c mut [Completion]> {
        let n = self.send_cq.poll(out)?.len();
        let n = match self.recv_cq.as_deref_mut() {
            Some(cq) if n < out.len() => n + cq.poll(&mut out[n..])?.len(),
            _ => n,
        };
        self.refresh();
        Ok(&mut out[..n])
    }

    /// Whether a request posted in this scope over borrowed memory may still be in use by the
    /// device (its completion, or a later one of the same work queue, not polled yet).
    pub fn in_flight(&mut self) -> bool {
        self.refresh();
        self.send_end.is_some() || self.recv_end.is_some()
    }

    /// Forgets the positions the rings have released.
    fn refresh(&mut self) {
        if self.send_end.is_some_and(|end| !self.qp.send_ring().pending_before(end)) {
            self.send_end = None;
        }
        if self.recv_end.is_some_and(|end| !self.qp.recv_ring().pending_before(end)) {
            self.recv_end = None;
        }
    }

    /// The queue pair (state, number, capacities, ...).
    pub fn qp(&self) -> &QueuePair {
        self.qp
    }

    /// Sets the drain's bounds: how long it waits for the scope's requests to complete before
    /// moving the queue pair to ERR, and then for the device to flush them (defaults: 10 s and
    /// 10 s). See [`QueuePair::scope`].
    pub fn set_drain_timeouts(&mut self, complete: Duration, flush: Duration) {
        self.bounds = DrainBounds { complete, flush };
    }
}

impl QueuePair {
    pub(crate) fn send_ring(&self) -> &Ring<Slot> {
        &self.send
    }

    pub(crate) fn recv_ring(&self) -> &Ring<Slot> {
        &self.recv
    }

    /// Checks that the CQs given to a scope are the ones this QP's tracked queues complete into.
    fn check_scope_cqs(&self, send_cq: &Arc<CqInner>, recv_cq: &Arc<CqInner>, split: bool) -> Result<()> {
        let bad = |reason| Err(Error::InvalidArgument { verb: "QueuePair::scope", reason });
        if self.state == QpState::UNUSABLE {
            return Err(Error::QpState {
                verb: "QueuePair::scope",
                state: self.state,
                expected: "not UNUSABLE",
            });
        }
        if self.has_send && !Arc::ptr_eq(&self.send_cq, send_cq) {
            return bad("the completion queue given is not the queue pair's send CQ");
        }
        if self.has_recv && !Arc::ptr_eq(&self.recv_cq, recv_cq) {
            return bad(if split {
                "the completion queue given is not the queue pair's receive CQ"
            } else {
                "the queue pair's receive CQ is another CQ: use QueuePair::scope_split"
            });
        }
        Ok(())
    }

    /// Runs `f` with a [`Scope`] that posts requests over memory *borrowed* from the caller
    /// (the third posting level, after owned buffers and the `unsafe` level), and returns only
    /// once the device is done with every request posted through it — like
    /// [`std::thread::scope`] for threads. `cq` must be the CQ both of this queue pair's work
    /// queues complete into (else see [`scope_split`](Self::scope_split)).
    ///
    /// ```no_run
    /// # fn f(qp: &mut ibverbs::QueuePair, cq: &mut ibverbs::CompletionQueue,
    /// #      src: &ibverbs::MemoryRegion, dst: &mut ibverbs::MemoryRegion,
    /// #      peer: ibverbs::RemoteSlice) -> ibverbs::Result<()> {
    /// use ibverbs::{Completion, ScopedSend};
    /// qp.scope(cq, |s| -> ibverbs::Result<()> {
    ///     // Writes from a region we keep reading meanwhile (shared borrow)...
    ///     s.post_send(ScopedSend::write(s.local(src, 0..64)?, peer.slice(0, 64)?).wr_id(1))?;
    ///     // ... and an RDMA Read into one we cannot touch until the scope ends (exclusive borrow).
    ///     s.post_send(ScopedSend::read(s.local_mut(dst, ..64)?, peer.slice(64, 64)?).wr_id(2))?;
    ///     let mut out: [Completion; 4] = Default::default();
    ///     let mut done = 0;
    ///     while done < 2 {
    ///         done += s.poll(&mut out)?.len();
    ///     }
    ///     Ok(())
    /// })??;
    /// println!("{:?}", &dst[..8]); // borrowable again: the scope has returned
    /// # Ok(()) }
    /// ```
    ///
    /// # Borrowed buffers
    /// [`Scope::local`] borrows a region shared (the device only reads it: Send and RDMA Write
    /// sources), [`Scope::local_mut`] exclusively (the device may write it: receives, RDMA Read
    /// and atomic targets); the chunk and remote-exposed variants follow the same rules
    /// ([`RemoteMemoryRegion`](crate::RemoteMemoryRegion) only ever gives copies, so its shared
    /// borrow may be device-written). The borrow lasts until this call returns: the closure is
    /// generic over the scope's lifetime `'s`, so only memory borrowed from *outside* the
    /// closure can be posted, and the borrow checker keeps it borrowed through the drain.
    /// Posting costs what an owned post costs (same checks, same slot ring and `wr_id`
    /// encoding; the slot holds no buffer): no allocation, no lock.
    ///
    /// # Completions
    /// [`Scope::poll`] polls the CQ: completions of scoped requests carry the caller's `wr_id`
    /// and no buffer, owned requests ([`Scope::post_send_owned`]) hand their buffers back, and
    /// other queue pairs' completions on a shared CQ come as from
    /// [`CompletionQueue::poll`]. [`Scope::in_flight`] says whether a scoped request may still be
    /// in use by the device.
    ///
    /// # The drain
    /// When the closure returns — or panics — the scope waits until every request posted through
    /// [`Scope::post_send`]/[`post_recv`](Scope::post_recv) has completed (its completion, or
    /// a later one of the same work queue, polled), polling the CQ itself. Every completion the
    /// drain polls (of this scope's requests, of owned requests, of other queue pairs sharing
    /// the CQ) is *kept* in the CQ: its next [`poll`](CompletionQueue::poll) calls return them
    /// first, in order, so none is lost. The wait is bounded
    /// ([`Scope::set_drain_timeouts`]; 10 s by default): after the bound the queue pair is moved
    /// to ERR (`ibv_modify_qp()`), so the device flushes what is left, and the drain waits again
    /// (the flush bound, 10 s by default). If the device still has not given everything back,
    /// the queue pair is reset (`ibv_modify_qp()` to RESET: the device forgets every request, as
    /// for [`reset`](Self::reset), even on a queue pair RDMA-CM drives); if even that fails (e.g.
    /// a device removed or failed fatally while the scope's requests were outstanding: its
    /// `ibv_modify_qp()` then fails with `EIO`), the
    /// process is **aborted** — the only other sound way out would be to block forever, and
    /// returning would hand the caller memory the device may still write. Nothing the closure
    /// can reach ends a borrow early: the scope counts its requests itself (ring positions),
    /// and `mem::forget` of a request, of a [`PostError`](crate::PostError) or of the `&mut Scope` only
    /// leaks. Scopes cannot nest on one queue pair (`&mut self`); they may nest on different
    /// ones.
    ///
    /// A scope left by a **panic** drains the same way, then moves the queue pair to ERR
    /// (whatever the drain found: the closure's protocol stopped in the middle, so the peer
    /// cannot be trusted to be in step), and resumes the panic. After ERR (or RESET) the queue
    /// pair needs [`reset`](Self::reset) and a new [`connect`](Self::connect) before it is used
    /// again (owned requests still outstanding complete with flush errors and hand their buffers
    /// back through the CQ, as always).
    ///
    /// # Errors
    /// Before `f` runs: [`Error::InvalidArgument`] when `cq` is not the CQ of both work queues,
    /// [`Error::QpState`] for a queue pair left UNUSABLE. After it: [`Error::Timeout`] (verb
    /// `QueuePair::scope`) when the requests did not complete within the bound and the queue pair
    /// was failed — `f`'s value is dropped then. Errors of posts and polls inside the scope are
    /// the closure's to handle (return them through `R`).
    ///
    /// # Panics
    /// Resumes a panic of `f` once drained; a panic while the drain polls (only a buffer's drop
    /// can panic, e.g. an [`OwnedBuffer`](crate::OwnedBuffer) free callback of a dropped queue
    /// pair's buffer) is held until the drain is over, then resumed.
    #[doc(alias = "ibv_post_send")]
    #[doc(alias = "ibv_post_recv")]
    #[doc(alias = "ibv_poll_cq")]
    #[doc(alias = "ibv_modify_qp")]
    pub fn scope<'env, F, R>(&mut self, cq: &mut CompletionQueue, f: F) -> Result<R>
    where
        F: for<'s> FnOnce(&mut Scope<'s, 'env>) -> R,
    {
        self.check_scope_cqs(&cq.inner, &cq.inner, false)?;
        run(Scope::new(self, cq, None), f)
    }

    /// [`scope`](Self::scope) for a queue pair whose work queues complete into two CQs:
    /// `send_cq` and `recv_cq`. [`Scope::poll`] polls both; the drain keeps each CQ's completions
    /// in that CQ.
    ///
    /// # Errors
    /// As [`scope`](Self::scope), with [`Error::InvalidArgument`] when the CQs are not the queue
    /// pair's send and receive CQs.
    #[doc(alias = "ibv_post_send")]
    #[doc(alias = "ibv_post_recv")]
    pub fn scope_split<'env, F, R>(
        &mut self,
        send_cq: &mut CompletionQueue,
        recv_cq: &mut CompletionQueue,
        f: F,
    ) -> Result<R>
    where
        F: for<'s> FnOnce(&mut Scope<'s, 'env>) -> R,
    {
        self.check_scope_cqs(&send_cq.inner, &recv_cq.inner, true)?;
        run(Scope::new(self, send_cq, Some(recv_cq)), f)
    }
}

/// Runs the closure, then the drain, whatever the closure did.
fn run<'s, 'env, F, R>(mut scope: Scope<'s, 'env>, f: F) -> Result<R>
where
    F: for<'x> FnOnce(&mut Scope<'x, 'env>) -> R,
{
    let out = catch_unwind(AssertUnwindSafe(|| f(&mut scope)));
    let panicked = out.is_err();
    // The drain catches the panics it can meet (a buffer's drop); should anything else in it
    // unwind, returning would end the borrows early: abort instead.
    let Ok((drained, late_panic)) = catch_unwind(AssertUnwindSafe(|| scope.drain(panicked))) else {
        let _ = writeln!(std::io::stderr(), "ibverbs: QueuePair::scope: the drain panicked; aborting");
        std::process::abort()
    };
    match out {
        Err(payload) => {
            // The closure's panic goes on; a second one (a buffer's drop while draining) is
            // dropped (`drop_payload`).
            if let Some(late) = late_panic {
                drop_payload(late);
            }
            resume_unwind(payload)
        }
        Ok(value) => {
            if let Some(p) = late_panic {
                drop(value);
                resume_unwind(p);
            }
            drained.map(|()| value)
        }
    }
}

impl Scope<'_, '_> {
    /// The drain (see [`QueuePair::scope`]): returns once no scoped request can still be in
    /// use by the device, or aborts the process. Never unwinds: a panic of a buffer's drop
    /// while polling is caught and handed back.
    fn drain(&mut self, panicked: bool) -> (Result<()>, Option<Payload>) {
        let mut panic = None;
        let started = Instant::now();
        if self.wait_released(self.bounds.complete, &mut panic) {
            if panicked {
                // Best effort: a QP the device already failed stays failed.
                let _ = self.qp.set_error();
            }
            return (Ok(()), panic);
        }
        let timeout = Error::Timeout { verb: "QueuePair::scope", waited: started.elapsed() };
        // Fail the QP: the device flushes what is left, each request completing in order.
        let failed = self.qp.set_error().is_ok() || self.qp.state == QpState::ERR;
        if self.wait_released(self.bounds.flush, &mut panic) {
            return (Err(timeout), panic);
        }
        // On siw only the ERROR state stops the device (below); without it, nothing does.
        let siw = self.qp.context().is_siw();
        if siw && !failed {
            let _ = writeln!(
                std::io::stderr(),
                "ibverbs: QueuePair::scope: siw neither completed nor flushed the requests posted over \
                 borrowed memory, and refused the ERROR state (QP {}); aborting rather than returning \
                 memory it may still write",
                self.qp.qp_num()
            );
            std::process::abort()
        }
        // No flush: RESET makes the device forget every request (the rings are retired; their
        // stale completions are recognised as such). siw (Linux 6.1) accepts RESET and ignores it,
        // and flushes nothing posted after its QP reached ERROR (its queues are in user memory);
        // there the ERROR state set above is what stops the device: siw moves no data for a QP in
        // ERROR (transmit and receive suspended, the connection dropped), and never leaves it.
        let _ = self.qp.reset_unchecked();
        if self.qp.state == QpState::RESET || self.qp.state == QpState::UNUSABLE {
            self.send_end = None;
            self.recv_end = None;
            return (Err(timeout), panic);
        }
        let _ = writeln!(
            std::io::stderr(),
            "ibverbs: QueuePair::scope: the device neither completed, flushed nor reset the requests \
             posted over borrowed memory (QP {}); aborting rather than returning memory it may still write",
            self.qp.qp_num()
        );
        std::process::abort()
    }

    /// Polls until the rings released every scoped position, or `bound` passed; keeps what it
    /// polls in the CQ. Returns whether everything was released.
    fn wait_released(&mut self, bound: Duration, panic: &mut Option<Payload>) -> bool {
        let deadline = Instant::now() + bound.min(MAX_BOUND);
        let mut buf: [Completion; 16] = Default::default();
        let mut idle = 0u32;
        loop {
            if !self.in_flight() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            let mut got = keep_polled(self.send_cq, &mut buf, panic);
            if let Some(cq) = self.recv_cq.as_deref_mut() {
                got += keep_polled(cq, &mut buf, panic);
            }
            if got > 0 {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                if idle < 64 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
    }
}

/// Polls `cq` once past its kept completions, and keeps what came in it; returns how many.
/// A panic (a buffer's drop) is caught into `panic` ([`keep_first`]).
fn keep_polled(cq: &mut CompletionQueue, buf: &mut [Completion], panic: &mut Option<Payload>) -> usize {
    match catch_unwind(AssertUnwindSafe(|| cq.poll_device(buf))) {
        Ok(Ok(n)) => {
            for c in &mut buf[..n] {
                cq.keep(std::mem::take(c));
            }
            n
        }
        // A failing ibv_poll_cq: the bound decides.
        Ok(Err(_)) => 0,
        Err(p) => {
            keep_first(panic, p);
            0
        }
    }
}
