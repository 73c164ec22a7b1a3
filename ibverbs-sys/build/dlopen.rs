//! The `dlopen` feature's half of the build script: bindgen's declarations of the libraries'
//! functions become calls through a table that `src/dl.rs` fills with `dlopen()`/`dlsym()`.
//!
//! bindgen runs as without the feature (same types, constants, shim wrappers). Then:
//! 1. [`split`] takes every function of libibverbs/librdmacm out of bindgen's `extern` blocks;
//!    the wrappers of the C shim (`link_name = "..__ibverbs_sys_shim"`) stay there: they are
//!    compiled into this crate and linked statically.
//! 2. [`generate`] writes, for each of those functions, a field of the library's table
//!    (`DlVerbs`, `DlCm`: `Option<unsafe extern "C" fn(..)>`, `None` when the loaded library lacks
//!    the symbol) and a Rust function of the same name and signature that calls through it, so
//!    `ffi::ibv_open_device(..)` reads as before.
//! 3. The C shim calls a few exported functions itself (the `static inline` verbs' fallbacks:
//!    `ibv_create_qp`, `ibv_query_device`, `_ibv_query_gid_ex`, the macros' `ibv_reg_mr`...).
//!    [`referenced`] finds them in the preprocessed C; the build compiles the C with each one
//!    renamed (`-Dibv_create_qp=ibverbs_sys_dl_ibv_create_qp`) and [`generate`] defines the
//!    renamed symbols as `extern "C"` trampolines through the table. No symbol of either library
//!    is left for the linker.

use std::collections::BTreeSet;

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// Prefix of the C shim's renamed references to library functions.
pub const RENAME_PREFIX: &str = "ibverbs_sys_dl_";

/// The exported functions behind `verbs.h`'s function-like macros (`ibv_query_port` takes the old
/// `struct _compat_ibv_port_attr`): bindgen does not bind them (the build blocklists the names),
/// but the macros call them, so the shim needs their trampolines. Signatures from `verbs.h`.
const MACRO_TARGETS: &str = r#"
extern "C" {
    pub fn ibv_query_port(
        context: *mut ibv_context,
        port_num: u8,
        port_attr: *mut ::core::ffi::c_void,
    ) -> ::core::ffi::c_int;
    pub fn ibv_reg_mr(
        pd: *mut ibv_pd,
        addr: *mut ::core::ffi::c_void,
        length: usize,
        access: ::core::ffi::c_int,
    ) -> *mut ibv_mr;
    pub fn ibv_reg_mr_iova(
        pd: *mut ibv_pd,
        addr: *mut ::core::ffi::c_void,
        length: usize,
        iova: u64,
        access: ::core::ffi::c_int,
    ) -> *mut ibv_mr;
}
"#;

/// Which library exports a function.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lib {
    Verbs,
    Cm,
}

/// A function of libibverbs or librdmacm, as bindgen declared it.
pub struct Function {
    name: String,
    lib: Lib,
    /// Its documentation (bindgen's `#[doc]` attributes).
    docs: Vec<syn::Attribute>,
    params: Vec<(syn::Ident, syn::Type)>,
    output: syn::ReturnType,
    /// Whether a Rust function of its name is generated (not for [`MACRO_TARGETS`]: the Rust
    /// names are the shim's macro wrappers).
    rust_api: bool,
}

impl Function {
    /// The C name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn from_foreign(f: syn::ForeignItemFn, rust_api: bool) -> Function {
        let name = f.sig.ident.to_string();
        if f.sig.variadic.is_some() {
            panic!("dlopen: {name} is variadic, which a Rust function cannot forward");
        }
        let params = f
            .sig
            .inputs
            .iter()
            .enumerate()
            .map(|(i, a)| match a {
                syn::FnArg::Typed(t) => {
                    let ident = match &*t.pat {
                        syn::Pat::Ident(p) if p.ident != "_" => p.ident.clone(),
                        _ => format_ident!("arg{}", i + 1),
                    };
                    (ident, (*t.ty).clone())
                }
                syn::FnArg::Receiver(_) => panic!("dlopen: {name} has a receiver"),
            })
            .collect();
        let lib = if name.starts_with("rdma_") { Lib::Cm } else { Lib::Verbs };
        let docs = f.attrs.into_iter().filter(|a| a.path().is_ident("doc")).collect();
        Function { name, lib, docs, params, output: f.sig.output, rust_api }
    }

    /// `Option<unsafe extern "C" fn(..) -> R>`.
    fn pointer_type(&self) -> TokenStream {
        let tys = self.params.iter().map(|(_, t)| t);
        let out = &self.output;
        quote!(::core::option::Option<unsafe extern "C" fn(#(#tys),*) #out>)
    }
}

/// The `link_name` of a foreign item, if it has one.
fn link_name(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find(|a| a.path().is_ident("link_name")).and_then(|a| match &a.meta {
        syn::Meta::NameValue(nv) => match &nv.value {
            syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

/// bindgen's bindings without the libraries' functions (pretty-printed), and those functions.
pub fn split(bindings: &str, shim_suffix: &str) -> (String, Vec<Function>) {
    let mut file: syn::File = syn::parse_str(bindings).expect("dlopen: parsing bindgen's output");
    let mut functions = Vec::new();
    for item in &mut file.items {
        let syn::Item::ForeignMod(block) = item else { continue };
        let items = std::mem::take(&mut block.items);
        for fi in items {
            match fi {
                syn::ForeignItem::Fn(f) => {
                    if let Some(l) = link_name(&f.attrs) {
                        if l.ends_with(shim_suffix) {
                            block.items.push(syn::ForeignItem::Fn(f));
                            continue;
                        }
                        panic!("dlopen: {} is linked as {l}, which the loader does not know", f.sig.ident);
                    }
                    functions.push(Function::from_foreign(f, true));
                }
                other => block.items.push(other),
            }
        }
    }
    file.items.retain(|i| !matches!(i, syn::Item::ForeignMod(b) if b.items.is_empty()));
    functions.sort_by(|a, b| a.name.cmp(&b.name));
    (prettyplease::unparse(&file), functions)
}

/// The functions behind the macros the shim wraps (see [`MACRO_TARGETS`]).
pub fn macro_targets() -> Vec<Function> {
    let block: syn::ItemForeignMod = syn::parse_str(MACRO_TARGETS).expect("dlopen: MACRO_TARGETS");
    block
        .items
        .into_iter()
        .map(|i| match i {
            syn::ForeignItem::Fn(f) => Function::from_foreign(f, false),
            _ => unreachable!(),
        })
        .collect()
}

/// The names of `candidates` that preprocessed C source refers to more than once: declared
/// and called (a function only declared appears once). Over-counting a name declared twice
/// only costs an unused trampoline; a call is never missed.
pub fn referenced(expanded: &[u8], candidates: &BTreeSet<String>) -> BTreeSet<String> {
    let text = String::from_utf8_lossy(expanded);
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for token in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if candidates.contains(token) {
            *counts.entry(token).or_default() += 1;
        }
    }
    counts.into_iter().filter(|&(_, n)| n >= 2).map(|(name, _)| name.to_string()).collect()
}

/// `dl_functions.rs`: the tables, their loaders, the Rust functions and the C shim's trampolines
/// (for the names in `for_c`, which must all be in `functions`).
pub fn generate(functions: &[Function], for_c: &BTreeSet<String>) -> String {
    for name in for_c {
        assert!(
            functions.iter().any(|f| &f.name == name),
            "dlopen: the C shim calls {name}, which the bindings do not declare: add it to MACRO_TARGETS"
        );
    }
    let mut out = TokenStream::new();
    for (lib, table, list) in [(Lib::Verbs, "DlVerbs", "VERBS_FUNCTIONS"), (Lib::Cm, "DlCm", "CM_FUNCTIONS")]
    {
        let fns: Vec<&Function> = functions.iter().filter(|f| f.lib == lib).collect();
        if fns.is_empty() && lib == Lib::Cm {
            // Without the `rdmacm` feature.
            continue;
        }
        let table = format_ident!("{table}");
        let list = format_ident!("{list}");
        let fields: Vec<_> = fns.iter().map(|f| format_ident!("{}", f.name)).collect();
        let types: Vec<_> = fns.iter().map(|f| f.pointer_type()).collect();
        let symbols: Vec<_> = fns
            .iter()
            .map(|f| proc_macro2::Literal::byte_string(format!("{}\0", f.name).as_bytes()))
            .collect();
        let names: Vec<_> = fns.iter().map(|f| f.name.as_str()).collect();
        let doc = match lib {
            Lib::Verbs => {
                "The functions of libibverbs, as `dlsym()` found them (`None`: not in the loaded library)."
            }
            Lib::Cm => {
                "The functions of librdmacm, as `dlsym()` found them (`None`: not in the loaded library)."
            }
        };
        out.extend(quote! {
            #[doc = #doc]
            #[allow(dead_code)]
            pub(crate) struct #table {
                #( pub(crate) #fields: #types, )*
            }

            impl #table {
                /// Looks every function up in `handle`.
                ///
                /// # Safety
                /// `handle` is a live `dlopen()` handle of the library, never closed.
                pub(crate) unsafe fn resolve(handle: *mut ::core::ffi::c_void) -> #table {
                    #table {
                        // SAFETY: each symbol is the C function of that name, whose signature
                        // bindgen read from the header; `Option<fn>` is a nullable pointer.
                        #( #fields: unsafe {
                            ::core::mem::transmute::<*mut ::core::ffi::c_void, #types>(
                                crate::dl::symbol(handle, #symbols))
                        }, )*
                    }
                }

                /// The address of function `name` in the loaded library: `None` when the
                /// bindings do not declare it, `Some(None)` when the library lacks it.
                #[allow(dead_code)]
                pub(crate) fn address(&self, name: &str) -> Option<Option<*const ::core::ffi::c_void>> {
                    match name {
                        #( #names => Some(self.#fields.map(|f| f as *const ::core::ffi::c_void)), )*
                        _ => None,
                    }
                }
            }

            /// The names of the functions of the table.
            #[allow(dead_code)]
            pub(crate) const #list: &[&str] = &[#(#names),*];
        });
        let (table_of, table_for_c) = match lib {
            Lib::Verbs => (quote!(crate::dl::verbs), quote!(crate::dl::verbs_for_c)),
            Lib::Cm => (quote!(crate::dl::cm), quote!(crate::dl::cm_for_c)),
        };
        let library = match lib {
            Lib::Verbs => quote!(crate::Library::Verbs),
            Lib::Cm => quote!(crate::Library::RdmaCm),
        };
        for f in &fns {
            let name = format_ident!("{}", f.name);
            let name_str = &f.name;
            let params: Vec<_> = f.params.iter().map(|(i, t)| quote!(#i: #t)).collect();
            let args: Vec<_> = f.params.iter().map(|(i, _)| i).collect();
            let out_ty = &f.output;
            if f.rust_api {
                let docs = &f.docs;
                out.extend(quote! {
                    #(#docs)*
                    #[inline]
                    pub unsafe fn #name(#(#params),*) #out_ty {
                        match #table_of(#name_str).#name {
                            // SAFETY: the caller keeps the C function's contract.
                            Some(__ibverbs_sys_f) => unsafe { __ibverbs_sys_f(#(#args),*) },
                            None => crate::dl::missing(#library, #name_str),
                        }
                    }
                });
            }
            if for_c.contains(&f.name) {
                let tramp = format_ident!("{RENAME_PREFIX}{}", f.name);
                out.extend(quote! {
                    #[doc(hidden)]
                    #[no_mangle]
                    pub unsafe extern "C" fn #tramp(#(#params),*) #out_ty {
                        match #table_for_c(#name_str).#name {
                            // SAFETY: the C shim calls it as the header declares it.
                            Some(__ibverbs_sys_f) => unsafe { __ibverbs_sys_f(#(#args),*) },
                            None => crate::dl::missing_abort(#library, #name_str),
                        }
                    }
                });
            }
        }
    }
    let file: syn::File = syn::parse2(out).expect("dlopen: generated functions");
    format!(
        "// Generated by ibverbs-sys' build script (feature `dlopen`): libibverbs' and librdmacm's functions\n\
         // called through the tables that src/dl.rs loads.\n\n{}",
        prettyplease::unparse(&file)
    )
}
