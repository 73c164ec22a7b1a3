//! `cargo xtask`: the project's automation, chiefly a SoftRoCE (rxe) harness.
//!
//! Our machines have no RDMA in their kernel, so the device tests run in a QEMU VM that boots the host's
//! Debian kernel, sees the host's root read-only through 9p (under a tmpfs overlay, so host-built
//! binaries run unchanged) and creates `rxe0` over a dummy netdev. On a host that already has an active
//! RDMA device, commands run directly on it unless `--vm` is given. See [`USAGE`].
//!
//! # What tests and programs can count on
//! - **Device tests** are the integration tests of the root package whose target name starts with
//!   `device_` (`tests/device_*.rs`). `cargo xtask test` finds them in `cargo test --workspace --no-run`'s
//!   JSON messages, keeps them out of the host run and runs each binary in the VM with
//!   `--test-threads=1`, in the workspace root, `CARGO_MANIFEST_DIR` set to it. A device test that finds
//!   no device should fail, not skip.
//! - **Environment** of every command run by `rxe`, `test` or `demo`: `IBVERBS_TEST_DEVICE` (`rxe0`),
//!   `IBVERBS_TEST_GID_INDEX` (`1`: the RoCE v2 GID `::ffff:192.0.2.1`), `IBVERBS_TEST_IP`
//!   (`192.0.2.1`, for RDMA-CM), plus the host's `PATH`, `HOME`, `USER`, `LANG`/`LC_*`, `TZ`,
//!   `RUST_BACKTRACE`, `RUST_LOG`, `RUST_LIB_BACKTRACE`, `RUST_MIN_STACK`, `RUST_TEST_*`, `IBVERBS_*`,
//!   `RDMAV_*`, `MLX5_*`, `VALGRIND_OPTS`, `TSAN_OPTIONS`, `CARGO_*` (not those describing xtask's own
//!   package) and `NO_COLOR`/`CLICOLOR*`. Under valgrind and ThreadSanitizer (`cargo xtask test`), device
//!   tests also get `IBVERBS_TEST_TIME_SCALE` (20 and 10 unless set): the factor to apply to their waits.
//!   Nothing else: no `TERM`, no `TMPDIR`. stdin is `/dev/null`; stdout and stderr are files, not
//!   terminals (C programs buffer fully: use `stdbuf -oL`).
//! - **The VM** sees the host's whole file tree at the same paths, writable but copy-on-write (writes,
//!   also to `/tmp`, stay in the VM and vanish with it), its own `/proc`, `/sys`, `/dev`, `/dev/shm`,
//!   loopback and `dummy0` (192.0.2.1/24, MTU from `--mtu`) with `rxe0` on it; no other network.
//!   Modules the kernel asks for at run time load from the host's `/lib/modules`.
//! - **Demo commands** are the shell lines of [`demo::DEMO`].
//! - **Logs**: the whole console of the last VM is kept in `~/.cache/ibverbs-xtask/last-console.log`;
//!   its tail is printed when a boot fails, the VM dies or a command times out.

mod callgrind;
mod cargo;
mod demo;
mod gate;
mod image;
mod json;
mod nightly;
mod plot;
mod prereq;
mod process;
mod publish;
mod ranks_bench;
mod rsh;
mod rxe2;
mod shell;
mod signals;
mod sweep;
mod test;
mod twohost;
mod vm;

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// The help text.
const USAGE: &str = "\
Usage: cargo xtask <command> [options]

Commands:
  rxe [--vm] [--device rxe|siw] [--kernel K] [--mtu N] [--timeout S] [--] CMD [ARGS...]
        Run CMD where an RDMA device exists and exit with its exit status: in a QEMU VM with
        SoftRoCE (rxe0 over dummy0, 192.0.2.1), or directly on this host if it has an ACTIVE RDMA
        port. CMD runs in the current directory with IBVERBS_TEST_DEVICE, IBVERBS_TEST_GID_INDEX and
        IBVERBS_TEST_IP set; its stdout and stderr come back separately. stdin is /dev/null.
        Exit status: CMD's, or 124 (timeout), 125 (the VM failed), 127 (no such command),
        128+N (signal N).
  rxe2 [--mtu N] [--mtu-b N] [--smp N] [--timeout S] [--] CMD_A [ARGS...] ::: CMD_B [ARGS...]
        Run CMD_A in guest A and CMD_B in guest B: two QEMU guests, each with rxe0 on a virtio NIC,
        joined by a private link (10.0.2.1 and 10.0.2.2; a forwarder in xtask relays the Ethernet
        frames between the guests' -netdev dgram sockets). Each side gets RXE2_ROLE (a/b), RXE2_SELF,
        RXE2_PEER, RXE2_CTL, IBVERBS_TEST_DEVICE=rxe0, IBVERBS_TEST_GID_INDEX=1 and
        IBVERBS_TEST_IP=RXE2_SELF, and on its PATH: `rxe2-barrier NAME [S]` (wait for the other
        side to reach NAME: 0, 1 if it is gone, 124 after S seconds) and `rxe2-fault kill-peer |
        restart-peer [S] | cut[2] [S] | restore[2]` (SIGKILL the other guest's QEMU; the same,
        then boot it again, S seconds later: it reruns its command with RXE2_RESTARTED=1; drop
        the link's frames for S seconds or until restored; cut2/restore2: the second link of
        --rails 2). Both commands start together; output lines are prefixed [A]/[B].
        Exit status: the worse of the two (a side killed with rxe2-fault does not count), 124 on
        timeout, 125 when a guest failed. --mtu sets both NICs' MTU (default 1500), --mtu-b B's;
        --smp the vCPUs per guest (default 1).
  test [--vm] [--device rxe|siw] [--kernel K] [--mtu N] [--timeout S] [--valgrind] [--tsan] [--miri] [--twohost] [--publish] [--gate] [-- TEST_ARGS...]
        The whole test suite: builds, host tests, doc tests; with a nightly toolchain (installed
        with rustup if missing): doc tests under nightly rustdoc (checks compile_fail error codes),
        Miri over the library's unit tests, the ThreadSanitizer build of tests/device_threads*.rs
        and tests/device_async.rs;
        then in one VM boot the device tests (tests/device_*.rs), the same under valgrind, the
        ThreadSanitizer binaries, the harness's self-tests and a leak check; the two-host stage:
        one pair of guests (as rxe2) for interop with rdma-core's pingpongs across hosts,
        write_bw, its server's bound when the client's host vanishes, and the library's
        tests/twohost_*.rs in both roles (link cuts, a process killed, a guest restarted); the
        publish checks (MSRV, docs without rdma-core, cargo publish --dry-run); in a second VM
        boot the siw pass (the device tests of test::SIW_BINARIES on siw0; test::SIW_VALGRIND
        under valgrind; the ThreadSanitizer builds, when that pass built them); the
        instruction-count gate (callgrind counts of the post/poll paths and an async operation in
        the VM, failing past 3 % over xtask/gate-baseline.txt); a summary.
        --valgrind, --tsan, --miri, --twohost, --publish, --gate: run only these passes (any
        combination).
        TEST_ARGS go to each device test binary (e.g. a test name filter).
  demo [--vm] [--mtu N] [--timeout S]
        Show the device at work: our devinfo, rc_pingpong and write_bw examples (one VM boot).
  bench [--vm] [--mtu N] [--timeout S] [--twohost | --ranks | --sweep | --callgrind]
        Benchmarks (release build), in two VM boots: the sweep below (10 rounds at 2 B, 4 KiB and
        64 KiB, where the safe level's targets are; 2 elsewhere), then our --safe --ex write_lat,
        send_lat and write_bw against perftest's, the post/poll micro-benchmark (safe level vs
        unsafe level vs raw ffi), the new user's program in C against ours at the safe one-shot
        and unsafe levels (examples/perf/newuser.sh, 20 alternating rounds), and the post/poll
        benchmark's instruction counts under callgrind (per WR, post and
        poll, ours and the provider's; a table, and target/xtask-bench/callgrind.json) and poll's
        per completion by batch size 1-32 (a table, the same JSON, docs/bench/poll_batch.svg).
        --callgrind: only the instruction counts.
        --twohost: instead, the same comparison across the two guests of rxe2 (servers in A,
        clients in B; examples/perf/compare_twohost.sh, PAIRS=8 by default), as a table.
        --ranks: instead, 4 ranks on the two guests (2 each, two rails): our allreduce
        (examples/collectives) against Open MPI's MPI_Allreduce under mpirun, 8 B - 64 MiB,
        alternating rounds (pml ucx over rxe if it runs, else ob1/tcp, named), as a table,
        target/xtask-bench/ranks.json and docs/bench/ranks_allreduce*.svg.
        --sweep: instead, the size sweep (2 B - 1 MiB) of the five tests and the scaling sweep
        (write_bw, 1-64 QPs), ours at both posting levels vs perftest (examples/perf/sweep.sh;
        PAIRS, SIZES, TESTS, QPS, TARGET_SIZES, TARGET_PAIRS, PIN from the environment; servers
        on CPU 1, clients on CPU 0 unless PIN=0), as tables, target/xtask-bench/sweep.json and
        SVG plots in docs/bench/.
  deps [--dry-run] [--allow-remove PKG]...
        Install the Debian packages of every command (xtask/packages.txt; .ci/run uses this) as
        root, never removing an installed package (checked by simulation first); otherwise, or
        with --dry-run, show what would be installed.
  help  This text.

Options:
  --vm          Use the VM even if this host has an RDMA device.
  --device D    The VM's device (implies the VM): rxe (SoftRoCE, rxe0, GID index 1) or siw
                (soft-iWARP, siw0 over the same dummy0, GID index 0; its module is built from
                linux-source against the kernel's headers and cached, see image::prepare_siw).
                `test --device siw` runs only the siw pass, `test --device rxe` all but it.
  --kernel K    The kernel the VM boots (implies the VM): host (default: the newest installed
                one with rdma_rxe), backports (the newest linux-image-amd64 of a *-backports apt
                suite, found with apt-cache) or a Debian kernel version (6.12.95+deb12-amd64).
                Other than host, its package is fetched with apt-get download (not installed),
                unpacked with dpkg -x into ~/.cache/ibverbs-xtask/kernels/<version>/ and cached;
                rxe only (`test --kernel` skips the siw pass).
  --mtu N       MTU of the VM's dummy0 (default 1500: rxe active MTU 1024; 9000 gives 4096).
  --timeout S   Seconds CMD (rxe; default 600), each device test binary (test; default 600) or each
                demo command (demo; default 120) may run, once the VM is up (boot: 120 s at most).

Environment: IBVERBS_XTASK_APPEND adds words to the VM kernel's command line (debugging);
IBVERBS_XTASK_NIGHTLY names the nightly toolchain (default: nightly); VALGRIND_OPTS and
TSAN_OPTIONS add options to the valgrind and ThreadSanitizer passes.
Files: boot files cached in ~/.cache/ibverbs-xtask/<kernel>/ (--kernel's: kernels/<kernel>/); the
last VM console in ~/.cache/ibverbs-xtask/last-console.log.";

/// Exit status for a bad command line.
const EXIT_USAGE: u8 = 2;

/// The hidden command that makes two memory errors for valgrind to find (a self-test of the valgrind
/// pass runs `valgrind ... xtask __memcheck-probe`).
pub const MEMCHECK_PROBE: &str = "__memcheck-probe";

/// Options shared by the commands.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Options {
    /// `--vm`: use the VM even where the host has a device.
    vm: bool,
    /// `--mtu N`.
    mtu: u32,
    /// `--timeout S`, if given.
    timeout: Option<Duration>,
    /// `test --valgrind`.
    valgrind: bool,
    /// `test --tsan`.
    tsan: bool,
    /// `test --miri`.
    miri: bool,
    /// `test --publish`.
    publish: bool,
    /// `test --gate`.
    gate: bool,
    /// `test --twohost`.
    twohost: bool,
    /// `bench --sweep`.
    sweep: bool,
    /// `bench --ranks`.
    ranks: bool,
    /// `bench --callgrind`.
    callgrind: bool,
    /// `deps --dry-run`.
    dry_run: bool,
    /// `rxe2 --mtu-b N`.
    mtu_b: Option<u32>,
    /// `rxe2 --smp N`.
    smp: Option<u32>,
    /// `rxe2 --rails N`: links (and NICs per guest), 1 or 2.
    rails: u32,
    /// `deps --allow-remove PKG`: installed packages the install may remove (repeatable).
    allow_remove: Vec<String>,
    /// `rxe|test --device rxe|siw`: the VM's device (implies the VM); `test` without it runs both.
    device: Option<vm::VmDevice>,
    /// `rxe|test --kernel K`: the kernel the VM boots (other than the host's, implies the VM).
    kernel: image::KernelChoice,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            vm: false,
            mtu: 1500,
            rails: 1,
            timeout: None,
            valgrind: false,
            tsan: false,
            miri: false,
            publish: false,
            gate: false,
            twohost: false,
            sweep: false,
            ranks: false,
            callgrind: false,
            dry_run: false,
            mtu_b: None,
            smp: None,
            allow_remove: Vec::new(),
            device: None,
            kernel: image::KernelChoice::Host,
        }
    }
}

/// A parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cli {
    /// `help`, `-h`, `--help` or nothing.
    Help,
    /// `rxe [options] [--] CMD [ARGS...]`.
    Rxe(Options, Vec<OsString>),
    /// `rxe2 [options] [--] CMD_A [ARGS...] ::: CMD_B [ARGS...]`.
    Rxe2(Options, Vec<OsString>, Vec<OsString>),
    /// `test [options] [-- TEST_ARGS...]`.
    Test(Options, Vec<OsString>),
    /// `demo [options]`.
    Demo(Options),
    /// `bench [options]`.
    Bench(Options),
    /// `deps [--dry-run]`.
    Deps(Options),
    /// The memcheck probe (hidden).
    MemcheckProbe,
}

/// Parses the arguments after `cargo xtask`.
fn parse_args(args: &[OsString]) -> Result<Cli, String> {
    let Some((command, rest)) = args.split_first() else { return Ok(Cli::Help) };
    let command = command.to_str().ok_or("the command is not UTF-8")?;
    if matches!(command, "help" | "-h" | "--help") {
        return Ok(Cli::Help);
    }
    if command == MEMCHECK_PROBE && rest.is_empty() {
        return Ok(Cli::MemcheckProbe);
    }
    if !matches!(command, "rxe" | "rxe2" | "test" | "demo" | "bench" | "deps") {
        return Err(format!("unknown command `{command}`"));
    }
    let mut opts = Options::default();
    let mut i = 0;
    while i < rest.len() {
        let arg = rest[i].to_string_lossy();
        if arg == "--" {
            i += 1;
            break;
        }
        if !arg.starts_with('-') {
            if command == "rxe" || command == "rxe2" {
                break; // the command to run
            }
            return Err(format!("unexpected argument `{arg}` (test arguments go after `--`)"));
        }
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) => (name.to_string(), Some(value.to_string())),
            None => (arg.to_string(), None),
        };
        let mut value = || -> Result<String, String> {
            if let Some(v) = &inline {
                return Ok(v.clone());
            }
            i += 1;
            let v = rest.get(i).ok_or(format!("{name} needs a value"))?;
            Ok(v.to_string_lossy().into_owned())
        };
        let flag = inline.is_none();
        match name.as_str() {
            "--vm" if flag && command != "deps" && command != "rxe2" => opts.vm = true,
            "--mtu-b" if command == "rxe2" => {
                let v = value()?;
                opts.mtu_b = Some(
                    v.parse().ok().filter(|m| (68..=65535).contains(m)).ok_or(format!("bad MTU `{v}`"))?,
                );
            }
            "--rails" if command == "rxe2" => {
                let v = value()?;
                opts.rails =
                    v.parse().ok().filter(|n| (1..=2).contains(n)).ok_or(format!("bad --rails `{v}`"))?;
            }
            "--smp" if command == "rxe2" => {
                let v = value()?;
                opts.smp =
                    Some(v.parse().ok().filter(|n| (1..=8).contains(n)).ok_or(format!("bad --smp `{v}`"))?);
            }
            "--valgrind" if flag && command == "test" => opts.valgrind = true,
            "--tsan" if flag && command == "test" => opts.tsan = true,
            "--miri" if flag && command == "test" => opts.miri = true,
            "--publish" if flag && command == "test" => opts.publish = true,
            "--gate" if flag && command == "test" => opts.gate = true,
            "--twohost" if flag && (command == "test" || command == "bench") => opts.twohost = true,
            "--sweep" if flag && command == "bench" => opts.sweep = true,
            "--ranks" if flag && command == "bench" => opts.ranks = true,
            "--callgrind" if flag && command == "bench" => opts.callgrind = true,
            "--dry-run" if flag && command == "deps" => opts.dry_run = true,
            "--device" if command == "rxe" || command == "test" => {
                let v = value()?;
                opts.device =
                    Some(vm::VmDevice::parse(&v).ok_or(format!("bad --device `{v}` (rxe or siw)"))?);
            }
            "--kernel" if command == "rxe" || command == "test" => {
                let v = value()?;
                opts.kernel = image::KernelChoice::parse(&v)
                    .ok_or(format!("bad --kernel `{v}` (host, backports or a kernel version)"))?;
            }
            "--allow-remove" if command == "deps" => {
                let v = value()?;
                if v.is_empty() || v.starts_with('-') {
                    return Err(format!("--allow-remove needs a package name, not `{v}`"));
                }
                opts.allow_remove.push(v);
            }
            "--mtu" | "--timeout" if command == "deps" => {
                return Err(format!("unknown option `{arg}` for `{command}`"))
            }
            "--mtu" => {
                let v = value()?;
                opts.mtu =
                    v.parse().ok().filter(|m| (68..=65535).contains(m)).ok_or(format!("bad MTU `{v}`"))?;
            }
            "--timeout" => {
                let v = value()?;
                let secs =
                    v.parse().ok().filter(|s| *s >= 1).ok_or(format!("bad timeout `{v}` (whole seconds)"))?;
                opts.timeout = Some(Duration::from_secs(secs));
            }
            "-h" | "--help" => return Ok(Cli::Help),
            _ => return Err(format!("unknown option `{arg}` for `{command}`")),
        }
        i += 1;
    }
    let tail = rest[i.min(rest.len())..].to_vec();
    if opts.device == Some(vm::VmDevice::Siw) && opts.kernel != image::KernelChoice::Host {
        return Err("--device siw boots the host's kernel only (siw is built against its headers)".into());
    }
    match command {
        "rxe" if tail.is_empty() => Err("rxe needs a command to run".into()),
        "rxe" => Ok(Cli::Rxe(opts, tail)),
        "rxe2" => {
            let split = tail.iter().position(|a| a == ":::").ok_or("rxe2 needs CMD_A ::: CMD_B")?;
            let (a, b) = (tail[..split].to_vec(), tail[split + 1..].to_vec());
            if a.is_empty() || b.is_empty() {
                return Err("rxe2 needs a command on each side of `:::`".into());
            }
            Ok(Cli::Rxe2(opts, a, b))
        }
        "test" => Ok(Cli::Test(opts, tail)),
        _ if !tail.is_empty() => Err(format!("{command} takes no arguments")),
        "bench"
            if [opts.twohost, opts.ranks, opts.sweep, opts.callgrind].iter().filter(|&&b| b).count() > 1 =>
        {
            Err("bench takes one of --twohost, --ranks, --sweep and --callgrind".into())
        }
        "bench" => Ok(Cli::Bench(opts)),
        "deps" => Ok(Cli::Deps(opts)),
        _ => Ok(Cli::Demo(opts)),
    }
}

/// The workspace's root folder (this crate's parent).
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// Picks where to run (the host's device, or the VM) and makes sure the packages of `extra` and of
/// that place are installed (see [`prereq::ensure`]).
fn backend(opts: &Options, extra: &[prereq::Group]) -> Result<vm::Backend, String> {
    let vm = opts.vm || opts.device.is_some() || opts.kernel != image::KernelChoice::Host;
    let host = if vm { None } else { prereq::host_device() };
    let mut groups = extra.to_vec();
    let backend = match host {
        Some(device) => {
            groups.push(prereq::Group::Device);
            vm::Backend::Local(device)
        }
        None => {
            if !cfg!(target_arch = "x86_64") {
                return Err("the rxe VM boots the host's x86_64 root: it needs an x86_64 host".into());
            }
            groups.push(prereq::Group::Vm);
            vm::Backend::Vm { mtu: opts.mtu, device: opts.device.unwrap_or_default() }
        }
    };
    prereq::ensure(&groups)?;
    Ok(backend)
}

/// Every package of `packages.txt`, plus the headers of the VM's kernel for siw when that kernel is
/// installed already (on a fresh machine the siw stage asks for them once the kernel is there).
fn deps_packages() -> Vec<String> {
    let mut list = prereq::packages(&prereq::Group::ALL);
    if let Ok((_, version)) = image::find_kernel() {
        list.extend(prereq::siw_packages(&version).into_iter().filter(|p| p.starts_with("linux-headers-")));
    }
    list
}

/// The packages `cargo xtask test` needs besides its backend's.
fn test_groups(passes: test::Passes) -> Vec<prereq::Group> {
    let mut groups = vec![prereq::Group::Build];
    if passes.valgrind {
        groups.push(prereq::Group::Valgrind);
    }
    groups
}

/// The memcheck probe: an uninitialised buffer handed to a system call, and a block whose last pointer
/// is dropped (a definite leak). valgrind must report both; without valgrind it does no harm.
#[inline(never)]
fn memcheck_probe() -> u8 {
    // SAFETY: malloc has no preconditions; the block is not read by Rust code. write(2) to /dev/null
    // only reads the 64 bytes (uninitialised on purpose: valgrind reports it), then the pointer is
    // dropped without free on purpose (valgrind reports a definite leak).
    unsafe {
        let block = libc::malloc(64);
        if block.is_null() {
            return 1;
        }
        let fd = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
        if fd >= 0 {
            libc::write(fd, block, 64);
            libc::close(fd);
        }
    }
    0
}

/// `cargo xtask rxe`.
fn rxe(opts: &Options, argv: &[OsString]) -> Result<u8, String> {
    let backend = backend(opts, &[])?;
    let cwd = std::env::current_dir().map_err(|e| format!("the current directory: {e}"))?;
    let label = argv.iter().map(|a| String::from_utf8_lossy(&shell::quote(a.as_bytes())).into_owned());
    let steps = [vm::Step {
        label: label.collect::<Vec<_>>().join(" "),
        script: shell::argv_script(&cwd, argv),
        timeout: opts.timeout.unwrap_or(Duration::from_secs(600)),
        output: vm::Output::Passthrough,
    }];
    let report = vm::run(&steps, &backend, &mut |_, _| {})?;
    report.explain(&steps);
    Ok(report.single_step_exit_code())
}

/// `cargo xtask rxe2`.
fn rxe2_command(opts: &Options, a: &[OsString], b: &[OsString]) -> Result<u8, String> {
    if !cfg!(target_arch = "x86_64") {
        return Err("the rxe VMs boot the host's x86_64 root: they need an x86_64 host".into());
    }
    prereq::ensure(&[prereq::Group::Vm])?;
    let cwd = std::env::current_dir().map_err(|e| format!("the current directory: {e}"))?;
    let pair = rxe2::PairOptions {
        mtu: [opts.mtu, opts.mtu_b.unwrap_or(opts.mtu)],
        smp: opts.smp.unwrap_or(if opts.rails >= 2 { 2 } else { 1 }),
        rails: opts.rails,
    };
    rxe2::command(&cwd, a, b, opts.timeout.unwrap_or(Duration::from_secs(600)), &pair)
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    // The guests' remote shell for mpirun (rsh.rs): hidden, run inside the two-host harness.
    let words: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    match words.first().map(String::as_str) {
        Some("__rsh-server") => return ExitCode::from(rsh::server(rsh::PORT)),
        Some("__rsh") if words.len() >= 3 => return ExitCode::from(rsh::client(&words[1], &words[2..])),
        _ => {}
    }
    let cli = match parse_args(&args) {
        Ok(cli) => cli,
        Err(e) => {
            eprintln!("xtask: {e}\n\n{USAGE}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    signals::install();
    let result = match &cli {
        Cli::Help => {
            println!("{USAGE}");
            Ok(0)
        }
        Cli::MemcheckProbe => return ExitCode::from(memcheck_probe()),
        Cli::Rxe(opts, argv) => {
            image::select_kernel(opts.kernel.clone());
            rxe(opts, argv)
        }
        Cli::Rxe2(opts, a, b) => rxe2_command(opts, a, b),
        Cli::Test(opts, test_args) => {
            let mut passes = test::Passes::only(
                opts.valgrind,
                opts.tsan,
                opts.miri,
                opts.twohost,
                opts.publish,
                opts.gate,
            );
            match opts.device {
                Some(vm::VmDevice::Siw) => passes = test::Passes::SIW_ONLY,
                Some(vm::VmDevice::Rxe) => passes.siw = false,
                None => {}
            }
            if opts.kernel != image::KernelChoice::Host {
                if passes.siw {
                    eprintln!("xtask: --kernel: no siw pass (siw is built for the host's kernel only)");
                }
                passes.siw = false;
                image::select_kernel(opts.kernel.clone());
            }
            backend(opts, &test_groups(passes)).and_then(|backend| {
                test::run(&test::TestOptions {
                    backend,
                    timeout: opts.timeout.unwrap_or(Duration::from_secs(600)),
                    test_args: test_args.clone(),
                    passes,
                })
            })
        }
        Cli::Demo(opts) => {
            backend(opts, &[prereq::Group::Build]).and_then(|backend| demo::run(&backend, opts.timeout))
        }
        Cli::Bench(opts) if opts.twohost => prereq::ensure(&[prereq::Group::Build, prereq::Group::Vm])
            .and_then(|()| demo::bench_twohost(opts.timeout)),
        Cli::Bench(opts) if opts.ranks => prereq::ensure(&[prereq::Group::Build, prereq::Group::Vm])
            .and_then(|()| ranks_bench::run(opts.timeout)),
        Cli::Bench(opts) if opts.sweep => {
            backend(opts, &[prereq::Group::Build]).and_then(|backend| sweep::run(&backend, opts.timeout, &[]))
        }
        Cli::Bench(opts) => backend(opts, &[prereq::Group::Build])
            .and_then(|backend| demo::bench(&backend, opts.timeout, opts.callgrind)),
        Cli::Deps(opts) => {
            prereq::ensure_packages(&deps_packages(), opts.dry_run, &opts.allow_remove).map(|()| 0)
        }
    };
    let code = match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: error: {e}");
            1
        }
    };
    match signals::received() {
        Some(signal) => ExitCode::from(signals::exit_status(signal)),
        None => ExitCode::from(code),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An argument list from string literals.
    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    fn secs(s: u64) -> Option<Duration> {
        Some(Duration::from_secs(s))
    }

    #[test]
    fn parses_rxe() {
        let opts = Options { vm: true, mtu: 9000, timeout: secs(30), ..Options::default() };
        assert_eq!(
            parse_args(&os(&["rxe", "--vm", "--mtu", "9000", "--timeout=30", "--", "ls", "-l"])),
            Ok(Cli::Rxe(opts, os(&["ls", "-l"])))
        );
        // Without `--`, the first word that is no option starts the command; its options are its own.
        assert_eq!(
            parse_args(&os(&["rxe", "ibv_devinfo", "-v", "--vm"])),
            Ok(Cli::Rxe(Options::default(), os(&["ibv_devinfo", "-v", "--vm"])))
        );
        assert_eq!(
            parse_args(&os(&["rxe", "--", "--weird-name"])),
            Ok(Cli::Rxe(Options::default(), os(&["--weird-name"])))
        );
    }

    #[test]
    fn parses_kernel() {
        let backports =
            Options { kernel: image::KernelChoice::Backports, timeout: secs(900), ..Options::default() };
        assert_eq!(
            parse_args(&os(&["rxe", "--kernel", "backports", "--timeout", "900", "--", "true"])),
            Ok(Cli::Rxe(backports, os(&["true"])))
        );
        let version = image::KernelChoice::Version("6.12.95+deb12-amd64".into());
        assert_eq!(
            parse_args(&os(&["test", "--kernel=6.12.95+deb12-amd64"])),
            Ok(Cli::Test(Options { kernel: version, ..Options::default() }, vec![]))
        );
        assert_eq!(
            parse_args(&os(&["rxe", "--kernel", "host", "true"])),
            Ok(Cli::Rxe(Options::default(), os(&["true"])))
        );
        for bad in [
            &["rxe", "--kernel", "newest", "true"][..],
            &["rxe", "--kernel"],
            &["rxe", "--kernel", "backports", "--device", "siw", "true"],
            &["test", "--device=siw", "--kernel=backports"],
            &["demo", "--kernel", "backports"],
            &["rxe2", "--kernel", "backports", "a", ":::", "b"],
        ] {
            assert!(parse_args(&os(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn parses_rxe2() {
        let opts =
            Options { mtu: 9000, mtu_b: Some(1500), smp: Some(2), timeout: secs(60), ..Options::default() };
        assert_eq!(
            parse_args(&os(&[
                "rxe2",
                "--mtu",
                "9000",
                "--mtu-b=1500",
                "--smp",
                "2",
                "--timeout",
                "60",
                "--",
                "a",
                "-x",
                ":::",
                "b",
                "--y"
            ])),
            Ok(Cli::Rxe2(opts, os(&["a", "-x"]), os(&["b", "--y"])))
        );
        assert_eq!(
            parse_args(&os(&["rxe2", "sh", "-c", "true", ":::", "false"])),
            Ok(Cli::Rxe2(Options::default(), os(&["sh", "-c", "true"]), os(&["false"])))
        );
        for bad in [
            &["rxe2", "a"][..],
            &["rxe2", "a", ":::"],
            &["rxe2", ":::", "b"],
            &["rxe2", "--vm", "a", ":::", "b"],
            &["rxe2", "--smp", "0", "a", ":::", "b"],
            &["rxe", "--mtu-b", "1500", "true"],
        ] {
            assert!(parse_args(&os(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn parses_test_and_demo() {
        assert_eq!(parse_args(&os(&["test"])), Ok(Cli::Test(Options::default(), vec![])));
        assert_eq!(
            parse_args(&os(&["test", "--timeout", "5", "--", "qp_", "--nocapture"])),
            Ok(Cli::Test(Options { timeout: secs(5), ..Options::default() }, os(&["qp_", "--nocapture"])))
        );
        assert_eq!(
            parse_args(&os(&["demo", "--mtu=9000"])),
            Ok(Cli::Demo(Options { mtu: 9000, ..Options::default() }))
        );
        assert_eq!(
            parse_args(&os(&["bench", "--timeout", "900"])),
            Ok(Cli::Bench(Options { timeout: secs(900), ..Options::default() }))
        );
        assert_eq!(
            parse_args(&os(&["bench", "--sweep"])),
            Ok(Cli::Bench(Options { sweep: true, ..Options::default() }))
        );
        assert!(parse_args(&os(&["bench", "--sweep", "--twohost"])).is_err());
        assert!(parse_args(&os(&["bench", "--ranks", "--twohost"])).is_err());
        assert!(parse_args(&os(&["test", "--sweep"])).is_err());
        assert!(parse_args(&os(&["bench", "--sweep", "--callgrind"])).is_err());
        assert_eq!(
            parse_args(&os(&["bench", "--callgrind"])),
            Ok(Cli::Bench(Options { callgrind: true, ..Options::default() }))
        );
        assert!(parse_args(&os(&["test", "--callgrind"])).is_err());
        assert_eq!(
            parse_args(&os(&["test", "--valgrind", "--tsan", "--", "x"])),
            Ok(Cli::Test(Options { valgrind: true, tsan: true, ..Options::default() }, os(&["x"])))
        );
        assert_eq!(
            parse_args(&os(&["test", "--miri"])),
            Ok(Cli::Test(Options { miri: true, ..Options::default() }, vec![]))
        );
        assert_eq!(
            parse_args(&os(&["test", "--gate"])),
            Ok(Cli::Test(Options { gate: true, ..Options::default() }, vec![]))
        );
        assert!(parse_args(&os(&["bench", "--gate"])).is_err());
        assert_eq!(parse_args(&os(&["deps"])), Ok(Cli::Deps(Options::default())));
        assert_eq!(
            parse_args(&os(&["deps", "--dry-run"])),
            Ok(Cli::Deps(Options { dry_run: true, ..Options::default() }))
        );
        assert_eq!(
            parse_args(&os(&["deps", "--allow-remove", "qemu-utils", "--allow-remove=x"])),
            Ok(Cli::Deps(Options {
                allow_remove: vec!["qemu-utils".into(), "x".into()],
                ..Options::default()
            }))
        );
        assert_eq!(parse_args(&os(&[MEMCHECK_PROBE])), Ok(Cli::MemcheckProbe));
        assert_eq!(parse_args(&os(&[])), Ok(Cli::Help));
        assert_eq!(parse_args(&os(&["help"])), Ok(Cli::Help));
        assert_eq!(parse_args(&os(&["test", "-h"])), Ok(Cli::Help));
    }

    #[test]
    fn rejects_bad_command_lines() {
        for bad in [
            &["frobnicate"][..],
            &["rxe"],
            &["rxe", "--"],
            &["rxe", "--mtu"],
            &["rxe", "--mtu", "big", "true"],
            &["rxe", "--mtu", "10", "true"],
            &["rxe", "--timeout", "0", "true"],
            &["rxe", "--timeout", "-3", "true"],
            &["rxe", "--timeout", "2.5", "true"],
            &["rxe", "--vm=yes", "true"],
            &["rxe", "--bogus", "true"],
            &["test", "filter"],
            &["test", "--valgrind=yes"],
            &["demo", "--", "x"],
            &["demo", "--tsan"],
            &["rxe", "--miri", "true"],
            &["deps", "--vm"],
            &["deps", "--mtu", "9000"],
            &["deps", "x"],
            &["deps", "--allow-remove"],
            &["deps", "--allow-remove", "--dry-run"],
            &["test", "--allow-remove", "qemu-utils"],
            &["test", "--dry-run"],
            &[MEMCHECK_PROBE, "x"],
        ] {
            assert!(parse_args(&os(bad)).is_err(), "{bad:?}");
        }
    }
}
