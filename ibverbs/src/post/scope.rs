//! The third posting level: requests over *borrowed* slices of registered memory, posted inside a
//! [`QueuePair::scope`](crate::QueuePair::scope) that does not return before the device is done
//! with every one of them (the `std::thread::scope` pattern). The [`Scope`](crate::Scope) handed
//! to the closure, and its drain, are the queue pair's (`queue/qp/scope.rs`).
//!
//! A scoped request goes through the same engine as an owned one (a slot of the work queue's
//! ring, a `wr_id` naming it, the CQ's registry finding it); its slot holds no buffer. What keeps
//! the memory alive and unaliased is the borrow: a [`ScopedLocal<'b>`] holds `&'b` (device
//! reads) or `&'b mut` (device writes) of its region, and the scope accepts only requests whose
//! borrows outlive the scope's call ([`Scope`]'s `'s`, bounded by `'env`). The scope records the
//! ring position after its last scoped request on each work queue; its drain waits until the
//! ring has released every position before it (completions release in order, see
//! [`ring`](super::ring)). The drain belongs to `QueuePair::scope` itself, not to a value the
//! closure could forget.

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;

use ibverbs_sys as ffi;

use crate::ah::AddressHandle;
use crate::error::{Error, Result};
use crate::memory::{check_range, MrInner, RemoteSlice};
use crate::pd::PdInner;
use crate::post::ring::Ring;
use crate::post::slot::{Request, Slot, SlotBufs};
use crate::post::wr::{EntryFacts, SendRequest, MAX_SGE};

/// A bounds-checked range of registered memory *borrowed* for a scope: one scatter/gather
/// entry (`struct ibv_sge`) of a [`ScopedSend`] or [`ScopedRecv`].
///
/// Made by [`Scope::local`](crate::Scope::local) (shared borrow: the device may only read it),
/// [`Scope::local_mut`](crate::Scope::local_mut) (exclusive borrow: the device may also write it,
/// for receives, RDMA Reads and atomics), the `_chunk` variants of both, and
/// [`Scope::local_remote`](crate::Scope::local_remote) (a remote-exposed region, racy by nature:
/// shared, and still device-writable). The borrow `'b` lasts as long as the scope the request is
/// posted in: the region can neither be touched (for `local_mut`), written (for `local`) nor
/// dropped until the scope has drained.
///
/// As with [`Local`](crate::Local), a range of 0 bytes is refused by the posts.
pub struct ScopedLocal<'b> {
    sge: ffi::ibv_sge,
    mr: &'b MrInner,
    writable: bool,
    /// The borrow of the bytes (shared or exclusive: which one is enforced by the constructor's
    /// argument, whose borrow this stands for).
    _bytes: PhantomData<&'b mut [u8]>,
}

impl fmt::Debug for ScopedLocal<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopedLocal")
            .field("addr", &format_args!("{:#x}", self.sge.addr))
            .field("len", &self.sge.length)
            .field("device_writable", &self.writable)
            .finish()
    }
}

impl<'b> ScopedLocal<'b> {
    pub(crate) fn new(
        mr: &'b MrInner,
        start: *mut u8,
        size: usize,
        range: impl RangeBounds<usize>,
        writable: bool,
    ) -> Result<Self> {
        let (offset, len) = check_range("Scope::local", range, size)?;
        let length = u32::try_from(len).map_err(|_| Error::InvalidArgument {
            verb: "Scope::local",
            reason: "a scatter/gather entry is at most 4 GiB - 1",
        })?;
        let addr = mr.device_addr(start).wrapping_add(offset as u64);
        Ok(ScopedLocal {
            sge: ffi::ibv_sge { addr, length, lkey: mr.lkey() },
            mr,
            writable,
            _bytes: PhantomData,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.sge.length
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.sge.length == 0
    }

    /// Whether the device may write it (made by `local_mut`, `local_chunk_mut` or
    /// `local_remote`).
    pub fn device_writable(&self) -> bool {
        self.writable
    }

    /// Splits the range into bytes `..mid` and `mid..` of it, both borrowed like this one: one
    /// exclusive borrow of a region becomes many disjoint receive buffers.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when `mid` is beyond the range.
    pub fn split_at(self, mid: u32) -> Result<(Self, Self)> {
        let Some((head, tail)) = split_sge(self.sge, mid) else {
            return Err(Error::OutOfBounds {
                verb: "ScopedLocal::split_at",
                offset: u64::from(mid),
                len: 0,
                size: u64::from(self.sge.length),
            });
        };
        let piece = |sge| ScopedLocal { sge, mr: self.mr, writable: self.writable, _bytes: PhantomData };
        Ok((piece(head), piece(tail)))
    }

    /// Splits the range into consecutive pieces of `size` bytes (the last one shorter when
    /// `size` does not divide the length); a `size` of 0 yields nothing.
    pub fn chunks(self, size: u32) -> impl Iterator<Item = ScopedLocal<'b>> {
        let mut rest = Some(self);
        std::iter::from_fn(move || {
            let cur = rest.take()?;
            if size == 0 || cur.is_empty() {
                return None;
            }
            let mid = size.min(cur.len());
            match cur.split_at(mid) {
                Ok((head, tail)) => {
                    rest = Some(tail);
                    Some(head)
                }
                Err(_) => None,
            }
        })
    }
}

/// Bytes `..mid` and `mid..` of `sge` (disjoint, covering it), or `None` when `mid` is beyond
/// its length.
fn split_sge(sge: ffi::ibv_sge, mid: u32) -> Option<(ffi::ibv_sge, ffi::ibv_sge)> {
    let rest = sge.length.checked_sub(mid)?;
    let head = ffi::ibv_sge { length: mid, ..sge };
    let tail = ffi::ibv_sge { addr: sge.addr.wrapping_add(u64::from(mid)), length: rest, lkey: sge.lkey };
    Some((head, tail))
}

/// Counts a request's borrowed entries for the checks the owned level runs.
fn facts(sges: &[Option<ScopedLocal<'_>>; MAX_SGE], pd: &std::sync::Arc<PdInner>) -> EntryFacts {
    let mut f = EntryFacts::default();
    for s in sges.iter().flatten() {
        f.count += 1;
        f.len += u64::from(s.sge.length);
        f.read_only |= !s.writable;
        f.foreign |= !s.mr.in_pd(pd);
        if s.sge.length == 0 {
            f.unusable = Some(crate::post::wr::EMPTY_ENTRY);
        }
    }
    f
}

/// Writes a request's borrowed entries as `ibv_sge`s; returns how many.
fn pack(sges: &[Option<ScopedLocal<'_>>; MAX_SGE], out: &mut [ffi::ibv_sge; MAX_SGE]) -> usize {
    let mut n = 0;
    for (o, s) in out.iter_mut().zip(sges.iter().flatten()) {
        *o = s.sge;
        n += 1;
    }
    n
}

/// A send-queue work request over borrowed memory (`struct ibv_send_wr`), posted with
/// [`Scope::post_send`](crate::Scope::post_send): Send, RDMA Write, RDMA Read or an atomic. The
/// builder mirrors [`SendRequest`]'s (inline data and window operations stay at the owned level:
/// [`Scope::post_send_owned`](crate::Scope::post_send_owned)).
pub struct ScopedSend<'b> {
    /// The operation and its options; its own entries stay empty.
    pub(crate) wr: SendRequest<'static>,
    sges: [Option<ScopedLocal<'b>>; MAX_SGE],
}

impl fmt::Debug for ScopedSend<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopedSend")
            .field("wr", &self.wr)
            .field("sges", &self.sges.iter().flatten().collect::<Vec<_>>())
            .finish()
    }
}

impl<'b> ScopedSend<'b> {
    fn with(wr: SendRequest<'static>, first: ScopedLocal<'b>) -> Self {
        ScopedSend { wr, sges: [Some(first), None, None, None] }
    }

    /// A Send of `local` (`IBV_WR_SEND`; with [`imm`](Self::imm), `IBV_WR_SEND_WITH_IMM`).
    pub fn send(local: ScopedLocal<'b>) -> Self {
        Self::with(SendRequest::send_op(), local)
    }

    /// An RDMA Write of `local` to `remote` (`IBV_WR_RDMA_WRITE`; with [`imm`](Self::imm),
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`).
    pub fn write(local: ScopedLocal<'b>, remote: RemoteSlice) -> Self {
        Self::with(SendRequest::write_op(remote), local)
    }

    /// An RDMA Read of `remote` into `local` (`IBV_WR_RDMA_READ`); `local` must be device
    /// writable ([`Scope::local_mut`](crate::Scope::local_mut)).
    pub fn read(local: ScopedLocal<'b>, remote: RemoteSlice) -> Self {
        Self::with(SendRequest::read_op(remote), local)
    }

    /// An atomic compare-and-swap (`IBV_WR_ATOMIC_CMP_AND_SWP`); the old value lands in
    /// `local` (8 device-writable bytes).
    pub fn compare_swap(local: ScopedLocal<'b>, remote: RemoteSlice, compare: u64, swap: u64) -> Self {
        Self::with(SendRequest::compare_swap_op(remote, compare, swap), local)
    }

    /// An atomic fetch-and-add (`IBV_WR_ATOMIC_FETCH_AND_ADD`); the old value lands in `local`
    /// (8 device-writable bytes).
    pub fn fetch_add(local: ScopedLocal<'b>, remote: RemoteSlice, add: u64) -> Self {
        Self::with(SendRequest::fetch_add_op(remote, add), local)
    }

    /// Adds a scatter/gather entry (at most [`MAX_SGE`] and the QP's `max_send_sge`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the request already has [`MAX_SGE`] entries.
    pub fn gather(mut self, local: ScopedLocal<'b>) -> Result<Self> {
        match self.sges.iter_mut().find(|s| s.is_none()) {
            Some(s) => {
                *s = Some(local);
                Ok(self)
            }
            None => {
                Err(Error::InvalidArgument { verb: "ibv_post_send", reason: "more than MAX_SGE entries" })
            }
        }
    }

    /// Immediate data (see [`SendRequest::imm`]).
    pub fn imm(mut self, imm: u32) -> Self {
        self.wr = self.wr.imm(imm);
        self
    }

    /// The caller's identifier, returned in the completion.
    pub fn wr_id(mut self, wr_id: u64) -> Self {
        self.wr = self.wr.wr_id(wr_id);
        self
    }

    /// Requests no completion (clears `IBV_SEND_SIGNALED`). The request then finishes with the next
    /// signaled completion of the send queue; if none follows in the scope, the drain cannot see it
    /// finish and ends by failing the queue pair (see
    /// [`QueuePair::scope`](crate::QueuePair::scope)).
    pub fn unsignaled(mut self) -> Self {
        self.wr = self.wr.unsignaled();
        self
    }

    /// Waits for earlier RDMA Reads and atomics first (`IBV_SEND_FENCE`).
    pub fn fence(mut self) -> Self {
        self.wr = self.wr.fence();
        self
    }

    /// Sets the solicited-event bit (`IBV_SEND_SOLICITED`).
    pub fn solicited(mut self) -> Self {
        self.wr = self.wr.solicited();
        self
    }

    /// The destination of a Send on a UD queue pair (see [`SendRequest::ud`]).
    pub fn ud(mut self, ah: &AddressHandle, remote_qpn: u32, remote_qkey: u32) -> Self {
        self.wr = self.wr.ud(ah, remote_qpn, remote_qkey);
        self
    }

    /// The destination XRC SRQ of a request on an XRC initiator (see [`SendRequest::xrc_srqn`]).
    pub fn xrc_srqn(mut self, srqn: u32) -> Self {
        self.wr = self.wr.xrc_srqn(srqn);
        self
    }

    /// Total bytes the request moves.
    pub fn len(&self) -> u64 {
        self.sges.iter().flatten().map(|s| u64::from(s.sge.length)).sum()
    }

    /// Whether it moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The checks of [`SendRequest`]'s validation, over the borrowed entries; returns their count.
    pub(crate) fn validate(&self, pd: &std::sync::Arc<PdInner>) -> Result<usize> {
        self.wr.check_entries(facts(&self.sges, pd), pd)
    }
}

impl Request for ScopedSend<'_> {
    type Raw = ffi::ibv_send_wr;
    const VERB: &'static str = "ibv_post_send";
    #[inline]
    fn fill_raw(&self, raw: &mut Self::Raw, sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64) {
        // The operation, flags and remote parts as for an owned request (no entries of its own,
        // no inline data), then the borrowed entries.
        self.wr.fill(raw, sges, device_wr_id);
        raw.num_sge = pack(&self.sges, sges) as i32;
    }
    fn link(raw: &mut Self::Raw, next: *mut Self::Raw) {
        raw.next = next;
    }
    #[inline]
    fn take_slot(&mut self) -> Slot {
        // No buffer: the scope's borrow keeps the memory until its drain.
        let ah = self.wr.ud.as_ref().map(|(ah, _, _)| ah.inner.clone());
        Slot { wr_id: self.wr.wr_id, bufs: SlotBufs::default(), _ah: ah }
    }
    #[inline]
    unsafe fn write_slot(&mut self, ring: &Ring<Slot>, pos: u32) {
        let slot = self.take_slot();
        // Light (nothing to drop) unless it holds a UD send's address handle.
        let heavy = slot._ah.is_some();
        // SAFETY: the caller's contract; the slot is initialised whole.
        unsafe { ring.write_in_place(pos, heavy, |p| p.write(slot)) };
    }
    fn give_back(&mut self, _slot: Slot, _sges: &[ffi::ibv_sge; MAX_SGE]) {
        // Nothing moved into the slot but a clone of the address handle, dropped here.
    }
}

/// A receive-queue work request over borrowed, device-writable memory (`struct ibv_recv_wr`),
/// posted with [`Scope::post_recv`](crate::Scope::post_recv).
pub struct ScopedRecv<'b> {
    sges: [Option<ScopedLocal<'b>>; MAX_SGE],
    wr_id: u64,
}

impl fmt::Debug for ScopedRecv<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopedRecv")
            .field("sges", &self.sges.iter().flatten().collect::<Vec<_>>())
            .field("wr_id", &self.wr_id)
            .finish()
    }
}

impl<'b> ScopedRecv<'b> {
    /// A receive into `local` (device writable: [`Scope::local_mut`](crate::Scope::local_mut)).
    pub fn new(local: ScopedLocal<'b>) -> Self {
        ScopedRecv { sges: [Some(local), None, None, None], wr_id: 0 }
    }

    /// Adds a scatter entry: the message fills the entries in order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the request already has [`MAX_SGE`] entries.
    pub fn scatter(mut self, local: ScopedLocal<'b>) -> Result<Self> {
        match self.sges.iter_mut().find(|s| s.is_none()) {
            Some(s) => {
                *s = Some(local);
                Ok(self)
            }
            None => {
                Err(Error::InvalidArgument { verb: "ibv_post_recv", reason: "more than MAX_SGE entries" })
            }
        }
    }

    /// The caller's identifier, returned in the completion.
    pub fn wr_id(mut self, wr_id: u64) -> Self {
        self.wr_id = wr_id;
        self
    }

    /// Checks the entries; returns their count.
    pub(crate) fn validate(&self, pd: &std::sync::Arc<PdInner>) -> Result<usize> {
        let f = facts(&self.sges, pd);
        let bad = |reason| Err(Error::InvalidArgument { verb: "ibv_post_recv", reason });
        if f.read_only {
            return bad("the device writes receive buffers: borrow them with Scope::local_mut");
        }
        if f.foreign {
            return bad("a buffer's memory region belongs to another protection domain");
        }
        if let Some(reason) = f.unusable {
            return bad(reason);
        }
        Ok(f.count)
    }
}

impl Request for ScopedRecv<'_> {
    type Raw = ffi::ibv_recv_wr;
    const VERB: &'static str = "ibv_post_recv";
    #[inline]
    fn fill_raw(&self, raw: &mut Self::Raw, sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64) {
        let n = pack(&self.sges, sges);
        raw.wr_id = device_wr_id;
        raw.next = std::ptr::null_mut();
        raw.sg_list = sges.as_mut_ptr();
        raw.num_sge = n as i32;
    }
    fn link(raw: &mut Self::Raw, next: *mut Self::Raw) {
        raw.next = next;
    }
    #[inline]
    fn take_slot(&mut self) -> Slot {
        Slot { wr_id: self.wr_id, bufs: SlotBufs::default(), _ah: None }
    }
    fn give_back(&mut self, _slot: Slot, _sges: &[ffi::ibv_sge; MAX_SGE]) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitting_an_entry_gives_disjoint_pieces_that_cover_it() {
        let sge = ffi::ibv_sge { addr: 0x1000, length: 100, lkey: 7 };
        let (a, b) = split_sge(sge, 30).unwrap();
        assert_eq!((a.addr, a.length, a.lkey), (0x1000, 30, 7));
        assert_eq!((b.addr, b.length, b.lkey), (0x1000 + 30, 70, 7));
        let (a, b) = split_sge(sge, 100).unwrap();
        assert_eq!((a.length, b.length, b.addr), (100, 0, 0x1000 + 100));
        assert_eq!(split_sge(sge, 0).map(|(a, b)| (a.length, b.length)), Some((0, 100)));
        assert!(split_sge(sge, 101).is_none());
        // At the top of the address space the tail's address wraps instead of overflowing.
        let top = ffi::ibv_sge { addr: u64::MAX - 9, length: 10, lkey: 1 };
        assert_eq!(split_sge(top, 10).map(|(_, b)| b.addr), Some(0));
    }
}
