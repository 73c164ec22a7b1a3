//! Build script of `ibverbs-sys`: find rdma-core, run bindgen over its headers and compile the C shim
//! that gives every `static inline` verb and function-like macro of `infiniband/verbs.h` a real symbol.
//!
//! Library lookup, in order:
//! 1. `IBVERBS_INCLUDE_DIR` / `IBVERBS_LIB_DIR` (both optional, either one switches pkg-config off);
//! 2. pkg-config `libibverbs` and `librdmacm`, at least [`MIN_LIBIBVERBS`];
//! 3. a panic that names the packages to install.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

/// Oldest libibverbs accepted (rdma-core v28: `ibv_reg_mr_iova2` and the `ibv_reg_mr` macro the
/// shim wraps). Verbs added later (`ibv_query_gid_ex`, v32) are gated by the safe crate's build.rs
/// on the exported version. pkg-config reports `1.<abi>.<rdma-core>.0`.
const MIN_LIBIBVERBS: &str = "1.8.28";
/// Suffix that the generated wrappers of `static inline` functions carry: `ibv_post_send` in C is
/// linked from `ibv_post_send__ibverbs_sys_shim`.
const SHIM_SUFFIX: &str = "__ibverbs_sys_shim";
/// Function-like macros of `verbs.h` wrapped by hand in `src/shim.c` (`ibverbs_sys_<name minus ibv_>`).
const MACRO_SHIMS: &[&str] = &["ibv_query_port", "ibv_reg_mr", "ibv_reg_mr_iova"];

const INSTALL_HINT: &str = "\
ibverbs-sys needs the rdma-core development files (libibverbs and librdmacm headers, libraries and
pkg-config files) and libclang for bindgen. Install them with:
    Debian/Ubuntu:  sudo apt-get install libibverbs-dev librdmacm-dev libclang-dev pkg-config
    Fedora/RHEL:    sudo dnf install rdma-core-devel clang-devel pkgconf-pkg-config
or point IBVERBS_INCLUDE_DIR (the folder holding infiniband/verbs.h) and IBVERBS_LIB_DIR (the folder
holding libibverbs.so) at an rdma-core build.";

/// Reads an environment variable and tells cargo to rerun when it changes.
fn env(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

struct Found {
    include_paths: Vec<PathBuf>,
    version: String,
}

fn find_library() -> Found {
    let inc = env("IBVERBS_INCLUDE_DIR");
    let lib = env("IBVERBS_LIB_DIR");
    if inc.is_some() || lib.is_some() {
        if let Some(lib) = &lib {
            println!("cargo:rustc-link-search=native={lib}");
        }
        println!("cargo:rustc-link-lib=ibverbs");
        println!("cargo:rustc-link-lib=rdmacm");
        let include_paths: Vec<PathBuf> = inc.into_iter().map(PathBuf::from).collect();
        let verbs_h = include_paths
            .iter()
            .map(|p| p.join("infiniband/verbs.h"))
            .chain(std::iter::once(PathBuf::from("/usr/include/infiniband/verbs.h")))
            .find(|p| p.exists());
        if verbs_h.is_none() {
            panic!("\nIBVERBS_INCLUDE_DIR does not hold infiniband/verbs.h.\n\n{INSTALL_HINT}\n");
        }
        // No pkg-config file to ask: the version is unknown, report the minimum we need.
        return Found { include_paths, version: MIN_LIBIBVERBS.to_string() };
    }

    let verbs = pkg_config::Config::new().atleast_version(MIN_LIBIBVERBS).probe("libibverbs");
    let cm = pkg_config::Config::new().probe("librdmacm");
    match (verbs, cm) {
        (Ok(verbs), Ok(cm)) => {
            let mut include_paths = verbs.include_paths;
            include_paths.extend(cm.include_paths);
            Found { include_paths, version: verbs.version }
        }
        (Err(e), _) | (_, Err(e)) => panic!(
            "\nCould not find rdma-core (libibverbs >= {MIN_LIBIBVERBS} and librdmacm) with pkg-config:\n{e}\n\n{INSTALL_HINT}\n"
        ),
    }
}

fn header_path(include_paths: &[PathBuf], rel: &str) -> PathBuf {
    include_paths
        .iter()
        .map(|p| p.join(rel))
        .chain(std::iter::once(Path::new("/usr/include").join(rel)))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("\n{rel} not found in {include_paths:?}\n\n{INSTALL_HINT}\n"))
}

fn main() {
    println!("cargo:rerun-if-changed=src/shim.c");
    println!("cargo:rerun-if-changed=src/wrapper.h");
    let found = find_library();
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let verbs_h = header_path(&found.include_paths, "infiniband/verbs.h");
    println!("cargo:rerun-if-changed={}", verbs_h.display());

    // The rdma-core version, for dependents (`DEP_IBVERBS_VERSION`, `DEP_IBVERBS_RDMA_CORE`) and for
    // the coverage test (which header was bound).
    println!("cargo:version={}", found.version);
    let rdma_core = found.version.split('.').nth(2).unwrap_or("0");
    println!("cargo:rdma_core={rdma_core}");
    println!("cargo:rustc-env=IBVERBS_SYS_VERBS_H={}", verbs_h.display());
    let cma_h = header_path(&found.include_paths, "rdma/rdma_cma.h");
    println!("cargo:rerun-if-changed={}", cma_h.display());
    println!("cargo:rustc-env=IBVERBS_SYS_RDMA_CMA_H={}", cma_h.display());

    let extern_c = out.join("static_fns.c");
    let mut builder = bindgen::Builder::default()
        .header("src/wrapper.h")
        .clang_args(found.include_paths.iter().map(|p| format!("-I{}", p.display())))
        .allowlist_function("ibv_.*|rdma_.*|_ibv_.*|verbs_.*")
        .allowlist_type("ibv_.*|rdma_.*|verbs_.*|ib_uverbs_.*")
        .allowlist_var("IBV_.*|RDMA_.*")
        // Values a provider or the kernel writes must be sound for any bit pattern: newtypes, never
        // Rust enums.
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
        .bitfield_enum("ibv_.*_(flags|mask|caps|cap_flags|bits|fields|flags2)")
        .bitfield_enum("ibv_(access_flags|send_flags|wc_flags|qp_attr_mask|rx_hash_fields|raw_packet_caps)")
        .derive_default(true)
        .derive_debug(true)
        .impl_debug(false)
        .prepend_enum_name(false)
        .layout_tests(true)
        .generate_comments(true)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&extern_c)
        .wrap_static_fns_suffix(SHIM_SUFFIX)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    // The compatibility symbols under the macros' names have other semantics than the macros
    // (`ibv_query_port`'s takes a shorter struct): declare the shim versions by hand instead.
    for m in MACRO_SHIMS {
        builder = builder.blocklist_function(m);
    }
    let bindings = builder
        .generate()
        .unwrap_or_else(|e| panic!("\nbindgen failed on infiniband/verbs.h: {e}\n\n{INSTALL_HINT}\n"));
    bindings.write_to_file(out.join("bindings.rs")).expect("writing bindings.rs");

    // Compile the generated wrappers of `static inline` functions plus the hand-written macro shims.
    let generated = fs::read_to_string(&extern_c).expect("bindgen did not write the static fn wrappers");
    let mut wrapped: Vec<String> = generated
        .lines()
        .filter_map(|l| {
            let end = l.find(SHIM_SUFFIX)?;
            let start = l[..end].rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
            Some(l[start..end].to_string())
        })
        .collect();
    wrapped.extend(MACRO_SHIMS.iter().map(|s| s.to_string()));
    wrapped.sort();
    wrapped.dedup();

    let mut build = cc::Build::new();
    build.file(&extern_c).file("src/shim.c").include(".").include("src").warnings(false);
    for p in &found.include_paths {
        build.include(p);
    }
    build.compile("ibverbs_sys_shim");

    // Record what the shim covers, for the coverage test, and a function that takes the address of
    // every wrapped binding (proves each one links).
    let mut list = String::from("/// Every `static inline` function and function-like macro of `verbs.h` given a symbol by the C shim.\npub const SHIM_FUNCTIONS: &[&str] = &[\n");
    let mut addrs = String::from("/// The address of every binding in [`SHIM_FUNCTIONS`], by name (proves each one links).\n#[doc(hidden)]\npub fn shim_symbol_addresses() -> [(&'static str, usize); SHIM_FUNCTIONS.len()] {\n    [\n");
    for w in &wrapped {
        writeln!(list, "    \"{w}\",").unwrap();
        writeln!(addrs, "        (\"{w}\", {w} as *const () as usize),").unwrap();
    }
    list.push_str("];\n");
    addrs.push_str("    ]\n}\n");
    fs::write(out.join("shim_list.rs"), list + &addrs).unwrap();
}
