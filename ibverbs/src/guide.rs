//! # Guide: from `ibv_devinfo` to a running RDMA program
//!
//! This guide is for people who know RDMA from the operator's side — `ls /dev/infiniband`,
//! `ibv_devices`, `ibv_devinfo`, the `NCCL_IB_*` variables of a training job — and want to write
//! or run a program with this crate. It is documentation only: the chapters are modules with
//! nothing in them but text and examples, and every example is compiled (and run, where no
//! device is needed) by the crate's tests.
//!
//! 1. [Reading `ibv_devinfo`](devinfo): what each field means for a program, and where the crate
//!    shows it.
//! 2. [Choosing the operation](operations): RDMA Write, RDMA Read, Send/Recv, atomics.
//! 3. [GID index, MTU, timeout, retries](tuning) and the matching `NCCL_IB_*` settings, which
//!    the crate reads ([`select`](crate::select)).
//! 4. [GPUDirect RDMA](gpudirect) (dmabuf): what it is and where it stands in the crate.
//! 5. [When it does not work](diagnosis): the `doctor` example and the crate's error messages.
//! 6. [Connecting through RDMA-CM, and iWARP](rdma_cm): IP addresses instead of GIDs, and what
//!    the third kind of RDMA network (RDMA over TCP) does differently.
//! 7. [When the device itself is wrong](device_bugs): the provider and kernel bugs safe code
//!    could reach, and what the crate does about each.
//!
//! The quickest check of a machine is the `doctor` example, which runs the checks of chapters 1
//! and 5 in one go and prints which device, port and GID a program would use:
//!
//! ```sh
//! cargo build --example doctor && target/debug/examples/doctor
//! NCCL_IB_HCA=^mlx5_1 target/debug/examples/doctor    # what a job with that setting would use
//! ```

pub mod devinfo {
    //! # 1. Reading `ibv_devinfo`
    //!
    //! Three commands tell whether a host can do RDMA at all:
    //!
    //! ```text
    //! $ ls /dev/infiniband/
    //! issm0 issm1 rdma_cm umad0 umad1 uverbs0 uverbs1
    //! $ ibv_devices
    //!     device                 node GUID
    //!     ------              ----------------
    //!     mlx5_0              e8ebd303004325cc
    //!     mlx5_1              e8ebd303004325cd
    //! $ ibv_devinfo
    //! hca_id: mlx5_0
    //!         transport:                      InfiniBand (0)
    //!         fw_ver:                         16.27.4200
    //!         ...
    //!                 port:   1
    //!                         state:                  PORT_ACTIVE (4)
    //!                         max_mtu:                4096 (5)
    //!                         active_mtu:             1024 (3)
    //!                         sm_lid:                 0
    //!                         port_lid:               0
    //!                         port_lmc:               0x00
    //!                         link_layer:             Ethernet
    //! ```
    //!
    //! A program needs the `uverbsN` file of its device in `/dev/infiniband` (a container gets it
    //! only with `--device`), and a port whose state is `PORT_ACTIVE`. The crate's examples
    //! `devices` and `devinfo` print the same as the C tools (the device tests compare them
    //! byte for byte), and take the [selection](crate::select) from the environment, so
    //! `NCCL_IB_HCA=^mlx5_1 devinfo` shows what a job with that setting would use.
    //!
    //! ## The device
    //!
    //! | field | meaning for a program | in the crate |
    //! |---|---|---|
    //! | `hca_id` | the device's kernel name: what `NCCL_IB_HCA` lists | [`Device::name`](crate::Device::name), [`Context::open`](crate::Context::open) |
    //! | `transport` | `InfiniBand` (also RoCE and SoftRoCE) or `iWARP` (RC only, connected through RDMA-CM) | [`Device::transport_type`](crate::Device::transport_type) |
    //! | `fw_ver`, `vendor_id`, `vendor_part_id`, `board_id` | which adapter and firmware: for bug reports | [`DeviceAttr::fw_ver`](crate::DeviceAttr::fw_ver) |
    //! | `node_guid`, `sys_image_guid` | the adapter's identity; two ports of one adapter share the system image GUID | [`DeviceAttr::node_guid`](crate::DeviceAttr::node_guid) |
    //! | `phys_port_cnt` | ports are numbered from 1 | [`DeviceAttr::phys_port_cnt`](crate::DeviceAttr::phys_port_cnt) |
    //!
    //! With `-v`, the limits a program runs into:
    //!
    //! | field | meaning for a program |
    //! |---|---|
    //! | `max_qp`, `max_cq`, `max_mr`, `max_pd` | how many of each object the device holds (all processes together) |
    //! | `max_qp_wr` | the deepest send or receive queue: the most requests in flight per queue |
    //! | `max_sge` | scatter/gather entries per request |
    //! | `max_cqe` | the largest completion queue |
    //! | `max_mr_size` | the largest memory region |
    //! | `max_qp_rd_atom`, `max_qp_init_rd_atom` | RDMA Reads and atomics in flight per queue pair, as target and as initiator ([`ConnectOptions::max_rd_atomic`](crate::ConnectOptions::max_rd_atomic)) |
    //! | `atomic_cap` | `ATOMIC_NONE`: no atomics at all; `ATOMIC_HCA`: atomic among this adapter's users |
    //!
    //! ## The port
    //!
    //! | field | meaning for a program | in the crate |
    //! |---|---|---|
    //! | `state` | only `PORT_ACTIVE` moves data. `PORT_DOWN`: no link (cable, switch port, or on RoCE the network device is down); `PORT_INIT`/`PORT_ARMED` on InfiniBand: link up, but no subnet manager (`opensm`) has configured the port | [`PortAttr::state`](crate::PortAttr::state), [`PortProblem::NotActive`](crate::select::PortProblem::NotActive) |
    //! | `max_mtu`, `active_mtu` | the path MTU a connection may use is at most the smaller `active_mtu` of its two ends; on RoCE it follows the network device's MTU: 1500 gives 1024, 9000 gives 4096 | [`PortAttr::active_mtu`](crate::PortAttr::active_mtu) |
    //! | `link_layer` | `InfiniBand`: peers are addressed by LID; `Ethernet` (RoCE): by GID, an IP address | [`PortAttr::link_layer`](crate::PortAttr::link_layer) |
    //! | `port_lid`, `sm_lid`, `port_lmc` | InfiniBand addressing, assigned by the subnet manager; 0 on RoCE | [`PortAttr::lid`](crate::PortAttr::lid) |
    //! | `GID[n]` (with `-v`) | the port's addresses and their types: the GID index a RoCE connection uses names one of these | [`Context::gid_table`](crate::Context::gid_table) |
    //!
    //! On RoCE, the GID table holds each IP address of the network device, once per RoCE
    //! version (mlx5: `GID[2]` RoCE v1 and `GID[3]` RoCE v2 for the first IPv4 address — hence
    //! `NCCL_IB_GID_INDEX=3` in many job scripts). SoftRoCE has only RoCE v2 GIDs: `GID[1]` is
    //! the IPv4 address. See [chapter 3](super::tuning).
    //!
    //! ## The same from a program
    //!
    //! ```no_run
    //! use ibverbs::{LinkLayer, PortState};
    //!
    //! for device in ibverbs::devices()?.iter() {
    //!     let ctx = device.open()?;
    //!     let attr = ctx.query_device()?;
    //!     println!("{}: fw {}, {} port(s), queues up to {} requests", ctx.name(), attr.fw_ver(),
    //!              attr.phys_port_cnt(), attr.max_qp_wr());
    //!     for port in 1..=attr.phys_port_cnt() {
    //!         let p = ctx.query_port(port)?;
    //!         let usable = p.state() == PortState::ACTIVE;
    //!         println!("  port {port}: {:?}, active MTU {}, usable: {usable}", p.state(), p.active_mtu());
    //!         if p.link_layer() == LinkLayer::ETHERNET {
    //!             for gid in ctx.gid_table(port)? {
    //!                 println!("    GID[{}] {} {}", gid.index, gid.gid.ip(), gid.gid_type.as_str());
    //!             }
    //!         }
    //!     }
    //! }
    //! # Ok::<(), ibverbs::Error>(())
    //! ```
    //!
    //! Or, as plain data for the [selection](crate::select), in one call:
    //! [`Fabric::query`](crate::select::Fabric::query).
}

pub mod operations {
    //! # 2. Choosing the operation
    //!
    //! | operation | who acts | the peer's CPU | the peer must have | good for |
    //! |---|---|---|---|---|
    //! | **RDMA Write** | the writer alone | not involved, not told | a region with [`REMOTE_WRITE`](crate::AccessFlags::REMOTE_WRITE), its address and rkey ([`RemoteSlice`](crate::RemoteSlice)) | bulk data into a buffer the peer reserved (NCCL's main transfer) |
    //! | **RDMA Write with immediate** | the writer | told by a receive completion carrying 32 bits | as above, plus a posted receive | data plus "it is there" in one message |
    //! | **RDMA Read** | the reader alone | not involved | a region with [`REMOTE_READ`](crate::AccessFlags::REMOTE_READ) | pulling data the peer published; costs a round trip, and only `max_qp_rd_atom` are in flight |
    //! | **Send / Recv** | both | receives into buffers it posted beforehand | a posted receive big enough, or the sender waits (RNR retries) | control messages, small messages, when the receiver decides where data goes |
    //! | **Atomics** (compare-and-swap, fetch-and-add) | the initiator | not involved | an 8-byte aligned word in a region with [`REMOTE_ATOMIC`](crate::AccessFlags::REMOTE_ATOMIC); `atomic_cap` not `ATOMIC_NONE` | counters, locks, flags shared by many peers |
    //!
    //! One-sided operations (Write, Read, atomics) need the peer's [`RemoteSlice`](crate::RemoteSlice)
    //! first, exchanged out of band like the [`Endpoint`](crate::Endpoint) (both have `encode`
    //! and `decode`). Their completion appears only on the initiator's side. A region a peer may
    //! write is a [`RemoteMemoryRegion`](crate::RemoteMemoryRegion), which safe code reads by
    //! copying (it can change at any moment).
    //!
    //! Each is one constructor of [`SendRequest`](crate::SendRequest); the buffers move into the
    //! queue pair and come back with the completion
    //! ([`Completion::take_region`](crate::Completion::take_region)), or with the error of a
    //! post that failed ([`PostError::request`](crate::PostError::request); `?` drops them) —
    //! unless the provider queued the request before failing
    //! ([`Error::QueuedWithError`](crate::Error::QueuedWithError)): then it stays posted and
    //! its buffers come back with its completion:
    //!
    //! ```
    //! use ibverbs::{Local, MemoryRegion, QueuePair, RecvRequest, RemoteSlice, Result, SendRequest};
    //!
    //! /// Copies `data` into the peer's buffer `at`, and tells the peer with immediate data 7.
    //! fn write(qp: &mut QueuePair, data: MemoryRegion, at: RemoteSlice) -> Result<()> {
    //!     Ok(qp.post_send(SendRequest::write(Local::whole(data), at).imm(7).wr_id(1))?)
    //! }
    //!
    //! /// Fetches the peer's bytes `from` into `into`.
    //! fn read(qp: &mut QueuePair, into: MemoryRegion, from: RemoteSlice) -> Result<()> {
    //!     Ok(qp.post_send(SendRequest::read(Local::whole(into), from).wr_id(2))?)
    //! }
    //!
    //! /// A message: the peer must have posted a receive first.
    //! fn send(qp: &mut QueuePair, peer_qp: &mut QueuePair, msg: MemoryRegion, buf: MemoryRegion) -> Result<()> {
    //!     peer_qp.post_recv(RecvRequest::new(Local::whole(buf)).wr_id(3))?;
    //!     Ok(qp.post_send(SendRequest::send(Local::whole(msg)).wr_id(4))?)
    //! }
    //!
    //! /// Adds 1 to the peer's 8-byte counter; the old value lands in `old` (8 bytes).
    //! fn increment(qp: &mut QueuePair, old: MemoryRegion, counter: RemoteSlice) -> Result<()> {
    //!     Ok(qp.post_send(SendRequest::fetch_add(Local::new(old, 0..8)?, counter, 1).wr_id(5))?)
    //! }
    //!
    //! /// Takes a lock word: 0 → 1 if it was free; `old` tells whether we got it.
    //! fn try_lock(qp: &mut QueuePair, old: MemoryRegion, lock: RemoteSlice) -> Result<()> {
    //!     Ok(qp.post_send(SendRequest::compare_swap(Local::new(old, 0..8)?, lock, 0, 1).wr_id(6))?)
    //! }
    //! # let _ = (write, read, send, increment, try_lock);
    //! ```
    //!
    //! Small messages (up to the QP's `max_inline_data`) can go inline, copied during the post:
    //! [`SendRequest::send_inline`](crate::SendRequest::send_inline),
    //! [`write_inline`](crate::SendRequest::write_inline). A stream of requests need not all be
    //! signaled ([`unsignaled`](crate::SendRequest::unsignaled)): on RC, a completion says
    //! that every earlier request of the queue is done too.
    //!
    //! **Transports.** RC (reliable connected) is the default and the only one that does Read
    //! and atomics. UC (unreliable connected) does Write and Send without acknowledgements. UD
    //! (unreliable datagram) does Send only, one MTU per message, to any peer through an
    //! [`AddressHandle`](crate::AddressHandle). See [`QpType`](crate::QpType).
}

pub mod tuning {
    //! # 3. GID index, MTU, timeout, retries — and `NCCL_IB_*`
    //!
    //! These are [`ConnectOptions`](crate::ConnectOptions) fields, and
    //! [`select::Config`](crate::select::Config) reads them from the same environment
    //! variables as NCCL (ours, `IBVERBS_*`, win when both are set):
    //!
    //! | setting | NCCL | ours | default here | what it does |
    //! |---|---|---|---|---|
    //! | devices and ports | `NCCL_IB_HCA` | `IBVERBS_HCA` | every ACTIVE port | `mlx5_0:1,mlx5_1` includes, `^mlx5_1` excludes, `=` matches exactly ([`HcaSelector`](crate::select::HcaSelector)) |
    //! | GID index | `NCCL_IB_GID_INDEX` | `IBVERBS_GID_INDEX` | automatic | the local address of RoCE traffic |
    //! | address family | `NCCL_IB_ADDR_FAMILY` | `IBVERBS_ADDR_FAMILY` | `AF_INET` | for the automatic GID choice |
    //! | address range | `NCCL_IB_ADDR_RANGE` | `IBVERBS_ADDR_RANGE` | any | e.g. `10.0.0.0/8`, for the automatic GID choice |
    //! | RoCE version | `NCCL_IB_ROCE_VERSION_NUM` | `IBVERBS_ROCE_VERSION` | 2 | for the GID choice |
    //! | ACK timeout | `NCCL_IB_TIMEOUT` | `IBVERBS_TIMEOUT` | 14 | 4.096 µs × 2^N before a retry |
    //! | retries | `NCCL_IB_RETRY_CNT` | `IBVERBS_RETRY_CNT` | 6 | retries before `RETRY_EXC_ERR` (7: for ever on rxe) |
    //! | service level | `NCCL_IB_SL` | `IBVERBS_SL` | 0 | InfiniBand QoS lane |
    //! | traffic class | `NCCL_IB_TC` | `IBVERBS_TC` | 0 | the GRH/IP traffic class byte: DSCP in its upper 6 bits |
    //! | P_Key index | `NCCL_IB_PKEY` | `IBVERBS_PKEY_INDEX` | 0 | InfiniBand partition |
    //! | path MTU | — | `IBVERBS_MTU` | the ports' active MTU | 256..4096 bytes |
    //!
    //! ```
    //! use ibverbs::select::Config;
    //!
    //! // The environment of the job in the RDMA primer that operators learn from:
    //! let job = [("NCCL_IB_HCA", "mlx5_1,mlx5_2"), ("NCCL_IB_GID_INDEX", "3"),
    //!            ("NCCL_IB_TIMEOUT", "23"), ("NCCL_IB_RETRY_CNT", "7")];
    //! let config = Config::from_vars(|name| job.iter().find(|(k, _)| *k == name).map(|(_, v)| *v))?;
    //! assert_eq!(config.connect.gid_index, Some(3));
    //! assert_eq!((config.connect.timeout, config.connect.retry_cnt), (23, 7));
    //! assert_eq!(config.selection.hca.entries().len(), 2);
    //! # Ok::<(), ibverbs::Error>(())
    //! ```
    //!
    //! In a program, [`Config::from_env`](crate::select::Config::from_env) and
    //! [`open`](crate::select::Config::open) give the device and the options:
    //!
    //! ```no_run
    //! use ibverbs::select::Config;
    //! use ibverbs::QpType;
    //!
    //! let config = Config::from_env()?;
    //! let (ctx, opts) = config.open()?;
    //! let pd = ctx.alloc_pd()?;
    //! let cq = ctx.create_cq(64, None)?;
    //! let qp = pd.create_qp(&cq, QpType::RC).build()?;
    //! let me = qp.endpoint(&opts)?; // send me.encode() to the peer, then qp.connect(&peer, &opts)
    //! # let _ = me;
    //! # Ok::<(), ibverbs::Error>(())
    //! ```
    //!
    //! ## GID index
    //!
    //! On RoCE every packet carries a source GID — an IP address of the port's network device —
    //! chosen by index in the port's GID table. The wrong one does not fail at setup: the
    //! connection times out (`RETRY_EXC_ERR`) or never routes. The crate chooses as NCCL does
    //! ([`GidPolicy`](crate::select::GidPolicy)): RoCE v2, IPv4 unless told otherwise, in the
    //! address range if one is given, lowest index first. An explicit index always wins, and is
    //! checked: empty entries and RoCE v1 entries (unless RoCE v1 is asked for) are named
    //! errors, not timeouts. On InfiniBand, peers are addressed by LID and no GID is needed.
    //!
    //! ## MTU
    //!
    //! The path MTU of a connection is the smaller active MTU of its two ports
    //! ([`QueuePair::connect`](crate::QueuePair::connect) does this). On RoCE the active MTU
    //! follows the network device: raise the device's MTU to 9000 for 4096-byte RDMA packets
    //! (about 1.5× the bandwidth of 1024 on SoftRoCE). Asking for more than a port's active MTU
    //! through `IBVERBS_MTU` is a named error
    //! ([`PortProblem::MtuAboveActive`](crate::select::PortProblem::MtuAboveActive)).
    //!
    //! ## Timeout and retries
    //!
    //! An unacknowledged packet is resent after 4.096 µs × 2^`timeout`; after `retry_cnt`
    //! resends the request fails with `RETRY_EXC_ERR` and the queue pair goes to the error
    //! state. So a dead peer is noticed after about (`retry_cnt` + 1) × that time:
    //!
    //! | `timeout` | one wait | with 7 retries |
    //! |---|---|---|
    //! | 14 (this crate; its 6 retries: 0.47 s) | 67 ms | 0.5 s |
    //! | 18 | 1.07 s | 8.6 s |
    //! | 20 | 4.3 s | 34 s |
    //! | 22 | 17 s | 2.3 min |
    //! | 23 (the primer's job) | 34 s | 4.6 min |
    //!
    //! Large fabrics with congestion need long timeouts (spurious retries make congestion
    //! worse); a test or a latency-sensitive service wants short ones. `rnr_retry` is apart: how
    //! often a Send is retried when the receiver has no receive posted (7 = forever).
    //! **SoftRoCE caveat:** rxe treats `retry_cnt = 7` as "retry forever", which is why this
    //! crate's default is 6 (the C tools' is 7): a vanished peer then surfaces as an error within
    //! [`ConnectOptions::retry_budget`](crate::ConnectOptions::retry_budget) (about twice that on
    //! rxe, whose timer is coarse). An explicit 7 (e.g. `NCCL_IB_RETRY_CNT=7`) is kept as asked.
}

pub mod gpudirect {
    //! # 4. GPUDirect RDMA (dmabuf)
    //!
    //! GPUDirect RDMA lets the adapter read and write GPU memory directly: a training job's
    //! gradients go from one GPU to another across the network without a copy through host
    //! memory. The adapter needs the GPU memory registered like host memory, which the kernel
    //! allows in two ways:
    //!
    //! - **dmabuf** (the current way): the GPU driver exports the memory range as a dmabuf file
    //!   descriptor (CUDA: `cuMemGetHandleForAddressRange` with
    //!   `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`, CUDA ≥ 11.7 with the open GPU kernel modules),
    //!   and `ibv_reg_dmabuf_mr()` registers it (Linux ≥ 5.12, rdma-core ≥ 34);
    //! - **peer memory** (the older way): with the `nvidia_peermem` module loaded, plain
    //!   `ibv_reg_mr()` accepts a GPU pointer. The `doctor` example lists the module when it is
    //!   loaded.
    //!
    //! Containers also need the GPU's device files (`--gpus`), and the `/dev/infiniband` files
    //! as always.
    //!
    //! ## Where it stands in this crate
    //!
    //! Registration is wrapped, posting is raw.
    //! [`ProtectionDomain::register_dmabuf`](crate::ProtectionDomain::register_dmabuf) registers
    //! a range of the dma-buf the GPU driver exports (`ibv_reg_dmabuf_mr()`) as a
    //! [`DmabufRegion`](crate::DmabufRegion): deregistered when dropped, its
    //! [`remote`](crate::DmabufRegion::remote) descriptor for peers (who then write or read GPU
    //! memory with RDMA Write and Read), its [`lkey`](crate::DmabufRegion::lkey) and
    //! [`iova`](crate::DmabufRegion::iova) for local requests. The safe posting level cannot
    //! take it: a [`MemoryRegion`](crate::MemoryRegion) derefs to `&[u8]`, and an
    //! [`OwnedBuffer`](crate::OwnedBuffer) promises memory the CPU may read and write — GPU
    //! memory is neither, so never pass a GPU pointer to
    //! [`OwnedBuffer::from_raw_parts`](crate::OwnedBuffer::from_raw_parts). Local requests on it
    //! go through the `unsafe` level, which takes raw work requests with any registered
    //! memory's `lkey`:
    //!
    //! ```no_run
    //! use std::os::fd::BorrowedFd;
    //! use ibverbs::{AccessFlags, DmabufRegion, ProtectionDomain, Result};
    //!
    //! /// Registers `len` bytes of the dma-buf `fd` (exported by the GPU driver) for local and
    //! /// remote access; the descriptor may be closed afterwards.
    //! fn register_gpu_memory(pd: &ProtectionDomain, fd: BorrowedFd<'_>, len: usize) -> Result<DmabufRegion> {
    //!     let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    //!     pd.register_dmabuf(fd, 0, len, 0, access)
    //! }
    //! # let _ = register_gpu_memory;
    //! ```
    //!
    //! Requests on such memory then go through
    //! [`QueuePair::post_send_unchecked`](crate::QueuePair::post_send_unchecked), whose `# Safety`
    //! section lists what the caller keeps valid until the completion (the region among it: keep
    //! the `DmabufRegion` alive until then). A device without dma-buf registration (SoftRoCE and
    //! siw among them) gives [`Error::Unsupported`](crate::Error::Unsupported).
}

pub mod diagnosis {
    //! # 5. When it does not work
    //!
    //! Run the `doctor` example first: it checks the device files, the kernel modules, the
    //! locked-memory limit, every port's state, GIDs and MTU, registers 1 MiB, and prints which
    //! port and GID the settings select — with the fix for each problem. Its exit status is 1
    //! when nothing is usable, so it can gate a job script.
    //!
    //! The crate's errors say the same things:
    //!
    //! | symptom | error | what the message adds |
    //! |---|---|---|
    //! | no device at all | [`Error::DeviceNotFound`](crate::Error::DeviceNotFound) with `available: "none"` | whether `/dev/infiniband` exists (not passed to the container?), whether the kernel has devices and `ib_uverbs`, how to load them |
    //! | registration refused | [`Error::Verb`](crate::Error::Verb) of `ibv_reg_mr` with `ENOMEM`/`EPERM` | the current `RLIMIT_MEMLOCK` and how to raise it: `ulimit -l unlimited`, `LimitMEMLOCK=infinity`, `docker run --ulimit memlock=-1` — or that the limit is not the cause (with `CAP_IPC_LOCK`: not the cause but on siw, which counts registrations against it anyway) |
    //! | a setting is wrong | [`Error::Setting`](crate::Error::Setting) | the variable, its value, the position of the problem |
    //! | nothing selected is usable | [`Error::NoUsablePort`](crate::Error::NoUsablePort) | every port and its [`PortProblem`](crate::select::PortProblem): not listed, excluded, not ACTIVE (with the network device's state), MTU above the active MTU, GID index empty or not RoCE v2, no GID in the family and range |
    //! | a port named by flags cannot be used | [`Error::Port`](crate::Error::Port) | its [`PortProblem`](crate::select::PortProblem) |
    //!
    //! ```
    //! use ibverbs::select::PortProblem;
    //! use ibverbs::Error;
    //!
    //! fn explain(e: &Error) -> &'static str {
    //!     match e {
    //!         Error::Setting { .. } => "fix the variable named in the message",
    //!         Error::DeviceNotFound { available, .. } if available == "none" => "no RDMA device on this host",
    //!         Error::NoUsablePort { rejected, .. }
    //!             if rejected.iter().any(|r| matches!(r.problem, PortProblem::NotActive { .. })) =>
    //!         {
    //!             "a selected port is down"
    //!         }
    //!         Error::Verb { verb: "ibv_reg_mr", .. } => "registration refused: see RLIMIT_MEMLOCK in the message",
    //!         _ => "see the message",
    //!     }
    //! }
    //! # let _ = explain;
    //! ```
    //!
    //! Failures after setup are completion statuses, not errors
    //! ([`WcStatus`](crate::WcStatus)): `RETRY_EXC_ERR` (12) means the peer did not answer — it
    //! died, or the GID/route is wrong (the selection's checks above catch most of those);
    //! `RNR_RETRY_EXC_ERR` (13) means it answered but had no receive posted;
    //! `REM_ACCESS_ERR` (10) means the rkey, address or access rights do not match the
    //! peer's region.
}

pub mod rdma_cm {
    //! # 6. Connecting through RDMA-CM, and iWARP
    //!
    //! An RC queue pair can be connected in two ways:
    //!
    //! - **By hand**: each side gets its [`Endpoint`](crate::Endpoint) (queue pair number, PSN,
    //!   LID or GID: [`QueuePair::endpoint`](crate::QueuePair::endpoint)), sends it to the peer
    //!   over a channel of its own (a TCP socket, a job launcher), and calls
    //!   [`QueuePair::connect`](crate::QueuePair::connect) with the peer's. This is what
    //!   `ibv_rc_pingpong` and perftest do by default, and what NCCL does over its bootstrap
    //!   sockets; the GID index, MTU and retry settings of [chapter 3](super::tuning) apply.
    //! - **Through RDMA-CM** (librdmacm, the `rdma_cm` entry of `/dev/infiniband`): the server
    //!   listens on an IP address and port of the RDMA port's network device, the client
    //!   connects to it, and RDMA-CM finds the device, the GID and the path and moves both queue
    //!   pairs to RTS — as a TCP connection would. This is `rping`, `perftest -R` and
    //!   `rdma_server`/`rdma_client`; the crate's [`cm`](crate::cm) module.
    //!
    //! The primer's three kinds of RDMA network differ here. InfiniBand and RoCE take both
    //! ways. **iWARP** (RDMA over TCP; soft-iWARP, `siw`, is its software device, as SoftRoCE,
    //! `rxe`, is RoCE's) takes RDMA-CM only: its queue pairs ride on TCP connections that
    //! RDMA-CM makes, and [`QueuePair::connect`](crate::QueuePair::connect) refuses them with
    //! [`Error::Unsupported`](crate::Error::Unsupported). `ibv_devinfo` shows it as
    //! `transport: iWARP (1)` ([`Context::is_iwarp`](crate::Context::is_iwarp)); its ports have no
    //! RoCE GID, so the address a program needs is the IP address of the network device under
    //! the port, which the `doctor` example prints (`IP addresses:`;
    //! [`Netdev::addresses`](crate::select::Netdev::addresses)).
    //!
    // The example needs the `cm` feature (on by default).
    #![cfg_attr(feature = "cm", doc = "```no_run")]
    #![cfg_attr(not(feature = "cm"), doc = "```ignore")]
    //! use std::net::SocketAddr;
    //! use std::time::Duration;
    //!
    //! use ibverbs::cm::{self, ConnParam, Listener};
    //! use ibverbs::QpCaps;
    //!
    //! let wait = Duration::from_secs(10);
    //! let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, ..QpCaps::default() };
    //!
    //! // Server: an address of the RDMA port's network device, and a port of its choosing.
    //! fn serve(addr: SocketAddr, caps: QpCaps, wait: Duration) -> ibverbs::Result<()> {
    //!     // The device behind `addr` as RDMA-CM opened it: the queue pair is made on an
    //!     // RDMA-CM id, so its PD and CQ come from this context.
    //!     let ctx = cm::device_context(addr, wait)?;
    //!     let (pd, cq) = (ctx.alloc_pd()?, ctx.create_cq(64, None)?);
    //!     let listener = Listener::bind(addr)?;
    //!     let (id, qp, _private_data) = listener.accept(&pd, &cq, caps, &ConnParam::default(), wait)?;
    //!     // `qp` is connected (RTS): post and poll as on any queue pair. `id` holds the
    //!     // connection: keep it while the queue pair is used.
    //!     # let _ = (id, qp);
    //!     Ok(())
    //! }
    //!
    //! // Client: the server's address; the device is the one that routes to it.
    //! fn dial(server: SocketAddr, caps: QpCaps, wait: Duration) -> ibverbs::Result<()> {
    //!     let ctx = cm::device_context(server, wait)?;
    //!     let (pd, cq) = (ctx.alloc_pd()?, ctx.create_cq(64, None)?);
    //!     let (id, qp) = cm::connect(server, &pd, &cq, caps, &ConnParam::default(), wait)?;
    //!     # let _ = (id, qp);
    //!     Ok(())
    //! }
    //! # let _ = (serve, dial, caps, wait);
    //! ```
    //!
    //! Every wait is bounded by `wait`: an address nobody answers for is
    //! [`Error::Timeout`](crate::Error::Timeout), a port nobody listens on
    //! [`Error::Rejected`](crate::Error::Rejected). To build the queue pair yourself (an SRQ, other
    //! capacities), use [`cm::resolve`](crate::cm::resolve), then
    //! [`QueuePairBuilder::build_on`](crate::QueuePairBuilder::build_on) and
    //! [`cm::establish`](crate::cm::establish).
    //!
    //! ## What iWARP does differently
    //!
    //! | | InfiniBand, RoCE | iWARP (siw measured) |
    //! |---|---|---|
    //! | queue pair types | RC, UC, UD (XRC on some adapters) | RC only: UC and UD are [`Error::Unsupported`](crate::Error::Unsupported) (`"UD queue pairs"`) |
    //! | connecting | by hand or RDMA-CM | RDMA-CM only |
    //! | immediate data | yes | no |
    //! | atomics | most adapters (`atomic_cap`) | siw: none (`atomic_cap` NONE) |
    //! | a Send that finds no receive posted | retried (`rnr_retry`), then `RNR_RETRY_EXC_ERR` | no retry: the connection ends, so post receives first |
    //! | the peer refuses an access, or dies | an error completion of that request (`REM_ACCESS_ERR`, `RETRY_EXC_ERR`) | the connection ends (a `DISCONNECTED` event) and the requests still outstanding flush (`WR_FLUSH_ERR`); a Send or RDMA Write completed successfully once TCP took it, and on siw a request posted after the end is never completed |
    //!
    //! On siw the crate also works around three things of the Linux driver: it completes a Send
    //! or RDMA Write before an RDMA Read posted ahead of it, so the safe level fences every
    //! request but Reads and atomics (the completion order is then the posting order, which the
    //! buffer hand-back relies on); all the queues of one context fit in 576 KiB (a creation
    //! error says so — RDMA-CM puts every queue pair of a device on one context); and
    //! `rdma_connect` blocks until TCP connects (up to about 131 s), which
    //! [`cm::connect`](crate::cm::connect) keeps within its bound.
    //!
    //! One more thing of siw it cannot work around, read in Linux 6.1's `siw_accept`: the
    //! accepting side sends its MPA reply, then hands its socket's receive upcall from the
    //! connection manager to the queue pair. A message that arrives in between stays in the
    //! socket, unprocessed, until the next one arrives: the acceptor's receive does not
    //! complete. Only the first message of the active side, posted as soon as it is connected
    //! and before the acceptor's [`cm::accept_request`](crate::cm::accept_request) (or
    //! `rdma_accept`'s `ESTABLISHED`) is through, can land there. The window is short; one
    //! failure of this crate's CI on siw fits it (the sender's Send completed, the acceptor's
    //! receive never did). A protocol that opens that way (rping's, C or Rust) then stalls
    //! until its timeout; one whose acceptor speaks first, or whose active side waits for a
    //! word from the acceptor, does not.
    //!
    //! Ports: rdma_cm picks an id's port (a listener's with port 0, every connecting id's) from
    //! the ephemeral range TCP uses, without seeing TCP's sockets, and siw binds that port in
    //! the TCP stack. When a native socket holds it (one left in `TIME_WAIT` by an earlier TCP
    //! connection of the host is enough), `rdma_listen` or `rdma_connect` fails with
    //! `EADDRINUSE`. [`Listener::bind`](crate::cm::Listener::bind) with port 0,
    //! [`cm::connect`](crate::cm::connect) and [`cm::connect_with`](crate::cm::connect_with)
    //! (for a queue pair the caller builds) then try another id, up to 16; code that calls
    //! `CmId::connect` or [`cm::establish`](crate::cm::establish) itself can do the same (a new
    //! id, and its queue pair, get another port). `iwpmd`, the port mapper rdma-core runs for
    //! iWARP devices, does not help siw, which binds the rdma_cm port and not the mapped one.
    //!
    //! The examples that run on iWARP: `rping`, `rdma_server` and `rdma_client` (against
    //! rdmacm-utils' tools), the perftest-style `write_bw`, `read_bw`, `send_bw`, `write_lat` and
    //! `send_lat` with `-R` (on both sides), `async_rpc -R` and `striped_bw`. `rc_pingpong`, `srq_pingpong` and
    //! `ud_pingpong` connect by hand, as the C tools they mirror, and stop with the error above.
}

pub mod device_bugs {
    //! # 7. When the device itself is wrong
    //!
    //! A safe binding promises more than "no undefined behaviour in this process": safe code
    //! must not lose completions, spin without end or crash the machine, on the providers and
    //! kernels people run, bugs included. These are the bugs the crate knows of, how it finds
    //! the devices that have them (once per [`Context`](crate::Context): the vendor ID from
    //! `ibv_query_device()` and the running kernel's version from `uname()`), and what it does.
    //! Each has a device test that failed before the crate steered around it.
    //!
    //! ## rxe: the extended CQ's `ibv_next_poll` at the end of the queue
    //! `ibv_create_cq_ex(3)` polls with `ibv_start_poll`, `ibv_next_poll` until it returns
    //! `ENOENT`, then `ibv_end_poll`. rdma-core's rxe provider (vendor ID 0xffffff) stores the
    //! consumer index and releases its lock in `ibv_next_poll` when it finds the queue empty,
    //! then advances the index and releases the lock again in `ibv_end_poll`: the consumer passes
    //! the producer, and from then on every poll returns stale or zeroed "successful" entries
    //! (`wr_id` 0) while real completions are skipped. It happens whenever a poll's array is
    //! larger than what is pending, the usual case. No rdma-core release has the fix (rdma-core
    //! 44 in Debian 12 has the bug). On rxe the crate therefore reads one completion per
    //! `ibv_start_poll`/`ibv_end_poll` and never calls `ibv_next_poll`: each completion costs
    //! one lock round trip more, and nothing is lost.
    //!
    //! ## rxe: a local invalidation of a window a peer already invalidated
    //! Linux's rxe (6.1) checks only for windows in its INVALID state before invalidating one,
    //! but an invalidation leaves a type 2 window FREE: a second invalidation dereferences the
    //! NULL queue pair and region pointers (`rxe_invalidate_mw` → `__rxe_put`) and panics the
    //! kernel. A peer's Send with Invalidate followed by
    //! [`SendRequest::local_invalidate`](crate::SendRequest::local_invalidate) of the same window
    //! is enough. The peer may invalidate at any moment (rxe does not even check that the
    //! invalidating queue pair is the window's), and rxe reports it with the kernel's flag bit
    //! (`IB_WC_WITH_INVALIDATE`, which is `IBV_WC_IP_CSUM_OK` in user space), so no tracking of
    //! completions could tell in time. On rxe the crate refuses every local invalidation of a
    //! type 2 window with [`Error::Unsupported`](crate::Error::Unsupported) naming the bug, and
    //! hands the window back. [`BoundWindow::revoke`](crate::BoundWindow::revoke) ends its
    //! access instead: it deallocates the window (`ibv_dealloc_mw()`, which is safe in any
    //! state) and allocates a fresh one on the same protection domain. Dropping the window does
    //! the first half. Posting `IBV_WR_LOCAL_INV` through [`ffi`](crate::ffi) remains possible,
    //! and can crash the machine.
    //!
    //! ## rxe: destroying a queue pair that type 2 windows are still bound through
    //! Linux's rxe takes a reference on the queue pair for every type 2 window bound through it
    //! and gives it back only when the window is invalidated or deallocated. `ibv_destroy_qp` of
    //! a queue pair such a window still references waits in the kernel for that reference,
    //! gives up, and frees the queue pair anyway, which the window's later deallocation touches.
    //! Dropping a connected pair with its CQs and PD before two still-bound type 2 windows took
    //! 102.8 s on 6.1. On rxe a type 2 window holds back the destruction of the queue pair its
    //! bind was posted through, from that post until it is deallocated (dropped,
    //! [`revoke`](crate::BoundWindow::revoke)d) or proven unbound: a queue pair dropped before
    //! its windows returns at once, and is destroyed (with its CQs, PD and buffers released
    //! after it) when its last window goes, on the thread that drops it. Every drop order of the
    //! crate's objects takes milliseconds. A queue pair dropped while a bind posted on it is not
    //! polled yet waits for that completion to be polled (and its window dropped); if its CQ is
    //! never polled again, the queue pair, the CQ and the window stay allocated until the process
    //! exits. Type 1 windows do not reference a queue pair.
    //!
    //! ## Any provider: a completion queue that never runs dry
    //! The async adaptor's [`Op`](crate::aio::Op) future drives its completion queue while it is
    //! polled. A CQ that keeps returning completions nobody waits for (a provider bug like the
    //! first one above, or a flood of completions of other requests) would keep one poll busy
    //! for ever, with the runtime's timers starved and memory growing. A poll of an `Op` (and
    //! [`Driver::reap`](crate::aio::Driver::reap)) handles a bounded number of completions, then
    //! wakes its task and yields. [`Driver::with_cq`](crate::aio::Driver::with_cq) hands out a
    //! view of the driven CQ that can create queue pairs but not poll it, so no completion can
    //! be taken behind the driver's back.
    //!
    //! ## Which kernels and providers were checked
    //! The crate's device suite runs on Debian 12's kernel 6.1 (rdma-core 44) in every run of
    //! the project's tests, and part of it again on the newest kernel of Debian's backports
    //! (6.12). Both kernels have the window crash and report remote invalidations with the wrong
    //! flag; the extended-CQ bug is rdma-core's, whatever the kernel. The project's
    //! `docs/device-bugs.md` keeps the measurements.
}
