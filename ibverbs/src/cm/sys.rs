//! What the module's files share of librdmacm's C conventions: socket addresses in the C layout,
//! timeouts in milliseconds, and deadlines for bounded waits.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use ibverbs_sys as ffi;

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
