//! [`AsyncCompletionQueue`]: one completion queue as a stream, and the arm / poll / wait
//! sequence it shares with the [`Driver`](super::Driver) (`CqCore`).

use std::fmt;
use std::future::poll_fn;
use std::task::{Context as TaskContext, Poll};

use super::backend::{reactor_error, Backend, Readiness};
use super::seam::Seam;
use super::wait::{Empty, SpinWindow, WaitPolicy};
use crate::error::{Error, Result};
use crate::queue::{Completion, CompletionChannel, CompletionQueue};

/// One CQ and its channel, with the arm / poll / wait sequence.
pub(crate) struct CqCore {
    pub(super) cq: CompletionQueue,
    seam: Seam,
    io: Box<dyn Readiness>,
    armed: bool,
    pub(super) wait: SpinWindow,
}

impl CqCore {
    pub(super) fn new(
        cq: CompletionQueue,
        channel: &CompletionChannel,
        backend: &dyn Backend,
    ) -> Result<CqCore> {
        // Armed, the CQ raises its events on its own channel: watching another would wait forever.
        if !cq.is_on(channel) {
            return Err(Error::InvalidArgument {
                verb: "ibv_req_notify_cq",
                reason: "the completion queue was not created on this completion channel",
            });
        }
        let seam = Seam::new(channel);
        let io = backend.watch(seam.watched()).map_err(reactor_error)?;
        Ok(CqCore { cq, seam, io, armed: false, wait: SpinWindow::new(WaitPolicy::default()) })
    }

    /// Polls without waiting (`ibv_poll_cq()`).
    pub(super) fn poll_now<'c>(&mut self, out: &'c mut [Completion]) -> Result<&'c mut [Completion]> {
        self.cq.poll(out)
    }

    /// Gets and acknowledges every pending event; an event means the CQ is no longer armed.
    fn drain_events(&mut self) -> Result<()> {
        while let Some(id) = self.seam.try_get_event()? {
            if id == self.cq.id() {
                self.armed = false;
            }
        }
        Ok(())
    }

    /// The whole sequence: `Ready(n)` with `n > 0` completions in `out[..n]`, or `Pending` with
    /// the reactor watching the channel for `reactor` (`cx`'s waker when `None`; busy polling
    /// wakes `cx`'s task itself). `front()`, asked when the CQ is empty: whether the poller
    /// waits for the completion that comes next on its queue (the stream's poller always does);
    /// one that waits behind an older operation does not spin under the adaptive wait
    /// ([`SpinWindow::empty_behind`]).
    pub(super) fn poll_ready(
        &mut self,
        cx: &mut TaskContext<'_>,
        reactor: Option<&std::task::Waker>,
        out: &mut [Completion],
        front: impl Fn() -> bool,
    ) -> Poll<Result<usize>> {
        if out.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // Whether this poll already asked the policy (once per poll: the adaptive window's
        // clock is read at most once).
        let mut asked = false;
        loop {
            match self.cq.poll(out) {
                Ok(got) if !got.is_empty() => {
                    self.wait.found(std::time::Instant::now);
                    return Poll::Ready(Ok(got.len()));
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            if !asked {
                asked = true;
                let next =
                    if front() { self.wait.empty(std::time::Instant::now) } else { self.wait.empty_behind() };
                if next == Empty::Spin {
                    // Busy polling (within the adaptive window, or for ever with `BusyPoll`):
                    // ask to be polled again at once; no arming, no wait.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
            }
            if !self.armed {
                if let Err(e) = self.cq.req_notify(false) {
                    return Poll::Ready(Err(e));
                }
                self.armed = true;
                // Closes the race: a completion that came after the poll above but before the
                // arming raised no event.
                continue;
            }
            let readable = match reactor {
                Some(w) => self.io.poll_readable(&mut TaskContext::from_waker(w)),
                None => self.io.poll_readable(cx),
            };
            match readable {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(reactor_error(e))),
                Poll::Ready(Ok(())) => {
                    if let Err(e) = self.drain_events() {
                        return Poll::Ready(Err(e));
                    }
                }
            }
        }
    }
}

/// A stream of completions from one completion queue, woken by its completion channel.
///
/// Owns the CQ (the safe level's single consumer) and watches the channel with a [`Backend`].
/// Requests are posted with the safe level ([`QueuePair::post_send`](crate::QueuePair::post_send),
/// ...) as usual; the completions hand their buffers back as with
/// [`CompletionQueue::poll`].
pub struct AsyncCompletionQueue {
    core: CqCore,
    batch: Box<[Completion]>,
    pos: usize,
    len: usize,
}

impl fmt::Debug for AsyncCompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncCompletionQueue").field("cq", &self.core.cq).finish_non_exhaustive()
    }
}

impl AsyncCompletionQueue {
    /// Wraps `cq`, which must have been created on `channel`
    /// ([`Context::create_cq`](crate::Context::create_cq)`(.., Some(&channel), ..)`), and
    /// registers the channel's descriptor with `backend`. The channel must serve this CQ only
    /// (see the [module docs](crate::aio)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `cq` was not created on `channel`; [`Error::Verb`] when the
    /// reactor refuses the descriptor.
    pub fn new(cq: CompletionQueue, channel: &CompletionChannel, backend: &dyn Backend) -> Result<Self> {
        let core = CqCore::new(cq, channel, backend)?;
        Ok(AsyncCompletionQueue {
            core,
            batch: (0..16).map(|_| Completion::default()).collect(),
            pos: 0,
            len: 0,
        })
    }

    /// The completion queue (e.g. to create queue pairs on it).
    pub fn cq(&self) -> &CompletionQueue {
        &self.core.cq
    }

    /// Sets what a poll does when it finds the CQ empty (see [`WaitPolicy`]; the default is
    /// [`WaitPolicy::ADAPTIVE`]: busy poll for a bounded while, then arm the CQ,
    /// `ibv_req_notify_cq()`, and sleep in the reactor).
    #[doc(alias = "ibv_req_notify_cq")]
    pub fn set_wait_policy(&mut self, policy: WaitPolicy) {
        self.core.wait.set(policy);
    }

    /// The wait policy (an adaptive spin as clamped, [`WaitPolicy::MAX_SPIN`]; a zero spin is
    /// [`WaitPolicy::Events`]).
    pub fn wait_policy(&self) -> WaitPolicy {
        self.core.wait.policy()
    }

    /// Polls for completions into `out` (`ibv_poll_cq()`, and `ibv_req_notify_cq()` +
    /// `ibv_get_cq_event()` while there is none): `Ready(Ok(n))` with `n > 0` (or `0` for an
    /// empty `out`), or `Pending` with the channel armed and watched. Completions buffered by
    /// [`next`](Self::next) come first.
    ///
    /// # Errors
    /// [`Error::Verb`] when a verb or the reactor fails.
    #[doc(alias = "ibv_poll_cq")]
    #[doc(alias = "ibv_req_notify_cq")]
    #[doc(alias = "ibv_get_cq_event")]
    pub fn poll_next_batch(
        &mut self,
        cx: &mut TaskContext<'_>,
        out: &mut [Completion],
    ) -> Poll<Result<usize>> {
        if self.pos < self.len {
            let n = (self.len - self.pos).min(out.len());
            for (o, b) in out.iter_mut().zip(&mut self.batch[self.pos..self.pos + n]) {
                *o = std::mem::take(b);
            }
            self.pos += n;
            return Poll::Ready(Ok(n));
        }
        self.core.poll_ready(cx, None, out, || true)
    }

    /// Waits for at least one completion (`ibv_poll_cq()`, and `ibv_req_notify_cq()` +
    /// `ibv_get_cq_event()` while there is none) and returns those that fit in `out`.
    ///
    /// Cancel-safe: dropping the future loses no completion.
    ///
    /// # Errors
    /// [`Error::Verb`] when a verb or the reactor fails.
    #[doc(alias = "ibv_poll_cq")]
    #[doc(alias = "ibv_req_notify_cq")]
    pub async fn next_batch<'c>(&mut self, out: &'c mut [Completion]) -> Result<&'c mut [Completion]> {
        let n = poll_fn(|cx| self.poll_next_batch(cx, out)).await?;
        Ok(&mut out[..n])
    }

    /// Polls for one completion (see [`poll_next_batch`](Self::poll_next_batch)).
    ///
    /// # Errors
    /// As [`poll_next_batch`](Self::poll_next_batch).
    #[doc(alias = "ibv_poll_cq")]
    #[doc(alias = "ibv_req_notify_cq")]
    #[doc(alias = "ibv_get_cq_event")]
    pub fn poll_next(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<Completion>> {
        if self.pos == self.len {
            self.pos = 0;
            self.len = 0;
            let AsyncCompletionQueue { core, batch, .. } = self;
            match core.poll_ready(cx, None, batch, || true) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(n)) => self.len = n,
            }
        }
        let c = std::mem::take(&mut self.batch[self.pos]);
        self.pos += 1;
        Poll::Ready(Ok(c))
    }

    /// Waits for the next completion. Cancel-safe.
    ///
    /// # Errors
    /// [`Error::Verb`] when a verb or the reactor fails.
    #[doc(alias = "ibv_poll_cq")]
    pub async fn next(&mut self) -> Result<Completion> {
        poll_fn(|cx| self.poll_next(cx)).await
    }

    /// Polls without waiting (`ibv_poll_cq()`); completions buffered by [`next`](Self::next)
    /// come first.
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_poll_cq()` fails.
    pub fn try_next_batch<'c>(&mut self, out: &'c mut [Completion]) -> Result<&'c mut [Completion]> {
        if self.pos < self.len {
            let n = (self.len - self.pos).min(out.len());
            for (o, b) in out.iter_mut().zip(&mut self.batch[self.pos..self.pos + n]) {
                *o = std::mem::take(b);
            }
            self.pos += n;
            return Ok(&mut out[..n]);
        }
        self.core.poll_now(out)
    }
}
