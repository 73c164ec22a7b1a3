//! Prerequisites: the Debian packages the commands need (the list is `xtask/packages.txt`, shared with
//! `.ci/run`), installed without removing anything the user has; and whether this host has an RDMA device.
//!
//! # Installing without removing
//! `apt-get install` may remove installed packages to satisfy a `Breaks`/`Conflicts`. Example: an image
//! with `qemu-utils` 10.0 from bookworm-backports (`Breaks: qemu-system-common (<< 1:8.0+dfsg-5~)`) loses
//! it when Debian 12's `qemu-system-x86` 7.2 comes in, since that depends on `qemu-system-common (= 7.2)`.
//! So the missing packages are first installed in simulation (`apt-get -s`). If that would remove a
//! package, the packages to install that come from the same source package are asked for from the apt
//! suite that offers the installed version (`qemu-system-x86/bookworm-backports`), and simulated again.
//! If no such set exists because the installed version's backports suite is not among the apt
//! sources (a brand-new machine of CI's kind: its image carries `qemu-utils` from
//! bookworm-backports without the source), xtask says so, adds that suite
//! (`/etc/apt/sources.list.d/rdma-verbs-<suite>.sources`, at the mirror the machine already uses;
//! apt gives backports priority 100, so nothing else comes from it unless named), runs
//! `apt-get update` and plans again. If no set exists even then, nothing is installed and the error
//! explains why and what to do. The real install runs with `--no-remove` on top. The planner's tests
//! replay a brand-new machine's recorded apt answers (`xtask/fixtures/apt/`).
//!
//! apt honours `APT_CONFIG`, and the installed-package check reads the status file apt's configuration
//! names, so a simulated system (another status file and source list) can be examined end to end with
//! `APT_CONFIG=... cargo xtask deps --dry-run`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::process;

/// The package list: `package group...` lines, `#` comments.
pub const PACKAGES_TXT: &str = include_str!("../packages.txt");

/// What a package is needed for (the groups of `packages.txt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// Building the workspace.
    Build,
    /// The SoftRoCE VM harness.
    Vm,
    /// Running on a host's own RDMA device.
    Device,
    /// The valgrind pass of `cargo xtask test`.
    Valgrind,
    /// Building the soft-iWARP module (`--device siw`); see [`siw_packages`].
    Siw,
}

impl Group {
    /// Every group.
    pub const ALL: [Group; 5] = [Group::Build, Group::Vm, Group::Device, Group::Valgrind, Group::Siw];

    /// Its name in `packages.txt`.
    pub fn name(self) -> &'static str {
        match self {
            Group::Build => "build",
            Group::Vm => "vm",
            Group::Device => "device",
            Group::Valgrind => "valgrind",
            Group::Siw => "siw",
        }
    }
}

/// Parses `packages.txt`: (package, groups) in file order. Fails on an unknown group or a package
/// without one.
pub fn parse_packages(text: &str) -> Result<Vec<(String, Vec<Group>)>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default();
        let mut words = line.split_whitespace();
        let Some(package) = words.next() else { continue };
        let groups = words
            .map(|w| {
                Group::ALL
                    .into_iter()
                    .find(|g| g.name() == w)
                    .ok_or(format!("line {}: unknown group `{w}`", n + 1))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if groups.is_empty() {
            return Err(format!("line {}: `{package}` has no group", n + 1));
        }
        out.push((package.to_string(), groups));
    }
    Ok(out)
}

/// The packages of `groups`, in the order of `packages.txt`, each once.
pub fn packages(groups: &[Group]) -> Vec<String> {
    let all = parse_packages(PACKAGES_TXT).expect("xtask/packages.txt is valid (a unit test checks it)");
    all.into_iter().filter(|(_, g)| g.iter().any(|g| groups.contains(g))).map(|(p, _)| p).collect()
}

/// The packages that building siw for kernel `version` needs: the `siw` group of `packages.txt`
/// (the kernel's source) and the headers of that very kernel, `linux-headers-<version>`.
pub fn siw_packages(version: &str) -> Vec<String> {
    let mut list = packages(&[Group::Siw]);
    list.push(format!("linux-headers-{version}"));
    list
}

/// Makes sure the packages of `groups` are installed (see [`ensure_packages`]).
pub fn ensure(groups: &[Group]) -> Result<(), String> {
    ensure_packages(&packages(groups), false, &[])
}

/// How long apt may take: `apt-get update`, one simulation or query, the real install.
const APT_UPDATE_LIMIT: Duration = Duration::from_secs(600);
const APT_QUERY_LIMIT: Duration = Duration::from_secs(120);
const APT_INSTALL_LIMIT: Duration = Duration::from_secs(1800);

/// Makes sure `packages` are installed. As root, installs the missing ones with apt-get (saying so) if
/// that removes nothing; otherwise prints the command to run (as planned, see the module's docs) and
/// fails. With `dry_run`, only shows the plan. Does nothing where there is no dpkg.
///
/// `allow_remove` names installed packages the install may remove when nothing else works (CI's
/// fresh machines: their image's backported `qemu-utils` against Debian 12's `qemu-system-x86`);
/// any other removal is still refused.
pub fn ensure_packages(packages: &[String], dry_run: bool, allow_remove: &[String]) -> Result<(), String> {
    if Command::new("dpkg-query").arg("--version").output().is_err() {
        eprintln!("xtask: no dpkg-query: not a Debian system, assuming {} are installed", packages.join(" "));
        return Ok(());
    }
    let missing = missing_packages(packages)?;
    if missing.is_empty() {
        if dry_run {
            eprintln!("xtask: all {} packages are installed: {}", packages.len(), packages.join(" "));
        }
        return Ok(());
    }
    let root = is_root();
    if root && !dry_run {
        eprintln!("xtask: missing Debian packages: {}; apt-get update ...", missing.join(" "));
        match apt(&["update", "-q"], APT_UPDATE_LIMIT, true) {
            Ok(r) if r.success() => {}
            Ok(r) => eprintln!(
                "xtask: warning: apt-get update failed ({}); going on with the lists we have",
                r.describe()
            ),
            Err(e) => return Err(e),
        }
    }
    let mut apt_now = SystemApt { stage: 0 };
    let mut planned = plan_install(&apt_now, &missing);
    let backports = match &planned {
        Err(Refusal { backports: Some(suite), message }) if root || dry_run => {
            Some((suite.clone(), message.clone()))
        }
        _ => None,
    };
    if let Some((suite, message)) = backports {
        // An installed backport is in the way and its suite is not configured: the matching
        // versions come from there. Adding the suite changes nothing else (apt gives a backports
        // suite priority 100: only what is asked from it by name, or already from it, comes from it).
        let uri = debian_mirror();
        eprintln!(
            "xtask: an installed package came from {suite}, which no apt source lists, and the packages \
             this project needs conflict with it in the default suite; the matching versions are in \
             {suite}. {} {} ({uri} {suite} main), then apt-get update, so as to take them from there \
             without removing anything.",
            if dry_run { "Would add" } else { "Adding" },
            backports_sources_path(&suite).display()
        );
        if dry_run {
            eprintln!("xtask: (dry run: the plan after that is not shown)\n{message}");
            return Ok(());
        }
        fs::write(backports_sources_path(&suite), backports_sources(&suite, &uri))
            .map_err(|e| format!("writing {}: {e}", backports_sources_path(&suite).display()))?;
        let r = apt(&["update", "-q"], APT_UPDATE_LIMIT, true)?;
        if !r.success() {
            return Err(format!("apt-get update after adding {suite} failed ({})", r.describe()));
        }
        apt_now.stage = 1;
        planned = plan_install(&apt_now, &missing);
    }
    let plan = match planned {
        Ok(plan) => plan,
        Err(e) if !allow_remove.is_empty() => {
            allowed_removal(&apt_now, &missing, allow_remove).ok_or(e.message)?
        }
        Err(e) => return Err(e.message),
    };
    if let Some(note) = &plan.note {
        eprintln!("xtask: {note}");
    }
    let no_remove = if plan.removes.is_empty() { " --no-remove" } else { "" };
    let line = format!("apt-get install -y --no-install-recommends{no_remove} {}", plan.args.join(" "));
    if dry_run {
        eprintln!("xtask: missing: {}\nxtask: would run: {line}\nxtask: which installs:", missing.join(" "));
        for inst in &plan.installs {
            eprintln!("    {inst}");
        }
        return Ok(());
    }
    if !root {
        return Err(format!(
            "missing Debian packages: {}\nInstall them with (removes nothing: checked by simulation):\n    sudo {line}",
            missing.join(" ")
        ));
    }
    eprintln!("xtask: installing: {line}");
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    if plan.removes.is_empty() {
        args.push("--no-remove");
    } else {
        eprintln!("xtask: removing {} (allowed by --allow-remove)", plan.removes.join(" "));
    }
    args.extend(plan.args.iter().map(String::as_str));
    let r = apt(&args, APT_INSTALL_LIMIT, true)?;
    if !r.success() {
        return Err(format!("`{line}` failed ({})", r.describe()));
    }
    if !plan.auto.is_empty() {
        // They were named only to take them from the suite: dependencies, not the user's choice.
        let mut mark = Command::new("apt-mark");
        mark.arg("auto").args(&plan.auto);
        let _ = process::run(&mut mark, APT_QUERY_LIMIT, false);
    }
    let still = missing_packages(packages)?;
    if !still.is_empty() {
        return Err(format!("`{line}` succeeded but these are still not installed: {}", still.join(" ")));
    }
    Ok(())
}

/// Runs `apt-get ARGS` non-interactively within `limit`, waiting (up to 5 minutes, within
/// `limit`) for dpkg's lock where another apt holds it, as apt-daily does on a freshly booted
/// machine: apt-get alone fails at once.
fn apt(args: &[&str], limit: Duration, show: bool) -> Result<process::Finished, String> {
    let mut cmd = Command::new("apt-get");
    cmd.args(["-o", "DPkg::Lock::Timeout=300"]).args(args).env("DEBIAN_FRONTEND", "noninteractive");
    process::run(&mut cmd, limit, show)
}

/// What the planner asks apt: the machine's apt, or (in tests) the recorded answers of another
/// machine, so that the planner's decisions on a real package state are tested without that state.
pub trait AptQuery {
    /// `apt-get -s -q install --no-install-recommends ARGS`, parsed.
    fn simulate(&self, args: &[String]) -> Result<Simulation, String>;
    /// `apt-cache ARGS`'s stdout (`policy PKG`, `show PKG[=VERSION]`).
    fn cache(&self, args: &[&str]) -> Result<String, String>;
}

/// The machine's own apt. With `XTASK_APT_RECORD=DIR`, every answer is also written to
/// `DIR/<stage>/<query>.txt` (stage 0 before xtask changes the apt sources, 1 after), the fixtures
/// that the planner's tests replay (`ReplayApt`, `xtask/fixtures/apt/`).
struct SystemApt {
    stage: u32,
}

/// The file name a query's answer is recorded under.
pub fn record_name(kind: &str, args: &[&str]) -> String {
    let mut name = kind.to_string();
    for a in args {
        name.push('_');
        name.extend(a.chars().map(|c| if c.is_ascii_alphanumeric() || "-.+".contains(c) { c } else { '_' }));
    }
    if name.len() > 120 {
        // Long argument lists: a prefix and a hash of the whole (FNV-1a), so that two lists that
        // share a long prefix do not share a file.
        let hash = name
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        name.truncate(100);
        name.push_str(&format!("-{hash:016x}"));
    }
    name + ".txt"
}

impl SystemApt {
    fn record(&self, kind: &str, args: &[&str], text: &str) {
        if let Some(dir) = std::env::var_os("XTASK_APT_RECORD") {
            let dir = PathBuf::from(dir).join(self.stage.to_string());
            let _ = fs::create_dir_all(&dir);
            let _ = fs::write(dir.join(record_name(kind, args)), text);
        }
    }
}

impl AptQuery for SystemApt {
    fn simulate(&self, args: &[String]) -> Result<Simulation, String> {
        let mut all = vec!["-s", "-q", "install", "--no-install-recommends"];
        all.extend(args.iter().map(String::as_str));
        let r = apt(&all, APT_QUERY_LIMIT, false)?;
        let text = format!("{}{}", r.stdout, r.stderr);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        self.record("simulate", &argv, &format!("{}\n{text}", if r.success() { "ok" } else { "failed" }));
        Ok(parse_simulation(r.success(), &text))
    }

    fn cache(&self, args: &[&str]) -> Result<String, String> {
        let r = process::run(Command::new("apt-cache").args(args), APT_QUERY_LIMIT, false)?;
        self.record("cache", args, &r.stdout);
        Ok(r.stdout)
    }
}

/// Recorded answers of another machine's apt (see [`SystemApt`]): a query with no recorded answer
/// is an error naming the file it would be in.
#[cfg(test)]
pub struct ReplayApt {
    dir: PathBuf,
}

#[cfg(test)]
impl ReplayApt {
    fn read(&self, name: &str) -> Result<String, String> {
        fs::read_to_string(self.dir.join(name)).map_err(|e| format!("{}: {e}", self.dir.join(name).display()))
    }
}

#[cfg(test)]
impl AptQuery for ReplayApt {
    fn simulate(&self, args: &[String]) -> Result<Simulation, String> {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let text = self.read(&record_name("simulate", &argv))?;
        let (status, rest) = text.split_once('\n').unwrap_or((&text, ""));
        Ok(parse_simulation(status == "ok", rest))
    }

    fn cache(&self, args: &[&str]) -> Result<String, String> {
        self.read(&record_name("cache", args))
    }
}

/// The dpkg database folder apt is configured with (`Dir::State::status`'s folder; honours `APT_CONFIG`).
fn dpkg_admindir() -> PathBuf {
    let out = Command::new("apt-config").args(["shell", "S", "Dir::State::status/f"]).output();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    let status =
        text.trim().strip_prefix("S='").and_then(|s| s.strip_suffix('\'')).unwrap_or("/var/lib/dpkg/status");
    Path::new(status).parent().unwrap_or(Path::new("/var/lib/dpkg")).to_path_buf()
}

/// The packages of `packages` that dpkg does not list as installed.
fn missing_packages(packages: &[String]) -> Result<Vec<String>, String> {
    let out = Command::new("dpkg-query")
        .arg(format!("--admindir={}", dpkg_admindir().display()))
        .args(["-W", "-f=${Package}\t${Status}\n"])
        .args(packages)
        .output()
        .map_err(|e| format!("running dpkg-query: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let installed: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .filter(|(_, status)| is_installed_status(status))
        .map(|(name, _)| name)
        .collect();
    Ok(packages.iter().filter(|p| !installed.contains(&p.as_str())).cloned().collect())
}

/// What `apt-get -s install` said.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Simulation {
    /// Whether apt-get exited 0.
    pub ok: bool,
    /// `Remv` lines: (package, installed version).
    pub removed: Vec<(String, String)>,
    /// `Inst` lines, as apt wrote them after `Inst `.
    pub installs: Vec<String>,
    /// Packages named on the left of apt's unmet-dependency lines (` pkg : Breaks: ...`).
    pub broken: Vec<String>,
    /// apt's explanation lines (unmet dependencies and `E:` lines).
    pub problems: Vec<String>,
}

impl Simulation {
    /// Whether the install would succeed without removing anything.
    pub fn clean(&self) -> bool {
        self.ok && self.removed.is_empty()
    }
}

/// A package name without its `:arch` suffix.
fn bare(name: &str) -> &str {
    name.split(':').next().unwrap_or(name)
}

/// Parses the output of `apt-get -s install ...`.
pub fn parse_simulation(ok: bool, text: &str) -> Simulation {
    let mut sim = Simulation { ok, ..Simulation::default() };
    let mut in_unmet = false;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Remv ") {
            let mut words = rest.split_whitespace();
            let name = bare(words.next().unwrap_or_default()).to_string();
            let version = words.next().unwrap_or_default().trim_matches(|c| c == '[' || c == ']').to_string();
            sim.removed.push((name, version));
        } else if let Some(rest) = line.strip_prefix("Inst ") {
            sim.installs.push(rest.to_string());
        } else if line.starts_with("The following packages have unmet dependencies") {
            in_unmet = true;
        } else if line.starts_with("E: ") {
            sim.problems.push(line.to_string());
        } else if in_unmet && line.starts_with(' ') {
            sim.problems.push(line.trim_end().to_string());
            if let Some((name, rest)) = line.trim_start().split_once(" : ") {
                let kind = rest.split(':').next().unwrap_or_default();
                if matches!(kind, "Breaks" | "Depends" | "PreDepends" | "Pre-Depends" | "Conflicts") {
                    let name = bare(name).to_string();
                    if !sim.broken.contains(&name) {
                        sim.broken.push(name);
                    }
                }
            }
        } else {
            in_unmet = false;
        }
    }
    sim
}

/// One version of a package in `apt-cache policy`: the version and the suites (`bookworm-backports`)
/// that offer it; `installed` for the one marked `***`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PolicyVersion {
    /// The version.
    pub version: String,
    /// Whether it is the installed one.
    pub installed: bool,
    /// The suites of the apt sources offering it (not `/var/lib/dpkg/status`).
    pub suites: Vec<String>,
}

/// Parses the version table of `apt-cache policy PACKAGE` (one package).
pub fn parse_policy(text: &str) -> Vec<PolicyVersion> {
    let mut versions: Vec<PolicyVersion> = Vec::new();
    let mut in_table = false;
    for line in text.lines() {
        if line.trim() == "Version table:" {
            in_table = true;
            continue;
        }
        if !in_table || line.trim().is_empty() {
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let words: Vec<&str> = line.split_whitespace().collect();
        if indent >= 8 {
            // `PRIO URL SUITE/COMPONENT ARCH Packages`, or `PRIO /var/lib/dpkg/status`.
            if let (Some(v), Some(dist)) = (versions.last_mut(), words.get(2)) {
                if let Some(suite) = dist.split('/').next().filter(|s| !s.is_empty() && *s != ".") {
                    if !v.suites.iter().any(|s| s == suite) {
                        v.suites.push(suite.to_string());
                    }
                }
            }
        } else {
            let installed = words.first() == Some(&"***");
            let version = if installed { words.get(1) } else { words.first() };
            versions.push(PolicyVersion {
                version: version.copied().unwrap_or_default().to_string(),
                installed,
                suites: Vec::new(),
            });
        }
    }
    versions
}

/// The `Source:` of the first stanza of `apt-cache show` output (the package's own name if none).
pub fn parse_source(show: &str, package: &str) -> String {
    let stanza = show.split("\n\n").next().unwrap_or_default();
    stanza
        .lines()
        .find_map(|l| l.strip_prefix("Source: "))
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or(package)
        .to_string()
}

/// The value of `field` in the first stanza of `apt-cache show` output.
fn stanza_field(show: &str, field: &str) -> Option<String> {
    let stanza = show.split("\n\n").next().unwrap_or_default();
    let prefix = format!("{field}: ");
    stanza.lines().find_map(|l| l.strip_prefix(prefix.as_str())).map(str::to_string)
}

/// What to ask apt-get for.
#[derive(Debug)]
struct Plan {
    /// The arguments after `install`: package names, some as `name/suite`.
    args: Vec<String>,
    /// Dependencies named in `args` only to take them from a suite: marked automatic afterwards.
    auto: Vec<String>,
    /// What the simulation said would be installed.
    installs: Vec<String>,
    /// Why some come from another suite.
    note: Option<String>,
    /// Installed packages the install removes (only those named by `--allow-remove`).
    removes: Vec<String>,
}

/// A plan that removes installed packages, if apt's simulation removes only packages named in
/// `allowed` (and would otherwise succeed).
fn allowed_removal(apt: &dyn AptQuery, missing: &[String], allowed: &[String]) -> Option<Plan> {
    let sim = apt.simulate(missing).ok()?;
    let only_allowed = sim.removed.iter().all(|(name, _)| allowed.contains(name));
    (sim.ok && !sim.removed.is_empty() && only_allowed).then(|| Plan {
        args: missing.to_vec(),
        auto: Vec::new(),
        note: Some(format!(
            "installing removes {} (allowed by --allow-remove)",
            sim.removed.iter().map(|(n, v)| format!("{n} {v}")).collect::<Vec<_>>().join(", ")
        )),
        removes: sim.removed.iter().map(|(n, _)| n.clone()).collect(),
        installs: sim.installs,
    })
}

/// The packages apt could not give the version another needs: `X` of `Depends: X (= V) but W is to be
/// installed` lines.
pub fn unmet_dependencies(problems: &[String]) -> Vec<String> {
    let mut names = Vec::new();
    for line in problems {
        for part in line.split("Depends: ").skip(1) {
            let name = bare(part.split_whitespace().next().unwrap_or_default()).to_string();
            if !name.is_empty() && !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names
}

/// Whether some version of `package` comes from `suite`.
fn offered_by(apt: &dyn AptQuery, package: &str, suite: &str) -> Result<bool, String> {
    Ok(parse_policy(&apt.cache(&["policy", package])?).iter().any(|v| v.suites.iter().any(|s| s == suite)))
}

/// How many rounds of "take the unmet dependencies from the suite too" a plan may try.
const PIN_ROUNDS: usize = 10;

/// Plans the install of `missing` so that nothing installed is removed (see the module's docs).
fn plan_install(apt: &dyn AptQuery, missing: &[String]) -> Result<Plan, Refusal> {
    let sim = apt.simulate(missing)?;
    if sim.clean() {
        return Ok(Plan {
            args: missing.to_vec(),
            auto: Vec::new(),
            installs: sim.installs,
            note: None,
            removes: Vec::new(),
        });
    }
    // The installed packages in the way, with their installed version.
    let mut culprits: Vec<(String, String)> = sim.removed.clone();
    for name in &sim.broken {
        if culprits.iter().any(|(c, _)| c == name) {
            continue;
        }
        if let Some(v) = parse_policy(&apt.cache(&["policy", name])?).into_iter().find(|v| v.installed) {
            culprits.push((name.clone(), v.version));
        }
    }
    let mut explained = Vec::new();
    let mut tried = Vec::new();
    // A culprit whose installed `~bpo` version no configured source offers: its backports suite.
    let mut unconfigured_backports = None;
    for (culprit, version) in &culprits {
        let policy = parse_policy(&apt.cache(&["policy", culprit])?);
        // One version may be listed twice (the installed copy apart from a source's when they differ).
        let mut suites: Vec<String> = Vec::new();
        for v in policy.iter().filter(|v| &v.version == version) {
            suites.extend(v.suites.iter().filter(|s| !suites.contains(s)).cloned().collect::<Vec<_>>());
        }
        let show = apt.cache(&["show", &format!("{culprit}={version}")])?;
        let source = parse_source(&show, culprit);
        let mut why: Vec<String> = ["Breaks", "Conflicts"]
            .iter()
            .filter_map(|f| stanza_field(&show, f).map(|v| format!("{f}: {v}")))
            .collect();
        if why.is_empty() {
            why.push("see apt's messages below".into());
        }
        if suites.is_empty() && unconfigured_backports.is_none() {
            unconfigured_backports = backports_hint(version);
        }
        let from = if suites.is_empty() { "no configured apt source".to_string() } else { suites.join(", ") };
        explained
            .push(format!("  {culprit} {version} ({}; this version offered by: {from})", why.join("; ")));
        for suite in &suites {
            // The missing packages built from the culprit's source package come from its suite, and
            // then whatever dependencies apt says they need from there.
            let mut pinned = Vec::new();
            for p in missing {
                if parse_source(&apt.cache(&["show", p])?, p) == source && offered_by(apt, p, suite)? {
                    pinned.push(p.clone());
                }
            }
            if pinned.is_empty() {
                continue;
            }
            let mut deps: Vec<String> = Vec::new();
            for _ in 0..PIN_ROUNDS {
                let mut args: Vec<String> = missing
                    .iter()
                    .map(|p| if pinned.contains(p) { format!("{p}/{suite}") } else { p.clone() })
                    .collect();
                args.extend(deps.iter().map(|d| format!("{d}/{suite}")));
                let again = apt.simulate(&args)?;
                if again.clean() {
                    let note = format!(
                        "taking {} from {suite}: from the default suite, the install would remove {culprit} {version}",
                        pinned.iter().chain(&deps).cloned().collect::<Vec<_>>().join(" ")
                    );
                    return Ok(Plan {
                        args,
                        auto: deps,
                        installs: again.installs,
                        note: Some(note),
                        removes: Vec::new(),
                    });
                }
                let mut more = Vec::new();
                for d in unmet_dependencies(&again.problems) {
                    if !deps.contains(&d) && !pinned.contains(&d) && offered_by(apt, &d, suite)? {
                        more.push(d);
                    }
                }
                if more.is_empty() {
                    tried.push(format!(
                        "asking for {} from {suite} did not work either; apt said:\n{}",
                        pinned.iter().chain(&deps).cloned().collect::<Vec<_>>().join(" "),
                        again.problems.join("\n")
                    ));
                    break;
                }
                deps.extend(more);
            }
        }
    }
    let mut msg = format!(
        "installing {} would remove installed packages, and no set of the configured apt sources keeps \
         them:\n{}\n",
        missing.join(" "),
        explained.join("\n")
    );
    if !sim.problems.is_empty() {
        msg.push_str(&format!("apt said:\n{}\n", sim.problems.join("\n")));
    }
    for t in &tried {
        msg.push_str(t);
        msg.push('\n');
    }
    msg.push_str("Nothing was installed or removed. Either make the matching versions installable");
    if let Some(hint) = culprits.iter().find_map(|(_, v)| backports_hint(v)) {
        msg.push_str(&format!(
            " (a `~bpo` version comes from backports: add `deb http://deb.debian.org/debian {hint} main` to \
             the apt sources and run `apt-get update`; then this installs the matching packages from {hint}; \
             as root, `cargo xtask deps` does that itself)"
        ));
    }
    msg.push_str(&format!(
        ", or accept the removal by installing them yourself:\n    sudo apt-get install --no-install-recommends {}",
        missing.join(" ")
    ));
    Err(Refusal { message: msg, backports: unconfigured_backports })
}

/// Why [`plan_install`] found no plan.
#[derive(Debug)]
struct Refusal {
    /// What to tell the user.
    message: String,
    /// The backports suite an installed package in the way came from, when no configured apt source
    /// offers it: adding that suite may give a plan.
    backports: Option<String>,
}

impl From<String> for Refusal {
    fn from(message: String) -> Self {
        Refusal { message, backports: None }
    }
}

/// The backports suite a `~bpoNN` version comes from (`~bpo12+1` → `bookworm-backports`).
pub fn backports_hint(version: &str) -> Option<String> {
    let n = version.split("~bpo").nth(1)?;
    let release: String = n.chars().take_while(char::is_ascii_digit).collect();
    let codename = match release.as_str() {
        "10" => "buster",
        "11" => "bullseye",
        "12" => "bookworm",
        "13" => "trixie",
        "14" => "forky",
        _ => return None,
    };
    Some(format!("{codename}-backports"))
}

/// Where `cargo xtask deps` writes the apt source of a backports suite it adds.
fn backports_sources_path(suite: &str) -> PathBuf {
    PathBuf::from(format!("/etc/apt/sources.list.d/rdma-verbs-{suite}.sources"))
}

/// The deb822 apt source of `suite` at `uri`, signed by Debian's archive keyring.
pub fn backports_sources(suite: &str, uri: &str) -> String {
    format!(
        "# Added by `cargo xtask deps` (rdma-verbs): an installed package came from {suite} and the\n\
         # harness's packages must match it (docs/harness.md). apt gives this suite priority 100, so\n\
         # nothing else is taken from it unless asked for by name. Remove this file to undo.\n\
         Types: deb\nURIs: {uri}\nSuites: {suite}\nComponents: main\n\
         Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
}

/// The Debian mirror this machine's apt sources already use (the first `URIs:`/`deb` address that
/// is not a security mirror), else deb.debian.org.
fn debian_mirror() -> String {
    let mut texts = Vec::new();
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut paths: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        texts.extend(paths.iter().filter_map(|p| fs::read_to_string(p).ok()));
    }
    texts.extend(fs::read_to_string("/etc/apt/sources.list").ok());
    texts.iter().find_map(|t| mirror_in(t)).unwrap_or_else(|| "http://deb.debian.org/debian".to_string())
}

/// The first Debian (not security) mirror address named in an apt source file's text.
pub fn mirror_in(text: &str) -> Option<String> {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| {
            // One-line sources may carry `[options]`, which may hold spaces.
            let l = match (l.find('['), l.find(']')) {
                (Some(a), Some(b)) if a < b => format!("{}{}", &l[..a], &l[b + 1..]),
                _ => l.to_string(),
            };
            let words: Vec<&str> = l.split_whitespace().collect();
            match words.first() {
                Some(&"URIs:") => words[1..].iter().map(|w| w.to_string()).collect(),
                Some(&"deb") => words.iter().skip(1).take(1).map(|w| w.to_string()).collect(),
                _ => Vec::new(),
            }
        })
        .find(|u: &String| u.ends_with("/debian") || u.ends_with("/debian/"))
        .map(|u| u.trim_end_matches('/').to_string())
}

/// Whether a `dpkg-query -f '${Status}'` answer means "installed".
pub fn is_installed_status(status: &str) -> bool {
    status.trim() == "install ok installed"
}

/// Whether we run as root.
fn is_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// An RDMA device of the host with an ACTIVE port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDevice {
    /// Its name (`/sys/class/infiniband/<name>`).
    pub name: String,
    /// The index of its RoCE v2 IPv4-mapped GID on the active port, if it has one.
    pub gid_index: Option<u32>,
    /// The IPv4 address of that GID, for RDMA-CM.
    pub ipv4: Option<String>,
}

/// The first RDMA device of this host that has an ACTIVE port, if any.
pub fn host_device() -> Option<HostDevice> {
    host_device_in(Path::new("/sys/class/infiniband"))
}

/// [`host_device`] over a sysfs tree rooted at `class` (for tests).
pub fn host_device_in(class: &Path) -> Option<HostDevice> {
    let mut devices: Vec<_> = fs::read_dir(class).ok()?.flatten().map(|e| e.path()).collect();
    devices.sort();
    for device in devices {
        let Ok(ports) = fs::read_dir(device.join("ports")) else { continue };
        let mut ports: Vec<_> = ports.flatten().map(|e| e.path()).collect();
        ports.sort();
        for port in ports {
            let state = fs::read_to_string(port.join("state")).unwrap_or_default();
            if !state.contains("ACTIVE") {
                continue;
            }
            let name = device.file_name()?.to_string_lossy().into_owned();
            let (gid_index, ipv4) = match roce_v2_ipv4_gid(&port) {
                Some((index, ip)) => (Some(index), Some(ip)),
                None => (None, None),
            };
            return Some(HostDevice { name, gid_index, ipv4 });
        }
    }
    None
}

/// The lowest GID index of `port` whose type is RoCE v2 and whose GID is IPv4-mapped, with the address.
fn roce_v2_ipv4_gid(port: &Path) -> Option<(u32, String)> {
    let types = fs::read_dir(port.join("gid_attrs/types")).ok()?;
    let mut indices: Vec<u32> =
        types.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect();
    indices.sort_unstable();
    indices.into_iter().find_map(|i| {
        let kind = fs::read_to_string(port.join(format!("gid_attrs/types/{i}"))).ok()?;
        if kind.trim() != "RoCE v2" {
            return None;
        }
        let gid = fs::read_to_string(port.join(format!("gids/{i}"))).ok()?;
        Some((i, ipv4_of_gid(gid.trim())?))
    })
}

/// The IPv4 address of an IPv4-mapped GID as sysfs writes it (`0000:0000:0000:0000:0000:ffff:c000:0201`).
pub fn ipv4_of_gid(gid: &str) -> Option<String> {
    let groups: Vec<u16> = gid.split(':').map(|g| u16::from_str_radix(g, 16).ok()).collect::<Option<_>>()?;
    if groups.len() != 8 || groups[..5].iter().any(|g| *g != 0) || groups[5] != 0xffff {
        return None;
    }
    let [a, b] = groups[6].to_be_bytes();
    let [c, d] = groups[7].to_be_bytes();
    Some(format!("{a}.{b}.{c}.{d}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_package_list_is_valid_and_grouped() {
        let all = parse_packages(PACKAGES_TXT).unwrap();
        assert!(all.len() >= 18);
        let build = packages(&[Group::Build]);
        for p in ["libibverbs-dev", "librdmacm-dev", "libclang-dev", "pkg-config", "build-essential"] {
            assert!(build.contains(&p.to_string()), "{p}");
        }
        assert!(packages(&[Group::Vm]).contains(&"qemu-system-x86".to_string()));
        assert!(!packages(&[Group::Device]).contains(&"qemu-system-x86".to_string()));
        assert!(packages(&[Group::Device]).contains(&"rdma-core".to_string()));
        assert_eq!(packages(&[Group::Valgrind]), ["valgrind"]);
        // Each package once, even when asked for through several groups.
        let every = packages(&Group::ALL);
        assert_eq!(every.len(), all.len());
        assert!(parse_packages("foo\n").is_err());
        assert!(parse_packages("foo bogus\n").is_err());
        assert_eq!(
            parse_packages("# c\n\nfoo build vm # why\n").unwrap(),
            [("foo".into(), vec![Group::Build, Group::Vm])]
        );
    }

    /// `apt-get -s install qemu-system-x86` on Debian 12 with qemu-utils 10.0 from bookworm-backports
    /// installed and no backports source (the real output, shortened).
    const SIM_REMOVES: &str = "\
The following packages will be REMOVED:
  qemu-utils
The following NEW packages will be installed:
  ipxe-qemu qemu-system-common qemu-system-data qemu-system-x86 seabios
0 upgraded, 5 newly installed, 1 to remove and 126 not upgraded.
Remv qemu-utils [1:10.0.2+ds-2+deb13u1~bpo12+1]
Inst ipxe-qemu (1.0.0+git-20190125.36a4c85-5.1 Debian:12.15/oldstable [all])
Inst qemu-system-common (1:7.2+dfsg-7+deb12u18+b3 Debian:12.15/oldstable [amd64])
Inst qemu-system-x86 (1:7.2+dfsg-7+deb12u18+b3 Debian:12.15/oldstable [amd64])
Conf qemu-system-x86 (1:7.2+dfsg-7+deb12u18+b3 Debian:12.15/oldstable [amd64])
";

    /// The same with a bookworm-backports source configured: apt gives up instead.
    const SIM_BROKEN: &str = "\
Some packages could not be installed. This may mean that you have
requested an impossible situation or if you are using the unstable
distribution that some required packages have not yet been created
or been moved out of Incoming.
The following information may help to resolve the situation:

The following packages have unmet dependencies:
 qemu-utils : Breaks: qemu-system-common (< 1:8.0+dfsg-5~) but 1:7.2+dfsg-7+deb12u18+b3 is to be installed
 qemu-system-x86 : Depends: qemu-system-common (= 1:10.0.2+ds-2+deb13u1~bpo12+1) but 1:7.2 is to be installed
                   Depends: seabios (> 1.16.3-1~) but 1.16.2-1 is to be installed
E: Error, pkgProblemResolver::Resolve generated breaks, this may be caused by held packages.
";

    fn fresh_machine(stage: u32) -> ReplayApt {
        ReplayApt {
            dir: Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/apt/fresh-debian12/{stage}")),
        }
    }

    /// What a brand-new machine installs for `cargo xtask demo`/`test` (every group but siw, whose
    /// kernel headers xtask adds later; the recording was of `cargo xtask deps`, less what the image
    /// already had).
    fn fresh_missing() -> Vec<String> {
        "libibverbs-dev librdmacm-dev libclang-dev qemu-system-x86 linux-image-amd64 busybox-static kmod cpio \
         rdma-core ibverbs-utils ibverbs-providers perftest rdmacm-utils linux-source-6.1"
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn fresh_machine_asks_for_the_backports_suite_of_its_qemu_utils() {
        // Recorded apt answers of a brand-new machine (fixtures/apt/fresh-debian12): Debian 12's
        // QEMU would remove the image's backported qemu-utils, and no source offers that version.
        let e = plan_install(&fresh_machine(0), &fresh_missing()).unwrap_err();
        assert_eq!(e.backports.as_deref(), Some("bookworm-backports"), "{}", e.message);
        assert!(e.message.contains("qemu-utils 1:10.0.2+ds-2+deb13u1~bpo12+1"), "{}", e.message);
        assert!(e.message.contains("Nothing was installed or removed"), "{}", e.message);
    }

    #[test]
    fn fresh_machine_with_backports_takes_the_matching_qemu_and_removes_nothing() {
        // Stage 1 was recorded once the kernel was known, so the siw group's headers are asked for too.
        let mut missing = fresh_missing();
        missing.push("linux-headers-6.1.0-57-amd64".into());
        let plan = plan_install(&fresh_machine(1), &missing).map_err(|e| e.message).unwrap();
        assert!(plan.removes.is_empty());
        assert!(plan.args.contains(&"qemu-system-x86/bookworm-backports".to_string()), "{:?}", plan.args);
        for p in fresh_missing().iter().filter(|p| *p != "qemu-system-x86") {
            assert!(plan.args.contains(p), "{p} asked for from the default suite: {:?}", plan.args);
        }
        // The dependencies taken from backports only to match are marked automatic afterwards.
        assert!(
            !plan.auto.is_empty()
                && plan.auto.iter().all(|d| d.starts_with("qemu-system-") || d == "seabios")
        );
        assert!(
            plan.installs.iter().any(|i| i.starts_with("qemu-system-x86 (1:10.0")),
            "{:?}",
            plan.installs
        );
        assert!(plan.note.unwrap().contains("would remove qemu-utils"));
    }

    #[test]
    fn the_added_backports_source_is_debs_of_the_machines_mirror() {
        let debian12 = "Types: deb\n# http://snapshot.debian.org/archive/debian/20250520T000000Z\n\
                        URIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n";
        assert_eq!(mirror_in(debian12).as_deref(), Some("http://deb.debian.org/debian"));
        let security = "Types: deb\nURIs: http://deb.debian.org/debian-security\n";
        assert_eq!(mirror_in(security), None);
        let one_line = "# x\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ bookworm main\n";
        assert_eq!(mirror_in(one_line).as_deref(), Some("http://mirror.example/debian"));
        let text = backports_sources("bookworm-backports", "http://deb.debian.org/debian");
        assert!(
            text.contains("\nSuites: bookworm-backports\n")
                && text.contains("\nURIs: http://deb.debian.org/debian\n")
        );
        assert!(text.lines().filter(|l| !l.starts_with('#')).all(|l| l.contains(": ")), "{text}");
    }

    #[test]
    fn parses_apt_simulations() {
        let sim = parse_simulation(true, SIM_REMOVES);
        assert_eq!(sim.removed, [("qemu-utils".to_string(), "1:10.0.2+ds-2+deb13u1~bpo12+1".to_string())]);
        assert_eq!(sim.installs.len(), 3);
        assert!(sim.installs[2].starts_with("qemu-system-x86 (1:7.2"));
        assert!(sim.broken.is_empty() && !sim.clean());

        let sim = parse_simulation(false, SIM_BROKEN);
        assert!(sim.removed.is_empty() && !sim.clean());
        assert_eq!(sim.broken, ["qemu-utils", "qemu-system-x86"]);
        assert_eq!(sim.problems.len(), 4);
        assert!(sim.problems[3].starts_with("E: Error"));

        let sim = parse_simulation(true, "Inst valgrind (1:3.19.0-1 Debian:12.15/oldstable [amd64])\n");
        assert!(sim.clean());
    }

    #[test]
    fn parses_apt_cache_policy_and_show() {
        let policy = "\
qemu-utils:
  Installed: 1:10.0.2+ds-2+deb13u1~bpo12+1
  Candidate: 1:10.0.2+ds-2+deb13u1~bpo12+1
  Version table:
 *** 1:10.0.2+ds-2+deb13u1~bpo12+1 100
        100 http://deb.debian.org/debian bookworm-backports/main amd64 Packages
        100 /var/lib/dpkg/status
     1:7.2+dfsg-7+deb12u18+b3 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
     1:7.2+dfsg-7+deb12u15 500
        500 http://deb.debian.org/debian-security bookworm-security/main amd64 Packages
";
        let versions = parse_policy(policy);
        assert_eq!(versions.len(), 3);
        assert_eq!(
            versions[0],
            PolicyVersion {
                version: "1:10.0.2+ds-2+deb13u1~bpo12+1".into(),
                installed: true,
                suites: vec!["bookworm-backports".into()]
            }
        );
        assert!(!versions[1].installed);
        assert_eq!(versions[2].suites, ["bookworm-security"]);
        assert!(parse_policy("N: Unable to locate package x\n").is_empty());

        let show = "Package: qemu-system-x86\nSource: qemu (1:7.2+dfsg-7+deb12u18)\nVersion: 1:7.2\n\nPackage: qemu-system-x86\nSource: other\n";
        assert_eq!(parse_source(show, "qemu-system-x86"), "qemu");
        assert_eq!(parse_source("Package: valgrind\nVersion: 1\n", "valgrind"), "valgrind");
        let show = "Package: qemu-utils\nBreaks: qemu-system-common (<< 1:8.0+dfsg-5~)\n";
        assert_eq!(stanza_field(show, "Breaks").as_deref(), Some("qemu-system-common (<< 1:8.0+dfsg-5~)"));
        assert_eq!(stanza_field(show, "Conflicts"), None);
    }

    #[test]
    fn finds_unmet_dependencies() {
        let sim = parse_simulation(false, SIM_BROKEN);
        assert_eq!(unmet_dependencies(&sim.problems), ["qemu-system-common", "seabios"]);
        assert!(unmet_dependencies(&[]).is_empty());
    }

    #[test]
    fn backports_versions_name_their_suite() {
        assert_eq!(backports_hint("1:10.0.2+ds-2+deb13u1~bpo12+1").as_deref(), Some("bookworm-backports"));
        assert_eq!(backports_hint("5.0-1~bpo11+2").as_deref(), Some("bullseye-backports"));
        assert_eq!(backports_hint("1:7.2+dfsg-7+deb12u18+b3"), None);
        assert_eq!(backports_hint("1.0~bpo99+1"), None);
    }

    #[test]
    fn dpkg_status() {
        assert!(is_installed_status("install ok installed"));
        assert!(!is_installed_status("deinstall ok config-files"));
        assert!(!is_installed_status(""));
    }

    #[test]
    fn ipv4_mapped_gids() {
        assert_eq!(ipv4_of_gid("0000:0000:0000:0000:0000:ffff:c000:0201").as_deref(), Some("192.0.2.1"));
        assert_eq!(ipv4_of_gid("fe80:0000:0000:0000:5054:00ff:fe12:3456"), None);
        assert_eq!(ipv4_of_gid("0000:0000:0000:0000:0000:0000:0000:0000"), None);
        assert_eq!(ipv4_of_gid("garbage"), None);
    }

    #[test]
    fn finds_an_active_device_and_its_roce_v2_gid() {
        let root = std::env::temp_dir().join(format!("xtask-sysfs-test.{}", std::process::id()));
        let port = |dev: &str, state: &str| {
            let p = root.join(dev).join("ports/1");
            fs::create_dir_all(p.join("gids")).unwrap();
            fs::create_dir_all(p.join("gid_attrs/types")).unwrap();
            fs::write(p.join("state"), state).unwrap();
            p
        };
        let down = port("a_down0", "1: DOWN\n");
        fs::write(down.join("gids/0"), "0000:0000:0000:0000:0000:ffff:0a00:0001\n").unwrap();
        let up = port("b_up0", "4: ACTIVE\n");
        for (i, kind, gid) in [
            (0, "IB/RoCE v1", "fe80:0000:0000:0000:5054:00ff:fe12:3456"),
            (1, "RoCE v2", "fe80:0000:0000:0000:5054:00ff:fe12:3456"),
            (2, "IB/RoCE v1", "0000:0000:0000:0000:0000:ffff:0a00:0002"),
            (3, "RoCE v2", "0000:0000:0000:0000:0000:ffff:0a00:0002"),
        ] {
            fs::write(up.join(format!("gid_attrs/types/{i}")), format!("{kind}\n")).unwrap();
            fs::write(up.join(format!("gids/{i}")), format!("{gid}\n")).unwrap();
        }
        let found = host_device_in(&root);
        let _ = fs::remove_dir_all(&root);
        assert_eq!(
            found,
            Some(HostDevice { name: "b_up0".into(), gid_index: Some(3), ipv4: Some("10.0.0.2".into()) })
        );
        assert_eq!(host_device_in(Path::new("/nonexistent")), None);
    }
}
