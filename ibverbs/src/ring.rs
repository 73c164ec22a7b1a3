//! The slot rings that keep posted buffers alive until their completion (the safe posting level).
//!
//! Each work queue of a [`QueuePair`](crate::QueuePair) has one [`Ring`]: a single-producer
//! (the poster, who holds `&mut QueuePair`), single-consumer (the poller, who holds
//! `&mut CompletionQueue`) ring of slots, sized to the queue's capacity when the QP is created.
//! The `wr_id` handed to the device encodes the ring (its key in the completion queue's
//! [`Registry`]) and the slot position, so a completion finds its slot with two loads: no lock and
//! no hash lookup. Work queues complete in order, so a completion at position `p` also completes
//! every earlier position (unsignaled sends).

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
use std::sync::Arc;

use crate::ah::AhInner;
use crate::wr::{LocalBuf, MAX_SGE};

/// Bit 63 of a device `wr_id`: set on every work request posted through the safe level.
pub(crate) const TAG: u64 = 1 << 63;
/// Bit 62: the request is on a receive queue.
pub(crate) const RECV: u64 = 1 << 62;
/// Bits 32..62 hold the ring's registry key.
const KEY_BITS: u32 = 30;
const KEY_MASK: u32 = (1 << KEY_BITS) - 1;
/// The low 16 bits of a key are its registry index; the rest is a generation.
const INDEX_BITS: u32 = 16;
/// Most rings (queue pairs' work queues) one completion queue can serve at once.
pub(crate) const REGISTRY_CAPACITY: usize = 4096;

/// What a slot keeps alive for one posted work request.
pub(crate) struct Slot {
    pub(crate) wr_id: u64,
    pub(crate) bufs: [Option<LocalBuf>; MAX_SGE],
    /// Kept alive (never read) until the UD send completes.
    pub(crate) _ah: Option<Arc<AhInner>>,
}

pub(crate) struct Ring {
    /// A power of two at least `cap` long, so a position maps to its slot with a mask.
    slots: Box<[UnsafeCell<MaybeUninit<Slot>>]>,
    mask: u32,
    /// Most positions outstanding at once: the work queue's depth.
    cap: u32,
    /// Next position the producer fills. Written only by the producer.
    head: AtomicU32,
    /// Oldest position not yet released. Written only by the consumer.
    tail: AtomicU32,
    /// Set once the QP is destroyed (or reset): the device no longer touches these buffers.
    dead: AtomicBool,
    key: u32,
    recv: bool,
}

// SAFETY: slots are accessed by exactly one producer (holding &mut QueuePair) and one consumer
// (holding &mut CompletionQueue, or dropping the last Arc): the producer writes only free slots
// (positions >= head, with head - tail < cap), publishes them with a Release store of head, and the
// consumer reads only positions in [tail, head) after an Acquire load of head, releasing them with a
// Release store of tail. The buffers inside are Send + Sync.
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

impl Ring {
    pub(crate) fn new(cap: u32, recv: bool) -> Ring {
        let cap = cap.clamp(1, 1 << 30);
        let len = cap.next_power_of_two();
        let slots = (0..len).map(|_| UnsafeCell::new(MaybeUninit::uninit())).collect();
        Ring {
            slots,
            mask: len - 1,
            cap,
            head: AtomicU32::new(0),
            tail: AtomicU32::new(0),
            dead: AtomicBool::new(false),
            key: 0,
            recv,
        }
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.cap
    }

    /// Number of posted, unreleased work requests.
    pub(crate) fn outstanding(&self) -> u32 {
        self.head.load(Ordering::Acquire).wrapping_sub(self.tail.load(Ordering::Acquire))
    }

    /// Producer: the position the next push gets, and how many slots are free.
    pub(crate) fn producer_state(&self) -> (u32, u32) {
        let head = self.head.load(Ordering::Relaxed);
        let used = head.wrapping_sub(self.tail.load(Ordering::Acquire));
        (head, self.cap - used.min(self.cap))
    }

    /// The `wr_id` the device gets for position `pos`.
    pub(crate) fn device_wr_id(&self, pos: u32) -> u64 {
        TAG | if self.recv { RECV } else { 0 } | (u64::from(self.key) << 32) | u64::from(pos)
    }

    fn slot(&self, pos: u32) -> *mut MaybeUninit<Slot> {
        // Positions in [tail, tail + cap) map to distinct slots: cap <= slots.len(), a power of two
        // that divides 2^32, so the mapping also survives the wrap-around of u32 positions.
        self.slots[(pos & self.mask) as usize].get()
    }

    /// Producer: fills the slot at `pos`.
    ///
    /// # Safety
    /// Called only by the producer, for a position in `[head, tail + cap)` not yet written.
    pub(crate) unsafe fn write(&self, pos: u32, slot: Slot) {
        // SAFETY: the slot is free (contract) so nobody else accesses it.
        unsafe { (*self.slot(pos)).write(slot) };
    }

    /// Producer: takes back the slot at `pos` (a request that was not posted after all).
    ///
    /// # Safety
    /// Called only by the producer, for a position it wrote and did not leave published.
    pub(crate) unsafe fn take_back(&self, pos: u32) -> Slot {
        // SAFETY: written by the producer and never seen by the consumer (contract).
        unsafe { (*self.slot(pos)).assume_init_read() }
    }

    /// Producer: makes positions below `head` visible to the consumer (or, with a lower value,
    /// withdraws positions that were not posted).
    pub(crate) fn set_head(&self, head: u32) {
        self.head.store(head, Ordering::Release);
    }

    /// Consumer: releases every position up to and including `pos`, returning the slot of `pos`
    /// and dropping the earlier ones (unsignaled requests completed by this one). Returns `None`
    /// (and releases nothing) when `pos` is not outstanding: a stale or foreign `wr_id`.
    ///
    /// # Safety
    /// Called only by the consumer of this ring.
    pub(crate) unsafe fn complete(&self, pos: u32) -> Option<Slot> {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        let idx = pos.wrapping_sub(tail);
        if idx >= head.wrapping_sub(tail) {
            return None;
        }
        let mut t = tail;
        while t != pos {
            // SAFETY: t in [tail, pos) ⊂ [tail, head): published and unreleased, ours to take.
            drop(unsafe { (*self.slot(t)).assume_init_read() });
            t = t.wrapping_add(1);
        }
        // SAFETY: pos in [tail, head), as above.
        let slot = unsafe { (*self.slot(pos)).assume_init_read() };
        self.tail.store(pos.wrapping_add(1), Ordering::Release);
        Some(slot)
    }

    /// Consumer (or last owner): drops every outstanding slot.
    ///
    /// # Safety
    /// Called only by the consumer, and only once the device no longer accesses the buffers
    /// (the QP is destroyed or reset).
    unsafe fn release_all(&self) {
        let head = self.head.load(Ordering::Acquire);
        let mut t = self.tail.load(Ordering::Relaxed);
        while t != head {
            // SAFETY: [tail, head) are published and unreleased.
            drop(unsafe { (*self.slot(t)).assume_init_read() });
            t = t.wrapping_add(1);
        }
        self.tail.store(head, Ordering::Release);
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: the last owner; a ring is dropped only from the registry after its QP was
        // destroyed (a QP whose destroy failed leaks its ring on purpose), or unregistered after
        // a failed QP creation.
        unsafe { self.release_all() };
    }
}

/// The rings one completion queue serves, indexed by the key in their `wr_id`s.
pub(crate) struct Registry {
    entries: Box<[AtomicPtr<Ring>]>,
    generation: AtomicU32,
    /// Rings marked dead and not yet swept.
    dead: AtomicU32,
    /// Sum of the registered rings' capacities: completions that can be outstanding at once.
    reserved: AtomicU32,
    /// Completions the CQ holds.
    cq_capacity: u32,
}

/// Why a ring could not be registered.
pub(crate) enum RegisterError {
    /// The CQ cannot hold every completion its queue pairs could produce.
    CqTooSmall { needed: u64, capacity: u32 },
    /// All registry entries are taken.
    Full,
}

impl Registry {
    pub(crate) fn new(cq_capacity: u32) -> Registry {
        Registry {
            entries: (0..REGISTRY_CAPACITY).map(|_| AtomicPtr::new(ptr::null_mut())).collect(),
            generation: AtomicU32::new(1),
            dead: AtomicU32::new(0),
            reserved: AtomicU32::new(0),
            cq_capacity,
        }
    }

    /// Registers a new ring (any thread), reserving room for its completions in the CQ.
    /// The ring (of `cap` slots) is allocated only once the CQ is known to have room for it, so
    /// its size is bounded by a CQ the device accepted.
    pub(crate) fn register(&self, cap: u32, recv: bool) -> Result<Arc<Ring>, RegisterError> {
        let cap = cap.max(1);
        let prev = self.reserved.fetch_add(cap, Ordering::AcqRel);
        let needed = u64::from(prev) + u64::from(cap);
        if needed > u64::from(self.cq_capacity) {
            self.reserved.fetch_sub(cap, Ordering::AcqRel);
            return Err(RegisterError::CqTooSmall { needed, capacity: self.cq_capacity });
        }
        let mut ring = Ring::new(cap, recv);
        let generation = self.generation.fetch_add(1, Ordering::Relaxed);
        for (i, entry) in self.entries.iter().enumerate() {
            if !entry.load(Ordering::Relaxed).is_null() {
                continue;
            }
            ring.key = ((generation << INDEX_BITS) | i as u32) & KEY_MASK;
            let arc = Arc::new(ring);
            let raw = Arc::into_raw(arc.clone()).cast_mut();
            match entry.compare_exchange(ptr::null_mut(), raw, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(arc),
                Err(_) => {
                    // SAFETY: `raw` came from Arc::into_raw just above and was not published.
                    drop(unsafe { Arc::from_raw(raw) });
                    ring = Arc::into_inner(arc).expect("unpublished ring has one owner");
                }
            }
        }
        self.reserved.fetch_sub(cap, Ordering::AcqRel);
        Err(RegisterError::Full)
    }

    /// Completions the CQ holds.
    pub(crate) fn cq_capacity(&self) -> u32 {
        self.cq_capacity
    }

    /// Retires a registered ring whose QP is destroyed (or reset, or never created): the device
    /// no longer touches its buffers, which the consumer releases at its next sweep. Its room in
    /// the CQ is given back now (any stale completions it left are skipped when polled).
    pub(crate) fn retire(&self, ring: &Ring) {
        if ring.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        self.reserved.fetch_sub(ring.cap, Ordering::AcqRel);
        self.dead.fetch_add(1, Ordering::AcqRel);
    }

    /// Consumer: the ring a device `wr_id` names, if it is still registered.
    ///
    /// # Safety
    /// Called only by the consumer (the holder of `&mut CompletionQueue`), which is the only one
    /// that removes entries: the returned reference stays valid until its next `sweep`.
    pub(crate) unsafe fn lookup(&self, wr_id: u64) -> Option<&Ring> {
        let key = ((wr_id >> 32) as u32) & KEY_MASK;
        let index = (key & ((1 << INDEX_BITS) - 1)) as usize;
        let p = self.entries.get(index)?.load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        // SAFETY: registered entries hold a strong count, removed only by the consumer (us).
        let ring = unsafe { &*p };
        (ring.key == key && ring.recv == (wr_id & RECV != 0)).then_some(ring)
    }

    /// Consumer: removes dead rings, releasing the buffers they still hold.
    ///
    /// # Safety
    /// Called only by the consumer.
    pub(crate) unsafe fn sweep(&self) {
        if self.dead.load(Ordering::Acquire) == 0 {
            return;
        }
        for entry in self.entries.iter() {
            let p = entry.load(Ordering::Acquire);
            if p.is_null() {
                continue;
            }
            // SAFETY: registered, and only we remove entries.
            let ring = unsafe { &*p };
            if ring.dead.load(Ordering::Acquire) {
                entry.store(ptr::null_mut(), Ordering::Release);
                self.dead.fetch_sub(1, Ordering::AcqRel);
                // SAFETY: the registry's strong count, taken in register(); the device no longer
                // touches the buffers (dead), so dropping them is sound.
                drop(unsafe { Arc::from_raw(p) });
            }
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        for entry in self.entries.iter() {
            let p = entry.swap(ptr::null_mut(), Ordering::AcqRel);
            if !p.is_null() {
                // SAFETY: the registry's strong count. The CQ is being destroyed, so every QP using
                // it was destroyed first (each holds an Arc of the CQ): buffers are free to drop.
                drop(unsafe { Arc::from_raw(p) });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(wr_id: u64) -> Slot {
        Slot { wr_id, bufs: Default::default(), _ah: None }
    }

    #[test]
    fn ring_completes_in_order_and_releases_earlier_slots() {
        let reg = Registry::new(16);
        let ring = reg.register(4, false).ok().unwrap();
        let (h, free) = ring.producer_state();
        assert_eq!((h, free), (0, 4));
        for i in 0..3 {
            // SAFETY: producer, free positions.
            unsafe { ring.write(i, slot(100 + u64::from(i))) };
        }
        ring.set_head(3);
        assert_eq!(ring.producer_state().1, 1);
        // SAFETY: single consumer in this test.
        unsafe {
            let id = ring.device_wr_id(1);
            assert_eq!(id & TAG, TAG);
            assert_eq!(id & RECV, 0);
            let r = reg.lookup(id).unwrap();
            assert_eq!(r.complete(1).unwrap().wr_id, 101); // releases 0 too
            assert_eq!(ring.outstanding(), 1);
            assert!(r.complete(1).is_none(), "a stale position is ignored");
            assert!(r.complete(7).is_none(), "a position never posted is ignored");
            assert_eq!(r.complete(2).unwrap().wr_id, 102);
        }
        assert_eq!(ring.producer_state(), (3, 4));
    }

    #[test]
    fn ring_positions_wrap() {
        let ring = Ring::new(2, true);
        let mut pos = u32::MAX - 1;
        ring.head.store(pos, Ordering::Relaxed);
        ring.tail.store(pos, Ordering::Relaxed);
        for round in 0..4u64 {
            // SAFETY: producer/consumer in one thread, free slot.
            unsafe {
                ring.write(pos, slot(round));
                ring.set_head(pos.wrapping_add(1));
                assert_eq!(ring.complete(pos).unwrap().wr_id, round);
            }
            pos = pos.wrapping_add(1);
        }
    }

    #[test]
    fn a_full_ring_of_odd_depth_wraps_without_slot_collisions() {
        // Depth 3 does not divide 2^32: positions u32::MAX - 1, u32::MAX, 0 must use 3 slots.
        let ring = Ring::new(3, false);
        let start = u32::MAX - 1;
        ring.head.store(start, Ordering::Relaxed);
        ring.tail.store(start, Ordering::Relaxed);
        for k in 0..3u32 {
            let pos = start.wrapping_add(k);
            // SAFETY: producer, free positions (3 outstanding at most).
            unsafe { ring.write(pos, slot(u64::from(k))) };
            ring.set_head(pos.wrapping_add(1));
        }
        assert_eq!(ring.producer_state().1, 0, "full");
        for k in 0..3u32 {
            // SAFETY: single consumer.
            let s = unsafe { ring.complete(start.wrapping_add(k)) }.unwrap();
            assert_eq!(s.wr_id, u64::from(k));
        }
    }

    #[test]
    fn registry_rejects_foreign_and_stale_keys() {
        let reg = Registry::new(100);
        let a = reg.register(8, false).ok().unwrap();
        let b = reg.register(8, true).ok().unwrap();
        // SAFETY: single consumer.
        unsafe {
            assert!(std::ptr::eq(reg.lookup(a.device_wr_id(0)).unwrap(), &*a));
            assert!(std::ptr::eq(reg.lookup(b.device_wr_id(5)).unwrap(), &*b));
            // Right key, wrong queue direction.
            assert!(reg.lookup(a.device_wr_id(0) | RECV).is_none());
            assert!(reg.lookup(TAG | (12345u64 << 32)).is_none());
            reg.retire(&a);
            let stale = a.device_wr_id(0);
            reg.sweep();
            assert!(reg.lookup(stale).is_none());
            // The freed entry is reused under a new generation: the stale key still misses.
            let c = reg.register(8, false).ok().unwrap();
            assert!(reg.lookup(stale).is_none());
            assert!(reg.lookup(c.device_wr_id(0)).is_some());
        }
    }

    #[test]
    fn registry_reserves_cq_room() {
        let reg = Registry::new(10);
        let _a = reg.register(6, false).ok().unwrap();
        match reg.register(6, true) {
            Err(RegisterError::CqTooSmall { needed: 12, capacity: 10 }) => {}
            _ => panic!("expected CqTooSmall"),
        }
        assert!(reg.register(4, true).is_ok());
    }

    #[test]
    fn retired_rings_are_swept_and_give_back_cq_room() {
        let reg = Registry::new(8);
        let ring = reg.register(8, false).ok().unwrap();
        // SAFETY: producer writes free slots.
        unsafe {
            for i in 0..3 {
                ring.write(i, slot(i.into()));
            }
        }
        ring.set_head(3);
        assert!(matches!(reg.register(1, true), Err(RegisterError::CqTooSmall { .. })));
        reg.retire(&ring);
        reg.retire(&ring); // idempotent
        let weak = Arc::downgrade(&ring);
        drop(ring);
        assert!(weak.upgrade().is_some(), "the registry still holds the ring");
        // SAFETY: single consumer.
        unsafe { reg.sweep() };
        assert!(weak.upgrade().is_none(), "the sweep dropped the ring and its slots");
        assert!(reg.register(8, true).is_ok());
    }
}
