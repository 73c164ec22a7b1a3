//! Seeded property tests of the decoders of every message the examples receive from a peer: the
//! pingpong tools' address message and `"done"` (`examples/common/wire.rs`), and the perf
//! examples' frames, hello, setup, run and report (`examples/perf/proto.rs`,
//! `examples/perf/report.rs`). A host test (no device): the modules are included by `#[path]`.
//!
//! Each decoder gets hundreds of thousands of inputs: random bytes, bytes drawn from the
//! characters that matter to it, valid encodings of random values, and valid encodings mutated
//! (bytes changed, multi-byte UTF-8 characters spliced in, bytes inserted or removed, truncated,
//! extended). For every input: no panic; accepted exactly when an independent oracle, written here
//! from the format's description, says the input is valid; an accepted input is the canonical
//! encoding of what it decodes to (re-encoding gives the same bytes); and valid values round-trip.
//! The generator is a fixed-seed xorshift, so every run sees the same inputs; a failure prints
//! the input.

#[allow(dead_code)]
#[path = "../examples/perf/clock.rs"]
mod clock;
#[allow(dead_code)]
#[path = "../examples/perf/proto.rs"]
mod proto;
#[allow(dead_code)]
#[path = "../examples/perf/report.rs"]
mod report;
#[allow(dead_code)]
#[path = "../examples/common/wire.rs"]
mod wire;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use ibverbs::{Endpoint, Gid, Mtu, RemoteSlice};
use proto::{Level, Params, Tag, TestKind};
use report::BwReport;
use wire::Dest;

/// xorshift64* with a fixed seed: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0; the bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    /// Up to `max - 1` random bytes.
    fn some_bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max);
        self.bytes(n)
    }

    /// A length: `exact` half of the time, one off, or anything below `max`.
    fn len_near(&mut self, exact: usize, max: usize) -> usize {
        match self.below(8) {
            0..=3 => exact,
            4 => exact.saturating_sub(1),
            5 => exact + 1,
            _ => self.below(max),
        }
    }

    /// A u64 that is often on a boundary.
    fn word(&mut self) -> u64 {
        match self.below(6) {
            0 => self.next(),
            1 => self.below(10) as u64,
            2 => self.pick(&[u32::MAX as u64, 1 << 32, (1 << 40) - 1, 1 << 40, u64::MAX, 1 << 23, 1 << 16]),
            3 => self.next() >> self.below(64),
            4 => (1u64 << self.below(64)).wrapping_add(self.pick(&[0, 1, u64::MAX])),
            _ => self.below(70_000) as u64,
        }
    }
}

/// Multi-byte UTF-8 characters and other troublemakers to splice in.
const SPLICES: &[&str] = &["€", "é", "𝄞", "中", "\u{feff}", "\0", ":", "+", "-", " ", "0x", "ff", "FF"];

/// Applies 1 to 3 random mutations to `m`.
fn mutate(rng: &mut Rng, m: &mut Vec<u8>, alphabet: &[u8]) {
    for _ in 0..1 + rng.below(3) {
        let at = if m.is_empty() { 0 } else { rng.below(m.len()) };
        match rng.below(9) {
            0 if !m.is_empty() => m[at] = rng.next() as u8,
            1 if !m.is_empty() => m[at] = rng.pick(alphabet),
            2 if !m.is_empty() => m[at] ^= 1 << rng.below(8),
            3 => {
                // Replace as many bytes as the character has: the length stays the same.
                let s = rng.pick(SPLICES).as_bytes();
                let end = (at + s.len()).min(m.len());
                m.splice(at..end, s.iter().copied());
            }
            4 => m.insert(at.min(m.len()), rng.pick(alphabet)),
            5 if !m.is_empty() => {
                m.remove(at);
            }
            6 => m.truncate(rng.below(m.len() + 1)),
            7 => m.extend(rng.some_bytes(4)),
            _ if !m.is_empty() => m[at] = m[at].to_ascii_uppercase(),
            _ => m.push(rng.pick(alphabet)),
        }
    }
}

/// Runs `f`, turning a panic into a failure that shows the input.
fn no_panic<T>(what: &str, input: &[u8], f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            panic!("{what} panicked on input {:?} ({} bytes)", String::from_utf8_lossy(input), input.len())
        }
    }
}

/// Counts inputs and accepted inputs, and prints them with the time taken.
struct Tally {
    what: &'static str,
    inputs: u64,
    accepted: u64,
    start: Instant,
}

impl Tally {
    fn new(what: &'static str) -> Tally {
        Tally { what, inputs: 0, accepted: 0, start: Instant::now() }
    }

    fn count(&mut self, accepted: bool) {
        self.inputs += 1;
        self.accepted += u64::from(accepted);
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        eprintln!(
            "{}: {} inputs ({} valid) in {:.2} s, no panic, no invalid input accepted",
            self.what,
            self.inputs,
            self.accepted,
            self.start.elapsed().as_secs_f64()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The pingpong tools' address message

/// The format, independently: `%04x:%06x:%06x:` + 32 hex digits + NUL, 52 bytes.
fn address_is_valid(m: &[u8]) -> bool {
    m.len() == 52
        && m.iter().enumerate().all(|(i, &c)| match i {
            4 | 11 | 18 => c == b':',
            51 => c == 0,
            _ => c.is_ascii_hexdigit(),
        })
}

fn random_dest(rng: &mut Rng) -> Dest {
    let mut gid = [0u8; 16];
    gid.iter_mut().for_each(|b| *b = rng.next() as u8);
    if rng.chance(20) {
        gid = [0; 16];
    }
    Dest {
        lid: rng.next() as u16,
        qpn: rng.next() as u32 & 0xff_ffff,
        psn: rng.next() as u32 & 0xff_ffff,
        gid: Gid(gid),
    }
}

#[test]
fn pingpong_address_decoder() {
    const N: usize = 400_000;
    let mut rng = Rng::new(0x5eed_0001);
    let alphabet: Vec<u8> = b"0123456789abcdefABCDEFgG:\0 +-xX\xe2\x82\xac\xc3\xff".to_vec();
    let mut tally = Tally::new("pingpong address message");
    for i in 0..N {
        let m: Vec<u8> = match i % 4 {
            0 => {
                let n = rng.len_near(52, 64);
                rng.bytes(n)
            }
            1 => {
                // The characters that matter, in the right places more often than not.
                let mut m = random_dest(&mut rng).to_wire().to_vec();
                for b in m.iter_mut() {
                    if rng.chance(3) {
                        *b = rng.pick(&alphabet);
                    }
                }
                m
            }
            2 => {
                let d = random_dest(&mut rng);
                let w = d.to_wire();
                assert_eq!(Dest::from_wire(&w), Ok(d), "round trip of {d:?}");
                if rng.chance(20) {
                    w.to_ascii_uppercase() // sscanf takes upper-case hex digits: so do we
                } else {
                    w.to_vec()
                }
            }
            _ => {
                let mut m = random_dest(&mut rng).to_wire().to_vec();
                mutate(&mut rng, &mut m, &alphabet);
                m
            }
        };
        let got = no_panic("Dest::from_wire", &m, || Dest::from_wire(&m));
        let valid = address_is_valid(&m);
        assert_eq!(got.is_ok(), valid, "input {:?}: decoder says {got:?}", String::from_utf8_lossy(&m));
        if let Ok(d) = got {
            assert_eq!(d.to_wire().to_vec(), m.to_ascii_lowercase(), "not canonical: {m:?}");
        }
        // The incremental check refuses exactly the inputs no valid message starts with.
        let prefix_ok = m.len() <= 52
            && address_is_valid(&[&m[..], &random_dest(&mut rng).to_wire()[m.len()..]].concat());
        let checked = no_panic("check_prefix", &m, || wire::check_prefix(&m));
        assert_eq!(
            checked.is_ok(),
            prefix_ok,
            "check_prefix on {:?}: {checked:?}",
            String::from_utf8_lossy(&m)
        );
        tally.count(valid);
    }
    // The operator's input.
    let mut euro = b"0000:000011:abcdef:".to_vec();
    euro.extend("€".bytes());
    euro.extend([b'0'; 29]);
    euro.push(0);
    assert!(Dest::from_wire(&euro).is_err());
}

#[test]
fn pingpong_done_decoder() {
    let mut rng = Rng::new(0x5eed_0002);
    let mut tally = Tally::new("pingpong \"done\" message");
    for _ in 0..100_000 {
        let mut m = b"done\0"[..rng.below(6)].to_vec();
        if rng.chance(70) {
            mutate(&mut rng, &mut m, b"done\0DONE");
        }
        let got = no_panic("check_done", &m, || wire::check_done(&m));
        let valid = b"done\0".starts_with(&m);
        assert_eq!(got.is_ok(), valid, "{m:?}");
        tally.count(valid && m.len() == 5);
    }
}

// ---------------------------------------------------------------------------------------------
// The perf examples' frames

const TAGS: [Tag; 10] = [
    Tag::Hello,
    Tag::Setup,
    Tag::Run,
    Tag::Ready,
    Tag::Done,
    Tag::Ack,
    Tag::End,
    Tag::Alive,
    Tag::CmPort,
    Tag::Error,
];

/// The payload lengths each tag allows, independently of `Tag::allows_len`.
fn len_ok(tag_byte: u8, len: usize) -> bool {
    match tag_byte {
        1 => len == 96,
        2 => len > 0 && len % 50 == 0 && len / 50 <= 1024,
        3 => len == 16,
        4 | 7 | 8 => len == 0,
        9 => len == 2,
        5 | 6 => len == 0 || len == 40,
        0xee => len <= 1024,
        _ => false,
    }
}

/// The outcome the protocol prescribes for a byte stream: the frame (tag, payload, bytes
/// consumed), or an error (`None`), skipping `Alive` frames.
fn frame_oracle(mut b: &[u8], expect: &[u8]) -> Option<(u8, Vec<u8>, usize)> {
    let mut used = 0;
    loop {
        if b.len() < 5 {
            return None;
        }
        let tag = b[0];
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        let known = matches!(tag, 1..=9 | 0xee);
        if !known
            || !(tag == 8 || tag == 0xee || expect.contains(&tag))
            || !len_ok(tag, len)
            || b.len() < 5 + len
        {
            return None;
        }
        used += 5 + len;
        match tag {
            8 => b = &b[5..],
            0xee => return None,
            _ => return Some((tag, b[5..5 + len].to_vec(), used)),
        }
    }
}

fn random_frame(rng: &mut Rng) -> Vec<u8> {
    let tag = rng.pick(&TAGS);
    let len = match tag {
        Tag::Hello => 96,
        Tag::Setup => 50 * (1 + rng.below(4)),
        Tag::Run => 16,
        Tag::CmPort => 2,
        Tag::Done | Tag::Ack => rng.pick(&[0, 40]),
        Tag::Error => rng.below(80),
        _ => 0,
    };
    let payload = rng.bytes(len);
    proto::encode_frame(tag, &payload)
}

#[test]
fn perf_frame_reader() {
    const N: usize = 300_000;
    let mut rng = Rng::new(0x5eed_0003);
    let mut tally = Tally::new("perf frames");
    let header_bytes = [0u8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0xee, 0xff, 0x40, b'G', b'0'];
    for i in 0..N {
        let mut stream = Vec::new();
        match i % 3 {
            0 => stream = rng.some_bytes(120),
            1 => {
                for _ in 0..rng.below(3) {
                    stream.extend(proto::encode_frame(Tag::Alive, &[]));
                }
                stream.extend(random_frame(&mut rng));
            }
            _ => {
                for _ in 0..1 + rng.below(3) {
                    stream.extend(random_frame(&mut rng));
                }
                mutate(&mut rng, &mut stream, &header_bytes);
            }
        }
        let expect: Vec<Tag> = TAGS.iter().copied().filter(|_| rng.chance(40)).collect();
        let expect_bytes: Vec<u8> = expect.iter().map(|&t| t as u8).collect();
        let mut src: &[u8] = &stream;
        let mut alive = 0;
        let got = no_panic("read_frame", &stream, || proto::read_frame(&mut src, &expect, || alive += 1));
        let want = frame_oracle(&stream, &expect_bytes);
        match (&got, &want) {
            (Ok((tag, payload)), Some((wtag, wpayload, used))) => {
                assert_eq!((*tag as u8, payload), (*wtag, wpayload), "{stream:?}");
                assert_eq!(stream.len() - src.len(), *used, "bytes consumed from {stream:?}");
                // The frame itself is canonical.
                assert_eq!(proto::encode_frame(*tag, payload), stream[used - 5 - payload.len()..*used]);
            }
            (Err(_), None) => {}
            _ => panic!("frame reader on {stream:?} expecting {expect:?}: {got:?}, oracle {want:?}"),
        }
        if let Err(proto::FrameError::Peer(msg)) = &got {
            assert!(!msg.chars().any(char::is_control), "control characters in {msg:?}");
        }
        tally.count(got.is_ok());
    }
}

#[test]
fn perf_peer_error_text() {
    let mut rng = Rng::new(0x5eed_0004);
    let mut tally = Tally::new("perf error texts");
    for _ in 0..50_000 {
        let mut b = rng.some_bytes(700);
        if rng.chance(50) {
            b = b.iter().map(|&c| c & 0x7f).collect();
        }
        let t = no_panic("peer_text", &b, || proto::peer_text(&b));
        assert!(!t.chars().any(char::is_control), "{t:?}");
        assert!(t.chars().count() <= 301 * 10, "{t:?}"); // an escaped character is at most 10 long
        tally.count(true);
    }
}

// ---------------------------------------------------------------------------------------------
// The perf examples' hello

/// The rules of a hello for a server of test `kind`, independently of `Params::validate`.
fn hello_is_valid(kind: TestKind, b: &[u8]) -> bool {
    if b.len() != 96 {
        return false;
    }
    let w: Vec<u64> = b.chunks(8).map(|c| u64::from_be_bytes(c.try_into().unwrap())).collect();
    let bw = matches!(kind, TestKind::WriteBw | TestKind::ReadBw | TestKind::SendBw);
    let id = TestKind::ALL.iter().position(|&k| k == kind).unwrap() as u64 + 1;
    let (size, all, iters, qps, tx, rx, _cq_mod, pl, _inline, mtu, raw) =
        (w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], w[10], w[11]);
    w[0] == id
        && all <= 1
        && raw <= 1
        && w[4..=10].iter().all(|&x| x <= u32::MAX as u64)
        && (1..=u32::MAX as u64).contains(&size)
        && (all == 0 || size == 1 << 23)
        && (5..1 << 40).contains(&iters)
        && (1..=1024).contains(&qps)
        && (bw || qps == 1)
        && (1..=65536).contains(&tx)
        && (1..=65536).contains(&rx)
        && pl >= 1
        && (pl == 1 || (bw && iters % pl == 0))
        && pl <= tx
        && pl <= 1024
        && matches!(mtu, 0 | 256 | 512 | 1024 | 2048 | 4096)
}

fn random_params(rng: &mut Rng, kind: TestKind) -> Params {
    let bw = kind.is_bw();
    let all = rng.chance(10);
    let post_list = if bw && rng.chance(30) { 1 + rng.below(8) as u32 } else { 1 };
    let tx_depth = post_list + rng.below(200) as u32;
    let iters = post_list as u64 * (5 + rng.below(1_000_000) as u64);
    Params {
        size: if all { 1 << 23 } else { 1 + rng.next() % u32::MAX as u64 },
        all,
        iters,
        qps: if bw { 1 + rng.below(1024) as u32 } else { 1 },
        tx_depth,
        rx_depth: 1 + rng.below(65536) as u32,
        cq_mod: rng.next() as u32,
        post_list,
        inline: rng.next() as u32,
        mtu: rng.pick(&[0, 256, 512, 1024, 2048, 4096]),
        level: if rng.chance(50) { Level::Raw } else { Level::Safe },
    }
}

#[test]
fn perf_hello_decoder() {
    const N: usize = 300_000;
    let mut rng = Rng::new(0x5eed_0005);
    let mut tally = Tally::new("perf hello");
    for i in 0..N {
        let kind = rng.pick(&TestKind::ALL);
        let b: Vec<u8> = match i % 4 {
            0 => {
                let n = rng.len_near(96, 120);
                rng.bytes(n)
            }
            1 => {
                // Boundary-heavy words, the test id mostly right.
                let mut w: Vec<u64> = (0..12).map(|_| rng.word()).collect();
                if rng.chance(80) {
                    w[0] = kind.id();
                }
                w.iter().flat_map(|x| x.to_be_bytes()).collect()
            }
            2 => {
                let p = random_params(&mut rng, kind);
                let b = p.encode(kind);
                assert_eq!(Params::decode(kind, &b, None), Ok(p.clone()), "round trip of {p:?}");
                let other = if p.level == Level::Raw { Level::Safe } else { Level::Raw };
                let own = Params::decode(kind, &b, Some(other)).map(|q| q.level);
                assert_eq!(own, Ok(other), "the server's own level wins");
                b
            }
            _ => {
                let mut b = random_params(&mut rng, kind).encode(kind);
                if rng.chance(50) {
                    // A word set to a boundary value.
                    let at = rng.below(12) * 8;
                    b[at..at + 8].copy_from_slice(&rng.word().to_be_bytes());
                } else {
                    mutate(&mut rng, &mut b, &[0, 1, 0xff, 0x80]);
                }
                b
            }
        };
        let got = no_panic("Params::decode", &b, || Params::decode(kind, &b, None));
        let valid = hello_is_valid(kind, &b);
        assert_eq!(got.is_ok(), valid, "{kind:?} hello {b:?}: {got:?}");
        if let Ok(p) = got {
            assert_eq!(p.encode(kind), b, "not canonical");
        }
        tally.count(valid);
    }
}

// ---------------------------------------------------------------------------------------------
// The perf examples' run, setup and report

#[test]
fn perf_run_decoder() {
    let mut rng = Rng::new(0x5eed_0006);
    let mut tally = Tally::new("perf run");
    for i in 0..100_000 {
        let b = if i % 2 == 0 {
            let n = rng.len_near(16, 24);
            rng.bytes(n)
        } else {
            let (size, iters) = (rng.word(), rng.word());
            let b = proto::encode_run(size, iters);
            assert_eq!(proto::decode_run(&b), Ok((size, iters)));
            b
        };
        let got = no_panic("decode_run", &b, || proto::decode_run(&b));
        assert_eq!(got.is_ok(), b.len() == 16, "{b:?}");
        if let Ok((size, iters)) = got {
            assert_eq!(proto::encode_run(size, iters), b);
        }
        tally.count(got.is_ok());
    }
}

fn random_entry(rng: &mut Rng, need: Option<u64>) -> (Endpoint, RemoteSlice) {
    let mut gid = [0u8; 16];
    gid.iter_mut().for_each(|b| *b = rng.next() as u8);
    let ep = Endpoint {
        qpn: rng.next() as u32 & 0xff_ffff,
        psn: rng.next() as u32 & 0xff_ffff,
        lid: rng.next() as u16,
        gid: Gid(gid),
        mtu: Mtu(1 + rng.below(5) as u32),
    };
    let slice = match need {
        None => RemoteSlice { addr: 0, len: 0, rkey: 0 },
        Some(need) => {
            let len = need + rng.below(10_000) as u64;
            RemoteSlice { addr: rng.next() % (u64::MAX - len), len, rkey: rng.next() as u32 }
        }
    };
    (ep, slice)
}

/// The setup format, independently: per queue pair 'V', 1, MTU 1..=5, 0, LID, QPN and PSN below
/// 2^24, GID; then address, length (not wrapping) and rkey; all zero where the peer exposes no
/// buffer, at least `need` bytes long where it does.
fn setup_is_valid(b: &[u8], qps: usize, need: Option<u64>) -> bool {
    b.len() == qps * 50
        && b.chunks(50).all(|e| {
            let be32 = |r: &[u8]| u32::from_be_bytes(r.try_into().unwrap());
            let be64 = |r: &[u8]| u64::from_be_bytes(r.try_into().unwrap());
            let (addr, len, rkey) = (be64(&e[30..38]), be64(&e[38..46]), be32(&e[46..50]));
            e[0] == b'V'
                && e[1] == 1
                && (1..=5).contains(&e[2])
                && e[3] == 0
                && be32(&e[6..10]) < 1 << 24
                && be32(&e[10..14]) < 1 << 24
                && addr.checked_add(len).is_some()
                && match need {
                    None => addr == 0 && len == 0 && rkey == 0,
                    Some(n) => len >= n,
                }
        })
}

#[test]
fn perf_setup_decoder() {
    const N: usize = 200_000;
    let mut rng = Rng::new(0x5eed_0007);
    let mut tally = Tally::new("perf setup");
    for i in 0..N {
        let qps = 1 + rng.below(4);
        let need = if rng.chance(50) { Some(rng.below(1 << 20) as u64) } else { None };
        let b = match i % 3 {
            0 => {
                let n = rng.len_near(qps * 50, 220);
                rng.bytes(n)
            }
            1 => {
                let entries: Vec<_> = (0..qps).map(|_| random_entry(&mut rng, need)).collect();
                let b = proto::encode_setup(&entries);
                assert_eq!(proto::decode_setup(&b, qps, need), Ok(entries), "round trip");
                b
            }
            _ => {
                let entries: Vec<_> = (0..qps).map(|_| random_entry(&mut rng, need)).collect();
                let mut b = proto::encode_setup(&entries);
                if rng.chance(50) {
                    // A field set to a boundary value (QPN, PSN, length or address).
                    let at = 50 * rng.below(qps) + rng.pick(&[2, 3, 6, 10, 30, 38]);
                    let w = rng.word().to_be_bytes();
                    let n = w.len().min(b.len() - at);
                    b[at..at + n].copy_from_slice(&w[..n]);
                } else {
                    mutate(&mut rng, &mut b, &[0, 1, b'V', 0xff]);
                }
                b
            }
        };
        let got = no_panic("decode_setup", &b, || proto::decode_setup(&b, qps, need));
        let valid = setup_is_valid(&b, qps, need);
        assert_eq!(got.is_ok(), valid, "setup {b:?} for {qps} QPs, need {need:?}: {got:?}");
        if let Ok(entries) = got {
            assert_eq!(proto::encode_setup(&entries), b, "not canonical");
        }
        tally.count(valid);
    }
}

#[test]
fn perf_report_decoder() {
    let mut rng = Rng::new(0x5eed_0008);
    let mut tally = Tally::new("perf report");
    let floats = [0.0, -0.0, 1.5, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, f64::MIN_POSITIVE, 1e300];
    for i in 0..100_000 {
        let b = match i % 3 {
            0 => {
                let n = rng.len_near(40, 48);
                rng.bytes(n)
            }
            1 => {
                let (size, iters) = (rng.word(), rng.word());
                let mut f =
                    || if rng.chance(50) { rng.pick(&floats) } else { (rng.next() >> 11) as f64 / 1e6 };
                let r = BwReport { size, iters, peak: f(), avg: f(), msg_rate: f() };
                r.encode()
            }
            _ => {
                let r = BwReport { size: rng.word(), iters: rng.word(), peak: 1.0, avg: 2.0, msg_rate: 0.5 };
                let mut b = r.encode();
                mutate(&mut rng, &mut b, &[0, 0x7f, 0xff, 0x80]);
                b
            }
        };
        let got = no_panic("BwReport::decode", &b, || BwReport::decode(&b));
        let valid = b.len() == 40
            && b[16..].chunks(8).all(|c| {
                let x = f64::from_bits(u64::from_be_bytes(c.try_into().unwrap()));
                x.is_finite() && x >= 0.0
            });
        assert_eq!(got.is_ok(), valid, "report {b:?}: {got:?}");
        if let Ok(r) = got {
            assert_eq!(r.encode(), b, "not canonical");
        }
        tally.count(valid);
    }
}

/// The address text of the GIDs the tools print: as glibc's `inet_ntop(AF_INET6)`.
#[test]
fn ntop_matches_glibc() {
    let ip = |s: &str| s.parse::<std::net::Ipv6Addr>().unwrap().octets();
    for s in
        ["::", "::1", "::ffff:192.0.2.1", "fe80::a8cd:a2ff:fefe:a049", "1:0:2::", "::1.2.3.4", "1::2:0:0:3"]
    {
        assert_eq!(wire::ntop(&ip(s)), s);
    }
    assert_eq!(wire::ntop(&ip("1:0:2:3:4:5:6:7")), "1:0:2:3:4:5:6:7");
}

/// The pingpong address message of a known value, byte for byte (`"%04x:%06x:%06x:%s"`, NUL).
#[test]
fn pingpong_address_bytes() {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&[192, 0, 2, 1]);
    let d = Dest { lid: 0, qpn: 0x11, psn: 0xabcdef, gid: Gid(g) };
    let w = d.to_wire();
    assert_eq!(&w[..51], b"0000:000011:abcdef:00000000000000000000ffffc0000201");
    assert_eq!(w[51], 0);
    assert_eq!(Dest::from_wire(&w).unwrap(), d);
    assert!(Dest::from_wire(b"zz").is_err());
}

/// A perftest peer's first message (its version string, NUL-padded to 16 bytes) is named as
/// such, not as noise.
#[test]
fn a_perftest_peer_is_named() {
    for version in ["6.10", "5.70", "25.1"] {
        let mut msg = [0u8; 16];
        msg[..version.len()].copy_from_slice(version.as_bytes());
        let mut src: &[u8] = &msg;
        let e = proto::read_frame(&mut src, &[Tag::Hello], || {}).unwrap_err();
        let proto::FrameError::Protocol(text) = e else { panic!("{version}: not a protocol error") };
        assert!(text.contains("perftest"), "{version}: {text}");
    }
    for other in [&b"\x00\x00\x00\x00\x00"[..], b"6x10\0", b"123.4", b".5\0\0\0", b"GET /"] {
        assert!(!proto::looks_like_perftest(other), "{other:?}");
    }
}
