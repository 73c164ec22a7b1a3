//! What the perftest-style examples share: command line, out-of-band protocol, verbs resources,
//! the bounded-wait guard, and the bandwidth loops.
//!
//! # Protocol
//!
//! The examples' own, not perftest's: a Rust server pairs with a Rust client, and perftest's C
//! tools with each other (the benchmarks run each pair in turn). perftest's exchange sends its
//! version string first, then structures of its own whose layout follows its version; a peer
//! that sends such a string is named as perftest in the error.
//!
//! The server listens on a TCP port; the client connects (retrying for `--connect-timeout`
//! seconds) and drives:
//!
//! 1. client → server `Hello`: the test and every parameter (the server adopts the client's
//!    size, iterations, queue pairs, depths...; only device, port and GID index are its own);
//! 2. server → client, then client → server, `Setup`: per queue pair its [`Endpoint`] encoding
//!    (30 bytes) and the [`RemoteSlice`] encoding (20 bytes) of its buffer; both connect their
//!    queue pairs;
//! 3. per measurement (one, or one per size with `--all`): client → server `Run` (size,
//!    iterations); server → client `Ready` once it can take traffic (receives posted); the data
//!    phase; client → server `Done` (with its bandwidth report), server → client `Ack` (with its
//!    own, where it measured one);
//! 4. client → server `End`, server → client `Ack`: the final sync; both tear down.
//!
//! Both sides send `Alive` frames every second or so from the main thread, while waiting for a
//! frame and from the hot loops (see [`oob`]; the examples start no thread).
//!
//! Device, port and GID index are checked before the server listens or the client connects.
//! Every wait is bounded: the connect (`--connect-timeout`), the server's wait for a client
//! (`--accept-timeout`, by default `--timeout`), every frame (the peer silent for `--timeout`:
//! not even `Alive` frames; the peer's setup, which may register large buffers, also within
//! `--setup-timeout`), and every completion or memory poll (`--timeout` without progress);
//! polling loops also notice at once when the peer's end of the TCP connection closes. Failures
//! end with one line on stderr (also sent to the peer) and a non-zero exit.
#![allow(dead_code)] // each example uses part of this module

pub mod bw;
pub mod clock;
#[path = "../common/device.rs"]
pub mod device;
#[path = "../common/memory.rs"]
pub mod memory;
#[path = "../common/net.rs"]
pub mod net;
pub mod oob;
pub mod proto;
pub mod report;
#[path = "../selection/mod.rs"]
pub mod selection;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::RawFd;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser};
use ibverbs::cm::{self, CmId, ConnParam};
use ibverbs::{
    AccessFlags, CompletionQueue, ConnectOptions, Context, Endpoint, LinkLayer, Local, MemoryRegion, Mtu,
    OwnedBuffer, PortAttr, ProtectionDomain, QpType, QueuePair, RemoteMemoryRegion, RemoteSlice, SendOps,
    WcFlags,
};

use clock::{ticks, Clock};
use oob::Oob;
pub use proto::{Level, Params, TestKind, DEFAULT_LEVEL};
use proto::{Tag, CACHE_LINE, CYCLE_BUFFER, MAX_SWEEP_SIZE};
use report::{BwReport, LatReport, BW_HEADER, LAT_HEADER, RESULT_LINE};

/// The command line, as perftest's where the flag exists there.
#[derive(Parser, Debug)]
#[command(after_help = "Run the server without HOST, then the client with the server's HOST. The client's \
                  parameters rule: the server adopts them. With -q N, -n counts messages per queue \
                  pair (as perftest; the table shows the total).")]
pub struct Args {
    /// RDMA device (default: IBVERBS_HCA/NCCL_IB_HCA's first usable port, else the first device).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    pub ib_dev: Option<String>,
    /// Port of the device (default: the environment's selection, else 1).
    #[arg(short = 'i', long = "ib-port", value_name = "PORT",
          value_parser = clap::value_parser!(u8).range(1..))]
    pub ib_port: Option<u8>,
    /// GID index (default: the RoCE v2 IPv4 GID on Ethernet ports, LID addressing on InfiniBand; with -R none is needed; an iWARP port's GID 0).
    #[arg(short = 'x', long = "gid-index", value_name = "INDEX")]
    pub gid_index: Option<u32>,
    /// Message size in bytes [default: 65536 for bandwidth, 2 for latency tests].
    #[arg(short = 's', long, value_name = "BYTES")]
    pub size: Option<u64>,
    /// Iterations (per queue pair) [default: 5000 for bandwidth, 1000 for latency tests].
    #[arg(short = 'n', long, value_name = "N")]
    pub iters: Option<u64>,
    /// TCP port of the out-of-band connection.
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub port: u16,
    /// Number of queue pairs (bandwidth tests).
    #[arg(short = 'q', long = "qp", default_value_t = 1, value_name = "N")]
    pub qp: u32,
    /// Sweep the sizes 2, 4, ..., 8 MiB. To stay reasonable on slow devices the iterations of a
    /// size are capped so that it moves at most 64 MiB per queue pair (16 MiB for latency tests),
    /// with at least 16 iterations.
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Send queue depth: messages in flight per queue pair [default: 128 for bandwidth, 1 for
    /// latency tests].
    #[arg(short = 't', long = "tx-depth", value_name = "N")]
    pub tx_depth: Option<u32>,
    /// Receive queue depth (Send tests) [default: 512].
    #[arg(short = 'r', long = "rx-depth", value_name = "N")]
    pub rx_depth: Option<u32>,
    /// Request a completion every N messages [default: 100, but 1 for sizes above 8 KiB (except
    /// with --all); at most the tx depth].
    #[arg(short = 'Q', long = "cq-mod", value_name = "N")]
    pub cq_mod: Option<u32>,
    /// Post N work requests per post call, chained (one doorbell); the last of each is signaled.
    #[arg(short = 'l', long = "post-list", default_value_t = 1, value_name = "N")]
    pub post_list: u32,
    /// Skip the peak bandwidth (bandwidth tests), printed as 0.00, as perftest's -N: its search
    /// over windows of messages grows with the square of -n.
    #[arg(short = 'N', long = "noPeak", alias = "no-peak")]
    pub no_peak: bool,
    /// Send messages of at most this many bytes inline (latency tests) [default: 0, as perftest
    /// on SoftRoCE].
    #[arg(short = 'I', long = "inline-size", value_name = "BYTES")]
    pub inline_size: Option<u32>,
    /// Path MTU in bytes (256..4096) [default: the port's active MTU].
    #[arg(short = 'm', long, value_name = "BYTES")]
    pub mtu: Option<u32>,
    /// Hot loop at the safe level (the default): prepared requests checked once, posted with
    /// post_prepared (and its chain, inline and receive forms), typed completions from poll.
    #[arg(long, conflicts_with = "raw")]
    pub safe: bool,
    /// Hot loop at the raw level: unsafe post_*_unchecked with prebuilt work requests +
    /// poll_raw (C's cost).
    #[arg(long)]
    pub raw: bool,
    /// This side's queue pairs and completion queues on the extended data path: QPs from
    /// ibv_create_qp_ex with send_ops (safe posts go through ibv_wr_*), CQs from
    /// ibv_create_cq_ex (polled with ibv_start_poll) asking for no optional field (the loops
    /// read only wr_id and status). Not negotiated: each side chooses.
    #[arg(long)]
    pub ex: bool,
    /// Connect the queue pairs with RDMA-CM (perftest's -R) instead of exchanging their
    /// addresses: the server listens on an RDMA-CM port it announces over the out-of-band
    /// connection, and the client connects each queue pair to it (at the server's address: give
    /// HOST as an address of the RDMA device's network interface). Both sides must use it.
    #[arg(short = 'R', long = "rdma-cm", conflicts_with = "ex")]
    pub rdma_cm: bool,
    /// Seconds without progress (no completion, no peer write, nothing at all from the peer)
    /// before giving up.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    pub timeout: f64,
    /// Seconds the client retries connecting to the server.
    #[arg(long = "connect-timeout", default_value_t = 10.0, value_name = "SECS")]
    pub connect_timeout: f64,
    /// Seconds the server waits for a client [default: --timeout].
    #[arg(long = "accept-timeout", value_name = "SECS")]
    pub accept_timeout: Option<f64>,
    /// Seconds the peer's setup (verbs resources and buffer registration, which takes long for
    /// large buffers) may take, as long as it stays alive.
    #[arg(long = "setup-timeout", default_value_t = 120.0, value_name = "SECS")]
    pub setup_timeout: f64,
    /// The server to connect to (client); none: be the server.
    pub host: Option<String>,
}

/// Server or client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Waits for the client, adopts its parameters.
    Server,
    /// Connects and drives.
    Client,
}

impl Params {
    fn from_args(kind: TestKind, a: &Args) -> Result<Params, String> {
        let bw = kind.is_bw();
        let size = if a.all { MAX_SWEEP_SIZE } else { a.size.unwrap_or(if bw { 65536 } else { 2 }) };
        let iters = a.iters.unwrap_or(if bw { 5000 } else { 1000 });
        let p = Params {
            size,
            all: a.all,
            iters,
            qps: a.qp,
            tx_depth: a.tx_depth.unwrap_or(if bw { 128 } else { 1 }),
            rx_depth: a.rx_depth.unwrap_or(512),
            cq_mod: a.cq_mod.unwrap_or(0),
            post_list: a.post_list,
            inline: a.inline_size.unwrap_or(0),
            mtu: a.mtu.unwrap_or(0),
            level: if a.safe {
                Level::Safe
            } else if a.raw {
                Level::Raw
            } else {
                DEFAULT_LEVEL
            },
        };
        p.validate(kind)?;
        Ok(p)
    }
}

/// One measurement, with the depths it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunSpec {
    /// Message size.
    pub size: u64,
    /// Iterations per queue pair.
    pub iters: u64,
    /// Queue pairs.
    pub qps: usize,
    /// Messages in flight per queue pair.
    pub tx_depth: u64,
    /// Receives posted ahead per queue pair.
    pub rx_depth: u64,
    /// A completion every `cq_mod` messages.
    pub cq_mod: u64,
    /// Work requests per post call.
    pub post_list: u64,
    /// Inline threshold.
    pub inline: u32,
    /// Posting level.
    pub level: Level,
}

impl RunSpec {
    /// Whether message `k` (of a queue pair) asks for a completion.
    #[inline(always)]
    pub fn signaled(&self, k: u64) -> bool {
        (k + 1) % self.cq_mod == 0 || k + 1 == self.iters
    }

    /// Where message `k` goes in its buffer: perftest cycles small messages through a page,
    /// cache-line aligned, and keeps large ones at the start.
    #[inline(always)]
    pub fn offset(&self, k: u64) -> u64 {
        if self.size > CYCLE_BUFFER / 2 {
            return 0;
        }
        let inc = self.size.div_ceil(CACHE_LINE) * CACHE_LINE;
        (k % (CYCLE_BUFFER / inc)) * inc
    }

    /// The byte range of message `k`.
    #[inline(always)]
    pub fn range(&self, k: u64) -> Range<usize> {
        let off = self.offset(k) as usize;
        off..off + self.size as usize
    }
}

/// Encodes the queue pair and message index into a `wr_id` (bit 63 clear, as the raw level needs).
#[inline(always)]
pub fn wr_id(q: usize, k: u64) -> u64 {
    ((q as u64) << 40) | k
}

/// Decodes [`wr_id`].
#[inline(always)]
pub fn split_wr_id(id: u64) -> (usize, u64) {
    ((id >> 40) as usize, id & ((1 << 40) - 1))
}

/// A registered buffer the hot loops share between work requests.
#[derive(Debug, Clone)]
pub enum Buf {
    /// Local-only: Send and RDMA Write sources, RDMA Read sources exposed to the peer.
    Ro(Arc<MemoryRegion>),
    /// Device- or peer-writable: RDMA Write targets, RDMA Read targets, receive buffers.
    Rw(Arc<RemoteMemoryRegion>),
}

impl Buf {
    /// The bytes `range` as a scatter/gather entry of a safe request.
    #[inline]
    pub fn local(&self, range: Range<usize>) -> ibverbs::Result<Local> {
        match self {
            Buf::Ro(m) => Local::new(m.clone(), range),
            Buf::Rw(m) => Local::new(m.clone(), range),
        }
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        match self {
            Buf::Ro(m) => m.addr() as u64,
            Buf::Rw(m) => m.addr() as u64,
        }
    }
    /// Length.
    pub fn len(&self) -> usize {
        match self {
            Buf::Ro(m) => m.len(),
            Buf::Rw(m) => m.len(),
        }
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        match self {
            Buf::Ro(m) => m.lkey(),
            Buf::Rw(m) => m.lkey(),
        }
    }
    /// The whole buffer for the peer.
    pub fn remote(&self) -> RemoteSlice {
        match self {
            Buf::Ro(m) => m.remote(),
            Buf::Rw(m) => m.remote(),
        }
    }
}

/// The verbs resources of one side.
#[derive(Debug)]
pub struct Rdma {
    /// The queue pairs (dropped first).
    pub qps: Vec<QueuePair>,
    /// Send completions of every queue pair.
    pub send_cq: CompletionQueue,
    /// Receive completions of every queue pair.
    pub recv_cq: CompletionQueue,
    /// The protection domain.
    pub pd: ProtectionDomain,
    /// The device.
    pub ctx: Context,
    /// How the queue pairs connect.
    pub opts: ConnectOptions,
    /// The port.
    pub port: PortAttr,
    /// The GID index in use (None: LID addressing).
    pub gid_index: Option<u32>,
    /// Inline bytes the queue pairs take.
    pub inline: u32,
    /// RDMA Reads in flight (initiator and responder).
    pub rd_atomic: u8,
    /// How the queue pairs are built.
    spec: QpSpec,
    /// With `-R`: the RDMA-CM id of each queue pair (the queue pairs are built on them when they
    /// connect, in [`Session::exchange`]).
    cm_ids: Vec<CmId>,
}

/// How [`Rdma`] builds its queue pairs.
#[derive(Debug, Clone, Copy)]
struct QpSpec {
    tx_depth: u32,
    rx_depth: u32,
    inline: u32,
    ex: bool,
    /// Connected with RDMA-CM (`-R`): built on ids in [`Session::exchange`].
    rdma_cm: bool,
}

/// The device side of a test, opened and checked before any peer is waited for.
#[derive(Debug)]
pub struct Device {
    ctx: Context,
    port_num: u8,
    port: PortAttr,
    gid_index: Option<u32>,
    rd_atomic: u8,
    /// ACK timeout: IBVERBS_TIMEOUT/NCCL_IB_TIMEOUT, default 14.
    timeout: u8,
    /// Retry count: IBVERBS_RETRY_CNT/NCCL_IB_RETRY_CNT, default 6 (rxe retries forever at 7:
    /// a vanished peer would never surface).
    retry_cnt: u8,
}

impl Device {
    /// Opens the device of `-d` and checks the port of `-i` (it must be active) and the GID
    /// index of `-x` (it must hold a GID). Without `-x`, an Ethernet port's RoCE v2 IPv4 GID,
    /// except with `-R` (RDMA-CM resolves the address itself); an iWARP device needs `-R`.
    fn open(kind: TestKind, a: &Args) -> Result<Device, String> {
        // Flags win; where absent, IBVERBS_*/NCCL_IB_* (device, port, GID index, timeout, retries).
        let target = selection::target(a.ib_dev.as_deref(), a.ib_port, a.gid_index)?;
        let (ctx, port_num) = (target.ctx, target.port);
        let port = device::active_port(&ctx, port_num)?;
        let dev = ctx.query_device().map_err(|e| format!("Couldn't query {}: {e}", ctx.name()))?;
        device::require_rdma_cm_on_iwarp(&ctx, a.rdma_cm)?;
        let gid_index = match target.gid_index {
            Some(i) => {
                device::check_gid_index(&ctx, port_num, i)?;
                Some(i)
            }
            // An iWARP port has no RoCE GID: its GID 0 (from its MAC address), for the header;
            // RDMA-CM addresses it by IP.
            None if ctx.is_iwarp() => device::check_gid_index(&ctx, port_num, 0).ok().map(|()| 0),
            None if port.link_layer() == LinkLayer::ETHERNET => match ctx.roce_v2_ipv4_gid_index(port_num) {
                Ok(i) => Some(i),
                // With -R the GID is only shown: RDMA-CM resolves the address itself.
                Err(_) if a.rdma_cm => None,
                Err(e) => {
                    return Err(format!(
                        "no RoCE v2 IPv4 GID on port {port_num} of {} (use -x): {e}",
                        ctx.name()
                    ))
                }
            },
            None => None,
        };
        let rd_atomic = if kind == TestKind::ReadBw {
            u8::try_from(dev.max_qp_rd_atom().min(dev.max_qp_init_rd_atom()).clamp(1, 255)).unwrap_or(16)
        } else {
            1
        };
        let timeout = target.connect.timeout;
        let retry_cnt = if target.retry_set { target.connect.retry_cnt } else { 6 };
        Ok(Device { ctx, port_num, port, gid_index, rd_atomic, timeout, retry_cnt })
    }

    /// The same device opened through librdmacm (`-R`): a queue pair created on an RDMA-CM id
    /// must use a protection domain and CQs of librdmacm's context of the device.
    fn on_cm_context(mut self) -> Result<Device, String> {
        let name = self.ctx.name().to_string();
        self.ctx = cm::devices()
            .map_err(|e| format!("RDMA-CM (librdmacm) devices: {e}"))?
            .into_iter()
            .find(|c| c.name() == name)
            .ok_or_else(|| format!("RDMA-CM (librdmacm) does not list {name}"))?;
        Ok(self)
    }
}

impl Rdma {
    /// Creates the protection domain, completion queues and queue pairs of test `kind` with
    /// parameters `p`.
    fn create(kind: TestKind, d: Device, p: &Params, ex: bool, rdma_cm: bool) -> Result<Rdma, String> {
        let Device { ctx, port_num, port, gid_index, rd_atomic, timeout, retry_cnt } = d;
        let opts = ConnectOptions {
            port: port_num,
            gid_index,
            mtu: Mtu::from_bytes(p.mtu),
            timeout,
            retry_cnt,
            max_rd_atomic: Some(rd_atomic),
            ..ConnectOptions::default()
        };
        let pd = ctx.alloc_pd().map_err(|e| format!("Couldn't allocate PD: {e}"))?;
        let rx_depth = if kind.uses_recv() { u64::from(p.rx_depth).min(p.iters) as u32 } else { 1 };
        let cq = |n: u32| {
            // The loops read only wr_id and status: no optional field, no accessor call per
            // completion for one (as a C program would ask for what it uses).
            if ex { ctx.create_cq_ex(n, None, WcFlags::empty()) } else { ctx.create_cq(n, None) }
                .map_err(|e| format!("Couldn't create a CQ of {n} entries: {e}"))
        };
        let send_cq = cq(p.qps * p.tx_depth)?;
        let recv_cq = cq(p.qps * rx_depth)?;
        let inline = if kind.is_bw() { 0 } else { p.inline };
        let spec = QpSpec { tx_depth: p.tx_depth, rx_depth, inline, ex, rdma_cm };
        let mut rdma = Rdma {
            qps: Vec::with_capacity(p.qps as usize),
            send_cq,
            recv_cq,
            pd,
            ctx,
            opts,
            port,
            gid_index,
            inline,
            rd_atomic,
            spec,
            cm_ids: Vec::new(),
        };
        if !rdma_cm {
            for _ in 0..p.qps {
                let qp = rdma.build_qp(None)?;
                rdma.add_qp(qp);
            }
        }
        Ok(rdma)
    }

    /// Builds one queue pair (on `id` with `-R`).
    fn build_qp(&self, id: Option<&CmId>) -> Result<QueuePair, String> {
        let b = self.qp_builder();
        match id {
            Some(id) => b.build_on(id),
            None => b.build(),
        }
        .map_err(|e| format!("Couldn't create QP: {e}"))
    }

    /// The queue pair this side builds: its CQs, depths, inline size and (`--ex`) send ops.
    fn qp_builder(&self) -> ibverbs::QueuePairBuilder<'_> {
        let s = self.spec;
        let mut b = self
            .pd
            .create_qp(&self.send_cq, QpType::RC)
            .recv_cq(&self.recv_cq)
            .max_send_wr(s.tx_depth)
            .max_recv_wr(s.rx_depth)
            .max_inline_data(s.inline);
        if s.ex {
            b = b.send_ops(SendOps::ALL_SAFE);
        }
        b
    }

    /// Adds a built queue pair; the first one tells the inline size the device grants.
    fn add_qp(&mut self, qp: QueuePair) {
        if self.qps.is_empty() {
            self.inline = qp.caps().max_inline_data;
        }
        self.qps.push(qp);
    }
}

/// Fails a hot loop that waits too long: no progress for `--timeout` seconds, the peer's end of
/// the TCP connection closed (it exited or crashed), or the peer silent for `--timeout` (no
/// `Alive` frame arrived: a dead host or a stopped process, even while the RDMA traffic, which
/// the peer's kernel or device handles alone, still flows). Checked every few dozen idle polls,
/// with the time-stamp counter, so it costs nothing measurable; the checks also send our own
/// `Alive` frames.
#[derive(Debug)]
pub struct Guard {
    fd: RawFd,
    /// Our `Alive` frames, sent by the checks.
    beat: oob::Beat,
    peer: &'static str,
    stall: u64,
    stall_secs: f64,
    check_every: u64,
    last_progress: u64,
    next_check: u64,
    spins: u32,
    /// When the bytes waiting on the socket last grew, and how many there were.
    heard: u64,
    pending: usize,
    what: &'static str,
}

impl Guard {
    /// Starts the clock: progress is due from now on.
    pub fn start(&mut self, what: &'static str) {
        let now = ticks();
        self.last_progress = now;
        self.heard = now;
        self.next_check = now.wrapping_add(self.check_every);
        self.what = what;
    }

    /// Something happened (a completion, a peer's write). Now and then (every 50 ms) also checks
    /// that the peer is still there: on a loopback device completions may never stop coming
    /// (the peer's kernel answers for a stopped peer), so [`idle`](Self::idle) alone may never
    /// get to check.
    #[inline(always)]
    pub fn progress(&mut self, now: u64) -> Result<(), String> {
        self.last_progress = now;
        if now < self.next_check {
            return Ok(());
        }
        self.check(now)
    }

    /// Nothing happened on this poll: fails when it has been so for too long, or the peer is gone.
    #[inline(always)]
    pub fn idle(&mut self) -> Result<(), String> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins % 32 != 0 {
            return Ok(());
        }
        let now = ticks();
        if now < self.next_check {
            return Ok(());
        }
        self.check(now)
    }

    /// Adds to an error message whether the peer is gone (waiting briefly: its RDMA resources may
    /// go down a moment before its TCP socket).
    #[cold]
    pub fn annotate(&self, msg: String) -> String {
        for _ in 0..10 {
            if oob::socket_closed(self.fd) {
                return format!("{msg}; the peer closed the connection (it exited?)");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        msg
    }

    #[cold]
    fn check(&mut self, now: u64) -> Result<(), String> {
        self.next_check = now.wrapping_add(self.check_every);
        self.beat.if_due();
        if oob::socket_closed(self.fd) {
            return Err(format!("the {} closed the connection while {}", self.peer, self.what));
        }
        let (alive, pending) = oob::take_alive_frames(self.fd);
        if alive > 0 || pending != self.pending {
            self.pending = pending;
            self.heard = now;
        }
        if now.wrapping_sub(self.heard) > self.stall {
            return Err(format!(
                "the {} sent nothing for {} s while {} (is it still running?)",
                self.peer,
                net::secs(Duration::from_secs_f64(self.stall_secs)),
                self.what
            ));
        }
        if now.wrapping_sub(self.last_progress) > self.stall {
            return Err(format!(
                "no progress for {:.0} s while {} (did the peer vanish?)",
                self.stall_secs, self.what
            ));
        }
        Ok(())
    }
}

/// One side of a test: parameters, clock, out-of-band connection, verbs resources.
#[derive(Debug)]
pub struct Session {
    /// The test.
    pub kind: TestKind,
    /// The agreed parameters.
    pub params: Params,
    /// Server or client.
    pub role: Role,
    /// Converts counter ticks to time.
    pub clock: Clock,
    /// The out-of-band connection.
    pub oob: Oob,
    /// Verbs resources (dropped before the buffers below).
    pub rdma: Rdma,
    /// Buffers used by raw-level requests: kept registered until the queue pairs are destroyed.
    keep: Vec<Buf>,
    plan: Vec<(u64, u64)>,
    next: usize,
    timeout: Duration,
    setup_timeout: Duration,
    /// The current measurement: (size, messages over all queue pairs).
    current: (u64, u64),
    header_printed: bool,
    no_peak: bool,
}

impl Session {
    fn start(kind: TestKind) -> Result<Session, String> {
        let matches = Args::command().name(kind.name()).about(kind.about()).get_matches();
        let args = Args::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        let secs = |s: f64, what: &str| match Duration::try_from_secs_f64(s) {
            Ok(d) if !d.is_zero() && d <= Duration::from_secs(net::MAX_WAIT_SECS) => Ok(d),
            _ => {
                Err(format!("{what} must be more than 0 and at most {} seconds, not {s}", net::MAX_WAIT_SECS))
            }
        };
        let timeout = secs(args.timeout, "--timeout")?;
        let setup_timeout = secs(args.setup_timeout, "--setup-timeout")?;
        let connect_timeout = secs(args.connect_timeout, "--connect-timeout")?;
        let accept_timeout = args.accept_timeout.map_or(Ok(timeout), |s| secs(s, "--accept-timeout"))?;
        // Everything that can be checked alone is, before waiting for a peer.
        let client_params = match args.host {
            Some(_) => Some(Params::from_args(kind, &args)?),
            None => None,
        };
        let device = Device::open(kind, &args)?;
        let device = if args.rdma_cm { device.on_cm_context()? } else { device };
        let clock = Clock::new();
        let (role, mut oob, params) = match (&args.host, client_params) {
            (Some(host), Some(params)) => {
                let mut oob = Oob::connect(host, args.port, connect_timeout, timeout)?;
                oob.set_reply_cap(setup_timeout);
                oob.send(Tag::Hello, &params.encode(kind))?;
                (Role::Client, oob, params)
            }
            _ => {
                let mut oob = Oob::accept(args.port, accept_timeout, timeout)?;
                oob.set_reply_cap(setup_timeout);
                let own_level = if args.safe {
                    Some(Level::Safe)
                } else if args.raw {
                    Some(Level::Raw)
                } else {
                    None
                };
                let hello = oob.recv_one(Tag::Hello, "the client's hello", Some(setup_timeout))?;
                match Params::decode(kind, &hello, own_level) {
                    Ok(p) => (Role::Server, oob, p),
                    Err(e) => {
                        let e = format!("refusing the client: {e}");
                        oob.fail(&e);
                        return Err(e);
                    }
                }
            }
        };
        oob.beat(); // the peer waits for our setup (see alloc_ro)
        let rdma = match Rdma::create(kind, device, &params, args.ex, args.rdma_cm) {
            Ok(r) => r,
            Err(e) => {
                oob.fail(&e);
                return Err(e);
            }
        };
        Ok(Session {
            kind,
            plan: params.plan(kind),
            params,
            role,
            clock,
            oob,
            rdma,
            keep: Vec::new(),
            next: 0,
            timeout,
            setup_timeout,
            current: (0, 0),
            header_printed: false,
            no_peak: args.no_peak,
        })
    }

    /// Whether the sender's report leaves out the peak bandwidth (`-N`).
    pub fn no_peak(&self) -> bool {
        self.no_peak
    }

    /// The out-of-band timeout (`--timeout`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A guard for a hot loop.
    pub fn guard(&self) -> Guard {
        Guard {
            fd: self.oob.raw_fd(),
            beat: self.oob.beat_for_guard(),
            peer: self.oob.peer(),
            stall: self.clock.ticks_in(self.timeout),
            stall_secs: self.timeout.as_secs_f64(),
            check_every: self.clock.ticks_in(Duration::from_millis(50)),
            last_progress: ticks(),
            next_check: 0,
            spins: 0,
            heard: ticks(),
            pending: usize::MAX,
            what: "waiting",
        }
    }

    /// Buffer length for the largest message: at least perftest's cycle buffer (a page).
    pub fn buf_len(&self) -> usize {
        self.params.size.max(CYCLE_BUFFER) as usize
    }

    /// Allocates and registers a local-only buffer (kept registered as long as the queue pairs).
    pub fn alloc_ro(&mut self, len: usize, access: AccessFlags) -> Result<Arc<MemoryRegion>, String> {
        memory::check(len as u64, "a buffer")?;
        // The peer may be waiting for our setup: alive before and after each long step.
        self.oob.beat();
        let buf = OwnedBuffer::zeroed(len)
            .map_err(|e| format!("Couldn't allocate a buffer of {len} bytes: {e}"))?;
        self.oob.beat();
        let mr =
            self.rdma.pd.register(buf, access).map_err(|e| format!("Couldn't register {len} bytes: {e}"))?;
        self.oob.beat();
        let mr = Arc::new(mr);
        self.keep.push(Buf::Ro(mr.clone()));
        Ok(mr)
    }

    /// Allocates and registers a device- or peer-writable buffer (kept registered as long as the
    /// queue pairs).
    pub fn alloc_rw(&mut self, len: usize, access: AccessFlags) -> Result<Arc<RemoteMemoryRegion>, String> {
        memory::check(len as u64, "a buffer")?;
        self.oob.beat(); // as in alloc_ro
        let mr = self.rdma.pd.allocate_remote(len, access);
        self.oob.beat();
        let mr =
            Arc::new(mr.map_err(|e| format!("Couldn't allocate and register a buffer of {len} bytes: {e}"))?);
        self.keep.push(Buf::Rw(mr.clone()));
        Ok(mr)
    }

    /// How many bytes each of the peer's buffers must have, for the tests where this side
    /// accesses them (`None`: the peer exposes none).
    fn peer_buffer_need(&self) -> Option<u64> {
        match (self.kind, self.role) {
            (TestKind::WriteBw | TestKind::ReadBw, Role::Client) | (TestKind::WriteLat, _) => {
                Some(self.buf_len() as u64)
            }
            _ => None,
        }
    }

    /// Exchanges endpoints and buffer descriptors (one per queue pair; `local` may hold empty
    /// slices where the peer needs none), connects the queue pairs and prints the header. Returns
    /// the peer's buffer descriptors. The peer's setup may take up to `--setup-timeout` (it may
    /// register large buffers), as long as it stays alive.
    pub fn exchange(&mut self, local: &[RemoteSlice]) -> Result<Vec<RemoteSlice>, String> {
        let n = self.params.qps as usize;
        if local.len() != n {
            return Err(format!("{} buffer descriptors for {n} queue pairs", local.len()));
        }
        self.cm_connect()?;
        let mut entries = Vec::with_capacity(n);
        for (qp, slice) in self.rdma.qps.iter().zip(local) {
            let ep = if self.rdma.spec.rdma_cm {
                // Connected already: the endpoint is for the header only (and iWARP devices,
                // which connect through RDMA-CM alone, have no endpoint to give).
                let r = &self.rdma;
                let gid = r.gid_index.and_then(|i| r.ctx.query_gid(r.opts.port, i).ok());
                Endpoint {
                    qpn: qp.qp_num(),
                    psn: 0,
                    lid: 0,
                    gid: gid.map_or(ibverbs::Gid([0; 16]), |e| e.gid),
                    mtu: self.rdma.port.active_mtu(),
                }
            } else {
                qp.endpoint(&self.rdma.opts).map_err(|e| format!("Couldn't get the local address: {e}"))?
            };
            entries.push((ep, *slice));
        }
        let mine = proto::encode_setup(&entries);
        let what = format!("the {}'s setup", self.oob.peer());
        let cap = Some(self.setup_timeout);
        let theirs = match self.role {
            Role::Server => {
                self.oob.send(Tag::Setup, &mine)?;
                self.oob.recv_one(Tag::Setup, &what, cap)?
            }
            Role::Client => {
                // A CmPort instead: the server uses -R and this client does not.
                let (tag, t) = self.oob.recv(&[Tag::Setup, Tag::CmPort], &what, cap)?;
                if tag != Tag::Setup {
                    return Err("the server uses RDMA-CM (-R): run both sides with -R, or neither".into());
                }
                self.oob.send(Tag::Setup, &mine)?;
                t
            }
        };
        let remote = proto::decode_setup(&theirs, n, self.peer_buffer_need())
            .map_err(|e| format!("protocol error in {what}: {e}"))?;
        if !self.rdma.spec.rdma_cm {
            for (qp, (ep, _)) in self.rdma.qps.iter_mut().zip(&remote) {
                qp.connect(ep, &self.rdma.opts)
                    .map_err(|e| format!("Couldn't connect to the remote QP: {e}"))?;
            }
        }
        let eps: Vec<Endpoint> = entries.iter().map(|e| e.0).collect();
        let (remote_eps, slices): (Vec<Endpoint>, Vec<RemoteSlice>) = remote.into_iter().unzip();
        self.print_header(&eps, local, &remote_eps, &slices);
        Ok(slices)
    }

    /// With `-R`: builds and connects the queue pairs through RDMA-CM. The server listens on a
    /// port of its choosing and sends it (`CmPort`); the client connects one id per queue pair to
    /// that port at the server's address. Every wait is bounded by `--setup-timeout`.
    fn cm_connect(&mut self) -> Result<(), String> {
        let t = self.setup_timeout;
        if !self.rdma.spec.rdma_cm {
            return Ok(());
        }
        let n = self.params.qps as usize;
        let rd = self.rdma.rd_atomic;
        let param = ConnParam {
            responder_resources: rd,
            initiator_depth: rd,
            retry_count: self.rdma.opts.retry_cnt.min(7),
            rnr_retry_count: self.rdma.opts.rnr_retry.min(7),
            ..ConnParam::default()
        };
        match self.role {
            Role::Server => {
                let l = cm::Listener::bind(SocketAddr::from(([0, 0, 0, 0], 0)))
                    .map_err(|e| format!("RDMA-CM: cannot listen: {e}"))?;
                let port = l.local_addr().map(|a| a.port()).ok_or("RDMA-CM: the listener has no port")?;
                self.oob.send(Tag::CmPort, &port.to_be_bytes())?;
                let deadline = std::time::Instant::now() + t;
                for _ in 0..n {
                    // Waited for in slices: a client that fails meanwhile (e.g. it does not use
                    // -R) says so over the out-of-band connection, or closes it.
                    let id = loop {
                        match l.request(Duration::from_millis(200)) {
                            Ok((id, _)) => break id,
                            Err(ibverbs::Error::Timeout { .. }) if std::time::Instant::now() < deadline => {
                                let fd = self.oob.raw_fd();
                                if oob::take_alive_frames(fd).1 > 0 {
                                    // Not a heartbeat: the client's error (or a protocol error).
                                    self.oob.recv(&[], "the client's RDMA-CM connection", Some(t))?;
                                    return Err("the client sent a frame instead of connecting".into());
                                }
                                if oob::socket_closed(fd) {
                                    return Err("the client left before connecting with RDMA-CM".into());
                                }
                            }
                            Err(e) => {
                                return Err(format!("RDMA-CM: no connection request from the client: {e}"))
                            }
                        }
                    };
                    let mut qp = match self.rdma.build_qp(Some(&id)) {
                        Ok(qp) => qp,
                        Err(e) => {
                            let _ = id.reject(&[]);
                            return Err(e);
                        }
                    };
                    cm::accept_request(&id, &mut qp, &param, t)
                        .map_err(|e| format!("RDMA-CM: accept: {e}"))?;
                    self.rdma.add_qp(qp);
                    self.rdma.cm_ids.push(id);
                }
            }
            Role::Client => {
                let what = "the server's RDMA-CM port";
                let (tag, b) = self.oob.recv(&[Tag::CmPort, Tag::Setup], what, Some(t))?;
                if tag != Tag::CmPort {
                    return Err("the server does not use RDMA-CM: run both sides with -R, or neither".into());
                }
                let addr = SocketAddr::new(self.oob.peer_ip()?, u16::from_be_bytes([b[0], b[1]]));
                for _ in 0..n {
                    // One bound for the resolve and the connection, each `t` before; another
                    // id when siw's rdma_connect meets a port that a native TCP socket holds
                    // (this program's out-of-band connection, or one left in TIME_WAIT).
                    let (id, qp) = cm::connect_with(addr, &param, t.saturating_mul(2), |id| {
                        self.rdma.qp_builder().build_on(id)
                    })
                    .map_err(|e| format!("RDMA-CM: connecting to {addr}: {e}"))?;
                    self.rdma.add_qp(qp);
                    self.rdma.cm_ids.push(id);
                }
            }
        }
        Ok(())
    }

    fn print_header(
        &mut self,
        eps: &[Endpoint],
        local: &[RemoteSlice],
        reps: &[Endpoint],
        rs: &[RemoteSlice],
    ) {
        let p = &self.params;
        let r = &self.rdma;
        // The path MTU `connect` chose: the smaller active MTU, capped by -m.
        let active = r.port.active_mtu();
        let path = reps.first().map_or(active, |e| active.min(e.mtu));
        let mtu = r.opts.mtu.map_or(path, |o| path.min(o)).bytes().unwrap_or(0);
        let mut h = String::new();
        let _ = writeln!(h, "{RESULT_LINE}");
        let _ = writeln!(h, "                    {}", self.kind.title());
        let _ = writeln!(h, " Dual-port       : OFF\t\tDevice         : {}", r.ctx.name());
        let _ = writeln!(h, " Number of qps   : {}\t\tTransport type : IB", p.qps);
        let _ = writeln!(h, " Connection type : RC\t\tUsing SRQ      : OFF");
        if self.role == Role::Client || !self.kind.is_bw() {
            let _ = writeln!(h, " TX depth        : {}", u64::from(p.tx_depth).min(p.iters));
        }
        if self.kind.uses_recv() {
            let _ = writeln!(h, " RX depth        : {}", u64::from(p.rx_depth).min(p.iters));
        }
        let first = self.plan.first().map_or(p.size, |x| x.0);
        let _ = writeln!(
            h,
            " CQ Moderation   : {}",
            p.cq_mod_for(first, u64::from(p.tx_depth).min(p.iters) as u32)
        );
        let _ = writeln!(h, " Mtu             : {mtu}[B]");
        let _ = writeln!(h, " Link type       : {}", r.port.link_layer().as_str());
        if let Some(i) = r.gid_index {
            let _ = writeln!(h, " GID index       : {i}");
        }
        let _ = writeln!(
            h,
            " Max inline data : {}[B]",
            if self.kind.is_bw() { 0 } else { p.inline.min(r.inline) }
        );
        if self.kind == TestKind::ReadBw {
            let _ = writeln!(h, " Outstand reads  : {}", r.rd_atomic);
        }
        let _ = writeln!(h, " Post level      : {}", p.level.describe());
        let _ = writeln!(h, " Data ex. method : Ethernet");
        let _ = writeln!(h, "{RESULT_LINE}");
        let addr = |h: &mut String, which: &str, e: &Endpoint, s: &RemoteSlice| {
            let _ = write!(h, " {which} address: LID {:04x} QPN {:#06x} PSN {:#08x}", e.lid, e.qpn, e.psn);
            if s.len > 0 {
                let _ = write!(h, " RKey {:#08x} VAddr {:#016x}", s.rkey, s.addr);
            }
            let gid: Vec<String> = e.gid.0.iter().map(|b| format!("{b:02}")).collect();
            let _ = writeln!(h, "\n GID: {}", gid.join(":"));
        };
        for (e, s) in eps.iter().zip(local) {
            addr(&mut h, "local", e, s);
        }
        for (e, s) in reps.iter().zip(rs) {
            addr(&mut h, "remote", e, s);
        }
        let _ = writeln!(h, "{RESULT_LINE}");
        let _ = write!(h, "{}", if self.kind.is_bw() { BW_HEADER } else { LAT_HEADER });
        println!("{h}");
        self.header_printed = true;
    }

    /// The next measurement, or `None` when the client is done (the final sync has happened).
    pub fn next_run(&mut self) -> Result<Option<RunSpec>, String> {
        let (size, iters) = match self.role {
            Role::Client => {
                let Some(&(size, iters)) = self.plan.get(self.next) else {
                    self.oob.send(Tag::End, &[])?;
                    self.oob.recv_one(
                        Tag::Ack,
                        "the server's final acknowledgement",
                        self.oob.reply_cap(),
                    )?;
                    return Ok(None);
                };
                self.next += 1;
                self.oob.send(Tag::Run, &proto::encode_run(size, iters))?;
                (size, iters)
            }
            Role::Server => {
                let what = "the client's next measurement (or its end)";
                let (tag, b) = self.oob.recv(&[Tag::Run, Tag::End], what, self.oob.reply_cap())?;
                if tag == Tag::End {
                    self.oob.send(Tag::Ack, &[])?;
                    return Ok(None);
                }
                // The client runs the plan both sides derive from the parameters, in order.
                let run = proto::decode_run(&b).map_err(|e| format!("protocol error: {e}"))?;
                let expected = self.plan.get(self.next).copied();
                if Some(run) != expected {
                    return Err(format!(
                        "protocol error: the client asks for {} x {} bytes, the plan says {}",
                        run.1,
                        run.0,
                        expected.map_or("nothing more".to_string(), |(s, i)| format!("{i} x {s} bytes"))
                    ));
                }
                self.next += 1;
                run
            }
        };
        let p = &self.params;
        let tx_depth = u64::from(p.tx_depth).min(iters);
        self.current = (size, iters * u64::from(p.qps));
        Ok(Some(RunSpec {
            size,
            iters,
            qps: p.qps as usize,
            tx_depth,
            rx_depth: u64::from(p.rx_depth).min(iters),
            cq_mod: u64::from(p.cq_mod_for(size, tx_depth as u32)),
            post_list: u64::from(p.post_list),
            inline: p.inline.min(self.rdma.inline),
            level: p.level,
        }))
    }

    /// Synchronizes the start of a measurement: the server says it is ready, the client waits
    /// for that.
    pub fn ready(&mut self) -> Result<(), String> {
        ready(self.role, &mut self.oob)
    }

    /// Ends a measurement: the client sends its report and waits for the server's
    /// acknowledgement (with the server's report); the server waits for the client (as long as
    /// the client's run takes, but no longer than `--timeout` once the client falls silent).
    /// Returns the peer's report, if it sent one.
    pub fn finish(&mut self, mine: Option<&BwReport>) -> Result<Option<BwReport>, String> {
        let payload = mine.map(BwReport::encode).unwrap_or_default();
        let theirs = match self.role {
            Role::Client => {
                self.oob.send(Tag::Done, &payload)?;
                self.oob.recv_one(
                    Tag::Ack,
                    "the server's acknowledgement of the measurement",
                    self.oob.reply_cap(),
                )?
            }
            Role::Server => {
                let t = self.oob.recv_one(Tag::Done, "the end of the client's measurement", None)?;
                self.oob.send(Tag::Ack, &payload)?;
                t
            }
        };
        if theirs.is_empty() {
            return Ok(None);
        }
        let r = BwReport::decode(&theirs).map_err(|e| format!("protocol error: {e}"))?;
        if (r.size, r.iters) != self.current {
            return Err(format!(
                "protocol error: the {}'s report is for {} x {} bytes, the measurement was {} x {} bytes",
                self.oob.peer(),
                r.iters,
                r.size,
                self.current.1,
                self.current.0
            ));
        }
        Ok(Some(r))
    }

    /// Prints a bandwidth row.
    pub fn print_bw(&self, r: &BwReport) {
        println!("{}", r.row());
    }

    /// Prints a latency row.
    pub fn print_lat(&self, r: &LatReport) {
        println!("{}", r.row());
    }
}

/// [`Session::ready`] on the parts of a session (for callers that borrow its verbs resources
/// meanwhile).
pub fn ready(role: Role, oob: &mut Oob) -> Result<(), String> {
    match role {
        Role::Server => oob.send(Tag::Ready, &[]),
        Role::Client => {
            let cap = oob.reply_cap();
            oob.recv_one(Tag::Ready, "the server to be ready", cap).map(drop)
        }
    }
}

/// Runs a test: sets up the session, runs `body`, reports errors (to stderr and to the peer) and
/// turns them into a non-zero exit status.
pub fn main(kind: TestKind, body: fn(&mut Session) -> Result<(), String>) -> ExitCode {
    let mut s = match Session::start(kind) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{}: {e}", kind.name());
            return ExitCode::FAILURE;
        }
    };
    match body(&mut s) {
        Ok(()) => {
            if s.header_printed {
                println!("{RESULT_LINE}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}: {e}", kind.name());
            s.oob.fail(&e);
            ExitCode::FAILURE
        }
    }
}
