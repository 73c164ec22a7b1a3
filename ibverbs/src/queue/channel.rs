//! Completion event channels, and the per-CQ event bookkeeping (batched acknowledgements).
//!
//! # How events are acknowledged (the argument)
//!
//! `ibv_destroy_cq` waits until the events acknowledged for a CQ (`ibv_ack_cq_events`) equal
//! the events the kernel *reported* for it, i.e. read from the channel by `ibv_get_cq_event`.
//! Every CQ on a channel of this crate is created with `cq_context` pointing to its
//! [`CqEvents`], an `Arc` kept by the CQ's inner object until *after* `ibv_destroy_cq` returned.
//! Its one atomic word holds the number of events read but not acknowledged yet, a "notified"
//! bit, and a `DYING` bit:
//!
//! - A reader ([`CompletionChannel::try_get_event`] and every wait built on it) reads an event,
//!   then, in one atomic update of that CQ's word: if `DYING` is clear it counts the event
//!   (acknowledging the whole batch itself once [`ACK_BATCH`] are pending); if `DYING` is set it
//!   acknowledges this one event itself. It touches the word only *before* any acknowledgement of
//!   its own, and never afterwards.
//! - The CQ's drop swaps the word to `DYING`, acknowledges the pending count it took, then calls
//!   `ibv_destroy_cq`. Each event is therefore acknowledged exactly once: by the drop when the
//!   reader's update came first, by the reader otherwise.
//! - A reader between `ibv_get_cq_event` and its update holds an event that is reported and not
//!   acknowledged, so `ibv_destroy_cq` (and the freeing of the word after it) waits for it: the
//!   word and the `struct ibv_cq` the reader acknowledges through are alive whenever it touches
//!   them. Once it acknowledged it touches neither.
//! - [`CompletionQueue::req_notify`](crate::CompletionQueue::req_notify) also acknowledges the
//!   pending count (the CQ is alive: `&self`).
//!
//! Nothing the caller holds is an unacknowledged event (a [`CqId`] is a plain value), so no drop
//! order and no `mem::forget` can make `ibv_destroy_cq` wait forever.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

use crate::device::{Context, ContextInner, CqId};
use crate::error::{cvt_p, Error, Result};
use crate::fd::{self, ReadinessFd, Wakeup};

/// Events of one CQ acknowledged in one `ibv_ack_cq_events` call by a reader, at the latest.
pub(crate) const ACK_BATCH: u32 = 64;

const DYING: u32 = 1 << 31;
const NOTIFIED: u32 = 1 << 30;
const PENDING: u32 = NOTIFIED - 1;

/// The event bookkeeping of one CQ; `cq_context` of the `ibv_cq` points to it (see the module
/// docs for the protocol).
pub(crate) struct CqEvents {
    word: AtomicU32,
    /// The CQ's process-unique number ([`CqId`]).
    pub(crate) serial: u64,
}

impl CqEvents {
    /// The bookkeeping of the CQ numbered `serial`, no event read yet.
    pub(crate) fn new(serial: u64) -> CqEvents {
        CqEvents { word: AtomicU32::new(0), serial }
    }

    /// Counts one event just read for this CQ and marks it notified; returns how many events
    /// the caller must acknowledge now (0, a full batch, or 1 when the CQ is being dropped).
    /// The caller must not touch `self` after acknowledging.
    pub(crate) fn record(&self) -> u32 {
        let mut ack = 0;
        let _ = self.word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            if w & DYING != 0 {
                ack = 1;
                return None;
            }
            let pending = (w & PENDING) + 1;
            if pending >= ACK_BATCH {
                ack = pending;
                Some((w & !PENDING) | NOTIFIED)
            } else {
                ack = 0;
                Some((w & !PENDING) | NOTIFIED | pending)
            }
        });
        ack
    }

    /// Takes the pending count, to be acknowledged by the caller (who holds the CQ alive).
    pub(crate) fn take_pending(&self) -> u32 {
        self.word.fetch_and(!PENDING, Ordering::AcqRel) & PENDING
    }

    /// Marks the CQ dying and takes the pending count: from now on readers acknowledge
    /// themselves.
    pub(crate) fn begin_drop(&self) -> u32 {
        self.word.swap(DYING, Ordering::AcqRel) & PENDING
    }

    /// Clears the notified bit, returning whether it was set.
    pub(crate) fn take_notified(&self) -> bool {
        self.word.fetch_and(!NOTIFIED, Ordering::AcqRel) & NOTIFIED != 0
    }
}

pub(crate) struct ChannelInner {
    pub(crate) raw: NonNull<ffi::ibv_comp_channel>,
    pub(crate) ctx: Arc<ContextInner>,
    /// The epoll instance handed out as `AsFd`.
    ready: ReadinessFd,
    /// Waiters of [`CompletionQueue::poll_wait`](crate::CompletionQueue::poll_wait): `true`
    /// while one of them (the leader) waits on the descriptor; the others wait on `turn`.
    leader: Mutex<bool>,
    turn: Condvar,
    /// Wakes the leader when another thread read an event the leader may wait for.
    wakeup: Wakeup,
}

// SAFETY: a completion channel is a file descriptor plus a context pointer; libibverbs allows
// getting events from any thread; the other fields are thread-safe types.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using this channel holds an Arc of this inner, so none is left.
        unsafe { ffi::ibv_destroy_comp_channel(self.raw.as_ptr()) };
    }
}

impl ChannelInner {
    fn fd(&self) -> RawFd {
        // SAFETY: the channel is valid while self lives; fd is a plain field written at creation.
        unsafe { (*self.raw.as_ptr()).fd }
    }

    fn lock(&self) -> MutexGuard<'_, bool> {
        // The flag is only set and cleared whole: a poisoned lock holds a consistent value.
        self.leader.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads one event without blocking, does its bookkeeping and wakes the waiters that may
    /// wait for it; `None` when there is none (`EAGAIN`).
    pub(crate) fn take_event(&self, by_leader: bool) -> Result<Option<CqId>> {
        let mut cq = std::ptr::null_mut();
        let mut cq_ctx = std::ptr::null_mut();
        // SAFETY: valid channel and out-pointers; the fd is non-blocking, so this returns.
        let ret = unsafe { ffi::ibv_get_cq_event(self.raw.as_ptr(), &mut cq, &mut cq_ctx) };
        if ret != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(Error::Verb { verb: "ibv_get_cq_event", source: e });
        }
        let (id, ack) = if cq_ctx.is_null() {
            // Not a CQ of this crate (a contract violation of a raw user): acknowledge at once.
            (CqId(0), 1)
        } else {
            // SAFETY: every CQ created on a channel of this crate has `cq_context` pointing to
            // its CqEvents, which lives until ibv_destroy_cq returned; that waits for this
            // event's acknowledgement, which comes after this (last) use of the reference.
            let events = unsafe { &*cq_ctx.cast::<CqEvents>() };
            (CqId(events.serial), events.record())
        };
        if ack > 0 {
            // SAFETY: `cq` is alive: its destruction waits for this acknowledgement. Neither
            // `cq` nor its CqEvents is touched after it.
            unsafe { ffi::ibv_ack_cq_events(cq, ack) };
        }
        let leading = self.lock();
        if *leading && !by_leader {
            self.wakeup.wake();
        }
        self.turn.notify_all();
        drop(leading);
        Ok(Some(id))
    }

    /// Waits until `events` is notified (an event for its CQ was read, by this thread or any
    /// other) or `deadline` passes; returns whether it was notified (and clears the bit).
    ///
    /// One waiter (the leader) waits on the channel's descriptor and reads events; the others
    /// wait on a condition variable that every reader signals. A reader that is not the leader
    /// sets the CQ's bit *before* it takes the lock to signal, and the leader checks its bit
    /// under the lock before it waits on the descriptor and an eventfd the reader writes when
    /// it sees a leader: no wake-up is lost.
    pub(crate) fn wait_notified(&self, events: &CqEvents, deadline: Option<Instant>) -> Result<bool> {
        let mut leading = self.lock();
        loop {
            if events.take_notified() {
                return Ok(true);
            }
            let left = fd::time_left(deadline);
            if left == Some(Duration::ZERO) {
                return Ok(false);
            }
            if *leading {
                leading = match left {
                    None => self.turn.wait(leading).unwrap_or_else(|e| e.into_inner()),
                    Some(l) => self.turn.wait_timeout(leading, l).unwrap_or_else(|e| e.into_inner()).0,
                };
                continue;
            }
            *leading = true;
            drop(leading);
            let res = fd::wait_any_readable(&[self.fd(), self.wakeup.raw()], left)
                .map_err(|source| Error::Verb { verb: "poll", source })
                .and_then(|readable| {
                    self.wakeup.reset();
                    if readable {
                        self.take_event(true)?;
                    }
                    Ok(())
                });
            leading = self.lock();
            *leading = false;
            self.turn.notify_all();
            res?;
        }
    }
}

/// A completion event channel (`struct ibv_comp_channel`): a file descriptor that becomes
/// readable when an armed [`CompletionQueue`](crate::CompletionQueue) gets a completion. Any
/// number of CQs may share one channel.
///
/// Most programs wait with [`CompletionQueue::poll_wait`](crate::CompletionQueue::poll_wait),
/// which arms, polls and waits in the race-free order. The channel's own
/// [`try_get_event`](Self::try_get_event) and [`get_event`](Self::get_event) read one event
/// and say which CQ it is for; the crate counts events and acknowledges them in batches
/// (`ibv_ack_cq_events`) on [`req_notify`](crate::CompletionQueue::req_notify), every
/// 64 events, and when the CQ is dropped, so `ibv_destroy_cq` never blocks on
/// acknowledgements, whatever the caller does.
///
/// # Reactors
/// The channel implements [`AsFd`], handing out a private epoll descriptor that watches the
/// channel: it is readable exactly when the channel is, tokio's `AsyncFd`, async-io, mio or
/// `poll(2)` can watch it, and `read(2)` on it fails (`EINVAL`), so safe code holding it cannot
/// consume an event the crate would never acknowledge (after which `ibv_destroy_cq` would
/// block forever). [`AsRawFd`] gives the channel's own descriptor: watching it is fine, reading
/// it is a breach of this crate's contract (see the crate's *Safety model*). Readiness is
/// level-triggered: after a wake-up, call [`try_get_event`](Self::try_get_event) until it
/// returns `None`.
///
/// Cloning is cheap (an `Arc`).
#[derive(Clone)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel").field("fd", &self.as_raw_fd()).finish()
    }
}

impl CompletionChannel {
    pub(crate) fn new(ctx: &Context) -> Result<CompletionChannel> {
        // SAFETY: valid context; destroyed once in ChannelInner::drop (or just below).
        let raw = cvt_p("ibv_create_comp_channel", unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) })?;
        // SAFETY: the channel is valid; fd is a plain field written at creation.
        let fd = unsafe { (*raw.as_ptr()).fd };
        let made = fd::set_nonblocking(fd)
            .map_err(|source| Error::Verb { verb: "fcntl", source })
            .and_then(|()| ReadinessFd::new(fd).map_err(|source| Error::Verb { verb: "epoll_ctl", source }))
            .and_then(|ready| {
                let wakeup = Wakeup::new().map_err(|source| Error::Verb { verb: "eventfd", source })?;
                Ok((ready, wakeup))
            });
        let (ready, wakeup) = match made {
            Ok(v) => v,
            Err(e) => {
                // SAFETY: created above, no CQ uses it; destroyed once.
                unsafe { ffi::ibv_destroy_comp_channel(raw.as_ptr()) };
                return Err(e);
            }
        };
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                raw,
                ctx: ctx.inner.clone(),
                ready,
                leader: Mutex::new(false),
                turn: Condvar::new(),
                wakeup,
            }),
        })
    }

    /// Reads one completion event if there is one, without blocking (`ibv_get_cq_event()` on
    /// the non-blocking descriptor), and returns which CQ it is for. The event is counted and
    /// acknowledged by the crate (in batches). The CQ must be re-armed with
    /// [`CompletionQueue::req_notify`](crate::CompletionQueue::req_notify) for its next event.
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_get_cq_event()` fails other than with `EAGAIN`.
    #[doc(alias = "ibv_get_cq_event")]
    #[doc(alias = "ibv_ack_cq_events")]
    pub fn try_get_event(&self) -> Result<Option<CqId>> {
        self.inner.take_event(false)
    }

    /// Waits up to `timeout` (forever for `None`; `Some(Duration::ZERO)` is
    /// [`try_get_event`](Self::try_get_event)) for a completion event and returns which CQ it
    /// is for; `None` on timeout. Events read by other threads meanwhile are theirs: this
    /// keeps waiting for another one until the deadline. A signal does not end the wait early.
    ///
    /// # Errors
    /// [`Error::Verb`] when `poll(2)` or `ibv_get_cq_event()` fails.
    #[doc(alias = "ibv_get_cq_event")]
    #[doc(alias = "ibv_ack_cq_events")]
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<Option<CqId>> {
        fd::take_until(self.as_raw_fd(), timeout, || self.try_get_event())
    }

    /// The raw `struct ibv_comp_channel *`.
    pub fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.inner.raw.as_ptr()
    }
}

impl AsRawFd for CompletionChannel {
    /// The channel's own descriptor, to watch for readability, never to read (see the type's
    /// docs); [`AsFd`] gives a descriptor that is safe to hand to anything.
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd()
    }
}

impl AsFd for CompletionChannel {
    /// A private epoll descriptor that is readable exactly when the channel is (see the type's
    /// docs): register it with a reactor, then read events with
    /// [`try_get_event`](CompletionChannel::try_get_event).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.ready.as_fd()
    }
}

impl Context {
    /// Creates a completion event channel (`ibv_create_comp_channel()`), non-blocking.
    ///
    /// # Errors
    /// [`Error::Verb`] when the verb, or setting up the descriptors (`fcntl`, `epoll_ctl`,
    /// `eventfd`), fails.
    #[doc(alias = "ibv_create_comp_channel")]
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_counted_and_acknowledged_in_batches() {
        let ev = CqEvents::new(1);
        for _ in 0..ACK_BATCH - 1 {
            assert_eq!(ev.record(), 0);
        }
        assert!(ev.take_notified());
        assert!(!ev.take_notified());
        assert_eq!(ev.record(), ACK_BATCH, "the batch is full: the reader acknowledges it");
        assert!(ev.take_notified());
        assert_eq!(ev.take_pending(), 0);
        ev.record();
        ev.record();
        assert_eq!(ev.take_pending(), 2, "req_notify acknowledges what is pending");
        assert_eq!(ev.take_pending(), 0);
    }

    #[test]
    fn after_the_drop_began_readers_acknowledge_themselves() {
        let ev = CqEvents::new(1);
        ev.record();
        ev.record();
        ev.record();
        assert_eq!(ev.begin_drop(), 3, "the drop acknowledges what was counted");
        assert_eq!(ev.record(), 1, "a late reader acknowledges its own event");
        assert_eq!(ev.record(), 1);
        assert!(!ev.take_notified());
    }

    #[test]
    fn racing_readers_and_a_drop_acknowledge_every_event_once() {
        let (rounds, per) = if cfg!(miri) { (3, 40) } else { (20, 300) };
        for _ in 0..rounds {
            let ev = Arc::new(CqEvents::new(1));
            let acked = Arc::new(AtomicU32::new(0));
            let readers: Vec<_> = (0..3)
                .map(|_| {
                    let (ev, acked) = (ev.clone(), acked.clone());
                    std::thread::spawn(move || {
                        for _ in 0..per {
                            acked.fetch_add(ev.record(), Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            acked.fetch_add(ev.take_pending(), Ordering::Relaxed);
            acked.fetch_add(ev.begin_drop(), Ordering::Relaxed);
            for r in readers {
                r.join().unwrap();
            }
            assert_eq!(acked.load(Ordering::Relaxed), 3 * per);
        }
    }
}
