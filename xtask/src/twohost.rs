//! The two-host stage of `cargo xtask test`: one pair of guests ([`crate::rxe2`]) for every two-host test.
//!
//! In order (each a pair step; guest A is the passive side):
//! 1. interop across hosts: our `rc_pingpong` and `ud_pingpong` against rdma-core's
//!    `ibv_rc_pingpong`/`ibv_ud_pingpong`, both roles each; our `write_bw` against itself; over
//!    RDMA-CM, our `rping` and `rdma_server`/`rdma_client` against rdmacm-utils' in both roles;
//!    RDMA-CM multicast, our `mcast` and rdmacm-utils' `mckey` as the sender in one guest, both as
//!    receivers in the other, each way ([`mcast_step`]);
//!    `read_bw`, `send_bw` and `send_lat` ours against ours; `write_bw -R` (RDMA-CM) ours against ours;
//! 2. `write_bw`'s server when its client's host vanishes (the link is cut for good: no FIN, no
//!    packet): it must exit non-zero within its `--timeout` plus slack;
//! 3. the library tests of `tests/twohost_*.rs` in both guests (but `zz_*`);
//! 4. last, `zz_*` tests: they restart guest B (`rxe2-fault restart-peer`: SIGKILLed mid-transfer,
//!    booted again, reconnected);
//! 5. then a second pair whose NICs' MTUs differ ([`MTU_OPTIONS`]): the RC test again.
//!
//! Every script checks exit statuses, the tools' reported iteration counts and its timings.

use std::path::Path;
use std::time::Duration;

use crate::rxe2::{PairOptions, PairStep};
use crate::vm::Output;
use crate::{cargo::Artifact, shell};

/// Shell helpers every step script starts with.
pub const PRELUDE: &str = r#"set -u
# Our examples' ACK timeout: 2^16 x 4.096 us = 268 ms per try (7 tries: 1.9 s) instead of the default
# 67 ms (0.47 s), which a guest descheduled on a loaded 2-core host can exceed while its peer is alive.
export IBVERBS_TIMEOUT=16
ms() { echo $(($(date +%s%N) / 1000000)); }
die() { echo "twohost: FAILED: $*" >&2; exit 1; }
# must_say FILE PATTERN WHAT
must_say() { grep -q -- "$2" "$1" || { cat "$1" >&2; die "$3: no '$2' in its output"; }; }
"#;

/// The pair options of the stage: both NICs at MTU 1500 (rxe active MTU 1024), one vCPU each.
pub const OPTIONS: PairOptions = PairOptions { mtu: [1500, 1500], smp: 1, rails: 1 };

/// The second, short pair of the stage: the two sides' NIC MTUs differ (A 1500: rxe active MTU
/// 1024; B 4000: 2048), so each side's endpoint advertises another MTU and `connect` must take the
/// smaller one: a side that sent 2048-byte packets to A would lose them all.
pub const MTU_OPTIONS: PairOptions = PairOptions { mtu: [1500, 4000], smp: 1, rails: 1 };

/// The steps of the [`MTU_OPTIONS`] pair: the RC test of `tests/twohost_*.rs` (multi-packet Send,
/// Write, Read and atomics), told that the MTUs differ (it checks they do).
pub fn mtu_steps(root: &Path, bins: &[Artifact]) -> Vec<PairStep> {
    bins.iter()
        .map(|bin| {
            let argv = [
                std::ffi::OsString::from("env"),
                "TWOHOST_MTU_DIFFER=1".into(),
                bin.executable.as_os_str().to_os_string(),
                "--test-threads=1".into(),
                "--nocapture".into(),
                "rc_send_write_read_atomics_across_hosts".into(),
            ];
            let s = shell::argv_script(root, &argv);
            PairStep {
                label: format!("{} rc_* with the sides' MTUs 1500 and 4000", bin.name),
                a: s.clone(),
                b: s,
                timeout: Duration::from_secs(120),
                output: Output::Live,
            }
        })
        .collect()
}

/// A pingpong interop step: `server` in A, `client` in B (which retries until A listens).
fn pingpong(label: &str, server: &str, client: &str, iters: u32) -> PairStep {
    let a = format!(
        "{PRELUDE}timeout 60 stdbuf -oL {server} >/tmp/pp.out 2>&1; rc=$?\ncat /tmp/pp.out\n\
         [ $rc -eq 0 ] || die \"server exit $rc\"\nmust_say /tmp/pp.out '{iters} iters' server\n"
    );
    let b = format!(
        "{PRELUDE}i=0\nwhile :; do\n  timeout 60 stdbuf -oL {client} \"$RXE2_PEER\" >/tmp/pp.out 2>&1; rc=$?\n  \
         [ $rc -ne 0 ] && grep -qi 'connect' /tmp/pp.out && [ $i -lt 40 ] && {{ i=$((i+1)); sleep 0.25; continue; }}\n  \
         break\ndone\ncat /tmp/pp.out\n[ $rc -eq 0 ] || die \"client exit $rc\"\nmust_say /tmp/pp.out '{iters} iters' client\n"
    );
    PairStep {
        label: label.into(),
        a: a.into_bytes(),
        b: b.into_bytes(),
        timeout: Duration::from_secs(120),
        output: Output::Live,
    }
}

/// A client/server step: `server` in A (its output must contain `server_says`), `client` in B,
/// started again (up to 40 times, 0.25 s apart) while it fails without `client_says` in its output:
/// rdma-core's CM clients give up at once when nothing listens yet, and A gives no sign of
/// readiness that B could wait for. The last run must succeed and say `client_says`.
fn served(label: &str, server: &str, client: &str, server_says: &str, client_says: &str) -> PairStep {
    let a = format!(
        "{PRELUDE}timeout 60 stdbuf -oL {server} >/tmp/s.out 2>&1; rc=$?\ncat /tmp/s.out\n\
         [ $rc -eq 0 ] || die \"server exit $rc\"\nmust_say /tmp/s.out '{server_says}' server\n"
    );
    let b = format!(
        "{PRELUDE}i=0\nwhile :; do\n  timeout 60 stdbuf -oL {client} >/tmp/c.out 2>&1; rc=$?\n  \
         [ $rc -ne 0 ] && ! grep -q -- '{client_says}' /tmp/c.out && [ $i -lt 40 ] && {{ i=$((i+1)); sleep 0.25; continue; }}\n  \
         break\ndone\ncat /tmp/c.out\n[ $rc -eq 0 ] || die \"client exit $rc\"\nmust_say /tmp/c.out '{client_says}' client\n"
    );
    PairStep {
        label: label.into(),
        a: a.into_bytes(),
        b: b.into_bytes(),
        timeout: Duration::from_secs(120),
        output: Output::Live,
    }
}

/// The multicast step: RDMA-CM multicast across the guests (`xtask/guest/mcast_twohost.sh`). In
/// two phases, each way at once with a group per direction (1: our `mcast` sends, 2: `mckey`
/// sends), the other guest's receivers, our `mcast` and `mckey`, both joined before the sender
/// starts, must each get all 20 datagrams of 100 bytes; ours checks every datagram's GRH
/// (IPv4/UDP to the group from the sender's address), immediate data and every payload byte.
/// About 10 s on TCG (`cargo xtask rxe2` by hand: 10.0 s); every wait in the script is bounded
/// (25 s per tool, 15 s for the joins, 30 s per barrier), the step by 60 s.
fn mcast_step(examples: &str) -> PairStep {
    let script = format!("{PRELUDE}E='{examples}'\n{}", include_str!("../guest/mcast_twohost.sh"));
    PairStep {
        label: "interop over RDMA-CM multicast: mcast (ours) and mckey, sender in one guest, both receiving in the other, each way".into(),
        a: script.clone().into_bytes(),
        b: script.into_bytes(),
        timeout: Duration::from_secs(60),
        output: Output::Live,
    }
}

/// The stage's steps. `examples` is the folder of the built examples; `bins` the two-host test binaries.
pub fn steps(root: &Path, examples: &Path, bins: &[Artifact]) -> Vec<PairStep> {
    let e = examples.display();
    let n = 200;
    let mut steps = vec![
        pingpong(
            "interop: rc_pingpong (ours, A) <- ibv_rc_pingpong (B)",
            &format!("{e}/rc_pingpong -d rxe0 -g 1 -n {n} --timeout 30"),
            &format!("ibv_rc_pingpong -d rxe0 -g 1 -n {n}"),
            n,
        ),
        pingpong(
            "interop: ibv_rc_pingpong (A) <- rc_pingpong (ours, B)",
            &format!("ibv_rc_pingpong -d rxe0 -g 1 -n {n}"),
            &format!("{e}/rc_pingpong -d rxe0 -g 1 -n {n} --timeout 30"),
            n,
        ),
        pingpong(
            "interop: ud_pingpong (ours, A) <- ibv_ud_pingpong (B)",
            &format!("{e}/ud_pingpong -d rxe0 -g 1 -n {n} -s 512 --timeout 30"),
            &format!("ibv_ud_pingpong -d rxe0 -g 1 -n {n} -s 512"),
            n,
        ),
        pingpong(
            "interop: ibv_ud_pingpong (A) <- ud_pingpong (ours, B)",
            &format!("ibv_ud_pingpong -d rxe0 -g 1 -n {n} -s 512"),
            &format!("{e}/ud_pingpong -d rxe0 -g 1 -n {n} -s 512 --timeout 30"),
            n,
        ),
    ];
    // write_bw ours <-> ours.
    steps.push(PairStep {
        label: "write_bw (ours, A server) <- write_bw (ours, B client), 64 KiB x 300".into(),
        a: format!(
            "{PRELUDE}timeout 90 {e}/write_bw -d rxe0 --timeout 20 >/tmp/bw.out 2>&1; rc=$?\ncat /tmp/bw.out\n\
             [ $rc -eq 0 ] || die \"server exit $rc\"\n"
        )
        .into_bytes(),
        b: format!(
            "{PRELUDE}timeout 90 {e}/write_bw -d rxe0 -n 300 --connect-timeout 20 \"$RXE2_PEER\" >/tmp/bw.out 2>&1; rc=$?\n\
             cat /tmp/bw.out\n[ $rc -eq 0 ] || die \"client exit $rc\"\nmust_say /tmp/bw.out 65536 client\n"
        )
        .into_bytes(),
        timeout: Duration::from_secs(120),
        output: Output::Live,
    });
    // RDMA-CM across hosts: rping and rdma_server/rdma_client, ours against rdma-core's, both roles.
    steps.extend([
        served(
            "interop over RDMA-CM: rping (ours, A) <- rping (B), 4 KiB x 5",
            &format!("{e}/rping -s -a $RXE2_SELF -p 7400 -S 4096 -v --timeout 30"),
            "rping -c -a $RXE2_PEER -p 7400 -S 4096 -C 5 -V -v",
            "server ping data",
            "ping data: rdma-ping-4",
        ),
        served(
            "interop over RDMA-CM: rping (A) <- rping (ours, B), 4 KiB x 5",
            "rping -s -a $RXE2_SELF -p 7401 -S 4096 -v",
            &format!("{e}/rping -c -a $RXE2_PEER -p 7401 -S 4096 -C 5 -V -v --timeout 30"),
            "server ping data",
            "ping data: rdma-ping-4",
        ),
        served(
            "interop over RDMA-CM: rdma_server (ours, A) <- rdma_client (B)",
            &format!("{e}/rdma_server -s $RXE2_SELF -p 7402 --timeout 30"),
            "rdma_client -s $RXE2_PEER -p 7402",
            "rdma_server: end 0",
            "rdma_client: end 0",
        ),
        served(
            "interop over RDMA-CM: rdma_server (A) <- rdma_client (ours, B)",
            "rdma_server -s $RXE2_SELF -p 7403",
            &format!("{e}/rdma_client -s $RXE2_PEER -p 7403 --timeout 30"),
            "rdma_server: end 0",
            "rdma_client: end 0",
        ),
    ]);
    steps.push(mcast_step(&e.to_string()));
    // The other perf examples, ours <-> ours.
    for (tool, args, says) in [
        ("read_bw", "-n 300", "65536"),
        ("send_bw", "-n 300", "65536"),
        ("send_lat", "-n 300 -s 2", "#bytes"),
    ] {
        steps.push(served(
            &format!("{tool} (ours, A server) <- {tool} (ours, B client), {args}"),
            &format!("{e}/{tool} -d rxe0 --timeout 20"),
            &format!("{e}/{tool} -d rxe0 {args} --connect-timeout 20 $RXE2_PEER"),
            "",
            says,
        ));
    }
    // perftest's -R: the queue pairs connected through RDMA-CM across hosts.
    steps.push(served(
        "write_bw -R (ours, A server) <- write_bw -R (ours, B client), 2 QPs over RDMA-CM",
        &format!("{e}/write_bw -d rxe0 -R --timeout 20"),
        &format!("{e}/write_bw -d rxe0 -R -q 2 -n 200 --connect-timeout 20 $RXE2_PEER"),
        "",
        "65536",
    ));
    // write_bw's server when the client's host vanishes: the link is cut for good mid-transfer (a dead
    // host sends no FIN and no packet; a SIGKILLed guest is kept for the last step).
    let limit = 3;
    steps.push(PairStep {
        label: format!(
            "write_bw server exits non-zero within --timeout {limit} s + 5 s when its client's host vanishes"
        ),
        a: format!(
            "{PRELUDE}main() {{
{e}/write_bw -d rxe0 --timeout {limit} >/tmp/bw.out 2>&1 &
p=$!
\
             rxe2-barrier link-cut 60 || die 'B did not cut the link'\nt0=$(ms)\nwait $p; rc=$?\nt=$(($(ms) - t0))\n\
             cat /tmp/bw.out\necho \"twohost: write_bw server exit $rc, $t ms after the barrier that follows the cut\"\n\
             [ $rc -ne 0 ] || die 'the server exited 0 although its client vanished'\n\
             [ $t -le $(( ({limit} + 5) * 1000 )) ] || die \"the server took $t ms\"\n}}\n\
             (main); rc=$?\nrxe2-barrier server-done 60\nexit $rc\n"
        )
        .into_bytes(),
        b: format!(
            "{PRELUDE}{e}/write_bw -d rxe0 -n 100000000 --connect-timeout 20 \"$RXE2_PEER\" >/tmp/bw.out 2>&1 &\np=$!\n\
             i=0; until grep -q 'remote address' /tmp/bw.out 2>/dev/null || [ $i -ge 300 ]; do i=$((i+1)); sleep 0.1; done\n\
             sleep 3\nt0=$(ms)\nrxe2-fault cut >/dev/null || die 'cut'\nrxe2-barrier link-cut 60\nrxe2-barrier server-done 60\n\
             t=$(($(ms) - t0))\nkill -9 $p 2>/dev/null; wait $p 2>/dev/null\nrxe2-fault restore >/dev/null || die 'restore'\n\
             echo \"twohost: from asking for the cut to the server's exit (plus two barriers' latency): $t ms\"\n\
             [ $t -le $(( ({limit} + 20) * 1000 )) ] || die \"the server was not done $t ms after the cut\"\n"
        )
        .into_bytes(),
        timeout: Duration::from_secs(90),
        output: Output::Live,
    });
    for bin in bins {
        let exe = bin.executable.as_os_str();
        let run = |filter: &[&str]| {
            let mut argv = vec![exe.to_os_string(), "--test-threads=1".into(), "--nocapture".into()];
            argv.extend(filter.iter().map(|f| (*f).into()));
            shell::argv_script(root, &argv)
        };
        let main = run(&["--skip", "zz_"]);
        steps.push(PairStep {
            label: format!("{} (both guests)", bin.name),
            a: main.clone(),
            b: main,
            timeout: Duration::from_secs(180),
            output: Output::Live,
        });
    }
    for bin in bins {
        let exe = bin.executable.as_os_str();
        let argv = [exe.to_os_string(), "--test-threads=1".into(), "--nocapture".into(), "zz_".into()];
        let s = shell::argv_script(root, &argv);
        steps.push(PairStep {
            label: format!("{} zz_* (restarts guest B)", bin.name),
            a: s.clone(),
            b: s,
            timeout: Duration::from_secs(180),
            output: Output::Live,
        });
    }
    steps
}

/// The pair of the ranks steps: two links (rxe0 and rxe1 in each guest), two NUMA nodes of one
/// vCPU each per guest ([`PairOptions::rails`]).
pub const RANKS_OPTIONS: PairOptions = PairOptions { mtu: [1500, 1500], smp: 2, rails: 2 };

/// Shell helpers of the ranks steps (after [`PRELUDE`]).
pub const RANKS_PRELUDE: &str = r#"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A loaded 2-core host runs four vCPUs: 1 s ACK timeouts (x7: 7.5 s before a live peer is called dead).
export IBVERBS_TIMEOUT=18
# mpirun across the two guests: its daemons start through xtask's remote shell (__rsh), Open MPI's
# own traffic on the first link only: pml ob1, btl tcp unless $PML_ARGS says otherwise (the tests
# keep TCP; `cargo xtask bench --ranks` tries pml ucx over the rxe devices first).
mpirun_() { t=$1; shift; timeout "$t" mpirun -n 4 --host 10.0.2.1:2,10.0.2.2:2 --mca plm_rsh_agent "$XTASK __rsh" \
  --mca oob_tcp_if_include 10.0.2.0/24 \
  ${PML_ARGS:---mca btl tcp,self,vader --mca btl_tcp_if_include 10.0.2.0/24 --mca pml ob1} \
  --map-by numa --bind-to core -x IBVERBS_TIMEOUT -x IBVERBS_BOOTSTRAP=10.0.2.1:29501 "$@"; }
"#;

/// B's side of an mpirun step: serve the remote shell until A is done.
pub fn rsh_side(xtask: &str, secs: u64, barrier: &str) -> Vec<u8> {
    format!(
        "{PRELUDE}{xtask} __rsh-server & srv=$!\nrxe2-barrier {barrier} {secs}; rc=$?\nkill $srv 2>/dev/null\n\
         [ $rc -eq 0 ] || die 'guest A did not finish'\n"
    )
    .into_bytes()
}

/// The ranks steps: 4 ranks (2 per guest, one per NUMA node) of `examples/collectives` over
/// `mpirun` with the environment's bootstrap and with MPI's (against `MPI_Allreduce`), then with
/// Slurm's variables and no launcher, then a rank SIGKILLed mid-allreduce (torchrun's variables;
/// then under mpirun): the others must exit 2 naming it, within a bound; last, the second rail's
/// link cut mid-allreduce while the first lives.
pub fn ranks_steps(examples: &Path, xtask: &Path) -> Vec<PairStep> {
    let c = examples.join("collectives").display().to_string();
    let x = xtask.display().to_string();
    let pre = format!("{PRELUDE}{RANKS_PRELUDE}XTASK={x}\n");
    let mut steps = Vec::new();
    // 1. mpirun, bootstrap by the environment (OMPI_COMM_WORLD_* and IBVERBS_BOOTSTRAP), every
    //    collective checked, and each rank's primary rail is its NUMA node's NIC.
    steps.push(PairStep {
        label: "ranks: mpirun -n 4 over two guests, environment bootstrap, two rails, every collective".into(),
        a: format!(
            "{pre}mpirun_ 240 {c} --coll all -b 8 -e 512K -f 8 -n 3 -w 1 --describe >/tmp/r.out 2>&1; rc=$?\n\
             rxe2-barrier ranks-1 60\ncat /tmp/r.out\n[ $rc -eq 0 ] || die \"mpirun exit $rc\"\n\
             [ \"$(grep -c 'Out of bounds values : 0 OK' /tmp/r.out)\" -eq 4 ] || die 'a collective with wrong values'\n\
             for r in 0 1 2 3; do grep -A1 \"rank $r of 4 (local rank $((r % 2))\" /tmp/r.out | grep -q \"rail 0: rxe$((r % 2)):1 on 10.0.$((2 + r % 2)).0/24 (primary: NUMA node $((r % 2)), where\" \\\n\
               || die \"rank $r's primary rail is not rxe$((r % 2)) on its NUMA node\"; done\n"
        )
        .into_bytes(),
        b: rsh_side(&x, 300, "ranks-1"),
        timeout: Duration::from_secs(300),
        output: Output::Live,
    });
    // 2. mpirun, bootstrap through MPI, our allreduce against MPI_Allreduce in alternating rounds.
    steps.push(PairStep {
        label: "ranks: mpirun -n 4, MPI bootstrap, allreduce against MPI_Allreduce (alternating rounds)".into(),
        a: format!(
            "{pre}mpirun_ 300 {c} --bootstrap mpi --compare-mpi --rounds 2 -b 8 -e 1M -f 8 -n 3 -w 1 >/tmp/r.out 2>&1; rc=$?\n\
             rxe2-barrier ranks-2 60\ncat /tmp/r.out\n[ $rc -eq 0 ] || die \"mpirun exit $rc\"\n\
             must_say /tmp/r.out 'Out of bounds values : 0 OK' 'allreduce'\n\
             [ \"$(grep -c '^mpi ' /tmp/r.out)\" -eq 6 ] || die 'not 6 sizes compared with MPI_Allreduce'\n"
        )
        .into_bytes(),
        b: rsh_side(&x, 360, "ranks-2"),
        timeout: Duration::from_secs(360),
        output: Output::Live,
    });
    // 3. Slurm's variables, no launcher: two ranks per guest started by the script.
    let d = examples.join("doctor").display().to_string();
    let slurm = |first: u32| {
        // doctor under Slurm's variables names each local rank's primary rail (its NUMA node's NIC).
        let doctor = format!(
            "for i in 0 1; do SLURM_PROCID=$(({first} + i)) SLURM_NTASKS=4 SLURM_LOCALID=$i taskset -c $i {d} --no-probe \\\n\
             >/tmp/d$i.out 2>&1 || {{ cat /tmp/d$i.out; die 'doctor failed'; }}\n\
             grep -q \"rail 0: *rxe$i:1 on 10.0.$((2 + i)).0/24 (primary: NUMA node $i\" /tmp/d$i.out \\\n\
             || {{ cat /tmp/d$i.out; die \"doctor: local rank $i's primary rail is not rxe$i\"; }}; done\n\
             grep -A2 '^rank' /tmp/d0.out /tmp/d1.out\n"
        );
        format!(
            "{pre}{doctor}for i in 0 1; do r=$(({first} + i)); SLURM_PROCID=$r SLURM_NTASKS=4 SLURM_LOCALID=$i SLURM_JOB_ID=42 \\\n\
             SLURM_STEP_ID=0 IBVERBS_BOOTSTRAP=10.0.2.1:29502 timeout 120 taskset -c $i {c} -b 8 -e 256K -f 8 -n 3 -w 1 \\\n\
             >/tmp/s$r.out 2>&1 & eval p$i=$!; done\nwait $p0; rc0=$?; wait $p1; rc1=$?\ncat /tmp/s*.out\n\
             [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || die \"rank exits $rc0 $rc1\"\n"
        )
        .into_bytes()
    };
    steps.push(PairStep {
        label: "ranks: Slurm's variables (SLURM_PROCID/NTASKS/LOCALID), TCP rendezvous, no launcher".into(),
        a: slurm(0),
        b: slurm(2),
        timeout: Duration::from_secs(150),
        output: Output::Live,
    });
    // Steps 4 and 6 start a guest's two ranks (`first`, `first + 1`) by torchrun's variables, a
    // 4 MiB allreduce looping long enough to be hit, each rank's output in /tmp/{out}$r.out; the
    // shell variable `w` is the rank's wrapper (`timeout 150` unless the step says otherwise).
    let torchrun_pair = |first: u32, port: u32, out: &str, wrapper: &str, extra: &str| {
        format!(
            "{pre}s0=$(ms)\nfor i in 0 1; do r=$(({first} + i)); {wrapper}\n\
             RANK=$r WORLD_SIZE=4 LOCAL_RANK=$i MASTER_ADDR=10.0.2.1 MASTER_PORT={port} $w taskset -c $i {c} \\\n\
             -b 4M -e 4M -n 1000 -w 0 -c 0{extra} --timeout 60 >/tmp/{out}$r.out 2>&1 & eval p$i=$!; done\n"
        )
    };
    // 4. Rank 3 SIGKILLed mid-allreduce (torchrun's variables): ranks 0-2 exit 2 within 30 s of
    //    the kill, each naming rank 3. The victim runs without a `timeout` wrapper (killing the
    //    wrapper would leave the rank running).
    let kill = |first: u32, victim: bool| {
        let mut s =
            torchrun_pair(first, 29503, "k", "if [ $r -eq 3 ]; then w=; else w='timeout 150'; fi", "");
        s.push_str("sleep 10\n");
        if victim {
            s.push_str(
                "kill -0 $p1 || die 'rank 3 ended before it was killed'\nt0=$(ms); kill -9 $p1\n\
                 wait $p0; rc=$?; t=$(($(ms) - t0))\ncat /tmp/k2.out\n\
                 [ $rc -eq 2 ] || die \"rank 2 exit $rc (want 2)\"\n\
                 grep -q 'rank 3: lost' /tmp/k2.out || die 'rank 2 does not name rank 3 as lost'\n\
                 [ $t -lt 30000 ] || die \"rank 2 took $t ms\"\necho \"rank 2 ended $t ms after the kill\"\n",
            );
        } else {
            s.push_str(
                "wait $p0; rc0=$?; wait $p1; rc1=$?; t=$(ms)\ncat /tmp/k0.out /tmp/k1.out\n\
                 [ $rc0 -eq 2 ] && [ $rc1 -eq 2 ] || die \"rank exits $rc0 $rc1 (want 2 2)\"\n\
                 grep -q 'rank 3: lost' /tmp/k0.out && grep -q 'rank 3: lost' /tmp/k1.out || die 'ranks 0/1 do not name rank 3 as lost'\n\
                 [ $((t - s0)) -lt 45000 ] || die \"ranks 0/1 took $((t - s0)) ms (the kill is at about 10 s)\"\n\
                 echo \"ranks 0 and 1 ended $((t - s0)) ms after the start (the kill: about 10 s)\"\n",
            );
        }
        s.into_bytes()
    };
    steps.push(PairStep {
        label: "ranks: rank 3 SIGKILLed mid-allreduce: ranks 0-2 exit 2 naming it, within 30 s".into(),
        a: kill(0, false),
        b: kill(2, true),
        timeout: Duration::from_secs(120),
        output: Output::Live,
    });
    // 5. The same under mpirun: rank 3 (in guest B) SIGKILLed; mpirun must exit non-zero, the
    //    survivors having named rank 3, within 60 s.
    steps.push(PairStep {
        label: "ranks: rank 3 SIGKILLed under mpirun: the job fails naming it, nothing hangs".into(),
        a: format!(
            "{pre}t0=$(ms)\nmpirun_ 100 {c} -b 4M -e 4M -n 1000 -w 0 -c 0 --timeout 60 >/tmp/m.out 2>&1; rc=$?; t=$(($(ms) - t0))\n\
             rxe2-barrier ranks-5 60\ncat /tmp/m.out\n[ $rc -ne 0 ] && [ $rc -ne 124 ] || die \"mpirun exit $rc\"\n\
             grep -q 'rank 3' /tmp/m.out || die 'nothing names rank 3'\n[ $t -lt 60000 ] || die \"mpirun took $t ms\"\n\
             echo \"mpirun exit $rc after $t ms\"\n"
        )
        .into_bytes(),
        b: format!(
            "{PRELUDE}{x} __rsh-server & srv=$!\nn=0; victim=\n\
             while [ -z \"$victim\" ] && [ $n -lt 600 ]; do\n  \
               for p in $(pgrep -f examples/collectives); do tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=3' && victim=$p; done\n  \
               n=$((n + 1)); sleep 0.1\ndone\n[ -n \"$victim\" ] || die 'rank 3 never started'\n\
             sleep 10; kill -9 $victim; echo \"killed rank 3 (pid $victim)\"\n\
             rxe2-barrier ranks-5 120; rc=$?\nkill $srv 2>/dev/null\n[ $rc -eq 0 ] || die 'guest A did not finish'\n"
        )
        .into_bytes(),
        timeout: Duration::from_secs(150),
        output: Output::Live,
    });
    // 6. Rail 2 (rxe1's link, 10.0.3.x) cut for good mid-allreduce while rail 1 lives: the pieces
    //    striped onto rxe1 exhaust their retries (7 x 1 s ACK timeouts), the rank that sees it tells
    //    the group, and every rank exits 2 naming rxe1 within 45 s of the cut. No failover onto
    //    the live rail: an RC queue pair in error is not moved (see docs/groups.md).
    let cut = |first: u32| {
        let mut s = torchrun_pair(first, 29504, "c", "w='timeout 150'", " --rails all");
        if first == 0 {
            s.push_str(
                "sleep 10\nkill -0 $p0 && kill -0 $p1 || die 'a rank ended before the cut'\n\
                 t0=$(ms); rxe2-fault cut2 120 || die 'no cut'\n",
            );
        } else {
            s.push_str("t0=$((s0 + 10000))\n");
        }
        s.push_str(&format!(
            "wait $p0; rc0=$?; wait $p1; rc1=$?; t=$(($(ms) - t0))\n\
             cat /tmp/c{first}.out /tmp/c$(({first} + 1)).out\n\
             [ $rc0 -eq 2 ] && [ $rc1 -eq 2 ] || die \"rank exits $rc0 $rc1 (want 2 2)\"\n\
             grep -q rxe1 /tmp/c{first}.out && grep -q rxe1 /tmp/c$(({first} + 1)).out || die 'a rank does not name rxe1'\n\
             [ $t -lt 45000 ] || die \"the ranks took $t ms after the cut\"\n\
             echo \"both ranks ended $t ms after the cut\"\n"
        ));
        if first == 0 {
            s.push_str("rxe2-fault restore2 >/dev/null\n");
        }
        s.into_bytes()
    };
    steps.push(PairStep {
        label:
            "ranks: rail 2 (rxe1) cut mid-allreduce, rail 1 alive: every rank exits 2 naming rxe1 within 45 s"
                .into(),
        a: cut(0),
        b: cut(2),
        timeout: Duration::from_secs(120),
        output: Output::Live,
    });
    steps
}
