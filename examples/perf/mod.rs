//! What the perftest-style examples share: command line, out-of-band protocol, verbs resources,
//! the bounded-wait guard, and the bandwidth loops.
//!
//! # Protocol
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
//! Every wait is bounded: the connect (`--connect-timeout`), every frame the client waits for,
//! and every completion or memory poll (`--timeout` without progress); polling loops also notice
//! at once when the peer's end of the TCP connection closes (a vanished peer), and exit non-zero
//! with a message instead of hanging.
#![allow(dead_code)] // each example uses part of this module

pub mod bw;
pub mod clock;
pub mod oob;
pub mod proto;
pub mod report;

use std::fmt::Write as _;
use std::ops::Range;
use std::os::fd::RawFd;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser};
use ibverbs::{
    AccessFlags, CompletionQueue, ConnectOptions, Context, Endpoint, LinkLayer, Local, MemoryRegion, Mtu,
    OwnedBuffer, PortAttr, ProtectionDomain, QpType, QueuePair, RemoteMemoryRegion, RemoteSlice,
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
    /// RDMA device (default: the first one).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    pub ib_dev: Option<String>,
    /// Port of the device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1, value_name = "PORT")]
    pub ib_port: u8,
    /// GID index (default: the RoCE v2 IPv4 GID on Ethernet ports, LID addressing on InfiniBand).
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
    /// Send messages of at most this many bytes inline (latency tests) [default: 0, as perftest
    /// on SoftRoCE].
    #[arg(short = 'I', long = "inline-size", value_name = "BYTES")]
    pub inline_size: Option<u32>,
    /// Path MTU in bytes (256..4096) [default: the port's active MTU].
    #[arg(short = 'm', long, value_name = "BYTES")]
    pub mtu: Option<u32>,
    /// Hot loop at the safe level: checked posts whose requests carry the buffers, handed back
    /// by the completions.
    #[arg(long, conflicts_with = "raw")]
    pub safe: bool,
    /// Hot loop at the raw level: unsafe post_*_unchecked with prebuilt work requests +
    /// poll_raw (the default: the faster one).
    #[arg(long)]
    pub raw: bool,
    /// Seconds without progress (no completion, no peer write) before giving up.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    pub timeout: f64,
    /// Seconds the client retries connecting to the server.
    #[arg(long = "connect-timeout", default_value_t = 10.0, value_name = "SECS")]
    pub connect_timeout: f64,
    /// Seconds the server waits for a client (default: forever).
    #[arg(long = "accept-timeout", value_name = "SECS")]
    pub accept_timeout: Option<f64>,
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
}

impl Rdma {
    fn open(kind: TestKind, a: &Args, p: &Params) -> Result<Rdma, String> {
        let ctx = Context::open(a.ib_dev.as_deref()).map_err(|e| e.to_string())?;
        let port = ctx.query_port(a.ib_port).map_err(|e| e.to_string())?;
        let dev = ctx.query_device().map_err(|e| e.to_string())?;
        let gid_index = match a.gid_index {
            Some(i) => Some(i),
            None if port.link_layer() == LinkLayer::ETHERNET => {
                Some(ctx.roce_v2_ipv4_gid_index(a.ib_port).map_err(|e| e.to_string())?)
            }
            None => None,
        };
        let rd_atomic = if kind == TestKind::ReadBw {
            u8::try_from(dev.max_qp_rd_atom().min(dev.max_qp_init_rd_atom()).clamp(1, 255)).unwrap_or(16)
        } else {
            1
        };
        let opts = ConnectOptions {
            port: a.ib_port,
            gid_index,
            mtu: Mtu::from_bytes(p.mtu),
            retry_cnt: 6, // rxe retries forever at 7: a vanished peer would never surface
            max_rd_atomic: Some(rd_atomic),
            ..ConnectOptions::default()
        };
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        let rx_depth = if kind.uses_recv() { u64::from(p.rx_depth).min(p.iters) as u32 } else { 1 };
        let send_cq = ctx.create_cq(p.qps * p.tx_depth, None).map_err(|e| e.to_string())?;
        let recv_cq = ctx.create_cq(p.qps * rx_depth, None).map_err(|e| e.to_string())?;
        let inline = if kind.is_bw() { 0 } else { p.inline };
        let mut qps = Vec::with_capacity(p.qps as usize);
        for _ in 0..p.qps {
            let qp = pd
                .create_qp(&send_cq, QpType::RC)
                .recv_cq(&recv_cq)
                .max_send_wr(p.tx_depth)
                .max_recv_wr(rx_depth)
                .max_inline_data(inline)
                .build()
                .map_err(|e| e.to_string())?;
            qps.push(qp);
        }
        let inline = qps.first().map_or(0, |q| q.caps().max_inline_data);
        Ok(Rdma { qps, send_cq, recv_cq, pd, ctx, opts, port, gid_index, inline, rd_atomic })
    }
}

/// Fails a hot loop that waits too long: no progress for `--timeout` seconds, or the peer's end of
/// the TCP connection closed (it exited or crashed). Checked every few dozen idle polls, with the
/// time-stamp counter, so it costs nothing measurable.
#[derive(Debug)]
pub struct Guard {
    fd: RawFd,
    stall: u64,
    stall_secs: f64,
    check_every: u64,
    last_progress: u64,
    next_check: u64,
    spins: u32,
    what: &'static str,
}

impl Guard {
    /// Starts the clock: progress is due from now on.
    pub fn start(&mut self, what: &'static str) {
        let now = ticks();
        self.last_progress = now;
        self.next_check = now.wrapping_add(self.check_every);
        self.what = what;
    }

    /// Something happened (a completion, a peer's write).
    #[inline(always)]
    pub fn progress(&mut self, now: u64) {
        self.last_progress = now;
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
        if oob::socket_closed(self.fd) {
            return Err(format!("the peer closed the connection while {}", self.what));
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
    header_printed: bool,
}

impl Session {
    fn start(kind: TestKind) -> Result<Session, String> {
        let matches = Args::command().name(kind.name()).about(kind.about()).get_matches();
        let args = Args::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        let secs = |s: f64, what: &str| {
            Duration::try_from_secs_f64(s).map_err(|_| format!("bad {what} {s}")).and_then(|d| {
                if d.is_zero() {
                    Err(format!("{what} must be positive"))
                } else {
                    Ok(d)
                }
            })
        };
        let timeout = secs(args.timeout, "--timeout")?;
        let clock = Clock::new();
        let (role, oob, params) = match &args.host {
            Some(host) => {
                let params = Params::from_args(kind, &args)?;
                let mut oob =
                    Oob::connect(host, args.port, secs(args.connect_timeout, "--connect-timeout")?)?;
                oob.send(Tag::Hello, &params.encode(kind))?;
                (Role::Client, oob, params)
            }
            None => {
                let wait = args.accept_timeout.map(|s| secs(s, "--accept-timeout")).transpose()?;
                println!("\n************************************");
                println!("* Waiting for client to connect... *");
                println!("************************************");
                let mut oob = Oob::accept(args.port, wait)?;
                let own_level = if args.safe {
                    Some(Level::Safe)
                } else if args.raw {
                    Some(Level::Raw)
                } else {
                    None
                };
                let hello = oob.recv(Tag::Hello, Some(timeout))?;
                match Params::decode(kind, &hello, own_level) {
                    Ok(p) => (Role::Server, oob, p),
                    Err(e) => {
                        oob.fail(&e);
                        return Err(e);
                    }
                }
            }
        };
        let mut oob = oob;
        let rdma = match Rdma::open(kind, &args, &params) {
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
            header_printed: false,
        })
    }

    /// The out-of-band timeout (`--timeout`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A guard for a hot loop.
    pub fn guard(&self) -> Guard {
        Guard {
            fd: self.oob.raw_fd(),
            stall: self.clock.ticks_in(self.timeout),
            stall_secs: self.timeout.as_secs_f64(),
            check_every: self.clock.ticks_in(Duration::from_millis(50)),
            last_progress: ticks(),
            next_check: 0,
            spins: 0,
            what: "waiting",
        }
    }

    /// Buffer length for the largest message: at least perftest's cycle buffer (a page).
    pub fn buf_len(&self) -> usize {
        self.params.size.max(CYCLE_BUFFER) as usize
    }

    /// Allocates and registers a local-only buffer (kept registered as long as the queue pairs).
    pub fn alloc_ro(&mut self, len: usize, access: AccessFlags) -> Result<Arc<MemoryRegion>, String> {
        let buf = OwnedBuffer::zeroed(len).map_err(|e| e.to_string())?;
        let mr = Arc::new(self.rdma.pd.register(buf, access).map_err(|e| e.to_string())?);
        self.keep.push(Buf::Ro(mr.clone()));
        Ok(mr)
    }

    /// Allocates and registers a device- or peer-writable buffer (kept registered as long as the
    /// queue pairs).
    pub fn alloc_rw(&mut self, len: usize, access: AccessFlags) -> Result<Arc<RemoteMemoryRegion>, String> {
        let mr = Arc::new(self.rdma.pd.allocate_remote(len, access).map_err(|e| e.to_string())?);
        self.keep.push(Buf::Rw(mr.clone()));
        Ok(mr)
    }

    /// Exchanges endpoints and buffer descriptors (one per queue pair; `local` may hold empty
    /// slices where the peer needs none), connects the queue pairs and prints the header. Returns
    /// the peer's buffer descriptors.
    pub fn exchange(&mut self, local: &[RemoteSlice]) -> Result<Vec<RemoteSlice>, String> {
        let n = self.rdma.qps.len();
        assert_eq!(local.len(), n, "one buffer descriptor per queue pair");
        let mut mine = Vec::with_capacity(n * 50);
        let mut eps = Vec::with_capacity(n);
        for (qp, slice) in self.rdma.qps.iter().zip(local) {
            let ep = qp.endpoint(&self.rdma.opts).map_err(|e| e.to_string())?;
            mine.extend_from_slice(&ep.encode());
            mine.extend_from_slice(&slice.encode());
            eps.push(ep);
        }
        let theirs = match self.role {
            Role::Server => {
                self.oob.send(Tag::Setup, &mine)?;
                self.oob.recv(Tag::Setup, Some(self.timeout))?
            }
            Role::Client => {
                let t = self.oob.recv(Tag::Setup, Some(self.timeout))?;
                self.oob.send(Tag::Setup, &mine)?;
                t
            }
        };
        if theirs.len() != n * 50 {
            return Err(format!("protocol error: setup of {} bytes for {n} queue pairs", theirs.len()));
        }
        let mut remote_eps = Vec::with_capacity(n);
        let mut slices = Vec::with_capacity(n);
        for chunk in theirs.chunks_exact(50) {
            remote_eps.push(Endpoint::decode(&chunk[..30]).map_err(|e| e.to_string())?);
            slices.push(RemoteSlice::decode(&chunk[30..]).map_err(|e| e.to_string())?);
        }
        for (qp, ep) in self.rdma.qps.iter_mut().zip(&remote_eps) {
            qp.connect(ep, &self.rdma.opts).map_err(|e| e.to_string())?;
        }
        self.print_header(&eps, local, &remote_eps, &slices);
        Ok(slices)
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
                    self.oob.recv(Tag::Ack, Some(self.timeout))?;
                    return Ok(None);
                };
                self.next += 1;
                let mut b = size.to_be_bytes().to_vec();
                b.extend_from_slice(&iters.to_be_bytes());
                self.oob.send(Tag::Run, &b)?;
                (size, iters)
            }
            Role::Server => {
                let (tag, b) = self.oob.recv_either(Tag::Run, Tag::End)?;
                if tag == Tag::End {
                    self.oob.send(Tag::Ack, &[])?;
                    return Ok(None);
                }
                if b.len() != 16 {
                    return Err("protocol error: bad run frame".into());
                }
                let size = u64::from_be_bytes(b[..8].try_into().unwrap_or_default());
                let iters = u64::from_be_bytes(b[8..].try_into().unwrap_or_default());
                if size == 0 || size > self.params.size || iters == 0 || iters > self.params.iters {
                    return Err(format!("protocol error: run of {iters} x {size} bytes out of range"));
                }
                (size, iters)
            }
        };
        let p = &self.params;
        let tx_depth = u64::from(p.tx_depth).min(iters);
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
        ready(self.role, &mut self.oob, self.timeout)
    }

    /// Ends a measurement: the client sends its report and waits for the server's
    /// acknowledgement (with the server's report); the server waits for the client (no time
    /// limit: a passive server does not know how long the test takes, but notices the client's
    /// exit). Returns the peer's report, if it sent one.
    pub fn finish(&mut self, mine: Option<&BwReport>) -> Result<Option<BwReport>, String> {
        let payload = mine.map(BwReport::encode).unwrap_or_default();
        let theirs = match self.role {
            Role::Client => {
                self.oob.send(Tag::Done, &payload)?;
                self.oob.recv(Tag::Ack, Some(self.timeout))?
            }
            Role::Server => {
                let t = self.oob.recv(Tag::Done, None)?;
                self.oob.send(Tag::Ack, &payload)?;
                t
            }
        };
        if theirs.is_empty() {
            Ok(None)
        } else {
            BwReport::decode(&theirs).map(Some)
        }
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
pub fn ready(role: Role, oob: &mut Oob, timeout: Duration) -> Result<(), String> {
    match role {
        Role::Server => oob.send(Tag::Ready, &[]),
        Role::Client => oob.recv(Tag::Ready, Some(timeout)).map(drop),
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
