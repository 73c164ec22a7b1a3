//! A stream of a context's asynchronous events (`ibv_get_async_event`) over any reactor.

use std::fmt;
use std::future::poll_fn;
use std::task::{Context as TaskContext, Poll};

use super::backend::{Backend, Readiness};
use super::seam::WatchedFd;
use crate::async_event::{AsyncEvent, AsyncEvents};
use crate::error::{Error, Result};

/// The asynchronous events of a context as a stream: [`next`](Self::next) waits for the next
/// [`AsyncEvent`] without blocking a thread or busy polling (the reactor of the
/// [`Backend`] watches the events' epoll descriptor).
///
/// Each event is read and acknowledged at once (`ibv_get_async_event()` +
/// `ibv_ack_async_event()`, see [`AsyncEvents::try_get`]), so a stream or an event held, dropped
/// or forgotten never delays the destruction of the object it names. Dropping a
/// [`next`](Self::next) future loses no event: events are read only when the future completes.
/// Several streams (or an [`AsyncEvents`] used directly) on one context share its events: each
/// event goes to whichever reads it first.
pub struct AsyncEventStream {
    events: AsyncEvents,
    ready: Box<dyn Readiness>,
}

impl fmt::Debug for AsyncEventStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncEventStream").field("events", &self.events).finish_non_exhaustive()
    }
}

impl AsyncEventStream {
    /// Watches `events` with `backend`'s reactor.
    ///
    /// # Errors
    /// [`Error::Verb`] (`"register with the reactor"`) when the reactor refuses the descriptor.
    pub fn new(events: &AsyncEvents, backend: &dyn Backend) -> Result<AsyncEventStream> {
        let ready = backend
            .watch(WatchedFd::async_events(events))
            .map_err(|source| Error::Verb { verb: "register with the reactor", source })?;
        Ok(AsyncEventStream { events: events.clone(), ready })
    }

    /// [`new`](Self::new) with the tokio backend (call inside a tokio runtime with I/O enabled).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`Error::Verb`] outside a tokio runtime.
    ///
    /// # Panics
    /// In a tokio runtime without its I/O driver (see [`Tokio`](super::tokio::Tokio)).
    #[cfg(feature = "tokio")]
    pub fn tokio(events: &AsyncEvents) -> Result<AsyncEventStream> {
        Self::new(events, &super::tokio::Tokio)
    }

    /// [`new`](Self::new) with the async-io backend.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    #[cfg(feature = "async-io")]
    pub fn async_io(events: &AsyncEvents) -> Result<AsyncEventStream> {
        Self::new(events, &super::async_io::AsyncIo)
    }

    /// Polls for the next event: one pending now is returned at once; otherwise the task is woken
    /// when the descriptor becomes readable.
    ///
    /// # Errors
    /// As [`AsyncEvents::try_get`], or the reactor's error (as [`Error::Verb`]).
    #[doc(alias = "ibv_get_async_event")]
    #[doc(alias = "ibv_ack_async_event")]
    pub fn poll_next(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<AsyncEvent>> {
        loop {
            if let Some(event) = self.events.try_get()? {
                return Poll::Ready(Ok(event));
            }
            // Nothing pending: wait for readability. `Ready` means readiness was seen (and
            // cleared): read again; an event that came between the read and the registration
            // makes the descriptor readable (level-triggered), so it is not missed.
            match self.ready.poll_readable(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(source)) => {
                    return Poll::Ready(Err(Error::Verb { verb: "poll the reactor", source }))
                }
                Poll::Ready(Ok(())) => {}
            }
        }
    }

    /// The next event. Cancellation-safe: dropping the future loses nothing.
    ///
    /// # Errors
    /// As [`poll_next`](Self::poll_next).
    #[doc(alias = "ibv_get_async_event")]
    #[doc(alias = "ibv_ack_async_event")]
    pub async fn next(&mut self) -> Result<AsyncEvent> {
        poll_fn(|cx| self.poll_next(cx)).await
    }
}
