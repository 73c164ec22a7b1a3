//! `fork()` in a process that uses RDMA (`ibv_fork_init`, `ibv_is_fork_initialized`).
//!
//! Registered memory is pinned for the device. Before Linux 5.13, a `fork()` made those pages
//! copy-on-write in the parent, so the parent's next write moved its data to a new page while
//! the device kept using the old one: silent corruption. rdma-core's old answer is
//! [`fork_init`] (`ibv_fork_init()`, or `RDMAV_FORK_SAFE=1` / `IBV_FORK_SAFE=1` in the
//! environment) before any registration: every region is then marked `MADV_DONTFORK`, so the
//! child has no mapping of registered memory at all (touching it there is a segfault; the child
//! should `exec` soon).
//!
//! Since Linux 5.13 the kernel copies pinned pages into the child at `fork()` instead, so the
//! parent's pages stay where the device expects them, and rdma-core (v35 and later) reports
//! [`ForkSupport::Unneeded`]: nothing to do, `fork` + `exec` (and `std::process::Command`) are
//! safe while transfers run. Either way the child must not use the parent's verbs objects
//! (contexts, queues, regions): they belong to the parent's device file.

use ibverbs_sys as ffi;

use crate::error::{cvt, Result};

/// What `fork()` does to this process's RDMA memory (`enum ibv_fork_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkSupport {
    /// Registrations are not protected: a `fork()` can corrupt transfers on kernels older than
    /// 5.13 (`IBV_FORK_DISABLED`). Call [`fork_init`] before any registration if the process
    /// forks there.
    Disabled,
    /// [`fork_init`] (or `RDMAV_FORK_SAFE`) is in effect: registrations are `MADV_DONTFORK`
    /// (`IBV_FORK_ENABLED`).
    Enabled,
    /// The kernel keeps pinned pages in the parent at `fork()`: nothing is needed
    /// (`IBV_FORK_UNNEEDED`).
    Unneeded,
    /// rdma-core older than v35 cannot tell (no `ibv_is_fork_initialized()`).
    Unknown,
}

/// How `fork()` affects registered memory in this process (`ibv_is_fork_initialized()`).
/// [`ForkSupport::Unknown`] also when libibverbs cannot be loaded (feature `dlopen`).
#[doc(alias = "ibv_is_fork_initialized")]
pub fn fork_support() -> ForkSupport {
    // A call that needs no object: it loads the library (with `dlopen`), which may be older than
    // the headers (v35 added the verb). Linked, it has every function the headers declare.
    #[cfg(ibverbs_has_is_fork_initialized)]
    if ffi::load().is_ok() && ffi::has_function("ibv_is_fork_initialized") {
        // SAFETY: no arguments; reads libibverbs' global state.
        let status = unsafe { ffi::ibv_is_fork_initialized() };
        return match status {
            ffi::ibv_fork_status::IBV_FORK_DISABLED => ForkSupport::Disabled,
            ffi::ibv_fork_status::IBV_FORK_ENABLED => ForkSupport::Enabled,
            ffi::ibv_fork_status::IBV_FORK_UNNEEDED => ForkSupport::Unneeded,
            _ => ForkSupport::Unknown,
        };
    }
    ForkSupport::Unknown
}

/// Makes registrations fork-safe the pre-5.13 way (`ibv_fork_init()`): every region registered
/// afterwards is `MADV_DONTFORK`. Must come before the process registers any memory; on kernels
/// where [`fork_support`] is [`ForkSupport::Unneeded`] it changes nothing.
///
/// Call it at the start of `main`, before any thread exists that could use RDMA. Setting
/// `RDMAV_FORK_SAFE=1` in the environment before the process starts does the same without code.
///
/// # Safety
/// No other thread may be inside libibverbs or librdmacm (through this crate or any other code)
/// during the call. libibverbs reads and writes the state `ibv_fork_init()` sets (its tree of
/// `MADV_DONTFORK` ranges, its "too late" flag) without a lock when any memory is registered or
/// deregistered, and when providers create or destroy queues: a concurrent call is a data race
/// in C, which can leave registered pages without `MADV_DONTFORK` while [`fork_support`] reports
/// [`ForkSupport::Enabled`].
///
/// # Errors
/// [`Error::Verb`](crate::Error::Verb) from the verb (`EINVAL` when memory was registered
/// already, or the kernel lacks `MADV_DONTFORK`); with the `dlopen` feature,
/// [`Error::LibraryMissing`](crate::Error::LibraryMissing) when libibverbs cannot be loaded.
#[doc(alias = "ibv_fork_init")]
pub unsafe fn fork_init() -> Result<()> {
    // A call that needs no object: with `dlopen`, a missing libibverbs becomes an error here.
    ffi::load()?;
    // SAFETY: no arguments; sets libibverbs' global fork mode (it refuses once regions exist),
    // with no other thread in libibverbs (the caller's contract).
    cvt("ibv_fork_init", unsafe { ffi::ibv_fork_init() })
}
