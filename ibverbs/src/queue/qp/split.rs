//! One queue pair, two threads: a queue pair split into a send half and a receive half
//! ([`QueuePair::into_split`]), each posting to its own work queue's slot ring from its own
//! thread, without a lock between them.
//!
//! # Why it is sound
//!
//! Each work queue has one slot ring ([`Ring`](crate::post::ring::Ring)): one producer (the
//! poster) and one consumer (the poller of the CQ the queue completes into). The whole queue
//! pair is the producer of both rings, which is why its posts take `&mut QueuePair`. The halves
//! hand out exactly one producer role each: the [`SendHalf`] is the only producer of the send
//! ring, the [`RecvHalf`] the only producer of the receive ring, and neither can reach the
//! other's ring (nor any `&self` method of the queue pair that touches a ring: the halves do
//! not lend out `&QueuePair`). Nothing about the consumer changes: the rings stay registered in
//! their CQs' registries, and a completion finds its slot from its `wr_id` as before, with no
//! lock and no lookup by queue pair.
//!
//! The two halves share the queue pair through an `Arc`: it is destroyed (`ibv_destroy_qp`, then
//! its rings retired for their CQs to release the outstanding buffers) when the last half is
//! dropped, never while a half can still post. Dropping one half leaves the other working;
//! `mem::forget` of a half leaks the queue pair and the buffers it holds, nothing more. The
//! providers' `ibv_post_send` and `ibv_post_recv` may be called from two threads at once on one
//! queue pair (libibverbs' threading rule: each work queue has its own lock in the provider).
//!
//! Each half has its own scratch arrays for the chains it posts (the queue pair's own, moved
//! into the half). While split, the queue pair's state is what it was at the split: state
//! changes ([`connect`](QueuePair::connect), [`reset`](QueuePair::reset), ...) and the other
//! posting paths (prepared requests, scopes, binds) need the whole queue pair again
//! ([`SendHalf::reunite`], [`SendHalf::into_queue_pair`], [`RecvHalf::into_queue_pair`]).
//!
//! Extended queue pairs ([`QueuePairBuilder::send_ops`](crate::QueuePairBuilder::send_ops)) are
//! not split: a `ibv_wr_start` ... `ibv_wr_complete` sequence must not overlap any other post on
//! the queue pair (see [`QueuePair::qp_ex_raw`]).

use std::fmt;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::attr::QpState;
use crate::device::QpId;
use crate::error::{Error, PostError, Result};
use crate::post::engine::{post_chain, post_one};
use crate::post::{RecvRequest, SendRequest, MAX_SGE};
use crate::queue::qp::QueuePair;

/// The send half of a queue pair split by [`QueuePair::into_split`] (or
/// [`QueuePair::into_send_half`]): posts to its send queue (`ibv_post_send()`), from any one
/// thread at a time, while the [`RecvHalf`] posts receives from another.
///
/// The half is the only producer of the queue pair's send ring; completions are polled from the
/// send CQ as usual and hand the buffers back. Receives cannot be posted on it:
///
/// ```compile_fail,E0599
/// # fn f(send: &mut ibverbs::SendHalf, mr: ibverbs::MemoryRegion) {
/// send.post_recv(ibverbs::RecvRequest::new(ibverbs::Local::whole(mr)));
/// # }
/// ```
pub struct SendHalf {
    qp: Arc<QueuePair>,
    chain: Box<[ffi::ibv_send_wr]>,
    chain_sges: Box<[[ffi::ibv_sge; MAX_SGE]]>,
    /// Whether a [`RecvHalf`] was made with this half (`into_split`), not `into_send_half`.
    paired: bool,
}

/// The receive half of a queue pair split by [`QueuePair::into_split`]: posts to its receive
/// queue (`ibv_post_recv()`), from any one thread at a time, while the [`SendHalf`] posts sends
/// from another.
///
/// The half is the only producer of the queue pair's receive ring. Sends cannot be posted on
/// it:
///
/// ```compile_fail,E0599
/// # fn f(recv: &mut ibverbs::RecvHalf, data: &[u8]) {
/// recv.post_send(ibverbs::SendRequest::send_inline(data));
/// # }
/// ```
pub struct RecvHalf {
    qp: Arc<QueuePair>,
    chain: Box<[ffi::ibv_recv_wr]>,
    chain_sges: Box<[[ffi::ibv_sge; MAX_SGE]]>,
}

// SAFETY: the `Arc<QueuePair>` is Send and Sync (`QueuePair` is both); the scratch arrays hold
// pointers only while a post of this half runs (rewritten by each post), and belong to this half
// alone. Moving a half moves its producer role with it: the thread hand-off orders the old
// thread's ring writes before the new thread's.
unsafe impl Send for SendHalf {}
// SAFETY: as for SendHalf.
unsafe impl Send for RecvHalf {}

/// [`QueuePair::into_split`] or [`QueuePair::into_send_half`] refused: why, and the queue pair,
/// unchanged.
pub struct SplitError {
    /// Why the queue pair was not split ([`Error::InvalidArgument`]).
    pub error: Error,
    /// The queue pair, given back.
    pub queue_pair: QueuePair,
}

impl fmt::Debug for SplitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SplitError")
            .field("error", &self.error)
            .field("queue_pair", &self.queue_pair)
            .finish()
    }
}

impl fmt::Display for SplitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the queue pair was not split: {}", self.error)
    }
}

impl std::error::Error for SplitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// [`SendHalf::reunite`] of halves of two different queue pairs: both halves, given back.
pub struct ReuniteError(pub SendHalf, pub RecvHalf);

impl fmt::Debug for ReuniteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ReuniteError").field(&self.0).field(&self.1).finish()
    }
}

impl fmt::Display for ReuniteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the send and receive halves belong to different queue pairs")
    }
}

impl std::error::Error for ReuniteError {}

const SPLIT: &str = "QueuePair::into_split";

impl QueuePair {
    /// Splits the queue pair into a [`SendHalf`] and a [`RecvHalf`], each [`Send`], each posting
    /// to its own work queue (and slot ring) without a lock between them: one thread can post
    /// sends while another refills receives. Like `TcpStream::into_split`; the halves go back
    /// together with [`SendHalf::reunite`].
    ///
    /// Split a connected queue pair: while split its state stays as it was (the halves post in
    /// it; a device that moves it to ERR flushes their requests as usual). The queue pair is
    /// destroyed once both halves are dropped; outstanding buffers come back through the CQs as
    /// when a whole queue pair is dropped. See the module's *why it is sound* in the source
    /// (`queue/qp/split.rs`) and the crate's *Safety model*.
    ///
    /// # Errors
    /// A [`SplitError`] giving the queue pair back, with [`Error::InvalidArgument`] for a queue
    /// pair without both work queues of its own (one on a shared receive queue: use
    /// [`into_send_half`](Self::into_send_half); an XRC queue pair) or an extended one
    /// ([`QueuePairBuilder::send_ops`](crate::QueuePairBuilder::send_ops)).
    #[allow(clippy::result_large_err)] // the queue pair comes back whole
    pub fn into_split(mut self) -> std::result::Result<(SendHalf, RecvHalf), SplitError> {
        let refuse = |reason, qp| {
            Err(SplitError { error: Error::InvalidArgument { verb: SPLIT, reason }, queue_pair: qp })
        };
        if !self.has_send || !self.has_recv {
            return refuse(
                "only a queue pair with a send and a receive queue of its own is split in two (on a shared receive queue: into_send_half)",
                self,
            );
        }
        if self.ex.is_some() {
            return refuse("an extended queue pair (send_ops) is not split", self);
        }
        let (chain, chain_sges) = (std::mem::take(&mut self.chain), std::mem::take(&mut self.chain_sges));
        let recv_chain = std::mem::take(&mut self.recv_chain);
        let recv_chain_sges = std::mem::take(&mut self.recv_chain_sges);
        let qp = Arc::new(self);
        let send = SendHalf { qp: qp.clone(), chain, chain_sges, paired: true };
        let recv = RecvHalf { qp, chain: recv_chain, chain_sges: recv_chain_sges };
        Ok((send, recv))
    }

    /// The send half alone, of a queue pair that has no receive queue of its own: one on a
    /// shared receive queue ([`QueuePairBuilder::srq`](crate::QueuePairBuilder::srq), whose
    /// receives are posted to the SRQ from any thread) or an XRC initiator. Back with
    /// [`SendHalf::into_queue_pair`].
    ///
    /// # Errors
    /// A [`SplitError`] giving the queue pair back, with [`Error::InvalidArgument`] for a queue
    /// pair with a receive queue of its own (use [`into_split`](Self::into_split)) or without a
    /// send queue (an XRC target), or an extended one.
    #[allow(clippy::result_large_err)] // the queue pair comes back whole
    pub fn into_send_half(mut self) -> std::result::Result<SendHalf, SplitError> {
        let refuse = |reason, qp| {
            Err(SplitError {
                error: Error::InvalidArgument { verb: "QueuePair::into_send_half", reason },
                queue_pair: qp,
            })
        };
        if !self.has_send || self.has_recv {
            return refuse(
                "only a queue pair with a send queue and no receive queue of its own (on a shared receive queue) becomes a send half alone (else: into_split)",
                self,
            );
        }
        if self.ex.is_some() {
            return refuse("an extended queue pair (send_ops) is not split", self);
        }
        let (chain, chain_sges) = (std::mem::take(&mut self.chain), std::mem::take(&mut self.chain_sges));
        Ok(SendHalf { qp: Arc::new(self), chain, chain_sges, paired: false })
    }
}

/// The queue pair back from its last half: `Some` when no other half holds it.
fn last_one(qp: Arc<QueuePair>) -> std::result::Result<QueuePair, Arc<QueuePair>> {
    Arc::try_unwrap(qp)
}

/// Scratch arrays of `len` entries (a half that was dropped took its queue's with it).
fn scratch<W: Default + Clone>(len: usize) -> (Box<[W]>, Box<[[ffi::ibv_sge; MAX_SGE]]>) {
    (
        vec![W::default(); len].into_boxed_slice(),
        vec![[ffi::ibv_sge::default(); MAX_SGE]; len].into_boxed_slice(),
    )
}

impl SendHalf {
    /// Posts one send-queue work request (`ibv_post_send()`), safely, as
    /// [`QueuePair::post_send`] does: the queue pair keeps the request's buffers until its
    /// completion is polled from the send CQ.
    ///
    /// # Errors
    /// As [`QueuePair::post_send`]: a [`PostError`] handing the request back.
    #[doc(alias = "ibv_post_send")]
    #[allow(clippy::result_large_err)] // as QueuePair::post_send: no allocation on the post path
    pub fn post_send<'a>(
        &mut self,
        mut wr: SendRequest<'a>,
    ) -> std::result::Result<(), PostError<SendRequest<'a>>> {
        let qp = &*self.qp;
        if let Err(error) = qp.check_send(&wr) {
            return Err(PostError { error, request: wr });
        }
        wr.bind_to(qp.id, qp.qp_num());
        match post_one(qp.raw.as_ptr(), &qp.send, qp.post_send_fn, &mut wr) {
            Ok(()) => {
                wr.release_posted();
                // Holds nothing now (as in QueuePair::post_send).
                std::mem::forget(wr);
                Ok(())
            }
            Err(error) => Err(PostError { error, request: wr }),
        }
    }

    /// Posts a chain of send requests with one `ibv_post_send()` call (one doorbell), safely,
    /// as [`QueuePair::post_send_chain`] does: on success `wrs` is empty; on error it holds the
    /// requests that were not posted, with their buffers.
    ///
    /// # Errors
    /// As [`QueuePair::post_send_chain`].
    #[doc(alias = "ibv_post_send")]
    pub fn post_send_chain(&mut self, wrs: &mut Vec<SendRequest<'_>>) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let qp = &*self.qp;
        qp.check_send_state()?;
        let (id, qp_num) = (qp.id, qp.qp_num());
        for wr in wrs.iter_mut() {
            qp.check_send_request(wr)?;
            wr.bind_to(id, qp_num);
        }
        post_chain(qp.raw.as_ptr(), &qp.send, qp.post_send_fn, &mut self.chain, &mut self.chain_sges, wrs)
    }

    /// Send requests posted through the safe level and not yet completed.
    pub fn outstanding_sends(&self) -> u32 {
        self.qp.outstanding_sends()
    }

    /// How many send requests may be outstanding at once ([`QueuePair::send_capacity`]).
    pub fn send_capacity(&self) -> u32 {
        self.qp.send_capacity()
    }

    /// The QP number ([`QueuePair::qp_num`]).
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// The queue pair's process-unique id ([`QueuePair::id`]).
    pub fn id(&self) -> QpId {
        self.qp.id()
    }

    /// The state the queue pair was split in ([`QueuePair::state`]).
    pub fn state(&self) -> QpState {
        self.qp.state()
    }

    /// Queries the device for the current state (`ibv_query_qp()`, [`QueuePair::query_state`]).
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails.
    #[doc(alias = "ibv_query_qp")]
    pub fn query_state(&self) -> Result<QpState> {
        self.qp.query_state()
    }

    /// Queries the device for the queue pair's attributes (`ibv_query_qp()`,
    /// [`QueuePair::query`]).
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails.
    #[doc(alias = "ibv_query_qp")]
    pub fn query(&self) -> Result<crate::queue::qp::QpAttributes> {
        self.qp.query()
    }

    /// Whether `recv` is the other half of this half's queue pair.
    pub fn is_pair_of(&self, recv: &RecvHalf) -> bool {
        Arc::ptr_eq(&self.qp, &recv.qp)
    }

    /// Puts the queue pair back together from its two halves (the opposite of
    /// [`QueuePair::into_split`]), e.g. to change its state. Outstanding requests stay posted.
    ///
    /// # Errors
    /// A [`ReuniteError`] giving both halves back when they belong to different queue pairs.
    #[allow(clippy::result_large_err)] // both halves come back
    pub fn reunite(self, recv: RecvHalf) -> std::result::Result<QueuePair, ReuniteError> {
        if !self.is_pair_of(&recv) {
            return Err(ReuniteError(self, recv));
        }
        let RecvHalf { qp: recv_qp, chain: recv_chain, chain_sges: recv_chain_sges } = recv;
        drop(recv_qp);
        let SendHalf { qp, chain, chain_sges, paired: _ } = self;
        // The two halves held the only references (they lend none out), both here.
        let Ok(mut qp) = last_one(qp) else {
            unreachable!("a split queue pair is held by its two halves only")
        };
        qp.chain = chain;
        qp.chain_sges = chain_sges;
        qp.recv_chain = recv_chain;
        qp.recv_chain_sges = recv_chain_sges;
        Ok(qp)
    }

    /// The whole queue pair back from this half when no [`RecvHalf`] of it lives any more (it
    /// was dropped, or there never was one: [`QueuePair::into_send_half`]). A dropped receive
    /// half's scratch is allocated again.
    ///
    /// # Errors
    /// The half, given back, while its receive half lives.
    #[allow(clippy::result_large_err)] // the half comes back
    pub fn into_queue_pair(self) -> std::result::Result<QueuePair, SendHalf> {
        let SendHalf { qp, chain, chain_sges, paired } = self;
        match last_one(qp) {
            Ok(mut qp) => {
                qp.chain = chain;
                qp.chain_sges = chain_sges;
                if paired {
                    let (c, s) = scratch::<ffi::ibv_recv_wr>(qp.recv.capacity() as usize);
                    qp.recv_chain = c;
                    qp.recv_chain_sges = s;
                }
                Ok(qp)
            }
            Err(qp) => Err(SendHalf { qp, chain, chain_sges, paired }),
        }
    }
}

impl RecvHalf {
    /// Posts one receive request (`ibv_post_recv()`), safely, as [`QueuePair::post_recv`] does:
    /// the queue pair keeps its buffers until the completion hands them back.
    ///
    /// # Errors
    /// As [`QueuePair::post_recv`]: a [`PostError`] handing the request back.
    #[doc(alias = "ibv_post_recv")]
    #[allow(clippy::result_large_err)] // as QueuePair::post_recv
    pub fn post_recv(&mut self, mut wr: RecvRequest) -> std::result::Result<(), PostError<RecvRequest>> {
        let qp = &*self.qp;
        if let Err(error) = qp.check_recv(&wr) {
            return Err(PostError { error, request: wr });
        }
        match post_one(qp.raw.as_ptr(), &qp.recv, qp.post_recv_fn, &mut wr) {
            Ok(()) => Ok(()),
            Err(error) => Err(PostError { error, request: wr }),
        }
    }

    /// Posts a chain of receive requests with one `ibv_post_recv()` call, safely, as
    /// [`QueuePair::post_recv_chain`] does: on success `wrs` is empty; on error it holds the
    /// requests not posted.
    ///
    /// # Errors
    /// As [`QueuePair::post_recv_chain`].
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv_chain(&mut self, wrs: &mut Vec<RecvRequest>) -> Result<()> {
        let qp = &*self.qp;
        for wr in wrs.iter() {
            qp.check_recv(wr)?;
        }
        post_chain(qp.raw.as_ptr(), &qp.recv, qp.post_recv_fn, &mut self.chain, &mut self.chain_sges, wrs)
    }

    /// Receive requests posted through the safe level and not yet completed.
    pub fn outstanding_recvs(&self) -> u32 {
        self.qp.outstanding_recvs()
    }

    /// How many receive requests may be outstanding at once ([`QueuePair::recv_capacity`]).
    pub fn recv_capacity(&self) -> u32 {
        self.qp.recv_capacity()
    }

    /// The QP number ([`QueuePair::qp_num`]).
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// The queue pair's process-unique id ([`QueuePair::id`]).
    pub fn id(&self) -> QpId {
        self.qp.id()
    }

    /// The state the queue pair was split in ([`QueuePair::state`]).
    pub fn state(&self) -> QpState {
        self.qp.state()
    }

    /// The whole queue pair back from this half when its [`SendHalf`] was dropped (the send
    /// half's scratch is allocated again). With both halves: [`SendHalf::reunite`].
    ///
    /// # Errors
    /// The half, given back, while its send half lives.
    #[allow(clippy::result_large_err)] // the half comes back
    pub fn into_queue_pair(self) -> std::result::Result<QueuePair, RecvHalf> {
        let RecvHalf { qp, chain, chain_sges } = self;
        match last_one(qp) {
            Ok(mut qp) => {
                qp.recv_chain = chain;
                qp.recv_chain_sges = chain_sges;
                let (c, s) = scratch::<ffi::ibv_send_wr>(qp.send.capacity() as usize);
                qp.chain = c;
                qp.chain_sges = s;
                Ok(qp)
            }
            Err(qp) => Err(RecvHalf { qp, chain, chain_sges }),
        }
    }
}

impl fmt::Debug for SendHalf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendHalf")
            .field("qp_num", &self.qp.qp_num())
            .field("state", &self.qp.state())
            .finish()
    }
}

impl fmt::Debug for RecvHalf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvHalf")
            .field("qp_num", &self.qp.qp_num())
            .field("state", &self.qp.state())
            .finish()
    }
}
