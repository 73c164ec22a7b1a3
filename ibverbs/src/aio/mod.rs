//! The async adaptor: completions, and safe posts whose futures own their buffers, over any
//! reactor.
//!
//! The runtime-agnostic core here is always compiled (it needs no dependency). A reactor plugs in
//! through [`Backend`]/[`Readiness`] ("tell me when this descriptor is readable"); two come with
//! the crate:
//!
//! | feature | backend | reactor |
//! |---|---|---|
//! | `tokio` | `tokio::Tokio` | `tokio::io::unix::AsyncFd` (call inside a tokio runtime) |
//! | `async-io` | `async_io::AsyncIo` | `async_io::Async` (smol and friends) |
//!
//! # The wait
//! Every wait runs the standard sequence on its completion queue: poll (`ibv_poll_cq()`); when
//! it is empty arm it (`ibv_req_notify_cq()`) and poll again (a completion that arrived between
//! the first poll and the arming raises no event: this second poll finds it); then wait until the
//! channel's descriptor is readable, get and acknowledge every pending event
//! (`ibv_get_cq_event()`, `ibv_ack_cq_events()`), and start over. What a poll that finds the CQ
//! empty does first is its [`WaitPolicy`]: by default ([`WaitPolicy::ADAPTIVE`]) it busy polls
//! for a bounded while after the CQ ran dry (the task wakes itself and yields to its executor),
//! then arms and sleeps as above, with the reactor watching the descriptor (of a [`Driver`]'s
//! operations only the oldest waiting one of each work queue spins: the others' completions
//! cannot come first); [`WaitPolicy::Events`] never spins, [`WaitPolicy::BusyPoll`] never sleeps.
//!
//! # Two ways in
//! - [`AsyncCompletionQueue`]: a stream of completions from one CQ ([`next`](AsyncCompletionQueue::next),
//!   [`next_batch`](AsyncCompletionQueue::next_batch)), for callers that post with the safe level
//!   themselves.
//! - [`Driver`] + [`AsyncQueuePair`]: `await`-able posts ([`AsyncQueuePair::send`],
//!   [`write`](AsyncQueuePair::write), [`read`](AsyncQueuePair::read),
//!   [`recv`](AsyncQueuePair::recv)). A driver owns one CQ; any number of queue pairs complete
//!   into it and any number of tasks await their operations: whichever task polls drives the CQ
//!   and hands each completion to the future waiting for it (by a slot index + generation carried
//!   in the `wr_id`), so no dedicated task is needed.
//!
//! # Cancellation
//! A posted request's buffers belong to the queue pair until its completion is polled (the safe
//! level's slot rings), not to the future. Dropping (or `mem::forget`ting) the future only
//! abandons the wait: the driver drops the completion, and with it the buffers, when the device
//! reports it done. No buffer is freed or reused while the device may touch it, whatever the
//! caller does; a forgotten future leaks its slot, and holds up no other task (the reactor wakes
//! the driver, which wakes every waiting task). The adaptor has no `unsafe` of its own:
//! reactors watch the channel's epoll descriptor (its `AsFd`), which cannot be read from.
//!
//! # Asynchronous events
//! [`AsyncEventStream`] awaits a context's [`AsyncEvent`](crate::AsyncEvent)s (port changes, QP
//! and CQ errors, ...) the same way, over the same backends.
//!
//! # One channel per adaptor
//! The channel given to an [`AsyncCompletionQueue`] or a [`Driver`] must be the one its CQ was
//! created on (checked: [`Error::InvalidArgument`](crate::Error::InvalidArgument) otherwise), and
//! serve that CQ only: the adaptor knows its CQ is no longer armed only from the events it reads
//! itself, so another reader of the channel (a second CQ's
//! [`poll_wait`](crate::CompletionQueue::poll_wait), a clone's `try_get_event`) that takes this
//! CQ's event leaves the adaptor waiting for an event that was already raised (until the future is
//! dropped). (Registering one descriptor twice with the same reactor fails anyway.) Several queue
//! pairs share one CQ and one channel through one [`Driver`].
// The backends are linked only where their features compile them (a link to a missing item
// is a rustdoc warning).
#![cfg_attr(feature = "tokio", doc = "\nThe tokio backend: [`tokio::Tokio`].")]
#![cfg_attr(feature = "async-io", doc = "\nThe async-io backend: [`async_io::AsyncIo`].")]

mod backend;
mod cq;
mod driver;
mod events;
mod seam;
mod wait;

#[cfg(feature = "async-io")]
pub mod async_io;
#[cfg(feature = "tokio")]
pub mod tokio;

pub use backend::{Backend, Readiness};
pub use cq::AsyncCompletionQueue;
pub use driver::{AsyncQueuePair, DrivenCq, Driver, Op};
pub use events::AsyncEventStream;
pub use seam::WatchedFd;
pub use wait::WaitPolicy;
