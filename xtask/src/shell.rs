//! POSIX shell text: quoting, the `env` file a job's steps source, and step scripts made from an argv.
//!
//! Everything works on bytes, so non-UTF-8 arguments and environment values pass through intact.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Exit status of a step whose command does not exist (as in POSIX shells).
pub const EXIT_NOT_FOUND: u8 = 127;

/// Quotes `word` for a POSIX shell: unchanged when it is made only of characters that are never special,
/// else in single quotes, each `'` written as `'\''`.
pub fn quote(word: &[u8]) -> Vec<u8> {
    let plain = |b: &u8| b.is_ascii_alphanumeric() || b"_-./,:=+@%^".contains(b);
    if !word.is_empty() && word.iter().all(plain) {
        return word.to_vec();
    }
    let mut out = Vec::with_capacity(word.len() + 2);
    out.push(b'\'');
    for &b in word {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
    out
}

/// Whether `name` can be a shell variable name (`[A-Za-z_][A-Za-z0-9_]*`).
pub fn is_var_name(name: &[u8]) -> bool {
    match name.split_first() {
        Some((first, rest)) => {
            (first.is_ascii_alphabetic() || *first == b'_')
                && rest.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'_')
        }
        None => false,
    }
}

/// Whether the host's environment variable `name` is handed to commands run in the VM.
///
/// The VM's processes start with an empty environment: they get these, plus what the harness sets.
pub fn is_forwarded(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "NO_COLOR",
        "RUST_BACKTRACE",
        "RUST_LIB_BACKTRACE",
        "RUST_LOG",
        "RUST_MIN_STACK",
        // Extra options for the valgrind and ThreadSanitizer passes of `cargo xtask test`.
        "VALGRIND_OPTS",
        "TSAN_OPTIONS",
    ];
    const PREFIXES: &[&str] = &["IBVERBS_", "CARGO_", "RUST_TEST_", "LC_", "RDMAV_", "MLX5_", "CLICOLOR"];
    // What `cargo run` sets to describe the package it runs (xtask itself): wrong for anything else.
    const CARGO_PACKAGE: &[&str] =
        &["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_CRATE_", "CARGO_BIN_", "CARGO_PRIMARY_PACKAGE"];
    (EXACT.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p)))
        && !CARGO_PACKAGE.iter().any(|p| name.starts_with(p))
}

/// The `env` file sourced before each step: one `export NAME=value` line per variable, values quoted.
/// Variables whose name is no shell name are left out (a shell could not set them).
pub fn env_file<N: AsRef<OsStr>, V: AsRef<OsStr>>(vars: &[(N, V)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in vars {
        let name = name.as_ref().as_bytes();
        if !is_var_name(name) {
            continue;
        }
        out.extend_from_slice(b"export ");
        out.extend_from_slice(name);
        out.push(b'=');
        out.extend_from_slice(&quote(value.as_ref().as_bytes()));
        out.push(b'\n');
    }
    out
}

/// The environment handed to the VM: the forwarded host variables (see [`is_forwarded`]), then
/// `extra` (which wins over a host variable of the same name).
pub fn vm_environment(
    host: impl IntoIterator<Item = (OsString, OsString)>,
    extra: &[(String, String)],
) -> Vec<(OsString, OsString)> {
    let mut vars: Vec<(OsString, OsString)> = host
        .into_iter()
        .filter(|(name, _)| name.to_str().is_some_and(is_forwarded))
        .filter(|(name, _)| !extra.iter().any(|(x, _)| name == x.as_str()))
        .collect();
    vars.sort();
    vars.extend(extra.iter().map(|(n, v)| (OsString::from(n), OsString::from(v))));
    vars
}

/// A script that runs `script` in `dir` (exit 125 if it cannot go there).
pub fn in_dir(dir: &Path, script: &[u8]) -> Vec<u8> {
    let mut s = b"cd ".to_vec();
    s.extend_from_slice(&quote(dir.as_os_str().as_bytes()));
    s.extend_from_slice(b" || exit 125\n");
    s.extend_from_slice(script);
    s
}

/// A step script that runs `argv` in `cwd`: a clear message and exit 127 when the command does not exist,
/// else `exec` of the command (so its exit status is the step's).
pub fn argv_script(cwd: &Path, argv: &[OsString]) -> Vec<u8> {
    let mut s = Vec::new();
    if let Some(cmd) = argv.first() {
        let cmd = quote(cmd.as_bytes());
        s.extend_from_slice(b"if ! command -v ");
        s.extend_from_slice(&cmd);
        s.extend_from_slice(b" >/dev/null 2>&1; then\n  printf 'xtask: %s: command not found (PATH=%s)\\n' ");
        s.extend_from_slice(&cmd);
        s.extend_from_slice(format!(" \"$PATH\" >&2\n  exit {EXIT_NOT_FOUND}\nfi\nexec").as_bytes());
        for arg in argv {
            s.push(b' ');
            s.extend_from_slice(&quote(arg.as_bytes()));
        }
        s.push(b'\n');
    }
    in_dir(cwd, &s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// Runs `script` with `sh -c` and returns its stdout.
    fn sh(script: &[u8]) -> Vec<u8> {
        let out = Command::new("sh").arg("-c").arg(OsStr::from_bytes(script)).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }

    #[test]
    fn quote_leaves_plain_words_alone() {
        assert_eq!(quote(b"abc-1.2/x_y:z=w"), b"abc-1.2/x_y:z=w");
        assert_eq!(quote(b""), b"''");
        assert_eq!(quote(b"a b"), b"'a b'");
        assert_eq!(quote(b"it's"), b"'it'\\''s'");
        assert_eq!(quote(b"$HOME"), b"'$HOME'");
    }

    #[test]
    fn quote_round_trips_through_sh() {
        let words: &[&[u8]] =
            &[b"", b"a b", b"it's", b"'", b"$HOME `x` $(y)", b"*", b"x\ny", b"\\", b"\"q\"", b"\xff\xfe"];
        for word in words {
            let mut script = b"printf %s ".to_vec();
            script.extend_from_slice(&quote(word));
            assert_eq!(sh(&script), *word, "word {:?}", String::from_utf8_lossy(word));
        }
    }

    #[test]
    fn var_names() {
        assert!(is_var_name(b"PATH"));
        assert!(is_var_name(b"_x1"));
        assert!(!is_var_name(b""));
        assert!(!is_var_name(b"1x"));
        assert!(!is_var_name(b"a-b"));
        assert!(!is_var_name(b"a.b"));
    }

    #[test]
    fn forwarded_variables() {
        for name in [
            "PATH",
            "HOME",
            "RUST_BACKTRACE",
            "RUST_LOG",
            "IBVERBS_TEST_DEVICE",
            "CARGO_HOME",
            "VALGRIND_OPTS",
        ] {
            assert!(is_forwarded(name), "{name}");
        }
        for name in
            ["LD_PRELOAD", "TERM", "TMPDIR", "PWD", "SHELL", "PATHX", "CARGO_MANIFEST_DIR", "CARGO_PKG_NAME"]
        {
            assert!(!is_forwarded(name), "{name}");
        }
    }

    #[test]
    fn env_file_quotes_values_and_skips_bad_names() {
        let vars = [("A", "x y"), ("B", "it's"), ("bad-name", "z"), ("C", "line1\nline2")];
        let file = env_file(&vars);
        assert_eq!(file, b"export A='x y'\nexport B='it'\\''s'\nexport C='line1\nline2'\n".to_vec());
        let mut script = file.clone();
        script.extend_from_slice(b"printf '%s|' \"$A\" \"$B\" \"$C\"");
        assert_eq!(sh(&script), b"x y|it's|line1\nline2|");
    }

    #[test]
    fn vm_environment_filters_and_overrides() {
        let host = [("PATH", "/bin"), ("IBVERBS_TEST_DEVICE", "mlx5_0"), ("SECRET", "s"), ("HOME", "/root")]
            .map(|(n, v)| (OsString::from(n), OsString::from(v)));
        let extra = [("IBVERBS_TEST_DEVICE".to_string(), "rxe0".to_string())];
        let env = vm_environment(host, &extra);
        let env: Vec<(&str, &str)> =
            env.iter().map(|(n, v)| (n.to_str().unwrap(), v.to_str().unwrap())).collect();
        assert_eq!(env, [("HOME", "/root"), ("PATH", "/bin"), ("IBVERBS_TEST_DEVICE", "rxe0")]);
    }

    #[test]
    fn in_dir_changes_directory_first() {
        assert_eq!(in_dir(Path::new("/a b"), b"pwd\n"), b"cd '/a b' || exit 125\npwd\n");
        assert_eq!(sh(&in_dir(Path::new("/usr"), b"pwd")), b"/usr\n");
    }

    #[test]
    fn argv_script_runs_the_command_with_its_arguments() {
        let argv: Vec<OsString> = ["printf", "%s|", "a b", "it's", "$HOME", ""].map(OsString::from).to_vec();
        assert_eq!(sh(&argv_script(Path::new("/"), &argv)), b"a b|it's|$HOME||");
    }

    #[test]
    fn argv_script_reports_a_missing_command() {
        let argv = [OsString::from("xtask-no-such-command")];
        let out =
            Command::new("sh").arg("-c").arg(OsStr::from_bytes(&argv_script(Path::new("/"), &argv))).output();
        let out = out.unwrap();
        assert_eq!(out.status.code(), Some(EXIT_NOT_FOUND.into()));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("xtask-no-such-command: command not found"), "{err}");
        assert!(out.stdout.is_empty());
    }
}
