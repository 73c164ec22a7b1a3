//! Address handles: the destination of Sends on UD queue pairs.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::attr::LinkLayer;
use crate::connect::{ah_attr, ConnectOptions, Endpoint};
use crate::error::{cvt_p, Error, Result};
use crate::pd::{PdInner, ProtectionDomain};

pub(crate) struct AhInner {
    raw: NonNull<ffi::ibv_ah>,
    pub(crate) pd: Arc<PdInner>,
}

// SAFETY: an AH is an immutable handle once created; rdma-core allows using it from any thread.
unsafe impl Send for AhInner {}
// SAFETY: as above.
unsafe impl Sync for AhInner {}

impl Drop for AhInner {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once; posted UD sends hold an Arc of this inner until
        // their completion, so no outstanding request uses it.
        unsafe { ffi::ibv_destroy_ah(self.raw.as_ptr()) };
    }
}

/// An address handle (`struct ibv_ah`): the path to a remote port, for UD sends.
///
/// Cloning is cheap (an `Arc`); a posted UD send keeps its handle alive until its completion.
#[derive(Clone)]
pub struct AddressHandle {
    pub(crate) inner: Arc<AhInner>,
}

impl fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AddressHandle").field("raw", &self.inner.raw).finish()
    }
}

impl AddressHandle {
    /// The raw `struct ibv_ah *`; valid while this handle lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_ah {
        self.inner.raw.as_ptr()
    }
}

impl ProtectionDomain {
    /// Creates an address handle for `remote`'s port (`ibv_create_ah()`), addressed by GID on
    /// RoCE and by LID on InfiniBand, with `opts`' port, GID index and service level.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for out-of-range `opts` (as
    /// [`QueuePair::connect`](crate::QueuePair::connect) checks them, e.g. a service level above
    /// 15, a GID index above 255); [`Error::Verb`](crate::Error::Verb) from `ibv_create_ah()`
    /// (e.g. a bad GID index), or from the port/GID queries.
    #[doc(alias = "ibv_create_ah")]
    pub fn create_ah(&self, remote: &Endpoint, opts: &ConnectOptions) -> Result<AddressHandle> {
        opts.validate("ibv_create_ah")?;
        let mut attr = ah_attr(&self.context(), remote, opts, "ibv_create_ah")?;
        self.create_ah_raw(&mut attr)
    }

    /// Creates an address handle routed by LID alone, without a global route header
    /// (`ibv_create_ah()` with `is_global = 0`): InfiniBand's routing inside one subnet, as
    /// rdma-core's pingpong tools do when given no GID. `dlid` is the destination port's LID
    /// ([`Endpoint::lid`](crate::Endpoint::lid), [`PortAttr::lid`](crate::PortAttr::lid)); of
    /// `opts`, the port, the service level (`sl`) and nothing else are used. The source path
    /// bits and the static rate are 0.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `dlid` of 0 or out-of-range `opts` (as
    /// [`create_ah`](Self::create_ah)); [`Error::Unsupported`] on a port whose link layer is not
    /// InfiniBand (RoCE and iWARP route by GID: the kernel refuses an address handle without a
    /// GRH there with `EINVAL`), before the verb; [`Error::Verb`] from `ibv_create_ah()` or the
    /// port query.
    #[doc(alias = "ibv_create_ah")]
    #[doc(alias = "is_global")]
    pub fn create_ah_lid(&self, dlid: u16, opts: &ConnectOptions) -> Result<AddressHandle> {
        const VERB: &str = "ibv_create_ah";
        opts.validate(VERB)?;
        if dlid == 0 {
            return Err(Error::InvalidArgument { verb: VERB, reason: "LID 0 is reserved (no port has it)" });
        }
        // Link layer 0 (unspecified) is InfiniBand on kernels that predate the field.
        let link_layer = self.context().query_port(opts.port)?.link_layer();
        if !matches!(link_layer, LinkLayer::INFINIBAND | LinkLayer::UNSPECIFIED) {
            return Err(Error::Unsupported {
                verb: VERB,
                capability:
                    "address handles without a GRH (LID routing): the port's link layer routes by GID",
            });
        }
        let mut attr = ffi::ibv_ah_attr {
            dlid,
            sl: opts.sl,
            src_path_bits: 0,
            static_rate: 0,
            is_global: 0,
            port_num: opts.port,
            ..Default::default()
        };
        self.create_ah_raw(&mut attr)
    }

    /// Creates an address handle from raw attributes (`ibv_create_ah()`).
    ///
    /// # Errors
    /// [`Error::Verb`](crate::Error::Verb) from `ibv_create_ah()`.
    #[doc(alias = "ibv_create_ah")]
    pub fn create_ah_raw(&self, attr: &mut ffi::ibv_ah_attr) -> Result<AddressHandle> {
        // Providers may fail without setting errno (mlx5 for a bad port): not an earlier call's.
        crate::error::clear_errno();
        // SAFETY: valid PD and attribute struct; the AH is destroyed once in AhInner::drop.
        let raw = cvt_p("ibv_create_ah", unsafe { ffi::ibv_create_ah(self.as_raw(), attr) })?;
        Ok(AddressHandle { inner: Arc::new(AhInner { raw, pd: self.inner.clone() }) })
    }
}
