//! `cargo xtask bench --ranks`: our allreduce (`examples/collectives`, release build) against Open
//! MPI's `MPI_Allreduce` on the same 4 ranks (2 per guest, one per NUMA node, two rails), the same
//! sizes (8 B to 64 MiB, factor 2) and in alternating rounds, in one boot of the ranks pair
//! ([`crate::twohost::RANKS_OPTIONS`]).
//!
//! Open MPI's transport: `pml ucx` over the rxe devices is tried first (a short run with
//! `UCX_TLS=rc_verbs,ud_verbs,self,sm`: UCX wires RC up over UD); when it fails, the comparison
//! uses `pml ob1` with the TCP BTL on the first link, and the table says which. Outputs: a Markdown table (ratios at every size),
//! `target/xtask-bench/ranks.json` and `docs/bench/ranks_allreduce.svg` (busbw) and
//! `docs/bench/ranks_allreduce_time.svg` (time per allreduce).

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use crate::plot::{Chart, Series};
use crate::rxe2::PairStep;
use crate::sweep::size_label;
use crate::twohost::{rsh_side, PRELUDE, RANKS_OPTIONS, RANKS_PRELUDE};
use crate::vm::Output;
use crate::{cargo, shell};

/// One size of the comparison: medians of the rounds.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Bytes per rank.
    pub size: u64,
    /// Our time per allreduce, µs.
    pub ours_us: f64,
    /// `MPI_Allreduce`'s, µs.
    pub mpi_us: f64,
}

impl Row {
    /// Bus bandwidth in MB/s from a time (nccl-tests' busbw: algbw × 2(n−1)/n, 4 ranks), computed
    /// here: the example prints GB/s to 4 decimals, too coarse for small sizes.
    fn busbw(&self, us: f64) -> f64 {
        self.size as f64 / us * 1.5
    }
}

/// The `mpi SIZE OURS_US MPI_US OURS_BUSBW MPI_BUSBW ...` rows of the example's output, and the
/// transport named by a `PML NAME` line (`ob1/tcp` when none says).
pub fn parse(out: &str) -> (Vec<Row>, String) {
    let mut rows: Vec<Row> = Vec::new();
    let mut pml = String::from("ob1/tcp");
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["PML", name] => pml = (*name).to_string(),
            ["mpi", size, ours, mpi, ..] => {
                let num = |s: &str| s.parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0);
                if let (Ok(size), Some(ours_us), Some(mpi_us)) = (size.parse::<u64>(), num(ours), num(mpi)) {
                    rows.retain(|r| r.size != size);
                    rows.push(Row { size, ours_us, mpi_us });
                }
            }
            _ => {}
        }
    }
    rows.sort_by_key(|r| r.size);
    (rows, pml)
}

/// The Markdown table: per size, both times and bus bandwidths and the ratios (ours / MPI for
/// busbw: above 1 is ours faster; ours / MPI for time: below 1 is ours faster).
pub fn table(rows: &[Row], pml: &str) -> String {
    let mut t = format!(
        "| size | ours, µs | MPI_Allreduce ({pml}), µs | time ours/MPI | ours busbw, MB/s | MPI busbw, MB/s | busbw ours/MPI |\n\
         |---|---|---|---|---|---|---|\n"
    );
    for r in rows {
        t.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.2} | {:.3} | {:.3} | {:.2} |\n",
            size_label(r.size),
            r.ours_us,
            r.mpi_us,
            r.ours_us / r.mpi_us,
            r.busbw(r.ours_us),
            r.busbw(r.mpi_us),
            r.mpi_us / r.ours_us
        ));
    }
    t
}

fn json(rows: &[Row], pml: &str) -> String {
    let body: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"size\": {}, \"ours_us\": {}, \"mpi_us\": {}, \"ours_busbw_mbs\": {}, \"mpi_busbw_mbs\": {}}}",
                r.size,
                r.ours_us,
                r.mpi_us,
                r.busbw(r.ours_us),
                r.busbw(r.mpi_us)
            )
        })
        .collect();
    format!("{{\"ranks\": 4, \"pml\": \"{pml}\", \"rows\": [\n  {}\n]}}\n", body.join(",\n  "))
}

fn charts(rows: &[Row], pml: &str) -> [(&'static str, Chart); 2] {
    let series = |name: &str, f: &dyn Fn(&Row) -> f64| Series {
        name: name.to_string(),
        points: rows.iter().map(|r| (r.size as f64, f(r))).collect(),
    };
    let mpi = format!("MPI_Allreduce ({pml})");
    [
        (
            "ranks_allreduce.svg",
            Chart {
                title: "allreduce, 4 ranks on 2 guests (rxe): bus bandwidth".into(),
                x_label: "bytes per rank".into(),
                y_label: "busbw, MB/s".into(),
                x_log2: true,
                y_log10: true,
                series: vec![series("ours", &|r| r.busbw(r.ours_us)), series(&mpi, &|r| r.busbw(r.mpi_us))],
            },
        ),
        (
            "ranks_allreduce_time.svg",
            Chart {
                title: "allreduce, 4 ranks on 2 guests (rxe): time".into(),
                x_label: "bytes per rank".into(),
                y_label: "µs per allreduce".into(),
                x_log2: true,
                y_log10: true,
                series: vec![series("ours", &|r| r.ours_us), series(&mpi, &|r| r.mpi_us)],
            },
        ),
    ]
}

/// Guest A's script: UCX tried, then the two halves of the size range (more iterations for the
/// small sizes), every result checked; B serves the remote shell.
fn script_a(collectives: &str, xtask: &str) -> Vec<u8> {
    let c = collectives;
    format!(
        "{PRELUDE}{RANKS_PRELUDE}XTASK={xtask}\n\
         UCX_ARGS='--mca pml ucx --mca btl self -x UCX_TLS=rc_verbs,ud_verbs,self,sm -x UCX_NET_DEVICES=rxe0:1,rxe1:1'\n\
         if PML_ARGS=$UCX_ARGS mpirun_ 120 {c} --bootstrap mpi --compare-mpi --rounds 1 -b 8 -e 64K -f 8 -n 2 -w 1 >/tmp/u.out 2>&1; then\n\
           echo 'PML ucx/rc_verbs'; PML_ARGS=$UCX_ARGS\n\
         else\n\
           echo 'Open MPI with pml ucx over rxe failed; the comparison uses pml ob1, btl tcp. UCX said:'\n\
           grep -i -m 8 'ucx.*error\\|fatal\\|ucx.*warn' /tmp/u.out; echo '(the end of its output:)'; tail -n 12 /tmp/u.out\n\
           echo 'PML ob1/tcp'; unset PML_ARGS\n\
         fi\n\
         export PML_ARGS\n\
         mpirun_ 1500 {c} --bootstrap mpi --compare-mpi --rounds 3 -b 8 -e 256K -f 2 -n 20 -w 2 >/tmp/b1.out 2>&1; rc1=$?\n\
         mpirun_ 2400 {c} --bootstrap mpi --compare-mpi --rounds 3 -b 512K -e 64M -f 2 -n 3 -w 1 >/tmp/b2.out 2>&1; rc2=$?\n\
         rxe2-barrier ranks-bench 60\ncat /tmp/b1.out /tmp/b2.out\n\
         [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] || die \"mpirun exits $rc1 $rc2\"\n\
         [ \"$(grep -c 'Out of bounds values : 0 OK' /tmp/b1.out /tmp/b2.out | awk -F: '{{s += $2}} END {{print s}}')\" -eq 2 ] \
         || die 'wrong values'\n"
    )
    .into_bytes()
}

/// `cargo xtask bench --ranks`.
pub fn run(timeout: Option<Duration>) -> Result<u8, String> {
    let root = crate::workspace_root();
    cargo::run(&root, &["build", "--release", "--examples", "--features", cargo::FEATURES])?;
    let target = cargo::target_dir(&root)?;
    let collectives = target.join("release/examples/collectives");
    let xtask = std::env::current_exe().map_err(|e| format!("the xtask executable: {e}"))?;
    let (c, x) = (collectives.display().to_string(), xtask.display().to_string());
    let secs = timeout.map_or(4500, |t| t.as_secs());
    let mut a = b"cd ".to_vec();
    a.extend_from_slice(&shell::quote(root.as_os_str().as_bytes()));
    a.push(b'\n');
    a.extend_from_slice(&script_a(&c, &x));
    let steps = [PairStep {
        label: "ours vs MPI_Allreduce, 4 ranks on two guests, 8 B to 64 MiB".into(),
        a,
        b: rsh_side(&x, secs, "ranks-bench"),
        timeout: Duration::from_secs(secs),
        output: Output::Live,
    }];
    // XTASK_RANKS_FROM=FILE: redraw the table and plots from a saved run's output (guest A's
    // lines, `[A] ` prefixes allowed) instead of booting the guests.
    let (out, code) = match std::env::var_os("XTASK_RANKS_FROM") {
        Some(f) => {
            let text = fs::read_to_string(&f).map_err(|e| format!("{}: {e}", Path::new(&f).display()))?;
            (text.lines().map(|l| l.strip_prefix("[A] ").unwrap_or(l)).collect::<Vec<_>>().join("\n"), 0)
        }
        None => {
            let report = crate::rxe2::run(&steps, &RANKS_OPTIONS, &mut |_, _| {})?;
            report.explain(&crate::rxe2::side_steps_of(&steps));
            let out = report.results.first().and_then(|r| r.sides[0].as_ref());
            (
                out.map(|r| String::from_utf8_lossy(&r.stdout).into_owned()).unwrap_or_default(),
                report.exit_code(),
            )
        }
    };
    let (rows, pml) = parse(&out);
    if rows.is_empty() {
        eprintln!("xtask: no comparison rows in guest A's output");
        return Ok(code.max(1));
    }
    let io = |p: &std::path::Path, e: std::io::Error| format!("writing {}: {e}", p.display());
    let data = target.join("xtask-bench");
    fs::create_dir_all(&data).map_err(|e| io(&data, e))?;
    let j = data.join("ranks.json");
    fs::write(&j, json(&rows, &pml)).map_err(|e| io(&j, e))?;
    eprintln!("xtask: wrote {}", j.display());
    let plots = root.join("docs/bench");
    fs::create_dir_all(&plots).map_err(|e| io(&plots, e))?;
    for (name, chart) in charts(&rows, &pml) {
        let p = plots.join(name);
        fs::write(&p, chart.svg()).map_err(|e| io(&p, e))?;
        eprintln!("xtask: wrote {}", p.display());
    }
    println!("{}", table(&rows, &pml));
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rows_and_the_transport() {
        let out = "PML ucx/rc_verbs\n# noise\n\
            mpi            8       20.00       40.00       0.0004       0.0002         2.000        0.500\n\
            mpi      1048576     1000.00      500.00       1.5729       3.1457         0.500        2.000\n\
            mpi            x       1.0 1.0 1.0 1.0\n\
            [A] mpi 1 2 3\n";
        let (rows, pml) = parse(out);
        assert_eq!(pml, "ucx/rc_verbs");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].size, 8);
        assert_eq!(rows[1].mpi_us, 500.0);
        let t = table(&rows, &pml);
        assert!(t.contains("| 8 B | 20 | 40 | 0.50 | 0.600 | 0.300 | 2.00 |"), "{t}");
        assert!(t.contains("| 1 MiB | 1000 | 500 | 2.00 | 1572.864 | 3145.728 | 0.50 |"), "{t}");
        let v = crate::json::parse(&json(&rows, &pml)).expect("valid JSON");
        assert_eq!(v.get("rows").and_then(|r| r.as_array()).map(<[_]>::len), Some(2));
        assert_eq!(parse("no rows").1, "ob1/tcp");
    }
}
