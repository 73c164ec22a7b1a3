//! RDMA Write latency, like perftest's `ib_write_lat`.
//!
//! Server: `write_lat -d rxe0 -x 1`; client: `write_lat -d rxe0 -x 1 SERVER`. A ping-pong of RDMA
//! Writes: each side writes `-s` bytes into the other's buffer, the last byte carrying an
//! iteration counter, and polls the last byte of its own buffer until the peer's write with the
//! next counter lands, then writes back. Latency is half the time between consecutive writes.
//!
//! The polled buffer is a `RemoteMemoryRegion` (the peer writes it at any time). At the safe
//! level its last byte is polled through a `RemoteByte` (bounds-checked once, then one atomic
//! load per turn); the source buffer is a local-only `RemoteMemoryRegion` (for its `RemoteByte`
//! store of the counter), and each run prepares one request over it (`prepare_send`) that
//! every iteration posts with `post_prepared`. Messages of at most `-I` bytes (perftest's
//! inline size) go inline: one request prepared from `SendRequest::write_inline`, each
//! iteration's bytes posted with `post_prepared_inline`.

#[path = "perf/mod.rs"]
mod perf;

use std::process::ExitCode;
use std::ptr;
use std::sync::Arc;

use ibverbs::raw::{self, RawSend};
use ibverbs::{
    AccessFlags, Completion, Local, RemoteMemoryRegion, RemoteSlice, SendRequest, WcStatus, WorkCompletion,
};
use perf::clock::ticks;
use perf::report::lat_report;
use perf::{Guard, Level, Role, RunSpec, Session, TestKind};

fn main() -> ExitCode {
    perf::main(TestKind::WriteLat, run)
}

fn run(s: &mut Session) -> Result<(), String> {
    let len = s.buf_len();
    let recv = s.alloc_rw(len, AccessFlags::REMOTE_WRITE)?;
    // The source: written between writes (never while one is in flight: the loop polls each
    // write's completion before the next); a RemoteMemoryRegion only for that interior
    // mutability, it is not exposed. The raw level stores into it with volatile writes, the safe
    // level copies in with `RemoteMemoryRegion::write`.
    let src = s.alloc_rw(len, AccessFlags::LOCAL_WRITE)?;
    let remote = s.exchange(&[recv.remote()])?[0];
    let zeros = vec![0u8; len.min(1 << 16)];
    while let Some(spec) = s.next_run()? {
        // No write of this run can arrive before we say ready (server) or post first (client).
        for start in (0..spec.size as usize).step_by(zeros.len()) {
            let n = zeros.len().min(spec.size as usize - start);
            recv.write(start, &zeros[..n]).map_err(|e| e.to_string())?;
        }
        s.ready()?;
        let dst = remote.slice(0, spec.size).map_err(|e| format!("the peer's buffer is too small: {e}"))?;
        let initiator = s.role == Role::Client;
        let mut guard = s.guard();
        let tposted = match spec.level {
            Level::Safe => safe_loop(s, &spec, &recv, &src, dst, initiator, &mut guard)?,
            Level::Raw => raw_loop(s, &spec, &recv, &src, dst, initiator, &mut guard)?,
        };
        s.finish(None)?;
        s.oob.beat(); // the report (its sort of the samples) sends nothing
        s.clock.recalibrate();
        s.print_lat(&lat_report(spec.size, &tposted, &s.clock));
    }
    Ok(())
}

/// The loop at the safe level: `RemoteByte::load` to poll, `post_prepared` of the run's
/// prepared write (`post_prepared_inline` of its prepared inline write for small messages),
/// `CompletionQueue::poll`.
fn safe_loop(
    s: &mut Session,
    spec: &RunSpec,
    recv: &RemoteMemoryRegion,
    src: &Arc<RemoteMemoryRegion>,
    dst: RemoteSlice,
    initiator: bool,
    guard: &mut Guard,
) -> Result<Vec<u64>, String> {
    let (iters, size) = (spec.iters, spec.size as usize);
    let inline = size <= spec.inline as usize;
    let mut inline_data = vec![0u8; size];
    let mut tposted = perf::memory::zeroed_vec::<u64>(iters, "the timestamps")?;
    let mut comps = [Completion::default()];
    let qp = &mut s.rdma.qps[0];
    let cq = &mut s.rdma.send_cq;
    let prepared = if inline {
        qp.prepare_send(SendRequest::write_inline(&inline_data, dst))
    } else {
        qp.prepare_send(SendRequest::write(Local::new(src.clone(), 0..size).map_err(|e| e.to_string())?, dst))
    }
    .map_err(|e| format!("prepare_send: {}", e.error))?;
    // The counter bytes, checked once (size <= buffer length).
    let poll_byte = recv.byte(size - 1).map_err(|e| e.to_string())?;
    let post_byte = src.byte(size - 1).map_err(|e| e.to_string())?;
    let (mut scnt, mut rcnt, mut ccnt) = (0u64, 0u64, 0u64);
    guard.start("waiting for the peer's write");
    while scnt < iters || rcnt < iters || ccnt < iters {
        if rcnt < iters && !(initiator && scnt == 0) {
            rcnt += 1;
            let want = rcnt as u8;
            while poll_byte.load() != want {
                guard.idle()?;
            }
            guard.progress(ticks())?;
        }
        if scnt < iters {
            tposted[scnt as usize] = ticks();
            scnt += 1;
            if inline {
                inline_data[size - 1] = scnt as u8;
                qp.post_prepared_inline(&prepared, scnt, &inline_data, 0)
                    .map_err(|e| format!("post_prepared_inline: {e}"))?;
            } else {
                // The previous write's completion was polled: nothing reads the buffer now.
                post_byte.store(scnt as u8);
                qp.post_prepared(&prepared, scnt, 0, size as u32, 0)
                    .map_err(|e| format!("post_prepared: {e}"))?;
            }
        }
        if ccnt < iters {
            let c = loop {
                let got = cq.poll(&mut comps).map_err(|e| e.to_string())?;
                if let Some(c) = got.first_mut() {
                    break c;
                }
                guard.idle()?;
            };
            if c.status() != WcStatus::SUCCESS {
                let msg = format!("write completion with status {} (iteration {})", c.status(), c.wr_id());
                return Err(guard.annotate(msg));
            }
            ccnt += 1;
        }
    }
    Ok(tposted)
}

/// The loop at the raw level: volatile loads of the polled byte, one prebuilt `ibv_send_wr`
/// posted with `post_send_unchecked`, `poll_raw`.
fn raw_loop(
    s: &Session,
    spec: &RunSpec,
    recv: &RemoteMemoryRegion,
    src: &Arc<RemoteMemoryRegion>,
    dst: RemoteSlice,
    initiator: bool,
    guard: &mut Guard,
) -> Result<Vec<u64>, String> {
    let (iters, size) = (spec.iters, spec.size as usize);
    let mut sge = [raw::sge(src.addr() as u64, size as u32, src.lkey())];
    let mut wr = RawSend::write(dst).sg_list(&mut sge).inline(size <= spec.inline as usize);
    // The counter bytes: in bounds (size <= buffer length).
    let poll_byte = recv.addr().wrapping_add(size - 1).cast_const();
    let post_byte = src.addr().wrapping_add(size - 1);
    let mut wc = [WorkCompletion::default()];
    let mut tposted = perf::memory::zeroed_vec::<u64>(iters, "the timestamps")?;
    let qp = &s.rdma.qps[0];
    let cq = &s.rdma.send_cq;
    let (mut scnt, mut rcnt, mut ccnt) = (0u64, 0u64, 0u64);
    guard.start("waiting for the peer's write");
    while scnt < iters || rcnt < iters || ccnt < iters {
        if rcnt < iters && !(initiator && scnt == 0) {
            rcnt += 1;
            let want = rcnt as u8;
            // SAFETY: `poll_byte` lies inside `recv`, alive for the whole loop; the peer writes it
            // by DMA, so it is only read with volatile loads and never through a reference.
            while unsafe { ptr::read_volatile(poll_byte) } != want {
                guard.idle()?;
            }
            guard.progress(ticks())?;
        }
        if scnt < iters {
            tposted[scnt as usize] = ticks();
            scnt += 1;
            // SAFETY: inside `src`; the previous write from it has completed (polled below before
            // the next iteration), so the device is not reading it.
            unsafe { ptr::write_volatile(post_byte, scnt as u8) };
            wr.set_wr_id(scnt);
            let mut bad = ptr::null_mut();
            // SAFETY: one write of `size` bytes from `src` (registered in this PD, kept registered
            // by the session until the QP is destroyed, untouched until the completion is polled)
            // into the peer's buffer as it described it; wr_id bit 63 clear.
            unsafe { qp.post_send_unchecked(wr.as_mut_ptr(), &mut bad) }
                .map_err(|e| format!("post_send_unchecked: {e}"))?;
        }
        if ccnt < iters {
            while cq.poll_raw(&mut wc).map_err(|e| e.to_string())?.is_empty() {
                guard.idle()?;
            }
            if !wc[0].is_ok() {
                let msg =
                    format!("write completion with status {} (iteration {})", wc[0].status(), wc[0].wr_id());
                return Err(guard.annotate(msg));
            }
            ccnt += 1;
        }
    }
    Ok(tposted)
}
