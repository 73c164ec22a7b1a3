//! [`RankProblem`]: what went wrong with other ranks of a [`group`](crate::group) (the payload of
//! [`Error::Group`](super::Error::Group)).

use std::fmt;
use std::time::Duration;

/// What went wrong with the ranks an [`Error::Group`](super::Error::Group) names.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RankProblem {
    /// They never reached the rendezvous (rank 0's listener) within the bound.
    NeverArrived {
        /// How long rank 0 waited for them.
        waited: Duration,
    },
    /// Their connection to the group closed: the process exited or was killed, or its host or
    /// link went away.
    Lost,
    /// They did not answer within the bound (alive, as far as anyone can tell, but stuck or
    /// behind).
    Unresponsive {
        /// How long the wait lasted.
        waited: Duration,
    },
    /// They reported a failure of their own (e.g. could not create or connect their queue pairs);
    /// the text is theirs.
    Failed {
        /// What the rank reported.
        reason: String,
    },
    /// They disagree with this rank about the group (its size, its job), or sent something that
    /// is not the bootstrap protocol.
    Mismatch {
        /// What differs.
        reason: String,
    },
    /// No network (rail) in common: two ranks whose NICs are on different networks cannot
    /// connect a queue pair.
    NoCommonRail {
        /// This rank's rails.
        ours: String,
        /// The other rank's rails.
        theirs: String,
    },
}

impl fmt::Display for RankProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankProblem::NeverArrived { waited } => {
                write!(f, "never arrived at the rendezvous within {waited:?}")
            }
            RankProblem::Lost => {
                f.write_str("lost (its connection closed: the process exited or was killed)")
            }
            RankProblem::Unresponsive { waited } => write!(f, "did not answer within {waited:?}"),
            RankProblem::Failed { reason } => write!(f, "failed: {reason}"),
            RankProblem::Mismatch { reason } => write!(f, "does not belong to this group: {reason}"),
            RankProblem::NoCommonRail { ours, theirs } => {
                write!(f, "shares no network with this rank (ours: {ours}; theirs: {theirs})")
            }
        }
    }
}

/// `"rank 3"`, `"ranks 1, 2"`.
pub(crate) fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}
