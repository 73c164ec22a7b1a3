//! Memory regions over a dma-buf (`ibv_reg_dmabuf_mr`): memory another driver exports as a
//! file descriptor — a GPU's memory, for GPUDirect RDMA as NCCL uses it — registered so the RDMA
//! device reads and writes it directly.
//!
//! The memory belongs to the exporting driver and is not in the process's address space as far
//! as Rust is concerned (mapping a dma-buf is `unsafe` in Rust): the crate never hands out a
//! reference into it. Registration takes the kernel's own reference on the dma-buf, so the
//! descriptor may be closed afterwards.

use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd};

use ibverbs_sys as ffi;

use crate::error::{Error, Result};
use crate::memory::keyed::KeyedMr;
use crate::memory::mr::AccessFlags;
use crate::memory::remote::RemoteSlice;
use crate::pd::ProtectionDomain;

/// A registered range of a dma-buf (`ibv_reg_dmabuf_mr()`), for safe posts as an
/// `Arc<DmabufRegion>` ([`LocalBuf::Dmabuf`](crate::LocalBuf::Dmabuf): `Local::whole(Arc::new(region))`
/// or a range of it, as the source of Sends and RDMA Writes and, registered with
/// [`AccessFlags::LOCAL_WRITE`], the target of receives, RDMA Reads and atomics), for the
/// `unsafe` raw level (SGEs of `iova`-based addresses with [`lkey`](Self::lkey)) and for peers
/// ([`remote`](Self::remote)). Deregistered when dropped (a post's `Arc` keeps it registered
/// until its completion).
///
/// Safe posts may share it, also for device writes: the crate never hands out a reference into
/// its memory (it is not in Rust's address space), so nothing in Rust can observe a write in
/// progress; what the bytes are is between the exporter and the device. It is never posted
/// inline and never prepared ([`QueuePair::prepare_send`](crate::QueuePair::prepare_send)
/// refuses it).
pub struct DmabufRegion {
    mr: KeyedMr,
    iova: u64,
    len: usize,
    access: AccessFlags,
}

impl ProtectionDomain {
    /// Registers `len` bytes at `offset` of the dma-buf `fd` (`ibv_reg_dmabuf_mr()`); the
    /// device and peers address them from `iova`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a length of 0 or unknown flag bits;
    /// [`Error::Unsupported`] where the provider (or the rdma-core the crate was built against,
    /// before v34) lacks dma-buf registration — SoftRoCE and siw do; [`Error::Verb`] otherwise
    /// (e.g. `EINVAL` or `EBADF` for a descriptor that is not a dma-buf).
    #[doc(alias = "ibv_reg_dmabuf_mr")]
    pub fn register_dmabuf(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<DmabufRegion> {
        const VERB: &str = "ibv_reg_dmabuf_mr";
        if len == 0 {
            return Err(Error::InvalidArgument { verb: VERB, reason: "zero-length memory region" });
        }
        let flags = libc::c_int::try_from(access.bits())
            .map_err(|_| Error::InvalidArgument { verb: VERB, reason: "unknown access flag bits" })?;
        // With `dlopen` the libibverbs loaded may be older than the headers (v34 added the verb).
        #[cfg(ibverbs_has_reg_dmabuf_mr)]
        if ffi::has_function("ibv_reg_dmabuf_mr") {
            // SAFETY: valid PD; `fd` is an open descriptor for the duration of the call (the
            // kernel takes its own reference to the dma-buf); no process memory is named.
            let raw =
                unsafe { ffi::ibv_reg_dmabuf_mr(self.as_raw(), offset, len, iova, fd.as_raw_fd(), flags) };
            let raw = crate::error::cvt_p(VERB, raw).map_err(|e| e.or_unsupported("dma-buf registration"))?;
            return Ok(DmabufRegion { mr: KeyedMr::new(raw, self.inner.clone()), iova, len, access });
        }
        let _ = (fd.as_raw_fd(), offset, iova, flags);
        Err(Error::Unsupported { verb: VERB, capability: "dma-buf registration (rdma-core before v34)" })
    }
}

impl DmabufRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The address the device and peers use for its first byte.
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    /// The rights it was registered with.
    pub fn access(&self) -> AccessFlags {
        self.access
    }
    /// A descriptor for a peer: IOVA, length and rkey.
    pub fn remote(&self) -> RemoteSlice {
        RemoteSlice { addr: self.iova, len: self.len as u64, rkey: self.rkey() }
    }
    /// The raw `struct ibv_mr *`; valid while this value lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.mr.as_raw()
    }
    /// Whether it was registered in `pd`.
    pub(crate) fn in_pd(&self, pd: &std::sync::Arc<crate::pd::PdInner>) -> bool {
        self.mr.in_pd(pd)
    }
}

impl fmt::Debug for DmabufRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmabufRegion").field("iova", &self.iova).field("len", &self.len).finish()
    }
}
