//! RDMA-CM multicast: ids of the `RDMA_PS_UDP` port space ([`EventChannel::create_udp_id`]),
//! which carry UD queue pairs, join and leave multicast groups by IP address
//! ([`CmId::join_multicast`], `rdma_join_multicast()`; [`CmId::leave_multicast`],
//! `rdma_leave_multicast()`). The outcome of a join is a
//! [`MULTICAST_JOIN`](crate::cm::CmEventKind::MULTICAST_JOIN) event whose
//! [`CmEvent::multicast`](crate::cm::CmEvent::multicast) is the group ([`McastJoin`]: GID, LID,
//! QP number and Q_Key to send with, its address handle), or `MULTICAST_ERROR`. librdmacm
//! attaches the id's queue pair to the group when the join's event is read (so create the
//! queue pair first: one created later is not attached, see
//! [`QueuePair::attach_mcast`](crate::QueuePair::attach_mcast)) and detaches it when the id
//! leaves (or is destroyed); on RoCE the kernel also joins the IP group (IGMP), which the device
//! needs to deliver the group's datagrams (rxe delivers nothing to an attached queue pair
//! otherwise).
//!
//! Senders address the group with [`McastJoin::create_ah`], the remote QP number
//! [`McastJoin::qp_num`] (`0xFFFFFF`) and the Q_Key [`McastJoin::qkey`] (in the UDP port space
//! `RDMA_UDP_QKEY`, `0x01234567`, which librdmacm also gives the id's queue pair); receivers get
//! each datagram behind a 40-byte GRH (on RoCE v2 with an IPv4 group, the IPv4 header in its
//! last 20 bytes).
//!
//! `rdma_leave_multicast()` waits until every event of the group that was read is
//! acknowledged; [`EventChannel::get_event`] reads and acknowledges under the channel's lock,
//! which [`CmId::leave_multicast`] holds too, so that wait is never reached.
//!
//! The crate remembers the groups an id joined and has not left. Dropping the id's queue pair
//! leaves them first: the kernel refuses to destroy a queue pair still attached to a group
//! (`EBUSY`), and the queue pair would leak. Dropping the id leaves those still joined:
//! librdmacm's `rdma_destroy_id` frees nothing of a group not left (measured with valgrind: 240
//! bytes per group, and the attached queue pair's 856 bytes plus its rings, before this).
//!
//! [`McastJoin`]: crate::cm::McastJoin

use std::net::{IpAddr, SocketAddr};

use ibverbs_sys as ffi;

use crate::cm::channel::EventChannel;
use crate::cm::id::{CmId, CmIdInner};
use crate::cm::sys::SockAddr;
use crate::error::{cvt, Result};

impl EventChannel {
    /// Creates an id for datagrams (port space `RDMA_PS_UDP`, `rdma_create_id()`): its queue
    /// pair is UD ([`QueuePairBuilder::build_on`](crate::QueuePairBuilder::build_on)), and it
    /// joins multicast groups ([`CmId::join_multicast`]).
    ///
    /// # Errors
    /// [`Error::Verb`](crate::Error::Verb) when the call fails.
    #[doc(alias = "rdma_create_id")]
    #[doc(alias = "RDMA_PS_UDP")]
    pub fn create_udp_id(&self) -> Result<CmId> {
        self.create_id_in(ffi::rdma_port_space::RDMA_PS_UDP)
    }
}

impl CmId {
    /// Whether the id is of the `RDMA_PS_UDP` port space ([`EventChannel::create_udp_id`]): its
    /// `ps` field.
    #[doc(alias = "RDMA_PS_UDP")]
    pub fn is_udp(&self) -> bool {
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; `ps` is written at creation only.
        unsafe { (*self.raw()).ps == ffi::rdma_port_space::RDMA_PS_UDP }
    }

    /// Joins the multicast group `group` (an IP multicast address) as a full member
    /// (`rdma_join_multicast()`), once the id is bound to a device: after
    /// [`resolve_addr`](Self::resolve_addr) to the group (from a local address, as `mckey -b`)
    /// or [`bind`](Self::bind) to a local address. The outcome is an event on the id's channel:
    /// [`MULTICAST_JOIN`](crate::cm::CmEventKind::MULTICAST_JOIN), whose
    /// [`CmEvent::multicast`](crate::cm::CmEvent::multicast) is the group's parameters (the id's
    /// queue pair, if it has one then, is attached to the group while the event is read), or
    /// `MULTICAST_ERROR` with the status. Datagrams sent before the join completes, here or at
    /// other members, are not delivered: post receives before joining.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an id that is not of the
    /// UDP port space, before the call; [`Error::Verb`](crate::Error::Verb) when the join cannot
    /// be started (e.g. `EINVAL` or `ENODEV` for an id not bound to a device).
    #[doc(alias = "rdma_join_multicast")]
    pub fn join_multicast(&self, group: IpAddr) -> Result<()> {
        self.check_udp("rdma_join_multicast")?;
        // Port 0, always: rdma_leave_multicast finds the group by comparing these bytes.
        let mut sa = SockAddr::new(SocketAddr::new(group, 0));
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; `sa` is a zero-padded socket address of its family's size, copied
        // by librdmacm during the call. The user context is NULL, so a MULTICAST_JOIN event's
        // `param.ud.private_data` (which `get_event` reads as `param.conn.private_data`) is NULL.
        let ret = unsafe { ffi::rdma_join_multicast(self.raw(), sa.as_mut_ptr(), std::ptr::null_mut()) };
        cvt("rdma_join_multicast", ret)?;
        lock_groups(&self.inner).push(group);
        Ok(())
    }

    /// Leaves the multicast group `group` (`rdma_leave_multicast()`), joined with
    /// [`join_multicast`](Self::join_multicast): the id's queue pair is detached from it, and an
    /// outcome of the join not read yet is discarded. Dropping the id's queue pair, or the id,
    /// leaves its groups too (see the module docs); after that this is `EADDRNOTAVAIL`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an id that is not of the
    /// UDP port space, before the call; [`Error::Verb`](crate::Error::Verb) (e.g.
    /// `EADDRNOTAVAIL` for a group the id did not join).
    #[doc(alias = "rdma_leave_multicast")]
    pub fn leave_multicast(&self, group: IpAddr) -> Result<()> {
        self.check_udp("rdma_leave_multicast")?;
        let mut sa = SockAddr::new(SocketAddr::new(group, 0));
        let _g = self.inner.channel.lock();
        // SAFETY: valid id; `sa` as in join_multicast. librdmacm detaches `id->qp`, which is NULL
        // or a live queue pair (our queue pair's destruction clears it under the lock we hold).
        // Its wait for the group's read events to be acknowledged returns at once: get_event
        // reads and acknowledges each event under this lock (see the module docs).
        let ret = unsafe { ffi::rdma_leave_multicast(self.raw(), sa.as_mut_ptr()) };
        // Whatever the result, librdmacm no longer has the group if it had it (it unlinks and
        // frees it even when the kernel's leave fails): forget one join of it.
        let mut groups = lock_groups(&self.inner);
        if let Some(i) = groups.iter().position(|g| *g == group) {
            groups.remove(i);
        }
        cvt("rdma_leave_multicast", ret)
    }

    fn check_udp(&self, verb: &'static str) -> Result<()> {
        if !self.is_udp() {
            return Err(crate::error::Error::InvalidArgument {
                verb,
                reason: "multicast is for ids of the RDMA_PS_UDP port space (EventChannel::create_udp_id)",
            });
        }
        Ok(())
    }
}

/// The id's list of joined groups; the data is a plain list, valid whatever a panicking holder
/// left.
fn lock_groups(inner: &CmIdInner) -> std::sync::MutexGuard<'_, Vec<IpAddr>> {
    inner.groups.lock().unwrap_or_else(|e| e.into_inner())
}

impl CmIdInner {
    /// Leaves every group the id joined and did not leave (`rdma_leave_multicast()`, errors
    /// ignored: librdmacm frees its record of the group whatever the kernel answers), which
    /// detaches the id's queue pair from them: before that queue pair or the id is destroyed.
    ///
    /// # Safety
    /// The caller holds the id's channel lock (librdmacm reads `id->qp` here).
    pub(crate) unsafe fn leave_all_groups(&self) {
        let groups = std::mem::take(&mut *lock_groups(self));
        for group in groups {
            let mut sa = SockAddr::new(SocketAddr::new(group, 0));
            // SAFETY: a live id (we are its owner); `sa` as in join_multicast; `id->qp` is NULL or
            // a live queue pair, and the channel lock is held (the caller's contract), so every
            // read event is acknowledged and the call does not wait.
            unsafe { ffi::rdma_leave_multicast(self.raw.as_ptr(), sa.as_mut_ptr()) };
        }
    }
}
