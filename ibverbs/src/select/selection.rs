//! [`Selection`]: which ports of a [`Fabric`] are usable, in order, and why the others are not
//! ([`Outcome`]); the first usable one is a [`Choice`].

use std::fmt;

use crate::attr::{GidEntry, LinkLayer, Mtu, PortState};
use crate::connect::ConnectOptions;
use crate::device::Context;
use crate::error::{Error, PortProblem, Rejected, Result};
use crate::select::fabric::{natural_cmp, DeviceDesc, Fabric, PortDesc};
use crate::select::gid::GidPolicy;
use crate::select::hca::{HcaEntry, HcaSelector};

/// What to use: which devices and ports ([`HcaSelector`]), which GID ([`GidPolicy`]), and
/// optionally a path MTU the port must reach. [`Config::from_env`](crate::select::Config::from_env)
/// builds one from the environment; the default selects every ACTIVE port with the automatic GID
/// choice.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(default))]
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
    /// Checks every port of `fabric` (see the [module docs](crate::select) for the order) and reports
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
    /// GID (steps 2 to 5 of the [module docs](crate::select)).
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
