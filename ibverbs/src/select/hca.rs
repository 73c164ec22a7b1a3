//! [`HcaSelector`]: which adapters and ports to use, in `NCCL_IB_HCA`'s syntax.

use std::fmt;
use std::str::FromStr;

use crate::error::{ParseError, ParseErrorKind};

/// Which devices and ports to use, in the syntax of NCCL's `NCCL_IB_HCA` (our variable:
/// `IBVERBS_HCA`).
///
/// ```text
/// [^][=]NAME[:PORT][,NAME[:PORT]...]
/// ```
///
/// - a comma-separated list of device names, each optionally with a port (`mlx5_0:1`); an
///   entry without a port means every port of the device;
/// - a name matches every device whose name **starts with** it (`mlx5` matches `mlx5_0` and
///   `mlx5_1` — and `mlx5_1` also matches `mlx5_10`), unless the list starts with `=`: then
///   names must match exactly;
/// - a list starting with `^` **excludes** what it matches and keeps the rest; `^=` excludes
///   exact names;
/// - the empty string (or no setting at all) selects every device.
///
/// The order of the names does not matter: ports are used in natural device name order, ports
/// in ascending order (see [`Selection`](super::Selection)). Only ACTIVE ports are ever
/// selected.
///
/// Stricter than NCCL, which silently ignores what it cannot read (so a typo means "use
/// nothing" or "use everything"): empty entries (`a,,b`, a trailing comma), whitespace,
/// `^`/`=` in the middle, `=^` for `^=`, and ports that are not 1..=255 are
/// [`ParseError`]s naming the position.
///
/// ```
/// use ibverbs::select::HcaSelector;
///
/// let s: HcaSelector = "mlx5_0:1,mlx5_1".parse()?;
/// assert!(s.matches("mlx5_0", 1) && !s.matches("mlx5_0", 2));
/// assert!(s.matches("mlx5_1", 2) && s.matches("mlx5_10", 1)); // a prefix match
///
/// let s: HcaSelector = "^=mlx5_1".parse()?;
/// assert!(!s.matches("mlx5_1", 1) && s.matches("mlx5_10", 1) && s.matches("mlx5_0", 1));
///
/// let e = "mlx5_0,,mlx5_1".parse::<HcaSelector>().unwrap_err();
/// assert_eq!(e.position, 7);
/// # Ok::<(), ibverbs::select::ParseError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HcaSelector {
    exclude: bool,
    exact: bool,
    entries: Vec<HcaEntry>,
}

/// One entry of an [`HcaSelector`]: a device name (or name prefix) and optionally a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcaEntry {
    /// The device name, or the start of device names (see [`HcaSelector`]).
    pub name: String,
    /// The port, or `None` for every port of the device.
    pub port: Option<u8>,
}

impl fmt::Display for HcaEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            Some(p) => write!(f, "{}:{p}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

impl HcaSelector {
    /// Every device and port (what an unset `NCCL_IB_HCA` means).
    pub fn all() -> HcaSelector {
        HcaSelector::default()
    }

    /// Parses `NCCL_IB_HCA` syntax (see the type's documentation).
    ///
    /// # Errors
    /// A [`ParseError`] naming the position of the first problem.
    pub fn parse(input: &str) -> Result<HcaSelector, ParseError> {
        let err = |position, kind| ParseError::new(input, position, kind);
        if input.is_empty() {
            return Ok(HcaSelector::all());
        }
        let mut pos = 0;
        let exclude = input.starts_with('^');
        if exclude {
            pos += 1;
        }
        let exact = input[pos..].starts_with('=');
        if exact {
            pos += 1;
            if !exclude && input[pos..].starts_with('^') {
                return Err(err(0, ParseErrorKind::ModifierOrder));
            }
        }
        if pos == input.len() {
            return Err(err(pos, ParseErrorKind::EmptyList));
        }
        let mut entries = Vec::new();
        for (start, entry) in split_with_offsets(&input[pos..], ',') {
            let start = start + pos;
            if entry.is_empty() {
                return Err(err(start, ParseErrorKind::EmptyEntry));
            }
            let (name, port) = match entry.find(':') {
                Some(i) => (&entry[..i], Some((start + i + 1, &entry[i + 1..]))),
                None => (entry, None),
            };
            if name.is_empty() {
                return Err(err(start, ParseErrorKind::EmptyName));
            }
            if let Some((i, c)) = name
                .char_indices()
                .find(|&(_, c)| c.is_whitespace() || c.is_control() || c == '^' || c == '=')
            {
                return Err(err(start + i, ParseErrorKind::UnexpectedChar(c)));
            }
            let port = match port {
                None => None,
                Some((at, text)) => {
                    if let Some(i) = text.find(':') {
                        return Err(err(at + i, ParseErrorKind::UnexpectedChar(':')));
                    }
                    if let Some(i) = text.find(|c: char| !c.is_ascii_digit()) {
                        return Err(err(at + i, ParseErrorKind::BadPort));
                    }
                    match text.parse::<u8>() {
                        Ok(p) if p >= 1 => Some(p),
                        _ => return Err(err(at, ParseErrorKind::BadPort)),
                    }
                }
            };
            entries.push(HcaEntry { name: name.to_string(), port });
        }
        Ok(HcaSelector { exclude, exact, entries })
    }

    /// Whether this selects every device (no list).
    pub fn is_all(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether the list excludes (`^`) rather than includes.
    pub fn is_exclude(&self) -> bool {
        self.exclude
    }

    /// Whether names must match exactly (`=`) rather than as prefixes.
    pub fn is_exact(&self) -> bool {
        self.exact
    }

    /// The entries of the list.
    pub fn entries(&self) -> &[HcaEntry] {
        &self.entries
    }

    /// The first entry that names port `port` of `device` (whether the list includes or
    /// excludes it).
    pub fn entry_for(&self, device: &str, port: u8) -> Option<&HcaEntry> {
        self.entries.iter().find(|e| self.names(e, device, port))
    }

    /// Whether entry `e` names port `port` of `device`.
    fn names(&self, e: &HcaEntry, device: &str, port: u8) -> bool {
        let name = if self.exact { device == e.name } else { device.starts_with(e.name.as_str()) };
        name && e.port.map_or(true, |p| p == port)
    }

    /// Whether port `port` of `device` is selected.
    pub fn matches(&self, device: &str, port: u8) -> bool {
        self.is_all() || self.entry_for(device, port).is_some() != self.exclude
    }

    /// The entries that match no port of `ports` (device name, port number): usually a typo.
    pub fn unmatched<'a>(&'a self, ports: &[(&str, u8)]) -> Vec<&'a HcaEntry> {
        self.entries
            .iter()
            .filter(|e| !ports.iter().any(|&(device, port)| self.names(e, device, port)))
            .collect()
    }
}

/// `s` split at `sep`, each piece with its byte offset.
fn split_with_offsets(s: &str, sep: char) -> impl Iterator<Item = (usize, &str)> {
    let mut offset = 0;
    s.split(sep).map(move |piece| {
        let at = offset;
        offset += piece.len() + sep.len_utf8();
        (at, piece)
    })
}

impl FromStr for HcaSelector {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HcaSelector::parse(s)
    }
}

impl fmt::Display for HcaSelector {
    /// The canonical `NCCL_IB_HCA` text: `^=mlx5_0:1,mlx5_1` (empty for every device).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.exclude {
            f.write_str("^")?;
        }
        if self.exact {
            f.write_str("=")?;
        }
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}
