//! `rc_pingpong`: rdma-core's `ibv_rc_pingpong` on the safe API. Two processes connect Reliable
//! Connected queue pairs and bounce a message back and forth; it speaks the C tool's TCP address
//! exchange, so either side may be `ibv_rc_pingpong`.
//!
//! ```text
//! rc_pingpong -d rxe0 -g 1              # server
//! rc_pingpong -d rxe0 -g 1 127.0.0.1    # client
//! ```
//!
//! Differences from the C tool: without `-g`, RoCE ports use their RoCE v2 IPv4 GID (the C tool
//! needs `-g` there); every wait is bounded: the server waits `--accept-timeout` seconds (by
//! default `--timeout`) for a client, the client retries connecting for `--timeout` seconds, every
//! later read or write of the exchange and every wait for a completion fails after `--timeout`
//! seconds; the peer's address message is checked byte by byte (a peer speaking anything else is
//! refused at its first wrong byte); the message buffer (one, as in the C tool) is checked
//! against the memory available before it is allocated; `-c` fails the run on bad data. Every
//! failure is one line on stderr and a non-zero exit.

mod common;
#[path = "selection/mod.rs"]
mod selection;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use ibverbs::{AccessFlags, ConnectOptions, LinkLayer, Local, Mtu, QpType, QueuePair, SendRequest};

use common::{Dest, Receives, Waiter, SEND_WRID};

/// Ping-pong over an RC queue pair (like ibv_rc_pingpong): without HOST, start a server and wait
/// for a client; with HOST, connect to the server there.
#[derive(Debug, Parser)]
#[command(name = "rc_pingpong")]
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
    /// Number of receives to post at a time
    #[arg(short = 'r', long = "rx-depth", value_name = "DEPTH", default_value_t = 500,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
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
            eprintln!("rc_pingpong: {e}");
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
        // IBVERBS_TIMEOUT/NCCL_IB_TIMEOUT (default 14) and IBVERBS_RETRY_CNT/NCCL_IB_RETRY_CNT;
        // without the latter 6: 7 means "retry forever" on SoftRoCE, a vanished peer must end the run.
        timeout: target.connect.timeout,
        retry_cnt: if target.retry_set { target.connect.retry_cnt } else { 6 },
        ..ConnectOptions::default()
    };

    let channel =
        if args.events { Some(ctx.create_comp_channel().map_err(|e| e.to_string())?) } else { None };
    let pd = ctx.alloc_pd().map_err(|e| format!("Couldn't allocate PD: {e}"))?;
    // One buffer, as in the C tool: every send goes from it and every receive lands in it. Memory
    // the device writes while several posted requests share it is what `RemoteMemoryRegion`
    // models (only copied into and out of); no remote access right is granted.
    common::memory::check(size as u64, "the message buffer")?;
    let buf = Arc::new(
        pd.allocate_remote(size, AccessFlags::LOCAL_WRITE)
            .map_err(|e| format!("Couldn't allocate and register a buffer of {size} bytes: {e}"))?,
    );
    // What we send: the C tools' fill byte, and with -c their check pattern.
    common::fill_pattern(&buf, 0, size, args.chk)?;

    let mut cq =
        ctx.create_cq(args.rx_depth + 1, channel.as_ref()).map_err(|e| format!("Couldn't create CQ: {e}"))?;
    let mut qp = pd
        .create_qp(&cq, QpType::RC)
        .max_send_wr(1)
        .max_recv_wr(args.rx_depth)
        .build()
        .map_err(|e| format!("Couldn't create QP: {e}"))?;
    // Inline sends copy their bytes when posted: a copy of the buffer's (small) contents.
    let inline_data = if size <= qp.caps().max_inline_data as usize {
        let mut data = vec![0u8; size];
        buf.read(0, &mut data).map_err(|e| e.to_string())?;
        Some(data)
    } else {
        None
    };
    qp.init(&opts).map_err(|e| format!("Failed to modify QP to INIT: {e}"))?;

    let mut rx = Receives::new(buf.clone(), size, args.rx_depth).checking_lengths(args.chk);
    rx.refill(&mut qp)?;
    if args.events {
        cq.req_notify(false).map_err(|e| format!("Couldn't request CQ notification: {e}"))?;
    }

    if let Some(index) = gid_idx {
        ctx.query_gid(ib_port, index).map_err(|e| format!("can't read sgid of index {index}: {e}"))?;
    }
    let ep = qp.endpoint(&opts).map_err(|e| format!("Couldn't get the local address: {e}"))?;
    let me = Dest::from_endpoint(&ep);
    println!(
        "  local address:  LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        me.lid,
        me.qpn,
        me.psn,
        common::ntop(&me.gid.0)
    );

    let connect = |qp: &mut QueuePair, remote: &Dest| {
        qp.connect(&remote.to_endpoint(), &opts).map_err(|e| e.to_string())
    };
    let remote = match &args.host {
        Some(host) => common::client_exchange(host, args.port, timeout, &me)?,
        None => {
            common::server_exchange(args.port, accept_wait, timeout, &me, |remote| connect(&mut qp, remote))?
        }
    };
    println!(
        "  remote address: LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        remote.lid,
        remote.qpn,
        remote.psn,
        common::ntop(&remote.gid.0)
    );
    if args.host.is_some() {
        connect(&mut qp, &remote)?;
    }

    let post_send = |qp: &mut QueuePair| {
        let wr = match &inline_data {
            Some(data) => SendRequest::send_inline(data),
            None => SendRequest::send(Local::new(buf.clone(), ..size)?),
        };
        qp.post_send(wr.wr_id(SEND_WRID)).map_err(|e| e.error)
    };
    let mut waiter = Waiter { cq: &mut cq, channel: channel.as_ref(), idle: timeout };
    let elapsed =
        common::pingpong(&mut qp, &mut waiter, &mut rx, args.iters, args.host.is_some(), post_send)?;
    common::print_summary(args.size, args.iters, elapsed);

    if args.chk && args.host.is_none() {
        let bad = common::invalid_pages(&buf, 0, size)?;
        for page in &bad {
            println!("invalid data in page {page}");
        }
        if !bad.is_empty() {
            return Err(format!("{} page(s) of the received buffer hold unexpected data", bad.len()));
        }
    }
    Ok(())
}
