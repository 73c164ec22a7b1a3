//! The TCP rendezvous's frames: encoding, and decoding that trusts nothing.
//!
//! Every frame is a 12-byte header — magic `IBVG`, version 1, kind, two zero bytes, payload length
//! (u32) — and its payload; integers are big-endian. A peer that sends anything else (another
//! program on the port, another job, garbage) is refused at the first frame.

use std::io::{self, Read, Write};
use std::time::Duration;

/// The header's first four bytes.
pub(crate) const MAGIC: [u8; 4] = *b"IBVG";
/// The protocol version.
pub(crate) const VERSION: u8 = 1;
/// Header length.
pub(crate) const HEADER: usize = 12;
/// Longest payload accepted (an allgather's result of every rank's bytes).
pub(crate) const MAX_PAYLOAD: usize = 64 << 20;
/// Longest host name carried.
const MAX_HOST: usize = 255;
/// Longest failure text carried.
const MAX_TEXT: usize = 1024;

/// A frame of the rendezvous protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    /// A rank introduces itself to rank 0.
    Hello { job: u64, size: u32, rank: u32, local_rank: u32, host: String },
    /// Rank 0: everyone arrived; the host of each rank, in rank order.
    Welcome { hosts: Vec<String> },
    /// A rank's contribution to allgather number `seq`.
    Gather { seq: u32, data: Vec<u8> },
    /// Rank 0: every rank's contribution to allgather `seq`, in rank order.
    Result { seq: u32, parts: Vec<Vec<u8>> },
    /// Rank 0: the group is over; `ranks` are at fault.
    Abort { problem: AbortKind, ranks: Vec<u32>, text: String },
    /// A rank tells rank 0 it failed (and leaves).
    Fail { text: String },
    /// A rank leaves the group normally (its handle was dropped).
    Leave,
}

/// The problem an [`Frame::Abort`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AbortKind {
    NeverArrived = 1,
    Lost = 2,
    Unresponsive = 3,
    Failed = 4,
    Mismatch = 5,
}

impl AbortKind {
    fn from_u8(b: u8) -> Option<AbortKind> {
        Some(match b {
            1 => AbortKind::NeverArrived,
            2 => AbortKind::Lost,
            3 => AbortKind::Unresponsive,
            4 => AbortKind::Failed,
            5 => AbortKind::Mismatch,
            _ => return None,
        })
    }
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => 1,
            Frame::Welcome { .. } => 2,
            Frame::Gather { .. } => 3,
            Frame::Result { .. } => 4,
            Frame::Abort { .. } => 5,
            Frame::Fail { .. } => 6,
            Frame::Leave => 7,
        }
    }

    /// The frame's bytes, header included.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut p = Vec::new();
        match self {
            Frame::Hello { job, size, rank, local_rank, host } => {
                p.extend_from_slice(&job.to_be_bytes());
                p.extend_from_slice(&size.to_be_bytes());
                p.extend_from_slice(&rank.to_be_bytes());
                p.extend_from_slice(&local_rank.to_be_bytes());
                put_str(&mut p, host, MAX_HOST);
            }
            Frame::Welcome { hosts } => {
                p.extend_from_slice(&(hosts.len() as u32).to_be_bytes());
                for h in hosts {
                    put_str(&mut p, h, MAX_HOST);
                }
            }
            Frame::Gather { seq, data } => {
                p.extend_from_slice(&seq.to_be_bytes());
                p.extend_from_slice(data);
            }
            Frame::Result { seq, parts } => {
                p.extend_from_slice(&seq.to_be_bytes());
                p.extend_from_slice(&(parts.len() as u32).to_be_bytes());
                for part in parts {
                    p.extend_from_slice(&(part.len() as u32).to_be_bytes());
                    p.extend_from_slice(part);
                }
            }
            Frame::Abort { problem, ranks, text } => {
                p.push(*problem as u8);
                p.extend_from_slice(&(ranks.len() as u32).to_be_bytes());
                for r in ranks {
                    p.extend_from_slice(&r.to_be_bytes());
                }
                put_str(&mut p, text, MAX_TEXT);
            }
            Frame::Fail { text } => put_str(&mut p, text, MAX_TEXT),
            Frame::Leave => {}
        }
        let mut out = Vec::with_capacity(HEADER + p.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind());
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&(p.len() as u32).to_be_bytes());
        out.extend_from_slice(&p);
        out
    }

    /// Checks a header: the payload length it announces.
    pub(crate) fn check_header(h: &[u8; HEADER]) -> Result<(u8, usize), String> {
        if h[..4] != MAGIC {
            return Err("not the group bootstrap protocol (bad magic)".into());
        }
        if h[4] != VERSION {
            return Err(format!("bootstrap protocol version {} (this rank speaks {VERSION})", h[4]));
        }
        if h[6] != 0 || h[7] != 0 {
            return Err("reserved header bytes are not zero".into());
        }
        let len = u32::from_be_bytes([h[8], h[9], h[10], h[11]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(format!("a frame of {len} bytes (at most {MAX_PAYLOAD})"));
        }
        if !(1..=7).contains(&h[5]) {
            return Err(format!("unknown frame kind {}", h[5]));
        }
        Ok((h[5], len))
    }

    /// Decodes a payload of `kind`.
    pub(crate) fn decode(kind: u8, p: &[u8]) -> Result<Frame, String> {
        let mut r = Reader { p, at: 0 };
        let f = match kind {
            1 => Frame::Hello {
                job: r.u64()?,
                size: r.u32()?,
                rank: r.u32()?,
                local_rank: r.u32()?,
                host: r.str(MAX_HOST)?,
            },
            2 => {
                let n = r.count(3)?;
                let mut hosts = Vec::with_capacity(n);
                for _ in 0..n {
                    hosts.push(r.str(MAX_HOST)?);
                }
                Frame::Welcome { hosts }
            }
            3 => {
                let seq = r.u32()?;
                Frame::Gather { seq, data: r.rest().to_vec() }
            }
            4 => {
                let seq = r.u32()?;
                let n = r.count(4)?;
                let mut parts = Vec::with_capacity(n);
                for _ in 0..n {
                    let len = r.u32()? as usize;
                    parts.push(r.bytes(len)?.to_vec());
                }
                Frame::Result { seq, parts }
            }
            5 => {
                let problem = AbortKind::from_u8(r.u8()?).ok_or("unknown abort kind")?;
                let n = r.count(4)?;
                let mut ranks = Vec::with_capacity(n);
                for _ in 0..n {
                    ranks.push(r.u32()?);
                }
                Frame::Abort { problem, ranks, text: r.str(MAX_TEXT)? }
            }
            6 => Frame::Fail { text: r.str(MAX_TEXT)? },
            7 => Frame::Leave,
            k => return Err(format!("unknown frame kind {k}")),
        };
        if r.at != p.len() {
            return Err("trailing bytes after a frame".into());
        }
        Ok(f)
    }
}

/// A length-prefixed (u16) UTF-8 string, cut at `max` bytes (on a character boundary).
fn put_str(p: &mut Vec<u8>, s: &str, max: usize) {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    p.extend_from_slice(&(end as u16).to_be_bytes());
    p.extend_from_slice(&s.as_bytes()[..end]);
}

struct Reader<'a> {
    p: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.p.len()).ok_or("a frame cut short")?;
        let b = &self.p[self.at..end];
        self.at = end;
        Ok(b)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.bytes(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.bytes(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let b = self.bytes(8)?;
        let mut a = [0; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
    /// A count of items of at least `min_each` bytes each: refused when the rest cannot hold them
    /// (no allocation sized by a hostile count).
    fn count(&mut self, min_each: usize) -> Result<usize, String> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_each) > self.p.len() - self.at {
            return Err("a count larger than the frame".into());
        }
        Ok(n)
    }
    fn str(&mut self, max: usize) -> Result<String, String> {
        let b = self.bytes(2)?;
        let n = usize::from(u16::from_be_bytes([b[0], b[1]]));
        if n > max {
            return Err("a string longer than allowed".into());
        }
        String::from_utf8(self.bytes(n)?.to_vec()).map_err(|_| "a string that is not UTF-8".into())
    }
    fn rest(&mut self) -> &'a [u8] {
        let b = &self.p[self.at..];
        self.at = self.p.len();
        b
    }
}

/// What reading a frame can end in, besides a frame.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The connection closed (at a frame boundary or inside one).
    Closed,
    /// The deadline passed.
    TimedOut,
    /// Not the protocol.
    Garbage(String),
    /// Another socket error (treated as a closed connection).
    Io,
}

/// Reads one frame from `s`, waiting at most `limit` in total.
pub(crate) fn read_frame(s: &mut std::net::TcpStream, limit: Duration) -> Result<Frame, ReadError> {
    let deadline = std::time::Instant::now() + limit;
    let mut h = [0u8; HEADER];
    read_full(s, &mut h, deadline)?;
    let (kind, len) = Frame::check_header(&h).map_err(ReadError::Garbage)?;
    let mut p = vec![0u8; len];
    read_full(s, &mut p, deadline)?;
    Frame::decode(kind, &p).map_err(ReadError::Garbage)
}

fn read_full(
    s: &mut std::net::TcpStream,
    mut buf: &mut [u8],
    deadline: std::time::Instant,
) -> Result<(), ReadError> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(ReadError::TimedOut);
        }
        s.set_read_timeout(Some(left)).map_err(|_| ReadError::Io)?;
        match s.read(buf) {
            Ok(0) => return Err(ReadError::Closed),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(ReadError::TimedOut)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted) =>
            {
                return Err(ReadError::Closed)
            }
            Err(_) => return Err(ReadError::Io),
        }
    }
    Ok(())
}

/// Writes a frame, waiting at most `limit`.
pub(crate) fn write_frame(s: &mut std::net::TcpStream, f: &Frame, limit: Duration) -> io::Result<()> {
    s.set_write_timeout(Some(limit.max(Duration::from_millis(1))))?;
    s.write_all(&f.encode())
}

/// FNV-1a of a job's identity: ranks of different jobs on one rendezvous port refuse each other.
pub(crate) fn job_key(id: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(f: Frame) {
        let bytes = f.encode();
        let h: [u8; HEADER] = bytes[..HEADER].try_into().unwrap();
        let (kind, len) = Frame::check_header(&h).unwrap();
        assert_eq!(len, bytes.len() - HEADER);
        assert_eq!(Frame::decode(kind, &bytes[HEADER..]).unwrap(), f);
    }

    #[test]
    fn frames_round_trip() {
        roundtrip(Frame::Hello { job: 7, size: 4, rank: 3, local_rank: 1, host: "node-b".into() });
        roundtrip(Frame::Welcome { hosts: vec!["a".into(), "".into(), "ü".into()] });
        roundtrip(Frame::Gather { seq: 9, data: vec![1, 2, 3] });
        roundtrip(Frame::Gather { seq: 0, data: vec![] });
        roundtrip(Frame::Result { seq: 2, parts: vec![vec![], vec![5; 40], vec![1]] });
        roundtrip(Frame::Abort { problem: AbortKind::Lost, ranks: vec![2, 3], text: "x".into() });
        roundtrip(Frame::Fail { text: "could not connect".into() });
        roundtrip(Frame::Leave);
    }

    #[test]
    fn garbage_is_refused_without_allocating_for_it() {
        let mut h = *b"GET / HTTP/1";
        assert!(Frame::check_header(&h).is_err());
        h = [b'I', b'B', b'V', b'G', 2, 1, 0, 0, 0, 0, 0, 0];
        assert!(Frame::check_header(&h).unwrap_err().contains("version 2"));
        h = [b'I', b'B', b'V', b'G', 1, 8, 0, 0, 0, 0, 0, 0];
        assert!(Frame::check_header(&h).is_err());
        h = [b'I', b'B', b'V', b'G', 1, 3, 0, 0, 0xff, 0xff, 0xff, 0xff];
        assert!(Frame::check_header(&h).unwrap_err().contains("bytes"));
        // A result announcing 2^32-1 parts in a 12-byte payload.
        let mut p = vec![0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff];
        p.extend_from_slice(&[0; 4]);
        assert!(Frame::decode(4, &p).unwrap_err().contains("count"));
        // A hello cut short, and one with trailing bytes.
        let hello = Frame::Hello { job: 1, size: 2, rank: 1, local_rank: 0, host: "h".into() }.encode();
        assert!(Frame::decode(1, &hello[HEADER..hello.len() - 1]).is_err());
        let mut long = hello[HEADER..].to_vec();
        long.push(0);
        assert!(Frame::decode(1, &long).unwrap_err().contains("trailing"));
        // A string that is not UTF-8.
        assert!(Frame::decode(6, &[0, 2, 0xff, 0xfe]).unwrap_err().contains("UTF-8"));
    }

    #[test]
    fn long_strings_are_cut_on_a_character_boundary() {
        let host = "é".repeat(200); // 400 bytes
        let f = Frame::Hello { job: 0, size: 1, rank: 0, local_rank: 0, host };
        let bytes = f.encode();
        let Frame::Hello { host, .. } = Frame::decode(1, &bytes[HEADER..]).unwrap() else { panic!() };
        assert_eq!(host.len(), 254);
    }

    #[test]
    fn job_keys_differ() {
        assert_ne!(job_key("slurm-17.0"), job_key("slurm-17.1"));
        assert_eq!(job_key(""), 0xcbf2_9ce4_8422_2325);
    }
}
