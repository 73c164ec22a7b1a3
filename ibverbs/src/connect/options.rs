//! How to connect a queue pair: [`ConnectOptions`] and the address vector they imply.

use ibverbs_sys as ffi;

use crate::attr::{LinkLayer, Mtu};
use crate::connect::endpoint::Endpoint;
use crate::device::Context;
use crate::error::{Error, Result};
use crate::memory::AccessFlags;

/// How to connect a queue pair: port, addressing and transport parameters.
///
/// Defaults: port 1, the RoCE v2 IPv4 GID on Ethernet ports (none on InfiniBand), path MTU the
/// smaller of both ports' active MTUs, `timeout` 14 (≈ 67 ms), `retry_cnt` 6, `rnr_retry` 7
/// (infinite), `min_rnr_timer` 12, RDMA Read/atomic depth from the device (at most 16), all remote
/// access rights on the QP (the memory regions' own rights still apply), Q_Key `0x11111111` for UD.
///
/// # A dead peer ends in an error, never a hang
/// When the peer of an RC queue pair vanishes (its host dies, its link is cut), nothing answers:
/// each unacknowledged request is resent after the local ACK timeout, and after `retry_cnt`
/// resends the oldest outstanding work request completes with
/// [`WcStatus::RETRY_EXC_ERR`](crate::WcStatus) and the others with flush errors. The default
/// `retry_cnt` is **6, not the 7 of the C tools**: SoftRoCE (rxe, Linux 6.1) treats 7 as "retry
/// forever", so a caller who kept the default and whose peer died would wait forever there. With
/// the defaults, [`ConnectOptions::retry_budget`] is 7 × 67 ms ≈ 0.47 s; measured between two
/// hosts (two QEMU guests, rxe, `cargo xtask test`'s two-host stage) the first error came 337–607 ms
/// after the last successful completion when the link was cut for good, 446 ms when the peer's
/// host was killed (see the README's Testing section). Setting `retry_cnt` to 7 (or `timeout` to 0) asks for an
/// unbounded wait on some devices: `retry_budget` is then `None`.
///
/// Whatever the options, wait for completions with a deadline (poll with a time limit) when a
/// hang must be impossible: the budget bounds the transport's own retries, not a peer that is
/// alive but never posts a receive (`rnr_retry` 7) or never sends.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(default))]
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
    /// Service level, 0..=15 (a larger value is refused: providers would mask it).
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
    /// The first send PSN (24 bits) this side uses and advertises; `None`: the queue pair's own
    /// random one ([`QueuePair::psn`](crate::QueuePair::psn)).
    /// [`endpoint`](crate::QueuePair::endpoint) advertises it and
    /// [`connect`](crate::QueuePair::connect) starts from it, so pass the same options to both.
    pub psn: Option<u32>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            port: 1,
            gid_index: None,
            mtu: None,
            timeout: 14,
            retry_cnt: 6,
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
            psn: None,
        }
    }
}

impl ConnectOptions {
    /// The nominal time after which an RC request to a vanished peer fails: (`retry_cnt` + 1) local
    /// ACK timeouts of 4.096 µs × 2^`timeout` each. `None` when the wait may be unbounded: `timeout`
    /// 0 (no ACK timeout at all) or `retry_cnt` 7 (retry forever on SoftRoCE).
    ///
    /// Devices round the timer up (rxe to its timer ticks): allow about twice the budget plus a
    /// little scheduling slack before calling a missing error completion a hang.
    ///
    /// ```
    /// use ibverbs::ConnectOptions;
    /// use std::time::Duration;
    ///
    /// let budget = ConnectOptions::default().retry_budget().unwrap();
    /// assert!(budget > Duration::from_millis(450) && budget < Duration::from_millis(500));
    /// assert_eq!(ConnectOptions { retry_cnt: 7, ..Default::default() }.retry_budget(), None);
    /// ```
    pub fn retry_budget(&self) -> Option<std::time::Duration> {
        if self.timeout == 0 || self.retry_cnt >= 7 || self.timeout > 31 {
            return None;
        }
        let one_ns = 4096u64 << self.timeout; // 4.096 µs × 2^timeout, in ns (fits: 2^43 at most)
        Some(std::time::Duration::from_nanos(one_ns * (u64::from(self.retry_cnt) + 1)))
    }

    /// Checks the fields that go to the device as they are, for `verb` (named in the error).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first field out of range.
    pub(crate) fn validate(&self, verb: &'static str) -> Result<()> {
        let bad = |reason| Err(Error::InvalidArgument { verb, reason });
        if self.timeout > 31 || self.min_rnr_timer > 31 {
            return bad("timeout and min_rnr_timer are 0..=31");
        }
        if self.retry_cnt > 7 || self.rnr_retry > 7 {
            return bad("retry_cnt and rnr_retry are 0..=7");
        }
        if self.mtu.is_some_and(|m| m.bytes().is_none()) {
            return bad("mtu is not one of the IB MTUs (256..4096 bytes, Mtu::MTU_256..=Mtu::MTU_4096)");
        }
        if self.port == 0 {
            return bad("port numbers start at 1");
        }
        if self.psn.is_some_and(|p| p > 0x00ff_ffff) {
            return bad("psn is a 24-bit number (at most 0xffffff)");
        }
        if self.sl > 15 {
            // Providers mask it (mlx5: 4 bits on InfiniBand, 3 on RoCE): another service level.
            return bad("sl (service level) is 0..=15");
        }
        Ok(())
    }
}

/// Picks the local GID index for `opts` on a port: explicit, or the RoCE v2 IPv4 one on Ethernet.
pub(crate) fn gid_index(ctx: &Context, opts: &ConnectOptions, link_layer: LinkLayer) -> Result<Option<u32>> {
    match opts.gid_index {
        Some(i) => Ok(Some(i)),
        None if link_layer == LinkLayer::ETHERNET => ctx.roce_v2_ipv4_gid_index(opts.port).map(Some),
        None => Ok(None),
    }
}

/// The address vector towards `remote` (for RTR and address handles), for `verb` (named in the
/// errors).
pub(crate) fn ah_attr(
    ctx: &Context,
    remote: &Endpoint,
    opts: &ConnectOptions,
    verb: &'static str,
) -> Result<ffi::ibv_ah_attr> {
    let port = ctx.query_port(opts.port)?;
    let mut ah =
        ffi::ibv_ah_attr { dlid: remote.lid, sl: opts.sl, port_num: opts.port, ..Default::default() };
    let index = gid_index(ctx, opts, port.link_layer())?;
    let use_grh = port.link_layer() == LinkLayer::ETHERNET || (index.is_some() && !remote.gid.is_zero());
    if let (true, Some(index)) = (use_grh, index) {
        let sgid_index = u8::try_from(index)
            .map_err(|_| Error::InvalidArgument { verb, reason: "GID index above 255" })?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_documentation_and_validate() {
        let o = ConnectOptions::default();
        assert_eq!((o.port, o.timeout, o.retry_cnt, o.rnr_retry, o.min_rnr_timer), (1, 14, 6, 7, 12));
        assert!(o.access.contains(AccessFlags::REMOTE_WRITE));
        assert!(o.validate("v").is_ok());
    }

    #[test]
    fn retry_budget_is_bounded_by_default_and_unbounded_where_rxe_retries_forever() {
        use std::time::Duration;
        let o = ConnectOptions::default();
        // 7 tries of 4.096 µs × 2^14 = 67.108864 ms.
        assert_eq!(o.retry_budget(), Some(Duration::from_nanos(7 * 67_108_864)));
        let b = |timeout, retry_cnt| {
            ConnectOptions { timeout, retry_cnt, ..ConnectOptions::default() }.retry_budget()
        };
        assert_eq!(b(14, 7), None);
        assert_eq!(b(0, 3), None);
        assert_eq!(b(32, 3), None);
        assert_eq!(b(1, 0), Some(Duration::from_nanos(8192)));
        assert_eq!(b(31, 6), Some(Duration::from_nanos(7 * (4096u64 << 31))));
    }

    // Regression (soundness hole 10): `mtu: Some(Mtu(0))` reached the device unchecked.
    #[test]
    fn out_of_range_fields_are_refused_before_the_device_sees_them() {
        let base = ConnectOptions::default();
        let cases = [
            ConnectOptions { mtu: Some(Mtu(0)), ..base.clone() },
            ConnectOptions { mtu: Some(Mtu(6)), ..base.clone() },
            ConnectOptions { mtu: Some(Mtu(u32::MAX)), ..base.clone() },
            ConnectOptions { timeout: 32, ..base.clone() },
            ConnectOptions { min_rnr_timer: 255, ..base.clone() },
            ConnectOptions { retry_cnt: 8, ..base.clone() },
            ConnectOptions { rnr_retry: 8, ..base.clone() },
            ConnectOptions { port: 0, ..base.clone() },
            ConnectOptions { psn: Some(0x0100_0000), ..base.clone() },
            ConnectOptions { sl: 16, ..base.clone() },
        ];
        for o in cases {
            assert!(
                matches!(
                    o.validate("ibv_create_ah"),
                    Err(Error::InvalidArgument { verb: "ibv_create_ah", .. })
                ),
                "{o:?}"
            );
        }
        assert!(ConnectOptions { mtu: Some(Mtu::MTU_4096), sl: 15, ..base }.validate("v").is_ok());
    }
}
