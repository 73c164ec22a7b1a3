//! The pingpong tools' address message (see the parent module's documentation), as data: no I/O
//! here, so that host tests can include this file and feed the decoder arbitrary bytes.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use ibverbs::{Endpoint, Gid, Mtu};

/// Whether the interface-ID half of a GID is zero: the C tools then address the peer by LID (and
/// `ibv_devinfo -v` does not list the entry).
pub fn interface_id_is_zero(gid: &Gid) -> bool {
    gid.0[8..].iter().all(|&b| b == 0)
}

/// A queue pair's address as the pingpong tools exchange it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// GID (all zero when the peer gave no `-g`).
    pub gid: Gid,
}

/// Length of an address message: `"0000:000000:000000:"`, 32 hex digits and a NUL.
pub const WIRE_LEN: usize = 52;
/// The message that ends the exchange, NUL included.
pub const DONE: &[u8; 5] = b"done\0";

impl Dest {
    /// This side's address, from its endpoint.
    pub fn from_endpoint(ep: &Endpoint) -> Dest {
        Dest { lid: ep.lid, qpn: ep.qpn, psn: ep.psn, gid: ep.gid }
    }

    /// The peer as an [`Endpoint`] to connect to or to make an address handle for. Like the C
    /// tools, a GID whose interface ID is zero means "no GID" (LID addressing on InfiniBand). The
    /// peer's MTU is not exchanged: the path MTU comes from the local port and `-m`.
    pub fn to_endpoint(self) -> Endpoint {
        let gid = if interface_id_is_zero(&self.gid) { Gid::default() } else { self.gid };
        Endpoint { qpn: self.qpn, psn: self.psn, lid: self.lid, gid, mtu: Mtu(0) }
    }

    /// The wire form: `"%04x:%06x:%06x:%s"` and a NUL, 52 bytes (QPN and PSN are 24-bit
    /// values: higher bits are not sent).
    pub fn to_wire(self) -> [u8; WIRE_LEN] {
        let mut text = format!("{:04x}:{:06x}:{:06x}:", self.lid, self.qpn & 0xff_ffff, self.psn & 0xff_ffff);
        for b in self.gid.0 {
            let _ = write!(text, "{b:02x}");
        }
        let mut msg = [0u8; WIRE_LEN];
        msg[..WIRE_LEN - 1].copy_from_slice(&text.as_bytes()[..WIRE_LEN - 1]);
        msg
    }

    /// Parses the wire form, byte by byte: exactly [`WIRE_LEN`] bytes, four, six and six hex
    /// digits and 32 for the GID, separated by colons, then a NUL (what the C tools send; they
    /// read it with `sscanf`, so upper-case digits are taken too).
    pub fn from_wire(msg: &[u8]) -> Result<Dest, String> {
        check_prefix(msg)?;
        if msg.len() != WIRE_LEN {
            return Err(format!(
                "an address message of {} bytes instead of {WIRE_LEN}: {}",
                msg.len(),
                show_bytes(msg)
            ));
        }
        // Every byte is now known to be what its position needs.
        let hex = |range: std::ops::Range<usize>| {
            msg[range].iter().fold(0u32, |acc, &c| (acc << 4) | u32::from(hex_value(c).unwrap_or(0)))
        };
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = hex(19 + 2 * i..21 + 2 * i) as u8;
        }
        Ok(Dest { lid: hex(0..4) as u16, qpn: hex(5..11), psn: hex(12..18), gid: Gid(gid) })
    }
}

/// What byte `i` of an address message must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Hex,
    Colon,
    Nul,
}

fn expect_at(i: usize) -> Expect {
    match i {
        4 | 11 | 18 => Expect::Colon,
        51 => Expect::Nul,
        _ => Expect::Hex,
    }
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Checks the first bytes of an address message as they arrive (so that a peer speaking another
/// protocol is refused at once, not after a timeout): each byte must be what its position needs,
/// and there may be at most [`WIRE_LEN`] of them.
pub fn check_prefix(msg: &[u8]) -> Result<(), String> {
    if msg.len() > WIRE_LEN {
        return Err(format!("an address message of more than {WIRE_LEN} bytes: {}", show_bytes(msg)));
    }
    for (i, &c) in msg.iter().enumerate() {
        let (ok, what) = match expect_at(i) {
            Expect::Hex => (hex_value(c).is_some(), "a hex digit"),
            Expect::Colon => (c == b':', "':'"),
            Expect::Nul => (c == 0, "the terminating NUL"),
        };
        if !ok {
            return Err(format!(
                "a malformed address message {} (byte {i} should be {what}); is the peer a pingpong tool?",
                show_bytes(msg)
            ));
        }
    }
    Ok(())
}

/// Checks the end-of-exchange message.
pub fn check_done(msg: &[u8]) -> Result<(), String> {
    if DONE.starts_with(msg) {
        Ok(())
    } else {
        Err(format!("the peer sent {} instead of \"done\"", show_bytes(msg)))
    }
}

/// Bytes as printable ASCII with escapes, e.g. `"0000:00\xe2\x82\xac"`.
pub fn show_bytes(b: &[u8]) -> String {
    let text: String = b.iter().flat_map(|&c| std::ascii::escape_default(c)).map(char::from).collect();
    format!("\"{text}\"")
}

/// Formats 16 bytes as glibc's `inet_ntop(AF_INET6)` does (the C tools print GIDs with it):
/// lowercase groups, the longest run of two or more zero groups as `::`, and a dotted IPv4 tail
/// for IPv4-mapped (`::ffff:a.b.c.d`) and IPv4-compatible (`::a.b.c.d`) addresses.
pub fn ntop(bytes: &[u8; 16]) -> String {
    let words: Vec<u16> = bytes.chunks(2).map(|p| u16::from_be_bytes([p[0], p[1]])).collect();
    // The longest run of zero words (the first of equal ones), if at least two long: (start, length).
    let mut best: Option<(usize, usize)> = None;
    let mut cur: Option<(usize, usize)> = None;
    for (i, &w) in words.iter().enumerate() {
        if w == 0 {
            let run = cur.map_or((i, 1), |(base, len)| (base, len + 1));
            cur = Some(run);
            if best.map_or(true, |(_, len)| run.1 > len) {
                best = Some(run);
            }
        } else {
            cur = None;
        }
    }
    let best = best.filter(|&(_, len)| len >= 2);
    let mut out = String::new();
    let mut i = 0;
    while i < 8 {
        if let Some((base, len)) = best {
            if i == base {
                out.push(':');
                i += len;
                if i == 8 {
                    out.push(':');
                }
                continue;
            }
        }
        if i > 0 {
            out.push(':');
        }
        let ipv4_tail =
            i == 6 && best.is_some_and(|(b, l)| b == 0 && (l == 6 || (l == 5 && words[5] == 0xffff)));
        if ipv4_tail {
            let _ = write!(out, "{}", Ipv4Addr::new(bytes[12], bytes[13], bytes[14], bytes[15]));
            break;
        }
        let _ = write!(out, "{:x}", words[i]);
        i += 1;
    }
    out
}
