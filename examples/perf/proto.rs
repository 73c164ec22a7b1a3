//! The out-of-band protocol of the perftest-style examples as data: frames, the tests and their
//! parameters, and the encodings of the messages. No sockets here: the frame reader takes any
//! [`ByteSource`], so that host tests can include this file and feed every decoder arbitrary
//! bytes. Every decoder checks every field and accepts only the encoding its encoder produces.
//!
//! A frame is a tag byte, a big-endian `u32` payload length and the payload. Each tag has a fixed
//! payload length (or a small set of them), checked from the header before any payload is read,
//! so that a peer speaking another protocol is refused at its first bytes.

use ibverbs::{Endpoint, Mtu, RemoteSlice};

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
    /// Either way, at any time: the sender is alive (sent every second or so by a thread of
    /// each side, so that a silent peer, a dead host or a stopped process, is noticed within
    /// `--timeout` even when the other side is only waiting). Empty.
    Alive = 8,
    /// Server → client, with `-R` only: the RDMA-CM port the server listens on (big-endian
    /// `u16`), sent before `Setup`; the client connects each queue pair there.
    CmPort = 9,
    /// Either way: the sender failed; the payload (text) says why.
    Error = 0xee,
}

/// Bytes of a frame header: the tag and the payload length.
pub const HEADER_LEN: usize = 5;
/// Bytes of a `Hello` payload.
pub const HELLO_LEN: usize = HELLO_WORDS * 8;
/// Bytes of a `Run` payload: size and iterations.
pub const RUN_LEN: usize = 16;
/// Bytes a `Setup` frame carries per queue pair: its endpoint and its buffer's remote slice.
pub const SETUP_ENTRY_LEN: usize = Endpoint::ENCODED_LEN + RemoteSlice::ENCODED_LEN;
/// The most queue pairs a test may use.
pub const MAX_QPS: u32 = 1024;
/// Bytes of a report (`Done`/`Ack` payload, when there is one).
pub const REPORT_LEN: usize = 40;
/// The most work requests per post call (`--post-list`).
pub const MAX_POST_LIST: u32 = 1024;
/// The longest error message accepted.
pub const MAX_ERROR_LEN: usize = 1024;

impl Tag {
    /// The tag of a tag byte.
    pub fn from_u8(b: u8) -> Option<Tag> {
        Some(match b {
            1 => Tag::Hello,
            2 => Tag::Setup,
            3 => Tag::Run,
            4 => Tag::Ready,
            5 => Tag::Done,
            6 => Tag::Ack,
            7 => Tag::End,
            8 => Tag::Alive,
            9 => Tag::CmPort,
            0xee => Tag::Error,
            _ => return None,
        })
    }

    /// Whether a frame with this tag may carry `len` payload bytes.
    pub fn allows_len(self, len: usize) -> bool {
        match self {
            Tag::Hello => len == HELLO_LEN,
            Tag::Setup => len > 0 && len % SETUP_ENTRY_LEN == 0 && len / SETUP_ENTRY_LEN <= MAX_QPS as usize,
            Tag::Run => len == RUN_LEN,
            Tag::Ready | Tag::End | Tag::Alive => len == 0,
            Tag::CmPort => len == 2,
            Tag::Done | Tag::Ack => len == 0 || len == REPORT_LEN,
            Tag::Error => len <= MAX_ERROR_LEN,
        }
    }
}

/// A frame: header and payload.
pub fn encode_frame(tag: Tag, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
    frame.push(tag as u8);
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// Why bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadError {
    /// The peer closed the connection (after `got` bytes of the frame).
    Closed {
        /// Bytes of the current frame received before the end.
        got: usize,
    },
    /// Nothing arrived in time.
    TimedOut,
    /// Another failure, described.
    Failed(String),
}

/// Where frames come from: a socket with deadlines, or bytes in a test.
pub trait ByteSource {
    /// Fills `buf` completely.
    fn fill(&mut self, buf: &mut [u8]) -> Result<(), ReadError>;
}

impl ByteSource for &[u8] {
    fn fill(&mut self, buf: &mut [u8]) -> Result<(), ReadError> {
        if self.len() < buf.len() {
            let got = self.len();
            *self = &[];
            return Err(ReadError::Closed { got });
        }
        let (head, rest) = self.split_at(buf.len());
        buf.copy_from_slice(head);
        *self = rest;
        Ok(())
    }
}

/// Why no expected frame was received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Reading failed.
    Read(ReadError),
    /// The peer sent an `Error` frame: its message, made printable.
    Peer(String),
    /// The peer sent something else than the protocol allows here.
    Protocol(String),
}

/// Whether the first bytes of a message are perftest's first message: its version string
/// (`"6.10"`, NUL-padded to 16 bytes), which a perftest peer sends where our frames begin.
pub fn looks_like_perftest(head: &[u8]) -> bool {
    let digits = head.iter().take_while(|b| b.is_ascii_digit()).count();
    (1..=2).contains(&digits)
        && head.get(digits) == Some(&b'.')
        && head.get(digits + 1).is_some_and(u8::is_ascii_digit)
}

/// Reads the next frame whose tag is one of `expect`, skipping `Alive` frames (`on_alive` runs
/// for each). Refuses a bad header before reading its payload.
pub fn read_frame(
    src: &mut impl ByteSource,
    expect: &[Tag],
    mut on_alive: impl FnMut(),
) -> Result<(Tag, Vec<u8>), FrameError> {
    loop {
        let mut head = [0u8; HEADER_LEN];
        src.fill(&mut head).map_err(FrameError::Read)?;
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let Some(tag) = Tag::from_u8(head[0]) else {
            if looks_like_perftest(&head) {
                return Err(FrameError::Protocol(format!(
                    "received {}, perftest's version string: the peer is perftest's C tool, whose \
                     exchange these examples do not speak (pair ours with ours)",
                    show_bytes(&head)
                )));
            }
            return Err(FrameError::Protocol(format!(
                "received {}, which is not a frame of our perf examples (is the peer one of them?)",
                show_bytes(&head)
            )));
        };
        if tag != Tag::Alive && tag != Tag::Error && !expect.contains(&tag) {
            return Err(FrameError::Protocol(format!("expected {}, received {tag:?}", names(expect))));
        }
        if !tag.allows_len(len) {
            return Err(FrameError::Protocol(format!(
                "a {tag:?} frame of {len} bytes (received {}; is the peer one of our perf examples?)",
                show_bytes(&head)
            )));
        }
        let mut payload = vec![0u8; len];
        src.fill(&mut payload).map_err(|e| match e {
            ReadError::Closed { got } => FrameError::Read(ReadError::Closed { got: HEADER_LEN + got }),
            e => FrameError::Read(e),
        })?;
        match tag {
            Tag::Alive => on_alive(),
            Tag::Error => return Err(FrameError::Peer(peer_text(&payload))),
            _ => return Ok((tag, payload)),
        }
    }
}

fn names(tags: &[Tag]) -> String {
    let names: Vec<String> = tags.iter().map(|t| format!("{t:?}")).collect();
    names.join(" or ")
}

/// Bytes as printable ASCII with escapes, e.g. `"GET /"` or `"\x01\x00"`.
pub fn show_bytes(b: &[u8]) -> String {
    let text: String = b.iter().flat_map(|&c| std::ascii::escape_default(c)).map(char::from).collect();
    format!("\"{text}\"")
}

/// A peer's error message, safe to print on one line: invalid UTF-8 replaced, control
/// characters escaped, at most 300 characters.
pub fn peer_text(payload: &[u8]) -> String {
    let text = String::from_utf8_lossy(payload);
    let mut out = String::new();
    for (n, c) in text.chars().enumerate() {
        if n == 300 {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A `Run` payload.
pub fn encode_run(size: u64, iters: u64) -> Vec<u8> {
    let mut b = size.to_be_bytes().to_vec();
    b.extend_from_slice(&iters.to_be_bytes());
    b
}

/// Decodes a `Run` payload: (size, iterations). Whether it is the expected run is for the caller
/// (it knows the plan).
pub fn decode_run(b: &[u8]) -> Result<(u64, u64), String> {
    let b: &[u8; RUN_LEN] = b.try_into().map_err(|_| format!("a run message of {} bytes", b.len()))?;
    let (size, iters) = b.split_at(8);
    let word = |w: &[u8]| u64::from_be_bytes(w.try_into().unwrap_or_default());
    Ok((word(size), word(iters)))
}

/// A `Setup` payload: per queue pair its endpoint and its buffer's descriptor (all zero when the
/// peer needs none).
pub fn encode_setup(entries: &[(Endpoint, RemoteSlice)]) -> Vec<u8> {
    let mut b = Vec::with_capacity(entries.len() * SETUP_ENTRY_LEN);
    for (ep, slice) in entries {
        b.extend_from_slice(&ep.encode());
        b.extend_from_slice(&slice.encode());
    }
    b
}

/// Decodes a `Setup` payload for `qps` queue pairs. `need` is how many bytes each remote buffer
/// must have (`None`: the peer exposes no buffer, and its descriptors must be all zero).
pub fn decode_setup(b: &[u8], qps: usize, need: Option<u64>) -> Result<Vec<(Endpoint, RemoteSlice)>, String> {
    if b.len() != qps * SETUP_ENTRY_LEN {
        return Err(format!("a setup message of {} bytes for {qps} queue pairs", b.len()));
    }
    let mut out = Vec::with_capacity(qps);
    for (i, chunk) in b.chunks_exact(SETUP_ENTRY_LEN).enumerate() {
        let (ep_bytes, slice_bytes) = chunk.split_at(Endpoint::ENCODED_LEN);
        let ep = Endpoint::decode(ep_bytes).map_err(|e| format!("queue pair {i}: {e}"))?;
        // Only the canonical encoding (e.g. reserved bytes zero).
        if ep.encode()[..] != *ep_bytes {
            return Err(format!("queue pair {i}: malformed endpoint {}", show_bytes(ep_bytes)));
        }
        let slice = RemoteSlice::decode(slice_bytes).map_err(|e| format!("queue pair {i}: {e}"))?;
        match need {
            None if slice != (RemoteSlice { addr: 0, len: 0, rkey: 0 }) => {
                return Err(format!("queue pair {i}: a buffer descriptor where none belongs"));
            }
            Some(need) if slice.len < need => {
                return Err(format!(
                    "queue pair {i}: the peer's buffer has {} bytes, {need} needed",
                    slice.len
                ));
            }
            _ => {}
        }
        out.push((ep, slice));
    }
    Ok(out)
}

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

/// The level used when neither `--safe` nor `--raw` is given: the safe one, which measures as
/// the raw one does. In 30 alternating rounds in one SoftRoCE guest, `write_lat` (the test the
/// safe level lagged in longest) gave medians of 11.33 µs safe against 11.18 µs raw at 2 B and
/// 82.54 against 81.75 µs at 4 KiB, once it polled through `RemoteByte`; the README's sweep
/// compares both levels with perftest at every size.
pub const DEFAULT_LEVEL: Level = Level::Safe;

impl Level {
    /// How the header names it.
    pub fn describe(self) -> &'static str {
        match self {
            Level::Safe => "safe (prepared posts and receives + poll)",
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
    /// Every test.
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

    /// The header's title.
    pub fn title(self) -> &'static str {
        match self {
            TestKind::WriteBw => "RDMA_Write BW Test",
            TestKind::WriteLat => "RDMA_Write Latency Test",
            TestKind::ReadBw => "RDMA_Read BW Test",
            TestKind::SendBw => "Send BW Test",
            TestKind::SendLat => "Send Latency Test",
        }
    }

    /// The command's description.
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

    /// The number a `Hello` carries.
    pub fn id(self) -> u64 {
        TestKind::ALL.iter().position(|&k| k == self).unwrap_or(0) as u64 + 1
    }

    /// The test of a `Hello`'s number.
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

/// Words of a `Hello`.
pub const HELLO_WORDS: usize = 12;
/// The largest size of a sweep (`--all`).
pub const MAX_SWEEP_SIZE: u64 = 1 << 23;
/// The fewest iterations of a size in a sweep.
pub const MIN_SWEEP_ITERS: u64 = 16;
/// perftest's cycle buffer: small messages cycle through a page.
pub const CYCLE_BUFFER: u64 = 4096;
/// Alignment of small messages in the cycle buffer.
pub const CACHE_LINE: u64 = 64;

impl Params {
    /// Checks the parameters of test `kind` (the client's command line, or a client's hello).
    pub fn validate(&self, kind: TestKind) -> Result<(), String> {
        if self.size == 0 || self.size > u64::from(u32::MAX) {
            return Err(format!("size must be 1..={} bytes", u32::MAX));
        }
        if self.iters < 5 || self.iters >= 1 << 40 {
            return Err("iterations must be at least 5 (and below 2^40)".into());
        }
        if self.all && self.size != MAX_SWEEP_SIZE {
            return Err(format!("a size sweep goes up to {MAX_SWEEP_SIZE} bytes, not {}", self.size));
        }
        if self.qps == 0 || self.qps > MAX_QPS {
            return Err(format!("the number of queue pairs must be 1..={MAX_QPS}"));
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
        if self.post_list > MAX_POST_LIST {
            return Err(format!("--post-list is at most {MAX_POST_LIST}"));
        }
        if self.post_list > self.tx_depth {
            return Err("--post-list cannot exceed the tx depth".into());
        }
        if self.mtu != 0 && Mtu::from_bytes(self.mtu).is_none() {
            return Err(format!("invalid MTU {} (256, 512, 1024, 2048 or 4096)", self.mtu));
        }
        Ok(())
    }

    /// The `Hello` payload.
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

    /// Decodes a `Hello` payload for a server of test `kind` (`own_level`: the server's own
    /// `--safe`/`--raw`, which overrides the client's). Accepts only what [`encode`](Self::encode)
    /// produces for valid parameters.
    pub fn decode(kind: TestKind, b: &[u8], own_level: Option<Level>) -> Result<Params, String> {
        let b: &[u8; HELLO_LEN] = b.try_into().map_err(|_| format!("a hello of {} bytes", b.len()))?;
        let mut words = [0u64; HELLO_WORDS];
        for (w, chunk) in words.iter_mut().zip(b.chunks_exact(8)) {
            *w = u64::from_be_bytes(chunk.try_into().unwrap_or_default());
        }
        if words[0] != kind.id() {
            let theirs = TestKind::from_id(words[0]).map_or("an unknown test", |k| k.name());
            return Err(format!("the client runs {theirs} but this server is {}", kind.name()));
        }
        let flag = |i: usize, what: &str| match words[i] {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(format!("bad hello: {what} is {v}, not 0 or 1")),
        };
        let n = |i: usize, what: &str| {
            u32::try_from(words[i]).map_err(|_| format!("bad hello: {what} of {} is out of range", words[i]))
        };
        let raw = flag(11, "the posting level")?;
        let p = Params {
            size: words[1],
            all: flag(2, "the size sweep flag")?,
            iters: words[3],
            qps: n(4, "a queue pair count")?,
            tx_depth: n(5, "a tx depth")?,
            rx_depth: n(6, "an rx depth")?,
            cq_mod: n(7, "a CQ moderation")?,
            post_list: n(8, "a post list")?,
            inline: n(9, "an inline size")?,
            mtu: n(10, "an MTU")?,
            level: if raw { Level::Raw } else { Level::Safe },
        };
        p.validate(kind)?;
        Ok(Params { level: own_level.unwrap_or(p.level), ..p })
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
