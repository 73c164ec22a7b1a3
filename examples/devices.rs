//! `devices`: rdma-core's `ibv_devices` on the safe API: lists the RDMA devices of this host with
//! their node GUIDs, in the C tool's format.
//!
//! When the environment selects devices (`IBVERBS_HCA` or `NCCL_IB_HCA`, and the GID/MTU
//! variables of `ibverbs::select`), only the devices with a usable selected port are listed:
//! `NCCL_IB_HCA=^mlx5_1 devices` shows what a job would use. `--all` ignores the environment.

mod selection;

use std::process::ExitCode;

use clap::Parser;

/// List the RDMA devices of this host and their node GUIDs (like ibv_devices); with
/// IBVERBS_HCA/NCCL_IB_HCA set, only the devices that selection uses
#[derive(Debug, Parser)]
#[command(name = "devices")]
struct Args {
    /// List every device, ignoring IBVERBS_HCA/NCCL_IB_HCA and the other selection variables
    #[arg(short = 'a', long)]
    all: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let list = match ibverbs::devices() {
        Ok(list) => list,
        Err(e) => {
            eprintln!("devices: Failed to get IB devices list: {e}");
            return ExitCode::FAILURE;
        }
    };
    let selected = if args.all {
        None
    } else {
        match selection::read("devices", &list) {
            Ok(selected) => selected,
            Err(e) => {
                eprintln!("devices: {e}");
                return ExitCode::FAILURE;
            }
        }
    };
    println!("    {:<16}\t   node GUID", "device");
    println!("    {:<16}\t----------------", "------");
    for device in list.iter().filter(|d| selected.as_ref().map_or(true, |s| s.has_device(d.name()))) {
        println!("    {:<16}\t{:016x}", device.name(), device.guid().0);
    }
    ExitCode::SUCCESS
}
