//! [`Launch`]: who this process is in its job, as the launcher's environment says.

use std::fmt;

use crate::error::{Error, ParseError, ParseErrorKind, Result};

/// The launcher whose variables described the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// This crate's own variables: `IBVERBS_RANK`, `IBVERBS_SIZE`, `IBVERBS_LOCAL_RANK`.
    Explicit,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`.
    OpenMpi,
    /// Slurm's `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`.
    Slurm,
    /// `torchrun` and the environments modelled on it: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`.
    Torchrun,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Explicit => "IBVERBS_RANK/IBVERBS_SIZE",
            Launcher::OpenMpi => "Open MPI (OMPI_COMM_WORLD_*)",
            Launcher::Slurm => "Slurm (SLURM_PROCID/SLURM_NTASKS)",
            Launcher::Torchrun => "torchrun (RANK/WORLD_SIZE)",
        })
    }
}

/// This process's place in its job: rank, size, rank on its host, and where the ranks meet.
///
/// Read from the environment a launcher sets ([`from_env`](Self::from_env)), in this order — the
/// first launcher whose rank variable is set wins, so `mpirun` inside a Slurm allocation is
/// read as Open MPI:
///
/// | launcher | rank | size | local rank | local size | job id |
/// |---|---|---|---|---|---|
/// | ours | `IBVERBS_RANK` | `IBVERBS_SIZE` | `IBVERBS_LOCAL_RANK` | `IBVERBS_LOCAL_SIZE` | `IBVERBS_JOB_ID` |
/// | Open MPI | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` | `OMPI_MCA_ess_base_jobid` |
/// | Slurm | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | — | `SLURM_JOB_ID`.`SLURM_STEP_ID` |
/// | torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `LOCAL_WORLD_SIZE` | `TORCHELASTIC_RUN_ID` |
///
/// A missing local rank is 0. The rendezvous (rank 0's address and a TCP port, for
/// [`TcpBootstrap`](super::TcpBootstrap)) is `IBVERBS_BOOTSTRAP=HOST:PORT`, else
/// `MASTER_ADDR` and `MASTER_PORT` (as torchrun sets them); `IBVERBS_JOB_ID` overrides the job id.
/// Ranks whose job ids differ refuse each other at the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank, `0..size`.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The rank among the ranks of this host.
    pub local_rank: usize,
    /// The number of ranks on this host, if the launcher says.
    pub local_size: Option<usize>,
    /// Whose variables these are.
    pub launcher: Launcher,
    /// `HOST:PORT` of rank 0's rendezvous, if set.
    pub rendezvous: Option<String>,
    /// The job's identity (empty if the launcher gives none).
    pub job_id: String,
}

/// Variable names of one launcher: rank, size, local rank, local size.
struct Names {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: Option<&'static str>,
}

const LAUNCHERS: [Names; 4] = [
    Names {
        launcher: Launcher::Explicit,
        rank: "IBVERBS_RANK",
        size: "IBVERBS_SIZE",
        local_rank: "IBVERBS_LOCAL_RANK",
        local_size: Some("IBVERBS_LOCAL_SIZE"),
    },
    Names {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
    },
    Names {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_size: None,
    },
    Names {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_size: Some("LOCAL_WORLD_SIZE"),
    },
];

/// Largest group the crate accepts (a bound on what a variable can make it allocate).
pub const MAX_RANKS: usize = 1 << 20;

impl Launch {
    /// Reads the process's environment (see the table above).
    ///
    /// # Errors
    /// [`Error::Bootstrap`] when no launcher's rank variable is set, or its size variable is
    /// missing; [`Error::Setting`] naming the variable for a value that is not a number in range
    /// (a rank not below the size, a size of 0 or above 2^20).
    pub fn from_env() -> Result<Launch> {
        Launch::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) over any source of variables (a map in tests).
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_vars<F>(get: F) -> Result<Launch>
    where
        F: Fn(&str) -> Option<String>,
    {
        let set = |name: &str| get(name).filter(|v| !v.is_empty());
        let Some(names) = LAUNCHERS.iter().find(|n| set(n.rank).is_some()) else {
            return Err(Error::Bootstrap {
                reason: "no launcher environment: none of IBVERBS_RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID, \
                         RANK is set (start the program with mpirun, srun or torchrun, or set IBVERBS_RANK and \
                         IBVERBS_SIZE)"
                    .into(),
                source: None,
            });
        };
        let number = |name: &'static str, min: usize, max: usize| -> Result<Option<usize>> {
            let Some(text) = set(name) else { return Ok(None) };
            match text.trim().parse::<usize>() {
                Ok(v) if (min..=max).contains(&v) => Ok(Some(v)),
                _ => Err(Error::Setting {
                    variable: Some(name),
                    error: ParseError::new(
                        &text,
                        0,
                        ParseErrorKind::Number { min: min as i64, max: max as i64 },
                    ),
                }),
            }
        };
        let size = number(names.size, 1, MAX_RANKS)?.ok_or_else(|| Error::Bootstrap {
            reason: format!("{} is set but {} is not", names.rank, names.size),
            source: None,
        })?;
        let rank = number(names.rank, 0, size - 1)?.unwrap_or(0);
        let local_size = match names.local_size {
            Some(n) => number(n, 1, size)?,
            None => None,
        };
        let local_rank = number(names.local_rank, 0, local_size.unwrap_or(size) - 1)?.unwrap_or(0);
        let rendezvous = match (set("IBVERBS_BOOTSTRAP"), set("MASTER_ADDR"), set("MASTER_PORT")) {
            (Some(hp), _, _) => Some(check_host_port("IBVERBS_BOOTSTRAP", &hp)?),
            (None, Some(addr), Some(port)) => {
                number("MASTER_PORT", 1, 65535)?;
                Some(if addr.contains(':') && !addr.starts_with('[') {
                    format!("[{addr}]:{}", port.trim())
                } else {
                    format!("{addr}:{}", port.trim())
                })
            }
            _ => None,
        };
        let job_id = set("IBVERBS_JOB_ID").unwrap_or_else(|| match names.launcher {
            Launcher::Explicit => String::new(),
            Launcher::OpenMpi => set("OMPI_MCA_ess_base_jobid").unwrap_or_default(),
            Launcher::Slurm => format!(
                "{}.{}",
                set("SLURM_JOB_ID").unwrap_or_default(),
                set("SLURM_STEP_ID").unwrap_or_default()
            ),
            Launcher::Torchrun => set("TORCHELASTIC_RUN_ID").unwrap_or_default(),
        });
        Ok(Launch { rank, size, local_rank, local_size, launcher: names.launcher, rendezvous, job_id })
    }
}

/// Checks `HOST:PORT` (`[V6]:PORT` for IPv6).
fn check_host_port(variable: &'static str, text: &str) -> Result<String> {
    let bad = |position| Error::Setting {
        variable: Some(variable),
        error: ParseError::new(
            text,
            position,
            ParseErrorKind::Word { expected: "HOST:PORT, e.g. 10.0.0.1:29500" },
        ),
    };
    let colon = text.rfind(':').ok_or_else(|| bad(text.len()))?;
    if colon == 0 {
        return Err(bad(0));
    }
    match text[colon + 1..].parse::<u16>() {
        Ok(p) if p > 0 => Ok(text.to_string()),
        _ => Err(bad(colon + 1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Result<Launch> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Launch::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn slurm() {
        let l = launch(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_ID", "17"),
            ("SLURM_STEP_ID", "0"),
            ("IBVERBS_BOOTSTRAP", "10.0.2.1:29500"),
        ])
        .unwrap();
        assert_eq!((l.rank, l.size, l.local_rank, l.local_size), (3, 4, 1, None));
        assert_eq!(l.launcher, Launcher::Slurm);
        assert_eq!(l.job_id, "17.0");
        assert_eq!(l.rendezvous.as_deref(), Some("10.0.2.1:29500"));
    }

    #[test]
    fn open_mpi_wins_over_the_slurm_allocation_around_it() {
        let l = launch(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_MCA_ess_base_jobid", "12345"),
        ])
        .unwrap();
        assert_eq!((l.rank, l.size, l.local_rank, l.local_size), (2, 4, 0, Some(2)));
        assert_eq!(l.launcher, Launcher::OpenMpi);
        assert_eq!(l.job_id, "12345");
        assert_eq!(l.rendezvous, None);
    }

    #[test]
    fn torchrun() {
        let l = launch(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "fd00::1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!((l.rank, l.size, l.local_rank), (1, 2, 1));
        assert_eq!(l.rendezvous.as_deref(), Some("[fd00::1]:29500"));
    }

    #[test]
    fn bad_values_name_their_variable() {
        let e = launch(&[("RANK", "4"), ("WORLD_SIZE", "4")]).unwrap_err().to_string();
        assert!(e.starts_with("RANK="), "{e}");
        let e = launch(&[("RANK", "0"), ("WORLD_SIZE", "0")]).unwrap_err().to_string();
        assert!(e.starts_with("WORLD_SIZE="), "{e}");
        let e = launch(&[("RANK", "0")]).unwrap_err().to_string();
        assert!(e.contains("RANK is set but WORLD_SIZE is not"), "{e}");
        let e = launch(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "1"), ("LOCAL_RANK", "1")])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("LOCAL_RANK="), "{e}");
        let e = launch(&[("IBVERBS_RANK", "0"), ("IBVERBS_SIZE", "2"), ("IBVERBS_BOOTSTRAP", "host")])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("IBVERBS_BOOTSTRAP="), "{e}");
        let e = launch(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "0")])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("MASTER_PORT="), "{e}");
        let e = launch(&[]).unwrap_err().to_string();
        assert!(e.contains("no launcher environment"), "{e}");
    }
}
