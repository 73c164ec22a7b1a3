//! The device selection of the environment (`IBVERBS_HCA`/`NCCL_IB_HCA`, the GID and MTU
//! variables: see `ibverbs::select`), for the tools that list devices: `devices`, `devinfo`,
//! `doctor`.
#![allow(dead_code)] // each example uses a part of this module

use ibverbs::select::{Choice, Config, Fabric, Selection};
use ibverbs::DeviceList;

/// What the environment selects: the configuration and the usable ports.
#[derive(Debug)]
pub struct FromEnv {
    /// The configuration read from the environment.
    pub config: Config,
    /// The usable ports, in order.
    pub chosen: Vec<Choice>,
}

/// Reads the environment. `Ok(None)` when no variable selects anything in particular: the
/// tools then show every device and port, as rdma-core's do. Entries of the device list that
/// match nothing are reported on stderr as `tool: warning: ...`.
///
/// # Errors
/// An invalid variable, or a selection with no usable port (the message lists every port and
/// why it is not usable).
pub fn read(tool: &str, list: &DeviceList) -> Result<Option<FromEnv>, String> {
    let config = Config::from_env().map_err(|e| e.to_string())?;
    if config.selection == Selection::default() {
        return Ok(None);
    }
    let fabric = Fabric::from_list(list);
    for entry in config.selection.evaluate(&fabric).unmatched {
        eprintln!("{tool}: warning: the device list entry {entry} matches no port ({})", config.describe());
    }
    let chosen = config.select_in(&fabric).map_err(|e| e.to_string())?;
    Ok(Some(FromEnv { config, chosen }))
}

impl FromEnv {
    /// Whether some port of `device` is selected.
    pub fn has_device(&self, device: &str) -> bool {
        self.chosen.iter().any(|c| c.device == device)
    }

    /// Whether port `port` of `device` is selected.
    pub fn has_port(&self, device: &str, port: u8) -> bool {
        self.chosen.iter().any(|c| c.device == device && c.port == port)
    }
}
