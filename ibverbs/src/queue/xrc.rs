//! eXtended Reliable Connection (XRC) domains. An XRC shared receive queue is made with
//! [`ProtectionDomain::create_xrc_srq`](crate::ProtectionDomain::create_xrc_srq) (`srq.rs`), a
//! target queue pair with [`QueuePairBuilder::xrcd`](crate::QueuePairBuilder::xrcd).
//!
//! Every entry point checks `IBV_DEVICE_XRC` in the device's capability flags first and returns
//! [`Error::Unsupported`] naming it when the device lacks it (SoftRoCE does).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::device::{Context, ContextInner};
use crate::error::{cvt_p, Error, Result};

pub(crate) struct XrcdInner {
    raw: NonNull<ffi::ibv_xrcd>,
    pub(crate) _ctx: Arc<ContextInner>,
}

// SAFETY: an XRC domain is an opaque kernel handle, usable from any thread.
unsafe impl Send for XrcdInner {}
// SAFETY: as above.
unsafe impl Sync for XrcdInner {}

impl Drop for XrcdInner {
    fn drop(&mut self) {
        // SAFETY: every SRQ of this domain holds an Arc of this inner; closed once. A failure
        // (EBUSY) only leaks.
        unsafe { ffi::ibv_close_xrcd(self.raw.as_ptr()) };
    }
}

/// An XRC domain (`struct ibv_xrcd`): groups XRC shared receive queues and target queue pairs.
#[derive(Clone)]
pub struct XrcDomain {
    pub(crate) inner: Arc<XrcdInner>,
}

impl fmt::Debug for XrcDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("XrcDomain").finish_non_exhaustive()
    }
}

impl XrcDomain {
    /// The raw `struct ibv_xrcd *`; valid while this domain (or an SRQ in it) lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_xrcd {
        self.inner.raw.as_ptr()
    }
}

/// [`Error::Unsupported`] unless the device has `IBV_DEVICE_XRC`.
pub(crate) fn check_xrc(ctx: &Context, verb: &'static str) -> Result<()> {
    let flags = ctx.query_device()?.0.device_cap_flags;
    if flags & ffi::ibv_device_cap_flags::IBV_DEVICE_XRC.0 == 0 {
        return Err(Error::Unsupported { verb, capability: "IBV_DEVICE_XRC" });
    }
    Ok(())
}

impl Context {
    /// Opens a new XRC domain, not shared with other processes (`ibv_open_xrcd()` with no file).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device lacks `IBV_DEVICE_XRC`; [`Error::Verb`] when the
    /// verb fails.
    #[doc(alias = "ibv_open_xrcd")]
    #[doc(alias = "ibv_close_xrcd")]
    pub fn open_xrcd(&self) -> Result<XrcDomain> {
        check_xrc(self, "ibv_open_xrcd")?;
        let mut attr = ffi::ibv_xrcd_init_attr {
            comp_mask: (ffi::ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_FD.0
                | ffi::ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_OFLAGS.0),
            fd: -1,
            oflags: libc::O_CREAT,
        };
        // SAFETY: valid context and attribute struct (no file: fd -1).
        let raw = cvt_p("ibv_open_xrcd", unsafe { ffi::ibv_open_xrcd(self.as_raw(), &mut attr) })?;
        Ok(XrcDomain { inner: Arc::new(XrcdInner { raw, _ctx: self.inner.clone() }) })
    }
}
