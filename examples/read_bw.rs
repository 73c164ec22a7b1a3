//! RDMA Read bandwidth, like perftest's `ib_read_bw`.
//!
//! Server: `read_bw -d rxe0 -x 1`; client: `read_bw -d rxe0 -x 1 SERVER`. The client reads `-n`
//! messages of `-s` bytes per queue pair from the server's buffer, keeping `-t` in flight (the
//! device itself keeps at most the queue pair's RDMA Read depth, `max_rd_atomic`, on the wire: the
//! device's maximum here, as perftest). The server is passive; both print the client's table.

#[path = "perf/mod.rs"]
mod perf;

use std::process::ExitCode;

use ibverbs::{AccessFlags, RemoteSlice};
use perf::bw::{self, Op, RawPath, SafePath};
use perf::report::bw_report;
use perf::{Buf, Level, Role, Session, TestKind};

fn main() -> ExitCode {
    perf::main(TestKind::ReadBw, run)
}

fn run(s: &mut Session) -> Result<(), String> {
    let len = s.buf_len();
    let qps = s.params.qps as usize;
    let mut bufs = Vec::with_capacity(qps);
    for _ in 0..qps {
        bufs.push(match s.role {
            // The device writes what it reads into a device-writable region.
            Role::Client => Buf::Rw(s.alloc_rw(len, AccessFlags::LOCAL_WRITE)?),
            // Peers may read a local-only region: reading never changes it.
            Role::Server => Buf::Ro(s.alloc_ro(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?),
        });
    }
    let local: Vec<RemoteSlice> = match s.role {
        Role::Client => vec![RemoteSlice { addr: 0, len: 0, rkey: 0 }; qps],
        Role::Server => bufs.iter().map(Buf::remote).collect(),
    };
    let remote = s.exchange(&local)?;
    while let Some(spec) = s.next_run()? {
        s.ready()?;
        if s.role == Role::Server {
            if let Some(r) = s.finish(None)? {
                s.print_bw(&r);
            }
            continue;
        }
        let mut guard = s.guard();
        let times = match spec.level {
            Level::Safe => {
                let r = &mut s.rdma;
                let mut path = SafePath::new(&mut r.qps, &mut r.send_cq, &bufs, &remote, Op::Read, spec);
                bw::run_sender(&mut path, &spec, &mut guard)?
            }
            Level::Raw => {
                let r = &s.rdma;
                let mut path = RawPath::new(&r.qps, &r.send_cq, &bufs, &remote, Op::Read, spec);
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
