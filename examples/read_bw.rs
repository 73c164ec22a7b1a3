//! RDMA Read bandwidth, like perftest's `ib_read_bw`.
//!
//! Server: `read_bw -d rxe0 -x 1`; client: `read_bw -d rxe0 -x 1 SERVER`. The client reads `-n`
//! messages of `-s` bytes per queue pair from the server's buffer, keeping `-t` in flight (the
//! device itself keeps at most the queue pair's RDMA Read depth, `max_rd_atomic`, on the wire: the
//! device's maximum here, as perftest). The server is passive; both print the client's table.

#[path = "perf/mod.rs"]
mod perf;

use std::process::ExitCode;

use perf::bw::{run_one_sided, Op};
use perf::TestKind;

fn main() -> ExitCode {
    perf::main(TestKind::ReadBw, |s| run_one_sided(s, Op::Read))
}
