//! [`TcpBootstrap`]: ranks meet at rank 0 over TCP (like NCCL's own bootstrap), no MPI needed.
//!
//! Rank 0 listens on the rendezvous port; every other rank connects (retrying while rank 0 is not
//! up yet) and introduces itself with its job key, the group's size, its rank and host. Rank 0
//! keeps one connection per rank for the life of the group: an allgather is every rank sending
//! its bytes to rank 0 and rank 0 sending all of them back. Those connections double as a
//! liveness signal: a rank that dies closes its connection, rank 0 sees it at once and tells
//! every other rank which rank it lost ([`Error::Group`] with [`RankProblem::Lost`]).

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use crate::error::{Error, RankProblem, Result};
use crate::group::launch::Launch;
use crate::group::wire::{self, AbortKind, Frame, ReadError};
use crate::group::Bootstrap;

/// Bounds of a [`TcpBootstrap`]'s waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootstrapOptions {
    /// How long the ranks wait for each other at the rendezvous (rank 0 for the last rank to
    /// arrive; the others for rank 0 to listen and answer). Default 60 s.
    pub rendezvous_timeout: Duration,
    /// How long an allgather or barrier waits for the slowest rank. Default 300 s: ranks may
    /// compute between collective steps; a rank that *dies* is reported at once, not after this.
    pub op_timeout: Duration,
    /// How long rank 0 waits for a new connection's first frame before closing it (a stray
    /// client must not hold up the rendezvous). Default 2 s.
    pub hello_timeout: Duration,
}

impl Default for BootstrapOptions {
    fn default() -> BootstrapOptions {
        BootstrapOptions {
            rendezvous_timeout: Duration::from_secs(60),
            op_timeout: Duration::from_secs(300),
            hello_timeout: Duration::from_secs(2),
        }
    }
}

/// A rank's connections to the group.
#[derive(Debug)]
enum Role {
    /// Rank 0: one connection per other rank (index = rank; `None` at 0 and for ranks gone).
    Root { peers: Vec<Option<TcpStream>>, early: Vec<Option<(u32, Vec<u8>)>>, left: Vec<bool> },
    /// Any other rank: its connection to rank 0, and whether rank 0 left normally.
    Member { root: TcpStream, root_left: bool },
}

/// The group bootstrap over TCP, from the launcher's environment ([`Launch`]).
///
/// ```no_run
/// use ibverbs::group::{Bootstrap, TcpBootstrap};
/// # fn main() -> ibverbs::Result<()> {
/// // torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (or srun/mpirun's variables
/// // and IBVERBS_BOOTSTRAP=HOST:PORT)
/// let mut boot = TcpBootstrap::from_env()?;
/// let all = boot.allgather(format!("hello from {}", boot.rank()).as_bytes())?;
/// assert_eq!(all.len(), boot.size());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TcpBootstrap {
    launch: Launch,
    opts: BootstrapOptions,
    role: Role,
    hosts: Vec<String>,
    seq: u32,
    /// Set once the group is broken: every later step fails with it.
    broken: Option<(&'static str, Vec<usize>, RankProblem)>,
}

impl TcpBootstrap {
    /// [`Launch::from_env`], then [`connect`](Self::connect) with the default bounds.
    ///
    /// # Errors
    /// As [`Launch::from_env`] and [`connect`](Self::connect).
    pub fn from_env() -> Result<TcpBootstrap> {
        TcpBootstrap::connect(Launch::from_env()?, &BootstrapOptions::default())
    }

    /// Meets the other ranks at `launch.rendezvous`: rank 0 listens there (on every address,
    /// at that port), the others connect to it. Returns once every rank has arrived.
    ///
    /// # Errors
    /// - [`Error::Bootstrap`]: no rendezvous address, it does not resolve, or rank 0 cannot
    ///   listen on it (the port is in use).
    /// - [`Error::Group`] with [`RankProblem::NeverArrived`] on every rank that arrived, naming
    ///   those that did not within `rendezvous_timeout`; [`RankProblem::Mismatch`] when rank 0
    ///   belongs to another job or group size; [`RankProblem::Unresponsive`] (rank 0) when
    ///   nothing answers.
    pub fn connect(launch: Launch, opts: &BootstrapOptions) -> Result<TcpBootstrap> {
        let Some(rendezvous) = launch.rendezvous.clone() else {
            return Err(Error::Bootstrap {
                reason: format!(
                    "no rendezvous address for {}: set IBVERBS_BOOTSTRAP=HOST:PORT (rank 0's host) or \
                     MASTER_ADDR and MASTER_PORT",
                    launch.launcher
                ),
                source: None,
            });
        };
        let addr = resolve(&rendezvous)?;
        let mut boot = TcpBootstrap {
            hosts: vec![String::new(); launch.size],
            launch,
            opts: *opts,
            role: Role::Member { root: placeholder_stream()?, root_left: false },
            seq: 0,
            broken: None,
        };
        if boot.launch.rank == 0 {
            boot.serve(addr)?;
        } else {
            boot.join(addr)?;
        }
        Ok(boot)
    }

    /// The launcher's description of this process.
    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    fn job_key(&self) -> u64 {
        wire::job_key(&self.launch.job_id)
    }

    /// Rank 0: accept every other rank.
    fn serve(&mut self, addr: SocketAddr) -> Result<()> {
        let size = self.launch.size;
        let bind: SocketAddr = match addr {
            SocketAddr::V4(a) => (std::net::Ipv4Addr::UNSPECIFIED, a.port()).into(),
            SocketAddr::V6(a) => (std::net::Ipv6Addr::UNSPECIFIED, a.port()).into(),
        };
        let listener = TcpListener::bind(bind).map_err(|e| Error::Bootstrap {
            reason: format!("rank 0 cannot listen on {bind} (the rendezvous {addr})"),
            source: Some(e),
        })?;
        listener.set_nonblocking(true).map_err(|e| Error::Bootstrap {
            reason: "setting the rendezvous listener non-blocking".into(),
            source: Some(e),
        })?;
        let mut peers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let mut hosts = vec![String::new(); size];
        hosts[0] = host_name();
        let mut arrived = 1;
        let start = Instant::now();
        let deadline = start + self.opts.rendezvous_timeout;
        while arrived < size {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (1..size).filter(|&r| peers[r].is_none()).collect();
                let problem = RankProblem::NeverArrived { waited: self.opts.rendezvous_timeout };
                let frame = Frame::Abort {
                    problem: AbortKind::NeverArrived,
                    ranks: missing.iter().map(|&r| r as u32).collect(),
                    text: String::new(),
                };
                for s in peers.iter_mut().flatten() {
                    let _ = wire::write_frame(s, &frame, Duration::from_secs(1));
                }
                return Err(Error::Group { during: "rendezvous", ranks: missing, problem });
            }
            let (mut s, _) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5).min(deadline - now));
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(Error::Bootstrap {
                        reason: "accepting at the rendezvous".into(),
                        source: Some(e),
                    })
                }
            };
            if s.set_nonblocking(false).is_err() {
                continue;
            }
            let _ = s.set_nodelay(true);
            let limit = self.opts.hello_timeout.min(deadline.saturating_duration_since(Instant::now()));
            // A stray connection (garbage, silence, another job) is closed; a rank of this job
            // that disagrees is told why before it is closed.
            let Ok(Frame::Hello { job, size: their_size, rank, host, .. }) = wire::read_frame(&mut s, limit)
            else {
                continue;
            };
            let refuse = |s: &mut TcpStream, text: String| {
                let f = Frame::Abort { problem: AbortKind::Mismatch, ranks: vec![0], text };
                let _ = wire::write_frame(s, &f, Duration::from_secs(1));
            };
            if job != self.job_key() {
                refuse(&mut s, "rank 0 at this rendezvous belongs to another job".into());
                continue;
            }
            if their_size as usize != size {
                refuse(&mut s, format!("rank 0 was started for {size} ranks, this rank for {their_size}"));
                continue;
            }
            let rank = rank as usize;
            if rank == 0 || rank >= size {
                refuse(&mut s, format!("rank {rank} is not a rank of a group of {size} other than 0"));
                continue;
            }
            if peers[rank].is_some() {
                refuse(&mut s, format!("rank {rank} already joined from {}", hosts[rank]));
                continue;
            }
            hosts[rank] = host;
            peers[rank] = Some(s);
            arrived += 1;
        }
        let welcome = Frame::Welcome { hosts: hosts.clone() };
        let mut lost = Vec::new();
        for (r, s) in peers.iter_mut().enumerate() {
            if let Some(st) = s {
                if wire::write_frame(st, &welcome, self.opts.rendezvous_timeout).is_err() {
                    lost.push(r);
                }
            }
        }
        self.hosts = hosts;
        self.role = Role::Root { peers, early: vec![None; size], left: vec![false; size] };
        if !lost.is_empty() {
            return Err(self.abort("rendezvous", lost, RankProblem::Lost));
        }
        Ok(())
    }

    /// Any other rank: connect to rank 0 and wait for everyone.
    fn join(&mut self, addr: SocketAddr) -> Result<()> {
        let wait = self.opts.rendezvous_timeout;
        // Rank 0 gives up at its own deadline and tells everyone: wait a little longer for that.
        let deadline = Instant::now() + wait + Duration::from_secs(5);
        let mut s = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Group {
                    during: "rendezvous",
                    ranks: vec![0],
                    problem: RankProblem::Unresponsive { waited: wait },
                });
            }
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
                Ok(s) => break s,
                Err(_) => std::thread::sleep(Duration::from_millis(50).min(left)),
            }
        };
        let _ = s.set_nodelay(true);
        let hello = Frame::Hello {
            job: self.job_key(),
            size: self.launch.size as u32,
            rank: self.launch.rank as u32,
            local_rank: self.launch.local_rank as u32,
            host: host_name(),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        wire::write_frame(&mut s, &hello, left).map_err(|e| Error::Bootstrap {
            reason: format!("sending this rank's introduction to rank 0 at {addr}"),
            source: Some(e),
        })?;
        let left = deadline.saturating_duration_since(Instant::now());
        match wire::read_frame(&mut s, left) {
            Ok(Frame::Welcome { hosts }) if hosts.len() == self.launch.size => {
                self.hosts = hosts;
                self.role = Role::Member { root: s, root_left: false };
                Ok(())
            }
            Ok(Frame::Abort { problem, ranks, text }) => {
                Err(abort_error("rendezvous", problem, ranks, text, wait))
            }
            Ok(other) => Err(mismatch_root("rendezvous", format!("answered {:?}", kind_name(&other)))),
            Err(e) => Err(read_error("rendezvous", 0, e, wait)),
        }
    }

    /// Marks the group broken, tells every rank still connected (rank 0), and returns the error.
    fn abort(&mut self, during: &'static str, ranks: Vec<usize>, problem: RankProblem) -> Error {
        if let Role::Root { peers, .. } = &mut self.role {
            let (kind, text) = abort_kind(&problem);
            let frame =
                Frame::Abort { problem: kind, ranks: ranks.iter().map(|&r| r as u32).collect(), text };
            for (r, s) in peers.iter_mut().enumerate() {
                if let Some(st) = s {
                    if !ranks.contains(&r) {
                        let _ = wire::write_frame(st, &frame, Duration::from_secs(1));
                    }
                }
                *s = None;
            }
        }
        self.broken = Some((during, ranks.clone(), problem.clone()));
        Error::Group { during, ranks, problem }
    }

    fn check_broken(&self) -> Result<()> {
        match &self.broken {
            Some((during, ranks, problem)) => {
                Err(Error::Group { during, ranks: ranks.clone(), problem: problem.clone() })
            }
            None => Ok(()),
        }
    }

    /// Rank 0's side of an allgather.
    fn root_allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let size = self.launch.size;
        let seq = self.seq;
        let op = self.opts.op_timeout;
        let deadline = Instant::now() + op;
        let mut parts: Vec<Option<Vec<u8>>> = vec![None; size];
        parts[0] = Some(data.to_vec());
        let (left_rank, early_bad) = {
            let Role::Root { early, left, .. } = &mut self.role else {
                unreachable!("root_allgather on rank 0")
            };
            let left_rank = (1..size).find(|&r| left[r]);
            let mut bad = None;
            for r in 1..size {
                match early[r].take() {
                    Some((s, d)) if s == seq => parts[r] = Some(d),
                    Some((s, _)) => bad = Some((r, s)),
                    None => {}
                }
            }
            (left_rank, bad)
        };
        if let Some(r) = left_rank {
            let problem = RankProblem::Failed { reason: "it left the group (its handle was dropped)".into() };
            return Err(self.abort("allgather", vec![r], problem));
        }
        if let Some((r, s)) = early_bad {
            let problem =
                RankProblem::Mismatch { reason: format!("sent allgather {s} during allgather {seq}") };
            return Err(self.abort("allgather", vec![r], problem));
        }
        loop {
            let missing: Vec<usize> = (1..size).filter(|&r| parts[r].is_none()).collect();
            if missing.is_empty() {
                break;
            }
            let Role::Root { peers, .. } = &mut self.role else { unreachable!() };
            let now = Instant::now();
            if now >= deadline {
                return Err(self.abort("allgather", missing, RankProblem::Unresponsive { waited: op }));
            }
            let ready = match poll_readable(peers, &missing, deadline - now) {
                Ok(r) => r,
                Err(e) => {
                    return Err(Error::Bootstrap {
                        reason: "poll() on the group's connections".into(),
                        source: Some(e),
                    })
                }
            };
            for r in ready {
                let Role::Root { peers, .. } = &mut self.role else { unreachable!() };
                let Some(s) = peers[r].as_mut() else { continue };
                match wire::read_frame(
                    s,
                    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100)),
                ) {
                    Ok(Frame::Gather { seq: s2, data }) if s2 == seq => parts[r] = Some(data),
                    Ok(Frame::Fail { text }) => {
                        return Err(self.abort("allgather", vec![r], RankProblem::Failed { reason: text }))
                    }
                    Ok(Frame::Leave) => {
                        let problem = RankProblem::Failed {
                            reason: "it left the group (its handle was dropped)".into(),
                        };
                        return Err(self.abort("allgather", vec![r], problem));
                    }
                    Ok(other) => {
                        let reason = format!("sent {} during allgather {seq}", kind_name(&other));
                        return Err(self.abort("allgather", vec![r], RankProblem::Mismatch { reason }));
                    }
                    Err(ReadError::TimedOut) => {
                        return Err(self.abort(
                            "allgather",
                            vec![r],
                            RankProblem::Unresponsive { waited: op },
                        ))
                    }
                    Err(ReadError::Garbage(reason)) => {
                        return Err(self.abort("allgather", vec![r], RankProblem::Mismatch { reason }))
                    }
                    Err(ReadError::Closed | ReadError::Io) => {
                        return Err(self.abort("allgather", vec![r], RankProblem::Lost))
                    }
                }
            }
        }
        let parts: Vec<Vec<u8>> = parts.into_iter().map(Option::unwrap_or_default).collect();
        let result = Frame::Result { seq, parts };
        let bytes_len: usize = match &result {
            Frame::Result { parts, .. } => parts.iter().map(|p| p.len() + 4).sum(),
            _ => 0,
        };
        if bytes_len > wire::MAX_PAYLOAD - 8 {
            let reason =
                format!("an allgather of {bytes_len} bytes in all (at most {})", wire::MAX_PAYLOAD - 8);
            return Err(Error::Bootstrap { reason, source: None });
        }
        let Role::Root { peers, .. } = &mut self.role else { unreachable!() };
        let mut lost = Vec::new();
        for (r, s) in peers.iter_mut().enumerate() {
            if let Some(st) = s {
                if wire::write_frame(st, &result, op).is_err() {
                    lost.push(r);
                }
            }
        }
        if !lost.is_empty() {
            return Err(self.abort("allgather", lost, RankProblem::Lost));
        }
        self.seq = self.seq.wrapping_add(1);
        let Frame::Result { parts, .. } = result else { unreachable!() };
        Ok(parts)
    }

    /// Any other rank's side of an allgather.
    fn member_allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.seq;
        let op = self.opts.op_timeout;
        let Role::Member { root, root_left } = &mut self.role else {
            unreachable!("member_allgather on rank 0")
        };
        if *root_left {
            let problem = RankProblem::Failed { reason: "it left the group (its handle was dropped)".into() };
            return Err(self.broke("allgather", vec![0], problem));
        }
        if data.len() > wire::MAX_PAYLOAD - 4 {
            let reason = format!(
                "an allgather contribution of {} bytes (at most {})",
                data.len(),
                wire::MAX_PAYLOAD - 4
            );
            return Err(Error::Bootstrap { reason, source: None });
        }
        if wire::write_frame(root, &Frame::Gather { seq, data: data.to_vec() }, op).is_err() {
            return Err(self.broke("allgather", vec![0], RankProblem::Lost));
        }
        let Role::Member { root, .. } = &mut self.role else { unreachable!() };
        // Rank 0 waits `op` for the slowest rank and then says so: wait a little longer.
        match wire::read_frame(root, op + Duration::from_secs(5)) {
            Ok(Frame::Result { seq: s, parts }) if s == seq && parts.len() == self.launch.size => {
                self.seq = self.seq.wrapping_add(1);
                Ok(parts)
            }
            Ok(Frame::Abort { problem, ranks, text }) => {
                let e = abort_error("allgather", problem, ranks, text, op);
                Err(self.broke_with(e))
            }
            Ok(other) => {
                Err(self.broke_with(mismatch_root("allgather", format!("sent {}", kind_name(&other)))))
            }
            Err(e) => {
                let e = read_error("allgather", 0, e, op);
                Err(self.broke_with(e))
            }
        }
    }

    fn broke(&mut self, during: &'static str, ranks: Vec<usize>, problem: RankProblem) -> Error {
        self.broken = Some((during, ranks.clone(), problem.clone()));
        Error::Group { during, ranks, problem }
    }

    fn broke_with(&mut self, e: Error) -> Error {
        if let Error::Group { during, ranks, problem } = &e {
            self.broken = Some((during, ranks.clone(), problem.clone()));
        }
        e
    }
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.launch.rank
    }

    fn size(&self) -> usize {
        self.launch.size
    }

    fn local_rank(&self) -> usize {
        self.launch.local_rank
    }

    fn host(&self, rank: usize) -> Option<&str> {
        self.hosts.get(rank).map(String::as_str)
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.check_broken()?;
        if self.launch.size == 1 {
            return Ok(vec![data.to_vec()]);
        }
        match self.role {
            Role::Root { .. } => self.root_allgather(data),
            Role::Member { .. } => self.member_allgather(data),
        }
    }

    fn check(&mut self) -> Result<()> {
        self.check_broken()?;
        let size = self.launch.size;
        match &mut self.role {
            Role::Member { root_left: true, .. } => Ok(()),
            Role::Member { root, root_left } => {
                if !poll_fds(&[root.as_raw_fd()], Duration::ZERO)
                    .unwrap_or_default()
                    .first()
                    .copied()
                    .unwrap_or(false)
                {
                    return Ok(());
                }
                match wire::read_frame(root, Duration::from_secs(1)) {
                    Ok(Frame::Leave) => {
                        *root_left = true;
                        Ok(())
                    }
                    Ok(Frame::Abort { problem, ranks, text }) => {
                        let e = abort_error("check", problem, ranks, text, self.opts.op_timeout);
                        Err(self.broke_with(e))
                    }
                    Ok(other) => {
                        Err(self.broke_with(mismatch_root("check", format!("sent {}", kind_name(&other)))))
                    }
                    Err(e) => {
                        let e = read_error("check", 0, e, self.opts.op_timeout);
                        Err(self.broke_with(e))
                    }
                }
            }
            Role::Root { peers, early, left } => {
                let watch: Vec<usize> = (1..size).filter(|&r| !left[r] && early[r].is_none()).collect();
                let ready = poll_readable(peers, &watch, Duration::ZERO).unwrap_or_default();
                for r in ready {
                    let Role::Root { peers, early, left } = &mut self.role else { unreachable!() };
                    let Some(s) = peers[r].as_mut() else { continue };
                    match wire::read_frame(s, Duration::from_secs(1)) {
                        Ok(Frame::Gather { seq, data }) => early[r] = Some((seq, data)),
                        Ok(Frame::Leave) => left[r] = true,
                        Ok(Frame::Fail { text }) => {
                            return Err(self.abort("check", vec![r], RankProblem::Failed { reason: text }))
                        }
                        Ok(other) => {
                            let reason = format!("sent {}", kind_name(&other));
                            return Err(self.abort("check", vec![r], RankProblem::Mismatch { reason }));
                        }
                        Err(ReadError::Garbage(reason)) => {
                            return Err(self.abort("check", vec![r], RankProblem::Mismatch { reason }))
                        }
                        Err(ReadError::TimedOut) => {
                            let waited = Duration::from_secs(1);
                            return Err(self.abort("check", vec![r], RankProblem::Unresponsive { waited }));
                        }
                        Err(ReadError::Closed | ReadError::Io) => {
                            return Err(self.abort("check", vec![r], RankProblem::Lost))
                        }
                    }
                }
                Ok(())
            }
        }
    }

    fn fail(&mut self, reason: &str) {
        if self.broken.is_some() {
            return;
        }
        let rank = self.launch.rank;
        match &mut self.role {
            Role::Member { root, .. } => {
                let _ = wire::write_frame(
                    root,
                    &Frame::Fail { text: reason.to_string() },
                    Duration::from_secs(1),
                );
                self.broken = Some(("fail", vec![rank], RankProblem::Failed { reason: reason.to_string() }));
            }
            Role::Root { .. } => {
                let _ = self.abort("fail", vec![0], RankProblem::Failed { reason: reason.to_string() });
            }
        }
    }
}

impl Drop for TcpBootstrap {
    fn drop(&mut self) {
        if self.broken.is_some() || self.launch.size == 1 {
            return;
        }
        match &mut self.role {
            Role::Member { root, root_left: false } => {
                let _ = wire::write_frame(root, &Frame::Leave, Duration::from_millis(200));
            }
            Role::Member { .. } => {}
            Role::Root { peers, .. } => {
                for s in peers.iter_mut().flatten() {
                    let _ = wire::write_frame(s, &Frame::Leave, Duration::from_millis(200));
                }
            }
        }
    }
}

/// The ranks among `watch` whose connection has something to read (or closed), waiting at most
/// `limit`.
fn poll_readable(
    peers: &[Option<TcpStream>],
    watch: &[usize],
    limit: Duration,
) -> std::io::Result<Vec<usize>> {
    let idx: Vec<usize> =
        watch.iter().copied().filter(|&r| peers.get(r).is_some_and(Option::is_some)).collect();
    let fds: Vec<RawFd> = idx.iter().map(|&r| peers[r].as_ref().map_or(-1, |s| s.as_raw_fd())).collect();
    let ready = poll_fds(&fds, limit)?;
    Ok(idx.into_iter().zip(ready).filter(|(_, ready)| *ready).map(|(r, _)| r).collect())
}

/// Which of `fds` are readable (or closed), waiting at most `limit`.
fn poll_fds(fds: &[RawFd], limit: Duration) -> std::io::Result<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    let ms = i32::try_from(limit.as_millis()).unwrap_or(i32::MAX);
    loop {
        // SAFETY: `pfds` is a valid array of `pfds.len()` pollfd structs, alive for the call; the
        // descriptors belong to streams the caller keeps open meanwhile.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(pfds.iter().map(|f| f.revents != 0).collect());
    }
}

fn resolve(hp: &str) -> Result<SocketAddr> {
    hp.to_socket_addrs()
        .map_err(|e| Error::Bootstrap { reason: format!("resolving the rendezvous {hp}"), source: Some(e) })?
        .next()
        .ok_or_else(|| Error::Bootstrap {
            reason: format!("the rendezvous {hp} resolves to no address"),
            source: None,
        })
}

/// A connected socket to stand in before the real role is set (never used for I/O).
fn placeholder_stream() -> Result<TcpStream> {
    let l = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| Error::Bootstrap { reason: "binding a loopback socket".into(), source: Some(e) })?;
    let a = l
        .local_addr()
        .map_err(|e| Error::Bootstrap { reason: "loopback address".into(), source: Some(e) })?;
    TcpStream::connect(a).map_err(|e| Error::Bootstrap { reason: "loopback connect".into(), source: Some(e) })
}

/// This host's name (`gethostname`), or `""`.
pub(crate) fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its length; gethostname writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn kind_name(f: &Frame) -> &'static str {
    match f {
        Frame::Hello { .. } => "an introduction",
        Frame::Welcome { .. } => "a welcome",
        Frame::Gather { .. } => "an allgather contribution",
        Frame::Result { .. } => "an allgather result",
        Frame::Abort { .. } => "an abort",
        Frame::Fail { .. } => "a failure",
        Frame::Leave => "a leave",
    }
}

fn abort_kind(p: &RankProblem) -> (AbortKind, String) {
    match p {
        RankProblem::NeverArrived { .. } => (AbortKind::NeverArrived, String::new()),
        RankProblem::Lost => (AbortKind::Lost, String::new()),
        RankProblem::Unresponsive { .. } => (AbortKind::Unresponsive, String::new()),
        RankProblem::Failed { reason } => (AbortKind::Failed, reason.clone()),
        RankProblem::Mismatch { reason } => (AbortKind::Mismatch, reason.clone()),
        RankProblem::NoCommonRail { ours, theirs } => {
            (AbortKind::Failed, format!("no common rail ({ours} / {theirs})"))
        }
    }
}

/// The error an abort from rank 0 means on this rank.
fn abort_error(
    during: &'static str,
    kind: AbortKind,
    ranks: Vec<u32>,
    text: String,
    waited: Duration,
) -> Error {
    let problem = match kind {
        AbortKind::NeverArrived => RankProblem::NeverArrived { waited },
        AbortKind::Lost => RankProblem::Lost,
        AbortKind::Unresponsive => RankProblem::Unresponsive { waited },
        AbortKind::Failed => RankProblem::Failed { reason: text },
        AbortKind::Mismatch => RankProblem::Mismatch { reason: text },
    };
    let mut ranks: Vec<usize> = ranks.into_iter().map(|r| r as usize).collect();
    ranks.sort_unstable();
    Error::Group { during, ranks, problem }
}

fn mismatch_root(during: &'static str, reason: String) -> Error {
    Error::Group { during, ranks: vec![0], problem: RankProblem::Mismatch { reason } }
}

fn read_error(during: &'static str, rank: usize, e: ReadError, waited: Duration) -> Error {
    let problem = match e {
        ReadError::Closed | ReadError::Io => RankProblem::Lost,
        ReadError::TimedOut => RankProblem::Unresponsive { waited },
        ReadError::Garbage(reason) => RankProblem::Mismatch { reason },
    };
    Error::Group { during, ranks: vec![rank], problem }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::launch::Launcher;
    use std::io::Write;
    use std::thread;

    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port()
    }

    fn launch(rank: usize, size: usize, port: u16, job: &str) -> Launch {
        Launch {
            rank,
            size,
            local_rank: rank % 2,
            local_size: None,
            launcher: Launcher::Explicit,
            rendezvous: Some(format!("127.0.0.1:{port}")),
            job_id: job.into(),
        }
    }

    fn quick() -> BootstrapOptions {
        BootstrapOptions {
            rendezvous_timeout: Duration::from_secs(3),
            op_timeout: Duration::from_secs(3),
            hello_timeout: Duration::from_millis(300),
        }
    }

    fn spawn(
        rank: usize,
        size: usize,
        port: u16,
        f: impl FnOnce(Result<TcpBootstrap>) + Send + 'static,
    ) -> thread::JoinHandle<()> {
        thread::spawn(move || f(TcpBootstrap::connect(launch(rank, size, port, "job"), &quick())))
    }

    #[test]
    #[cfg_attr(miri, ignore = "TCP sockets")]
    fn four_ranks_allgather_and_barrier() {
        let port = free_port();
        let handles: Vec<_> = (0..4)
            .map(|r| {
                spawn(r, 4, port, move |b| {
                    let mut b = b.unwrap();
                    assert_eq!((b.rank(), b.size()), (r, 4));
                    for round in 0..3u8 {
                        let mine = vec![r as u8; r + round as usize];
                        let all = b.allgather(&mine).unwrap();
                        for (k, part) in all.iter().enumerate() {
                            assert_eq!(part, &vec![k as u8; k + round as usize]);
                        }
                        b.barrier().unwrap();
                        b.check().unwrap();
                    }
                    assert!(b.host(3).is_some());
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "TCP sockets")]
    fn a_rank_that_never_arrives_is_named_on_every_other_rank() {
        let port = free_port();
        let handles: Vec<_> = [0, 1, 3]
            .into_iter()
            .map(|r| {
                spawn(r, 4, port, |b| match b.unwrap_err() {
                    Error::Group {
                        during: "rendezvous",
                        ranks,
                        problem: RankProblem::NeverArrived { .. },
                    } => {
                        assert_eq!(ranks, [2])
                    }
                    e => panic!("{e}"),
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "TCP sockets")]
    fn strays_are_refused_and_the_group_still_forms() {
        let port = free_port();
        let root = spawn(0, 2, port, |b| {
            let mut b = b.unwrap();
            assert_eq!(b.allgather(b"0").unwrap(), [b"0".to_vec(), b"1".to_vec()]);
        });
        // Garbage, silence, another job, a wrong size, a duplicate of rank 0: all refused.
        let connect = || loop {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                break s;
            }
            thread::sleep(Duration::from_millis(10));
        };
        let mut garbage = connect();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let _silent = connect();
        let other_job = thread::spawn(move || TcpBootstrap::connect(launch(1, 2, port, "other"), &quick()));
        let wrong_size = thread::spawn(move || TcpBootstrap::connect(launch(1, 3, port, "job"), &quick()));
        for (what, h) in [("another job", other_job), ("wrong size", wrong_size)] {
            match h.join().unwrap().unwrap_err() {
                Error::Group { ranks, problem: RankProblem::Mismatch { reason }, .. } => {
                    assert_eq!(ranks, [0], "{what}");
                    assert!(!reason.is_empty());
                }
                e => panic!("{what}: {e}"),
            }
        }
        let member = spawn(1, 2, port, |b| {
            let mut b = b.unwrap();
            assert_eq!(b.allgather(b"1").unwrap(), [b"0".to_vec(), b"1".to_vec()]);
        });
        root.join().unwrap();
        member.join().unwrap();
    }

    /// A rank that dies (its connection closes without a leave) is reported as lost to the others,
    /// whether they are in an allgather or checking.
    #[test]
    #[cfg_attr(miri, ignore = "TCP sockets")]
    fn a_lost_rank_is_named_everywhere() {
        let port = free_port();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let victim = thread::spawn(move || {
            let b = TcpBootstrap::connect(launch(2, 3, port, "job"), &quick()).unwrap();
            rx.recv().unwrap();
            // Death: the socket closes, no leave frame.
            let mut b = std::mem::ManuallyDrop::new(b);
            if let Role::Member { root, .. } = &mut b.role {
                root.shutdown(std::net::Shutdown::Both).unwrap();
            }
        });
        let checker = spawn(1, 3, port, |b| {
            let mut b = b.unwrap();
            let start = Instant::now();
            loop {
                match b.check() {
                    Ok(()) => thread::sleep(Duration::from_millis(5)),
                    Err(Error::Group { ranks, problem: RankProblem::Lost, .. }) => {
                        assert_eq!(ranks, [2]);
                        break;
                    }
                    Err(e) => panic!("{e}"),
                }
                assert!(start.elapsed() < Duration::from_secs(5), "no news of the lost rank");
            }
            // Broken for good.
            assert!(matches!(b.allgather(b"x"), Err(Error::Group { problem: RankProblem::Lost, .. })));
        });
        let root = spawn(0, 3, port, move |b| {
            let mut b = b.unwrap();
            tx.send(()).unwrap();
            match b.allgather(b"0").unwrap_err() {
                Error::Group { during: "allgather", ranks, problem: RankProblem::Lost } => {
                    assert_eq!(ranks, [2])
                }
                e => panic!("{e}"),
            }
        });
        for h in [victim, checker, root] {
            h.join().unwrap();
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "TCP sockets")]
    fn a_failure_is_relayed_with_its_reason() {
        let port = free_port();
        let failing = spawn(1, 3, port, |b| {
            let mut b = b.unwrap();
            b.fail("no usable port");
        });
        let others: Vec<_> = [0, 2]
            .into_iter()
            .map(|r| {
                spawn(r, 3, port, |b| match b.unwrap().allgather(b"") {
                    Err(Error::Group { ranks, problem: RankProblem::Failed { reason }, .. }) => {
                        assert_eq!(ranks, [1]);
                        assert_eq!(reason, "no usable port");
                    }
                    r => panic!("{r:?}"),
                })
            })
            .collect();
        failing.join().unwrap();
        for h in others {
            h.join().unwrap();
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "TCP sockets")]
    fn a_silent_rank_is_unresponsive_within_the_bound() {
        let port = free_port();
        let silent = spawn(1, 2, port, |b| {
            let _b = b.unwrap();
            thread::sleep(Duration::from_secs(5));
        });
        let root = spawn(0, 2, port, |b| {
            let mut b = b.unwrap();
            let start = Instant::now();
            match b.allgather(b"") {
                Err(Error::Group { ranks, problem: RankProblem::Unresponsive { .. }, .. }) => {
                    assert_eq!(ranks, [1])
                }
                r => panic!("{r:?}"),
            }
            assert!(start.elapsed() < Duration::from_secs(4));
        });
        root.join().unwrap();
        silent.join().unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "TCP sockets")]
    fn no_rendezvous_is_a_clear_error() {
        let mut l = launch(0, 2, 1, "");
        l.rendezvous = None;
        let e = TcpBootstrap::connect(l, &quick()).unwrap_err().to_string();
        assert!(e.contains("IBVERBS_BOOTSTRAP"), "{e}");
        // A group of one needs nobody.
        let mut b = TcpBootstrap::connect(launch(0, 1, free_port(), ""), &quick()).unwrap();
        assert_eq!(b.allgather(b"x").unwrap(), [b"x".to_vec()]);
    }
}
