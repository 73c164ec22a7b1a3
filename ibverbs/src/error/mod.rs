//! The crate's error type, and the plain data its variants carry: what is wrong with a setting's
//! text ([`ParseError`], in `setting`) and why a port is not usable ([`PortProblem`],
//! [`Rejected`], in `port`); the values it names of devices and queue pairs are in `attr`.

use std::fmt;
use std::io;

mod group;
mod port;
mod setting;

pub use group::RankProblem;
pub use port::{PortProblem, Rejected};
pub use setting::{ParseError, ParseErrorKind};

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a verbs call.
///
/// Each variant names the C verb that failed (or that the crate refused to call) and, where the
/// operating system reported one, carries its error as [`source`](std::error::Error::source).
/// Completion statuses are *not* errors of this type: they are data on a
/// [`WorkCompletion`](crate::WorkCompletion).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A verb returned an error code or `NULL` with `errno` set.
    ///
    /// The message adds what points to the fix where the crate can tell: for a registration
    /// (`ibv_reg_mr`) refused with `ENOMEM` or `EPERM`, the current `RLIMIT_MEMLOCK` and how
    /// to raise it (or that the limit is not the cause); for `ibv_get_device_list` and device
    /// files that cannot be opened, whether `/dev/infiniband` and the kernel modules are there
    /// (see [`diag`](crate::diag)). These are read when the message is formatted.
    #[error("{verb} failed: {source}{}", crate::diag::verb_hint(.verb, .source))]
    Verb {
        /// The C verb, e.g. `"ibv_create_qp"`.
        verb: &'static str,
        /// The OS error it reported.
        #[source]
        source: io::Error,
    },
    /// A post's verb returned an error after the provider had queued the work request(s): its
    /// `bad_wr` named none of them. siw and rxe do this when the system call that rings their
    /// doorbell fails (siw: the queue pair's state lock was held or the queue pair had left RTS).
    ///
    /// The requests stay posted: their buffers are not handed back here (a failed single post's
    /// [`PostError::request`](crate::PostError::request) is left without them), and come back
    /// with their completions, including the flush when the queue pair goes to the error state
    /// ([`QueuePair::set_error`](crate::QueuePair::set_error) or a fault), or when the queue pair is destroyed.
    /// Counting them as not posted would hand back memory the device may still read or write.
    #[error("{verb} failed after the provider queued the work request(s), which stay posted: {source}")]
    QueuedWithError {
        /// `"ibv_post_send"`, `"ibv_post_recv"`, `"ibv_post_srq_recv"` or `"ibv_wr_complete"`.
        verb: &'static str,
        /// The OS error it reported.
        #[source]
        source: io::Error,
    },
    /// No RDMA device of the requested name exists.
    ///
    /// When no device exists at all (`available` is `"none"`), the message says whether
    /// `/dev/infiniband` exists (not passed to the container?), whether the kernel has devices
    /// and modules (`/sys/class/infiniband`, `ib_uverbs`), and how to fix what is missing
    /// ([`SystemReport::no_device_hint`](crate::diag::SystemReport::no_device_hint), read when
    /// the message is formatted).
    #[error("no RDMA device named {name:?} (devices present: {available}){}", crate::diag::not_found_hint(.available))]
    DeviceNotFound {
        /// The name asked for.
        name: String,
        /// The names that do exist, comma separated, or `"none"`.
        available: String,
    },
    /// An argument was rejected before any verb was called.
    #[error("{verb}: invalid argument: {reason}")]
    InvalidArgument {
        /// The C verb that would have been called.
        verb: &'static str,
        /// What was wrong.
        reason: &'static str,
    },
    /// A local slice or remote range lies (partly) outside its memory region.
    #[error("{verb}: range {offset}..{offset}+{len} is outside the region of {size} bytes")]
    OutOfBounds {
        /// The C verb that would have been called.
        verb: &'static str,
        /// Start of the requested range, relative to the region.
        offset: u64,
        /// Length of the requested range.
        len: u64,
        /// Size of the region.
        size: u64,
    },
    /// A post would overfill a work queue: more work requests are outstanding than it holds.
    #[error("{verb}: work queue full ({capacity} work requests outstanding); poll completions first")]
    QueueFull {
        /// `"ibv_post_send"`, `"ibv_post_recv"` or `"ibv_post_srq_recv"`.
        verb: &'static str,
        /// The queue's capacity in work requests.
        capacity: u32,
    },
    /// The queue pair is not in a state that allows the operation (e.g. posting a send before
    /// it reached RTS).
    #[error("{verb}: queue pair is in state {state:?}, needs {expected}")]
    QpState {
        /// The C verb that would have been called.
        verb: &'static str,
        /// The state the queue pair is in.
        state: crate::attr::QpState,
        /// The state(s) the operation needs.
        expected: &'static str,
    },
    /// A typed `ibv_modify_qp()` ([`QueuePair::modify`](crate::QueuePair::modify)) refused
    /// before the verb: the move is not in the queue pair state machine (`attribute` is
    /// `"IBV_QP_STATE"`), or the attribute named (its `ibv_qp_attr_mask` bit) is required by the
    /// move for the queue pair's transport and missing, or not taken by it. Nothing changed.
    #[error("{verb}: {from:?} -> {to:?}: {attribute} {problem}")]
    QpAttribute {
        /// The C verb that would have been called.
        verb: &'static str,
        /// The state the queue pair is in (as its handle knows it).
        from: crate::attr::QpState,
        /// The state asked for.
        to: crate::attr::QpState,
        /// The attribute mask bit at fault, e.g. `"IBV_QP_TIMEOUT"`.
        attribute: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// A completion queue cannot hold every completion its queue pairs could produce at once
    /// (the sum of their work queue sizes): the safe level refuses to let a CQ overflow.
    #[error("{verb}: completion queue of {capacity} entries is too small: its queue pairs need {needed}")]
    CqTooSmall {
        /// The C verb that would have been called.
        verb: &'static str,
        /// Entries needed.
        needed: u64,
        /// Entries the CQ has.
        capacity: u32,
    },
    /// A completion queue already serves the most work queues it can track
    /// (4096; dropped queue pairs are reclaimed when it is polled).
    #[error("{verb}: completion queue serves too many queue pairs")]
    TooManyQueuePairs {
        /// The C verb that would have been called.
        verb: &'static str,
    },
    /// The device lacks a capability the operation needs: found missing in its attributes
    /// before the verb was called (e.g. XRC, memory windows, ODP on SoftRoCE), or refused by the
    /// provider with `EOPNOTSUPP`/`ENOSYS` (e.g. `ibv_rereg_mr` on SoftRoCE). Nothing changed.
    #[error("{verb}: the device does not support {capability}")]
    Unsupported {
        /// The C verb that was (or would have been) called.
        verb: &'static str,
        /// The capability missing, as the C library names it where it has a name (e.g.
        /// `"IBV_DEVICE_XRC"`).
        capability: &'static str,
    },
    /// A send operation that the extended queue pair was not created for (its `send_ops_flags`,
    /// see [`QueuePairBuilder::send_ops`](crate::QueuePairBuilder::send_ops)), or that the
    /// extended posting path (`ibv_wr_*`) has no call for. Refused before anything was posted.
    #[error("{verb}: send operation {op} is not enabled on this extended queue pair")]
    SendOpNotEnabled {
        /// The C verb that would have been called.
        verb: &'static str,
        /// The operation, named by its `IBV_QP_EX_WITH_*` flag.
        op: &'static str,
    },
    /// A bounded wait ended without what it waited for (an RDMA-CM event, a connection).
    #[error("{verb}: timed out after {waited:?}")]
    Timeout {
        /// The C call (or step) whose outcome did not arrive.
        verb: &'static str,
        /// How long the crate waited.
        waited: std::time::Duration,
    },
    /// Private data for an RDMA-CM message is longer than the transport carries; refused before
    /// anything was sent (never truncated).
    #[error("{verb}: private data of {len} bytes is longer than the transport's limit of {max}")]
    PrivateDataTooLong {
        /// `"rdma_connect"`, `"rdma_accept"` or `"rdma_reject"`.
        verb: &'static str,
        /// Bytes given.
        len: usize,
        /// Bytes the message carries.
        max: usize,
    },
    /// A GID table entry could not be read (`ibv_query_gid_ex()`, or `ibv_query_gid()` before
    /// rdma-core v32): the message names the port and index, and what an empty entry
    /// (`ENODATA`) or an index beyond the table (`EINVAL`) usually means.
    #[error("{verb} failed for port {port}, GID index {index}: {source}{}", gid_hint(.source))]
    GidQuery {
        /// `"ibv_query_gid_ex"` or `"ibv_query_gid"`.
        verb: &'static str,
        /// The port asked for.
        port: u8,
        /// The GID index asked for.
        index: u32,
        /// The OS error it reported.
        #[source]
        source: io::Error,
    },
    /// The queue pair was created on an RDMA-CM id ([`cm`](crate::cm)): RDMA-CM drives its
    /// state transitions, so `init`, `connect`, `activate_ud` and `reset` are refused.
    #[error("{verb}: the queue pair is managed by RDMA-CM (connect, accept and disconnect its id instead)")]
    CmManaged {
        /// The C verb that would have been called.
        verb: &'static str,
    },
    /// The peer rejected an RDMA-CM connection (`RDMA_CM_EVENT_REJECTED`).
    #[error("{verb}: connection rejected by the peer (reason {status}{})", reject_reason(*.status))]
    Rejected {
        /// The step that was answered with the rejection.
        verb: &'static str,
        /// The transport's reject reason (InfiniBand/RoCE: 28 = rejected by the peer's
        /// application, 8 = nothing listens on that port; iWARP: `-ECONNREFUSED`).
        status: i32,
        /// The private data the peer sent with the rejection (padded by the transport).
        private_data: Vec<u8>,
    },
    /// An RDMA-CM operation ended with an event other than the one that means success
    /// (`ADDR_ERROR`, `ROUTE_ERROR`, `UNREACHABLE`, `CONNECT_ERROR`, `DEVICE_REMOVAL`...).
    /// With the `cm` feature.
    #[cfg(feature = "cm")]
    #[error("{verb}: {event:?} (status {status}{})", errno_name(*.status))]
    CmEvent {
        /// The step that failed.
        verb: &'static str,
        /// The event that came instead.
        event: crate::attr::CmEventKind,
        /// The event's status (a negated errno value for most errors).
        status: i32,
    },
    /// A setting — an environment variable such as `IBVERBS_HCA` or `NCCL_IB_HCA`, or a string
    /// given to one of [`select`](crate::select)'s parsers — is not valid. The message names the
    /// variable, its value and the position of the problem.
    #[error("{}{error}", .variable.map(|v| format!("{v}=")).unwrap_or_default())]
    Setting {
        /// The environment variable, if the text came from one.
        variable: Option<&'static str>,
        /// What is wrong, and where.
        #[source]
        error: ParseError,
    },
    /// A selection ([`select`](crate::select)) found no usable port: each port of each device
    /// is listed with the problem that excluded it (not selected, not ACTIVE, no suitable GID,
    /// MTU...).
    #[error("no usable RDMA port for {selection}: {}", list_rejected(.rejected))]
    NoUsablePort {
        /// The selection: the variables that were set, or the [`Selection`](crate::select::Selection).
        selection: String,
        /// Every port (or device) and why it is not usable.
        rejected: Vec<Rejected>,
    },
    /// rdma-core's library could not be loaded (feature `dlopen`): the program runs on a host
    /// without it (a laptop, a container without devices), or with one older than rdma-core
    /// v28. Returned by the first call that needs it ([`devices`](crate::devices),
    /// [`Context::open`](crate::Context::open), `cm::EventChannel::new`, ...), and by every later
    /// one: fall back to another transport, or install the package.
    #[error("{library} could not be loaded ({reason}): install rdma-core's {package} package")]
    LibraryMissing {
        /// The library's file name: `"libibverbs.so.1"` or `"librdmacm.so.1"`.
        library: &'static str,
        /// The Debian/Ubuntu package that installs it: `"libibverbs1"` or `"librdmacm1"`
        /// (Fedora/RHEL: `libibverbs`, `librdmacm`).
        package: &'static str,
        /// The dynamic loader's message (`dlerror()`), or what the library lacks.
        reason: String,
    },
    /// Other ranks of a [`group`](crate::group) failed, vanished or never came: returned by the
    /// collective steps ([`Bootstrap::allgather`](crate::group::Bootstrap::allgather),
    /// [`Group::create`](crate::group::Group::create), [`Group::check`](crate::group::Group::check))
    /// on every rank that learns of it, naming the ranks and what happened to them.
    #[error("{during}: {}: {problem}", group::ranks_text(.ranks))]
    Group {
        /// The step that could not complete, e.g. `"rendezvous"`, `"allgather"`.
        during: &'static str,
        /// The ranks at fault (ascending).
        ranks: Vec<usize>,
        /// What happened to them.
        problem: RankProblem,
    },
    /// The launcher's environment does not describe a group this process can join: a variable
    /// missing or inconsistent (`RANK` without `WORLD_SIZE`, a rank not below the size, no
    /// rendezvous address), or the rendezvous could not be set up.
    #[error("group bootstrap: {reason}")]
    Bootstrap {
        /// What is missing or wrong, naming the variables.
        reason: String,
        /// The OS error, where one was the cause (a port already in use...).
        #[source]
        source: Option<io::Error>,
    },
    /// A port named explicitly cannot be used as asked: not ACTIVE, GID index empty or not RoCE
    /// v2, an MTU above the port's active MTU... (see [`PortProblem`](crate::select::PortProblem)).
    #[error("{device} port {port}: {problem}")]
    Port {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// What is wrong with it.
        problem: PortProblem,
    },
}

impl From<ibverbs_sys::LoadError> for Error {
    fn from(e: ibverbs_sys::LoadError) -> Error {
        let library = e.library();
        Error::LibraryMissing {
            library: library.soname(),
            package: library.package(),
            reason: e.reason().to_string(),
        }
    }
}

/// A note on common InfiniBand CM reject reasons.
fn reject_reason(status: i32) -> &'static str {
    match status {
        8 => ": invalid service ID, nothing listens on that port",
        28 => ": rejected by the peer's application",
        -111 => ": connection refused (iWARP: nothing listens on that port, or the peer rejected)",
        _ => "",
    }
}

/// A negated errno value as text, e.g. `: Connection timed out`.
#[cfg(feature = "cm")]
fn errno_name(status: i32) -> String {
    if status < 0 {
        // Wrapping: a status of i32::MIN (a hand-built error) must not panic in Display.
        format!(": {}", io::Error::from_raw_os_error(status.wrapping_neg()))
    } else {
        String::new()
    }
}

/// What a failed GID query usually means.
fn gid_hint(source: &io::Error) -> &'static str {
    match source.raw_os_error() {
        Some(libc::ENODATA) => {
            "; the entry is empty (list the port's GIDs with `ibv_devinfo -v` or the `doctor` example; \
             a RoCE port has a RoCE v2 IPv4 GID only while its network device has an IPv4 address)"
        }
        Some(libc::EINVAL) => "; the index is beyond the port's GID table, or the port does not exist",
        _ => "",
    }
}

/// The ports of [`Error::NoUsablePort`], one after the other.
fn list_rejected(rejected: &[Rejected]) -> String {
    if rejected.is_empty() {
        return "no port".to_string();
    }
    rejected.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("; ")
}

impl Error {
    /// The error of a verb that reported failure through `errno`.
    pub(crate) fn last_os(verb: &'static str) -> Self {
        Error::Verb { verb, source: last_errno() }
    }

    /// The error of a verb that returned an errno value (positive or negated).
    pub(crate) fn from_ret(verb: &'static str, ret: i32) -> Self {
        Error::Verb { verb, source: io::Error::from_raw_os_error(ret.wrapping_abs()) }
    }

    /// [`Error::QueuedWithError`] for a post verb that failed with `ret` after queuing its
    /// requests (a `ret` of -1 reads `errno`, as in [`from_post`](Self::from_post)).
    pub(crate) fn queued_with(verb: &'static str, ret: i32) -> Self {
        Error::QueuedWithError { verb, source: post_source(ret) }
    }

    /// What a post verb that failed with `ret` and `bad` (its `bad_wr`) did with the chain of `n`
    /// requests at `base`: how many of them the provider queued ([`posted_before`]), and the
    /// error — [`Error::QueuedWithError`] when it queued all of them, else [`Error::Verb`]. Call
    /// it right after the verb: a `ret` of -1 is a failed system call's (libsiw returns
    /// `write(2)`'s result), whose error is in `errno`.
    pub(crate) fn from_post<T>(
        verb: &'static str,
        ret: i32,
        base: *const T,
        n: usize,
        bad: *const T,
    ) -> (usize, Self) {
        let source = post_source(ret);
        let posted = posted_before(base, n, bad);
        let error =
            if posted == n { Error::QueuedWithError { verb, source } } else { Error::Verb { verb, source } };
        (posted, error)
    }

    /// A provider's `EOPNOTSUPP` (or `ENOSYS`, `EPROTONOSUPPORT`) for `verb` becomes
    /// [`Error::Unsupported`] naming `capability`; any other error stays as it is.
    pub(crate) fn or_unsupported(self, capability: &'static str) -> Self {
        match self {
            Error::Verb { verb, ref source }
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT)
                ) =>
            {
                Error::Unsupported { verb, capability }
            }
            e => e,
        }
    }

    /// The OS error code carried by this error, if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Verb { source, .. }
            | Error::GidQuery { source, .. }
            | Error::QueuedWithError { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// A failed post: the error, and the request (with its buffers) handed back.
pub struct PostError<R> {
    /// What went wrong.
    pub error: Error,
    /// The request that was not posted, with its buffers. With [`Error::QueuedWithError`] it
    /// was posted after all: this is what is left of it, without its buffers (they come back
    /// with its completion).
    pub request: R,
}

impl<R> fmt::Debug for PostError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostError").field("error", &self.error).finish_non_exhaustive()
    }
}

impl<R> fmt::Display for PostError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl<R> std::error::Error for PostError<R> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<R> From<PostError<R>> for Error {
    fn from(e: PostError<R>) -> Error {
        e.error
    }
}

/// How many of a chain of `n` work requests starting at `base` the provider queued, from the
/// `bad_wr` it returned with an error: those before `bad` when `bad` is one of them; all `n` when
/// it names none (a NULL `bad_wr`: siw and rxe queue every request and then fail the system call
/// of their doorbell; or a pointer outside the chain). Counting a request the device may have as
/// not posted would hand its buffers back while the device reads or writes them; the other way
/// round only keeps them until their completion, the queue pair's flush or its destruction.
fn posted_before<T>(base: *const T, n: usize, bad: *const T) -> usize {
    let size = std::mem::size_of::<T>();
    let offset = (bad as usize).wrapping_sub(base as usize);
    if !bad.is_null() && offset % size == 0 && offset / size < n {
        offset / size
    } else {
        n
    }
}

/// The OS error of a post verb that returned `ret`: an errno value (positive or negated), or -1
/// for a failed system call's (libsiw returns `write(2)`'s result), whose error is in `errno`.
// Always: a call here from `from_post` moved the code of the 32-post prepared chains that
// inline it (+1.1 instructions per WR under callgrind).
#[inline(always)]
fn post_source(ret: i32) -> io::Error {
    if ret == -1 {
        last_errno()
    } else {
        io::Error::from_raw_os_error(ret.wrapping_abs())
    }
}

/// `errno` after a call that failed, or, where the library left it 0 (libsiw's queue creation
/// does when it refuses the memory-map key the kernel gave, see `device::SIW_QUEUE_SPACE`), an
/// error that says so rather than "Success".
fn last_errno() -> io::Error {
    match io::Error::last_os_error() {
        e if e.raw_os_error() == Some(0) => io::Error::other("no errno given"),
        e => e,
    }
}

/// Sets this thread's `errno` to 0, before a verb whose provider can fail without setting it
/// (libsiw's queue creation, see `Context::explain_queue_failure`; mlx5's `ibv_create_ah` for a
/// bad port), so that a value left from an earlier call is not taken for its error.
pub(crate) fn clear_errno() {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = 0 };
}

/// Checks a pointer returned by a verb: `NULL` becomes [`Error::Verb`] with `errno`.
pub(crate) fn cvt_p<T>(verb: &'static str, p: *mut T) -> Result<std::ptr::NonNull<T>> {
    std::ptr::NonNull::new(p).ok_or_else(|| Error::last_os(verb))
}

/// Checks the return value of a verb that returns 0 on success and an errno value (or -1 with
/// `errno` set) on failure.
pub(crate) fn cvt(verb: &'static str, ret: i32) -> Result<()> {
    match ret {
        0 => Ok(()),
        -1 => Err(Error::last_os(verb)),
        e => Err(Error::from_ret(verb, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_without_errno_says_so() {
        clear_errno();
        let e = Error::last_os("rdma_create_qp");
        assert_eq!(e.to_string(), "rdma_create_qp failed: no errno given");
        assert_eq!(e.raw_os_error(), None);
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = libc::ENOMEM };
        assert_eq!(Error::last_os("rdma_create_qp").raw_os_error(), Some(libc::ENOMEM));
    }

    #[test]
    fn extreme_statuses_display_without_overflow() {
        // Debug builds panicked negating i32::MIN.
        #[cfg(feature = "cm")]
        {
            let e = Error::CmEvent {
                verb: "rdma_connect",
                event: crate::attr::CmEventKind::REJECTED,
                status: i32::MIN,
            };
            assert!(e.to_string().contains("rdma_connect"));
        }
        assert!(Error::from_ret("ibv_poll_cq", i32::MIN).to_string().contains("ibv_poll_cq"));
        assert!(post_source(i32::MIN).raw_os_error().is_some());
        assert_eq!(Error::from_ret("v", -libc::EINVAL).raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn a_provider_without_the_verb_is_reported_as_unsupported() {
        for errno in [libc::EOPNOTSUPP, libc::ENOSYS, libc::EPROTONOSUPPORT] {
            let e = Error::from_ret("ibv_rereg_mr", errno).or_unsupported("rereg");
            assert!(matches!(e, Error::Unsupported { verb: "ibv_rereg_mr", capability: "rereg" }), "{e:?}");
            assert_eq!(e.to_string(), "ibv_rereg_mr: the device does not support rereg");
        }
        for errno in [libc::EINVAL, libc::ENOMEM, libc::EPERM] {
            let e = Error::from_ret("ibv_reg_mr", errno).or_unsupported("odp");
            assert_eq!(e.raw_os_error(), Some(errno), "other errors stay verb errors");
        }
        let e = Error::InvalidArgument { verb: "x", reason: "y" }.or_unsupported("z");
        assert!(matches!(e, Error::InvalidArgument { .. }));
    }

    #[test]
    fn cvt_maps_return_conventions() {
        assert!(cvt("ibv_x", 0).is_ok());
        let e = cvt("ibv_modify_qp", libc::EINVAL).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        assert!(e.to_string().starts_with("ibv_modify_qp failed: "), "{e}");
        let e = cvt("ibv_modify_qp", -libc::ENOMEM).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM));
    }

    #[test]
    fn cvt_p_reads_errno() {
        // SAFETY: __errno_location returns this thread's errno slot.
        unsafe { *libc::__errno_location() = libc::ENODEV };
        let e = cvt_p::<u8>("ibv_open_device", std::ptr::null_mut()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENODEV));
        let mut x = 0u8;
        assert!(cvt_p("ibv_open_device", &mut x).is_ok());
    }

    #[test]
    fn a_missing_library_names_its_package() {
        let e = Error::from(ibverbs_sys::LoadError::new(
            ibverbs_sys::Library::Verbs,
            "libibverbs.so.1: cannot open shared object file: No such file or directory",
        ));
        assert_eq!(
            e.to_string(),
            "libibverbs.so.1 could not be loaded (libibverbs.so.1: cannot open shared object file: No such file \
             or directory): install rdma-core's libibverbs1 package"
        );
        let e = Error::from(ibverbs_sys::LoadError::new(ibverbs_sys::Library::RdmaCm, "x"));
        assert!(matches!(e, Error::LibraryMissing { library: "librdmacm.so.1", package: "librdmacm1", .. }));
    }

    #[test]
    fn error_is_send_sync_and_has_source() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<Error>();
        let e = cvt("ibv_x", libc::EIO).unwrap_err();
        assert!(std::error::Error::source(&e).is_some());
    }
}
