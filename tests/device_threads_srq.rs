//! A shared receive queue used from three threads at once over a real device: one thread posts
//! (the SRQ's producer), two threads poll the two CQs its queue pairs complete into (consumers
//! taking slots of the one slot table in any order), and the SRQ is destroyed while both still
//! poll. Built and run under ThreadSanitizer by `cargo xtask test --tsan`: any data race fails.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use ibverbs::{Completion, Local, MemoryRegion, QpType, QueuePair, RecvRequest, SendRequest};

#[test]
fn one_producer_and_two_consumer_threads_share_an_srq() {
    const DEPTH: u32 = 16;
    let messages: u64 = if time_scale() > 1 { 40 } else { 400 };
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    let mut srq = pd.create_srq(DEPTH, 1).unwrap();
    let cq_r = [ctx.create_cq(64, None).unwrap(), ctx.create_cq(64, None).unwrap()];
    let mut cq_s = ctx.create_cq(128, None).unwrap();
    let (mut receivers, mut ids) = (Vec::new(), Vec::new());
    let mut senders: Vec<QueuePair> = Vec::new();
    for q in 0..4 {
        let (r, s, cm) = connect_built(
            &pd,
            || pd.create_qp(&cq_r[q % 2], QpType::RC).max_send_wr(1).srq(&srq),
            || pd.create_qp(&cq_s, QpType::RC).max_send_wr(16).max_recv_wr(1),
        );
        receivers.push(r);
        senders.push(s);
        ids.push(cm);
    }
    let (back_tx, back_rx) = mpsc::channel::<MemoryRegion>();
    for _ in 0..DEPTH {
        srq.post_recv(RecvRequest::new(Local::whole(pd.allocate(64).unwrap()))).unwrap();
    }
    let received = Arc::new(AtomicU64::new(0));
    // Receives the producer has posted again: the sender stays within what the SRQ holds
    // (iWARP has no RNR retry: a Send that finds the SRQ empty ends its connection).
    let reposted = Arc::new(AtomicU64::new(0));
    let stop_producer = Arc::new(AtomicBool::new(false));
    let stop_consumers = Arc::new(AtomicBool::new(false));
    // The producer: keeps the SRQ stocked with the buffers the consumers hand back, then drops
    // the SRQ handle (the queue pairs still hold it).
    let producer = {
        let (stop, reposted) = (stop_producer.clone(), reposted.clone());
        thread::spawn(move || {
            let mut posted = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(mr) = back_rx.recv_timeout(Duration::from_millis(5)) {
                    srq.post_recv(RecvRequest::new(Local::whole(mr)).wr_id(posted)).unwrap();
                    posted += 1;
                    reposted.store(posted, Ordering::SeqCst);
                }
            }
            posted
        })
    };
    let consumers: Vec<_> = cq_r
        .into_iter()
        .map(|mut cq| {
            let (back, received, stop) = (back_tx.clone(), received.clone(), stop_consumers.clone());
            thread::spawn(move || {
                let mut out: [Completion; 4] = Default::default();
                let mut mine = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for c in cq.poll(&mut out).unwrap() {
                        assert!(c.is_ok() && c.is_tracked(), "{c:?}");
                        let mut mr = c.take_region().unwrap();
                        let len = c.byte_len() as usize;
                        assert_eq!(len, 48, "{c:?}");
                        // A message's first byte is its seed (see `pattern`).
                        assert_eq!(&mr[..len], &pattern(len, mr[0])[..], "every byte of the message");
                        // Zeroed before it is posted again: a receive that wrote nothing into it
                        // would fail the check above (no seed makes an all-zero pattern).
                        mr.fill(0);
                        let _ = back.send(mr);
                        received.fetch_add(1, Ordering::SeqCst);
                        mine += 1;
                    }
                    thread::yield_now();
                }
                mine
            })
        })
        .collect();
    drop(back_tx);
    let deadline = Instant::now() + scaled(Duration::from_secs(60));
    let mut out: [Completion; 16] = Default::default();
    let (mut sent, mut in_flight) = (0u64, 0u64);
    while received.load(Ordering::SeqCst) < messages {
        assert!(Instant::now() < deadline, "timed out at {}", received.load(Ordering::SeqCst));
        // The SRQ holds DEPTH + reposted - arrived >= DEPTH + reposted - sent receives: keep half
        // of them spare.
        while sent < messages
            && sent < reposted.load(Ordering::SeqCst) + u64::from(DEPTH) / 2
            && in_flight < 32
        {
            let mut m = pd.allocate(48).unwrap();
            m.copy_from_slice(&pattern(48, sent as u8));
            senders[(sent % 4) as usize].post_send(SendRequest::send(Local::whole(m))).unwrap();
            sent += 1;
            in_flight += 1;
        }
        for c in cq_s.poll(&mut out).unwrap() {
            assert!(c.is_ok(), "{c:?}");
            in_flight -= 1;
        }
        thread::yield_now();
    }
    stop_producer.store(true, Ordering::Relaxed);
    let posted = producer.join().unwrap();
    assert!(posted >= messages - u64::from(DEPTH));
    // The SRQ goes with its last queue pair, with buffers posted, while both consumers poll.
    drop(receivers);
    thread::sleep(scaled(Duration::from_millis(20)));
    stop_consumers.store(true, Ordering::Relaxed);
    let total: u64 = consumers.into_iter().map(|c| c.join().unwrap()).sum();
    assert_eq!(total, messages);
}
