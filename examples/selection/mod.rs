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

/// Where a tool with device flags runs: its flags where given, else the environment's
/// selection (`IBVERBS_*`/`NCCL_IB_*`, see `ibverbs::select::Config`), else the first device,
/// port 1 and the automatic GID.
#[derive(Debug)]
pub struct Target {
    /// The opened device.
    pub ctx: ibverbs::Context,
    /// The port.
    pub port: u8,
    /// The GID index: the flag, else the environment's (an explicit index, or the one its
    /// automatic choice found), else `None` (the library's automatic choice).
    pub gid_index: Option<u32>,
    /// The environment's connection options (timeout, retry count, SL... or their defaults).
    pub connect: ibverbs::ConnectOptions,
    /// Whether the environment set the ACK timeout (`IBVERBS_TIMEOUT`/`NCCL_IB_TIMEOUT`).
    pub timeout_set: bool,
    /// Whether the environment set the retry count (`IBVERBS_RETRY_CNT`/`NCCL_IB_RETRY_CNT`).
    pub retry_set: bool,
}

/// Opens the [`Target`] of the flags `device` (`-d`), `port` (`-i`) and `gid` (`-g`/`-x`).
///
/// # Errors
/// An invalid environment variable (the message names it), whether or not flags are given; a
/// device that does not exist; a selection with no usable port.
pub fn target(device: Option<&str>, port: Option<u8>, gid: Option<u32>) -> Result<Target, String> {
    let config = Config::from_env().map_err(|e| e.to_string())?;
    let set =
        |names: [&str; 2]| config.settings.iter().any(|s| names.contains(&s.variable) && !s.value.is_empty());
    let timeout_set = set(["IBVERBS_TIMEOUT", "NCCL_IB_TIMEOUT"]);
    let retry_set = set(["IBVERBS_RETRY_CNT", "NCCL_IB_RETRY_CNT"]);
    let open = |name: Option<&str>| ibverbs::Context::open(name).map_err(|e| e.to_string());
    let (ctx, port, env_gid) = match device {
        // -d wins over the environment's device list.
        Some(name) => (open(Some(name))?, port.unwrap_or(1), config.connect.gid_index),
        None if config.selection.hca.is_all() => {
            let ctx = open(None)?;
            let port = port.unwrap_or(1);
            // A GID setting (range, family...) without a device list: the selection's choice on
            // this device and port, when it has one.
            let gid = if config.selection == Selection::default() {
                None
            } else {
                config
                    .select()
                    .map_err(|e| e.to_string())?
                    .iter()
                    .find(|c| c.device == ctx.name() && c.port == port)
                    .and_then(|c| config.connect_options(c).gid_index)
            };
            (ctx, port, gid.or(config.connect.gid_index))
        }
        None => {
            let choices = config.select().map_err(|e| e.to_string())?;
            let choice = match port {
                Some(p) => choices.iter().find(|c| c.port == p).ok_or_else(|| {
                    format!("port {p} is not among the selected ports ({})", config.describe())
                })?,
                None => choices.first().ok_or_else(|| format!("no usable port ({})", config.describe()))?,
            };
            let ctx = choice.open().map_err(|e| e.to_string())?;
            (ctx, choice.port, config.connect_options(choice).gid_index)
        }
    };
    Ok(Target { ctx, port, gid_index: gid.or(env_gid), connect: config.connect, timeout_set, retry_set })
}
