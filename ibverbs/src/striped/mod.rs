//! [`StripedConnection`]: one connection made of several RC queue pairs, like NCCL's
//! `NCCL_IB_QPS_PER_CONNECTION`, striping large RDMA Writes and Reads across them and reporting
//! one completion per request.
//!
//! Setup (this file): N RC queue pairs on one protection domain and one completion queue
//! (`ibv_create_cq`, `ibv_create_qp`), their [`EndpointList`] for the out-of-band exchange, and
//! the connection (`ibv_modify_qp` to RTS, per queue pair); or, for queue pairs connected
//! through RDMA-CM (the one way on iWARP), [`StripedConnection::from_queue_pairs`]. Posting and
//! polling are in `post.rs`; the split rule and the request ring in `plan.rs`.
//!
//! # Ownership
//! The module adds no `unsafe`: every piece is posted with the safe level
//! ([`QueuePair::post_send`]), so each piece's buffer is held by its queue pair until the
//! piece's completion is polled, exactly as for a single request. On top of that:
//! - a **shared** source ([`StripeBuf::Shared`], Writes only: the device only reads it) is an
//!   `Arc<MemoryRegion>`; every piece holds a clone, and the request's slot holds one more that
//!   comes back in the [`StripedCompletion`];
//! - an **owned** region ([`StripeBuf::Owned`], Writes and Reads) is cut into disjoint owned
//!   [`Chunk`]s, one per piece, each holding the registration alive. The slot keeps only the
//!   registration's reference count, which gives no access to the bytes. When the last piece
//!   completes (its chunk has been dropped), the region is rebuilt from that reference only if it
//!   is the last one (`Arc::try_unwrap`): no chunk exists anywhere then — not in a queue pair,
//!   not in a completion — so no device access can still be pending on it, and handing back the
//!   `MemoryRegion` (which gives `&mut [u8]`) aliases nothing.
//!
//! Dropping the connection drops its queue pairs (`ibv_destroy_qp`) before the completion queue
//! and the slots; buffers still posted are released by the safe level as for any queue pair
//! dropped with work outstanding (see the crate's *Safety model*).
//!
//! # Cost
//! The request slots, the per-QP queues and the poll array are allocated at creation; a request
//! on a shared source allocates nothing (one `Arc` clone per piece). A request on an **owned**
//! region allocates twice (the `Box` → `Arc` conversion that lets chunks share the registration,
//! and back), because [`MemoryRegion`] stores its registration in a `Box`.
//!
//! [`QueuePair::post_send`]: crate::QueuePair::post_send
//! [`Chunk`]: crate::Chunk
//! [`MemoryRegion`]: crate::MemoryRegion

mod connection;
mod endpoints;
mod plan;
mod post;

pub use connection::{StripeBuf, StripeOptions, StripedConnection};
pub use endpoints::EndpointList;
pub use post::{StripedCompletion, StripedOp, StripedPostError};
