//! The passes of `cargo xtask test` that need a nightly toolchain: Miri over the library's unit tests,
//! the doc tests under nightly rustdoc (the only rustdoc that checks the error codes of
//! `compile_fail,E....` doc tests) with a self-test of that mechanism, and the ThreadSanitizer build of
//! the threaded device tests with a racy probe program.
//!
//! The toolchain is `nightly` (or `IBVERBS_XTASK_NIGHTLY`) with the components `miri` and `rust-src`,
//! run through rustup. When it or a component is missing, it is installed with rustup (bounded in
//! time); when that fails, the passes fail with a message that says so — they are never skipped.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::cargo::{self, Artifact};
use crate::process::{self, Finished};

/// The toolchain used when `IBVERBS_XTASK_NIGHTLY` is not set.
pub const DEFAULT_TOOLCHAIN: &str = "nightly";
/// The components the passes need.
pub const COMPONENTS: &[&str] = &["miri", "rust-src"];
/// The target the ThreadSanitizer build is for (`-Zbuild-std` needs an explicit one).
pub const TSAN_TARGET: &str = "x86_64-unknown-linux-gnu";
/// The exit status of a ThreadSanitizer-instrumented program after a report (TSan's default).
pub const TSAN_EXIT: i32 = 66;

/// How long installing the toolchain, building or running one pass may take.
const RUSTUP_LIMIT: Duration = Duration::from_secs(900);
const PASS_LIMIT: Duration = Duration::from_secs(1800);

/// The nightly toolchain's name.
pub fn toolchain() -> String {
    std::env::var("IBVERBS_XTASK_NIGHTLY").ok().filter(|t| !t.is_empty()).unwrap_or(DEFAULT_TOOLCHAIN.into())
}

/// `rustup ARGS` within `limit`, output shown.
fn rustup(args: &[&str], limit: Duration, show: bool) -> Result<Finished, String> {
    let mut cmd = Command::new("rustup");
    cmd.args(args).env_remove("RUSTUP_TOOLCHAIN").env_remove("RUST_BACKTRACE");
    process::run(&mut cmd, limit, show)
}

/// Makes sure the nightly toolchain and [`COMPONENTS`] are installed, installing what is missing with
/// rustup. Returns the toolchain's name, or why the nightly passes cannot run.
pub fn ensure() -> Result<String, String> {
    let toolchain = toolchain();
    let cannot = |why: String| {
        format!(
            "the nightly passes need the toolchain `{toolchain}` with {}: {why}",
            COMPONENTS.join(" and ")
        )
    };
    rustup(&["--version"], Duration::from_secs(60), false)
        .ok()
        .filter(Finished::success)
        .ok_or_else(|| cannot("rustup was not found (install Rust with rustup: https://rustup.rs)".into()))?;
    let listed = rustup(
        &["component", "list", "--installed", "--toolchain", &toolchain],
        Duration::from_secs(60),
        false,
    )?;
    let attempt = if !listed.success() {
        eprintln!(
            "xtask: installing the Rust toolchain `{toolchain}` with {} (rustup) ...",
            COMPONENTS.join(", ")
        );
        let components = COMPONENTS.join(",");
        // --allow-downgrade: a nightly whose Miri is broken is skipped for the newest one that has it.
        let args = [
            "toolchain",
            "install",
            &toolchain,
            "--profile",
            "minimal",
            "--allow-downgrade",
            "--component",
            &components,
        ];
        Some(rustup(&args, RUSTUP_LIMIT, true)?)
    } else {
        let installed: Vec<&str> = listed.stdout.lines().map(str::trim).collect();
        let missing: Vec<&str> =
            COMPONENTS.iter().copied().filter(|c| !installed.iter().any(|i| is_component(i, c))).collect();
        if missing.is_empty() {
            None
        } else {
            eprintln!(
                "xtask: adding {} to the Rust toolchain `{toolchain}` (rustup) ...",
                missing.join(", ")
            );
            let mut args = vec!["component", "add", "--toolchain", &toolchain];
            args.extend(missing);
            Some(rustup(&args, RUSTUP_LIMIT, true)?)
        }
    };
    if let Some(r) = attempt {
        if !r.success() {
            return Err(cannot(format!(
                "rustup could not install it ({}): {}\nInstall it yourself: rustup toolchain install {toolchain} \
                 --component {}",
                r.describe(),
                r.stderr
                    .lines()
                    .find(|l| l.starts_with("error:"))
                    .map_or_else(|| crate::vm::last_lines(r.stderr.trim(), 3), str::to_string)
                    .trim(),
                COMPONENTS.join(",")
            )));
        }
    }
    // The proof: Miri answers.
    let miri = nightly_cargo(&toolchain, Path::new("."), &["miri", "--version"]).output();
    match miri {
        Ok(out) if out.status.success() => Ok(toolchain),
        Ok(out) => Err(cannot(format!(
            "`cargo miri --version` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
        Err(e) => Err(cannot(format!("running rustup: {e}"))),
    }
}

/// Whether `listed` (a line of `rustup component list --installed`) is `component`: `rust-src`, or
/// `miri-x86_64-unknown-linux-gnu` (the name, a dash, a target triple).
pub fn is_component(listed: &str, component: &str) -> bool {
    listed
        .strip_prefix(component)
        .is_some_and(|rest| rest.is_empty() || (rest.starts_with('-') && rest.matches('-').count() >= 3))
}

/// `rustup run TOOLCHAIN cargo ARGS` in `dir`, without the variables that would pick another
/// toolchain or change the flags of an instrumented build.
pub fn nightly_cargo(toolchain: &str, dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", toolchain, "cargo"]).args(args).current_dir(dir);
    for var in ["RUSTUP_TOOLCHAIN", "CARGO", "RUSTC", "RUSTDOC", "RUSTC_WRAPPER", "CARGO_ENCODED_RUSTFLAGS"] {
        cmd.env_remove(var);
    }
    cmd
}

/// The outcome of a pass that libtest counts.
#[derive(Debug)]
pub struct PassResult {
    /// cargo's exit status (-1 if it was killed).
    pub code: i32,
    /// Its stdout (libtest's report).
    pub stdout: String,
    /// What to add to the summary line.
    pub note: String,
    /// How long it took.
    pub elapsed: Duration,
}

impl PassResult {
    fn from(r: &Finished, note: String) -> Self {
        let note = if r.timed_out { format!("{} (time limit)", r.describe()) } else { note };
        PassResult { code: r.code.unwrap_or(-1), stdout: r.stdout.clone(), note, elapsed: r.elapsed }
    }
}

/// `cargo +nightly miri test -p rdma-verbs --lib`: the library's unit tests under Miri. It runs
/// beside other passes, so its output is not shown as it comes: it is returned with the result
/// (its stderr, then its stdout), for the caller to show when it is done.
pub fn miri(toolchain: &str, root: &Path) -> Result<(PassResult, String), String> {
    let r = process::run(
        &mut nightly_cargo(toolchain, root, &["miri", "test", "-p", "rdma-verbs", "--lib"]),
        PASS_LIMIT,
        false,
    )?;
    let note = miri_abort(&r.stdout, &r.stderr).unwrap_or_default();
    let output = format!("{}{}", r.stderr, r.stdout);
    Ok((PassResult::from(&r, note), output))
}

/// When Miri stopped a whole test binary (an unsupported operation such as an FFI call aborts it, not
/// just the test): which test (the last `test NAME ...` line of libtest's stdout without a verdict)
/// and why (Miri's first `error:` line on stderr).
pub fn miri_abort(stdout: &str, stderr: &str) -> Option<String> {
    let line = stdout.lines().rev().find(|l| l.starts_with("test "))?;
    let name = line.strip_prefix("test ")?.trim_end().strip_suffix("...")?.trim_end();
    let why = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("error: "))
        .find(|w| !w.starts_with("aborting") && !w.starts_with("test failed"))
        .unwrap_or("see the log");
    let mut note = format!("Miri aborted the run in `{name}`: {why}");
    if why.contains("foreign function") {
        note.push_str(" — mark unit tests that call C #[cfg_attr(miri, ignore)]");
    }
    Some(note)
}

/// `cargo +nightly test --doc -p rdma-verbs` (its own target folder): the doc tests with nightly rustdoc,
/// which checks the error codes of `compile_fail,E....` doc tests.
pub fn doc_tests(toolchain: &str, root: &Path, target_dir: &Path) -> Result<PassResult, String> {
    eprintln!("xtask: ==== doc tests with nightly rustdoc: cargo +{toolchain} test --doc -p rdma-verbs");
    let dir = target_dir.join("nightly");
    let dir = dir.to_string_lossy();
    let mut cmd =
        nightly_cargo(toolchain, root, &["test", "--doc", "-p", "rdma-verbs", "--target-dir", &dir]);
    let r = process::run(&mut cmd, PASS_LIMIT, true)?;
    Ok(PassResult::from(&r, String::new()))
}

/// The throw-away crate of [`check_error_codes`]: the same code, which fails with E0308, under a wrong
/// and a right expected code.
const CODES_CRATE_LIB: &str = r#"//! Self-test of rustdoc's checking of `compile_fail` error codes (generated by cargo xtask).

/// ```compile_fail,E0599
/// let x: u32 = "not a number";
/// ```
pub fn wrong_code() {}

/// ```compile_fail,E0308
/// let x: u32 = "not a number";
/// ```
pub fn right_code() {}
"#;

/// The verdict of rustdoc on the doc test of `function` in libtest's output: `Some(true)` for ok.
pub fn doc_test_verdict(output: &str, function: &str) -> Option<bool> {
    let prefix = format!(" - {function} (line ");
    let line = output.lines().find(|l| l.starts_with("test ") && l.contains(&prefix))?;
    if line.ends_with(" ... ok") {
        Some(true)
    } else if line.ends_with(" ... FAILED") {
        Some(false)
    } else {
        None
    }
}

/// A folder removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Proves that the nightly doc-test pass checks error codes: in a throw-away crate, a
/// `compile_fail,E0599` doc test of code that fails with E0308 must FAIL under nightly rustdoc, and
/// the same with `E0308` must pass. Returns what stable rustdoc made of the wrong code, for the record.
pub fn check_error_codes(toolchain: &str, stable_root: &Path) -> Result<String, String> {
    let dir =
        TempDir(std::env::temp_dir().join(format!("ibverbs-xtask-rustdoc-codes.{}", std::process::id())));
    let _ = fs::remove_dir_all(&dir.0);
    let io = |e: std::io::Error| format!("writing the self-test crate in {}: {e}", dir.0.display());
    fs::create_dir_all(dir.0.join("src")).map_err(io)?;
    fs::write(
        dir.0.join("Cargo.toml"),
        "[package]\nname = \"xtask-rustdoc-codes\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n[workspace]\n",
    )
    .map_err(io)?;
    fs::write(dir.0.join("src/lib.rs"), CODES_CRATE_LIB).map_err(io)?;
    let limit = Duration::from_secs(300);
    let r = process::run(&mut nightly_cargo(toolchain, &dir.0, &["test", "--doc"]), limit, false)?;
    let out = format!("{}{}", r.stdout, r.stderr);
    let verdicts = (doc_test_verdict(&out, "wrong_code"), doc_test_verdict(&out, "right_code"));
    if verdicts != (Some(false), Some(true)) || r.success() {
        return Err(format!(
            "nightly rustdoc did not tell the wrong error code from the right one (wrong code passed: {:?}, \
             right code passed: {:?}, {}):\n{}",
            verdicts.0,
            verdicts.1,
            r.describe(),
            crate::vm::last_lines(&out, 20)
        ));
    }
    if !out.contains("Some expected error codes were not found: [\"E0599\"]") {
        return Err(format!("nightly rustdoc failed the wrong code, but not for its code:\n{out}"));
    }
    // For the record: stable rustdoc accepts the wrong code (why this pass exists).
    let mut stable = cargo::command(stable_root, &["test", "--doc"]);
    stable.current_dir(&dir.0);
    let s = process::run(&mut stable, limit, false)?;
    let stable_wrong = doc_test_verdict(&format!("{}{}", s.stdout, s.stderr), "wrong_code");
    Ok(match stable_wrong {
        Some(true) => "stable rustdoc passed the wrong code: it does not check codes".into(),
        Some(false) => "stable rustdoc also failed the wrong code".into(),
        None => format!("stable rustdoc: no verdict ({})", s.describe()),
    })
}

/// What the ThreadSanitizer build produced.
#[derive(Debug)]
pub struct TsanBuild {
    /// The instrumented binaries: `tests/device_threads*.rs` and `tests/device_async.rs`
    /// ([`TSAN_TESTS`]).
    pub tests: Vec<Artifact>,
    /// The racy probe program (must be caught).
    pub probe: PathBuf,
    /// How long the build took.
    pub elapsed: Duration,
}

/// The probe: two threads write one variable without synchronisation (a data race on purpose).
const TSAN_PROBE_MAIN: &str = r#"//! A deliberate data race, which ThreadSanitizer must report (generated by cargo xtask).
fn main() {
    static mut COUNTER: u64 = 0;
    let p = std::ptr::addr_of_mut!(COUNTER) as usize;
    // SAFETY: none; this is the data race the sanitizer must find.
    let t = std::thread::spawn(move || unsafe { *(p as *mut u64) += 1 });
    unsafe { *(p as *mut u64) += 1 };
    t.join().unwrap();
}
"#;

/// The device tests built with ThreadSanitizer (cargo's `--test` patterns): the threads tests
/// (queue pairs, CQs and SRQs shared between threads) and the async adaptor's (its driver's
/// wake-up handshake between the reactor, the poller and tasks on a multi-threaded runtime;
/// built with `--features tokio,async-io`).
pub const TSAN_TESTS: [&str; 2] = ["device_threads*", "device_async"];

/// Builds the [`TSAN_TESTS`] of the root package with ThreadSanitizer
/// (`RUSTFLAGS=-Zsanitizer=thread cargo +nightly test -Zbuild-std --target x86_64-unknown-linux-gnu
/// --features tokio,async-io --no-run`, in `TARGET/tsan`), and the racy probe with the same flags
/// and folder (so it reuses the instrumented standard library).
pub fn build_tsan(toolchain: &str, root: &Path, target_dir: &Path) -> Result<TsanBuild, String> {
    let dir = target_dir.join("tsan");
    let dir_s = dir.to_string_lossy().into_owned();
    let tsan_cargo = |cwd: &Path, args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["-Zbuild-std", "--target", TSAN_TARGET, "--target-dir", &dir_s]);
        all.push("--message-format=json-render-diagnostics");
        let mut cmd = nightly_cargo(toolchain, cwd, &all);
        cmd.env("RUSTFLAGS", "-Zsanitizer=thread");
        cmd
    };
    eprintln!(
        "xtask: ==== ThreadSanitizer build: RUSTFLAGS=-Zsanitizer=thread cargo +{toolchain} test -Zbuild-std \
         --target {TSAN_TARGET} -p rdma-verbs --features tokio,async-io --test 'device_threads*' \
         --test device_async --no-run (in {dir_s})"
    );
    let mut args = vec!["test", "--no-run", "-p", "rdma-verbs", "--features", "tokio,async-io"];
    for t in TSAN_TESTS {
        args.extend(["--test", t]);
    }
    let mut cmd = tsan_cargo(root, &args);
    // The build's own messages on stderr are shown; the JSON on stdout is kept.
    let r = process::run(&mut cmd, PASS_LIMIT, false)?;
    eprint!("{}", r.stderr);
    if !r.success() {
        return Err(format!(
            "the ThreadSanitizer build failed ({}): {}",
            r.describe(),
            crate::vm::last_lines(&r.stderr, 5).trim()
        ));
    }
    let root_manifest = root.join("Cargo.toml");
    let mut tests: Vec<Artifact> = cargo::parse_artifacts(&r.stdout)
        .into_iter()
        .filter(|a| a.manifest_path == root_manifest && a.kind.iter().any(|k| k == "test"))
        .filter(|a| a.name.starts_with("device_threads") || a.name == "device_async")
        .collect();
    tests.sort_by(|a, b| a.name.cmp(&b.name));
    for want in ["device_threads", "device_async"] {
        if !tests.iter().any(|a| a.name == want) {
            return Err(format!("the ThreadSanitizer build produced no tests/{want}.rs binary"));
        }
    }
    for t in &tests {
        let data = fs::read(&t.executable).map_err(|e| format!("reading {}: {e}", t.executable.display()))?;
        if crate::image::find_all(&data, b"__tsan_init").next().is_none() {
            return Err(format!("{} has no ThreadSanitizer runtime (__tsan_init)", t.executable.display()));
        }
    }
    let probe_dir = dir.join("probe");
    let io = |e: std::io::Error| format!("writing the probe crate in {}: {e}", probe_dir.display());
    fs::create_dir_all(probe_dir.join("src")).map_err(io)?;
    fs::write(
        probe_dir.join("Cargo.toml"),
        "[package]\nname = \"xtask-tsan-probe\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n[workspace]\n",
    )
    .map_err(io)?;
    fs::write(probe_dir.join("src/main.rs"), TSAN_PROBE_MAIN).map_err(io)?;
    let p = process::run(&mut tsan_cargo(&probe_dir, &["build"]), PASS_LIMIT, false)?;
    eprint!("{}", p.stderr);
    if !p.success() {
        return Err(format!("building the ThreadSanitizer probe failed ({})", p.describe()));
    }
    let probe = cargo::parse_artifacts(&p.stdout)
        .into_iter()
        .find(|a| a.name == "xtask-tsan-probe")
        .map(|a| a.executable)
        .ok_or("building the ThreadSanitizer probe gave no executable")?;
    Ok(TsanBuild { tests, probe, elapsed: r.elapsed + p.elapsed })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_where_miri_aborted() {
        let out = "running 3 tests\ntest a::ok_one ... ok\ntest cq::tests::names ... \n";
        let err = "   Compiling x\nerror: unsupported operation: can't call foreign function `ibv_wc_status_str` on OS `linux`\n\
                   error: aborting due to 1 previous error\n";
        let note = miri_abort(out, err).unwrap();
        assert!(note.contains("`cq::tests::names`: unsupported operation"), "{note}");
        assert!(note.contains("cfg_attr(miri, ignore)"), "{note}");
        assert_eq!(miri_abort("test a ... ok\ntest result: ok. 1 passed;", ""), None);
    }

    #[test]
    fn recognises_installed_components() {
        assert!(is_component("rust-src", "rust-src"));
        assert!(is_component("miri-x86_64-unknown-linux-gnu", "miri"));
        assert!(!is_component("rust-src", "rust"));
        assert!(!is_component("rust-std-x86_64-unknown-linux-gnu", "rust-src"));
        assert!(!is_component("miri-preview", "miri"));
    }

    #[test]
    fn reads_doc_test_verdicts() {
        let out = "test src/lib.rs - wrong_code (line 3) - compile fail ... FAILED\n\
                   test src/lib.rs - right_code (line 8) - compile fail ... ok\n";
        assert_eq!(doc_test_verdict(out, "wrong_code"), Some(false));
        assert_eq!(doc_test_verdict(out, "right_code"), Some(true));
        assert_eq!(doc_test_verdict(out, "other"), None);
    }
}
