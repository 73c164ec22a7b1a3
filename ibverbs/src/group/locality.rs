//! Where things are: the NUMA node of a NIC, the NUMA nodes of this process's CPUs, and the IP
//! network of an address — from sysfs (under a root given for tests) and `getifaddrs()`.

use std::collections::BTreeSet;
use std::fs;
use std::net::IpAddr;
use std::path::Path;

/// The NUMA node of RDMA device `device`, or of the network device `netdev` under it (a software
/// device such as rxe has no bus device of its own): `None` when sysfs does not say (`-1`).
pub(crate) fn nic_numa_node(root: &Path, device: &str, netdev: Option<&str>) -> Option<u32> {
    let read = |p: &Path| -> Option<u32> {
        let text = fs::read_to_string(p).ok()?;
        let v: i64 = text.trim().parse().ok()?;
        u32::try_from(v).ok()
    };
    // A virtio NIC's `device` is the virtio device; its PCI function (with the node) is the parent.
    let of_device = |dev: std::path::PathBuf| {
        read(&dev.join("numa_node")).or_else(|| {
            fs::canonicalize(&dev).ok().and_then(|d| d.parent().and_then(|p| read(&p.join("numa_node"))))
        })
    };
    of_device(root.join(format!("sys/class/infiniband/{device}/device")))
        .or_else(|| netdev.and_then(|n| of_device(root.join(format!("sys/class/net/{n}/device")))))
}

/// Parses a kernel CPU list (`0-3,8,10-11`).
pub(crate) fn parse_cpu_list(text: &str) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let mut ends = part.splitn(2, '-');
        let a = ends.next().and_then(|a| a.trim().parse::<usize>().ok());
        let b = ends.next().map(|b| b.trim().parse::<usize>().ok());
        match (a, b) {
            (Some(a), None) => {
                out.insert(a);
            }
            // A bounded range: at most 1 << 16 CPUs from one entry.
            (Some(a), Some(Some(b))) if b >= a && b - a < 1 << 16 => out.extend(a..=b),
            _ => {}
        }
    }
    out
}

/// The NUMA nodes of this host with their CPUs, from `sys/devices/system/node/node*/cpulist`.
pub(crate) fn numa_nodes(root: &Path) -> Vec<(u32, BTreeSet<usize>)> {
    let mut out = Vec::new();
    let Ok(dir) = fs::read_dir(root.join("sys/devices/system/node")) else { return out };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(n) = name.to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Ok(text) = fs::read_to_string(entry.path().join("cpulist")) {
            out.push((n, parse_cpu_list(&text)));
        }
    }
    out.sort_by_key(|(n, _)| *n);
    out
}

/// The CPUs this thread may run on (`sched_getaffinity`), or `None` if that fails.
pub(crate) fn affinity() -> Option<BTreeSet<usize>> {
    // SAFETY: cpu_set_t is plain data; all-zero is a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is writable and its size is passed; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return None;
    }
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` was filled by sched_getaffinity; CPU_ISSET reads bit `c` < its size.
    Some((0..max).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// The NUMA nodes whose CPUs meet `cpus`.
pub(crate) fn nodes_of(cpus: &BTreeSet<usize>, nodes: &[(u32, BTreeSet<usize>)]) -> BTreeSet<u32> {
    nodes.iter().filter(|(_, c)| !c.is_disjoint(cpus)).map(|(n, _)| *n).collect()
}

/// `"10.0.2.0/24"` for an address this host has (`getifaddrs()`, the interface's netmask), or
/// `None` when no interface has it.
pub(crate) fn network_of(ip: IpAddr) -> Option<String> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head`; freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() {
            continue;
        }
        // SAFETY: non-null sockaddr pointers of the list, read as the family they declare.
        let (addr, mask) = unsafe { (sockaddr_ip(ifa.ifa_addr), sockaddr_ip(ifa.ifa_netmask)) };
        if let (Some(a), Some(m)) = (addr, mask) {
            if a == ip {
                found = Some(network(a, m));
                break;
            }
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once; no node is used after this.
    unsafe { libc::freeifaddrs(head) };
    found
}

/// An IP address from a `sockaddr`.
///
/// # Safety
/// `sa` points to a valid `sockaddr` whose storage is as large as its family's struct
/// (`sockaddr_in` or `sockaddr_in6`).
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    // SAFETY: the caller guarantees a valid sockaddr.
    let family = i32::from(unsafe { (*sa).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: AF_INET: the storage is a sockaddr_in (caller's guarantee).
            let sin = unsafe { &*sa.cast::<libc::sockaddr_in>() };
            Some(IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()))
        }
        libc::AF_INET6 => {
            // SAFETY: AF_INET6: the storage is a sockaddr_in6 (caller's guarantee).
            let sin6 = unsafe { &*sa.cast::<libc::sockaddr_in6>() };
            Some(IpAddr::from(sin6.sin6_addr.s6_addr))
        }
        _ => None,
    }
}

/// `addr & mask` as `"network/prefix"`.
pub(crate) fn network(addr: IpAddr, mask: IpAddr) -> String {
    match (addr, mask) {
        (IpAddr::V4(a), IpAddr::V4(m)) => {
            let (a, m) = (u32::from(a), u32::from(m));
            format!("{}/{}", std::net::Ipv4Addr::from(a & m), m.count_ones())
        }
        (IpAddr::V6(a), IpAddr::V6(m)) => {
            let (a, m) = (u128::from(a), u128::from(m));
            format!("{}/{}", std::net::Ipv6Addr::from(a & m), m.count_ones())
        }
        (a, _) => format!("{a}/?"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n").into_iter().collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert!(parse_cpu_list("").is_empty());
        assert!(parse_cpu_list("5-2,x,0-99999999").is_empty());
    }

    #[test]
    #[cfg_attr(miri, ignore = "creates and reads files")]
    fn nodes_and_nics_from_a_sysfs_tree() {
        let dir = std::env::temp_dir().join(format!("ibverbs-locality-{}", std::process::id()));
        let w = |p: &str, text: &str| {
            let path = dir.join(p);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        };
        w("sys/devices/system/node/node0/cpulist", "0\n");
        w("sys/devices/system/node/node1/cpulist", "1\n");
        w("sys/devices/system/node/possible", "0-1\n");
        w("sys/class/infiniband/mlx5_0/device/numa_node", "1\n");
        w("sys/class/infiniband/mlx5_1/device/numa_node", "-1\n");
        w("sys/class/net/eth1/device/numa_node", "1\n");
        // virtio: the netdev's device is the virtio device, the node is on its PCI parent.
        w("sys/devices/pci0000:40/0000:40:00.0/numa_node", "1\n");
        w("sys/devices/pci0000:40/0000:40:00.0/virtio3/uevent", "");
        fs::create_dir_all(dir.join("sys/class/net/eth2")).unwrap();
        std::os::unix::fs::symlink(
            dir.join("sys/devices/pci0000:40/0000:40:00.0/virtio3"),
            dir.join("sys/class/net/eth2/device"),
        )
        .unwrap();
        let nodes = numa_nodes(&dir);
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes_of(&[1].into_iter().collect(), &nodes), [1].into_iter().collect());
        assert_eq!(nodes_of(&[0, 1].into_iter().collect(), &nodes).len(), 2);
        assert_eq!(nic_numa_node(&dir, "mlx5_0", None), Some(1));
        assert_eq!(nic_numa_node(&dir, "mlx5_1", None), None);
        assert_eq!(nic_numa_node(&dir, "rxe1", Some("eth1")), Some(1));
        assert_eq!(nic_numa_node(&dir, "rxe0", Some("eth0")), None);
        assert_eq!(nic_numa_node(&dir, "rxe2", Some("eth2")), Some(1));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn networks() {
        let n = |a: &str, m: &str| network(a.parse().unwrap(), m.parse().unwrap());
        assert_eq!(n("10.0.2.7", "255.255.255.0"), "10.0.2.0/24");
        assert_eq!(n("fd00::5", "ffff:ffff::"), "fd00::/32");
    }

    #[test]
    #[cfg_attr(miri, ignore = "calls getifaddrs")]
    fn the_loopback_interface_has_its_network() {
        assert_eq!(network_of("127.0.0.1".parse().unwrap()).as_deref(), Some("127.0.0.0/8"));
    }

    #[test]
    #[cfg_attr(miri, ignore = "calls sched_getaffinity")]
    fn this_process_has_an_affinity() {
        assert!(!affinity().unwrap().is_empty());
    }
}
