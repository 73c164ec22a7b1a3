//! The `dlopen` feature: libibverbs (and librdmacm) loaded at run time, once per process.
//!
//! The build script generates, from bindgen's declarations, the tables `DlVerbs`/`DlCm` (one
//! `Option<unsafe extern "C" fn>` per function, `None` where the loaded library lacks the symbol),
//! a Rust function per C function that calls through them ([`verbs`], [`cm`]), and the trampolines
//! the C shim calls instead of the library's own symbols ([`verbs_for_c`], [`cm_for_c`]).
//!
//! # When a table is used without a successful load
//! Every function of the bindings loads its library on its first call: [`verbs`] and [`cm`]
//! load on demand, so raw `ffi` code that never calls [`load`](crate::load) works as if the
//! library were linked. They panic only when the library cannot be loaded. The safe crate calls
//! `load()` / `load_rdmacm()` at each of its entry points that can be a program's first call into
//! the libraries (the device list, RDMA-CM's event channel and device list, the `fork` functions,
//! the names of the verbs' enums), and turns a failure into its typed error; every other call of
//! the safe crate takes an object (a device of a list, a context, a channel, an id, ...) that
//! exists only after such a load succeeded. So safe code never reaches the panic: only raw `ffi`
//! calls without `load()` on a host without rdma-core do. The C shim's trampolines are reached
//! only through shim functions, which take such objects too; were one reached without the
//! library, it aborts with the same message (it cannot unwind into C).

use std::ffi::{c_void, CStr};
use std::io::Write as _;
use std::sync::OnceLock;

#[cfg(feature = "rdmacm")]
use crate::DlCm;
use crate::{DlVerbs, Library, LoadError};

/// The rdma-core version of the headers the bindings were generated from.
const BUILT_WITH: &str = env!("IBVERBS_SYS_RDMA_CORE");

static VERBS: OnceLock<Result<DlVerbs, LoadError>> = OnceLock::new();
#[cfg(feature = "rdmacm")]
static CM: OnceLock<Result<DlCm, LoadError>> = OnceLock::new();

/// `dlopen()`s `library` for good (the handle is never closed: the tables point into it).
fn open(library: Library) -> Result<*mut c_void, LoadError> {
    let name: &[u8] = match library {
        Library::Verbs => b"libibverbs.so.1\0",
        Library::RdmaCm => b"librdmacm.so.1\0",
    };
    // SAFETY: a NUL-terminated name. Local binding: librdmacm and libibverbs' providers find
    // libibverbs through their own dependency on it, which resolves to this copy.
    let handle = unsafe { libc::dlopen(name.as_ptr().cast(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror() returns this thread's message of the failed dlopen(), or NULL.
        let e = unsafe { libc::dlerror() };
        let reason = if e.is_null() {
            "dlopen() failed without a message".to_string()
        } else {
            // SAFETY: a NUL-terminated string, valid until the next dl* call of this thread.
            unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
        };
        return Err(LoadError::new(library, reason));
    }
    Ok(handle)
}

/// `dlsym(handle, name)`; NULL when the library lacks the symbol.
///
/// # Safety
/// `handle` is a live `dlopen()` handle; `name` ends with a NUL byte.
pub(crate) unsafe fn symbol(handle: *mut c_void, name: &[u8]) -> *mut c_void {
    debug_assert_eq!(name.last(), Some(&0));
    // SAFETY: the caller's contract.
    unsafe { libc::dlsym(handle, name.as_ptr().cast()) }
}

/// libibverbs' table, loaded on the first call.
pub(crate) fn load_verbs() -> &'static Result<DlVerbs, LoadError> {
    VERBS.get_or_init(|| {
        let handle = open(Library::Verbs)?;
        // SAFETY: a handle of libibverbs, never closed.
        let table = unsafe { DlVerbs::resolve(handle) };
        // rdma-core v28's, which the C shim calls (`ibv_reg_mr` with optional access flags).
        if table.ibv_reg_mr_iova2.is_none() {
            return Err(LoadError::new(
                Library::Verbs,
                "it has no ibv_reg_mr_iova2: rdma-core older than v28, the oldest this crate supports",
            ));
        }
        Ok(table)
    })
}

/// librdmacm's table (libibverbs' loaded first), loaded on the first call.
#[cfg(feature = "rdmacm")]
pub(crate) fn load_cm() -> &'static Result<DlCm, LoadError> {
    CM.get_or_init(|| {
        // librdmacm depends on libibverbs, and its functions take libibverbs' objects.
        if let Err(e) = load_verbs() {
            return Err(e.clone());
        }
        let handle = open(Library::RdmaCm)?;
        // SAFETY: a handle of librdmacm, never closed.
        Ok(unsafe { DlCm::resolve(handle) })
    })
}

pub(crate) fn verbs_loaded() -> bool {
    matches!(VERBS.get(), Some(Ok(_)))
}

#[cfg(feature = "rdmacm")]
pub(crate) fn cm_loaded() -> bool {
    matches!(CM.get(), Some(Ok(_)))
}

/// libibverbs' table for the Rust function `function`: loads the library on the first call and
/// panics if it cannot (see the module's docs for why safe code never gets here then).
#[inline]
pub(crate) fn verbs(function: &str) -> &'static DlVerbs {
    match load_verbs() {
        Ok(table) => table,
        Err(e) => not_loaded(function, e),
    }
}

/// librdmacm's table for the Rust function `function`: as [`verbs`].
#[cfg(feature = "rdmacm")]
#[inline]
pub(crate) fn cm(function: &str) -> &'static DlCm {
    match load_cm() {
        Ok(table) => table,
        Err(e) => not_loaded(function, e),
    }
}

/// libibverbs' table for the C shim's call of `function`: as [`verbs`], aborting instead of
/// panicking (a panic cannot unwind into C).
#[allow(dead_code)]
pub(crate) fn verbs_for_c(function: &str) -> &'static DlVerbs {
    match load_verbs() {
        Ok(table) => table,
        Err(e) => abort(format_args!("{}", NotLoaded(function, e))),
    }
}

/// librdmacm's table for the C shim's call of `function`: as [`verbs_for_c`].
#[cfg(feature = "rdmacm")]
#[allow(dead_code)]
pub(crate) fn cm_for_c(function: &str) -> &'static DlCm {
    match load_cm() {
        Ok(table) => table,
        Err(e) => abort(format_args!("{}", NotLoaded(function, e))),
    }
}

struct NotLoaded<'a>(&'a str, &'a LoadError);

impl std::fmt::Display for NotLoaded<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ibverbs_sys::{} called, but {} (call ibverbs_sys::load() first to get this as an error)",
            self.0, self.1
        )
    }
}

#[cold]
#[inline(never)]
fn not_loaded(function: &str, e: &LoadError) -> ! {
    panic!("{}", NotLoaded(function, e))
}

struct Missing(Library, &'static str);

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} has no function {}: the installed rdma-core is older than the one this program's bindings \
             come from (v{BUILT_WITH}); check ibverbs_sys::has_function() first, or upgrade rdma-core's {} package",
            self.0.soname(),
            self.1,
            self.0.package()
        )
    }
}

/// The loaded library lacks `function` (it is older than the headers): panics naming it.
#[cold]
#[inline(never)]
pub(crate) fn missing(library: Library, function: &'static str) -> ! {
    panic!("{}", Missing(library, function))
}

/// As [`missing`], for the C shim: aborts.
#[cold]
#[inline(never)]
#[allow(dead_code)]
pub(crate) fn missing_abort(library: Library, function: &'static str) -> ! {
    abort(format_args!("{}", Missing(library, function)))
}

#[cold]
fn abort(message: std::fmt::Arguments<'_>) -> ! {
    let _ = writeln!(std::io::stderr(), "fatal: {message}");
    std::process::abort()
}

/// The address of `name` in its library (`rdma_*` in librdmacm), loading it first.
pub(crate) fn address(name: &str) -> Option<*const c_void> {
    #[cfg(feature = "rdmacm")]
    if name.starts_with("rdma_") {
        return load_cm().as_ref().ok()?.address(name)?;
    }
    load_verbs().as_ref().ok()?.address(name)?
}
