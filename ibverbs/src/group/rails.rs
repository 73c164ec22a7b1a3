//! Which NICs (rails) a rank uses, in which order, and why: NCCL's rule of the NIC nearest to the
//! rank's CPUs, as plain data so that it can be tested without devices.

use std::collections::BTreeSet;
use std::fmt;

/// Which of the selected ports a rank uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RailPolicy {
    /// Every selected port, the nearest first (its *primary* rail). Peers are connected on every
    /// network (rail) both have: large transfers can stripe across them.
    #[default]
    All,
    /// Only the nearest port (ties spread over the ranks of a host by local rank), as NCCL gives
    /// each GPU its nearest NIC. Two ranks whose nearest ports are on different networks cannot
    /// connect: [`Group::create`](super::Group::create) fails naming them.
    Nearest,
}

/// One rail of a rank: the port, its network, its NUMA node, and why it is where it is in the
/// order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailInfo {
    /// The device, e.g. `mlx5_0`, `rxe1`.
    pub device: String,
    /// The port number.
    pub port: u8,
    /// The GID index (RoCE), `None` for LID addressing.
    pub gid_index: Option<u32>,
    /// The network the port is on: the IP network of its GID's address (`10.0.3.0/24`) on
    /// RoCE, the subnet prefix on InfiniBand. Ranks connect rails of the same network.
    pub network: String,
    /// The NIC's NUMA node, if the system says.
    pub numa_node: Option<u32>,
    /// Why the rail has its place (locality against this rank's CPUs).
    pub why: String,
}

impl fmt::Display for RailInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{} on {} ({})", self.device, self.port, self.network, self.why)
    }
}

/// A port before ordering: the fields of [`RailInfo`] but `why`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate<T> {
    pub(crate) info: RailInfo,
    pub(crate) extra: T,
}

/// 0: on one of the rank's nodes; 1: unknown; 2: elsewhere.
fn distance(numa: Option<u32>, rank_nodes: &BTreeSet<u32>) -> u8 {
    match numa {
        Some(n) if rank_nodes.contains(&n) => 0,
        None => 1,
        Some(_) => 2,
    }
}

fn nodes_text(nodes: &BTreeSet<u32>) -> String {
    let v: Vec<String> = nodes.iter().map(u32::to_string).collect();
    if v.is_empty() {
        "unknown".into()
    } else {
        v.join(",")
    }
}

/// Orders the candidates nearest first and keeps what `policy` keeps, filling in `why`.
///
/// Candidates at the same distance keep their order (natural device order), except the nearest
/// ones when there are several: those are rotated by `local_rank`, so that the ranks of a host
/// spread over equally near NICs instead of all taking the first.
pub(crate) fn plan<T>(
    mut cands: Vec<Candidate<T>>,
    rank_nodes: &BTreeSet<u32>,
    local_rank: usize,
    policy: RailPolicy,
) -> Vec<Candidate<T>> {
    cands.sort_by_key(|c| distance(c.info.numa_node, rank_nodes)); // stable
    let Some(best) = cands.first().map(|c| distance(c.info.numa_node, rank_nodes)) else { return cands };
    let tied = cands.iter().take_while(|c| distance(c.info.numa_node, rank_nodes) == best).count();
    if tied > 1 {
        cands[..tied].rotate_left(local_rank % tied);
    }
    let ours = nodes_text(rank_nodes);
    for (i, c) in cands.iter_mut().enumerate() {
        let d = distance(c.info.numa_node, rank_nodes);
        let place = match c.info.numa_node {
            Some(n) if d == 0 => format!("NUMA node {n}, where this rank's CPUs are (node {ours})"),
            Some(n) => format!("NUMA node {n}, away from this rank's CPUs (node {ours})"),
            None => "NUMA node unknown".to_string(),
        };
        c.info.why = if i == 0 && tied > 1 {
            format!(
                "primary: {place}; {tied} NICs as near, local rank {local_rank} takes #{}",
                local_rank % tied
            )
        } else if i == 0 {
            format!("primary: {place}")
        } else {
            place
        };
    }
    if policy == RailPolicy::Nearest {
        cands.truncate(1);
    }
    cands
}

/// Pairs the rails of two ranks that are on the same network: the k-th rail of a network on one
/// side with the k-th of that network on the other. Returns (ours, theirs) index pairs, in our
/// order.
pub(crate) fn match_rails(ours: &[String], theirs: &[String]) -> Vec<(usize, usize)> {
    let mut used = vec![false; theirs.len()];
    let mut out = Vec::new();
    for (i, net) in ours.iter().enumerate() {
        if let Some(j) = (0..theirs.len()).find(|&j| !used[j] && &theirs[j] == net) {
            used[j] = true;
            out.push((i, j));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(device: &str, net: &str, numa: Option<u32>) -> Candidate<()> {
        Candidate {
            info: RailInfo {
                device: device.into(),
                port: 1,
                gid_index: Some(1),
                network: net.into(),
                numa_node: numa,
                why: String::new(),
            },
            extra: (),
        }
    }

    fn names(c: &[Candidate<()>]) -> Vec<&str> {
        c.iter().map(|c| c.info.device.as_str()).collect()
    }

    #[test]
    fn the_nic_of_the_ranks_node_comes_first() {
        let two = || vec![cand("rxe0", "10.0.2.0/24", Some(0)), cand("rxe1", "10.0.3.0/24", Some(1))];
        let node1: BTreeSet<u32> = [1].into_iter().collect();
        let p = plan(two(), &node1, 0, RailPolicy::All);
        assert_eq!(names(&p), ["rxe1", "rxe0"]);
        assert!(p[0].info.why.starts_with("primary: NUMA node 1, where"), "{}", p[0].info.why);
        assert!(p[1].info.why.contains("away from"), "{}", p[1].info.why);
        let p = plan(two(), &[0].into_iter().collect(), 1, RailPolicy::Nearest);
        assert_eq!(names(&p), ["rxe0"]);
    }

    #[test]
    fn equally_near_nics_are_spread_by_local_rank() {
        let both: BTreeSet<u32> = [0, 1].into_iter().collect();
        let two = || vec![cand("rxe0", "a", Some(0)), cand("rxe1", "b", Some(1))];
        assert_eq!(names(&plan(two(), &both, 0, RailPolicy::All)), ["rxe0", "rxe1"]);
        let p = plan(two(), &both, 1, RailPolicy::All);
        assert_eq!(names(&p), ["rxe1", "rxe0"]);
        assert!(p[0].info.why.contains("2 NICs as near, local rank 1 takes #1"), "{}", p[0].info.why);
        // Unknown NUMA nodes (a VM without NUMA): the same spreading.
        let unknown = || vec![cand("a0", "n", None), cand("a1", "n", None), cand("a2", "n", None)];
        assert_eq!(names(&plan(unknown(), &BTreeSet::new(), 4, RailPolicy::Nearest)), ["a1"]);
        // A known-near NIC beats unknown ones, which beat far ones.
        let mixed = vec![cand("far", "n", Some(1)), cand("unknown", "n", None), cand("near", "n", Some(0))];
        assert_eq!(
            names(&plan(mixed, &[0].into_iter().collect(), 3, RailPolicy::All)),
            ["near", "unknown", "far"]
        );
        assert!(plan(Vec::<Candidate<()>>::new(), &both, 0, RailPolicy::All).is_empty());
    }

    #[test]
    fn rails_pair_by_network() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(match_rails(&s(&["b", "a"]), &s(&["a", "b"])), [(0, 1), (1, 0)]);
        assert_eq!(match_rails(&s(&["a", "a"]), &s(&["a", "c", "a"])), [(0, 0), (1, 2)]);
        assert!(match_rails(&s(&["a"]), &s(&["b"])).is_empty());
    }
}
