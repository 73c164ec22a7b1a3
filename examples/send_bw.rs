//! Send bandwidth, like perftest's `ib_send_bw`.
//!
//! Server: `send_bw -d rxe0 -x 1`; client: `send_bw -d rxe0 -x 1 SERVER`. The client sends `-n`
//! messages of `-s` bytes per queue pair, keeping `-t` in flight; the server keeps `-r` receives
//! posted per queue pair, reposting one per message taken. Each side prints its own measurement
//! (the server's from its first to its last receive, without a peak: perftest prints 0.00).

#[path = "perf/mod.rs"]
mod perf;

use std::process::ExitCode;

use ibverbs::{AccessFlags, RemoteSlice};
use perf::bw::{self, Op, RawPath, SafePath};
use perf::report::rx_bw_report;
use perf::{Buf, Level, Role, RunSpec, Session, TestKind};

fn main() -> ExitCode {
    perf::main(TestKind::SendBw, run)
}

fn run(s: &mut Session) -> Result<(), String> {
    let len = s.buf_len();
    let qps = s.params.qps as usize;
    let mut bufs = Vec::with_capacity(qps);
    for _ in 0..qps {
        bufs.push(match s.role {
            Role::Client => Buf::Ro(s.alloc_ro(len, AccessFlags::LOCAL_WRITE)?),
            // Receive buffers are written by the device while many receives share them.
            Role::Server => Buf::Rw(s.alloc_rw(len, AccessFlags::LOCAL_WRITE)?),
        });
    }
    let none = vec![RemoteSlice { addr: 0, len: 0, rkey: 0 }; qps];
    s.exchange(&none)?;
    while let Some(spec) = s.next_run()? {
        match s.role {
            Role::Server => server_run(s, &bufs, spec)?,
            Role::Client => client_run(s, &bufs, spec)?,
        }
    }
    Ok(())
}

fn server_run(s: &mut Session, bufs: &[Buf], spec: RunSpec) -> Result<(), String> {
    let mut guard = s.guard();
    let role = s.role;
    let (first, last) = match spec.level {
        Level::Safe => {
            let r = &mut s.rdma;
            let mut path = SafePath::receiver(&mut r.qps, &mut r.recv_cq, bufs, spec)?;
            let pre = bw::prepost(&mut path, &spec)?;
            perf::ready(role, &mut s.oob)?;
            bw::run_receiver(&mut path, &spec, pre, &mut guard)?
        }
        Level::Raw => {
            let r = &s.rdma;
            let mut path = RawPath::new(&r.qps, &r.recv_cq, bufs, &[], Op::Send, spec);
            let pre = bw::prepost(&mut path, &spec)?;
            perf::ready(role, &mut s.oob)?;
            bw::run_receiver(&mut path, &spec, pre, &mut guard)?
        }
    };
    s.clock.recalibrate();
    let report = rx_bw_report(spec.size, spec.iters * spec.qps as u64, first, last, &s.clock);
    s.finish(Some(&report))?;
    s.print_bw(&report);
    Ok(())
}

fn client_run(s: &mut Session, bufs: &[Buf], spec: RunSpec) -> Result<(), String> {
    s.ready()?;
    bw::send_and_report(s, bufs, &[], Op::Send, spec)
}
