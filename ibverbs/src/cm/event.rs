//! RDMA-CM event channels and events.

use std::fmt;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;

use crate::attr::CmEventKind;
use crate::cm::channel::EventChannel;
use crate::cm::id::{CmId, CmIdInner};
use crate::cm::sys::deadline_in;
use crate::error::{cvt, Error, Result};

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
    /// The group of a [`CmEventKind::MULTICAST_JOIN`].
    mcast: Option<McastJoin>,
}

/// The multicast group a [`CmEventKind::MULTICAST_JOIN`] event reports (its `param.ud`,
/// `struct rdma_ud_param`), typed: the group's GID and LID, the service level, the remote QP
/// number and Q_Key to send to it with, and its address vector, from which
/// [`create_ah`](Self::create_ah) makes the address handle. By the time the event is returned
/// the id's queue pair, if it had one, is attached to the group (librdmacm calls
/// `ibv_attach_mcast()` while the event is read; when that fails the event is
/// `MULTICAST_ERROR` instead). From [`CmId::join_multicast`].
#[derive(Clone, Copy)]
pub struct McastJoin {
    gid: crate::attr::Gid,
    lid: u16,
    qp_num: u32,
    qkey: u32,
    sl: u8,
    ah_attr: ffi::ibv_ah_attr,
}

impl fmt::Debug for McastJoin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McastJoin")
            .field("gid", &self.gid)
            .field("lid", &self.lid)
            .field("qp_num", &self.qp_num)
            .field("qkey", &self.qkey)
            .field("sl", &self.sl)
            .finish()
    }
}

impl McastJoin {
    /// The group's GID (`ah_attr.grh.dgid`; on RoCE v2 an IPv4 group's IPv4-mapped address,
    /// `::ffff:a.b.c.d`).
    pub fn gid(&self) -> crate::attr::Gid {
        self.gid
    }

    /// The group's LID (`ah_attr.dlid`: the multicast LID on InfiniBand; 0 on RoCE).
    pub fn lid(&self) -> u16 {
        self.lid
    }

    /// The remote QP number of sends to the group (`qp_num`: `0xFFFFFF`,
    /// [`MCAST_QPN`](crate::MCAST_QPN)).
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The Q_Key of sends to the group (`qkey`: `RDMA_UDP_QKEY`, `0x01234567`, in the UDP port
    /// space).
    pub fn qkey(&self) -> u32 {
        self.qkey
    }

    /// The service level of the group's path (`ah_attr.sl`).
    pub fn sl(&self) -> u8 {
        self.sl
    }

    /// The address vector of the event (`ah_attr`), as [`create_ah`](Self::create_ah) passes
    /// it to `ibv_create_ah()`.
    pub fn ah_attr(&self) -> &ffi::ibv_ah_attr {
        &self.ah_attr
    }

    /// An address handle for the group (`ibv_create_ah()` with the event's address vector:
    /// the group's GID with the id's port and source GID index), in `pd`, which must be of the
    /// id's device context ([`CmId::context`]). Send with
    /// `SendRequest::send(..).ud(&ah, join.qp_num(), join.qkey())`.
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_create_ah()` (e.g. `EINVAL` for a `pd` of another device, whose
    /// ports or GID table the address vector does not fit).
    #[doc(alias = "ibv_create_ah")]
    pub fn create_ah(&self, pd: &crate::pd::ProtectionDomain) -> Result<crate::ah::AddressHandle> {
        let mut attr = self.ah_attr;
        pd.create_ah_raw(&mut attr)
    }
}

impl fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEvent")
            .field("kind", &self.kind)
            .field("status", &self.status)
            .field("private_data_len", &self.private_data.len())
            .field("new_id", &self.new_id.is_some())
            .field("multicast", &self.mcast)
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

    /// The group of a [`CmEventKind::MULTICAST_JOIN`] event ([`CmId::join_multicast`]); `None`
    /// for any other event (`MULTICAST_ERROR` carries only its [`status`](Self::status)).
    #[doc(alias = "rdma_ud_param")]
    pub fn multicast(&self) -> Option<&McastJoin> {
        self.mcast.as_ref()
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
        let mcast = (kind == CmEventKind::MULTICAST_JOIN).then(|| {
            // SAFETY: as above; a MULTICAST_JOIN event's parameters are the `ud` member (plain
            // data: its `private_data` is the join's context, which we always pass as NULL).
            let ud = unsafe { (*ev.as_ptr()).param.ud };
            McastJoin {
                gid: crate::attr::Gid::from_raw(&ud.ah_attr.grh.dgid),
                lid: ud.ah_attr.dlid,
                qp_num: ud.qp_num,
                qkey: ud.qkey,
                sl: ud.ah_attr.sl,
                ah_attr: ud.ah_attr,
            }
        });
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
            mcast,
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
}

impl CmId {
    /// Waits (bounded by `timeout`) for the next event on the id's channel, which must be
    /// private to the id; `Err(Error::Timeout)` when none comes.
    pub(crate) fn next_event(&self, verb: &'static str, timeout: Duration) -> Result<CmEvent> {
        let ch = self.channel();
        let deadline = deadline_in(timeout);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if let Some(ev) = ch.get_event(Some(left))? {
                return Ok(ev);
            }
            if left.is_zero() {
                return Err(Error::Timeout { verb, waited: timeout });
            }
        }
    }
}
