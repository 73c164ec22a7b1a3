//! `cargo xtask bench --sweep`: the size and scaling sweeps of `examples/perf/sweep.sh` in one VM
//! boot (release build), as tables of medians and ratios, a machine-readable file
//! (`target/xtask-bench/sweep.json`) and SVG plots (`docs/bench/*.svg`, which the README shows).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use crate::plot::{Chart, Series};
use crate::vm::{self, Output, Step};
use crate::{cargo, shell};

/// The three kinds of run, in the order of the tables and legends.
pub const KINDS: [&str; 3] = ["safe", "raw", "perftest"];

/// Legend names of [`KINDS`].
const KIND_NAMES: [&str; 3] = ["ours, safe level", "ours, raw level", "perftest (C)"];

/// The tests of the size sweep: (name, unit of its value, higher is better).
pub const TESTS: [(&str, &str, bool); 5] = [
    ("write_bw", "MB/s", true),
    ("read_bw", "MB/s", true),
    ("send_bw", "MB/s", true),
    ("write_lat", "µs (typical)", false),
    ("send_lat", "µs (typical)", false),
];

/// The sizes at which the issue's targets apply (safe ≥ 0.97× perftest's bandwidth, ≤ 1.03× its
/// latency).
const TARGET_SIZES: [u64; 3] = [2, 4096, 65536];

/// How long the sweep may run by default.
const TIMEOUT: Duration = Duration::from_secs(3600);

/// Every value measured, by (sweep, test, kind, x): `sweep` is `SWEEP` (x = size) or `SCALE`
/// (x = queue pairs); failed runs count in `failed`.
#[derive(Debug, Default)]
pub struct Results {
    /// Values of the successful runs.
    pub values: BTreeMap<(String, String, String, u64), Vec<f64>>,
    /// Runs that failed.
    pub failed: usize,
}

/// Parses the `SWEEP`/`SCALE` lines of `sweep.sh`'s output (other lines are ignored).
pub fn parse(out: &str) -> Results {
    let mut r = Results::default();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 7 || !(f[0] == "SWEEP" || f[0] == "SCALE") || !KINDS.contains(&f[2]) {
            continue;
        }
        let Ok(x) = f[3].parse::<u64>() else { continue };
        match (f[5] == "rc=0", f[6].parse::<f64>()) {
            (true, Ok(v)) if v.is_finite() => {
                r.values.entry((f[0].to_string(), f[1].to_string(), f[2].to_string(), x)).or_default().push(v)
            }
            _ => r.failed += 1,
        }
    }
    r
}

/// The median of `v` (mean of the middle two for an even count); `None` when empty.
pub fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

impl Results {
    fn median(&self, sweep: &str, test: &str, kind: &str, x: u64) -> Option<f64> {
        self.values.get(&(sweep.into(), test.into(), kind.into(), x)).and_then(|v| median(v))
    }

    /// The x values measured for (sweep, test), ascending.
    fn xs(&self, sweep: &str, test: &str) -> Vec<u64> {
        let mut xs: Vec<u64> =
            self.values.keys().filter(|k| k.0 == sweep && k.1 == test).map(|k| k.3).collect();
        xs.sort_unstable();
        xs.dedup();
        xs
    }

    /// The Markdown tables: per test, per size, the medians of the three kinds and the ratios
    /// ours/perftest, with the target verdict at the target sizes; then the scaling sweep.
    pub fn tables(&self) -> String {
        let mut o = String::new();
        let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        // Values below 1 (bandwidth at a few bytes) with four decimals.
        let fv = |v: Option<f64>| match v {
            Some(v) if v.abs() < 1.0 => format!("{v:.4}"),
            v => f(v),
        };
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        for (test, unit, higher) in TESTS {
            let xs = self.xs("SWEEP", test);
            if xs.is_empty() {
                continue;
            }
            let _ = writeln!(
                o,
                "\n{test}, {unit} ({}):\n",
                if higher { "higher is better" } else { "lower is better" }
            );
            let _ = writeln!(
                o,
                "| size | safe | raw | perftest | safe/perftest | raw/perftest | target (safe) |"
            );
            let _ = writeln!(o, "|---|---|---|---|---|---|---|");
            for x in xs {
                let [s, r, p] = KINDS.map(|k| self.median("SWEEP", test, k, x));
                let rs = ratio(s, p);
                let verdict = match (TARGET_SIZES.contains(&x), rs) {
                    (false, _) => "",
                    (true, None) => "not measured",
                    (true, Some(q)) if (higher && q >= 0.97) || (!higher && q <= 1.03) => "met",
                    (true, Some(_)) => "missed",
                };
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {} | {} | {verdict} |",
                    size_label(x),
                    fv(s),
                    fv(r),
                    fv(p),
                    f(rs),
                    f(ratio(r, p))
                );
            }
        }
        let qs = self.xs("SCALE", "write_bw");
        if !qs.is_empty() {
            let _ = writeln!(
                o,
                "\nwrite_bw, 64 B messages, thousand messages/s by queue pairs (higher is better):\n"
            );
            let _ = writeln!(o, "| QPs | safe | raw | perftest | safe/perftest | raw/perftest |");
            let _ = writeln!(o, "|---|---|---|---|---|---|");
            for q in qs {
                // perftest's MsgRate column is in Mpps.
                let [s, r, p] = KINDS.map(|k| self.median("SCALE", "write_bw", k, q).map(|v| v * 1000.0));
                let _ = writeln!(
                    o,
                    "| {q} | {} | {} | {} | {} | {} |",
                    f(s),
                    f(r),
                    f(p),
                    f(ratio(s, p)),
                    f(ratio(r, p))
                );
            }
        }
        o
    }

    /// Every value as JSON: `{"failed": N, "runs": [{"sweep", "test", "kind", "x", "values",
    /// "median"}...]}`.
    pub fn json(&self) -> String {
        let mut o = format!("{{\n  \"failed\": {},\n  \"runs\": [", self.failed);
        for (i, ((sweep, test, kind, x), v)) in self.values.iter().enumerate() {
            let vals: Vec<String> = v.iter().map(|v| format!("{v}")).collect();
            let _ = write!(
                o,
                "{}\n    {{\"sweep\": \"{sweep}\", \"test\": \"{test}\", \"kind\": \"{kind}\", \"x\": {x}, \"values\": [{}], \"median\": {}}}",
                if i == 0 { "" } else { "," },
                vals.join(", "),
                median(v).map_or("null".to_string(), |m| format!("{m}"))
            );
        }
        o.push_str("\n  ]\n}\n");
        o
    }

    /// The charts: one per test of the size sweep, and the scaling sweep.
    pub fn charts(&self) -> Vec<(String, Chart)> {
        let series = |sweep: &str, test: &str, scale: f64| -> Vec<Series> {
            KINDS
                .iter()
                .zip(KIND_NAMES)
                .map(|(k, name)| Series {
                    name: name.to_string(),
                    points: self
                        .xs(sweep, test)
                        .into_iter()
                        .filter_map(|x| self.median(sweep, test, k, x).map(|v| (x as f64, v * scale)))
                        .collect(),
                })
                .collect()
        };
        let mut out = Vec::new();
        for (test, unit, higher) in TESTS {
            if self.xs("SWEEP", test).is_empty() {
                continue;
            }
            out.push((
                format!("{test}.svg"),
                Chart {
                    title: format!(
                        "{test}: {} by message size (SoftRoCE)",
                        if higher { "bandwidth" } else { "latency" }
                    ),
                    x_label: "message size [bytes]".into(),
                    y_label: unit.into(),
                    x_log2: true,
                    y_log10: !higher,
                    series: series("SWEEP", test, 1.0),
                },
            ));
        }
        if !self.xs("SCALE", "write_bw").is_empty() {
            out.push((
                "scaling.svg".into(),
                Chart {
                    title: "write_bw, 64 B messages: message rate by queue pairs".into(),
                    x_label: "queue pairs".into(),
                    y_label: "thousand messages/s".into(),
                    x_log2: true,
                    y_log10: false,
                    series: series("SCALE", "write_bw", 1000.0),
                },
            ));
        }
        out
    }
}

/// `2`, `4 KiB`, `1 MiB`.
pub fn size_label(x: u64) -> String {
    match x {
        _ if x >= 1 << 20 && x % (1 << 20) == 0 => format!("{} MiB", x >> 20),
        _ if x >= 1 << 10 && x % (1 << 10) == 0 => format!("{} KiB", x >> 10),
        _ => format!("{x} B"),
    }
}

/// The environment variables of `sweep.sh` that `run` passes on.
const VARS: [&str; 7] = ["PAIRS", "SIZES", "TESTS", "QPS", "TARGET_SIZES", "TARGET_PAIRS", "PIN"];

/// `cargo xtask bench --sweep` (and the first step of `cargo xtask bench`): runs the sweep,
/// prints the tables, writes the JSON file and the plots. [`VARS`] in the environment go to
/// `sweep.sh`; `defaults` gives values for those the environment does not set.
pub fn run(
    backend: &vm::Backend,
    timeout: Option<Duration>,
    defaults: &[(&str, &str)],
) -> Result<u8, String> {
    let root = crate::workspace_root();
    cargo::run(&root, &["build", "--release", "--examples"])?;
    let target = cargo::target_dir(&root)?;
    let mut script = b"TARGET_DIR=".to_vec();
    script.extend_from_slice(&shell::quote(target.as_os_str().as_bytes()));
    script.push(b'\n');
    for var in VARS {
        let default = defaults.iter().find(|(k, _)| *k == var).map(|(_, v)| std::ffi::OsString::from(v));
        if let Some(v) = std::env::var_os(var).or(default) {
            script.extend_from_slice(format!("{var}=").as_bytes());
            script.extend_from_slice(&shell::quote(v.as_bytes()));
            script.extend_from_slice(format!("\nexport {var}\n").as_bytes());
        }
    }
    script.extend_from_slice(br#"sh examples/perf/sweep.sh "$TARGET_DIR/release/examples""#);
    let steps = [Step {
        label: "size and scaling sweeps: ours (safe, raw) vs perftest".into(),
        script: shell::in_dir(&root, &script),
        timeout: timeout.unwrap_or(TIMEOUT),
        output: Output::Live,
    }];
    let mut out = String::new();
    let mut code = 0;
    let report = vm::run(&steps, backend, &mut |_, r| {
        out = String::from_utf8_lossy(&r.stdout).into_owned();
        code = r.code;
    })?;
    report.explain(&steps);
    let results = parse(&out);
    println!("{}", results.tables());
    write_outputs(&results, &target.join("xtask-bench"), &root.join("docs/bench"))?;
    if results.failed > 0 {
        eprintln!("xtask: {} runs of the sweep failed (see above)", results.failed);
    }
    Ok(match report.end {
        vm::End::Completed if code == 0 && results.failed == 0 && !results.values.is_empty() => 0,
        vm::End::Completed => 1,
        _ => report.single_step_exit_code().max(1),
    })
}

/// Writes `sweep.json` into `data` and the charts into `plots`.
fn write_outputs(r: &Results, data: &Path, plots: &Path) -> Result<(), String> {
    let io = |p: &Path, e: std::io::Error| format!("writing {}: {e}", p.display());
    fs::create_dir_all(data).map_err(|e| io(data, e))?;
    let json = data.join("sweep.json");
    fs::write(&json, r.json()).map_err(|e| io(&json, e))?;
    eprintln!("xtask: wrote {}", json.display());
    fs::create_dir_all(plots).map_err(|e| io(plots, e))?;
    for (name, chart) in r.charts() {
        let p = plots.join(name);
        fs::write(&p, chart.svg()).map_err(|e| io(&p, e))?;
        eprintln!("xtask: wrote {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "noise\n\
        SWEEP write_bw safe 4096 1 rc=0 30.5\n\
        SWEEP write_bw raw 4096 1 rc=0 31\n\
        SWEEP write_bw perftest 4096 1 rc=0 31.0\n\
        SWEEP write_bw safe 4096 2 rc=0 29.5\n\
        SWEEP write_bw perftest 4096 2 rc=1 -\n\
        SWEEP write_lat safe 2 1 rc=0 10.6\n\
        SWEEP write_lat perftest 2 1 rc=0 10.0\n\
        SCALE write_bw safe 4 1 rc=0 0.21\n\
        SCALE write_bw perftest 4 1 rc=0 0.2\n\
        SWEEP write_bw other 4096 1 rc=0 1\n\
        SWEEP write_bw safe x 1 rc=0 1\n";

    #[test]
    fn parses_medians_failures_and_ignores_the_rest() {
        let r = parse(OUT);
        assert_eq!(r.failed, 1);
        assert_eq!(r.median("SWEEP", "write_bw", "safe", 4096), Some(30.0));
        assert_eq!(r.median("SWEEP", "write_bw", "perftest", 4096), Some(31.0));
        assert_eq!(r.median("SCALE", "write_bw", "safe", 4), Some(0.21));
        assert_eq!(r.values.len(), 7);
    }

    #[test]
    fn tables_give_ratios_and_target_verdicts() {
        let t = parse(OUT).tables();
        // 30 / 31 = 0.968: missed at 4 KiB (bandwidth target 0.97).
        assert!(t.contains("| 4 KiB | 30.00 | 31.00 | 31.00 | 0.97 | 1.00 | missed |"), "{t}");
        // 10.6 / 10.0 = 1.06 latency: missed; raw not measured.
        assert!(t.contains("| 2 B | 10.60 | - | 10.00 | 1.06 | - | missed |"), "{t}");
        assert!(t.contains("| 4 | 210.00 | - | 200.00 | 1.05 | - |"), "{t}");
        assert_eq!(t.matches("| 4 KiB |").count(), 1, "one row per size: {t}");
    }

    #[test]
    fn json_and_charts() {
        let r = parse(OUT);
        let j = r.json();
        let v = crate::json::parse(&j).expect("valid JSON");
        assert_eq!(v.get("runs").and_then(|r| r.as_array()).map(<[_]>::len), Some(7));
        let charts = r.charts();
        let names: Vec<&str> = charts.iter().map(|c| c.0.as_str()).collect();
        assert_eq!(names, ["write_bw.svg", "write_lat.svg", "scaling.svg"]);
        assert!(charts[0].1.svg().contains("perftest (C)"));
    }
}
