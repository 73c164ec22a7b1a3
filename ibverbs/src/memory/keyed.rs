//! [`KeyedMr`]: a registration that owns no process memory — implicit ODP, on-device memory,
//! dma-buf regions — reduced to what all of them have: keys, a raw handle and deregistration.

use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::pd::PdInner;

/// A registered `struct ibv_mr` whose memory is not this process's to manage: deregistered
/// (`ibv_dereg_mr()`) when dropped, its protection domain kept alive until then.
pub(crate) struct KeyedMr {
    raw: NonNull<ffi::ibv_mr>,
    _pd: Arc<PdInner>,
}

// SAFETY: an opaque kernel handle, usable from any thread; only plain fields are read.
unsafe impl Send for KeyedMr {}
// SAFETY: as above.
unsafe impl Sync for KeyedMr {}

impl KeyedMr {
    /// Takes ownership of `raw`, registered in `pd`.
    pub(crate) fn new(raw: NonNull<ffi::ibv_mr>, pd: Arc<PdInner>) -> KeyedMr {
        KeyedMr { raw, _pd: pd }
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: valid MR while self lives; a plain field written at registration.
        unsafe { (*self.raw.as_ptr()).lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.raw.as_ptr()).rkey }
    }

    pub(crate) fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.raw.as_ptr()
    }

    /// Whether it was registered in `pd`.
    pub(crate) fn in_pd(&self, pd: &Arc<PdInner>) -> bool {
        Arc::ptr_eq(&self._pd, pd)
    }
}

impl Drop for KeyedMr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once. The memory is not ours: a failure leaks
        // only the kernel object. Raw posts over the region are their caller's contract to
        // finish first.
        unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
    }
}
