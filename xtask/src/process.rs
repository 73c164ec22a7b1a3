//! Running a program with a time limit: its output shown and/or kept, the whole process group killed
//! when the limit passes or a termination signal comes in (every wait of the harness is bounded).

use std::io::{Read, Write};
use std::process::{Command, Stdio};
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
/// copied to ours as they come; they are kept either way.
pub fn run(cmd: &mut Command, limit: Duration, show: bool) -> Result<Finished, String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    signals::own_group_dying_with_us(cmd);
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("running {program}: {e}"))?;
    let pump = |pipe: Option<Box<dyn Read + Send>>, to_stderr: bool| {
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            let Some(mut pipe) = pipe else { return kept };
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
                        kept.extend_from_slice(&buf[..n]);
                    }
                }
            }
            kept
        })
    };
    let out = pump(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>), false);
    let err = pump(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>), true);
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
    // A grandchild that left the group could keep the pipes open: the group was killed, so this ends.
    let stdout = String::from_utf8_lossy(&out.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err.join().unwrap_or_default()).into_owned();
    if let Some(signal) = signals::received() {
        return Err(format!("interrupted by signal {signal} while running {program}"));
    }
    Ok(Finished { code: status.and_then(|s| s.code()), stdout, stderr, timed_out, elapsed: start.elapsed() })
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
    fn a_missing_program_is_an_error() {
        assert!(run(&mut Command::new("xtask-no-such-program"), Duration::from_secs(5), false).is_err());
    }
}
