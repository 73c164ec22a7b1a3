//! Registered buffer pools over a real device: one registration carved into owned chunks, a
//! receive pool that keeps a queue pair stocked, chunks used as send sources.

mod common;

use std::collections::VecDeque;

use common::*;
use ibverbs::{Chunk, Completion, Error, Local, ReceivePool, SendRequest};

#[test]
fn chunks_are_owned_disjoint_pieces_of_one_registration() {
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.allocate(10_000).unwrap();
    let (base, lkey) = (mr.addr() as usize, mr.lkey());
    let mut chunks = mr.into_chunks(4096).unwrap();
    assert_eq!(chunks.iter().map(Chunk::len).collect::<Vec<_>>(), [4096, 4096, 1808]);
    assert_eq!(chunks.iter().map(Chunk::offset).collect::<Vec<_>>(), [0, 4096, 8192]);
    for (i, c) in chunks.iter_mut().enumerate() {
        assert_eq!(c.addr() as usize, base + c.offset());
        assert_eq!(c.lkey(), lkey, "one registration");
        c.fill(i as u8 + 1);
    }
    for (i, c) in chunks.iter().enumerate() {
        assert!(c.iter().all(|&b| b == i as u8 + 1), "chunk {i} was not touched by its neighbours");
    }
    let last = chunks.pop().unwrap();
    let (last, e) = last.split_at(1809).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }));
    let (a, b) = last.split_at(8).unwrap();
    assert_eq!((a.offset(), a.len(), b.offset(), b.len()), (8192, 8, 8200, 1800));
    assert!(matches!(pd.allocate(64).unwrap().into_chunks(0), Err(Error::InvalidArgument { .. })));
    let (x, y) = pd.allocate(64).unwrap().split_at(64).unwrap();
    assert_eq!((x.len(), y.len()), (64, 0));
    // A range outside a chunk is refused, naming the call.
    match Local::new(a, 0..9) {
        Err(Error::OutOfBounds { verb: "Local::new", size: 8, .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_receive_pool_keeps_a_queue_pair_stocked_and_messages_land_in_place() {
    const MESSAGES: u32 = 500;
    let mut p = rc_pair(16);
    let mut pool = ReceivePool::new(p.pd.allocate(64 * 1024).unwrap().into_chunks(1024).unwrap());
    assert_eq!(pool.available(), 64);
    // The safe level's ring holds the depth asked for; the device may grant more.
    assert_eq!((p.b.recv_capacity(), p.b.send_capacity()), (16, 16));
    assert!(p.b.caps().max_recv_wr >= 16, "{:?}", p.b.caps());
    assert_eq!(pool.refill(&mut p.b).unwrap(), 16, "as many as the receive queue holds");
    assert_eq!((pool.available(), p.b.outstanding_recvs()), (48, 16));
    let mut senders: VecDeque<Chunk> = p.pd.allocate(8 * 1024).unwrap().into_chunks(1024).unwrap().into();
    let mut out: [Completion; 16] = Default::default();
    let (mut sent, mut received) = (0u32, 0u32);
    let deadline = std::time::Instant::now() + scaled(std::time::Duration::from_secs(60));
    while received < MESSAGES {
        assert!(std::time::Instant::now() < deadline, "timed out at {received}");
        // Keep within the receives the peer has posted.
        while sent < MESSAGES && sent < received + 16 {
            let Some(mut chunk) = senders.pop_front() else { break };
            let len = 1 + (sent as usize * 37) % 1024;
            let msg = pattern(len, sent as u8);
            chunk[..len].copy_from_slice(&msg);
            p.a.post_send(SendRequest::send(Local::new(chunk, ..len).unwrap()).wr_id(u64::from(sent)))
                .unwrap();
            sent += 1;
        }
        for c in p.cq_a.poll(&mut out).unwrap() {
            assert!(c.is_ok(), "{c:?}");
            senders.push_back(c.take_chunk().expect("the send chunk comes back"));
        }
        for c in p.cq_b.poll(&mut out).unwrap() {
            assert!(c.is_ok(), "{c:?}");
            let chunk = c.take_chunk().expect("the receive chunk comes back");
            let len = c.byte_len() as usize;
            assert_eq!(len, 1 + (received as usize * 37) % 1024);
            assert_eq!(&chunk[..len], &pattern(len, received as u8)[..], "message {received} in place");
            assert_eq!(c.wr_id(), chunk.offset() as u64);
            pool.put(chunk);
            received += 1;
        }
        pool.refill(&mut p.b).unwrap();
    }
    assert_eq!(pool.available() + p.b.outstanding_recvs() as usize, 64, "no chunk lost");
}

#[test]
fn a_pool_refuses_what_the_queue_pair_cannot_take_and_keeps_its_chunks() {
    let mut p = rc_pair(4);
    let other_pd = p.ctx.alloc_pd().unwrap();
    let mut pool = ReceivePool::new(other_pd.allocate(4 * 64).unwrap().into_chunks(64).unwrap());
    assert!(matches!(pool.refill(&mut p.b), Err(Error::InvalidArgument { .. })));
    assert_eq!(pool.available(), 4, "the refused chunk stays in the pool");
    // Unsignaled requests may not hold owned chunks (nothing would hand them back).
    let chunk = p.pd.allocate(64).unwrap().into_chunks(64).unwrap().pop().unwrap();
    let target = std::sync::Arc::new(p.pd.allocate_remote(64, ibverbs::AccessFlags::REMOTE_WRITE).unwrap());
    let r = p.a.post_send(SendRequest::write(Local::whole(chunk), target.remote()).unsignaled());
    let e = r.unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }));
    assert!(e.request.into_buffers().next().and_then(ibverbs::LocalBuf::into_chunk).is_some());

    // A chunk no post takes (of 0 bytes) goes to the bottom of the pool: the next refill posts
    // the others instead of failing on it again and again.
    let (_, empty) = p.pd.allocate(64).unwrap().split_at(64).unwrap();
    let mut chunks = p.pd.allocate(2 * 64).unwrap().into_chunks(64).unwrap();
    chunks.push(empty);
    let mut pool = ReceivePool::new(chunks);
    match pool.refill(&mut p.b) {
        Err(Error::InvalidArgument { reason, .. }) if reason.contains("0 bytes") => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(pool.refill(&mut p.b).unwrap(), 2, "the usable chunks are posted");
    assert_eq!(pool.available(), 1, "the empty chunk stays in the pool");
    assert!(pool.refill(&mut p.b).is_err(), "and is refused each time it is tried");
}
