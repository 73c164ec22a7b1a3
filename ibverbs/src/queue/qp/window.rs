//! Memory windows bound through a queue pair: type 1 binds and unbinds (`ibv_bind_mw()`, posted
//! through the engine like a send request), and a peer's invalidation of a type 2 window proven
//! by a receive completion ([`BoundWindow::remote_invalidated`]). The windows themselves, and the
//! regions exposed through them, are in `memory/window.rs`; type 2 binds are send requests
//! ([`SendRequest::bind_window`](crate::SendRequest::bind_window)).

use std::ops::RangeBounds;

use ibverbs_sys as ffi;

use crate::error::Error;
use crate::memory::{AccessFlags, BoundWindow, ExposedRegion, MemoryWindow, MwType, Pending};
use crate::post::slot::Request;
use crate::post::{LocalBuf, Slot, SlotBufs, MAX_SGE};
use crate::queue::completion::Completion;
use crate::queue::qp::{QpType, QueuePair};

impl BoundWindow {
    /// Accepts a peer's Send with Invalidate of this (type 2) window, reported by `c`, a receive
    /// completion of `qp` (`IBV_WC_WITH_INV`, `invalidated_rkey`), as proof that the window is
    /// unbound, and hands it back unbound. The evidence is used up: `c` no longer reports an
    /// invalidation.
    ///
    /// Checked: the window is type 2 and bound to `qp`; `c` is a successful, tracked (safely
    /// posted) completion of `qp`'s number naming this window's rkey.
    ///
    /// # Errors
    /// The window back (still bound) with [`Error::InvalidArgument`] when a check fails.
    ///
    /// # Safety
    /// `c` must come from `qp`'s receive CQ and from a receive posted on `qp` *after* this
    /// window's bind was posted (for a queue pair on a shared receive queue: a receive posted to
    /// that SRQ after the bind, since any of its receives may complete for `qp`). (An older completion may name an earlier holder of the same
    /// rkey: a deallocated window whose index the device gave to this one, with the same 8-bit
    /// key; the checks above cannot tell them apart. Accepting it would let the region become
    /// private while the peer can still write it.)
    #[allow(clippy::result_large_err)]
    pub unsafe fn remote_invalidated(
        self,
        qp: &QueuePair,
        c: &mut Completion,
    ) -> std::result::Result<MemoryWindow, (BoundWindow, Error)> {
        let verb = "BoundWindow::remote_invalidated";
        let reason = if self.mw_type() != MwType::Type2 {
            Some("only type 2 windows are invalidated by a peer")
        } else if self.qp.map(|(id, _)| id) != Some(qp.id) {
            Some("the window is not bound to this queue pair")
        } else if !c.is_ok() || !c.is_tracked() || c.qp_num() != qp.qp_num() {
            Some("not a successful, safely posted completion of this queue pair")
        } else if c.invalidated_rkey() != Some(self.rkey()) {
            Some("the completion does not invalidate this window's rkey")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err((self, Error::InvalidArgument { verb, reason }));
        }
        c.consume_invalidation();
        Ok(self.into_unbound())
    }
}

/// A type 1 bind or unbind, posted through the engine like a send request (`ibv_bind_mw()`).
struct Type1Bind {
    window: Option<BoundWindow>,
    wr_id: u64,
}

/// What `ibv_bind_mw()` takes, as the engine's raw request.
#[repr(C)]
struct Type1Raw {
    bind: ffi::ibv_mw_bind,
    mw: *mut ffi::ibv_mw,
}

impl Default for Type1Raw {
    fn default() -> Self {
        Type1Raw { bind: ffi::ibv_mw_bind::default(), mw: std::ptr::null_mut() }
    }
}

/// The engine's "provider post" for a type 1 bind: one request, never a chain.
unsafe extern "C" fn post_type1(qp: *mut ffi::ibv_qp, raw: *mut Type1Raw, _bad: *mut *mut Type1Raw) -> i32 {
    // SAFETY: the engine passes a valid QP and the request it filled (a live window, and the
    // registration its slot holds, or none for an unbind); ibv_bind_mw posts it on the send queue
    // and, on success, writes the window's new rkey into mw->rkey (read once the completion hands
    // the window back).
    unsafe { ffi::ibv_bind_mw(qp, (*raw).mw, &mut (*raw).bind) }
}

impl Request for Type1Bind {
    type Raw = Type1Raw;
    const VERB: &'static str = "ibv_bind_mw";
    fn fill_raw(&self, raw: &mut Type1Raw, _sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64) {
        raw.bind.wr_id = device_wr_id;
        raw.bind.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        if let Some(w) = &self.window {
            raw.mw = w.as_raw();
            // A zero-length bind unbinds a type 1 window. It still names the region: rxe's
            // provider reads `bind_info.mr->lkey` whatever the length (a NULL MR crashes it).
            let unbind = w.pending == Pending::Invalidate;
            raw.bind.bind_info = ffi::ibv_mw_bind_info {
                mr: w.mr_raw(),
                addr: w.device_addr(),
                length: if unbind { 0 } else { w.len() as u64 },
                mw_access_flags: if unbind { 0 } else { w.access().bits() },
            };
        }
    }
    fn link(_raw: &mut Type1Raw, _next: *mut Type1Raw) {}
    fn take_slot(&mut self) -> Slot {
        Slot {
            wr_id: self.wr_id,
            bufs: SlotBufs::new([
                self.window.take().map(|w| LocalBuf::Window(Box::new(w))),
                None,
                None,
                None,
            ]),
            _ah: None,
        }
    }
    fn give_back(&mut self, mut slot: Slot, _sges: &[ffi::ibv_sge; MAX_SGE]) {
        if let Some(LocalBuf::Window(w)) = slot.bufs.first_mut().take() {
            self.window = Some(*w);
        }
    }
}

impl QueuePair {
    /// Posts a type 1 bind or unbind; on error the window comes back, unless the provider may
    /// have queued the request (`None`, with [`Error::QueuedWithError`]).
    #[allow(clippy::result_large_err)] // the window comes back
    fn post_type1(
        &mut self,
        w: BoundWindow,
        wr_id: u64,
    ) -> std::result::Result<(), (Option<BoundWindow>, Error)> {
        let verb = "ibv_bind_mw";
        let reason = if self.qp_type() == QpType::UD {
            Some("memory windows are bound on connected queue pairs (RC, UC)")
        } else if !w.window().in_pd(self.pd_inner()) || !w.mr().in_pd(self.pd_inner()) {
            Some("the window or its memory region belongs to another protection domain than the QP")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err((Some(w), Error::InvalidArgument { verb, reason }));
        }
        // Taken before the slot is published (the engine publishes it with release ordering),
        // dropped once ibv_bind_mw returned: a poller given the window by its completion waits
        // for it before reading mw->rkey or deallocating the window.
        let _in_provider = w.window().in_provider();
        let mut req = Type1Bind { window: Some(w), wr_id };
        // ibv_bind_mw names no failed request (no bad_wr), and rxe's posts it through its
        // post_send, which can fail at the doorbell after queuing it: every failure of the
        // verb itself counts as queued (Error::QueuedWithError), the window staying in its slot
        // until the request's completion (or the queue pair's end) hands it back.
        self.post_send_via(post_type1, &mut req).map_err(|e| (req.window.take(), e))
    }

    /// Binds the type 1 window `mw` to the bytes `range` of `region`, granting `access`
    /// (`ibv_bind_mw()`, which posts a bind on this QP's send queue). The completion, with
    /// `wr_id`, hands it back ([`Completion::take_bound_window`](crate::Completion::take_bound_window))
    /// with its new rkey; peers may use it through any QP of the protection domain.
    ///
    /// # Errors
    /// The window back, with [`Error::InvalidArgument`] (not type 1, region or window of another
    /// protection domain, rights the region cannot give, empty range, a UD queue pair),
    /// [`Error::OutOfBounds`] (range outside the region), [`Error::QpState`] before RTS or
    /// [`Error::QueueFull`]. When `ibv_bind_mw()` itself fails, no window comes back (`None`)
    /// and the error is [`Error::QueuedWithError`]: the verb does not say whether the provider
    /// queued the bind (rxe can fail at its doorbell after queuing it), so it counts as posted,
    /// and its completion hands the window back.
    #[doc(alias = "ibv_bind_mw")]
    #[allow(clippy::result_large_err)]
    pub fn bind_mw(
        &mut self,
        mw: MemoryWindow,
        region: &ExposedRegion,
        range: impl RangeBounds<usize>,
        access: AccessFlags,
        wr_id: u64,
    ) -> std::result::Result<(), (Option<MemoryWindow>, Error)> {
        if mw.mw_type() != MwType::Type1 {
            let e = Error::InvalidArgument {
                verb: "ibv_bind_mw",
                reason: "type 2 windows are bound with SendRequest::bind_window",
            };
            return Err((Some(mw), e));
        }
        let w = mw.prepare_bind("ibv_bind_mw", region, range, access).map_err(|(mw, e)| (Some(mw), e))?;
        self.post_type1(w, wr_id).map_err(|(w, e)| (w.map(BoundWindow::into_unposted), e))
    }

    /// Unbinds the type 1 window `w` (`ibv_bind_mw()` with length 0). Once the
    /// completion (with `wr_id`) succeeded,
    /// [`Completion::take_invalidated_window`](crate::Completion::take_invalidated_window) hands
    /// it back unbound.
    ///
    /// # Errors
    /// The window back, still bound, with [`Error::InvalidArgument`] (not type 1, another
    /// protection domain, a UD queue pair), [`Error::QpState`] or [`Error::QueueFull`]. When
    /// `ibv_bind_mw()` itself fails, no window comes back (`None`) and the error is
    /// [`Error::QueuedWithError`], as for [`bind_mw`](Self::bind_mw): the unbind counts as
    /// posted, and its completion hands the window back.
    #[doc(alias = "ibv_bind_mw")]
    #[allow(clippy::result_large_err)]
    pub fn unbind_mw(
        &mut self,
        mut w: BoundWindow,
        wr_id: u64,
    ) -> std::result::Result<(), (Option<BoundWindow>, Error)> {
        if w.mw_type() != MwType::Type1 {
            let e = Error::InvalidArgument {
                verb: "ibv_bind_mw",
                reason: "type 2 windows are invalidated with SendRequest::local_invalidate",
            };
            return Err((Some(w), e));
        }
        w.pending = Pending::Invalidate;
        self.post_type1(w, wr_id).map_err(|(w, e)| {
            let w = w.map(|mut w| {
                w.pending = Pending::None;
                w
            });
            (w, e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_in_a_slot_does_not_grow_the_buffer_enum() {
        // LocalBuf is copied per completion on the hot path: the window variant is boxed.
        assert!(std::mem::size_of::<LocalBuf>() <= 4 * std::mem::size_of::<usize>());
    }
}
