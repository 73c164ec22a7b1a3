//! Safe, idiomatic bindings for **libibverbs** (rdma-core): RDMA verbs over InfiniBand, RoCE and
//! iWARP adapters, and SoftRoCE (`rdma_rxe`).
//!
//! The raw bindings are re-exported as [`ffi`].
#![warn(missing_docs)]

pub use ibverbs_sys as ffi;

mod ah;
mod cq;
mod device;
mod error;
mod mr;
mod pd;
mod qp;
mod ring;
mod wr;

pub use ah::AddressHandle;
pub use cq::{Completion, CompletionChannel, CompletionQueue, CqId, WcOpcode, WcStatus, WorkCompletion};
pub use device::{
    devices, Context, Device, DeviceAttr, DeviceList, Gid, GidEntry, GidType, Guid, LinkLayer, Mtu, NodeType,
    PortAttr, PortState, TransportType,
};
pub use error::{Error, Result};
pub use mr::{AccessFlags, MemoryRegion, OwnedBuffer, RemoteMemoryRegion, RemoteSlice};
pub use pd::ProtectionDomain;
pub use qp::{ConnectOptions, Endpoint, PostError, QpCaps, QpState, QpType, QueuePair, QueuePairBuilder};
pub use wr::{Local, LocalBuf, RecvRequest, SendRequest, MAX_SGE};
