//! UD multicast at the verbs level: a UD queue pair joins a group's traffic
//! ([`QueuePair::attach_mcast`], `ibv_attach_mcast()`) and leaves it
//! ([`QueuePair::detach_mcast`], `ibv_detach_mcast()`); an address handle for the group
//! ([`ProtectionDomain::create_mcast_ah`]) sends to every queue pair attached to it
//! ([`MCAST_QPN`] as the remote QP number).
//!
//! Attaching only tells the device to deliver the group's packets to the queue pair. Joining the
//! group in the fabric (the subnet manager on InfiniBand; IGMP and the NIC's multicast filter on
//! RoCE) is RDMA-CM's `rdma_join_multicast` or the application's job; a group's GID and LID come
//! from there. On RoCE v2 an IPv4 group's GID is the IPv4-mapped address (`::ffff:239.1.2.3`),
//! its LID 0 (not used), and the host must be a member of the IP group on the port's interface
//! (`IP_ADD_MEMBERSHIP` of any socket, or RDMA-CM's join): SoftRoCE delivers the group's
//! datagrams only then (measured on Linux 6.1: attached alone, nothing arrived).

use ibverbs_sys as ffi;

use crate::ah::AddressHandle;
use crate::attr::Gid;
use crate::connect::{ConnectOptions, Endpoint};
use crate::error::{cvt, Error, Result};
use crate::pd::ProtectionDomain;
use crate::queue::qp::{QpType, QueuePair};

/// The remote QP number of a send to a multicast group (`0xFFFFFF`: every queue pair attached).
pub const MCAST_QPN: u32 = 0x00ff_ffff;

/// Whether `gid` names a multicast group: an IB multicast GID (`ff00::/8`) or, on RoCE v2, an
/// IPv4-mapped multicast address (`::ffff:224.0.0.0/100`).
pub fn is_mcast_gid(gid: &Gid) -> bool {
    let g = &gid.0;
    g[0] == 0xff || (gid.is_ipv4_mapped() && (g[12] & 0xf0) == 0xe0)
}

fn check_group(gid: &Gid, verb: &'static str) -> Result<()> {
    if !is_mcast_gid(gid) {
        return Err(Error::InvalidArgument {
            verb,
            reason: "not a multicast GID (ff00::/8, or an IPv4-mapped 224.0.0.0/4 address on RoCE v2)",
        });
    }
    Ok(())
}

impl QueuePair {
    fn check_mcast(&self, gid: &Gid, verb: &'static str) -> Result<()> {
        if self.qp_type != QpType::UD {
            return Err(Error::InvalidArgument {
                verb,
                reason: "only UD queue pairs take multicast traffic",
            });
        }
        check_group(gid, verb)
    }

    /// Attaches this UD queue pair to the multicast group `gid` (with its `lid` on InfiniBand, 0
    /// on RoCE) (`ibv_attach_mcast()`): the device delivers the group's datagrams whose Q_Key
    /// matches this queue pair's to its receive queue (each starting with a 40-byte GRH).
    /// Attaching a group twice is one attachment.
    ///
    /// The queue pair's drop detaches it from every group still attached here: the kernel
    /// refuses to destroy a queue pair with attachments (`EBUSY`), which would leak it. A queue
    /// pair on an RDMA-CM id is also left from the id's groups (joined with
    /// `cm::CmId::join_multicast`) when it is dropped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a queue pair that is not UD or a GID that is not a
    /// multicast one ([`is_mcast_gid`]), before the verb; [`Error::Unsupported`] where the
    /// device has no multicast (`EOPNOTSUPP`/`ENOSYS`: iWARP); [`Error::Verb`] otherwise.
    #[doc(alias = "ibv_attach_mcast")]
    pub fn attach_mcast(&mut self, gid: &Gid, lid: u16) -> Result<()> {
        const VERB: &str = "ibv_attach_mcast";
        self.check_mcast(gid, VERB)?;
        let raw = gid.to_raw();
        // SAFETY: a valid QP and GID, read during the call.
        let ret = unsafe { ffi::ibv_attach_mcast(self.raw.as_ptr(), &raw, lid) };
        cvt(VERB, ret).map_err(|e| e.or_unsupported("multicast"))?;
        if !self.mcast.contains(&(*gid, lid)) {
            self.mcast.push((*gid, lid));
        }
        Ok(())
    }

    /// Detaches this UD queue pair from the multicast group `gid` (`ibv_detach_mcast()`).
    ///
    /// # Errors
    /// As [`attach_mcast`](Self::attach_mcast); [`Error::Verb`] (`EINVAL`, ...) for a group the
    /// queue pair is not attached to.
    #[doc(alias = "ibv_detach_mcast")]
    pub fn detach_mcast(&mut self, gid: &Gid, lid: u16) -> Result<()> {
        const VERB: &str = "ibv_detach_mcast";
        self.check_mcast(gid, VERB)?;
        let raw = gid.to_raw();
        // SAFETY: a valid QP and GID, read during the call.
        let ret = unsafe { ffi::ibv_detach_mcast(self.raw.as_ptr(), &raw, lid) };
        cvt(VERB, ret).map_err(|e| e.or_unsupported("multicast"))?;
        self.mcast.retain(|&m| m != (*gid, lid));
        Ok(())
    }
}

impl ProtectionDomain {
    /// An address handle for the multicast group `gid` (`ibv_create_ah()` with a GRH whose
    /// destination is the group, and `lid` the group's LID on InfiniBand, 0 on RoCE), with
    /// `opts`' port, GID index (the automatic RoCE v2 choice by default), service level, hop
    /// limit and traffic class. Send to the group with
    /// `SendRequest::send(..).ud(&ah, MCAST_QPN, qkey)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a GID that is not a multicast one or out-of-range `opts`;
    /// [`Error::Verb`] from `ibv_create_ah()` or the port and GID queries.
    #[doc(alias = "ibv_create_ah")]
    pub fn create_mcast_ah(&self, gid: &Gid, lid: u16, opts: &ConnectOptions) -> Result<AddressHandle> {
        check_group(gid, "ibv_create_ah")?;
        let group = Endpoint { qpn: MCAST_QPN, psn: 0, lid, gid: *gid, mtu: crate::attr::Mtu(0) };
        self.create_ah(&group, opts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multicast_gids_are_told_apart() {
        let v4 = |a: [u8; 4]| {
            let mut g = [0u8; 16];
            g[10] = 0xff;
            g[11] = 0xff;
            g[12..].copy_from_slice(&a);
            Gid(g)
        };
        assert!(is_mcast_gid(&v4([239, 255, 7, 7])));
        assert!(is_mcast_gid(&v4([224, 0, 0, 1])));
        assert!(!is_mcast_gid(&v4([192, 0, 2, 1])));
        let mut ib = [0u8; 16];
        ib[0] = 0xff;
        ib[1] = 0x12;
        assert!(is_mcast_gid(&Gid(ib)));
        assert!(!is_mcast_gid(&Gid([0; 16])));
        assert!(!is_mcast_gid(&Gid([0xfe; 16])));
    }
}
