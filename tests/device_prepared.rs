//! Prepared requests over a real device: built and checked once, posted many times with only
//! the wr_id and the ranges changing.

mod common;

use std::sync::Arc;

use common::*;
use ibverbs::{AccessFlags, Error, Local, QpState, QpType, RecvRequest, SendRequest};

/// A 4 KiB source filled with `pattern(_, seed)`, an 8 KiB remote-writable target, and an RDMA
/// Write from the one to the other prepared on `p.a`.
fn prepared_write(
    p: &mut Pair,
    seed: u8,
) -> (Arc<ibverbs::MemoryRegion>, Arc<ibverbs::RemoteMemoryRegion>, ibverbs::PreparedSend) {
    let mut src = p.pd.allocate(4096).unwrap();
    src.copy_from_slice(&pattern(4096, seed));
    let src = Arc::new(src);
    let target = Arc::new(p.pd.allocate_remote(8192, AccessFlags::REMOTE_WRITE).unwrap());
    let prepared = p.a.prepare_send(SendRequest::write(Local::whole(src.clone()), target.remote())).unwrap();
    (src, target, prepared)
}

#[test]
fn prepared_writes_move_the_right_bytes_and_pin_their_buffer_to_the_queue_pair() {
    let mut p = rc_pair(32);
    let (src, target, prepared) = prepared_write(&mut p, 7);
    assert_eq!(prepared.buffer_len(), 4096);
    let mut expect = vec![0u8; 8192];
    for i in 0..300u64 {
        let (off, len, roff) = ((i * 131) as usize % 4000, 1 + (i * 7) as u32 % 96, (i * 257) % 8000);
        p.a.post_prepared(&prepared, i, off, len, roff).unwrap();
        let c = poll_one(&mut p.cq_a);
        assert!(c.is_ok() && c.is_tracked() && c.wr_id() == i, "{c:?}");
        expect[roff as usize..roff as usize + len as usize].copy_from_slice(&src[off..off + len as usize]);
    }
    assert_eq!(target.to_vec(), expect);
    assert_eq!(Arc::strong_count(&src), 3, "ours, the request's and the queue pair's pin");

    // The pin outlives the request and every other handle while a post is outstanding: the
    // device still reads the buffer after both are gone.
    p.a.post_prepared(&prepared, 7, 100, 64, 0).unwrap();
    drop(prepared);
    let weak = Arc::downgrade(&src);
    let first = src[100..164].to_vec();
    drop(src);
    assert_eq!(weak.strong_count(), 1, "only the queue pair's pin is left");
    let mut c = poll_one(&mut p.cq_a);
    assert!(c.is_ok() && c.wr_id() == 7, "{c:?}");
    assert_eq!(c.take_buffers().count(), 0, "the slot held nothing");
    assert_eq!(&target.to_vec()[..64], &first[..]);

    // Nothing outstanding and nobody else holding it: the next prepare lets the pin go.
    let other = Arc::new(p.pd.allocate(64).unwrap());
    let again = p.a.prepare_send(SendRequest::write(Local::whole(other.clone()), target.remote())).unwrap();
    assert_eq!(weak.strong_count(), 0, "the buffer was freed");
    assert_eq!(Arc::strong_count(&other), 3);
    drop(again);
    drop(p.a);
    assert_eq!(Arc::strong_count(&other), 1, "the queue pair's drop lets its pins go");
}

#[test]
fn prepared_atomics_and_sends() {
    let mut p = rc_pair(8);
    let counter = Arc::new(p.pd.allocate_remote(16, AccessFlags::REMOTE_ATOMIC).unwrap());
    let old = Arc::new(p.pd.allocate_remote(8, AccessFlags::LOCAL_WRITE).unwrap());
    let add =
        p.a.prepare_send(SendRequest::fetch_add(Local::whole(old.clone()), counter.remote(), 3)).unwrap();
    // The checks come before the device: an atomic of 4 bytes or at a misaligned address.
    assert!(matches!(p.a.post_prepared(&add, 0, 0, 4, 8), Err(Error::InvalidArgument { .. })));
    assert!(matches!(p.a.post_prepared(&add, 0, 0, 8, 4), Err(Error::InvalidArgument { .. })));
    if has_atomics(&p.ctx) {
        for i in 0..10u64 {
            p.a.post_prepared(&add, i, 0, 8, 8).unwrap();
            assert!(poll_one(&mut p.cq_a).is_ok());
            assert_eq!(old.load_u64(0).unwrap(), 3 * i, "the old value came back");
        }
        assert_eq!(counter.load_u64(8).unwrap(), 30);
    }

    // Sends, with immediate data where the transport has it (not iWARP).
    let imm = has_immediate(&p.ctx).then_some(9);
    let msg = Arc::new(p.pd.register(b"hello prepared".to_vec(), AccessFlags::LOCAL_WRITE).unwrap());
    let send = p.a.prepare_send(maybe_imm(SendRequest::send(Local::whole(msg.clone())), imm)).unwrap();
    for i in 0..5 {
        p.b.post_recv(ibverbs::RecvRequest::new(Local::whole(p.pd.allocate(64).unwrap()))).unwrap();
        p.a.post_prepared(&send, i, 6, 8, 0).unwrap();
        assert!(poll_one(&mut p.cq_a).is_ok());
        let mut r = poll_one(&mut p.cq_b);
        assert_eq!((r.byte_len(), r.imm_data()), (8, imm));
        assert_eq!(&r.take_region().unwrap()[..8], b"prepared");
    }
    assert!(matches!(p.a.post_prepared(&send, 0, 0, 4, 1), Err(Error::InvalidArgument { .. })));
}

#[test]
fn a_prepared_request_is_checked_once_and_cheaply_after() {
    let mut p = rc_pair(4);
    let src = Arc::new(p.pd.allocate(64).unwrap());
    let target = Arc::new(p.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    let write = || SendRequest::write(Local::whole(src.clone()), target.remote());
    let prepared = p.a.prepare_send(write()).unwrap();
    // Ranges outside the buffer or the remote range, with overflowing arithmetic too.
    for (off, len, roff) in [(0, 65, 0), (60, 8, 0), (usize::MAX, 2, 0), (0, 8, 57), (0, 1, u64::MAX)] {
        let r = p.a.post_prepared(&prepared, 0, off, len, roff);
        assert!(matches!(r, Err(Error::OutOfBounds { .. })), "{off} {len} {roff}: {r:?}");
    }
    // Another queue pair, even one that reuses the freed QP's memory, is refused.
    assert!(matches!(p.b.post_prepared(&prepared, 0, 0, 8, 0), Err(Error::InvalidArgument { .. })));
    // Queue pairs of their own beyond the pair's: on CQs of their own, so that the pair's CQs
    // (sized for the pair: some devices, e.g. siw, give exactly the depth asked) keep their room.
    let spare_cq = p.ctx.create_cq(16, None).unwrap();
    let ud_prepared = {
        let qp = p.pd.create_qp(&spare_cq, QpType::RC).max_send_wr(1).max_recv_wr(1).build().unwrap();
        qp.prepare_send(write()).unwrap()
    };
    if is_iwarp() {
        unsupported(&p.ctx, "UD", "iWARP: RC only (a prepared request on another, UD, queue pair)");
    } else {
        for _ in 0..8 {
            let mut ud = p.pd.create_qp(&spare_cq, QpType::UD).max_send_wr(1).max_recv_wr(1).build().unwrap();
            ud.activate_ud(&opts()).unwrap();
            let r = ud.post_prepared(&ud_prepared, 0, 0, 8, 0);
            assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
        }
    }
    // An owned buffer is not preparable; the request comes back.
    let owned = p.pd.allocate(8).unwrap();
    let e = p.a.prepare_send(SendRequest::write(Local::whole(owned), target.remote())).unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }));
    assert!(e.request.into_buffers().next().and_then(ibverbs::LocalBuf::into_region).is_some());
    // The state is checked at each post, not at preparation.
    let mut fresh = p.pd.create_qp(&spare_cq, QpType::RC).max_send_wr(1).max_recv_wr(1).build().unwrap();
    let early = fresh.prepare_send(write()).unwrap();
    assert_eq!(fresh.state(), QpState::RESET);
    assert!(matches!(fresh.post_prepared(&early, 0, 0, 8, 0), Err(Error::QpState { .. })));
}

#[test]
fn prepared_chains_post_with_one_call_and_release_every_slot() {
    let mut p = rc_pair(32);
    let (src, target, prepared) = prepared_write(&mut p, 3);
    let mut expect = vec![0u8; 8192];
    for round in 0..20u64 {
        // 16 writes, only the last signaled: its completion releases all 16 slots.
        let posts: Vec<ibverbs::PreparedPost<'_>> = (0..16u64)
            .map(|k| {
                let i = round * 16 + k;
                let (off, len, roff) = ((i * 131) as usize % 4000, 1 + (i * 7) as u32 % 96, (i * 257) % 8000);
                expect[roff as usize..roff as usize + len as usize]
                    .copy_from_slice(&src[off..off + len as usize]);
                let post = prepared.at(i, off, len, roff);
                if k < 15 {
                    post.unsignaled()
                } else {
                    post
                }
            })
            .collect();
        p.a.post_prepared_chain(&posts).unwrap();
        let c = poll_one(&mut p.cq_a);
        assert!(c.is_ok() && c.is_tracked() && c.wr_id() == round * 16 + 15, "{c:?}");
    }
    assert_eq!(target.to_vec(), expect);
    assert_eq!(Arc::strong_count(&src), 3, "slots hold nothing: ours, `prepared` and the pin");

    // Checked before anything is posted: a bad range anywhere refuses the whole chain.
    let posts = [prepared.at(1, 0, 8, 0), prepared.at(2, 4090, 8, 0)];
    let e = p.a.post_prepared_chain(&posts).unwrap_err();
    assert!(matches!(e.error, Error::OutOfBounds { .. }) && e.posted == 0, "{e:?}");
    // Longer than the send queue: refused whole.
    let posts: Vec<_> = (0..33).map(|i| prepared.at(i, 0, 8, 0).unsignaled()).collect();
    let e = p.a.post_prepared_chain(&posts).unwrap_err();
    assert!(matches!(e.error, Error::QueueFull { .. }) && e.posted == 0, "{e:?}");
    // Another queue pair's request.
    let e = p.b.post_prepared_chain(&[prepared.at(0, 0, 8, 0)]).unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }) && e.posted == 0, "{e:?}");
    assert!(p.a.post_prepared_chain(&[]).is_ok());
    assert_eq!(Arc::strong_count(&src), 3, "refused chains keep nothing");
}

// A completion releases every unsignaled slot before it. Slots of prepared posts hold nothing
// and are released without being looked at while no slot that holds something is
// outstanding; a one-shot request's buffer among them must still come back (be dropped) with
// the completion that releases it, and the fast release resume after it.
#[test]
fn a_buffer_among_unsignaled_prepared_posts_comes_back_with_the_later_completion() {
    let mut p = rc_pair(32);
    let mut src = p.pd.allocate(256).unwrap();
    src.copy_from_slice(&pattern(256, 5));
    let src = Arc::new(src);
    let mut owned = p.pd.allocate(64).unwrap();
    owned.copy_from_slice(&pattern(64, 9));
    let owned = Arc::new(owned);
    let target = Arc::new(p.pd.allocate_remote(8192, AccessFlags::REMOTE_WRITE).unwrap());
    let prepared = p.a.prepare_send(SendRequest::write(Local::whole(src.clone()), target.remote())).unwrap();
    let at = |i: u64| prepared.at(i, 0, 64, 1024 + 64 * (i % 32)).unsignaled();
    for round in 0..10u64 {
        let base = round * 10;
        p.a.post_prepared_chain(&[at(base), at(base + 1), at(base + 2)]).unwrap();
        let wr =
            SendRequest::write(Local::whole(owned.clone()), target.remote()).wr_id(base + 3).unsignaled();
        p.a.post_send(wr).unwrap();
        assert_eq!(Arc::strong_count(&owned), 2, "the slot holds the buffer");
        p.a.post_prepared_chain(&[at(base + 4), at(base + 5), prepared.at(base + 6, 0, 64, 0)]).unwrap();
        let c = poll_one(&mut p.cq_a);
        assert!(c.is_ok() && c.is_tracked() && c.wr_id() == base + 6, "{c:?}");
        assert_eq!(Arc::strong_count(&owned), 1, "released with the completion after it, round {round}");
        // Light slots only, after the heavy one was released.
        p.a.post_prepared_chain(&[at(base + 7), at(base + 8), prepared.at(base + 9, 0, 64, 0)]).unwrap();
        let mut c = poll_one(&mut p.cq_a);
        assert!(c.is_ok() && c.wr_id() == base + 9 && c.take_buffers().count() == 0, "{c:?}");
    }
    let bytes = target.to_vec();
    assert_eq!(&bytes[..64], &src[..64], "the last signaled prepared write landed at 0");
    assert_eq!(Arc::strong_count(&src), 3, "ours, `prepared` and the queue pair's pin");
}

#[test]
fn prepared_posts_from_an_iterator_are_written_as_they_come() {
    let mut p = rc_pair(32);
    let (src, target, prepared) = prepared_write(&mut p, 11);
    let mut expect = vec![0u8; 8192];
    for round in 0..5u64 {
        let posts = (0..16u64).map(|k| {
            let i = round * 16 + k;
            let (off, len, roff) = ((i * 97) as usize % 4000, 1 + (i * 5) as u32 % 90, (i * 131) % 8000);
            expect[roff as usize..roff as usize + len as usize]
                .copy_from_slice(&src[off..off + len as usize]);
            let post = prepared.at(i, off, len, roff);
            if k < 15 {
                post.unsignaled()
            } else {
                post
            }
        });
        p.a.post_prepared_iter(posts).unwrap();
        let c = poll_one(&mut p.cq_a);
        assert!(c.is_ok() && c.wr_id() == round * 16 + 15, "{c:?}");
    }
    assert_eq!(target.to_vec(), expect);

    // A chain of one (posted on the stack) and an empty one.
    p.a.post_prepared_iter(std::iter::once(prepared.at(500, 0, 8, 0))).unwrap();
    assert_eq!(poll_one(&mut p.cq_a).wr_id(), 500);
    p.a.post_prepared_iter(std::iter::empty()).unwrap();
    // An iterator whose size hint says one but yields two: the first is posted, the second
    // refused with a typed error (not silently dropped).
    struct Lying<I>(I);
    impl<I: Iterator> Iterator for Lying<I> {
        type Item = I::Item;
        fn next(&mut self) -> Option<I::Item> {
            self.0.next()
        }
        fn size_hint(&self) -> (usize, Option<usize>) {
            (1, Some(1))
        }
    }
    let e = p.a.post_prepared_iter(Lying([prepared.at(510, 0, 8, 0), prepared.at(511, 0, 8, 0)].into_iter()));
    let e = e.unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }) && e.posted == 1, "{e:?}");
    assert_eq!(poll_one(&mut p.cq_a).wr_id(), 510);

    // An iterator with no size hint, and a chain from an array.
    let mut k = 0u64;
    let unhinted = std::iter::from_fn(|| {
        k += 1;
        (k <= 3).then(|| prepared.at(600 + k, 0, 8, 8 * k))
    });
    p.a.post_prepared_iter(unhinted).unwrap();
    p.a.post_prepared_iter([prepared.at(700, 0, 8, 0), prepared.at(701, 8, 8, 8)]).unwrap();
    let mut got = Vec::new();
    while got.len() < 5 {
        got.push(poll_one(&mut p.cq_a).wr_id());
    }
    assert_eq!(got, [601, 602, 603, 700, 701]);
    // Longer than the send queue, or a bad range anywhere: refused whole, nothing posted, and
    // the queue as it was.
    let mut longer = (0..40).map(|i| prepared.at(i, 0, 8, 0).unsignaled());
    let e = p.a.post_prepared_iter(&mut longer).unwrap_err();
    assert!(matches!(e.error, Error::QueueFull { .. }) && e.posted == 0, "{e:?}");
    assert_eq!(longer.count(), 7, "taken up to the post found without room (the 33rd)");
    let e = p.a.post_prepared_iter([prepared.at(1, 0, 8, 0), prepared.at(2, 4090, 8, 0)]).unwrap_err();
    assert!(matches!(e.error, Error::OutOfBounds { .. }) && e.posted == 0, "{e:?}");
    p.a.post_prepared_iter((0..32).map(|i| prepared.at(900 + i, 0, 8, 0))).unwrap();
    for i in 0..32 {
        assert_eq!(poll_one(&mut p.cq_a).wr_id(), 900 + i, "the whole queue is free again");
    }
    assert_eq!(Arc::strong_count(&src), 3, "ours, `prepared` and the queue pair's pin");
}

// A chain's scratch entry keeps the template last posted there (the request's opcode, keys,
// immediate data) and rewrites it only when another request comes to that index: chains that
// mix three requests, each at a different index every round, must still post each as prepared.
#[test]
fn chains_mixing_prepared_requests_post_each_with_its_own_template() {
    let mut p = rc_pair(32);
    let mut src = p.pd.allocate(4096).unwrap();
    src.copy_from_slice(&pattern(4096, 5));
    let src = Arc::new(src);
    let t1 = Arc::new(p.pd.allocate_remote(4096, AccessFlags::REMOTE_WRITE).unwrap());
    let t2 = Arc::new(p.pd.allocate_remote(4096, AccessFlags::REMOTE_WRITE).unwrap());
    // With immediate data where the transport has it (not iWARP): then the second Write takes a
    // receive too.
    let with_imm = has_immediate(&p.ctx);
    let (imm_w2, imm_send) = (with_imm.then_some(77), with_imm.then_some(5));
    let w1 = p.a.prepare_send(SendRequest::write(Local::whole(src.clone()), t1.remote())).unwrap();
    let w2 = SendRequest::write(Local::whole(src.clone()), t2.remote());
    let w2 = p.a.prepare_send(maybe_imm(w2, imm_w2)).unwrap();
    let send = p.a.prepare_send(maybe_imm(SendRequest::send(Local::whole(src.clone())), imm_send)).unwrap();
    let (mut e1, mut e2) = (vec![0u8; 4096], vec![0u8; 4096]);
    let mut received = Vec::new();
    for round in 0..12u64 {
        // Round r puts request (r + k) % 3 at index k: every index sees every request.
        let mut posts = Vec::new();
        let mut imms = 0;
        for k in 0..6u64 {
            let i = round * 6 + k;
            let (off, len, roff) = ((i * 97) as usize % 4000, 1 + (i * 13) as u32 % 64, (i * 61) % 4000);
            let post = match (round + k) % 3 {
                0 => {
                    e1[roff as usize..][..len as usize].copy_from_slice(&src[off..][..len as usize]);
                    w1.at(i, off, len, roff)
                }
                1 => {
                    e2[roff as usize..][..len as usize].copy_from_slice(&src[off..][..len as usize]);
                    imms += usize::from(with_imm);
                    w2.at(i, off, len, roff)
                }
                _ => {
                    received.push((src[off..][..len as usize].to_vec(), imm_send));
                    imms += 1;
                    send.at(i, off, len, 0)
                }
            };
            posts.push(if k < 5 { post.unsignaled() } else { post });
        }
        // Write-with-immediate and Send each take a receive on b (`imms` of them).
        for _ in 0..imms {
            p.b.post_recv(ibverbs::RecvRequest::new(Local::whole(p.pd.allocate(64).unwrap()))).unwrap();
        }
        p.a.post_prepared_chain(&posts).unwrap();
        let c = poll_one(&mut p.cq_a);
        assert!(c.is_ok() && c.wr_id() == round * 6 + 5, "{c:?}");
        for _ in 0..imms {
            let mut r = poll_one(&mut p.cq_b);
            assert!(r.is_ok(), "{r:?}");
            if r.opcode() == ibverbs::WcOpcode::RECV_RDMA_WITH_IMM {
                assert_eq!(r.imm_data(), Some(77));
            } else {
                let (bytes, imm) = received.remove(0);
                assert_eq!(r.imm_data(), imm);
                assert_eq!(&r.take_region().unwrap()[..bytes.len()], &bytes[..]);
            }
        }
        // A single post between chains (its own request, not the scratch) changes nothing.
        p.a.post_prepared(&w1, 1000 + round, 0, 8, 4088).unwrap();
        assert!(poll_one(&mut p.cq_a).is_ok());
        e1[4088..].copy_from_slice(&src[..8]);
    }
    assert!(received.is_empty());
    assert_eq!(t1.to_vec(), e1);
    assert_eq!(t2.to_vec(), e2);
    drop((w1, w2, send));
    assert_eq!(Arc::strong_count(&src), 2, "the queue pair's pin is left");
    drop(p.a);
    assert_eq!(Arc::strong_count(&src), 1, "and goes with the queue pair");
}

#[test]
fn small_prepared_sends_and_writes_from_a_local_region_go_inline() {
    let mut p = pair(QpType::RC, 8, 1, 64);
    let inline_max = p.a.caps().max_inline_data;
    assert!(inline_max >= 64, "asked for 64 inline bytes: {inline_max}");
    let src = Arc::new(p.pd.register(pattern(4096, 3), AccessFlags::LOCAL_WRITE).unwrap());
    let target = Arc::new(p.pd.allocate_remote(4096, AccessFlags::REMOTE_WRITE).unwrap());
    let inline = |post: ibverbs::PreparedPost<'_>| format!("{post:?}").contains("inline: true");

    let write = p.a.prepare_send(SendRequest::write(Local::whole(src.clone()), target.remote())).unwrap();
    assert!(inline(write.at(0, 0, inline_max, 0)) && inline(write.at(0, 0, 0, 0)));
    assert!(!inline(write.at(0, 0, inline_max + 1, 0)), "longer than max_inline_data");
    // Inline and not, one after the other: the bytes land either way.
    for (i, (off, len)) in [(5usize, 48u32), (100, 1000), (7, 1)].into_iter().enumerate() {
        p.a.post_prepared(&write, i as u64, off, len, off as u64).unwrap();
        assert!(poll_one(&mut p.cq_a).is_ok());
        let end = off + len as usize;
        assert_eq!(&target.to_vec()[off..end], &src[off..end], "post {i}");
    }
    let send = p.a.prepare_send(SendRequest::send(Local::whole(src.clone()))).unwrap();
    assert!(inline(send.at(0, 0, 64, 0)));
    p.b.post_recv(ibverbs::RecvRequest::new(Local::whole(p.pd.allocate(64).unwrap()))).unwrap();
    p.a.post_prepared(&send, 9, 10, 64, 0).unwrap();
    assert!(poll_one(&mut p.cq_a).is_ok());
    let mut r = poll_one(&mut p.cq_b);
    assert_eq!(r.byte_len(), 64);
    assert_eq!(&r.take_region().unwrap()[..], &src[10..74]);

    // Never inline: a region another thread may write, and an RDMA Read.
    let remote_src = Arc::new(p.pd.allocate_remote(64, AccessFlags::LOCAL_WRITE).unwrap());
    let w = p.a.prepare_send(SendRequest::write(Local::whole(remote_src), target.remote())).unwrap();
    assert!(!inline(w.at(0, 0, 8, 0)));
    let dst = Arc::new(p.pd.allocate_remote(64, AccessFlags::LOCAL_WRITE).unwrap());
    let read = p.a.prepare_send(SendRequest::read(Local::whole(dst), target.remote())).unwrap();
    assert!(!inline(read.at(0, 0, 8, 0)));
    // A queue pair without inline room: nothing goes inline.
    let q = rc_pair(4);
    let s2 = Arc::new(q.pd.allocate(64).unwrap());
    let t2 = Arc::new(q.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    let none = q.a.prepare_send(SendRequest::write(Local::whole(s2), t2.remote())).unwrap();
    match q.a.caps().max_inline_data {
        0 => assert!(!inline(none.at(0, 0, 0, 0)) && !inline(none.at(0, 0, 8, 0))),
        room => unsupported(
            &q.pd.context(),
            "a queue pair without inline room",
            format_args!("asked for none, the device gave {room} bytes"),
        ),
    }
}

// Prepared receives: many posted into one Arc<RemoteMemoryRegion> at once, each landing at its
// own offset; their completions hand no buffer back; the queue pair's pin keeps the region
// alive for posted receives after every handle of ours is gone, and lets it go afterwards.
#[test]
fn prepared_receives_land_in_one_shared_region_which_the_queue_pair_pins() {
    let mut p = rc_pair(8);
    let mut src = p.pd.allocate(4096).unwrap();
    src.copy_from_slice(&pattern(4096, 21));
    let src = Arc::new(src);
    let send = p.a.prepare_send(SendRequest::send(Local::whole(src.clone()))).unwrap();
    let region = Arc::new(p.pd.allocate_remote(8 * 256, AccessFlags::empty()).unwrap());
    let recv = p.b.prepare_recv(RecvRequest::new(Local::whole(region.clone()))).unwrap();
    assert_eq!(recv.buffer_len(), 8 * 256);
    for round in 0..3u64 {
        for i in 0..8u64 {
            p.b.post_prepared_recv(&recv, round * 8 + i, 256 * i as usize, 256).unwrap();
        }
        assert!(matches!(p.b.post_prepared_recv(&recv, 0, 0, 8), Err(Error::QueueFull { .. })));
        for i in 0..8u64 {
            let len = 1 + (round * 8 + i) as u32 * 9;
            p.a.post_prepared(&send, i, (i * 100) as usize, len, 0).unwrap();
            assert!(poll_one(&mut p.cq_a).is_ok());
        }
        for (i, mut c) in poll_n(&mut p.cq_b, 8).into_iter().enumerate() {
            let len = 1 + (round * 8 + i as u64) as u32 * 9;
            assert!(c.is_ok(), "{c:?}");
            assert_eq!((c.wr_id(), c.byte_len()), (round * 8 + i as u64, len));
            assert!(c.take_buffers().next().is_none(), "a prepared receive's slot holds nothing");
            let mut got = vec![0u8; len as usize];
            region.read(256 * i, &mut got).unwrap();
            assert_eq!(got, src[i * 100..][..len as usize], "round {round} message {i}");
        }
    }

    // Every handle of ours dropped while two receives are posted: the pin keeps the region.
    p.b.post_prepared_recv(&recv, 100, 0, 64).unwrap();
    p.b.post_prepared_recv(&recv, 101, 64, 64).unwrap();
    let weak = Arc::downgrade(&region);
    drop((recv, region));
    assert!(weak.upgrade().is_some(), "pinned by the queue pair");
    for i in 0..2 {
        p.a.post_prepared(&send, i, 0, 64, 0).unwrap();
        assert!(poll_one(&mut p.cq_a).is_ok());
    }
    let got: Vec<u64> = poll_n(&mut p.cq_b, 2).iter().map(|c| c.wr_id()).collect();
    assert_eq!(got, [100, 101]);
    let mut landed = vec![0u8; 128];
    weak.upgrade().unwrap().read(0, &mut landed).unwrap();
    assert_eq!(landed[..64], src[..64]);
    assert_eq!(landed[64..], src[..64]);
    // The next prepare_recv, with no receive outstanding, lets the unused pin go.
    let other = Arc::new(p.pd.allocate_remote(64, AccessFlags::empty()).unwrap());
    let recv2 = p.b.prepare_recv(RecvRequest::new(Local::whole(other.clone()))).unwrap();
    assert!(weak.upgrade().is_none(), "pruned: nothing posted, nobody else holds it");

    // What a prepared receive refuses.
    let e = p.b.prepare_recv(RecvRequest::new(Local::whole(src.clone()))).unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }), "a read-only shared region: {e}");
    let e = p.b.prepare_recv(RecvRequest::new(Local::whole(p.pd.allocate(64).unwrap()))).unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }), "an owned region: {e}");
    assert!(e.request.into_buffers().next().is_some(), "handed back with its buffer");
    let third = Arc::new(p.pd.allocate_remote(16, AccessFlags::empty()).unwrap());
    let two = RecvRequest::new(Local::new(third.clone(), 0..8).unwrap())
        .scatter(Local::new(third.clone(), 8..16).unwrap());
    let e = p.b.prepare_recv(two.unwrap()).unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }), "two entries: {e}");
    let e = p.b.post_prepared_recv(&recv2, 0, 60, 8).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    let e = p.a.post_prepared_recv(&recv2, 0, 0, 8).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "prepared for b, posted on a: {e}");
    assert_eq!(p.b.outstanding_recvs(), 0);
    drop(p.b);
    assert_eq!(Arc::strong_count(&other), 2, "ours and recv2's: the queue pair's drop let its pin go");
}

#[test]
fn requests_prepared_with_inline_data_bring_their_bytes_at_each_post() {
    let mut p = pair(QpType::RC, 16, 1, 64);
    let target = Arc::new(p.pd.allocate_remote(256, AccessFlags::REMOTE_WRITE).unwrap());
    // The data given at preparation only makes it an inline request; it is not kept.
    let write = p.a.prepare_send(SendRequest::write_inline(b"not sent", target.remote())).unwrap();
    let cap = write.inline_capacity().expect("an inline request");
    assert!(cap >= 64, "max_inline_data {cap}");
    assert_eq!(write.buffer_len(), 0);
    let mut expect = vec![0u8; 256];
    let mut data = [0u8; 64];
    for i in 0..100u64 {
        let (len, roff) = (1 + (i * 5) as usize % 64, (i * 37) % 192);
        data[..len].copy_from_slice(&pattern(len, i as u8));
        p.a.post_prepared_inline(&write, i, &data[..len], roff).unwrap();
        // Copied during the post: changing the bytes now changes nothing that arrives.
        data.fill(0xee);
        let mut c = poll_one(&mut p.cq_a);
        assert!(c.is_ok() && c.is_tracked() && c.wr_id() == i, "{c:?}");
        assert_eq!(c.take_buffers().count(), 0, "the slot held nothing");
        expect[roff as usize..roff as usize + len].copy_from_slice(&pattern(len, i as u8));
    }
    assert_eq!(target.to_vec(), expect);
    // Byte by byte, as a spin loop polls the flag a peer's write sets.
    for (i, &b) in expect.iter().enumerate() {
        assert_eq!(target.byte(i).unwrap().load(), b, "byte {i}");
    }
    assert!(matches!(target.byte(256), Err(Error::OutOfBounds { .. })));
    // Empty posts, inline or through `at` (the one range an inline request has).
    p.a.post_prepared_inline(&write, 200, &[], 0).unwrap();
    assert!(poll_one(&mut p.cq_a).is_ok());
    p.a.post_prepared(&write, 201, 0, 0, 10).unwrap();
    assert!(poll_one(&mut p.cq_a).is_ok());
    assert_eq!(target.to_vec(), expect, "empty writes change nothing");

    // Refusals: too much data, a remote range outside the target, another queue pair, a
    // request over a buffer, a local range on an inline request, a remote offset on a Send.
    let big = vec![1u8; cap + 1];
    let r = p.a.post_prepared_inline(&write, 0, &big, 0);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    for (len, roff) in [(8, 249), (1, 256), (1, u64::MAX)] {
        let r = p.a.post_prepared_inline(&write, 0, &data[..len], roff);
        assert!(matches!(r, Err(Error::OutOfBounds { .. })), "{len} {roff}: {r:?}");
    }
    let r = p.b.post_prepared_inline(&write, 0, b"x", 0);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let src = Arc::new(p.pd.allocate(64).unwrap());
    let over_buffer = p.a.prepare_send(SendRequest::write(Local::whole(src), target.remote())).unwrap();
    assert_eq!(over_buffer.inline_capacity(), None);
    let r = p.a.post_prepared_inline(&over_buffer, 0, b"x", 0);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let r = p.a.post_prepared(&write, 0, 0, 4, 0);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");

    // Sends, with immediate data where the transport has it (not iWARP), into the peer's
    // receives.
    let imm = has_immediate(&p.ctx).then_some(0x55);
    let send = p.a.prepare_send(maybe_imm(SendRequest::send_inline(&[]), imm)).unwrap();
    for i in 0..10u64 {
        p.b.post_recv(RecvRequest::new(Local::whole(p.pd.allocate(64).unwrap()))).unwrap();
        let msg = pattern(1 + i as usize * 6, 40 + i as u8);
        p.a.post_prepared_inline(&send, i, &msg, 0).unwrap();
        assert!(poll_one(&mut p.cq_a).is_ok());
        let mut r = poll_one(&mut p.cq_b);
        assert!(r.is_ok(), "{r:?}");
        assert_eq!((r.byte_len() as usize, r.imm_data()), (msg.len(), imm));
        assert_eq!(&r.take_region().unwrap()[..msg.len()], &msg[..]);
    }
    let r = p.a.post_prepared_inline(&send, 0, b"x", 1);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    // No post went out for the refusals: nothing more completes.
    let mut out: [ibverbs::Completion; 4] = Default::default();
    assert_eq!(p.cq_a.poll(&mut out).unwrap().len(), 0);

    // The state is checked at each post.
    let spare_cq = p.ctx.create_cq(4, None).unwrap();
    let mut fresh =
        p.pd.create_qp(&spare_cq, QpType::RC)
            .max_send_wr(1)
            .max_recv_wr(1)
            .max_inline_data(8)
            .build()
            .unwrap();
    let early = fresh.prepare_send(SendRequest::write_inline(&[], target.remote())).unwrap();
    let r = fresh.post_prepared_inline(&early, 0, b"x", 0);
    assert!(matches!(r, Err(Error::QpState { .. })), "{r:?}");
}
