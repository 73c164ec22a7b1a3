//! Connection management with **librdmacm** (RDMA-CM): IP addressing, route resolution and the
//! connection handshake of RC queue pairs, as `rping`, `ib_write_bw -R` and most RDMA
//! applications do it; and multicast groups joined by IP address on UD queue pairs, as
//! `mckey` does it.
//!
//! | type | C object | created by | destroyed by |
//! |---|---|---|---|
//! | [`EventChannel`] | `rdma_event_channel` | [`EventChannel::new`] | `rdma_destroy_event_channel` |
//! | [`CmId`] | `rdma_cm_id` | [`EventChannel::create_id`] (`RDMA_PS_TCP`), [`EventChannel::create_udp_id`] (`RDMA_PS_UDP`), a [`CmEventKind::CONNECT_REQUEST`] | `rdma_destroy_id` |
//! | [`QueuePair`](crate::QueuePair) on an id | `ibv_qp` (`id->qp`) | [`QueuePairBuilder::build_on`](crate::QueuePairBuilder::build_on) | `ibv_destroy_qp`, then `id->qp = NULL` (what `rdma_destroy_qp` does) |
//!
//! The blocking helpers [`connect`] and [`Listener`] do the whole exchange with bounded waits;
//! their halves ([`resolve`] + [`establish`], [`Listener::request`] + [`accept_request`]) let the
//! caller build the queue pair on the id in between (e.g. to post receives before the connection
//! exists); the event-level API ([`CmId`] + [`EventChannel::get_event`]) does it step by step.
//!
//! # Multicast
//! An id of [`EventChannel::create_udp_id`] carries a UD queue pair (librdmacm brings it to RTS
//! with the Q_Key `RDMA_UDP_QKEY`) and joins IP multicast groups: [`CmId::join_multicast`]
//! (`rdma_join_multicast`) reports a [`CmEventKind::MULTICAST_JOIN`] event whose
//! [`CmEvent::multicast`] is the group, typed ([`McastJoin`]: GID, LID, service level, remote QP
//! number and Q_Key, and [`McastJoin::create_ah`] for the address handle to send to it with);
//! the id's queue pair is attached to the group as the event is read, and detached by
//! [`CmId::leave_multicast`] (`rdma_leave_multicast`), which dropping the queue pair or the id
//! does for the groups still joined. On RoCE the join
//! also makes the host a member of the IP group, without which rxe delivers nothing. The
//! example `mcast` talks to rdmacm-utils' `mckey` in both roles.
//!
//! # Contexts
//! librdmacm opens the devices itself: an id's device context (`id->verbs`, known once its
//! address is resolved or bound) is *not* a context opened with
//! [`Context::open`](crate::Context::open), and `rdma_create_qp` refuses a protection domain of
//! another context. [`CmId::context`], [`device_context`] and [`devices`] hand out librdmacm's
//! contexts as [`Context`](crate::Context)s (one `Context` per device, shared by every call, so
//! the crate's same-context checks hold); the protection domain, completion queues and memory
//! regions of a CM queue pair must be made from one of them.
//!
//! # Lifetimes (whatever the caller does)
//! - A queue pair created on an id holds an `Arc` of the id: the QP is destroyed first, then
//!   the id (`rdma_destroy_id`), because librdmacm keeps `id->qp` and uses it (e.g. in
//!   `rdma_disconnect`); the QP's drop clears `id->qp` once the QP is destroyed.
//! - An id holds an `Arc` of its event channel: the channel is destroyed after all its ids.
//! - A `Context` from librdmacm holds an `rdma_get_devices()` reference, which keeps librdmacm
//!   from closing the device while any object of it lives.
//! - [`EventChannel::get_event`] copies what an event carries (private data included) and
//!   acknowledges it (`rdma_ack_cm_event`) before returning, so `rdma_destroy_id` (which waits
//!   for the acknowledgement of every event of its id) never blocks, even if the caller leaks or
//!   `mem::forget`s events and ids.
//! - librdmacm reads and writes an id's fields (`qp`, `route`, ...) when it processes that id's
//!   events; every call on an id, every event processed on a channel and the destruction of a
//!   CM queue pair take the id's channel lock, so no two of them race.
//! - A connection request's new id gets an event channel of its own (`rdma_migrate_id`), so
//!   its events never mix with the listener's, and a listener can go before its accepted ids.

mod blocking;
mod channel;
mod devices;
mod event;
mod id;
mod mcast;
mod qp;
mod sys;

pub use crate::attr::CmEventKind;
pub use blocking::{accept_request, connect, connect_with, device_context, establish, resolve, Listener};
pub use channel::EventChannel;
pub use devices::devices;
pub use event::{CmEvent, McastJoin};
pub use id::{CmId, ConnParam};
