//! Queue pairs: creation, queries and destruction. Connection setup (the state transitions) is
//! in [`state`], posting in [`post`].

mod attrs;
mod mcast;
mod post;
pub(super) mod scope;
mod split;
pub(super) mod state;
mod window;

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::attr::QpState;
use crate::device::{next_queue_id, Context, ObjectKind, QpId};
use crate::error::{cvt, cvt_p, Error, Result};
use crate::pd::{PdInner, ProtectionDomain};
use crate::post::engine::{register_rings, register_send_ring};
use crate::post::ex::{ExQp, SendOps};
use crate::post::ring::Ring;
use crate::post::{Slot, MAX_SGE};
use crate::queue::cq::{CompletionQueue, CqInner};
use crate::queue::srq::{SharedReceiveQueue, SrqInner};
use crate::queue::xrc::XrcDomain;

pub use attrs::{
    ack_timeout_code, ack_timeout_duration, rnr_timer_code, rnr_timer_duration, ModifyQp, PathMigState,
    QpAttributes, PATH_MIGRATION, RATE_LIMIT,
};
pub use mcast::{is_mcast_gid, MCAST_QPN};
pub use split::{RecvHalf, ReuniteError, SendHalf, SplitError};

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
    /// XRC initiator (`IBV_QPT_XRC_SEND`): sends to XRC SRQs of a remote XRC domain; no receive
    /// queue. Needs `IBV_DEVICE_XRC`.
    pub const XRC_SEND: QpType = QpType(ffi::ibv_qp_type::IBV_QPT_XRC_SEND.0);
    /// XRC target (`IBV_QPT_XRC_RECV`): receives into the XRC SRQs of its
    /// [`XrcDomain`](XrcDomain) ([`QueuePairBuilder::xrcd`]); no work queues of its own.
    /// Needs `IBV_DEVICE_XRC`.
    pub const XRC_RECV: QpType = QpType(ffi::ibv_qp_type::IBV_QPT_XRC_RECV.0);

    fn is_xrc(self) -> bool {
        self == QpType::XRC_SEND || self == QpType::XRC_RECV
    }

    /// What a device lacks that refuses to create a queue pair of this type (`EOPNOTSUPP`, as
    /// iWARP devices, RC only, answer for UC and UD): the capability of [`Error::Unsupported`].
    fn capability(self) -> &'static str {
        match self {
            QpType::RC => "RC queue pairs",
            QpType::UC => "UC queue pairs",
            QpType::UD => "UD queue pairs",
            _ => "queue pairs of this type",
        }
    }
}

impl fmt::Debug for QpType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            QpType::RC => f.write_str("RC"),
            QpType::UC => f.write_str("UC"),
            QpType::UD => f.write_str("UD"),
            QpType::XRC_SEND => f.write_str("XRC_SEND"),
            QpType::XRC_RECV => f.write_str("XRC_RECV"),
            QpType(n) => write!(f, "QpType({n})"),
        }
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
    pub(crate) pd: &'a ProtectionDomain,
    send_cq: &'a CompletionQueue,
    recv_cq: &'a CompletionQueue,
    pub(crate) qp_type: QpType,
    caps: QpCaps,
    srq: Option<&'a SharedReceiveQueue>,
    xrcd: Option<&'a XrcDomain>,
    pub(crate) send_ops: Option<SendOps>,
}

impl ProtectionDomain {
    /// Starts building a queue pair of type `qp_type` whose send and receive completions go to
    /// `cq` (change the receive side with [`QueuePairBuilder::recv_cq`]).
    #[doc(alias = "ibv_create_qp")]
    pub fn create_qp<'a>(&'a self, cq: &'a CompletionQueue, qp_type: QpType) -> QueuePairBuilder<'a> {
        QueuePairBuilder {
            pd: self,
            send_cq: cq,
            recv_cq: cq,
            qp_type,
            caps: QpCaps::default(),
            srq: None,
            xrcd: None,
            send_ops: None,
        }
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
    /// Receives come from the shared receive queue `srq` (`ibv_qp_init_attr.srq`): the queue
    /// pair has no receive queue of its own (its `max_recv_wr`/`max_recv_sge` are ignored, and
    /// [`QueuePair::post_recv`] refuses with [`Error::InvalidArgument`]); its receive
    /// completions, on the receive CQ, hand back the buffers posted to the SRQ. The queue pair
    /// keeps the SRQ alive. The first queue pair of an SRQ on a CQ reserves the SRQ's depth in
    /// that CQ (kept until the SRQ is dropped), however many of its queue pairs complete there.
    #[doc(alias = "ibv_qp_init_attr")]
    pub fn srq(mut self, srq: &'a SharedReceiveQueue) -> Self {
        self.srq = Some(srq);
        self
    }
    /// The XRC domain of an XRC target queue pair ([`QpType::XRC_RECV`]; required for it). The
    /// queue pair keeps the domain alive.
    #[doc(alias = "ibv_qp_init_attr_ex")]
    pub fn xrcd(mut self, xrcd: &'a XrcDomain) -> Self {
        self.xrcd = Some(xrcd);
        self
    }
    /// All capacities at once.
    pub fn caps(mut self, caps: QpCaps) -> Self {
        self.caps = caps;
        self
    }

    /// Makes it an *extended* queue pair (`ibv_create_qp_ex()` with
    /// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`): its send queue is posted through the work-request
    /// builders of `struct ibv_qp_ex` (`ibv_wr_start`, `ibv_wr_send`, `ibv_wr_rdma_write`, ...,
    /// `ibv_wr_complete`) instead of `ibv_post_send`, for the operations in `ops` only.
    ///
    /// [`post_send`](QueuePair::post_send), [`post_send_chain`](QueuePair::post_send_chain) and
    /// [`post_prepared`](QueuePair::post_prepared) keep exactly their guarantees: buffers move
    /// into the QP before the doorbell and come back with the completion; a chain is one builder
    /// sequence with one doorbell, posted all or nothing; a request whose operation is not in
    /// `ops` is refused with [`Error::SendOpNotEnabled`] before anything is posted. Receives
    /// still use `ibv_post_recv`. The raw builder table is [`QueuePair::qp_ex_raw`].
    ///
    /// Not for [`build_on`](Self::build_on) (RDMA-CM ids).
    #[doc(alias = "ibv_create_qp_ex")]
    #[doc(alias = "send_ops_flags")]
    #[doc(alias = "IBV_QP_INIT_ATTR_SEND_OPS_FLAGS")]
    pub fn send_ops(mut self, ops: SendOps) -> Self {
        self.send_ops = Some(ops);
        self
    }

    /// Creates the queue pair (`ibv_create_qp()`), in state RESET.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero send or receive depth, a CQ of another device
    /// context than the protection domain, an SRQ of another protection domain, or an XRC
    /// queue pair built without what its type needs; [`Error::CqTooSmall`] when a
    /// CQ cannot hold every completion of its queue pairs (the send and receive depths add up on
    /// a shared CQ); [`Error::TooManyQueuePairs`] when a CQ already serves the most queues it
    /// can track; [`Error::Unsupported`] for a type the device does not have (`EOPNOTSUPP`:
    /// UC and UD on iWARP, capability "UC queue pairs" or "UD queue pairs"); [`Error::Verb`] from
    /// `ibv_create_qp()` (e.g. `EINVAL` for capacities above the device's limits).
    /// With [`send_ops`](Self::send_ops): [`Error::Unsupported`] where the provider has no
    /// extended QPs (capability "extended QPs": `EOPNOTSUPP` from `ibv_create_qp_ex()`, e.g.
    /// siw) or leaves out a builder every post needs; otherwise [`Error::Verb`] from
    /// `ibv_create_qp_ex()`.
    #[doc(alias = "ibv_create_qp")]
    #[doc(alias = "ibv_create_qp_ex")]
    pub fn build(self) -> Result<QueuePair> {
        if self.qp_type.is_xrc() {
            return self.build_xrc();
        }
        let pd = self.pd.as_raw();
        if let Some(ops) = self.send_ops {
            let ctx = self.pd.inner.ctx.raw.as_ptr();
            return self.build_with("ibv_create_qp_ex", None, |init| {
                let mut ex = ffi::ibv_qp_init_attr_ex {
                    qp_context: init.qp_context,
                    send_cq: init.send_cq,
                    recv_cq: init.recv_cq,
                    srq: init.srq,
                    cap: init.cap,
                    qp_type: init.qp_type,
                    sq_sig_all: init.sq_sig_all,
                    comp_mask: (ffi::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD
                        | ffi::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
                        .0,
                    pd,
                    send_ops_flags: ops.bits(),
                    ..Default::default()
                };
                // SAFETY: valid context, PD and CQs (kept alive by the QP's Arcs); `ex` is a valid
                // attribute struct whose comp_mask names the fields set.
                let raw = cvt_p("ibv_create_qp_ex", unsafe { ffi::ibv_create_qp_ex(ctx, &mut ex) })
                    .map_err(|e| e.or_unsupported("extended QPs"))?;
                init.cap = ex.cap;
                Ok(raw)
            });
        }
        let capability = self.qp_type.capability();
        self.build_with("ibv_create_qp", None, |init| {
            // SAFETY: valid PD and CQs (kept alive by the QP's Arcs); `init` is a valid attribute
            // struct.
            cvt_p("ibv_create_qp", unsafe { ffi::ibv_create_qp(pd, init) })
                .map_err(|e| e.or_unsupported(capability))
        })
    }

    /// XRC queue pairs: `ibv_create_qp_ex()` with the PD (initiator) or the XRC domain (target),
    /// after the capability check.
    fn build_xrc(self) -> Result<QueuePair> {
        const VERB: &str = "ibv_create_qp_ex";
        if self.send_ops.is_some() {
            // build_xrc creates no extended part (its send_ops_flags are not passed).
            return Err(Error::InvalidArgument {
                verb: VERB,
                reason: "XRC queue pairs are not created with send_ops here",
            });
        }
        if self.srq.is_some() {
            // Neither XRC type has a receive queue of its own to replace (a target's receives
            // arrive on the XRC SRQs of its domain): .srq() would only reserve CQ room.
            return Err(Error::InvalidArgument {
                verb: VERB,
                reason: "XRC queue pairs take no .srq() (XRC_RECV receives through its XRC domain's SRQs)",
            });
        }
        crate::queue::xrc::check_xrc(&self.pd.context(), VERB)?;
        let target = self.qp_type == QpType::XRC_RECV;
        let xrcd = match (target, self.xrcd) {
            (true, None) => {
                return Err(Error::InvalidArgument {
                    verb: VERB,
                    reason: "an XRC target queue pair needs .xrcd()",
                })
            }
            (true, Some(x)) if !Arc::ptr_eq(&x.inner._ctx, &self.pd.inner.ctx) => {
                return Err(Error::InvalidArgument {
                    verb: VERB,
                    reason: "the XRC domain belongs to another device context than the protection domain",
                })
            }
            (true, Some(x)) => x.as_raw(),
            (false, _) => std::ptr::null_mut(),
        };
        let (pd, ctx) = (self.pd.as_raw(), self.pd.inner.ctx.raw.as_ptr());
        self.build_with(VERB, None, |init| {
            use ffi::ibv_qp_init_attr_mask as M;
            let mut ex = std::mem::MaybeUninit::<ffi::ibv_qp_init_attr_ex>::zeroed();
            let p = ex.as_mut_ptr();
            // SAFETY: all-zero is a valid ibv_qp_init_attr_ex (null pointers and integers),
            // written through `p` so its padding stays initialised; valid context, PD, CQs and
            // XRC domain (kept alive by the QP's Arcs).
            let raw = unsafe {
                (*p).send_cq = init.send_cq;
                (*p).recv_cq = init.recv_cq;
                (*p).cap = init.cap;
                (*p).qp_type = init.qp_type;
                if target {
                    (*p).comp_mask = M::IBV_QP_INIT_ATTR_XRCD.0;
                    (*p).xrcd = xrcd;
                } else {
                    (*p).comp_mask = M::IBV_QP_INIT_ATTR_PD.0;
                    (*p).pd = pd;
                }
                let raw = ffi::ibv_create_qp_ex(ctx, p);
                init.cap = (*p).cap;
                raw
            };
            cvt_p(VERB, raw)
        })
    }

    /// The creation steps common to every queue pair: checks, ring registration (all or
    /// nothing), `create` (the verb), and the QP's scratch arrays.
    pub(crate) fn build_with(
        self,
        verb: &'static str,
        cm: Option<Arc<dyn CmIdHold>>,
        create: impl FnOnce(&mut ffi::ibv_qp_init_attr) -> Result<NonNull<ffi::ibv_qp>>,
    ) -> Result<QueuePair> {
        let mut caps = self.caps;
        // Work queues this QP has of its own: an SRQ or XRC QP has no receive queue, an XRC
        // target no send queue either.
        let has_recv = self.srq.is_none() && !self.qp_type.is_xrc();
        let has_send = self.qp_type != QpType::XRC_RECV;
        if !has_recv {
            caps.max_recv_wr = 0;
            caps.max_recv_sge = 0;
        }
        if !has_send {
            caps = QpCaps {
                max_send_wr: 0,
                max_recv_wr: 0,
                max_send_sge: 0,
                max_recv_sge: 0,
                max_inline_data: 0,
            };
        }
        if (has_send && caps.max_send_wr == 0) || (has_recv && caps.max_recv_wr == 0) {
            return Err(Error::InvalidArgument {
                verb,
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
        let pd_ctx = &self.pd.inner.ctx;
        if !Arc::ptr_eq(&self.send_cq.inner.ctx, pd_ctx) || !Arc::ptr_eq(&self.recv_cq.inner.ctx, pd_ctx) {
            // libibverbs would pass the CQ's per-context handle on the PD's context, attaching
            // the QP to whichever CQ of that context has the same number.
            return Err(Error::InvalidArgument {
                verb,
                reason: "a completion queue belongs to another device context than the protection domain",
            });
        }
        let send_cq = self.send_cq.inner.clone();
        let recv_cq = self.recv_cq.inner.clone();
        let srq = self.srq.map(|s| s.inner.clone());
        if let Some(srq) = &srq {
            if !Arc::ptr_eq(&srq.pd, &self.pd.inner) {
                return Err(Error::InvalidArgument {
                    verb,
                    reason: "the shared receive queue belongs to another protection domain",
                });
            }
            // Refused before the attachment reserves CQ room the kernel's refusal would leave
            // taken until the SRQ goes.
            if srq._xrcd.is_some() {
                return Err(Error::InvalidArgument {
                    verb,
                    reason: "an XRC SRQ serves XRC_RECV queue pairs through their XRC domain, not .srq()",
                });
            }
            init.srq = srq.raw.as_ptr();
            // Attached first: on a shared CQ, the send ring's CqTooSmall then reports the total
            // needed. The attachment stays if the QP is not created (it is the SRQ's, given back
            // when the SRQ goes).
            srq.attach_to(&recv_cq, verb)?;
        }
        // A queue the QP does not have gets a ring that is never registered nor posted to.
        let none = || Arc::new(Ring::new(1, 0));
        let [send, recv] = match (has_send, has_recv) {
            (true, true) => register_rings(
                &send_cq.registry,
                &recv_cq.registry,
                caps.max_send_wr,
                caps.max_recv_wr,
                verb,
            )?,
            (true, false) => [register_send_ring(&send_cq.registry, caps.max_send_wr, verb)?, none()],
            (false, _) => [none(), none()],
        };
        crate::error::clear_errno();
        let raw = match create(&mut init) {
            Ok(r) => r,
            Err(e) => {
                let e = self.pd.context().explain_queue_failure(e);
                // The rings never reached the device.
                if has_send {
                    send_cq.registry.unregister(&send);
                }
                if has_recv {
                    recv_cq.registry.unregister(&recv);
                }
                return Err(e);
            }
        };
        let ex = match self.send_ops {
            None => None,
            Some(ops) => {
                // SAFETY: a QP created by ibv_create_qp_ex; NULL if it has no extended part.
                let qpx = unsafe { ffi::ibv_qp_to_qp_ex(raw.as_ptr()) };
                // SAFETY: the ibv_qp_ex of this QP lives as long as the QP (which holds the result).
                let table =
                    (!qpx.is_null()).then(|| unsafe { ExQp::new(qpx, ops, self.qp_type == QpType::UD) });
                match table.flatten() {
                    Some(t) => Some(t),
                    None => {
                        // SAFETY: created above, never posted to, destroyed once.
                        unsafe { ffi::ibv_destroy_qp(raw.as_ptr()) };
                        // Only registered rings: a queue the QP lacks has a placeholder, which
                        // unregister would count as a registered ring given back.
                        if has_send {
                            send_cq.registry.unregister(&send);
                        }
                        if has_recv {
                            recv_cq.registry.unregister(&recv);
                        }
                        return Err(Error::Unsupported {
                            verb,
                            capability: "the work-request builders of struct ibv_qp_ex (ibv_wr_start, ibv_wr_set_sge_list, ...)",
                        });
                    }
                }
            }
        };
        // SAFETY: the QP is valid; its context's ops table belongs to the provider.
        let (provider_post_send, post_recv_fn) = unsafe {
            let ops = &(*(*raw.as_ptr()).context).ops;
            (ops.post_send, ops.post_recv)
        };
        // siw: the safe level posts through `fenced_post_send` (see there); ex QPs do not exist.
        let post_send_fn = match provider_post_send {
            Some(_) if ex.is_none() && self.pd.context().is_siw() => Some(fenced_post_send as PostSendFn),
            f => f,
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
        let id = next_queue_id();
        self.pd.inner.ctx.serials.insert(ObjectKind::Qp, raw.as_ptr() as usize, id);
        Ok(QueuePair {
            raw,
            id,
            resets: 0,
            post_send_fn,
            provider_post_send,
            post_recv_fn,
            ex,
            send,
            recv,
            caps: actual,
            qp_type: self.qp_type,
            state: QpState::RESET,
            sendable: false,
            light_sends: false,
            psn: random_psn(),
            chain: vec![ffi::ibv_send_wr::default(); chain_len].into_boxed_slice(),
            chain_sges: vec![[ffi::ibv_sge::default(); MAX_SGE]; chain_len].into_boxed_slice(),
            recv_chain: vec![ffi::ibv_recv_wr::default(); recv_chain_len].into_boxed_slice(),
            recv_chain_sges: vec![[ffi::ibv_sge::default(); MAX_SGE]; recv_chain_len].into_boxed_slice(),
            prepared: None,
            pins: std::sync::Mutex::new(Vec::new()),
            recv_pins: std::sync::Mutex::new(Vec::new()),
            send_cq,
            recv_cq,
            pd: self.pd.inner.clone(),
            cm,
            srq,
            has_send,
            has_recv,
            _xrcd: self.xrcd.filter(|_| self.qp_type == QpType::XRC_RECV).map(|x| x.inner.clone()),
            mcast: Vec::new(),
        })
    }
}

type PostSendFn =
    unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_send_wr, *mut *mut ffi::ibv_send_wr) -> i32;
type PostRecvFn =
    unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32;

/// The safe level's `post_send` on siw: fences (`IBV_SEND_FENCE`) every request of the chain
/// but RDMA Reads and atomics, then calls the provider's `post_send`.
///
/// siw completes a Send or RDMA Write as soon as TCP has taken it, while an RDMA Read posted
/// before it still waits for its response (Linux 6.1 `siw_qp_sq_process`): the send queue's
/// completions come out of order. The rings cannot take that: a completion ends every earlier
/// request of its queue ([`Ring`]), so the Read's buffer would be handed back, or a scope
/// would return, while the response may still be written into it. A fenced request starts only
/// once every earlier Read and atomic has completed (siw: its ORQ is empty), which puts the
/// completions back in posting order; a fence with no Read outstanding costs nothing.
///
/// # Safety
/// As the provider's `post_send`: `qp` is a live queue pair of a siw context, `wr` heads a valid,
/// `NULL`-terminated chain of requests this call may modify (the safe level's own), and
/// `bad_wr` is valid for a write.
pub(crate) unsafe extern "C" fn fenced_post_send(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    bad_wr: *mut *mut ffi::ibv_send_wr,
) -> i32 {
    use ffi::ibv_wr_opcode as O;
    let mut w = wr;
    while !w.is_null() {
        // SAFETY: a valid chain the caller lets us modify (contract).
        unsafe {
            let op = (*w).opcode;
            if op != O::IBV_WR_RDMA_READ
                && op != O::IBV_WR_ATOMIC_CMP_AND_SWP
                && op != O::IBV_WR_ATOMIC_FETCH_AND_ADD
            {
                (*w).send_flags |= ffi::ibv_send_flags::IBV_SEND_FENCE.0;
            }
            w = (*w).next;
        }
    }
    // SAFETY: a live QP (contract): its context's ops table belongs to the provider.
    match unsafe { (*(*qp).context).ops.post_send } {
        // SAFETY: the provider's post_send with the caller's valid arguments.
        Some(f) => unsafe { f(qp, wr, bad_wr) },
        None => libc::EOPNOTSUPP,
    }
}

/// A queue pair (`struct ibv_qp`).
///
/// Created in state RESET by [`ProtectionDomain::create_qp`]; [`connect`](Self::connect) (RC, UC)
/// or [`activate_ud`](Self::activate_ud) (UD) brings it to RTS. Posting takes `&mut self` at the
/// safe level: the QP keeps each posted buffer until its completion is polled from the CQ, which
/// hands it back. Dropping the QP destroys it (`ibv_destroy_qp()`); buffers still outstanding are
/// released at the CQ's next [`poll`](CompletionQueue::poll) (or when the CQ goes).
pub struct QueuePair {
    raw: NonNull<ffi::ibv_qp>,
    /// Unique for the process's lifetime (never reused, unlike the `ibv_qp` address): what a
    /// prepared request is checked against.
    pub(crate) id: u64,
    /// Resets that reached the device (it forgot every request then), counted even when the
    /// reset failed afterwards: what [`Incarnation`] compares besides the rings.
    pub(crate) resets: u64,
    /// What the safe level posts sends through: the provider's `post_send`, or on siw
    /// [`fenced_post_send`] in front of it.
    post_send_fn: Option<PostSendFn>,
    /// The provider's `post_send`, for the `unsafe` level.
    provider_post_send: Option<PostSendFn>,
    post_recv_fn: Option<PostRecvFn>,
    /// The builder table of an extended QP ([`QueuePairBuilder::send_ops`]): sends go through it.
    ex: Option<ExQp>,
    send: Arc<Ring<Slot>>,
    recv: Arc<Ring<Slot>>,
    caps: QpCaps,
    qp_type: QpType,
    state: QpState,
    /// Whether sends may be posted: a send queue (`has_send`) in RTS or ERR (where the device
    /// flushes them). Kept with `state` by [`set_state`](Self::set_state), so that a post checks
    /// one flag.
    sendable: bool,
    /// Whether light send requests ([`SendRequest::is_light`](crate::post::SendRequest)) may
    /// skip the general checks: `sendable` on a classic (not `send_ops`) RC or UC queue pair.
    /// Kept with `state` by [`set_state`](Self::set_state).
    light_sends: bool,
    psn: u32,
    chain: Box<[ffi::ibv_send_wr]>,
    chain_sges: Box<[[ffi::ibv_sge; MAX_SGE]]>,
    recv_chain: Box<[ffi::ibv_recv_wr]>,
    recv_chain_sges: Box<[[ffi::ibv_sge; MAX_SGE]]>,
    /// Scratch of prepared posts, with the templates last posted (allocated at the first).
    pub(crate) prepared: Option<crate::post::prepared::PreparedScratch>,
    /// The buffers and address handles of prepared requests, held for their posts (whose slots
    /// hold nothing): dropped with the QP after `ibv_destroy_qp`, leaked if it fails, pruned
    /// by `prepare_send` (see `QueuePair::pin`).
    pub(crate) pins: std::sync::Mutex<Vec<crate::post::prepared::Pin>>,
    /// The same for prepared receives ([`PreparedRecv`](crate::PreparedRecv)): their buffers,
    /// pruned by `prepare_recv` when no receive is outstanding.
    pub(crate) recv_pins: std::sync::Mutex<Vec<crate::post::prepared::Pin>>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    pd: Arc<PdInner>,
    /// The RDMA-CM id the QP was created on: RDMA-CM drives its state, and the id is destroyed
    /// only after the QP (this Arc).
    pub(crate) cm: Option<Arc<dyn CmIdHold>>,
    /// The shared receive queue receives come from: destroyed only after this QP (this Arc).
    /// Declared after `raw`'s users; the QP itself is destroyed in `Drop::drop`, before any
    /// field is dropped.
    pub(crate) srq: Option<Arc<SrqInner>>,
    /// Whether the send ring is registered (not for an XRC target).
    pub(crate) has_send: bool,
    /// Whether the receive ring is registered (not on an SRQ, not for XRC).
    pub(crate) has_recv: bool,
    /// The XRC domain of an XRC target, destroyed after it.
    _xrcd: Option<Arc<crate::queue::xrc::XrcdInner>>,
    /// The multicast groups (GID, LID) attached through [`attach_mcast`](Self::attach_mcast) and
    /// not detached: the drop detaches them first (Linux refuses to destroy a queue pair with
    /// attachments: `EBUSY`).
    pub(crate) mcast: Vec<(crate::attr::Gid, u16)>,
}

// SAFETY: libibverbs QPs may be used from any thread (providers lock their queues). The rings are
// single-producer: every producer method takes &mut self. The scratch arrays are touched only under
// &mut self and hold no pointers between calls that matter (they are rewritten on each use).
unsafe impl Send for QueuePair {}
// SAFETY: &self methods only query the QP, post through the `unsafe` level (which providers
// make thread-safe), or change the prepared requests' pin lists under their Mutex.
unsafe impl Sync for QueuePair {}

/// What a queue pair created on an RDMA-CM id holds of the id: the id lives until the queue pair
/// is gone, and destroys it. The `cm` module's id implements it, and creates such queue pairs
/// ([`QueuePairBuilder::build_on`](crate::QueuePairBuilder::build_on)).
pub(crate) trait CmIdHold: Send + Sync {
    /// Destroys `qp` (`ibv_destroy_qp()`) as `rdma_destroy_qp()` does, returning the verb's
    /// result: on success the id no longer names it (`id->qp`).
    ///
    /// # Safety
    /// `qp` is the queue pair created on this id, destroyed once.
    unsafe fn destroy_qp(&self, qp: *mut ffi::ibv_qp) -> i32;
}

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

pub(crate) fn random_psn() -> u32 {
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

impl QueuePair {
    /// Identifies this QP in [`AsyncEvent`](crate::AsyncEvent)s: a number unique in the
    /// process (see [`QpId`](crate::QpId)).
    pub fn id(&self) -> QpId {
        QpId(self.id)
    }

    /// Whether both work queues complete into `cq` (checked by the async adaptor).
    pub(crate) fn completes_into(&self, cq: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.send_cq, &cq.inner) && Arc::ptr_eq(&self.recv_cq, &cq.inner)
    }

    /// What this queue pair's requests are posted to now: the QP itself (`id`) and its rings,
    /// which a reset replaces. [`Incarnation::is`] tells whether a queue pair still is it.
    pub(crate) fn incarnation(&self) -> Incarnation {
        Incarnation { id: self.id, resets: self.resets, send: self.send.clone(), recv: self.recv.clone() }
    }
}

/// A queue pair and its rings at one moment ([`QueuePair::incarnation`]). Holding the rings
/// keeps their addresses from being reused, so a comparison cannot mistake new rings for them.
pub(crate) struct Incarnation {
    /// The id of that queue pair.
    pub(crate) id: u64,
    resets: u64,
    send: Arc<Ring<Slot>>,
    recv: Arc<Ring<Slot>>,
}

impl Incarnation {
    /// Whether `qp` is still the same queue pair with the same rings (not replaced, not reset).
    pub(crate) fn is(&self, qp: &QueuePair) -> bool {
        self.id == qp.id
            && self.resets == qp.resets
            && Arc::ptr_eq(&self.send, &qp.send)
            && Arc::ptr_eq(&self.recv, &qp.recv)
    }
}

impl QueuePair {
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: valid QP; qp_num is a plain field written at creation.
        unsafe { (*self.raw.as_ptr()).qp_num }
    }

    /// The QP's initial send PSN (random, 24 bits), as advertised in its [`Endpoint`](crate::Endpoint).
    pub fn psn(&self) -> u32 {
        self.psn
    }

    /// Sets the initial send PSN used by the next [`connect`](Self::connect) (unless the options
    /// name one: [`ConnectOptions::psn`](crate::ConnectOptions::psn), the simpler way). Call it
    /// before [`endpoint`](Self::endpoint), which advertises the PSN to the peer (a PSN set after
    /// the peer got the endpoint makes the two sides disagree). [`reset`](Self::reset) picks a
    /// new random one.
    pub fn set_psn(&mut self, psn: u32) {
        self.psn = psn & 0x00ff_ffff;
    }

    /// The transport type.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// The capacities the device granted (at least those asked for). The safe level keeps as
    /// many requests outstanding as were asked for: see [`send_capacity`](Self::send_capacity)
    /// and [`recv_capacity`](Self::recv_capacity).
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// How many send requests the safe level lets be outstanding at once: the `max_send_wr`
    /// asked for at creation (the device may have granted more, [`caps`](Self::caps)); a post
    /// beyond it fails with [`Error::QueueFull`]. 0 without a send queue (an XRC target).
    pub fn send_capacity(&self) -> u32 {
        if self.has_send {
            self.send.capacity()
        } else {
            0
        }
    }

    /// How many receive requests the safe level lets be outstanding at once: the `max_recv_wr`
    /// asked for at creation (the device may have granted more, [`caps`](Self::caps)); a post
    /// beyond it fails with [`Error::QueueFull`]. 0 without a receive queue of its own (a
    /// shared receive queue's queue pair, XRC).
    pub fn recv_capacity(&self) -> u32 {
        if self.has_recv {
            self.recv.capacity()
        } else {
            0
        }
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

    /// Whether receives come from a shared receive queue ([`QueuePairBuilder::srq`]).
    pub fn uses_srq(&self) -> bool {
        self.srq.is_some()
    }

    /// Receive requests posted through the safe level and not yet completed (0 on a queue pair
    /// that uses a shared receive queue: see [`SharedReceiveQueue::outstanding`]).
    pub fn outstanding_recvs(&self) -> u32 {
        self.recv.outstanding()
    }

    /// Whether this queue pair's send queue completes into `cq`.
    pub(crate) fn sends_into(&self, cq: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.send_cq, &cq.inner)
    }

    /// Whether this queue pair and `other` belong to one protection domain.
    pub(crate) fn same_pd(&self, other: &QueuePair) -> bool {
        Arc::ptr_eq(&self.pd, &other.pd)
    }

    /// The raw `struct ibv_qp *`; valid while this QP lives. What `ffi` calls may not do with
    /// it: see the crate's *Safety model* (raw handles).
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.raw.as_ptr()
    }

    /// The operations an extended queue pair posts ([`QueuePairBuilder::send_ops`], less any
    /// whose builder the provider does not have); `None` for a classic queue pair.
    pub fn send_ops(&self) -> Option<SendOps> {
        self.ex.map(|e| e.ops)
    }

    /// The raw `struct ibv_qp_ex *` of an extended queue pair (`ibv_qp_to_qp_ex()`), for posting
    /// with the `ibv_wr_*` builders at exactly C's cost; `None` for a classic queue pair. Valid
    /// while this QP lives.
    ///
    /// Getting the pointer is safe; using it is `unsafe` (`ffi::ibv_wr_start` and friends), with
    /// the contract of [`post_send_unchecked`](Self::post_send_unchecked) for every request
    /// built (memory registered in this QP's PD and left alone until the completion, address
    /// handles alive, `wr_id` bit 63 clear, CQ room within
    /// [`CompletionQueue::unreserved`](crate::CompletionQueue::unreserved)), plus: each
    /// `ibv_wr_start` ... `ibv_wr_complete` (or `ibv_wr_abort`) sequence runs on one thread and
    /// never overlaps another sequence or post on this QP, on any thread — not a safe
    /// [`post_send`](Self::post_send), nor [`post_send_unchecked`](Self::post_send_unchecked)
    /// inside the sequence on the same thread (`ibv_wr_post(3)` forbids `ibv_post_send` there;
    /// rxe's provider would spin on the lock its `ibv_wr_start` holds) — and uses only the
    /// operations the QP was created for ([`send_ops`](Self::send_ops)).
    #[doc(alias = "ibv_qp_to_qp_ex")]
    pub fn qp_ex_raw(&self) -> Option<*mut ffi::ibv_qp_ex> {
        self.ex.map(|e| e.raw)
    }

    /// Whether the QP was created on an RDMA-CM id (whose connection drives its state).
    pub fn is_cm_managed(&self) -> bool {
        self.cm.is_some()
    }

    /// Reads the state from the device (`ibv_query_qp()`) into [`state`](Self::state), e.g.
    /// after an RDMA-CM event moved it (a QP left [`QpState::UNUSABLE`] stays so).
    ///
    /// On an iWARP device a queue pair on an RDMA-CM id keeps its known state when the device
    /// answers RESET: siw's `ibv_query_qp()` does not report the state (it always reads RESET),
    /// and such a queue pair is never in RESET (librdmacm moves it to INIT when it creates it).
    /// After the `ESTABLISHED` event use [`cm_established`](Self::cm_established).
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails.
    #[doc(alias = "ibv_query_qp")]
    pub fn refresh_state(&mut self) -> Result<QpState> {
        let s = self.query_state()?;
        if self.state != QpState::UNUSABLE && !self.unreported(s) {
            self.set_state(s);
        }
        Ok(self.state)
    }

    /// Records that the connection of this queue pair's RDMA-CM id is established (after its
    /// `ESTABLISHED` event), which moved the queue pair to RTS: reads the state from the device
    /// (`ibv_query_qp()`), and where the device does not report it (siw: RESET, see
    /// [`refresh_state`](Self::refresh_state)) takes RTS. [`cm::connect`](crate::cm::connect)
    /// and [`Listener::accept`](crate::cm::Listener::accept) call it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a queue pair not created on an RDMA-CM id; [`Error::Verb`]
    /// when the query fails.
    #[doc(alias = "ibv_query_qp")]
    pub fn cm_established(&mut self) -> Result<QpState> {
        if self.cm.is_none() {
            return Err(Error::InvalidArgument {
                verb: "ibv_query_qp",
                reason: "cm_established is for queue pairs created on an RDMA-CM id",
            });
        }
        let s = self.query_state()?;
        if self.state != QpState::UNUSABLE {
            self.set_state(if self.unreported(s) { QpState::RTS } else { s });
        }
        Ok(self.state)
    }

    /// Whether `queried` is siw's non-answer: RESET for a queue pair on an RDMA-CM id (never in
    /// RESET) of an iWARP device.
    pub(crate) fn unreported(&self, queried: QpState) -> bool {
        queried == QpState::RESET && self.cm.is_some() && self.context().is_iwarp()
    }

    /// Refuses a state transition of this crate's on a queue pair RDMA-CM drives.
    pub(crate) fn check_not_cm(&self) -> Result<()> {
        if self.cm.is_some() {
            return Err(Error::CmManaged { verb: "ibv_modify_qp" });
        }
        Ok(())
    }

    /// The context the queue pair was created in (its protection domain's).
    pub(crate) fn context(&self) -> Context {
        Context { inner: self.pd.ctx.clone() }
    }

    /// Records the queue pair's state (the only writer of `state`), and whether sends may be
    /// posted in it.
    pub(crate) fn set_state(&mut self, state: QpState) {
        self.state = state;
        self.sendable = self.has_send && (state == QpState::RTS || state == QpState::ERR);
        self.light_sends =
            self.sendable && self.ex.is_none() && (self.qp_type == QpType::RC || self.qp_type == QpType::UC);
    }

    /// `ibv_modify_qp()` as given, recording the new state.
    fn modify_raw(&mut self, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask) -> Result<()> {
        // SAFETY: valid QP and attribute struct.
        let ret = unsafe { ffi::ibv_modify_qp(self.raw.as_ptr(), attr, mask.0 as i32) };
        cvt("ibv_modify_qp", ret)?;
        self.set_state(QpState(attr.qp_state.0));
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // Linux's ibv_destroy_qp fails with EBUSY while multicast groups are attached through
        // ibv_attach_mcast (uverbs_free_qp): detach them first, best effort (a failure leaves the
        // destroy to fail and the queue pair leaked below, never freed while live).
        for (gid, lid) in std::mem::take(&mut self.mcast) {
            let gid = gid.to_raw();
            // SAFETY: a valid QP (not destroyed yet) and GID, read during the call.
            let _ = unsafe { ffi::ibv_detach_mcast(self.raw.as_ptr(), &gid, lid) };
        }
        // Everything the destruction needs, and every reference that must outlive the queue
        // pair, moves into the teardown; what stays here is dropped when this returns.
        let pins = |p: &mut std::sync::Mutex<Vec<crate::post::prepared::Pin>>| {
            std::mem::take(p.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner))
        };
        let t = QpTeardown {
            raw: self.raw,
            id: self.id,
            cm: self.cm.take(),
            pd: self.pd.clone(),
            send: self.send.clone(),
            recv: self.recv.clone(),
            send_cq: self.send_cq.clone(),
            recv_cq: self.recv_cq.clone(),
            has_send: self.has_send,
            has_recv: self.has_recv,
            pins: pins(&mut self.pins),
            recv_pins: pins(&mut self.recv_pins),
            _prepared: self.prepared.take(),
            _srq: self.srq.take(),
            _xrcd: self._xrcd.take(),
        };
        // Deferred while type 2 windows bound through it live, on devices whose
        // ibv_destroy_qp would wait for them (rxe: see memory/hold.rs); at once otherwise.
        if let Some(run) = crate::memory::park_qp_teardown(self.id, Box::new(move || t.run())) {
            run();
        }
    }
}

/// The destruction of a dropped queue pair (`ibv_destroy_qp`, then its buffers handed to its
/// CQs), with the references that must outlive it: its CQs, PD, SRQ, XRC domain and RDMA-CM id
/// are dropped only after the verb. Run by the queue pair's drop, or later by the last window
/// that held it back (`memory/hold.rs`).
struct QpTeardown {
    raw: NonNull<ffi::ibv_qp>,
    id: u64,
    cm: Option<Arc<dyn CmIdHold>>,
    pd: Arc<PdInner>,
    send: Arc<Ring<Slot>>,
    recv: Arc<Ring<Slot>>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    has_send: bool,
    has_recv: bool,
    pins: Vec<crate::post::prepared::Pin>,
    recv_pins: Vec<crate::post::prepared::Pin>,
    _prepared: Option<crate::post::prepared::PreparedScratch>,
    _srq: Option<Arc<SrqInner>>,
    _xrcd: Option<Arc<crate::queue::xrc::XrcdInner>>,
}

// SAFETY: its fields are (a subset of) what a QueuePair holds, and QueuePair is Send: the raw
// `ibv_qp` may be destroyed from any thread, the rest are Send handles. It is taken out of the
// queue pair by its drop, so nothing posts to the queue pair any more, and it runs once (`run`
// takes it by value) on whichever thread drops the last window holding the queue pair.
unsafe impl Send for QpTeardown {}

impl QpTeardown {
    fn run(mut self) {
        let ret = match &self.cm {
            None => {
                // SAFETY: created once, destroyed once (the queue pair was dropped).
                unsafe { ffi::ibv_destroy_qp(self.raw.as_ptr()) }
            }
            // SAFETY: the id's queue pair, created once, destroyed once.
            Some(cm) => unsafe { cm.destroy_qp(self.raw.as_ptr()) },
        };
        if ret == 0 {
            self.pd.ctx.serials.remove(ObjectKind::Qp, self.raw.as_ptr() as usize, self.id);
            // The device is done with every posted buffer: hand them to the CQs to release.
            if self.has_send {
                self.send_cq.registry.retire(&self.send);
            }
            if self.has_recv {
                self.recv_cq.registry.retire(&self.recv);
            }
        } else {
            // The QP may still be live in the device: never release its buffers.
            std::mem::forget(self.send.clone());
            std::mem::forget(self.recv.clone());
            std::mem::forget(std::mem::take(&mut self.pins));
            std::mem::forget(std::mem::take(&mut self.recv_pins));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_is_24_bits() {
        for _ in 0..100 {
            assert!(random_psn() <= 0x00ff_ffff);
        }
    }

    #[test]
    fn states_and_types_print_their_names() {
        assert_eq!(format!("{:?}", QpState::RTS), "RTS");
        assert_eq!(format!("{:?}", QpState::UNUSABLE), "UNUSABLE");
        assert_eq!(format!("{:?}", QpState(77)), "QpState(77)");
        assert_eq!(format!("{:?}", QpType::UD), "UD");
    }
}
