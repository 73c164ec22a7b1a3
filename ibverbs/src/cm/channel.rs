//! RDMA-CM event channels (`struct rdma_event_channel`): the descriptor through which librdmacm
//! reports the events of the ids created on it, and the lock every call on those ids takes.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard};

use ibverbs_sys as ffi;

use crate::error::{cvt_p, Error, Result};
use crate::fd::ReadinessFd;

pub(crate) struct ChannelInner {
    raw: NonNull<ffi::rdma_event_channel>,
    /// Held by every librdmacm call on an id of this channel and while an event is processed:
    /// librdmacm reads and writes the id's fields (`qp`, `route`...) in both.
    lock: Mutex<()>,
    /// The epoll instance handed out as `AsFd`.
    ready: ReadinessFd,
    /// Live ids reporting to this channel (changed under `lock`): the blocking helpers, which
    /// read every event on an id's channel, take only ids that have theirs to themselves.
    pub(crate) ids: AtomicUsize,
}

// SAFETY: an event channel is a descriptor; librdmacm's calls on it are thread-safe, and the
// fields of its ids are only touched under `lock`.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl ChannelInner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        // The guarded data is `()`: a panic while it was held leaves nothing half-changed.
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn raw(&self) -> *mut ffi::rdma_event_channel {
        self.raw.as_ptr()
    }
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every id of the channel holds an Arc of this inner, so none is left.
        unsafe { ffi::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// An RDMA-CM event channel (`struct rdma_event_channel`): the descriptor through which
/// librdmacm reports the events of the ids created on it.
///
/// [`get_event`](Self::get_event) waits with a bound, copies the event and acknowledges it. For
/// reactors, the channel implements [`AsFd`] with a private epoll descriptor that is readable
/// exactly when the channel is (one more descriptor per channel), and which nothing can read an
/// event from: safe code holding the channel's own descriptor could read an event that is never
/// acknowledged, after which `rdma_destroy_id` would block forever, so that one is only
/// [`AsRawFd`] (to watch, never to read). When the `AsFd` descriptor is readable, call
/// `get_event(Some(Duration::ZERO))`. Cloning is cheap (an `Arc`).
#[derive(Clone)]
pub struct EventChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel").field("fd", &self.as_raw_fd()).finish()
    }
}

impl AsFd for EventChannel {
    /// A private epoll descriptor, readable exactly when an event waits (see the type's docs).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.ready.as_fd()
    }
}

impl AsRawFd for EventChannel {
    /// The channel's descriptor, to watch for readability (never to read: see the type's docs).
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is valid while self lives; fd is written at creation.
        unsafe { (*self.inner.raw.as_ptr()).fd }
    }
}

impl EventChannel {
    /// Creates an event channel (`rdma_create_event_channel()`), with a non-blocking
    /// descriptor.
    ///
    /// # Errors
    /// [`Error::Verb`] when the call fails (e.g. no `rdma_ucm` module: `ENODEV`); with the
    /// `dlopen` feature, [`Error::LibraryMissing`] when librdmacm or libibverbs cannot be loaded.
    #[doc(alias = "rdma_create_event_channel")]
    pub fn new() -> Result<EventChannel> {
        // Every RDMA-CM object starts from a channel (the blocking helpers make theirs here):
        // with `dlopen`, a missing librdmacm becomes an error at this first call.
        ffi::load_rdmacm()?;
        // SAFETY: no arguments; destroyed once in ChannelInner::drop.
        let raw = cvt_p("rdma_create_event_channel", unsafe { ffi::rdma_create_event_channel() })?;
        // SAFETY: the channel is valid; `fd` is a plain field written at creation.
        let fd = unsafe { (*raw.as_ptr()).fd };
        // Non-blocking: a reader that loses a race for an event returns instead of blocking
        // (librdmacm supports this, see rdma_get_cm_event(3)).
        let ready = crate::fd::set_nonblocking(fd)
            .map_err(|source| Error::Verb { verb: "fcntl", source })
            .and_then(|()| ReadinessFd::new(fd).map_err(|source| Error::Verb { verb: "epoll_ctl", source }));
        match ready {
            Ok(ready) => Ok(EventChannel {
                inner: Arc::new(ChannelInner { raw, lock: Mutex::new(()), ready, ids: AtomicUsize::new(0) }),
            }),
            Err(e) => {
                // SAFETY: created above and owned by nothing else; destroyed once.
                unsafe { ffi::rdma_destroy_event_channel(raw.as_ptr()) };
                Err(e)
            }
        }
    }

    /// The raw `struct rdma_event_channel *`. What `ffi` calls may not do with it: read events
    /// without acknowledging them, or destroy it.
    pub fn as_raw(&self) -> *mut ffi::rdma_event_channel {
        self.inner.raw()
    }
}
