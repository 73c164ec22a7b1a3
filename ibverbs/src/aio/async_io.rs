//! The async-io backend (feature `async-io`, the reactor of smol and friends): watches the
//! channel's epoll descriptor ([`WatchedFd`]'s `AsFd`) with `async_io::Async`.

use std::io;
use std::task::{Context as TaskContext, Poll};

use ::async_io::Async;

use super::backend::{Backend, Readiness};
use super::cq::AsyncCompletionQueue;
use super::driver::Driver;
use super::seam::WatchedFd;
use crate::error::Result;
use crate::queue::{CompletionChannel, CompletionQueue};

/// The async-io reactor (its global reactor thread, started on first use).
#[derive(Debug, Clone, Copy, Default)]
pub struct AsyncIo;

struct AsyncIoReadiness(Async<WatchedFd>);

impl Readiness for AsyncIoReadiness {
    fn poll_readable(&self, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        // async-io reports an event at most once per registration and re-registers on the next
        // `Pending`, where a descriptor that is still readable fires again at once.
        self.0.poll_readable(cx)
    }
}

impl Backend for AsyncIo {
    fn watch(&self, fd: WatchedFd) -> io::Result<Box<dyn Readiness>> {
        Ok(Box::new(AsyncIoReadiness(Async::new(fd)?)))
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
