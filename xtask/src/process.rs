//! Running a program with a time limit: its output shown and/or kept, the whole process group killed
//! when the limit passes or a termination signal comes in (every wait of the harness is bounded).

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::signals;

/// How a bounded run ended.
#[derive(Debug, Default)]
pub struct Finished {
    /// The exit status; `None` if it was killed (time limit) or died of a signal.
    pub code: Option<i32>,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
    /// Whether it was killed because the limit passed.
    pub timed_out: bool,
    /// How long it ran.
    pub elapsed: Duration,
}

impl Finished {
    /// Whether it exited with status 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// `exit status N`, `killed after S s (time limit)` or `killed by a signal`, for messages.
    pub fn describe(&self) -> String {
        match self.code {
            Some(code) => format!("exit status {code}"),
            None if self.timed_out => {
                format!("killed after {:.0} s (time limit)", self.elapsed.as_secs_f64())
            }
            None => "killed by a signal".into(),
        }
    }
}

/// Runs `cmd` (stdin `/dev/null`) in a process group of its own; kills the group after `limit` or when
/// we receive SIGINT/SIGTERM/SIGHUP (then returns an error). With `show`, its stdout and stderr are
/// copied to ours as they come; they are kept either way, up to [`PIPE_GRACE`] after its end.
pub fn run(cmd: &mut Command, limit: Duration, show: bool) -> Result<Finished, String> {
    run_with_grace(cmd, limit, show, PIPE_GRACE)
}

/// How long [`run`] (and the harness's other runs of a child) waits, once the program exited,
/// for the ends of its output: a process it left running (in its group, or one that left the
/// group) may keep the pipes open for ever.
pub const PIPE_GRACE: Duration = Duration::from_secs(10);

/// [`run`], waiting up to `grace` after the program's end for the ends of its output; what came
/// until then is kept, with a line saying the rest was cut.
fn run_with_grace(
    cmd: &mut Command,
    limit: Duration,
    show: bool,
    grace: Duration,
) -> Result<Finished, String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    signals::own_group_dying_with_us(cmd);
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("running {program}: {e}"))?;
    let pipes = Pipes::start(&mut child, show);
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(status);
        }
        if signals::received().is_some() || start.elapsed() > limit {
            timed_out = signals::received().is_none();
            signals::kill_group(child.id());
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // After a normal exit the group is not killed (its id may already name another process's
    // group): what the program left running may hold the pipes, which `finish` bounds.
    let (stdout, stderr) = pipes.finish(grace, &program);
    if let Some(signal) = signals::received() {
        return Err(format!("interrupted by signal {signal} while running {program}"));
    }
    Ok(Finished { code: status.and_then(|s| s.code()), stdout, stderr, timed_out, elapsed: start.elapsed() })
}

/// The readers of a child's stdout and stderr, copying them to ours as they come (with `show`)
/// and keeping them where [`finish`](Self::finish) can take them even if a pipe never ends.
pub struct Pipes {
    out: Arc<Mutex<Vec<u8>>>,
    err: Arc<Mutex<Vec<u8>>>,
    /// One message per pipe that reached its end.
    ended: mpsc::Receiver<()>,
}

impl Pipes {
    /// Starts reading `child`'s piped stdout and stderr (a pipe it does not have counts as ended).
    pub fn start(child: &mut Child, show: bool) -> Pipes {
        let (ended, ended_rx) = mpsc::channel::<()>();
        let pump = |pipe: Option<Box<dyn Read + Send>>, to_stderr: bool| {
            let kept = Arc::new(Mutex::new(Vec::new()));
            let (keep, ended) = (kept.clone(), ended.clone());
            std::thread::spawn(move || {
                if let Some(mut pipe) = pipe {
                    let mut buf = [0u8; 8192];
                    loop {
                        match pipe.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if show {
                                    let _ = if to_stderr {
                                        std::io::stderr().lock().write_all(&buf[..n])
                                    } else {
                                        std::io::stdout().lock().write_all(&buf[..n])
                                    };
                                }
                                lock(&keep).extend_from_slice(&buf[..n]);
                            }
                        }
                    }
                }
                let _ = ended.send(());
            });
            kept
        };
        let out = pump(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>), false);
        let err = pump(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>), true);
        Pipes { out, err, ended: ended_rx }
    }

    /// Once `program` ended: waits up to `grace` for both pipes' ends and returns (stdout,
    /// stderr). A process it left running (or a grandchild that left its group) may hold them
    /// open: then what came is returned, stderr ending with a line saying the rest was cut.
    pub fn finish(self, grace: Duration, program: &str) -> (String, String) {
        let deadline = Instant::now() + grace;
        let mut open = 2;
        while open > 0 {
            match self.ended.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(()) => open -= 1,
                Err(_) => break,
            }
        }
        let take =
            |kept: &Mutex<Vec<u8>>| String::from_utf8_lossy(&std::mem::take(&mut *lock(kept))).into_owned();
        let (stdout, mut stderr) = (take(&self.out), take(&self.err));
        if open > 0 {
            stderr.push_str(&format!(
                "\nxtask: output cut {:.1} s after {program} ended: a process it left running holds its pipes\n",
                grace.as_secs_f64()
            ));
        }
        (stdout, stderr)
    }
}

/// The lock of a pipe's output (a reader that panicked left whole chunks).
fn lock(kept: &Mutex<Vec<u8>>) -> std::sync::MutexGuard<'_, Vec<u8>> {
    kept.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_output_and_exit_status() {
        let r = run(
            Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
            Duration::from_secs(20),
            false,
        )
        .unwrap();
        assert_eq!((r.code, r.stdout.as_str(), r.stderr.as_str()), (Some(3), "out\n", "err\n"));
        assert!(!r.timed_out && !r.success());
        assert_eq!(r.describe(), "exit status 3");
    }

    #[test]
    fn kills_the_whole_group_at_the_limit() {
        // The background `sleep` holds the pipes open: the run ends only if the group is killed.
        let r = run(
            Command::new("sh").args(["-c", "echo started; sleep 1000 & sleep 1000"]),
            Duration::from_millis(500),
            false,
        )
        .unwrap();
        assert!(r.timed_out && r.code.is_none(), "{r:?}");
        assert_eq!(r.stdout, "started\n");
        assert!(r.elapsed < Duration::from_secs(10), "{:?}", r.elapsed);
        assert!(r.describe().contains("time limit"));
    }

    #[test]
    fn a_process_left_running_does_not_hold_the_run_after_the_program_ends() {
        // The program exits at once; the `sleep` it leaves in its group holds both pipes for 5 s.
        let r = run_with_grace(
            Command::new("sh").args(["-c", "echo out; echo err >&2; sleep 5 & exit 0"]),
            Duration::from_secs(20),
            false,
            Duration::from_millis(300),
        )
        .unwrap();
        assert!(r.elapsed < Duration::from_secs(4), "{:?}", r.elapsed);
        assert_eq!((r.code, r.stdout.as_str()), (Some(0), "out\n"));
        assert!(r.stderr.starts_with("err\n") && r.stderr.contains("output cut"), "{:?}", r.stderr);
    }

    #[test]
    fn a_missing_program_is_an_error() {
        assert!(run(&mut Command::new("xtask-no-such-program"), Duration::from_secs(5), false).is_err());
    }
}
