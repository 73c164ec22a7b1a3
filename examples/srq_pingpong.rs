//! `srq_pingpong`: rdma-core's `ibv_srq_pingpong` on the safe API. Each side creates `-q` RC
//! queue pairs that all receive through one shared receive queue, and each queue pair ping-pongs
//! with its peer; it speaks the C tool's TCP address exchange (one address message per slot of the
//! C tool's 256-entry table, unused ones all zero), so either side may be `ibv_srq_pingpong`.
//!
//! ```text
//! srq_pingpong -d rxe0 -g 1              # server
//! srq_pingpong -d rxe0 -g 1 127.0.0.1    # client
//! ```
//!
//! Differences from the C tool are those of `rc_pingpong` (bounded waits, checked address
//! messages, RoCE v2 GID by default, `-c` fails the run on bad data, and checks every byte of
//! each page where the C tool checks the first); `-o` (ODP) is not offered.

mod common;
#[path = "selection/mod.rs"]
mod selection;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use ibverbs::{
    AccessFlags, Completion, ConnectOptions, Gid, LinkLayer, Local, Mtu, QpType, QueuePair, RecvRequest,
    SendRequest, SharedReceiveQueue,
};

use common::{Dest, Waiter, RECV_WRID, SEND_WRID};

/// Address messages per exchange: the C tool's `MAX_QP`, sent whatever `-q` is.
const MAX_QP: usize = 256;

/// Ping-pong over several RC queue pairs sharing one receive queue (like ibv_srq_pingpong):
/// without HOST, start a server and wait for a client; with HOST, connect to the server there.
#[derive(Debug, Parser)]
#[command(name = "srq_pingpong")]
struct Args {
    /// Listen on/connect to TCP port PORT
    #[arg(short = 'p', long, default_value_t = 18515)]
    port: u16,
    /// Use IB device DEV (default: IBVERBS_HCA/NCCL_IB_HCA's first usable port, else the first device found)
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    ib_dev: Option<String>,
    /// Use port PORT of the IB device (default: the environment's selection, else 1)
    #[arg(short = 'i', long = "ib-port", value_name = "PORT",
          value_parser = clap::value_parser!(u8).range(1..))]
    ib_port: Option<u8>,
    /// Size of message to exchange
    #[arg(short = 's', long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    size: u32,
    /// Path MTU (256, 512, 1024, 2048 or 4096)
    #[arg(short = 'm', long, default_value = "1024", value_parser = common::parse_mtu)]
    mtu: Mtu,
    /// Number of QPs
    #[arg(short = 'q', long = "num-qp", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..MAX_QP as i64))]
    num_qp: u32,
    /// Number of receives to post at a time (the SRQ's depth)
    #[arg(short = 'r', long = "rx-depth", value_name = "DEPTH", default_value_t = 500,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    rx_depth: u32,
    /// Number of exchanges
    #[arg(short = 'n', long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Service level value
    #[arg(short = 'l', long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..16))]
    sl: u8,
    /// Sleep on CQ events (default poll)
    #[arg(short = 'e', long)]
    events: bool,
    /// Local port GID index (default: the RoCE v2 IPv4 GID on RoCE, none on InfiniBand)
    #[arg(short = 'g', long = "gid-idx", value_name = "INDEX")]
    gid_idx: Option<u32>,
    /// Validate the received buffer (server side)
    #[arg(short = 'c', long)]
    chk: bool,
    /// Seconds to keep trying to reach the server, and to wait for the peer at any later step
    #[arg(long, value_name = "SECS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=common::net::MAX_WAIT_SECS))]
    timeout: u64,
    /// Seconds the server waits for a client [default: --timeout]
    #[arg(long = "accept-timeout", value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=common::net::MAX_WAIT_SECS))]
    accept_timeout: Option<u64>,
    /// Server to connect to (omit to be the server)
    host: Option<String>,
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("srq_pingpong: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Posts receives into `buf` on the SRQ until `depth` are outstanding; returns how many are.
fn refill(
    srq: &mut SharedReceiveQueue,
    buf: &Arc<ibverbs::RemoteMemoryRegion>,
    len: usize,
) -> Result<u32, String> {
    let mut wrs = Vec::with_capacity((srq.capacity() - srq.outstanding()) as usize);
    for _ in srq.outstanding()..srq.capacity() {
        let local = Local::new(buf.clone(), ..len).map_err(|e| e.to_string())?;
        wrs.push(RecvRequest::new(local).wr_id(RECV_WRID));
    }
    srq.post_recv_chain(&mut wrs)
        .map_err(|e| format!("Couldn't post receive ({}): {e}", srq.outstanding()))?;
    Ok(srq.outstanding())
}

fn run(args: &Args) -> Result<(), String> {
    if args.num_qp > args.rx_depth {
        return Err(format!(
            "rx_depth {} is too small for {} QPs -- must have at least one receive per QP.",
            args.rx_depth, args.num_qp
        ));
    }
    let timeout = Duration::from_secs(args.timeout);
    let accept_wait = Duration::from_secs(args.accept_timeout.unwrap_or(args.timeout));
    let size = args.size as usize;
    let num_qp = args.num_qp as usize;
    let target = selection::target(args.ib_dev.as_deref(), args.ib_port, args.gid_idx)?;
    let (ctx, ib_port, gid_idx) = (target.ctx, target.port, target.gid_index);
    let port =
        ctx.query_port(ib_port).map_err(|e| format!("Couldn't get port info of port {}: {e}", ib_port))?;
    if port.link_layer() != LinkLayer::ETHERNET && port.lid() == 0 {
        return Err("Couldn't get local LID".into());
    }
    let opts = ConnectOptions {
        port: ib_port,
        gid_index: gid_idx,
        mtu: Some(args.mtu),
        sl: args.sl,
        timeout: target.connect.timeout,
        // 7 means "retry forever" on SoftRoCE: a vanished peer must end the run.
        retry_cnt: if target.retry_set { target.connect.retry_cnt } else { 6 },
        ..ConnectOptions::default()
    };

    let channel =
        if args.events { Some(ctx.create_comp_channel().map_err(|e| e.to_string())?) } else { None };
    let pd = ctx.alloc_pd().map_err(|e| format!("Couldn't allocate PD: {e}"))?;
    // One buffer, as in the C tool, shared by every send and every receive of every queue pair:
    // a `RemoteMemoryRegion` (only copied into and out of), with no remote access right granted.
    common::memory::check(size as u64, "the message buffer")?;
    let buf = Arc::new(
        pd.allocate_remote(size, AccessFlags::LOCAL_WRITE)
            .map_err(|e| format!("Couldn't allocate and register a buffer of {size} bytes: {e}"))?,
    );
    // The C tool fills its buffer with zeros (not the 0x7b of ibv_rc_pingpong), and its `-c`
    // pattern is a 0 at the start of every page: all zeros, sent and expected.
    buf.fill(0);

    let mut cq = ctx
        .create_cq(args.rx_depth + args.num_qp, channel.as_ref())
        .map_err(|e| format!("Couldn't create CQ: {e}"))?;
    let mut srq = pd.create_srq(args.rx_depth, 1).map_err(|e| format!("Couldn't create SRQ: {e}"))?;
    let mut qps = Vec::with_capacity(num_qp);
    for _ in 0..num_qp {
        let mut qp = pd
            .create_qp(&cq, QpType::RC)
            .max_send_wr(1)
            .srq(&srq)
            .build()
            .map_err(|e| format!("Couldn't create QP: {e}"))?;
        qp.init(&opts).map_err(|e| format!("Failed to modify QP to INIT: {e}"))?;
        qps.push(qp);
    }
    let inline_data = if size <= qps[0].caps().max_inline_data as usize {
        let mut data = vec![0u8; size];
        buf.read(0, &mut data).map_err(|e| e.to_string())?;
        Some(data)
    } else {
        None
    };

    let mut routs = refill(&mut srq, &buf, size)?;
    if args.events {
        cq.req_notify(false).map_err(|e| format!("Couldn't request CQ notification: {e}"))?;
    }
    if let Some(index) = gid_idx {
        ctx.query_gid(ib_port, index).map_err(|e| format!("can't read sgid of index {index}: {e}"))?;
    }
    let zero = Dest { lid: 0, qpn: 0, psn: 0, gid: Gid::default() };
    let mut mine = vec![zero; MAX_QP];
    for (me, qp) in mine.iter_mut().zip(&qps) {
        let ep = qp.endpoint(&opts).map_err(|e| format!("Couldn't get the local address: {e}"))?;
        *me = Dest::from_endpoint(&ep);
        println!(
            "  local address:  LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
            me.lid,
            me.qpn,
            me.psn,
            common::ntop(&me.gid.0)
        );
    }
    let connect_all = |qps: &mut [QueuePair], remote: &[Dest]| {
        qps.iter_mut()
            .zip(remote)
            .try_for_each(|(qp, r)| qp.connect(&r.to_endpoint(), &opts).map_err(|e| e.to_string()))
    };
    let remote = match &args.host {
        Some(host) => common::client_exchange_all(host, args.port, timeout, &mine)?,
        None => {
            common::server_exchange_all(args.port, accept_wait, timeout, &mine, |r| connect_all(&mut qps, r))?
        }
    };
    for r in &remote[..num_qp] {
        println!(
            "  remote address: LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
            r.lid,
            r.qpn,
            r.psn,
            common::ntop(&r.gid.0)
        );
    }
    if args.host.is_some() {
        connect_all(&mut qps, &remote)?;
    }

    let post_send = |qp: &mut QueuePair| {
        let wr = match &inline_data {
            Some(data) => SendRequest::send_inline(data),
            None => SendRequest::send(Local::new(buf.clone(), ..size).map_err(|e| e.to_string())?),
        };
        qp.post_send(wr.wr_id(SEND_WRID)).map_err(|e| format!("Couldn't post send: {}", e.error))
    };
    // What each queue pair waits for before its next send, as in the C tool.
    let mut pending = vec![RECV_WRID; num_qp];
    if args.host.is_some() {
        for (qp, p) in qps.iter_mut().zip(&mut pending) {
            post_send(qp)?;
            *p = RECV_WRID | SEND_WRID;
        }
    }
    let qpns: Vec<u32> = qps.iter().map(QueuePair::qp_num).collect();
    let mut waiter = Waiter { cq: &mut cq, channel: channel.as_ref(), idle: timeout };
    let mut wcs: Vec<Completion> =
        (0..num_qp + args.rx_depth as usize).map(|_| Completion::default()).collect();
    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    while rcnt < args.iters || scnt < args.iters {
        for wc in waiter.wait(&mut wcs)?.iter() {
            if !wc.is_ok() {
                return Err(common::failed_status(wc));
            }
            let i = qpns
                .iter()
                .position(|&n| n == wc.qp_num())
                .ok_or_else(|| format!("Couldn't find QPN {:06x}", wc.qp_num()))?;
            match wc.wr_id() {
                SEND_WRID => scnt += 1,
                RECV_WRID => {
                    if args.chk {
                        common::check_message_len(wc, size)?;
                    }
                    routs -= 1;
                    if routs <= args.num_qp {
                        routs = refill(&mut srq, &buf, size)?;
                    }
                    rcnt += 1;
                }
                other => return Err(format!("Completion for unknown wr_id {other}")),
            }
            pending[i] &= !wc.wr_id();
            if scnt < args.iters && pending[i] == 0 {
                post_send(&mut qps[i])?;
                pending[i] = RECV_WRID | SEND_WRID;
            }
        }
    }
    common::print_summary(args.size, args.iters, start.elapsed());

    if args.chk && args.host.is_none() {
        let page = common::page_size();
        let mut got = vec![0u8; size];
        buf.read(0, &mut got).map_err(|e| e.to_string())?;
        let bad: Vec<usize> =
            got.chunks(page).enumerate().filter(|(_, p)| p.iter().any(|&b| b != 0)).map(|(i, _)| i).collect();
        for page in &bad {
            println!("invalid data in page {page}");
        }
        if !bad.is_empty() {
            return Err(format!("{} page(s) of the received buffer hold unexpected data", bad.len()));
        }
    }
    Ok(())
}
