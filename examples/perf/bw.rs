//! The bandwidth loops (perftest's `run_iter_bw` and `run_iter_bw_server`), generic over the
//! posting level: [`SafePath`] posts typed requests that carry `Arc` handles of the buffers,
//! [`RawPath`] posts prebuilt `ibv_send_wr`/`ibv_recv_wr` chains through the `unsafe` level.
//! Both are monomorphized into the same loop, so the only difference measured is the level.

use std::ptr;

use ibverbs::ffi;
use ibverbs::raw::{self, RawSend};
use ibverbs::{
    AccessFlags, Completion, CompletionQueue, PreparedPost, PreparedRecv, PreparedSend, QueuePair,
    RecvRequest, RemoteSlice, SendRequest, WcStatus, WorkCompletion,
};

use super::clock::ticks;
use super::report::bw_report;
use super::{memory, split_wr_id, wr_id, Buf, Guard, Level, Role, RunSpec, Session};

/// Completions fetched per poll (perftest's default batch).
pub const POLL_BATCH: usize = 16;

/// The operation of a bandwidth test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// RDMA Write of the local buffer to the peer's.
    Write,
    /// RDMA Read of the peer's buffer into the local one.
    Read,
    /// Send of the local buffer.
    Send,
}

/// A completion, reduced to what the loops need.
#[derive(Debug, Clone, Copy)]
pub struct Done {
    /// Queue pair index.
    pub q: usize,
    /// Message index in that queue pair.
    pub k: u64,
    /// Status.
    pub status: WcStatus,
}

impl Default for Done {
    fn default() -> Self {
        Done { q: 0, k: 0, status: WcStatus::SUCCESS }
    }
}

/// Posts and polls for a sender.
pub trait SendPath {
    /// Posts messages `k..k + n` of queue pair `q`, chained when `n > 1`.
    fn post(&mut self, q: usize, k: u64, n: usize) -> Result<(), String>;
    /// Polls the send CQ into `out`; returns how many.
    fn poll(&mut self, out: &mut [Done]) -> Result<usize, String>;
}

/// Posts and polls for a receiver.
pub trait RecvPath {
    /// Posts the receive for message `k` of queue pair `q`.
    fn post_recv(&mut self, q: usize, k: u64) -> Result<(), String>;
    /// Polls the receive CQ into `out`; returns how many.
    fn poll(&mut self, out: &mut [Done]) -> Result<usize, String>;
}

/// The safe level: one prepared request per queue pair (`prepare_send` once, then
/// `post_prepared_iter` of `PreparedPost`s with only the `wr_id` and the ranges changing, as a
/// server posting from a registered pool does); chains longer than one on an extended queue
/// pair (`--ex`, where those are refused) as one-shot requests holding `Arc`s of the buffers
/// (`post_send_chain`); receives prepared once per queue pair over its whole buffer
/// (`prepare_recv`, then `post_prepared_recv` of each message's range); `CompletionQueue::poll`.
pub struct SafePath<'a> {
    qps: &'a mut [QueuePair],
    cq: &'a mut CompletionQueue,
    local: &'a [Buf],
    /// Per queue pair, the request of `op` over its whole local buffer and remote slice (empty on
    /// the receiving side).
    prepared: Vec<PreparedSend>,
    /// Per queue pair, the receive into its whole local buffer (empty on the sending side).
    prepared_recv: Vec<PreparedRecv>,
    /// Whether the queue pairs are extended (chains longer than one go one-shot).
    ex: bool,
    remote: &'a [RemoteSlice],
    op: Op,
    /// One-shot requests of a chain (extended queue pairs).
    chain: Vec<SendRequest<'static>>,
    run: RunSpec,
    comps: Vec<Completion>,
}

/// Posts of a chain at a time (longer chains go in several calls).
const CHAIN_BLOCK: usize = 32;

/// Message `k` of queue pair `q` as a post of its prepared request `p` (signaled as `run` says).
#[inline(always)]
fn post_of<'p>(p: &'p PreparedSend, run: &RunSpec, op: Op, q: usize, k: u64) -> PreparedPost<'p> {
    let range = run.range(k);
    let (off, len) = (range.start, range.len() as u32);
    // Write and Read use the same offset at both ends; a Send has no remote range.
    let remote_off = if op == Op::Send { 0 } else { off as u64 };
    let post = p.at(wr_id(q, k), off, len, remote_off);
    if run.signaled(k) {
        post
    } else {
        post.unsignaled()
    }
}

impl<'a> SafePath<'a> {
    /// A sending path over `qps` (one `local` buffer and, for Write and Read, one `remote` slice
    /// per queue pair), polling `cq`: prepares one request per queue pair.
    pub fn new(
        qps: &'a mut [QueuePair],
        cq: &'a mut CompletionQueue,
        local: &'a [Buf],
        remote: &'a [RemoteSlice],
        op: Op,
        run: RunSpec,
    ) -> Result<Self, String> {
        let mut prepared = Vec::with_capacity(qps.len());
        // Extended queue pairs (all or none of a run) post longer chains one-shot.
        let ex = qps.iter().any(|qp| qp.send_ops().is_some());
        for (q, qp) in qps.iter().enumerate() {
            let buf = local.get(q).ok_or("no local buffer for a queue pair")?;
            let whole = buf.local(0..buf.len()).map_err(|e| e.to_string())?;
            let wr = match op {
                Op::Write => {
                    SendRequest::write(whole, *remote.get(q).ok_or("no remote buffer for a queue pair")?)
                }
                Op::Read => {
                    SendRequest::read(whole, *remote.get(q).ok_or("no remote buffer for a queue pair")?)
                }
                Op::Send => SendRequest::send(whole),
            };
            prepared.push(qp.prepare_send(wr).map_err(|e| format!("prepare_send: {}", e.error))?);
        }
        let comps = (0..POLL_BATCH).map(|_| Completion::default()).collect();
        let chain = Vec::with_capacity(run.post_list as usize);
        Ok(SafePath {
            qps,
            cq,
            local,
            prepared,
            prepared_recv: Vec::new(),
            ex,
            remote,
            op,
            chain,
            run,
            comps,
        })
    }

    /// A receiving path over `qps` (one `local` buffer per queue pair), polling `cq`.
    pub fn receiver(
        qps: &'a mut [QueuePair],
        cq: &'a mut CompletionQueue,
        local: &'a [Buf],
        run: RunSpec,
    ) -> Result<Self, String> {
        let mut prepared_recv = Vec::with_capacity(qps.len());
        for (qp, buf) in qps.iter().zip(local) {
            let whole = buf.local(0..buf.len()).map_err(|e| e.to_string())?;
            prepared_recv.push(
                qp.prepare_recv(RecvRequest::new(whole)).map_err(|e| format!("prepare_recv: {}", e.error))?,
            );
        }
        Ok(SafePath {
            qps,
            cq,
            local,
            prepared: Vec::new(),
            prepared_recv,
            ex: false,
            remote: &[],
            op: Op::Send,
            chain: Vec::new(),
            run,
            comps: (0..POLL_BATCH).map(|_| Completion::default()).collect(),
        })
    }

    /// Message `k` of queue pair `q` as a one-shot request (extended queue pairs).
    fn request(&self, q: usize, k: u64) -> Result<SendRequest<'static>, String> {
        let range = self.run.range(k);
        let (off, len) = (range.start as u64, range.len() as u64);
        let local = self.local[q].local(range).map_err(|e| e.to_string())?;
        let remote = || self.remote[q].slice(off, len).map_err(|e| e.to_string());
        let wr = match self.op {
            Op::Write => SendRequest::write(local, remote()?),
            Op::Read => SendRequest::read(local, remote()?),
            Op::Send => SendRequest::send(local),
        }
        .wr_id(wr_id(q, k));
        Ok(if self.run.signaled(k) { wr } else { wr.unsignaled() })
    }

    /// [`SendPath::post`] of a chain on an extended queue pair: one-shot requests.
    fn post_one_shot(&mut self, q: usize, k: u64, n: usize) -> Result<(), String> {
        for i in 0..n as u64 {
            let wr = self.request(q, k + i)?;
            self.chain.push(wr);
        }
        let r = self.qps[q].post_send_chain(&mut self.chain).map_err(|e| format!("post_send_chain: {e}"));
        self.chain.clear();
        r
    }

    fn poll_into(&mut self, out: &mut [Done]) -> Result<usize, String> {
        let n = out.len().min(self.comps.len());
        let got = self.cq.poll(&mut self.comps[..n]).map_err(|e| e.to_string())?;
        for (c, d) in got.iter().zip(out.iter_mut()) {
            let (q, k) = split_wr_id(c.wr_id());
            *d = Done { q, k, status: c.status() };
        }
        Ok(got.len())
    }
}

impl SendPath for SafePath<'_> {
    #[inline]
    fn post(&mut self, q: usize, k: u64, n: usize) -> Result<(), String> {
        if n > 1 && self.ex {
            return self.post_one_shot(q, k, n);
        }
        let p = self.prepared.get(q).ok_or("no prepared request for a queue pair")?;
        let (run, op) = (&self.run, self.op);
        let qp = &mut self.qps[q];
        let err = |e| format!("post_prepared_iter: {e}");
        if n == 1 {
            // A chain of one posts as post_prepared does (and on extended queue pairs too).
            return qp.post_prepared_iter([post_of(p, run, op, q, k)]).map_err(err);
        }
        let mut i = 0;
        while i < n {
            let m = (n - i).min(CHAIN_BLOCK);
            // Each post is written into the chain as the iterator builds it.
            qp.post_prepared_iter((i..i + m).map(|j| post_of(p, run, op, q, k + j as u64))).map_err(err)?;
            i += m;
        }
        Ok(())
    }

    #[inline]
    fn poll(&mut self, out: &mut [Done]) -> Result<usize, String> {
        self.poll_into(out)
    }
}

impl RecvPath for SafePath<'_> {
    #[inline]
    fn post_recv(&mut self, q: usize, k: u64) -> Result<(), String> {
        let range = self.run.range(k);
        let p = self.prepared_recv.get(q).ok_or("no prepared receive for a queue pair")?;
        self.qps[q]
            .post_prepared_recv(p, wr_id(q, k), range.start, range.len() as u32)
            .map_err(|e| format!("post_prepared_recv: {e}"))
    }

    #[inline]
    fn poll(&mut self, out: &mut [Done]) -> Result<usize, String> {
        self.poll_into(out)
    }
}

/// The raw level: per queue pair a prebuilt chain of `post_list` work requests whose addresses,
/// `wr_id`s and flags are rewritten in place before each `post_send_unchecked`, and `poll_raw`.
pub struct RawPath<'a> {
    qps: &'a [QueuePair],
    cq: &'a CompletionQueue,
    run: RunSpec,
    op: Op,
    base: Vec<u64>,
    rbase: Vec<u64>,
    // The chains point into these vectors, which are never resized after `new`.
    wr: Vec<ffi::ibv_send_wr>,
    rwr: Vec<ffi::ibv_recv_wr>,
    sge: Vec<ffi::ibv_sge>,
    wcs: Vec<WorkCompletion>,
}

impl<'a> RawPath<'a> {
    /// A path over `qps` (one `local` buffer and, for Write and Read, one `remote` slice per queue
    /// pair), polling `cq`. The buffers must stay registered until the queue pairs are destroyed
    /// (the session keeps them so).
    pub fn new(
        qps: &'a [QueuePair],
        cq: &'a CompletionQueue,
        local: &[Buf],
        remote: &[RemoteSlice],
        op: Op,
        run: RunSpec,
    ) -> Self {
        let pl = run.post_list as usize;
        let n = qps.len() * pl;
        let mut p = RawPath {
            qps,
            cq,
            run,
            op,
            base: local.iter().map(Buf::addr).collect(),
            rbase: remote.iter().map(|r| r.addr).collect(),
            wr: vec![ffi::ibv_send_wr::default(); n],
            rwr: vec![ffi::ibv_recv_wr::default(); qps.len()],
            sge: vec![ffi::ibv_sge::default(); n],
            wcs: vec![WorkCompletion::default(); POLL_BATCH],
        };
        for i in 0..n {
            let q = i / pl;
            p.sge[i] = raw::sge(p.base[q], run.size as u32, local[q].lkey());
            // `sg_list`, `next`, `wr_id` and the flags are set in `post` (pointers taken there
            // stay valid).
            p.wr[i] = match op {
                Op::Write => RawSend::write(remote[q]),
                Op::Read => RawSend::read(remote[q]),
                Op::Send => RawSend::send(),
            }
            .0;
            p.wr[i].num_sge = 1;
        }
        for w in &mut p.rwr {
            w.num_sge = 1;
        }
        p
    }
}

impl SendPath for RawPath<'_> {
    #[inline]
    fn post(&mut self, q: usize, k: u64, n: usize) -> Result<(), String> {
        let blk = q * self.run.post_list as usize;
        // A real check (one compare): the writes below go through raw pointers.
        assert!(n >= 1 && blk + n <= self.wr.len(), "a post of {n} requests at {blk} in {}", self.wr.len());
        // All accesses below go through these two pointers (no references into the vectors are
        // created meanwhile), so the links written into the chain stay valid for the device.
        let wrs = self.wr.as_mut_ptr();
        let sges = self.sge.as_mut_ptr();
        for i in 0..n {
            let idx = k + i as u64;
            let off = self.run.offset(idx);
            let flags = if self.run.signaled(idx) { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            // SAFETY: blk + i < blk + n <= len of both vectors (one block of post_list per queue
            // pair, n == post_list); nothing else accesses them meanwhile.
            unsafe {
                let sge = sges.add(blk + i);
                (*sge).addr = self.base[q] + off;
                let w = wrs.add(blk + i);
                (*w).wr_id = wr_id(q, idx);
                (*w).send_flags = flags;
                (*w).sg_list = sge;
                (*w).next = if i + 1 < n { w.add(1) } else { ptr::null_mut() };
                if self.op != Op::Send {
                    (*w).wr.rdma.remote_addr = self.rbase[q] + off;
                }
            }
        }
        let mut bad = ptr::null_mut();
        // SAFETY: `wrs[blk..blk + n]` is a NULL-terminated chain whose SGEs name `size` bytes at
        // cycle offsets inside the queue pair's buffer (registered in this QP's PD and kept
        // registered by the session until the QPs are destroyed); the remote ranges lie in the
        // peer's buffer as it described it. The device only reads the local buffer for Write and
        // Send; for Read it writes a RemoteMemoryRegion nobody holds references into. wr_ids have
        // bit 63 clear.
        unsafe { self.qps[q].post_send_unchecked(wrs.add(blk), &mut bad) }
            .map_err(|e| format!("post_send_unchecked: {e}"))
    }

    #[inline]
    fn poll(&mut self, out: &mut [Done]) -> Result<usize, String> {
        let n = out.len().min(self.wcs.len());
        let got = self.cq.poll_raw(&mut self.wcs[..n]).map_err(|e| e.to_string())?;
        for (wc, d) in got.iter().zip(out.iter_mut()) {
            let (q, k) = split_wr_id(wc.wr_id());
            *d = Done { q, k, status: wc.status() };
        }
        Ok(got.len())
    }
}

impl RecvPath for RawPath<'_> {
    #[inline]
    fn post_recv(&mut self, q: usize, k: u64) -> Result<(), String> {
        let blk = q * self.run.post_list as usize;
        let sge = self.sge.as_mut_ptr();
        let rwr = self.rwr.as_mut_ptr();
        // SAFETY: blk < len of `sge` and q < len of `rwr` (one entry per queue pair); no references
        // into the vectors exist meanwhile, so the link stays valid.
        let w = unsafe {
            let s = sge.add(blk);
            (*s).addr = self.base[q] + self.run.offset(k);
            let w = rwr.add(q);
            (*w).wr_id = wr_id(q, k);
            (*w).sg_list = s;
            (*w).next = ptr::null_mut();
            w
        };
        let mut bad = ptr::null_mut();
        // SAFETY: one receive whose SGE names `size` bytes inside the queue pair's receive buffer,
        // a RemoteMemoryRegion (no references into it) kept registered by the session until the
        // QPs are destroyed; wr_id bit 63 clear.
        unsafe { self.qps[q].post_recv_unchecked(w, &mut bad) }
            .map_err(|e| format!("post_recv_unchecked: {e}"))
    }

    #[inline]
    fn poll(&mut self, out: &mut [Done]) -> Result<usize, String> {
        SendPath::poll(self, out)
    }
}

/// Timestamps of a sender's run: post time of every message and poll time of the completion
/// covering it, in counter ticks.
#[derive(Debug)]
pub struct SendTimes {
    /// Per message (all queue pairs, in posting order).
    pub tposted: Vec<u64>,
    /// Per message (in completion order).
    pub tcompleted: Vec<u64>,
}

fn status_error(d: &Done, role: &str) -> String {
    format!("{role} completion with status {} (queue pair {}, message {})", d.status, d.q, d.k)
}

/// perftest's `run_iter_bw`: keeps up to `tx_depth` messages in flight on every queue pair, posting
/// `post_list` at a time, requesting a completion every `cq_mod`, polling in batches.
pub fn run_sender<P: SendPath>(p: &mut P, run: &RunSpec, guard: &mut Guard) -> Result<SendTimes, String> {
    let q = run.qps;
    let iters = run.iters;
    let pl = run.post_list;
    let tot = iters * q as u64;
    let mut tposted = memory::zeroed_vec::<u64>(tot, "the post timestamps")?;
    let mut tcompleted = memory::zeroed_vec::<u64>(tot, "the completion timestamps")?;
    let tot = tposted.len();
    let mut scnt = vec![0u64; q];
    let mut ccnt = vec![0u64; q];
    let (mut totscnt, mut totccnt) = (0usize, 0usize);
    let mut done = [Done::default(); POLL_BATCH];
    guard.start("waiting for send completions");
    while totccnt < tot {
        for qi in 0..q {
            while scnt[qi] < iters && scnt[qi] + pl <= run.tx_depth + ccnt[qi] {
                let now = ticks();
                tposted[totscnt..totscnt + pl as usize].fill(now);
                p.post(qi, scnt[qi], pl as usize)?;
                scnt[qi] += pl;
                totscnt += pl as usize;
            }
        }
        let n = p.poll(&mut done)?;
        if n == 0 {
            guard.idle()?;
            continue;
        }
        let now = ticks();
        guard.progress(now)?;
        for d in &done[..n] {
            if d.status != WcStatus::SUCCESS {
                return Err(guard.annotate(status_error(d, "send")));
            }
            if d.q >= q || d.k >= iters {
                return Err(format!("unexpected completion (wr_id for queue pair {}, message {})", d.q, d.k));
            }
            let upto = d.k + 1;
            let covered = upto.saturating_sub(ccnt[d.q]) as usize;
            ccnt[d.q] = ccnt[d.q].max(upto);
            let end = (totccnt + covered).min(tot);
            tcompleted[totccnt..end].fill(now);
            totccnt = end;
        }
    }
    Ok(SendTimes { tposted, tcompleted })
}

/// Posts the first receives of every queue pair (before the run starts); returns how many each.
pub fn prepost<P: RecvPath>(p: &mut P, run: &RunSpec) -> Result<u64, String> {
    let n = run.rx_depth.min(run.iters);
    for q in 0..run.qps {
        for k in 0..n {
            p.post_recv(q, k)?;
        }
    }
    Ok(n)
}

/// perftest's `run_iter_bw_server`: takes `iters` messages on every queue pair, reposting a
/// receive for each one taken while more are due. Returns the counter at the first and at the
/// last completion.
pub fn run_receiver<P: RecvPath>(
    p: &mut P,
    run: &RunSpec,
    preposted: u64,
    guard: &mut Guard,
) -> Result<(u64, u64), String> {
    let q = run.qps;
    let tot = run.iters * q as u64;
    let mut posted = vec![preposted; q];
    let mut rcnt = 0u64;
    let mut first = None;
    let mut done = [Done::default(); POLL_BATCH];
    guard.start("waiting for receive completions");
    while rcnt < tot {
        let n = p.poll(&mut done)?;
        if n == 0 {
            guard.idle()?;
            continue;
        }
        let now = ticks();
        guard.progress(now)?;
        first.get_or_insert(now);
        for d in &done[..n] {
            if d.status != WcStatus::SUCCESS {
                return Err(guard.annotate(status_error(d, "receive")));
            }
            if d.q >= q {
                return Err(format!("unexpected completion (wr_id for queue pair {})", d.q));
            }
            rcnt += 1;
            if posted[d.q] < run.iters {
                p.post_recv(d.q, posted[d.q])?;
                posted[d.q] += 1;
            }
        }
    }
    Ok((first.unwrap_or(0), ticks()))
}

/// The whole of `write_bw` (`op` = [`Op::Write`]) and `read_bw` ([`Op::Read`]): the client moves
/// `-n` messages per queue pair to or from the server's buffer; the passive server prints the
/// client's table.
pub fn run_one_sided(s: &mut Session, op: Op) -> Result<(), String> {
    let len = s.buf_len();
    let qps = s.params.qps as usize;
    // All of them at once, before the first: each is checked as it is allocated, but a first
    // buffer that fits is zeroed and pinned (seconds per GB) before a second one is refused.
    let total = (len as u64).saturating_mul(qps as u64);
    memory::check(total, &format!("{qps} buffers of {len} bytes (one per queue pair), a total"))?;
    let mut bufs = Vec::with_capacity(qps);
    for _ in 0..qps {
        bufs.push(match (op, s.role) {
            // The device only reads the source of a write; it writes the target of a read.
            (Op::Write, Role::Client) => Buf::Ro(s.alloc_ro(len, AccessFlags::LOCAL_WRITE)?),
            (Op::Read, Role::Client) => Buf::Rw(s.alloc_rw(len, AccessFlags::LOCAL_WRITE)?),
            (Op::Write, Role::Server) => Buf::Rw(s.alloc_rw(len, AccessFlags::REMOTE_WRITE)?),
            // Peers may read a local-only region: reading never changes it.
            (_, Role::Server) => {
                Buf::Ro(s.alloc_ro(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?)
            }
            (Op::Send, Role::Client) => return Err("run_one_sided is for RDMA Write and Read".into()),
        });
    }
    // The client's buffers are not exposed: it sends empty descriptors.
    let local: Vec<RemoteSlice> = match s.role {
        Role::Client => vec![RemoteSlice { addr: 0, len: 0, rkey: 0 }; qps],
        Role::Server => bufs.iter().map(Buf::remote).collect(),
    };
    let remote = s.exchange(&local)?;
    while let Some(spec) = s.next_run()? {
        s.ready()?;
        if s.role == Role::Server {
            // Passive: the client reports, we print its numbers.
            if let Some(r) = s.finish(None)? {
                s.print_bw(&r);
            }
            continue;
        }
        send_and_report(s, &bufs, &remote, op, spec)?;
    }
    Ok(())
}

/// The sending side of a bandwidth run at `spec`'s level: sends, then reports its table to the
/// peer and prints it.
pub fn send_and_report(
    s: &mut Session,
    bufs: &[Buf],
    remote: &[RemoteSlice],
    op: Op,
    spec: RunSpec,
) -> Result<(), String> {
    let mut guard = s.guard();
    let times = match spec.level {
        Level::Safe => {
            let r = &mut s.rdma;
            let mut path = SafePath::new(&mut r.qps, &mut r.send_cq, bufs, remote, op, spec)?;
            run_sender(&mut path, &spec, &mut guard)?
        }
        Level::Raw => {
            let r = &s.rdma;
            let mut path = RawPath::new(&r.qps, &r.send_cq, bufs, remote, op, spec);
            run_sender(&mut path, &spec, &mut guard)?
        }
    };
    s.oob.beat(); // the report (its search over windows of messages) sends nothing
    s.clock.recalibrate();
    let report = bw_report(
        spec.size,
        &times.tposted,
        &times.tcompleted,
        spec.post_list as usize,
        spec.cq_mod as usize,
        !s.no_peak(),
        &s.clock,
    );
    s.finish(Some(&report))?;
    s.print_bw(&report);
    Ok(())
}
