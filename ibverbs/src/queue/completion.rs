//! Work completions: the device's report ([`WorkCompletion`]) and the safe level's
//! [`Completion`], which hands a request's buffers back.

use std::fmt;
use std::mem::ManuallyDrop;

use ibverbs_sys as ffi;

use crate::memory::{BoundWindow, Chunk, MemoryRegion, MemoryWindow, Pending};
use crate::post::registry::Registry;
use crate::post::ring::TAG;
use crate::post::table::SRQ;
use crate::post::{LocalBuf, Slot, SlotBufs, MAX_SGE};

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
        // Needs no object: without libibverbs (feature `dlopen`), the same names from here.
        if ffi::load().is_err() {
            return wc_status_name(self.0);
        }
        // SAFETY: returns a static string for any value ("unknown" otherwise).
        let p = unsafe { ffi::ibv_wc_status_str(ffi::ibv_wc_status(self.0)) };
        if p.is_null() {
            return "unknown";
        }
        // SAFETY: a static NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap_or("unknown")
    }
}

/// `ibv_wc_status_str()`'s texts (rdma-core's `libibverbs/enum_strs.c`), for a process where
/// libibverbs cannot be loaded (feature `dlopen`).
fn wc_status_name(value: u32) -> &'static str {
    const NAMES: [&str; 24] = [
        "success",
        "local length error",
        "local QP operation error",
        "local EE context operation error",
        "local protection error",
        "Work Request Flushed Error",
        "memory management operation error",
        "bad response error",
        "local access error",
        "remote invalid request error",
        "remote access error",
        "remote operation error",
        "transport retry counter exceeded",
        "RNR retry counter exceeded",
        "local RDD violation error",
        "remote invalid RD request",
        "aborted error",
        "invalid EE context number",
        "invalid EE context state",
        "fatal error",
        "response timeout error",
        "general error",
        "TM error",
        "TM software rendezvous",
    ];
    usize::try_from(value).ok().and_then(|i| NAMES.get(i)).copied().unwrap_or("unknown")
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
    LOCAL_INV = IBV_WC_LOCAL_INV: "A local invalidate completed.",
    RECV = IBV_WC_RECV: "A receive took an incoming Send.",
    RECV_RDMA_WITH_IMM = IBV_WC_RECV_RDMA_WITH_IMM: "A receive took an RDMA Write with immediate.",
}

/// One work completion as the device reports it (`struct ibv_wc`), for
/// [`CompletionQueue::poll_raw`](crate::CompletionQueue::poll_raw).
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
    /// Whether this is a successful receive's completion (`IBV_WC_RECV` or
    /// `IBV_WC_RECV_RDMA_WITH_IMM`): the one kind whose flags describe an incoming message.
    fn is_ok_receive(&self) -> bool {
        self.is_ok() && self.0.opcode.0 & ffi::ibv_wc_opcode::IBV_WC_RECV.0 != 0
    }
    /// The immediate data, in host order, if the message this receive took carried any. `None`
    /// for every other completion: mlx4 and mlx5 flag `IBV_WC_WITH_IMM` on the sender's own
    /// completion of a Send or RDMA Write with immediate too, without the value, and a failed
    /// completion's flags are not valid (`ibv_poll_cq(3)`).
    pub fn imm_data(&self) -> Option<u32> {
        use ffi::ibv_wc_flags as F;
        let carried = self.0.wc_flags & (F::IBV_WC_WITH_IMM.0 | F::IBV_WC_WITH_INV.0) == F::IBV_WC_WITH_IMM.0;
        (carried && self.is_ok_receive())
            // SAFETY: both union members are plain u32s.
            .then(|| u32::from_be(unsafe { self.0.__bindgen_anon_1.imm_data }))
    }
    /// The rkey a peer's Send with Invalidate invalidated (`IBV_WC_WITH_INV`), if any (on a
    /// successful receive's completion only, as [`imm_data`](Self::imm_data)).
    #[doc(alias = "IBV_WC_WITH_INV")]
    pub fn invalidated_rkey(&self) -> Option<u32> {
        // SAFETY: both union members are plain u32s.
        let rkey = unsafe { self.0.__bindgen_anon_1.invalidated_rkey };
        (self.0.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_INV.0 != 0 && self.is_ok_receive()).then_some(rkey)
    }
    /// The local QP number.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }
    /// The sending QP number (UD receives).
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }
    /// Whether a UD receive starts with a 40-byte GRH (false for a failed completion, whose
    /// flags are not valid).
    pub fn has_grh(&self) -> bool {
        self.0.wc_flags & ffi::ibv_wc_flags::IBV_WC_GRH.0 != 0 && self.is_ok()
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

/// A completion from [`CompletionQueue::poll`](crate::CompletionQueue::poll): the device's report plus, for a safely posted
/// request, the caller's `wr_id` and the buffers the request held.
#[derive(Default)]
pub struct Completion {
    wc: WorkCompletion,
    /// Dropped (by [`clear`](Self::clear) and by the entry's drop) only when `holds` says
    /// buffers came in: an entry that never got any is dropped without looking at them.
    bufs: ManuallyDrop<[Option<LocalBuf>; MAX_SGE]>,
    tracked: bool,
    /// Whether buffers were moved into `bufs` since the last [`clear`](Self::clear) (the
    /// caller may have taken some since); when it is `false` every entry is `None`: buffers
    /// come in only with it set (a slot's, taken by a poll).
    holds: bool,
    /// The completion timestamp, from an extended CQ that asked for it.
    ts: Option<u64>,
}

impl Drop for Completion {
    /// Drops the buffers not taken by the caller, if any came in: an entry that never got
    /// buffers is dropped without looking at them. As any array's, the other entries are still
    /// dropped if one's drop unwinds.
    fn drop(&mut self) {
        if self.holds {
            // SAFETY: dropped once, here, and never used again (the entry is being dropped).
            unsafe { ManuallyDrop::drop(&mut self.bufs) };
        }
    }
}

impl Completion {
    /// Drops what the entry holds (buffers not taken by the caller), leaving it empty.
    #[inline]
    pub(crate) fn clear(&mut self) {
        self.ts = None;
        self.tracked = false;
        // Only an entry that got buffers can hold some. `holds` stays set until every one
        // was dropped: should a drop unwind, the next clear (or the entry's drop) drops the
        // others, each once (the one that unwound was taken out first).
        if self.holds {
            self.drop_bufs();
            self.holds = false;
        }
    }

    /// [`clear`](Self::clear)'s dropping of the buffers, out of line: inlined, its four drop
    /// calls made every poll of one completion save and restore more registers, also the
    /// polls that find nothing.
    #[inline(never)]
    fn drop_bufs(&mut self) {
        for b in self.bufs.iter_mut() {
            // One at a time: a panicking drop leaves the others in place, each dropped once.
            // Entries come compact from the slot, but the caller may have taken any of them:
            // every one is looked at.
            if b.is_some() {
                drop(b.take());
            }
        }
    }

    /// Moves a slot's buffers into this cleared entry (every entry `None`), which then holds
    /// them: entries in SGE order, up to the first empty one (a slot's are compact), so that a
    /// one-buffer slot moves one entry. Returns whether the slot held any.
    ///
    /// # Safety
    /// `slot_bufs` points to a slot's initialised buffers (in the sense of `SlotBufs`), which
    /// this moves out: the caller does not drop or read them again.
    #[inline(always)]
    unsafe fn take_slot_bufs(bufs: &mut [Option<LocalBuf>; MAX_SGE], slot_bufs: *const SlotBufs) -> bool {
        // SAFETY: entry 0 is initialised (the caller's contract and the invariant).
        if unsafe { !SlotBufs::first_is_some(slot_bufs) } {
            return false;
        }
        // Every entry is initialised when the first holds a buffer (SlotBufs); MaybeUninit<T>
        // is laid out as T.
        let src = slot_bufs.cast::<Option<LocalBuf>>();
        let mut k = 0;
        while k < MAX_SGE {
            // SAFETY: entry k is initialised (above) and read once, moved out.
            let Some(buf) = (unsafe { src.add(k).read() }) else { break };
            // The entry was `None` (cleared): writing over it drops nothing.
            // SAFETY: k < MAX_SGE, in bounds of `bufs`.
            unsafe { std::ptr::write(bufs.as_mut_ptr().add(k), Some(buf)) };
            k += 1;
        }
        // The entries after the first empty one are empty too (compact): nothing left to move.
        true
    }

    /// Fills a cleared entry from a polled work completion, taking the request's slot.
    ///
    /// # Safety
    /// Called only by the registry's consumer (from `poll`, which holds
    /// `&mut CompletionQueue`), on an entry [`clear`](Self::clear)ed since its last fill.
    // Always: outlined, its call, prologue and epilogue cost ~20 instructions per completion
    // (callgrind, `POST_POLL_BATCH=Safe`).
    #[inline(always)]
    pub(crate) unsafe fn fill(&mut self, wc: &ffi::ibv_wc, registry: &Registry<Slot>) {
        self.wc = WorkCompletion(*wc);
        // SAFETY: the caller's contract; `self.wc` was just filled.
        unsafe { self.take_slot(registry) }
    }

    /// The work completion, for the provider to write into directly (a poll of one
    /// completion): zeroed first, since providers leave fields they do not use unwritten.
    #[inline(always)]
    pub(crate) fn zeroed_wc(&mut self) -> *mut ffi::ibv_wc {
        self.wc = WorkCompletion::default();
        &mut self.wc.0
    }

    /// [`fill`](Self::fill) of an entry whose work completion the provider wrote in place
    /// ([`zeroed_wc`](Self::zeroed_wc)): finds and takes the request's slot.
    ///
    /// # Safety
    /// As [`fill`](Self::fill), with `self.wc` written by the provider since the entry was
    /// cleared.
    #[inline(always)]
    pub(crate) unsafe fn take_slot(&mut self, registry: &Registry<Slot>) {
        let wr_id = self.wc.0.wr_id;
        if wr_id & TAG == 0 {
            return;
        }
        if wr_id & SRQ != 0 {
            // SAFETY: the caller's contract.
            return unsafe { self.fill_srq(registry) };
        }
        let (wc_out, bufs) = (&mut self.wc, &mut *self.bufs);
        // SAFETY: the consumer (contract).
        let Some(ring) = (unsafe { registry.lookup(wr_id) }) else { return };
        let take = |slot: *mut Slot| {
            // SAFETY: `slot` points to the initialised slot, ours until we return; each field
            // is read once (moved out): `wr_id` is Copy, the buffers move into the entry, which
            // was cleared (all `None`: overwriting drops nothing), the address handle comes back.
            unsafe {
                wc_out.0.wr_id = (*slot).wr_id;
                // A slot's entries are compact: an empty first one means an empty slot (a
                // prepared post's), and the cleared entry already holds nothing.
                let holds = Self::take_slot_bufs(bufs, std::ptr::addr_of!((*slot).bufs));
                (holds, std::ptr::read(std::ptr::addr_of!((*slot)._ah)))
            }
        };
        // SAFETY: the consumer (contract) of the ring and of the registry's `deferred`; `take`
        // moves every field out.
        if let Some((holds, ah)) = unsafe { ring.complete_in_place(wr_id as u32, registry.deferred(), take) }
        {
            self.tracked = true;
            self.holds = holds;
            // Dropped after the position is released: a UD send's address handle, out of
            // line (only UD sends hold one; inlined, its call kept more registers live).
            if let Some(ah) = ah {
                drop_ah(ah);
            }
        }
    }

    /// [`take_slot`](Self::take_slot)'s common case, with no call: an untagged completion, or
    /// the completion of a queue pair's request whose slot holds no address handle and whose
    /// unsignaled predecessors hold nothing to drop. Returns `false`, having changed nothing,
    /// for every other case (a shared receive queue's request, a stale or foreign `wr_id`, an
    /// address handle, earlier buffers to drop), which `take_slot` then handles: nothing is
    /// dropped here, so no panic can be deferred.
    ///
    /// # Safety
    /// As [`take_slot`](Self::take_slot).
    #[inline(always)]
    pub(crate) unsafe fn take_slot_quiet(&mut self, registry: &Registry<Slot>) -> bool {
        let wr_id = self.wc.0.wr_id;
        if wr_id & TAG == 0 {
            return true;
        }
        if wr_id & SRQ != 0 {
            return false;
        }
        // SAFETY: the consumer (contract).
        let Some(ring) = (unsafe { registry.lookup(wr_id) }) else { return false };
        let (wc_out, bufs) = (&mut self.wc, &mut *self.bufs);
        let take = |slot: *mut Slot| {
            // SAFETY: `slot` points to the initialised slot, ours until we return. A slot with an
            // address handle is declined before anything is read out of it; otherwise each
            // field that needs dropping is moved out once (the buffers into the cleared entry,
            // all `None`: overwriting drops nothing), and the `None` address handle needs none.
            unsafe {
                if (*std::ptr::addr_of!((*slot)._ah)).is_some() {
                    return None;
                }
                wc_out.0.wr_id = (*slot).wr_id;
                Some(Self::take_slot_bufs(bufs, std::ptr::addr_of!((*slot).bufs)))
            }
        };
        // SAFETY: the consumer (contract); `take` moves every field that needs dropping out
        // when it takes the slot.
        match unsafe { ring.complete_quiet(wr_id as u32, take) } {
            Some(holds) => {
                self.tracked = true;
                self.holds = holds;
                true
            }
            None => false,
        }
    }

    /// [`fill`](Self::fill)'s branch for a shared receive queue's request (any order, any of
    /// its CQs: see post/table.rs), outlined so that it does not weigh on the inlined common path.
    ///
    /// # Safety
    /// As [`fill`](Self::fill), with `self.wc` just filled from a completion whose `wr_id` has
    /// the `TAG` and `SRQ` bits.
    #[inline(never)]
    unsafe fn fill_srq(&mut self, registry: &Registry<Slot>) {
        let wr_id = self.wc.0.wr_id;
        // SAFETY: the consumer (contract).
        let slot = unsafe { registry.lookup_srq(wr_id) }.and_then(|table| table.complete(wr_id));
        if let Some(slot) = slot {
            self.wc.0.wr_id = slot.wr_id;
            // The entry was cleared: the buffers replaced are all `None`, nothing to drop.
            std::mem::forget(std::mem::replace(&mut *self.bufs, slot.bufs.into_array()));
            self.tracked = true;
            self.holds = true;
        }
    }

    /// [`fill`](Self::fill) for a completion read from an extended CQ (as a classic `ibv_wc`), with
    /// its timestamp if the CQ reports one.
    ///
    /// # Safety
    /// As [`fill`](Self::fill).
    #[inline]
    pub(crate) unsafe fn fill_ex(&mut self, wc: &ffi::ibv_wc, ts: Option<u64>, registry: &Registry<Slot>) {
        // SAFETY: the caller's contract is fill's.
        unsafe { self.fill(wc, registry) };
        self.ts = ts;
    }

    /// The completion's timestamp in device clock ticks (`ibv_wc_read_completion_ts()`), when
    /// it was polled from an extended CQ created with
    /// [`WcFlags::COMPLETION_TIMESTAMP`](crate::WcFlags::COMPLETION_TIMESTAMP); `None` otherwise
    /// (and for failed completions). The device's clock rate is `hca_core_clock` (kHz) of
    /// [`Context::query_device_ex`](crate::Context::query_device_ex).
    #[doc(alias = "ibv_wc_read_completion_ts")]
    pub fn timestamp(&self) -> Option<u64> {
        self.ts
    }

    /// Replaces the `wr_id` reported (the async adaptor puts the caller's back in place of its token).
    pub(crate) fn set_wr_id(&mut self, wr_id: u64) {
        self.wc.0.wr_id = wr_id;
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
    /// The vendor's error syndrome (meaningful for failed completions; 0 where the provider
    /// does not report one).
    pub fn vendor_err(&self) -> u32 {
        self.wc.vendor_err()
    }
    /// Whether this completes a request posted through the safe level (and so returned its
    /// buffers). `false` for requests posted with the `unsafe` level, and for stale completions
    /// of a queue pair that was dropped.
    pub fn is_tracked(&self) -> bool {
        self.tracked
    }
    /// Takes the buffers the request held, in SGE order.
    #[inline]
    pub fn take_buffers(&mut self) -> impl Iterator<Item = LocalBuf> + '_ {
        self.bufs.iter_mut().filter_map(Option::take)
    }
    /// Takes the first chunk the request held (the common one-buffer case with pools).
    pub fn take_chunk(&mut self) -> Option<Chunk> {
        self.bufs.iter_mut().find(|b| matches!(b, Some(LocalBuf::Chunk(_))))?.take()?.into_chunk()
    }
    /// The rkey of this process's type 2 window that the peer's Send with Invalidate
    /// invalidated (`IBV_WC_WITH_INV`, `invalidated_rkey`), on a receive completion. Hand the
    /// window and this completion to
    /// [`BoundWindow::remote_invalidated`](crate::BoundWindow::remote_invalidated) to get it back
    /// unbound.
    #[doc(alias = "IBV_WC_WITH_INV")]
    pub fn invalidated_rkey(&self) -> Option<u32> {
        self.wc.invalidated_rkey()
    }
    /// Uses up the invalidation this completion reports (it is evidence for one window only).
    pub(crate) fn consume_invalidation(&mut self) {
        self.wc.0.wc_flags &= !ffi::ibv_wc_flags::IBV_WC_WITH_INV.0;
    }
    /// Takes the window a bind request held, bound (successful bind), or the window of a failed
    /// bind or invalidation (whose state the device did not confirm: treat it as bound; dropping
    /// it deallocates it).
    #[doc(alias = "IBV_WC_BIND_MW")]
    pub fn take_bound_window(&mut self) -> Option<BoundWindow> {
        let ok = self.is_ok();
        let slot = self.bufs.iter_mut().find(|b| match b {
            Some(LocalBuf::Window(w)) => !ok || w.pending == Pending::Bind,
            _ => false,
        })?;
        match slot.take() {
            Some(LocalBuf::Window(w)) => {
                let mut w = *w;
                if ok && w.pending == Pending::Bind {
                    w.commit_rkey();
                }
                w.pending = Pending::None;
                Some(w)
            }
            _ => None,
        }
    }
    /// Takes the window of a *successful* local invalidate or type 1 unbind, unbound: the device
    /// confirmed that no peer can use its old rkey, so it no longer holds its region.
    #[doc(alias = "IBV_WC_LOCAL_INV")]
    pub fn take_invalidated_window(&mut self) -> Option<MemoryWindow> {
        // A successful local invalidate reports LOCAL_INV, a type 1 unbind BIND_MW.
        if !self.is_ok() || !matches!(self.opcode(), WcOpcode::LOCAL_INV | WcOpcode::BIND_MW) {
            return None;
        }
        let slot = self
            .bufs
            .iter_mut()
            .find(|b| matches!(b, Some(LocalBuf::Window(w)) if w.pending == Pending::Invalidate))?;
        match slot.take() {
            Some(LocalBuf::Window(w)) => Some(w.into_unbound()),
            _ => None,
        }
    }
    /// Takes the first owned region the request held (the common one-buffer case).
    ///
    /// The way back for a request of one owned region (`RecvRequest::new(Local::whole(mr))`):
    /// inlined, and that region, in the first entry, is found by one test.
    #[inline]
    pub fn take_region(&mut self) -> Option<MemoryRegion> {
        if matches!(self.bufs[0], Some(LocalBuf::Owned(_))) {
            return self.bufs[0].take().and_then(LocalBuf::into_region);
        }
        self.take_later_region()
    }

    /// [`take_region`](Self::take_region) of a region not in the first entry.
    #[inline(never)]
    fn take_later_region(&mut self) -> Option<MemoryRegion> {
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

/// Drops a completed UD send's address handle ([`Completion::take_slot`]'s cold part).
#[inline(never)]
fn drop_ah(ah: std::sync::Arc<crate::ah::AhInner>) {
    drop(ah);
}

#[cfg(test)]
mod tests {
    use super::*;

    // Light slots (prepared posts) are written with their first buffer entry only: taken back
    // after a failed post, completed through a `Completion`, released with a later one or with
    // the ring, nothing reads past that entry (run under Miri, an uninitialised read fails).
    #[test]
    fn light_slots_are_read_no_further_than_their_first_entry() {
        use crate::post::prepared::{light_slot, write_light_slot};
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(8, false)]).unwrap();
        let writer = ring.light_writer();
        for pos in 0..5u32 {
            // SAFETY: the producer of a fresh ring; positions 0..5 are free.
            unsafe {
                if pos % 2 == 0 {
                    write_light_slot(&ring, pos, 100 + u64::from(pos));
                } else {
                    writer.write(pos, |slot| light_slot(slot, 100 + u64::from(pos)));
                }
            }
        }
        ring.set_head(5);
        // A post that failed: the last one withdrawn and taken back whole.
        ring.set_head(4);
        // SAFETY: withdrawn before the consumer could see it.
        let back = unsafe { ring.take_back(4) };
        assert_eq!(back.wr_id, 104);
        assert!(back.bufs.into_array().iter().all(Option::is_none));
        // The completion of position 1 releases 0 with it and takes 1 where it lies.
        let mut c = Completion::default();
        let wc = ffi::ibv_wc { wr_id: ring.device_wr_id(1), ..Default::default() };
        // SAFETY: the registry's only consumer; the entry is fresh (cleared).
        unsafe { c.fill(&wc, &reg) };
        assert_eq!(c.wr_id(), 101);
        assert!(c.take_buffers().next().is_none(), "a light slot hands back nothing");
        assert_eq!(ring.outstanding(), 2);
        // Positions 2 and 3 are released with the ring (popped whole and dropped).
        drop(ring);
        drop(reg);
    }

    #[test]
    #[cfg_attr(miri, ignore = "calls into libibverbs")]
    fn wc_status_is_sound_for_any_value_and_names_it() {
        assert_eq!(WcStatus::SUCCESS.as_str(), "success");
        assert_eq!(WcStatus::REM_ACCESS_ERR.as_str(), "remote access error");
        assert_eq!(WcStatus::RETRY_EXC_ERR.0, 12);
        assert_eq!(WcStatus(0xdead).as_str(), "unknown");
        assert_eq!(format!("{:?}", WcOpcode::RECV), "RECV");
        assert_eq!(format!("{:?}", WcOpcode(999)), "WcOpcode(999)");
    }

    /// The texts used without libibverbs are the library's.
    #[test]
    #[cfg_attr(miri, ignore = "calls into libibverbs")]
    fn fallback_wc_status_names_are_the_librarys() {
        ffi::load().expect("the host tests run with libibverbs");
        for v in 0..64 {
            // SAFETY: a static string for any value.
            let p = unsafe { ffi::ibv_wc_status_str(ffi::ibv_wc_status(v)) };
            // SAFETY: NUL-terminated.
            let c = unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap();
            assert_eq!(wc_status_name(v), c, "status {v}");
        }
    }

    #[test]
    fn work_completion_is_transparent_and_reads_imm() {
        assert_eq!(std::mem::size_of::<WorkCompletion>(), std::mem::size_of::<ffi::ibv_wc>());
        let mut wc = ffi::ibv_wc::default();
        wc.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
        assert_eq!(WorkCompletion(wc).imm_data(), None);
        wc.wc_flags = ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0;
        wc.opcode = ffi::ibv_wc_opcode::IBV_WC_RECV;
        assert_eq!(WorkCompletion(wc).imm_data(), Some(0x1234_5678));
        wc.opcode = ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM;
        assert_eq!(WorkCompletion(wc).imm_data(), Some(0x1234_5678));
    }

    /// Immediate data, an invalidated rkey and the GRH flag belong to successful receives:
    /// mlx4/mlx5 flag `WITH_IMM` on the sender's completion too (with no value), and a failed
    /// completion's flags may be an earlier entry's.
    #[test]
    fn only_successful_receives_report_what_the_message_carried() {
        use ffi::{ibv_wc_flags as F, ibv_wc_opcode as O, ibv_wc_status as S};
        let wc = |opcode, status, flags| {
            let mut wc = ffi::ibv_wc { opcode, status, wc_flags: flags, ..Default::default() };
            wc.__bindgen_anon_1.imm_data = 0xfeedu32.to_be();
            WorkCompletion(wc)
        };
        let (imm, inv, grh) = (F::IBV_WC_WITH_IMM.0, F::IBV_WC_WITH_INV.0, F::IBV_WC_GRH.0);
        // The sender's own completions of a Send and a Write with immediate (mlx5's flags).
        assert_eq!(wc(O::IBV_WC_SEND, S::IBV_WC_SUCCESS, imm).imm_data(), None);
        assert_eq!(wc(O::IBV_WC_RDMA_WRITE, S::IBV_WC_SUCCESS, imm).imm_data(), None);
        // A failed completion with an earlier entry's flags.
        let failed = wc(O::IBV_WC_RECV, S::IBV_WC_WR_FLUSH_ERR, imm | grh);
        assert_eq!((failed.imm_data(), failed.has_grh()), (None, false));
        assert_eq!(wc(O::IBV_WC_RECV, S::IBV_WC_REM_ACCESS_ERR, inv).invalidated_rkey(), None);
        // Receives.
        let recv = wc(O::IBV_WC_RECV, S::IBV_WC_SUCCESS, imm | grh);
        assert_eq!((recv.imm_data(), recv.has_grh()), (Some(0xfeed), true));
        let invalidated = wc(O::IBV_WC_RECV, S::IBV_WC_SUCCESS, inv);
        assert_eq!(invalidated.invalidated_rkey(), Some(0xfeedu32.to_be()));
        // mlx4 ORs WITH_INV into what was there: the union then holds the rkey, not a value.
        assert_eq!(wc(O::IBV_WC_RECV, S::IBV_WC_SUCCESS, imm | inv).imm_data(), None);
    }

    #[test]
    fn untagged_completions_are_passed_through() {
        let reg = Registry::<Slot>::for_tests(8);
        let mut c = Completion::default();
        let wc = ffi::ibv_wc { wr_id: 77, ..Default::default() };
        // SAFETY: single consumer.
        unsafe { c.fill(&wc, &reg) };
        assert_eq!(c.wr_id(), 77);
        assert!(!c.is_tracked());
        // A tagged wr_id naming no ring is not dereferenced.
        let wc = ffi::ibv_wc { wr_id: TAG | (5 << 32) | 3, ..Default::default() };
        c.clear();
        // SAFETY: single consumer.
        unsafe { c.fill(&wc, &reg) };
        assert!(!c.is_tracked());
    }
}
