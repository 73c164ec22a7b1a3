//! Bounded TCP for the examples' out-of-band exchanges: every connect, accept, read and write
//! ends by a deadline, and failures come back as [`IoError`]s that say what happened (the peer
//! closed the connection, or nothing arrived in time) instead of an OS error number.
#![allow(dead_code)] // each example uses a part of this module

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// The longest `--timeout` (and similar) the examples take: about 11 days. Far enough for any
/// use, and `Instant` arithmetic never overflows with it.
pub const MAX_WAIT_SECS: u64 = 1_000_000;

/// The instant `d` from now (`d` is at most [`MAX_WAIT_SECS`] in practice; longer is capped).
pub fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d).unwrap_or_else(|| now + Duration::from_secs(MAX_WAIT_SECS))
}

/// Seconds for messages: `3`, `0.5`.
pub fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s}")
    }
}

/// Why a read or write did not complete.
#[derive(Debug)]
pub enum IoError {
    /// The peer closed (or reset) the connection.
    Closed,
    /// The deadline passed.
    TimedOut,
    /// Another failure.
    Failed(io::Error),
}

impl std::fmt::Display for IoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoError::Closed => write!(f, "the peer closed the connection"),
            IoError::TimedOut => write!(f, "timed out"),
            IoError::Failed(e) => write!(f, "{e}"),
        }
    }
}

fn classify(e: io::Error) -> IoError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => IoError::Closed,
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => IoError::TimedOut,
        _ => IoError::Failed(e),
    }
}

/// What is left until `until`, at least a millisecond (a zero socket timeout means "forever").
fn left(until: Instant) -> Duration {
    until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// Reads at least one byte into `buf` (non-empty), waiting until `until` at most.
pub fn read_some(stream: &mut TcpStream, buf: &mut [u8], until: Instant) -> Result<usize, IoError> {
    loop {
        if Instant::now() >= until {
            return Err(IoError::TimedOut);
        }
        stream.set_read_timeout(Some(left(until))).map_err(IoError::Failed)?;
        match stream.read(buf) {
            Ok(0) => return Err(IoError::Closed),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => match classify(e) {
                IoError::TimedOut => {} // the loop checks the deadline
                other => return Err(other),
            },
        }
    }
}

/// Fills `buf`, waiting until `until` at most; `check` sees the bytes received so far after
/// every read and may refuse them at once. On failure, also returns how many bytes had come.
pub fn read_exact_checked(
    stream: &mut TcpStream,
    buf: &mut [u8],
    until: Instant,
    mut check: impl FnMut(&[u8]) -> Result<(), String>,
) -> Result<(), (usize, ReadFailure)> {
    let mut got = 0;
    while got < buf.len() {
        match read_some(stream, &mut buf[got..], until) {
            Ok(n) => got += n,
            Err(e) => return Err((got, ReadFailure::Io(e))),
        }
        check(&buf[..got]).map_err(|msg| (got, ReadFailure::Invalid(msg)))?;
    }
    Ok(())
}

/// Why [`read_exact_checked`] failed.
#[derive(Debug)]
pub enum ReadFailure {
    /// Reading failed.
    Io(IoError),
    /// The check refused the bytes: why.
    Invalid(String),
}

/// Writes all of `buf`, waiting until `until` at most.
pub fn write_all(stream: &TcpStream, mut buf: &[u8], until: Instant) -> Result<(), IoError> {
    let mut out = stream; // `Write` is implemented for `&TcpStream`
    while !buf.is_empty() {
        if Instant::now() >= until {
            return Err(IoError::TimedOut);
        }
        stream.set_write_timeout(Some(left(until))).map_err(IoError::Failed)?;
        match out.write(buf) {
            Ok(0) => return Err(IoError::Closed),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => match classify(e) {
                IoError::TimedOut => {}
                other => return Err(other),
            },
        }
    }
    Ok(())
}

/// Listens on TCP `port` of every IPv4 address (non-blocking: [`accept`] waits).
pub fn listen(port: u16) -> Result<TcpListener, String> {
    let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port))
        .map_err(|e| format!("Couldn't listen to port {port}: {e}"))?;
    listener.set_nonblocking(true).map_err(|e| format!("Couldn't listen to port {port}: {e}"))?;
    Ok(listener)
}

/// Waits for one client on `listener` (TCP port `port`), at most `wait`.
pub fn accept(listener: &TcpListener, port: u16, wait: Duration) -> Result<TcpStream, String> {
    let until = deadline_after(wait);
    loop {
        let now = Instant::now();
        if now >= until {
            return Err(format!(
                "no client connected to TCP port {port} within {} s (--accept-timeout sets how long to wait)",
                secs(wait)
            ));
        }
        let ms = until.duration_since(now).as_millis().clamp(1, i32::MAX as u128) as i32;
        let mut pfd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the listener's descriptor, which outlives the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(format!("waiting for a client on port {port}: {e}"));
        }
        if n == 0 {
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).map_err(|e| format!("socket: {e}"))?;
                return Ok(stream);
            }
            // The client may have given up between poll and accept.
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::ConnectionAborted) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("accept() failed: {e}")),
        }
    }
}

/// Connects to `host:port`, retrying refused connections until `wait` has passed.
pub fn connect(host: &str, port: u16, wait: Duration) -> Result<TcpStream, String> {
    let until = deadline_after(wait);
    let mut last = String::from("timed out");
    loop {
        match (host, port).to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    match TcpStream::connect_timeout(&addr, left(until)) {
                        Ok(stream) => return Ok(stream),
                        Err(e) => last = e.to_string(),
                    }
                }
            }
            Err(e) => last = format!("cannot resolve {host}: {e}"),
        }
        if Instant::now() >= until {
            return Err(format!("Couldn't connect to {host}:{port} within {} s: {last}", secs(wait)));
        }
        std::thread::sleep(Duration::from_millis(100).min(until.saturating_duration_since(Instant::now())));
    }
}
