//! `doctor`: the checks an operator runs by hand before an RDMA job — `ls /dev/infiniband`,
//! `lsmod`, `ulimit -l`, `ibv_devices`, `ibv_devinfo -v` — in one go, and what the device
//! selection (`IBVERBS_HCA`/`NCCL_IB_HCA`, GID index, address family and range, MTU: see
//! `ibverbs::select`) would pick. For each device and port it prints what is usable and what is
//! wrong, with the fix; the exit status is 1 when nothing is usable (no usable port, a setting
//! that is not valid, or memory that cannot be registered), 0 otherwise.
//!
//! `-d`/`-i` name the device and port to check instead of the environment's list; the
//! registration probe (1 MiB by default: `--probe-size`, `--no-probe`) shows whether the
//! locked-memory limit lets memory be registered; a probe larger than the memory available
//! (`MemAvailable`) is not run, and named as a problem. Started by a launcher (`mpirun`, `srun`,
//! `torchrun`: `ibverbs::group::Launch`), it also prints the rank and the NICs (rails) a group
//! member of that local rank takes, nearest to its CPUs first, and why.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::ExitCode;

use clap::Parser;
use ibverbs::diag::{FileState, SystemReport};
use ibverbs::group::{plan_rails, GroupOptions, Launch};
use ibverbs::select::{Choice, Config, DeviceDesc, Fabric, HcaSelector, Outcome, PortDesc, PortProblem};
use ibverbs::{GidType, LinkLayer};

/// Rank variables of the launchers `Launch` reads (a set one that does not parse is a problem).
const LAUNCH_VARS: [&str; 4] = ["IBVERBS_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "RANK"];

/// Check this host's RDMA setup: device files, kernel modules, the locked-memory limit, each
/// device's ports and GIDs, and which port and GID the selection (IBVERBS_HCA/NCCL_IB_HCA...)
/// picks. Exit status 1 when nothing is usable.
#[derive(Debug, Parser)]
#[command(name = "doctor")]
struct Args {
    /// Check device DEV only (instead of IBVERBS_HCA/NCCL_IB_HCA)
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    ib_dev: Option<String>,
    /// Check port PORT only (with -d)
    #[arg(short = 'i', long = "ib-port", value_name = "PORT", requires = "ib_dev",
          value_parser = clap::value_parser!(u8).range(1..))]
    ib_port: Option<u8>,
    /// Bytes to register for the registration probe
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u64).range(1..=1 << 40))]
    probe_size: u64,
    /// Do not register memory to check the locked-memory limit
    #[arg(long)]
    no_probe: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut problems: Vec<String> = Vec::new();
    let mut fatal = false;

    let report = SystemReport::gather();
    println!("host");
    print_host(&report);
    problems.extend(report.problems());

    // The settings, and the selection they make (or the one the flags name).
    let mut config = match Config::from_env() {
        Ok(config) => config,
        Err(e) => {
            problems.push(format!("{e} (a job would refuse to start)"));
            fatal = true;
            Config::default()
        }
    };
    println!("  settings:          {}", config.describe());
    if let Some(dev) = &args.ib_dev {
        let text = match args.ib_port {
            Some(p) => format!("={dev}:{p}"),
            None => format!("={dev}"),
        };
        match HcaSelector::parse(&text) {
            Ok(hca) => config.selection.hca = hca,
            Err(e) => {
                eprintln!("doctor: bad device name: {e}");
                return ExitCode::FAILURE;
            }
        }
        println!("  checking:          {} (from the flags)", &text[1..]);
    }

    let (fabric, listed) = match Fabric::query() {
        Ok(fabric) => (fabric, true),
        Err(e) => {
            problems.push(e.to_string());
            (Fabric::default(), false)
        }
    };
    let outcome = config.selection.evaluate(&fabric);
    let chosen_first = outcome.chosen.first().cloned();

    // Every device libibverbs lists, then those only the kernel shows.
    for device in &fabric.devices {
        println!();
        print_device(device, &report, &outcome);
    }
    let kernel_only = Fabric::from_sysfs(Path::new("/")).unwrap_or_default();
    for device in kernel_only.devices.iter().filter(|d| fabric.device(&d.name).is_none()) {
        println!();
        print_kernel_only(device, &report);
        // With no usable device at all, the "no device" message below says the same.
        if !fabric.devices.is_empty() {
            problems.push(format!("{}: {}", device.name, kernel_only_reason(&device.name, &report)));
        }
    }
    if fabric.devices.is_empty() {
        println!();
        println!("devices: none that libibverbs can use");
    }
    if fabric.devices.is_empty() && listed {
        problems.push(
            ibverbs::Error::DeviceNotFound { name: "<any>".into(), available: "none".into() }.to_string(),
        );
    }

    // What the selection picks.
    println!();
    println!("selection ({})", config.selection);
    for entry in &outcome.unmatched {
        problems.push(format!("the device list entry {entry} matches no port ({})", config.describe()));
    }
    for r in outcome
        .rejected
        .iter()
        .filter(|r| !matches!(r.problem, PortProblem::NotListed | PortProblem::Excluded { .. }))
    {
        problems.push(r.to_string());
    }
    match &chosen_first {
        Some(first) => {
            let n = outcome.chosen.len();
            println!("  usable ports:      {n}: {}", list(&outcome.chosen));
            println!("  would use:         {first}");
            let o = config.connect_options(first);
            if first.iwarp {
                println!(
                    "  connect options:   none: iWARP queue pairs connect through RDMA-CM (ibverbs::cm)"
                );
            } else {
                println!(
                "  connect options:   port {}, GID index {}, path MTU {}, timeout {} ({}), retry_cnt {}, \
                 rnr_retry {}, sl {}, traffic class {}, P_Key index {}",
                o.port,
                o.gid_index.map_or_else(|| "none (LID)".to_string(), |i| i.to_string()),
                o.mtu.map_or_else(|| "the ports' active MTU".to_string(), |m| m.to_string()),
                o.timeout,
                ack_timeout(o.timeout),
                o.retry_cnt,
                o.rnr_retry,
                o.sl,
                o.traffic_class,
                o.pkey_index
            );
            }
        }
        None => {
            fatal = true;
            println!("  usable ports:      none");
            if !fabric.devices.is_empty() {
                if let Err(e) = config.select_in(&fabric) {
                    problems.push(e.to_string());
                }
            }
        }
    }

    // Under a launcher (mpirun, srun, torchrun): which NICs this rank would take as a group
    // member, and why (ibverbs::group's locality rule).
    match Launch::from_env() {
        Ok(launch) => {
            println!();
            println!(
                "rank {} of {} (local rank {}, {}{})",
                launch.rank,
                launch.size,
                launch.local_rank,
                launch.launcher,
                launch.rendezvous.as_deref().map_or_else(String::new, |r| format!(", rendezvous {r}"))
            );
            let opts = GroupOptions { config: Some(config.clone()), ..GroupOptions::default() };
            match plan_rails(launch.local_rank, &opts) {
                Ok(rails) => {
                    for (i, r) in rails.iter().enumerate() {
                        println!("  rail {i}:            {r}");
                    }
                }
                Err(e) => println!("  rails:             none: {e}"),
            }
        }
        Err(e) => {
            if let Some(var) = LAUNCH_VARS.iter().find(|v| std::env::var_os(v).is_some()) {
                problems
                    .push(format!("{var} is set but the launcher's variables do not describe a rank: {e}"));
            }
        }
    }

    // Whether memory can be registered on the device it would use.
    if let Some(first) = chosen_first.filter(|_| !args.no_probe) {
        let size = usize::try_from(args.probe_size).unwrap_or(usize::MAX);
        // Registering pins every page: more than the memory available would push the host
        // into swapping or the OOM killer (root has no locked-memory limit to stop it).
        if let Some(a) = available_memory().filter(|&a| args.probe_size > a) {
            let a = bytes(a);
            println!("  registration:      {} on {}: not run", bytes(args.probe_size), first.device);
            problems.push(format!(
                "the registration probe's {} is more than the {a} of memory available: pass a smaller --probe-size",
                bytes(args.probe_size)
            ));
        } else {
            let result = first.open().and_then(|ctx| ctx.alloc_pd()).and_then(|pd| pd.allocate(size));
            match result {
                Ok(_) => println!("  registration:      {} on {}: ok", bytes(args.probe_size), first.device),
                Err(e) => {
                    println!("  registration:      {} on {}: FAILED", bytes(args.probe_size), first.device);
                    problems.push(format!("registering {} on {}: {e}", bytes(args.probe_size), first.device));
                    fatal = true;
                }
            }
        }
    }

    // A problem some longer message already explains (a "no device" error quotes the host's
    // problems) is shown once.
    let all = problems.clone();
    problems.retain(|p| !all.iter().any(|q| q != p && q.contains(p.as_str())));
    problems.dedup();
    println!();
    if problems.is_empty() {
        println!("problems: none");
    } else {
        println!("problems:");
        for p in &problems {
            println!("  - {p}");
        }
    }
    if fatal {
        println!("verdict: NOTHING USABLE");
        ExitCode::FAILURE
    } else {
        println!("verdict: usable: {}", list(&outcome.chosen));
        ExitCode::SUCCESS
    }
}

/// `ls /dev/infiniband`, the kernel's devices and modules, `ulimit -l`.
fn print_host(r: &SystemReport) {
    let names = |v: &Option<Vec<String>>, missing: &str| match v {
        None => missing.to_string(),
        Some(v) if v.is_empty() => "(empty)".to_string(),
        Some(v) => v.join(" "),
    };
    println!("  /dev/infiniband:   {}", names(&r.dev_infiniband, "MISSING"));
    println!("  kernel devices:    {}", names(&r.kernel_devices, "none (/sys/class/infiniband missing)"));
    println!(
        "  kernel modules:    {}{}",
        r.modules_loaded(),
        if r.uverbs_loaded { "" } else { " (ib_uverbs NOT loaded)" }
    );
    match &r.memlock {
        Some(m) => {
            let note = if m.limits_registration() {
                ""
            } else if m.soft.is_some() && r.modules.iter().any(|x| x == "siw") {
                ": registrations are not limited, except siw's (it counts them against the limit \
                 whatever the capabilities)"
            } else {
                ": registrations are not limited"
            };
            println!("  locked memory:     {m} (RLIMIT_MEMLOCK, `ulimit -l`){note}")
        }
        None => println!("  locked memory:     unknown (getrlimit failed)"),
    }
}

/// The ports chosen, as `rxe0 port 1, rxe1 port 1`.
fn list(chosen: &[Choice]) -> String {
    chosen.iter().map(|c| format!("{} port {}", c.device, c.port)).collect::<Vec<_>>().join(", ")
}

/// A byte count: `1 MiB`, `64 KiB`, or bytes.
fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} bytes"),
    }
}

/// 4.096 µs × 2^timeout, readably.
fn ack_timeout(t: u8) -> String {
    if t == 0 {
        return "infinite".to_string();
    }
    let us = 4.096 * f64::from(1u32 << t.min(31));
    match us {
        us if us >= 1e6 => format!("{:.1} s", us / 1e6),
        us if us >= 1e3 => format!("{:.1} ms", us / 1e3),
        us => format!("{us:.1} us"),
    }
}

/// The device file line of `device`.
fn device_file(device: &str, report: &SystemReport) -> String {
    match report.uverbs.iter().find(|u| u.ibdev == device) {
        Some(u) => {
            let state = match u.file {
                FileState::Usable => "ok",
                FileState::Missing => "MISSING",
                FileState::NoAccess => "NO ACCESS",
            };
            format!("/dev/infiniband/{} ({state})", u.name)
        }
        None => "none (no uverbs device)".to_string(),
    }
}

fn print_device(device: &DeviceDesc, report: &SystemReport, outcome: &Outcome) {
    println!(
        "device {}: node GUID {}, device file {}",
        device.name,
        device.node_guid,
        device_file(&device.name, report)
    );
    if let Some(e) = &device.error {
        println!("  NOT USABLE: {e}");
        return;
    }
    for port in &device.ports {
        print_port(port, device.iwarp);
        let chosen = outcome.chosen.iter().find(|c| c.device == device.name && c.port == port.port);
        let rejected = outcome.rejected.iter().find(|r| r.device == device.name && r.port == Some(port.port));
        match (chosen, rejected) {
            (Some(c), _) => println!("    => usable: {}", usable(c)),
            (None, Some(r)) => match r.problem {
                PortProblem::NotListed | PortProblem::Excluded { .. } => println!("    => {}", r.problem),
                _ => println!("    => NOT USABLE: {}", r.problem),
            },
            (None, None) => {}
        }
    }
}

/// How a chosen port is addressed: `GID[1] 192.0.2.1 (RoCE v2)`, `LID 12` or `iWARP (RDMA-CM)`.
fn usable(c: &Choice) -> String {
    match c.gid {
        _ if c.iwarp => "iWARP: connect through RDMA-CM (ibverbs::cm), addressed by IP".to_string(),
        Some(g) => format!("GID[{}] {} ({})", g.index, g.gid.ip(), g.gid_type.as_str()),
        None => format!("LID {}", c.lid),
    }
}

/// A device the kernel has but libibverbs does not list.
fn print_kernel_only(device: &DeviceDesc, report: &SystemReport) {
    println!("device {}: in the kernel only, device file {}", device.name, device_file(&device.name, report));
    println!("  NOT USABLE: {}", kernel_only_reason(&device.name, report));
    for port in &device.ports {
        print_port(port, device.iwarp);
    }
}

fn kernel_only_reason(device: &str, report: &SystemReport) -> String {
    match report.uverbs.iter().find(|u| u.ibdev == device) {
        Some(u) if u.file == FileState::Missing => format!(
            "libibverbs cannot use it: its device file /dev/infiniband/{} is missing (not passed to \
             the container? `docker run --device=/dev/infiniband/{}`)",
            u.name, u.name
        ),
        Some(u) if u.file == FileState::NoAccess => {
            format!("libibverbs cannot use it: no read/write access to /dev/infiniband/{}", u.name)
        }
        Some(_) => "libibverbs does not list it: is the provider library for its driver installed \
                    (rdma-core's ibverbs-providers)?"
            .to_string(),
        None => "it has no user-space verbs device: is ib_uverbs loaded (`modprobe ib_uverbs`)?".to_string(),
    }
}

/// A port's state, link layer, MTU, network device and GID table (of an iWARP device's port if
/// `iwarp`).
fn print_port(port: &PortDesc, iwarp: bool) {
    let link = match port.link_layer {
        LinkLayer::ETHERNET if iwarp => {
            "Ethernet (iWARP: RDMA over TCP, connects through RDMA-CM)".to_string()
        }
        LinkLayer::ETHERNET => "Ethernet (RoCE: addressing by GID)".to_string(),
        LinkLayer::INFINIBAND | LinkLayer::UNSPECIFIED => format!("InfiniBand (LID {})", port.lid),
        other => format!("unknown ({})", other.0),
    };
    let mtu = port.active_mtu.map_or_else(|| "unknown".to_string(), |m| m.to_string());
    println!("  port {}: {}, {link}, active MTU {mtu}", port.port, port.state.as_str().to_uppercase());
    if let Some(n) = &port.netdev {
        let ndev_mtu = n.mtu.map_or_else(String::new, |m| format!(", MTU {m}"));
        println!("    network device: {} ({}{ndev_mtu})", n.name, n.oper_state);
        // Where RDMA-CM reaches the port (an iWARP port is addressed by IP alone).
        match n.addresses() {
            Ok(a) if a.is_empty() => println!("    IP addresses:   none (RDMA-CM cannot reach this port)"),
            Ok(a) => {
                let a: Vec<String> = a.iter().map(|a| a.to_string()).collect();
                println!("    IP addresses:   {}", a.join(", "));
            }
            Err(e) => println!("    IP addresses:   unknown (getifaddrs: {e})"),
        }
    }
    if port.gids.is_empty() {
        println!("    GID table: empty ({} entries)", port.gid_tbl_len);
    }
    let mut seen = BTreeSet::new();
    for g in &port.gids {
        let ip = g.gid.ip();
        let family = if ip.is_ipv4() { "IPv4" } else { "IPv6" };
        let kind = match g.gid_type {
            GidType::IB => "IB".to_string(),
            t => format!("{} {family}", t.as_str()),
        };
        let dup = if seen.insert(ip) { "" } else { " (same address, other type)" };
        println!("    GID[{:3}] {:<40} {kind}{dup}", g.index, ip.to_string());
    }
}

/// The memory available to new allocations without swapping, in bytes: `MemAvailable` of
/// `/proc/meminfo` (free pages and reclaimable caches), else the free pages
/// (`sysconf(_SC_AVPHYS_PAGES)`); `None` when neither says.
fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = meminfo.lines().find_map(|l| {
        let rest = l.strip_prefix("MemAvailable:")?;
        rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()
    });
    if let Some(kib) = kib {
        return Some(kib.saturating_mul(1024));
    }
    // SAFETY: sysconf reads system values; no pointer is involved.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_AVPHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages > 0 && page > 0).then(|| (pages as u64).saturating_mul(page as u64))
}
