//! Provider and kernel bugs that safe code could reach, and how the crate steers around them.
//!
//! A safe binding must not lose completions or crash the machine on the providers and kernels its
//! users run, bugs included. Each quirk here is found once per [`Context`](crate::Context), from the
//! device's vendor ID and the running kernel's version, and read where the crate takes the path that
//! would trip it. What each costs and why is in [the guide's chapter](crate::guide::device_bugs).
//!
//! This module sits at the bottom of the crate: it imports nothing of it but the raw bindings.

/// rxe's vendor ID (`RXE_VENDOR_ID`, 0xffffff, in Linux's `rxe_param.h`; rxe sets no other).
pub(crate) const RXE_VENDOR_ID: u32 = 0x00ff_ffff;

/// The first rdma-core release whose rxe provider's `ibv_next_poll` no longer corrupts the CQ at
/// its end. `None`: no release is known to have the fix (rdma-core 44, Debian 12's, has the bug,
/// measured; upstream's fix of the double advance was an open pull request when this was
/// written), so every version is treated as affected. Set it once a release is measured fixed.
pub(crate) const RXE_EX_POLL_FIXED: Option<u32> = None;

/// The first kernel whose rxe no longer panics on a local invalidation of a window a peer's Send
/// with Invalidate already invalidated. `None`: no kernel measured fixed yet (6.1.0-57 and
/// 6.12.95 both panic, measured), every rxe kernel is treated as affected.
pub(crate) const RXE_MW_INVALIDATE_FIXED: Option<(u32, u32)> = None;

/// What the crate steers around on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Quirks {
    /// The provider's `ibv_next_poll` that finds the CQ empty must not be followed by its
    /// `ibv_end_poll`, although `ibv_create_cq_ex(3)` says it must. rdma-core's rxe provider
    /// (every release known: see [`RXE_EX_POLL_FIXED`]) stores the consumer
    /// index and unlocks in `next_poll` on `ENOENT`, then advances the index and unlocks again in
    /// `end_poll`: the consumer passes the producer, and every later poll returns stale or zeroed
    /// "successful" entries (`wr_id` 0) while real completions are skipped. The crate then
    /// polls one completion per `start_poll`/`end_poll` and never calls `next_poll`.
    pub(crate) ex_poll_one_per_start: bool,
    /// A local invalidation (`IBV_WR_LOCAL_INV`) of a type 2 window that is no longer valid
    /// dereferences NULL in the kernel and panics it. Linux's rxe (`rxe_invalidate_mw`, 6.1)
    /// refuses only windows in state INVALID, but invalidation leaves them FREE: a second
    /// invalidation, e.g. a local one after a peer's Send with Invalidate, calls `rxe_put()` on
    /// the NULL queue pair and region pointers. A peer may invalidate at any moment and rxe reports
    /// it with the wrong `wc_flags` bit, so the crate cannot know in time: on such kernels safe
    /// code cannot post a local invalidation of a type 2 window at all
    /// ([`SendRequest::local_invalidate`](crate::SendRequest::local_invalidate) says
    /// [`Error::Unsupported`](crate::Error::Unsupported));
    /// [`BoundWindow::revoke`](crate::BoundWindow::revoke) ends the window's access instead.
    pub(crate) mw_local_invalidate_panics: bool,
    /// `ibv_destroy_qp` of a queue pair that a type 2 window is still bound through waits in the
    /// kernel for the window's reference on the queue pair: Linux's rxe takes one per type 2 bind
    /// (`rxe_do_bind_mw`) and drops it only at the window's invalidation or deallocation, and
    /// `__rxe_cleanup` waits (about 51 s per queue pair on 6.1, measured), warns, then frees the
    /// queue pair anyway, which the window's later deallocation then touches. The crate defers such a queue pair's destruction
    /// until its windows are gone (`memory/hold.rs`): every drop order returns at once.
    pub(crate) destroy_qp_waits_for_type2_windows: bool,
}

impl Quirks {
    /// The quirks of a device with `vendor_id` (`None` when the query failed) on an iWARP
    /// (`iwarp`) or other transport, under the kernel `release` (`uname -r`) and rdma-core
    /// `rdma_core` (its major version, `None` when unknown). Unknown versions count as affected.
    pub(crate) fn of(vendor_id: Option<u32>, iwarp: bool, release: &str, rdma_core: Option<u32>) -> Quirks {
        // A failed query: the workarounds are safe on any device, skipping them is not.
        let rxe = !iwarp && vendor_id.map_or(true, |v| v == RXE_VENDOR_ID);
        let kernel_fixed = match (RXE_MW_INVALIDATE_FIXED, kernel_version(release)) {
            (Some(fixed), Some(running)) => running >= fixed,
            _ => false,
        };
        let provider_fixed = match (RXE_EX_POLL_FIXED, rdma_core) {
            (Some(fixed), Some(running)) => running >= fixed,
            _ => false,
        };
        Quirks {
            ex_poll_one_per_start: rxe && !provider_fixed,
            mw_local_invalidate_panics: rxe && !kernel_fixed,
            destroy_qp_waits_for_type2_windows: rxe,
        }
    }
}

/// The (major, minor) of a kernel release string (`6.1.0-57-amd64` → (6, 1)).
pub(crate) fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// rdma-core's major version from the file name of the libibverbs a process loaded:
/// `libibverbs.so.1.<ABI minor>.<rdma-core major>.<rdma-core minor>` (rdma-core's build names its
/// libraries so; `libibverbs.so.1.14.44.0` is rdma-core 44.0).
pub(crate) fn rdma_core_from_file_name(name: &str) -> Option<u32> {
    let rest = name.rsplit('/').next()?.strip_prefix("libibverbs.so.1.")?;
    let mut parts = rest.split('.');
    let _abi_minor: u32 = parts.next()?.parse().ok()?;
    parts.next()?.parse().ok()
}

/// The rdma-core major version of the libibverbs this process runs with: the real file behind
/// the library that holds `ibv_get_device_list` (`dladdr()`, then the symbolic links resolved).
pub(crate) fn rdma_core_version() -> Option<u32> {
    // SAFETY: `Dl_info` is plain pointers; dladdr() fills it for an address of a loaded object.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    #[cfg(not(feature = "dlopen"))]
    let addr = ibverbs_sys::ibv_get_device_list as *const libc::c_void;
    // Loaded at run time: the function of the bindings is ours, the library's is in its table.
    #[cfg(feature = "dlopen")]
    let addr = ibverbs_sys::function_address("ibv_get_device_list")?;
    // SAFETY: a valid address (a function of the linked libibverbs) and out-pointer.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr() returned a NUL-terminated name that lives while the object is loaded.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    let real = std::fs::canonicalize(&name).ok()?;
    rdma_core_from_file_name(&real.to_string_lossy())
}

/// The running kernel's release and the loaded rdma-core's major version ([`kernel_release`],
/// [`rdma_core_version`]): the same for every context of the process, so read once.
pub(crate) fn running_versions() -> &'static (String, Option<u32>) {
    static RUNNING: std::sync::OnceLock<(String, Option<u32>)> = std::sync::OnceLock::new();
    RUNNING.get_or_init(|| (kernel_release(), rdma_core_version()))
}

/// The running kernel's release (`uname -r`), or "" when `uname()` fails.
pub(crate) fn kernel_release() -> String {
    // SAFETY: `utsname` is plain bytes; uname() fills it or fails.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    if unsafe { libc::uname(&mut u) } != 0 {
        return String::new();
    }
    // SAFETY: uname() NUL-terminates `release` within the array.
    unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions() {
        assert_eq!(kernel_version("6.1.0-57-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("6.12.48+deb12-amd64"), Some((6, 12)));
        assert_eq!(kernel_version("5.15"), Some((5, 15)));
        assert_eq!(kernel_version("garbage"), None);
        assert_eq!(kernel_version(""), None);
    }

    #[test]
    fn rxe_and_others() {
        let rxe = Quirks::of(Some(RXE_VENDOR_ID), false, "6.1.0-57-amd64", Some(44));
        assert!(rxe.ex_poll_one_per_start && rxe.mw_local_invalidate_panics);
        let mlx5 = Quirks::of(Some(0x02c9), false, "6.1.0-57-amd64", Some(44));
        assert_eq!(mlx5, Quirks::default());
        // siw (iWARP) is not rxe, whatever its vendor ID.
        assert_eq!(Quirks::of(Some(0x0062_6d74), true, "6.1.0", Some(44)), Quirks::default());
        // A failed query or unknown versions take the safe side.
        assert!(Quirks::of(None, false, "6.1.0", Some(44)).mw_local_invalidate_panics);
        assert!(!Quirks::of(None, true, "6.1.0", Some(44)).mw_local_invalidate_panics);
        assert!(Quirks::of(Some(RXE_VENDOR_ID), false, "", None).ex_poll_one_per_start);
    }

    #[test]
    fn rdma_core_versions_from_library_file_names() {
        assert_eq!(rdma_core_from_file_name("/usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0"), Some(44));
        assert_eq!(rdma_core_from_file_name("libibverbs.so.1.15.56.1"), Some(56));
        assert_eq!(rdma_core_from_file_name("/usr/lib/libibverbs.so.1"), None);
        assert_eq!(rdma_core_from_file_name("/usr/lib/librdmacm.so.1.3.44.0"), None);
    }
}
