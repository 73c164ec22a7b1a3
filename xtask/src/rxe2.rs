//! Two guests joined by a link: `cargo xtask rxe2` and the two-host stage of `cargo xtask test`.
//!
//! # Design
//! - **Two QEMU guests**, A and B, boot the same kernel and initramfs as the single-guest harness
//!   ([`vm`]), each with one vCPU (two guests of two vCPUs each starve a 2-core host) and a
//!   virtio-net NIC (`-netdev dgram` over Unix datagram sockets: no host networking, no root). A first
//!   step in each guest loads `virtio_net`, replaces the single-guest `rxe0` (over `dummy0`) by an `rxe0`
//!   over the NIC, gives the NIC `10.0.2.1/24` (A) or `10.0.2.2/24` (B) and waits for the port to be
//!   ACTIVE and GID index 1 to be the RoCE v2 GID of that address.
//! - **The link** is a forwarder in xtask ([`Forwarder`]): each guest's NIC sends to a socket of the
//!   forwarder, which relays every datagram to the other guest's socket — unless the link is cut, when it
//!   drops them (a cable pulled out). Nothing else reaches the guests.
//! - **Control channel**: each guest's job folder (the read-write 9p share at `/run/ibverbs-xtask`) has a
//!   `ctl/` folder the host watches every 10 ms ([`Control`]). Two shell helpers the host writes to the
//!   job's `bin/` (first on `PATH`) use it:
//!   - `rxe2-barrier NAME [SECONDS]`: creates `ctl/barrier/NAME.arrived` and waits for the host's
//!     `NAME.go` (both guests arrived: exit 0), `NAME.dead` (the other guest is gone: exit 1) or its own
//!     limit (default 300 s: exit 124). Rust tests run the helper as a command.
//!   - `rxe2-fault kill-peer | restart-peer [SECONDS] | cut[2] [SECONDS] | restore[2]`: writes `ctl/fault/ID.req` and
//!     waits (at most 30 s) for the host's `ID.done`, then prints `ok applied_at_ns=N` (the host's wall
//!     clock when it did it: the round trip through 9p takes up to seconds in a loaded guest, so a test
//!     that times a fault compares its own wall clock with N). `kill-peer` SIGKILLs the other guest's
//!     QEMU (returns once it is dead); `restart-peer` does the same and then boots that guest again,
//!     SECONDS later if given (see *Restart*); `cut` stops the forwarder relaying datagrams (for
//!     SECONDS, or until `restore`); `cut2` and `restore2` do that to the second link of
//!     `--rails 2` only.
//! - **Steps**: both guests run the same number of steps; each step starts with a barrier, so step N of A
//!   and of B start together. A pair's exit status is the worse of the two (124 if either timed out); a
//!   guest killed on request does not count (its peer's status is the pair's).
//! - **Restart** (`rxe2-fault restart-peer`): the killed guest boots again from scratch (a new kernel,
//!   a new rxe0, the same MAC and address, a job folder emptied but for `ctl/` and `bin/`), runs the link
//!   setup and then **resumes the step it was killed in**, without that step's barrier and with
//!   `RXE2_RESTARTED=1` in its environment, followed by the remaining steps as usual. Its results stand
//!   for that side from then on (a restarted side counts, unlike a killed one); the other side meets it
//!   with a barrier, which waits for the boot instead of reporting the side gone.
//! - **Environment** of each side: `RXE2_ROLE` (`a`/`b`), `RXE2_SELF`, `RXE2_PEER` (IPv4 addresses),
//!   `RXE2_CTL` (the control folder), `IBVERBS_TEST_IP` = `RXE2_SELF`, and the single guest's
//!   `IBVERBS_TEST_DEVICE` (`rxe0`) and `IBVERBS_TEST_GID_INDEX` (1).

use std::ffi::OsString;
use std::fs;
use std::io::ErrorKind;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::vm::{self, Backend, End, Output, Step, StepResult};
use crate::{shell, signals};

/// IPv4 address of guest A on the link.
pub const ADDR_A: &str = "10.0.2.1";
/// IPv4 address of guest B on the link.
pub const ADDR_B: &str = "10.0.2.2";
/// Where the job folder is in a guest.
const GUEST_JOB: &str = "/run/ibverbs-xtask";
/// Time the link setup step of each guest may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the host looks at the control folders.
const CONTROL_POLL: Duration = Duration::from_millis(10);

/// The barrier helper (see the module documentation).
const BARRIER_SCRIPT: &str = r#"#!/bin/sh
# rxe2-barrier NAME [SECONDS]: wait until the other guest reaches barrier NAME too (cargo xtask rxe2).
# Exit 0 when both arrived, 1 when the other guest is gone, 124 after SECONDS (default 300).
name=$1
limit=${2:-300}
case $name in '' | */* | .*) echo "rxe2-barrier: bad barrier name '$name'" >&2; exit 2 ;; esac
d=$RXE2_CTL/barrier
: >"$d/.$name.$$" && mv "$d/.$name.$$" "$d/$name.arrived" || exit 2
end=$(($(date +%s) + limit))
i=0
while :; do
	if [ -e "$d/$name.go" ]; then rm -f "$d/$name.go"; exit 0; fi
	if [ -e "$d/$name.dead" ]; then
		rm -f "$d/$name.dead"
		echo "rxe2-barrier: $name: the other guest is gone" >&2
		exit 1
	fi
	# The clock, not a count of sleeps: a loop round takes far longer than its sleep in a slow guest.
	i=$((i + 1))
	if [ $((i % 10)) -eq 0 ] && [ "$(date +%s)" -ge "$end" ]; then break; fi
	sleep 0.02
done
rm -f "$d/$name.arrived"
echo "rxe2-barrier: $name: the other guest did not arrive within $limit s" >&2
exit 124
"#;

/// The fault helper (see the module documentation).
const FAULT_SCRIPT: &str = r#"#!/bin/sh
# rxe2-fault kill-peer | restart-peer [SECONDS] | cut[2] [SECONDS] | restore[2]: ask the host for a fault (cargo xtask rxe2).
# Returns once the host has done it: exit 0 and prints "ok applied_at_ns=N" (the host's wall clock when
# it did it), or exit 1 with the host's reason, 124 without an answer in 30 s.
id=$$.$(date +%s%N)
d=$RXE2_CTL/fault
printf '%s\n' "$*" >"$d/.$id" && mv "$d/.$id" "$d/$id.req" || exit 2
end=$(($(date +%s) + 30))
i=0
while [ ! -e "$d/$id.done" ]; do
	i=$((i + 1))
	if [ $((i % 10)) -eq 0 ] && [ "$(date +%s)" -ge "$end" ]; then
		echo "rxe2-fault: $*: no answer from the host" >&2
		exit 124
	fi
	sleep 0.02
done
r=$(cat "$d/$id.done")
rm -f "$d/$id.done"
case $r in
ok*) echo "$r"; exit 0 ;;
*) echo "rxe2-fault: $*: $r" >&2; exit 1 ;;
esac
"#;

/// The link setup step: rxe0 over the virtio NIC instead of dummy0.
const SETUP_SCRIPT: &str = r#"set -u
fail() { echo "rxe2 link setup: $*" >&2; exit 1; }
modprobe virtio_net || fail "modprobe virtio_net"
nic=
n=0
while [ -z "$nic" ]; do
	for d in /sys/class/net/*; do
		case "$(cat "$d/address" 2>/dev/null)" in 52:54:00:12:34:*) nic=${d##*/} ;; esac
	done
	n=$((n + 1))
	[ -n "$nic" ] || [ "$n" -le 100 ] || fail "no virtio NIC after 10 s"
	[ -n "$nic" ] || sleep 0.1
done
# Host names (Open MPI refuses a node named "(none)"), resolvable in both guests.
hostname "guest-$RXE2_ROLE" 2>/dev/null || echo "guest-$RXE2_ROLE" > /proc/sys/kernel/hostname
printf '10.0.2.1 guest-a\n10.0.2.2 guest-b\n' >> /etc/hosts 2>/dev/null || true
rdma link delete rxe0 || fail "rdma link delete rxe0"
ip link delete dummy0 || fail "ip link delete dummy0"
ip link set "$nic" mtu "$RXE2_MTU" || fail "ip link set $nic mtu $RXE2_MTU"
ip link set "$nic" up || fail "ip link set $nic up"
ip addr add "$RXE2_SELF/24" dev "$nic" || fail "ip addr add $RXE2_SELF/24 dev $nic"
rdma link add rxe0 type rxe netdev "$nic" || fail "rdma link add rxe0 type rxe netdev $nic"
want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' $(echo "$RXE2_SELF" | tr . ' '))
p=/sys/class/infiniband/rxe0/ports/1
n=0
until grep -q ACTIVE "$p/state" 2>/dev/null && [ "$(cat "$p/gids/1" 2>/dev/null)" = "$want" ]; do
	n=$((n + 1))
	[ "$n" -le 200 ] || fail "rxe0 not ACTIVE with GID[1] = $want after 20 s: $(cat "$p/state" "$p/gids/1" 2>&1)"
	sleep 0.1
done
echo "rxe0 over $nic ($RXE2_SELF, MTU $RXE2_MTU): $(cat "$p/state"), active_mtu $(cat "$p/active_mtu" 2>/dev/null)"
[ "${RXE2_RAILS:-1}" -ge 2 ] || exit 0
# The second rail: the NIC whose MAC is 52:54:00:12:35:xx, 10.0.3.x, rxe1.
self2=$(echo "$RXE2_SELF" | sed 's/^10\.0\.2\./10.0.3./')
nic2=
n=0
while [ -z "$nic2" ]; do
	for d in /sys/class/net/*; do
		case "$(cat "$d/address" 2>/dev/null)" in 52:54:00:12:35:*) nic2=${d##*/} ;; esac
	done
	n=$((n + 1))
	[ -n "$nic2" ] || [ "$n" -le 100 ] || fail "no second NIC after 10 s"
	[ -n "$nic2" ] || sleep 0.1
done
[ "$nic2" != "$nic" ] || fail "the second NIC is the first ($nic)"
ip link set "$nic2" mtu "$RXE2_MTU" || fail "ip link set $nic2 mtu"
ip link set "$nic2" up || fail "ip link set $nic2 up"
ip addr add "$self2/24" dev "$nic2" || fail "ip addr add $self2/24 dev $nic2"
rdma link add rxe1 type rxe netdev "$nic2" || fail "rdma link add rxe1 type rxe netdev $nic2"
want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' $(echo "$self2" | tr . ' '))
p=/sys/class/infiniband/rxe1/ports/1
n=0
until grep -q ACTIVE "$p/state" 2>/dev/null && [ "$(cat "$p/gids/1" 2>/dev/null)" = "$want" ]; do
	n=$((n + 1))
	[ "$n" -le 200 ] || fail "rxe1 not ACTIVE with GID[1] = $want after 20 s"
	sleep 0.1
done
echo "rxe1 over $nic2 ($self2): NUMA nodes: $nic $(cat /sys/class/net/$nic/device/../numa_node 2>/dev/null), $nic2 $(cat /sys/class/net/$nic2/device/../numa_node 2>/dev/null); CPUs of node 1: $(cat /sys/devices/system/node/node1/cpulist 2>/dev/null)"
"#;

/// One side of the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Guest A (`10.0.2.1`).
    A,
    /// Guest B (`10.0.2.2`).
    B,
}

impl Side {
    fn index(self) -> usize {
        match self {
            Side::A => 0,
            Side::B => 1,
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Side::A => "[A] ",
            Side::B => "[B] ",
        }
    }
}

/// One step of a two-guest job: a script for each guest, started together.
#[derive(Debug, Clone)]
pub struct PairStep {
    /// What reports call it.
    pub label: String,
    /// Guest A's script.
    pub a: Vec<u8>,
    /// Guest B's script.
    pub b: Vec<u8>,
    /// Each side is killed after this long (exit status 124).
    pub timeout: Duration,
    /// What happens to the output.
    pub output: Output,
}

/// Options of a two-guest job.
#[derive(Debug, Clone)]
pub struct PairOptions {
    /// MTU of A's and B's NIC.
    pub mtu: [u32; 2],
    /// vCPUs per guest.
    pub smp: u32,
    /// Links between the guests (1 or 2). With 2, each guest has a second NIC on a second link
    /// (`10.0.3.1`/`10.0.3.2`, its own forwarder) with `rxe1` over it, and two NUMA nodes of one
    /// vCPU and half the memory each: NIC 1 (rxe0) sits on a PCI expander bridge of node 0, NIC 2
    /// (rxe1) on one of node 1 (`/sys/class/net/*/device/numa_node` says so in the guest).
    /// Needs `smp` 2.
    pub rails: u32,
}

/// A pair step's outcome.
#[derive(Debug, Clone)]
pub struct PairResult {
    /// A's and B's results (`None`: that side never ran the step).
    pub sides: [Option<StepResult>; 2],
    /// The pair's exit status: the worse of the two (see [`combine`]).
    pub code: i32,
}

/// How a two-guest job ended.
#[derive(Debug)]
pub struct PairReport {
    /// The results of the pair steps, in order (a step only one side finished has `None` for the other).
    pub results: Vec<PairResult>,
    /// Each side's [`vm::Report`].
    pub reports: [vm::Report; 2],
    /// Whether each side was killed on request (`rxe2-fault kill-peer`).
    pub killed: [bool; 2],
    /// How many times each side was restarted on request (`rxe2-fault restart-peer`).
    pub restarts: [u32; 2],
    /// The pair step each side's last boot started at (0 unless it was restarted); its
    /// [`vm::Report`] counts steps from there.
    pub resumed_at: [usize; 2],
    /// From the start until both links were up, if they came up.
    pub boot: Option<Duration>,
    /// Datagrams relayed and dropped by the forwarder.
    pub relayed: u64,
    /// Datagrams dropped (link cut, or a guest not there).
    pub dropped: u64,
}

impl PairReport {
    /// The job's exit status: the worse of the sides' (a side killed on request does not count); 124 on
    /// timeout; 125 when a guest failed to boot or died unasked.
    pub fn exit_code(&self) -> u8 {
        let mut codes = Vec::new();
        for (i, report) in self.reports.iter().enumerate() {
            if self.killed[i] {
                continue;
            }
            let code = match &report.end {
                End::Completed => {
                    self.results.iter().map(|r| r.sides[i].as_ref().map_or(0, side_code)).fold(0, worse)
                }
                End::Stuck(_) => i32::from(vm::EXIT_TIMEOUT),
                End::Interrupted(signal) => i32::from(signals::exit_status(*signal)),
                End::BootFailed(_) | End::Died(_) => i32::from(vm::EXIT_VM_FAILURE),
            };
            codes.push(code);
        }
        u8::try_from(codes.into_iter().fold(0, worse)).unwrap_or(1)
    }

    /// Explains on stderr what went wrong on each side, with its console's tail.
    pub fn explain(&self, side_steps: &[Vec<Step>; 2]) {
        for side in [Side::A, Side::B] {
            let i = side.index();
            if self.killed[i] {
                eprintln!("xtask: {}killed on request (rxe2-fault kill-peer)", side.tag());
                continue;
            }
            let report = &self.reports[i];
            let failed = !matches!(report.end, End::Completed) || report.results.iter().any(|r| r.timed_out);
            if failed {
                eprintln!("xtask: {}----", side.tag());
                let first = self.resumed_at[i];
                if first == 0 {
                    report.explain(&side_steps[i]);
                } else {
                    // The restarted boot: the link setup, then the steps from the one it resumed.
                    let steps = &side_steps[i];
                    let mut resumed = steps[..1].to_vec();
                    resumed.extend_from_slice(steps.get(1 + first..).unwrap_or(&[]));
                    report.explain(&resumed);
                }
            }
        }
    }
}

/// A step's exit status as the pair sees it (124 when it timed out).
fn side_code(r: &StepResult) -> i32 {
    if r.timed_out {
        i32::from(vm::EXIT_TIMEOUT)
    } else {
        r.code
    }
}

/// The worse of two exit statuses: 124 (timeout) beats any other failure, a failure beats success, and
/// between two failures the larger wins.
pub fn worse(a: i32, b: i32) -> i32 {
    let timeout = i32::from(vm::EXIT_TIMEOUT);
    if a == timeout || b == timeout {
        timeout
    } else if a == 0 {
        b
    } else if b == 0 {
        a
    } else {
        a.max(b)
    }
}

/// Combines both sides of a pair step: the worse status; a side killed on request does not count, and
/// a side that did not run it counts as 125 (its guest failed).
pub fn combine(a: Option<&StepResult>, b: Option<&StepResult>, killed: [bool; 2]) -> i32 {
    let mut code = 0;
    for (i, r) in [a, b].into_iter().enumerate() {
        code = match (r, killed[i]) {
            (_, true) => code,
            (Some(r), false) => worse(code, side_code(r)),
            (None, false) => worse(code, i32::from(vm::EXIT_VM_FAILURE)),
        };
    }
    code
}

/// A fault the guests (or the host) can ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL the other guest's QEMU.
    KillPeer,
    /// Drop every datagram on the link, for this long (or until [`Fault::Restore`]).
    Cut(Option<Duration>),
    /// Relay datagrams again.
    Restore,
    /// [`Fault::Cut`] of the second link (`--rails 2`: rxe1, 10.0.3.x) only.
    Cut2(Option<Duration>),
    /// [`Fault::Restore`] of the second link.
    Restore2,
    /// SIGKILL the other guest's QEMU, then boot that guest again (it resumes the step it was in),
    /// after this long (at once if `None`): the survivor can see the peer gone before it returns.
    RestartPeer(Option<Duration>),
}

impl Fault {
    /// Parses a request line of `rxe2-fault`.
    pub fn parse(line: &str) -> Result<Fault, String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["kill-peer"] => Ok(Fault::KillPeer),
            ["restart-peer"] => Ok(Fault::RestartPeer(None)),
            ["restart-peer", secs] => Ok(Fault::RestartPeer(Some(seconds(secs)?))),
            ["restore"] => Ok(Fault::Restore),
            ["cut"] => Ok(Fault::Cut(None)),
            ["cut", secs] => Ok(Fault::Cut(Some(seconds(secs)?))),
            ["restore2"] => Ok(Fault::Restore2),
            ["cut2"] => Ok(Fault::Cut2(None)),
            ["cut2", secs] => Ok(Fault::Cut2(Some(seconds(secs)?))),
            _ => Err(format!(
                "unknown fault `{line}` (kill-peer | restart-peer [SECONDS] | cut[2] [SECONDS] | restore[2])"
            )),
        }
    }
}

/// A fault's duration: seconds (`3`, `0.5`, `3s`), more than 0 and up to an hour.
fn seconds(word: &str) -> Result<Duration, String> {
    let secs = word.strip_suffix('s').unwrap_or(word);
    secs.parse()
        .ok()
        .filter(|s: &f64| s.is_finite() && *s > 0.0 && *s <= 3600.0)
        .map(Duration::from_secs_f64)
        .ok_or(format!("bad duration `{secs}` (seconds, up to 3600)"))
}

/// The link's state, shared by the forwarder and the control thread.
#[derive(Debug, Default)]
pub struct LinkState {
    /// Datagrams are dropped while this is set...
    cut: AtomicBool,
    /// ...or until this instant (if any).
    cut_until: Mutex<Option<Instant>>,
    relayed: AtomicU64,
    dropped: AtomicU64,
    stop: AtomicBool,
}

impl LinkState {
    /// Whether the link is cut now (a timed cut that expired is lifted).
    pub fn is_cut(&self) -> bool {
        if !self.cut.load(Ordering::SeqCst) {
            return false;
        }
        let mut until = self.cut_until.lock().unwrap_or_else(|e| e.into_inner());
        match *until {
            Some(t) if Instant::now() >= t => {
                *until = None;
                self.cut.store(false, Ordering::SeqCst);
                false
            }
            _ => true,
        }
    }

    /// Cuts the link, for `d` or until [`LinkState::restore`].
    pub fn cut(&self, d: Option<Duration>) {
        *self.cut_until.lock().unwrap_or_else(|e| e.into_inner()) = d.map(|d| Instant::now() + d);
        self.cut.store(true, Ordering::SeqCst);
    }

    /// Restores the link.
    pub fn restore(&self) {
        *self.cut_until.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// The host end of the link: relays datagrams between the two guests' sockets, or drops them while the
/// link is cut.
pub struct Forwarder {
    state: Arc<LinkState>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Forwarder {
    /// Binds `ours[i]` (where guest i sends) and relays what arrives to `theirs[1 - i]` (where guest
    /// 1 - i receives).
    pub fn start(ours: [&Path; 2], theirs: [&Path; 2], state: Arc<LinkState>) -> Result<Forwarder, String> {
        let bind = |p: &Path| -> Result<UnixDatagram, String> {
            let s = UnixDatagram::bind(p).map_err(|e| format!("binding {}: {e}", p.display()))?;
            s.set_read_timeout(Some(Duration::from_millis(100))).map_err(|e| e.to_string())?;
            s.set_write_timeout(Some(Duration::from_millis(200))).map_err(|e| e.to_string())?;
            Ok(s)
        };
        let sockets = [Arc::new(bind(ours[0])?), Arc::new(bind(ours[1])?)];
        let mut threads = Vec::new();
        for i in 0..2 {
            let from = Arc::clone(&sockets[i]);
            let to = Arc::clone(&sockets[1 - i]);
            let dest = theirs[1 - i].to_path_buf();
            let state = Arc::clone(&state);
            threads.push(thread::spawn(move || relay(&from, &to, &dest, &state)));
        }
        Ok(Forwarder { state, threads })
    }

    /// Stops the relay threads.
    pub fn stop(self) {
        self.state.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// One direction of the link.
fn relay(from: &UnixDatagram, to: &UnixDatagram, dest: &Path, state: &LinkState) {
    let mut buf = vec![0u8; 70_000];
    while !state.stop.load(Ordering::SeqCst) {
        let n = match from.recv(&mut buf) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(_) => return,
        };
        if state.is_cut() || to.send_to(&buf[..n], dest).is_err() {
            state.dropped.fetch_add(1, Ordering::Relaxed);
        } else {
            state.relayed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What the control thread shares with the rest.
#[derive(Debug, Default)]
struct Shared {
    /// QEMU's pid per side (0 before it runs and after it ended).
    pids: [Arc<AtomicU32>; 2],
    /// The side's VM has ended (its `vm::run_with` returned).
    done: [AtomicBool; 2],
    /// The side was killed on request.
    killed: [AtomicBool; 2],
    /// The side was killed to be booted again; its VM thread boots it (and clears this).
    restarting: [AtomicBool; 2],
    /// How long the VM thread waits before that boot, in milliseconds.
    restart_delay_ms: [AtomicU64; 2],
    /// Pair steps each side has finished (the step a restarted side resumes).
    finished: [AtomicUsize; 2],
    /// Restarts of each side.
    restarts: [AtomicU32; 2],
}

/// The control thread: barriers and fault requests of both guests (see the module documentation).
struct Control {
    ctl: [PathBuf; 2],
    shared: Arc<Shared>,
    link: Arc<LinkState>,
    /// The second link (`rails` 2; cut and restored but never relayed otherwise).
    link2: Arc<LinkState>,
}

impl Control {
    fn run(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::SeqCst) {
            self.barriers();
            for side in [Side::A, Side::B] {
                self.faults(side);
            }
            thread::sleep(CONTROL_POLL);
        }
    }

    fn gone(&self, i: usize) -> bool {
        self.shared.done[i].load(Ordering::SeqCst) || self.shared.killed[i].load(Ordering::SeqCst)
    }

    fn barriers(&self) {
        for i in 0..2 {
            let dir = self.ctl[i].join("barrier");
            let Ok(entries) = fs::read_dir(&dir) else { continue };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(barrier) = name.strip_suffix(".arrived") else { continue };
                let other = self.ctl[1 - i].join("barrier").join(&name);
                if other.exists() {
                    let _ = fs::remove_file(entry.path());
                    let _ = fs::remove_file(&other);
                    for ctl in &self.ctl {
                        let _ = fs::write(ctl.join("barrier").join(format!("{barrier}.go")), b"");
                    }
                } else if self.gone(1 - i) {
                    let _ = fs::remove_file(entry.path());
                    let _ = fs::write(dir.join(format!("{barrier}.dead")), b"");
                }
            }
        }
    }

    fn faults(&self, side: Side) {
        let i = side.index();
        let dir = self.ctl[i].join("fault");
        let Ok(entries) = fs::read_dir(&dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".req") else { continue };
            let line = fs::read_to_string(entry.path()).unwrap_or_default();
            let _ = fs::remove_file(entry.path());
            let answer = match Fault::parse(&line) {
                Ok(fault) => {
                    eprintln!("xtask: {}fault requested: {}", side.tag(), line.trim());
                    match self.apply(side, &fault) {
                        Ok(()) => {
                            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
                            format!("ok applied_at_ns={}", now.map_or(0, |d| d.as_nanos()))
                        }
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            let tmp = dir.join(format!(".{id}.answer"));
            let _ = fs::write(&tmp, format!("{answer}\n"))
                .and_then(|()| fs::rename(&tmp, dir.join(format!("{id}.done"))));
        }
    }

    /// Does `fault`, asked for by `side`.
    fn apply(&self, side: Side, fault: &Fault) -> Result<(), String> {
        match fault {
            Fault::KillPeer | Fault::RestartPeer(_) => {
                let peer = 1 - side.index();
                let pid = self.shared.pids[peer].load(Ordering::SeqCst);
                if pid == 0 {
                    return Err("the peer guest is not running".into());
                }
                let flag = match fault {
                    Fault::RestartPeer(delay) => {
                        let ms = delay.map_or(0, |d| d.as_millis() as u64);
                        self.shared.restart_delay_ms[peer].store(ms, Ordering::SeqCst);
                        &self.shared.restarting[peer]
                    }
                    _ => &self.shared.killed[peer],
                };
                flag.store(true, Ordering::SeqCst);
                signals::send(pid, libc::SIGKILL);
                // Answer once it is dead: its QEMU is our child, reaped by its VM thread.
                let deadline = Instant::now() + Duration::from_secs(10);
                while Path::new(&format!("/proc/{pid}/stat")).exists()
                    && fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
                {
                    if Instant::now() > deadline {
                        return Err("the peer's QEMU did not die within 10 s".into());
                    }
                    thread::sleep(Duration::from_millis(5));
                }
                Ok(())
            }
            Fault::Cut(d) => {
                self.link.cut(*d);
                Ok(())
            }
            Fault::Restore => {
                self.link.restore();
                Ok(())
            }
            Fault::Cut2(d) => {
                self.link2.cut(*d);
                Ok(())
            }
            Fault::Restore2 => {
                self.link2.restore();
                Ok(())
            }
        }
    }
}

/// The variables of one side.
fn side_env(side: Side, mtu: u32) -> Vec<(String, String)> {
    let (me, peer, role) = match side {
        Side::A => (ADDR_A, ADDR_B, "a"),
        Side::B => (ADDR_B, ADDR_A, "b"),
    };
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    vec![
        ("RXE2_ROLE".into(), role.into()),
        ("RXE2_SELF".into(), me.into()),
        ("RXE2_PEER".into(), peer.into()),
        ("RXE2_MTU".into(), mtu.to_string()),
        ("RXE2_CTL".into(), format!("{GUEST_JOB}/ctl")),
        ("IBVERBS_TEST_IP".into(), me.into()),
        ("PATH".into(), format!("{GUEST_JOB}/bin:/usr/sbin:/sbin:{path}")),
    ]
}

/// The steps one side runs: the link setup, then each pair step's script after a barrier.
fn side_steps(steps: &[PairStep], side: Side) -> Vec<Step> {
    side_steps_from(steps, side, 0)
}

/// [`side_steps`] of a guest restarted in pair step `first`: the link setup, then the pair steps from
/// `first` on, where step `first` (the one it was killed in) starts without its barrier (the other side
/// is past it). `first == 0` is a first boot.
fn side_steps_from(steps: &[PairStep], side: Side, first: usize) -> Vec<Step> {
    let mut out = vec![Step {
        label: "link setup".into(),
        script: SETUP_SCRIPT.as_bytes().to_vec(),
        timeout: SETUP_TIMEOUT,
        output: Output::Captured,
    }];
    for (n, step) in steps.iter().enumerate().skip(first) {
        let mut script = if first > 0 && n == first {
            Vec::new()
        } else {
            format!(
                "rxe2-barrier step-{n} {} || {{ echo 'xtask: the other guest did not start this step' >&2; exit 125; }}\n",
                step.timeout.as_secs().max(1)
            )
            .into_bytes()
        };
        script.extend_from_slice(if side == Side::A { &step.a } else { &step.b });
        out.push(Step { label: step.label.clone(), script, timeout: step.timeout, output: step.output });
    }
    out
}

/// Each side's steps as [`run`] runs them (for [`PairReport::explain`]).
pub fn side_steps_of(steps: &[PairStep]) -> [Vec<Step>; 2] {
    [side_steps(steps, Side::A), side_steps(steps, Side::B)]
}

/// What [`run`] calls after each pair step.
pub type OnPairResult<'a> = dyn FnMut(usize, &PairResult) + Send + 'a;

/// Runs `steps` on two guests joined by a link; `on_result` is called for each finished pair step
/// (index, result).
pub fn run(
    steps: &[PairStep],
    opts: &PairOptions,
    on_result: &mut OnPairResult<'_>,
) -> Result<PairReport, String> {
    let tmp = vm::TempDir::new()?;
    let sock = |n: &str| tmp.path.join(n);
    let (guest_a, guest_b, host_a, host_b) =
        (sock("a.sock"), sock("b.sock"), sock("ha.sock"), sock("hb.sock"));
    let link = Arc::new(LinkState::default());
    let forwarder = Forwarder::start([&host_a, &host_b], [&guest_a, &guest_b], Arc::clone(&link))?;
    let two = opts.rails >= 2;
    let (guest_a2, guest_b2, host_a2, host_b2) =
        (sock("a2.sock"), sock("b2.sock"), sock("ha2.sock"), sock("hb2.sock"));
    let link2 = Arc::new(LinkState::default());
    let forwarder2 = if two {
        Some(Forwarder::start([&host_a2, &host_b2], [&guest_a2, &guest_b2], Arc::clone(&link2))?)
    } else {
        None
    };
    let shared = Arc::new(Shared::default());
    let mut jobs = Vec::new();
    for (side, dir) in [(Side::A, "job-a"), (Side::B, "job-b")] {
        let job = tmp.path.join(dir);
        let io = |e: std::io::Error| format!("writing {}: {e}", job.display());
        for sub in ["ctl/barrier", "ctl/fault", "bin"] {
            fs::create_dir_all(job.join(sub)).map_err(io)?;
        }
        for (name, text) in [("rxe2-barrier", BARRIER_SCRIPT), ("rxe2-fault", FAULT_SCRIPT)] {
            let path = job.join("bin").join(name);
            fs::write(&path, text).map_err(io)?;
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).map_err(io)?;
        }
        let _ = side;
        jobs.push(job);
    }
    let control = Control {
        ctl: [jobs[0].join("ctl"), jobs[1].join("ctl")],
        shared: Arc::clone(&shared),
        link: Arc::clone(&link),
        link2: Arc::clone(&link2),
    };
    let start = Instant::now();
    let ready: Mutex<[Option<Instant>; 2]> = Mutex::new([None, None]);
    let results: Mutex<Vec<[Option<StepResult>; 2]>> = Mutex::new(vec![[None, None]; steps.len()]);
    let reported: Mutex<usize> = Mutex::new(0);
    let stop_control = AtomicBool::new(false);
    let on_result = Mutex::new(on_result);
    let backend = Backend::Vm { mtu: 1500, device: crate::vm::VmDevice::Rxe };

    let reports = thread::scope(|s| -> Result<[(vm::Report, usize); 2], String> {
        let control_thread = s.spawn(|| control.run(&stop_control));
        let mut handles = Vec::new();
        for side in [Side::A, Side::B] {
            let i = side.index();
            let (job, sock_self, sock_host) = match side {
                Side::A => (&jobs[0], &guest_a, &host_a),
                Side::B => (&jobs[1], &guest_b, &host_b),
            };
            let mac = format!("52:54:00:12:34:{:02x}", 0x0a + i);
            let netdev = |id: &str, own: &Path, host: &Path| {
                [
                    OsString::from("-netdev"),
                    OsString::from(format!(
                        "dgram,id={id},local.type=unix,local.path={},remote.type=unix,remote.path={}",
                        vm::qemu_escape(own),
                        vm::qemu_escape(host)
                    )),
                ]
            };
            let mut qemu_args: Vec<OsString> = netdev("link", sock_self, sock_host).to_vec();
            if two {
                let (own2, host2) = match side {
                    Side::A => (&guest_a2, &host_a2),
                    Side::B => (&guest_b2, &host_b2),
                };
                let mac2 = format!("52:54:00:12:35:{:02x}", 0x0a + i);
                qemu_args.extend(netdev("link2", own2, host2));
                for arg in [
                    "-object",
                    "memory-backend-ram,id=mem0,size=1G",
                    "-numa",
                    "node,nodeid=0,cpus=0,memdev=mem0",
                    "-object",
                    "memory-backend-ram,id=mem1,size=1G",
                    "-numa",
                    "node,nodeid=1,cpus=1,memdev=mem1",
                    "-device",
                    "pxb,id=pxb0,bus_nr=32,numa_node=0,bus=pci.0",
                    "-device",
                    "pxb,id=pxb1,bus_nr=64,numa_node=1,bus=pci.0",
                ] {
                    qemu_args.push(OsString::from(arg));
                }
                qemu_args.push(OsString::from("-device"));
                qemu_args
                    .push(OsString::from(format!("virtio-net-pci,netdev=link,mac={mac},bus=pxb0,addr=0")));
                qemu_args.push(OsString::from("-device"));
                qemu_args
                    .push(OsString::from(format!("virtio-net-pci,netdev=link2,mac={mac2},bus=pxb1,addr=0")));
            } else {
                qemu_args.push(OsString::from("-device"));
                qemu_args.push(OsString::from(format!("virtio-net-pci,netdev=link,mac={mac}")));
            }
            let mut env = side_env(side, opts.mtu[i]);
            env.push(("RXE2_RAILS".into(), opts.rails.max(1).to_string()));
            let extras = vm::Extras {
                qemu_args,
                env,
                job: Some(job.clone()),
                pid: Some(Arc::clone(&shared.pids[i])),
                tag: Some(side.tag()),
                smp: opts.smp,
                console_suffix: if side == Side::A { "-a" } else { "-b" },
                // The environment's choice (IBVERBS_XTASK_ICOUNT), as for one guest.
                icount: None,
            };
            let (shared, ready, results, reported, on_result, backend) =
                (&shared, &ready, &results, &reported, &on_result, &backend);
            let mut extras = extras;
            handles.push(s.spawn(move || {
                // The pair step this boot starts at (0, or the step a restarted guest resumes).
                let mut first = 0;
                loop {
                    let steps_now = side_steps_from(steps, side, first);
                    let report = vm::run_with(&steps_now, backend, &extras, &mut |n, r| {
                        if n == 0 {
                            if r.code != 0 {
                                eprintln!("xtask: {}link setup failed ({}):", side.tag(), r.code);
                                eprint!("{}", String::from_utf8_lossy(&r.stdout));
                                eprint!("{}", String::from_utf8_lossy(&r.stderr));
                            }
                            if first > 0 {
                                eprintln!(
                                    "xtask: {}restarted guest up, link and rxe0 ready after {:.1} s",
                                    side.tag(),
                                    r.elapsed.as_secs_f64()
                                );
                                return;
                            }
                            let mut ready = ready.lock().unwrap_or_else(|e| e.into_inner());
                            ready[i] = Some(Instant::now());
                            if let [Some(a), Some(b)] = *ready {
                                let t = a.max(b) - start;
                                eprintln!(
                                    "xtask: both guests up, link and rxe0 ready after {:.1} s",
                                    t.as_secs_f64()
                                );
                            }
                            return;
                        }
                        let k = first + n - 1;
                        shared.finished[i].store(k + 1, Ordering::SeqCst);
                        let mut all = results.lock().unwrap_or_else(|e| e.into_inner());
                        all[k][i] = Some(r.clone());
                        flush_results(&all, &shared.killed, &shared.done, reported, on_result);
                    });
                    if !shared.restarting[i].swap(false, Ordering::SeqCst) {
                        shared.done[i].store(true, Ordering::SeqCst);
                        let all = results.lock().unwrap_or_else(|e| e.into_inner());
                        flush_results(&all, &shared.killed, &shared.done, reported, on_result);
                        break report.map(|r| (r, first));
                    }
                    first = shared.finished[i].load(Ordering::SeqCst);
                    shared.restarts[i].fetch_add(1, Ordering::SeqCst);
                    let Some(step) = steps.get(first) else {
                        // Killed after its last step: nothing to resume.
                        shared.done[i].store(true, Ordering::SeqCst);
                        break report.map(|r| (r, first));
                    };
                    let delay = Duration::from_millis(shared.restart_delay_ms[i].load(Ordering::SeqCst));
                    eprintln!(
                        "xtask: {}restarting the guest in {:.1} s (rxe2-fault restart-peer); it resumes `{}`",
                        side.tag(),
                        delay.as_secs_f64(),
                        step.label
                    );
                    thread::sleep(delay);
                    if let Err(e) = prepare_restart(job, sock_self) {
                        shared.done[i].store(true, Ordering::SeqCst);
                        break Err(e);
                    }
                    if !extras.env.iter().any(|(k, _)| k == "RXE2_RESTARTED") {
                        extras.env.push(("RXE2_RESTARTED".into(), "1".into()));
                    }
                }
            }));
        }
        // Every VM thread joined, then the control thread stopped, before any error returns:
        // the scope would wait for the control thread for ever.
        let joined: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        stop_control.store(true, Ordering::SeqCst);
        let _ = control_thread.join();
        let mut out = Vec::new();
        for r in joined {
            out.push(r.map_err(|_| "a VM thread panicked".to_string())?);
        }
        let b = out.pop().expect("two reports")?;
        let a = out.pop().expect("two reports")?;
        Ok([a, b])
    });
    forwarder.stop();
    if let Some(f) = forwarder2 {
        f.stop();
    }
    let [(report_a, resumed_a), (report_b, resumed_b)] = reports?;
    let reports = [report_a, report_b];
    let killed = [shared.killed[0].load(Ordering::SeqCst), shared.killed[1].load(Ordering::SeqCst)];
    let restarts = [shared.restarts[0].load(Ordering::SeqCst), shared.restarts[1].load(Ordering::SeqCst)];
    let all = results.into_inner().unwrap_or_else(|e| e.into_inner());
    let results = all
        .into_iter()
        .filter(|r| r.iter().any(Option::is_some))
        .map(|[a, b]| PairResult { code: combine(a.as_ref(), b.as_ref(), killed), sides: [a, b] })
        .collect();
    let ready = ready.into_inner().unwrap_or_else(|e| e.into_inner());
    let boot = match ready {
        [Some(a), Some(b)] => Some(a.max(b) - start),
        _ => None,
    };
    Ok(PairReport {
        results,
        reports,
        killed,
        restarts,
        resumed_at: [resumed_a, resumed_b],
        boot,
        relayed: link.relayed.load(Ordering::Relaxed),
        dropped: link.dropped.load(Ordering::Relaxed),
    })
}

/// Readies `job` and the guest's NIC socket for a restarted guest: the job folder keeps only `ctl/`
/// and `bin/` (the steps, outputs and exit statuses of the killed boot would be read as the new
/// boot's), and the killed QEMU's socket file is removed (the new QEMU binds the same path).
fn prepare_restart(job: &Path, socket: &Path) -> Result<(), String> {
    let entries = fs::read_dir(job).map_err(|e| format!("reading {}: {e}", job.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("reading {}: {e}", job.display()))?;
        let name = entry.file_name();
        if name == "ctl" || name == "bin" {
            continue;
        }
        let path = entry.path();
        let gone = if entry.file_type().is_ok_and(|t| t.is_dir()) {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        gone.map_err(|e| format!("removing {}: {e}", path.display()))?;
    }
    match fs::remove_file(socket) {
        Err(e) if e.kind() != ErrorKind::NotFound => Err(format!("removing {}: {e}", socket.display())),
        _ => Ok(()),
    }
}

/// Calls `on_result` for the pair steps that are complete (both sides finished, or a side is gone), in
/// order, each once.
fn flush_results(
    all: &[[Option<StepResult>; 2]],
    killed: &[AtomicBool; 2],
    done: &[AtomicBool; 2],
    reported: &Mutex<usize>,
    on_result: &Mutex<&mut OnPairResult<'_>>,
) {
    let mut reported = reported.lock().unwrap_or_else(|e| e.into_inner());
    while *reported < all.len() {
        let n = *reported;
        let [a, b] = &all[n];
        let gone = |i: usize| done[i].load(Ordering::SeqCst) || killed[i].load(Ordering::SeqCst);
        let complete = (a.is_some() || gone(0)) && (b.is_some() || gone(1));
        if !complete || (a.is_none() && b.is_none()) {
            return;
        }
        let k = [killed[0].load(Ordering::SeqCst), killed[1].load(Ordering::SeqCst)];
        let result = PairResult { code: combine(a.as_ref(), b.as_ref(), k), sides: [a.clone(), b.clone()] };
        let mut f = on_result.lock().unwrap_or_else(|e| e.into_inner());
        (*f)(n, &result);
        *reported += 1;
    }
}

/// `cargo xtask rxe2`: one command on each guest.
pub fn command(
    cwd: &Path,
    argv_a: &[OsString],
    argv_b: &[OsString],
    timeout: Duration,
    opts: &PairOptions,
) -> Result<u8, String> {
    let label = |argv: &[OsString]| {
        argv.iter()
            .map(|a| {
                String::from_utf8_lossy(&shell::quote(std::os::unix::ffi::OsStrExt::as_bytes(a.as_os_str())))
                    .into_owned()
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let steps = [PairStep {
        label: format!("{} ::: {}", label(argv_a), label(argv_b)),
        a: shell::argv_script(cwd, argv_a),
        b: shell::argv_script(cwd, argv_b),
        timeout,
        output: Output::Passthrough,
    }];
    let report = run(&steps, opts, &mut |_, _| {})?;
    if let Some(boot) = report.boot {
        eprintln!(
            "xtask: rxe2: boot {:.1} s; link relayed {} datagrams, dropped {}; guests restarted: A {}, B {}",
            boot.as_secs_f64(),
            report.relayed,
            report.dropped,
            report.restarts[0],
            report.restarts[1]
        );
    }
    report.explain(&side_steps_of(&steps));
    let code = report.exit_code();
    if let Some(r) = report.results.first() {
        let show = |s: &Option<StepResult>| s.as_ref().map_or("-".to_string(), |r| side_code(r).to_string());
        eprintln!(
            "xtask: rxe2: exit A {}, B {} → {} (pair {code})",
            show(&r.sides[0]),
            show(&r.sides[1]),
            r.code
        );
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worse_of_two() {
        assert_eq!(worse(0, 0), 0);
        assert_eq!(worse(0, 3), 3);
        assert_eq!(worse(1, 0), 1);
        assert_eq!(worse(1, 101), 101);
        assert_eq!(worse(124, 137), 124);
        assert_eq!(worse(0, 124), 124);
    }

    #[test]
    fn combine_skips_a_side_killed_on_request() {
        let r = |code| StepResult { code, ..Default::default() };
        assert_eq!(combine(Some(&r(0)), Some(&r(2)), [false, false]), 2);
        assert_eq!(combine(Some(&r(0)), None, [false, true]), 0);
        assert_eq!(combine(Some(&r(0)), None, [false, false]), 125);
        let timed_out = StepResult { code: 124, timed_out: true, ..Default::default() };
        assert_eq!(combine(Some(&timed_out), Some(&r(1)), [false, false]), 124);
    }

    #[test]
    fn parses_faults() {
        assert_eq!(Fault::parse("kill-peer\n"), Ok(Fault::KillPeer));
        assert_eq!(Fault::parse("restart-peer"), Ok(Fault::RestartPeer(None)));
        assert_eq!(Fault::parse("restart-peer 2"), Ok(Fault::RestartPeer(Some(Duration::from_secs(2)))));
        assert_eq!(Fault::parse("restore"), Ok(Fault::Restore));
        assert_eq!(Fault::parse("cut"), Ok(Fault::Cut(None)));
        assert_eq!(Fault::parse("cut 3s"), Ok(Fault::Cut(Some(Duration::from_secs(3)))));
        assert_eq!(Fault::parse("cut 0.5"), Ok(Fault::Cut(Some(Duration::from_millis(500)))));
        assert_eq!(Fault::parse("cut2 4"), Ok(Fault::Cut2(Some(Duration::from_secs(4)))));
        assert_eq!(Fault::parse("restore2"), Ok(Fault::Restore2));
        for bad in [
            "",
            "kill",
            "cut -1",
            "cut 0",
            "cut x",
            "cut 1 2",
            "kill-peer now",
            "restart-peer x",
            "restart-peer 1 2",
        ] {
            assert!(Fault::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn link_cut_expires() {
        let link = LinkState::default();
        assert!(!link.is_cut());
        link.cut(Some(Duration::from_millis(30)));
        assert!(link.is_cut());
        thread::sleep(Duration::from_millis(40));
        assert!(!link.is_cut());
        link.cut(None);
        assert!(link.is_cut());
        link.restore();
        assert!(!link.is_cut());
    }

    /// The forwarder relays both ways and drops while cut.
    #[test]
    fn forwarder_relays_and_cuts() {
        let dir = vm::TempDir::new().unwrap();
        let p = |n: &str| dir.path.join(n);
        let (ga, gb) = (UnixDatagram::bind(p("a")).unwrap(), UnixDatagram::bind(p("b")).unwrap());
        for g in [&ga, &gb] {
            g.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        }
        let link = Arc::new(LinkState::default());
        let fwd = Forwarder::start([&p("ha"), &p("hb")], [&p("a"), &p("b")], Arc::clone(&link)).unwrap();
        let mut buf = [0u8; 64];
        ga.send_to(b"to b", p("ha")).unwrap();
        let n = gb.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"to b");
        gb.send_to(b"to a", p("hb")).unwrap();
        let n = ga.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"to a");
        link.cut(None);
        ga.send_to(b"lost", p("ha")).unwrap();
        gb.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        assert!(gb.recv(&mut buf).is_err());
        link.restore();
        ga.send_to(b"again", p("ha")).unwrap();
        gb.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let n = gb.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"again");
        fwd.stop();
        assert_eq!(link.relayed.load(Ordering::Relaxed), 3);
        assert_eq!(link.dropped.load(Ordering::Relaxed), 1);
    }

    /// Barriers and fault requests through the control folders, with the real helper scripts on the host.
    #[test]
    fn barrier_and_fault_helpers_talk_to_the_control_thread() {
        let dir = vm::TempDir::new().unwrap();
        let mut ctl = Vec::new();
        for side in ["a", "b"] {
            let c = dir.path.join(side);
            fs::create_dir_all(c.join("barrier")).unwrap();
            fs::create_dir_all(c.join("fault")).unwrap();
            ctl.push(c);
        }
        let bin = dir.path.join("bin");
        fs::create_dir_all(&bin).unwrap();
        fs::write(bin.join("barrier"), BARRIER_SCRIPT).unwrap();
        fs::write(bin.join("fault"), FAULT_SCRIPT).unwrap();
        let control = Control {
            ctl: [ctl[0].clone(), ctl[1].clone()],
            shared: Arc::new(Shared::default()),
            link: Arc::new(LinkState::default()),
            link2: Arc::new(LinkState::default()),
        };
        let stop = AtomicBool::new(false);
        let sh = |ctl: &Path, script: &str, args: &[&str]| {
            std::process::Command::new("/bin/sh")
                .arg(bin.join(script))
                .args(args)
                .env("RXE2_CTL", ctl)
                .output()
                .unwrap()
        };
        /// Stops the control thread when the scope's closure ends, also by a failed assertion
        /// (the scope would wait for the control thread for ever).
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        thread::scope(|s| {
            s.spawn(|| control.run(&stop));
            let _stop = StopOnDrop(&stop);
            let a = s.spawn(|| sh(&ctl[0], "barrier", &["x", "10"]));
            thread::sleep(Duration::from_millis(200));
            assert!(!a.is_finished(), "a barrier waits for the other side");
            let b = sh(&ctl[1], "barrier", &["x", "10"]);
            assert!(b.status.success(), "{b:?}");
            assert!(a.join().unwrap().status.success());
            // Long enough to be seen cut when the helper returns on a loaded machine.
            let cut = sh(&ctl[0], "fault", &["cut", "1"]);
            assert!(cut.status.success(), "{cut:?}");
            assert!(control.link.is_cut());
            let bad = sh(&ctl[1], "fault", &["explode"]);
            assert_eq!(bad.status.code(), Some(1));
            assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown fault"));
            let kill = sh(&ctl[1], "fault", &["kill-peer"]);
            assert_eq!(kill.status.code(), Some(1), "no peer QEMU to kill");
            // The other side is gone: a barrier says so instead of waiting.
            control.shared.done[1].store(true, Ordering::SeqCst);
            let alone = sh(&ctl[0], "barrier", &["y", "10"]);
            assert_eq!(alone.status.code(), Some(1));
            assert!(String::from_utf8_lossy(&alone.stderr).contains("gone"));
        });
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while control.link.is_cut() && std::time::Instant::now() < until {
            thread::sleep(Duration::from_millis(50));
        }
        assert!(!control.link.is_cut(), "a timed cut ends");
    }

    /// A restarted guest resumes the step it was killed in without that step's barrier, then runs
    /// the remaining steps with theirs.
    #[test]
    fn restarted_side_resumes_its_step_without_the_barrier() {
        let step = |label: &str| PairStep {
            label: label.into(),
            a: b"echo a\n".to_vec(),
            b: format!("echo {label}\n").into_bytes(),
            timeout: Duration::from_secs(5),
            output: Output::Captured,
        };
        let steps = [step("one"), step("two"), step("three")];
        let first = side_steps(&steps, Side::B);
        assert_eq!(first.len(), 4);
        assert!(String::from_utf8_lossy(&first[1].script).starts_with("rxe2-barrier step-0 "));
        let again = side_steps_from(&steps, Side::B, 1);
        let labels: Vec<&str> = again.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["link setup", "two", "three"]);
        assert_eq!(again[1].script, b"echo two\n", "no barrier: A is past it");
        assert!(String::from_utf8_lossy(&again[2].script).starts_with("rxe2-barrier step-2 "));
    }

    /// The job folder of a restarted guest keeps its control folders only, and the old NIC socket goes.
    #[test]
    fn restart_clears_the_job_but_its_control_folders() {
        let dir = vm::TempDir::new().unwrap();
        let job = dir.path.join("job");
        for sub in ["ctl/barrier", "bin", "steps"] {
            fs::create_dir_all(job.join(sub)).unwrap();
        }
        for f in ["ctl/barrier/x.arrived", "bin/rxe2-fault", "steps/0.sh", "0.rc", "0.out", "ready", "env"] {
            fs::write(job.join(f), b"").unwrap();
        }
        let sock = dir.path.join("b.sock");
        drop(UnixDatagram::bind(&sock).unwrap());
        prepare_restart(&job, &sock).unwrap();
        let mut left: Vec<String> = fs::read_dir(&job)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["bin", "ctl"]);
        assert!(job.join("ctl/barrier/x.arrived").exists() && job.join("bin/rxe2-fault").exists());
        assert!(!sock.exists());
        UnixDatagram::bind(&sock).expect("the path is free for the new QEMU");
        prepare_restart(&job, &dir.path.join("never-bound")).expect("no socket is no error");
    }

    #[test]
    fn setup_script_computes_the_gid() {
        // The GID line of the setup script, run on the host.
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg("printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' $(echo 10.0.2.1 | tr . ' ')")
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "0000:0000:0000:0000:0000:ffff:0a00:0201");
    }
}
