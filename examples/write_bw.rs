//! RDMA Write bandwidth, like perftest's `ib_write_bw`.
//!
//! Server: `write_bw -d rxe0 -x 1`; client: `write_bw -d rxe0 -x 1 SERVER`. The client writes
//! `-n` messages of `-s` bytes per queue pair into the server's buffer, keeping `-t` in flight;
//! the server is passive. Both print the client's result table (as perftest does).

#[path = "perf/mod.rs"]
mod perf;

use std::process::ExitCode;

use ibverbs::{AccessFlags, RemoteSlice};
use perf::bw::{self, Op, RawPath, SafePath};
use perf::report::bw_report;
use perf::{Buf, Level, Role, Session, TestKind};

fn main() -> ExitCode {
    perf::main(TestKind::WriteBw, run)
}

fn run(s: &mut Session) -> Result<(), String> {
    let len = s.buf_len();
    let qps = s.params.qps as usize;
    let mut bufs = Vec::with_capacity(qps);
    for _ in 0..qps {
        bufs.push(match s.role {
            Role::Client => Buf::Ro(s.alloc_ro(len, AccessFlags::LOCAL_WRITE)?),
            Role::Server => Buf::Rw(s.alloc_rw(len, AccessFlags::REMOTE_WRITE)?),
        });
    }
    // The client's buffers are not exposed: it sends empty descriptors.
    let local: Vec<RemoteSlice> = match s.role {
        Role::Client => vec![RemoteSlice { addr: 0, len: 0, rkey: 0 }; qps],
        Role::Server => bufs.iter().map(Buf::remote).collect(),
    };
    let remote = s.exchange(&local)?;
    while let Some(spec) = s.next_run()? {
        s.ready()?;
        if s.role == Role::Server {
            // Passive: the client reports, we print its numbers.
            if let Some(r) = s.finish(None)? {
                s.print_bw(&r);
            }
            continue;
        }
        let mut guard = s.guard();
        let times = match spec.level {
            Level::Safe => {
                let r = &mut s.rdma;
                let mut path = SafePath::new(&mut r.qps, &mut r.send_cq, &bufs, &remote, Op::Write, spec);
                bw::run_sender(&mut path, &spec, &mut guard)?
            }
            Level::Raw => {
                let r = &s.rdma;
                let mut path = RawPath::new(&r.qps, &r.send_cq, &bufs, &remote, Op::Write, spec);
                bw::run_sender(&mut path, &spec, &mut guard)?
            }
        };
        s.clock.recalibrate();
        let report = bw_report(
            spec.size,
            &times.tposted,
            &times.tcompleted,
            spec.post_list as usize,
            spec.cq_mod as usize,
            &s.clock,
        );
        s.finish(Some(&report))?;
        s.print_bw(&report);
    }
    Ok(())
}
