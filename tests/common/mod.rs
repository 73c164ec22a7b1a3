//! Shared helpers of the device tests: they run over a real verbs device (SoftRoCE in the
//! `cargo xtask test` VM) and fail, never skip, when there is none.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use ibverbs::{Completion, CompletionQueue, ConnectOptions, Context, ProtectionDomain, QpType, QueuePair};

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
}

/// Creates and connects an RC pair with `depth` work requests per queue.
pub fn rc_pair(depth: u32) -> Pair {
    pair(QpType::RC, depth, 1, 0)
}

/// Creates and connects a pair of `qp_type` (RC or UC).
pub fn pair(qp_type: QpType, depth: u32, sge: u32, inline: u32) -> Pair {
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
    Pair { ctx, pd, cq_a, cq_b, a, b }
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The netdev under port 1 of `dev` (from sysfs).
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
    panic!("no netdev found under /sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs");
}

/// `ip link set DEV STATE`.
pub fn ip_link(dev: &str, state: &str) {
    let ip = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("no `ip` command");
    let st = std::process::Command::new(ip).args(["link", "set", dev, state]).status().unwrap();
    assert!(st.success(), "ip link set {dev} {state}: {st}");
}

/// Brings the netdev back up even when the test fails, so later tests find the port active.
pub struct LinkUp(pub String);
impl Drop for LinkUp {
    fn drop(&mut self) {
        ip_link(&self.0, "up");
    }
}

/// Reports that the test device lacks `feature`, after the test checked the typed error the
/// crate gives for it: the test passes, and `cargo xtask test` names the feature in its summary
/// as unsupported by the device (never a silent pass). Written straight to the process's stdout,
/// past libtest's capture, as one line `IBVERBS-UNSUPPORTED: <device>: <feature> (<test>): <why>`.
pub fn unsupported(ctx: &Context, feature: &str, why: impl std::fmt::Display) {
    use std::io::Write;
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let line = format!("{UNSUPPORTED_PREFIX}{}: {feature} ({test}): {why}\n", ctx.name());
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

/// The line prefix of [`unsupported`] (`xtask/src/test.rs` looks for the same text).
pub const UNSUPPORTED_PREFIX: &str = "IBVERBS-UNSUPPORTED: ";
