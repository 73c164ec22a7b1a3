//! RDMA Write bandwidth, like perftest's `ib_write_bw`.
//!
//! Server: `write_bw -d rxe0 -x 1`; client: `write_bw -d rxe0 -x 1 SERVER`. The client writes
//! `-n` messages of `-s` bytes per queue pair into the server's buffer, keeping `-t` in flight;
//! the server is passive. Both print the client's result table (as perftest does).

#[path = "perf/mod.rs"]
mod perf;

use std::process::ExitCode;

use perf::bw::{run_one_sided, Op};
use perf::TestKind;

fn main() -> ExitCode {
    perf::main(TestKind::WriteBw, |s| run_one_sided(s, Op::Write))
}
