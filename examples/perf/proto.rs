//! The out-of-band protocol of the perftest-style examples as data: frame tags, the tests and
//! their parameters, and the encodings of the messages (no I/O here, so that host tests can
//! include this file and feed the decoders arbitrary bytes).

use ibverbs::Mtu;

/// Frame tags of the protocol (see the module documentation of `perf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tag {
    /// Client → server: the test and its parameters.
    Hello = 1,
    /// Both ways: the queue pairs' endpoints and the buffers' remote slices.
    Setup = 2,
    /// Client → server: one measurement (message size and iterations) follows.
    Run = 3,
    /// Server → client: ready for the measurement (queue pairs connected, receives posted).
    Ready = 4,
    /// Client → server: the measurement is over (with the client's report, if any).
    Done = 5,
    /// Server → client: acknowledges `Done` (with the server's report, if any).
    Ack = 6,
    /// Client → server: no more measurements; the server answers with `Ack` and both exit.
    End = 7,
    /// Either way: the sender failed; the payload says why.
    Error = 0xee,
}

impl Tag {
    pub fn from_u8(b: u8) -> Option<Tag> {
        Some(match b {
            1 => Tag::Hello,
            2 => Tag::Setup,
            3 => Tag::Run,
            4 => Tag::Ready,
            5 => Tag::Done,
            6 => Tag::Ack,
            7 => Tag::End,
            0xee => Tag::Error,
            _ => return None,
        })
    }
}

/// Largest payload accepted (setup frames of many queue pairs are the biggest).
pub const MAX_PAYLOAD: usize = 1 << 20;

/// Which posting level the hot loop uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// `QueuePair::post_send`/`post_recv`(`_chain`) and `CompletionQueue::poll`: checked, buffers
    /// moved into the queue pair and handed back by the completion.
    Safe,
    /// `unsafe` `post_send_unchecked`/`post_recv_unchecked` with prebuilt `ibv_send_wr`s and
    /// `poll_raw`: C's cost.
    Raw,
}

/// The level used when neither `--safe` nor `--raw` is given: the faster one. Measured on
/// SoftRoCE in a TCG VM (5 alternating runs each): the bandwidth tests are equal within noise at
/// 64 KiB (the device dominates), the latency tests are faster at the raw level (write_lat 2 B:
/// 10.9 vs 11.7 µs, send_lat 2 B: 12.0 vs 14.1 µs; `benches/post_poll.rs` puts the safe level's
/// extra cost at about 1.5 µs per post + poll there).
pub const DEFAULT_LEVEL: Level = Level::Raw;

impl Level {
    pub fn describe(self) -> &'static str {
        match self {
            Level::Safe => "safe (post_send/post_recv + poll)",
            Level::Raw => "raw (post_send_unchecked + poll_raw)",
        }
    }
}

/// The five tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestKind {
    /// RDMA Write bandwidth.
    WriteBw,
    /// RDMA Write latency (ping-pong of writes, polling memory).
    WriteLat,
    /// RDMA Read bandwidth.
    ReadBw,
    /// Send bandwidth.
    SendBw,
    /// Send latency (ping-pong of sends).
    SendLat,
}

impl TestKind {
    pub const ALL: [TestKind; 5] =
        [TestKind::WriteBw, TestKind::WriteLat, TestKind::ReadBw, TestKind::SendBw, TestKind::SendLat];

    /// Program name.
    pub fn name(self) -> &'static str {
        match self {
            TestKind::WriteBw => "write_bw",
            TestKind::WriteLat => "write_lat",
            TestKind::ReadBw => "read_bw",
            TestKind::SendBw => "send_bw",
            TestKind::SendLat => "send_lat",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            TestKind::WriteBw => "RDMA_Write BW Test",
            TestKind::WriteLat => "RDMA_Write Latency Test",
            TestKind::ReadBw => "RDMA_Read BW Test",
            TestKind::SendBw => "Send BW Test",
            TestKind::SendLat => "Send Latency Test",
        }
    }

    pub fn about(self) -> &'static str {
        match self {
            TestKind::WriteBw => "RDMA Write bandwidth test (like perftest's ib_write_bw)",
            TestKind::WriteLat => "RDMA Write latency test (like perftest's ib_write_lat)",
            TestKind::ReadBw => "RDMA Read bandwidth test (like perftest's ib_read_bw)",
            TestKind::SendBw => "Send bandwidth test (like perftest's ib_send_bw)",
            TestKind::SendLat => "Send latency test (like perftest's ib_send_lat)",
        }
    }

    /// Bandwidth (true) or latency test.
    pub fn is_bw(self) -> bool {
        matches!(self, TestKind::WriteBw | TestKind::ReadBw | TestKind::SendBw)
    }

    /// Whether the receiver posts receives.
    pub fn uses_recv(self) -> bool {
        matches!(self, TestKind::SendBw | TestKind::SendLat)
    }

    pub fn id(self) -> u64 {
        TestKind::ALL.iter().position(|&k| k == self).unwrap_or(0) as u64 + 1
    }

    pub fn from_id(id: u64) -> Option<TestKind> {
        TestKind::ALL.get((id as usize).checked_sub(1)?).copied()
    }
}

/// The parameters both sides agree on (the client's, after defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    /// Message size (the largest one with `all`).
    pub size: u64,
    /// Size sweep.
    pub all: bool,
    /// Iterations per queue pair.
    pub iters: u64,
    /// Queue pairs.
    pub qps: u32,
    /// Send queue depth.
    pub tx_depth: u32,
    /// Receive queue depth.
    pub rx_depth: u32,
    /// Requested CQ moderation (0: perftest's rule).
    pub cq_mod: u32,
    /// Work requests per post call.
    pub post_list: u32,
    /// Inline threshold.
    pub inline: u32,
    /// Path MTU in bytes (0: active MTU).
    pub mtu: u32,
    /// Posting level.
    pub level: Level,
}

pub const HELLO_WORDS: usize = 12;
pub const MAX_SWEEP_SIZE: u64 = 1 << 23;
pub const MIN_SWEEP_ITERS: u64 = 16;
pub const CYCLE_BUFFER: u64 = 4096;
pub const CACHE_LINE: u64 = 64;

impl Params {
    pub fn validate(&self, kind: TestKind) -> Result<(), String> {
        if self.size == 0 || self.size > u64::from(u32::MAX) {
            return Err(format!("size must be 1..={} bytes", u32::MAX));
        }
        if self.iters < 5 || self.iters >= 1 << 40 {
            return Err("iterations must be at least 5 (and below 2^40)".into());
        }
        if self.qps == 0 || self.qps > 1024 {
            return Err("the number of queue pairs must be 1..=1024".into());
        }
        if !kind.is_bw() && self.qps != 1 {
            return Err("latency tests use one queue pair (-q 1)".into());
        }
        if self.tx_depth == 0 || self.rx_depth == 0 || self.post_list == 0 {
            return Err("tx depth, rx depth and post list must be at least 1".into());
        }
        if self.tx_depth > 1 << 16 || self.rx_depth > 1 << 16 {
            return Err("tx and rx depths are at most 65536".into());
        }
        if self.post_list > 1 && (!kind.is_bw() || self.iters % u64::from(self.post_list) != 0) {
            return Err("--post-list is for bandwidth tests, and must divide the iterations".into());
        }
        if self.post_list > self.tx_depth {
            return Err("--post-list cannot exceed the tx depth".into());
        }
        if self.mtu != 0 && Mtu::from_bytes(self.mtu).is_none() {
            return Err(format!("invalid MTU {} (256, 512, 1024, 2048 or 4096)", self.mtu));
        }
        Ok(())
    }

    pub fn encode(&self, kind: TestKind) -> Vec<u8> {
        let words: [u64; HELLO_WORDS] = [
            kind.id(),
            self.size,
            u64::from(self.all),
            self.iters,
            u64::from(self.qps),
            u64::from(self.tx_depth),
            u64::from(self.rx_depth),
            u64::from(self.cq_mod),
            u64::from(self.post_list),
            u64::from(self.inline),
            u64::from(self.mtu),
            (self.level == Level::Raw) as u64,
        ];
        words.iter().flat_map(|w| w.to_be_bytes()).collect()
    }

    pub fn decode(kind: TestKind, b: &[u8], own_level: Option<Level>) -> Result<Params, String> {
        if b.len() != HELLO_WORDS * 8 {
            return Err("protocol error: bad hello (is the client one of our perf examples?)".into());
        }
        let w = |i: usize| u64::from_be_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let n = |i: usize| u32::try_from(w(i)).map_err(|_| "protocol error: bad hello".to_string());
        let theirs = TestKind::from_id(w(0)).map_or("an unknown test", |k| k.name());
        if w(0) != kind.id() {
            return Err(format!("the client runs {theirs} but this server is {}", kind.name()));
        }
        let p = Params {
            size: w(1),
            all: w(2) != 0,
            iters: w(3),
            qps: n(4)?,
            tx_depth: n(5)?,
            rx_depth: n(6)?,
            cq_mod: n(7)?,
            post_list: n(8)?,
            inline: n(9)?,
            mtu: n(10)?,
            level: own_level.unwrap_or(if w(11) != 0 { Level::Raw } else { Level::Safe }),
        };
        p.validate(kind)?;
        Ok(p)
    }

    /// The measurements to run: (size, iterations per queue pair).
    pub fn plan(&self, kind: TestKind) -> Vec<(u64, u64)> {
        if !self.all {
            return vec![(self.size, self.iters)];
        }
        let budget: u64 = if kind.is_bw() { 64 << 20 } else { 16 << 20 };
        let pl = u64::from(self.post_list);
        (1..=23)
            .map(|e| {
                let size = 1u64 << e;
                let iters = self.iters.min((budget / size).max(MIN_SWEEP_ITERS));
                (size, (iters / pl * pl).max(pl))
            })
            .collect()
    }

    /// The CQ moderation of a measurement (perftest's rules).
    pub fn cq_mod_for(&self, size: u64, tx_depth: u32) -> u32 {
        let m = if self.post_list > 1 {
            self.post_list
        } else if self.cq_mod != 0 {
            self.cq_mod
        } else if size > 8192 && !self.all {
            1
        } else {
            100
        };
        m.min(tx_depth).max(1)
    }
}
