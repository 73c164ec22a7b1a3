//! What devices, ports, GIDs and queue pairs report, as plain values: a device's and a port's
//! attributes ([`DeviceAttr`], [`DeviceAttrEx`], [`OdpCaps`], [`PortAttr`]), the verbs' enums
//! ([`NodeType`], [`TransportType`], [`Mtu`], [`PortState`], [`LinkLayer`], [`GidType`],
//! [`QpState`], [`CmEventKind`]), GIDs and GUIDs, a RoCE version and the network device under
//! a port.
//!
//! Plain data over the C library's values, calling no verb that can fail: the error type and
//! every module above it can name them.

use std::ffi::CStr;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ibverbs_sys as ffi;

/// The kind of node a device is (`enum ibv_node_type`): sound for any value a library reports.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct NodeType(pub i32);

impl NodeType {
    /// An InfiniBand channel adapter (also RoCE HCAs and SoftRoCE).
    pub const CA: NodeType = NodeType(ffi::ibv_node_type::IBV_NODE_CA.0);
    /// An InfiniBand switch.
    pub const SWITCH: NodeType = NodeType(ffi::ibv_node_type::IBV_NODE_SWITCH.0);
    /// An InfiniBand router.
    pub const ROUTER: NodeType = NodeType(ffi::ibv_node_type::IBV_NODE_ROUTER.0);
    /// An iWARP RNIC.
    pub const RNIC: NodeType = NodeType(ffi::ibv_node_type::IBV_NODE_RNIC.0);

    /// The C library's name for it (`ibv_node_type_str()`), e.g. `"InfiniBand channel adapter"`.
    #[doc(alias = "ibv_node_type_str")]
    pub fn as_str(self) -> &'static str {
        // Needs no object: without libibverbs (feature `dlopen`), the same names from here.
        if ffi::load().is_err() {
            return node_type_name(self.0);
        }
        // SAFETY: ibv_node_type_str returns a static string for any value ("unknown" otherwise).
        unsafe { static_str(ffi::ibv_node_type_str(ffi::ibv_node_type(self.0))) }
    }
}

impl fmt::Debug for NodeType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeType({}: {})", self.0, self.as_str())
    }
}

/// The transport a device speaks (`enum ibv_transport_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct TransportType(pub i32);

impl TransportType {
    /// InfiniBand transport (also RoCE and SoftRoCE).
    pub const IB: TransportType = TransportType(ffi::ibv_transport_type::IBV_TRANSPORT_IB.0);
    /// iWARP.
    pub const IWARP: TransportType = TransportType(ffi::ibv_transport_type::IBV_TRANSPORT_IWARP.0);

    /// The name `ibv_devinfo` prints: `"InfiniBand"`, `"iWARP"`, or `"unknown"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportType::IB => "InfiniBand",
            TransportType::IWARP => "iWARP",
            _ => "unknown",
        }
    }
}

/// Reads a static C string (or `""` for `NULL`).
///
/// # Safety
/// `p` is `NULL` or points to a NUL-terminated string that lives for the rest of the program.
unsafe fn static_str(p: *const libc::c_char) -> &'static str {
    if p.is_null() {
        return "";
    }
    // SAFETY: per this function's contract.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
}

/// `ibv_node_type_str()`'s names (rdma-core's `libibverbs/enum_strs.c`), for a process where
/// libibverbs cannot be loaded (feature `dlopen`).
fn node_type_name(value: i32) -> &'static str {
    match value {
        1 => "InfiniBand channel adapter",
        2 => "InfiniBand switch",
        3 => "InfiniBand router",
        4 => "iWARP NIC",
        5 => "usNIC",
        6 => "usNIC UDP",
        7 => "unspecified",
        _ => "unknown",
    }
}

/// `ibv_port_state_str()`'s names, as [`node_type_name`].
fn port_state_name(value: u32) -> &'static str {
    match value {
        0 => "no state change (NOP)",
        1 => "down",
        2 => "init",
        3 => "armed",
        4 => "active",
        5 => "active defer",
        _ => "unknown",
    }
}

/// A 64-bit GUID (node, system image or port GUID), in host byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Guid(pub u64);

impl Guid {
    /// From the network-order (`__be64`) value the C structs hold.
    pub fn from_be(raw: u64) -> Guid {
        Guid(u64::from_be(raw))
    }
}

impl fmt::Display for Guid {
    /// Formats as `ibv_devinfo` does: `0011:2233:4455:6677`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.0;
        write!(f, "{:04x}:{:04x}:{:04x}:{:04x}", v >> 48, (v >> 32) & 0xffff, (v >> 16) & 0xffff, v & 0xffff)
    }
}

impl fmt::Debug for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Guid({self})")
    }
}

/// Device attributes (`struct ibv_device_attr`), from
/// [`Context::query_device`](crate::Context::query_device).
#[derive(Clone, Copy)]
pub struct DeviceAttr(pub ffi::ibv_device_attr);

macro_rules! int_getters {
    ($( $(#[$m:meta])* $name:ident : $ty:ty ),* $(,)?) => {
        $( $(#[$m])* pub fn $name(&self) -> $ty { <$ty>::try_from(self.0.$name).unwrap_or_default() } )*
    };
}

impl DeviceAttr {
    /// Firmware version string.
    pub fn fw_ver(&self) -> String {
        let bytes: Vec<u8> = self.0.fw_ver.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    /// Node GUID.
    pub fn node_guid(&self) -> Guid {
        Guid::from_be(self.0.node_guid)
    }
    /// System image GUID.
    pub fn sys_image_guid(&self) -> Guid {
        Guid::from_be(self.0.sys_image_guid)
    }
    int_getters! {
        /// Largest registrable memory region, in bytes.
        max_mr_size: u64,
        /// IEEE vendor ID.
        vendor_id: u32,
        /// Vendor part ID.
        vendor_part_id: u32,
        /// Hardware version.
        hw_ver: u32,
        /// Maximum number of queue pairs.
        max_qp: u32,
        /// Maximum work requests per queue.
        max_qp_wr: u32,
        /// Maximum scatter/gather entries per work request.
        max_sge: u32,
        /// Maximum number of completion queues.
        max_cq: u32,
        /// Maximum completions per completion queue.
        max_cqe: u32,
        /// Maximum number of memory regions.
        max_mr: u32,
        /// Maximum number of protection domains.
        max_pd: u32,
        /// Maximum outstanding RDMA Read/atomic operations a QP can be the target of.
        max_qp_rd_atom: u32,
        /// Maximum outstanding RDMA Read/atomic operations a QP can initiate.
        max_qp_init_rd_atom: u32,
        /// Maximum number of address handles.
        max_ah: u32,
        /// Number of physical ports.
        phys_port_cnt: u8,
        /// Page sizes the device supports for registrations, a bit per power of two
        /// (`page_size_cap`).
        page_size_cap: u64,
        /// Maximum scatter/gather entries of an RDMA Read's local side (`max_sge_rd`).
        max_sge_rd: u32,
        /// Maximum outstanding RDMA Read/atomic operations per end-to-end context (`max_ee_rd_atom`;
        /// RD, 0 on current devices).
        max_ee_rd_atom: u32,
        /// Maximum RDMA Read/atomic operations the device can be the target of in all
        /// (`max_res_rd_atom`).
        max_res_rd_atom: u32,
        /// Maximum outstanding RDMA Read/atomic operations an end-to-end context can initiate
        /// (`max_ee_init_rd_atom`; RD).
        max_ee_init_rd_atom: u32,
        /// Maximum number of end-to-end contexts (`max_ee`; RD).
        max_ee: u32,
        /// Maximum number of reliable datagram domains (`max_rdd`; RD).
        max_rdd: u32,
        /// Maximum number of memory windows (`max_mw`); 0 when the device has none.
        max_mw: u32,
        /// Maximum number of raw IPv6 datagram queue pairs (`max_raw_ipv6_qp`).
        max_raw_ipv6_qp: u32,
        /// Maximum number of raw Ethertype datagram queue pairs (`max_raw_ethy_qp`).
        max_raw_ethy_qp: u32,
        /// Maximum number of multicast groups (`max_mcast_grp`).
        max_mcast_grp: u32,
        /// Maximum queue pairs attached to one multicast group (`max_mcast_qp_attach`).
        max_mcast_qp_attach: u32,
        /// Maximum multicast attachments in all (`max_total_mcast_qp_attach`).
        max_total_mcast_qp_attach: u32,
        /// Maximum number of fast memory regions (`max_fmr`; obsolete, 0 on current devices).
        max_fmr: u32,
        /// Maximum remaps per fast memory region (`max_map_per_fmr`; obsolete).
        max_map_per_fmr: u32,
        /// Maximum number of shared receive queues (`max_srq`); 0 when the device has none.
        max_srq: u32,
        /// Maximum work requests per shared receive queue (`max_srq_wr`).
        max_srq_wr: u32,
        /// Maximum scatter/gather entries per shared receive queue request (`max_srq_sge`).
        max_srq_sge: u32,
        /// Number of P_Key table entries per port (`max_pkeys`).
        max_pkeys: u16,
        /// The local CA ACK delay (`local_ca_ack_delay`): 4.096 µs × 2^value.
        local_ca_ack_delay: u8,
    }
    /// Atomic operation support (`IBV_ATOMIC_NONE/HCA/GLOB`).
    pub fn atomic_cap(&self) -> ffi::ibv_atomic_cap {
        self.0.atomic_cap
    }
    /// The capability flags (`device_cap_flags`, bits of `enum ibv_device_cap_flags`, e.g.
    /// `IBV_DEVICE_MEM_WINDOW_TYPE_2B`), as the device reports them.
    pub fn device_cap_flags(&self) -> u32 {
        self.0.device_cap_flags
    }
    /// Whether [`device_cap_flags`](Self::device_cap_flags) has `flag`.
    pub fn has_cap(&self, flag: ffi::ibv_device_cap_flags) -> bool {
        self.0.device_cap_flags & flag.0 != 0
    }
}

impl fmt::Debug for DeviceAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceAttr")
            .field("fw_ver", &self.fw_ver())
            .field("node_guid", &self.node_guid())
            .field("max_qp", &self.max_qp())
            .field("max_qp_wr", &self.max_qp_wr())
            .field("max_sge", &self.max_sge())
            .field("max_cqe", &self.max_cqe())
            .field("max_mr_size", &self.max_mr_size())
            .field("atomic_cap", &self.atomic_cap())
            .field("phys_port_cnt", &self.phys_port_cnt())
            .finish_non_exhaustive()
    }
}

/// Extended device attributes (`struct ibv_device_attr_ex`), from
/// [`Context::query_device_ex`](crate::Context::query_device_ex).
#[derive(Clone, Copy)]
pub struct DeviceAttrEx(pub ffi::ibv_device_attr_ex);

impl DeviceAttrEx {
    /// The classic attributes.
    pub fn orig(&self) -> DeviceAttr {
        DeviceAttr(self.0.orig_attr)
    }

    /// On-demand paging capabilities (`odp_caps`): what
    /// [`AccessFlags::ON_DEMAND`](crate::AccessFlags::ON_DEMAND) regions may do on this device.
    pub fn odp(&self) -> OdpCaps {
        let c = &self.0.odp_caps;
        OdpCaps {
            general: c.general_caps,
            rc: c.per_transport_caps.rc_odp_caps,
            uc: c.per_transport_caps.uc_odp_caps,
            ud: c.per_transport_caps.ud_odp_caps,
            xrc: self.0.xrc_odp_caps,
        }
    }

    /// Bytes of on-device memory one [`DeviceMemory`](crate::DeviceMemory) may have
    /// (`max_dm_size`); 0 when the device has none.
    pub fn max_dm_size(&self) -> u64 {
        self.0.max_dm_size
    }

    /// The extended capability flags (`device_cap_flags_ex`, `enum ibv_device_cap_flags` and
    /// more), as the device reports them.
    pub fn device_cap_flags_ex(&self) -> u64 {
        self.0.device_cap_flags_ex
    }

    /// The extended attributes' `comp_mask`, as the library and provider set it.
    pub fn comp_mask(&self) -> u32 {
        self.0.comp_mask
    }

    /// The bits of a completion timestamp that count (`completion_timestamp_mask`); 0 when the
    /// device has no completion timestamps (rxe, siw).
    pub fn completion_timestamp_mask(&self) -> u64 {
        self.0.completion_timestamp_mask
    }

    /// The frequency of the device's clock, in kHz (`hca_core_clock`); 0 when not reported.
    pub fn hca_core_clock(&self) -> u64 {
        self.0.hca_core_clock
    }

    /// TCP segmentation offload (`tso_caps`): the largest segment and the queue pair types
    /// (bits `1 << IBV_QPT_*`) it works on.
    pub fn tso_caps(&self) -> ffi::ibv_tso_caps {
        self.0.tso_caps
    }

    /// Receive-side scaling (`rss_caps`): indirection tables, hash fields and functions.
    pub fn rss_caps(&self) -> ffi::ibv_rss_caps {
        self.0.rss_caps
    }

    /// Maximum number of receive work queues (`max_wq_type_rq`).
    pub fn max_wq_type_rq(&self) -> u32 {
        self.0.max_wq_type_rq
    }

    /// Packet pacing (`packet_pacing_caps`): rate limits in kbps and the queue pair types.
    pub fn packet_pacing_caps(&self) -> ffi::ibv_packet_pacing_caps {
        self.0.packet_pacing_caps
    }

    /// Raw packet capabilities (`raw_packet_caps`, bits of `enum ibv_raw_packet_caps`).
    pub fn raw_packet_caps(&self) -> u32 {
        self.0.raw_packet_caps
    }

    /// Tag matching (`tm_caps`): tags, outstanding operations, rendezvous header size.
    pub fn tm_caps(&self) -> ffi::ibv_tm_caps {
        self.0.tm_caps
    }

    /// Completion moderation (`cq_mod_caps`): the largest count and period.
    pub fn cq_mod_caps(&self) -> ffi::ibv_cq_moderation_caps {
        self.0.cq_mod_caps
    }

    /// PCIe atomic operations (`pci_atomic_caps`): the operand sizes of fetch-and-add, swap and
    /// compare-and-swap.
    pub fn pci_atomic_caps(&self) -> ffi::ibv_pci_atomic_caps {
        self.0.pci_atomic_caps
    }

    /// ODP capabilities of XRC (`xrc_odp_caps`); also in [`odp`](Self::odp).
    pub fn xrc_odp_caps(&self) -> u32 {
        self.0.xrc_odp_caps
    }

    /// Number of physical ports (`phys_port_cnt_ex`, which counts beyond 255): the classic
    /// `phys_port_cnt` where the library or the provider leaves it 0 (rdma-core before v35).
    pub fn phys_port_cnt_ex(&self) -> u32 {
        #[cfg(ibverbs_has_phys_port_cnt_ex)]
        if self.0.phys_port_cnt_ex != 0 {
            return self.0.phys_port_cnt_ex;
        }
        u32::from(self.0.orig_attr.phys_port_cnt)
    }
}

/// On-demand paging capabilities of a device (`struct ibv_odp_caps`, plus `xrc_odp_caps`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OdpCaps {
    /// `enum ibv_odp_general_caps` bits: `IBV_ODP_SUPPORT`, `IBV_ODP_SUPPORT_IMPLICIT`.
    pub general: u64,
    /// `enum ibv_odp_transport_cap_bits` for RC queue pairs (send, receive, write, read, ...).
    pub rc: u32,
    /// The same for UC.
    pub uc: u32,
    /// The same for UD.
    pub ud: u32,
    /// The same for XRC.
    pub xrc: u32,
}

impl OdpCaps {
    /// Whether the device supports on-demand paging at all (`IBV_ODP_SUPPORT`).
    pub fn supported(&self) -> bool {
        self.general & u64::from(ffi::ibv_odp_general_caps::IBV_ODP_SUPPORT.0) != 0
    }

    /// Whether it supports implicit ODP, one region over the whole address space
    /// (`IBV_ODP_SUPPORT_IMPLICIT`).
    pub fn implicit(&self) -> bool {
        self.general & u64::from(ffi::ibv_odp_general_caps::IBV_ODP_SUPPORT_IMPLICIT.0) != 0
    }
}

impl fmt::Debug for DeviceAttrEx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceAttrEx").field("orig", &self.orig()).finish_non_exhaustive()
    }
}

/// A path MTU (`enum ibv_mtu`): sound for any value a device reports.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct Mtu(pub u32);

impl Mtu {
    /// 256 bytes.
    pub const MTU_256: Mtu = Mtu(1);
    /// 512 bytes.
    pub const MTU_512: Mtu = Mtu(2);
    /// 1024 bytes.
    pub const MTU_1024: Mtu = Mtu(3);
    /// 2048 bytes.
    pub const MTU_2048: Mtu = Mtu(4);
    /// 4096 bytes.
    pub const MTU_4096: Mtu = Mtu(5);

    /// The MTU in bytes, or `None` for a value outside the enum.
    pub fn bytes(self) -> Option<u32> {
        (1..=5).contains(&self.0).then(|| 128 << self.0)
    }

    /// The MTU for a byte count (256, 512, 1024, 2048 or 4096).
    pub fn from_bytes(bytes: u32) -> Option<Mtu> {
        match bytes {
            256 => Some(Mtu::MTU_256),
            512 => Some(Mtu::MTU_512),
            1024 => Some(Mtu::MTU_1024),
            2048 => Some(Mtu::MTU_2048),
            4096 => Some(Mtu::MTU_4096),
            _ => None,
        }
    }
}

impl fmt::Debug for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.bytes() {
            Some(b) => write!(f, "Mtu({b})"),
            None => write!(f, "Mtu(invalid {})", self.0),
        }
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.bytes() {
            Some(b) => write!(f, "{b}"),
            None => write!(f, "invalid MTU enum ({})", self.0),
        }
    }
}

/// The logical state of a port (`enum ibv_port_state`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct PortState(pub u32);

impl PortState {
    /// Down.
    pub const DOWN: PortState = PortState(1);
    /// Initializing.
    pub const INIT: PortState = PortState(2);
    /// Armed.
    pub const ARMED: PortState = PortState(3);
    /// Active: ready to move data.
    pub const ACTIVE: PortState = PortState(4);

    /// The C library's name for it (`ibv_port_state_str()`), e.g. `"active"`.
    #[doc(alias = "ibv_port_state_str")]
    pub fn as_str(self) -> &'static str {
        // As NodeType::as_str.
        if ffi::load().is_err() {
            return port_state_name(self.0);
        }
        // SAFETY: returns a static string for any value.
        unsafe { static_str(ffi::ibv_port_state_str(ffi::ibv_port_state(self.0))) }
    }
}

impl fmt::Debug for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PortState({})", self.as_str())
    }
}

/// The link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct LinkLayer(pub u8);

impl LinkLayer {
    /// Unspecified (treated as InfiniBand by the C tools).
    pub const UNSPECIFIED: LinkLayer = LinkLayer(0);
    /// InfiniBand: addressing by LID.
    pub const INFINIBAND: LinkLayer = LinkLayer(1);
    /// Ethernet (RoCE, SoftRoCE): addressing by GID.
    pub const ETHERNET: LinkLayer = LinkLayer(2);

    /// The name `ibv_devinfo` prints.
    pub fn as_str(self) -> &'static str {
        match self {
            LinkLayer::UNSPECIFIED | LinkLayer::INFINIBAND => "InfiniBand",
            LinkLayer::ETHERNET => "Ethernet",
            _ => "Unknown",
        }
    }
}

/// Port attributes (`struct ibv_port_attr`), from [`Context::query_port`](crate::Context::query_port).
#[derive(Clone, Copy)]
pub struct PortAttr(pub ffi::ibv_port_attr);

impl PortAttr {
    /// Logical port state.
    pub fn state(&self) -> PortState {
        PortState(self.0.state.0)
    }
    /// Largest MTU the port supports.
    pub fn max_mtu(&self) -> Mtu {
        Mtu(self.0.max_mtu.0)
    }
    /// MTU currently in effect.
    pub fn active_mtu(&self) -> Mtu {
        Mtu(self.0.active_mtu.0)
    }
    /// Base LID (InfiniBand).
    pub fn lid(&self) -> u16 {
        self.0.lid
    }
    /// LID of the subnet manager.
    pub fn sm_lid(&self) -> u16 {
        self.0.sm_lid
    }
    /// LID mask control.
    pub fn lmc(&self) -> u8 {
        self.0.lmc
    }
    /// Link layer: InfiniBand (LID addressing) or Ethernet (GID addressing).
    pub fn link_layer(&self) -> LinkLayer {
        LinkLayer(self.0.link_layer)
    }
    /// Length of the GID table.
    pub fn gid_tbl_len(&self) -> u32 {
        u32::try_from(self.0.gid_tbl_len).unwrap_or(0)
    }
    /// Length of the P_Key table (`pkey_tbl_len`): the indices
    /// [`Context::query_pkey`](crate::Context::query_pkey) takes.
    pub fn pkey_tbl_len(&self) -> u16 {
        self.0.pkey_tbl_len
    }
    /// Active link width (encoded as in `ibv_port_attr`).
    pub fn active_width(&self) -> u8 {
        self.0.active_width
    }
    /// Active link speed (encoded as in `ibv_port_attr`).
    pub fn active_speed(&self) -> u8 {
        self.0.active_speed
    }
    /// Physical port state.
    pub fn phys_state(&self) -> u8 {
        self.0.phys_state
    }
    /// Largest message size.
    pub fn max_msg_sz(&self) -> u32 {
        self.0.max_msg_sz
    }
    /// Port capability flags (`port_cap_flags`, bits of `enum ibv_port_cap_flags`).
    pub fn port_cap_flags(&self) -> u32 {
        self.0.port_cap_flags
    }
    /// More port capability flags (`port_cap_flags2`, bits of `enum ibv_port_cap_flags2`).
    pub fn port_cap_flags2(&self) -> u16 {
        self.0.port_cap_flags2
    }
    /// Packets dropped for a bad P_Key (`bad_pkey_cntr`).
    pub fn bad_pkey_cntr(&self) -> u32 {
        self.0.bad_pkey_cntr
    }
    /// Packets dropped for a Q_Key violation (`qkey_viol_cntr`).
    pub fn qkey_viol_cntr(&self) -> u32 {
        self.0.qkey_viol_cntr
    }
    /// Number of virtual lanes (`max_vl_num`, encoded as in `ibv_port_attr`).
    pub fn max_vl_num(&self) -> u8 {
        self.0.max_vl_num
    }
    /// Service level of the subnet manager (`sm_sl`).
    pub fn sm_sl(&self) -> u8 {
        self.0.sm_sl
    }
    /// The subnet propagation delay (`subnet_timeout`): 4.096 µs × 2^value.
    pub fn subnet_timeout(&self) -> u8 {
        self.0.subnet_timeout
    }
    /// The type of initialisation the subnet manager did (`init_type_reply`).
    pub fn init_type_reply(&self) -> u8 {
        self.0.init_type_reply
    }
    /// Port flags (`flags`: `IBV_QPF_GRH_REQUIRED` when the port needs a GRH on every address).
    pub fn flags(&self) -> u8 {
        self.0.flags
    }
}

impl fmt::Debug for PortAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PortAttr")
            .field("state", &self.state())
            .field("max_mtu", &self.max_mtu())
            .field("active_mtu", &self.active_mtu())
            .field("lid", &self.lid())
            .field("link_layer", &self.link_layer())
            .field("gid_tbl_len", &self.gid_tbl_len())
            .finish_non_exhaustive()
    }
}

/// A 128-bit global identifier (`union ibv_gid`), in network byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// Whether this is an IPv4-mapped address (`::ffff:a.b.c.d`), as RoCE v2 GIDs of IPv4
    /// addresses are.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10].iter().all(|&b| b == 0) && self.0[10] == 0xff && self.0[11] == 0xff
    }

    /// The GID as an IP address: IPv4 for an IPv4-mapped GID (`::ffff:a.b.c.d`, as RoCE v2 GIDs
    /// of IPv4 addresses are), IPv6 otherwise (RoCE GIDs of IPv6 addresses, link-local
    /// `fe80::` GIDs, InfiniBand GIDs).
    pub fn ip(&self) -> std::net::IpAddr {
        let v6 = std::net::Ipv6Addr::from(self.0);
        match v6.to_ipv4_mapped() {
            Some(v4) => std::net::IpAddr::V4(v4),
            None => std::net::IpAddr::V6(v6),
        }
    }

    /// Whether the GID is all zeroes (an unused entry).
    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|&b| b == 0)
    }

    /// The raw union, for C structs.
    pub fn to_raw(self) -> ffi::ibv_gid {
        ffi::ibv_gid { raw: self.0 }
    }

    /// From the raw union.
    pub fn from_raw(raw: &ffi::ibv_gid) -> Gid {
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Gid(unsafe { raw.raw })
    }
}

impl fmt::Display for Gid {
    /// Formats as `ibv_devinfo -v` does: eight groups of four hex digits, e.g.
    /// `0000:0000:0000:0000:0000:ffff:c000:0201`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// The type of a GID table entry (`enum ibv_gid_type`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct GidType(pub u32);

impl GidType {
    /// InfiniBand.
    pub const IB: GidType = GidType(ffi::ibv_gid_type::IBV_GID_TYPE_IB.0);
    /// RoCE v1 (Ethernet, no IP header).
    pub const ROCE_V1: GidType = GidType(ffi::ibv_gid_type::IBV_GID_TYPE_ROCE_V1.0);
    /// RoCE v2 (UDP/IP encapsulation): the only type SoftRoCE supports.
    pub const ROCE_V2: GidType = GidType(ffi::ibv_gid_type::IBV_GID_TYPE_ROCE_V2.0);

    /// The name `ibv_devinfo -v` prints: `"IB"`, `"RoCE v1"`, `"RoCE v2"`.
    pub fn as_str(self) -> &'static str {
        match self {
            GidType::IB => "IB",
            GidType::ROCE_V1 => "RoCE v1",
            GidType::ROCE_V2 => "RoCE v2",
            _ => "unknown",
        }
    }
}

impl fmt::Debug for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GidType({})", self.as_str())
    }
}

/// One GID table entry (`struct ibv_gid_entry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// The GID.
    pub gid: Gid,
    /// Its index in the port's table.
    pub index: u32,
    /// The port.
    pub port: u32,
    /// Its type.
    pub gid_type: GidType,
    /// Interface index of the associated network device (0 for none).
    pub ndev_ifindex: u32,
}

impl GidEntry {
    #[cfg_attr(not(ibverbs_has_query_gid_ex), allow(dead_code))]
    pub(crate) fn from_raw(e: &ffi::ibv_gid_entry) -> GidEntry {
        GidEntry {
            gid: Gid::from_raw(&e.gid),
            index: e.gid_index,
            port: e.port_num,
            gid_type: GidType(e.gid_type),
            ndev_ifindex: e.ndev_ifindex,
        }
    }
}

/// The state of a queue pair (`enum ibv_qp_state`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct QpState(pub u32);

impl QpState {
    /// Reset: just created, or reset.
    pub const RESET: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_RESET.0);
    /// Initialized: receives may be posted.
    pub const INIT: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_INIT.0);
    /// Ready to receive.
    pub const RTR: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_RTR.0);
    /// Ready to send.
    pub const RTS: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_RTS.0);
    /// Send queue drained.
    pub const SQD: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_SQD.0);
    /// Send queue error.
    pub const SQE: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_SQE.0);
    /// Error: outstanding requests are flushed.
    pub const ERR: QpState = QpState(ffi::ibv_qp_state::IBV_QPS_ERR.0);
    /// Not a verbs state: this crate's mark for a queue pair that lost its work queues in a
    /// failed [`QueuePair::reset`](crate::QueuePair::reset) (no room for fresh ones in its CQ).
    /// Nothing can be posted; poll the CQ until it is empty and call `reset` again.
    pub const UNUSABLE: QpState = QpState(u32::MAX);
}

impl fmt::Debug for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match *self {
            QpState::RESET => "RESET",
            QpState::INIT => "INIT",
            QpState::RTR => "RTR",
            QpState::RTS => "RTS",
            QpState::SQD => "SQD",
            QpState::SQE => "SQE",
            QpState::ERR => "ERR",
            QpState::UNUSABLE => "UNUSABLE",
            QpState(n) => return write!(f, "QpState({n})"),
        };
        f.write_str(name)
    }
}

/// A RoCE version (`NCCL_IB_ROCE_VERSION_NUM`, our `IBVERBS_ROCE_VERSION`): 1 or 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RoceVersion {
    /// RoCE v1: Ethernet frames without an IP header; one Layer-2 domain only.
    V1,
    /// RoCE v2: UDP/IP (port 4791); routable. NCCL's default and the only one SoftRoCE has.
    V2,
}

impl RoceVersion {
    /// The GID type of this version.
    pub fn gid_type(self) -> GidType {
        match self {
            RoceVersion::V1 => GidType::ROCE_V1,
            RoceVersion::V2 => GidType::ROCE_V2,
        }
    }
}

impl fmt::Display for RoceVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.gid_type().as_str())
    }
}

/// The network device under a RoCE or iWARP port (e.g. `eth0`, or `dummy0` for SoftRoCE and
/// soft-iWARP in the test VM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Netdev {
    /// The interface name.
    pub name: String,
    /// Its operational state from `/sys/class/net/<name>/operstate`: `up`, `down`, `unknown`...
    pub oper_state: String,
    /// Its MTU in bytes, if known: the RoCE active MTU is the largest IB MTU below it (minus
    /// headers).
    pub mtu: Option<u32>,
}

impl Netdev {
    /// The interface's IP addresses now (`getifaddrs()`), IPv4 first, each once: where RDMA-CM
    /// reaches the port (an iWARP port is addressed by IP alone; a RoCE port's IPv4 address is
    /// also its RoCE v2 GID). Empty when the interface has none or is gone.
    ///
    /// # Errors
    /// The OS error of `getifaddrs()`.
    #[doc(alias = "getifaddrs")]
    pub fn addresses(&self) -> io::Result<Vec<IpAddr>> {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        // SAFETY: `head` is a valid out-pointer; on success the list is ours until freeifaddrs.
        if unsafe { libc::getifaddrs(&mut head) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut found = Vec::new();
        let mut node = head;
        while !node.is_null() {
            // SAFETY: a node of the list getifaddrs gave, alive until freeifaddrs below; nothing
            // in this loop can unwind (a failed allocation aborts).
            let ifa = unsafe { &*node };
            node = ifa.ifa_next;
            // SAFETY: ifa_name is a NUL-terminated string of the node; ifa_addr, when not null,
            // points to a sockaddr of the family it names, as long as the node (getifaddrs(3)).
            let addr = unsafe {
                if ifa.ifa_addr.is_null() || CStr::from_ptr(ifa.ifa_name).to_bytes() != self.name.as_bytes() {
                    continue;
                }
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*ifa.ifa_addr.cast::<libc::sockaddr_in>();
                        IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*ifa.ifa_addr.cast::<libc::sockaddr_in6>();
                        IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                    }
                    _ => continue,
                }
            };
            if !found.contains(&addr) {
                found.push(addr);
            }
        }
        // SAFETY: the list getifaddrs gave, freed once; no reference into it is kept.
        unsafe { libc::freeifaddrs(head) };
        found.sort_by_key(|a| a.is_ipv6());
        Ok(found)
    }

    /// Its first IPv4 address ([`addresses`](Self::addresses)), if it has one.
    ///
    /// # Errors
    /// As [`addresses`](Self::addresses).
    pub fn ipv4(&self) -> io::Result<Option<Ipv4Addr>> {
        Ok(self.addresses()?.into_iter().find_map(|a| match a {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        }))
    }
}

/// The kind of an RDMA-CM event (`enum rdma_cm_event_type`); sound for any value librdmacm
/// writes. With the `cm` feature.
#[cfg(feature = "cm")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct CmEventKind(pub u32);

#[cfg(feature = "cm")]
impl CmEventKind {
    /// `rdma_resolve_addr` succeeded.
    pub const ADDR_RESOLVED: CmEventKind =
        CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED.0);
    /// `rdma_resolve_addr` failed (status: the error, e.g. `-ETIMEDOUT`, `-ENODEV`).
    pub const ADDR_ERROR: CmEventKind = CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_ERROR.0);
    /// `rdma_resolve_route` succeeded.
    pub const ROUTE_RESOLVED: CmEventKind =
        CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED.0);
    /// `rdma_resolve_route` failed.
    pub const ROUTE_ERROR: CmEventKind = CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_ERROR.0);
    /// A peer asks to connect to a listener: the event carries the new id
    /// ([`CmEvent::take_new_id`](crate::cm::CmEvent::take_new_id)) and the peer's private data.
    pub const CONNECT_REQUEST: CmEventKind =
        CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST.0);
    /// A reply to a connection request of an id without a queue pair.
    pub const CONNECT_RESPONSE: CmEventKind =
        CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_RESPONSE.0);
    /// The connection could not be established.
    pub const CONNECT_ERROR: CmEventKind =
        CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR.0);
    /// The peer is unreachable or did not answer.
    pub const UNREACHABLE: CmEventKind = CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE.0);
    /// The peer rejected the connection (status: the reason, e.g. 28 for a consumer reject and
    /// 8 when nothing listens on an InfiniBand/RoCE port), with its private data.
    pub const REJECTED: CmEventKind = CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED.0);
    /// The connection is established: the queue pair is in RTS.
    pub const ESTABLISHED: CmEventKind = CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED.0);
    /// The connection was disconnected (by either side, or by the peer's kernel when the
    /// peer's process died). librdmacm does not touch a user-space queue pair on this event:
    /// answer it with [`CmId::disconnect`](crate::cm::CmId::disconnect), which moves the queue
    /// pair to the error state so that its outstanding requests flush and hand their buffers back.
    pub const DISCONNECTED: CmEventKind = CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED.0);
    /// The id's device was removed: destroy everything of it.
    pub const DEVICE_REMOVAL: CmEventKind =
        CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL.0);
    /// A multicast join completed.
    pub const MULTICAST_JOIN: CmEventKind =
        CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_MULTICAST_JOIN.0);
    /// A multicast join failed.
    pub const MULTICAST_ERROR: CmEventKind =
        CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_MULTICAST_ERROR.0);
    /// The id's network address changed.
    pub const ADDR_CHANGE: CmEventKind = CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_CHANGE.0);
    /// The queue pair of a disconnected connection left its time-wait state and may be reused.
    pub const TIMEWAIT_EXIT: CmEventKind =
        CmEventKind(ffi::rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT.0);
}

#[cfg(feature = "cm")]
impl fmt::Debug for CmEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match *self {
            CmEventKind::ADDR_RESOLVED => "ADDR_RESOLVED",
            CmEventKind::ADDR_ERROR => "ADDR_ERROR",
            CmEventKind::ROUTE_RESOLVED => "ROUTE_RESOLVED",
            CmEventKind::ROUTE_ERROR => "ROUTE_ERROR",
            CmEventKind::CONNECT_REQUEST => "CONNECT_REQUEST",
            CmEventKind::CONNECT_RESPONSE => "CONNECT_RESPONSE",
            CmEventKind::CONNECT_ERROR => "CONNECT_ERROR",
            CmEventKind::UNREACHABLE => "UNREACHABLE",
            CmEventKind::REJECTED => "REJECTED",
            CmEventKind::ESTABLISHED => "ESTABLISHED",
            CmEventKind::DISCONNECTED => "DISCONNECTED",
            CmEventKind::DEVICE_REMOVAL => "DEVICE_REMOVAL",
            CmEventKind::MULTICAST_JOIN => "MULTICAST_JOIN",
            CmEventKind::MULTICAST_ERROR => "MULTICAST_ERROR",
            CmEventKind::ADDR_CHANGE => "ADDR_CHANGE",
            CmEventKind::TIMEWAIT_EXIT => "TIMEWAIT_EXIT",
            CmEventKind(n) => return write!(f, "CmEventKind({n})"),
        };
        f.write_str(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odp_caps_read_the_general_bits() {
        let mut attr = DeviceAttrEx(ffi::ibv_device_attr_ex::default());
        assert!(!attr.odp().supported() && !attr.odp().implicit());
        attr.0.odp_caps.general_caps = u64::from(ffi::ibv_odp_general_caps::IBV_ODP_SUPPORT.0);
        attr.0.odp_caps.per_transport_caps.rc_odp_caps = 0x3f;
        attr.0.xrc_odp_caps = 1;
        let odp = attr.odp();
        assert!(odp.supported() && !odp.implicit());
        assert_eq!((odp.rc, odp.xrc), (0x3f, 1));
        attr.0.max_dm_size = 1 << 17;
        assert_eq!(attr.max_dm_size(), 1 << 17);
    }

    #[test]
    fn gid_formats_like_ibv_devinfo() {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[192, 0, 2, 1]);
        let gid = Gid(g);
        assert_eq!(gid.to_string(), "0000:0000:0000:0000:0000:ffff:c000:0201");
        assert!(gid.is_ipv4_mapped());
        assert_eq!(gid.ip().to_string(), "192.0.2.1");
        let link_local = Gid([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert!(!link_local.is_ipv4_mapped());
        assert_eq!(link_local.ip().to_string(), "fe80::102:304:506:708");
        assert_eq!(Gid::from_raw(&gid.to_raw()), gid);
    }

    #[test]
    fn guid_formats_like_ibv_devinfo() {
        assert_eq!(Guid(0x0011_2233_4455_6677).to_string(), "0011:2233:4455:6677");
        assert_eq!(Guid::from_be(0x0011_2233_4455_6677u64.to_be()).0, 0x0011_2233_4455_6677);
    }

    #[test]
    fn mtu_round_trips_and_survives_unknown_values() {
        for b in [256, 512, 1024, 2048, 4096] {
            assert_eq!(Mtu::from_bytes(b).unwrap().bytes(), Some(b));
        }
        assert_eq!(Mtu::from_bytes(1500), None);
        assert_eq!(Mtu(77).bytes(), None);
        assert_eq!(format!("{:?}", Mtu(77)), "Mtu(invalid 77)");
        assert!(Mtu::MTU_1024 < Mtu::MTU_4096);
    }

    #[test]
    #[cfg_attr(miri, ignore = "calls into libibverbs")]
    fn enum_newtypes_name_any_value() {
        assert_eq!(PortState::ACTIVE.as_str(), "active");
        assert!(!PortState(999).as_str().is_empty());
        assert_eq!(NodeType::CA.as_str(), "InfiniBand channel adapter");
        assert_eq!(GidType(42).as_str(), "unknown");
        assert_eq!(LinkLayer(9).as_str(), "Unknown");
        assert_eq!(TransportType::IB.as_str(), "InfiniBand");
    }

    /// The names used without libibverbs are the library's.
    #[test]
    #[cfg_attr(miri, ignore = "calls into libibverbs")]
    fn fallback_names_are_the_librarys() {
        ffi::load().expect("the host tests run with libibverbs");
        for v in -3..40 {
            // SAFETY: static strings for any value.
            let c = unsafe { static_str(ffi::ibv_node_type_str(ffi::ibv_node_type(v))) };
            assert_eq!(node_type_name(v), c, "node type {v}");
        }
        for v in 0..40 {
            // SAFETY: as above.
            let c = unsafe { static_str(ffi::ibv_port_state_str(ffi::ibv_port_state(v))) };
            assert_eq!(port_state_name(v), c, "port state {v}");
        }
    }

    /// `getifaddrs` (a system call Miri cannot make): the loopback interface has 127.0.0.1, an
    /// interface that does not exist has no address.
    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_netdevs_addresses_come_from_getifaddrs() {
        let named = |name: &str| Netdev { name: name.into(), oper_state: "unknown".into(), mtu: None };
        let lo = named("lo").addresses().unwrap();
        assert!(lo.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)), "{lo:?}");
        assert!(
            lo.iter().take_while(|a| a.is_ipv4()).count() >= 1
                && lo.windows(2).all(|w| w[0].is_ipv4() || w[1].is_ipv6())
        );
        assert_eq!(named("lo").ipv4().unwrap(), Some(Ipv4Addr::LOCALHOST));
        assert_eq!(named("no-such-netdev0").addresses().unwrap(), Vec::<IpAddr>::new());
        assert_eq!(named("no-such-netdev0").ipv4().unwrap(), None);
    }

    #[test]
    #[cfg(feature = "cm")]
    fn event_kinds_print_their_names() {
        assert_eq!(format!("{:?}", CmEventKind::ESTABLISHED), "ESTABLISHED");
        assert_eq!(format!("{:?}", CmEventKind::TIMEWAIT_EXIT), "TIMEWAIT_EXIT");
        assert_eq!(format!("{:?}", CmEventKind(999)), "CmEventKind(999)");
    }
}
