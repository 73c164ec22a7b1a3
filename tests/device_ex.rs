//! Device tests of the extended data path: extended queue pairs (`ibv_create_qp_ex`, posting with
//! the `ibv_wr_*` builders) and extended completion queues (`ibv_create_cq_ex`, polling with
//! `ibv_start_poll`/`ibv_next_poll`/`ibv_end_poll`), alone and mixed with the classic ones.
//! Every payload and every atomic's old value is compared, and every buffer comes back.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ibverbs::{
    AccessFlags, Completion, CompletionQueue, Error, Local, QpType, QueuePair, RecvRequest, SendOps,
    SendRequest, WcFlags, WcOpcode, WcStatus,
};

/// Which side of the data path is extended.
#[derive(Debug, Clone, Copy)]
struct Kind {
    qp_ex: bool,
    cq_ex: bool,
}

/// A connected RC pair; both QPs and both CQs extended or not as `kind` says.
struct ExPair {
    pd: ibverbs::ProtectionDomain,
    cq_a: CompletionQueue,
    cq_b: CompletionQueue,
    a: QueuePair,
    b: QueuePair,
    _ctx: ibverbs::Context,
}

/// Whether the device has the extended objects `kind` needs; on one without them (siw), checks
/// the crate's typed error, reports the feature (see [`unsupported`]) and returns `false`.
fn has_extended(ctx: &ibverbs::Context, kind: Kind) -> bool {
    let refused = |r: Result<(), Error>, feature: &'static str| match r {
        Ok(()) => false,
        Err(Error::Unsupported { capability, .. }) if capability == feature => {
            unsupported(ctx, feature, "the provider answers EOPNOTSUPP");
            true
        }
        Err(e) => panic!("{feature}: unexpected error {e:?}"),
    };
    if kind.cq_ex && refused(ctx.create_cq_ex(4, None, WcFlags::STANDARD).map(drop), "extended CQs") {
        return false;
    }
    if kind.qp_ex {
        let (pd, cq) = (ctx.alloc_pd().unwrap(), ctx.create_cq(4, None).unwrap());
        let qp = pd.create_qp(&cq, QpType::RC).max_send_wr(1).max_recv_wr(1).send_ops(SendOps::SEND).build();
        if refused(qp.map(drop), "extended QPs") {
            return false;
        }
    }
    true
}

/// A connected pair as `kind` says, or `None` when the device lacks it (reported: see
/// [`has_extended`]).
fn ex_pair(kind: Kind, ops: SendOps, depth: u32) -> Option<ExPair> {
    let ctx = context();
    if !has_extended(&ctx, kind) {
        return None;
    }
    let pd = ctx.alloc_pd().unwrap();
    let cq = || {
        if kind.cq_ex {
            ctx.create_cq_ex(2 * depth, None, WcFlags::STANDARD).unwrap()
        } else {
            ctx.create_cq(2 * depth, None).unwrap()
        }
    };
    let (cq_a, cq_b) = (cq(), cq());
    let build = |cq| {
        let b = pd.create_qp(cq, QpType::RC).max_send_wr(depth).max_recv_wr(depth).max_inline_data(64);
        let b = if kind.qp_ex { b.send_ops(ops) } else { b };
        b.build().unwrap()
    };
    let mut a = build(&cq_a);
    let mut b = build(&cq_b);
    assert_eq!(a.send_ops().is_some(), kind.qp_ex);
    assert_eq!(cq_a.cq_ex_raw().is_some(), kind.cq_ex);
    let o = opts();
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    a.connect(&eb, &o).unwrap();
    b.connect(&ea, &o).unwrap();
    Some(ExPair { pd, cq_a, cq_b, a, b, _ctx: ctx })
}

/// Every operation of the safe requests once, each payload and old value compared.
fn every_operation(kind: Kind) {
    let Some(mut p) = ex_pair(kind, SendOps::ALL_SAFE, 8) else { return };

    // Send and Send with immediate.
    for (i, imm) in [None, Some(0xdead_beef_u32)].into_iter().enumerate() {
        let data = pattern(1000, i as u8);
        p.b.post_recv(RecvRequest::new(Local::whole(p.pd.allocate(1024).unwrap())).wr_id(10 + i as u64))
            .unwrap();
        let mut src = p.pd.allocate(1000).unwrap();
        src.copy_from_slice(&data);
        let mut wr = SendRequest::send(Local::whole(src)).wr_id(20 + i as u64);
        if let Some(imm) = imm {
            wr = wr.imm(imm);
        }
        p.a.post_send(wr).unwrap();
        let mut sc = poll_one(&mut p.cq_a);
        assert_eq!(
            (sc.status(), sc.opcode(), sc.wr_id()),
            (WcStatus::SUCCESS, WcOpcode::SEND, 20 + i as u64)
        );
        assert_eq!(sc.take_region().unwrap().as_slice(), &data[..], "{kind:?}: send buffer back intact");
        let mut rc = poll_one(&mut p.cq_b);
        assert_eq!(
            (rc.status(), rc.opcode(), rc.wr_id()),
            (WcStatus::SUCCESS, WcOpcode::RECV, 10 + i as u64)
        );
        assert_eq!((rc.byte_len(), rc.imm_data(), rc.qp_num()), (1000, imm, p.b.qp_num()), "{kind:?}");
        assert_eq!(rc.timestamp(), None);
        let got = rc.take_region().unwrap();
        assert_eq!(&got[..1000], &data[..]);
    }

    // Inline Send: the data is copied while posting.
    let mut data = pattern(48, 7);
    p.b.post_recv(RecvRequest::new(Local::whole(p.pd.allocate(64).unwrap())).wr_id(30)).unwrap();
    p.a.post_send(SendRequest::send_inline(&data).wr_id(31)).unwrap();
    let sent = data.clone();
    data.fill(0); // free again once the post returned
    assert_eq!(poll_one(&mut p.cq_a).wr_id(), 31);
    let mut rc = poll_one(&mut p.cq_b);
    assert_eq!(rc.byte_len(), 48);
    assert_eq!(&rc.take_region().unwrap()[..48], &sent[..]);

    // RDMA Write, then Write with immediate (which consumes a receive).
    let target =
        Arc::new(p.pd.allocate_remote(4096, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap());
    let data = pattern(3000, 3);
    let mut src = p.pd.allocate(3000).unwrap();
    src.copy_from_slice(&data);
    p.a.post_send(SendRequest::write(Local::whole(src), target.remote().slice(100, 3000).unwrap()).wr_id(1))
        .unwrap();
    let mut c = poll_one(&mut p.cq_a);
    assert_eq!((c.status(), c.opcode()), (WcStatus::SUCCESS, WcOpcode::RDMA_WRITE), "{kind:?}: {c:?}");
    let src = c.take_region().unwrap();
    let got = target.to_vec();
    assert_eq!(&got[100..3100], &data[..]);
    assert!(got[..100].iter().chain(&got[3100..]).all(|&b| b == 0));
    p.b.post_recv(RecvRequest::empty().wr_id(5)).unwrap();
    let remote = target.remote().slice(0, 64).unwrap();
    p.a.post_send(SendRequest::write(Local::new(src, 0..64).unwrap(), remote).imm(0x0102_0304)).unwrap();
    let mut c = poll_one(&mut p.cq_a);
    assert!(c.is_ok());
    assert_eq!(c.take_region().unwrap().as_slice(), &data[..], "the write source comes back");
    let rc = poll_one(&mut p.cq_b);
    assert_eq!(
        (rc.opcode(), rc.imm_data(), rc.wr_id()),
        (WcOpcode::RECV_RDMA_WITH_IMM, Some(0x0102_0304), 5)
    );
    assert_eq!(&target.to_vec()[..64], &data[..64]);

    // RDMA Read back what the Write put there.
    let dst = p.pd.allocate(3000).unwrap();
    p.a.post_send(SendRequest::read(Local::whole(dst), target.remote().slice(100, 3000).unwrap())).unwrap();
    let mut c = poll_one(&mut p.cq_a);
    assert_eq!((c.status(), c.opcode()), (WcStatus::SUCCESS, WcOpcode::RDMA_READ), "{kind:?}: {c:?}");
    assert_eq!(c.take_region().unwrap().as_slice(), &data[..]);

    // Atomics: a failed and a matching compare-and-swap, then fetch-and-add; old values compared.
    let word_mr = Arc::new(p.pd.allocate_remote(64, AccessFlags::REMOTE_ATOMIC).unwrap());
    word_mr.write(8, &100u64.to_ne_bytes()).unwrap();
    let word = word_mr.remote().slice(8, 8).unwrap();
    let old = |c: &mut ibverbs::Completion| {
        let r = c.take_region().unwrap();
        (u64::from_ne_bytes(r[..8].try_into().unwrap()), r)
    };
    p.a.post_send(SendRequest::compare_swap(Local::whole(p.pd.allocate(8).unwrap()), word, 5, 7)).unwrap();
    let mut c = poll_one(&mut p.cq_a);
    assert_eq!((c.status(), c.opcode()), (WcStatus::SUCCESS, WcOpcode::COMP_SWAP), "{kind:?}: {c:?}");
    let (v, res) = old(&mut c);
    assert_eq!((v, word_mr.load_u64(8).unwrap()), (100, 100), "no swap");
    p.a.post_send(SendRequest::compare_swap(Local::whole(res), word, 100, 777)).unwrap();
    let (v, res) = old(&mut poll_one(&mut p.cq_a));
    assert_eq!((v, word_mr.load_u64(8).unwrap()), (100, 777), "swapped");
    p.a.post_send(SendRequest::fetch_add(Local::whole(res), word, 23)).unwrap();
    let mut c = poll_one(&mut p.cq_a);
    assert_eq!(c.opcode(), WcOpcode::FETCH_ADD);
    let (v, _) = old(&mut c);
    assert_eq!((v, word_mr.load_u64(8).unwrap()), (777, 800));
    assert_eq!((word_mr.load_u64(0).unwrap(), word_mr.load_u64(16).unwrap()), (0, 0));
    assert_eq!((p.a.outstanding_sends(), p.b.outstanding_recvs()), (0, 0));
}

#[test]
fn every_operation_extended_qp_and_extended_cq() {
    every_operation(Kind { qp_ex: true, cq_ex: true });
}

#[test]
fn every_operation_extended_qp_classic_cq() {
    every_operation(Kind { qp_ex: true, cq_ex: false });
}

#[test]
fn every_operation_classic_qp_extended_cq() {
    every_operation(Kind { qp_ex: false, cq_ex: true });
}

/// An extended CQ that did not ask for immediate data reports none, rather than a 0 it never
/// read; one that asked reports the sender's value.
#[test]
fn immediate_data_is_reported_only_where_the_cq_asked_for_it() {
    let ctx = context();
    if !has_extended(&ctx, Kind { qp_ex: false, cq_ex: true }) {
        return;
    }
    let pd = ctx.alloc_pd().unwrap();
    const IMM: u32 = 0x0a0b_0c0d;
    for (flags, want) in [(WcFlags::BYTE_LEN, None), (WcFlags::BYTE_LEN | WcFlags::IMM, Some(IMM))] {
        let mut cq_a = ctx.create_cq(8, None).unwrap();
        let mut cq_b = ctx.create_cq_ex(8, None, flags).unwrap();
        let build = |cq| pd.create_qp(cq, QpType::RC).max_send_wr(4).max_recv_wr(4).build().unwrap();
        let (mut a, mut b) = (build(&cq_a), build(&cq_b));
        let o = opts();
        let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
        a.connect(&eb, &o).unwrap();
        b.connect(&ea, &o).unwrap();
        b.post_recv(RecvRequest::new(Local::whole(pd.allocate(64).unwrap())).wr_id(1)).unwrap();
        a.post_send(SendRequest::send(Local::whole(pd.allocate(24).unwrap())).imm(IMM).wr_id(2)).unwrap();
        let sc = poll_one(&mut cq_a);
        assert_eq!((sc.status(), sc.wr_id()), (WcStatus::SUCCESS, 2));
        let rc = poll_one(&mut cq_b);
        assert_eq!(
            (rc.status(), rc.opcode(), rc.wr_id(), rc.byte_len(), rc.imm_data()),
            (WcStatus::SUCCESS, WcOpcode::RECV, 1, 24, want),
            "{flags:?}"
        );
        assert_eq!(rc.invalidated_rkey(), None);
    }
}

/// A chain of 32 RDMA Writes (31 unsignaled, completed by the last, signaled one) is one builder
/// sequence with one doorbell; the one completion releases all 32 buffers.
#[test]
fn chain_of_32_with_unsignaled_requests() {
    let Some(mut p) = ex_pair(Kind { qp_ex: true, cq_ex: true }, SendOps::RDMA_WRITE, 32) else { return };
    let target = Arc::new(p.pd.allocate_remote(32 * 64, AccessFlags::REMOTE_WRITE).unwrap());
    let srcs: Vec<_> = (0..32u8)
        .map(|i| {
            let mut m = p.pd.allocate(64).unwrap();
            m.copy_from_slice(&pattern(64, i));
            Arc::new(m)
        })
        .collect();
    let mut chain: Vec<SendRequest> = srcs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let wr = SendRequest::write(
                Local::whole(s.clone()),
                target.remote().slice(i as u64 * 64, 64).unwrap(),
            );
            if i < 31 {
                wr.unsignaled()
            } else {
                wr.wr_id(99)
            }
        })
        .collect();
    p.a.post_send_chain(&mut chain).unwrap();
    assert!(chain.is_empty());
    assert_eq!(p.a.outstanding_sends(), 32);
    let c = poll_one(&mut p.cq_a);
    assert_eq!((c.status(), c.wr_id()), (WcStatus::SUCCESS, 99), "{c:?}");
    drop(c);
    assert_quiet(&mut p.cq_a, Duration::from_millis(20));
    assert_eq!(p.a.outstanding_sends(), 0);
    assert!(srcs.iter().all(|s| Arc::strong_count(s) == 1), "all 32 buffers released");
    let got = target.to_vec();
    for i in 0..32u8 {
        assert_eq!(&got[i as usize * 64..][..64], &pattern(64, i)[..], "write {i}");
    }
}

/// A buffer whose free callback panics, released by a later completion polled from an extended
/// CQ (`ibv_start_poll`...): the poll finishes, keeps its completions and then resumes the
/// panic; the next polls return them.
#[test]
fn a_panicking_buffer_free_loses_no_completion_on_an_extended_cq() {
    let Some(mut p) = ex_pair(Kind { qp_ex: false, cq_ex: true }, SendOps::RDMA_WRITE, 8) else { return };
    let target = Arc::new(p.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    let freed = Arc::new(AtomicU32::new(0));
    let mr = Arc::new(region_freed_by(&p.pd, freed.clone(), true));
    p.a.post_send(SendRequest::write(Local::whole(mr), target.remote()).unsignaled()).unwrap();
    p.a.post_send(SendRequest::write_inline(b"", target.remote()).wr_id(7)).unwrap();
    p.a.post_send(SendRequest::write_inline(b"", target.remote()).wr_id(8)).unwrap();
    std::thread::sleep(scaled(Duration::from_millis(200)));
    let mut out: [Completion; 4] = Default::default();
    let r = catch_unwind(AssertUnwindSafe(|| p.cq_a.poll(&mut out).map(|c| c.len())));
    assert!(r.is_err(), "the callback's panic propagates out of poll");
    assert_eq!(freed.load(Ordering::SeqCst), 1);
    assert!(p.cq_a.kept() >= 1, "the poll's completions are kept, not lost");
    let mut seen = Vec::new();
    let deadline = Instant::now() + scaled(Duration::from_secs(5));
    while seen.len() < 2 {
        assert!(Instant::now() < deadline, "completions lost: saw only {seen:?}");
        for c in p.cq_a.poll(&mut out).unwrap() {
            assert!(c.is_ok() && c.is_tracked(), "{c:?}");
            seen.push(c.wr_id());
        }
    }
    assert_eq!(seen, [7, 8], "every completion, once, in order");
    assert_eq!((p.a.outstanding_sends(), freed.load(Ordering::SeqCst)), (0, 1));
}

/// Prepared requests on an extended QP: `post_prepared` and a chain of one (signaled or not) go
/// through the builders; a longer chain is refused whole, before anything is posted.
#[test]
fn prepared_writes_through_an_extended_qp() {
    let Some(mut p) = ex_pair(Kind { qp_ex: true, cq_ex: false }, SendOps::RDMA_WRITE, 8) else { return };
    let target = Arc::new(p.pd.allocate_remote(256, AccessFlags::REMOTE_WRITE).unwrap());
    let mut src = p.pd.allocate(256).unwrap();
    src.copy_from_slice(&pattern(256, 5));
    let src = Arc::new(src);
    let w = p.a.prepare_send(SendRequest::write(Local::whole(src.clone()), target.remote())).unwrap();
    p.a.post_prepared(&w, 1, 0, 64, 0).unwrap();
    assert_eq!(poll_one(&mut p.cq_a).wr_id(), 1);
    p.a.post_prepared_chain(&[w.at(2, 64, 64, 64).unsignaled()]).unwrap();
    p.a.post_prepared_chain(&[w.at(3, 128, 64, 128)]).unwrap();
    let c = poll_one(&mut p.cq_a);
    assert_eq!((c.status(), c.wr_id()), (WcStatus::SUCCESS, 3), "{c:?}");
    drop(c);
    assert_quiet(&mut p.cq_a, Duration::from_millis(20));
    assert_eq!(p.a.outstanding_sends(), 0, "the unsignaled one was released with the next");
    let e = p.a.post_prepared_chain(&[w.at(4, 192, 32, 192), w.at(5, 224, 32, 224)]).unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }) && e.posted == 0, "{e:?}");
    assert_eq!(p.a.outstanding_sends(), 0);
    let mut want = pattern(256, 5);
    want[192..].fill(0);
    assert_eq!(target.to_vec(), want);
}

/// `post_send_iter` on an extended QP: one request posts through the builders, an empty
/// iterator posts nothing, and a longer one is refused with its first request handed back.
#[test]
fn send_requests_from_an_iterator_on_an_extended_qp() {
    let Some(mut p) = ex_pair(Kind { qp_ex: true, cq_ex: false }, SendOps::RDMA_WRITE, 8) else { return };
    let target = Arc::new(p.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    let bytes = *b"extended";
    let write = |i: u64| SendRequest::write_inline(&bytes, target.remote().slice(8 * i, 8).unwrap()).wr_id(i);
    p.a.post_send_iter(std::iter::once(write(0))).unwrap();
    // No size hint: peeked for a second request.
    let mut once = Some(write(1));
    p.a.post_send_iter(std::iter::from_fn(|| once.take())).unwrap();
    p.a.post_send_iter(std::iter::empty()).unwrap();
    assert_eq!(poll_n(&mut p.cq_a, 2).iter().map(|c| c.wr_id()).collect::<Vec<_>>(), [0, 1]);
    let e = p.a.post_send_iter((2..4).map(write)).unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }) && e.posted == 0, "{e:?}");
    assert!(e.request.is_some());
    assert_eq!(p.a.outstanding_sends(), 0);
    let mut want = bytes.repeat(2);
    want.resize(64, 0);
    assert_eq!(target.to_vec(), want);
}

/// An operation the extended QP was not created for is refused before anything is posted: a
/// single request comes back with its buffer, a chain comes back whole.
#[test]
fn an_operation_not_enabled_is_a_typed_error_and_nothing_is_posted() {
    let Some(mut p) = ex_pair(Kind { qp_ex: true, cq_ex: true }, SendOps::SEND, 8) else { return };
    assert_eq!(p.a.send_ops(), Some(SendOps::SEND));
    let target = Arc::new(p.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    let mut src = p.pd.allocate(64).unwrap();
    src.fill(0x77);
    let e = p.a.post_send(SendRequest::write(Local::whole(src), target.remote()).wr_id(3)).unwrap_err();
    assert!(matches!(e.error, Error::SendOpNotEnabled { op: "IBV_QP_EX_WITH_RDMA_WRITE", .. }), "{e:?}");
    let back: Vec<_> = e.request.into_buffers().collect();
    assert_eq!(back.len(), 1);
    let src = back.into_iter().next().unwrap().into_region().unwrap();
    assert!(src.iter().all(|&b| b == 0x77), "the buffer came back");

    p.b.post_recv(RecvRequest::new(Local::whole(p.pd.allocate(64).unwrap()))).unwrap();
    let mut chain = vec![
        SendRequest::send_inline(b"first"),
        SendRequest::send(Local::whole(src)).imm(1), // Send with immediate: not enabled
    ];
    let e = p.a.post_send_chain(&mut chain).unwrap_err();
    assert!(matches!(e, Error::SendOpNotEnabled { op: "IBV_QP_EX_WITH_SEND_WITH_IMM", .. }), "{e:?}");
    assert_eq!(chain.len(), 2, "the whole chain comes back");
    assert_eq!(p.a.outstanding_sends(), 0);
    assert_quiet(&mut p.cq_a, Duration::from_millis(50));
    assert_quiet(&mut p.cq_b, Duration::from_millis(1));
    // The QP still works for what it was created for.
    chain.truncate(1);
    p.a.post_send_chain(&mut chain).unwrap();
    assert!(poll_one(&mut p.cq_a).is_ok());
    let mut rc = poll_one(&mut p.cq_b);
    assert_eq!(&rc.take_region().unwrap()[..5], b"first");
}

/// Completion timestamps: on a device with a completion clock they are read; on one without
/// (SoftRoCE: `completion_timestamp_mask` 0) creating the CQ is the typed error, reported as an
/// unsupported feature in the test summary.
#[test]
fn completion_timestamps_or_the_typed_unsupported_error() {
    let ctx = context();
    let mask = ctx.query_device_ex().unwrap().0.completion_timestamp_mask;
    match ctx.create_cq_ex(8, None, WcFlags::STANDARD | WcFlags::COMPLETION_TIMESTAMP) {
        Err(Error::Unsupported { verb: "ibv_create_cq_ex", capability: feature }) => {
            assert_eq!(mask, 0, "refused although the device reports a completion clock");
            assert!(feature.contains("IBV_WC_EX_WITH_COMPLETION_TIMESTAMP"), "{feature}");
            unsupported(&ctx, "completion timestamps", feature);
        }
        Err(e) => panic!("unexpected error: {e}"),
        Ok(mut cq) => {
            assert_ne!(mask, 0);
            let pd = ctx.alloc_pd().unwrap();
            let mut qp = pd.create_qp(&cq, QpType::RC).max_send_wr(2).max_recv_wr(2).build().unwrap();
            let o = opts();
            let e = qp.endpoint(&o).unwrap();
            qp.connect(&e, &o).unwrap(); // to itself
            qp.post_recv(RecvRequest::empty()).unwrap();
            qp.post_send(SendRequest::send_inline(&[])).unwrap();
            let cs = poll_n(&mut cq, 2);
            assert!(cs.iter().all(|c| c.is_ok() && c.timestamp().is_some()), "{cs:?}");
        }
    }
}

/// A UD Send through an extended QP (`ibv_wr_set_ud_addr`), received by a classic one.
#[test]
fn ud_send_through_an_extended_qp() {
    let ctx = context();
    if !has_extended(&ctx, Kind { qp_ex: true, cq_ex: true }) {
        return;
    }
    let pd = ctx.alloc_pd().unwrap();
    let mut cq_a = ctx.create_cq_ex(16, None, WcFlags::STANDARD).unwrap();
    let mut cq_b = ctx.create_cq(16, None).unwrap();
    let mut a = pd
        .create_qp(&cq_a, QpType::UD)
        .max_send_wr(4)
        .max_recv_wr(4)
        .send_ops(SendOps::SEND | SendOps::SEND_WITH_IMM)
        .build()
        .unwrap();
    let mut b = pd.create_qp(&cq_b, QpType::UD).max_send_wr(4).max_recv_wr(4).build().unwrap();
    let o = opts();
    a.activate_ud(&o).unwrap();
    b.activate_ud(&o).unwrap();
    b.post_recv(RecvRequest::new(Local::whole(pd.allocate(40 + 512).unwrap())).wr_id(3)).unwrap();
    let ah = pd.create_ah(&b.endpoint(&o).unwrap(), &o).unwrap();
    let data = pattern(512, 11);
    let mut src = pd.allocate(512).unwrap();
    src.copy_from_slice(&data);
    a.post_send(SendRequest::send(Local::whole(src)).ud(&ah, b.qp_num(), o.qkey).imm(99).wr_id(8)).unwrap();
    drop(ah); // the posted request keeps the address handle alive
    let mut sc = poll_one(&mut cq_a);
    assert!(sc.is_ok() && sc.wr_id() == 8, "{sc:?}");
    assert_eq!(sc.take_region().unwrap().as_slice(), &data[..]);
    let mut rc = poll_one(&mut cq_b);
    assert!(rc.is_ok(), "{rc:?}");
    assert_eq!((rc.byte_len(), rc.src_qp(), rc.imm_data()), (40 + 512, a.qp_num(), Some(99)));
    assert_eq!(&rc.take_region().unwrap()[40..], &data[..]);
}

/// Polls into an array larger than what is pending, so that the extended poll meets the empty CQ
/// after completions (on rdma-core's rxe provider the documented `next_poll`-until-`ENOENT`
/// then `end_poll` sequence moved the consumer index past the producer: later polls returned
/// zeroed "successful" entries with `wr_id` 0 and lost real ones; the crate polls one
/// completion per `start_poll` there). 200 rounds of 1 to 3 Sends with their receives: exactly
/// those completions come back, each once, all tracked, and nothing more over 100 polls of the
/// drained CQs.
#[test]
fn an_extended_cq_polled_past_its_last_completion_returns_exactly_what_was_posted() {
    let Some(mut p) = ex_pair(Kind { qp_ex: false, cq_ex: true }, SendOps::empty(), 8) else { return };
    let deadline = Instant::now() + scaled(Duration::from_secs(120));
    let mut big: Vec<Completion> = (0..16).map(|_| Completion::default()).collect();
    let mut drain = |cq: &mut CompletionQueue, want: &[u64], what: &str| {
        let mut got: Vec<u64> = Vec::new();
        while got.len() < want.len() {
            assert!(Instant::now() < deadline, "{what}: timed out with {got:?} of {want:?}");
            for c in cq.poll(&mut big).unwrap().iter_mut() {
                assert!(c.is_tracked(), "{what}: a completion nobody posted: {c:?}");
                assert_eq!(c.status(), WcStatus::SUCCESS, "{what}: {c:?}");
                got.push(c.wr_id());
                drop(std::mem::take(c));
            }
        }
        got.sort_unstable();
        assert_eq!(got, want, "{what}: each completion once");
        for _ in 0..100 {
            let extra = cq.poll(&mut big).unwrap();
            assert!(extra.is_empty(), "{what}: a completion after the last one: {:?}", extra[0]);
        }
    };
    for round in 0..200u64 {
        let k = 1 + round % 3;
        let ids: Vec<u64> = (0..k).map(|i| round * 10 + i).collect();
        for &id in &ids {
            p.b.post_recv(RecvRequest::new(Local::whole(p.pd.allocate(64).unwrap())).wr_id(id)).unwrap();
        }
        for &id in &ids {
            let mut src = p.pd.allocate(64).unwrap();
            src.copy_from_slice(&pattern(64, id as u8));
            p.a.post_send(SendRequest::send(Local::whole(src)).wr_id(id)).unwrap();
        }
        drain(&mut p.cq_a, &ids, "send CQ");
        drain(&mut p.cq_b, &ids, "receive CQ");
    }
}
