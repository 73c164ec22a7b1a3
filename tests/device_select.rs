//! Device tests of device, port and GID selection (`ibverbs::select`), the diagnostics
//! (`ibverbs::diag`) and the tools that use them (`devices`, `devinfo`, `doctor`), over SoftRoCE
//! in the `cargo xtask test` VM. They fail, never skip, without a device.
//!
//! Several tests add a second SoftRoCE device themselves (the VM runs them as root): `dummy1`
//! with 198.51.100.1/24 and `rxe1` over it, removed again at the end of the test (also when it
//! fails). The examples are run from `target/<profile>/examples/` (`cargo build --examples`).

mod common;
#[path = "support/memlock.rs"]
mod memlock;

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ibverbs::select::{Config, Fabric, PortProblem, Selection};
use ibverbs::{AccessFlags, Error, GidType, LinkLayer, Local, Mtu, PortState, QpType, SendRequest};
use memlock::with_memlock;

const EXTRA_IP: &str = "198.51.100.1";

/// The device the harness made (rxe0 over dummy0, 192.0.2.1).
fn device() -> String {
    common::context().name().to_string()
}

/// The harness's GID index of the test device (1 on SoftRoCE).
fn gid_index() -> u32 {
    std::env::var("IBVERBS_TEST_GID_INDEX").ok().and_then(|v| v.parse().ok()).unwrap_or(1)
}

/// Runs a command of the guest (`ip`, `rdma`), panicking with its output when it fails.
fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The state of port 1 of `dev` from sysfs, e.g. `4: ACTIVE`.
fn port_state(dev: &str) -> String {
    std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/state")).unwrap_or_default()
}

/// Waits up to 10 s for port 1 of `dev` to reach a state containing `want`.
fn wait_state(dev: &str, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !port_state(dev).contains(want) {
        assert!(Instant::now() < deadline, "{dev} port 1 did not become {want}: {}", port_state(dev));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A second SoftRoCE device, `rxe1` over `dummy1` (198.51.100.1/24), for as long as it lives.
struct ExtraRxe;

impl ExtraRxe {
    fn add() -> ExtraRxe {
        common::context(); // fails clearly without the harness's device
        ExtraRxe::remove(); // left over by an earlier, killed run
        sh(&["ip", "link", "add", "dummy1", "type", "dummy"]);
        let guard = ExtraRxe; // from here on, Drop cleans up
        sh(&["ip", "addr", "add", &format!("{EXTRA_IP}/24"), "dev", "dummy1"]);
        sh(&["ip", "link", "set", "dummy1", "up"]);
        sh(&["rdma", "link", "add", "rxe1", "type", "rxe", "netdev", "dummy1"]);
        wait_state("rxe1", "ACTIVE");
        guard
    }

    fn set_netdev(&self, up: bool) {
        sh(&["ip", "link", "set", "dummy1", if up { "up" } else { "down" }]);
        wait_state("rxe1", if up { "ACTIVE" } else { "DOWN" });
    }

    fn remove() {
        let _ = Command::new("rdma").args(["link", "delete", "rxe1"]).output();
        let _ = Command::new("ip").args(["link", "del", "dummy1"]).output();
    }
}

impl Drop for ExtraRxe {
    fn drop(&mut self) {
        ExtraRxe::remove();
    }
}

fn config(vars: &[(&str, &str)]) -> ibverbs::Result<Config> {
    let env: HashMap<&str, &str> = vars.iter().copied().collect();
    Config::from_vars(|name| env.get(name).copied())
}

fn chosen(vars: &[(&str, &str)]) -> Vec<String> {
    let c = config(vars).unwrap();
    match c.select() {
        Ok(ports) => ports.iter().map(|p| format!("{}:{}", p.device, p.port)).collect(),
        Err(e) => panic!("{vars:?}: {e}"),
    }
}

/// An RDMA Write of a pattern between two RC queue pairs of the device and port that `config`
/// opens, with its options: proves the selection's port and GID carry traffic.
fn write_over(config: &Config) -> String {
    let (ctx, opts) = config.open().unwrap();
    let opts = ibverbs::ConnectOptions { retry_cnt: 6, ..opts };
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(8, None).unwrap();
    let mut a = pd.create_qp(&cq, QpType::RC).max_send_wr(2).max_recv_wr(2).build().unwrap();
    let mut b = pd.create_qp(&cq, QpType::RC).max_send_wr(2).max_recv_wr(2).build().unwrap();
    let (ea, eb) = (a.endpoint(&opts).unwrap(), b.endpoint(&opts).unwrap());
    a.connect(&eb, &opts).unwrap();
    b.connect(&ea, &opts).unwrap();
    let target = std::sync::Arc::new(pd.allocate_remote(64, AccessFlags::REMOTE_WRITE).unwrap());
    let data = common::pattern(64, 7);
    let mut src = pd.allocate(64).unwrap();
    src.copy_from_slice(&data);
    a.post_send(SendRequest::write(Local::whole(src), target.remote()).wr_id(1)).unwrap();
    let wc = common::poll_one(&mut cq);
    assert!(wc.is_ok(), "{wc:?}");
    let mut out = [0u8; 64];
    target.read(0, &mut out).unwrap();
    assert_eq!(&out[..], &data[..]);
    ctx.name().to_string()
}

// ---------------------------------------------------------------------------------------------
// The description of the real devices

#[test]
fn the_fabric_describes_the_device_as_verbs_and_sysfs_do() {
    let ctx = common::context();
    let fabric = Fabric::query().unwrap();
    let d = fabric.device(ctx.name()).unwrap_or_else(|| panic!("{} missing from {fabric:?}", ctx.name()));
    assert_eq!(d.error, None);
    assert_eq!(d.node_guid, ctx.query_device().unwrap().node_guid());
    let p = &d.ports[0];
    let attr = ctx.query_port(1).unwrap();
    assert_eq!(
        (p.port, p.state, p.link_layer, p.lid),
        (1, PortState::ACTIVE, LinkLayer::ETHERNET, attr.lid())
    );
    assert_eq!((p.active_mtu, p.gid_tbl_len), (Some(attr.active_mtu()), attr.gid_tbl_len()));
    assert_eq!(p.gids, ctx.gid_table(1).unwrap());
    assert_eq!(d.iwarp, ctx.is_iwarp());
    let netdev = p.netdev.as_ref().expect("the netdev of an Ethernet port (RoCE: its GIDs; iWARP: its MAC)");
    assert_eq!(netdev.name, "dummy0");
    assert_eq!(netdev.mtu.map(|m| m >= 1500), Some(true));

    // sysfs agrees on everything it shows (not the MTU).
    let sysfs = Fabric::from_sysfs(Path::new("/")).unwrap();
    let s = sysfs.device(ctx.name()).unwrap();
    assert_eq!((s.node_guid, s.error.as_ref(), s.iwarp), (d.node_guid, None, d.iwarp));
    let sp = &s.ports[0];
    assert_eq!(
        (sp.port, sp.state, sp.link_layer, sp.lid, sp.gid_tbl_len),
        (1, p.state, p.link_layer, p.lid, p.gid_tbl_len)
    );
    assert_eq!(sp.gids, p.gids);
    assert_eq!(sp.netdev, p.netdev);
    assert_eq!(sp.active_mtu, None);
}

// ---------------------------------------------------------------------------------------------
// Selection on the harness's device

#[test]
fn the_environment_selects_the_device_and_gid_the_harness_uses() {
    let dev = device();
    let c =
        config(&[("NCCL_IB_HCA", &format!("={dev}")), ("NCCL_IB_TIMEOUT", "15"), ("NCCL_IB_RETRY_CNT", "6")])
            .unwrap();
    let ports = c.select().unwrap();
    assert_eq!(ports.len(), 1);
    let p = &ports[0];
    if common::is_iwarp() {
        // No GID: RDMA-CM addresses it by IP; the options keep the variables all the same.
        assert_eq!((p.device.as_str(), p.port, p.gid_index(), p.iwarp), (dev.as_str(), 1, None, true));
        assert_eq!(p.to_string(), format!("{dev} port 1, iWARP (RDMA-CM)"));
        let (ctx, opts) = c.open().unwrap();
        assert_eq!(ctx.name(), dev);
        assert_eq!((opts.port, opts.gid_index, opts.timeout, opts.retry_cnt), (1, None, 15, 6));
        common::unsupported(
            &ctx,
            "a GID selected from NCCL_IB_GID_INDEX",
            "iWARP has none (RDMA-CM connects by IP): the selection's traffic check is not made",
        );
        return;
    }
    assert_eq!((p.device.as_str(), p.port, p.gid_index()), (dev.as_str(), 1, Some(gid_index())));
    let g = p.gid.unwrap();
    assert_eq!(g.gid_type, GidType::ROCE_V2);
    assert_eq!(
        g.gid.ip().to_string(),
        std::env::var("IBVERBS_TEST_IP").unwrap_or_else(|_| "192.0.2.1".into())
    );
    let (ctx, opts) = c.open().unwrap();
    assert_eq!(ctx.name(), dev);
    assert_eq!((opts.port, opts.gid_index, opts.timeout, opts.retry_cnt), (1, Some(gid_index()), 15, 6));
    // The automatic choice is the library's own default (ConnectOptions with no GID index).
    assert_eq!(Some(ctx.roce_v2_ipv4_gid_index(1).unwrap()), p.gid_index());
    assert_eq!(write_over(&c), dev);
}

#[test]
fn gid_family_range_and_version_choose_among_the_devices_gids() {
    let dev = device();
    let hca = format!("={dev}");
    let pick = |vars: &[(&str, &str)]| {
        let mut v = vec![("IBVERBS_HCA", hca.as_str())];
        v.extend_from_slice(vars);
        config(&v).unwrap().select().map(|p| p[0].gid_index())
    };
    if common::is_iwarp() {
        // The RoCE settings do not apply to an iWARP port, which takes no GID.
        for vars in [
            ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
            ("NCCL_IB_ADDR_RANGE", "10.0.0.0/8"),
            ("NCCL_IB_ROCE_VERSION_NUM", "1"),
        ] {
            assert_eq!(pick(&[vars]).unwrap(), None, "{vars:?}");
        }
        let why = "iWARP ports take no GID: RDMA-CM addresses them by IP";
        return common::unsupported(&common::context(), "RoCE GID selection", why);
    }
    // SoftRoCE: [0] the link-local IPv6 GID, [1] the IPv4 one, both RoCE v2.
    assert_eq!(pick(&[("NCCL_IB_ADDR_FAMILY", "AF_INET6")]).unwrap(), Some(0));
    assert_eq!(pick(&[("NCCL_IB_ADDR_RANGE", "192.0.2.0/24")]).unwrap(), Some(1));
    assert_eq!(pick(&[("NCCL_IB_ADDR_RANGE", "fe80::/10")]).unwrap(), Some(0));
    assert_eq!(pick(&[("NCCL_IB_ROCE_VERSION_NUM", "2")]).unwrap(), Some(1));
    for (vars, words) in [
        (
            &[("NCCL_IB_ADDR_RANGE", "10.0.0.0/8")][..],
            &["no GID is a RoCE v2 (or v1) GID of family AF_INET in 10.0.0.0/8", "192.0.2.1 RoCE v2"][..],
        ),
        (&[("NCCL_IB_ROCE_VERSION_NUM", "1")][..], &["no GID is a RoCE v1 GID"][..]),
    ] {
        let e = pick(vars).unwrap_err();
        assert!(matches!(e, Error::NoUsablePort { .. }), "{e:?}");
        for w in words {
            assert!(e.to_string().contains(w), "{vars:?}: {e} lacks {w:?}");
        }
    }
}

#[test]
fn explicit_settings_the_port_cannot_honour_are_named() {
    let ctx = common::context();
    let dev = ctx.name().to_string();
    let hca = format!("={dev}");
    // An empty GID entry (SoftRoCE has 2 of 1024); beyond the table on siw (1 entry).
    let e = config(&[("IBVERBS_HCA", &hca), ("NCCL_IB_GID_INDEX", "7")]).unwrap().select().unwrap_err();
    let Error::NoUsablePort { rejected, .. } = &e else { panic!("{e:?}") };
    if common::is_iwarp() {
        assert_eq!(rejected[0].problem, PortProblem::GidIndexOutOfTable { index: 7, len: 1 }, "{e}");
        assert!(e.to_string().contains("GID index 7 is beyond the GID table"), "{e}");
    } else {
        assert_eq!(rejected[0].problem, PortProblem::GidEmpty { index: 7 }, "{e}");
        assert!(e.to_string().contains("GID index 7 is empty"), "{e}");
    }
    // An MTU above the port's active MTU (1024 on a 1500-byte netdev).
    let active = ctx.query_port(1).unwrap().active_mtu();
    let fabric = Fabric::query().unwrap();
    match Mtu(active.0 + 1).bytes() {
        Some(bytes) => {
            let c = config(&[("IBVERBS_MTU", &bytes.to_string())]).unwrap();
            let e = c.selection.resolve(&fabric, &dev, 1).unwrap_err();
            assert!(
                matches!(e, Error::Port { problem: PortProblem::MtuAboveActive { requested, active: a }, .. }
                    if requested == Mtu(active.0 + 1) && a == active),
                "{e:?}"
            );
            assert!(
                e.to_string()
                    .contains(&format!("MTU {bytes} asked for is above the port's active MTU {active}")),
                "{e}"
            );
        }
        None => panic!(
            "the test device's active MTU is already {active}: cannot ask for more (run with MTU 1500)"
        ),
    }
    let c = config(&[("IBVERBS_MTU", &active.to_string())]).unwrap();
    assert!(c.selection.resolve(&fabric, &dev, 1).is_ok());
    // A port the device does not have.
    let e = Selection::default().resolve(&fabric, &dev, 2).unwrap_err();
    assert!(matches!(e, Error::Port { problem: PortProblem::NoSuchPort { ports: 1 }, .. }), "{e:?}");
}

// ---------------------------------------------------------------------------------------------
// Several devices

#[test]
fn nccl_syntax_selects_among_several_devices() {
    let dev = device();
    let _rxe1 = ExtraRxe::add();
    let p0 = format!("{dev}:1");
    // Natural name order: rxe0 before rxe1, rxe1 before siw0.
    let mut both = [p0.as_str(), "rxe1:1"];
    both.sort_by(|a, b| ibverbs::select::natural_cmp(a, b));
    assert_eq!(chosen(&[]), both);
    let prefixed: Vec<&str> = both.iter().copied().filter(|p| p.starts_with("rxe")).collect();
    assert_eq!(chosen(&[("NCCL_IB_HCA", "rxe")]), prefixed);
    assert_eq!(chosen(&[("NCCL_IB_HCA", "=rxe1")]), ["rxe1:1"]);
    assert_eq!(chosen(&[("NCCL_IB_HCA", "rxe1:1")]), ["rxe1:1"]);
    assert_eq!(chosen(&[("NCCL_IB_HCA", "^rxe1")]), [p0.as_str()]);
    assert_eq!(chosen(&[("NCCL_IB_HCA", &format!("^={dev}"))]), ["rxe1:1"]);
    assert_eq!(chosen(&[("IBVERBS_HCA", "=rxe1"), ("NCCL_IB_HCA", &format!("={dev}"))]), ["rxe1:1"]);
    // The address range picks the RoCE device whose address is in it (an iWARP port takes no GID:
    // the range does not apply to it).
    let in_range = if common::is_iwarp() { both.to_vec() } else { vec!["rxe1:1"] };
    assert_eq!(chosen(&[("NCCL_IB_ADDR_RANGE", "198.51.100.0/24")]), in_range);
    let fabric = Fabric::query().unwrap();
    let c = config(&[("NCCL_IB_ADDR_RANGE", "198.51.100.0/24")]).unwrap();
    let out = c.selection.evaluate(&fabric);
    let refused = out
        .rejected
        .iter()
        .any(|r| r.device == dev && matches!(r.problem, PortProblem::NoMatchingGid { .. }));
    assert_eq!(refused, !common::is_iwarp(), "{out:?}");
    assert_eq!(out.chosen[0].gid.unwrap().gid.ip().to_string(), EXTRA_IP);
    // A port that does not exist: nothing usable, and the entry is reported.
    let c = config(&[("NCCL_IB_HCA", "rxe1:2")]).unwrap();
    assert_eq!(c.selection.evaluate(&fabric).unmatched.len(), 1);
    let e = c.select_in(&fabric).unwrap_err();
    assert!(e.to_string().starts_with("no usable RDMA port for NCCL_IB_HCA=\"rxe1:2\""), "{e}");
    // Traffic over the second device, as selected.
    assert_eq!(write_over(&config(&[("IBVERBS_HCA", "=rxe1"), ("IBVERBS_TIMEOUT", "14")]).unwrap()), "rxe1");
}

#[test]
fn a_port_whose_netdev_is_down_is_named_and_left_out() {
    let dev = device();
    let rxe1 = ExtraRxe::add();
    rxe1.set_netdev(false);
    let fabric = Fabric::query().unwrap();
    let port = &fabric.device("rxe1").unwrap().ports[0];
    assert_eq!(port.state, PortState::DOWN);
    assert_eq!(
        port.netdev.as_ref().map(|n| (n.name.as_str(), n.oper_state.as_str())),
        Some(("dummy1", "down"))
    );
    assert_eq!(chosen(&[]), [format!("{dev}:1")]);
    let e = config(&[("NCCL_IB_HCA", "=rxe1")]).unwrap().select_in(&fabric).unwrap_err();
    let Error::NoUsablePort { rejected, .. } = &e else { panic!("{e:?}") };
    let r = rejected.iter().find(|r| r.device == "rxe1").unwrap();
    assert!(matches!(r.problem, PortProblem::NotActive { state: PortState::DOWN, .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("rxe1 port 1: port state DOWN is not ACTIVE"), "{msg}");
    assert!(msg.contains("dummy1 is down: `ip link set dummy1 up`"), "{msg}");
    let e = Selection::default().resolve(&fabric, "rxe1", 1).unwrap_err();
    assert!(matches!(e, Error::Port { problem: PortProblem::NotActive { .. }, .. }), "{e:?}");
    rxe1.set_netdev(true);
    assert_eq!(chosen(&[("NCCL_IB_HCA", "=rxe1")]), ["rxe1:1"]);
}

// ---------------------------------------------------------------------------------------------
// Diagnostics in the library's errors

#[test]
fn a_registration_refused_for_the_memlock_limit_names_rlimit_memlock() {
    let ctx = common::context();
    let pd = ctx.alloc_pd().unwrap();
    let (small, big) =
        with_memlock(64 << 10, || (pd.allocate(4096).map(drop), pd.allocate(1 << 20).map(drop)));
    small.expect("4 KiB fits in a 64 KiB limit");
    let e = big.expect_err("1 MiB registered under a 64 KiB RLIMIT_MEMLOCK without CAP_IPC_LOCK");
    assert!(matches!(e, Error::Verb { verb: "ibv_reg_mr", .. }), "{e:?}");
    assert_eq!(e.raw_os_error(), Some(libc::ENOMEM));
    let msg = with_memlock(64 << 10, || e.to_string());
    for w in ["ibv_reg_mr failed: ", "RLIMIT_MEMLOCK is 64 KiB", "ulimit -l unlimited", "--ulimit memlock=-1"]
    {
        assert!(msg.contains(w), "{msg:?} lacks {w:?}");
    }
    // A limit of 0: the kernel refuses with EPERM, named the same way.
    let (e, msg) = with_memlock(0, || {
        let e = pd.allocate(4096).map(drop).expect_err("registered with RLIMIT_MEMLOCK 0");
        let msg = e.to_string();
        (e, msg)
    });
    // siw refuses with ENOMEM (siw_umem_get), the core's ib_umem_get with EPERM.
    let want = if common::is_iwarp() { libc::ENOMEM } else { libc::EPERM };
    assert_eq!(e.raw_os_error(), Some(want), "{e}");
    assert!(msg.contains("RLIMIT_MEMLOCK is 0 bytes"), "{msg}");
    // Restored: registrations work again.
    pd.allocate(1 << 20).unwrap();
}

// ---------------------------------------------------------------------------------------------
// The tools

/// The path of a bundled example, next to this test binary: `target/<profile>/examples/<name>`.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps/<test>");
    let path = dir.join("examples").join(name);
    assert!(
        path.is_file(),
        "{} is missing: build the examples first (`cargo build --examples`)",
        path.display()
    );
    path
}

/// How a tool run ended.
#[derive(Debug)]
struct Run {
    what: String,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn describe(&self) -> String {
        format!(
            "`{}`: exit {:?}\n--- stdout:\n{}--- stderr:\n{}---",
            self.what, self.code, self.stdout, self.stderr
        )
    }

    fn expect(&self, code: i32, words: &[&str]) -> &Run {
        assert_eq!(self.code, Some(code), "{}", self.describe());
        for w in words {
            assert!(self.stdout.contains(w) || self.stderr.contains(w), "no {w:?} in {}", self.describe());
        }
        self
    }

    fn lacks(&self, words: &[&str]) -> &Run {
        for w in words {
            assert!(!self.stdout.contains(w), "{w:?} in {}", self.describe());
        }
        self
    }
}

/// Runs example `name` with `args`, the selection variables cleared and `env` set, and `setup`
/// run in the child before it starts (killed after 60 s).
fn tool(name: &str, args: &[&str], env: &[(&str, &str)], setup: Option<fn() -> std::io::Result<()>>) -> Run {
    let mut cmd = Command::new(example(name));
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for v in ibverbs::select::VARIABLES {
        cmd.env_remove(v.name);
        if let Some(n) = v.nccl {
            cmd.env_remove(n);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (OsString::from(k), OsString::from(v))));
    if let Some(setup) = setup {
        // SAFETY: `setup` makes only system calls (setrlimit, prctl, unshare, mount), which are
        // safe between fork and exec.
        unsafe { cmd.pre_exec(setup) };
    }
    let what = format!("{env:?} {name} {}", args.join(" "));
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{what}: {e}"));
    let read_all = |mut from: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = from.read_to_string(&mut s);
            s
        })
    };
    let stdout = read_all(Box::new(child.stdout.take().unwrap()));
    let stderr = read_all(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        match child.try_wait().unwrap() {
            Some(status) => break status,
            None if Instant::now() > deadline => {
                let _ = child.kill();
                panic!("{what} hung");
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    Run { what, code: status.code(), stdout: stdout.join().unwrap(), stderr: stderr.join().unwrap() }
}

/// A 64 KiB RLIMIT_MEMLOCK and no CAP_IPC_LOCK after exec (as an unprivileged job runs).
fn low_memlock() -> std::io::Result<()> {
    let low = libc::rlimit { rlim_cur: 64 << 10, rlim_max: 64 << 10 };
    // SAFETY: plain system calls on this (child) process.
    unsafe {
        if libc::setrlimit(libc::RLIMIT_MEMLOCK, &low) != 0
            || libc::prctl(libc::PR_CAPBSET_DROP, 14, 0, 0, 0) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A private mount namespace with an empty /dev/infiniband: a container the device files were
/// not passed to.
fn no_device_files() -> std::io::Result<()> {
    let c = |s: &str| std::ffi::CString::new(s).unwrap_or_default();
    let (root, dir, tmpfs) = (c("/"), c("/dev/infiniband"), c("tmpfs"));
    // SAFETY: plain system calls on this (child) process with valid NUL-terminated strings.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0
            || libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            || libc::mount(tmpfs.as_ptr(), dir.as_ptr(), tmpfs.as_ptr(), 0, std::ptr::null()) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[test]
fn devinfo_and_devices_list_what_the_selection_uses() {
    let dev = device();
    let _rxe1 = ExtraRxe::add();
    let hca0 = format!("hca_id:\t{dev}\n");
    // Without settings: every device, exactly as the C tools print them.
    for (ours, c) in [("devinfo", "ibv_devinfo"), ("devices", "ibv_devices")] {
        let r = tool(ours, &[], &[], None);
        let out = Command::new(c).output().unwrap();
        assert_eq!(r.stdout, String::from_utf8_lossy(&out.stdout), "{}", r.describe());
    }
    tool("devinfo", &[], &[("NCCL_IB_HCA", "^rxe1")], None).expect(0, &[&hca0]).lacks(&["rxe1"]);
    tool("devinfo", &["-l"], &[("IBVERBS_HCA", "=rxe1"), ("NCCL_IB_HCA", "rxe0")], None)
        .expect(0, &["1 HCA found:\n\trxe1\n"]);
    tool("devices", &[], &[("NCCL_IB_HCA", "^rxe1")], None).expect(0, &[&dev]).lacks(&["rxe1"]);
    tool("devices", &["--all"], &[("NCCL_IB_HCA", "^rxe1")], None).expect(0, &[&dev, "rxe1"]);
    // The flags win: -d shows the device the environment excludes.
    tool("devinfo", &["-d", "rxe1"], &[("NCCL_IB_HCA", "^rxe1")], None)
        .expect(0, &["hca_id:\trxe1"])
        .lacks(&[&hca0]);
    // A device whose port is down is not what a job would use.
    _rxe1.set_netdev(false);
    let listed = format!("{dev},rxe1");
    tool("devinfo", &[], &[("NCCL_IB_HCA", &listed)], None).expect(0, &[&hca0]).lacks(&["rxe1"]);
    tool("devinfo", &[], &[("NCCL_IB_HCA", "=rxe1")], None)
        .expect(1, &["no usable RDMA port", "dummy1 is down"]);
    _rxe1.set_netdev(true);
    // Bad settings are errors naming the variable and the position.
    tool("devinfo", &[], &[("NCCL_IB_HCA", "rxe0,,rxe1")], None)
        .expect(1, &["NCCL_IB_HCA=\"rxe0,,rxe1\": empty entry", "at position 5"]);
    tool("devices", &[], &[("IBVERBS_GID_INDEX", "x")], None).expect(1, &["IBVERBS_GID_INDEX=\"x\""]);
}

#[test]
fn doctor_reports_a_usable_device() {
    let dev = device();
    let r = tool("doctor", &[], &[], None);
    eprintln!("{}", r.describe()); // shown with --nocapture
    let ip = std::env::var("IBVERBS_TEST_IP").unwrap_or_else(|_| "192.0.2.1".into());
    if common::is_iwarp() {
        r.expect(
            0,
            &[
                &format!("device {dev}: node GUID "),
                "port 1: ACTIVE, Ethernet (iWARP: RDMA over TCP, connects through RDMA-CM)",
                "network device: dummy0",
                &format!("IP addresses:   {ip}"),
                "=> usable: iWARP: connect through RDMA-CM",
                &format!("would use:         {dev} port 1, iWARP (RDMA-CM)"),
                "connect options:   none: iWARP queue pairs connect through RDMA-CM",
                "problems: none",
                &format!("verdict: usable: {dev} port 1"),
            ],
        );
        return;
    }
    r.expect(
        0,
        &[
            "/dev/infiniband:   rdma_cm uverbs0",
            "kernel modules:    ib_core, ib_uverbs",
            "rdma_rxe",
            &format!("device {dev}: node GUID "),
            "device file /dev/infiniband/uverbs0 (ok)",
            "port 1: ACTIVE, Ethernet",
            "network device: dummy0",
            &format!("IP addresses:   {ip}"),
            &format!("GID[  1] {ip}"),
            "RoCE v2 IPv4",
            &format!("would use:         {dev} port 1, GID[1] {ip} (RoCE v2)"),
            "registration:      1 MiB on",
            ": ok",
            "problems: none",
            &format!("verdict: usable: {dev} port 1"),
        ],
    );
}

#[test]
fn doctor_does_not_pin_more_memory_than_the_host_has() {
    let _ = device();
    // 1 TiB: more than the guest's memory. Registering it (root has no locked-memory limit)
    // would pin page after page until the OOM killer came.
    tool("doctor", &["--probe-size", "1099511627776"], &[], None).expect(
        0,
        &["registration:      1024 GiB on", ": not run", "probe's 1024 GiB is more than the", "--probe-size"],
    );
}

#[test]
fn doctor_names_a_port_whose_netdev_is_down() {
    let dev = device();
    let rxe1 = ExtraRxe::add();
    rxe1.set_netdev(false);
    let r = tool("doctor", &[], &[], None);
    eprintln!("{}", r.describe());
    r.expect(
        0,
        &[
            "device rxe1: ",
            "port 1: DOWN, Ethernet",
            "network device: dummy1 (down",
            "=> NOT USABLE: port state DOWN is not ACTIVE (its network device dummy1 is down: `ip link set dummy1 up`",
            "rxe1 port 1: port state DOWN",
            &format!("verdict: usable: {dev} port 1"),
        ],
    );
    let r = tool("doctor", &[], &[("NCCL_IB_HCA", "=rxe1")], None);
    eprintln!("{}", r.describe());
    r.expect(
        1,
        &[
            "settings:          NCCL_IB_HCA=\"=rxe1\"",
            "not selected",
            "no usable RDMA port",
            "verdict: NOTHING USABLE",
        ],
    );
    rxe1.set_netdev(true);
    tool("doctor", &[], &[("NCCL_IB_HCA", "=rxe1")], None).expect(
        0,
        &["would use:         rxe1 port 1, GID[1] 198.51.100.1 (RoCE v2)", "verdict: usable: rxe1 port 1"],
    );
    tool("doctor", &["-d", "rxe1", "-i", "1"], &[("NCCL_IB_HCA", "^rxe1")], None)
        .expect(0, &["checking:          rxe1:1 (from the flags)", "verdict: usable: rxe1 port 1"]);
}

#[test]
fn doctor_names_a_low_memlock_limit_and_its_fix() {
    // `ulimit -l 64` alone does not stop root: CAP_IPC_LOCK lifts the limit, and the doctor says so.
    let r = tool(
        "doctor",
        &[],
        &[],
        Some(|| {
            let low = libc::rlimit { rlim_cur: 64 << 10, rlim_max: 64 << 10 };
            // SAFETY: a plain system call on this (child) process.
            match unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &low) } {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        }),
    );
    if common::is_iwarp() {
        // Not on siw: it counts registrations against the limit whatever the capabilities.
        r.expect(1, &["64 KiB, lifted by CAP_IPC_LOCK", "except siw's", "1 MiB on", "FAILED", "not for siw"]);
    } else {
        r.expect(
            0,
            &["locked memory:     64 KiB, lifted by CAP_IPC_LOCK", "registration:      1 MiB on", ": ok"],
        );
    }
    // Without CAP_IPC_LOCK, as an unprivileged job: the registration fails, named with its fix.
    let r = tool("doctor", &[], &[], Some(low_memlock));
    eprintln!("{}", r.describe());
    r.expect(
        1,
        &[
            "locked memory:     64 KiB (RLIMIT_MEMLOCK, `ulimit -l`)\n",
            "registration:      1 MiB on",
            "FAILED",
            "ibv_reg_mr failed: Cannot allocate memory",
            "RLIMIT_MEMLOCK is 64 KiB",
            "ulimit -l unlimited",
            "--ulimit memlock=-1",
            "verdict: NOTHING USABLE",
        ],
    );
    // The same through a shell, as an operator would try it.
    let script = format!(
        "ulimit -l 64 && exec setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock {}",
        example("doctor").display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("RLIMIT_MEMLOCK is 64 KiB") && text.contains("ulimit -l unlimited"), "{text}");
}

#[test]
fn doctor_without_device_files_says_they_were_not_passed_in() {
    let dev = device();
    let r = tool("doctor", &[], &[], Some(no_device_files));
    eprintln!("{}", r.describe());
    r.expect(
        1,
        &[
            "/dev/infiniband:   (empty)",
            &format!("device {dev}: in the kernel only, device file /dev/infiniband/uverbs0 (MISSING)"),
            "not passed to the container?",
            "no RDMA device named \"<any>\" (devices present: none); /dev/infiniband/uverbs0",
            "verdict: NOTHING USABLE",
        ],
    );
    // The tools built on the library say the same.
    let r = tool("devinfo", &[], &[], Some(no_device_files));
    r.expect(1, &["No IB devices found", "/dev/infiniband/uverbs0", "not passed to the container?"]);
}

#[test]
fn doctor_refuses_invalid_settings() {
    common::context();
    tool("doctor", &[], &[("NCCL_IB_HCA", "rxe0,,rxe1")], None).expect(
        1,
        &[
            "NCCL_IB_HCA=\"rxe0,,rxe1\": empty entry (two commas, or a comma at an end) at position 5",
            "verdict: NOTHING USABLE",
        ],
    );
    tool("doctor", &[], &[("NCCL_IB_TIMEOUT", "40")], None)
        .expect(1, &["NCCL_IB_TIMEOUT=\"40\": not an integer from 0 to 31", "NOTHING USABLE"]);
}
