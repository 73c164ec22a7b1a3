//! Completion event channels.

use std::fmt;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crate::device::{Context, ContextInner};
use crate::error::{cvt_p, Error, Result};
use crate::ffi;

pub(crate) struct ChannelInner {
    pub(crate) raw: NonNull<ffi::ibv_comp_channel>,
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: a completion channel is a file descriptor plus a context pointer; libibverbs allows
// getting events from any thread.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using this channel holds an Arc of this inner, so none is left.
        unsafe { ffi::ibv_destroy_comp_channel(self.raw.as_ptr()) };
    }
}

/// A completion event channel (`struct ibv_comp_channel`): a file descriptor that becomes
/// readable when an armed [`CompletionQueue`](crate::CompletionQueue) gets a completion.
///
/// [`get_event`](Self::get_event) waits with a timeout and acknowledges what it gets. The
/// channel implements [`AsRawFd`] so that a reactor (epoll, mio, tokio's `AsyncFd`) can watch it
/// for readability, but not `AsFd`: a safe `BorrowedFd` could be turned into a `File` and
/// `read()`, consuming an event this crate never learns of and never acknowledges, after which
/// `ibv_destroy_cq` would block forever. Reading the raw descriptor (which takes `unsafe`) is
/// forbidden by this crate's contract: use `get_event`. Cloning is cheap (an `Arc`).
#[derive(Clone)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel").field("fd", &self.as_raw_fd()).finish()
    }
}

/// Identifies the completion queue an event is for (compare with [`CompletionQueue::id`](crate::CompletionQueue::id)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqId(pub(crate) usize);

impl CompletionChannel {
    pub(crate) fn new(ctx: &Context) -> Result<CompletionChannel> {
        // SAFETY: valid context; destroyed once in ChannelInner::drop.
        let raw = cvt_p("ibv_create_comp_channel", unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) })?;
        let ch = CompletionChannel { inner: Arc::new(ChannelInner { raw, ctx: ctx.inner.clone() }) };
        // Non-blocking, so that a racing reader never leaves ibv_get_cq_event blocked forever.
        let fd = ch.as_raw_fd();
        // SAFETY: fcntl on a descriptor we own.
        let ret =
            unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
        if ret < 0 {
            return Err(Error::last_os("fcntl"));
        }
        Ok(ch)
    }

    /// Waits up to `timeout` (forever for `None`) for a completion event, acknowledges it
    /// (`ibv_get_cq_event()` + `ibv_ack_cq_events()`), and returns which CQ it is for; `None` on
    /// timeout. The CQ must be re-armed with [`CompletionQueue::req_notify`](crate::CompletionQueue::req_notify) for the next event.
    ///
    /// # Errors
    /// [`Error::Verb`] when `poll(2)` or `ibv_get_cq_event()` fails.
    #[doc(alias = "ibv_get_cq_event")]
    #[doc(alias = "ibv_ack_cq_events")]
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<Option<CqId>> {
        let ms = match timeout {
            None => -1,
            Some(t) => i32::try_from(t.as_millis()).unwrap_or(i32::MAX),
        };
        let mut pfd = libc::pollfd { fd: self.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(None);
            }
            return Err(Error::Verb { verb: "poll", source: e });
        }
        if n == 0 {
            return Ok(None);
        }
        let mut cq = std::ptr::null_mut();
        let mut cq_ctx = std::ptr::null_mut();
        // SAFETY: valid channel and out-pointers; the fd is non-blocking.
        let ret = unsafe { ffi::ibv_get_cq_event(self.inner.raw.as_ptr(), &mut cq, &mut cq_ctx) };
        if ret != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None); // another thread took it
            }
            return Err(Error::Verb { verb: "ibv_get_cq_event", source: e });
        }
        // SAFETY: `cq` is the CQ the event is for; it cannot be destroyed before this ack
        // (ibv_destroy_cq waits for all events to be acknowledged).
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(Some(CqId(cq as usize)))
    }

    /// The raw `struct ibv_comp_channel *`.
    pub fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.inner.raw.as_ptr()
    }
}

impl AsRawFd for CompletionChannel {
    /// The channel's descriptor, to watch for readability (never to read: see the type's docs).
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is valid while self lives; fd is a plain field written at creation.
        unsafe { (*self.inner.raw.as_ptr()).fd }
    }
}

impl Context {
    /// Creates a completion event channel (`ibv_create_comp_channel()`).
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails.
    #[doc(alias = "ibv_create_comp_channel")]
    pub fn create_comp_channel(&self) -> Result<crate::CompletionChannel> {
        crate::CompletionChannel::new(self)
    }
}
