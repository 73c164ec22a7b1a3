//! Dropping the objects of bound memory windows returns promptly in every order (issue 47).
//!
//! rxe's `ibv_destroy_qp` waits up to 50 s in the kernel for the type 2 windows still bound
//! through the queue pair (and then frees the queue pair under them); the crate defers such a
//! queue pair's destruction until its windows are gone. These tests drop a pair of connected
//! queue pairs (with their CQs), the protection domain handle, two exposed regions and two
//! windows bound over them and written through by the peer, in each of the 24 orders of those
//! four groups, for each window type, and bound the time every order takes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ibverbs::{
    AccessFlags, BoundWindow, CompletionQueue, Error, ExposedRegion, Local, MwType, ProtectionDomain,
    QueuePair, SendRequest, WcOpcode, WcStatus,
};

/// What one order drops, in four groups.
struct Objects {
    qps: Option<(QueuePair, CompletionQueue, QueuePair, CompletionQueue)>,
    pd: Option<ProtectionDomain>,
    regions: Option<Vec<ExposedRegion>>,
    windows: Option<Vec<BoundWindow>>,
}

/// Binds `mw` (type `ty`) over the first KiB of `region` through `qp`, polling the bind's
/// completion from `cq`.
fn bind(
    qp: &mut QueuePair,
    cq: &mut CompletionQueue,
    mw: ibverbs::MemoryWindow,
    region: &ExposedRegion,
    i: u64,
) -> BoundWindow {
    match mw.mw_type() {
        MwType::Type1 => qp.bind_mw(mw, region, 0..1024, AccessFlags::REMOTE_WRITE, i).unwrap(),
        _ => {
            let wr = SendRequest::bind_window(mw, region, 0..1024, AccessFlags::REMOTE_WRITE).unwrap();
            qp.post_send(wr.wr_id(i)).unwrap();
        }
    }
    let mut c = poll_one(cq);
    assert_eq!((c.status(), c.opcode(), c.wr_id()), (WcStatus::SUCCESS, WcOpcode::BIND_MW, i), "{c:?}");
    c.take_bound_window().unwrap()
}

/// Writes 64 bytes of pattern `seed` through window `w` from `qp` and checks they landed.
fn write_through(
    pd: &ProtectionDomain,
    qp: &mut QueuePair,
    cq: &mut CompletionQueue,
    w: &BoundWindow,
    region: &ExposedRegion,
    seed: u8,
) {
    let mut src = pd.allocate(64).unwrap();
    src.copy_from_slice(&pattern(64, seed));
    qp.post_send(SendRequest::write(Local::whole(src), w.remote().slice(0, 64).unwrap())).unwrap();
    let c = poll_one(cq);
    assert_eq!(c.status(), WcStatus::SUCCESS, "{c:?}");
    assert_eq!(region.to_vec()[..64], pattern(64, seed)[..]);
}

/// A connected pair, two exposed regions, and a window of type `ty` over each: the first bound
/// through `b` and written through by `a`, the second bound through `a` and written by `b` (so
/// that windows of both queue pairs are in play).
fn setup(ty: MwType) -> (Objects, Option<[ibverbs::cm::CmId; 2]>) {
    let Pair { pd, mut a, mut b, mut cq_a, mut cq_b, cm, .. } = rc_pair(8);
    let mut regions = Vec::new();
    let mut windows = Vec::new();
    for i in 0..2u64 {
        let region = pd.allocate_windowed(4096, AccessFlags::LOCAL_WRITE).unwrap().expose();
        let mw = pd.alloc_mw(ty).unwrap();
        let (binder, bcq, writer, wcq) = if i == 0 {
            (&mut b, &mut cq_b, &mut a, &mut cq_a)
        } else {
            (&mut a, &mut cq_a, &mut b, &mut cq_b)
        };
        let w = bind(binder, bcq, mw, &region, i);
        write_through(&pd, writer, wcq, &w, &region, i as u8);
        regions.push(region);
        windows.push(w);
    }
    let objects = Objects {
        qps: Some((a, cq_a, b, cq_b)),
        pd: Some(pd),
        regions: Some(regions),
        windows: Some(windows),
    };
    (objects, cm)
}

/// Whether `ty` windows are supported; reports them unsupported by name when not.
fn windows_supported(ty: MwType) -> bool {
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    match pd.alloc_mw(ty) {
        Ok(_) => true,
        Err(Error::Unsupported { capability, .. }) => {
            unsupported(&ctx, &format!("memory windows ({ty:?})"), capability);
            false
        }
        Err(e) => panic!("ibv_alloc_mw({ty:?}): {e:?}"),
    }
}

/// Asserts that the kernel never waited for a queue pair's references (rxe's `__rxe_cleanup`
/// warns with a stack trace naming itself when it gives up).
fn assert_kernel_never_waited() {
    if let Ok(out) = std::process::Command::new("dmesg").output() {
        let log = String::from_utf8_lossy(&out.stdout);
        assert!(!log.contains("__rxe_cleanup"), "the kernel waited in __rxe_cleanup:\n{log}");
    }
}

/// Every order of `items`.
fn permutations(items: &[usize]) -> Vec<Vec<usize>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    let mut out = Vec::new();
    for (i, &first) in items.iter().enumerate() {
        let rest: Vec<usize> = items.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, &x)| x).collect();
        for mut p in permutations(&rest) {
            p.insert(0, first);
            out.push(p);
        }
    }
    out
}

const NAMES: [&str; 4] = ["queue pairs and CQs", "PD", "regions", "windows"];

fn every_order(ty: MwType) {
    if !windows_supported(ty) {
        return;
    }
    let orders = permutations(&[0, 1, 2, 3]);
    assert_eq!(orders.len(), 24);
    let bound = scaled(Duration::from_secs(2));
    let mut slowest = (Duration::ZERO, String::new());
    for order in &orders {
        let (mut o, cm) = setup(ty);
        let name = order.iter().map(|&g| NAMES[g]).collect::<Vec<_>>().join(", then ");
        let start = Instant::now();
        for &g in order {
            match g {
                0 => drop(o.qps.take()),
                1 => drop(o.pd.take()),
                2 => drop(o.regions.take()),
                _ => drop(o.windows.take()),
            }
        }
        let took = start.elapsed();
        drop(cm);
        println!("{ty:?}: dropping {name} took {took:?}");
        assert!(took < bound, "{ty:?}: dropping {name} took {took:?}");
        if took > slowest.0 {
            slowest = (took, name);
        }
    }
    println!("{ty:?}: 24 orders, the slowest ({}) took {:?}", slowest.1, slowest.0);
    assert_kernel_never_waited();
}

#[test]
fn type1_windows_drop_promptly_in_every_order() {
    every_order(MwType::Type1);
}

#[test]
fn type2_windows_drop_promptly_in_every_order() {
    every_order(MwType::Type2);
}

/// A queue pair whose destruction waits for its windows still hands its buffers back once the
/// last window goes: a receive buffer it had outstanding is released (by the CQ's next polls),
/// not before, and the CQ's room comes back.
#[test]
fn a_deferred_queue_pair_releases_its_buffers_after_its_last_window() {
    if !windows_supported(MwType::Type2) {
        return;
    }
    let (mut o, _cm) = setup(MwType::Type2);
    let (a, cq_a, mut b, mut cq_b) = o.qps.take().unwrap();
    let pd = o.pd.take().unwrap();
    let rx = std::sync::Arc::new(pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    b.post_recv(ibverbs::RecvRequest::new(Local::whole(rx.clone())).wr_id(77)).unwrap();
    assert_eq!(std::sync::Arc::strong_count(&rx), 2, "the posted receive holds it");
    let start = Instant::now();
    drop(b);
    assert!(start.elapsed() < scaled(Duration::from_secs(1)), "the drop returned at once");
    // Deferred on rxe (the windows still hold the queue pair): the receive stays the device's.
    let deferred = std::sync::Arc::strong_count(&rx) == 2;
    let mut got = [ibverbs::Completion::default(), ibverbs::Completion::default()];
    for _ in 0..2 {
        assert!(cq_b.poll(&mut got).unwrap().is_empty());
    }
    if deferred {
        assert_eq!(std::sync::Arc::strong_count(&rx), 2, "not released before the queue pair is destroyed");
    }
    drop(o.windows.take());
    // Destroyed now: its buffers are released by the CQ's next polls (rxe gives no flush
    // completion for a destroyed queue pair's receives).
    for _ in 0..2 {
        let polled = cq_b.poll(&mut got).unwrap();
        assert!(polled.is_empty(), "unexpected completions {polled:?}");
    }
    assert_eq!(std::sync::Arc::strong_count(&rx), 1, "the receive's buffer came back");
    assert_eq!(cq_b.unreserved(), cq_b.capacity(), "the destroyed queue pair's room came back");
    println!("deferred until the last window: {deferred}");
    drop((a, cq_a, cq_b, pd, o));
}

/// A queue pair dropped while a type 2 bind posted on it has not been polled: the device may have
/// executed the bind (taking its reference on the queue pair), so the window in the request holds
/// the queue pair from the post on. The drop returns at once; the bind still completes (the queue
/// pair lives on in the device); the window it hands out, moved to another thread and dropped
/// there, lets the queue pair be destroyed, without the kernel waiting.
#[test]
fn a_window_in_a_pending_bind_holds_its_dropped_queue_pair() {
    if !windows_supported(MwType::Type2) {
        return;
    }
    let Pair { pd, a, mut b, cq_a, mut cq_b, cm, .. } = rc_pair(8);
    let region = pd.allocate_windowed(4096, AccessFlags::LOCAL_WRITE).unwrap().expose();
    let mw = pd.alloc_mw(MwType::Type2).unwrap();
    let wr = SendRequest::bind_window(mw, &region, 0..1024, AccessFlags::REMOTE_WRITE).unwrap();
    b.post_send(wr.wr_id(5)).unwrap();
    let start = Instant::now();
    drop(b);
    let took = start.elapsed();
    println!("dropping a queue pair with a bind in flight took {took:?}");
    assert!(took < scaled(Duration::from_secs(1)), "the drop took {took:?}");
    let mut c = poll_one(&mut cq_b);
    assert_eq!((c.wr_id(), c.opcode()), (5, WcOpcode::BIND_MW), "{c:?}");
    let w = c.take_bound_window().expect("the bind's window");
    let start = Instant::now();
    std::thread::spawn(move || drop(w)).join().unwrap();
    let took = start.elapsed();
    println!("dropping its window (and so destroying the queue pair) on another thread took {took:?}");
    assert!(took < scaled(Duration::from_secs(2)), "took {took:?}");
    assert_eq!(region.windows(), 0);
    drop(c);
    let mut got = [ibverbs::Completion::default(), ibverbs::Completion::default()];
    for _ in 0..2 {
        assert!(cq_b.poll(&mut got).unwrap().is_empty());
    }
    assert_eq!(cq_b.unreserved(), cq_b.capacity(), "the destroyed queue pair's room came back after polls");
    drop((a, cq_a, cq_b, region, pd, cm));
    assert_kernel_never_waited();
}

/// Windows of two queue pairs, each queue pair dropped before its window: each queue pair is
/// destroyed when its own window is revoked (`BoundWindow::revoke`: deallocated, a new window
/// allocated), not before, and independently of the other. A CQ's room comes back (after polls
/// that find it empty) only once its queue pair is destroyed.
#[test]
fn revoking_each_window_destroys_only_its_own_dropped_queue_pair() {
    if !windows_supported(MwType::Type2) {
        return;
    }
    let (mut o, _cm) = setup(MwType::Type2);
    let (a, mut cq_a, b, mut cq_b) = o.qps.take().unwrap();
    let mut windows = o.windows.take().unwrap();
    // Window 0 was bound through b, window 1 through a.
    let through_a = windows.pop().unwrap();
    let through_b = windows.pop().unwrap();
    let start = Instant::now();
    drop((a, b));
    assert!(start.elapsed() < scaled(Duration::from_secs(1)), "the drops returned at once");
    let mut got = [ibverbs::Completion::default(), ibverbs::Completion::default()];
    let mut settle = |cq: &mut CompletionQueue| {
        for _ in 0..2 {
            let polled = cq.poll(&mut got).unwrap();
            assert!(polled.is_empty(), "unexpected completions {polled:?}");
        }
        cq.capacity() - cq.unreserved()
    };
    assert!(settle(&mut cq_a) > 0 && settle(&mut cq_b) > 0, "both queue pairs are held by their windows");
    let start = Instant::now();
    let fresh_b = through_b.revoke().unwrap();
    println!("revoking b's window (destroying b) took {:?}", start.elapsed());
    assert_eq!(settle(&mut cq_b), 0, "b is destroyed: its room came back");
    assert!(settle(&mut cq_a) > 0, "a is still held by its window");
    let start = Instant::now();
    let fresh_a = through_a.revoke().unwrap();
    println!("revoking a's window (destroying a) took {:?}", start.elapsed());
    assert_eq!(settle(&mut cq_a), 0, "a is destroyed: its room came back");
    assert_eq!(o.regions.as_ref().unwrap().iter().map(|r| r.windows()).sum::<usize>(), 0);
    drop((fresh_a, fresh_b, cq_a, cq_b, o));
    assert_kernel_never_waited();
}
