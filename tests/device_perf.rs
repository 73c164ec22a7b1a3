//! Device tests of the perftest-style examples (`write_bw`, `write_lat`, `read_bw`, `send_bw`,
//! `send_lat`): each runs as server and client over a real verbs device (SoftRoCE in the
//! `cargo xtask test` VM) with tiny sizes, at both posting levels, and must exit 0 with a result
//! row in perftest's format; and a peer that vanishes mid-run must make the other side fail
//! quickly instead of hanging. Also `striped_bw`, whose two ends live in one process. They
//! fail, never skip, when there is no device.
//!
//! The examples are the binaries next to this test's (`target/<profile>/examples/`), which the
//! harness builds first. `IBVERBS_TEST_DEVICE` (default `rxe0`) and `IBVERBS_TEST_GID_INDEX`
//! (default 1) choose the device and GID. The tests run one at a time: busy-polling pairs running
//! concurrently on a two-CPU VM would only slow each other down.
//!
//! On an iWARP device (soft-iWARP in the siw stage), whose queue pairs connect only through
//! RDMA-CM, every run connects with `-R` at `IBVERBS_TEST_IP`; the runs on the extended data
//! path (`--ex`, which takes no `-R`) are reported as unsupported there, and a side started
//! without `-R` must refuse at once, naming iWARP. Whether the device is iWARP comes from sysfs
//! (its node type is an RNIC): this binary opens no device itself (`CHILD_ONLY` in xtask).

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::{test_device_name, unsupported_on};

/// Serializes the tests.
static SERIAL: Mutex<()> = Mutex::new(());
/// TCP ports: a fresh one per run, away from the default 18515 other tests may use.
static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

const BW_HEADER: &str = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";
const LAT_HEADER: &str =
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
                          t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";

/// How long one example may run before it is killed and the test fails.
const RUN_TIMEOUT: Duration = Duration::from_secs(60);

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn port() -> u16 {
    let base = 24000 + (std::process::id() % 2000) as u16 * 4;
    base + NEXT_PORT.fetch_add(1, Ordering::Relaxed)
}

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/device_perf-HASH → target/<profile>/examples/<name>
    let path = exe.parent().and_then(|d| d.parent()).expect("target dir").join("examples").join(name);
    assert!(
        path.is_file(),
        "{} not found: build the examples first (cargo build --examples)",
        path.display()
    );
    path
}

fn device_args() -> Vec<String> {
    let gid = std::env::var("IBVERBS_TEST_GID_INDEX").unwrap_or_else(|_| "1".into());
    vec!["-d".into(), test_device_name(), "-x".into(), gid]
}

/// Whether the test device is iWARP: its sysfs node type is an RNIC (`4: RNIC`; an InfiniBand
/// or RoCE device is `1: CA`). A device that is not there fails the test.
fn iwarp() -> bool {
    static IWARP: OnceLock<bool> = OnceLock::new();
    *IWARP.get_or_init(|| {
        let path = format!("/sys/class/infiniband/{}/node_type", test_device_name());
        let node_type =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("no test device: {path}: {e}"));
        node_type.contains("RNIC")
    })
}

/// The flags every side gets and the address the client connects to: none and 127.0.0.1, or
/// on iWARP `-R` and the device's address (`IBVERBS_TEST_IP`).
fn transport() -> (&'static [&'static str], String) {
    if iwarp() {
        (&["-R"], cm_host())
    } else {
        (&[], "127.0.0.1".into())
    }
}

/// A running example whose output is collected by threads (stdout line by line, so that a test
/// can wait for a line).
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    stdout: Vec<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Proc {
    fn spawn(name: &str, args: &[String]) -> Proc {
        let mut child = Command::new(example(name))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        let out = child.stdout.take().expect("stdout");
        let mut err = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Proc { child, lines, stdout: Vec::new(), stderr: Some(stderr) }
    }

    /// Waits until a stdout line contains `needle` (true), or `timeout` passes or stdout closes.
    fn wait_line(&mut self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.contains(needle);
                    self.stdout.push(line);
                    if hit {
                        return true;
                    }
                }
                Err(_) => return false,
            }
        }
    }

    /// Waits for the exit (killing the process after `timeout`); returns the status (`None` when
    /// it had to be killed), stdout and stderr.
    fn finish(mut self, timeout: Duration) -> (Option<ExitStatus>, String, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
            }
        };
        while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(500)) {
            self.stdout.push(line);
        }
        let stderr = self.stderr.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let stdout = std::mem::take(&mut self.stdout).join("\n");
        (status, stdout, stderr)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Nothing outlives a test, whatever happened.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The numbers of the first result row after the table header.
fn result_row(stdout: &str, header: &str) -> Vec<f64> {
    let mut lines = stdout.lines();
    lines.by_ref().find(|l| *l == header).unwrap_or_else(|| panic!("no result table header in:\n{stdout}"));
    let row = lines.next().unwrap_or_else(|| panic!("no result row in:\n{stdout}"));
    let nums: Vec<f64> = row.split_whitespace().map(|w| w.parse().unwrap_or(f64::NAN)).collect();
    assert!(nums.iter().all(|n| n.is_finite()), "result row is not all numbers: {row:?}");
    nums
}

/// Runs `name` as server and client with `args` (both sides; the client adds its level and the
/// server's address) and checks both exit 0 and the client's row.
fn run_ok(name: &str, args: &[&str], level: &str) {
    if iwarp() && args.contains(&"--ex") {
        let why =
            "iWARP connects only through RDMA-CM (-R), which the extended data path (--ex) does not take";
        return unsupported_on(&test_device_name(), "extended QPs and CQs (--ex)", why);
    }
    let (both, host) = transport();
    run_ok_with(name, both, args, level, &host);
}

/// [`run_ok`] with `both` given to both sides, and the client connecting to `host`.
fn run_ok_with(name: &str, both: &[&str], args: &[&str], level: &str, host: &str) {
    let _serial = lock();
    let port = port().to_string();
    let mut common = device_args();
    common.extend(["-p".to_string(), port]);
    common.extend(both.iter().map(|s| s.to_string()));
    let server = Proc::spawn(name, &common);
    let mut client_args = common.clone();
    client_args.extend(args.iter().map(|s| s.to_string()));
    client_args.extend([level.to_string(), host.to_string()]);
    let client = Proc::spawn(name, &client_args);
    let (cs, cout, cerr) = client.finish(RUN_TIMEOUT);
    let (ss, sout, serr) = server.finish(Duration::from_secs(20));
    let ctx = format!(
        "{name} {args:?} {level}\n--- client stdout:\n{cout}\n--- client stderr:\n{cerr}\n\
         --- server stdout:\n{sout}\n--- server stderr:\n{serr}"
    );
    assert!(cs.is_some_and(|s| s.success()), "client failed ({cs:?}): {ctx}");
    assert!(ss.is_some_and(|s| s.success()), "server failed ({ss:?}): {ctx}");
    let bw = name.ends_with("_bw");
    let header = if bw { BW_HEADER } else { LAT_HEADER };
    let row = result_row(&cout, header);
    if bw {
        // size, iterations, peak, average, message rate
        assert_eq!(row.len(), 5, "{ctx}");
        assert!(row[3] > 0.0 && row[4] > 0.0, "no bandwidth measured: {ctx}");
    } else {
        // size, iterations, min, max, typical, average, stdev, 99%, 99.9%
        assert_eq!(row.len(), 9, "{ctx}");
        assert!(row[2] > 0.0 && row[4] >= row[2] && row[5] > 0.0, "no latency measured: {ctx}");
    }
    assert_eq!(row[0], args_size(args) as f64, "{ctx}");
    // The server prints a table too (the client's numbers for write/read, its own for the rest).
    result_row(&sout, header);
}

fn args_size(args: &[&str]) -> u64 {
    args.windows(2).find(|w| w[0] == "-s").and_then(|w| w[1].parse().ok()).unwrap_or(0)
}

#[test]
fn write_bw_runs_at_both_levels() {
    run_ok("write_bw", &["-s", "4096", "-n", "200"], "--raw");
    run_ok("write_bw", &["-s", "4096", "-n", "100", "-q", "2"], "--safe");
}

#[test]
fn read_bw_runs_at_both_levels() {
    run_ok("read_bw", &["-s", "4096", "-n", "200"], "--raw");
    run_ok("read_bw", &["-s", "65536", "-n", "50", "-t", "16"], "--safe");
}

#[test]
fn send_bw_runs_at_both_levels() {
    run_ok("send_bw", &["-s", "4096", "-n", "200", "-l", "4"], "--raw");
    run_ok("send_bw", &["-s", "4096", "-n", "200", "-l", "4"], "--safe");
}

#[test]
fn write_lat_runs_at_both_levels() {
    run_ok("write_lat", &["-s", "2", "-n", "100"], "--raw");
    // Prepared inline writes (-I), each bringing its bytes, on both data paths.
    run_ok("write_lat", &["-s", "64", "-n", "100", "-I", "64"], "--safe");
    run_ok("write_lat", &["-s", "64", "-n", "100", "-I", "64", "--ex"], "--safe");
    // Prepared writes (no -I), on the classic and the extended data path.
    run_ok("write_lat", &["-s", "2", "-n", "100"], "--safe");
    run_ok("write_lat", &["-s", "4096", "-n", "100", "--ex"], "--safe");
}

#[test]
fn the_extended_data_path_runs_at_both_levels() {
    // The client on the extended data path (--ex: extended QPs and CQs), the server classic.
    run_ok("write_bw", &["-s", "4096", "-n", "100", "--ex"], "--safe");
    run_ok("send_lat", &["-s", "64", "-n", "100", "--ex"], "--safe");
    run_ok("read_bw", &["-s", "4096", "-n", "100", "--ex"], "--raw");
}

#[test]
fn send_lat_runs_at_both_levels() {
    run_ok("send_lat", &["-s", "2", "-n", "100"], "--raw");
    run_ok("send_lat", &["-s", "64", "-n", "100", "-t", "4", "-Q", "2"], "--safe");
}

/// Starts a long run, waits until `watched`'s result table header is out (the run has begun),
/// kills the other side, and expects `watched` to fail within `within`.
fn vanishing_peer(name: &str, args: &[&str], kill_server: bool, within: Duration) {
    let _serial = lock();
    let port = port().to_string();
    let (both, host) = transport();
    let mut common = device_args();
    common.extend(["-p".to_string(), port, "--timeout".to_string(), "30".to_string()]);
    common.extend(both.iter().map(|s| s.to_string()));
    let mut server = Proc::spawn(name, &common);
    let mut client_args = common.clone();
    client_args.extend(args.iter().map(|s| s.to_string()));
    client_args.push(host);
    let mut client = Proc::spawn(name, &client_args);
    let header = if name.ends_with("_bw") { BW_HEADER } else { LAT_HEADER };
    let (watched, victim) = if kill_server { (&mut client, &mut server) } else { (&mut server, &mut client) };
    assert!(
        watched.wait_line(header.trim_end(), Duration::from_secs(30)),
        "{name} never started its run: {:?}",
        watched.stdout
    );
    std::thread::sleep(Duration::from_millis(1500));
    victim.kill();
    let started = Instant::now();
    let (watched, victim) = if kill_server { (client, server) } else { (server, client) };
    drop(victim);
    let (status, out, err) = watched.finish(within + Duration::from_secs(5));
    let took = started.elapsed();
    let ctx = format!("{name}: status {status:?} after {took:?}\n--- stdout:\n{out}\n--- stderr:\n{err}");
    let status = status.unwrap_or_else(|| panic!("hung after its peer vanished (killed): {ctx}"));
    assert!(!status.success(), "succeeded although its peer vanished: {ctx}");
    assert!(took <= within, "took too long to notice: {ctx}");
    assert!(err.contains(&format!("{name}: ")), "no error message: {ctx}");
}

#[test]
fn write_bw_client_fails_when_the_server_vanishes() {
    vanishing_peer("write_bw", &["-s", "65536", "-n", "1000000"], true, Duration::from_secs(15));
}

#[test]
fn write_lat_server_fails_when_the_client_vanishes() {
    vanishing_peer("write_lat", &["-s", "2", "-n", "2000000"], false, Duration::from_secs(15));
}

/// The address RDMA-CM reaches the test device at (the harness's `dummy0`; not 127.0.0.1).
fn cm_host() -> String {
    std::env::var("IBVERBS_TEST_IP").unwrap_or_else(|_| "192.0.2.1".into())
}

/// `-R`: every perf example with its queue pairs connected through RDMA-CM (several queue pairs
/// for the bandwidth tests), at both levels.
#[test]
fn rdma_cm_connects_every_perf_example() {
    let host = cm_host();
    run_ok_with("write_bw", &["-R"], &["-s", "4096", "-n", "200", "-q", "2"], "--raw", &host);
    run_ok_with("read_bw", &["-R"], &["-s", "65536", "-n", "50", "-t", "16"], "--safe", &host);
    run_ok_with("send_bw", &["-R"], &["-s", "4096", "-n", "200", "-q", "3"], "--safe", &host);
    run_ok_with("write_lat", &["-R"], &["-s", "2", "-n", "100"], "--raw", &host);
    run_ok_with("send_lat", &["-R"], &["-s", "64", "-n", "100"], "--safe", &host);
}

/// `-R` without `-x`: RDMA-CM resolves the address itself, so the examples pick no GID they
/// would need (an iWARP port has no RoCE v2 GID: `write_bw -R` used to refuse to start on siw);
/// the header still shows the port's GID (its RoCE v2 IPv4 GID, or an iWARP port's GID 0).
#[test]
fn rdma_cm_needs_no_gid_index() {
    let _serial = lock();
    let common = ["-d".to_string(), test_device_name(), "-p".into(), port().to_string(), "-R".into()];
    let server = Proc::spawn("write_bw", &common);
    let mut client_args = common.to_vec();
    client_args.extend(["-s", "4096", "-n", "100", "--safe"].map(String::from));
    client_args.push(cm_host());
    let (cs, cout, cerr) = Proc::spawn("write_bw", &client_args).finish(RUN_TIMEOUT);
    let (ss, sout, serr) = server.finish(Duration::from_secs(20));
    let ctx = format!("--- client:\n{cout}\n{cerr}\n--- server:\n{sout}\n{serr}");
    assert!(cs.is_some_and(|s| s.success()), "client failed ({cs:?}): {ctx}");
    assert!(ss.is_some_and(|s| s.success()), "server failed ({ss:?}): {ctx}");
    assert_eq!(result_row(&cout, BW_HEADER)[0], 4096.0, "{ctx}");
    let gid = cout
        .lines()
        .find_map(|l| l.trim().strip_prefix("GID: "))
        .unwrap_or_else(|| panic!("no GID line: {ctx}"));
    assert!(gid.split(':').any(|b| b != "00"), "the header's GID is all zeros: {ctx}");
}

/// `-R` on one side only: both sides fail with a message that says so, promptly. On iWARP the
/// side without `-R` refuses before it connects: its message names iWARP and `-R`.
#[test]
fn rdma_cm_on_one_side_only_is_refused_by_name() {
    let host = cm_host();
    if iwarp() {
        for role in ["server", "client"] {
            let _serial = lock();
            let mut args = device_args();
            args.extend(["-p".to_string(), port().to_string(), "-n".into(), "10".into()]);
            if role == "client" {
                args.push(host.clone());
            }
            let t = Instant::now();
            let (status, out, err) = Proc::spawn("write_bw", &args).finish(RUN_TIMEOUT);
            let ctx = format!("the {role} without -R on iWARP\n--- stdout:\n{out}\n--- stderr:\n{err}");
            assert!(status.is_some_and(|s| !s.success()), "it must fail: {ctx}");
            assert!(err.contains("is an iWARP device") && err.contains("use -R"), "it says why: {ctx}");
            assert!(t.elapsed() < Duration::from_secs(8), "took {:?}: {ctx}", t.elapsed());
        }
        return;
    }
    for (server_cm, client_cm, says) in
        [(true, false, "the server uses RDMA-CM (-R)"), (false, true, "the server does not use RDMA-CM")]
    {
        let _serial = lock();
        let mut common = device_args();
        common.extend(["-p".to_string(), port().to_string()]);
        let mut server_args = common.clone();
        if server_cm {
            server_args.push("-R".into());
        }
        let server = Proc::spawn("write_bw", &server_args);
        let mut client_args = common;
        if client_cm {
            client_args.push("-R".into());
        }
        client_args.extend(["-n".into(), "10".into(), host.clone()]);
        let t = Instant::now();
        let client = Proc::spawn("write_bw", &client_args);
        let (cs, cout, cerr) = client.finish(RUN_TIMEOUT);
        let (ss, sout, serr) = server.finish(Duration::from_secs(20));
        let ctx = format!("server -R {server_cm}, client -R {client_cm}\n--- client:\n{cout}\n{cerr}\n--- server:\n{sout}\n{serr}");
        assert!(cs.is_some_and(|s| !s.success()), "the client must fail: {ctx}");
        assert!(ss.is_some_and(|s| !s.success()), "the server must fail: {ctx}");
        assert!(cerr.contains(says), "the client says why: {ctx}");
        assert!(serr.contains(says), "the server relays the client's reason: {ctx}");
        assert!(t.elapsed() < Duration::from_secs(8), "took {:?}: {ctx}", t.elapsed());
    }
}

/// `striped_bw` (both ends in one process): a row of MB/s per (queue pairs, size), in order; on
/// iWARP every pair of queue pairs connects through RDMA-CM at the address of the device's
/// network device, which it finds itself.
#[test]
fn striped_bw_prints_a_row_per_queue_pair_count_and_size() {
    let _serial = lock();
    let mut args = device_args();
    args.extend(["--qps", "1,2,4", "-s", "4096,65536", "-n", "50"].map(String::from));
    let (status, out, err) = Proc::spawn("striped_bw", &args).finish(RUN_TIMEOUT);
    let ctx = format!("--- stdout:\n{out}\n--- stderr:\n{err}");
    assert!(status.is_some_and(|s| s.success()), "striped_bw failed ({status:?}): {ctx}");
    let header = format!("# striped_bw on {} port 1, 50 messages per row", test_device_name());
    assert!(out.starts_with(&header), "{ctx}");
    assert_eq!(out.contains(&format!("connected through RDMA-CM at {}", cm_host())), iwarp(), "{ctx}");
    let rows: Vec<(u32, usize, f64)> = out
        .lines()
        .skip(2)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "a row is qps, bytes, MB/s: {l:?} in {ctx}");
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect();
    let expected = [(1, 4096), (2, 4096), (4, 4096), (1, 65536), (2, 65536), (4, 65536)];
    assert_eq!(rows.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(), expected, "{ctx}");
    assert!(rows.iter().all(|r| r.2 > 0.0), "{ctx}");
}

/// How many threads process `pid` has (its entries in `/proc/PID/task`).
fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count()).unwrap_or(0)
}

/// Regression: a heartbeat thread made every example process multi-threaded, so glibc's
/// cancellable `write` (each doorbell of the provider) took its multi-threaded path, costing 5-9 %
/// of the 2-byte message rate on SoftRoCE. Both sides of a run (a sender's hot loop, and a
/// server that only waits) have one thread, the whole way through the run.
#[test]
fn perf_examples_run_single_threaded() {
    for (name, args) in
        [("write_bw", ["-s", "2", "-n", "3000000"]), ("send_lat", ["-s", "2", "-n", "1000000"])]
    {
        let _serial = lock();
        let port = port().to_string();
        let (both, host) = transport();
        let mut common = device_args();
        common.extend(["-p".to_string(), port]);
        common.extend(both.iter().map(|s| s.to_string()));
        common.extend(args.iter().map(|s| s.to_string()));
        let mut server = Proc::spawn(name, &common);
        let mut client_args = common.clone();
        client_args.push(host);
        let mut client = Proc::spawn(name, &client_args);
        let header = if name.ends_with("_bw") { BW_HEADER } else { LAT_HEADER };
        assert!(
            client.wait_line(header.trim_end(), Duration::from_secs(30)),
            "{name} never started its run: {:?}",
            client.stdout
        );
        // Sampled through the run (both sides busy: the client posting and polling, the server
        // polling or waiting for the end), while both are alive.
        let mut samples = 0;
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(100));
            let (c, s) = (threads(client.child.id()), threads(server.child.id()));
            if c == 0 || s == 0 {
                break; // one has exited
            }
            assert_eq!((c, s), (1, 1), "{name}: threads of the client and the server");
            samples += 1;
        }
        assert!(samples >= 3, "{name}: the run ended before it could be sampled ({samples} samples)");
        client.kill();
        server.kill();
    }
}
