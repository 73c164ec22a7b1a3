//! Queue pairs on RDMA-CM ids: [`QueuePairBuilder::build_on`], and how such a queue pair is
//! destroyed (what it holds of its id).

use ibverbs_sys as ffi;

use crate::attr::QpState;
use crate::cm::id::{CmId, CmIdInner};
use crate::error::{cvt, cvt_p, Error, Result};
use crate::queue::{CmIdHold, QpType, QueuePair, QueuePairBuilder};

impl QueuePairBuilder<'_> {
    /// Creates the queue pair on an RDMA-CM id (`rdma_create_qp()`): on an id of
    /// [`EventChannel::create_udp_id`](crate::cm::EventChannel::create_udp_id) a UD queue pair,
    /// which librdmacm brings to RTS with the port space's Q_Key (for multicast:
    /// [`CmId::join_multicast`](crate::cm::CmId::join_multicast)); otherwise an RC queue pair in INIT
    /// whose state transitions RDMA-CM drives ([`CmId::connect`](crate::cm::CmId::connect),
    /// [`accept`](crate::cm::CmId::accept), [`disconnect`](crate::cm::CmId::disconnect)); this
    /// crate's [`init`](QueuePair::init), [`connect`](QueuePair::connect),
    /// [`activate_ud`](QueuePair::activate_ud) and [`reset`](QueuePair::reset) refuse it with
    /// [`Error::CmManaged`]. Posting works as for any queue pair, with the same slot rings.
    ///
    /// Its [`state`](QueuePair::state) is read from the device at creation (INIT); RDMA-CM moves
    /// it to RTS when the connection is established, so call
    /// [`cm_established`](QueuePair::cm_established) after the `ESTABLISHED` event before posting
    /// sends ([`cm::connect`](crate::cm::connect) and [`Listener::accept`](crate::cm::Listener::accept)
    /// do).
    ///
    /// The queue pair keeps the id alive: it is destroyed first, and clears `id->qp` (as
    /// `rdma_destroy_qp()` does), so librdmacm never uses a destroyed queue pair. Before it is
    /// destroyed, the id leaves the multicast groups it joined and did not leave
    /// ([`CmId::leave_multicast`](crate::cm::CmId::leave_multicast)): the kernel refuses to
    /// destroy a queue pair attached to a group.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a type the id's port space does not carry (RC on
    /// `RDMA_PS_TCP`, UD on `RDMA_PS_UDP`), an id not bound to a device yet (resolve
    /// its route, or take it from a connection request), or a PD or CQ of another context than
    /// the id's device (make them from [`CmId::context`](crate::cm::CmId::context)); `EINVAL`
    /// when the id already has a queue pair; otherwise as [`build`](Self::build).
    #[doc(alias = "rdma_create_qp")]
    pub fn build_on(self, id: &CmId) -> Result<QueuePair> {
        let bad = |reason| Err(Error::InvalidArgument { verb: "rdma_create_qp", reason });
        if self.send_ops.is_some() {
            return bad("extended queue pairs (send_ops) are not created on RDMA-CM ids here");
        }
        let udp = id.is_udp();
        if !udp && self.qp_type != QpType::RC {
            return bad("RDMA-CM ids of the RDMA_PS_TCP port space carry RC queue pairs only");
        }
        if udp && self.qp_type != QpType::UD {
            return bad("RDMA-CM ids of the RDMA_PS_UDP port space carry UD queue pairs only");
        }
        if id.verbs()?.as_ptr() != self.pd.inner.ctx.raw.as_ptr() {
            // Both contexts are open now, so equal addresses mean the same context.
            return bad(
                "the protection domain belongs to another device context than the id (use CmId::context)",
            );
        }
        let cm = id.inner.clone();
        let pd = self.pd.as_raw();
        let mut qp = self.build_with("rdma_create_qp", Some(cm.clone()), |init| {
            let _g = cm.channel.lock();
            // SAFETY: valid id, PD and CQs (the PD and CQs share the id's context, checked above
            // and in build_with); `init` is a valid attribute struct. librdmacm stores the QP in
            // `id->qp` under the channel lock we hold.
            let ret = unsafe { ffi::rdma_create_qp(cm.raw.as_ptr(), pd, init) };
            cvt("rdma_create_qp", ret)?;
            // SAFETY: valid id; `qp` was just written under our lock.
            cvt_p("rdma_create_qp", unsafe { (*cm.raw.as_ptr()).qp })
        })?;
        let s = qp.query_state()?;
        // rdma_create_qp moved it to INIT (a UD one on to RTS); siw does not report states (see
        // refresh_state).
        qp.set_state(if qp.unreported(s) { QpState::INIT } else { s });
        Ok(qp)
    }
}

impl CmIdHold for CmIdInner {
    unsafe fn destroy_qp(&self, qp: *mut ffi::ibv_qp) -> i32 {
        // What rdma_destroy_qp() does (the id has no CQs of librdmacm's: we always pass ours), but
        // with the result checked: on failure `id->qp` keeps naming the QP, which is then leaked,
        // so librdmacm never uses freed memory.
        let _g = self.channel.lock();
        // The kernel refuses to destroy a queue pair still attached to a multicast group
        // (EBUSY): leave the id's groups first, which detaches it (rdma_leave_multicast).
        // SAFETY: the channel lock is held.
        unsafe { self.leave_all_groups() };
        // SAFETY: created once, destroyed once (the caller's contract), under the channel lock
        // that every librdmacm call on the id (and event processing, which uses `id->qp`) holds.
        let ret = unsafe { ffi::ibv_destroy_qp(qp) };
        if ret == 0 {
            // SAFETY: valid id (the queue pair's Arc keeps it); written under the lock.
            unsafe { (*self.raw.as_ptr()).qp = std::ptr::null_mut() };
        }
        ret
    }
}
