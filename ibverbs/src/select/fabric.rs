//! [`Fabric`]: a plain-data description of a host's RDMA devices, ports and GIDs, built from the
//! verbs or from sysfs, on which the selection works.

use std::fs;
use std::io;
use std::path::Path;

use crate::attr::{Gid, GidEntry, GidType, Guid, LinkLayer, Mtu, Netdev, PortState};
use crate::device::{devices, Context, DeviceList};
use crate::error::Result;

/// The RDMA devices of a host, their ports and GID tables, as plain data: what
/// [`Selection`](super::Selection) chooses from.
///
/// Build it from the verbs ([`Fabric::query`], [`Fabric::from_list`],
/// [`DeviceDesc::from_context`]), from a sysfs tree ([`Fabric::from_sysfs`], which needs no
/// device access), or write it by hand to test a selection without a device:
///
/// ```
/// use ibverbs::select::{DeviceDesc, Fabric, PortDesc, Selection};
/// use ibverbs::{Gid, GidEntry, GidType, LinkLayer, Mtu, PortState};
///
/// let mut gid = [0u8; 16];
/// gid[10..].copy_from_slice(&[0xff, 0xff, 10, 0, 0, 7]); // ::ffff:10.0.0.7
/// let port = PortDesc {
///     port: 1,
///     state: PortState::ACTIVE,
///     link_layer: LinkLayer::ETHERNET,
///     lid: 0,
///     active_mtu: Some(Mtu::MTU_4096),
///     gid_tbl_len: 4,
///     gids: vec![GidEntry { gid: Gid(gid), index: 3, port: 1, gid_type: GidType::ROCE_V2, ndev_ifindex: 0 }],
///     netdev: None,
/// };
/// let fabric = Fabric { devices: vec![DeviceDesc::new("mlx5_0", vec![port])] };
/// let chosen = Selection::default().select(&fabric)?;
/// assert_eq!((chosen[0].device.as_str(), chosen[0].gid_index()), ("mlx5_0", Some(3)));
/// # Ok::<(), ibverbs::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fabric {
    /// The devices; the builders of this crate put them in natural name order
    /// ([`natural_cmp`](super::natural_cmp)), and [`Selection`](super::Selection) goes through
    /// them in that order whatever order they are in.
    pub devices: Vec<DeviceDesc>,
}

/// One device of a [`Fabric`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceDesc {
    /// The kernel name, e.g. `mlx5_0`, `rxe0`.
    pub name: String,
    /// The node GUID (zero when unknown).
    pub node_guid: Guid,
    /// The ports, in ascending order.
    pub ports: Vec<PortDesc>,
    /// Why the device could not be described (opened or queried), if it could not.
    pub error: Option<String>,
    /// An iWARP device (node type RNIC, e.g. siw): its queue pairs connect through RDMA-CM,
    /// which addresses them by IP, so the selection chooses no GID for its ports.
    pub iwarp: bool,
}

/// One port of a [`DeviceDesc`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortDesc {
    /// The port number, from 1.
    pub port: u8,
    /// The logical state: only ACTIVE ports are selected.
    pub state: PortState,
    /// InfiniBand (addressing by LID) or Ethernet (RoCE, addressing by GID).
    pub link_layer: LinkLayer,
    /// The port's LID (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// The MTU in effect, if known (sysfs does not show it).
    pub active_mtu: Option<Mtu>,
    /// The length of the GID table.
    pub gid_tbl_len: u32,
    /// The populated GID entries.
    pub gids: Vec<GidEntry>,
    /// The network device under a RoCE or iWARP port, if known.
    pub netdev: Option<Netdev>,
}

impl Fabric {
    /// Describes the devices of this host through the verbs: every device of
    /// [`devices()`](crate::devices) is opened and its ports and GID tables are queried; the
    /// devices come in natural name order.
    ///
    /// # Errors
    /// [`Error::Verb`](crate::Error::Verb) when `ibv_get_device_list()` fails. A device that
    /// cannot be opened or queried is described with its [`error`](DeviceDesc::error) instead.
    pub fn query() -> Result<Fabric> {
        Ok(Fabric::from_list(&devices()?))
    }

    /// Describes the devices of `list` (see [`query`](Self::query)), in natural name order: each
    /// is opened (`ibv_open_device()`) and described by [`DeviceDesc::from_context`]
    /// (`ibv_query_device()`, `ibv_query_port()` and the GID table of each port).
    pub fn from_list(list: &DeviceList) -> Fabric {
        let mut devices: Vec<DeviceDesc> = list
            .iter()
            .map(|d| {
                d.open().and_then(|ctx| DeviceDesc::from_context(&ctx)).unwrap_or_else(|e| DeviceDesc {
                    name: d.name().to_string(),
                    node_guid: d.guid(),
                    ports: Vec::new(),
                    error: Some(e.to_string()),
                    iwarp: false,
                })
            })
            .collect();
        devices.sort_by(|a, b| natural_cmp(&a.name, &b.name));
        Fabric { devices }
    }

    /// Describes the devices from a sysfs tree under `root` (`/` for this host's):
    /// `sys/class/infiniband/<device>/ports/<n>/{state,link_layer,lid,gids,gid_attrs}` and
    /// `sys/class/net/<netdev>`. Needs no access to `/dev/infiniband`, so it also works where
    /// the device files are missing (a container they were not passed to). Devices come in
    /// natural name order ([`natural_cmp`](super::natural_cmp)); [`active_mtu`](PortDesc::active_mtu) is unknown (`None`).
    ///
    /// A missing `sys/class/infiniband` (no RDMA driver loaded) gives an empty fabric; a device
    /// whose files cannot be read is described with its [`error`](DeviceDesc::error).
    ///
    /// # Errors
    /// The error of reading `sys/class/infiniband` itself (other than its absence).
    pub fn from_sysfs(root: &Path) -> io::Result<Fabric> {
        let class = root.join("sys/class/infiniband");
        let mut names = match fs::read_dir(&class) {
            Ok(dir) => {
                dir.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect()
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        names.sort_by(|a, b| natural_cmp(a, b));
        let devices = names
            .into_iter()
            .map(|name| {
                sysfs_device(root, &name).unwrap_or_else(|e| DeviceDesc {
                    name: name.clone(),
                    node_guid: Guid::default(),
                    ports: Vec::new(),
                    error: Some(format!("reading {}/{name}: {e}", class.display())),
                    iwarp: false,
                })
            })
            .collect();
        Ok(Fabric { devices })
    }

    /// Every port of every device, in order.
    pub fn ports(&self) -> impl Iterator<Item = (&DeviceDesc, &PortDesc)> + '_ {
        self.devices.iter().flat_map(|d| d.ports.iter().map(move |p| (d, p)))
    }

    /// The device named `name`.
    pub fn device(&self, name: &str) -> Option<&DeviceDesc> {
        self.devices.iter().find(|d| d.name == name)
    }

    /// The names of the devices, comma separated, or `"none"` (as
    /// [`Error::DeviceNotFound`](crate::Error::DeviceNotFound) lists them).
    pub fn names(&self) -> String {
        if self.devices.is_empty() {
            return "none".to_string();
        }
        self.devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ")
    }
}

impl DeviceDesc {
    /// A device with `ports`, a zero GUID and no error (for descriptions written by hand).
    pub fn new(name: &str, ports: Vec<PortDesc>) -> DeviceDesc {
        DeviceDesc { name: name.to_string(), node_guid: Guid::default(), ports, error: None, iwarp: false }
    }

    /// Describes an open device: `ibv_query_device()`, then `ibv_query_port()` and the GID table
    /// of each port; the network device of a RoCE port comes from its GIDs and sysfs, that of an
    /// iWARP port from the MAC address in its GID.
    ///
    /// # Errors
    /// The error of the first verb that fails.
    pub fn from_context(ctx: &Context) -> Result<DeviceDesc> {
        let attr = ctx.query_device()?;
        let iwarp = ctx.is_iwarp();
        let mut ports = Vec::new();
        for port in 1..=attr.phys_port_cnt() {
            let a = ctx.query_port(port)?;
            let gids = ctx.gid_table(port)?;
            let netdev = match a.link_layer() {
                LinkLayer::ETHERNET if iwarp => iwarp_netdev(Path::new("/"), &gids),
                LinkLayer::ETHERNET => netdev(Path::new("/"), ctx.name(), port, &gids),
                _ => None,
            };
            ports.push(PortDesc {
                port,
                state: a.state(),
                link_layer: a.link_layer(),
                lid: a.lid(),
                active_mtu: Some(a.active_mtu()),
                gid_tbl_len: a.gid_tbl_len(),
                gids,
                netdev,
            });
        }
        Ok(DeviceDesc {
            name: ctx.name().to_string(),
            node_guid: attr.node_guid(),
            ports,
            error: None,
            iwarp,
        })
    }
}

/// Reads a sysfs attribute, without its trailing newline.
fn read(path: &Path) -> io::Result<String> {
    let s = fs::read_to_string(path)?;
    Ok(s.trim_end_matches('\n').to_string())
}

/// The network device of a RoCE port: the one of its GIDs (by interface index), else the one
/// sysfs names for its first GID entries.
fn netdev(root: &Path, device: &str, port: u8, gids: &[GidEntry]) -> Option<Netdev> {
    let by_index = gids.iter().filter(|e| e.ndev_ifindex != 0).find_map(|e| {
        let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
        // SAFETY: `buf` has the IF_NAMESIZE bytes if_indextoname() may write.
        let p = unsafe { libc::if_indextoname(e.ndev_ifindex, buf.as_mut_ptr()) };
        // SAFETY: on success `p` is `buf`, holding a NUL-terminated name.
        (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
    });
    let ndevs = root.join(format!("sys/class/infiniband/{device}/ports/{port}/gid_attrs/ndevs"));
    let name = by_index.or_else(|| (0..4).find_map(|i| read(&ndevs.join(i.to_string())).ok()))?;
    netdev_named(root, &name)
}

/// The network device of an iWARP port: the one whose MAC address its first GID carries (siw,
/// Chelsio and Intel make an iWARP GID of the MAC address, zero-padded); their GIDs name no
/// network device in sysfs.
fn iwarp_netdev(root: &Path, gids: &[GidEntry]) -> Option<Netdev> {
    let mac = gids.first()?.gid.0;
    let mac =
        format!("{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", mac[0], mac[1], mac[2], mac[3], mac[4], mac[5]);
    let net = root.join("sys/class/net");
    let mut names: Vec<String> = fs::read_dir(&net)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let name = names.into_iter().find(|n| read(&net.join(n).join("address")).is_ok_and(|a| a == mac))?;
    netdev_named(root, &name)
}

/// The state and MTU of network device `name` under `root`.
fn netdev_named(root: &Path, name: &str) -> Option<Netdev> {
    let dir = root.join("sys/class/net").join(name);
    if name.is_empty() || name.contains('/') {
        return None;
    }
    Some(Netdev {
        name: name.to_string(),
        oper_state: read(&dir.join("operstate")).unwrap_or_else(|_| "unknown".to_string()),
        mtu: read(&dir.join("mtu")).ok().and_then(|m| m.parse().ok()),
    })
}

/// Parses a GID as sysfs shows it: eight groups of four hex digits.
fn parse_sysfs_gid(s: &str) -> Option<Gid> {
    let mut out = [0u8; 16];
    let groups: Vec<&str> = s.split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    for (i, g) in groups.iter().enumerate() {
        let v = u16::from_str_radix(g, 16).ok()?;
        out[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(Gid(out))
}

/// Parses a GUID as sysfs shows it: `0011:2233:4455:6677`.
fn parse_sysfs_guid(s: &str) -> Option<Guid> {
    let hex: String = s.split(':').collect();
    (hex.len() == 16).then(|| u64::from_str_radix(&hex, 16).ok().map(Guid)).flatten()
}

fn sysfs_device(root: &Path, name: &str) -> io::Result<DeviceDesc> {
    let dir = root.join("sys/class/infiniband").join(name);
    let node_guid = read(&dir.join("node_guid")).ok().and_then(|g| parse_sysfs_guid(&g)).unwrap_or_default();
    let mut numbers: Vec<u8> = fs::read_dir(dir.join("ports"))?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect();
    numbers.sort_unstable();
    // "4: RNIC" (include/rdma/ib_verbs.h RDMA_NODE_RNIC).
    let iwarp = read(&dir.join("node_type")).is_ok_and(|t| t.split(':').next() == Some("4"));
    let mut ports = Vec::new();
    for port in numbers {
        let p = dir.join("ports").join(port.to_string());
        // "4: ACTIVE"
        let state = read(&p.join("state"))?;
        let state =
            state.split(':').next().and_then(|n| n.trim().parse().ok()).map_or(PortState(0), PortState);
        let link_layer = match read(&p.join("link_layer")).unwrap_or_default().as_str() {
            "Ethernet" => LinkLayer::ETHERNET,
            "InfiniBand" => LinkLayer::INFINIBAND,
            _ => LinkLayer::UNSPECIFIED,
        };
        let lid = read(&p.join("lid"))
            .ok()
            .and_then(|l| u16::from_str_radix(l.trim_start_matches("0x"), 16).ok())
            .unwrap_or(0);
        let mut indexes: Vec<u32> = fs::read_dir(p.join("gids"))?
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
            .collect();
        indexes.sort_unstable();
        let gid_tbl_len = indexes.last().map_or(0, |&i| i.saturating_add(1));
        let mut gids = Vec::new();
        let mut ndev = None;
        for index in indexes {
            // Reading an empty RoCE entry fails (EINVAL) or shows zeroes: both mean "empty".
            let Some(gid) = read(&p.join(format!("gids/{index}"))).ok().and_then(|g| parse_sysfs_gid(&g))
            else {
                continue;
            };
            if gid.is_zero() {
                continue;
            }
            // An iWARP GID has no type in sysfs; the verbs call it IB.
            let gid_type = match read(&p.join(format!("gid_attrs/types/{index}"))).ok().as_deref() {
                Some("RoCE v2") => GidType::ROCE_V2,
                _ if iwarp => GidType::IB,
                _ if link_layer == LinkLayer::ETHERNET => GidType::ROCE_V1,
                _ => GidType::IB,
            };
            let ndev_name = read(&p.join(format!("gid_attrs/ndevs/{index}"))).ok();
            let ndev_ifindex = ndev_name
                .as_deref()
                .and_then(|n| read(&root.join("sys/class/net").join(n).join("ifindex")).ok())
                .and_then(|i| i.parse().ok())
                .unwrap_or(0);
            if ndev.is_none() {
                ndev = ndev_name;
            }
            gids.push(GidEntry { gid, index, port: u32::from(port), gid_type, ndev_ifindex });
        }
        let netdev = match link_layer {
            LinkLayer::ETHERNET if iwarp => iwarp_netdev(root, &gids),
            LinkLayer::ETHERNET => {
                ndev.and_then(|n| netdev_named(root, &n)).or_else(|| netdev(root, name, port, &[]))
            }
            _ => None,
        };
        ports.push(PortDesc { port, state, link_layer, lid, active_mtu: None, gid_tbl_len, gids, netdev });
    }
    Ok(DeviceDesc { name: name.to_string(), node_guid, ports, error: None, iwarp })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_gids_and_guids_parse() {
        let g = parse_sysfs_gid("0000:0000:0000:0000:0000:ffff:c000:0201").unwrap();
        assert_eq!(g.ip().to_string(), "192.0.2.1");
        assert_eq!(parse_sysfs_gid("fe80:0000:0000:0000:0000:0000:0000"), None);
        assert_eq!(parse_sysfs_gid("fe80:0000:0000:0000:0000:0000:0000:zzzz"), None);
        assert_eq!(parse_sysfs_guid("0011:2233:4455:6677"), Some(Guid(0x0011_2233_4455_6677)));
        assert_eq!(parse_sysfs_guid("0011:2233"), None);
    }
}
