//! Addressing a peer: what a queue pair advertises ([`Endpoint`]) and how to reach it
//! ([`ConnectOptions`], and the address vector both imply). The state transitions that use them
//! are [`QueuePair::connect`](crate::QueuePair::connect) and friends.

mod endpoint;
mod options;

pub use endpoint::Endpoint;
pub use options::ConnectOptions;
pub(crate) use options::{ah_attr, gid_index};

#[cfg(test)]
pub(crate) mod tests_support {
    /// A small deterministic generator (xorshift64*) for the crate's property tests, so that a
    /// failure reproduces.
    pub(crate) fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}
