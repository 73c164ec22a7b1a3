//! Host test of the `dlopen` feature: the libraries load, every function the bindings declare is
//! found in the library the loader looks in (this host's rdma-core is the one the headers come
//! from), and a function looked up by name is the library's own.
#![cfg(feature = "dlopen")]

use ibverbs_sys::Library;

/// The feature is on in this build.
const _: () = assert!(ibverbs_sys::DLOPEN);

#[test]
fn the_libraries_load_and_have_every_bound_function() {
    ibverbs_sys::load().expect("libibverbs.so.1 loads on a host with rdma-core");
    assert!(ibverbs_sys::is_loaded());
    #[cfg(feature = "rdmacm")]
    {
        ibverbs_sys::load_rdmacm().expect("librdmacm.so.1 loads on a host with rdma-core");
        assert!(ibverbs_sys::is_rdmacm_loaded());
    }
    let mut n = 0;
    let missing: Vec<_> = ibverbs_sys::dynamic_functions()
        .inspect(|_| n += 1)
        .filter(|(_, name)| !ibverbs_sys::has_function(name))
        .collect();
    assert!(missing.is_empty(), "not found in the library the loader looks in: {missing:?}");
    assert!(n >= 50, "only {n} functions are loaded: the build script's split is broken?");
    let libs: Vec<Library> = ibverbs_sys::dynamic_functions().map(|(l, _)| l).collect();
    assert!(libs.contains(&Library::Verbs));
    assert_eq!(libs.contains(&Library::RdmaCm), cfg!(feature = "rdmacm"));
    assert!(!ibverbs_sys::has_function("ibv_no_such_verb"));
    assert!(!ibverbs_sys::has_function("ibv_post_send"), "a shim function, not looked up");
}

#[test]
fn a_function_resolves_to_the_library_and_is_callable() {
    let addr = ibverbs_sys::function_address("ibv_get_device_list").expect("ibv_get_device_list");
    // SAFETY: a valid address of a loaded object; dladdr fills `info`.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    assert_ne!(unsafe { libc::dladdr(addr, &mut info) }, 0);
    // SAFETY: dladdr returned a NUL-terminated name.
    let file = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    assert!(file.contains("libibverbs.so"), "{file}");
    // A call through the table: this host has no device, or some; either way a valid list.
    let mut n = -1;
    // SAFETY: a valid out-pointer; the list is freed below.
    let list = unsafe { ibverbs_sys::ibv_get_device_list(&mut n) };
    if !list.is_null() {
        assert!(n >= 0);
        // SAFETY: the list just returned.
        unsafe { ibverbs_sys::ibv_free_device_list(list) };
    }
    // A string helper, with no object.
    // SAFETY: returns a static string for any value.
    let s = unsafe {
        std::ffi::CStr::from_ptr(ibverbs_sys::ibv_wc_status_str(ibverbs_sys::ibv_wc_status::IBV_WC_SUCCESS))
    };
    assert_eq!(s.to_str().unwrap(), "success");
}

#[test]
fn a_load_error_names_the_library_and_its_package() {
    let e = ibverbs_sys::LoadError::new(Library::Verbs, "x: cannot open shared object file").to_string();
    assert!(e.starts_with("libibverbs.so.1 could not be loaded (x: cannot open shared object file)"), "{e}");
    assert!(e.contains("libibverbs1") && e.contains("rdma-core"), "{e}");
    assert_eq!(Library::RdmaCm.package(), "librdmacm1");
    assert_eq!(Library::RdmaCm.soname(), "librdmacm.so.1");
}
