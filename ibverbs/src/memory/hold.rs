//! Queue pairs whose destruction waits for the type 2 windows bound through them.
//!
//! Linux's rxe takes a reference on the queue pair for every type 2 window bound through it
//! (`rxe_do_bind_mw`) and gives it back only when the window is invalidated or deallocated.
//! `ibv_destroy_qp` of a queue pair that such a window still references waits for that reference
//! in the kernel (`__rxe_cleanup`: about 51 s per queue pair on Linux 6.1, measured), warns, then
//! frees the queue pair that the window still points to (the window's later deallocation drops a reference on freed
//! memory). On such devices ([`Quirks::destroy_qp_waits_for_type2_windows`]) a type 2 window
//! holds a [`QpHoldToken`] of the queue pair its bind is posted through, from that post on (the
//! device may execute the bind, taking its reference, before its completion is polled); a queue
//! pair dropped while tokens of it live parks its destruction here ([`park_qp_teardown`]) and
//! returns at once; the last token, dropped after its window's unbinding was proven or its
//! deallocation succeeded, runs it, on whatever thread drops it.
//!
//! What a parked queue pair keeps: the teardown owns everything `ibv_destroy_qp` needs and every
//! reference the queue pair held (its CQs, PD, SRQ, XRC domain, RDMA-CM id, the rings with their
//! posted buffers, prepared requests' pins), so none of those is destroyed before it; dropping
//! their handles meanwhile only drops a reference. The queue pair stays as it was in the device
//! (its posted requests may still complete, into CQs that live on) until the teardown runs.
//!
//! Limits. A window whose deallocation fails keeps its token for ever (`mem::forget`): the
//! queue pair, and what it holds, are leaked with the window's region, as the crate leaks
//! whatever a failed destroy verb may leave in use. A bind still posted when its queue pair is
//! dropped holds the queue pair until its completion is polled (which hands the window out or
//! drops it): a CQ that is never polled again keeps the queue pair, the CQ and the window
//! allocated until the process exits. At process exit nothing parked runs; the kernel frees
//! every object when the device file closes.
//!
//! [`Quirks::destroy_qp_waits_for_type2_windows`]: crate::quirks::Quirks::destroy_qp_waits_for_type2_windows

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

/// What a dropped queue pair still has to do (destroy itself, hand its buffers to its CQs).
pub(crate) type Teardown = Box<dyn FnOnce() + Send>;

/// The windows bound through one queue pair, and its parked teardown.
pub(crate) struct QpHold {
    qp_id: u64,
    state: Mutex<HoldState>,
}

#[derive(Default)]
struct HoldState {
    /// Live tokens: windows that may still be bound through the queue pair.
    bound: usize,
    /// The queue pair's teardown, parked by its drop while `bound > 0`.
    parked: Option<Teardown>,
}

impl QpHold {
    fn state(&self) -> MutexGuard<'_, HoldState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The holds of live queue pairs, by their process-unique id ([`QpId`](crate::QpId)).
fn holds() -> MutexGuard<'static, HashMap<u64, Weak<QpHold>>> {
    static HOLDS: OnceLock<Mutex<HashMap<u64, Weak<QpHold>>>> = OnceLock::new();
    HOLDS.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner)
}

impl Drop for QpHold {
    fn drop(&mut self) {
        let mut map = holds();
        // Only this hold's entry: a dead one (a new hold of the same id is never made while
        // this one lives, and ids are not reused).
        if map.get(&self.qp_id).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&self.qp_id);
        }
    }
}

/// A window bound through queue pair `qp_id` holds back its destruction until this token is
/// dropped (after the window's unbinding was proven or its deallocation succeeded).
pub(crate) struct QpHoldToken(Arc<QpHold>);

impl QpHoldToken {
    /// A token of queue pair `qp_id`.
    pub(crate) fn new(qp_id: u64) -> QpHoldToken {
        let mut map = holds();
        let hold = match map.get(&qp_id).and_then(Weak::upgrade) {
            Some(h) => h,
            None => {
                let h = Arc::new(QpHold { qp_id, state: Mutex::default() });
                map.insert(qp_id, Arc::downgrade(&h));
                h
            }
        };
        // Counted before the map is unlocked: a drop of the queue pair that finds this hold finds
        // it counted. (Lock order: the map, then a hold's state; nothing takes them the other
        // way round.)
        hold.state().bound += 1;
        drop(map);
        QpHoldToken(hold)
    }

    /// The id of the queue pair it holds.
    pub(crate) fn qp_id(&self) -> u64 {
        self.0.qp_id
    }
}

impl Drop for QpHoldToken {
    fn drop(&mut self) {
        let run = {
            let mut st = self.0.state();
            st.bound -= 1;
            if st.bound == 0 {
                st.parked.take()
            } else {
                None
            }
        };
        // Outside the lock: the teardown destroys the queue pair and drops what it held.
        if let Some(teardown) = run {
            teardown();
        }
    }
}

/// The drop of queue pair `qp_id`: parks `teardown` while windows bound through the queue pair
/// hold tokens of it (the last token runs it) and returns `None`; otherwise hands it back to be
/// run now.
pub(crate) fn park_qp_teardown(qp_id: u64, teardown: Teardown) -> Option<Teardown> {
    let Some(hold) = holds().get(&qp_id).and_then(Weak::upgrade) else {
        return Some(teardown);
    };
    let mut st = hold.state();
    if st.bound == 0 {
        return Some(teardown);
    }
    st.parked = Some(teardown);
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn counter() -> (Arc<AtomicUsize>, impl Fn() -> Teardown) {
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        (runs, move || {
            let r = r.clone();
            Box::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }) as Teardown
        })
    }

    #[test]
    fn a_queue_pair_without_windows_is_torn_down_at_once() {
        let (runs, t) = counter();
        park_qp_teardown(u64::MAX - 1, t()).expect("nothing holds it")();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // A token that came and went leaves nothing behind.
        drop(QpHoldToken::new(u64::MAX - 1));
        park_qp_teardown(u64::MAX - 1, t()).expect("nothing holds it")();
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert!(!holds().contains_key(&(u64::MAX - 1)));
    }

    #[test]
    fn the_last_window_runs_the_parked_teardown_once() {
        let (runs, t) = counter();
        let id = u64::MAX - 2;
        let a = QpHoldToken::new(id);
        let b = QpHoldToken::new(id);
        assert_eq!(a.qp_id(), id);
        assert!(park_qp_teardown(id, t()).is_none(), "parked");
        drop(a);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "one window left");
        drop(b);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(!holds().contains_key(&id));
        // Tokens of other queue pairs are independent.
        let other = QpHoldToken::new(id - 1);
        park_qp_teardown(id, t()).expect("id's hold is gone")();
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        drop(other);
    }

    /// A window moved to another thread: its last token and the queue pair's drop race; the
    /// teardown runs exactly once, on whichever side comes second, and nothing is left behind.
    #[test]
    fn a_drop_racing_the_last_window_on_another_thread_runs_the_teardown_once() {
        let rounds = if cfg!(miri) { 8 } else { 2000 };
        for round in 0..rounds {
            let id = u64::MAX - 1000 - round;
            let (runs, t) = counter();
            let token = QpHoldToken::new(id);
            let window = std::thread::spawn(move || drop(token));
            if let Some(run) = park_qp_teardown(id, t()) {
                run();
            }
            window.join().unwrap();
            assert_eq!(runs.load(Ordering::SeqCst), 1, "round {round}");
            assert!(!holds().contains_key(&id), "round {round}");
        }
    }

    /// A bind request recorded for one queue pair and then posted on another moves its token:
    /// the first queue pair's parked teardown runs when the token leaves it, the second's waits
    /// for the window.
    #[test]
    fn a_token_moved_to_another_queue_pair_releases_the_first() {
        let (runs, t) = counter();
        let (first, second) = (u64::MAX - 3, u64::MAX - 4);
        let mut hold = Some(QpHoldToken::new(first));
        assert!(park_qp_teardown(first, t()).is_none(), "parked");
        drop(hold.replace(QpHoldToken::new(second)));
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the first queue pair is held no more");
        assert!(park_qp_teardown(second, t()).is_none(), "parked");
        drop(hold);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    /// A teardown that panics (a buffer's drop) does not poison the bookkeeping: later tokens and
    /// drops of the same and other queue pairs work.
    #[test]
    fn a_panicking_teardown_leaves_the_holds_usable() {
        let id = u64::MAX - 5;
        let token = QpHoldToken::new(id);
        assert!(park_qp_teardown(id, Box::new(|| panic!("a buffer's drop panicked"))).is_none());
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(token)));
        assert!(caught.is_err());
        assert!(!holds().contains_key(&id));
        let (runs, t) = counter();
        let token = QpHoldToken::new(id);
        assert!(park_qp_teardown(id, t()).is_none());
        drop(token);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
