//! Descriptor helpers shared by the event channels (completion channels, asynchronous events,
//! RDMA-CM event channels): non-blocking mode, a bounded wait for readability, and the private
//! epoll descriptor handed to reactors as `AsFd`.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// Sets `O_NONBLOCK` on `fd`, so that a reader that loses a race for an event gets `EAGAIN`
/// instead of blocking (`ibv_get_cq_event`, `ibv_get_async_event` and `rdma_get_cm_event` all
/// support it).
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl(F_GETFL) reads the flags of a descriptor; an invalid one is EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::O_NONBLOCK != 0 {
        return Ok(());
    }
    // SAFETY: as above; only the status flags change.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The `poll(2)` timeout for `left`: -1 (forever) for `None`, else milliseconds rounded *up*
/// (a wait of 0.3 ms must not become a busy 0 ms poll), capped at `i32::MAX`.
pub(crate) fn poll_millis(left: Option<Duration>) -> i32 {
    match left {
        None => -1,
        Some(d) => {
            let ms = d.as_nanos().div_ceil(1_000_000);
            i32::try_from(ms).unwrap_or(i32::MAX)
        }
    }
}

/// Waits until `fd` is readable or `timeout` passed (forever for `None`): `Ok(true)` when
/// readable, `Ok(false)` on timeout. An interrupted `poll(2)` (`EINTR`) is retried with the time
/// that is left, so a signal neither shortens nor lengthens the wait.
pub(crate) fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> io::Result<bool> {
    wait_any_readable(&[fd], timeout)
}

/// [`wait_readable`] over several descriptors (at most 4): `Ok(true)` when one is readable.
pub(crate) fn wait_any_readable(fds: &[RawFd], timeout: Option<Duration>) -> io::Result<bool> {
    let mut pfds = [libc::pollfd { fd: -1, events: libc::POLLIN, revents: 0 }; 4];
    let n_fds = fds.len().min(pfds.len());
    for (p, &fd) in pfds.iter_mut().zip(fds.iter()) {
        p.fd = fd;
    }
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    let mut left = timeout;
    loop {
        // SAFETY: `n_fds` valid pollfds for the duration of the call.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), n_fds as libc::nfds_t, poll_millis(left)) };
        if n > 0 {
            return Ok(true);
        }
        if n == 0 {
            return Ok(false);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
        if let Some(d) = deadline {
            let now = Instant::now();
            if now >= d {
                return Ok(false);
            }
            left = Some(d - now);
        }
        // Otherwise: forever, or a timeout too large for an Instant: wait it again.
    }
}

/// The time left until `deadline` (`None`: no deadline, wait forever).
pub(crate) fn time_left(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

/// The deadline `timeout` from now; `None` (forever) for `None` or a timeout too large to
/// represent.
pub(crate) fn deadline(timeout: Option<Duration>) -> Option<Instant> {
    timeout.and_then(|t| Instant::now().checked_add(t))
}

/// Takes an event with `try_take` (non-blocking), waiting for `fd` to become readable in between,
/// until one comes or `timeout` (forever for `None`) passes: `Ok(None)` then. An event another
/// reader takes meanwhile is theirs: this keeps waiting for another one until the deadline. A
/// signal does not end the wait early.
pub(crate) fn take_until<T>(
    fd: RawFd,
    timeout: Option<Duration>,
    mut try_take: impl FnMut() -> crate::error::Result<Option<T>>,
) -> crate::error::Result<Option<T>> {
    let deadline = deadline(timeout);
    loop {
        if let Some(event) = try_take()? {
            return Ok(Some(event));
        }
        let left = match timeout {
            Some(_) if deadline.is_none() => timeout, // too far to represent: forever-ish
            _ => time_left(deadline),
        };
        if left == Some(Duration::ZERO) {
            return Ok(None);
        }
        if !wait_readable(fd, left).map_err(|source| crate::error::Error::Verb { verb: "poll", source })? {
            return Ok(None);
        }
    }
}

/// A non-blocking `eventfd(2)`: one thread wakes another that waits in `poll(2)`.
pub(crate) struct Wakeup {
    fd: OwnedFd,
}

impl Wakeup {
    pub(crate) fn new() -> io::Result<Wakeup> {
        // SAFETY: plain syscall; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(Wakeup { fd: unsafe { OwnedFd::from_raw_fd(raw) } })
    }

    /// Makes the descriptor readable (best effort: a full counter is readable anyway).
    pub(crate) fn wake(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Resets the descriptor to not readable.
    pub(crate) fn reset(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    pub(crate) fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A private epoll instance watching one descriptor for `EPOLLIN` (level-triggered).
///
/// It is readable exactly when the watched descriptor is, any reactor can watch it (epoll
/// instances nest), and `read(2)` on it fails with `EINVAL`: handing it out as a safe
/// [`BorrowedFd`] lets safe code wait for events without being able to consume one.
pub(crate) struct ReadinessFd {
    epoll: OwnedFd,
}

impl ReadinessFd {
    /// Creates the epoll instance (`EPOLL_CLOEXEC`) and adds `watched` to it.
    pub(crate) fn new(watched: RawFd) -> io::Result<ReadinessFd> {
        // SAFETY: plain syscall; the result is checked.
        let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 0 };
        // SAFETY: both descriptors are open; `ev` is valid for the call.
        if unsafe { libc::epoll_ctl(raw, libc::EPOLL_CTL_ADD, watched, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ReadinessFd { epoll })
    }
}

impl AsFd for ReadinessFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_timeouts_round_up_and_saturate() {
        assert_eq!(poll_millis(None), -1);
        assert_eq!(poll_millis(Some(Duration::ZERO)), 0);
        assert_eq!(poll_millis(Some(Duration::from_micros(300))), 1);
        assert_eq!(poll_millis(Some(Duration::from_millis(7))), 7);
        assert_eq!(poll_millis(Some(Duration::from_nanos(7_000_001))), 8);
        assert_eq!(poll_millis(Some(Duration::MAX)), i32::MAX);
    }

    // poll(2) and epoll are not available under Miri.
    #[test]
    #[cfg_attr(miri, ignore)]
    fn waits_are_bounded_and_the_epoll_descriptor_follows_its_source_and_cannot_be_read() {
        let w = Wakeup::new().unwrap();
        set_nonblocking(w.raw()).unwrap();
        let ready = ReadinessFd::new(w.raw()).unwrap();
        let epfd = ready.as_fd().as_raw_fd();
        let t = Instant::now();
        assert!(!wait_readable(w.raw(), Some(Duration::from_millis(30))).unwrap());
        assert!(t.elapsed() >= Duration::from_millis(30));
        assert!(!wait_readable(epfd, Some(Duration::ZERO)).unwrap());
        w.wake();
        assert!(wait_readable(w.raw(), Some(Duration::ZERO)).unwrap());
        assert!(
            wait_readable(epfd, Some(Duration::ZERO)).unwrap(),
            "level-triggered: readable with its source"
        );
        assert!(wait_any_readable(&[epfd, w.raw()], None).unwrap());
        let mut f = std::fs::File::from(ready.as_fd().try_clone_to_owned().unwrap());
        let e = std::io::Read::read(&mut f, &mut [0u8; 8]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        assert!(wait_readable(w.raw(), Some(Duration::ZERO)).unwrap(), "the failed read consumed nothing");
        w.reset();
        assert!(!wait_readable(epfd, Some(Duration::ZERO)).unwrap());
        assert!(set_nonblocking(-1).is_err());
    }
}
