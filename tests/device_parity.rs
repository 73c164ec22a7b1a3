//! Device tests of what rdma-core's own test suite (the pyverbs tests) does and the crate could
//! not say before (issue 47): completion vectors, resizing a CQ, the P_Key table, re-registration
//! with a new PD or range, address handles without a GRH, the device attributes, a 0-byte RDMA
//! Read, window binds through the extended post API, and how long dropping bound windows takes.

mod common;

use std::sync::Arc;

use common::*;
use ibverbs::{AccessFlags, Error, Local, SendRequest, WcFlags, WcOpcode, WcStatus};

/// Every completion vector of the context takes a CQ (classic and extended); the first one past
/// them is refused by name before the verb.
#[test]
fn cq_on_each_completion_vector() {
    let ctx = context();
    let n = ctx.num_comp_vectors();
    assert!(n >= 1, "num_comp_vectors {n}");
    for v in 0..n {
        let cq = ctx.cq_builder(8).comp_vector(v).build().unwrap();
        assert_eq!(cq.comp_vector(), v);
        assert!(cq.capacity() >= 8);
    }
    let e = ctx.cq_builder(8).comp_vector(n).build().unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { verb: "ibv_create_cq", reason } if reason.contains("num_comp_vectors")),
        "{e:?}"
    );
    let e = ctx.cq_builder(8).comp_vector(u32::MAX).wc_flags(WcFlags::BYTE_LEN).build().unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { verb: "ibv_create_cq_ex", .. }), "{e:?}");
    match ctx.cq_builder(8).comp_vector(n - 1).wc_flags(WcFlags::BYTE_LEN).build() {
        Ok(cq) => assert_eq!((cq.comp_vector(), cq.wc_flags()), (n - 1, Some(WcFlags::BYTE_LEN))),
        Err(Error::Unsupported { capability, .. }) => unsupported(&ctx, "extended CQs", capability),
        Err(e) => panic!("ibv_create_cq_ex on vector {}: {e:?}", n - 1),
    }
    // A CQ on the last vector carries traffic and its events like any other.
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.cq_builder(4).channel(&ch).comp_vector(n - 1).build().unwrap();
    cq.req_notify(false).unwrap();
    assert_eq!(cq.comp_vector(), n - 1);
}

/// `resize` grows and shrinks a CQ that queue pairs use, refuses to go below the room their
/// queues reserved (nothing changes), and traffic flows after each resize.
#[test]
fn cq_resize_keeps_the_room_queue_pairs_reserved() {
    let mut p = rc_pair(4);
    let cap = p.cq_a.capacity();
    let reserved = cap - p.cq_a.unreserved();
    assert!(reserved >= 8, "an RC pair of depth 4 reserves its send and receive queues: {reserved}");
    match p.cq_a.resize(reserved - 1) {
        Err(Error::CqTooSmall { verb: "ibv_resize_cq", needed, capacity }) => {
            assert_eq!((needed, capacity), (u64::from(reserved), reserved - 1));
        }
        Err(Error::Unsupported { capability, .. }) => {
            panic!("refused by the verb, not the check: {capability}")
        }
        other => panic!("a resize below the reserved room: {other:?}"),
    }
    assert_eq!((p.cq_a.capacity(), p.cq_a.unreserved()), (cap, cap - reserved), "nothing changed");
    let grown = match p.cq_a.resize(256) {
        Ok(c) => c,
        Err(Error::Unsupported { capability, .. }) => {
            unsupported(&p.ctx, "ibv_resize_cq", capability);
            return;
        }
        Err(e) => panic!("ibv_resize_cq(256): {e:?}"),
    };
    assert!(grown >= 256, "{grown}");
    assert_eq!((p.cq_a.capacity(), p.cq_a.unreserved()), (grown, grown - reserved));
    let max_cqe = p.ctx.query_device().unwrap().max_cqe();
    if let Some(too_big) = max_cqe.checked_add(1) {
        let e = p.cq_a.resize(too_big).unwrap_err();
        assert!(matches!(e, Error::Verb { verb: "ibv_resize_cq", .. }), "{e:?}");
        assert_eq!(p.cq_a.capacity(), grown, "a refused resize keeps the size");
    }
    let target = Arc::new(p.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    let mut src = Some(p.pd.allocate(64).unwrap());
    for (round, depth) in [(1u8, None), (2, Some(reserved)), (3, Some(64))] {
        if let Some(d) = depth {
            let got = p.cq_a.resize(d).unwrap();
            assert!(got >= d && got == p.cq_a.capacity(), "resize({d}) gave {got}");
            assert_eq!(p.cq_a.unreserved(), got - reserved);
        }
        let mut s = src.take().unwrap();
        s.fill(round);
        for i in 0..4u64 {
            let remote = target.remote().slice(16 * i, 16).unwrap();
            let local = Local::new(s, (16 * i as usize)..(16 * i as usize + 16)).unwrap();
            p.a.post_send(SendRequest::write(local, remote).wr_id(i)).unwrap();
            let mut c = poll_one(&mut p.cq_a);
            assert_eq!((c.status(), c.opcode(), c.wr_id()), (WcStatus::SUCCESS, WcOpcode::RDMA_WRITE, i));
            s = c.take_region().unwrap();
        }
        assert_eq!(target.to_vec(), vec![round; 64], "round {round}");
        src = Some(s);
    }
    // A new queue pair on the resized CQ reserves from its new room.
    let before = p.cq_a.unreserved();
    let q = p.pd.create_qp(&p.cq_a, ibverbs::QpType::RC).max_send_wr(4).max_recv_wr(4).build().unwrap();
    assert!(p.cq_a.unreserved() <= before - 8);
    drop(q);
}

/// The P_Key table as rdma-core's tests read it: every entry by index, the default key at index
/// 0 of a RoCE/iWARP port, its index found back, a key not in the table and bad arguments typed.
#[test]
fn pkey_table_and_index() {
    let ctx = context();
    let len = ctx.query_port(1).unwrap().pkey_tbl_len();
    if len == 0 {
        // iWARP has no partitions: siw reports an empty table.
        assert_eq!(ctx.pkey_table(1).unwrap(), Vec::<u16>::new());
        let e = ctx.query_pkey(1, 0).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { verb: "ibv_query_pkey", .. }), "{e:?}");
        assert_eq!(ctx.pkey_index(1, 0xffff).unwrap(), None);
        unsupported(&ctx, "P_Key table", "pkey_tbl_len is 0");
        return;
    }
    let table = ctx.pkey_table(1).unwrap();
    assert_eq!(table.len(), usize::from(len));
    for (i, &k) in table.iter().enumerate() {
        assert_eq!(ctx.query_pkey(1, i as u16).unwrap(), k);
    }
    assert_eq!(table[0], 0xffff, "the default full-membership key first: {table:x?}");
    assert_eq!(ctx.pkey_index(1, 0xffff).unwrap(), Some(0));
    let absent = (1..0x7fffu16).find(|k| !table.contains(k)).unwrap();
    assert_eq!(ctx.pkey_index(1, absent).unwrap(), None);
    assert!(matches!(ctx.query_pkey(1, len), Err(Error::InvalidArgument { verb: "ibv_query_pkey", .. })));
    assert!(matches!(ctx.query_pkey(0, 0), Err(Error::InvalidArgument { verb: "ibv_query_pkey", .. })));
    assert!(matches!(
        ctx.pkey_index(0, 0xffff),
        Err(Error::InvalidArgument { verb: "ibv_get_pkey_index", .. })
    ));
    let ports = ctx.query_device().unwrap().phys_port_cnt();
    assert!(matches!(ctx.pkey_table(ports + 1), Err(Error::Verb { verb: "ibv_query_port", .. })));
}

/// `ibv_rereg_mr` with `IBV_REREG_MR_CHANGE_PD` and `IBV_REREG_MR_CHANGE_TRANSLATION`: a PD of
/// another context is refused before the verb; where the provider lacks the verb (rxe, siw) the
/// error is `Unsupported`, the new buffer comes back, and the region is left exactly as it was
/// (keys, address, bytes, a peer's RDMA Read of it).
#[test]
fn rereg_pd_and_translation() {
    let mut p = rc_pair(4);
    let data = pattern(256, 5);
    let mut mr = p.pd.register(data.clone(), AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).unwrap();
    let (lkey, rkey, addr) = (mr.lkey(), mr.rkey(), mr.addr());
    let other = context();
    let other_pd = other.alloc_pd().unwrap();
    let e = mr.rereg_pd(&other_pd).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { verb: "ibv_rereg_mr", .. }), "{e:?}");
    assert_eq!(mr.rereg_pd(&p.pd).ok(), Some(()), "its own PD: nothing to do");
    let pd2 = p.ctx.alloc_pd().unwrap();
    let moved = match mr.rereg_pd(&pd2) {
        Ok(()) => true,
        Err(Error::Unsupported { verb: "ibv_rereg_mr", capability }) => {
            unsupported(&p.ctx, "ibv_rereg_mr(IBV_REREG_MR_CHANGE_PD)", capability);
            false
        }
        Err(e) => panic!("ibv_rereg_mr(CHANGE_PD): {e:?}"),
    };
    drop(pd2); // the region keeps the PD it is in alive
    let e = mr.rereg_buffer(Vec::new()).unwrap_err();
    assert!(
        matches!(&e, (Some(b), Error::InvalidArgument { verb: "ibv_rereg_mr", .. }) if b.is_empty()),
        "{e:?}"
    );
    let fresh = pattern(512, 9);
    let remapped = match mr.rereg_buffer(fresh.clone()) {
        Ok(old) => {
            assert_eq!(p.pd.register(old, AccessFlags::LOCAL_WRITE).unwrap().as_slice(), &data[..]);
            assert_eq!((mr.len(), mr.as_slice()), (512, &fresh[..]));
            true
        }
        Err((Some(back), Error::Unsupported { verb: "ibv_rereg_mr", capability })) => {
            assert_eq!(p.pd.register(back, AccessFlags::LOCAL_WRITE).unwrap().as_slice(), &fresh[..]);
            unsupported(&p.ctx, "ibv_rereg_mr(IBV_REREG_MR_CHANGE_TRANSLATION)", capability);
            false
        }
        Err(e) => panic!("ibv_rereg_mr(CHANGE_TRANSLATION): {e:?}"),
    };
    if moved || remapped {
        return; // the pair's PD no longer holds it; the data path is tested where it is unsupported
    }
    assert_eq!((mr.lkey(), mr.rkey(), mr.addr(), mr.as_slice()), (lkey, rkey, addr, &data[..]));
    let dst = p.pd.allocate(256).unwrap();
    p.b.post_send(SendRequest::read(Local::whole(dst), mr.remote()).wr_id(3)).unwrap();
    let mut c = poll_one(&mut p.cq_b);
    assert_eq!((c.status(), c.opcode(), c.wr_id()), (WcStatus::SUCCESS, WcOpcode::RDMA_READ, 3), "{c:?}");
    assert_eq!(c.take_region().unwrap().as_slice(), &data[..]);
}

/// An address handle without a GRH (LID routing): on an InfiniBand port it is created from the
/// port's LID; on RoCE/iWARP the crate refuses it by name before the verb, and the kernel's own
/// answer to the raw attributes (`EINVAL`) shows why.
#[test]
fn address_handle_without_grh() {
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let o = opts();
    let e = pd.create_ah_lid(0, &o).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { verb: "ibv_create_ah", .. }), "{e:?}");
    let bad_sl = ibverbs::ConnectOptions { sl: 16, ..opts() };
    assert!(matches!(pd.create_ah_lid(1, &bad_sl), Err(Error::InvalidArgument { .. })));
    let port = ctx.query_port(o.port).unwrap();
    match pd.create_ah_lid(port.lid().max(1), &o) {
        Ok(ah) => {
            assert_eq!(port.link_layer(), ibverbs::LinkLayer::INFINIBAND);
            assert!(!ah.as_raw().is_null());
        }
        Err(Error::Unsupported { verb: "ibv_create_ah", capability }) => {
            assert_eq!(port.link_layer(), ibverbs::LinkLayer::ETHERNET);
            let mut raw = ibverbs::ffi::ibv_ah_attr { dlid: 1, port_num: o.port, ..Default::default() };
            // rxe: the kernel's EINVAL (RoCE needs a GRH); siw: no address handles at all.
            let want = if is_iwarp() { libc::EOPNOTSUPP } else { libc::EINVAL };
            match pd.create_ah_raw(&mut raw) {
                Err(Error::Verb { verb: "ibv_create_ah", source }) => {
                    assert_eq!(source.raw_os_error(), Some(want), "{source}")
                }
                other => panic!("the kernel took an AH without a GRH on RoCE: {other:?}"),
            }
            unsupported(&ctx, "address handles without a GRH", capability);
        }
        Err(e) => panic!("create_ah_lid: {e:?}"),
    }
}

/// The device and port attributes through their getters: what rdma-core's `test_device.py`
/// asserts of them, and every numeric field `ibv_devinfo -v` prints equal to the getter's value.
#[test]
fn device_attributes_match_ibv_devinfo() {
    let ctx = context();
    let a = ctx.query_device().unwrap();
    let x = ctx.query_device_ex().unwrap();
    let port = ctx.query_port(1).unwrap();
    let page = ibverbs::page_size() as u64;
    // rdma-core's verify_device_attr and verify_port_attr.
    assert!(a.max_mr_size() > page && a.page_size_cap() >= page, "{a:?}");
    assert!(a.vendor_id() != 0 && a.node_guid().0 != 0 && a.sys_image_guid().0 != 0, "{a:?}");
    for (name, v) in [
        ("max_qp", a.max_qp()),
        ("max_qp_wr", a.max_qp_wr()),
        ("max_sge", a.max_sge()),
        ("max_cq", a.max_cq()),
        ("max_cqe", a.max_cqe()),
        ("max_mr", a.max_mr()),
        ("max_pd", a.max_pd()),
    ] {
        assert!(v > 0, "{name} is 0");
    }
    if !is_iwarp() {
        assert!(a.max_pkeys() > 0);
    }
    assert_eq!(x.phys_port_cnt_ex(), u32::from(a.phys_port_cnt()));
    assert_eq!(x.orig().max_qp(), a.max_qp());
    assert!(port.max_msg_sz() > 0x1000);
    assert!(port.active_mtu().bytes().is_some() && port.max_mtu().bytes().is_some());

    let getters: Vec<(&str, u64)> = vec![
        ("max_mr_size", a.max_mr_size()),
        ("page_size_cap", a.page_size_cap()),
        ("max_qp", a.max_qp().into()),
        ("max_qp_wr", a.max_qp_wr().into()),
        ("device_cap_flags", a.device_cap_flags().into()),
        ("max_sge", a.max_sge().into()),
        ("max_sge_rd", a.max_sge_rd().into()),
        ("max_cq", a.max_cq().into()),
        ("max_cqe", a.max_cqe().into()),
        ("max_mr", a.max_mr().into()),
        ("max_pd", a.max_pd().into()),
        ("max_qp_rd_atom", a.max_qp_rd_atom().into()),
        ("max_ee_rd_atom", a.max_ee_rd_atom().into()),
        ("max_res_rd_atom", a.max_res_rd_atom().into()),
        ("max_qp_init_rd_atom", a.max_qp_init_rd_atom().into()),
        ("max_ee_init_rd_atom", a.max_ee_init_rd_atom().into()),
        ("max_ee", a.max_ee().into()),
        ("max_rdd", a.max_rdd().into()),
        ("max_mw", a.max_mw().into()),
        ("max_raw_ipv6_qp", a.max_raw_ipv6_qp().into()),
        ("max_raw_ethy_qp", a.max_raw_ethy_qp().into()),
        ("max_mcast_grp", a.max_mcast_grp().into()),
        ("max_mcast_qp_attach", a.max_mcast_qp_attach().into()),
        ("max_total_mcast_qp_attach", a.max_total_mcast_qp_attach().into()),
        ("max_ah", a.max_ah().into()),
        ("max_fmr", a.max_fmr().into()),
        ("max_map_per_fmr", a.max_map_per_fmr().into()),
        ("max_srq", a.max_srq().into()),
        ("max_srq_wr", a.max_srq_wr().into()),
        ("max_srq_sge", a.max_srq_sge().into()),
        ("max_pkeys", a.max_pkeys().into()),
        ("local_ca_ack_delay", a.local_ca_ack_delay().into()),
        ("vendor_id", a.vendor_id().into()),
        ("vendor_part_id", a.vendor_part_id().into()),
        ("hw_ver", a.hw_ver().into()),
        ("phys_port_cnt", a.phys_port_cnt().into()),
        ("max_msg_sz", port.max_msg_sz().into()),
        ("port_cap_flags", port.port_cap_flags().into()),
        ("port_cap_flags2", port.port_cap_flags2().into()),
        ("max_vl_num", port.max_vl_num().into()),
        ("bad_pkey_cntr", port.bad_pkey_cntr().into()),
        ("qkey_viol_cntr", port.qkey_viol_cntr().into()),
        ("sm_sl", port.sm_sl().into()),
        ("pkey_tbl_len", port.pkey_tbl_len().into()),
        ("gid_tbl_len", port.gid_tbl_len().into()),
        ("subnet_timeout", port.subnet_timeout().into()),
        ("init_type_reply", port.init_type_reply().into()),
        ("sm_lid", port.sm_lid().into()),
        ("port_lid", port.lid().into()),
        ("port_lmc", port.lmc().into()),
        ("max_dm_size", x.max_dm_size()),
        ("completion_timestamp_mask", x.completion_timestamp_mask()),
        ("hca_core_clock", x.hca_core_clock()),
        ("device_cap_flags_ex", x.device_cap_flags_ex()),
        ("max_wq_type_rq", x.max_wq_type_rq().into()),
        ("max_tso", x.tso_caps().max_tso.into()),
        ("max_rwq_indirection_tables", x.rss_caps().max_rwq_indirection_tables.into()),
        ("max_rwq_indirection_table_size", x.rss_caps().max_rwq_indirection_table_size.into()),
        ("rx_hash_fields_mask", x.rss_caps().rx_hash_fields_mask),
        ("qp_rate_limit_min", x.packet_pacing_caps().qp_rate_limit_min.into()),
        ("qp_rate_limit_max", x.packet_pacing_caps().qp_rate_limit_max.into()),
        ("num_comp_vectors", ctx.num_comp_vectors().into()),
    ];
    let out = std::process::Command::new("ibv_devinfo")
        .args(["-v", "-d", ctx.name()])
        .output()
        .expect("ibv_devinfo (ibverbs-utils) in the test machine");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut printed = std::collections::HashMap::new();
    for line in text.lines() {
        let Some((k, v)) = line.trim().split_once(':') else { continue };
        let v = v.split_whitespace().next().unwrap_or("");
        let n = match v.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => v.parse::<u64>().ok(),
        };
        if let Some(n) = n {
            printed.entry(k.trim().to_string()).or_insert(n);
        }
    }
    let mut compared = 0;
    let mut not_printed = Vec::new();
    for (name, ours) in &getters {
        if let Some(&theirs) = printed.get(*name) {
            assert_eq!(*ours, theirs, "{name}: getter {ours:#x}, ibv_devinfo {theirs:#x}");
            compared += 1;
        } else {
            not_printed.push(*name);
        }
    }
    // ibv_devinfo 44 leaves out some fields (and the extended ones a device does not fill).
    assert!(compared >= 45, "only {compared} fields compared; ibv_devinfo printed {printed:?}");
    println!("{compared} attributes equal to ibv_devinfo -v's; not printed by it: {not_printed:?}");
}

/// A 0-byte RDMA Read: completes as a Read of 0 bytes with no buffer, after the Write before it
/// (whose bytes are then at the peer); it may be unsignaled, holding nothing.
#[test]
fn zero_byte_rdma_read() {
    let mut p = rc_pair(4);
    let target =
        Arc::new(p.pd.allocate_remote(64, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap());
    let data = pattern(64, 7);
    let mut src = p.pd.allocate(64).unwrap();
    src.copy_from_slice(&data);
    p.a.post_send(SendRequest::write(Local::whole(src), target.remote()).wr_id(1)).unwrap();
    p.a.post_send(SendRequest::read_empty(target.remote()).wr_id(2)).unwrap();
    let mut cs = poll_n(&mut p.cq_a, 2);
    assert_eq!((cs[0].status(), cs[0].opcode(), cs[0].wr_id()), (WcStatus::SUCCESS, WcOpcode::RDMA_WRITE, 1));
    assert_eq!((cs[1].status(), cs[1].opcode(), cs[1].wr_id()), (WcStatus::SUCCESS, WcOpcode::RDMA_READ, 2));
    assert_eq!(cs[1].byte_len(), 0);
    assert!(cs[1].take_region().is_none());
    assert_eq!(target.to_vec(), data, "the Write before it is at the peer");
    p.a.post_send(SendRequest::read_empty(target.remote().slice(8, 0).unwrap()).unsignaled().wr_id(3))
        .unwrap();
    p.a.post_send(SendRequest::read_empty(target.remote().slice(8, 8).unwrap()).wr_id(4)).unwrap();
    let c = poll_one(&mut p.cq_a);
    assert_eq!(
        (c.status(), c.opcode(), c.wr_id(), c.byte_len()),
        (WcStatus::SUCCESS, WcOpcode::RDMA_READ, 4, 0)
    );
    assert_quiet(&mut p.cq_a, std::time::Duration::from_millis(20));
    assert_eq!(target.to_vec(), data, "nothing changed at the peer");
}

/// Window binds and Send with Invalidate through the extended post API (`ibv_wr_bind_mw`,
/// `ibv_wr_send_inv`): the same requests as on a classic queue pair, the window handed back by
/// the bind's completion, the peer writing through it until its Send with Invalidate; a queue
/// pair created without `SendOps::BIND_MW` refuses the bind before posting.
#[test]
fn window_bind_and_send_with_invalidate_through_the_extended_post_api() {
    use ibverbs::{MwType, QpType, RecvRequest, SendOps};
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    match pd.alloc_mw(MwType::Type2) {
        Ok(_) => {}
        Err(Error::Unsupported { capability, .. }) => {
            unsupported(&ctx, "memory windows (Type2)", capability);
            return;
        }
        Err(e) => panic!("ibv_alloc_mw: {e:?}"),
    }
    let mut cq_a = ctx.create_cq(16, None).unwrap();
    let mut cq_b = ctx.create_cq(16, None).unwrap();
    let build = |cq, ops| pd.create_qp(cq, QpType::RC).max_send_wr(4).max_recv_wr(4).send_ops(ops).build();
    let mut a = match build(&cq_a, SendOps::ALL_SAFE | SendOps::SEND_WITH_INV) {
        Ok(q) => q,
        Err(Error::Unsupported { capability, .. }) => {
            unsupported(&ctx, "extended QPs", capability);
            return;
        }
        Err(e) => panic!("ibv_create_qp_ex: {e:?}"),
    };
    let mut b = build(&cq_b, SendOps::ALL_SAFE | SendOps::BIND_MW).unwrap();
    assert!(b.send_ops().unwrap().contains(SendOps::BIND_MW), "{:?}", b.send_ops());
    let o = opts();
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    a.connect(&eb, &o).unwrap();
    b.connect(&ea, &o).unwrap();

    let region = pd.allocate_windowed(4096, AccessFlags::LOCAL_WRITE).unwrap().expose();
    // `a` was not created for binds: refused before anything is posted.
    let wr = SendRequest::bind_window(
        pd.alloc_mw(MwType::Type2).unwrap(),
        &region,
        0..1024,
        AccessFlags::REMOTE_WRITE,
    )
    .unwrap();
    let e = a.post_send(wr).unwrap_err();
    assert!(matches!(e.error, Error::SendOpNotEnabled { op: "IBV_QP_EX_WITH_BIND_MW", .. }), "{e:?}");
    drop(e); // the refused request, with its window, comes back in the error
    assert_eq!(region.windows(), 0);
    assert_quiet(&mut cq_a, std::time::Duration::from_millis(10));

    let mw = pd.alloc_mw(MwType::Type2).unwrap();
    let wr = SendRequest::bind_window(mw, &region, 1024..2048, AccessFlags::REMOTE_WRITE).unwrap();
    b.post_send(wr.wr_id(7)).unwrap();
    let mut c = poll_one(&mut cq_b);
    assert_eq!((c.status(), c.opcode(), c.wr_id()), (WcStatus::SUCCESS, WcOpcode::BIND_MW, 7), "{c:?}");
    let w = c.take_bound_window().unwrap();
    let remote = w.remote();
    assert_eq!((remote.len, region.windows()), (1024, 1));

    let data = pattern(1024, 11);
    let mut src = pd.allocate(1024).unwrap();
    src.copy_from_slice(&data);
    a.post_send(SendRequest::write(Local::whole(src), remote).wr_id(1)).unwrap();
    let mut c = poll_one(&mut cq_a);
    assert_eq!((c.status(), c.opcode()), (WcStatus::SUCCESS, WcOpcode::RDMA_WRITE), "{c:?}");
    let src = c.take_region().unwrap();
    assert_eq!(&region.to_vec()[1024..2048], &data[..]);

    // The peer's Send with Invalidate, built with ibv_wr_send_inv, ends the window's access.
    b.post_recv(RecvRequest::new(Local::whole(pd.allocate(64).unwrap())).wr_id(21)).unwrap();
    a.post_send(SendRequest::send_with_invalidate(Local::new(src, 0..16).unwrap(), remote.rkey).wr_id(2))
        .unwrap();
    let c = poll_one(&mut cq_a);
    assert_eq!((c.status(), c.opcode(), c.wr_id()), (WcStatus::SUCCESS, WcOpcode::SEND, 2), "{c:?}");
    let c = poll_one(&mut cq_b);
    assert_eq!(
        (c.status(), c.opcode(), c.wr_id(), c.byte_len()),
        (WcStatus::SUCCESS, WcOpcode::RECV, 21, 16)
    );
    let mut src = pd.allocate(8).unwrap();
    src.copy_from_slice(b"too late");
    a.post_send(SendRequest::write(Local::whole(src), remote).wr_id(3)).unwrap();
    let c = poll_one(&mut cq_a);
    assert_eq!((c.status(), c.wr_id()), (WcStatus::REM_ACCESS_ERR, 3), "the rkey is invalidated: {c:?}");
    w.dealloc();
    assert_eq!(region.windows(), 0);
    let private = region.into_private().unwrap();
    assert_eq!(&private[1024..2048], &data[..], "the refused write changed nothing");
}
