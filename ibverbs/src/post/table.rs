//! The slot table of one shared receive queue: what keeps its posted buffers alive until their
//! completion, when completions come in any order and from several consumers.
//!
//! A [`Ring`](super::ring::Ring) assumes one consumer and in-order completion. A shared receive
//! queue has neither: any queue pair attached to it takes its next work request, those queue
//! pairs complete into different CQs (polled by different threads), and QP B's completion of the
//! second request can come before QP A's of the first. So each slot has its own state and
//! generation, and exactly one party takes a posted slot, by a CAS:
//!
//! ```text
//! FREE --producer claims its bit--> WRITING --producer publishes (Release)--> POSTED
//!   ^                                                                           |
//!   +--- winner stores FREE, gen + 1 (Release), sets the free bit <--- TAKEN <--+ CAS (AcqRel):
//!                                  a completion naming (index, gen), or the release after destroy
//! ```
//!
//! - The producer is the holder of `&mut SharedReceiveQueue`: the only one that claims free
//!   slots (it clears a bit of the free bitmap, `AtomicU64` words scanned from a cursor) and
//!   writes them. Consumers (each CQ's poller) only set bits.
//! - A device `wr_id` names the slot's index and generation. A completion takes the slot only if
//!   its CAS from `(gen, POSTED)` to `(gen, TAKEN)` succeeds: a stale or foreign `wr_id` (an older
//!   generation, a slot not posted) is skipped and never dereferenced.
//! - After `ibv_destroy_srq` succeeded, [`release_all`](SlotTable::release_all) takes every posted
//!   slot with the same CAS, so it may run while consumers on other threads still poll stale
//!   completions: each value goes to exactly one party, and is dropped at most once even when a
//!   drop panics (the slot is taken before the value is dropped).
//!
//! No lock, allocation or system call on post or completion. Generic over the slot's content so
//! the protocol is tested under Miri with the tests' own values.

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::ring::{RECV, TAG};

/// Bit 61 of a device `wr_id`: the request is on a shared receive queue (with [`TAG`] and
/// [`RECV`]); bits 32..61 then name the SRQ, bits 16..32 the slot's generation, bits 0..16 its
/// index.
pub(crate) const SRQ: u64 = 1 << 61;
/// Bits of the SRQ id in a `wr_id` (32..61).
pub(crate) const SRQ_ID_BITS: u32 = 29;
/// Most slots a table has: the index is 16 bits of the `wr_id`.
pub(crate) const MAX_SLOTS: u32 = 1 << 16;
/// The bits of a `wr_id` that name the SRQ.
pub(crate) const SRQ_ID_MASK: u64 = TAG | RECV | SRQ | (((1u64 << SRQ_ID_BITS) - 1) << 32);

const FREE: u32 = 0;
const WRITING: u32 = 1;
const POSTED: u32 = 2;
const TAKEN: u32 = 3;
const STATE_MASK: u32 = 3;
const GEN_SHIFT: u32 = 2;
const GEN_MASK: u32 = 0xffff;

fn word(gen: u32, state: u32) -> u32 {
    ((gen & GEN_MASK) << GEN_SHIFT) | state
}

fn gen_of(word: u32) -> u32 {
    (word >> GEN_SHIFT) & GEN_MASK
}

struct Entry<T> {
    /// Generation (16 bits) and state (2 bits).
    state: AtomicU32,
    value: UnsafeCell<MaybeUninit<T>>,
}

pub(crate) struct SlotTable<T> {
    slots: Box<[Entry<T>]>,
    /// Bit set = the slot is free for the producer to claim.
    free: Box<[AtomicU64]>,
    /// Where the producer's next scan starts (word index). Producer only.
    cursor: AtomicU32,
    /// Slots posted and not yet taken back (an upper bound while a take is in progress).
    posted: AtomicU32,
    /// `TAG | RECV | SRQ | id << 32`.
    base: u64,
}

// SAFETY: a slot's value is written only by the producer while the slot is WRITING (claimed
// through the bitmap, which only the producer clears), read only by the one party whose CAS moved
// it from POSTED to TAKEN (after the producer's Release store of POSTED, acquired by the CAS), and
// the slot is handed back to the producer by a Release store of FREE and a Release `fetch_or` of
// its bit, acquired by the producer's claiming `fetch_and`. Values move between threads: `T: Send`.
unsafe impl<T: Send> Send for SlotTable<T> {}
// SAFETY: as above: every access to a value is exclusive by that protocol.
unsafe impl<T: Send> Sync for SlotTable<T> {}

impl<T> SlotTable<T> {
    /// A table of `cap` slots (`1..=MAX_SLOTS`) for the SRQ `id` (kept to its low 29 bits).
    pub(crate) fn new(cap: u32, id: u32) -> SlotTable<T> {
        let cap = cap.clamp(1, MAX_SLOTS);
        let slots = (0..cap)
            .map(|_| Entry {
                state: AtomicU32::new(word(0, FREE)),
                value: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        let words = cap.div_ceil(64);
        let free = (0..words)
            .map(|w| {
                let left = cap - w * 64;
                AtomicU64::new(if left >= 64 { u64::MAX } else { (1u64 << left) - 1 })
            })
            .collect();
        let id = u64::from(id) & ((1 << SRQ_ID_BITS) - 1);
        SlotTable {
            slots,
            free,
            cursor: AtomicU32::new(0),
            posted: AtomicU32::new(0),
            base: TAG | RECV | SRQ | (id << 32),
        }
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    /// The bits every `wr_id` of this table carries.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Slots posted and not yet completed or released.
    pub(crate) fn outstanding(&self) -> u32 {
        self.posted.load(Ordering::Acquire).min(self.capacity())
    }

    /// Producer: claims a free slot (it becomes WRITING), or `None` when every slot is posted.
    ///
    /// # Safety
    /// Called only by the producer (the holder of `&mut SharedReceiveQueue`).
    pub(crate) unsafe fn claim(&self) -> Option<u32> {
        let words = self.free.len() as u32;
        let start = self.cursor.load(Ordering::Relaxed) % words;
        for k in 0..words {
            let w = (start + k) % words;
            let bits = self.free[w as usize].load(Ordering::Relaxed);
            if bits == 0 {
                continue;
            }
            let bit = bits.trailing_zeros();
            // Only the producer clears bits, so this one is still set; Acquire pairs with the
            // consumer's Release fetch_or that freed it.
            self.free[w as usize].fetch_and(!(1u64 << bit), Ordering::Acquire);
            self.cursor.store(w, Ordering::Relaxed);
            let idx = w * 64 + bit;
            let e = &self.slots[idx as usize];
            let gen = gen_of(e.state.load(Ordering::Acquire));
            e.state.store(word(gen, WRITING), Ordering::Relaxed);
            return Some(idx);
        }
        None
    }

    /// Producer: the `wr_id` a claimed slot will be published under.
    ///
    /// # Safety
    /// Called only by the producer, for a slot it claimed.
    pub(crate) unsafe fn wr_id_of(&self, idx: u32) -> u64 {
        let gen = gen_of(self.slots[idx as usize].state.load(Ordering::Relaxed));
        self.base | (u64::from(gen) << 16) | u64::from(idx)
    }

    /// Producer: fills a claimed slot and publishes it; returns the `wr_id` for the device.
    /// Publish *before* posting: the completion can be polled before the post returns.
    ///
    /// # Safety
    /// Called only by the producer, for a slot it claimed and has not published.
    pub(crate) unsafe fn publish(&self, idx: u32, value: T) -> u64 {
        let e = &self.slots[idx as usize];
        // SAFETY: WRITING: nobody else touches the value (contract).
        unsafe { (*e.value.get()).write(value) };
        let gen = gen_of(e.state.load(Ordering::Relaxed));
        self.posted.fetch_add(1, Ordering::AcqRel);
        e.state.store(word(gen, POSTED), Ordering::Release);
        self.base | (u64::from(gen) << 16) | u64::from(idx)
    }

    /// Producer: takes back a published slot the device never saw (its post failed) and frees it.
    ///
    /// # Safety
    /// Called only by the producer, for a slot it published whose `wr_id` the device did not
    /// accept (so no completion names it).
    pub(crate) unsafe fn withdraw(&self, idx: u32) -> Option<T> {
        let e = &self.slots[idx as usize];
        let cur = e.state.load(Ordering::Acquire);
        // SAFETY: the CAS makes us the slot's only taker.
        unsafe { self.take(e, idx, cur) }
    }

    /// Producer: frees a claimed slot that was never published.
    pub(crate) fn unclaim(&self, idx: u32) {
        let e = &self.slots[idx as usize];
        let gen = gen_of(e.state.load(Ordering::Relaxed));
        e.state.store(word(gen, FREE), Ordering::Release);
        self.free[(idx / 64) as usize].fetch_or(1 << (idx % 64), Ordering::Release);
    }

    /// Takes slot `idx` if its state word is still `cur` and POSTED: CAS to TAKEN, move the
    /// value out, store FREE with the next generation, set the free bit.
    ///
    /// # Safety
    /// A slot taken here must be one the device is done with (its completion was polled, or the
    /// SRQ was destroyed, or the device never saw it).
    unsafe fn take(&self, e: &Entry<T>, idx: u32, cur: u32) -> Option<T> {
        if cur & STATE_MASK != POSTED {
            return None;
        }
        let gen = gen_of(cur);
        e.state.compare_exchange(cur, word(gen, TAKEN), Ordering::AcqRel, Ordering::Relaxed).ok()?;
        // SAFETY: we won the CAS: the value was published (Acquire) and no one else takes it.
        let value = unsafe { (*e.value.get()).assume_init_read() };
        // Freed before the value is dropped by anyone: a panicking drop cannot make it be taken
        // twice.
        self.posted.fetch_sub(1, Ordering::AcqRel);
        e.state.store(word(gen.wrapping_add(1), FREE), Ordering::Release);
        self.free[(idx / 64) as usize].fetch_or(1 << (idx % 64), Ordering::Release);
        Some(value)
    }

    /// Consumer (any CQ's poller, any thread): takes the slot a polled completion names, or
    /// `None` for a `wr_id` of another table, an index out of range, a slot not posted or of
    /// another generation (a stale completion).
    pub(crate) fn complete(&self, wr_id: u64) -> Option<T> {
        if wr_id & SRQ_ID_MASK != self.base {
            return None;
        }
        let idx = (wr_id & 0xffff) as u32;
        let gen = ((wr_id >> 16) & 0xffff) as u32;
        let e = self.slots.get(idx as usize)?;
        // SAFETY: a polled completion: the device is done with this request's buffers.
        unsafe { self.take(e, idx, word(gen, POSTED)) }
    }

    /// Takes every posted slot and drops its value (any thread, concurrently with consumers).
    /// Panic-safe: a panicking drop propagates; slots not reached stay posted for a later call,
    /// and no value is dropped twice.
    ///
    /// # Safety
    /// Called only once the device no longer accesses the buffers (`ibv_destroy_srq` succeeded).
    pub(crate) unsafe fn release_all(&self) {
        for (idx, e) in self.slots.iter().enumerate() {
            let cur = e.state.load(Ordering::Acquire);
            // SAFETY: contract; a consumer racing us for this slot loses or wins the CAS.
            drop(unsafe { self.take(e, idx as u32, cur) });
        }
    }

    #[cfg(test)]
    fn set_generation(&self, idx: u32, gen: u32) {
        let e = &self.slots[idx as usize];
        let cur = e.state.load(Ordering::Relaxed);
        e.state.store(word(gen, cur & STATE_MASK), Ordering::Relaxed);
    }
}

impl<T> Drop for SlotTable<T> {
    fn drop(&mut self) {
        // SAFETY: the last owner. A table is dropped only after its SRQ was destroyed (an SRQ
        // whose destroy fails leaks its table on purpose), or when it never reached the device.
        unsafe { self.release_all() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    fn post(t: &SlotTable<u64>, v: u64) -> u64 {
        // SAFETY: the test is the only producer.
        unsafe {
            let idx = t.claim().expect("a free slot");
            t.publish(idx, v)
        }
    }

    #[test]
    fn srq_table_completes_out_of_order_and_skips_stale_ids() {
        let t = SlotTable::<u64>::new(4, 7);
        let ids: Vec<u64> = (0..4).map(|v| post(&t, v)).collect();
        // SAFETY: producer.
        assert_eq!(unsafe { t.claim() }, None, "full");
        assert_eq!(t.outstanding(), 4);
        assert_eq!(t.complete(ids[2]), Some(2), "out of order");
        assert_eq!(t.complete(ids[0]), Some(0));
        assert_eq!(t.complete(ids[2]), None, "a repeated wr_id is stale");
        let again = post(&t, 20);
        assert_ne!(again & 0xffff_ffff, ids[2] & 0xffff_ffff, "reused slots get a new generation");
        assert_eq!(t.complete(ids[0]), None, "stale after reuse");
        assert_eq!(t.complete(ids[2]), None, "stale after reuse");
        assert_eq!(t.complete(again), Some(20));
        assert_eq!(t.complete(ids[3]), Some(3));
        assert_eq!(t.complete(ids[1]), Some(1));
        assert_eq!(t.outstanding(), 0);
        let other = SlotTable::<u64>::new(4, 8);
        let foreign = post(&other, 5);
        assert_eq!(t.complete(foreign), None, "another SRQ's wr_id");
        assert_eq!(t.complete(t.base() | 0xfff0), None, "index out of range");
    }

    #[test]
    fn srq_table_generations_wrap() {
        let t = SlotTable::<u64>::new(1, 1);
        t.set_generation(0, 0xffff);
        let old = post(&t, 1);
        assert_eq!((old >> 16) & 0xffff, 0xffff);
        assert_eq!(t.complete(old), Some(1));
        let new = post(&t, 2);
        assert_eq!((new >> 16) & 0xffff, 0, "wrapped to 0");
        assert_eq!(t.complete(old), None);
        assert_eq!(t.complete(new), Some(2));
    }

    #[test]
    fn srq_table_withdraw_and_unclaim_free_the_slot() {
        let t = SlotTable::<u64>::new(1, 1);
        // SAFETY: producer; the device never saw these.
        unsafe {
            let i = t.claim().unwrap();
            t.unclaim(i);
            let i = t.claim().unwrap();
            let id = t.publish(i, 9);
            assert_eq!(t.withdraw(i), Some(9));
            assert_eq!(t.complete(id), None);
            assert!(t.claim().is_some());
        }
    }

    /// Counts drops of values; panics in drop when asked.
    struct Counted(Arc<AtomicUsize>, bool);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
            if self.1 {
                panic!("a user value's drop panicked");
            }
        }
    }

    #[test]
    fn srq_table_two_consumers_and_one_producer() {
        const N: u64 = if cfg!(miri) { 40 } else { 4000 };
        let t = Arc::new(SlotTable::<u64>::new(8, 3));
        let (tx_a, rx_a) = std::sync::mpsc::channel::<u64>();
        let (tx_b, rx_b) = std::sync::mpsc::channel::<u64>();
        let done = Arc::new(AtomicU64::new(0));
        let consumer = |rx: std::sync::mpsc::Receiver<u64>| {
            let t = t.clone();
            let done = done.clone();
            std::thread::spawn(move || {
                let mut sum = 0;
                for id in rx {
                    let v = t.complete(id).expect("a posted slot");
                    assert_eq!(t.complete(id), None);
                    sum += v;
                    done.fetch_add(1, Ordering::SeqCst);
                }
                sum
            })
        };
        let a = consumer(rx_a);
        let b = consumer(rx_b);
        let mut posted = 0;
        let mut v = 0;
        while v < N {
            if posted - done.load(Ordering::SeqCst) >= 8 {
                std::thread::yield_now();
                continue;
            }
            // SAFETY: the only producer.
            let id = match unsafe { t.claim() } {
                // SAFETY: claimed above.
                Some(i) => unsafe { t.publish(i, v) },
                None => continue, // a consumer is between its count and its free bit
            };
            // "Device": QP A or QP B takes the WR, completions reach different CQs.
            if v % 3 == 0 { &tx_a } else { &tx_b }.send(id).unwrap();
            posted += 1;
            v += 1;
        }
        drop((tx_a, tx_b));
        let sum = a.join().unwrap() + b.join().unwrap();
        assert_eq!(sum, N * (N - 1) / 2, "every value taken exactly once");
        assert_eq!(t.outstanding(), 0);
    }

    #[test]
    fn srq_table_release_all_races_a_consumer() {
        let drops = Arc::new(AtomicUsize::new(0));
        let t = Arc::new(SlotTable::<Counted>::new(16, 1));
        let mut ids = Vec::new();
        for _ in 0..16 {
            // SAFETY: the only producer.
            unsafe {
                let i = t.claim().unwrap();
                ids.push(t.publish(i, Counted(drops.clone(), false)));
            }
        }
        let t2 = t.clone();
        let consumer =
            std::thread::spawn(move || ids.iter().filter(|&&id| t2.complete(id).is_some()).count());
        // SAFETY: the "SRQ" is destroyed: the device is done with every buffer.
        unsafe { t.release_all() };
        let by_consumer = consumer.join().unwrap();
        assert!(by_consumer <= 16);
        assert_eq!(drops.load(Ordering::SeqCst), 16, "each value dropped exactly once");
        drop(t);
        assert_eq!(drops.load(Ordering::SeqCst), 16);
    }

    #[test]
    fn srq_table_a_panicking_drop_drops_nothing_twice() {
        let drops = Arc::new(AtomicUsize::new(0));
        let t = SlotTable::<Counted>::new(4, 1);
        for k in 0..4 {
            // SAFETY: the only producer.
            unsafe {
                let i = t.claim().unwrap();
                t.publish(i, Counted(drops.clone(), k == 1));
            }
        }
        // SAFETY: "destroyed".
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { t.release_all() }));
        assert!(r.is_err(), "the panic propagates");
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        // SAFETY: as above.
        unsafe { t.release_all() };
        assert_eq!(drops.load(Ordering::SeqCst), 4, "the rest, each once");
        drop(t);
        assert_eq!(drops.load(Ordering::SeqCst), 4);
    }
}
