//! Queue pair attributes, typed: a general [`QueuePair::modify`] over [`ModifyQp`] (the state
//! machine and the attribute masks checked before `ibv_modify_qp()` is called), and
//! [`QueuePair::query`] (`ibv_query_qp()`) into [`QpAttributes`], with the timers as
//! [`Duration`]s.
//!
//! # Timers
//!
//! The local ACK timeout is a code `n` meaning 4.096 µs × 2^n (0: no timeout). A [`Duration`]
//! is rounded **up** to the next such value (never a shorter wait than asked for):
//! [`ack_timeout_code`]. The RNR NAK timer is a code into the table of the InfiniBand
//! specification (`ibv_modify_qp(3)`: 1 = 0.01 ms ... 31 = 491.52 ms, 0 = 655.36 ms); a
//! [`Duration`] is rounded up to the next entry: [`rnr_timer_code`].
//!
//! # Compile-time transport typing
//!
//! The transport is checked at run time, not typed: [`QueuePair`] is one type for RC, UC, UD
//! and XRC, and an attribute that the transport does not take (a Q_Key on an RC queue pair, an
//! ACK timeout on UD) is refused by [`QueuePair::modify`] before the verb, naming the mask
//! ([`Error::QpAttribute`]). A type parameter would have to reach everything that holds a
//! queue pair (RDMA-CM, striped connections, pools, the async adaptor, split halves) for the
//! few attributes it would catch, while the common path — [`connect`](QueuePair::connect) and
//! [`activate_ud`](QueuePair::activate_ud) — never gets them wrong.

use std::time::Duration;

use ibverbs_sys as ffi;

use crate::attr::{Mtu, QpState};
use crate::connect::{ah_attr, ConnectOptions, Endpoint};
use crate::error::{cvt, Error, Result};
use crate::memory::AccessFlags;
use crate::queue::qp::{QpCaps, QpType, QueuePair};

use ffi::ibv_qp_attr_mask as M;

/// The RNR NAK timer's table, in microseconds, indexed by code (`ibv_modify_qp(3)`, the
/// InfiniBand specification's table 45): code 0 is the longest.
const RNR_TABLE_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120,
    7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680,
    491_520,
];

/// The local ACK timeout code of `timeout`: the smallest `n` in 1..=31 with
/// 4.096 µs × 2^n ≥ `timeout` (rounded up); `None` (no timeout: wait for ever) is code 0.
///
/// ```
/// use std::time::Duration;
/// use ibverbs::{ack_timeout_code, ack_timeout_duration};
/// assert_eq!(ack_timeout_code(Some(Duration::from_millis(67))).unwrap(), 14); // 67.1 ms
/// assert_eq!(ack_timeout_code(Some(Duration::from_millis(68))).unwrap(), 15); // rounded up
/// assert_eq!(ack_timeout_code(None).unwrap(), 0);
/// assert_eq!(ack_timeout_duration(14), Some(Duration::from_nanos(4096 << 14)));
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] above 4.096 µs × 2^31 (about 2.4 hours).
pub fn ack_timeout_code(timeout: Option<Duration>) -> Result<u8> {
    let Some(d) = timeout else { return Ok(0) };
    let ns = d.as_nanos();
    (1u8..=31).find(|&n| (4096u128 << n) >= ns).ok_or(Error::InvalidArgument {
        verb: "ibv_modify_qp",
        reason: "the ACK timeout is above 4.096 µs × 2^31 (about 2.4 hours)",
    })
}

/// What local ACK timeout code `code` means: 4.096 µs × 2^code, `None` for 0 (no timeout) and
/// for codes above 31 (not a timeout).
pub fn ack_timeout_duration(code: u8) -> Option<Duration> {
    (1..=31).contains(&code).then(|| Duration::from_nanos(4096u64 << code))
}

/// The RNR NAK timer code of `timer`: the code of the smallest entry of the InfiniBand table
/// that is at least `timer` (rounded up; 0.01 ms ... 655.36 ms).
///
/// ```
/// use std::time::Duration;
/// use ibverbs::{rnr_timer_code, rnr_timer_duration};
/// assert_eq!(rnr_timer_code(Duration::from_micros(640)).unwrap(), 12);
/// assert_eq!(rnr_timer_code(Duration::from_micros(641)).unwrap(), 13); // 0.96 ms
/// assert_eq!(rnr_timer_code(Duration::from_millis(600)).unwrap(), 0); // 655.36 ms
/// assert_eq!(rnr_timer_duration(0), Some(Duration::from_micros(655_360)));
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] above 655.36 ms.
pub fn rnr_timer_code(timer: Duration) -> Result<u8> {
    let us = timer.as_nanos().div_ceil(1000);
    (1u8..=31).chain([0]).find(|&c| u128::from(RNR_TABLE_US[usize::from(c)]) >= us).ok_or(
        Error::InvalidArgument {
            verb: "ibv_modify_qp",
            reason: "the RNR timer is above 655.36 ms, the table's longest",
        },
    )
}

/// What RNR NAK timer code `code` means (`None` above 31).
pub fn rnr_timer_duration(code: u8) -> Option<Duration> {
    RNR_TABLE_US.get(usize::from(code)).map(|&us| Duration::from_micros(u64::from(us)))
}

/// The attribute names of `ibv_qp_attr_mask`, as the errors name them.
const NAMES: [(M, &str); 21] = [
    (M::IBV_QP_STATE, "IBV_QP_STATE"),
    (M::IBV_QP_CUR_STATE, "IBV_QP_CUR_STATE"),
    (M::IBV_QP_EN_SQD_ASYNC_NOTIFY, "IBV_QP_EN_SQD_ASYNC_NOTIFY"),
    (M::IBV_QP_ACCESS_FLAGS, "IBV_QP_ACCESS_FLAGS"),
    (M::IBV_QP_PKEY_INDEX, "IBV_QP_PKEY_INDEX"),
    (M::IBV_QP_PORT, "IBV_QP_PORT"),
    (M::IBV_QP_QKEY, "IBV_QP_QKEY"),
    (M::IBV_QP_AV, "IBV_QP_AV"),
    (M::IBV_QP_PATH_MTU, "IBV_QP_PATH_MTU"),
    (M::IBV_QP_TIMEOUT, "IBV_QP_TIMEOUT"),
    (M::IBV_QP_RETRY_CNT, "IBV_QP_RETRY_CNT"),
    (M::IBV_QP_RNR_RETRY, "IBV_QP_RNR_RETRY"),
    (M::IBV_QP_RQ_PSN, "IBV_QP_RQ_PSN"),
    (M::IBV_QP_MAX_QP_RD_ATOMIC, "IBV_QP_MAX_QP_RD_ATOMIC"),
    (M::IBV_QP_ALT_PATH, "IBV_QP_ALT_PATH"),
    (M::IBV_QP_MIN_RNR_TIMER, "IBV_QP_MIN_RNR_TIMER"),
    (M::IBV_QP_SQ_PSN, "IBV_QP_SQ_PSN"),
    (M::IBV_QP_MAX_DEST_RD_ATOMIC, "IBV_QP_MAX_DEST_RD_ATOMIC"),
    (M::IBV_QP_PATH_MIG_STATE, "IBV_QP_PATH_MIG_STATE"),
    (M::IBV_QP_DEST_QPN, "IBV_QP_DEST_QPN"),
    (M::IBV_QP_RATE_LIMIT, "IBV_QP_RATE_LIMIT"),
];

fn name_of(bit: u32) -> &'static str {
    NAMES.iter().find(|(m, _)| m.0 == bit).map_or("an unknown ibv_qp_attr_mask bit", |(_, n)| n)
}

/// The transport classes of the state machine's table.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Ud,
    Uc,
    Rc,
    XrcSend,
    XrcRecv,
}

impl Class {
    fn of(t: QpType) -> Option<Class> {
        Some(match t {
            QpType::UD => Class::Ud,
            QpType::UC => Class::Uc,
            QpType::RC => Class::Rc,
            QpType::XRC_SEND => Class::XrcSend,
            QpType::XRC_RECV => Class::XrcRecv,
            _ => return None,
        })
    }
}

const fn bits(ms: &[M]) -> u32 {
    let mut b = 0;
    let mut i = 0;
    while i < ms.len() {
        b |= ms[i].0;
        i += 1;
    }
    b
}

/// The attributes a transition requires and those it allows besides (the InfiniBand state
/// machine, as Linux's `ib_modify_qp_is_ok` has it), without `IBV_QP_STATE`; `None` when the
/// transition is not in the state machine. RESET and ERR targets are handled apart.
fn transition(from: QpState, to: QpState, c: Class) -> Option<(u32, u32)> {
    use Class::*;
    use QpState as S;
    let rc_like = matches!(c, Rc | XrcSend | XrcRecv);
    let init_attrs = match c {
        Ud => bits(&[M::IBV_QP_PKEY_INDEX, M::IBV_QP_PORT, M::IBV_QP_QKEY]),
        _ => bits(&[M::IBV_QP_PKEY_INDEX, M::IBV_QP_PORT, M::IBV_QP_ACCESS_FLAGS]),
    };
    // What RTR->RTS, RTS->RTS and SQD->RTS may change.
    let to_rts_opt = match c {
        Ud => bits(&[M::IBV_QP_CUR_STATE, M::IBV_QP_QKEY, M::IBV_QP_RATE_LIMIT]),
        Uc => {
            bits(&[M::IBV_QP_CUR_STATE, M::IBV_QP_ALT_PATH, M::IBV_QP_ACCESS_FLAGS, M::IBV_QP_PATH_MIG_STATE])
        }
        _ => bits(&[
            M::IBV_QP_CUR_STATE,
            M::IBV_QP_ALT_PATH,
            M::IBV_QP_ACCESS_FLAGS,
            M::IBV_QP_MIN_RNR_TIMER,
            M::IBV_QP_PATH_MIG_STATE,
            M::IBV_QP_RATE_LIMIT,
        ]),
    };
    Some(match (from, to) {
        (S::RESET, S::INIT) => (init_attrs, 0),
        (S::INIT, S::INIT) => (0, init_attrs),
        (S::INIT, S::RTR) => {
            let path = bits(&[M::IBV_QP_AV, M::IBV_QP_PATH_MTU, M::IBV_QP_DEST_QPN, M::IBV_QP_RQ_PSN]);
            match c {
                Ud => (0, bits(&[M::IBV_QP_PKEY_INDEX, M::IBV_QP_QKEY])),
                Uc | XrcSend => {
                    (path, bits(&[M::IBV_QP_ALT_PATH, M::IBV_QP_ACCESS_FLAGS, M::IBV_QP_PKEY_INDEX]))
                }
                _ => (
                    path | bits(&[M::IBV_QP_MAX_DEST_RD_ATOMIC, M::IBV_QP_MIN_RNR_TIMER]),
                    bits(&[M::IBV_QP_ALT_PATH, M::IBV_QP_ACCESS_FLAGS, M::IBV_QP_PKEY_INDEX]),
                ),
            }
        }
        (S::RTR, S::RTS) => match c {
            Ud | Uc => (M::IBV_QP_SQ_PSN.0, to_rts_opt),
            XrcRecv => (bits(&[M::IBV_QP_TIMEOUT, M::IBV_QP_SQ_PSN]), to_rts_opt),
            _ => (
                bits(&[
                    M::IBV_QP_TIMEOUT,
                    M::IBV_QP_RETRY_CNT,
                    M::IBV_QP_RNR_RETRY,
                    M::IBV_QP_SQ_PSN,
                    M::IBV_QP_MAX_QP_RD_ATOMIC,
                ]),
                to_rts_opt,
            ),
        },
        (S::RTS, S::RTS) | (S::SQD, S::RTS) => (0, to_rts_opt),
        (S::SQE, S::RTS) => match c {
            Ud => (0, bits(&[M::IBV_QP_CUR_STATE, M::IBV_QP_QKEY])),
            Uc => (0, bits(&[M::IBV_QP_CUR_STATE, M::IBV_QP_ACCESS_FLAGS])),
            _ => return None,
        },
        (S::RTS, S::SQD) => (0, M::IBV_QP_EN_SQD_ASYNC_NOTIFY.0),
        (S::SQD, S::SQD) => match c {
            Ud => (0, bits(&[M::IBV_QP_PKEY_INDEX, M::IBV_QP_QKEY])),
            Uc => (
                0,
                bits(&[
                    M::IBV_QP_AV,
                    M::IBV_QP_ALT_PATH,
                    M::IBV_QP_ACCESS_FLAGS,
                    M::IBV_QP_PKEY_INDEX,
                    M::IBV_QP_PATH_MIG_STATE,
                ]),
            ),
            _ if rc_like => (
                0,
                bits(&[
                    M::IBV_QP_PORT,
                    M::IBV_QP_AV,
                    M::IBV_QP_TIMEOUT,
                    M::IBV_QP_RETRY_CNT,
                    M::IBV_QP_RNR_RETRY,
                    M::IBV_QP_MAX_QP_RD_ATOMIC,
                    M::IBV_QP_MAX_DEST_RD_ATOMIC,
                    M::IBV_QP_ALT_PATH,
                    M::IBV_QP_ACCESS_FLAGS,
                    M::IBV_QP_PKEY_INDEX,
                    M::IBV_QP_MIN_RNR_TIMER,
                    M::IBV_QP_PATH_MIG_STATE,
                ]),
            ),
            _ => return None,
        },
        _ => return None,
    })
}

/// The path migration state of a queue pair (`enum ibv_mig_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathMigState {
    /// `IBV_MIG_MIGRATED`: no alternate path armed (or migration happened).
    Migrated,
    /// `IBV_MIG_REARM`: arming the alternate path.
    Rearm,
    /// `IBV_MIG_ARMED`: the alternate path is armed.
    Armed,
}

impl PathMigState {
    fn to_raw(self) -> ffi::ibv_mig_state {
        match self {
            PathMigState::Migrated => ffi::ibv_mig_state::IBV_MIG_MIGRATED,
            PathMigState::Rearm => ffi::ibv_mig_state::IBV_MIG_REARM,
            PathMigState::Armed => ffi::ibv_mig_state::IBV_MIG_ARMED,
        }
    }

    fn from_raw(raw: ffi::ibv_mig_state) -> PathMigState {
        match raw {
            ffi::ibv_mig_state::IBV_MIG_REARM => PathMigState::Rearm,
            ffi::ibv_mig_state::IBV_MIG_ARMED => PathMigState::Armed,
            _ => PathMigState::Migrated,
        }
    }
}

/// The capability [`QueuePair::modify`] names in [`Error::Unsupported`] for an alternate path
/// or a path migration state on a device without automatic path migration: one without
/// `IBV_DEVICE_AUTO_PATH_MIG`, iWARP, or SoftRoCE (rxe stores an alternate path but never
/// migrates to it).
pub const PATH_MIGRATION: &str = "alternate paths (automatic path migration)";

/// The capability [`QueuePair::modify`] names in [`Error::Unsupported`] for a rate limit on a
/// device without packet pacing (`packet_pacing_caps.qp_rate_limit_max` 0, e.g. rxe).
pub const RATE_LIMIT: &str = "a send rate limit (packet pacing)";

/// A typed `ibv_modify_qp()`: the target state and the attributes to set, for
/// [`QueuePair::modify`]. Each setter adds its attribute's mask bit; the state machine and the
/// masks are checked by `modify` before the verb.
///
/// ```no_run
/// # fn f(qp: &mut ibverbs::QueuePair) -> Result<(), ibverbs::Error> {
/// use std::time::Duration;
/// use ibverbs::{ModifyQp, QpState};
/// // In RTS: a shorter minimum RNR timer (RC), rounded up to the table's 1.28 ms.
/// qp.modify(&ModifyQp::to(QpState::RTS).min_rnr_timer(Duration::from_millis(1)))?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ModifyQp {
    to: QpState,
    attr: ffi::ibv_qp_attr,
    mask: u32,
    path: Option<(Endpoint, ConnectOptions)>,
    alt_path: Option<(Endpoint, ConnectOptions)>,
    /// The first setter's refusal, reported by `modify` ([`Error::InvalidArgument`]).
    error: Option<&'static str>,
}

impl std::fmt::Debug for ModifyQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = NAMES.iter().filter(|(m, _)| self.mask & m.0 != 0).map(|(_, n)| *n).collect();
        f.debug_struct("ModifyQp")
            .field("to", &self.to)
            .field("mask", &names)
            .field("error", &self.error)
            .finish()
    }
}

impl ModifyQp {
    /// A move to `state` (`IBV_QP_STATE`; the same state as now to change attributes only,
    /// e.g. RTS → RTS). Moves to RESET and ERR go through [`QueuePair::reset`] and
    /// [`QueuePair::set_error`], which `modify` calls for them.
    pub fn to(state: QpState) -> ModifyQp {
        ModifyQp {
            to: state,
            attr: ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state(state.0), ..Default::default() },
            mask: M::IBV_QP_STATE.0,
            path: None,
            alt_path: None,
            error: None,
        }
    }

    fn set(mut self, bit: M, f: impl FnOnce(&mut ffi::ibv_qp_attr)) -> Self {
        f(&mut self.attr);
        self.mask |= bit.0;
        self
    }

    fn fail(mut self, reason: &'static str) -> Self {
        self.error.get_or_insert(reason);
        self
    }

    /// The state the move starts from as the caller knows it (`IBV_QP_CUR_STATE`).
    pub fn cur_state(self, state: QpState) -> Self {
        self.set(M::IBV_QP_CUR_STATE, |a| a.cur_qp_state = ffi::ibv_qp_state(state.0))
    }
    /// The port (`IBV_QP_PORT`, from 1).
    pub fn port(self, port: u8) -> Self {
        if port == 0 {
            return self.fail("port numbers start at 1");
        }
        self.set(M::IBV_QP_PORT, |a| a.port_num = port)
    }
    /// The P_Key index (`IBV_QP_PKEY_INDEX`).
    pub fn pkey_index(self, index: u16) -> Self {
        self.set(M::IBV_QP_PKEY_INDEX, |a| a.pkey_index = index)
    }
    /// The remote access rights (`IBV_QP_ACCESS_FLAGS`; RC, UC).
    pub fn access(self, access: AccessFlags) -> Self {
        self.set(M::IBV_QP_ACCESS_FLAGS, |a| a.qp_access_flags = access.bits())
    }
    /// The Q_Key (`IBV_QP_QKEY`; UD).
    pub fn qkey(self, qkey: u32) -> Self {
        self.set(M::IBV_QP_QKEY, |a| a.qkey = qkey)
    }
    /// The path MTU (`IBV_QP_PATH_MTU`).
    pub fn path_mtu(self, mtu: Mtu) -> Self {
        if mtu.bytes().is_none() {
            return self.fail("path MTU is not one of the IB MTUs (Mtu::MTU_256..=Mtu::MTU_4096)");
        }
        self.set(M::IBV_QP_PATH_MTU, |a| a.path_mtu = ffi::ibv_mtu(mtu.0))
    }
    /// The remote QP number (`IBV_QP_DEST_QPN`, 24 bits).
    pub fn dest_qp_num(self, qpn: u32) -> Self {
        if qpn > 0x00ff_ffff {
            return self.fail("QP numbers are 24-bit values");
        }
        self.set(M::IBV_QP_DEST_QPN, |a| a.dest_qp_num = qpn)
    }
    /// The receive PSN (`IBV_QP_RQ_PSN`, 24 bits).
    pub fn rq_psn(self, psn: u32) -> Self {
        if psn > 0x00ff_ffff {
            return self.fail("PSNs are 24-bit values");
        }
        self.set(M::IBV_QP_RQ_PSN, |a| a.rq_psn = psn)
    }
    /// The send PSN (`IBV_QP_SQ_PSN`, 24 bits).
    pub fn sq_psn(self, psn: u32) -> Self {
        if psn > 0x00ff_ffff {
            return self.fail("PSNs are 24-bit values");
        }
        self.set(M::IBV_QP_SQ_PSN, |a| a.sq_psn = psn)
    }
    /// The primary path to `remote` (`IBV_QP_AV`): its address vector from `opts` (port, GID
    /// index, service level, ...) as [`QueuePair::connect`] builds it, at `modify`.
    pub fn address(mut self, remote: &Endpoint, opts: &ConnectOptions) -> Self {
        self.path = Some((*remote, opts.clone()));
        self.mask |= M::IBV_QP_AV.0;
        self
    }
    /// The alternate path (`IBV_QP_ALT_PATH`), on its port `opts.port`, with the local ACK
    /// timeout `opts.timeout`. Devices without automatic path migration (rxe, iWARP) refuse it
    /// ([`Error::Unsupported`], capability [`PATH_MIGRATION`]).
    pub fn alternate_path(mut self, remote: &Endpoint, opts: &ConnectOptions) -> Self {
        self.alt_path = Some((*remote, opts.clone()));
        self.mask |= M::IBV_QP_ALT_PATH.0;
        self
    }
    /// The path migration state (`IBV_QP_PATH_MIG_STATE`; refused as
    /// [`alternate_path`](Self::alternate_path) is where there is no path migration).
    pub fn path_mig_state(self, state: PathMigState) -> Self {
        self.set(M::IBV_QP_PATH_MIG_STATE, |a| a.path_mig_state = state.to_raw())
    }
    /// The local ACK timeout (`IBV_QP_TIMEOUT`; RC): `None` waits for ever, a duration is
    /// rounded up to 4.096 µs × 2^n ([`ack_timeout_code`]).
    pub fn ack_timeout(self, timeout: Option<Duration>) -> Self {
        match ack_timeout_code(timeout) {
            Ok(code) => self.set(M::IBV_QP_TIMEOUT, |a| a.timeout = code),
            Err(_) => self.fail("the ACK timeout is above 4.096 µs × 2^31 (about 2.4 hours)"),
        }
    }
    /// Transport retries before `RETRY_EXC_ERR` (`IBV_QP_RETRY_CNT`, 0..=7; RC). SoftRoCE
    /// treats 7 as "for ever" (see [`ConnectOptions`]).
    pub fn retry_cnt(self, count: u8) -> Self {
        if count > 7 {
            return self.fail("retry_cnt is 0..=7");
        }
        self.set(M::IBV_QP_RETRY_CNT, |a| a.retry_cnt = count)
    }
    /// Receiver-not-ready retries (`IBV_QP_RNR_RETRY`, 0..=7, 7 = for ever; RC).
    pub fn rnr_retry(self, count: u8) -> Self {
        if count > 7 {
            return self.fail("rnr_retry is 0..=7 (7: for ever)");
        }
        self.set(M::IBV_QP_RNR_RETRY, |a| a.rnr_retry = count)
    }
    /// The minimum RNR NAK timer this side asks senders to wait (`IBV_QP_MIN_RNR_TIMER`; RC),
    /// rounded up to the InfiniBand table ([`rnr_timer_code`]).
    pub fn min_rnr_timer(self, timer: Duration) -> Self {
        match rnr_timer_code(timer) {
            Ok(code) => self.set(M::IBV_QP_MIN_RNR_TIMER, |a| a.min_rnr_timer = code),
            Err(_) => self.fail("the RNR timer is above 655.36 ms, the table's longest"),
        }
    }
    /// Outstanding RDMA Reads and atomics this side initiates (`IBV_QP_MAX_QP_RD_ATOMIC`; RC).
    pub fn max_rd_atomic(self, n: u8) -> Self {
        self.set(M::IBV_QP_MAX_QP_RD_ATOMIC, |a| a.max_rd_atomic = n)
    }
    /// Outstanding RDMA Reads and atomics this side answers (`IBV_QP_MAX_DEST_RD_ATOMIC`; RC).
    pub fn max_dest_rd_atomic(self, n: u8) -> Self {
        self.set(M::IBV_QP_MAX_DEST_RD_ATOMIC, |a| a.max_dest_rd_atomic = n)
    }
    /// A send rate limit in kbit/s (`IBV_QP_RATE_LIMIT`; RC and UD, to or in RTS; 0: none), on
    /// devices with packet pacing; others refuse it ([`Error::Unsupported`], capability
    /// [`RATE_LIMIT`]); a rate outside `qp_rate_limit_min..=qp_rate_limit_max` is
    /// [`Error::InvalidArgument`].
    pub fn rate_limit(self, kbps: u32) -> Self {
        self.set(M::IBV_QP_RATE_LIMIT, |a| a.rate_limit = kbps)
    }
    /// On a move to SQD: ask for the `SQ_DRAINED` asynchronous event
    /// (`IBV_QP_EN_SQD_ASYNC_NOTIFY`).
    pub fn notify_sq_drained(self, notify: bool) -> Self {
        self.set(M::IBV_QP_EN_SQD_ASYNC_NOTIFY, |a| a.en_sqd_async_notify = u8::from(notify))
    }

    /// The `ibv_qp_attr_mask` bits set so far.
    pub fn mask(&self) -> u32 {
        self.mask
    }

    /// The local ACK timeout as its raw code (`IBV_QP_TIMEOUT`), for [`ConnectOptions::timeout`],
    /// which is one: set as it is, with no round trip through a [`Duration`] (0..=31 checked by
    /// [`ConnectOptions`]' validation before).
    pub(crate) fn ack_timeout_raw(self, code: u8) -> Self {
        self.set(M::IBV_QP_TIMEOUT, |a| a.timeout = code)
    }

    /// The minimum RNR NAK timer as its raw code (`IBV_QP_MIN_RNR_TIMER`), for
    /// [`ConnectOptions::min_rnr_timer`], set as it is.
    pub(crate) fn min_rnr_timer_raw(self, code: u8) -> Self {
        self.set(M::IBV_QP_MIN_RNR_TIMER, |a| a.min_rnr_timer = code)
    }

    /// The primary path as an address vector already built (`IBV_QP_AV`): `connect` builds it
    /// (and reports its errors) before the first transition, where [`address`](Self::address)
    /// would build it only at the RTR move.
    pub(crate) fn address_raw(mut self, av: ffi::ibv_ah_attr) -> Self {
        self.path = None;
        self.set(M::IBV_QP_AV, |a| a.ah_attr = av)
    }

    /// The first setter's refusal, as [`QueuePair::modify`] reports it.
    fn check_values(&self) -> Result<()> {
        match self.error {
            Some(reason) => Err(Error::InvalidArgument { verb: "ibv_modify_qp", reason }),
            None => Ok(()),
        }
    }
}

/// Checks `m` as a move from `from` on a queue pair of type `t`, before the verb: the values its
/// setters were given, that the move is in the state machine for the transport, that every
/// attribute it requires is set and none it does not take is. Moves to RESET and ERR are not in
/// the table (`modify` hands them to `reset` and `set_error`).
fn check_move(from: QpState, t: QpType, m: &ModifyQp) -> Result<()> {
    const VERB: &str = "ibv_modify_qp";
    m.check_values()?;
    let extra = m.mask & !M::IBV_QP_STATE.0;
    let Some(class) = Class::of(t) else {
        return Err(Error::InvalidArgument {
            verb: VERB,
            reason: "no state machine known for this queue pair type",
        });
    };
    let Some((required, optional)) = transition(from, m.to, class) else {
        return Err(Error::QpAttribute {
            verb: VERB,
            from,
            to: m.to,
            attribute: "IBV_QP_STATE",
            problem: "is a move the queue pair state machine does not have",
        });
    };
    let missing = required & !extra;
    if missing != 0 {
        return Err(attr_error(
            from,
            m.to,
            missing & missing.wrapping_neg(),
            "is required by this move for this transport",
        ));
    }
    let stray = extra & !(required | optional);
    if stray != 0 {
        return Err(attr_error(
            from,
            m.to,
            stray & stray.wrapping_neg(),
            "is not taken by this move for this transport",
        ));
    }
    Ok(())
}

fn attr_error(from: QpState, to: QpState, bit: u32, problem: &'static str) -> Error {
    Error::QpAttribute { verb: "ibv_modify_qp", from, to, attribute: name_of(bit), problem }
}

/// A queue pair's attributes as the device reports them ([`QueuePair::query`],
/// `ibv_query_qp()`), timers as durations.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpAttributes {
    /// The current state (`qp_state`).
    pub state: QpState,
    /// The path MTU (`path_mtu`).
    pub path_mtu: Mtu,
    /// The path migration state (`path_mig_state`).
    pub path_mig_state: PathMigState,
    /// The Q_Key (`qkey`; UD).
    pub qkey: u32,
    /// The receive PSN (`rq_psn`).
    pub rq_psn: u32,
    /// The send PSN (`sq_psn`).
    pub sq_psn: u32,
    /// The remote QP number (`dest_qp_num`).
    pub dest_qp_num: u32,
    /// The remote access rights (`qp_access_flags`).
    pub access: AccessFlags,
    /// The capacities (`cap`).
    pub caps: QpCaps,
    /// The P_Key index (`pkey_index`).
    pub pkey_index: u16,
    /// The port (`port_num`).
    pub port: u8,
    /// Whether the send queue is draining (`sq_draining`, in SQD).
    pub sq_draining: bool,
    /// Outstanding RDMA Reads/atomics initiated (`max_rd_atomic`).
    pub max_rd_atomic: u8,
    /// Outstanding RDMA Reads/atomics answered (`max_dest_rd_atomic`).
    pub max_dest_rd_atomic: u8,
    /// The minimum RNR NAK timer (`min_rnr_timer`, decoded from the table).
    pub min_rnr_timer: Duration,
    /// The raw `min_rnr_timer` code.
    pub min_rnr_timer_code: u8,
    /// The local ACK timeout (`timeout`): `None` for none (code 0).
    pub ack_timeout: Option<Duration>,
    /// The raw `timeout` code.
    pub ack_timeout_code: u8,
    /// Transport retries (`retry_cnt`).
    pub retry_cnt: u8,
    /// RNR retries (`rnr_retry`; 7 = for ever).
    pub rnr_retry: u8,
    /// The service level of the primary path (`ah_attr.sl`).
    pub sl: u8,
}

impl QueuePair {
    /// Queries the device for the queue pair's attributes (`ibv_query_qp()` with every
    /// attribute): state, PSNs, Q_Key, path MTU, timers as durations, retry counts, ...
    ///
    /// siw does not report the state (it reads RESET; see
    /// [`refresh_state`](Self::refresh_state)).
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails.
    #[doc(alias = "ibv_query_qp")]
    pub fn query(&self) -> Result<QpAttributes> {
        let mut attr = ffi::ibv_qp_attr::default();
        let mut init = ffi::ibv_qp_init_attr::default();
        let all = NAMES.iter().fold(0u32, |b, (m, _)| b | m.0) & !M::IBV_QP_RATE_LIMIT.0;
        // SAFETY: valid QP and out-pointers.
        let ret = unsafe { ffi::ibv_query_qp(self.raw.as_ptr(), &mut attr, all as i32, &mut init) };
        cvt("ibv_query_qp", ret)?;
        let min_rnr = attr.min_rnr_timer;
        Ok(QpAttributes {
            state: QpState(attr.qp_state.0),
            path_mtu: Mtu(attr.path_mtu.0),
            path_mig_state: PathMigState::from_raw(attr.path_mig_state),
            qkey: attr.qkey,
            rq_psn: attr.rq_psn,
            sq_psn: attr.sq_psn,
            dest_qp_num: attr.dest_qp_num,
            access: AccessFlags::from_bits_truncate(attr.qp_access_flags),
            caps: QpCaps {
                max_send_wr: attr.cap.max_send_wr,
                max_recv_wr: attr.cap.max_recv_wr,
                max_send_sge: attr.cap.max_send_sge,
                max_recv_sge: attr.cap.max_recv_sge,
                max_inline_data: attr.cap.max_inline_data,
            },
            pkey_index: attr.pkey_index,
            port: attr.port_num,
            sq_draining: attr.sq_draining != 0,
            max_rd_atomic: attr.max_rd_atomic,
            max_dest_rd_atomic: attr.max_dest_rd_atomic,
            min_rnr_timer: rnr_timer_duration(min_rnr).unwrap_or_default(),
            min_rnr_timer_code: min_rnr,
            ack_timeout: ack_timeout_duration(attr.timeout),
            ack_timeout_code: attr.timeout,
            retry_cnt: attr.retry_cnt,
            rnr_retry: attr.rnr_retry,
            sl: attr.ah_attr.sl,
        })
    }

    /// A typed `ibv_modify_qp()`: moves the queue pair to `m`'s state with `m`'s attributes,
    /// after checking, before the verb, that the move is in the state machine from the state
    /// this handle knows ([`state`](Self::state)), that every attribute the move requires for
    /// this transport is set, and that none it does not take is (the error names the mask bit).
    /// Moves to RESET and ERR take no attribute and are [`reset`](Self::reset) and
    /// [`set_error`](Self::set_error).
    ///
    /// Send requests are posted at the safe level in RTS (and ERR, which flushes them): in SQD
    /// (a send-queue drain, [`drain_send_queue`](Self::drain_send_queue)) posts are refused
    /// until the queue pair is back in RTS.
    ///
    /// # Errors
    /// [`Error::QpAttribute`] for a move not in the state machine (naming `IBV_QP_STATE`), a
    /// required attribute missing or one not allowed (naming its mask bit);
    /// [`Error::InvalidArgument`] for a value out of range (the first setter's) or a queue pair
    /// type the table does not cover; [`Error::Unsupported`] for an alternate path or path
    /// migration state where the device has no path migration (capability
    /// [`PATH_MIGRATION`]: rxe, iWARP), a rate limit where it has no packet pacing (capability
    /// [`RATE_LIMIT`]), or any move on iWARP, whose queue pairs RDMA-CM drives (capability
    /// [`IWARP_MANUAL_CONNECT`](crate::IWARP_MANUAL_CONNECT)); [`Error::CmManaged`] for a queue
    /// pair on an RDMA-CM id; [`Error::Verb`] when the device refuses the move (the state is
    /// then unchanged).
    #[doc(alias = "ibv_modify_qp")]
    pub fn modify(&mut self, m: &ModifyQp) -> Result<()> {
        const VERB: &str = "ibv_modify_qp";
        self.check_not_cm()?;
        // Before the RESET/ERR hand-off: a bad value is refused whatever the target.
        m.check_values()?;
        let extra = m.mask & !M::IBV_QP_STATE.0;
        if m.to == QpState::RESET || m.to == QpState::ERR {
            if extra != 0 {
                return Err(attr_error(
                    self.state,
                    m.to,
                    extra & extra.wrapping_neg(),
                    "is not taken by a move to RESET or ERR",
                ));
            }
            return if m.to == QpState::RESET { self.reset() } else { self.set_error() };
        }
        if self.context().is_iwarp() {
            return Err(Error::Unsupported {
                verb: VERB,
                capability: crate::queue::qp::state::IWARP_MANUAL_CONNECT,
            });
        }
        self.modify_checked(m)
    }

    /// The checked path under [`modify`](Self::modify) and the moves of
    /// [`connect`](Self::connect), [`init`](Self::init) and [`activate_ud`](Self::activate_ud)
    /// (which make their own RDMA-CM, iWARP and state checks first): `m` checked against the
    /// state machine and the masks for this transport ([`check_move`]), the device's path
    /// migration and packet pacing where asked for, the address vectors built, then
    /// `ibv_modify_qp()` with `m`'s attributes and mask.
    pub(super) fn modify_checked(&mut self, m: &ModifyQp) -> Result<()> {
        const VERB: &str = "ibv_modify_qp";
        check_move(self.state, self.qp_type, m)?;
        let mut attr = m.attr;
        let ctx = self.context();
        if m.mask & (M::IBV_QP_ALT_PATH.0 | M::IBV_QP_PATH_MIG_STATE.0) != 0 {
            let dev = ctx.query_device()?;
            let apm = dev.0.device_cap_flags & ffi::ibv_device_cap_flags::IBV_DEVICE_AUTO_PATH_MIG.0 != 0;
            if !apm || dev.vendor_id() == crate::quirks::RXE_VENDOR_ID {
                return Err(Error::Unsupported { verb: VERB, capability: PATH_MIGRATION });
            }
        }
        if m.mask & M::IBV_QP_RATE_LIMIT.0 != 0 {
            let ex = ctx.query_device_ex()?;
            let pp = ex.0.packet_pacing_caps;
            if pp.qp_rate_limit_max == 0 {
                return Err(Error::Unsupported { verb: VERB, capability: RATE_LIMIT });
            }
            let r = attr.rate_limit;
            if r != 0 && (r < pp.qp_rate_limit_min || r > pp.qp_rate_limit_max) {
                return Err(Error::InvalidArgument {
                    verb: VERB,
                    reason: "the rate limit is outside the device's qp_rate_limit_min..=qp_rate_limit_max",
                });
            }
        }
        if let Some((remote, opts)) = &m.path {
            opts.validate(VERB)?;
            attr.ah_attr = ah_attr(&ctx, remote, opts, VERB)?;
        }
        if let Some((remote, opts)) = &m.alt_path {
            opts.validate(VERB)?;
            attr.alt_ah_attr = ah_attr(&ctx, remote, opts, VERB)?;
            attr.alt_port_num = opts.port;
            attr.alt_pkey_index = opts.pkey_index;
            attr.alt_timeout = opts.timeout;
        }
        self.modify_raw(&mut attr, ffi::ibv_qp_attr_mask(m.mask))
    }

    /// RTS → SQD (`ibv_modify_qp()`): the device finishes the send requests under way and
    /// starts no new one; with `notify`, an `SQ_DRAINED` asynchronous event says when it is
    /// done ([`QpAttributes::sq_draining`] tells too). Safe posts of sends are refused in SQD.
    /// [`resume_send_queue`](Self::resume_send_queue) goes back to RTS.
    ///
    /// # Errors
    /// As [`modify`](Self::modify).
    #[doc(alias = "ibv_modify_qp")]
    #[doc(alias = "IBV_QPS_SQD")]
    pub fn drain_send_queue(&mut self, notify: bool) -> Result<()> {
        self.modify(&ModifyQp::to(QpState::SQD).notify_sq_drained(notify))
    }

    /// SQD → RTS (`ibv_modify_qp()`): sends are processed (and may be posted) again.
    ///
    /// # Errors
    /// As [`modify`](Self::modify).
    #[doc(alias = "ibv_modify_qp")]
    pub fn resume_send_queue(&mut self) -> Result<()> {
        self.modify(&ModifyQp::to(QpState::RTS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_timeouts_round_up_to_the_next_power_of_two_of_4096_ns() {
        assert_eq!(ack_timeout_code(Some(Duration::ZERO)).unwrap(), 1);
        assert_eq!(ack_timeout_code(Some(Duration::from_nanos(8192))).unwrap(), 1);
        assert_eq!(ack_timeout_code(Some(Duration::from_nanos(8193))).unwrap(), 2);
        assert_eq!(ack_timeout_code(Some(Duration::from_nanos(4096 << 31))).unwrap(), 31);
        assert!(ack_timeout_code(Some(Duration::from_nanos((4096 << 31) + 1))).is_err());
        for code in 1..=31u8 {
            let d = ack_timeout_duration(code).unwrap();
            assert_eq!(ack_timeout_code(Some(d)).unwrap(), code, "a code's own duration maps back");
        }
        assert_eq!(ack_timeout_duration(0), None);
        assert_eq!(ack_timeout_duration(32), None);
    }

    #[test]
    fn rnr_timers_round_up_along_the_table() {
        for code in 0..=31u8 {
            let d = rnr_timer_duration(code).unwrap();
            assert_eq!(rnr_timer_code(d).unwrap(), code);
        }
        assert_eq!(rnr_timer_code(Duration::ZERO).unwrap(), 1);
        assert_eq!(rnr_timer_code(Duration::from_nanos(10_001)).unwrap(), 2);
        assert_eq!(rnr_timer_code(Duration::from_micros(491_521)).unwrap(), 0);
        assert!(rnr_timer_code(Duration::from_micros(655_361)).is_err());
        // Codes 1..=31 grow; 0 is above them all.
        assert!(RNR_TABLE_US[1..].windows(2).all(|w| w[0] < w[1]));
        assert!(RNR_TABLE_US[0] > RNR_TABLE_US[31]);
    }

    #[test]
    fn the_state_machine_names_what_is_missing_or_stray() {
        use QpState as S;
        let rc = Class::Rc;
        assert!(transition(S::RESET, S::RTS, rc).is_none());
        assert!(transition(S::RTR, S::RTR, rc).is_none());
        let (req, opt) = transition(S::RESET, S::INIT, Class::Ud).unwrap();
        assert_eq!(req & M::IBV_QP_QKEY.0, M::IBV_QP_QKEY.0);
        assert_eq!(opt, 0);
        let (req, _) = transition(S::RTR, S::RTS, rc).unwrap();
        assert_eq!(name_of(req & req.wrapping_neg()), "IBV_QP_TIMEOUT");
        let (req, opt) = transition(S::RTR, S::RTS, Class::Ud).unwrap();
        assert_eq!(req, M::IBV_QP_SQ_PSN.0);
        assert_eq!(opt & M::IBV_QP_TIMEOUT.0, 0, "UD takes no ACK timeout");
        let (_, opt) = transition(S::RTS, S::SQD, Class::Uc).unwrap();
        assert_eq!(opt, M::IBV_QP_EN_SQD_ASYNC_NOTIFY.0);
        assert!(transition(S::SQE, S::RTS, rc).is_none(), "RC has no SQE");
        assert_eq!(NAMES.iter().fold(0, |b, (m, _)| b | m.0).count_ones(), NAMES.len() as u32);
    }

    #[test]
    fn raw_timer_codes_set_what_their_durations_set() {
        for code in 0..=31u8 {
            let raw = ModifyQp::to(QpState::RTS).ack_timeout_raw(code);
            let typed = ModifyQp::to(QpState::RTS).ack_timeout(ack_timeout_duration(code));
            assert_eq!((raw.attr.timeout, raw.mask), (code, typed.mask));
            assert_eq!(typed.attr.timeout, code, "ACK timeout code {code} round-trips");
            let raw = ModifyQp::to(QpState::RTR).min_rnr_timer_raw(code);
            let typed = ModifyQp::to(QpState::RTR).min_rnr_timer(rnr_timer_duration(code).unwrap());
            assert_eq!((raw.attr.min_rnr_timer, raw.mask), (code, typed.mask));
            assert_eq!(typed.attr.min_rnr_timer, code, "RNR timer code {code} round-trips");
        }
    }

    /// `connect`, `init` and `activate_ud` build their moves as `ModifyQp`s: for every transport,
    /// the attributes and masks that reach `ibv_modify_qp()` are those the raw `ibv_qp_attr`s
    /// carried before, and each move passes the checks `modify` makes.
    #[test]
    fn connect_moves_carry_the_masks_they_always_had_and_pass_the_checks() {
        use super::super::state::{init_move, rtr_move, rts_move};
        use crate::attr::Gid;
        use QpState as S;
        let opts = ConnectOptions {
            timeout: 17,
            min_rnr_timer: 9,
            retry_cnt: 6,
            rnr_retry: 5,
            qkey: 0x1234_5678,
            pkey_index: 3,
            port: 2,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            ..ConnectOptions::default()
        };
        let remote =
            Endpoint { qpn: 0x00ab_cdef, psn: 0x0012_3456, lid: 7, gid: Gid::default(), mtu: Mtu::MTU_1024 };
        let av = ffi::ibv_ah_attr { dlid: 7, sl: 2, port_num: 2, ..Default::default() };
        let state = M::IBV_QP_STATE;
        let path = state | M::IBV_QP_AV | M::IBV_QP_PATH_MTU | M::IBV_QP_DEST_QPN | M::IBV_QP_RQ_PSN;
        let requester =
            M::IBV_QP_TIMEOUT | M::IBV_QP_RETRY_CNT | M::IBV_QP_RNR_RETRY | M::IBV_QP_MAX_QP_RD_ATOMIC;
        for t in [QpType::RC, QpType::UC, QpType::UD, QpType::XRC_SEND, QpType::XRC_RECV] {
            let init = init_move(t, &opts);
            let (a, ud) = (&init.attr, t == QpType::UD);
            assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_INIT);
            assert_eq!((a.pkey_index, a.port_num), (3, 2));
            let rest = if ud { M::IBV_QP_QKEY } else { M::IBV_QP_ACCESS_FLAGS };
            assert_eq!(init.mask, (state | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | rest).0, "{t:?}");
            match t {
                QpType::UD => assert_eq!(a.qkey, 0x1234_5678),
                QpType::UC => {
                    assert_eq!(
                        a.qp_access_flags,
                        (AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).bits()
                    )
                }
                _ => assert_eq!(a.qp_access_flags, opts.access.bits()),
            }
            check_move(S::RESET, t, &init).unwrap();
            if ud {
                // activate_ud's moves.
                let rtr = ModifyQp::to(S::RTR);
                assert_eq!(rtr.mask, state.0);
                check_move(S::INIT, t, &rtr).unwrap();
                let rts = ModifyQp::to(S::RTS).sq_psn(0x00ff_fffe);
                assert_eq!((rts.mask, rts.attr.sq_psn), ((state | M::IBV_QP_SQ_PSN).0, 0x00ff_fffe));
                check_move(S::RTR, t, &rts).unwrap();
                continue;
            }
            let rtr = rtr_move(t, &remote, &opts, av, Mtu::MTU_1024, 4);
            let a = &rtr.attr;
            assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_RTR);
            assert_eq!(
                (a.path_mtu, a.dest_qp_num, a.rq_psn),
                (ffi::ibv_mtu(Mtu::MTU_1024.0), 0x00ab_cdef, 0x0012_3456)
            );
            assert_eq!((a.ah_attr.dlid, a.ah_attr.sl, a.ah_attr.port_num), (7, 2, 2));
            let responder = t == QpType::RC || t == QpType::XRC_RECV;
            if responder {
                assert_eq!(
                    rtr.mask,
                    (path | M::IBV_QP_MAX_DEST_RD_ATOMIC | M::IBV_QP_MIN_RNR_TIMER).0,
                    "{t:?}"
                );
                assert_eq!((a.max_dest_rd_atomic, a.min_rnr_timer), (4, 9));
            } else {
                assert_eq!(rtr.mask, path.0, "{t:?}");
            }
            check_move(S::INIT, t, &rtr).unwrap();
            let rts = rts_move(t, &opts, 0x0000_0042, 4);
            let a = &rts.attr;
            assert_eq!((a.qp_state, a.sq_psn), (ffi::ibv_qp_state::IBV_QPS_RTS, 0x42));
            let expected = match t {
                QpType::XRC_RECV => state | M::IBV_QP_SQ_PSN | M::IBV_QP_TIMEOUT,
                QpType::RC | QpType::XRC_SEND => state | M::IBV_QP_SQ_PSN | requester,
                _ => state | M::IBV_QP_SQ_PSN,
            };
            assert_eq!(rts.mask, expected.0, "{t:?}");
            if rts.mask & M::IBV_QP_TIMEOUT.0 != 0 {
                assert_eq!(a.timeout, 17);
            }
            if rts.mask & M::IBV_QP_RETRY_CNT.0 != 0 {
                assert_eq!((a.retry_cnt, a.rnr_retry, a.max_rd_atomic), (6, 5, 4));
            }
            check_move(S::RTR, t, &rts).unwrap();
        }
    }

    #[test]
    fn setters_record_their_mask_and_the_first_bad_value() {
        let m = ModifyQp::to(QpState::RTS).retry_cnt(3).sq_psn(5).ack_timeout(Some(Duration::from_millis(1)));
        assert_eq!(
            m.mask(),
            (M::IBV_QP_STATE | M::IBV_QP_RETRY_CNT | M::IBV_QP_SQ_PSN | M::IBV_QP_TIMEOUT).0
        );
        assert_eq!(m.attr.timeout, 8); // 4.096 µs × 2^8 = 1.05 ms
        let m = ModifyQp::to(QpState::RTS).retry_cnt(8).sq_psn(1 << 24);
        assert_eq!(m.error, Some("retry_cnt is 0..=7"));
    }
}
