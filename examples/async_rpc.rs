//! Request/response over RC Send/Recv with the async adaptor (`ibverbs::aio`) on tokio.
//!
//! Server: `async_rpc -d rxe0 -g 1`; client: `async_rpc -d rxe0 -g 1 SERVER`. The client keeps
//! `--concurrency` requests in flight (one task each), the server answers each from a task per
//! posted receive; both sides complete their operations through one [`Driver`] per side, with the
//! library's default wait (`WaitPolicy::ADAPTIVE`: busy polling for a bounded while, then the
//! completion channel; `--adaptive-us` sets the spin), woken by the completion channel only
//! (`--events`) or busy polling (`--busy-poll`). The client
//! prints requests per second and latency percentiles; both print their CPU time. Each side
//! registers its message buffers once, as one region carved into owned chunks
//! (`MemoryRegion::into_chunks`): a receive or send takes a chunk, its completion hands it back
//! (`Completion::take_chunk`), and no buffer is allocated or registered while requests run.
//!
//! `--sync` makes the client the synchronous safe level instead (one thread busy-polling the CQ,
//! the same messages): run against the same server, it is the baseline the async client is
//! compared with across two hosts.
//!
//! The queue pairs' addresses (and the run's parameters) are exchanged over TCP (`--port`). With
//! `-R` the queue pairs connect through RDMA-CM instead (the one way on iWARP): the server
//! listens on an RDMA-CM port it sends in that exchange, and the client connects to it at the
//! server's address (SERVER must then be an IP address of the server's RDMA port). Every wait is
//! bounded by `--timeout`; any failure is one line on stderr and a non-zero exit.
//!
//! `--bench` runs, in one process over one device (two queue pairs connected to each other, no
//! TCP), the same request/response load through the synchronous safe level (busy polling
//! `CompletionQueue::poll`) and through the async adaptor (events, busy polling, then the
//! adaptive wait), and prints requests per second, latency and CPU seconds per million messages of
//! each, with ratios.

#[path = "common/mod.rs"]
mod common;

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use ibverbs::aio::{AsyncQueuePair, Driver, WaitPolicy};
use ibverbs::cm::{self, CmId, ConnParam, Listener};
use ibverbs::{
    Chunk, Completion, CompletionQueue, ConnectOptions, Context, Endpoint, Gid, Local, Mtu, ProtectionDomain,
    QpCaps, QpType, QueuePair, RecvRequest, SendRequest,
};

#[derive(Parser, Debug, Clone)]
#[command(name = "async_rpc", about = "RC Send/Recv request/response on tokio with ibverbs::aio")]
struct Args {
    /// The server to connect to (client); none: be the server.
    server: Option<String>,
    /// TCP port of the address exchange.
    #[arg(short = 'p', long, default_value_t = 18530)]
    port: u16,
    /// RDMA device (default: the first).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    device: Option<String>,
    /// GID index (rxe: 1, the IPv4-mapped RoCE v2 GID).
    #[arg(short = 'g', long = "gid-idx", default_value_t = 1)]
    gid_index: u32,
    /// Requests the client sends in all.
    #[arg(short = 'n', long, default_value_t = 10_000)]
    requests: u64,
    /// Requests in flight at once.
    #[arg(short = 'c', long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=256))]
    concurrency: u32,
    /// Request and response size in bytes (at least 16).
    #[arg(short = 's', long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(16..=1 << 20))]
    size: u32,
    /// Wait for completions on the completion channel only (no spin).
    #[arg(long, conflicts_with_all = ["busy_poll", "adaptive_us"])]
    events: bool,
    /// Busy-poll the completion queue instead.
    #[arg(long, conflicts_with = "adaptive_us")]
    busy_poll: bool,
    /// Client: the synchronous safe level instead of the async adaptor (one thread
    /// busy-polling `CompletionQueue::poll`, the same messages), to compare with across hosts.
    #[arg(long, conflicts_with_all = ["events", "busy_poll", "adaptive_us", "bench"], requires = "server")]
    sync: bool,
    /// The adaptive wait's spin in microseconds (busy poll that long after the CQ ran dry, then
    /// sleep on the channel); without --events or --busy-poll the adaptive wait is used, with
    /// this spin or the library's default (WaitPolicy::DEFAULT_SPIN). --bench: the spin of its
    /// "async adaptive" run.
    #[arg(long, value_name = "US", value_parser = clap::value_parser!(u64).range(1..=10_000))]
    adaptive_us: Option<u64>,
    /// Seconds any one wait may take (the server's wait for a client, each exchange, each
    /// request), and the whole run at most ten times that.
    #[arg(long, default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=common::net::MAX_WAIT_SECS))]
    timeout: u64,
    /// The in-process comparison of the synchronous safe level and the async adaptor.
    #[arg(long)]
    bench: bool,
    /// --bench: run only these paths (comma-separated: sync, events, busy, adaptive, pingpong),
    /// e.g. to profile one; the ratios are printed for the pairs that ran.
    #[arg(long, value_name = "PATHS", value_delimiter = ',', requires = "bench")]
    only: Vec<String>,
    /// Connect the queue pairs through RDMA-CM (as perftest's -R), the one way on iWARP: the
    /// server listens on an RDMA-CM port it sends in the TCP exchange, and the client connects to
    /// it at SERVER, which must then be an IP address of the server's RDMA port. Both sides must
    /// use it.
    #[arg(short = 'R', long = "rdma-cm", conflicts_with = "bench")]
    rdma_cm: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let r = if args.bench { bench(&args) } else { run(&args) };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("async_rpc: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Process CPU time (user + system).
fn cpu_time() -> Duration {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The drivers' wait policy from `--events`, `--busy-poll` and `--adaptive-us`.
fn wait_policy(args: &Args) -> WaitPolicy {
    if args.events {
        WaitPolicy::Events
    } else if args.busy_poll {
        WaitPolicy::BusyPoll
    } else {
        adaptive(args)
    }
}

/// The adaptive wait with `--adaptive-us`, or the library's default spin.
fn adaptive(args: &Args) -> WaitPolicy {
    args.adaptive_us.map_or(WaitPolicy::ADAPTIVE, |us| WaitPolicy::adaptive(Duration::from_micros(us)))
}

fn connect_options(args: &Args) -> ConnectOptions {
    // A finite retry count: rxe treats 7 as "retry forever", which would hang on a dead peer.
    ConnectOptions { gid_index: Some(args.gid_index), retry_cnt: 6, timeout: 14, ..ConnectOptions::default() }
}

/// Depth of each work queue: the requests in flight plus room for their replies' receives.
fn depth(args: &Args) -> u32 {
    2 * args.concurrency + 4
}

/// The client's message of the exchange: its endpoint, the run's parameters and whether it
/// connects through RDMA-CM (`-R`).
const HELLO_LEN: usize = Endpoint::ENCODED_LEN + 20;
/// The server's answer: its endpoint, its RDMA-CM port (0 without `-R`) and whether it uses `-R`.
const REPLY_LEN: usize = Endpoint::ENCODED_LEN + 4;

/// What the exchange gives: the peer's endpoint, the run's parameters, and the server's
/// RDMA-CM listener (server, `-R`) or port (client, `-R`).
struct Exchanged {
    peer: Endpoint,
    n: u64,
    size: u32,
    conc: u32,
    listener: Option<Listener>,
    cm_port: u16,
    /// The exchange's connection, kept for the server's "ready" byte (see [`server`]).
    stream: TcpStream,
}

/// Whether the peer's `-R` differs from ours: the message that says so.
fn cm_mismatch(ours: bool, theirs: bool, peer: &str) -> Result<(), String> {
    match (ours, theirs) {
        (true, false) => {
            Err(format!("the {peer} does not use RDMA-CM (-R): run both sides with -R, or neither"))
        }
        (false, true) => Err(format!("the {peer} uses RDMA-CM (-R): run both sides with -R, or neither")),
        _ => Ok(()),
    }
}

fn exchange(args: &Args, me: &Endpoint) -> Result<Exchanged, String> {
    let wait = Duration::from_secs(args.timeout);
    let until = Instant::now() + wait;
    let io = |what: &str, e: common::net::IoError| format!("{what}: {e:?} (--timeout {} s)", args.timeout);
    let read = |s: &mut TcpStream, buf: &mut [u8]| {
        common::net::read_exact_checked(s, buf, until, |_| Ok(())).map_err(|(got, f)| {
            format!(
                "reading the peer's address: {f:?} after {got} of {} bytes (--timeout {} s)",
                buf.len(),
                args.timeout
            )
        })
    };
    match &args.server {
        Some(host) => {
            let mut s = common::net::connect(host, args.port, wait)?;
            let mut hello = me.encode().to_vec();
            hello.extend_from_slice(&args.requests.to_le_bytes());
            hello.extend_from_slice(&args.size.to_le_bytes());
            hello.extend_from_slice(&args.concurrency.to_le_bytes());
            hello.extend_from_slice(&u32::from(args.rdma_cm).to_le_bytes());
            common::net::write_all(&s, &hello, until).map_err(|e| io("sending our address", e))?;
            let mut buf = [0u8; REPLY_LEN];
            read(&mut s, &mut buf)?;
            let peer = Endpoint::decode(&buf[..Endpoint::ENCODED_LEN])
                .map_err(|e| format!("the server's address: {e}"))?;
            let rest = &buf[Endpoint::ENCODED_LEN..];
            let cm_port = u16::from_le_bytes([rest[0], rest[1]]);
            cm_mismatch(args.rdma_cm, rest[2] != 0, "server")?;
            let (n, size, conc) = (args.requests, args.size, args.concurrency);
            Ok(Exchanged { peer, n, size, conc, listener: None, cm_port, stream: s })
        }
        None => {
            let listener = common::net::listen(args.port)?;
            println!("async_rpc: waiting for a client on TCP port {}", args.port);
            let mut s = common::net::accept(&listener, args.port, wait)?;
            let mut buf = [0u8; HELLO_LEN];
            read(&mut s, &mut buf)?;
            let peer = Endpoint::decode(&buf[..Endpoint::ENCODED_LEN])
                .map_err(|e| format!("the client's address: {e}"))?;
            let rest = &buf[Endpoint::ENCODED_LEN..];
            let n = u64::from_le_bytes(rest[..8].try_into().unwrap());
            let size = u32::from_le_bytes(rest[8..12].try_into().unwrap());
            let conc = u32::from_le_bytes(rest[12..16].try_into().unwrap());
            let client_cm = u32::from_le_bytes(rest[16..20].try_into().unwrap()) != 0;
            // Listening before the answer names the port: the client connects as soon as it has it.
            let listener = if args.rdma_cm && client_cm {
                let any = SocketAddr::from(([0, 0, 0, 0], 0));
                Some(Listener::bind(any).map_err(|e| format!("RDMA-CM: cannot listen: {e}"))?)
            } else {
                None
            };
            let cm_port = listener.as_ref().and_then(|l| l.local_addr()).map_or(0, |a| a.port());
            let mut reply = me.encode().to_vec();
            reply.extend_from_slice(&cm_port.to_le_bytes());
            reply.extend_from_slice(&[u8::from(args.rdma_cm), 0]);
            common::net::write_all(&s, &reply, until).map_err(|e| io("sending our address", e))?;
            cm_mismatch(args.rdma_cm, client_cm, "client")?;
            if !(16..=1 << 20).contains(&size) || !(1..=256).contains(&conc) {
                return Err(format!("the client asked for size {size}, concurrency {conc}: out of range"));
            }
            // The queues were sized from our own -c before the exchange (see `depth`).
            if conc > args.concurrency {
                return Err(format!(
                    "the client asked for concurrency {conc}, more than this server's -c {}: start the server with -c {conc} or more",
                    args.concurrency
                ));
            }
            Ok(Exchanged { peer, n, size, conc, listener, cm_port, stream: s })
        }
    }
}

/// Everything one side needs: device objects and the connected queue pair, before the driver.
struct Side {
    _ctx: Context,
    pd: Arc<ProtectionDomain>,
    channel: ibverbs::CompletionChannel,
    cq: CompletionQueue,
    qp: QueuePair,
    /// With `-R`: the RDMA-CM id the queue pair was made on, which holds its connection.
    _id: Option<CmId>,
}

/// The protection domain, completion channel and CQ (both queues' completions) of one side.
fn side_parts(
    ctx: &Context,
    depth: u32,
) -> Result<(ProtectionDomain, ibverbs::CompletionChannel, CompletionQueue), String> {
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let channel = ctx.create_comp_channel().map_err(|e| e.to_string())?;
    let cq = ctx.create_cq(2 * depth, Some(&channel)).map_err(|e| e.to_string())?;
    Ok((pd, channel, cq))
}

/// The device objects of one side, and its queue pair: made by hand, or on the RDMA-CM `id`.
fn open_side(ctx: &Context, depth: u32, id: Option<&CmId>) -> Result<Side, String> {
    let (pd, channel, cq) = side_parts(ctx, depth)?;
    let b = pd.create_qp(&cq, QpType::RC).max_send_wr(depth).max_recv_wr(depth);
    let qp = match id {
        Some(id) => b.build_on(id),
        None => b.build(),
    }
    .map_err(|e| format!("creating the queue pair: {e}"))?;
    Ok(Side { _ctx: ctx.clone(), pd: Arc::new(pd), channel, cq, qp, _id: None })
}

/// `-R`: connects this side's queue pair through RDMA-CM after the exchange `x` (the server
/// accepts on its listener, the client connects to the server's RDMA-CM port at `host`). The
/// queue pair is made on the id, with the PD and CQ of the id's device context.
fn cm_side(args: &Args, x: &Exchanged, depth: u32) -> Result<Side, String> {
    let wait = Duration::from_secs(args.timeout);
    // One outstanding RDMA Read or atomic each way: this example sends and receives only.
    let param = ConnParam::default();
    match (&x.listener, &args.server) {
        (Some(l), _) => {
            let (id, _) = l.request(wait).map_err(|e| format!("RDMA-CM: no connection request: {e}"))?;
            let ctx = id.context().map_err(|e| e.to_string())?;
            let mut side = match open_side(&ctx, depth, Some(&id)) {
                Ok(side) => side,
                Err(e) => {
                    let _ = id.reject(&[]);
                    return Err(e);
                }
            };
            cm::accept_request(&id, &mut side.qp, &param, wait)
                .map_err(|e| format!("RDMA-CM: accept: {e}"))?;
            side._id = Some(id);
            Ok(side)
        }
        (None, Some(host)) => {
            let ip: IpAddr = host.parse().map_err(|_| {
                format!("-R: {host} is not an IP address (RDMA-CM reaches the server's port by IP)")
            })?;
            let at = SocketAddr::new(ip, x.cm_port);
            // cm::connect keeps its bound on siw too, whose rdma_connect waits for TCP.
            let ctx = cm::device_context(at, wait).map_err(|e| format!("RDMA-CM: resolving {at}: {e}"))?;
            let (pd, channel, cq) = side_parts(&ctx, depth)?;
            let caps = QpCaps { max_send_wr: depth, max_recv_wr: depth, ..QpCaps::default() };
            let (id, qp) = cm::connect(at, &pd, &cq, caps, &param, wait)
                .map_err(|e| format!("RDMA-CM: connecting to {at}: {e}"))?;
            Ok(Side { _ctx: ctx, pd: Arc::new(pd), channel, cq, qp, _id: Some(id) })
        }
        (None, None) => Err("-R: the server has no RDMA-CM listener".into()),
    }
}

fn run(args: &Args) -> Result<(), String> {
    let ctx = common::open_device(args.device.as_deref())?;
    common::device::require_rdma_cm_on_iwarp(&ctx, args.rdma_cm)?;
    let o = connect_options(args);
    let (side, x) = if args.rdma_cm {
        // Nothing to exchange but the parameters and the RDMA-CM port.
        let me = Endpoint { qpn: 0, psn: 0, lid: 0, gid: Gid([0; 16]), mtu: Mtu::MTU_1024 };
        let x = exchange(args, &me)?;
        (cm_side(args, &x, depth(args))?, x)
    } else {
        let mut side = open_side(&ctx, depth(args), None)?;
        let me = side.qp.endpoint(&o).map_err(|e| format!("our endpoint: {e}"))?;
        let x = exchange(args, &me)?;
        side.qp.connect(&x.peer, &o).map_err(|e| format!("connecting the queue pair: {e}"))?;
        (side, x)
    };
    let (n, size, conc) = (x.n, x.size, x.conc);
    let stream = x.stream;
    let mut client_stream = stream.try_clone().map_err(|e| format!("the exchange's connection: {e}"))?;
    let until = || Instant::now() + Duration::from_secs(args.timeout);
    // The server's receives are posted when it sends this byte, and the client sends nothing
    // before it has it: a Send that finds no receive posted ends an iWARP connection (no RNR
    // retry there), and costs an RNR retry elsewhere.
    let ready = move || {
        common::net::write_all(&stream, &[1], until())
            .map_err(|e| format!("telling the client we are ready: {e:?}"))
    };
    if args.sync {
        server_ready(&mut client_stream, until(), args.timeout)?;
        return sync_client(side, n, size, conc, Duration::from_secs(args.timeout));
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let policy = wait_policy(args);
    let mode = match policy {
        WaitPolicy::Events => "events".to_string(),
        WaitPolicy::BusyPoll => "busy-poll".to_string(),
        WaitPolicy::Adaptive { spin } => format!("adaptive {} us", spin.as_micros()),
        _ => format!("{policy:?}"),
    };
    let mode = mode.as_str();
    let limit = Duration::from_secs(args.timeout);
    let whole = limit * 10;
    rt.block_on(async move {
        let driver = Driver::tokio(side.cq, &side.channel).map_err(|e| e.to_string())?;
        driver.set_wait_policy(policy);
        let ep = Arc::new(AsyncQueuePair::new(side.qp, &driver).map_err(|(_, e)| e.to_string())?);
        let (cpu0, t0) = (cpu_time(), Instant::now());
        let work = async {
            if args.server.is_some() {
                server_ready(&mut client_stream, until(), args.timeout)?;
                client(ep.clone(), side.pd.clone(), n, size, conc, limit).await
            } else {
                server(ep.clone(), side.pd.clone(), n, size, conc, ready).await.map(|()| Vec::new())
            }
        };
        let lat = tokio::time::timeout(whole, work)
            .await
            .map_err(|_| format!("the run took more than {} s (10 × --timeout)", whole.as_secs()))??;
        let (cpu, wall) = (cpu_time() - cpu0, t0.elapsed());
        if args.server.is_some() {
            report_client(mode, (n, size, conc), lat, wall);
        } else {
            println!("async_rpc server ({mode}): answered {n} requests");
        }
        report_cpu(mode, cpu, wall);
        Ok(())
    })
}

/// `count` buffers of `size` bytes carved from one registration, the way servers register one
/// pool and hand each request a slot of it: owned chunks, each handed back by the completion of
/// the request that took it (`Completion::take_chunk`).
fn pool(pd: &ProtectionDomain, size: u32, count: u32) -> Result<Vec<Chunk>, String> {
    let total = u64::from(size) * u64::from(count);
    common::memory::check(total, "the buffer pool")?;
    pd.allocate(total as usize)
        .and_then(|mr| mr.into_chunks(size as usize))
        .map_err(|e| format!("allocating a pool of {count} buffers of {size} bytes: {e}"))
}

fn check(c: &Completion, what: &str) -> Result<(), String> {
    if c.is_ok() {
        Ok(())
    } else {
        Err(format!("{what} completed with status {}", c.status()))
    }
}

/// Answers `n` requests: `conc + 2` tasks, each with a receive posted, replying to what lands
/// in it. `ready` is called once every task's first receive is posted.
///
/// A task posts its next receive (from a spare buffer) before it replies: a client sends its
/// next request once it has the reply, and on iWARP a Send that finds no receive posted ends
/// the connection (there is no RNR retry), so every request must find one. (Re-posting after
/// the reply's completion lost the connection now and then on siw: the client's next request
/// could arrive first.)
async fn server(
    ep: Arc<AsyncQueuePair>,
    pd: Arc<ProtectionDomain>,
    n: u64,
    size: u32,
    conc: u32,
    ready: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    let served = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    // One registration for every task's two buffers (one received into, then replied from,
    // while the other is posted).
    let mut buffers = pool(&pd, size, 2 * (conc + 2))?;
    while let Some(buf) = buffers.pop() {
        let mut spare = buffers.pop().ok_or("the pool ran out")?;
        let (ep, served) = (ep.clone(), served.clone());
        // Posted here, not in the task: all are posted before `ready`.
        let first = ep.post_recv(RecvRequest::new(Local::whole(buf))).map_err(|e| e.error.to_string())?;
        tasks.push(tokio::spawn(async move {
            let mut op = first;
            loop {
                let mut c = op.await.map_err(|e| e.to_string())?;
                check(&c, "a receive")?;
                let len = c.byte_len() as usize;
                let req = c.take_chunk().ok_or("the receive's buffer did not come back")?;
                // The next receive first (see above).
                op = ep.post_recv(RecvRequest::new(Local::whole(spare))).map_err(|e| e.error.to_string())?;
                // A message of no bytes is echoed with no entry (no post takes an entry of 0
                // bytes); the buffer stays here.
                let (reply, kept) = if len == 0 {
                    (SendRequest::send_inline(&[]), Some(req))
                } else {
                    (SendRequest::send(Local::new(req, 0..len).map_err(|e| e.to_string())?), None)
                };
                let mut c = ep.send(reply).await.map_err(|e| e.to_string())?;
                check(&c, "a reply")?;
                let buf = match kept {
                    Some(buf) => buf,
                    None => c.take_chunk().ok_or("the reply's buffer did not come back")?,
                };
                if served.fetch_add(1, Ordering::AcqRel) + 1 >= n {
                    return Ok::<(), String>(());
                }
                spare = buf;
            }
        }));
    }
    ready()?;
    // Done when one task has counted the last request; the others' receives stay posted, their
    // futures dropped (sound: the queue pair keeps the buffers).
    loop {
        if served.load(Ordering::Acquire) >= n {
            for t in &tasks {
                t.abort();
            }
            // Let the client's last reply complete before the queue pair goes.
            tokio::time::sleep(Duration::from_millis(100)).await;
            return Ok(());
        }
        if let Some(t) = tasks.iter_mut().find(|t| t.is_finished()) {
            match t.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(format!("a server task failed: {e}")),
            }
            tasks.retain(|t| !t.is_finished());
            continue;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

type Waiters = Arc<Mutex<Vec<Option<tokio::sync::oneshot::Sender<u64>>>>>;

/// Sends `n` requests with `conc` in flight; returns each one's latency.
async fn client(
    ep: Arc<AsyncQueuePair>,
    pd: Arc<ProtectionDomain>,
    n: u64,
    size: u32,
    conc: u32,
    limit: Duration,
) -> Result<Vec<Duration>, String> {
    let waiters: Waiters = Arc::new(Mutex::new((0..conc).map(|_| None).collect()));
    // Receivers: a task per posted receive, handing each reply to the request's slot after
    // posting the next receive from a spare buffer (as the server does: on iWARP a reply that
    // finds no receive ends the connection); their buffers and the senders' come from one
    // registration.
    let mut buffers = pool(&pd, size, 3 * conc + 4)?;
    let mut receivers = Vec::new();
    for _ in 0..conc + 2 {
        let (ep, waiters) = (ep.clone(), waiters.clone());
        let buf = buffers.pop().ok_or("the pool ran out")?;
        let mut spare = buffers.pop().ok_or("the pool ran out")?;
        let mut op = ep.post_recv(RecvRequest::new(Local::whole(buf))).map_err(|e| e.error.to_string())?;
        receivers.push(tokio::spawn(async move {
            loop {
                let mut c = op.await.map_err(|e| e.to_string())?;
                check(&c, "a receive")?;
                let m = c.take_chunk().ok_or("the receive's buffer did not come back")?;
                op = ep.post_recv(RecvRequest::new(Local::whole(spare))).map_err(|e| e.error.to_string())?;
                let slot = u64::from_le_bytes(m.as_slice()[..8].try_into().unwrap());
                let seq = u64::from_le_bytes(m.as_slice()[8..16].try_into().unwrap());
                let tx = waiters.lock().unwrap().get_mut(slot as usize).and_then(Option::take);
                match tx {
                    Some(tx) => {
                        let _ = tx.send(seq);
                    }
                    None => return Err::<(), String>(format!("a reply for slot {slot} that waits for none")),
                }
                spare = m;
            }
        }));
    }
    let next = Arc::new(AtomicU64::new(0));
    // Replies taken: the watchdog fails the run when it stands still for `limit` (a timer per
    // request would cost each request a clock read and a timer wheel's insert and removal).
    let answered = Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    for slot in 0..conc {
        let (ep, waiters, next, answered) = (ep.clone(), waiters.clone(), next.clone(), answered.clone());
        let mut buf = buffers.pop().ok_or("the pool ran out")?;
        senders.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let seq = next.fetch_add(1, Ordering::AcqRel);
                if seq >= n {
                    return Ok::<_, String>(lat);
                }
                let (tx, rx) = tokio::sync::oneshot::channel();
                waiters.lock().unwrap()[slot as usize] = Some(tx);
                buf.as_mut_slice()[..8].copy_from_slice(&u64::from(slot).to_le_bytes());
                buf.as_mut_slice()[8..16].copy_from_slice(&seq.to_le_bytes());
                let t = Instant::now();
                let mut c = ep.send(SendRequest::send(Local::whole(buf))).await.map_err(|e| e.to_string())?;
                check(&c, "a request")?;
                buf = c.take_chunk().ok_or("the request's buffer did not come back")?;
                // No timer of its own: the watchdog below bounds the wait.
                let got = rx.await.map_err(|_| "the receivers stopped".to_string())?;
                if got != seq {
                    return Err(format!("slot {slot}: reply for request {got}, expected {seq}"));
                }
                answered.fetch_add(1, Ordering::Relaxed);
                lat.push(t.elapsed());
            }
        }));
    }
    let watchdog = async {
        let mut last = answered.load(Ordering::Relaxed);
        loop {
            tokio::time::sleep(limit).await;
            let now = answered.load(Ordering::Relaxed);
            if now == last {
                return format!(
                    "no reply within {} s (--timeout): {now} of {n} requests answered",
                    limit.as_secs()
                );
            }
            last = now;
        }
    };
    let collect = async {
        let mut all = Vec::with_capacity(n.min(1 << 20) as usize);
        for s in senders.iter_mut() {
            match s.await {
                Ok(Ok(l)) => all.extend(l),
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(format!("a client task failed: {e}")),
            }
        }
        Ok(all)
    };
    let all = tokio::select! {
        r = collect => r,
        e = watchdog => Err(e),
    };
    let all = match all {
        Ok(all) => all,
        Err(e) => {
            senders.iter().for_each(|t| t.abort());
            receivers.iter().for_each(|t| t.abort());
            return Err(e);
        }
    };
    for r in &receivers {
        if r.is_finished() {
            continue;
        }
        r.abort();
    }
    for r in receivers {
        if let Ok(Err(e)) = r.await {
            return Err(e);
        }
    }
    Ok(all)
}

/// Client: waits (until `deadline`) for the server's byte saying its receives are posted.
fn server_ready(stream: &mut TcpStream, deadline: Instant, timeout_secs: u64) -> Result<(), String> {
    let mut byte = [0u8];
    common::net::read_exact_checked(stream, &mut byte, deadline, |_| Ok(()))
        .map_err(|(_, f)| format!("waiting for the server to be ready: {f:?} (--timeout {timeout_secs} s)"))
}

/// `--sync`: the client on the synchronous safe level. One thread keeps `conc` requests in
/// flight (the same messages as `client`: slot and sequence number in the first 16 bytes),
/// busy-polling the CQ; prints the client's lines as the async client does.
fn sync_client(mut side: Side, n: u64, size: u32, conc: u32, limit: Duration) -> Result<(), String> {
    let conc = conc as usize;
    // The replies' receives (as many as the async client keeps posted), and the staging buffers.
    for buf in pool(&side.pd, size, conc as u32 + 2)? {
        side.qp.post_recv(RecvRequest::new(Local::whole(buf))).map_err(|e| e.error.to_string())?;
    }
    // A slot is free again once both its request's send completion (which hands the buffer
    // back) and its reply came, in either order.
    let mut free: Vec<(u64, Chunk)> = (0..conc as u64).zip(pool(&side.pd, size, conc as u32)?).collect();
    let mut started: Vec<Option<(u64, Instant)>> = vec![None; conc];
    let mut sent: Vec<Option<Chunk>> = (0..conc).map(|_| None).collect();
    let mut answered = vec![false; conc];
    let mut lat = Vec::with_capacity(n.min(1 << 20) as usize);
    let mut out: Vec<Completion> = (0..16).map(|_| Completion::default()).collect();
    let (mut next, mut done) = (0u64, 0u64);
    let (cpu0, t0) = (cpu_time(), Instant::now());
    // Empty polls since the last completion, and when the first 1024 of them were done: the
    // clock is read once per 1024 empty polls only (a clock read can be a system call, as with
    // this VM's HPET, which a busy-polling loop should not pay at each poll).
    let (mut empty, mut idle) = (0u32, None::<Instant>);
    while done < n {
        while next < n {
            let Some((slot, mut m)) = free.pop() else { break };
            m.as_mut_slice()[..8].copy_from_slice(&slot.to_le_bytes());
            m.as_mut_slice()[8..16].copy_from_slice(&next.to_le_bytes());
            started[slot as usize] = Some((next, Instant::now()));
            side.qp
                .post_send(SendRequest::send(Local::whole(m)).wr_id(slot))
                .map_err(|e| e.error.to_string())?;
            next += 1;
        }
        let got = side.cq.poll(&mut out).map_err(|e| e.to_string())?;
        if !got.is_empty() {
            (empty, idle) = (0, None);
        } else {
            empty = empty.wrapping_add(1);
            if empty % 1024 == 0 && idle.get_or_insert_with(Instant::now).elapsed() > limit {
                return Err(format!(
                    "no completion within {} s (--timeout): {done} of {n} replies",
                    limit.as_secs()
                ));
            }
        }
        for comp in got.iter_mut() {
            check(comp, "a client completion")?;
            let m = comp.take_chunk().ok_or("a completion without its buffer")?;
            if comp.opcode() == ibverbs::WcOpcode::RECV {
                let slot = u64::from_le_bytes(m.as_slice()[..8].try_into().unwrap());
                let seq = u64::from_le_bytes(m.as_slice()[8..16].try_into().unwrap());
                match started.get_mut(slot as usize).and_then(Option::take) {
                    Some((want, t)) if want == seq => {
                        lat.push(t.elapsed());
                        match sent[slot as usize].take() {
                            Some(buf) => free.push((slot, buf)),
                            None => answered[slot as usize] = true,
                        }
                    }
                    other => {
                        return Err(format!("slot {slot}: reply for request {seq}, waiting for {other:?}"))
                    }
                }
                done += 1;
                side.qp.post_recv(RecvRequest::new(Local::whole(m))).map_err(|e| e.error.to_string())?;
            } else {
                let slot = comp.wr_id() as usize;
                if std::mem::take(&mut answered[slot]) {
                    free.push((slot as u64, m));
                } else {
                    sent[slot] = Some(m);
                }
            }
        }
    }
    let (cpu, wall) = (cpu_time() - cpu0, t0.elapsed());
    report_client("sync busy-poll", (n, size, conc as u32), lat, wall);
    report_cpu("sync busy-poll", cpu, wall);
    Ok(())
}

/// The client's line: `n` requests of `size` bytes, `conc` in flight, their latencies `lat`
/// over `wall`.
fn report_client(mode: &str, (n, size, conc): (u64, u32, u32), mut lat: Vec<Duration>, wall: Duration) {
    lat.sort_unstable();
    println!(
        "async_rpc client ({mode}): {n} requests of {size} B, {conc} in flight: {:.0} requests/s; latency p50 {:.1} us, p99 {:.1} us, p999 {:.1} us",
        n as f64 / wall.as_secs_f64(),
        us(percentile(&lat, 0.50)),
        us(percentile(&lat, 0.99)),
        us(percentile(&lat, 0.999)),
    );
}

/// The process's CPU time line.
fn report_cpu(mode: &str, cpu: Duration, wall: Duration) {
    println!(
        "async_rpc cpu ({mode}): {:.3} s user+sys over {:.3} s wall ({:.0}%)",
        cpu.as_secs_f64(),
        wall.as_secs_f64(),
        100.0 * cpu.as_secs_f64() / wall.as_secs_f64()
    );
}

// ---- --bench: the same load in one process, sync safe level against the async adaptor ----

struct Figures {
    rate: f64,
    p50: Duration,
    p99: Duration,
    cpu_per_million: f64,
}

fn report(name: &str, f: &Figures) {
    println!(
        "bench {name:<22} {:>9.0} req/s  p50 {:>8.1} us  p99 {:>8.1} us  cpu {:>7.2} s per million messages",
        f.rate,
        us(f.p50),
        us(f.p99),
        f.cpu_per_million
    );
}

fn figures(n: u64, wall: Duration, cpu: Duration, mut lat: Vec<Duration>) -> Figures {
    lat.sort_unstable();
    // Each request is two messages (request and reply).
    Figures {
        rate: n as f64 / wall.as_secs_f64(),
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        cpu_per_million: cpu.as_secs_f64() * 1e6 / (2 * n) as f64,
    }
}

/// Two queue pairs on one device connected to each other, each with its own CQ and channel.
fn loopback(args: &Args) -> Result<(Side, Side), String> {
    let ctx = common::open_device(args.device.as_deref())?;
    let o = connect_options(args);
    let (mut a, mut b) = (open_side(&ctx, depth(args), None)?, open_side(&ctx, depth(args), None)?);
    let (ea, eb) =
        (a.qp.endpoint(&o).map_err(|e| e.to_string())?, b.qp.endpoint(&o).map_err(|e| e.to_string())?);
    a.qp.connect(&eb, &o).map_err(|e| e.to_string())?;
    b.qp.connect(&ea, &o).map_err(|e| e.to_string())?;
    Ok((a, b))
}

/// The synchronous safe level: one thread busy-polls both CQs, keeping `conc` requests in flight.
fn bench_sync(args: &Args) -> Result<Figures, String> {
    let (n, size, conc) = (args.requests, args.size, args.concurrency as usize);
    let (mut c, mut s) = loopback(args)?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout) * 10;
    let extra = conc as u32 + 2;
    for (s_buf, c_buf) in pool(&s.pd, size, extra)?.into_iter().zip(pool(&c.pd, size, extra)?) {
        s.qp.post_recv(RecvRequest::new(Local::whole(s_buf))).map_err(|e| e.to_string())?;
        c.qp.post_recv(RecvRequest::new(Local::whole(c_buf))).map_err(|e| e.to_string())?;
    }
    // The client's staging buffers: a free list of chunks of one registration, each sent from
    // and handed back by its send's completion.
    let mut free: Vec<Chunk> = pool(&c.pd, size, conc as u32)?;
    let mut start: VecDeque<Instant> = VecDeque::new();
    let mut lat = Vec::with_capacity(n.min(1 << 20) as usize);
    let (mut sent, mut done) = (0u64, 0u64);
    let mut out: Vec<Completion> = (0..16).map(|_| Completion::default()).collect();
    let (cpu0, t0) = (cpu_time(), Instant::now());
    while done < n {
        while sent < n && !free.is_empty() {
            let m = free.pop().unwrap();
            start.push_back(Instant::now());
            c.qp.post_send(SendRequest::send(Local::whole(m))).map_err(|e| e.error.to_string())?;
            sent += 1;
        }
        // Server: echo every request from its receive buffer, repost the buffer when the reply is done.
        for comp in s.cq.poll(&mut out).map_err(|e| e.to_string())?.iter_mut() {
            check(comp, "a server completion")?;
            let m = comp.take_chunk().ok_or("no buffer")?;
            if comp.opcode() == ibverbs::WcOpcode::RECV {
                s.qp.post_send(SendRequest::send(Local::whole(m))).map_err(|e| e.error.to_string())?;
            } else {
                s.qp.post_recv(RecvRequest::new(Local::whole(m))).map_err(|e| e.error.to_string())?;
            }
        }
        for comp in c.cq.poll(&mut out).map_err(|e| e.to_string())?.iter_mut() {
            check(comp, "a client completion")?;
            let m = comp.take_chunk().ok_or("no buffer")?;
            if comp.opcode() == ibverbs::WcOpcode::RECV {
                lat.push(start.pop_front().ok_or("a reply to nothing")?.elapsed());
                done += 1;
                c.qp.post_recv(RecvRequest::new(Local::whole(m))).map_err(|e| e.error.to_string())?;
            } else {
                free.push(m);
            }
        }
        if Instant::now() > deadline {
            return Err(format!("sync bench: {done} of {n} replies before the deadline"));
        }
    }
    Ok(figures(n, t0.elapsed(), cpu_time() - cpu0, lat))
}

/// One side's queue pair on a driver of its own with `policy` (inside a tokio runtime), and
/// its protection domain.
fn driven(side: Side, policy: WaitPolicy) -> Result<(AsyncQueuePair, Arc<ProtectionDomain>), String> {
    let driver = Driver::tokio(side.cq, &side.channel).map_err(|e| e.to_string())?;
    driver.set_wait_policy(policy);
    let ep = AsyncQueuePair::new(side.qp, &driver).map_err(|(_, e)| e.to_string())?;
    Ok((ep, side.pd))
}

/// The async adaptor: the same server and client as the two-process run, in one runtime.
fn bench_async(args: &Args, policy: WaitPolicy) -> Result<Figures, String> {
    let (n, size, conc) = (args.requests, args.size, args.concurrency);
    let (c, s) = loopback(args)?;
    let limit = Duration::from_secs(args.timeout);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let ((cep, cpd), (sep, spd)) = (driven(c, policy)?, driven(s, policy)?);
        let (cpu0, t0) = (cpu_time(), Instant::now());
        let srv = tokio::spawn(server(Arc::new(sep), spd, n, size, conc, || Ok(())));
        let lat = tokio::time::timeout(limit * 10, client(Arc::new(cep), cpd, n, size, conc, limit))
            .await
            .map_err(|_| "async bench: timed out".to_string())??;
        let (wall, cpu) = (t0.elapsed(), cpu_time() - cpu0);
        srv.await.map_err(|e| e.to_string())??;
        Ok(figures(n, wall, cpu, lat))
    })
}

/// The async adaptor in its plainest shape at one request in flight: one client task (post the
/// reply's receive, send the request, await both) and one server task (await a request, post the
/// next receive, send the reply), each side on its own driver with `policy`; no routing of
/// replies to waiting tasks (`client`'s receivers and channels). `-c 1` only.
fn bench_pingpong(args: &Args, policy: WaitPolicy) -> Result<Figures, String> {
    let (n, size) = (args.requests, args.size);
    let (c, s) = loopback(args)?;
    let limit = Duration::from_secs(args.timeout);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let ((cep, cpd), (sep, spd)) = (driven(c, policy)?, driven(s, policy)?);
        let mut sbufs = pool(&spd, size, 2)?;
        let (mut spare, first) =
            (sbufs.pop().ok_or("the pool ran out")?, sbufs.pop().ok_or("the pool ran out")?);
        let mut op = sep.post_recv(RecvRequest::new(Local::whole(first))).map_err(|e| e.error.to_string())?;
        let (cpu0, t0) = (cpu_time(), Instant::now());
        let srv = tokio::spawn(async move {
            for _ in 0..n {
                let mut c = op.await.map_err(|e| e.to_string())?;
                check(&c, "a request")?;
                let len = c.byte_len() as usize;
                let req = c.take_chunk().ok_or("the request's buffer did not come back")?;
                // The next receive before the reply (see `server`).
                op = sep.post_recv(RecvRequest::new(Local::whole(spare))).map_err(|e| e.error.to_string())?;
                let local = Local::new(req, 0..len).map_err(|e| e.to_string())?;
                let mut r = sep.send(SendRequest::send(local)).await.map_err(|e| e.to_string())?;
                check(&r, "a reply")?;
                spare = r.take_chunk().ok_or("the reply's buffer did not come back")?;
            }
            Ok::<(), String>(())
        });
        // A task of its own, not `block_on`'s future: a spinning wait wakes its own task, and
        // tokio's current-thread scheduler answers a wake-up of the `block_on` future with a
        // poll of its I/O driver (`epoll_wait()`) when no other task is queued, while a
        // spawned task's goes to the run queue.
        let client = tokio::spawn(async move {
            let mut bufs = pool(&cpd, size, 2)?;
            let (mut sbuf, mut rbuf) =
                (bufs.pop().ok_or("the pool ran out")?, bufs.pop().ok_or("the pool ran out")?);
            let mut lat = Vec::with_capacity(n.min(1 << 20) as usize);
            for seq in 0..n {
                sbuf.as_mut_slice()[..8].copy_from_slice(&seq.to_le_bytes());
                let t = Instant::now();
                // The reply's receive first: it must be posted before the request can be answered.
                let reply =
                    cep.post_recv(RecvRequest::new(Local::whole(rbuf))).map_err(|e| e.error.to_string())?;
                let mut sent =
                    cep.send(SendRequest::send(Local::whole(sbuf))).await.map_err(|e| e.to_string())?;
                check(&sent, "a request")?;
                sbuf = sent.take_chunk().ok_or("the request's buffer did not come back")?;
                let mut got = reply.await.map_err(|e| e.to_string())?;
                check(&got, "a reply")?;
                rbuf = got.take_chunk().ok_or("the reply's buffer did not come back")?;
                let echoed = u64::from_le_bytes(rbuf.as_slice()[..8].try_into().unwrap());
                if echoed != seq {
                    return Err(format!("reply for request {echoed}, expected {seq}"));
                }
                lat.push(t.elapsed());
            }
            Ok::<_, String>(lat)
        });
        let lat = tokio::time::timeout(limit * 10, client)
            .await
            .map_err(|_| "async ping-pong: timed out".to_string())?
            .map_err(|e| e.to_string())??;
        let (wall, cpu) = (t0.elapsed(), cpu_time() - cpu0);
        tokio::time::timeout(limit, srv)
            .await
            .map_err(|_| "async ping-pong: the server did not finish".to_string())?
            .map_err(|e| e.to_string())??;
        Ok(figures(n, wall, cpu, lat))
    })
}

fn bench(args: &Args) -> Result<(), String> {
    println!(
        "async_rpc --bench: {} requests of {} B, {} in flight, one process over one device",
        args.requests, args.size, args.concurrency
    );
    // Each path (as `--only` names it) and the name its line gives it; the sync one first.
    const PATHS: [(&str, &str); 5] = [
        ("sync", "sync safe (busy poll)"),
        ("events", "async events"),
        ("busy", "async busy-poll"),
        ("adaptive", "async adaptive"),
        ("pingpong", "async ping-pong adaptive"),
    ];
    if let Some(bad) = args.only.iter().find(|p| !PATHS.iter().any(|(path, _)| path == p)) {
        let paths: Vec<&str> = PATHS.iter().map(|(path, _)| *path).collect();
        return Err(format!("--only: no path {bad:?} ({})", paths.join(", ")));
    }
    let runs = |p: &str| args.only.is_empty() || args.only.iter().any(|o| o == p);
    let policy = adaptive(args);
    let mut got: Vec<(&str, Figures)> = Vec::new();
    for (path, name) in PATHS {
        // The ping-pong keeps one request in flight by its shape.
        if !runs(path) || (path == "pingpong" && args.concurrency != 1) {
            continue;
        }
        let f = match path {
            "sync" => bench_sync(args)?,
            "events" => bench_async(args, WaitPolicy::Events)?,
            "busy" => bench_async(args, WaitPolicy::BusyPoll)?,
            "adaptive" => bench_async(args, policy)?,
            _ => bench_pingpong(args, policy)?,
        };
        report(name, &f);
        got.push((name, f));
    }
    if let (true, WaitPolicy::Adaptive { spin }) = (runs("adaptive"), policy) {
        println!("bench (async adaptive: spin {} us)", spin.as_micros());
    }
    let find = |name: &str| got.iter().find(|(n, _)| *n == name).map(|(_, f)| f);
    let ratio = |name: &str, f: &Figures, base: &str, b: &Figures| {
        println!(
            "bench ratio {name} / {base}: req/s {:.2}, p50 latency {:.2}, p99 latency {:.2}, cpu per message {:.2}",
            f.rate / b.rate,
            f.p50.as_secs_f64() / b.p50.as_secs_f64(),
            f.p99.as_secs_f64() / b.p99.as_secs_f64(),
            f.cpu_per_million / b.cpu_per_million
        );
    };
    let (sync_name, busy_name, adaptive_name) = (PATHS[0].1, PATHS[2].1, PATHS[3].1);
    if let Some(base) = find(sync_name) {
        for (name, f) in got.iter().filter(|(name, _)| *name != sync_name) {
            ratio(name, f, "sync", base);
        }
    }
    if let (Some(a), Some(b)) = (find(adaptive_name), find(busy_name)) {
        ratio(adaptive_name, a, busy_name, b);
    }
    Ok(())
}
