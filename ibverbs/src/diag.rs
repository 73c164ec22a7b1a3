//! Checks of the host's RDMA setup, for messages that point to the fix: device files, kernel
//! modules and the locked-memory limit.
//!
//! The crate's errors use them: a registration refused for the locked-memory limit names
//! `RLIMIT_MEMLOCK` with its value and how to raise it, and "no device" says whether
//! `/dev/infiniband` and the kernel's devices are there. The `doctor` example prints all of it.
//!
//! ```no_run
//! let report = ibverbs::diag::SystemReport::gather();
//! for problem in report.problems() {
//!     eprintln!("problem: {problem}");
//! }
//! ```

use std::ffi::CString;
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The locked-memory limit of this process (`RLIMIT_MEMLOCK`), against which registered memory
/// (and, on most adapters, queue buffers) is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memlock {
    /// The soft limit in bytes (the one enforced); `None`: unlimited.
    pub soft: Option<u64>,
    /// The hard limit in bytes (how far an unprivileged process may raise the soft one);
    /// `None`: unlimited.
    pub hard: Option<u64>,
    /// Whether the process has `CAP_IPC_LOCK`, which lifts the limit (root usually has it).
    pub cap_ipc_lock: bool,
}

impl Memlock {
    /// The limit of this process (`getrlimit(RLIMIT_MEMLOCK)`, `CapEff` of `/proc/self/status`).
    ///
    /// # Errors
    /// The error of `getrlimit()`.
    pub fn current() -> io::Result<Memlock> {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: `lim` is a valid out-pointer.
        if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let limit = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
        Ok(Memlock { soft: limit(lim.rlim_cur), hard: limit(lim.rlim_max), cap_ipc_lock: has_cap_ipc_lock() })
    }

    /// Whether the limit applies to registrations: a finite soft limit and no `CAP_IPC_LOCK`.
    pub fn limits_registration(&self) -> bool {
        self.soft.is_some() && !self.cap_ipc_lock
    }

    /// How to raise the limit, in one sentence.
    pub fn how_to_raise() -> &'static str {
        "raise it with `ulimit -l unlimited` in the shell that starts the program (the hard limit: \
         `* - memlock unlimited` in /etc/security/limits.conf), `LimitMEMLOCK=infinity` for a \
         systemd service, `docker run --ulimit memlock=-1` (or `--cap-add IPC_LOCK`) in containers"
    }
}

impl fmt::Display for Memlock {
    /// E.g. `64 KiB (hard limit 64 KiB)`, `unlimited`, `64 KiB (hard limit unlimited), lifted by
    /// CAP_IPC_LOCK`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: Option<u64>| v.map_or_else(|| "unlimited".to_string(), bytes);
        f.write_str(&show(self.soft))?;
        if self.hard != self.soft {
            write!(f, " (hard limit {})", show(self.hard))?;
        }
        if self.cap_ipc_lock && self.soft.is_some() {
            f.write_str(", lifted by CAP_IPC_LOCK")?;
        }
        Ok(())
    }
}

/// A byte count as `ulimit -l` users think of it: `64 KiB`, `8 MiB`, or bytes.
fn bytes(v: u64) -> String {
    match v {
        v if v >= 1 << 30 && v % (1 << 30) == 0 => format!("{} GiB", v >> 30),
        v if v >= 1 << 20 && v % (1 << 20) == 0 => format!("{} MiB", v >> 20),
        v if v >= 1 << 10 && v % (1 << 10) == 0 => format!("{} KiB", v >> 10),
        v => format!("{v} bytes"),
    }
}

/// Whether `CAP_IPC_LOCK` (bit 14) is in this thread's effective capabilities.
fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    let Ok(status) = fs::read_to_string("/proc/thread-self/status") else { return false };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// Whether a file may be opened for reading and writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileState {
    /// It does not exist.
    Missing,
    /// It exists, but this process may not open it for reading and writing.
    NoAccess,
    /// It exists and may be opened.
    Usable,
}

/// A user-space verbs device: `/sys/class/infiniband_verbs/uverbsN`, the kernel device behind
/// it, and its device file `/dev/infiniband/uverbsN`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UverbsDevice {
    /// The verbs device, e.g. `uverbs0`.
    pub name: String,
    /// The RDMA device it serves, e.g. `rxe0`.
    pub ibdev: String,
    /// The state of `/dev/infiniband/<name>`.
    pub file: FileState,
}

/// Kernel modules worth naming: the RDMA core, user-space access, adapter drivers, GPUDirect.
pub const MODULES: &[&str] = &[
    "ib_core",
    "ib_uverbs",
    "rdma_cm",
    "rdma_ucm",
    "ib_umad",
    "mlx5_ib",
    "mlx4_ib",
    "rdma_rxe",
    "siw",
    "irdma",
    "bnxt_re",
    "efa",
    "erdma",
    "hns_roce_hw_v2",
    "qedr",
    "hfi1",
    "ib_qib",
    "mana_ib",
    "vmw_pvrdma",
    "iw_cxgb4",
    "nvidia_peermem",
];

/// What the host offers for RDMA: device files, the kernel's devices, modules, the memlock limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemReport {
    /// The entries of `/dev/infiniband` (sorted), or `None` when it does not exist.
    pub dev_infiniband: Option<Vec<String>>,
    /// The RDMA devices of the kernel, `/sys/class/infiniband` (sorted), or `None` when it does
    /// not exist (the RDMA core is not loaded).
    pub kernel_devices: Option<Vec<String>>,
    /// Whether `ib_uverbs` is there (`/sys/class/infiniband_verbs` exists).
    pub uverbs_loaded: bool,
    /// The user-space verbs devices and their device files.
    pub uverbs: Vec<UverbsDevice>,
    /// The modules of [`MODULES`] that are loaded (`/sys/module/<name>` exists).
    pub modules: Vec<String>,
    /// This process's locked-memory limit, if it could be read.
    pub memlock: Option<Memlock>,
}

impl SystemReport {
    /// Looks at this host.
    pub fn gather() -> SystemReport {
        SystemReport::gather_at(Path::new("/"))
    }

    /// Looks at the `dev/infiniband` and `sys` trees under `root` (for tests with a fake tree);
    /// the memlock limit is always this process's.
    pub fn gather_at(root: &Path) -> SystemReport {
        let list = |dir: &Path| -> Option<Vec<String>> {
            let mut names: Vec<String> = fs::read_dir(dir)
                .ok()?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            Some(names)
        };
        let verbs_class = root.join("sys/class/infiniband_verbs");
        let uverbs = list(&verbs_class)
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n.starts_with("uverbs"))
            .map(|name| {
                let ibdev = fs::read_to_string(verbs_class.join(&name).join("ibdev"))
                    .map(|s| s.trim_end().to_string())
                    .unwrap_or_default();
                let file = file_state(&root.join("dev/infiniband").join(&name));
                UverbsDevice { name, ibdev, file }
            })
            .collect();
        SystemReport {
            dev_infiniband: list(&root.join("dev/infiniband")),
            kernel_devices: list(&root.join("sys/class/infiniband")),
            uverbs_loaded: verbs_class.is_dir(),
            uverbs,
            modules: MODULES
                .iter()
                .filter(|m| root.join("sys/module").join(m).exists())
                .map(|m| m.to_string())
                .collect(),
            memlock: Memlock::current().ok(),
        }
    }

    /// What stops programs from using the devices, one sentence each naming the fix: missing
    /// kernel support or modules, missing or inaccessible device files, a memlock limit that
    /// applies. Empty when nothing is wrong.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let devices = match &self.kernel_devices {
            None => {
                out.push(
                    "/sys/class/infiniband does not exist: the kernel's RDMA core (ib_core) is not \
                     loaded, or the kernel has no RDMA support; load the adapter's driver (e.g. \
                     `modprobe mlx5_ib`), or for SoftRoCE `modprobe rdma_rxe` and `rdma link add \
                     rxe0 type rxe netdev eth0`"
                        .to_string(),
                );
                &[][..]
            }
            Some(d) if d.is_empty() => {
                out.push(format!(
                    "/sys/class/infiniband is empty: no adapter driver has registered an RDMA \
                     device (modules loaded: {}); load the adapter's driver (e.g. `modprobe \
                     mlx5_ib`), or for SoftRoCE `rdma link add rxe0 type rxe netdev eth0`",
                    self.modules_loaded()
                ));
                &[][..]
            }
            Some(d) => &d[..],
        };
        if !devices.is_empty() && !self.uverbs_loaded {
            out.push(format!(
                "the kernel has {} but ib_uverbs (verbs access from user space) is not loaded: \
                 `modprobe ib_uverbs`",
                devices.join(", ")
            ));
        }
        if !devices.is_empty() && self.uverbs_loaded && self.dev_infiniband.is_none() {
            out.push(format!(
                "/dev/infiniband does not exist, although the kernel has {}: in a container, the \
                 device files were not passed in (`docker run --device=/dev/infiniband/uverbs0 \
                 ...`, or `--device=/dev/infiniband`; on Kubernetes, an RDMA device plugin)",
                devices.join(", ")
            ));
        } else {
            for u in &self.uverbs {
                match u.file {
                    FileState::Missing => out.push(format!(
                        "/dev/infiniband/{} (the device file of {}) is missing: not passed to the \
                         container? (`docker run --device=/dev/infiniband/{}`)",
                        u.name, u.ibdev, u.name
                    )),
                    FileState::NoAccess => out.push(format!(
                        "no read/write access to /dev/infiniband/{} (the device file of {}): run \
                         as a user allowed to (often the `rdma` group) or fix the udev rule",
                        u.name, u.ibdev
                    )),
                    FileState::Usable => {}
                }
            }
        }
        if let Some(m) = self.memlock.filter(|m| m.limits_registration()) {
            if m.soft.is_some_and(|s| s < 64 << 20) {
                out.push(format!(
                    "the locked-memory limit RLIMIT_MEMLOCK is {m}: registered memory counts \
                     against it, so registrations beyond it fail; {}",
                    Memlock::how_to_raise()
                ));
            }
        }
        out
    }

    /// The [`problems`](Self::problems) that keep devices from being opened: all but the
    /// locked-memory limit.
    pub fn device_problems(&self) -> Vec<String> {
        self.problems().into_iter().filter(|p| !p.contains("RLIMIT_MEMLOCK")).collect()
    }

    /// Why libibverbs may have found no device, for "no device" errors: the
    /// [`problems`](Self::problems) other than the memlock limit, or what remains when
    /// everything the kernel shows is in place.
    pub fn no_device_hint(&self) -> String {
        let problems = self.device_problems();
        if !problems.is_empty() {
            return problems.join("; ");
        }
        let devices = self.kernel_devices.as_deref().unwrap_or_default().join(", ");
        format!(
            "the kernel has {devices}, ib_uverbs is loaded and the device files are in \
             /dev/infiniband: libibverbs may lack the provider library for the driver (install \
             rdma-core's ibverbs-providers; `ibv_devices` should list the devices)"
        )
    }

    /// The loaded modules of [`MODULES`], comma separated, or `none`.
    pub fn modules_loaded(&self) -> String {
        if self.modules.is_empty() {
            "none".to_string()
        } else {
            self.modules.join(", ")
        }
    }
}

/// Whether `path` exists and may be opened for reading and writing (`access(R_OK | W_OK)`).
fn file_state(path: &Path) -> FileState {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else { return FileState::Missing };
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::access(c.as_ptr(), libc::R_OK | libc::W_OK) } == 0 {
        return FileState::Usable;
    }
    if path.exists() {
        FileState::NoAccess
    } else {
        FileState::Missing
    }
}

/// What an error message of `verb` failing with `source` adds to point to the fix (empty when
/// nothing): the memlock limit for registrations, the host's setup for "no device".
pub(crate) fn verb_hint(verb: &str, source: &io::Error) -> String {
    let errno = source.raw_os_error().unwrap_or(0);
    match verb {
        "ibv_reg_mr" | "ibv_reg_mr_iova" | "ibv_reg_mr_iova2" | "ibv_reg_dmabuf_mr"
            if errno == libc::ENOMEM || errno == libc::EPERM =>
        {
            Memlock::current().map_or_else(|_| String::new(), |m| registration_hint(&m))
        }
        "ibv_create_cq" | "ibv_create_qp" | "ibv_create_srq" if errno == libc::ENOMEM => {
            match Memlock::current() {
                Ok(m) if m.limits_registration() => format!(
                    " (queue buffers are locked memory on most adapters, and RLIMIT_MEMLOCK is \
                     {m}: {})",
                    Memlock::how_to_raise()
                ),
                _ => String::new(),
            }
        }
        "ibv_get_device_list" => format!(" ({})", SystemReport::gather().no_device_hint()),
        "ibv_open_device" if [libc::ENOENT, libc::EACCES, libc::EPERM, libc::ENXIO].contains(&errno) => {
            let problems = SystemReport::gather().device_problems();
            if problems.is_empty() {
                String::new()
            } else {
                format!(" ({})", problems.join("; "))
            }
        }
        _ => String::new(),
    }
}

/// What a "no device" message adds when no device at all is present (`available` is `none`).
pub(crate) fn not_found_hint(available: &str) -> String {
    if available == "none" {
        format!("; {}", SystemReport::gather().no_device_hint())
    } else {
        String::new()
    }
}

/// What a registration refused with `ENOMEM` or `EPERM` adds to its message under the limit `m`.
fn registration_hint(m: &Memlock) -> String {
    if m.limits_registration() {
        format!(
            " (registered memory is locked memory, and the locked-memory limit \
             RLIMIT_MEMLOCK is {m}: {})",
            Memlock::how_to_raise()
        )
    } else if m.soft.is_some() {
        // siw (Linux 6.1 siw_umem_get) counts registrations against the soft limit whatever
        // the capabilities.
        format!(
            " (RLIMIT_MEMLOCK is {m}: the capability lifts the limit for most drivers, but not \
             for siw, which counts every registration against it; {}. Otherwise the device may \
             be out of memory-region resources, see max_mr and max_mr_size)",
            Memlock::how_to_raise()
        )
    } else {
        format!(
            " (RLIMIT_MEMLOCK is {m}, so the locked-memory limit is not the cause: the device may \
             be out of memory-region resources, see max_mr and max_mr_size)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_registration_names_the_limit_as_it_applies() {
        let lim = |soft: Option<u64>, cap_ipc_lock| Memlock { soft, hard: soft, cap_ipc_lock };
        let limited = registration_hint(&lim(Some(64 << 10), false));
        assert!(
            limited.contains("RLIMIT_MEMLOCK is 64 KiB") && limited.contains("ulimit -l unlimited"),
            "{limited}"
        );
        // The capability: most drivers ignore the limit, siw does not.
        let lifted = registration_hint(&lim(Some(8 << 20), true));
        assert!(lifted.contains("lifted by CAP_IPC_LOCK") && lifted.contains("not for siw"), "{lifted}");
        assert!(lifted.contains("max_mr") && lifted.contains("ulimit -l unlimited"), "{lifted}");
        let unlimited = registration_hint(&lim(None, false));
        assert!(unlimited.contains("not the cause") && !unlimited.contains("siw"), "{unlimited}");
    }

    #[test]
    fn byte_counts_read_like_ulimit() {
        assert_eq!(bytes(65536), "64 KiB");
        assert_eq!(bytes(8 << 20), "8 MiB");
        assert_eq!(bytes(3 << 30), "3 GiB");
        assert_eq!(bytes(1000), "1000 bytes");
        let m = Memlock { soft: Some(65536), hard: Some(65536), cap_ipc_lock: false };
        assert_eq!(m.to_string(), "64 KiB");
        assert!(m.limits_registration());
        let m = Memlock { soft: Some(65536), hard: None, cap_ipc_lock: true };
        assert_eq!(m.to_string(), "64 KiB (hard limit unlimited), lifted by CAP_IPC_LOCK");
        assert!(!m.limits_registration());
        let m = Memlock { soft: None, hard: None, cap_ipc_lock: false };
        assert_eq!(m.to_string(), "unlimited");
        assert!(!m.limits_registration());
    }
}
