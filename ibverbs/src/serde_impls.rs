//! serde's `Serialize` and `Deserialize` (feature `serde`) for the value types that are not
//! derived where they are defined: their text forms for human-readable formats (JSON, TOML:
//! what a configuration file holds), compact ones otherwise. The crate's own compact encodings
//! ([`Endpoint::encode`](crate::Endpoint::encode), ...) are unchanged.
//!
//! | type | human-readable | other formats |
//! |---|---|---|
//! | [`Gid`] | IPv6 text, `"::ffff:192.0.2.1"` (any IPv6 form is read, `ibv_devinfo`'s too) | 16 bytes |
//! | [`Mtu`] | bytes, `1024` | bytes |
//! | [`AccessFlags`] | the flags' names, `"LOCAL_WRITE \| REMOTE_READ"` (bitflags' text form) | the bits |
//! | [`RoceVersion`] | `1` or `2` | the same |
//! | [`AddrFamily`] | `"AF_INET"`, `"AF_INET6"` (and what its `FromStr` takes) | the same |
//! | [`AddrRange`] | `"10.0.0.0/8"` | the same |
//! | [`HcaSelector`] | `NCCL_IB_HCA`'s syntax, `"^=mlx5_1:1"` | the same |
//!
//! A value that does not parse is a deserialization error naming it: an `Mtu` that is not one of
//! the IB MTUs, a GID that is not an IPv6 address, a selector with a syntax error.

use std::fmt;
use std::net::Ipv6Addr;

use serde::de::{self, Deserializer, Visitor};
use serde::ser::{self, Serializer};
use serde::{Deserialize, Serialize};

use crate::attr::{Gid, Mtu, RoceVersion};
use crate::memory::AccessFlags;
use crate::select::{AddrFamily, AddrRange, HcaSelector};

impl Serialize for Gid {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(&Ipv6Addr::from(self.0))
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Gid {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Gid, D::Error> {
        if d.is_human_readable() {
            let text = String::deserialize(d)?;
            let ip: Ipv6Addr = text
                .parse()
                .map_err(|_| de::Error::custom(format_args!("GID {text:?} is not an IPv6 address")))?;
            Ok(Gid(ip.octets()))
        } else {
            <[u8; 16]>::deserialize(d).map(Gid)
        }
    }
}

impl Serialize for Mtu {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.bytes() {
            Some(b) => s.serialize_u32(b),
            None => Err(ser::Error::custom(format_args!("{self:?} is not one of the IB MTUs"))),
        }
    }
}

impl<'de> Deserialize<'de> for Mtu {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Mtu, D::Error> {
        let bytes = u32::deserialize(d)?;
        Mtu::from_bytes(bytes).ok_or_else(|| {
            de::Error::custom(format_args!(
                "MTU {bytes} is not one of the IB MTUs (256, 512, 1024, 2048, 4096)"
            ))
        })
    }
}

impl Serialize for AccessFlags {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        bitflags::serde::serialize(self, s)
    }
}

impl<'de> Deserialize<'de> for AccessFlags {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<AccessFlags, D::Error> {
        bitflags::serde::deserialize(d)
    }
}

impl Serialize for RoceVersion {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(match self {
            RoceVersion::V1 => 1,
            RoceVersion::V2 => 2,
        })
    }
}

impl<'de> Deserialize<'de> for RoceVersion {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<RoceVersion, D::Error> {
        match u8::deserialize(d)? {
            1 => Ok(RoceVersion::V1),
            2 => Ok(RoceVersion::V2),
            n => Err(de::Error::custom(format_args!("RoCE version {n} is neither 1 nor 2"))),
        }
    }
}

/// Serializes `value` as its `Display` text.
fn as_text<T: fmt::Display, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(value)
}

/// Deserializes a `T` from its text form, naming what (`what`) failed to parse and why.
fn from_text<'de, T, D>(d: D, what: &'static str) -> Result<T, D::Error>
where
    T: std::str::FromStr,
    T::Err: fmt::Display,
    D: Deserializer<'de>,
{
    struct Text<T>(&'static str, std::marker::PhantomData<T>);
    impl<T: std::str::FromStr> Visitor<'_> for Text<T>
    where
        T::Err: fmt::Display,
    {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "{} as text", self.0)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
            v.parse().map_err(|e| E::custom(format_args!("{} {v:?}: {e}", self.0)))
        }
    }
    d.deserialize_str(Text(what, std::marker::PhantomData))
}

macro_rules! text_serde {
    ($($t:ty: $what:literal),* $(,)?) => {$(
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                as_text(self, s)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<$t, D::Error> {
                from_text(d, $what)
            }
        }
    )*};
}

text_serde! {
    AddrFamily: "address family",
    AddrRange: "address range",
    HcaSelector: "HCA selector",
}
