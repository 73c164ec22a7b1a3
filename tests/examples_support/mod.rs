//! Helpers of the device tests of the examples (`device_examples.rs`, `device_example_faults.rs`):
//! finding the example binaries, running them under deadlines with their output collected, and
//! waiting for servers to listen.
#![allow(dead_code)] // each test binary uses a part of this module

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long one ping-pong process may run (they take well under a second; TCG is slow).
pub const RUN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a server may take to start listening.
pub const LISTEN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failing command may take to report its error.
pub const ERROR_TIMEOUT: Duration = Duration::from_secs(20);

pub fn device() -> String {
    std::env::var("IBVERBS_TEST_DEVICE").unwrap_or_else(|_| "rxe0".to_string())
}

pub fn gid_index() -> String {
    std::env::var("IBVERBS_TEST_GID_INDEX").unwrap_or_else(|_| "1".to_string())
}

/// Fails the test unless the test device can be opened.
pub fn require_device() {
    let name = device();
    ibverbs::Context::open(Some(&name)).unwrap_or_else(|e| {
        panic!("these tests need the RDMA device {name:?} ({e}); run them with `cargo xtask test`")
    });
}

/// The path of a bundled example, next to this test binary: `target/<profile>/examples/<name>`.
pub fn example(name: &str) -> PathBuf {
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
pub struct Running {
    pub what: String,
    child: Option<Child>,
    started: Instant,
    lines: mpsc::Receiver<String>,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
}

/// How a child process ended.
#[derive(Debug)]
pub struct Finished {
    pub what: String,
    pub status: Option<ExitStatus>,
    pub timed_out: bool,
    pub elapsed: Duration,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    pub fn describe(&self) -> String {
        let how = match (self.timed_out, self.status) {
            (true, _) => format!("killed after {:.1} s (timed out)", self.elapsed.as_secs_f64()),
            (false, Some(s)) => format!("{s} after {:.1} s", self.elapsed.as_secs_f64()),
            (false, None) => "not waited for".to_string(),
        };
        format!("`{}`: {how}\n--- stdout:\n{}--- stderr:\n{}---", self.what, self.stdout, self.stderr)
    }

    pub fn assert_success(&self) {
        assert!(self.success(), "expected success: {}", self.describe());
    }

    /// Asserts that it failed by itself (non-zero exit, not killed by us) within `within`.
    pub fn assert_failure(&self, within: Duration) {
        assert!(!self.timed_out, "expected a prompt failure, but it hung: {}", self.describe());
        assert!(self.status.is_some_and(|s| !s.success()), "expected a non-zero exit: {}", self.describe());
        assert!(self.elapsed <= within, "expected failure within {within:?}: {}", self.describe());
    }
}

impl Running {
    pub fn spawn(program: impl AsRef<OsStr>, args: &[String]) -> Running {
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
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> bool {
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
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Stops the child with SIGSTOP: it keeps its sockets open but never answers again, as a
    /// host that died (no FIN, no RST) looks to its peer.
    pub fn freeze(&self) {
        let pid = self.pid();
        assert!(pid > 0, "no child to stop");
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0, "SIGSTOP {pid}");
    }

    /// Kills the child now.
    pub fn kill(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
        }
    }

    /// Waits for the child to exit, killing it after `timeout`.
    pub fn finish(mut self, timeout: Duration) -> Finished {
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
pub fn run(program: impl AsRef<OsStr>, args: &[&str], timeout: Duration) -> Finished {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    Running::spawn(program, &args).finish(timeout)
}

/// Whether a TCP socket listens on `port` (read from /proc: the C client does not retry, so a
/// server must be listening before it starts).
pub fn listening(port: u16) -> bool {
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
pub fn start_server(program: &PathBuf, args: &[String], port: u16) -> Running {
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

impl Finished {
    /// A failure as a user should see it: by itself, non-zero, within `within`, with a message
    /// on stderr and no panic.
    pub fn assert_clean_failure(&self, within: Duration) {
        self.assert_failure(within);
        assert!(!self.stderr.trim().is_empty(), "no error message: {}", self.describe());
        assert!(
            !self.stderr.contains("panicked") && self.status.and_then(|s| s.code()) != Some(101),
            "it panicked: {}",
            self.describe()
        );
        assert!(!self.stderr.contains("(os error 11)"), "an unexplained EAGAIN: {}", self.describe());
    }
}
