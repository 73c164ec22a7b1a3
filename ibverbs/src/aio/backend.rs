//! What a reactor gives the adaptor: [`Backend`] watches a descriptor, [`Readiness`] reports it
//! readable. The tokio and async-io backends implement them; so can any other runtime.

use std::io;
use std::task::{Context as TaskContext, Poll};

use super::seam::WatchedFd;
use crate::error::Error;

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

pub(super) fn reactor_error(e: io::Error) -> Error {
    Error::Verb { verb: "reactor (waiting for the completion channel)", source: e }
}
