//! The devices librdmacm opened, as [`Context`]s ([`devices`], and an id's context): each held
//! open by a reference on librdmacm's device list.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use ibverbs_sys as ffi;

use crate::device::{Context, ContextInner};
use crate::error::{Error, Result};

/// A reference on librdmacm's device list (`rdma_get_devices()`), released with
/// `rdma_free_devices()`: while it lives, librdmacm does not close any device of the list.
struct DeviceAnchor {
    list: NonNull<*mut ffi::ibv_context>,
}

// SAFETY: the list is an array of pointers written once by librdmacm, only read and freed
// (under librdmacm's own lock).
unsafe impl Send for DeviceAnchor {}
// SAFETY: as above.
unsafe impl Sync for DeviceAnchor {}

impl DeviceAnchor {
    fn new() -> Result<DeviceAnchor> {
        // `devices()` needs no other object: with `dlopen`, where a missing librdmacm becomes an
        // error.
        ffi::load_rdmacm()?;
        let mut n = 0;
        // SAFETY: valid out-pointer; the list is freed once in Drop.
        let list = unsafe { ffi::rdma_get_devices(&mut n) };
        let list = NonNull::new(list).ok_or_else(|| Error::last_os("rdma_get_devices"))?;
        Ok(DeviceAnchor { list })
    }

    fn contexts(&self) -> Vec<NonNull<ffi::ibv_context>> {
        let mut out = Vec::new();
        for i in 0.. {
            // SAFETY: a NULL-terminated array of contexts.
            let p = unsafe { *self.list.as_ptr().add(i) };
            match NonNull::new(p) {
                Some(p) => out.push(p),
                None => break,
            }
        }
        out
    }
}

impl Drop for DeviceAnchor {
    fn drop(&mut self) {
        // SAFETY: the list came from rdma_get_devices and is freed once.
        unsafe { ffi::rdma_free_devices(self.list.as_ptr()) };
    }
}

/// The [`Context`]s librdmacm opened, by `ibv_context` address; each lives while anything of it
/// does (a `Weak` here does not keep it).
static CM_CONTEXTS: Mutex<Vec<(usize, Weak<ContextInner>)>> = Mutex::new(Vec::new());

/// librdmacm's context `raw` as a [`Context`]: the one already handed out, or a new one anchored
/// by a fresh `rdma_get_devices()` reference. `raw` must be valid now (an id bound to it lives).
pub(crate) fn cm_context(raw: NonNull<ffi::ibv_context>) -> Result<Context> {
    let mut cache = CM_CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    cache.retain(|(_, w)| w.strong_count() > 0);
    if let Some(inner) =
        cache.iter().find(|(p, _)| *p == raw.as_ptr() as usize).and_then(|(_, w)| w.upgrade())
    {
        return Ok(Context { inner });
    }
    let anchor = DeviceAnchor::new()?;
    if !anchor.contexts().contains(&raw) {
        return Err(Error::InvalidArgument {
            verb: "rdma_get_devices",
            reason: "the id's device is not in librdmacm's device list (removed?)",
        });
    }
    // SAFETY: a valid context (in the list we hold); its device's name is a C string.
    let name = unsafe { std::ffi::CStr::from_ptr(ffi::ibv_get_device_name((*raw.as_ptr()).device)) }
        .to_string_lossy()
        .into_owned();
    let inner = Arc::new(ContextInner::adopted(raw, name, Box::new(anchor)));
    cache.push((raw.as_ptr() as usize, Arc::downgrade(&inner)));
    Ok(Context { inner })
}

/// Every device librdmacm knows, as [`Context`]s usable with RDMA-CM ids
/// (`rdma_get_devices()`).
///
/// # Errors
/// [`Error::Verb`] from `rdma_get_devices()`; with the `dlopen` feature,
/// [`Error::LibraryMissing`] when librdmacm or libibverbs cannot be loaded.
#[doc(alias = "rdma_get_devices")]
pub fn devices() -> Result<Vec<Context>> {
    let anchor = DeviceAnchor::new()?;
    anchor.contexts().into_iter().map(cm_context).collect()
}
