//! Addressing a peer: what a queue pair advertises ([`Endpoint`]) and how to reach it
//! ([`ConnectOptions`], and the address vector both imply). The state transitions that use them
//! are [`QueuePair::connect`](crate::QueuePair::connect) and friends.

mod endpoint;
mod options;

pub use endpoint::Endpoint;
pub use options::ConnectOptions;
pub(crate) use options::{ah_attr, gid_index};
