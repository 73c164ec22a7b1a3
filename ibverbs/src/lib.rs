//! Safe, idiomatic bindings for **libibverbs** (rdma-core): RDMA verbs over InfiniBand, RoCE and
//! iWARP adapters, and SoftRoCE (`rdma_rxe`).
//!
//! Every wrapper names the C verb it calls (search the docs for `ibv_post_send`); the raw,
//! bindgen-generated API is re-exported as [`ffi`] for anything not wrapped yet.
//!
//! # Quick start
//!
//! Two RC queue pairs on one device, connected to each other, move bytes with an RDMA Write and a
//! Send with immediate data (this is `examples/quickstart.rs`; run it where a device exists, e.g.
//! `cargo xtask rxe -- target/debug/examples/quickstart`):
//!
//! ```no_run
#![doc = include_str!("../../examples/quickstart.rs")]
//! ```
//!
//! # Objects and resource lifetimes
//!
//! | type | C object | created by | destroyed by |
//! |---|---|---|---|
//! | [`Context`] | `ibv_context` | [`Context::open`], [`Device::open`] | `ibv_close_device` |
//! | [`ProtectionDomain`] | `ibv_pd` | [`Context::alloc_pd`] | `ibv_dealloc_pd` |
//! | [`MemoryRegion`], [`RemoteMemoryRegion`] | `ibv_mr` | [`ProtectionDomain::allocate`], [`register`](ProtectionDomain::register), ... | `ibv_dereg_mr` |
//! | [`CompletionChannel`] | `ibv_comp_channel` | [`Context::create_comp_channel`] | `ibv_destroy_comp_channel` |
//! | [`CompletionQueue`] | `ibv_cq` | [`Context::create_cq`] | `ibv_destroy_cq` |
//! | [`QueuePair`] | `ibv_qp` | [`ProtectionDomain::create_qp`] | `ibv_destroy_qp` |
//! | [`AddressHandle`] | `ibv_ah` | [`ProtectionDomain::create_ah`] | `ibv_destroy_ah` |
//!
//! Every handle is `'static`: a child holds an `Arc` of its parent's inner object, so parents
//! outlive children by construction, whatever order the caller drops things in, and handles can be
//! stored in the caller's own structs. `Drop` destroys the object, best-effort and without
//! panicking; a destroy that fails leaks rather than frees memory the device may still use.
//!
//! # Thread safety
//!
//! All handles are `Send + Sync` (rdma-core's verbs are thread-safe). Operations that mutate the
//! crate's own bookkeeping take `&mut self`: posting at the safe level
//! ([`QueuePair::post_send`]) and polling with buffer tracking ([`CompletionQueue::poll`]). A QP can
//! post from one thread while its CQ is polled in another.
//!
//! # Safety model
//!
//! Posting a work request hands memory to the device until a completion says it is done. The
//! crate offers two levels:
//!
//! 1. **Safe, owned buffers** ([`QueuePair::post_send`], [`post_recv`](QueuePair::post_recv),
//!    [`post_send_chain`](QueuePair::post_send_chain)): a request *moves* its buffers in — an owned
//!    [`MemoryRegion`], an `Arc<MemoryRegion>` (only for memory the device reads), or an
//!    `Arc<RemoteMemoryRegion>`. The QP keeps them in a slot of a ring sized at creation; the
//!    completion polled from the CQ hands them back ([`Completion::take_region`]). Nothing can touch
//!    an owned buffer meanwhile, and `mem::forget` of any handle only leaks. The `wr_id` given to
//!    the device encodes the ring and slot, so a completion finds its buffers without a lock or a
//!    hash lookup, also on a CQ shared by many QPs and both queues of a QP.
//!    * *Unsignaled sends* complete silently; the next signaled completion of the queue releases
//!      them (work queues complete in order). They may hold only shared handles, since nothing
//!      would hand an owned buffer back.
//!    * *Queue and CQ overflow* cannot happen: a full ring is [`Error::QueueFull`], and a QP whose
//!      queues could overfill its CQ is refused at creation ([`Error::CqTooSmall`]).
//!    * *A QP dropped with work outstanding*: after `ibv_destroy_qp` returns the device is done, so
//!      its buffers are released at the CQ's next poll (or when the CQ goes); its stale completions
//!      are recognised by a generation in the `wr_id` and never dereferenced. Errors flush every
//!      request with its buffers; [`QueuePair::reset`] starts over with empty rings.
//!    * *Regions outlive their users*: a posted request owns (or shares) its region, so it cannot
//!      be deregistered meanwhile; the PD outlives its regions and QPs through their `Arc`s.
//!    * *Inline data* is copied during the post ([`SendRequest::send_inline`] borrows it only for
//!      the call).
//! 2. **Unsafe, zero overhead** ([`QueuePair::post_send_unchecked`],
//!    [`CompletionQueue::poll_raw`]): raw `ibv_send_wr` chains at exactly C's cost. The `# Safety`
//!    sections state what must stay valid until completion.
//!
//! **Remote-exposed memory is typed apart.** A peer may write a region registered with
//! [`AccessFlags::REMOTE_WRITE`] or [`AccessFlags::REMOTE_ATOMIC`] at any moment, so such a region is
//! a [`RemoteMemoryRegion`]: safe code copies in and out with volatile accesses; references into it
//! are `unsafe`. Local-only [`MemoryRegion`]s deref to `[u8]` freely.
//!
//! Values the device writes (completion status and opcode, port state, MTU, GID type...) are
//! `#[repr(transparent)]` newtypes with associated constants, sound for any value.
//!
//! These guarantees are pinned by tests, including these that must not compile:
//!
//! A buffer moved into a post cannot be touched until its completion hands it back:
//! ```compile_fail,E0382
//! # fn f(qp: &mut ibverbs::QueuePair, mr: ibverbs::MemoryRegion, peer: ibverbs::RemoteSlice) {
//! use ibverbs::{Local, SendRequest};
//! qp.post_send(SendRequest::write(Local::whole(mr), peer)).unwrap();
//! mr[0] = 1; // error: use of moved value `mr`
//! # }
//! ```
//! A slice of a region cannot outlive handing the region to a post:
//! ```compile_fail,E0505
//! # fn f(qp: &mut ibverbs::QueuePair, mr: ibverbs::MemoryRegion) {
//! use ibverbs::{Local, RecvRequest};
//! let view: &[u8] = &mr;
//! qp.post_recv(RecvRequest::new(Local::whole(mr))).unwrap(); // error: cannot move out of `mr`
//! println!("{}", view[0]);
//! # }
//! ```
//! Remote-writable memory gives no safe references:
//! ```compile_fail,E0133
//! # fn f(mr: &ibverbs::RemoteMemoryRegion) {
//! let bytes: &[u8] = mr.as_slice(); // error: call to unsafe function
//! # }
//! ```
//! Nor does it deref to a slice:
//! ```compile_fail,E0608
//! # fn f(mr: &ibverbs::RemoteMemoryRegion) {
//! let first = mr[0]; // error: cannot index
//! # }
//! ```
//! A region shared with posts (read by the device) cannot be written:
//! ```compile_fail,E0596
//! # fn f(mr: std::sync::Arc<ibverbs::MemoryRegion>) {
//! mr.as_mut_slice()[0] = 1; // error: cannot borrow data in an `Arc` as mutable
//! # }
//! ```
//! Posting at the safe level needs exclusive access to the QP, polling to the CQ:
//! ```compile_fail,E0596
//! # fn f(qp: &ibverbs::QueuePair) {
//! qp.post_send(ibverbs::SendRequest::send_inline(b"x")); // error: `qp` is a `&` reference
//! # }
//! ```
//! ```compile_fail,E0596
//! # fn f(cq: &ibverbs::CompletionQueue) {
//! let mut out: [ibverbs::Completion; 1] = Default::default();
//! cq.poll(&mut out); // error: `cq` is a `&` reference
//! # }
//! ```
//! The completion queue has one owner: it cannot be cloned (queue pairs keep it alive themselves):
//! ```compile_fail,E0308
//! # fn f(cq: &ibverbs::CompletionQueue) {
//! let second = cq.clone(); // error: no method `clone` (the CQ is not Clone)
//! let _: ibverbs::CompletionQueue = second;
//! # }
//! ```
//! Inline data must outlive the request that borrows it:
//! ```compile_fail,E0597
//! # fn f(qp: &mut ibverbs::QueuePair) {
//! let wr = { let data = vec![1u8; 8]; ibverbs::SendRequest::send_inline(&data) }; // error: `data` does not live long enough
//! qp.post_send(wr).unwrap();
//! # }
//! ```
//!
//! And these that must:
//! ```
//! fn assert_static_send_sync<T: 'static + Send + Sync>() {}
//! assert_static_send_sync::<ibverbs::Context>();
//! assert_static_send_sync::<ibverbs::QueuePair>();
//! assert_static_send_sync::<ibverbs::CompletionQueue>();
//! assert_static_send_sync::<ibverbs::MemoryRegion>();
//! assert_static_send_sync::<ibverbs::RemoteMemoryRegion>();
//! // Handles can live in the caller's own structs, without lifetimes.
//! struct Endpoint { _qp: ibverbs::QueuePair, _cq: ibverbs::CompletionQueue, _pd: ibverbs::ProtectionDomain }
//! ```
#![warn(missing_docs)]

pub use ibverbs_sys as ffi;

mod ah;
mod connect;
mod device;
mod error;
mod memory;
mod pd;
mod post;
mod queue;

pub use ah::AddressHandle;
pub use connect::{ConnectOptions, Endpoint};
pub use device::{
    devices, Context, Device, DeviceAttr, DeviceAttrEx, DeviceList, Gid, GidEntry, GidType, Guid, LinkLayer,
    Mtu, NodeType, PortAttr, PortState, TransportType,
};
pub use error::{Error, Result};
pub use memory::{page_size, AccessFlags, MemoryRegion, OwnedBuffer, RemoteMemoryRegion, RemoteSlice};
pub use pd::ProtectionDomain;
pub use post::{Local, LocalBuf, RecvRequest, SendRequest, MAX_SGE};
pub use queue::{
    Completion, CompletionChannel, CompletionQueue, CqId, PostError, QpCaps, QpState, QpType, QueuePair,
    QueuePairBuilder, WcOpcode, WcStatus, WorkCompletion,
};
