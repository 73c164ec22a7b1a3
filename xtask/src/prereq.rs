//! Prerequisites: the Debian packages the harness needs, and whether this host has an RDMA device.

use std::fs;
use std::path::Path;
use std::process::Command;

/// Packages the VM harness needs (the VM's root is the host's root, so the RDMA tools and providers
/// come from the host too).
pub const VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "linux-image-amd64",
    "busybox-static",
    "rdma-core",
    "ibverbs-utils",
    "ibverbs-providers",
    "perftest",
    "rdmacm-utils",
    "iproute2",
    "kmod",
    "cpio",
    "xz-utils",
];

/// Packages needed when commands run directly on a host with its own RDMA device.
pub const HOST_PACKAGES: &[&str] =
    &["rdma-core", "ibverbs-utils", "ibverbs-providers", "perftest", "rdmacm-utils", "iproute2"];

/// Makes sure `packages` are installed: as root, installs the missing ones with apt-get (saying so);
/// otherwise prints the command to run and fails. Does nothing where there is no dpkg.
pub fn ensure_packages(packages: &[&str]) -> Result<(), String> {
    if Command::new("dpkg-query").arg("--version").output().is_err() {
        eprintln!("xtask: no dpkg-query: not a Debian system, assuming {} are installed", packages.join(" "));
        return Ok(());
    }
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !is_installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let list = missing.join(" ");
    if !is_root() {
        return Err(format!(
            "missing Debian packages: {list}\nInstall them with:\n    sudo apt-get install -y {list}"
        ));
    }
    eprintln!("xtask: installing missing Debian packages: {list}");
    let apt = |args: &[&str]| -> Result<(), String> {
        let status = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map_err(|e| format!("running apt-get: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("apt-get {} failed ({status})", args.join(" ")))
        }
    };
    apt(&["update", "-q"])?;
    let mut install = vec!["install", "-y", "-q", "--no-install-recommends"];
    install.extend(&missing);
    apt(&install)
}

/// Whether dpkg says `package` is installed.
fn is_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|out| is_installed_status(&String::from_utf8_lossy(&out.stdout)))
}

/// Whether a `dpkg-query -f '${Status}'` answer means "installed".
pub fn is_installed_status(status: &str) -> bool {
    status.trim() == "install ok installed"
}

/// Whether we run as root.
fn is_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// An RDMA device of the host with an ACTIVE port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDevice {
    /// Its name (`/sys/class/infiniband/<name>`).
    pub name: String,
    /// The index of its RoCE v2 IPv4-mapped GID on the active port, if it has one.
    pub gid_index: Option<u32>,
    /// The IPv4 address of that GID, for RDMA-CM.
    pub ipv4: Option<String>,
}

/// The first RDMA device of this host that has an ACTIVE port, if any.
pub fn host_device() -> Option<HostDevice> {
    host_device_in(Path::new("/sys/class/infiniband"))
}

/// [`host_device`] over a sysfs tree rooted at `class` (for tests).
pub fn host_device_in(class: &Path) -> Option<HostDevice> {
    let mut devices: Vec<_> = fs::read_dir(class).ok()?.flatten().map(|e| e.path()).collect();
    devices.sort();
    for device in devices {
        let Ok(ports) = fs::read_dir(device.join("ports")) else { continue };
        let mut ports: Vec<_> = ports.flatten().map(|e| e.path()).collect();
        ports.sort();
        for port in ports {
            let state = fs::read_to_string(port.join("state")).unwrap_or_default();
            if !state.contains("ACTIVE") {
                continue;
            }
            let name = device.file_name()?.to_string_lossy().into_owned();
            let (gid_index, ipv4) = match roce_v2_ipv4_gid(&port) {
                Some((index, ip)) => (Some(index), Some(ip)),
                None => (None, None),
            };
            return Some(HostDevice { name, gid_index, ipv4 });
        }
    }
    None
}

/// The lowest GID index of `port` whose type is RoCE v2 and whose GID is IPv4-mapped, with the address.
fn roce_v2_ipv4_gid(port: &Path) -> Option<(u32, String)> {
    let types = fs::read_dir(port.join("gid_attrs/types")).ok()?;
    let mut indices: Vec<u32> =
        types.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect();
    indices.sort_unstable();
    indices.into_iter().find_map(|i| {
        let kind = fs::read_to_string(port.join(format!("gid_attrs/types/{i}"))).ok()?;
        if kind.trim() != "RoCE v2" {
            return None;
        }
        let gid = fs::read_to_string(port.join(format!("gids/{i}"))).ok()?;
        Some((i, ipv4_of_gid(gid.trim())?))
    })
}

/// The IPv4 address of an IPv4-mapped GID as sysfs writes it (`0000:0000:0000:0000:0000:ffff:c000:0201`).
pub fn ipv4_of_gid(gid: &str) -> Option<String> {
    let groups: Vec<u16> = gid.split(':').map(|g| u16::from_str_radix(g, 16).ok()).collect::<Option<_>>()?;
    if groups.len() != 8 || groups[..5].iter().any(|g| *g != 0) || groups[5] != 0xffff {
        return None;
    }
    let [a, b] = groups[6].to_be_bytes();
    let [c, d] = groups[7].to_be_bytes();
    Some(format!("{a}.{b}.{c}.{d}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dpkg_status() {
        assert!(is_installed_status("install ok installed"));
        assert!(!is_installed_status("deinstall ok config-files"));
        assert!(!is_installed_status(""));
    }

    #[test]
    fn ipv4_mapped_gids() {
        assert_eq!(ipv4_of_gid("0000:0000:0000:0000:0000:ffff:c000:0201").as_deref(), Some("192.0.2.1"));
        assert_eq!(ipv4_of_gid("fe80:0000:0000:0000:5054:00ff:fe12:3456"), None);
        assert_eq!(ipv4_of_gid("0000:0000:0000:0000:0000:0000:0000:0000"), None);
        assert_eq!(ipv4_of_gid("garbage"), None);
    }

    #[test]
    fn finds_an_active_device_and_its_roce_v2_gid() {
        let root = std::env::temp_dir().join(format!("xtask-sysfs-test.{}", std::process::id()));
        let port = |dev: &str, state: &str| {
            let p = root.join(dev).join("ports/1");
            fs::create_dir_all(p.join("gids")).unwrap();
            fs::create_dir_all(p.join("gid_attrs/types")).unwrap();
            fs::write(p.join("state"), state).unwrap();
            p
        };
        let down = port("a_down0", "1: DOWN\n");
        fs::write(down.join("gids/0"), "0000:0000:0000:0000:0000:ffff:0a00:0001\n").unwrap();
        let up = port("b_up0", "4: ACTIVE\n");
        for (i, kind, gid) in [
            (0, "IB/RoCE v1", "fe80:0000:0000:0000:5054:00ff:fe12:3456"),
            (1, "RoCE v2", "fe80:0000:0000:0000:5054:00ff:fe12:3456"),
            (2, "IB/RoCE v1", "0000:0000:0000:0000:0000:ffff:0a00:0002"),
            (3, "RoCE v2", "0000:0000:0000:0000:0000:ffff:0a00:0002"),
        ] {
            fs::write(up.join(format!("gid_attrs/types/{i}")), format!("{kind}\n")).unwrap();
            fs::write(up.join(format!("gids/{i}")), format!("{gid}\n")).unwrap();
        }
        let found = host_device_in(&root);
        let _ = fs::remove_dir_all(&root);
        assert_eq!(
            found,
            Some(HostDevice { name: "b_up0".into(), gid_index: Some(3), ipv4: Some("10.0.0.2".into()) })
        );
        assert_eq!(host_device_in(Path::new("/nonexistent")), None);
    }
}
