//! Micro-benchmark of the post/poll path: nanoseconds per post + poll of one RDMA Write and of a
//! chain of 32, at the three levels the crate offers:
//!
//! - **safe**: `QueuePair::post_send` / `post_send_iter` + `CompletionQueue::poll` (checked,
//!   tracked);
//! - **unsafe**: `QueuePair::post_send_unchecked` + `CompletionQueue::poll_raw` (prebuilt
//!   `ibv_send_wr`s);
//! - **ffi**: `ibverbs::ffi::ibv_post_send` + `ibv_poll_cq` through the C shim, as a C program does;
//! - the same on the **extended** data path, over a second loopback pair whose QP is created with
//!   `send_ops` (`ibv_create_qp_ex`) and whose CQ with `create_cq_ex`: **ex safe** (`post_send`
//!   / `post_send_chain` through `ibv_wr_*`, `poll` through `ibv_start_poll`...) and **ex ffi**
//!   (`ibv_wr_start`, `ibv_wr_rdma_write`, `ibv_wr_set_inline_data`, `ibv_wr_complete` and
//!   `ibv_start_poll`/`ibv_end_poll` through the C shim on `qp_ex_raw`/`cq_ex_raw`).
//!
//! Two more levels run only in counting mode (`POST_POLL_ONLY=Owned` or `Scoped`, single
//! requests): a non-inline Write of a shared registered buffer at the owned level, and the same
//! Write from a slice borrowed for a `QueuePair::scope` (`Scope::post_send` + `Scope::poll`).
//!
//! A second counting mode, `POST_POLL_BATCH=<level>` (`Ffi`, `Unsafe` or `Safe`), measures the
//! poll cost per completion against the batch size B (1, 2, 4, 8, 16, 32; one call of `run_batch`
//! per B, in that order): each of its iterations posts B *signaled* 8-byte RDMA Writes as one
//! chain, sleeps 2 ms so that the device has finished them, then polls until all B completions
//! are in, through `poll_batch`, which makes one poll call with room for B completions:
//! `ibv_poll_cq` through `ibverbs::ffi` (`Ffi`; prebuilt inline chain, `post_send_unchecked`),
//! `CompletionQueue::poll_raw` (`Unsafe`; the same chain) or `CompletionQueue::poll` of tracked
//! completions (`Safe`; `post_prepared_chain` of B prepared posts, not inline).
//!
//! The operation is an 8-byte inline RDMA Write on a loopback RC pair, the cheapest operation that
//! still goes through the whole device path, so that the software cost shows as much as it can.
//! Only the last request of a chain is signaled. Each figure is the median of several runs; the
//! variants are interleaved run by run so that drifts hit them alike. The `post` column is the
//! time spent inside the post call alone (the rest of an iteration is the device working and the
//! poll loop waiting for it).
//!
//! After the table, a second one: **two threads on one queue pair**, one posting 8-byte inline
//! RDMA Writes (and polling their completions) while the other refills receives for the peer's
//! 8-byte Sends (and polls them), through the halves of `QueuePair::into_split` (no lock) against
//! an `Arc<Mutex<QueuePair>>` both threads lock for each post; nanoseconds per message (both
//! directions counted), median of several runs, the two interleaved.
//!
//! A third counting mode, `POST_POLL_EMPTY=<level>` (`Ffi`, `Unsafe` or `Safe`), makes 200 polls
//! of the empty CQ (a busy-polling loop's common case) through `poll`, twice (`run_empty`, one
//! call per round; callgrind counts the second): the cost of a poll that finds nothing.
//!
//! It needs a device: `cargo bench --no-run`, then run the binary where one exists, e.g.
//! `cargo xtask rxe -- target/release/deps/post_poll-<hash>`. `IBVERBS_TEST_DEVICE` and
//! `IBVERBS_TEST_GID_INDEX` choose the device and GID (default: the first device, the RoCE v2
//! IPv4 GID). On SoftRoCE the device's own software path dominates every figure.

use std::ptr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs::ffi;
use ibverbs::{
    AccessFlags, Completion, CompletionQueue, ConnectOptions, Context, QpType, QueuePair, RemoteSlice,
    SendOps, SendRequest, WcFlags, WorkCompletion,
};

/// `ENOENT`: what `ibv_start_poll` returns on an empty CQ.
const ENOENT: i32 = 2;
/// Requests in the chained variant.
const CHAIN: usize = 32;
/// Measured runs per variant (the median is reported).
const RUNS: usize = 11;
/// Gives up on a completion after this long.
const POLL_TIMEOUT: Duration = Duration::from_secs(10);
/// Batch sizes of the `POST_POLL_BATCH` mode, in the order of its `run_batch` calls.
const BATCHES: [usize; 6] = [1, 2, 4, 8, 16, 32];
/// Iterations per batch size in the `POST_POLL_BATCH` mode.
const BATCH_ITERS: usize = 50;
/// Polls of an empty CQ per round in the `POST_POLL_EMPTY` mode.
const EMPTY_ITERS: usize = 200;

fn rdtsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC has no preconditions.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        use std::sync::OnceLock;
        static BASE: OnceLock<Instant> = OnceLock::new();
        BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Safe,
    /// A prepared RDMA Write from a registered buffer (`prepare_send` once; `post_prepared` per
    /// single request, `post_prepared_chain` per chain).
    Prepared,
    Unsafe,
    Ffi,
    /// The safe level on the extended pair.
    ExSafe,
    /// The C builders and poll calls on the extended pair, through the shim.
    ExFfi,
    /// Counting only: an owned (non-inline) RDMA Write of a shared registered buffer
    /// (`post_send` of an `Arc` clone + `poll`), the owned level's twin of `Scoped`.
    Owned,
    /// Counting only: the same Write from a slice borrowed for a scope (`Scope::post_send` +
    /// `Scope::poll`, all iterations in one `QueuePair::scope`).
    Scoped,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Safe => "safe    post_send(_iter) + poll",
            Level::Prepared => "safe    post_prepared + poll (not inline)",
            Level::Unsafe => "unsafe  post_send_unchecked + poll_raw",
            Level::Ffi => "ffi     ibv_post_send + ibv_poll_cq",
            Level::ExSafe => "ex safe post_send(_chain) + poll",
            Level::ExFfi => "ex ffi  ibv_wr_* + ibv_start_poll",
            Level::Owned => "owned   post_send(Arc region) + poll",
            Level::Scoped => "scoped  Scope::post_send + Scope::poll",
        }
    }
}

/// One run's totals.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Nanoseconds per iteration (post + poll until the signaled completion).
    iter_ns: f64,
    /// Nanoseconds per iteration spent inside the post call.
    post_ns: f64,
}

struct Bench {
    qp: QueuePair,
    cq: CompletionQueue,
    remote: RemoteSlice,
    data: [u8; 8],
    prepared: ibverbs::PreparedSend,
    /// The registered source of the prepared, owned and scoped Writes.
    src: Arc<ibverbs::MemoryRegion>,
    /// The extended pair: QP (send_ops RDMA Write) and CQ (create_cq_ex).
    ex_qp: QueuePair,
    ex_cq: CompletionQueue,
    _ex_peer: QueuePair,
    _ex_peer_cq: CompletionQueue,
    // Keeps the peer and the target alive.
    _peer: QueuePair,
    _peer_cq: CompletionQueue,
    _target: Arc<ibverbs::RemoteMemoryRegion>,
    _ctx: Context,
}

fn setup() -> Result<Bench, String> {
    let name = std::env::var("IBVERBS_TEST_DEVICE").ok();
    let ctx =
        Context::open(name.as_deref()).map_err(|e| format!("{e} (this benchmark needs an RDMA device)"))?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let depth = 2 * CHAIN as u32;
    let cq = ctx.create_cq(2 * depth, None).map_err(|e| e.to_string())?;
    let peer_cq = ctx.create_cq(2 * depth, None).map_err(|e| e.to_string())?;
    let build =
        |cq| pd.create_qp(cq, QpType::RC).max_send_wr(depth).max_recv_wr(1).max_inline_data(64).build();
    let mut qp = build(&cq).map_err(|e| e.to_string())?;
    let mut peer = build(&peer_cq).map_err(|e| e.to_string())?;
    let gid_index = std::env::var("IBVERBS_TEST_GID_INDEX").ok().and_then(|v| v.parse().ok());
    let opts = ConnectOptions { gid_index, retry_cnt: 6, ..ConnectOptions::default() };
    let (a, b) =
        (qp.endpoint(&opts).map_err(|e| e.to_string())?, peer.endpoint(&opts).map_err(|e| e.to_string())?);
    qp.connect(&b, &opts).map_err(|e| e.to_string())?;
    peer.connect(&a, &opts).map_err(|e| e.to_string())?;
    // No optional field: both ex levels read only what every completion has (the safe poll reads
    // every field asked for, the ffi one only wr_id and status).
    let ex_cq = ctx.create_cq_ex(2 * depth, None, WcFlags::empty()).map_err(|e| e.to_string())?;
    let ex_peer_cq = ctx.create_cq_ex(2 * depth, None, WcFlags::empty()).map_err(|e| e.to_string())?;
    let build_ex = |cq| {
        pd.create_qp(cq, QpType::RC)
            .max_send_wr(depth)
            .max_recv_wr(1)
            .max_inline_data(64)
            .send_ops(SendOps::RDMA_WRITE)
            .build()
    };
    let mut ex_qp = build_ex(&ex_cq).map_err(|e| e.to_string())?;
    let mut ex_peer = build_ex(&ex_peer_cq).map_err(|e| e.to_string())?;
    let (a, b) = (
        ex_qp.endpoint(&opts).map_err(|e| e.to_string())?,
        ex_peer.endpoint(&opts).map_err(|e| e.to_string())?,
    );
    ex_qp.connect(&b, &opts).map_err(|e| e.to_string())?;
    ex_peer.connect(&a, &opts).map_err(|e| e.to_string())?;
    let target = Arc::new(pd.allocate_remote(4096, AccessFlags::REMOTE_WRITE).map_err(|e| e.to_string())?);
    let remote = target.remote().slice(0, 8).map_err(|e| e.to_string())?;
    let src = Arc::new(pd.allocate(8).map_err(|e| e.to_string())?);
    let prepared = qp
        .prepare_send(SendRequest::write(ibverbs::Local::whole(src.clone()), remote))
        .map_err(|e| e.to_string())?;
    Ok(Bench {
        prepared,
        src,
        qp,
        cq,
        ex_qp,
        ex_cq,
        _ex_peer: ex_peer,
        _ex_peer_cq: ex_peer_cq,
        remote,
        data: *b"post_pol",
        _peer: peer,
        _peer_cq: peer_cq,
        _target: target,
        _ctx: ctx,
    })
}

/// Prebuilt inline writes: `n` chained requests, the last one signaled.
fn raw_chain(b: &Bench, sges: &mut [ffi::ibv_sge], wrs: &mut [ffi::ibv_send_wr]) {
    let n = wrs.len();
    for (i, (w, s)) in wrs.iter_mut().zip(sges.iter_mut()).enumerate() {
        *s = ffi::ibv_sge { addr: b.data.as_ptr() as u64, length: 8, lkey: 0 };
        *w = ffi::ibv_send_wr {
            wr_id: i as u64,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            num_sge: 1,
            sg_list: s,
            send_flags: ffi::ibv_send_flags::IBV_SEND_INLINE.0
                | if i + 1 == n { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 },
            ..Default::default()
        };
        w.wr.rdma =
            ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: b.remote.addr, rkey: b.remote.rkey };
    }
    // Linked last, through one pointer, so that no later reference invalidates the links.
    let base = wrs.as_mut_ptr();
    for i in 0..n.saturating_sub(1) {
        // SAFETY: i + 1 < n: both elements are in `wrs`.
        unsafe { (*base.add(i)).next = base.add(i + 1) };
    }
}

/// Runs `iters` iterations of `n` requests at `level`; returns the totals in ticks and the
/// elapsed wall time. (A function of its own: the callgrind step dumps its counts after each
/// call.)
#[inline(never)]
fn run(b: &mut Bench, level: Level, n: usize, iters: usize) -> Result<(u64, u64, Duration), String> {
    let mut sges = vec![ffi::ibv_sge::default(); n];
    let mut wrs = vec![ffi::ibv_send_wr::default(); n];
    raw_chain(b, &mut sges, &mut wrs);
    let mut comps = [Completion::default()];
    let mut wcs = [WorkCompletion::default()];
    let mut chain: Vec<SendRequest<'_>> = Vec::with_capacity(n);
    let data = b.data;
    let mut post_ticks = 0u64;
    let start = Instant::now();
    let t_start = rdtsc();
    for _ in 0..iters {
        let t0 = rdtsc();
        post(b, level, n, &mut wrs, &mut chain, &data)?;
        if counting() {
            // Instruction counting: let the device finish first, so that (nearly) every poll
            // finds the completion and empty polls do not swamp the figures.
            std::thread::sleep(Duration::from_millis(2));
        }
        post_ticks += rdtsc() - t0;
        let deadline = Instant::now() + POLL_TIMEOUT;
        let mut spins = 0u32;
        loop {
            let (got, ok) = poll(b, level, &mut comps, &mut wcs)?;
            if counting() {
                POLLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if got == 0 {
                    EMPTY_POLLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            if !ok {
                return Err(format!("completion error at the {level:?} level"));
            }
            if got > 0 {
                break;
            }
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 && Instant::now() > deadline {
                return Err(format!("no completion within {POLL_TIMEOUT:?} at the {level:?} level"));
            }
        }
    }
    let total = rdtsc() - t_start;
    Ok((total, post_ticks, start.elapsed()))
}

/// The scoped level, counting only: `iters` single Writes from a borrowed slice, each polled,
/// in one scope.
fn run_scoped(b: &mut Bench, iters: usize) -> Result<(), String> {
    let (src, remote) = (b.src.clone(), b.remote);
    let r = b.qp.scope(&mut b.cq, |s| -> Result<(), String> {
        let mut comps = [Completion::default()];
        for _ in 0..iters {
            post_scoped(s, &src, remote)?;
            std::thread::sleep(Duration::from_millis(2));
            let deadline = Instant::now() + POLL_TIMEOUT;
            loop {
                let got = poll_scoped(s, &mut comps)?;
                POLLS.fetch_add(1, Ordering::Relaxed);
                if got == 0 {
                    EMPTY_POLLS.fetch_add(1, Ordering::Relaxed);
                } else {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("no completion within {POLL_TIMEOUT:?} at the scoped level"));
                }
            }
        }
        Ok(())
    });
    r.map_err(|e| e.to_string())?
}

/// One scoped post (a function of its own for callgrind).
#[inline(never)]
fn post_scoped<'s>(
    s: &mut ibverbs::Scope<'s, '_>,
    src: &'s ibverbs::MemoryRegion,
    remote: RemoteSlice,
) -> Result<(), String> {
    let local = s.local(src, ..).map_err(|e| e.to_string())?;
    s.post_send(ibverbs::ScopedSend::write(local, remote)).map_err(|e| e.to_string())
}

/// One poll through the scope (a function of its own for callgrind).
#[inline(never)]
fn poll_scoped(s: &mut ibverbs::Scope<'_, '_>, comps: &mut [Completion]) -> Result<usize, String> {
    let got = s.poll(comps).map_err(|e| e.to_string())?;
    if got.first().is_some_and(|c| !c.is_ok()) {
        return Err("completion error at the scoped level".into());
    }
    Ok(got.len())
}

/// Posts one iteration's `n` requests at `level` (a function of its own, so that callgrind
/// reports its cost apart).
#[inline(never)]
fn post<'a>(
    b: &mut Bench,
    level: Level,
    n: usize,
    wrs: &mut [ffi::ibv_send_wr],
    chain: &mut Vec<SendRequest<'a>>,
    data: &'a [u8; 8],
) -> Result<(), String> {
    post_impl(b, level, n, wrs, chain, data)
}

/// [`post`]'s work, also called (uncounted) by [`warm_up`].
#[inline(always)]
fn post_impl<'a>(
    b: &mut Bench,
    level: Level,
    n: usize,
    wrs: &mut [ffi::ibv_send_wr],
    chain: &mut Vec<SendRequest<'a>>,
    data: &'a [u8; 8],
) -> Result<(), String> {
    let remote = b.remote;
    match level {
        Level::Safe if n == 1 => {
            b.qp.post_send(SendRequest::write_inline(data, remote)).map_err(|e| e.to_string())?;
        }
        Level::Safe => {
            let wrs = (0..n).map(|i| {
                let wr = SendRequest::write_inline(data, remote).wr_id(i as u64);
                if i + 1 < n {
                    wr.unsignaled()
                } else {
                    wr
                }
            });
            b.qp.post_send_iter(wrs).map_err(|e| e.to_string())?;
        }
        Level::ExSafe if n == 1 => {
            b.ex_qp.post_send(SendRequest::write_inline(data, remote)).map_err(|e| e.to_string())?;
        }
        Level::ExSafe => {
            for i in 0..n {
                let wr = SendRequest::write_inline(data, remote).wr_id(i as u64);
                chain.push(if i + 1 < n { wr.unsignaled() } else { wr });
            }
            b.ex_qp.post_send_chain(chain).map_err(|e| e.to_string())?;
        }
        Level::ExFfi => {
            let qpx = b.ex_qp.qp_ex_raw().ok_or("not an extended QP")?;
            // SAFETY: one builder sequence on this thread (we hold the QP) of inline writes
            // (data copied during the setter) into the registered target, which outlives
            // the QP; the QP was created for RDMA Write; wr_ids < 2^63.
            let ret = unsafe {
                ffi::ibv_wr_start(qpx);
                for i in 0..n {
                    (*qpx).wr_id = i as u64;
                    (*qpx).wr_flags = ffi::ibv_send_flags::IBV_SEND_INLINE.0
                        | if i + 1 == n { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
                    ffi::ibv_wr_rdma_write(qpx, remote.rkey, remote.addr);
                    ffi::ibv_wr_set_inline_data(qpx, data.as_ptr().cast_mut().cast(), 8);
                }
                ffi::ibv_wr_complete(qpx)
            };
            if ret != 0 {
                return Err(format!("ibv_wr_complete: {}", std::io::Error::from_raw_os_error(ret)));
            }
        }
        Level::Prepared if n == 1 => {
            b.qp.post_prepared(&b.prepared, 0, 0, 8, 0).map_err(|e| e.to_string())?;
        }
        Level::Owned => {
            let wr = SendRequest::write(ibverbs::Local::whole(b.src.clone()), remote);
            b.qp.post_send(wr).map_err(|e| e.to_string())?;
        }
        Level::Scoped => return Err("the scoped level runs in run_scoped".into()),
        Level::Prepared => {
            let p = &b.prepared;
            // Built as they are posted (`post_prepared_iter`): an array built first with
            // `std::array::from_fn` cost ~36 instructions per post, ~20 of them the `memcpy`
            // that moves it into place.
            let posts = (0..n).map(|i| {
                let post = p.at(i as u64, 0, 8, 0);
                if i + 1 < n {
                    post.unsignaled()
                } else {
                    post
                }
            });
            b.qp.post_prepared_iter(posts).map_err(|e| e.to_string())?;
        }
        Level::Unsafe => {
            let mut bad = ptr::null_mut();
            // SAFETY: a valid NULL-terminated chain of inline writes (data copied during the
            // call) into the registered target, which outlives the QP; wr_ids < 2^63.
            unsafe { b.qp.post_send_unchecked(wrs.as_mut_ptr(), &mut bad) }.map_err(|e| e.to_string())?;
        }
        Level::Ffi => {
            let mut bad = ptr::null_mut();
            // SAFETY: as above, through the C function on the raw QP (alive in `b`).
            let ret = unsafe { ffi::ibv_post_send(b.qp.as_raw(), wrs.as_mut_ptr(), &mut bad) };
            if ret != 0 {
                return Err(format!("ibv_post_send: {}", std::io::Error::from_raw_os_error(ret)));
            }
        }
    }
    Ok(())
}

/// Polls once at `level`: (completions got, whether they are successful).
#[inline(never)]
fn poll(
    b: &mut Bench,
    level: Level,
    comps: &mut [Completion],
    wcs: &mut [WorkCompletion],
) -> Result<(usize, bool), String> {
    poll_impl(b, level, comps, wcs)
}

/// Counting mode: one iteration of `n` requests at `level` through [`post_impl`] and
/// [`poll_impl`], outside the functions callgrind counts, so that first-use costs (a queue
/// pair's chain scratch, allocated at its first chain) stay out of the per-WR figures, which
/// are then the steady state's.
fn warm_up(b: &mut Bench, level: Level, n: usize) -> Result<(), String> {
    let mut sges = vec![ffi::ibv_sge::default(); n];
    let mut wrs = vec![ffi::ibv_send_wr::default(); n];
    raw_chain(b, &mut sges, &mut wrs);
    let (mut comps, mut wcs) = ([Completion::default()], [WorkCompletion::default()]);
    let mut chain: Vec<SendRequest<'_>> = Vec::with_capacity(n);
    let data = b.data;
    post_impl(b, level, n, &mut wrs, &mut chain, &data)?;
    let deadline = Instant::now() + POLL_TIMEOUT;
    loop {
        let (got, ok) = poll_impl(b, level, &mut comps, &mut wcs)?;
        if !ok {
            return Err(format!("completion error at the {level:?} level (warm-up)"));
        }
        if got > 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("no completion within {POLL_TIMEOUT:?} at the {level:?} level (warm-up)"));
        }
    }
}

/// [`poll`]'s work, also called (uncounted) by [`warm_up`].
#[inline(always)]
fn poll_impl(
    b: &mut Bench,
    level: Level,
    comps: &mut [Completion],
    wcs: &mut [WorkCompletion],
) -> Result<(usize, bool), String> {
    let r = match level {
        Level::Safe | Level::Prepared | Level::Owned => {
            let got = b.cq.poll(comps).map_err(|e| e.to_string())?;
            (got.len(), got.first().map_or(true, |c| c.is_ok()))
        }
        Level::Unsafe => {
            let got = b.cq.poll_raw(wcs).map_err(|e| e.to_string())?;
            (got.len(), got.first().map_or(true, |c| c.is_ok()))
        }
        Level::ExSafe => {
            let got = b.ex_cq.poll(comps).map_err(|e| e.to_string())?;
            (got.len(), got.first().map_or(true, |c| c.is_ok()))
        }
        Level::ExFfi => {
            let cqx = b.ex_cq.cq_ex_raw().ok_or("not an extended CQ")?;
            let mut attr = ffi::ibv_poll_cq_attr::default();
            // SAFETY: valid extended CQ polled by this thread only; end_poll follows a
            // successful start_poll, and status is read in between.
            unsafe {
                match ffi::ibv_start_poll(cqx, &mut attr) {
                    0 => {
                        let ok = (*cqx).status == ffi::ibv_wc_status::IBV_WC_SUCCESS;
                        ffi::ibv_end_poll(cqx);
                        (1, ok)
                    }
                    ENOENT => (0, true),
                    e => return Err(format!("ibv_start_poll: {e}")),
                }
            }
        }
        Level::Scoped => return Err("the scoped level runs in run_scoped".into()),
        Level::Ffi => {
            // SAFETY: valid CQ; room for one ibv_wc (WorkCompletion is transparent).
            let ret = unsafe { ffi::ibv_poll_cq(b.cq.as_raw(), 1, wcs.as_mut_ptr().cast()) };
            if ret < 0 {
                return Err("ibv_poll_cq failed".into());
            }
            (ret as usize, ret == 0 || wcs[0].is_ok())
        }
    };
    Ok(r)
}

/// `POST_POLL_EMPTY` mode: `iters` calls of [`poll`] at `level` on the CQ with nothing in it (a
/// busy-polling loop's common case, each one delaying the sight of the completion), after
/// checking that it is empty (a function of its own: the callgrind step dumps after it). Fails
/// on any poll that finds something.
#[inline(never)]
fn run_empty(b: &mut Bench, level: Level, iters: usize) -> Result<(), String> {
    let (mut comps, mut wcs) = ([Completion::default()], [WorkCompletion::default()]);
    for _ in 0..iters {
        let (got, _) = poll(b, level, &mut comps, &mut wcs)?;
        POLLS.fetch_add(1, Ordering::Relaxed);
        if got != 0 {
            return Err(format!("the CQ is not empty at the {level:?} level"));
        }
        EMPTY_POLLS.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// `POST_POLL_BATCH` mode: `iters` iterations of `n` signaled requests posted as one chain,
/// then polled until all `n` completions are in, `n` at most per poll call (a function of its
/// own: the callgrind step dumps its counts after each call). Counts the poll calls in
/// `POLLS`/`EMPTY_POLLS`; fails on any unsuccessful completion.
#[inline(never)]
fn run_batch(b: &mut Bench, level: Level, n: usize, iters: usize) -> Result<(), String> {
    let mut sges = vec![ffi::ibv_sge::default(); n];
    let mut wrs = vec![ffi::ibv_send_wr::default(); n];
    raw_chain(b, &mut sges, &mut wrs);
    for w in &mut wrs {
        w.send_flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    }
    let mut comps: Vec<Completion> = (0..n).map(|_| Completion::default()).collect();
    let mut wcs = vec![WorkCompletion::default(); n];
    for _ in 0..iters {
        match level {
            Level::Ffi | Level::Unsafe => {
                let mut bad = ptr::null_mut();
                // SAFETY: a valid NULL-terminated chain of inline writes (data copied during the
                // call) into the registered target, which outlives the QP; wr_ids < 2^63; the
                // send queue (depth 64) and the CQ (128) have room for the chain's n <= 32.
                unsafe { b.qp.post_send_unchecked(wrs.as_mut_ptr(), &mut bad) }.map_err(|e| e.to_string())?;
            }
            Level::Safe => {
                let p = &b.prepared;
                b.qp.post_prepared_iter((0..n).map(|i| p.at(i as u64, 0, 8, 0)))
                    .map_err(|e| e.to_string())?;
            }
            _ => return Err(format!("POST_POLL_BATCH has no {level:?} level")),
        }
        // Let the device finish first, so that (nearly) every poll finds completions.
        std::thread::sleep(Duration::from_millis(2));
        let deadline = Instant::now() + POLL_TIMEOUT;
        let mut left = n;
        while left > 0 {
            let got = poll_batch(b, level, &mut comps, &mut wcs)?;
            POLLS.fetch_add(1, Ordering::Relaxed);
            if got == 0 {
                EMPTY_POLLS.fetch_add(1, Ordering::Relaxed);
                if Instant::now() > deadline {
                    return Err(format!("{left} of {n} completions missing after {POLL_TIMEOUT:?}"));
                }
                continue;
            }
            let ok = match level {
                Level::Safe => comps[..got].iter().all(|c| c.is_ok()),
                _ => wcs[..got].iter().all(|c| c.is_ok()),
            };
            if !ok {
                return Err(format!("completion error at the {level:?} level, batch {n}"));
            }
            left = left
                .checked_sub(got)
                .ok_or_else(|| format!("{got} completions polled, {left} expected (batch {n})"))?;
        }
    }
    Ok(())
}

/// One poll call at `level` with room for `comps.len()` (= `wcs.len()`) completions; returns how
/// many it got (a function of its own: the callgrind step collects only inside it). Statuses are
/// checked by the caller.
#[inline(never)]
fn poll_batch(
    b: &mut Bench,
    level: Level,
    comps: &mut [Completion],
    wcs: &mut [WorkCompletion],
) -> Result<usize, String> {
    match level {
        Level::Safe => Ok(b.cq.poll(comps).map_err(|e| e.to_string())?.len()),
        Level::Unsafe => Ok(b.cq.poll_raw(wcs).map_err(|e| e.to_string())?.len()),
        _ => {
            let want = wcs.len() as i32;
            // SAFETY: valid CQ; room for `want` ibv_wc (WorkCompletion is transparent).
            let ret = unsafe { ffi::ibv_poll_cq(b.cq.as_raw(), want, wcs.as_mut_ptr().cast()) };
            if ret < 0 {
                return Err("ibv_poll_cq failed".into());
            }
            Ok(ret as usize)
        }
    }
}

/// `POST_POLL_ONLY=<level>[:<n>]` (e.g. `Safe`, `ExSafe:32`): run that level alone, 200 single
/// and/or 20 chained iterations (`n` 1 or 32), each after one uncounted warm-up iteration
/// ([`warm_up`]), for instruction counting under callgrind (`post` and `poll` are functions
/// of their own: read their inclusive costs).
/// Calls of `poll` in the counting mode, and how many of them found nothing.
static POLLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static EMPTY_POLLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn counting() -> bool {
    static ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ONLY.get_or_init(|| std::env::var_os("POST_POLL_ONLY").is_some())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` and friends: nothing to list
    }
    let mut b = match setup() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("post_poll: {e}");
            std::process::exit(1);
        }
    };
    if let Some(name) = std::env::var_os("POST_POLL_BATCH") {
        let name = name.to_string_lossy();
        let all = [Level::Ffi, Level::Unsafe, Level::Safe];
        let Some(&level) = all.iter().find(|l| format!("{l:?}") == name) else {
            eprintln!("post_poll: POST_POLL_BATCH={name}: not one of {all:?}");
            std::process::exit(2);
        };
        for n in BATCHES {
            if let Err(e) = run_batch(&mut b, level, n, BATCH_ITERS) {
                eprintln!("post_poll: {e}");
                std::process::exit(1);
            }
            let (polls, empty) = (POLLS.swap(0, Ordering::Relaxed), EMPTY_POLLS.swap(0, Ordering::Relaxed));
            println!(
                "post_poll batch: {level:?}: {BATCH_ITERS} iterations of {n} completion(s), {polls} polls ({empty} empty)"
            );
        }
        return;
    }
    if let Some(name) = std::env::var_os("POST_POLL_EMPTY") {
        let name = name.to_string_lossy();
        let all = [Level::Ffi, Level::Unsafe, Level::Safe];
        let Some(&level) = all.iter().find(|l| format!("{l:?}") == name) else {
            eprintln!("post_poll: POST_POLL_EMPTY={name}: not one of {all:?}");
            std::process::exit(2);
        };
        // One uncounted round first (first-use costs), then the counted one.
        for _ in 0..2 {
            if let Err(e) = run_empty(&mut b, level, EMPTY_ITERS) {
                eprintln!("post_poll: {e}");
                std::process::exit(1);
            }
        }
        let (polls, empty) = (POLLS.swap(0, Ordering::Relaxed), EMPTY_POLLS.swap(0, Ordering::Relaxed));
        println!("post_poll empty: {level:?}: {polls} polls ({empty} empty)");
        return;
    }
    if counting() {
        let spec = std::env::var("POST_POLL_ONLY").unwrap_or_default();
        let (name, chain) = spec.split_once(':').unwrap_or((&spec, ""));
        let chain: Option<usize> = chain.parse().ok();
        let all = [
            Level::Safe,
            Level::Prepared,
            Level::Unsafe,
            Level::Ffi,
            Level::ExSafe,
            Level::ExFfi,
            Level::Owned,
            Level::Scoped,
        ];
        let Some(&level) = all.iter().find(|l| format!("{l:?}") == name) else {
            eprintln!("post_poll: POST_POLL_ONLY={name}: not one of {all:?}");
            std::process::exit(2);
        };
        for (n, iters) in [(1usize, 200usize), (CHAIN, 20)] {
            if chain.is_some_and(|c| c != n) || (n > 1 && matches!(level, Level::Owned | Level::Scoped)) {
                continue;
            }
            let r = if level == Level::Scoped {
                run_scoped(&mut b, iters)
            } else {
                warm_up(&mut b, level, n).and_then(|()| run(&mut b, level, n, iters).map(drop))
            };
            if let Err(e) = r {
                eprintln!("post_poll: {e}");
                std::process::exit(1);
            }
            let (polls, empty) = (POLLS.swap(0, Ordering::Relaxed), EMPTY_POLLS.swap(0, Ordering::Relaxed));
            println!(
                "post_poll: {level:?}: {iters} iterations of {n} request(s), {polls} polls ({empty} empty)"
            );
        }
        return;
    }
    let mut rows = Vec::new();
    for (n, iters) in [(1usize, 3000usize), (CHAIN, 300)] {
        let levels: &[Level] =
            &[Level::Safe, Level::Prepared, Level::Unsafe, Level::Ffi, Level::ExSafe, Level::ExFfi];
        // Warm up every level (page faults, caches, the device's first requests).
        for &l in levels {
            if let Err(e) = run(&mut b, l, n, iters / 10) {
                eprintln!("post_poll: {e}");
                std::process::exit(1);
            }
        }
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); levels.len()];
        for _ in 0..RUNS {
            for (i, &l) in levels.iter().enumerate() {
                match run(&mut b, l, n, iters) {
                    Ok((total, post, wall)) => {
                        let ns_per_tick = wall.as_nanos() as f64 / total.max(1) as f64;
                        samples[i].push(Sample {
                            iter_ns: wall.as_nanos() as f64 / iters as f64,
                            post_ns: post as f64 * ns_per_tick / iters as f64,
                        });
                    }
                    Err(e) => {
                        eprintln!("post_poll: {e}");
                        std::process::exit(1);
                    }
                }
            }
        }
        for (i, &l) in levels.iter().enumerate() {
            let mut it: Vec<f64> = samples[i].iter().map(|s| s.iter_ns).collect();
            let mut po: Vec<f64> = samples[i].iter().map(|s| s.post_ns).collect();
            rows.push((n, l, median(&mut it), median(&mut po)));
        }
    }
    let threads = match two_threads(&b._ctx) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("post_poll: two threads: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "post + poll of 8-byte inline RDMA Writes, loopback RC on {} (median of {RUNS} runs)",
        b._ctx.name()
    );
    println!(
        "{:>4}  {:<40} {:>12} {:>10} {:>10} {:>8}",
        "WRs", "level", "ns/iter", "ns/WR", "post ns", "vs ffi"
    );
    for &(n, l, it, po) in &rows {
        let ffi = rows.iter().find(|r| r.0 == n && r.1 == Level::Ffi).map_or(it, |r| r.2);
        println!("{n:>4}  {:<40} {it:>12.0} {:>10.0} {po:>10.0} {:>8.3}", l.name(), it / n as f64, it / ffi);
    }
    println!(
        "\ntwo threads on one queue pair: Writes posted by one, receives refilled by the other \
         ({THREAD_MSGS} messages each way, median of {THREAD_RUNS} runs)"
    );
    println!("{:<40} {:>12}", "how", "ns/message");
    for (name, ns) in threads {
        println!("{name:<40} {ns:>12.0}");
    }
}

/// Messages each way per run of [`two_threads`].
const THREAD_MSGS: u64 = 1000;
/// Runs of each variant of [`two_threads`] (the median is reported).
const THREAD_RUNS: usize = 3;
/// Depth of each queue of the two-thread pair.
const THREAD_DEPTH: u32 = 32;

/// What each of the two threads posts through: a split half, or the locked queue pair.
trait Poster: Send + 'static {
    fn write(&mut self, wr: SendRequest<'_>) -> Result<(), String>;
    fn recv(&mut self, wr: ibverbs::RecvRequest) -> Result<(), String>;
}

impl Poster for ibverbs::SendHalf {
    fn write(&mut self, wr: SendRequest<'_>) -> Result<(), String> {
        self.post_send(wr).map_err(|e| e.error.to_string())
    }
    fn recv(&mut self, _: ibverbs::RecvRequest) -> Result<(), String> {
        Err("a send half posts no receive".into())
    }
}

impl Poster for ibverbs::RecvHalf {
    fn write(&mut self, _: SendRequest<'_>) -> Result<(), String> {
        Err("a receive half posts no send".into())
    }
    fn recv(&mut self, wr: ibverbs::RecvRequest) -> Result<(), String> {
        self.post_recv(wr).map_err(|e| e.error.to_string())
    }
}

impl Poster for Arc<std::sync::Mutex<QueuePair>> {
    fn write(&mut self, wr: SendRequest<'_>) -> Result<(), String> {
        self.lock().map_err(|e| e.to_string())?.post_send(wr).map_err(|e| e.error.to_string())
    }
    fn recv(&mut self, wr: ibverbs::RecvRequest) -> Result<(), String> {
        self.lock().map_err(|e| e.to_string())?.post_recv(wr).map_err(|e| e.error.to_string())
    }
}

/// The two-thread table's rows: (how, ns per message).
fn two_threads(ctx: &Context) -> Result<Vec<(&'static str, f64)>, String> {
    let e = |e: ibverbs::Error| e.to_string();
    let pd = ctx.alloc_pd().map_err(e)?;
    let (send_cq, recv_cq) =
        (ctx.create_cq(THREAD_DEPTH, None).map_err(e)?, ctx.create_cq(THREAD_DEPTH, None).map_err(e)?);
    let peer_cq = ctx.create_cq(2 * THREAD_DEPTH, None).map_err(e)?;
    let build = |send: &CompletionQueue, recv: &CompletionQueue| {
        pd.create_qp(send, QpType::RC)
            .recv_cq(recv)
            .max_send_wr(THREAD_DEPTH)
            .max_recv_wr(THREAD_DEPTH)
            .max_inline_data(64)
            .build()
    };
    let mut qp = build(&send_cq, &recv_cq).map_err(e)?;
    let mut peer = build(&peer_cq, &peer_cq).map_err(e)?;
    let gid_index = std::env::var("IBVERBS_TEST_GID_INDEX").ok().and_then(|v| v.parse().ok());
    let opts = ConnectOptions { gid_index, retry_cnt: 6, ..ConnectOptions::default() };
    let (a, b) = (qp.endpoint(&opts).map_err(e)?, peer.endpoint(&opts).map_err(e)?);
    qp.connect(&b, &opts).map_err(e)?;
    peer.connect(&a, &opts).map_err(e)?;
    let target = pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).map_err(e)?;
    let remote = target.remote().slice(0, 8).map_err(e)?;
    let mut cqs = Some((send_cq, recv_cq, peer_cq));
    let (mut split, mut locked) = (Vec::new(), Vec::new());
    for run in 0..=THREAD_RUNS {
        for locked_run in [false, true] {
            let (s, r, p) = cqs.take().ok_or("lost the CQs")?;
            let (ns, back, qp_back) = if locked_run {
                let shared = Arc::new(std::sync::Mutex::new(qp));
                let (ns, cqs_back, w, r) =
                    drive(&pd, shared.clone(), shared.clone(), &mut peer, remote, (s, r, p))?;
                drop((w, r));
                let qp = Arc::try_unwrap(shared).map_err(|_| "the lock is still shared")?;
                (ns, cqs_back, qp.into_inner().map_err(|e| e.to_string())?)
            } else {
                let (sh, rh) = qp.into_split().map_err(|e| e.error.to_string())?;
                let (ns, cqs_back, sh, rh) = drive(&pd, sh, rh, &mut peer, remote, (s, r, p))?;
                (ns, cqs_back, sh.reunite(rh).map_err(|e| e.to_string())?)
            };
            qp = qp_back;
            cqs = Some(back);
            // Run 0 warms up.
            if run > 0 {
                if locked_run {
                    locked.push(ns)
                } else {
                    split.push(ns)
                }
            }
        }
    }
    Ok(vec![
        ("split halves (SendHalf + RecvHalf)", median(&mut split)),
        ("Arc<Mutex<QueuePair>>", median(&mut locked)),
    ])
}

type Cqs = (CompletionQueue, CompletionQueue, CompletionQueue);

/// One run: a thread posts `THREAD_MSGS` inline Writes through `w` (polling the send CQ), another
/// keeps receives posted through `r` for the peer's `THREAD_MSGS` Sends (polling the receive CQ),
/// while this thread drives the peer. Nanoseconds per message, both directions counted; the CQs
/// and both posters come back.
fn drive<W: Poster, R: Poster>(
    pd: &ibverbs::ProtectionDomain,
    mut w: W,
    mut r: R,
    peer: &mut QueuePair,
    remote: RemoteSlice,
    (mut send_cq, mut recv_cq, mut peer_cq): Cqs,
) -> Result<(f64, Cqs, W, R), String> {
    use std::sync::atomic::AtomicU64;
    let posted = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let writer = std::thread::spawn(move || -> Result<(CompletionQueue, W), String> {
        let mut out: [Completion; 16] = Default::default();
        let (mut sent, mut done) = (0u64, 0u64);
        let deadline = Instant::now() + POLL_TIMEOUT;
        while done < THREAD_MSGS {
            if sent < THREAD_MSGS && sent - done < u64::from(THREAD_DEPTH) {
                w.write(SendRequest::write_inline(b"two-thr!", remote).wr_id(sent))?;
                sent += 1;
            }
            for c in send_cq.poll(&mut out).map_err(|e| e.to_string())?.iter() {
                if !c.is_ok() {
                    return Err(format!("{c:?}"));
                }
                done += 1;
            }
            if Instant::now() > deadline {
                return Err("the writer timed out".into());
            }
        }
        Ok((send_cq, w))
    });
    let receiver = {
        let (posted, pd) = (posted.clone(), pd.clone());
        std::thread::spawn(move || -> Result<(CompletionQueue, R), String> {
            let mut out: [Completion; 16] = Default::default();
            let (mut n, mut got) = (0u64, 0u64);
            while n < u64::from(THREAD_DEPTH) {
                let mr = pd.allocate(8).map_err(|e| e.to_string())?;
                r.recv(ibverbs::RecvRequest::new(ibverbs::Local::whole(mr)))?;
                n += 1;
            }
            posted.store(n, Ordering::Release);
            let deadline = Instant::now() + POLL_TIMEOUT;
            while got < THREAD_MSGS {
                for c in recv_cq.poll(&mut out).map_err(|e| e.to_string())?.iter_mut() {
                    if !c.is_ok() {
                        return Err(format!("{c:?}"));
                    }
                    got += 1;
                    if n < THREAD_MSGS {
                        let mr = c.take_region().ok_or("no receive buffer back")?;
                        r.recv(ibverbs::RecvRequest::new(ibverbs::Local::whole(mr)))?;
                        n += 1;
                        posted.store(n, Ordering::Release);
                    }
                }
                if Instant::now() > deadline {
                    return Err("the receiver timed out".into());
                }
            }
            Ok((recv_cq, r))
        })
    };
    let mut out: [Completion; 16] = Default::default();
    let (mut sent, mut done) = (0u64, 0u64);
    let deadline = Instant::now() + POLL_TIMEOUT;
    while done < THREAD_MSGS {
        if sent < THREAD_MSGS
            && sent < posted.load(Ordering::Acquire)
            && sent - done < u64::from(THREAD_DEPTH)
        {
            peer.post_send(SendRequest::send_inline(b"two-thr!").wr_id(sent))
                .map_err(|e| e.error.to_string())?;
            sent += 1;
        }
        for c in peer_cq.poll(&mut out).map_err(|e| e.to_string())?.iter() {
            if !c.is_ok() {
                return Err(format!("{c:?}"));
            }
            done += 1;
        }
        if Instant::now() > deadline {
            return Err("the peer timed out".into());
        }
    }
    let (send_cq, w) = writer.join().map_err(|_| "the writer panicked")??;
    let (recv_cq, r) = receiver.join().map_err(|_| "the receiver panicked")??;
    let ns = start.elapsed().as_nanos() as f64 / (2 * THREAD_MSGS) as f64;
    Ok((ns, (send_cq, recv_cq, peer_cq), w, r))
}
