//! Choosing devices, ports and GIDs the way NCCL does, from the same settings.
//!
//! People who run RDMA at scale configure it through NCCL's environment variables. This module
//! reads the same ones — and our own `IBVERBS_*` names, which win — so that a job already set up
//! for NCCL runs unchanged:
//!
//! ```no_run
//! fn main() -> ibverbs::Result<()> {
//!     // NCCL_IB_HCA=mlx5_0:1,mlx5_1 NCCL_IB_GID_INDEX=3 NCCL_IB_TIMEOUT=22 ./my-job
//!     let config = ibverbs::select::Config::from_env()?; // a typo in any variable is an error naming it
//!     let (ctx, opts) = config.open()?; // the first usable port, its GID, timeout, retries...
//!     println!("using {} port {} GID index {:?}", ctx.name(), opts.port, opts.gid_index);
//!     Ok(())
//! }
//! ```
//!
//! # The variables
//!
//! | ours | NCCL's | what | type |
//! |---|---|---|---|
//! | `IBVERBS_HCA` | `NCCL_IB_HCA` | devices and ports to use | [`HcaSelector`] |
//! | `IBVERBS_GID_INDEX` | `NCCL_IB_GID_INDEX` | GID index; `-1` = automatic | [`GidPolicy::index`] |
//! | `IBVERBS_ADDR_FAMILY` | `NCCL_IB_ADDR_FAMILY` | `AF_INET` or `AF_INET6`, for the automatic GID choice | [`AddrFamily`] |
//! | `IBVERBS_ADDR_RANGE` | `NCCL_IB_ADDR_RANGE` | e.g. `10.0.0.0/8`, for the automatic GID choice | [`AddrRange`] |
//! | `IBVERBS_ROCE_VERSION` | `NCCL_IB_ROCE_VERSION_NUM` | `1` or `2` | [`RoceVersion`] |
//! | `IBVERBS_TIMEOUT` | `NCCL_IB_TIMEOUT` | ACK timeout exponent, 0..=31 | [`ConnectOptions::timeout`] |
//! | `IBVERBS_RETRY_CNT` | `NCCL_IB_RETRY_CNT` | transport retries, 0..=7 | [`ConnectOptions::retry_cnt`] |
//! | `IBVERBS_SL` | `NCCL_IB_SL` | service level, 0..=15 | [`ConnectOptions::sl`] |
//! | `IBVERBS_TC` | `NCCL_IB_TC` | traffic class, 0..=255 | [`ConnectOptions::traffic_class`] |
//! | `IBVERBS_PKEY_INDEX` | `NCCL_IB_PKEY` | P_Key index, 0..=65535 | [`ConnectOptions::pkey_index`] |
//! | `IBVERBS_MTU` | — | path MTU in bytes: 256, 512, 1024, 2048 or 4096 | [`Selection::mtu`] |
//! | `IBVERBS_QPS_PER_CONNECTION` | `NCCL_IB_QPS_PER_CONNECTION` | queue pairs per striped connection, 1..=64 | [`StripeOptions::qps`](crate::striped::StripeOptions::qps) |
//! | `IBVERBS_SPLIT_DATA_ON_QPS` | `NCCL_IB_SPLIT_DATA_ON_QPS` | 1: split large requests over them; 0: round-robin | [`StripeOptions::split_data`](crate::striped::StripeOptions::split_data) |
//!
//! [`ConnectOptions::timeout`]: crate::ConnectOptions::timeout
//! [`ConnectOptions::retry_cnt`]: crate::ConnectOptions::retry_cnt
//! [`ConnectOptions::sl`]: crate::ConnectOptions::sl
//! [`ConnectOptions::traffic_class`]: crate::ConnectOptions::traffic_class
//! [`ConnectOptions::pkey_index`]: crate::ConnectOptions::pkey_index
//!
//! [`VARIABLES`] lists them for programs that print their settings. A variable set to the empty
//! string means its default (and still hides the NCCL variable behind it). Settings NCCL has
//! and this crate does not read (`NCCL_IB_DISABLE`, `NCCL_IB_USE_INLINE`...) are about how NCCL
//! uses connections, not how to make one.
//!
//! # How a port is chosen
//!
//! [`Selection::evaluate`] goes through the devices in natural name order (`mlx5_2` before
//! `mlx5_10`, [`natural_cmp`]) and their ports in ascending order — deterministic, whatever
//! order the kernel lists the devices in (it is not sorted: a device added later may come
//! first); the first usable port is what [`Config::open`] uses. It keeps a port when, in this
//! order of checks:
//!
//! 1. the [`HcaSelector`] selects it (`NCCL_IB_HCA`; every port when unset);
//! 2. its link layer is InfiniBand or Ethernet;
//! 3. it is ACTIVE ([`PortProblem::NotActive`] names its state, and for RoCE the state of its
//!    network device);
//! 4. its active MTU is at least the [`mtu`](Selection::mtu) asked for, if any;
//! 5. the [`GidPolicy`] finds its GID (on Ethernet) or it is addressed by LID (InfiniBand).
//!    An iWARP device's port ([`DeviceDesc::iwarp`], e.g. siw) takes no GID: its queue pairs
//!    connect through RDMA-CM ([`crate::cm`]), which addresses them by IP; only an explicit
//!    index is checked (in the table, not empty), and the address family, range and RoCE
//!    version do not apply.
//!
//! Every port not kept is reported with the [`PortProblem`] that excluded it, so a program can say
//! *why* nothing is usable ([`Error::NoUsablePort`](crate::Error::NoUsablePort)). The selection
//! works on a [`Fabric`] — plain data — so it can be tested on descriptions written by hand.

mod env;
mod fabric;
mod gid;
mod hca;
mod parse;
mod selection;

pub use crate::attr::{Netdev, RoceVersion};
pub use crate::error::{ParseError, ParseErrorKind, PortProblem, Rejected};
pub use env::{Config, Setting, Variable, VARIABLES};
pub use fabric::{natural_cmp, DeviceDesc, Fabric, PortDesc};
pub use gid::{AddrFamily, AddrRange, GidPolicy};
pub use hca::{HcaEntry, HcaSelector};
pub use selection::{Choice, Outcome, Selection};
