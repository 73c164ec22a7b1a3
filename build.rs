//! Build script of the safe `ibverbs` crate: turns the rdma-core version that `ibverbs-sys`
//! exports (`links = "rdma_verbs"` → `DEP_RDMA_VERBS_RDMA_CORE`) into `cfg`s for verbs that older
//! rdma-core releases lack.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DEP_RDMA_VERBS_RDMA_CORE");
    println!("cargo:rustc-check-cfg=cfg(ibverbs_has_query_gid_ex)");
    println!("cargo:rustc-check-cfg=cfg(ibverbs_has_query_gid_table)");
    println!("cargo:rustc-check-cfg=cfg(ibverbs_has_reg_dmabuf_mr)");
    println!("cargo:rustc-check-cfg=cfg(ibverbs_has_is_fork_initialized)");
    println!("cargo:rustc-check-cfg=cfg(ibverbs_has_phys_port_cnt_ex)");
    let rdma_core: u32 =
        std::env::var("DEP_RDMA_VERBS_RDMA_CORE").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    // ibv_query_gid_ex() and ibv_query_gid_table() appeared in rdma-core v32.
    if rdma_core >= 32 {
        println!("cargo:rustc-cfg=ibverbs_has_query_gid_ex");
        println!("cargo:rustc-cfg=ibverbs_has_query_gid_table");
    }
    // ibv_reg_dmabuf_mr() appeared in v34, ibv_is_fork_initialized() and
    // ibv_device_attr_ex.phys_port_cnt_ex in v35.
    if rdma_core >= 34 {
        println!("cargo:rustc-cfg=ibverbs_has_reg_dmabuf_mr");
    }
    if rdma_core >= 35 {
        println!("cargo:rustc-cfg=ibverbs_has_is_fork_initialized");
        println!("cargo:rustc-cfg=ibverbs_has_phys_port_cnt_ex");
    }
}
