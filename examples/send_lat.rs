//! Send latency, like perftest's `ib_send_lat`.
//!
//! Server: `send_lat -d rxe0 -x 1`; client: `send_lat -d rxe0 -x 1 SERVER`. A ping-pong of Sends
//! with receives posted ahead (`-r`, reposted as they are consumed): the client sends, the server
//! answers each message it receives, and so on. Sends request a completion every `-Q` messages
//! (with the default tx depth of 1: every one), which is polled before going on, as perftest.
//! Latency is half the time between consecutive sends.

#[path = "perf/mod.rs"]
mod perf;

use std::process::ExitCode;
use std::ptr;

use ibverbs::raw::{self, RawRecv, RawSend};
use ibverbs::{AccessFlags, Completion, RecvRequest, RemoteSlice, SendRequest, WcStatus, WorkCompletion};
use perf::clock::ticks;
use perf::report::lat_report;
use perf::{Buf, Guard, Level, Role, RunSpec, Session, TestKind};

fn main() -> ExitCode {
    perf::main(TestKind::SendLat, run)
}

fn run(s: &mut Session) -> Result<(), String> {
    let len = s.buf_len();
    let src = Buf::Ro(s.alloc_ro(len, AccessFlags::LOCAL_WRITE)?);
    // Receive buffer shared by every posted receive: device-written, never read here.
    let dst = Buf::Rw(s.alloc_rw(len, AccessFlags::LOCAL_WRITE)?);
    s.exchange(&[RemoteSlice { addr: 0, len: 0, rkey: 0 }])?;
    while let Some(spec) = s.next_run()? {
        let initiator = s.role == Role::Client;
        let mut guard = s.guard();
        let tposted = match spec.level {
            Level::Safe => safe_loop(s, &spec, &src, &dst, initiator, &mut guard)?,
            Level::Raw => raw_loop(s, &spec, &src, &dst, initiator, &mut guard)?,
        };
        s.finish(None)?;
        s.oob.beat(); // the report (its sort of the samples) sends nothing
        s.clock.recalibrate();
        s.print_lat(&lat_report(spec.size, &tposted, &s.clock));
    }
    Ok(())
}

fn status_error(what: &str, status: WcStatus, n: u64) -> String {
    format!("{what} completion with status {status} (iteration {n})")
}

/// The loop at the safe level: `post_prepared_recv` of a receive prepared over the receive buffer,
/// `post_prepared` of the run's two prepared Sends (signaled and not; inline up to `-I` bytes,
/// as prepared Sends from an `Arc<MemoryRegion>` are), `CompletionQueue::poll`.
fn safe_loop(
    s: &mut Session,
    spec: &RunSpec,
    src: &Buf,
    dst: &Buf,
    initiator: bool,
    guard: &mut Guard,
) -> Result<Vec<u64>, String> {
    let (iters, size) = (spec.iters, spec.size as usize);
    let role = s.role;
    let r = &mut s.rdma;
    let (qp, send_cq, recv_cq) = (&mut r.qps[0], &mut r.send_cq, &mut r.recv_cq);
    // The receive, prepared once over the whole buffer: each post lands the message at 0.
    let whole_dst = dst.local(0..dst.len()).map_err(|e| e.to_string())?;
    let prepared_recv =
        qp.prepare_recv(RecvRequest::new(whole_dst)).map_err(|e| format!("prepare_recv: {}", e.error))?;
    let recv = |qp: &mut ibverbs::QueuePair, k: u64| {
        qp.post_prepared_recv(&prepared_recv, k, 0, size as u32)
            .map_err(|e| format!("post_prepared_recv: {e}"))
    };
    // Prepared once per run: every post changes only its wr_id (and sends the first `size`
    // bytes).
    let prepare = |qp: &ibverbs::QueuePair, wr: SendRequest<'static>| {
        qp.prepare_send(wr).map_err(|e| format!("prepare_send: {}", e.error))
    };
    let whole = || src.local(0..src.len()).map_err(|e| e.to_string());
    let signaled_send = prepare(qp, SendRequest::send(whole()?))?;
    let unsignaled_send = prepare(qp, SendRequest::send(whole()?).unsignaled())?;
    let mut posted = 0u64;
    while posted < spec.rx_depth {
        recv(qp, posted)?;
        posted += 1;
    }
    perf::ready(role, &mut s.oob)?;
    let mut tposted = perf::memory::zeroed_vec::<u64>(iters, "the timestamps")?;
    let mut comps = [Completion::default()];
    let (mut scnt, mut rcnt) = (0u64, 0u64);
    guard.start("waiting for the peer's message");
    while scnt < iters || rcnt < iters {
        if rcnt < iters && !(initiator && scnt == 0) {
            let c = loop {
                let got = recv_cq.poll(&mut comps).map_err(|e| e.to_string())?;
                if let Some(c) = got.first_mut() {
                    break c;
                }
                guard.idle()?;
            };
            guard.progress(ticks())?;
            if c.status() != WcStatus::SUCCESS {
                return Err(guard.annotate(status_error("receive", c.status(), rcnt)));
            }
            rcnt += 1;
            if posted < iters {
                recv(qp, posted)?;
                posted += 1;
            }
        }
        if scnt < iters {
            tposted[scnt as usize] = ticks();
            scnt += 1;
            let signaled = scnt % spec.cq_mod == 0 || scnt == iters;
            let p = if signaled { &signaled_send } else { &unsignaled_send };
            qp.post_prepared(p, scnt, 0, size as u32, 0).map_err(|e| format!("post_prepared: {e}"))?;
            if signaled {
                let c = loop {
                    let got = send_cq.poll(&mut comps).map_err(|e| e.to_string())?;
                    if let Some(c) = got.first_mut() {
                        break c;
                    }
                    guard.idle()?;
                };
                if c.status() != WcStatus::SUCCESS {
                    return Err(guard.annotate(status_error("send", c.status(), scnt)));
                }
            }
        }
    }
    Ok(tposted)
}

/// The loop at the raw level: prebuilt `ibv_recv_wr`/`ibv_send_wr` posted with
/// `post_recv_unchecked`/`post_send_unchecked`, `poll_raw`.
fn raw_loop(
    s: &mut Session,
    spec: &RunSpec,
    src: &Buf,
    dst: &Buf,
    initiator: bool,
    guard: &mut Guard,
) -> Result<Vec<u64>, String> {
    let (iters, size) = (spec.iters, spec.size as usize);
    let mut rsge = [raw::sge(dst.addr(), size as u32, dst.lkey())];
    let mut rwr = RawRecv::new(0, &mut rsge);
    let mut ssge = [raw::sge(src.addr(), size as u32, src.lkey())];
    let mut swr = RawSend::send().sg_list(&mut ssge).inline(size <= spec.inline as usize);
    let role = s.role;
    let r = &s.rdma;
    let (qp, send_cq, recv_cq) = (&r.qps[0], &r.send_cq, &r.recv_cq);
    let mut post_recv = |k: u64| -> Result<(), String> {
        rwr.set_wr_id(k);
        let mut bad = ptr::null_mut();
        // SAFETY: one receive of `size` bytes into `dst`, a RemoteMemoryRegion nobody holds
        // references into, kept registered by the session until the QP is destroyed; bit 63 clear.
        unsafe { qp.post_recv_unchecked(rwr.as_mut_ptr(), &mut bad) }
            .map_err(|e| format!("post_recv_unchecked: {e}"))
    };
    let mut posted = 0u64;
    while posted < spec.rx_depth {
        post_recv(posted)?;
        posted += 1;
    }
    perf::ready(role, &mut s.oob)?;
    let mut tposted = perf::memory::zeroed_vec::<u64>(iters, "the timestamps")?;
    let mut wc = [WorkCompletion::default()];
    let (mut scnt, mut rcnt) = (0u64, 0u64);
    guard.start("waiting for the peer's message");
    while scnt < iters || rcnt < iters {
        if rcnt < iters && !(initiator && scnt == 0) {
            while recv_cq.poll_raw(&mut wc).map_err(|e| e.to_string())?.is_empty() {
                guard.idle()?;
            }
            guard.progress(ticks())?;
            if !wc[0].is_ok() {
                return Err(guard.annotate(status_error("receive", wc[0].status(), rcnt)));
            }
            rcnt += 1;
            if posted < iters {
                post_recv(posted)?;
                posted += 1;
            }
        }
        if scnt < iters {
            tposted[scnt as usize] = ticks();
            scnt += 1;
            let signaled = scnt % spec.cq_mod == 0 || scnt == iters;
            swr.set_wr_id(scnt);
            swr.set_signaled(signaled);
            let mut bad = ptr::null_mut();
            // SAFETY: one send of `size` bytes from `src` (registered in this PD, kept registered
            // by the session until the QP is destroyed, never written); bit 63 clear.
            unsafe { qp.post_send_unchecked(swr.as_mut_ptr(), &mut bad) }
                .map_err(|e| format!("post_send_unchecked: {e}"))?;
            if signaled {
                while send_cq.poll_raw(&mut wc).map_err(|e| e.to_string())?.is_empty() {
                    guard.idle()?;
                }
                if !wc[0].is_ok() {
                    return Err(guard.annotate(status_error("send", wc[0].status(), scnt)));
                }
            }
        }
    }
    Ok(tposted)
}
