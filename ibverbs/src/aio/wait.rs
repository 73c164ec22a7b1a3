//! [`WaitPolicy`]: what a waiting future does when its completion queue is empty, and the
//! bounded spin window of the adaptive wait (`SpinWindow`, pure logic).

use std::time::{Duration, Instant};

/// What a waiting future does when it finds its completion queue empty (set with
/// [`Driver::set_wait_policy`](super::Driver::set_wait_policy) or
/// [`AsyncCompletionQueue::set_wait_policy`](super::AsyncCompletionQueue::set_wait_policy)).
///
/// | policy | when the CQ is empty | latency | CPU while idle |
/// |---|---|---|---|
/// | [`Events`](Self::Events) | arm the CQ (`ibv_req_notify_cq()`), poll again, sleep in the reactor | a wake-up per idle gap (channel event, reactor, task switch) | none |
/// | [`BusyPoll`](Self::BusyPoll) | wake its own task and yield to the executor | lowest | a core, for as long as anything waits |
/// | [`Adaptive`](Self::Adaptive) | busy poll for at most `spin` (less after gaps that outlast it twice over), then as `Events`; only the oldest waiting operation of each work queue spins | as `BusyPoll` when completions come within `spin` | at most `spin` per idle gap, then none |
///
/// The adaptive wait is the one sockets call busy polling (`SO_BUSY_POLL`): a completion that
/// comes soon after the CQ ran dry (the peer's answer to a request in flight) is taken without a
/// sleep and a wake-up; a CQ that stays empty costs at most `spin` of CPU before the task sleeps
/// as on the event path. The window is the driver's (or the stream's), not each task's: it opens
/// when a poll first finds the CQ empty after taking completions, and closes at the first
/// completion or after `spin`; polls in between spin, polls after it arm the CQ and sleep, until
/// a completion comes and a later empty poll opens a new window. So the CPU spent spinning is
/// bounded by `spin` per idle gap of the CQ, however many tasks wait.
/// When idle gaps outlast `spin` twice over (completions come from a peer far slower than the
/// spin), each such gap in a row halves the next window, down to `spin / 16`; a completion that
/// comes while the window is open, or within `spin` of its start, gives the next window the whole
/// `spin` again (finding out costs one clock read per gap the tasks slept through).
/// (The clock is read at every 8th empty poll only, a clock read costing as much as a system call
/// on some machines: the window starts at the 8th empty poll and ends at the first reading at
/// least `spin` later, so it spins `spin` plus at most 15 polls.)
/// Arming is followed by a poll before the sleep (the classic race: a completion that came
/// between the last poll and the arming raises no event), on every policy that sleeps.
///
/// Of a [`Driver`]'s waiting operations only the oldest of each work queue (a queue pair's send
/// or receive queue) spins under the adaptive wait: a queue completes its requests in the order
/// they were posted, so the others' completions cannot come first. They sleep as on the event
/// path (the CQ armed: a kept-aside or forgotten front future strands nobody), and each is woken
/// when it comes to the front.
///
/// [`Default`] is [`WaitPolicy::ADAPTIVE`] (`Adaptive` with [`DEFAULT_SPIN`](Self::DEFAULT_SPIN)):
/// see `docs/benchmarks.md` for what it costs and gains against the others.
///
/// [`Driver`]: super::Driver
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitPolicy {
    /// Arm the CQ and sleep in the reactor until the channel fires: no CPU while idle, a
    /// wake-up per idle gap.
    Events,
    /// Never arm nor sleep: a waiting task that finds the CQ empty wakes itself and yields to its
    /// executor at once. Lowest latency; keeps a core busy for as long as anything waits (without
    /// bound: use it only on a core set aside for it).
    BusyPoll,
    /// Busy poll for at most `spin` after the CQ ran dry, then arm it and sleep as
    /// [`Events`](Self::Events). `spin` is clamped to [`MAX_SPIN`](Self::MAX_SPIN); zero is
    /// `Events`.
    Adaptive {
        /// How long the CQ is busy polled after it ran dry before the waiting tasks sleep.
        spin: Duration,
    },
}

impl WaitPolicy {
    /// The spin of [`WaitPolicy::ADAPTIVE`]: about the round trip of a small message on a
    /// software device (rxe) in the project's VM, well above it on hardware, where a round trip
    /// is a few microseconds.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);

    /// The longest spin [`Adaptive`](Self::Adaptive) keeps: longer ones are clamped to it.
    pub const MAX_SPIN: Duration = Duration::from_millis(10);

    /// `Adaptive` with [`DEFAULT_SPIN`](Self::DEFAULT_SPIN), the default.
    pub const ADAPTIVE: WaitPolicy = WaitPolicy::Adaptive { spin: Self::DEFAULT_SPIN };

    /// `Adaptive` with `spin` (clamped to [`MAX_SPIN`](Self::MAX_SPIN)).
    pub fn adaptive(spin: Duration) -> WaitPolicy {
        WaitPolicy::Adaptive { spin: spin.min(Self::MAX_SPIN) }
    }
}

impl Default for WaitPolicy {
    fn default() -> WaitPolicy {
        WaitPolicy::ADAPTIVE
    }
}

/// What a poll that found the CQ empty does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Empty {
    /// Wake its own task and return `Pending` (busy poll).
    Spin,
    /// Arm the CQ (if it is not), poll again, and sleep in the reactor.
    Sleep,
}

/// The adaptive window reads the clock at every this many empty polls only (the first read
/// starts the `spin`): a clock read can cost a system call (a VM whose clock source is the HPET
/// has no vDSO fast path), more than the poll it would time.
pub(crate) const CLOCK_EVERY: u32 = 8;

/// The most halvings of the adaptive window (to 1/16 of `spin`) after idle gaps that outlasted
/// twice its `spin`.
pub(crate) const MAX_BACKOFF: u32 = 4;

/// The wait policy with the adaptive wait's window (pure logic: the caller gives the time).
///
/// The window spins `CLOCK_EVERY` empty polls before it first reads the clock, then until its
/// length has passed since that read (checked every `CLOCK_EVERY` polls): at most `spin` plus
/// `2 * CLOCK_EVERY - 1` polls of spinning per idle gap. Its length is `spin` halved once per
/// idle gap in a row that outlasted twice the `spin` (at most [`MAX_BACKOFF`] times): when the
/// completions come much later than the spin (a peer across a slow link), spinning would only
/// burn the CPU the sleep then saves. A completion that comes while the window is open, or after
/// it closed but within `spin` of its start (a whole `spin` would have caught it), gives the next
/// window the whole `spin` again; a gap between one and two `spin`s changes nothing (a busy host's
/// hiccup can stretch a gap that far). Finding out costs one clock read per gap the task slept
/// through.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpinWindow {
    policy: WaitPolicy,
    /// When the current idle gap's window first read the clock (`None`: not yet, or the last
    /// poll found completions).
    since: Option<Instant>,
    /// Empty polls in the current idle gap (`u32::MAX` once its window closed).
    polls: u32,
    /// Idle gaps in a row that outlasted twice the `spin` (at most [`MAX_BACKOFF`]).
    misses: u32,
}

impl SpinWindow {
    pub(crate) fn new(policy: WaitPolicy) -> SpinWindow {
        SpinWindow { policy: Self::clamped(policy), since: None, polls: 0, misses: 0 }
    }

    fn clamped(policy: WaitPolicy) -> WaitPolicy {
        match policy {
            WaitPolicy::Adaptive { spin } if spin.is_zero() => WaitPolicy::Events,
            WaitPolicy::Adaptive { spin } => WaitPolicy::adaptive(spin),
            p => p,
        }
    }

    pub(crate) fn policy(&self) -> WaitPolicy {
        self.policy
    }

    /// Sets the policy; a new window opens at the next empty poll.
    pub(crate) fn set(&mut self, policy: WaitPolicy) {
        *self = SpinWindow::new(policy);
    }

    /// A poll found completions: the idle gap (if any) is over. `now` gives the time; it is
    /// called only under the adaptive policy, and only when the gap's window had closed (once
    /// per gap the task slept through).
    pub(crate) fn found(&mut self, now: impl FnOnce() -> Instant) {
        if let WaitPolicy::Adaptive { spin } = self.policy {
            if self.polls == u32::MAX {
                // Slept through the gap: would the whole spin have caught this completion?
                if let Some(since) = self.since {
                    let gap = now().saturating_duration_since(since);
                    if gap <= spin {
                        self.misses = 0;
                    } else if gap > 2 * spin {
                        // Well past the spin: not a gap that a hiccup of the host made longer.
                        self.misses = (self.misses + 1).min(MAX_BACKOFF);
                    }
                }
            } else if self.polls > 0 {
                // Caught while spinning.
                self.misses = 0;
            }
        }
        self.since = None;
        self.polls = 0;
    }

    /// The current window's length: `spin` halved once per miss.
    fn window(&self, spin: Duration) -> Duration {
        spin / (1 << self.misses)
    }

    /// A poll found the CQ empty for an operation that cannot complete next (an older one of
    /// its queue still waits): it spins only under `BusyPoll`; under the adaptive wait it
    /// sleeps, leaving the window to the operations at the front of their queues.
    pub(crate) fn empty_behind(&self) -> Empty {
        match self.policy {
            WaitPolicy::BusyPoll => Empty::Spin,
            _ => Empty::Sleep,
        }
    }

    /// A poll found the CQ empty; `now` gives the time (called only for the adaptive policy,
    /// at most once per `CLOCK_EVERY` empty polls).
    pub(crate) fn empty(&mut self, now: impl FnOnce() -> Instant) -> Empty {
        match self.policy {
            WaitPolicy::Events => Empty::Sleep,
            WaitPolicy::BusyPoll => Empty::Spin,
            WaitPolicy::Adaptive { spin } => {
                // Once closed, the window stays closed (the count stops growing) until a
                // completion reopens it.
                if self.polls == u32::MAX {
                    return Empty::Sleep;
                }
                self.polls += 1;
                if self.polls % CLOCK_EVERY != 0 {
                    return Empty::Spin;
                }
                let now = now();
                let since = *self.since.get_or_insert(now);
                // `since` never lies ahead of `now` (Instant is monotonic); saturating anyway.
                if now.saturating_duration_since(since) < self.window(spin) {
                    Empty::Spin
                } else {
                    self.polls = u32::MAX;
                    Empty::Sleep
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_sleep_and_busy_poll_spins_whatever_the_time() {
        let t0 = Instant::now();
        let mut ev = SpinWindow::new(WaitPolicy::Events);
        let mut busy = SpinWindow::new(WaitPolicy::BusyPoll);
        for i in 0..5 {
            let t = t0 + Duration::from_secs(i);
            assert_eq!(ev.empty(|| t), Empty::Sleep);
            assert_eq!(busy.empty(|| t), Empty::Spin);
        }
    }

    /// Feeds `w` empty polls at the times `t` gives until it says `Sleep`; returns how many
    /// polls spun, and panics if the clock was read other than at every `CLOCK_EVERY`th poll.
    fn spins_until_sleep(w: &mut SpinWindow, mut t: impl FnMut(u32) -> Instant) -> u32 {
        for i in 1..10_000 {
            let mut read = false;
            let e = w.empty(|| {
                read = true;
                t(i)
            });
            assert_eq!(read, i % CLOCK_EVERY == 0, "poll {i}: clock read {read}");
            if e == Empty::Sleep {
                return i - 1;
            }
        }
        panic!("the window never closed");
    }

    #[test]
    fn adaptive_spins_within_its_window_then_sleeps_until_a_completion_reopens_it() {
        let t0 = Instant::now();
        let e = CLOCK_EVERY;
        let mut w = SpinWindow::new(WaitPolicy::adaptive(Duration::from_micros(100)));
        // One microsecond per poll: the clock starts at poll e, the window closes at the first
        // check 100 us later (poll e + 100 rounded up to a multiple of e).
        let spun = spins_until_sleep(&mut w, |i| t0 + Duration::from_micros(u64::from(i)));
        assert_eq!(spun, (e + 100).div_ceil(e) * e - 1);
        // Once closed it stays closed, however many polls come and whenever, without the clock.
        for _ in 0..3 * e {
            assert_eq!(w.empty(|| panic!("no clock once closed")), Empty::Sleep);
        }
        // A completion ends the gap: the next empty poll opens a new window. It came within
        // the whole spin of the window's start (poll e), so the next window is whole too.
        w.found(|| t0 + Duration::from_micros(u64::from(e) + 100));
        let t1 = t0 + Duration::from_secs(5);
        let spun = spins_until_sleep(&mut w, |i| t1 + Duration::from_micros(10 * u64::from(i)));
        // 10 us per poll: 100 us after poll e is poll e + 10, first checked at the next
        // multiple of e.
        assert_eq!(spun, (e + 10).div_ceil(e) * e - 1);
        // Polls that find the CQ empty long after each other (the task was not scheduled) end
        // the window at the second clock read.
        w.found(|| t1 + Duration::from_micros(10 * u64::from(e) + 50));
        let spun = spins_until_sleep(&mut w, |i| t1 + Duration::from_secs(u64::from(i)));
        assert_eq!(spun, 2 * e - 1);
    }

    /// Polls of `w` at one microsecond each from `base` until it says `Sleep`; returns how many
    /// spun (as [`spins_until_sleep`]).
    fn gap(w: &mut SpinWindow, base: Instant) -> u32 {
        spins_until_sleep(w, |i| base + Duration::from_micros(u64::from(i)))
    }

    /// The polls a window of `us` microseconds spins at one microsecond per poll.
    fn spun_for(us: u32) -> u32 {
        (CLOCK_EVERY + us).div_ceil(CLOCK_EVERY) * CLOCK_EVERY - 1
    }

    #[test]
    fn adaptive_window_halves_after_gaps_it_cannot_catch_and_comes_back_whole() {
        let e = CLOCK_EVERY;
        let spin = Duration::from_micros(160);
        let mut w = SpinWindow::new(WaitPolicy::adaptive(spin));
        let mut base = Instant::now();
        // Completions a second after each window closed: 160, 80, 40, 20, 10 us, then 10 us
        // again (at most MAX_BACKOFF halvings).
        for us in [160, 80, 40, 20, 10, 10] {
            assert_eq!(gap(&mut w, base), spun_for(us), "a window of {us} us");
            w.found(|| base + Duration::from_secs(1));
            base += Duration::from_secs(2);
        }
        // A completion while the window is open (no clock read for it): the next one is whole.
        for _ in 0..3 {
            assert_eq!(w.empty(|| base), Empty::Spin);
        }
        w.found(|| panic!("no clock for a completion caught while spinning"));
        assert_eq!(gap(&mut w, base), spun_for(160));
        // Halved once, the window closes after 80 us; a completion 120 us after its start is
        // one the whole spin would have caught: the next window is whole again.
        w.found(|| base + Duration::from_secs(1));
        base += Duration::from_secs(2);
        assert_eq!(gap(&mut w, base), spun_for(80));
        w.found(|| base + Duration::from_micros(u64::from(e) + 120));
        base += Duration::from_secs(2);
        assert_eq!(gap(&mut w, base), spun_for(160));
        // A gap between one and two spins changes nothing: still whole after it.
        w.found(|| base + Duration::from_micros(u64::from(e) + 250));
        base += Duration::from_secs(2);
        assert_eq!(gap(&mut w, base), spun_for(160));
        // And after a halving, such a gap keeps the halved window.
        w.found(|| base + Duration::from_secs(1));
        base += Duration::from_secs(2);
        assert_eq!(gap(&mut w, base), spun_for(80));
        w.found(|| base + Duration::from_micros(u64::from(e) + 300));
        base += Duration::from_secs(2);
        assert_eq!(gap(&mut w, base), spun_for(80));
        // A second miss in a row halves it again; completions back to back (no empty poll
        // between them) change nothing.
        w.found(|| base + Duration::from_secs(1));
        w.found(|| panic!("no clock without an idle gap"));
        base += Duration::from_secs(2);
        assert_eq!(gap(&mut w, base), spun_for(40));
    }

    #[test]
    fn events_and_busy_poll_never_read_the_clock_at_a_completion() {
        for policy in [WaitPolicy::Events, WaitPolicy::BusyPoll] {
            let mut w = SpinWindow::new(policy);
            let _ = w.empty(|| panic!("no clock"));
            w.found(|| panic!("no clock"));
        }
    }

    #[test]
    fn adaptive_spin_is_clamped_and_zero_is_events() {
        assert_eq!(
            WaitPolicy::adaptive(Duration::from_secs(3600)),
            WaitPolicy::Adaptive { spin: WaitPolicy::MAX_SPIN }
        );
        let w = SpinWindow::new(WaitPolicy::Adaptive { spin: Duration::MAX });
        assert_eq!(w.policy(), WaitPolicy::Adaptive { spin: WaitPolicy::MAX_SPIN });
        let t0 = Instant::now();
        let mut w = SpinWindow::new(WaitPolicy::Adaptive { spin: Duration::MAX });
        // A millisecond per poll: the clamped 10 ms end after poll CLOCK_EVERY + 10.
        let spun = spins_until_sleep(&mut w, |i| t0 + Duration::from_millis(u64::from(i)));
        assert_eq!(spun, (CLOCK_EVERY + 10).div_ceil(CLOCK_EVERY) * CLOCK_EVERY - 1);
        let mut z = SpinWindow::new(WaitPolicy::Adaptive { spin: Duration::ZERO });
        assert_eq!(z.policy(), WaitPolicy::Events);
        assert_eq!(z.empty(|| t0), Empty::Sleep);
    }

    #[test]
    fn setting_a_policy_starts_a_new_window() {
        let t0 = Instant::now();
        let mut w = SpinWindow::new(WaitPolicy::adaptive(Duration::from_micros(10)));
        let spun = spins_until_sleep(&mut w, |i| t0 + Duration::from_secs(u64::from(i)));
        assert_eq!(spun, 2 * CLOCK_EVERY - 1);
        w.set(WaitPolicy::adaptive(Duration::from_micros(10)));
        assert_eq!(w.empty(|| panic!("not at the first poll")), Empty::Spin);
    }

    #[test]
    fn the_default_is_adaptive_with_the_default_spin() {
        assert_eq!(WaitPolicy::default(), WaitPolicy::Adaptive { spin: WaitPolicy::DEFAULT_SPIN });
    }
}
