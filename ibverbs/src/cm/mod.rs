//! Connection management with **librdmacm** (RDMA-CM): IP addressing, route resolution and the
//! connection handshake of RC queue pairs, as `rping`, `ib_write_bw -R` and most RDMA
//! applications do it.
//!
//! | type | C object | created by | destroyed by |
//! |---|---|---|---|
//! | [`EventChannel`] | `rdma_event_channel` | [`EventChannel::new`] | `rdma_destroy_event_channel` |
//! | [`CmId`] | `rdma_cm_id` | [`EventChannel::create_id`], a [`CmEventKind::CONNECT_REQUEST`] | `rdma_destroy_id` |
//! | [`QueuePair`](crate::QueuePair) on an id | `ibv_qp` (`id->qp`) | [`QueuePairBuilder::build_on`](crate::QueuePairBuilder::build_on) | `ibv_destroy_qp`, then `id->qp = NULL` (what `rdma_destroy_qp` does) |
//!
//! The blocking helpers [`connect`] and [`Listener`] do the whole exchange with bounded waits;
//! their halves ([`resolve`] + [`establish`], [`Listener::request`] + [`accept_request`]) let the
//! caller build the queue pair on the id in between (e.g. to post receives before the connection
//! exists); the event-level API ([`CmId`] + [`EventChannel::get_event`]) does it step by step.
//!
//! # Contexts
//! librdmacm opens the devices itself: an id's device context (`id->verbs`, known once its
//! address is resolved or bound) is *not* a context opened with [`Context::open`], and
//! `rdma_create_qp` refuses a protection domain of another context. [`CmId::context`],
//! [`device_context`] and [`devices`] hand out librdmacm's contexts as [`Context`]s (one
//! `Context` per device, shared by every call, so the crate's same-context checks hold); the
//! protection domain, completion queues and memory regions of a CM queue pair must be made from
//! one of them.
//!
//! # Lifetimes (whatever the caller does)
//! - A queue pair created on an id holds an `Arc` of the id: the QP is destroyed first, then
//!   the id (`rdma_destroy_id`), because librdmacm keeps `id->qp` and uses it (e.g. in
//!   `rdma_disconnect`); the QP's drop clears `id->qp` once the QP is destroyed.
//! - An id holds an `Arc` of its event channel: the channel is destroyed after all its ids.
//! - A `Context` from librdmacm holds an `rdma_get_devices()` reference, which keeps librdmacm
//!   from closing the device while any object of it lives.
//! - [`EventChannel::get_event`] copies what an event carries (private data included) and
//!   acknowledges it (`rdma_ack_cm_event`) before returning, so `rdma_destroy_id` (which waits
//!   for the acknowledgement of every event of its id) never blocks, even if the caller leaks or
//!   `mem::forget`s events and ids.
//! - librdmacm reads and writes an id's fields (`qp`, `route`, ...) when it processes that id's
//!   events; every call on an id, every event processed on a channel and the destruction of a
//!   CM queue pair take the id's channel lock, so no two of them race.
//! - A connection request's new id gets an event channel of its own (`rdma_migrate_id`), so
//!   its events never mix with the listener's, and a listener can go before its accepted ids.

mod blocking;
mod event;
mod id;
mod qp;

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

pub use crate::attr::CmEventKind;
pub use blocking::{accept_request, connect, connect_with, device_context, establish, resolve, Listener};
pub use event::{CmEvent, EventChannel};
pub use id::{CmId, ConnParam};

use ibverbs_sys as ffi;

use crate::device::{Context, ContextInner};
use crate::error::{Error, Result};

/// A reference on librdmacm's device list (`rdma_get_devices()`), released with
/// `rdma_free_devices()`: while it lives, librdmacm does not close any device of the list.
struct DeviceAnchor {
    list: NonNull<*mut ffi::ibv_context>,
}

// SAFETY: the list is an array of pointers written once by librdmacm, only read and freed
// (under librdmacm's own lock).
unsafe impl Send for DeviceAnchor {}
// SAFETY: as above.
unsafe impl Sync for DeviceAnchor {}

impl DeviceAnchor {
    fn new() -> Result<DeviceAnchor> {
        let mut n = 0;
        // SAFETY: valid out-pointer; the list is freed once in Drop.
        let list = unsafe { ffi::rdma_get_devices(&mut n) };
        let list = NonNull::new(list).ok_or_else(|| Error::last_os("rdma_get_devices"))?;
        Ok(DeviceAnchor { list })
    }

    fn contexts(&self) -> Vec<NonNull<ffi::ibv_context>> {
        let mut out = Vec::new();
        for i in 0.. {
            // SAFETY: a NULL-terminated array of contexts.
            let p = unsafe { *self.list.as_ptr().add(i) };
            match NonNull::new(p) {
                Some(p) => out.push(p),
                None => break,
            }
        }
        out
    }
}

impl Drop for DeviceAnchor {
    fn drop(&mut self) {
        // SAFETY: the list came from rdma_get_devices and is freed once.
        unsafe { ffi::rdma_free_devices(self.list.as_ptr()) };
    }
}

/// The [`Context`]s librdmacm opened, by `ibv_context` address; each lives while anything of it
/// does (a `Weak` here does not keep it).
static CM_CONTEXTS: Mutex<Vec<(usize, Weak<ContextInner>)>> = Mutex::new(Vec::new());

/// librdmacm's context `raw` as a [`Context`]: the one already handed out, or a new one anchored
/// by a fresh `rdma_get_devices()` reference. `raw` must be valid now (an id bound to it lives).
fn cm_context(raw: NonNull<ffi::ibv_context>) -> Result<Context> {
    let mut cache = CM_CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    cache.retain(|(_, w)| w.strong_count() > 0);
    if let Some(inner) =
        cache.iter().find(|(p, _)| *p == raw.as_ptr() as usize).and_then(|(_, w)| w.upgrade())
    {
        return Ok(Context { inner });
    }
    let anchor = DeviceAnchor::new()?;
    if !anchor.contexts().contains(&raw) {
        return Err(Error::InvalidArgument {
            verb: "rdma_get_devices",
            reason: "the id's device is not in librdmacm's device list (removed?)",
        });
    }
    // SAFETY: a valid context (in the list we hold); its device's name is a C string.
    let name = unsafe { std::ffi::CStr::from_ptr(ffi::ibv_get_device_name((*raw.as_ptr()).device)) }
        .to_string_lossy()
        .into_owned();
    let inner = Arc::new(ContextInner::adopted(raw, name, Box::new(anchor)));
    cache.push((raw.as_ptr() as usize, Arc::downgrade(&inner)));
    Ok(Context { inner })
}

/// Every device librdmacm knows, as [`Context`]s usable with RDMA-CM ids
/// (`rdma_get_devices()`).
///
/// # Errors
/// [`Error::Verb`] from `rdma_get_devices()`.
#[doc(alias = "rdma_get_devices")]
pub fn devices() -> Result<Vec<Context>> {
    let anchor = DeviceAnchor::new()?;
    anchor.contexts().into_iter().map(cm_context).collect()
}

/// A socket address in the C layout librdmacm takes (`struct sockaddr_in`/`sockaddr_in6`).
#[repr(C)]
pub(crate) union SockAddr {
    v4: libc::sockaddr_in,
    v6: libc::sockaddr_in6,
    storage: libc::sockaddr_storage,
}

impl SockAddr {
    pub(crate) fn new(addr: SocketAddr) -> SockAddr {
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut s: SockAddr = unsafe { std::mem::zeroed() };
        match addr {
            SocketAddr::V4(a) => {
                s.v4 = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                    sin_zero: [0; 8],
                }
            }
            SocketAddr::V6(a) => {
                s.v6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo().to_be(),
                    sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                    sin6_scope_id: a.scope_id(),
                }
            }
        }
        s
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut ffi::sockaddr {
        (self as *mut SockAddr).cast()
    }
}

/// Reads an IPv4 or IPv6 address from a `struct sockaddr *`; `None` for NULL or another family.
///
/// # Safety
/// `p` is NULL or points to a readable `sockaddr_storage`-sized socket address.
pub(crate) unsafe fn read_sockaddr(p: *const ffi::sockaddr) -> Option<SocketAddr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's contract: a readable sockaddr_storage.
    let s = unsafe { std::ptr::read_unaligned(p.cast::<libc::sockaddr_storage>()) };
    match i32::from(s.ss_family) {
        libc::AF_INET => {
            // SAFETY: sockaddr_in is smaller than sockaddr_storage and any bytes are valid.
            let a = unsafe { std::ptr::read_unaligned(p.cast::<libc::sockaddr_in>()) };
            let ip = Ipv4Addr::from(a.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(a.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: as above.
            let a = unsafe { std::ptr::read_unaligned(p.cast::<libc::sockaddr_in6>()) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(a.sin6_port),
                u32::from_be(a.sin6_flowinfo),
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// The instant `timeout` from now, for any `timeout` (a huge one, e.g. `Duration::MAX`, waits
/// about 136 years instead of overflowing `Instant`).
pub(crate) fn deadline_in(timeout: std::time::Duration) -> std::time::Instant {
    const LONGEST: std::time::Duration = std::time::Duration::from_secs(1 << 32);
    std::time::Instant::now() + timeout.min(LONGEST)
}

/// A timeout in milliseconds for librdmacm (`int`), at least 1 ms.
pub(crate) fn timeout_ms(t: std::time::Duration) -> i32 {
    i32::try_from(t.as_millis()).unwrap_or(i32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_timeout_makes_a_deadline() {
        let now = std::time::Instant::now();
        assert!(deadline_in(std::time::Duration::MAX) > now + std::time::Duration::from_secs(1 << 31));
        let soon = deadline_in(std::time::Duration::from_millis(5));
        assert!(soon >= now + std::time::Duration::from_millis(5));
        assert_eq!(timeout_ms(std::time::Duration::MAX), i32::MAX);
        assert_eq!(timeout_ms(std::time::Duration::ZERO), 1);
    }

    #[test]
    fn socket_addresses_round_trip_through_the_c_layout() {
        for a in ["192.0.2.1:7174", "[fe80::1%3]:1", "[::ffff:192.0.2.1]:65535", "0.0.0.0:0"] {
            let a: SocketAddr = a.parse().unwrap();
            let mut s = SockAddr::new(a);
            // SAFETY: a SockAddr is a sockaddr_storage.
            assert_eq!(unsafe { read_sockaddr(s.as_mut_ptr()) }, Some(a));
        }
        // SAFETY: NULL is allowed.
        assert_eq!(unsafe { read_sockaddr(std::ptr::null()) }, None);
        // SAFETY: all-zero storage: family 0 (AF_UNSPEC).
        let z: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        // SAFETY: a readable sockaddr_storage.
        assert_eq!(unsafe { read_sockaddr((&z as *const libc::sockaddr_storage).cast()) }, None);
    }

    #[test]
    fn timeouts_are_clamped() {
        use std::time::Duration;
        assert_eq!(timeout_ms(Duration::ZERO), 1);
        assert_eq!(timeout_ms(Duration::from_millis(2000)), 2000);
        assert_eq!(timeout_ms(Duration::from_secs(u64::MAX)), i32::MAX);
    }
}
