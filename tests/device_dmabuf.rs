//! dma-buf regions at the safe level: a real dma-buf made with Linux's `udmabuf` (a memfd turned
//! into a dma-buf), registered with `ibv_reg_dmabuf_mr`, and posted from and into as an
//! `Arc<DmabufRegion>` with the data checked through the memfd. Where the device refuses dma-buf
//! registration (SoftRoCE and siw on Linux 6.1 have no `reg_user_mr_dmabuf`) the typed
//! `Error::Unsupported` is what is checked, and the test reports it; a kernel without `udmabuf`
//! (Debian's 6.1: `CONFIG_UDMABUF` is not set) is reported as such.

mod common;

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use common::*;
use ibverbs::{AccessFlags, DmabufRegion, Error, Local, LocalBuf, RecvRequest, SendRequest};

const LEN: usize = 1 << 16;

/// `UDMABUF_CREATE` (`linux/udmabuf.h`): `_IOW('u', 0x42, struct udmabuf_create)`, 24 bytes.
const UDMABUF_CREATE: libc::c_ulong = 0x4018_7542;
const UDMABUF_FLAGS_CLOEXEC: u32 = 1;

#[repr(C)]
struct UdmabufCreate {
    memfd: u32,
    flags: u32,
    offset: u64,
    size: u64,
}

/// A sealed memfd of `LEN` bytes and the dma-buf `udmabuf` made of it, or why not.
fn udmabuf() -> Result<(OwnedFd, OwnedFd), String> {
    // SAFETY: a NUL-terminated literal name; a fresh descriptor.
    let memfd = unsafe { libc::memfd_create(c"ibverbs-udmabuf".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(memfd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: just opened, owned here.
    let memfd = unsafe { OwnedFd::from_raw_fd(memfd) };
    // SAFETY: a valid descriptor; resizing and sealing a memfd touch no memory of ours.
    unsafe {
        assert_eq!(libc::ftruncate(memfd.as_raw_fd(), LEN as i64), 0);
        assert_eq!(libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
    }
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/udmabuf")
        .map_err(|e| format!("/dev/udmabuf: {e} (a kernel without CONFIG_UDMABUF, as Debian's 6.1)"))?;
    let arg = UdmabufCreate {
        memfd: memfd.as_raw_fd() as u32,
        flags: UDMABUF_FLAGS_CLOEXEC,
        offset: 0,
        size: LEN as u64,
    };
    // SAFETY: UDMABUF_CREATE reads a `struct udmabuf_create`, which `arg` is, for the call.
    let fd = unsafe { libc::ioctl(dev.as_raw_fd(), UDMABUF_CREATE, &arg) };
    if fd < 0 {
        return Err(format!("UDMABUF_CREATE: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the ioctl returned a new descriptor, owned here.
    Ok((memfd, unsafe { OwnedFd::from_raw_fd(fd) }))
}

fn pread(fd: &OwnedFd, offset: usize, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    // SAFETY: `buf` is valid for `len` bytes.
    let n = unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), len, offset as i64) };
    assert_eq!(n, len as isize);
    buf
}

fn pwrite(fd: &OwnedFd, offset: usize, data: &[u8]) {
    // SAFETY: `data` is valid for its length.
    let n = unsafe { libc::pwrite(fd.as_raw_fd(), data.as_ptr().cast(), data.len(), offset as i64) };
    assert_eq!(n, data.len() as isize);
}

#[test]
fn a_udmabuf_registered_and_posted_from_and_into_safely() {
    let Pair { pd, mut cq_a, mut cq_b, mut a, mut b, ctx, cm: _cm } = rc_pair(8);
    let (memfd, dmabuf) = match udmabuf() {
        Ok(fds) => fds,
        Err(why) => {
            unsupported(&ctx, "udmabuf (a memfd as a dma-buf)", why);
            return;
        }
    };
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let region: DmabufRegion = match pd.register_dmabuf(dmabuf.as_fd(), 0, LEN, 0x1000_0000, access) {
        Ok(r) => r,
        Err(e @ Error::Unsupported { verb: "ibv_reg_dmabuf_mr", .. }) => {
            // The kernel made a real dma-buf; the device has no dma-buf registration.
            unsupported(&ctx, "dma-buf registration of a real dma-buf (udmabuf)", e);
            return;
        }
        Err(e) => panic!("ibv_reg_dmabuf_mr of a udmabuf: {e}"),
    };
    drop(dmabuf); // the registration holds the kernel's reference
    assert_eq!((region.len(), region.iova()), (LEN, 0x1000_0000));
    let region = Arc::new(region);
    let pattern_out = pattern(4096, 3);
    pwrite(&memfd, 0, &pattern_out);
    // The peer's memory, remote-writable and readable.
    let peer =
        Arc::new(pd.allocate_remote(8192, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap());
    peer.write(4096, &pattern(4096, 9)).unwrap();

    // RDMA Write from the dma-buf (shared, so unsignaled is allowed too), Read into it.
    let src = Local::new(region.clone(), 0..4096).unwrap();
    a.post_send(SendRequest::write(src, peer.remote().slice(0, 4096).unwrap()).wr_id(1)).unwrap();
    let dst = Local::new(region.clone(), 8192..12288).unwrap();
    a.post_send(SendRequest::read(dst, peer.remote().slice(4096, 4096).unwrap()).wr_id(2)).unwrap();
    let done = poll_n(&mut cq_a, 2);
    assert!(done.iter().all(|c| c.is_ok()), "{done:?}");
    assert_eq!(done.iter().map(|c| c.wr_id()).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(peer.to_vec()[..4096], pattern_out[..], "written from the dma-buf");
    assert_eq!(pread(&memfd, 8192, 4096), pattern(4096, 9), "read into the dma-buf");

    // A Send received into the dma-buf.
    a.post_recv(RecvRequest::new(Local::new(region.clone(), 16384..16392).unwrap()).wr_id(3)).unwrap();
    b.post_send(SendRequest::send_inline(b"dma-buf!").wr_id(4)).unwrap();
    let mut c = poll_one(&mut cq_a);
    assert!(c.is_ok() && c.wr_id() == 3 && c.byte_len() == 8, "{c:?}");
    assert!(c.take_buffers().all(|buf| matches!(buf, LocalBuf::Dmabuf(_))));
    assert!(poll_one(&mut cq_b).is_ok());
    assert_eq!(pread(&memfd, 16384, 8), b"dma-buf!");
    assert_eq!(Arc::strong_count(&region), 1, "every post gave its handle back");

    // Registered without LOCAL_WRITE, it is no target of the device's writes (refused before
    // the post), and still a source.
    let (_memfd, dmabuf) = udmabuf().expect("a second udmabuf");
    let ro = Arc::new(pd.register_dmabuf(dmabuf.as_fd(), 0, LEN, 0, AccessFlags::empty()).unwrap());
    let e = a.post_recv(RecvRequest::new(Local::new(ro.clone(), 0..8).unwrap())).unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }), "{:?}", e.error);
    let e = a.post_send(SendRequest::read(
        Local::new(ro.clone(), 0..8).unwrap(),
        peer.remote().slice(0, 8).unwrap(),
    ));
    assert!(matches!(e.unwrap_err().error, Error::InvalidArgument { .. }));
    a.post_send(
        SendRequest::write(Local::new(ro, 0..8).unwrap(), peer.remote().slice(0, 8).unwrap()).wr_id(5),
    )
    .unwrap();
    assert!(poll_one(&mut cq_a).is_ok());
}
