//! How a request is cut into pieces, and the ring of per-request slots: pure logic, no verbs.

use crate::queue::WcStatus;

/// One piece of a request: which queue pair, and which bytes of the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) qp: usize,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

/// The pieces of a request of `len` bytes over `qps` queue pairs starting at `first`
/// (round-robin position): one whole piece unless `split` and `len > threshold`, else
/// `ceil(len / qps)` rounded up to `align`, the last piece taking the remainder (so fewer than
/// `qps` pieces when rounding leaves nothing for the last ones). Never more than `qps` pieces,
/// never an empty piece (except the single piece of an empty request).
pub(crate) fn pieces(
    len: usize,
    qps: usize,
    first: usize,
    split: bool,
    threshold: usize,
    align: usize,
) -> impl Iterator<Item = Piece> {
    let qps = qps.max(1);
    let chunk = if split && len > threshold && qps > 1 {
        let per = len.div_ceil(qps);
        let align = align.max(1);
        per.div_ceil(align).saturating_mul(align).max(1)
    } else {
        len.max(1)
    };
    let count = if len == 0 { 1 } else { len.div_ceil(chunk) };
    (0..count).map(move |k| {
        let offset = k * chunk;
        Piece { qp: (first + k) % qps, offset, len: chunk.min(len - offset) }
    })
}

/// The top byte of every piece's wire `wr_id`: a completion of the connection's queue pairs
/// with another `wr_id` (the usual small numbers, offsets) is never taken for a piece.
const WIRE_MARK: u64 = 0x57 << 56;
/// Bits 0..56 of a wire `wr_id`: the generation (24 bits), the queue pair and the slot.
const GEN_AND_BELOW: u64 = (1 << 56) - 1;

/// A slot generation's low 24 bits, as a wire `wr_id` carries them.
fn gen_bits(gen: u32) -> u64 {
    u64::from(gen) & 0xff_ffff
}

/// The queue pair (index) a piece's wire `wr_id` ([`Slots::wire_id`]) names.
pub(crate) fn wire_qp(wire: u64) -> usize {
    (wire >> 24) as usize & 0xff
}

/// What a slot remembers of one outstanding request.
#[derive(Debug)]
pub(crate) struct Slot<H> {
    /// Bumped each time the slot is freed: a piece's wire `wr_id` carries it, so a stale piece
    /// completion never counts against a later request.
    pub(crate) gen: u32,
    pub(crate) wr_id: u64,
    /// Pieces posted and not yet completed.
    pub(crate) pending: u32,
    /// The first bad status among the pieces (SUCCESS while all are good).
    pub(crate) status: WcStatus,
    pub(crate) len: u64,
    /// An RDMA Read (else a Write).
    pub(crate) read: bool,
    pub(crate) hold: Option<H>,
}

/// A fixed ring of request slots with a free stack: allocated once, nothing per request.
#[derive(Debug)]
pub(crate) struct Slots<H> {
    slots: Box<[Slot<H>]>,
    free: Vec<u32>,
}

impl<H> Slots<H> {
    pub(crate) fn new(n: u32) -> Slots<H> {
        let slots = (0..n)
            .map(|_| Slot {
                gen: 0,
                wr_id: 0,
                pending: 0,
                status: WcStatus::SUCCESS,
                len: 0,
                read: false,
                hold: None,
            })
            .collect();
        Slots { slots, free: (0..n).rev().collect() }
    }

    /// Number of requests outstanding.
    pub(crate) fn outstanding(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Takes a free slot for a request; `None` when all are in use.
    pub(crate) fn acquire(&mut self, wr_id: u64, len: u64) -> Option<u32> {
        let i = self.free.pop()?;
        let s = &mut self.slots[i as usize];
        s.wr_id = wr_id;
        s.pending = 0;
        s.status = WcStatus::SUCCESS;
        s.len = len;
        Some(i)
    }

    /// The wire `wr_id` of slot `i`'s piece on queue pair `qp`: the slot's generation in the
    /// high 32 bits, `qp` in bits 24..32 and `i` below, so that a completion names the queue
    /// pair its piece was posted on ([`wire_qp`]) and one of another queue pair sharing the CQ
    /// is told apart.
    pub(crate) fn wire_id(&self, i: u32, qp: usize) -> u64 {
        debug_assert!(i < 1 << 24 && qp < 1 << 8);
        WIRE_MARK | gen_bits(self.slots[i as usize].gen) << 32 | (qp as u64) << 24 | u64::from(i)
    }

    pub(crate) fn get_mut(&mut self, i: u32) -> &mut Slot<H> {
        &mut self.slots[i as usize]
    }

    /// The slot a piece completion names, if it is the current request of that slot and has a
    /// piece outstanding.
    pub(crate) fn lookup(&mut self, wire: u64) -> Option<u32> {
        if wire & !GEN_AND_BELOW != WIRE_MARK {
            return None;
        }
        let i = wire as u32 & 0xff_ffff;
        let s = self.slots.get(i as usize)?;
        (gen_bits(s.gen) == (wire & GEN_AND_BELOW) >> 32 && s.pending > 0).then_some(i)
    }

    /// Frees slot `i`, returning what it held.
    pub(crate) fn release(&mut self, i: u32) -> Option<H> {
        let s = &mut self.slots[i as usize];
        s.gen = s.gen.wrapping_add(1);
        s.pending = 0;
        self.free.push(i);
        s.hold.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(len: usize, qps: usize, first: usize, split: bool) -> Vec<Piece> {
        pieces(len, qps, first, split, 4096, 128).collect()
    }

    #[test]
    fn small_requests_go_whole_round_robin() {
        assert_eq!(collect(100, 4, 2, true), vec![Piece { qp: 2, offset: 0, len: 100 }]);
        assert_eq!(collect(4096, 4, 3, true), vec![Piece { qp: 3, offset: 0, len: 4096 }]);
        assert_eq!(collect(0, 4, 1, true), vec![Piece { qp: 1, offset: 0, len: 0 }]);
        assert_eq!(collect(1 << 20, 4, 1, false), vec![Piece { qp: 1, offset: 0, len: 1 << 20 }]);
    }

    #[test]
    fn large_requests_split_in_aligned_equal_chunks_last_takes_rest() {
        let p = collect(1 << 20, 4, 1, true);
        assert_eq!(p.len(), 4);
        assert!(p.iter().all(|p| p.len == 1 << 18));
        assert_eq!(p.iter().map(|p| p.qp).collect::<Vec<_>>(), vec![1, 2, 3, 0]);
        let p = collect(10_001, 3, 0, true);
        assert_eq!(p.iter().map(|p| p.len).collect::<Vec<_>>(), vec![3456, 3456, 3089]);
    }

    #[test]
    fn pieces_cover_the_request_exactly_for_all_sizes() {
        let sizes = if cfg!(miri) { 300 } else { 20_000 };
        for qps in 1..=8 {
            for len in (0..sizes).map(|i| i * 37 + i % 5) {
                let mut next = 0;
                let mut used = [false; 8];
                for p in pieces(len, qps, 5, true, 1000, 64) {
                    assert_eq!(p.offset, next);
                    assert!(p.len > 0 || len == 0);
                    assert!(!std::mem::replace(&mut used[p.qp], true), "one piece per QP");
                    next += p.len;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn slots_reject_stale_and_foreign_ids() {
        let mut s: Slots<()> = Slots::new(2);
        let a = s.acquire(7, 1).unwrap();
        let wire = s.wire_id(a, 0);
        assert_eq!(s.lookup(wire), None, "no piece outstanding yet");
        s.get_mut(a).pending = 1;
        assert_eq!(s.lookup(wire), Some(a));
        let on_63 = s.wire_id(a, 63);
        assert_eq!((wire_qp(wire), wire_qp(on_63)), (0, 63));
        assert_eq!(s.lookup(on_63), Some(a), "every piece of a request names its slot");
        s.release(a);
        assert_eq!(s.lookup(wire), None, "freed");
        let b = s.acquire(8, 1).unwrap();
        let c = s.acquire(9, 1).unwrap();
        assert!(s.acquire(10, 1).is_none());
        s.get_mut(b).pending = 1;
        s.get_mut(c).pending = 1;
        assert_eq!(s.lookup(wire), None, "a reused slot has a new generation");
        assert_eq!(s.lookup(u64::MAX), None);
        // The usual wr_ids of other requests (0, small counters) never name a piece, even where
        // their low bits match a live one's.
        let live = s.wire_id(b, 0);
        assert_eq!(s.lookup(live), Some(b));
        assert_eq!(s.lookup(live & 0xffff_ffff), None);
        assert_eq!(s.lookup(0), None);
        assert_eq!(s.outstanding(), 2);
    }
}
