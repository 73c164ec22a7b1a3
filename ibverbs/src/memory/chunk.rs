//! [`Chunk`]: an owned, disjoint piece of one registration, so that a server registers one large
//! buffer once and carves it into thousands of receive or staging slots.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::memory::mr::{MemoryRegion, MrInner};

/// An owned piece of a local-only [`MemoryRegion`]: bytes `offset..offset + len` of it, usable
/// wherever a [`Local`](crate::Local) buffer is accepted, and dereferencing to `[u8]` while no
/// post holds it.
///
/// Chunks come from [`MemoryRegion::into_chunks`] and [`MemoryRegion::split_at`] (and split
/// further with [`Chunk::split_at`]); each holds the registration alive, which is deregistered
/// when the last chunk goes. Two chunks never overlap, and a chunk is not `Clone`: that is the
/// whole proof that the device writing one chunk never races a slice of another — ownership, no
/// runtime check on the post path. A chunk moved into a post is unreachable until its
/// completion hands it back ([`Completion::take_chunk`](crate::Completion::take_chunk)):
///
/// ```compile_fail,E0382
/// # fn f(qp: &mut ibverbs::QueuePair, chunk: ibverbs::Chunk) {
/// use ibverbs::{Local, RecvRequest};
/// qp.post_recv(RecvRequest::new(Local::whole(chunk))).unwrap();
/// let first = chunk[0]; // error: use of moved value `chunk`
/// # }
/// ```
pub struct Chunk {
    pub(crate) mr: Arc<MrInner>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl MemoryRegion {
    /// Carves the region into owned chunks of `size` bytes, in address order (the last one
    /// shorter when `size` does not divide the length).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `size` of 0; the region is dropped (deregistered) with
    /// the error.
    pub fn into_chunks(self, size: usize) -> Result<Vec<Chunk>> {
        if size == 0 {
            return Err(Error::InvalidArgument { verb: "MemoryRegion::into_chunks", reason: "chunk size 0" });
        }
        let mr: Arc<MrInner> = Arc::from(self.inner);
        let len = mr.len();
        Ok((0..len)
            .step_by(size)
            .map(|offset| Chunk { mr: mr.clone(), offset, len: size.min(len - offset) })
            .collect())
    }

    /// Splits the region into two owned chunks: bytes `..mid` and `mid..`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when `mid` is beyond the region; the region is dropped
    /// (deregistered) with the error. ([`Chunk::split_at`] hands its chunk back instead: compare
    /// `mid` with [`len`](Self::len) first to keep the region.)
    pub fn split_at(self, mid: usize) -> Result<(Chunk, Chunk)> {
        let len = self.len();
        Chunk { mr: Arc::from(self.inner), offset: 0, len }.split_at(mid).map_err(|(_, e)| e)
    }
}

impl Chunk {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the chunk is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the chunk starts in its region.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Start address of the chunk's memory.
    pub fn addr(&self) -> *mut u8 {
        // In bounds: offset <= the region's length (construction).
        self.mr.addr().wrapping_add(self.offset)
    }

    /// The local key of its region.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Splits the chunk into bytes `..mid` and `mid..` of it.
    ///
    /// # Errors
    /// The chunk back, with [`Error::OutOfBounds`], when `mid` is beyond it.
    #[allow(clippy::result_large_err)] // the chunk comes back whole
    pub fn split_at(self, mid: usize) -> std::result::Result<(Chunk, Chunk), (Chunk, Error)> {
        if mid > self.len {
            let e = Error::OutOfBounds {
                verb: "Chunk::split_at",
                offset: mid as u64,
                len: 0,
                size: self.len as u64,
            };
            return Err((self, e));
        }
        let tail = Chunk { mr: self.mr.clone(), offset: self.offset + mid, len: self.len - mid };
        Ok((Chunk { len: mid, ..self }, tail))
    }

    /// The chunk's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: inside the region, which stays registered and allocated while this chunk holds
        // it; the region is local-only (into_chunks takes a MemoryRegion), chunks are disjoint
        // and not Clone, and a posted chunk is owned by the queue pair, so nothing else writes
        // these bytes while the slice lives.
        unsafe { std::slice::from_raw_parts(self.addr(), self.len) }
    }

    /// The chunk's bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.addr(), self.len) }
    }
}

impl std::ops::Deref for Chunk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for Chunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl fmt::Debug for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chunk")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("lkey", &self.lkey())
            .finish()
    }
}
