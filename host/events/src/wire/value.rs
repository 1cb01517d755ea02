//! Any MessagePack value as the decoder sees it ([`Val`]), the scalar fields read from it, and
//! the `otherwise!` visitor methods that consume a value of a type a visitor does not read.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use xxhash_rust::xxh3::xxh3_64;

use crate::batch::DropReason;

/// One MessagePack value: the scalars the decoder reads, `Array` for any array and `Other` for
/// anything else (a map, a bool, an extension), each consumed whole.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Val<'de> {
    Nil,
    /// Any non-negative integer.
    UInt(u64),
    /// A negative integer.
    Int(i64),
    Float(f64),
    Str(&'de str),
    Bytes(&'de [u8]),
    Array,
    Other,
}

/// Consumes what is left of an array.
pub(super) fn drain_seq<'de, A: SeqAccess<'de>>(seq: &mut A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Consumes what is left of a map.
pub(super) fn drain_map<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Visitor methods for the value types a visitor does not read: each consumes the value whole
/// (a container's items, an extension's bytes) and answers `$v`.
macro_rules! otherwise {
    ($v:expr; $($kind:ident)*) => { $( otherwise!(@ $kind $v); )* };
    (@ unit $v:expr) => {
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ bool $v:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ int $v:expr) => {
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> { Ok($v) }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ float $v:expr) => {
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ str $v:expr) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ bytes $v:expr) => {
        fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ seq $v:expr) => {
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            drain_seq(&mut seq)?;
            Ok($v)
        }
    };
    (@ map $v:expr) => {
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            drain_map(&mut map)?;
            Ok($v)
        }
    };
    // rmp-serde hands an extension to `visit_newtype_struct`.
    (@ ext $v:expr) => {
        fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            IgnoredAny::deserialize(d)?;
            Ok($v)
        }
    };
}

pub(super) use otherwise;

struct ValVisitor;

impl<'de> Visitor<'de> for ValVisitor {
    type Value = Val<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any MessagePack value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Val<'de>, E> {
        Ok(Val::Nil)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Val<'de>, E> {
        Ok(Val::UInt(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Val<'de>, E> {
        Ok(if v >= 0 {
            Val::UInt(v as u64)
        } else {
            Val::Int(v)
        })
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Val<'de>, E> {
        Ok(Val::Float(v))
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Val<'de>, E> {
        Ok(Val::Str(v))
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Val<'de>, E> {
        Ok(Val::Bytes(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Val<'de>, A::Error> {
        drain_seq(&mut seq)?;
        Ok(Val::Array)
    }

    // A copied (not borrowed) string never comes from a slice; nothing reads one.
    otherwise!(Val::Other; bool str bytes map ext);
}

impl<'de> Deserialize<'de> for Val<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValVisitor)
    }
}

// ---- scalar fields ----------------------------------------------------------------------------

/// An engine block hash as the router's 64-bit handle.
#[inline]
pub(super) fn hash_of(v: Val<'_>) -> Result<u64, DropReason> {
    match v {
        Val::UInt(h) => Ok(h),
        Val::Int(h) => Ok(h as u64),
        Val::Bytes(b) if !b.is_empty() && b.len() <= 64 => Ok(xxh3_64(b)),
        _ => Err(DropReason::MalformedEvent),
    }
}

/// `parent_block_hash`: nil or a hash.
pub(super) fn parent_of(v: Val<'_>) -> Result<Option<u64>, DropReason> {
    match v {
        Val::Nil => Ok(None),
        v => hash_of(v).map(Some),
    }
}

#[inline]
pub(super) fn token_of(v: Val<'_>) -> Result<u32, DropReason> {
    match v {
        Val::UInt(t) if t <= u64::from(u32::MAX) => Ok(t as u32),
        _ => Err(DropReason::MalformedEvent),
    }
}

pub(super) fn opt_uint(v: Val<'_>) -> Result<Option<u64>, DropReason> {
    match v {
        Val::Nil => Ok(None),
        Val::UInt(u) => Ok(Some(u)),
        _ => Err(DropReason::MalformedEvent),
    }
}

pub(super) fn opt_str(v: Val<'_>) -> Result<Option<&str>, DropReason> {
    match v {
        Val::Nil => Ok(None),
        Val::Str(s) => Ok(Some(s)),
        _ => Err(DropReason::MalformedEvent),
    }
}

pub(super) fn ts_of(v: Val<'_>) -> Option<f64> {
    match v {
        Val::Float(t) => Some(t),
        Val::UInt(t) => Some(t as f64),
        Val::Int(t) => Some(t as f64),
        Val::Nil => Some(0.0),
        _ => None,
    }
}

pub(super) fn rank_of(v: Val<'_>) -> Option<Option<u32>> {
    match v {
        Val::Nil => Some(None),
        Val::UInt(r) if r <= u64::from(u32::MAX) => Some(Some(r as u32)),
        _ => None,
    }
}
