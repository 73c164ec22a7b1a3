//! A shared driver of one completion queue and the queue pairs whose futures await on it.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};
use std::task::{Context as TaskContext, Poll, Wake, Waker};

use super::backend::Backend;
use super::cq::CqCore;
use super::wait::WaitPolicy;
use crate::error::{Error, PostError, Result};
use crate::memory::RemoteSlice;
use crate::pd::ProtectionDomain;
use crate::post::ring::{keep_first, Payload};
use crate::post::{Local, RecvRequest, SendRequest};
use crate::queue::{Completion, CompletionChannel, CompletionQueue, QpType, QueuePair, QueuePairBuilder};

/// Completions fetched per `ibv_poll_cq()` by the driver.
const BATCH: usize = 16;

/// Completions one poll of an [`Op`] (or one [`Driver::reap`]) handles at most: then it wakes its
/// task and yields, so that a CQ that never runs dry (completions nobody waits for, a provider
/// bug) cannot keep a poll, the driver's lock and the executor's thread for ever, nor grow the
/// completions it drops without bound.
pub(crate) const POLL_BUDGET: usize = 4 * BATCH;

enum Entry {
    Free,
    /// Posted; the future waits (with the waker of the task that polled it last).
    Waiting(Option<Waker>, u64),
    /// Completed; the future has not taken it yet.
    Done(Completion),
    /// The future was dropped: the completion is dropped when it comes.
    Abandoned,
    /// Its queue pair was reset or replaced through [`AsyncQueuePair::with_qp`]: no completion
    /// will come for it; the future resolves to an error.
    Forgotten,
}

struct Slot {
    gen: u32,
    /// The number of the queue pair the operation was posted on: a completion of another (or
    /// of a request posted by other means) that carries the same `wr_id` is not its.
    qp_num: u32,
    /// The queue pair's [`QueuePair`] id (never reused, unlike QP numbers): which operations
    /// [`State::forget`] ends.
    owner: u64,
    /// The work queue (a queue pair's send or receive queue: [`State::queues`]) it was posted on.
    queue: u32,
    entry: Entry,
}

struct State {
    core: CqCore,
    batch: Box<[Completion]>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Per work queue of the driven queue pairs (two each), the tokens of its operations whose
    /// completions have not come, oldest first. A work queue completes its requests in the
    /// order they were posted, so only the front one's completion can come next: under the
    /// adaptive wait the others sleep instead of spinning, and each is woken when it comes to
    /// the front ([`State::wake_front`]).
    queues: Vec<VecDeque<u64>>,
    /// Indices of `queues` no queue pair uses.
    free_queues: Vec<u32>,
}

/// The top byte of every token: `wr_id`s of requests the driver did not post (the usual small
/// numbers, offsets) never name one of its operations.
const TOKEN_MARK: u64 = 0x41 << 56;
/// A slot generation's bits in a token (24).
const GEN_MASK: u32 = 0xff_ffff;

fn token(idx: u32, gen: u32) -> u64 {
    TOKEN_MARK | u64::from(gen & GEN_MASK) << 32 | u64::from(idx)
}

/// The slot index a token names.
fn index(tok: u64) -> u32 {
    (tok & 0xffff_ffff) as u32
}

impl State {
    fn slot(&mut self, tok: u64) -> Option<&mut Slot> {
        let s = self.slots.get_mut(index(tok) as usize)?;
        (token(index(tok), s.gen) == tok).then_some(s)
    }

    fn alloc(&mut self, user_wr_id: u64, qp_num: u32, owner: u64, queue: u32) -> u64 {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot { gen: 0, qp_num: 0, owner: 0, queue: 0, entry: Entry::Free });
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 operations in flight")
            }
        };
        let s = &mut self.slots[idx as usize];
        s.entry = Entry::Waiting(None, user_wr_id);
        s.qp_num = qp_num;
        s.owner = owner;
        s.queue = queue;
        let tok = token(idx, s.gen);
        self.queues[queue as usize].push_back(tok);
        tok
    }

    /// Two work queues for a queue pair (send, receive), empty.
    fn open_queues(&mut self) -> [u32; 2] {
        [(); 2].map(|()| match self.free_queues.pop() {
            Some(q) => q,
            None => {
                self.queues.push(VecDeque::new());
                u32::try_from(self.queues.len() - 1).expect("fewer than 2^32 queue pairs")
            }
        })
    }

    /// Gives back the work queues of a queue pair that is gone; operations of it still
    /// outstanding are no longer in any queue's order.
    fn close_queues(&mut self, queues: [u32; 2]) {
        for q in queues {
            self.queues[q as usize].clear();
            self.free_queues.push(q);
        }
    }

    /// Takes `tok` out of its work queue's order (its completion came, or it was never posted).
    /// Usually the front (or, for a post that failed, the back); searched otherwise, and
    /// nothing when it is not there (its queue pair's queues were closed or cleared).
    #[inline]
    fn unqueue(&mut self, tok: u64, queue: u32) {
        let q = &mut self.queues[queue as usize];
        if q.front() == Some(&tok) {
            q.pop_front();
        } else {
            Self::unqueue_slow(q, tok);
        }
    }

    #[inline(never)]
    fn unqueue_slow(q: &mut VecDeque<u64>, tok: u64) {
        if q.back() == Some(&tok) {
            q.pop_back();
        } else if let Some(i) = q.iter().position(|&t| t == tok) {
            q.remove(i);
        }
    }

    /// Whether no operation whose future waits was posted before `tok` on its work queue: its
    /// completion is the next one a waiting future of that queue can get. (Operations of
    /// dropped futures ahead of it do not count: nobody waits for them.)
    #[inline]
    fn is_front(&self, tok: u64) -> bool {
        is_front(&self.slots, &self.queues, tok)
    }

    /// `tok`'s completion came: out of its work queue's order, and the operation now at the
    /// front (if it waits, and is not `own`) into `wake`.
    #[inline]
    fn leave_queue(&mut self, tok: u64, queue: u32, own: u64, wake: &mut Wakers) {
        self.unqueue(tok, queue);
        self.wake_front(queue, own, wake);
    }

    /// Adds to `wake` the waker of the oldest operation of work queue `queue` whose future waits
    /// (it may have slept behind the one that just left the front), unless it is `own`.
    #[inline]
    fn wake_front(&self, queue: u32, own: u64, wake: &mut Wakers) {
        let q = &self.queues[queue as usize];
        if q.is_empty() {
            return;
        }
        self.wake_front_slow(q, own, wake);
    }

    #[inline(never)]
    fn wake_front_slow(&self, q: &VecDeque<u64>, own: u64, wake: &mut Wakers) {
        for &t in q {
            if let Entry::Waiting(w, _) = &self.slots[index(t) as usize].entry {
                if t != own {
                    wake.extend(w.clone());
                }
                return;
            }
        }
    }

    /// Retires the slot of `tok` (which must be live): a new generation, back on the free list.
    /// Its entry is the caller's to empty.
    fn retire(&mut self, tok: u64) -> &mut Slot {
        self.free.push(index(tok));
        let s = &mut self.slots[index(tok) as usize];
        s.gen = s.gen.wrapping_add(1);
        s
    }

    /// Frees the slot of `tok` (which must be live); returns what it held.
    fn release(&mut self, tok: u64) -> Entry {
        std::mem::replace(&mut self.retire(tok).entry, Entry::Free)
    }

    /// Frees the slot of `tok`, which must be live and done, and takes its completion: moved
    /// once, out of the slot (not as the whole entry, as [`release`](Self::release) returns it).
    #[inline]
    fn take_done(&mut self, tok: u64) -> Completion {
        match std::mem::replace(&mut self.retire(tok).entry, Entry::Free) {
            Entry::Done(c) => c,
            _ => unreachable!("take_done on a slot that is not done"),
        }
    }

    /// When `batch[0]` is the completion of `tok`, a waiting operation (whose poll took it):
    /// frees its slot (the operation behind it in its queue is woken into `wake`) and returns
    /// it, with the caller's `wr_id`. Otherwise `None`, the batch untouched.
    #[inline]
    fn take_own(&mut self, tok: u64, wake: &mut Wakers) -> Option<Completion> {
        let c = &self.batch[0];
        if !c.is_tracked() || c.wr_id() != tok {
            return None;
        }
        let qp_num = c.qp_num();
        let s = self.slot(tok)?;
        let Entry::Waiting(_, user) = s.entry else { return None };
        if s.qp_num != qp_num {
            return None;
        }
        let queue = s.queue;
        // Its waker (this poll's task) goes with the entry.
        self.retire(tok).entry = Entry::Free;
        self.leave_queue(tok, queue, tok, wake);
        let mut c = std::mem::take(&mut self.batch[0]);
        c.set_wr_id(user);
        Some(c)
    }

    /// Hands the polled completions `batch[..n]` to their futures. Returns the wakers to wake
    /// (outside the lock) and the completions to drop (outside the lock too: dropping a buffer
    /// may run a caller's callback). The waker of operation `own` (the one being polled, which
    /// takes its completion in this very poll; `0`, no token, for none) is not woken.
    fn dispatch(&mut self, n: usize, own: u64, wake: &mut Wakers, drop_later: &mut Vec<Completion>) {
        for i in 0..n {
            let c = &mut self.batch[i];
            if !c.is_tracked() {
                // A stale completion of a dropped queue pair: nothing waits for it.
                drop_later.push(std::mem::take(c));
                continue;
            }
            let (tok, qp_num) = (c.wr_id(), c.qp_num());
            // Looked at in place: the completion (a few hundred bytes) is moved once, into the
            // slot or to the drops.
            let Some(slot) = self.slot(tok).filter(|s| s.qp_num == qp_num) else {
                // Not one of the driver's operations: a request posted by other means (through
                // `with_qp`, an SRQ's receive) whose `wr_id` happens to look like a token.
                drop_later.push(std::mem::take(&mut self.batch[i]));
                continue;
            };
            let queue = slot.queue;
            match &mut slot.entry {
                Entry::Waiting(w, user) => {
                    let (w, user) = (w.take(), *user);
                    let c = &mut self.batch[i];
                    c.set_wr_id(user);
                    // Re-borrowed: `slot` and the batch are two fields of `self`.
                    self.slots[index(tok) as usize].entry = Entry::Done(std::mem::take(c));
                    if tok != own {
                        wake.extend(w);
                    }
                    self.leave_queue(tok, queue, own, wake);
                }
                Entry::Abandoned => {
                    drop_later.push(std::mem::take(&mut self.batch[i]));
                    self.release(tok);
                    self.leave_queue(tok, queue, own, wake);
                }
                _ => {
                    // One completion per signaled request: a second can only be of a request
                    // posted by other means with this token as its wr_id. Keep what was there.
                    drop_later.push(std::mem::take(&mut self.batch[i]));
                }
            }
        }
    }

    /// Ends the operations of the queue pair whose id is `owner` that wait for a completion
    /// (the queue pair was reset, replaced or destroyed): their futures resolve to an error,
    /// the slots of dropped ones are freed (a completion that still comes finds its slot's
    /// generation moved on and is dropped), its work queues `queues` are emptied. Returns the
    /// wakers of their tasks.
    fn forget(&mut self, owner: u64, queues: [u32; 2]) -> Vec<Waker> {
        for q in queues {
            self.queues[q as usize].clear();
        }
        let mut wake = Vec::new();
        let mut freed = Vec::new();
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.owner != owner || matches!(s.entry, Entry::Free) {
                continue;
            }
            match std::mem::replace(&mut s.entry, Entry::Free) {
                Entry::Waiting(w, _) => {
                    s.entry = Entry::Forgotten;
                    wake.extend(w);
                }
                Entry::Abandoned => freed.push(token(i as u32, s.gen)),
                other => s.entry = other,
            }
        }
        for tok in freed {
            self.release(tok);
        }
        wake
    }

    /// The wakers of the tasks of every waiting operation, each task once (as far as
    /// [`Waker::will_wake`] tells).
    fn waiting_wakers(&self) -> Vec<Waker> {
        let mut wake: Vec<Waker> = Vec::new();
        for s in &self.slots {
            if let Entry::Waiting(Some(w), _) = &s.entry {
                if !wake.iter().any(|x| x.will_wake(w)) {
                    wake.push(w.clone());
                }
            }
        }
        wake
    }
}

/// [`State::is_front`] on the state's two fields it reads (a poll asks it while the CQ, a third
/// field, is borrowed).
#[inline]
fn is_front(slots: &[Slot], queues: &[VecDeque<u64>], tok: u64) -> bool {
    let Some(s) = slots.get(index(tok) as usize) else { return true };
    let Some(q) = queues.get(s.queue as usize) else { return true };
    match q.front() {
        None => true,
        Some(&t) if t == tok => true,
        Some(_) => is_front_slow(slots, q, tok),
    }
}

#[inline(never)]
fn is_front_slow(slots: &[Slot], q: &VecDeque<u64>, tok: u64) -> bool {
    for &t in q {
        if t == tok {
            return true;
        }
        if matches!(slots[index(t) as usize].entry, Entry::Waiting(..)) {
            return false;
        }
    }
    true
}

/// The wakers a poll collects under the lock, to wake once it is let go: the first inline (a
/// poll that hands over a completion usually hands over one: no allocation), the others in a
/// vector.
#[derive(Default)]
struct Wakers {
    first: Option<Waker>,
    more: Vec<Waker>,
}

impl Wakers {
    fn extend(&mut self, w: Option<Waker>) {
        let Some(w) = w else { return };
        if self.first.is_none() {
            self.first = Some(w);
        } else {
            self.more.push(w);
        }
    }

    fn wake_all(self) {
        // The drop wakes them.
        drop(self);
    }
}

impl Drop for Wakers {
    /// Wakes the tasks, also when a poll unwinds (a buffer's free callback panicked in the CQ's
    /// poll after this poll handed other operations their completions: their slots are done,
    /// and only these wakers tell their tasks).
    fn drop(&mut self) {
        // Filled in order: no first means none (a poll that found nothing).
        if let Some(w) = self.first.take() {
            w.wake();
            std::mem::take(&mut self.more).into_iter().for_each(Waker::wake);
        }
    }
}

struct Shared {
    state: Mutex<State>,
    /// The waker the reactor holds: the driver's own ([`ReactorWake`]), not a task's, so that
    /// no task's future (forgotten, or kept aside unpolled) can be the only one the reactor
    /// would wake.
    reactor: Waker,
    /// Set when the reactor woke the driver while the state's lock was held: the holder wakes
    /// the waiting tasks once it lets go ([`StateGuard`]).
    wake_pending: AtomicBool,
}

impl Shared {
    fn new(state: State) -> Arc<Shared> {
        Arc::new_cyclic(|weak| Shared {
            state: Mutex::new(state),
            reactor: Waker::from(Arc::new(ReactorWake(weak.clone()))),
            wake_pending: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> StateGuard<'_> {
        // A panic under the lock leaves the state consistent. Completions handed over are
        // dropped outside it, but a poll under it may drop buffers itself (of unsignaled
        // requests a completion releases, or of dropped queue pairs) and `with_cq` runs the
        // caller's closure: a panic there unwinds out of the CQ's poll, which is panic-safe,
        // before `dispatch` touched the slots.
        StateGuard {
            guard: self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
            _then: WakeIfPending(self),
        }
    }

    /// Wakes the task of every waiting operation if the reactor woke the driver since, unless
    /// the state's lock is held: its holder calls this again when it lets go. (Each side sets
    /// or clears its own mark, then looks at the other's, with a full fence between: of the
    /// reactor's wake-up and a holder's unlock, whichever comes second sees the first.)
    fn wake_if_pending(&self) {
        loop {
            fence(Ordering::SeqCst);
            if !self.wake_pending.load(Ordering::Relaxed) {
                return;
            }
            let st = match self.state.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => return,
            };
            self.wake_pending.store(false, Ordering::Relaxed);
            let wake = st.waiting_wakers();
            // Not a `StateGuard`: the loop looks at the mark again itself.
            drop(st);
            // Outside the lock: a waker may poll its task at once.
            wake.into_iter().for_each(Waker::wake);
        }
    }
}

/// The reactor's waker: wakes every task that waits on the driver. Each polls its future once;
/// the first takes the completions from the CQ and hands them to their futures, the others find
/// it empty and wait again (their polls register this waker again).
struct ReactorWake(Weak<Shared>);

impl Wake for ReactorWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(shared) = self.0.upgrade() {
            shared.wake_pending.store(true, Ordering::Relaxed);
            shared.wake_if_pending();
        }
    }
}

/// The driver's state, locked; once unlocked, wakes the waiting tasks if the reactor woke the
/// driver meanwhile.
struct StateGuard<'a> {
    // Fields drop in order: the lock goes first.
    guard: MutexGuard<'a, State>,
    _then: WakeIfPending<'a>,
}

struct WakeIfPending<'a>(&'a Shared);

impl Drop for WakeIfPending<'_> {
    fn drop(&mut self) {
        // Unwinding out of the lock: a poll of the CQ under it met a buffer's panicking drop
        // (of a dropped queue pair's request, say), and the CQ keeps the completions it took for
        // its next poll, which no channel event will announce. Every waiting task polls again,
        // so that one of them takes them.
        if std::thread::panicking() {
            self.0.wake_pending.store(true, Ordering::Relaxed);
        }
        self.0.wake_if_pending();
    }
}

impl Deref for StateGuard<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        &self.guard
    }
}

impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

/// Drives one completion queue for any number of [`AsyncQueuePair`]s and tasks.
///
/// Like any future, an [`Op`] makes progress only while polled. The reactor wakes the driver,
/// which wakes the task of every waiting operation: a future kept aside without being polled,
/// or forgotten, holds up no other task.
///
/// Owns the CQ (created on a channel that serves it alone) and its channel's reactor
/// registration. Cloning is cheap (an `Arc`); every clone drives the same CQ. There is no
/// background task: a future that waits polls the CQ itself (`ibv_poll_cq()`), hands the
/// completions it finds to their futures, and when there is none spins or arms the CQ and waits
/// for the channel, as its [`WaitPolicy`] says ([`set_wait_policy`](Self::set_wait_policy)).
///
/// A poll may drop buffers while the driver's lock is held (those of unsignaled requests a
/// completion releases, or of dropped queue pairs): an [`OwnedBuffer`](crate::OwnedBuffer) free
/// callback must not call into this driver or its queue pairs (the lock is not reentrant).
#[derive(Clone)]
pub struct Driver {
    shared: Arc<Shared>,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

impl Driver {
    /// Wraps `cq`, created on `channel`, which must serve this CQ only; registers the channel's
    /// descriptor with `backend`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `cq` was not created on `channel`, or is an extended CQ
    /// whose completions do not carry the QP number ([`WcFlags::QP_NUM`](crate::WcFlags::QP_NUM):
    /// the driver matches a completion to its operation by it); [`Error::Verb`] when the
    /// reactor refuses the descriptor.
    pub fn new(cq: CompletionQueue, channel: &CompletionChannel, backend: &dyn Backend) -> Result<Driver> {
        if !cq.reports_qp_num() {
            return Err(Error::InvalidArgument {
                verb: "ibv_create_cq_ex",
                reason: "the driver's extended CQ must report the QP number (WcFlags::QP_NUM)",
            });
        }
        let core = CqCore::new(cq, channel, backend)?;
        let state = State {
            core,
            batch: (0..BATCH).map(|_| Completion::default()).collect(),
            slots: Vec::new(),
            free: Vec::new(),
            queues: Vec::new(),
            free_queues: Vec::new(),
        };
        Ok(Driver { shared: Shared::new(state) })
    }

    /// Runs `f` on a view of the driven CQ ([`DrivenCq`]), e.g. to create queue pairs on it
    /// with [`DrivenCq::create_qp`]. The view cannot poll the CQ or wait on its channel: no
    /// completion can be taken behind the driver's back. (It holds the driver's lock: `f` must
    /// not await or call back into the driver or its queue pairs: a post locks its queue pair,
    /// then the driver.)
    pub fn with_cq<R>(&self, f: impl FnOnce(DrivenCq<'_>) -> R) -> R {
        f(DrivenCq { cq: &self.shared.lock().core.cq })
    }

    /// Polls the CQ without waiting (`ibv_poll_cq()`) until it is empty or a bounded number of
    /// completions (64) was handled, and hands what it finds to the waiting futures;
    /// completions of dropped futures are dropped, returning their buffers' room to their queue
    /// pairs. Returns how many completions it polled (call it again while that is 64).
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_poll_cq()` fails.
    pub fn reap(&self) -> Result<usize> {
        let mut wake = Wakers::default();
        let mut drop_later = Vec::new();
        let mut total = 0;
        let r = {
            let mut st = self.shared.lock();
            loop {
                let State { core, batch, .. } = &mut *st;
                match core.poll_now(batch) {
                    Ok(got) => {
                        let n = got.len();
                        st.dispatch(n, 0, &mut wake, &mut drop_later);
                        total += n;
                        if n < BATCH || total >= POLL_BUDGET {
                            break Ok(total);
                        }
                    }
                    Err(e) => break Err(e),
                }
            }
        };
        // Woken before the drops: a buffer's free callback that panics loses no wake-up.
        wake.wake_all();
        if let Some(panic) = drop_each(drop_later) {
            std::panic::resume_unwind(panic);
        }
        r
    }

    /// Sets what a waiting future does when it finds the CQ empty (see [`WaitPolicy`]; the
    /// default is [`WaitPolicy::ADAPTIVE`]: busy poll for a bounded while, then arm the CQ,
    /// `ibv_req_notify_cq()`, and sleep in the reactor). Takes effect at the next poll of any
    /// waiting future; a task sleeping in the reactor sleeps on until the channel fires.
    #[doc(alias = "ibv_req_notify_cq")]
    pub fn set_wait_policy(&self, policy: WaitPolicy) {
        self.shared.lock().core.wait.set(policy);
    }

    /// The wait policy (an adaptive spin as clamped, [`WaitPolicy::MAX_SPIN`]; a zero spin is
    /// [`WaitPolicy::Events`]).
    pub fn wait_policy(&self) -> WaitPolicy {
        self.shared.lock().core.wait.policy()
    }

    /// [`set_wait_policy`](Self::set_wait_policy) with [`WaitPolicy::BusyPoll`] (`true`: a
    /// waiting task that finds the CQ empty wakes itself and yields to its executor at once:
    /// lower latency, a core kept busy) or [`WaitPolicy::Events`] (`false`: arm the CQ and sleep
    /// in the reactor until the channel fires).
    pub fn set_busy_poll(&self, busy: bool) {
        self.set_wait_policy(if busy { WaitPolicy::BusyPoll } else { WaitPolicy::Events });
    }

    /// Operations posted whose futures have not yet returned or been dropped, plus dropped ones
    /// still waiting for their completion.
    pub fn in_flight(&self) -> usize {
        let st = self.shared.lock();
        st.slots.len() - st.free.len()
    }

    fn begin(&self, user_wr_id: u64, qp: &QueuePair, queue: u32) -> u64 {
        self.shared.lock().alloc(user_wr_id, qp.qp_num(), qp.id, queue)
    }
}

/// The completion queue a [`Driver`] drives, as [`Driver::with_cq`] lends it: queue pairs can be
/// created on it, but it cannot be polled or waited on (that would take the futures'
/// completions, or the channel's events, behind the driver).
#[derive(Debug, Clone, Copy)]
pub struct DrivenCq<'a> {
    cq: &'a CompletionQueue,
}

impl<'a> DrivenCq<'a> {
    /// Starts a queue pair of `pd` whose send and receive completions go to the driven CQ
    /// ([`ProtectionDomain::create_qp`](crate::ProtectionDomain::create_qp), `ibv_create_qp()`);
    /// wrap the built queue pair with [`AsyncQueuePair::new`].
    pub fn create_qp(&self, pd: &'a ProtectionDomain, qp_type: QpType) -> QueuePairBuilder<'a> {
        pd.create_qp(self.cq, qp_type)
    }

    /// The CQ's capacity in completions (`cqe` as the provider rounded it).
    pub fn capacity(&self) -> u32 {
        self.cq.capacity()
    }

    /// Whether `qp` sends and receives into the driven CQ.
    pub fn completes(&self, qp: &QueuePair) -> bool {
        qp.completes_into(self.cq)
    }
}

/// The future of one posted operation: resolves to its [`Completion`] (with the request's
/// buffers, and the caller's `wr_id`).
///
/// Dropping it before it resolves is sound: the request's buffers stay with the queue pair until
/// the device completes it, then the driver drops them. It keeps its queue pair alive (the QP is
/// destroyed only when the [`AsyncQueuePair`] and every `Op` of it are gone), so a pending
/// operation completes, if only with a flush error, unless
/// [`with_qp`](AsyncQueuePair::with_qp) resets or replaces the queue pair: then it resolves to
/// [`Error::InvalidArgument`].
///
/// A poll does bounded work whatever the CQ returns: it handles at most 64 completions (of any
/// operation, or of nobody's), then wakes its own task and returns `Pending`, so that a CQ that
/// never runs dry cannot hold the executor's thread or grow memory without bound.
///
/// A poll that meets a buffer's panicking drop (an [`OwnedBuffer`](crate::OwnedBuffer) free
/// callback: of a dropped future's completion, or released by the CQ's poll) propagates the
/// panic, and loses no completion: this operation's comes at its next poll, those the CQ's poll
/// took are kept for the next polls (as [`CompletionQueue::poll`] keeps them), and every task
/// waiting on the driver is woken to take them.
#[must_use = "the operation is posted either way; dropping the future only forgoes its completion"]
pub struct Op {
    shared: Arc<Shared>,
    tok: u64,
    finished: bool,
    /// The operation's completion, taken by a poll that then unwound (a buffer of another
    /// completion panicked in its drop): the next poll returns it. Boxed: it is there only
    /// after such a panic, and a completion (a few hundred bytes) inline would be moved with
    /// every move of the future.
    kept: Option<Box<Completion>>,
    _qp: Arc<QpCell>,
}

/// What an [`AsyncQueuePair`] and its [`Op`]s share: the queue pair, then (dropped after it)
/// the reaper of its abandoned operations.
struct QpCell {
    qp: Mutex<QueuePair>,
    reaper: Reaper,
}

/// Once the queue pair is destroyed, the completions of its operations whose futures were
/// dropped never reach their slots (they come back untracked, or not at all): frees those slots.
struct Reaper {
    /// `None` once the queue pair was taken back ([`AsyncQueuePair::into_inner`]).
    shared: Option<Arc<Shared>>,
    /// The queue pair's id (changed when [`AsyncQueuePair::with_qp`] replaces it).
    owner: std::sync::atomic::AtomicU64,
    /// Its send and receive queues' orders in the driver ([`State::queues`]).
    queues: [u32; 2],
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(shared) = &self.shared {
            let mut st = shared.lock();
            let wake = st.forget(*self.owner.get_mut(), self.queues);
            st.close_queues(self.queues);
            drop(st);
            // No operation of the queue pair is waiting (each `Op` holds it): nothing to wake.
            drop(wake);
        }
    }
}

impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Op").field("token", &self.tok).field("finished", &self.finished).finish()
    }
}

impl Future for Op {
    type Output = Result<Completion>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<Completion>> {
        if self.finished {
            return Poll::Ready(Err(Error::InvalidArgument {
                verb: "ibv_poll_cq",
                reason: "the operation's future was polled after it completed",
            }));
        }
        if let Some(c) = self.kept.take() {
            self.finished = true;
            return Poll::Ready(Ok(*c));
        }
        let tok = self.tok;
        let mut wake = Wakers::default();
        let mut drop_later = Vec::new();
        // The completion, once taken from its slot. The loop's outcome is small (`Step`): the
        // completion (a few hundred bytes) is moved only when there is one, not at each poll.
        let mut done = None;
        let step = {
            let mut guard = self.shared.lock();
            let st = &mut *guard;
            let mut handled = 0;
            loop {
                // Done?
                match st.slot(tok).map(|s| &mut s.entry) {
                    Some(Entry::Done(_)) => {
                        done = Some(st.take_done(tok));
                        break Step::Done;
                    }
                    Some(Entry::Waiting(w, _)) => {
                        if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                            *w = Some(cx.waker().clone());
                        }
                    }
                    Some(Entry::Forgotten) => {
                        st.release(tok);
                        break Step::Failed(Error::InvalidArgument {
                            verb: "ibv_poll_cq",
                            reason: "the queue pair was reset or replaced in AsyncQueuePair::with_qp: \
                                     the operation will not complete",
                        });
                    }
                    _ => break Step::Failed(LOST),
                }
                if handled >= POLL_BUDGET {
                    // Bounded work per poll, whatever the CQ returns: come back after the
                    // executor ran others (timers included).
                    cx.waker().wake_by_ref();
                    break Step::Pending;
                }
                // Drive: poll the CQ, and wait for the channel when it is empty. One completion
                // per `ibv_poll_cq()`: most polls of a waiting future find the CQ empty (its
                // completion is not there yet), and the one-entry poll is the cheap one; a
                // burst costs a provider call per completion (the loop comes back for the next).
                // Only the front operation of its work queue spins under the adaptive wait:
                // another's completion cannot come before the front one's (asked only when the
                // CQ is empty).
                let State { core, batch, slots, queues, .. } = st;
                let front = || is_front(slots, queues, tok);
                match core.poll_ready(cx, Some(&self.shared.reactor), &mut batch[..1], front) {
                    Poll::Ready(Ok(n)) => {
                        handled += n;
                        // Its own completion (the usual find of a waiting operation's poll):
                        // taken straight from the batch, not moved into the slot and out.
                        if n == 1 {
                            if let Some(c) = st.take_own(tok, &mut wake) {
                                done = Some(c);
                                break Step::Done;
                            }
                        }
                        st.dispatch(n, tok, &mut wake, &mut drop_later);
                    }
                    Poll::Ready(Err(e)) => {
                        // The request stays posted: its completion is dropped when it comes.
                        if let Some(s) = st.slot(tok) {
                            s.entry = Entry::Abandoned;
                        }
                        break Step::Failed(e);
                    }
                    Poll::Pending => break Step::Pending,
                }
            }
        };
        // Wake everyone handed a completion, this task included when another future of it
        // (e.g. a `select!` branch polled before this one) was among them (this operation's own
        // completion needs no wake-up: this poll returns it). Before the drops: a buffer's free
        // callback that panics loses no wake-up.
        wake.wake_all();
        if let Some(panic) = drop_each(drop_later) {
            // This operation's completion, if it came, is not lost with the panic: kept for
            // the next poll.
            if let Some(c) = done {
                self.kept = Some(Box::new(c));
            }
            std::panic::resume_unwind(panic);
        }
        match step {
            Step::Pending => Poll::Pending,
            Step::Done => {
                self.finished = true;
                Poll::Ready(match done {
                    Some(c) => Ok(c),
                    None => Err(LOST),
                })
            }
            Step::Failed(e) => {
                self.finished = true;
                Poll::Ready(Err(e))
            }
        }
    }
}

/// How one poll of an [`Op`] ended (its completion, if any, aside).
enum Step {
    Pending,
    /// The completion was taken from the slot.
    Done,
    Failed(Error),
}

/// An operation's slot that holds none of its states (cannot happen: its future holds it).
const LOST: Error = Error::InvalidArgument { verb: "ibv_poll_cq", reason: "the operation's slot was lost" };

/// Drops the completions of abandoned operations one at a time, so that a buffer's panicking
/// drop leaves the others to be dropped (a second panic while unwinding would abort); returns
/// the first panic's payload ([`keep_first`]).
#[inline]
fn drop_each(completions: Vec<Completion>) -> Option<Payload> {
    if completions.is_empty() {
        // The common case, without a call.
        return None;
    }
    drop_each_slow(completions)
}

#[inline(never)]
fn drop_each_slow(completions: Vec<Completion>) -> Option<Payload> {
    let mut first = None;
    for c in completions {
        if let Err(p) = std::panic::catch_unwind(AssertUnwindSafe(|| drop(c))) {
            keep_first(&mut first, p);
        }
    }
    first
}

impl Drop for Op {
    fn drop(&mut self) {
        // A kept completion was taken from a slot already released (the field drops it).
        if self.finished || self.kept.is_some() {
            return;
        }
        let mut wake = Wakers::default();
        let done = {
            let mut st = self.shared.lock();
            let front = st.is_front(self.tok);
            match st.slot(self.tok) {
                Some(Slot { entry: e @ Entry::Waiting(..), queue, .. }) => {
                    *e = Entry::Abandoned;
                    // The next waiting operation of its queue is at the front now: it spins.
                    let queue = *queue;
                    if front {
                        st.wake_front(queue, self.tok, &mut wake);
                    }
                    None
                }
                Some(Slot { entry: Entry::Done(_) | Entry::Forgotten, .. }) => Some(st.release(self.tok)),
                _ => None,
            }
        };
        wake.wake_all();
        drop(done);
    }
}

/// A connected queue pair whose posts are futures, completing through a shared [`Driver`].
///
/// Methods take `&self`: any number of tasks may post on one queue pair (share it in an `Arc`).
/// Each call posts at once (`ibv_post_send()` / `ibv_post_recv()`, a short lock on the QP) and
/// returns an [`Op`] to await. Every request is signaled (a request made
/// [`unsignaled`](SendRequest::unsignaled) is refused: its future could never resolve).
pub struct AsyncQueuePair {
    qp: Arc<QpCell>,
    /// Set when [`with_qp`](Self::with_qp) left a queue pair that [`new`](Self::new) would
    /// refuse (not completing into the driver's CQ, receiving through an SRQ): posts are refused
    /// (their futures could never resolve, or their messages would be dropped).
    detached: AtomicBool,
    driver: Driver,
}

impl fmt::Debug for AsyncQueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncQueuePair").field("qp", &*self.lock_qp()).finish_non_exhaustive()
    }
}

fn to_error<R>(e: PostError<R>) -> Error {
    e.error
}

impl AsyncQueuePair {
    /// Wraps `qp`, whose send and receive queues must both complete into `driver`'s CQ.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (handing the QP back) when they do not, or when the queue pair
    /// receives through a shared receive queue or is an XRC queue pair (the driver takes only
    /// the completions of its own operations: those receives' messages would be dropped).
    #[allow(clippy::result_large_err)] // the QP comes back by value
    pub fn new(qp: QueuePair, driver: &Driver) -> std::result::Result<AsyncQueuePair, (QueuePair, Error)> {
        if !driver.with_cq(|cq| cq.completes(&qp)) {
            let e = Error::InvalidArgument {
                verb: "ibv_poll_cq",
                reason: "the queue pair's send and receive queues must complete into the driver's CQ",
            };
            return Err((qp, e));
        }
        if !(qp.has_send && qp.has_recv) {
            // Receives of a shared receive queue (or XRC) are not the driver's operations: it
            // would drop every message they take.
            let e = Error::InvalidArgument {
                verb: "ibv_poll_cq",
                reason: "the queue pair must have its own send and receive queues (no SRQ, no XRC)",
            };
            return Err((qp, e));
        }
        let queues = driver.shared.lock().open_queues();
        Ok(AsyncQueuePair {
            qp: Arc::new(QpCell {
                reaper: Reaper { shared: Some(driver.shared.clone()), owner: qp.id.into(), queues },
                qp: Mutex::new(qp),
            }),
            detached: AtomicBool::new(false),
            driver: driver.clone(),
        })
    }

    fn lock_qp(&self) -> MutexGuard<'_, QueuePair> {
        self.qp.qp.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The driver.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// Runs `f` on the queue pair (state queries, outstanding counts, [`set_error`](QueuePair::set_error)
    /// to flush every operation). It holds the QP's lock: `f` must not await, nor call this
    /// `AsyncQueuePair` (its lock is not reentrant: that call would deadlock). `f` should not
    /// post: the driver takes a completion for one of its operations only by its token
    /// (`wr_id`) and queue pair, so a request posted here is dropped with its completion
    /// (buffers included) unless its `wr_id` mimics a token, when it may resolve that
    /// operation's future.
    ///
    /// When `f` resets the queue pair or replaces it (`reset`, `mem::replace`, `mem::swap`),
    /// even by panicking afterwards, the operations still waiting resolve to
    /// [`Error::InvalidArgument`]: the device forgot them, or they went with the queue pair
    /// taken out. A replacement that [`new`](Self::new) would refuse (it does not complete into
    /// the driver's CQ, or receives through a shared receive queue) makes later posts fail with
    /// [`Error::InvalidArgument`] until `with_qp` puts one it accepts.
    pub fn with_qp<R>(&self, f: impl FnOnce(&mut QueuePair) -> R) -> R {
        let mut qp = self.lock_qp();
        let before = qp.incarnation();
        // Caught so that the check below runs with the lock still held, outside any unwinding.
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| f(&mut qp)));
        if !before.is(&qp) {
            let mut st = self.driver.shared.lock();
            // As `new` checks: a queue pair whose receives go through an SRQ (or XRC) would
            // have their messages dropped by the driver.
            let attached = qp.completes_into(&st.core.cq) && qp.has_send && qp.has_recv;
            self.detached.store(!attached, Ordering::Relaxed);
            self.qp.reaper.owner.store(qp.id, Ordering::Relaxed);
            let wake = st.forget(before.id, self.qp.reaper.queues);
            drop(st);
            drop(qp);
            wake.into_iter().for_each(Waker::wake);
        }
        r.unwrap_or_else(|p| std::panic::resume_unwind(p))
    }

    fn op(&self, tok: u64) -> Op {
        Op { shared: self.driver.shared.clone(), tok, finished: false, kept: None, _qp: self.qp.clone() }
    }

    /// Posts a send-queue request (`ibv_post_send()`) now and returns the future of its
    /// completion. When the send queue is full, it first reaps completions of dropped futures
    /// ([`Driver::reap`]) and retries once.
    ///
    /// # Errors
    /// As [`QueuePair::post_send`], handing the request back; [`Error::InvalidArgument`] for an
    /// unsignaled request.
    #[doc(alias = "ibv_post_send")]
    #[allow(clippy::result_large_err)] // as QueuePair::post_send
    pub fn post_send<'a>(&self, wr: SendRequest<'a>) -> std::result::Result<Op, PostError<SendRequest<'a>>> {
        if !wr.signaled {
            let error = Error::InvalidArgument {
                verb: "ibv_post_send",
                reason: "the async adaptor posts signaled requests only",
            };
            return Err(PostError { error, request: wr });
        }
        let qp = self.lock_qp();
        if let Err(error) = self.check_attached("ibv_post_send") {
            return Err(PostError { error, request: wr });
        }
        let tok = self.driver.begin(wr.wr_id, &qp, self.qp.reaper.queues[0]);
        let wr = wr.wr_id(tok);
        self.post_retrying(qp, tok, wr, |qp, wr| qp.post_send(wr)).map_err(|mut e| {
            e.request.wr_id = self.release(tok);
            e
        })
    }

    /// Posts a receive (`ibv_post_recv()`) now and returns the future of its completion.
    ///
    /// # Errors
    /// As [`QueuePair::post_recv`], handing the request back.
    #[doc(alias = "ibv_post_recv")]
    #[allow(clippy::result_large_err)] // as QueuePair::post_recv
    pub fn post_recv(&self, wr: RecvRequest) -> std::result::Result<Op, PostError<RecvRequest>> {
        let qp = self.lock_qp();
        if let Err(error) = self.check_attached("ibv_post_recv") {
            return Err(PostError { error, request: wr });
        }
        let tok = self.driver.begin(wr.wr_id, &qp, self.qp.reaper.queues[1]);
        let wr = wr.wr_id(tok);
        self.post_retrying(qp, tok, wr, |qp, wr| qp.post_recv(wr)).map_err(|mut e| {
            e.request.wr_id = self.release(tok);
            e
        })
    }

    /// Refuses posts while [`with_qp`](Self::with_qp) has left a queue pair that
    /// [`new`](Self::new) would refuse.
    fn check_attached(&self, verb: &'static str) -> Result<()> {
        if self.detached.load(Ordering::Relaxed) {
            return Err(Error::InvalidArgument {
                verb,
                reason: "the queue pair put in with_qp does not complete into the driver's CQ, or has no receive queue of its own (SRQ, XRC)",
            });
        }
        Ok(())
    }

    /// Posts `wr` (carrying the slot token `tok`, made under the lock `qp` for its queue pair)
    /// with `post`; a full queue gets one [`Driver::reap`] and one retry. On success the future
    /// of slot `tok`.
    #[allow(clippy::result_large_err)] // PostError hands the request back, as QueuePair's
    fn post_retrying<R>(
        &self,
        mut qp: MutexGuard<'_, QueuePair>,
        tok: u64,
        mut wr: R,
        post: impl Fn(&mut QueuePair, R) -> std::result::Result<(), PostError<R>>,
    ) -> std::result::Result<Op, PostError<R>> {
        let mut retried = false;
        loop {
            let r = post(&mut qp, wr);
            match r {
                Ok(()) => return Ok(self.op(tok)),
                Err(e) if matches!(e.error, Error::QueueFull { .. }) && !retried => {
                    retried = true;
                    wr = e.request;
                    let _ = self.driver.reap();
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Frees slot `tok` of a request that was never posted; the caller's `wr_id` it held.
    fn release(&self, tok: u64) -> u64 {
        let mut st = self.driver.shared.lock();
        let queue = st.slot(tok).map(|s| s.queue);
        if let Some(q) = queue {
            st.unqueue(tok, q);
        }
        match st.release(tok) {
            Entry::Waiting(_, user) => user,
            _ => 0,
        }
    }

    /// Posts `wr` (`ibv_post_send()`) and waits for its completion, which hands the buffers back
    /// ([`Completion::take_region`], ...). A failed completion is returned as is (check
    /// [`Completion::status`]). Dropping the future at any point is sound (see [`Op`]).
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send) (the request's buffers are dropped; use `post_send` to
    /// get them back), or a reactor / `ibv_poll_cq()` failure.
    #[doc(alias = "ibv_post_send")]
    pub async fn send(&self, wr: SendRequest<'_>) -> Result<Completion> {
        self.post_send(wr).map_err(to_error)?.await
    }

    /// An RDMA Write of `local` to `remote` (`IBV_WR_RDMA_WRITE`), awaited. See [`send`](Self::send).
    ///
    /// # Errors
    /// As [`send`](Self::send).
    #[doc(alias = "ibv_post_send")]
    pub async fn write(&self, local: Local, remote: RemoteSlice) -> Result<Completion> {
        self.send(SendRequest::write(local, remote)).await
    }

    /// An RDMA Read of `remote` into `local` (`IBV_WR_RDMA_READ`), awaited. See [`send`](Self::send).
    ///
    /// # Errors
    /// As [`send`](Self::send).
    #[doc(alias = "ibv_post_send")]
    pub async fn read(&self, local: Local, remote: RemoteSlice) -> Result<Completion> {
        self.send(SendRequest::read(local, remote)).await
    }

    /// Posts a receive (`ibv_post_recv()`) and waits for the message. Dropping the future is
    /// sound: the buffer stays posted and the message that lands in it is dropped with it.
    ///
    /// # Errors
    /// As [`post_recv`](Self::post_recv), or a reactor / `ibv_poll_cq()` failure.
    #[doc(alias = "ibv_post_recv")]
    pub async fn recv(&self, wr: RecvRequest) -> Result<Completion> {
        self.post_recv(wr).map_err(to_error)?.await
    }

    /// Send-queue requests the queue pair still holds (posted, completion not yet polled).
    pub fn outstanding_sends(&self) -> u32 {
        self.lock_qp().outstanding_sends()
    }

    /// Receives the queue pair still holds.
    pub fn outstanding_recvs(&self) -> u32 {
        self.lock_qp().outstanding_recvs()
    }

    /// Takes the queue pair back, once no [`Op`] of it is left (`Err(self)` while one is).
    /// Requests still outstanding (of dropped futures) stay posted; the driver drops their
    /// completions.
    ///
    /// # Errors
    /// `self`, when an `Op` of this queue pair is still alive.
    #[allow(clippy::result_large_err)] // self comes back by value
    pub fn into_inner(self) -> std::result::Result<QueuePair, Self> {
        match Arc::try_unwrap(self.qp) {
            Ok(QpCell { qp, mut reaper }) => {
                // Its abandoned operations' requests stay posted: their slots stay taken until
                // their completions come (the driver drops them then). Its queues' orders go.
                if let Some(shared) = reaper.shared.take() {
                    shared.lock().close_queues(reaper.queues);
                }
                Ok(qp.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner))
            }
            Err(qp) => Err(AsyncQueuePair { qp, detached: self.detached, driver: self.driver }),
        }
    }
}

#[cfg(test)]
mod tests {
    /// A future is moved whole (into the task, through every `async fn` that awaits it): an
    /// `Op` stays a handful of words, its rare kept completion boxed.
    #[test]
    fn an_operation_future_is_a_few_words() {
        assert!(std::mem::size_of::<super::Op>() <= 48, "{}", std::mem::size_of::<super::Op>());
        assert!(std::mem::size_of::<crate::queue::Completion>() > 100);
    }
}
