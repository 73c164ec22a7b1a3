//! Running a job — a list of shell steps — where an RDMA device exists: in a QEMU VM with SoftRoCE (rxe),
//! or directly on a host that has a device of its own.
//!
//! # The job folder protocol
//! The host writes a job folder: `run.sh` (`guest/run.sh`), `env` (sourced before each step),
//! `vm.conf` (for the VM's init) and `steps/N.sh` + `steps/N.timeout`. The VM gets it as the read-write
//! 9p share `xtask` at `/run/ibverbs-xtask` (`JOB` in `guest/init.sh`); its init (`guest/init.sh`) touches `ready` once rxe0 is up,
//! then runs `run.sh`, which writes each step's stdout and stderr to `N.out` and `N.err` and its exit
//! status to `N.rc`. The host streams `N.out`/`N.err` as they grow and moves on when `N.rc` appears.
//! A local job runs the same `run.sh` on the host.
//!
//! Whatever happens — success, a boot failure, a timeout, SIGINT/SIGTERM — QEMU (or the local job's
//! process group) is killed and the temporary folder removed before [`run`] returns.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{image, shell, signals};

/// Exit status for a command that ran out of time (as `timeout(1)`).
pub const EXIT_TIMEOUT: u8 = 124;
/// Exit status when the VM failed: it did not boot, or died while a command was running.
pub const EXIT_VM_FAILURE: u8 = 125;

/// The rxe device the VM creates.
pub const RXE_DEVICE: &str = "rxe0";
/// Its GID index of the RoCE v2 IPv4-mapped GID (`::ffff:192.0.2.1`).
pub const RXE_GID_INDEX: u32 = 1;
/// The IPv4 address of the VM's `dummy0`, under rxe0 (for RDMA-CM).
pub const RXE_IP: &str = "192.0.2.1";

/// The soft-iWARP device the VM creates with `--device siw`, over the same `dummy0`.
pub const SIW_DEVICE: &str = "siw0";
/// siw's only GID (index 0), made from `dummy0`'s MAC address.
pub const SIW_GID_INDEX: u32 = 0;

/// The software RDMA device of the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VmDevice {
    /// SoftRoCE (`rdma_rxe`): `rxe0`, RoCE v2, GID index 1.
    #[default]
    Rxe,
    /// Soft-iWARP (`siw`, built by [`image::prepare_siw`]): `siw0`, iWARP over TCP, GID index 0;
    /// queue pairs connect only through RDMA-CM.
    Siw,
}

impl VmDevice {
    /// Its name on the command line (`--device rxe|siw`).
    pub fn parse(name: &str) -> Option<VmDevice> {
        match name {
            "rxe" => Some(VmDevice::Rxe),
            "siw" => Some(VmDevice::Siw),
            _ => None,
        }
    }

    /// The device the VM creates (`rxe0`, `siw0`).
    pub fn name(self) -> &'static str {
        match self {
            VmDevice::Rxe => RXE_DEVICE,
            VmDevice::Siw => SIW_DEVICE,
        }
    }

    /// The GID index the tests use on it.
    pub fn gid_index(self) -> u32 {
        match self {
            VmDevice::Rxe => RXE_GID_INDEX,
            VmDevice::Siw => SIW_GID_INDEX,
        }
    }
}

/// How long the VM may take from QEMU's start to rxe0 being ACTIVE.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long after a step's own timeout (enforced in the VM) the host gives up on the VM.
const HOST_GRACE: Duration = Duration::from_secs(30);
/// How often the host looks at the job folder.
const POLL: Duration = Duration::from_millis(50);
/// Lines of the guest console shown after a failure.
const CONSOLE_TAIL_LINES: usize = 40;

/// The step runner, shared by the VM and local jobs.
const RUN_SCRIPT: &str = include_str!("../guest/run.sh");

/// Where a job runs.
#[derive(Debug, Clone)]
pub enum Backend {
    /// In a QEMU VM with rxe0 (or siw0) over a dummy netdev of this MTU.
    Vm {
        /// MTU of `dummy0` (rxe's active MTU follows it: 1500 → 1024, 9000 → 4096).
        mtu: u32,
        /// The device created over `dummy0`.
        device: VmDevice,
    },
    /// On this host, which has an active RDMA device.
    Local(crate::prereq::HostDevice),
}

/// What happens to a step's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Streamed to our stdout/stderr as it comes, not kept (a command run by `cargo xtask rxe`).
    Passthrough,
    /// A header line, then streamed and kept (device tests, demo commands).
    Live,
    /// Only kept (harness self-tests).
    Captured,
}

/// One step of a job: a POSIX shell script run with `/bin/sh` in the VM (or on the host).
#[derive(Debug, Clone)]
pub struct Step {
    /// What the header line and reports call it.
    pub label: String,
    /// The script (see [`shell::argv_script`] for one that runs an argv).
    pub script: Vec<u8>,
    /// The step is killed after this long and its exit status is then [`EXIT_TIMEOUT`].
    pub timeout: Duration,
    /// What happens to its output.
    pub output: Output,
}

/// A step's outcome.
#[derive(Debug, Clone, Default)]
pub struct StepResult {
    /// Exit status (`128 + n` when killed by signal `n`, 124 after its timeout).
    pub code: i32,
    /// Its stdout (empty for [`Output::Passthrough`]).
    pub stdout: Vec<u8>,
    /// Its stderr (empty for [`Output::Passthrough`]).
    pub stderr: Vec<u8>,
    /// How long it ran, as seen from the host.
    pub elapsed: Duration,
    /// Whether it was killed after its timeout.
    pub timed_out: bool,
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// Every step ran (each may have failed: see the results).
    Completed,
    /// The VM never got to the first step; the reason.
    BootFailed(String),
    /// The VM or the local runner went away in the middle of the job.
    Died(String),
    /// Step N outlived its timeout by more than the grace period; the VM was killed.
    Stuck(usize),
    /// We received this signal; everything was killed.
    Interrupted(i32),
}

/// The outcome of [`run`].
#[derive(Debug)]
pub struct Report {
    /// The results of the steps that finished, in order.
    pub results: Vec<StepResult>,
    /// How it ended.
    pub end: End,
    /// The last lines of the guest console and of QEMU's own messages (empty for a local job).
    pub console_tail: String,
    /// Where a copy of the whole guest console was kept, if there was one.
    pub console_log: Option<PathBuf>,
}

impl Report {
    /// Explains on stderr, with the console's tail, a job that did not complete or a step that timed out
    /// (except [`Output::Captured`] ones: their caller judges them).
    pub fn explain(&self, steps: &[Step]) {
        let what = match &self.end {
            End::Completed => {
                let timed_out =
                    self.results.iter().zip(steps).find(|(r, s)| r.timed_out && s.output != Output::Captured);
                match timed_out {
                    Some((_, step)) => {
                        format!("`{}` timed out after {} s", step.label, step.timeout.as_secs())
                    }
                    None => return,
                }
            }
            End::BootFailed(reason) => format!("the VM did not boot: {reason}"),
            End::Died(reason) => reason.clone(),
            End::Stuck(i) => format!(
                "`{}` timed out after {} s and the VM did not respond: killed it",
                steps[*i].label,
                steps[*i].timeout.as_secs()
            ),
            End::Interrupted(signal) => format!("interrupted by signal {signal}: stopped everything"),
        };
        eprintln!("xtask: {what}");
        if !self.console_tail.is_empty() {
            let log = self.console_log.as_ref().map(|p| format!(" (whole log: {})", p.display()));
            eprintln!("xtask: ---- last lines of the VM console{} ----", log.unwrap_or_default());
            eprint!("{}", self.console_tail);
            eprintln!("xtask: ---- end of the VM console ----");
        }
    }

    /// The exit status of a one-step job such as `cargo xtask rxe`: the step's own, or 124 (timeout),
    /// 125 (VM failure), 128 + N (signal N).
    pub fn single_step_exit_code(&self) -> u8 {
        match &self.end {
            End::Completed => match self.results.first() {
                Some(r) if r.timed_out => EXIT_TIMEOUT,
                Some(r) => u8::try_from(r.code).unwrap_or(EXIT_VM_FAILURE),
                None => 0,
            },
            End::BootFailed(_) | End::Died(_) => EXIT_VM_FAILURE,
            End::Stuck(_) => EXIT_TIMEOUT,
            End::Interrupted(signal) => signals::exit_status(*signal),
        }
    }
}

/// The variables every step sees besides the forwarded host ones: the device to test.
pub fn device_env(backend: &Backend) -> Vec<(String, String)> {
    match backend {
        Backend::Vm { device, .. } => vec![
            ("IBVERBS_TEST_DEVICE".into(), device.name().into()),
            ("IBVERBS_TEST_GID_INDEX".into(), device.gid_index().to_string()),
            ("IBVERBS_TEST_IP".into(), RXE_IP.into()),
        ],
        Backend::Local(dev) => {
            // The user's own settings win on a real host: they know their fabric.
            let mut env = vec![("IBVERBS_TEST_DEVICE".to_string(), dev.name.clone())];
            if let Some(gid) = dev.gid_index {
                env.push(("IBVERBS_TEST_GID_INDEX".into(), gid.to_string()));
            }
            if let Some(ip) = &dev.ipv4 {
                env.push(("IBVERBS_TEST_IP".into(), ip.clone()));
            }
            env.retain(|(name, _)| std::env::var_os(name).is_none());
            env
        }
    }
}

/// What a VM of a two-guest job ([`crate::rxe2`]) needs beyond a plain one.
#[derive(Debug, Default)]
pub struct Extras {
    /// More QEMU arguments (its NIC).
    pub qemu_args: Vec<OsString>,
    /// More variables for every step; they win over [`device_env`]'s and the host's.
    pub env: Vec<(String, String)>,
    /// The job folder to use (created by the caller, who watches it); a temporary one if `None`.
    pub job: Option<PathBuf>,
    /// Where to publish QEMU's process id once it runs (for fault injection).
    pub pid: Option<Arc<AtomicU32>>,
    /// Prefix of every output line and of xtask's messages about this VM (`"[A] "`).
    pub tag: Option<&'static str>,
    /// Number of vCPUs (2 if 0).
    pub smp: u32,
    /// The console log is kept as `last-console<suffix>.log` in the cache folder.
    pub console_suffix: &'static str,
    /// QEMU's `-icount` value (`shift=0`: the guest's clock counts the instructions it runs,
    /// 1 ns each, user and kernel alike, instead of following the host's; one TCG thread, as
    /// icount needs). A benchmark's times then repeat from run to run, whatever the host's load.
    /// `None`: `IBVERBS_XTASK_ICOUNT` if set, else the host's clock.
    pub icount: Option<String>,
}

/// Runs `steps` on `backend`, one after the other, calling `on_result` after each.
pub fn run(
    steps: &[Step],
    backend: &Backend,
    on_result: &mut dyn FnMut(usize, &StepResult),
) -> Result<Report, String> {
    run_with(steps, backend, &Extras::default(), on_result)
}

/// [`run`] with [`Extras`].
pub fn run_with(
    steps: &[Step],
    backend: &Backend,
    extras: &Extras,
    on_result: &mut dyn FnMut(usize, &StepResult),
) -> Result<Report, String> {
    let tmp = TempDir::new()?;
    let job = extras.job.clone().unwrap_or_else(|| tmp.path.join("job"));
    let image = match backend {
        Backend::Vm { device, .. } => {
            let image = image::prepare()?;
            let siw = match device {
                VmDevice::Siw => Some(image::prepare_siw(&image.version)?),
                VmDevice::Rxe => None,
            };
            Some((image, siw))
        }
        Backend::Local(_) => None,
    };
    let vm_conf = match (backend, &image) {
        (Backend::Vm { mtu, device }, Some((image, siw))) => {
            let mut conf = vm_conf(*mtu, *device, siw.as_ref());
            // A kernel that is not the host's: the guest links its modules at /lib/modules/<version>.
            if let Some(modules) = &image.modules {
                let quoted = shell::quote(modules.as_os_str().as_bytes());
                conf.push_str(&format!("MODULES_DIR={}\n", String::from_utf8_lossy(&quoted)));
            }
            Some(conf)
        }
        _ => None,
    };
    write_job(&job, steps, backend, &extras.env, vm_conf.as_deref())?;
    let console = tmp.path.join("console.log");
    let qemu_log = tmp.path.join("qemu.log");
    let tag = extras.tag.unwrap_or("");
    let (mut child, ready_at_start) = match (backend, &image) {
        (Backend::Vm { device, .. }, Some((image, _))) => {
            eprintln!(
                "xtask: {tag}booting the VM (kernel {}, {}, QEMU TCG: no KVM)",
                image.version,
                device.name()
            );
            (spawn_qemu(image, &job, &console, &qemu_log, extras)?, false)
        }
        (Backend::Vm { .. }, None) => unreachable!("a VM backend has its image"),
        (Backend::Local(dev), _) => {
            eprintln!("xtask: running on this host's RDMA device {} (no VM; --vm forces one)", dev.name);
            (spawn_local(&job)?, true)
        }
    };
    if let Some(pid) = &extras.pid {
        pid.store(child.id(), Ordering::SeqCst);
    }
    let guard = KillOnDrop(&mut child);
    let device = match backend {
        Backend::Vm { device, .. } => device.name(),
        Backend::Local(dev) => dev.name.as_str(),
    };
    let (results, end) = follow(steps, &job, guard.0, ready_at_start, extras.tag, device, on_result);
    if let Some(pid) = &extras.pid {
        pid.store(0, Ordering::SeqCst);
    }
    drop(guard);
    let (console_tail, console_log) = match backend {
        Backend::Vm { .. } => console_report(&console, &qemu_log, extras.console_suffix),
        Backend::Local(_) => (String::new(), None),
    };
    // A VM that died under a step: say so by name when its kernel crashed (a kernel bug reached
    // from the step, e.g. rxe's NULL dereference on a second window invalidation).
    let end = match end {
        End::Died(reason) => {
            match kernel_crash(&String::from_utf8_lossy(&fs::read(&console).unwrap_or_default())) {
                Some(crash) => End::Died(format!("the guest kernel crashed ({crash}): {reason}")),
                None => End::Died(reason),
            }
        }
        end => end,
    };
    Ok(Report { results, end, console_tail, console_log })
}

/// The VM init's `vm.conf`: `MTU`, `DEVICE` (`rxe0` or `siw0`), and for siw the module to load
/// (`SIW_MODULE`, a host path the guest sees under its root) and its dependencies (`SIW_DEPENDS`,
/// loaded first with the host's modprobe).
pub fn vm_conf(mtu: u32, device: VmDevice, siw: Option<&image::SiwModule>) -> String {
    let mut conf = format!("MTU={mtu}\nDEVICE={}\n", device.name());
    if let Some(siw) = siw {
        conf.push_str(&format!(
            "SIW_MODULE={}\nSIW_DEPENDS='{}'\n",
            String::from_utf8_lossy(&shell::quote(siw.path.as_os_str().as_bytes())),
            siw.depends.join(" ")
        ));
    }
    conf
}

/// Writes the job folder.
fn write_job(
    job: &Path,
    steps: &[Step],
    backend: &Backend,
    extra_env: &[(String, String)],
    vm_conf: Option<&str>,
) -> Result<(), String> {
    let io = |e: std::io::Error| format!("writing the job folder {}: {e}", job.display());
    fs::create_dir_all(job.join("steps")).map_err(io)?;
    fs::write(job.join("run.sh"), RUN_SCRIPT).map_err(io)?;
    let mut vars = device_env(backend);
    vars.retain(|(n, _)| !extra_env.iter().any(|(x, _)| x == n));
    vars.extend(extra_env.iter().cloned());
    let env = match backend {
        Backend::Vm { .. } => shell::env_file(&shell::vm_environment(std::env::vars_os(), &vars)),
        Backend::Local(_) => shell::env_file(&vars),
    };
    fs::write(job.join("env"), env).map_err(io)?;
    if let Some(conf) = vm_conf {
        fs::write(job.join("vm.conf"), conf).map_err(io)?;
    }
    for (i, step) in steps.iter().enumerate() {
        fs::write(job.join(format!("steps/{i}.sh")), &step.script).map_err(io)?;
        fs::write(job.join(format!("steps/{i}.timeout")), format!("{}\n", step.timeout.as_secs().max(1)))
            .map_err(io)?;
    }
    Ok(())
}

/// Escapes a value for QEMU's `key=value,...` option syntax (a comma is written twice).
pub fn qemu_escape(path: &Path) -> String {
    path.to_string_lossy().replace(',', ",,")
}

/// The kernel command line.
fn kernel_cmdline() -> String {
    let mut cmdline = "console=ttyS0 quiet panic=-1 mitigations=off".to_string();
    // A debugging knob, also used by the harness's boot-failure self-test.
    if let Some(extra) = std::env::var_os("IBVERBS_XTASK_APPEND") {
        cmdline.push(' ');
        cmdline.push_str(&extra.to_string_lossy());
    }
    cmdline
}

/// Starts QEMU on `image`, sharing the host's root read-only and `job` read-write.
fn spawn_qemu(
    image: &image::Image,
    job: &Path,
    console: &Path,
    qemu_log: &Path,
    extras: &Extras,
) -> Result<Child, String> {
    let log = File::create(qemu_log).map_err(|e| format!("creating {}: {e}", qemu_log.display()))?;
    let log2 = log.try_clone().map_err(|e| e.to_string())?;
    // Extras::icount, or IBVERBS_XTASK_ICOUNT=shift=N (2^N ns per instruction).
    let icount = extras
        .icount
        .clone()
        .or_else(|| std::env::var("IBVERBS_XTASK_ICOUNT").ok().filter(|v| !v.is_empty()));
    let tcg = if icount.is_some() { "tcg,thread=single" } else { "tcg,thread=multi" };
    let icount_args = icount.map(|v| vec!["-icount".to_string(), v]).unwrap_or_default();
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-nodefaults", "-no-user-config", "-machine", "pc", "-accel", tcg, "-cpu", "max"])
        .args(&icount_args)
        .arg("-smp")
        .arg(if extras.smp == 0 { "2".to_string() } else { extras.smp.to_string() })
        .args(["-m", "2G", "-display", "none", "-monitor", "none", "-nic", "none", "-no-reboot"])
        .arg("-chardev")
        .arg(format!("file,id=console,path={}", qemu_escape(console)))
        .args(["-serial", "chardev:console"])
        .arg("-kernel")
        .arg(&image.kernel)
        .arg("-initrd")
        .arg(&image.initramfs)
        .arg("-append")
        .arg(kernel_cmdline())
        .arg("-virtfs")
        .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
        .arg("-virtfs")
        .arg(format!("local,path={},mount_tag=xtask,security_model=none,multidevs=remap", qemu_escape(job)))
        .args(&extras.qemu_args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
    signals::own_group_dying_with_us(&mut cmd);
    cmd.spawn().map_err(|e| format!("starting qemu-system-x86_64 (is qemu-system-x86 installed?): {e}"))
}

/// Starts `run.sh` on the host.
fn spawn_local(job: &Path) -> Result<Child, String> {
    let mut cmd = Command::new("/bin/sh");
    cmd.arg(job.join("run.sh")).arg(job).current_dir("/").stdin(Stdio::null());
    signals::own_group_dying_with_us(&mut cmd);
    cmd.spawn().map_err(|e| format!("starting /bin/sh: {e}"))
}

/// Kills a child's process group (QEMU, or a local job with everything it started) and reaps it.
struct KillOnDrop<'a>(&'a mut Child);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        signals::kill_group(self.0.id());
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A growing file read from where the last read stopped.
#[derive(Debug)]
struct Tail {
    path: PathBuf,
    file: Option<File>,
}

impl Tail {
    fn new(path: PathBuf) -> Self {
        Tail { path, file: None }
    }

    /// Copies what was appended since the last call to `sink` and/or `keep`.
    fn pump(&mut self, sink: Option<&mut dyn Write>, keep: Option<&mut Vec<u8>>) {
        if self.file.is_none() {
            self.file = File::open(&self.path).ok();
        }
        let Some(file) = &mut self.file else { return };
        let mut new = Vec::new();
        if file.read_to_end(&mut new).is_err() || new.is_empty() {
            return;
        }
        if let Some(sink) = sink {
            let _ = sink.write_all(&new);
            let _ = sink.flush();
        }
        if let Some(keep) = keep {
            keep.extend_from_slice(&new);
        }
    }
}

/// Serializes the tagged output of concurrent VMs.
static TAGGED_OUTPUT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A writer that puts `tag` before every line it passes on to `inner` (a partial line waits for its end,
/// so the lines of two guests interleave whole).
pub struct Tagged<'a, W: Write> {
    inner: W,
    tag: &'a str,
    pending: &'a mut Vec<u8>,
}

impl<'a, W: Write> Tagged<'a, W> {
    /// Tags lines written to `inner`; `pending` keeps an unfinished line between calls.
    pub fn new(inner: W, tag: &'a str, pending: &'a mut Vec<u8>) -> Self {
        Tagged { inner, tag, pending }
    }
}

impl<W: Write> Write for Tagged<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.pending.extend_from_slice(buf);
        let mut out = Vec::new();
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            out.extend_from_slice(self.tag.as_bytes());
            out.extend(self.pending.drain(..=end));
        }
        if !out.is_empty() {
            // One write of whole lines, under a lock shared by every VM: the lines of two guests (and of
            // stdout and stderr, often the same pipe) never mix.
            let _one_writer = TAGGED_OUTPUT.lock().unwrap_or_else(|e| e.into_inner());
            self.inner.write_all(&out)?;
            self.inner.flush()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The step being followed.
struct Current {
    started: Instant,
    out: Tail,
    err: Tail,
    result: StepResult,
    /// Unfinished tagged lines of stdout and stderr.
    partial: [Vec<u8>; 2],
}

impl Current {
    fn pump(&mut self, output: Output, tag: Option<&str>) {
        let keep = output != Output::Passthrough;
        let stream = output != Output::Captured;
        let [p_out, p_err] = &mut self.partial;
        match tag {
            Some(tag) => {
                let mut out = Tagged::new(std::io::stdout(), tag, p_out);
                let mut err = Tagged::new(std::io::stderr(), tag, p_err);
                self.out.pump(
                    stream.then_some(&mut out as &mut dyn Write),
                    keep.then_some(&mut self.result.stdout),
                );
                self.err.pump(
                    stream.then_some(&mut err as &mut dyn Write),
                    keep.then_some(&mut self.result.stderr),
                );
            }
            None => {
                let (mut stdout, mut stderr) = (std::io::stdout().lock(), std::io::stderr().lock());
                self.out.pump(
                    stream.then_some(&mut stdout as &mut dyn Write),
                    keep.then_some(&mut self.result.stdout),
                );
                self.err.pump(
                    stream.then_some(&mut stderr as &mut dyn Write),
                    keep.then_some(&mut self.result.stderr),
                );
            }
        }
    }

    /// Writes out an unfinished last line (the step ended without a newline).
    fn finish_lines(&mut self, tag: Option<&str>) {
        let Some(tag) = tag else { return };
        for (is_err, partial) in self.partial.iter_mut().enumerate() {
            let is_err = is_err == 1;
            if !partial.is_empty() {
                let text = format!("{tag}{}\n", String::from_utf8_lossy(partial));
                if is_err {
                    eprint!("{text}");
                } else {
                    print!("{text}");
                }
                partial.clear();
            }
        }
    }
}

/// Follows the job folder until the job ends: boot, then each step's output and exit status.
fn follow(
    steps: &[Step],
    job: &Path,
    child: &mut Child,
    mut ready: bool,
    tag: Option<&str>,
    device: &str,
    on_result: &mut dyn FnMut(usize, &StepResult),
) -> (Vec<StepResult>, End) {
    let t = tag.unwrap_or("");
    let start = Instant::now();
    let mut results = Vec::new();
    let mut current: Option<Current> = None;
    loop {
        if let Some(signal) = signals::received() {
            return (results, End::Interrupted(signal));
        }
        // Looked at before the files: whatever the child wrote before exiting is then in them.
        let exited = child.try_wait().ok().flatten();
        if !ready {
            if job.join("ready").exists() {
                ready = true;
                eprintln!("xtask: {t}VM ready ({} up) after {:.1} s", device, start.elapsed().as_secs_f64());
            } else if let Ok(reason) = fs::read_to_string(job.join("setup-failed")) {
                return (results, End::BootFailed(reason.trim().to_string()));
            } else if let Some(status) = exited {
                return (results, End::BootFailed(format!("QEMU exited ({status}) before the VM was ready")));
            } else if start.elapsed() > BOOT_TIMEOUT {
                return (results, End::BootFailed(format!("not ready after {} s", BOOT_TIMEOUT.as_secs())));
            }
        }
        if ready {
            while results.len() < steps.len() {
                let i = results.len();
                let step = &steps[i];
                let cur = current.get_or_insert_with(|| {
                    if step.output == Output::Live {
                        eprintln!("xtask: {t}==== [{}/{}] {}", i + 1, steps.len(), step.label);
                    }
                    Current {
                        started: Instant::now(),
                        out: Tail::new(job.join(format!("{i}.out"))),
                        err: Tail::new(job.join(format!("{i}.err"))),
                        result: StepResult::default(),
                        partial: [Vec::new(), Vec::new()],
                    }
                });
                // The exit status is written after the output is complete: read it first.
                let rc = fs::read_to_string(job.join(format!("{i}.rc"))).ok();
                cur.pump(step.output, tag);
                let Some(rc) = rc else { break };
                let mut cur = current.take().expect("current step");
                cur.finish_lines(tag);
                cur.result.code = rc.trim().parse().unwrap_or(-1);
                cur.result.elapsed = cur.started.elapsed();
                cur.result.timed_out = cur.result.code == i32::from(EXIT_TIMEOUT)
                    && cur.result.elapsed + Duration::from_secs(1) >= step.timeout;
                on_result(i, &cur.result);
                results.push(cur.result);
            }
            if results.len() == steps.len() {
                return (results, End::Completed);
            }
            let cur = current.as_ref().expect("a step is running");
            let i = results.len();
            if cur.started.elapsed() > steps[i].timeout + HOST_GRACE {
                return (results, End::Stuck(i));
            }
            if let Some(status) = exited {
                let step = &steps[i].label;
                return (results, End::Died(format!("the VM stopped ({status}) while `{step}` was running")));
            }
        }
        std::thread::sleep(POLL);
    }
}

/// What a guest console says of a kernel crash, in one line: the first `BUG:`/`Oops`/general
/// protection fault line, the function it hit (`RIP: 0010:...`) and the panic line, without
/// their timestamps; `None` when the console shows no crash.
pub fn kernel_crash(console: &str) -> Option<String> {
    let strip = |l: &str| -> String {
        let l = l.trim_end();
        match l.strip_prefix('[').and_then(|r| r.split_once("] ")) {
            Some((_, rest)) => rest.to_string(),
            None => l.to_string(),
        }
    };
    let lines: Vec<String> = console.lines().map(strip).collect();
    let first = |pred: &dyn Fn(&str) -> bool| lines.iter().find(|l| pred(l)).cloned();
    let bug = first(&|l| {
        l.starts_with("BUG: ") || l.starts_with("Oops") || l.starts_with("general protection fault")
    });
    let rip = first(&|l| l.starts_with("RIP: 0010:")).map(|l| l.trim_start_matches("RIP: 0010:").to_string());
    let panic = first(&|l| l.starts_with("Kernel panic - not syncing"));
    if bug.is_none() && panic.is_none() {
        return None;
    }
    let mut parts: Vec<String> = bug.into_iter().collect();
    parts.extend(rip.map(|r| format!("in {r}")));
    parts.extend(panic);
    Some(parts.join("; "))
}

/// The tails of the console and of QEMU's messages; keeps a copy of the console in the cache folder.
fn console_report(console: &Path, qemu_log: &Path, suffix: &str) -> (String, Option<PathBuf>) {
    let mut tail = String::new();
    let text = fs::read(console).unwrap_or_default();
    tail.push_str(&last_lines(&String::from_utf8_lossy(&text), CONSOLE_TAIL_LINES));
    let qemu = fs::read(qemu_log).unwrap_or_default();
    if !qemu.is_empty() {
        tail.push_str("xtask: ---- QEMU's messages ----\n");
        tail.push_str(&last_lines(&String::from_utf8_lossy(&qemu), 10));
    }
    let kept = image::cache_root().join(format!("last-console{suffix}.log"));
    let kept =
        fs::create_dir_all(image::cache_root()).and_then(|()| fs::write(&kept, &text)).ok().map(|()| kept);
    (tail, kept)
}

/// The last `n` lines of `text`, each ending with a newline.
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].iter().map(|l| format!("{l}\n")).collect()
}

/// Prefix of our temporary folders' names: `ibverbs-xtask.<pid>.<n>`.
const TMP_PREFIX: &str = "ibverbs-xtask.";

/// A temporary folder, removed on drop.
#[derive(Debug)]
pub struct TempDir {
    /// Its path.
    pub path: PathBuf,
}

impl TempDir {
    /// Creates one in `$TMPDIR` (or /tmp), after removing those of xtask processes that no longer exist
    /// (a SIGKILLed run cannot clean up after itself).
    pub fn new() -> Result<Self, String> {
        let base = std::env::temp_dir();
        sweep_stale(&base);
        for n in 0u32.. {
            let path = base.join(format!("{TMP_PREFIX}{}.{n}", std::process::id()));
            match fs::create_dir(&path) {
                Ok(()) => return Ok(TempDir { path }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(format!("creating {}: {e}", path.display())),
            }
        }
        unreachable!()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// Removes `base/ibverbs-xtask.<pid>.*` folders whose process is gone.
fn sweep_stale(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else { return };
    for entry in entries.flatten() {
        let name: OsString = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(TMP_PREFIX)) else { continue };
        let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// Whether any process's command line mentions `needle` (used by the self-tests: no QEMU may survive).
pub fn processes_mentioning(needle: &Path) -> Vec<u32> {
    let needle = needle.as_os_str().as_bytes();
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmdline| image::find_all(&cmdline, needle).next().is_some())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(label: &str, script: &str, output: Output) -> Step {
        Step {
            label: label.into(),
            script: script.as_bytes().to_vec(),
            timeout: Duration::from_secs(20),
            output,
        }
    }

    fn local() -> Backend {
        Backend::Local(crate::prereq::HostDevice { name: "fake0".into(), gid_index: Some(3), ipv4: None })
    }

    #[test]
    fn last_lines_of_text() {
        assert_eq!(last_lines("a\nb\nc\n", 2), "b\nc\n");
        assert_eq!(last_lines("a\nb", 5), "a\nb\n");
        assert_eq!(last_lines("", 3), "");
    }

    #[test]
    fn tagged_lines_are_whole() {
        let (mut sink, mut pending) = (Vec::new(), Vec::new());
        let mut w = Tagged::new(&mut sink, "[A] ", &mut pending);
        w.write_all(b"one\ntw").unwrap();
        w.write_all(b"o\n\nthr").unwrap();
        assert_eq!(sink, b"[A] one\n[A] two\n[A] \n");
        assert_eq!(pending, b"thr");
    }

    #[test]
    fn qemu_options_escape_commas() {
        assert_eq!(qemu_escape(Path::new("/tmp/a,b")), "/tmp/a,,b");
    }

    #[test]
    fn single_step_exit_codes() {
        let report = |end, code, timed_out| Report {
            results: vec![StepResult { code, timed_out, ..Default::default() }],
            end,
            console_tail: String::new(),
            console_log: None,
        };
        assert_eq!(report(End::Completed, 0, false).single_step_exit_code(), 0);
        assert_eq!(report(End::Completed, 101, false).single_step_exit_code(), 101);
        assert_eq!(report(End::Completed, 124, true).single_step_exit_code(), EXIT_TIMEOUT);
        assert_eq!(report(End::BootFailed("x".into()), 0, false).single_step_exit_code(), EXIT_VM_FAILURE);
        assert_eq!(report(End::Died("x".into()), 0, false).single_step_exit_code(), EXIT_VM_FAILURE);
        // The guest's console when rxe 6.1 dereferenced NULL on a second window invalidation
        // (shortened), and a sysrq crash: named in one line.
        let oops = "[   12.5] BUG: kernel NULL pointer dereference, address: 0000000000000004\n\
                    [   12.5] #PF: supervisor write access in kernel mode\n\
                    [   12.5] Oops: 0002 [#1] PREEMPT SMP NOPTI\n\
                    [   12.5] RIP: 0010:__rxe_put+0xe/0x40 [rdma_rxe]\n\
                    [   12.6] Kernel panic - not syncing: Fatal exception in interrupt\n";
        assert_eq!(
            kernel_crash(oops).as_deref(),
            Some(
                "BUG: kernel NULL pointer dereference, address: 0000000000000004; in __rxe_put+0xe/0x40 \
                 [rdma_rxe]; Kernel panic - not syncing: Fatal exception in interrupt"
            )
        );
        assert_eq!(
            kernel_crash(
                "[ 4.8] sysrq: Trigger a crash\n[ 4.8] Kernel panic - not syncing: sysrq triggered crash\n"
            )
            .as_deref(),
            Some("Kernel panic - not syncing: sysrq triggered crash")
        );
        assert_eq!(kernel_crash("[ 1.0] rdma_rxe: loaded\nsome output\n"), None);
        assert_eq!(report(End::Stuck(0), 0, false).single_step_exit_code(), EXIT_TIMEOUT);
        assert_eq!(report(End::Interrupted(15), 0, false).single_step_exit_code(), 143);
    }

    /// The job protocol end to end, with `run.sh` on the host (as for a host with its own device).
    #[test]
    fn local_job_runs_steps_in_order_with_separate_streams() {
        let steps = [
            step("both", "echo out; echo err >&2; exit 3", Output::Captured),
            step("env", "echo \"$IBVERBS_TEST_DEVICE\"", Output::Captured),
            step("missing", "exec xtask-no-such-command", Output::Captured),
            Step { timeout: Duration::from_secs(1), ..step("slow", "sleep 30; echo late", Output::Captured) },
        ];
        let mut seen = Vec::new();
        let report = run(&steps, &local(), &mut |i, r| seen.push((i, r.code))).unwrap();
        assert_eq!(report.end, End::Completed);
        assert_eq!(seen, [(0, 3), (1, 0), (2, 127), (3, 124)]);
        let r = &report.results;
        assert_eq!((r[0].stdout.as_slice(), r[0].stderr.as_slice()), (&b"out\n"[..], &b"err\n"[..]));
        let device = std::env::var("IBVERBS_TEST_DEVICE").unwrap_or_else(|_| "fake0".into());
        assert_eq!(String::from_utf8_lossy(&r[1].stdout), format!("{device}\n"));
        assert!(r[3].timed_out && r[3].stdout.is_empty());
        assert!(r[3].elapsed < Duration::from_secs(10), "{:?}", r[3].elapsed);
    }
}
