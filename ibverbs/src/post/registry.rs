//! The rings one completion queue serves, found from a completion's `wr_id` in two loads.
//!
//! A ring's key (bits 32..62 of its device `wr_id`s) is its index in the registry's table plus a
//! generation. The soundness of the safe level rests on one rule: **an index is reused, and the
//! completion-queue room its ring reserved is given back, only once the completion queue has been
//! seen empty after the ring was retired** — after that, no completion naming the old ring can
//! still be in the CQ. Until then the old ring stays in its entry (its buffers already released),
//! so a stale completion finds it, finds no outstanding position, and is skipped.
//!
//! A ring's life: registered ([`LIVE`]) → retired by its QP's destroy or reset, from any thread
//! ([`RETIRED`]) → seen by the consumer at the start of a poll, which releases its slots
//! ([`DRAINING`]) → removed by the consumer after a poll of that same or a later call found the CQ
//! empty. The generation is defence in depth only: it is not what keeps stale completions apart.

use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::ring::{Deferred, Ring, DRAINING, LIVE, RECV, RETIRED, TAG, UNUSED};
#[cfg(test)]
use super::slot::{Slot, SlotBufs};
use super::table::{SlotTable, SRQ};

/// Bits of a key: the low [`INDEX_BITS`] are the index, the rest a generation. Bits 32..61 of a
/// `wr_id` (bit 61 marks a shared receive queue's requests).
const KEY_BITS: u32 = 29;
const KEY_MASK: u32 = (1 << KEY_BITS) - 1;
const INDEX_BITS: u32 = 16;
/// Most rings (queue pairs' work queues) one completion queue can serve at once.
pub(crate) const REGISTRY_CAPACITY: usize = 4096;

/// Most shared receive queues one completion queue serves at once.
pub(crate) const SRQ_CAPACITY: usize = 64;

/// One shared receive queue's entry in one CQ's registry: shared by the registry (which finds the
/// slot table from a completion) and the SRQ (which retires it when it is destroyed).
pub(crate) struct SrqAttachment<T> {
    pub(crate) table: Arc<SlotTable<T>>,
    /// [`LIVE`], [`RETIRED`] or [`DRAINING`].
    state: std::sync::atomic::AtomicU8,
}

/// Why a queue pair's rings could not be registered.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RegisterError {
    /// The CQ cannot hold every completion its queue pairs could produce.
    CqTooSmall { needed: u64, capacity: u32 },
    /// All registry entries are taken (by live rings, or by retired ones waiting for the CQ to
    /// be seen empty).
    Full,
}

pub(crate) struct Registry<T> {
    entries: Box<[AtomicPtr<Ring<T>>]>,
    /// Shared receive queues attached to this CQ (each entry a strong count of an attachment).
    srqs: Box<[AtomicPtr<SrqAttachment<T>>]>,
    /// One past the highest SRQ index ever used.
    srq_high: AtomicUsize,
    /// One past the highest index ever used: scans stop there.
    high: AtomicUsize,
    generation: AtomicU32,
    /// Rings retired and not yet seen by the consumer.
    retired: AtomicU32,
    /// Rings the consumer has seen retired and not yet removed. Written only by the consumer.
    draining: AtomicU32,
    /// The CQ's room in one word, so that a reservation and a resize
    /// ([`set_capacity`](Self::set_capacity)) see each other: bits 32..64 are the completions the
    /// CQ holds, bits 0..32 the sum of the capacities of the rings (and SRQ tables) in the table,
    /// live or not yet removed, i.e. completions that can be in the CQ at once. The reserved sum
    /// never exceeds the capacity after a successful [`reserve`](Self::reserve), and an
    /// unreserve never takes more than was reserved, so the low half never borrows from the high.
    room: AtomicU64,
    /// A panic of a released slot's drop, caught while the consumer took completions, for the
    /// poll to resume once it kept them. Consumer-only.
    deferred: Deferred,
}

impl<T> Registry<T> {
    pub(crate) fn new(cq_capacity: u32) -> Registry<T> {
        Self::with_entries(cq_capacity, REGISTRY_CAPACITY)
    }

    /// A registry for the unit tests of other modules: [`new`](Self::new)'s but with a table of
    /// 64 entries (they register a few rings), which Miri fills in a fraction of the time it
    /// takes for the production table's 4096 (about 2 s a registry).
    #[cfg(test)]
    pub(crate) fn for_tests(cq_capacity: u32) -> Registry<T> {
        Self::with_entries(cq_capacity, 64)
    }

    /// A registry of `entries` table entries (at most `2^INDEX_BITS`).
    fn with_entries(cq_capacity: u32, entries: usize) -> Registry<T> {
        assert!(entries <= 1 << INDEX_BITS);
        Registry {
            entries: (0..entries).map(|_| AtomicPtr::new(ptr::null_mut())).collect(),
            srqs: (0..SRQ_CAPACITY).map(|_| AtomicPtr::new(ptr::null_mut())).collect(),
            srq_high: AtomicUsize::new(0),
            high: AtomicUsize::new(0),
            generation: AtomicU32::new(1),
            retired: AtomicU32::new(0),
            draining: AtomicU32::new(0),
            room: AtomicU64::new(u64::from(cq_capacity) << 32),
            deferred: Deferred::new(),
        }
    }

    /// Where the consumer keeps a panic caught while it takes completions (see [`Deferred`]).
    #[inline(always)]
    pub(crate) fn deferred(&self) -> &Deferred {
        &self.deferred
    }

    /// Completions the CQ holds.
    pub(crate) fn cq_capacity(&self) -> u32 {
        (self.room.load(Ordering::Acquire) >> 32) as u32
    }

    /// Completions not reserved by the rings in the table: what `unsafe`-level posts whose
    /// completions land in this CQ may use.
    pub(crate) fn unreserved(&self) -> u32 {
        let room = self.room.load(Ordering::Acquire);
        ((room >> 32) as u32).saturating_sub(room as u32)
    }

    /// Completions reserved by the rings and SRQ tables in the table.
    #[cfg(test)]
    pub(crate) fn reserved(&self) -> u32 {
        self.room.load(Ordering::Acquire) as u32
    }

    /// Reserves room for `n` more completions, all or nothing (any thread).
    fn reserve(&self, n: u64) -> Result<(), RegisterError> {
        let mut cur = self.room.load(Ordering::Acquire);
        loop {
            let capacity = (cur >> 32) as u32;
            let needed = u64::from(cur as u32) + n;
            if needed > u64::from(capacity) {
                return Err(RegisterError::CqTooSmall { needed, capacity });
            }
            // needed <= capacity, a u32: the low half holds it.
            let new = (cur & !u64::from(u32::MAX)) | needed;
            match self.room.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    fn unreserve(&self, n: u32) {
        // The low half holds at least `n` (what was reserved): no borrow from the capacity.
        self.room.fetch_sub(u64::from(n), Ordering::AcqRel);
    }

    /// Sets the CQ's capacity to `capacity` (any thread), unless the room already reserved
    /// exceeds it: then nothing changes and the error names the reserved room as `needed`.
    /// Returns the capacity it replaced. Used around `ibv_resize_cq`: lowered to the smaller of
    /// the old and new sizes before the verb, so that no reservation made meanwhile counts on
    /// entries the resize may take away, then set to what the device reports.
    pub(crate) fn set_capacity(&self, capacity: u32) -> Result<u32, RegisterError> {
        let mut cur = self.room.load(Ordering::Acquire);
        loop {
            let reserved = cur as u32;
            if reserved > capacity {
                return Err(RegisterError::CqTooSmall { needed: u64::from(reserved), capacity });
            }
            let new = (u64::from(capacity) << 32) | u64::from(reserved);
            match self.room.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok((cur >> 32) as u32),
                Err(now) => cur = now,
            }
        }
    }

    /// Registers rings of the given capacities (any thread): reserves room for all their
    /// completions in the CQ first, then allocates each ring (so its size is bounded by a CQ the
    /// device accepted) and gives it a free index. All or nothing.
    pub(crate) fn register<const N: usize>(
        &self,
        rings: [(u32, bool); N],
    ) -> Result<[Arc<Ring<T>>; N], RegisterError> {
        let total: u64 = rings.iter().map(|&(cap, _)| u64::from(cap.max(1))).sum();
        self.reserve(total)?;
        let mut done: Vec<Arc<Ring<T>>> = Vec::with_capacity(N);
        for &(cap, recv) in &rings {
            match self.insert(cap.max(1), recv) {
                Some(ring) => done.push(ring),
                None => {
                    for ring in &done {
                        // Published already: only the consumer may take it out of the table.
                        ring.state.store(UNUSED, Ordering::Release);
                        self.retired.fetch_add(1, Ordering::AcqRel);
                    }
                    self.unreserve(total as u32);
                    return Err(RegisterError::Full);
                }
            }
        }
        Ok(done.try_into().unwrap_or_else(|_| unreachable!("one ring per request")))
    }

    /// Puts a new ring of `cap` slots into a free entry.
    fn insert(&self, cap: u32, recv: bool) -> Option<Arc<Ring<T>>> {
        for (i, entry) in self.entries.iter().enumerate() {
            if !entry.load(Ordering::Acquire).is_null() {
                continue;
            }
            let generation = self.generation.fetch_add(1, Ordering::Relaxed);
            let key = ((generation << INDEX_BITS) | i as u32) & KEY_MASK;
            let base = TAG | if recv { RECV } else { 0 } | (u64::from(key) << 32);
            let ring = Arc::new(Ring::new(cap, base));
            let raw = Arc::into_raw(ring.clone()).cast_mut();
            match entry.compare_exchange(ptr::null_mut(), raw, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.high.fetch_max(i + 1, Ordering::AcqRel);
                    return Some(ring);
                }
                // SAFETY: `raw` came from Arc::into_raw just above and was not published.
                Err(_) => drop(unsafe { Arc::from_raw(raw) }),
            }
        }
        None
    }

    fn index(wr_id: u64) -> usize {
        (((wr_id >> 32) as u32) & ((1 << INDEX_BITS) - 1)) as usize
    }

    /// Gives back a ring that never reached the device (its queue pair was not created, or a
    /// reset could not register its sibling): its CQ room now, since no completion can name it,
    /// and its table entry at the consumer's next poll (only the consumer takes published rings
    /// out of the table: it may be looking at this one right now).
    pub(crate) fn unregister(&self, ring: &Ring<T>) {
        if ring.state.compare_exchange(LIVE, UNUSED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            self.unreserve(ring.capacity());
            self.retired.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Retires a registered ring whose queue was destroyed or reset (any thread, after the verb
    /// returned, with no post after it): the device no longer touches its buffers, and no new
    /// completion will name it. The consumer releases the buffers at its next poll. Of the
    /// ring's CQ room, what its outstanding requests could still have in the CQ is kept, and
    /// comes back with its index once the CQ has been seen empty; the rest comes back now.
    ///
    /// Only the ring's owner (its queue pair, which has stopped posting to it) calls `retire` or
    /// [`unregister`](Self::unregister), one call at a time; a second call does nothing.
    pub(crate) fn retire(&self, ring: &Ring<T>) {
        // The consumer never changes a LIVE ring's state, and no other thread retires it: a ring
        // seen LIVE here stays LIVE until the store below.
        if ring.state.load(Ordering::Acquire) != LIVE {
            return;
        }
        // Completions of this ring still in the CQ are for outstanding positions (a polled one
        // releases its position and every earlier one); the consumer only lowers the count
        // meanwhile, so this is an upper bound.
        let keep = ring.outstanding().min(ring.capacity());
        // Recorded before the ring is seen RETIRED: a consumer that sees it so (Acquire) may
        // drain it and give this room back at once (`drained` reads `kept`).
        ring.kept.store(keep, Ordering::Relaxed);
        ring.state.store(RETIRED, Ordering::Release);
        self.unreserve(ring.capacity() - keep);
        self.retired.fetch_add(1, Ordering::AcqRel);
    }

    /// Attaches a shared receive queue's slot table (any thread): reserves its depth in the CQ
    /// and puts it in a free SRQ entry. The caller attaches each SRQ at most once per CQ.
    pub(crate) fn attach_srq(
        &self,
        table: Arc<SlotTable<T>>,
    ) -> Result<Arc<SrqAttachment<T>>, RegisterError> {
        let cap = table.capacity();
        self.reserve(u64::from(cap))?;
        let att = Arc::new(SrqAttachment { table, state: std::sync::atomic::AtomicU8::new(LIVE) });
        for (i, entry) in self.srqs.iter().enumerate() {
            if !entry.load(Ordering::Acquire).is_null() {
                continue;
            }
            let raw = Arc::into_raw(att.clone()).cast_mut();
            match entry.compare_exchange(ptr::null_mut(), raw, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.srq_high.fetch_max(i + 1, Ordering::AcqRel);
                    return Ok(att);
                }
                // SAFETY: `raw` came from Arc::into_raw just above and was not published.
                Err(_) => drop(unsafe { Arc::from_raw(raw) }),
            }
        }
        self.unreserve(cap);
        Err(RegisterError::Full)
    }

    /// Retires an SRQ's attachment (any thread) once `ibv_destroy_srq` succeeded: no new
    /// completion names it; its room and entry come back once the CQ was seen empty.
    pub(crate) fn retire_srq(&self, att: &SrqAttachment<T>) {
        if att.state.compare_exchange(LIVE, RETIRED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            self.retired.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Consumer: the slot table of the attached SRQ a device `wr_id` (with the SRQ bit) names.
    ///
    /// # Safety
    /// As [`lookup`](Self::lookup): only the consumer takes attachments out of the table.
    #[inline]
    pub(crate) unsafe fn lookup_srq(&self, wr_id: u64) -> Option<&SlotTable<T>> {
        let high = self.srq_high.load(Ordering::Acquire);
        let want = wr_id & super::table::SRQ_ID_MASK;
        for entry in &self.srqs[..high] {
            let p = entry.load(Ordering::Acquire);
            if p.is_null() {
                continue;
            }
            // SAFETY: table entries hold a strong count, removed only by the consumer (us).
            let att = unsafe { &*p };
            if att.table.base() == want {
                return Some(&att.table);
            }
        }
        None
    }

    /// Consumer: the ring a device `wr_id` names, if it is still in the table (live or not).
    ///
    /// # Safety
    /// Called only by the consumer (the holder of `&mut CompletionQueue`), which is the only one
    /// that takes rings out of the table: the reference stays valid until its next
    /// [`begin_poll`](Self::begin_poll) or [`drained`](Self::drained).
    pub(crate) unsafe fn lookup(&self, wr_id: u64) -> Option<&Ring<T>> {
        let p = self.entries.get(Self::index(wr_id))?.load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        // SAFETY: table entries hold a strong count, removed only by the consumer (us).
        let ring = unsafe { &*p };
        let mask = TAG | RECV | SRQ | (u64::from(KEY_MASK) << 32);
        (ring.wr_id_base() == wr_id & mask).then_some(ring)
    }

    /// Consumer, at the start of a poll: takes out of the table the rings that never reached
    /// the device, and releases the buffers of rings retired since the last poll, marking them
    /// draining. Returns whether any ring is draining, i.e. whether a poll
    /// that finds the CQ empty should call [`drained`](Self::drained). Two loads when nothing
    /// was retired.
    ///
    /// A panic in a buffer's drop propagates; the ring then stays retired and the rest of its
    /// buffers are released at the next poll (every buffer is dropped at most once).
    ///
    /// # Safety
    /// Called only by the consumer.
    #[inline]
    pub(crate) unsafe fn begin_poll(&self) -> bool {
        // SAFETY: consumer (contract).
        unsafe { self.release_retired() };
        self.is_draining()
    }

    /// Consumer: [`begin_poll`](Self::begin_poll) without its result, for a poll that asks
    /// [`is_draining`](Self::is_draining) only once the CQ was seen empty (nothing it needs
    /// lives across the provider call then).
    ///
    /// # Safety
    /// Called only by the consumer.
    #[inline]
    pub(crate) unsafe fn release_retired(&self) {
        if self.retired.load(Ordering::Acquire) != 0 {
            // SAFETY: consumer (contract).
            unsafe { self.take_retired() };
        }
    }

    /// Whether any ring is draining. Only the consumer marks rings draining (in
    /// [`begin_poll`](Self::begin_poll)/[`release_retired`](Self::release_retired)) or takes them
    /// out ([`drained`](Self::drained)): read by the consumer after its provider call, it is what
    /// `begin_poll` returned before it.
    #[inline]
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed) != 0
    }

    /// Consumer: the slow part of [`begin_poll`](Self::begin_poll).
    ///
    /// # Safety
    /// Called only by the consumer.
    #[cold]
    unsafe fn take_retired(&self) {
        // SAFETY: consumer (contract).
        unsafe {
            self.for_each_ring(|ring| match ring.state.load(Ordering::Acquire) {
                RETIRED => {
                    // SAFETY: consumer; retired means the device is done with these buffers.
                    ring.release_all();
                    ring.state.store(DRAINING, Ordering::Release);
                    self.retired.fetch_sub(1, Ordering::AcqRel);
                    self.draining.fetch_add(1, Ordering::AcqRel);
                    false
                }
                UNUSED => {
                    // No wr_id names it: out of the table at once.
                    self.retired.fetch_sub(1, Ordering::AcqRel);
                    true
                }
                _ => false,
            });
            self.for_each_srq(|att| {
                if att.state.load(Ordering::Acquire) == RETIRED {
                    att.state.store(DRAINING, Ordering::Release);
                    self.retired.fetch_sub(1, Ordering::AcqRel);
                    self.draining.fetch_add(1, Ordering::AcqRel);
                    // SAFETY: retired after ibv_destroy_srq succeeded. Normally a no-op (the SRQ
                    // released its slots); finishes the job if a drop panicked there.
                    att.table.release_all();
                }
                false
            })
        }
    }

    /// Consumer: as [`for_each_ring`](Self::for_each_ring), for the SRQ attachments.
    ///
    /// # Safety
    /// Called only by the consumer.
    unsafe fn for_each_srq(&self, mut f: impl FnMut(&SrqAttachment<T>) -> bool) {
        let high = self.srq_high.load(Ordering::Acquire);
        for entry in &self.srqs[..high] {
            let p = entry.load(Ordering::Acquire);
            // SAFETY: in the table, whose strong count keeps it alive; only we take entries out.
            if !p.is_null() && f(unsafe { &*p }) {
                entry.store(ptr::null_mut(), Ordering::Release);
                // SAFETY: the table's strong count, taken in attach_srq(); `f` has returned.
                drop(unsafe { Arc::from_raw(p) });
            }
        }
    }

    /// Consumer: calls `f` on every ring in the table, and takes the ring out of the table (and
    /// drops the table's strong count) when `f` returns `true` — after `f` returned, so that no
    /// reference into the ring outlives it.
    ///
    /// # Safety
    /// Called only by the consumer.
    unsafe fn for_each_ring(&self, mut f: impl FnMut(&Ring<T>) -> bool) {
        let high = self.high.load(Ordering::Acquire);
        for entry in &self.entries[..high] {
            let p = entry.load(Ordering::Acquire);
            // SAFETY: in the table, whose strong count keeps it alive; only the consumer (us)
            // takes rings out.
            if !p.is_null() && f(unsafe { &*p }) {
                entry.store(ptr::null_mut(), Ordering::Release);
                // SAFETY: the table's strong count, taken in insert(); `f` has returned.
                drop(unsafe { Arc::from_raw(p) });
            }
        }
    }

    /// Consumer: the CQ was found empty by a poll that started after [`begin_poll`]: no
    /// completion of a draining ring can remain, so their indices and CQ room come back.
    ///
    /// # Safety
    /// Called only by the consumer, after a provider poll (issued after `begin_poll` marked the
    /// rings) returned fewer completions than asked for.
    // Rare (a queue pair was dropped or reset): out of line, so that the empty poll that asks
    // for it does not carry its loops.
    #[cold]
    #[inline(never)]
    pub(crate) unsafe fn drained(&self) {
        // SAFETY: consumer (contract).
        unsafe {
            self.for_each_ring(|ring| {
                let remove = ring.state.load(Ordering::Acquire) == DRAINING;
                if remove {
                    // Its slots were released in begin_poll: removing it drops nothing of the
                    // user's.
                    self.draining.fetch_sub(1, Ordering::AcqRel);
                    self.unreserve(ring.kept.load(Ordering::Acquire));
                }
                remove
            });
            self.for_each_srq(|att| {
                let remove = att.state.load(Ordering::Acquire) == DRAINING;
                if remove {
                    self.draining.fetch_sub(1, Ordering::AcqRel);
                    self.unreserve(att.table.capacity());
                }
                remove
            })
        }
    }
}

impl<T> Drop for Registry<T> {
    fn drop(&mut self) {
        for entry in self.srqs.iter() {
            let p = entry.swap(ptr::null_mut(), Ordering::AcqRel);
            if !p.is_null() {
                // SAFETY: the table's strong count. Every SRQ attached holds an Arc of this CQ,
                // so it was destroyed (or leaked its table on a failed destroy) before we got here.
                drop(unsafe { Arc::from_raw(p) });
            }
        }
        for entry in self.entries.iter() {
            let p = entry.swap(ptr::null_mut(), Ordering::AcqRel);
            if !p.is_null() {
                // SAFETY: the table's strong count. The CQ is being destroyed, so every QP using
                // it was destroyed first (each holds an Arc of the CQ): buffers are free to drop.
                drop(unsafe { Arc::from_raw(p) });
            }
        }
    }
}

/// Test support for the CQ poll paths (`queue/cq.rs`, `queue/cq_ex.rs`): a ring of `cap` slots (a
/// receive queue's when `recv`) registered in `reg`, with a slot per `wr_ids` entry written and
/// published at positions `0..`.
#[cfg(test)]
pub(crate) fn posted_ring(reg: &Registry<Slot>, cap: u32, recv: bool, wr_ids: &[u64]) -> Arc<Ring<Slot>> {
    let [ring] = reg.register([(cap, recv)]).unwrap();
    for (pos, &wr_id) in (0u32..).zip(wr_ids) {
        let slot = Slot { wr_id, bufs: SlotBufs::default(), _ah: None };
        // SAFETY: the caller is the new ring's only producer; positions from 0 are free.
        unsafe { ring.write(pos, slot) };
    }
    ring.set_head(wr_ids.len() as u32);
    ring
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small table, so that filling it is quick (also under Miri).
    const ENTRIES: usize = 64;

    fn small(cq_capacity: u32) -> Registry<u64> {
        Registry::with_entries(cq_capacity, ENTRIES)
    }

    fn one(reg: &Registry<u64>, cap: u32, recv: bool) -> Arc<Ring<u64>> {
        let [r] = reg.register([(cap, recv)]).unwrap();
        r
    }

    /// One full poll by the consumer that finds the CQ empty.
    fn poll_empty(reg: &Registry<u64>) {
        // SAFETY: single consumer in these tests.
        unsafe {
            if reg.begin_poll() {
                reg.drained();
            }
        }
    }

    #[test]
    fn the_production_table_has_its_documented_size() {
        let reg = Registry::<u64>::new(8);
        assert_eq!(reg.entries.len(), REGISTRY_CAPACITY);
    }

    #[test]
    fn rejects_foreign_and_stale_keys() {
        let reg = small(100);
        let [a, b] = reg.register([(8, false), (8, true)]).unwrap();
        // SAFETY: single consumer.
        unsafe {
            assert!(std::ptr::eq(reg.lookup(a.device_wr_id(0)).unwrap(), &*a));
            assert!(std::ptr::eq(reg.lookup(b.device_wr_id(5)).unwrap(), &*b));
            // Right key, wrong queue direction.
            assert!(reg.lookup(a.device_wr_id(0) | RECV).is_none());
            assert!(reg.lookup(TAG | (12345u64 << 32)).is_none());
            let stale = a.device_wr_id(0);
            reg.retire(&a);
            poll_empty(&reg);
            assert!(reg.lookup(stale).is_none());
            // The freed entry is reused under a new generation: the stale key still misses.
            let c = one(&reg, 8, false);
            assert!(reg.lookup(stale).is_none());
            assert!(reg.lookup(c.device_wr_id(0)).is_some());
        }
    }

    #[test]
    fn reserves_cq_room_all_or_nothing() {
        let reg = small(10);
        let _a = one(&reg, 6, false);
        assert_eq!(
            reg.register([(2, false), (4, true)]).err(),
            Some(RegisterError::CqTooSmall { needed: 12, capacity: 10 }),
            "the need reported is the whole QP's"
        );
        assert_eq!(reg.unreserved(), 4, "a refused QP reserves nothing");
        assert!(reg.register([(2, false), (2, true)]).is_ok());
        assert_eq!(reg.unreserved(), 0);
    }

    #[test]
    fn reservation_arithmetic_cannot_wrap() {
        let reg = small(u32::MAX);
        let _a = one(&reg, 16, false);
        for _ in 0..8 {
            assert!(matches!(
                reg.register([(u32::MAX, false), (u32::MAX, true)]),
                Err(RegisterError::CqTooSmall { .. })
            ));
        }
        assert_eq!(reg.unreserved(), u32::MAX - 16);
    }

    #[test]
    fn a_capacity_change_below_the_reserved_room_is_refused_and_changes_nothing() {
        let reg = small(10);
        let _a = one(&reg, 6, false);
        assert_eq!(reg.reserved(), 6);
        assert_eq!(reg.set_capacity(5), Err(RegisterError::CqTooSmall { needed: 6, capacity: 5 }));
        assert_eq!((reg.cq_capacity(), reg.unreserved()), (10, 4));
        assert_eq!(reg.set_capacity(6), Ok(10));
        assert_eq!((reg.cq_capacity(), reg.unreserved()), (6, 0));
        assert!(matches!(
            reg.register([(1, false)]),
            Err(RegisterError::CqTooSmall { needed: 7, capacity: 6 })
        ));
        assert_eq!(reg.set_capacity(u32::MAX), Ok(6));
        assert_eq!(reg.unreserved(), u32::MAX - 6);
        assert!(reg.register([(100, false)]).is_ok());
        assert_eq!(reg.reserved(), 106);
    }

    // Regression (soundness hole 3): a retired ring's CQ room came back at once, while its
    // completions could still be in the CQ; a new QP could then overflow the CQ.
    #[test]
    fn cq_room_and_index_come_back_only_after_the_cq_is_seen_empty() {
        let reg = small(8);
        let ring = one(&reg, 8, false);
        let index = Registry::<u64>::index(ring.wr_id_base());
        // SAFETY: producer writes free slots.
        unsafe {
            for i in 0..3 {
                ring.write(i, i.into());
            }
        }
        ring.set_head(3);
        reg.retire(&ring);
        reg.retire(&ring); // idempotent
        let weak = Arc::downgrade(&ring);
        drop(ring);
        // The 5 positions never posted come back now; the 3 outstanding ones may still have
        // completions in the CQ.
        assert_eq!(reg.unreserved(), 5);
        assert!(matches!(reg.register([(6, true)]), Err(RegisterError::CqTooSmall { needed: 9, .. })));
        // A poll that does not find the CQ empty (it filled the caller's whole array): the
        // buffers go, the room and the index stay.
        // SAFETY: single consumer.
        assert!(unsafe { reg.begin_poll() });
        assert_eq!(weak.upgrade().map(|r| r.outstanding()), Some(0), "buffers released");
        assert!(matches!(reg.register([(6, true)]), Err(RegisterError::CqTooSmall { .. })));
        // Now a poll finds the CQ empty.
        // SAFETY: single consumer.
        unsafe { reg.drained() };
        assert!(weak.upgrade().is_none(), "the registry let go of the ring");
        let again = one(&reg, 8, true);
        assert_eq!(Registry::<u64>::index(again.wr_id_base()), index, "the index is free again");
    }

    // Regression (soundness hole 2): with a stale completion of a retired ring in the CQ, safe
    // code could cycle generations until a new ring got the old key. An index is now not reused
    // before the CQ is seen empty, however many registrations come and go meanwhile.
    #[test]
    fn a_retired_index_is_never_reused_before_a_drain() {
        let reg = small(1 << 20);
        let victim = one(&reg, 4, true);
        let stale = victim.device_wr_id(0);
        let index = Registry::<u64>::index(stale);
        reg.retire(&victim);
        drop(victim);
        let mut churned = 0;
        loop {
            // Polls that never find the CQ empty (the stale completion is in it).
            // SAFETY: single consumer.
            unsafe { reg.begin_poll() };
            let r = match reg.register([(1, true)]) {
                Ok([r]) => r,
                Err(e) => {
                    assert_eq!(e, RegisterError::Full);
                    break;
                }
            };
            assert_ne!(Registry::<u64>::index(r.wr_id_base()), index);
            reg.retire(&r);
            churned += 1;
            // SAFETY: single consumer.
            assert!(unsafe { reg.lookup(stale) }.is_some_and(|old| old.outstanding() == 0));
        }
        assert_eq!(churned, ENTRIES - 1, "every other index was used once, none twice");
        // SAFETY: single consumer.
        unsafe { reg.lookup(stale) }.expect("the victim stays until a drain");
        poll_empty(&reg);
        // SAFETY: single consumer.
        assert!(unsafe { reg.lookup(stale) }.is_none());
        assert_eq!(reg.unreserved(), 1 << 20, "all room back");
    }

    #[test]
    fn a_ring_that_never_reached_the_device_leaves_at_once() {
        let reg = small(8);
        let ring = one(&reg, 8, false);
        let index = Registry::<u64>::index(ring.wr_id_base());
        reg.unregister(&ring);
        assert_eq!(reg.unreserved(), 8, "its room comes back at once");
        // Its entry, at the consumer's next poll (whether or not it finds the CQ empty).
        // SAFETY: single consumer.
        unsafe { reg.begin_poll() };
        // SAFETY: single consumer.
        assert!(unsafe { reg.lookup(ring.device_wr_id(0)) }.is_none());
        let again = one(&reg, 8, false);
        assert_eq!(Registry::<u64>::index(again.wr_id_base()), index);
    }

    #[test]
    fn retired_rings_are_released_and_removed() {
        let reg = small(8);
        let ring = one(&reg, 8, false);
        let weak = Arc::downgrade(&ring);
        reg.retire(&ring);
        drop(ring);
        assert!(weak.upgrade().is_some(), "the registry still holds the ring");
        poll_empty(&reg);
        assert!(weak.upgrade().is_none(), "the drain removed the ring");
        assert!(reg.register([(8, true)]).is_ok());
    }

    #[test]
    fn a_full_table_is_a_typed_error_and_leaves_nothing_reserved() {
        let reg = small(u32::MAX);
        let rings: Vec<_> = (0..ENTRIES).map(|_| one(&reg, 1, false)).collect();
        assert_eq!(reg.register([(1, false)]).err(), Some(RegisterError::Full));
        reg.retire(&rings[7]);
        poll_empty(&reg);
        let before = reg.unreserved();
        // One entry is free: a QP needs two, so the first ring is taken back and nothing stays.
        assert_eq!(reg.register([(1, false), (1, true)]).err(), Some(RegisterError::Full));
        assert_eq!(reg.unreserved(), before);
        // SAFETY: single consumer; its next poll frees the entry the refused QP briefly took.
        unsafe { reg.begin_poll() };
        assert!(reg.register([(1, true)]).is_ok());
    }

    #[test]
    fn generations_wrap_harmlessly() {
        let reg = small(64);
        reg.generation.store(u32::MAX - 3, Ordering::Relaxed);
        let mut keys = Vec::new();
        for _ in 0..8 {
            let r = one(&reg, 2, false);
            keys.push(r.wr_id_base());
            // SAFETY: single consumer.
            unsafe { assert!(reg.lookup(r.device_wr_id(1)).is_some()) };
            reg.retire(&r);
            poll_empty(&reg);
        }
        assert!(keys.iter().all(|k| k & TAG != 0 && k & RECV == 0));
        assert_eq!(reg.unreserved(), 64);
    }

    // Regression (seen as 4 entries of CQ room missing under ThreadSanitizer in device_threads'
    // queue_pairs_reset_and_dropped_while_their_cq_is_polled): retire() made a ring RETIRED
    // before it recorded the room its outstanding requests keep, so a consumer that drained it
    // in between gave back 0 for it, and the record came too late: that room never came back.
    #[test]
    fn room_kept_by_a_ring_retired_during_a_drain_comes_back() {
        let reg = Arc::new(small(1 << 16));
        let rounds = if cfg!(miri) { 40 } else { 20_000 };
        for _ in 0..rounds {
            let [a, b] = reg.register([(4, false), (4, true)]).unwrap();
            for r in [&a, &b] {
                // SAFETY: producer writes free slots.
                unsafe {
                    r.write(0, 0);
                    r.write(1, 1);
                }
                r.set_head(2);
            }
            // While `b` is being retired, `a`'s retirement has the consumer look at the rings.
            let retirer = {
                let reg = reg.clone();
                std::thread::spawn(move || {
                    reg.retire(&a);
                    reg.retire(&b);
                })
            };
            while !retirer.is_finished() {
                poll_empty(&reg);
            }
            retirer.join().unwrap();
            poll_empty(&reg);
            poll_empty(&reg);
        }
        assert_eq!(reg.unreserved(), 1 << 16, "all room back");
    }

    // Our own probe: a registrar giving back a ring that never reached the device (reset() of a
    // QP whose send and receive CQs differ) while the consumer polls. A first version removed the
    // entry from the registrar's thread while the consumer could hold a reference into it (Miri:
    // data race on the ring's memory, a use-after-free).
    #[test]
    fn unregister_and_a_concurrent_drain_remove_a_ring_once() {
        let reg = Arc::new(small(1 << 16));
        let rounds = if cfg!(miri) { 30 } else { 3_000 };
        for _ in 0..rounds {
            let [victim, other] = reg.register([(2, false), (2, true)]).unwrap();
            reg.retire(&other); // something for the consumer to drain
            drop(other);
            let weak = Arc::downgrade(&victim);
            let registrar = {
                let reg = reg.clone();
                std::thread::spawn(move || reg.unregister(&victim))
            };
            // SAFETY: this thread is the only consumer.
            unsafe {
                if reg.begin_poll() {
                    reg.drained();
                }
            }
            registrar.join().unwrap();
            // SAFETY: the only consumer; this poll takes out whatever the race left.
            unsafe { reg.begin_poll() };
            assert!(weak.upgrade().is_none(), "removed exactly once, and freed");
        }
        assert_eq!(reg.unreserved(), 1 << 16);
    }
}
