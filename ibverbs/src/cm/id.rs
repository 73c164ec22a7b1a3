//! RDMA-CM identifiers (`struct rdma_cm_id`) and their operations.

use std::fmt;
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;

use crate::attr::TransportType;
use crate::cm::channel::{ChannelInner, EventChannel};
use crate::cm::devices::cm_context;
use crate::cm::sys::{read_sockaddr, timeout_ms, SockAddr};
use crate::device::Context;
use crate::error::{cvt, cvt_p, Error, Result};

pub(crate) struct CmIdInner {
    pub(crate) raw: NonNull<ffi::rdma_cm_id>,
    pub(crate) channel: Arc<ChannelInner>,
    /// This id's number, unique in the process (never reused, unlike the id's address), also
    /// kept in `raw->context` so that an event names its id by it ([`CmEvent::is_for`]).
    ///
    /// [`CmEvent::is_for`]: crate::cm::CmEvent::is_for
    pub(crate) serial: u64,
    /// The multicast groups joined and not left (`rdma_join_multicast` succeeded, once per
    /// call; changed under the channel lock): left before the id's queue pair is destroyed (the
    /// kernel refuses to destroy a queue pair attached to a group, `EBUSY`) and before the id is
    /// (librdmacm's `rdma_destroy_id` does not free the memory of groups not left).
    pub(crate) groups: std::sync::Mutex<Vec<std::net::IpAddr>>,
}

impl CmIdInner {
    /// Takes ownership of `raw`, an id on `channel`, giving it a new serial (written into
    /// `raw->context`).
    ///
    /// # Safety
    /// `raw` is a live id of `channel` that nobody else uses or owns: the returned value
    /// destroys it once.
    pub(crate) unsafe fn adopt(raw: NonNull<ffi::rdma_cm_id>, channel: Arc<ChannelInner>) -> CmIdInner {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let serial = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: a live id that is ours alone (contract); librdmacm never reads `context`.
        unsafe { (*raw.as_ptr()).context = serial as usize as *mut std::ffi::c_void };
        CmIdInner { raw, channel, serial, groups: std::sync::Mutex::new(Vec::new()) }
    }
}

// SAFETY: librdmacm's calls are thread-safe; the id's fields are only read or written under
// its channel's lock.
unsafe impl Send for CmIdInner {}
// SAFETY: as above.
unsafe impl Sync for CmIdInner {}

impl Drop for CmIdInner {
    fn drop(&mut self) {
        let _g = self.channel.lock();
        // Leave what the caller did not (a QP on the id left them already when it was
        // destroyed): librdmacm frees a group's memory only in rdma_leave_multicast.
        // SAFETY: the channel lock is held.
        unsafe { self.leave_all_groups() };
        // SAFETY: created once, destroyed once; a QP on the id holds an Arc of this inner, so
        // it is gone (and `id->qp` cleared). Every event of the id was acknowledged when it was
        // read (get_event acknowledges under the lock we hold), so this does not block.
        unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
        self.channel.ids.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// An RDMA-CM identifier (`struct rdma_cm_id`): the RDMA analogue of a socket, in the
/// `RDMA_PS_TCP` port space (RC connections) or the `RDMA_PS_UDP` one (UD datagrams and
/// multicast: [`EventChannel::create_udp_id`], [`join_multicast`](Self::join_multicast)).
///
/// Created by [`EventChannel::create_id`], [`EventChannel::create_udp_id`] or taken from a connection request
/// ([`CmEvent::take_new_id`](crate::cm::CmEvent::take_new_id)). The calls start an operation
/// whose outcome arrives as an event on the id's [`channel`](Self::channel). Dropping the id
/// destroys it (`rdma_destroy_id()`), after a queue pair created on it (which keeps it alive).
pub struct CmId {
    pub(crate) inner: Arc<CmIdInner>,
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId").field("local", &self.local_addr()).field("peer", &self.peer_addr()).finish()
    }
}

/// Connection parameters of [`CmId::connect`] and [`CmId::accept`] (`struct rdma_conn_param`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnParam {
    /// Private data for the peer. At most the transport's limit, checked before anything is
    /// sent: on InfiniBand and RoCE 56 bytes in a connect, 196 in an accept, 148 in a reject;
    /// on iWARP 255.
    pub private_data: Vec<u8>,
    /// RDMA Reads and atomics the peer may have outstanding towards us.
    pub responder_resources: u8,
    /// RDMA Reads and atomics we may have outstanding towards the peer.
    pub initiator_depth: u8,
    /// Transport retries (0–7; 7 means "forever" on rxe, so the default is 6). In a connect,
    /// the count asked for both queue pairs. In an accept (InfiniBand and RoCE, a queue pair
    /// created on the id), the most the accepted queue pair takes: the connection manager
    /// would give it the peer's request as it is, so a peer asking for 7 (as rdma-core's tools
    /// do) would make it retry for ever on rxe once that peer went silent; it gets the smaller
    /// of the two (see [`CmId::accept`]).
    pub retry_count: u8,
    /// Receiver-not-ready retries (0–7; 7 means "forever"). Default 6. In a connect, what the
    /// accepting side's queue pair is asked to use; in an accept, what the connecting peer's
    /// queue pair gets, and the most the accepted queue pair takes of the peer's request (as
    /// [`retry_count`](Self::retry_count)).
    pub rnr_retry_count: u8,
}

impl Default for ConnParam {
    fn default() -> Self {
        ConnParam {
            private_data: Vec::new(),
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 6,
            rnr_retry_count: 6,
        }
    }
}

/// Which message private data goes in.
#[derive(Clone, Copy)]
enum Message {
    Connect,
    Accept,
    Reject,
}

impl ConnParam {
    fn raw(&self, verb: &'static str, max: usize) -> Result<ffi::rdma_conn_param> {
        if self.private_data.len() > max {
            return Err(Error::PrivateDataTooLong { verb, len: self.private_data.len(), max });
        }
        if self.retry_count > 7 || self.rnr_retry_count > 7 {
            return Err(Error::InvalidArgument { verb, reason: "retry counts are 3-bit values (0..=7)" });
        }
        Ok(ffi::rdma_conn_param {
            private_data: if self.private_data.is_empty() {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            // max <= 255.
            private_data_len: self.private_data.len() as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 0,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: 0,
            qp_num: 0,
        })
    }
}

/// The transport of a bound id's device context.
fn transport(verbs: NonNull<ffi::ibv_context>) -> TransportType {
    // SAFETY: a context stays valid while an id bound to it lives (the callers hold one);
    // `device` is set at open.
    unsafe { TransportType((*(*verbs.as_ptr()).device).transport_type.0) }
}

/// [`CmId::accept`] on InfiniBand or RoCE of an id with a queue pair: librdmacm's transitions of
/// `rdma_accept()` (INIT again, RTR, RTS, from `rdma_init_qp_attr()`), with the retry counts
/// capped at `raw`'s, then `rdma_accept()` with `id->qp` cleared for the call, naming the queue
/// pair in `raw` instead, so that librdmacm leaves its state alone.
///
/// # Safety
/// `id` is a live id bound to a device of the InfiniBand transport, `qp` is its live queue pair
/// (`id->qp`), and the caller holds the id's channel lock (every access to `id->qp` in this
/// crate and in librdmacm's event processing happens under it) for the whole call. `raw` is a
/// checked parameter block whose private data stays valid for the call.
unsafe fn accept_capped(
    id: *mut ffi::rdma_cm_id,
    qp: *mut ffi::ibv_qp,
    raw: &mut ffi::rdma_conn_param,
) -> Result<()> {
    // SAFETY: a live id (the contract).
    let (verbs, port_num) = unsafe { ((*id).verbs, (*id).port_num) };
    let (resp, depth) = (raw.responder_resources, raw.initiator_depth);
    let mut dev = ffi::ibv_device_attr::default();
    // The device's limits matter only for a request's value asked for (255, below).
    if resp == u8::MAX || depth == u8::MAX {
        // SAFETY: the live context of a bound id; a plain struct the call fills.
        cvt("ibv_query_device", unsafe { ffi::ibv_query_device(verbs, &mut dev) })?;
    }
    let mut port = ffi::ibv_port_attr::default();
    // SAFETY: as above (the shim calls the macro version with the full struct).
    cvt("ibv_query_port", unsafe { ffi::ibv_query_port(verbs, port_num, &mut port) })?;
    let modify = |state: ffi::ibv_qp_state, tune: &dyn Fn(&mut ffi::ibv_qp_attr, &mut i32)| {
        let mut attr = ffi::ibv_qp_attr { qp_state: state, ..Default::default() };
        let mut mask = 0;
        // SAFETY: a live id with a connection request, under its channel lock (the contract);
        // plain values the call fills.
        cvt("rdma_init_qp_attr", unsafe { ffi::rdma_init_qp_attr(id, &mut attr, &mut mask) })?;
        tune(&mut attr, &mut mask);
        // SAFETY: the id's live queue pair (the contract); attributes from the kernel's CM.
        cvt("ibv_modify_qp", unsafe { ffi::ibv_modify_qp(qp, &mut attr, mask) })
    };
    // As librdmacm: RDMA_MAX_RESP_RES / RDMA_MAX_INIT_DEPTH (255) ask for the request's value
    // within the device's limit; anything else is taken as it is.
    let limit = |asked: u8, request: u8, max: i32| {
        if asked == u8::MAX {
            request.min(u8::try_from(max).unwrap_or(u8::MAX))
        } else {
            asked
        }
    };
    modify(ffi::ibv_qp_state::IBV_QPS_INIT, &|_, _| {})?;
    let infiniband = u32::from(port.link_layer) == ffi::IBV_LINK_LAYER_INFINIBAND.0;
    modify(ffi::ibv_qp_state::IBV_QPS_RTR, &|attr, mask| {
        // librdmacm's mask of bits 21-24 (RoCE attributes of old kernels) on InfiniBand.
        if infiniband {
            *mask &= !0xe0_0000;
        }
        attr.max_dest_rd_atomic = limit(resp, attr.max_dest_rd_atomic, dev.max_qp_rd_atom);
    })?;
    let (retry, rnr) = (raw.retry_count, raw.rnr_retry_count);
    modify(ffi::ibv_qp_state::IBV_QPS_RTS, &|attr, _| {
        attr.max_rd_atomic = limit(depth, attr.max_rd_atomic, dev.max_qp_init_rd_atom);
        attr.retry_cnt = attr.retry_cnt.min(retry);
        attr.rnr_retry = attr.rnr_retry.min(rnr);
    })?;
    // SAFETY: the live queue pair and id (the contract); `id->qp` is cleared and restored under
    // the channel lock the caller holds, so nothing else sees it cleared; `raw` is checked and
    // its private data valid for the call (the contract).
    let ret = unsafe {
        raw.qp_num = (*qp).qp_num;
        raw.srq = u8::from(!(*qp).srq.is_null());
        (*id).qp = std::ptr::null_mut();
        let ret = ffi::rdma_accept(id, raw);
        (*id).qp = qp;
        ret
    };
    if ret != 0 {
        // As librdmacm when the kernel refuses the accept: the queue pair goes to ERR.
        let err = Error::last_os("rdma_accept");
        let mut attr = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_ERR, ..Default::default() };
        // SAFETY: the id's live queue pair (the contract).
        unsafe { ffi::ibv_modify_qp(qp, &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) };
        return Err(err);
    }
    Ok(())
}

impl CmId {
    pub(crate) fn raw(&self) -> *mut ffi::rdma_cm_id {
        self.inner.raw.as_ptr()
    }

    /// The raw `struct rdma_cm_id *`. What `ffi` calls may not do with it: destroy it, create
    /// or destroy a queue pair or an SRQ on it (librdmacm would give a later queue pair made on
    /// the id that SRQ behind the crate's back), migrate it, or call anything while another
    /// thread may use the id (the crate serialises its own calls with the channel's lock).
    /// Its `context` holds the crate's number for the id, by which events name it
    /// ([`CmEvent::is_for`](crate::cm::CmEvent::is_for)): changed, the id's events are no longer
    /// recognised as its own.
    pub fn as_raw(&self) -> *mut ffi::rdma_cm_id {
        self.raw()
    }

    /// The event channel the id's events arrive on.
    pub fn channel(&self) -> EventChannel {
        EventChannel { inner: self.inner.channel.clone() }
    }

    /// The id's device context (`id->verbs`) as a [`Context`], shared with every other id of
    /// the same device: make the protection domain, CQs and memory regions of the id's queue
    /// pair from it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] before the id is bound to a device (resolve or bind an
    /// address first); [`Error::Verb`] from `rdma_get_devices()`.
    pub fn context(&self) -> Result<Context> {
        let verbs = self.verbs()?;
        cm_context(verbs)
    }

    /// Whether `qp` is the queue pair created on this id (`id->qp`, read under the channel lock
    /// that `rdma_create_qp` and our queue pair's destruction take too).
    pub(crate) fn owns_qp(&self, qp: *mut ffi::ibv_qp) -> bool {
        let _g = self.inner.channel.lock();
        // SAFETY: a live id; its `qp` field is written only under the lock held here.
        let own = unsafe { (*self.raw()).qp };
        !own.is_null() && own == qp
    }

    pub(crate) fn verbs(&self) -> Result<NonNull<ffi::ibv_context>> {
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; its fields are written only under the lock we hold.
        NonNull::new(unsafe { (*self.raw()).verbs }).ok_or(Error::InvalidArgument {
            verb: "rdma_create_qp",
            reason: "the id is not bound to a device yet: resolve or bind an address first",
        })
    }

    fn max_private_data(&self, verb: &'static str, msg: Message) -> Result<usize> {
        let verbs = self.verbs().map_err(|_| Error::InvalidArgument {
            verb,
            reason: "the id is not bound to a device yet: resolve its route first",
        })?;
        Ok(match (transport(verbs), msg) {
            (TransportType::IWARP, _) => 255,
            (_, Message::Connect) => 56,
            (_, Message::Accept) => 196,
            (_, Message::Reject) => 148,
        })
    }

    /// Binds the id to a local address (`rdma_bind_addr()`); port 0 picks one. Binding to a
    /// specific IP address binds the id to that address's device.
    ///
    /// # Errors
    /// [`Error::Verb`] (e.g. `EADDRINUSE`, `EADDRNOTAVAIL`).
    #[doc(alias = "rdma_bind_addr")]
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        let mut sa = SockAddr::new(addr);
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; `sa` is a socket address of its family's size.
        cvt("rdma_bind_addr", unsafe { ffi::rdma_bind_addr(self.raw(), sa.as_mut_ptr()) })
    }

    /// Listens for connection requests (`rdma_listen()`), which arrive as
    /// [`CONNECT_REQUEST`](crate::cm::CmEventKind::CONNECT_REQUEST) events.
    ///
    /// # Errors
    /// [`Error::Verb`] (e.g. `EADDRINUSE`).
    #[doc(alias = "rdma_listen")]
    pub fn listen(&self, backlog: i32) -> Result<()> {
        let _g = self.inner.channel.lock();
        // SAFETY: valid id.
        cvt("rdma_listen", unsafe { ffi::rdma_listen(self.raw(), backlog) })
    }

    /// Resolves `dst` (and the local device) within `timeout` (`rdma_resolve_addr()`), from
    /// `src` if given; the outcome is an [`ADDR_RESOLVED`](crate::cm::CmEventKind::ADDR_RESOLVED)
    /// or [`ADDR_ERROR`](crate::cm::CmEventKind::ADDR_ERROR) event.
    ///
    /// # Errors
    /// [`Error::Verb`] when the request cannot be started (e.g. `EADDRNOTAVAIL`, `ENODEV`).
    #[doc(alias = "rdma_resolve_addr")]
    pub fn resolve_addr(&self, src: Option<SocketAddr>, dst: SocketAddr, timeout: Duration) -> Result<()> {
        let mut src = src.map(SockAddr::new);
        let mut dst = SockAddr::new(dst);
        let src_ptr = src.as_mut().map_or(std::ptr::null_mut(), SockAddr::as_mut_ptr);
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; socket addresses of their families' sizes (or NULL for src).
        let ret =
            unsafe { ffi::rdma_resolve_addr(self.raw(), src_ptr, dst.as_mut_ptr(), timeout_ms(timeout)) };
        cvt("rdma_resolve_addr", ret)
    }

    /// Resolves the route to the resolved address within `timeout` (`rdma_resolve_route()`);
    /// the outcome is a [`ROUTE_RESOLVED`](crate::cm::CmEventKind::ROUTE_RESOLVED) or
    /// [`ROUTE_ERROR`](crate::cm::CmEventKind::ROUTE_ERROR) event.
    ///
    /// # Errors
    /// [`Error::Verb`] when the request cannot be started.
    #[doc(alias = "rdma_resolve_route")]
    pub fn resolve_route(&self, timeout: Duration) -> Result<()> {
        let _g = self.inner.channel.lock();
        // SAFETY: valid id.
        cvt("rdma_resolve_route", unsafe { ffi::rdma_resolve_route(self.raw(), timeout_ms(timeout)) })
    }

    /// Sends a connection request (`rdma_connect()`), after route resolution; the outcome is an
    /// [`ESTABLISHED`](crate::cm::CmEventKind::ESTABLISHED) event (the id's queue pair is then in
    /// RTS: record it with [`QueuePair::cm_established`](crate::QueuePair::cm_established)), [`REJECTED`](crate::cm::CmEventKind::REJECTED), `UNREACHABLE` or `CONNECT_ERROR`.
    ///
    /// On iWARP the TCP connection is made inside `rdma_connect()`: a port nobody listens on
    /// fails there, not with a `REJECTED` event. On siw the call blocks until TCP connects or
    /// gives up (about 131 s for an address that does not answer, Linux 6.1), holding the event
    /// channel's lock (librdmacm reads the id's queue pair, which event processing and a queue
    /// pair's drop change under that lock): meanwhile every other call on the channel waits, its
    /// own timeout not covering that wait — [`EventChannel::get_event`](crate::cm::EventChannel::get_event),
    /// and the calls and drops of its other ids and their queue pairs. On siw, connect an id on a
    /// channel of its own ([`cm::connect`](crate::cm::connect) does, on a thread of its own).
    ///
    /// # Errors
    /// [`Error::PrivateDataTooLong`] before anything is sent; [`Error::InvalidArgument`] for
    /// retry counts above 7 or an unresolved id; [`Error::Rejected`] (status `-ECONNREFUSED`, as
    /// iWARP's `REJECTED` events carry, no private data) when `rdma_connect()` itself fails with
    /// `ECONNREFUSED` (iWARP: nobody listens on the port); [`Error::Verb`] for any other failure
    /// of `rdma_connect()` (on iWARP e.g. `ETIMEDOUT` when the peer's address does not answer).
    #[doc(alias = "rdma_connect")]
    pub fn connect(&self, param: &ConnParam) -> Result<()> {
        let max = self.max_private_data("rdma_connect", Message::Connect)?;
        let mut raw = param.raw("rdma_connect", max)?;
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; `raw` points at `param`'s private data, which outlives the call
        // (librdmacm copies it).
        match cvt("rdma_connect", unsafe { ffi::rdma_connect(self.raw(), &mut raw) }) {
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => Err(Error::Rejected {
                verb: "rdma_connect",
                status: -libc::ECONNREFUSED,
                private_data: Vec::new(),
            }),
            r => r,
        }
    }

    /// Accepts a connection request (`rdma_accept()`) on its new id, which moves the id's queue
    /// pair to RTS; the connection is usable after the
    /// [`ESTABLISHED`](crate::cm::CmEventKind::ESTABLISHED) event.
    ///
    /// On InfiniBand and RoCE, with a queue pair created on the id
    /// ([`build_on`](crate::QueuePairBuilder::build_on)), the retry counts of `param` bound the
    /// accepted queue pair's own: the connection manager would give it the peer's request as it
    /// is, and a peer asking for 7 (as rdma-core's tools do, and as a hostile peer may) would make
    /// it retry for ever on rxe once that peer goes silent. The queue pair gets the smaller of
    /// the peer's count and `param`'s, for transport and receiver-not-ready retries alike. The
    /// crate then makes librdmacm's INIT, RTR and RTS transitions itself
    /// (`rdma_init_qp_attr()`, `ibv_modify_qp()`, with `param`'s responder resources and
    /// initiator depth as librdmacm sets them) and calls `rdma_accept()` naming the queue pair by
    /// number, so that librdmacm does not move it again. iWARP has no such counts (TCP
    /// retransmits): there, and for an id without a queue pair (or with one not RC, which this
    /// crate does not create on ids), `rdma_accept()` does it all.
    ///
    /// # Errors
    /// [`Error::PrivateDataTooLong`] before anything is sent; [`Error::InvalidArgument`] for
    /// retry counts above 7; [`Error::Verb`] from `rdma_accept()`, or from
    /// `ibv_query_device()`, `ibv_query_port()`, `rdma_init_qp_attr()` or `ibv_modify_qp()`
    /// of the transitions above (nothing was sent to the peer then: reject the request or drop
    /// the id).
    #[doc(alias = "rdma_accept")]
    #[doc(alias = "rdma_init_qp_attr")]
    pub fn accept(&self, param: &ConnParam) -> Result<()> {
        let max = self.max_private_data("rdma_accept", Message::Accept)?;
        let mut raw = param.raw("rdma_accept", max)?;
        let _g = self.inner.channel.lock();
        // SAFETY: valid id, whose fields are written only under the lock we hold.
        let (qp, verbs) = unsafe { ((*self.raw()).qp, (*self.raw()).verbs) };
        // A bound id's context (max_private_data found it) lives as long as the id.
        let iwarp = NonNull::new(verbs).is_some_and(|v| transport(v) == TransportType::IWARP);
        // SAFETY: `id->qp`, when set, is the id's live queue pair (see below).
        if qp.is_null() || iwarp || unsafe { (*qp).qp_type } != ffi::ibv_qp_type::IBV_QPT_RC {
            // SAFETY: valid id; `raw` points at `param`'s private data (copied by the call).
            return cvt("rdma_accept", unsafe { ffi::rdma_accept(self.raw(), &mut raw) });
        }
        // SAFETY: a live id (ours) and its live queue pair `id->qp` (a queue pair created on an id
        // keeps the id alive and clears `id->qp` before it is destroyed, under this lock, which we
        // hold); an InfiniBand-transport device; `raw` is `param`'s, checked.
        unsafe { accept_capped(self.raw(), qp, &mut raw) }
    }

    /// Rejects a connection request (`rdma_reject()`) with `private_data` for the peer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id not bound to a device yet;
    /// [`Error::PrivateDataTooLong`] before anything is sent; [`Error::Verb`] from
    /// `rdma_reject()`.
    #[doc(alias = "rdma_reject")]
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let max = self.max_private_data("rdma_reject", Message::Reject)?;
        if private_data.len() > max {
            return Err(Error::PrivateDataTooLong { verb: "rdma_reject", len: private_data.len(), max });
        }
        let ptr = if private_data.is_empty() { std::ptr::null() } else { private_data.as_ptr().cast() };
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; the data (at most 255 bytes, checked) is copied by the call.
        cvt("rdma_reject", unsafe { ffi::rdma_reject(self.raw(), ptr, private_data.len() as u8) })
    }

    /// Moves the id to `channel` (`rdma_migrate_id()`): its later events, and those not read
    /// yet, arrive there. Every event this crate read was acknowledged at once, so the call does
    /// not wait.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] while a queue pair created on the id (which keeps a handle to
    /// it) exists: migrate before [`build_on`](crate::QueuePairBuilder::build_on);
    /// [`Error::Verb`] from `rdma_migrate_id()`.
    #[doc(alias = "rdma_migrate_id")]
    pub fn migrate(&mut self, channel: &EventChannel) -> Result<()> {
        let inner = Arc::get_mut(&mut self.inner).ok_or(Error::InvalidArgument {
            verb: "rdma_migrate_id",
            reason: "a queue pair created on the id still uses it: migrate before build_on",
        })?;
        if Arc::ptr_eq(&inner.channel, &channel.inner) {
            return Ok(());
        }
        {
            // Both channels' locks (librdmacm touches the id's fields while processing events of
            // either), taken in address order so that two migrations in opposite directions
            // cannot deadlock.
            let (a, b) = (&inner.channel, &channel.inner);
            let (first, second) = if Arc::as_ptr(a) < Arc::as_ptr(b) { (a, b) } else { (b, a) };
            let _g1 = first.lock();
            let _g2 = second.lock();
            // SAFETY: a live id we hold exclusively (no QP, no other handle) and a live channel;
            // every event of the id was acknowledged when it was read, so the call does not wait.
            let ret = unsafe { ffi::rdma_migrate_id(inner.raw.as_ptr(), channel.inner.raw()) };
            cvt("rdma_migrate_id", ret)?;
            inner.channel.ids.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            channel.inner.ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // The id now reports to `channel`, which it keeps alive (the old one may go).
        inner.channel = channel.inner.clone();
        Ok(())
    }

    /// Disconnects (`rdma_disconnect()`): the id's queue pair goes to the error state (its
    /// outstanding requests are flushed) and both sides get a
    /// [`DISCONNECTED`](crate::cm::CmEventKind::DISCONNECTED) event.
    ///
    /// # Errors
    /// [`Error::Verb`] from `rdma_disconnect()` (e.g. `EINVAL` when not connected).
    #[doc(alias = "rdma_disconnect")]
    pub fn disconnect(&self) -> Result<()> {
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; `id->qp` is NULL or a live QP (cleared under this lock when the QP
        // is destroyed).
        cvt("rdma_disconnect", unsafe { ffi::rdma_disconnect(self.raw()) })
    }

    /// The local address (`rdma_get_local_addr()`), once bound or resolved.
    #[doc(alias = "rdma_get_local_addr")]
    pub fn local_addr(&self) -> Option<SocketAddr> {
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; the address lives in the id (a sockaddr_storage-sized union) and is
        // written only under the lock we hold.
        unsafe { read_sockaddr(ffi::rdma_get_local_addr(self.raw())) }
    }

    /// The peer's address (`rdma_get_peer_addr()`), once resolved or connected.
    #[doc(alias = "rdma_get_peer_addr")]
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        let _g = self.inner.channel.lock();
        // SAFETY: as in local_addr.
        unsafe { read_sockaddr(ffi::rdma_get_peer_addr(self.raw())) }
    }

    /// [`Error::InvalidArgument`] naming `verb` when other ids report to this id's channel: the
    /// blocking helpers read every event on it ([`next_event`](Self::next_event)), and would
    /// take theirs.
    pub(crate) fn check_private_channel(&self, verb: &'static str) -> Result<()> {
        if self.inner.channel.ids.load(std::sync::atomic::Ordering::Relaxed) > 1 {
            return Err(Error::InvalidArgument {
                verb,
                reason: "the id shares its event channel with other ids, whose events this helper would take: wait with EventChannel::get_event",
            });
        }
        Ok(())
    }
}

impl EventChannel {
    /// Creates an id for RC connections (port space `RDMA_PS_TCP`) on this channel
    /// (`rdma_create_id()`).
    ///
    /// # Errors
    /// [`Error::Verb`] when the call fails.
    #[doc(alias = "rdma_create_id")]
    pub fn create_id(&self) -> Result<CmId> {
        self.create_id_in(ffi::rdma_port_space::RDMA_PS_TCP)
    }

    /// `rdma_create_id()` in the port space `ps` (TCP or UDP: what [`CmId`] supports).
    pub(crate) fn create_id_in(&self, ps: ffi::rdma_port_space) -> Result<CmId> {
        let _g = self.inner.lock();
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid channel and out-pointer; the id is destroyed once in CmIdInner::drop.
        let ret = unsafe { ffi::rdma_create_id(self.inner.raw(), &mut raw, std::ptr::null_mut(), ps) };
        cvt("rdma_create_id", ret)?;
        let raw = cvt_p("rdma_create_id", raw)?;
        self.inner.ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the new id of this channel, ours alone.
        Ok(CmId { inner: Arc::new(unsafe { CmIdInner::adopt(raw, self.inner.clone()) }) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_params_are_checked_before_librdmacm_sees_them() {
        let p = ConnParam { private_data: vec![1; 57], ..ConnParam::default() };
        assert!(matches!(
            p.raw("rdma_connect", 56),
            Err(Error::PrivateDataTooLong { verb: "rdma_connect", len: 57, max: 56 })
        ));
        let p = ConnParam { private_data: vec![1; 56], ..ConnParam::default() };
        let raw = p.raw("rdma_connect", 56).unwrap();
        assert_eq!(raw.private_data_len, 56);
        assert_eq!(raw.private_data, p.private_data.as_ptr().cast());
        assert_eq!((raw.retry_count, raw.rnr_retry_count), (6, 6), "finite: 7 is forever on rxe");
        let raw = ConnParam::default().raw("rdma_accept", 196).unwrap();
        assert!(raw.private_data.is_null() && raw.private_data_len == 0);
        let p = ConnParam { rnr_retry_count: 8, ..ConnParam::default() };
        assert!(matches!(p.raw("rdma_connect", 56), Err(Error::InvalidArgument { .. })));
        // The largest length a u8 carries (iWARP's limit here).
        let p = ConnParam { private_data: vec![0; 255], ..ConnParam::default() };
        assert_eq!(p.raw("rdma_connect", 255).unwrap().private_data_len, 255);
    }

    #[test]
    fn errors_name_reject_reasons_and_errnos() {
        let e = Error::Rejected { verb: "rdma_connect", status: 8, private_data: vec![] };
        assert!(e.to_string().contains("nothing listens"), "{e}");
        let e = Error::CmEvent {
            verb: "rdma_resolve_addr",
            event: crate::cm::CmEventKind::ADDR_ERROR,
            status: -libc::ETIMEDOUT,
        };
        assert!(e.to_string().contains("ADDR_ERROR") && e.to_string().contains("timed out"), "{e}");
    }
}
