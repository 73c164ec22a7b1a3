//! The extended posting path of a queue pair created with
//! [`QueuePairBuilder::send_ops`](crate::QueuePairBuilder::send_ops): the work-request builders of
//! `struct ibv_qp_ex` (`ibv_wr_start`, `ibv_wr_send`, `ibv_wr_rdma_write`, ..., the `ibv_wr_set_*`
//! setters, `ibv_wr_complete`) instead of `ibv_post_send`.
//!
//! The ownership machinery is the classic path's, unchanged: each request is first built as the
//! classic `ibv_send_wr` by the same [`Request::fill_raw`] (so every check, every `wr_id` and every
//! slot is the same), its buffers move into its work queue's [`Ring`] before the doorbell, and the
//! same completions hand them back. Only the hand-over to the provider differs: the `ibv_send_wr`
//! is replayed as builder calls, and one `ibv_wr_complete` rings the doorbell for the whole batch.
//! `ibv_wr_post(3)` says `ibv_wr_complete` is all or nothing ("If it fails, none of the WRs are
//! posted"), but rxe makes the batch visible to the device (its producer index) *before* the
//! doorbell system call whose failure it returns, so a batch refused there may still run. The
//! checks before `ibv_wr_start` leave a provider no reason of its own to refuse a batch (every
//! operation enabled, room in the queue, SGE counts and inline sizes within the QP's limits), so a
//! failing `ibv_wr_complete` is taken as a failed doorbell: the batch stays posted, its slots keep
//! its buffers until its completions (or the queue pair's end) release them, and the error is
//! [`Error::QueuedWithError`], as on the classic path when the provider queued the requests.

use ibverbs_sys as ffi;

use crate::error::{Error, Result};
use crate::post::engine::batch_head;
use crate::post::ring::Ring;
use crate::post::slot::{Request, Slot};
use crate::post::wr::MAX_SGE;

bitflags::bitflags! {
    /// The send operations an extended queue pair is created for (`send_ops_flags` of
    /// `struct ibv_qp_init_attr_ex`, the `IBV_QP_EX_WITH_*` flags of
    /// `enum ibv_qp_create_send_ops_flags`). A safe post of an operation not in the set is refused
    /// with [`Error::SendOpNotEnabled`] before anything is posted.
    #[doc(alias = "ibv_qp_create_send_ops_flags")]
    #[doc(alias = "send_ops_flags")]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct SendOps: u64 {
        /// RDMA Write (`IBV_QP_EX_WITH_RDMA_WRITE`, `ibv_wr_rdma_write()`).
        const RDMA_WRITE = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0 as u64;
        /// RDMA Write with immediate (`IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM`, `ibv_wr_rdma_write_imm()`).
        const RDMA_WRITE_WITH_IMM =
            ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM.0 as u64;
        /// Send (`IBV_QP_EX_WITH_SEND`, `ibv_wr_send()`).
        const SEND = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND.0 as u64;
        /// Send with immediate (`IBV_QP_EX_WITH_SEND_WITH_IMM`, `ibv_wr_send_imm()`).
        const SEND_WITH_IMM = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND_WITH_IMM.0 as u64;
        /// RDMA Read (`IBV_QP_EX_WITH_RDMA_READ`, `ibv_wr_rdma_read()`).
        const RDMA_READ = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_READ.0 as u64;
        /// Atomic compare-and-swap (`IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP`, `ibv_wr_atomic_cmp_swp()`).
        const ATOMIC_CMP_AND_SWP =
            ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP.0 as u64;
        /// Atomic fetch-and-add (`IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD`, `ibv_wr_atomic_fetch_add()`).
        const ATOMIC_FETCH_AND_ADD =
            ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD.0 as u64;
        /// Every operation the safe requests ([`SendRequest`](SendRequest)) can carry.
        const ALL_SAFE = Self::RDMA_WRITE.bits()
            | Self::RDMA_WRITE_WITH_IMM.bits()
            | Self::SEND.bits()
            | Self::SEND_WITH_IMM.bits()
            | Self::RDMA_READ.bits()
            | Self::ATOMIC_CMP_AND_SWP.bits()
            | Self::ATOMIC_FETCH_AND_ADD.bits();
        /// Binding a type 2 memory window (`IBV_QP_EX_WITH_BIND_MW`, `ibv_wr_bind_mw()`): what
        /// [`SendRequest::bind_window`](crate::SendRequest::bind_window) posts. Not in
        /// [`ALL_SAFE`](Self::ALL_SAFE): devices without windows refuse a QP created with it.
        const BIND_MW = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_BIND_MW.0 as u64;
        /// Local invalidate (`IBV_QP_EX_WITH_LOCAL_INV`, `ibv_wr_local_inv()`): what
        /// [`SendRequest::local_invalidate`](crate::SendRequest::local_invalidate) posts. Not in
        /// [`ALL_SAFE`](Self::ALL_SAFE).
        const LOCAL_INV = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_LOCAL_INV.0 as u64;
        /// Send with Invalidate (`IBV_QP_EX_WITH_SEND_WITH_INV`, `ibv_wr_send_inv()`): what
        /// [`SendRequest::send_with_invalidate`](crate::SendRequest::send_with_invalidate)
        /// posts. Not in [`ALL_SAFE`](Self::ALL_SAFE).
        const SEND_WITH_INV = ffi::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND_WITH_INV.0 as u64;
        // Flags of newer rdma-core releases (TSO, ...) survive a round trip; the safe level never
        // posts those operations.
        const _ = !0;
    }
}

/// The operation flag a classic work request needs on an extended QP, and its name; `None` for an
/// opcode the extended path has no call for.
fn required_op(opcode: ffi::ibv_wr_opcode) -> Option<(SendOps, &'static str)> {
    use ffi::ibv_wr_opcode as O;
    Some(match opcode {
        O::IBV_WR_SEND => (SendOps::SEND, "IBV_QP_EX_WITH_SEND"),
        O::IBV_WR_SEND_WITH_IMM => (SendOps::SEND_WITH_IMM, "IBV_QP_EX_WITH_SEND_WITH_IMM"),
        O::IBV_WR_RDMA_WRITE => (SendOps::RDMA_WRITE, "IBV_QP_EX_WITH_RDMA_WRITE"),
        O::IBV_WR_RDMA_WRITE_WITH_IMM => (SendOps::RDMA_WRITE_WITH_IMM, "IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM"),
        O::IBV_WR_RDMA_READ => (SendOps::RDMA_READ, "IBV_QP_EX_WITH_RDMA_READ"),
        O::IBV_WR_ATOMIC_CMP_AND_SWP => (SendOps::ATOMIC_CMP_AND_SWP, "IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP"),
        O::IBV_WR_ATOMIC_FETCH_AND_ADD => {
            (SendOps::ATOMIC_FETCH_AND_ADD, "IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD")
        }
        O::IBV_WR_BIND_MW => (SendOps::BIND_MW, "IBV_QP_EX_WITH_BIND_MW"),
        O::IBV_WR_LOCAL_INV => (SendOps::LOCAL_INV, "IBV_QP_EX_WITH_LOCAL_INV"),
        O::IBV_WR_SEND_WITH_INV => (SendOps::SEND_WITH_INV, "IBV_QP_EX_WITH_SEND_WITH_INV"),
        _ => return None,
    })
}

type Start = unsafe extern "C" fn(*mut ffi::ibv_qp_ex);
type Complete = unsafe extern "C" fn(*mut ffi::ibv_qp_ex) -> i32;
type Plain = unsafe extern "C" fn(*mut ffi::ibv_qp_ex);
type WithImm = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, u32);
type Rdma = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, u32, u64);
type RdmaImm = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, u32, u64, u32);
type Cas = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, u32, u64, u64, u64);
type Faa = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, u32, u64, u64);
type SgeList = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, usize, *const ffi::ibv_sge);
type Inline = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, *mut std::ffi::c_void, usize);
type UdAddr = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, *mut ffi::ibv_ah, u32, u32);
type BindMw = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, *mut ffi::ibv_mw, u32, *const ffi::ibv_mw_bind_info);
type Invalidate = unsafe extern "C" fn(*mut ffi::ibv_qp_ex, u32);

/// The builder table of one extended QP, read once at creation (as the classic path reads
/// `context->ops.post_send` once): the provider fills `struct ibv_qp_ex`'s function pointers in
/// `ibv_create_qp_ex` and never changes them. An operation whose pointer the provider left `NULL`
/// is treated as not enabled.
#[derive(Clone, Copy)]
pub(crate) struct ExQp {
    pub(crate) raw: *mut ffi::ibv_qp_ex,
    /// The operations asked for at creation whose builder the provider filled in.
    pub(crate) ops: SendOps,
    ud: bool,
    start: Start,
    complete: Complete,
    send: Option<Plain>,
    send_imm: Option<WithImm>,
    write: Option<Rdma>,
    write_imm: Option<RdmaImm>,
    read: Option<Rdma>,
    cas: Option<Cas>,
    faa: Option<Faa>,
    sge_list: SgeList,
    inline: Inline,
    ud_addr: Option<UdAddr>,
    bind_mw: Option<BindMw>,
    local_inv: Option<Invalidate>,
    send_inv: Option<Invalidate>,
}

impl std::fmt::Debug for ExQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExQp").field("ops", &self.ops).field("ud", &self.ud).finish_non_exhaustive()
    }
}

impl ExQp {
    /// Reads the builder table of `raw`. `None` when the provider did not fill in the calls every
    /// post needs (`wr_start`, `wr_complete`, the SGE and inline setters, and for UD the address
    /// setter).
    ///
    /// # Safety
    /// `raw` points to a valid `struct ibv_qp_ex` (from `ibv_qp_to_qp_ex` of a QP created with
    /// `ibv_create_qp_ex`) that outlives every use of the result.
    pub(crate) unsafe fn new(raw: *mut ffi::ibv_qp_ex, asked: SendOps, ud: bool) -> Option<ExQp> {
        // SAFETY: valid (contract); the function pointers are plain fields.
        let t = unsafe { &*raw };
        let mut ops = SendOps::empty();
        let mut keep = |flag: SendOps, present: bool| {
            if asked.contains(flag) && present {
                ops |= flag;
            }
        };
        keep(SendOps::SEND, t.wr_send.is_some());
        keep(SendOps::SEND_WITH_IMM, t.wr_send_imm.is_some());
        keep(SendOps::RDMA_WRITE, t.wr_rdma_write.is_some());
        keep(SendOps::RDMA_WRITE_WITH_IMM, t.wr_rdma_write_imm.is_some());
        keep(SendOps::RDMA_READ, t.wr_rdma_read.is_some());
        keep(SendOps::ATOMIC_CMP_AND_SWP, t.wr_atomic_cmp_swp.is_some());
        keep(SendOps::ATOMIC_FETCH_AND_ADD, t.wr_atomic_fetch_add.is_some());
        keep(SendOps::BIND_MW, t.wr_bind_mw.is_some());
        keep(SendOps::LOCAL_INV, t.wr_local_inv.is_some());
        keep(SendOps::SEND_WITH_INV, t.wr_send_inv.is_some());
        let ud_addr = t.wr_set_ud_addr;
        if ud && ud_addr.is_none() {
            return None;
        }
        Some(ExQp {
            raw,
            ops,
            ud,
            start: t.wr_start?,
            complete: t.wr_complete?,
            send: t.wr_send,
            send_imm: t.wr_send_imm,
            write: t.wr_rdma_write,
            write_imm: t.wr_rdma_write_imm,
            read: t.wr_rdma_read,
            cas: t.wr_atomic_cmp_swp,
            faa: t.wr_atomic_fetch_add,
            sge_list: t.wr_set_sge_list?,
            inline: t.wr_set_inline_data?,
            ud_addr,
            bind_mw: t.wr_bind_mw,
            local_inv: t.wr_local_inv,
            send_inv: t.wr_send_inv,
        })
    }

    /// Checks that this QP can build `wr`.
    fn check(&self, wr: &ffi::ibv_send_wr) -> Result<()> {
        let verb = "ibv_wr_start";
        match required_op(wr.opcode) {
            Some((flag, _)) if self.ops.contains(flag) => Ok(()),
            Some((_, op)) => Err(Error::SendOpNotEnabled { verb, op }),
            None => Err(Error::SendOpNotEnabled {
                verb,
                op: "(an opcode the extended posting path does not build: type 1 window binds go through ibv_bind_mw)",
            }),
        }
    }

    /// Replays one checked classic work request as builder calls (between `wr_start` and
    /// `wr_complete`).
    ///
    /// # Safety
    /// Called between this QP's `wr_start` and `wr_complete` by the one thread posting (the
    /// caller holds `&mut QueuePair`); `wr` passed [`check`](Self::check) and describes memory
    /// that stays valid until its completion (or, for inline data, during this call).
    unsafe fn build(&self, wr: &ffi::ibv_send_wr) {
        use ffi::ibv_wr_opcode as O;
        let q = self.raw;
        // SAFETY: `q` is valid; the builders read `wr_id` and `wr_flags` when called.
        unsafe {
            (*q).wr_id = wr.wr_id;
            (*q).wr_flags = wr.send_flags;
        }
        // SAFETY: the union members read are those `fill` wrote for the opcode; the builder of each
        // opcode is present (checked); the arguments are what the classic request carries.
        unsafe {
            // Read per opcode, only the union member `fill` wrote: another member may overlap
            // its padding (e.g. `rdma.rkey`'s tail under `atomic.compare_add`).
            let imm = || wr.__bindgen_anon_1.imm_data;
            match wr.opcode {
                O::IBV_WR_SEND => call(self.send)(q),
                O::IBV_WR_SEND_WITH_IMM => call(self.send_imm)(q, imm()),
                O::IBV_WR_RDMA_WRITE => call(self.write)(q, wr.wr.rdma.rkey, wr.wr.rdma.remote_addr),
                O::IBV_WR_RDMA_WRITE_WITH_IMM => {
                    call(self.write_imm)(q, wr.wr.rdma.rkey, wr.wr.rdma.remote_addr, imm())
                }
                O::IBV_WR_RDMA_READ => call(self.read)(q, wr.wr.rdma.rkey, wr.wr.rdma.remote_addr),
                O::IBV_WR_ATOMIC_CMP_AND_SWP => {
                    let a = &wr.wr.atomic;
                    call(self.cas)(q, a.rkey, a.remote_addr, a.compare_add, a.swap)
                }
                O::IBV_WR_ATOMIC_FETCH_AND_ADD => {
                    let a = &wr.wr.atomic;
                    call(self.faa)(q, a.rkey, a.remote_addr, a.compare_add)
                }
                O::IBV_WR_SEND_WITH_INV => call(self.send_inv)(q, wr.__bindgen_anon_1.invalidate_rkey),
                // A bind and a local invalidate are whole work requests: no address or data
                // setter follows them (a provider may have finished the WQE already, as mlx5
                // does). The bind info points into `wr`, read during the call.
                O::IBV_WR_BIND_MW => {
                    let b = &wr.__bindgen_anon_2.bind_mw;
                    call(self.bind_mw)(q, b.mw, b.rkey, &b.bind_info);
                    return;
                }
                O::IBV_WR_LOCAL_INV => {
                    call(self.local_inv)(q, wr.__bindgen_anon_1.invalidate_rkey);
                    return;
                }
                _ => unreachable!("checked before wr_start"),
            }
            if self.ud {
                let ud = wr.wr.ud;
                call(self.ud_addr)(q, ud.ah, ud.remote_qpn, ud.remote_qkey);
            }
            let n = usize::try_from(wr.num_sge).unwrap_or(0);
            if wr.send_flags & ffi::ibv_send_flags::IBV_SEND_INLINE.0 != 0 {
                // `fill` puts inline data in the first SGE (none for empty data); the provider
                // copies it during this call.
                let (addr, len) = if n == 0 {
                    (std::ptr::NonNull::<std::ffi::c_void>::dangling().as_ptr(), 0)
                } else {
                    let s = *wr.sg_list;
                    (s.addr as usize as *mut std::ffi::c_void, s.length as usize)
                };
                (self.inline)(q, addr, len);
            } else {
                (self.sge_list)(q, n, wr.sg_list);
            }
        }
    }
}

/// A builder checked present before use.
#[inline(always)]
fn call<F>(f: Option<F>) -> F {
    // A `None` would mean `check` let an operation through whose builder is missing: `ops` only
    // holds operations whose builder is present.
    f.unwrap_or_else(|| unreachable!("builder checked present"))
}

/// Posts checked requests as one batch of builder calls with one doorbell (`ibv_wr_complete`), on
/// `ring`'s send queue of the extended QP `ex`. The requests are first filled as classic work
/// requests into `scratch` and `scratch_sges` (their first `wrs.len()` entries). On success, and
/// on [`Error::QueuedWithError`] (a failed `ibv_wr_complete`: see the module doc), every
/// request's buffers are in the ring and every request is posted; on any other error nothing was
/// posted and every request keeps its buffers.
// Inlined into its two callers (single post, chain); the classic path does not call it.
#[inline]
pub(crate) fn post_batch<R: Request<Raw = ffi::ibv_send_wr>>(
    ex: &ExQp,
    ring: &Ring<Slot>,
    scratch: &mut [ffi::ibv_send_wr],
    scratch_sges: &mut [[ffi::ibv_sge; MAX_SGE]],
    wrs: &mut [R],
) -> Result<()> {
    let n = wrs.len();
    if n == 0 {
        return Ok(());
    }
    let head = batch_head(ring, n, scratch.len().min(scratch_sges.len()), R::VERB)?;
    // Pass 1, no side effect: the classic requests, each checked against the QP's operations.
    for (i, wr) in wrs.iter().enumerate() {
        let (raw, sges) = (&mut scratch[i], &mut scratch_sges[i]);
        wr.fill_raw(raw, sges, ring.device_wr_id(head.wrapping_add(i as u32)));
        // `fill` pointed `sg_list` at `sges`; re-pointed in pass 2, after the last `&mut`.
        ex.check(raw)?;
    }
    // Pass 2: one builder sequence; each request's buffers move into its slot.
    // SAFETY: valid extended QP; we are its only poster (&mut QueuePair).
    unsafe { (ex.start)(ex.raw) };
    for (i, wr) in wrs.iter_mut().enumerate() {
        let raw = &mut scratch[i];
        raw.sg_list = scratch_sges[i].as_mut_ptr();
        // SAFETY: between wr_start and wr_complete; checked in pass 1; the SGEs name memory of
        // buffers about to move into the slot (the move does not move the memory), or memory a
        // scope's borrow keeps until its drain saw the slot's position released.
        unsafe { ex.build(raw) };
        // SAFETY: producer; positions head..head + n are free (n <= free).
        unsafe { wr.write_slot(ring, head.wrapping_add(i as u32)) };
    }
    // Published before the doorbell: a completion may be polled before wr_complete returns.
    ring.set_head(head.wrapping_add(n as u32));
    // SAFETY: ends the builder sequence started above.
    let ret = unsafe { (ex.complete)(ex.raw) };
    if ret == 0 {
        return Ok(());
    }
    // Not withdrawn: rxe may have queued the batch before its doorbell failed (module doc).
    // Slots of requests that never reached the device are released by a later completion of
    // this queue, or with the ring.
    Err(Error::queued_with("ibv_wr_complete", ret))
}

/// [`post_batch`] of a whole chain: on success `wrs` is emptied here, in the same instance (the
/// requests' drop glue then compiles as in the classic `post_chain`, about 100 instructions per
/// request cheaper under callgrind than emptying it in the caller), and on
/// [`Error::QueuedWithError`] (every request posted); on any other error it keeps every request.
#[inline(never)]
pub(crate) fn post_chain<R: Request<Raw = ffi::ibv_send_wr>>(
    ex: &ExQp,
    ring: &Ring<Slot>,
    scratch: &mut [ffi::ibv_send_wr],
    scratch_sges: &mut [[ffi::ibv_sge; MAX_SGE]],
    wrs: &mut Vec<R>,
) -> Result<()> {
    match post_batch(ex, ring, scratch, scratch_sges, wrs) {
        Ok(()) => {
            wrs.clear();
            Ok(())
        }
        Err(e @ Error::QueuedWithError { .. }) => {
            // Every request is posted, its buffers in its slot: as the classic chain does.
            R::clear_posted(wrs);
            Err(e)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RemoteSlice;
    use crate::post::registry::Registry;
    use crate::post::ring::TAG;
    use crate::post::wr::SendRequest;
    use std::cell::RefCell;

    /// What the fake provider saw, in order.
    #[derive(Debug, PartialEq)]
    enum Call {
        Start,
        Send { wr_id: u64, flags: u32 },
        SendImm(u32),
        Write { rkey: u32, addr: u64 },
        Cas { compare: u64, swap: u64 },
        Sges(usize),
        Inline(Vec<u8>),
        Complete,
        Bind { rkey: u32, addr: u64, len: u64, access: u32 },
        LocalInv(u32),
        SendInv(u32),
    }

    thread_local! {
        static CALLS: RefCell<Vec<Call>> = const { RefCell::new(Vec::new()) };
        static COMPLETE_RET: RefCell<i32> = const { RefCell::new(0) };
    }

    fn log(c: Call) {
        CALLS.with(|l| l.borrow_mut().push(c));
    }

    unsafe extern "C" fn start(_q: *mut ffi::ibv_qp_ex) {
        log(Call::Start);
    }
    unsafe extern "C" fn complete(_q: *mut ffi::ibv_qp_ex) -> i32 {
        log(Call::Complete);
        COMPLETE_RET.with(|r| *r.borrow())
    }
    unsafe extern "C" fn send(q: *mut ffi::ibv_qp_ex) {
        // SAFETY: the engine passes its valid QP.
        let (wr_id, flags) = unsafe { ((*q).wr_id, (*q).wr_flags) };
        log(Call::Send { wr_id, flags });
    }
    unsafe extern "C" fn send_imm(_q: *mut ffi::ibv_qp_ex, imm: u32) {
        log(Call::SendImm(u32::from_be(imm)));
    }
    unsafe extern "C" fn write(_q: *mut ffi::ibv_qp_ex, rkey: u32, addr: u64) {
        log(Call::Write { rkey, addr });
    }
    unsafe extern "C" fn cas(_q: *mut ffi::ibv_qp_ex, _rkey: u32, _addr: u64, compare: u64, swap: u64) {
        log(Call::Cas { compare, swap });
    }
    unsafe extern "C" fn sge_list(_q: *mut ffi::ibv_qp_ex, n: usize, sges: *const ffi::ibv_sge) {
        for k in 0..n {
            // SAFETY: the engine hands `n` valid SGEs (read the way a provider copies them).
            let _ = unsafe { *sges.add(k) };
        }
        log(Call::Sges(n));
    }
    unsafe extern "C" fn inline(_q: *mut ffi::ibv_qp_ex, addr: *mut std::ffi::c_void, len: usize) {
        let data = if len == 0 {
            Vec::new()
        } else {
            // SAFETY: the engine hands inline data valid for `len` bytes during the call.
            unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec()
        };
        log(Call::Inline(data));
    }

    unsafe extern "C" fn bind_mw(
        _q: *mut ffi::ibv_qp_ex,
        _mw: *mut ffi::ibv_mw,
        rkey: u32,
        info: *const ffi::ibv_mw_bind_info,
    ) {
        // SAFETY: the engine passes bind info valid during the call.
        let i = unsafe { &*info };
        log(Call::Bind { rkey, addr: i.addr, len: i.length, access: i.mw_access_flags });
    }
    unsafe extern "C" fn local_inv(_q: *mut ffi::ibv_qp_ex, rkey: u32) {
        log(Call::LocalInv(rkey));
    }
    unsafe extern "C" fn send_inv(_q: *mut ffi::ibv_qp_ex, rkey: u32) {
        log(Call::SendInv(rkey));
    }

    /// A fake `struct ibv_qp_ex` with Send, Send with immediate, RDMA Write and compare-and-swap.
    fn fake_qp() -> Box<ffi::ibv_qp_ex> {
        let mut q = Box::<ffi::ibv_qp_ex>::default();
        q.wr_start = Some(start);
        q.wr_complete = Some(complete);
        q.wr_send = Some(send);
        q.wr_send_imm = Some(send_imm);
        q.wr_rdma_write = Some(write);
        q.wr_atomic_cmp_swp = Some(cas);
        q.wr_set_sge_list = Some(sge_list);
        q.wr_set_inline_data = Some(inline);
        q
    }

    fn setup(q: &mut ffi::ibv_qp_ex, asked: SendOps) -> ExQp {
        CALLS.with(|l| l.borrow_mut().clear());
        COMPLETE_RET.with(|r| *r.borrow_mut() = 0);
        // SAFETY: the fake QP outlives the test.
        unsafe { ExQp::new(q, asked, false) }.expect("table complete")
    }

    fn calls() -> Vec<Call> {
        CALLS.with(|l| std::mem::take(&mut *l.borrow_mut()))
    }

    #[test]
    fn operations_the_provider_lacks_are_not_enabled() {
        let mut q = fake_qp();
        let ex = setup(&mut q, SendOps::ALL_SAFE);
        assert_eq!(
            ex.ops,
            SendOps::SEND | SendOps::SEND_WITH_IMM | SendOps::RDMA_WRITE | SendOps::ATOMIC_CMP_AND_SWP
        );
        q.wr_set_sge_list = None;
        // SAFETY: valid fake QP.
        assert!(unsafe { ExQp::new(&mut *q, SendOps::SEND, false) }.is_none());
        // SAFETY: valid fake QP.
        assert!(unsafe { ExQp::new(&mut *q, SendOps::SEND, true) }.is_none(), "UD needs set_ud_addr");
    }

    #[test]
    fn a_batch_is_built_in_order_with_one_doorbell() {
        let mut q = fake_qp();
        let ex = setup(&mut q, SendOps::ALL_SAFE);
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(8, false)]).unwrap();
        let remote = RemoteSlice { addr: 0x1000, len: 64, rkey: 9 };
        let data = *b"inline!!";
        let mut scratch = vec![ffi::ibv_send_wr::default(); 8];
        let mut sges = vec![[ffi::ibv_sge::default(); MAX_SGE]; 8];
        let mut wrs = vec![
            SendRequest::send_inline(&data).wr_id(1),
            SendRequest::send_inline(&[]).imm(0xabcd).unsignaled(),
            SendRequest::write_inline(&data, remote),
        ];
        post_batch(&ex, &ring, &mut scratch, &mut sges, &mut wrs).unwrap();
        let signaled = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let inl = ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        assert_eq!(
            calls(),
            vec![
                Call::Start,
                Call::Send { wr_id: ring.device_wr_id(0), flags: signaled | inl },
                Call::Inline(data.to_vec()),
                Call::SendImm(0xabcd),
                Call::Inline(Vec::new()),
                Call::Write { rkey: 9, addr: 0x1000 },
                Call::Inline(data.to_vec()),
                Call::Complete,
            ]
        );
        assert_eq!(ring.outstanding(), 3);
        assert_ne!(ring.device_wr_id(0) & TAG, 0);
    }

    // A bind and a local invalidate are whole requests (mlx5 finishes their WQE in the builder):
    // no SGE or inline setter may follow them; a Send with Invalidate takes its SGEs like a Send.
    #[test]
    fn binds_and_invalidations_are_built_without_data_setters_and_need_their_flags() {
        use ffi::ibv_wr_opcode as O;
        let mut q = fake_qp();
        q.wr_bind_mw = Some(bind_mw);
        q.wr_local_inv = Some(local_inv);
        q.wr_send_inv = Some(send_inv);
        let ex =
            setup(&mut q, SendOps::SEND | SendOps::BIND_MW | SendOps::LOCAL_INV | SendOps::SEND_WITH_INV);
        assert_eq!(ex.ops, SendOps::SEND | SendOps::BIND_MW | SendOps::LOCAL_INV | SendOps::SEND_WITH_INV);
        let mut sges = [ffi::ibv_sge::default(); MAX_SGE];
        let mut wr = ffi::ibv_send_wr { sg_list: sges.as_mut_ptr(), ..Default::default() };
        wr.opcode = O::IBV_WR_BIND_MW;
        wr.__bindgen_anon_2.bind_mw = ffi::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
            mw: std::ptr::null_mut(),
            rkey: 0x1234,
            bind_info: ffi::ibv_mw_bind_info {
                mr: std::ptr::null_mut(),
                addr: 0x1000,
                length: 64,
                mw_access_flags: 2,
            },
        };
        ex.check(&wr).unwrap();
        // SAFETY: a fake QP; the request names no memory.
        unsafe { ex.build(&wr) };
        wr.opcode = O::IBV_WR_LOCAL_INV;
        wr.__bindgen_anon_1.invalidate_rkey = 0x55;
        ex.check(&wr).unwrap();
        // SAFETY: as above.
        unsafe { ex.build(&wr) };
        wr.opcode = O::IBV_WR_SEND_WITH_INV;
        wr.__bindgen_anon_1.invalidate_rkey = 0x66;
        ex.check(&wr).unwrap();
        // SAFETY: as above (no SGE).
        unsafe { ex.build(&wr) };
        assert_eq!(
            calls(),
            vec![
                Call::Bind { rkey: 0x1234, addr: 0x1000, len: 64, access: 2 },
                Call::LocalInv(0x55),
                Call::SendInv(0x66),
                Call::Sges(0),
            ]
        );
        let only_send = setup(&mut q, SendOps::SEND);
        for (op, name) in [
            (O::IBV_WR_BIND_MW, "IBV_QP_EX_WITH_BIND_MW"),
            (O::IBV_WR_LOCAL_INV, "IBV_QP_EX_WITH_LOCAL_INV"),
            (O::IBV_WR_SEND_WITH_INV, "IBV_QP_EX_WITH_SEND_WITH_INV"),
        ] {
            wr.opcode = op;
            let e = only_send.check(&wr).unwrap_err();
            assert!(matches!(e, Error::SendOpNotEnabled { op, .. } if op == name), "{e:?}");
        }
    }

    #[test]
    fn an_operation_not_enabled_is_refused_before_wr_start() {
        let mut q = fake_qp();
        let ex = setup(&mut q, SendOps::SEND);
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(8, false)]).unwrap();
        let mut scratch = vec![ffi::ibv_send_wr::default(); 8];
        let mut sges = vec![[ffi::ibv_sge::default(); MAX_SGE]; 8];
        let remote = RemoteSlice { addr: 0x1000, len: 64, rkey: 9 };
        let mut wrs = vec![SendRequest::send_inline(b"a"), SendRequest::write_inline(b"b", remote)];
        let e = post_batch(&ex, &ring, &mut scratch, &mut sges, &mut wrs).unwrap_err();
        assert!(matches!(e, Error::SendOpNotEnabled { op: "IBV_QP_EX_WITH_RDMA_WRITE", .. }), "{e:?}");
        assert!(calls().is_empty(), "nothing reached the provider");
        assert_eq!(ring.outstanding(), 0);
        assert_eq!(wrs.len(), 2);
    }

    // The provider fails at wr_complete. rxe publishes the batch before its doorbell system call
    // can fail, so the batch may be queued: every slot stays published, holding its request's
    // buffers, and the error says the requests are posted (Miri checks that no slot is read
    // twice or leaked). A later completion of the queue releases the slots up to its own.
    #[test]
    fn a_failed_wr_complete_leaves_the_batch_posted() {
        let mut q = fake_qp();
        let ex = setup(&mut q, SendOps::ALL_SAFE);
        COMPLETE_RET.with(|r| *r.borrow_mut() = libc::ENOMEM);
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(8, false)]).unwrap();
        let mut scratch = vec![ffi::ibv_send_wr::default(); 8];
        let mut sges = vec![[ffi::ibv_sge::default(); MAX_SGE]; 8];
        let mut wrs: Vec<SendRequest> = (0..5).map(|i| SendRequest::send_inline(b"x").wr_id(i)).collect();
        let e = post_chain(&ex, &ring, &mut scratch, &mut sges, &mut wrs).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM));
        assert!(matches!(e, Error::QueuedWithError { verb: "ibv_wr_complete", .. }), "{e:?}");
        assert_eq!(ring.outstanding(), 5, "every slot stays published");
        assert_eq!(ring.producer_state(), (5, 3));
        assert!(wrs.is_empty(), "every request is posted");
        assert_eq!(calls().last(), Some(&Call::Complete));
        // The ring goes on from there; the completion of the next post releases them all.
        COMPLETE_RET.with(|r| *r.borrow_mut() = 0);
        let mut more = vec![SendRequest::send_inline(b"y").wr_id(9)];
        post_chain(&ex, &ring, &mut scratch, &mut sges, &mut more).unwrap();
        assert_eq!(ring.outstanding(), 6);
        // SAFETY: the test is the ring's only consumer; position 5 is outstanding.
        let slot = unsafe { ring.complete(5) }.expect("outstanding");
        assert_eq!(slot.wr_id, 9);
        assert_eq!(ring.outstanding(), 0);
    }

    #[test]
    fn a_batch_that_does_not_fit_takes_nothing() {
        let mut q = fake_qp();
        let ex = setup(&mut q, SendOps::ALL_SAFE);
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(2, false)]).unwrap();
        let mut scratch = vec![ffi::ibv_send_wr::default(); 8];
        let mut sges = vec![[ffi::ibv_sge::default(); MAX_SGE]; 8];
        let mut wrs: Vec<SendRequest> = (0..3).map(|_| SendRequest::send_inline(b"x")).collect();
        assert!(matches!(
            post_batch(&ex, &ring, &mut scratch, &mut sges, &mut wrs),
            Err(Error::QueueFull { .. })
        ));
        assert!(calls().is_empty());
    }
}
