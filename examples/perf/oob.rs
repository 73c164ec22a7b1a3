//! The out-of-band channel: one TCP connection carrying small tagged frames.
//!
//! A frame is a tag byte, a big-endian `u32` length and the payload. Either side may send an
//! [`Tag::Error`] frame (a UTF-8 message) instead of the expected one; the receiver then fails with
//! the peer's message.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::proto::{Tag, MAX_PAYLOAD};

/// The out-of-band connection.
#[derive(Debug)]
pub struct Oob {
    stream: TcpStream,
}

impl Oob {
    /// Connects to `host:port`, retrying for `wait` while nobody listens yet.
    pub fn connect(host: &str, port: u16, wait: Duration) -> Result<Oob, String> {
        let deadline = Instant::now() + wait;
        let mut last_err;
        loop {
            match (host, port).to_socket_addrs() {
                Ok(addrs) => {
                    last_err = format!("{host}:{port} resolves to no address");
                    for addr in addrs {
                        let left = deadline
                            .saturating_duration_since(Instant::now())
                            .max(Duration::from_millis(100));
                        match TcpStream::connect_timeout(&addr, left) {
                            Ok(stream) => return Oob::new(stream),
                            Err(e) => last_err = format!("{addr}: {e}"),
                        }
                    }
                }
                Err(e) => last_err = format!("cannot resolve {host}: {e}"),
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "could not connect to the server at {host}:{port} within {:.0} s ({last_err}); \
                     is it running?",
                    wait.as_secs_f64()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits on `port` (all addresses) for one client, at most `wait` (forever for `None`).
    pub fn accept(port: u16, wait: Option<Duration>) -> Result<Oob, String> {
        let listener = TcpListener::bind(("0.0.0.0", port))
            .map_err(|e| format!("cannot listen on TCP port {port}: {e}"))?;
        let Some(wait) = wait else {
            let (stream, _) = listener.accept().map_err(|e| format!("accept on port {port}: {e}"))?;
            return Oob::new(stream);
        };
        listener.set_nonblocking(true).map_err(|e| format!("listener: {e}"))?;
        let deadline = Instant::now() + wait;
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).map_err(|e| format!("socket: {e}"))?;
                    return Oob::new(stream);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(format!(
                            "no client connected to TCP port {port} within {:.0} s",
                            wait.as_secs_f64()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(format!("accept on port {port}: {e}")),
            }
        }
    }

    fn new(stream: TcpStream) -> Result<Oob, String> {
        stream.set_nodelay(true).map_err(|e| format!("socket: {e}"))?;
        Ok(Oob { stream })
    }

    /// Sends one frame.
    pub fn send(&mut self, tag: Tag, payload: &[u8]) -> Result<(), String> {
        let mut frame = Vec::with_capacity(5 + payload.len());
        frame.push(tag as u8);
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload);
        self.stream.write_all(&frame).map_err(|e| format!("sending to the peer: {e}"))
    }

    /// Receives the next frame, which must carry `tag`; waits at most `timeout` (forever for
    /// `None`). Returns its payload.
    pub fn recv(&mut self, tag: Tag, timeout: Option<Duration>) -> Result<Vec<u8>, String> {
        self.stream.set_read_timeout(timeout).map_err(|e| format!("socket: {e}"))?;
        let what = |e: io::Error| match e.kind() {
            io::ErrorKind::UnexpectedEof => format!("the peer closed the connection (waiting for {tag:?})"),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
                "the peer did not answer within {:.0} s (waiting for {tag:?})",
                timeout.unwrap_or_default().as_secs_f64()
            ),
            _ => format!("receiving from the peer (waiting for {tag:?}): {e}"),
        };
        let mut head = [0u8; 5];
        self.stream.read_exact(&mut head).map_err(what)?;
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(format!("protocol error: frame of {len} bytes"));
        }
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload).map_err(what)?;
        match Tag::from_u8(head[0]) {
            Some(t) if t == tag => Ok(payload),
            Some(Tag::Error) => Err(format!("the peer failed: {}", String::from_utf8_lossy(&payload))),
            other => Err(format!("protocol error: expected {tag:?}, got {other:?} (tag {})", head[0])),
        }
    }

    /// Receives a frame with one of two tags.
    pub fn recv_either(&mut self, a: Tag, b: Tag) -> Result<(Tag, Vec<u8>), String> {
        self.stream.set_read_timeout(None).map_err(|e| format!("socket: {e}"))?;
        let mut head = [0u8; 5];
        self.stream.read_exact(&mut head).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => "the peer closed the connection".to_string(),
            _ => format!("receiving from the peer: {e}"),
        })?;
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(format!("protocol error: frame of {len} bytes"));
        }
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload).map_err(|e| format!("receiving from the peer: {e}"))?;
        match Tag::from_u8(head[0]) {
            Some(t) if t == a || t == b => Ok((t, payload)),
            Some(Tag::Error) => Err(format!("the peer failed: {}", String::from_utf8_lossy(&payload))),
            other => Err(format!("protocol error: expected {a:?} or {b:?}, got {other:?}")),
        }
    }

    /// The socket, for [`socket_closed`].
    pub fn raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Tells the peer why we fail (best effort) and closes the connection.
    pub fn fail(&mut self, msg: &str) {
        let _ = self.send(Tag::Error, msg.as_bytes());
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// Whether the peer has closed the connection on `fd` (or it broke): a non-blocking peek, one
/// system call. Data waiting to be read means the peer is alive.
pub fn socket_closed(fd: RawFd) -> bool {
    let mut b = 0u8;
    // SAFETY: a one-byte peek into a valid local buffer; a stale descriptor only yields an error.
    let n = unsafe { libc::recv(fd, (&mut b as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    match n {
        0 => true,
        n if n > 0 => false,
        _ => {
            let e = io::Error::last_os_error();
            !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted)
        }
    }
}
