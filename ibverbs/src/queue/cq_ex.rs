//! The extended poll path of a completion queue created with
//! [`Context::create_cq_ex`](crate::Context::create_cq_ex) (`ibv_create_cq_ex()`): completions are
//! read with `ibv_start_poll` / `ibv_next_poll` / `ibv_end_poll` and the `ibv_wc_read_*`
//! accessors into the same [`Completion`]s as the classic path, whose `wr_id` finds the request's
//! slot through the same registry (so queue pairs, channels and the buffer hand-back work
//! unchanged).
//!
//! The sequence rules of `ibv_create_cq_ex(3)`: `ibv_start_poll` returning `ENOENT` means the CQ
//! is empty and *no* `ibv_end_poll` follows; after any other success exactly one `ibv_end_poll`
//! follows (here from a guard, so also when a buffer's drop panics in between); the accessors
//! are valid only between the two, for the completion `start_poll`/`next_poll` made current.

use ibverbs_sys as ffi;

use crate::error::{Error, Result};
use crate::post::registry::Registry;
use crate::post::Slot;
use crate::queue::completion::Completion;

bitflags::bitflags! {
    /// The fields an extended completion queue reports besides `wr_id`, status, opcode, flags and
    /// vendor error (`wc_flags` of `struct ibv_cq_init_attr_ex`, the `IBV_WC_EX_WITH_*` flags of
    /// `enum ibv_create_cq_wc_flags`). Fields not asked for read as 0 in the [`Completion`], but
    /// for those of [`IMM`](Self::IMM), which read as absent.
    #[doc(alias = "ibv_create_cq_wc_flags")]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct WcFlags: u64 {
        /// Bytes received or transferred (`IBV_WC_EX_WITH_BYTE_LEN`, `ibv_wc_read_byte_len()`).
        const BYTE_LEN = ffi::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_BYTE_LEN.0 as u64;
        /// Immediate data (`IBV_WC_EX_WITH_IMM`, `ibv_wc_read_imm_data()`), and the rkey a
        /// peer's Send with Invalidate invalidated (`ibv_wc_read_invalidated_rkey()`, the same
        /// accessor). Without it a completion carries neither: [`Completion::imm_data`] and
        /// [`Completion::invalidated_rkey`] return `None` (the flags that announce them are
        /// cleared), and an invalidated window cannot be taken back through
        /// [`BoundWindow::remote_invalidated`](crate::BoundWindow::remote_invalidated).
        const IMM = ffi::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_IMM.0 as u64;
        /// The local QP number (`IBV_WC_EX_WITH_QP_NUM`, `ibv_wc_read_qp_num()`).
        const QP_NUM = ffi::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_QP_NUM.0 as u64;
        /// The sending QP number of UD receives (`IBV_WC_EX_WITH_SRC_QP`, `ibv_wc_read_src_qp()`).
        const SRC_QP = ffi::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_SRC_QP.0 as u64;
        /// The sender's LID (`IBV_WC_EX_WITH_SLID`, `ibv_wc_read_slid()`).
        const SLID = ffi::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_SLID.0 as u64;
        /// The service level (`IBV_WC_EX_WITH_SL`, `ibv_wc_read_sl()`).
        const SL = ffi::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_SL.0 as u64;
        /// The DLID path bits (`IBV_WC_EX_WITH_DLID_PATH_BITS`, `ibv_wc_read_dlid_path_bits()`).
        const DLID_PATH_BITS = ffi::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_DLID_PATH_BITS.0 as u64;
        /// The completion's timestamp in device clock ticks
        /// (`IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`, `ibv_wc_read_completion_ts()`;
        /// [`Completion::timestamp`]). Only on devices whose `completion_timestamp_mask` is not 0:
        /// elsewhere creating the CQ fails with [`Error::Unsupported`].
        const COMPLETION_TIMESTAMP =
            ffi::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP.0 as u64;
        /// What the classic `struct ibv_wc` carries (`IBV_WC_STANDARD_FLAGS`): every flag above
        /// but the timestamp.
        const STANDARD = Self::BYTE_LEN.bits()
            | Self::IMM.bits()
            | Self::QP_NUM.bits()
            | Self::SRC_QP.bits()
            | Self::SLID.bits()
            | Self::SL.bits()
            | Self::DLID_PATH_BITS.bits();
    }
}

impl Default for WcFlags {
    /// [`WcFlags::STANDARD`].
    fn default() -> Self {
        WcFlags::STANDARD
    }
}

type StartPoll = unsafe extern "C" fn(*mut ffi::ibv_cq_ex, *mut ffi::ibv_poll_cq_attr) -> i32;
type NextPoll = unsafe extern "C" fn(*mut ffi::ibv_cq_ex) -> i32;
type EndPoll = unsafe extern "C" fn(*mut ffi::ibv_cq_ex);
type ReadU32 = unsafe extern "C" fn(*mut ffi::ibv_cq_ex) -> u32;
type ReadU8 = unsafe extern "C" fn(*mut ffi::ibv_cq_ex) -> u8;
type ReadU64 = unsafe extern "C" fn(*mut ffi::ibv_cq_ex) -> u64;
type ReadOpcode = unsafe extern "C" fn(*mut ffi::ibv_cq_ex) -> ffi::ibv_wc_opcode;
type ReadFlags = unsafe extern "C" fn(*mut ffi::ibv_cq_ex) -> std::os::raw::c_uint;

/// The poll table of one extended CQ, read once at creation (the provider fills the function
/// pointers of `struct ibv_cq_ex` in `ibv_create_cq_ex`, for the fields asked for, and never
/// changes them).
pub(crate) struct ExCq {
    pub(crate) raw: *mut ffi::ibv_cq_ex,
    pub(crate) flags: WcFlags,
    start: StartPoll,
    next: NextPoll,
    end: EndPoll,
    opcode: ReadOpcode,
    wc_flags: ReadFlags,
    vendor_err: ReadU32,
    byte_len: Option<ReadU32>,
    imm: Option<ReadU32>,
    qp_num: Option<ReadU32>,
    src_qp: Option<ReadU32>,
    slid: Option<ReadU32>,
    sl: Option<ReadU8>,
    dlid_path_bits: Option<ReadU8>,
    ts: Option<ReadU64>,
    /// Whether any field past `byte_len`'s group was asked for (`IMM`, `SRC_QP`, `SLID`, `SL`,
    /// `DLID_PATH_BITS`, `COMPLETION_TIMESTAMP`): a CQ asking for none skips their tests.
    /// Kept rather than tested on `flags` at each poll, which measured 6 instructions more per
    /// poll (callgrind, `post_poll` `ExSafe:1`: 338 against 344).
    tail: bool,
    /// One completion per `start_poll`/`end_poll`, never `next_poll`: for a provider whose
    /// `next_poll` reaching an empty CQ corrupts it ([`Quirks::ex_poll_one_per_start`], rxe).
    ///
    /// [`Quirks::ex_poll_one_per_start`]: crate::quirks::Quirks::ex_poll_one_per_start
    one_per_start: bool,
}

impl ExCq {
    /// Reads the poll table of `raw`, created with `flags`. `None` when the provider left out
    /// a call every poll needs or an accessor of a field asked for. With `one_per_start`, every
    /// poll reads one completion per `start_poll`/`end_poll` and never calls `next_poll`.
    ///
    /// # Safety
    /// `raw` points to a valid `struct ibv_cq_ex` that outlives every use of the result.
    pub(crate) unsafe fn new(raw: *mut ffi::ibv_cq_ex, flags: WcFlags, one_per_start: bool) -> Option<ExCq> {
        // SAFETY: valid (contract); plain fields.
        let t = unsafe { &*raw };
        // An accessor asked for must be there (`None` fails the whole table); others are unused.
        fn want<F>(flags: WcFlags, flag: WcFlags, f: Option<F>) -> Option<Option<F>> {
            if flags.contains(flag) {
                f.map(Some)
            } else {
                Some(None)
            }
        }
        Some(ExCq {
            raw,
            flags,
            start: t.start_poll?,
            next: t.next_poll?,
            end: t.end_poll?,
            opcode: t.read_opcode?,
            wc_flags: t.read_wc_flags?,
            vendor_err: t.read_vendor_err?,
            byte_len: want(flags, WcFlags::BYTE_LEN, t.read_byte_len)?,
            imm: want(flags, WcFlags::IMM, t.read_imm_data)?,
            qp_num: want(flags, WcFlags::QP_NUM, t.read_qp_num)?,
            src_qp: want(flags, WcFlags::SRC_QP, t.read_src_qp)?,
            slid: want(flags, WcFlags::SLID, t.read_slid)?,
            sl: want(flags, WcFlags::SL, t.read_sl)?,
            dlid_path_bits: want(flags, WcFlags::DLID_PATH_BITS, t.read_dlid_path_bits)?,
            ts: want(flags, WcFlags::COMPLETION_TIMESTAMP, t.read_completion_ts)?,
            tail: flags.intersects(
                WcFlags::IMM
                    | WcFlags::SRC_QP
                    | WcFlags::SLID
                    | WcFlags::SL
                    | WcFlags::DLID_PATH_BITS
                    | WcFlags::COMPLETION_TIMESTAMP,
            ),
            one_per_start,
        })
    }

    /// The current completion as a classic `struct ibv_wc` (fields not asked for, and those not
    /// valid for a failed completion, are 0), and its timestamp if asked for.
    ///
    /// # Safety
    /// Called between a successful `start_poll` and its `end_poll`.
    #[inline]
    unsafe fn read(&self) -> (ffi::ibv_wc, Option<u64>) {
        let q = self.raw;
        let mut wc = ffi::ibv_wc::default();
        // SAFETY: a completion is current (contract): `wr_id` and `status` are set, and the
        // accessors read it.
        unsafe {
            wc.wr_id = std::ptr::addr_of!((*q).wr_id).read();
            wc.status = std::ptr::addr_of!((*q).status).read();
            let r32 = |f: Option<ReadU32>| f.map_or(0, |f| f(q));
            if let Some(f) = self.qp_num {
                wc.qp_num = f(q);
            }
            if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
                // Only wr_id, status, qp_num and vendor_err are valid for a failed completion.
                wc.vendor_err = (self.vendor_err)(q);
                return (wc, None);
            }
            wc.opcode = (self.opcode)(q);
            wc.wc_flags = (self.wc_flags)(q);
            wc.byte_len = r32(self.byte_len);
            if wc.wc_flags & CARRIED != 0 {
                match self.imm {
                    // Only a receive carries them: mlx4 flags WITH_IMM on the sender's own
                    // completions too, where its accessor returns whatever the CQE held.
                    Some(_) if wc.opcode.0 & ffi::ibv_wc_opcode::IBV_WC_RECV.0 == 0 => {
                        wc.wc_flags &= !CARRIED
                    }
                    // Immediate data in network order, an rkey in host order, as in `struct
                    // ibv_wc` (`ibv_wc_read_invalidated_rkey` is this accessor).
                    Some(f) => wc.__bindgen_anon_1.imm_data = f(q),
                    // Not asked for, so not read: the flags announcing it go.
                    None => wc.wc_flags &= !CARRIED,
                }
            }
            if !self.tail {
                // Nothing more was asked for: the rest stays 0 (one test instead of five).
                return (wc, None);
            }
            wc.src_qp = r32(self.src_qp);
            wc.slid = r32(self.slid) as u16;
            wc.sl = self.sl.map_or(0, |f| f(q));
            wc.dlid_path_bits = self.dlid_path_bits.map_or(0, |f| f(q));
            (wc, self.ts.map(|f| f(q)))
        }
    }
}

/// The `wc_flags` announcing the union field `ibv_wc_read_imm_data` reads: immediate data, or
/// the rkey a Send with Invalidate invalidated. A CQ that did not ask for [`WcFlags::IMM`]
/// clears them, so that [`Completion::imm_data`] and [`Completion::invalidated_rkey`] say
/// `None` rather than `Some(0)`.
const CARRIED: u32 = ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 | ffi::ibv_wc_flags::IBV_WC_WITH_INV.0;

/// Calls `ibv_end_poll` when dropped: after a successful `ibv_start_poll`, also when a buffer's
/// drop panics while the completions are read (the provider holds its CQ lock until then).
struct EndGuard<'a>(&'a ExCq);

impl Drop for EndGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: created only after a successful start_poll on this CQ; dropped once.
        unsafe { (self.0.end)(self.0.raw) };
    }
}

/// The body of [`CompletionQueue::poll`](crate::CompletionQueue::poll) on an extended CQ: returns
/// how many entries of `out` it filled. A poll that ends on `ENOENT` has seen the CQ empty (the
/// registry's `drained` rule); one that filled `out` has not. An error of `ibv_next_poll` after
/// completions were read ends the call with those completions (the next call reports it again
/// from `ibv_start_poll`).
///
/// # Safety
/// Called only by the registry's consumer (the holder of `&mut CompletionQueue`); `ex` is the
/// valid poll table of a live CQ.
// Out of line: inlined next to the classic path, it made the classic poll's code larger and
// slower (+21 instructions per completion under callgrind).
#[inline(never)]
pub(crate) unsafe fn poll_into_ex(
    ex: &ExCq,
    registry: &Registry<Slot>,
    out: &mut [Completion],
) -> Result<usize> {
    // SAFETY: consumer (contract).
    let draining = unsafe { registry.begin_poll() };
    if out.is_empty() {
        return Ok(0);
    }
    // Drop what the caller left in the entries *before* starting the poll: a buffer's drop that
    // panics then loses no completion and leaves no poll open.
    for c in out.iter_mut() {
        c.clear();
    }
    if ex.one_per_start {
        // SAFETY: as this function's (contract).
        return unsafe { poll_one_per_start(ex, registry, out, draining) };
    }
    let mut attr = ffi::ibv_poll_cq_attr::default();
    // SAFETY: valid CQ (contract); `attr` is a valid attribute struct (comp_mask 0).
    let ret = unsafe { (ex.start)(ex.raw, &mut attr) };
    if ret == libc::ENOENT {
        // Empty; no end_poll after ENOENT.
        if draining {
            // SAFETY: consumer; the CQ was seen empty after begin_poll marked the rings.
            unsafe { registry.drained() };
        }
        return Ok(0);
    }
    if ret != 0 {
        return Err(Error::from_ret("ibv_start_poll", ret));
    }
    let guard = EndGuard(ex);
    let mut filled = 0;
    let mut empty = false;
    loop {
        // SAFETY: between start_poll and end_poll, a completion is current.
        let (wc, ts) = unsafe { ex.read() };
        // SAFETY: consumer (contract); the entry was cleared above.
        unsafe { out[filled].fill_ex(&wc, ts, registry) };
        filled += 1;
        if filled == out.len() {
            break;
        }
        // SAFETY: between start_poll and end_poll.
        match unsafe { (ex.next)(ex.raw) } {
            0 => {}
            libc::ENOENT => {
                empty = true;
                break;
            }
            _ => break,
        }
    }
    drop(guard);
    if empty && draining {
        // SAFETY: consumer; next_poll found the CQ empty after begin_poll marked the rings.
        unsafe { registry.drained() };
    }
    Ok(filled)
}

/// [`poll_into_ex`] for a provider whose `next_poll` must not reach an empty CQ
/// ([`ExCq::one_per_start`]): each completion is read between its own `start_poll` and
/// `end_poll`, until `out` is full or `start_poll` finds the CQ empty. The entries of `out` were
/// cleared; `draining` is what `begin_poll` returned.
///
/// # Safety
/// As [`poll_into_ex`].
#[cold]
unsafe fn poll_one_per_start(
    ex: &ExCq,
    registry: &Registry<Slot>,
    out: &mut [Completion],
    draining: bool,
) -> Result<usize> {
    let mut filled = 0;
    while filled < out.len() {
        let mut attr = ffi::ibv_poll_cq_attr::default();
        // SAFETY: valid CQ (contract); no poll is open (each iteration ended its own).
        let ret = unsafe { (ex.start)(ex.raw, &mut attr) };
        if ret == libc::ENOENT {
            if draining {
                // SAFETY: consumer; the CQ was seen empty after begin_poll marked the rings.
                unsafe { registry.drained() };
            }
            return Ok(filled);
        }
        if ret != 0 {
            if filled > 0 {
                // What was read is returned; the next call reports the error again.
                return Ok(filled);
            }
            return Err(Error::from_ret("ibv_start_poll", ret));
        }
        let guard = EndGuard(ex);
        // SAFETY: between start_poll and end_poll, a completion is current.
        let (wc, ts) = unsafe { ex.read() };
        // SAFETY: consumer (contract); the entry was cleared by the caller.
        unsafe { out[filled].fill_ex(&wc, ts, registry) };
        filled += 1;
        drop(guard);
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::post::ring::{RECV, TAG};
    use crate::queue::completion::{WcOpcode, WcStatus};
    use std::cell::RefCell;

    /// A fake provider's CQ: a queue of (wr_id, status, opcode, imm) and a log of the calls.
    #[derive(Default)]
    struct Fake {
        queue: Vec<(u64, u32, u32, Option<u32>)>,
        next: usize,
        log: Vec<&'static str>,
        /// Whether a poll is open (start_poll succeeded, end_poll not called yet).
        open: bool,
        /// An error `next_poll` returns once, instead of advancing.
        next_err: Option<i32>,
        /// Completions with a value carry an invalidated rkey (`IBV_WC_WITH_INV`, host order)
        /// instead of immediate data.
        inv: bool,
        /// rdma-core's rxe provider: the queue is a ring of [`RING`] entries (those past the
        /// completions queued read as zeroed "successful" entries), and a `next_poll` that finds
        /// it empty stores the consumer index, then `end_poll` advances it once more.
        rxe_bug: bool,
    }

    /// The ring size of the rxe model.
    const RING: usize = 8;

    thread_local! {
        static FAKE: RefCell<Fake> = RefCell::new(Fake::default());
    }

    fn current(q: *mut ffi::ibv_cq_ex) -> i32 {
        FAKE.with(|f| {
            let f = f.borrow();
            let entry = if f.rxe_bug {
                // Empty when the consumer index meets the producer's, modulo the ring.
                if f.next % RING == f.queue.len() % RING {
                    None
                } else {
                    Some(f.queue.get(f.next).copied().unwrap_or((0, OK, 0, None)))
                }
            } else {
                f.queue.get(f.next).copied()
            };
            match entry {
                None => libc::ENOENT,
                Some((wr_id, status, _, _)) => {
                    // SAFETY: `q` is the test's fake CQ; plain fields a provider sets.
                    unsafe {
                        (*q).wr_id = wr_id;
                        (*q).status = ffi::ibv_wc_status(status);
                    }
                    0
                }
            }
        })
    }

    unsafe extern "C" fn start(q: *mut ffi::ibv_cq_ex, _attr: *mut ffi::ibv_poll_cq_attr) -> i32 {
        let was_open = FAKE.with(|f| {
            let mut f = f.borrow_mut();
            f.log.push("start");
            f.open
        });
        assert!(!was_open, "start_poll while a poll is open");
        let r = current(q);
        FAKE.with(|f| f.borrow_mut().open = r == 0);
        r
    }
    unsafe extern "C" fn next(q: *mut ffi::ibv_cq_ex) -> i32 {
        let err = FAKE.with(|f| {
            let mut f = f.borrow_mut();
            assert!(f.open, "next_poll outside a poll");
            f.log.push("next");
            f.next_err.take().or_else(|| {
                f.next += 1;
                None
            })
        });
        err.unwrap_or_else(|| current(q))
    }
    unsafe extern "C" fn end(_q: *mut ffi::ibv_cq_ex) {
        FAKE.with(|f| {
            let mut f = f.borrow_mut();
            assert!(f.open, "end_poll without a successful start_poll");
            f.log.push("end");
            f.open = false;
            // The last completion read is consumed by end_poll; rxe's advances whatever
            // next_poll did.
            if f.rxe_bug || f.next < f.queue.len() {
                f.next += 1;
            }
        });
    }
    fn field<T>(pick: impl Fn(&(u64, u32, u32, Option<u32>)) -> T) -> T {
        FAKE.with(|f| {
            let f = f.borrow();
            assert!(f.open, "an accessor outside a poll");
            pick(f.queue.get(f.next).unwrap_or(&(0, OK, 0, None)))
        })
    }
    unsafe extern "C" fn opcode(_q: *mut ffi::ibv_cq_ex) -> ffi::ibv_wc_opcode {
        ffi::ibv_wc_opcode(field(|c| c.2))
    }
    fn inv() -> bool {
        FAKE.with(|f| f.borrow().inv)
    }
    unsafe extern "C" fn wc_flags(_q: *mut ffi::ibv_cq_ex) -> std::os::raw::c_uint {
        let flag =
            if inv() { ffi::ibv_wc_flags::IBV_WC_WITH_INV.0 } else { ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 };
        field(|c| if c.3.is_some() { flag } else { 0 })
    }
    unsafe extern "C" fn imm(_q: *mut ffi::ibv_cq_ex) -> u32 {
        let v = field(|c| c.3.expect("read_imm_data without IBV_WC_WITH_IMM or IBV_WC_WITH_INV"));
        if inv() {
            v
        } else {
            v.to_be()
        }
    }
    unsafe extern "C" fn byte_len(_q: *mut ffi::ibv_cq_ex) -> u32 {
        field(|c| c.0 as u32 * 10)
    }
    unsafe extern "C" fn u32_zero(_q: *mut ffi::ibv_cq_ex) -> u32 {
        field(|_| 0)
    }
    unsafe extern "C" fn u8_zero(_q: *mut ffi::ibv_cq_ex) -> u8 {
        field(|_| 0)
    }
    unsafe extern "C" fn vendor_err(_q: *mut ffi::ibv_cq_ex) -> u32 {
        field(|_| 0x42)
    }
    unsafe extern "C" fn ts(_q: *mut ffi::ibv_cq_ex) -> u64 {
        field(|c| 1000 + c.0)
    }

    fn fake_cq(queue: Vec<(u64, u32, u32, Option<u32>)>) -> Box<ffi::ibv_cq_ex> {
        FAKE.with(|f| *f.borrow_mut() = Fake { queue, ..Fake::default() });
        let mut q = Box::<ffi::ibv_cq_ex>::default();
        q.start_poll = Some(start);
        q.next_poll = Some(next);
        q.end_poll = Some(end);
        q.read_opcode = Some(opcode);
        q.read_wc_flags = Some(wc_flags);
        q.read_vendor_err = Some(vendor_err);
        q.read_byte_len = Some(byte_len);
        q.read_imm_data = Some(imm);
        q.read_qp_num = Some(u32_zero);
        q.read_src_qp = Some(u32_zero);
        q.read_slid = Some(u32_zero);
        q.read_sl = Some(u8_zero);
        q.read_dlid_path_bits = Some(u8_zero);
        q
    }

    fn log() -> Vec<&'static str> {
        FAKE.with(|f| std::mem::take(&mut f.borrow_mut().log))
    }

    const OK: u32 = 0;
    const SEND: u32 = ffi::ibv_wc_opcode::IBV_WC_SEND.0;
    const RECV_OP: u32 = ffi::ibv_wc_opcode::IBV_WC_RECV.0;

    /// rxe's extended CQ, as rdma-core's provider has it: the documented sequence (a `next_poll`
    /// that finds the CQ empty, then `end_poll`) moves the consumer past the producer, and later
    /// polls return zeroed "successful" entries nobody posted; polling one completion per
    /// `start_poll`/`end_poll` returns exactly what was queued, however large the array.
    #[test]
    fn rxe_next_poll_at_empty_corrupts_the_cq_and_one_per_start_does_not() {
        let reg = Registry::<Slot>::for_tests(8);
        let sends = vec![(5, OK, SEND, None), (6, OK, SEND, None)];
        for one_per_start in [false, true] {
            let mut q = fake_cq(sends.clone());
            FAKE.with(|f| f.borrow_mut().rxe_bug = true);
            // SAFETY: the fake CQ outlives the table.
            let ex = unsafe { ExCq::new(&mut *q, WcFlags::STANDARD, one_per_start) }.unwrap();
            let mut out: [Completion; 4] = Default::default();
            let mut got = Vec::new();
            for _ in 0..4 {
                // SAFETY: single consumer.
                let n = unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap();
                got.extend(out[..n].iter().map(|c| c.wr_id()));
            }
            let calls = log();
            if one_per_start {
                assert_eq!(got, [5, 6], "exactly what was queued");
                assert!(!calls.contains(&"next"), "{calls:?}");
                assert_eq!(calls[..5], ["start", "end", "start", "end", "start"]);
            } else {
                // The bug itself: phantom completions after the first poll that met the end.
                assert_eq!(got[..2], [5, 6]);
                assert!(got.len() > 2 && got[2..].iter().all(|&w| w == 0), "{got:?}");
            }
        }
    }

    #[test]
    fn an_empty_cq_is_start_poll_enoent_and_no_end_poll() {
        let mut q = fake_cq(vec![]);
        // SAFETY: the fake CQ outlives the table.
        let ex = unsafe { ExCq::new(&mut *q, WcFlags::STANDARD, false) }.unwrap();
        let reg = Registry::<Slot>::for_tests(8);
        let mut out: [Completion; 4] = Default::default();
        // SAFETY: single consumer.
        assert_eq!(unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap(), 0);
        assert_eq!(log(), ["start"]);
    }

    #[test]
    fn completions_are_read_between_start_and_end_and_find_their_slots() {
        let reg = Registry::<Slot>::for_tests(64);
        let ring = crate::post::registry::posted_ring(&reg, 4, true, &[100, 101]);
        let mut q = fake_cq(vec![
            (ring.device_wr_id(1), OK, RECV_OP, Some(0xfeed)),
            (5, OK, SEND, None),
            (TAG | RECV | (77 << 32), WcStatus::WR_FLUSH_ERR.0, 0, None),
        ]);
        // SAFETY: the fake CQ outlives the table.
        let ex = unsafe { ExCq::new(&mut *q, WcFlags::STANDARD, false) }.unwrap();
        let mut out: [Completion; 8] = Default::default();
        // SAFETY: single consumer.
        let n = unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap();
        assert_eq!(n, 3);
        assert_eq!(log(), ["start", "next", "next", "next", "end"]);
        assert!(out[0].is_tracked() && out[0].wr_id() == 101);
        assert_eq!(out[0].opcode(), WcOpcode::RECV);
        assert_eq!(out[0].imm_data(), Some(0xfeed));
        assert_eq!(out[0].byte_len(), (ring.device_wr_id(1) as u32).wrapping_mul(10));
        assert_eq!(out[0].timestamp(), None, "not asked for");
        assert_eq!(ring.outstanding(), 0, "position 0 released with 1");
        assert_eq!((out[1].wr_id(), out[1].imm_data(), out[1].is_tracked()), (5, None, false));
        assert_eq!(out[2].status(), WcStatus::WR_FLUSH_ERR);
        assert_eq!((out[2].vendor_err(), out[2].byte_len()), (0x42, 0), "only the error fields");
        assert!(!out[2].is_tracked(), "a key naming no ring is skipped");
        // All consumed: the next poll finds the CQ empty.
        // SAFETY: single consumer.
        assert_eq!(unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap(), 0);
        assert_eq!(log(), ["start"]);
    }

    unsafe extern "C" fn logged_u32(_q: *mut ffi::ibv_cq_ex) -> u32 {
        FAKE.with(|f| f.borrow_mut().log.push("tail"));
        field(|_| 7)
    }

    /// A CQ that asked for no field of the tail group (imm, src_qp, slid, sl, dlid_path_bits,
    /// timestamp) calls none of their accessors and leaves them 0; one that asked for one
    /// calls it.
    #[test]
    fn fields_not_asked_for_are_not_read() {
        let reg = Registry::<Slot>::for_tests(8);
        for (flags, calls) in [(WcFlags::BYTE_LEN, 0), (WcFlags::BYTE_LEN | WcFlags::SRC_QP, 1)] {
            let mut q = fake_cq(vec![(3, OK, RECV_OP, None)]);
            q.read_src_qp = Some(logged_u32);
            // SAFETY: the fake CQ outlives the table.
            let ex = unsafe { ExCq::new(&mut *q, flags, false) }.unwrap();
            let mut out: [Completion; 1] = Default::default();
            // SAFETY: single consumer.
            assert_eq!(unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap(), 1);
            assert_eq!(log().iter().filter(|&&e| e == "tail").count(), calls, "{flags:?}");
            let c = &out[0];
            assert_eq!((c.wr_id(), c.byte_len(), c.opcode()), (3, 30, WcOpcode::RECV));
            assert_eq!(c.src_qp(), if calls == 1 { 7 } else { 0 });
        }
    }

    /// Immediate data and an invalidated rkey come through one accessor: read when the CQ asked
    /// for `IMM`, and otherwise reported absent, never as a 0 nobody read.
    #[test]
    fn immediate_data_and_invalidated_rkeys_are_read_or_reported_absent() {
        let reg = Registry::<Slot>::for_tests(8);
        for inv in [false, true] {
            for flags in [WcFlags::STANDARD, WcFlags::BYTE_LEN, WcFlags::BYTE_LEN | WcFlags::SRC_QP] {
                let mut q = fake_cq(vec![(3, OK, RECV_OP, Some(0xfeed))]);
                FAKE.with(|f| f.borrow_mut().inv = inv);
                // SAFETY: the fake CQ outlives the table.
                let ex = unsafe { ExCq::new(&mut *q, flags, false) }.unwrap();
                let mut out: [Completion; 1] = Default::default();
                // SAFETY: single consumer.
                assert_eq!(unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap(), 1);
                let c = &out[0];
                let (carried, other) = if inv {
                    (c.invalidated_rkey(), c.imm_data())
                } else {
                    (c.imm_data(), c.invalidated_rkey())
                };
                let asked = flags.contains(WcFlags::IMM);
                assert_eq!(carried, asked.then_some(0xfeed), "{flags:?}, invalidation: {inv}");
                assert_eq!(other, None, "{flags:?}, invalidation: {inv}");
                assert_eq!(c.byte_len(), 30, "the rest is read as before");
            }
        }
    }

    /// A send completion flagged `WITH_IMM` (mlx4's extended CQ flags the sender's own
    /// completions of requests with immediate) reports no immediate data.
    #[test]
    fn a_send_completion_flagged_with_imm_reports_none() {
        let reg = Registry::<Slot>::for_tests(8);
        let mut q = fake_cq(vec![(3, OK, SEND, Some(0xbad)), (4, OK, RECV_OP, Some(0xfeed))]);
        // SAFETY: the fake CQ outlives the table.
        let ex = unsafe { ExCq::new(&mut *q, WcFlags::STANDARD, false) }.unwrap();
        let mut out: [Completion; 2] = Default::default();
        // SAFETY: single consumer.
        assert_eq!(unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap(), 2);
        assert_eq!((out[0].opcode(), out[0].imm_data()), (WcOpcode::SEND, None));
        assert_eq!((out[1].opcode(), out[1].imm_data()), (WcOpcode::RECV, Some(0xfeed)));
    }

    #[test]
    fn a_full_array_ends_the_poll_without_seeing_the_cq_empty() {
        let reg = Registry::<Slot>::for_tests(8);
        let ring = crate::post::registry::posted_ring(&reg, 8, false, &[0, 0]);
        reg.retire(&ring);
        drop(ring);
        assert_eq!(reg.unreserved(), 6);
        let mut q = fake_cq((1..=3).map(|i| (i, OK, SEND, None)).collect());
        // SAFETY: the fake CQ outlives the table.
        let ex = unsafe { ExCq::new(&mut *q, WcFlags::BYTE_LEN, false) }.unwrap();
        let mut out: [Completion; 2] = Default::default();
        // SAFETY: single consumer.
        unsafe {
            assert_eq!(poll_into_ex(&ex, &reg, &mut out).unwrap(), 2, "full: not seen empty");
            assert_eq!(log(), ["start", "next", "end"], "no next_poll past the array");
            assert_eq!(reg.unreserved(), 6);
            assert_eq!(poll_into_ex(&ex, &reg, &mut out[..0]).unwrap(), 0, "asked for none");
            assert!(log().is_empty(), "asking for none polls nothing");
            assert_eq!(reg.unreserved(), 6);
            assert_eq!(poll_into_ex(&ex, &reg, &mut out).unwrap(), 1, "seen empty by next_poll");
            assert_eq!(log(), ["start", "next", "end"]);
        }
        assert_eq!(reg.unreserved(), 8, "the drain rule ran");
        assert_eq!(out[0].wr_id(), 3);
    }

    #[test]
    fn start_poll_enoent_counts_as_seen_empty() {
        let reg = Registry::<Slot>::for_tests(8);
        let [ring] = reg.register([(8, false)]).unwrap();
        reg.retire(&ring);
        drop(ring);
        let mut q = fake_cq(vec![]);
        // SAFETY: the fake CQ outlives the table.
        let ex = unsafe { ExCq::new(&mut *q, WcFlags::empty(), false) }.unwrap();
        let mut out: [Completion; 2] = Default::default();
        // SAFETY: single consumer.
        assert_eq!(unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap(), 0);
        assert_eq!(reg.unreserved(), 8);
    }

    #[test]
    fn errors_are_typed_and_a_next_poll_error_keeps_what_was_read() {
        let reg = Registry::<Slot>::for_tests(8);
        let mut q = fake_cq(vec![(1, OK, SEND, None), (2, OK, SEND, None)]);
        q.start_poll = Some({
            unsafe extern "C" fn failing(_q: *mut ffi::ibv_cq_ex, _a: *mut ffi::ibv_poll_cq_attr) -> i32 {
                FAKE.with(|f| f.borrow_mut().log.push("start"));
                libc::EIO
            }
            failing
        });
        // SAFETY: the fake CQ outlives the table.
        let ex = unsafe { ExCq::new(&mut *q, WcFlags::STANDARD, false) }.unwrap();
        let mut out: [Completion; 4] = Default::default();
        // SAFETY: single consumer.
        let e = unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap_err();
        assert!(matches!(e, Error::Verb { verb: "ibv_start_poll", .. }), "{e:?}");
        assert_eq!(log(), ["start"], "no end_poll after a failed start_poll");

        let mut q = fake_cq(vec![(1, OK, SEND, None), (2, OK, SEND, None)]);
        FAKE.with(|f| f.borrow_mut().next_err = Some(libc::EIO));
        // SAFETY: the fake CQ outlives the table.
        let ex = unsafe { ExCq::new(&mut *q, WcFlags::STANDARD, false) }.unwrap();
        // SAFETY: single consumer.
        assert_eq!(unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap(), 1);
        assert_eq!(log(), ["start", "next", "end"]);
        assert_eq!(out[0].wr_id(), 1);
    }

    #[test]
    fn timestamps_are_read_when_asked_for_and_missing_accessors_are_refused() {
        let mut q = fake_cq(vec![(7, OK, SEND, None)]);
        // SAFETY: the fake CQ outlives the table.
        assert!(unsafe { ExCq::new(&mut *q, WcFlags::COMPLETION_TIMESTAMP, false) }.is_none(), "no accessor");
        q.read_completion_ts = Some(ts);
        // SAFETY: as above.
        let ex = unsafe { ExCq::new(&mut *q, WcFlags::COMPLETION_TIMESTAMP, false) }.unwrap();
        let reg = Registry::<Slot>::for_tests(8);
        let mut out: [Completion; 1] = Default::default();
        // SAFETY: single consumer.
        assert_eq!(unsafe { poll_into_ex(&ex, &reg, &mut out) }.unwrap(), 1);
        assert_eq!(out[0].timestamp(), Some(1007));
        assert_eq!(out[0].byte_len(), 0, "not asked for");
    }
}
