//! Posting on a queue pair: the safe level (checked, buffers owned until completion) and the
//! `unsafe` level at C's cost.

use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::attr::QpState;
use crate::error::{cvt, Error, PostError, Result};
use crate::pd::PdInner;
use crate::post::engine::{
    post_chain, post_light_one, post_one, post_prepared_chain, post_prepared_one, post_prepared_recv_one,
    post_recv_single, post_send_iter, post_send_single, RawPost,
};
use crate::post::ex::{self, ExQp};
use crate::post::prepared::{
    keep_pins, Pin, PreparedChainError, PreparedPost, PreparedRecv, PreparedScratch, PreparedSend,
};
use crate::post::ring::Ring;
use crate::post::slot::Request;
use crate::post::wr::{send_flags, send_or_write_opcode, Op};
use crate::post::LocalBuf;
use crate::post::{RecvRequest, ScopedRecv, ScopedSend, SendIterError, SendRequest, Slot, MAX_SGE};
use crate::queue::qp::{QpCaps, QpType, QueuePair};

impl QueuePair {
    /// Posts `wr` on the send queue through `post` (a verb other than `ibv_post_send` that
    /// posts there, e.g. `ibv_bind_mw`), with the state check of every safe post.
    pub(crate) fn post_send_via<R: Request>(&mut self, post: RawPost<R::Raw>, wr: &mut R) -> Result<()> {
        self.check_send_state()?;
        post_one(self.raw.as_ptr(), &self.send, Some(post), wr)
    }

    /// The QP's protection domain.
    pub(crate) fn pd_inner(&self) -> &Arc<crate::pd::PdInner> {
        &self.pd
    }

    /// Whether sends may be posted: one flag kept with the state (`set_state`), the error
    /// worked out apart.
    #[inline(always)]
    pub(super) fn check_send_state(&self) -> Result<()> {
        if !self.sendable {
            return Err(self.unsendable());
        }
        Ok(())
    }

    /// Why sends may not be posted ([`check_send_state`](Self::check_send_state)).
    #[cold]
    #[inline(never)]
    fn unsendable(&self) -> Error {
        if !self.has_send {
            return Error::InvalidArgument {
                verb: "ibv_post_send",
                reason: "an XRC target queue pair has no send queue",
            };
        }
        Error::QpState { verb: "ibv_post_send", state: self.state, expected: "RTS" }
    }

    pub(super) fn check_send(&self, wr: &SendRequest<'_>) -> Result<()> {
        self.check_send_state()?;
        self.check_send_request(wr)
    }

    /// Everything about a send request but the QP's state. Always inlined: as a call, its
    /// `Result` went through memory and cost post_send ~20 instructions under callgrind.
    #[inline(always)]
    pub(super) fn check_send_request(&self, wr: &SendRequest<'_>) -> Result<()> {
        let count = wr.validate(&self.pd)?;
        self.check_send_fit(wr, count)
    }

    /// The checks of a send request against this QP's type and capacities, given its entry count.
    #[inline]
    fn check_send_fit(&self, wr: &SendRequest<'_>, count: usize) -> Result<()> {
        send_fits(&self.pd, &self.caps, self.qp_type, wr, count)
    }

    pub(super) fn check_recv(&self, wr: &RecvRequest) -> Result<()> {
        self.check_recv_state()?;
        if wr.validate(&self.pd)? > self.caps.max_recv_sge as usize {
            return Err(Error::InvalidArgument {
                verb: "ibv_post_recv",
                reason: "more scatter/gather entries than the QP's max_recv_sge",
            });
        }
        Ok(())
    }

    fn check_recv_state(&self) -> Result<()> {
        if !self.has_recv {
            return Err(Error::InvalidArgument {
                verb: "ibv_post_recv",
                reason: "the queue pair has no receive queue of its own (it receives through a shared receive queue: post to the SRQ)",
            });
        }
        if self.state == QpState::RESET || self.state == QpState::UNUSABLE {
            return Err(Error::QpState {
                verb: "ibv_post_recv",
                state: self.state,
                expected: "INIT, RTR or RTS",
            });
        }
        Ok(())
    }

    /// Posts a scope's send request (see [`Scope::post_send`](crate::Scope::post_send)) with the
    /// checks of [`post_send`](Self::post_send); returns the send ring's position after it if
    /// it was posted (also when the provider queued it and then failed), and the outcome.
    pub(crate) fn post_scoped_send(&mut self, wr: &mut ScopedSend<'_>) -> (Option<u32>, Result<()>) {
        let before = self.send.producer_state().0;
        let r = (|| {
            self.check_send_state()?;
            let count = wr.validate(&self.pd)?;
            self.check_send_fit(&wr.wr, count)?;
            match &self.ex {
                None => post_one(self.raw.as_ptr(), &self.send, self.post_send_fn, wr),
                Some(ex) => ex::post_batch(
                    ex,
                    &self.send,
                    &mut self.chain,
                    &mut self.chain_sges,
                    std::slice::from_mut(wr),
                ),
            }
        })();
        (scoped_end(&self.send, before), r)
    }

    /// Posts a chain of a scope's send requests with one doorbell (see
    /// [`Scope::post_send_chain`](crate::Scope::post_send_chain)); returns the send ring's
    /// position after the last request posted if any was (also when an error left others
    /// unposted), and the outcome.
    pub(crate) fn post_scoped_send_chain(
        &mut self,
        wrs: &mut Vec<ScopedSend<'_>>,
    ) -> (Option<u32>, Result<()>) {
        let before = self.send.producer_state().0;
        let checked = wrs.iter().try_for_each(|wr| {
            self.check_send_state()?;
            let count = wr.validate(&self.pd)?;
            self.check_send_fit(&wr.wr, count)
        });
        let r = checked.and_then(|()| match &self.ex {
            Some(ex) => ex::post_chain(ex, &self.send, &mut self.chain, &mut self.chain_sges, wrs),
            None => {
                let qp = self.raw.as_ptr();
                post_chain(qp, &self.send, self.post_send_fn, &mut self.chain, &mut self.chain_sges, wrs)
            }
        });
        (scoped_end(&self.send, before), r)
    }

    /// Posts a scope's receive request (see [`Scope::post_recv`](crate::Scope::post_recv)) with
    /// the checks of [`post_recv`](Self::post_recv); returns the receive ring's position after
    /// it if it was posted (also when the provider queued it and then failed), and the outcome.
    pub(crate) fn post_scoped_recv(&mut self, wr: &mut ScopedRecv<'_>) -> (Option<u32>, Result<()>) {
        let before = self.recv.producer_state().0;
        let r = (|| {
            self.check_recv_state()?;
            if wr.validate(&self.pd)? > self.caps.max_recv_sge as usize {
                return Err(Error::InvalidArgument {
                    verb: "ibv_post_recv",
                    reason: "more scatter/gather entries than the QP's max_recv_sge",
                });
            }
            post_one(self.raw.as_ptr(), &self.recv, self.post_recv_fn, wr)
        })();
        (scoped_end(&self.recv, before), r)
    }

    /// Posts one send-queue work request (`ibv_post_send()`), safely: the QP keeps the request's
    /// buffers (and address handle) until the completion is polled from the send CQ, whose
    /// [`Completion`](crate::Completion) hands them back. On an extended queue pair
    /// ([`QueuePairBuilder::send_ops`](crate::QueuePairBuilder::send_ops)) the request goes
    /// through `ibv_wr_start`, its `ibv_wr_*` builder and setters, and `ibv_wr_complete`, with the
    /// same guarantees.
    ///
    /// # Errors
    /// A [`PostError`] handing the request back, with [`Error::QpState`] before RTS,
    /// [`Error::QueueFull`] when `max_send_wr` requests are outstanding, [`Error::InvalidArgument`]
    /// or [`Error::OutOfBounds`] for a request the QP cannot take, [`Error::SendOpNotEnabled`]
    /// for an operation an extended QP was not created for, or [`Error::Verb`] when the
    /// provider refuses it. [`Error::QueuedWithError`] when the provider queued the request and
    /// then failed: it stays posted, and the `PostError` holds the request without its buffers.
    #[doc(alias = "ibv_post_send")]
    #[doc(alias = "ibv_wr_start")]
    #[doc(alias = "ibv_wr_complete")]
    // The request comes back by value on error: boxing it would allocate on the post path.
    #[allow(clippy::result_large_err)]
    #[inline(always)]
    pub fn post_send<'a>(&mut self, mut wr: SendRequest<'a>) -> Result<(), PostError<SendRequest<'a>>> {
        // A light request (inline data or none, on a connected classic queue pair that may
        // send) takes the light path, inlined into the caller: its checks are a few tests of
        // fields the caller often just wrote, its slot holds nothing.
        if self.light_sends && wr.is_light(self.caps.max_inline_data) {
            // Its fields read out, the request is forgotten (it holds nothing: light) and built
            // again only if the post fails, so that a request built by the caller need not be
            // written to memory, only the fields read here.
            let light = wr.light();
            std::mem::forget(wr);
            // SAFETY: our live QP, its send ring and provider call, `&mut self` held;
            // `light_sends` says it is RC or UC, classic and may post sends, and `light` was
            // read from a request light for its max_inline_data.
            return match unsafe { post_light_one(self.raw.as_ptr(), &self.send, self.post_send_fn, &light) } {
                Ok(()) => Ok(()),
                Err(error) => Err(PostError { error, request: light.into_request() }),
            };
        }
        // A Send or RDMA Write of one whole region (the common one-buffer post), inlined too:
        // its entry and fields read out, the request is forgotten and built again only if the
        // post fails, as for a light one.
        if let Some((raw, sge)) = self.single_send(&wr) {
            let entry = wr.sges[0].take();
            // No inline data, window, address handle or XRC SRQ (single_send), no other entry.
            let fields = wr.light();
            std::mem::forget(wr);
            let (qp, post) = (self.raw.as_ptr(), self.post_send_fn);
            // SAFETY: our live QP, its send ring and provider call, `&mut self` held;
            // `single_send` checked the request as `check_send` does (it holds no window or
            // address handle: nothing to bind) and wrote its work request and the SGE of its
            // only entry, now `entry`.
            return match unsafe { post_send_single(qp, &self.send, post, entry, fields.wr_id, raw, sge) } {
                Ok(()) => Ok(()),
                Err((error, entry)) => Err(PostError { error, request: fields.into_request_with(entry) }),
            };
        }
        self.post_send_general(wr)
    }

    /// [`post_send`](Self::post_send) of any request: checks, buffers moved into the slot.
    #[inline(never)]
    #[allow(clippy::result_large_err)] // as post_send
    fn post_send_general<'a>(&mut self, mut wr: SendRequest<'a>) -> Result<(), PostError<SendRequest<'a>>> {
        // `mut wr`, not `let mut wr = wr;` below: that rebinding copied the whole request (a
        // `memcpy` call of ~400 bytes, 64 instructions under callgrind).
        if let Err(error) = self.check_send(&wr) {
            return Err(PostError { error, request: wr });
        }
        wr.bind_to(self.id, self.qp_num());
        let posted = match &self.ex {
            None => post_one(self.raw.as_ptr(), &self.send, self.post_send_fn, &mut wr),
            Some(ex) => ex::post_batch(
                ex,
                &self.send,
                &mut self.chain,
                &mut self.chain_sges,
                std::slice::from_mut(&mut wr),
            ),
        };
        match posted {
            Ok(()) => {
                wr.release_posted();
                // Holds nothing now: forgetting it skips only tests of its empty fields.
                std::mem::forget(wr);
                Ok(())
            }
            Err(error) => Err(PostError { error, request: wr }),
        }
    }

    /// The work request and SGE of a send request that [`post_send_single`] may post: a Send or
    /// RDMA Write (with immediate data or not) of exactly one entry (the others empty) over a
    /// whole [`LocalBuf::Owned`], [`Shared`](LocalBuf::Shared) or [`Remote`](LocalBuf::Remote)
    /// region of this QP's protection domain, not empty and within the remote slice, without
    /// inline data, window, address handle or XRC SRQ, signaled if the buffer is owned, on a
    /// classic RC or UC queue pair that may post sends (`light_sends`) with room for one entry:
    /// every check of [`check_send`](Self::check_send) for such a request. `None` sends the
    /// request down the general checks, which say why when it fails.
    #[inline(always)]
    fn single_send(&self, wr: &SendRequest<'_>) -> Option<(ffi::ibv_send_wr, ffi::ibv_sge)> {
        let [Some(local), None, None, None] = &wr.sges else { return None };
        if !self.light_sends
            || self.caps.max_send_sge < 1
            || wr.inline.is_some()
            || wr.window.is_some()
            || wr.ud.is_some()
            || wr.xrc_srqn.is_some()
            || local.len == 0
        {
            return None;
        }
        let mr = local.buf.whole_region()?;
        if !mr.in_pd(&self.pd) || (!wr.signaled && matches!(local.buf, LocalBuf::Owned(_))) {
            return None;
        }
        let write_to = match wr.op {
            Op::Send => None,
            Op::Write(r) if u64::from(local.len) <= r.len => Some(r),
            _ => return None,
        };
        let mut raw = ffi::ibv_send_wr::default();
        raw.opcode = send_or_write_opcode(&mut raw, write_to, wr.imm.is_some());
        if let Some(imm) = wr.imm {
            raw.__bindgen_anon_1.imm_data = imm.to_be();
        }
        raw.send_flags = send_flags(wr.signaled, wr.fence, wr.solicited);
        Some((raw, local.sge_in(mr)))
    }

    /// Posts a chain of send requests with one `ibv_post_send()` call (one doorbell), safely.
    /// On success `wrs` is empty; on error it holds the requests that were not posted (the first
    /// is the one the provider refused), with their buffers.
    ///
    /// On an extended queue pair ([`QueuePairBuilder::send_ops`](crate::QueuePairBuilder::send_ops))
    /// the chain is one `ibv_wr_start` ... `ibv_wr_complete` sequence (one doorbell): on an
    /// error before it `wrs` holds every request; a failing `ibv_wr_complete` leaves every
    /// request posted (rxe queues the batch before its doorbell can fail) and `wrs` empty.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send); checks that apply to every request run before anything
    /// is posted, and [`Error::QueueFull`] is reported before posting when the chain does not fit.
    /// [`Error::QueuedWithError`] when the provider queued every request and then failed (on an
    /// extended queue pair: any failure of `ibv_wr_complete`). On an extended queue pair,
    /// [`Error::SendOpNotEnabled`] for a request whose operation the QP was not created for.
    #[doc(alias = "ibv_post_send")]
    #[doc(alias = "ibv_wr_complete")]
    pub fn post_send_chain(&mut self, wrs: &mut Vec<SendRequest<'_>>) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        // The state once (it cannot change during the call), then the requests in one pass: a
        // bind recorded on a request that then is not posted (a later one fails its check) is
        // harmless, as when the provider refuses it (it is re-recorded when posted).
        self.check_send_state()?;
        let (id, qp_num) = (self.id, self.qp_num());
        for wr in wrs.iter_mut() {
            self.check_send_request(wr)?;
            wr.bind_to(id, qp_num);
        }
        if let Some(ex) = &self.ex {
            return ex::post_chain(ex, &self.send, &mut self.chain, &mut self.chain_sges, wrs);
        }
        let qp = self.raw.as_ptr();
        post_chain(qp, &self.send, self.post_send_fn, &mut self.chain, &mut self.chain_sges, wrs)
    }

    /// [`post_send_chain`](Self::post_send_chain) of the requests an iterator yields, each
    /// checked, written into the chain and moved into its slot as it comes (one
    /// `ibv_post_send()` call, one doorbell): no request is moved into a `Vec` first, which for
    /// a chain of small requests costs about as much as the checks (a 312-byte copy each).
    ///
    /// ```no_run
    /// # fn f(qp: &mut ibverbs::QueuePair, peer: ibverbs::RemoteSlice) -> Result<(), ibverbs::Error> {
    /// use ibverbs::SendRequest;
    /// let data = [7u8; 8];
    /// // 16 inline writes of 8 bytes, only the last signaled: one doorbell.
    /// qp.post_send_iter((0..16u64).map(|i| {
    ///     let wr = SendRequest::write_inline(&data, peer.slice(8 * i, 8).unwrap()).wr_id(i);
    ///     if i < 15 { wr.unsignaled() } else { wr }
    /// }))?;
    /// # Ok(()) }
    /// ```
    ///
    /// Unlike `post_send_chain`, the requests are consumed: when one fails its checks or finds
    /// no room, nothing is posted, that request comes back in the error
    /// ([`SendIterError::request`](crate::SendIterError::request)) and the ones taken before it
    /// are dropped with their buffers. Use `post_send_chain` for requests whose owned buffers
    /// you need back on error. If the iterator panics, the requests it yielded before are
    /// leaked (not posted, their buffers never freed).
    ///
    /// On an extended queue pair ([`QueuePairBuilder::send_ops`](crate::QueuePairBuilder::send_ops))
    /// an iterator of one request posts as [`post_send`](Self::post_send) does; longer ones
    /// are refused ([`Error::InvalidArgument`]: use `post_send_chain` there).
    ///
    /// # Errors
    /// A [`SendIterError`](crate::SendIterError) with the number of requests that reached the
    /// device (0 for every check): as [`post_send`](Self::post_send) for any request,
    /// [`Error::QueueFull`] when the iterator yields more requests than the send queue (or the
    /// QP's chain scratch, `max_send_wr` long) has room for (the requests up to and including
    /// the one found without room are taken from the iterator), or [`Error::Verb`] when the
    /// provider refuses one (the ones before it are posted; the rest are dropped).
    #[doc(alias = "ibv_post_send")]
    #[allow(clippy::result_large_err)] // as post_send: the refused request comes back whole
    pub fn post_send_iter<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = SendRequest<'a>>,
    ) -> std::result::Result<(), SendIterError<'a>> {
        let refuse = |error, request| SendIterError { posted: 0, error, request };
        if let Err(error) = self.check_send_state() {
            return Err(refuse(error, None));
        }
        let wrs = wrs.into_iter();
        if wrs.size_hint() == (1, Some(1)) || self.ex.is_some() {
            let mut wrs = wrs.peekable();
            return match (wrs.next(), wrs.peek().is_some()) {
                (None, _) => Ok(()),
                (Some(wr), false) => {
                    self.post_send(wr).map_err(|e| SendIterError { posted: 0, error: e.error, request: Some(e.request) })
                }
                (Some(wr), true) => Err(refuse(
                    Error::InvalidArgument {
                        verb: "ibv_post_send",
                        reason: "post_send_iter chains are for queue pairs posted through ibv_post_send (not send_ops)",
                    },
                    Some(wr),
                )),
            };
        }
        let (id, qp_num, qp_type) = (self.id, self.qp_num(), self.qp_type);
        let (pd, caps) = (&self.pd, &self.caps);
        let check = |wr: &mut SendRequest<'a>| {
            let count = wr.validate(pd)?;
            send_fits(pd, caps, qp_type, wr, count)?;
            wr.bind_to(id, qp_num);
            Ok(())
        };
        let qp = self.raw.as_ptr();
        let light = self.light_sends.then_some(self.caps.max_inline_data);
        post_send_iter(
            qp,
            &self.send,
            self.post_send_fn,
            &mut self.chain,
            &mut self.chain_sges,
            wrs,
            light,
            check,
        )
    }

    /// Posts one receive request (`ibv_post_recv()`), safely: the QP keeps its buffers until the
    /// completion hands them back.
    ///
    /// # Errors
    /// A [`PostError`] handing the request back: [`Error::InvalidArgument`] on a queue pair
    /// built on a shared receive queue (post to the SRQ instead), [`Error::QpState`] in RESET,
    /// [`Error::QueueFull`] when `max_recv_wr` receives are outstanding,
    /// [`Error::InvalidArgument`] for a buffer the device may not write, [`Error::Verb`] when the
    /// provider refuses it; [`Error::QueuedWithError`] as for [`post_send`](Self::post_send).
    #[doc(alias = "ibv_post_recv")]
    #[allow(clippy::result_large_err)] // as post_send: no allocation on the post path
    #[inline(always)]
    pub fn post_recv(&mut self, mut wr: RecvRequest) -> Result<(), PostError<RecvRequest>> {
        // The common receive, one entry over a whole owned or remote-exposed region, takes the
        // single path, inlined into the caller: its checks are a few tests of what the caller
        // often just built, and nothing of the request but its entry is read or moved.
        if let Some(sge) = self.single_recv_sge(&wr) {
            // Its entry and `wr_id` read out, the request (which holds nothing else) is
            // forgotten and built again only if the post fails, so that a request built by the
            // caller need not be written to memory.
            let (entry, wr_id) = (wr.sges[0].take(), wr.wr_id);
            std::mem::forget(wr);
            let (qp, post) = (self.raw.as_ptr(), self.post_recv_fn);
            // SAFETY: our live QP, its receive ring and provider call, `&mut self` held;
            // `single_recv_sge` checked the request as `check_recv` does and built the SGE of
            // its only entry, now `entry`.
            return match unsafe { post_recv_single(qp, &self.recv, post, entry, wr_id, sge) } {
                Ok(()) => Ok(()),
                Err((error, entry)) => Err(PostError { error, request: RecvRequest::again(entry, wr_id) }),
            };
        }
        self.post_recv_general(wr)
    }

    /// The SGE of a receive request that [`post_recv_single`] may post: exactly one entry (the
    /// others empty), over a whole [`LocalBuf::Owned`] or [`LocalBuf::Remote`] region (both
    /// device-writable) of this QP's protection domain, not empty, on a queue pair with a
    /// receive queue of its own in a state that takes receives and room for one entry: every
    /// check of [`check_recv`](Self::check_recv) for such a request. `None` sends the request
    /// down the general path, which checks it again and says why when it fails.
    #[inline(always)]
    fn single_recv_sge(&self, wr: &RecvRequest) -> Option<ffi::ibv_sge> {
        let [Some(local), None, None, None] = &wr.sges else { return None };
        let mr = local.buf.writable_region()?;
        let takes = self.has_recv
            && self.state != QpState::RESET
            && self.state != QpState::UNUSABLE
            && self.caps.max_recv_sge >= 1
            && local.len != 0
            && mr.in_pd(&self.pd);
        takes.then(|| local.sge_in(mr))
    }

    /// [`post_recv`](Self::post_recv) of any request: checks, buffers moved into the slot.
    #[inline(never)]
    #[allow(clippy::result_large_err)] // as post_send
    fn post_recv_general(&mut self, mut wr: RecvRequest) -> Result<(), PostError<RecvRequest>> {
        // `mut wr`: a `let mut wr = wr;` rebinding copies the request (see post_send).
        if let Err(error) = self.check_recv(&wr) {
            return Err(PostError { error, request: wr });
        }
        match post_one(self.raw.as_ptr(), &self.recv, self.post_recv_fn, &mut wr) {
            Ok(()) => Ok(()),
            Err(error) => Err(PostError { error, request: wr }),
        }
    }

    /// Posts a chain of receive requests with one `ibv_post_recv()` call, safely. On success
    /// `wrs` is empty; on error it holds the requests not posted.
    ///
    /// # Errors
    /// As [`post_recv`](Self::post_recv).
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv_chain(&mut self, wrs: &mut Vec<RecvRequest>) -> Result<()> {
        for wr in wrs.iter() {
            self.check_recv(wr)?;
        }
        let qp = self.raw.as_ptr();
        post_chain(qp, &self.recv, self.post_recv_fn, &mut self.recv_chain, &mut self.recv_chain_sges, wrs)
    }

    /// Keeps `new` (a prepared request's buffer and address handle) for the posts of this queue
    /// pair until it is dropped. When no post of the queue pair is outstanding, pins nobody else
    /// holds (their requests are dropped, and no slot relies on them) are let go first, so the
    /// list stays as long as the buffers in use.
    fn pin(&self, new: [Option<crate::post::prepared::Pin>; 2]) {
        pin_to(&self.pins, &self.send, new);
    }

    /// Checks `wr` once for this queue pair and keeps its buffer for
    /// [`post_prepared_recv`](Self::post_prepared_recv). The request must have exactly one
    /// scatter/gather entry over an `Arc<RemoteMemoryRegion>` (the one buffer type the device
    /// may write while others hold it): the queue pair keeps a handle of it for the posts, so
    /// their slots hold nothing and their completions hand no buffer back (see
    /// [`PreparedRecv`]). The QP's state is checked at each post.
    ///
    /// # Errors
    /// A [`PostError`] handing the request back: [`Error::InvalidArgument`] on a queue pair
    /// that receives through a shared receive queue, for a buffer of another protection domain,
    /// or for a request with more or fewer than one entry or another buffer type.
    #[allow(clippy::result_large_err)] // the request comes back whole
    pub fn prepare_recv(&self, wr: RecvRequest) -> Result<PreparedRecv, PostError<RecvRequest>> {
        let checked = if self.has_recv { wr.validate(&self.pd).map(|_| ()) } else { self.check_recv_state() };
        if let Err(error) = checked {
            return Err(PostError { error, request: wr });
        }
        let p = PreparedRecv::from_checked(self.id, &wr, "ibv_post_recv")
            .map_err(|error| PostError { error, request: wr })?;
        pin_to(&self.recv_pins, &self.recv, [Some(p.pin()), None]);
        Ok(p)
    }

    /// Posts a prepared receive (`ibv_post_recv()`) with `wr_id` into bytes
    /// `offset..offset + len` of its buffer, the only check left per post. The queue pair holds
    /// the buffer for the post (see [`PreparedRecv`]): its completion hands no buffer back; read
    /// what arrived from the `RemoteMemoryRegion` (`read`, `to_vec`) at the offset you posted.
    ///
    /// # Errors
    /// [`Error::QpState`] in RESET, [`Error::InvalidArgument`] for a receive prepared for
    /// another queue pair, [`Error::OutOfBounds`] for a range outside the buffer,
    /// [`Error::QueueFull`] when `max_recv_wr` receives are outstanding, or [`Error::Verb`]
    /// when the provider refuses it ([`Error::QueuedWithError`] when it queued the receive and
    /// then failed: it stays posted).
    #[doc(alias = "ibv_post_recv")]
    pub fn post_prepared_recv(
        &mut self,
        prepared: &PreparedRecv,
        wr_id: u64,
        offset: usize,
        len: u32,
    ) -> Result<()> {
        self.check_recv_state()?;
        prepared.check(self.id, offset, len, "ibv_post_recv")?;
        post_prepared_recv_one(self.raw.as_ptr(), &self.recv, self.post_recv_fn, prepared, wr_id, offset, len)
    }

    /// Checks `wr` once for this queue pair and keeps its fixed parts (opcode, flags, remote key,
    /// immediate data, UD destination, local key) for [`post_prepared`](Self::post_prepared).
    /// The request must have exactly one scatter/gather entry over a *shared* buffer
    /// (`Arc<MemoryRegion>` or `Arc<RemoteMemoryRegion>`, which the queue pair keeps a handle of
    /// for the posts: see [`PreparedSend`]), or be a Send or RDMA Write with inline data, whose
    /// posts bring their bytes ([`post_prepared_inline`](Self::post_prepared_inline)). The QP's
    /// state is checked at each post, so a QP may be prepared for before it is connected. Posts
    /// of at most `max_inline_data` bytes of a Send or RDMA Write from an `Arc<MemoryRegion>` go
    /// inline (see [`PreparedSend`]).
    ///
    /// # Errors
    /// A [`PostError`] handing the request back: any error [`post_send`](Self::post_send) reports
    /// for the request itself, or [`Error::InvalidArgument`] for a request without inline data
    /// with more or fewer than one entry, or over an owned buffer. An extended queue pair's
    /// operations ([`Error::SendOpNotEnabled`]) are checked at each post, not here.
    #[allow(clippy::result_large_err)] // the request comes back whole
    pub fn prepare_send<'a>(&self, wr: SendRequest<'a>) -> Result<PreparedSend, PostError<SendRequest<'a>>> {
        if let Err(error) = self.check_send_request(&wr) {
            return Err(PostError { error, request: wr });
        }
        match PreparedSend::from_checked(self.id, self.caps.max_inline_data, &wr) {
            Some(p) => {
                self.pin(p.pins());
                Ok(p)
            }
            None => Err(PostError {
                error: Error::InvalidArgument {
                    verb: "ibv_post_send",
                    reason: "a prepared request has inline data, or one entry over a shared (Arc) buffer",
                },
                request: wr,
            }),
        }
    }

    /// Posts a prepared request (`ibv_post_send()`) with `wr_id`, local bytes
    /// `offset..offset + len` of its buffer and (for RDMA Write/Read and atomics) remote bytes
    /// `remote_offset..remote_offset + len` of its remote range — the only checks left per post.
    /// The queue pair holds the buffer for the post (see [`PreparedSend`]): its completion hands
    /// no buffer back. On an extended queue pair
    /// ([`QueuePairBuilder::send_ops`](crate::QueuePairBuilder::send_ops)) the post goes through
    /// `ibv_wr_start`, its `ibv_wr_*` builder and `ibv_wr_complete`.
    ///
    /// # Errors
    /// [`Error::QpState`] before RTS, [`Error::InvalidArgument`] for a request prepared for
    /// another queue pair (or a remote offset on a Send, or an atomic not of 8 aligned bytes),
    /// [`Error::OutOfBounds`] for ranges outside the buffer or the remote range,
    /// [`Error::QueueFull`], [`Error::SendOpNotEnabled`] for an operation an extended QP was not
    /// created for, or [`Error::Verb`] when the provider refuses it
    /// ([`Error::QueuedWithError`] when it queued the post and then failed: it stays posted).
    #[doc(alias = "ibv_post_send")]
    #[doc(alias = "ibv_wr_start")]
    #[doc(alias = "ibv_wr_complete")]
    // Inlined into the caller, as C's `ibv_post_send` is (`static inline`): a call of its own
    // cost 46 instructions per post (callgrind, `post_poll` Prepared:1: ours 149 -> 103; with
    // `#[inline]`, which left it a call, 132).
    #[inline(always)]
    pub fn post_prepared(
        &mut self,
        prepared: &PreparedSend,
        wr_id: u64,
        offset: usize,
        len: u32,
        remote_offset: u64,
    ) -> Result<()> {
        self.check_send_state()?;
        // post_prepared_single's work, spelled out for this one caller (the chains of one keep
        // it): the refused post's fields go to its error one by one, and an extended QP's post
        // is a call of its own. With a whole post passed to either, the post was written to the
        // stack on the path that posts too (6 instructions a post, callgrind); in
        // post_prepared_single itself the change cost the 32-post chains ~35 instructions.
        if prepared.qp != self.id || !prepared.limits.fits(offset, len, remote_offset) {
            return Err(refused_prepared(prepared, self.id, offset, len, remote_offset));
        }
        let post = prepared.at(wr_id, offset, len, remote_offset);
        match &self.ex {
            // SAFETY: our live QP and send ring, its provider call; `&mut self` held and `post`
            // checked for this queue pair just above.
            None => unsafe { post_prepared_one(self.raw.as_ptr(), &self.send, self.post_send_fn, &post) },
            Some(ex) => post_prepared_ex(ex, &self.send, &mut self.chain, &mut self.chain_sges, post),
        }
    }

    /// [`post_prepared`](Self::post_prepared) of one post with its own flags (a chain of one
    /// too), the QP's state checked: on the stack (cheaper than the chain's scratch set-up), or
    /// through the builder table of an extended QP.
    #[inline(always)] // outlined, the 48-byte post passed by value cost 16 instructions (callgrind)
    fn post_prepared_single(&mut self, post: PreparedPost<'_>) -> Result<()> {
        let p = post.prepared;
        if p.qp != self.id || !p.limits.fits(post.offset, post.len, post.remote_offset) {
            return Err(post.error(self.id));
        }
        // SAFETY: checked just above.
        unsafe { self.post_checked_prepared(post) }
    }

    /// Posts a prepared request (`ibv_post_send()`) with `wr_id`, bringing its bytes: `data`,
    /// copied inline by the provider during the call (so `data` is free again when it returns),
    /// into remote bytes `remote_offset..remote_offset + data.len()` of an RDMA Write's remote
    /// range (0 for a Send). The request was prepared from a
    /// [`SendRequest::send_inline`](crate::SendRequest::send_inline) or
    /// [`SendRequest::write_inline`](crate::SendRequest::write_inline); the data it was
    /// prepared with is not used. The post's slot holds nothing and its completion hands no
    /// buffer back. This is `ib_write_lat`'s small-message post (one prebuilt inline request,
    /// posted again and again) at the safe level. On an extended queue pair the post goes
    /// through `ibv_wr_start` ... `ibv_wr_complete`, as for [`post_prepared`](Self::post_prepared).
    ///
    /// # Errors
    /// [`Error::QpState`] before RTS, [`Error::InvalidArgument`] for a request prepared for
    /// another queue pair or over a buffer, for more than `max_inline_data` bytes, or a remote
    /// offset on a Send, [`Error::OutOfBounds`] for a range outside the remote range,
    /// [`Error::QueueFull`], [`Error::SendOpNotEnabled`] for an operation an extended QP was not
    /// created for, or [`Error::Verb`] when the provider refuses it
    /// ([`Error::QueuedWithError`] when it queued the post and then failed: it stays posted).
    #[doc(alias = "ibv_post_send")]
    #[doc(alias = "IBV_SEND_INLINE")]
    #[doc(alias = "ibv_wr_start")]
    #[doc(alias = "ibv_wr_complete")]
    pub fn post_prepared_inline(
        &mut self,
        prepared: &PreparedSend,
        wr_id: u64,
        data: &[u8],
        remote_offset: u64,
    ) -> Result<()> {
        self.check_send_state()?;
        // The post names `data` by address and borrows it (the provider copies inline data
        // during the post, within this call).
        let post = prepared.inline_post(self.id, wr_id, data, remote_offset)?;
        // SAFETY: inline_post checked it for this queue pair.
        unsafe { self.post_checked_prepared(post) }
    }

    /// Posts one checked prepared post: its request's staged request, or through the builder
    /// table of an extended QP.
    ///
    /// # Safety
    /// `post` was checked for this queue pair: prepared for it (`post.prepared.qp == self.id`),
    /// its ranges within the request's limits.
    #[inline(always)]
    unsafe fn post_checked_prepared(&mut self, post: PreparedPost<'_>) -> Result<()> {
        match &self.ex {
            // SAFETY: our live QP and send ring, its provider call; `&mut self` held and `post`
            // checked for us (contract).
            None => unsafe { post_prepared_one(self.raw.as_ptr(), &self.send, self.post_send_fn, &post) },
            Some(ex) => post_prepared_ex(ex, &self.send, &mut self.chain, &mut self.chain_sges, post),
        }
    }

    /// Posts a chain of prepared requests (each built with [`PreparedSend::at`], optionally
    /// [`unsignaled`](crate::PreparedPost::unsignaled)) with one `ibv_post_send()` call (one
    /// doorbell). Every post is checked as by [`post_prepared`](Self::post_prepared) before
    /// anything is posted. A chain of one is posted as `post_prepared` posts (on the stack, no
    /// scratch), signaled or not as the post says.
    ///
    /// # Errors
    /// A [`PreparedChainError`] with the number of posts that reached the device (0 for every
    /// check below) and the error: as [`post_prepared`](Self::post_prepared) for any of them,
    /// [`Error::QueueFull`] when the chain does not fit, [`Error::InvalidArgument`] for a chain
    /// of more than one on an extended queue pair
    /// ([`QueuePairBuilder::send_ops`](crate::QueuePairBuilder::send_ops): post them one by one
    /// there), or [`Error::Verb`] when the provider
    /// refuses one (the ones before it are posted); [`Error::QueuedWithError`] when it queued
    /// all of them and then failed (`posted` is the chain's length).
    #[doc(alias = "ibv_post_send")]
    pub fn post_prepared_chain(
        &mut self,
        posts: &[PreparedPost<'_>],
    ) -> std::result::Result<(), PreparedChainError> {
        self.post_prepared_iter(posts.iter().copied())
    }

    /// [`post_prepared_chain`](Self::post_prepared_chain) of the posts an iterator yields, each
    /// checked and written into the chain as it comes: no array of [`PreparedPost`]s is built
    /// first (building one and moving it into place costs about as much as the checks).
    ///
    /// ```no_run
    /// # fn f(qp: &mut ibverbs::QueuePair, p: &ibverbs::PreparedSend) -> Result<(), ibverbs::PreparedChainError> {
    /// // 16 writes of 64 bytes each, only the last signaled: one doorbell.
    /// qp.post_prepared_iter((0..16u64).map(|i| {
    ///     let post = p.at(i, 64 * i as usize, 64, 64 * i);
    ///     if i < 15 { post.unsignaled() } else { post }
    /// }))
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`post_prepared_chain`](Self::post_prepared_chain): nothing is posted when a post fails
    /// its checks or the iterator yields more posts than the send queue has room for
    /// ([`Error::QueueFull`]; the posts up to and including the one found without room are
    /// taken from the iterator).
    #[doc(alias = "ibv_post_send")]
    pub fn post_prepared_iter<'p>(
        &mut self,
        posts: impl IntoIterator<Item = PreparedPost<'p>>,
    ) -> std::result::Result<(), PreparedChainError> {
        let refuse = |error| PreparedChainError { posted: 0, error };
        self.check_send_state().map_err(refuse)?;
        let mut posts = posts.into_iter();
        if posts.size_hint() == (1, Some(1)) {
            let Some(one) = posts.next() else { return Ok(()) };
            self.post_prepared_single(one).map_err(refuse)?;
            // A size hint is no promise: an iterator that yields more is refused, not cut short.
            return match posts.next() {
                None => Ok(()),
                Some(_) => Err(more_than_hinted()),
            };
        }
        if self.ex.is_some() {
            let mut posts = posts.peekable();
            return match (posts.next(), posts.peek()) {
                (None, _) => Ok(()),
                (Some(one), None) => self.post_prepared_single(one).map_err(refuse),
                (Some(_), Some(_)) => Err(refuse(Error::InvalidArgument {
                    verb: "ibv_post_send",
                    reason:
                        "post_prepared_chain is for queue pairs posted through ibv_post_send (not send_ops)",
                })),
            };
        }
        let len = self.chain.len();
        let scratch = self.prepared.get_or_insert_with(|| PreparedScratch::new(len));
        post_prepared_chain(self.raw.as_ptr(), self.id, &self.send, self.post_send_fn, scratch, posts)
    }

    /// Posts a raw chain of send requests (`ibv_post_send()`) at exactly C's cost: no checks, no
    /// buffer tracking. Poll their completions with
    /// [`CompletionQueue::poll_raw`](crate::CompletionQueue::poll_raw) (or `poll`, which passes
    /// untracked completions through).
    ///
    /// # Errors
    /// [`Error::Verb`] with the provider's error; `bad_wr` then points at the first request not
    /// posted. [`Error::InvalidArgument`] when the provider has no `post_send`.
    ///
    /// # Safety
    /// - `wr` heads a valid, `NULL`-terminated chain of `ibv_send_wr`s whose SGEs name memory
    ///   registered (with the `lkey` given) in this QP's protection domain;
    /// - that memory stays registered and allocated until the request's completion is polled (for
    ///   unsignaled requests: until a later signaled request of this QP completes), or until this
    ///   QP is dropped; on siw a later request completes before an RDMA Read or atomic posted
    ///   ahead of it unless it carries `IBV_SEND_FENCE`, so there an unfenced later completion
    ///   does not end a Read or atomic (the safe level fences for that reason);
    /// - an SGE of length 0 counts as naming the 2 GiB from its address up to the end of its
    ///   memory region (Mellanox devices read a byte count of 0 so; mlx4 passes a receive's as
    ///   is): the conditions here hold for that memory too, or the chain has no such SGE;
    /// - memory the device writes (receive/Read/atomic targets) is not read or written through
    ///   Rust references meanwhile; memory it reads is not written meanwhile — in particular no
    ///   request writes into a [`MemoryRegion`](crate::MemoryRegion) that safe code can borrow
    ///   (one owned by the caller), only into memory the caller manages itself or into a
    ///   [`RemoteMemoryRegion`](crate::RemoteMemoryRegion);
    /// - no request binds a memory window to memory of a local-only
    ///   [`MemoryRegion`](crate::MemoryRegion) or otherwise grants remote write or atomic access to
    ///   it (`IBV_WR_BIND_MW`);
    /// - address handles of UD requests stay alive as long as the request;
    /// - every `wr_id` has bit 63 clear (bit 63 marks the safe level's requests).
    ///
    /// Not a safety condition, but the caller's duty: the completions of raw requests need room
    /// in the send CQ that the safe level does not reserve — keep them within
    /// [`CompletionQueue::unreserved`](crate::CompletionQueue::unreserved), or completions are lost.
    ///
    /// Inline data is copied during the call and may be reused as soon as it returns.
    #[doc(alias = "ibv_post_send")]
    pub unsafe fn post_send_unchecked(
        &self,
        wr: *mut ffi::ibv_send_wr,
        bad_wr: &mut *mut ffi::ibv_send_wr,
    ) -> Result<()> {
        // Not `ok_or(Error::...)`: that builds (and drops) the error on every call, which
        // callgrind counts on this path.
        let Some(f) = self.provider_post_send else {
            return Err(Error::InvalidArgument { verb: "ibv_post_send", reason: "no post_send" });
        };
        // SAFETY: the caller's contract.
        cvt("ibv_post_send", unsafe { f(self.raw.as_ptr(), wr, bad_wr) })
    }

    /// Posts a raw chain of receive requests (`ibv_post_recv()`) at exactly C's cost.
    ///
    /// # Errors
    /// [`Error::Verb`] with the provider's error; [`Error::InvalidArgument`] when the provider
    /// has no `post_recv`.
    ///
    /// # Safety
    /// As [`post_send_unchecked`](Self::post_send_unchecked): `wr` heads a valid,
    /// `NULL`-terminated chain of `ibv_recv_wr`s whose SGEs name memory registered in this QP's
    /// protection domain, which stays registered, allocated and untouched by Rust references
    /// until the completion is polled or the QP is dropped — never memory of a
    /// [`MemoryRegion`](crate::MemoryRegion) that safe code can borrow — and every `wr_id` has
    /// bit 63 clear. An SGE of length 0 names up to 2 GiB, as for sends. Their completions need
    /// CQ room as for sends.
    #[doc(alias = "ibv_post_recv")]
    pub unsafe fn post_recv_unchecked(
        &self,
        wr: *mut ffi::ibv_recv_wr,
        bad_wr: &mut *mut ffi::ibv_recv_wr,
    ) -> Result<()> {
        // Not `ok_or(Error::...)`: that builds (and drops) the error on every call, which
        // callgrind counts on this path.
        let Some(f) = self.post_recv_fn else {
            return Err(Error::InvalidArgument { verb: "ibv_post_recv", reason: "no post_recv" });
        };
        // SAFETY: the caller's contract.
        cvt("ibv_post_recv", unsafe { f(self.raw.as_ptr(), wr, bad_wr) })
    }
}

/// The checks of a send request against a QP's protection domain `pd`, capacities and type,
/// given its entry count (`QueuePair::check_send_fit`, on the fields alone so that a chain's
/// loop can check while it holds the QP's scratch).
#[inline(always)]
fn send_fits(
    pd: &Arc<PdInner>,
    caps: &QpCaps,
    qp_type: QpType,
    wr: &SendRequest<'_>,
    count: usize,
) -> Result<()> {
    let bad = |reason| Err(Error::InvalidArgument { verb: "ibv_post_send", reason });
    if wr.ud.as_ref().is_some_and(|(ah, _, _)| !Arc::ptr_eq(&ah.inner.pd, pd)) {
        return bad("the address handle belongs to another protection domain");
    }
    if let Some(d) = wr.inline {
        if d.len() > caps.max_inline_data as usize {
            return bad("inline data larger than the QP's max_inline_data");
        }
    } else if count > caps.max_send_sge as usize {
        return bad("more scatter/gather entries than the QP's max_send_sge");
    }
    if wr.xrc_srqn.is_some() != (qp_type == QpType::XRC_SEND) {
        return bad(
            "an XRC initiator's requests name their remote SRQ (SendRequest::xrc_srqn); no other's do",
        );
    }
    // The address handle first: without one (every connected QP) the operation is looked at
    // only on UC.
    match &wr.ud {
        None => match qp_type {
            QpType::UD => bad("a send on a UD queue pair needs a destination: SendRequest::ud"),
            QpType::UC if matches!(wr.op, Op::Read(_) | Op::CompareSwap { .. } | Op::FetchAdd { .. }) => {
                bad("UC queue pairs do not do RDMA Read or atomics")
            }
            _ => Ok(()),
        },
        Some(_) if qp_type != QpType::UD => bad("only UD queue pairs take an address handle"),
        Some(_) if !matches!(wr.op, Op::Send) => bad("UD queue pairs only send"),
        Some(_) => Ok(()),
    }
}

/// Keeps `new` in `pins` for the posts of the queue whose ring is `ring` (see
/// `QueuePair::pin` and `keep_pins`).
fn pin_to(pins: &std::sync::Mutex<Vec<Pin>>, ring: &Ring<Slot>, new: [Option<Pin>; 2]) {
    // The outstanding count only falls while the caller holds &QueuePair (posting takes &mut),
    // and a slot released by the consumer no longer needs its request's buffer.
    keep_pins(pins, ring.outstanding() == 0, new.into_iter().flatten());
}

/// The end a scope records after posting on `ring`, whose head was `before`: the ring's head
/// when any request reached it, also when the post then failed (a request the provider queued
/// before failing, `Error::QueuedWithError`, is posted, and the scope's drain must wait for it).
fn scoped_end(ring: &Ring<Slot>, before: u32) -> Option<u32> {
    let after = ring.producer_state().0;
    (after != before).then_some(after)
}

/// `post_prepared_iter`'s error for an iterator whose size hint said one and that yielded more
/// (out of line: its constant stores weighed on the chains' code, callgrind).
#[cold]
#[inline(never)]
fn more_than_hinted() -> PreparedChainError {
    PreparedChainError {
        posted: 1,
        error: Error::InvalidArgument {
            verb: "ibv_post_send",
            reason: "the iterator yielded more posts than its size_hint's upper bound (1); only the first was posted",
        },
    }
}

/// The error of a single prepared post refused by its checks ([`PreparedPost::error`]).
#[cold]
#[inline(never)]
fn refused_prepared(prepared: &PreparedSend, qp: u64, offset: usize, len: u32, remote_offset: u64) -> Error {
    prepared.at(0, offset, len, remote_offset).error(qp)
}

/// One checked prepared post through the builder table of an extended QP (`ex::post_batch` of
/// one), for [`QueuePair::post_prepared`].
#[inline(never)]
fn post_prepared_ex(
    ex: &ExQp,
    ring: &Ring<Slot>,
    scratch: &mut [ffi::ibv_send_wr],
    scratch_sges: &mut [[ffi::ibv_sge; MAX_SGE]],
    mut post: PreparedPost<'_>,
) -> Result<()> {
    ex::post_batch(ex, ring, scratch, scratch_sges, std::slice::from_mut(&mut post))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RemoteSlice;
    use crate::post::registry::Registry;
    use crate::post::MAX_SGE;
    use crate::queue::qp::fenced_post_send;
    use std::sync::Mutex;

    /// (opcode, send_flags) of every request the provider was handed, in order.
    static SEEN: Mutex<Vec<(u32, u32)>> = Mutex::new(Vec::new());

    /// A provider that walks the chain as a real one does and records what it read.
    unsafe extern "C" fn recording(
        _qp: *mut ffi::ibv_qp,
        mut wr: *mut ffi::ibv_send_wr,
        _bad: *mut *mut ffi::ibv_send_wr,
    ) -> i32 {
        let mut seen = SEEN.lock().unwrap();
        // SAFETY: the caller hands a valid NULL-terminated chain.
        unsafe {
            while !wr.is_null() {
                seen.push(((*wr).opcode.0, (*wr).send_flags));
                wr = (*wr).next;
            }
        }
        0
    }

    // siw completes sends out of order after an RDMA Read: the safe level fences every request
    // but Reads and atomics (see fenced_post_send). Run under Miri: the flags are written through
    // the pointers the engine hands the provider.
    #[test]
    fn on_siw_every_request_but_reads_and_atomics_is_fenced() {
        use ffi::ibv_wr_opcode as O;
        let fence = ffi::ibv_send_flags::IBV_SEND_FENCE.0;
        let signaled = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut ctx = ffi::ibv_context::default();
        ctx.ops.post_send = Some(recording);
        let mut qp = ffi::ibv_qp { context: &mut ctx, ..Default::default() };
        let qp = std::ptr::addr_of_mut!(qp);

        // A raw chain of each opcode.
        let ops = [O::IBV_WR_RDMA_READ, O::IBV_WR_RDMA_WRITE, O::IBV_WR_SEND, O::IBV_WR_ATOMIC_CMP_AND_SWP];
        let mut wrs: Vec<ffi::ibv_send_wr> = ops
            .iter()
            .map(|&opcode| ffi::ibv_send_wr { opcode, send_flags: signaled, ..Default::default() })
            .collect();
        let base = wrs.as_mut_ptr();
        for i in 0..ops.len() - 1 {
            // SAFETY: i + 1 < len.
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        let mut bad = std::ptr::null_mut();
        SEEN.lock().unwrap().clear();
        // SAFETY: a fake QP whose context's post_send records; a valid chain of ours.
        assert_eq!(unsafe { fenced_post_send(qp, base, &mut bad) }, 0);
        let want: Vec<(u32, u32)> = vec![
            (O::IBV_WR_RDMA_READ.0, signaled),
            (O::IBV_WR_RDMA_WRITE.0, signaled | fence),
            (O::IBV_WR_SEND.0, signaled | fence),
            (O::IBV_WR_ATOMIC_CMP_AND_SWP.0, signaled),
        ];
        assert_eq!(*SEEN.lock().unwrap(), want);

        // Through the engine: a chain of inline Sends and Writes.
        let reg = Registry::<Slot>::for_tests(64);
        let [ring] = reg.register([(8, false)]).unwrap();
        let mut scratch = vec![ffi::ibv_send_wr::default(); 8];
        let mut sges = vec![[ffi::ibv_sge::default(); MAX_SGE]; 8];
        let remote = RemoteSlice { addr: 0x1000, len: 64, rkey: 7 };
        let mut chain = vec![SendRequest::send_inline(b"x"), SendRequest::write_inline(b"y", remote)];
        SEEN.lock().unwrap().clear();
        post_chain(qp, &ring, Some(fenced_post_send), &mut scratch, &mut sges, &mut chain).unwrap();
        let seen = SEEN.lock().unwrap().clone();
        assert_eq!(seen.len(), 2);
        assert!(seen.iter().all(|&(_, flags)| flags & fence != 0), "{seen:?}");
        // The ring holds the two posts until a poll releases them with the registry.
        assert_eq!(ring.outstanding(), 2);
    }
}
