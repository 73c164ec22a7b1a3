//! Running cargo, and reading what it built from its JSON messages.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{json, signals};

/// `cargo ARGS` in the workspace root (the cargo that runs us, if we run under `cargo run`).
pub fn command<S: AsRef<OsStr>>(root: &Path, args: &[S]) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args(args).current_dir(root);
    cmd
}

/// Runs `cargo ARGS` with its output shown; fails if it fails or a signal came in meanwhile.
pub fn run(root: &Path, args: &[&str]) -> Result<(), String> {
    let status = command(root, args).status().map_err(|e| format!("running cargo: {e}"))?;
    if let Some(signal) = signals::received() {
        return Err(format!("interrupted by signal {signal}"));
    }
    if !status.success() {
        return Err(format!("cargo {} failed ({status})", args.join(" ")));
    }
    Ok(())
}

/// The workspace's target directory (honours `CARGO_TARGET_DIR` and cargo's configuration).
pub fn target_dir(root: &Path) -> Result<PathBuf, String> {
    let out = command(root, &["metadata", "--format-version", "1", "--no-deps"])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running cargo metadata: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let metadata = json::parse(&text).map_err(|e| format!("reading cargo metadata: {e}"))?;
    let dir = metadata.get("target_directory").and_then(json::Value::as_str);
    dir.map(PathBuf::from).ok_or_else(|| "cargo metadata gave no target_directory".into())
}

/// A test executable cargo built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    /// The package's `Cargo.toml`.
    pub manifest_path: PathBuf,
    /// The target's kinds (`lib`, `bin`, `test`, ...).
    pub kind: Vec<String>,
    /// The target's name.
    pub name: String,
    /// The test executable.
    pub executable: PathBuf,
}

/// The crate features every build of the test suite enables (the async adaptor's backends: the
/// device tests `device_async` and the example `async_rpc` require them; `mpi`: the collectives
/// example's MPI bootstrap and its comparison with `MPI_Allreduce` in the two-host stage;
/// `serde`: the host test `serde_roundtrip`, which then builds with everything else instead of
/// in a build of its own).
pub const FEATURES: &str = "tokio,async-io,mpi,serde";

/// The test executables of `cargo test --workspace --no-run --features FEATURES` (building them).
pub fn test_artifacts(root: &Path) -> Result<Vec<Artifact>, String> {
    let args = [
        "test",
        "--workspace",
        "--no-run",
        "--features",
        FEATURES,
        "--message-format=json-render-diagnostics",
    ];
    let out =
        command(root, &args).stderr(Stdio::inherit()).output().map_err(|e| format!("running cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo test --workspace --no-run --features {FEATURES} failed ({})", out.status));
    }
    Ok(parse_artifacts(&String::from_utf8_lossy(&out.stdout)))
}

/// Parses cargo's JSON messages: the compiler artifacts that have an executable.
pub fn parse_artifacts(messages: &str) -> Vec<Artifact> {
    let mut artifacts = Vec::new();
    for line in messages.lines().filter(|l| l.starts_with('{')) {
        let Ok(msg) = json::parse(line) else { continue };
        if msg.get("reason").and_then(json::Value::as_str) != Some("compiler-artifact") {
            continue;
        }
        let (Some(manifest), Some(target), Some(exe)) = (
            msg.get("manifest_path").and_then(json::Value::as_str),
            msg.get("target"),
            msg.get("executable").and_then(json::Value::as_str),
        ) else {
            continue;
        };
        let kind = target.get("kind").and_then(json::Value::as_array).unwrap_or_default();
        artifacts.push(Artifact {
            manifest_path: manifest.into(),
            kind: kind.iter().filter_map(json::Value::as_str).map(String::from).collect(),
            name: target.get("name").and_then(json::Value::as_str).unwrap_or_default().to_string(),
            executable: exe.into(),
        });
    }
    artifacts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_artifact_messages() {
        let messages = concat!(
            r#"{"reason":"compiler-artifact","manifest_path":"/w/Cargo.toml","target":{"kind":["test"],"name":"device_x"},"executable":"/w/target/debug/deps/device_x-1"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","manifest_path":"/w/Cargo.toml","target":{"kind":["lib"],"name":"w"},"executable":null}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#,
            "\nnot json\n"
        );
        let want = Artifact {
            manifest_path: "/w/Cargo.toml".into(),
            kind: vec!["test".into()],
            name: "device_x".into(),
            executable: "/w/target/debug/deps/device_x-1".into(),
        };
        assert_eq!(parse_artifacts(messages), [want]);
    }

    #[test]
    fn finds_the_target_dir() {
        let root = crate::workspace_root();
        let dir = target_dir(&root).unwrap();
        match std::env::var_os("CARGO_TARGET_DIR") {
            Some(set) if Path::new(&set).is_absolute() => assert_eq!(dir, Path::new(&set)),
            Some(_) => {}
            None => assert!(dir.is_absolute()),
        }
    }
}
