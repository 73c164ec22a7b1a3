//! `mcast`: rdmacm-utils' `mckey` on the safe API, wire-compatible with it in both roles. It
//! joins an IP multicast group through RDMA-CM (`rdma_join_multicast`) on a UD queue pair; as
//! the receiver (default) it waits for `-C` datagrams of `-S` bytes, as the sender (`-s`) it
//! sends them to the group.
//!
//! ```text
//! mcast -m 239.255.7.7 -b 192.0.2.1 -C 20 --peer mckey   # then: mckey -m 239.255.7.7 -b 192.0.2.1 -s -C 20
//! mcast -m 239.255.7.7 -b 192.0.2.1 -s -C 20             # with: mckey -m 239.255.7.7 -b 192.0.2.1 -C 20
//! ```
//!
//! On the wire, as `mckey`: each datagram is a Send with immediate data (the sender's QP
//! number) to the group's address handle, remote QP `0xFFFFFF` and the Q_Key of the join's
//! event (`RDMA_UDP_QKEY`); 100 bytes and 10 datagrams by default; the sender waits `--delay`
//! seconds (3, as `mckey`) after joining before sending, since datagrams are not retransmitted;
//! receives (40-byte GRH + message) are posted before the join.
//!
//! The receiver checks each datagram: a successful receive of exactly 40 + `-S` bytes, with a
//! GRH whose destination is the group (on RoCE v2 with an IPv4 group, the IPv4 header in the
//! GRH's last 20 bytes: version 4, protocol UDP, destination the group, the same source for
//! every datagram and, with `--from`, that address), immediate data equal to the sender's QP
//! number (`src_qp`), the same sender throughout; and the payload: from our sender (`--peer
//! ours`, the default) datagram `i` is `pattern(i)`, every byte; from `mckey` (`--peer mckey`),
//! which sends every datagram from one buffer that it never writes, every datagram carries the
//! same bytes as the first. Unlike the C tool, every wait is bounded (`--timeout`) and any
//! failure exits non-zero.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use ibverbs::cm::{CmEvent, CmEventKind, EventChannel, McastJoin};
use ibverbs::{Completion, CompletionQueue, Local, QpType, RecvRequest, SendRequest};

/// Joins a multicast group through RDMA-CM and sends or receives datagrams (as mckey).
#[derive(Debug, Parser)]
#[command(name = "mcast")]
struct Args {
    /// The multicast group (an IP address)
    #[arg(short = 'm')]
    group: IpAddr,
    /// The local address to join from
    #[arg(short = 'b')]
    bind: Option<IpAddr>,
    /// Send (default: receive)
    #[arg(short = 's')]
    sender: bool,
    /// Datagrams to send or receive
    #[arg(short = 'C', default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=4096))]
    count: u32,
    /// Bytes per datagram (at most the port's MTU)
    #[arg(short = 'S', default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=4096))]
    size: u32,
    /// Receiver: who sends, which decides the payload check
    #[arg(long, value_enum, default_value_t = Peer::Ours)]
    peer: Peer,
    /// Receiver: the sender's IP address, checked in each datagram's GRH (IPv4 groups)
    #[arg(long)]
    from: Option<IpAddr>,
    /// Sender: seconds to wait after joining, for the receivers to be ready
    #[arg(long, default_value_t = 3)]
    delay: u64,
    /// Bound on every wait, in seconds
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout: u64,
}

/// Who sends to the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Peer {
    /// This example: datagram `i` is `pattern(i)`.
    Ours,
    /// rdmacm-utils' `mckey`: every datagram carries the same (unwritten) buffer.
    Mckey,
}

/// The bytes of datagram `i` from our sender.
fn pattern(i: u32, len: usize) -> Vec<u8> {
    (0..len).map(|k| (k as u32).wrapping_mul(7).wrapping_add(i.wrapping_mul(13)) as u8).collect()
}

/// The global route header in front of every UD receive.
const GRH: usize = 40;

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mcast: {e}");
            ExitCode::FAILURE
        }
    }
}

fn e(what: &'static str) -> impl Fn(ibverbs::Error) -> String {
    move |err| format!("{what}: {err}")
}

fn run(a: &Args) -> Result<(), String> {
    let timeout = Duration::from_secs(a.timeout);
    let ch = EventChannel::new().map_err(e("rdma_create_event_channel"))?;
    let id = ch.create_udp_id().map_err(e("rdma_create_id"))?;
    let bind = a.bind.map(|ip| SocketAddr::new(ip, 0));
    id.resolve_addr(bind, SocketAddr::new(a.group, 0), timeout).map_err(e("rdma_resolve_addr"))?;
    wait_for(&ch, CmEventKind::ADDR_RESOLVED, timeout)?;
    let ctx = id.context().map_err(e("the id's device"))?;
    let pd = ctx.alloc_pd().map_err(e("ibv_alloc_pd"))?;
    let mut cq = ctx.create_cq(2 * a.count, None).map_err(e("ibv_create_cq"))?;
    // Created before the join: librdmacm attaches the id's queue pair when the join completes.
    let mut qp = pd
        .create_qp(&cq, QpType::UD)
        .max_send_wr(a.count)
        .max_recv_wr(a.count)
        .build_on(&id)
        .map_err(e("rdma_create_qp"))?;
    let len = a.size as usize;
    if !a.sender {
        // Every receive is posted before the join: datagrams are not retransmitted.
        for i in 0..a.count {
            let mr = pd.allocate(GRH + len).map_err(e("ibv_reg_mr"))?;
            qp.post_recv(RecvRequest::new(Local::whole(mr)).wr_id(u64::from(i)))
                .map_err(|x| format!("ibv_post_recv: {}", x.error))?;
        }
    }
    id.join_multicast(a.group).map_err(e("rdma_join_multicast"))?;
    let ev = wait_for(&ch, CmEventKind::MULTICAST_JOIN, timeout)?;
    let join = *ev.multicast().ok_or("a MULTICAST_JOIN event without its group")?;
    println!(
        "mcast: joined {} (GID {}, LID {:#x}, SL {}, QPN {:#x}, Q_Key {:#x}) on QP {:#x}",
        a.group,
        join.gid(),
        join.lid(),
        join.sl(),
        join.qp_num(),
        join.qkey(),
        qp.qp_num()
    );
    let deadline = Instant::now() + timeout;
    let mut out: [Completion; 16] = Default::default();
    if a.sender {
        std::thread::sleep(Duration::from_secs(a.delay));
        let ah = join.create_ah(&pd).map_err(e("ibv_create_ah"))?;
        let imm = qp.qp_num();
        for i in 0..a.count {
            let mut mr = pd.allocate(len).map_err(e("ibv_reg_mr"))?;
            mr.as_mut_slice().copy_from_slice(&pattern(i, len));
            let wr = SendRequest::send(Local::whole(mr))
                .imm(imm)
                .ud(&ah, join.qp_num(), join.qkey())
                .wr_id(u64::from(i));
            qp.post_send(wr).map_err(|x| format!("ibv_post_send: {}", x.error))?;
        }
        let mut done = 0;
        while done < a.count {
            for c in poll(&mut cq, &mut out, deadline, "send completions", done, a.count)? {
                if !c.is_ok() {
                    return Err(format!("send {}: {}", c.wr_id(), c.status()));
                }
                done += 1;
            }
        }
        println!("mcast: sent {} datagrams of {len} bytes to {}", a.count, a.group);
    } else {
        let mut check = Checker { a, join: &join, first: None };
        let mut got = 0;
        while got < a.count {
            for c in poll(&mut cq, &mut out, deadline, "datagrams", got, a.count)? {
                check.datagram(got, c)?;
                got += 1;
            }
        }
        let (src_qp, src_ip, payload) = check.first.unwrap_or_default();
        let from = src_ip.map_or(String::new(), |ip| format!(" {ip}"));
        println!(
            "mcast: received {} datagrams of {len} bytes from {} (sender{from} QP {src_qp:#x}), every byte checked",
            a.count, a.group
        );
        if a.peer == Peer::Mckey {
            let zeros = payload.iter().all(|&b| b == 0);
            println!(
                "mcast: mckey's payload: the same {len} bytes in every datagram{}",
                if zeros { " (all zero)" } else { "" }
            );
        }
    }
    id.leave_multicast(a.group).map_err(e("rdma_leave_multicast"))?;
    Ok(())
}

/// The receiver's checks of each datagram (see the module docs).
struct Checker<'a> {
    a: &'a Args,
    join: &'a McastJoin,
    /// The first datagram's sender QP, source address (IPv4 groups) and payload.
    first: Option<(u32, Option<IpAddr>, Vec<u8>)>,
}

impl Checker<'_> {
    fn datagram(&mut self, i: u32, c: &mut Completion) -> Result<(), String> {
        let len = self.a.size as usize;
        if !c.is_ok() {
            return Err(format!("receive {}: {}", c.wr_id(), c.status()));
        }
        if c.byte_len() as usize != GRH + len {
            return Err(format!(
                "datagram {i}: {} bytes, expected {} (GRH + {len})",
                c.byte_len(),
                GRH + len
            ));
        }
        if !c.work_completion().has_grh() {
            return Err(format!("datagram {i} without a GRH"));
        }
        let src_qp = c.src_qp();
        if c.imm_data() != Some(src_qp) {
            return Err(format!(
                "datagram {i}: immediate data {:?}, expected the sender's QP number {src_qp:#x}",
                c.imm_data()
            ));
        }
        let mr = c.take_region().ok_or("a receive without its buffer")?;
        let buf = mr.as_slice();
        let src_ip = self.grh(i, &buf[..GRH])?;
        let payload = &buf[GRH..GRH + len];
        match &self.first {
            None => self.first = Some((src_qp, src_ip, payload.to_vec())),
            Some((qp, ip, first)) => {
                if (*qp, *ip) != (src_qp, src_ip) {
                    return Err(format!(
                        "datagram {i} from QP {src_qp:#x} at {src_ip:?}, datagram 0 from QP {qp:#x} at {ip:?}"
                    ));
                }
                if self.a.peer == Peer::Mckey && payload != &first[..] {
                    return Err(format!(
                        "datagram {i}: not the bytes of datagram 0 (mckey sends one buffer)"
                    ));
                }
            }
        }
        if self.a.peer == Peer::Ours {
            let want = pattern(i, len);
            if let Some(k) = (0..len).find(|&k| payload[k] != want[k]) {
                return Err(format!(
                    "datagram {i}: byte {k} is {:#04x}, expected {:#04x}",
                    payload[k], want[k]
                ));
            }
        }
        Ok(())
    }

    /// Checks a datagram's GRH against the group; the sender's IPv4 address for an IPv4 group.
    fn grh(&self, i: u32, grh: &[u8]) -> Result<Option<IpAddr>, String> {
        match self.a.group {
            IpAddr::V4(group) => {
                // RoCE v2: the IPv4 header in the last 20 bytes of the GRH.
                let ip = &grh[20..];
                let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
                let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
                if ip[0] != 0x45 || ip[9] != 17 || dst != group {
                    return Err(format!(
                        "datagram {i}: GRH {:02x?} is not an IPv4/UDP header to {group} (version/IHL {:#04x}, protocol {}, destination {dst})",
                        ip, ip[0], ip[9]
                    ));
                }
                if let Some(from) = self.a.from {
                    if IpAddr::V4(src) != from {
                        return Err(format!("datagram {i} from {src}, expected {from}"));
                    }
                }
                Ok(Some(IpAddr::V4(src)))
            }
            IpAddr::V6(_) => {
                let dgid = Ipv6Addr::from(<[u8; 16]>::try_from(&grh[24..40]).map_err(|_| "a short GRH")?);
                if grh[0] >> 4 != 6 || dgid.octets() != self.join.gid().0 {
                    return Err(format!(
                        "datagram {i}: GRH destination {dgid}, expected the group {}",
                        self.join.gid()
                    ));
                }
                Ok(None)
            }
        }
    }
}

/// Polls `cq` once; fails past `deadline`, saying how many of `want` `what` came.
fn poll<'c>(
    cq: &mut CompletionQueue,
    out: &'c mut [Completion],
    deadline: Instant,
    what: &str,
    have: u32,
    want: u32,
) -> Result<&'c mut [Completion], String> {
    if Instant::now() > deadline {
        return Err(format!("timed out: {have} of {want} {what}"));
    }
    let got = cq.poll(out).map_err(e("ibv_poll_cq"))?;
    if got.is_empty() {
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok(got)
}

/// Waits for the next event, which must be `kind` with status 0.
fn wait_for(ch: &EventChannel, kind: CmEventKind, timeout: Duration) -> Result<CmEvent, String> {
    let ev = ch
        .get_event(Some(timeout))
        .map_err(e("rdma_get_cm_event"))?
        .ok_or(format!("no {kind:?} event within {timeout:?}"))?;
    if ev.kind() != kind || ev.status() != 0 {
        return Err(format!("expected {kind:?}, got {:?} (status {})", ev.kind(), ev.status()));
    }
    Ok(ev)
}
