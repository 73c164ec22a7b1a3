//! Moving bytes between the ranks of a group: pieces of at most `SLOT` bytes sent from staging
//! chunks into receive chunks that stay posted, in order per queue pair; a transfer's pieces go
//! round-robin over the rails both ranks share (the same order on both sides, so each side knows
//! which queue pair the next piece comes on).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ibverbs::group::{Bootstrap, Group};
use ibverbs::{Chunk, Completion, Local, RecvRequest, SendRequest, WcOpcode};

/// Largest piece.
pub const SLOT: usize = 128 << 10;
/// Receive and send staging chunks per peer and rail.
pub const DEPTH: usize = 8;
/// Pieces up to this size go inline (no staging copy, no send completion buffer).
const INLINE: usize = 64;

/// A peer's end of one rail.
struct Lane {
    rail: usize,
    /// Send staging chunks not in flight.
    free: Vec<Chunk>,
    /// Pieces received and not yet consumed: (chunk, length).
    arrived: VecDeque<(Chunk, usize)>,
}

/// Everything a rank needs to move bytes to and from its peers.
pub struct Engine<B: Bootstrap> {
    pub group: Group<B>,
    /// `lanes[peer]`: one per rail shared with the peer, in the order both sides agree on.
    lanes: Vec<Vec<Lane>>,
    /// Pieces sent and not completed, per rail (their chunks come back with the completions).
    in_flight: Vec<usize>,
    wcs: Vec<Completion>,
    timeout: Duration,
    polls: u32,
    pub last_check: Instant,
}

/// How long a failed completion waits for the bootstrap to report its peer lost before it is
/// reported as it is.
const LOSS_GRACE: Duration = Duration::from_secs(3);

/// An error of the data path, naming the peer.
pub fn fail<T>(text: String) -> Result<T, String> {
    Err(text)
}

impl<B: Bootstrap> Engine<B> {
    /// Posts the receive chunks and prepares the send staging of every peer and shared rail.
    pub fn new(mut group: Group<B>, timeout: Duration) -> Result<Engine<B>, String> {
        let (me, n) = (group.rank(), group.size());
        let mut lanes: Vec<Vec<Lane>> = (0..n).map(|_| Vec::new()).collect();
        // Both sides order a peer's rails by network name: the same order on both.
        for (peer, peer_lanes) in lanes.iter_mut().enumerate() {
            if peer == me {
                continue;
            }
            let mut rails: Vec<(String, usize)> = group
                .rails()
                .iter()
                .enumerate()
                .filter(|(_, r)| r.peers().any(|p| p == peer))
                .map(|(i, r)| (r.info().network.clone(), i))
                .collect();
            rails.sort();
            for (_, rail) in rails {
                let r = group.rail(rail);
                let recv = r.pd().allocate(DEPTH * SLOT).map_err(|e| e.to_string())?;
                let send = r.pd().allocate(DEPTH * SLOT).map_err(|e| e.to_string())?;
                let qp = r.qp(peer).expect("a queue pair on a rail that reaches the peer");
                for (k, chunk) in recv.into_chunks(SLOT).map_err(|e| e.to_string())?.into_iter().enumerate() {
                    qp.post_recv(RecvRequest::new(Local::whole(chunk)).wr_id(k as u64))
                        .map_err(|e| format!("posting receives for rank {peer}: {e}"))?;
                }
                let free = send.into_chunks(SLOT).map_err(|e| e.to_string())?;
                peer_lanes.push(Lane { rail, free, arrived: VecDeque::new() });
            }
        }
        let rails = group.rails().len();
        Ok(Engine {
            group,
            lanes,
            in_flight: vec![0; rails],
            wcs: (0..32).map(|_| Completion::default()).collect(),
            timeout,
            polls: 0,
            last_check: Instant::now(),
        })
    }

    /// Polls every rail once; every completion is accounted for. Every 1024 polls, asks the
    /// bootstrap whether a rank was lost.
    pub fn progress(&mut self) -> Result<(), String> {
        let nrails = self.group.rails().len();
        for rail in 0..nrails {
            let r = self.group.rail(rail);
            let (cq, _) = r.parts();
            let done = cq.poll(&mut self.wcs).map_err(|e| e.to_string())?;
            for wc in done.iter_mut() {
                let peer = self.group.rails()[rail].peer_of(wc.qp_num());
                let Some(peer) = peer else {
                    return fail(format!("a completion of no queue pair of this group: {wc:?}"));
                };
                if !wc.is_ok() {
                    let what = format!(
                        "rank {peer}: {:?} on the queue pair to it ({} {})",
                        wc.status(),
                        self.group.rails()[rail].info().device,
                        self.group.rails()[rail].info().network
                    );
                    // A peer that died fails its queue pairs' requests (a remote operation or
                    // retry error) about when its bootstrap connection closes: give the
                    // bootstrap a moment to say so (rank 0 relays a loss), and name the lost
                    // rank rather than the transport's symptom when it does. Bounded.
                    let until = Instant::now() + LOSS_GRACE;
                    loop {
                        self.group.check().map_err(|e| e.to_string())?;
                        if Instant::now() >= until {
                            return fail(what);
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                let lane =
                    self.lanes[peer].iter_mut().find(|l| l.rail == rail).expect("a lane per rail and peer");
                if wc.opcode() == WcOpcode::RECV {
                    let len = wc.byte_len() as usize;
                    let chunk = wc.take_chunk().expect("a receive completion hands its chunk back");
                    lane.arrived.push_back((chunk, len));
                } else {
                    self.in_flight[rail] -= 1;
                    if let Some(chunk) = wc.take_chunk() {
                        lane.free.push(chunk);
                    }
                }
            }
        }
        self.polls = self.polls.wrapping_add(1);
        if self.polls % 1024 == 0 {
            self.group.check().map_err(|e| e.to_string())?;
            self.last_check = Instant::now();
        }
        Ok(())
    }

    /// Number of rails shared with `peer`.
    fn lanes(&self, peer: usize) -> usize {
        self.lanes[peer].len()
    }

    /// Sends piece `i` of a transfer (`data`, at most SLOT bytes) to `peer`, if a staging chunk is
    /// free on its lane: `Ok(false)` when not (call again after `progress`).
    fn try_send_piece(&mut self, peer: usize, i: usize, data: &[u8]) -> Result<bool, String> {
        let nl = self.lanes(peer);
        let lane_ix = i % nl;
        let rail = self.lanes[peer][lane_ix].rail;
        if data.len() <= INLINE {
            let qp = self.group.rail(rail).qp(peer).expect("lane's queue pair");
            return match qp.post_send(SendRequest::send_inline(data)) {
                Ok(()) => {
                    self.in_flight[rail] += 1;
                    Ok(true)
                }
                Err(e) if matches!(e.error, ibverbs::Error::QueueFull { .. }) => Ok(false),
                Err(e) => fail(format!("sending to rank {peer}: {}", e.error)),
            };
        }
        let Some(mut chunk) = self.lanes[peer][lane_ix].free.pop() else { return Ok(false) };
        chunk[..data.len()].copy_from_slice(data);
        let local = Local::new(chunk, ..data.len()).map_err(|e| e.to_string())?;
        let qp = self.group.rail(rail).qp(peer).expect("lane's queue pair");
        match qp.post_send(SendRequest::send(local)) {
            Ok(()) => {
                self.in_flight[rail] += 1;
                Ok(true)
            }
            Err(e) => {
                let full = matches!(e.error, ibverbs::Error::QueueFull { .. });
                let text = e.error.to_string();
                for b in e.request.into_buffers() {
                    if let Some(c) = b.into_chunk() {
                        self.lanes[peer][lane_ix].free.push(c);
                    }
                }
                if full {
                    Ok(false)
                } else {
                    fail(format!("sending to rank {peer}: {text}"))
                }
            }
        }
    }

    /// Piece `i` of the transfer from `peer`, if it arrived: handed to `f`, its chunk posted again.
    fn try_recv_piece(&mut self, peer: usize, i: usize, f: &mut dyn FnMut(&[u8])) -> Result<bool, String> {
        let nl = self.lanes(peer);
        let lane_ix = i % nl;
        let Some((chunk, len)) = self.lanes[peer][lane_ix].arrived.pop_front() else { return Ok(false) };
        f(&chunk[..len]);
        let rail = self.lanes[peer][lane_ix].rail;
        let qp = self.group.rail(rail).qp(peer).expect("lane's queue pair");
        qp.post_recv(RecvRequest::new(Local::whole(chunk)))
            .map_err(|e| format!("posting a receive for rank {peer}: {}", e.error))?;
        Ok(true)
    }

    /// Sends `send` to each of `to` and receives `recv_len` bytes from each of `from`, all at
    /// once, piece by piece: `on_piece(from_index, offset, bytes)` for every piece received, in
    /// order per peer. Bounded by the engine's timeout.
    pub fn exchange(
        &mut self,
        to: &[usize],
        send: &[&[u8]],
        from: &[usize],
        recv_len: &[usize],
        on_piece: &mut dyn FnMut(usize, usize, &[u8]),
    ) -> Result<(), String> {
        let pieces = |len: usize| len.div_ceil(SLOT).max(1);
        let mut sent = vec![0usize; to.len()];
        let mut got = vec![0usize; from.len()];
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let mut all = true;
            for (k, &peer) in to.iter().enumerate() {
                let total = pieces(send[k].len());
                while sent[k] < total {
                    let off = sent[k] * SLOT;
                    let end = (off + SLOT).min(send[k].len());
                    if !self.try_send_piece(peer, sent[k], &send[k][off..end])? {
                        break;
                    }
                    sent[k] += 1;
                }
                all &= sent[k] == total;
            }
            for (k, &peer) in from.iter().enumerate() {
                let total = pieces(recv_len[k]);
                while got[k] < total {
                    let off = got[k] * SLOT;
                    let mut cb = |b: &[u8]| on_piece(k, off, b);
                    if !self.try_recv_piece(peer, got[k], &mut cb)? {
                        break;
                    }
                    got[k] += 1;
                }
                all &= got[k] == total;
            }
            if all {
                return Ok(());
            }
            self.progress()?;
            spins = spins.wrapping_add(1);
            // Ranks may share CPUs (two per vCPU in the harness): let a peer run.
            if spins % 16 == 0 {
                std::thread::yield_now();
            }
            if spins % 4096 == 0 && start.elapsed() > self.timeout {
                let waiting: Vec<String> = from
                    .iter()
                    .enumerate()
                    .filter(|&(k, _)| got[k] < pieces(recv_len[k]))
                    .map(|(_, p)| p.to_string())
                    .collect();
                return fail(format!(
                    "no data from rank {} within {:?} (its process may be stuck)",
                    waiting.join(", rank "),
                    self.timeout
                ));
            }
        }
    }

    /// Waits until every send completed (staging chunks back).
    pub fn flush(&mut self) -> Result<(), String> {
        let start = Instant::now();
        while self.in_flight.iter().any(|&n| n > 0) {
            self.progress()?;
            if start.elapsed() > self.timeout {
                return fail(format!("sends not completed within {:?}", self.timeout));
            }
        }
        Ok(())
    }
}
