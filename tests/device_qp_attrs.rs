//! Typed queue pair attributes: `QueuePair::query` after a connect, a connection made by hand
//! with `QueuePair::modify` alone, the state machine's refusals naming their mask bit, SQD drain
//! and resume, and the typed refusals of what the device lacks (alternate paths, rate limits).

mod common;

use std::time::Duration;

use common::*;
use ibverbs::{
    AccessFlags, ConnectOptions, Error, Local, ModifyQp, Mtu, QpState, QpType, QueuePair, RecvRequest,
    SendRequest,
};

/// Checks a Send from `a` to `b` arrives (8 bytes).
fn send_arrives(
    pd: &ibverbs::ProtectionDomain,
    p: (&mut QueuePair, &mut QueuePair),
    cqs: (&mut ibverbs::CompletionQueue, &mut ibverbs::CompletionQueue),
) {
    let (a, b) = p;
    let (cq_a, cq_b) = cqs;
    b.post_recv(RecvRequest::new(Local::whole(pd.allocate(8).unwrap())).wr_id(3)).unwrap();
    let mut mr = pd.allocate(8).unwrap();
    mr.as_mut_slice().copy_from_slice(b"attr-ok!");
    a.post_send(SendRequest::send(Local::whole(mr)).wr_id(4)).unwrap();
    let c = poll_one(cq_a);
    assert!(c.is_ok() && c.wr_id() == 4, "{c:?}");
    let mut c = poll_one(cq_b);
    assert!(c.is_ok() && c.wr_id() == 3, "{c:?}");
    assert_eq!(c.take_region().unwrap().as_slice(), b"attr-ok!");
}

#[test]
fn query_reports_what_connect_set() {
    let Pair { a, b, ctx, cm: _cm, .. } = rc_pair(4);
    let qa = a.query().unwrap();
    if is_iwarp() {
        // siw reports neither the state nor the IB transport attributes: only that it answers.
        unsupported(&ctx, "ibv_query_qp's IB attributes", format!("iWARP: siw reports {qa:?}"));
        return;
    }
    let o = opts();
    assert_eq!(qa.state, QpState::RTS);
    assert_eq!(qa.dest_qp_num, b.qp_num());
    assert_eq!(qa.sq_psn, a.psn(), "the send PSN advertised");
    assert_eq!(qa.rq_psn, b.psn(), "the peer's send PSN");
    assert_eq!(qa.ack_timeout_code, o.timeout);
    assert_eq!(qa.ack_timeout, Some(Duration::from_nanos(4096 << o.timeout)));
    assert_eq!((qa.retry_cnt, qa.rnr_retry), (o.retry_cnt, o.rnr_retry));
    assert_eq!(qa.min_rnr_timer_code, o.min_rnr_timer);
    assert_eq!(qa.min_rnr_timer, Duration::from_micros(640), "code 12 of the IB table");
    let port = ctx.query_port(1).unwrap();
    assert_eq!(qa.path_mtu, port.active_mtu());
    assert_eq!(qa.port, 1);
    assert_eq!(qa.access, o.access);
    assert!(qa.caps.max_send_wr >= 4 && qa.caps.max_recv_wr >= 4, "{:?}", qa.caps);
    let qb = b.query().unwrap();
    assert_eq!((qb.sq_psn, qb.rq_psn, qb.dest_qp_num), (b.psn(), a.psn(), a.qp_num()));
}

#[test]
fn a_connection_made_with_modify_alone_carries_data_and_its_timers() {
    if iwarp_lacks("connecting by hand (typed modify)", "iWARP queue pairs connect through RDMA-CM") {
        return;
    }
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let (mut cq_a, mut cq_b) = (ctx.create_cq(8, None).unwrap(), ctx.create_cq(8, None).unwrap());
    let mut a = pd.create_qp(&cq_a, QpType::RC).max_send_wr(4).max_recv_wr(4).build().unwrap();
    let mut b = pd.create_qp(&cq_b, QpType::RC).max_send_wr(4).max_recv_wr(4).build().unwrap();
    let o = ConnectOptions::default();
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    // RESET -> INIT needs the port: named before the verb.
    let init = ModifyQp::to(QpState::INIT).pkey_index(0).access(AccessFlags::LOCAL_WRITE);
    let e = a.modify(&init).unwrap_err();
    assert!(
        matches!(
            e,
            Error::QpAttribute { attribute: "IBV_QP_PORT", from: QpState::RESET, to: QpState::INIT, .. }
        ),
        "{e:?}"
    );
    // A Q_Key is UD's: not taken by an RC queue pair.
    let e = a.modify(&init.clone().port(1).qkey(7)).unwrap_err();
    assert!(matches!(e, Error::QpAttribute { attribute: "IBV_QP_QKEY", .. }), "{e:?}");
    // RESET -> RTS is no move of the state machine.
    let e = a.modify(&ModifyQp::to(QpState::RTS).sq_psn(1)).unwrap_err();
    assert!(matches!(e, Error::QpAttribute { attribute: "IBV_QP_STATE", .. }), "{e:?}");
    assert_eq!(a.state(), QpState::RESET, "nothing changed");
    for (qp, peer) in [(&mut a, &eb), (&mut b, &ea)] {
        qp.modify(&init.clone().port(1)).unwrap();
        assert_eq!(qp.state(), QpState::INIT);
        let rtr = ModifyQp::to(QpState::RTR)
            .address(peer, &o)
            .path_mtu(Mtu::MTU_1024.min(peer.mtu))
            .dest_qp_num(peer.qpn)
            .rq_psn(peer.psn)
            .max_dest_rd_atomic(1);
        // RC's RTR needs the minimum RNR timer too.
        let e = qp.modify(&rtr).unwrap_err();
        assert!(matches!(e, Error::QpAttribute { attribute: "IBV_QP_MIN_RNR_TIMER", .. }), "{e:?}");
        qp.modify(&rtr.min_rnr_timer(Duration::from_millis(1))).unwrap();
        let psn = qp.psn();
        qp.modify(
            &ModifyQp::to(QpState::RTS)
                .sq_psn(psn)
                .ack_timeout(Some(Duration::from_millis(100)))
                .retry_cnt(5)
                .rnr_retry(6)
                .max_rd_atomic(1),
        )
        .unwrap();
        assert_eq!(qp.state(), QpState::RTS);
    }
    let q = a.query().unwrap();
    assert_eq!(q.state, QpState::RTS);
    assert_eq!(q.ack_timeout_code, 15, "100 ms rounded up to 4.096 µs × 2^15");
    assert_eq!(q.ack_timeout, Some(Duration::from_nanos(4096 << 15)));
    assert_eq!((q.retry_cnt, q.rnr_retry), (5, 6));
    assert_eq!(q.min_rnr_timer_code, 14, "1 ms rounded up to the table's 1.28 ms");
    assert_eq!(q.min_rnr_timer, Duration::from_micros(1280));
    assert_eq!(q.path_mtu, Mtu::MTU_1024.min(eb.mtu));
    assert_eq!((q.sq_psn, q.rq_psn, q.dest_qp_num), (a.psn(), b.psn(), b.qp_num()));
    send_arrives(&pd, (&mut a, &mut b), (&mut cq_a, &mut cq_b));
    // RTS -> RTS: a changed attribute, read back.
    a.modify(&ModifyQp::to(QpState::RTS).min_rnr_timer(Duration::from_micros(10))).unwrap();
    assert_eq!(a.query().unwrap().min_rnr_timer_code, 1);
    // Out-of-range values are refused by the setter's check, before the verb.
    let e = a.modify(&ModifyQp::to(QpState::RTS).retry_cnt(8)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { reason: "retry_cnt is 0..=7", .. }), "{e:?}");
}

#[test]
fn sqd_drains_and_resumes_and_what_the_device_lacks_is_typed() {
    if iwarp_lacks("SQD, alternate paths and rate limits", "iWARP queue pairs are driven by RDMA-CM") {
        return;
    }
    let Pair { pd, mut cq_a, mut cq_b, mut a, mut b, ctx, cm: _cm } = rc_pair(4);
    a.drain_send_queue(true).unwrap();
    assert_eq!(a.state(), QpState::SQD);
    assert_eq!(a.query().unwrap().state, QpState::SQD);
    let e = a.post_send(SendRequest::send_inline(b"")).unwrap_err();
    assert!(matches!(e.error, Error::QpState { state: QpState::SQD, .. }), "{:?}", e.error);
    // SQD -> SQD takes an ACK timeout on RC; SQD -> INIT is no move.
    a.modify(&ModifyQp::to(QpState::SQD).ack_timeout(Some(Duration::from_millis(30)))).unwrap();
    let e = a.modify(&ModifyQp::to(QpState::INIT)).unwrap_err();
    assert!(matches!(e, Error::QpAttribute { attribute: "IBV_QP_STATE", from: QpState::SQD, .. }), "{e:?}");
    a.resume_send_queue().unwrap();
    assert_eq!(a.query().unwrap().state, QpState::RTS);
    assert_eq!(a.query().unwrap().ack_timeout_code, 13, "set in SQD: 30 ms up to 33.6 ms");
    send_arrives(&pd, (&mut a, &mut b), (&mut cq_a, &mut cq_b));

    let peer = b.endpoint(&opts()).unwrap();
    let alt = ModifyQp::to(QpState::RTS).alternate_path(&peer, &opts());
    match a.modify(&alt) {
        Err(Error::Unsupported { capability: ibverbs::PATH_MIGRATION, .. }) => {
            unsupported(&ctx, "alternate paths", "typed Error::Unsupported (PATH_MIGRATION) before the verb")
        }
        other => panic!("an alternate path on {}: {other:?}", ctx.name()),
    }
    match a.modify(&ModifyQp::to(QpState::RTS).rate_limit(1000)) {
        Err(Error::Unsupported { capability: ibverbs::RATE_LIMIT, .. }) => {
            unsupported(&ctx, "QP rate limits", "no packet pacing: typed Error::Unsupported (RATE_LIMIT)")
        }
        Ok(()) => {}
        other => panic!("a rate limit on {}: {other:?}", ctx.name()),
    }
    assert_eq!(a.state(), QpState::RTS, "refusals changed nothing");
    // Moves to ERR and RESET go through set_error and reset (rings and all).
    a.modify(&ModifyQp::to(QpState::ERR)).unwrap();
    assert_eq!(a.state(), QpState::ERR);
    a.modify(&ModifyQp::to(QpState::RESET)).unwrap();
    assert_eq!(a.state(), QpState::RESET);
}
