//! Host test of the `dlopen` feature: a program built with it starts on a host without rdma-core,
//! and its first verbs call returns [`Error::LibraryMissing`] naming the library and its package.
//!
//! The host has rdma-core (the build needs its headers), so its absence is simulated: this test
//! binary, which does not link libibverbs, runs itself again (the `child` test) in a private
//! mount namespace (`unshare -m`) where the directory holding `libibverbs.so.1` is replaced by
//! one of symbolic links to all its files but `libibverbs*` and `librdmacm*` (or only
//! `librdmacm*`): the dynamic loader then finds neither, as on a host without the packages. As a
//! control, `/usr/bin/ibv_devices` (ibverbs-utils, linked to libibverbs) must fail to start
//! there. Needs root (a mount namespace); without it, or without `unshare`, the test says why and
//! checks nothing else.

#![cfg(feature = "dlopen")]

use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The feature is on in this build.
const _: () = assert!(ibverbs::ffi::DLOPEN);

use ibverbs::Error;

/// The environment variable that makes [`child`] run a scenario.
const CHILD: &str = "IBVERBS_DLOPEN_ABSENT_CHILD";
/// The longest a run in the namespace may take.
const TIME_LIMIT: Duration = Duration::from_secs(120);

/// Replaces directory `$1` by symbolic links to its entries, but those whose name up to `.so`
/// is one of `$3` (space separated), using `$2` (a fresh empty directory) for a tmpfs; then runs
/// the rest of the arguments. Runs inside `unshare -m`: the mounts vanish with the namespace.
const HIDE: &str = r#"set -e
lib=$1; work=$2; hide=$3; shift 3
mount -t tmpfs ibverbs-dlopen-test "$work"
mkdir "$work/orig" "$work/shadow"
mount --bind "$lib" "$work/orig"
for f in "$work"/orig/* "$work"/orig/.[!.]*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  n=${f##*/}
  case " $hide " in *" ${n%%.so*} "*) continue ;; esac
  ln -s "$f" "$work/shadow/$n"
done
mount --bind "$work/shadow" "$lib"
exec "$@"
"#;

/// The directory of the libibverbs this process loads.
fn library_dir() -> PathBuf {
    let addr = ibverbs::ffi::function_address("ibv_get_device_list").expect("libibverbs loads on this host");
    // SAFETY: `Dl_info` is plain pointers, filled by dladdr for an address of a loaded object.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: a valid address and out-pointer.
    assert_ne!(unsafe { libc::dladdr(addr, &mut info) }, 0, "dladdr");
    // SAFETY: dladdr returned the object's NUL-terminated name.
    let file = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    let real = std::fs::canonicalize(&file).unwrap_or_else(|e| panic!("{file}: {e}"));
    real.parent().expect("a library in a directory").to_path_buf()
}

/// Why this host cannot run the namespace, if it cannot.
fn cannot_run() -> Option<String> {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root: a mount namespace (unshare -m) needs CAP_SYS_ADMIN".into());
    }
    match Command::new("unshare").args(["-m", "true"]).stdin(Stdio::null()).output() {
        Err(e) => Some(format!("`unshare` (util-linux) cannot run: {e}")),
        Ok(o) if !o.status.success() => {
            Some(format!("`unshare -m true` fails: {}", String::from_utf8_lossy(&o.stderr).trim()))
        }
        Ok(_) => None,
    }
}

/// Runs `program args` with the libraries named in `hide` absent, within [`TIME_LIMIT`].
fn run_without(lib: &Path, hide: &str, program: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let work =
        std::env::temp_dir().join(format!("ibverbs-dlopen-absent-{}-{}", std::process::id(), hide.len()));
    std::fs::create_dir_all(&work).unwrap();
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "sh", "-c", HIDE, "sh"])
        .arg(lib)
        .arg(&work)
        .arg(hide)
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawning unshare");
    // Read the pipes on threads: a child that fills one must not block the deadline.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut v).map(|_| v).unwrap_or_default()
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut err, &mut v).map(|_| v).unwrap_or_default()
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > TIME_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir(&work);
            panic!("{} did not finish within {TIME_LIMIT:?}", program.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = std::fs::remove_dir(&work);
    Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() }
}

/// Runs the [`child`] scenario `scenario` in the namespace; returns its output.
fn run_child(lib: &Path, hide: &str, scenario: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let o = run_without(
        lib,
        hide,
        &exe,
        &["--exact", "child", "--nocapture", "--test-threads=1"],
        &[(CHILD, scenario)],
    );
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "scenario {scenario} failed ({}):\n{stdout}\n{stderr}", o.status);
    assert!(stdout.contains("1 passed"), "scenario {scenario} did not run:\n{stdout}\n{stderr}");
    stdout
}

#[test]
fn starts_without_rdma_core_and_names_the_missing_library() {
    if let Some(why) = cannot_run() {
        eprintln!("dlopen_absent: not run: {why}");
        return;
    }
    let lib = library_dir();

    // Control: a program linked to libibverbs does not start there.
    let linked = Path::new("/usr/bin/ibv_devices");
    if linked.exists() {
        let o = run_without(&lib, "libibverbs librdmacm", linked, &[], &[]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "ibv_devices started without libibverbs: {stderr}");
        assert!(
            stderr.contains("error while loading shared libraries: libibverbs.so.1"),
            "the libraries are not hidden: {stderr}"
        );
        eprintln!("linked ibv_devices, libraries hidden: {}", stderr.trim());
    } else {
        eprintln!("dlopen_absent: no /usr/bin/ibv_devices (ibverbs-utils) for the linked control");
    }

    let out = run_child(&lib, "libibverbs librdmacm", "absent");
    eprintln!("{out}");
    assert!(out.contains("devices(): libibverbs.so.1 could not be loaded"), "{out}");
    #[cfg(feature = "cm")]
    {
        let out = run_child(&lib, "librdmacm", "no-rdmacm");
        eprintln!("{out}");
        assert!(out.contains("EventChannel::new(): librdmacm.so.1 could not be loaded"), "{out}");
    }
}

/// The scenario named by [`CHILD`], run in the namespace by the test above; nothing otherwise.
#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD) else { return };
    match scenario.as_str() {
        "absent" => absent(),
        #[cfg(feature = "cm")]
        "no-rdmacm" => no_rdmacm(),
        s => panic!("unknown scenario {s}"),
    }
}

/// Neither library: every entry point gives the typed error; the rest works.
fn absent() {
    let verbs_missing = |what: &str, r: Result<(), Error>| {
        let e = r.expect_err(what);
        println!("{what}: {e}");
        match &e {
            Error::LibraryMissing { library, package, reason } => {
                assert_eq!((*library, *package), ("libibverbs.so.1", "libibverbs1"), "{what}");
                assert!(reason.contains("libibverbs.so.1"), "{what}: {reason}");
            }
            e => panic!("{what}: {e:?}"),
        }
        assert!(e.to_string().contains("install rdma-core's libibverbs1 package"), "{e}");
    };
    verbs_missing("devices()", ibverbs::devices().map(drop));
    verbs_missing("devices() again", ibverbs::devices().map(drop));
    verbs_missing("Context::open(None)", ibverbs::Context::open(None).map(drop));
    verbs_missing("select::Fabric::query()", ibverbs::select::Fabric::query().map(drop));
    // SAFETY: no other thread uses the libraries.
    verbs_missing("fork::fork_init()", unsafe { ibverbs::fork::fork_init() });
    #[cfg(feature = "cm")]
    {
        // librdmacm needs libibverbs, which is what is missing.
        verbs_missing("cm::EventChannel::new()", ibverbs::cm::EventChannel::new().map(drop));
        verbs_missing("cm::devices()", ibverbs::cm::devices().map(drop));
    }
    assert!(!ibverbs::ffi::is_loaded());
    let e = ibverbs::ffi::load().unwrap_err();
    assert_eq!(e.library(), ibverbs::ffi::Library::Verbs);
    assert!(!ibverbs::ffi::has_function("ibv_open_device"));
    // What needs no library still works.
    assert_eq!(ibverbs::fork::fork_support(), ibverbs::fork::ForkSupport::Unknown);
    assert_eq!(ibverbs::WcStatus::REM_ACCESS_ERR.as_str(), "remote access error");
    assert_eq!(ibverbs::PortState::ACTIVE.as_str(), "active");
    assert_eq!(ibverbs::NodeType::RNIC.as_str(), "iWARP NIC");
    // A raw call without load() panics naming the library.
    let panic = std::panic::catch_unwind(|| {
        let mut n = 0;
        // SAFETY: a valid out-pointer (never reached: the library is missing).
        unsafe { ibverbs::ffi::ibv_get_device_list(&mut n) }
    })
    .expect_err("a raw call without the library");
    let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    println!("raw ffi::ibv_get_device_list panics: {msg}");
    assert!(
        msg.contains("ibv_get_device_list") && msg.contains("libibverbs.so.1 could not be loaded"),
        "{msg}"
    );
}

/// libibverbs without librdmacm: the verbs work, RDMA-CM gives the typed error.
#[cfg(feature = "cm")]
fn no_rdmacm() {
    // This host has no RDMA device (or some): either way not a missing library.
    match ibverbs::devices() {
        Err(Error::LibraryMissing { .. }) => panic!("libibverbs is there"),
        r => println!("devices(): {:?}", r.map(|l| l.len())),
    }
    assert!(ibverbs::ffi::is_loaded());
    for (what, r) in [
        ("EventChannel::new()", ibverbs::cm::EventChannel::new().map(drop)),
        ("cm::devices()", ibverbs::cm::devices().map(drop)),
    ] {
        let e = r.expect_err(what);
        println!("{what}: {e}");
        assert!(
            matches!(&e, Error::LibraryMissing { library: "librdmacm.so.1", package: "librdmacm1", .. }),
            "{what}: {e:?}"
        );
    }
    assert!(!ibverbs::ffi::is_rdmacm_loaded());
}
