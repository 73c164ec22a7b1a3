//! Helpers of the crate's unit tests.

/// A small deterministic generator (xorshift64*) for the crate's property tests, so that a
/// failure reproduces.
pub(crate) fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}
