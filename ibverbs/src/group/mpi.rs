//! [`MpiBootstrap`]: a group bootstrapped through the program's MPI communicator (feature `mpi`,
//! on rsmpi's `mpi` crate).

use std::fmt;

use mpi::datatype::PartitionMut;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;
use mpi::Count;

use crate::error::{Error, Result};
use crate::group::Bootstrap;

/// The ranks of an MPI communicator as a group [`Bootstrap`]: endpoints travel through
/// `MPI_Allgatherv` on a duplicate of the communicator (the program's own messages never meet
/// the group's), the local rank is the rank in `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`.
///
/// ```no_run
/// # fn main() -> ibverbs::Result<()> {
/// use ibverbs::group::{Group, GroupOptions, MpiBootstrap};
/// let universe = mpi::initialize().expect("MPI_Init");
/// let group = Group::create(MpiBootstrap::new(&universe.world()), &GroupOptions::default())?;
/// # let _ = group; Ok(()) }
/// ```
///
/// MPI has no notion of a rank failing alone: [`check`](Bootstrap::check) knows nothing, and
/// when a rank dies the launcher (`mpirun`) ends the job. Errors of MPI calls abort the job
/// (MPI's default error handler).
pub struct MpiBootstrap {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    local_rank: usize,
}

impl fmt::Debug for MpiBootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiBootstrap")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .finish()
    }
}

impl MpiBootstrap {
    /// A bootstrap over (a duplicate of) `comm`. Collective over `comm` (`MPI_Comm_dup`,
    /// `MPI_Comm_split_type`).
    pub fn new(comm: &SimpleCommunicator) -> MpiBootstrap {
        let comm = comm.duplicate();
        let local_rank = comm.split_shared(0).rank() as usize;
        MpiBootstrap { rank: comm.rank() as usize, size: comm.size() as usize, local_rank, comm }
    }

    /// The communicator the group's exchanges use.
    pub fn communicator(&self) -> &SimpleCommunicator {
        &self.comm
    }
}

impl Bootstrap for MpiBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn local_rank(&self) -> usize {
        self.local_rank
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let too_long = || Error::Bootstrap {
            reason: format!("an allgather contribution of {} bytes (MPI counts are 31-bit)", data.len()),
            source: None,
        };
        let mine = Count::try_from(data.len()).map_err(|_| too_long())?;
        let mut counts: Vec<Count> = vec![0; self.size];
        self.comm.all_gather_into(&mine, &mut counts[..]);
        let mut displs = Vec::with_capacity(self.size);
        let mut total: Count = 0;
        for &c in &counts {
            displs.push(total);
            total = total.checked_add(c).ok_or_else(too_long)?;
        }
        let mut all = vec![0u8; total as usize];
        {
            let mut part = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
            self.comm.all_gather_varcount_into(data, &mut part);
        }
        Ok(counts.iter().zip(&displs).map(|(&c, &d)| all[d as usize..(d + c) as usize].to_vec()).collect())
    }

    fn barrier(&mut self) -> Result<()> {
        self.comm.barrier();
        Ok(())
    }
}
