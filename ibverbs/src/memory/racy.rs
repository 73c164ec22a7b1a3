//! Copies in and out of memory that others may write at any moment: peers through RDMA, the
//! local device, and other threads of this process through the same `&RemoteMemoryRegion`.
//!
//! Volatile accesses cover the device but not other threads: two threads copying into and out of
//! one region with volatile accesses is a data race, undefined behaviour. Every access here is
//! a relaxed **atomic** access instead, and always of the same size for a given byte, because
//! Rust's memory model forbids racing atomic accesses of different sizes to overlapping memory:
//!
//! - a byte whose aligned 8-byte word lies wholly inside the memory is accessed as part of that
//!   word (`AtomicU64`); a write of part of a word is a compare-and-swap loop on the word;
//! - the other bytes (at most 7 at each end of the memory) are accessed alone (`AtomicU8`).
//!
//! The choice depends only on the memory's bounds and the byte's address, so every access to a
//! byte, from whichever thread and whichever method, has the same size. A concurrent copy may be
//! torn (some bytes old, some new); it is never undefined behaviour.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// `len` bytes at `base` that others may write concurrently, copied only with atomic accesses.
#[derive(Clone, Copy)]
pub(crate) struct RacyBytes {
    base: *mut u8,
    len: usize,
}

const WORD: usize = 8;

impl RacyBytes {
    /// # Safety
    /// `base` is valid for reads and writes of `len` bytes for as long as the returned value
    /// (or a copy of it) is used, and is accessed by this process only through `RacyBytes` (or
    /// atomics of the same granularity) meanwhile.
    pub(crate) unsafe fn new(base: *mut u8, len: usize) -> RacyBytes {
        RacyBytes { base, len }
    }

    /// Offsets `[lo, hi)` covered by whole words inside the memory.
    fn words(&self) -> (usize, usize) {
        let misalign = self.base as usize % WORD;
        let lo = if misalign == 0 { 0 } else { WORD - misalign }.min(self.len);
        let hi = (lo + (self.len - lo) / WORD * WORD).max(lo);
        (lo, hi)
    }

    fn byte(&self, offset: usize) -> &AtomicU8 {
        // SAFETY: callers pass offsets inside the memory, valid per `new`'s contract; AtomicU8
        // has no alignment requirement.
        unsafe { AtomicU8::from_ptr(self.base.add(offset)) }
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: callers pass the offset of an 8-aligned word inside the memory.
        unsafe { AtomicU64::from_ptr(self.base.add(offset).cast::<u64>()) }
    }

    /// Calls `f(at, word, from, to)` for each access unit overlapping `[offset, offset + n)`: the
    /// word at offset `at` (its bytes `from..to`), or the single byte at `at` (`word == false`,
    /// `from == 0`, `to == 1`).
    fn for_each_unit(&self, offset: usize, n: usize, mut f: impl FnMut(usize, bool, usize, usize)) {
        debug_assert!(offset.checked_add(n).is_some_and(|e| e <= self.len));
        let (lo, hi) = self.words();
        let mut o = offset;
        let end = offset + n;
        while o < end {
            if o >= lo && o < hi {
                let w = o - (o - lo) % WORD;
                let from = o - w;
                let to = (end - w).min(WORD);
                f(w, true, from, to);
                o = w + to;
            } else {
                f(o, false, 0, 1);
                o += 1;
            }
        }
    }

    /// Copies `dst.len()` bytes at `offset` out. The caller checked the bounds.
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8]) {
        self.for_each_unit(offset, dst.len(), |addr, word, from, to| {
            let at = addr + from - offset;
            if word {
                let bytes = self.word(addr).load(Ordering::Relaxed).to_ne_bytes();
                dst[at..at + to - from].copy_from_slice(&bytes[from..to]);
            } else {
                dst[at] = self.byte(addr).load(Ordering::Relaxed);
            }
        });
    }

    /// Copies `src` in at `offset`. The caller checked the bounds.
    pub(crate) fn write(&self, offset: usize, src: &[u8]) {
        self.for_each_unit(offset, src.len(), |addr, word, from, to| {
            let at = addr + from - offset;
            let part = &src[at..at + to - from];
            if !word {
                self.byte(addr).store(part[0], Ordering::Relaxed);
            } else if from == 0 && to == WORD {
                let mut b = [0; WORD];
                b.copy_from_slice(part);
                self.word(addr).store(u64::from_ne_bytes(b), Ordering::Relaxed);
            } else {
                let atom = self.word(addr);
                let mut cur = atom.load(Ordering::Relaxed);
                loop {
                    let mut b = cur.to_ne_bytes();
                    b[from..to].copy_from_slice(part);
                    match atom.compare_exchange_weak(
                        cur,
                        u64::from_ne_bytes(b),
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => break,
                        Err(now) => cur = now,
                    }
                }
            }
        });
    }

    /// Sets every byte to `value`.
    pub(crate) fn fill(&self, value: u8) {
        let word = u64::from_ne_bytes([value; WORD]);
        self.for_each_unit(0, self.len, |addr, is_word, _, _| {
            // Whole-memory fills only cut words at the memory's ends, which are byte units.
            if is_word {
                self.word(addr).store(word, Ordering::Relaxed);
            } else {
                self.byte(addr).store(value, Ordering::Relaxed);
            }
        });
    }

    /// The access unit of the byte at `offset`, found once for many loads and stores. The
    /// caller checked the bounds.
    pub(crate) fn byte_unit(&self, offset: usize) -> ByteUnit {
        debug_assert!(offset < self.len);
        let (lo, hi) = self.words();
        if offset >= lo && offset < hi {
            let w = offset - (offset - lo) % WORD;
            let i = (offset - w) as u32;
            // Where byte `i` of the word's native-endian bytes sits in its value.
            let shift = if cfg!(target_endian = "little") { 8 * i } else { 8 * (WORD as u32 - 1 - i) };
            // SAFETY: `w` is inside the memory (`lo <= w < hi`).
            ByteUnit { unit: unsafe { self.base.add(w) }, shift: Some(shift) }
        } else {
            // SAFETY: `offset` is inside the memory (the caller's check).
            ByteUnit { unit: unsafe { self.base.add(offset) }, shift: None }
        }
    }

    /// The aligned 8 bytes at `offset` in one access, if that word lies inside the memory.
    pub(crate) fn load_u64(&self, offset: usize) -> Option<u64> {
        let (lo, hi) = self.words();
        let inside = offset >= lo && offset < hi && (offset - lo) % WORD == 0;
        inside.then(|| self.word(offset).load(Ordering::Relaxed))
    }
}

/// One byte of a [`RacyBytes`], accessed as [`RacyBytes`] accesses it: the 8-byte word holding
/// it (`shift`: where the byte sits in the word's value), or the byte alone. Valid as long as
/// the `RacyBytes` it came from.
#[derive(Clone, Copy)]
pub(crate) struct ByteUnit {
    unit: *mut u8,
    shift: Option<u32>,
}

impl ByteUnit {
    /// The byte, in one relaxed atomic load.
    ///
    /// # Safety
    /// The memory it came from is still valid, per [`RacyBytes::new`]'s contract.
    #[inline]
    pub(crate) unsafe fn load(&self) -> u8 {
        match self.shift {
            Some(s) => {
                // SAFETY: an 8-aligned word inside the memory (byte_unit), valid (contract).
                let word = unsafe { AtomicU64::from_ptr(self.unit.cast::<u64>()) };
                (word.load(Ordering::Relaxed) >> s) as u8
            }
            // SAFETY: a byte inside the memory, valid (contract).
            None => unsafe { AtomicU8::from_ptr(self.unit) }.load(Ordering::Relaxed),
        }
    }

    /// Sets the byte to `value`, leaving its word's other bytes as they are (a compare-and-swap
    /// loop for a byte inside a word, as [`RacyBytes::write`] does).
    ///
    /// # Safety
    /// As [`load`](Self::load).
    #[inline]
    pub(crate) unsafe fn store(&self, value: u8) {
        match self.shift {
            Some(s) => {
                // SAFETY: as in `load`.
                let atom = unsafe { AtomicU64::from_ptr(self.unit.cast::<u64>()) };
                let (mask, bits) = (!(0xffu64 << s), u64::from(value) << s);
                let mut cur = atom.load(Ordering::Relaxed);
                while let Err(now) =
                    atom.compare_exchange_weak(cur, cur & mask | bits, Ordering::Relaxed, Ordering::Relaxed)
                {
                    cur = now;
                }
            }
            // SAFETY: as in `load`.
            None => unsafe { AtomicU8::from_ptr(self.unit) }.store(value, Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Owned memory for tests, 8-aligned, viewed at an offset so that the ends are unaligned.
    struct Mem {
        buf: Box<[AtomicU64]>,
    }

    impl Mem {
        fn new(words: usize) -> Mem {
            Mem { buf: (0..words).map(|_| AtomicU64::new(0)).collect() }
        }
        fn view(&self, skip: usize, len: usize) -> RacyBytes {
            assert!(skip + len <= self.buf.len() * WORD);
            // SAFETY: inside the buffer, which outlives the view in every test, and is only
            // accessed through RacyBytes views of the same bounds.
            unsafe { RacyBytes::new(self.buf.as_ptr().cast::<u8>().cast_mut().add(skip), len) }
        }
    }

    // Each view gets memory of its own: Miri's weak-memory emulation cannot follow one location
    // accessed with two access sizes even in one thread (a limitation of the tool, not UB).
    #[test]
    fn copies_round_trip_at_every_alignment() {
        for skip in 0..8 {
            let lens: &[usize] = if cfg!(miri) { &[9, 23] } else { &[1, 7, 8, 9, 23, 40] };
            for &len in lens {
                let mem = Mem::new(8);
                let r = mem.view(skip, len);
                r.fill(0);
                let step = if cfg!(miri) { 5 } else { 1 };
                for off in (0..len).step_by(step) {
                    for n in (0..=(len - off).min(17)).step_by(step) {
                        let data: Vec<u8> = (0..n).map(|i| (i + off + 1) as u8).collect();
                        r.write(off, &data);
                        let mut back = vec![0; n];
                        r.read(off, &mut back);
                        assert_eq!(back, data, "skip {skip} len {len} off {off} n {n}");
                    }
                }
                let mut all = vec![0; len];
                r.fill(0xab);
                r.read(0, &mut all);
                assert!(all.iter().all(|&b| b == 0xab));
            }
        }
    }

    #[test]
    fn writes_do_not_touch_neighbours() {
        let mem = Mem::new(4);
        let r = mem.view(3, 26);
        r.fill(0x11);
        r.write(6, &[1, 2, 3]);
        let mut all = [0u8; 26];
        r.read(0, &mut all);
        let mut want = [0x11u8; 26];
        want[6..9].copy_from_slice(&[1, 2, 3]);
        assert_eq!(all, want);
        // Bytes outside the view were never written (read alone, as the view reads the bytes of
        // the words they share).
        let base = mem.buf.as_ptr().cast::<u8>().cast_mut();
        for i in (0..3).chain(29..32) {
            // SAFETY: inside the buffer; byte-sized like every access to these words.
            assert_eq!(unsafe { AtomicU8::from_ptr(base.add(i)) }.load(Ordering::Relaxed), 0, "byte {i}");
        }
    }

    #[test]
    fn load_u64_needs_a_whole_aligned_word_inside() {
        let mem = Mem::new(4);
        let r = mem.view(8, 16);
        r.write(0, &7u64.to_ne_bytes());
        assert_eq!(r.load_u64(0), Some(7));
        assert_eq!(r.load_u64(8), Some(0));
        assert_eq!(r.load_u64(4), None, "misaligned");
        assert_eq!(r.load_u64(16), None, "outside");
        assert_eq!(r.load_u64(usize::MAX), None, "overflow");
        let mem = Mem::new(4);
        let r = mem.view(3, 20);
        r.write(5, &7u64.to_ne_bytes());
        assert_eq!(r.load_u64(5), Some(7), "the word at address 8, written above");
        assert_eq!(r.load_u64(13), None, "a word that runs past the end");
    }

    #[test]
    fn a_byte_unit_reads_and_writes_the_byte_the_copies_do() {
        for skip in 0..8 {
            let mem = Mem::new(5);
            let r = mem.view(skip, 29);
            r.fill(0x5a);
            for off in (0..29).step_by(if cfg!(miri) { 3 } else { 1 }) {
                let b = r.byte_unit(off);
                // SAFETY: `mem` outlives the unit.
                unsafe {
                    assert_eq!(b.load(), 0x5a, "skip {skip} off {off}");
                    b.store(off as u8 + 1);
                    assert_eq!(b.load(), off as u8 + 1);
                }
                let mut all = [0u8; 29];
                r.read(0, &mut all);
                for (i, &x) in all.iter().enumerate() {
                    let want = if i == off { off as u8 + 1 } else { 0x5a };
                    assert_eq!(x, want, "byte {i} after a store to {off} (skip {skip})");
                }
                r.write(off, &[0xa0]);
                // SAFETY: as above.
                assert_eq!(unsafe { b.load() }, 0xa0, "the unit sees the copy");
                r.write(off, &[0x5a]);
            }
        }
    }

    // Regression (soundness hole 6): copies used volatile accesses, a data race between two
    // threads (ThreadSanitizer and Miri report it). Now every access is atomic and of one size
    // per byte; Miri checks both.
    #[test]
    fn threads_copy_in_and_out_concurrently_without_a_data_race() {
        let mem = Arc::new(Mem::new(6));
        let rounds = if cfg!(miri) { 20 } else { 2_000 };
        let threads: Vec<_> = (0..3u8)
            .map(|t| {
                let mem = mem.clone();
                std::thread::spawn(move || {
                    let r = mem.view(3, 40);
                    let mut buf = [0u8; 40];
                    for i in 0..rounds {
                        let off = (i * 7 + usize::from(t) * 5) % 30;
                        let n = (i % 10) + 1;
                        if (i + usize::from(t)) % 2 == 0 {
                            r.write(off, &[t; 10][..n]);
                        } else {
                            r.read(off, &mut buf[..n]);
                            assert!(buf[..n].iter().all(|&b| b < 3), "only values the threads wrote");
                        }
                        if i % 17 == 0 {
                            r.fill(t);
                        }
                        let _ = r.load_u64(5);
                        let unit = r.byte_unit(usize::from(t) * 9 + i % 4);
                        // SAFETY: `mem` outlives the unit.
                        unsafe {
                            unit.store(t);
                            assert!(unit.load() < 3, "only values the threads wrote");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
