//! [`ParseError`]: what is wrong with a setting's text, and where (the payload of
//! [`Error::Setting`](super::Error::Setting)). The parsers are in `select`.

use std::fmt;
use std::net::IpAddr;

/// A setting's text that could not be parsed: the text, the byte position of the problem in it
/// (counted from 0), and what is wrong.
///
/// Returned by the parsers of [`select`](crate::select) ([`HcaSelector`](crate::select::HcaSelector),
/// [`AddrRange`](crate::select::AddrRange), ...); [`Config::from_vars`](crate::select::Config::from_vars)
/// wraps it in [`Error::Setting`](crate::Error::Setting) with the variable's name.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParseError {
    /// The text that was parsed.
    pub input: String,
    /// Byte offset of the problem in `input`, from 0 (`input.len()` when something is missing
    /// at the end).
    pub position: usize,
    /// What is wrong.
    pub kind: ParseErrorKind,
}

/// What is wrong with a setting's text (see [`ParseError`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseErrorKind {
    /// `^` or `=` (or both) with no device name after them.
    EmptyList,
    /// An empty entry in a comma list: `a,,b`, a leading or a trailing comma.
    EmptyEntry,
    /// An entry with a port but no device name: `:1`.
    EmptyName,
    /// A port that is not a number from 1 to 255: `mlx5_0:x`, `mlx5_0:0`, `mlx5_0:`.
    BadPort,
    /// A character that does not belong there: whitespace, a control character, a second `:`,
    /// or `^`/`=` anywhere but at the start.
    UnexpectedChar(char),
    /// `=^...`: exclusion comes first, as in NCCL (`^=mlx5_0`).
    ModifierOrder,
    /// Not an integer in `min..=max`.
    Number {
        /// Smallest accepted value.
        min: i64,
        /// Largest accepted value.
        max: i64,
    },
    /// Not one of the accepted words.
    Word {
        /// The accepted words, e.g. `"AF_INET or AF_INET6"`.
        expected: &'static str,
    },
    /// Not an address range `ADDRESS/PREFIX_LENGTH`, e.g. `10.0.0.0/8` or `fd00::/8`.
    AddrRange,
    /// A prefix length longer than the address (32 for IPv4, 128 for IPv6).
    PrefixLength {
        /// The longest prefix the address family allows.
        max: u8,
    },
    /// An address range with bits set after its prefix, e.g. `10.1.0.0/8`: they would be
    /// ignored, so the range is probably not the one meant.
    HostBits {
        /// The range as it was probably meant, e.g. `10.0.0.0/8`.
        network: IpAddr,
    },
    /// The value is not valid UTF-8.
    NotUnicode,
    /// The value contradicts another setting.
    Conflict {
        /// What it contradicts, e.g. `"the address family AF_INET6"`.
        with: String,
    },
}

impl fmt::Display for ParseErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseErrorKind::EmptyList => f.write_str("no device name after `^`/`=`"),
            ParseErrorKind::EmptyEntry => f.write_str("empty entry (two commas, or a comma at an end)"),
            ParseErrorKind::EmptyName => f.write_str("a port without a device name"),
            ParseErrorKind::BadPort => f.write_str("the port is not a number from 1 to 255"),
            ParseErrorKind::UnexpectedChar(c) => write!(f, "unexpected character {c:?}"),
            ParseErrorKind::ModifierOrder => f.write_str("`=^`: write `^=` (exclusion first, as NCCL does)"),
            ParseErrorKind::Number { min, max } => write!(f, "not an integer from {min} to {max}"),
            ParseErrorKind::Word { expected } => write!(f, "expected {expected}"),
            ParseErrorKind::AddrRange => {
                f.write_str("not an address range ADDRESS/LENGTH (e.g. 10.0.0.0/8 or fd00::/8)")
            }
            ParseErrorKind::PrefixLength { max } => write!(f, "prefix length above {max}"),
            ParseErrorKind::HostBits { network } => {
                write!(f, "bits set after the prefix (did you mean {network}?)")
            }
            ParseErrorKind::NotUnicode => f.write_str("not valid UTF-8"),
            ParseErrorKind::Conflict { with } => write!(f, "contradicts {with}"),
        }
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {} at position {}", self.input, self.kind, self.position)
    }
}

impl std::error::Error for ParseError {}

impl ParseError {
    pub(crate) fn new(input: &str, position: usize, kind: ParseErrorKind) -> ParseError {
        ParseError { input: input.to_string(), position, kind }
    }
}
