//! Device tests of the RDMA-CM examples (`rping`, `rdma_server`, `rdma_client`, `mcast`) against
//! rdma-core's tools (rdmacm-utils) and each other, in both roles, over SoftRoCE (rxe0 on dummy0
//! at 192.0.2.1) and soft-iWARP (the siw stage), and of `async_rpc -R`. The examples run as
//! child processes: this binary opens no device itself, so the valgrind pass leaves it out
//! (`CHILD_ONLY` in `xtask/src/test.rs`); the library code they use runs in-process under
//! valgrind in `tests/device_cm.rs`.

mod common;

use std::time::Duration;

use common::*;

const HOST: &str = "192.0.2.1";

// ---- rping: our example against rdma-core's `rping` (rdmacm-utils), both roles ----

mod rping {
    use std::io::{BufRead, BufReader, Read};
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::sync::mpsc;
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    use super::scaled;

    /// How long one rping run may take (three pings of 64 KiB take well under a second; TCG
    /// is slow).
    pub fn run_timeout() -> Duration {
        scaled(Duration::from_secs(60))
    }

    /// Our example, next to this test binary: `target/<profile>/examples/rping`.
    pub fn ours() -> PathBuf {
        example("rping")
    }

    /// One of our examples, next to this test binary: `target/<profile>/examples/<name>`.
    pub fn example(name: &str) -> PathBuf {
        let exe = std::env::current_exe().expect("the test binary's path");
        let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>/deps/<test>");
        let path = dir.join("examples").join(name);
        assert!(path.is_file(), "{} is missing: `cargo build --examples` first", path.display());
        path
    }

    /// A child process whose output is collected; killed when dropped.
    pub struct Proc {
        what: String,
        child: Option<Child>,
        started: Instant,
        lines: mpsc::Receiver<String>,
        out: Option<JoinHandle<String>>,
        err: Option<JoinHandle<String>>,
    }

    #[derive(Debug)]
    pub struct Done {
        pub what: String,
        pub ok: bool,
        pub exited: bool,
        pub elapsed: Duration,
        pub stdout: String,
        pub stderr: String,
    }

    impl Done {
        pub fn assert_ok(&self) {
            assert!(self.ok, "expected success: {self:#?}");
        }
        pub fn assert_failed_within(&self, bound: Duration) {
            assert!(self.exited && !self.ok, "expected a clean failure: {self:#?}");
            assert!(self.elapsed <= bound, "expected failure within {bound:?}: {self:#?}");
            assert!(!self.stderr.contains("panicked"), "a panic: {self:#?}");
        }
        pub fn count(&self, needle: &str) -> usize {
            self.stdout.lines().filter(|l| l.contains(needle)).count()
        }
    }

    impl Proc {
        pub fn spawn(program: impl Into<PathBuf>, args: &[&str]) -> Proc {
            let program = program.into();
            let what = format!("{} {}", program.display(), args.join(" "));
            let mut child = Command::new(&program)
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run `{what}`: {e} (is rdmacm-utils installed?)"));
            let (tx, lines) = mpsc::channel();
            let o = child.stdout.take().unwrap();
            let out = std::thread::spawn(move || {
                let mut all = String::new();
                for line in BufReader::new(o).lines() {
                    let Ok(line) = line else { break };
                    all.push_str(&line);
                    all.push('\n');
                    let _ = tx.send(line);
                }
                all
            });
            let mut e = child.stderr.take().unwrap();
            let err = std::thread::spawn(move || {
                let mut all = Vec::new();
                let _ = e.read_to_end(&mut all);
                String::from_utf8_lossy(&all).into_owned()
            });
            Proc { what, child: Some(child), started: Instant::now(), lines, out: Some(out), err: Some(err) }
        }

        pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> bool {
            let deadline = Instant::now() + timeout;
            loop {
                match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(l) if l.contains(needle) => return true,
                    Ok(_) => {}
                    Err(_) => return false,
                }
            }
        }

        pub fn finish(mut self, timeout: Duration) -> Done {
            let mut child = self.child.take().unwrap();
            let deadline = Instant::now() + timeout;
            let (status, exited) = loop {
                match child.try_wait() {
                    Ok(Some(s)) => break (Some(s), true),
                    Ok(None) if Instant::now() >= deadline => {
                        let _ = child.kill();
                        break (child.wait().ok(), false);
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                    Err(_) => break (None, false),
                }
            };
            let elapsed = self.started.elapsed();
            let stdout = self.out.take().and_then(|h| h.join().ok()).unwrap_or_default();
            let stderr = self.err.take().and_then(|h| h.join().ok()).unwrap_or_default();
            Done {
                what: std::mem::take(&mut self.what),
                ok: exited && status.is_some_and(|s| s.success()),
                exited,
                elapsed,
                stdout,
                stderr,
            }
        }
    }

    impl Drop for Proc {
        fn drop(&mut self) {
            if let Some(mut c) = self.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

use rping::{example, ours, run_timeout, Proc};

/// One rping run: a server and a client (ours or C) on `port` with `-S size`, three pings with
/// verification; both must succeed and print every ping.
fn rping_run(server_ours: bool, client_ours: bool, port: u16, size: u32) {
    let p = port.to_string();
    let s = size.to_string();
    let c_rping = std::path::PathBuf::from("rping");
    let server_prog = if server_ours { ours() } else { c_rping.clone() };
    let client_prog = if client_ours { ours() } else { c_rping };
    let server = Proc::spawn(server_prog, &["-s", "-a", HOST, "-p", &p, "-S", &s, "-v"]);
    if server_ours {
        assert!(server.wait_for_line("listening on", run_timeout()), "our server never listened");
    } else {
        // The C server prints nothing when ready; our client retries a rejected connection,
        // the C client does not.
        std::thread::sleep(scaled(Duration::from_millis(500)));
    }
    let client = Proc::spawn(client_prog, &["-c", "-a", HOST, "-p", &p, "-S", &s, "-C", "3", "-V", "-v"]);
    let c = client.finish(run_timeout());
    let sv = server.finish(run_timeout());
    c.assert_ok();
    sv.assert_ok();
    assert_eq!(c.count("ping data: "), 3, "{c:#?}");
    assert_eq!(sv.count("server ping data: "), 3, "{sv:#?}");
    for i in 0..3 {
        let want = format!("rdma-ping-{i}: ");
        if size as usize > want.len() {
            assert!(c.stdout.contains(&want), "ping {i} missing: {c:#?}");
        }
    }
    eprintln!("{} <-> {} -S {size}: ok\n{}", sv.what, c.what, c.stdout.lines().next().unwrap_or(""));
}

#[test]
fn rping_our_server_with_c_client() {
    for (i, size) in [26, 4096, 65535].into_iter().enumerate() {
        rping_run(true, false, 7300 + i as u16, size);
    }
}

#[test]
fn rping_c_server_with_our_client() {
    for (i, size) in [26, 4096, 65535].into_iter().enumerate() {
        rping_run(false, true, 7310 + i as u16, size);
    }
}

#[test]
fn rping_ours_with_ours() {
    for (i, size) in [1, 4096, 65536].into_iter().enumerate() {
        rping_run(true, true, 7320 + i as u16, size);
    }
}

#[test]
fn rping_client_without_server_fails_within_its_timeout() {
    let c = Proc::spawn(ours(), &["-c", "-a", HOST, "-p", "7330", "-C", "1", "--timeout", "2"]);
    let d = c.finish(run_timeout());
    d.assert_failed_within(scaled(Duration::from_secs(8)));
    assert!(d.stderr.contains("rejected"), "{d:#?}");
}

/// A persistent server (`-P`) waits for its next client past `--timeout`, as the C tool does,
/// and serves clients one after the other; a plain server gives up at its timeout.
#[test]
fn a_persistent_rping_server_waits_past_its_timeout_for_each_client() {
    let server = Proc::spawn(ours(), &["-s", "-P", "-a", HOST, "-p", "7332", "-v", "--timeout", "1"]);
    assert!(server.wait_for_line("listening on", run_timeout()), "our server never listened");
    for round in 0..2 {
        // Longer than the server's --timeout before each client.
        std::thread::sleep(Duration::from_millis(2500));
        let c = Proc::spawn(ours(), &["-c", "-a", HOST, "-p", "7332", "-C", "2", "-V", "--timeout", "10"]);
        c.finish(run_timeout()).assert_ok();
        eprintln!("client {round} served");
    }
    // Still waiting for the next: stopped by the test (finish kills it at the bound).
    let sv = server.finish(Duration::from_millis(500));
    assert!(!sv.exited, "the persistent server left on its own: {sv:#?}");
    assert_eq!(sv.count("server ping data: "), 4, "two pings of each client: {sv:#?}");
    let plain = Proc::spawn(ours(), &["-s", "-a", HOST, "-p", "7333", "--timeout", "1"]);
    let d = plain.finish(run_timeout());
    d.assert_failed_within(scaled(Duration::from_secs(8)));
    assert!(d.stderr.contains("no client within"), "{d:#?}");
}

#[test]
fn rping_mismatched_sizes_fail_cleanly_on_both_sides() {
    let server = Proc::spawn(ours(), &["-s", "-a", HOST, "-p", "7331", "-S", "64", "--timeout", "5"]);
    assert!(server.wait_for_line("listening on", run_timeout()));
    let client =
        Proc::spawn(ours(), &["-c", "-a", HOST, "-p", "7331", "-S", "4096", "-C", "2", "--timeout", "5"]);
    let sv = server.finish(run_timeout());
    let c = client.finish(run_timeout());
    let bound = scaled(Duration::from_secs(20));
    sv.assert_failed_within(bound);
    assert!(sv.stderr.contains("advertises 4096 bytes"), "{sv:#?}");
    c.assert_failed_within(bound);
}

#[test]
fn rping_server_without_client_gives_up_within_its_timeout() {
    let s = Proc::spawn(ours(), &["-s", "-a", HOST, "-p", "7332", "--timeout", "2"]);
    let d = s.finish(run_timeout());
    d.assert_failed_within(scaled(Duration::from_secs(8)));
    assert!(d.stderr.contains("no client"), "{d:#?}");
}

/// rdma_server/rdma_client (one 16-byte message each way), ours or C on each side.
fn rdma_server_client(server_ours: bool, client_ours: bool, port: u16) {
    let p = port.to_string();
    let prog = |ours: bool, name: &str| if ours { example(name) } else { std::path::PathBuf::from(name) };
    let server = Proc::spawn(prog(server_ours, "rdma_server"), &["-s", HOST, "-p", &p]);
    if server_ours {
        assert!(server.wait_for_line("listening on", run_timeout()), "our server never listened");
    } else {
        std::thread::sleep(scaled(Duration::from_millis(500)));
    }
    // A generous bound for ours: a lost CM message (seen once in ~80 runs against the C server,
    // whose rdma_accept waits for the RTU before it answers) is retried by the kernel's CM only
    // after seconds.
    let mut args = vec!["-s", HOST, "-p", &p];
    if client_ours {
        args.extend(["--timeout", "40"]);
    }
    let c = Proc::spawn(prog(client_ours, "rdma_client"), &args).finish(run_timeout());
    let s = server.finish(run_timeout());
    assert!(c.ok && s.ok, "expected success:\n{c:#?}\n{s:#?}");
    assert!(c.stdout.contains("rdma_client: end 0"), "{c:#?}");
    assert!(s.stdout.contains("rdma_server: end 0"), "{s:#?}");
}

#[test]
fn rdma_server_ours_with_c_client() {
    rdma_server_client(true, false, 7340);
}

#[test]
fn rdma_client_ours_with_c_server() {
    rdma_server_client(false, true, 7341);
}

#[test]
fn rdma_server_and_client_ours_with_ours() {
    rdma_server_client(true, true, 7342);
}

// ---- async_rpc -R: the async adaptor's example over queue pairs connected by RDMA-CM ----

/// `async_rpc -R` (built with the `tokio` feature): the server's and the client's queue pairs
/// connect through RDMA-CM (the one way on iWARP) and the client's 300 requests are answered.
/// Then `-R` on one side only: both sides fail within their `--timeout`, the side without `-R`
/// saying why (on iWARP it refuses before it exchanges anything; elsewhere the exchange tells
/// each side that the other differs).
#[test]
fn async_rpc_connects_through_rdma_cm() {
    let prog = example("async_rpc");
    let dev = test_device_name();
    let server = Proc::spawn(&prog, &["-R", "-d", &dev, "-p", "18791", "--timeout", "20"]);
    assert!(server.wait_for_line("waiting for a client", run_timeout()), "the server never listened");
    let client_args = ["-R", "-d", &dev, "-p", "18791", "--timeout", "20", "-n", "300", "-c", "8", HOST];
    let c = Proc::spawn(&prog, &client_args).finish(run_timeout());
    let s = server.finish(run_timeout());
    c.assert_ok();
    s.assert_ok();
    assert!(c.stdout.contains("requests/s; latency p50"), "{c:#?}");
    assert!(s.stdout.contains("answered 300 requests"), "{s:#?}");

    let bound = scaled(Duration::from_secs(3 + 5));
    let server = Proc::spawn(&prog, &["-R", "-d", &dev, "-p", "18792", "--timeout", "3"]);
    assert!(server.wait_for_line("waiting for a client", run_timeout()), "the server never listened");
    let c = Proc::spawn(&prog, &["-d", &dev, "-p", "18792", "--timeout", "3", "-n", "30", HOST])
        .finish(run_timeout());
    let s = server.finish(run_timeout());
    c.assert_failed_within(bound);
    s.assert_failed_within(bound);
    assert!(c.stderr.contains("-R"), "the client says why: {c:#?}");
}

// ---- mcast: our example against rdma-core's `mckey` (rdmacm-utils), both roles ----

/// How many datagrams of how many bytes each mcast run sends: mckey's default size, twice its
/// default count.
const MCAST_COUNT: &str = "20";
const MCAST_SIZE: &str = "100";

/// `mckey` with its stdout line-buffered (through coreutils' `stdbuf`), so that its "joined"
/// line can be waited for.
fn mckey(args: &[&str]) -> Proc {
    let mut a = vec!["-oL", "mckey"];
    a.extend_from_slice(args);
    Proc::spawn("stdbuf", &a)
}

/// One multicast run on `group` (an address of its own per test): a receiver (ours or `mckey`)
/// posts its receives and joins; then a sender (ours or `mckey`) joins and sends 20 datagrams of
/// 100 bytes to the group through RDMA-CM; both must succeed. Our receiver checks every
/// datagram (length, GRH: IPv4/UDP to the group from this host, immediate data = the sender's
/// QP number, the same sender throughout) and every payload byte: our sender's pattern, or for
/// `mckey`, which sends one unwritten buffer, the same bytes in every datagram. `mckey` as the
/// receiver checks only the count (it prints "data transfers complete" once it has them all).
fn mcast_run(sender_ours: bool, receiver_ours: bool, group: &str) {
    let ours = example("mcast");
    let dev = test_device_name();
    let base = ["-m", group, "-b", HOST, "-C", MCAST_COUNT, "-S", MCAST_SIZE];
    if dev.starts_with("siw") {
        // iWARP has no UD queue pairs: our example says so and fails cleanly, within its bound.
        let r = Proc::spawn(&ours, &base).finish(run_timeout());
        r.assert_failed_within(run_timeout());
        assert!(r.stderr.contains("rdma_create_qp"), "{r:#?}");
        unsupported_on(&dev, "multicast (UD) through RDMA-CM", "iWARP has no UD queue pairs");
        return;
    }
    let receiver = if receiver_ours {
        let mut a = base.to_vec();
        a.extend(["--timeout", "60", "--from", HOST, "--peer", if sender_ours { "ours" } else { "mckey" }]);
        let p = Proc::spawn(&ours, &a);
        assert!(p.wait_for_line("mcast: joined", run_timeout()), "our receiver never joined");
        p
    } else {
        let p = mckey(&base);
        assert!(p.wait_for_line("mckey: joined", run_timeout()), "mckey never joined");
        p
    };
    let sender = if sender_ours {
        let mut a = base.to_vec();
        a.extend(["-s", "--delay", "1", "--timeout", "60"]);
        Proc::spawn(&ours, &a)
    } else {
        let mut a = base.to_vec();
        a.push("-s");
        mckey(&a)
    };
    let s = sender.finish(run_timeout());
    let r = receiver.finish(run_timeout());
    s.assert_ok();
    r.assert_ok();
    if sender_ours {
        assert_eq!(s.count("mcast: sent 20 datagrams of 100 bytes"), 1, "{s:#?}");
    } else {
        assert_eq!(s.count("data transfers complete"), 1, "{s:#?}");
        assert!(s.stdout.contains("return status 0"), "{s:#?}");
    }
    if receiver_ours {
        assert_eq!(r.count("mcast: received 20 datagrams of 100 bytes"), 1, "{r:#?}");
        if !sender_ours {
            assert_eq!(r.count("mcast: mckey's payload: the same 100 bytes in every datagram"), 1, "{r:#?}");
        }
    } else {
        assert_eq!(r.count("data transfers complete"), 1, "{r:#?}");
        assert!(r.stdout.contains("return status 0"), "{r:#?}");
    }
    eprintln!("{} -> {}: ok\n{}{}", s.what, r.what, s.stdout, r.stdout);
}

#[test]
fn mcast_ours_with_ours() {
    mcast_run(true, true, "239.255.7.21");
}

#[test]
fn mcast_our_sender_with_mckey_receiver() {
    mcast_run(true, false, "239.255.7.22");
}

#[test]
fn mcast_mckey_sender_with_our_receiver() {
    mcast_run(false, true, "239.255.7.23");
}
