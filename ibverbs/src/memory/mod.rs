//! Registered memory: the buffers regions own ([`OwnedBuffer`]), local-only and remote-exposed
//! regions ([`MemoryRegion`], [`RemoteMemoryRegion`]), and ranges of them as peers name them
//! ([`RemoteSlice`]).

mod buffer;
mod mr;
mod racy;
mod remote;

pub use buffer::{page_size, OwnedBuffer};
pub(crate) use mr::MrInner;
pub use mr::{AccessFlags, MemoryRegion, RemoteMemoryRegion};
pub use remote::RemoteSlice;
