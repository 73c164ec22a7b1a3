//! Soak: many queue pairs on shared completion queues, several threads posting and polling mixed
//! operations of mixed sizes while another thread creates and destroys queue pairs, every payload
//! checked; afterwards the device's object counts (`rdma resource show`, read while this process
//! is still alive) are back to where they started, and the resident set did not grow with the
//! number of operations.
//!
//! `IBVERBS_SOAK_OPS` sets the number of verified work requests: 150 000 by default, about a
//! minute on rxe under QEMU's emulation (what `cargo xtask test` runs); a million or more for a
//! real soak (`cargo xtask rxe -- env IBVERBS_SOAK_OPS=1000000 target/debug/deps/device_soak-…`).
//! Divided by 4 × `IBVERBS_TEST_TIME_SCALE` under valgrind. The test prints ops/s and peak RSS.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use ibverbs::cm::CmId;
use ibverbs::{
    AccessFlags, Completion, CompletionQueue, Context, Local, MemoryRegion, ProtectionDomain, QpType,
    QueuePair, RecvRequest, RemoteMemoryRegion, SendRequest, WcOpcode,
};

/// Worker threads, each with its own CQ shared by all its queue pairs (both ends).
const WORKERS: usize = 4;
/// Loopback RC pairs per worker: 4 × 8 × 2 = 64 queue pairs; 4 × 6 × 2 = 48 on iWARP, whose
/// queue pairs all live on RDMA-CM's one context of the device, where siw fits 576 KiB of
/// queues (libsiw refuses the memory-map key of page 144): 64 queue pairs of two pages each
/// and the CQs would need 154 pages.
fn pairs() -> usize {
    if is_iwarp() {
        6
    } else {
        8
    }
}
/// Work requests per queue.
const DEPTH: u32 = 16;
/// Largest payload.
const MAX_LEN: usize = 16 * 1024;
/// Slots of `MAX_LEN` bytes in each pair's remote region (a write and the read that checks it
/// use one slot; the slot cycles, so several rounds are in flight on distinct memory).
const SLOTS: usize = 4;

/// Object counts of one device from `rdma resource show` (`0: rxe0: pd 1 cq 0 qp 1 ...`).
fn resources(dev: &str) -> Vec<(String, u64)> {
    let out = Command::new("rdma").args(["resource", "show"]).output().expect("run `rdma resource show`");
    assert!(out.status.success(), "rdma resource show: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(&format!("{dev}:")))
        .unwrap_or_else(|| panic!("no line for {dev} in `rdma resource show`: {text}"));
    let words: Vec<&str> = line.split_whitespace().skip(2).collect();
    words.chunks(2).filter_map(|kv| Some((kv[0].to_string(), kv.get(1)?.parse().ok()?))).collect()
}

fn count(res: &[(String, u64)], kind: &str) -> u64 {
    res.iter().find(|(k, _)| k == kind).map_or(0, |(_, n)| *n)
}

/// `VmRSS` or `VmHWM` of this process, in KiB.
fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"))
}

/// A cheap deterministic hash of (pair, sequence number).
fn mix(a: u64, b: u64) -> u64 {
    let mut x = a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^ (x >> 32)
}

/// Mixed sizes: mostly small, one in sixteen up to `MAX_LEN` (rxe under QEMU's emulation pays
/// per byte: checksums and copies are emulated instructions).
fn size_of(h: u64) -> usize {
    if h % 16 == 0 {
        1 + (h >> 8) as usize % MAX_LEN
    } else {
        1 + (h >> 8) as usize % 64
    }
}

fn fill_pattern(buf: &mut [u8], seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(131).wrapping_add(seed) as u8;
    }
}

fn check_pattern(buf: &[u8], seed: u64, what: &str) {
    for (i, &b) in buf.iter().enumerate() {
        let want = (i as u64).wrapping_mul(131).wrapping_add(seed) as u8;
        assert_eq!(b, want, "{what}: byte {i} of {} (seed {seed})", buf.len());
    }
}

/// wr_id layout: kind (4 bits) | pair (8 bits) | round (52 bits).
fn wr_id(kind: u64, pair: usize, round: u64) -> u64 {
    kind << 60 | (pair as u64) << 52 | round
}
const K_SEND: u64 = 1;
const K_RECV: u64 = 2;
const K_WRITE: u64 = 3;
const K_READ: u64 = 4;
const K_ATOMIC: u64 = 5;
const K_INLINE: u64 = 6;

/// Where every thread waits until all have set up, with a bound: a thread that panics in its
/// set-up never arrives, and the others then fail after [`Gate::BOUND`] instead of waiting
/// forever (a `Barrier` would hang the test).
struct Gate {
    arrived: Mutex<usize>,
    all: Condvar,
    n: usize,
}

impl Gate {
    /// How long a thread waits for the others (scaled).
    const BOUND: Duration = Duration::from_secs(300);

    fn new(n: usize) -> Arc<Gate> {
        Arc::new(Gate { arrived: Mutex::new(0), all: Condvar::new(), n })
    }

    /// Arrives and waits for the others; `Err` with how many arrived when the bound passes.
    fn wait(&self) -> Result<(), String> {
        let mut arrived = self.arrived.lock().unwrap();
        *arrived += 1;
        self.all.notify_all();
        let (arrived, timeout) =
            self.all.wait_timeout_while(arrived, scaled(Self::BOUND), |a| *a < self.n).unwrap();
        if timeout.timed_out() {
            return Err(format!(
                "only {} of {} threads set up within {:?}",
                *arrived,
                self.n,
                scaled(Self::BOUND)
            ));
        }
        Ok(())
    }
}

/// One loopback pair and the buffers its rounds cycle through.
struct PairState {
    a: QueuePair,
    b: QueuePair,
    /// On iWARP, the RDMA-CM ids the pair was connected through.
    _ids: Option<[CmId; 2]>,
    remote: Arc<RemoteMemoryRegion>,
    counter: Arc<RemoteMemoryRegion>,
    send_buf: Option<MemoryRegion>,
    recv_buf: Option<MemoryRegion>,
    write_buf: Option<MemoryRegion>,
    read_buf: Option<MemoryRegion>,
    atomic_buf: Option<MemoryRegion>,
}

/// Two RC queue pairs on `cq`, connected to each other (through RDMA-CM on iWARP: keep the ids).
fn connected_pair(pd: &ProtectionDomain, cq: &CompletionQueue) -> (QueuePair, QueuePair, Option<[CmId; 2]>) {
    let qp = || pd.create_qp(cq, QpType::RC).max_send_wr(DEPTH).max_recv_wr(DEPTH).max_inline_data(64);
    connect_built(pd, qp, qp)
}

/// Runs rounds over [`pairs`] pairs on one CQ until `stop`/`budget`; returns the ops it verified.
/// Fetch-and-adds only with `atomics` (the device has them; siw has none).
fn worker(
    w: usize,
    pd: ProtectionDomain,
    ctx: Context,
    atomics: bool,
    budget: Arc<AtomicU64>,
    start: Arc<Gate>,
) -> u64 {
    let pairs_n = pairs();
    // Each queue of each QP may have DEPTH outstanding: the safe level reserves that much room.
    let mut cq = ctx.create_cq(pairs_n as u32 * 4 * DEPTH, None).unwrap();
    let mut pairs: Vec<PairState> = (0..pairs_n)
        .map(|_| {
            let (a, b, ids) = connected_pair(&pd, &cq);
            PairState {
                a,
                b,
                _ids: ids,
                remote: Arc::new(
                    pd.allocate_remote(SLOTS * MAX_LEN, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)
                        .unwrap(),
                ),
                counter: Arc::new(pd.allocate_remote(8, AccessFlags::REMOTE_ATOMIC).unwrap()),
                send_buf: Some(pd.allocate(MAX_LEN).unwrap()),
                recv_buf: Some(pd.allocate(MAX_LEN).unwrap()),
                write_buf: Some(pd.allocate(MAX_LEN).unwrap()),
                read_buf: Some(pd.allocate(MAX_LEN).unwrap()),
                atomic_buf: Some(pd.allocate(8).unwrap()),
            }
        })
        .collect();
    start.wait().unwrap_or_else(|e| panic!("worker {w}: {e}"));
    let mut out: [Completion; 32] = Default::default();
    let mut verified = 0u64;
    let mut round = 0u64;
    // The whole run (a million operations take about four minutes here), and each round.
    let run_deadline = Instant::now() + scaled(Duration::from_secs(1800));
    // Take a batch of the shared budget per round: 6 work requests per pair (5 without atomics).
    let per_round = if atomics { 6 } else { 5 } * pairs_n as u64;
    while budget.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| b.checked_sub(per_round)).is_ok() {
        assert!(Instant::now() < run_deadline, "worker {w}: soak deadline passed after {verified} ops");
        let deadline = Instant::now() + scaled(Duration::from_secs(30));
        for (p, st) in pairs.iter_mut().enumerate() {
            let h = mix((w * pairs_n + p) as u64, round);
            let seed = h >> 3;
            // Receive, then the matching send.
            let len = size_of(h);
            let recv = st.recv_buf.take().unwrap();
            st.b.post_recv(RecvRequest::new(Local::whole(recv)).wr_id(wr_id(K_RECV, p, round))).unwrap();
            let mut send = st.send_buf.take().unwrap();
            fill_pattern(&mut send.as_mut_slice()[..len], seed);
            st.a.post_send(
                SendRequest::send(Local::new(send, ..len).unwrap()).wr_id(wr_id(K_SEND, p, round)),
            )
            .unwrap();
            // A write into this round's slot, and a read of it back (RC executes them in order at
            // the responder, so the read sees the write). Not fenced: on rxe (kernel 6.1) fenced
            // Reads behind an atomic made this loop 15-30 times slower (shared rxe notes).
            let wlen = size_of(h.rotate_left(17));
            let slot = (round as usize % SLOTS) * MAX_LEN;
            let mut wbuf = st.write_buf.take().unwrap();
            fill_pattern(&mut wbuf.as_mut_slice()[..wlen], seed ^ 0x55);
            let dst = st.remote.remote().slice(slot as u64, wlen as u64).unwrap();
            st.a.post_send(
                SendRequest::write(Local::new(wbuf, ..wlen).unwrap(), dst).wr_id(wr_id(K_WRITE, p, round)),
            )
            .unwrap();
            let rbuf = st.read_buf.take().unwrap();
            st.a.post_send(
                SendRequest::read(Local::new(rbuf, ..wlen).unwrap(), dst).wr_id(wr_id(K_READ, p, round)),
            )
            .unwrap();
            // A fetch-and-add whose old value is the round number (one adder per counter).
            if atomics {
                let abuf = st.atomic_buf.take().unwrap();
                st.a.post_send(
                    SendRequest::fetch_add(Local::whole(abuf), st.counter.remote(), 1)
                        .wr_id(wr_id(K_ATOMIC, p, round)),
                )
                .unwrap();
            }
            // An inline write to the slot after the next one (nobody reads it: the device copies it at post).
            let inline = [(seed & 0xff) as u8; 48];
            let islot = ((round as usize + 2) % SLOTS) * MAX_LEN + MAX_LEN - 48;
            st.a.post_send(
                SendRequest::write_inline(&inline, st.remote.remote().slice(islot as u64, 48).unwrap())
                    .wr_id(wr_id(K_INLINE, p, round)),
            )
            .unwrap();
        }
        // Every pair's completions of this round (all but one on a's send queue, 1 on b's
        // receive queue).
        let mut pending = per_round as usize;
        let mut seen = vec![0u8; pairs_n];
        while pending > 0 {
            if Instant::now() >= deadline {
                let states: Vec<_> = pairs
                    .iter()
                    .map(|st| {
                        (
                            st.a.query_state().ok(),
                            st.b.query_state().ok(),
                            st.a.outstanding_sends(),
                            st.b.outstanding_recvs(),
                        )
                    })
                    .collect();
                let dmesg =
                    Command::new("dmesg").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
                let tail: Vec<String> =
                    dmesg.unwrap_or_default().lines().rev().take(40).map(String::from).collect();
                panic!(
                    "worker {w}: round {round} timed out, {pending} completions missing; kinds seen per pair \
                     (bitmask of 1<<kind): {seen:?}; states {states:?}; resources {:?}; dmesg (newest first):\n{}",
                    resources(&test_device_name()),
                    tail.join("\n")
                );
            }
            let got = cq.poll(&mut out).unwrap();
            if got.is_empty() {
                thread::yield_now();
                continue;
            }
            for c in got.iter_mut() {
                assert!(c.is_ok(), "worker {w}: {c:?}");
                let id = c.wr_id();
                let (kind, p, r) = (id >> 60, (id >> 52 & 0xff) as usize, id & ((1 << 52) - 1));
                assert_eq!(r, round, "worker {w}: completion of another round: {c:?}");
                let h = mix((w * pairs_n + p) as u64, round);
                let seed = h >> 3;
                let st = &mut pairs[p];
                seen[p] |= 1 << kind;
                match kind {
                    K_SEND => {
                        assert_eq!(c.opcode(), WcOpcode::SEND);
                        st.send_buf = Some(c.take_region().unwrap());
                    }
                    K_RECV => {
                        assert_eq!(c.opcode(), WcOpcode::RECV);
                        let len = size_of(h);
                        assert_eq!(c.byte_len() as usize, len);
                        let buf = c.take_region().unwrap();
                        check_pattern(&buf.as_slice()[..len], seed, "received payload");
                        st.recv_buf = Some(buf);
                    }
                    K_WRITE => st.write_buf = Some(c.take_region().unwrap()),
                    K_READ => {
                        assert_eq!(c.opcode(), WcOpcode::RDMA_READ);
                        let wlen = size_of(h.rotate_left(17));
                        let buf = c.take_region().unwrap();
                        check_pattern(&buf.as_slice()[..wlen], seed ^ 0x55, "read back of the write");
                        st.read_buf = Some(buf);
                    }
                    K_ATOMIC => {
                        assert_eq!(c.opcode(), WcOpcode::FETCH_ADD);
                        let buf = c.take_region().unwrap();
                        let old = u64::from_ne_bytes(buf.as_slice()[..8].try_into().unwrap());
                        assert_eq!(old, round, "fetch-and-add's old value");
                        st.atomic_buf = Some(buf);
                    }
                    K_INLINE => assert!(!c.is_tracked() || c.take_buffers().next().is_none()),
                    _ => panic!("worker {w}: unexpected wr_id {id:#x}"),
                }
                verified += 1;
                pending -= 1;
            }
        }
        round += 1;
        if round % 1000 == 0 {
            eprintln!("soak: worker {w}: {round} rounds, {verified} ops");
        }
    }
    for st in &pairs {
        if atomics {
            assert_eq!(st.counter.load_u64(0).unwrap(), round, "every fetch-and-add landed once");
        }
        assert_eq!((st.a.outstanding_sends(), st.b.outstanding_recvs()), (0, 0));
    }
    verified
}

/// Creates and destroys queue pairs on its own CQ while the workers run: some drained, some
/// dropped with work outstanding. Returns how many pairs it created and its slowest pair's
/// connection (through RDMA-CM on iWARP, where the workers' load shares the kernel's connection
/// manager with it).
fn churner(pd: ProtectionDomain, ctx: Context, stop: Arc<AtomicBool>, start: Arc<Gate>) -> (u64, Duration) {
    let mut cq = ctx.create_cq(8 * DEPTH, None).unwrap();
    let buf = Arc::new(pd.allocate(4096).unwrap());
    let target = Arc::new(pd.allocate_remote(4096, AccessFlags::REMOTE_WRITE).unwrap());
    let mut out: [Completion; 16] = Default::default();
    start.wait().unwrap_or_else(|e| panic!("churner: {e}"));
    let mut created = 0u64;
    let mut slowest = Duration::ZERO;
    let enabled = std::env::var("IBVERBS_SOAK_CHURN").map_or(true, |v| v != "0");
    while !enabled && !stop.load(Ordering::Relaxed) {
        thread::sleep(Duration::from_millis(10));
    }
    while enabled && !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let (mut a, b, ids) = connected_pair(&pd, &cq);
        slowest = slowest.max(t.elapsed());
        created += 1;
        for i in 0..4u64 {
            let dst = target.remote().slice(i * 512, 512).unwrap();
            a.post_send(SendRequest::write(Local::new(buf.clone(), ..512).unwrap(), dst).wr_id(i)).unwrap();
        }
        if created % 2 == 0 {
            // Drained: every completion comes back before the pair goes.
            let mut seen = 0;
            let deadline = Instant::now() + scaled(Duration::from_secs(30));
            while seen < 4 {
                assert!(Instant::now() < deadline, "churner: writes did not complete");
                let got = cq.poll(&mut out).unwrap();
                for c in got.iter() {
                    assert!(c.is_ok(), "churner: {c:?}");
                }
                seen += got.len();
                thread::yield_now();
            }
        }
        drop(a);
        drop(b);
        drop(ids);
        // Stale completions of a dropped pair are released here; a poll that finds the CQ empty
        // lets the registry reuse the pairs' entries.
        while !cq.poll(&mut out).unwrap().is_empty() {}
        thread::sleep(Duration::from_millis(2));
    }
    (created, slowest)
}

/// The text of a thread's panic.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Under valgrind (time scale 20) the soak is 80 times shorter: memcheck runs it about 20 times
/// slower, and what it checks (every access) needs no length.
fn scaled_down() -> u64 {
    match time_scale() {
        1 => 1,
        s => 4 * u64::from(s),
    }
}

#[test]
fn soak_many_qps_shared_cqs_mixed_operations() {
    let dev = test_device_name();
    let ops: u64 = std::env::var("IBVERBS_SOAK_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(150_000)
        / scaled_down();
    if is_iwarp() {
        // librdmacm opens its context of the device at first use and keeps it, and its own
        // protection domain can outlive the last id (rdma_free_devices drops a reference without
        // freeing it): both belong in the baseline.
        drop(pair_context());
    }
    let base = resources(&dev);
    let rss_start = status_kib("VmRSS:");
    let t0 = Instant::now();
    let (verified, created, rss_warm, rss_end, during, atomics) = {
        let ctx = pair_context();
        let atomics = has_atomics(&ctx);
        let pd = ctx.alloc_pd().unwrap();
        let budget = Arc::new(AtomicU64::new(ops));
        let stop = Arc::new(AtomicBool::new(false));
        let start = Gate::new(WORKERS + 2);
        let handles: Vec<_> = (0..WORKERS)
            .map(|w| {
                let (pd, ctx, budget, start) = (pd.clone(), ctx.clone(), budget.clone(), start.clone());
                thread::spawn(move || worker(w, pd, ctx, atomics, budget, start))
            })
            .collect();
        let churn = {
            let (pd, ctx, stop, start) = (pd.clone(), ctx.clone(), stop.clone(), start.clone());
            thread::spawn(move || churner(pd, ctx, stop, start))
        };
        if let Err(e) = start.wait() {
            // A thread that failed its set-up panicked: its panic says why.
            stop.store(true, Ordering::Relaxed);
            budget.store(0, Ordering::Relaxed);
            let failures: Vec<String> = handles
                .into_iter()
                .map(|h| h.join().map(drop))
                .chain([churn.join().map(drop)])
                .filter_map(|r| r.err().map(|p| panic_text(&*p)))
                .collect();
            panic!("{e}; the threads' failures:\n{}", failures.join("\n"));
        }
        let setup = t0.elapsed();
        // Objects while everything is alive: at least our queue pairs and 5 CQs.
        let during = resources(&dev);
        assert!(
            count(&during, "qp") >= count(&base, "qp") + (WORKERS * pairs() * 2) as u64,
            "qp count while alive: {during:?} (base {base:?})"
        );
        assert!(count(&during, "cq") > count(&base, "cq") + WORKERS as u64, "cq count: {during:?}");
        // RSS once the run is warm (a tenth of the budget spent) and near its end (nine tenths),
        // everything alive both times.
        let rss_at = |left: u64| {
            let wait_until = Instant::now() + scaled(Duration::from_secs(900));
            while budget.load(Ordering::Relaxed) > left && Instant::now() < wait_until {
                thread::sleep(Duration::from_millis(5));
            }
            status_kib("VmRSS:")
        };
        let rss_warm = rss_at(ops - ops / 10);
        let rss_end = rss_at(ops / 10);
        let verified: u64 = handles.into_iter().map(|h| h.join().expect("worker")).sum();
        stop.store(true, Ordering::Relaxed);
        let (created, slowest) = churn.join().expect("churner");
        eprintln!("soak: the churner's slowest connection took {:.3} s", slowest.as_secs_f64());
        eprintln!("soak: setup {:.2} s", setup.as_secs_f64());
        (verified, created, rss_warm, rss_end, during, atomics)
    };
    let elapsed = t0.elapsed();
    // Everything dropped, the process still alive: the device's counts are back to the baseline.
    let after = resources(&dev);
    for kind in ["pd", "cq", "qp", "mr", "ctx"] {
        assert_eq!(
            count(&after, kind),
            count(&base, kind),
            "{kind} count after the soak: {after:?} (before {base:?})"
        );
    }
    let peak = status_kib("VmHWM:");
    eprintln!(
        "soak: {verified} ops verified in {:.1} s ({:.0} ops/s) on {} QPs over {WORKERS} shared CQs; \
         churner created and destroyed {created} pairs; objects while alive: qp {} cq {} mr {}; \
         RSS start {rss_start} KiB, at 10 % {rss_warm} KiB, at 90 % {rss_end} KiB, peak {peak} KiB",
        elapsed.as_secs_f64(),
        verified as f64 / elapsed.as_secs_f64(),
        WORKERS * pairs() * 2,
        count(&during, "qp"),
        count(&during, "cq"),
        count(&during, "mr"),
    );
    let per_round = (if atomics { 6 } else { 5 } * pairs()) as u64;
    assert_eq!(verified, ops / per_round * per_round, "every op of the budget verified");
    assert!(created >= 2 || std::env::var("IBVERBS_SOAK_CHURN").is_ok_and(|v| v == "0"), "the churner ran");
    // The resident set does not grow with the number of operations: from a tenth of the run to
    // nine tenths (eight tenths of the operations), at most 2 MiB (allocator noise).
    // Not under valgrind, whose own shadow memory grows with what the program touches.
    if time_scale() == 1 {
        assert!(rss_end <= rss_warm + 2048, "RSS grew from {rss_warm} KiB to {rss_end} KiB over the run");
    }
}
