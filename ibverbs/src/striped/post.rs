//! Posting striped requests and polling their completions.

use std::sync::Arc;

use super::connection::{Hold, StripeBuf, StripedConnection};
use super::plan::{self, pieces};
use crate::attr::QpState;
use crate::error::{Error, Result};
use crate::memory::{MemoryRegion, RemoteSlice};
use crate::post::{Local, SendRequest};
use crate::queue::WcStatus;

/// The operation of a striped request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StripedOp {
    /// RDMA Write (`IBV_WR_RDMA_WRITE`): local buffer → remote range.
    Write,
    /// RDMA Read (`IBV_WR_RDMA_READ`): remote range → local buffer.
    Read,
}

/// A refused striped post: nothing was posted, and the buffer comes back.
#[derive(Debug)]
pub struct StripedPostError {
    /// What went wrong.
    pub error: Error,
    /// The request's buffer: always `Some`. Nothing was posted, so every piece's chunk was
    /// dropped before this error is returned and an owned region is whole again (a piece the
    /// provider queued before failing counts as posted: the request is then accepted and
    /// reports [`WcStatus::GENERAL_ERR`] in its completion). `None` would mean a chunk of it is
    /// still alive elsewhere, which the connection never allows.
    pub buf: Option<StripeBuf>,
}

impl std::fmt::Display for StripedPostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

/// One completion per striped request, once every piece completed.
#[derive(Debug)]
pub struct StripedCompletion {
    wr_id: u64,
    status: WcStatus,
    op: StripedOp,
    len: u64,
    buf: Option<StripeBuf>,
}

impl StripedCompletion {
    /// The caller's `wr_id`.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }
    /// [`WcStatus::SUCCESS`] when every piece succeeded, else the first bad status polled (a
    /// failed piece's status; the pieces flushed after it report `WR_FLUSH_ERR` later), or
    /// [`WcStatus::GENERAL_ERR`] when the provider refused to post a piece after earlier pieces
    /// were posted, or failed after queuing a piece ([`Error::QueuedWithError`]: the request
    /// counts as posted, and completes once every posted piece did).
    pub fn status(&self) -> WcStatus {
        self.status
    }
    /// Whether every piece succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::SUCCESS
    }
    /// Write or Read.
    pub fn op(&self) -> StripedOp {
        self.op
    }
    /// Length of the request in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the request was empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Takes the request's buffer. Always `Some` for a shared source; for an owned region
    /// `Some` unless a chunk of it is still held elsewhere, which the connection never does
    /// (then the region is deregistered when that chunk goes).
    pub fn take_buf(&mut self) -> Option<StripeBuf> {
        self.buf.take()
    }
    /// Takes the owned region back (see [`take_buf`](Self::take_buf)).
    pub fn take_region(&mut self) -> Option<MemoryRegion> {
        match self.buf.take()? {
            StripeBuf::Owned(m) => Some(m),
            shared => {
                self.buf = Some(shared);
                None
            }
        }
    }
}

impl StripedConnection {
    /// Posts an RDMA Write of the whole of `buf` to `remote` (its first `buf.len()` bytes),
    /// split over the queue pairs as the options say (one `ibv_post_send` per piece, through
    /// [`QueuePair::post_send`](crate::QueuePair::post_send)). One [`StripedCompletion`] with
    /// `wr_id` comes from [`poll`](Self::poll) when all pieces completed.
    ///
    /// # Errors
    /// A [`StripedPostError`] handing `buf` back, nothing posted: [`Error::QueueFull`] when
    /// `depth` requests are outstanding, [`Error::QpState`] when a queue pair is not in RTS,
    /// [`Error::OutOfBounds`] when `remote` is shorter than `buf`, or the first piece's post error.
    #[doc(alias = "ibv_post_send")]
    pub fn post_write(
        &mut self,
        buf: impl Into<StripeBuf>,
        remote: RemoteSlice,
        wr_id: u64,
    ) -> Result<(), StripedPostError> {
        self.post(StripedOp::Write, buf.into(), remote, wr_id)
    }

    /// Posts an RDMA Read of `remote`'s first `buf.len()` bytes into the owned region `buf`,
    /// split as [`post_write`](Self::post_write). The region comes back in the completion.
    ///
    /// # Errors
    /// As [`post_write`](Self::post_write), and [`Error::InvalidArgument`] for a
    /// [`StripeBuf::Shared`] buffer (the device would write memory others can read).
    #[doc(alias = "ibv_post_send")]
    pub fn post_read(
        &mut self,
        buf: impl Into<StripeBuf>,
        remote: RemoteSlice,
        wr_id: u64,
    ) -> Result<(), StripedPostError> {
        self.post(StripedOp::Read, buf.into(), remote, wr_id)
    }

    fn post(
        &mut self,
        op: StripedOp,
        buf: StripeBuf,
        remote: RemoteSlice,
        wr_id: u64,
    ) -> Result<(), StripedPostError> {
        let fail = |error, buf| Err(StripedPostError { error, buf: Some(buf) });
        if op == StripedOp::Read && matches!(buf, StripeBuf::Shared(_)) {
            let reason = "an RDMA Read writes its buffer: pass an owned region";
            return fail(Error::InvalidArgument { verb: "ibv_post_send", reason }, buf);
        }
        let len = buf.len();
        if let Err(e) = remote.slice(0, len as u64) {
            return fail(e, buf);
        }
        if let Some(qp) = self.qps.iter().find(|qp| qp.state() != QpState::RTS) {
            return fail(Error::QpState { verb: "ibv_post_send", state: qp.state(), expected: "RTS" }, buf);
        }
        let Some(slot) = self.slots.acquire(wr_id, len as u64) else {
            let capacity = self.opts.depth;
            return fail(Error::QueueFull { verb: "ibv_post_send", capacity }, buf);
        };
        let hold = match buf {
            StripeBuf::Shared(m) => Hold::Shared(m),
            StripeBuf::Owned(m) => Hold::Owned(Arc::from(m.inner)),
        };
        let o = &self.opts;
        let first = self.next;
        let mut posted = 0u32;
        let mut first_error = None;
        for p in pieces(len, self.qps.len(), first, o.split_data, o.threshold, o.align) {
            let local = match &hold {
                Hold::Shared(m) => Local::new(m.clone(), p.offset..p.offset + p.len),
                Hold::Owned(mr) => Local::new(Hold::chunk(mr, p.offset, p.len), ..),
            };
            // In bounds by construction (pieces cover 0..len, checked against `remote` above).
            let posted_ok = local.and_then(|local| {
                let r = remote.slice(p.offset as u64, p.len as u64)?;
                let wr = match op {
                    StripedOp::Write => SendRequest::write(local, r),
                    StripedOp::Read => SendRequest::read(local, r),
                };
                // A refused request comes back with its buffer (a clone or a chunk): dropped here.
                self.qps[p.qp].post_send(wr.wr_id(self.slots.wire_id(slot, p.qp))).map_err(|e| e.error)
            });
            match posted_ok {
                Ok(()) => posted += 1,
                // Queued by the provider before it failed: posted, its chunk or clone in its
                // slot, its completion counted like the others'.
                Err(e @ Error::QueuedWithError { .. }) => {
                    posted += 1;
                    first_error = Some(e);
                    break;
                }
                Err(e) => {
                    first_error = Some(e);
                    break;
                }
            }
        }
        self.next = (first + 1) % self.qps.len();
        if posted == 0 {
            // Nothing posted: every piece's chunk or clone has been dropped.
            self.slots.release(slot);
            let error =
                first_error.unwrap_or(Error::InvalidArgument { verb: "ibv_post_send", reason: "no piece" });
            return Err(StripedPostError { error, buf: hold.give_back() });
        }
        let s = self.slots.get_mut(slot);
        s.pending = posted;
        s.read = op == StripedOp::Read;
        s.hold = Some(hold);
        if first_error.is_some() {
            s.status = WcStatus::GENERAL_ERR;
        }
        Ok(())
    }

    /// Polls the completion queue once (`ibv_poll_cq`, through
    /// [`CompletionQueue::poll`](crate::CompletionQueue::poll)) for up to an internal batch of
    /// piece completions, and appends to `out` one [`StripedCompletion`] per request whose
    /// last piece completed. Returns how many it appended. Allocates nothing when `out` has
    /// room (reserve [`StripeOptions::depth`](super::StripeOptions::depth) entries once).
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_poll_cq` fails.
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll(&mut self, out: &mut Vec<StripedCompletion>) -> Result<usize> {
        let before = out.len();
        let done = self.cq.poll(&mut self.wcs)?;
        for c in done.iter_mut() {
            // The piece's buffer (an Arc clone or a chunk) goes now, before the slot may
            // rebuild an owned region.
            for b in c.take_buffers() {
                drop(b);
            }
            // Only this connection's pieces: a completion of another queue pair sharing the CQ
            // (made on `cq()` by the caller) whose wr_id happens to look like a piece's is skipped.
            let ours = self.qps.get(plan::wire_qp(c.wr_id())).is_some_and(|qp| qp.qp_num() == c.qp_num());
            if !c.is_tracked() || !ours {
                continue;
            }
            let Some(i) = self.slots.lookup(c.wr_id()) else { continue };
            let s = self.slots.get_mut(i);
            if s.status == WcStatus::SUCCESS && !c.is_ok() {
                s.status = c.status();
            }
            s.pending -= 1;
            if s.pending == 0 {
                let (wr_id, status, len) = (s.wr_id, s.status, s.len);
                let op = if s.read { StripedOp::Read } else { StripedOp::Write };
                let buf = self.slots.release(i).and_then(Hold::give_back);
                out.push(StripedCompletion { wr_id, status, op, len, buf });
            }
        }
        Ok(out.len() - before)
    }
}
