//! Quick start: two RC queue pairs on one device, connected to each other, move bytes with an
//! RDMA Write and a Send/Recv. Run it where an RDMA device exists: `cargo xtask rxe -- target/debug/examples/quickstart`.
use std::sync::Arc;

use ibverbs::{AccessFlags, Completion, ConnectOptions, Context, Local, QpType, RecvRequest, SendRequest};

fn main() -> ibverbs::Result<()> {
    let ctx = Context::open(None)?; // the first device, e.g. rxe0
    let pd = ctx.alloc_pd()?;
    let mut cq = ctx.create_cq(64, None)?;
    let mut a = pd.create_qp(&cq, QpType::RC).max_send_wr(16).max_recv_wr(16).build()?;
    let mut b = pd.create_qp(&cq, QpType::RC).max_send_wr(16).max_recv_wr(16).build()?;

    // Exchange endpoints (here in-process; between hosts, send `Endpoint::encode()` over TCP).
    let opts = ConnectOptions::default();
    let (ea, eb) = (a.endpoint(&opts)?, b.endpoint(&opts)?);
    a.connect(&eb, &opts)?;
    b.connect(&ea, &opts)?;

    // RDMA Write into memory that b exposes for remote writing.
    let target = Arc::new(pd.allocate_remote(4096, AccessFlags::REMOTE_WRITE)?);
    let mut src = pd.allocate(11)?;
    src.copy_from_slice(b"hello, rdma");
    a.post_send(SendRequest::write(Local::whole(src), target.remote()).wr_id(1))?;

    // Send/Recv: the buffers move into the queue pair and come back with the completions.
    b.post_recv(RecvRequest::new(Local::whole(pd.allocate(64)?)).wr_id(2))?;
    a.post_send(SendRequest::send_inline(b"").imm(42).wr_id(3))?;

    let mut done = 0;
    let mut wcs: [Completion; 4] = Default::default();
    while done < 3 {
        for wc in cq.poll(&mut wcs)? {
            assert!(wc.is_ok(), "{wc:?}");
            if wc.wr_id() == 2 {
                println!("received immediate {:?}", wc.imm_data());
            }
            done += 1;
        }
    }
    let mut out = [0u8; 11];
    target.read(0, &mut out)?;
    println!("remote memory now holds {:?}", String::from_utf8_lossy(&out));
    Ok(())
}
