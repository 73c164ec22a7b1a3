//! Queue pairs: creation, connection (RESET → INIT → RTR → RTS) and posting.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::cq::{CompletionQueue, CqInner};
use crate::device::{Context, Gid, LinkLayer, Mtu};
use crate::error::{cvt, cvt_p, Error, Result};
use crate::ffi;
use crate::mr::AccessFlags;
use crate::pd::{PdInner, ProtectionDomain};
use crate::ring::{RegisterError, Ring, Slot};
use crate::wr::{Local, LocalBuf, Op, RecvRequest, SendRequest, MAX_SGE};

/// The transport service of a queue pair (`enum ibv_qp_type`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct QpType(pub u32);

impl QpType {
    /// Reliable Connected: all operations, acknowledged, in order.
    pub const RC: QpType = QpType(ffi::ibv_qp_type::IBV_QPT_RC.0);
    /// Unreliable Connected: Send and RDMA Write, no acknowledgements.
    pub const UC: QpType = QpType(ffi::ibv_qp_type::IBV_QPT_UC.0);
    /// Unreliable Datagram: Sends of at most one MTU to any UD QP, through address handles.
    pub const UD: QpType = QpType(ffi::ibv_qp_type::IBV_QPT_UD.0);
}

impl fmt::Debug for QpType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            QpType::RC => f.write_str("RC"),
            QpType::UC => f.write_str("UC"),
            QpType::UD => f.write_str("UD"),
            QpType(n) => write!(f, "QpType({n})"),
        }
    }
}

/// The state of a queue pair (`enum ibv_qp_state`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct QpState(pub u32);

impl QpState {
    /// Reset: just created, or reset.
    pub const RESET: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_RESET.0);
    /// Initialized: receives may be posted.
    pub const INIT: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_INIT.0);
    /// Ready to receive.
    pub const RTR: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_RTR.0);
    /// Ready to send.
    pub const RTS: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_RTS.0);
    /// Send queue drained.
    pub const SQD: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_SQD.0);
    /// Send queue error.
    pub const SQE: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_SQE.0);
    /// Error: outstanding requests are flushed.
    pub const ERR: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_ERR.0);
}

impl fmt::Debug for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match *self {
            QpState::RESET => "RESET",
            QpState::INIT => "INIT",
            QpState::RTR => "RTR",
            QpState::RTS => "RTS",
            QpState::SQD => "SQD",
            QpState::SQE => "SQE",
            QpState::ERR => "ERR",
            QpState(n) => return write!(f, "QpState({n})"),
        };
        f.write_str(name)
    }
}

/// Work queue capacities of a queue pair (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send-queue work requests.
    pub max_send_wr: u32,
    /// Outstanding receive-queue work requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Bytes of inline data per send request.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 }
    }
}

/// Builds a [`QueuePair`] (`ibv_create_qp()`); from [`ProtectionDomain::create_qp`].
#[derive(Debug)]
pub struct QueuePairBuilder<'a> {
    pd: &'a ProtectionDomain,
    send_cq: &'a CompletionQueue,
    recv_cq: &'a CompletionQueue,
    qp_type: QpType,
    caps: QpCaps,
}

impl ProtectionDomain {
    /// Starts building a queue pair of type `qp_type` whose send and receive completions go to
    /// `cq` (change the receive side with [`QueuePairBuilder::recv_cq`]).
    #[doc(alias = "ibv_create_qp")]
    pub fn create_qp<'a>(&'a self, cq: &'a CompletionQueue, qp_type: QpType) -> QueuePairBuilder<'a> {
        QueuePairBuilder { pd: self, send_cq: cq, recv_cq: cq, qp_type, caps: QpCaps::default() }
    }
}

impl<'a> QueuePairBuilder<'a> {
    /// Receive completions go to `cq` instead.
    pub fn recv_cq(mut self, cq: &'a CompletionQueue) -> Self {
        self.recv_cq = cq;
        self
    }
    /// Send queue depth (default 64).
    pub fn max_send_wr(mut self, n: u32) -> Self {
        self.caps.max_send_wr = n;
        self
    }
    /// Receive queue depth (default 64).
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.caps.max_recv_wr = n;
        self
    }
    /// Scatter/gather entries per send request (default 1; the safe level uses at most
    /// [`MAX_SGE`]).
    pub fn max_send_sge(mut self, n: u32) -> Self {
        self.caps.max_send_sge = n;
        self
    }
    /// Scatter/gather entries per receive request (default 1).
    pub fn max_recv_sge(mut self, n: u32) -> Self {
        self.caps.max_recv_sge = n;
        self
    }
    /// Inline data bytes per send request (default 0).
    pub fn max_inline_data(mut self, n: u32) -> Self {
        self.caps.max_inline_data = n;
        self
    }
    /// All capacities at once.
    pub fn caps(mut self, caps: QpCaps) -> Self {
        self.caps = caps;
        self
    }

    /// Creates the queue pair (`ibv_create_qp()`), in state RESET.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero send or receive depth; [`Error::CqTooSmall`] when a
    /// CQ cannot hold every completion of its queue pairs (the send and receive depths add up on
    /// a shared CQ); [`Error::Verb`] from `ibv_create_qp()` (e.g. `EINVAL` for capacities above
    /// the device's limits).
    #[doc(alias = "ibv_create_qp")]
    pub fn build(self) -> Result<QueuePair> {
        let caps = self.caps;
        if caps.max_send_wr == 0 || caps.max_recv_wr == 0 {
            return Err(Error::InvalidArgument {
                verb: "ibv_create_qp",
                reason: "send and receive queue depths must be at least 1",
            });
        }
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: self.send_cq.as_raw(),
            recv_cq: self.recv_cq.as_raw(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ffi::ibv_qp_type(self.qp_type.0),
            sq_sig_all: 0,
            ..Default::default()
        };
        let send_cq = self.send_cq.inner.clone();
        let recv_cq = self.recv_cq.inner.clone();
        let reg = |cq: &CqInner, cap, recv| register_ring(cq, cap, recv, "ibv_create_qp");
        let send = reg(&send_cq, caps.max_send_wr, false)?;
        let recv = match reg(&recv_cq, caps.max_recv_wr, true) {
            Ok(r) => r,
            Err(e) => {
                send_cq.registry.retire(&send);
                return Err(e);
            }
        };
        // SAFETY: valid PD and CQs (kept alive by the QP's Arcs); `init` is a valid attribute struct.
        let raw = unsafe { ffi::ibv_create_qp(self.pd.as_raw(), &mut init) };
        let raw = match cvt_p("ibv_create_qp", raw) {
            Ok(r) => r,
            Err(e) => {
                send_cq.registry.retire(&send);
                recv_cq.registry.retire(&recv);
                return Err(e);
            }
        };
        // SAFETY: the QP is valid; its context's ops table belongs to the provider.
        let (post_send_fn, post_recv_fn) = unsafe {
            let ops = &(*(*raw.as_ptr()).context).ops;
            (ops.post_send, ops.post_recv)
        };
        let actual = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        let chain_len = caps.max_send_wr as usize;
        let recv_chain_len = caps.max_recv_wr as usize;
        Ok(QueuePair {
            raw,
            post_send_fn,
            post_recv_fn,
            send,
            recv,
            caps: actual,
            qp_type: self.qp_type,
            state: QpState::RESET,
            psn: random_psn(),
            chain: vec![ffi::ibv_send_wr::default(); chain_len].into_boxed_slice(),
            chain_sges: vec![[ffi::ibv_sge::default(); MAX_SGE]; chain_len].into_boxed_slice(),
            recv_chain: vec![ffi::ibv_recv_wr::default(); recv_chain_len].into_boxed_slice(),
            recv_chain_sges: vec![[ffi::ibv_sge::default(); MAX_SGE]; recv_chain_len].into_boxed_slice(),
            send_cq,
            recv_cq,
            pd: self.pd.inner.clone(),
        })
    }
}

type PostSendFn =
    unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_send_wr, *mut *mut ffi::ibv_send_wr) -> i32;
type PostRecvFn =
    unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32;

/// A queue pair (`struct ibv_qp`).
///
/// Created in state RESET by [`ProtectionDomain::create_qp`]; [`connect`](Self::connect) (RC, UC)
/// or [`activate_ud`](Self::activate_ud) (UD) brings it to RTS. Posting takes `&mut self` at the
/// safe level: the QP keeps each posted buffer until its completion is polled from the CQ, which
/// hands it back. Dropping the QP destroys it (`ibv_destroy_qp()`); buffers still outstanding are
/// released at the CQ's next [`poll`](CompletionQueue::poll) (or when the CQ goes).
pub struct QueuePair {
    raw: NonNull<ffi::ibv_qp>,
    post_send_fn: Option<PostSendFn>,
    post_recv_fn: Option<PostRecvFn>,
    send: Arc<Ring>,
    recv: Arc<Ring>,
    caps: QpCaps,
    qp_type: QpType,
    state: QpState,
    psn: u32,
    chain: Box<[ffi::ibv_send_wr]>,
    chain_sges: Box<[[ffi::ibv_sge; MAX_SGE]]>,
    recv_chain: Box<[ffi::ibv_recv_wr]>,
    recv_chain_sges: Box<[[ffi::ibv_sge; MAX_SGE]]>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    pd: Arc<PdInner>,
}

// SAFETY: libibverbs QPs may be used from any thread (providers lock their queues). The rings are
// single-producer: every producer method takes &mut self. The scratch arrays are touched only under
// &mut self and hold no pointers between calls that matter (they are rewritten on each use).
unsafe impl Send for QueuePair {}
// SAFETY: &self methods only query the QP or post through the `unsafe` level, which providers
// make thread-safe.
unsafe impl Sync for QueuePair {}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num())
            .field("type", &self.qp_type)
            .field("state", &self.state)
            .field("caps", &self.caps)
            .finish()
    }
}

/// A failed post: the error, and the request (with its buffers) handed back.
pub struct PostError<R> {
    /// What went wrong.
    pub error: Error,
    /// The request that was not posted.
    pub request: R,
}

impl<R> fmt::Debug for PostError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostError").field("error", &self.error).finish_non_exhaustive()
    }
}

impl<R> fmt::Display for PostError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl<R> std::error::Error for PostError<R> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<R> From<PostError<R>> for Error {
    fn from(e: PostError<R>) -> Error {
        e.error
    }
}

fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: writes at most 4 bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    if n != 4 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        b = (t ^ std::process::id()).to_ne_bytes();
    }
    u32::from_ne_bytes(b) & 0x00ff_ffff
}

/// How to connect a queue pair: port, addressing and transport parameters.
///
/// Defaults: port 1, the RoCE v2 IPv4 GID on Ethernet ports (none on InfiniBand), path MTU the
/// smaller of both ports' active MTUs, `timeout` 14 (≈ 67 ms), `retry_cnt` 7, `rnr_retry` 7
/// (infinite), `min_rnr_timer` 12, RDMA Read/atomic depth from the device (at most 16), all remote
/// access rights on the QP (the memory regions' own rights still apply), Q_Key `0x11111111` for UD.
///
/// **SoftRoCE caveat:** rxe on Linux 6.1 treats `retry_cnt = 7` as "retry forever", so a caller
/// whose peer dies never gets an error there; use 6 or less when that matters (on hardware, 7
/// means seven retries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Local port number (from 1).
    pub port: u8,
    /// Local GID index for GRH addressing; `None` picks the RoCE v2 IPv4 GID on Ethernet
    /// ports (like NCCL's `NCCL_IB_GID_INDEX`), and LID addressing on InfiniBand ports.
    pub gid_index: Option<u32>,
    /// Upper bound on the path MTU.
    pub mtu: Option<Mtu>,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (`NCCL_IB_TIMEOUT`), 0..=31.
    pub timeout: u8,
    /// Transport retries before `RETRY_EXC_ERR` (`NCCL_IB_RETRY_CNT`), 0..=7.
    pub retry_cnt: u8,
    /// Receiver-not-ready retries, 0..=7 (7 = infinite).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer (encoded as in `ibv_modify_qp(3)`), 0..=31.
    pub min_rnr_timer: u8,
    /// Outstanding RDMA Reads/atomics, initiator and responder; `None`: the device's limits,
    /// at most 16.
    pub max_rd_atomic: Option<u8>,
    /// Service level.
    pub sl: u8,
    /// GRH traffic class.
    pub traffic_class: u8,
    /// GRH hop limit.
    pub hop_limit: u8,
    /// P_Key index.
    pub pkey_index: u16,
    /// Remote access rights of the QP (RC, UC).
    pub access: AccessFlags,
    /// Q_Key (UD).
    pub qkey: u32,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            port: 1,
            gid_index: None,
            mtu: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: None,
            sl: 0,
            traffic_class: 0,
            hop_limit: 64,
            pkey_index: 0,
            access: AccessFlags::LOCAL_WRITE
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
            qkey: 0x1111_1111,
        }
    }
}

/// What a peer needs to connect to a queue pair: QP number, initial PSN, LID, GID and active MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID (zero when LID-addressed).
    pub gid: Gid,
    /// The port's active MTU.
    pub mtu: Mtu,
}

impl Endpoint {
    /// Size of [`encode`](Self::encode)'s output.
    pub const ENCODED_LEN: usize = 30;
    const MAGIC: u8 = b'V';
    const VERSION: u8 = 1;

    /// A stable byte encoding for out-of-band exchange: magic `'V'`, version 1, MTU enum, 0,
    /// LID (2 bytes), QPN (4), PSN (4), GID (16); integers big-endian.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0; Self::ENCODED_LEN];
        b[0] = Self::MAGIC;
        b[1] = Self::VERSION;
        b[2] = u8::try_from(self.mtu.0).unwrap_or(0);
        b[4..6].copy_from_slice(&self.lid.to_be_bytes());
        b[6..10].copy_from_slice(&self.qpn.to_be_bytes());
        b[10..14].copy_from_slice(&self.psn.to_be_bytes());
        b[14..30].copy_from_slice(&self.gid.0);
        b
    }

    /// Decodes [`encode`](Self::encode)'s output, checking every field.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong length, magic or version, a QPN or PSN wider than
    /// 24 bits, or an invalid MTU.
    pub fn decode(bytes: &[u8]) -> Result<Endpoint> {
        let bad = |reason| Error::InvalidArgument { verb: "Endpoint::decode", reason };
        let b: &[u8; Self::ENCODED_LEN] =
            bytes.try_into().map_err(|_| bad("an endpoint encodes to 30 bytes"))?;
        if b[0] != Self::MAGIC || b[1] != Self::VERSION {
            return Err(bad("not an endpoint (bad magic or version)"));
        }
        let mtu = Mtu(u32::from(b[2]));
        if mtu.bytes().is_none() {
            return Err(bad("invalid MTU"));
        }
        let be32 = |r: &[u8]| u32::from_be_bytes([r[0], r[1], r[2], r[3]]);
        let ep = Endpoint {
            lid: u16::from_be_bytes([b[4], b[5]]),
            qpn: be32(&b[6..10]),
            psn: be32(&b[10..14]),
            gid: Gid(b[14..30].try_into().unwrap_or_default()),
            mtu,
        };
        if ep.qpn > 0x00ff_ffff || ep.psn > 0x00ff_ffff {
            return Err(bad("QPN and PSN are 24-bit values"));
        }
        Ok(ep)
    }
}

/// Picks the local GID index for `opts` on a port: explicit, or the RoCE v2 IPv4 one on Ethernet.
fn gid_index(ctx: &Context, opts: &ConnectOptions, link_layer: LinkLayer) -> Result<Option<u32>> {
    match opts.gid_index {
        Some(i) => Ok(Some(i)),
        None if link_layer == LinkLayer::ETHERNET => ctx.roce_v2_ipv4_gid_index(opts.port).map(Some),
        None => Ok(None),
    }
}

/// The address vector towards `remote` (for RTR and address handles).
pub(crate) fn ah_attr(ctx: &Context, remote: &Endpoint, opts: &ConnectOptions) -> Result<ffi::ibv_ah_attr> {
    let port = ctx.query_port(opts.port)?;
    let mut ah =
        ffi::ibv_ah_attr { dlid: remote.lid, sl: opts.sl, port_num: opts.port, ..Default::default() };
    let index = gid_index(ctx, opts, port.link_layer())?;
    let use_grh = port.link_layer() == LinkLayer::ETHERNET || (index.is_some() && !remote.gid.is_zero());
    if let (true, Some(index)) = (use_grh, index) {
        let sgid_index = u8::try_from(index)
            .map_err(|_| Error::InvalidArgument { verb: "ibv_modify_qp", reason: "GID index above 255" })?;
        // Checks that the entry exists (a typed error for a bad index, not an opaque EINVAL later).
        ctx.query_gid(opts.port, index)?;
        ah.is_global = 1;
        ah.grh = ffi::ibv_global_route {
            dgid: remote.gid.to_raw(),
            flow_label: 0,
            sgid_index,
            hop_limit: opts.hop_limit,
            traffic_class: opts.traffic_class,
        };
    }
    Ok(ah)
}

impl QueuePair {
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: valid QP; qp_num is a plain field written at creation.
        unsafe { (*self.raw.as_ptr()).qp_num }
    }

    /// The QP's initial send PSN (random, 24 bits), as advertised in its [`Endpoint`].
    pub fn psn(&self) -> u32 {
        self.psn
    }

    /// Sets the initial send PSN used by the next [`connect`](Self::connect).
    pub fn set_psn(&mut self, psn: u32) {
        self.psn = psn & 0x00ff_ffff;
    }

    /// The transport type.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// The capacities the device granted (at least those asked for).
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// The state as last set through this handle (the device may since have moved it to ERR).
    pub fn state(&self) -> QpState {
        self.state
    }

    /// Queries the device for the current state (`ibv_query_qp()`).
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails.
    #[doc(alias = "ibv_query_qp")]
    pub fn query_state(&self) -> Result<QpState> {
        let mut attr = ffi::ibv_qp_attr::default();
        let mut init = ffi::ibv_qp_init_attr::default();
        // SAFETY: valid QP and out-pointers.
        let ret = unsafe {
            ffi::ibv_query_qp(
                self.raw.as_ptr(),
                &mut attr,
                ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        };
        cvt("ibv_query_qp", ret)?;
        Ok(QpState(attr.qp_state.0))
    }

    /// Send requests posted through the safe level and not yet completed.
    pub fn outstanding_sends(&self) -> u32 {
        self.send.outstanding()
    }

    /// Receive requests posted through the safe level and not yet completed.
    pub fn outstanding_recvs(&self) -> u32 {
        self.recv.outstanding()
    }

    /// The raw `struct ibv_qp *`; valid while this QP lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.raw.as_ptr()
    }

    fn context(&self) -> Context {
        Context { inner: self.pd.ctx.clone() }
    }

    fn modify(&mut self, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask) -> Result<()> {
        // SAFETY: valid QP and attribute struct.
        let ret = unsafe { ffi::ibv_modify_qp(self.raw.as_ptr(), attr, mask.0 as i32) };
        cvt("ibv_modify_qp", ret)?;
        self.state = QpState(attr.qp_state.0);
        Ok(())
    }

    /// This QP's connection details for a peer, on `opts.port` with `opts`' GID choice.
    ///
    /// # Errors
    /// [`Error::Verb`] for a bad port or GID index (from `ibv_query_port()`/`ibv_query_gid_ex()`).
    pub fn endpoint(&self, opts: &ConnectOptions) -> Result<Endpoint> {
        let ctx = self.context();
        let port = ctx.query_port(opts.port)?;
        let gid = match gid_index(&ctx, opts, port.link_layer())? {
            Some(i) => ctx.query_gid(opts.port, i)?.gid,
            None => Gid::default(),
        };
        Ok(Endpoint { qpn: self.qp_num(), psn: self.psn, lid: port.lid(), gid, mtu: port.active_mtu() })
    }

    /// RESET → INIT (`ibv_modify_qp()`): binds the QP to `opts.port`; receives may be posted
    /// from now on.
    ///
    /// # Errors
    /// [`Error::QpState`] unless the QP is in RESET; [`Error::Verb`] for a bad port or P_Key
    /// index.
    #[doc(alias = "ibv_modify_qp")]
    pub fn init(&mut self, opts: &ConnectOptions) -> Result<()> {
        if self.state != QpState::RESET {
            return Err(Error::QpState { verb: "ibv_modify_qp", state: self.state, expected: "RESET" });
        }
        self.context().query_port(opts.port)?;
        use ffi::ibv_qp_attr_mask as M;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: opts.pkey_index,
            port_num: opts.port,
            ..Default::default()
        };
        let mask = if self.qp_type == QpType::UD {
            attr.qkey = opts.qkey;
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_QKEY
        } else {
            let mut access = opts.access;
            if self.qp_type == QpType::UC {
                access &= AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
            }
            attr.qp_access_flags = access.bits();
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS
        };
        self.modify(&mut attr, mask)
    }

    /// Connects an RC or UC QP to `remote`: RESET → INIT (if needed) → RTR → RTS
    /// (`ibv_modify_qp()`), with path MTU the smaller of both ports' active MTUs (and
    /// `opts.mtu`), addressing by GID on RoCE and by LID on InfiniBand.
    ///
    /// # Errors
    /// [`Error::QpState`] unless the QP is in RESET or INIT; [`Error::InvalidArgument`] for a UD
    /// QP or out-of-range options; [`Error::Verb`] for a bad port or GID index, or when the device
    /// rejects a transition.
    #[doc(alias = "ibv_modify_qp")]
    pub fn connect(&mut self, remote: &Endpoint, opts: &ConnectOptions) -> Result<()> {
        let bad = |reason| Err(Error::InvalidArgument { verb: "ibv_modify_qp", reason });
        if self.qp_type == QpType::UD {
            return bad("UD queue pairs are not connected: use activate_ud and address handles");
        }
        if remote.qpn > 0x00ff_ffff || remote.psn > 0x00ff_ffff {
            return bad("QPN and PSN are 24-bit values");
        }
        if opts.timeout > 31 || opts.retry_cnt > 7 || opts.rnr_retry > 7 || opts.min_rnr_timer > 31 {
            return bad("timeout and min_rnr_timer are 0..=31, retry_cnt and rnr_retry 0..=7");
        }
        if self.state == QpState::RESET {
            self.init(opts)?;
        }
        if self.state != QpState::INIT {
            return Err(Error::QpState {
                verb: "ibv_modify_qp",
                state: self.state,
                expected: "RESET or INIT",
            });
        }
        let ctx = self.context();
        let port = ctx.query_port(opts.port)?;
        let mut mtu = port.active_mtu();
        if remote.mtu.bytes().is_some() {
            mtu = mtu.min(remote.mtu);
        }
        if let Some(m) = opts.mtu {
            mtu = mtu.min(m);
        }
        let rd_atomic = match opts.max_rd_atomic {
            Some(n) => n,
            None => {
                let dev = ctx.query_device()?;
                let n = dev.max_qp_rd_atom().min(dev.max_qp_init_rd_atom()).clamp(1, 16);
                u8::try_from(n).unwrap_or(16)
            }
        };
        use ffi::ibv_qp_attr_mask as M;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: ffi::ibv_mtu(mtu.0),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            ah_attr: ah_attr(&ctx, remote, opts)?,
            max_dest_rd_atomic: rd_atomic,
            min_rnr_timer: opts.min_rnr_timer,
            ..Default::default()
        };
        let mut mask =
            M::IBV_QP_STATE | M::IBV_QP_AV | M::IBV_QP_PATH_MTU | M::IBV_QP_DEST_QPN | M::IBV_QP_RQ_PSN;
        if self.qp_type == QpType::RC {
            mask = mask | M::IBV_QP_MAX_DEST_RD_ATOMIC | M::IBV_QP_MIN_RNR_TIMER;
        }
        self.modify(&mut attr, mask)?;

        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: self.psn,
            timeout: opts.timeout,
            retry_cnt: opts.retry_cnt,
            rnr_retry: opts.rnr_retry,
            max_rd_atomic: rd_atomic,
            ..Default::default()
        };
        let mut mask = M::IBV_QP_STATE | M::IBV_QP_SQ_PSN;
        if self.qp_type == QpType::RC {
            mask = mask
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC;
        }
        self.modify(&mut attr, mask)
    }

    /// Brings a UD QP to RTS: RESET → INIT (if needed) → RTR → RTS (`ibv_modify_qp()`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a non-UD QP, [`Error::QpState`] unless in RESET or INIT,
    /// [`Error::Verb`] when the device rejects a transition.
    #[doc(alias = "ibv_modify_qp")]
    pub fn activate_ud(&mut self, opts: &ConnectOptions) -> Result<()> {
        if self.qp_type != QpType::UD {
            return Err(Error::InvalidArgument {
                verb: "ibv_modify_qp",
                reason: "activate_ud is for UD queue pairs",
            });
        }
        if self.state == QpState::RESET {
            self.init(opts)?;
        }
        if self.state != QpState::INIT {
            return Err(Error::QpState {
                verb: "ibv_modify_qp",
                state: self.state,
                expected: "RESET or INIT",
            });
        }
        use ffi::ibv_qp_attr_mask as M;
        let mut attr = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_RTR, ..Default::default() };
        self.modify(&mut attr, M::IBV_QP_STATE)?;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: self.psn,
            ..Default::default()
        };
        self.modify(&mut attr, M::IBV_QP_STATE | M::IBV_QP_SQ_PSN)
    }

    /// Moves the QP to the error state (`ibv_modify_qp()`): outstanding requests complete with
    /// [`WcStatus::WR_FLUSH_ERR`](crate::WcStatus::WR_FLUSH_ERR), returning their buffers.
    ///
    /// # Errors
    /// [`Error::Verb`] when the device rejects the transition.
    #[doc(alias = "ibv_modify_qp")]
    pub fn set_error(&mut self) -> Result<()> {
        let mut attr = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_ERR, ..Default::default() };
        self.modify(&mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE)
    }

    /// Resets the QP (`ibv_modify_qp()` to RESET) for reuse: requests still outstanding are
    /// dropped by the device without completions, so their buffers are released at the CQ's next
    /// poll, and the QP starts over with empty queues and a new PSN.
    ///
    /// # Errors
    /// [`Error::Verb`] when the device rejects the transition; [`Error::CqTooSmall`] or
    /// [`Error::TooManyQueuePairs`] if the fresh queues cannot be registered (the QP is then left
    /// in RESET, unable to post).
    #[doc(alias = "ibv_modify_qp")]
    pub fn reset(&mut self) -> Result<()> {
        let mut attr = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_RESET, ..Default::default() };
        self.modify(&mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE)?;
        // The device has forgotten every request: retire the rings (their buffers go at the next
        // poll) and start with empty ones.
        self.send_cq.registry.retire(&self.send);
        self.recv_cq.registry.retire(&self.recv);
        let reg = |cq: &CqInner, cap, recv| register_ring(cq, cap, recv, "ibv_modify_qp");
        let send = reg(&self.send_cq, self.send.capacity(), false);
        let recv = reg(&self.recv_cq, self.recv.capacity(), true);
        match (send, recv) {
            (Ok(s), Ok(r)) => {
                self.send = s;
                self.recv = r;
                self.psn = random_psn();
                Ok(())
            }
            (s, r) => {
                let mut err = None;
                for (res, cq) in [(s, &self.send_cq), (r, &self.recv_cq)] {
                    match res {
                        Ok(ring) => cq.registry.retire(&ring),
                        Err(e) => err = Some(e),
                    }
                }
                self.state = QpState(u32::MAX); // unusable: every post checks the state
                Err(err.unwrap_or(Error::TooManyQueuePairs { verb: "ibv_modify_qp" }))
            }
        }
    }

    fn check_send(&self, wr: &SendRequest<'_>) -> Result<()> {
        if self.state != QpState::RTS && self.state != QpState::ERR {
            return Err(Error::QpState { verb: "ibv_post_send", state: self.state, expected: "RTS" });
        }
        let count = wr.validate(&self.pd)?;
        let bad = |reason| Err(Error::InvalidArgument { verb: "ibv_post_send", reason });
        if wr.ud.as_ref().is_some_and(|(ah, _, _)| !Arc::ptr_eq(&ah.inner.pd, &self.pd)) {
            return bad("the address handle belongs to another protection domain");
        }
        if let Some(d) = wr.inline {
            if d.len() > self.caps.max_inline_data as usize {
                return bad("inline data larger than the QP's max_inline_data");
            }
        } else if count > self.caps.max_send_sge as usize {
            return bad("more scatter/gather entries than the QP's max_send_sge");
        }
        match (self.qp_type, &wr.ud, wr.op) {
            (QpType::UD, None, _) => bad("a send on a UD queue pair needs a destination: SendRequest::ud"),
            (QpType::UD, Some(_), Op::Send) => Ok(()),
            (QpType::UD, Some(_), _) => bad("UD queue pairs only send"),
            (_, Some(_), _) => bad("only UD queue pairs take an address handle"),
            (QpType::UC, None, Op::Read(_) | Op::CompareSwap { .. } | Op::FetchAdd { .. }) => {
                bad("UC queue pairs do not do RDMA Read or atomics")
            }
            _ => Ok(()),
        }
    }

    fn check_recv(&self, wr: &RecvRequest) -> Result<()> {
        if self.state == QpState::RESET || self.state == QpState(u32::MAX) {
            return Err(Error::QpState {
                verb: "ibv_post_recv",
                state: self.state,
                expected: "INIT, RTR or RTS",
            });
        }
        if wr.validate(&self.pd)? > self.caps.max_recv_sge as usize {
            return Err(Error::InvalidArgument {
                verb: "ibv_post_recv",
                reason: "more scatter/gather entries than the QP's max_recv_sge",
            });
        }
        Ok(())
    }

    /// Posts one send-queue work request (`ibv_post_send()`), safely: the QP keeps the request's
    /// buffers (and address handle) until the completion is polled from the send CQ, whose
    /// [`Completion`](crate::Completion) hands them back.
    ///
    /// # Errors
    /// A [`PostError`] handing the request back, with [`Error::QpState`] before RTS,
    /// [`Error::QueueFull`] when `max_send_wr` requests are outstanding, [`Error::InvalidArgument`]
    /// or [`Error::OutOfBounds`] for a request the QP cannot take, or [`Error::Verb`] when the
    /// provider refuses it.
    #[doc(alias = "ibv_post_send")]
    // The request comes back by value on error: boxing it would allocate on the post path.
    #[allow(clippy::result_large_err)]
    pub fn post_send<'a>(&mut self, wr: SendRequest<'a>) -> Result<(), PostError<SendRequest<'a>>> {
        if let Err(error) = self.check_send(&wr) {
            return Err(PostError { error, request: wr });
        }
        let mut wr = wr;
        match post_one(self.raw.as_ptr(), &self.send, self.post_send_fn, &mut wr) {
            Ok(()) => Ok(()),
            Err(error) => Err(PostError { error, request: wr }),
        }
    }

    /// Posts a chain of send requests with one `ibv_post_send()` call (one doorbell), safely.
    /// On success `wrs` is empty; on error it holds the requests that were not posted (the first
    /// is the one the provider refused), with their buffers.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send); checks that apply to every request run before anything
    /// is posted, and [`Error::QueueFull`] is reported before posting when the chain does not fit.
    #[doc(alias = "ibv_post_send")]
    pub fn post_send_chain(&mut self, wrs: &mut Vec<SendRequest<'_>>) -> Result<()> {
        for wr in wrs.iter() {
            self.check_send(wr)?;
        }
        let qp = self.raw.as_ptr();
        post_chain(qp, &self.send, self.post_send_fn, &mut self.chain, &mut self.chain_sges, wrs)
    }

    /// Posts one receive request (`ibv_post_recv()`), safely: the QP keeps its buffers until the
    /// completion hands them back.
    ///
    /// # Errors
    /// A [`PostError`] handing the request back: [`Error::QpState`] in RESET,
    /// [`Error::QueueFull`] when `max_recv_wr` receives are outstanding,
    /// [`Error::InvalidArgument`] for a buffer the device may not write, [`Error::Verb`] when the
    /// provider refuses it.
    #[doc(alias = "ibv_post_recv")]
    #[allow(clippy::result_large_err)] // as post_send: no allocation on the post path
    pub fn post_recv(&mut self, wr: RecvRequest) -> Result<(), PostError<RecvRequest>> {
        if let Err(error) = self.check_recv(&wr) {
            return Err(PostError { error, request: wr });
        }
        let mut wr = wr;
        match post_one(self.raw.as_ptr(), &self.recv, self.post_recv_fn, &mut wr) {
            Ok(()) => Ok(()),
            Err(error) => Err(PostError { error, request: wr }),
        }
    }

    /// Posts a chain of receive requests with one `ibv_post_recv()` call, safely. On success
    /// `wrs` is empty; on error it holds the requests not posted.
    ///
    /// # Errors
    /// As [`post_recv`](Self::post_recv).
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv_chain(&mut self, wrs: &mut Vec<RecvRequest>) -> Result<()> {
        for wr in wrs.iter() {
            self.check_recv(wr)?;
        }
        let qp = self.raw.as_ptr();
        post_chain(qp, &self.recv, self.post_recv_fn, &mut self.recv_chain, &mut self.recv_chain_sges, wrs)
    }

    /// Posts a raw chain of send requests (`ibv_post_send()`) at exactly C's cost: no checks, no
    /// buffer tracking. Poll their completions with
    /// [`CompletionQueue::poll_raw`](crate::CompletionQueue::poll_raw) (or `poll`, which passes
    /// untracked completions through).
    ///
    /// # Errors
    /// [`Error::Verb`] with the provider's error; `bad_wr` then points at the first request not
    /// posted.
    ///
    /// # Safety
    /// - `wr` heads a valid, `NULL`-terminated chain of `ibv_send_wr`s whose SGEs name memory
    ///   registered (with the `lkey` given) in this QP's protection domain;
    /// - that memory stays registered and allocated until the request's completion is polled (for
    ///   unsignaled requests: until a later signaled request of this QP completes), or until this
    ///   QP is dropped;
    /// - memory the device writes (receive/Read/atomic targets) is not read or written through
    ///   Rust references meanwhile; memory it reads is not written meanwhile;
    /// - address handles of UD requests stay alive as long;
    /// - every `wr_id` has bit 63 clear (bit 63 marks the safe level's requests).
    ///
    /// Inline data is copied during the call and may be reused as soon as it returns.
    #[doc(alias = "ibv_post_send")]
    pub unsafe fn post_send_unchecked(
        &self,
        wr: *mut ffi::ibv_send_wr,
        bad_wr: &mut *mut ffi::ibv_send_wr,
    ) -> Result<()> {
        let f = self
            .post_send_fn
            .ok_or(Error::InvalidArgument { verb: "ibv_post_send", reason: "no post_send" })?;
        // SAFETY: the caller's contract.
        cvt("ibv_post_send", unsafe { f(self.raw.as_ptr(), wr, bad_wr) })
    }

    /// Posts a raw chain of receive requests (`ibv_post_recv()`) at exactly C's cost.
    ///
    /// # Errors
    /// [`Error::Verb`] with the provider's error.
    ///
    /// # Safety
    /// As [`post_send_unchecked`](Self::post_send_unchecked): the memory stays registered,
    /// allocated and untouched by Rust references until the completion is polled or the QP is
    /// dropped, and `wr_id`s have bit 63 clear.
    #[doc(alias = "ibv_post_recv")]
    pub unsafe fn post_recv_unchecked(
        &self,
        wr: *mut ffi::ibv_recv_wr,
        bad_wr: &mut *mut ffi::ibv_recv_wr,
    ) -> Result<()> {
        let f = self
            .post_recv_fn
            .ok_or(Error::InvalidArgument { verb: "ibv_post_recv", reason: "no post_recv" })?;
        // SAFETY: the caller's contract.
        cvt("ibv_post_recv", unsafe { f(self.raw.as_ptr(), wr, bad_wr) })
    }
}

/// Registers a fresh ring of `cap` slots in `cq`'s registry.
fn register_ring(cq: &CqInner, cap: u32, recv: bool, verb: &'static str) -> Result<Arc<Ring>> {
    cq.registry.register(cap, recv).map_err(|e| match e {
        RegisterError::CqTooSmall { needed, capacity } => Error::CqTooSmall { verb, needed, capacity },
        RegisterError::Full => Error::TooManyQueuePairs { verb },
    })
}

/// A provider's `post_send` or `post_recv` entry point.
type RawPost<W> = unsafe extern "C" fn(*mut ffi::ibv_qp, *mut W, *mut *mut W) -> i32;

/// What the generic posting code needs of a safe request type.
trait Request {
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
    /// Where a withdrawn slot's buffers go back.
    fn sges_mut(&mut self) -> &mut [Option<Local>; MAX_SGE];
}

impl Request for SendRequest<'_> {
    type Raw = ffi::ibv_send_wr;
    const VERB: &'static str = "ibv_post_send";
    fn fill_raw(&self, raw: &mut Self::Raw, sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64) {
        self.fill(raw, sges, device_wr_id);
    }
    fn link(raw: &mut Self::Raw, next: *mut Self::Raw) {
        raw.next = next;
    }
    fn take_slot(&mut self) -> Slot {
        let ah = self.ud.as_ref().map(|(ah, _, _)| ah.inner.clone());
        Slot { wr_id: self.wr_id, bufs: take_bufs(&mut self.sges), _ah: ah }
    }
    fn sges_mut(&mut self) -> &mut [Option<Local>; MAX_SGE] {
        &mut self.sges
    }
}

impl Request for RecvRequest {
    type Raw = ffi::ibv_recv_wr;
    const VERB: &'static str = "ibv_post_recv";
    fn fill_raw(&self, raw: &mut Self::Raw, sges: &mut [ffi::ibv_sge; MAX_SGE], device_wr_id: u64) {
        self.fill(raw, sges, device_wr_id);
    }
    fn link(raw: &mut Self::Raw, next: *mut Self::Raw) {
        raw.next = next;
    }
    fn take_slot(&mut self) -> Slot {
        Slot { wr_id: self.wr_id, bufs: take_bufs(&mut self.sges), _ah: None }
    }
    fn sges_mut(&mut self) -> &mut [Option<Local>; MAX_SGE] {
        &mut self.sges
    }
}

/// Posts one checked request on `ring`'s work queue of `qp`; on error the request keeps its
/// buffers (taken by reference: the request is not moved again on the post path).
fn post_one<R: Request>(
    qp: *mut ffi::ibv_qp,
    ring: &Ring,
    post: Option<RawPost<R::Raw>>,
    wr: &mut R,
) -> Result<()> {
    let (head, free) = ring.producer_state();
    if free == 0 {
        return Err(Error::QueueFull { verb: R::VERB, capacity: ring.capacity() });
    }
    let mut raw = R::Raw::default();
    let mut sges = [ffi::ibv_sge::default(); MAX_SGE];
    wr.fill_raw(&mut raw, &mut sges, ring.device_wr_id(head));
    // Publish the slot before posting: the completion may be polled before the post returns.
    // SAFETY: we are the producer (the caller holds &mut QueuePair) and `head` is free.
    unsafe { ring.write(head, wr.take_slot()) };
    ring.set_head(head.wrapping_add(1));
    let mut bad = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: valid QP; `raw` and `sges` describe registered memory of the QP's PD held by the
        // slot until its completion (or inline data borrowed by `wr`, copied during this call).
        Some(f) => unsafe { f(qp, &mut raw, &mut bad) },
        None => libc::ENOSYS,
    };
    if ret != 0 {
        ring.set_head(head);
        // SAFETY: the producer withdrew `head`; the device never saw it.
        let slot = unsafe { ring.take_back(head) };
        restore(wr.sges_mut(), slot, &sges);
        return Err(Error::from_ret(R::VERB, ret));
    }
    Ok(())
}

/// Posts checked requests as one chain, built in the QP's `scratch`; see `post_send_chain`.
fn post_chain<R: Request>(
    qp: *mut ffi::ibv_qp,
    ring: &Ring,
    post: Option<RawPost<R::Raw>>,
    scratch: &mut [R::Raw],
    scratch_sges: &mut [[ffi::ibv_sge; MAX_SGE]],
    wrs: &mut Vec<R>,
) -> Result<()> {
    let n = wrs.len();
    if n == 0 {
        return Ok(());
    }
    let (head, free) = ring.producer_state();
    if n > free as usize || n > scratch.len() {
        return Err(Error::QueueFull { verb: R::VERB, capacity: ring.capacity() });
    }
    let base = scratch.as_mut_ptr();
    for (i, wr) in wrs.iter_mut().enumerate() {
        let pos = head.wrapping_add(i as u32);
        wr.fill_raw(&mut scratch[i], &mut scratch_sges[i], ring.device_wr_id(pos));
        if i + 1 < n {
            // SAFETY: i + 1 < n <= scratch.len().
            R::link(&mut scratch[i], unsafe { base.add(i + 1) });
        }
        // SAFETY: producer; positions head..head + n are free (n <= free).
        unsafe { ring.write(pos, wr.take_slot()) };
    }
    ring.set_head(head.wrapping_add(n as u32));
    let mut bad: *mut R::Raw = std::ptr::null_mut();
    let ret = match post {
        // SAFETY: a valid NULL-terminated chain of n requests in QP-owned scratch, describing
        // memory held by the slots (or inline data borrowed by the requests in `wrs`).
        Some(f) => unsafe { f(qp, base, &mut bad) },
        None => libc::ENOSYS,
    };
    if ret == 0 {
        wrs.clear();
        return Ok(());
    }
    // Requests from `bad` on were not posted.
    let posted = if bad.is_null() {
        0
    } else {
        (bad as usize).saturating_sub(base as usize) / std::mem::size_of::<R::Raw>()
    };
    let posted = posted.min(n);
    ring.set_head(head.wrapping_add(posted as u32));
    for (i, wr) in wrs.iter_mut().enumerate().skip(posted) {
        // SAFETY: withdrawn positions, never seen by the device or the consumer.
        let slot = unsafe { ring.take_back(head.wrapping_add(i as u32)) };
        restore(wr.sges_mut(), slot, &scratch_sges[i]);
    }
    wrs.drain(..posted);
    Err(Error::from_ret(R::VERB, ret))
}

fn take_bufs(sges: &mut [Option<Local>; MAX_SGE]) -> [Option<LocalBuf>; MAX_SGE] {
    // Compact, in SGE order: slot entry i is the buffer of `ibv_sge` i.
    let mut out: [Option<LocalBuf>; MAX_SGE] = Default::default();
    for (o, s) in out.iter_mut().zip(sges.iter_mut().filter_map(Option::take)) {
        *o = Some(s.into_buf());
    }
    out
}

/// Puts a withdrawn slot's buffers back into the request they came from.
fn restore(dst: &mut [Option<Local>; MAX_SGE], slot: Slot, sges: &[ffi::ibv_sge; MAX_SGE]) {
    for ((d, b), sge) in dst.iter_mut().zip(slot.bufs).zip(sges) {
        if let Some(buf) = b {
            let offset = (sge.addr - buf.mr().addr() as u64) as usize;
            *d = Some(Local { buf, offset, len: sge.length });
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let ret = unsafe { ffi::ibv_destroy_qp(self.raw.as_ptr()) };
        if ret == 0 {
            // The device is done with every posted buffer: hand them to the CQs to release.
            self.send_cq.registry.retire(&self.send);
            self.recv_cq.registry.retire(&self.recv);
        } else {
            // The QP may still be live in the device: never release its buffers.
            std::mem::forget(self.send.clone());
            std::mem::forget(self.recv.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_encoding_round_trips_and_checks_fields() {
        let mut gid = [0u8; 16];
        gid[15] = 9;
        let ep = Endpoint { qpn: 0x12_3456, psn: 0xab_cdef, lid: 7, gid: Gid(gid), mtu: Mtu::MTU_1024 };
        let b = ep.encode();
        assert_eq!(b.len(), Endpoint::ENCODED_LEN);
        assert_eq!(Endpoint::decode(&b).unwrap(), ep);
        assert!(Endpoint::decode(&b[..29]).is_err());
        let mut bad = b;
        bad[0] = b'X';
        assert!(Endpoint::decode(&bad).is_err());
        let mut bad = b;
        bad[2] = 9;
        assert!(Endpoint::decode(&bad).is_err());
        let mut bad = b;
        bad[6] = 1; // QPN above 24 bits
        assert!(Endpoint::decode(&bad).is_err());
    }

    #[test]
    fn psn_is_24_bits() {
        for _ in 0..100 {
            assert!(random_psn() <= 0x00ff_ffff);
        }
    }

    #[test]
    fn connect_defaults_match_the_documentation() {
        let o = ConnectOptions::default();
        assert_eq!((o.port, o.timeout, o.retry_cnt, o.rnr_retry, o.min_rnr_timer), (1, 14, 7, 7, 12));
        assert!(o.access.contains(AccessFlags::REMOTE_WRITE));
        assert_eq!(format!("{:?}", QpState::RTS), "RTS");
        assert_eq!(format!("{:?}", QpState(77)), "QpState(77)");
        assert_eq!(format!("{:?}", QpType::UD), "UD");
    }
}
