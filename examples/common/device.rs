//! Opening a device and checking a port and GID index, before anything waits for a peer.
#![allow(dead_code)] // each example uses a part of this module

use ibverbs::{Context, PortAttr, PortState};

/// Opens the device named `name`, or the first one. The error names the devices that exist.
pub fn open_device(name: Option<&str>) -> Result<Context, String> {
    let list = ibverbs::devices().map_err(|e| format!("Failed to get IB devices list: {e}"))?;
    let names: Vec<&str> = list.iter().map(|d| d.name()).collect();
    let device = match name {
        Some(name) => list.iter().find(|d| d.name() == name).ok_or_else(|| {
            let present = if names.is_empty() { "none".to_string() } else { names.join(", ") };
            format!("IB device {name} not found (devices present: {present})")
        })?,
        None => list.get(0).ok_or("No IB devices found")?,
    };
    device.open().map_err(|e| format!("Couldn't get context for {}: {e}", device.name()))
}

/// Queries `port` of `ctx`, with a message naming the ports that exist when it does not.
pub fn query_port(ctx: &Context, port: u8) -> Result<PortAttr, String> {
    let count = ctx.query_device().map(|d| d.phys_port_cnt()).unwrap_or(0);
    if port == 0 || (count > 0 && port > count) {
        return Err(format!("{} has no port {port} (its ports: 1..={count})", ctx.name()));
    }
    ctx.query_port(port).map_err(|e| format!("Couldn't get port info of port {port} of {}: {e}", ctx.name()))
}

/// Like [`query_port`], and the port must be active (as perftest checks).
pub fn active_port(ctx: &Context, port: u8) -> Result<PortAttr, String> {
    let attr = query_port(ctx, port)?;
    if attr.state() != PortState::ACTIVE {
        return Err(format!("port {port} of {} is {}, not active", ctx.name(), attr.state().as_str()));
    }
    Ok(attr)
}

/// Checks that GID `index` of `port` holds a GID.
pub fn check_gid_index(ctx: &Context, port: u8, index: u32) -> Result<(), String> {
    ctx.query_gid(port, index).map(drop).map_err(|e| {
        let len = ctx.query_port(port).map(|p| p.gid_tbl_len()).unwrap_or(0);
        format!("no GID at index {index} of port {port} of {} (table of {len} entries): {e}", ctx.name())
    })
}

/// Refuses an iWARP device unless the program connects through RDMA-CM (`-R`): iWARP queue
/// pairs connect no other way, and saying so up front beats failing at the first connect.
pub fn require_rdma_cm_on_iwarp(ctx: &Context, rdma_cm: bool) -> Result<(), String> {
    if ctx.is_iwarp() && !rdma_cm {
        return Err(format!(
            "{} is an iWARP device: its queue pairs connect only through RDMA-CM (use -R on both sides)",
            ctx.name()
        ));
    }
    Ok(())
}
