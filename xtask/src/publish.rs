//! Publish readiness, checked by `cargo xtask test`: the declared MSRV builds both libraries, the
//! documentation builds where rdma-core is absent (as on docs.rs), and `cargo publish --dry-run`
//! packages and verifies both crates.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::cargo;
use crate::process::{self, Finished};

/// The packages published from this workspace, in dependency order.
pub const PACKAGES: [&str; 2] = ["rdma-verbs-sys", "rdma-verbs"];

/// A check's limit: a cold build of bindgen and the two crates takes about two minutes here.
const LIMIT: Duration = Duration::from_secs(900);

/// `rust-version` of `[workspace.package]` in the root `Cargo.toml`.
pub fn declared_msrv(manifest: &str) -> Option<String> {
    let mut in_ws = false;
    for line in manifest.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            in_ws = t == "[workspace.package]";
        } else if in_ws {
            if let Some(v) = t.strip_prefix("rust-version") {
                let v = v.trim_start().strip_prefix('=')?.trim().trim_matches('"');
                return Some(v.to_string());
            }
        }
    }
    None
}

fn fail(what: &str, r: &Finished) -> String {
    let tail: Vec<&str> = r.stderr.lines().rev().take(15).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    format!("{what}: {}\n{}", r.describe(), tail.join("\n"))
}

/// Copies the files cargo needs to resolve and build the workspace into `dst` (a scratch copy, so
/// that a lockfile resolved for the MSRV does not touch the checkout's).
fn copy_workspace(root: &Path, dst: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst).map_err(|e| format!("creating {}: {e}", dst.display()))?;
    let mut cp = Command::new("cp");
    cp.arg("-r").current_dir(root);
    for entry in [
        "Cargo.toml",
        "build.rs",
        "README.md",
        "ibverbs",
        "ibverbs-sys",
        "xtask",
        "examples",
        "benches",
        "tests",
    ] {
        cp.arg(entry);
    }
    cp.arg(dst);
    let r = process::run(&mut cp, Duration::from_secs(60), false)?;
    if !r.success() {
        return Err(fail("copying the workspace", &r));
    }
    Ok(())
}

/// The MSRV check: a lockfile resolved for `rust-version`
/// (`CARGO_RESOLVER_INCOMPATIBLE_RUST_VERSIONS=fallback`), then `cargo +MSRV check --lib
/// --all-features` of both libraries, the toolchain installed with rustup if missing. Returns the
/// version checked.
pub fn msrv(root: &Path, target_dir: &Path) -> Result<String, String> {
    let manifest =
        std::fs::read_to_string(root.join("Cargo.toml")).map_err(|e| format!("reading Cargo.toml: {e}"))?;
    let version = declared_msrv(&manifest).ok_or("no rust-version in [workspace.package]")?;
    eprintln!("xtask: ==== MSRV: cargo +{version} check --lib --all-features (rdma-verbs, rdma-verbs-sys)");
    let mut install = Command::new("rustup");
    install.args(["toolchain", "install", &version, "--profile", "minimal"]).env_remove("RUSTUP_TOOLCHAIN");
    let r = process::run(&mut install, LIMIT, false)?;
    if !r.success() {
        return Err(fail(&format!("rustup toolchain install {version}"), &r));
    }
    let scratch = target_dir.join("msrv");
    let src = scratch.join("src");
    copy_workspace(root, &src)?;
    let mut lock = cargo::command(&src, &["generate-lockfile"]);
    lock.env("CARGO_RESOLVER_INCOMPATIBLE_RUST_VERSIONS", "fallback");
    let r = process::run(&mut lock, LIMIT, false)?;
    if !r.success() {
        return Err(fail("cargo generate-lockfile (MSRV-aware)", &r));
    }
    let mut check = Command::new("cargo");
    check
        .arg(format!("+{version}"))
        .args(["check", "--lib", "--all-features", "-p", PACKAGES[0], "-p", PACKAGES[1]])
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", scratch.join("target"))
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO");
    let r = process::run(&mut check, LIMIT, true)?;
    if !r.success() {
        return Err(fail(&format!("cargo +{version} check"), &r));
    }
    Ok(version)
}

/// An environment in which pkg-config finds nothing.
fn hide_rdma_core(cmd: &mut Command, empty: &Path) {
    cmd.env("PKG_CONFIG_LIBDIR", empty).env("PKG_CONFIG_PATH", empty).env_remove("IBVERBS_INCLUDE_DIR");
    cmd.env_remove("IBVERBS_LIB_DIR");
}

/// `DOCS_RS=1 cargo doc` of both crates with pkg-config unable to find libibverbs, after proving
/// that it cannot: pkg-config fails, and the same build without `DOCS_RS` fails naming rdma-core.
pub fn docs_without_rdma_core(root: &Path, target_dir: &Path) -> Result<(), String> {
    eprintln!("xtask: ==== docs without rdma-core: DOCS_RS=1 cargo doc, pkg-config finding nothing");
    let dir = target_dir.join("docsrs");
    let empty: PathBuf = dir.join("no-pkgconfig");
    std::fs::create_dir_all(&empty).map_err(|e| format!("creating {}: {e}", empty.display()))?;
    let mut probe = Command::new("pkg-config");
    probe.args(["--exists", "libibverbs"]);
    hide_rdma_core(&mut probe, &empty);
    let r = process::run(&mut probe, Duration::from_secs(30), false)?;
    if r.success() {
        return Err(
            "pkg-config still finds libibverbs with PKG_CONFIG_LIBDIR and PKG_CONFIG_PATH emptied".into()
        );
    }
    let target = dir.join("target");
    let build = |docs_rs: bool| -> Result<Finished, String> {
        let mut cmd = cargo::command(
            root,
            &["doc", "--no-deps", "--all-features", "-p", PACKAGES[0], "-p", PACKAGES[1]],
        );
        cmd.env("CARGO_TARGET_DIR", &target);
        hide_rdma_core(&mut cmd, &empty);
        if docs_rs {
            cmd.env("DOCS_RS", "1");
        } else {
            cmd.env_remove("DOCS_RS");
        }
        process::run(&mut cmd, LIMIT, docs_rs)
    };
    let control = build(false)?;
    if control.success() || !control.stderr.contains("Could not find rdma-core") {
        return Err(fail("without DOCS_RS the build should fail, naming rdma-core", &control));
    }
    let r = build(true)?;
    if !r.success() {
        return Err(fail("DOCS_RS=1 cargo doc", &r));
    }
    for lib in ["ibverbs", "ibverbs_sys"] {
        let index = target.join("doc").join(lib).join("index.html");
        if !index.exists() {
            return Err(format!("DOCS_RS=1 cargo doc wrote no {}", index.display()));
        }
    }
    Ok(())
}

/// `cargo publish --dry-run --workspace`: packages both crates and builds each from its package.
pub fn dry_run(root: &Path) -> Result<(), String> {
    eprintln!("xtask: ==== cargo publish --dry-run --workspace --allow-dirty");
    // The verification of rdma-verbs takes rdma-verbs-sys from a local overlay of the registry,
    // which cargo extracts into $CARGO_HOME/registry/src like any registry crate, and never again
    // once there (registry crates are immutable): on a machine that ran this check before, a
    // changed rdma-verbs-sys of the same version was verified against the old copy (seen: the
    // verification missed functions the new one has). Those copies go first.
    for stale in stale_extracted_packages(&cargo_home()) {
        eprintln!("xtask: removing {}, an earlier dry run's copy of a workspace package", stale.display());
        let _ = std::fs::remove_dir_all(&stale);
    }
    // The workspace's target folder: the verification builds reuse its dependencies.
    let mut cmd = cargo::command(root, &["publish", "--dry-run", "--workspace", "--allow-dirty"]);
    let r = process::run(&mut cmd, LIMIT, false)?;
    if !r.success() {
        return Err(fail("cargo publish --dry-run", &r));
    }
    for p in PACKAGES {
        if !r.stderr.contains(&format!("Verifying {p} ")) {
            return Err(format!("cargo publish --dry-run did not verify {p}"));
        }
    }
    Ok(())
}

/// Cargo's home folder (`$CARGO_HOME`, else `~/.cargo`).
fn cargo_home() -> std::path::PathBuf {
    std::env::var_os("CARGO_HOME").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cargo")
    })
}

/// The registry copies of the workspace's packages (`registry/src/<index>/<package>-<version>`)
/// under `cargo_home`: what earlier `cargo publish --dry-run`s extracted.
pub fn stale_extracted_packages(cargo_home: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(indexes) = std::fs::read_dir(cargo_home.join("registry").join("src")) else { return found };
    for index in indexes.flatten() {
        let Ok(entries) = std::fs::read_dir(index.path()) else { continue };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = PACKAGES.iter().any(|p| {
                name.strip_prefix(p)
                    .and_then(|v| v.strip_prefix('-'))
                    .is_some_and(|v| v.starts_with(|c: char| c.is_ascii_digit()))
            });
            if ours {
                found.push(e.path());
            }
        }
    }
    found.sort();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_earlier_dry_runs_copies_of_the_workspace_packages_only() {
        let home = std::env::temp_dir().join(format!("xtask-cargo-home-{}", std::process::id()));
        let idx = home.join("registry/src/index.crates.io-1949cf8c6b5b557f");
        for d in ["rdma-verbs-sys-0.1.0", "rdma-verbs-0.1.0", "rdma-verbs-extra-1.0.0", "libc-0.2.1"] {
            std::fs::create_dir_all(idx.join(d)).unwrap();
        }
        let got: Vec<String> = stale_extracted_packages(&home)
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(got, ["rdma-verbs-0.1.0", "rdma-verbs-sys-0.1.0"]);
        std::fs::remove_dir_all(&home).unwrap();
        assert!(stale_extracted_packages(&home).is_empty());
    }

    #[test]
    fn reads_the_declared_msrv() {
        let m =
            "[workspace]\nmembers = []\n\n[workspace.package]\nedition = \"2021\"\nrust-version = \"1.77\"\n";
        assert_eq!(declared_msrv(m).as_deref(), Some("1.77"));
        assert_eq!(declared_msrv("[package]\nrust-version = \"1.80\"\n"), None);
        assert_eq!(declared_msrv("[workspace.package]\nedition = \"2021\"\n"), None);
    }

    #[test]
    fn the_workspace_declares_one() {
        let m = std::fs::read_to_string(crate::workspace_root().join("Cargo.toml")).unwrap();
        assert!(declared_msrv(&m).is_some());
    }
}
