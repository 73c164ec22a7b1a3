//! `ud_pingpong`: rdma-core's `ibv_ud_pingpong` on the safe API. Two processes bounce a datagram
//! back and forth between Unreliable Datagram queue pairs, each sending through an address handle
//! for the other; it speaks the C tool's TCP address exchange, so either side may be
//! `ibv_ud_pingpong`.
//!
//! ```text
//! ud_pingpong -d rxe0 -g 1              # server
//! ud_pingpong -d rxe0 -g 1 127.0.0.1    # client
//! ```
//!
//! A UD message is at most one MTU, and every receive lands in the buffer with 40 bytes in front
//! for the Global Routing Header the device writes there (one buffer, as in the C tool: sends go
//! from the bytes after the GRH). Differences from the C tool are those of `rc_pingpong`:
//! automatic RoCE v2 GID without `-g`, every wait bounded (`--accept-timeout`, `--timeout`: a
//! lost peer, or a lost datagram, ends the run), the address message checked byte by byte, and
//! `-c` failing the run on bad data.

mod common;
#[path = "selection/mod.rs"]
mod selection;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use ibverbs::{AccessFlags, ConnectOptions, Local, QpType, QueuePair, SendRequest};

use common::{Dest, Receives, Waiter, SEND_WRID};

/// Bytes of Global Routing Header in front of every UD receive.
const GRH: usize = 40;
/// The Q_Key both C tools use.
const QKEY: u32 = 0x1111_1111;

/// Ping-pong over a UD queue pair (like ibv_ud_pingpong): without HOST, start a server and wait
/// for a client; with HOST, connect to the server there.
#[derive(Debug, Parser)]
#[command(name = "ud_pingpong")]
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
    /// Size of message to exchange (at most the port's active MTU)
    #[arg(short = 's', long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    size: u32,
    /// Number of receives to post at a time
    #[arg(short = 'r', long = "rx-depth", value_name = "DEPTH", default_value_t = 500,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    rx_depth: u32,
    /// Number of exchanges
    #[arg(short = 'n', long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Send messages with service level SL
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
            eprintln!("ud_pingpong: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let timeout = Duration::from_secs(args.timeout);
    let accept_wait = Duration::from_secs(args.accept_timeout.unwrap_or(args.timeout));
    let size = args.size as usize;
    // Flags win; where absent, IBVERBS_*/NCCL_IB_* (device, port, GID index, timeout, retries).
    let target = selection::target(args.ib_dev.as_deref(), args.ib_port, args.gid_idx)?;
    let (ctx, ib_port, gid_idx) = (target.ctx, target.port, target.gid_index);
    let port = ctx
        .query_port(ib_port)
        .map_err(|e| format!("Unable to query port info for port {}: {e}", ib_port))?;
    let mtu = port.active_mtu().bytes().unwrap_or(0);
    if args.size > mtu {
        return Err(format!("Requested size larger than port MTU ({mtu})"));
    }
    let opts = ConnectOptions {
        port: ib_port,
        gid_index: gid_idx,
        sl: args.sl,
        qkey: QKEY,
        ..ConnectOptions::default()
    };

    let channel =
        if args.events { Some(ctx.create_comp_channel().map_err(|e| e.to_string())?) } else { None };
    let pd = ctx.alloc_pd().map_err(|e| format!("Couldn't allocate PD: {e}"))?;
    // One buffer, as in the C tool: receives land in it (the GRH first), sends go from its bytes
    // after the GRH. Memory the device writes while several posted requests share it is what
    // `RemoteMemoryRegion` models (only copied into and out of); no remote access right.
    let buf = Arc::new(
        pd.allocate_remote(size + GRH, AccessFlags::LOCAL_WRITE)
            .map_err(|e| format!("Couldn't allocate and register a buffer of {} bytes: {e}", size + GRH))?,
    );
    // What we send: the C tools' fill byte, and with -c their check pattern.
    buf.fill(0x7b);
    common::fill_pattern(&buf, GRH, size, args.chk)?;

    let mut cq =
        ctx.create_cq(args.rx_depth + 1, channel.as_ref()).map_err(|e| format!("Couldn't create CQ: {e}"))?;
    let mut qp = pd
        .create_qp(&cq, QpType::UD)
        .max_send_wr(1)
        .max_recv_wr(args.rx_depth)
        .build()
        .map_err(|e| format!("Couldn't create QP: {e}"))?;
    // Inline sends copy their bytes when posted: a copy of the buffer's (small) contents.
    let inline_data = if size <= qp.caps().max_inline_data as usize {
        let mut data = vec![0u8; size];
        buf.read(GRH, &mut data).map_err(|e| e.to_string())?;
        Some(data)
    } else {
        None
    };
    qp.init(&opts).map_err(|e| format!("Failed to modify QP to INIT: {e}"))?;

    let mut rx = Receives::new(buf.clone(), size + GRH, args.rx_depth).checking_lengths(args.chk);
    rx.refill(&mut qp)?;
    if args.events {
        cq.req_notify(false).map_err(|e| format!("Couldn't request CQ notification: {e}"))?;
    }

    if let Some(index) = gid_idx {
        ctx.query_gid(ib_port, index)
            .map_err(|e| format!("Could not get local gid for gid index {index}: {e}"))?;
    }
    let ep = qp.endpoint(&opts).map_err(|e| format!("Couldn't get the local address: {e}"))?;
    let me = Dest::from_endpoint(&ep);
    // The C tool's line, with its colon before "GID".
    println!(
        "  local address:  LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}: GID {}",
        me.lid,
        me.qpn,
        me.psn,
        common::ntop(&me.gid.0)
    );

    // Bringing a UD QP up needs no peer; the address handle is the path to it.
    let connect = |qp: &mut QueuePair, remote: &Dest| {
        qp.activate_ud(&opts).map_err(|e| format!("Failed to bring the QP to RTS: {e}"))?;
        pd.create_ah(&remote.to_endpoint(), &opts).map_err(|e| format!("Failed to create AH: {e}"))
    };
    let (remote, ah) = match &args.host {
        Some(host) => {
            let remote = common::client_exchange(host, args.port, timeout, &me)?;
            let ah = connect(&mut qp, &remote)?;
            (remote, ah)
        }
        None => {
            let mut ah = None;
            let remote = common::server_exchange(args.port, accept_wait, timeout, &me, |remote| {
                ah = Some(connect(&mut qp, remote)?);
                Ok(())
            })?;
            (remote, ah.ok_or("no address handle")?)
        }
    };
    println!(
        "  remote address: LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        remote.lid,
        remote.qpn,
        remote.psn,
        common::ntop(&remote.gid.0)
    );

    let post_send = |qp: &mut QueuePair| {
        let wr = match &inline_data {
            Some(data) => SendRequest::send_inline(data),
            None => SendRequest::send(Local::new(buf.clone(), GRH..GRH + size)?),
        };
        qp.post_send(wr.ud(&ah, remote.qpn, QKEY).wr_id(SEND_WRID)).map_err(|e| e.error)
    };
    let mut waiter = Waiter { cq: &mut cq, channel: channel.as_ref(), idle: timeout };
    let elapsed =
        common::pingpong(&mut qp, &mut waiter, &mut rx, args.iters, args.host.is_some(), post_send)?;
    common::print_summary(args.size, args.iters, elapsed);

    if args.chk && args.host.is_none() {
        let bad = common::invalid_pages(&buf, GRH, size)?;
        for page in &bad {
            println!("invalid data in page {page}");
        }
        if !bad.is_empty() {
            return Err(format!("{} page(s) of the received buffer hold unexpected data", bad.len()));
        }
    }
    Ok(())
}
