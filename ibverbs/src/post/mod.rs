//! The posting engine, in the order a work request travels:
//!
//! 1. [`wr`]: typed requests ([`SendRequest`], [`RecvRequest`]) over registered buffers
//!    ([`Local`]), checked before anything reaches the device;
//! 2. [`engine`]: a request moves its buffers into a [`Slot`] of its work queue's [`Ring`] and
//!    becomes a raw `ibv_send_wr`/`ibv_recv_wr` whose `wr_id` names the slot ([`prepared`]
//!    requests skip the building and most checks: done once, copied per post);
//! 3. [`registry`]: each completion queue knows the rings of the queues it serves, so a polled
//!    completion finds its slot from the `wr_id` alone (see
//!    [`CompletionQueue::poll`](crate::CompletionQueue::poll)) and hands the buffers back;
//! 4. [`table`]: a shared receive queue's slots, taken in any order by the pollers of several
//!    CQs (per-slot CAS state and generation instead of a ring's in-order positions); each CQ's
//!    registry also knows the SRQs attached to it.
//!
//! 5. [`scope`]: the third level, requests over memory *borrowed* for a
//!    [`QueuePair::scope`](crate::QueuePair::scope): same slots (holding no buffer) and `wr_id`s,
//!    the borrow ending only after the scope's drain saw every position released.
//!
//! [`ex`] is the second hand-over to the provider, for queue pairs created with
//! [`SendOps`]: the same requests, slots and `wr_id`s, replayed as `ibv_wr_*` builder calls with
//! one `ibv_wr_complete` per batch.

pub(crate) mod engine;
pub(crate) mod ex;
pub(crate) mod prepared;
pub mod raw;
pub(crate) mod registry;
pub(crate) mod ring;
pub(crate) mod scope;
pub(crate) mod slot;
pub(crate) mod table;
pub(crate) mod wr;

pub use ex::SendOps;
pub use prepared::{PreparedChainError, PreparedPost, PreparedRecv, PreparedSend};
pub use scope::{ScopedLocal, ScopedRecv, ScopedSend};
pub(crate) use slot::{Slot, SlotBufs};
pub use wr::{Local, LocalBuf, RecvRequest, SendIterError, SendRequest, MAX_SGE};
