//! The tokio backend (feature `tokio`): watches the channel's epoll descriptor ([`WatchedFd`])
//! with `tokio::io::unix::AsyncFd`.

use std::io;
use std::task::{Context as TaskContext, Poll};

use ::tokio::io::unix::AsyncFd;
use ::tokio::io::Interest;

use super::backend::{Backend, Readiness};
use super::cq::AsyncCompletionQueue;
use super::driver::Driver;
use super::seam::WatchedFd;
use crate::error::Result;
use crate::queue::{CompletionChannel, CompletionQueue};

/// The tokio reactor. [`Backend::watch`] must run inside a tokio runtime with its I/O driver
/// enabled: outside any runtime it returns an error (so the constructors below return
/// [`Error::Verb`](crate::Error::Verb)); in a runtime built without I/O (no `enable_io`) it
/// panics, as `AsyncFd::new` does, tokio offering no way to ask first.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tokio;

struct TokioReadiness(AsyncFd<WatchedFd>);

impl Readiness for TokioReadiness {
    fn poll_readable(&self, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        match self.0.poll_read_ready(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(mut guard)) => {
                // Cleared before the caller drains: tokio keeps any readiness that arrives after
                // this guard was handed out, so nothing is lost.
                guard.clear_ready();
                Poll::Ready(Ok(()))
            }
        }
    }
}

impl Backend for Tokio {
    fn watch(&self, fd: WatchedFd) -> io::Result<Box<dyn Readiness>> {
        // `AsyncFd` panics outside a runtime: the caller gets an error instead.
        if let Err(e) = ::tokio::runtime::Handle::try_current() {
            return Err(io::Error::other(format!("the tokio backend needs a tokio runtime: {e}")));
        }
        // tokio 1.54 deprecated the safe constructor in favour of an `unsafe` one whose contract
        // (the descriptor stays open and is not reused while registered) `WatchedFd` meets by
        // construction: it owns its channel. The safe one keeps the feature working with every
        // tokio since 1.38, as old as the crate's MSRV allows.
        #[allow(deprecated)]
        let afd = AsyncFd::with_interest(fd, Interest::READABLE)?;
        Ok(Box::new(TokioReadiness(afd)))
    }
}

impl AsyncCompletionQueue {
    /// [`AsyncCompletionQueue::new`] with the [`Tokio`] backend (call inside a tokio runtime).
    ///
    /// # Errors
    /// As [`AsyncCompletionQueue::new`]; [`Error::Verb`](crate::Error::Verb) outside a tokio runtime.
    ///
    /// # Panics
    /// In a tokio runtime without its I/O driver (see [`Tokio`]).
    pub fn tokio(cq: CompletionQueue, channel: &CompletionChannel) -> Result<Self> {
        Self::new(cq, channel, &Tokio)
    }
}

impl Driver {
    /// [`Driver::new`] with the [`Tokio`] backend (call inside a tokio runtime).
    ///
    /// # Errors
    /// As [`Driver::new`]; [`Error::Verb`](crate::Error::Verb) outside a tokio runtime.
    ///
    /// # Panics
    /// In a tokio runtime without its I/O driver (see [`Tokio`]).
    pub fn tokio(cq: CompletionQueue, channel: &CompletionChannel) -> Result<Self> {
        Self::new(cq, channel, &Tokio)
    }
}
