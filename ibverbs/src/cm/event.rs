//! RDMA-CM event channels and events.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ibverbs_sys as ffi;

use crate::attr::CmEventKind;
use crate::cm::id::{CmId, CmIdInner};
use crate::error::{cvt, cvt_p, Error, Result};
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

/// An RDMA-CM event (`struct rdma_cm_event`), copied out of librdmacm and already acknowledged.
pub struct CmEvent {
    kind: CmEventKind,
    status: i32,
    /// The serial of the id the event is about (see `CmIdInner::serial`; 0: none).
    id: u64,
    /// For a connection request, the listener's serial.
    listen_id: u64,
    private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    new_id: Option<CmId>,
}

impl fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEvent")
            .field("kind", &self.kind)
            .field("status", &self.status)
            .field("private_data_len", &self.private_data.len())
            .field("new_id", &self.new_id.is_some())
            .finish()
    }
}

impl CmEvent {
    /// What happened.
    pub fn kind(&self) -> CmEventKind {
        self.kind
    }

    /// The event's status: 0 on success; for errors a negated errno value, or for
    /// [`CmEventKind::REJECTED`] the transport's reject reason.
    pub fn status(&self) -> i32 {
        self.status
    }

    /// Whether the event is about `id` (for a connection request: whether `id` is the listener
    /// it came to).
    pub fn is_for(&self, id: &CmId) -> bool {
        // By serial, not address: an event kept after its id was destroyed is not taken for
        // one of a later id that librdmacm allocated at the same address.
        let serial = id.inner.serial;
        self.id == serial || (self.kind == CmEventKind::CONNECT_REQUEST && self.listen_id == serial)
    }

    /// The private data the peer sent with a connection request, accept or reject (a copy; on
    /// InfiniBand and RoCE the transport pads it to its maximum size with zeros).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The connection parameters the peer asked for (`responder_resources`, `initiator_depth`,
    /// `retry_count`, `rnr_retry_count`), in a connection request or reply.
    pub fn conn_param(&self) -> (u8, u8, u8, u8) {
        (self.responder_resources, self.initiator_depth, self.retry_count, self.rnr_retry_count)
    }

    /// Takes the new id of a [`CmEventKind::CONNECT_REQUEST`]: accept or reject it. It is owned
    /// by the caller, not by the listener, and has an event channel of its own
    /// ([`CmId::channel`]). Dropping it (or the event) unaccepted destroys it, which the peer
    /// sees as a rejection or timeout.
    pub fn take_new_id(&mut self) -> Option<CmId> {
        self.new_id.take()
    }
}

impl EventChannel {
    /// Creates an event channel (`rdma_create_event_channel()`), with a non-blocking
    /// descriptor.
    ///
    /// # Errors
    /// [`Error::Verb`] when the call fails (e.g. no `rdma_ucm` module: `ENODEV`).
    #[doc(alias = "rdma_create_event_channel")]
    pub fn new() -> Result<EventChannel> {
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

    /// Creates an id for RC connections (port space `RDMA_PS_TCP`) on this channel
    /// (`rdma_create_id()`).
    ///
    /// # Errors
    /// [`Error::Verb`] when the call fails.
    #[doc(alias = "rdma_create_id")]
    pub fn create_id(&self) -> Result<CmId> {
        let _g = self.inner.lock();
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid channel and out-pointer; the id is destroyed once in CmIdInner::drop.
        let ret = unsafe {
            ffi::rdma_create_id(
                self.inner.raw(),
                &mut raw,
                std::ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        cvt("rdma_create_id", ret)?;
        let raw = cvt_p("rdma_create_id", raw)?;
        self.inner.ids.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the new id of this channel, ours alone.
        Ok(CmId { inner: Arc::new(unsafe { CmIdInner::adopt(raw, self.inner.clone()) }) })
    }

    /// Waits up to `timeout` (forever for `None`) for an event (`rdma_get_cm_event()`), copies
    /// it and acknowledges it (`rdma_ack_cm_event()`); `None` on timeout or when another thread
    /// took the event.
    ///
    /// A [`CmEventKind::CONNECT_REQUEST`]'s new id is moved to an event channel of its own
    /// (`rdma_migrate_id()`) before it is handed out.
    ///
    /// The wait is for an event; taking the channel's lock is not part of it: while an id of
    /// this channel connects on siw ([`CmId::connect`](crate::cm::CmId::connect), which holds
    /// the lock as long as TCP takes), this call waits for it beyond `timeout`.
    ///
    /// # Errors
    /// [`Error::Verb`] when `poll(2)`, `rdma_get_cm_event()` or, for a connection request,
    /// `rdma_create_event_channel()`/`rdma_migrate_id()` fails (the request is then rejected).
    #[doc(alias = "rdma_get_cm_event")]
    #[doc(alias = "rdma_ack_cm_event")]
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<Option<CmEvent>> {
        let readable = crate::fd::wait_readable(self.as_raw_fd(), timeout)
            .map_err(|source| Error::Verb { verb: "poll", source })?;
        if !readable {
            return Ok(None);
        }
        let guard = self.inner.lock();
        let mut ev = std::ptr::null_mut();
        // SAFETY: valid channel and out-pointer; the descriptor is non-blocking.
        let ret = unsafe { ffi::rdma_get_cm_event(self.inner.raw(), &mut ev) };
        if ret != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(Error::Verb { verb: "rdma_get_cm_event", source: e });
        }
        let Some(ev) = NonNull::new(ev) else {
            return Err(Error::InvalidArgument { verb: "rdma_get_cm_event", reason: "returned no event" });
        };
        // SAFETY: a valid event until it is acknowledged below; librdmacm zero-fills it
        // (memset before each event is read), so the parameter union is initialised whichever
        // member it wrote.
        let (kind, status, id, listen_id, conn) = unsafe {
            let e = &*ev.as_ptr();
            (CmEventKind(e.event.0), e.status, e.id, e.listen_id, e.param.conn)
        };
        // The serials of the ids the event names, from their `context` (see `CmIdInner`); a
        // connection request's new id has its listener's until it is adopted below.
        let serial = |p: *mut ffi::rdma_cm_id| {
            if p.is_null() {
                return 0;
            }
            // SAFETY: the ids an unacknowledged event names are alive (rdma_destroy_id waits
            // for the acknowledgement); `context` is written only when an id is adopted, before
            // any of its events can be read.
            unsafe { (*p).context as usize as u64 }
        };
        let (id_serial, listen_serial) = (serial(id), serial(listen_id));
        let mut private_data = Vec::new();
        if !conn.private_data.is_null() && conn.private_data_len > 0 {
            // SAFETY: librdmacm points private_data at the event's own buffer of
            // RDMA_MAX_PRIVATE_DATA (256) bytes and writes its length (a u8, at most 255).
            let bytes = unsafe {
                std::slice::from_raw_parts(conn.private_data.cast::<u8>(), conn.private_data_len.into())
            };
            private_data.extend_from_slice(bytes);
        }
        // SAFETY: the event came from rdma_get_cm_event and is acknowledged once; nothing of
        // it is used afterwards (all copied above). Acknowledged before any id could be
        // destroyed: rdma_destroy_id waits for its events' acknowledgements.
        unsafe { ffi::rdma_ack_cm_event(ev.as_ptr()) };
        let new_id = match (kind == CmEventKind::CONNECT_REQUEST, NonNull::new(id)) {
            (true, Some(new)) => Some(Self::adopt_request(new)?),
            _ => None,
        };
        drop(guard);
        Ok(Some(CmEvent {
            kind,
            status,
            id: new_id.as_ref().map_or(id_serial, |n| n.inner.serial),
            listen_id: listen_serial,
            private_data,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
            retry_count: conn.retry_count,
            rnr_retry_count: conn.rnr_retry_count,
            new_id,
        }))
    }

    /// Gives a connection request's new id (whose event is acknowledged) a channel of its own
    /// and an owner; rejects and destroys it if that fails.
    fn adopt_request(new: NonNull<ffi::rdma_cm_id>) -> Result<CmId> {
        let fail = |e: Error| {
            // SAFETY: the new id is ours alone (never handed out), its only event acknowledged,
            // no QP on it: reject and destroy it once.
            unsafe {
                ffi::rdma_reject(new.as_ptr(), std::ptr::null(), 0);
                ffi::rdma_destroy_id(new.as_ptr());
            }
            e
        };
        let ch = EventChannel::new().map_err(fail)?;
        // SAFETY: valid id and channel; all events of the id are acknowledged, so the call
        // does not wait.
        let ret = unsafe { ffi::rdma_migrate_id(new.as_ptr(), ch.inner.raw()) };
        cvt("rdma_migrate_id", ret).map_err(fail)?;
        ch.inner.ids.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the request's new id, now on `ch`, ours alone (never handed out).
        Ok(CmId { inner: Arc::new(unsafe { CmIdInner::adopt(new, ch.inner) }) })
    }

    /// The raw `struct rdma_event_channel *`. What `ffi` calls may not do with it: read events
    /// without acknowledging them, or destroy it.
    pub fn as_raw(&self) -> *mut ffi::rdma_event_channel {
        self.inner.raw()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_kinds_print_their_names() {
        assert_eq!(format!("{:?}", CmEventKind::ESTABLISHED), "ESTABLISHED");
        assert_eq!(format!("{:?}", CmEventKind::TIMEWAIT_EXIT), "TIMEWAIT_EXIT");
        assert_eq!(format!("{:?}", CmEventKind(999)), "CmEventKind(999)");
    }
}
