//! Asynchronous events of a device context (`ibv_get_async_event`): port state changes, queue
//! pair and completion queue errors, fatal device errors.
//!
//! # When events are acknowledged (the argument)
//!
//! `ibv_destroy_qp`, `ibv_destroy_cq` and `ibv_destroy_srq` wait until every asynchronous event
//! of the object that was read has been acknowledged (`ibv_ack_async_event`). An event that the
//! caller could hold unacknowledged (and `mem::forget`) would therefore make the drop of its
//! object hang forever. So [`AsyncEvents`] acknowledges each event *as it reads it*, after
//! copying out what the typed [`AsyncEvent`] needs: the event type, and for a QP its number
//! (read from the `struct ibv_qp` before the acknowledgement, while the pending event keeps the
//! QP from being destroyed). The object itself is named by values that are never dereferenced
//! (a number unique in the process, a QP number, a port number: never an address another object
//! may get once the first is destroyed), so an event about an object that is gone
//! stays harmless. An [`AsyncEvent`] is a plain `Copy` value: nothing of it is left to
//! acknowledge, and its drop is trivial ("acknowledged automatically" at read).

use std::fmt;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;

use crate::device::{Context, ContextInner, CqId, ObjectKind, QpId};
use crate::error::{Error, Result};
use crate::fd::{self, ReadinessFd};
use crate::queue::{CompletionQueue, QueuePair, SharedReceiveQueue};

/// The type of an asynchronous event (`enum ibv_event_type`); sound for any value the library
/// writes, with a constant for each value rdma-core defines.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct AsyncEventType(pub u32);

impl AsyncEventType {
    /// A completion queue overran or hit an error (`IBV_EVENT_CQ_ERR`); names the CQ.
    pub const CQ_ERR: Self = Self(ffi::ibv_event_type::IBV_EVENT_CQ_ERR.0);
    /// A queue pair hit an error the device could not report in a completion and went to the
    /// error state (`IBV_EVENT_QP_FATAL`).
    pub const QP_FATAL: Self = Self(ffi::ibv_event_type::IBV_EVENT_QP_FATAL.0);
    /// Invalid request local work queue error: a transport error the responder detected
    /// (`IBV_EVENT_QP_REQ_ERR`); the QP went to the error state.
    pub const QP_REQ_ERR: Self = Self(ffi::ibv_event_type::IBV_EVENT_QP_REQ_ERR.0);
    /// Local access violation error: a remote peer's request violated the protection of this
    /// QP's memory (`IBV_EVENT_QP_ACCESS_ERR`); the QP went to the error state.
    pub const QP_ACCESS_ERR: Self = Self(ffi::ibv_event_type::IBV_EVENT_QP_ACCESS_ERR.0);
    /// The first packet arrived on a QP in RTR (`IBV_EVENT_COMM_EST`).
    pub const COMM_EST: Self = Self(ffi::ibv_event_type::IBV_EVENT_COMM_EST.0);
    /// A QP's send queue drained after a move to SQD (`IBV_EVENT_SQ_DRAINED`).
    pub const SQ_DRAINED: Self = Self(ffi::ibv_event_type::IBV_EVENT_SQ_DRAINED.0);
    /// A QP migrated to its alternate path (`IBV_EVENT_PATH_MIG`).
    pub const PATH_MIG: Self = Self(ffi::ibv_event_type::IBV_EVENT_PATH_MIG.0);
    /// A QP's path migration failed (`IBV_EVENT_PATH_MIG_ERR`).
    pub const PATH_MIG_ERR: Self = Self(ffi::ibv_event_type::IBV_EVENT_PATH_MIG_ERR.0);
    /// The device failed: every object of the context is unusable (`IBV_EVENT_DEVICE_FATAL`).
    pub const DEVICE_FATAL: Self = Self(ffi::ibv_event_type::IBV_EVENT_DEVICE_FATAL.0);
    /// A port became active (`IBV_EVENT_PORT_ACTIVE`); names the port.
    pub const PORT_ACTIVE: Self = Self(ffi::ibv_event_type::IBV_EVENT_PORT_ACTIVE.0);
    /// A port left the active state (`IBV_EVENT_PORT_ERR`), e.g. its link went down.
    pub const PORT_ERR: Self = Self(ffi::ibv_event_type::IBV_EVENT_PORT_ERR.0);
    /// A port's LID changed (`IBV_EVENT_LID_CHANGE`).
    pub const LID_CHANGE: Self = Self(ffi::ibv_event_type::IBV_EVENT_LID_CHANGE.0);
    /// A port's P_Key table changed (`IBV_EVENT_PKEY_CHANGE`).
    pub const PKEY_CHANGE: Self = Self(ffi::ibv_event_type::IBV_EVENT_PKEY_CHANGE.0);
    /// The subnet manager of a port changed (`IBV_EVENT_SM_CHANGE`).
    pub const SM_CHANGE: Self = Self(ffi::ibv_event_type::IBV_EVENT_SM_CHANGE.0);
    /// A shared receive queue hit an error (`IBV_EVENT_SRQ_ERR`).
    pub const SRQ_ERR: Self = Self(ffi::ibv_event_type::IBV_EVENT_SRQ_ERR.0);
    /// A shared receive queue fell below its armed limit (`IBV_EVENT_SRQ_LIMIT_REACHED`).
    pub const SRQ_LIMIT_REACHED: Self = Self(ffi::ibv_event_type::IBV_EVENT_SRQ_LIMIT_REACHED.0);
    /// The last work request of a QP attached to an SRQ was consumed after the QP went to the
    /// error state (`IBV_EVENT_QP_LAST_WQE_REACHED`).
    pub const QP_LAST_WQE_REACHED: Self = Self(ffi::ibv_event_type::IBV_EVENT_QP_LAST_WQE_REACHED.0);
    /// The subnet manager asks clients to re-register (`IBV_EVENT_CLIENT_REREGISTER`).
    pub const CLIENT_REREGISTER: Self = Self(ffi::ibv_event_type::IBV_EVENT_CLIENT_REREGISTER.0);
    /// A port's GID table changed (`IBV_EVENT_GID_CHANGE`), e.g. an IP address of the netdev
    /// under a RoCE port came or went.
    pub const GID_CHANGE: Self = Self(ffi::ibv_event_type::IBV_EVENT_GID_CHANGE.0);
    /// A work queue (`ibv_wq`) hit a fatal error (`IBV_EVENT_WQ_FATAL`).
    pub const WQ_FATAL: Self = Self(ffi::ibv_event_type::IBV_EVENT_WQ_FATAL.0);

    /// The constant's name, `None` for a value this crate does not know.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::CQ_ERR => "CQ_ERR",
            Self::QP_FATAL => "QP_FATAL",
            Self::QP_REQ_ERR => "QP_REQ_ERR",
            Self::QP_ACCESS_ERR => "QP_ACCESS_ERR",
            Self::COMM_EST => "COMM_EST",
            Self::SQ_DRAINED => "SQ_DRAINED",
            Self::PATH_MIG => "PATH_MIG",
            Self::PATH_MIG_ERR => "PATH_MIG_ERR",
            Self::DEVICE_FATAL => "DEVICE_FATAL",
            Self::PORT_ACTIVE => "PORT_ACTIVE",
            Self::PORT_ERR => "PORT_ERR",
            Self::LID_CHANGE => "LID_CHANGE",
            Self::PKEY_CHANGE => "PKEY_CHANGE",
            Self::SM_CHANGE => "SM_CHANGE",
            Self::SRQ_ERR => "SRQ_ERR",
            Self::SRQ_LIMIT_REACHED => "SRQ_LIMIT_REACHED",
            Self::QP_LAST_WQE_REACHED => "QP_LAST_WQE_REACHED",
            Self::CLIENT_REREGISTER => "CLIENT_REREGISTER",
            Self::GID_CHANGE => "GID_CHANGE",
            Self::WQ_FATAL => "WQ_FATAL",
            _ => return None,
        })
    }

    /// Which kind of object the event names (what `ibv_async_event.element` holds).
    fn element(self) -> Element {
        match self {
            Self::CQ_ERR => Element::Cq,
            Self::QP_FATAL
            | Self::QP_REQ_ERR
            | Self::QP_ACCESS_ERR
            | Self::COMM_EST
            | Self::SQ_DRAINED
            | Self::PATH_MIG
            | Self::PATH_MIG_ERR
            | Self::QP_LAST_WQE_REACHED => Element::Qp,
            Self::SRQ_ERR | Self::SRQ_LIMIT_REACHED => Element::Srq,
            Self::WQ_FATAL => Element::Wq,
            Self::PORT_ACTIVE
            | Self::PORT_ERR
            | Self::LID_CHANGE
            | Self::PKEY_CHANGE
            | Self::SM_CHANGE
            | Self::CLIENT_REREGISTER
            | Self::GID_CHANGE => Element::Port,
            Self::DEVICE_FATAL => Element::Device,
            _ => Element::Unknown,
        }
    }
}

impl fmt::Debug for AsyncEventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "AsyncEventType({})", self.0),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Element {
    Cq,
    Qp,
    Srq,
    Wq,
    Port,
    Device,
    Unknown,
}

/// The object an [`AsyncEvent`] is about, as plain values (never pointers that could dangle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncObject {
    /// A queue pair: its id and QP number (read while the QP was alive).
    QueuePair {
        /// Compare with [`QueuePair::id`](crate::QueuePair::id).
        id: QpId,
        /// The QP number ([`QueuePair::qp_num`](crate::QueuePair::qp_num)).
        qp_num: u32,
    },
    /// A completion queue (compare with [`CompletionQueue::id`](crate::CompletionQueue::id); 0
    /// for a CQ created with `ffi`).
    CompletionQueue(CqId),
    /// A shared receive queue: its number, unique in the process (compare with
    /// [`SharedReceiveQueue::id`](crate::SharedReceiveQueue::id); 0 for an SRQ created with
    /// `ffi`).
    SharedReceiveQueue(u64),
    /// A work queue: the address of its `struct ibv_wq`, as a value.
    WorkQueue(usize),
    /// A port of the device (1-based).
    Port(u8),
    /// The whole device.
    Device,
    /// An event type this crate does not know: the object is not read.
    Unknown,
}

/// An asynchronous event (`struct ibv_async_event`), copied out and already acknowledged
/// (`ibv_ack_async_event()` runs when it is read): see [`AsyncEvents`]. Holding, dropping or
/// forgetting it never delays the destruction of the object it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AsyncEvent {
    kind: AsyncEventType,
    object: AsyncObject,
}

impl AsyncEvent {
    /// The event's type.
    pub fn kind(&self) -> AsyncEventType {
        self.kind
    }

    /// The object it is about.
    pub fn object(&self) -> AsyncObject {
        self.object
    }

    /// The port number of a port event.
    pub fn port(&self) -> Option<u8> {
        match self.object {
            AsyncObject::Port(p) => Some(p),
            _ => None,
        }
    }

    /// The QP number of a queue pair event.
    pub fn qp_num(&self) -> Option<u32> {
        match self.object {
            AsyncObject::QueuePair { qp_num, .. } => Some(qp_num),
            _ => None,
        }
    }

    /// Whether the event is about `qp` (same id and QP number).
    pub fn is_for_qp(&self, qp: &QueuePair) -> bool {
        self.object == AsyncObject::QueuePair { id: qp.id(), qp_num: qp.qp_num() }
    }

    /// Whether the event is about `srq` (e.g. [`AsyncEventType::SRQ_LIMIT_REACHED`]).
    pub fn is_for_srq(&self, srq: &SharedReceiveQueue) -> bool {
        self.object == AsyncObject::SharedReceiveQueue(srq.id())
    }

    /// Whether the event is about `cq`.
    pub fn is_for_cq(&self, cq: &CompletionQueue) -> bool {
        self.object == AsyncObject::CompletionQueue(cq.id())
    }
}

/// The asynchronous event queue of a device context: [`Context::async_events`].
///
/// Each event is read by exactly one reader, whichever handle (or clone) reads it. Reading
/// acknowledges (see [`AsyncEvent`]).
///
/// # Reactors
/// Like [`CompletionChannel`](crate::CompletionChannel), it implements [`AsFd`] with a private
/// epoll descriptor that is readable exactly when the context's event descriptor is and that
/// cannot be read (`EINVAL`), so no event can be consumed behind the crate's back; [`AsRawFd`]
/// gives the context's own `async_fd`, to watch, never to read. Readiness is level-triggered:
/// after a wake-up call [`try_get`](Self::try_get) until it returns `None`.
#[derive(Clone)]
pub struct AsyncEvents {
    inner: Arc<AsyncInner>,
}

struct AsyncInner {
    ctx: Arc<ContextInner>,
    ready: ReadinessFd,
}

impl fmt::Debug for AsyncEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncEvents").field("fd", &self.as_raw_fd()).finish()
    }
}

impl AsyncEvents {
    /// Reads one event if there is one, without blocking (`ibv_get_async_event()` on the
    /// non-blocking descriptor), copies it and acknowledges it (`ibv_ack_async_event()`).
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_get_async_event()` fails other than with `EAGAIN`.
    #[doc(alias = "ibv_get_async_event")]
    #[doc(alias = "ibv_ack_async_event")]
    pub fn try_get(&self) -> Result<Option<AsyncEvent>> {
        // SAFETY: all-zero is a valid ibv_async_event (null pointers and integers).
        let mut ev: ffi::ibv_async_event = unsafe { MaybeUninit::zeroed().assume_init() };
        // SAFETY: valid context and out-pointer; async_fd is non-blocking (set when this
        // handle was made), so this returns.
        let ret = unsafe { ffi::ibv_get_async_event(self.inner.ctx.raw.as_ptr(), &mut ev) };
        if ret != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(Error::Verb { verb: "ibv_get_async_event", source: e });
        }
        let kind = AsyncEventType(ev.event_type.0);
        // The CQ, QP or SRQ is alive while its event is not acknowledged (its destruction waits
        // for that): its address names it in the context's serials until the acknowledgement.
        let serial = |kind, addr| self.inner.ctx.serials.get(kind, addr);
        // SAFETY: the union member read is the one `event_type` says libibverbs wrote. The QP
        // is alive while its event is not acknowledged (ibv_destroy_qp waits for it), so its
        // qp_num may be read before the acknowledgement below. Nothing is read after it.
        let object = unsafe {
            match kind.element() {
                Element::Cq => {
                    AsyncObject::CompletionQueue(CqId(serial(ObjectKind::Cq, ev.element.cq as usize)))
                }
                Element::Qp => {
                    let qp = ev.element.qp;
                    let qp_num = if qp.is_null() { 0 } else { (*qp).qp_num };
                    AsyncObject::QueuePair { id: QpId(serial(ObjectKind::Qp, qp as usize)), qp_num }
                }
                Element::Srq => {
                    AsyncObject::SharedReceiveQueue(serial(ObjectKind::Srq, ev.element.srq as usize))
                }
                Element::Wq => AsyncObject::WorkQueue(ev.element.wq as usize),
                Element::Port => AsyncObject::Port(u8::try_from(ev.element.port_num).unwrap_or(0)),
                Element::Device => AsyncObject::Device,
                Element::Unknown => AsyncObject::Unknown,
            }
        };
        // SAFETY: an event returned by ibv_get_async_event, acknowledged exactly once.
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Ok(Some(AsyncEvent { kind, object }))
    }

    /// Waits up to `timeout` (forever for `None`) for an event; `None` on timeout. Events
    /// other threads read meanwhile are theirs. A signal does not end the wait early.
    ///
    /// # Errors
    /// [`Error::Verb`] when `poll(2)` or `ibv_get_async_event()` fails.
    #[doc(alias = "ibv_get_async_event")]
    #[doc(alias = "ibv_ack_async_event")]
    pub fn get(&self, timeout: Option<Duration>) -> Result<Option<AsyncEvent>> {
        fd::take_until(self.as_raw_fd(), timeout, || self.try_get())
    }
}

impl AsRawFd for AsyncEvents {
    /// The context's `async_fd`, to watch for readability, never to read (see the type's
    /// docs).
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the context is valid while self lives; async_fd is written at open.
        unsafe { (*self.inner.ctx.raw.as_ptr()).async_fd }
    }
}

impl AsFd for AsyncEvents {
    /// A private epoll descriptor readable exactly when events are pending (see the type's
    /// docs).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.ready.as_fd()
    }
}

impl Context {
    /// The context's asynchronous event queue (`ibv_get_async_event()`): port changes, QP and
    /// CQ errors, fatal device errors. Makes the context's `async_fd` non-blocking. Every
    /// handle (and every call) reads from the same queue of the context; each event goes to one
    /// reader.
    ///
    /// # Errors
    /// [`Error::Verb`] when `fcntl` or setting up the epoll descriptor fails.
    #[doc(alias = "ibv_get_async_event")]
    pub fn async_events(&self) -> Result<AsyncEvents> {
        // SAFETY: valid context; async_fd is written at open.
        let fd = unsafe { (*self.as_raw()).async_fd };
        fd::set_nonblocking(fd).map_err(|source| Error::Verb { verb: "fcntl", source })?;
        let ready = ReadinessFd::new(fd).map_err(|source| Error::Verb { verb: "epoll_ctl", source })?;
        Ok(AsyncEvents { inner: Arc::new(AsyncInner { ctx: self.inner.clone(), ready }) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_type_has_a_name_and_an_object_kind() {
        for v in 0..=19 {
            let t = AsyncEventType(v);
            assert!(t.name().is_some(), "{v}");
            assert!(t.element() != Element::Unknown, "{v}");
        }
        assert_eq!(format!("{:?}", AsyncEventType(999)), "AsyncEventType(999)");
        assert_eq!(format!("{:?}", AsyncEventType::PORT_ERR), "PORT_ERR");
        assert!(AsyncEventType(999).element() == Element::Unknown);
    }
}
