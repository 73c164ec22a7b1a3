//! What a posted request leaves in its work queue's ring ([`Slot`], with its buffers in
//! [`SlotBufs`]), and what the engine needs of a request type to post it ([`Request`]): shared by
//! the engine, the prepared requests, the scoped ones and the window binds.

use std::mem::MaybeUninit;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::ah::AhInner;
use crate::post::ring::{Ring, SlotValue};
use crate::post::wr::{LocalBuf, MAX_SGE};

/// What a slot keeps alive for one posted work request.
pub(crate) struct Slot {
    /// The caller's `wr_id`.
    pub(crate) wr_id: u64,
    /// The request's buffers, in SGE order.
    pub(crate) bufs: SlotBufs,
    /// Kept alive (never read) until the UD send completes.
    pub(crate) _ah: Option<Arc<AhInner>>,
}

// Dropped as any value: `SlotBufs` drops its entries as its invariant allows.
impl SlotValue for Slot {}

/// A slot's buffers, compact: entry `i` is the buffer of SGE `i` (a window takes entry 0), so the
/// first empty entry ends them. Either every entry is initialised, or the first is `None` and the
/// others may not be: a slot that holds no buffer (a prepared post's) is written with one store
/// instead of [`MAX_SGE`]. Entry 0 is always initialised.
#[repr(transparent)]
pub(crate) struct SlotBufs([MaybeUninit<Option<LocalBuf>>; MAX_SGE]);

impl SlotBufs {
    /// Every entry initialised from `bufs`, which must be compact (checked in debug builds).
    pub(crate) fn new(bufs: [Option<LocalBuf>; MAX_SGE]) -> SlotBufs {
        debug_assert!(
            bufs.iter().skip_while(|b| b.is_some()).all(Option::is_none),
            "a slot's buffers are compact"
        );
        SlotBufs(bufs.map(MaybeUninit::new))
    }

    /// Entry 0 (the only one of a window request).
    pub(crate) fn first_mut(&mut self) -> &mut Option<LocalBuf> {
        // SAFETY: entry 0 is always initialised (the type's invariant).
        unsafe { self.0[0].assume_init_mut() }
    }

    /// The entries as an array; all `None` when the first is (the others hold nothing then).
    pub(crate) fn into_array(self) -> [Option<LocalBuf>; MAX_SGE] {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: entry 0 is always initialised; read once, the value is not dropped
        // (ManuallyDrop).
        let first = unsafe { me.0[0].assume_init_read() };
        if first.is_none() {
            return Default::default();
        }
        // SAFETY: the first entry is `Some`, so every entry is initialised (the invariant); each
        // is read once and `me` is never dropped.
        unsafe { [first, me.0[1].assume_init_read(), me.0[2].assume_init_read(), me.0[3].assume_init_read()] }
    }

    /// Writes the buffers of a slot that holds none, where they lie: entry 0 only (`None`).
    ///
    /// # Safety
    /// `p` is valid for writes; it points into a slot being written.
    #[inline]
    pub(crate) unsafe fn write_empty(p: *mut SlotBufs) {
        // SAFETY: the caller's contract; MaybeUninit<T> is laid out as T.
        unsafe { p.cast::<Option<LocalBuf>>().write(None) };
    }

    /// Whether entry 0 holds a buffer, read in place through `p` (every entry is then
    /// initialised).
    ///
    /// # Safety
    /// `p` points to initialised slot buffers (in the sense of the invariant).
    #[inline]
    pub(crate) unsafe fn first_is_some(p: *const SlotBufs) -> bool {
        // SAFETY: entry 0 is initialised (the caller's contract and the invariant).
        unsafe { (*p.cast::<Option<LocalBuf>>()).is_some() }
    }
}

// MAX_SGE is the array length `into_array` spells out.
const _: () = assert!(MAX_SGE == 4);

impl Default for SlotBufs {
    fn default() -> SlotBufs {
        SlotBufs::new(Default::default())
    }
}

impl Drop for SlotBufs {
    /// Drops the entries up to the first empty one (entries past it hold nothing, and may be
    /// uninitialised). If a buffer's drop unwinds, the entries after it are leaked, never
    /// dropped twice.
    fn drop(&mut self) {
        for e in &mut self.0 {
            // SAFETY: the entries before this one were `Some`, so this one is initialised (the
            // invariant); it is dropped once, in place, and never read again.
            unsafe {
                if e.assume_init_ref().is_none() {
                    break;
                }
                e.assume_init_drop();
            }
        }
    }
}

/// What the generic posting code needs of a safe request type.
pub(crate) trait Request {
    /// The C work request (`ibv_send_wr` or `ibv_recv_wr`).
    type Raw: Default;
    /// The verb, for errors.
    const VERB: &'static str;
    /// Fills `raw` and `sges` (the caller links `next`).
    fn fill_raw(&self, raw: &mut Self::Raw, sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64);
    /// Links `raw` to the next request of a chain.
    fn link(raw: &mut Self::Raw, next: *mut Self::Raw);
    /// Moves what must live until the completion into a slot.
    fn take_slot(&mut self) -> Slot;
    /// [`take_slot`](Self::take_slot) straight into the ring's slot at `pos`.
    ///
    /// # Safety
    /// As [`Ring::write`]: the producer, for a free position.
    #[inline]
    unsafe fn write_slot(&mut self, ring: &Ring<Slot>, pos: u32) {
        // SAFETY: the caller's contract.
        unsafe { ring.write(pos, self.take_slot()) };
    }
    /// Takes back a withdrawn slot (a request that was not posted after all), whose SGEs were
    /// `sges`.
    fn give_back(&mut self, slot: Slot, sges: &[ffi::ibv_sge; MAX_SGE]);
    /// Empties `wrs`, whose requests were all posted.
    fn clear_posted(wrs: &mut Vec<Self>)
    where
        Self: Sized,
    {
        wrs.clear();
    }
}
