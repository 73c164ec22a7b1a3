//! Interop tests of the bundled examples against rdma-core's C tools, over a real verbs device
//! (SoftRoCE in the `cargo xtask test` VM): `rc_pingpong`, `ud_pingpong` and `srq_pingpong`
//! against `ibv_rc_pingpong`, `ibv_ud_pingpong` and `ibv_srq_pingpong` in both roles, `devinfo` and `devices` against
//! `ibv_devinfo` and `ibv_devices`, and the examples' handling of bad input and vanishing peers
//! (more of that in `device_example_faults.rs`).
//!
//! The examples are run from `target/<profile>/examples/` (build them first: `cargo build
//! --examples`); the device is `IBVERBS_TEST_DEVICE` (default `rxe0`) with GID index
//! `IBVERBS_TEST_GID_INDEX` (default 1). Every child process runs under a deadline and is killed
//! when it passes it, so a hung peer fails a test instead of hanging it. Each test uses its own
//! TCP ports.

mod examples_support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use examples_support::*;

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
// srq_pingpong

/// Every `prefix` line's (LID, QPN, PSN), in order.
fn addresses(out: &str, prefix: &str) -> Vec<(String, String, String)> {
    out.lines().filter(|l| l.starts_with(prefix)).filter_map(|l| address(l, prefix)).collect()
}

/// One srq_pingpong run with `qps` queue pairs per side: on top of [`pingpong`]'s checks, each
/// side prints one local and one remote line per queue pair, and each side's remote lines are
/// the other's local ones, in order (QP i talks to the peer's QP i).
fn srq_pingpong(server: Impl, client: Impl, port: u16, qps: usize, extra: &[&str]) {
    let q = qps.to_string();
    let mut common = vec!["-n", "100", "-q", q.as_str()];
    common.extend_from_slice(extra);
    let (srv, cli) = pingpong("srq_pingpong", server, client, port, &common, &[], &[]);
    for (a, b) in [(&srv, &cli), (&cli, &srv)] {
        let remote = addresses(&a.stdout, "  remote address:");
        let local = addresses(&b.stdout, "  local address:");
        assert_eq!(remote.len(), qps, "{}", a.describe());
        assert_eq!(remote, local, "addresses differ:\n{}\n{}", a.describe(), b.describe());
    }
    for side in [&srv, &cli] {
        assert!(side.stdout.contains("100 iters in "), "{}", side.describe());
    }
}

#[test]
fn srq_pingpong_ours_with_ours() {
    srq_pingpong(Impl::Ours, Impl::Ours, 18601, 4, &["-c"]);
    srq_pingpong(Impl::Ours, Impl::Ours, 18602, 8, &["-e", "-s", "64"]);
}

#[test]
fn srq_pingpong_our_server_with_c_client() {
    srq_pingpong(Impl::Ours, Impl::C, 18603, 4, &["-c"]);
    srq_pingpong(Impl::Ours, Impl::C, 18604, 2, &["-e", "-s", "1", "-r", "8"]);
}

#[test]
fn srq_pingpong_our_client_with_c_server() {
    srq_pingpong(Impl::C, Impl::Ours, 18605, 4, &["-c"]);
    srq_pingpong(Impl::C, Impl::Ours, 18606, 16, &["-s", "8192"]);
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
            if !host {
                // A server waits for its client as long as the machine needs to start it.
                a.extend(["--accept-timeout".to_string(), "60".to_string()]);
            }
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

/// `async_rpc` (built with `--features tokio`): a server and a client, with the event path and
/// with busy polling; both exit 0 and print their figures. And a client without a server fails
/// cleanly within its `--timeout`.
#[test]
fn async_rpc_events_and_busy_poll() {
    require_device();
    let prog = example("async_rpc");
    for (mode, port) in [("--events", 18781u16), ("--busy-poll", 18782)] {
        let common =
            ["-d".to_string(), device(), "-g".to_string(), gid_index(), "-p".to_string(), port.to_string()];
        let mut srv_args: Vec<String> = common.to_vec();
        srv_args.extend([mode.to_string(), "--timeout".into(), "20".into()]);
        let srv = start_server(&prog, &srv_args, port);
        let mut cli_args = srv_args.clone();
        cli_args.extend(["-n".into(), "300".into(), "-c".into(), "8".into(), "127.0.0.1".into()]);
        let cli = Running::spawn(&prog, &cli_args).finish(RUN_TIMEOUT);
        let srv = srv.finish(RUN_TIMEOUT);
        for side in [&srv, &cli] {
            side.assert_success();
            assert!(side.stdout.contains("async_rpc cpu ("), "{}", side.describe());
        }
        assert!(cli.stdout.contains("requests/s; latency p50"), "{}", cli.describe());
        assert!(srv.stdout.contains("answered 300 requests"), "{}", srv.describe());
    }
    let r = run(&prog, &["-d", &device(), "-p", "18783", "--timeout", "1", "127.0.0.1"], ERROR_TIMEOUT);
    r.assert_clean_failure(ERROR_TIMEOUT);
}
