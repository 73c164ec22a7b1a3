//! Interop tests of the bundled examples against rdma-core's C tools, over a real verbs device
//! (SoftRoCE in the `cargo xtask test` VM): `rc_pingpong` and `ud_pingpong` against
//! `ibv_rc_pingpong` and `ibv_ud_pingpong` in both roles, `devinfo` and `devices` against
//! `ibv_devinfo` and `ibv_devices`, and the examples' handling of bad input and vanishing peers.
//!
//! The examples are run from `target/<profile>/examples/` (build them first: `cargo build
//! --examples`); the device is `IBVERBS_TEST_DEVICE` (default `rxe0`) with GID index
//! `IBVERBS_TEST_GID_INDEX` (default 1). Every child process runs under a deadline and is killed
//! when it passes it, so a hung peer fails a test instead of hanging it. Each test uses its own
//! TCP ports.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long one ping-pong process may run (they take well under a second; TCG is slow).
const RUN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a server may take to start listening.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failing command may take to report its error.
const ERROR_TIMEOUT: Duration = Duration::from_secs(20);

fn device() -> String {
    std::env::var("IBVERBS_TEST_DEVICE").unwrap_or_else(|_| "rxe0".to_string())
}

fn gid_index() -> String {
    std::env::var("IBVERBS_TEST_GID_INDEX").unwrap_or_else(|_| "1".to_string())
}

/// Fails the test unless the test device can be opened.
fn require_device() {
    let name = device();
    ibverbs::Context::open(Some(&name)).unwrap_or_else(|e| {
        panic!("these tests need the RDMA device {name:?} ({e}); run them with `cargo xtask test`")
    });
}

/// The path of a bundled example, next to this test binary: `target/<profile>/examples/<name>`.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps/<test>");
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.is_file(),
        "example binary {} is missing: build the examples first (`cargo build --examples`)",
        path.display()
    );
    path
}

/// A child process whose output is collected as it runs.
struct Running {
    what: String,
    child: Option<Child>,
    started: Instant,
    lines: mpsc::Receiver<String>,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
}

/// How a child process ended.
#[derive(Debug)]
struct Finished {
    what: String,
    status: Option<ExitStatus>,
    timed_out: bool,
    elapsed: Duration,
    stdout: String,
    stderr: String,
}

impl Finished {
    fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    fn describe(&self) -> String {
        let how = match (self.timed_out, self.status) {
            (true, _) => format!("killed after {:.1} s (timed out)", self.elapsed.as_secs_f64()),
            (false, Some(s)) => format!("{s} after {:.1} s", self.elapsed.as_secs_f64()),
            (false, None) => "not waited for".to_string(),
        };
        format!("`{}`: {how}\n--- stdout:\n{}--- stderr:\n{}---", self.what, self.stdout, self.stderr)
    }

    fn assert_success(&self) {
        assert!(self.success(), "expected success: {}", self.describe());
    }

    /// Asserts that it failed by itself (non-zero exit, not killed by us) within `within`.
    fn assert_failure(&self, within: Duration) {
        assert!(!self.timed_out, "expected a prompt failure, but it hung: {}", self.describe());
        assert!(self.status.is_some_and(|s| !s.success()), "expected a non-zero exit: {}", self.describe());
        assert!(self.elapsed <= within, "expected failure within {within:?}: {}", self.describe());
    }
}

impl Running {
    fn spawn(program: impl AsRef<OsStr>, args: &[String]) -> Running {
        let program = program.as_ref();
        let what = format!("{} {}", program.to_string_lossy(), args.join(" "));
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run `{what}`: {e} (are rdma-core's ibverbs-utils installed?)")
            });
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().expect("piped stdout");
        let stdout = std::thread::spawn(move || {
            let mut all = String::new();
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                all.push_str(&line);
                all.push('\n');
                let _ = tx.send(line);
            }
            all
        });
        let mut err = child.stderr.take().expect("piped stderr");
        let stderr = std::thread::spawn(move || {
            let mut all = Vec::new();
            let _ = err.read_to_end(&mut all);
            String::from_utf8_lossy(&all).into_owned()
        });
        Running {
            what,
            child: Some(child),
            started: Instant::now(),
            lines,
            stdout: Some(stdout),
            stderr: Some(stderr),
        }
    }

    /// Waits until the child prints a line containing `needle`; false if it exits or `timeout`
    /// passes first.
    fn wait_for_line(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }

    /// The child's process id.
    fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Stops the child with SIGSTOP: it keeps its sockets open but never answers again, as a
    /// host that died (no FIN, no RST) looks to its peer.
    fn freeze(&self) {
        let pid = self.pid();
        assert!(pid > 0, "no child to stop");
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0, "SIGSTOP {pid}");
    }

    /// Kills the child now.
    fn kill(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
        }
    }

    /// Waits for the child to exit, killing it after `timeout`.
    fn finish(mut self, timeout: Duration) -> Finished {
        let mut child = self.child.take().expect("a running child");
        let deadline = Instant::now() + timeout;
        let mut timed_out = false;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() >= deadline => {
                    timed_out = true;
                    let _ = child.kill();
                    break child.wait().ok();
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(_) => break None,
            }
        };
        let elapsed = self.started.elapsed();
        let stdout = self.stdout.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let stderr = self.stderr.take().and_then(|h| h.join().ok()).unwrap_or_default();
        Finished { what: std::mem::take(&mut self.what), status, timed_out, elapsed, stdout, stderr }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Never leave a process behind when a test fails halfway.
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs a command to completion (killed after `timeout`).
fn run(program: impl AsRef<OsStr>, args: &[&str], timeout: Duration) -> Finished {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    Running::spawn(program, &args).finish(timeout)
}

/// Whether a TCP socket listens on `port` (read from /proc: the C client does not retry, so a
/// server must be listening before it starts).
fn listening(port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|file| {
        std::fs::read_to_string(file).unwrap_or_default().lines().skip(1).any(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            cols.len() > 3
                && cols[3] == "0A"
                && cols[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()) == Some(port)
        })
    })
}

/// Starts a ping-pong server and waits until it listens on `port`.
fn start_server(program: &PathBuf, args: &[String], port: u16) -> Running {
    let server = Running::spawn(program, args);
    let deadline = Instant::now() + LISTEN_TIMEOUT;
    while !listening(port) {
        if Instant::now() >= deadline {
            let f = server.finish(Duration::ZERO);
            panic!("the server never listened on port {port}: {}", f.describe());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

/// Which implementation plays a role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Impl {
    /// Our example.
    Ours,
    /// rdma-core's C tool.
    C,
}

fn program(tool: &str, who: Impl) -> PathBuf {
    match who {
        Impl::Ours => example(tool),
        Impl::C => PathBuf::from(format!("ibv_{tool}")),
    }
}

/// The address a ping-pong side printed in its `prefix` line: (LID, QPN, PSN).
fn address(out: &str, prefix: &str) -> Option<(String, String, String)> {
    let line = out.lines().find(|l| l.starts_with(prefix))?;
    let field = |name: &str| {
        let rest = &line[line.find(name)? + name.len()..];
        Some(rest.trim_start().split(|c: char| c == ',' || c == ':' || c.is_whitespace()).next()?.to_string())
    };
    Some((field("LID")?, field("QPN")?, field("PSN")?))
}

/// Runs one ping-pong: a `server` and a `client` (each ours or the C tool) on TCP `port`, with
/// `common` arguments on both sides and `server_args`/`client_args` on one. Asserts that both
/// succeed, print the summary, and saw each other's addresses.
fn pingpong(
    tool: &str,
    server: Impl,
    client: Impl,
    port: u16,
    common: &[&str],
    server_args: &[&str],
    client_args: &[&str],
) -> (Finished, Finished) {
    require_device();
    let base =
        ["-d".to_string(), device(), "-g".to_string(), gid_index(), "-p".to_string(), port.to_string()];
    let args = |extra: &[&str]| -> Vec<String> {
        base.iter().cloned().chain(common.iter().chain(extra).map(|s| s.to_string())).collect()
    };
    let srv = start_server(&program(tool, server), &args(server_args), port);
    let mut cli_args = args(client_args);
    cli_args.push("127.0.0.1".to_string());
    let cli = Running::spawn(program(tool, client), &cli_args).finish(RUN_TIMEOUT);
    let srv = srv.finish(RUN_TIMEOUT);
    for side in [&srv, &cli] {
        side.assert_success();
        assert!(
            side.stdout.contains(" bytes in ") && side.stdout.contains(" iters in "),
            "{}",
            side.describe()
        );
        assert!(!side.stdout.contains("invalid data"), "{}", side.describe());
    }
    // Each side's remote address is the other's local one.
    for (a, b) in [(&srv, &cli), (&cli, &srv)] {
        let remote = address(&a.stdout, "  remote address:");
        let local = address(&b.stdout, "  local address:");
        assert!(remote.is_some() && remote == local, "addresses differ:\n{}\n{}", a.describe(), b.describe());
    }
    (srv, cli)
}

// ---------------------------------------------------------------------------------------------
// rc_pingpong

#[test]
fn rc_pingpong_our_server_with_c_client() {
    for (port, size) in [(18701, "1"), (18702, "4096"), (18703, "65536")] {
        pingpong("rc_pingpong", Impl::Ours, Impl::C, port, &["-n", "50", "-s", size, "-c"], &[], &[]);
    }
}

#[test]
fn rc_pingpong_our_client_with_c_server() {
    for (port, size) in [(18711, "1"), (18712, "4096"), (18713, "65536")] {
        pingpong("rc_pingpong", Impl::C, Impl::Ours, port, &["-n", "50", "-s", size, "-c"], &[], &[]);
    }
}

#[test]
fn rc_pingpong_with_events_in_both_roles() {
    let common = ["-n", "50", "-e"];
    pingpong("rc_pingpong", Impl::Ours, Impl::C, 18721, &common, &[], &[]);
    pingpong("rc_pingpong", Impl::C, Impl::Ours, 18722, &common, &[], &[]);
    // Only one side sleeping on events, the other polling.
    pingpong("rc_pingpong", Impl::Ours, Impl::C, 18723, &["-n", "50"], &["-e"], &[]);
}

#[test]
fn rc_pingpong_ours_with_ours() {
    // A small receive queue (refilled as it drains), a path MTU below the port's, and checking.
    let common = ["-n", "100", "-s", "10000", "-r", "4", "-m", "512", "-c"];
    pingpong("rc_pingpong", Impl::Ours, Impl::Ours, 18731, &common, &["-e"], &[]);
    pingpong("rc_pingpong", Impl::Ours, Impl::Ours, 18732, &["-n", "50"], &[], &["-e"]);
}

#[test]
fn rc_pingpong_small_receive_queue_with_c() {
    pingpong("rc_pingpong", Impl::Ours, Impl::C, 18733, &["-n", "50", "-r", "2"], &[], &[]);
    pingpong("rc_pingpong", Impl::C, Impl::Ours, 18734, &["-n", "50", "-r", "2"], &[], &[]);
}

// ---------------------------------------------------------------------------------------------
// ud_pingpong

#[test]
fn ud_pingpong_our_server_with_c_client() {
    pingpong("ud_pingpong", Impl::Ours, Impl::C, 18741, &["-n", "50", "-c"], &[], &[]);
    pingpong("ud_pingpong", Impl::Ours, Impl::C, 18742, &["-n", "50", "-s", "1", "-e"], &[], &[]);
}

#[test]
fn ud_pingpong_our_client_with_c_server() {
    pingpong("ud_pingpong", Impl::C, Impl::Ours, 18751, &["-n", "50", "-c"], &[], &[]);
    pingpong("ud_pingpong", Impl::C, Impl::Ours, 18752, &["-n", "50", "-s", "512", "-e"], &[], &[]);
}

#[test]
fn ud_pingpong_ours_with_ours() {
    pingpong("ud_pingpong", Impl::Ours, Impl::Ours, 18761, &["-n", "50", "-r", "4", "-c"], &["-e"], &[]);
}

// ---------------------------------------------------------------------------------------------
// devinfo and devices

/// The `name: value` lines of `ibv_devinfo` output, keyed `port N/name` inside a port section;
/// GID lines are collected apart.
fn devinfo_fields(out: &str) -> (BTreeMap<String, String>, Vec<String>) {
    let mut fields = BTreeMap::new();
    let mut gids = Vec::new();
    let mut port = None;
    for line in out.lines() {
        let t = line.trim();
        if t.starts_with("GID[") {
            gids.push(format!("{port:?} {t}"));
            continue;
        }
        let Some((key, value)) = t.split_once(':') else { continue };
        let (key, value) = (key.trim(), value.trim());
        if key == "hca_id" {
            port = None;
        }
        if key == "port" {
            port = Some(value.to_string());
        }
        let key = match &port {
            Some(p) if key != "port" => format!("port {p}/{key}"),
            _ => key.to_string(),
        };
        fields.insert(key, value.to_string());
    }
    (fields, gids)
}

const DEVICE_FIELDS: &[&str] = &[
    "hca_id",
    "transport",
    "fw_ver",
    "node_guid",
    "sys_image_guid",
    "vendor_id",
    "vendor_part_id",
    "hw_ver",
    "phys_port_cnt",
];
const PORT_FIELDS: &[&str] =
    &["state", "max_mtu", "active_mtu", "sm_lid", "port_lid", "port_lmc", "link_layer"];

#[test]
fn devinfo_matches_ibv_devinfo() {
    require_device();
    let dev = device();
    let ours = example("devinfo");
    for args in
        [vec![], vec!["-d", &dev], vec!["-v"], vec!["-d", &dev, "-v", "-i", "1"], vec!["-d", &dev, "-i", "1"]]
    {
        let c = run("ibv_devinfo", &args, ERROR_TIMEOUT);
        let r = run(&ours, &args, ERROR_TIMEOUT);
        c.assert_success();
        r.assert_success();
        let (c_fields, c_gids) = devinfo_fields(&c.stdout);
        let (r_fields, r_gids) = devinfo_fields(&r.stdout);
        assert!(c_fields.contains_key("hca_id"), "no hca_id in {}", c.describe());
        for key in DEVICE_FIELDS {
            assert_eq!(c_fields.get(*key), r_fields.get(*key), "field {key} of devinfo {args:?}");
        }
        assert!(c_fields.contains_key("port"), "no port section in {}", c.describe());
        for key in c_fields.keys().filter(|k| k.starts_with("port ")) {
            let name = key.rsplit('/').next().unwrap_or_default();
            if PORT_FIELDS.contains(&name) || args.contains(&"-v") {
                assert_eq!(c_fields.get(key), r_fields.get(key), "field {key} of devinfo {args:?}");
            }
        }
        if args.contains(&"-v") {
            assert!(!c_gids.is_empty(), "ibv_devinfo -v shows no GID: {}", c.describe());
            assert_eq!(c_gids, r_gids, "GID lines of devinfo {args:?}");
        }
        // And the whole text, tabs and all.
        assert_eq!(c.stdout, r.stdout, "output of devinfo {args:?}");
    }
    let c = run("ibv_devinfo", &["-l"], ERROR_TIMEOUT);
    let r = run(&ours, &["-l"], ERROR_TIMEOUT);
    assert_eq!(c.stdout, r.stdout, "devinfo -l");
}

#[test]
fn devices_matches_ibv_devices() {
    require_device();
    let c = run("ibv_devices", &[], ERROR_TIMEOUT);
    let r = run(example("devices"), &[], ERROR_TIMEOUT);
    c.assert_success();
    r.assert_success();
    assert!(c.stdout.contains(&device()), "{}", c.describe());
    assert_eq!(c.stdout, r.stdout);
}

// ---------------------------------------------------------------------------------------------
// Bad input and vanishing peers

#[test]
fn unknown_device_names_the_devices_present() {
    require_device();
    let dev = device();
    for tool in ["rc_pingpong", "ud_pingpong", "devinfo"] {
        let f = run(example(tool), &["-d", "nosuchdev"], ERROR_TIMEOUT);
        f.assert_failure(ERROR_TIMEOUT);
        assert!(f.stderr.contains("nosuchdev") && f.stderr.contains(&dev), "{}", f.describe());
    }
}

#[test]
fn bad_flag_values_are_rejected() {
    require_device();
    let dev = device();
    let cases: &[(&str, &[&str])] = &[
        ("rc_pingpong", &["-m", "1000"]),
        ("rc_pingpong", &["-n", "0"]),
        ("rc_pingpong", &["-s", "0"]),
        ("rc_pingpong", &["-s", "lots"]),
        ("rc_pingpong", &["-i", "0"]),
        ("rc_pingpong", &["-p", "70000"]),
        ("rc_pingpong", &["-l", "16"]),
        ("rc_pingpong", &["-r", "0"]),
        ("rc_pingpong", &["--bogus"]),
        ("rc_pingpong", &["a", "b"]),
        ("rc_pingpong", &["-d", &dev, "-i", "9"]),
        ("rc_pingpong", &["-d", &dev, "-g", "999"]),
        ("ud_pingpong", &["-d", &dev, "-s", "65536"]),
        ("ud_pingpong", &["-n", "0"]),
        ("devinfo", &["-i", "0"]),
        ("devinfo", &["-d", &dev, "-i", "9"]),
        ("devices", &["extra"]),
    ];
    for (tool, args) in cases {
        let f = run(example(tool), args, ERROR_TIMEOUT);
        f.assert_failure(ERROR_TIMEOUT);
        assert!(!f.stderr.trim().is_empty(), "no error message: {}", f.describe());
    }
}

#[test]
fn client_gives_up_when_no_server_listens() {
    require_device();
    let port = 18799;
    assert!(!listening(port), "port {port} is in use");
    for tool in ["rc_pingpong", "ud_pingpong"] {
        let args = ["-d", &device(), "-g", &gid_index(), "-p", "18799", "--timeout", "2", "127.0.0.1"];
        let f = run(example(tool), &args, ERROR_TIMEOUT);
        f.assert_failure(ERROR_TIMEOUT);
        assert!(f.elapsed >= Duration::from_secs(2), "gave up before its timeout: {}", f.describe());
        assert!(f.stderr.contains("Couldn't connect"), "{}", f.describe());
    }
}

/// Starts a long ping-pong between `server` and `client`, kills the `victim` side once the run is
/// under way, and asserts that the survivor (one of ours, with `--timeout 3`) fails promptly.
fn survivor_fails_when_peer_vanishes(tool: &str, port: u16, server: Impl, client: Impl, kill_client: bool) {
    require_device();
    let base =
        ["-d".to_string(), device(), "-g".to_string(), gid_index(), "-p".to_string(), port.to_string()];
    let args = |who: Impl, host: bool| {
        let mut a: Vec<String> = base.to_vec();
        a.extend(["-n".to_string(), "100000000".to_string()]);
        if who == Impl::Ours {
            a.extend(["--timeout".to_string(), "3".to_string()]);
        }
        if host {
            a.push("127.0.0.1".to_string());
        }
        a
    };
    let mut srv = start_server(&program(tool, server), &args(server, false), port);
    let mut cli = Running::spawn(program(tool, client), &args(client, true));
    let (survivor_out, survivor_is_server) = if kill_client { (&srv, true) } else { (&cli, false) };
    assert!(
        survivor_out.wait_for_line("remote address", RUN_TIMEOUT),
        "the exchange did not happen ({tool}, survivor is the {})",
        if survivor_is_server { "server" } else { "client" }
    );
    std::thread::sleep(Duration::from_millis(500)); // let the ping-pong run
    let within = Duration::from_secs(3) + ERROR_TIMEOUT;
    let survivor = if kill_client {
        cli.kill();
        let killed_at = Instant::now();
        let f = srv.finish(within);
        drop(cli);
        (f, killed_at)
    } else {
        srv.kill();
        let killed_at = Instant::now();
        let f = cli.finish(within);
        drop(srv);
        (f, killed_at)
    };
    let (f, killed_at) = survivor;
    assert!(!f.timed_out, "the survivor hung after its peer vanished: {}", f.describe());
    assert!(f.status.is_some_and(|s| !s.success()), "the survivor did not fail: {}", f.describe());
    assert!(killed_at.elapsed() <= within, "{}", f.describe());
    assert!(!f.stderr.trim().is_empty(), "no error message: {}", f.describe());
    eprintln!("{}", f.describe()); // shown with --nocapture
}

#[test]
fn rc_server_fails_when_its_client_vanishes() {
    survivor_fails_when_peer_vanishes("rc_pingpong", 18771, Impl::Ours, Impl::C, true);
}

#[test]
fn rc_client_fails_when_its_server_vanishes() {
    survivor_fails_when_peer_vanishes("rc_pingpong", 18772, Impl::C, Impl::Ours, false);
}

#[test]
fn ud_server_fails_when_its_client_vanishes() {
    survivor_fails_when_peer_vanishes("ud_pingpong", 18773, Impl::Ours, Impl::Ours, true);
}

// ---------------------------------------------------------------------------------------------
// Bad peers, dead peers and bad input: every example fails clearly (one message, non-zero exit,
// no panic) and promptly, in both roles. Fake peers are raw TCP sockets of this test: silent,
// speaking garbage, closing early, or frozen with SIGSTOP (a stopped process keeps its socket
// open and sends nothing, as a dead host: no FIN, no RST).

use std::io::Write as _;
use std::net::{TcpListener, TcpStream};

/// The perftest-style examples.
const PERF: [&str; 5] = ["write_bw", "read_bw", "send_bw", "write_lat", "send_lat"];
/// Every example that talks to a peer.
const NETWORKED: [&str; 7] =
    ["rc_pingpong", "ud_pingpong", "write_bw", "read_bw", "send_bw", "write_lat", "send_lat"];

/// How long a prompt failure may take (process start-up and device opening under TCG included).
const PROMPTLY: Duration = Duration::from_secs(5);

fn is_perf(tool: &str) -> bool {
    PERF.contains(&tool)
}

/// Arguments choosing the device (and GID index) for `tool`, with TCP port `port`.
fn device_args(tool: &str, port: u16) -> Vec<String> {
    let gid_flag = if is_perf(tool) { "-x" } else { "-g" };
    vec!["-d".into(), device(), gid_flag.into(), gid_index(), "-p".into(), port.to_string()]
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

impl Finished {
    /// A failure as a user should see it: by itself, non-zero, within `within`, with a message
    /// on stderr and no panic.
    fn assert_clean_failure(&self, within: Duration) {
        self.assert_failure(within);
        assert!(!self.stderr.trim().is_empty(), "no error message: {}", self.describe());
        assert!(
            !self.stderr.contains("panicked") && self.status.and_then(|s| s.code()) != Some(101),
            "it panicked: {}",
            self.describe()
        );
        assert!(!self.stderr.contains("os error 11"), "an unexplained EAGAIN: {}", self.describe());
    }
}

/// Runs `check` for every tool (with its index), all of them even when some fail, then fails
/// naming those that did (their panic messages are printed as they happen).
fn for_each_tool(tools: &[&str], check: impl Fn(&str, u16)) {
    let mut failed = Vec::new();
    for (i, &tool) in tools.iter().enumerate() {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(tool, i as u16))).is_err() {
            failed.push(tool);
        }
    }
    assert!(failed.is_empty(), "failed for {failed:?} (see above)");
}

/// Connects a raw TCP client to a server of ours once it listens on `port`.
fn raw_client(server: &Running, port: u16) -> TcpStream {
    let deadline = Instant::now() + LISTEN_TIMEOUT;
    while !listening(port) {
        assert!(Instant::now() < deadline, "`{}` never listened on port {port}", server.what);
        std::thread::sleep(Duration::from_millis(20));
    }
    TcpStream::connect(("127.0.0.1", port)).expect("connecting to the server")
}

/// A fake server on `port`: accepts one client (waiting at most RUN_TIMEOUT).
fn fake_server(port: u16) -> TcpListener {
    TcpListener::bind(("127.0.0.1", port)).expect("binding the fake server")
}

fn accept_one(listener: &TcpListener) -> TcpStream {
    listener.set_nonblocking(true).expect("nonblocking listener");
    let deadline = Instant::now() + RUN_TIMEOUT;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).expect("blocking stream");
                return s;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(Instant::now() < deadline, "the client never connected");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// Reads what the peer sends until it closes (or 60 s pass), so that our side of the socket
/// stays open meanwhile.
fn drain(mut s: TcpStream) {
    let _ = s.set_read_timeout(Some(RUN_TIMEOUT));
    let mut buf = [0u8; 4096];
    while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
}

/// The address message of the pingpong tools with a multi-byte UTF-8 character in its GID.
fn euro_address() -> Vec<u8> {
    let mut m = b"0000:000011:abcdef:".to_vec();
    m.extend("€".bytes());
    m.extend([b'0'; 29]);
    m.push(0);
    assert_eq!(m.len(), 52);
    m
}

#[test]
fn perf_servers_check_device_port_and_gid_before_waiting_for_a_client() {
    require_device();
    let dev = device();
    let bad: [&[&str]; 4] =
        [&["-d", "nosuch0"], &["-d", &dev, "-i", "0"], &["-d", &dev, "-i", "9"], &["-d", &dev, "-x", "200"]];
    for_each_tool(&PERF, |tool, i| {
        for (j, bad) in bad.iter().enumerate() {
            let mut args = strings(bad);
            args.extend(["-p".to_string(), (18800 + 4 * i + j as u16).to_string()]);
            let f = Running::spawn(example(tool), &args).finish(Duration::from_secs(2));
            f.assert_clean_failure(Duration::from_secs(2));
            let named = bad.last().copied().unwrap_or_default();
            assert!(f.stderr.contains(named), "the message does not name {named:?}: {}", f.describe());
            eprintln!("{tool} {}: {:.1} s: {}", bad.join(" "), f.elapsed.as_secs_f64(), f.stderr.trim());
        }
    });
}

#[test]
fn pingpong_servers_reject_a_multibyte_gid_without_panicking() {
    require_device();
    for_each_tool(&["rc_pingpong", "ud_pingpong"], |tool, i| {
        let act = |mut s: TcpStream| {
            let _ = s.write_all(&euro_address());
            drain(s);
        };
        let f = server_vs_raw_client(tool, 18821 + i, "30", act, PROMPTLY);
        f.assert_clean_failure(PROMPTLY);
        eprintln!("{tool} server: {}", f.stderr.trim());
    });
}

#[test]
fn pingpong_clients_reject_a_multibyte_gid_without_panicking() {
    require_device();
    for_each_tool(&["rc_pingpong", "ud_pingpong"], |tool, i| {
        let act = |mut s: TcpStream| {
            let mut theirs = [0u8; 52];
            if s.read_exact(&mut theirs).is_ok() {
                let _ = s.write_all(&euro_address());
            }
            drain(s);
        };
        let f = client_vs_fake_server(tool, 18823 + i, "30", act, PROMPTLY);
        f.assert_clean_failure(PROMPTLY);
        eprintln!("{tool} client: {}", f.stderr.trim());
    });
}

/// Starts `tool` as a server with `--timeout timeout`, connects a raw client that does `act`
/// with the socket, and returns how the server ended (killed after `within`).
fn server_vs_raw_client(
    tool: &str,
    port: u16,
    timeout: &str,
    act: impl FnOnce(TcpStream) + Send + 'static,
    within: Duration,
) -> Finished {
    let mut args = device_args(tool, port);
    args.extend(strings(&["--timeout", timeout]));
    let server = Running::spawn(example(tool), &args);
    let s = raw_client(&server, port);
    let keep = std::thread::spawn(move || act(s));
    let f = server.finish(within);
    let _ = keep.join();
    f
}

/// Starts `tool` as a client with `--timeout timeout` towards a fake server that does `act` with
/// the accepted socket, and returns how the client ended (killed after `within`).
fn client_vs_fake_server(
    tool: &str,
    port: u16,
    timeout: &str,
    act: impl FnOnce(TcpStream) + Send + 'static,
    within: Duration,
) -> Finished {
    let listener = fake_server(port);
    let mut args = device_args(tool, port);
    args.extend(strings(&["--timeout", timeout, "127.0.0.1"]));
    let client = Running::spawn(example(tool), &args);
    let s = accept_one(&listener);
    let keep = std::thread::spawn(move || act(s));
    let f = client.finish(within);
    let _ = keep.join();
    f
}

#[test]
fn servers_fail_promptly_when_the_client_speaks_garbage() {
    require_device();
    for_each_tool(&NETWORKED, |tool, i| {
        let act = |mut s: TcpStream| {
            let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n");
            drain(s);
        };
        let f = server_vs_raw_client(tool, 18830 + i, "30", act, PROMPTLY);
        f.assert_clean_failure(PROMPTLY);
        eprintln!("{tool} server: {}", f.stderr.trim());
    });
}

#[test]
fn clients_fail_promptly_when_the_server_speaks_garbage() {
    require_device();
    for_each_tool(&NETWORKED, |tool, i| {
        let act = |mut s: TcpStream| {
            let _ = s.write_all(b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n");
            drain(s);
        };
        let f = client_vs_fake_server(tool, 18910 + i, "30", act, PROMPTLY);
        f.assert_clean_failure(PROMPTLY);
        eprintln!("{tool} client: {}", f.stderr.trim());
    });
}

#[test]
fn servers_fail_promptly_when_the_client_closes_early() {
    require_device();
    for_each_tool(&NETWORKED, |tool, i| {
        for (j, partial) in [&b""[..], b"0000:00"].into_iter().enumerate() {
            let act = move |mut s: TcpStream| {
                let _ = s.write_all(partial);
            };
            let f = server_vs_raw_client(tool, 18840 + 2 * i + j as u16, "30", act, PROMPTLY);
            f.assert_clean_failure(PROMPTLY);
            assert!(
                f.stderr.contains("closed"),
                "the message does not say the peer closed: {}",
                f.describe()
            );
            eprintln!("{tool} server: {}", f.stderr.trim());
        }
    });
}

#[test]
fn clients_fail_promptly_when_the_server_closes_early() {
    require_device();
    for_each_tool(&NETWORKED, |tool, i| {
        let f = client_vs_fake_server(tool, 18920 + i, "30", drop, PROMPTLY);
        f.assert_clean_failure(PROMPTLY);
        assert!(f.stderr.contains("closed"), "the message does not say the peer closed: {}", f.describe());
        eprintln!("{tool} client: {}", f.stderr.trim());
    });
}

#[test]
fn servers_give_up_on_a_silent_client_after_their_timeout() {
    require_device();
    let within = Duration::from_secs(3) + PROMPTLY;
    for_each_tool(&NETWORKED, |tool, i| {
        let f = server_vs_raw_client(tool, 18860 + i, "3", drain, within);
        f.assert_clean_failure(within);
        assert!(f.elapsed >= Duration::from_secs(3), "gave up before its timeout: {}", f.describe());
        assert!(f.stderr.contains("3 s"), "the message does not say how long it waited: {}", f.describe());
        eprintln!("{tool} server: {}", f.stderr.trim());
    });
}

#[test]
fn clients_give_up_on_a_silent_server_after_their_timeout() {
    require_device();
    let within = Duration::from_secs(3) + PROMPTLY;
    for_each_tool(&NETWORKED, |tool, i| {
        let f = client_vs_fake_server(tool, 18870 + i, "3", drain, within);
        f.assert_clean_failure(within);
        assert!(f.stderr.contains("3 s"), "the message does not say how long it waited: {}", f.describe());
        eprintln!("{tool} client: {}", f.stderr.trim());
    });
}

#[test]
fn servers_fail_when_their_client_freezes_mid_run() {
    require_device();
    for_each_tool(&NETWORKED, |tool, i| {
        let port = 18880 + i;
        // Runs of minutes (the perf examples keep a timestamp per message: keep their memory small).
        let iters = if is_perf(tool) { "1000000" } else { "100000000" };
        let mut args = device_args(tool, port);
        args.extend(strings(&["--timeout", "3", "-n", iters]));
        if tool.ends_with("_bw") {
            args.extend(strings(&["-s", "65536"]));
        }
        let server = Running::spawn(example(tool), &args);
        let deadline = Instant::now() + LISTEN_TIMEOUT;
        while !listening(port) {
            assert!(Instant::now() < deadline, "{tool} never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        args.push("127.0.0.1".into());
        let client = Running::spawn(example(tool), &args);
        let started = if is_perf(tool) { "#bytes" } else { "remote address" };
        assert!(server.wait_for_line(started, RUN_TIMEOUT), "{tool}: the run never started");
        std::thread::sleep(Duration::from_millis(1000));
        client.freeze();
        let frozen_at = Instant::now();
        let within = Duration::from_secs(3) + PROMPTLY;
        let f = server.finish(within + Duration::from_secs(5));
        let took = frozen_at.elapsed();
        drop(client);
        f.assert_clean_failure(RUN_TIMEOUT);
        assert!(took <= within, "{tool} server took {took:?} after its client froze: {}", f.describe());
        eprintln!("{tool} server, {:.1} s after its client froze: {}", took.as_secs_f64(), f.stderr.trim());
    });
}

#[test]
fn rc_pingpong_with_an_oversized_message_fails_with_a_message() {
    require_device();
    // 1.5 GB: one buffer fits in the test VM's 2 GiB (the C tool's choice); two did not and the
    // kernel's OOM killer ended the process without a word. 4 GiB - 1 cannot fit at all.
    for (port, size) in [(18891, "1500000000"), (18892, "4294967295")] {
        let mut args = device_args("rc_pingpong", port);
        args.extend(strings(&["-s", size, "--timeout", "5"]));
        let f = Running::spawn(example("rc_pingpong"), &args).finish(RUN_TIMEOUT);
        // Either it cannot get the memory, or it has it and gives up waiting for a client.
        f.assert_clean_failure(RUN_TIMEOUT);
        eprintln!("rc_pingpong -s {size}: {:.1} s: {}", f.elapsed.as_secs_f64(), f.stderr.trim());
    }
}

/// A frame of our perf examples' out-of-band protocol: tag, big-endian length, payload.
fn frame(tag: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![tag];
    f.extend((payload.len() as u32).to_be_bytes());
    f.extend(payload);
    f
}

/// The `Hello` payload of write_bw (test 1) with `size` bytes, `qps` queue pairs, 5 iterations.
fn write_bw_hello(size: u64, qps: u64) -> Vec<u8> {
    // test, size, all, iters, qps, tx depth, rx depth, cq mod, post list, inline, mtu, raw
    let words: [u64; 12] = [1, size, 0, 5, qps, 128, 512, 0, 1, 0, 0, 1];
    words.iter().flat_map(|w| w.to_be_bytes()).collect()
}

#[test]
fn perf_server_asked_for_more_memory_than_there_is_fails_with_a_message() {
    require_device();
    let act = |mut s: TcpStream| {
        let _ = s.write_all(&frame(1, &write_bw_hello(1_500_000_000, 2)));
        drain(s);
    };
    let f = server_vs_raw_client("write_bw", 18893, "30", act, RUN_TIMEOUT);
    f.assert_clean_failure(RUN_TIMEOUT);
    eprintln!("write_bw server: {}", f.stderr.trim());
}
