//! `cargo xtask test`: the project's whole test suite.
//!
//! 1. `cargo build --workspace --all-targets` and `cargo build --examples`, both with
//!    `--features tokio,async-io` (the async adaptor's tests and example need them);
//! 2. the host tests: `cargo test --workspace` without the device test binaries, then the doc tests;
//! 3. the ThreadSanitizer build of `tests/device_threads*.rs` and `tests/device_async.rs`; then,
//!    beside the device job and at the lowest CPU priority ([`host_lane`]), the publish checks
//!    ([`publish`]) and the nightly passes ([`nightly`]): the doc tests again with nightly rustdoc
//!    (which checks the error codes of `compile_fail,E....` doc tests) plus a self-test proving it
//!    does, and Miri over the library's unit tests;
//! 4. in ONE VM boot, one binary after the other, each with `--test-threads=1` (but about half
//!    of the valgrind runs go to a second VM, booted when the plain runs are done: [`split_valgrind`]):
//!    - the device test binaries — the integration tests of the root package named `device_*`
//!      (`tests/device_*.rs`);
//!    - the same binaries under valgrind's memcheck ([`valgrind_argv`]: memory errors and definite
//!      leaks fail them with exit status [`VALGRIND_ERROR_EXIT`]), and a probe valgrind must catch;
//!    - the ThreadSanitizer builds of `tests/device_threads*.rs` and `tests/device_async.rs`
//!      (`TSAN_OPTIONS=halt_on_error=1`: a report fails them with exit status 66; less
//!      [`TSAN_SKIP_TESTS`]), and a racy probe TSan must catch;
//!    - the harness's self-tests and a leak check (`rdma resource show` against a baseline taken
//!      before the first test);
//! 5. self-tests of `cargo xtask rxe` as a program (timeout → 124, SIGTERM → nothing left behind,
//!    boot failure → 125), each a short run of its own;
//! 6. a summary, ending with the line `N passed, M failed`.
//!
//! `--valgrind`, `--tsan` and `--miri` run only those passes (with their probes and the leak check).
//! Under valgrind and ThreadSanitizer the device tests run with `IBVERBS_TEST_TIME_SCALE` set (see
//! [`VALGRIND_TIME_SCALE`]), a factor the test helpers apply to their waits.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::cargo::{self, Artifact};
use crate::nightly::{self, TsanBuild};
use crate::publish;
use crate::vm::{self, Backend, End, Output, Step, StepResult};
use crate::{demo, process, shell, signals};

/// Which passes of the suite run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Passes {
    /// Host tests, doc tests, the device tests, the harness's self-tests.
    pub plain: bool,
    /// The doc tests under nightly rustdoc, and the self-test of its error-code check.
    pub nightly_doc: bool,
    /// Miri over the library's unit tests.
    pub miri: bool,
    /// The device tests under valgrind.
    pub valgrind: bool,
    /// `tests/device_threads*.rs` under ThreadSanitizer.
    pub tsan: bool,
    /// The publish-readiness checks ([`publish`]).
    pub publish: bool,
    /// The two-host stage ([`crate::twohost`]).
    pub twohost: bool,
    /// The siw stage: [`SIW_BINARIES`] on soft-iWARP, in a boot of its own.
    pub siw: bool,
    /// The second-kernel stage: [`KERNEL2_BINARIES`] on rxe under the backports kernel.
    pub kernel2: bool,
    /// The instruction-count gate ([`crate::gate`]), in the device job.
    pub gate: bool,
}

impl Passes {
    /// The whole suite (`cargo xtask test`).
    pub const ALL: Passes = Passes {
        plain: true,
        nightly_doc: true,
        miri: true,
        valgrind: true,
        tsan: true,
        twohost: true,
        publish: true,
        siw: true,
        kernel2: true,
        gate: true,
    };

    /// `test --device siw`: only the siw stage.
    pub const SIW_ONLY: Passes = Passes {
        plain: false,
        nightly_doc: false,
        miri: false,
        valgrind: false,
        tsan: false,
        twohost: false,
        publish: false,
        siw: true,
        kernel2: false,
        gate: false,
    };

    /// Only the passes asked for (`--valgrind`, `--tsan`, `--miri`, `--twohost`, `--publish`,
    /// `--gate`); the whole suite if none is.
    pub fn only(valgrind: bool, tsan: bool, miri: bool, twohost: bool, publish: bool, gate: bool) -> Passes {
        if !(valgrind || tsan || miri || twohost || publish || gate) {
            return Passes::ALL;
        }
        Passes {
            plain: false,
            nightly_doc: false,
            miri,
            valgrind,
            tsan,
            twohost,
            publish,
            siw: false,
            kernel2: false,
            gate,
        }
    }

    /// Whether a pass needs the nightly toolchain.
    pub fn need_nightly(&self) -> bool {
        self.nightly_doc || self.miri || self.tsan
    }
}

/// Options of `cargo xtask test`.
#[derive(Debug, Clone)]
pub struct TestOptions {
    /// Where the device tests run.
    pub backend: Backend,
    /// Timeout of each device test binary.
    pub timeout: Duration,
    /// Extra arguments for each device test binary (after `--test-threads=1`), e.g. a test name filter.
    pub test_args: Vec<OsString>,
    /// The passes to run.
    pub passes: Passes,
}

/// The exit status valgrind gives a program in which it found errors (`--error-exitcode`): distinct
/// from libtest's 101, the harness's 124/125/127 and TSan's 66.
pub const VALGRIND_ERROR_EXIT: i32 = 99;
/// `IBVERBS_TEST_TIME_SCALE` under valgrind (unless set already): memcheck slowed the device tests 7
/// to 13 times under QEMU TCG (measured), so 20 leaves a margin for a busy machine.
pub const VALGRIND_TIME_SCALE: u32 = 20;
/// `IBVERBS_TEST_TIME_SCALE` under ThreadSanitizer (unless set already): about 3 times slower (measured).
pub const TSAN_TIME_SCALE: u32 = 10;

/// The valgrind command that runs a device test binary: memcheck; errors and definite leaks (of any
/// code: the suppressions file lists the known ones that are not ours) make it exit with
/// [`VALGRIND_ERROR_EXIT`]. Child processes are not traced.
pub fn valgrind_argv(root: &Path) -> Vec<OsString> {
    let mut supp = OsString::from("--suppressions=");
    supp.push(root.join("xtask/valgrind.supp"));
    let mut argv: Vec<OsString> = [
        "valgrind",
        "--tool=memcheck",
        "--leak-check=full",
        "--show-leak-kinds=definite",
        "--errors-for-leak-kinds=definite",
        "--num-callers=40",
    ]
    .map(OsString::from)
    .to_vec();
    argv.push(format!("--error-exitcode={VALGRIND_ERROR_EXIT}").into());
    argv.push(supp);
    argv
}

/// The `TSAN_OPTIONS` of a ThreadSanitizer step: stop at the first report with exit status 66, with
/// our suppressions (for uninstrumented C code), and then whatever the caller's `TSAN_OPTIONS` adds.
/// `allocator_may_return_null=1`: an impossible allocation returns NULL as with glibc's malloc instead
/// of aborting (tests check that a huge registration is a typed error; TSan's allocator caps at 1 TiB).
pub fn tsan_options(root: &Path) -> String {
    format!(
        "halt_on_error=1 exitcode={} second_deadlock_stack=1 allocator_may_return_null=1 suppressions={}",
        nightly::TSAN_EXIT,
        root.join("xtask/tsan.supp").display()
    )
}

/// Pass/fail counts, as libtest reports them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Tests that passed.
    pub passed: u64,
    /// Tests that failed.
    pub failed: u64,
    /// Tests that were ignored.
    pub ignored: u64,
}

impl std::ops::AddAssign for Tally {
    fn add_assign(&mut self, other: Tally) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.ignored += other.ignored;
    }
}

/// Sums libtest's `test result: ok. N passed; M failed; K ignored; ...` lines; `None` if there is none.
pub fn parse_libtest(output: &str) -> Option<Tally> {
    let mut total: Option<Tally> = None;
    for line in output.lines() {
        let Some(rest) = line.trim().strip_prefix("test result: ") else { continue };
        let mut tally = Tally::default();
        for part in rest.split(';') {
            let words: Vec<&str> = part.split_whitespace().collect();
            let [.., count, what] = words[..] else { continue };
            let Ok(count) = count.parse::<u64>() else { continue };
            match what {
                "passed" => tally.passed += count,
                "failed" => tally.failed += count,
                "ignored" => tally.ignored += count,
                _ => {}
            }
        }
        *total.get_or_insert_with(Tally::default) += tally;
    }
    total
}

/// The unsupported lines grouped by their device (the first word), in order of first appearance.
pub fn unsupported_by_device(lines: &[String]) -> Vec<(String, Vec<String>)> {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for line in lines {
        let device = line.split_whitespace().next().unwrap_or("?").to_string();
        match groups.iter_mut().find(|(d, _)| *d == device) {
            Some((_, group)) => group.push(line.clone()),
            None => groups.push((device, vec![line.clone()])),
        }
    }
    groups
}

/// The test named in an unsupported line (`<device> <feature> (<test>): <why>`).
pub fn test_of_unsupported(line: &str) -> Option<&str> {
    let head = line.split("): ").next()?;
    head.rsplit_once(" (").map(|(_, test)| test)
}

/// The features a device test reported unsupported: its `IBVERBS-UNSUPPORTED: ` lines, without
/// the prefix (see `tests/common/mod.rs`, `unsupported`).
pub fn unsupported_lines(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|l| {
            l.find("IBVERBS-UNSUPPORTED: ").map(|i| l[i + "IBVERBS-UNSUPPORTED: ".len()..].trim().to_string())
        })
        .filter(|l| !l.is_empty())
        .collect()
}

/// One line of the summary.
#[derive(Debug)]
struct Line {
    what: String,
    ok: bool,
    tally: Tally,
    note: String,
    took: Option<Duration>,
}

/// The results gathered so far.
#[derive(Debug, Default)]
struct Summary {
    lines: Vec<Line>,
    /// Features the device lacks, as device tests reported them (`IBVERBS-UNSUPPORTED:` lines),
    /// without repeats (the valgrind pass runs the same tests).
    unsupported: Vec<String>,
}

impl Summary {
    /// Appends the lines (and the unsupported features not already listed) of `other`.
    fn absorb(&mut self, other: Summary) {
        self.lines.extend(other.lines);
        for u in other.unsupported {
            if !self.unsupported.contains(&u) {
                self.unsupported.push(u);
            }
        }
    }

    /// Adds a line for something libtest counted (`code` is its exit status).
    fn counted(&mut self, what: impl Into<String>, code: i32, tally: Option<Tally>, note: impl Into<String>) {
        let mut tally = tally.unwrap_or_default();
        let ok = code == 0 && tally.failed == 0;
        if !ok && tally.failed == 0 {
            tally.failed = 1; // it failed without saying which test: count the binary as one failure
        }
        self.lines.push(Line { what: what.into(), ok, tally, note: note.into(), took: None });
    }

    /// Adds a line for one check of our own.
    fn check(&mut self, what: impl Into<String>, result: Result<(), String>) {
        let ok = result.is_ok();
        let tally = Tally { passed: u64::from(ok), failed: u64::from(!ok), ignored: 0 };
        self.lines.push(Line {
            what: what.into(),
            ok,
            tally,
            note: result.err().unwrap_or_default(),
            took: None,
        });
    }

    /// Collects the `IBVERBS-UNSUPPORTED:` lines of a device test's output.
    fn unsupported_from(&mut self, stdout: &str) {
        for line in unsupported_lines(stdout) {
            if !self.unsupported.contains(&line) {
                self.unsupported.push(line);
            }
        }
    }

    /// Records how long the last line's work took.
    fn took(&mut self, elapsed: Duration) {
        if let Some(line) = self.lines.last_mut() {
            line.took = Some(elapsed);
        }
    }

    fn total(&self) -> Tally {
        let mut total = Tally::default();
        for line in &self.lines {
            total += line.tally;
        }
        total
    }

    /// Prints the summary on stdout; the last line is `N passed, M failed`.
    fn print(&self) {
        let width = self.lines.iter().map(|l| l.what.len()).max().unwrap_or(0);
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "\nxtask: ======== summary ========");
        for l in &self.lines {
            let status = if l.ok { "ok" } else { "FAILED" };
            let mut counts = format!("{} passed, {} failed", l.tally.passed, l.tally.failed);
            if l.tally.ignored > 0 {
                counts.push_str(&format!(", {} ignored", l.tally.ignored));
            }
            if let Some(took) = l.took {
                counts.push_str(&format!("  [{:.1} s]", took.as_secs_f64()));
            }
            let note = if l.note.is_empty() { String::new() } else { format!("  ({})", l.note) };
            let _ = writeln!(out, "xtask: {:width$}  {status:6}  {counts}{note}", l.what);
        }
        for (device, lines) in unsupported_by_device(&self.unsupported) {
            let tests = {
                let mut names: Vec<&str> = lines.iter().filter_map(|l| test_of_unsupported(l)).collect();
                names.sort_unstable();
                names.dedup();
                names.len()
            };
            let _ = writeln!(
                out,
                "xtask: unsupported by {device}: {tests} tests (each checked the typed error or the device's \
                 capability; not a pass of the feature)"
            );
            for u in lines {
                let _ = writeln!(out, "xtask:   {u}");
            }
        }
        let total = self.total();
        let _ = writeln!(out, "{} passed, {} failed", total.passed, total.failed);
    }
}

/// The host passes that run beside the device job, in a thread at the lowest CPU priority
/// (`nice` 19, which the commands it starts inherit): Miri over the library's unit tests (in a
/// thread of its own: its tests run on one thread), the publish checks, and the doc tests with
/// nightly rustdoc and their self-test. Returns their summary lines.
fn host_lane(
    passes: Passes,
    root: &Path,
    target_dir: &Path,
    toolchain: Option<Result<String, String>>,
) -> Result<Summary, String> {
    lowest_priority();
    let started = Instant::now();
    let mut summary = Summary::default();
    let miri_job = match &toolchain {
        Some(Ok(tc)) if passes.miri => {
            eprintln!(
                "xtask: ==== Miri: cargo +{tc} miri test -p rdma-verbs --lib (beside the device job; its output comes when it is done)"
            );
            let (tc, root) = (tc.clone(), root.to_path_buf());
            Some(std::thread::spawn(move || nightly::miri(&tc, &root)))
        }
        _ => None,
    };
    if passes.publish {
        publish_checks(root, target_dir, &mut summary)?;
    }
    if let (Some(toolchain), true) = (&toolchain, passes.nightly_doc) {
        let what = "doc tests with nightly rustdoc (checks compile_fail codes)";
        match toolchain {
            Ok(tc) => {
                let r = nightly::doc_tests(tc, root, target_dir)?;
                summary.counted(what, r.code, parse_libtest(&r.stdout), r.note);
                summary.took(r.elapsed);
                let t = Instant::now();
                let check = nightly::check_error_codes(tc, root);
                interrupted()?;
                if let Ok(record) = &check {
                    eprintln!("xtask: self-test: rustdoc error codes ... ok ({record})");
                }
                summary.check(
                    "self-test: nightly rustdoc fails a compile_fail doc test whose error code is wrong",
                    check.map(|_| ()),
                );
                summary.took(t.elapsed());
            }
            Err(why) => summary.counted(what, -1, None, why.clone()),
        }
    }
    if let (Some(toolchain), true) = (&toolchain, passes.miri) {
        let what = "Miri: cargo +nightly miri test -p rdma-verbs --lib";
        match (toolchain, miri_job) {
            (Ok(_), Some(job)) => {
                let (r, output) = job.join().map_err(|_| "the Miri pass's thread panicked".to_string())??;
                eprintln!("xtask: ==== Miri's output ({:.0} s):", r.elapsed.as_secs_f64());
                eprint!("{output}");
                summary.counted(what, r.code, parse_libtest(&r.stdout), r.note);
                summary.took(r.elapsed);
            }
            (Err(why), _) => summary.counted(what, -1, None, why.clone()),
            (Ok(_), None) => summary.counted(what, -1, None, "not started"),
        }
    }
    eprintln!("xtask: the host passes beside the device job took {:.0} s", started.elapsed().as_secs_f64());
    Ok(summary)
}

/// Gives the calling thread (and the threads and processes it starts) the lowest CPU priority
/// (`nice` 19: Linux keeps a nice value per thread). Best effort: a refusal leaves it as it was.
fn lowest_priority() {
    // SAFETY: gettid has no arguments and cannot fail; setpriority takes plain integers and
    // changes only the scheduling priority of the calling thread.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
}

/// The publish-readiness checks ([`publish`]): MSRV, docs without rdma-core, publish dry run.
fn publish_checks(root: &Path, target_dir: &Path, summary: &mut Summary) -> Result<(), String> {
    let t = Instant::now();
    let msrv = publish::msrv(root, target_dir);
    interrupted()?;
    let what = match &msrv {
        Ok(v) => format!("MSRV: cargo +{v} check --lib --all-features of both crates"),
        Err(_) => "MSRV: cargo +MSRV check of both crates".into(),
    };
    summary.check(&what, msrv.map(|_| ()));
    summary.took(t.elapsed());
    let t = Instant::now();
    let docs = publish::docs_without_rdma_core(root, target_dir);
    interrupted()?;
    summary.check("docs without rdma-core: DOCS_RS=1 cargo doc, pkg-config finding nothing", docs);
    summary.took(t.elapsed());
    let t = Instant::now();
    let dry = publish::dry_run(root);
    interrupted()?;
    summary.check("cargo publish --dry-run --workspace (rdma-verbs-sys, rdma-verbs)", dry);
    summary.took(t.elapsed());
    Ok(())
}

/// Runs the suite; returns the exit status.
pub fn run(opts: &TestOptions) -> Result<u8, String> {
    let start = Instant::now();
    let root = crate::workspace_root();
    let passes = opts.passes;
    let mut summary = Summary::default();

    // The stable build, for the host tests and the device tests (plain and under valgrind).
    let mut twohost = Vec::new();
    let (device, host_tests) = if passes.plain || passes.valgrind || passes.twohost || passes.siw {
        cargo::run(&root, &["build", "--workspace", "--all-targets", "--features", cargo::FEATURES])?;
        cargo::run(&root, &["build", "--examples", "--features", cargo::FEATURES])?;
        let artifacts = cargo::test_artifacts(&root)?;
        interrupted()?;
        twohost = twohost_binaries(&artifacts, &root.join("Cargo.toml"));
        classify(&artifacts, &root.join("Cargo.toml"))
    } else {
        (Vec::new(), Vec::new())
    };
    let target_dir = cargo::target_dir(&root)?;

    if passes.plain {
        let mut host =
            vec![OsString::from("test"), "--workspace".into(), "--features".into(), cargo::FEATURES.into()];
        host.extend(["--lib".into(), "--bins".into()]);
        for name in &host_tests {
            host.extend(["--test".into(), name.into()]);
        }
        let t = Instant::now();
        let (code, tally) = cargo_test(&root, &host)?;
        summary.counted("host tests (cargo test --workspace, no device_*)", code, tally, "");
        summary.took(t.elapsed());
        let t = Instant::now();
        let (code, tally) = cargo_test(
            &root,
            &[
                "test".into(),
                "--workspace".into(),
                "--features".into(),
                cargo::FEATURES.into(),
                "--doc".into(),
            ],
        )?;
        summary.counted("doc tests (cargo test --workspace --doc)", code, tally, "");
        summary.took(t.elapsed());
        // The `dlopen` feature's host test (a build of its own: libibverbs and librdmacm loaded
        // at run time): a program built with it starts where rdma-core is hidden and says which
        // library and package are missing.
        let t = Instant::now();
        let (code, tally) = cargo_test(
            &root,
            &["test".into(), "--features".into(), "dlopen".into(), "--test".into(), "dlopen_absent".into()],
        )?;
        summary.counted(
            "dlopen host test (cargo test --features dlopen --test dlopen_absent)",
            code,
            tally,
            "",
        );
        summary.took(t.elapsed());
        // The `serde` feature's host test (every wire and configuration type to JSON and back)
        // is one of the host tests above: `cargo::FEATURES` enables `serde`.
    }
    // The instruction-count gate's benchmarks (release build), run under callgrind in the
    // device job ([`crate::gate`]).
    let gate = if passes.gate {
        let t = Instant::now();
        let built = cargo::run(&root, &["bench", "--no-run", "--bench", "post_poll", "--bench", "async_op"]);
        interrupted()?;
        if let Err(why) = &built {
            summary.check(GATE_LABEL, Err(format!("not run: the release build failed: {why}")));
        }
        summary.took(t.elapsed());
        built.is_ok()
    } else {
        false
    };
    let toolchain = passes.need_nightly().then(nightly::ensure);
    interrupted()?;
    if let Some(Err(why)) = &toolchain {
        eprintln!("xtask: error: {why}");
    }
    // The ThreadSanitizer build first: the device job runs its binaries.
    let mut tsan = None;
    if let (Some(toolchain), true) = (&toolchain, passes.tsan) {
        let what = "ThreadSanitizer build of tests/device_threads*.rs and tests/device_async.rs";
        let built = toolchain.clone().and_then(|tc| nightly::build_tsan(&tc, &root, &target_dir));
        interrupted()?;
        match built {
            Ok(b) => {
                summary.check(what, Ok(()));
                summary.took(b.elapsed);
                tsan = Some(b);
            }
            Err(why) => summary.check(what, Err(why)),
        }
    }
    // The host passes nothing on the device needs (Miri, the publish checks, the nightly doc
    // tests) run beside the device job, on the CPU time its VMs leave: at the lowest priority,
    // so that a device test's timing (a plain run has one VM, which leaves a core idle) never
    // competes with them ([`host_lane`]). Their lines join the summary when they are done.
    let lane = {
        let (root, target_dir, toolchain) = (root.clone(), target_dir.clone(), toolchain.clone());
        std::thread::spawn(move || host_lane(passes, &root, &target_dir, toolchain))
    };

    // The VM boots if something is to run there (not for a failed ThreadSanitizer build alone).
    if passes.plain || passes.valgrind || tsan.is_some() || gate {
        if device.is_empty() && passes.plain {
            eprintln!(
                "xtask: no device test binaries (tests/device_*.rs) yet: only the harness self-tests use the VM"
            );
        }
        // A job that could not run (no kernel image, QEMU failing to start...) fails its line:
        // the later stages and the summary still come.
        let job = run_device_job(opts, &root, &device, tsan.as_ref(), gate, &mut summary);
        interrupted()?;
        if let Err(e) = job {
            eprintln!("xtask: the device job failed: {e}");
            summary.check("device job (the rxe0 VM)", Err(e));
        }
    }
    if passes.plain {
        run_program_self_tests(&opts.backend, &mut summary);
    }
    if passes.twohost && within_budget(start.elapsed(), "two-host stage", &mut summary) {
        if matches!(opts.backend, Backend::Vm { .. }) {
            run_twohost_stage(&root, &target_dir, &twohost, &mut summary);
            interrupted()?;
        } else {
            eprintln!("xtask: two-host stage skipped: it needs the VM backend (--vm) on this host");
            summary.check("two-host stage", Err("not run: this host has its own device; use --vm".into()));
        }
    }

    if passes.siw && within_budget(start.elapsed(), "siw stage", &mut summary) {
        run_siw_stage(opts, &root, &device, tsan.as_ref(), &mut summary);
        interrupted()?;
    }

    if passes.kernel2 && within_budget(start.elapsed(), "second-kernel stage", &mut summary) {
        run_kernel2_stage(opts, &device, &mut summary);
        interrupted()?;
    }

    let t = Instant::now();
    match lane.join() {
        Ok(Ok(lines)) => summary.absorb(lines),
        Ok(Err(why)) => return Err(why),
        Err(_) => summary.check("host passes beside the device job", Err("their thread panicked".into())),
    }
    eprintln!("xtask: waited {:.0} s for the host passes beside the device job", t.elapsed().as_secs_f64());

    summary.print();
    eprintln!("xtask: test took {:.0} s", start.elapsed().as_secs_f64());
    Ok(if summary.total().failed == 0 && summary.lines.iter().all(|l| l.ok) { 0 } else { 1 })
}

/// How long a run may have taken when a later stage (two-host, siw) starts. A full run takes
/// about 21 minutes; one whose device tests hang spends each binary's 10-minute limit in
/// every pass, and CI's limit is 90 minutes: past this, the later stages are failed unrun,
/// so that the summary still comes out.
const RUN_BUDGET: Duration = Duration::from_secs(60 * 60);

/// Whether a run that has taken `spent` may still start `stage` ([`RUN_BUDGET`]); if not,
/// fails the stage's line in `summary`.
fn within_budget(spent: Duration, stage: &str, summary: &mut Summary) -> bool {
    if spent <= RUN_BUDGET {
        return true;
    }
    eprintln!("xtask: {stage} not started: the run has taken {:.0} min", spent.as_secs_f64() / 60.0);
    summary.check(
        stage.to_string(),
        Err(format!(
            "not run: the run had taken {:.0} min (budget {} min)",
            spent.as_secs_f64() / 60.0,
            RUN_BUDGET.as_secs() / 60
        )),
    );
    false
}

/// The two-host stage (see [`crate::twohost`]): one pair of guests for all two-host tests, then a
/// short second pair whose NICs' MTUs differ.
fn run_twohost_stage(root: &Path, target_dir: &Path, bins: &[Artifact], summary: &mut Summary) {
    let started = Instant::now();
    if bins.is_empty() {
        summary.check("two-host stage", Err("no tests/twohost_*.rs binaries".into()));
        return;
    }
    // XTASK_TWOHOST_ONLY=ranks: only the ranks pair (a developer's shortcut).
    if std::env::var("XTASK_TWOHOST_ONLY").as_deref() != Ok("ranks") {
        let steps = crate::twohost::steps(root, &target_dir.join("debug/examples"), bins);
        run_pair(&steps, &crate::twohost::OPTIONS, "", summary);
        let steps = crate::twohost::mtu_steps(root, bins);
        run_pair(&steps, &crate::twohost::MTU_OPTIONS, "MTUs 1500/4000: ", summary);
    }
    match std::env::current_exe() {
        Ok(xtask) => {
            let steps = crate::twohost::ranks_steps(&target_dir.join("debug/examples"), &xtask);
            run_pair(&steps, &crate::twohost::RANKS_OPTIONS, "4 ranks, 2 rails: ", summary);
        }
        Err(e) => summary.check("two-host stage: ranks", Err(format!("the xtask executable: {e}"))),
    }
    summary.check(
        format!("two-host stage wall time {:.0} s (budget 420 s)", started.elapsed().as_secs_f64()),
        if started.elapsed() <= Duration::from_secs(420) {
            Ok(())
        } else {
            Err("over the stage's 7-minute budget".into())
        },
    );
}

/// Runs `steps` on one pair of guests with `opts` and adds a summary line per step (labels
/// prefixed with `prefix`).
fn run_pair(
    steps: &[crate::rxe2::PairStep],
    opts: &crate::rxe2::PairOptions,
    prefix: &str,
    summary: &mut Summary,
) {
    let started = Instant::now();
    eprintln!("xtask: ==== two-host stage: {prefix}{} steps on two guests joined by a link", steps.len());
    let mut lines: Vec<(String, i32, Option<Tally>, Duration)> = Vec::new();
    let report = crate::rxe2::run(steps, opts, &mut |i, r| {
        let status = run_status(r.code);
        let elapsed = r.sides.iter().flatten().map(|s| s.elapsed).max().unwrap_or_default();
        eprintln!(
            "xtask: two-host: {prefix}{} ... {status} ({:.1} s)",
            steps[i].label,
            elapsed.as_secs_f64()
        );
        // libtest's tally, from the side that ran the most tests.
        let tally = r
            .sides
            .iter()
            .flatten()
            .filter_map(|s| parse_libtest(&String::from_utf8_lossy(&s.stdout)))
            .max_by_key(|t| t.passed + t.failed);
        lines.push((steps[i].label.clone(), r.code, tally, elapsed));
    });
    let report = match report {
        Ok(report) => report,
        Err(e) => {
            summary.check(format!("two-host stage {prefix}"), Err(e));
            return;
        }
    };
    let side_steps = crate::rxe2::side_steps_of(steps);
    report.explain(&side_steps);
    let boot = report.boot.map_or("-".into(), |b| format!("{:.1} s", b.as_secs_f64()));
    eprintln!(
        "xtask: two-host stage {prefix}{:.0} s (boot {boot}); link relayed {} datagrams, dropped {}; guests restarted: A {}, B {}",
        started.elapsed().as_secs_f64(),
        report.relayed,
        report.dropped,
        report.restarts[0],
        report.restarts[1]
    );
    for (i, step) in steps.iter().enumerate() {
        match lines.get(i) {
            Some((label, code, tally, elapsed)) => {
                let what = format!("two-host: {prefix}{label}");
                match tally {
                    // Every step runs tests (some by a name filter): none run is a failure, as
                    // when a test the filter names was renamed.
                    Some(t) if t.passed + t.failed == 0 => {
                        summary.check(what, Err("no test ran: a name filter that matches none?".into()))
                    }
                    Some(t) => summary.counted(what, *code, Some(*t), ""),
                    None if *code == 0 => summary.check(what, Ok(())),
                    None => summary.check(what, Err(format!("exit {code}"))),
                }
                summary.took(*elapsed);
            }
            None => summary.counted(
                format!("two-host: {prefix}{}", step.label),
                -1,
                None,
                "not run (a guest failed)",
            ),
        }
    }
}

/// Fails if a signal came in.
fn interrupted() -> Result<(), String> {
    match signals::received() {
        Some(signal) => Err(format!("interrupted by signal {signal}")),
        None => Ok(()),
    }
}

/// The bound of one host `cargo test` (build included): a test that hangs fails the run's
/// line instead of holding CI to its own limit with no summary.
const CARGO_TEST_LIMIT: Duration = Duration::from_secs(1800);

/// Runs a `cargo test` with its output shown and its stdout parsed, bounded by
/// [`CARGO_TEST_LIMIT`] (then killed with its process group, and failed).
fn cargo_test(root: &Path, args: &[OsString]) -> Result<(i32, Option<Tally>), String> {
    let f = crate::process::run(&mut cargo::command(root, args), CARGO_TEST_LIMIT, true)?;
    if f.timed_out {
        let args: Vec<_> = args.iter().map(|a| a.to_string_lossy()).collect();
        eprintln!("xtask: cargo {}: {}", args.join(" "), f.describe());
    }
    Ok((f.code.unwrap_or(-1), parse_libtest(&f.stdout)))
}

/// Name prefix of the two-host test binaries (`tests/twohost_*.rs`), run by the two-host stage.
pub const TWOHOST_PREFIX: &str = "twohost_";

/// The two-host test binaries of the root package, sorted by name.
pub fn twohost_binaries(artifacts: &[Artifact], root_manifest: &Path) -> Vec<Artifact> {
    let mut bins: Vec<Artifact> = artifacts
        .iter()
        .filter(|a| a.kind.iter().any(|k| k == "test"))
        .filter(|a| a.manifest_path == root_manifest && a.name.starts_with(TWOHOST_PREFIX))
        .cloned()
        .collect();
    bins.sort_by(|a, b| a.name.cmp(&b.name));
    bins
}

/// Splits the artifacts into the device test binaries (integration tests of the package at
/// `root_manifest` named `device_*`) and the names of the other integration test targets.
pub fn classify(artifacts: &[Artifact], root_manifest: &Path) -> (Vec<Artifact>, Vec<String>) {
    let mut device = Vec::new();
    let mut host = Vec::new();
    for a in artifacts.iter().filter(|a| a.kind.iter().any(|k| k == "test")) {
        if a.manifest_path == root_manifest && a.name.starts_with("device_") {
            device.push(a.clone());
        } else if a.manifest_path == root_manifest && a.name.starts_with(TWOHOST_PREFIX) {
            // Neither host nor single-guest tests: the two-host stage runs them.
        } else if !host.contains(&a.name) {
            host.push(a.name.clone());
        }
    }
    device.sort_by(|a, b| a.name.cmp(&b.name));
    (device, host)
}

/// A step whose output is only kept, for a self-test.
fn self_test_step(label: &str, script: Vec<u8>, timeout_secs: u64) -> Step {
    Step { label: label.into(), script, timeout: Duration::from_secs(timeout_secs), output: Output::Captured }
}

/// A check of a step's result.
type Check = Box<dyn Fn(&StepResult) -> Result<(), String>>;

/// Expects exit status `code`.
fn code_is(r: &StepResult, code: i32) -> Result<(), String> {
    if r.code == code {
        Ok(())
    } else {
        Err(format!(
            "exit status {} instead of {code}; stderr: {}",
            r.code,
            String::from_utf8_lossy(&r.stderr).trim()
        ))
    }
}

/// Expects `stream` to be exactly `want`.
fn stream_is(which: &str, got: &[u8], want: &str) -> Result<(), String> {
    if got == want.as_bytes() {
        Ok(())
    } else {
        Err(format!("{which} was {:?} instead of {want:?}", String::from_utf8_lossy(got)))
    }
}

/// The harness's self-tests that run as steps of the device job.
fn job_self_tests(backend: &Backend, root: &Path) -> Vec<(Step, Check)> {
    let argv = |args: &[&str]| shell::argv_script(root, &args.iter().map(OsString::from).collect::<Vec<_>>());
    let expected = |name: &str| {
        let device = vm::device_env(backend).into_iter().find(|(n, _)| n == name).map(|(_, v)| v);
        device.or_else(|| std::env::var(name).ok()).unwrap_or_default()
    };
    let env_want = format!(
        "{}\n{}\n{}\n{}\n",
        expected("IBVERBS_TEST_DEVICE"),
        expected("IBVERBS_TEST_GID_INDEX"),
        std::env::var("PATH").unwrap_or_default(),
        root.display()
    );
    let mut tests: Vec<(Step, Check)> = Vec::new();
    for code in [0, 1, 101] {
        let step = self_test_step(
            &format!("exit status {code} comes back"),
            argv(&["sh", "-c", &format!("exit {code}")]),
            30,
        );
        tests.push((step, Box::new(move |r| code_is(r, code))));
    }
    tests.push((
        self_test_step(
            "stdout and stderr come back apart",
            argv(&["sh", "-c", "echo to-stdout; echo to-stderr >&2; echo more-stdout"]),
            30,
        ),
        Box::new(|r| {
            code_is(r, 0)?;
            stream_is("stdout", &r.stdout, "to-stdout\nmore-stdout\n")?;
            stream_is("stderr", &r.stderr, "to-stderr\n")
        }),
    ));
    tests.push((
        self_test_step(
            "arguments arrive intact",
            argv(&["printf", "%s|", "a b", "it's", "$HOME", "*", "x\ny", ""]),
            30,
        ),
        Box::new(|r| stream_is("stdout", &r.stdout, "a b|it's|$HOME|*|x\ny||")),
    ));
    tests.push((
        self_test_step(
            "device variables, PATH and working directory",
            argv(&[
                "sh",
                "-c",
                r#"printf '%s\n' "$IBVERBS_TEST_DEVICE" "$IBVERBS_TEST_GID_INDEX" "$PATH" "$(pwd)""#,
            ]),
            30,
        ),
        Box::new(move |r| stream_is("stdout", &r.stdout, &env_want)),
    ));
    tests.push((
        self_test_step("a missing command fails clearly (127)", argv(&["xtask-no-such-command", "arg"]), 30),
        Box::new(|r| {
            code_is(r, i32::from(shell::EXIT_NOT_FOUND))?;
            let err = String::from_utf8_lossy(&r.stderr);
            if err.contains("xtask-no-such-command: command not found") {
                Ok(())
            } else {
                Err(format!("unclear message: {err:?}"))
            }
        }),
    ));
    tests.push((
        self_test_step("a step's timeout stops it (124)", argv(&["sh", "-c", "echo started; sleep 1000"]), 3),
        Box::new(|r| {
            code_is(r, i32::from(vm::EXIT_TIMEOUT))?;
            stream_is("stdout", &r.stdout, "started\n")?;
            if !r.timed_out || r.elapsed > Duration::from_secs(20) {
                return Err(format!("not seen as a timeout (after {:?})", r.elapsed));
            }
            Ok(())
        }),
    ));
    tests.push((
        self_test_step(
            "ibv_devinfo shows the device PORT_ACTIVE",
            shell::in_dir(root, br#"ibv_devinfo -d "$IBVERBS_TEST_DEVICE""#),
            60,
        ),
        Box::new(|r| {
            code_is(r, 0)?;
            if String::from_utf8_lossy(&r.stdout).contains("PORT_ACTIVE") {
                Ok(())
            } else {
                Err(format!("no PORT_ACTIVE in: {}", String::from_utf8_lossy(&r.stdout)))
            }
        }),
    ));
    tests.push((
        self_test_step(
            "ibv_rc_pingpong server and client exchange data",
            shell::in_dir(root, demo::RC_PINGPONG.as_bytes()),
            120,
        ),
        Box::new(|r| {
            let out = String::from_utf8_lossy(&r.stdout);
            let client = out.split("--- server:").next().unwrap_or_default();
            if r.code == 0 && client.contains("bytes in") {
                Ok(())
            } else {
                Err(format!("exit {}; output:\n{out}{}", r.code, String::from_utf8_lossy(&r.stderr)))
            }
        }),
    ));
    tests
}

/// Counts of RDMA objects per (device, kind), from `rdma resource show`.
pub type Resources = BTreeMap<(String, String), u64>;

/// Parses `rdma resource show` (`0: rxe0: pd 1 cq 0 qp 1 cm_id 0 mr 0 ctx 0 srq 0` per device).
pub fn parse_resources(text: &str) -> Resources {
    let mut counts = Resources::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let [index, device, rest @ ..] = &words[..] else { continue };
        if !index.ends_with(':') || !device.ends_with(':') || index[..index.len() - 1].parse::<u32>().is_err()
        {
            continue;
        }
        let device = device.trim_end_matches(':');
        for pair in rest.chunks_exact(2) {
            if let Ok(n) = pair[1].parse() {
                counts.insert((device.to_string(), pair[0].to_string()), n);
            }
        }
    }
    counts
}

/// The objects counted in `after` beyond `baseline`, as `rxe0 qp +1` items.
pub fn leaked(baseline: &Resources, after: &Resources) -> Vec<String> {
    after
        .iter()
        .filter_map(|(key, &n)| {
            let before = baseline.get(key).copied().unwrap_or(0);
            (n > before).then(|| format!("{} {} +{}", key.0, key.1, n - before))
        })
        .collect()
}

/// `rdma resource show`, then (after a `---` line) the details of each object kind.
const RESOURCES_SCRIPT: &[u8] = b"rdma resource show || exit\necho ---\nfor kind in qp cq mr pd ctx srq cm_id; do rdma resource show $kind; done\ntrue\n";

/// How a device test binary runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// As it is.
    Plain,
    /// Under valgrind's memcheck.
    Valgrind,
    /// A ThreadSanitizer build.
    Tsan,
}

/// A device test binary as a step of the device job, and its line in the summary.
#[derive(Debug)]
struct DeviceRun {
    what: String,
    kind: Kind,
    step: Step,
}

/// The script of a device test binary's step: `CARGO_MANIFEST_DIR`, `prelude`, then
/// `exec WRAPPER... EXE --test-threads=1 TEST_ARGS...` in the workspace root.
fn device_script(
    root: &Path,
    prelude: &[u8],
    wrapper: &[OsString],
    exe: &Path,
    test_args: &[OsString],
) -> Vec<u8> {
    let mut script = b"export CARGO_MANIFEST_DIR=".to_vec();
    script.extend_from_slice(&shell::quote(root.as_os_str().as_bytes()));
    script.push(b'\n');
    script.extend_from_slice(prelude);
    script.extend_from_slice(b"exec");
    for word in wrapper.iter().map(|w| w.as_bytes()).chain([exe.as_os_str().as_bytes()]) {
        script.push(b' ');
        script.extend_from_slice(&shell::quote(word));
    }
    script.extend_from_slice(b" --test-threads=1");
    for arg in test_args {
        script.push(b' ');
        script.extend_from_slice(&shell::quote(arg.as_bytes()));
    }
    script
}

/// `export IBVERBS_TEST_TIME_SCALE=...` (unless set), `RUST_BACKTRACE=0` and, for TSan,
/// `TSAN_OPTIONS`. Backtraces captured and symbolized under a sanitizer made the tests that panic
/// on purpose slow (under TSan, `device_async`'s: one 63 s against 9 s, another 132 s against
/// 0.7 s; under valgrind `device_soundness`'s three `panicking` tests 45 s against 25 s; rxe0,
/// 2026-12-04); a failing test's backtrace is in its plain run.
fn sanitizer_prelude(root: &Path, kind: Kind) -> Vec<u8> {
    let scale = if kind == Kind::Tsan { TSAN_TIME_SCALE } else { VALGRIND_TIME_SCALE };
    let mut prelude = format!(
        "export IBVERBS_TEST_TIME_SCALE=\"${{IBVERBS_TEST_TIME_SCALE:-{scale}}}\"\nexport RUST_BACKTRACE=0\n"
    )
    .into_bytes();
    if kind == Kind::Tsan {
        prelude.extend_from_slice(b"export TSAN_OPTIONS=");
        prelude.extend_from_slice(&shell::quote(tsan_options(root).as_bytes()));
        prelude.extend_from_slice(b"\"${TSAN_OPTIONS:+ $TSAN_OPTIONS}\"\n");
    }
    prelude
}

/// The device test binaries' steps: plain, under valgrind, ThreadSanitizer builds.
fn device_runs(
    opts: &TestOptions,
    root: &Path,
    device: &[Artifact],
    tsan: Option<&TsanBuild>,
) -> Vec<DeviceRun> {
    let where_ = if matches!(opts.backend, Backend::Vm { .. }) { "in the VM" } else { "on this host" };
    let mut runs = Vec::new();
    let mut add = |name: &str, how: &str, kind: Kind, script: Vec<u8>| {
        let step = Step {
            label: format!("{name} ({how})"),
            script: shell::in_dir(root, &script),
            timeout: opts.timeout,
            output: Output::Live,
        };
        let what = if kind == Kind::Plain {
            format!("{name} ({where_})")
        } else {
            format!("{name} ({how}, {where_})")
        };
        runs.push(DeviceRun { what, kind, step });
    };
    if opts.passes.plain {
        for bin in device {
            let script = device_script(root, b"", &[], &bin.executable, &opts.test_args);
            add(&bin.name, "device tests", Kind::Plain, script);
        }
    }
    if opts.passes.valgrind {
        for bin in device.iter().filter(|b| !CHILD_ONLY.contains(&b.name.as_str())) {
            let prelude = sanitizer_prelude(root, Kind::Valgrind);
            let args = skip_args(&bin.name, &opts.test_args, &CHILD_ONLY_TESTS);
            let script = device_script(root, &prelude, &valgrind_argv(root), &bin.executable, &args);
            add(&bin.name, "valgrind", Kind::Valgrind, script);
        }
    }
    if let Some(build) = tsan {
        for bin in &build.tests {
            let prelude = sanitizer_prelude(root, Kind::Tsan);
            let args = skip_args(&bin.name, &opts.test_args, &TSAN_SKIP_TESTS);
            let script = device_script(root, &prelude, &[], &bin.executable, &args);
            add(&bin.name, "ThreadSanitizer", Kind::Tsan, script);
        }
    }
    runs
}

/// Tests left out of the ThreadSanitizer runs (`--skip FILTER`): the binary and the filter.
/// `no_busy_polling` measures CPU time against wall time, which TSan's instrumentation inflates
/// (the awaiting thread measured 76 % busy).
pub const TSAN_SKIP_TESTS: [(&str, &str); 1] = [("device_async", "no_busy_polling")];

/// The test arguments of binary `name`'s run in a pass that leaves out `skips` (its table of
/// binaries and filters: [`CHILD_ONLY_TESTS`], [`TSAN_SKIP_TESTS`]): the caller's, then a
/// `--skip FILTER` per entry of the binary.
fn skip_args(name: &str, test_args: &[OsString], skips: &[(&str, &str)]) -> Vec<OsString> {
    let mut args = test_args.to_vec();
    for (_, filter) in skips.iter().filter(|(bin, _)| *bin == name) {
        args.extend([OsString::from("--skip"), OsString::from(filter)]);
    }
    args
}

/// The device test binaries of the siw stage (soft-iWARP, `siw0`): the core verbs, RDMA-CM, the
/// CM examples against rdmacm-utils (rping at 1/4096/65536 bytes, rdma_server/client, ours and
/// C's in both roles), receive pools, the allocation-free hot path, prepared requests, scoped
/// borrows, shared receive queues, the soundness holes' regression tests, threads, completion and
/// asynchronous events, the async adaptor, the extended data path, memory windows, striped
/// connections, the device capabilities, the device selection with the tools that use it
/// (beside an rxe1 the tests add), the soak (48 queue pairs through RDMA-CM, 150 000
/// operations: 18 s in CI) and the perftest-style examples (`device_perf`, every run with `-R`:
/// 17 s). They connect through RDMA-CM on iWARP (`tests/common::pair`, `connect_built`) and
/// report what iWARP or siw lacks (`IBVERBS-UNSUPPORTED:`: atomics, extended QPs and CQs, memory
/// windows, RoCE GID selection, queues beyond 576 KiB per context...). Not here: the binaries of
/// rxe's tools and perftest (`device_examples*`, `device_example_faults`). Three of them also
/// run under valgrind ([`SIW_VALGRIND`]). The plain runs: 137 s, 188 tests (CI, 2026-12-03).
pub const SIW_BINARIES: [&str; 21] = [
    "device_core",
    "device_cm",
    "device_cm_examples",
    "device_pool",
    "device_alloc",
    "device_prepared",
    "device_scope",
    "device_srq",
    "device_soundness",
    "device_threads",
    "device_threads_srq",
    "device_events",
    "device_async",
    "device_ex",
    "device_mw",
    "device_window_drops",
    "device_multi_qp",
    "device_caps",
    "device_select",
    "device_soak",
    "device_perf",
];

/// The binaries of [`SIW_BINARIES`] the siw stage also runs under valgrind (memcheck, as the
/// valgrind pass does on rxe0): the soundness holes' regression tests, threads and prepared
/// requests, over siw's user-mapped queues and the fences the safe level adds on siw. The first
/// runs in the stage's VM after its plain runs (92 s with the time scale of 20, CI 2026-12-03),
/// the others in a second siw VM beside it (53 s and 38 s). `device_scope` (130 s), `device_cm`
/// (56 s) and `device_srq` (39 s) also report 0 errors there, and are left out for CI's time
/// (30 min).
pub const SIW_VALGRIND: [&str; 3] = ["device_soundness", "device_threads", "device_prepared"];

/// The siw stage: [`SIW_BINARIES`] in one boot of a VM with `siw0` instead of `rxe0`, then
/// [`SIW_VALGRIND`] under valgrind (all but the first in a second siw VM, which boots when the
/// plain runs are over), then the ThreadSanitizer builds of the threads tests
/// (`tests/device_threads*.rs`, when that pass built them: 6 s on siw0, 2026-12-03), whose
/// completions come in another order on siw (fenced sends, Reads that complete late), and of
/// the async adaptor's tests (`tests/device_async.rs`).
fn run_siw_stage(
    opts: &TestOptions,
    root: &Path,
    device: &[Artifact],
    tsan: Option<&TsanBuild>,
    summary: &mut Summary,
) {
    let Backend::Vm { mtu, .. } = opts.backend else {
        eprintln!("xtask: siw stage skipped: it needs the VM backend (--vm) on this host");
        summary.check("siw stage", Err("not run: this host has its own device; use --vm".into()));
        return;
    };
    let backend = Backend::Vm { mtu, device: crate::vm::VmDevice::Siw };
    let bins: Vec<&Artifact> =
        SIW_BINARIES.iter().filter_map(|name| device.iter().find(|b| b.name == *name)).collect();
    if bins.len() != SIW_BINARIES.len() {
        summary.check("siw stage: its binaries", Err(format!("missing some of {}", SIW_BINARIES.join(", "))));
    }
    let step = |label: String, script: Vec<u8>| Step {
        label,
        script: shell::in_dir(root, &script),
        timeout: opts.timeout,
        output: Output::Live,
    };
    let mut runs: Vec<DeviceRun> = bins
        .iter()
        .map(|bin| DeviceRun {
            what: format!("{} (siw0, in the VM)", bin.name),
            kind: Kind::Plain,
            step: step(
                format!("{} (siw0)", bin.name),
                device_script(root, b"", &[], &bin.executable, &opts.test_args),
            ),
        })
        .collect();
    let prelude = sanitizer_prelude(root, Kind::Valgrind);
    // In SIW_VALGRIND's order: the first stays in this VM.
    for bin in SIW_VALGRIND.iter().filter_map(|name| bins.iter().find(|b| b.name == *name)) {
        let script = device_script(root, &prelude, &valgrind_argv(root), &bin.executable, &opts.test_args);
        runs.push(DeviceRun {
            what: format!("{} (siw0, valgrind, in the VM)", bin.name),
            kind: Kind::Valgrind,
            step: step(format!("{} (siw0, valgrind)", bin.name), script),
        });
    }
    runs.extend(siw_tsan_runs(root, tsan, &opts.test_args, &step));
    // The second VM takes every valgrind run but the first (device_soundness, the longest).
    let mut valgrind = 0;
    let (runs, side): (Vec<DeviceRun>, Vec<DeviceRun>) = runs.into_iter().partition(|r| {
        valgrind += usize::from(r.kind == Kind::Valgrind);
        r.kind != Kind::Valgrind || valgrind == 1
    });
    let steps: Vec<Step> = runs.iter().map(|r| r.step.clone()).collect();
    let side_steps: Vec<Step> = side.iter().map(|r| r.step.clone()).collect();
    let plain = runs.iter().take_while(|r| r.kind == Kind::Plain).count();
    let started = Instant::now();
    let (report, side_report) = run_beside(
        (&steps, &backend, plain.checked_sub(1)),
        (&side_steps, "-siw-valgrind2", 0..side_steps.len()),
        &mut |i, r| {
            let status = run_status(r.code);
            eprintln!("xtask: {} ... {status} ({:.1} s)", steps[i].label, r.elapsed.as_secs_f64());
        },
    );
    let took = started.elapsed();
    eprintln!(
        "xtask: siw stage ({} runs, {} boots): {:.1} s",
        steps.len() + side_steps.len(),
        1 + usize::from(!side.is_empty()),
        took.as_secs_f64()
    );
    for (runs, report, steps) in [(runs, Some(report), &steps), (side, side_report, &side_steps)] {
        let Some(report) = report else { continue };
        let report = match report {
            Ok(report) => report,
            Err(e) => {
                for run in runs {
                    summary.counted(run.what, -1, None, format!("not run: {e}"));
                }
                continue;
            }
        };
        report.explain(steps);
        let note = vm_note(&report.end, steps);
        record_device_runs(&runs, &report, 0, &note, opts.timeout, summary);
    }
    summary.check("siw stage (boot included)", Ok(()));
    summary.took(took);
}

/// The device test binaries of the second-kernel stage: those that reach the provider's and the
/// kernel's own behaviour (the core verbs, extended CQs and QPs, windows, completion accounting
/// across every data path, events, SRQs), run on rxe under the newest kernel of Debian's
/// backports suite (6.12 on Debian 12), where the guests otherwise boot the host's (6.1). The
/// crate's workarounds are version-aware; this stage shows, in every run, that they hold on the
/// newer kernel too (measured there once: every device binary; one async test's time bound was
/// tight, 6.12's rxe being about twice as slow per packet under TCG).
pub const KERNEL2_BINARIES: [&str; 6] =
    ["device_core", "device_ex", "device_mw", "device_accounting", "device_events", "device_srq"];

/// The second-kernel stage: each of [`KERNEL2_BINARIES`] in a boot of its own of
/// `cargo xtask rxe --kernel backports` (which fetches and caches that kernel). Where no apt
/// source offers a backports kernel, the stage says so by name and runs nothing.
fn run_kernel2_stage(opts: &TestOptions, device: &[Artifact], summary: &mut Summary) {
    if !matches!(opts.backend, Backend::Vm { .. }) {
        summary.check("second-kernel stage", Err("not run: this host has its own device; use --vm".into()));
        return;
    }
    let started = Instant::now();
    let timeout = opts.timeout.as_secs().to_string();
    eprintln!(
        "xtask: ==== second-kernel stage: {} binaries on rxe0 under the backports kernel",
        KERNEL2_BINARIES.len()
    );
    for name in KERNEL2_BINARIES {
        let Some(bin) = device.iter().find(|b| b.name == name) else {
            summary.check(format!("{name} (second kernel)"), Err("no such test binary".into()));
            continue;
        };
        let exe = bin.executable.to_string_lossy().into_owned();
        let mut args =
            vec!["rxe", "--kernel", "backports", "--timeout", &timeout, "--", &exe, "--test-threads=1"];
        let extra: Vec<String> = opts.test_args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        args.extend(extra.iter().map(String::as_str));
        let run = sub_xtask(&args, &[], opts.timeout + Duration::from_secs(600), None);
        let run = match run {
            Ok(run) => run,
            Err(e) => {
                summary.counted(format!("{name} (second kernel)"), -1, None, format!("not run: {e}"));
                continue;
            }
        };
        if run.stderr.contains("no backports suite offers") {
            eprintln!("xtask: second-kernel stage not run: no apt source offers a backports kernel");
            summary.check(
                "second-kernel stage: not run (no apt source offers a backports kernel: add the \
                 distribution's backports suite to test one)",
                Ok(()),
            );
            return;
        }
        let kernel = run
            .stderr
            .lines()
            .find_map(|l| l.split("(kernel ").nth(1).and_then(|k| k.split(',').next()))
            .unwrap_or("backports")
            .to_string();
        summary.unsupported_from(&run.stdout);
        let note = if run.code == Some(0) {
            String::new()
        } else {
            vm::last_lines(&run.stderr, 3).trim_end().replace('\n', " / ")
        };
        summary.counted(
            format!("{name} (rxe0, kernel {kernel})"),
            run.code.unwrap_or(-1),
            parse_libtest(&run.stdout),
            note,
        );
        summary.took(run.elapsed);
    }
    eprintln!("xtask: second-kernel stage: {:.1} s", started.elapsed().as_secs_f64());
}

/// The siw stage's ThreadSanitizer runs: each binary of the ThreadSanitizer build that is one of
/// [`SIW_BINARIES`] (all of them: `tests/device_threads*.rs`, `tests/device_async.rs`), with the
/// TSan prelude, less [`TSAN_SKIP_TESTS`].
fn siw_tsan_runs(
    root: &Path,
    tsan: Option<&TsanBuild>,
    test_args: &[OsString],
    step: &dyn Fn(String, Vec<u8>) -> Step,
) -> Vec<DeviceRun> {
    let Some(build) = tsan else { return Vec::new() };
    let prelude = sanitizer_prelude(root, Kind::Tsan);
    build
        .tests
        .iter()
        .filter(|b| SIW_BINARIES.contains(&b.name.as_str()))
        .map(|bin| DeviceRun {
            what: format!("{} (siw0, ThreadSanitizer, in the VM)", bin.name),
            kind: Kind::Tsan,
            step: step(
                format!("{} (siw0, ThreadSanitizer)", bin.name),
                device_script(
                    root,
                    &prelude,
                    &[],
                    &bin.executable,
                    &skip_args(&bin.name, test_args, &TSAN_SKIP_TESTS),
                ),
            ),
        })
        .collect()
}

/// Device test binaries that call no verb in-process: their tests run the examples as child
/// processes, which valgrind does not trace, so under valgrind they would check only the test
/// harness. The valgrind pass leaves them out; [`child_only_check`] proves each still calls no
/// verb (the examples' own code is exercised in-process by the library's device tests).
pub const CHILD_ONLY: [&str; 5] =
    ["device_cm_examples", "device_examples", "device_examples_env", "device_example_faults", "device_perf"];

/// Tests of the other device binaries that only start examples, left out of their valgrind run
/// (`--skip FILTER`): the binary and the filter (libtest's, a substring of the test names). Under
/// valgrind they only wait for child processes, which it does not trace (`device_select`'s
/// `devinfo`/`doctor` tests: ~30 s of a CI run's valgrind pass).
pub const CHILD_ONLY_TESTS: [(&str, &str); 2] = [("device_select", "devinfo_"), ("device_select", "doctor_")];

/// What a device test source must not contain to be in [`CHILD_ONLY`]: the calls that open a
/// device or create a verbs object in the test process.
const IN_PROCESS_VERBS: [&str; 7] = [
    "context()",
    "Context::open",
    "Device::open",
    "ibverbs::devices",
    "alloc_pd",
    "create_cq",
    "async_events",
];

/// Checks that every [`CHILD_ONLY`] binary's source (`tests/NAME.rs`) exists and calls no verb.
pub fn child_only_check(root: &Path) -> Result<(), String> {
    for name in CHILD_ONLY {
        let path = root.join("tests").join(format!("{name}.rs"));
        let src = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // Comments may name a verb without calling it.
        let code: String =
            src.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
        if let Some(call) = IN_PROCESS_VERBS.iter().find(|c| code.contains(*c)) {
            return Err(format!(
                "{} calls `{call}`: it uses verbs in-process, so it must run under valgrind (take it out of CHILD_ONLY)",
                path.display()
            ));
        }
    }
    Ok(())
}

/// Checks that every filter of [`CHILD_ONLY_TESTS`] names at least one test of its binary's source
/// (`#[test] fn NAME` with the filter in `NAME`), so that a renamed test is not left out silently, and
/// that each such test starts an example (calls `tool(`).
pub fn child_only_tests_check(root: &Path) -> Result<(), String> {
    for (name, filter) in CHILD_ONLY_TESTS {
        let path = root.join("tests").join(format!("{name}.rs"));
        let src = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut found = 0;
        for (fn_name, test) in test_fns(&src) {
            if !fn_name.contains(filter) {
                continue;
            }
            found += 1;
            let body = test.split("\n}\n").next().unwrap_or(test);
            if !body.contains("tool(") {
                return Err(format!(
                    "{}: {fn_name} starts no example (`tool(`): valgrind must run it",
                    path.display()
                ));
            }
        }
        if found == 0 {
            return Err(format!("{}: no test name contains `{filter}` (CHILD_ONLY_TESTS)", path.display()));
        }
    }
    Ok(())
}

/// The `#[test]` functions of a test file's source: each one's name and its text up to the next
/// `#[test]`.
fn test_fns(src: &str) -> impl Iterator<Item = (&str, &str)> {
    src.split("#[test]").skip(1).filter_map(|test| {
        let name = test.trim_start().strip_prefix("fn ")?.split('(').next()?;
        Some((name, test))
    })
}

/// `valgrind: N errors, definitely lost X` from valgrind's stderr, or `None` if it printed no
/// `ERROR SUMMARY` (so the program did not run under valgrind).
pub fn valgrind_verdict(stderr: &str) -> Option<(u64, String)> {
    let errors = stderr.lines().rev().find_map(|l| {
        let rest = l.split_once("ERROR SUMMARY: ")?.1;
        rest.split_whitespace().next()?.parse::<u64>().ok()
    })?;
    let lost = stderr
        .lines()
        .rev()
        .find_map(|l| l.split_once("definitely lost: ").map(|(_, r)| r.trim().to_string()))
        .unwrap_or_else(|| "no leak summary".into());
    Some((errors, format!("valgrind: {errors} errors, definitely lost: {lost}")))
}

/// How many ThreadSanitizer reports a program's stderr holds.
pub fn tsan_reports(stderr: &str) -> usize {
    stderr.matches("WARNING: ThreadSanitizer:").count()
}

/// The summary entry of a device test binary's step: (exit status to count, note).
fn device_verdict(run: &DeviceRun, r: &StepResult, timeout: Duration) -> (i32, String) {
    let stderr = String::from_utf8_lossy(&r.stderr);
    let mut notes = Vec::new();
    let mut code = r.code;
    if r.timed_out {
        notes.push(format!("timed out after {} s", timeout.as_secs()));
    }
    match run.kind {
        Kind::Plain => {}
        Kind::Valgrind => match valgrind_verdict(&stderr) {
            Some((_, note)) => {
                if r.code == VALGRIND_ERROR_EXIT {
                    notes.push(format!("valgrind found errors (exit {VALGRIND_ERROR_EXIT}); {note}"));
                } else {
                    notes.push(note);
                }
            }
            None if !r.timed_out => {
                code = if code == 0 { -1 } else { code };
                notes.push("no valgrind ERROR SUMMARY in its output: it did not run under valgrind".into());
            }
            None => {}
        },
        Kind::Tsan => {
            let n = tsan_reports(&stderr);
            if n > 0 || r.code == nightly::TSAN_EXIT {
                notes.push(format!("ThreadSanitizer: {n} report(s) (exit {})", r.code));
            }
        }
    }
    (code, notes.join("; "))
}

/// Self-tests proving the sanitizer passes catch what they are for, as steps of the device job.
fn sanitizer_self_tests(root: &Path, passes: Passes, tsan: Option<&TsanBuild>) -> Vec<(Step, Check)> {
    let mut tests: Vec<(Step, Check)> = Vec::new();
    if passes.valgrind {
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("xtask"));
        let mut argv = valgrind_argv(root);
        argv.extend([exe.into_os_string(), crate::MEMCHECK_PROBE.into()]);
        tests.push((
            self_test_step(
                "valgrind fails a program with an uninitialised read and a definite leak (exit 99)",
                shell::argv_script(root, &argv),
                300,
            ),
            Box::new(|r| {
                code_is(r, VALGRIND_ERROR_EXIT)?;
                let err = String::from_utf8_lossy(&r.stderr);
                for want in ["points to uninitialised byte(s)", "definitely lost: 64 bytes in 1 blocks"] {
                    if !err.contains(want) {
                        return Err(format!(
                            "no `{want}` in valgrind's report:\n{}",
                            vm::last_lines(&err, 30)
                        ));
                    }
                }
                Ok(())
            }),
        ));
    }
    if let Some(build) = tsan {
        let mut script = b"export TSAN_OPTIONS=".to_vec();
        script.extend_from_slice(&shell::quote(tsan_options(root).as_bytes()));
        script.extend_from_slice(b"\nexec ");
        script.extend_from_slice(&shell::quote(build.probe.as_os_str().as_bytes()));
        tests.push((
            self_test_step(
                "ThreadSanitizer fails a program with a data race (exit 66)",
                shell::in_dir(root, &script),
                120,
            ),
            Box::new(|r| {
                code_is(r, nightly::TSAN_EXIT)?;
                let err = String::from_utf8_lossy(&r.stderr);
                if err.contains("WARNING: ThreadSanitizer: data race") {
                    Ok(())
                } else {
                    Err(format!("no data race report:\n{}", vm::last_lines(&err, 30)))
                }
            }),
        ));
    }
    tests
}

/// The device test binaries (plain, under valgrind, ThreadSanitizer builds), the self-tests and the
/// leak check, in one VM boot; in the VM, half of the valgrind runs go to a second VM of their own
/// (see [`split_valgrind`]), booted once the plain runs are done, with its own leak check.
/// The summary line of the instruction-count gate.
const GATE_LABEL: &str =
    "instruction-count gate: callgrind counts of the hot paths vs xtask/gate-baseline.txt";

/// How long the gate's callgrind runs may take (about 3 minutes under TCG).
const GATE_TIMEOUT: u64 = 900;

/// The device job: the device test binaries (plain, then under the sanitizers), the harness's
/// self-tests, the instruction-count gate when `gate` (its benchmarks were built), and the
/// leak check, in one boot (the valgrind runs split over a second VM beside it).
fn run_device_job(
    opts: &TestOptions,
    root: &Path,
    device: &[Artifact],
    tsan: Option<&TsanBuild>,
    gate: bool,
    summary: &mut Summary,
) -> Result<(), String> {
    if opts.passes.valgrind {
        summary.check(
            format!(
                "valgrind pass leaves out {} (no verb in-process: they only start examples, which valgrind does not trace)",
                CHILD_ONLY.join(", ")
            ),
            child_only_check(root),
        );
        let skipped: Vec<String> = CHILD_ONLY_TESTS.iter().map(|(b, f)| format!("{b} --skip {f}")).collect();
        summary.check(
            format!("valgrind pass leaves out tests that only start examples: {}", skipped.join(", ")),
            child_only_tests_check(root),
        );
    }
    let (runs, side) = split_valgrind(device_runs(opts, root, device, tsan), &opts.backend);
    // The plain runs come first (device_runs): the second VM starts after them, so that the two
    // VMs run side by side only under the sanitizers, never under a plain run's timing.
    let plain = runs.iter().take_while(|r| r.kind == Kind::Plain).count();
    let baseline = || self_test_step("rdma resource baseline", RESOURCES_SCRIPT.to_vec(), 60);
    let check = || self_test_step("rdma resource check", RESOURCES_SCRIPT.to_vec(), 60);
    let mut steps = vec![baseline()];
    steps.extend(runs.iter().map(|r| r.step.clone()));
    let mut self_tests = if opts.passes.plain { job_self_tests(&opts.backend, root) } else { Vec::new() };
    self_tests.extend(sanitizer_self_tests(root, opts.passes, tsan));
    let first_self_test = steps.len();
    steps.extend(self_tests.iter().map(|(step, _)| step.clone()));
    let gate_step = gate.then(|| {
        let mut script = b"TARGET_DIR=".to_vec();
        script.extend_from_slice(&shell::quote(
            cargo::target_dir(root).unwrap_or_default().as_os_str().as_bytes(),
        ));
        script.push(b'\n');
        script.extend_from_slice(crate::gate::script().as_bytes());
        steps.push(self_test_step(GATE_LABEL, shell::in_dir(root, &script), GATE_TIMEOUT));
        steps.len() - 1
    });
    let leak_step = steps.len();
    steps.push(check());
    // No second VM when it has no run (e.g. `test --gate` alone).
    let mut side_steps = Vec::new();
    if !side.is_empty() {
        side_steps.push(baseline());
        side_steps.extend(side.iter().map(|r| r.step.clone()));
        side_steps.push(check());
    }

    let started = Instant::now();
    let mut verdicts: Vec<Result<(), String>> = Vec::new();
    let mut gate_verdict: Option<Result<(), String>> = None;
    let (report, side_report) = run_beside(
        // Step 0 is the baseline: step `plain` is the last plain run.
        (&steps, &opts.backend, (plain > 0).then_some(plain)),
        (&side_steps, "-valgrind2", 1..side_steps.len().saturating_sub(1)),
        &mut |i, r| {
            if Some(i) == gate_step {
                let baseline = std::fs::read_to_string(root.join(crate::gate::BASELINE))
                    .map_err(|e| format!("{}: {e}", crate::gate::BASELINE));
                let out = String::from_utf8_lossy(&r.stdout);
                let verdict = baseline.and_then(|b| crate::gate::check(&out, r.code, &b));
                match &verdict {
                    Ok(table) => {
                        eprintln!("xtask: {GATE_LABEL} ... ok ({:.0} s)\n{table}", r.elapsed.as_secs_f64())
                    }
                    Err(why) => eprintln!("xtask: {GATE_LABEL} ... FAILED: {why}"),
                }
                gate_verdict = Some(verdict.map(|_| ()));
            } else if (first_self_test..first_self_test + self_tests.len()).contains(&i) {
                let verdict = self_tests[i - first_self_test].1(r);
                let status = if verdict.is_ok() { "ok" } else { "FAILED" };
                eprintln!("xtask: self-test: {} ... {status}", steps[i].label);
                verdicts.push(verdict);
            } else if (1..first_self_test).contains(&i) {
                let status = run_status(r.code);
                eprintln!("xtask: {} ... {status} ({:.1} s)", steps[i].label, r.elapsed.as_secs_f64());
            }
        },
    );
    let report = report?;
    eprintln!("xtask: {} steps in one boot: {:.1} s", steps.len(), started.elapsed().as_secs_f64());
    report.explain(&steps);
    let note = vm_note(&report.end, &steps);
    record_device_runs(&runs, &report, 1, &note, opts.timeout, summary);
    let mut verdicts = verdicts.into_iter();
    for (step, _) in &self_tests {
        summary.check(
            format!("self-test: {}", step.label),
            verdicts.next().unwrap_or_else(|| Err(note.clone())),
        );
    }
    if gate_step.is_some() {
        summary.check(GATE_LABEL, gate_verdict.unwrap_or_else(|| Err(note.clone())));
    }
    summary.check("leak check: rdma resource show vs. baseline", leak_verdict(&report, leak_step, &note));
    match side_report {
        None => {}
        Some(Ok(report)) => {
            eprintln!("xtask: {SIDE_TAG}{} steps in a second VM", side_steps.len());
            report.explain(&side_steps);
            let note = vm_note(&report.end, &side_steps);
            record_device_runs(&side, &report, 1, &note, opts.timeout, summary);
            let leaks = leak_verdict(&report, side_steps.len() - 1, &note);
            summary.check("leak check of the second valgrind VM: rdma resource show vs. baseline", leaks);
        }
        Some(Err(why)) => {
            for run in &side {
                summary.counted(run.what.clone(), -1, None, format!("not run: the second VM: {why}"));
            }
        }
    }
    Ok(())
}

/// Runs `steps` in a VM of `backend` and, when `side_steps` is not empty, `side_steps` in a second
/// VM of the same backend that boots once the first has finished its step `start_after` (its
/// last plain run: the two VMs run side by side only under the sanitizers, never under a plain
/// run's timing), or at once for `None`. `on_result` sees the first VM's results; the second
/// prints a progress line, tagged [`SIDE_TAG`], for each of its steps in `side_progress`, and
/// keeps its console log with `console_suffix`. Returns both reports (`None` for no second VM).
#[allow(clippy::type_complexity)]
fn run_beside(
    (steps, backend, start_after): (&[Step], &Backend, Option<usize>),
    (side_steps, console_suffix, side_progress): (&[Step], &'static str, std::ops::Range<usize>),
    on_result: &mut dyn FnMut(usize, &StepResult),
) -> (Result<vm::Report, String>, Option<Result<vm::Report, String>>) {
    std::thread::scope(|scope| {
        // Dropping `go` lets the second VM start.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let side_job = (!side_steps.is_empty()).then(|| {
            scope.spawn(move || {
                let _ = wait.recv();
                let extras = vm::Extras { tag: Some(SIDE_TAG), console_suffix, ..Default::default() };
                vm::run_with(side_steps, backend, &extras, &mut |i, r| {
                    if side_progress.contains(&i) {
                        let status = run_status(r.code);
                        let took = r.elapsed.as_secs_f64();
                        eprintln!("xtask: {SIDE_TAG}{} ... {status} ({took:.1} s)", side_steps[i].label);
                    }
                })
            })
        });
        let mut go = Some(go).filter(|_| start_after.is_some());
        // Beside a second VM, whole lines only (an empty tag), so that the two never mix in a line.
        let extras = vm::Extras { tag: side_job.as_ref().map(|_| ""), ..Default::default() };
        let report = vm::run_with(steps, backend, &extras, &mut |i, r| {
            if Some(i) == start_after {
                go = None;
            }
            on_result(i, r);
        });
        drop(go);
        let side_report = side_job
            .map(|job| job.join().unwrap_or_else(|_| Err("the second VM's thread panicked".to_string())));
        (report, side_report)
    })
}

/// `ok`, or `FAILED (exit N)`, for a run's progress line.
fn run_status(code: i32) -> String {
    if code == 0 {
        "ok".to_string()
    } else {
        format!("FAILED (exit {code})")
    }
}

/// The prefix of the second valgrind VM's lines.
const SIDE_TAG: &str = "[valgrind VM 2] ";

/// Seconds each device test binary took under valgrind in the VM (CI-like run of 2026-12-07,
/// QEMU TCG on 2 cores), to split the valgrind runs between the two VMs ([`split_valgrind`]);
/// a binary not listed counts as [`VALGRIND_UNKNOWN_SECS`]. Only the balance depends on them.
const VALGRIND_SECS: [(&str, f64); 25] = [
    ("device_async", 151.0),
    ("device_core", 119.0),
    ("device_cm", 118.0),
    ("device_accounting", 117.0),
    ("device_soundness", 107.0),
    ("device_events", 94.0),
    ("device_scope", 69.0),
    ("device_ex", 68.0),
    ("device_multi_qp", 67.0),
    ("device_select", 66.0),
    ("device_parity", 62.0),
    ("device_soak", 61.0),
    ("device_threads", 59.0),
    ("device_alloc", 58.0),
    ("device_pool", 58.0),
    ("device_mw", 55.0),
    ("device_threads_srq", 53.0),
    ("device_caps", 52.0),
    ("device_dmabuf", 50.0),
    ("device_prepared", 48.0),
    ("device_window_drops", 40.0),
    ("device_srq", 40.0),
    ("device_threads_split", 39.0),
    ("device_mcast", 36.0),
    ("device_qp_attrs", 31.0),
];

/// The weight of a valgrind run of a binary [`VALGRIND_SECS`] does not list.
const VALGRIND_UNKNOWN_SECS: f64 = 60.0;

/// The main VM's work after the valgrind runs, in seconds (ThreadSanitizer runs, the gate,
/// self-tests): its head start in [`split_valgrind`]'s balance.
const MAIN_TAIL_SECS: f64 = 80.0;

/// Splits the device runs between the main VM and a second one: in the VM backend, the valgrind
/// runs are shared out longest first ([`VALGRIND_SECS`]), each to the VM with less work so far
/// (the main VM starting with its [`MAIN_TAIL_SECS`]), so that both end about together; each VM
/// keeps the runs in their order. Memcheck runs a program's threads one at a time, so a valgrind
/// run keeps one host core busy; two VMs use two (the valgrind pass was about half of a CI run).
/// Each VM still runs one binary at a time on its own device. Nothing is split on a host's own
/// device, whose tests must run one at a time, or for fewer than 2 valgrind runs.
fn split_valgrind(runs: Vec<DeviceRun>, backend: &Backend) -> (Vec<DeviceRun>, Vec<DeviceRun>) {
    let valgrind = runs.iter().filter(|r| r.kind == Kind::Valgrind).count();
    if !matches!(backend, Backend::Vm { .. }) || valgrind < 2 {
        return (runs, Vec::new());
    }
    // Each run's weight, looked up once (by the binary's name, the first word of its label).
    let weight: Vec<f64> = runs
        .iter()
        .map(|r| {
            let name = r.what.split_whitespace().next().unwrap_or_default();
            VALGRIND_SECS.iter().find(|(n, _)| *n == name).map_or(VALGRIND_UNKNOWN_SECS, |(_, s)| *s)
        })
        .collect();
    let mut order: Vec<usize> = (0..runs.len()).filter(|&i| runs[i].kind == Kind::Valgrind).collect();
    // Stable: equal weights keep the runs' order.
    order.sort_by(|&a, &b| weight[b].total_cmp(&weight[a]));
    let mut to_side = vec![false; runs.len()];
    let (mut main_load, mut side_load) = (MAIN_TAIL_SECS, 0.0);
    for i in order {
        if side_load < main_load {
            side_load += weight[i];
            to_side[i] = true;
        } else {
            main_load += weight[i];
        }
    }
    let (mut main, mut side) = (Vec::new(), Vec::new());
    for (run, side_run) in runs.into_iter().zip(to_side) {
        if side_run {
            side.push(run);
        } else {
            main.push(run);
        }
    }
    (main, side)
}

/// Adds the summary lines of `runs`, the steps `first..first + runs.len()` of `report` (`first`
/// is 1 after a baseline step, 0 without one).
fn record_device_runs(
    runs: &[DeviceRun],
    report: &vm::Report,
    first: usize,
    vm_note: &str,
    timeout: Duration,
    summary: &mut Summary,
) {
    for (i, run) in runs.iter().enumerate() {
        match report.results.get(first + i) {
            Some(r) => {
                let (code, note) = device_verdict(run, r, timeout);
                let stdout = String::from_utf8_lossy(&r.stdout);
                summary.unsupported_from(&stdout);
                let tally = parse_libtest(&stdout);
                summary.counted(run.what.clone(), code, tally, note);
                summary.took(r.elapsed);
            }
            None => summary.counted(run.what.clone(), -1, None, vm_note.to_string()),
        }
    }
}

/// The leak check of a VM's job: `rdma resource show` at step `leak_step` against the baseline
/// at step 0 (a failed baseline fails the check with its error).
fn leak_verdict(report: &vm::Report, leak_step: usize, vm_note: &str) -> Result<(), String> {
    let results = &report.results;
    if let Some(r) = results.first().filter(|r| r.code != 0) {
        return Err(format!("rdma resource baseline: {}", String::from_utf8_lossy(&r.stderr).trim()));
    }
    match (results.first(), results.get(leak_step)) {
        (Some(before), Some(after)) => {
            let part = |r: &StepResult| {
                let text = String::from_utf8_lossy(&r.stdout).into_owned();
                let (counts, details) = text.split_once("---\n").unwrap_or((&text, ""));
                (parse_resources(counts), details.to_string())
            };
            let ((base, _), (now, details)) = (part(before), part(after));
            let diff = leaked(&base, &now);
            eprintln!("xtask: rdma resources before the tests: {}", describe(&base));
            eprintln!("xtask: rdma resources after the tests:  {}", describe(&now));
            if diff.is_empty() {
                Ok(())
            } else {
                eprintln!("xtask: objects left over:\n{details}");
                Err(format!("left over: {}", diff.join(", ")))
            }
        }
        _ => Err(vm_note.to_string()),
    }
}

/// `rxe0: pd 0 cq 0 ...` for a log line.
fn describe(counts: &Resources) -> String {
    if counts.is_empty() {
        return "(none listed)".into();
    }
    let mut by_device: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for ((device, kind), n) in counts {
        by_device.entry(device).or_default().push(format!("{kind} {n}"));
    }
    by_device.iter().map(|(d, items)| format!("{d}: {}", items.join(" "))).collect::<Vec<_>>().join("; ")
}

/// What a run of `cargo xtask` as a child gave.
#[derive(Debug)]
struct SubRun {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
    /// Entries left in its `$TMPDIR`, processes whose command line mentions it.
    leftovers: Vec<String>,
}

/// Runs this program with `args`, its `$TMPDIR` a fresh folder (so we can see what it leaves behind),
/// `env` added, killed after `limit`. `on_started` is called once a process mentions that folder
/// (QEMU or the local runner has started).
fn sub_xtask(
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
    on_started: Option<&dyn Fn(u32)>,
) -> Result<SubRun, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding our own executable: {e}"))?;
    let tmp = std::env::temp_dir().join(format!("ibverbs-xtask-selftest.{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
    let start = Instant::now();
    let mut child = Command::new(exe)
        .args(args)
        .envs(env.iter().copied())
        .env("TMPDIR", &tmp)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running xtask: {e}"))?;
    let pipes = process::Pipes::start(&mut child, false);
    let mut started = on_started.is_none();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(status);
        }
        if signals::received().is_some() || start.elapsed() > limit {
            signals::send(child.id(), libc::SIGTERM);
            std::thread::sleep(Duration::from_secs(2));
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        if !started && !vm::processes_mentioning(&tmp).is_empty() {
            started = true;
            if let Some(f) = on_started {
                f(child.id());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let elapsed = start.elapsed();
    eprintln!(
        "xtask:   exit status {:?} after {:.1} s",
        status.and_then(|s| s.code()),
        elapsed.as_secs_f64()
    );
    // A QEMU or runner it left behind may hold the pipes: bounded, and listed below.
    let (stdout, stderr) = pipes.finish(process::PIPE_GRACE, "xtask");
    let mut leftovers: Vec<String> = fs::read_dir(&tmp)
        .map(|d| d.flatten().map(|e| format!("file {}", e.path().display())).collect())
        .unwrap_or_default();
    leftovers.extend(vm::processes_mentioning(&tmp).iter().map(|pid| format!("process {pid}")));
    let _ = fs::remove_dir_all(&tmp);
    interrupted()?;
    Ok(SubRun { code: status.and_then(|s| s.code()), stdout, stderr, elapsed, leftovers })
}

/// Checks a [`SubRun`]: its exit status, that nothing was left behind, and `extra`.
fn check_sub(
    run: Result<SubRun, String>,
    code: i32,
    extra: impl Fn(&SubRun) -> Result<(), String>,
) -> Result<(), String> {
    let run = run?;
    let tail = || vm::last_lines(&run.stderr, 15);
    if run.code != Some(code) {
        return Err(format!(
            "exit status {:?} instead of {code} after {:.1} s; stderr:\n{}",
            run.code,
            run.elapsed.as_secs_f64(),
            tail()
        ));
    }
    if !run.leftovers.is_empty() {
        return Err(format!("left behind: {}", run.leftovers.join(", ")));
    }
    extra(&run).map_err(|e| format!("{e}; stderr:\n{}", tail()))
}

/// Self-tests of `cargo xtask rxe` as a program: each is a run of its own.
fn run_program_self_tests(backend: &Backend, summary: &mut Summary) {
    let is_vm = matches!(backend, Backend::Vm { .. });
    let vm_flag: &[&str] = if is_vm { &["--vm"] } else { &[] };
    let args = |rest: &[&'static str]| -> Vec<&'static str> { [&["rxe"], vm_flag, rest].concat() };

    eprintln!("xtask: self-test: `cargo xtask rxe --timeout 3 -- sh -c 'echo started; sleep 1000'` ...");
    let run = sub_xtask(
        &args(&["--timeout", "3", "--", "sh", "-c", "echo started; exec sleep 1000"]),
        &[],
        vm::BOOT_TIMEOUT + Duration::from_secs(60),
        None,
    );
    summary.check(
        "self-test: rxe --timeout exits 124, cleans up",
        check_sub(run, i32::from(vm::EXIT_TIMEOUT), |r| {
            if r.stdout != "started\n" {
                return Err(format!("stdout {:?} instead of \"started\\n\"", r.stdout));
            }
            if !r.stderr.contains("timed out") {
                return Err("no `timed out` message".into());
            }
            Ok(())
        }),
    );

    eprintln!("xtask: self-test: SIGTERM to `cargo xtask rxe -- sleep 1000` once it started ...");
    let term = |pid: u32| {
        std::thread::sleep(Duration::from_millis(500));
        signals::send(pid, libc::SIGTERM);
    };
    let run = sub_xtask(&args(&["--", "sleep", "1000"]), &[], Duration::from_secs(60), Some(&term));
    summary.check(
        "self-test: rxe on SIGTERM exits 143, cleans up",
        check_sub(run, signals::exit_status(libc::SIGTERM).into(), |r| {
            if r.elapsed > Duration::from_secs(30) {
                return Err(format!("took {:.1} s", r.elapsed.as_secs_f64()));
            }
            Ok(())
        }),
    );

    if is_vm {
        eprintln!("xtask: self-test: a kernel panic at boot (rdinit=/nonexistent) ...");
        let run = sub_xtask(
            &args(&["--", "true"]),
            &[("IBVERBS_XTASK_APPEND", "rdinit=/nonexistent")],
            vm::BOOT_TIMEOUT + Duration::from_secs(60),
            None,
        );
        summary.check(
            "self-test: rxe on a failed boot exits 125, shows the console",
            check_sub(run, i32::from(vm::EXIT_VM_FAILURE), |r| {
                if !r.stderr.contains("did not boot") || !r.stderr.contains("Kernel panic") {
                    return Err("no boot failure message with the console's kernel panic".into());
                }
                Ok(())
            }),
        );
        // A step that crashes the guest's kernel (as a kernel bug reached from a test would): a
        // failure naming the crash, not a hang.
        eprintln!("xtask: self-test: a kernel crash under a step (sysrq c) ...");
        let crash = "echo 1 > /proc/sys/kernel/sysrq && echo c > /proc/sysrq-trigger; sleep 600";
        let run = sub_xtask(
            &args(&["--", "sh", "-c", crash]),
            &[],
            vm::BOOT_TIMEOUT + Duration::from_secs(60),
            None,
        );
        summary.check(
            "self-test: rxe whose kernel crashes under a step exits 125 and names the crash",
            check_sub(run, i32::from(vm::EXIT_VM_FAILURE), |r| {
                if !r
                    .stderr
                    .contains("the guest kernel crashed (Kernel panic - not syncing: sysrq triggered crash)")
                {
                    return Err("no message naming the guest's kernel crash".into());
                }
                if r.elapsed > vm::BOOT_TIMEOUT + Duration::from_secs(30) {
                    return Err(format!("took {:.1} s", r.elapsed.as_secs_f64()));
                }
                Ok(())
            }),
        );
    }
}

/// Why the steps a VM did not finish were not run ("" when it completed them all).
fn vm_note(end: &End, steps: &[Step]) -> String {
    match end {
        End::Completed => String::new(),
        End::BootFailed(why) => format!("not run: the VM did not boot: {why}"),
        End::Died(why) => format!("not run: {why}"),
        End::Stuck(i) => format!("not run: `{}` hung the VM", steps[*i].label),
        End::Interrupted(signal) => format!("not run: interrupted by signal {signal}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_stages_fail_unrun_past_the_run_budget() {
        let mut s = Summary::default();
        assert!(within_budget(RUN_BUDGET, "siw stage", &mut s));
        assert!(s.lines.is_empty());
        assert!(!within_budget(RUN_BUDGET + Duration::from_secs(1), "siw stage", &mut s));
        assert_eq!(s.lines.len(), 1);
        let line = &s.lines[0];
        assert!(!line.ok && line.what == "siw stage" && line.note.contains("not run"), "{line:?}");
        assert_eq!(s.total().failed, 1);
    }

    #[test]
    fn siw_valgrind_runs_are_siw_binaries_that_call_verbs() {
        for name in SIW_VALGRIND {
            assert!(SIW_BINARIES.contains(&name), "{name} is not in the siw stage");
            assert!(!CHILD_ONLY.contains(&name), "{name} runs its verbs in child processes");
        }
    }

    #[test]
    fn siw_tsan_runs_are_the_tsan_builds_siw_binaries_with_the_tsan_prelude() {
        let root = Path::new("/w");
        let step = |label: String, script: Vec<u8>| Step {
            label,
            script,
            timeout: Duration::from_secs(1),
            output: Output::Live,
        };
        assert!(siw_tsan_runs(root, None, &[], &step).is_empty());
        let build = TsanBuild {
            tests: vec![
                artifact("/w/Cargo.toml", "test", "device_threads"),
                artifact("/w/Cargo.toml", "test", "device_threads_rxe_only"),
                artifact("/w/Cargo.toml", "test", "device_threads_srq"),
                artifact("/w/Cargo.toml", "test", "device_async"),
            ],
            probe: "/t/probe".into(),
            elapsed: Duration::ZERO,
        };
        let runs = siw_tsan_runs(root, Some(&build), &["filter".into()], &step);
        let whats: Vec<&str> = runs.iter().map(|r| r.what.as_str()).collect();
        assert_eq!(
            whats,
            [
                "device_threads (siw0, ThreadSanitizer, in the VM)",
                "device_threads_srq (siw0, ThreadSanitizer, in the VM)",
                "device_async (siw0, ThreadSanitizer, in the VM)"
            ]
        );
        for run in &runs {
            assert!(run.kind == Kind::Tsan);
            let script = String::from_utf8_lossy(&run.step.script);
            assert!(script.contains("TSAN_OPTIONS="), "{script}");
            assert!(script.contains("\nexport RUST_BACKTRACE=0\n"), "{script}");
            if run.what.starts_with("device_async") {
                assert!(script.contains("/t/device_async"), "{script}");
                assert!(script.ends_with(" --test-threads=1 filter --skip no_busy_polling"), "{script}");
            } else {
                assert!(script.contains("/t/device_threads"), "{script}");
                assert!(script.ends_with(" --test-threads=1 filter"), "{script}");
            }
        }
    }

    #[test]
    fn parses_libtest_summaries() {
        let out = "running 3 tests\ntest a ... ok\n\
                   test result: ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s\n\n\
                   test result: FAILED. 5 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s\n";
        assert_eq!(parse_libtest(out), Some(Tally { passed: 7, failed: 2, ignored: 1 }));
        assert_eq!(parse_libtest("no summary here\n"), None);
        assert_eq!(
            parse_libtest("test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s"),
            Some(Tally::default())
        );
    }

    #[test]
    fn collects_unsupported_lines_once() {
        // The line may follow libtest's `test x ... ` on the same line (written past its capture).
        let out = "running 2 tests\ntest odp ... IBVERBS-UNSUPPORTED: rxe0 on-demand paging (odp): no IBV_ODP_SUPPORT\nok\n\
                   IBVERBS-UNSUPPORTED: rxe0 device memory (dm): max_dm_size 0\nIBVERBS-UNSUPPORTED: \n";
        let lines = unsupported_lines(out);
        assert_eq!(
            lines,
            vec!["rxe0 on-demand paging (odp): no IBV_ODP_SUPPORT", "rxe0 device memory (dm): max_dm_size 0"]
        );
        let mut s = Summary::default();
        s.unsupported_from(out);
        s.unsupported_from(out);
        assert_eq!(s.unsupported.len(), 2, "the valgrind pass repeats them");
    }

    #[test]
    fn groups_unsupported_lines_by_device_and_names_their_tests() {
        let lines: Vec<String> = [
            "rxe0 on-demand paging (odp): no IBV_ODP_SUPPORT",
            "siw0 atomics (atomics_compare_swap_and_fetch_add): atomic_cap is IBV_ATOMIC_NONE",
            "siw0 UD (ud_send): iWARP: RC only (see (notes))",
        ]
        .map(String::from)
        .to_vec();
        let groups = unsupported_by_device(&lines);
        assert_eq!(groups.len(), 2);
        assert_eq!((groups[0].0.as_str(), groups[0].1.len()), ("rxe0", 1));
        assert_eq!((groups[1].0.as_str(), groups[1].1.len()), ("siw0", 2));
        assert_eq!(test_of_unsupported(&lines[1]), Some("atomics_compare_swap_and_fetch_add"));
        assert_eq!(test_of_unsupported(&lines[2]), Some("ud_send"));
        assert_eq!(test_of_unsupported("no test here"), None);
    }

    #[test]
    fn summary_counts_crashes_as_failures() {
        let mut s = Summary::default();
        s.counted("a", 0, Some(Tally { passed: 3, failed: 0, ignored: 1 }), "");
        s.counted("crashed", 139, None, "");
        s.counted("failed", 101, Some(Tally { passed: 1, failed: 2, ignored: 0 }), "");
        s.check("mine", Ok(()));
        s.check("mine too", Err("no".into()));
        assert_eq!(s.total(), Tally { passed: 5, failed: 4, ignored: 1 });
        assert_eq!(s.lines.iter().map(|l| l.ok).collect::<Vec<_>>(), [true, false, false, true, false]);
    }

    fn artifact(manifest: &str, kind: &str, name: &str) -> Artifact {
        Artifact {
            manifest_path: manifest.into(),
            kind: vec![kind.into()],
            name: name.into(),
            executable: format!("/t/{name}").into(),
        }
    }

    #[test]
    fn classifies_device_tests() {
        let arts = [
            artifact("/w/Cargo.toml", "lib", "ibverbs"),
            artifact("/w/Cargo.toml", "test", "device_qp"),
            artifact("/w/Cargo.toml", "test", "api"),
            artifact("/w/Cargo.toml", "test", "device_cq"),
            artifact("/w/sys/Cargo.toml", "test", "device_sys"),
            artifact("/w/xtask/Cargo.toml", "bin", "xtask"),
        ];
        let (device, host) = classify(&arts, Path::new("/w/Cargo.toml"));
        assert_eq!(device.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["device_cq", "device_qp"]);
        assert_eq!(host, ["api", "device_sys"]);
    }

    #[test]
    fn child_only_binaries_call_no_verb() {
        child_only_check(&crate::workspace_root()).unwrap();
        let dir = std::env::temp_dir().join(format!("xtask-child-only-{}", std::process::id()));
        fs::create_dir_all(dir.join("tests")).unwrap();
        for name in CHILD_ONLY {
            fs::write(dir.join("tests").join(format!("{name}.rs")), "fn main() {}\n").unwrap();
        }
        assert!(child_only_check(&dir).is_ok());
        fs::write(dir.join("tests/device_perf.rs"), "// The client on ibv_create_cq_ex: no call.\n").unwrap();
        assert!(child_only_check(&dir).is_ok(), "a comment naming a verb is no call");
        fs::write(dir.join("tests/device_perf.rs"), "let ctx = common::context();\n").unwrap();
        let err = child_only_check(&dir).unwrap_err();
        assert!(err.contains("device_perf.rs calls `context()`"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    // A renamed test would no longer be left out of the TSan runs (and would cost minutes
    // there): every filter names a test of its binary.
    #[test]
    fn tsan_skip_filters_name_tests() {
        let root = crate::workspace_root();
        for (name, filter) in TSAN_SKIP_TESTS {
            let src = fs::read_to_string(root.join("tests").join(format!("{name}.rs"))).unwrap();
            let named = test_fns(&src).any(|(fn_name, _)| fn_name.contains(filter));
            assert!(named, "tests/{name}.rs: no test name contains `{filter}` (TSAN_SKIP_TESTS)");
        }
    }

    #[test]
    fn child_only_tests_are_named_and_start_examples() {
        child_only_tests_check(&crate::workspace_root()).unwrap();
        let dir = std::env::temp_dir().join(format!("xtask-child-only-tests-{}", std::process::id()));
        fs::create_dir_all(dir.join("tests")).unwrap();
        let write = |src: &str| fs::write(dir.join("tests/device_select.rs"), src).unwrap();
        write("#[test]\nfn devinfo_lists() {\n    tool(\"devinfo\");\n}\n#[test]\nfn doctor_x() {\n    tool(\"doctor\");\n}\n");
        assert!(child_only_tests_check(&dir).is_ok());
        write("#[test]\nfn devinfo_lists() {\n    tool(\"devinfo\");\n}\n#[test]\nfn doctor_x() {\n    context();\n}\n#[test]\nfn other() {\n    tool(\"y\");\n}\n");
        let err = child_only_tests_check(&dir).unwrap_err();
        assert!(err.contains("doctor_x starts no example"), "{err}");
        write("#[test]\nfn devinfo_lists() {\n    tool(\"devinfo\");\n}\n");
        let err = child_only_tests_check(&dir).unwrap_err();
        assert!(err.contains("no test name contains `doctor_`"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn passes_asked_for() {
        assert_eq!(Passes::only(false, false, false, false, false, false), Passes::ALL);
        let t = Passes::only(false, false, false, true, false, false);
        assert!(t.twohost && !t.plain && !t.publish);
        let v = Passes::only(true, false, false, false, false, false);
        assert!(v.valgrind && !v.plain && !v.tsan && !v.miri && !v.nightly_doc && !v.publish && !v.twohost);
        assert!(!v.need_nightly());
        let m = Passes::only(false, false, true, false, false, false);
        assert!(m.need_nightly() && !m.plain && !m.valgrind && !m.tsan);
        assert!(Passes::only(false, true, false, false, false, false).need_nightly());
        let p = Passes::only(false, false, false, false, true, false);
        let g = Passes::only(false, false, false, false, false, true);
        assert!(g.gate && !g.plain && !g.valgrind && !g.siw && !g.need_nightly());
        assert!(p.publish && !p.plain && !p.valgrind && !p.tsan && !p.twohost && !p.need_nightly());
    }

    #[test]
    fn device_scripts_run_the_binary_under_its_wrapper() {
        let root = Path::new("/w s");
        let args = [OsString::from("name filter")];
        let plain = device_script(root, b"", &[], Path::new("/t/device_x-1"), &args);
        assert_eq!(
            String::from_utf8(plain).unwrap(),
            "export CARGO_MANIFEST_DIR='/w s'\nexec /t/device_x-1 --test-threads=1 'name filter'"
        );
        let prelude = sanitizer_prelude(root, Kind::Valgrind);
        let script = device_script(root, &prelude, &valgrind_argv(root), Path::new("/t/d"), &[]);
        let script = String::from_utf8(script).unwrap();
        assert!(script.contains("IBVERBS_TEST_TIME_SCALE=\"${IBVERBS_TEST_TIME_SCALE:-20}\""), "{script}");
        assert!(script.contains("\nexport RUST_BACKTRACE=0\n"), "{script}");
        assert!(
            script.contains("exec valgrind --tool=memcheck ") && script.contains("--error-exitcode=99 "),
            "{script}"
        );
        assert!(
            script.contains("'--suppressions=/w s/xtask/valgrind.supp' /t/d --test-threads=1"),
            "{script}"
        );
        let tsan = String::from_utf8(sanitizer_prelude(Path::new("/w"), Kind::Tsan)).unwrap();
        assert!(tsan.contains("TSAN_OPTIONS='halt_on_error=1 exitcode=66 second_deadlock_stack=1 allocator_may_return_null=1 suppressions=/w/xtask/tsan.supp'\"${TSAN_OPTIONS:+ $TSAN_OPTIONS}\""), "{tsan}");
        assert!(tsan.contains(":-10}"), "{tsan}");
    }

    #[test]
    fn reads_sanitizer_verdicts() {
        let clean = "==1== HEAP SUMMARY:\n==1==    definitely lost: 0 bytes in 0 blocks\n\
                     ==1== ERROR SUMMARY: 0 errors from 0 contexts (suppressed: 0 from 0)\n";
        assert_eq!(
            valgrind_verdict(clean),
            Some((0, "valgrind: 0 errors, definitely lost: 0 bytes in 0 blocks".to_string()))
        );
        let bad =
            "==7==    definitely lost: 64 bytes in 1 blocks\n==7== ERROR SUMMARY: 2 errors from 2 contexts\n";
        assert_eq!(valgrind_verdict(bad).map(|v| v.0), Some(2));
        assert_eq!(valgrind_verdict("test result: ok. 1 passed;"), None);
        let race = "==================\nWARNING: ThreadSanitizer: data race (pid=1)\n";
        assert_eq!(tsan_reports(race), 1);
        assert_eq!(tsan_reports("test result: ok"), 0);
    }

    #[test]
    fn parses_rdma_resources_and_finds_leaks() {
        let before = parse_resources("0: rxe0: pd 1 cq 1 qp 1 cm_id 0 mr 0 ctx 0 srq 0\n");
        let after = parse_resources(
            "0: rxe0: pd 2 cq 1 qp 3 cm_id 0 mr 0 ctx 1 srq 0\nlink rxe0/1 lqpn 1 type GSI\n",
        );
        assert_eq!(before.get(&("rxe0".into(), "qp".into())), Some(&1));
        assert_eq!(leaked(&before, &after), ["rxe0 ctx +1", "rxe0 pd +1", "rxe0 qp +2"]);
        assert!(leaked(&after, &before).is_empty());
        assert!(parse_resources("").is_empty());
        assert_eq!(describe(&before), "rxe0: cm_id 0 cq 1 ctx 0 mr 0 pd 1 qp 1 srq 0");
    }

    #[test]
    fn valgrind_runs_are_balanced_over_a_second_vm_only_in_the_vm() {
        let run = |name: &str, kind| DeviceRun {
            what: name.into(),
            kind,
            step: Step {
                label: name.into(),
                script: Vec::new(),
                timeout: Duration::from_secs(1),
                output: Output::Live,
            },
        };
        let runs = || {
            vec![
                run("a", Kind::Plain),
                run("b", Kind::Plain),
                run("a vg", Kind::Valgrind),
                run("b vg", Kind::Valgrind),
                run("c vg", Kind::Valgrind),
                run("t", Kind::Tsan),
            ]
        };
        let names = |v: &[DeviceRun]| v.iter().map(|r| r.what.clone()).collect::<Vec<_>>();
        let vm = Backend::Vm { mtu: 1500, device: vm::VmDevice::Rxe };
        // Unlisted binaries weigh the same: the second VM takes runs until it has more work
        // than the main VM's tail.
        let (main, side) = split_valgrind(runs(), &vm);
        assert_eq!(names(&main), ["a", "b", "c vg", "t"]);
        assert_eq!(names(&side), ["a vg", "b vg"]);
        // Longest first, each to the VM with less work: async (151) to the second VM, core (119)
        // to the main one (80 + 119), cm (118) to the second (151 < 199), accounting to the main.
        let heavy = ["device_accounting", "device_async", "device_cm", "device_core"]
            .map(|n| run(&format!("{n} (valgrind)"), Kind::Valgrind))
            .into_iter()
            .collect();
        let (main, side) = split_valgrind(heavy, &vm);
        assert_eq!(names(&main), ["device_accounting (valgrind)", "device_core (valgrind)"]);
        assert_eq!(names(&side), ["device_async (valgrind)", "device_cm (valgrind)"]);
        let host =
            Backend::Local(crate::prereq::HostDevice { name: "x0".into(), gid_index: None, ipv4: None });
        let (main, side) = split_valgrind(runs(), &host);
        assert_eq!((main.len(), side.len()), (6, 0), "a host's own device runs one binary at a time");
        let one = vec![run("a", Kind::Plain), run("a vg", Kind::Valgrind)];
        assert!(split_valgrind(one, &vm).1.is_empty());
    }
}
