//! UD multicast at the verbs level: two UD queue pairs attached to a group receive every
//! datagram a third sends to the group's address handle; a detached one receives nothing more.

mod common;

use std::time::Duration;

use common::*;
use ibverbs::{Error, Gid, Local, QpType, RecvRequest, SendRequest, MCAST_QPN};

/// `::ffff:239.255.43.1`: an IPv4 multicast group as RoCE v2 names it.
fn group() -> Gid {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&[239, 255, 43, 1]);
    Gid(g)
}

/// Joins the group's IPv4 address on the test device's interface (a UDP socket's
/// `IP_ADD_MEMBERSHIP`), as RDMA-CM does for a RoCE group; kept while the socket lives.
fn join_ip_group() -> std::net::UdpSocket {
    let sock = std::net::UdpSocket::bind(("0.0.0.0", 0)).unwrap();
    let std::net::IpAddr::V4(local) = test_ip() else { panic!("the test address is IPv4") };
    sock.join_multicast_v4(&[239, 255, 43, 1].into(), &local)
        .expect("IP_ADD_MEMBERSHIP on the test interface");
    sock
}

const GRH: usize = 40;
const LEN: usize = 32;

#[test]
fn datagrams_to_a_group_reach_every_attached_queue_pair() {
    if iwarp_lacks_qp_type(QpType::UD) {
        return;
    }
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let o = opts();
    let cqs: Vec<_> = (0..3).map(|_| ctx.create_cq(16, None).unwrap()).collect();
    let mut qps: Vec<_> = cqs
        .iter()
        .map(|cq| pd.create_qp(cq, QpType::UD).max_send_wr(8).max_recv_wr(8).build().unwrap())
        .collect();
    for qp in &mut qps {
        qp.activate_ud(&o).unwrap();
    }
    let [mut cq_r1, mut cq_r2, mut cq_s]: [_; 3] = cqs.try_into().unwrap();
    let g = group();
    // Typed refusals before the verb.
    let mut rc = pd.create_qp(&cq_s, QpType::RC).max_send_wr(1).max_recv_wr(1).build().unwrap();
    assert!(matches!(rc.attach_mcast(&g, 0), Err(Error::InvalidArgument { verb: "ibv_attach_mcast", .. })));
    let unicast = ctx.query_gid(1, o.gid_index.unwrap_or(1)).map(|e| e.gid).unwrap_or(Gid([1; 16]));
    assert!(matches!(qps[0].attach_mcast(&unicast, 0), Err(Error::InvalidArgument { .. })));
    assert!(matches!(pd.create_mcast_ah(&unicast, 0, &o), Err(Error::InvalidArgument { .. })));

    // On RoCE the group is joined at the IP level (IGMP, the NIC's filter: what
    // rdma_join_multicast does); rxe delivers the looped-back datagrams only then.
    let _membership = join_ip_group();
    for qp in &mut qps[..2] {
        qp.attach_mcast(&g, 0).unwrap();
        for i in 0..4 {
            qp.post_recv(RecvRequest::new(Local::whole(pd.allocate(GRH + LEN).unwrap())).wr_id(i)).unwrap();
        }
    }
    let ah = pd.create_mcast_ah(&g, 0, &o).unwrap();
    let send = |qp: &mut ibverbs::QueuePair, seq: u8| {
        let mut mr = pd.allocate(LEN).unwrap();
        mr.as_mut_slice().copy_from_slice(&pattern(LEN, seq));
        qp.post_send(SendRequest::send(Local::whole(mr)).ud(&ah, MCAST_QPN, o.qkey).wr_id(u64::from(seq)))
            .unwrap();
    };
    let (r1, rest) = qps.split_at_mut(1);
    let (r2, s) = rest.split_at_mut(1);
    let (r1, r2, s) = (&mut r1[0], &mut r2[0], &mut s[0]);
    for seq in 0..2u8 {
        send(s, seq);
        assert!(poll_one(&mut cq_s).is_ok());
        for cq in [&mut cq_r1, &mut cq_r2] {
            let mut c = poll_one(cq);
            assert!(c.is_ok(), "{c:?}");
            assert_eq!(c.wr_id(), u64::from(seq), "each receiver gets each datagram once, in order");
            assert_eq!(c.byte_len() as usize, GRH + LEN);
            assert!(c.work_completion().has_grh());
            assert_eq!(c.src_qp(), s.qp_num(), "from the sender");
            assert_eq!(&c.take_region().unwrap().as_slice()[GRH..], &pattern(LEN, seq)[..]);
        }
    }
    // Detached, the first receives nothing more; the second still does.
    r1.detach_mcast(&g, 0).unwrap();
    send(s, 2);
    assert!(poll_one(&mut cq_s).is_ok());
    let mut c = poll_one(&mut cq_r2);
    assert!(c.is_ok() && c.wr_id() == 2, "{c:?}");
    assert_eq!(&c.take_region().unwrap().as_slice()[GRH..], &pattern(LEN, 2)[..]);
    assert_quiet(&mut cq_r1, scaled(Duration::from_millis(300)));
    assert_eq!(r1.outstanding_recvs(), 2);
    // r2 is dropped still attached: its drop detaches it first (the kernel refuses to destroy an
    // attached queue pair, EBUSY; the valgrind pass reported the leak before the drop did).
    let _ = r2;
}

/// The UD queue pairs on the test device, as the kernel lists them (`rdma resource show qp`: one
/// line per queue pair; its `pid` is the creating thread's id, so the lines are counted by type:
/// the device tests run one at a time, and nothing else in the guest makes UD queue pairs).
fn ud_qps() -> usize {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show", "qp", "link", &format!("{}/1", test_device_name())])
        .output()
        .expect("run `rdma resource show qp`");
    assert!(out.status.success(), "rdma resource show qp: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains(" type UD ")).count()
}

#[test]
fn a_queue_pair_dropped_while_attached_is_destroyed() {
    // Linux refuses to destroy a queue pair with multicast attachments (EBUSY): the drop
    // detaches first, so the queue pair is gone from the kernel afterwards (it used to be leaked).
    if iwarp_lacks_qp_type(QpType::UD) {
        return;
    }
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4, None).unwrap();
    let before = ud_qps();
    let mut qp = pd.create_qp(&cq, QpType::UD).max_send_wr(1).max_recv_wr(1).build().unwrap();
    qp.activate_ud(&opts()).unwrap();
    let mut g2 = group();
    g2.0[15] = 2;
    qp.attach_mcast(&group(), 0).unwrap();
    qp.attach_mcast(&group(), 0).unwrap(); // twice: one attachment
    qp.attach_mcast(&g2, 0).unwrap();
    qp.detach_mcast(&g2, 0).unwrap();
    assert_eq!(ud_qps(), before + 1, "the queue pair is listed");
    drop(qp);
    assert_eq!(ud_qps(), before, "the attached queue pair was destroyed by its drop");
    // A detached group is not detached again: detaching it now is the kernel's error.
    let mut qp = pd.create_qp(&cq, QpType::UD).max_send_wr(1).max_recv_wr(1).build().unwrap();
    qp.activate_ud(&opts()).unwrap();
    qp.attach_mcast(&group(), 0).unwrap();
    qp.detach_mcast(&group(), 0).unwrap();
    assert!(matches!(qp.detach_mcast(&group(), 0), Err(Error::Verb { .. })), "not attached any more");
    drop(qp);
    assert_eq!(ud_qps(), before);
}
