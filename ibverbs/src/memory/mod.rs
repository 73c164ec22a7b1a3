//! Registered memory: the buffers regions own ([`OwnedBuffer`]), local-only and remote-exposed
//! regions ([`MemoryRegion`], [`RemoteMemoryRegion`]), owned pieces of one registration
//! ([`Chunk`]), and ranges of them as peers name them ([`RemoteSlice`]); the rest of the
//! registration family: on-demand paging ([`odp`]), on-device memory ([`DeviceMemory`]) and
//! dma-buf regions ([`DmabufRegion`]).

mod buffer;
mod chunk;
mod device_memory;
mod dmabuf;
mod hold;
mod keyed;
mod mr;
pub mod odp;
mod racy;
mod remote;
mod window;

pub use buffer::{page_size, OwnedBuffer};
pub use chunk::Chunk;
pub use device_memory::{DeviceMemory, DeviceMemoryRegion};
pub use dmabuf::DmabufRegion;
pub(crate) use hold::park_qp_teardown;
pub(crate) use mr::{check_range, MrInner};
pub use mr::{AccessFlags, MemoryRegion, RemoteByte, RemoteMemoryRegion, IOVA_ELSEWHERE};
pub use remote::RemoteSlice;
pub(crate) use window::Pending;
pub use window::{
    BoundWindow, ExposedRegion, MemoryWindow, MwType, WindowedRegion, MAX_BINDS, WINDOW_ACCESS,
};
