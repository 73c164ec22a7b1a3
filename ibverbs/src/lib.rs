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
//! # Choosing the device, port and GID
//!
//! [`select`] chooses them the way NCCL does, from the same environment variables
//! (`NCCL_IB_HCA`, `NCCL_IB_GID_INDEX`, `NCCL_IB_TIMEOUT`, ... — or ours, `IBVERBS_*`, which
//! win), so that a job configured for NCCL runs unchanged; [`diag`] checks the host (device
//! files, kernel modules, the locked-memory limit) for error messages that point to the fix.
//! The [`guide`] explains `ibv_devinfo`'s fields, the operations, the tuning settings and
//! GPUDirect RDMA for readers who know RDMA from the operator's side.
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
//! | [`AsyncEvents`] | the context's `async_fd` | [`Context::async_events`] | (the context) |
//! | [`QueuePair`] | `ibv_qp` | [`ProtectionDomain::create_qp`] | `ibv_destroy_qp` |
//! | [`SharedReceiveQueue`] | `ibv_srq` | [`ProtectionDomain::create_srq`], [`create_xrc_srq`](ProtectionDomain::create_xrc_srq) | `ibv_destroy_srq` (after its last QP) |
//! | [`XrcDomain`] | `ibv_xrcd` | [`Context::open_xrcd`] | `ibv_close_xrcd` |
//! | [`AddressHandle`] | `ibv_ah` | [`ProtectionDomain::create_ah`] | `ibv_destroy_ah` |
//! | [`cm::EventChannel`] | `rdma_event_channel` | [`cm::EventChannel::new`] | `rdma_destroy_event_channel` |
//! | [`cm::CmId`] | `rdma_cm_id` | [`cm::EventChannel::create_id`], a connection request | `rdma_destroy_id` |
//! | [`QueuePair`] on a [`cm::CmId`] | `ibv_qp` | [`QueuePairBuilder::build_on`] | `ibv_destroy_qp` + `id->qp = NULL` |
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
//! [`QueuePair::into_split`] hands its two work queues to two threads: a [`SendHalf`] and a
//! [`RecvHalf`], each the only poster of its queue's slot ring, with no lock between them.
//!
//! # Queue pair attributes
//!
//! [`QueuePair::connect`] and [`ConnectOptions`] are the short path. [`QueuePair::modify`] takes
//! any move of the state machine with typed attributes ([`ModifyQp`]; timers from
//! [`Duration`](std::time::Duration)s, rounded up as [`ack_timeout_code`] and [`rnr_timer_code`]
//! say), checked before `ibv_modify_qp()`: a move the state machine lacks, or an attribute the
//! move requires or does not take for the queue pair's transport, is [`Error::QpAttribute`]
//! naming the mask bit. [`QueuePair::query`] reads them back ([`QpAttributes`]).
//!
//! The short path is built on [`ModifyQp`]: [`QueuePair::connect`] (RESET → INIT → RTR → RTS),
//! [`QueuePair::init`] and [`QueuePair::activate_ud`] make each of their moves a [`ModifyQp`] from
//! the [`ConnectOptions`] and go through the same checks as [`QueuePair::modify`] before the verb.
//! `ConnectOptions`' `timeout` and `min_rnr_timer` are the raw codes and reach the device as
//! they are (no rounding through a `Duration`).
//!
//! The transport is checked at run time, not in the type: [`QueuePair`] is one type for RC, UC,
//! UD and XRC. A type parameter would have to reach everything that holds a queue pair (RDMA-CM,
//! striped connections, pools, the async adaptor, split halves) for the few attributes it would
//! catch (a Q_Key on RC, an ACK timeout on UD), which `modify` refuses before the verb anyway;
//! the common path (`connect`, `activate_ud`) sets only what fits the transport.
//!
//! # Safety model
//!
//! Posting a work request hands memory to the device until a completion says it is done. The
//! crate offers three levels:
//!
//! 1. **Safe, owned buffers** ([`QueuePair::post_send`], [`post_recv`](QueuePair::post_recv),
//!    [`post_send_chain`](QueuePair::post_send_chain),
//!    [`post_send_iter`](QueuePair::post_send_iter)): a request *moves* its buffers in — an owned
//!    [`MemoryRegion`], an `Arc<MemoryRegion>` (only for memory the device reads), or an
//!    `Arc<RemoteMemoryRegion>`. The QP keeps them in a slot of a ring sized at creation; the
//!    completion polled from the CQ hands them back ([`Completion::take_region`]). Nothing can touch
//!    an owned buffer meanwhile, and `mem::forget` of any handle only leaks. The `wr_id` given to
//!    the device encodes the ring and slot, so a completion finds its buffers without a lock or a
//!    hash lookup, also on a CQ shared by many QPs and both queues of a QP. A prepared request
//!    ([`QueuePair::prepare_send`]) is checked once and posted many times; its `Arc` buffer is
//!    *pinned* to the queue pair instead (held until the queue pair is destroyed, or until a
//!    later `prepare_send` finds nothing outstanding), so its posts' slots hold nothing; one
//!    prepared with inline data holds no buffer at all, each post lending its bytes for the
//!    call ([`QueuePair::post_prepared_inline`]: the provider copies inline data then). A
//!    prepared receive ([`QueuePair::prepare_recv`], [`SharedReceiveQueue::prepare_recv`]) does
//!    the same for an `Arc<RemoteMemoryRegion>`, the one buffer the device may write while it is
//!    shared (an SRQ's pin lasts until the SRQ is destroyed, after its last queue pair).
//! 2. **Unsafe, zero overhead** ([`QueuePair::post_send_unchecked`],
//!    [`CompletionQueue::poll_raw`], and for the extended path [`QueuePair::qp_ex_raw`] and
//!    [`CompletionQueue::cq_ex_raw`]): raw `ibv_send_wr` chains (or `ibv_wr_*` builder calls) at
//!    exactly C's cost. The `# Safety` sections state what must stay valid until completion.
//! 3. **Safe, borrowed buffers** ([`QueuePair::scope`]): requests over slices of registered
//!    regions *borrowed* for a scope that does not return before the device is done with them
//!    (see *Scoped borrowed buffers* below).
//!
//! What the crate guarantees, and what a user of the `unsafe` level must guarantee, class by
//! class:
//!
//! ## Objects of different contexts and protection domains
//! Verbs objects carry per-context kernel handles, and the kernel resolves a handle in the
//! context of the call: a CQ of context B passed to `ibv_create_qp` on a PD of context A names
//! whichever CQ of A has the same number. Every API that takes two objects checks that they
//! belong together before any verb runs: a QP's CQs and its PD share a context; a CQ and its
//! channel share a context; a request's buffers and address handle belong to the QP's PD. A
//! mismatch is [`Error::InvalidArgument`]. *Raw users:* the same rule holds for handles passed
//! to `ffi` functions.
//!
//! ## Completions that outlive their queue pair
//! A QP dropped (or [`reset`](QueuePair::reset)) with work outstanding leaves its completions
//! in the CQ on some providers (rxe keeps them; mlx5 removes them). After `ibv_destroy_qp`
//! returns the device no longer touches the QP's buffers, so the CQ's next
//! [`poll`](CompletionQueue::poll) releases them. Its ring stays in the CQ's registry, so a
//! stale completion still finds *its own* ring (with nothing outstanding) and is reported
//! untracked. The ring's registry index is reused only once a poll has found the CQ empty after
//! the QP went (a call of `poll` that returns fewer completions than its array holds): from then
//! on no completion naming it can exist, so no new queue's `wr_id` can be mistaken for an old
//! one, however many queue pairs come and go. The generation bits in the `wr_id` are defence in
//! depth only.
//!
//! ## Completion queue room
//! A CQ that overflows loses completions. The safe level reserves, for every work queue it
//! tracks, one CQ entry per request that queue can have outstanding, and refuses a QP that does
//! not fit ([`Error::CqTooSmall`], naming the whole QP's need). A dropped or reset queue keeps the
//! room of the requests it had outstanding (an upper bound of its completions still in the CQ)
//! until a poll finds the CQ empty. *What it costs a caller who never drains:* queue pairs created
//! on a CQ that is never polled dry may be refused with `CqTooSmall` (their predecessors'
//! leftovers still count) or [`Error::TooManyQueuePairs`] (registry entries are held until a
//! drain); a [`reset`](QueuePair::reset) may be refused for the same reason and leaves the QP
//! [`QpState::UNUSABLE`] until the CQ is polled dry and `reset` is called again. *Raw users:*
//! requests posted with the `unsafe` level must keep their completions within
//! [`CompletionQueue::unreserved`]; beyond it the CQ overflows (completions are lost, which never
//! makes the safe level unsound: buffers of lost completions come back with a later completion of
//! their queue or when their QP goes).
//!
//! ## Shared receive queues
//! A [`SharedReceiveQueue`]'s receives are consumed by whichever of its queue pairs takes the
//! next one; their completions land on those queue pairs' receive CQs (polled by different
//! threads) in any order: QP A takes request 0, QP B request 1, B's completion comes first. The
//! in-order rule of a QP's ring ("a completion at position p completes every earlier one") would
//! free buffers the device is still writing, so an SRQ has its own slot table instead:
//! - each slot has an atomic state (free → written by the single producer, the holder of
//!   `&mut SharedReceiveQueue` → posted, published with Release before the post → taken by
//!   exactly one winner of a compare-and-swap → free) and a 16-bit generation; the device
//!   `wr_id` names the SRQ (bit 61 set, an SRQ number in bits 32..61, never reused within a
//!   process: creating more than 2^29 − 1 SRQs fails), the generation and the
//!   slot. A completion takes a slot only if its CAS from (generation, posted) succeeds: a stale
//!   or foreign `wr_id` is skipped, never dereferenced. Free slots are a bitmap of atomic words
//!   that consumers set and only the producer clears: no lock, allocation or system call on
//!   post or poll. The safe level's depth is therefore at most 65536.
//! - Building a queue pair with [`QueuePairBuilder::srq`] attaches the SRQ to the QP's receive
//!   CQ (once per CQ): that CQ's registry finds the slot table from the `wr_id`, and reserves
//!   the SRQ's depth in the CQ ([`Error::CqTooSmall`] reports the total needed). The QP holds
//!   the SRQ, so the SRQ is destroyed after all of its queue pairs.
//! - Once `ibv_destroy_srq` succeeded, the SRQ retires its attachments (each CQ's registry then
//!   treats it as a dropped QP's ring: its entry and CQ room come back once a poll finds the CQ
//!   empty, so a stale completion never finds a freed table) and takes back every posted slot
//!   with the same CAS, which is sound while pollers on other threads take stale completions:
//!   each buffer goes to exactly one party, and a panicking drop drops nothing twice. A destroy
//!   that fails leaks the table.
//! - A queue pair dropped while requests it had taken from the SRQ were unfinished: those
//!   buffers stay posted (the device may have handed them to the QP) and come back when the SRQ
//!   is destroyed, as do those whose completions were polled with
//!   [`poll_raw`](CompletionQueue::poll_raw) (an SRQ has no order in which a later completion
//!   could release them). [`QueuePair::post_recv`] on a QP built on an SRQ is
//!   [`Error::InvalidArgument`]. *Raw users* of [`SharedReceiveQueue::post_recv_raw`]: as for a
//!   QP's receive queue, plus `wr_id`s with bit 63 clear and CQ room beyond the SRQ's depth.
//!
//! Pinned by Miri-run unit tests (out-of-order completion, two consumer threads and one
//! producer, release racing a consumer, a panicking drop, stale `wr_id`s after reuse, wrapped
//! generations, two CQs sharing one SRQ) and `tests/device_srq.rs`.
//!
//! ## Two data paths: classic and extended
//! A queue pair created with [`QueuePairBuilder::send_ops`] posts its sends through the
//! work-request builders of `struct ibv_qp_ex` (`ibv_wr_start`, `ibv_wr_rdma_write`, ...,
//! `ibv_wr_complete`), and a CQ from [`Context::create_cq_ex`] is polled with `ibv_start_poll`,
//! `ibv_next_poll`, the `ibv_wc_read_*` accessors and `ibv_end_poll`. Both reuse the classic
//! machinery unchanged: a request is built by the same code into the same `ibv_send_wr` (same
//! checks, same `wr_id` naming its slot), its buffers move into the same slot ring *before* the
//! doorbell, and a completion read by either poll path goes through the same registry lookup that
//! hands them back. Differences, each with its rule: `ibv_wr_post(3)` says `ibv_wr_complete`
//! posts all of a batch or none, but rxe publishes the batch to the device before the doorbell
//! system call whose failure it returns; with every reason a provider has to refuse a batch
//! checked before `ibv_wr_start`, a failing `ibv_wr_complete` is taken as a failed doorbell, and
//! the whole batch stays posted ([`Error::QueuedWithError`]: its slots keep its buffers, as on
//! the classic path when the provider queued the requests before failing);
//! an operation the QP was not created for is refused before `ibv_wr_start`
//! ([`Error::SendOpNotEnabled`]), never passed to a builder the provider did not fill in;
//! `ibv_end_poll` follows every successful `ibv_start_poll` (from a guard, also when a buffer's
//! drop panics in between) and never an `ENOENT` one, and the accessors run only in between, only
//! for fields asked for at creation; a poll that ends on `ENOENT` (from either call) counts as
//! having seen the CQ empty for the registry's reuse rule above. *Raw users:*
//! [`QueuePair::qp_ex_raw`] and [`CompletionQueue::cq_ex_raw`] state their contracts: those of
//! the classic `unsafe` level plus the sequencing rules.
//!
//! ## Memory the provider did not write
//! Providers write only some fields of a work completion (mlx5 leaves `byte_len`, `src_qp`,
//! `slid`, `sl`, `pkey_index` and `vendor_err` alone for a successful Send or Write).
//! [`CompletionQueue::poll`] zeroes the entries it hands the provider, so every field of a
//! [`Completion`] is initialised (0 where the provider wrote nothing). `poll_raw` writes into the
//! caller's initialised array, whose unwritten fields keep their old values.
//!
//! ## Panics in user code
//! The only user code the crate runs is `Drop` of the values it holds (buffers, and an
//! [`OwnedBuffer`] free callback, which may panic). Every path that drops them releases a
//! slot *before* dropping its value, so a panic propagates out of `poll` (or a drop) and every
//! value is still dropped at most once; values not reached yet are released later or leaked,
//! never dropped twice. `poll` drops what the caller left in its array *before* taking
//! completions from the device, so a panic there loses no completion.
//!
//! ## Scoped borrowed buffers
//! [`QueuePair::scope`] (and [`scope_split`](QueuePair::scope_split) for a QP with two CQs) runs
//! a closure with a [`Scope`], in the style of `std::thread::scope`. The answers to the hard
//! cases:
//! - **Shape.** `qp.scope(&mut cq, |s| ...)`: the scope holds `&mut` of the QP (scopes cannot
//!   nest on one QP; they may on different ones) and of the CQ(s) both work queues complete into
//!   (checked before the closure runs: [`Error::InvalidArgument`]). The closure is generic over
//!   the scope's lifetime `'s` (invariant; `'env: 's`); [`Scope::post_send`] and
//!   [`post_recv`](Scope::post_recv) take [`ScopedSend<'s>`]/[`ScopedRecv<'s>`], so only memory
//!   borrowed from outside the closure can be posted, and the borrow checker keeps it borrowed
//!   until `scope` returns — after the drain.
//! - **Borrows.** [`Scope::local`] takes `&'b MemoryRegion` (the device only reads it: Send and
//!   Write sources; the caller may keep reading it), [`Scope::local_mut`] `&'b mut MemoryRegion`
//!   (the device may write it: receives, RDMA Read and atomic targets; nothing else can touch the
//!   region until the scope returns), with the same for a [`Chunk`]. A request whose device
//!   writes a shared borrow is refused at post ([`Error::InvalidArgument`]), as at the owned
//!   level. A [`RemoteMemoryRegion`] is borrowed shared and may still be device-written
//!   ([`Scope::local_remote`]): it only ever gives copies, so the remote-writable rules above
//!   hold unchanged; no scope hands out `&[u8]` of anything. A borrowed region cannot be dropped
//!   (deregistered) while borrowed. A request may be posted on any scope whose QP shares the
//!   region's PD (checked at post): whichever scope posts it drains it, and only a borrow that
//!   outlives that scope's call compiles.
//! - **Engine.** A scoped request goes through the owned level's engine (checks, a slot of the
//!   ring, the `wr_id` naming it, the CQ's registry); its slot holds no buffer. Posting costs no
//!   allocation and no lock (pinned by `tests/device_alloc.rs`).
//! - **Counting.** After each scoped post the scope records the ring position that follows it.
//!   Work queues complete in order, so once the ring has released every position before it (its
//!   completion, or a later one of the same queue, polled), the device is done with every scoped
//!   request of that queue. The count lives in the scope's own frame, not in anything the
//!   closure owns: `mem::forget` of a request, a [`PostError`] or the `&mut Scope` leaks nothing
//!   the drain needs. The position test is exact while anything before it is outstanding
//!   (Miri-run unit tests cover the wrap of `u32` positions).
//! - **Completions.** [`Scope::poll`] polls the CQ(s) through [`CompletionQueue::poll`]:
//!   scoped completions carry the caller's `wr_id` and no buffer; owned ones hand theirs back;
//!   other QPs' on a shared CQ come as always. The drain polls the device itself and **keeps**
//!   every completion it polls in the CQ ([`CompletionQueue::kept`]), which its next `poll` (or
//!   `poll_wait`) returns first, in order: nothing is lost, whoever it belongs to.
//! - **Drain.** When the closure returns or panics (caught with `catch_unwind`), the scope waits
//!   for its requests with a bound ([`Scope::set_drain_timeouts`], 10 s by default), then moves
//!   the QP to ERR (`ibv_modify_qp`) so the device flushes the rest, and waits again (10 s); if
//!   the device has still not given everything back it resets the QP (`ibv_modify_qp` to RESET:
//!   the device forgets every request, the rule the owned level relies on for
//!   [`QueuePair::reset`]), and if even that fails it **aborts the process**: blocking forever is
//!   the only other sound choice, and returning would hand back memory the device may write. A
//!   panic while draining (a dropped buffer's free callback) is caught and resumed after the
//!   drain. A drain that had to fail the QP returns [`Error::Timeout`]; a panicking scope leaves
//!   the QP in ERR (the closure's protocol stopped in the middle) and then resumes the panic.
//!   Either way the QP needs [`QueuePair::reset`] and a new connection.
//! - **Unsignaled requests.** A scoped request posted unsignaled is finished by the next signaled
//!   completion of its queue; if none follows, the drain cannot see it finish and ends by failing
//!   the QP.
//! - **What the caller must not do.** Nothing in safe code can end a scope early. *Raw users:*
//!   consuming a scope's completions behind its back (`ibv_poll_cq` through
//!   [`CompletionQueue::as_raw`] during a scope) only makes its drain wait for the bound and fail
//!   the QP; resetting or destroying the QP through [`QueuePair::as_raw`] during a scope is
//!   forbidden like every destroy of an object the crate owns.
//!
//! Pinned by `tests/device_scope.rs` (borrowed sends, writes, reads and receives with their data
//! checked; 32 receives over one split borrow; owned and scoped requests mixed; a shared CQ whose
//! other completions the drain keeps; a panic while a 4 MiB RDMA Read lands in the borrowed
//! buffer: every byte landed, the QP is in ERR; a peer that is gone: the drain fails the QP and
//! the flush completes both requests; a chain of unsignaled scoped writes; the extended data
//! path) and the `compile_fail` tests below.
//!
//! ## Memory that others write
//! A peer may write a region registered with [`AccessFlags::REMOTE_WRITE`] or
//! [`AccessFlags::REMOTE_ATOMIC`] at any moment, and so may other threads through a shared
//! `&RemoteMemoryRegion`: such a region is a [`RemoteMemoryRegion`], which gives safe code only
//! copies in and out. Those use relaxed atomic accesses, always of the same size for a given byte
//! (a byte inside an aligned 8-byte word of the region is accessed with that word, the few bytes
//! at unaligned ends alone), so racing copies between threads are torn, never a data race.
//! [`RemoteMemoryRegion::byte`] finds one byte's access unit once ([`RemoteByte`]), so a spin
//! loop polling the flag a peer's write sets pays one atomic load a turn, of that same size.
//! References into it are `unsafe` ([`RemoteMemoryRegion::as_slice`]). A local-only
//! [`MemoryRegion`] takes only [`AccessFlags::LOCAL_ONLY`]: neither remote write, atomics, nor
//! memory-window binding (a window can grant remote write), nor flags the crate does not know.
//! It derefs to `[u8]` freely, because while a post uses it the QP owns it.
//!
//! ## The rest of the registration family
//! A region registered with an IOVA ([`ProtectionDomain::register_iova`]) is addressed by IOVA
//! locally too: the crate builds every scatter/gather entry over it from the IOVA, so a range of
//! a [`Chunk`] names that chunk's bytes and no other's. On-demand paging
//! ([`AccessFlags::ON_DEMAND`]) changes only how the memory is pinned, so it is allowed on a
//! local-only region; *implicit* ODP reaches the whole address space and is `unsafe` to create
//! ([`ProtectionDomain::register_implicit_odp`]). `rereg_access` takes `&mut self` (no post holds
//! the region) and keeps each type's rights. On-device memory ([`DeviceMemory`]) and dma-buf
//! regions ([`DmabufRegion`]) are not process memory to Rust: the crate hands out copies and
//! keys, never references. [`fork`] says what `fork()` does to registered memory.
//!
//! ## Memory exposed through windows: reading in place what a peer wrote
//! The question users ask: how to read, with no copy and no `unsafe`, what a peer RDMA-wrote.
//! A [`RemoteMemoryRegion`] cannot say when peers are done, so it only copies out. Memory
//! windows can: a window's rkey stops working when the window is invalidated, and the device
//! reports that. The crate tracks it in the types:
//!
//! - [`ProtectionDomain::allocate_windowed`] registers memory with `LOCAL_WRITE | MW_BIND` and
//!   *no remote right of its own*: the region's rkey grants nothing, so peers reach it only
//!   through windows bound to it. It starts *private* ([`WindowedRegion`]: derefs to `[u8]` and
//!   `mut [u8]`; it is not a [`LocalBuf`], so no post can make the device write it either).
//! - [`WindowedRegion::expose`] consumes it into an [`ExposedRegion`], which holds the
//!   registration in an `Arc`, gives only copies ([`ExposedRegion::read`], `to_vec`), and is the
//!   only thing a window binds to ([`SendRequest::bind_window`] for type 2,
//!   [`QueuePair::bind_mw`] for type 1). A bind request moves the [`MemoryWindow`] in and takes a
//!   clone of that `Arc`; the completion hands back a [`BoundWindow`] that keeps it.
//! - A [`BoundWindow`] gives its `Arc` up only when the window is proven unbound: the successful
//!   completion of *its own* local invalidate ([`SendRequest::local_invalidate`]) or type 1 unbind
//!   ([`QueuePair::unbind_mw`]) — the request holds the window whose rkey it names, so the
//!   completion cannot be confused with another — via [`Completion::take_invalidated_window`];
//!   or its deallocation (`ibv_dealloc_mw()`, in `Drop`: if it fails, the `Arc` is leaked); or
//!   a peer's Send with Invalidate ([`BoundWindow::remote_invalidated`], see below). A failed or
//!   flushed bind or invalidate hands the window back still counted as bound.
//! - [`ExposedRegion::into_private`] succeeds only when it holds the *last* `Arc`
//!   (`Arc::try_unwrap`): then no window that could be bound to the memory exists, none is in a
//!   posted request, and the registration itself grants peers nothing. Nothing but this process
//!   can write the bytes, so `&[u8]` is sound. The type system tracks the state; the one runtime
//!   check is a reference count, and it fails safe (the region stays exposed).
//!
//! What the crate relies on from the device: once an invalidation (local invalidate, type 1
//! unbind, Send with Invalidate, deallocation) has completed, no access through the old rkey
//! happens any more, including the rest of a multi-packet RDMA Write that began before it. The
//! device tests pin both on rxe (new accesses are refused; a 256 KiB Write under way is cut off
//! with a remote access error and nothing lands after the invalidation completed); a peer that
//! finishes its writes and then sends the Send with Invalidate on the same RC connection
//! (ordered after its writes) does not depend on the in-flight case at all.
//!
//! The hard cases: **`mem::forget`** of a bound window (or of a completion holding one) leaks its
//! `Arc`: the region never becomes private again and the memory is never deregistered or freed,
//! so no window is ever open on memory that is later reused. **A hostile peer** that keeps
//! writing after the invalidation is refused by the device (remote access error, pinned by the
//! device tests; the memory is unchanged). **The QP a type 2 window was bound to is destroyed**:
//! the crate does not assume that unbinds it; the window keeps the region until it is
//! invalidated or deallocated (dropping it deallocates). Invalidate or drop type 2 windows
//! before their QP: rxe (kernel 6.1) blocks `ibv_destroy_qp` for about 50 s while a type 2
//! window is still bound to the QP. **Objects of two contexts or protection
//! domains**: a bind checks that the window and the region share a PD, and the post that the QP
//! does too, before anything is posted. **Rkeys are reused**: each bind of a type 2 window moves
//! its 8-bit key on (`ibv_inc_rkey()`, from the key of its last binding however the window came
//! back), and a type 2 window takes at most [`MAX_BINDS`] binds, so no key of a type 2 window
//! repeats. A type 1 window's key is the provider's to choose (`ibv_bind_mw()`): it comes round
//! again after 256 binds, and a peer that kept the key of that time reaches the new binding, as
//! with any reused rkey; allocate a new type 1 window rather than rebinding one that often. **Remote invalidation** is reported on a *receive* completion that names
//! only an rkey; the crate checks that it is a successful, safely posted completion of the QP
//! the window is bound to, naming the window's rkey, and uses the evidence up. What it cannot
//! check is *when* the Send was received: a completion still unpolled from before this window's
//! bind may name an earlier window that had the same index and key. So
//! [`BoundWindow::remote_invalidated`] is `unsafe`: the receive must have been posted after the
//! bind. Local invalidation and deallocation are safe. (rxe on kernel 6.1 reports remote
//! invalidation with the kernel's flag bit instead of `IBV_WC_WITH_INV`, so
//! [`Completion::invalidated_rkey`] is `None` there: deallocate instead.)
//!
//! ## Numbers from callers and peers
//! Every size or offset a caller or a peer supplies is checked with checked arithmetic
//! ([`OwnedBuffer::zeroed`], [`RemoteSlice::slice`] — whose fields are public, so it may come
//! from anywhere — [`Local::new`], range checks of copies) and decoders check every field and
//! reserved byte ([`Endpoint::decode`], [`RemoteSlice::decode`]). [`ConnectOptions`] are checked
//! before `ibv_modify_qp` sees them. Counters that wrap (ring positions, generations) are
//! designed for it and tested across the wrap.
//!
//! ## Completion events
//! `ibv_destroy_cq` waits until every event read for the CQ (`ibv_get_cq_event`) is
//! acknowledged (`ibv_ack_cq_events`). The crate reads events itself
//! ([`CompletionChannel::try_get_event`], [`get_event`](CompletionChannel::get_event),
//! [`CompletionQueue::poll_wait`]) and hands out only a [`CqId`], a plain value: nothing the
//! caller holds is an unacknowledged event. It counts events per CQ in an atomic word that the
//! CQ's `cq_context` points to (kept alive until after `ibv_destroy_cq` returned) and
//! acknowledges them in batches: on [`CompletionQueue::req_notify`], every 64 events, and in the
//! CQ's drop, which first marks the word *dying* and acknowledges what was counted; a reader
//! that reads an event of a dying CQ acknowledges it itself. One atomic update decides which of
//! the two acknowledges each event, and a reader touches the word and the CQ only while its own
//! event is unacknowledged (so `ibv_destroy_cq` is still waiting for it): no event is
//! acknowledged twice or never, no freed CQ is touched, and no drop order or `mem::forget`
//! makes a destroy hang. (The full argument is in the source of `queue/channel.rs`.)
//!
//! A channel's descriptor must never be *read* except by the crate: an event read behind its
//! back is never acknowledged. So [`AsFd`](std::os::fd::AsFd) hands out a private epoll
//! descriptor watching the channel (level-triggered): readable exactly when the channel is,
//! watchable by any reactor, and `read(2)` on it (e.g. through a `File` made from a dup) fails
//! with `EINVAL`. [`AsRawFd`](std::os::fd::AsRawFd) gives the channel's own descriptor, to
//! watch only. The channel's descriptor is non-blocking, so a reader that loses a race returns.
//! [`CompletionQueue::poll_wait`] arms, polls again (closing the race with a completion that
//! came between the empty poll and the arming) and waits with a deadline; when several CQs
//! share a channel, one waiter reads the descriptor and hands events of other CQs to their
//! waiters, so no wake-up is lost.
//!
//! ## Asynchronous events
//! `ibv_destroy_qp`, `ibv_destroy_cq` and `ibv_destroy_srq` wait for the acknowledgement of
//! every asynchronous event read about the object. [`AsyncEvents`] acknowledges each event as it
//! reads it, after copying out the type and the object as values ([`AsyncObject`]: an address
//! as an id, a QP number read while the unacknowledged event kept the QP alive, a port number),
//! never a pointer that could dangle. An [`AsyncEvent`] is `Copy`: holding, dropping or
//! forgetting it cannot delay a destroy. Its descriptor is exposed like a completion channel's
//! (epoll `AsFd`, watch-only `AsRawFd`); [`Context::async_events`] makes the context's
//! `async_fd` non-blocking.

//! ## Async
//! [`aio`] awaits completions without busy polling, over any reactor (features `tokio` and
//! `async-io` bring the two backends; the core is always compiled): a stream of completions
//! ([`aio::AsyncCompletionQueue`]) and `await`-able safe posts ([`aio::AsyncQueuePair`] through a
//! shared [`aio::Driver`]). Futures own nothing the device uses: a posted request's buffers stay in
//! the queue pair's slot ring until the completion is polled, as at the safe level, so dropping or
//! `mem::forget`ting a future mid-transfer never frees or reuses a buffer the device may touch (the
//! driver drops it when the completion comes). The adaptor reads and acknowledges every event on
//! the channel it is given, which must serve its CQ alone.
//!
//! ## Connection management (RDMA-CM)
//! [`cm`] wraps librdmacm. Its rules, pinned by device tests: a queue pair created on an id
//! holds the id, which holds its event channel, so the QP is destroyed before the id
//! (librdmacm keeps `id->qp` and uses it, e.g. in `rdma_disconnect`; the QP's drop clears it)
//! and the id before its channel, whatever order the caller drops them in.
//! [`cm::EventChannel::get_event`] copies every event (private data included, at most the 255
//! bytes its `u8` length allows) and acknowledges it at once, so `rdma_destroy_id` never blocks
//! on an unacknowledged event, whatever the caller does with events (`mem::forget` included).
//! librdmacm reads and writes an id's fields when it processes the id's events: every call on an
//! id, every event read and a CM QP's destruction hold the channel's lock. For reactors the channel is
//! `AsFd` through a private epoll descriptor that cannot consume an event, as for completion
//! channels; its own descriptor is only `AsRawFd`. librdmacm opens its own device
//! contexts; [`cm::CmId::context`] hands them out as [`Context`]s (one per device, kept open by an
//! `rdma_get_devices()` reference), and a QP on an id is refused unless its PD and CQs belong to
//! the id's context. RDMA-CM drives a CM QP's state: [`QueuePair::connect`],
//! [`init`](QueuePair::init), [`activate_ud`](QueuePair::activate_ud) and
//! [`reset`](QueuePair::reset) refuse it ([`Error::CmManaged`]). Private data longer than the
//! transport carries is [`Error::PrivateDataTooLong`] before anything is sent.
//!
//! ### iWARP (soft-iWARP, Chelsio, Intel...) connects through [`cm`] only
//! An iWARP device ([`Context::is_iwarp`]: transport [`TransportType::IWARP`], node type
//! [`NodeType::RNIC`]) runs RDMA over a TCP connection that the kernel makes for RDMA-CM, so its
//! queue pairs reach RTR and RTS only through [`cm::connect`] / [`cm::Listener::accept`] (or
//! [`cm::CmId::connect`] / [`accept`](cm::CmId::accept) with
//! [`QueuePair::cm_established`] after `ESTABLISHED`). [`QueuePair::connect`] and
//! [`QueuePair::endpoint`] refuse it with [`Error::Unsupported`] naming [`IWARP_MANUAL_CONNECT`];
//! nothing is changed. [`QueuePair::reset`] is refused the same way ([`IWARP_RESET`]): siw
//! accepts RESET and ignores it. siw completes a Send or RDMA Write before an RDMA Read posted
//! ahead of it; the safe level therefore posts every request but Reads and atomics with
//! `IBV_SEND_FENCE` on siw, which keeps completions in posting order (the `unsafe` level posts
//! requests as they are). iWARP has RC queue pairs only (no UC, UD or address handles), no
//! immediate data, no RNR retry (a send that finds no receive posted ends the connection) and, on
//! siw, no atomics or memory windows. An RDMA Write completes once the data is handed to TCP: a
//! responder's access error ends the connection (a `DISCONNECTED` event) instead of a
//! `REM_ACCESS_ERR` completion. Measured on siw (Linux 6.1): `ibv_query_qp` reports no state
//! (always RESET; [`QueuePair::refresh_state`] then keeps the known state), `rdma_connect` to an
//! address that does not answer blocks in the kernel's TCP connect for about 131 s
//! ([`cm::connect`] still returns [`Error::Timeout`] at its bound, connecting on a thread of its
//! own; [`cm::establish`] and [`CmId::connect`](cm::CmId::connect) block that long), a 255-byte
//! connect private data is reset by the peer's
//! siw, and a request posted after the connection broke never completes (not even flushed): watch
//! the id's events and stop posting on `DISCONNECTED`.
//!
//! ## Striped connections (several queue pairs per connection)
//! [`striped::StripedConnection`] spreads one connection over N RC queue pairs
//! (`NCCL_IB_QPS_PER_CONNECTION`), splitting large RDMA Writes and Reads into aligned, equal
//! pieces (`NCCL_IB_SPLIT_DATA_ON_QPS`) and reporting one completion per request. It connects
//! its queue pairs by hand, or takes queue pairs connected through RDMA-CM
//! ([`StripedConnection::from_queue_pairs`](striped::StripedConnection::from_queue_pairs), the
//! one way on iWARP). It adds no
//! `unsafe`: each piece is a safe post holding either a clone of a shared source
//! (`Arc<MemoryRegion>`, device reads only) or an owned, disjoint [`Chunk`] of the caller's
//! region; the region is rebuilt and handed back only when no chunk of it exists any more
//! (`Arc::try_unwrap` of the registration), so nothing can alias memory the device may still
//! write. A request on an owned region costs two small allocations (the registration moves from
//! a `Box` to an `Arc` and back); on a shared source none.
//!
//! ## What `unsafe` code must not do with raw handles
//! The `as_raw()` handles let `ffi` calls do anything C can. These break the crate's invariants
//! and are forbidden: destroying, deallocating or deregistering an object the crate owns
//! (`ibv_destroy_qp`, `ibv_dereg_mr`, ...); `ibv_rereg_mr` on a region; binding a memory window
//! to a local-only [`MemoryRegion`], or any other way of granting remote write or atomic access to
//! it; `ibv_resize_cq`; reading a completion channel's or the context's
//! asynchronous event descriptor, calling `ibv_get_cq_event` or `ibv_get_async_event` (the
//! crate counts and acknowledges events itself), `ibv_ack_cq_events` on a CQ of the crate,
//! creating a CQ with `ffi` on a channel of the crate (its `cq_context` must point to the
//! crate's bookkeeping), or making either descriptor blocking again; posting a work request whose `wr_id` has bit 63 set (the safe level's
//! tag). `ibv_poll_cq` on a CQ the safe level uses is allowed but consumes its completions
//! (their buffers come back only with a later completion of the same queue, or when the QP
//! goes); `ibv_modify_qp` behind the crate's back is allowed but leaves [`QueuePair::state`]
//! stale.
//!
//! ## Reviewer's checklist for changes
//! - Does a new API take two verbs objects? Check context/PD membership before any verb.
//! - Does memory reach the device? It is owned by a slot (or shared read-only) until a completion
//!   or the QP's destruction; a failed post hands it back.
//! - Does a value the crate holds get dropped? Release the slot first; no `unwrap` of a
//!   state a panic could leave half-changed.
//! - Does anything reuse an index, key or position? Only after the CQ was seen empty (or, for
//!   ring positions, after the completion released it).
//! - Does safe code get a reference to memory a peer, the device or another thread may write?
//!   It must not; copy with [`RemoteMemoryRegion`]'s atomic copies instead.
//! - Does a number come from a caller or a peer? Checked arithmetic, and an error naming it.
//! - Does a wait depend on another party? It has a bound.
//! - Is it tested: a host test (under Miri if pure Rust), a device test, a `compile_fail` test
//!   with its error code?
//!
//! Values the device writes (completion status and opcode, async event type, port state, MTU,
//! GID type...) are `#[repr(transparent)]` newtypes with associated constants, sound for any
//! value.
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
//! The completion queue has one owner: it cannot be cloned (queue pairs keep it alive themselves).
//! `cq.clone()` only copies the reference, which is not a `CompletionQueue`:
//! ```compile_fail,E0308
//! # fn f(cq: &ibverbs::CompletionQueue) {
//! let second = cq.clone();
//! let _: ibverbs::CompletionQueue = second; // error: mismatched types (`&CompletionQueue`)
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
//! A buffer borrowed exclusively by a scoped RDMA Read (or receive) can be neither read nor
//! written until the scope returns:
//! ```compile_fail,E0502
//! # fn f(qp: &mut ibverbs::QueuePair, cq: &mut ibverbs::CompletionQueue,
//! #      mut buf: ibverbs::MemoryRegion, peer: ibverbs::RemoteSlice) {
//! use ibverbs::ScopedSend;
//! qp.scope(cq, |s| {
//!     s.post_send(ScopedSend::read(s.local_mut(&mut buf, ..).unwrap(), peer)).unwrap();
//!     println!("{}", buf[0]); // error: cannot borrow `buf` as immutable (borrowed as mutable)
//! }).unwrap();
//! # }
//! ```
//! ```compile_fail,E0499
//! # fn f(qp: &mut ibverbs::QueuePair, cq: &mut ibverbs::CompletionQueue, mut buf: ibverbs::MemoryRegion) {
//! use ibverbs::ScopedRecv;
//! qp.scope(cq, |s| {
//!     s.post_recv(ScopedRecv::new(s.local_mut(&mut buf, ..).unwrap())).unwrap();
//!     buf[0] = 1; // error: cannot borrow `buf` as mutable more than once
//! }).unwrap();
//! # }
//! ```
//! A buffer a scoped send reads cannot be written meanwhile:
//! ```compile_fail,E0502
//! # fn f(qp: &mut ibverbs::QueuePair, cq: &mut ibverbs::CompletionQueue, mut buf: ibverbs::MemoryRegion) {
//! use ibverbs::ScopedSend;
//! qp.scope(cq, |s| {
//!     s.post_send(ScopedSend::send(s.local(&buf, ..).unwrap())).unwrap();
//!     buf[0] = 1; // error: cannot borrow `buf` as mutable (borrowed as immutable)
//! }).unwrap();
//! # }
//! ```
//! Only memory that outlives the scope can be posted in it (a buffer of the closure's own would
//! be freed before the drain):
//! ```compile_fail,E0597
//! # fn f(qp: &mut ibverbs::QueuePair, cq: &mut ibverbs::CompletionQueue, pd: &ibverbs::ProtectionDomain) {
//! use ibverbs::ScopedRecv;
//! qp.scope(cq, |s| {
//!     let mut buf = pd.allocate(64).unwrap();
//!     s.post_recv(ScopedRecv::new(s.local_mut(&mut buf, ..).unwrap())).unwrap(); // error: `buf` does not live long enough
//! }).unwrap();
//! # }
//! ```
//! The scope cannot escape its closure:
//! ```compile_fail,E0521
//! # fn f(qp: &mut ibverbs::QueuePair, cq: &mut ibverbs::CompletionQueue) {
//! let mut kept = None;
//! qp.scope(cq, |s| kept = Some(s)).unwrap(); // error: borrowed data escapes outside of closure
//! # }
//! ```
//! Scopes do not nest on one queue pair:
//! ```compile_fail,E0500
//! # fn f(qp: &mut ibverbs::QueuePair, cq: &mut ibverbs::CompletionQueue, cq2: &mut ibverbs::CompletionQueue) {
//! qp.scope(cq, |_| {
//!     qp.scope(cq2, |_| ()).unwrap(); // error: closure requires unique access to `*qp` but it is already borrowed
//! }).unwrap();
//! # }
//! ```
//! A scoped request cannot be posted at the owned level (on a queue pair no scope drains):
//! ```compile_fail,E0308
//! # fn f(qp: &mut ibverbs::QueuePair, other: &mut ibverbs::QueuePair,
//! #      cq: &mut ibverbs::CompletionQueue, buf: ibverbs::MemoryRegion) {
//! use ibverbs::ScopedSend;
//! qp.scope(cq, |s| {
//!     other.post_send(ScopedSend::send(s.local(&buf, ..).unwrap())).unwrap(); // error: mismatched types
//! }).unwrap();
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
//! #[cfg(feature = "cm")]
//! {
//!     assert_static_send_sync::<ibverbs::cm::EventChannel>();
//!     assert_static_send_sync::<ibverbs::cm::CmId>();
//!     assert_static_send_sync::<ibverbs::cm::CmEvent>();
//!     assert_static_send_sync::<ibverbs::cm::Listener>();
//! }
//! assert_static_send_sync::<ibverbs::CompletionChannel>();
//! assert_static_send_sync::<ibverbs::AsyncEvents>();
//! // Events are plain values: nothing in them is left to acknowledge.
//! fn assert_copy<T: Copy>() {}
//! assert_copy::<ibverbs::AsyncEvent>();
//! assert_copy::<ibverbs::CqId>();
//! // Handles can live in the caller's own structs, without lifetimes.
//! struct Endpoint { _qp: ibverbs::QueuePair, _cq: ibverbs::CompletionQueue, _pd: ibverbs::ProtectionDomain }
//! ```
//! A buffer is the caller's again once the scope has returned, and a scope may post a buffer
//! borrowed outside an enclosing scope's closure (it drains it itself):
//! ```
//! # fn f(a: &mut ibverbs::QueuePair, cq_a: &mut ibverbs::CompletionQueue,
//! #      b: &mut ibverbs::QueuePair, cq_b: &mut ibverbs::CompletionQueue,
//! #      mut buf: ibverbs::MemoryRegion, pd: &ibverbs::ProtectionDomain) {
//! use ibverbs::{ScopedRecv, ScopedSend};
//! a.scope(cq_a, |s| {
//!     s.post_recv(ScopedRecv::new(s.local_mut(&mut buf, ..).unwrap())).unwrap();
//!     let mut inner = pd.allocate(64).unwrap();
//!     b.scope(cq_b, |t| {
//!         t.post_recv(ScopedRecv::new(t.local_mut(&mut inner, ..).unwrap())).unwrap();
//!     }).unwrap();
//!     inner[0] = 1;
//! }).unwrap();
//! buf[0] = 1;
//! # }
//! ```
#![warn(missing_docs)]

/// The raw C API (the `rdma-verbs-sys` crate): bindgen's bindings to `infiniband/verbs.h` and
/// (with the `cm` feature) `rdma/rdma_cma.h`, every `static inline` verb callable under its C name. For the `unsafe`
/// raw posting level ([`QueuePair::post_send_unchecked`] and friends); [`raw`] builds its work requests
/// without naming bindgen's unions. With the `dlopen` feature the libraries are loaded at run time
/// (`ffi::load()`; the crate's entry points return [`Error::LibraryMissing`] without them).
#[doc(inline)]
pub use ibverbs_sys as ffi;

mod ah;
pub mod aio;
mod async_event;
mod attr;
#[cfg(feature = "cm")]
pub mod cm;
mod connect;
mod device;
pub mod diag;
mod error;
mod fd;
pub mod fork;
pub mod group;
pub mod guide;
mod memory;
mod pd;
mod pkey;
mod pool;
mod post;
mod queue;
mod quirks;
pub mod select;
#[cfg(feature = "serde")]
mod serde_impls;
pub mod striped;
#[cfg(test)]
mod tests_support;

pub use ah::AddressHandle;
pub use async_event::{AsyncEvent, AsyncEventType, AsyncEvents, AsyncObject};
pub use attr::{
    DeviceAttr, DeviceAttrEx, Gid, GidEntry, GidType, Guid, LinkLayer, Mtu, NodeType, OdpCaps, PortAttr,
    PortState, QpState, TransportType,
};
pub use connect::{ConnectOptions, Endpoint};
pub use device::{devices, Context, CqId, Device, DeviceList, QpId};
pub use error::{Error, PostError, Result};
pub use memory::odp;
pub use memory::{
    page_size, AccessFlags, BoundWindow, Chunk, DeviceMemory, DeviceMemoryRegion, DmabufRegion,
    ExposedRegion, MemoryRegion, MemoryWindow, MwType, OwnedBuffer, RemoteByte, RemoteMemoryRegion,
    RemoteSlice, WindowedRegion, IOVA_ELSEWHERE, MAX_BINDS, WINDOW_ACCESS,
};
pub use pd::ProtectionDomain;
pub use pool::ReceivePool;
pub use post::raw;
pub use post::{
    Local, LocalBuf, PreparedChainError, PreparedPost, PreparedRecv, PreparedSend, RecvRequest, ScopedLocal,
    ScopedRecv, ScopedSend, SendIterError, SendOps, SendRequest, MAX_SGE,
};
pub use queue::{
    ack_timeout_code, ack_timeout_duration, rnr_timer_code, rnr_timer_duration, ModifyQp, PathMigState,
    QpAttributes, PATH_MIGRATION, RATE_LIMIT,
};
pub use queue::{is_mcast_gid, MCAST_QPN};
pub use queue::{
    Completion, CompletionChannel, CompletionQueue, CqBuilder, QpCaps, QpType, QueuePair, QueuePairBuilder,
    Scope, SharedReceiveQueue, SrqAttr, WcFlags, WcOpcode, WcStatus, WorkCompletion, XrcDomain,
    IWARP_MANUAL_CONNECT, IWARP_RESET,
};
pub use queue::{RecvHalf, ReuniteError, SendHalf, SplitError};
