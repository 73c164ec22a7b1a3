//! The instruction-count gate: a step of `cargo xtask test` (and of `cargo xtask bench
//! --callgrind`) that counts the user-space instructions of the crate's hot paths under callgrind
//! in the VM and fails when any of them grew past [`TOLERANCE`] over the baseline committed in
//! [`BASELINE`].
//!
//! The paths ([`figures`]): the post and poll of one RDMA Write and of chains of 32, per WR, at the
//! `unsafe`, safe one-shot (inline) and safe prepared levels, and of one RDMA Write of a registered
//! buffer that the queue pair holds until the completion (`Owned`) (`benches/post_poll.rs`), the safe poll of
//! batches of 1, 16 and 32 completions, per completion (its `POST_POLL_BATCH` mode) and one
//! awaited operation of the async adaptor (`benches/async_op.rs`, [`crate::callgrind::ASYNC_SCRIPT`]).
//! Six callgrind runs, about two minutes in the VM.
//! Each figure is *ours*: the provider library's share is left out, so an rdma-core update does
//! not move the gate, and instruction counts do not depend on the machine's load.
//!
//! Updating the baseline is a reviewed change: `cargo xtask bench --callgrind` writes the figures
//! of its run as `target/xtask-bench/gate-baseline.txt`; copy it over [`BASELINE`] and say in the
//! commit message why the counts moved.

use std::fmt::Write as _;

use crate::callgrind::{AsyncCount, BatchRow, Row};

/// The committed baseline, relative to the workspace root.
pub const BASELINE: &str = "xtask/gate-baseline.txt";

/// How much a figure may grow over its baseline before the gate fails (3 %).
pub const TOLERANCE: f64 = 0.03;

/// Growth below this many instructions never fails the gate (figures of a few instructions per
/// WR, where one instruction more per chain is a few percent).
pub const SLACK: f64 = 1.0;

/// What one empty poll may cost, at most, in a synchronous figure (`wr.*`, `batch.*`): the
/// benchmarks sleep 2 ms before they poll, so that the device has finished, but a VM slowed by
/// the host's other work may still make a poll find nothing; such polls are allowed for, at this
/// many instructions each, over the tolerance.
pub const EMPTY_POLL_ALLOWANCE: f64 = 150.0;

/// [`EMPTY_POLL_ALLOWANCE`] for the async operation (an empty poll there also arms the CQ and
/// polls it again).
pub const EMPTY_ASYNC_POLL_ALLOWANCE: f64 = 1500.0;

/// The levels of `benches/post_poll.rs` the gate watches (`POST_POLL_ONLY` names), and whether
/// the level runs chains too (`Owned`, the one-shot post of a registered buffer that the slot
/// holds until the completion, runs single requests only).
const LEVELS: [(&str, bool); 4] = [("Unsafe", true), ("Safe", true), ("Prepared", true), ("Owned", false)];

/// The batch sizes of the safe poll the gate watches.
const BATCHES: [u64; 3] = [1, 16, 32];

/// The guest script's per-WR part: each level of [`LEVELS`] once under callgrind, collecting
/// inside the benchmark's `post` and `poll` together (one run a level instead of
/// [`crate::callgrind::SCRIPT`]'s two, to keep the gate short), one dump per shape
/// (`what=both`).
const WR_SCRIPT: &str = r#"b=$(ls -t "$TARGET_DIR"/release/deps/post_poll-* | grep -v '\.d$' | head -n 1)
[ -x "$b" ] || { echo "no post_poll benchmark binary (cargo bench --no-run --bench post_poll)"; exit 1; }
rc=0
for level in Unsafe Safe Prepared Owned; do
  d=$(mktemp -d)
  echo "@@cg level=$level what=both"
  (cd "$d" && POST_POLL_ONLY=$level valgrind -q --tool=callgrind --collect-atstart=no \
    --toggle-collect=post_poll::post --toggle-collect=post_poll::poll --dump-after=post_poll::run \
    --callgrind-out-file="$d/cg.%p" "$b") 2>&1 || { echo "@@failed"; rc=1; }
  for f in "$d"/cg.*; do
    [ -f "$f" ] || continue
    echo "@@file"
    cat "$f"
  done
  echo "@@end"
  rm -rf "$d"
done
d=$(mktemp -d)
echo "@@cg level=Safe what=batch"
(cd "$d" && POST_POLL_BATCH=Safe valgrind -q --tool=callgrind --collect-atstart=no \
  --toggle-collect=post_poll::poll_batch --dump-after=post_poll::run_batch \
  --callgrind-out-file="$d/cg.%p" "$b") 2>&1 || { echo "@@failed"; rc=1; }
for f in "$d"/cg.*; do
  [ -f "$f" ] || continue
  echo "@@file"
  cat "$f"
done
echo "@@end"
rm -rf "$d"
exit $rc
"#;

/// The guest script: [`WR_SCRIPT`] (the per-WR runs and the safe batch run), then the async
/// run ([`crate::callgrind::ASYNC_SCRIPT`]); exits non-zero if any failed.
pub fn script() -> String {
    format!("rc=0\n( {WR_SCRIPT} ) || rc=1\n( {} ) || rc=1\nexit $rc\n", crate::callgrind::ASYNC_SCRIPT)
}

/// Reads [`WR_SCRIPT`]'s per-WR sections into rows whose `post` holds post and poll together
/// (their `poll` is zero); also the problems (failed runs, missing shapes).
pub fn parse_both(out: &str) -> (Vec<Row>, Vec<String>) {
    let mut rows = Vec::new();
    let mut problems = Vec::new();
    let sections = crate::callgrind::sections(out, "post_poll: ", [5, 7, 9], &mut problems);
    for s in sections.iter().filter(|s| s.what == "both") {
        for &(part, count) in &s.dumps {
            let Some(&(wrs, iterations)) =
                (part as usize).checked_sub(1).and_then(|i| crate::callgrind::SHAPES.get(i))
            else {
                continue;
            };
            // A level without chains dumps an empty part at its exit.
            let chains = LEVELS.iter().any(|&(l, c)| l == s.level && c);
            if count.total == 0 || (wrs > 1 && !chains) {
                continue;
            }
            let (polls, empty_polls) = s.polls.get(&wrs).copied().unwrap_or((0, 0));
            rows.push(Row {
                level: s.level.clone(),
                wrs,
                iterations,
                post: count,
                poll: Default::default(),
                polls,
                empty_polls,
            });
        }
    }
    for (level, chains) in LEVELS {
        for (wrs, _) in crate::callgrind::SHAPES.into_iter().filter(|&(wrs, _)| chains || wrs == 1) {
            if !rows.iter().any(|r| r.level == level && r.wrs == wrs && r.post.total > 0) {
                problems.push(format!("{level}, {wrs} WR(s) per post: no counts"));
            }
        }
    }
    (rows, problems)
}

/// One measured figure: its key in the baseline, instructions (ours) per unit, and the empty
/// polls that went into it (a poll that found nothing costs instructions the device's speed
/// decides, not the code: shown when a figure fails).
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    /// `wr.<level>.<WRs per post>` (a post and its poll, per WR), `batch.safe.<B>` (a poll of
    /// B completions, per completion) or `async.op`.
    pub key: String,
    /// Instructions per WR, completion or operation, the provider's share left out.
    pub value: f64,
    /// Empty polls among the polls counted.
    pub empty_polls: u64,
    /// What those empty polls may have added per unit, at most ([`EMPTY_POLL_ALLOWANCE`]):
    /// allowed over the tolerance.
    pub allowance: f64,
}

/// The gate's figures from the parsed runs.
pub fn figures(rows: &[Row], batch: &[BatchRow], op: Option<&AsyncCount>) -> Vec<Figure> {
    let mut out = Vec::new();
    for (level, _) in LEVELS {
        for r in rows.iter().filter(|r| r.level == level) {
            let ours = r.post.ours() + r.poll.ours();
            let units = (r.iterations * r.wrs).max(1) as f64;
            out.push(Figure {
                key: format!("wr.{}.{}", level.to_ascii_lowercase(), r.wrs),
                value: ours as f64 / units,
                empty_polls: r.empty_polls,
                allowance: r.empty_polls as f64 * EMPTY_POLL_ALLOWANCE / units,
            });
        }
    }
    for b in BATCHES {
        if let Some(r) = batch.iter().find(|r| r.level == "Safe" && r.batch == b) {
            out.push(Figure {
                key: format!("batch.safe.{b}"),
                value: r.per_completion(r.poll.ours()),
                empty_polls: r.empty_polls,
                allowance: r.empty_polls as f64 * EMPTY_POLL_ALLOWANCE / r.completions().max(1) as f64,
            });
        }
    }
    if let Some(op) = op {
        out.push(Figure {
            key: "async.op".into(),
            value: op.per_op(op.count.ours()),
            empty_polls: op.empty_polls,
            allowance: op.empty_polls as f64 * EMPTY_ASYNC_POLL_ALLOWANCE / op.ops.max(1) as f64,
        });
    }
    out
}

/// Reads a baseline: `key value` lines; `#` starts a comment.
///
/// # Errors
/// A line that is not a key and a number, or a key given twice.
pub fn parse_baseline(text: &str) -> Result<Vec<(String, f64)>, String> {
    let mut out: Vec<(String, f64)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(key), Some(value), None) = (words.next(), words.next(), words.next()) else {
            return Err(format!("{BASELINE}:{}: not `key value`: {line:?}", i + 1));
        };
        let value: f64 = value
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("{BASELINE}:{}: {value:?} is not a count", i + 1))?;
        if out.iter().any(|(k, _)| k == key) {
            return Err(format!("{BASELINE}:{}: {key} given twice", i + 1));
        }
        out.push((key.to_string(), value));
    }
    if out.is_empty() {
        return Err(format!("{BASELINE} has no figures"));
    }
    Ok(out)
}

/// The baseline file of `figures`, with a header saying where it came from.
pub fn render_baseline(figures: &[Figure], commit: &str, date: &str) -> String {
    let mut out = format!(
        "# The instruction-count gate's baseline (xtask/src/gate.rs): user-space instructions (callgrind Ir),\n\
         # the provider library's share left out, per WR (wr.*: a post and its poll), per completion (batch.*) or per\n\
         # operation (async.op). `cargo xtask test` fails when a figure grows more than {:.0} % (and more than\n\
         # {SLACK} instruction) over this. Written by `cargo xtask bench --callgrind` at commit {commit}, {date};\n\
         # updating it is a reviewed change whose commit message says why the counts moved.\n",
        TOLERANCE * 100.0
    );
    for f in figures {
        let _ = writeln!(out, "{} {:.1}", f.key, f.value);
    }
    out
}

/// The gate's verdict on `now` against `baseline`.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Figures that grew past the tolerance, or are missing.
    pub failures: Vec<String>,
    /// Figures that fell past the tolerance (lock the gain in by updating the baseline), and
    /// figures the baseline does not have.
    pub notes: Vec<String>,
    /// Every figure against its baseline, one line each.
    pub table: String,
}

/// Judges `now` against `baseline`.
pub fn judge(baseline: &[(String, f64)], now: &[Figure]) -> Verdict {
    let mut failures = Vec::new();
    let mut notes = Vec::new();
    let mut table = String::new();
    for (key, base) in baseline {
        let Some(f) = now.iter().find(|f| &f.key == key) else {
            failures.push(format!("{key}: not measured (baseline {base:.1})"));
            continue;
        };
        let change = if *base > 0.0 { (f.value - base) / base } else { 0.0 };
        let empty = if f.empty_polls > 0 {
            format!(" ({} empty polls counted, {:.1} allowed for them)", f.empty_polls, f.allowance)
        } else {
            String::new()
        };
        let _ = writeln!(
            table,
            "  {key:<18} {:>9.1}  baseline {base:>9.1}  {:>+6.1} %{empty}",
            f.value,
            change * 100.0
        );
        if f.value > base * (1.0 + TOLERANCE) + f.allowance && f.value - base > SLACK + f.allowance {
            failures.push(format!(
                "{key}: {:.1} instructions, {:+.1} % over the baseline's {base:.1} (limit {:.0} %){empty}",
                f.value,
                change * 100.0,
                TOLERANCE * 100.0
            ));
        } else if f.value < base * (1.0 - TOLERANCE) && base - f.value > SLACK {
            notes.push(format!(
                "{key}: {:.1}, {:+.1} % under the baseline's {base:.1}: update {BASELINE} to keep the gain",
                f.value,
                change * 100.0
            ));
        }
    }
    for f in now.iter().filter(|f| !baseline.iter().any(|(k, _)| *k == f.key)) {
        notes.push(format!("{}: {:.1}, not in the baseline", f.key, f.value));
    }
    Verdict { failures, notes, table }
}

/// The figures of the gate script's output ([`script`]), and its problems (failed runs, missing
/// counts).
pub fn read_output(output: &str) -> (Vec<Figure>, Vec<String>) {
    let (rows, mut problems) = parse_both(output);
    let (batch, batch_problems) = crate::callgrind::parse_batch_output(output);
    let (op, op_problems) = crate::callgrind::parse_async_output(output);
    // The batch levels the gate does not run are missing without harm; the rest may not be.
    problems.extend(batch_problems.into_iter().filter(|p| p.starts_with("Safe")));
    problems.extend(op_problems);
    (figures(&rows, &batch, op.as_ref()), problems)
}

/// Reads the gate step's output and judges it against `baseline_text`: `Ok` with the figures'
/// table, or `Err` naming every figure that grew, went missing, or a run that failed.
pub fn check(output: &str, code: i32, baseline_text: &str) -> Result<String, String> {
    let baseline = parse_baseline(baseline_text)?;
    let (figures, problems) = read_output(output);
    let verdict = judge(&baseline, &figures);
    let mut failures = verdict.failures;
    if code != 0 {
        failures.push(format!("the callgrind runs exited {code}"));
    }
    failures.extend(problems);
    let mut report = verdict.table;
    for n in &verdict.notes {
        let _ = writeln!(report, "  note: {n}");
    }
    if failures.is_empty() {
        Ok(report)
    } else {
        Err(format!("{}\n{report}", failures.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callgrind::Count;

    fn row(level: &str, wrs: u64, post: u64, poll: u64, empty: u64) -> Row {
        Row {
            level: level.into(),
            wrs,
            iterations: 10,
            post: Count { total: post + 1000, provider: 1000 },
            poll: Count { total: poll + 500, provider: 500 },
            polls: 10 + empty,
            empty_polls: empty,
        }
    }

    #[test]
    fn figures_are_ours_per_unit() {
        let rows = [row("Ffi", 1, 10, 10, 0), row("Safe", 1, 3000, 1300, 2), row("Safe", 32, 32_000, 320, 0)];
        let batch = [BatchRow {
            level: "Safe".into(),
            batch: 16,
            iterations: 50,
            poll: Count { total: 8000 + 100, provider: 100 },
            polls: 50,
            empty_polls: 0,
        }];
        let op = AsyncCount {
            ops: 200,
            count: Count { total: 450_000, provider: 50_000 },
            polls: 200,
            empty_polls: 0,
        };
        let f = figures(&rows, &batch, Some(&op));
        let got: Vec<(&str, f64, u64)> = f.iter().map(|f| (f.key.as_str(), f.value, f.empty_polls)).collect();
        assert_eq!(
            got,
            [
                ("wr.safe.1", 430.0, 2),
                ("wr.safe.32", 101.0, 0),
                ("batch.safe.16", 10.0, 0),
                ("async.op", 2000.0, 0)
            ]
        );
    }

    #[test]
    fn the_gate_script_output_is_read() {
        let dump = |part: u32, total: u64| {
            format!("@@file\npart: {part}\nob=(1) /t/post_poll\nfn=(2) post_poll::post\n0 {total}\ntotals: {total}\n")
        };
        let mut out = String::new();
        for (level, n) in [("Unsafe", 100u64), ("Safe", 400), ("Prepared", 200), ("Owned", 300)] {
            out.push_str(&format!("@@cg level={level} what=both\n"));
            out.push_str(&format!(
                "post_poll: {level}: 200 iterations of 1 request(s), 200 polls (0 empty)\n"
            ));
            out.push_str(&format!(
                "post_poll: {level}: 20 iterations of 32 request(s), 21 polls (1 empty)\n"
            ));
            out.push_str(&dump(1, n * 200));
            out.push_str(&dump(2, if level == "Owned" { 0 } else { n * 640 }));
            out.push_str("@@end\n");
        }
        let (rows, problems) = parse_both(&out);
        assert!(problems.is_empty(), "{problems:?}");
        let f = figures(&rows, &[], None);
        let got: Vec<(&str, f64, u64)> = f.iter().map(|f| (f.key.as_str(), f.value, f.empty_polls)).collect();
        assert_eq!(got[2..4], [("wr.safe.1", 400.0, 0), ("wr.safe.32", 400.0, 1)]);
        assert_eq!(got[6..], [("wr.owned.1", 300.0, 0)], "no chains of Owned, and no empty dump");
        let (_, problems) = parse_both(&out.replace("level=Prepared", "level=Other"));
        assert_eq!(
            problems,
            ["Prepared, 1 WR(s) per post: no counts", "Prepared, 32 WR(s) per post: no counts"]
        );
    }

    #[test]
    fn the_baseline_round_trips_and_bad_lines_are_refused() {
        let f = [
            Figure { key: "wr.safe.1".into(), value: 308.0, empty_polls: 0, allowance: 0.0 },
            Figure { key: "wr.safe.32".into(), value: 4.25, empty_polls: 0, allowance: 0.0 },
        ];
        let text = render_baseline(&f, "abc123", "2026-12-07");
        assert_eq!(
            parse_baseline(&text).unwrap(),
            [("wr.safe.1".to_string(), 308.0), ("wr.safe.32".into(), 4.2)]
        );
        assert!(parse_baseline("post.safe.1 308\npost.safe.1 309\n").unwrap_err().contains("twice"));
        assert!(parse_baseline("post.safe.1\n").unwrap_err().contains("not `key value`"));
        assert!(parse_baseline("post.safe.1 lots\n").unwrap_err().contains("not a count"));
        assert!(parse_baseline("# nothing\n").unwrap_err().contains("no figures"));
    }

    #[test]
    fn growth_past_the_tolerance_fails_and_a_fall_is_noted() {
        let base = [
            ("a".to_string(), 100.0),
            ("b".to_string(), 100.0),
            ("c".to_string(), 2.0),
            ("d".into(), 50.0),
            ("f".into(), 100.0),
        ];
        let now = [
            Figure { key: "a".into(), value: 103.0, empty_polls: 0, allowance: 0.0 },
            Figure { key: "b".into(), value: 103.5, empty_polls: 3, allowance: 0.4 },
            Figure { key: "f".into(), value: 110.0, empty_polls: 50, allowance: 7.5 },
            Figure { key: "c".into(), value: 2.9, empty_polls: 0, allowance: 0.0 },
            Figure { key: "e".into(), value: 7.0, empty_polls: 0, allowance: 0.0 },
        ];
        let v = judge(&base, &now);
        // a: +3 % is allowed; b: +3.5 % is not (its empty polls allow 0.4 of it); c: +45 % but
        // under one instruction; d: missing; f: +10 %, 7.5 of it allowed for its empty polls.
        assert_eq!(v.failures.len(), 2, "{:?}", v.failures);
        assert!(
            v.failures[0].starts_with("b: 103.5 instructions, +3.5 %")
                && v.failures[0].contains("3 empty polls")
        );
        assert!(v.failures[1].starts_with("d: not measured"));
        assert_eq!(v.notes, ["e: 7.0, not in the baseline"]);
        let f = Figure { key: "f".into(), value: 110.0, empty_polls: 40, allowance: 6.0 };
        assert!(judge(&base, &[f])
            .failures
            .iter()
            .any(|f| f.starts_with("f: 110.0") && f.contains("40 empty polls counted, 6.0 allowed")));
        let fell =
            judge(&base[..1], &[Figure { key: "a".into(), value: 90.0, empty_polls: 0, allowance: 0.0 }]);
        assert!(fell.failures.is_empty());
        assert!(fell.notes[0].contains("-10.0 % under"), "{:?}", fell.notes);
    }

    #[test]
    fn a_failed_or_empty_run_fails_the_check() {
        let base = "wr.safe.1 300\n";
        let e = check("", 0, base).unwrap_err();
        assert!(e.contains("wr.safe.1: not measured") && e.contains("async op: no counts"), "{e}");
        assert!(check("", 1, base).unwrap_err().contains("exited 1"));
    }
}
