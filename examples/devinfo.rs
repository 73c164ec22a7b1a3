//! `devinfo`: rdma-core's `ibv_devinfo` on the safe API: the attributes of each RDMA device and of
//! its ports, in the C tool's format (`-v` for all of them and the GID tables, `-d` for one device,
//! `-i` for one port, `-l` for the device names).
//!
//! The basic attributes come from [`Context::query_device`] and [`Context::query_port`], the GID
//! table from [`Context::gid_table`]. The extended attributes that `-v` shows (ODP, TSO, RSS, ...)
//! come from [`Context::query_device_ex`] (`ibv_query_device_ex()`); [`ibverbs::ffi`] gives
//! only the names of their flag bits.
//!
//! When the environment selects devices (`IBVERBS_HCA` or `NCCL_IB_HCA`, and the GID/MTU
//! variables of `ibverbs::select`), only the selected, usable ports and their devices are shown:
//! `NCCL_IB_HCA=^rxe1 devinfo` lists what a job would use. The flags win: with `-d` the
//! environment is ignored, `-i` picks the port of the selected devices; `--all` ignores it.

mod common;
mod selection;

use std::fmt::Write as _;
use std::process::ExitCode;

use clap::Parser;
use ibverbs::ffi;
use ibverbs::{Context, Device, GidEntry, GidType, LinkLayer, PortAttr};

/// Print the attributes of the RDMA devices (like ibv_devinfo).
#[derive(Debug, Parser)]
#[command(name = "devinfo")]
struct Args {
    /// Use IB device DEV (default: all devices)
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    ib_dev: Option<String>,
    /// Use port PORT of the IB device (default: all ports)
    #[arg(short = 'i', long = "ib-port", value_name = "PORT", value_parser = clap::value_parser!(u8).range(1..))]
    ib_port: Option<u8>,
    /// Print only the IB devices names
    #[arg(short = 'l', long)]
    list: bool,
    /// Print all the attributes of the IB device(s)
    #[arg(short = 'v', long)]
    verbose: bool,
    /// Show every device and port, ignoring IBVERBS_HCA/NCCL_IB_HCA and the other selection
    /// variables
    #[arg(short = 'a', long)]
    all: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let list = match ibverbs::devices() {
        Ok(list) => list,
        Err(e) => {
            eprintln!("devinfo: Failed to get IB devices list: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The environment's selection, unless a flag names the device.
    let env = if args.all || args.ib_dev.is_some() {
        None
    } else {
        match selection::read("devinfo", &list) {
            Ok(env) => env,
            Err(e) => {
                eprintln!("devinfo: {e}");
                return ExitCode::FAILURE;
            }
        }
    };
    let in_env = |d: &Device<'_>| env.as_ref().map_or(true, |env| env.has_device(d.name()));
    if args.list {
        let names: Vec<&str> = list.iter().filter(in_env).map(|d| d.name()).collect();
        let n = names.len();
        println!("{n} HCA{} found:", if n == 1 { "" } else { "s" });
        for name in names {
            println!("\t{name}");
        }
        println!();
        return ExitCode::SUCCESS;
    }
    let selected: Vec<Device<'_>> = match &args.ib_dev {
        Some(name) => match list.iter().find(|d| d.name() == name) {
            Some(device) => vec![device],
            None => {
                let names: Vec<&str> = list.iter().map(|d| d.name()).collect();
                let present = if names.is_empty() { "none".to_string() } else { names.join(", ") };
                eprintln!("devinfo: IB device '{name}' wasn't found (devices present: {present})");
                return ExitCode::FAILURE;
            }
        },
        None if list.is_empty() => {
            eprintln!(
                "devinfo: No IB devices found ({})",
                ibverbs::diag::SystemReport::gather().no_device_hint()
            );
            return ExitCode::FAILURE;
        }
        None => list.iter().filter(in_env).collect(),
    };
    // Ports: `-i`, else the environment's for the device, else all.
    let ports = |device: &str, port: u8| match (args.ib_port, &env) {
        (Some(p), _) => p == port,
        (None, Some(env)) => env.has_port(device, port),
        (None, None) => true,
    };
    let mut ok = true;
    for device in selected {
        // Print what was gathered even when a later query fails, as the C tool does.
        let mut out = String::new();
        let result = print_hca_cap(&mut out, &device, args.ib_port, &ports, args.verbose);
        print!("{out}");
        if let Err(e) = result {
            eprintln!("devinfo: {}: {e}", device.name());
            ok = false;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `ibv_query_device_ex()`: the basic attributes and the extended ones.
fn query_device_ex(ctx: &Context) -> Result<ffi::ibv_device_attr_ex, String> {
    ctx.query_device_ex().map(|a| a.0).map_err(|e| format!("Failed to query device props: {e}"))
}

fn transport_str(t: i32) -> &'static str {
    match t {
        0 => "InfiniBand",
        1 => "iWARP",
        2 => "usNIC",
        3 => "usNIC UDP",
        4 => "unspecified",
        _ => "invalid transport",
    }
}

fn port_state_str(s: u32) -> &'static str {
    match s {
        1 => "PORT_DOWN",
        2 => "PORT_INIT",
        3 => "PORT_ARMED",
        4 => "PORT_ACTIVE",
        _ => "invalid state",
    }
}

fn port_phy_state_str(s: u8) -> &'static str {
    match s {
        1 => "SLEEP",
        2 => "POLLING",
        3 => "DISABLED",
        4 => "PORT_CONFIGURATION TRAINNING",
        5 => "LINK_UP",
        6 => "LINK_ERROR_RECOVERY",
        7 => "PHY TEST",
        _ => "invalid physical state",
    }
}

fn atomic_cap_str(a: u32) -> &'static str {
    match a {
        0 => "ATOMIC_NONE",
        1 => "ATOMIC_HCA",
        2 => "ATOMIC_GLOB",
        _ => "invalid atomic capability",
    }
}

fn mtu_str(m: u32) -> String {
    match ibverbs::Mtu(m).bytes() {
        Some(b) => b.to_string(),
        None => "invalid MTU".to_string(),
    }
}

fn width_str(w: u8) -> &'static str {
    match w {
        1 => "1",
        2 => "4",
        4 => "8",
        8 => "12",
        16 => "2",
        _ => "invalid width",
    }
}

fn speed_str(s: u8) -> &'static str {
    match s {
        1 => "2.5 Gbps",
        2 => "5.0 Gbps",
        4 | 8 => "10.0 Gbps",
        16 => "14.0 Gbps",
        32 => "25.0 Gbps",
        64 => "50.0 Gbps",
        128 => "100.0 Gbps",
        _ => "invalid speed",
    }
}

fn vl_str(v: u8) -> &'static str {
    match v {
        1 => "1",
        2 => "2",
        3 => "4",
        4 => "8",
        5 => "15",
        _ => "invalid value",
    }
}

fn link_layer_str(l: LinkLayer) -> &'static str {
    match l {
        LinkLayer::UNSPECIFIED => "Unspecified",
        LinkLayer::INFINIBAND => "InfiniBand",
        LinkLayer::ETHERNET => "Ethernet",
        _ => "Unknown",
    }
}

/// Prints the names of the flags set in `value`, one per line, then the unknown ones.
fn print_flags(out: &mut String, value: u64, known: &[(u64, &str)]) {
    let mut unknown = value;
    for &(bit, name) in known {
        if value & bit != 0 {
            let _ = writeln!(out, "\t\t\t\t\t{name}");
        }
        unknown &= !bit;
    }
    if unknown != 0 {
        let _ = writeln!(out, "\t\t\t\t\tUnknown flags: 0x{unknown:X}");
    }
}

fn print_device_cap_flags(out: &mut String, flags: u32) {
    use ffi::ibv_device_cap_flags as F;
    let known = [
        (F::IBV_DEVICE_RESIZE_MAX_WR, "RESIZE_MAX_WR"),
        (F::IBV_DEVICE_BAD_PKEY_CNTR, "BAD_PKEY_CNTR"),
        (F::IBV_DEVICE_BAD_QKEY_CNTR, "BAD_QKEY_CNTR"),
        (F::IBV_DEVICE_RAW_MULTI, "RAW_MULTI"),
        (F::IBV_DEVICE_AUTO_PATH_MIG, "AUTO_PATH_MIG"),
        (F::IBV_DEVICE_CHANGE_PHY_PORT, "CHANGE_PHY_PORT"),
        (F::IBV_DEVICE_UD_AV_PORT_ENFORCE, "UD_AV_PORT_ENFORCE"),
        (F::IBV_DEVICE_CURR_QP_STATE_MOD, "CURR_QP_STATE_MOD"),
        (F::IBV_DEVICE_SHUTDOWN_PORT, "SHUTDOWN_PORT"),
        (F::IBV_DEVICE_INIT_TYPE, "INIT_TYPE"),
        (F::IBV_DEVICE_PORT_ACTIVE_EVENT, "PORT_ACTIVE_EVENT"),
        (F::IBV_DEVICE_SYS_IMAGE_GUID, "SYS_IMAGE_GUID"),
        (F::IBV_DEVICE_RC_RNR_NAK_GEN, "RC_RNR_NAK_GEN"),
        (F::IBV_DEVICE_SRQ_RESIZE, "SRQ_RESIZE"),
        (F::IBV_DEVICE_N_NOTIFY_CQ, "N_NOTIFY_CQ"),
        (F::IBV_DEVICE_MEM_WINDOW, "MEM_WINDOW"),
        (F::IBV_DEVICE_UD_IP_CSUM, "UD_IP_CSUM"),
        (F::IBV_DEVICE_XRC, "XRC"),
        (F::IBV_DEVICE_MEM_MGT_EXTENSIONS, "MEM_MGT_EXTENSIONS"),
        (F::IBV_DEVICE_MEM_WINDOW_TYPE_2A, "MEM_WINDOW_TYPE_2A"),
        (F::IBV_DEVICE_MEM_WINDOW_TYPE_2B, "MEM_WINDOW_TYPE_2B"),
        (F::IBV_DEVICE_RC_IP_CSUM, "RC_IP_CSUM"),
        (F::IBV_DEVICE_RAW_IP_CSUM, "RAW_IP_CSUM"),
        (F::IBV_DEVICE_MANAGED_FLOW_STEERING, "MANAGED_FLOW_STEERING"),
    ]
    .map(|(f, name)| (u64::from(f.0), name));
    print_flags(out, u64::from(flags), &known);
}

fn print_odp_trans_caps(out: &mut String, caps: u32) {
    use ffi::ibv_odp_transport_cap_bits as B;
    if caps == 0 {
        let _ = writeln!(out, "\t\t\t\t\tNO SUPPORT");
        return;
    }
    let known = [
        (B::IBV_ODP_SUPPORT_SEND, "SUPPORT_SEND"),
        (B::IBV_ODP_SUPPORT_RECV, "SUPPORT_RECV"),
        (B::IBV_ODP_SUPPORT_WRITE, "SUPPORT_WRITE"),
        (B::IBV_ODP_SUPPORT_READ, "SUPPORT_READ"),
        (B::IBV_ODP_SUPPORT_ATOMIC, "SUPPORT_ATOMIC"),
        (B::IBV_ODP_SUPPORT_SRQ_RECV, "SUPPORT_SRQ"),
    ]
    .map(|(f, name)| (u64::from(f.0), name));
    print_flags(out, u64::from(caps), &known);
}

fn print_odp_caps(out: &mut String, attr: &ffi::ibv_device_attr_ex) {
    use ffi::ibv_odp_general_caps as G;
    let caps = &attr.odp_caps;
    let _ = writeln!(out, "\tgeneral_odp_caps:");
    let known = [(G::IBV_ODP_SUPPORT, "ODP_SUPPORT"), (G::IBV_ODP_SUPPORT_IMPLICIT, "ODP_SUPPORT_IMPLICIT")]
        .map(|(f, name)| (u64::from(f.0), name));
    print_flags(out, caps.general_caps, &known);
    for (name, value) in [
        ("rc", caps.per_transport_caps.rc_odp_caps),
        ("uc", caps.per_transport_caps.uc_odp_caps),
        ("ud", caps.per_transport_caps.ud_odp_caps),
        ("xrc", attr.xrc_odp_caps),
    ] {
        let _ = writeln!(out, "\t{name}_odp_caps:");
        print_odp_trans_caps(out, value);
    }
}

/// The "supported_qp" lists of the TSO, RSS and packet pacing capabilities.
fn print_supported_qpts(out: &mut String, qpts: u32) {
    let raw = 1u64 << ffi::ibv_qp_type::IBV_QPT_RAW_PACKET.0;
    let ud = 1u64 << ffi::ibv_qp_type::IBV_QPT_UD.0;
    let _ = writeln!(out, "\t\tsupported_qp:");
    print_flags(out, u64::from(qpts), &[(raw, "SUPPORT_RAW_PACKET"), (ud, "SUPPORT_UD")]);
}

fn print_extended(out: &mut String, attr: &ffi::ibv_device_attr_ex) {
    if attr.completion_timestamp_mask != 0 {
        let _ = writeln!(out, "\tcompletion timestamp_mask:\t\t\t0x{:016x}", attr.completion_timestamp_mask);
    } else {
        let _ = writeln!(out, "\tcompletion_timestamp_mask not supported");
    }
    if attr.hca_core_clock != 0 {
        let _ = writeln!(out, "\thca_core_clock:\t\t\t{}kHZ", attr.hca_core_clock);
    } else {
        let _ = writeln!(out, "\tcore clock not supported");
    }
    if attr.raw_packet_caps != 0 {
        use ffi::ibv_raw_packet_caps as R;
        let _ = writeln!(out, "\traw packet caps:");
        for (cap, name) in [
            (R::IBV_RAW_PACKET_CAP_CVLAN_STRIPPING, "C-VLAN stripping offload"),
            (R::IBV_RAW_PACKET_CAP_SCATTER_FCS, "Scatter FCS offload"),
            (R::IBV_RAW_PACKET_CAP_IP_CSUM, "IP csum offload"),
            (R::IBV_RAW_PACKET_CAP_DELAY_DROP, "Delay drop"),
        ] {
            if attr.raw_packet_caps & cap.0 != 0 {
                let _ = writeln!(out, "\t\t\t\t\t{name}");
            }
        }
    }
    let _ = writeln!(out, "\tdevice_cap_flags_ex:\t\t0x{:X}", attr.device_cap_flags_ex);
    let ex = attr.device_cap_flags_ex & 0xffff_ffff_0000_0000;
    print_flags(
        out,
        ex,
        &[
            (ffi::IBV_DEVICE_RAW_SCATTER_FCS, "RAW_SCATTER_FCS"),
            (ffi::IBV_DEVICE_PCI_WRITE_END_PADDING, "PCI_WRITE_END_PADDING"),
        ],
    );

    let tso = &attr.tso_caps;
    let _ = writeln!(out, "\ttso_caps:");
    let _ = writeln!(out, "\t\tmax_tso:\t\t\t{}", tso.max_tso as i32);
    if tso.max_tso != 0 {
        print_supported_qpts(out, tso.supported_qpts);
    }

    let rss = &attr.rss_caps;
    let _ = writeln!(out, "\trss_caps:");
    let _ = writeln!(out, "\t\tmax_rwq_indirection_tables:\t\t\t{}", rss.max_rwq_indirection_tables);
    let _ = writeln!(out, "\t\tmax_rwq_indirection_table_size:\t\t\t{}", rss.max_rwq_indirection_table_size);
    let _ = writeln!(out, "\t\trx_hash_function:\t\t\t\t0x{:x}", rss.rx_hash_function);
    let _ = writeln!(out, "\t\trx_hash_fields_mask:\t\t\t\t0x{:X}", rss.rx_hash_fields_mask);
    if rss.supported_qpts != 0 {
        print_supported_qpts(out, rss.supported_qpts);
    }
    let _ = writeln!(out, "\tmax_wq_type_rq:\t\t\t{}", attr.max_wq_type_rq);

    let pacing = &attr.packet_pacing_caps;
    let _ = writeln!(out, "\tpacket_pacing_caps:");
    let _ = writeln!(out, "\t\tqp_rate_limit_min:\t{}kbps", pacing.qp_rate_limit_min);
    let _ = writeln!(out, "\t\tqp_rate_limit_max:\t{}kbps", pacing.qp_rate_limit_max);
    if pacing.qp_rate_limit_max != 0 {
        print_supported_qpts(out, pacing.supported_qpts);
    }

    let tm = &attr.tm_caps;
    if tm.max_num_tags != 0 {
        let _ = writeln!(out, "\tmax_rndv_hdr_size:\t\t{}", tm.max_rndv_hdr_size);
        let _ = writeln!(out, "\tmax_num_tags:\t\t\t{}", tm.max_num_tags);
        let _ = writeln!(out, "\tmax_ops:\t\t\t{}", tm.max_ops);
        let _ = writeln!(out, "\tmax_sge:\t\t\t{}", tm.max_sge);
        let _ = writeln!(out, "\tflags:");
        if tm.flags & ffi::ibv_tm_cap_flags::IBV_TM_CAP_RC.0 != 0 {
            let _ = writeln!(out, "\t\t\t\t\tIBV_TM_CAP_RC");
        }
    } else {
        let _ = writeln!(out, "\ttag matching not supported");
    }

    let cq_mod = &attr.cq_mod_caps;
    if cq_mod.max_cq_count != 0 && cq_mod.max_cq_period != 0 {
        let _ = writeln!(out, "\n\tcq moderation caps:");
        let _ = writeln!(out, "\t\tmax_cq_count:\t{}", cq_mod.max_cq_count);
        let _ = writeln!(out, "\t\tmax_cq_period:\t{} us\n", cq_mod.max_cq_period);
    }
    if attr.max_dm_size != 0 {
        let _ = writeln!(out, "\tmaximum available device memory:\t{}Bytes\n", attr.max_dm_size);
    }
}

fn print_device_verbose(out: &mut String, ctx: &Context, attr: &ffi::ibv_device_attr_ex) {
    let a = &attr.orig_attr;
    let _ = writeln!(out, "\tmax_mr_size:\t\t\t0x{:x}", a.max_mr_size);
    let _ = writeln!(out, "\tpage_size_cap:\t\t\t0x{:x}", a.page_size_cap);
    let _ = writeln!(out, "\tmax_qp:\t\t\t\t{}", a.max_qp);
    let _ = writeln!(out, "\tmax_qp_wr:\t\t\t{}", a.max_qp_wr);
    let _ = writeln!(out, "\tdevice_cap_flags:\t\t0x{:08x}", a.device_cap_flags);
    print_device_cap_flags(out, a.device_cap_flags);
    for (name, tabs, value) in [
        ("max_sge", 3, a.max_sge),
        ("max_sge_rd", 3, a.max_sge_rd),
        ("max_cq", 4, a.max_cq),
        ("max_cqe", 3, a.max_cqe),
        ("max_mr", 4, a.max_mr),
        ("max_pd", 4, a.max_pd),
        ("max_qp_rd_atom", 3, a.max_qp_rd_atom),
        ("max_ee_rd_atom", 3, a.max_ee_rd_atom),
        ("max_res_rd_atom", 2, a.max_res_rd_atom),
        ("max_qp_init_rd_atom", 2, a.max_qp_init_rd_atom),
        ("max_ee_init_rd_atom", 2, a.max_ee_init_rd_atom),
    ] {
        let _ = writeln!(out, "\t{name}:{}{value}", "\t".repeat(tabs));
    }
    let _ = writeln!(out, "\tatomic_cap:\t\t\t{} ({})", atomic_cap_str(a.atomic_cap.0), a.atomic_cap.0);
    for (name, tabs, value) in [
        ("max_ee", 4, a.max_ee),
        ("max_rdd", 3, a.max_rdd),
        ("max_mw", 4, a.max_mw),
        ("max_raw_ipv6_qp", 2, a.max_raw_ipv6_qp),
        ("max_raw_ethy_qp", 2, a.max_raw_ethy_qp),
        ("max_mcast_grp", 3, a.max_mcast_grp),
        ("max_mcast_qp_attach", 2, a.max_mcast_qp_attach),
        ("max_total_mcast_qp_attach", 1, a.max_total_mcast_qp_attach),
        ("max_ah", 4, a.max_ah),
        ("max_fmr", 3, a.max_fmr),
    ] {
        let _ = writeln!(out, "\t{name}:{}{value}", "\t".repeat(tabs));
    }
    if a.max_fmr != 0 {
        let _ = writeln!(out, "\tmax_map_per_fmr:\t\t{}", a.max_map_per_fmr);
    }
    let _ = writeln!(out, "\tmax_srq:\t\t\t{}", a.max_srq);
    if a.max_srq != 0 {
        let _ = writeln!(out, "\tmax_srq_wr:\t\t\t{}", a.max_srq_wr);
        let _ = writeln!(out, "\tmax_srq_sge:\t\t\t{}", a.max_srq_sge);
    }
    let _ = writeln!(out, "\tmax_pkeys:\t\t\t{}", a.max_pkeys);
    let _ = writeln!(out, "\tlocal_ca_ack_delay:\t\t{}", a.local_ca_ack_delay);
    print_odp_caps(out, attr);
    print_extended(out, attr);
    let vectors = ctx.num_comp_vectors();
    let _ = writeln!(out, "\tnum_comp_vectors:\t\t{vectors}");
}

fn print_port_verbose(out: &mut String, port: &PortAttr, is_ib_transport: bool) {
    let p = &port.0;
    let _ = writeln!(out, "\t\t\tmax_msg_sz:\t\t0x{:x}", p.max_msg_sz);
    let _ = writeln!(out, "\t\t\tport_cap_flags:\t\t0x{:08x}", p.port_cap_flags);
    let _ = writeln!(out, "\t\t\tport_cap_flags2:\t0x{:04x}", p.port_cap_flags2);
    let _ = writeln!(out, "\t\t\tmax_vl_num:\t\t{} ({})", vl_str(p.max_vl_num), p.max_vl_num);
    let _ = writeln!(out, "\t\t\tbad_pkey_cntr:\t\t0x{:x}", p.bad_pkey_cntr);
    let _ = writeln!(out, "\t\t\tqkey_viol_cntr:\t\t0x{:x}", p.qkey_viol_cntr);
    let _ = writeln!(out, "\t\t\tsm_sl:\t\t\t{}", p.sm_sl);
    let _ = writeln!(out, "\t\t\tpkey_tbl_len:\t\t{}", p.pkey_tbl_len);
    let _ = writeln!(out, "\t\t\tgid_tbl_len:\t\t{}", p.gid_tbl_len);
    let _ = writeln!(out, "\t\t\tsubnet_timeout:\t\t{}", p.subnet_timeout);
    let _ = writeln!(out, "\t\t\tinit_type_reply:\t{}", p.init_type_reply);
    let _ = writeln!(out, "\t\t\tactive_width:\t\t{}X ({})", width_str(p.active_width), p.active_width);
    let _ = writeln!(out, "\t\t\tactive_speed:\t\t{} ({})", speed_str(p.active_speed), p.active_speed);
    if is_ib_transport {
        let _ = writeln!(out, "\t\t\tphys_state:\t\t{} ({})", port_phy_state_str(p.phys_state), p.phys_state);
    }
}

/// The port's populated GID entries: from one `ibv_query_gid_table()`, or entry by entry where
/// that is not supported.
fn gid_entries(ctx: &Context, port_num: u8, port: &PortAttr) -> Result<Vec<GidEntry>, String> {
    if let Ok(table) = ctx.gid_table(port_num) {
        return Ok(table);
    }
    let mut entries = Vec::new();
    for index in 0..port.gid_tbl_len() {
        match ctx.query_gid(port_num, index) {
            Ok(entry) => entries.push(entry),
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {} // an empty entry
            Err(e) => return Err(format!("Failed to query gid to port {port_num}, index {index}: {e}")),
        }
    }
    Ok(entries)
}

fn print_gids(out: &mut String, entries: &[GidEntry], link_layer: LinkLayer) {
    for entry in entries.iter().filter(|e| !common::interface_id_is_zero(&e.gid)) {
        let suffix = if link_layer == LinkLayer::ETHERNET {
            format!(", {}", entry.gid_type.as_str())
        } else {
            String::new()
        };
        let i = entry.index;
        match entry.gid_type {
            // `ibv_devinfo` shows IB and RoCE v1 GIDs in groups of four hex digits...
            GidType::IB | GidType::ROCE_V1 => {
                let _ = writeln!(out, "\t\t\tGID[{i:3}]:\t\t{}{suffix}", entry.gid);
            }
            // ... and RoCE v2 GIDs as IPv6 addresses.
            GidType::ROCE_V2 => {
                let _ = writeln!(out, "\t\t\tGID[{i:3}]:\t\t{}{suffix}", common::ntop(&entry.gid.0));
            }
            _ => {}
        }
    }
}

/// Reads `/sys/class/infiniband/<dev>/board_id`, as `ibv_devinfo` does (not every driver has it).
fn board_id(device: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/sys/class/infiniband/{device}/board_id")).ok()?;
    (!text.is_empty()).then(|| text.strip_suffix('\n').unwrap_or(&text).to_string())
}

fn print_hca_cap(
    out: &mut String,
    device: &Device<'_>,
    ib_port: Option<u8>,
    show_port: &dyn Fn(&str, u8) -> bool,
    verbose: bool,
) -> Result<(), String> {
    let ctx = device.open().map_err(|e| format!("Failed to open device: {e}"))?;
    let attr = query_device_ex(&ctx)?;
    let a = &attr.orig_attr;
    if ib_port.is_some_and(|p| p > a.phys_port_cnt) {
        return Err(format!("Invalid port requested for device (it has {} port(s))", a.phys_port_cnt));
    }
    let dev = ibverbs::DeviceAttr(*a);
    let transport = device.transport_type().0;
    let _ = writeln!(out, "hca_id:\t{}", device.name());
    let _ = writeln!(out, "\ttransport:\t\t\t{} ({transport})", transport_str(transport));
    let fw_ver = dev.fw_ver();
    if !fw_ver.is_empty() {
        let _ = writeln!(out, "\tfw_ver:\t\t\t\t{fw_ver}");
    }
    let _ = writeln!(out, "\tnode_guid:\t\t\t{}", dev.node_guid());
    let _ = writeln!(out, "\tsys_image_guid:\t\t\t{}", dev.sys_image_guid());
    let _ = writeln!(out, "\tvendor_id:\t\t\t0x{:04x}", a.vendor_id);
    let _ = writeln!(out, "\tvendor_part_id:\t\t\t{}", a.vendor_part_id as i32);
    let _ = writeln!(out, "\thw_ver:\t\t\t\t0x{:X}", a.hw_ver);
    if let Some(board) = board_id(device.name()) {
        let _ = writeln!(out, "\tboard_id:\t\t\t{board}");
    }
    let _ = writeln!(out, "\tphys_port_cnt:\t\t\t{}", a.phys_port_cnt);
    if verbose {
        print_device_verbose(out, &ctx, &attr);
    }

    for port_num in 1..=a.phys_port_cnt {
        if !show_port(device.name(), port_num) {
            continue;
        }
        let port =
            ctx.query_port(port_num).map_err(|e| format!("Failed to query port {port_num} props: {e}"))?;
        let p = &port.0;
        let _ = writeln!(out, "\t\tport:\t{port_num}");
        let _ = writeln!(out, "\t\t\tstate:\t\t\t{} ({})", port_state_str(p.state.0), p.state.0);
        let _ = writeln!(out, "\t\t\tmax_mtu:\t\t{} ({})", mtu_str(p.max_mtu.0), p.max_mtu.0);
        let _ = writeln!(out, "\t\t\tactive_mtu:\t\t{} ({})", mtu_str(p.active_mtu.0), p.active_mtu.0);
        let _ = writeln!(out, "\t\t\tsm_lid:\t\t\t{}", port.sm_lid());
        let _ = writeln!(out, "\t\t\tport_lid:\t\t{}", port.lid());
        let _ = writeln!(out, "\t\t\tport_lmc:\t\t0x{:02x}", port.lmc());
        let _ = writeln!(out, "\t\t\tlink_layer:\t\t{}", link_layer_str(port.link_layer()));
        if verbose {
            print_port_verbose(out, &port, transport == 0);
            print_gids(out, &gid_entries(&ctx, port_num, &port)?, port.link_layer());
        }
        let _ = writeln!(out);
    }
    Ok(())
}
