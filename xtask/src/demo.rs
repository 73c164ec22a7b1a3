//! `cargo xtask demo`: a few programs shown working over the device, in one VM boot.
//!
//! Each entry of [`DEMO`] is a title and a shell command line, run in order with `/bin/sh` in the
//! workspace root, where `$IBVERBS_TEST_DEVICE`, `$IBVERBS_TEST_GID_INDEX` and `$IBVERBS_TEST_IP` name the
//! device and `$TARGET_DIR` is cargo's target directory (the examples, built by `cargo build --examples`
//! before the VM boots, are in `$TARGET_DIR/debug/examples/`). To show another program, add a line.

use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use crate::sweep::median;
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
        "ours vs perftest on the extended data path (--safe --ex: ibv_wr_* posts, ibv_start_poll polls)",
        r#"OURS_ARGS="--safe --ex" PAIRS=3 TESTS="write_lat send_lat write_bw" sh examples/perf/compare.sh "$TARGET_DIR/release/examples""#,
    ),
    (
        "post/poll micro-benchmark: safe level vs unsafe level vs raw ffi",
        r#"b=$(ls -t "$TARGET_DIR"/release/deps/post_poll-* | grep -v '\.d$' | head -n 1) && "$b""#,
    ),
    (
        "the new user's program (issue 46): C vs the safe one-shot level vs the unsafe level, 20 alternating rounds (send latency, write bandwidth)",
        r#"ROUNDS=20 LAT_ITERS=5000 BW_ITERS=1000 sh examples/perf/newuser.sh "$TARGET_DIR/release/examples""#,
    ),
];

/// The async adaptor against the synchronous safe level on the host's clock (the last step of
/// [`BENCH`]'s boot): `async_rpc --bench`, five rounds with one request in flight and three with
/// 16, each round running every path in one process.
const BENCH_ASYNC: (&str, &str) = (
    "the async adaptor vs the synchronous safe level (async_rpc --bench, one process over one device; 5 rounds at 1 in flight, 3 at 16)",
    r#"b="$TARGET_DIR/release/examples/async_rpc" && for r in 1 2 3 4 5; do echo "round $r, 1 in flight"; "$b" --bench -n 3000 -c 1 || exit 1; done && for r in 1 2 3; do echo "round $r, 16 in flight"; "$b" --bench -n 5000 -c 16 || exit 1; done"#,
);

/// The runs of a boot of their own whose clock counts instructions ([`vm::Extras::icount`]
/// `shift=0`): the same programs, whose times then repeat from run to run (one round each is
/// enough), user and kernel instructions weighing alike.
pub const BENCH_ICOUNT: &[(&str, &str)] = &[
    (
        "under icount (guest time = instructions run): the async adaptor vs the synchronous safe level, 1 and 16 in flight",
        r#"b="$TARGET_DIR/release/examples/async_rpc" && "$b" --bench -n 3000 -c 1 && "$b" --bench -n 5000 -c 16"#,
    ),
    (
        "under icount: the new user's program, C vs the safe one-shot level vs the unsafe level, 3 rounds",
        r#"ROUNDS=3 LAT_ITERS=3000 BW_ITERS=1000 sh examples/perf/newuser.sh "$TARGET_DIR/release/examples""#,
    ),
];

/// The sweep's settings in `cargo xtask bench` (the environment overrides them): 10 rounds at
/// the target sizes (2 B, 4 KiB, 64 KiB), 2 elsewhere.
pub const BENCH_SWEEP: &[(&str, &str)] = &[("PAIRS", "2"), ("TARGET_PAIRS", "10")];

/// How long one benchmark command may run by default.
const BENCH_TIMEOUT: Duration = Duration::from_secs(1200);

/// Runs the demo, each command limited to `timeout` (default 120 s); returns the exit status.
pub fn run(backend: &vm::Backend, timeout: Option<Duration>) -> Result<u8, String> {
    let root = crate::workspace_root();
    cargo::run(&root, &["build", "--examples"])?;
    run_lines(backend, DEMO, timeout.unwrap_or(TIMEOUT), "demo")
}

/// Runs the benchmarks (release build): the sweep ([`crate::sweep::run`] with [`BENCH_SWEEP`], in
/// a boot of its own), then the other commands, each limited to `timeout` (default 20 min), then
/// the instruction counts ([`crate::callgrind`]): per WR of post and poll, then per completion of
/// poll against the batch size (also plotted to `docs/bench/poll_batch.svg`); with
/// `callgrind_only`, only those.
pub fn bench(backend: &vm::Backend, timeout: Option<Duration>, callgrind_only: bool) -> Result<u8, String> {
    let root = crate::workspace_root();
    let mut sweep_code = 0;
    if !callgrind_only {
        // The size and scaling sweeps (ours at both levels against perftest, with the targets'
        // ratios), in a boot of their own.
        sweep_code = crate::sweep::run(backend, None, BENCH_SWEEP)?;
        // The tokio feature for async_rpc.
        cargo::run(&root, &["build", "--release", "--examples", "--features", "tokio"])?;
    }
    cargo::run(&root, &["bench", "--no-run", "--bench", "post_poll", "--bench", "async_op"])?;
    let with_async: Vec<(&str, &str)> = BENCH.iter().copied().chain([BENCH_ASYNC]).collect();
    let lines = if callgrind_only { &[][..] } else { &with_async[..] };
    let timeout = timeout.unwrap_or(BENCH_TIMEOUT);
    let captured = [
        (
            "instructions per WR under callgrind: ffi, unsafe, safe one-shot, safe prepared",
            crate::callgrind::SCRIPT,
        ),
        (
            "poll instructions per completion by batch size under callgrind: ffi, unsafe, safe",
            crate::callgrind::BATCH_SCRIPT,
        ),
    ];
    let gate_script = crate::gate::script();
    let captured = [
        captured[0],
        captured[1],
        (
            "the instruction-count gate's runs (post + poll per level, safe batches, an async operation)",
            &gate_script,
        ),
    ];
    let (code, results) =
        run_lines_with(backend, lines, &captured, timeout, "bench", &vm::Extras::default())?;
    let outs = results.get(lines.len()..).unwrap_or(&[]);
    let Some(out) = outs.first() else {
        eprintln!("xtask: the callgrind step did not run");
        return Ok(code.max(1));
    };
    let (batch_stdout, batch_code) = match outs.get(1) {
        Some(r) => (String::from_utf8_lossy(&r.stdout).into_owned(), r.code),
        None => {
            eprintln!("xtask: the batch callgrind step did not run");
            (String::new(), 1)
        }
    };
    let took: Vec<String> = outs.iter().map(|r| format!("{:.0} s", r.elapsed.as_secs_f64())).collect();
    eprintln!("xtask: the callgrind steps took {}", took.join(" and "));
    let (rows, problems) = crate::callgrind::parse_output(&String::from_utf8_lossy(&out.stdout));
    for p in &problems {
        eprintln!("xtask: callgrind: {p}");
    }
    if out.code != 0 || !problems.is_empty() {
        eprintln!("xtask: the callgrind step's output:\n{}", String::from_utf8_lossy(&out.stdout));
    }
    let (batch, batch_problems) = crate::callgrind::parse_batch_output(&batch_stdout);
    for p in &batch_problems {
        eprintln!("xtask: callgrind, batch: {p}");
    }
    if batch_code != 0 || !batch_problems.is_empty() {
        eprintln!("xtask: the batch callgrind step's output:\n{batch_stdout}");
    }
    println!("\nuser-space instructions per WR (callgrind, benches/post_poll.rs; \"ours\" = all but the provider library's share):\n");
    println!("{}", crate::callgrind::table(&rows));
    println!("\npoll: user-space instructions per completion vs batch size B (callgrind, benches/post_poll.rs POST_POLL_BATCH; one poll call with room for B; empty polls / polls per level last):\n");
    println!("{}", crate::callgrind::batch_table(&batch));
    let commit = git_commit(&root);
    let date = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let dir = cargo::target_dir(&root)?.join("xtask-bench");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let file = dir.join("callgrind.json");
    std::fs::write(&file, crate::callgrind::json(&rows, &batch, &commit, &date))
        .map_err(|e| format!("{}: {e}", file.display()))?;
    eprintln!("xtask: wrote {}", file.display());
    if batch.is_empty() {
        eprintln!("xtask: no batch counts: docs/bench/poll_batch.svg left as it was");
    } else {
        let plots = root.join("docs/bench");
        std::fs::create_dir_all(&plots).map_err(|e| format!("{}: {e}", plots.display()))?;
        let svg = plots.join("poll_batch.svg");
        let (chart, styles) = crate::callgrind::batch_chart(&batch);
        std::fs::write(&svg, chart.svg_styled(&styles)).map_err(|e| format!("{}: {e}", svg.display()))?;
        eprintln!("xtask: wrote {}", svg.display());
    }
    // The gate's runs: the async operation's count, and the gate's verdict on this run.
    let (gate_stdout, gate_code) = match outs.get(2) {
        Some(r) => (String::from_utf8_lossy(&r.stdout).into_owned(), r.code),
        None => (String::new(), 1),
    };
    let (op, _) = crate::callgrind::parse_async_output(&gate_stdout);
    let (figures, gate_problems) = crate::gate::read_output(&gate_stdout);
    for p in &gate_problems {
        eprintln!("xtask: callgrind, the gate's runs: {p}");
    }
    if let Some(op) = &op {
        println!(
            "\nasync adaptor: {:.1} user-space instructions per awaited operation, {:.1} ours ({} operations, {} polls, {} empty)",
            op.per_op(op.count.total),
            op.per_op(op.count.ours()),
            op.ops,
            op.polls,
            op.empty_polls
        );
    }
    if gate_code != 0 || !gate_problems.is_empty() {
        eprintln!("xtask: the gate step's output:\n{gate_stdout}");
    }
    let gate_file = dir.join("gate-baseline.txt");
    std::fs::write(&gate_file, crate::gate::render_baseline(&figures, &commit, &date))
        .map_err(|e| format!("{}: {e}", gate_file.display()))?;
    eprintln!(
        "xtask: wrote {} (copy it over {} to move the gate)",
        gate_file.display(),
        crate::gate::BASELINE
    );
    match std::fs::read_to_string(root.join(crate::gate::BASELINE))
        .map_err(|e| e.to_string())
        .and_then(|b| crate::gate::parse_baseline(&b).map(|base| crate::gate::judge(&base, &figures)))
    {
        Ok(v) => {
            println!("\ninstruction-count gate against {}:\n{}", crate::gate::BASELINE, v.table);
            for n in &v.notes {
                println!("  note: {n}");
            }
            for f in &v.failures {
                println!("  WOULD FAIL: {f}");
            }
        }
        Err(e) => eprintln!("xtask: no gate verdict: {e}"),
    }
    let ok = problems.is_empty()
        && out.code == 0
        && batch_problems.is_empty()
        && batch_code == 0
        && gate_problems.is_empty()
        && gate_code == 0;
    // The icount boot (the VM device only: a host's own device has no instruction clock).
    let mut icount_code = 0;
    if !callgrind_only && matches!(backend, vm::Backend::Vm { .. }) {
        eprintln!("xtask: one more boot, whose clock counts instructions (QEMU -icount shift=0)");
        let extras = vm::Extras { icount: Some("shift=0".into()), ..Default::default() };
        icount_code = run_lines_with(backend, BENCH_ICOUNT, &[], timeout, "bench (icount)", &extras)?.0;
    }
    let code = code.max(sweep_code).max(icount_code);
    Ok(if ok { code } else { code.max(1) })
}

/// The workspace's commit (`git rev-parse --short HEAD`, with `-dirty` for local changes).
fn git_commit(root: &std::path::Path) -> String {
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let head = run(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    if dirty {
        format!("{head}-dirty")
    } else {
        head
    }
}

/// `cargo xtask bench --twohost`: `examples/perf/compare_twohost.sh` in both guests of a pair
/// (release build; servers in A, clients in B, ours and perftest's alternating), then the table
/// of medians and ratios from B's `RESULT` lines. `PAIRS` in the environment sets the pairs per
/// test (default 8: fewer do not separate the two tools across this link).
pub fn bench_twohost(timeout: Option<Duration>) -> Result<u8, String> {
    let root = crate::workspace_root();
    cargo::run(&root, &["build", "--release", "--examples"])?;
    let pairs: u32 = std::env::var("PAIRS").ok().and_then(|p| p.parse().ok()).filter(|&p| p > 0).unwrap_or(8);
    let mut script = format!("PAIRS={pairs}\nexport PAIRS\nTARGET_DIR=").into_bytes();
    script.extend_from_slice(&shell::quote(cargo::target_dir(&root)?.as_os_str().as_bytes()));
    script.extend_from_slice(b"\nexport TARGET_DIR\nsh examples/perf/compare_twohost.sh\n");
    let script = shell::in_dir(&root, &script);
    let steps = [crate::rxe2::PairStep {
        label: format!("ours vs perftest across two guests, {pairs} pairs per test"),
        a: script.clone(),
        b: script,
        timeout: timeout.unwrap_or(Duration::from_secs(600 + 400 * u64::from(pairs))),
        output: Output::Live,
    }];
    let report = crate::rxe2::run(&steps, &crate::twohost::OPTIONS, &mut |_, _| {})?;
    report.explain(&crate::rxe2::side_steps_of(&steps));
    let b =
        report.results.first().and_then(|r| r.sides[1].as_ref()).map(|r| String::from_utf8_lossy(&r.stdout));
    let (table, complete) = twohost_table(b.as_deref().unwrap_or(""));
    println!("{table}");
    let code = report.exit_code();
    Ok(if code == 0 && !complete { 1 } else { code })
}

/// The Markdown table of `RESULT test kind pairN rc=R value` lines: per test, the medians of ours
/// and perftest's successful runs and their ratio (ours / perftest). Also whether every run
/// succeeded.
pub fn twohost_table(b_stdout: &str) -> (String, bool) {
    const TESTS: [(&str, &str, &str); 5] = [
        ("write_bw", "MB/s", "64 KiB"),
        ("read_bw", "MB/s", "64 KiB"),
        ("send_bw", "MB/s", "64 KiB"),
        ("write_lat", "µs (typical)", "2 B"),
        ("send_lat", "µs (typical)", "2 B"),
    ];
    let mut complete = true;
    let mut seen = 0;
    let mut runs: std::collections::HashMap<(String, String), Vec<f64>> = std::collections::HashMap::new();
    for line in b_stdout.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.first() != Some(&"RESULT") || f.len() < 6 {
            continue;
        }
        seen += 1;
        match (f[4] == "rc=0", f[5].parse::<f64>()) {
            (true, Ok(v)) if v.is_finite() => {
                runs.entry((f[1].to_string(), f[2].to_string())).or_default().push(v)
            }
            _ => complete = false,
        }
    }
    let mut out = String::from(
        "| test | size | ours (median) | perftest (median) | ratio ours/perftest |\n|---|---|---|---|---|\n",
    );
    for (test, unit, size) in TESTS {
        let m = |kind: &str| runs.get(&(test.to_string(), kind.to_string())).and_then(|v| median(v));
        let (ours, theirs) = (m("ours"), m("perftest"));
        let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        let ratio = match (ours, theirs) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => {
                complete = false;
                "-".to_string()
            }
        };
        out.push_str(&format!("| {test}, {unit} | {size} | {} | {} | {ratio} |\n", show(ours), show(theirs)));
    }
    (out, complete && seen > 0)
}

/// Runs `lines` in one boot, in the workspace root with `$TARGET_DIR` set; returns the exit status.
fn run_lines(
    backend: &vm::Backend,
    lines: &[(&str, &str)],
    timeout: Duration,
    what: &str,
) -> Result<u8, String> {
    run_lines_with(backend, lines, &[], timeout, what, &vm::Extras::default()).map(|(code, _)| code)
}

/// [`run_lines`], then the `captured` (title, line) steps, whose output is only kept (the caller
/// reads it from the results); returns the exit status of `lines` and every step's result.
fn run_lines_with(
    backend: &vm::Backend,
    lines: &[(&str, &str)],
    captured: &[(&str, &str)],
    timeout: Duration,
    what: &str,
    extras: &vm::Extras,
) -> Result<(u8, Vec<vm::StepResult>), String> {
    let root = crate::workspace_root();
    let mut target_dir = b"TARGET_DIR=".to_vec();
    target_dir.extend_from_slice(&shell::quote(cargo::target_dir(&root)?.as_os_str().as_bytes()));
    target_dir.push(b'\n');
    let mut steps: Vec<Step> = lines
        .iter()
        .map(|(title, line)| Step {
            label: (*title).to_string(),
            script: shell::in_dir(&root, &[&target_dir[..], line.as_bytes()].concat()),
            timeout,
            output: Output::Live,
        })
        .collect();
    for &(title, line) in captured {
        eprintln!("xtask: then (output kept for the table): {title}");
        steps.push(Step {
            label: title.to_string(),
            script: shell::in_dir(&root, &[&target_dir[..], line.as_bytes()].concat()),
            timeout,
            output: Output::Captured,
        });
    }
    let mut failed = 0;
    let report = vm::run_with(&steps, backend, extras, &mut |i, r| {
        if i >= lines.len() {
            return; // the captured steps: judged by the caller
        }
        if r.code != 0 {
            failed += 1;
            eprintln!("xtask: `{}` FAILED (exit {})", steps[i].label, r.code);
        }
    })?;
    report.explain(&steps);
    let code = match report.end {
        vm::End::Completed if failed == 0 => {
            if !lines.is_empty() {
                eprintln!("xtask: {what} done: {} commands succeeded", lines.len());
            }
            0
        }
        vm::End::Completed => 1,
        _ => report.single_step_exit_code().max(1),
    };
    Ok((code, report.results))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_scripts_exist() {
        let root = crate::workspace_root();
        let mut seen = 0;
        for (_, cmd) in BENCH {
            for word in cmd.split_whitespace().filter(|w| w.starts_with("examples/perf/")) {
                assert!(root.join(word).is_file(), "{word} (in `{cmd}`) is not a file");
                seen += 1;
            }
        }
        for (_, cmd) in BENCH_ICOUNT {
            for word in cmd.split_whitespace().filter(|w| w.starts_with("examples/perf/")) {
                assert!(root.join(word).is_file(), "{word} (in `{cmd}`) is not a file");
            }
        }
        assert!(seen >= 2, "the bench runs compare.sh and newuser.sh");
        let async_rpc = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
        assert!(
            async_rpc.contains("name = \"async_rpc\"\nrequired-features = [\"tokio\", \"cm\"]"),
            "the bench builds the examples with the features async_rpc needs (tokio; cm by default)"
        );
        assert!(root.join("examples/perf/newuser.c").is_file(), "newuser.sh compiles newuser.c");
    }

    #[test]
    fn twohost_table_takes_medians_and_ratios_and_notices_failures() {
        let out = "RESULT write_bw ours pair1 rc=0 10.0\nRESULT write_bw perftest pair1 rc=0 20.0\n\
                   RESULT write_bw ours pair2 rc=0 12.0\nRESULT write_bw perftest pair2 rc=0 10.0\n\
                   RESULT write_bw ours pair3 rc=0 30.0\nnoise\n";
        let (table, complete) = twohost_table(out);
        assert!(table.contains("| write_bw, MB/s | 64 KiB | 12.00 | 15.00 | 0.80 |"), "{table}");
        assert!(table.contains("| send_lat, µs (typical) | 2 B | - | - | - |"), "{table}");
        assert!(!complete, "four tests have no figures");
        assert!(!twohost_table("RESULT write_lat ours pair1 rc=1 FAILED\n").1);
        assert!(!twohost_table("").1);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }
}
