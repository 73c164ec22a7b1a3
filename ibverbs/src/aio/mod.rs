//! The async adaptor: completions, and safe posts whose futures own their buffers, over any
//! reactor.
//!
//! The runtime-agnostic core here is always compiled (it needs no dependency). A reactor plugs in
//! through [`Backend`]/[`Readiness`] ("tell me when this descriptor is readable"); two come with
//! the crate:
//!
//! | feature | backend | reactor |
//! |---|---|---|
//! | `tokio` | `tokio::Tokio` | `tokio::io::unix::AsyncFd` (call inside a tokio runtime) |
//! | `async-io` | `async_io::AsyncIo` | `async_io::Async` (smol and friends) |
//!
//! # The wait
//! Every wait runs the standard sequence on its completion queue: poll (`ibv_poll_cq()`); when
//! it is empty arm it (`ibv_req_notify_cq()`) and poll again (a completion that arrived between
//! the first poll and the arming raises no event: this second poll finds it); then wait until the
//! channel's descriptor is readable, get and acknowledge every pending event
//! (`ibv_get_cq_event()`, `ibv_ack_cq_events()`), and start over. Nothing spins: a task that
//! finds nothing returns `Pending` with the reactor watching the descriptor.
//!
//! # Two ways in
//! - [`AsyncCompletionQueue`]: a stream of completions from one CQ ([`next`](AsyncCompletionQueue::next),
//!   [`next_batch`](AsyncCompletionQueue::next_batch)), for callers that post with the safe level
//!   themselves.
//! - [`Driver`] + [`AsyncQueuePair`]: `await`-able posts ([`AsyncQueuePair::send`],
//!   [`write`](AsyncQueuePair::write), [`read`](AsyncQueuePair::read),
//!   [`recv`](AsyncQueuePair::recv)). A driver owns one CQ; any number of queue pairs complete
//!   into it and any number of tasks await their operations: whichever task polls drives the CQ
//!   and hands each completion to the future waiting for it (by a slot index + generation carried
//!   in the `wr_id`), so no dedicated task is needed.
//!
//! # Cancellation
//! A posted request's buffers belong to the queue pair until its completion is polled (the safe
//! level's slot rings), not to the future. Dropping (or `mem::forget`ting) the future only
//! abandons the wait: the driver drops the completion, and with it the buffers, when the device
//! reports it done. No buffer is freed or reused while the device may touch it, whatever the
//! caller does; a forgotten future leaks its slot, and holds up no other task (the reactor wakes
//! the driver, which wakes every waiting task). The adaptor has no `unsafe` of its own:
//! reactors watch the channel's epoll descriptor (its `AsFd`), which cannot be read from.
//!
//! # Asynchronous events
//! [`AsyncEventStream`] awaits a context's [`AsyncEvent`](crate::AsyncEvent)s (port changes, QP
//! and CQ errors, ...) the same way, over the same backends.
//!
//! # One channel per adaptor
//! The channel given to an [`AsyncCompletionQueue`] or a [`Driver`] must be the one its CQ was
//! created on (checked: [`Error::InvalidArgument`] otherwise), and serve that CQ only: the adaptor
//! knows its CQ is no longer armed only from the events it reads itself, so another reader of the
//! channel (a second CQ's [`poll_wait`](crate::CompletionQueue::poll_wait), a clone's
//! `try_get_event`) that takes this CQ's event leaves the adaptor waiting for an event that was
//! already raised (until the future is dropped). (Registering one descriptor twice with the same
//! reactor fails anyway.) Several queue pairs share one CQ and one channel through one
//! [`Driver`].
// The backends are linked only where their features compile them (a link to a missing item
// is a rustdoc warning).
#![cfg_attr(feature = "tokio", doc = "\nThe tokio backend: [`tokio::Tokio`].")]
#![cfg_attr(feature = "async-io", doc = "\nThe async-io backend: [`async_io::AsyncIo`].")]

mod driver;
mod events;
mod seam;

#[cfg(feature = "async-io")]
pub mod async_io;
#[cfg(feature = "tokio")]
pub mod tokio;

use std::fmt;
use std::future::poll_fn;
use std::io;
use std::task::{Context as TaskContext, Poll};

pub use driver::{AsyncQueuePair, DrivenCq, Driver, Op};
pub use events::AsyncEventStream;
pub use seam::WatchedFd;

use crate::error::{Error, Result};
use crate::queue::{Completion, CompletionChannel, CompletionQueue};
use seam::Seam;

/// Readiness of one descriptor, as a reactor reports it.
pub trait Readiness: Send + Sync {
    /// Polls for readability of the watched descriptor. `Ready(Ok(()))` means the reactor saw it
    /// readable and that readiness is now *cleared*: the caller then consumes everything that is
    /// pending, and a later `Pending` is woken by anything that arrives after the clearing.
    /// `Pending` registers `cx`'s waker (implementations may keep only the last one).
    fn poll_readable(&self, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>>;
}

/// A reactor that can watch a completion channel's descriptor.
pub trait Backend {
    /// Registers `fd` for readability.
    ///
    /// # Errors
    /// What the reactor reports (e.g. no runtime, or the descriptor already registered).
    fn watch(&self, fd: WatchedFd) -> io::Result<Box<dyn Readiness>>;
}

fn reactor_error(e: io::Error) -> Error {
    Error::Verb { verb: "reactor (waiting for the completion channel)", source: e }
}

/// One CQ and its channel, with the arm / poll / wait sequence.
pub(crate) struct CqCore {
    cq: CompletionQueue,
    seam: Seam,
    io: Box<dyn Readiness>,
    armed: bool,
    busy: bool,
}

impl CqCore {
    fn new(cq: CompletionQueue, channel: &CompletionChannel, backend: &dyn Backend) -> Result<CqCore> {
        // Armed, the CQ raises its events on its own channel: watching another would wait forever.
        if !cq.is_on(channel) {
            return Err(Error::InvalidArgument {
                verb: "ibv_req_notify_cq",
                reason: "the completion queue was not created on this completion channel",
            });
        }
        let seam = Seam::new(channel);
        let io = backend.watch(seam.watched()).map_err(reactor_error)?;
        Ok(CqCore { cq, seam, io, armed: false, busy: false })
    }

    /// Polls without waiting (`ibv_poll_cq()`).
    fn poll_now<'c>(&mut self, out: &'c mut [Completion]) -> Result<&'c mut [Completion]> {
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
    /// wakes `cx`'s task itself).
    fn poll_ready(
        &mut self,
        cx: &mut TaskContext<'_>,
        reactor: Option<&std::task::Waker>,
        out: &mut [Completion],
    ) -> Poll<Result<usize>> {
        if out.is_empty() {
            return Poll::Ready(Ok(0));
        }
        loop {
            match self.cq.poll(out) {
                Ok(got) if !got.is_empty() => return Poll::Ready(Ok(got.len())),
                Ok(_) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            if self.busy {
                // Busy polling: ask to be polled again at once, never arm nor wait.
                cx.waker().wake_by_ref();
                return Poll::Pending;
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
    /// (see the [module docs](self)).
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
        self.core.poll_ready(cx, None, out)
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
            match core.poll_ready(cx, None, batch) {
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
