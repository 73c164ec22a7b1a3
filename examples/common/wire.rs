//! The pingpong tools' address message (see the parent module's documentation), as data: no I/O
//! here, so that host tests can include this file and feed the decoder arbitrary bytes.

use std::fmt::Write as _;

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

    /// The wire form: `"%04x:%06x:%06x:%s"` and a NUL, 52 bytes.
    pub fn to_wire(self) -> [u8; WIRE_LEN] {
        let mut text = format!("{:04x}:{:06x}:{:06x}:", self.lid, self.qpn, self.psn);
        for b in self.gid.0 {
            let _ = write!(text, "{b:02x}");
        }
        let mut msg = [0u8; WIRE_LEN];
        let n = text.len().min(WIRE_LEN - 1);
        msg[..n].copy_from_slice(&text.as_bytes()[..n]);
        msg
    }

    /// Parses the wire form, checking every field.
    pub fn from_wire(msg: &[u8]) -> Result<Dest, String> {
        let text = msg.split(|&b| b == 0).next().unwrap_or_default();
        let text = std::str::from_utf8(text).map_err(|_| "address message is not text".to_string())?;
        let bad = || format!("malformed address message {text:?}");
        let fields: Vec<&str> = text.split(':').collect();
        let [lid, qpn, psn, gid] = fields[..] else { return Err(bad()) };
        let hex = |s: &str| u32::from_str_radix(s, 16).map_err(|_| bad());
        let (lid, qpn, psn) = (hex(lid)?, hex(qpn)?, hex(psn)?);
        if lid > 0xffff || qpn > 0xff_ffff || psn > 0xff_ffff || gid.len() != 32 {
            return Err(bad());
        }
        let mut raw = [0u8; 16];
        for (i, b) in raw.iter_mut().enumerate() {
            *b = u8::from_str_radix(&gid[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Dest { lid: lid as u16, qpn, psn, gid: Gid(raw) })
    }
}
