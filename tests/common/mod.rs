//! Shared helpers of the device tests: they run over a real verbs device (SoftRoCE in the
//! `cargo xtask test` VM) and fail, never skip, when there is none.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use ibverbs::cm::{self, CmId, ConnParam, Listener};
use ibverbs::{
    Completion, CompletionQueue, ConnectOptions, Context, Endpoint, Error, Gid, Mtu, ProtectionDomain,
    QpCaps, QpState, QpType, QueuePair, QueuePairBuilder, SendRequest, SharedReceiveQueue,
    IWARP_MANUAL_CONNECT, IWARP_RESET,
};

/// The test device's name: `IBVERBS_TEST_DEVICE` (set by the harness), `rxe0` when unset. For
/// the tests that only start programs on it (they open no device themselves).
pub fn test_device_name() -> String {
    std::env::var("IBVERBS_TEST_DEVICE").unwrap_or_else(|_| "rxe0".into())
}

/// Opens the test device: `IBVERBS_TEST_DEVICE` (set by the harness) or the first one.
pub fn context() -> Context {
    let name = std::env::var("IBVERBS_TEST_DEVICE").ok();
    Context::open(name.as_deref()).unwrap_or_else(|e| {
        panic!("device tests need an RDMA device ({e}); run them with `cargo xtask test`")
    })
}

/// The factor by which the harness asks device tests to stretch their waits
/// (`IBVERBS_TEST_TIME_SCALE`: set under valgrind and ThreadSanitizer, which slow everything
/// down); 1 when unset.
/// Read once: reading the environment allocates, and `device_alloc` counts allocations.
pub fn time_scale() -> u32 {
    static SCALE: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *SCALE.get_or_init(|| {
        std::env::var("IBVERBS_TEST_TIME_SCALE")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&s| s > 0)
            .unwrap_or(1)
    })
}

/// `d` stretched by [`time_scale`].
pub fn scaled(d: Duration) -> Duration {
    d * time_scale()
}

/// Connection options for loopback tests: a finite retry count (rxe treats 7 as forever).
pub fn opts() -> ConnectOptions {
    ConnectOptions { retry_cnt: 6, timeout: 14, ..ConnectOptions::default() }
}

/// Polls `cq` until one completion arrives, or panics after 10 s.
pub fn poll_one(cq: &mut CompletionQueue) -> Completion {
    poll_n(cq, 1).pop().unwrap()
}

/// Polls `cq` until `n` completions arrived, or panics after 10 s.
pub fn poll_n(cq: &mut CompletionQueue, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + scaled(Duration::from_secs(10));
    let mut out: Vec<Completion> = Vec::new();
    let mut buf: Vec<Completion> = (0..16).map(|_| Completion::default()).collect();
    while out.len() < n {
        let want = (n - out.len()).min(buf.len());
        let got = cq.poll(&mut buf[..want]).expect("ibv_poll_cq");
        let k = got.len();
        for c in got.iter_mut() {
            out.push(std::mem::take(c));
        }
        if k == 0 {
            assert!(Instant::now() < deadline, "timed out waiting for completions: {} of {n}", out.len());
            std::thread::yield_now();
        }
    }
    out
}

/// Asserts that no completion arrives on `cq` within `wait`.
pub fn assert_quiet(cq: &mut CompletionQueue, wait: Duration) {
    let deadline = Instant::now() + wait;
    let mut buf = [Completion::default()];
    while Instant::now() < deadline {
        let got = cq.poll(&mut buf).expect("ibv_poll_cq");
        assert!(got.is_empty(), "unexpected completion {:?}", got[0]);
    }
}

/// Two connected queue pairs of one type on the test device, each with its own CQ.
pub struct Pair {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq_a: CompletionQueue,
    pub cq_b: CompletionQueue,
    pub a: QueuePair,
    pub b: QueuePair,
    /// On iWARP, the RDMA-CM ids of `a` and `b`: they hold the connection (dropping one
    /// disconnects it), so a test that takes the pair apart keeps them (`cm: _cm`).
    pub cm: Option<[CmId; 2]>,
}

/// Creates and connects an RC pair with `depth` work requests per queue.
pub fn rc_pair(depth: u32) -> Pair {
    pair(QpType::RC, depth, 1, 0)
}

/// The IPv4 address of the test device's netdev, for RDMA-CM (`IBVERBS_TEST_IP`, set by the
/// harness; 192.0.2.1, the VM's `dummy0`, when unset).
pub fn test_ip() -> std::net::IpAddr {
    std::env::var("IBVERBS_TEST_IP").ok().and_then(|v| v.parse().ok()).unwrap_or([192, 0, 2, 1].into())
}

/// Whether the test device is iWARP (siw): its queue pairs connect only through RDMA-CM, RC only.
pub fn is_iwarp() -> bool {
    static IWARP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *IWARP.get_or_init(|| context().is_iwarp())
}

/// For a test that needs what an iWARP device cannot do by its nature (`feature`: connecting queue
/// pairs by hand, UC or UD queue pairs, reusing a QP after a reset...): on an iWARP device, checks the
/// typed error the crate gives for a hand-made connection, reports the test as unsupported (see
/// [`unsupported`]) and returns `true`; the test then returns. `false` on any other device.
pub fn iwarp_lacks(feature: &str, why: &str) -> bool {
    if !is_iwarp() {
        return false;
    }
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4, None).unwrap();
    let mut qp = pd.create_qp(&cq, QpType::RC).max_send_wr(1).max_recv_wr(1).build().unwrap();
    let o = opts();
    let e = qp.endpoint(&o).unwrap_err();
    assert!(
        matches!(e, Error::Unsupported { capability, .. } if capability == IWARP_MANUAL_CONNECT),
        "QueuePair::endpoint on iWARP: {e:?}"
    );
    let peer = Endpoint { qpn: qp.qp_num(), psn: 0, lid: 0, gid: Gid::default(), mtu: Mtu::MTU_1024 };
    let e = qp.connect(&peer, &o).unwrap_err();
    assert!(
        matches!(e, Error::Unsupported { capability, .. } if capability == IWARP_MANUAL_CONNECT),
        "QueuePair::connect on iWARP: {e:?}"
    );
    assert_eq!(qp.state(), QpState::RESET, "a refused connect changes nothing");
    unsupported(&ctx, feature, format!("iWARP: {why}"));
    true
}

/// For a test of UC or UD queue pairs (`qp_type`): on an iWARP device (RC only), checks that
/// creating one gives the typed error (`Error::Unsupported`, capability "UC queue pairs" or "UD
/// queue pairs"), then does what [`iwarp_lacks`] does; `false` on any other device.
pub fn iwarp_lacks_qp_type(qp_type: QpType) -> bool {
    if !is_iwarp() {
        return false;
    }
    let (feature, capability) = match qp_type {
        QpType::UC => ("UC", "UC queue pairs"),
        QpType::UD => ("UD", "UD queue pairs"),
        other => panic!("iwarp_lacks_qp_type is for UC and UD, not {other:?}"),
    };
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4, None).unwrap();
    let e = pd.create_qp(&cq, qp_type).max_send_wr(1).max_recv_wr(1).build().unwrap_err();
    assert!(
        matches!(e, Error::Unsupported { verb: "ibv_create_qp", capability: c } if c == capability),
        "a {feature} queue pair on iWARP: {e:?}"
    );
    iwarp_lacks(feature, "iWARP has RC queue pairs only (creating one gives Error::Unsupported)")
}

/// For a test of [`QueuePair::reset`] on `qp` (a queue pair made by hand, not on an RDMA-CM id):
/// on an iWARP device, checks that the crate refuses the reset with its typed error (siw accepts
/// RESET and ignores it), reports the test as unsupported and returns `true`; the test then
/// returns. `false` on any other device, where nothing is done.
pub fn iwarp_refuses_reset(ctx: &Context, qp: &mut QueuePair) -> bool {
    if !is_iwarp() {
        return false;
    }
    let e = qp.reset().unwrap_err();
    assert!(
        matches!(e, Error::Unsupported { capability: IWARP_RESET, .. }),
        "QueuePair::reset on iWARP: {e:?}"
    );
    unsupported(ctx, "resetting a queue pair", "iWARP: siw accepts RESET and ignores it");
    true
}

/// Creates and connects a pair of `qp_type` (RC or UC). On an iWARP device (RC only) the pair
/// connects through RDMA-CM (a listener on [`test_ip`] and a connect to it), both queue pairs on one
/// protection domain of the RDMA-CM context of the device.
pub fn pair(qp_type: QpType, depth: u32, sge: u32, inline: u32) -> Pair {
    if is_iwarp() {
        assert_eq!(qp_type, QpType::RC, "iWARP has RC only: check common::iwarp_lacks first");
        return cm_pair(QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: sge,
            max_recv_sge: sge,
            max_inline_data: inline,
        });
    }
    let ctx = context();
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = ctx.create_cq(2 * depth, None).unwrap();
    let cq_b = ctx.create_cq(2 * depth, None).unwrap();
    let build = |cq| {
        pd.create_qp(cq, qp_type)
            .max_send_wr(depth)
            .max_recv_wr(depth)
            .max_send_sge(sge)
            .max_recv_sge(sge)
            .max_inline_data(inline)
            .build()
            .unwrap()
    };
    let mut a = build(&cq_a);
    let mut b = build(&cq_b);
    let o = opts();
    let ea = a.endpoint(&o).unwrap();
    let eb = b.endpoint(&o).unwrap();
    a.connect(&eb, &o).unwrap();
    b.connect(&ea, &o).unwrap();
    Pair { ctx, pd, cq_a, cq_b, a, b, cm: None }
}

/// The context to build connected queue pairs on: on iWARP the RDMA-CM context of the device
/// that owns [`test_ip`] (queue pairs on RDMA-CM ids need their PD and CQs from it), elsewhere
/// [`context`].
pub fn pair_context() -> Context {
    if is_iwarp() {
        cm::device_context((test_ip(), 0).into(), scaled(Duration::from_secs(10)))
            .expect("rdma_resolve_addr of the test address")
    } else {
        context()
    }
}

/// An RC pair connected through RDMA-CM: `b` accepts on an ephemeral port of [`test_ip`], `a`
/// connects to it. Reads and atomics outstanding: as many as the device allows (up to 16), as
/// [`QueuePair::connect`] does.
pub fn cm_pair(caps: QpCaps) -> Pair {
    let ctx = pair_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = ctx.create_cq(2 * caps.max_send_wr.max(caps.max_recv_wr), None).unwrap();
    let cq_b = ctx.create_cq(2 * caps.max_send_wr.max(caps.max_recv_wr), None).unwrap();
    let (a, b, ids) = cm_connect_built(
        &pd,
        || pd.create_qp(&cq_a, QpType::RC).caps(caps),
        || pd.create_qp(&cq_b, QpType::RC).caps(caps),
    );
    Pair { ctx, pd, cq_a, cq_b, a, b, cm: Some(ids) }
}

/// Two RC queue pairs of `pd` (a on `cq_a`, b on `cq_b`) connected to each other: by hand
/// ([`QueuePair::connect`] with [`opts`]), or on iWARP through RDMA-CM (then `pd` must come from
/// [`pair_context`], and the ids must be kept as long as the queue pairs are used).
pub fn connect_qps(
    pd: &ProtectionDomain,
    cq_a: &CompletionQueue,
    cq_b: &CompletionQueue,
    caps: QpCaps,
) -> (QueuePair, QueuePair, Option<[CmId; 2]>) {
    connect_built(
        pd,
        || pd.create_qp(cq_a, QpType::RC).caps(caps),
        || pd.create_qp(cq_b, QpType::RC).caps(caps),
    )
}

/// [`connect_qps`] of the RC queue pairs the builders `a` and `b` describe (e.g. with a
/// receive CQ of its own): built and connected by hand, or on iWARP built on RDMA-CM ids
/// (`pd` from [`pair_context`]) and connected through them (`a` is then called again for each
/// new connecting id, see [`cm_connect_built`]).
pub fn connect_built<'q>(
    pd: &ProtectionDomain,
    a: impl Fn() -> QueuePairBuilder<'q>,
    b: impl FnOnce() -> QueuePairBuilder<'q> + Send,
) -> (QueuePair, QueuePair, Option<[CmId; 2]>) {
    if is_iwarp() {
        let (a, b, ids) = cm_connect_built(pd, a, b);
        return (a, b, Some(ids));
    }
    let mut a = a().build().unwrap();
    let mut b = b().build().unwrap();
    let o = opts();
    let (ea, eb) = (a.endpoint(&o).unwrap(), b.endpoint(&o).unwrap());
    a.connect(&eb, &o).unwrap();
    b.connect(&ea, &o).unwrap();
    (a, b, None)
}

/// [`connect_built`] through RDMA-CM: `b` accepts on an ephemeral port of [`test_ip`], `a`
/// connects to it; reads and atomics outstanding: as many as the device allows (up to 16), as
/// [`QueuePair::connect`] does.
fn cm_connect_built<'q>(
    pd: &ProtectionDomain,
    a: impl Fn() -> QueuePairBuilder<'q>,
    b: impl FnOnce() -> QueuePairBuilder<'q> + Send,
) -> (QueuePair, QueuePair, [CmId; 2]) {
    let wait = scaled(Duration::from_secs(10));
    let listener = Listener::bind((test_ip(), 0).into()).expect("rdma_listen on the test address");
    let addr = listener.local_addr().unwrap();
    let dev = pd.context().query_device().unwrap();
    let rd = u8::try_from(dev.max_qp_rd_atom().min(dev.max_qp_init_rd_atom()).clamp(1, 16)).unwrap_or(16);
    let param = ConnParam { responder_resources: rd, initiator_depth: rd, ..ConnParam::default() };
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let (id, _) = listener.request(wait).expect("a connection request");
            let mut qp = b().build_on(&id).expect("the accepting queue pair");
            cm::accept_request(&id, &mut qp, &param, wait).expect("rdma_accept");
            (id, qp)
        });
        // Two bounds of `wait`, as the resolve and the connection each had before
        // cm::connect_with; it also tries another id when siw's rdma_connect meets a port a
        // native TCP socket holds (the listener still waits for its request).
        let (id_a, qa) = cm::connect_with(addr, &param, 2 * wait, |id| a().build_on(id))
            .expect("rdma_resolve_addr/route, the connecting queue pair and rdma_connect");
        let (id_b, qb) = server.join().unwrap();
        (qa, qb, [id_a, id_b])
    })
}

/// Waits (up to 10 s, scaled) for `id`'s `DISCONNECTED` event, skipping other events; panics
/// when none comes.
pub fn wait_disconnected(id: &CmId) {
    let deadline = Instant::now() + scaled(Duration::from_secs(10));
    let ch = id.channel();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no DISCONNECTED event within 10 s");
        if let Some(ev) = ch.get_event(Some(left)).unwrap() {
            if ev.is_for(id) && ev.kind() == ibverbs::cm::CmEventKind::DISCONNECTED {
                return;
            }
        }
    }
}

/// Whether the device does atomics (`atomic_cap` is not `IBV_ATOMIC_NONE`); when it does not,
/// reports `test`'s need of them (see [`unsupported`]) and returns `false`.
pub fn has_atomics(ctx: &Context) -> bool {
    let cap = ctx.query_device().unwrap().atomic_cap();
    if cap == ibverbs::ffi::ibv_atomic_cap::IBV_ATOMIC_NONE {
        unsupported(ctx, "atomics", "atomic_cap is IBV_ATOMIC_NONE");
        return false;
    }
    true
}

/// Whether the device carries immediate data (send/RDMA Write with immediate); iWARP (RFC 5040)
/// has none and siw refuses the opcodes. When it does not, reports it and returns `false`.
pub fn has_immediate(ctx: &Context) -> bool {
    if ctx.is_iwarp() {
        unsupported(ctx, "immediate data", "iWARP transport: no send/RDMA Write with immediate");
        return false;
    }
    true
}

/// `wr` with immediate data `imm` when there is one (`SendRequest::imm`), as it is otherwise:
/// for tests that send immediate data only where the transport has it ([`has_immediate`]).
pub fn maybe_imm(wr: SendRequest<'_>, imm: Option<u32>) -> SendRequest<'_> {
    match imm {
        Some(imm) => wr.imm(imm),
        None => wr,
    }
}

/// A deterministic byte pattern: byte `i` is `(i as u8) * 31 + seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    // Its period of 256 bytes, copied over: a test build is unoptimised, and computing each of
    // the 4 MiB of a large test's pattern took tens of seconds under valgrind.
    let period: Vec<u8> = (0..=255u8).map(|i| i.wrapping_mul(31).wrapping_add(seed)).collect();
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let n = (len - v.len()).min(period.len());
        v.extend_from_slice(&period[..n]);
    }
    v
}

/// The netdev under port 1 of `dev`: from sysfs (RoCE GIDs name it), or on iWARP, whose GIDs
/// do not, the interface that holds [`test_ip`] (`ip -o addr`; the harness puts siw0 over it).
pub fn netdev(dev: &str) -> String {
    for idx in 0..4 {
        let path = format!("/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/{idx}");
        if let Ok(s) = std::fs::read_to_string(&path) {
            let s = s.trim();
            if !s.is_empty() {
                return s.to_string();
            }
        }
    }
    if is_iwarp() {
        let out = std::process::Command::new(ip_command()).args(["-o", "addr", "show"]).output().unwrap();
        let ip = test_ip().to_string();
        // Lines read `N: NAME inet ADDR/PREFIX ...`.
        let text = String::from_utf8_lossy(&out.stdout);
        let found = text.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 3 && f[3].split('/').next() == Some(ip.as_str())).then(|| f[1].to_string())
        });
        return found.unwrap_or_else(|| panic!("no interface holds {ip} (the netdev of {dev}): {text}"));
    }
    panic!("no netdev found under /sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs");
}

/// The `ip` command's path.
fn ip_command() -> &'static str {
    ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("no `ip` command")
}

/// `ip link set DEV STATE`.
pub fn ip_link(dev: &str, state: &str) {
    let st = std::process::Command::new(ip_command()).args(["link", "set", dev, state]).status().unwrap();
    assert!(st.success(), "ip link set {dev} {state}: {st}");
}

/// Brings the netdev back up even when the test fails, so later tests find the port active.
pub struct LinkUp(pub String);
impl Drop for LinkUp {
    fn drop(&mut self) {
        ip_link(&self.0, "up");
    }
}

/// Reports that the test device lacks `feature`: the test has checked the typed error the crate
/// gives for it and passes, and `cargo xtask test` lists the line in its summary under
/// "unsupported by the device" (never a silent pass). Written straight to the process's stdout,
/// past libtest's capture, as `IBVERBS-UNSUPPORTED: <device> <feature> (<test>): <why>`.
pub fn unsupported(ctx: &Context, feature: &str, why: impl std::fmt::Display) {
    unsupported_on(ctx.name(), feature, why);
}

/// [`unsupported`] naming the device by name, for the tests that open no device themselves.
pub fn unsupported_on(device: &str, feature: &str, why: impl std::fmt::Display) {
    use std::io::Write;
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let line = format!("IBVERBS-UNSUPPORTED: {device} {feature} ({test}): {why}\n");
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

/// A registered region whose memory is freed by a callback that counts its calls and panics
/// when asked to.
pub fn region_freed_by(
    pd: &ProtectionDomain,
    calls: std::sync::Arc<std::sync::atomic::AtomicU32>,
    panics: bool,
) -> ibverbs::MemoryRegion {
    let mem: &'static mut [u8] = Box::leak(vec![7u8; 64].into_boxed_slice());
    let (ptr, len) = (std::ptr::NonNull::new(mem.as_mut_ptr()).unwrap(), mem.len());
    let free = move |p: *mut u8, n: usize| {
        // SAFETY: p/n are the leaked box's parts, freed once here.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)) });
        calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if panics {
            panic!("free callback panicked (allowed by its contract)");
        }
    };
    // SAFETY: initialised (from `vec!`), ours alone from now on, and `free` releases it once.
    let buf = unsafe { ibverbs::OwnedBuffer::from_raw_parts(ptr, len, Some(Box::new(free))) };
    pd.register(buf, ibverbs::AccessFlags::LOCAL_WRITE).unwrap()
}

/// Builds an RC queue pair whose receives come from `srq`, and a plain sender connected to it
/// (on iWARP through RDMA-CM: `pd` from [`pair_context`], and the ids returned must be kept as
/// long as the queue pairs are used).
pub fn rc_on_srq(
    pd: &ProtectionDomain,
    srq: &SharedReceiveQueue,
    recv_cq: &CompletionQueue,
    send_cq: &CompletionQueue,
) -> (QueuePair, QueuePair, Option<[CmId; 2]>) {
    let (r, s, cm) = connect_built(
        pd,
        || pd.create_qp(recv_cq, QpType::RC).max_send_wr(4).srq(srq),
        || pd.create_qp(send_cq, QpType::RC).max_send_wr(16).max_recv_wr(1),
    );
    assert!(r.uses_srq());
    assert_eq!(r.recv_capacity(), 0, "its receives go to the SRQ");
    (r, s, cm)
}
