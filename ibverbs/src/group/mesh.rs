//! [`Group`]: every rank connected to every other, one RC queue pair per peer and rail.

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use crate::attr::LinkLayer;
use crate::connect::{ConnectOptions, Endpoint};
use crate::device::Context;
use crate::error::{Error, RankProblem, Result};
use crate::group::locality;
use crate::group::rails::{self, Candidate, RailInfo, RailPolicy};
use crate::group::Bootstrap;
use crate::pd::ProtectionDomain;
use crate::queue::{CompletionQueue, QpType, QueuePair};
use crate::select::{Choice, Config, Fabric};

/// How a [`Group`] is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupOptions {
    /// Which ports, GIDs and connection settings (`NCCL_IB_HCA`, `NCCL_IB_GID_INDEX`,
    /// `NCCL_IB_TIMEOUT`, ...); `None`: [`Config::from_env`] on each rank.
    pub config: Option<Config>,
    /// Which of the selected ports each rank uses.
    pub rails: RailPolicy,
    /// Send queue depth of each queue pair. Default 64.
    pub max_send_wr: u32,
    /// Receive queue depth of each queue pair. Default 64.
    pub max_recv_wr: u32,
    /// Inline data of each queue pair, in bytes. Default 64.
    pub max_inline_data: u32,
}

impl Default for GroupOptions {
    fn default() -> GroupOptions {
        GroupOptions {
            config: None,
            rails: RailPolicy::All,
            max_send_wr: 64,
            max_recv_wr: 64,
            max_inline_data: 64,
        }
    }
}

/// One NIC (port) of a rank in a [`Group`]: its device, protection domain, completion queue, and
/// a queue pair to each peer that shares its network.
///
/// The completion queue serves every queue pair of the rail, both directions: find the peer of
/// a completion with [`peer_of`](Self::peer_of).
pub struct Rail {
    // Field order is drop order: queue pairs, then the CQ, PD and device they use (each also
    // holds what it needs alive, so any order would be sound).
    qps: Vec<Option<QueuePair>>,
    /// `(qp_num, rank)`, sorted by qp_num.
    by_qpn: Vec<(u32, usize)>,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    ctx: Context,
    info: RailInfo,
    opts: ConnectOptions,
}

impl Rail {
    /// The port, its network and NUMA node, and why this rank uses it where it does.
    pub fn info(&self) -> &RailInfo {
        &self.info
    }

    /// The device.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The protection domain of the rail's queue pairs: register the memory they use here.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The completion queue of every queue pair of the rail.
    pub fn cq(&mut self) -> &mut CompletionQueue {
        &mut self.cq
    }

    /// The queue pair to `peer`, if `peer` shares this rail's network (never for this rank).
    pub fn qp(&mut self, peer: usize) -> Option<&mut QueuePair> {
        self.qps.get_mut(peer).and_then(Option::as_mut)
    }

    /// The completion queue and the queue pairs (indexed by rank) at once, to post and poll in one
    /// loop.
    pub fn parts(&mut self) -> (&mut CompletionQueue, &mut [Option<QueuePair>]) {
        (&mut self.cq, &mut self.qps)
    }

    /// The rank whose queue pair has number `qp_num` (a completion's
    /// [`qp_num`](crate::Completion::qp_num)).
    pub fn peer_of(&self, qp_num: u32) -> Option<usize> {
        self.by_qpn.binary_search_by_key(&qp_num, |&(q, _)| q).ok().map(|i| self.by_qpn[i].1)
    }

    /// The connection options the rail's queue pairs were connected with (its port and GID
    /// index, the configuration's timers).
    pub fn connect_options(&self) -> &ConnectOptions {
        &self.opts
    }

    /// The ranks this rail reaches, ascending.
    pub fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        self.qps.iter().enumerate().filter(|(_, q)| q.is_some()).map(|(r, _)| r)
    }
}

impl fmt::Debug for Rail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rail")
            .field("info", &self.info)
            .field("peers", &self.peers().collect::<Vec<_>>())
            .finish()
    }
}

/// Ranks connected all to all over RDMA: on every rank, one RC [`QueuePair`] to every other
/// rank on each rail (NIC) the two share, created collectively with
/// [`create`](Self::create).
///
/// The group owns the [`Bootstrap`] it was made with, for the collective steps the program
/// still needs ([`allgather`](Self::allgather) of memory keys, [`barrier`](Self::barrier)) and as
/// its liveness signal ([`check`](Self::check)). What travels over the queue pairs is the
/// program's: post on them with any of the crate's posting levels.
///
/// ```no_run
/// use ibverbs::group::{Group, GroupOptions, TcpBootstrap};
/// # fn main() -> ibverbs::Result<()> {
/// let mut group = Group::create(TcpBootstrap::from_env()?, &GroupOptions::default())?;
/// println!("rank {} of {}: {}", group.rank(), group.size(), group.rails()[0].info());
/// let right = (group.rank() + 1) % group.size();
/// let rail = group.rail(0);
/// let qp = rail.qp(right).expect("a queue pair to every peer on the primary rail");
/// # let _ = qp; Ok(()) }
/// ```
pub struct Group<B: Bootstrap> {
    rails: Vec<Rail>,
    boot: B,
}

impl<B: Bootstrap> fmt::Debug for Group<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.boot.rank())
            .field("size", &self.boot.size())
            .field("rails", &self.rails)
            .finish()
    }
}

/// What a rank publishes in the group's first allgather.
struct Published {
    networks: Vec<String>,
    devices: Vec<String>,
    /// `endpoints[peer][rail]`.
    endpoints: Vec<Vec<Endpoint>>,
}

/// A rank's local setup: its rails with a queue pair (not yet connected) for every peer.
type Local = Vec<Rail>;

impl<B: Bootstrap> Group<B> {
    /// Builds the group, collectively: every rank of `boot` must call it.
    ///
    /// Each rank selects its ports ([`GroupOptions::config`]), orders them nearest first
    /// ([`RailPolicy`]), creates a protection domain, a completion queue and one RC queue pair
    /// per peer on each, publishes the endpoints in an allgather, connects the queue pairs of the
    /// rails it shares with each peer (by network), and confirms in a second allgather. When
    /// the call returns `Ok` on one rank, every queue pair of every rank is ready to send.
    ///
    /// # Errors
    /// On every rank, when any rank fails: [`Error::Group`] naming the ranks that failed and
    /// their reasons ([`RankProblem::Failed`]), that vanished ([`RankProblem::Lost`]), or that
    /// share no network with another ([`RankProblem::NoCommonRail`]). The rank that failed
    /// itself returns its own error (e.g. [`Error::NoUsablePort`], [`Error::Unsupported`] on an
    /// iWARP port). The waits are the bootstrap's, bounded.
    pub fn create(mut boot: B, opts: &GroupOptions) -> Result<Group<B>> {
        let (me, size) = (boot.rank(), boot.size());
        let local = Self::setup(&boot, opts);
        let payload = match &local {
            Ok(rails) => encode_published(rails, size),
            Err(e) => encode_failure(&e.to_string()),
        };
        let all = boot.allgather(&payload)?;
        let mut rails = local?;
        let mut failed = Vec::new();
        let mut published: Vec<Option<Published>> = Vec::with_capacity(size);
        for (r, bytes) in all.iter().enumerate() {
            match decode_published(bytes, size) {
                Ok(p) => published.push(Some(p)),
                Err(reason) => {
                    failed.push((r, reason));
                    published.push(None);
                }
            }
        }
        if !failed.is_empty() {
            return Err(group_failure(failed));
        }
        let mine = rails.iter().map(|r| r.info.network.clone()).collect::<Vec<_>>();
        let connected = Self::connect_all(&mut rails, &published, me, &mine);
        let status = match &connected {
            Ok(()) => encode_ok(),
            Err(e) => encode_failure(&e.to_string()),
        };
        let all = boot.allgather(&status)?;
        connected?;
        let failed: Vec<(usize, String)> = all
            .iter()
            .enumerate()
            .filter_map(|(r, b)| match decode_status(b) {
                Ok(()) => None,
                Err(reason) => Some((r, reason)),
            })
            .collect();
        if !failed.is_empty() {
            return Err(group_failure(failed));
        }
        Ok(Group { rails, boot })
    }

    /// This rank's rails, each with a queue pair to every peer (not connected yet).
    fn setup(boot: &B, opts: &GroupOptions) -> Result<Local> {
        let (me, size) = (boot.rank(), boot.size());
        let config = match &opts.config {
            Some(c) => c.clone(),
            None => Config::from_env()?,
        };
        let planned = planned_rails(&config, boot.local_rank(), opts.rails)?;
        let mut out = Vec::with_capacity(planned.len());
        for cand in planned {
            let choice = cand.extra;
            if choice.iwarp {
                return Err(Error::Unsupported {
                    verb: "Group::create",
                    capability:
                        "connecting queue pairs without RDMA-CM (an iWARP port; a group connects RoCE \
                                 and InfiniBand ports)",
                });
            }
            let ctx = choice.open()?;
            let pd = ctx.alloc_pd()?;
            let peers = size.saturating_sub(1) as u64;
            let need = peers * u64::from(opts.max_send_wr + opts.max_recv_wr);
            let max = u64::from(ctx.query_device()?.max_cqe());
            if need > max {
                return Err(Error::InvalidArgument {
                    verb: "Group::create",
                    reason: "the rail's completion queue would need more entries than the device has: \
                             lower max_send_wr/max_recv_wr",
                });
            }
            let cq = ctx.create_cq(need.max(1) as u32, None)?;
            let conn = choice.connect_options(&config.connect);
            let mut qps = Vec::with_capacity(size);
            for peer in 0..size {
                qps.push(if peer == me {
                    None
                } else {
                    Some(
                        pd.create_qp(&cq, QpType::RC)
                            .max_send_wr(opts.max_send_wr)
                            .max_recv_wr(opts.max_recv_wr)
                            .max_inline_data(opts.max_inline_data)
                            .build()?,
                    )
                });
            }
            out.push(Rail { qps, by_qpn: Vec::new(), cq, pd, ctx, info: cand.info, opts: conn });
        }
        Ok(out)
    }

    /// Connects each peer's queue pairs on the networks both have; drops the others.
    fn connect_all(
        rails: &mut [Rail],
        published: &[Option<Published>],
        me: usize,
        mine: &[String],
    ) -> Result<()> {
        let mut keep = vec![vec![false; published.len()]; rails.len()];
        for (peer, p) in published.iter().enumerate() {
            let Some(p) = p else { continue };
            if peer == me {
                continue;
            }
            let pairs = rails::match_rails(mine, &p.networks);
            if pairs.is_empty() {
                return Err(Error::Group {
                    during: "create",
                    ranks: vec![peer],
                    problem: RankProblem::NoCommonRail { ours: mine.join(" "), theirs: p.networks.join(" ") },
                });
            }
            for (ours, theirs) in pairs {
                let remote = p.endpoints[me][theirs];
                let rail = &mut rails[ours];
                let opts = rail.opts.clone();
                if let Some(qp) = rail.qps[peer].as_mut() {
                    qp.connect(&remote, &opts)?;
                    keep[ours][peer] = true;
                }
                let _ = &p.devices;
            }
        }
        for (r, rail) in rails.iter_mut().enumerate() {
            for (peer, qp) in rail.qps.iter_mut().enumerate() {
                if !keep[r][peer] {
                    *qp = None;
                }
            }
            rail.by_qpn = rail
                .qps
                .iter()
                .enumerate()
                .filter_map(|(p, q)| q.as_ref().map(|q| (q.qp_num(), p)))
                .collect();
            rail.by_qpn.sort_unstable();
        }
        Ok(())
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.boot.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.boot.size()
    }

    /// This rank's rank on its host.
    pub fn local_rank(&self) -> usize {
        self.boot.local_rank()
    }

    /// This rank's rails, the primary (nearest) first.
    pub fn rails(&self) -> &[Rail] {
        &self.rails
    }

    /// Rail `i` (0: the primary).
    ///
    /// # Panics
    /// If `i` is not below `rails().len()`.
    pub fn rail(&mut self, i: usize) -> &mut Rail {
        &mut self.rails[i]
    }

    /// Every rail at once.
    pub fn rails_mut(&mut self) -> &mut [Rail] {
        &mut self.rails
    }

    /// The bootstrap the group was made with.
    pub fn bootstrap(&mut self) -> &mut B {
        &mut self.boot
    }

    /// Every rank's `data`, in rank order, through the bootstrap (e.g. the
    /// [`RemoteSlice`](crate::RemoteSlice)s each rank exposes). Collective.
    ///
    /// # Errors
    /// As [`Bootstrap::allgather`].
    pub fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.boot.allgather(data)
    }

    /// Returns once every rank has called it. Collective.
    ///
    /// # Errors
    /// As [`Bootstrap::barrier`].
    pub fn barrier(&mut self) -> Result<()> {
        self.boot.barrier()
    }

    /// Whether the group is still whole, without waiting: an error names a rank that was lost
    /// or failed ([`Bootstrap::check`]). Call it in completion-waiting loops (every few
    /// milliseconds is cheap: one `poll()`), so that a rank waiting for data from a dead peer
    /// learns of it even though its own queue pairs see no error.
    ///
    /// # Errors
    /// As [`Bootstrap::check`].
    pub fn check(&mut self) -> Result<()> {
        self.boot.check()
    }

    /// Tells the other ranks this rank failed (they get [`RankProblem::Failed`] with `reason`),
    /// best effort.
    pub fn fail(&mut self, reason: &str) {
        self.boot.fail(reason)
    }

    /// A heading line for the rank, then one line per rail: which NIC this rank took, and why.
    ///
    /// ```no_run
    /// fn main() -> ibverbs::Result<()> {
    ///     // mpirun -n 4 --host a:2,b:2 -x IBVERBS_BOOTSTRAP=a:29500 ./my-job   (or srun, or torchrun)
    ///     let boot = ibverbs::group::TcpBootstrap::from_env()?; // who am I, where is rank 0
    ///     let mut group = ibverbs::group::Group::create(boot, &Default::default())?;
    ///     println!("{}", group.describe()); // rank 1 of 4 ... rail 0: rxe1:1 on 10.0.3.0/24 (primary: ...)
    ///     let right = (group.rank() + 1) % group.size();
    ///     let _qp = group.rail(0).qp(right); // an RC queue pair to the right neighbour, ready to send
    ///     Ok(())
    /// }
    /// ```
    pub fn describe(&self) -> String {
        let host = self.boot.host(self.rank()).map_or_else(String::new, |h| format!(", host {h}"));
        let mut s =
            format!("rank {} of {} (local rank {}{host}):", self.rank(), self.size(), self.local_rank());
        for (i, r) in self.rails.iter().enumerate() {
            let peers = r.peers().count();
            s.push_str(&format!("\n  rail {i}: {} -> {peers} peers", r.info));
        }
        s
    }
}

/// The rails a rank with this local rank takes on this host, in order, and why: what
/// [`Group::create`] will use, without creating anything or meeting the other ranks (the
/// locality part of a selection report: `doctor` prints it under a launcher).
///
/// # Errors
/// As [`Config::from_env`] (when `opts.config` is `None`) and the selection
/// ([`Error::NoUsablePort`], ...).
pub fn plan_rails(local_rank: usize, opts: &GroupOptions) -> Result<Vec<RailInfo>> {
    let config = match &opts.config {
        Some(c) => c.clone(),
        None => Config::from_env()?,
    };
    Ok(planned_rails(&config, local_rank, opts.rails)?.into_iter().map(|c| c.info).collect())
}

/// The selected ports of `config` as rail candidates, ordered by [`rails::plan`].
fn planned_rails(config: &Config, local_rank: usize, policy: RailPolicy) -> Result<Vec<Candidate<Choice>>> {
    let fabric = Fabric::query()?;
    let choices = config.select_in(&fabric)?;
    let root = Path::new("/");
    let cands: Vec<Candidate<Choice>> = choices
        .into_iter()
        .map(|c| {
            let port = fabric.device(&c.device).and_then(|d| d.ports.iter().find(|p| p.port == c.port));
            let netdev = port.and_then(|p| p.netdev.as_ref()).map(|n| n.name.clone());
            let network = match (c.link_layer, c.gid) {
                (LinkLayer::INFINIBAND, Some(g)) => format!("ib:{:02x?}", &g.gid.0[..8]),
                (LinkLayer::INFINIBAND, None) => "ib".to_string(),
                (_, Some(g)) => {
                    locality::network_of(g.gid.ip()).unwrap_or_else(|| format!("{}/?", g.gid.ip()))
                }
                (_, None) => "iwarp".to_string(),
            };
            Candidate {
                info: RailInfo {
                    device: c.device.clone(),
                    port: c.port,
                    gid_index: c.gid_index(),
                    network,
                    numa_node: locality::nic_numa_node(root, &c.device, netdev.as_deref()),
                    why: String::new(),
                },
                extra: c,
            }
        })
        .collect();
    let nodes = locality::numa_nodes(root);
    let rank_nodes = match locality::affinity() {
        Some(cpus) if !nodes.is_empty() => locality::nodes_of(&cpus, &nodes),
        _ => BTreeSet::new(),
    };
    Ok(rails::plan(cands, &rank_nodes, local_rank, policy))
}

fn encode_published(rails: &[Rail], size: usize) -> Vec<u8> {
    let mut b = vec![0u8, rails.len() as u8];
    let put = |b: &mut Vec<u8>, s: &str| {
        let s = &s.as_bytes()[..s.len().min(255)];
        b.push(s.len() as u8);
        b.extend_from_slice(s);
    };
    for r in rails {
        put(&mut b, &r.info.network);
        put(&mut b, &r.info.device);
    }
    for peer in 0..size {
        for r in rails {
            let ep = match &r.qps[peer] {
                Some(qp) => qp.endpoint(&r.opts).map(|e| e.encode()).unwrap_or([0; Endpoint::ENCODED_LEN]),
                None => [0; Endpoint::ENCODED_LEN],
            };
            b.extend_from_slice(&ep);
        }
    }
    b
}

fn encode_failure(text: &str) -> Vec<u8> {
    let mut b = vec![1u8];
    b.extend_from_slice(text.as_bytes());
    b
}

fn encode_ok() -> Vec<u8> {
    vec![0]
}

fn decode_status(b: &[u8]) -> std::result::Result<(), String> {
    match b.first() {
        Some(0) if b.len() == 1 => Ok(()),
        Some(1) => Err(String::from_utf8_lossy(&b[1..]).into_owned()),
        _ => Err("sent a status this rank cannot read".into()),
    }
}

fn decode_published(b: &[u8], size: usize) -> std::result::Result<Published, String> {
    if b.first() == Some(&1) {
        return Err(String::from_utf8_lossy(&b[1..]).into_owned());
    }
    let bad = || "sent endpoints this rank cannot read".to_string();
    if b.len() < 2 || b[0] != 0 {
        return Err(bad());
    }
    let n = usize::from(b[1]);
    let mut at = 2;
    let mut take = |len: usize| -> std::result::Result<&[u8], String> {
        let end = at + len;
        let s = b.get(at..end).ok_or_else(bad)?;
        at = end;
        Ok(s)
    };
    let mut networks = Vec::with_capacity(n);
    let mut devices = Vec::with_capacity(n);
    for _ in 0..n {
        let l = usize::from(take(1)?[0]);
        networks.push(String::from_utf8_lossy(take(l)?).into_owned());
        let l = usize::from(take(1)?[0]);
        devices.push(String::from_utf8_lossy(take(l)?).into_owned());
    }
    let mut endpoints = Vec::with_capacity(size);
    for _ in 0..size {
        let mut row = Vec::with_capacity(n);
        for _ in 0..n {
            let e = take(Endpoint::ENCODED_LEN)?;
            row.push(if e.iter().all(|&x| x == 0) {
                Endpoint { qpn: 0, psn: 0, lid: 0, gid: Default::default(), mtu: crate::attr::Mtu(0) }
            } else {
                Endpoint::decode(e).map_err(|e| e.to_string())?
            });
        }
        endpoints.push(row);
    }
    if take(1).is_ok() {
        return Err(bad());
    }
    Ok(Published { networks, devices, endpoints })
}

fn group_failure(failed: Vec<(usize, String)>) -> Error {
    let ranks: Vec<usize> = failed.iter().map(|(r, _)| *r).collect();
    let reason = if failed.len() == 1 {
        failed[0].1.clone()
    } else {
        failed.iter().map(|(r, t)| format!("rank {r}: {t}")).collect::<Vec<_>>().join("; ")
    };
    Error::Group { during: "create", ranks, problem: RankProblem::Failed { reason } }
}
