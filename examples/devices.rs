//! `devices`: rdma-core's `ibv_devices` on the safe API: lists the RDMA devices of this host with
//! their node GUIDs, in the C tool's format.

use std::process::ExitCode;

use clap::Parser;

/// List the RDMA devices of this host and their node GUIDs (like ibv_devices).
#[derive(Debug, Parser)]
#[command(name = "devices")]
struct Args {}

fn main() -> ExitCode {
    let Args {} = Args::parse();
    let list = match ibverbs::devices() {
        Ok(list) => list,
        Err(e) => {
            eprintln!("devices: Failed to get IB devices list: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("    {:<16}\t   node GUID", "device");
    println!("    {:<16}\t----------------", "------");
    for device in list.iter() {
        println!("    {:<16}\t{:016x}", device.name(), device.guid().0);
    }
    ExitCode::SUCCESS
}
