//! eXtended Reliable Connection (XRC): domains and XRC shared receive queues.
//!
//! Every entry point checks `IBV_DEVICE_XRC` in the device's capability flags first and returns
//! [`Error::Unsupported`] naming it when the device lacks it (SoftRoCE does).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::device::{Context, ContextInner};
use crate::error::{cvt_p, Error, Result};
use crate::pd::ProtectionDomain;
use crate::queue::cq::CompletionQueue;
use crate::queue::srq::{check_depth, srq_id_for, SharedReceiveQueue};

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

impl ProtectionDomain {
    /// Creates an XRC shared receive queue in `xrcd` whose completions go to `cq`
    /// (`ibv_create_srq_ex()` with `IBV_SRQT_XRC`). Posting and buffer ownership are those of
    /// any [`SharedReceiveQueue`]; remote XRC senders name it by its SRQ number.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device lacks `IBV_DEVICE_XRC`;
    /// [`Error::InvalidArgument`] for a `cq` or `xrcd` of another device context than the
    /// protection domain; otherwise as [`create_srq`](Self::create_srq), or
    /// [`Error::CqTooSmall`] when `cq` cannot hold the
    /// SRQ's completions, [`Error::TooManyQueuePairs`] when `cq` already serves the most queues
    /// it can track.
    #[doc(alias = "ibv_create_srq_ex")]
    pub fn create_xrc_srq(
        &self,
        xrcd: &XrcDomain,
        cq: &CompletionQueue,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<SharedReceiveQueue> {
        const VERB: &str = "ibv_create_srq_ex";
        check_xrc(&self.context(), VERB)?;
        check_depth(max_wr, VERB)?;
        if !Arc::ptr_eq(&cq.inner.ctx, &self.inner.ctx) || !Arc::ptr_eq(&xrcd.inner._ctx, &self.inner.ctx) {
            return Err(Error::InvalidArgument {
                verb: VERB,
                reason: "the CQ or XRC domain belongs to another device context than the protection domain",
            });
        }
        use ffi::ibv_srq_init_attr_mask as M;
        // Written through the pointer of a zeroed MaybeUninit: the padding stays initialised (see
        // `create_srq`).
        let mut init = std::mem::MaybeUninit::<ffi::ibv_srq_init_attr_ex>::zeroed();
        let p = init.as_mut_ptr();
        // SAFETY: all-zero is a valid ibv_srq_init_attr_ex (null pointers and integers); valid
        // context, PD, XRC domain and CQ (all kept alive by the SRQ's Arcs).
        let raw = unsafe {
            (*p).attr.max_wr = max_wr;
            (*p).attr.max_sge = max_sge;
            (*p).comp_mask = M::IBV_SRQ_INIT_ATTR_TYPE.0
                | M::IBV_SRQ_INIT_ATTR_PD.0
                | M::IBV_SRQ_INIT_ATTR_XRCD.0
                | M::IBV_SRQ_INIT_ATTR_CQ.0;
            (*p).srq_type = ffi::ibv_srq_type::IBV_SRQT_XRC;
            (*p).pd = self.as_raw();
            (*p).xrcd = xrcd.as_raw();
            (*p).cq = cq.as_raw();
            ffi::ibv_create_srq_ex(self.inner.ctx.raw.as_ptr(), p)
        };
        let raw = cvt_p(VERB, raw)?;
        let id = srq_id_for(raw, VERB)?;
        let srq = SharedReceiveQueue::from_raw(
            id,
            raw,
            max_wr,
            max_sge,
            self.inner.clone(),
            Some(xrcd.inner.clone()),
        );
        // Its completions go to `cq`: attach there (dropping `srq` on failure destroys it).
        srq.inner.attach_to(&cq.inner, VERB)?;
        Ok(srq)
    }
}
