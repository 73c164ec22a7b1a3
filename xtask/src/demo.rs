//! `cargo xtask demo`: a few programs shown working over the device, in one VM boot.
//!
//! Each entry of [`DEMO`] is a title and a shell command line, run in order with `/bin/sh` in the
//! workspace root, where `$IBVERBS_TEST_DEVICE`, `$IBVERBS_TEST_GID_INDEX` and `$IBVERBS_TEST_IP` name the
//! device and `$TARGET_DIR` is cargo's target directory (the examples, built by `cargo build --examples`
//! before the VM boots, are in `$TARGET_DIR/debug/examples/`). To show another program, add a line.

use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use crate::vm::{self, Output, Step};
use crate::{cargo, shell};

/// The C `ibv_rc_pingpong` server and client over 127.0.0.1 (the client's output, then the server's).
/// Exits non-zero if either side fails. Also one of the harness's self-tests.
pub const RC_PINGPONG: &str = r#"gid=${IBVERBS_TEST_GID_INDEX:-0}
server_log=$(mktemp)
stdbuf -oL ibv_rc_pingpong -d "$IBVERBS_TEST_DEVICE" -g "$gid" >"$server_log" 2>&1 &
server=$!
n=0
until ss -ltn | grep -q ':18515 ' || [ "$n" -ge 100 ]; do n=$((n + 1)); sleep 0.1; done
echo "--- client: ibv_rc_pingpong -d $IBVERBS_TEST_DEVICE -g $gid 127.0.0.1"
stdbuf -oL ibv_rc_pingpong -d "$IBVERBS_TEST_DEVICE" -g "$gid" 127.0.0.1
client_rc=$?
wait "$server"
server_rc=$?
echo "--- server: ibv_rc_pingpong -d $IBVERBS_TEST_DEVICE -g $gid"
cat "$server_log"
rm -f "$server_log"
echo "--- client exit $client_rc, server exit $server_rc"
[ "$client_rc" -eq 0 ] && [ "$server_rc" -eq 0 ]
"#;

/// Our `rc_pingpong` example, server and client over 127.0.0.1 (the client's output, then the
/// server's). Exits non-zero if either side fails.
pub const OUR_RC_PINGPONG: &str = r#"ex="$TARGET_DIR/debug/examples"
gid=${IBVERBS_TEST_GID_INDEX:-0}
server_log=$(mktemp)
"$ex/rc_pingpong" -d "$IBVERBS_TEST_DEVICE" -g "$gid" -n 1000 >"$server_log" 2>&1 &
server=$!
n=0
until ss -ltn | grep -q ':18515 ' || [ "$n" -ge 100 ]; do n=$((n + 1)); sleep 0.1; done
echo "--- client: rc_pingpong -d $IBVERBS_TEST_DEVICE -g $gid -n 1000 127.0.0.1"
"$ex/rc_pingpong" -d "$IBVERBS_TEST_DEVICE" -g "$gid" -n 1000 127.0.0.1
client_rc=$?
wait "$server"
server_rc=$?
echo "--- server: rc_pingpong -d $IBVERBS_TEST_DEVICE -g $gid -n 1000"
cat "$server_log"
rm -f "$server_log"
echo "--- client exit $client_rc, server exit $server_rc"
[ "$client_rc" -eq 0 ] && [ "$server_rc" -eq 0 ]
"#;

/// The demo: (title, shell command line).
pub const DEMO: &[(&str, &str)] = &[
    (
        "devinfo: the device, as ibv_devinfo shows it",
        r#""$TARGET_DIR/debug/examples/devinfo" -d "$IBVERBS_TEST_DEVICE""#,
    ),
    ("rc_pingpong: an RC send/receive exchange (ours, both sides)", OUR_RC_PINGPONG),
    ("write_bw: RDMA Write bandwidth (ours, both sides)", OUR_WRITE_BW),
];

/// Our `write_bw` example, server and client over 127.0.0.1 (64 KiB messages).
pub const OUR_WRITE_BW: &str = r#"ex="$TARGET_DIR/debug/examples"
gid=${IBVERBS_TEST_GID_INDEX:-0}
server_log=$(mktemp)
"$ex/write_bw" -d "$IBVERBS_TEST_DEVICE" -x "$gid" -s 65536 -n 2000 >"$server_log" 2>&1 &
server=$!
n=0
until ss -ltn | grep -q ':18515 ' || [ "$n" -ge 100 ]; do n=$((n + 1)); sleep 0.1; done
echo "--- client: write_bw -d $IBVERBS_TEST_DEVICE -x $gid -s 65536 -n 2000 127.0.0.1"
"$ex/write_bw" -d "$IBVERBS_TEST_DEVICE" -x "$gid" -s 65536 -n 2000 127.0.0.1
client_rc=$?
wait "$server"
server_rc=$?
rm -f "$server_log"
echo "--- client exit $client_rc, server exit $server_rc"
[ "$client_rc" -eq 0 ] && [ "$server_rc" -eq 0 ]
"#;

/// How long one demo command may run by default.
const TIMEOUT: Duration = Duration::from_secs(120);

/// The benchmarks: (title, shell command line), run in the workspace root of a release build.
pub const BENCH: &[(&str, &str)] = &[
    (
        "ours vs perftest: write_bw, read_bw, send_bw, write_lat, send_lat (medians, ratio ours/perftest)",
        r#"sh examples/perf/compare.sh "$TARGET_DIR/release/examples""#,
    ),
    (
        "the same at the safe posting level (--safe): write_lat, send_lat, write_bw",
        r#"OURS_ARGS=--safe PAIRS=3 TESTS="write_lat send_lat write_bw" sh examples/perf/compare.sh "$TARGET_DIR/release/examples""#,
    ),
    (
        "post/poll micro-benchmark: safe level vs unsafe level vs raw ffi",
        r#"b=$(ls -t "$TARGET_DIR"/release/deps/post_poll-* | grep -v '\.d$' | head -n 1) && "$b""#,
    ),
];

/// How long one benchmark command may run by default.
const BENCH_TIMEOUT: Duration = Duration::from_secs(1200);

/// Runs the demo, each command limited to `timeout` (default 120 s); returns the exit status.
pub fn run(backend: &vm::Backend, timeout: Option<Duration>) -> Result<u8, String> {
    let root = crate::workspace_root();
    cargo::run(&root, &["build", "--examples"])?;
    run_lines(backend, DEMO, timeout.unwrap_or(TIMEOUT), "demo")
}

/// Runs the benchmarks (release build), each command limited to `timeout` (default 20 min).
pub fn bench(backend: &vm::Backend, timeout: Option<Duration>) -> Result<u8, String> {
    let root = crate::workspace_root();
    cargo::run(&root, &["build", "--release", "--examples"])?;
    cargo::run(&root, &["bench", "--no-run", "--bench", "post_poll"])?;
    run_lines(backend, BENCH, timeout.unwrap_or(BENCH_TIMEOUT), "bench")
}

/// Runs `lines` in one boot, in the workspace root with `$TARGET_DIR` set; returns the exit status.
fn run_lines(
    backend: &vm::Backend,
    lines: &[(&str, &str)],
    timeout: Duration,
    what: &str,
) -> Result<u8, String> {
    let root = crate::workspace_root();
    let mut target_dir = b"TARGET_DIR=".to_vec();
    target_dir.extend_from_slice(&shell::quote(cargo::target_dir(&root)?.as_os_str().as_bytes()));
    target_dir.push(b'\n');
    let steps: Vec<Step> = lines
        .iter()
        .map(|(title, line)| Step {
            label: (*title).to_string(),
            script: shell::in_dir(&root, &[&target_dir[..], line.as_bytes()].concat()),
            timeout,
            output: Output::Live,
        })
        .collect();
    let mut failed = 0;
    let report = vm::run(&steps, backend, &mut |i, r| {
        if r.code != 0 {
            failed += 1;
            eprintln!("xtask: `{}` FAILED (exit {})", steps[i].label, r.code);
        }
    })?;
    report.explain(&steps);
    Ok(match report.end {
        vm::End::Completed if failed == 0 => {
            eprintln!("xtask: {what} done: {} commands succeeded", steps.len());
            0
        }
        vm::End::Completed => 1,
        _ => report.single_step_exit_code().max(1),
    })
}
