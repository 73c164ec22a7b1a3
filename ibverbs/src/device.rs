//! Devices and device contexts. What they report (device, port and GID attributes) are plain
//! values of `attr`.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::CStr;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use ibverbs_sys as ffi;

use crate::attr::{
    DeviceAttr, DeviceAttrEx, Gid, GidEntry, GidType, Guid, LinkLayer, NodeType, PortAttr, TransportType,
};
use crate::error::{cvt, cvt_p, Error, Result};

/// Why a queue's creation on siw fails without `errno`. siw's kernel driver numbers the
/// memory-map keys of a context's queues by page, from 0, lowest free range first, and libsiw
/// takes the key of page 144 (offset 0x90000, its `SIW_INVAL_UOBJ_KEY`) for "invalid": it
/// destroys a queue given that key and returns failure with `errno` untouched. Measured on Linux
/// 6.1: the 145th one-page CQ of a context fails, and every one after it while the first 144
/// live.
pub(crate) const SIW_QUEUE_SPACE: &str = "no errno given: libsiw refused the queue's memory-map \
    key. siw numbers a context's queue mappings by page and libsiw takes page 144 (offset 0x90000) \
    for its invalid key, so the CQs, queue pairs and SRQs of one context fit in 576 KiB (32 bytes \
    per CQE, 120 per send and 112 per receive work request, queue depths rounded up to a power \
    of two, each queue to whole pages): destroy some or make them smaller; a Context opened \
    separately has its own 576 KiB, but RDMA-CM puts all its queue pairs of a device on one";

/// The list of RDMA devices present on this host (`ibv_get_device_list()`).
///
/// Freed with `ibv_free_device_list()` on drop; devices borrowed from it must be opened (which
/// yields an owned [`Context`]) before the list is dropped.
pub struct DeviceList {
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

// SAFETY: the list is an immutable array of device pointers; libibverbs allows reading it and
// opening its devices from any thread.
unsafe impl Send for DeviceList {}
// SAFETY: as above, nothing in it is mutated after ibv_get_device_list() returns.
unsafe impl Sync for DeviceList {}

/// Lists the RDMA devices present on this host.
///
/// # Errors
/// [`Error::Verb`] when `ibv_get_device_list()` fails (e.g. `ENOSYS` without kernel support);
/// with the `dlopen` feature, [`Error::LibraryMissing`] when libibverbs cannot be loaded.
#[doc(alias = "ibv_get_device_list")]
pub fn devices() -> Result<DeviceList> {
    // The first verbs call of a program that starts from the device list (Context::open and
    // select do): with `dlopen`, where a missing libibverbs becomes an error (ffi's `dl` module).
    ffi::load()?;
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the returned array is owned by the DeviceList.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    let list = cvt_p("ibv_get_device_list", list)?;
    Ok(DeviceList { list, len: usize::try_from(n).unwrap_or(0) })
}

impl DeviceList {
    /// Number of devices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no device is present.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device at `index`.
    pub fn get(&self, index: usize) -> Option<Device<'_>> {
        if index >= self.len {
            return None;
        }
        // SAFETY: index < len, the array holds `len` valid device pointers.
        let raw = unsafe { *self.list.as_ptr().add(index) };
        NonNull::new(raw).map(|raw| Device { raw, _list: self })
    }

    /// Iterates over the devices.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Device<'_>> + '_ {
        (0..self.len).filter_map(|i| self.get(i)).collect::<Vec<_>>().into_iter()
    }

    /// The device named `name` (e.g. `"rxe0"`, `"mlx5_0"`).
    ///
    /// # Errors
    /// [`Error::DeviceNotFound`], naming the devices that exist.
    pub fn find(&self, name: &str) -> Result<Device<'_>> {
        self.iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::DeviceNotFound { name: name.to_string(), available: self.names() })
    }

    fn names(&self) -> String {
        let names: Vec<String> = self.iter().map(|d| d.name().to_string()).collect();
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list() and is freed once; opened contexts
        // stay valid after the free.
        unsafe { ffi::ibv_free_device_list(self.list.as_ptr()) };
    }
}

impl fmt::Debug for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One RDMA device of a [`DeviceList`].
#[derive(Clone, Copy)]
pub struct Device<'a> {
    raw: NonNull<ffi::ibv_device>,
    _list: &'a DeviceList,
}

impl<'a> Device<'a> {
    /// The kernel name of the device, e.g. `"rxe0"` (`ibv_get_device_name()`).
    #[doc(alias = "ibv_get_device_name")]
    pub fn name(&self) -> &'a str {
        // SAFETY: the device pointer is valid while the list lives ('a); the name is stored in the
        // device struct.
        let p = unsafe { ffi::ibv_get_device_name(self.raw.as_ptr()) };
        if p.is_null() {
            return "";
        }
        // SAFETY: non-NULL, NUL-terminated, lives as long as the device list.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
    }

    /// The node GUID, in host order (`ibv_get_device_guid()`).
    #[doc(alias = "ibv_get_device_guid")]
    pub fn guid(&self) -> Guid {
        // SAFETY: valid device pointer.
        Guid::from_be(unsafe { ffi::ibv_get_device_guid(self.raw.as_ptr()) })
    }

    /// The node type.
    pub fn node_type(&self) -> NodeType {
        // SAFETY: valid device pointer; node_type is a plain field written at discovery.
        NodeType(unsafe { (*self.raw.as_ptr()).node_type.0 })
    }

    /// The transport type.
    pub fn transport_type(&self) -> TransportType {
        // SAFETY: as above.
        TransportType(unsafe { (*self.raw.as_ptr()).transport_type.0 })
    }

    /// Opens the device (`ibv_open_device()`).
    ///
    /// # Errors
    /// [`Error::Verb`] when the device cannot be opened (permissions on `/dev/infiniband`, ...).
    #[doc(alias = "ibv_open_device")]
    pub fn open(&self) -> Result<Context> {
        // A provider may fail without setting errno: not an earlier call's.
        crate::error::clear_errno();
        // SAFETY: valid device pointer; the context is closed once in ContextInner::drop.
        let raw = unsafe { ffi::ibv_open_device(self.raw.as_ptr()) };
        let raw = cvt_p("ibv_open_device", raw)?;
        Ok(Context {
            inner: Arc::new(ContextInner {
                raw,
                name: self.name().to_string(),
                cm_anchor: None,
                siw: Default::default(),
                quirks: Default::default(),
                serials: Default::default(),
            }),
        })
    }

    /// The raw `struct ibv_device *`.
    pub fn as_raw(&self) -> *mut ffi::ibv_device {
        self.raw.as_ptr()
    }
}

impl fmt::Debug for Device<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device").field("name", &self.name()).field("guid", &self.guid()).finish()
    }
}

pub(crate) struct ContextInner {
    pub(crate) raw: NonNull<ffi::ibv_context>,
    pub(crate) name: String,
    /// For a context librdmacm opened (an RDMA-CM id's `verbs`): what keeps it open (the `cm`
    /// module's `rdma_get_devices()` list, see [`ContextInner::adopted`]). Such a context is never
    /// closed by this crate: dropping the anchor (`rdma_free_devices()`) hands it back to librdmacm.
    pub(crate) cm_anchor: Option<Box<dyn Any + Send + Sync>>,
    /// Whether the device is siw, found by [`Context::is_siw`] once.
    pub(crate) siw: std::sync::OnceLock<bool>,
    /// The provider and kernel bugs the crate steers around, found by [`Context::quirks`] once.
    pub(crate) quirks: std::sync::OnceLock<crate::quirks::Quirks>,
    /// The process-unique numbers of the context's live CQs, QPs and SRQs, by address: what an
    /// asynchronous event names them by ([`crate::AsyncObject`]).
    pub(crate) serials: Serials,
}

/// The kinds of objects an asynchronous event names by address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ObjectKind {
    Cq,
    Qp,
    Srq,
}

/// The process-unique numbers (serials) of a context's live objects, by kind and address.
///
/// An asynchronous event names its object by the address of its `struct ibv_cq`/`ibv_qp`/
/// `ibv_srq`; the allocator may give that address to a later object once the first is
/// destroyed, so an event kept by the caller would be taken for the later one. The event's
/// reader looks the address up here while the object is alive (its destruction waits for the
/// event's acknowledgement) and keeps the serial instead. An object is entered once created
/// and removed once destroyed, and only by its own serial: a later object at the same address
/// may already have replaced the entry. Objects created behind the crate (with `ffi`) are
/// absent: their events name serial 0, which no object of the crate has.
#[derive(Default)]
pub(crate) struct Serials(Mutex<HashMap<(ObjectKind, usize), u64>>);

impl Serials {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<(ObjectKind, usize), u64>> {
        // Entries are inserted and removed whole: a poisoned lock holds a consistent map.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new object of `kind` at `addr` has `serial`.
    pub(crate) fn insert(&self, kind: ObjectKind, addr: usize, serial: u64) {
        self.map().insert((kind, addr), serial);
    }

    /// The object of `kind` at `addr` with `serial` was destroyed.
    pub(crate) fn remove(&self, kind: ObjectKind, addr: usize, serial: u64) {
        let mut map = self.map();
        if map.get(&(kind, addr)) == Some(&serial) {
            map.remove(&(kind, addr));
        }
    }

    /// The serial of the live object of `kind` at `addr`; 0 for one the crate did not create.
    pub(crate) fn get(&self, kind: ObjectKind, addr: usize) -> u64 {
        self.map().get(&(kind, addr)).copied().unwrap_or(0)
    }
}

/// Identifies a queue pair in an [`AsyncEvent`](crate::AsyncEvent) (compare with
/// [`QueuePair::id`](crate::QueuePair::id)): a number unique in the process, never given to another
/// QP (the `struct ibv_qp` address of a dropped QP may be a later one's: an event kept after its QP
/// was dropped is not taken for that later QP). 0 for a QP created with `ffi`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpId(pub(crate) u64);

/// Identifies the completion queue an event is for (compare with
/// [`CompletionQueue::id`](crate::CompletionQueue::id)): a number unique in the process, never
/// given to another CQ (the `struct ibv_cq` address of a dropped CQ may be a later one's: an id
/// kept after its CQ was dropped is not taken for that later CQ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqId(pub(crate) u64);

/// A process-wide identity of a queue pair, SRQ or CQ (what prepared requests are checked
/// against, and what [`QpId`](crate::QpId), [`CqId`](crate::CqId) and SRQ ids are): a 64-bit
/// counter does not wrap in any process's lifetime.
pub(crate) fn next_queue_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

// SAFETY: libibverbs contexts are thread-safe: every verb taking a context may be called from any
// thread concurrently (rdma-core documents the verbs as thread-safe).
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl ContextInner {
    /// The inner of a context another library opened and keeps open while `anchor` lives
    /// (librdmacm's, anchored by its device list): this crate never closes it.
    #[cfg(feature = "cm")]
    pub(crate) fn adopted(
        raw: NonNull<ffi::ibv_context>,
        name: String,
        anchor: Box<dyn Any + Send + Sync>,
    ) -> ContextInner {
        ContextInner {
            raw,
            name,
            cm_anchor: Some(anchor),
            siw: Default::default(),
            quirks: Default::default(),
            serials: Default::default(),
        }
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        if self.cm_anchor.is_some() {
            // librdmacm's context: the anchor's drop releases it; librdmacm closes it.
            return;
        }
        // SAFETY: every child (PD, CQ, channel...) holds an Arc of this inner, so none is left;
        // the context is closed exactly once.
        unsafe { ffi::ibv_close_device(self.raw.as_ptr()) };
    }
}

/// An open RDMA device (`struct ibv_context`): the parent of every other verbs object.
///
/// Cloning is cheap (an `Arc`); the device is closed (`ibv_close_device()`) when the last clone
/// and the last object created from it are gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context").field("device", &self.inner.name).finish()
    }
}

impl Context {
    /// Opens the device named `name`, or the first device when `name` is `None`.
    ///
    /// # Errors
    /// [`Error::DeviceNotFound`] (listing the devices present) when no device matches, or the
    /// error of `ibv_get_device_list()`/`ibv_open_device()`.
    pub fn open(name: Option<&str>) -> Result<Context> {
        let list = devices()?;
        match name {
            Some(name) => list.find(name)?.open(),
            None => list
                .get(0)
                .ok_or_else(|| Error::DeviceNotFound { name: "<any>".to_string(), available: "none".into() })?
                .open(),
        }
    }

    /// The device's kernel name, e.g. `"rxe0"`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's node type (`ibv_context->device->node_type`): [`NodeType::RNIC`] for an
    /// iWARP device such as siw.
    pub fn node_type(&self) -> NodeType {
        // SAFETY: a valid context points at its device, which libibverbs keeps until the context
        // is closed; node_type is a plain field written at discovery.
        NodeType(unsafe { (*(*self.as_raw()).device).node_type.0 })
    }

    /// The transport the device speaks (`ibv_context->device->transport_type`). On
    /// [`TransportType::IWARP`] queue pairs connect only through RDMA-CM ([`crate::cm`]):
    /// [`QueuePair::connect`](crate::QueuePair::connect) refuses them.
    pub fn transport_type(&self) -> TransportType {
        // SAFETY: as in node_type.
        TransportType(unsafe { (*(*self.as_raw()).device).transport_type.0 })
    }

    /// Whether the device is iWARP ([`transport_type`](Self::transport_type) is
    /// [`TransportType::IWARP`]): its queue pairs connect only through RDMA-CM ([`crate::cm`]).
    pub fn is_iwarp(&self) -> bool {
        self.transport_type() == TransportType::IWARP
    }

    /// Whether the device is soft-iWARP (siw: vendor ID 0x626d74, "bmt", on an iWARP device),
    /// whose quirks the crate works around: it registers every memory region at its virtual
    /// address, ignoring the IOVA of `ibv_reg_mr_iova2()` (Linux 6.1 `siw_reg_user_mr` leaves
    /// `rnic_va` unused), and completes send-queue requests out of order (see
    /// `queue::qp::fenced_post_send`). Queries the device once per context, on iWARP only.
    /// A failed query is not kept (the next call asks again) and answers `true` meanwhile: the
    /// workarounds are safe on any iWARP device, while skipping the fence on siw would let a
    /// Send's completion hand back the buffer of a Read posted before it, still being written.
    pub(crate) fn is_siw(&self) -> bool {
        const SIW_VENDOR_ID: u32 = 0x0062_6d74;
        if let Some(&siw) = self.inner.siw.get() {
            return siw;
        }
        let siw = if !self.is_iwarp() {
            false
        } else {
            match self.query_device() {
                Ok(a) => a.vendor_id() == SIW_VENDOR_ID,
                Err(_) => return true,
            }
        };
        // A racing caller may have set the same answer first.
        let _ = self.inner.siw.set(siw);
        siw
    }

    /// The provider and kernel bugs the crate steers around on this device
    /// ([`crate::quirks`]): found from the vendor ID and the running kernel once per context. A
    /// failed device query is not kept (the next call asks again) and answers with every
    /// workaround on meanwhile.
    pub(crate) fn quirks(&self) -> crate::quirks::Quirks {
        use crate::quirks::{running_versions, Quirks};
        if let Some(&q) = self.inner.quirks.get() {
            return q;
        }
        let vendor = self.query_device().ok().map(|a| a.vendor_id());
        let (release, rdma_core) = running_versions();
        let q = Quirks::of(vendor, self.is_iwarp(), release, *rdma_core);
        if vendor.is_some() {
            // A racing caller may have set the same answer first.
            let _ = self.inner.quirks.set(q);
        }
        q
    }

    /// `e`, the failure of a queue's creation on this context (`ibv_create_cq`, `ibv_create_qp`,
    /// `rdma_create_qp`, `ibv_create_srq`, called with `errno` cleared by
    /// [`clear_errno`](crate::error::clear_errno)), with its cause where the crate knows it: on
    /// siw, a failure without `errno` is libsiw refusing the memory-map key the kernel gave the
    /// queue ([`SIW_QUEUE_SPACE`]).
    pub(crate) fn explain_queue_failure(&self, e: Error) -> Error {
        match e {
            Error::Verb { verb, source } if source.raw_os_error().is_none() && self.is_siw() => {
                Error::Verb { verb, source: std::io::Error::other(SIW_QUEUE_SPACE) }
            }
            e => e,
        }
    }

    /// The raw `struct ibv_context *`, for use with [`ffi`](crate::ffi). It stays valid while
    /// this context (or any object created from it) lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_context {
        self.inner.raw.as_ptr()
    }

    /// Queries the device's attributes (`ibv_query_device()`).
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails.
    #[doc(alias = "ibv_query_device")]
    pub fn query_device(&self) -> Result<DeviceAttr> {
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: valid context; attr is a valid out-pointer of the right type.
        cvt("ibv_query_device", unsafe { ffi::ibv_query_device(self.as_raw(), &mut attr) })?;
        Ok(DeviceAttr(attr))
    }

    /// Queries the device's extended attributes (`ibv_query_device_ex()`): ODP, TSO, RSS,
    /// completion timestamps and more, plus the classic attributes in [`DeviceAttrEx::orig`].
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb fails.
    #[doc(alias = "ibv_query_device_ex")]
    pub fn query_device_ex(&self) -> Result<DeviceAttrEx> {
        let mut attr = ffi::ibv_device_attr_ex::default();
        // SAFETY: valid context; NULL input is allowed; attr is a writable struct of the verb's type.
        let ret = unsafe { ffi::ibv_query_device_ex(self.as_raw(), std::ptr::null(), &mut attr) };
        cvt("ibv_query_device_ex", ret)?;
        Ok(DeviceAttrEx(attr))
    }

    /// Number of completion vectors (interrupt vectors for completion events).
    pub fn num_comp_vectors(&self) -> u32 {
        // SAFETY: valid context; a plain field set when the device was opened.
        u32::try_from(unsafe { (*self.as_raw()).num_comp_vectors }).unwrap_or(0)
    }

    /// Queries port `port` (numbered from 1) (`ibv_query_port()`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for port 0, [`Error::Verb`] (`EINVAL`) for a port the device does
    /// not have.
    #[doc(alias = "ibv_query_port")]
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        if port == 0 {
            return Err(Error::InvalidArgument {
                verb: "ibv_query_port",
                reason: "ports are numbered from 1",
            });
        }
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: valid context; attr is a full, current struct ibv_port_attr (the shim calls the
        // macro version).
        cvt("ibv_query_port", unsafe { ffi::ibv_query_port(self.as_raw(), port, &mut attr) })?;
        Ok(PortAttr(attr))
    }

    /// Reads GID table entry `index` of `port` with its type and network device
    /// (`ibv_query_gid_ex()`; with rdma-core older than v32, `ibv_query_gid()` plus the kernel's
    /// `gid_attrs` in sysfs).
    ///
    /// # Errors
    /// [`Error::GidQuery`] naming the port and index: `EINVAL` for a bad port or index,
    /// `ENODATA` for an empty entry.
    #[doc(alias = "ibv_query_gid_ex")]
    #[doc(alias = "ibv_query_gid")]
    pub fn query_gid(&self, port: u8, index: u32) -> Result<GidEntry> {
        // With `dlopen` the libibverbs loaded may be older than the headers (v32 added the verb);
        // linked, it has every function the headers declare.
        #[cfg(ibverbs_has_query_gid_ex)]
        if ffi::has_function("_ibv_query_gid_ex") {
            let mut entry = ffi::ibv_gid_entry::default();
            // SAFETY: valid context and out-pointer; entry_size is the size of the struct we pass.
            let ret = unsafe {
                ffi::_ibv_query_gid_ex(
                    self.as_raw(),
                    u32::from(port),
                    index,
                    &mut entry,
                    0,
                    std::mem::size_of::<ffi::ibv_gid_entry>(),
                )
            };
            cvt("ibv_query_gid_ex", ret).map_err(|e| gid_error(e, port, index))?;
            return Ok(GidEntry::from_raw(&entry));
        }
        self.query_gid_compat(port, index)
    }

    /// [`query_gid`](Self::query_gid) the way rdma-core before v32 allows: `ibv_query_gid()`
    /// for the GID, the kernel's `/sys/class/infiniband/<dev>/ports/<port>/gid_attrs` for its type
    /// and network device. Public only so that tests can compare it with `ibv_query_gid_ex()`.
    ///
    /// # Errors
    /// As [`query_gid`](Self::query_gid).
    #[doc(hidden)]
    #[doc(alias = "ibv_query_gid")]
    pub fn query_gid_compat(&self, port: u8, index: u32) -> Result<GidEntry> {
        self.query_gid_compat_inner(port, index).map_err(|e| gid_error(e, port, index))
    }

    fn query_gid_compat_inner(&self, port: u8, index: u32) -> Result<GidEntry> {
        let c_index = libc::c_int::try_from(index).map_err(|_| Error::Verb {
            verb: "ibv_query_gid",
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        })?;
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: valid context and out-pointer.
        cvt("ibv_query_gid", unsafe { ffi::ibv_query_gid(self.as_raw(), port, c_index, &mut gid) })?;
        let gid = Gid::from_raw(&gid);
        if gid.is_zero() {
            return Err(Error::Verb {
                verb: "ibv_query_gid",
                source: std::io::Error::from_raw_os_error(libc::ENODATA),
            });
        }
        let attrs = format!("/sys/class/infiniband/{}/ports/{port}/gid_attrs", self.name());
        let read = |what: &str| std::fs::read_to_string(format!("{attrs}/{what}/{index}")).ok();
        let gid_type = match read("types").as_deref().map(str::trim) {
            Some("RoCE v2") => GidType::ROCE_V2,
            Some(_) | None if self.query_port(port)?.link_layer() == LinkLayer::ETHERNET => GidType::ROCE_V1,
            _ => GidType::IB,
        };
        let ndev_ifindex = read("ndevs")
            .and_then(|name| std::ffi::CString::new(name.trim()).ok())
            // SAFETY: a valid NUL-terminated interface name.
            .map_or(0, |name| unsafe { libc::if_nametoindex(name.as_ptr()) });
        Ok(GidEntry { gid, index, port: u32::from(port), gid_type, ndev_ifindex })
    }

    /// The populated entries of `port`'s GID table (`ibv_query_gid_table()`; with rdma-core older
    /// than v32, one [`query_gid`](Self::query_gid) per entry).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for port 0; [`Error::Verb`] when a verb fails, e.g. for a port
    /// the device does not have.
    #[doc(alias = "ibv_query_gid_table")]
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let len = usize::try_from(self.query_port(port)?.0.gid_tbl_len).unwrap_or(0);
        // As in query_gid: the loaded libibverbs may predate the verb (v32).
        #[cfg(ibverbs_has_query_gid_table)]
        if ffi::has_function("_ibv_query_gid_table") {
            // The verb returns the entries of every port (EINVAL without room for all of them):
            // room for each port's table, which may differ in size from `port`'s.
            let all_ports = self.query_device()?.0.phys_port_cnt.max(1);
            let mut room = 0usize;
            for p in 1..=all_ports {
                let l = if p == port {
                    len
                } else {
                    self.query_port(p).map_or(len, |a| usize::try_from(a.0.gid_tbl_len).unwrap_or(0))
                };
                room = room.saturating_add(l);
            }
            let mut entries = vec![ffi::ibv_gid_entry::default(); room];
            // SAFETY: valid context; `entries` has room for `entries.len()` entries of that size.
            let n = unsafe {
                ffi::_ibv_query_gid_table(
                    self.as_raw(),
                    entries.as_mut_ptr(),
                    entries.len(),
                    0,
                    std::mem::size_of::<ffi::ibv_gid_entry>(),
                )
            };
            if n < 0 {
                return Err(Error::from_ret("ibv_query_gid_table", i32::try_from(n).unwrap_or(libc::EINVAL)));
            }
            let n = usize::try_from(n).unwrap_or(0).min(entries.len());
            return Ok(entries[..n]
                .iter()
                .filter(|e| e.port_num == u32::from(port))
                .map(GidEntry::from_raw)
                .collect());
        }
        Ok((0..len as u32).filter_map(|i| self.query_gid(port, i).ok()).collect())
    }

    /// The GID index to use for RoCE v2 over IPv4 on `port`: the first RoCE v2 entry whose GID is
    /// an IPv4-mapped address (`::ffff:a.b.c.d`). On an InfiniBand port, index 0. This is what
    /// `NCCL_IB_GID_INDEX` or the `-g`/`-x` flags of the C tools are usually set to by hand (1 on
    /// a freshly created SoftRoCE device). Reads the port (`ibv_query_port()`) and its
    /// [`gid_table`](Self::gid_table) (`ibv_query_gid_table()`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for port 0; [`Error::Verb`] when a verb fails, or (`ENODATA`)
    /// when the port has no such GID (no IPv4 address on its netdev).
    #[doc(alias = "ibv_query_port")]
    #[doc(alias = "ibv_query_gid_table")]
    pub fn roce_v2_ipv4_gid_index(&self, port: u8) -> Result<u32> {
        let attr = self.query_port(port)?;
        if attr.link_layer() == LinkLayer::INFINIBAND {
            return Ok(0);
        }
        self.gid_table(port)?
            .into_iter()
            .find(|e| e.gid_type == GidType::ROCE_V2 && e.gid.is_ipv4_mapped())
            .map(|e| e.index)
            .ok_or_else(|| Error::Verb {
                verb: "ibv_query_gid_table",
                source: std::io::Error::from_raw_os_error(libc::ENODATA),
            })
    }
}

/// A GID query's verb error, with the port and index it asked for.
fn gid_error(e: Error, port: u8, index: u32) -> Error {
    match e {
        Error::Verb { verb: verb @ ("ibv_query_gid_ex" | "ibv_query_gid"), source } => {
            Error::GidQuery { verb, port, index, source }
        }
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_name_live_objects_and_a_dead_ones_removal_spares_its_successor() {
        let s = Serials::default();
        s.insert(ObjectKind::Cq, 0x1000, 7);
        s.insert(ObjectKind::Qp, 0x1000, 8);
        assert_eq!((s.get(ObjectKind::Cq, 0x1000), s.get(ObjectKind::Qp, 0x1000)), (7, 8));
        assert_eq!(s.get(ObjectKind::Srq, 0x1000), 0, "an object the crate did not create");
        // A later CQ at the address enters itself before the first one's removal comes.
        s.insert(ObjectKind::Cq, 0x1000, 9);
        s.remove(ObjectKind::Cq, 0x1000, 7);
        assert_eq!(s.get(ObjectKind::Cq, 0x1000), 9);
        s.remove(ObjectKind::Cq, 0x1000, 9);
        assert_eq!(s.get(ObjectKind::Cq, 0x1000), 0);
        assert_eq!(s.get(ObjectKind::Qp, 0x1000), 8);
    }
}
