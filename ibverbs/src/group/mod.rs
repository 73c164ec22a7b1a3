//! Groups of ranks: HPC programs started as N processes by `mpirun`, Slurm's `srun` or
//! `torchrun`, connected all to all over RDMA.
//!
//! Two pieces, each usable alone:
//!
//! - a [`Bootstrap`]: who this process is (rank, size, local rank) and a way to exchange a few
//!   bytes with every other rank (allgather, barrier). [`TcpBootstrap`] reads the launcher's
//!   environment ([`Launch`]: Open MPI's `OMPI_COMM_WORLD_*`, Slurm's `SLURM_*`, torchrun's
//!   `RANK`/`WORLD_SIZE`) and meets the other ranks over TCP at rank 0, as NCCL's bootstrap
//!   does; `MpiBootstrap` (feature `mpi`) uses the program's MPI communicator.
//! - a [`Group`]: on top of a bootstrap, one RC queue pair from every rank to every other, on
//!   each NIC (rail) the two share, the NIC nearest to the rank's CPUs first.
//!
//! ```no_run
//! use ibverbs::group::{Group, GroupOptions, TcpBootstrap};
//! use ibverbs::{Local, RecvRequest, SendRequest};
//! # fn main() -> ibverbs::Result<()> {
//! // mpirun -n 4 -x IBVERBS_BOOTSTRAP=node1:29500 ./prog   (or srun, or torchrun)
//! let mut group = Group::create(TcpBootstrap::from_env()?, &GroupOptions::default())?;
//! let (me, n) = (group.rank(), group.size());
//! let (left, right) = ((me + n - 1) % n, (me + 1) % n);
//! let rail = group.rail(0);
//! let buf = rail.pd().allocate(64)?;
//! rail.qp(left).unwrap().post_recv(RecvRequest::new(Local::whole(buf)))?;
//! group.barrier()?; // every receive posted before anyone sends
//! let rail = group.rail(0);
//! rail.qp(right).unwrap().post_send(SendRequest::send_inline(b"hello, right neighbour"))?;
//! # Ok(()) }
//! ```
//!
//! # Failures
//! Every wait is bounded ([`BootstrapOptions`]), and a failure anywhere becomes an error
//! everywhere: [`Error::Group`](crate::Error::Group) names the ranks at fault and what happened
//! to them ([`RankProblem`]): never arrived, lost (the process
//! died: its TCP connection to rank 0 closed, which rank 0 relays to every rank at once), failed
//! with its own error, or unresponsive. A rank that waits for data on its queue pairs calls
//! [`Group::check`] in its loop: the queue pairs themselves only report a dead peer to the rank
//! that sends to it (after the transport's retries), not to one that waits to receive.
//!
//! # Rails and locality
//! The ports come from [`select`](crate::select) (so `NCCL_IB_HCA`, `NCCL_IB_GID_INDEX` and
//! the rest apply). A rank orders them as NCCL does: the NIC on the NUMA node of the rank's CPUs
//! first (its *primary* rail); equally near NICs are spread over the ranks of a host by local
//! rank. Two ranks connect the rails that are on the same network (the IP network of a RoCE
//! GID, the subnet prefix on InfiniBand), so a host with two NICs on two networks has two queue
//! pairs to each peer. [`Group::describe`] says which NIC each rank took and why.

mod launch;
mod locality;
mod mesh;
#[cfg(feature = "mpi")]
mod mpi;
mod rails;
mod tcp;
mod wire;

pub use crate::error::RankProblem;
pub use launch::{Launch, Launcher, MAX_RANKS};
pub use mesh::{plan_rails, Group, GroupOptions, Rail};
#[cfg(feature = "mpi")]
pub use mpi::MpiBootstrap;
pub use rails::{RailInfo, RailPolicy};
pub use tcp::{BootstrapOptions, TcpBootstrap};

use crate::error::Result;

/// How the ranks of a job learn about each other: their number, their places, and an exchange
/// of bytes. The implementations: [`TcpBootstrap`] (the launcher's environment and TCP) and,
/// with the `mpi` feature, `MpiBootstrap` (an MPI communicator).
///
/// Every method but the accessors is collective where it says so: every rank must call it, in
/// the same order.
pub trait Bootstrap {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn size(&self) -> usize;

    /// The rank among the ranks of this host (picks the NIC among equally near ones).
    fn local_rank(&self) -> usize;

    /// The host name of `rank`, where known (for messages).
    fn host(&self, _rank: usize) -> Option<&str> {
        None
    }

    /// Every rank's `data`, in rank order (this rank's included). Collective; contributions
    /// may differ in length.
    ///
    /// # Errors
    /// [`Error::Group`](crate::Error::Group) naming the ranks that were lost, failed or did not
    /// answer within the bound.
    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Returns once every rank has called it. Collective.
    ///
    /// # Errors
    /// As [`allgather`](Self::allgather).
    fn barrier(&mut self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }

    /// Without waiting: an error if a rank is known to be lost or failed. The default knows
    /// nothing and returns `Ok`.
    ///
    /// # Errors
    /// [`Error::Group`](crate::Error::Group) naming the rank.
    fn check(&mut self) -> Result<()> {
        Ok(())
    }

    /// Tells the other ranks that this one failed, with `reason`, best effort. The default does
    /// nothing (an MPI job ends when one of its processes exits with an error).
    fn fail(&mut self, _reason: &str) {}
}

impl<B: Bootstrap + ?Sized> Bootstrap for Box<B> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn local_rank(&self) -> usize {
        (**self).local_rank()
    }
    fn host(&self, rank: usize) -> Option<&str> {
        (**self).host(rank)
    }
    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        (**self).allgather(data)
    }
    fn barrier(&mut self) -> Result<()> {
        (**self).barrier()
    }
    fn check(&mut self) -> Result<()> {
        (**self).check()
    }
    fn fail(&mut self, reason: &str) {
        (**self).fail(reason)
    }
}
