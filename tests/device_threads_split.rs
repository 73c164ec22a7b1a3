//! One RC queue pair, two threads: its send half posts (and its send CQ is polled) in one thread,
//! its receive half posts (and its receive CQ is polled) in another, at full rate, while the peer
//! runs in the main thread. Built and run under ThreadSanitizer by `cargo xtask test --tsan`
//! (`device_threads*`): any data race is a failure.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use ibverbs::{
    Completion, CompletionQueue, Error, Local, MemoryRegion, ProtectionDomain, QpCaps, QpType, RecvRequest,
    SendHalf, SendRequest,
};

const DEPTH: u32 = 32;
const LEN: usize = 8;

/// The payload of message `seq` in direction `dir`: the sequence and the direction, checked on
/// arrival.
fn payload(dir: u8, seq: u64) -> [u8; LEN] {
    (seq | (u64::from(dir) << 56)).to_le_bytes()
}

fn buffer(pd: &ProtectionDomain, bytes: [u8; LEN]) -> MemoryRegion {
    let mut mr = pd.allocate(LEN).unwrap();
    mr.as_mut_slice().copy_from_slice(&bytes);
    mr
}

/// Polls `cq` once into `out`; panics past `deadline` (what `what` is waiting for).
fn poll<'c>(
    cq: &mut CompletionQueue,
    out: &'c mut [Completion],
    deadline: Instant,
    what: &str,
) -> &'c mut [Completion] {
    assert!(Instant::now() < deadline, "timed out: {what}");
    let got = cq.poll(out).unwrap();
    if got.is_empty() {
        thread::yield_now();
    }
    got
}

#[test]
fn send_half_and_recv_half_post_from_two_threads_at_full_rate() {
    let n: u64 = if time_scale() > 1 { 300 } else { 3000 };
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    let caps = QpCaps { max_send_wr: DEPTH, max_recv_wr: DEPTH, ..QpCaps::default() };
    let cq_a_send = ctx.create_cq(DEPTH, None).unwrap();
    let cq_a_recv = ctx.create_cq(DEPTH, None).unwrap();
    let mut cq_b = ctx.create_cq(2 * DEPTH, None).unwrap();
    let (a, mut b, _ids) = connect_built(
        &pd,
        || pd.create_qp(&cq_a_send, QpType::RC).recv_cq(&cq_a_recv).caps(caps),
        || pd.create_qp(&cq_b, QpType::RC).caps(caps),
    );
    let (mut a_send, mut a_recv) = a.into_split().unwrap();
    assert!(a_send.is_pair_of(&a_recv));
    // Credits: receives posted so far by each side (receives are consumed in order, so message k
    // may be sent once the peer posted its k-th receive: no RNR wait, and iWARP has none).
    let a_posted = Arc::new(AtomicU64::new(0));
    let b_posted = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + scaled(Duration::from_secs(60));

    let sender = {
        let (pd, b_posted) = (pd.clone(), b_posted.clone());
        let mut cq = cq_a_send;
        thread::spawn(move || {
            let mut out: [Completion; 16] = Default::default();
            let (mut sent, mut done) = (0u64, 0u64);
            let mut free: Vec<MemoryRegion> = Vec::new();
            while done < n {
                if sent < n && sent < b_posted.load(Ordering::Acquire) && a_send.outstanding_sends() < DEPTH {
                    let mut mr = free.pop().unwrap_or_else(|| pd.allocate(LEN).unwrap());
                    mr.as_mut_slice().copy_from_slice(&payload(1, sent));
                    a_send.post_send(SendRequest::send(Local::whole(mr)).wr_id(sent)).unwrap();
                    sent += 1;
                }
                for c in poll(&mut cq, &mut out, deadline, "the send half's completions").iter_mut() {
                    assert!(c.is_ok(), "{c:?}");
                    assert_eq!(c.wr_id(), done, "send completions in order, each once");
                    free.push(c.take_region().expect("the send buffer comes back"));
                    done += 1;
                }
            }
            assert_eq!(a_send.outstanding_sends(), 0);
            (a_send, cq)
        })
    };
    let receiver = {
        let (pd, a_posted) = (pd.clone(), a_posted.clone());
        let mut cq = cq_a_recv;
        thread::spawn(move || {
            let mut out: [Completion; 16] = Default::default();
            let mut posted = 0u64;
            let mut got = 0u64;
            while posted < u64::from(DEPTH) {
                a_recv
                    .post_recv(RecvRequest::new(Local::whole(pd.allocate(LEN).unwrap())).wr_id(posted))
                    .unwrap();
                posted += 1;
            }
            a_posted.store(posted, Ordering::Release);
            while got < n {
                for c in poll(&mut cq, &mut out, deadline, "the receive half's completions").iter_mut() {
                    assert!(c.is_ok(), "{c:?}");
                    assert_eq!(c.wr_id(), got, "receive completions in order, each once");
                    assert_eq!(c.byte_len() as usize, LEN);
                    let mr = c.take_region().expect("the receive buffer comes back");
                    assert_eq!(mr.as_slice(), payload(2, got), "message {got} from the peer");
                    got += 1;
                    if posted < n {
                        a_recv.post_recv(RecvRequest::new(Local::whole(mr)).wr_id(posted)).unwrap();
                        posted += 1;
                        a_posted.store(posted, Ordering::Release);
                    }
                }
            }
            assert_eq!(a_recv.outstanding_recvs(), 0);
            (a_recv, cq)
        })
    };

    // The peer, whole, in this thread: receives a's messages and sends its own.
    let mut out: [Completion; 16] = Default::default();
    let (mut b_recv_posted, mut b_got, mut b_sent, mut b_done) = (0u64, 0u64, 0u64, 0u64);
    while b_recv_posted < u64::from(DEPTH) {
        b.post_recv(RecvRequest::new(Local::whole(pd.allocate(LEN).unwrap())).wr_id(b_recv_posted)).unwrap();
        b_recv_posted += 1;
    }
    b_posted.store(b_recv_posted, Ordering::Release);
    while b_got < n || b_done < n {
        if b_sent < n && b_sent < a_posted.load(Ordering::Acquire) && b.outstanding_sends() < DEPTH {
            b.post_send(SendRequest::send(Local::whole(buffer(&pd, payload(2, b_sent)))).wr_id(b_sent))
                .unwrap();
            b_sent += 1;
        }
        for c in poll(&mut cq_b, &mut out, deadline, "the peer's completions").iter_mut() {
            assert!(c.is_ok(), "{c:?}");
            let mr = c.take_region().expect("a buffer comes back");
            if c.opcode() == ibverbs::WcOpcode::RECV {
                assert_eq!(c.wr_id(), b_got, "the peer's receives in order");
                assert_eq!(mr.as_slice(), payload(1, b_got), "message {b_got} from the send half");
                b_got += 1;
                if b_recv_posted < n {
                    b.post_recv(RecvRequest::new(Local::whole(mr)).wr_id(b_recv_posted)).unwrap();
                    b_recv_posted += 1;
                    b_posted.store(b_recv_posted, Ordering::Release);
                }
            } else {
                assert_eq!(c.wr_id(), b_done, "the peer's sends in order");
                b_done += 1;
            }
        }
    }
    let (a_send, _cq_send) = sender.join().unwrap();
    let (a_recv, _cq_recv) = receiver.join().unwrap();
    assert_eq!((b_got, b_done), (n, n));
    // Back together: the whole queue pair posts again.
    let mut a = a_send.reunite(a_recv).unwrap();
    assert_eq!((a.outstanding_sends(), a.outstanding_recvs()), (0, 0));
    assert!(a.post_recv(RecvRequest::new(Local::whole(pd.allocate(LEN).unwrap()))).is_ok());
    eprintln!("{n} messages each way through the two halves of one queue pair");
}

// One half dropped (with requests outstanding) while the other goes on; the queue pair is
// destroyed only with the last half, and the buffers still posted come back through the CQ.
#[test]
fn a_dropped_half_leaves_the_other_working_and_the_last_one_destroys_the_queue_pair() {
    let Pair { pd, mut cq_a, mut cq_b, a, mut b, ctx: _ctx, cm: _cm } = rc_pair(8);
    let (mut send, mut recv) = a.into_split().unwrap();
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let region = region_freed_by(&pd, calls.clone(), false);
    let freed = || calls.load(Ordering::SeqCst) == 1;
    recv.post_recv(RecvRequest::new(Local::whole(region)).wr_id(7)).unwrap();
    // Dropped with a receive outstanding: the queue pair lives on in the send half.
    drop(recv);
    b.post_recv(RecvRequest::new(Local::whole(pd.allocate(LEN).unwrap())).wr_id(1)).unwrap();
    send.post_send(SendRequest::send(Local::whole(buffer(&pd, payload(1, 5)))).wr_id(5)).unwrap();
    let c = poll_one(&mut cq_a);
    assert!(c.is_ok() && c.wr_id() == 5, "{c:?}");
    let mut c = poll_one(&mut cq_b);
    assert!(c.is_ok() && c.wr_id() == 1, "{c:?}");
    assert_eq!(c.take_region().unwrap().as_slice(), payload(1, 5));
    assert!(!freed(), "the receive buffer is still posted");
    // The whole queue pair back from the last half; its receive scratch is new.
    let a = send.into_queue_pair().unwrap();
    assert_eq!(a.outstanding_recvs(), 1);
    let (send, recv) = a.into_split().unwrap();
    drop(send);
    let recv = recv.into_queue_pair().unwrap().into_split().unwrap().1;
    // The last half dropped: ibv_destroy_qp, and the outstanding receive comes back at a poll
    // (siw leaves a flush completion of the destroyed queue pair in the CQ: passed through
    // untracked, its buffer released with the ring).
    drop(recv);
    let mut out = [Completion::default()];
    let deadline = Instant::now() + scaled(Duration::from_secs(10));
    while !freed() {
        assert!(Instant::now() < deadline, "the posted receive buffer was never released");
        for c in cq_a.poll(&mut out).unwrap().iter_mut() {
            assert!(c.take_region().is_none(), "a stale completion hands no buffer back: {c:?}");
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "released once");
}

// Splitting refuses what it cannot split, typed, giving the queue pair back; halves of two
// queue pairs do not reunite.
#[test]
fn split_refusals_are_typed_and_give_everything_back() {
    let Pair { pd, cq_a: _cq_a, cq_b: _cq_b, a, b, ctx, cm: _cm } = rc_pair(4);
    // A queue pair on an SRQ: no receive half, only a send half.
    let srq = pd.create_srq(4, 1).unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let on_srq = pd.create_qp(&cq, QpType::RC).max_send_wr(2).srq(&srq).build().unwrap();
    let e = on_srq.into_split().unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { verb: "QueuePair::into_split", .. }), "{e:?}");
    let half: SendHalf = e.queue_pair.into_send_half().unwrap();
    assert_eq!(half.send_capacity(), 2);
    let on_srq = half.into_queue_pair().unwrap();
    assert!(on_srq.uses_srq());
    // A queue pair with its own receive queue is not a send half alone.
    let e = a.into_send_half().unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { verb: "QueuePair::into_send_half", .. }), "{e:?}");
    let (sa, ra) = e.queue_pair.into_split().unwrap();
    let (sb, rb) = b.into_split().unwrap();
    let ibverbs::ReuniteError(sa, rb) = sa.reunite(rb).unwrap_err();
    let ibverbs::ReuniteError(sb, ra) = sb.reunite(ra).unwrap_err();
    assert!(sa.reunite(ra).is_ok() && sb.reunite(rb).is_ok());
    drop(ctx);
}
