//! Completion accounting over a real device, one test per data path, each through the same
//! checker: every request posted is recorded in a [`Ledger`] (its `wr_id`, the CQ it completes
//! on, its queue pair, opcode, length, immediate data and buffers), and every completion polled
//! is consumed by it. An untracked completion, a `wr_id` nobody posted, a second completion of
//! one, a completion of an unsignaled request, a wrong status, opcode, queue pair, length or
//! payload fails the test; so does a completion that does not come within a bound.
//!
//! Every CQ is drained by [`drain_exact`]: polls with an array of 32 entries (larger than the
//! 1 to 8 completions outstanding: a poll must stop where the CQ is empty) until exactly the
//! expected number arrived, then 50 more polls of the empty CQ that must find nothing. rdma-core's
//! rxe provider corrupts an extended CQ whose `ibv_next_poll` reaches an empty CQ; tests that
//! always polled arrays exactly as large as the completions expected never saw it, these would
//! (zeroed "successful" completions with `wr_id` 0, real ones lost).
//!
//! Each test runs 100 rounds (10 under valgrind) of 1 to 4 requests (some signaled, some not where the API
//! allows), payloads checked, over every kind of CQ the device has (classic, and extended where
//! `ibv_create_cq_ex` works: on siw it does not, which is reported).

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ibverbs::striped::{StripeBuf, StripeOptions, StripedCompletion, StripedConnection, StripedOp};
use ibverbs::{
    AccessFlags, BoundWindow, Completion, CompletionChannel, CompletionQueue, Context, Error, Local,
    MemoryRegion, MemoryWindow, MwType, ProtectionDomain, QpCaps, QpType, QueuePair, RecvRequest, Scope,
    ScopedRecv, ScopedSend, SendOps, SendRequest, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};

/// Rounds per test (and per CQ kind where a test runs over both).
/// Rounds per test: 100, fewer under valgrind (its time scale divides them), at least 10.
fn round_count() -> u64 {
    (100 / u64::from(time_scale())).max(10)
}
/// Entries of every polling array: more than the completions ever outstanding on one CQ.
const POLL_ENTRIES: usize = 32;
/// Polls of a drained CQ that must find it empty.
const QUIET_POLLS: usize = 50;
/// Bytes of one request's slot in the test buffers.
const SLOT: usize = 256;

/// A tiny deterministic generator (xorshift), seeded per test.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 0
    }
    /// Requests in a round: 1..=4.
    fn count(&mut self) -> usize {
        1 + self.below(4) as usize
    }
    /// A length in 1..=max.
    fn len(&mut self, max: usize) -> usize {
        1 + self.below(max as u64) as usize
    }
}

/// What a completion hands back.
#[derive(Debug, Clone, PartialEq)]
enum Bufs {
    /// Nothing: scoped, prepared and inline requests, receives without a buffer.
    None,
    /// The owned region posted; for a receive its first bytes are these (the message), for a
    /// send they are the source, intact.
    Region(Option<Vec<u8>>),
    /// Left in the completion for the test to take (windows, SRQ buffers, striped buffers).
    Keep,
}

/// What one posted, signaled request must complete as.
#[derive(Debug, Clone)]
struct Expect {
    /// The CQ (by the test's name for it) it completes on.
    cq: &'static str,
    /// The queue pair it was posted on (`None`: any, e.g. a shared receive queue's receive).
    qp_num: Option<u32>,
    opcode: WcOpcode,
    /// Bytes received (receives only; a send's `byte_len` is not defined).
    byte_len: Option<u32>,
    /// The immediate data it carries (checked for every completion: `None` must be `None`).
    imm: Option<u32>,
    bufs: Bufs,
}

impl Expect {
    fn send(cq: &'static str, qp: &QueuePair, opcode: WcOpcode, bufs: Bufs) -> Expect {
        Expect { cq, qp_num: Some(qp.qp_num()), opcode, byte_len: None, imm: None, bufs }
    }
    fn recv(
        cq: &'static str,
        qp_num: Option<u32>,
        opcode: WcOpcode,
        len: usize,
        imm: Option<u32>,
        bufs: Bufs,
    ) -> Expect {
        Expect { cq, qp_num, opcode, byte_len: Some(len as u32), imm, bufs }
    }
}

/// Every request posted, and what became of it.
struct Ledger {
    test: &'static str,
    next: u64,
    /// Signaled requests posted whose completion has not come yet.
    pending: HashMap<u64, Expect>,
    /// Unsignaled requests: no completion may ever name them.
    silent: HashSet<u64>,
    /// Requests whose completion came.
    seen: HashSet<u64>,
    /// Rounds settled.
    rounds: u64,
    polls: u64,
    empty_polls: u64,
}

impl Ledger {
    fn new(test: &'static str, base: u64) -> Ledger {
        Ledger {
            test,
            next: base << 32,
            pending: HashMap::new(),
            silent: HashSet::new(),
            seen: HashSet::new(),
            rounds: 0,
            polls: 0,
            empty_polls: 0,
        }
    }

    /// A `wr_id` never used before in this test.
    fn fresh(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Records a signaled request; returns its `wr_id`.
    fn expect(&mut self, e: Expect) -> u64 {
        let id = self.fresh();
        self.pending.insert(id, e);
        id
    }

    /// Records an unsignaled request; returns its `wr_id`.
    fn unsignaled(&mut self) -> u64 {
        let id = self.fresh();
        self.silent.insert(id);
        id
    }

    /// Records a request signaled or not; returns its `wr_id`.
    fn post(&mut self, signaled: bool, e: Expect) -> u64 {
        if signaled {
            self.expect(e)
        } else {
            self.unsignaled()
        }
    }

    /// The expectation of `wr_id`, completed on `cq`: panics for a `wr_id` nobody posted, one
    /// already completed, one posted unsignaled, or one that belongs to another CQ.
    fn take(&mut self, wr_id: u64, cq: &str) -> Expect {
        let test = self.test;
        if let Some(e) = self.pending.remove(&wr_id) {
            assert_eq!(
                e.cq, cq,
                "{test}: wr_id {wr_id:#x} completed on CQ {cq}, but was posted to complete on {}",
                e.cq
            );
            self.seen.insert(wr_id);
            return e;
        }
        if self.seen.contains(&wr_id) {
            panic!("{test}: a second completion of wr_id {wr_id:#x} on CQ {cq}");
        }
        if self.silent.contains(&wr_id) {
            panic!("{test}: a completion on CQ {cq} of wr_id {wr_id:#x}, which was posted unsignaled");
        }
        panic!("{test}: a phantom completion on CQ {cq}: wr_id {wr_id:#x} was never posted")
    }

    /// Checks `c`, polled from `cq`, against its request, and takes the buffers it hands back
    /// (but those of [`Bufs::Keep`]).
    fn consume(&mut self, c: &mut Completion, cq: &str) {
        let test = self.test;
        assert!(
            c.is_tracked(),
            "{test}: an untracked completion on CQ {cq} (no request posted through the safe API): {c:?}"
        );
        let wr_id = c.wr_id();
        let e = self.take(wr_id, cq);
        assert_eq!(c.status(), WcStatus::SUCCESS, "{test}: wr_id {wr_id:#x} on {cq}: {c:?}");
        assert_eq!(c.opcode(), e.opcode, "{test}: wr_id {wr_id:#x} on {cq}: {c:?}");
        if let Some(qpn) = e.qp_num {
            assert_eq!(c.qp_num(), qpn, "{test}: wr_id {wr_id:#x} on {cq}: the queue pair: {c:?}");
        }
        if let Some(len) = e.byte_len {
            assert_eq!(c.byte_len(), len, "{test}: wr_id {wr_id:#x} on {cq}: byte_len: {c:?}");
        }
        assert_eq!(c.imm_data(), e.imm, "{test}: wr_id {wr_id:#x} on {cq}: immediate data: {c:?}");
        match e.bufs {
            Bufs::None => assert_eq!(c.take_buffers().count(), 0, "{test}: wr_id {wr_id:#x}: held no buffer"),
            Bufs::Region(data) => {
                let r = c
                    .take_region()
                    .unwrap_or_else(|| panic!("{test}: wr_id {wr_id:#x}: its region comes back"));
                if let Some(d) = data {
                    assert_eq!(&r[..d.len()], &d[..], "{test}: wr_id {wr_id:#x} on {cq}: the payload");
                }
                assert_eq!(c.take_buffers().count(), 0, "{test}: wr_id {wr_id:#x}: one region only");
            }
            Bufs::Keep => {}
        }
    }

    /// Every signaled request completed.
    fn settled(&mut self, round: u64) {
        self.rounds += 1;
        let mut left: Vec<_> = self.pending.iter().map(|(id, e)| (*id, e.cq, e.opcode)).collect();
        left.sort_unstable_by_key(|l| l.0);
        assert!(left.is_empty(), "{}: round {round}: requests never completed: {left:x?}", self.test);
    }

    fn summary(&self) {
        println!(
            "{}: {} rounds, {} completions accounted, {} unsignaled requests never completed, {} polls ({} of them of an empty CQ)",
            self.test,
            self.rounds,
            self.seen.len(),
            self.silent.len(),
            self.polls,
            self.empty_polls
        );
    }
}

/// What [`drain_exact`] polls: a CQ, or a scope's CQ.
trait Poller {
    fn poll_into<'c>(&mut self, out: &'c mut [Completion]) -> ibverbs::Result<&'c mut [Completion]>;
}

impl Poller for CompletionQueue {
    fn poll_into<'c>(&mut self, out: &'c mut [Completion]) -> ibverbs::Result<&'c mut [Completion]> {
        self.poll(out)
    }
}

impl Poller for Scope<'_, '_> {
    fn poll_into<'c>(&mut self, out: &'c mut [Completion]) -> ibverbs::Result<&'c mut [Completion]> {
        self.poll(out)
    }
}

/// Polls `cq` (called `name` in the ledger) with an array of [`POLL_ENTRIES`] until exactly `n`
/// completions came (within 10 s), each consumed by `ledger`, then [`QUIET_POLLS`] more times,
/// each of which must find the CQ empty. Returns the completions, in order, with what
/// [`Bufs::Keep`] left in them.
fn drain_exact(cq: &mut impl Poller, ledger: &mut Ledger, name: &'static str, n: usize) -> Vec<Completion> {
    let test = ledger.test;
    let deadline = Instant::now() + scaled(Duration::from_secs(10));
    let mut out: [Completion; POLL_ENTRIES] = Default::default();
    let mut got: Vec<Completion> = Vec::with_capacity(n);
    while got.len() < n {
        let batch = cq.poll_into(&mut out).unwrap_or_else(|e| panic!("{test}: polling {name}: {e}"));
        ledger.polls += 1;
        let k = batch.len();
        for c in batch.iter_mut() {
            ledger.consume(c, name);
            got.push(std::mem::take(c));
        }
        assert!(got.len() <= n, "{test}: {} completions on {name} where {n} were expected", got.len());
        if k == 0 {
            ledger.empty_polls += 1;
            if Instant::now() > deadline {
                let mut missing: Vec<u64> =
                    ledger.pending.iter().filter(|(_, e)| e.cq == name).map(|(id, _)| *id).collect();
                missing.sort_unstable();
                panic!(
                    "{test}: timed out on {name}: {} of {n} completions came; missing {missing:x?}",
                    got.len()
                );
            }
            std::thread::yield_now();
        }
    }
    for i in 0..QUIET_POLLS {
        let batch = cq.poll_into(&mut out).unwrap_or_else(|e| panic!("{test}: polling {name}: {e}"));
        ledger.polls += 1;
        ledger.empty_polls += 1;
        if let Some(c) = batch.first() {
            panic!(
                "{test}: {name} drained of its {n} completions, then its poll {} of the empty CQ returned {} more: {c:?}",
                i + 1,
                batch.len()
            );
        }
        if i % 8 == 7 {
            std::thread::yield_now();
        }
    }
    got
}

/// Classic or extended CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CqKind {
    Classic,
    Extended,
}

fn create_cq(
    ctx: &Context,
    kind: CqKind,
    depth: u32,
    channel: Option<&CompletionChannel>,
) -> CompletionQueue {
    match kind {
        CqKind::Classic => ctx.create_cq(depth, channel).unwrap(),
        CqKind::Extended => ctx.create_cq_ex(depth, channel, WcFlags::STANDARD).unwrap(),
    }
}

/// Whether `r` is the crate's typed error for a missing `feature`, which is then reported; panics
/// on any other error.
fn refused(ctx: &Context, r: Result<(), Error>, feature: &'static str) -> bool {
    match r {
        Ok(()) => false,
        Err(Error::Unsupported { capability, .. }) if capability == feature => {
            unsupported(ctx, feature, "the provider answers EOPNOTSUPP");
            true
        }
        Err(e) => panic!("{feature}: unexpected error {e:?}"),
    }
}

/// The CQ kinds of the device: classic, and extended where it has them (else reported).
fn cq_kinds(ctx: &Context) -> Vec<CqKind> {
    if refused(ctx, ctx.create_cq_ex(4, None, WcFlags::STANDARD).map(drop), "extended CQs") {
        vec![CqKind::Classic]
    } else {
        vec![CqKind::Classic, CqKind::Extended]
    }
}

/// Whether the device has extended queue pairs (else reported).
fn has_extended_qp(ctx: &Context) -> bool {
    let (pd, cq) = (ctx.alloc_pd().unwrap(), ctx.create_cq(4, None).unwrap());
    let qp = pd.create_qp(&cq, QpType::RC).max_send_wr(1).max_recv_wr(1).send_ops(SendOps::SEND).build();
    !refused(ctx, qp.map(drop), "extended QPs")
}

/// A connected RC pair whose CQs are of `kind`; extended queue pairs with `ops` when given. On
/// iWARP connected through RDMA-CM.
fn pair_on(kind: CqKind, ops: Option<SendOps>, depth: u32) -> Pair {
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = create_cq(&ctx, kind, 4 * depth, None);
    let cq_b = create_cq(&ctx, kind, 4 * depth, None);
    let caps = QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let (a, b, cm) = {
        let build = |cq| {
            let pd = &pd;
            move || {
                let b = pd.create_qp(cq, QpType::RC).caps(caps);
                match ops {
                    Some(o) => b.send_ops(o),
                    None => b,
                }
            }
        };
        connect_built(&pd, build(&cq_a), build(&cq_b))
    };
    assert_eq!(a.send_ops().is_some(), ops.is_some());
    assert_eq!(cq_a.cq_ex_raw().is_some(), kind == CqKind::Extended);
    Pair { ctx, pd, cq_a, cq_b, a, b, cm }
}

/// An owned region holding `data`.
fn region(pd: &ProtectionDomain, data: &[u8]) -> MemoryRegion {
    let mut m = pd.allocate(data.len()).unwrap();
    m.copy_from_slice(data);
    m
}

/// The source of a send holding `data`: owned when the request is signaled (it comes back in the
/// completion), shared when not (an unsignaled request holds only shared buffers, dropped when a
/// later completion releases it): a clone is kept in `held` for [`released`].
fn source(pd: &ProtectionDomain, data: &[u8], signaled: bool, held: &mut Vec<Arc<MemoryRegion>>) -> Local {
    if signaled {
        Local::whole(region(pd, data))
    } else {
        let shared = Arc::new(region(pd, data));
        held.push(shared.clone());
        Local::whole(shared)
    }
}

/// Every unsignaled request's buffer of `held` was released (its queue pair holds it no more).
fn released(held: &mut Vec<Arc<MemoryRegion>>, test: &str, round: u64) {
    for (i, b) in held.drain(..).enumerate() {
        assert_eq!(
            Arc::strong_count(&b),
            1,
            "{test}: round {round}: unsignaled request {i}'s buffer never released"
        );
    }
}

/// The bytes `read` returns once the RDMA Writes `writes` (offset, data) whose completions were
/// polled have landed: at once on InfiniBand and RoCE, where a Write completes once the responder
/// acknowledged it; on iWARP, where a Write completes once TCP took its data, once they are all
/// there or after 10 s (the checks that follow then report the difference).
fn landed(read: impl Fn() -> Vec<u8>, writes: &[(usize, &[u8])]) -> Vec<u8> {
    let mut bytes = read();
    if is_iwarp() {
        let deadline = Instant::now() + scaled(Duration::from_secs(10));
        let there = |b: &[u8]| writes.iter().all(|(off, d)| b.get(*off..off + d.len()) == Some(*d));
        while !there(&bytes) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
            bytes = read();
        }
    }
    bytes
}

/// The requests of the Send/Write rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Send,
    SendInline,
    Write,
    WriteImm,
}

/// Rounds of 1 to 4 Sends (owned or inline, with immediate data or not) and RDMA Writes (with
/// immediate data or not) from `p.a` to `p.b`, the receives posted first (singly or as a
/// chain), the sends posted singly or as a chain, each signaled or not (the last always).
fn send_write_rounds(p: &mut Pair, ledger: &mut Ledger, rng: &mut Rng, imm: bool) {
    let target = Arc::new(p.pd.allocate_remote(4 * SLOT, AccessFlags::REMOTE_WRITE).unwrap());
    let bq = p.b.qp_num();
    for round in 0..round_count() {
        let mut held = Vec::new();
        target.write(0, &[0u8; 4 * SLOT]).unwrap();
        let k = rng.count();
        let ops: Vec<Op> = (0..k)
            .map(|_| match rng.below(if imm { 4 } else { 3 }) {
                0 => Op::Send,
                1 => Op::SendInline,
                2 => Op::Write,
                _ => Op::WriteImm,
            })
            .collect();
        let datas: Vec<Vec<u8>> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| {
                let max = if *op == Op::SendInline { 64 } else { SLOT };
                pattern(rng.len(max), (round * 4 + i as u64) as u8)
            })
            .collect();
        let imms: Vec<Option<u32>> = ops
            .iter()
            .map(|op| match op {
                Op::WriteImm => Some(rng.next() as u32),
                Op::Send | Op::SendInline if imm && rng.coin() => Some(rng.next() as u32),
                _ => None,
            })
            .collect();
        // The receives, in the order the messages that take them arrive.
        let mut recvs = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let len = datas[i].len();
            match op {
                Op::Send | Op::SendInline => {
                    let e = Expect::recv(
                        "b",
                        Some(bq),
                        WcOpcode::RECV,
                        len,
                        imms[i],
                        Bufs::Region(Some(datas[i].clone())),
                    );
                    recvs.push(
                        RecvRequest::new(Local::whole(p.pd.allocate(SLOT).unwrap())).wr_id(ledger.expect(e)),
                    );
                }
                Op::WriteImm => {
                    let e =
                        Expect::recv("b", Some(bq), WcOpcode::RECV_RDMA_WITH_IMM, len, imms[i], Bufs::None);
                    recvs.push(RecvRequest::empty().wr_id(ledger.expect(e)));
                }
                Op::Write => {}
            }
        }
        let n_b = recvs.len();
        if rng.coin() {
            p.b.post_recv_chain(&mut recvs).unwrap();
        } else {
            for r in recvs {
                p.b.post_recv(r).map_err(|e| e.error).unwrap();
            }
        }
        let mut sends = Vec::new();
        let mut n_a = 0;
        for (i, op) in ops.iter().enumerate() {
            let signaled = i + 1 == k || rng.coin();
            n_a += usize::from(signaled);
            let data = &datas[i];
            let remote = target.remote().slice((i * SLOT) as u64, data.len() as u64).unwrap();
            let wr = match op {
                Op::Send => {
                    let wr_id = ledger.post(
                        signaled,
                        Expect::send("a", &p.a, WcOpcode::SEND, Bufs::Region(Some(data.clone()))),
                    );
                    SendRequest::send(source(&p.pd, data, signaled, &mut held)).wr_id(wr_id)
                }
                Op::SendInline => {
                    let wr_id = ledger.post(signaled, Expect::send("a", &p.a, WcOpcode::SEND, Bufs::None));
                    SendRequest::send_inline(data).wr_id(wr_id)
                }
                Op::Write | Op::WriteImm => {
                    let wr_id = ledger.post(
                        signaled,
                        Expect::send("a", &p.a, WcOpcode::RDMA_WRITE, Bufs::Region(Some(data.clone()))),
                    );
                    SendRequest::write(source(&p.pd, data, signaled, &mut held), remote).wr_id(wr_id)
                }
            };
            let wr = maybe_imm(wr, imms[i]);
            sends.push(if signaled { wr } else { wr.unsignaled() });
        }
        if rng.coin() {
            p.a.post_send_chain(&mut sends).unwrap();
        } else {
            for wr in sends {
                p.a.post_send(wr).map_err(|e| e.error).unwrap();
            }
        }
        if rng.coin() {
            drain_exact(&mut p.cq_a, ledger, "a", n_a);
            drain_exact(&mut p.cq_b, ledger, "b", n_b);
        } else {
            drain_exact(&mut p.cq_b, ledger, "b", n_b);
            drain_exact(&mut p.cq_a, ledger, "a", n_a);
        }
        ledger.settled(round);
        released(&mut held, ledger.test, round);
        assert_eq!(
            (p.a.outstanding_sends(), p.b.outstanding_recvs()),
            (0, 0),
            "round {round}: every slot released"
        );
        let writes: Vec<(usize, &[u8])> = (0..k)
            .filter(|&i| matches!(ops[i], Op::Write | Op::WriteImm))
            .map(|i| (i * SLOT, &datas[i][..]))
            .collect();
        let got = landed(|| target.to_vec(), &writes);
        for (i, op) in ops.iter().enumerate() {
            if matches!(op, Op::Write | Op::WriteImm) {
                assert_eq!(&got[i * SLOT..][..datas[i].len()], &datas[i][..], "round {round}: write {i}");
            }
        }
    }
}

/// Data path `path` (its ledger's base and its seed): the Send/Write rounds on a pair whose CQs
/// are `kind` and whose queue pairs post through `ops` (extended) or classically.
fn send_write_path(kind: CqKind, ops: Option<SendOps>, test: &'static str, path: u64) {
    let mut p = pair_on(kind, ops, 16);
    let imm = has_immediate(&p.ctx);
    let mut ledger = Ledger::new(test, path);
    let mut rng = Rng::new(0x5eed_0000 + path);
    send_write_rounds(&mut p, &mut ledger, &mut rng, imm);
    ledger.summary();
}

/// Data path 1: Classic CQs and classic queue pairs: Send/Recv, RDMA Write, and RDMA Write with
/// immediate where the transport has it.
#[test]
fn classic_cq_classic_qp_sends_and_writes_every_completion_once() {
    send_write_path(CqKind::Classic, None, "classic CQ, classic QP", 1);
}

/// Data path 2: Extended CQs (`ibv_create_cq_ex`) and classic queue pairs: the path rxe's provider
/// corrupted once a poll's `ibv_next_poll` reached the empty CQ.
#[test]
fn extended_cq_classic_qp_sends_and_writes_every_completion_once() {
    let ctx = pair_context();
    if !cq_kinds(&ctx).contains(&CqKind::Extended) {
        return;
    }
    send_write_path(CqKind::Extended, None, "extended CQ, classic QP", 2);
}

/// Data path 3: Extended queue pairs (posting with the `ibv_wr_*` builders) on extended CQs.
#[test]
fn extended_cq_extended_qp_sends_and_writes_every_completion_once() {
    let ctx = pair_context();
    if !cq_kinds(&ctx).contains(&CqKind::Extended) || !has_extended_qp(&ctx) {
        return;
    }
    let ops = SendOps::SEND | SendOps::SEND_WITH_IMM | SendOps::RDMA_WRITE | SendOps::RDMA_WRITE_WITH_IMM;
    send_write_path(CqKind::Extended, Some(ops), "extended CQ, extended QP", 3);
}

/// Data path 4: Receives from a shared receive queue: two receivers on one SRQ, each completing
/// into its own CQ (a classic one, and one of each kind the device has), two senders on one CQ.
/// Which receive a message takes is the device's choice: every receive completes once, on the CQ of
/// the receiver the message went to, in the order its sender sent, with its own buffer.
#[test]
fn srq_receives_every_completion_once() {
    let ctx = pair_context();
    let kinds = cq_kinds(&ctx);
    let mut ledger = Ledger::new("SRQ", 4);
    let mut rng = Rng::new(0x5eed_0004);
    for kind in kinds {
        let pd = ctx.alloc_pd().unwrap();
        let mut srq = pd.create_srq(32, 1).unwrap();
        let mut cq_r = [create_cq(&ctx, CqKind::Classic, 64, None), create_cq(&ctx, kind, 64, None)];
        let mut cq_s = create_cq(&ctx, kind, 128, None);
        let (r0, mut s0, _cm0) = rc_on_srq(&pd, &srq, &cq_r[0], &cq_s);
        let (r1, mut s1, _cm1) = rc_on_srq(&pd, &srq, &cq_r[1], &cq_s);
        let rq = [r0.qp_num(), r1.qp_num()];
        for round in 0..round_count() {
            let mut held = Vec::new();
            let k = rng.count();
            // The SRQ's receives: any receiver may take any of them.
            let mut addrs = HashMap::new();
            let mut recvs = Vec::new();
            for _ in 0..k {
                let mr = pd.allocate(SLOT).unwrap();
                let id = ledger.expect(Expect {
                    cq: "r",
                    qp_num: None,
                    opcode: WcOpcode::RECV,
                    byte_len: None,
                    imm: None,
                    bufs: Bufs::Keep,
                });
                addrs.insert(id, mr.addr() as usize);
                recvs.push(RecvRequest::new(Local::whole(mr)).wr_id(id));
            }
            if rng.coin() {
                srq.post_recv_chain(&mut recvs).unwrap();
            } else {
                for r in recvs {
                    srq.post_recv(r).map_err(|e| e.error).unwrap();
                }
            }
            assert_eq!(srq.outstanding() as usize, k);
            // Each message through sender 0 or 1; each sender's last one signaled.
            let to: Vec<usize> = (0..k).map(|_| rng.below(2) as usize).collect();
            let msgs: Vec<Vec<u8>> =
                (0..k).map(|i| pattern(rng.len(SLOT), (round * 8 + i as u64) as u8)).collect();
            let mut n_s = 0;
            for (i, msg) in msgs.iter().enumerate() {
                let s = to[i];
                let last = !to[i + 1..].contains(&s);
                let signaled = last || rng.coin();
                n_s += usize::from(signaled);
                let qp = if s == 0 { &mut s0 } else { &mut s1 };
                let id = ledger
                    .post(signaled, Expect::send("s", qp, WcOpcode::SEND, Bufs::Region(Some(msg.clone()))));
                let wr = SendRequest::send(source(&pd, msg, signaled, &mut held)).wr_id(id);
                qp.post_send(if signaled { wr } else { wr.unsignaled() }).map_err(|e| e.error).unwrap();
            }
            drain_exact(&mut cq_s, &mut ledger, "s", n_s);
            for (r, cq) in cq_r.iter_mut().enumerate() {
                let sent: Vec<&Vec<u8>> =
                    msgs.iter().zip(&to).filter(|(_, &s)| s == r).map(|(m, _)| m).collect();
                let got = drain_exact(cq, &mut ledger, "r", sent.len());
                for (j, mut c) in got.into_iter().enumerate() {
                    assert_eq!(
                        c.qp_num(),
                        rq[r],
                        "{kind:?} round {round}: receiver {r}'s completion on its CQ"
                    );
                    assert_eq!(
                        c.byte_len() as usize,
                        sent[j].len(),
                        "{kind:?} round {round}: receiver {r} message {j}"
                    );
                    let mr = c.take_region().expect("the receive's buffer comes back");
                    assert_eq!(mr.addr() as usize, addrs[&c.wr_id()], "the buffer of this wr_id");
                    assert_eq!(
                        &mr[..sent[j].len()],
                        &sent[j][..],
                        "{kind:?} round {round}: receiver {r} message {j}"
                    );
                    assert_eq!(c.take_buffers().count(), 0);
                }
            }
            ledger.settled(round);
            released(&mut held, ledger.test, round);
            assert_eq!(srq.outstanding(), 0);
            assert_eq!((s0.outstanding_sends(), s1.outstanding_sends()), (0, 0));
        }
    }
    ledger.summary();
}

/// Data path 5a: Prepared requests: RDMA Writes and Sends prepared once and posted with new ranges
/// and `wr_id`s (singly, or as chains with unsignaled posts), into prepared receives of one shared
/// region; over each CQ kind.
#[test]
fn prepared_posts_every_completion_once() {
    let ctx = pair_context();
    let kinds = cq_kinds(&ctx);
    let imm = has_immediate(&ctx).then_some(0x1234_5678);
    let mut ledger = Ledger::new("prepared", 5);
    let mut rng = Rng::new(0x5eed_0005);
    for kind in kinds {
        let mut p = pair_on(kind, None, 16);
        let src = Arc::new(region(&p.pd, &pattern(4 * SLOT, kind as u8 + 1)));
        let target = Arc::new(p.pd.allocate_remote(4 * SLOT, AccessFlags::REMOTE_WRITE).unwrap());
        let landing = Arc::new(p.pd.allocate_remote(4 * SLOT, AccessFlags::empty()).unwrap());
        let write = p.a.prepare_send(SendRequest::write(Local::whole(src.clone()), target.remote())).unwrap();
        let send = p.a.prepare_send(maybe_imm(SendRequest::send(Local::whole(src.clone())), imm)).unwrap();
        let recv = p.b.prepare_recv(RecvRequest::new(Local::whole(landing.clone()))).unwrap();
        for round in 0..round_count() {
            target.write(0, &[0u8; 4 * SLOT]).unwrap();
            landing.write(0, &[0u8; 4 * SLOT]).unwrap();
            let k = rng.count();
            // (is a Send, source offset, length)
            let reqs: Vec<(bool, usize, usize)> = (0..k)
                .map(|_| {
                    let len = rng.len(SLOT);
                    (rng.coin(), rng.below((4 * SLOT - len) as u64 + 1) as usize, len)
                })
                .collect();
            let mut n_b = 0;
            for &(is_send, _, len) in &reqs {
                if is_send {
                    let e = Expect::recv("b", Some(p.b.qp_num()), WcOpcode::RECV, len, imm, Bufs::None);
                    p.b.post_prepared_recv(&recv, ledger.expect(e), n_b * SLOT, SLOT as u32).unwrap();
                    n_b += 1;
                }
            }
            let chain = rng.coin();
            let mut n_a = 0;
            let mut posts = Vec::new();
            let mut sent = 0;
            for (i, &(is_send, off, len)) in reqs.iter().enumerate() {
                // A single post is always signaled; a chain's are signaled at random, the last always.
                let signaled = !chain || i + 1 == k || rng.coin();
                n_a += usize::from(signaled);
                let (prepared, opcode, roff) = if is_send {
                    sent += 1;
                    (&send, WcOpcode::SEND, 0)
                } else {
                    (&write, WcOpcode::RDMA_WRITE, (i * SLOT) as u64)
                };
                let id = ledger.post(signaled, Expect::send("a", &p.a, opcode, Bufs::None));
                if chain {
                    let post = prepared.at(id, off, len as u32, roff);
                    posts.push(if signaled { post } else { post.unsignaled() });
                } else {
                    p.a.post_prepared(prepared, id, off, len as u32, roff).unwrap();
                }
            }
            assert_eq!(sent, n_b);
            if chain {
                p.a.post_prepared_chain(&posts).unwrap();
            }
            drop(posts);
            drain_exact(&mut p.cq_a, &mut ledger, "a", n_a);
            drain_exact(&mut p.cq_b, &mut ledger, "b", n_b);
            ledger.settled(round);
            assert_eq!((p.a.outstanding_sends(), p.b.outstanding_recvs()), (0, 0));
            let writes: Vec<(usize, &[u8])> = (0..k)
                .filter(|&i| !reqs[i].0)
                .map(|i| (i * SLOT, &src[reqs[i].1..reqs[i].1 + reqs[i].2]))
                .collect();
            let (t, l) = (landed(|| target.to_vec(), &writes), landing.to_vec());
            let mut j = 0;
            for (i, &(is_send, off, len)) in reqs.iter().enumerate() {
                if is_send {
                    assert_eq!(
                        &l[j * SLOT..][..len],
                        &src[off..off + len],
                        "{kind:?} round {round}: send {i}"
                    );
                    j += 1;
                } else {
                    assert_eq!(
                        &t[i * SLOT..][..len],
                        &src[off..off + len],
                        "{kind:?} round {round}: write {i}"
                    );
                }
            }
        }
    }
    ledger.summary();
}

/// Data path 5b: Scoped posts: Sends and RDMA Writes from a borrowed region into receives of
/// another borrowed region (nested scopes on both queue pairs), polled through the scope or left to
/// the scope's drain (which keeps them in the CQ for the next polls); over each CQ kind.
#[test]
fn scoped_posts_every_completion_once() {
    let ctx = pair_context();
    let kinds = cq_kinds(&ctx);
    let mut ledger = Ledger::new("scoped", 6);
    let mut rng = Rng::new(0x5eed_0006);
    let (mut kept_a, mut kept_b) = (0, 0);
    for kind in kinds {
        let mut p = pair_on(kind, None, 16);
        let mut src = p.pd.allocate(4 * SLOT).unwrap();
        let mut dst = p.pd.allocate(4 * SLOT).unwrap();
        let target = p.pd.allocate_remote(4 * SLOT, AccessFlags::REMOTE_WRITE).unwrap();
        let (aq, bq) = (p.a.qp_num(), p.b.qp_num());
        for round in 0..round_count() {
            src.copy_from_slice(&pattern(4 * SLOT, round as u8));
            dst.fill(0);
            target.write(0, &[0u8; 4 * SLOT]).unwrap();
            let k = rng.count();
            // (is a Send, length)
            let reqs: Vec<(bool, usize)> = (0..k).map(|_| (rng.coin(), rng.len(SLOT))).collect();
            let n_b = reqs.iter().filter(|r| r.0).count();
            let signaled: Vec<bool> = (0..k).map(|i| i + 1 == k || rng.coin()).collect();
            let n_a = signaled.iter().filter(|&&s| s).count();
            let (poll_a, poll_b) = (rng.coin(), rng.coin());
            let (a, cq_a, b, cq_b) = (&mut p.a, &mut p.cq_a, &mut p.b, &mut p.cq_b);
            b.scope(cq_b, |sb| {
                let whole = sb.local_mut(&mut dst, ..).unwrap();
                for (j, piece) in whole.chunks(SLOT as u32).take(n_b).enumerate() {
                    let len = reqs.iter().filter(|r| r.0).nth(j).unwrap().1;
                    let e = Expect::recv("b", Some(bq), WcOpcode::RECV, len, None, Bufs::None);
                    sb.post_recv(ScopedRecv::new(piece).wr_id(ledger.expect(e)))
                        .map_err(|e| e.error)
                        .unwrap();
                }
                a.scope(cq_a, |sa| {
                    for (i, &(is_send, len)) in reqs.iter().enumerate() {
                        let local = sa.local(&src, i * SLOT..i * SLOT + len).unwrap();
                        let (wr, opcode) = if is_send {
                            (ScopedSend::send(local), WcOpcode::SEND)
                        } else {
                            let remote = target.remote().slice((i * SLOT) as u64, len as u64).unwrap();
                            (ScopedSend::write(local, remote), WcOpcode::RDMA_WRITE)
                        };
                        let e = Expect {
                            cq: "a",
                            qp_num: Some(aq),
                            opcode,
                            byte_len: None,
                            imm: None,
                            bufs: Bufs::None,
                        };
                        let wr = wr.wr_id(ledger.post(signaled[i], e));
                        sa.post_send(if signaled[i] { wr } else { wr.unsignaled() })
                            .map_err(|e| e.error)
                            .unwrap();
                    }
                    if poll_a {
                        drain_exact(sa, &mut ledger, "a", n_a);
                        assert!(!sa.in_flight());
                    }
                })
                .unwrap();
                if poll_b {
                    drain_exact(sb, &mut ledger, "b", n_b);
                }
            })
            .unwrap();
            // What the drains polled is kept in the CQs, in order, for the next polls.
            assert_eq!(p.cq_a.kept(), if poll_a { 0 } else { n_a }, "{kind:?} round {round}");
            assert_eq!(p.cq_b.kept(), if poll_b { 0 } else { n_b }, "{kind:?} round {round}");
            kept_a += p.cq_a.kept();
            kept_b += p.cq_b.kept();
            if !poll_a {
                drain_exact(&mut p.cq_a, &mut ledger, "a", n_a);
            }
            if !poll_b {
                drain_exact(&mut p.cq_b, &mut ledger, "b", n_b);
            }
            ledger.settled(round);
            assert_eq!((p.a.outstanding_sends(), p.b.outstanding_recvs()), (0, 0));
            let writes: Vec<(usize, &[u8])> =
                (0..k).filter(|&i| !reqs[i].0).map(|i| (i * SLOT, &src[i * SLOT..][..reqs[i].1])).collect();
            let t = landed(|| target.to_vec(), &writes);
            let mut j = 0;
            for (i, &(is_send, len)) in reqs.iter().enumerate() {
                let want = &src[i * SLOT..i * SLOT + len];
                if is_send {
                    assert_eq!(&dst[j * SLOT..][..len], want, "{kind:?} round {round}: send {i}");
                    j += 1;
                } else {
                    assert_eq!(&t[i * SLOT..][..len], want, "{kind:?} round {round}: write {i}");
                }
            }
        }
    }
    println!("scoped: {kept_a} send and {kept_b} receive completions came through the drains' kept queues");
    ledger.summary();
}

/// Whether the device has type 2 memory windows (else reported).
fn has_type2_windows(pd: &ProtectionDomain) -> bool {
    match pd.alloc_mw(MwType::Type2) {
        Ok(_) => true,
        Err(Error::Unsupported { capability, .. }) => {
            unsupported(&pd.context(), "memory windows (Type2)", capability);
            false
        }
        Err(e) => panic!("ibv_alloc_mw(Type2): {e:?}"),
    }
}

/// Data path 6: Memory windows: each round binds 1 to 4 type 2 windows on `b` (singly or as a
/// chain), the peer RDMA Writes through each, then sends a Send with Invalidate of each; the window
/// comes back unbound from the receive's completion where the device reports the invalidation
/// (`IBV_WC_WITH_INV`), and is deallocated where it does not. No local invalidation is posted.
#[test]
fn memory_windows_every_completion_once() {
    let ctx = pair_context();
    if !has_type2_windows(&ctx.alloc_pd().unwrap()) {
        return;
    }
    let kinds = cq_kinds(&ctx);
    let mut ledger = Ledger::new("memory windows", 7);
    let mut rng = Rng::new(0x5eed_0007);
    let (mut by_invalidation, mut by_dealloc) = (0u32, 0u32);
    let mut reported = false;
    for kind in kinds {
        let mut p = pair_on(kind, None, 16);
        let exposed = p.pd.allocate_windowed(4 * SLOT, AccessFlags::LOCAL_WRITE).unwrap().expose();
        let mut spare: Vec<MemoryWindow> = Vec::new();
        let bq = p.b.qp_num();
        for round in 0..round_count() {
            let mut held = Vec::new();
            let k = rng.count();
            let mut binds = Vec::new();
            let mut ids = Vec::new();
            for i in 0..k {
                let mw = spare.pop().unwrap_or_else(|| p.pd.alloc_mw(MwType::Type2).unwrap());
                let id = ledger.expect(Expect::send("b", &p.b, WcOpcode::BIND_MW, Bufs::Keep));
                ids.push(id);
                let wr = SendRequest::bind_window(
                    mw,
                    &exposed,
                    i * SLOT..(i + 1) * SLOT,
                    AccessFlags::REMOTE_WRITE,
                )
                .unwrap_or_else(|(_, e)| panic!("bind_window: {e}"));
                binds.push(wr.wr_id(id));
            }
            if rng.coin() {
                p.b.post_send_chain(&mut binds).unwrap();
            } else {
                for wr in binds {
                    p.b.post_send(wr).map_err(|e| e.error).unwrap();
                }
            }
            let mut windows: Vec<Option<BoundWindow>> = (0..k).map(|_| None).collect();
            for mut c in drain_exact(&mut p.cq_b, &mut ledger, "b", k) {
                let i = ids.iter().position(|&id| id == c.wr_id()).unwrap();
                let w = c.take_bound_window().expect("the bind's window, bound");
                assert_eq!((w.offset(), w.len()), (i * SLOT, SLOT));
                windows[i] = Some(w);
            }
            let mut windows: Vec<BoundWindow> = windows.into_iter().map(Option::unwrap).collect();
            assert_eq!(exposed.windows(), k);
            // The receives of the Sends with Invalidate, posted after the binds.
            let msgs: Vec<Vec<u8>> =
                (0..k).map(|i| pattern(1 + rng.below(32) as usize, (round + i as u64) as u8)).collect();
            let mut recv_ids = Vec::new();
            for msg in &msgs {
                let e = Expect::recv("b", Some(bq), WcOpcode::RECV, msg.len(), None, Bufs::Keep);
                let id = ledger.expect(e);
                recv_ids.push(id);
                p.b.post_recv(RecvRequest::new(Local::whole(p.pd.allocate(64).unwrap())).wr_id(id))
                    .map_err(|e| e.error)
                    .unwrap();
            }
            // The peer writes through every window, then invalidates each with a Send.
            let datas: Vec<Vec<u8>> =
                (0..k).map(|i| pattern(rng.len(SLOT), (round * 3 + i as u64) as u8)).collect();
            let mut n_a = 0;
            for (i, data) in datas.iter().enumerate() {
                let signaled = rng.coin();
                n_a += usize::from(signaled);
                let e = Expect::send("a", &p.a, WcOpcode::RDMA_WRITE, Bufs::Region(Some(data.clone())));
                let id = ledger.post(signaled, e);
                let remote = windows[i].remote().slice(0, data.len() as u64).unwrap();
                let wr = SendRequest::write(source(&p.pd, data, signaled, &mut held), remote).wr_id(id);
                p.a.post_send(if signaled { wr } else { wr.unsignaled() }).map_err(|e| e.error).unwrap();
            }
            for (i, msg) in msgs.iter().enumerate() {
                let signaled = i + 1 == k || rng.coin();
                n_a += usize::from(signaled);
                let id = ledger
                    .post(signaled, Expect::send("a", &p.a, WcOpcode::SEND, Bufs::Region(Some(msg.clone()))));
                let wr = SendRequest::send_with_invalidate(
                    source(&p.pd, msg, signaled, &mut held),
                    windows[i].rkey(),
                )
                .wr_id(id);
                p.a.post_send(if signaled { wr } else { wr.unsignaled() }).map_err(|e| e.error).unwrap();
            }
            drain_exact(&mut p.cq_a, &mut ledger, "a", n_a);
            let got = drain_exact(&mut p.cq_b, &mut ledger, "b", k);
            // RC order: the i-th receive took the i-th Send, which invalidated window i.
            for (i, mut c) in got.into_iter().enumerate().rev() {
                assert_eq!(c.wr_id(), recv_ids[i], "{kind:?} round {round}: receives complete in order");
                let mr = c.take_region().unwrap();
                assert_eq!(&mr[..msgs[i].len()], &msgs[i][..], "{kind:?} round {round}: message {i}");
                let w = windows.pop().unwrap();
                match c.invalidated_rkey() {
                    Some(rkey) => {
                        assert_eq!(rkey, w.rkey(), "{kind:?} round {round}: the rkey of window {i}");
                        // SAFETY: `c` completes a receive posted on `b`, after the window's bind.
                        let mw = unsafe { w.remote_invalidated(&p.b, &mut c) }
                            .unwrap_or_else(|(_, e)| panic!("remote_invalidated: {e}"));
                        spare.push(mw);
                        by_invalidation += 1;
                    }
                    None => {
                        if !reported {
                            reported = true;
                            unsupported(
                                &p.ctx,
                                "IBV_WC_WITH_INV on a Send with Invalidate's receive",
                                format_args!(
                                    "wc_flags {:#x}: the windows are deallocated instead of taken back",
                                    c.work_completion().0.wc_flags
                                ),
                            );
                        }
                        w.dealloc();
                        by_dealloc += 1;
                    }
                }
            }
            ledger.settled(round);
            released(&mut held, ledger.test, round);
            assert_eq!(exposed.windows(), 0, "{kind:?} round {round}: every window unbound");
            assert_eq!(
                (p.a.outstanding_sends(), p.b.outstanding_sends(), p.b.outstanding_recvs()),
                (0, 0, 0)
            );
            let writes: Vec<(usize, &[u8])> =
                datas.iter().enumerate().map(|(i, d)| (i * SLOT, &d[..])).collect();
            let bytes = landed(|| exposed.to_vec(), &writes);
            for (i, data) in datas.iter().enumerate() {
                assert_eq!(
                    &bytes[i * SLOT..][..data.len()],
                    &data[..],
                    "{kind:?} round {round}: write through window {i}"
                );
            }
        }
    }
    println!(
        "memory windows: {by_invalidation} taken back by the peer's invalidation, {by_dealloc} deallocated"
    );
    ledger.summary();
}

/// Polls `conn` until exactly `n` striped completions came (within 10 s), each consumed by
/// `ledger` (CQ "striped": the operation and length checked), then [`QUIET_POLLS`] more times
/// that must find none.
fn drain_striped(conn: &mut StripedConnection, ledger: &mut Ledger, n: usize) -> Vec<StripedCompletion> {
    let test = ledger.test;
    let deadline = Instant::now() + scaled(Duration::from_secs(10));
    let mut out = Vec::with_capacity(64);
    let mut consumed = 0;
    while out.len() < n {
        let k = conn.poll(&mut out).unwrap();
        ledger.polls += 1;
        for c in &out[consumed..] {
            let e = ledger.take(c.wr_id(), "striped");
            assert!(c.is_ok(), "{test}: {c:?}");
            let op = if e.opcode == WcOpcode::RDMA_READ { StripedOp::Read } else { StripedOp::Write };
            assert_eq!((c.op(), Some(c.len() as u32)), (op, e.byte_len), "{test}: {c:?}");
        }
        consumed = out.len();
        assert!(out.len() <= n, "{test}: {} striped completions where {n} were expected", out.len());
        if k == 0 {
            ledger.empty_polls += 1;
            assert!(Instant::now() < deadline, "{test}: timed out: {} of {n} striped completions", out.len());
            std::thread::yield_now();
        }
    }
    for i in 0..QUIET_POLLS {
        assert_eq!(
            conn.poll(&mut out).unwrap(),
            0,
            "{test}: poll {} after the drain: {:?}",
            i + 1,
            out.last()
        );
        ledger.polls += 1;
        ledger.empty_polls += 1;
    }
    // The connection's poll drops, without a word, every completion it does not take for a
    // piece (untracked ones, other queue pairs'): only a raw poll of its CQ (`ibv_poll_cq`) sees a
    // phantom. Everything was taken: a raw poll takes nothing of the connection's.
    let mut raw: [WorkCompletion; POLL_ENTRIES] = Default::default();
    for i in 0..QUIET_POLLS / 5 {
        let got = conn.cq().poll_raw(&mut raw).unwrap();
        assert!(
            got.is_empty(),
            "{test}: raw poll {} of the drained CQ returned {} completions: {:?}",
            i + 1,
            got.len(),
            got.first().map(|w| (w.wr_id(), w.status(), w.opcode(), w.qp_num()))
        );
        ledger.polls += 1;
        ledger.empty_polls += 1;
    }
    out
}

/// Data path 8: Striped connections: three RC queue pairs on one CQ (of each kind the device has)
/// carrying 1 to 4 RDMA Writes (owned or shared sources) and Reads a round, split over the queue
/// pairs above 1 KiB; one completion per request, every buffer back, every byte checked.
#[test]
fn striped_connection_every_completion_once() {
    let ctx = pair_context();
    let kinds = cq_kinds(&ctx);
    let mut ledger = Ledger::new("striped", 8);
    let mut rng = Rng::new(0x5eed_0008);
    const MAX: usize = 8 << 10;
    let stripe = StripeOptions { qps: 3, split_data: true, threshold: 1024, align: 128, depth: 16 };
    for kind in kinds {
        let pd = ctx.alloc_pd().unwrap();
        let cq_a = create_cq(&ctx, kind, stripe.qps * (stripe.depth + 1), None);
        let cq_b = ctx.create_cq(stripe.qps * 4, None).unwrap();
        let (mut qa, mut _qb, mut _ids) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..stripe.qps {
            let (a, b, cm) = connect_built(
                &pd,
                || pd.create_qp(&cq_a, QpType::RC).max_send_wr(stripe.depth).max_recv_wr(1),
                || pd.create_qp(&cq_b, QpType::RC).max_send_wr(1).max_recv_wr(1),
            );
            qa.push(a);
            _qb.push(b);
            _ids.push(cm);
        }
        let mut conn = StripedConnection::from_queue_pairs(cq_a, qa, &stripe).unwrap();
        let flags = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let target = pd.allocate_remote(4 * MAX, flags).unwrap();
        let source = pd.allocate_remote(4 * MAX, flags).unwrap();
        let source_bytes = pattern(4 * MAX, 77);
        source.write(0, &source_bytes).unwrap();
        for round in 0..round_count() {
            target.write(0, &vec![0u8; 4 * MAX]).unwrap();
            let k = rng.count();
            // (0 owned Write, 1 shared Write, 2 Read; length)
            let reqs: Vec<(u64, usize)> = (0..k).map(|_| (rng.below(3), rng.len(MAX))).collect();
            let mut ids = Vec::new();
            for (i, &(op, len)) in reqs.iter().enumerate() {
                let opcode = if op == 2 { WcOpcode::RDMA_READ } else { WcOpcode::RDMA_WRITE };
                let e = Expect {
                    cq: "striped",
                    qp_num: None,
                    opcode,
                    byte_len: Some(len as u32),
                    imm: None,
                    bufs: Bufs::Keep,
                };
                let id = ledger.expect(e);
                ids.push(id);
                let data = pattern(len, (round * 4 + i as u64) as u8);
                let r = match op {
                    0 => conn.post_write(
                        region(&pd, &data),
                        target.remote().slice((i * MAX) as u64, len as u64).unwrap(),
                        id,
                    ),
                    1 => conn.post_write(
                        Arc::new(region(&pd, &data)),
                        target.remote().slice((i * MAX) as u64, len as u64).unwrap(),
                        id,
                    ),
                    _ => conn.post_read(
                        pd.allocate(len).unwrap(),
                        source.remote().slice((i * MAX) as u64, len as u64).unwrap(),
                        id,
                    ),
                };
                r.map_err(|e| e.error).unwrap();
            }
            for mut c in drain_striped(&mut conn, &mut ledger, k) {
                let i = ids.iter().position(|&id| id == c.wr_id()).unwrap();
                let (op, len) = reqs[i];
                let data = pattern(len, (round * 4 + i as u64) as u8);
                match (op, c.take_buf()) {
                    (0, Some(StripeBuf::Owned(m))) => {
                        assert_eq!(&m[..], &data[..], "the owned source, whole again")
                    }
                    (1, Some(StripeBuf::Shared(m))) => assert_eq!(&m[..], &data[..], "the shared source"),
                    (2, Some(StripeBuf::Owned(m))) => {
                        assert_eq!(
                            &m[..],
                            &source_bytes[i * MAX..][..len],
                            "{kind:?} round {round}: read {i}"
                        )
                    }
                    (op, b) => panic!("{kind:?} round {round}: request {i} (kind {op}) came back with {b:?}"),
                }
            }
            ledger.settled(round);
            assert_eq!(conn.outstanding(), 0);
            assert!(conn.queue_pairs().iter().all(|qp| qp.outstanding_sends() == 0));
            let datas: Vec<Vec<u8>> =
                reqs.iter().enumerate().map(|(i, r)| pattern(r.1, (round * 4 + i as u64) as u8)).collect();
            let writes: Vec<(usize, &[u8])> =
                (0..k).filter(|&i| reqs[i].0 != 2).map(|i| (i * MAX, &datas[i][..])).collect();
            let t = landed(|| target.to_vec(), &writes);
            for (i, &(op, len)) in reqs.iter().enumerate() {
                if op != 2 {
                    let data = &datas[i][..len];
                    assert_eq!(&t[i * MAX..][..len], data, "{kind:?} round {round}: write {i}");
                }
            }
        }
    }
    ledger.summary();
}

/// Data path 7: The async adaptor (`ibverbs::aio`): a driver on one CQ (of each kind the device
/// has) with both queue pairs on it; rounds at 1 operation in flight (RDMA Writes and Reads, each
/// awaited) and at 16 (8 receives and 8 Sends posted, then every future awaited: by spawned tasks
/// on tokio, in a shuffled order on async-io). Every future resolves once, within a bound, with its
/// `wr_id` and its buffer; then 50 reaps of the empty CQ must find nothing.
#[cfg(all(feature = "tokio", feature = "async-io"))]
mod aio_accounting {
    use super::*;
    use ibverbs::aio::{AsyncQueuePair, Driver, Op as AioOp};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Backend {
        Tokio,
        AsyncIo,
    }

    /// `f`, or a panic after 10 s (scaled).
    async fn within<F: std::future::Future>(backend: Backend, what: &str, f: F) -> F::Output {
        let d = scaled(Duration::from_secs(10));
        let r = match backend {
            Backend::Tokio => tokio::time::timeout(d, f).await.ok(),
            Backend::AsyncIo => {
                futures_lite::future::or(async { Some(f.await) }, async {
                    async_io::Timer::after(d).await;
                    None
                })
                .await
            }
        };
        r.unwrap_or_else(|| panic!("{what}: timed out"))
    }

    /// The driver's CQ has nothing more: 50 reaps poll none.
    fn quiet(driver: &Driver, ledger: &mut Ledger, round: u64) {
        assert_eq!(driver.in_flight(), 0, "round {round}: every operation resolved");
        for i in 0..QUIET_POLLS {
            let n = driver.reap().unwrap();
            assert_eq!(
                n,
                0,
                "{}: round {round}: reap {} of the drained CQ polled {n} completions",
                ledger.test,
                i + 1
            );
            ledger.polls += 1;
            ledger.empty_polls += 1;
        }
    }

    /// The rounds on one driver.
    async fn rounds(
        backend: Backend,
        pd: &ProtectionDomain,
        driver: &Driver,
        a: &Arc<AsyncQueuePair>,
        b: &Arc<AsyncQueuePair>,
        ledger: &mut Ledger,
        rng: &mut Rng,
    ) {
        let flags = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let target = pd.allocate_remote(SLOT, flags).unwrap();
        let (aq, bq) = (a.with_qp(|q| q.qp_num()), b.with_qp(|q| q.qp_num()));
        // One in flight.
        for round in 0..round_count() {
            let data = pattern(rng.len(SLOT), round as u8);
            let remote = target.remote().slice(0, data.len() as u64).unwrap();
            let e = Expect {
                cq: "async",
                qp_num: Some(aq),
                opcode: WcOpcode::RDMA_WRITE,
                byte_len: None,
                imm: None,
                bufs: Bufs::Region(Some(data.clone())),
            };
            let id = ledger.expect(e);
            let op = a
                .post_send(SendRequest::write(Local::whole(region(pd, &data)), remote).wr_id(id))
                .map_err(|e| e.error)
                .unwrap();
            let mut c = within(backend, "a write", op).await.unwrap();
            ledger.consume(&mut c, "async");
            quiet(driver, ledger, round);
            // And read it back.
            let e = Expect {
                cq: "async",
                qp_num: Some(aq),
                opcode: WcOpcode::RDMA_READ,
                byte_len: None,
                imm: None,
                bufs: Bufs::Region(Some(data.clone())),
            };
            let id = ledger.expect(e);
            let op = a
                .post_send(
                    SendRequest::read(Local::whole(pd.allocate(data.len()).unwrap()), remote).wr_id(id),
                )
                .map_err(|e| e.error)
                .unwrap();
            let mut c = within(backend, "a read", op).await.unwrap();
            // The Read came back with the Write's bytes (checked by the ledger): they are in the
            // target (on iWARP a Write completes once TCP took its data, before it landed).
            ledger.consume(&mut c, "async");
            assert_eq!(&target.to_vec()[..data.len()], &data[..]);
            quiet(driver, ledger, round);
            ledger.settled(round);
        }
        // Sixteen in flight: 8 receives on b, then 8 Sends from a.
        for round in 0..round_count() {
            let mut ops: Vec<(u64, AioOp)> = Vec::new();
            let msgs: Vec<Vec<u8>> = (0..8).map(|i| pattern(rng.len(SLOT), (round * 8 + i) as u8)).collect();
            for m in &msgs {
                let e = Expect::recv(
                    "async",
                    Some(bq),
                    WcOpcode::RECV,
                    m.len(),
                    None,
                    Bufs::Region(Some(m.clone())),
                );
                let id = ledger.expect(e);
                ops.push((
                    id,
                    b.post_recv(RecvRequest::new(Local::whole(pd.allocate(SLOT).unwrap())).wr_id(id))
                        .map_err(|e| e.error)
                        .unwrap(),
                ));
            }
            for m in &msgs {
                let e = Expect {
                    cq: "async",
                    qp_num: Some(aq),
                    opcode: WcOpcode::SEND,
                    byte_len: None,
                    imm: None,
                    bufs: Bufs::Region(Some(m.clone())),
                };
                let id = ledger.expect(e);
                ops.push((
                    id,
                    a.post_send(SendRequest::send(Local::whole(region(pd, m))).wr_id(id))
                        .map_err(|e| e.error)
                        .unwrap(),
                ));
            }
            assert_eq!(driver.in_flight(), 16);
            let mut resolved: Vec<(u64, Completion)> = Vec::new();
            match backend {
                Backend::Tokio => {
                    let tasks: Vec<_> = ops
                        .into_iter()
                        .map(|(id, op)| {
                            (
                                id,
                                tokio::spawn(async move {
                                    tokio::time::timeout(scaled(Duration::from_secs(10)), op).await
                                }),
                            )
                        })
                        .collect();
                    for (id, t) in tasks {
                        let c = t
                            .await
                            .unwrap()
                            .unwrap_or_else(|_| panic!("round {round}: wr_id {id:#x} timed out"))
                            .unwrap();
                        resolved.push((id, c));
                    }
                }
                Backend::AsyncIo => {
                    // A shuffled order: later operations resolved first.
                    for i in (1..ops.len()).rev() {
                        ops.swap(i, rng.below(i as u64 + 1) as usize);
                    }
                    for (id, op) in ops {
                        resolved.push((id, within(backend, "an operation", op).await.unwrap()));
                    }
                }
            }
            for (id, mut c) in resolved {
                assert_eq!(c.wr_id(), id, "round {round}: the future resolved with its own wr_id");
                ledger.consume(&mut c, "async");
            }
            ledger.settled(round);
            quiet(driver, ledger, round);
            assert_eq!(a.outstanding_sends() + b.outstanding_recvs(), 0);
        }
    }

    fn run(backend: Backend, kind: CqKind, ledger: &mut Ledger, rng: &mut Rng) {
        let ctx = pair_context();
        let pd = ctx.alloc_pd().unwrap();
        let channel = ctx.create_comp_channel().unwrap();
        let cq = create_cq(&ctx, kind, 256, Some(&channel));
        let caps = QpCaps { max_send_wr: 32, max_recv_wr: 32, ..QpCaps::default() };
        let (a, b, _cm) = connect_qps(&pd, &cq, &cq, caps);
        let body = async {
            let driver = match backend {
                Backend::Tokio => Driver::tokio(cq, &channel).unwrap(),
                Backend::AsyncIo => Driver::async_io(cq, &channel).unwrap(),
            };
            let a = Arc::new(AsyncQueuePair::new(a, &driver).map_err(|(_, e)| e).unwrap());
            let b = Arc::new(AsyncQueuePair::new(b, &driver).map_err(|(_, e)| e).unwrap());
            rounds(backend, &pd, &driver, &a, &b, ledger, rng).await;
        };
        match backend {
            Backend::Tokio => {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(body);
            }
            Backend::AsyncIo => futures_lite::future::block_on(body),
        }
    }

    #[test]
    fn async_operations_resolve_once_at_1_and_16_in_flight() {
        let ctx = pair_context();
        let kinds = cq_kinds(&ctx);
        let mut ledger = Ledger::new("async", 9);
        let mut rng = Rng::new(0x5eed_0009);
        for &kind in &kinds {
            run(Backend::Tokio, kind, &mut ledger, &mut rng);
        }
        // async-io on the last kind (extended where the device has it).
        run(Backend::AsyncIo, *kinds.last().unwrap(), &mut ledger, &mut rng);
        ledger.summary();
    }
}
