//! [`Config`]: the selection and connection options from environment variables, ours
//! (`IBVERBS_*`) or NCCL's (`NCCL_IB_*`).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use super::fabric::Fabric;
use super::gid::AddrRange;
use super::hca::HcaSelector;
use super::parse::int;
use super::selection::{Choice, Selection};
use crate::attr::Mtu;
use crate::connect::ConnectOptions;
use crate::device::Context;
use crate::error::{Error, ParseError, ParseErrorKind, Result};

/// One environment variable that [`Config::from_vars`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variable {
    /// Our name, e.g. `IBVERBS_HCA`: wins when both are set.
    pub name: &'static str,
    /// NCCL's name for the same setting, e.g. `NCCL_IB_HCA`.
    pub nccl: Option<&'static str>,
    /// What it sets, and its values.
    pub meaning: &'static str,
}

/// Every variable [`Config::from_vars`] reads, in the order it reads them.
pub const VARIABLES: &[Variable] = &[
    Variable {
        name: HCA,
        nccl: Some("NCCL_IB_HCA"),
        meaning: "devices and ports: [^][=]NAME[:PORT],... (prefix match; ^ excludes, = exact)",
    },
    Variable {
        name: GID_INDEX,
        nccl: Some("NCCL_IB_GID_INDEX"),
        meaning: "GID index, 0..=255; -1: automatic",
    },
    Variable {
        name: ADDR_FAMILY,
        nccl: Some("NCCL_IB_ADDR_FAMILY"),
        meaning: "address family of the automatic GID choice: AF_INET (default) or AF_INET6",
    },
    Variable {
        name: ADDR_RANGE,
        nccl: Some("NCCL_IB_ADDR_RANGE"),
        meaning: "address range of the automatic GID choice, e.g. 10.0.0.0/8",
    },
    Variable {
        name: ROCE_VERSION,
        nccl: Some("NCCL_IB_ROCE_VERSION_NUM"),
        meaning: "RoCE version of the GID, 1 or 2 (default: 2, or 1 when a port has no RoCE v2 GID)",
    },
    Variable {
        name: TIMEOUT,
        nccl: Some("NCCL_IB_TIMEOUT"),
        meaning: "ACK timeout: 4.096 us * 2^N, N in 0..=31 (default 14)",
    },
    Variable {
        name: RETRY_CNT,
        nccl: Some("NCCL_IB_RETRY_CNT"),
        meaning: "transport retries before an error, 0..=7 (default 6: rxe retries 7 for ever)",
    },
    Variable { name: SL, nccl: Some("NCCL_IB_SL"), meaning: "service level, 0..=15 (default 0)" },
    Variable { name: TC, nccl: Some("NCCL_IB_TC"), meaning: "traffic class, 0..=255 (default 0)" },
    Variable { name: PKEY_INDEX, nccl: Some("NCCL_IB_PKEY"), meaning: "P_Key index, 0..=65535 (default 0)" },
    Variable {
        name: MTU,
        nccl: None,
        meaning: "path MTU in bytes: 256, 512, 1024, 2048 or 4096 (default: the ports' active MTU)",
    },
    Variable {
        name: QPS_PER_CONNECTION,
        nccl: Some("NCCL_IB_QPS_PER_CONNECTION"),
        meaning: "queue pairs per striped connection, 1..=64 (default 1)",
    },
    Variable {
        name: SPLIT_DATA_ON_QPS,
        nccl: Some("NCCL_IB_SPLIT_DATA_ON_QPS"),
        meaning: "1: split large requests over a striped connection's queue pairs; 0: one queue pair per request, round-robin (default 1)",
    },
];

const HCA: &str = "IBVERBS_HCA";
const GID_INDEX: &str = "IBVERBS_GID_INDEX";
const ADDR_FAMILY: &str = "IBVERBS_ADDR_FAMILY";
const ADDR_RANGE: &str = "IBVERBS_ADDR_RANGE";
const ROCE_VERSION: &str = "IBVERBS_ROCE_VERSION";
const TIMEOUT: &str = "IBVERBS_TIMEOUT";
const RETRY_CNT: &str = "IBVERBS_RETRY_CNT";
const SL: &str = "IBVERBS_SL";
const TC: &str = "IBVERBS_TC";
const PKEY_INDEX: &str = "IBVERBS_PKEY_INDEX";
const MTU: &str = "IBVERBS_MTU";
const QPS_PER_CONNECTION: &str = "IBVERBS_QPS_PER_CONNECTION";
const SPLIT_DATA_ON_QPS: &str = "IBVERBS_SPLIT_DATA_ON_QPS";

/// A variable that was set, and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    /// The variable that was used (ours, or NCCL's when ours is unset).
    pub variable: &'static str,
    /// Its value.
    pub value: String,
}

/// Device selection and connection options, from environment variables.
///
/// ```
/// use std::collections::HashMap;
/// use ibverbs::select::Config;
///
/// let env: HashMap<&str, &str> =
///     [("NCCL_IB_HCA", "^=mlx5_1"), ("NCCL_IB_TIMEOUT", "22"), ("IBVERBS_TIMEOUT", "18")].into();
/// let config = Config::from_vars(|name| env.get(name).copied())?;
/// assert_eq!(config.selection.hca.to_string(), "^=mlx5_1");
/// assert_eq!(config.connect.timeout, 18); // ours wins
///
/// let env: HashMap<&str, &str> =
///     [("NCCL_IB_QPS_PER_CONNECTION", "4"), ("NCCL_IB_SPLIT_DATA_ON_QPS", "0")].into();
/// let config = Config::from_vars(|name| env.get(name).copied())?;
/// assert_eq!((config.stripe.qps, config.stripe.split_data), (4, false));
///
/// let env: HashMap<&str, &str> = [("NCCL_IB_RETRY_CNT", "8")].into();
/// let e = Config::from_vars(|name| env.get(name).copied()).unwrap_err();
/// assert!(e.to_string().starts_with("NCCL_IB_RETRY_CNT=\"8\""), "{e}");
/// # Ok::<(), ibverbs::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(default))]
pub struct Config {
    /// Which devices, ports and GIDs to use.
    pub selection: Selection,
    /// Connection options: the defaults with the variables' values (the port and, unless
    /// explicit, the GID index come from the [`Choice`]: see
    /// [`connect_options`](Self::connect_options)).
    pub connect: ConnectOptions,
    /// Striped connections ([`StripedConnection`](crate::striped::StripedConnection)): the
    /// defaults with `qps` and `split_data` from the variables.
    pub stripe: crate::striped::StripeOptions,
    /// The variables that were set, in [`VARIABLES`] order (not serialized: what
    /// [`from_vars`](Self::from_vars) read, not configuration).
    #[cfg_attr(feature = "serde", serde(skip))]
    pub settings: Vec<Setting>,
}

impl Config {
    /// Reads the process environment (see [`from_vars`](Self::from_vars)).
    ///
    /// # Errors
    /// As [`from_vars`](Self::from_vars).
    pub fn from_env() -> Result<Config> {
        Config::from_vars(|name| std::env::var_os(name))
    }

    /// Reads the variables of [`VARIABLES`] through `get` (a variable's value, or `None` when
    /// unset): for each, our name when set, else NCCL's. An empty value means the default.
    ///
    /// # Errors
    /// [`Error::Setting`] naming the variable, its value and the position of the problem, for
    /// the first value that is not valid: nothing is silently ignored.
    pub fn from_vars<F, V>(get: F) -> Result<Config>
    where
        F: Fn(&str) -> Option<V>,
        V: AsRef<OsStr>,
    {
        let mut config = Config::default();
        let mut family_from = None;
        for var in VARIABLES {
            let Some((name, value)) = lookup(&get, var)? else { continue };
            config.settings.push(Setting { variable: name, value: value.clone() });
            if value.is_empty() {
                continue;
            }
            let bad = |error: ParseError| Error::Setting { variable: Some(name), error };
            let number = |min, max| int(&value, min, max).map_err(bad);
            match var.name {
                HCA => config.selection.hca = HcaSelector::parse(&value).map_err(bad)?,
                GID_INDEX => {
                    let index = u32::try_from(number(-1, 255)?).ok();
                    config.selection.gid.index = index;
                    config.connect.gid_index = index;
                }
                ADDR_FAMILY => {
                    config.selection.gid.family = Some(value.parse().map_err(bad)?);
                    family_from = Some(format!("{name}={value}"));
                }
                ADDR_RANGE => {
                    let range: AddrRange = value.parse().map_err(bad)?;
                    if let (Some(family), Some(from)) = (config.selection.gid.family, &family_from) {
                        if family != range.family() {
                            let kind = ParseErrorKind::Conflict { with: from.clone() };
                            return Err(bad(ParseError::new(&value, 0, kind)));
                        }
                    }
                    config.selection.gid.range = Some(range);
                }
                ROCE_VERSION => config.selection.gid.roce_version = Some(value.parse().map_err(bad)?),
                TIMEOUT => config.connect.timeout = small(number(0, 31)?),
                RETRY_CNT => config.connect.retry_cnt = small(number(0, 7)?),
                SL => config.connect.sl = small(number(0, 15)?),
                TC => config.connect.traffic_class = small(number(0, 255)?),
                PKEY_INDEX => config.connect.pkey_index = u16::try_from(number(0, 65535)?).unwrap_or(0),
                MTU => {
                    let mtu = value.parse().ok().and_then(Mtu::from_bytes).ok_or_else(|| {
                        let expected = "an MTU in bytes: 256, 512, 1024, 2048 or 4096";
                        bad(ParseError::new(&value, 0, ParseErrorKind::Word { expected }))
                    })?;
                    config.selection.mtu = Some(mtu);
                    config.connect.mtu = Some(mtu);
                }
                QPS_PER_CONNECTION => config.stripe.qps = u32::try_from(number(1, 64)?).unwrap_or(1),
                SPLIT_DATA_ON_QPS => config.stripe.split_data = number(0, 1)? == 1,
                _ => {}
            }
        }
        Ok(config)
    }

    /// The variables that were set, as `NAME=value` words, or `no IBVERBS_*/NCCL_IB_* variable
    /// set`.
    pub fn describe(&self) -> String {
        if self.settings.is_empty() {
            return "no IBVERBS_*/NCCL_IB_* variable set".to_string();
        }
        let words: Vec<String> =
            self.settings.iter().map(|s| format!("{}={:?}", s.variable, s.value)).collect();
        words.join(" ")
    }

    /// The usable ports of `fabric` (see [`Selection::select`]); errors name the variables.
    ///
    /// # Errors
    /// As [`Selection::select`].
    pub fn select_in(&self, fabric: &Fabric) -> Result<Vec<Choice>> {
        self.selection.select_described(fabric, || format!("{} ({})", self.describe(), self.selection))
    }

    /// The usable ports of this host ([`Fabric::query`], then [`select_in`](Self::select_in)).
    ///
    /// # Errors
    /// As [`Fabric::query`] and [`Selection::select`].
    pub fn select(&self) -> Result<Vec<Choice>> {
        self.select_in(&Fabric::query()?)
    }

    /// [`connect`](Self::connect) with `choice`'s port and GID index.
    pub fn connect_options(&self, choice: &Choice) -> ConnectOptions {
        choice.connect_options(&self.connect)
    }

    /// Opens the first usable port's device, with the connection options for that port.
    ///
    /// # Errors
    /// As [`select`](Self::select) and [`Context::open`].
    pub fn open(&self) -> Result<(Context, ConnectOptions)> {
        let choices = self.select()?;
        // select() never returns an empty list.
        let first = choices
            .first()
            .ok_or_else(|| Error::NoUsablePort { selection: self.describe(), rejected: Vec::new() })?;
        Ok((first.open()?, self.connect_options(first)))
    }
}

/// A value in 0..=255 as `u8` (the callers checked the range).
fn small(v: i64) -> u8 {
    u8::try_from(v).unwrap_or(u8::MAX)
}

/// The value of `var`: ours when set, else NCCL's; `None` when neither is set.
fn lookup<F, V>(get: &F, var: &Variable) -> Result<Option<(&'static str, String)>>
where
    F: Fn(&str) -> Option<V>,
    V: AsRef<OsStr>,
{
    let found = get(var.name)
        .map(|v| (var.name, v))
        .or_else(|| var.nccl.and_then(|nccl| get(nccl).map(|v| (nccl, v))));
    let Some((name, value)) = found else { return Ok(None) };
    let bytes = value.as_ref().as_bytes();
    match std::str::from_utf8(bytes) {
        Ok(s) => Ok(Some((name, s.to_string()))),
        Err(e) => {
            let error =
                ParseError::new(&String::from_utf8_lossy(bytes), e.valid_up_to(), ParseErrorKind::NotUnicode);
            Err(Error::Setting { variable: Some(name), error })
        }
    }
}
