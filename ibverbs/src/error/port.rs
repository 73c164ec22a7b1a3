//! [`PortProblem`] and [`Rejected`]: why a port is not usable (the payloads of
//! [`Error::Port`](super::Error::Port) and [`Error::NoUsablePort`](super::Error::NoUsablePort)).
//! The selection that finds them is in `select`.

use std::fmt;

use crate::attr::{GidType, LinkLayer, Mtu, Netdev, PortState, RoceVersion};

/// Why a port (or a whole device) is not usable.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PortProblem {
    /// The device could not be opened or queried.
    DeviceUnavailable {
        /// The error.
        reason: String,
    },
    /// The device has no port of that number.
    NoSuchPort {
        /// How many ports it has.
        ports: usize,
    },
    /// Not in the include list (`NCCL_IB_HCA=...`).
    NotListed,
    /// In the exclude list (`NCCL_IB_HCA=^...`).
    Excluded {
        /// The entry that excludes it.
        entry: String,
    },
    /// A link layer other than InfiniBand and Ethernet.
    UnsupportedLinkLayer {
        /// The link layer.
        link_layer: LinkLayer,
    },
    /// The port is not ACTIVE.
    NotActive {
        /// Its state.
        state: PortState,
        /// Its network device (RoCE), whose state usually says why.
        netdev: Option<Netdev>,
    },
    /// The MTU asked for is above the port's active MTU.
    MtuAboveActive {
        /// The MTU asked for.
        requested: Mtu,
        /// The port's active MTU.
        active: Mtu,
    },
    /// The explicit GID index lies beyond the port's GID table.
    GidIndexOutOfTable {
        /// The index.
        index: u32,
        /// The table's length.
        len: u32,
    },
    /// The explicit GID index names an empty entry.
    GidEmpty {
        /// The index.
        index: u32,
    },
    /// The explicit GID index names an entry of another RoCE version.
    GidType {
        /// The index.
        index: u32,
        /// Its type.
        found: GidType,
        /// The version asked for (RoCE v2 unless `NCCL_IB_ROCE_VERSION_NUM=1`).
        wanted: RoceVersion,
    },
    /// The automatic choice found no GID of the family, range and RoCE version asked for.
    NoMatchingGid {
        /// What it looked for, e.g. `a RoCE v2 (or v1) GID of family AF_INET`.
        wanted: String,
        /// The port's populated entries, e.g. `[0] fe80::1 RoCE v2`.
        table: String,
    },
}

impl fmt::Display for PortProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortProblem::DeviceUnavailable { reason } => write!(f, "cannot be used: {reason}"),
            PortProblem::NoSuchPort { ports } => write!(f, "no such port (the device has {ports})"),
            PortProblem::NotListed => f.write_str("not selected (not in the device list)"),
            PortProblem::Excluded { entry } => write!(f, "excluded (by ^{entry})"),
            PortProblem::UnsupportedLinkLayer { link_layer } => {
                write!(f, "link layer {} is neither InfiniBand nor Ethernet", link_layer.0)
            }
            PortProblem::NotActive { state, netdev } => {
                write!(f, "port state {} is not ACTIVE", state.as_str().to_uppercase())?;
                match netdev {
                    Some(n) if n.oper_state != "up" && n.oper_state != "unknown" => write!(
                        f,
                        " (its network device {} is {}: `ip link set {} up`, check the cable/link)",
                        n.name, n.oper_state, n.name
                    ),
                    Some(n) => write!(f, " (network device {} is {})", n.name, n.oper_state),
                    None if *state == PortState::INIT || *state == PortState::ARMED => {
                        f.write_str(" (link up, but no subnet manager has configured it: is opensm running?)")
                    }
                    None => f.write_str(" (no link: check the cable and the switch port)"),
                }
            }
            PortProblem::MtuAboveActive { requested, active } => write!(
                f,
                "MTU {requested} asked for is above the port's active MTU {active} \
                 (raise the network device's MTU or ask for less)"
            ),
            PortProblem::GidIndexOutOfTable { index, len } => {
                write!(f, "GID index {index} is beyond the GID table ({len} entries)")
            }
            PortProblem::GidEmpty { index } => write!(
                f,
                "GID index {index} is empty (no address behind it: see `ibv_devinfo -v`, or \
                 leave the index unset for the automatic choice)"
            ),
            PortProblem::GidType { index, found, wanted } => write!(
                f,
                "GID index {index} is {}, not {wanted} (RoCE v1 and v2 GIDs of an address \
                 alternate in the table; to use RoCE v1 set IBVERBS_ROCE_VERSION=1)",
                found.as_str()
            ),
            PortProblem::NoMatchingGid { wanted, table } => {
                write!(f, "no GID is {wanted} (GIDs: {table})")
            }
        }
    }
}

/// A port (or a device, `port: None`) that a selection did not keep, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The device.
    pub device: String,
    /// The port, or `None` for the whole device.
    pub port: Option<u8>,
    /// Why.
    pub problem: PortProblem,
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            Some(p) => write!(f, "{} port {p}: {}", self.device, self.problem),
            None => write!(f, "{}: {}", self.device, self.problem),
        }
    }
}
