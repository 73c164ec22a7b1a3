//! Choosing devices, ports and GIDs the way NCCL does, from the same settings.
//!
//! People who run RDMA at scale configure it through NCCL's environment variables. This module
//! reads the same ones — and our own `IBVERBS_*` names, which win — so that a job already set up
//! for NCCL runs unchanged:
//!
//! ```no_run
//! fn main() -> ibverbs::Result<()> {
//!     // NCCL_IB_HCA=mlx5_0:1,mlx5_1 NCCL_IB_GID_INDEX=3 NCCL_IB_TIMEOUT=22 ./my-job
//!     let config = ibverbs::select::Config::from_env()?; // a typo in any variable is an error naming it
//!     let (ctx, opts) = config.open()?; // the first usable port, its GID, timeout, retries...
//!     println!("using {} port {} GID index {:?}", ctx.name(), opts.port, opts.gid_index);
//!     Ok(())
//! }
//! ```
//!
//! # The variables
//!
//! | ours | NCCL's | what | type |
//! |---|---|---|---|
//! | `IBVERBS_HCA` | `NCCL_IB_HCA` | devices and ports to use | [`HcaSelector`] |
//! | `IBVERBS_GID_INDEX` | `NCCL_IB_GID_INDEX` | GID index; `-1` = automatic | [`GidPolicy::index`] |
//! | `IBVERBS_ADDR_FAMILY` | `NCCL_IB_ADDR_FAMILY` | `AF_INET` or `AF_INET6`, for the automatic GID choice | [`AddrFamily`] |
//! | `IBVERBS_ADDR_RANGE` | `NCCL_IB_ADDR_RANGE` | e.g. `10.0.0.0/8`, for the automatic GID choice | [`AddrRange`] |
//! | `IBVERBS_ROCE_VERSION` | `NCCL_IB_ROCE_VERSION_NUM` | `1` or `2` | [`RoceVersion`] |
//! | `IBVERBS_TIMEOUT` | `NCCL_IB_TIMEOUT` | ACK timeout exponent, 0..=31 | [`ConnectOptions::timeout`] |
//! | `IBVERBS_RETRY_CNT` | `NCCL_IB_RETRY_CNT` | transport retries, 0..=7 | [`ConnectOptions::retry_cnt`] |
//! | `IBVERBS_SL` | `NCCL_IB_SL` | service level, 0..=15 | [`ConnectOptions::sl`] |
//! | `IBVERBS_TC` | `NCCL_IB_TC` | traffic class, 0..=255 | [`ConnectOptions::traffic_class`] |
//! | `IBVERBS_PKEY_INDEX` | `NCCL_IB_PKEY` | P_Key index, 0..=65535 | [`ConnectOptions::pkey_index`] |
//! | `IBVERBS_MTU` | — | path MTU in bytes: 256, 512, 1024, 2048 or 4096 | [`Selection::mtu`] |
//! | `IBVERBS_QPS_PER_CONNECTION` | `NCCL_IB_QPS_PER_CONNECTION` | queue pairs per striped connection, 1..=64 | [`StripeOptions::qps`](crate::striped::StripeOptions::qps) |
//! | `IBVERBS_SPLIT_DATA_ON_QPS` | `NCCL_IB_SPLIT_DATA_ON_QPS` | 1: split large requests over them; 0: round-robin | [`StripeOptions::split_data`](crate::striped::StripeOptions::split_data) |
//!
//! [`VARIABLES`] lists them for programs that print their settings. A variable set to the empty
//! string means its default (and still hides the NCCL variable behind it). Settings NCCL has
//! and this crate does not read (`NCCL_IB_DISABLE`, `NCCL_IB_USE_INLINE`...) are about how NCCL
//! uses connections, not how to make one.
//!
//! # How a port is chosen
//!
//! [`Selection::evaluate`] goes through the devices in natural name order (`mlx5_2` before
//! `mlx5_10`, [`natural_cmp`]) and their ports in ascending order — deterministic, whatever
//! order the kernel lists the devices in (it is not sorted: a device added later may come
//! first); the first usable port is what [`Config::open`] uses. It keeps a port when, in this
//! order of checks:
//!
//! 1. the [`HcaSelector`] selects it (`NCCL_IB_HCA`; every port when unset);
//! 2. its link layer is InfiniBand or Ethernet;
//! 3. it is ACTIVE ([`PortProblem::NotActive`] names its state, and for RoCE the state of its
//!    network device);
//! 4. its active MTU is at least the [`mtu`](Selection::mtu) asked for, if any;
//! 5. the [`GidPolicy`] finds its GID (on Ethernet) or it is addressed by LID (InfiniBand).
//!    An iWARP device's port ([`DeviceDesc::iwarp`], e.g. siw) takes no GID: its queue pairs
//!    connect through RDMA-CM ([`crate::cm`]), which addresses them by IP; only an explicit
//!    index is checked (in the table, not empty), and the address family, range and RoCE
//!    version do not apply.
//!
//! Every port not kept is reported with the [`PortProblem`] that excluded it, so a program can
//! say *why* nothing is usable ([`Error::NoUsablePort`]). The selection works on a [`Fabric`]
//! — plain data — so it can be tested on descriptions written by hand.

mod env;
mod fabric;
mod gid;
mod hca;
mod parse;

use std::fmt;

pub use crate::attr::{Netdev, RoceVersion};
pub use crate::error::{ParseError, ParseErrorKind, PortProblem, Rejected};
pub use env::{Config, Setting, Variable, VARIABLES};
pub use fabric::{DeviceDesc, Fabric, PortDesc};
pub use gid::{AddrFamily, AddrRange, GidPolicy};
pub use hca::{HcaEntry, HcaSelector};

use crate::attr::{GidEntry, LinkLayer, Mtu, PortState};
use crate::connect::ConnectOptions;
use crate::device::Context;
use crate::error::{Error, Result};

/// What to use: which devices and ports ([`HcaSelector`]), which GID ([`GidPolicy`]), and
/// optionally a path MTU the port must reach. [`Config::from_env`] builds one from the
/// environment; the default selects every ACTIVE port with the automatic GID choice.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selection {
    /// Devices and ports (`NCCL_IB_HCA`).
    pub hca: HcaSelector,
    /// GID choice (`NCCL_IB_GID_INDEX`, `NCCL_IB_ADDR_FAMILY`, `NCCL_IB_ADDR_RANGE`,
    /// `NCCL_IB_ROCE_VERSION_NUM`).
    pub gid: GidPolicy,
    /// A path MTU the port's active MTU must reach (`IBVERBS_MTU`); `None`: the port's.
    pub mtu: Option<Mtu>,
}

/// A usable port, as [`Selection`] chose it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The device name.
    pub device: String,
    /// The port number.
    pub port: u8,
    /// The port's link layer.
    pub link_layer: LinkLayer,
    /// The port's LID (InfiniBand).
    pub lid: u16,
    /// The GID chosen; `None` means addressing by LID (InfiniBand), or by IP through RDMA-CM
    /// on an iWARP device.
    pub gid: Option<GidEntry>,
    /// The port's active MTU, if known.
    pub active_mtu: Option<Mtu>,
    /// An iWARP device: connect its queue pairs through RDMA-CM ([`crate::cm`]), not with
    /// [`connect_options`](Self::connect_options).
    pub iwarp: bool,
}

impl Choice {
    /// The GID index chosen, if any.
    pub fn gid_index(&self) -> Option<u32> {
        self.gid.map(|g| g.index)
    }

    /// `base` with this choice's port and GID index.
    pub fn connect_options(&self, base: &ConnectOptions) -> ConnectOptions {
        ConnectOptions { port: self.port, gid_index: self.gid_index(), ..base.clone() }
    }

    /// Opens the device.
    ///
    /// # Errors
    /// As [`Context::open`].
    pub fn open(&self) -> Result<Context> {
        Context::open(Some(&self.device))
    }
}

impl fmt::Display for Choice {
    /// E.g. `rxe0 port 1, GID[1] 192.0.2.1 (RoCE v2)`, `mlx5_0 port 1, LID 12` or
    /// `siw0 port 1, iWARP (RDMA-CM)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} port {}", self.device, self.port)?;
        match self.gid {
            Some(g) if self.iwarp => write!(f, ", GID[{}], iWARP (RDMA-CM)", g.index),
            Some(g) => write!(f, ", GID[{}] {} ({})", g.index, g.gid.ip(), g.gid_type.as_str()),
            None if self.iwarp => write!(f, ", iWARP (RDMA-CM)"),
            None => write!(f, ", LID {}", self.lid),
        }
    }
}

/// The result of [`Selection::evaluate`]: what was chosen, what was not and why.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Outcome {
    /// The usable ports, in natural device name order, then port order.
    pub chosen: Vec<Choice>,
    /// The ports (or devices) not kept.
    pub rejected: Vec<Rejected>,
    /// Entries of the device list that name no port of the fabric (usually a typo).
    pub unmatched: Vec<HcaEntry>,
}

impl Selection {
    /// Checks every port of `fabric` (see the [module docs](self) for the order) and reports
    /// what is usable and why the rest is not. Never fails.
    pub fn evaluate(&self, fabric: &Fabric) -> Outcome {
        let mut out = Outcome::default();
        let mut devices: Vec<&DeviceDesc> = fabric.devices.iter().collect();
        devices.sort_by(|a, b| natural_cmp(&a.name, &b.name));
        for device in devices {
            if let Some(reason) = &device.error {
                let problem = PortProblem::DeviceUnavailable { reason: reason.clone() };
                out.rejected.push(Rejected { device: device.name.clone(), port: None, problem });
                continue;
            }
            for port in &device.ports {
                match self.check(device, port) {
                    Ok(choice) => out.chosen.push(choice),
                    Err(problem) => out.rejected.push(Rejected {
                        device: device.name.clone(),
                        port: Some(port.port),
                        problem,
                    }),
                }
            }
        }
        let ports: Vec<(&str, u8)> = fabric.ports().map(|(d, p)| (d.name.as_str(), p.port)).collect();
        out.unmatched = self.hca.unmatched(&ports).into_iter().cloned().collect();
        out
    }

    /// The usable ports of `fabric`, in order.
    ///
    /// # Errors
    /// [`Error::DeviceNotFound`] when `fabric` has no device at all (its message says whether
    /// `/dev/infiniband` and the kernel modules are there); [`Error::NoUsablePort`], listing
    /// each port's [`PortProblem`], when no port is usable.
    pub fn select(&self, fabric: &Fabric) -> Result<Vec<Choice>> {
        self.select_described(fabric, || self.to_string())
    }

    /// [`select`](Self::select), describing the selection with `describe()` in errors.
    pub(crate) fn select_described(
        &self,
        fabric: &Fabric,
        describe: impl Fn() -> String,
    ) -> Result<Vec<Choice>> {
        if fabric.devices.is_empty() {
            let name = if self.hca.is_all() { "<any>".to_string() } else { self.hca.to_string() };
            return Err(Error::DeviceNotFound { name, available: fabric.names() });
        }
        let outcome = self.evaluate(fabric);
        if outcome.chosen.is_empty() {
            return Err(Error::NoUsablePort { selection: describe(), rejected: outcome.rejected });
        }
        Ok(outcome.chosen)
    }

    /// Checks one named port, whatever the [`hca`](Self::hca) list says: for a device and port
    /// given explicitly (a tool's `-d`/`-i` flags), with this selection's GID and MTU policy.
    ///
    /// # Errors
    /// [`Error::DeviceNotFound`] for a device `fabric` does not have; [`Error::Port`] with the
    /// [`PortProblem`] (the device cannot be used, no such port, not ACTIVE, MTU, GID).
    pub fn resolve(&self, fabric: &Fabric, device: &str, port: u8) -> Result<Choice> {
        let d = fabric
            .device(device)
            .ok_or_else(|| Error::DeviceNotFound { name: device.to_string(), available: fabric.names() })?;
        let problem = |problem| Error::Port { device: device.to_string(), port, problem };
        if let Some(reason) = &d.error {
            return Err(problem(PortProblem::DeviceUnavailable { reason: reason.clone() }));
        }
        let p = d
            .ports
            .iter()
            .find(|p| p.port == port)
            .ok_or_else(|| problem(PortProblem::NoSuchPort { ports: d.ports.len() }))?;
        self.check_port(d, p).map_err(problem)
    }

    /// The [`HcaSelector`] check, then [`check_port`](Self::check_port).
    fn check(&self, device: &DeviceDesc, port: &PortDesc) -> Result<Choice, PortProblem> {
        if !self.hca.matches(&device.name, port.port) {
            return Err(match self.hca.entry_for(&device.name, port.port) {
                Some(e) => PortProblem::Excluded { entry: e.to_string() },
                None => PortProblem::NotListed,
            });
        }
        self.check_port(device, port)
    }

    /// Checks one port of `device` on everything but the device list: link layer, state, MTU,
    /// GID (steps 2 to 5 of the [module docs](self)).
    ///
    /// # Errors
    /// The first [`PortProblem`] found.
    pub fn check_port(&self, device: &DeviceDesc, port: &PortDesc) -> Result<Choice, PortProblem> {
        let ll = port.link_layer;
        if ll != LinkLayer::INFINIBAND && ll != LinkLayer::ETHERNET && ll != LinkLayer::UNSPECIFIED {
            return Err(PortProblem::UnsupportedLinkLayer { link_layer: ll });
        }
        if port.state != PortState::ACTIVE {
            return Err(PortProblem::NotActive { state: port.state, netdev: port.netdev.clone() });
        }
        if let (Some(requested), Some(active)) = (self.mtu, port.active_mtu) {
            if requested > active {
                return Err(PortProblem::MtuAboveActive { requested, active });
            }
        }
        let gid = if device.iwarp { self.gid.choose_iwarp(port)? } else { self.gid.choose(port)? };
        Ok(Choice {
            device: device.name.clone(),
            port: port.port,
            link_layer: ll,
            lid: port.lid,
            gid,
            active_mtu: port.active_mtu,
            iwarp: device.iwarp,
        })
    }
}

/// Compares device names naturally: runs of digits by their value, so `mlx5_2` comes before
/// `mlx5_10` and `rxe9` before `rxe10`.
pub fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    /// The next run of digits or of other characters, and the rest.
    fn run(s: &str) -> (&str, &str) {
        let digits = s.starts_with(|c: char| c.is_ascii_digit());
        let end = s.find(|c: char| c.is_ascii_digit() != digits).unwrap_or(s.len());
        s.split_at(end)
    }
    let (mut a, mut b) = (a, b);
    while !a.is_empty() && !b.is_empty() {
        let ((ra, rest_a), (rb, rest_b)) = (run(a), run(b));
        let digits = |r: &str| r.starts_with(|c: char| c.is_ascii_digit());
        let order = if digits(ra) && digits(rb) {
            let (ta, tb) = (ra.trim_start_matches('0'), rb.trim_start_matches('0'));
            ta.len().cmp(&tb.len()).then_with(|| ta.cmp(tb)).then_with(|| ra.len().cmp(&rb.len()))
        } else {
            ra.cmp(rb)
        };
        if order != std::cmp::Ordering::Equal {
            return order;
        }
        (a, b) = (rest_a, rest_b);
    }
    a.len().cmp(&b.len())
}

impl fmt::Display for Selection {
    /// E.g. `devices ^rxe1, auto (a RoCE v2 (or v1) GID of family AF_INET), MTU 1024`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.hca.is_all() {
            f.write_str("all devices")?;
        } else {
            write!(f, "devices {}", self.hca)?;
        }
        write!(f, ", {}", self.gid)?;
        if let Some(m) = self.mtu {
            write!(f, ", MTU {m}")?;
        }
        Ok(())
    }
}
