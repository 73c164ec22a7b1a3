//! The async-io backend (feature `async-io`, the reactor of smol and friends): watches the
//! channel with `async_io::Async`.
//!
//! `async_io::Async` takes a type that implements `AsFd`, which the crate's channel deliberately
//! does not (see [`CompletionChannel`]). The backend wraps the descriptor in a private type that
//! lends it to the reactor only, which registers it with epoll and never reads it; that wrapper
//! is the adaptor's one `unsafe` block.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::task::{Context as TaskContext, Poll};

use ::async_io::Async;

use super::{AsyncCompletionQueue, Backend, Driver, Readiness, WatchedFd};
use crate::error::Result;
use crate::queue::{CompletionChannel, CompletionQueue};

/// The async-io reactor (its global reactor thread, started on first use).
#[derive(Debug, Clone, Copy, Default)]
pub struct AsyncIo;

/// The channel's descriptor, lent to async-io's reactor only (private: no caller can reach the
/// `BorrowedFd` and read from it).
struct Lent(WatchedFd);

impl AsFd for Lent {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: `self.0` keeps the channel, and so its descriptor, open for as long as `self`
        // lives, which bounds the borrow; async-io only registers it with (and removes it from)
        // its poller and never reads or closes it.
        unsafe { BorrowedFd::borrow_raw(self.0.as_raw_fd()) }
    }
}

struct AsyncIoReadiness(Async<Lent>);

impl Readiness for AsyncIoReadiness {
    fn poll_readable(&self, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        // async-io reports an event at most once per registration and re-registers on the next
        // `Pending`, where a descriptor that is still readable fires again at once.
        self.0.poll_readable(cx)
    }
}

impl Backend for AsyncIo {
    fn watch(&self, fd: WatchedFd) -> io::Result<Box<dyn Readiness>> {
        Ok(Box::new(AsyncIoReadiness(Async::new(Lent(fd))?)))
    }
}

impl AsyncCompletionQueue {
    /// [`AsyncCompletionQueue::new`] with the [`AsyncIo`] backend.
    ///
    /// # Errors
    /// As [`AsyncCompletionQueue::new`].
    pub fn async_io(cq: CompletionQueue, channel: &CompletionChannel) -> Result<Self> {
        Self::new(cq, channel, &AsyncIo)
    }
}

impl Driver {
    /// [`Driver::new`] with the [`AsyncIo`] backend.
    ///
    /// # Errors
    /// As [`Driver::new`].
    pub fn async_io(cq: CompletionQueue, channel: &CompletionChannel) -> Result<Self> {
        Self::new(cq, channel, &AsyncIo)
    }
}
