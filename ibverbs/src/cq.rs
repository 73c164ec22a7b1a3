//! Completion queues, completion channels and work completions.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crate::device::{Context, ContextInner};
use crate::error::{cvt, cvt_p, Error, Result};
use crate::ffi;
use crate::ring::{Registry, TAG};
use crate::wr::{LocalBuf, MAX_SGE};
use crate::MemoryRegion;

pub(crate) struct ChannelInner {
    raw: NonNull<ffi::ibv_comp_channel>,
    _ctx: Arc<ContextInner>,
}

// SAFETY: a completion channel is a file descriptor plus a context pointer; libibverbs allows
// getting events from any thread.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using this channel holds an Arc of this inner, so none is left.
        unsafe { ffi::ibv_destroy_comp_channel(self.raw.as_ptr()) };
    }
}

/// A completion event channel (`struct ibv_comp_channel`): a file descriptor that becomes
/// readable when an armed [`CompletionQueue`] gets a completion.
///
/// It implements [`AsFd`], so an async runtime can wait on it; [`get_event`](Self::get_event)
/// waits with a timeout. Cloning is cheap (an `Arc`).
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel").field("fd", &self.as_fd().as_raw_fd()).finish()
    }
}

/// Identifies the completion queue an event is for (compare with [`CompletionQueue::id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqId(usize);

impl CompletionChannel {
    pub(crate) fn new(ctx: &Context) -> Result<CompletionChannel> {
        // SAFETY: valid context; destroyed once in ChannelInner::drop.
        let raw = cvt_p("ibv_create_comp_channel", unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) })?;
        let ch = CompletionChannel { inner: Arc::new(ChannelInner { raw, _ctx: ctx.inner.clone() }) };
        // Non-blocking, so that a racing reader never leaves ibv_get_cq_event blocked forever.
        let fd = ch.as_fd().as_raw_fd();
        // SAFETY: fcntl on a descriptor we own.
        let ret =
            unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
        if ret < 0 {
            return Err(Error::last_os("fcntl"));
        }
        Ok(ch)
    }

    /// Waits up to `timeout` (forever for `None`) for a completion event, acknowledges it
    /// (`ibv_get_cq_event()` + `ibv_ack_cq_events()`), and returns which CQ it is for; `None` on
    /// timeout. The CQ must be re-armed with [`CompletionQueue::req_notify`] for the next event.
    ///
    /// # Errors
    /// [`Error::Verb`] when `poll(2)` or `ibv_get_cq_event()` fails.
    #[doc(alias = "ibv_get_cq_event")]
    #[doc(alias = "ibv_ack_cq_events")]
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<Option<CqId>> {
        let ms = match timeout {
            None => -1,
            Some(t) => i32::try_from(t.as_millis()).unwrap_or(i32::MAX),
        };
        let mut pfd = libc::pollfd { fd: self.as_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(None);
            }
            return Err(Error::Verb { verb: "poll", source: e });
        }
        if n == 0 {
            return Ok(None);
        }
        let mut cq = std::ptr::null_mut();
        let mut cq_ctx = std::ptr::null_mut();
        // SAFETY: valid channel and out-pointers; the fd is non-blocking.
        let ret = unsafe { ffi::ibv_get_cq_event(self.inner.raw.as_ptr(), &mut cq, &mut cq_ctx) };
        if ret != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None); // another thread took it
            }
            return Err(Error::Verb { verb: "ibv_get_cq_event", source: e });
        }
        // SAFETY: `cq` is the CQ the event is for; it cannot be destroyed before this ack
        // (ibv_destroy_cq waits for all events to be acknowledged).
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(Some(CqId(cq as usize)))
    }

    /// The raw `struct ibv_comp_channel *`.
    pub fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.inner.raw.as_ptr()
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel's fd is open while the channel lives.
        unsafe { BorrowedFd::borrow_raw((*self.inner.raw.as_ptr()).fd) }
    }
}

pub(crate) struct CqInner {
    pub(crate) raw: NonNull<ffi::ibv_cq>,
    poll_fn: unsafe extern "C" fn(*mut ffi::ibv_cq, i32, *mut ffi::ibv_wc) -> i32,
    pub(crate) registry: Registry,
    _channel: Option<Arc<ChannelInner>>,
    _ctx: Arc<ContextInner>,
}

// SAFETY: libibverbs CQs may be polled and armed from any thread (providers lock internally); the
// registry is designed for one consumer (enforced by &mut CompletionQueue) and many registrars.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc of this inner, so all are destroyed; events
        // are acknowledged as they are read. After this the registry drops the remaining buffers.
        let ret = unsafe { ffi::ibv_destroy_cq(self.raw.as_ptr()) };
        if ret != 0 {
            // Should not happen (no QP is left); the buffers in the registry are not touched by a
            // destroyed QP either way, so dropping them stays sound.
        }
    }
}

/// A completion queue (`struct ibv_cq`).
///
/// Not `Clone`: exactly one owner polls it with [`poll`](Self::poll) (`&mut self`), which returns
/// the buffers of safely posted work requests; queue pairs keep the CQ itself alive.
/// Shared by any number of queue pairs, and by both queues of a QP.
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("capacity", &self.capacity()).finish()
    }
}

/// Completions fetched from the device per `ibv_poll_cq` call of [`CompletionQueue::poll`].
const POLL_BATCH: usize = 16;

impl CompletionQueue {
    pub(crate) fn new(ctx: &Context, depth: u32, channel: Option<&CompletionChannel>) -> Result<Self> {
        let cqe = i32::try_from(depth).ok().filter(|&d| d > 0).ok_or(Error::InvalidArgument {
            verb: "ibv_create_cq",
            reason: "depth must be in 1..=i32::MAX",
        })?;
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.inner.raw.as_ptr());
        // SAFETY: valid context and (optional) channel, which the CQ keeps alive via its Arc.
        let raw = unsafe { ffi::ibv_create_cq(ctx.as_raw(), cqe, std::ptr::null_mut(), ch, 0) };
        let raw = cvt_p("ibv_create_cq", raw)?;
        // SAFETY: the CQ is valid; cqe is the real capacity, context->ops a table of the provider.
        let (capacity, poll_fn) = unsafe {
            let cap = u32::try_from((*raw.as_ptr()).cqe).unwrap_or(depth);
            (cap, (*(*raw.as_ptr()).context).ops.poll_cq)
        };
        let Some(poll_fn) = poll_fn else {
            // SAFETY: created above, destroyed once.
            unsafe { ffi::ibv_destroy_cq(raw.as_ptr()) };
            return Err(Error::InvalidArgument { verb: "ibv_poll_cq", reason: "provider has no poll_cq" });
        };
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                raw,
                poll_fn,
                registry: Registry::new(capacity),
                _channel: channel.map(|c| c.inner.clone()),
                _ctx: ctx.inner.clone(),
            }),
        })
    }

    /// How many completions it holds (at least the depth asked for).
    pub fn capacity(&self) -> u32 {
        self.inner.registry.cq_capacity()
    }

    /// Identifies this CQ in [`CompletionChannel::get_event`] results.
    pub fn id(&self) -> CqId {
        CqId(self.inner.raw.as_ptr() as usize)
    }

    /// The raw `struct ibv_cq *`; valid while this CQ (or a QP using it) lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.raw.as_ptr()
    }

    /// Arms the CQ: the next completion (only solicited ones if `solicited_only`) raises an event
    /// on its channel (`ibv_req_notify_cq()`).
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails (e.g. the CQ has no channel).
    #[doc(alias = "ibv_req_notify_cq")]
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: valid CQ.
        cvt("ibv_req_notify_cq", unsafe { ffi::ibv_req_notify_cq(self.as_raw(), i32::from(solicited_only)) })
    }

    /// Polls up to `out.len()` completions into `out` (`ibv_poll_cq()`) and returns the filled
    /// part. Completions of safely posted work requests carry the caller's `wr_id` and hand the
    /// request's buffers back ([`Completion::take_buffers`]); earlier unsignaled requests of the
    /// same queue are released at the same time. Buffers of queue pairs dropped with work
    /// outstanding are released here too. Allocates nothing, takes no lock.
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_poll_cq()` fails.
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll<'c>(&mut self, out: &'c mut [Completion]) -> Result<&'c mut [Completion]> {
        let registry = &self.inner.registry;
        // SAFETY: &mut self makes us the registry's only consumer.
        unsafe { registry.sweep() };
        let mut filled = 0;
        while filled < out.len() {
            // Not zeroed: the provider writes the entries it returns (a memset would cost more
            // than the poll itself on hardware).
            let mut wcs = std::mem::MaybeUninit::<[ffi::ibv_wc; POLL_BATCH]>::uninit();
            let want = (out.len() - filled).min(POLL_BATCH);
            // SAFETY: valid CQ; `wcs` has room for `want` entries.
            let n = unsafe { (self.inner.poll_fn)(self.as_raw(), want as i32, wcs.as_mut_ptr().cast()) };
            if n < 0 {
                return Err(Error::from_ret("ibv_poll_cq", n));
            }
            let n = (n as usize).min(want);
            // SAFETY: ibv_poll_cq initialized the first n entries.
            let wcs = unsafe { std::slice::from_raw_parts(wcs.as_ptr().cast::<ffi::ibv_wc>(), n) };
            for (wc, slot) in wcs.iter().zip(&mut out[filled..]) {
                slot.fill(wc, registry);
            }
            filled += n;
            if n < want {
                break;
            }
        }
        Ok(&mut out[..filled])
    }

    /// Polls completions as the device reports them (`ibv_poll_cq()`), at exactly C's cost: no
    /// buffer tracking. Use it with [`QueuePair::post_send_unchecked`](crate::QueuePair::post_send_unchecked)
    /// and friends. Completions of safely posted requests polled this way do not release their
    /// buffers until a later completion of the same queue is polled with [`poll`](Self::poll), or
    /// the QP is dropped; their `wr_id`s are the crate's internal encoding.
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_poll_cq()` fails.
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_raw<'c>(&self, out: &'c mut [WorkCompletion]) -> Result<&'c mut [WorkCompletion]> {
        let want = i32::try_from(out.len()).unwrap_or(i32::MAX);
        // SAFETY: valid CQ; WorkCompletion is a transparent ibv_wc; `out` has room for `want`.
        let n = unsafe { (self.inner.poll_fn)(self.as_raw(), want, out.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(Error::from_ret("ibv_poll_cq", n));
        }
        Ok(&mut out[..n as usize])
    }
}

/// The status of a work completion (`enum ibv_wc_status`): a newtype sound for any value the
/// provider writes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct WcStatus(pub u32);

macro_rules! wc_status_consts {
    ($($name:ident = $c:ident: $doc:literal),* $(,)?) => {
        impl WcStatus { $( #[doc = $doc] pub const $name: WcStatus = WcStatus(ffi::ibv_wc_status::$c.0); )* }
    };
}

wc_status_consts! {
    SUCCESS = IBV_WC_SUCCESS: "The operation completed successfully.",
    LOC_LEN_ERR = IBV_WC_LOC_LEN_ERR: "Local length error (e.g. a message larger than the receive buffer).",
    LOC_QP_OP_ERR = IBV_WC_LOC_QP_OP_ERR: "Local QP operation error.",
    LOC_PROT_ERR = IBV_WC_LOC_PROT_ERR: "Local protection error (bad lkey or access rights).",
    WR_FLUSH_ERR = IBV_WC_WR_FLUSH_ERR: "Flushed: the QP entered the error state.",
    MW_BIND_ERR = IBV_WC_MW_BIND_ERR: "Memory window bind error.",
    BAD_RESP_ERR = IBV_WC_BAD_RESP_ERR: "Bad response from the responder.",
    LOC_ACCESS_ERR = IBV_WC_LOC_ACCESS_ERR: "Local access error.",
    REM_INV_REQ_ERR = IBV_WC_REM_INV_REQ_ERR: "Remote invalid request (e.g. a message too long for the peer).",
    REM_ACCESS_ERR = IBV_WC_REM_ACCESS_ERR: "Remote access error (bad rkey, range or rights).",
    REM_OP_ERR = IBV_WC_REM_OP_ERR: "Remote operation error.",
    RETRY_EXC_ERR = IBV_WC_RETRY_EXC_ERR: "Transport retry counter exceeded (the peer does not answer).",
    RNR_RETRY_EXC_ERR = IBV_WC_RNR_RETRY_EXC_ERR: "Receiver-not-ready retry counter exceeded.",
    REM_ABORT_ERR = IBV_WC_REM_ABORT_ERR: "Remote aborted.",
    FATAL_ERR = IBV_WC_FATAL_ERR: "Fatal error.",
    RESP_TIMEOUT_ERR = IBV_WC_RESP_TIMEOUT_ERR: "Response timeout.",
    GENERAL_ERR = IBV_WC_GENERAL_ERR: "General error.",
}

impl WcStatus {
    /// The C library's text (`ibv_wc_status_str()`), e.g. `"remote access error"`.
    #[doc(alias = "ibv_wc_status_str")]
    pub fn as_str(self) -> &'static str {
        // SAFETY: returns a static string for any value ("unknown" otherwise).
        let p = unsafe { ffi::ibv_wc_status_str(ffi::ibv_wc_status(self.0)) };
        if p.is_null() {
            return "unknown";
        }
        // SAFETY: a static NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap_or("unknown")
    }
}

impl fmt::Debug for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WcStatus({}: {})", self.0, self.as_str())
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.as_str(), self.0)
    }
}

/// The operation a work completion reports (`enum ibv_wc_opcode`); only meaningful when the
/// status is [`WcStatus::SUCCESS`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct WcOpcode(pub u32);

macro_rules! wc_opcode_consts {
    ($($name:ident = $c:ident: $doc:literal),* $(,)?) => {
        impl WcOpcode { $( #[doc = $doc] pub const $name: WcOpcode = WcOpcode(ffi::ibv_wc_opcode::$c.0); )* }
        impl fmt::Debug for WcOpcode {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                $( if *self == WcOpcode::$name { return f.write_str(stringify!($name)); } )*
                write!(f, "WcOpcode({})", self.0)
            }
        }
    };
}

wc_opcode_consts! {
    SEND = IBV_WC_SEND: "A Send completed.",
    RDMA_WRITE = IBV_WC_RDMA_WRITE: "An RDMA Write completed.",
    RDMA_READ = IBV_WC_RDMA_READ: "An RDMA Read completed.",
    COMP_SWAP = IBV_WC_COMP_SWAP: "An atomic compare-and-swap completed.",
    FETCH_ADD = IBV_WC_FETCH_ADD: "An atomic fetch-and-add completed.",
    BIND_MW = IBV_WC_BIND_MW: "A memory window bind completed.",
    RECV = IBV_WC_RECV: "A receive took an incoming Send.",
    RECV_RDMA_WITH_IMM = IBV_WC_RECV_RDMA_WITH_IMM: "A receive took an RDMA Write with immediate.",
}

/// One work completion as the device reports it (`struct ibv_wc`), for
/// [`CompletionQueue::poll_raw`].
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
pub struct WorkCompletion(pub ffi::ibv_wc);

impl WorkCompletion {
    /// The `wr_id` of the work request.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }
    /// The status.
    pub fn status(&self) -> WcStatus {
        WcStatus(self.0.status.0)
    }
    /// Whether the status is [`WcStatus::SUCCESS`].
    pub fn is_ok(&self) -> bool {
        self.status() == WcStatus::SUCCESS
    }
    /// The operation (valid only on success).
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode(self.0.opcode.0)
    }
    /// Bytes received (receives) or transferred (RDMA Read/atomics).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }
    /// The immediate data, in host order, if the message carried any.
    pub fn imm_data(&self) -> Option<u32> {
        (self.0.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
            // SAFETY: both union members are plain u32s.
            .then(|| u32::from_be(unsafe { self.0.__bindgen_anon_1.imm_data }))
    }
    /// The local QP number.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }
    /// The sending QP number (UD receives).
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }
    /// Whether a UD receive starts with a 40-byte GRH.
    pub fn has_grh(&self) -> bool {
        self.0.wc_flags & ffi::ibv_wc_flags::IBV_WC_GRH.0 != 0
    }
    /// The vendor's error syndrome.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
    /// The sender's LID (UD receives on InfiniBand).
    pub fn slid(&self) -> u16 {
        self.0.slid
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("imm_data", &self.imm_data())
            .field("qp_num", &self.qp_num())
            .finish_non_exhaustive()
    }
}

/// A completion from [`CompletionQueue::poll`]: the device's report plus, for a safely posted
/// request, the caller's `wr_id` and the buffers the request held.
#[derive(Default)]
pub struct Completion {
    wc: WorkCompletion,
    bufs: [Option<LocalBuf>; MAX_SGE],
    tracked: bool,
}

impl Completion {
    fn fill(&mut self, wc: &ffi::ibv_wc, registry: &Registry) {
        self.wc = WorkCompletion(*wc);
        self.bufs = Default::default();
        self.tracked = false;
        if wc.wr_id & TAG == 0 {
            return;
        }
        // SAFETY: called from poll(), which holds &mut CompletionQueue: the only consumer.
        let slot = unsafe { registry.lookup(wc.wr_id).and_then(|ring| ring.complete(wc.wr_id as u32)) };
        if let Some(slot) = slot {
            self.wc.0.wr_id = slot.wr_id;
            self.bufs = slot.bufs;
            self.tracked = true;
        }
    }

    /// The report as the device gave it (with the caller's `wr_id`).
    pub fn work_completion(&self) -> &WorkCompletion {
        &self.wc
    }
    /// The caller's `wr_id`.
    pub fn wr_id(&self) -> u64 {
        self.wc.wr_id()
    }
    /// The status.
    pub fn status(&self) -> WcStatus {
        self.wc.status()
    }
    /// Whether the status is [`WcStatus::SUCCESS`].
    pub fn is_ok(&self) -> bool {
        self.wc.is_ok()
    }
    /// The operation (valid only on success).
    pub fn opcode(&self) -> WcOpcode {
        self.wc.opcode()
    }
    /// Bytes received or transferred.
    pub fn byte_len(&self) -> u32 {
        self.wc.byte_len()
    }
    /// Immediate data in host order, if any.
    pub fn imm_data(&self) -> Option<u32> {
        self.wc.imm_data()
    }
    /// The local QP number.
    pub fn qp_num(&self) -> u32 {
        self.wc.qp_num()
    }
    /// The sending QP number (UD receives).
    pub fn src_qp(&self) -> u32 {
        self.wc.src_qp()
    }
    /// Whether this completes a request posted through the safe level (and so returned its
    /// buffers). `false` for requests posted with the `unsafe` level, and for stale completions
    /// of a queue pair that was dropped.
    pub fn is_tracked(&self) -> bool {
        self.tracked
    }
    /// Takes the buffers the request held, in SGE order.
    pub fn take_buffers(&mut self) -> impl Iterator<Item = LocalBuf> + '_ {
        self.bufs.iter_mut().filter_map(Option::take)
    }
    /// Takes the first owned region the request held (the common one-buffer case).
    pub fn take_region(&mut self) -> Option<MemoryRegion> {
        self.bufs.iter_mut().find(|b| matches!(b, Some(LocalBuf::Owned(_))))?.take()?.into_region()
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("wc", &self.wc)
            .field("tracked", &self.tracked)
            .field("buffers", &self.bufs.iter().flatten().count())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wc_status_is_sound_for_any_value_and_names_it() {
        assert_eq!(WcStatus::SUCCESS.as_str(), "success");
        assert_eq!(WcStatus::REM_ACCESS_ERR.as_str(), "remote access error");
        assert_eq!(WcStatus::RETRY_EXC_ERR.0, 12);
        assert_eq!(WcStatus(0xdead).as_str(), "unknown");
        assert_eq!(format!("{:?}", WcOpcode::RECV), "RECV");
        assert_eq!(format!("{:?}", WcOpcode(999)), "WcOpcode(999)");
    }

    #[test]
    fn work_completion_is_transparent_and_reads_imm() {
        assert_eq!(std::mem::size_of::<WorkCompletion>(), std::mem::size_of::<ffi::ibv_wc>());
        let mut wc = ffi::ibv_wc::default();
        wc.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
        assert_eq!(WorkCompletion(wc).imm_data(), None);
        wc.wc_flags = ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0;
        assert_eq!(WorkCompletion(wc).imm_data(), Some(0x1234_5678));
    }

    #[test]
    fn untagged_completions_are_passed_through() {
        let reg = Registry::new(8);
        let mut c = Completion::default();
        let wc = ffi::ibv_wc { wr_id: 77, ..Default::default() };
        c.fill(&wc, &reg);
        assert_eq!(c.wr_id(), 77);
        assert!(!c.is_tracked());
        // A tagged wr_id naming no ring is not dereferenced.
        let wc = ffi::ibv_wc { wr_id: TAG | (5 << 32) | 3, ..Default::default() };
        c.fill(&wc, &reg);
        assert!(!c.is_tracked());
    }
}
