//! The post and poll paths allocate nothing: a counting global allocator watches a loop of safe
//! posts (single and chained) and polls over a real device.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use ibverbs::{AccessFlags, Completion, CompletionQueue, Local, QpType, RecvRequest, SendRequest};

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, only counting calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Polls until `n` completions arrived, taking the owned region of the last one; no allocation.
fn drain(cq: &mut CompletionQueue, out: &mut [Completion], n: usize) -> Option<ibverbs::MemoryRegion> {
    let deadline = Instant::now() + scaled(Duration::from_secs(10));
    let mut seen = 0;
    let mut region = None;
    while seen < n {
        for c in cq.poll(&mut out[..]).unwrap() {
            assert!(c.is_ok(), "{c:?}");
            if let Some(r) = c.take_region() {
                region = Some(r);
            }
            seen += 1;
        }
        assert!(Instant::now() < deadline, "timed out");
    }
    region
}

#[test]
fn post_and_poll_paths_do_not_allocate() {
    // Inline data room for the inline writes below (siw gives what is asked, rxe rounds up).
    let mut p = pair(QpType::RC, 64, 1, 16);
    let target = std::sync::Arc::new(p.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    let mut send_buf = Some(p.pd.allocate(64).unwrap());
    let mut recv_buf = Some(p.pd.allocate(64).unwrap());
    let mut out: [Completion; 16] = Default::default();
    let mut chain = Vec::with_capacity(32);
    let shared = std::sync::Arc::new(p.pd.allocate(8).unwrap());

    for round in 0..2 {
        // Round 0 warms up (lazy provider state, thread-locals); round 1 is measured.
        let before = ALLOCS.load(Ordering::Relaxed);
        for _ in 0..50 {
            p.b.post_recv(RecvRequest::new(Local::whole(recv_buf.take().unwrap()))).unwrap();
            p.a.post_send(SendRequest::send(Local::whole(send_buf.take().unwrap()))).unwrap();
            send_buf = drain(&mut p.cq_a, &mut out, 1);
            recv_buf = drain(&mut p.cq_b, &mut out, 1);
            // A chain of 32 unsignaled writes and a signaled one, posted with one call.
            for _ in 0..31 {
                chain.push(
                    SendRequest::write(Local::whole(shared.clone()), target.remote().slice(0, 8).unwrap())
                        .unsignaled(),
                );
            }
            chain
                .push(SendRequest::write(Local::whole(shared.clone()), target.remote().slice(0, 8).unwrap()));
            p.a.post_send_chain(&mut chain).unwrap();
            drain(&mut p.cq_a, &mut out, 1);
            // The same chain built as it is posted (post_send_iter), and inline writes from
            // borrowed bytes.
            p.a.post_send_iter((0..32).map(|i| {
                let wr =
                    SendRequest::write(Local::whole(shared.clone()), target.remote().slice(0, 8).unwrap());
                if i < 31 {
                    wr.unsignaled()
                } else {
                    wr
                }
            }))
            .unwrap();
            drain(&mut p.cq_a, &mut out, 1);
            let bytes = [5u8; 8];
            p.a.post_send_iter(
                (0..8).map(|_| SendRequest::write_inline(&bytes, target.remote().slice(8, 8).unwrap())),
            )
            .unwrap();
            drain(&mut p.cq_a, &mut out, 8);
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        if round == 1 {
            assert_eq!(allocs, 0, "the post/poll loop allocated {allocs} times");
        }
    }
    // Completions hold the buffers they handed back until taken or overwritten.
    drop(out);
    assert_eq!(std::sync::Arc::strong_count(&shared), 1);
}

#[test]
fn a_receive_pool_in_steady_state_does_not_allocate() {
    let mut p = rc_pair(16);
    let mut pool = ibverbs::ReceivePool::new(p.pd.allocate(64 * 256).unwrap().into_chunks(256).unwrap());
    let mut send_chunks = p.pd.allocate(16 * 64).unwrap().into_chunks(64).unwrap();
    let mut out: [Completion; 16] = Default::default();
    for round in 0..2 {
        let before = ALLOCS.load(Ordering::Relaxed);
        for i in 0..200u32 {
            pool.refill(&mut p.b).unwrap();
            let mut chunk = send_chunks.pop().unwrap();
            chunk[..4].copy_from_slice(&i.to_le_bytes());
            p.a.post_send(SendRequest::send(Local::new(chunk, ..4).unwrap())).unwrap();
            let deadline = Instant::now() + scaled(Duration::from_secs(10));
            let (mut sent, mut got) = (false, false);
            while !(sent && got) {
                assert!(Instant::now() < deadline, "timed out");
                for c in p.cq_a.poll(&mut out).unwrap() {
                    send_chunks.push(c.take_chunk().unwrap());
                    sent = true;
                }
                for c in p.cq_b.poll(&mut out).unwrap() {
                    assert!(c.is_ok(), "{c:?}");
                    let chunk = c.take_chunk().unwrap();
                    assert_eq!(chunk[..4], i.to_le_bytes());
                    pool.put(chunk);
                    got = true;
                }
            }
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        if round == 1 {
            assert_eq!(allocs, 0, "the pool loop allocated {allocs} times");
        }
    }
}

#[test]
fn prepared_posts_do_not_allocate() {
    let mut p = rc_pair(32);
    let src = std::sync::Arc::new(p.pd.allocate(64).unwrap());
    let target = std::sync::Arc::new(p.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    let prepared = p.a.prepare_send(SendRequest::write(Local::whole(src), target.remote())).unwrap();
    let mut out: [Completion; 16] = Default::default();
    for round in 0..2 {
        let before = ALLOCS.load(Ordering::Relaxed);
        for i in 0..300u64 {
            p.a.post_prepared(&prepared, i, (i % 56) as usize, 8, i % 56).unwrap();
            drain(&mut p.cq_a, &mut out, 1);
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        if round == 1 {
            assert_eq!(allocs, 0, "prepared posts allocated {allocs} times");
        }
    }
    // Chains of 8 (7 unsignaled, the last signaled), as post_poll's Prepared level posts them.
    for round in 0..2 {
        let before = ALLOCS.load(Ordering::Relaxed);
        for i in 0..40u64 {
            let posts: [ibverbs::PreparedPost<'_>; 8] = std::array::from_fn(|k| {
                let post = prepared.at(i * 8 + k as u64, k, 8, 8 * k as u64);
                if k < 7 {
                    post.unsignaled()
                } else {
                    post
                }
            });
            p.a.post_prepared_chain(&posts).unwrap();
            drain(&mut p.cq_a, &mut out, 1);
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        if round == 1 {
            assert_eq!(allocs, 0, "prepared chains allocated {allocs} times");
        }
    }
    // The same chains built as they are posted (post_prepared_iter), as post_poll's Prepared
    // level now posts them.
    for round in 0..2 {
        let before = ALLOCS.load(Ordering::Relaxed);
        for i in 0..40u64 {
            p.a.post_prepared_iter((0..8usize).map(|k| {
                let post = prepared.at(i * 8 + k as u64, k, 8, 8 * k as u64);
                if k < 7 {
                    post.unsignaled()
                } else {
                    post
                }
            }))
            .unwrap();
            drain(&mut p.cq_a, &mut out, 1);
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        if round == 1 {
            assert_eq!(allocs, 0, "prepared chains from an iterator allocated {allocs} times");
        }
    }
    // Inline posts of a request prepared with inline data, each bringing its bytes.
    let mut q = pair(ibverbs::QpType::RC, 32, 1, 16);
    let target = q.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap();
    let inline = q.a.prepare_send(SendRequest::write_inline(&[], target.remote())).unwrap();
    let mut data = [0u8; 16];
    for round in 0..2 {
        let before = ALLOCS.load(Ordering::Relaxed);
        for i in 0..300u64 {
            data[(i % 16) as usize] = i as u8;
            q.a.post_prepared_inline(&inline, i, &data[..1 + (i % 16) as usize], i % 48).unwrap();
            drain(&mut q.cq_a, &mut out, 1);
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        if round == 1 {
            assert_eq!(allocs, 0, "prepared inline posts allocated {allocs} times");
        }
    }
}

#[test]
fn scoped_posts_and_polls_do_not_allocate() {
    use ibverbs::{ScopedRecv, ScopedSend};
    let mut p = rc_pair(40);
    let mut src = p.pd.allocate(64).unwrap();
    src.copy_from_slice(&[7; 64]);
    let mut dst = p.pd.allocate(64 * 32).unwrap();
    let target = p.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap();
    let mut out: [Completion; 16] = Default::default();
    let (a, cq_a, b, cq_b) = (&mut p.a, &mut p.cq_a, &mut p.b, &mut p.cq_b);
    for round in 0..2 {
        let before = ALLOCS.load(Ordering::Relaxed);
        for _ in 0..20 {
            // A scope on each side: 32 scoped receives over one split borrow, 32 scoped sends, an
            // RDMA Write and Read of borrowed slices; every completion polled through the scopes.
            b.scope(cq_b, |sb| {
                let whole = sb.local_mut(&mut dst, ..).unwrap();
                for piece in whole.chunks(64) {
                    sb.post_recv(ScopedRecv::new(piece)).unwrap();
                }
                a.scope(cq_a, |sa| {
                    for _ in 0..32 {
                        sa.post_send(ScopedSend::send(sa.local(&src, ..).unwrap())).unwrap();
                    }
                    let w =
                        ScopedSend::write(sa.local(&src, ..8).unwrap(), target.remote().slice(0, 8).unwrap());
                    sa.post_send(w).unwrap();
                    let r =
                        ScopedSend::read(sa.local(&src, ..8).unwrap(), target.remote().slice(0, 8).unwrap());
                    // Refused (a shared borrow is read-only for the device): the error costs
                    // nothing either.
                    assert!(sa.post_send(r).is_err());
                    let deadline = Instant::now() + scaled(Duration::from_secs(10));
                    while sa.in_flight() {
                        for c in sa.poll(&mut out).unwrap() {
                            assert!(c.is_ok(), "{c:?}");
                        }
                        assert!(Instant::now() < deadline, "timed out");
                    }
                })
                .unwrap();
                let deadline = Instant::now() + scaled(Duration::from_secs(10));
                while sb.in_flight() {
                    for c in sb.poll(&mut out).unwrap() {
                        assert!(c.is_ok(), "{c:?}");
                    }
                    assert!(Instant::now() < deadline, "timed out");
                }
            })
            .unwrap();
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        if round == 1 {
            assert_eq!(allocs, 0, "scoped posts and polls allocated {allocs} times");
        }
    }
    assert_eq!(cq_a.kept() + cq_b.kept(), 0, "everything was polled inside the scopes");
    assert_eq!(dst[64 * 31..], [7; 64]);
}

#[test]
fn prepared_receives_do_not_allocate() {
    let mut p = rc_pair(32);
    let src = std::sync::Arc::new(p.pd.allocate(64).unwrap());
    let send = p.a.prepare_send(SendRequest::send(Local::whole(src))).unwrap();
    let region = std::sync::Arc::new(p.pd.allocate_remote(64 * 16, AccessFlags::empty()).unwrap());
    let recv = p.b.prepare_recv(ibverbs::RecvRequest::new(Local::whole(region.clone()))).unwrap();
    // Prepared receives into shared receive queues (one per round: nothing consumes them).
    let mut srqs = [p.pd.create_srq(16, 1).unwrap(), p.pd.create_srq(16, 1).unwrap()];
    let srq_recv = srqs
        .each_ref()
        .map(|srq| srq.prepare_recv(ibverbs::RecvRequest::new(Local::whole(region.clone()))).unwrap());
    let mut out: [Completion; 16] = Default::default();
    for round in 0..2 {
        let before = ALLOCS.load(Ordering::Relaxed);
        for i in 0..200u64 {
            p.b.post_prepared_recv(&recv, i, 64 * (i % 16) as usize, 64).unwrap();
            p.a.post_prepared(&send, i, 0, 64, 0).unwrap();
            drain(&mut p.cq_a, &mut out, 1);
            drain(&mut p.cq_b, &mut out, 1);
        }
        for k in 0..16u64 {
            srqs[round].post_prepared_recv(&srq_recv[round], k, 64 * k as usize, 64).unwrap();
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        if round == 1 {
            assert_eq!(allocs, 0, "prepared receives allocated {allocs} times");
        }
    }
}
