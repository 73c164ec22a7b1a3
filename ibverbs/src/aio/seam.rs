//! The adaptor's only contact with the completion channel: a non-blocking "get and acknowledge
//! the next event" ([`CompletionChannel::try_get_event`]) and the descriptor a reactor watches
//! (the channel's [`AsFd`]: a private epoll descriptor that is readable exactly when the channel
//! is and cannot be read from).

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use crate::async_event::AsyncEvents;
use crate::device::CqId;
use crate::error::Result;
use crate::queue::CompletionChannel;

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
        self.channel.try_get_event()
    }

    /// The descriptor to hand a reactor.
    pub(crate) fn watched(&self) -> WatchedFd {
        WatchedFd { source: Source::Channel(self.channel.clone()) }
    }
}

/// What a [`WatchedFd`] keeps open.
enum Source {
    Channel(CompletionChannel),
    AsyncEvents(AsyncEvents),
}

impl WatchedFd {
    /// The epoll descriptor of a context's asynchronous events, for an
    /// [`AsyncEventStream`](super::AsyncEventStream).
    pub(crate) fn async_events(events: &AsyncEvents) -> WatchedFd {
        WatchedFd { source: Source::AsyncEvents(events.clone()) }
    }
}

/// A completion channel's (or a context's asynchronous events') descriptor, handed to a
/// [`Backend`](super::Backend) to watch for readability. It keeps the channel (and so the
/// descriptor) open as long as it lives.
///
/// Both [`AsFd`] and [`AsRawFd`] give the private epoll descriptor of [`CompletionChannel`]'s
/// (or [`AsyncEvents`]') `AsFd`: readable exactly when an event is pending, and `read(2)` on it
/// fails, so a reactor can register it and nothing can consume an event behind the adaptor's back
/// (events are read and acknowledged by the adaptor: `ibv_get_cq_event()`/`ibv_ack_cq_events()`,
/// `ibv_get_async_event()`/`ibv_ack_async_event()`).
pub struct WatchedFd {
    source: Source,
}

impl fmt::Debug for WatchedFd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WatchedFd").field("fd", &self.as_raw_fd()).finish()
    }
}

impl AsFd for WatchedFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match &self.source {
            Source::Channel(c) => c.as_fd(),
            Source::AsyncEvents(e) => e.as_fd(),
        }
    }
}

impl AsRawFd for WatchedFd {
    fn as_raw_fd(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}
