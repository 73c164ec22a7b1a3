//! `cargo xtask bench --callgrind` (and the last step of `cargo xtask bench`): user-space
//! instructions per work request of the post/poll micro-benchmark (`benches/post_poll.rs`),
//! counted by callgrind in the VM, at four levels (raw `ffi`, the `unsafe` level, the safe
//! one-shot `post_send(_chain)`, the safe prepared `post_prepared(_chain)`), for single posts
//! and chains of 32.
//!
//! Each level runs twice under callgrind (`POST_POLL_ONLY=<level>`: 200 single posts, then 20
//! chains of 32): once collecting only inside the benchmark's `post` function, once only inside
//! `poll` (`--collect-atstart=no --toggle-collect`), with a dump after each `run` call, so that
//! each dump holds one (level, chain length, post or poll) count. A count is split into the
//! provider's share (the inclusive cost of every call from outside the provider library into it:
//! its `post_send`/`poll_cq` and whatever they call, e.g. the doorbell's `write`) and *ours* (the
//! rest: the benchmark's own loop, this crate, the C shim, the `memcpy`s they call).

use std::fmt::Write as _;

/// The levels, as `POST_POLL_ONLY` names them, and how the table names them.
pub const LEVELS: [(&str, &str); 4] = [
    ("Ffi", "raw ffi (ibv_post_send / ibv_poll_cq)"),
    ("Unsafe", "unsafe (post_send_unchecked / poll_raw)"),
    ("Safe", "safe one-shot (post_send(_chain) / poll)"),
    ("Prepared", "safe prepared (post_prepared(_chain) / poll)"),
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

/// Reads the guest script's output into rows (levels × shapes, in [`LEVELS`] order); a level
/// whose run failed or printed no dump is missing. Also the failures' descriptions.
pub fn parse_output(out: &str) -> (Vec<Row>, Vec<String>) {
    let mut rows: Vec<Row> = Vec::new();
    let mut problems = Vec::new();
    let mut sections = out.split("@@cg ").skip(1);
    for section in sections.by_ref() {
        let header = section.lines().next().unwrap_or("");
        let field =
            |k: &str| header.split_whitespace().find_map(|f| f.strip_prefix(k)).unwrap_or("").to_string();
        let (level, what) = (field("level="), field("what="));
        if section.lines().any(|l| l == "@@failed") {
            problems.push(format!("{level} {what}: callgrind run failed"));
        }
        // The benchmark's summary lines: "post_poll: L: I iterations of N request(s), P polls (E empty)".
        let mut polls = std::collections::HashMap::new();
        for l in section.lines().filter(|l| l.starts_with("post_poll: ")) {
            let words: Vec<&str> = l.split_whitespace().collect();
            let num = |i: usize| {
                words.get(i).map(|w| w.trim_start_matches('(')).and_then(|w| w.parse::<u64>().ok())
            };
            if let (Some(n), Some(p), Some(e)) = (num(5), num(7), num(9)) {
                polls.insert(n, (p, e));
            }
        }
        let body = section.split("@@end").next().unwrap_or("");
        for file in body.split("@@file").skip(1) {
            let (part, count) = parse_dump(file);
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

/// The rows as JSON (an object with the method and one entry per row, raw counts included).
pub fn json(rows: &[Row], commit: &str, date: &str) -> String {
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
        let j = json(&rows, "abc", "2026-11-30");
        assert!(crate::json::parse(&j).is_ok(), "{j}");

        let (_, problems) = parse_output("@@cg level=Safe what=post\n@@failed\n@@end\n");
        assert!(problems.iter().any(|p| p.contains("failed")), "{problems:?}");
        assert!(problems.iter().any(|p| p.contains("Ffi, 1 WR(s) per post: no counts")), "{problems:?}");
    }
}
