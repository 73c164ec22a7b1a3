//! The queues: completion queues and their event channels, queue pairs (creation, connection
//! setup, posting), and the completions polled from them.

mod channel;
mod completion;
mod cq;
mod cq_ex;
mod qp;
mod srq;
mod xrc;

pub use channel::CompletionChannel;
pub use completion::{Completion, WcOpcode, WcStatus, WorkCompletion};
pub use cq::{CompletionQueue, CqBuilder};
pub use cq_ex::WcFlags;
pub use qp::scope::Scope;
pub use qp::state::{IWARP_MANUAL_CONNECT, IWARP_RESET};
#[cfg(feature = "cm")]
pub(crate) use qp::CmIdHold;
pub use qp::{
    ack_timeout_code, ack_timeout_duration, rnr_timer_code, rnr_timer_duration, ModifyQp, PathMigState,
    QpAttributes, PATH_MIGRATION, RATE_LIMIT,
};
pub use qp::{is_mcast_gid, MCAST_QPN};
pub use qp::{QpCaps, QpType, QueuePair, QueuePairBuilder};
pub use qp::{RecvHalf, ReuniteError, SendHalf, SplitError};
pub use srq::{SharedReceiveQueue, SrqAttr};
pub use xrc::XrcDomain;
