//! Protection domains.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::device::{Context, ContextInner};
use crate::error::{cvt_p, Result};

pub(crate) struct PdInner {
    pub(crate) raw: NonNull<ffi::ibv_pd>,
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: a PD is an opaque kernel handle; rdma-core allows using it (creating MRs, QPs, AHs in
// it) from any thread concurrently.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR, QP and AH of this PD holds an Arc of this inner, so none is left; the
        // PD is deallocated once. A failure (EBUSY) cannot happen then; it would only leak.
        unsafe { ffi::ibv_dealloc_pd(self.raw.as_ptr()) };
    }
}

/// A protection domain (`struct ibv_pd`): memory regions, queue pairs and address handles in one
/// PD can be used together.
///
/// Cloning is cheap (an `Arc`); the PD is deallocated (`ibv_dealloc_pd()`) when the last clone and
/// the last object created in it are gone, and it keeps its [`Context`] open until then.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: the PD is valid while self lives; handle is a plain field.
        let handle = unsafe { (*self.inner.raw.as_ptr()).handle };
        f.debug_struct("ProtectionDomain").field("handle", &handle).finish()
    }
}

impl ProtectionDomain {
    pub(crate) fn new(ctx: &Context) -> Result<ProtectionDomain> {
        // A provider may fail without setting errno: not an earlier call's.
        crate::error::clear_errno();
        // SAFETY: valid context; the PD is deallocated once in PdInner::drop.
        let raw = cvt_p("ibv_alloc_pd", unsafe { ffi::ibv_alloc_pd(ctx.as_raw()) })?;
        Ok(ProtectionDomain { inner: Arc::new(PdInner { raw, ctx: ctx.inner.clone() }) })
    }

    /// The context this PD belongs to.
    pub fn context(&self) -> Context {
        Context { inner: self.inner.ctx.clone() }
    }

    /// The raw `struct ibv_pd *`; valid while this PD (or any object created in it) lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.inner.raw.as_ptr()
    }
}

impl Context {
    /// Creates a protection domain (`ibv_alloc_pd()`).
    ///
    /// # Errors
    /// [`Error::Verb`](crate::Error::Verb) when the verb fails.
    #[doc(alias = "ibv_alloc_pd")]
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        ProtectionDomain::new(self)
    }
}
