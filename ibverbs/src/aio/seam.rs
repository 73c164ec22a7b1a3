//! The adaptor's only contact with the completion channel: a non-blocking "get and acknowledge
//! the next event" and the descriptor a reactor watches. When the channel grows a
//! `try_get_event()` / `AsFd` API, only this file changes.

use std::fmt;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use crate::error::Result;
use crate::queue::{CompletionChannel, CqId};

/// The channel as the adaptor uses it.
#[derive(Clone)]
pub(crate) struct Seam {
    channel: CompletionChannel,
}

impl Seam {
    pub(crate) fn new(channel: &CompletionChannel) -> Seam {
        Seam { channel: channel.clone() }
    }

    /// Gets and acknowledges one pending event without blocking; `None` when there is none.
    pub(crate) fn try_get_event(&self) -> Result<Option<CqId>> {
        self.channel.get_event(Some(Duration::ZERO))
    }

    /// The descriptor to hand a reactor.
    pub(crate) fn watched(&self) -> WatchedFd {
        WatchedFd { channel: self.channel.clone() }
    }
}

/// A completion channel's descriptor, handed to a [`Backend`](super::Backend) to watch for
/// readability. It keeps the channel (and so the descriptor) open as long as it lives.
///
/// It implements [`AsRawFd`] only. A backend registers it with its reactor and waits for
/// readability; it must never read from it (events are read and acknowledged by the adaptor, with
/// `ibv_get_cq_event()`/`ibv_ack_cq_events()`; an event read behind the crate's back is never
/// acknowledged and makes `ibv_destroy_cq()` block forever).
pub struct WatchedFd {
    channel: CompletionChannel,
}

impl fmt::Debug for WatchedFd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WatchedFd").field("fd", &self.as_raw_fd()).finish()
    }
}

impl AsRawFd for WatchedFd {
    fn as_raw_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }
}
