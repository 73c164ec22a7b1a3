//! RDMA Write bandwidth over a striped connection (`ibverbs::striped`): N queue pairs per
//! connection, like `NCCL_IB_QPS_PER_CONNECTION`. Both ends live in this process on one device
//! (loopback), so it needs no peer: `striped_bw --qps 1,2,4,8 -s 65536,1048576`.
//!
//! Device, port, GID index, timeout and retries come from `IBVERBS_*`/`NCCL_IB_*`
//! (`Config::from_env()`); `-d`/`-i`/`-g` win. Prints one row per (queue pairs, size): MB/s
//! (10^6 bytes per second) of `-n` messages with `-t` requests in flight.
//!
//! On an iWARP device, whose queue pairs connect only through RDMA-CM, each pair of queue pairs
//! connects through RDMA-CM at the port's address: `--ip`, else the first IPv4 address of the
//! port's network device (`Netdev::ipv4`); the connections are made with
//! `StripedConnection::from_queue_pairs`.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs::cm::{self, CmId, ConnParam, Listener};
use ibverbs::select::{Config, DeviceDesc};
use ibverbs::striped::{StripeOptions, StripedConnection};
use ibverbs::{AccessFlags, Context, ProtectionDomain, QpCaps};

/// How long each RDMA-CM step (resolving, connecting, accepting) may take.
const CM_WAIT: Duration = Duration::from_secs(10);

struct Args {
    device: Option<String>,
    port: Option<u8>,
    gid: Option<u32>,
    ip: Option<IpAddr>,
    qps: Vec<u32>,
    sizes: Vec<usize>,
    iters: usize,
    tx_depth: u32,
}

fn list<T: std::str::FromStr>(flag: &str, v: &str) -> Result<Vec<T>, String> {
    v.split(',').map(|x| x.parse().map_err(|_| format!("{flag}: bad value {x:?}"))).collect()
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        device: None,
        port: None,
        gid: None,
        ip: None,
        qps: vec![1, 2, 4, 8],
        sizes: vec![64 << 10, 1 << 20],
        iters: 1000,
        tx_depth: 32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "-d" | "--ib-dev" => a.device = Some(val()?),
            "-i" | "--ib-port" => a.port = Some(val()?.parse().map_err(|_| "-i: bad port".to_string())?),
            "-g" | "-x" | "--gid-idx" => {
                a.gid = Some(val()?.parse().map_err(|_| "-g: bad GID index".to_string())?)
            }
            "--ip" => a.ip = Some(val()?.parse().map_err(|_| "--ip: bad IP address".to_string())?),
            "--qps" => a.qps = list("--qps", &val()?)?,
            "-s" | "--size" => a.sizes = list("-s", &val()?)?,
            "-n" | "--iters" => a.iters = val()?.parse().map_err(|_| "-n: bad count".to_string())?,
            "-t" | "--tx-depth" => a.tx_depth = val()?.parse().map_err(|_| "-t: bad depth".to_string())?,
            "-h" | "--help" => {
                println!("usage: striped_bw [-d DEV] [-i PORT] [-g GID] [--ip ADDR (iWARP)] [--qps 1,2,4,8] [-s 65536,1048576] [-n ITERS] [-t DEPTH]");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    if a.qps.iter().any(|&q| q == 0 || q > 64)
        || a.sizes.contains(&0)
        || a.iters == 0
        || !(1..=1 << 16).contains(&a.tx_depth)
    {
        return Err("--qps in 1..=64, sizes and -n above 0, -t in 1..=65536".into());
    }
    Ok(a)
}

fn run(a: &Args) -> Result<(), String> {
    let config = Config::from_env().map_err(|e| e.to_string())?;
    let mut opts = config.connect.clone();
    let ctx = match &a.device {
        Some(name) => {
            opts.port = a.port.unwrap_or(1);
            ibverbs::Context::open(Some(name)).map_err(|e| e.to_string())?
        }
        None => {
            let (ctx, o) = config.open().map_err(|e| e.to_string())?;
            opts = o;
            if let Some(p) = a.port {
                opts.port = p;
            }
            ctx
        }
    };
    if let Some(g) = a.gid {
        opts.gid_index = Some(g);
    }
    // iWARP: RDMA-CM's context of the device (the queue pairs are made on its ids), and where.
    let (ctx, cm_at) = if ctx.is_iwarp() {
        let ip = match a.ip {
            Some(ip) => ip,
            None => port_ip(&ctx, opts.port)?,
        };
        let at = SocketAddr::new(ip, 0);
        let cm_ctx = cm::device_context(at, CM_WAIT).map_err(|e| format!("RDMA-CM at {ip}: {e}"))?;
        if cm_ctx.name() != ctx.name() {
            return Err(format!("{ip} is an address of {}, not of {}", cm_ctx.name(), ctx.name()));
        }
        (cm_ctx, Some(at))
    } else {
        (ctx, None)
    };
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let how = cm_at.map_or_else(String::new, |at| format!(", connected through RDMA-CM at {}", at.ip()));
    println!(
        "# striped_bw on {} port {}, {} messages per row, {} in flight{how}",
        ctx.name(),
        opts.port,
        a.iters,
        a.tx_depth
    );
    println!("{:>4} {:>10} {:>10}", "qps", "bytes", "MB/s");
    for &size in &a.sizes {
        let dst = pd
            .allocate_remote(size, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .map_err(|e| e.to_string())?;
        let src = Arc::new(pd.allocate(size).map_err(|e| e.to_string())?);
        for &qps in &a.qps {
            let stripe = StripeOptions { qps, depth: a.tx_depth, ..config.stripe.clone() };
            // The ids hold the RDMA-CM connections: kept for the row.
            let (mut x, _y, _ids) = match cm_at {
                Some(at) => cm_ends(&pd, &stripe, at)?,
                None => {
                    let mut x = StripedConnection::new(&pd, &stripe).map_err(|e| e.to_string())?;
                    let mut y = StripedConnection::new(&pd, &stripe).map_err(|e| e.to_string())?;
                    let ex = x.endpoints(&opts).map_err(|e| e.to_string())?;
                    let ey = y.endpoints(&opts).map_err(|e| e.to_string())?;
                    x.connect(&ey, &opts).map_err(|e| e.to_string())?;
                    y.connect(&ex, &opts).map_err(|e| e.to_string())?;
                    (x, y, Vec::new())
                }
            };
            let mut done = Vec::with_capacity(a.tx_depth as usize);
            let (mut posted, mut completed) = (0, 0);
            let start = Instant::now();
            let mut last = start;
            while completed < a.iters {
                while posted < a.iters && x.outstanding() < a.tx_depth as usize {
                    x.post_write(src.clone(), dst.remote(), posted as u64).map_err(|e| e.to_string())?;
                    posted += 1;
                }
                done.clear();
                if x.poll(&mut done).map_err(|e| e.to_string())? == 0 {
                    if last.elapsed() > Duration::from_secs(10) {
                        return Err(format!("no completion for 10 s ({completed} of {})", a.iters));
                    }
                    continue;
                }
                last = Instant::now();
                for c in &done {
                    if !c.is_ok() {
                        return Err(format!("request {} failed: {}", c.wr_id(), c.status().as_str()));
                    }
                }
                completed += done.len();
            }
            let secs = start.elapsed().as_secs_f64();
            println!("{qps:>4} {size:>10} {:>10.2}", (a.iters * size) as f64 / secs / 1e6);
        }
    }
    Ok(())
}

/// The first IPv4 address of the network device under `port` of `ctx`'s device, where RDMA-CM
/// reaches an iWARP port.
fn port_ip(ctx: &Context, port: u8) -> Result<IpAddr, String> {
    let desc = DeviceDesc::from_context(ctx).map_err(|e| e.to_string())?;
    let netdev =
        desc.ports.iter().find(|p| p.port == port).and_then(|p| p.netdev.as_ref()).ok_or_else(|| {
            format!("no network device found under port {port} of {}: give its address with --ip", ctx.name())
        })?;
    match netdev.ipv4() {
        Ok(Some(ip)) => Ok(IpAddr::V4(ip)),
        Ok(None) => {
            Err(format!("{} (under {}) has no IPv4 address: give one with --ip", netdev.name, ctx.name()))
        }
        Err(e) => Err(format!("the addresses of {}: {e}", netdev.name)),
    }
}

/// Two striped ends of `stripe.qps` queue pairs each, every pair connected through RDMA-CM at
/// `at`'s address (iWARP): `x`'s queue pairs connect, `y`'s are accepted. Returns the ids,
/// which hold the connections.
fn cm_ends(
    pd: &ProtectionDomain,
    stripe: &StripeOptions,
    at: SocketAddr,
) -> Result<(StripedConnection, StripedConnection, Vec<CmId>), String> {
    let ctx = pd.context();
    // As StripedConnection::new: room for each queue pair's sends and its one receive.
    let cq = || ctx.create_cq(stripe.qps * (stripe.depth + 1), None).map_err(|e| e.to_string());
    let (cq_x, cq_y) = (cq()?, cq()?);
    let caps = QpCaps { max_send_wr: stripe.depth, max_recv_wr: 1, ..QpCaps::default() };
    let param = ConnParam::default();
    let listener = Listener::bind(at).map_err(|e| format!("rdma_listen at {}: {e}", at.ip()))?;
    let at = listener.local_addr().ok_or("the listener has no address")?;
    let (mut qx, mut qy, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..stripe.qps {
        let (connected, accepted) = std::thread::scope(|s| {
            let server = s.spawn(|| listener.accept(pd, &cq_y, caps, &param, CM_WAIT));
            let connected = cm::connect(at, pd, &cq_x, caps, &param, CM_WAIT);
            (connected, server.join())
        });
        let (id_x, q_x) = connected.map_err(|e| format!("connecting: {e}"))?;
        let (id_y, q_y, _) =
            accepted.map_err(|_| "the accepting thread panicked")?.map_err(|e| format!("accepting: {e}"))?;
        qx.push(q_x);
        qy.push(q_y);
        ids.extend([id_x, id_y]);
    }
    let x = StripedConnection::from_queue_pairs(cq_x, qx, stripe).map_err(|e| e.to_string())?;
    let y = StripedConnection::from_queue_pairs(cq_y, qy, stripe).map_err(|e| e.to_string())?;
    Ok((x, y, ids))
}

fn main() -> ExitCode {
    match parse().and_then(|a| run(&a)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("striped_bw: {e}");
            ExitCode::FAILURE
        }
    }
}
