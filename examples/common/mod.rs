//! Helpers shared by the bundled examples: opening a device by name, formatting GIDs the way the C
//! tools do, and — for `rc_pingpong`, `ud_pingpong` and `srq_pingpong` — the out-of-band address exchange and the
//! completion loop of rdma-core's `ibv_*_pingpong` tools.
//!
//! The exchange speaks the C tools' protocol over TCP, so either side can be a C tool:
//!
//! 1. the client connects and sends its address as the 52-byte NUL-terminated string
//!    `"%04x:%06x:%06x:%s"` (LID, QPN, PSN, then the GID as 32 hex digits, byte by byte);
//! 2. the server reads it, brings its queue pair to RTS towards the client, and replies with its
//!    own address in the same format;
//! 3. the client answers `"done\0"` and both close the connection; the client then connects its
//!    queue pair.
//!
//! Unlike the C tools, every step is bounded (the server's wait for a client by
//! `--accept-timeout`, every other read and write by `--timeout`), the address message is parsed
//! byte by byte and refused at its first wrong byte, and every failure is one line saying what
//! happened.
#![allow(dead_code)] // each example uses a part of this module

pub mod device;
pub mod memory;
pub mod net;
pub mod wire;

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[allow(unused_imports)] // each example uses a part of it
pub use device::open_device;
#[allow(unused_imports)] // each example uses a part of it
pub use wire::{interface_id_is_zero, ntop, Dest, DONE, WIRE_LEN};

use ibverbs::{
    Completion, CompletionChannel, CompletionQueue, Local, Mtu, QueuePair, RecvRequest, RemoteMemoryRegion,
};

/// The system's page size (the C tools' `-c` pattern marks the first byte of every page).
pub fn page_size() -> usize {
    ibverbs::page_size()
}

/// Fills `len` bytes of `buf` from `offset` with what a `-c` (`--chk`) run sends: `0x7b` (the C
/// tools' fill byte), with 0 at the start of every page (counted from `offset`). Without `check`,
/// only the fill byte. In chunks of at most 1 MiB: no copy of the whole buffer is made.
pub fn fill_pattern(buf: &RemoteMemoryRegion, offset: usize, len: usize, check: bool) -> Result<(), String> {
    if !check && offset == 0 && len == buf.len() {
        buf.fill(0x7b);
        return Ok(());
    }
    let page = page_size();
    let chunk_len = len.min(1 << 20).div_ceil(page) * page;
    let chunk: Vec<u8> = (0..chunk_len).map(|i| if check && i % page == 0 { 0 } else { 0x7b }).collect();
    for start in (0..len).step_by(chunk_len.max(1)) {
        let n = chunk_len.min(len - start);
        buf.write(offset + start, &chunk[..n]).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Compares `len` bytes of `buf` from `offset` with [`fill_pattern`]'s check pattern: the
/// numbers of the pages that differ. Reads in chunks of at most 1 MiB.
pub fn invalid_pages(buf: &RemoteMemoryRegion, offset: usize, len: usize) -> Result<Vec<usize>, String> {
    let page = page_size();
    let mut expected = vec![0x7b; page];
    expected[0] = 0;
    let chunk_len = len.min(1 << 20).div_ceil(page) * page;
    let mut got = vec![0u8; chunk_len];
    let mut bad = Vec::new();
    for start in (0..len).step_by(chunk_len.max(1)) {
        let n = chunk_len.min(len - start);
        buf.read(offset + start, &mut got[..n]).map_err(|e| e.to_string())?;
        for (i, p) in got[..n].chunks(page).enumerate() {
            if p != &expected[..p.len()] {
                bad.push(start / page + i);
            }
        }
    }
    Ok(bad)
}

/// A failed step of the exchange as one line: what we were doing and what happened.
fn failed(e: net::IoError, wait: Duration, doing: &str, peer: &str) -> String {
    match e {
        net::IoError::TimedOut => format!("timed out after {} s {doing}", net::secs(wait)),
        net::IoError::Closed => format!("the {peer} closed the connection ({doing})"),
        net::IoError::Failed(e) => format!("{doing}: {e}"),
    }
}

/// Reads the peer's address message, refusing it at its first byte that does not fit.
fn read_address(stream: &mut TcpStream, wait: Duration, peer: &str) -> Result<Dest, String> {
    let mut msg = [0u8; WIRE_LEN];
    let doing = format!("waiting for the {peer}'s address message");
    net::read_exact_checked(stream, &mut msg, net::deadline_after(wait), wire::check_prefix).map_err(
        |(got, e)| match e {
            net::ReadFailure::Invalid(msg) => format!("the {peer} sent {msg}"),
            net::ReadFailure::Io(net::IoError::Closed) => format!(
                "the {peer} closed the connection after {got} of the {WIRE_LEN} bytes of its address message \
                 (is it a pingpong tool?)"
            ),
            net::ReadFailure::Io(e) => failed(e, wait, &doing, peer),
        },
    )?;
    Dest::from_wire(&msg).map_err(|e| format!("the {peer} sent {e}"))
}

/// The client's side of the exchange: connects (retrying for `timeout`), sends `me`, returns
/// the server's address. Every step waits at most `timeout`.
pub fn client_exchange(host: &str, port: u16, timeout: Duration, me: &Dest) -> Result<Dest, String> {
    Ok(client_exchange_all(host, port, timeout, std::slice::from_ref(me))?[0])
}

/// [`client_exchange`] for tools that exchange several addresses (`ibv_srq_pingpong` sends one
/// message per slot of its table, `mes.len()` of them, and reads as many back).
pub fn client_exchange_all(
    host: &str,
    port: u16,
    timeout: Duration,
    mes: &[Dest],
) -> Result<Vec<Dest>, String> {
    let mut stream = net::connect(host, port, timeout)?;
    for me in mes {
        net::write_all(&stream, &me.to_wire(), net::deadline_after(timeout))
            .map_err(|e| failed(e, timeout, "sending our address", "server"))?;
    }
    let mut remote = Vec::with_capacity(mes.len());
    for _ in mes {
        remote.push(read_address(&mut stream, timeout, "server")?);
    }
    net::write_all(&stream, DONE, net::deadline_after(timeout))
        .map_err(|e| failed(e, timeout, "sending \"done\"", "server"))?;
    Ok(remote)
}

/// The server's side of the exchange: waits at most `accept_wait` for a client on `port`, reads
/// its address, runs `connect` with it (bringing the local queue pair up before the client can
/// send), then replies with `me`. Every later step waits at most `timeout`.
pub fn server_exchange(
    port: u16,
    accept_wait: Duration,
    timeout: Duration,
    me: &Dest,
    connect: impl FnOnce(&Dest) -> Result<(), String>,
) -> Result<Dest, String> {
    let all = server_exchange_all(port, accept_wait, timeout, std::slice::from_ref(me), |r| connect(&r[0]))?;
    Ok(all[0])
}

/// [`server_exchange`] for tools that exchange several addresses: reads `mes.len()` of them,
/// runs `connect` with all, replies with `mes`.
pub fn server_exchange_all(
    port: u16,
    accept_wait: Duration,
    timeout: Duration,
    mes: &[Dest],
    connect: impl FnOnce(&[Dest]) -> Result<(), String>,
) -> Result<Vec<Dest>, String> {
    let listener = net::listen(port)?;
    let mut stream = net::accept(&listener, port, accept_wait)?;
    drop(listener);
    let mut remote = Vec::with_capacity(mes.len());
    for _ in mes {
        remote.push(read_address(&mut stream, timeout, "client")?);
    }
    connect(&remote).map_err(|e| format!("Couldn't connect to remote QP: {e}"))?;
    for me in mes {
        net::write_all(&stream, &me.to_wire(), net::deadline_after(timeout))
            .map_err(|e| failed(e, timeout, "sending our address", "client"))?;
    }
    let mut done = [0u8; DONE.len()];
    let doing = "waiting for the client's \"done\"";
    net::read_exact_checked(&mut stream, &mut done, net::deadline_after(timeout), wire::check_done).map_err(
        |(_, e)| match e {
            net::ReadFailure::Invalid(msg) => msg,
            net::ReadFailure::Io(e) => failed(e, timeout, doing, "client"),
        },
    )?;
    Ok(remote)
}

/// `wr_id` of receives.
pub const RECV_WRID: u64 = 1;
/// `wr_id` of sends.
pub const SEND_WRID: u64 = 2;

/// The receive side of a ping-pong: every receive lands in the same buffer, as in the C tools.
///
/// The buffer is a [`RemoteMemoryRegion`], the crate's type for memory the device may write at any
/// time while others hold it: many receives share it, and it is only ever copied out of.
pub struct Receives {
    buf: Arc<RemoteMemoryRegion>,
    len: usize,
    depth: u32,
    outstanding: u32,
    /// `-c`: every received message must fill its receive (`len` bytes).
    check_len: bool,
}

impl Receives {
    /// With `on` (`-c`), [`pingpong`] fails on a message that does not fill its receive
    /// ([`check_message_len`]).
    pub fn checking_lengths(mut self, on: bool) -> Receives {
        self.check_len = on;
        self
    }

    /// Receives of `len` bytes into `buf`, keeping `depth` posted.
    pub fn new(buf: Arc<RemoteMemoryRegion>, len: usize, depth: u32) -> Receives {
        Receives { buf, len, depth, outstanding: 0, check_len: false }
    }

    /// Posts receives until `depth` are outstanding, in one chain.
    pub fn refill(&mut self, qp: &mut QueuePair) -> Result<(), String> {
        let mut wrs = Vec::with_capacity((self.depth - self.outstanding) as usize);
        for _ in self.outstanding..self.depth {
            let local = Local::new(self.buf.clone(), ..self.len).map_err(|e| e.to_string())?;
            wrs.push(RecvRequest::new(local).wr_id(RECV_WRID));
        }
        let n = wrs.len() as u32;
        let result = qp.post_recv_chain(&mut wrs);
        self.outstanding += n - wrs.len() as u32;
        result.map_err(|e| format!("Couldn't post receive ({} of {}): {e}", self.outstanding, self.depth))
    }

    /// The receive buffer.
    pub fn buffer(&self) -> &RemoteMemoryRegion {
        &self.buf
    }
}

/// Waits for completions on `cq`, by busy polling or (with a channel) by sleeping on CQ events, and
/// fails when none arrives for `idle`: the peer is gone or stuck.
pub struct Waiter<'a> {
    /// The completion queue.
    pub cq: &'a mut CompletionQueue,
    /// The channel the CQ reports to, for `-e`; the CQ must have been armed once.
    pub channel: Option<&'a CompletionChannel>,
    /// How long to wait for a completion.
    pub idle: Duration,
}

impl Waiter<'_> {
    /// At least one completion (at most `out.len()`).
    pub fn wait<'c>(&mut self, out: &'c mut [Completion]) -> Result<&'c mut [Completion], String> {
        let deadline = Instant::now() + self.idle;
        let mut spins = 0u32;
        loop {
            let n = self.cq.poll(out).map_err(|e| format!("poll CQ failed: {e}"))?.len();
            if n > 0 {
                return Ok(&mut out[..n]);
            }
            let now = Instant::now();
            match self.channel {
                // Check the clock now and then: it is cheap, but not free.
                None => {
                    spins = spins.wrapping_add(1);
                    if spins % 1024 == 0 && now >= deadline {
                        return Err(self.timed_out());
                    }
                }
                Some(channel) => {
                    if now >= deadline {
                        return Err(self.timed_out());
                    }
                    let event = channel
                        .get_event(Some(deadline - now))
                        .map_err(|e| format!("Failed to get cq_event: {e}"))?;
                    match event {
                        None => {} // timed out (or interrupted): the loop checks the deadline
                        Some(id) if id != self.cq.id() => return Err("CQ event for an unknown CQ".into()),
                        // Re-arm before polling, so that no completion slips between the two.
                        Some(_) => self
                            .cq
                            .req_notify(false)
                            .map_err(|e| format!("Couldn't request CQ notification: {e}"))?,
                    }
                }
            }
        }
    }

    fn timed_out(&self) -> String {
        format!("no completion for {} s: the peer is gone or stuck", self.idle.as_secs_f64())
    }
}

/// Runs `iters` ping-pong exchanges as the C tools do: each side keeps `rx_depth` receives posted
/// and sends its next message once both its previous send and the peer's message have completed;
/// the `initiator` (the client) sends first. `post_send` posts one send with `wr_id` [`SEND_WRID`].
/// Returns the time the exchanges took.
pub fn pingpong(
    qp: &mut QueuePair,
    waiter: &mut Waiter<'_>,
    rx: &mut Receives,
    iters: u32,
    initiator: bool,
    mut post_send: impl FnMut(&mut QueuePair) -> Result<(), ibverbs::Error>,
) -> Result<Duration, String> {
    let mut send = |qp: &mut QueuePair| post_send(qp).map_err(|e| format!("Couldn't post send: {e}"));
    let mut pending = RECV_WRID;
    if initiator {
        send(qp)?;
        pending |= SEND_WRID;
    }
    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    let mut wcs: [Completion; 2] = Default::default();
    while rcnt < iters || scnt < iters {
        for wc in waiter.wait(&mut wcs)?.iter() {
            if !wc.is_ok() {
                return Err(failed_status(wc));
            }
            match wc.wr_id() {
                SEND_WRID => scnt += 1,
                RECV_WRID => {
                    if rx.check_len {
                        check_message_len(wc, rx.len)?;
                    }
                    rx.outstanding -= 1;
                    if rx.outstanding <= 1 {
                        rx.refill(qp)?;
                    }
                    rcnt += 1;
                }
                other => return Err(format!("Completion for unknown wr_id {other}")),
            }
            pending &= !wc.wr_id();
            if scnt < iters && pending == 0 {
                send(qp)?;
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    Ok(start.elapsed())
}

/// Prints the C tools' summary lines.
pub fn print_summary(size: u32, iters: u32, elapsed: Duration) {
    let usec = elapsed.as_secs_f64() * 1e6;
    let bytes = u128::from(size) * u128::from(iters) * 2;
    println!("{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec", usec / 1e6, bytes as f64 * 8.0 / usec);
    println!("{iters} iters in {:.2} seconds = {:.2} usec/iter", usec / 1e6, usec / f64::from(iters));
}

/// Parses an MTU in bytes for clap: 256, 512, 1024, 2048 or 4096.
pub fn parse_mtu(s: &str) -> Result<Mtu, String> {
    s.parse::<u32>()
        .ok()
        .and_then(Mtu::from_bytes)
        .ok_or_else(|| format!("{s:?} is not an MTU: use 256, 512, 1024, 2048 or 4096"))
}

/// `-c` of the pingpong tools: a received message must fill its receive of `len` bytes (one
/// buffer serves the sends and the receives, so a short message would leave the bytes the data
/// check expects in place).
pub fn check_message_len(wc: &Completion, len: usize) -> Result<(), String> {
    if wc.byte_len() as usize == len {
        return Ok(());
    }
    Err(format!(
        "a message of {} bytes arrived, not {len} (-c checks every message's length: is the peer's -s the same?)",
        wc.byte_len()
    ))
}

/// The error of a failed completion, as the C pingpong tools print it.
pub fn failed_status(wc: &Completion) -> String {
    let status = wc.status();
    format!("Failed status {} ({}) for wr_id {}", status.as_str(), status.0, wc.wr_id())
}
