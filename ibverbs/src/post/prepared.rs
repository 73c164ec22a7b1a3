//! Prepared requests: the fixed parts of a send-queue request (opcode, flags, remote key,
//! immediate data, UD address, local key) built and checked once, then posted many times with
//! only the `wr_id`, the local range and the remote offset changing, checked cheaply.

use std::fmt;
use std::ptr::addr_of_mut;
use std::sync::Arc;

use crate::ah::AhInner;
use crate::error::{Error, Result};
use crate::ffi;
use crate::memory::RemoteSlice;
use crate::post::engine::{Request, Slot};
use crate::post::ring::Ring;
use crate::post::wr::{LocalBuf, Op, SendRequest, MAX_SGE};

/// A send-queue request prepared for one queue pair by
/// [`QueuePair::prepare_send`](crate::QueuePair::prepare_send), posted with
/// [`QueuePair::post_prepared`](crate::QueuePair::post_prepared).
///
/// It holds a *shared* buffer (`Arc<MemoryRegion>` read by the device, or
/// `Arc<RemoteMemoryRegion>`), because it is posted again and again: each post puts one more
/// clone of the `Arc` in the request's slot, so the buffer outlives every posted request exactly
/// as with [`QueuePair::post_send`](crate::QueuePair::post_send).
pub struct PreparedSend {
    /// The queue pair it was checked for (its process-unique id: an `ibv_qp` address could be
    /// reused by a queue pair of another type or PD once the first is gone).
    pub(crate) qp: u64,
    /// The work request with everything but `wr_id`, the SGE and the remote address filled in.
    template: ffi::ibv_send_wr,
    lkey: u32,
    /// Start address and length of the local buffer.
    base: u64,
    buf_len: usize,
    buf: LocalBuf,
    /// The remote range of RDMA Write/Read and atomics.
    remote: Option<RemoteSlice>,
    atomic: bool,
    ah: Option<Arc<AhInner>>,
}

// SAFETY: the raw pointers in `template` (the UD address handle) point to objects this value
// keeps alive through its own `Arc`s, and are only read (copied into posts); the rest is owned
// data and Send + Sync handles.
unsafe impl Send for PreparedSend {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for PreparedSend {}

impl fmt::Debug for PreparedSend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedSend")
            .field("opcode", &self.template.opcode.0)
            .field("buf_len", &self.buf_len)
            .field("remote", &self.remote)
            .finish_non_exhaustive()
    }
}

impl PreparedSend {
    /// Builds the template from a request the queue pair already checked. `None` unless it has
    /// exactly one entry, over a shared buffer, and no inline data.
    pub(crate) fn from_checked(qp: u64, wr: &SendRequest<'_>) -> Option<PreparedSend> {
        let mut entries = wr.sges.iter().flatten();
        let (local, rest) = (entries.next()?, entries.next());
        if rest.is_some() || wr.inline.is_some() {
            return None;
        }
        let buf = local.buf.clone_shared()?;
        let (start, buf_len) = (buf.device_start(), buf.bounds().1);
        let mut template = ffi::ibv_send_wr::default();
        let mut sges = [ffi::ibv_sge::default(); MAX_SGE];
        wr.fill(&mut template, &mut sges, 0);
        template.sg_list = std::ptr::null_mut();
        let (remote, atomic) = match wr.op {
            Op::Send | Op::SendInv(_) => (None, false),
            // Window operations carry no entry: refused above.
            Op::BindMw | Op::LocalInv => return None,
            Op::Write(r) | Op::Read(r) => (Some(r), false),
            Op::CompareSwap { remote, .. } | Op::FetchAdd { remote, .. } => (Some(remote), true),
        };
        Some(PreparedSend {
            qp,
            template,
            lkey: sges[0].lkey,
            base: start,
            buf_len,
            buf,
            remote,
            atomic,
            ah: wr.ud.as_ref().map(|(ah, _, _)| ah.inner.clone()),
        })
    }

    /// Length of the local buffer the request draws its ranges from.
    pub fn buffer_len(&self) -> usize {
        self.buf_len
    }

    /// Checks one post's variable parts.
    pub(crate) fn check(&self, offset: usize, len: u32, remote_offset: u64) -> Result<()> {
        let end = offset.checked_add(len as usize);
        if end.map_or(true, |e| e > self.buf_len) {
            return Err(Error::OutOfBounds {
                verb: "ibv_post_send",
                offset: offset as u64,
                len: u64::from(len),
                size: self.buf_len as u64,
            });
        }
        if let Some(r) = self.remote {
            let end = remote_offset.checked_add(u64::from(len));
            if end.map_or(true, |e| e > r.len) {
                return Err(Error::OutOfBounds {
                    verb: "ibv_post_send",
                    offset: remote_offset,
                    len: u64::from(len),
                    size: r.len,
                });
            }
            if self.atomic && (len != 8 || (r.addr + remote_offset) % 8 != 0) {
                return Err(Error::InvalidArgument {
                    verb: "ibv_post_send",
                    reason: "an atomic moves 8 bytes at an 8-byte aligned remote address",
                });
            }
        } else if remote_offset != 0 {
            return Err(Error::InvalidArgument {
                verb: "ibv_post_send",
                reason: "a Send has no remote offset",
            });
        }
        Ok(())
    }
}

/// One post of a [`PreparedSend`] in a chain: the request, its `wr_id`, its local range
/// `offset..offset + len` and (RDMA Write/Read, atomics) its remote offset; built with
/// [`PreparedSend::at`], posted with
/// [`QueuePair::post_prepared_chain`](crate::QueuePair::post_prepared_chain).
#[derive(Clone, Copy)]
pub struct PreparedPost<'p> {
    pub(crate) prepared: &'p PreparedSend,
    pub(crate) wr_id: u64,
    pub(crate) offset: usize,
    pub(crate) len: u32,
    pub(crate) remote_offset: u64,
    /// `send_flags` of the template with `IBV_SEND_SIGNALED` cleared when the post is
    /// unsignaled.
    pub(crate) flags: u32,
}

impl fmt::Debug for PreparedPost<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedPost")
            .field("wr_id", &self.wr_id)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("remote_offset", &self.remote_offset)
            .field("signaled", &(self.flags & ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 != 0))
            .finish_non_exhaustive()
    }
}

impl PreparedSend {
    /// One post of this request with `wr_id`, local bytes `offset..offset + len` and remote
    /// bytes `remote_offset..remote_offset + len`, for
    /// [`QueuePair::post_prepared_chain`](crate::QueuePair::post_prepared_chain) (the ranges
    /// are checked when it is posted). Signaled as the request was prepared.
    pub fn at(&self, wr_id: u64, offset: usize, len: u32, remote_offset: u64) -> PreparedPost<'_> {
        PreparedPost { prepared: self, wr_id, offset, len, remote_offset, flags: self.template.send_flags }
    }
}

impl PreparedPost<'_> {
    /// Clears `IBV_SEND_SIGNALED`: the post produces no completion of its own; its slot is
    /// released by the next signaled completion of the queue pair (a prepared request holds
    /// only shared buffers, so that is always allowed).
    pub fn unsignaled(mut self) -> Self {
        self.flags &= !ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        self
    }
}

/// A chain of prepared posts stopped short:
/// [`QueuePair::post_prepared_chain`](crate::QueuePair::post_prepared_chain) posted the first
/// `posted` of them (their completions come as usual) and not the rest.
#[derive(Debug)]
pub struct PreparedChainError {
    /// How many posts, from the first, reached the device.
    pub posted: usize,
    /// Why the rest did not.
    pub error: Error,
}

impl fmt::Display for PreparedChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (after {} posted)", self.error, self.posted)
    }
}

impl std::error::Error for PreparedChainError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl PreparedPost<'_> {
    /// What the slot keeps alive: one more handle to the shared buffer (and the UD address).
    #[inline]
    pub(crate) fn slot(&self) -> Slot {
        let p = self.prepared;
        let buf = p.buf.clone_shared();
        Slot { wr_id: self.wr_id, bufs: [buf, None, None, None], _ah: p.ah.clone() }
    }

    /// [`slot`](Self::slot), written field by field into the ring's slot at `pos`.
    ///
    /// # Safety
    /// As [`Ring::write`]: the producer, for a free position.
    #[inline]
    pub(crate) unsafe fn write_slot_at(&self, ring: &Ring<Slot>, pos: u32) {
        let p = self.prepared;
        let (buf, ah) = (p.buf.clone_shared(), p.ah.clone());
        let init = |slot: *mut Slot| {
            // SAFETY: `slot` points to the free slot (uninitialised, ours alone); every field
            // is written once, so the whole value is initialised on return.
            unsafe {
                addr_of_mut!((*slot).wr_id).write(self.wr_id);
                let bufs = addr_of_mut!((*slot).bufs).cast::<Option<LocalBuf>>();
                bufs.write(buf);
                for k in 1..MAX_SGE {
                    bufs.add(k).write(None);
                }
                addr_of_mut!((*slot)._ah).write(ah);
            }
        };
        // SAFETY: the caller's contract; `init` initialises the whole slot.
        unsafe { ring.write_in_place(pos, init) };
    }
}

impl Request for PreparedPost<'_> {
    type Raw = ffi::ibv_send_wr;
    const VERB: &'static str = "ibv_post_send";

    #[inline]
    fn fill_raw(&self, raw: &mut Self::Raw, sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64) {
        let p = self.prepared;
        let t = &p.template;
        // Field by field rather than `*raw = *t`: a whole-struct copy of this size becomes a
        // `memcpy` call on the post path. Every field of `ibv_send_wr` is written.
        raw.wr_id = device_wr_id;
        raw.next = std::ptr::null_mut();
        raw.opcode = t.opcode;
        raw.send_flags = self.flags;
        raw.__bindgen_anon_1 = t.__bindgen_anon_1;
        raw.wr = t.wr;
        raw.qp_type = t.qp_type;
        raw.__bindgen_anon_2 = t.__bindgen_anon_2;
        sges[0] =
            ffi::ibv_sge { addr: p.base.wrapping_add(self.offset as u64), length: self.len, lkey: p.lkey };
        raw.sg_list = sges.as_mut_ptr();
        raw.num_sge = i32::from(self.len != 0);
        if let Some(r) = p.remote {
            // Checked: remote_offset + len <= r.len, and r.addr + r.len does not wrap (a
            // RemoteSlice from decode or slice; a hand-made one at worst names a bad address,
            // which the peer refuses).
            let addr = r.addr.wrapping_add(self.remote_offset);
            if p.atomic {
                raw.wr.atomic.remote_addr = addr;
            } else {
                raw.wr.rdma.remote_addr = addr;
            }
        }
    }

    fn link(raw: &mut Self::Raw, next: *mut Self::Raw) {
        raw.next = next;
    }

    #[inline]
    fn take_slot(&mut self) -> Slot {
        self.slot()
    }

    #[inline]
    unsafe fn write_slot(&mut self, ring: &Ring<Slot>, pos: u32) {
        // SAFETY: the caller's contract.
        unsafe { self.write_slot_at(ring, pos) };
    }

    fn give_back(&mut self, slot: Slot, _sges: &[ffi::ibv_sge; MAX_SGE]) {
        drop(slot); // only clones of shared handles
    }
}
