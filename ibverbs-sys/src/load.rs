//! Whether the libraries are there: with the `dlopen` feature they are loaded at run time, on the
//! first call (or [`load`]), and their absence is a [`LoadError`]; without it they are linked, the
//! program does not start without them, and these functions only say that all is well.

use std::fmt;

/// A library of rdma-core that this crate binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Library {
    /// libibverbs (`libibverbs.so.1`): the verbs.
    Verbs,
    /// librdmacm (`librdmacm.so.1`): RDMA-CM, with the `rdmacm` feature.
    RdmaCm,
}

impl Library {
    /// The file the dynamic loader looks for: `"libibverbs.so.1"` or `"librdmacm.so.1"`.
    pub const fn soname(self) -> &'static str {
        match self {
            Library::Verbs => "libibverbs.so.1",
            Library::RdmaCm => "librdmacm.so.1",
        }
    }

    /// The Debian/Ubuntu package (built from rdma-core) that installs it: `"libibverbs1"` or
    /// `"librdmacm1"`.
    pub const fn package(self) -> &'static str {
        match self {
            Library::Verbs => "libibverbs1",
            Library::RdmaCm => "librdmacm1",
        }
    }

    /// The Fedora/RHEL package that installs it: `"libibverbs"` or `"librdmacm"`.
    pub const fn rpm_package(self) -> &'static str {
        match self {
            Library::Verbs => "libibverbs",
            Library::RdmaCm => "librdmacm",
        }
    }
}

/// A library could not be loaded (feature `dlopen`): which one, and the dynamic loader's reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    library: Library,
    reason: String,
}

impl LoadError {
    /// An error for `library`, for `reason`.
    pub fn new(library: Library, reason: impl Into<String>) -> LoadError {
        LoadError { library, reason: reason.into() }
    }

    /// The library that is missing (or unusable).
    pub fn library(&self) -> Library {
        self.library
    }

    /// Why: `dlerror()`'s text (e.g. `"libibverbs.so.1: cannot open shared object file: No such
    /// file or directory"`), or what the loaded library lacks.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = self.library;
        write!(
            f,
            "{} could not be loaded ({}): install rdma-core's {} package ({} on Fedora/RHEL)",
            l.soname(),
            self.reason,
            l.package(),
            l.rpm_package()
        )
    }
}

impl std::error::Error for LoadError {}

/// Whether this build loads the libraries at run time (the `dlopen` feature).
pub const DLOPEN: bool = cfg!(feature = "dlopen");

/// Makes libibverbs callable. With the `dlopen` feature: loads `libibverbs.so.1` on the first
/// call (every function of the bindings also does on its first call), and returns what that
/// first attempt gave, on every call: a failure is not retried. Without it: `Ok(())`, the library
/// is linked.
///
/// # Errors
/// [`LoadError`] naming the library when `dlopen()` fails, or when the library is older than
/// rdma-core v28 (no `ibv_reg_mr_iova2`), the oldest this crate supports.
#[inline]
pub fn load() -> Result<(), LoadError> {
    #[cfg(feature = "dlopen")]
    {
        crate::dl::load_verbs().as_ref().map(|_| ()).map_err(Clone::clone)
    }
    #[cfg(not(feature = "dlopen"))]
    {
        Ok(())
    }
}

/// Makes librdmacm (and libibverbs, which it needs) callable: as [`load`], for
/// `librdmacm.so.1` after `libibverbs.so.1`.
///
/// # Errors
/// [`LoadError`] naming the first library that could not be loaded.
#[cfg(feature = "rdmacm")]
#[inline]
pub fn load_rdmacm() -> Result<(), LoadError> {
    #[cfg(feature = "dlopen")]
    {
        crate::dl::load_cm().as_ref().map(|_| ()).map_err(Clone::clone)
    }
    #[cfg(not(feature = "dlopen"))]
    {
        Ok(())
    }
}

/// Whether libibverbs is callable now: always without `dlopen`; with it, once a load succeeded
/// (this does not try one).
#[inline]
pub fn is_loaded() -> bool {
    #[cfg(feature = "dlopen")]
    {
        crate::dl::verbs_loaded()
    }
    #[cfg(not(feature = "dlopen"))]
    {
        true
    }
}

/// Whether librdmacm is callable now: as [`is_loaded`].
#[cfg(feature = "rdmacm")]
#[inline]
pub fn is_rdmacm_loaded() -> bool {
    #[cfg(feature = "dlopen")]
    {
        crate::dl::cm_loaded()
    }
    #[cfg(not(feature = "dlopen"))]
    {
        true
    }
}

/// Whether the function `name` of the bindings can be called. With `dlopen`: whether the loaded
/// library has it (loading the library first, `rdma_*` names from librdmacm): a library older than
/// the headers the crate was built with lacks the newer functions, and calling one of them panics
/// naming it. Without `dlopen` every function of the bindings was linked at build time: `true`
/// (the name is not looked up).
#[inline]
pub fn has_function(name: &str) -> bool {
    #[cfg(feature = "dlopen")]
    {
        function_address(name).is_some()
    }
    #[cfg(not(feature = "dlopen"))]
    {
        let _ = name;
        true
    }
}

/// The address of the function `name` in the loaded library (loading it first), as `dlsym()`
/// found it: `None` when the library cannot be loaded, lacks it, or the bindings do not declare
/// it. Feature `dlopen` (without it, take the address of the function itself).
#[cfg(feature = "dlopen")]
pub fn function_address(name: &str) -> Option<*const core::ffi::c_void> {
    crate::dl::address(name)
}

/// The functions this crate looks up with `dlsym()`: every function of the bindings except the
/// C shim's (`static inline` verbs and macros, compiled into this crate), plus the exported
/// functions behind `verbs.h`'s macros that the shim calls. Feature `dlopen`.
#[cfg(feature = "dlopen")]
pub fn dynamic_functions() -> impl Iterator<Item = (Library, &'static str)> {
    let verbs = crate::VERBS_FUNCTIONS.iter().map(|n| (Library::Verbs, *n));
    #[cfg(feature = "rdmacm")]
    let verbs = verbs.chain(crate::CM_FUNCTIONS.iter().map(|n| (Library::RdmaCm, *n)));
    verbs
}
