//! SIGINT/SIGTERM/SIGHUP: noted in a flag that the wait loops poll, so they can kill what they started
//! (QEMU, a local job), remove their temporary folder and exit with 128 + the signal's number.

use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

/// The last termination signal received, 0 if none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    RECEIVED.store(signal, Ordering::SeqCst);
}

/// Installs the handlers. From then on SIGINT, SIGTERM and SIGHUP no longer end the process: the
/// loops that wait for children check [`received`].
pub fn install() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        let handler: extern "C" fn(libc::c_int) = on_signal;
        // SAFETY: `on_signal` only stores into an atomic, which is async-signal-safe; the handler stays
        // valid for the life of the process. `signal` on glibc installs it with SA_RESTART semantics.
        unsafe {
            libc::signal(signal, handler as libc::sighandler_t);
        }
    }
}

/// The termination signal received since [`install`], if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        signal => Some(signal),
    }
}

/// The exit status of a process that stopped because of `signal` (shell convention).
pub fn exit_status(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(255)
}

/// Sends SIGKILL to the process group `pgid` (a child started with `process_group(0)`).
pub fn kill_group(pgid: u32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else { return };
    // SAFETY: kill(2) has no memory-safety preconditions; a negative pid addresses the group we created.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// Sends `signal` to process `pid`.
pub fn send(pid: u32, signal: i32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return };
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Makes `cmd`'s process a process group of its own (so a terminal's Ctrl-C reaches only us, and we can
/// kill all of it) that receives SIGKILL when this process dies, even by SIGKILL.
pub fn own_group_dying_with_us(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    // SAFETY: the closure runs in the child between fork and exec; prctl(2) is async-signal-safe and
    // touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
