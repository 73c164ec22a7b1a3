//! Safe, idiomatic bindings for **libibverbs** (rdma-core): RDMA verbs over InfiniBand, RoCE and
//! iWARP adapters, and SoftRoCE (`rdma_rxe`).
//!
//! The raw bindings are re-exported as [`ffi`].
#![warn(missing_docs)]

pub use ibverbs_sys as ffi;

mod error;

pub use error::{Error, Result};
