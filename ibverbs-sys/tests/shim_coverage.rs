//! Host test: every `static inline` function and function-like macro that the installed
//! `infiniband/verbs.h` (and `rdma/rdma_cma.h`) declares has a callable binding through the C shim.

use std::collections::BTreeSet;

/// Macros that need no shim entry, each with the reason.
const EXEMPT_MACROS: &[(&str, &str)] = &[(
    "ibv_get_device_list",
    "defined only for RDMA_STATIC_PROVIDERS builds; the exported function of that name is bound",
)];

/// Names of the `static inline` functions a header defines, minus internal `_`-prefixed helpers.
fn static_inline_functions(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(pos) = rest.find("static inline") {
        rest = &rest[pos + "static inline".len()..];
        let Some(paren) = rest.find('(') else { break };
        let head = rest[..paren].trim_end();
        let name: String = head
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        if !name.is_empty() && !name.starts_with('_') {
            names.insert(name);
        }
    }
    names
}

/// Names of the function-like `#define ibv_*(`/`rdma_*(` macros a header defines.
fn function_like_macros(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.trim_start().strip_prefix("#define "))
        .filter_map(|l| {
            let l = l.trim_start();
            let end = l.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))?;
            let (name, after) = l.split_at(end);
            (after.starts_with('(') && (name.starts_with("ibv_") || name.starts_with("rdma_")))
                .then(|| name.to_string())
        })
        .collect()
}

fn check(header: &str) -> usize {
    let text = std::fs::read_to_string(header).unwrap_or_else(|e| panic!("reading {header}: {e}"));
    let shim: BTreeSet<&str> = ibverbs_sys::SHIM_FUNCTIONS.iter().copied().collect();
    let inline = static_inline_functions(&text);
    let macros = function_like_macros(&text);
    let missing: Vec<&String> = inline
        .iter()
        .chain(macros.iter().filter(|m| !EXEMPT_MACROS.iter().any(|(e, _)| e == m)))
        .filter(|n| !shim.contains(n.as_str()))
        .collect();
    assert!(missing.is_empty(), "{header}: no shim binding for {missing:?}");
    inline.len() + macros.len()
}

#[test]
fn every_static_inline_verb_has_a_binding() {
    let n = check(env!("IBVERBS_SYS_VERBS_H"));
    // verbs.h of any supported rdma-core defines dozens; a tiny count means the parser broke.
    assert!(n >= 50, "only {n} static inline functions/macros found in verbs.h: parser broken?");
    // Empty without the `rdmacm` feature: librdmacm's header is not bound then.
    let cma_h = env!("IBVERBS_SYS_RDMA_CMA_H");
    if !cma_h.is_empty() {
        check(cma_h);
    }
}

#[test]
fn hot_path_verbs_are_covered() {
    for name in [
        "ibv_post_send",
        "ibv_post_recv",
        "ibv_post_srq_recv",
        "ibv_poll_cq",
        "ibv_req_notify_cq",
        "ibv_reg_mr",
        "ibv_query_port",
        "ibv_wr_start",
        "ibv_wr_complete",
        "ibv_wr_rdma_write",
        "ibv_wc_read_opcode",
        "ibv_start_poll",
        "ibv_next_poll",
        "ibv_end_poll",
        "ibv_create_cq_ex",
        "ibv_create_qp_ex",
    ] {
        assert!(ibverbs_sys::SHIM_FUNCTIONS.contains(&name), "{name} not in the shim");
    }
}

#[test]
fn every_shim_symbol_links() {
    let addrs = ibverbs_sys::shim_symbol_addresses();
    assert_eq!(addrs.len(), ibverbs_sys::SHIM_FUNCTIONS.len());
    for (name, addr) in addrs {
        assert_ne!(addr, 0, "{name} has a null address");
    }
}

#[test]
fn parser_finds_known_shapes() {
    let text =
        "static inline int ibv_a(int x)\n{}\n__attribute__((x)) static inline struct s *\nibv_b(void)\n\
                static inline void __ibv_c(void)\n#define ibv_d(a, b) __ibv_c()\n#define IBV_E 1\n";
    let f: Vec<_> = static_inline_functions(text).into_iter().collect();
    assert_eq!(f, ["ibv_a", "ibv_b"]);
    let m: Vec<_> = function_like_macros(text).into_iter().collect();
    assert_eq!(m, ["ibv_d"]);
}
