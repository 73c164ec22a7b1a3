//! `rdma_server`: rdmacm-utils' `rdma_server` on the safe API. Waits for one client, receives
//! its 16-byte message, answers with 16 bytes and disconnects; the client may be rdma-core's
//! `rdma_client` or ours.
//!
//! ```text
//! rdma_server -s 192.0.2.1        # then: rdma_client -s 192.0.2.1
//! ```
//!
//! Differences from the C tool: every wait is bounded by `--timeout` seconds; it prints the
//! address it listens on once it does.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use ibverbs::cm::{CmEventKind, ConnParam, EventChannel};
use ibverbs::{CompletionQueue, Local, QpType, RecvRequest, SendRequest, WcStatus};

/// Receives one 16-byte message over an RDMA-CM connection and answers it (like rdma_server).
#[derive(Debug, Parser)]
#[command(name = "rdma_server")]
struct Args {
    /// Address to listen on (default: all)
    #[arg(short = 's')]
    server: Option<IpAddr>,
    /// Port
    #[arg(short = 'p', default_value_t = 7471)]
    port: u16,
    /// Bound on every wait, in seconds
    #[arg(long, default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    timeout: u64,
}

/// Polls `cq` for one completion within `timeout`; its status must be SUCCESS.
fn wait_one(cq: &mut CompletionQueue, timeout: Duration) -> Result<ibverbs::Completion, String> {
    let deadline = Instant::now() + timeout;
    let mut buf: [ibverbs::Completion; 1] = Default::default();
    loop {
        if cq.poll(&mut buf).map_err(|e| e.to_string())?.len() == 1 {
            let c = std::mem::take(&mut buf[0]);
            if c.status() != WcStatus::SUCCESS {
                return Err(format!("completion failed: {:?}", c.status()));
            }
            return Ok(c);
        }
        if Instant::now() > deadline {
            return Err(format!("no completion within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn run(args: &Args) -> Result<(), String> {
    let timeout = Duration::from_secs(args.timeout);
    let e = |what: &'static str| move |err: ibverbs::Error| format!("{what}: {err}");
    let ch = EventChannel::new().map_err(e("rdma_create_event_channel"))?;
    let listen = ch.create_id().map_err(e("rdma_create_id"))?;
    let addr = SocketAddr::new(args.server.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), args.port);
    listen.bind(addr).map_err(e("rdma_bind_addr"))?;
    listen.listen(0).map_err(e("rdma_listen"))?;
    println!("rdma_server: listening on {addr}");
    let mut ev = ch.get_event(Some(timeout)).map_err(e("rdma_get_cm_event"))?.ok_or("no client")?;
    let id = match ev.take_new_id() {
        Some(id) => id,
        None => return Err(format!("unexpected event {:?}", ev.kind())),
    };
    let ctx = id.context().map_err(e("context"))?;
    let pd = ctx.alloc_pd().map_err(e("ibv_alloc_pd"))?;
    let mut cq = ctx.create_cq(4, None).map_err(e("ibv_create_cq"))?;
    let mut qp = pd
        .create_qp(&cq, QpType::RC)
        .max_send_wr(1)
        .max_recv_wr(1)
        .max_inline_data(16)
        .build_on(&id)
        .map_err(e("rdma_create_qp"))?;
    let recv = pd.allocate(16).map_err(e("ibv_reg_mr"))?;
    qp.post_recv(RecvRequest::new(Local::whole(recv))).map_err(|x| format!("post recv: {x}"))?;
    id.accept(&ConnParam::default()).map_err(e("rdma_accept"))?;
    match id.channel().get_event(Some(timeout)).map_err(e("rdma_get_cm_event"))? {
        Some(ev) if ev.kind() == CmEventKind::ESTABLISHED => {}
        other => return Err(format!("wait for ESTABLISHED: {other:?}")),
    }
    qp.cm_established().map_err(e("ibv_query_qp"))?;
    let got = wait_one(&mut cq, timeout)?;
    if got.byte_len() != 16 {
        return Err(format!("received {} bytes, expected 16", got.byte_len()));
    }
    let msg = [0u8; 16];
    qp.post_send(SendRequest::send_inline(&msg)).map_err(|x| format!("post send: {x}"))?;
    wait_one(&mut cq, timeout)?;
    id.disconnect().map_err(e("rdma_disconnect"))?;
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    println!("rdma_server: start");
    let r = run(&args);
    if let Err(e) = &r {
        eprintln!("rdma_server: {e}");
    }
    println!("rdma_server: end {}", if r.is_ok() { 0 } else { -1 });
    if r.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
