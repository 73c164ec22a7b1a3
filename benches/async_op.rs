//! Instructions of one awaited operation of the async adaptor (`ibverbs::aio`), for the
//! instruction-count gate of `cargo xtask test` and `cargo xtask bench --callgrind`.
//!
//! Each iteration posts one signaled 8-byte inline RDMA Write through
//! [`AsyncQueuePair::post_send`] on a loopback RC pair (function `post_op`), sleeps 2 ms so that
//! the device has finished it, then polls the operation's future once (function `poll_op`),
//! which drives the driver's CQ, hands the completion to the operation's slot and resolves the
//! future. callgrind collects inside those two functions only
//! (`--toggle-collect=async_op::post_op --toggle-collect=async_op::poll_op`), so that the count
//! per operation is the adaptor's post + the poll that completes it, with no empty poll in it
//! unless the device was slower than the sleep: the summary line says how many polls found
//! nothing (`async_op: I operations, P polls (E empty)`).
//!
//! The future is polled by hand, with a waker that does nothing, and the driver watches the
//! channel through a backend whose readiness never fires: a poll that finds the CQ empty arms
//! it and returns `Pending`, and the loop polls again after another sleep. No reactor thread,
//! so nothing but the adaptor is counted.
//!
//! It needs a device: `cargo bench --no-run --bench async_op`, then run the binary where one
//! exists (e.g. `cargo xtask rxe -- target/release/deps/async_op-<hash>`). Without
//! `ASYNC_OP_ITERS` it runs 200 iterations after 5 uncounted ones.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use ibverbs::aio::{AsyncQueuePair, Backend, Driver, Op, Readiness, WatchedFd};
use ibverbs::{AccessFlags, Completion, ConnectOptions, Context, QpType, RemoteSlice, SendRequest};

/// A readiness that never fires: the benchmark polls by hand.
struct Never;

impl Readiness for Never {
    fn poll_readable(&self, _cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Poll::Pending
    }
}

/// A backend whose descriptors never become ready.
struct ByHand;

impl Backend for ByHand {
    fn watch(&self, _fd: WatchedFd) -> io::Result<Box<dyn Readiness>> {
        Ok(Box::new(Never))
    }
}

/// A waker that does nothing.
struct Noop;

impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

/// Gives up on a completion after this long.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Posts one operation (a function of its own for callgrind).
#[inline(never)]
fn post_op(qp: &AsyncQueuePair, data: &[u8; 8], remote: RemoteSlice) -> Result<Op, String> {
    qp.post_send(SendRequest::write_inline(data, remote)).map_err(|e| e.error.to_string())
}

/// Polls the operation's future once (a function of its own for callgrind).
#[inline(never)]
fn poll_op(op: &mut Op, cx: &mut TaskContext<'_>) -> Poll<ibverbs::Result<Completion>> {
    Pin::new(op).poll(cx)
}

/// `iters` operations; returns the polls made and how many found nothing. (A function of its
/// own: callgrind dumps its counts after each call.)
#[inline(never)]
fn run(qp: &AsyncQueuePair, remote: RemoteSlice, iters: usize) -> Result<(u64, u64), String> {
    let waker = Waker::from(Arc::new(Noop));
    let mut cx = TaskContext::from_waker(&waker);
    let data = *b"async_op";
    let (mut polls, mut empty) = (0u64, 0u64);
    for i in 0..iters {
        let mut op = post_op(qp, &data, remote)?;
        let deadline = Instant::now() + TIMEOUT;
        loop {
            std::thread::sleep(Duration::from_millis(2));
            polls += 1;
            match poll_op(&mut op, &mut cx) {
                Poll::Ready(Ok(c)) if c.is_ok() => break,
                Poll::Ready(Ok(c)) => return Err(format!("operation {i}: completion {:?}", c.status())),
                Poll::Ready(Err(e)) => return Err(format!("operation {i}: {e}")),
                Poll::Pending => empty += 1,
            }
            if Instant::now() > deadline {
                return Err(format!("operation {i}: no completion within {TIMEOUT:?}"));
            }
        }
    }
    Ok((polls, empty))
}

fn bench() -> Result<(), String> {
    let name = std::env::var("IBVERBS_TEST_DEVICE").ok();
    let ctx =
        Context::open(name.as_deref()).map_err(|e| format!("{e} (this benchmark needs an RDMA device)"))?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let channel = ctx.create_comp_channel().map_err(|e| e.to_string())?;
    let cq = ctx.create_cq(64, Some(&channel)).map_err(|e| e.to_string())?;
    let peer_cq = ctx.create_cq(64, None).map_err(|e| e.to_string())?;
    let build = |cq| pd.create_qp(cq, QpType::RC).max_send_wr(16).max_recv_wr(1).max_inline_data(64).build();
    let mut qp = build(&cq).map_err(|e| e.to_string())?;
    let mut peer = build(&peer_cq).map_err(|e| e.to_string())?;
    let gid_index = std::env::var("IBVERBS_TEST_GID_INDEX").ok().and_then(|v| v.parse().ok());
    let opts = ConnectOptions { gid_index, retry_cnt: 6, ..ConnectOptions::default() };
    let (a, b) =
        (qp.endpoint(&opts).map_err(|e| e.to_string())?, peer.endpoint(&opts).map_err(|e| e.to_string())?);
    qp.connect(&b, &opts).map_err(|e| e.to_string())?;
    peer.connect(&a, &opts).map_err(|e| e.to_string())?;
    let target = pd.allocate_remote(4096, AccessFlags::REMOTE_WRITE).map_err(|e| e.to_string())?;
    let remote = target.remote().slice(0, 8).map_err(|e| e.to_string())?;
    let driver = Driver::new(cq, &channel, &ByHand).map_err(|e| e.to_string())?;
    let qp = AsyncQueuePair::new(qp, &driver).map_err(|(_, e)| e.to_string())?;
    let iters = std::env::var("ASYNC_OP_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    // Uncounted warm-up (callgrind dumps after each `run`: the first dump is the warm-up's).
    run(&qp, remote, 5)?;
    let (polls, empty) = run(&qp, remote, iters)?;
    println!("async_op: {iters} operations, {polls} polls ({empty} empty)");
    let mut got = [0u8; 8];
    target.read(0, &mut got).map_err(|e| e.to_string())?;
    if got != *b"async_op" {
        return Err("the target does not hold the written bytes".into());
    }
    drop(qp);
    drop(driver);
    drop(peer);
    Ok(())
}

fn main() {
    if let Err(e) = bench() {
        eprintln!("async_op: {e}");
        std::process::exit(1);
    }
}
