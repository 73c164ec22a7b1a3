//! The program a new user writes first, ported from C (`examples/perf/newuser.c`, issue 46): two
//! RC queue pairs of one device in one thread, connected to each other, one CQ per QP.
//!
//! `newuser lat N`: N ping-pongs of 8-byte Sends (a warm-up of N/10 excluded): A sends, B polls
//! its receive, re-posts it and sends back, A polls its send and receive, B polls its send. At
//! the safe level (the default) each post moves an owned 8-byte [`MemoryRegion`] in
//! (`post_send(SendRequest::send(Local::whole(mr)))`, `post_recv(RecvRequest::new(...))`) and
//! the completion hands it back ([`Completion::take_buffers`]); each wait is a busy
//! [`CompletionQueue::poll`] into a one-entry array. With `--unsafe`: the crate's `unsafe` level,
//! [`QueuePair::post_send_unchecked`] / [`post_recv_unchecked`](QueuePair::post_recv_unchecked)
//! of raw requests built once and [`CompletionQueue::poll_raw`], the steps of the C program.
//!
//! `newuser bw N`: N RDMA Writes of `SIZE` bytes (default 65536) from A into B with up to
//! `WINDOW` (default 16) outstanding, each completion polled one at a time; the safe level posts
//! `SendRequest::write(Local::whole(src.clone()), target.remote())` from an
//! `Arc<MemoryRegion>`.
//!
//! Environment: `IBVERBS_TEST_DEVICE`, `IBVERBS_TEST_GID_INDEX` (default 1), `SIZE`, `WINDOW`;
//! `EMPTY_POLLS=K` (latency mode) polls A's empty CQ K times before the loop, untimed (under
//! callgrind, the difference to K=0 is the cost of K empty polls at the level run).
//! Prints one `RESULT` line, in the C program's format. Run it with `examples/perf/newuser.sh`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use ibverbs::raw::{self, RawRecv, RawSend};
use ibverbs::{
    AccessFlags, Completion, CompletionQueue, ConnectOptions, Context, Local, MemoryRegion, QpType,
    QueuePair, RecvRequest, SendRequest, WorkCompletion,
};

const SEND_ID: u64 = 1;
const RECV_ID: u64 = 2;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let unsafe_level = args.iter().any(|a| a == "--unsafe");
    let pos: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let (Some(mode), Some(Ok(iters))) = (pos.first(), pos.get(1).map(|n| n.parse::<u64>())) else {
        eprintln!("usage: newuser [--unsafe] lat|bw N");
        return ExitCode::from(2);
    };
    match run(mode, iters, unsafe_level) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("newuser: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One side: its CQ and QP.
struct Side {
    cq: CompletionQueue,
    qp: QueuePair,
}

fn run(mode: &str, iters: u64, unsafe_level: bool) -> ibverbs::Result<String> {
    let name = std::env::var("IBVERBS_TEST_DEVICE").ok();
    let ctx = Context::open(name.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let opts = ConnectOptions { gid_index: Some(env("IBVERBS_TEST_GID_INDEX", 1)), ..Default::default() };
    let side = || -> ibverbs::Result<Side> {
        let cq = ctx.create_cq(64, None)?;
        let qp = pd.create_qp(&cq, QpType::RC).max_send_wr(16).max_recv_wr(16).build()?;
        Ok(Side { cq, qp })
    };
    let (mut a, mut b) = (side()?, side()?);
    let (ea, eb) = (a.qp.endpoint(&opts)?, b.qp.endpoint(&opts)?);
    a.qp.connect(&eb, &opts)?;
    b.qp.connect(&ea, &opts)?;
    let level = if unsafe_level { "unsafe" } else { "safe" };
    let warm = iters / 10;
    if mode == "lat" {
        let empties: u64 = env("EMPTY_POLLS", 0);
        let (mut raw_wc, mut wc) = ([WorkCompletion::default()], [Completion::default()]);
        for _ in 0..empties {
            let got =
                if unsafe_level { a.cq.poll_raw(&mut raw_wc)?.len() } else { a.cq.poll(&mut wc)?.len() };
            if got != 0 {
                return Err(ibverbs::Error::InvalidArgument {
                    verb: "newuser",
                    reason: "EMPTY_POLLS: the CQ is not empty",
                });
            }
        }
        let mut empty = 0u64;
        let (t, med, empty) = if unsafe_level {
            lat_unsafe(&pd, &mut a, &mut b, warm, iters, &mut empty)?
        } else {
            lat_safe(&pd, &mut a, &mut b, warm, iters, &mut empty)?
        };
        let n = iters as f64;
        Ok(format!(
            "RESULT newuser lang=rust level={level} mode=lat iters={iters} rtt_us={:.3} lat_us={:.3} med_us={:.3} empty_per_rtt={:.3}",
            t / n * 1e6,
            t / n / 2.0 * 1e6,
            med / 2.0 * 1e6,
            empty as f64 / n
        ))
    } else if mode == "bw" {
        let size: usize = env("SIZE", 65536);
        let window: u64 = env("WINDOW", 16);
        if iters < CHUNK {
            return Err(ibverbs::Error::InvalidArgument {
                verb: "newuser",
                reason: "bw needs at least 50 writes",
            });
        }
        let (t, med) = if unsafe_level {
            bw_unsafe(&pd, &mut a, size, window, warm, iters)?
        } else {
            bw_safe(&pd, &mut a, size, window, warm, iters)?
        };
        Ok(format!(
            "RESULT newuser lang=rust level={level} mode=bw iters={iters} size={size} window={window} mb_s={:.1} med_mb_s={:.1}",
            iters as f64 * size as f64 / t / 1e6,
            CHUNK as f64 * size as f64 / med / 1e6
        ))
    } else {
        Err(ibverbs::Error::InvalidArgument { verb: "newuser", reason: "mode is lat or bw" })
    }
}

/// The median of the intervals between consecutive instants of `t`, in seconds.
fn median_interval(t: &[Instant]) -> f64 {
    let mut d: Vec<f64> = t.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
    d.sort_by(f64::total_cmp);
    let n = d.len();
    if n % 2 == 1 {
        d[n / 2]
    } else {
        (d[n / 2 - 1] + d[n / 2]) / 2.0
    }
}

/// Writes between the bandwidth mode's time stamps (its `med_mb_s` is the median of these
/// chunks' rates).
const CHUNK: u64 = 50;

fn fail(c: &Completion) -> ibverbs::Error {
    eprintln!("completion {} failed: {:?}", c.wr_id(), c.status());
    ibverbs::Error::InvalidArgument { verb: "newuser", reason: "a completion failed" }
}

/// The safe level's side: its owned send and receive regions while they are not posted.
struct Bufs {
    send: Option<MemoryRegion>,
    recv: Option<MemoryRegion>,
}

/// Busy-polls `cq` into a one-entry array until a completion comes; puts its buffer back in
/// `bufs` and re-posts a completed receive.
fn reap_safe(s: &mut Side, bufs: &mut Bufs, n: usize, empty: &mut u64) -> ibverbs::Result<()> {
    let mut wc = [Completion::default()];
    for _ in 0..n {
        let c = loop {
            if let Some(c) = s.cq.poll(&mut wc)?.first_mut() {
                break c;
            }
            *empty += 1;
        };
        if !c.is_ok() {
            return Err(fail(c));
        }
        let mr = match c.take_buffers().next() {
            Some(ibverbs::LocalBuf::Owned(mr)) => mr,
            _ => return Err(ibverbs::Error::InvalidArgument { verb: "newuser", reason: "no buffer back" }),
        };
        if c.wr_id() == RECV_ID {
            s.qp.post_recv(RecvRequest::new(Local::whole(mr)).wr_id(RECV_ID)).map_err(|e| e.error)?;
        } else {
            bufs.send = Some(mr);
        }
    }
    Ok(())
}

fn post_send_safe(s: &mut Side, bufs: &mut Bufs) -> ibverbs::Result<()> {
    let mr = bufs.send.take().expect("the send buffer is back");
    s.qp.post_send(SendRequest::send(Local::whole(mr)).wr_id(SEND_ID)).map_err(|e| e.error)
}

fn lat_safe(
    pd: &ibverbs::ProtectionDomain,
    a: &mut Side,
    b: &mut Side,
    warm: u64,
    iters: u64,
    empty: &mut u64,
) -> ibverbs::Result<(f64, f64, u64)> {
    let mut ba = Bufs { send: Some(pd.allocate(8)?), recv: Some(pd.allocate(8)?) };
    let mut bb = Bufs { send: Some(pd.allocate(8)?), recv: Some(pd.allocate(8)?) };
    for (s, bufs) in [(&mut *a, &mut ba), (&mut *b, &mut bb)] {
        let mr = bufs.recv.take().expect("allocated");
        s.qp.post_recv(RecvRequest::new(Local::whole(mr)).wr_id(RECV_ID)).map_err(|e| e.error)?;
    }
    let mut stamps = Vec::with_capacity(iters as usize + 1);
    let mut t0 = Instant::now();
    for i in 0..warm + iters {
        if i == warm {
            *empty = 0;
            t0 = Instant::now();
        }
        if i >= warm {
            stamps.push(Instant::now());
        }
        post_send_safe(a, &mut ba)?;
        reap_safe(b, &mut bb, 1, empty)?; // B's receive, re-posted
        post_send_safe(b, &mut bb)?;
        reap_safe(a, &mut ba, 2, empty)?; // A's send and receive
        reap_safe(b, &mut bb, 1, empty)?; // B's send
    }
    stamps.push(Instant::now());
    Ok((t0.elapsed().as_secs_f64(), median_interval(&stamps), *empty))
}

/// The unsafe level's side: raw requests built once over its buffers, as C's.
struct RawSide {
    sge_s: [ibverbs_sys::ibv_sge; 1],
    sge_r: [ibverbs_sys::ibv_sge; 1],
}

fn wait_raw(cq: &CompletionQueue, wc: &mut [WorkCompletion; 1], empty: &mut u64) -> ibverbs::Result<u64> {
    loop {
        if let Some(c) = cq.poll_raw(wc)?.first() {
            if !c.is_ok() {
                eprintln!("completion {} failed: {:?}", c.wr_id(), c.status());
                return Err(ibverbs::Error::InvalidArgument {
                    verb: "newuser",
                    reason: "a completion failed",
                });
            }
            return Ok(c.wr_id());
        }
        *empty += 1;
    }
}

fn lat_unsafe(
    pd: &ibverbs::ProtectionDomain,
    a: &mut Side,
    b: &mut Side,
    warm: u64,
    iters: u64,
    empty: &mut u64,
) -> ibverbs::Result<(f64, f64, u64)> {
    // Receive targets are remote-exposed regions (the `unsafe` level's contract: no memory that
    // safe code can borrow is written by the device); send sources are owned regions.
    let regions = [
        (pd.allocate(8)?, pd.allocate_remote(8, AccessFlags::LOCAL_WRITE)?),
        (pd.allocate(8)?, pd.allocate_remote(8, AccessFlags::LOCAL_WRITE)?),
    ];
    let mut raws: Vec<RawSide> = regions
        .iter()
        .map(|(s, r)| RawSide {
            sge_s: [raw::sge(s.addr() as u64, 8, s.lkey())],
            sge_r: [raw::sge(r.addr() as u64, 8, r.lkey())],
        })
        .collect();
    let (ra, rb) = raws.split_at_mut(1);
    let (ra, rb) = (&mut ra[0], &mut rb[0]);
    let mut wc = [WorkCompletion::default()];
    let post_recv = |qp: &QueuePair, r: &mut RawSide| -> ibverbs::Result<()> {
        let mut wr = RawRecv::new(RECV_ID, &mut r.sge_r);
        let mut bad = std::ptr::null_mut();
        // SAFETY: the SGE names 8 bytes of a remote-exposed region of this PD that lives until
        // the function returns (after every completion is polled or the QPs are dropped); the
        // wr_id has bit 63 clear; one receive per QP is outstanding, within max_recv_wr.
        unsafe { qp.post_recv_unchecked(&mut wr.0, &mut bad) }
    };
    let post_send = |qp: &QueuePair, r: &mut RawSide| -> ibverbs::Result<()> {
        let mut wr = RawSend::send().wr_id(SEND_ID);
        wr.set_sg_list(&mut r.sge_s);
        let mut bad = std::ptr::null_mut();
        // SAFETY: the SGE names 8 bytes of a region of this PD that the device only reads and
        // that lives until every completion is polled; the wr_id has bit 63 clear; one send per
        // QP is outstanding, within max_send_wr and the CQ's unreserved room.
        unsafe { qp.post_send_unchecked(&mut wr.0, &mut bad) }
    };
    let reap = |s: &Side,
                r: &mut RawSide,
                n: usize,
                wc: &mut [WorkCompletion; 1],
                empty: &mut u64|
     -> ibverbs::Result<()> {
        for _ in 0..n {
            if wait_raw(&s.cq, wc, empty)? == RECV_ID {
                post_recv(&s.qp, r)?;
            }
        }
        Ok(())
    };
    post_recv(&a.qp, ra)?;
    post_recv(&b.qp, rb)?;
    let mut stamps = Vec::with_capacity(iters as usize + 1);
    let mut t0 = Instant::now();
    for i in 0..warm + iters {
        if i == warm {
            *empty = 0;
            t0 = Instant::now();
        }
        if i >= warm {
            stamps.push(Instant::now());
        }
        post_send(&a.qp, ra)?;
        reap(b, rb, 1, &mut wc, empty)?;
        post_send(&b.qp, rb)?;
        reap(a, ra, 2, &mut wc, empty)?;
        reap(b, rb, 1, &mut wc, empty)?;
    }
    stamps.push(Instant::now());
    let t = t0.elapsed().as_secs_f64();
    drop(regions);
    Ok((t, median_interval(&stamps), *empty))
}

fn bw_safe(
    pd: &ibverbs::ProtectionDomain,
    a: &mut Side,
    size: usize,
    window: u64,
    warm: u64,
    iters: u64,
) -> ibverbs::Result<(f64, f64)> {
    let mut src = pd.allocate(size)?;
    src.as_mut_slice().fill(1);
    let src = Arc::new(src);
    let dst = pd.allocate_remote(size, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let total = warm + iters;
    let (mut posted, mut done) = (0u64, 0u64);
    let mut wc = [Completion::default()];
    let mut stamps = Vec::with_capacity((iters / CHUNK) as usize + 1);
    let mut t0 = Instant::now();
    while done < total {
        while posted < total && posted - done < window {
            a.qp.post_send(SendRequest::write(Local::whole(src.clone()), dst.remote()).wr_id(posted))
                .map_err(|e| e.error)?;
            posted += 1;
        }
        let c = loop {
            if let Some(c) = a.cq.poll(&mut wc)?.first_mut() {
                break c;
            }
        };
        if !c.is_ok() {
            return Err(fail(c));
        }
        done += 1;
        if done == warm {
            t0 = Instant::now();
        }
        if done >= warm && (done - warm) % CHUNK == 0 && stamps.len() <= (iters / CHUNK) as usize {
            stamps.push(Instant::now());
        }
    }
    Ok((t0.elapsed().as_secs_f64(), median_interval(&stamps)))
}

fn bw_unsafe(
    pd: &ibverbs::ProtectionDomain,
    a: &mut Side,
    size: usize,
    window: u64,
    warm: u64,
    iters: u64,
) -> ibverbs::Result<(f64, f64)> {
    let mut src = pd.allocate(size)?;
    src.as_mut_slice().fill(1);
    let dst = pd.allocate_remote(size, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let total = warm + iters;
    let (mut posted, mut done) = (0u64, 0u64);
    let mut wc = [WorkCompletion::default()];
    let mut empty = 0u64;
    let mut sge = [raw::sge(src.addr() as u64, size as u32, src.lkey())];
    let mut stamps = Vec::with_capacity((iters / CHUNK) as usize + 1);
    let mut t0 = Instant::now();
    while done < total {
        while posted < total && posted - done < window {
            let mut wr = RawSend::write(dst.remote()).wr_id(posted);
            wr.set_sg_list(&mut sge);
            let mut bad = std::ptr::null_mut();
            // SAFETY: the SGE names `src`, a region of this PD that the device only reads and
            // that outlives every completion (all are polled before it drops); the target is a
            // remote-exposed region; wr_ids stay far below bit 63; at most `window` (16) are
            // outstanding, within max_send_wr and the CQ's 64 entries.
            unsafe { a.qp.post_send_unchecked(&mut wr.0, &mut bad)? };
            posted += 1;
        }
        wait_raw(&a.cq, &mut wc, &mut empty)?;
        done += 1;
        if done == warm {
            t0 = Instant::now();
        }
        if done >= warm && (done - warm) % CHUNK == 0 && stamps.len() <= (iters / CHUNK) as usize {
            stamps.push(Instant::now());
        }
    }
    Ok((t0.elapsed().as_secs_f64(), median_interval(&stamps)))
}
