//! `cargo xtask bench --callgrind` (and the last step of `cargo xtask bench`): user-space
//! instructions per work request of the post/poll micro-benchmark (`benches/post_poll.rs`),
//! counted by callgrind in the VM, at four levels (raw `ffi`, the `unsafe` level, the safe
//! one-shot `post_send(_iter)`, the safe prepared `post_prepared(_iter)`), for single posts
//! and chains of 32.
//!
//! Each level runs twice under callgrind (`POST_POLL_ONLY=<level>`: 200 single posts, then 20
//! chains of 32, each shape after one warm-up iteration outside the counted functions, so that
//! first-use costs such as a queue pair's lazily allocated chain scratch are not spread over the
//! counted WRs): once collecting only inside the benchmark's `post` function, once only inside
//! `poll` (`--collect-atstart=no --toggle-collect`), with a dump after each `run` call, so that
//! each dump holds one (level, chain length, post or poll) count. A count is split into the
//! provider's share (the inclusive cost of every call from outside the provider library into it:
//! its `post_send`/`poll_cq` and whatever they call, e.g. the doorbell's `write`) and *ours* (the
//! rest: the benchmark's own loop, this crate, the C shim, the `memcpy`s they call).
//!
//! Then the poll cost per completion against the batch size ([`BATCH_SCRIPT`]): each of three
//! levels (`ffi`, `unsafe`, safe `poll` of tracked completions) runs once under callgrind
//! (`POST_POLL_BATCH=<level>`: for B = 1, 2, 4 ... 32, 50 chains of B signaled Writes, each
//! polled until its B completions are in, one poll call with room for B at a time), collecting
//! only inside the benchmark's `poll_batch`, with a dump after each `run_batch` call: one dump per
//! (level, B), split as above, divided by the completions (50 × B). A table
//! ([`batch_table`]), the `poll_batch` rows of `callgrind.json`, and a plot ([`batch_chart`],
//! `docs/bench/poll_batch.svg`).

use std::fmt::Write as _;

/// The levels, as `POST_POLL_ONLY` names them, and how the table names them.
pub const LEVELS: [(&str, &str); 4] = [
    ("Ffi", "raw ffi (ibv_post_send / ibv_poll_cq)"),
    ("Unsafe", "unsafe (post_send_unchecked / poll_raw)"),
    ("Safe", "safe one-shot (post_send(_iter) / poll)"),
    ("Prepared", "safe prepared (post_prepared(_iter) / poll)"),
];

/// Single posts and chains: (WRs per post, iterations) as `benches/post_poll.rs` runs them.
pub const SHAPES: [(u64, u64); 2] = [(1, 200), (32, 20)];

/// The guest script: runs every level twice under callgrind and prints, between markers, the
/// benchmark's output and every callgrind dump. `$TARGET_DIR` names cargo's target directory.
pub const SCRIPT: &str = r#"b=$(ls -t "$TARGET_DIR"/release/deps/post_poll-* | grep -v '\.d$' | head -n 1)
[ -x "$b" ] || { echo "no post_poll benchmark binary (cargo bench --no-run --bench post_poll)"; exit 1; }
rc=0
for level in Ffi Unsafe Safe Prepared; do
  for what in post poll; do
    d=$(mktemp -d)
    echo "@@cg level=$level what=$what"
    (cd "$d" && POST_POLL_ONLY=$level valgrind -q --tool=callgrind --collect-atstart=no \
      --toggle-collect="post_poll::$what" --dump-after=post_poll::run \
      --callgrind-out-file="$d/cg.%p" "$b") 2>&1 || { echo "@@failed"; rc=1; }
    for f in "$d"/cg.*; do
      [ -f "$f" ] || continue
      echo "@@file"
      cat "$f"
    done
    echo "@@end"
    rm -rf "$d"
  done
done
exit $rc
"#;

/// The levels of the batch run, as `POST_POLL_BATCH` names them, and how the table and the
/// plot name them.
pub const BATCH_LEVELS: [(&str, &str); 3] = [("Ffi", "ffi"), ("Unsafe", "unsafe"), ("Safe", "safe")];

/// Batch sizes in the order of the batch run's `run_batch` calls (dumps), and its iterations
/// per batch size, as `benches/post_poll.rs` runs them.
pub const BATCHES: [u64; 6] = [1, 2, 4, 8, 16, 32];
/// Iterations per batch size.
pub const BATCH_ITERS: u64 = 50;

/// The guest script of the batch run: every level of [`BATCH_LEVELS`] once under callgrind,
/// collecting only inside `poll_batch`, one dump per batch size; printed between the markers of
/// [`SCRIPT`] (`what=batch`).
pub const BATCH_SCRIPT: &str = r#"b=$(ls -t "$TARGET_DIR"/release/deps/post_poll-* | grep -v '\.d$' | head -n 1)
[ -x "$b" ] || { echo "no post_poll benchmark binary (cargo bench --no-run --bench post_poll)"; exit 1; }
rc=0
for level in Ffi Unsafe Safe; do
  d=$(mktemp -d)
  echo "@@cg level=$level what=batch"
  (cd "$d" && POST_POLL_BATCH=$level valgrind -q --tool=callgrind --collect-atstart=no \
    --toggle-collect=post_poll::poll_batch --dump-after=post_poll::run_batch \
    --callgrind-out-file="$d/cg.%p" "$b") 2>&1 || { echo "@@failed"; rc=1; }
  for f in "$d"/cg.*; do
    [ -f "$f" ] || continue
    echo "@@file"
    cat "$f"
  done
  echo "@@end"
  rm -rf "$d"
done
exit $rc
"#;

/// The guest script of the async adaptor's count (`benches/async_op.rs`): one callgrind run
/// collecting inside its `post_op` and `poll_op`, dumped after each `run` call (the first dump is
/// the warm-up's, the second the counted iterations'); printed between the markers of
/// [`SCRIPT`] (`level=Async what=op`).
pub const ASYNC_SCRIPT: &str = r#"b=$(ls -t "$TARGET_DIR"/release/deps/async_op-* | grep -v '\.d$' | head -n 1)
[ -x "$b" ] || { echo "no async_op benchmark binary (cargo bench --no-run --bench async_op)"; exit 1; }
rc=0
d=$(mktemp -d)
echo "@@cg level=Async what=op"
(cd "$d" && valgrind -q --tool=callgrind --collect-atstart=no \
  --toggle-collect=async_op::post_op --toggle-collect=async_op::poll_op --dump-after=async_op::run \
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

/// The async adaptor's count: one operation posted and its future polled to completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncCount {
    /// Operations counted.
    pub ops: u64,
    /// Inside `post_op` and `poll_op`.
    pub count: Count,
    /// Polls of the futures, and how many found nothing.
    pub polls: u64,
    /// Polls that found nothing.
    pub empty_polls: u64,
}

impl AsyncCount {
    /// `v` per operation.
    pub fn per_op(&self, v: u64) -> f64 {
        v as f64 / self.ops.max(1) as f64
    }
}

/// Reads [`ASYNC_SCRIPT`]'s output: the counted run's dump (part 2) and the summary line
/// (`async_op: I operations, P polls (E empty)`). `None` with the problems when it is not there.
pub fn parse_async_output(out: &str) -> (Option<AsyncCount>, Vec<String>) {
    let mut problems = Vec::new();
    let mut found = None;
    for Section { what, polls, dumps, .. } in sections(out, "async_op: ", [1, 3, 5], &mut problems) {
        if what != "op" {
            continue;
        }
        let (Some(&count), Some((&ops, &(p, e)))) =
            (dumps.iter().find(|(part, _)| *part == 2).map(|(_, c)| c), polls.iter().next())
        else {
            continue;
        };
        found = Some(AsyncCount { ops, count, polls: p, empty_polls: e });
    }
    match found {
        Some(c) if c.count.total > 0 && c.ops > 0 => (Some(c), problems),
        _ => {
            problems.push("async op: no counts".into());
            (None, problems)
        }
    }
}

/// One callgrind dump, reduced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Count {
    /// Every instruction collected.
    pub total: u64,
    /// The provider's share of `total`.
    pub provider: u64,
}

impl Count {
    /// Ours: `total` minus the provider's share.
    pub fn ours(&self) -> u64 {
        self.total.saturating_sub(self.provider)
    }
}

/// Whether a callgrind object (a path) is the device provider: a `lib<name>-rdmav<N>.so`
/// plugin of libibverbs, or one of the providers linked directly (mlx4, mlx5, efa...).
pub fn is_provider(object: &str) -> bool {
    let base = object.rsplit('/').next().unwrap_or(object);
    base.contains("-rdmav")
        || ["libmlx4.", "libmlx5.", "libefa.", "libhns.", "libmana.", "libirdma."]
            .iter()
            .any(|p| base.starts_with(p))
}

/// Reduces one callgrind output file (format version 1, one event: `Ir`) to its `totals:`
/// and the provider's share: the first cost line after each `calls=` line is the inclusive cost
/// of that call; calls from an object that is not the provider into one that is add up.
/// Also returns the file's `part:` number (1 for the first dump).
pub fn parse_dump(text: &str) -> (u32, Count) {
    // Object names (their ids are a namespace of their own): "(12) /path" defines id 12,
    // "(12)" refers to it.
    let mut names: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut resolve = |v: &str| -> String {
        let v = v.trim();
        if let Some(rest) = v.strip_prefix('(') {
            if let Some((id, name)) = rest.split_once(')') {
                let name = name.trim();
                if name.is_empty() {
                    return names.get(id).cloned().unwrap_or_default();
                }
                names.insert(id.to_string(), name.to_string());
                return name.to_string();
            }
        }
        v.to_string()
    };
    let (mut part, mut count) = (1, Count::default());
    let mut ob = String::new();
    let mut cob: Option<String> = None;
    let mut in_call = false;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("part:") {
            part = v.trim().parse().unwrap_or(1);
        } else if let Some(v) = line.strip_prefix("totals:").or_else(|| line.strip_prefix("summary:")) {
            let v = v.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0);
            count.total = count.total.max(v);
        } else if let Some(v) = line.strip_prefix("ob=") {
            ob = resolve(v);
        } else if let Some(v) = line.strip_prefix("cob=") {
            cob = Some(resolve(v));
        } else if line.starts_with("calls=") {
            in_call = true;
        } else if in_call
            && line.starts_with(|c: char| c.is_ascii_digit() || c == '+' || c == '-' || c == '*')
        {
            let callee = cob.take().unwrap_or_else(|| ob.clone());
            let cost: u64 = line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
            if is_provider(&callee) && !is_provider(&ob) {
                count.provider += cost;
            }
            in_call = false;
        }
    }
    (part, count)
}

/// One row of the table: a level and a chain length, post and poll counted apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// `POST_POLL_ONLY` name of the level.
    pub level: String,
    /// WRs per post call.
    pub wrs: u64,
    /// Post calls.
    pub iterations: u64,
    /// Inside the benchmark's `post`.
    pub post: Count,
    /// Inside the benchmark's `poll`.
    pub poll: Count,
    /// Poll calls, and how many found nothing (the benchmark's own count).
    pub polls: u64,
    /// Poll calls that found nothing.
    pub empty_polls: u64,
}

impl Row {
    fn per_wr(&self, v: u64) -> f64 {
        v as f64 / (self.iterations * self.wrs).max(1) as f64
    }
}

/// One `@@cg` section of a guest script's output, read.
pub(crate) struct Section {
    /// `level=` of its header.
    pub(crate) level: String,
    /// `what=` of its header.
    pub(crate) what: String,
    /// The benchmark's counts from its summary lines: shape (WRs per post, or batch size) →
    /// (poll calls, empty ones).
    pub(crate) polls: std::collections::HashMap<u64, (u64, u64)>,
    /// Its dumps: (part number, count).
    pub(crate) dumps: Vec<(u32, Count)>,
}

/// Splits a guest script's output into its sections; a failed run is reported in `problems`.
/// Summary lines start with `prefix`; `words` are the indices of the shape, the poll calls and
/// the empty ones among their whitespace-separated words.
pub(crate) fn sections(
    out: &str,
    prefix: &str,
    words: [usize; 3],
    problems: &mut Vec<String>,
) -> Vec<Section> {
    let mut found = Vec::new();
    for section in out.split("@@cg ").skip(1) {
        let header = section.lines().next().unwrap_or("");
        let field =
            |k: &str| header.split_whitespace().find_map(|f| f.strip_prefix(k)).unwrap_or("").to_string();
        let (level, what) = (field("level="), field("what="));
        if section.lines().any(|l| l == "@@failed") {
            problems.push(format!("{level} {what}: callgrind run failed"));
        }
        let mut polls = std::collections::HashMap::new();
        for l in section.lines().filter(|l| l.starts_with(prefix)) {
            let w: Vec<&str> = l.split_whitespace().collect();
            let num =
                |i: usize| w.get(i).map(|w| w.trim_start_matches('(')).and_then(|w| w.parse::<u64>().ok());
            if let (Some(n), Some(p), Some(e)) = (num(words[0]), num(words[1]), num(words[2])) {
                polls.insert(n, (p, e));
            }
        }
        let body = section.split("@@end").next().unwrap_or("");
        let dumps = body.split("@@file").skip(1).map(parse_dump).collect();
        found.push(Section { level, what, polls, dumps });
    }
    found
}

/// Reads the guest script's output into rows (levels × shapes, in [`LEVELS`] order); a level
/// whose run failed or printed no dump is missing. Also the failures' descriptions.
pub fn parse_output(out: &str) -> (Vec<Row>, Vec<String>) {
    let mut rows: Vec<Row> = Vec::new();
    let mut problems = Vec::new();
    // The benchmark's summary lines: "post_poll: L: I iterations of N request(s), P polls (E empty)".
    for Section { level, what, polls, dumps } in sections(out, "post_poll: ", [5, 7, 9], &mut problems) {
        for (part, count) in dumps {
            let Some(&(wrs, iterations)) = (part as usize).checked_sub(1).and_then(|i| SHAPES.get(i)) else {
                continue;
            };
            let row = match rows.iter_mut().find(|r| r.level == level && r.wrs == wrs) {
                Some(r) => r,
                None => {
                    rows.push(Row {
                        level: level.clone(),
                        wrs,
                        iterations,
                        post: Count::default(),
                        poll: Count::default(),
                        polls: 0,
                        empty_polls: 0,
                    });
                    rows.last_mut().expect("just pushed")
                }
            };
            match what.as_str() {
                "post" => row.post = count,
                "poll" => {
                    row.poll = count;
                    let (p, e) = polls.get(&wrs).copied().unwrap_or((0, 0));
                    row.polls = p;
                    row.empty_polls = e;
                }
                _ => {}
            }
        }
    }
    rows.sort_by_key(|r| (LEVELS.iter().position(|(l, _)| *l == r.level).unwrap_or(LEVELS.len()), r.wrs));
    for (level, _) in LEVELS {
        for (wrs, _) in SHAPES {
            match rows.iter().find(|r| r.level == level && r.wrs == wrs) {
                None => problems.push(format!("{level}, {wrs} WR(s) per post: no counts")),
                Some(r) if r.post.total == 0 || r.poll.total == 0 => {
                    problems.push(format!("{level}, {wrs} WR(s) per post: post or poll counted nothing"))
                }
                Some(_) => {}
            }
        }
    }
    (rows, problems)
}

/// The Markdown table: per WR, post and poll, inclusive of the provider and ours, and ours
/// against the `unsafe` level's.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| level | WRs per post | post, incl. provider | post, ours | poll, incl. provider | poll, ours | ours, post + poll | ours − unsafe |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let name = LEVELS.iter().find(|(l, _)| *l == r.level).map_or(r.level.as_str(), |(_, n)| n);
        let ours = r.per_wr(r.post.ours()) + r.per_wr(r.poll.ours());
        let base = rows.iter().find(|u| u.level == "Unsafe" && u.wrs == r.wrs);
        let delta = base.map_or("-".to_string(), |u| {
            format!("{:+.1}", ours - (u.per_wr(u.post.ours()) + u.per_wr(u.poll.ours())))
        });
        let _ = writeln!(
            out,
            "| {name} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {ours:.1} | {delta} |",
            r.wrs,
            r.per_wr(r.post.total),
            r.per_wr(r.post.ours()),
            r.per_wr(r.poll.total),
            r.per_wr(r.poll.ours()),
        );
    }
    out
}

/// One row of the batch run: a level and a batch size, the poll calls counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRow {
    /// `POST_POLL_BATCH` name of the level.
    pub level: String,
    /// Completions per batch (B), the room of each poll call.
    pub batch: u64,
    /// Batches posted and polled.
    pub iterations: u64,
    /// Inside the benchmark's `poll_batch`.
    pub poll: Count,
    /// Poll calls (the benchmark's own count).
    pub polls: u64,
    /// Poll calls that found nothing.
    pub empty_polls: u64,
}

impl BatchRow {
    /// Completions polled.
    pub fn completions(&self) -> u64 {
        self.iterations * self.batch
    }

    /// `v` per completion.
    pub fn per_completion(&self, v: u64) -> f64 {
        v as f64 / self.completions().max(1) as f64
    }
}

/// Reads the batch script's output into rows ([`BATCH_LEVELS`] × [`BATCHES`], in that order);
/// a (level, B) without a dump is missing. Also the problems: failed runs, missing or empty
/// counts.
pub fn parse_batch_output(out: &str) -> (Vec<BatchRow>, Vec<String>) {
    let mut rows: Vec<BatchRow> = Vec::new();
    let mut problems = Vec::new();
    // "post_poll batch: L: I iterations of B completion(s), P polls (E empty)".
    for Section { level, what, polls, dumps } in sections(out, "post_poll batch: ", [6, 8, 10], &mut problems)
    {
        if what != "batch" {
            continue;
        }
        for (part, count) in dumps {
            let Some(&batch) = (part as usize).checked_sub(1).and_then(|i| BATCHES.get(i)) else {
                continue;
            };
            let (p, e) = polls.get(&batch).copied().unwrap_or((0, 0));
            rows.retain(|r| !(r.level == level && r.batch == batch));
            rows.push(BatchRow {
                level: level.clone(),
                batch,
                iterations: BATCH_ITERS,
                poll: count,
                polls: p,
                empty_polls: e,
            });
        }
    }
    rows.sort_by_key(|r| {
        (BATCH_LEVELS.iter().position(|(l, _)| *l == r.level).unwrap_or(BATCH_LEVELS.len()), r.batch)
    });
    for (level, _) in BATCH_LEVELS {
        for batch in BATCHES {
            match rows.iter().find(|r| r.level == level && r.batch == batch) {
                None => problems.push(format!("{level}, batch {batch}: no counts")),
                Some(r) if r.poll.total == 0 => {
                    problems.push(format!("{level}, batch {batch}: counted nothing"))
                }
                Some(r) if r.polls == 0 => problems.push(format!("{level}, batch {batch}: no summary line")),
                Some(_) => {}
            }
        }
    }
    (rows, problems)
}

/// The Markdown table "instructions per completion vs batch size": one row per B, per level
/// the count incl. the provider and ours, then the empty polls of each level.
pub fn batch_table(rows: &[BatchRow]) -> String {
    let mut out = String::from("| B |");
    let mut rule = String::from("|---|");
    for (_, name) in BATCH_LEVELS {
        let _ = write!(out, " {name}, incl. provider | {name}, ours |");
        rule.push_str("---|---|");
    }
    let names: Vec<&str> = BATCH_LEVELS.iter().map(|(_, n)| *n).collect();
    let _ = writeln!(out, " empty polls ({}) |", names.join(" / "));
    rule.push_str("---|");
    out.push_str(&rule);
    out.push('\n');
    let mut batches: Vec<u64> = rows.iter().map(|r| r.batch).collect();
    batches.sort_unstable();
    batches.dedup();
    for b in batches {
        let _ = write!(out, "| {b} |");
        let mut empty = Vec::new();
        for (level, _) in BATCH_LEVELS {
            match rows.iter().find(|r| r.level == level && r.batch == b) {
                Some(r) => {
                    let _ = write!(
                        out,
                        " {:.1} | {:.1} |",
                        r.per_completion(r.poll.total),
                        r.per_completion(r.poll.ours())
                    );
                    empty.push(format!("{}/{}", r.empty_polls, r.polls));
                }
                None => {
                    out.push_str(" - | - |");
                    empty.push("-".into());
                }
            }
        }
        let _ = writeln!(out, " {} |", empty.join(" · "));
    }
    out
}

/// The plot of [`batch_table`]: instructions per completion by batch size (log2 x axis), one
/// solid line per level of the total (incl. the provider) and a dashed one of ours in the same
/// colour; the styles to pass to [`Chart::svg_styled`](crate::plot::Chart::svg_styled).
pub fn batch_chart(rows: &[BatchRow]) -> (crate::plot::Chart, Vec<(usize, usize)>) {
    let mut series = Vec::new();
    let mut styles = Vec::new();
    for (i, (level, name)) in BATCH_LEVELS.iter().enumerate() {
        let of = |f: &dyn Fn(&BatchRow) -> u64| -> Vec<(f64, f64)> {
            rows.iter()
                .filter(|r| r.level == *level)
                .map(|r| (r.batch as f64, r.per_completion(f(r))))
                .collect()
        };
        series.push(crate::plot::Series { name: format!("{name}, total"), points: of(&|r| r.poll.total) });
        styles.push((i, 0));
        series.push(crate::plot::Series { name: format!("{name}, ours"), points: of(&|r| r.poll.ours()) });
        styles.push((i, 1));
    }
    let chart = crate::plot::Chart {
        title: "poll: instructions per completion by batch size (SoftRoCE)".into(),
        x_label: "completions per poll call (B)".into(),
        y_label: "user-space instructions per completion (callgrind Ir)".into(),
        x_log2: true,
        y_log10: false,
        series,
    };
    (chart, styles)
}

/// The rows as JSON (an object with the method and one entry per row, raw counts included),
/// with the batch run's rows as `poll_batch`.
pub fn json(rows: &[Row], batch: &[BatchRow], commit: &str, date: &str) -> String {
    let mut out = String::from("{\n");
    let _ = writeln!(out, "  \"commit\": \"{}\",", commit.replace(['"', '\\'], ""));
    let _ = writeln!(out, "  \"date\": \"{}\",", date.replace(['"', '\\'], ""));
    out.push_str(
        "  \"method\": \"callgrind Ir in the VM, benches/post_poll.rs (8-byte RDMA Writes on a loopback RC pair; inline except the prepared level), post and poll toggled apart; provider = inclusive cost of calls into the provider library; ours = total - provider\",\n  \"rows\": [\n",
    );
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            out,
            "    {{\"level\": \"{}\", \"wrs_per_post\": {}, \"iterations\": {}, \"post_total\": {}, \"post_provider\": {}, \"poll_total\": {}, \"poll_provider\": {}, \"polls\": {}, \"empty_polls\": {}, \"per_wr\": {{\"post_total\": {:.1}, \"post_ours\": {:.1}, \"poll_total\": {:.1}, \"poll_ours\": {:.1}}}}}{}",
            r.level,
            r.wrs,
            r.iterations,
            r.post.total,
            r.post.provider,
            r.poll.total,
            r.poll.provider,
            r.polls,
            r.empty_polls,
            r.per_wr(r.post.total),
            r.per_wr(r.post.ours()),
            r.per_wr(r.poll.total),
            r.per_wr(r.poll.ours()),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    out.push_str("  ],\n");
    out.push_str(
        "  \"poll_batch_method\": \"callgrind Ir in the VM, benches/post_poll.rs POST_POLL_BATCH: per batch size B, 50 chains of B signaled 8-byte RDMA Writes (ffi, unsafe: inline, post_send_unchecked; safe: post_prepared_chain, tracked), each polled after 2 ms until its B completions are in, one poll call with room for B at a time; collected inside poll_batch only; per_completion = count / (iterations * B)\",\n  \"poll_batch\": [\n",
    );
    for (i, r) in batch.iter().enumerate() {
        let _ = writeln!(
            out,
            "    {{\"level\": \"{}\", \"batch\": {}, \"iterations\": {}, \"completions\": {}, \"poll_total\": {}, \"poll_provider\": {}, \"polls\": {}, \"empty_polls\": {}, \"per_completion\": {{\"total\": {:.1}, \"provider\": {:.1}, \"ours\": {:.1}}}}}{}",
            r.level,
            r.batch,
            r.iterations,
            r.completions(),
            r.poll.total,
            r.poll.provider,
            r.polls,
            r.empty_polls,
            r.per_completion(r.poll.total),
            r.per_completion(r.poll.provider),
            r.per_completion(r.poll.ours()),
            if i + 1 < batch.len() { "," } else { "" }
        );
    }
    out.push_str("  ]\n}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const DUMP: &str = "# callgrind format\nversion: 1\npart: 2\npositions: line\nevents: Ir\nsummary: 1000\n\n\
ob=(24) /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so\nfl=(265) ???\nfn=(3584) 0x0000000000003cc0\n0 480\n\
cob=(3) /usr/lib/x86_64-linux-gnu/libc.so.6\ncfi=(279) x.S\ncfn=(3594) write\ncalls=20 22 \n0 80\n0 20\n\n\
ob=(10) /work/target/release/deps/post_poll-1\nfl=(181) ???\nfn=(3578) post_poll::post\n0 100\n\
cob=(3)\ncfi=(169)\ncfn=(722) memcpy\ncalls=20 264 \n0 30\n\
cfn=(3712) ibverbs::engine\ncalls=20 0 \n0 800\n\
fn=(3712)\n0 100\ncob=(24)\ncfi=(265)\ncfn=(3584)\ncalls=20 0 \n+2 580\n0 20\n\ntotals: 1000\n";

    #[test]
    fn a_dump_splits_into_ours_and_the_providers() {
        let (part, c) = parse_dump(DUMP);
        assert_eq!(part, 2);
        assert_eq!(c, Count { total: 1000, provider: 580 });
        assert_eq!(c.ours(), 420);
        assert!(is_provider("/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so"));
        assert!(is_provider("/usr/lib/x86_64-linux-gnu/libmlx5.so.1.24"));
        assert!(!is_provider("/usr/lib/x86_64-linux-gnu/libibverbs.so.1"));
    }

    #[test]
    fn the_output_becomes_rows_a_table_and_json() {
        let part1 = DUMP.replace("part: 2", "part: 1");
        let mut out = String::new();
        for (level, _) in LEVELS {
            for what in ["post", "poll"] {
                out.push_str(&format!("@@cg level={level} what={what}\n"));
                out.push_str(&format!(
                    "post_poll: {level}: 200 iterations of 1 request(s), 201 polls (1 empty)\n"
                ));
                out.push_str(&format!(
                    "post_poll: {level}: 20 iterations of 32 request(s), 20 polls (0 empty)\n"
                ));
                out.push_str(&format!("@@file\n{part1}@@file\n{DUMP}@@end\n"));
            }
        }
        let (rows, problems) = parse_output(&out);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(rows.len(), 8);
        assert_eq!(
            (rows[0].level.as_str(), rows[0].wrs, rows[0].polls, rows[0].empty_polls),
            ("Ffi", 1, 201, 1)
        );
        assert_eq!((rows[1].wrs, rows[1].iterations), (32, 20));
        let t = table(&rows);
        // 420 ours over 200 posts, twice (post and poll): 2.1 + 2.1.
        assert!(
            t.contains("| raw ffi (ibv_post_send / ibv_poll_cq) | 1 | 5.0 | 2.1 | 5.0 | 2.1 | 4.2 | +0.0 |"),
            "{t}"
        );
        let j = json(&rows, &[], "abc", "2026-11-30");
        assert!(crate::json::parse(&j).is_ok(), "{j}");

        let (_, problems) = parse_output("@@cg level=Safe what=post\n@@failed\n@@end\n");
        assert!(problems.iter().any(|p| p.contains("failed")), "{problems:?}");
        assert!(problems.iter().any(|p| p.contains("Ffi, 1 WR(s) per post: no counts")), "{problems:?}");
    }

    /// The batch script's output with `DUMP` (1000 total, 580 provider) as every dump.
    fn batch_output() -> String {
        let mut out = String::new();
        for (level, _) in BATCH_LEVELS {
            out.push_str(&format!("@@cg level={level} what=batch\n"));
            for (i, b) in BATCHES.iter().enumerate() {
                let empty = u64::from(level == "Safe");
                out.push_str(&format!(
                    "post_poll batch: {level}: 50 iterations of {b} completion(s), {} polls ({empty} empty)\n",
                    50 + empty
                ));
                out.push_str(&format!("@@file\n{}", DUMP.replace("part: 2", &format!("part: {}", i + 1))));
            }
            // The dump at exit (no run_batch call): ignored.
            out.push_str(&format!("@@file\n{}@@end\n", DUMP.replace("part: 2", "part: 7")));
        }
        out
    }

    #[test]
    fn the_batch_output_becomes_rows_a_table_json_and_a_chart() {
        let (rows, problems) = parse_batch_output(&batch_output());
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(rows.len(), 18);
        assert_eq!((rows[0].level.as_str(), rows[0].batch, rows[0].polls), ("Ffi", 1, 50));
        assert_eq!((rows[5].batch, rows[5].completions()), (32, 1600));
        assert_eq!((rows[12].level.as_str(), rows[12].empty_polls, rows[12].polls), ("Safe", 1, 51));
        let t = batch_table(&rows);
        assert!(t.starts_with("| B | ffi, incl. provider | ffi, ours | unsafe, incl. provider |"), "{t}");
        // 1000 total, 420 ours over 50 completions (B = 1) and over 400 (B = 8).
        assert!(t.contains("| 1 | 20.0 | 8.4 | 20.0 | 8.4 | 20.0 | 8.4 | 0/50 · 0/50 · 1/51 |"), "{t}");
        assert!(t.contains("| 8 | 2.5 | 1.1 | 2.5 | 1.1 | 2.5 | 1.1 |"), "{t}");
        assert_eq!(t.lines().count(), 2 + 6);
        let j = json(&[], &rows, "abc", "2026-11-30");
        let v = crate::json::parse(&j).unwrap_or_else(|e| panic!("{e}: {j}"));
        assert_eq!(v.get("rows").and_then(|r| r.as_array()).map(<[_]>::len), Some(0));
        let batch = v.get("poll_batch").and_then(|r| r.as_array()).expect("poll_batch");
        assert_eq!(batch.len(), 18);
        assert!(
            j.contains("\"level\": \"Unsafe\", \"batch\": 4, \"iterations\": 50, \"completions\": 200"),
            "{j}"
        );
        let (chart, styles) = batch_chart(&rows);
        assert_eq!(chart.series.len(), 6);
        assert_eq!(styles, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]);
        assert_eq!(chart.series[1].name, "ffi, ours");
        assert_eq!(chart.series[1].points[3], (8.0, 1.05));
        let svg = chart.svg_styled(&styles);
        assert_eq!(svg.matches("<polyline").count(), 6);
        assert!(svg.contains(">32<"), "log2 x labels");

        let (rows, problems) = parse_batch_output("@@cg level=Ffi what=batch\n@@failed\n@@end\n");
        assert!(rows.is_empty());
        assert!(problems.iter().any(|p| p.contains("Ffi batch: callgrind run failed")), "{problems:?}");
        assert!(problems.iter().any(|p| p.contains("Safe, batch 32: no counts")), "{problems:?}");
    }
}
