//! Threads racing every `&self` path of the crate that touches shared state, over a real verbs
//! device. Built and run under ThreadSanitizer by `cargo xtask test --tsan` (and normally by
//! `cargo xtask test`): any data race is a failure.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use ibverbs::{AccessFlags, Completion, Local, QpType, RecvRequest, SendRequest};

// Hole 6: `RemoteMemoryRegion` is `Sync` and its copies take `&self`; with volatile accesses two
// threads copying in and out was a data race. Here three threads copy in and out of one region
// while the device RDMA-writes into it.
#[test]
fn remote_region_copies_race_between_threads_and_the_device() {
    let Pair { pd, mut cq_a, cq_b: _cq_b, mut a, b: _b, ctx: _ctx, cm: _cm } = rc_pair(16);
    let region = Arc::new(pd.allocate_remote(4096 + 3, AccessFlags::REMOTE_WRITE).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let copiers: Vec<_> = (0..3u8)
        .map(|t| {
            let (region, stop) = (region.clone(), stop.clone());
            thread::spawn(move || {
                let mut buf = [0u8; 64];
                let mut rounds = 0u64;
                while !stop.load(Ordering::Relaxed) || rounds < 100 {
                    // Under valgrind threads run one at a time: do not hog the lock.
                    thread::yield_now();
                    let off = (rounds as usize * 61 + usize::from(t) * 13) % (4096 - 64);
                    match (rounds + u64::from(t)) % 4 {
                        0 => region.write(off, &[t + 1; 64][..(rounds as usize % 64) + 1]).unwrap(),
                        1 => region.read(off + 1, &mut buf).unwrap(),
                        2 => drop(region.load_u64(off & !7).unwrap()),
                        _ => {
                            if rounds % 50 == 0 {
                                region.fill(t + 1);
                            }
                        }
                    }
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    let src = Arc::new(pd.allocate(256).unwrap());
    let writes = if time_scale() > 1 { 20 } else { 200 };
    for i in 0..writes {
        let off = (i * 97) % (4096 - 256);
        a.post_send(SendRequest::write(Local::whole(src.clone()), region.remote().slice(off, 256).unwrap()))
            .unwrap();
        assert!(poll_one(&mut cq_a).is_ok());
    }
    stop.store(true, Ordering::Relaxed);
    let total: u64 = copiers.into_iter().map(|c| c.join().unwrap()).sum();
    let bytes = region.to_vec();
    assert!(bytes.iter().all(|&b| b <= 3), "only values the threads or the device wrote");
    eprintln!("{total} racing copies while the device wrote {writes} times");
}

// Posting (producer, `&mut QueuePair` in one thread) and polling (consumer, `&mut
// CompletionQueue` in another) meet only in the slot ring's atomics.
#[test]
fn posting_and_polling_on_different_threads() {
    let n: u64 = if time_scale() > 1 { 200 } else { 2000 };
    let Pair { pd, cq_a, mut cq_b, mut a, mut b, ctx: _ctx, cm: _cm } = rc_pair(32);
    let received = Arc::new(AtomicU64::new(0));
    // The sender starts once the first receives are posted: iWARP has no RNR retry (a send that
    // finds no receive ends the connection).
    let (posted_first, first_posted) = std::sync::mpsc::channel::<()>();
    let receiver = {
        let received = received.clone();
        let pd = pd.clone();
        thread::spawn(move || {
            let mut posted = 0u64;
            let mut out: [Completion; 8] = Default::default();
            let deadline = Instant::now() + scaled(Duration::from_secs(60));
            while posted < 32 {
                b.post_recv(RecvRequest::new(Local::whole(pd.allocate(8).unwrap())).wr_id(posted)).unwrap();
                posted += 1;
            }
            posted_first.send(()).unwrap();
            while received.load(Ordering::Relaxed) < n {
                assert!(
                    Instant::now() < deadline,
                    "receiver timed out: {} of {n} received",
                    received.load(Ordering::Relaxed)
                );
                let got = cq_b.poll(&mut out).unwrap();
                if got.is_empty() {
                    thread::yield_now();
                }
                for c in got.iter_mut() {
                    assert!(c.is_ok(), "{c:?}");
                    let mr = c.take_region().expect("the receive buffer comes back");
                    received.fetch_add(1, Ordering::Relaxed);
                    if posted < n {
                        b.post_recv(RecvRequest::new(Local::whole(mr)).wr_id(posted)).unwrap();
                        posted += 1;
                    }
                }
            }
            b
        })
    };
    // The sender's CQ is polled by a third thread.
    let sent_done = Arc::new(AtomicU64::new(0));
    let poller = {
        let sent_done = sent_done.clone();
        let mut cq_a = cq_a;
        thread::spawn(move || {
            let mut out: [Completion; 16] = Default::default();
            let deadline = Instant::now() + scaled(Duration::from_secs(60));
            while sent_done.load(Ordering::Acquire) < n {
                assert!(
                    Instant::now() < deadline,
                    "sender's poller timed out: {} of {n} sends completed",
                    sent_done.load(Ordering::Acquire)
                );
                let got = cq_a.poll(&mut out).unwrap();
                if got.is_empty() {
                    thread::yield_now();
                }
                for c in got.iter() {
                    assert!(c.is_ok(), "{c:?}");
                    sent_done.fetch_add(1, Ordering::Release);
                }
            }
            cq_a
        })
    };
    // Bounded: a receiver that panicked drops its end, and the wait ends at once.
    first_posted
        .recv_timeout(scaled(Duration::from_secs(60)))
        .expect("the receiver posted its first receives");
    let mut sent = 0;
    let deadline = Instant::now() + scaled(Duration::from_secs(60));
    while sent < n {
        assert!(Instant::now() < deadline, "sender timed out: {sent} of {n} posted");
        // Stay within the peer's posted receives (RNR retries would slow the test down).
        if sent - sent_done.load(Ordering::Acquire) >= 16 || sent >= received.load(Ordering::Relaxed) + 24 {
            thread::yield_now();
            continue;
        }
        match a.post_send(SendRequest::send_inline(b"").wr_id(sent)) {
            Ok(()) => sent += 1,
            Err(e) if matches!(e.error, ibverbs::Error::QueueFull { .. }) => thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
    }
    let _b = receiver.join().unwrap();
    let _cq_a = poller.join().unwrap();
    assert_eq!(received.load(Ordering::Relaxed), n);
    assert_eq!(a.outstanding_sends(), 0);
}

// Queue pairs reset and dropped (their rings retired) in other threads while their CQ is polled:
// retirement and the consumer's release of the rings meet in the registry's atomics.
#[test]
fn queue_pairs_reset_and_dropped_while_their_cq_is_polled() {
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(256, None).unwrap();
    let per_thread = 12;
    let batches: Vec<Vec<_>> = (0..2)
        .map(|_| {
            (0..per_thread)
                .map(|_| pd.create_qp(&cq, QpType::RC).max_send_wr(4).max_recv_wr(4).build().unwrap())
                .collect()
        })
        .collect();
    let start = Arc::new(Barrier::new(3));
    let resets = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = batches
        .into_iter()
        .map(|batch| {
            let (pd, start, resets) = (pd.clone(), start.clone(), resets.clone());
            thread::spawn(move || {
                start.wait();
                for mut qp in batch {
                    qp.init(&opts()).unwrap();
                    for _ in 0..2 {
                        qp.post_recv(RecvRequest::new(Local::whole(pd.allocate(8).unwrap()))).unwrap();
                    }
                    // Fresh queues may not fit until the CQ is seen empty: then the reset says
                    // so, and the queue pair is dropped unusable. iWARP has no reset.
                    match qp.reset() {
                        Ok(()) => {
                            resets.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(ibverbs::Error::CqTooSmall { .. } | ibverbs::Error::TooManyQueuePairs { .. }) => {
                        }
                        Err(ibverbs::Error::Unsupported { capability: ibverbs::IWARP_RESET, .. })
                            if is_iwarp() => {}
                        Err(e) => panic!("reset: {e:?}"),
                    }
                    thread::sleep(Duration::from_millis(5));
                    drop(qp);
                }
            })
        })
        .collect();
    start.wait();
    let mut out: [Completion; 4] = Default::default();
    while !workers.iter().all(|w| w.is_finished()) {
        if cq.poll(&mut out).unwrap().is_empty() {
            thread::yield_now();
        }
    }
    for w in workers {
        w.join().unwrap();
    }
    let resets = resets.load(Ordering::Relaxed);
    if is_iwarp() {
        unsupported(&ctx, "resetting a queue pair", "iWARP: siw accepts RESET and ignores it; dropped only");
    } else {
        assert!(resets > 0, "no reset of {} succeeded while the CQ was polled", 2 * per_thread);
    }
    eprintln!("{resets} of {} queue pairs reset before their drop", 2 * per_thread);
    // Everything comes back once the CQ is polled dry with nothing left in it.
    while cq.poll(&mut out).unwrap().len() == out.len() {}
    assert_eq!(cq.unreserved(), cq.capacity());
    let again =
        pd.create_qp(&cq, QpType::RC).max_send_wr(cq.capacity() / 2).max_recv_wr(cq.capacity() / 2).build();
    assert!(again.is_ok(), "all room and entries are back: {again:?}");
}

// A reset whose fresh receive queue does not fit in its own CQ gives its fresh send ring back
// to the send CQ while another thread polls that CQ: only the poller takes entries out.
#[test]
fn a_failed_reset_gives_rings_back_while_the_other_cq_is_polled() {
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let send_cq = ctx.create_cq(64, None).unwrap();
    let mut recv_cq = ctx.create_cq(4, None).unwrap();
    let depth = recv_cq.capacity();
    let mut qp = pd
        .create_qp(&send_cq, QpType::RC)
        .recv_cq(&recv_cq)
        .max_send_wr(4)
        .max_recv_wr(depth)
        .build()
        .unwrap();
    if iwarp_refuses_reset(&ctx, &mut qp) {
        return;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let stop = stop.clone();
        let mut send_cq = send_cq;
        thread::spawn(move || {
            let mut out: [Completion; 4] = Default::default();
            while !stop.load(Ordering::Relaxed) {
                if send_cq.poll(&mut out).unwrap().is_empty() {
                    thread::yield_now();
                }
            }
            send_cq
        })
    };
    for _ in 0..200 {
        qp.init(&opts()).unwrap();
        qp.post_recv(RecvRequest::new(Local::whole(pd.allocate(8).unwrap()))).unwrap();
        // The receive's room is kept until recv_cq is seen empty: the fresh receive queue
        // does not fit, and the fresh send ring goes back to send_cq.
        assert!(matches!(qp.reset(), Err(ibverbs::Error::CqTooSmall { .. })));
        let mut out: [Completion; 2] = Default::default();
        assert!(recv_cq.poll(&mut out).unwrap().is_empty());
        qp.reset().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let mut send_cq = poller.join().unwrap();
    let mut out: [Completion; 2] = Default::default();
    assert!(send_cq.poll(&mut out).unwrap().is_empty());
    drop(qp);
    assert_eq!(send_cq.unreserved(), send_cq.capacity());
}

// Registrations from many threads at once: the CQ's reservation never exceeds its capacity.
#[test]
fn concurrent_registrations_never_overcommit_a_cq() {
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = Arc::new(ctx.create_cq(64, None).unwrap());
    let cap = cq.capacity();
    // What one QP reserves: its queues as the device sized them (rxe grants 3 + 2; a device
    // may round up). RC, which every transport has; never connected.
    let need = {
        let _one = pd.create_qp(&cq, QpType::RC).max_send_wr(3).max_recv_wr(2).build().unwrap();
        cap - cq.unreserved()
    };
    assert_eq!(cq.unreserved(), cap, "a QP that never posted gives its room back at once");
    assert!(need >= 5 && cap / need < 64, "{need} of {cap}: the threads try 64");
    let start = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (pd, cq, start) = (pd.clone(), cq.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                let mut mine = Vec::new();
                for _ in 0..16 {
                    if let Ok(qp) = pd.create_qp(&cq, QpType::RC).max_send_wr(3).max_recv_wr(2).build() {
                        mine.push(qp);
                    }
                }
                mine
            })
        })
        .collect();
    let all: Vec<_> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    assert_eq!(all.len() as u32, cap / need, "exactly as many QPs as fit ({need} entries each)");
    assert_eq!(cq.unreserved(), cap % need);
}
