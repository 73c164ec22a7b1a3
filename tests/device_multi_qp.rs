//! Striped connections ([`StripedConnection`]) over a real device: two ends on one device
//! (loopback on rxe0), N = 1, 2, 4, 8 queue pairs; Writes and Reads below and above the split
//! threshold and not divisible by N, data checked; one completion per request; a failing piece
//! makes one error completion and every buffer comes back; dropping with requests outstanding;
//! another queue pair's completion on the connection's CQ is not taken for a piece.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{connect_built, is_iwarp, opts, pair_context, pattern, scaled, time_scale, unsupported};
use ibverbs::cm::CmId;
use ibverbs::striped::{
    EndpointList, StripeBuf, StripeOptions, StripedCompletion, StripedConnection, StripedOp,
};
use ibverbs::{
    AccessFlags, Error, ProtectionDomain, QpType, RemoteMemoryRegion, RemoteSlice, WcStatus,
    IWARP_MANUAL_CONNECT,
};

const THRESHOLD: usize = 16 << 10;

/// Two connected striped ends with `qps` queue pairs on one protection domain.
fn ends(pd: &ProtectionDomain, qps: u32) -> (StripedConnection, StripedConnection, Vec<[CmId; 2]>) {
    ends_with(pd, &StripeOptions { qps, threshold: THRESHOLD, depth: 16, ..StripeOptions::default() })
}

/// Two connected striped ends with `stripe` on one protection domain: through the wire encoding
/// of their endpoints, as a real exchange would; on iWARP (`pd` from [`pair_context`]) of queue
/// pairs connected through RDMA-CM ([`StripedConnection::from_queue_pairs`]; the ids returned
/// hold the connections).
fn ends_with(
    pd: &ProtectionDomain,
    stripe: &StripeOptions,
) -> (StripedConnection, StripedConnection, Vec<[CmId; 2]>) {
    if is_iwarp() {
        let a = StripedConnection::new(pd, stripe).unwrap();
        let e = a.endpoints(&opts()).unwrap_err();
        assert!(matches!(e, Error::Unsupported { capability: IWARP_MANUAL_CONNECT, .. }), "{e:?}");
        let ctx = pd.context();
        let room = stripe.qps * (stripe.depth + 1);
        let (cq_a, cq_b) = (ctx.create_cq(room, None).unwrap(), ctx.create_cq(room, None).unwrap());
        let (mut qa, mut qb, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..stripe.qps {
            let build = |cq| move || pd.create_qp(cq, QpType::RC).max_send_wr(stripe.depth).max_recv_wr(1);
            let (a, b, cm) = connect_built(pd, build(&cq_a), build(&cq_b));
            qa.push(a);
            qb.push(b);
            ids.extend(cm);
        }
        let a = StripedConnection::from_queue_pairs(cq_a, qa, stripe).unwrap();
        let b = StripedConnection::from_queue_pairs(cq_b, qb, stripe).unwrap();
        return (a, b, ids);
    }
    let mut a = StripedConnection::new(pd, stripe).unwrap();
    let mut b = StripedConnection::new(pd, stripe).unwrap();
    let ea = EndpointList::decode(&a.endpoints(&opts()).unwrap().encode()).unwrap();
    let eb = EndpointList::decode(&b.endpoints(&opts()).unwrap().encode()).unwrap();
    assert_eq!(ea.0.len(), stripe.qps as usize);
    a.connect(&eb, &opts()).unwrap();
    b.connect(&ea, &opts()).unwrap();
    (a, b, Vec::new())
}

/// Polls until `n` request completions arrived (10 s, scaled); checks that no more come.
fn wait(c: &mut StripedConnection, n: usize) -> Vec<StripedCompletion> {
    let deadline = Instant::now() + scaled(Duration::from_secs(10));
    let mut out = Vec::with_capacity(16);
    while out.len() < n {
        c.poll(&mut out).unwrap();
        assert!(Instant::now() < deadline, "timed out: {} of {n} completions", out.len());
    }
    assert_eq!(out.len(), n, "one completion per request");
    assert_eq!(c.outstanding(), 0);
    c.poll(&mut out).unwrap();
    assert_eq!(out.len(), n, "no completion beyond one per request");
    out
}

fn target(pd: &ProtectionDomain, len: usize) -> Arc<RemoteMemoryRegion> {
    let flags = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    Arc::new(pd.allocate_remote(len, flags).unwrap())
}

#[test]
fn writes_and_reads_arrive_whole_with_one_completion_per_request() {
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    let all = [1, 100, 4096, THRESHOLD, THRESHOLD + 1, 100_003, (1 << 20) + 7];
    // Under valgrind (time scale > 1): below, just above and well above the threshold.
    let sizes: &[usize] = if time_scale() > 1 { &[100, THRESHOLD + 1, 100_003] } else { &all };
    let max = *sizes.iter().max().unwrap();
    let dst = target(&pd, max);
    for qps in [1, 2, 4, 8] {
        let (mut a, _b, _cm) = ends(&pd, qps);
        for (k, &len) in sizes.iter().enumerate() {
            let seed = (qps as u8).wrapping_mul(17).wrapping_add(k as u8);
            let data = pattern(len, seed);
            // Write from an owned region.
            let mut src = pd.allocate(len).unwrap();
            src.as_mut_slice().copy_from_slice(&data);
            a.post_write(src, dst.remote(), 10 + k as u64).unwrap();
            let mut c = wait(&mut a, 1).pop().unwrap();
            assert!(c.is_ok(), "qps {qps} len {len}: {:?}", c.status());
            assert_eq!((c.wr_id(), c.op(), c.len()), (10 + k as u64, StripedOp::Write, len as u64));
            assert_eq!(c.take_region().expect("owned region back").as_slice(), &data[..]);
            assert_eq!(&dst.to_vec()[..len], &data[..], "qps {qps} len {len}: written");

            // Read it back into a fresh owned region.
            let back = pd.allocate(len).unwrap();
            a.post_read(back, dst.remote(), 99).unwrap();
            let mut c = wait(&mut a, 1).pop().unwrap();
            assert!(c.is_ok(), "read qps {qps} len {len}: {:?}", c.status());
            assert_eq!(c.op(), StripedOp::Read);
            assert_eq!(c.take_region().unwrap().as_slice(), &data[..], "qps {qps} len {len}: read");
        }

        // Several requests outstanding at once, a shared source, distinct remote ranges.
        let len = 3 * THRESHOLD + 5;
        let data = pattern(len, 0x5a);
        let mut src = pd.allocate(len).unwrap();
        src.as_mut_slice().copy_from_slice(&data);
        let src = Arc::new(src);
        let n = if time_scale() > 1 { 3 } else { 6 };
        let wide = target(&pd, len * n);
        for i in 0..n {
            let r = wide.remote().slice((i * len) as u64, len as u64).unwrap();
            a.post_write(src.clone(), r, i as u64).unwrap();
        }
        let mut seen: Vec<u64> = wait(&mut a, n)
            .into_iter()
            .map(|mut c| {
                assert!(c.is_ok());
                assert!(matches!(c.take_buf(), Some(StripeBuf::Shared(_))));
                c.wr_id()
            })
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..n as u64).collect::<Vec<_>>());
        assert_eq!(Arc::strong_count(&src), 1, "every piece's clone came back");
        let all = wide.to_vec();
        for i in 0..n {
            assert_eq!(&all[i * len..(i + 1) * len], &data[..]);
        }
    }
}

#[test]
fn round_robin_without_split_spreads_whole_requests() {
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    let stripe = StripeOptions { qps: 4, split_data: false, depth: 16, ..StripeOptions::default() };
    let (mut a, _b, _cm) = ends_with(&pd, &stripe);
    let len = 100_001;
    let dst = target(&pd, len);
    let data = pattern(len, 3);
    for i in 0..8 {
        let mut src = pd.allocate(len).unwrap();
        src.as_mut_slice().copy_from_slice(&data);
        a.post_write(src, dst.remote(), i).unwrap();
        let c = wait(&mut a, 1);
        assert!(c[0].is_ok());
    }
    assert_eq!(dst.to_vec(), data);
}

#[test]
fn a_failing_piece_makes_one_error_completion_and_buffers_come_back() {
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    if is_iwarp() {
        let why = "iWARP: the responder's refusal ends the connection, the Write completes once sent";
        return unsupported(&ctx, "remote access error completion", why);
    }
    let region = 64 << 10;
    let dst = target(&pd, region);
    for qps in [2, 4, 8] {
        // The remote range runs past the region: only the last piece(s) fail.
        let (mut a, _b, _cm) = ends(&pd, qps);
        let len = 2 * region + 3;
        let beyond = RemoteSlice { len: len as u64, ..dst.remote() };
        a.post_write(pd.allocate(len).unwrap(), beyond, 1).unwrap();
        let mut c = wait(&mut a, 1).pop().unwrap();
        assert_eq!(c.wr_id(), 1);
        assert_eq!(c.status(), WcStatus::REM_ACCESS_ERR, "qps {qps}");
        assert_eq!(c.take_region().expect("buffer back after an error").len(), len);

        // A Read with a wrong rkey, on a fresh connection, then more requests behind it.
        let (mut a, _b, _cm) = ends(&pd, qps);
        let bad = RemoteSlice { rkey: dst.remote().rkey ^ 0x5555, ..dst.remote() };
        a.post_read(pd.allocate(region).unwrap(), bad, 2).unwrap();
        for i in 0..3 {
            a.post_read(pd.allocate(region).unwrap(), dst.remote(), 10 + i).unwrap();
        }
        let done = wait(&mut a, 4);
        for mut c in done {
            if c.wr_id() == 2 {
                assert!(!c.is_ok());
            }
            assert!(c.take_region().is_some(), "every buffer comes back ({:?})", c.status());
        }
    }
}

#[test]
fn requests_that_cannot_be_posted_hand_the_buffer_back() {
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    let (mut a, _b, _cm) = ends(&pd, 2);
    let dst = target(&pd, 4096);
    // Remote range shorter than the buffer.
    let e = a.post_write(pd.allocate(8192).unwrap(), dst.remote(), 1).unwrap_err();
    assert!(matches!(e.error, ibverbs::Error::OutOfBounds { .. }), "{e}");
    assert_eq!(e.buf.unwrap().len(), 8192);
    // A Read into a shared region.
    let shared = Arc::new(pd.allocate(4096).unwrap());
    let e = a.post_read(shared.clone(), dst.remote(), 1).unwrap_err();
    assert!(matches!(e.buf, Some(StripeBuf::Shared(_))));
    // More requests than the depth.
    for i in 0..16 {
        a.post_write(shared.clone(), dst.remote(), i).unwrap();
    }
    let e = a.post_write(shared.clone(), dst.remote(), 16).unwrap_err();
    assert!(matches!(e.error, ibverbs::Error::QueueFull { .. }), "{e}");
    assert_eq!(wait(&mut a, 16).len(), 16);
    // Queue pairs that do not make a connection of these options.
    let ctx = pd.context();
    let (cq, other) = (ctx.create_cq(64, None).unwrap(), ctx.create_cq(64, None).unwrap());
    let qp = |cq: &ibverbs::CompletionQueue, depth| {
        pd.create_qp(cq, QpType::RC).max_send_wr(depth).max_recv_wr(1).build().unwrap()
    };
    let stripe = StripeOptions { qps: 2, depth: 16, ..StripeOptions::default() };
    let refused = |qps: Vec<ibverbs::QueuePair>, cq| {
        let r = StripedConnection::from_queue_pairs(cq, qps, &stripe).map(drop);
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    };
    refused(vec![qp(&cq, 16)], ctx.create_cq(4, None).unwrap()); // one of two
    refused(vec![qp(&cq, 16), qp(&other, 16)], cq); // another CQ
    let cq = ctx.create_cq(64, None).unwrap();
    refused(vec![qp(&cq, 16), qp(&cq, 4)], cq); // room for fewer requests than the depth
                                                // An extended CQ whose completions do not name their queue pair: no piece could be matched.
    match ctx.create_cq_ex(64, None, ibverbs::WcFlags::BYTE_LEN) {
        Ok(cq) => refused(vec![qp(&cq, 16), qp(&cq, 16)], cq),
        Err(e @ Error::Unsupported { .. }) => unsupported(&ctx, "extended CQs", e),
        Err(e) => panic!("create_cq_ex: {e}"),
    }
    if is_iwarp() {
        // The peer list comes from endpoints(), which iWARP refuses (no connecting by hand).
        unsupported(
            &ctx,
            "connecting queue pairs by hand",
            "iWARP: the wrong-length peer list is not checked",
        );
        return;
    }
    // A peer list of the wrong length.
    let (mut c, d) =
        (StripedConnection::new(&pd, &StripeOptions { qps: 3, ..Default::default() }).unwrap(), &a);
    match c.connect(&d.endpoints(&opts()).unwrap(), &opts()) {
        Err(Error::InvalidArgument { verb: "StripedConnection::connect", .. }) => {}
        other => panic!("a peer list of the wrong length: {other:?}"),
    }
}

#[test]
fn dropping_with_requests_outstanding_is_sound() {
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    let rounds = if time_scale() > 1 { 2 } else { 10 };
    let len = 256 << 10;
    let dst = target(&pd, len);
    let shared = Arc::new(pd.allocate(len).unwrap());
    for round in 0..rounds {
        let qps = [1, 2, 4, 8][round % 4];
        let (mut a, b, _cm) = ends(&pd, qps);
        for i in 0..8 {
            if i % 2 == 0 {
                a.post_write(shared.clone(), dst.remote(), i).unwrap();
            } else {
                a.post_read(pd.allocate(len).unwrap(), dst.remote(), i).unwrap();
            }
        }
        if round % 2 == 0 {
            drop(b);
            drop(a);
        } else {
            drop(a);
            drop(b);
        }
    }
    // The pieces' clones are released once their queue pairs are gone.
    assert_eq!(Arc::strong_count(&shared), 1);
}

/// A queue pair of the caller's that completes into the connection's CQ (made before the
/// connection, on a CQ with room for it): its completion, with the `wr_id` of a live piece, is
/// consumed (its buffer released) and not counted as that piece, so the request completes with
/// its last real piece and hands its owned buffer back.
#[test]
fn another_queue_pairs_completion_on_the_cq_is_not_taken_for_a_piece() {
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    let stripe = StripeOptions { qps: 2, threshold: THRESHOLD, depth: 16, ..StripeOptions::default() };
    let cq_a = ctx.create_cq(64, None).unwrap();
    let cq_b = ctx.create_cq(64, None).unwrap();
    let (mut qa, mut qb, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        let pd = &pd;
        let build = |cq| move || pd.create_qp(cq, QpType::RC).max_send_wr(16).max_recv_wr(1);
        let (a, b, cm) = connect_built(pd, build(&cq_a), build(&cq_b));
        qa.push(a);
        qb.push(b);
        ids.extend(cm);
    }
    // The third pair stays the caller's: `x` sends into the connection's CQ.
    let mut x = qa.pop().unwrap();
    let _y = qb.pop().unwrap();
    let mut a = StripedConnection::from_queue_pairs(cq_a, qa, &stripe).unwrap();
    let _b = StripedConnection::from_queue_pairs(cq_b, qb, &stripe).unwrap();
    let dst = target(&pd, 2 * THRESHOLD);
    // `x`'s Write completes first, with the wire id of the first request's piece on queue pair
    // 0 (the connection's mark 0x57 in the top byte, generation 0, queue pair 0, slot 0): only
    // its queue pair number tells it apart. (A wr_id without the mark, e.g. 0, never names one.)
    x.post_send(
        ibverbs::SendRequest::write(
            ibverbs::Local::whole(pd.allocate(8).unwrap()),
            dst.remote().slice(0, 8).unwrap(),
        )
        .wr_id(0x57 << 56),
    )
    .unwrap();
    std::thread::sleep(scaled(Duration::from_millis(200)));
    let mut src = pd.allocate(2 * THRESHOLD).unwrap();
    src.copy_from_slice(&pattern(2 * THRESHOLD, 5));
    a.post_write(src, dst.remote(), 77).unwrap();
    let mut done = wait(&mut a, 1);
    let c = &mut done[0];
    assert_eq!((c.wr_id(), c.status(), c.len()), (77, WcStatus::SUCCESS, 2 * THRESHOLD as u64));
    let back = c.take_region().expect("the owned buffer comes back with the request's last piece");
    assert_eq!(&back[..], &pattern(2 * THRESHOLD, 5)[..]);
    assert_eq!(dst.to_vec(), pattern(2 * THRESHOLD, 5));
    assert_eq!(x.outstanding_sends(), 0, "x's completion was consumed and its buffer released");
}
