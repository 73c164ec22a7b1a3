//! Registered buffer pools: keep a receive queue stocked from the chunks of one registration.
//!
//! Send-side staging buffers need no type of their own: a `Vec<Chunk>` with room for every chunk
//! is the free list. Pop a chunk, write the message into it, post it; its completion hands it
//! back ([`Completion::take_chunk`](crate::Completion::take_chunk)) to be pushed again. Nothing
//! allocates or registers while messages go (`examples/async_rpc.rs` stages its requests so):
//!
//! ```no_run
//! # fn f(pd: &ibverbs::ProtectionDomain, qp: &mut ibverbs::QueuePair, cq: &mut ibverbs::CompletionQueue) -> ibverbs::Result<()> {
//! use ibverbs::{Completion, Local, SendRequest};
//! let mut free = pd.allocate(64 * 4096)?.into_chunks(4096)?;
//! let mut wcs: [Completion; 16] = Default::default();
//! loop {
//!     if let Some(mut chunk) = free.pop() {
//!         let len = 5;
//!         chunk[..len].copy_from_slice(b"hello");
//!         qp.post_send(SendRequest::send(Local::new(chunk, ..len)?)).map_err(|e| e.error)?;
//!     }
//!     for wc in cq.poll(&mut wcs)? {
//!         free.extend(wc.take_chunk());
//!     }
//! }
//! # }
//! ```

use crate::error::{Error, PostError, Result};
use crate::memory::Chunk;
use crate::post::{Local, LocalBuf, RecvRequest};
use crate::queue::{QueuePair, SharedReceiveQueue};

/// Keeps a queue pair's receive queue stocked with [`Chunk`]s of one (or several)
/// registrations, the way servers register one large buffer once and carve it into slots.
///
/// The pool owns the chunks that are not posted; [`refill`](Self::refill) posts as many as the
/// receive queue has room for, and each receive completion hands its chunk back
/// ([`Completion::take_chunk`](crate::Completion::take_chunk)) to be read and then
/// [`put`](Self::put) back. Nothing allocates after [`new`](Self::new): the pool's storage holds
/// every chunk it was given.
///
/// ```no_run
/// # fn f(pd: &ibverbs::ProtectionDomain, qp: &mut ibverbs::QueuePair, cq: &mut ibverbs::CompletionQueue) -> ibverbs::Result<()> {
/// use ibverbs::{Completion, ReceivePool};
/// let mut pool = ReceivePool::new(pd.allocate(1 << 20)?.into_chunks(4096)?);
/// pool.refill(qp)?;
/// let mut wcs: [Completion; 16] = Default::default();
/// loop {
///     for wc in cq.poll(&mut wcs)? {
///         if let Some(chunk) = wc.take_chunk() {
///             // At most the chunk (a UD receive counts its 40-byte header in byte_len too).
///             let message = &chunk[..(wc.byte_len() as usize).min(chunk.len())];
///             // ... use the message in place ...
///             # let _ = message;
///             pool.put(chunk);
///         }
///     }
///     pool.refill(qp)?;
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct ReceivePool {
    free: Vec<Chunk>,
}

impl ReceivePool {
    /// A pool of `chunks`, none posted yet.
    pub fn new(chunks: Vec<Chunk>) -> ReceivePool {
        ReceivePool { free: chunks }
    }

    /// Chunks in the pool (not posted).
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Gives a chunk (back) to the pool. Does not allocate for chunks the pool held before (its
    /// storage has room for all of them).
    pub fn put(&mut self, chunk: Chunk) {
        self.free.push(chunk);
    }

    /// Posts receives into pool chunks (`ibv_post_recv()`, one request per chunk, `wr_id` = the
    /// chunk's offset in its region) until the queue pair's receive queue is full or the pool is
    /// empty; returns how many it posted.
    ///
    /// # Errors
    /// The error of the first post that failed (its chunk stays in the pool), e.g.
    /// [`Error::QpState`](crate::Error::QpState) in RESET or
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a chunk of another
    /// protection domain or an empty one when no other chunk could be posted before it (such a
    /// chunk goes to the bottom of the pool and ends the refill: later refills post the
    /// others first).
    #[doc(alias = "ibv_post_recv")]
    pub fn refill(&mut self, qp: &mut QueuePair) -> Result<usize> {
        // The safe level's receive ring: the depth asked for, which the device may have rounded
        // up in `caps()` (posting to that would end the refill on QueueFull).
        let room = qp.recv_capacity().saturating_sub(qp.outstanding_recvs()) as usize;
        let mut posted = 0;
        while posted < room {
            let Some(chunk) = self.free.pop() else { break };
            let wr_id = chunk.offset() as u64;
            if let Err(e) = qp.post_recv(RecvRequest::new(Local::whole(chunk)).wr_id(wr_id)) {
                return self.refused(e, posted);
            }
            posted += 1;
        }
        Ok(posted)
    }

    /// Posts receives into pool chunks on a shared receive queue (`ibv_post_srq_recv()`, one
    /// request per chunk, `wr_id` = the chunk's offset in its region) until the SRQ is full or
    /// the pool is empty; returns how many it posted. The chunks come back in the completions of
    /// whichever queue pairs take them, on their receive CQs.
    ///
    /// # Errors
    /// The error of the first post that failed (its chunk stays in the pool), e.g.
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a chunk of another
    /// protection domain.
    #[doc(alias = "ibv_post_srq_recv")]
    pub fn refill_srq(&mut self, srq: &mut SharedReceiveQueue) -> Result<usize> {
        let room = srq.capacity().saturating_sub(srq.outstanding()) as usize;
        let mut posted = 0;
        while posted < room {
            let Some(chunk) = self.free.pop() else { break };
            let wr_id = chunk.offset() as u64;
            if let Err(e) = srq.post_recv(RecvRequest::new(Local::whole(chunk)).wr_id(wr_id)) {
                return self.refused(e, posted);
            }
            posted += 1;
        }
        Ok(posted)
    }

    /// Takes a refused receive's chunk back, after `posted` receives of this refill. A chunk
    /// the post refuses for what it is (of another protection domain, or empty) goes to the
    /// bottom of the pool, so that later refills post the others first, and ends the refill:
    /// `Ok(posted)` when it posted some, else the error. After any other error (the queue
    /// pair's state, a full queue) the chunk is the next one tried, and the error returned.
    #[allow(clippy::result_large_err)] // takes the PostError the post returned, by value
    fn refused(&mut self, e: PostError<RecvRequest>, posted: usize) -> Result<usize> {
        let chunks = e.request.into_buffers().filter_map(LocalBuf::into_chunk);
        if matches!(e.error, Error::InvalidArgument { .. }) {
            for c in chunks {
                // No allocation: the storage had room for it before it was popped.
                self.free.insert(0, c);
            }
            if posted > 0 {
                return Ok(posted);
            }
        } else {
            self.free.extend(chunks);
        }
        Err(e.error)
    }
}
