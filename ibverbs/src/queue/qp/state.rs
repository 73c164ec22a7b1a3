//! Connection setup of a queue pair: the state transitions RESET → INIT → RTR → RTS, error and
//! reset.

use ibverbs_sys as ffi;

use crate::attr::Gid;
use crate::attr::{Mtu, QpState};
use crate::connect::{ah_attr, gid_index, ConnectOptions, Endpoint};
use crate::error::{Error, Result};
use crate::memory::AccessFlags;
use crate::post::engine::{register_rings, register_send_ring};
use crate::queue::qp::{random_psn, ModifyQp, QpType, QueuePair};

/// The capability [`QueuePair::connect`] names in [`Error::Unsupported`] on an iWARP device: a
/// queue pair moved to RTR/RTS by hand (`ibv_modify_qp()`); iWARP connects through RDMA-CM
/// ([`crate::cm`]).
pub const IWARP_MANUAL_CONNECT: &str = "manual RTR/RTS on iWARP (connect through RDMA-CM: ibverbs::cm)";

/// The capability [`QueuePair::reset`] names in [`Error::Unsupported`] on an iWARP device: its
/// queue pairs are reused through RDMA-CM, and siw (Linux 6.1) accepts RESET but ignores it,
/// keeping what was posted.
pub const IWARP_RESET: &str = "RESET on iWARP (siw ignores it; use a new RDMA-CM id and queue pair)";

/// [`QueuePair::init`]'s move, RESET → INIT for a queue pair of type `t`: port and P_Key index,
/// with the Q_Key (UD) or the access rights (UC: the write rights only, the rest being refused
/// there).
pub(super) fn init_move(t: QpType, opts: &ConnectOptions) -> ModifyQp {
    let m = ModifyQp::to(QpState::INIT).pkey_index(opts.pkey_index).port(opts.port);
    if t == QpType::UD {
        return m.qkey(opts.qkey);
    }
    let mut access = opts.access;
    if t == QpType::UC {
        access &= AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    }
    m.access(access)
}

/// [`QueuePair::connect`]'s INIT → RTR for a queue pair of type `t`: the path to `remote` (`av`,
/// built before the first move), path MTU, remote QPN and PSN, and for RC and XRC targets the
/// responder's attributes (the kernel refuses them elsewhere), `min_rnr_timer` as
/// [`ConnectOptions`]' raw code.
pub(super) fn rtr_move(
    t: QpType,
    remote: &Endpoint,
    opts: &ConnectOptions,
    av: ffi::ibv_ah_attr,
    mtu: Mtu,
    rd_atomic: u8,
) -> ModifyQp {
    let m =
        ModifyQp::to(QpState::RTR).address_raw(av).path_mtu(mtu).dest_qp_num(remote.qpn).rq_psn(remote.psn);
    if t == QpType::RC || t == QpType::XRC_RECV {
        return m.max_dest_rd_atomic(rd_atomic).min_rnr_timer_raw(opts.min_rnr_timer);
    }
    m
}

/// [`QueuePair::connect`]'s RTR → RTS for a queue pair of type `t`: the send PSN `sq_psn`, the
/// ACK timeout (raw code) on XRC targets, and for RC and XRC initiators the requester's
/// attributes.
pub(super) fn rts_move(t: QpType, opts: &ConnectOptions, sq_psn: u32, rd_atomic: u8) -> ModifyQp {
    let m = ModifyQp::to(QpState::RTS).sq_psn(sq_psn);
    if t == QpType::XRC_RECV {
        return m.ack_timeout_raw(opts.timeout);
    }
    if t == QpType::RC || t == QpType::XRC_SEND {
        return m
            .ack_timeout_raw(opts.timeout)
            .retry_cnt(opts.retry_cnt)
            .rnr_retry(opts.rnr_retry)
            .max_rd_atomic(rd_atomic);
    }
    m
}

impl QueuePair {
    /// This QP's connection details for a peer, on `opts.port` with `opts`' GID choice.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for port 0 or out-of-range options; [`Error::Verb`] for a port
    /// the device does not have (`ibv_query_port()`); [`Error::GidQuery`] for a GID index whose
    /// entry cannot be read (naming the port and index);
    /// [`Error::Unsupported`] (capability [`IWARP_MANUAL_CONNECT`]) on an iWARP device, whose
    /// queue pairs connect through RDMA-CM ([`crate::cm`]), not by exchanging endpoints.
    pub fn endpoint(&self, opts: &ConnectOptions) -> Result<Endpoint> {
        self.check_not_iwarp()?;
        let ctx = self.context();
        let port = ctx.query_port(opts.port)?;
        let gid = match gid_index(&ctx, opts, port.link_layer())? {
            Some(i) => ctx.query_gid(opts.port, i)?.gid,
            None => Gid::default(),
        };
        opts.validate("ibv_modify_qp")?;
        Ok(Endpoint {
            qpn: self.qp_num(),
            psn: self.send_psn(opts),
            lid: port.lid(),
            gid,
            mtu: port.active_mtu(),
        })
    }

    /// The first send PSN for `opts`: theirs, or this QP's.
    fn send_psn(&self, opts: &ConnectOptions) -> u32 {
        opts.psn.unwrap_or(self.psn) & 0x00ff_ffff
    }

    /// Refuses a hand-driven connection on an iWARP device: iWARP queue pairs reach RTR/RTS only
    /// through RDMA-CM (the kernel ties them to a TCP connection), and siw would fail late or
    /// leave the QP half-moved.
    fn check_not_iwarp(&self) -> Result<()> {
        if self.context().is_iwarp() {
            return Err(Error::Unsupported { verb: "ibv_modify_qp", capability: IWARP_MANUAL_CONNECT });
        }
        Ok(())
    }

    /// Refuses any state but RESET and INIT (where `connect` and `activate_ud` start).
    fn check_reset_or_init(&self) -> Result<()> {
        if self.state != QpState::RESET && self.state != QpState::INIT {
            return Err(Error::QpState {
                verb: "ibv_modify_qp",
                state: self.state,
                expected: "RESET or INIT",
            });
        }
        Ok(())
    }

    /// Brings a QP in RESET to INIT; refuses any state but RESET and INIT.
    fn reach_init(&mut self, opts: &ConnectOptions) -> Result<()> {
        self.check_reset_or_init()?;
        if self.state == QpState::RESET {
            self.init(opts)?;
        }
        Ok(())
    }

    /// RESET → INIT (`ibv_modify_qp()`): binds the QP to `opts.port`; receives may be posted
    /// from now on.
    ///
    /// # Errors
    /// [`Error::QpState`] unless the QP is in RESET; [`Error::InvalidArgument`] for port 0
    /// (`ibv_query_port()`); [`Error::Verb`] for a port the device does not have or a bad P_Key
    /// index; [`Error::CmManaged`] for a queue pair created on an RDMA-CM id.
    #[doc(alias = "ibv_modify_qp")]
    pub fn init(&mut self, opts: &ConnectOptions) -> Result<()> {
        self.check_not_cm()?;
        if self.state != QpState::RESET {
            return Err(Error::QpState { verb: "ibv_modify_qp", state: self.state, expected: "RESET" });
        }
        self.context().query_port(opts.port)?;
        self.modify_checked(&init_move(self.qp_type, opts))
    }

    /// Connects an RC or UC QP to `remote`: RESET → INIT (if needed) → RTR → RTS
    /// (`ibv_modify_qp()`), with path MTU the smaller of both ports' active MTUs (and
    /// `opts.mtu`), addressing by GID on RoCE and by LID on InfiniBand.
    ///
    /// # Errors
    /// [`Error::QpState`] unless the QP is in RESET or INIT; [`Error::InvalidArgument`] for a UD
    /// QP or out-of-range options (including a `max_rd_atomic` above the device's limits, a
    /// service level above 15 and, where the address has a GRH, a GID index above 255);
    /// [`Error::Verb`] for a port the device does not have, or when the device rejects a
    /// transition; [`Error::GidQuery`] for a GID index whose entry cannot be read;
    /// [`Error::CmManaged`] for a queue pair created on an RDMA-CM id;
    /// [`Error::Unsupported`] (capability [`IWARP_MANUAL_CONNECT`]) on an iWARP device (siw,
    /// see [`Context::is_iwarp`](crate::Context::is_iwarp)), whose queue pairs reach RTR and RTS
    /// only through RDMA-CM: create the QP on a [`CmId`](crate::cm::CmId) instead
    /// ([`crate::cm`]); nothing is changed. Options are checked before
    /// any transition, but if the device still refuses RTS after accepting RTR, the QP stays in
    /// RTR, where `connect` refuses to run again: [`reset`](Self::reset) it first.
    #[doc(alias = "ibv_modify_qp")]
    pub fn connect(&mut self, remote: &Endpoint, opts: &ConnectOptions) -> Result<()> {
        self.check_not_cm()?;
        self.check_not_iwarp()?;
        let bad = |reason| Err(Error::InvalidArgument { verb: "ibv_modify_qp", reason });
        if self.qp_type == QpType::UD {
            return bad("UD queue pairs are not connected: use activate_ud and address handles");
        }
        if remote.qpn > 0x00ff_ffff || remote.psn > 0x00ff_ffff {
            return bad("QPN and PSN are 24-bit values");
        }
        opts.validate("ibv_modify_qp")?;
        self.check_reset_or_init()?;
        // Everything that can fail without the device refusing a transition is worked out
        // before the first one (RESET -> INIT sets the access rights and port, which a second
        // `connect` from INIT would not set again).
        let ctx = self.context();
        let port = ctx.query_port(opts.port)?;
        let mut mtu = port.active_mtu();
        if remote.mtu.bytes().is_some() {
            mtu = mtu.min(remote.mtu);
        }
        if let Some(m) = opts.mtu {
            mtu = mtu.min(m);
        }
        let dev = ctx.query_device()?;
        let device_max = dev.max_qp_rd_atom().min(dev.max_qp_init_rd_atom());
        let rd_atomic = match opts.max_rd_atomic {
            // Checked before any transition: the device would refuse it only at RTS, leaving the
            // QP in RTR.
            Some(n) if u32::from(n) > device_max => {
                return Err(Error::InvalidArgument {
                    verb: "ibv_modify_qp",
                    reason: "max_rd_atomic is above the device's max_qp_rd_atom / max_qp_init_rd_atom",
                })
            }
            Some(n) => n,
            // At most 16 (as the C tools ask), and 0 where the device has no RDMA Read or
            // atomic resources (1 would be refused at RTS, after RTR was accepted).
            None => u8::try_from(device_max.min(16)).unwrap_or(16),
        };
        let av = ah_attr(&ctx, remote, opts, "ibv_modify_qp")?;
        self.reach_init(opts)?;
        self.modify_checked(&rtr_move(self.qp_type, remote, opts, av, mtu, rd_atomic))?;
        self.modify_checked(&rts_move(self.qp_type, opts, self.send_psn(opts), rd_atomic))
    }

    /// Brings a UD QP to RTS: RESET → INIT (if needed) → RTR → RTS (`ibv_modify_qp()`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a non-UD QP or out-of-range options (as
    /// [`connect`](Self::connect) checks them), [`Error::QpState`] unless in RESET or INIT,
    /// [`Error::Verb`] when the device rejects a transition; [`Error::CmManaged`] for a queue pair
    /// created on an RDMA-CM id.
    #[doc(alias = "ibv_modify_qp")]
    pub fn activate_ud(&mut self, opts: &ConnectOptions) -> Result<()> {
        self.check_not_cm()?;
        if self.qp_type != QpType::UD {
            return Err(Error::InvalidArgument {
                verb: "ibv_modify_qp",
                reason: "activate_ud is for UD queue pairs",
            });
        }
        opts.validate("ibv_modify_qp")?;
        self.reach_init(opts)?;
        self.modify_checked(&ModifyQp::to(QpState::RTR))?;
        self.modify_checked(&ModifyQp::to(QpState::RTS).sq_psn(self.send_psn(opts)))
    }

    /// Moves the QP to the error state (`ibv_modify_qp()`): outstanding requests complete with
    /// [`WcStatus::WR_FLUSH_ERR`](crate::WcStatus::WR_FLUSH_ERR), returning their buffers.
    ///
    /// # Errors
    /// [`Error::QpState`] for a QP left [`QpState::UNUSABLE`] by a failed reset; [`Error::Verb`]
    /// when the device rejects the transition.
    #[doc(alias = "ibv_modify_qp")]
    pub fn set_error(&mut self) -> Result<()> {
        if self.state == QpState::UNUSABLE {
            // Its rings are retired: a post in ERR would reach the device through them.
            return Err(Error::QpState {
                verb: "ibv_modify_qp",
                state: self.state,
                expected: "not UNUSABLE (reset it)",
            });
        }
        let mut attr = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_ERR, ..Default::default() };
        self.modify_raw(&mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE)
    }

    /// Resets the QP (`ibv_modify_qp()` to RESET) for reuse: requests still outstanding are
    /// dropped by the device without completions, so their buffers are released at the CQ's next
    /// poll, and the QP starts over with empty queues and a new PSN.
    ///
    /// # Errors
    /// [`Error::Verb`] when the device rejects the transition; [`Error::CqTooSmall`] or
    /// [`Error::TooManyQueuePairs`] if the fresh queues cannot be registered (the QP is then left
    /// [`QpState::UNUSABLE`], unable to post: poll its CQ dry and call `reset` again); [`Error::CmManaged`] for a queue pair created on an RDMA-CM id;
    /// [`Error::Unsupported`] (capability [`IWARP_RESET`]) on an iWARP device, where no queue
    /// pair made by hand can be connected (see [`connect`](Self::connect)), so none is worth
    /// resetting, and where siw's `ibv_modify_qp()` to RESET succeeds without changing anything:
    /// the receives posted stay queued in the device, and a QP in ERROR stays there.
    #[doc(alias = "ibv_modify_qp")]
    pub fn reset(&mut self) -> Result<()> {
        self.check_not_cm()?;
        if self.context().is_iwarp() {
            return Err(Error::Unsupported { verb: "ibv_modify_qp", capability: IWARP_RESET });
        }
        self.reset_unchecked()
    }

    /// [`reset`](Self::reset) without the RDMA-CM check (a scope's last resort: see
    /// [`QueuePair::scope`]). Once it returns with the QP in RESET or UNUSABLE, the device has
    /// forgotten every request.
    pub(crate) fn reset_unchecked(&mut self) -> Result<()> {
        let mut attr = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_RESET, ..Default::default() };
        self.modify_raw(&mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE)?;
        self.resets += 1;
        // The device has forgotten every request: retire the rings (their buffers go at the next
        // poll, their indices once the CQ is seen empty) and start with empty ones.
        let fresh = match (self.has_send, self.has_recv) {
            (true, true) => {
                self.send_cq.registry.retire(&self.send);
                self.recv_cq.registry.retire(&self.recv);
                register_rings(
                    &self.send_cq.registry,
                    &self.recv_cq.registry,
                    self.send.capacity(),
                    self.recv.capacity(),
                    "ibv_modify_qp",
                )
            }
            // No receive ring: receives belong to the SRQ (untouched by a reset), or to XRC SRQs.
            (true, false) => {
                self.send_cq.registry.retire(&self.send);
                register_send_ring(&self.send_cq.registry, self.send.capacity(), "ibv_modify_qp")
                    .map(|send| [send, self.recv.clone()])
            }
            (false, _) => Ok([self.send.clone(), self.recv.clone()]),
        };
        match fresh {
            Ok([send, recv]) => {
                self.send = send;
                self.recv = recv;
                self.psn = random_psn();
                Ok(())
            }
            Err(e) => {
                self.set_state(QpState::UNUSABLE); // every post checks the state
                Err(e)
            }
        }
    }
}
