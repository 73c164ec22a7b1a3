//! Collectives over a rank group, measured like nccl-tests: allreduce (a ring for large messages,
//! one all-to-all round for small ones), allgather, broadcast and barrier, every result checked.
//!
//! An example of embedding the crate in HPC code (the library part is `ibverbs::group`: ranks,
//! bootstrap, queue pairs); the algorithms here are the program's. Start it as any rank program:
//!
//! ```text
//! mpirun -n 4 --host a:2,b:2 -x IBVERBS_BOOTSTRAP=a:29500 target/release/examples/collectives -b 8 -e 64M -f 2
//! srun -N2 -n4 env IBVERBS_BOOTSTRAP=a:29500 target/release/examples/collectives
//! RANK=0 WORLD_SIZE=2 MASTER_ADDR=a MASTER_PORT=29500 target/release/examples/collectives   # and RANK=1
//! ```
//!
//! The output is nccl-tests' (`all_reduce_perf -b 8 -e 64M -f 2`): size, count, type, redop,
//! root, then time (µs), algbw and busbw (GB/s) and #wrong, out of place and in place; busbw is
//! algbw × 2(n−1)/n for allreduce, × (n−1)/n for allgather, × 1 for broadcast. With the `mpi`
//! feature, `--bootstrap mpi` uses MPI for the bootstrap and `--compare-mpi` times
//! `MPI_Allreduce` on the same sizes, alternating with ours round by round.

mod engine;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use ibverbs::group::{Bootstrap, Group, GroupOptions, RailPolicy, TcpBootstrap};

use engine::Engine;

#[derive(Parser, Debug)]
#[command(about = "Collectives over an RDMA rank group, in nccl-tests' format")]
struct Args {
    /// Smallest size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    min: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    max: usize,
    /// Size factor between steps.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u8,
    /// allreduce, allgather, broadcast, barrier or all.
    #[arg(long, default_value = "allreduce")]
    coll: String,
    /// env (the launcher's variables and a TCP rendezvous) or mpi (feature `mpi`).
    #[arg(long, default_value = "env")]
    bootstrap: String,
    /// Also time MPI_Allreduce, alternating with ours (feature `mpi`, under mpirun).
    #[arg(long)]
    compare_mpi: bool,
    /// Rounds of ours/MPI per size with --compare-mpi (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Rails: all (every NIC, nearest first) or nearest.
    #[arg(long, default_value = "all")]
    rails: String,
    /// Allreduce messages up to this size use one all-to-all round instead of the ring.
    #[arg(long, default_value = "32K", value_parser = parse_size)]
    small: usize,
    /// Bound on every wait, in seconds.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
    /// Print each rank's rails (which NIC, and why) before the table.
    #[arg(long)]
    describe: bool,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().map(|n| n * mult).map_err(|e| format!("{s:?}: {e}"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(wrong) => {
            eprintln!("collectives: {wrong} wrong values");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!(
                "collectives: rank {}: {e}",
                std::env::var("OMPI_COMM_WORLD_RANK").or_else(|_| std::env::var("RANK")).unwrap_or_default()
            );
            ExitCode::from(2)
        }
    }
}

fn options(args: &Args) -> Result<GroupOptions, String> {
    let rails = match args.rails.as_str() {
        "all" => RailPolicy::All,
        "nearest" => RailPolicy::Nearest,
        r => return Err(format!("--rails {r}: all or nearest")),
    };
    Ok(GroupOptions {
        rails,
        max_send_wr: 64,
        max_recv_wr: engine::DEPTH as u32 + 8,
        ..GroupOptions::default()
    })
}

fn run(args: &Args) -> Result<u64, String> {
    let opts = options(args)?;
    match args.bootstrap.as_str() {
        "env" => {
            #[cfg(feature = "mpi")]
            let universe =
                if args.compare_mpi { Some(mpi::initialize().ok_or("MPI_Init failed")?) } else { None };
            #[cfg(not(feature = "mpi"))]
            if args.compare_mpi {
                return Err("--compare-mpi needs the mpi feature".into());
            }
            let group = Group::create(TcpBootstrap::from_env().map_err(|e| e.to_string())?, &opts)
                .map_err(|e| e.to_string())?;
            #[cfg(feature = "mpi")]
            return bench(args, group, universe.as_ref().map(|u| u.world()));
            #[cfg(not(feature = "mpi"))]
            bench(args, group)
        }
        #[cfg(feature = "mpi")]
        "mpi" => {
            let universe = mpi::initialize().ok_or("MPI_Init failed")?;
            let world = universe.world();
            let group =
                Group::create(ibverbs::group::MpiBootstrap::new(&world), &opts).map_err(|e| e.to_string())?;
            bench(args, group, if args.compare_mpi { Some(world) } else { None })
        }
        b => Err(format!(
            "--bootstrap {b}: env{}",
            if cfg!(feature = "mpi") { " or mpi" } else { " (mpi needs the mpi feature)" }
        )),
    }
}

/// A collective's name, nccl-tests' busbw factor, and whether sizes are of the whole output.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Coll {
    AllReduce,
    AllGather,
    Broadcast,
    Barrier,
}

impl Coll {
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather => (n - 1.0) / n,
            Coll::Broadcast | Coll::Barrier => 1.0,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::AllGather => "all_gather",
            Coll::Broadcast => "broadcast",
            Coll::Barrier => "barrier",
        }
    }
}

#[cfg(feature = "mpi")]
type World = Option<mpi::topology::SimpleCommunicator>;
#[cfg(not(feature = "mpi"))]
type World = ();

fn bench<B: Bootstrap>(
    args: &Args,
    group: Group<B>,
    #[cfg(feature = "mpi")] world: World,
) -> Result<u64, String> {
    #[cfg(not(feature = "mpi"))]
    let world: World = ();
    let colls: Vec<Coll> = match args.coll.as_str() {
        "allreduce" => vec![Coll::AllReduce],
        "allgather" => vec![Coll::AllGather],
        "broadcast" => vec![Coll::Broadcast],
        "barrier" => vec![Coll::Barrier],
        "all" => vec![Coll::AllReduce, Coll::AllGather, Coll::Broadcast, Coll::Barrier],
        c => return Err(format!("--coll {c}: allreduce, allgather, broadcast, barrier or all")),
    };
    let describe = group.describe();
    let mut e = Engine::new(group, Duration::from_secs(args.timeout))?;
    let (me, n) = (e.group.rank(), e.group.size());
    // Every rank's description, printed by rank 0 in rank order.
    let all = e.group.allgather(describe.as_bytes()).map_err(|x| x.to_string())?;
    if me == 0 {
        println!(
            "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: {}(factor) warmup iters: {} iters: {} agg iters: 1 validation: {} graph: 0",
            args.min, args.max, args.factor, args.warmup, args.iters, args.check
        );
        println!("#\n# Using devices");
        for d in &all {
            let text = String::from_utf8_lossy(d);
            let mut lines = text.lines();
            println!("#  {}", lines.next().unwrap_or(""));
            if args.describe {
                for l in lines {
                    println!("#  {l}");
                }
            }
        }
    }
    let mut wrong_total = 0u64;
    for coll in colls {
        match run_coll(args, &mut e, coll, me, n, &world) {
            Ok(w) => wrong_total += w,
            Err(text) => {
                // Said at once, the other ranks told, and gone: an HPC rank that lost a peer
                // exits (as MPI_Abort does) instead of tearing its queue pairs down one by one.
                eprintln!("collectives: rank {me}: {text}");
                e.group.fail(&text);
                std::process::exit(2);
            }
        }
    }
    e.flush()?;
    e.group.barrier().map_err(|x| x.to_string())?;
    Ok(wrong_total)
}

fn sizes(args: &Args) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = args.min.max(4);
    while s <= args.max {
        out.push(s);
        if args.factor < 2 {
            break;
        }
        s *= args.factor;
    }
    out
}

/// Times `iters` runs of `f` after `warmup`, and returns the slowest rank's average in µs.
fn timed<B: Bootstrap>(
    e: &mut Engine<B>,
    warmup: usize,
    iters: usize,
    f: &mut dyn FnMut(&mut Engine<B>) -> Result<(), String>,
) -> Result<f64, String> {
    for _ in 0..warmup {
        f(e)?;
    }
    e.group.barrier().map_err(|x| x.to_string())?;
    let start = Instant::now();
    for _ in 0..iters {
        f(e)?;
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64;
    max_over_ranks(e, us)
}

fn max_over_ranks<B: Bootstrap>(e: &mut Engine<B>, v: f64) -> Result<f64, String> {
    let all = e.group.allgather(&v.to_le_bytes()).map_err(|x| x.to_string())?;
    Ok(all.iter().map(|b| f64::from_le_bytes(b[..8].try_into().unwrap_or_default())).fold(0.0, f64::max))
}

fn sum_over_ranks<B: Bootstrap>(e: &mut Engine<B>, v: u64) -> Result<u64, String> {
    let all = e.group.allgather(&v.to_le_bytes()).map_err(|x| x.to_string())?;
    Ok(all.iter().map(|b| u64::from_le_bytes(b[..8].try_into().unwrap_or_default())).sum())
}

/// Rank `r`'s input element `i`, round `k`: small integers, so that sums are exact in f32.
fn input(r: usize, i: usize, k: usize) -> f32 {
    ((r + 1) * ((i + k) % 13 + 1)) as f32
}

fn run_coll<B: Bootstrap>(
    args: &Args,
    e: &mut Engine<B>,
    coll: Coll,
    me: usize,
    n: usize,
    world: &World,
) -> Result<u64, String> {
    let _ = world;
    if me == 0 {
        println!("#\n# {} ({} ranks)", coll.name(), n);
        println!("#                                                              out-of-place                       in-place          ");
        println!("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong");
        println!("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       ");
    }
    let mut wrong_total = 0;
    let mut busbw_sum = 0.0;
    let mut rows = 0;
    #[cfg(feature = "mpi")]
    let mut mpi_rows: Vec<(usize, f64, f64)> = Vec::new();
    let list = if coll == Coll::Barrier { vec![0] } else { sizes(args) };
    for size in list {
        let count = size / 4;
        #[allow(unused_mut)] // set again by the MPI comparison (feature mpi)
        let (mut t_out, t_in, wrong_out, wrong_in);
        match coll {
            Coll::Barrier => {
                t_out = timed(e, args.warmup, args.iters, &mut |e| barrier(e, me, n))?;
                t_in = t_out;
                (wrong_out, wrong_in) = (0, 0);
            }
            _ => {
                let check = |e: &mut Engine<B>, in_place: bool, k: usize| -> Result<u64, String> {
                    if args.check == 0 {
                        return Ok(0);
                    }
                    let w = run_checked(e, coll, count, me, n, in_place, k, args.small)?;
                    sum_over_ranks(e, w)
                };
                wrong_out = check(e, false, 1)?;
                let mut bufs = Buffers::new(coll, count, me, n, 0);
                let small = args.small;
                t_out = timed(e, args.warmup, args.iters, &mut |e| bufs.run(e, coll, me, n, false, small))?;
                wrong_in = check(e, true, 2)?;
                t_in = timed(e, args.warmup, args.iters, &mut |e| bufs.run(e, coll, me, n, true, small))?;
                #[cfg(feature = "mpi")]
                if let (Some(w), Coll::AllReduce) = (world, coll) {
                    mpi_rows.push(compare_mpi(args, e, w, &mut bufs, count, me, n, &mut t_out)?);
                }
            }
        }
        let bytes = size as f64;
        let (alg_out, alg_in) = (bytes / t_out / 1e3, bytes / t_in / 1e3);
        let f = coll.bus_factor(n);
        wrong_total += wrong_out + wrong_in;
        busbw_sum += alg_out * f;
        rows += 1;
        if me == 0 {
            let (ty, op, root) = match coll {
                Coll::AllReduce => ("float", "sum", "-1"),
                Coll::AllGather => ("float", "none", "-1"),
                Coll::Broadcast => ("float", "none", "0"),
                Coll::Barrier => ("none", "none", "-1"),
            };
            println!(
                "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7.2}  {:>6.2}  {:>6.2}  {:>5}  {:>7.2}  {:>6.2}  {:>6.2}  {:>5}",
                size, count, ty, op, root, t_out, alg_out, alg_out * f, wrong_out, t_in, alg_in, alg_in * f, wrong_in
            );
        }
    }
    if me == 0 {
        println!(
            "# Out of bounds values : {} {}",
            wrong_total,
            if wrong_total == 0 { "OK" } else { "FAILED" }
        );
        println!("# Avg bus bandwidth    : {:.4} ", busbw_sum / rows.max(1) as f64);
        #[cfg(feature = "mpi")]
        if !mpi_rows.is_empty() {
            println!(
                "#\n# MPI_Allreduce (same sizes, same ranks; rounds alternate ours/MPI, median of {} rounds)",
                args.rounds
            );
            println!(
                "#       size     ours_us      mpi_us   ours_busbw    mpi_busbw   busbw_ratio   time_ratio"
            );
            for (size, ours, theirs) in &mpi_rows {
                let f = coll.bus_factor(n);
                let (bo, bm) = (*size as f64 / ours / 1e3 * f, *size as f64 / theirs / 1e3 * f);
                println!(
                    "mpi {:>12}  {:>10.2}  {:>10.2}  {:>11.4}  {:>11.4}  {:>12.3}  {:>11.3}",
                    size,
                    ours,
                    theirs,
                    bo,
                    bm,
                    bo / bm,
                    ours / theirs
                );
            }
        }
    }
    Ok(wrong_total)
}

/// Alternates rounds of ours and MPI_Allreduce on the same sizes; returns (size, ours µs, MPI µs),
/// the medians, and sets `t_out` to our median.
#[cfg(feature = "mpi")]
#[allow(clippy::too_many_arguments)]
fn compare_mpi<B: Bootstrap>(
    args: &Args,
    e: &mut Engine<B>,
    world: &mpi::topology::SimpleCommunicator,
    bufs: &mut Buffers,
    count: usize,
    me: usize,
    n: usize,
    t_out: &mut f64,
) -> Result<(usize, f64, f64), String> {
    use mpi::collective::SystemOperation;
    use mpi::traits::*;
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    let send: Vec<f32> = (0..count).map(|i| input(me, i, 0)).collect();
    let mut recv = vec![0f32; count];
    for _ in 0..args.rounds.max(1) {
        ours.push(timed(e, 1, args.iters, &mut |e| bufs.run(e, Coll::AllReduce, me, n, false, args.small))?);
        for _ in 0..args.warmup {
            world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        }
        world.barrier();
        let start = Instant::now();
        for _ in 0..args.iters {
            world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        }
        let us = start.elapsed().as_secs_f64() * 1e6 / args.iters.max(1) as f64;
        theirs.push(max_over_ranks(e, us)?);
    }
    // MPI's result checked too: the same sums.
    let expect: f32 = (1..=n).sum::<usize>() as f32;
    if recv.iter().enumerate().any(|(i, &v)| v != expect * ((i % 13 + 1) as f32)) {
        return Err("MPI_Allreduce gave a wrong result".into());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (o, t) = (median(&mut ours), median(&mut theirs));
    *t_out = o;
    Ok((count * 4, o, t))
}

/// A collective's buffers, allocated once per size.
struct Buffers {
    input: Vec<f32>,
    output: Vec<f32>,
    /// Small allreduce: one vector per peer.
    scratch: Vec<Vec<f32>>,
}

impl Buffers {
    fn new(coll: Coll, count: usize, me: usize, n: usize, k: usize) -> Buffers {
        let (in_len, out_len) = match coll {
            Coll::AllGather => (count / n, count / n * n),
            _ => (count, count),
        };
        Buffers {
            input: (0..in_len)
                .map(|i| input(me, i + me * in_len * usize::from(coll == Coll::AllGather), k))
                .collect(),
            output: vec![0.0; out_len],
            scratch: if coll == Coll::AllReduce {
                (0..n).map(|_| vec![0.0; count]).collect()
            } else {
                Vec::new()
            },
        }
    }

    fn run<B: Bootstrap>(
        &mut self,
        e: &mut Engine<B>,
        coll: Coll,
        me: usize,
        n: usize,
        in_place: bool,
        small: usize,
    ) -> Result<(), String> {
        match coll {
            Coll::AllReduce => {
                let data = if in_place {
                    &mut self.input
                } else {
                    self.output.copy_from_slice(&self.input);
                    &mut self.output
                };
                if data.len() * 4 <= small {
                    allreduce_small(e, data, &mut self.scratch, me, n)
                } else {
                    allreduce_ring(e, data, me, n)
                }
            }
            Coll::AllGather => {
                let block = self.input.len();
                self.output[me * block..(me + 1) * block].copy_from_slice(&self.input);
                if in_place {
                    self.input.copy_from_slice(&self.output[me * block..(me + 1) * block]);
                }
                allgather_ring(e, &mut self.output, block, me, n)
            }
            Coll::Broadcast => {
                let data = if in_place {
                    &mut self.input
                } else {
                    if me == 0 {
                        self.output.copy_from_slice(&self.input);
                    }
                    &mut self.output
                };
                broadcast_chain(e, data, me, n)
            }
            Coll::Barrier => barrier(e, me, n),
        }
    }
}

/// One checked run: fresh inputs (round `k`), the collective, then the count of wrong elements.
#[allow(clippy::too_many_arguments)]
fn run_checked<B: Bootstrap>(
    e: &mut Engine<B>,
    coll: Coll,
    count: usize,
    me: usize,
    n: usize,
    in_place: bool,
    k: usize,
    small: usize,
) -> Result<u64, String> {
    let mut b = Buffers::new(coll, count, me, n, k);
    b.run(e, coll, me, n, in_place, small)?;
    let result = match (coll, in_place) {
        (Coll::AllReduce | Coll::Broadcast, true) => &b.input,
        _ => &b.output,
    };
    let sum_r: usize = (1..=n).sum();
    let wrong = result
        .iter()
        .enumerate()
        .filter(|&(i, &v)| {
            let want = match coll {
                Coll::AllReduce => (sum_r * ((i + k) % 13 + 1)) as f32,
                Coll::AllGather => {
                    let block = count / n;
                    input(i / block.max(1), i, k)
                }
                Coll::Broadcast => input(0, i, k),
                Coll::Barrier => v,
            };
            v != want
        })
        .count();
    Ok(wrong as u64)
}

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte of it may be read as a u8; the length is the
    // slice's size in bytes; the lifetime is the input's.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Segment `k` of `n` of `count` elements.
fn seg(count: usize, n: usize, k: usize) -> std::ops::Range<usize> {
    (k * count / n)..((k + 1) * count / n)
}

/// A shared and a mutable view of two disjoint ranges of `v`.
fn two(v: &mut [f32], a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> (&[f32], &mut [f32]) {
    if a.start < b.start {
        let (lo, hi) = v.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = v.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

fn add_bytes(acc: &mut [f32], off: usize, bytes: &[u8]) {
    let start = off / 4;
    for (a, b) in acc[start..start + bytes.len() / 4].iter_mut().zip(bytes.chunks_exact(4)) {
        *a += f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
    }
}

fn copy_bytes(dst: &mut [f32], off: usize, bytes: &[u8]) {
    let start = off / 4;
    for (a, b) in dst[start..start + bytes.len() / 4].iter_mut().zip(bytes.chunks_exact(4)) {
        *a = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Ring allreduce: reduce-scatter then allgather, n−1 steps each, to the right neighbour.
fn allreduce_ring<B: Bootstrap>(
    e: &mut Engine<B>,
    data: &mut [f32],
    me: usize,
    n: usize,
) -> Result<(), String> {
    if n == 1 {
        return Ok(());
    }
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    let count = data.len();
    for s in 0..n - 1 {
        let (ss, rs) = (seg(count, n, (me + n - s) % n), seg(count, n, (me + 2 * n - s - 1) % n));
        let rlen = rs.len() * 4;
        let (send, recv) = two(data, ss, rs);
        e.exchange(&[right], &[as_bytes(send)], &[left], &[rlen], &mut |_, off, b| add_bytes(recv, off, b))?;
    }
    for s in 0..n - 1 {
        let (ss, rs) = (seg(count, n, (me + 1 + n - s) % n), seg(count, n, (me + n - s) % n));
        let rlen = rs.len() * 4;
        let (send, recv) = two(data, ss, rs);
        e.exchange(&[right], &[as_bytes(send)], &[left], &[rlen], &mut |_, off, b| copy_bytes(recv, off, b))?;
    }
    Ok(())
}

/// Small allreduce: everyone sends everything to everyone, then sums in rank order (the same
/// order on every rank, so every rank has the same bits).
fn allreduce_small<B: Bootstrap>(
    e: &mut Engine<B>,
    data: &mut [f32],
    scratch: &mut [Vec<f32>],
    me: usize,
    n: usize,
) -> Result<(), String> {
    let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
    let len = data.len() * 4;
    {
        let bytes = as_bytes(data);
        let sends: Vec<&[u8]> = peers.iter().map(|_| bytes).collect();
        let lens: Vec<usize> = peers.iter().map(|_| len).collect();
        let peers2 = peers.clone();
        e.exchange(&peers, &sends, &peers, &lens, &mut |k, off, b| {
            copy_bytes(&mut scratch[peers2[k]], off, b)
        })?;
    }
    scratch[me].copy_from_slice(data);
    for (i, v) in data.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for s in scratch.iter() {
            acc += s[i];
        }
        *v = acc;
    }
    Ok(())
}

/// Ring allgather of `block` elements per rank into `out`.
fn allgather_ring<B: Bootstrap>(
    e: &mut Engine<B>,
    out: &mut [f32],
    block: usize,
    me: usize,
    n: usize,
) -> Result<(), String> {
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    for s in 0..n.saturating_sub(1) {
        let sb = (me + n - s) % n;
        let rb = (me + 2 * n - s - 1) % n;
        let (send, recv) = two(out, sb * block..(sb + 1) * block, rb * block..(rb + 1) * block);
        e.exchange(&[right], &[as_bytes(send)], &[left], &[block * 4], &mut |_, off, b| {
            copy_bytes(recv, off, b)
        })?;
    }
    Ok(())
}

/// Broadcast from rank 0 along the chain 0 → 1 → … → n−1, piece by piece (pipelined).
fn broadcast_chain<B: Bootstrap>(
    e: &mut Engine<B>,
    data: &mut [f32],
    me: usize,
    n: usize,
) -> Result<(), String> {
    let len = data.len() * 4;
    let piece = engine::SLOT;
    let pieces = len.div_ceil(piece).max(1);
    for i in 0..pieces {
        let range = (i * piece / 4)..(((i + 1) * piece).min(len) / 4);
        if me > 0 {
            let dst = &mut data[range.clone()];
            e.exchange(&[], &[], &[me - 1], &[dst.len() * 4], &mut |_, off, b| copy_bytes(dst, off, b))?;
        }
        if me + 1 < n {
            e.exchange(&[me + 1], &[as_bytes(&data[range])], &[], &[], &mut |_, _, _| {})?;
        }
    }
    Ok(())
}

/// Barrier: an empty message to and from every peer.
fn barrier<B: Bootstrap>(e: &mut Engine<B>, me: usize, n: usize) -> Result<(), String> {
    let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
    let sends: Vec<&[u8]> = peers.iter().map(|_| &[][..]).collect();
    let lens = vec![0; peers.len()];
    e.exchange(&peers, &sends, &peers, &lens, &mut |_, _, _| {})
}
