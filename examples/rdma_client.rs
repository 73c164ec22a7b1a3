//! `rdma_client`: rdmacm-utils' `rdma_client` on the safe API. Connects, sends a 16-byte
//! message, waits for the 16-byte answer and disconnects; the server may be rdma-core's
//! `rdma_server` or ours.
//!
//! ```text
//! rdma_client -s 192.0.2.1
//! ```
//!
//! Differences from the C tool: every wait is bounded by `--timeout` seconds, and a rejected
//! connection (no server yet) is retried until then.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use ibverbs::cm::{self, ConnParam};
use ibverbs::{CompletionQueue, Error, Local, QpCaps, RecvRequest, SendRequest, WcStatus};

/// Sends one 16-byte message over an RDMA-CM connection and waits for the answer (like
/// rdma_client).
#[derive(Debug, Parser)]
#[command(name = "rdma_client")]
struct Args {
    /// Server address
    #[arg(short = 's', default_value = "127.0.0.1")]
    server: IpAddr,
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
    let e = |what: &'static str| move |err: Error| format!("{what}: {err}");
    let addr = SocketAddr::new(args.server, args.port);
    let ctx = cm::device_context(addr, timeout).map_err(e("rdma_resolve_addr"))?;
    let pd = ctx.alloc_pd().map_err(e("ibv_alloc_pd"))?;
    let mut cq = ctx.create_cq(4, None).map_err(e("ibv_create_cq"))?;
    let caps = QpCaps { max_send_wr: 1, max_recv_wr: 1, max_inline_data: 16, ..QpCaps::default() };
    let deadline = Instant::now() + timeout;
    let (id, mut qp) = loop {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        match cm::connect(addr, &pd, &cq, caps, &ConnParam::default(), left) {
            Ok(c) => break c,
            Err(Error::Rejected { .. }) if Instant::now() + Duration::from_millis(200) < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(x) => return Err(format!("connect to {addr}: {x}")),
        }
    };
    let recv = pd.allocate(16).map_err(e("ibv_reg_mr"))?;
    qp.post_recv(RecvRequest::new(Local::whole(recv))).map_err(|x| format!("post recv: {x}"))?;
    let msg = [0u8; 16];
    qp.post_send(SendRequest::send_inline(&msg)).map_err(|x| format!("post send: {x}"))?;
    // The send's and the answer's completions, in either order.
    let a = wait_one(&mut cq, timeout).map_err(|x| format!("{x} (none of the send and the answer)"))?;
    let first = if a.opcode() == ibverbs::WcOpcode::RECV { "answer" } else { "send" };
    let b = wait_one(&mut cq, timeout).map_err(|x| format!("{x} (after the {first})"))?;
    let answer = if a.opcode() == ibverbs::WcOpcode::RECV { a } else { b };
    if answer.byte_len() != 16 {
        return Err(format!("received {} bytes, expected 16", answer.byte_len()));
    }
    id.disconnect().map_err(e("rdma_disconnect"))?;
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    println!("rdma_client: start");
    let r = run(&args);
    if let Err(e) = &r {
        eprintln!("rdma_client: {e}");
    }
    println!("rdma_client: end {}", if r.is_ok() { 0 } else { -1 });
    if r.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
