//! The VM's boot files: the host's Debian kernel, uncompressed, and a tiny initramfs (busybox, the RDMA
//! modules, `guest/init.sh`), built once and cached in `~/.cache/ibverbs-xtask/<kernel version>/`.
//!
//! The cache is keyed on the kernel image's size and mtime, its modules, busybox and the init script, so
//! a kernel upgrade or a change of `init.sh` rebuilds it.
//!
//! `--kernel backports` (or an explicit Debian kernel version, [`KernelChoice`]) boots a kernel that is
//! not installed instead: its `linux-image-*` package is fetched with `apt-get download`, unpacked with
//! `dpkg -x` into `~/.cache/ibverbs-xtask/kernels/<kernel version>/root/` (its modules indexed there with
//! `depmod -b`), and the boot files are built from that tree the same way, next to it. Nothing is
//! installed on the host: `/boot` and `/lib/modules` stay as they are.

use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// PID 1 of the VM.
pub const INIT_SCRIPT: &str = include_str!("../guest/init.sh");

/// Modules the VM loads, each with its dependencies (`modprobe --show-depends`), in this order.
/// `crc32_generic`: rxe asks the crypto API for "crc32" (its ICRC) when a device is added; no module
/// declares that dependency.
pub const MODULES: &[&str] =
    &["virtio_pci", "9p", "9pnet_virtio", "overlay", "dummy", "crc32_generic", "rdma_rxe", "rdma_ucm"];

/// The static busybox of Debian's `busybox-static`.
const BUSYBOX: &str = "/bin/busybox";

/// The magic bytes that open an xz stream.
const XZ_MAGIC: &[u8] = b"\xFD7zXZ\x00";

/// The magic bytes that open a zstd frame.
const ZSTD_MAGIC: &[u8] = b"\x28\xB5\x2F\xFD";

/// Bump to rebuild every cache after a change of the image's layout.
const LAYOUT_VERSION: u32 = 1;

/// Ready-to-boot files.
#[derive(Debug)]
pub struct Image {
    /// The kernel to pass to `-kernel`: the ELF vmlinux (booted through PVH), or the bzImage if it could
    /// not be extracted.
    pub kernel: PathBuf,
    /// The uncompressed cpio initramfs.
    pub initramfs: PathBuf,
    /// The kernel's version (`uname -r` in the VM).
    pub version: String,
    /// For a kernel that is not the host's: its module folder in the cache (`.../root/lib/modules/<version>`),
    /// which the guest links at `/lib/modules/<version>` for the modules it loads later. `None` for the
    /// host's kernel, whose modules are the host's own.
    pub modules: Option<PathBuf>,
}

/// Which kernel the VM boots (`--kernel`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum KernelChoice {
    /// The host's installed kernel ([`find_kernel`]).
    #[default]
    Host,
    /// The newest kernel of the backports suite: the one its `linux-image-amd64` depends on (found
    /// with `apt-cache`), fetched and cached.
    Backports,
    /// The Debian kernel of this version (package `linux-image-<version>`), fetched and cached.
    Version(String),
}

impl KernelChoice {
    /// Its name on the command line: `host`, `backports` or a kernel version (`6.12.95+deb12-amd64`).
    pub fn parse(name: &str) -> Option<KernelChoice> {
        let version_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '+' | '~' | '-' | '_');
        match name {
            "host" => Some(KernelChoice::Host),
            "backports" => Some(KernelChoice::Backports),
            v if v.starts_with(|c: char| c.is_ascii_digit())
                && v.contains('.')
                && v.chars().all(version_char) =>
            {
                Some(KernelChoice::Version(v.to_string()))
            }
            _ => None,
        }
    }
}

/// The kernel chosen for this process's VMs ([`select_kernel`]).
static KERNEL: OnceLock<KernelChoice> = OnceLock::new();

/// Chooses the kernel every VM of this process boots (once, before the first; the host's otherwise).
pub fn select_kernel(choice: KernelChoice) {
    let _ = KERNEL.set(choice);
}

/// The folder of xtask's caches: `$XDG_CACHE_HOME/ibverbs-xtask` or `~/.cache/ibverbs-xtask`.
pub fn cache_root() -> PathBuf {
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into())).join(".cache"),
    };
    base.join("ibverbs-xtask")
}

/// The newest installed kernel whose modules include `rdma_rxe`: its `/boot/vmlinuz-*` and version.
pub fn find_kernel() -> Result<(PathBuf, String), String> {
    let mut found = Vec::new();
    let entries = fs::read_dir("/boot").map_err(|e| format!("reading /boot: {e}"))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(version) = name.strip_prefix("vmlinuz-") else { continue };
        let dep = fs::read_to_string(format!("/lib/modules/{version}/modules.dep")).unwrap_or_default();
        if dep.contains("/rdma_rxe.ko") {
            found.push((entry.path(), version.to_string()));
        }
    }
    found.sort_by(|a, b| version_cmp(&a.1, &b.1));
    found.pop().ok_or_else(|| {
        "no kernel in /boot with the rdma_rxe module in /lib/modules/<version> (is linux-image-amd64 installed?)"
            .to_string()
    })
}

/// Compares kernel versions by their numeric parts ("6.1.0-57" < "6.1.0-100").
fn version_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let key = |v: &str| -> Vec<u64> {
        v.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect()
    };
    key(a).cmp(&key(b)).then_with(|| a.cmp(b))
}

/// Returns the cached boot files for the chosen kernel ([`select_kernel`]; the newest suitable
/// installed kernel by default), fetching and building them first if needed.
pub fn prepare() -> Result<Image, String> {
    match KERNEL.get() {
        None | Some(KernelChoice::Host) => {
            let (vmlinuz, version) = find_kernel()?;
            prepare_in(&cache_root().join(&version), &vmlinuz, version, None)
        }
        Some(choice) => {
            let package = resolve_kernel_package(choice)?;
            let dir = fetched_kernel_dir(&cache_root(), &package.release);
            let tree = fetch_kernel(&package, &dir)?;
            let vmlinuz = tree.join("boot").join(format!("vmlinuz-{}", package.release));
            prepare_in(&dir, &vmlinuz, package.release, Some(&tree))
        }
    }
}

/// The boot files of kernel `version` (image `vmlinuz`, modules under `root`, `/` if `None`), cached in
/// `dir`: built unless the cache's stamp matches.
fn prepare_in(dir: &Path, vmlinuz: &Path, version: String, root: Option<&Path>) -> Result<Image, String> {
    let modules = root.map(|root| modules_dir(root, &version));
    let image = Image { kernel: dir.join("kernel"), initramfs: dir.join("initramfs.cpio"), version, modules };
    let modules_dep = match &image.modules {
        Some(dir) => dir.join("modules.dep"),
        None => PathBuf::from(format!("/lib/modules/{}/modules.dep", image.version)),
    };
    let stamp = cache_stamp(vmlinuz, &modules_dep)?;
    let stamp_file = dir.join("stamp");
    if image.kernel.is_file()
        && image.initramfs.is_file()
        && fs::read_to_string(&stamp_file).is_ok_and(|s| s == stamp)
    {
        return Ok(image);
    }
    eprintln!("xtask: building the VM's boot files for kernel {} in {}", image.version, dir.display());
    fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let compressed = fs::read(vmlinuz).map_err(|e| format!("reading {}: {e}", vmlinuz.display()))?;
    let kernel = match extract_vmlinux(&compressed) {
        Some(elf) => elf,
        None => {
            eprintln!(
                "xtask: warning: could not extract an ELF vmlinux from {}; booting it compressed (slower)",
                vmlinuz.display()
            );
            compressed
        }
    };
    write_atomic(&image.kernel, &kernel)?;
    write_atomic(&image.initramfs, &build_initramfs(&image.version, root)?)?;
    write_atomic(&stamp_file, stamp.as_bytes())?;
    Ok(image)
}

/// A Debian kernel package to fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelPackage {
    /// Its name (`linux-image-6.12.95+deb12-amd64`).
    pub name: String,
    /// The package version to fetch (`6.12.95-1~bpo12+1`); apt's candidate if `None`.
    pub version: Option<String>,
    /// The suite it comes from, for messages (`bookworm-backports`).
    pub suite: Option<String>,
    /// The kernel version it holds (`uname -r`: `6.12.95+deb12-amd64`).
    pub release: String,
}

/// The cache folder of a fetched kernel: `<cache root>/kernels/<kernel version>`.
pub fn fetched_kernel_dir(cache_root: &Path, release: &str) -> PathBuf {
    cache_root.join("kernels").join(release)
}

/// The module folder of kernel `version` in an unpacked tree (`<root>/lib/modules/<version>`).
pub fn modules_dir(root: &Path, version: &str) -> PathBuf {
    root.join("lib/modules").join(version)
}

/// The kernel version a `linux-image-*` package holds: its name without the prefix (and without
/// `-unsigned`), or `None` for a package of another kind (a meta-package's name has no version).
pub fn package_release(name: &str) -> Option<String> {
    let release = name.strip_prefix("linux-image-")?;
    let release = release.strip_suffix("-unsigned").unwrap_or(release);
    release.starts_with(|c: char| c.is_ascii_digit()).then(|| release.to_string())
}

/// The versions of `apt-cache madison` lines (`name | version | URL suite/component arch Packages`)
/// with their suites, in the order listed.
pub fn parse_madison(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split('|').map(str::trim);
            let (_name, version, source) = (fields.next()?, fields.next()?, fields.next()?);
            let suite = source.split_whitespace().nth(1)?.split('/').next()?;
            (!version.is_empty()).then(|| (version.to_string(), suite.to_string()))
        })
        .collect()
}

/// The newest version of a madison listing ([`parse_madison`]) from a `*-backports` suite.
pub fn newest_backport(listing: &[(String, String)]) -> Option<&(String, String)> {
    listing.iter().filter(|(_, suite)| suite.ends_with("-backports")).max_by(|a, b| version_cmp(&a.0, &b.0))
}

/// The kernel image package a meta-package depends on, from its `apt-cache show` stanza
/// (`Depends: linux-image-6.12.95+deb12-amd64 (= 6.12.95-1~bpo12+1)`).
pub fn image_dependency(show: &str) -> Option<String> {
    let depends = show.lines().find_map(|line| line.strip_prefix("Depends:"))?;
    depends
        .split([',', '|'])
        .filter_map(|dep| dep.split_whitespace().next())
        .find(|name| package_release(name).is_some())
        .map(String::from)
}

/// Runs `apt-cache ARGS` and returns its output, or why it failed.
fn apt_cache(args: &[&str]) -> Result<String, String> {
    let out = Command::new("apt-cache")
        .args(args)
        .output()
        .map_err(|e| format!("running apt-cache (is this a Debian host?): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "apt-cache {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The package of a kernel that is not the host's. `backports`: the newest `linux-image-amd64` that a
/// `*-backports` suite offers (`apt-cache madison`) and the image it depends on (`apt-cache show`).
fn resolve_kernel_package(choice: &KernelChoice) -> Result<KernelPackage, String> {
    match choice {
        KernelChoice::Host => Err("the host's kernel is not fetched".into()),
        KernelChoice::Version(release) => Ok(KernelPackage {
            name: format!("linux-image-{release}"),
            version: None,
            suite: None,
            release: release.clone(),
        }),
        KernelChoice::Backports => {
            let meta = "linux-image-amd64";
            let listing = apt_cache(&["madison", meta])?;
            let parsed = parse_madison(&listing);
            let Some((version, suite)) = newest_backport(&parsed) else {
                return Err(format!(
                    "no backports suite offers {meta}: `apt-cache madison {meta}` lists\n{}\
                     (add e.g. bookworm-backports to apt's sources, as `cargo xtask deps` may have, and \
                     run `apt-get update`)",
                    if listing.trim().is_empty() { "nothing\n".to_string() } else { listing }
                ));
            };
            let show = apt_cache(&["show", &format!("{meta}={version}")])?;
            let name = image_dependency(&show).ok_or(format!(
                "{meta} {version} ({suite}) depends on no linux-image-<version> package: `apt-cache show \
                 {meta}={version}` says\n{show}"
            ))?;
            let release = package_release(&name).expect("image_dependency checked the name");
            Ok(KernelPackage { name, version: Some(version.clone()), suite: Some(suite.clone()), release })
        }
    }
}

/// The unpacked tree of `package` in `dir/root`, fetched first unless complete (its modules indexed)
/// and of the same package version (`dir/package` names what was fetched): `apt-get download` and
/// `dpkg -x` into a folder of this process, `depmod -b`, then a rename.
fn fetch_kernel(package: &KernelPackage, dir: &Path) -> Result<PathBuf, String> {
    let tree = dir.join("root");
    let release = &package.release;
    let spec = match &package.version {
        Some(version) => format!("{}={version}", package.name),
        None => package.name.clone(),
    };
    let package_file = dir.join("package");
    let complete = modules_dir(&tree, release).join("modules.dep").is_file();
    // An explicit kernel version is taken as cached whatever package version brought it.
    if complete && (package.version.is_none() || fs::read_to_string(&package_file).is_ok_and(|s| s == spec)) {
        return Ok(tree);
    }
    let from = package.suite.as_deref().map(|s| format!(" from {s}")).unwrap_or_default();
    eprintln!("xtask: fetching {spec}{from} (apt-get download; not installed) into {}", dir.display());
    let work = dir.join(format!("fetch.tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).map_err(|e| format!("creating {}: {e}", work.display()))?;
    let result = unpack_kernel(&spec, release, &work).and_then(|unpacked| {
        let _ = fs::remove_dir_all(&tree);
        fs::rename(&unpacked, &tree).or_else(|e| {
            // Another process of ours may have put a complete tree there meanwhile.
            if modules_dir(&tree, release).join("modules.dep").is_file() {
                Ok(())
            } else {
                Err(format!("renaming {} to {}: {e}", unpacked.display(), tree.display()))
            }
        })
    });
    let _ = fs::remove_dir_all(&work);
    if result.is_err() {
        let _ = fs::remove_dir(dir); // only if empty: a kernel never fetched leaves no folder
    }
    result?;
    write_atomic(&package_file, spec.as_bytes())?;
    Ok(tree)
}

/// Runs `cmd`; a failure says `what` failed, with the last lines of its output.
fn run_checked(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("running {what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{what} failed ({}):\n{}{}",
        out.status,
        last_lines(&String::from_utf8_lossy(&out.stdout)),
        last_lines(&String::from_utf8_lossy(&out.stderr))
    ))
}

/// Downloads `spec` into `work`, unpacks it into `work/root`, indexes its modules; returns that tree.
fn unpack_kernel(spec: &str, release: &str, work: &Path) -> Result<PathBuf, String> {
    run_checked(
        Command::new("apt-get").args(["download", spec]).current_dir(work),
        &format!(
            "apt-get download {spec} (in {}; are apt's lists current and the mirror reachable?)",
            work.display()
        ),
    )?;
    let deb = fs::read_dir(work)
        .map_err(|e| format!("reading {}: {e}", work.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or(format!("apt-get download {spec} left no .deb in {}", work.display()))?;
    let root = work.join("root");
    run_checked(
        Command::new("dpkg").arg("-x").arg(&deb).arg(&root),
        &format!("dpkg -x {} {}", deb.display(), root.display()),
    )?;
    let _ = fs::remove_file(&deb);
    // A package that ships its modules under /usr/lib only: depmod and modprobe look in <root>/lib.
    if !root.join("lib").exists() && root.join("usr/lib/modules").is_dir() {
        std::os::unix::fs::symlink("usr/lib", root.join("lib"))
            .map_err(|e| format!("linking {}/lib to usr/lib: {e}", root.display()))?;
    }
    for needed in [root.join(format!("boot/vmlinuz-{release}")), modules_dir(&root, release)] {
        if !needed.exists() {
            return Err(format!("{spec} has no {} (is it a kernel of version {release}?)", needed.display()));
        }
    }
    run_checked(
        Command::new("depmod").arg("-b").arg(&root).arg(release),
        &format!("depmod -b {} {release}", root.display()),
    )?;
    Ok(root)
}

/// Bump to rebuild every cached siw module after a change of how it is built.
const SIW_LAYOUT_VERSION: u32 = 1;

/// The soft-iWARP module built for the VM's kernel (Debian's kernel ships without it).
#[derive(Debug, Clone)]
pub struct SiwModule {
    /// `siw.ko`, in the cache folder of the kernel (next to `kernel` and `initramfs.cpio`).
    pub path: PathBuf,
    /// The modules it needs loaded first (`modinfo -F depends`), e.g. `ib_core`, `libcrc32c`.
    pub depends: Vec<String>,
}

/// The kernel source tarball Debian's `linux-source-X.Y` ships for kernel `version` ("6.1.0-57-amd64"
/// → `/usr/src/linux-source-6.1.tar.xz`), and the folder name inside it.
pub fn kernel_source(version: &str) -> (PathBuf, String) {
    let mut parts = version.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().unwrap_or("");
    let minor = parts.next().unwrap_or("");
    let name = format!("linux-source-{major}.{minor}");
    (PathBuf::from(format!("/usr/src/{name}.tar.xz")), name)
}

/// Returns the cached `siw.ko` for kernel `version`, building it first when missing or stale: the
/// module's sources are extracted from Debian's `linux-source` tarball (only
/// `drivers/infiniband/sw/siw/`) and built out of tree against `linux-headers-<version>`
/// (`make -C /lib/modules/<version>/build M=<dir> CONFIG_RDMA_SIW=m modules`). The packages are
/// installed first if missing (as root; otherwise the `apt-get install` line is printed).
///
/// The cache (`siw.ko`, `siw.depends`, `siw.stamp` in the kernel's cache folder) is keyed on the
/// source tarball, the headers (`Module.symvers`, `.config`), the kernel's modules and image, so a new
/// kernel or source package rebuilds it. The boot files' own stamp is not involved.
pub fn prepare_siw(version: &str) -> Result<SiwModule, String> {
    let dir = cache_root().join(version);
    let path = dir.join("siw.ko");
    let depends_file = dir.join("siw.depends");
    let stamp_file = dir.join("siw.stamp");
    let parse_depends = |text: &str| {
        text.split([',', ' ', '\n']).filter(|s| !s.is_empty()).map(String::from).collect::<Vec<_>>()
    };
    if let Ok(stamp) = siw_stamp(version) {
        if path.is_file() && fs::read_to_string(&stamp_file).is_ok_and(|s| s == stamp) {
            if let Ok(depends) = fs::read_to_string(&depends_file) {
                return Ok(SiwModule { path, depends: parse_depends(&depends) });
            }
        }
    }
    crate::prereq::ensure_packages(&crate::prereq::siw_packages(version), false, &[])?;
    let stamp = siw_stamp(version)?;
    let (tarball, top) = kernel_source(version);
    eprintln!("xtask: building the siw module for kernel {version} from {}", tarball.display());
    fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let work = dir.join(format!("siw-build.tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).map_err(|e| format!("creating {}: {e}", work.display()))?;
    let result = build_siw(version, &tarball, &top, &work);
    let built = result.and_then(|ko| {
        let out = Command::new("modinfo")
            .args(["-F", "depends"])
            .arg(&ko)
            .output()
            .map_err(|e| format!("running modinfo (is kmod installed?): {e}"))?;
        if !out.status.success() {
            return Err(format!("modinfo -F depends {} failed", ko.display()));
        }
        let depends = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let data = fs::read(&ko).map_err(|e| format!("reading {}: {e}", ko.display()))?;
        write_atomic(&path, &data)?;
        write_atomic(&depends_file, depends.as_bytes())?;
        write_atomic(&stamp_file, stamp.as_bytes())?;
        Ok(parse_depends(&depends))
    });
    let _ = fs::remove_dir_all(&work);
    Ok(SiwModule { path, depends: built? })
}

/// Extracts siw's sources into `work` and builds them; returns the built `siw.ko`.
fn build_siw(version: &str, tarball: &Path, top: &str, work: &Path) -> Result<PathBuf, String> {
    let sub = "drivers/infiniband/sw/siw";
    run_checked(
        Command::new("tar").arg("-xJf").arg(tarball).arg("-C").arg(work).arg(format!("{top}/{sub}")),
        &format!("tar -xJf {} {top}/{sub}", tarball.display()),
    )?;
    let src = work.join(top).join(sub);
    run_checked(
        Command::new("make")
            .arg("-C")
            .arg(format!("/lib/modules/{version}/build"))
            .arg(format!("M={}", src.display()))
            .args(["CONFIG_RDMA_SIW=m", "modules"]),
        &format!("make -C /lib/modules/{version}/build M={} CONFIG_RDMA_SIW=m modules", src.display()),
    )?;
    Ok(src.join("siw.ko"))
}

/// The last lines of a build's output, for an error message.
fn last_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = lines[lines.len().saturating_sub(20)..].join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    out
}

/// What a cached siw module was built from.
fn siw_stamp(version: &str) -> Result<String, String> {
    let meta = |p: &Path| -> Result<String, String> {
        let m = fs::metadata(p).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(format!("{} size={} mtime={}", p.display(), m.len(), m.mtime()))
    };
    let build = format!("/lib/modules/{version}/build");
    Ok(format!(
        "siw-layout={SIW_LAYOUT_VERSION}\nsource={}\nsymvers={}\nconfig={}\nmodules={}\nkernel={}\n",
        meta(&kernel_source(version).0)?,
        meta(Path::new(&format!("{build}/Module.symvers")))?,
        meta(Path::new(&format!("{build}/.config")))?,
        meta(Path::new(&format!("/lib/modules/{version}/modules.dep")))?,
        meta(Path::new(&format!("/boot/vmlinuz-{version}")))?,
    ))
}

/// What the cached files were built from; a different stamp means they are stale.
fn cache_stamp(vmlinuz: &Path, modules_dep: &Path) -> Result<String, String> {
    let meta = |p: &Path| -> Result<String, String> {
        let m = fs::metadata(p).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(format!("{} size={} mtime={}", p.display(), m.len(), m.mtime()))
    };
    Ok(format!(
        "layout={LAYOUT_VERSION}\nkernel={}\nmodules={}\nbusybox={}\ninit={:016x}\nmodule-list={}\n",
        meta(vmlinuz)?,
        meta(modules_dep)?,
        meta(Path::new(BUSYBOX))?,
        fnv1a(INIT_SCRIPT.as_bytes()),
        MODULES.join(" "),
    ))
}

/// 64-bit FNV-1a: a hash that stays the same across Rust versions (unlike `DefaultHasher`).
pub fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Writes `path` through a temporary file and a rename, so a concurrent reader never sees half of it.
/// The temporary file's name is the process's and the call's own: two guests of one process
/// preparing a cold cache at once (the two-host stage alone) write files of their own.
fn write_atomic(path: &Path, data: &[u8]) -> Result<(), String> {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}.{call}", std::process::id()));
    fs::write(&tmp, data).and_then(|()| fs::rename(&tmp, path)).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        format!("writing {}: {e}", path.display())
    })
}

/// Every offset at which `needle` occurs in `haystack`.
pub fn find_all<'a>(haystack: &'a [u8], needle: &'a [u8]) -> impl Iterator<Item = usize> + 'a {
    haystack.windows(needle.len()).enumerate().filter(move |(_, w)| *w == needle).map(|(i, _)| i)
}

/// The ELF vmlinux inside a bzImage whose payload is xz-compressed (Debian 12's 6.1) or
/// zstd-compressed (its 6.12), like the kernel's `scripts/extract-vmlinux`: tries `xz -d` at each xz
/// magic, then `zstd -d` at each zstd magic, until the output is an ELF file.
pub fn extract_vmlinux(bzimage: &[u8]) -> Option<Vec<u8>> {
    let xz = find_all(bzimage, XZ_MAGIC).map(|offset| (&["xz", "-dc", "--single-stream"][..], offset));
    let zstd = find_all(bzimage, ZSTD_MAGIC).map(|offset| (&["zstd", "-dc"][..], offset));
    xz.chain(zstd).find_map(|(argv, offset)| {
        let out = pipe_through(argv, &bzimage[offset..]).ok()?;
        out.starts_with(b"\x7fELF").then_some(out)
    })
}

/// Runs `argv` with `input` on stdin and returns its stdout (whatever its exit status: `xz` complains
/// about trailing data after the stream it decompressed).
fn pipe_through(argv: &[&str], input: &[u8]) -> Result<Vec<u8>, String> {
    let mut child = Command::new(argv[0])
        .args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("running {}: {e}", argv[0]))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let out = std::thread::scope(|s| {
        s.spawn(move || {
            // A decompressor may stop reading early (end of stream): a broken pipe is fine.
            let _ = stdin.write_all(input);
        });
        child.wait_with_output()
    });
    Ok(out.map_err(|e| format!("running {}: {e}", argv[0]))?.stdout)
}

/// One `insmod` of `modprobe --show-depends`: the module file and its parameters.
#[derive(Debug, PartialEq, Eq)]
pub struct Insmod {
    /// Absolute path of the `.ko` (maybe compressed: `.ko.xz`, `.ko.zst`, `.ko.gz`).
    pub path: String,
    /// Parameters modprobe would pass (e.g. `numdummies=0`), space-separated.
    pub params: String,
}

/// Parses the output of `modprobe --show-depends` (`insmod PATH PARAMS...` lines; `builtin NAME` lines
/// are modules built into the kernel and need nothing).
pub fn parse_show_depends(text: &str) -> Vec<Insmod> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("insmod")).then_some(())?;
            let path = words.next()?.to_string();
            Some(Insmod { path, params: words.collect::<Vec<_>>().join(" ") })
        })
        .collect()
}

/// The modules to load in order (each once), with their parameters; from the tree `root` (`modprobe -d`)
/// when given.
fn module_plan(version: &str, root: Option<&Path>) -> Result<Vec<Insmod>, String> {
    let mut plan: Vec<Insmod> = Vec::new();
    for module in MODULES {
        // One module per call: further names would be taken as its parameters.
        let mut modprobe = Command::new("modprobe");
        if let Some(root) = root {
            modprobe.arg("-d").arg(root);
        }
        let out = modprobe
            .args(["-S", version, "--show-depends", module])
            .output()
            .map_err(|e| format!("running modprobe (is kmod installed?): {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "modprobe -S {version} --show-depends {module} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        for insmod in parse_show_depends(&String::from_utf8_lossy(&out.stdout)) {
            if !plan.iter().any(|p| p.path == insmod.path) {
                plan.push(insmod);
            }
        }
    }
    Ok(plan)
}

/// Reads a module file, decompressing `.ko.xz`, `.ko.zst` and `.ko.gz` (busybox's insmod takes plain
/// `.ko` only). Returns the plain file name and its contents.
fn read_module(path: &str) -> Result<(String, Vec<u8>), String> {
    let data = fs::read(path).map_err(|e| format!("reading {path}: {e}"))?;
    let base = path.rsplit('/').next().unwrap_or(path);
    for (ext, argv) in [(".xz", ["xz", "-dc"]), (".zst", ["zstd", "-dc"]), (".gz", ["gzip", "-dc"])] {
        if let Some(plain) = base.strip_suffix(ext) {
            let out = pipe_through(&argv, &data)?;
            if out.is_empty() {
                return Err(format!("could not decompress {path} with {}", argv[0]));
            }
            return Ok((plain.to_string(), out));
        }
    }
    Ok((base.to_string(), data))
}

/// Builds the initramfs: `/init`, `/bin/busybox`, `/dev/console`, `/lib/modules/*.ko` and
/// `/etc/modules.load` (`file params` lines in load order). The modules come from the tree `root` when
/// given, the host's `/lib/modules` otherwise.
fn build_initramfs(version: &str, root: Option<&Path>) -> Result<Vec<u8>, String> {
    let mut cpio = Cpio::default();
    for dir in ["bin", "dev", "etc", "lib", "lib/modules"] {
        cpio.dir(dir);
    }
    cpio.char_device("dev/console", 5, 1);
    cpio.file("init", 0o755, INIT_SCRIPT.as_bytes());
    let busybox =
        fs::read(BUSYBOX).map_err(|e| format!("reading {BUSYBOX} (is busybox-static installed?): {e}"))?;
    cpio.file("bin/busybox", 0o755, &busybox);
    let mut load = String::new();
    for insmod in module_plan(version, root)? {
        let (name, data) = read_module(&insmod.path)?;
        cpio.file(&format!("lib/modules/{name}"), 0o644, &data);
        load.push_str(&format!("{name} {}\n", insmod.params));
    }
    cpio.file("etc/modules.load", 0o644, load.as_bytes());
    Ok(cpio.finish())
}

/// A writer of the cpio "newc" format, the one the kernel unpacks as an initramfs.
#[derive(Debug, Default)]
pub struct Cpio {
    buf: Vec<u8>,
    next_ino: u32,
}

impl Cpio {
    /// Adds a directory (mode 0755).
    pub fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, 0, 0, &[]);
    }

    /// Adds a regular file with permission bits `perm`.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | perm, 0, 0, data);
    }

    /// Adds a character device node (mode 0600).
    pub fn char_device(&mut self, name: &str, major: u32, minor: u32) {
        self.entry(name, 0o020_600, major, minor, &[]);
    }

    fn entry(&mut self, name: &str, mode: u32, rdev_major: u32, rdev_minor: u32, data: &[u8]) {
        self.next_ino += 1;
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        let fields = [
            self.next_ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            u32::try_from(data.len()).expect("initramfs member under 4 GiB"),
            0, // devmajor
            0, // devminor
            rdev_major,
            rdev_minor,
            u32::try_from(name.len() + 1).expect("short name"),
            0, // check
        ];
        self.buf.extend_from_slice(b"070701");
        for field in fields {
            self.buf.extend_from_slice(format!("{field:08X}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while self.buf.len() % 4 != 0 {
            self.buf.push(0);
        }
    }

    /// Appends the trailer and returns the archive.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 0, 0, &[]);
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_occurrence() {
        assert_eq!(find_all(b"abXYabXYab", b"ab").collect::<Vec<_>>(), [0, 4, 8]);
        assert_eq!(find_all(b"aaa", b"aa").collect::<Vec<_>>(), [0, 1]);
        assert_eq!(find_all(b"abc", b"xyz").count(), 0);
        assert_eq!(find_all(b"ab", b"abc").count(), 0);
    }

    #[test]
    fn extracts_an_elf_after_a_false_magic_and_before_trailing_garbage() {
        let elf = b"\x7fELF\x02\x01\x01 pretend this is a kernel".repeat(100);
        let xz = pipe_through(&["xz", "-c", "--check=crc32"], &elf).unwrap();
        assert!(xz.starts_with(XZ_MAGIC));
        let mut bzimage = b"MZ boot sector ".to_vec();
        bzimage.extend_from_slice(XZ_MAGIC); // a magic that opens no valid stream
        bzimage.extend_from_slice(b"junk");
        bzimage.extend_from_slice(&xz);
        bzimage.extend_from_slice(b"trailing setup data");
        assert_eq!(extract_vmlinux(&bzimage).as_deref(), Some(&elf[..]));
        assert_eq!(extract_vmlinux(b"MZ no payload"), None);
    }

    #[test]
    fn extracts_a_zstd_compressed_elf() {
        // Debian's 6.12 kernels are zstd-compressed; skip where zstd is missing.
        let elf = b"\x7fELF\x02\x01\x01 pretend this is a 6.12 kernel".repeat(100);
        let Ok(zst) = pipe_through(&["zstd", "-c"], &elf) else { return };
        if !zst.starts_with(ZSTD_MAGIC) {
            return;
        }
        let mut bzimage = b"MZ boot sector ".to_vec();
        bzimage.extend_from_slice(ZSTD_MAGIC); // a magic that opens no valid frame
        bzimage.extend_from_slice(b"junk");
        bzimage.extend_from_slice(&zst);
        bzimage.extend_from_slice(b"trailing setup data");
        assert_eq!(extract_vmlinux(&bzimage).as_deref(), Some(&elf[..]));
    }

    #[test]
    fn extracts_the_installed_kernel() {
        // Only where a kernel is installed (the harness's prerequisites).
        let Ok((vmlinuz, _)) = find_kernel() else { return };
        let Ok(data) = fs::read(vmlinuz) else { return };
        let elf = extract_vmlinux(&data).expect("an ELF vmlinux inside the installed kernel");
        assert!(elf.len() > data.len());
    }

    #[test]
    fn parses_show_depends() {
        let text = "insmod /lib/modules/6.1/kernel/net/ipv4/udp_tunnel.ko \n\
                    builtin crc32\n\
                    insmod /lib/modules/6.1/kernel/drivers/net/dummy.ko.xz numdummies=0 \n";
        assert_eq!(
            parse_show_depends(text),
            [
                Insmod {
                    path: "/lib/modules/6.1/kernel/net/ipv4/udp_tunnel.ko".into(),
                    params: String::new()
                },
                Insmod {
                    path: "/lib/modules/6.1/kernel/drivers/net/dummy.ko.xz".into(),
                    params: "numdummies=0".into()
                },
            ]
        );
    }

    #[test]
    fn finds_the_kernel_source_of_a_version() {
        assert_eq!(
            kernel_source("6.1.0-57-amd64"),
            (PathBuf::from("/usr/src/linux-source-6.1.tar.xz"), "linux-source-6.1".to_string())
        );
        assert_eq!(kernel_source("6.12.9+bpo-amd64").1, "linux-source-6.12");
    }

    #[test]
    fn parses_kernel_choices() {
        assert_eq!(KernelChoice::parse("host"), Some(KernelChoice::Host));
        assert_eq!(KernelChoice::parse("backports"), Some(KernelChoice::Backports));
        assert_eq!(
            KernelChoice::parse("6.12.95+deb12-amd64"),
            Some(KernelChoice::Version("6.12.95+deb12-amd64".into()))
        );
        for bad in ["", "latest", "6", "6.12 x", "../6.12", "6.12/x", "-6.12"] {
            assert_eq!(KernelChoice::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn finds_the_newest_backported_kernel() {
        // `apt-cache madison linux-image-amd64` on a Debian 12 host with bookworm-backports.
        let listing = "\
linux-image-amd64 | 6.12.95-1~bpo12+1 | http://deb.debian.org/debian bookworm-backports/main amd64 Packages
linux-image-amd64 |  6.1.192-3 | http://deb.debian.org/debian-security bookworm-security/main amd64 Packages
linux-image-amd64 |  6.1.176-1 | http://deb.debian.org/debian bookworm/main amd64 Packages
";
        let parsed = parse_madison(listing);
        assert_eq!(parsed.len(), 3);
        assert_eq!(parsed[1], ("6.1.192-3".to_string(), "bookworm-security".to_string()));
        assert_eq!(
            newest_backport(&parsed),
            Some(&("6.12.95-1~bpo12+1".to_string(), "bookworm-backports".to_string()))
        );
        // Listed in any order, the newest backport wins; none without a backports suite.
        let two = [
            ("6.12.9-1~bpo12+1".to_string(), "bookworm-backports".to_string()),
            ("6.12.30-1~bpo12+1".to_string(), "bookworm-backports".to_string()),
        ];
        assert_eq!(newest_backport(&two).map(|v| v.0.as_str()), Some("6.12.30-1~bpo12+1"));
        assert_eq!(newest_backport(&parsed[1..]), None);
        assert_eq!(parse_madison(""), []);
    }

    #[test]
    fn finds_the_image_a_meta_package_depends_on() {
        let show = "Package: linux-image-amd64\nSource: linux-signed-amd64 (6.12.95+1~bpo12+1)\n\
                    Version: 6.12.95-1~bpo12+1\n\
                    Depends: linux-image-6.12.95+deb12-amd64 (= 6.12.95-1~bpo12+1)\n\
                    Description: Linux for 64-bit PCs (meta-package)\n";
        assert_eq!(image_dependency(show).as_deref(), Some("linux-image-6.12.95+deb12-amd64"));
        assert_eq!(
            image_dependency("Depends: foo, linux-image-6.1.0-57-amd64-unsigned (= 1) | bar\n").as_deref(),
            Some("linux-image-6.1.0-57-amd64-unsigned")
        );
        assert_eq!(image_dependency("Depends: linux-image-amd64, foo\n"), None);
        assert_eq!(image_dependency("Package: x\n"), None);
    }

    #[test]
    fn names_a_fetched_kernel_and_its_cache() {
        assert_eq!(
            package_release("linux-image-6.12.95+deb12-amd64").as_deref(),
            Some("6.12.95+deb12-amd64")
        );
        assert_eq!(
            package_release("linux-image-6.12.95+deb12-amd64-unsigned").as_deref(),
            Some("6.12.95+deb12-amd64")
        );
        assert_eq!(package_release("linux-image-amd64"), None);
        assert_eq!(package_release("linux-headers-6.12.95+deb12-amd64"), None);
        let dir = fetched_kernel_dir(Path::new("/c/ibverbs-xtask"), "6.12.95+deb12-amd64");
        assert_eq!(dir, Path::new("/c/ibverbs-xtask/kernels/6.12.95+deb12-amd64"));
        assert_eq!(
            modules_dir(&dir.join("root"), "6.12.95+deb12-amd64"),
            Path::new("/c/ibverbs-xtask/kernels/6.12.95+deb12-amd64/root/lib/modules/6.12.95+deb12-amd64")
        );
    }

    #[test]
    fn orders_kernel_versions_numerically() {
        use std::cmp::Ordering::Less;
        assert_eq!(version_cmp("6.1.0-57-amd64", "6.1.0-100-amd64"), Less);
        assert_eq!(version_cmp("5.10.0-30-amd64", "6.1.0-1-amd64"), Less);
    }

    #[test]
    fn fnv1a_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn cpio_newc_is_readable_by_cpio() {
        let mut cpio = Cpio::default();
        cpio.dir("d");
        cpio.file("d/f", 0o644, b"hello");
        cpio.file("x", 0o755, b"");
        let archive = cpio.finish();
        assert_eq!(archive.len() % 4, 0);
        assert!(archive.starts_with(b"070701"));
        if let Ok(list) = pipe_through(&["cpio", "-it", "--quiet"], &archive) {
            // `cpio` is one of the harness's prerequisites; skip this part where it is missing.
            if !list.is_empty() {
                assert_eq!(String::from_utf8_lossy(&list), "d\nd/f\nx\n");
            }
        }
    }
}
