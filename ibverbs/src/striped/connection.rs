//! [`StripedConnection`]: its queue pairs, how it is built and connected ([`StripeOptions`]), and
//! the sources and destinations its requests hold ([`StripeBuf`]). Posting and polling are in
//! `post.rs`, the cutting of requests into pieces in `plan.rs`.

use std::sync::Arc;

use crate::connect::ConnectOptions;
use crate::error::{Error, Result};
use crate::memory::{Chunk, MemoryRegion, MrInner};
use crate::pd::ProtectionDomain;
use crate::queue::{Completion, CompletionQueue, QpType, QueuePair};
use crate::striped::endpoints::EndpointList;
use crate::striped::plan;

/// How a [`StripedConnection`] is built and how it splits requests.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(default))]
pub struct StripeOptions {
    /// Queue pairs per connection (`NCCL_IB_QPS_PER_CONNECTION`), 1..=[`EndpointList::MAX`].
    pub qps: u32,
    /// Split requests longer than [`threshold`](Self::threshold) over the queue pairs
    /// (`NCCL_IB_SPLIT_DATA_ON_QPS=1`); when `false`, every request goes whole to the next
    /// queue pair, round-robin (`=0`). Default `true` (NCCL 2.12+ defaults to 0; the
    /// environment variable, when set, decides).
    pub split_data: bool,
    /// Requests of at most this many bytes are never split (default 16 KiB).
    pub threshold: usize,
    /// Split pieces are multiples of this many bytes, except the last (default 128, as NCCL).
    pub align: usize,
    /// Requests outstanding at once (and send queue depth of each queue pair), default 128.
    pub depth: u32,
}

impl Default for StripeOptions {
    fn default() -> Self {
        StripeOptions { qps: 1, split_data: true, threshold: 16 << 10, align: 128, depth: 128 }
    }
}

/// What a striped request uses as its local buffer.
#[derive(Debug)]
pub enum StripeBuf {
    /// An owned region, moved in (Writes and Reads): cut into owned chunks, one per piece, and
    /// handed back whole when every piece has completed.
    Owned(MemoryRegion),
    /// A shared region (Writes only: the device reads it), as [`LocalBuf::Shared`](crate::LocalBuf::Shared).
    Shared(Arc<MemoryRegion>),
}

impl From<MemoryRegion> for StripeBuf {
    fn from(m: MemoryRegion) -> Self {
        StripeBuf::Owned(m)
    }
}
impl From<Arc<MemoryRegion>> for StripeBuf {
    fn from(m: Arc<MemoryRegion>) -> Self {
        StripeBuf::Shared(m)
    }
}

impl StripeBuf {
    /// Length of the region in bytes.
    pub fn len(&self) -> usize {
        match self {
            StripeBuf::Owned(m) => m.len(),
            StripeBuf::Shared(m) => m.len(),
        }
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The owned region back, if this is [`StripeBuf::Owned`].
    pub fn into_region(self) -> Option<MemoryRegion> {
        match self {
            StripeBuf::Owned(m) => Some(m),
            StripeBuf::Shared(_) => None,
        }
    }
}

/// What a request's slot holds until all its pieces completed.
#[derive(Debug)]
pub(crate) enum Hold {
    /// One more clone of a shared source, handed back.
    Shared(Arc<MemoryRegion>),
    /// The registration of an owned region whose chunks are out; only a reference count.
    Owned(Arc<MrInner>),
}

impl Hold {
    /// The request's buffer back: an owned region only once no chunk of it exists.
    pub(crate) fn give_back(self) -> Option<StripeBuf> {
        match self {
            Hold::Shared(m) => Some(StripeBuf::Shared(m)),
            Hold::Owned(mr) => Arc::try_unwrap(mr)
                .ok()
                .map(|inner| StripeBuf::Owned(MemoryRegion { inner: Box::new(inner) })),
        }
    }

    /// An owned chunk of bytes `offset..offset + len` of an owned region.
    pub(crate) fn chunk(mr: &Arc<MrInner>, offset: usize, len: usize) -> Chunk {
        Chunk { mr: mr.clone(), offset, len }
    }
}

/// One connection made of [`StripeOptions::qps`] RC queue pairs on one protection domain and one
/// completion queue, that stripes large RDMA Writes and Reads across them and reports one
/// [`StripedCompletion`](crate::striped::StripedCompletion) per request (see the
/// [module docs](crate::striped) for the ownership argument).
///
/// ```no_run
/// use ibverbs::striped::{StripeOptions, StripedConnection};
/// use ibverbs::{AccessFlags, ConnectOptions, Context};
///
/// let ctx = Context::open(None)?;
/// let pd = ctx.alloc_pd()?;
/// let opts = ConnectOptions::default();
/// let stripe = StripeOptions { qps: 4, ..StripeOptions::default() };
/// let mut a = StripedConnection::new(&pd, &stripe)?;
/// let mut b = StripedConnection::new(&pd, &stripe)?;
/// // Exchange the encoded lists out of band in real programs.
/// let (ea, eb) = (a.endpoints(&opts)?, b.endpoints(&opts)?);
/// a.connect(&eb, &opts)?;
/// b.connect(&ea, &opts)?;
///
/// let target = pd.allocate_remote(1 << 20, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
/// let src = pd.allocate(1 << 20)?;
/// a.post_write(src, target.remote(), 7).map_err(|e| e.error)?;
/// let mut done = Vec::with_capacity(8);
/// while done.is_empty() {
///     a.poll(&mut done)?;
/// }
/// assert!(done[0].is_ok() && done[0].wr_id() == 7);
/// let src = done[0].take_region().expect("every piece done: the region comes back");
/// # drop(src);
/// # Ok::<(), ibverbs::Error>(())
/// ```
pub struct StripedConnection {
    // Field order is drop order: the queue pairs go first (ibv_destroy_qp), then the CQ.
    pub(super) qps: Vec<QueuePair>,
    pub(super) cq: CompletionQueue,
    pub(super) slots: plan::Slots<Hold>,
    pub(super) wcs: Box<[Completion]>,
    pub(super) next: usize,
    pub(super) opts: StripeOptions,
}

/// Refuses `qps` outside 1..=[`EndpointList::MAX`] and a `depth` outside 1..=65 536, naming
/// `verb`.
fn check_options(opts: &StripeOptions, verb: &'static str) -> Result<()> {
    let bad = |reason| Err(Error::InvalidArgument { verb, reason });
    if opts.qps == 0 || opts.qps as usize > EndpointList::MAX {
        return bad("qps must be in 1..=64");
    }
    if opts.depth == 0 || opts.depth > 1 << 16 {
        return bad("depth must be in 1..=65536");
    }
    Ok(())
}

impl std::fmt::Debug for StripedConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripedConnection")
            .field("qps", &self.qps.iter().map(QueuePair::qp_num).collect::<Vec<_>>())
            .field("outstanding", &self.slots.outstanding())
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl StripedConnection {
    /// Creates a completion queue (`ibv_create_cq`) with room for every piece, and
    /// `opts.qps` RC queue pairs on `pd` (`ibv_create_qp`), each with a send queue of
    /// `opts.depth` requests and a receive queue of one.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `qps` outside 1..=[`EndpointList::MAX`] or a `depth` of 0
    /// (or above 65 536); [`Error::Verb`] when the device refuses the CQ or a queue pair.
    #[doc(alias = "ibv_create_qp")]
    pub fn new(pd: &ProtectionDomain, opts: &StripeOptions) -> Result<StripedConnection> {
        check_options(opts, "StripedConnection::new")?;
        let per_qp = opts.depth + 1;
        let cq = pd.context().create_cq(opts.qps * per_qp, None)?;
        let qps = (0..opts.qps)
            .map(|_| pd.create_qp(&cq, QpType::RC).max_send_wr(opts.depth).max_recv_wr(1).build())
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::assemble(cq, qps, opts))
    }

    /// Makes a striped connection of queue pairs the caller created and connected, e.g. on
    /// RDMA-CM ids ([`QueuePairBuilder::build_on`](crate::QueuePairBuilder::build_on), then
    /// [`crate::cm`]), the one way to connect them on iWARP: `opts.qps` RC queue pairs of one
    /// protection domain whose send queues complete into `cq`, each with room for `opts.depth`
    /// requests. Which of the peer's queue pairs each is connected to does not matter: the
    /// pieces address the peer's memory by its remote key. RDMA-CM ids the queue pairs were built
    /// on hold their connections: keep them as long as this connection is used.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `opts` that [`new`](Self::new) refuses, a number of queue
    /// pairs other than `opts.qps`, or a queue pair that is not RC, completes its sends into
    /// another CQ than `cq`, has room for fewer than `opts.depth` send requests, belongs to
    /// another protection domain than the first, has requests outstanding or receives through
    /// a shared receive queue (their completions would be taken for pieces); and for an
    /// extended `cq` whose completions do not carry the QP number
    /// ([`WcFlags::QP_NUM`](crate::WcFlags::QP_NUM): a piece's completion is matched to its
    /// queue pair by it).
    pub fn from_queue_pairs(
        cq: CompletionQueue,
        qps: Vec<QueuePair>,
        opts: &StripeOptions,
    ) -> Result<StripedConnection> {
        const VERB: &str = "StripedConnection::from_queue_pairs";
        check_options(opts, VERB)?;
        let bad = |reason| Err(Error::InvalidArgument { verb: VERB, reason });
        if qps.len() != opts.qps as usize {
            return bad("the number of queue pairs is not opts.qps");
        }
        if !cq.reports_qp_num() {
            return bad("an extended CQ must report the QP number (WcFlags::QP_NUM)");
        }
        for qp in &qps {
            if qp.qp_type() != QpType::RC || !qp.sends_into(&cq) || !qp.same_pd(&qps[0]) {
                return bad(
                    "every queue pair is RC, of the first one's protection domain, sending into the CQ",
                );
            }
            if qp.send_capacity() < opts.depth {
                return bad("a queue pair has room for fewer send requests than opts.depth");
            }
            // The connection takes every tracked completion of its queue pairs on `cq` for a
            // piece: none may come from anything else (an SRQ's receives, earlier requests).
            if qp.uses_srq() || qp.outstanding_sends() != 0 || qp.outstanding_recvs() != 0 {
                return bad(
                    "a queue pair has requests outstanding or receives through a shared receive queue",
                );
            }
        }
        Ok(Self::assemble(cq, qps, opts))
    }

    /// The connection of checked parts.
    fn assemble(cq: CompletionQueue, qps: Vec<QueuePair>, opts: &StripeOptions) -> StripedConnection {
        let batch = (opts.qps as usize * 4).clamp(16, 256);
        StripedConnection {
            qps,
            cq,
            slots: plan::Slots::new(opts.depth),
            wcs: (0..batch).map(|_| Completion::default()).collect(),
            next: 0,
            opts: opts.clone(),
        }
    }

    /// The endpoints of the queue pairs, in order, for the peer's [`connect`](Self::connect)
    /// (see [`QueuePair::endpoint`]: `ibv_query_port`, `ibv_query_gid_ex`).
    ///
    /// # Errors
    /// As [`QueuePair::endpoint`].
    pub fn endpoints(&self, opts: &ConnectOptions) -> Result<EndpointList> {
        self.qps.iter().map(|qp| qp.endpoint(opts)).collect::<Result<_>>().map(EndpointList)
    }

    /// Connects queue pair *i* to the peer's endpoint *i* (`ibv_modify_qp` to INIT, RTR, RTS;
    /// see [`QueuePair::connect`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the peer has a different number of queue pairs; else as
    /// [`QueuePair::connect`] (queue pairs before the failing one stay connected).
    #[doc(alias = "ibv_modify_qp")]
    pub fn connect(&mut self, remote: &EndpointList, opts: &ConnectOptions) -> Result<()> {
        if remote.0.len() != self.qps.len() {
            return Err(Error::InvalidArgument {
                verb: "StripedConnection::connect",
                reason: "the peer's endpoint list has a different number of queue pairs",
            });
        }
        for (qp, ep) in self.qps.iter_mut().zip(&remote.0) {
            qp.connect(ep, opts)?;
        }
        Ok(())
    }

    /// The queue pairs, in order.
    pub fn queue_pairs(&self) -> &[QueuePair] {
        &self.qps
    }

    /// The options it was built with.
    pub fn options(&self) -> &StripeOptions {
        &self.opts
    }

    /// Requests posted whose completion has not been polled yet.
    pub fn outstanding(&self) -> usize {
        self.slots.outstanding()
    }

    /// The completion queue its queue pairs share (for `req_notify` / channels; polling it
    /// directly bypasses the per-request accounting: use [`poll`](Self::poll)). Completions of
    /// other queue pairs sending into it (the caller's, made on it) are consumed by `poll`, their
    /// buffers released, and never counted as pieces (each piece's `wr_id` names its queue pair,
    /// checked against the completion's `qp_num`).
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }
}
