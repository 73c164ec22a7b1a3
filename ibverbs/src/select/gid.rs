//! [`GidPolicy`]: which GID of a port to use, explicitly or as NCCL chooses it.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use super::fabric::PortDesc;
use super::parse::int;
use crate::attr::{GidEntry, LinkLayer, RoceVersion};
use crate::error::{ParseError, ParseErrorKind, PortProblem};

/// The address family of the GIDs to choose from (`NCCL_IB_ADDR_FAMILY`, our
/// `IBVERBS_ADDR_FAMILY`): RoCE v2 GIDs are IP addresses, IPv4 ones written as IPv4-mapped IPv6
/// (`::ffff:192.0.2.1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddrFamily {
    /// IPv4 (`AF_INET`): the default, as in NCCL.
    Ipv4,
    /// IPv6 (`AF_INET6`), including link-local `fe80::` GIDs.
    Ipv6,
}

impl AddrFamily {
    /// The family of an address.
    pub fn of(addr: IpAddr) -> AddrFamily {
        match addr {
            IpAddr::V4(_) => AddrFamily::Ipv4,
            IpAddr::V6(_) => AddrFamily::Ipv6,
        }
    }

    /// NCCL's spelling: `AF_INET` or `AF_INET6`.
    pub fn as_str(self) -> &'static str {
        match self {
            AddrFamily::Ipv4 => "AF_INET",
            AddrFamily::Ipv6 => "AF_INET6",
        }
    }
}

impl fmt::Display for AddrFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AddrFamily {
    type Err = ParseError;

    /// `AF_INET` or `AF_INET6` (NCCL's values); also `ipv4`/`ipv6`, `inet`/`inet6`, `4`/`6`, in any
    /// case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "af_inet" | "ipv4" | "inet" | "4" => Ok(AddrFamily::Ipv4),
            "af_inet6" | "ipv6" | "inet6" | "6" => Ok(AddrFamily::Ipv6),
            _ => Err(ParseError::new(s, 0, ParseErrorKind::Word { expected: "AF_INET or AF_INET6" })),
        }
    }
}

/// An IP address range in CIDR notation, e.g. `10.0.0.0/8` or `fd00::/8`
/// (`NCCL_IB_ADDR_RANGE`, our `IBVERBS_ADDR_RANGE`): only GIDs whose address lies in it are
/// chosen. Bits after the prefix are ignored (`10.1.2.3/8` is `10.0.0.0/8`), as in NCCL.
///
/// ```
/// use ibverbs::select::AddrRange;
///
/// let r: AddrRange = "10.0.0.0/8".parse()?;
/// assert!(r.contains("10.20.30.40".parse().unwrap()));
/// assert!(!r.contains("192.0.2.1".parse().unwrap()));
/// assert_eq!("10.1.2.3/8".parse::<AddrRange>()?, r);
/// assert_eq!(r.to_string(), "10.0.0.0/8");
/// # Ok::<(), ibverbs::select::ParseError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AddrRange {
    network: IpAddr,
    prefix_len: u8,
}

impl AddrRange {
    /// The range of `prefix_len` leading bits of `addr` (later bits are cleared).
    ///
    /// # Errors
    /// [`ParseErrorKind::PrefixLength`] when `prefix_len` is longer than the address.
    pub fn new(addr: IpAddr, prefix_len: u8) -> Result<AddrRange, ParseError> {
        let max = match addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        if prefix_len > max {
            let text = format!("{addr}/{prefix_len}");
            let at = text.len() - prefix_len.to_string().len();
            return Err(ParseError::new(&text, at, ParseErrorKind::PrefixLength { max }));
        }
        Ok(AddrRange { network: mask(addr, prefix_len), prefix_len })
    }

    /// The first address of the range.
    pub fn network(&self) -> IpAddr {
        self.network
    }

    /// The number of leading bits that addresses in the range share.
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    /// The address family of the range.
    pub fn family(&self) -> AddrFamily {
        AddrFamily::of(self.network)
    }

    /// Whether `addr` lies in the range (never for an address of the other family).
    pub fn contains(&self, addr: IpAddr) -> bool {
        AddrFamily::of(addr) == self.family() && mask(addr, self.prefix_len) == self.network
    }
}

/// `addr` with every bit after the first `len` cleared.
fn mask(addr: IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let bits = u32::from(a);
            let m = u32::MAX.checked_shl(32 - u32::from(len.min(32))).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(bits & m))
        }
        IpAddr::V6(a) => {
            let bits = u128::from(a);
            let m = u128::MAX.checked_shl(128 - u32::from(len.min(128))).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(bits & m))
        }
    }
}

impl FromStr for AddrRange {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some((addr, len)) = s.split_once('/') else {
            return Err(ParseError::new(s, s.len(), ParseErrorKind::AddrRange));
        };
        let addr: IpAddr = addr.parse().map_err(|_| ParseError::new(s, 0, ParseErrorKind::AddrRange))?;
        let max: u8 = if addr.is_ipv4() { 32 } else { 128 };
        let at = s.len() - len.len();
        if let Some(i) = len.find(|c: char| !c.is_ascii_digit()) {
            return Err(ParseError::new(s, at + i, ParseErrorKind::AddrRange));
        }
        if len.is_empty() {
            return Err(ParseError::new(s, at, ParseErrorKind::AddrRange));
        }
        match len.parse::<u8>() {
            Ok(n) if n <= max => AddrRange::new(addr, n),
            _ => Err(ParseError::new(s, at, ParseErrorKind::PrefixLength { max })),
        }
    }
}

impl fmt::Display for AddrRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix_len)
    }
}

// `RoceVersion` itself is a plain value of `attr`, below the error type (whose `PortProblem` names
// it); its parser is here, with the other settings'.
impl FromStr for RoceVersion {
    type Err = ParseError;

    /// `1` or `2`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match int(s, 1, 2)? {
            1 => Ok(RoceVersion::V1),
            _ => Ok(RoceVersion::V2),
        }
    }
}

/// How to choose the GID of a port (the source address of RoCE traffic).
///
/// - **An explicit index always wins** (`IBVERBS_GID_INDEX`/`NCCL_IB_GID_INDEX`): it is used on
///   every selected port, whatever its address. It is checked, so that a misconfiguration is
///   named instead of showing up as a connection timeout: it must lie in the port's table, the
///   entry must not be empty, and on Ethernet ports it must be of the RoCE version asked for
///   (RoCE v2 unless `roce_version` says 1 — stricter than NCCL, which uses a RoCE v1 index as
///   given; on mlx5 the RoCE v1 and v2 GIDs of an address alternate, an easy off-by-one).
/// - **Otherwise, on Ethernet (RoCE) ports**, as NCCL chooses: among the port's GIDs whose
///   address is of `family` (default IPv4, or the range's family) and in `range` (if given),
///   the lowest index of type RoCE v2; if there is none, of type RoCE v1 (only the given version
///   when `roce_version` is set).
/// - **Otherwise, on InfiniBand ports**: no GID: addressing by LID (`family` and `range` do not
///   apply).
///
/// ```
/// use ibverbs::select::{AddrFamily, GidPolicy};
///
/// let auto = GidPolicy::default(); // RoCE v2, IPv4: index 1 on a fresh SoftRoCE device
/// let fixed = GidPolicy { index: Some(3), ..GidPolicy::default() }; // NCCL_IB_GID_INDEX=3
/// let v6 = GidPolicy { family: Some(AddrFamily::Ipv6), ..GidPolicy::default() };
/// # let _ = (auto, fixed, v6);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(default))]
pub struct GidPolicy {
    /// An explicit GID index (`NCCL_IB_GID_INDEX`); `None` chooses automatically.
    pub index: Option<u32>,
    /// The address family to choose from (`NCCL_IB_ADDR_FAMILY`); `None`: the range's family,
    /// or IPv4.
    pub family: Option<AddrFamily>,
    /// The address range to choose from (`NCCL_IB_ADDR_RANGE`).
    pub range: Option<AddrRange>,
    /// The RoCE version required (`NCCL_IB_ROCE_VERSION_NUM`); `None`: RoCE v2 preferred,
    /// RoCE v1 accepted by the automatic choice when there is no RoCE v2 GID.
    pub roce_version: Option<RoceVersion>,
}

impl GidPolicy {
    /// The address family the automatic choice looks for.
    pub fn family(&self) -> AddrFamily {
        self.family.or(self.range.map(|r| r.family())).unwrap_or(AddrFamily::Ipv4)
    }

    /// Chooses the GID of `port`: `Ok(None)` means addressing by LID (InfiniBand, no explicit
    /// index).
    ///
    /// # Errors
    /// The [`PortProblem`] that makes the port unusable with this policy:
    /// [`GidIndexOutOfTable`](PortProblem::GidIndexOutOfTable),
    /// [`GidEmpty`](PortProblem::GidEmpty), [`GidType`](PortProblem::GidType) for an explicit
    /// index; [`NoMatchingGid`](PortProblem::NoMatchingGid) when the automatic choice finds none.
    pub fn choose(&self, port: &PortDesc) -> Result<Option<GidEntry>, PortProblem> {
        let ethernet = port.link_layer == LinkLayer::ETHERNET;
        if let Some(index) = self.index {
            let entry = populated(port, index)?;
            let wanted = self.roce_version.unwrap_or(RoceVersion::V2);
            if ethernet && entry.gid_type != wanted.gid_type() {
                return Err(PortProblem::GidType { index, found: entry.gid_type, wanted });
            }
            return Ok(Some(*entry));
        }
        if !ethernet {
            return Ok(None);
        }
        let family = self.family();
        let fits = |e: &&GidEntry| {
            let ip = e.gid.ip();
            !e.gid.is_zero() && AddrFamily::of(ip) == family && self.range.map_or(true, |r| r.contains(ip))
        };
        let versions: &[RoceVersion] = match self.roce_version {
            Some(RoceVersion::V1) => &[RoceVersion::V1],
            Some(RoceVersion::V2) => &[RoceVersion::V2],
            None => &[RoceVersion::V2, RoceVersion::V1],
        };
        for v in versions {
            let best =
                port.gids.iter().filter(fits).filter(|e| e.gid_type == v.gid_type()).min_by_key(|e| e.index);
            if let Some(e) = best {
                return Ok(Some(*e));
            }
        }
        Err(PortProblem::NoMatchingGid { wanted: self.describe_auto(), table: describe_table(&port.gids) })
    }

    /// [`choose`](Self::choose) for a port of an iWARP device: no GID (RDMA-CM addresses it by
    /// IP) unless an index is given, which must be in the table and not empty; the family,
    /// range and RoCE version do not apply.
    ///
    /// # Errors
    /// [`GidIndexOutOfTable`](PortProblem::GidIndexOutOfTable) and
    /// [`GidEmpty`](PortProblem::GidEmpty) for an explicit index.
    pub fn choose_iwarp(&self, port: &PortDesc) -> Result<Option<GidEntry>, PortProblem> {
        self.index.map(|index| populated(port, index).copied()).transpose()
    }

    /// What the automatic choice looks for, e.g. `a RoCE v2 GID of family AF_INET in 10.0.0.0/8`.
    fn describe_auto(&self) -> String {
        let version = match self.roce_version {
            Some(v) => v.to_string(),
            None => "RoCE v2 (or v1)".to_string(),
        };
        let mut s = format!("a {version} GID of family {}", self.family());
        if let Some(r) = self.range {
            s.push_str(&format!(" in {r}"));
        }
        s
    }
}

impl fmt::Display for GidPolicy {
    /// E.g. `GID index 3`, or `auto (RoCE v2 (or v1), AF_INET, in 10.0.0.0/8)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(i) = self.index {
            return write!(f, "GID index {i}");
        }
        write!(f, "auto ({})", self.describe_auto())
    }
}

/// The populated entries of a GID table, e.g. `[0] fe80::1 RoCE v2, [1] 192.0.2.1 RoCE v2`.
pub(crate) fn describe_table(gids: &[GidEntry]) -> String {
    let items: Vec<String> = gids
        .iter()
        .filter(|e| !e.gid.is_zero())
        .map(|e| format!("[{}] {} {}", e.index, e.gid.ip(), e.gid_type.as_str()))
        .collect();
    if items.is_empty() {
        "the table is empty".to_string()
    } else {
        items.join(", ")
    }
}

/// The entry at `index` of `port`'s GID table, which must be in the table and not empty.
fn populated(port: &PortDesc, index: u32) -> Result<&GidEntry, PortProblem> {
    if index >= port.gid_tbl_len {
        return Err(PortProblem::GidIndexOutOfTable { index, len: port.gid_tbl_len });
    }
    port.gids.iter().find(|e| e.index == index && !e.gid.is_zero()).ok_or(PortProblem::GidEmpty { index })
}
