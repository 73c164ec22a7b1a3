//! Typed builders of raw work requests for the `unsafe` level
//! ([`QueuePair::post_send_unchecked`](crate::QueuePair::post_send_unchecked),
//! [`QueuePair::post_recv_unchecked`](crate::QueuePair::post_recv_unchecked)), so that code at C's
//! cost never names bindgen's unions (`ibv_send_wr__bindgen_ty_2__bindgen_ty_1`).
//!
//! [`RawSend`] and [`RawRecv`] are `#[repr(transparent)]` over `ffi::ibv_send_wr` and
//! `ffi::ibv_recv_wr`: build them once, keep them in an array, change only what changes per post
//! (`set_wr_id`, `set_remote`, the SGE), link them with [`RawSend::chain`], and post the head.
//! Building and posting cost what the same stores in C cost (every method is `#[inline]` and
//! only writes fields). Nothing here is checked or tracked: the `# Safety` contract of the post
//! call covers the pointers these values carry.
//!
//! ```no_run
//! # fn f(qp: &ibverbs::QueuePair, src: &ibverbs::RemoteMemoryRegion, dst: ibverbs::RemoteSlice) {
//! use ibverbs::raw::{sge, RawSend};
//! let mut sg = [sge(src.addr() as u64, 64, src.lkey())];
//! let mut wr = RawSend::write(dst).wr_id(7).sg_list(&mut sg).inline(true);
//! let mut bad = std::ptr::null_mut();
//! // SAFETY: `src` is registered in the QP's PD and outlives the request's completion; ...
//! unsafe { qp.post_send_unchecked(wr.as_mut_ptr(), &mut bad) }.unwrap();
//! # }
//! ```

use ibverbs_sys as ffi;

use crate::ah::AddressHandle;
use crate::memory::RemoteSlice;

/// A scatter/gather entry (`struct ibv_sge`): `length` bytes at device address `addr` of the
/// region whose local key is `lkey`.
#[inline]
pub fn sge(addr: u64, length: u32, lkey: u32) -> ffi::ibv_sge {
    ffi::ibv_sge { addr, length, lkey }
}

/// A raw send work request (`struct ibv_send_wr`), signaled by default.
#[repr(transparent)]
#[derive(Clone, Copy, Default)]
pub struct RawSend(pub ffi::ibv_send_wr);

impl std::fmt::Debug for RawSend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawSend")
            .field("wr_id", &self.0.wr_id)
            .field("opcode", &self.0.opcode.0)
            .field("num_sge", &self.0.num_sge)
            .field("send_flags", &self.0.send_flags)
            .finish_non_exhaustive()
    }
}

impl RawSend {
    #[inline]
    fn op(opcode: ffi::ibv_wr_opcode) -> Self {
        RawSend(ffi::ibv_send_wr {
            opcode,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        })
    }

    /// A Send (`IBV_WR_SEND`).
    #[inline]
    pub fn send() -> Self {
        Self::op(ffi::ibv_wr_opcode::IBV_WR_SEND)
    }

    /// An RDMA Write to `remote` (`IBV_WR_RDMA_WRITE`).
    #[inline]
    pub fn write(remote: RemoteSlice) -> Self {
        Self::op(ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE).remote(remote.addr, remote.rkey)
    }

    /// An RDMA Read from `remote` (`IBV_WR_RDMA_READ`).
    #[inline]
    pub fn read(remote: RemoteSlice) -> Self {
        Self::op(ffi::ibv_wr_opcode::IBV_WR_RDMA_READ).remote(remote.addr, remote.rkey)
    }

    /// A compare-and-swap of the 8 bytes at `remote.addr` (`IBV_WR_ATOMIC_CMP_AND_SWP`): the
    /// old value lands in the single 8-byte SGE.
    #[inline]
    pub fn compare_swap(remote: RemoteSlice, compare: u64, swap: u64) -> Self {
        let mut w = Self::op(ffi::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP);
        w.0.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
            remote_addr: remote.addr,
            compare_add: compare,
            swap,
            rkey: remote.rkey,
        };
        w
    }

    /// A fetch-and-add of `add` to the 8 bytes at `remote.addr` (`IBV_WR_ATOMIC_FETCH_AND_ADD`).
    #[inline]
    pub fn fetch_add(remote: RemoteSlice, add: u64) -> Self {
        let mut w = Self::op(ffi::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD);
        w.0.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
            remote_addr: remote.addr,
            compare_add: add,
            swap: 0,
            rkey: remote.rkey,
        };
        w
    }

    /// Adds immediate data (Send → `IBV_WR_SEND_WITH_IMM`, RDMA Write →
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`; other opcodes are left as they are). `imm` is in host
    /// order; it travels in network order, as the receiver's completion reports it.
    #[inline]
    pub fn imm(mut self, imm: u32) -> Self {
        self.0.opcode = match self.0.opcode {
            ffi::ibv_wr_opcode::IBV_WR_SEND => ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM,
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            op => op,
        };
        self.0.__bindgen_anon_1.imm_data = imm.to_be();
        self
    }

    /// Sets the caller's `wr_id` (keep bit 63 clear: it marks the safe level's requests).
    #[inline]
    pub fn wr_id(mut self, wr_id: u64) -> Self {
        self.0.wr_id = wr_id;
        self
    }

    /// Points the request at `sges` (`sg_list`, `num_sge`). The pointer is stored: `sges` must
    /// stay in place until the post call returns.
    #[inline]
    pub fn sg_list(mut self, sges: &mut [ffi::ibv_sge]) -> Self {
        self.set_sg_list(sges);
        self
    }

    /// Requests a completion (`IBV_SEND_SIGNALED`, the default) or not.
    #[inline]
    pub fn signaled(self, on: bool) -> Self {
        self.flag(ffi::ibv_send_flags::IBV_SEND_SIGNALED.0, on)
    }

    /// Copies the data into the work queue while posting (`IBV_SEND_INLINE`).
    #[inline]
    pub fn inline(self, on: bool) -> Self {
        self.flag(ffi::ibv_send_flags::IBV_SEND_INLINE.0, on)
    }

    /// Waits for earlier RDMA Reads and atomics first (`IBV_SEND_FENCE`).
    #[inline]
    pub fn fence(self, on: bool) -> Self {
        self.flag(ffi::ibv_send_flags::IBV_SEND_FENCE.0, on)
    }

    /// Sets the solicited-event bit (`IBV_SEND_SOLICITED`).
    #[inline]
    pub fn solicited(self, on: bool) -> Self {
        self.flag(ffi::ibv_send_flags::IBV_SEND_SOLICITED.0, on)
    }

    #[inline]
    fn flag(mut self, bit: u32, on: bool) -> Self {
        self.set_flag(bit, on);
        self
    }

    #[inline]
    fn set_flag(&mut self, bit: u32, on: bool) {
        if on {
            self.0.send_flags |= bit;
        } else {
            self.0.send_flags &= !bit;
        }
    }

    /// Requests a completion or not, in place (e.g. every `n`th request of a stream).
    #[inline]
    pub fn set_signaled(&mut self, on: bool) {
        self.set_flag(ffi::ibv_send_flags::IBV_SEND_SIGNALED.0, on);
    }

    /// The UD destination: address handle, remote QP number and Q_Key. The handle's pointer is
    /// stored: it must outlive the request's completion.
    #[inline]
    pub fn ud(mut self, ah: &AddressHandle, remote_qpn: u32, remote_qkey: u32) -> Self {
        self.0.wr.ud =
            ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 { ah: ah.as_raw(), remote_qpn, remote_qkey };
        self
    }

    #[inline]
    fn remote(mut self, remote_addr: u64, rkey: u32) -> Self {
        self.set_remote(remote_addr, rkey);
        self
    }

    /// Changes the remote address and key in place: of an RDMA Write or Read (`wr.rdma`), or of
    /// an atomic (`wr.atomic`, whose compare/add and swap operands stay as they are).
    #[inline]
    pub fn set_remote(&mut self, remote_addr: u64, rkey: u32) {
        use ffi::ibv_wr_opcode as O;
        match self.0.opcode {
            O::IBV_WR_ATOMIC_CMP_AND_SWP | O::IBV_WR_ATOMIC_FETCH_AND_ADD => {
                // SAFETY: an atomic's request was built with its `atomic` member (the
                // constructors); plain integers in any case.
                let at = unsafe { &mut self.0.wr.atomic };
                (at.remote_addr, at.rkey) = (remote_addr, rkey);
            }
            _ => self.0.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey },
        }
    }

    /// Changes the `wr_id` in place.
    #[inline]
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.0.wr_id = wr_id;
    }

    /// Points the request at `sges` in place (see [`sg_list`](Self::sg_list)).
    #[inline]
    pub fn set_sg_list(&mut self, sges: &mut [ffi::ibv_sge]) {
        self.0.sg_list = sges.as_mut_ptr();
        self.0.num_sge = i32::try_from(sges.len()).unwrap_or(i32::MAX);
    }

    /// Links `wrs` into one chain in order (each `next` to the following one, the last to
    /// `NULL`) and returns its head (`NULL` for an empty slice), for one doorbell. The pointers
    /// stay valid while `wrs` is neither moved nor borrowed again mutably.
    #[inline]
    pub fn chain(wrs: &mut [RawSend]) -> *mut ffi::ibv_send_wr {
        // SAFETY: RawSend is repr(transparent) over ibv_send_wr; `next` is its link field.
        unsafe {
            link(wrs.as_mut_ptr().cast::<ffi::ibv_send_wr>(), wrs.len(), |w| {
                std::ptr::addr_of_mut!((*w).next)
            })
        }
    }

    /// The C struct, for the post call.
    #[inline]
    pub fn as_mut_ptr(&mut self) -> *mut ffi::ibv_send_wr {
        &mut self.0
    }
}

/// Links the `n` work requests at `base` into one chain in order (each `next` to the following
/// one, the last to `NULL`); returns the head, `NULL` when `n` is 0. Every access goes through
/// `base`, so the links stay valid while the array is neither moved nor borrowed again.
///
/// # Safety
/// `base` points to `n` initialised work requests, writable, and `next_of(w)` is the address of
/// the `next` field of the request at `w`.
unsafe fn link<W>(base: *mut W, n: usize, next_of: impl Fn(*mut W) -> *mut *mut W) -> *mut W {
    for i in 0..n {
        // SAFETY: i < n and i + 1 <= n (one past the end is never dereferenced); the contract.
        unsafe { *next_of(base.add(i)) = if i + 1 < n { base.add(i + 1) } else { std::ptr::null_mut() } };
    }
    if n == 0 {
        std::ptr::null_mut()
    } else {
        base
    }
}

/// A raw receive work request (`struct ibv_recv_wr`).
#[repr(transparent)]
#[derive(Clone, Copy, Default)]
pub struct RawRecv(pub ffi::ibv_recv_wr);

impl std::fmt::Debug for RawRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawRecv").field("wr_id", &self.0.wr_id).field("num_sge", &self.0.num_sge).finish()
    }
}

impl RawRecv {
    /// A receive into `sges` (stored as a pointer: see [`RawSend::sg_list`]) with `wr_id`.
    #[inline]
    pub fn new(wr_id: u64, sges: &mut [ffi::ibv_sge]) -> Self {
        let mut r = RawRecv(ffi::ibv_recv_wr { wr_id, ..Default::default() });
        r.set_sg_list(sges);
        r
    }

    /// Points the request at `sges` in place.
    #[inline]
    pub fn set_sg_list(&mut self, sges: &mut [ffi::ibv_sge]) {
        self.0.sg_list = sges.as_mut_ptr();
        self.0.num_sge = i32::try_from(sges.len()).unwrap_or(i32::MAX);
    }

    /// Changes the `wr_id` in place.
    #[inline]
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.0.wr_id = wr_id;
    }

    /// Links `wrs` into one chain; see [`RawSend::chain`].
    #[inline]
    pub fn chain(wrs: &mut [RawRecv]) -> *mut ffi::ibv_recv_wr {
        // SAFETY: RawRecv is repr(transparent) over ibv_recv_wr; `next` is its link field.
        unsafe {
            link(wrs.as_mut_ptr().cast::<ffi::ibv_recv_wr>(), wrs.len(), |w| {
                std::ptr::addr_of_mut!((*w).next)
            })
        }
    }

    /// The C struct, for the post call.
    #[inline]
    pub fn as_mut_ptr(&mut self) -> *mut ffi::ibv_recv_wr {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builders_fill_the_c_fields() {
        let remote = RemoteSlice { addr: 0x1000, len: 64, rkey: 9 };
        let mut sg = [sge(0x2000, 64, 3), sge(0x3000, 8, 3)];
        let w = RawSend::write(remote).wr_id(5).sg_list(&mut sg).inline(true).imm(0x0102_0304);
        assert_eq!(w.0.opcode, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(w.0.wr_id, 5);
        assert_eq!(w.0.num_sge, 2);
        assert_eq!(w.0.sg_list, sg.as_mut_ptr());
        // SAFETY: the rdma member was the one written.
        let rdma = unsafe { w.0.wr.rdma };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0x1000, 9));
        // SAFETY: imm_data was written.
        assert_eq!(unsafe { w.0.__bindgen_anon_1.imm_data }, 0x0102_0304u32.to_be());
        let f = w.0.send_flags;
        assert_eq!(
            f,
            ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 | ffi::ibv_send_flags::IBV_SEND_INLINE.0,
            "signaled by default"
        );
        assert_eq!(RawSend::send().signaled(false).0.send_flags, 0);
        let a = RawSend::compare_swap(remote, 1, 2);
        // SAFETY: the atomic member was written.
        let at = unsafe { a.0.wr.atomic };
        assert_eq!((at.remote_addr, at.compare_add, at.swap, at.rkey), (0x1000, 1, 2, 9));
        // Moving an atomic keeps its operands (the `rdma` member overlaps compare_add).
        let mut moved = a;
        moved.set_remote(0x2000, 11);
        // SAFETY: as above.
        let at = unsafe { moved.0.wr.atomic };
        assert_eq!((at.remote_addr, at.compare_add, at.swap, at.rkey), (0x2000, 1, 2, 11));
        assert_eq!(RawSend::read(remote).imm(1).0.opcode, ffi::ibv_wr_opcode::IBV_WR_RDMA_READ);
    }

    #[test]
    fn chains_link_in_order_and_end_in_null() {
        let mut wrs = [RawSend::send().wr_id(1), RawSend::send().wr_id(2), RawSend::send().wr_id(3)];
        let head = RawSend::chain(&mut wrs);
        let mut ids = Vec::new();
        let mut p = head;
        while !p.is_null() {
            // SAFETY: a chain just linked over `wrs`, which is not touched meanwhile.
            unsafe {
                ids.push((*p).wr_id);
                p = (*p).next;
            }
        }
        assert_eq!(ids, [1, 2, 3]);
        assert!(RawSend::chain(&mut []).is_null());
        let mut sg = [sge(0, 1, 1)];
        let mut rs = [RawRecv::new(4, &mut sg), RawRecv::new(5, &mut sg)];
        let head = RawRecv::chain(&mut rs);
        // SAFETY: as above.
        unsafe { assert_eq!((*(*head).next).wr_id, 5) };
    }
}
