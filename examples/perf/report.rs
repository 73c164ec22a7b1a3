//! perftest's result tables: the same columns, units and number formats (perftest 6.x as shipped
//! by Debian 12), so scripts that read perftest output read ours.
//!
//! Bandwidth is in MB/sec of 2^20 bytes (perftest's default `--report_gbits` off), message rate in
//! millions of messages per second; latencies are in microseconds, half the measured round trip.

use super::clock::Clock;

/// perftest's `RESULT_LINE`.
pub const RESULT_LINE: &str =
    "---------------------------------------------------------------------------------------";

/// The header of a bandwidth table.
pub const BW_HEADER: &str =
    " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";

/// The header of a latency table (with perftest's trailing space).
pub const LAT_HEADER: &str =
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
                              t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";

const MB: f64 = 1048576.0;

/// One row of a bandwidth table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwReport {
    /// Message size in bytes.
    pub size: u64,
    /// Messages, over all queue pairs.
    pub iters: u64,
    /// Best bandwidth over any run of consecutive messages (0 where not measured, as perftest's
    /// receive side).
    pub peak: f64,
    /// Bandwidth from the first post to the last completion.
    pub avg: f64,
    /// Messages per second, in millions.
    pub msg_rate: f64,
}

impl BwReport {
    /// Bytes of [`encode`](Self::encode)'s output.
    pub const ENCODED_LEN: usize = 40;

    /// The perftest row (`REPORT_FMT`).
    pub fn row(&self) -> String {
        format!(
            " {:<7}    {:<10}       {:<7.2}            {:<7.2}\t\t   {:<7.6}",
            self.size, self.iters, self.peak, self.avg, self.msg_rate
        )
    }

    /// For the out-of-band channel.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::ENCODED_LEN);
        v.extend_from_slice(&self.size.to_be_bytes());
        v.extend_from_slice(&self.iters.to_be_bytes());
        v.extend_from_slice(&self.peak.to_be_bytes());
        v.extend_from_slice(&self.avg.to_be_bytes());
        v.extend_from_slice(&self.msg_rate.to_be_bytes());
        v
    }

    /// Decodes [`encode`](Self::encode)'s output: every figure finite and not negative.
    pub fn decode(b: &[u8]) -> Result<BwReport, String> {
        let b: &[u8; Self::ENCODED_LEN] =
            b.try_into().map_err(|_| format!("a report is {} bytes, got {}", Self::ENCODED_LEN, b.len()))?;
        let mut w = [0u64; 5];
        for (w, chunk) in w.iter_mut().zip(b.chunks_exact(8)) {
            *w = u64::from_be_bytes(chunk.try_into().unwrap_or_default());
        }
        let r = BwReport {
            size: w[0],
            iters: w[1],
            peak: f64::from_bits(w[2]),
            avg: f64::from_bits(w[3]),
            msg_rate: f64::from_bits(w[4]),
        };
        for (what, x) in
            [("peak bandwidth", r.peak), ("average bandwidth", r.avg), ("message rate", r.msg_rate)]
        {
            if !(x.is_finite() && x >= 0.0) {
                return Err(format!("a report with {what} {x}"));
            }
        }
        Ok(r)
    }
}

/// The bandwidth of a sender, as perftest's `print_report_bw`: `tposted[i]` is when message `i` was
/// posted, `tcompleted[j]` when the completion covering message `j` was polled (a completion of a
/// signaled request covers the unsignaled ones before it), in counter ticks. The peak is 0
/// without `peak` (perftest's `-N`).
pub fn bw_report(
    size: u64,
    tposted: &[u64],
    tcompleted: &[u64],
    post_list: usize,
    cq_mod: usize,
    peak: bool,
    clock: &Clock,
) -> BwReport {
    let n = tposted.len().min(tcompleted.len());
    if n == 0 {
        return BwReport { size, iters: 0, peak: 0.0, avg: 0.0, msg_rate: 0.0 };
    }
    let tps = clock.ticks_per_sec();
    // Peak: the fastest window of consecutive messages, posted i..=j. perftest tries every start i
    // (every post_list-th) against every completion j (every cq_mod-th, and the last); for very long
    // runs we space the starts out to keep this quadratic search in the tens of millions of steps.
    // Without `peak`, no start is tried.
    let step_j = cq_mod.max(1);
    let pairs = (n / post_list.max(1)) as f64 * (n / step_j) as f64;
    let stride = post_list.max(1) * ((pairs / 5e7).ceil() as usize).max(1);
    let mut best = f64::INFINITY;
    let mut i = if peak { 0 } else { n };
    while i < n {
        let first_j = (i + 1).div_ceil(step_j) * step_j - 1;
        let mut j = first_j;
        while j < n {
            let t = tcompleted[j].saturating_sub(tposted[i]) as f64 / (j - i + 1) as f64;
            best = best.min(t);
            j += step_j;
        }
        if n % step_j != 0 {
            let j = n - 1;
            best = best.min(tcompleted[j].saturating_sub(tposted[i]) as f64 / (j - i + 1) as f64);
        }
        i += stride;
    }
    let peak = if best.is_finite() && best > 0.0 { size as f64 * tps / best / MB } else { 0.0 };
    let secs = tcompleted[n - 1].saturating_sub(tposted[0]) as f64 / tps;
    let (avg, msg_rate) =
        if secs > 0.0 { (size as f64 * n as f64 / secs / MB, n as f64 / secs / 1e6) } else { (0.0, 0.0) };
    BwReport { size, iters: n as u64, peak, avg, msg_rate }
}

/// The bandwidth of a receiver, as perftest's server side of `ib_send_bw`: from the first receive
/// completion to the last; no peak (printed as 0.00, like perftest).
pub fn rx_bw_report(size: u64, n: u64, first: u64, last: u64, clock: &Clock) -> BwReport {
    let secs = clock.secs(last.saturating_sub(first));
    let (avg, msg_rate) =
        if secs > 0.0 { (size as f64 * n as f64 / secs / MB, n as f64 / secs / 1e6) } else { (0.0, 0.0) };
    BwReport { size, iters: n, peak: 0.0, avg, msg_rate }
}

/// One row of a latency table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatReport {
    /// Message size in bytes.
    pub size: u64,
    /// Round trips.
    pub iters: u64,
    /// Smallest one-way latency, µs.
    pub min: f64,
    /// Largest (perftest drops the two largest samples first), µs.
    pub max: f64,
    /// Median, µs.
    pub typical: f64,
    /// Mean, µs.
    pub avg: f64,
    /// Standard deviation, µs.
    pub stdev: f64,
    /// 99th percentile, µs.
    pub p99: f64,
    /// 99.9th percentile, µs.
    pub p999: f64,
}

impl LatReport {
    /// The perftest row (`REPORT_FMT_LAT`).
    pub fn row(&self) -> String {
        format!(
            " {:<7} {}          {:<7.2}        {:<7.2}      {:<7.2}  \t       {:<7.2}     \t{:<7.2}\t\t{:<7.2} \t\t{:<7.2}",
            self.size, self.iters, self.min, self.max, self.typical, self.avg, self.stdev, self.p99, self.p999
        )
    }
}

/// Latency statistics as perftest's `print_report_lat`: the samples are the times between
/// consecutive posts (`tposted`, one round trip each), halved; the two largest are dropped.
/// Needs at least 4 posts.
pub fn lat_report(size: u64, tposted: &[u64], clock: &Clock) -> LatReport {
    let iters = tposted.len() as u64;
    let mut delta: Vec<u64> = tposted.windows(2).map(|w| w[1].saturating_sub(w[0])).collect();
    delta.sort_unstable();
    let to_us = |t: u64| t as f64 / clock.ticks_per_sec() * 1e6 / 2.0;
    if delta.len() < 3 {
        let v = delta.first().map_or(0.0, |&d| to_us(d));
        return LatReport { size, iters, min: v, max: v, typical: v, avg: v, stdev: 0.0, p99: v, p999: v };
    }
    let m = delta.len() - 2; // LAT_MEASURE_TAIL
    let median = if (m - 1) % 2 == 1 {
        (to_us(delta[m / 2]) + to_us(delta[m / 2 - 1])) / 2.0
    } else {
        to_us(delta[m / 2])
    };
    let avg = delta[..m].iter().map(|&d| to_us(d)).sum::<f64>() / m as f64;
    // perftest truncates each deviation to an integer; we do not.
    let var = delta[..m].iter().map(|&d| (to_us(d) - avg).powi(2)).sum::<f64>() / m as f64;
    let at = |q: f64| to_us(delta[((m as f64 * q).ceil() as usize).min(m)]);
    LatReport {
        size,
        iters,
        min: to_us(delta[0]),
        max: to_us(delta[m]),
        typical: median,
        avg,
        stdev: var.sqrt(),
        p99: at(0.99),
        p999: at(0.999),
    }
}
