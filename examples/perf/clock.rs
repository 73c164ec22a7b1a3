//! Timestamps for the hot loops.
//!
//! Like perftest's `get_cycles()`, the loops read the CPU's time-stamp counter: one instruction,
//! no system call. `Instant::now()` would do as well on hardware, but in a VM whose clocksource is
//! not the TSC (QEMU TCG boots with `hpet`) every `clock_gettime()` is a system call plus an
//! emulated device read, which would be charged to the measured loop. The counter is calibrated
//! against the system clock: roughly at start (for deadlines) and precisely over the whole run
//! (for reports).

use std::time::{Duration, Instant};

/// The current time-stamp counter value (nanoseconds since the first call on targets without one).
#[inline(always)]
pub fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC has no preconditions; every x86_64 CPU has it.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        use std::sync::OnceLock;
        static BASE: OnceLock<Instant> = OnceLock::new();
        BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// Converts counter ticks to time.
#[derive(Debug, Clone)]
pub struct Clock {
    t0: Instant,
    c0: u64,
    ticks_per_sec: f64,
}

impl Clock {
    /// Calibrates the counter against the system clock over 20 ms.
    pub fn new() -> Clock {
        let t0 = Instant::now();
        let c0 = ticks();
        std::thread::sleep(Duration::from_millis(20));
        let mut clock = Clock { t0, c0, ticks_per_sec: 1e9 };
        clock.recalibrate();
        clock
    }

    /// Recomputes the rate over everything since [`Clock::new`]: the longer the baseline, the
    /// more precise (call it before computing a report).
    pub fn recalibrate(&mut self) {
        let (c1, t1) = (ticks(), Instant::now());
        let secs = t1.duration_since(self.t0).as_secs_f64();
        let dt = c1.wrapping_sub(self.c0) as f64;
        if secs > 0.0 && dt > 0.0 {
            self.ticks_per_sec = dt / secs;
        }
    }

    /// Ticks per second.
    pub fn ticks_per_sec(&self) -> f64 {
        self.ticks_per_sec
    }

    /// Ticks in `d`.
    pub fn ticks_in(&self, d: Duration) -> u64 {
        (d.as_secs_f64() * self.ticks_per_sec) as u64
    }

    /// Seconds in `t` ticks.
    pub fn secs(&self, t: u64) -> f64 {
        t as f64 / self.ticks_per_sec
    }
}
