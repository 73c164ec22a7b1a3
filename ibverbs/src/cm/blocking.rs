//! Blocking helpers: a whole RDMA-CM connection setup with bounded waits.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::attr::CmEventKind;
use crate::cm::channel::EventChannel;
use crate::cm::event::CmEvent;
use crate::cm::id::{CmId, ConnParam};
use crate::cm::sys::deadline_in;
use crate::device::Context;
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;
use crate::queue::{CompletionQueue, QpCaps, QpType, QueuePair};

/// The error for an event that is not the `expected` one.
fn unexpected(verb: &'static str, ev: &CmEvent) -> Error {
    if ev.kind() == CmEventKind::REJECTED {
        Error::Rejected { verb, status: ev.status(), private_data: ev.private_data().to_vec() }
    } else {
        Error::CmEvent { verb, event: ev.kind(), status: ev.status() }
    }
}

/// Waits for the `expected` event on the id's private channel until `deadline`.
fn expect(
    id: &CmId,
    verb: &'static str,
    expected: CmEventKind,
    deadline: Instant,
    total: Duration,
) -> Result<CmEvent> {
    let left = deadline.saturating_duration_since(Instant::now());
    let ev = id.next_event(verb, left).map_err(|e| match e {
        Error::Timeout { verb, .. } => Error::Timeout { verb, waited: total },
        e => e,
    })?;
    if ev.kind() == expected && ev.status() == 0 {
        Ok(ev)
    } else {
        Err(unexpected(verb, &ev))
    }
}

/// The RDMA-CM [`Context`] of the device that `addr` resolves to (`rdma_resolve_addr()` on a
/// temporary id, bounded by `timeout`): for a local address the device that owns it, for a
/// remote one the device that routes to it. Make the protection domain and CQs of
/// [`connect`] or [`Listener::accept`] from it.
///
/// # Errors
/// [`Error::Timeout`], [`Error::CmEvent`] (`ADDR_ERROR`) or [`Error::Verb`] when the address does
/// not resolve.
#[doc(alias = "rdma_resolve_addr")]
pub fn device_context(addr: SocketAddr, timeout: Duration) -> Result<Context> {
    let deadline = deadline_in(timeout);
    let id = EventChannel::new()?.create_id()?;
    id.resolve_addr(None, addr, timeout)?;
    expect(&id, "rdma_resolve_addr", CmEventKind::ADDR_RESOLVED, deadline, timeout)?;
    id.context()
}

/// Resolves the address and the route to the listener at `addr` (`rdma_resolve_addr()` and
/// `rdma_resolve_route()` on a new id with a channel of its own), both waits together bounded by
/// `timeout`: the first half of [`connect`], for callers that create the queue pair themselves
/// (e.g. to post receives before the connection exists) and then call [`establish`].
/// [`CmId::context`] is the device's context for the protection domain and CQs.
///
/// # Errors
/// [`Error::Timeout`] when a step does not finish in time (e.g. an address nobody answers for);
/// [`Error::CmEvent`] for an address or route error event; [`Error::Verb`] when a request cannot
/// be started.
#[doc(alias = "rdma_resolve_route")]
pub fn resolve(addr: SocketAddr, timeout: Duration) -> Result<CmId> {
    let deadline = deadline_in(timeout);
    let id = EventChannel::new()?.create_id()?;
    id.resolve_addr(None, addr, timeout)?;
    expect(&id, "rdma_resolve_addr", CmEventKind::ADDR_RESOLVED, deadline, timeout)?;
    id.resolve_route(deadline.saturating_duration_since(Instant::now()))?;
    expect(&id, "rdma_resolve_route", CmEventKind::ROUTE_RESOLVED, deadline, timeout)?;
    Ok(id)
}

/// Sends the connection request of `id` (resolved by [`resolve`]) with `param` and waits, bounded
/// by `timeout`, until the connection is established; `qp` (created on `id` with
/// [`QueuePairBuilder::build_on`](crate::QueuePairBuilder::build_on)) is then in RTS. The second
/// half of [`connect`]. On siw the bound does not cover `rdma_connect()` itself, which blocks
/// until TCP connects or gives up (see [`connect`], which keeps its bound there).
///
/// # Errors
/// As [`connect`]'s, after resolution; [`Error::InvalidArgument`] when `id` shares its event
/// channel with other ids (whose events this function would take: wait for the events with
/// [`EventChannel::get_event`] instead), or `qp` is not `id`'s.
#[doc(alias = "rdma_connect")]
pub fn establish(id: &CmId, qp: &mut QueuePair, param: &ConnParam, timeout: Duration) -> Result<()> {
    let deadline = deadline_in(timeout);
    id.check_private_channel("rdma_connect")?;
    check_own_qp(id, qp)?;
    id.connect(param)?;
    expect(id, "rdma_connect", CmEventKind::ESTABLISHED, deadline, timeout)?;
    qp.cm_established().map(|_| ())
}

/// `qp` must be the queue pair created on `id`.
fn check_own_qp(id: &CmId, qp: &QueuePair) -> Result<()> {
    if id.owns_qp(qp.as_raw()) {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            verb: "rdma_connect",
            reason: "the queue pair was not created on this id (QueuePairBuilder::build_on)",
        })
    }
}

/// Connects an RC queue pair to the listener at `addr`: resolves the address and route, creates
/// the queue pair on the id (with `pd`, `cq` for both queues, and `caps`), sends the request with
/// `param`, and waits for the connection to be established; every wait together is bounded by
/// `timeout`. The queue pair is in RTS. ([`resolve`] and [`establish`] are its two halves, for
/// callers that build the queue pair themselves.)
///
/// On siw (soft-iWARP) `rdma_connect()` makes the TCP connection before it returns, so to an
/// address that does not answer it blocks until TCP gives up (about 131 s on Linux 6.1). There
/// this function connects on a thread of its own that owns the id and the queue pair, and
/// returns [`Error::Timeout`] at the bound while that thread waits out the kernel and then drops
/// them (holding `pd` and `cq` until then). [`establish`] has no such thread: on siw its bound
/// does not cover `rdma_connect()` itself.
///
/// An `EADDRINUSE` from `rdma_connect()` is answered with a new id, up to 16 ids in all within
/// `timeout`: on iWARP, rdma_cm picks the local port without seeing TCP's sockets, and siw
/// binds it in the TCP stack, where a native socket may hold it (hosts that run `iwpmd`, the
/// iWARP port mapper, avoid this for providers that use its mapped ports; siw does not).
///
/// `pd` and `cq` must come from the RDMA-CM context of the device that reaches `addr` (see
/// [`device_context`]).
///
/// # Errors
/// [`Error::Timeout`] when a step does not finish in time (e.g. an address nobody answers for);
/// [`Error::Rejected`] when the peer (or its CM, for a port nobody listens on) rejects;
/// [`Error::CmEvent`] for an address, route or connection error event;
/// [`Error::PrivateDataTooLong`] before anything is sent; [`Error::InvalidArgument`] when `pd`
/// or `cq` belong to another context than the id's device; and the errors of
/// [`QueuePairBuilder::build`](crate::QueuePairBuilder::build).
#[doc(alias = "rdma_connect")]
pub fn connect(
    addr: SocketAddr,
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    caps: QpCaps,
    param: &ConnParam,
    timeout: Duration,
) -> Result<(CmId, QueuePair)> {
    connect_with(addr, param, timeout, |id| pd.create_qp(cq, QpType::RC).caps(caps).build_on(id))
}

/// [`connect`] with a queue pair the caller builds: `build` gets the resolved id and builds
/// the queue pair on it ([`QueuePairBuilder::build_on`](crate::QueuePairBuilder::build_on),
/// e.g. with a receive CQ of its own or an SRQ, from the id's
/// [`context`](CmId::context)). Everything else is as [`connect`]: one bound for every wait,
/// siw's `rdma_connect()` on a thread of its own, and another id after an `EADDRINUSE`, for
/// which `build` is called again.
///
/// # Errors
/// As [`connect`], with `build`'s errors for those of the queue pair's creation.
#[doc(alias = "rdma_connect")]
pub fn connect_with(
    addr: SocketAddr,
    param: &ConnParam,
    timeout: Duration,
    mut build: impl FnMut(&CmId) -> Result<QueuePair>,
) -> Result<(CmId, QueuePair)> {
    let deadline = deadline_in(timeout);
    let mut tries = 1;
    loop {
        let id = resolve(addr, deadline.saturating_duration_since(Instant::now()))?;
        let mut qp = build(&id)?;
        let r = if qp.context().is_siw() {
            establish_apart(id, qp, param, deadline, timeout)
        } else {
            establish(&id, &mut qp, param, deadline.saturating_duration_since(Instant::now()))
                .map(|()| (id, qp))
        };
        match r {
            // The id and queue pair were dropped with the error; a new id gets another port.
            Err(e) if port_taken(&e) && tries < PORTS_TRIED => tries += 1,
            r => return r,
        }
    }
}

/// How many ports [`connect_with`] and [`Listener::bind`] (with port 0) try when rdma_cm's pick is
/// taken in the TCP stack.
const PORTS_TRIED: usize = 16;

/// Whether `e` is `rdma_connect()` or `rdma_listen()` failing with `EADDRINUSE`: on iWARP,
/// rdma_cm picks ports from the ephemeral range TCP uses without seeing TCP's sockets, and the
/// provider (siw) binds the port in the TCP stack, where a native socket may hold it (even one
/// in `TIME_WAIT`). Another id, with another port, may succeed.
fn port_taken(e: &Error) -> bool {
    matches!(e, Error::Verb { verb: "rdma_connect" | "rdma_listen", source }
        if source.raw_os_error() == Some(libc::EADDRINUSE))
}

/// [`establish`] on a thread that owns `id` and `qp`, waited for until `deadline`: siw's
/// `rdma_connect()` blocks in the kernel's TCP connect (see [`connect`]). At the deadline the
/// caller gets [`Error::Timeout`]; the thread's result, when it comes, finds no receiver and is
/// dropped there (the queue pair, then the id).
fn establish_apart(
    id: CmId,
    mut qp: QueuePair,
    param: &ConnParam,
    deadline: Instant,
    timeout: Duration,
) -> Result<(CmId, QueuePair)> {
    const VERB: &str = "rdma_connect";
    // Room for the result, so the thread never waits for a receiver that is gone.
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let param = param.clone();
    std::thread::Builder::new()
        .name("rdma_connect".into())
        .spawn(move || {
            let r = establish(&id, &mut qp, &param, deadline.saturating_duration_since(Instant::now()));
            // Err: the caller stopped waiting; the id and the queue pair are dropped here.
            let _ = tx.send(r.map(|()| (id, qp)));
        })
        .map_err(|source| Error::Verb { verb: "pthread_create", source })?;
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            Err(Error::Timeout { verb: VERB, waited: timeout })
        }
        // The thread ended without a result: establish panicked.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            Err(Error::Verb { verb: VERB, source: std::io::Error::other("the connecting thread panicked") })
        }
    }
}

/// A listening RDMA-CM id (`rdma_bind_addr()` + `rdma_listen()`) that accepts RC connections.
#[derive(Debug)]
pub struct Listener {
    id: CmId,
}

impl Listener {
    /// Binds to `addr` (port 0 picks one, see [`local_addr`](Self::local_addr)) and listens,
    /// with a backlog of 64 connection requests.
    ///
    /// With port 0, a port that turns out to be taken at `rdma_listen()` (`EADDRINUSE`) is
    /// given up for another, up to 16 ports in all. On iWARP, rdma_cm picks its ports from the
    /// ephemeral range TCP uses without seeing TCP's sockets; siw's listen binds the port in the
    /// TCP stack, and a native socket holding it (even one in `TIME_WAIT`) makes it fail. The
    /// active side meets the same in `rdma_connect()` (see [`connect`]).
    ///
    /// # Errors
    /// [`Error::Verb`] from `rdma_create_event_channel()`, `rdma_create_id()`,
    /// `rdma_bind_addr()` (e.g. `EADDRINUSE`) or `rdma_listen()` (with port 0, `EADDRINUSE` only
    /// when 16 ports in a row were taken).
    #[doc(alias = "rdma_listen")]
    pub fn bind(addr: SocketAddr) -> Result<Listener> {
        let mut tries = 1;
        loop {
            let id = EventChannel::new()?.create_id()?;
            id.bind(addr)?;
            match id.listen(64) {
                Ok(()) => return Ok(Listener { id }),
                // Dropping the id gives its port back to rdma_cm, whose next pick is random.
                Err(e) if addr.port() == 0 && port_taken(&e) && tries < PORTS_TRIED => tries += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// The address listened on, with the port chosen (`rdma_get_local_addr()`).
    #[doc(alias = "rdma_get_local_addr")]
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// The listening id, e.g. to get connection requests as events from its
    /// [`channel`](CmId::channel) instead of through [`accept`](Self::accept).
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// Waits for a connection request, creates an RC queue pair for it (with `pd`, `cq` for
    /// both queues, and `caps`), accepts it with `param` and waits until the connection is
    /// established; every wait together is bounded by `timeout`. Returns the connection's id (owned
    /// by the caller; the listener may go first), its queue pair in RTS, and the private data
    /// the peer sent.
    ///
    /// A request that cannot be served (a queue pair that cannot be created, e.g. `pd` of
    /// another device) is rejected and the error returned. ([`request`](Self::request) and
    /// [`accept_request`] are its two halves, for callers that build the queue pair themselves.)
    ///
    /// # Errors
    /// [`Error::Timeout`] when no request arrives or the connection does not complete in time;
    /// [`Error::CmEvent`] for an error event; the errors of [`CmId::accept`] and
    /// [`QueuePairBuilder::build`](crate::QueuePairBuilder::build).
    #[doc(alias = "rdma_accept")]
    pub fn accept(
        &self,
        pd: &ProtectionDomain,
        cq: &CompletionQueue,
        caps: QpCaps,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(CmId, QueuePair, Vec<u8>)> {
        let deadline = deadline_in(timeout);
        let (id, private_data) = self.request(timeout)?;
        let mut qp = match pd.create_qp(cq, QpType::RC).caps(caps).build_on(&id) {
            Ok(qp) => qp,
            Err(e) => {
                let _ = id.reject(&[]);
                return Err(e);
            }
        };
        accept_request(&id, &mut qp, param, deadline.saturating_duration_since(Instant::now()))?;
        Ok((id, qp, private_data))
    }

    /// Waits, bounded by `timeout`, for a connection request: the first half of
    /// [`accept`](Self::accept). Returns the request's new id (owned by the caller: dropping it
    /// without [`accept_request`] lets the peer's connect fail) and the private data the peer
    /// sent. [`CmId::context`] of the new id is the device's context for its protection domain
    /// and CQs.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no request arrives in time; [`Error::CmEvent`] for another event;
    /// [`Error::InvalidArgument`] when the listener shares its event channel with other ids
    /// (it would take their events), or for a request event without a new id;
    /// [`Error::Verb`] when `poll(2)`, `rdma_get_cm_event()` or,
    /// for the request's new id, `rdma_create_event_channel()`/`rdma_migrate_id()` fails.
    #[doc(alias = "rdma_get_cm_event")]
    pub fn request(&self, timeout: Duration) -> Result<(CmId, Vec<u8>)> {
        // It reads every event of the listener's channel: other ids' events would be lost.
        self.id.check_private_channel("rdma_get_cm_event")?;
        let deadline = deadline_in(timeout);
        let mut ev = expect(&self.id, "rdma_listen", CmEventKind::CONNECT_REQUEST, deadline, timeout)?;
        let id = ev.take_new_id().ok_or(Error::InvalidArgument {
            verb: "rdma_get_cm_event",
            reason: "a connection request without a new id",
        })?;
        Ok((id, ev.private_data().to_vec()))
    }
}

/// Accepts the connection request of `id` (from [`Listener::request`]) with `param` and waits,
/// bounded by `timeout`, until the connection is established; `qp` (created on `id` with
/// [`QueuePairBuilder::build_on`](crate::QueuePairBuilder::build_on)) is then in RTS. The second
/// half of [`Listener::accept`].
///
/// # Errors
/// [`Error::Timeout`] when the connection does not complete in time; [`Error::CmEvent`] for an
/// error event; [`Error::InvalidArgument`] when `id` shares its event channel with other ids
/// (as for [`establish`]) or `qp` is not `id`'s; the errors of [`CmId::accept`].
#[doc(alias = "rdma_accept")]
pub fn accept_request(id: &CmId, qp: &mut QueuePair, param: &ConnParam, timeout: Duration) -> Result<()> {
    let deadline = deadline_in(timeout);
    id.check_private_channel("rdma_accept")?;
    check_own_qp(id, qp)?;
    id.accept(param)?;
    expect(id, "rdma_accept", CmEventKind::ESTABLISHED, deadline, timeout)?;
    qp.cm_established().map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verb(verb: &'static str, errno: i32) -> Error {
        Error::Verb { verb, source: std::io::Error::from_raw_os_error(errno) }
    }

    #[test]
    fn only_a_taken_port_at_listen_or_connect_is_tried_again() {
        assert!(port_taken(&verb("rdma_connect", libc::EADDRINUSE)));
        assert!(port_taken(&verb("rdma_listen", libc::EADDRINUSE)));
        // A port the caller named (rdma_bind_addr), or another failure, is the caller's answer.
        assert!(!port_taken(&verb("rdma_bind_addr", libc::EADDRINUSE)));
        assert!(!port_taken(&verb("rdma_connect", libc::ECONNREFUSED)));
        assert!(!port_taken(&Error::Timeout { verb: "rdma_connect", waited: Duration::from_secs(1) }));
    }
}
