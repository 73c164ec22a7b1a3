//! The out-of-band channel: one TCP connection carrying the frames of [`super::proto`].
//!
//! Every wait is bounded. Each side sends an `Alive` frame every second or so (at most a quarter
//! of `--timeout` apart) while it waits for a frame and from its hot loops' [`Guard`](super::Guard),
//! so a receiver can tell a peer that is busy (running a long measurement while this side only
//! waits) from one that is gone: a receive fails when nothing at all has arrived for
//! `--timeout`, which is what a dead host, a stopped process or a peer speaking no protocol look
//! like. Some waits also have an overall bound (the setup's `--setup-timeout`). A side also
//! sends one before and after each step of its setup that may take long (allocating and
//! registering a buffer): a single such step must end within the peer's `--timeout`. Either side
//! may send an `Error` frame instead of the expected one; the receiver then fails with the peer's
//! message.
//!
//! The frames are sent by the main thread: the examples start no thread. A process with a second
//! thread takes glibc's multi-threaded path in every cancellable system call (the cancellation
//! bookkeeping around it), and the provider rings each doorbell with a `write`: with a heartbeat
//! thread the 2-byte message rate of `write_bw` on SoftRoCE was 5-9 % lower.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::net::{self, IoError};
use super::proto::{encode_frame, read_frame, ByteSource, FrameError, ReadError, Tag};

/// The out-of-band connection.
#[derive(Debug)]
pub struct Oob {
    /// For reading.
    stream: TcpStream,
    /// The same socket for writing (every frame we send), and our `Alive` frames' schedule.
    beat: Beat,
    /// The longest silence of the peer we accept.
    timeout: Duration,
    /// "server" or "client".
    peer: &'static str,
    /// How long a reply the peer sends at once may take, whatever its `Alive` frames say
    /// (`--setup-timeout`, see [`reply_cap`](Self::reply_cap)).
    reply: Option<Duration>,
}

impl Oob {
    /// Connects to the server at `host:port`, retrying for `wait` while nobody listens yet.
    pub fn connect(host: &str, port: u16, wait: Duration, timeout: Duration) -> Result<Oob, String> {
        let stream = net::connect(host, port, wait).map_err(|e| format!("{e}; is the server running?"))?;
        Oob::new(stream, timeout, "server")
    }

    /// Listens on `port` (all addresses) and waits at most `wait` for one client.
    pub fn accept(port: u16, wait: Duration, timeout: Duration) -> Result<Oob, String> {
        let listener = net::listen(port)?;
        println!("\n************************************");
        println!("* Waiting for client to connect... *");
        println!("************************************");
        let stream = net::accept(&listener, port, wait)?;
        Oob::new(stream, timeout, "client")
    }

    fn new(stream: TcpStream, timeout: Duration, peer: &'static str) -> Result<Oob, String> {
        stream.set_nodelay(true).map_err(|e| format!("socket: {e}"))?;
        let writer = Arc::new(stream.try_clone().map_err(|e| format!("socket: {e}"))?);
        // A quarter of --timeout, between 10 ms and a second.
        let interval = (timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let beat = Beat { writer, interval, last_sent: Instant::now() };
        Ok(Oob { stream, beat, timeout, peer, reply: None })
    }

    /// Caps the waits for frames a working peer sends at once (hello, run, ready, acknowledgements)
    /// at `cap`, however many `Alive` frames it sends meanwhile: a peer that only ever says it is
    /// alive is not waited for forever.
    pub fn set_reply_cap(&mut self, cap: Duration) {
        self.reply = Some(cap);
    }

    /// The cap of [`set_reply_cap`](Self::set_reply_cap), for [`recv`](Self::recv).
    pub fn reply_cap(&self) -> Option<Duration> {
        self.reply
    }

    /// The `Alive` frames of a hot loop's guard: on the same socket, at the same interval, on
    /// a schedule of their own.
    pub fn beat_for_guard(&self) -> Beat {
        self.beat.clone()
    }

    /// Sends an `Alive` frame if none has gone for a beat's interval: around work that sends
    /// nothing for a while (a setup step, a report's computation).
    pub fn beat(&mut self) {
        self.beat.if_due();
    }

    /// The peer's IP address (the server's, for `-R`).
    pub fn peer_ip(&self) -> Result<std::net::IpAddr, String> {
        self.stream.peer_addr().map(|a| a.ip()).map_err(|e| format!("socket: {e}"))
    }

    /// The peer: "server" or "client".
    pub fn peer(&self) -> &'static str {
        self.peer
    }

    /// Sends one frame (waiting at most `--timeout` for room in the socket).
    pub fn send(&mut self, tag: Tag, payload: &[u8]) -> Result<(), String> {
        let frame = encode_frame(tag, payload);
        let sent = net::write_all(&self.beat.writer, &frame, net::deadline_after(self.timeout));
        self.beat.last_sent = Instant::now();
        sent.map_err(|e| match e {
            IoError::Closed => self.why_closed(&format!("sending {tag:?}")),
            IoError::TimedOut => format!(
                "timed out after {} s sending {tag:?}: the {} does not read (is it stuck?)",
                net::secs(self.timeout),
                self.peer
            ),
            IoError::Failed(e) => format!("sending {tag:?} to the {}: {e}", self.peer),
        })
    }

    /// After the peer closed the connection under a send: its `Error` frame, if it sent one.
    fn why_closed(&mut self, doing: &str) -> String {
        let mut src = Source::new(&mut self.stream, &mut self.beat, Duration::from_millis(500), None);
        match read_frame(&mut src, &[], || {}) {
            Err(FrameError::Peer(msg)) => format!("the {} failed: {msg}", self.peer),
            _ => format!("the {} closed the connection ({doing})", self.peer),
        }
    }

    /// Receives the next frame with one of the tags `expect` (skipping `Alive` frames); `what`
    /// names it for messages. Sends `Alive` frames while it waits. Fails when the peer sends
    /// nothing for `--timeout`, or when `cap` (if any) passes.
    pub fn recv(
        &mut self,
        expect: &[Tag],
        what: &str,
        cap: Option<Duration>,
    ) -> Result<(Tag, Vec<u8>), String> {
        let mut src = Source::new(&mut self.stream, &mut self.beat, self.timeout, cap);
        let got = read_frame(&mut src, expect, || {});
        let cap_passed = src.cap.is_some_and(|c| Instant::now() >= c);
        got.map_err(|e| match e {
            FrameError::Read(ReadError::TimedOut) if cap_passed => format!(
                "timed out after {} s waiting for {what} (--setup-timeout sets how long a peer's setup may take)",
                net::secs(cap.unwrap_or_default())
            ),
            FrameError::Read(ReadError::TimedOut) => format!(
                "the {} sent nothing for {} s while we waited for {what} (is it still running?)",
                self.peer,
                net::secs(self.timeout)
            ),
            FrameError::Read(ReadError::Closed { got: 0 }) => {
                format!("the {} closed the connection while we waited for {what}", self.peer)
            }
            FrameError::Read(ReadError::Closed { .. }) => {
                format!("the {} closed the connection in the middle of a message (waiting for {what})", self.peer)
            }
            FrameError::Read(ReadError::Failed(e)) => format!("receiving {what} from the {}: {e}", self.peer),
            FrameError::Peer(msg) => format!("the {} failed: {msg}", self.peer),
            FrameError::Protocol(msg) => format!("protocol error while waiting for {what}: {msg}"),
        })
    }

    /// Receives the next frame, which must carry `tag`; returns its payload.
    pub fn recv_one(&mut self, tag: Tag, what: &str, cap: Option<Duration>) -> Result<Vec<u8>, String> {
        self.recv(&[tag], what, cap).map(|(_, payload)| payload)
    }

    /// The socket, for [`socket_closed`].
    pub fn raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Tells the peer why we fail (best effort) and closes the connection.
    pub fn fail(&mut self, msg: &str) {
        let msg = msg.as_bytes();
        let frame = encode_frame(Tag::Error, &msg[..msg.len().min(super::proto::MAX_ERROR_LEN)]);
        let until = net::deadline_after(self.timeout.min(Duration::from_secs(1)));
        let _ = net::write_all(&self.beat.writer, &frame, until);
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// When and where a side sends its `Alive` frames: on `writer`, every `interval` since
/// `last_sent` (best effort: a peer that does not read is found out by the waits).
#[derive(Debug, Clone)]
pub struct Beat {
    writer: Arc<TcpStream>,
    interval: Duration,
    last_sent: Instant,
}

impl Beat {
    /// When the next frame is due.
    fn due(&self) -> Instant {
        self.last_sent + self.interval
    }

    /// Sends an `Alive` frame if one is due, waiting at most an interval for room.
    pub fn if_due(&mut self) {
        if Instant::now() >= self.due() {
            let _ = net::write_all(
                &self.writer,
                &encode_frame(Tag::Alive, &[]),
                net::deadline_after(self.interval),
            );
            self.last_sent = Instant::now();
        }
    }
}

/// The socket as a [`ByteSource`]: each read waits until the peer's silence exceeds `liveness`
/// (any byte restarts that clock) or `cap` passes, sending our `Alive` frames meanwhile.
struct Source<'a> {
    stream: &'a mut TcpStream,
    beat: &'a mut Beat,
    liveness: Duration,
    live_until: Instant,
    cap: Option<Instant>,
}

impl<'a> Source<'a> {
    fn new(stream: &'a mut TcpStream, beat: &'a mut Beat, liveness: Duration, cap: Option<Duration>) -> Self {
        Source {
            stream,
            beat,
            liveness,
            live_until: net::deadline_after(liveness),
            cap: cap.map(net::deadline_after),
        }
    }
}

impl ByteSource for Source<'_> {
    fn fill(&mut self, buf: &mut [u8]) -> Result<(), ReadError> {
        let mut got = 0;
        while got < buf.len() {
            let until = self.cap.map_or(self.live_until, |c| c.min(self.live_until));
            self.beat.if_due();
            match net::read_some(self.stream, &mut buf[got..], until.min(self.beat.due())) {
                Ok(n) => {
                    got += n;
                    self.live_until = net::deadline_after(self.liveness);
                }
                Err(IoError::Closed) => return Err(ReadError::Closed { got }),
                // A beat is due: sent at the top of the loop.
                Err(IoError::TimedOut) if Instant::now() < until => {}
                Err(IoError::TimedOut) => return Err(ReadError::TimedOut),
                Err(IoError::Failed(e)) => return Err(ReadError::Failed(e.to_string())),
            }
        }
        Ok(())
    }
}

/// Consumes the `Alive` frames at the head of what waits on socket `fd` (only those: a frame of
/// another kind stays for the next receive), without waiting. Returns how many it took and how
/// many bytes are left waiting (up to 4 KiB). For hot loops, which do not receive meanwhile: the
/// heartbeats of a long measurement would otherwise fill the socket's buffer.
pub fn take_alive_frames(fd: RawFd) -> (usize, usize) {
    let mut buf = [0u8; 4096];
    let peek = |buf: &mut [u8], flags| {
        // SAFETY: receives at most `buf.len()` bytes into a valid local buffer.
        unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags | libc::MSG_DONTWAIT) }
    };
    let n = peek(&mut buf, libc::MSG_PEEK);
    let Ok(n) = usize::try_from(n) else { return (0, 0) };
    let alive = encode_frame(Tag::Alive, &[]);
    let frames = buf[..n].chunks_exact(alive.len()).take_while(|c| *c == &alive[..]).count();
    let take = frames * alive.len();
    if take == 0 {
        return (0, n);
    }
    let taken = usize::try_from(peek(&mut buf[..take], 0)).unwrap_or(0);
    (taken / alive.len(), n - taken)
}

/// Whether the peer has closed the connection on `fd` (or it broke): one `poll` without waiting.
/// `POLLRDHUP` reports the peer's FIN even while unread data (its `Alive` frames) is queued.
pub fn socket_closed(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd; a stale descriptor only yields POLLNVAL.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n < 0 {
        return io::Error::last_os_error().kind() != io::ErrorKind::Interrupted;
    }
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}
