//! Device tests of the registration family and fork safety: IOVA registration (bytes moved and
//! compared), `ibv_rereg_mr`, on-demand paging, on-device memory, dma-buf regions, and
//! `fork()` + `exec` while transfers run. A capability the device lacks is checked for its typed
//! error and reported by name (`common::unsupported`), never passed silently.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use ibverbs::fork::{fork_init, fork_support, ForkSupport};
use ibverbs::odp::OdpAdvice;
use ibverbs::{
    AccessFlags, Error, Local, OwnedBuffer, RecvRequest, SendRequest, WcOpcode, WcStatus, IOVA_ELSEWHERE,
};

/// A page-aligned IOVA far from any real address of this process.
const IOVA: u64 = 0x7000_0000_0000;

fn page_buf(len: usize) -> OwnedBuffer {
    OwnedBuffer::zeroed(len).unwrap()
}

#[test]
fn iova_regions_move_bytes_by_their_iova() {
    let mut p = rc_pair(8);
    let len = 8192;
    // RDMA Write from an IOVA source into an IOVA target, both addressed by IOVA.
    let mut src = match p.pd.register_iova(page_buf(len), IOVA, AccessFlags::LOCAL_WRITE) {
        Err(Error::Unsupported { capability: IOVA_ELSEWHERE, .. }) => {
            return unsupported(&p.ctx, "IOVA registration", "siw registers every region at its address");
        }
        r => r.unwrap(),
    };
    src.copy_from_slice(&pattern(len, 7));
    assert_eq!(src.iova(), IOVA);
    assert_eq!(src.remote().addr, IOVA);
    let target = Arc::new(
        p.pd.register_remote_iova(page_buf(len), IOVA + 0x10_0000, AccessFlags::REMOTE_WRITE).unwrap(),
    );
    assert_eq!(target.remote().addr, IOVA + 0x10_0000);
    let remote = target.remote().slice(512, 4096).unwrap();
    p.a.post_send(SendRequest::write(Local::new(src, 1000..5096).unwrap(), remote).wr_id(1)).unwrap();
    let mut c = poll_one(&mut p.cq_a);
    assert_eq!(c.status(), WcStatus::SUCCESS, "{c:?}");
    let src = c.take_region().unwrap();
    let got = target.to_vec();
    assert_eq!(&got[512..4608], &src[1000..5096], "the SGE named bytes 1000.. of the source by IOVA");
    assert!(got[..512].iter().chain(&got[4608..]).all(|&b| b == 0));

    // RDMA Read back into an IOVA region, and Send/Recv into an IOVA chunk.
    let back = p.pd.register_iova(page_buf(4096), IOVA + 0x20_0000, AccessFlags::LOCAL_WRITE);
    let back = back.unwrap();
    let readable =
        p.pd.register_remote_iova(page_buf(4096), IOVA + 0x30_0000, AccessFlags::REMOTE_READ)
            .map(Arc::new)
            .unwrap();
    readable.write(0, &pattern(4096, 9)).unwrap();
    p.a.post_send(SendRequest::read(Local::whole(back), readable.remote()).wr_id(2)).unwrap();
    let mut c = poll_one(&mut p.cq_a);
    assert_eq!((c.status(), c.opcode()), (WcStatus::SUCCESS, WcOpcode::RDMA_READ), "{c:?}");
    assert_eq!(&c.take_region().unwrap()[..], &pattern(4096, 9)[..]);

    let chunks =
        p.pd.register_iova(page_buf(8192), IOVA + 0x40_0000, AccessFlags::LOCAL_WRITE)
            .unwrap()
            .into_chunks(4096)
            .unwrap();
    let mut chunks = chunks.into_iter();
    let (first, second) = (chunks.next().unwrap(), chunks.next().unwrap());
    p.b.post_recv(RecvRequest::new(Local::whole(second))).unwrap();
    p.a.post_send(SendRequest::send(Local::new(src, 0..3000).unwrap())).unwrap();
    assert!(poll_one(&mut p.cq_a).is_ok());
    let mut rc = poll_one(&mut p.cq_b);
    assert_eq!(rc.status(), WcStatus::SUCCESS, "{rc:?}");
    assert_eq!(rc.byte_len(), 3000);
    let second = rc.take_chunk().unwrap();
    assert_eq!(&second[..3000], &pattern(len, 7)[..3000], "received into the second chunk by its IOVA");
    assert!(first.iter().all(|&b| b == 0), "the first chunk untouched");
}

#[test]
fn rereg_access_checks_its_arguments_and_reports_the_device() {
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let mut mr = pd.allocate(4096).unwrap();
    assert!(matches!(mr.rereg_access(AccessFlags::REMOTE_WRITE), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        mr.rereg_access(AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND),
        Err(Error::InvalidArgument { .. })
    ));
    match mr.rereg_access(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ) {
        Ok(()) => assert!(mr.access().contains(AccessFlags::REMOTE_READ)),
        Err(e @ Error::Unsupported { .. }) => {
            assert_eq!(mr.access(), AccessFlags::LOCAL_WRITE, "unchanged after a refused rereg");
            unsupported(&ctx, "ibv_rereg_mr", e);
        }
        Err(e) => panic!("{e}"),
    }
    // The region still works after the attempt.
    mr.copy_from_slice(&[1; 4096]);
    assert_eq!(mr[4095], 1);
}

#[test]
fn on_demand_paging_is_checked_against_the_device() {
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let odp = ctx.query_device_ex().unwrap().odp();
    let plain = pd.allocate(4096).unwrap();
    assert!(
        matches!(plain.advise(OdpAdvice::Prefetch, .., true), Err(Error::InvalidArgument { .. })),
        "advice needs an ODP region"
    );
    let r = pd.register(page_buf(1 << 16), AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND);
    match (odp.supported(), r) {
        (true, Ok(mr)) => {
            assert!(mr.access().contains(AccessFlags::ON_DEMAND));
            assert!(matches!(
                mr.advise(OdpAdvice::PrefetchWrite, 0..1 << 17, true),
                Err(Error::OutOfBounds { .. })
            ));
            match mr.advise(OdpAdvice::PrefetchWrite, .., true) {
                Ok(()) => {}
                Err(e @ Error::Unsupported { .. }) => unsupported(&ctx, "ibv_advise_mr", e),
                Err(e) => panic!("{e}"),
            }
        }
        (false, Err(e @ Error::Unsupported { .. })) => {
            assert!(e.to_string().contains("IBV_ODP_SUPPORT"), "{e}");
            unsupported(&ctx, "on-demand paging", e);
        }
        (s, r) => panic!("ODP support {s} but registration gave {r:?}"),
    }
    // SAFETY: no key of the region is used (and none with remote rights is given out).
    match unsafe { pd.register_implicit_odp(AccessFlags::LOCAL_WRITE) } {
        Ok(imp) => assert!(odp.implicit() && imp.access().contains(AccessFlags::ON_DEMAND)),
        Err(e @ Error::Unsupported { .. }) => {
            assert!(!odp.implicit());
            unsupported(&ctx, "implicit on-demand paging", e);
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn device_memory_copies_and_registers_where_the_device_has_it() {
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let max = ctx.query_device_ex().unwrap().max_dm_size();
    match ctx.alloc_dm(4096, 3) {
        Ok(dm) => {
            assert!(max >= 4096);
            let data = pattern(256, 5);
            assert!(matches!(dm.copy_from_slice(4000, &data), Err(Error::OutOfBounds { .. })));
            dm.copy_from_slice(64, &data).unwrap();
            let mut back = vec![0; 256];
            dm.copy_to_slice(64, &mut back).unwrap();
            assert_eq!(back, data);
            let mr = dm.register(&pd, 0..4096, AccessFlags::LOCAL_WRITE).unwrap();
            assert_eq!(mr.remote().addr, 0, "zero-based");
        }
        Err(e @ Error::Unsupported { .. }) => {
            assert_eq!(max, 0);
            unsupported(&ctx, "on-device memory (ibv_alloc_dm)", e);
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn dmabuf_registration_is_refused_with_a_typed_error_where_unsupported() {
    use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    // A memfd, which is not a dma-buf: a provider with the verb refuses it, one without says so
    // (the guest has no dma-buf exporter; the registration of a real one is not tested here).
    // SAFETY: a fresh memfd; the name is a NUL-terminated literal.
    let memfd = unsafe { libc::memfd_create(c"ibverbs-dmabuf".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(memfd >= 0);
    // SAFETY: just opened, owned here.
    let memfd = unsafe { OwnedFd::from_raw_fd(memfd) };
    // SAFETY: a valid descriptor; resizing a memfd has no memory-safety effect.
    assert_eq!(unsafe { libc::ftruncate(memfd.as_raw_fd(), 1 << 16) }, 0);
    assert!(matches!(
        pd.register_dmabuf(memfd.as_fd(), 0, 0, 0, AccessFlags::LOCAL_WRITE),
        Err(Error::InvalidArgument { .. })
    ));
    match pd.register_dmabuf(memfd.as_fd(), 0, 1 << 16, 0, AccessFlags::LOCAL_WRITE) {
        Err(e @ Error::Unsupported { .. }) => {
            unsupported(&ctx, "dma-buf registration (ibv_reg_dmabuf_mr)", e)
        }
        // A provider that has the verb refuses a memfd that is not a dma-buf.
        Err(Error::Verb { .. }) => {}
        Ok(r) => panic!("a memfd registered as a dma-buf: {r:?}"),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn fork_and_exec_while_transfers_run() {
    let status = fork_support();
    println!("fork support: {status:?}");
    // rdma-core 44 on Linux 6.1 (the harness's guest): the kernel keeps pinned pages in the parent.
    assert_ne!(status, ForkSupport::Disabled, "this kernel and rdma-core need no ibv_fork_init");
    if status == ForkSupport::Unneeded {
        // SAFETY: no other thread of this test binary is in libibverbs: the harness runs device
        // tests one at a time (--test-threads=1), and this test starts its own threads below.
        unsafe { fork_init() }.unwrap();
        assert_eq!(fork_support(), ForkSupport::Unneeded, "fork_init changes nothing where it is unneeded");
    }

    let mut p = rc_pair(16);
    let stop = Arc::new(AtomicBool::new(false));
    let forked = Arc::new(AtomicU32::new(0));
    let forker = {
        let (stop, forked) = (stop.clone(), forked.clone());
        std::thread::spawn(move || {
            let mut children = 0;
            while !stop.load(Ordering::Relaxed) && children < 200 {
                // SAFETY: the child calls only async-signal-safe functions (execv, _exit).
                let pid = unsafe { libc::fork() };
                assert!(pid >= 0, "fork failed");
                if pid == 0 {
                    // SAFETY: NUL-terminated literals and a NULL-terminated argv.
                    unsafe {
                        let argv = [c"/bin/true".as_ptr(), std::ptr::null()];
                        libc::execv(c"/bin/true".as_ptr(), argv.as_ptr());
                        libc::_exit(127);
                    }
                }
                let mut wstatus = 0;
                // SAFETY: our child.
                assert_eq!(unsafe { libc::waitpid(pid, &mut wstatus, 0) }, pid);
                assert!(
                    libc::WIFEXITED(wstatus) && libc::WEXITSTATUS(wstatus) == 0,
                    "child status {wstatus:#x}"
                );
                children += 1;
                forked.store(children, Ordering::Relaxed);
            }
            children
        })
    };

    // Meanwhile: the parent rewrites its source buffer before every transfer (a page the fork
    // made copy-on-write on an old kernel would leave the device reading the stale copy) and
    // checks every byte that arrives.
    let target = Arc::new(p.pd.allocate_remote(1 << 16, AccessFlags::REMOTE_WRITE).unwrap());
    let mut src = p.pd.allocate(1 << 16).unwrap();
    let mut rounds = 0u32;
    let deadline = std::time::Instant::now() + scaled(Duration::from_secs(3));
    // At least 20 transfers, and on until 5 children forked (or the deadline).
    while rounds < 20 || (forked.load(Ordering::Relaxed) < 5 && std::time::Instant::now() < deadline) {
        let seed = rounds as u8;
        src.copy_from_slice(&pattern(1 << 16, seed));
        p.a.post_send(SendRequest::write(Local::whole(src), target.remote())).unwrap();
        let mut c = poll_one(&mut p.cq_a);
        assert_eq!(c.status(), WcStatus::SUCCESS, "{c:?}");
        src = c.take_region().unwrap();
        let want = pattern(1 << 16, seed);
        // On iWARP an RDMA Write completes once TCP took it: its bytes land a moment later.
        let landed = std::time::Instant::now() + scaled(Duration::from_secs(5));
        while is_iwarp() && target.to_vec() != want && std::time::Instant::now() < landed {
            std::thread::yield_now();
        }
        assert!(target.to_vec() == want, "round {rounds}: bytes differ after a fork");
        rounds += 1;
        if rounds >= 400 {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let children = forker.join().unwrap();
    println!("{rounds} verified 64 KiB writes while {children} children forked and exec'd");
    assert!(children > 0 && rounds >= 20);
}

/// A prepared request over a region registered with an IOVA never goes inline: the provider
/// copies inline data with the CPU from the entry's address, which for such a region is the
/// IOVA, not where the bytes are (rxe and mlx5 would read whatever lives at the IOVA, or fault).
#[test]
fn prepared_posts_over_an_iova_region_are_not_copied_from_the_iova() {
    let mut p = pair(ibverbs::QpType::RC, 8, 1, 64);
    let src = match p.pd.register_iova(page_buf(4096), IOVA + 0x50_0000, AccessFlags::LOCAL_WRITE) {
        Err(Error::Unsupported { capability: IOVA_ELSEWHERE, .. }) => {
            return unsupported(&p.ctx, "IOVA registration", "siw registers every region at its address");
        }
        r => r.unwrap(),
    };
    let mut src = src;
    src.copy_from_slice(&pattern(4096, 3));
    let src = Arc::new(src);
    assert!(p.a.caps().max_inline_data >= 8, "{:?}", p.a.caps());
    let target = p.pd.allocate_remote(4096, AccessFlags::REMOTE_WRITE).unwrap();
    let prepared = p.a.prepare_send(SendRequest::write(Local::whole(src.clone()), target.remote())).unwrap();
    // 8 bytes: below max_inline_data, the size a prepared post over a plain region sends inline.
    p.a.post_prepared(&prepared, 1, 100, 8, 16).unwrap();
    let c = poll_one(&mut p.cq_a);
    assert_eq!((c.wr_id(), c.status()), (1, WcStatus::SUCCESS), "{c:?}");
    assert_eq!(
        &target.to_vec()[16..24],
        &pattern(4096, 3)[100..108],
        "the bytes at offset 100 of the region"
    );
}
