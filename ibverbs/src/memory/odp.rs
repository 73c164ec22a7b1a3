//! On-demand paging: regions whose pages the device faults in as it touches them
//! ([`AccessFlags::ON_DEMAND`]), prefetch advice (`ibv_advise_mr`), and implicit ODP, one
//! registration over the whole address space ([`ImplicitOdpRegion`], `unsafe` to create).
//!
//! An ODP region is registered like any other ([`ProtectionDomain::register`] with
//! `AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND`): it owns its memory, so the safe
//! level's guarantees are unchanged; only the pinning is. The crate checks the device's ODP
//! capability first ([`DeviceAttrEx::odp`](crate::DeviceAttrEx::odp)) and answers
//! [`Error::Unsupported`] where it is missing (SoftRoCE on kernels before 6.10, siw).

use std::fmt;
use std::ops::RangeBounds;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::error::{cvt_p, Error, Result};
use crate::memory::keyed::KeyedMr;
use crate::memory::mr::{odp_caps, AccessFlags, MemoryRegion, MrInner, RemoteMemoryRegion};
use crate::pd::{PdInner, ProtectionDomain};

/// What [`MemoryRegion::advise`] asks of the device (`enum ib_uverbs_advise_mr_advice`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OdpAdvice {
    /// Fault the pages in for reading (`IBV_ADVISE_MR_ADVICE_PREFETCH`).
    Prefetch,
    /// Fault the pages in for writing (`IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE`).
    PrefetchWrite,
    /// Map only the pages already present, without faulting others in
    /// (`IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT`).
    PrefetchNoFault,
}

impl OdpAdvice {
    fn raw(self) -> ffi::ib_uverbs_advise_mr_advice {
        match self {
            OdpAdvice::Prefetch => ffi::ib_uverbs_advise_mr_advice::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH,
            OdpAdvice::PrefetchWrite => {
                ffi::ib_uverbs_advise_mr_advice::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_WRITE
            }
            OdpAdvice::PrefetchNoFault => {
                ffi::ib_uverbs_advise_mr_advice::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT
            }
        }
    }
}

/// `ibv_advise_mr()` over bytes `range` of one region.
fn advise(
    mr: &MrInner,
    pd: &Arc<PdInner>,
    advice: OdpAdvice,
    range: impl RangeBounds<usize>,
    flush: bool,
) -> Result<()> {
    const VERB: &str = "ibv_advise_mr";
    if !mr.access().contains(AccessFlags::ON_DEMAND) {
        return Err(Error::InvalidArgument {
            verb: VERB,
            reason: "the region was not registered with ON_DEMAND",
        });
    }
    let (offset, len) = mr.range(VERB, range)?;
    let length = u32::try_from(len).map_err(|_| Error::InvalidArgument {
        verb: VERB,
        reason: "a scatter/gather entry is at most 4 GiB - 1",
    })?;
    let mut sge =
        ffi::ibv_sge { addr: mr.device_addr(mr.addr()).wrapping_add(offset as u64), length, lkey: mr.lkey() };
    let flags = if flush { ffi::ib_uverbs_advise_mr_flag::IB_UVERBS_ADVISE_MR_FLAG_FLUSH.0 } else { 0 };
    // SAFETY: valid PD (the region holds it); one SGE naming bytes of this region by its own lkey
    // (a hint: the device only maps pages of the region, it moves no data).
    let ret = unsafe { ffi::ibv_advise_mr(pd.raw.as_ptr(), advice.raw(), flags, &mut sge, 1) };
    crate::error::cvt(VERB, ret).map_err(|e| e.or_unsupported("memory-region advice (ibv_advise_mr)"))
}

impl MemoryRegion {
    /// Advises the device about bytes `range` of an on-demand-paged region (`ibv_advise_mr()`),
    /// e.g. to fault them in before the first transfer; with `flush`, the call returns once done.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a region without [`AccessFlags::ON_DEMAND`] or a range of
    /// 4 GiB or more, [`Error::OutOfBounds`], [`Error::Unsupported`] where the provider lacks
    /// the verb, [`Error::Verb`] when it fails otherwise.
    #[doc(alias = "ibv_advise_mr")]
    pub fn advise(&self, advice: OdpAdvice, range: impl RangeBounds<usize>, flush: bool) -> Result<()> {
        advise(&self.inner, self.inner.pd(), advice, range, flush)
    }
}

impl RemoteMemoryRegion {
    /// As [`MemoryRegion::advise`] (`ibv_advise_mr()`).
    ///
    /// # Errors
    /// As [`MemoryRegion::advise`].
    #[doc(alias = "ibv_advise_mr")]
    pub fn advise(&self, advice: OdpAdvice, range: impl RangeBounds<usize>, flush: bool) -> Result<()> {
        advise(&self.inner, self.inner.pd(), advice, range, flush)
    }
}

/// An implicit on-demand-paging region: one registration whose keys reach **every byte of the
/// process's address space** (`ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND | ...)`).
///
/// It owns no memory and the safe posting level never uses it: its keys are for the `unsafe`
/// raw level and for peers, under the contract of
/// [`ProtectionDomain::register_implicit_odp`]. Dropping it deregisters it (`ibv_dereg_mr()`).
pub struct ImplicitOdpRegion {
    mr: KeyedMr,
    access: AccessFlags,
}

impl ImplicitOdpRegion {
    /// The local key: an SGE may name any virtual address with it.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The remote key: with remote rights, a peer may reach any virtual address with it.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The rights it was registered with ([`AccessFlags::ON_DEMAND`] included).
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// The raw `struct ibv_mr *`; valid while this value lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.mr.as_raw()
    }
}

impl fmt::Debug for ImplicitOdpRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImplicitOdpRegion")
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .field("access", &self.access)
            .finish()
    }
}

impl ProtectionDomain {
    /// Registers the whole address space as one implicit on-demand-paging region
    /// (`ibv_reg_mr(pd, NULL, SIZE_MAX, access | IBV_ACCESS_ON_DEMAND)`), after checking the
    /// device's `IBV_ODP_SUPPORT_IMPLICIT`.
    ///
    /// # Safety
    /// The region's keys reach any virtual address of the process. The caller must ensure that
    /// every use of them names only memory that is valid, and not accessed in a conflicting way
    /// by Rust code, for as long as the device may access it:
    /// - every work request posted (at the `unsafe` level) with [`lkey`](ImplicitOdpRegion::lkey)
    ///   satisfies the `# Safety` contract of that raw post for the bytes its SGEs name;
    /// - with any remote right in `access` ([`AccessFlags::REMOTE_WRITE`],
    ///   [`AccessFlags::REMOTE_READ`], [`AccessFlags::REMOTE_ATOMIC`]), every peer given the
    ///   [`rkey`](ImplicitOdpRegion::rkey) only reads memory the process lets it read, and only
    ///   writes memory no Rust reference covers and no allocation will reuse while it may write,
    ///   until this region is dropped (a peer holding the rkey is then refused).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device lacks implicit ODP, [`Error::InvalidArgument`] for
    /// unknown flag bits, [`Error::Verb`] from `ibv_reg_mr()`.
    #[doc(alias = "ibv_reg_mr")]
    pub unsafe fn register_implicit_odp(&self, access: AccessFlags) -> Result<ImplicitOdpRegion> {
        const VERB: &str = "ibv_reg_mr";
        let access = access | AccessFlags::ON_DEMAND;
        let flags = libc::c_int::try_from(access.bits())
            .map_err(|_| Error::InvalidArgument { verb: VERB, reason: "unknown access flag bits" })?;
        if !odp_caps(self, VERB)?.implicit() {
            return Err(Error::Unsupported {
                verb: VERB,
                capability: "implicit on-demand paging (IBV_ODP_SUPPORT_IMPLICIT)",
            });
        }
        // SAFETY: valid PD; NULL/SIZE_MAX is the documented implicit-ODP form; what the keys may
        // reach is the caller's contract.
        let raw = unsafe { ffi::ibv_reg_mr(self.as_raw(), std::ptr::null_mut(), usize::MAX, flags) };
        let raw = cvt_p(VERB, raw).map_err(|e| e.or_unsupported("implicit on-demand paging"))?;
        Ok(ImplicitOdpRegion { mr: KeyedMr::new(raw, self.inner.clone()), access })
    }
}
