//! Device tests of the examples facing bad peers, dead peers and bad input (over SoftRoCE in the
//! `cargo xtask test` VM): every example fails clearly (one message, non-zero exit, no panic)
//! and promptly, in both roles. Fake peers are raw TCP sockets of this test: silent, speaking
//! garbage, closing early, or frozen with SIGSTOP (a stopped process keeps its socket open and
//! sends nothing, as a dead host does: no FIN, no RST). The examples are run from
//! `target/<profile>/examples/`; each test uses its own TCP ports (18800-18999).

mod examples_support;

use std::io::{Read, Write as _};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use examples_support::*;

/// The perftest-style examples.
const PERF: [&str; 5] = ["write_bw", "read_bw", "send_bw", "write_lat", "send_lat"];
/// Every example that talks to a peer.
const NETWORKED: [&str; 7] =
    ["rc_pingpong", "ud_pingpong", "write_bw", "read_bw", "send_bw", "write_lat", "send_lat"];

/// How long a prompt failure may take (process start-up and device opening under TCG included).
const PROMPTLY: Duration = Duration::from_secs(10);

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

/// How many tools' checks run at once. Most of a check is waiting for a timeout of the example
/// under test; a few at a time cut the binary's time to about a third without starving the
/// examples of the VM's two CPUs (their own bounds allow 10 s of start-up, `PROMPTLY`).
const AT_ONCE: usize = 3;

/// Runs `check` for every tool (with its index), `AT_ONCE` at a time (each on its own ports),
/// all of them even when some fail, then fails naming those that did (their panic messages are
/// printed as they happen).
fn for_each_tool(tools: &[&str], check: impl Fn(&str, u16) + Sync) {
    let mut failed = Vec::new();
    let indexed: Vec<(usize, &str)> = tools.iter().copied().enumerate().collect();
    for group in indexed.chunks(AT_ONCE) {
        std::thread::scope(|s| {
            let running: Vec<_> = group
                .iter()
                .map(|&(i, tool)| {
                    (
                        tool,
                        s.spawn({
                            let check = &check;
                            move || check(tool, i as u16)
                        }),
                    )
                })
                .collect();
            for (tool, handle) in running {
                if handle.join().is_err() {
                    failed.push(tool);
                }
            }
        });
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
            // Waiting for a client would take 60 s; the checks take well under 2 s (more when
            // the machine is loaded).
            let mut args = strings(bad);
            args.extend(["-p".to_string(), (18800 + 4 * i + j as u16).to_string()]);
            args.extend(strings(&["--accept-timeout", "60"]));
            let f = Running::spawn(example(tool), &args).finish(PROMPTLY);
            f.assert_clean_failure(PROMPTLY);
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
/// with the socket, and returns how the server ended (killed after `within`); fails when `act`
/// panicked (its assertions).
fn server_vs_raw_client(
    tool: &str,
    port: u16,
    timeout: &str,
    act: impl FnOnce(TcpStream) + Send + 'static,
    within: Duration,
) -> Finished {
    let mut args = device_args(tool, port);
    args.extend(strings(&["--timeout", timeout, "--accept-timeout", "60"]));
    let server = Running::spawn(example(tool), &args);
    let s = raw_client(&server, port);
    let keep = std::thread::spawn(move || act(s));
    let f = server.finish(within);
    // The peer's own checks (its writes ignore a closed socket, so only a check panics).
    assert!(keep.join().is_ok(), "the raw client's checks failed: {}", f.describe());
    f
}

/// Starts `tool` as a client with `--timeout timeout` towards a fake server that does `act` with
/// the accepted socket, and returns how the client ended (killed after `within`); fails when
/// `act` panicked.
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
    // As in server_vs_raw_client.
    assert!(keep.join().is_ok(), "the fake server's checks failed: {}", f.describe());
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
        // Nothing, or the start of a valid first message.
        let start: &'static [u8] = if is_perf(tool) { &[1, 0, 0] } else { b"0000:00" };
        for (j, partial) in [&b""[..], start].into_iter().enumerate() {
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

/// A client that only ever sends `Alive` frames (never its hello) is alive, but not waited for
/// forever: the perf server's wait for a frame a working peer sends at once is capped by
/// `--setup-timeout`. (The perf tools share this code: one of them is enough.)
#[test]
fn perf_servers_do_not_wait_forever_for_a_client_that_only_says_it_is_alive() {
    require_device();
    let tool = "write_bw";
    let port = 18895;
    let mut args = device_args(tool, port);
    args.extend(strings(&["--timeout", "1", "--setup-timeout", "3", "--accept-timeout", "60"]));
    let server = Running::spawn(example(tool), &args);
    let s = raw_client(&server, port);
    let alive = std::thread::spawn(move || {
        let mut s = s;
        let until = Instant::now() + Duration::from_secs(30);
        // Alive: tag 8, an empty payload.
        while Instant::now() < until && s.write_all(&[8, 0, 0, 0, 0]).is_ok() {
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let within = Duration::from_secs(3) + PROMPTLY;
    let f = server.finish(within);
    f.assert_clean_failure(within);
    assert!(f.elapsed >= Duration::from_secs(3), "gave up before --setup-timeout: {}", f.describe());
    assert!(f.stderr.contains("--setup-timeout"), "the message does not name the bound: {}", f.describe());
    eprintln!("{tool} server: {}", f.stderr.trim());
    let _ = alive.join();
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
        // The server waits for its client as long as the machine needs to start it.
        args.extend(strings(&["--timeout", "3", "--accept-timeout", "60", "-n", iters]));
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
fn rc_pingpong_registers_one_buffer_like_the_c_tool() {
    // Two buffers of -s bytes (a send and a receive buffer) doubled the memory of a large -s:
    // 1.5 GB in a 2 GiB machine was OOM-killed without a word. Count the registered regions.
    require_device();
    let port = 18894;
    let mut args = device_args("rc_pingpong", port);
    args.extend(strings(&["-s", "100000000", "--timeout", "60"]));
    let server = Running::spawn(example("rc_pingpong"), &args);
    assert!(server.wait_for_line("local address", RUN_TIMEOUT), "rc_pingpong never got ready");
    let pid = server.pid().to_string();
    let mrs = run("rdma", &["resource", "show", "mr"], ERROR_TIMEOUT);
    mrs.assert_success();
    let ours: Vec<&str> = mrs
        .stdout
        .lines()
        .filter(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.windows(2).any(|p| p == ["pid", pid.as_str()])
        })
        .collect();
    let large = ours.iter().filter(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        w.windows(2).any(|p| p[0] == "mrlen" && p[1].parse::<u64>().is_ok_and(|n| n >= 100_000_000))
    });
    assert_eq!(large.count(), 1, "registered regions of rc_pingpong (pid {pid}):\n{}", ours.join("\n"));
    eprintln!("rc_pingpong -s 100000000: {}", ours.join(" | "));
}

#[test]
fn rc_pingpong_with_an_oversized_message_fails_with_a_message() {
    require_device();
    // 1.9 GB in the 2 GiB test VM: two such buffers were OOM-killed without a word, one does not
    // fit either. 4 GiB - 1 cannot fit at all.
    for (port, size) in [(18891, "1900000000"), (18892, "4294967295")] {
        let mut args = device_args("rc_pingpong", port);
        args.extend(strings(&["-s", size, "--timeout", "60"]));
        let f = Running::spawn(example("rc_pingpong"), &args).finish(RUN_TIMEOUT);
        f.assert_clean_failure(PROMPTLY);
        assert!(f.stderr.contains("Couldn't allocate"), "{}", f.describe());
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
    // Each buffer fits the 2 GiB VM, the two do not: refused before the first is allocated
    // (zeroing and pinning 1.5 GB took ~15 s under TCG).
    f.assert_clean_failure(PROMPTLY);
    assert!(f.stderr.contains("Couldn't allocate 2 buffers"), "{}", f.describe());
    eprintln!("write_bw server: {}", f.stderr.trim());
}

#[test]
fn servers_give_up_when_no_client_connects() {
    require_device();
    let within = Duration::from_secs(2) + PROMPTLY;
    for_each_tool(&NETWORKED, |tool, i| {
        let mut args = device_args(tool, 18930 + i);
        args.extend(strings(&["--timeout", "2"]));
        let f = Running::spawn(example(tool), &args).finish(within);
        f.assert_clean_failure(within);
        assert!(f.elapsed >= Duration::from_secs(2), "gave up before its timeout: {}", f.describe());
        assert!(f.stderr.contains("no client connected"), "{}", f.describe());
        eprintln!("{tool} server: {:.1} s: {}", f.elapsed.as_secs_f64(), f.stderr.trim());
    });
}

#[test]
fn clients_fail_when_their_server_freezes_mid_run() {
    require_device();
    for_each_tool(&NETWORKED, |tool, i| {
        let port = 18940 + i;
        let iters = if is_perf(tool) { "1000000" } else { "100000000" };
        let mut args = device_args(tool, port);
        // The server waits for its client as long as the machine needs to start it.
        args.extend(strings(&["--timeout", "3", "--accept-timeout", "60", "-n", iters]));
        if tool.ends_with("_bw") {
            args.extend(strings(&["-s", "65536"]));
        }
        let server = start_server(&example(tool), &args, port);
        args.push("127.0.0.1".into());
        let client = Running::spawn(example(tool), &args);
        let started = if is_perf(tool) { "#bytes" } else { "remote address" };
        assert!(client.wait_for_line(started, RUN_TIMEOUT), "{tool}: the run never started");
        std::thread::sleep(Duration::from_millis(1000));
        server.freeze();
        let frozen_at = Instant::now();
        let within = Duration::from_secs(3) + PROMPTLY;
        let f = client.finish(within + Duration::from_secs(5));
        let took = frozen_at.elapsed();
        drop(server);
        f.assert_clean_failure(RUN_TIMEOUT);
        assert!(took <= within, "{tool} client took {took:?} after its server froze: {}", f.describe());
        eprintln!("{tool} client, {:.1} s after its server froze: {}", took.as_secs_f64(), f.stderr.trim());
    });
}

/// Reads one frame of the perf protocol: (tag, payload).
fn read_perf_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    s.read_exact(&mut head)?;
    let mut payload = vec![0u8; u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize];
    s.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

/// Reads frames until one that is not `Alive` (tag 8).
fn read_perf_message(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    loop {
        let f = read_perf_frame(s)?;
        if f.0 != 8 {
            return Ok(f);
        }
    }
}

/// Sends `Alive` frames every 250 ms for `d`.
fn keep_alive(s: &mut TcpStream, d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if s.write_all(&frame(8, &[])).is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A `Setup` payload for one queue pair: a made-up endpoint on the test device's GID (a QP the
/// other side can move to RTS towards, though nothing answers there) and `slice`. The GID comes
/// from sysfs: this binary calls no verb in-process (so `cargo xtask test` leaves it out of the
/// valgrind pass, which would check only this harness, not the examples it starts).
fn fake_setup(slice: ibverbs::RemoteSlice) -> Vec<u8> {
    let path = format!("/sys/class/infiniband/{}/ports/1/gids/{}", device(), gid_index());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let hex: String = text.trim().chars().filter(|c| *c != ':').collect();
    assert_eq!(hex.len(), 32, "{path}: {text}");
    let mut gid = [0u8; 16];
    for (i, b) in gid.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("a hexadecimal GID");
    }
    let ep = ibverbs::Endpoint {
        qpn: 0x12345,
        psn: 0,
        lid: 0,
        gid: ibverbs::Gid(gid),
        mtu: ibverbs::Mtu::MTU_1024,
    };
    let mut b = ep.encode().to_vec();
    b.extend(slice.encode());
    b
}

#[test]
fn perf_server_waits_for_a_slow_but_alive_client_setup() {
    // A client whose setup (say, registering a large buffer) takes longer than the server's
    // --timeout, but which stays alive meanwhile: the server must wait for it.
    require_device();
    let act = |mut s: TcpStream| {
        s.write_all(&frame(1, &write_bw_hello(4096, 1))).expect("hello");
        let mut r = s.try_clone().expect("clone");
        let reader = std::thread::spawn(move || {
            let mut tags = Vec::new();
            while let Ok((tag, _)) = read_perf_message(&mut r) {
                tags.push(tag);
            }
            tags
        });
        keep_alive(&mut s, Duration::from_millis(2500));
        let _ = s.write_all(&frame(2, &fake_setup(ibverbs::RemoteSlice { addr: 0, len: 0, rkey: 0 })));
        let _ = s.write_all(&frame(7, &[])); // End
        let tags = reader.join().unwrap_or_default();
        assert_eq!(tags, [2, 6], "the server's messages: Setup, Ack");
    };
    let f = server_vs_raw_client("write_bw", 18950, "1", act, RUN_TIMEOUT);
    f.assert_success();
    eprintln!("write_bw server: {}", f.describe());
}

#[test]
fn perf_client_waits_for_a_slow_but_alive_server_setup() {
    require_device();
    let act = |mut s: TcpStream| {
        let (tag, hello) = read_perf_message(&mut s).expect("the client's hello");
        assert_eq!((tag, hello.len()), (1, 96));
        keep_alive(&mut s, Duration::from_millis(2500));
        let slice = ibverbs::RemoteSlice { addr: 0x10_0000, len: 1 << 20, rkey: 1 };
        s.write_all(&frame(2, &fake_setup(slice))).expect("setup");
        let (tag, _) = read_perf_message(&mut s).expect("the client's setup");
        assert_eq!(tag, 2);
        let (tag, _) = read_perf_message(&mut s).expect("the client's run");
        assert_eq!(tag, 3);
        let _ = s.write_all(&frame(0xee, b"fake server: stop here"));
        drain(s);
    };
    let mut args = vec!["-s".to_string(), "4096".to_string(), "-n".to_string(), "5".to_string()];
    args.extend(strings(&["--timeout", "1"]));
    let listener = fake_server(18951);
    let mut cargs = device_args("write_bw", 18951);
    cargs.extend(args);
    cargs.push("127.0.0.1".into());
    let client = Running::spawn(example("write_bw"), &cargs);
    let s = accept_one(&listener);
    let keep = std::thread::spawn(move || act(s));
    let f = client.finish(RUN_TIMEOUT);
    assert!(keep.join().is_ok(), "the fake server's checks failed: {}", f.describe());
    f.assert_clean_failure(RUN_TIMEOUT);
    assert!(f.stderr.contains("fake server: stop here"), "{}", f.describe());
    eprintln!("write_bw client: {}", f.stderr.trim());
}

#[test]
fn perf_setup_wait_is_bounded_by_setup_timeout() {
    // A client that stays alive but never finishes its setup.
    require_device();
    let act = |mut s: TcpStream| {
        let _ = s.write_all(&frame(1, &write_bw_hello(4096, 1)));
        keep_alive(&mut s, Duration::from_secs(30));
    };
    let mut args = device_args("write_bw", 18952);
    args.extend(strings(&["--timeout", "1", "--setup-timeout", "3", "--accept-timeout", "60"]));
    let server = Running::spawn(example("write_bw"), &args);
    let s = raw_client(&server, 18952);
    let _keep = std::thread::spawn(move || act(s));
    let within = Duration::from_secs(3) + PROMPTLY;
    let f = server.finish(within);
    f.assert_clean_failure(within);
    assert!(f.elapsed >= Duration::from_secs(3), "{}", f.describe());
    assert!(f.stderr.contains("timed out after 3 s"), "{}", f.describe());
    eprintln!("write_bw server: {}", f.stderr.trim());
}
