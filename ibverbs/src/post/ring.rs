//! The slot ring of one work queue: what keeps posted buffers alive until their completion.
//!
//! Each work queue of a [`QueuePair`](crate::QueuePair) has one [`Ring`]: a single-producer (the
//! poster, who holds `&mut QueuePair`), single-consumer (the poller, who holds
//! `&mut CompletionQueue`) ring of slots, sized to the queue's depth when the QP is created.
//! A slot at position `p` holds what request `p` keeps alive; the `wr_id` handed to the device
//! names the ring (its key in the CQ's [`Registry`](super::registry::Registry)) and `p`. Work
//! queues complete in order, so a completion at `p` also completes every earlier position
//! (unsignaled sends).
//!
//! The ring is generic over the slot's content so that its logic is tested under Miri with
//! values of the tests' own choosing (e.g. values whose `Drop` panics).

use std::any::Any;
use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};

/// Bit 63 of a device `wr_id`: set on every work request posted through the safe level.
pub(crate) const TAG: u64 = 1 << 63;
/// Bit 62: the request is on a receive queue.
pub(crate) const RECV: u64 = 1 << 62;

/// The ring's queue pair is alive: the device may use the buffers of outstanding slots.
pub(crate) const LIVE: u8 = 0;
/// The queue pair was destroyed (or reset): the device no longer touches the buffers, but
/// completions naming the ring may still sit in the completion queue.
pub(crate) const RETIRED: u8 = 1;
/// The consumer has released the ring's slots and waits to see the completion queue empty
/// before it reuses the ring's registry index and gives its room back.
pub(crate) const DRAINING: u8 = 2;
/// The ring never reached the device: its room is back, and the consumer takes it out of the
/// table at its next poll.
pub(crate) const UNUSED: u8 = 3;

/// Releases position `.1` of a ring (stores `tail = .1 + 1`) when dropped, on return or on
/// unwind: until then the producer cannot reuse the slot (it writes only positions below
/// `tail + cap`).
struct Release<'a>(&'a AtomicU32, u32);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.store(self.1.wrapping_add(1), Ordering::Release);
    }
}

/// What a panic carries ([`std::panic::catch_unwind`]'s error).
pub(crate) type Payload = Box<dyn Any + Send + 'static>;

/// Keeps the first of the panics caught in a sequence of drops (the one resumed once the
/// sequence is done): a later payload is dropped ([`drop_payload`]).
pub(crate) fn keep_first(kept: &mut Option<Payload>, payload: Payload) {
    if kept.is_none() {
        *kept = Some(payload);
    } else {
        drop_payload(payload);
    }
}

/// Drops the payload of a panic that will not be resumed, leaking it should that drop, which
/// runs the payload's own code, panic too.
pub(crate) fn drop_payload(payload: Payload) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}

/// A panic caught while the consumer takes completions: the drop of a slot released by a later
/// completion ([`Ring::complete_in_place`]) runs the user's code (an
/// [`OwnedBuffer`](crate::OwnedBuffer)'s free callback). Unwinding from there would lose the
/// completions of the poll's batch already taken from the device; instead the poll finishes
/// its batch, keeps its completions for the next polls and then resumes the panic (see
/// `CompletionQueue::poll`). Touched only by the consumer.
pub(crate) struct Deferred(UnsafeCell<Option<Payload>>);

// SAFETY: the cell is read and written only by the consumer (every accessor is an `unsafe fn`
// whose contract says so), and one thread at a time is the consumer: it holds
// `&mut CompletionQueue`. The payload it holds is `Send`.
unsafe impl Sync for Deferred {}

impl Deferred {
    pub(crate) const fn new() -> Deferred {
        Deferred(UnsafeCell::new(None))
    }

    /// Consumer: runs `f`, catching its panic. The first payload is kept ([`keep_first`]).
    ///
    /// # Safety
    /// Called only by the consumer.
    pub(crate) unsafe fn catch(&self, f: impl FnOnce()) {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(f)) {
            // SAFETY: the consumer alone touches the cell (contract); nothing else reaches it
            // while the reference lives (a payload's drop, run by `keep_first`, cannot: the
            // cell is the crate's).
            keep_first(unsafe { &mut *self.0.get() }, payload);
        }
    }

    /// Consumer: whether a panic waits to be resumed.
    ///
    /// # Safety
    /// Called only by the consumer.
    #[inline(always)]
    pub(crate) unsafe fn is_set(&self) -> bool {
        // SAFETY: the consumer alone touches the cell (contract).
        unsafe { (*self.0.get()).is_some() }
    }

    /// Consumer: takes the panic that waits to be resumed.
    ///
    /// # Safety
    /// Called only by the consumer.
    pub(crate) unsafe fn take(&self) -> Option<Payload> {
        // SAFETY: the consumer alone touches the cell (contract).
        unsafe { (*self.0.get()).take() }
    }
}

/// How a ring drops an outstanding slot where it lies, when a later completion releases it.
pub(crate) trait SlotValue: Sized {
    /// Drops the value at `p` (by default, all of it: `ptr::drop_in_place`). An override may
    /// skip parts it knows hold nothing to drop, or leak the rest if a drop unwinds; it never
    /// drops a part twice.
    ///
    /// # Safety
    /// `p` points to an initialised value that is not used again.
    #[inline]
    unsafe fn drop_slot(p: *mut Self) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::drop_in_place(p) }
    }
}

pub(crate) struct Ring<T> {
    /// A power of two at least `cap` long, so a position maps to its slot with a mask.
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
    mask: u32,
    /// Most positions outstanding at once: the work queue's depth.
    cap: u32,
    /// Next position the producer fills. Written only by the producer.
    head: AtomicU32,
    /// Oldest position not yet released. Written only by the consumer.
    tail: AtomicU32,
    /// One past the position last written with something to drop (a *heavy* slot; see
    /// [`write_in_place`](Self::write_in_place)), or 0. Written only by the producer, before
    /// the `head` store that publishes the slot; read by the consumer after its `Acquire` load
    /// of `head`, so it is never older than the slots the consumer sees.
    last_heavy: AtomicU32,
    /// `TAG`, `RECV` if a receive queue, and the registry key in bits 32..62.
    wr_id_base: u64,
    /// [`LIVE`], [`RETIRED`], [`DRAINING`] or [`UNUSED`].
    pub(crate) state: AtomicU8,
    /// Once retired: the CQ room the ring keeps until the CQ is seen empty, an upper bound of
    /// its completions that can still be in the CQ (its outstanding positions when retired).
    pub(crate) kept: AtomicU32,
}

// SAFETY: slots are accessed by exactly one producer (holding &mut QueuePair) and one consumer
// (holding &mut CompletionQueue, or dropping the last Arc): the producer writes only free slots
// (positions >= head, with head - tail < cap), publishes them with a Release store of head, and the
// consumer reads only positions in [tail, head) after an Acquire load of head, releasing them with a
// Release store of tail. The slot contents are sent between those threads, hence `T: Send`.
unsafe impl<T: Send> Send for Ring<T> {}
// SAFETY: as above; shared references only reach the slots through the producer/consumer
// protocol, never concurrently with each other for one slot.
unsafe impl<T: Send> Sync for Ring<T> {}

impl<T> Ring<T> {
    /// A ring of `cap` slots (clamped to `1..=2^30`) whose device `wr_id`s start with
    /// `wr_id_base`.
    pub(crate) fn new(cap: u32, wr_id_base: u64) -> Ring<T> {
        let cap = cap.clamp(1, 1 << 30);
        let len = cap.next_power_of_two();
        let slots = (0..len).map(|_| UnsafeCell::new(MaybeUninit::uninit())).collect();
        Ring {
            slots,
            mask: len - 1,
            cap,
            head: AtomicU32::new(0),
            tail: AtomicU32::new(0),
            last_heavy: AtomicU32::new(0),
            wr_id_base,
            state: AtomicU8::new(LIVE),
            kept: AtomicU32::new(0),
        }
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.cap
    }

    /// The high bits every device `wr_id` of this ring carries.
    pub(crate) fn wr_id_base(&self) -> u64 {
        self.wr_id_base
    }

    /// Number of posted, unreleased work requests.
    pub(crate) fn outstanding(&self) -> u32 {
        self.head.load(Ordering::Acquire).wrapping_sub(self.tail.load(Ordering::Acquire))
    }

    /// Whether a position before `end` is still outstanding, where `end` is a value `head` had
    /// (a scope's position after its last request). Never `false` while one is: such a
    /// position `p` has `tail <= p < end <= head`, so `head - end < head - tail <= cap` without
    /// wrapping. (After 2^32 more posts a stale `end` may read as pending while nothing before it
    /// is: a longer wait, never an early end.)
    pub(crate) fn pending_before(&self, end: u32) -> bool {
        let head = self.head.load(Ordering::Acquire);
        let tail = self.tail.load(Ordering::Acquire);
        head.wrapping_sub(tail) > head.wrapping_sub(end)
    }

    /// Producer: the position the next push gets, and how many slots are free.
    pub(crate) fn producer_state(&self) -> (u32, u32) {
        let head = self.head.load(Ordering::Relaxed);
        let used = head.wrapping_sub(self.tail.load(Ordering::Acquire));
        (head, self.cap - used.min(self.cap))
    }

    /// The `wr_id` the device gets for position `pos`.
    pub(crate) fn device_wr_id(&self, pos: u32) -> u64 {
        self.wr_id_base | u64::from(pos)
    }

    fn slot(&self, pos: u32) -> *mut MaybeUninit<T> {
        // Positions in [tail, tail + cap) map to distinct slots: cap <= slots.len(), a power of two
        // that divides 2^32, so the mapping also survives the wrap-around of u32 positions.
        let i = (pos & self.mask) as usize;
        debug_assert!(i < self.slots.len());
        // SAFETY: slots.len() == mask + 1 (see new), so i <= mask is in bounds (unchecked: this
        // is on every post and every release).
        unsafe { self.slots.get_unchecked(i) }.get()
    }

    /// Producer: fills the slot at `pos` (a heavy slot: see
    /// [`write_in_place`](Self::write_in_place)).
    ///
    /// # Safety
    /// Called only by the producer, for a position in `[head, tail + cap)` not yet written.
    pub(crate) unsafe fn write(&self, pos: u32, value: T) {
        self.last_heavy.store(pos.wrapping_add(1), Ordering::Relaxed);
        // SAFETY: the slot is free (contract) so nobody else accesses it.
        unsafe { (*self.slot(pos)).write(value) };
    }

    /// Producer: fills the slot at `pos` where it lies: `init` gets a pointer to the
    /// uninitialised slot (a large value built elsewhere and moved in is a `memcpy` call).
    ///
    /// `heavy` is whether the value may hold something to drop. A light slot (`false`: its
    /// [`SlotValue::drop_slot`] would do nothing, e.g. a prepared post's) is released without
    /// being looked at when a later completion releases it with the slots before it: while no
    /// heavy slot is outstanding, releasing any number of unsignaled posts is one store. A slot
    /// wrongly written as light would at worst be leaked, never dropped twice or read.
    ///
    /// # Safety
    /// As [`write`](Self::write); `init` initialises the value (every field; a `Slot`'s buffer
    /// entries as `SlotBufs` requires) and does not keep the pointer.
    #[inline]
    pub(crate) unsafe fn write_in_place(&self, pos: u32, heavy: bool, init: impl FnOnce(*mut T)) {
        if heavy {
            self.last_heavy.store(pos.wrapping_add(1), Ordering::Relaxed);
        }
        // The slot is free (contract) so nobody else accesses it.
        init(self.slot(pos).cast::<T>());
    }

    /// Producer: the slots' address and mask, read once for a loop that writes light slots
    /// (see [`write_in_place`](Self::write_in_place)) at many positions: the loop's stores
    /// through raw pointers would otherwise have the compiler load both again for each slot.
    #[inline]
    pub(crate) fn light_writer(&self) -> LightWriter<'_, T> {
        LightWriter { slots: self.slots.as_ptr(), mask: self.mask, _ring: PhantomData }
    }

    /// Consumer: whether no heavy slot can be outstanding at or after `tail`, a position the
    /// consumer has not released yet. Conservative: `false` whenever the last heavy slot written
    /// lies in `[tail, tail + cap)`, which every outstanding slot does (and every slot the
    /// producer may be writing: below `tail + cap`). Heavy slots are written in position order,
    /// so when the last one is before `tail`, all are. (After 2^32 positions without a heavy
    /// slot, a stale mark may alias into the window again: a slower release, never a missed
    /// drop.)
    #[inline]
    fn light_from(&self, tail: u32) -> bool {
        let since = self.last_heavy.load(Ordering::Relaxed).wrapping_sub(tail);
        since == 0 || since > self.cap
    }

    /// Producer: takes back the slot at `pos` (a request that was not posted after all).
    ///
    /// # Safety
    /// Called only by the producer, for a position it wrote and withdrew with
    /// [`set_head`](Self::set_head) before the consumer could see it.
    pub(crate) unsafe fn take_back(&self, pos: u32) -> T {
        // SAFETY: written by the producer and never seen by the consumer (contract).
        unsafe { (*self.slot(pos)).assume_init_read() }
    }

    /// Producer: makes positions below `head` visible to the consumer (or, with a lower value,
    /// withdraws positions that were not posted).
    pub(crate) fn set_head(&self, head: u32) {
        self.head.store(head, Ordering::Release);
    }

    /// Consumer: moves the oldest outstanding slot out and releases its position.
    ///
    /// # Safety
    /// Called only by the consumer, with `tail != head`.
    #[inline]
    unsafe fn pop(&self, tail: u32) -> T {
        // SAFETY: tail is in [tail, head): published and unreleased, ours to take (contract).
        let value = unsafe { (*self.slot(tail)).assume_init_read() };
        // Released before the value is dropped: if its drop unwinds, the slot is not dropped
        // a second time by a later release.
        self.tail.store(tail.wrapping_add(1), Ordering::Release);
        value
    }

    /// Consumer (or last owner): drops every outstanding slot. Panic-safe like
    /// [`complete`](Self::complete).
    ///
    /// # Safety
    /// Called only by the consumer, and only once the device no longer accesses the buffers
    /// (the QP is destroyed or reset).
    pub(crate) unsafe fn release_all(&self) {
        let head = self.head.load(Ordering::Acquire);
        let mut tail = self.tail.load(Ordering::Relaxed);
        while tail != head {
            // SAFETY: consumer; [tail, head) are published and unreleased.
            drop(unsafe { self.pop(tail) });
            tail = tail.wrapping_add(1);
        }
    }
}

impl<T: SlotValue> Ring<T> {
    /// Consumer: drops the oldest outstanding slot where it lies (no move out of the ring) and
    /// then releases its position. If the drop unwinds, the position is released all the same
    /// (the value counts as dropped: it is never dropped again).
    ///
    /// # Safety
    /// Called only by the consumer, with `tail != head`.
    #[inline]
    unsafe fn drop_oldest(&self, tail: u32) {
        let _release = Release(&self.tail, tail);
        // SAFETY: tail is in [tail, head): published and unreleased, ours to drop (contract);
        // the guard releases the position only after the drop, so nobody else touches it
        // meanwhile.
        unsafe { T::drop_slot(self.slot(tail).cast::<T>()) };
    }

    /// Consumer: drops the slots of `[tail, end)` in order, releasing each (see
    /// [`drop_oldest`](Self::drop_oldest)); out of line, off the path of a completion that
    /// releases only light slots. A drop that panics is caught into `deferred` and the range
    /// goes on: every slot of it is dropped (once) and released.
    ///
    /// # Safety
    /// Called only by the consumer (of the ring and of `deferred`), with `tail` the ring's tail
    /// and `end` an outstanding position (or `head`).
    #[inline(never)]
    unsafe fn drop_range(&self, mut tail: u32, end: u32, deferred: &Deferred) {
        while tail != end {
            // SAFETY: consumer (contract); tail != end, so tail != head: `drop_oldest` drops
            // and releases it, on return or unwind, so the next turn's `tail` is the ring's.
            unsafe { deferred.catch(|| self.drop_oldest(tail)) };
            tail = tail.wrapping_add(1);
        }
    }

    /// Consumer (the tests' form of [`complete_in_place`](Self::complete_in_place), moving the
    /// slot out whole): releases every position up to and including `pos`, returning the slot of `pos`
    /// and dropping the earlier ones (unsignaled requests completed by this one). Returns `None`
    /// (and releases nothing) when `pos` is not outstanding: a stale or foreign `wr_id`.
    ///
    /// If dropping an earlier slot panics, the panic is resumed once every earlier slot was
    /// dropped and `pos` taken (and dropped by the unwinding): each slot is dropped once.
    ///
    /// # Safety
    /// Called only by the consumer of this ring.
    #[cfg(test)]
    pub(crate) unsafe fn complete(&self, pos: u32) -> Option<T> {
        let deferred = Deferred::new();
        // SAFETY: consumer (contract); `deferred` is ours.
        let slot = unsafe { self.complete_deferring(pos, &deferred) };
        // SAFETY: ours.
        if let Some(payload) = unsafe { deferred.take() } {
            std::panic::resume_unwind(payload)
        }
        slot
    }

    /// [`complete`](Self::complete) with the panic of an earlier slot's drop caught into
    /// `deferred`.
    ///
    /// # Safety
    /// As [`complete_in_place`](Self::complete_in_place).
    #[cfg(test)]
    pub(crate) unsafe fn complete_deferring(&self, pos: u32, deferred: &Deferred) -> Option<T> {
        // SAFETY: consumer (contract); the value is moved out whole.
        unsafe { self.complete_in_place(pos, deferred, |slot| slot.read()) }
    }

    /// Consumer: the oldest unreleased position when `pos` is outstanding (posted, not yet
    /// released), else `None` (a stale or foreign position). Its `head` load (Acquire) orders
    /// the loads that follow after the producer's writes of every slot up to `pos`.
    #[inline(always)]
    fn outstanding_tail(&self, pos: u32) -> Option<u32> {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        (pos.wrapping_sub(tail) < head.wrapping_sub(tail)).then_some(tail)
    }

    /// Consumer: whether releasing the outstanding positions `[tail, pos)` with `pos` drops
    /// nothing (there are none, or none can be heavy): after
    /// [`outstanding_tail`](Self::outstanding_tail) gave `tail`.
    #[inline(always)]
    fn releases_nothing(&self, tail: u32, pos: u32) -> bool {
        tail == pos || self.light_from(tail)
    }

    /// Consumer: [`complete`](Self::complete), but the slot of `pos` is handed to `take` where
    /// it lies, as a pointer to the initialised value, instead of being moved out whole (a move
    /// of a large slot is a `memcpy` call); its position is released once `take` returns (or
    /// unwinds: what `take` left unread is then leaked, never dropped twice).
    ///
    /// A panic of an earlier slot's drop is caught into `deferred`, for the poll to resume once
    /// it has kept its batch's completions: the other earlier slots are still dropped and
    /// `pos` is still handed to `take`, each once.
    ///
    /// # Safety
    /// Called only by the consumer of this ring and of `deferred`; `take` moves out (reads
    /// once) every field that needs dropping and does not keep the pointer.
    // Always: on every completion polled; outlined, its call, prologue and epilogue cost ~16
    // instructions per completion (callgrind, `POST_POLL_BATCH=Safe`).
    #[inline(always)]
    pub(crate) unsafe fn complete_in_place<R>(
        &self,
        pos: u32,
        deferred: &Deferred,
        take: impl FnOnce(*mut T) -> R,
    ) -> Option<R> {
        let tail = self.outstanding_tail(pos)?;
        // When nothing in [tail, pos) can hold anything to drop, those positions are released
        // by the guard below with `pos`.
        if !self.releases_nothing(tail, pos) {
            // SAFETY: consumer (contract); [tail, pos) are outstanding (pos is).
            unsafe { self.drop_range(tail, pos, deferred) };
        }
        let _release = Release(&self.tail, pos);
        // The slot is outstanding and unreleased until the guard drops: ours alone.
        Some(take(self.slot(pos).cast::<T>()))
    }

    /// Consumer: [`complete_in_place`](Self::complete_in_place)'s common case, which drops
    /// nothing and calls nothing: when `pos` is outstanding and the positions before it (the
    /// unsignaled requests it completes) hold nothing to drop, the slot of `pos` is handed to
    /// `take` where it lies; if `take` takes it (returns `Some`, having moved out every field
    /// that needs dropping), the positions up to and including `pos` are released. Otherwise
    /// (`pos` not outstanding, earlier slots to drop, or `take` declining, having read nothing
    /// out) nothing changes and `None` comes back: `complete_in_place` does the rest.
    ///
    /// # Safety
    /// Called only by the consumer of this ring; `take`, when it returns `Some`, moved out
    /// (read once) every field that needs dropping, and it does not keep the pointer.
    #[inline(always)]
    pub(crate) unsafe fn complete_quiet<R>(
        &self,
        pos: u32,
        take: impl FnOnce(*mut T) -> Option<R>,
    ) -> Option<R> {
        let tail = self.outstanding_tail(pos)?;
        if !self.releases_nothing(tail, pos) {
            return None;
        }
        // Outstanding and unreleased: ours alone until the store below (no unwinding: `take`
        // of a `Some` moved the fields out, and a `None` read nothing).
        let taken = take(self.slot(pos).cast::<T>())?;
        self.tail.store(pos.wrapping_add(1), Ordering::Release);
        Some(taken)
    }
}

/// [`Ring::light_writer`]: writes light slots where they lie.
pub(crate) struct LightWriter<'r, T> {
    slots: *const UnsafeCell<MaybeUninit<T>>,
    mask: u32,
    _ring: PhantomData<&'r Ring<T>>,
}

impl<T> LightWriter<'_, T> {
    /// Producer: [`Ring::write_in_place`] of a light slot at `pos`.
    ///
    /// # Safety
    /// As [`Ring::write_in_place`] with `heavy` false: the producer, a free position, and
    /// `init` initialises the value (every field; a `Slot`'s buffer entries as `SlotBufs`
    /// requires), puts nothing to drop in it and does not keep the pointer.
    #[inline]
    pub(crate) unsafe fn write(&self, pos: u32, init: impl FnOnce(*mut T)) {
        let i = (pos & self.mask) as usize;
        // SAFETY: i <= mask < the slots' length (as in `Ring::slot`); the ring outlives `self`.
        init(unsafe { (*self.slots.add(i)).get() }.cast::<T>());
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        // SAFETY: the last owner; a ring is dropped only by its registry after its QP was
        // destroyed or reset (a QP whose destroy fails leaks its ring on purpose), or when
        // its registration failed before any post.
        unsafe { self.release_all() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    impl SlotValue for u64 {}

    #[test]
    fn keep_first_keeps_the_first_panic_and_drops_the_later_ones() {
        use std::sync::atomic::AtomicU32;
        use std::sync::Arc;
        struct Counted(Arc<AtomicU32>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let drops = Arc::new(AtomicU32::new(0));
        let mut kept = None;
        keep_first(&mut kept, Box::new(1u32));
        keep_first(&mut kept, Box::new(Counted(drops.clone())));
        keep_first(&mut kept, Box::new(Counted(drops.clone())));
        assert_eq!(drops.load(Ordering::SeqCst), 2, "later payloads are dropped at once");
        assert_eq!(kept.and_then(|p| p.downcast::<u32>().ok()).map(|b| *b), Some(1));
    }

    #[test]
    fn completes_in_order_and_releases_earlier_slots() {
        let ring = Ring::<u64>::new(4, TAG);
        assert_eq!(ring.producer_state(), (0, 4));
        for i in 0..3 {
            // SAFETY: producer, free positions.
            unsafe { ring.write(i, 100 + u64::from(i)) };
        }
        ring.set_head(3);
        assert_eq!(ring.producer_state().1, 1);
        // SAFETY: single consumer in this test.
        unsafe {
            assert_eq!(ring.complete(1), Some(101)); // releases 0 too
            assert_eq!(ring.outstanding(), 1);
            assert_eq!(ring.complete(1), None, "a stale position is ignored");
            assert_eq!(ring.complete(7), None, "a position never posted is ignored");
            assert_eq!(ring.complete(2), Some(102));
        }
        assert_eq!(ring.producer_state(), (3, 4));
        assert_eq!(ring.device_wr_id(5), TAG | 5);
    }

    #[test]
    fn the_quiet_completion_takes_only_what_releases_nothing_to_drop() {
        let ring = Ring::<u64>::new(8, TAG);
        // SAFETY: producer, free positions: 0 and 1 heavy, 2 and 3 light.
        unsafe {
            ring.write(0, 10);
            ring.write(1, 11);
            ring.write_in_place(2, false, |p| p.write(12));
            ring.write_in_place(3, false, |p| p.write(13));
        }
        ring.set_head(4);
        let take = |p: *mut u64| {
            // SAFETY: the slot handed over is initialised.
            Some(unsafe { p.read() })
        };
        // SAFETY: single consumer in this test.
        unsafe {
            assert_eq!(ring.complete_quiet(1, take), None, "a heavy slot before it: declined");
            assert_eq!(ring.outstanding(), 4, "and nothing released");
            assert_eq!(ring.complete_quiet(0, take), Some(10));
            assert_eq!(ring.complete_quiet(1, |_| None::<u64>), None, "take declined");
            assert_eq!(ring.outstanding(), 3, "and nothing released");
            assert_eq!(ring.complete_quiet(1, take), Some(11));
            assert_eq!(ring.complete_quiet(3, take), Some(13), "releases the light slot 2 with it");
            assert_eq!(ring.outstanding(), 0);
            assert_eq!(ring.complete_quiet(3, take), None, "a stale position");
            assert_eq!(ring.complete_quiet(7, take), None, "a position never posted");
        }
        assert_eq!(ring.producer_state(), (4, 8));
    }

    #[test]
    fn positions_wrap() {
        let ring = Ring::<u64>::new(2, 0);
        let mut pos = u32::MAX - 1;
        ring.head.store(pos, Ordering::Relaxed);
        ring.tail.store(pos, Ordering::Relaxed);
        for round in 0..4u64 {
            // SAFETY: producer/consumer in one thread, free slot.
            unsafe {
                ring.write(pos, round);
                ring.set_head(pos.wrapping_add(1));
                assert_eq!(ring.complete(pos), Some(round));
            }
            pos = pos.wrapping_add(1);
        }
    }

    #[test]
    fn a_full_ring_of_odd_depth_wraps_without_slot_collisions() {
        // Depth 3 does not divide 2^32: positions u32::MAX - 1, u32::MAX, 0 must use 3 slots.
        let ring = Ring::<u64>::new(3, 0);
        let start = u32::MAX - 1;
        ring.head.store(start, Ordering::Relaxed);
        ring.tail.store(start, Ordering::Relaxed);
        for k in 0..3u32 {
            let pos = start.wrapping_add(k);
            // SAFETY: producer, free positions (3 outstanding at most).
            unsafe { ring.write(pos, u64::from(k)) };
            ring.set_head(pos.wrapping_add(1));
        }
        assert_eq!(ring.producer_state().1, 0, "full");
        for k in 0..3u32 {
            // SAFETY: single consumer.
            assert_eq!(unsafe { ring.complete(start.wrapping_add(k)) }, Some(u64::from(k)));
        }
    }

    #[test]
    fn pending_before_tracks_the_positions_a_scope_posted_across_the_wrap() {
        for start in [0u32, u32::MAX - 2] {
            let ring = Ring::<u64>::new(4, 0);
            ring.head.store(start, Ordering::Relaxed);
            ring.tail.store(start, Ordering::Relaxed);
            assert!(!ring.pending_before(start), "nothing posted");
            for k in 0..3u32 {
                // SAFETY: producer, free positions.
                unsafe { ring.write(start.wrapping_add(k), u64::from(k)) };
            }
            ring.set_head(start.wrapping_add(3));
            // A scope posted position start + 1 (end = start + 2); 0 and 2 are someone else's.
            let end = start.wrapping_add(2);
            assert!(ring.pending_before(end));
            // SAFETY: single consumer.
            unsafe {
                assert_eq!(ring.complete(start), Some(0));
                assert!(ring.pending_before(end), "position start + 1 is still out");
                assert_eq!(ring.complete(start.wrapping_add(1)), Some(1));
            }
            assert!(!ring.pending_before(end), "released, though a later position is out");
            assert!(ring.pending_before(start.wrapping_add(3)));
            // SAFETY: single consumer.
            assert_eq!(unsafe { ring.complete(start.wrapping_add(2)) }, Some(2));
            assert!(!ring.pending_before(start.wrapping_add(3)));
        }
    }

    #[test]
    fn a_later_completion_releases_a_scoped_position_before_it() {
        // Unsignaled requests: a completion at p releases every earlier position.
        let ring = Ring::<u64>::new(8, 0);
        for k in 0..5u32 {
            // SAFETY: producer, free positions.
            unsafe { ring.write(k, u64::from(k)) };
        }
        ring.set_head(5);
        assert!(ring.pending_before(2));
        // SAFETY: single consumer.
        assert_eq!(unsafe { ring.complete(4) }, Some(4));
        assert!(!ring.pending_before(2) && !ring.pending_before(5));
    }

    thread_local! {
        /// Drops per slot value of the running test (values own nothing on the heap, so a slot
        /// leaked on purpose leaks no memory).
        static DROPS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// Counts its drops; panics in drop when `panics` is set.
    struct Tracked {
        id: usize,
        panics: bool,
    }

    impl SlotValue for Tracked {}

    impl Drop for Tracked {
        fn drop(&mut self) {
            DROPS.with(|d| d.borrow_mut()[self.id] += 1);
            if self.panics {
                panic!("a user value's drop panicked");
            }
        }
    }

    fn drops() -> Vec<u32> {
        DROPS.with(|d| d.borrow().clone())
    }

    fn tracked_ring(n: u32, panicking: &[u32]) -> Ring<Tracked> {
        DROPS.with(|d| *d.borrow_mut() = vec![0; n as usize]);
        let ring = Ring::new(n, 0);
        for i in 0..n {
            let value = Tracked { id: i as usize, panics: panicking.contains(&i) };
            // SAFETY: producer, free positions.
            unsafe { ring.write(i, value) };
        }
        ring.set_head(n);
        ring
    }

    // Regression (soundness hole 5): a panicking drop of a released predecessor used to leave
    // `tail` behind, so the slots already dropped were dropped again by the next release.
    #[test]
    fn a_panicking_drop_during_complete_drops_nothing_twice() {
        let ring = tracked_ring(6, &[1]);
        // SAFETY: single consumer.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { ring.complete(3) }));
        assert!(r.is_err(), "the panic propagates");
        assert_eq!(drops(), [1, 1, 1, 1, 0, 0], "the range and 3 itself (unwound) dropped once");
        assert_eq!(ring.outstanding(), 2);
        drop(ring);
        assert_eq!(drops(), [1; 6], "every slot dropped exactly once");
    }

    // A panicking drop of a released predecessor does not stop the release: the later slots of
    // the range are dropped, the completed one is handed over, and the panic waits in
    // `deferred` for the poll to resume once it has kept its completions.
    #[test]
    fn a_panic_in_the_released_range_is_deferred_and_the_range_goes_on() {
        let ring = tracked_ring(8, &[1, 2]);
        let deferred = Deferred::new();
        // SAFETY: single consumer (of the ring and of `deferred`).
        unsafe {
            let four = ring.complete_deferring(4, &deferred).expect("outstanding");
            assert_eq!(four.id, 4);
            assert!(deferred.is_set(), "the first panic is kept");
            assert_eq!(drops(), [1, 1, 1, 1, 0, 0, 0, 0], "0..4 dropped once, 2's panic dropped");
            assert_eq!(ring.outstanding(), 3);
            let payload = deferred.take().expect("kept");
            assert_eq!(payload.downcast_ref::<&str>(), Some(&"a user value's drop panicked"));
            assert!(!deferred.is_set());
            drop(four);
            assert_eq!(ring.complete_deferring(7, &deferred).map(|t| t.id), Some(7));
            assert!(!deferred.is_set(), "no panic, nothing kept");
        }
        drop(ring);
        assert_eq!(drops(), [1; 8], "every slot dropped exactly once");
    }

    /// Writes `Tracked { id }` at `pos`, heavy or light.
    fn put(ring: &Ring<Tracked>, pos: u32, id: usize, heavy: bool) {
        // SAFETY: producer in this single-threaded test, free position; the value is
        // initialised whole.
        unsafe { ring.write_in_place(pos, heavy, |p| p.write(Tracked { id, panics: false })) };
    }

    #[test]
    fn light_slots_are_released_without_being_looked_at_and_heavy_ones_are_dropped() {
        // Positions wrap during the test. A light slot released with earlier ones is not
        // dropped (a `Tracked` owns nothing, so that is only seen in its drop count): that is
        // how the fast path shows.
        DROPS.with(|d| *d.borrow_mut() = vec![0; 13]);
        let ring = Ring::<Tracked>::new(4, 0);
        let start = u32::MAX - 2;
        ring.head.store(start, Ordering::Relaxed);
        ring.tail.store(start, Ordering::Relaxed);
        // As if the ring had come here through light slots only (a mark left at 0 would alias
        // into the window: slower, see `light_from`).
        ring.last_heavy.store(start, Ordering::Relaxed);
        let at = |k: u32| start.wrapping_add(k);
        // All light: one completion releases the three before it without dropping them.
        for k in 0..4 {
            put(&ring, at(k), k as usize, false);
        }
        ring.set_head(at(4));
        // SAFETY: single consumer.
        drop(unsafe { ring.complete(at(3)) });
        assert_eq!(drops()[..4], [0, 0, 0, 1]);
        assert_eq!(ring.outstanding(), 0);
        // A heavy slot among light ones: the slow path drops every slot before the completion.
        for k in 4..8 {
            put(&ring, at(k), k as usize, k == 5);
        }
        ring.set_head(at(8));
        // SAFETY: single consumer.
        drop(unsafe { ring.complete(at(6)) });
        assert_eq!(drops()[4..8], [1, 1, 1, 0]);
        // The heavy slot is released: light again, though it was the last heavy one written.
        put(&ring, at(8), 8, false);
        ring.set_head(at(9));
        // SAFETY: single consumer.
        drop(unsafe { ring.complete(at(8)) });
        assert_eq!(drops()[7..9], [0, 1]);
        // A heavy slot written and withdrawn (never published), then the position rewritten
        // light: conservatively slow until the consumer passes the mark, never a missed drop.
        put(&ring, at(9), 12, true);
        // SAFETY: producer; withdrawn before any publication.
        drop(unsafe { ring.take_back(at(9)) });
        assert_eq!(drops()[12], 1, "the withdrawn value is dropped by its taker");
        put(&ring, at(9), 9, false);
        put(&ring, at(10), 10, true);
        put(&ring, at(11), 11, false);
        ring.set_head(at(12));
        // SAFETY: single consumer.
        drop(unsafe { ring.complete(at(11)) });
        assert_eq!(drops()[9..12], [1, 1, 1]);
        assert_eq!(ring.outstanding(), 0);
        drop(ring);
        assert_eq!(drops(), [0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]);
    }

    #[test]
    fn a_panicking_drop_during_release_all_drops_nothing_twice() {
        let ring = tracked_ring(4, &[1, 2]);
        for _ in 0..2 {
            // SAFETY: single consumer; nothing else uses the values.
            let release = || unsafe { ring.release_all() };
            assert!(catch_unwind(AssertUnwindSafe(release)).is_err());
        }
        // SAFETY: as above.
        unsafe { ring.release_all() };
        drop(ring);
        assert_eq!(drops(), [1; 4], "every slot dropped exactly once");
    }

    #[test]
    fn a_panicking_drop_while_the_ring_is_dropped_leaks_instead_of_double_dropping() {
        let ring = tracked_ring(3, &[0]);
        assert!(catch_unwind(AssertUnwindSafe(move || drop(ring))).is_err());
        assert_eq!(drops(), [1, 0, 0], "the rest leaks: dropped never rather than twice");
    }
}
