//! `rping`: rdmacm-utils' `rping` on the safe API. The client advertises a buffer (address,
//! rkey, size in network byte order: 16 bytes), the server RDMA-Reads it, says "go ahead", the
//! client advertises a second buffer, the server RDMA-Writes the data back into it, says "go
//! ahead" again; the client may verify the echo (`-V`). It speaks the C tool's wire protocol, so
//! either side may be rdma-core's `rping`.
//!
//! ```text
//! rping -s -a 192.0.2.1 -v                  # server
//! rping -c -a 192.0.2.1 -C 3 -S 4096 -V -v  # client
//! ```
//!
//! Differences from the C tool: every wait is bounded by `--timeout` seconds (the C tool waits
//! forever) but a persistent server's (`-P`) wait for its next client, which, as the C tool's,
//! lasts until one comes (or the server is stopped); the client retries a rejected connection
//! (no server yet) until then; `-S` takes 1..=65536 (the C tool 26..=65535); a persistent server
//! serves one client after the other instead of one thread each; retry counts are 6, not 7
//! (which means "forever" on rxe).

use std::collections::VecDeque;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use ibverbs::cm::{self, CmEventKind, CmId, ConnParam, EventChannel};
use ibverbs::{
    AccessFlags, CompletionQueue, Error, Local, MemoryRegion, QpType, QueuePair, RecvRequest, RemoteSlice,
    SendRequest, WcStatus,
};

/// RDMA ping-pong over RDMA-CM (like rdmacm-utils' rping).
#[derive(Debug, Parser)]
#[command(name = "rping")]
struct Args {
    /// Run as the server
    #[arg(short = 's', conflicts_with = "client", required_unless_present = "client")]
    server: bool,
    /// Run as the client
    #[arg(short = 'c')]
    client: bool,
    /// Address to bind to (server, default 0.0.0.0) or connect to (client)
    #[arg(short = 'a')]
    addr: Option<IpAddr>,
    /// Port
    #[arg(short = 'p', default_value_t = 7174)]
    port: u16,
    /// Pings to run (client; 0: forever)
    #[arg(short = 'C', default_value_t = 0)]
    count: u32,
    /// Ping buffer size in bytes
    #[arg(short = 'S', default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536))]
    size: u32,
    /// Print the ping data
    #[arg(short = 'v', action = clap::ArgAction::Count)]
    verbose: u8,
    /// Verify the echoed data (client)
    #[arg(short = 'V')]
    validate: bool,
    /// Debug output
    #[arg(short = 'd')]
    debug: bool,
    /// Persistent server: serve clients one after the other, waiting for each as long as it takes
    #[arg(short = 'P')]
    persistent: bool,
    /// Bound on every wait, in seconds
    #[arg(long, default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    timeout: u64,
}

const INFO_LEN: usize = 16;
const RECV: u64 = 1;
const SEND: u64 = 2;
const READ: u64 = 3;
const WRITE: u64 = 4;

/// rping's `struct rping_rdma_info`: buf (be64), rkey (be32), size (be32).
#[derive(Debug, Clone, Copy)]
struct Info {
    addr: u64,
    rkey: u32,
    size: u32,
}

impl Info {
    fn encode(&self) -> [u8; INFO_LEN] {
        let mut b = [0u8; INFO_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..].copy_from_slice(&self.size.to_be_bytes());
        b
    }
    fn decode(b: &[u8]) -> Info {
        let u64_at = |r: std::ops::Range<usize>| u64::from_be_bytes(b[r].try_into().unwrap_or([0; 8]));
        let u32_at = |r: std::ops::Range<usize>| u32::from_be_bytes(b[r].try_into().unwrap_or([0; 4]));
        Info { addr: u64_at(0..8), rkey: u32_at(8..12), size: u32_at(12..16) }
    }
}

/// What a wait ended with.
enum Got {
    Info(Info),
    Region(MemoryRegion),
    Disconnected,
}

/// One connection: its id, queue pair and CQ, with the completions that came early.
struct Conn {
    id: CmId,
    qp: QueuePair,
    cq: CompletionQueue,
    infos: VecDeque<Info>,
    regions: Vec<(u64, MemoryRegion)>,
    timeout: Duration,
    debug: bool,
}

type Res<T> = Result<T, String>;

fn err(what: &str) -> impl Fn(Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

impl Conn {
    fn post_recv(&mut self, mr: MemoryRegion) -> Res<()> {
        self.qp
            .post_recv(RecvRequest::new(Local::whole(mr)).wr_id(RECV))
            .map_err(|e| format!("post recv: {e}"))
    }

    fn send_info(&mut self, mr: MemoryRegion, info: Info) -> Res<()> {
        let mut mr = mr;
        mr.copy_from_slice(&info.encode());
        if self.debug {
            eprintln!("RDMA addr {:x} rkey {:x} len {}", info.addr, info.rkey, info.size);
        }
        self.qp
            .post_send(SendRequest::send(Local::whole(mr)).wr_id(SEND))
            .map_err(|e| format!("post send: {e}"))
    }

    /// Waits (bounded) for the completion `want`; a receive seen meanwhile is kept for later.
    fn wait(&mut self, want: u64) -> Res<Got> {
        if want == RECV {
            if let Some(i) = self.infos.pop_front() {
                return Ok(Got::Info(i));
            }
        } else if let Some(k) = self.regions.iter().position(|(w, _)| *w == want) {
            return Ok(Got::Region(self.regions.swap_remove(k).1));
        }
        let deadline = Instant::now() + self.timeout;
        let ch = self.id.channel();
        let mut buf: [ibverbs::Completion; 4] = Default::default();
        loop {
            let n = self.cq.poll(&mut buf).map_err(err("ibv_poll_cq"))?.len();
            for c in buf.iter_mut().take(n) {
                if c.status() != WcStatus::SUCCESS {
                    if c.status() == WcStatus::WR_FLUSH_ERR {
                        return Ok(Got::Disconnected);
                    }
                    return Err(format!("cq completion failed status {} ({:?})", c.status().0, c.status()));
                }
                let region = c.take_region();
                match (c.wr_id(), region) {
                    (RECV, Some(mr)) => {
                        if c.byte_len() as usize != INFO_LEN {
                            return Err(format!("Received bogus data, size {}", c.byte_len()));
                        }
                        let info = Info::decode(&mr[..INFO_LEN]);
                        if self.debug {
                            eprintln!(
                                "Received rkey {:x} addr {:x} len {} from peer",
                                info.rkey, info.addr, info.size
                            );
                        }
                        // The protocol has at most two advertisements in flight (the server
                        // uses one per step): more is a peer not speaking it, not a queue to grow.
                        if self.infos.len() >= 2 {
                            return Err("the peer sent advertisements faster than the protocol allows".into());
                        }
                        self.infos.push_back(info);
                        self.post_recv(mr)?;
                    }
                    (w, Some(mr)) => self.regions.push((w, mr)),
                    (w, None) => return Err(format!("completion {w} without its buffer")),
                }
            }
            if want == RECV {
                if let Some(i) = self.infos.pop_front() {
                    return Ok(Got::Info(i));
                }
            } else if let Some(k) = self.regions.iter().position(|(w, _)| *w == want) {
                return Ok(Got::Region(self.regions.swap_remove(k).1));
            }
            if let Some(ev) = ch.get_event(Some(Duration::ZERO)).map_err(err("rdma_get_cm_event"))? {
                if ev.kind() == CmEventKind::DISCONNECTED {
                    return Ok(Got::Disconnected);
                }
                if self.debug {
                    eprintln!("cma_event type {:?} status {}", ev.kind(), ev.status());
                }
            }
            if n == 0 {
                if Instant::now() > deadline {
                    return Err(format!("timed out after {:?} waiting for the peer", self.timeout));
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn region(&mut self, want: u64) -> Res<Option<MemoryRegion>> {
        match self.wait(want)? {
            Got::Region(mr) => Ok(Some(mr)),
            Got::Disconnected => Ok(None),
            Got::Info(_) => Err("unexpected receive".into()),
        }
    }

    fn info(&mut self) -> Res<Option<Info>> {
        match self.wait(RECV)? {
            Got::Info(i) => Ok(Some(i)),
            Got::Disconnected => Ok(None),
            Got::Region(_) => Err("unexpected completion".into()),
        }
    }
}

/// The C string at the start of `b` (up to its first NUL).
fn c_str(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn server(args: &Args) -> Res<()> {
    let timeout = Duration::from_secs(args.timeout);
    let ch = EventChannel::new().map_err(err("rdma_create_event_channel"))?;
    let listen = ch.create_id().map_err(err("rdma_create_id"))?;
    let addr = SocketAddr::new(args.addr.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), args.port);
    listen.bind(addr).map_err(err("rdma_bind_addr"))?;
    listen.listen(3).map_err(err("rdma_listen"))?;
    println!("rping: listening on {addr}");
    let _ = std::io::stdout().flush();
    loop {
        let deadline = Instant::now() + timeout;
        let id = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // A persistent server waits for its next client as long as it takes (as the C tool).
            let wait = if args.persistent { None } else { Some(left) };
            match ch.get_event(wait).map_err(err("rdma_get_cm_event"))? {
                Some(mut ev) if ev.kind() == CmEventKind::CONNECT_REQUEST => {
                    if let Some(id) = ev.take_new_id() {
                        break id;
                    }
                }
                Some(ev) => return Err(format!("unexpected event {:?} (status {})", ev.kind(), ev.status())),
                None if left.is_zero() && !args.persistent => {
                    return Err(format!("no client within {timeout:?}"))
                }
                None => {}
            }
        };
        let r = serve(args, id, timeout);
        if !args.persistent {
            return r;
        }
        if let Err(e) = r {
            eprintln!("rping: {e}");
        }
    }
}

fn serve(args: &Args, id: CmId, timeout: Duration) -> Res<()> {
    let size = args.size as usize;
    let ctx = id.context().map_err(err("rdma_cm_id context"))?;
    let pd = ctx.alloc_pd().map_err(err("ibv_alloc_pd"))?;
    let cq = ctx.create_cq(32, None).map_err(err("ibv_create_cq"))?;
    let qp = pd.create_qp(&cq, QpType::RC).max_send_wr(16).max_recv_wr(2).build_on(&id);
    let qp = match qp {
        Ok(qp) => qp,
        Err(e) => {
            let _ = id.reject(&[]);
            return Err(format!("rdma_create_qp: {e}"));
        }
    };
    let mut c = Conn { id, qp, cq, infos: VecDeque::new(), regions: Vec::new(), timeout, debug: args.debug };
    c.post_recv(pd.allocate(INFO_LEN).map_err(err("ibv_reg_mr"))?)?;
    c.id.accept(&ConnParam::default()).map_err(err("rdma_accept"))?;
    let ev = c.id.next_event_for_example(timeout)?;
    if ev != CmEventKind::ESTABLISHED {
        return Err(format!("wait for ESTABLISHED: got {ev:?}"));
    }
    c.qp.cm_established().map_err(err("ibv_query_qp"))?;
    let mut rdma_buf = Some(pd.allocate(size).map_err(err("ibv_reg_mr"))?);
    let mut send_buf = Some(pd.allocate(INFO_LEN).map_err(err("ibv_reg_mr"))?);
    // The client's source buffer: RDMA Read it.
    while let Some(info) = c.info()? {
        if info.size as usize > size || info.size == 0 {
            return Err(format!("the client advertises {} bytes; this server's -S is {size}", info.size));
        }
        let remote = RemoteSlice { addr: info.addr, len: info.size.into(), rkey: info.rkey };
        let local = Local::new(rdma_buf.take().ok_or("buffer lost")?, 0..info.size as usize)
            .map_err(err("local range"))?;
        c.qp.post_send(SendRequest::read(local, remote).wr_id(READ))
            .map_err(|e| format!("post send: {e}"))?;
        let Some(buf) = c.region(READ)? else { break };
        if args.verbose > 0 {
            println!("server ping data: {}", c_str(&buf));
        }
        rdma_buf = Some(buf);
        // Go ahead.
        c.send_info(send_buf.take().ok_or("buffer lost")?, Info { addr: 0, rkey: 0, size: 0 })?;
        let Some(sb) = c.region(SEND)? else { break };
        send_buf = Some(sb);
        // The client's sink buffer: RDMA Write the data back.
        let Some(info) = c.info()? else { break };
        let buf = rdma_buf.take().ok_or("buffer lost")?;
        // C's strlen(buf) + 1 within the bytes read: up to and including the first NUL.
        let read = size.min(info.size as usize);
        let len = buf[..read].iter().position(|&b| b == 0).map_or(read, |nul| nul + 1);
        let remote = RemoteSlice { addr: info.addr, len: len as u64, rkey: info.rkey };
        let local = Local::new(buf, 0..len).map_err(err("local range"))?;
        c.qp.post_send(SendRequest::write(local, remote).wr_id(WRITE))
            .map_err(|e| format!("post send: {e}"))?;
        let Some(buf) = c.region(WRITE)? else { break };
        rdma_buf = Some(buf);
        c.send_info(send_buf.take().ok_or("buffer lost")?, Info { addr: 0, rkey: 0, size: 0 })?;
        let Some(sb) = c.region(SEND)? else { break };
        send_buf = Some(sb);
    }
    eprintln!("server DISCONNECT EVENT...");
    Ok(())
}

/// The ping text: rping's `"rdma-ping-%d: "` then a cycle of letters, NUL-terminated.
fn fill(ping: u32, start: u8, size: usize) -> Vec<u8> {
    let mut b = vec![0u8; size];
    let text = format!("rdma-ping-{ping}: ");
    let n = text.len().min(size.saturating_sub(1));
    b[..n].copy_from_slice(&text.as_bytes()[..n]);
    let mut ch = start;
    for x in b.iter_mut().skip(text.len()) {
        *x = ch;
        ch += 1;
        if ch > 122 {
            ch = 65;
        }
    }
    b[size - 1] = 0;
    b
}

fn client(args: &Args) -> Res<()> {
    let timeout = Duration::from_secs(args.timeout);
    let size = args.size as usize;
    let addr = SocketAddr::new(args.addr.ok_or("the client needs -a ADDRESS")?, args.port);
    let ctx = cm::device_context(addr, timeout).map_err(err("rdma_resolve_addr"))?;
    let pd = ctx.alloc_pd().map_err(err("ibv_alloc_pd"))?;
    let cq = ctx.create_cq(32, None).map_err(err("ibv_create_cq"))?;
    let caps = ibverbs::QpCaps { max_send_wr: 16, max_recv_wr: 2, ..Default::default() };
    let deadline = Instant::now() + timeout;
    // A rejection may mean the server is not listening yet: retry until the deadline, then
    // report the rejection rather than the timeout of the last short attempt.
    let mut rejected: Option<Error> = None;
    let (id, qp) = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match cm::connect(addr, &pd, &cq, caps, &ConnParam::default(), left.max(Duration::from_millis(1))) {
            Ok(c) => break c,
            Err(e @ Error::Rejected { .. }) if Instant::now() < deadline => {
                rejected = Some(e);
                std::thread::sleep(Duration::from_millis(100).min(left));
            }
            Err(e) => {
                let e = match (e, rejected) {
                    (Error::Timeout { .. } | Error::Rejected { .. }, Some(r))
                    | (r @ Error::Rejected { .. }, None) => {
                        format!("{r} (retried for {timeout:?})")
                    }
                    (e, _) => e.to_string(),
                };
                return Err(format!("connect to {addr}: {e}"));
            }
        }
    };
    let mut c = Conn { id, qp, cq, infos: VecDeque::new(), regions: Vec::new(), timeout, debug: args.debug };
    c.post_recv(pd.allocate(INFO_LEN).map_err(err("ibv_reg_mr"))?)?;
    let start_buf = pd.allocate_remote(size, AccessFlags::REMOTE_READ).map_err(err("ibv_reg_mr"))?;
    let rdma_buf = pd.allocate_remote(size, AccessFlags::REMOTE_WRITE).map_err(err("ibv_reg_mr"))?;
    let mut send_buf = Some(pd.allocate(INFO_LEN).map_err(err("ibv_reg_mr"))?);
    let info_of = |r: &ibverbs::RemoteMemoryRegion| {
        let s = r.remote();
        Info { addr: s.addr, rkey: s.rkey, size: size as u32 }
    };
    let mut start = 65u8;
    let mut ping = 0u32;
    while args.count == 0 || ping < args.count {
        let data = fill(ping, start, size);
        start = if start >= 122 { 65 } else { start + 1 };
        start_buf.write(0, &data).map_err(err("copy"))?;
        c.send_info(send_buf.take().ok_or("buffer lost")?, info_of(&start_buf))?;
        send_buf = Some(c.region(SEND)?.ok_or("disconnected")?);
        c.info()?.ok_or("disconnected while waiting for RDMA_WRITE_ADV")?;
        c.send_info(send_buf.take().ok_or("buffer lost")?, info_of(&rdma_buf))?;
        send_buf = Some(c.region(SEND)?.ok_or("disconnected")?);
        c.info()?.ok_or("disconnected while waiting for RDMA_WRITE_COMPLETE")?;
        let got = rdma_buf.to_vec();
        if args.validate && got != data {
            return Err("data mismatch!".into());
        }
        if args.verbose > 0 {
            println!("ping data: {}", c_str(&got));
        }
        ping += 1;
    }
    c.id.disconnect().map_err(err("rdma_disconnect"))?;
    Ok(())
}

/// Waiting for one event of an id's own channel, for the example.
trait NextEvent {
    fn next_event_for_example(&self, timeout: Duration) -> Res<CmEventKind>;
}

impl NextEvent for CmId {
    fn next_event_for_example(&self, timeout: Duration) -> Res<CmEventKind> {
        let ch = self.channel();
        match ch.get_event(Some(timeout)).map_err(err("rdma_get_cm_event"))? {
            Some(ev) => Ok(ev.kind()),
            None => Err(format!("no event within {timeout:?}")),
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let r = if args.server { server(&args) } else { client(&args) };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rping: {e}");
            ExitCode::FAILURE
        }
    }
}
