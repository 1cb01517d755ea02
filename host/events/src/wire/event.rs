//! One KV event: a tagged array or a tagged map, read into [`Fields`] with every field's
//! alternatives (hashes, plain or Eagle tokens, SGLang's name map at 7/8, Dynamo's slot at 9),
//! then emitted by the decoder or dropped with its reason, always consumed whole.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
};

use super::value::{
    drain_map, drain_seq, hash_of, opt_str, opt_uint, otherwise, parent_of, token_of, Val,
};
use super::Key;
use crate::batch::{Batch, DropReason};
use crate::emit::{fold, BlockExtra, Emitter, EventKind, Fields};
use kvroute_core::hashing::chain;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Why reading an event stopped early: the wire failed (the payload is dropped) or the event is
/// dropped for a reason (the rest of it is consumed, then it is counted).
enum Stop<E> {
    Wire(E),
    Drop(DropReason),
}

impl<E> From<DropReason> for Stop<E> {
    fn from(r: DropReason) -> Self {
        Stop::Drop(r)
    }
}

/// The next array element through `$seed`, or `return Ok(())` when the array has no more.
macro_rules! next {
    ($seq:expr, $seed:expr) => {
        match $seq.next_element_seed($seed) {
            Ok(Some(v)) => v,
            Ok(None) => return Ok(()),
            Err(e) => return Err(Stop::Wire(e)),
        }
    };
}

/// One event: a tagged array or a tagged map. Its value is `Err(reason)` when it is dropped.
pub(super) struct EventSeed<'s> {
    pub(super) dec: &'s mut Emitter,
    pub(super) out: &'s mut Batch,
    pub(super) budget: usize,
}

impl<'de> DeserializeSeed<'de> for EventSeed<'_> {
    type Value = Result<(), DropReason>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

fn kind_of(tag: &str) -> EventKind {
    match tag {
        "BlockStored" => EventKind::Stored,
        "BlockRemoved" => EventKind::Removed,
        "AllBlocksCleared" => EventKind::Cleared,
        _ => EventKind::Unknown,
    }
}

impl<'s> EventSeed<'s> {
    fn hashes(&self) -> HashesSeed {
        HashesSeed {
            budget: self.budget,
        }
    }

    fn tokens(&mut self) -> TokensSeed<'_> {
        TokensSeed {
            out: &mut self.dec.tokens,
            budget: self.budget,
        }
    }

    /// `["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name,
    /// extra_keys, (block_mm_infos,) group_idx, kind, window, ...]`.
    fn stored_array<'de, A: SeqAccess<'de>>(
        &mut self,
        seq: &mut A,
        f: &mut Fields<'de>,
    ) -> Result<(), Stop<A::Error>> {
        f.hashes = Some(next!(seq, self.hashes())?);
        f.parent = parent_of(next!(seq, PhantomData::<Val>))?;
        f.eagle = next!(seq, self.tokens())?;
        f.has_tokens = true;
        f.block_size = opt_uint(next!(seq, PhantomData::<Val>))?;
        next!(seq, PhantomData::<IgnoredAny>); // lora_id
        f.medium = opt_str(next!(seq, PhantomData::<Val>))?;
        name_slot(next!(seq, PhantomData::<Slot>), true, f)?;
        name_slot(next!(seq, PhantomData::<Slot>), false, f)?;
        // Metadata starts at position 9, or 10 when 9 is Dynamo's block_mm_infos array.
        let group = match next!(seq, PhantomData::<Ninth>) {
            Ninth::MmInfos(m) => {
                f.mm_infos = Some(m);
                next!(seq, PhantomData::<Val>)
            }
            Ninth::Val(v) => v,
        };
        f.group_idx = opt_uint(group)?;
        f.spec_kind = opt_str(next!(seq, PhantomData::<Val>))?;
        Ok(())
    }

    /// `["BlockRemoved", hashes, medium, group_idx, kind, ...]`.
    fn removed_array<'de, A: SeqAccess<'de>>(
        &mut self,
        seq: &mut A,
        f: &mut Fields<'de>,
    ) -> Result<(), Stop<A::Error>> {
        f.hashes = Some(next!(seq, self.hashes())?);
        f.medium = opt_str(next!(seq, PhantomData::<Val>))?;
        f.group_idx = opt_uint(next!(seq, PhantomData::<Val>))?;
        f.spec_kind = opt_str(next!(seq, PhantomData::<Val>))?;
        Ok(())
    }

    /// A tagged array after its tag.
    fn array_fields<'de, A: SeqAccess<'de>>(
        &mut self,
        seq: &mut A,
        f: &mut Fields<'de>,
    ) -> Result<(), Stop<A::Error>> {
        let tag = match seq.next_element::<Val>() {
            Ok(Some(Val::Str(t))) => t,
            Ok(_) => return Err(Stop::Drop(DropReason::MalformedEvent)),
            Err(e) => return Err(Stop::Wire(e)),
        };
        f.kind = kind_of(tag);
        match f.kind {
            EventKind::Stored => self.stored_array(seq, f),
            EventKind::Removed => self.removed_array(seq, f),
            EventKind::Cleared => Ok(()),
            EventKind::Unknown => Err(Stop::Drop(DropReason::UnknownEventType)),
        }
    }

    /// A tagged map: fields by name, any order, unknown keys ignored.
    fn map_fields<'de, A: MapAccess<'de>>(
        &mut self,
        map: &mut A,
        f: &mut Fields<'de>,
    ) -> Result<(), Stop<A::Error>> {
        let mut tag = None;
        loop {
            let key = match map.next_key::<Key>() {
                Ok(Some(k)) => k,
                Ok(None) => break,
                Err(e) => return Err(Stop::Wire(e)),
            };
            let w = Stop::Wire;
            match key {
                Key::Type => match map.next_value::<Val>().map_err(w)? {
                    Val::Str(t) => tag = Some(t),
                    _ => return Err(Stop::Drop(DropReason::MalformedEvent)),
                },
                Key::BlockHashes => {
                    f.hashes = Some(map.next_value_seed(self.hashes()).map_err(w)??)
                }
                Key::Parent => f.parent = parent_of(map.next_value().map_err(w)?)?,
                Key::TokenIds => {
                    f.eagle = map.next_value_seed(self.tokens()).map_err(w)??;
                    f.has_tokens = true;
                }
                Key::BlockSize => f.block_size = opt_uint(map.next_value().map_err(w)?)?,
                Key::Medium => f.medium = opt_str(map.next_value().map_err(w)?)?,
                Key::LoraName => f.lora_name = opt_str(map.next_value().map_err(w)?)?,
                Key::CacheSalt => f.cache_salt = opt_str(map.next_value().map_err(w)?)?,
                Key::ExtraKeys => name_slot(map.next_value::<Slot>().map_err(w)?, false, f)?,
                Key::GroupIdx => f.group_idx = opt_uint(map.next_value().map_err(w)?)?,
                Key::SpecKind => f.spec_kind = opt_str(map.next_value().map_err(w)?)?,
                _ => {
                    map.next_value::<IgnoredAny>().map_err(w)?;
                }
            }
        }
        f.kind = match tag.map(kind_of) {
            Some(EventKind::Unknown) => return Err(Stop::Drop(DropReason::UnknownEventType)),
            Some(kind) => kind,
            None => return Err(Stop::Drop(DropReason::MalformedEvent)),
        };
        Ok(())
    }
}

/// An event's reading as the batch sees it: a wire error to return, or the event's fate.
fn settle<E>(read: Result<(), Stop<E>>) -> Result<Result<(), DropReason>, E> {
    match read {
        Ok(()) => Ok(Ok(())),
        Err(Stop::Drop(reason)) => Ok(Err(reason)),
        Err(Stop::Wire(e)) => Err(e),
    }
}

impl<'de> Visitor<'de> for EventSeed<'_> {
    type Value = Result<(), DropReason>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a tagged array or tagged map KV event")
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut f = Fields::default();
        let read = settle(self.array_fields(&mut seq, &mut f))?;
        // Trailing extra elements, or the rest of a dropped event.
        drain_seq(&mut seq)?;
        Ok(read.and_then(|()| self.dec.emit(f, self.out)))
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut f = Fields::default();
        let read = settle(self.map_fields(&mut map, &mut f))?;
        drain_map(&mut map)?;
        Ok(read.and_then(|()| self.dec.emit(f, self.out)))
    }

    otherwise!(Err(DropReason::MalformedEvent); unit bool int float str bytes ext);
}

// ---- arrays inside an event -------------------------------------------------------------------

/// `block_hashes`: an array of hashes (nil = none).
struct HashesSeed {
    budget: usize,
}

impl<'de> DeserializeSeed<'de> for HashesSeed {
    type Value = Result<Vec<u64>, DropReason>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for HashesSeed {
    type Value = Result<Vec<u64>, DropReason>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of block hashes")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Ok(Vec::new()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.budget));
        while let Some(v) = seq.next_element::<Val>()? {
            match hash_of(v) {
                Ok(h) => out.push(h),
                Err(r) => {
                    drain_seq(&mut seq)?;
                    return Ok(Err(r));
                }
            }
        }
        Ok(Ok(out))
    }

    otherwise!(Err(DropReason::MalformedEvent); bool int float str bytes map ext);
}

/// `token_ids` into the decoder's scratch buffer: plain tokens, or Eagle's pairs `[[a, b], ...]`
/// (the firsts plus the last second). The first element decides which. Its value is whether they
/// were pairs.
struct TokensSeed<'s> {
    out: &'s mut Vec<u32>,
    budget: usize,
}

impl<'de> DeserializeSeed<'de> for TokensSeed<'_> {
    type Value = Result<bool, DropReason>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// One element of `token_ids`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Token {
    One(u32),
    Pair(u32, u32),
    Bad,
}

struct TokenVisitor;

impl<'de> Visitor<'de> for TokenVisitor {
    type Value = Token;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token id or an Eagle pair")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Token, E> {
        Ok(token_of(Val::UInt(v)).map_or(Token::Bad, Token::One))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Token, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Ok(Token::Bad),
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Token, A::Error> {
        if seq.size_hint() != Some(2) {
            drain_seq(&mut seq)?;
            return Ok(Token::Bad);
        }
        let a = seq.next_element::<Val>()?.map(token_of);
        let b = seq.next_element::<Val>()?.map(token_of);
        drain_seq(&mut seq)?;
        Ok(match (a, b) {
            (Some(Ok(a)), Some(Ok(b))) => Token::Pair(a, b),
            _ => Token::Bad,
        })
    }

    otherwise!(Token::Bad; unit bool float str bytes map ext);
}

impl<'de> Deserialize<'de> for Token {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TokenVisitor)
    }
}

impl<'de> Visitor<'de> for TokensSeed<'_> {
    type Value = Result<bool, DropReason>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of token ids")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.out.clear();
        Ok(Ok(false))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let out = self.out;
        out.clear();
        out.reserve(seq.size_hint().unwrap_or(0).min(self.budget));
        let bad = |mut seq: A| -> Result<Self::Value, A::Error> {
            drain_seq(&mut seq)?;
            Ok(Err(DropReason::MalformedEvent))
        };
        match seq.next_element::<Token>()? {
            None => Ok(Ok(false)),
            Some(Token::One(t)) => {
                out.push(t);
                while let Some(t) = seq.next_element::<Token>()? {
                    match t {
                        Token::One(t) => out.push(t),
                        _ => return bad(seq),
                    }
                }
                Ok(Ok(false))
            }
            Some(Token::Pair(a, mut last_second)) => {
                out.push(a);
                while let Some(t) = seq.next_element::<Token>()? {
                    match t {
                        Token::Pair(a, b) => {
                            out.push(a);
                            last_second = b;
                        }
                        _ => return bad(seq),
                    }
                }
                out.push(last_second);
                Ok(Ok(true))
            }
            Some(Token::Bad) => bad(seq),
        }
    }

    otherwise!(Err(DropReason::MalformedEvent); bool int float str bytes map ext);
}

// ---- positions 7 and 8 of a stored array ------------------------------------------------------

/// Position 7 (`lora_name`) or 8 (`extra_keys`): a string, SGLang's `{cache_salt, lora_name?}`
/// map (each name present: `Some`, maybe of nil), vLLM's `extra_keys` (an array with one entry
/// per block), nil, or anything else.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Slot<'de> {
    Nil,
    Name(&'de str),
    Extra(Vec<BlockExtra<'de>>),
    Salted {
        cache_salt: Option<Option<&'de str>>,
        lora_name: Option<Option<&'de str>>,
    },
    Bad,
    Other,
}

struct SlotVisitor;

impl<'de> Visitor<'de> for SlotVisitor {
    type Value = Slot<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a LoRA name or a {cache_salt, lora_name} map")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Slot<'de>, E> {
        Ok(Slot::Nil)
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Slot<'de>, E> {
        Ok(Slot::Name(v))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Slot<'de>, A::Error> {
        let (mut cache_salt, mut lora_name) = (None, None);
        while let Some(key) = map.next_key::<Key>()? {
            let into = match key {
                Key::CacheSalt => &mut cache_salt,
                Key::LoraName => &mut lora_name,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            match opt_str(map.next_value()?) {
                Ok(v) => *into = Some(v),
                Err(_) => {
                    drain_map(&mut map)?;
                    return Ok(Slot::Bad);
                }
            }
        }
        Ok(Slot::Salted {
            cache_salt,
            lora_name,
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Slot<'de>, A::Error> {
        // Every entry takes at least one byte of the payload.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(e) = seq.next_element::<BlockExtra<'de>>()? {
            out.push(e);
        }
        Ok(Slot::Extra(out))
    }

    otherwise!(Slot::Other; bool int float str bytes ext);
}

impl<'de> Deserialize<'de> for Slot<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SlotVisitor)
    }
}

/// Applies position 7 (`is_lora_slot`) or 8: a string names the LoRA (position 7 only), a map is
/// SGLang's, nil or anything else at position 8 is ignored.
fn name_slot<'de>(
    slot: Slot<'de>,
    is_lora_slot: bool,
    f: &mut Fields<'de>,
) -> Result<(), DropReason> {
    match slot {
        Slot::Nil => Ok(()),
        Slot::Name(s) if is_lora_slot => {
            f.lora_name = Some(s);
            Ok(())
        }
        Slot::Salted {
            cache_salt,
            lora_name,
        } => {
            if let Some(s) = cache_salt {
                f.cache_salt = s;
            }
            if let Some(l) = lora_name {
                f.lora_name = l;
            }
            Ok(())
        }
        Slot::Extra(keys) if !is_lora_slot => {
            f.extra_keys = Some(keys);
            Ok(())
        }
        Slot::Bad => Err(DropReason::MalformedEvent),
        _ if is_lora_slot => Err(DropReason::MalformedEvent),
        _ => Ok(()),
    }
}

// ---- extra keys and multimodal infos ------------------------------------------------------------

/// Any value folded into one `u64`: its scalars and its shape (order matters). Used for the
/// identity keys the router cannot reproduce from a prompt (multimodal hashes and offsets,
/// prompt-embedding digests, Dynamo's `block_mm_infos` entries): equal values fold equal.
struct FoldVisitor;

fn fold_scalar(bytes: &[u8], tag: u64) -> u64 {
    xxh3_64_with_seed(bytes, tag)
}

impl<'de> Visitor<'de> for FoldVisitor {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<u64, E> {
        Ok(fold_scalar(&[], 9))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<u64, E> {
        Ok(fold_scalar(&[u8::from(v)], 8))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(fold_scalar(&v.to_le_bytes(), 3))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        match u64::try_from(v) {
            Ok(u) => self.visit_u64(u),
            Err(_) => Ok(fold_scalar(&v.to_le_bytes(), 4)),
        }
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
        Ok(fold_scalar(&v.to_bits().to_le_bytes(), 5))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        Ok(fold_scalar(v.as_bytes(), 6))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<u64, E> {
        Ok(fold_scalar(v, 7))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u64, A::Error> {
        let mut acc = fold_scalar(b"[", 10);
        while let Some(Folded(x)) = seq.next_element()? {
            acc = chain(acc, x);
        }
        Ok(acc)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u64, A::Error> {
        let mut acc = fold_scalar(b"{", 10);
        while let Some((Folded(k), Folded(v))) = map.next_entry()? {
            acc = chain(chain(acc, k), v);
        }
        Ok(acc)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        let Folded(x) = Folded::deserialize(d)?;
        Ok(chain(fold_scalar(b"ext", 10), x))
    }
}

struct Folded(u64);

impl<'de> Deserialize<'de> for Folded {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(FoldVisitor).map(Folded)
    }
}

/// One key of a block's `extra_keys` tuple: a string (LoRA name, cache salt) or anything else,
/// folded.
enum ExtraKey<'de> {
    Str(&'de str),
    Other(u64),
}

struct ExtraKeyVisitor;

/// Visitor methods that fold the value with [`FoldVisitor`] and wrap it with `$wrap`.
macro_rules! fold_into {
    ($wrap:expr; $($kind:ident)*) => { $( fold_into!(@ $kind $wrap); )* };
    (@ unit $w:expr) => {
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> { FoldVisitor.visit_unit().map($w) }
    };
    (@ bool $w:expr) => {
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> { FoldVisitor.visit_bool(v).map($w) }
    };
    (@ int $w:expr) => {
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> { FoldVisitor.visit_u64(v).map($w) }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> { FoldVisitor.visit_i64(v).map($w) }
    };
    (@ float $w:expr) => {
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> { FoldVisitor.visit_f64(v).map($w) }
    };
    (@ str $w:expr) => {
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> { FoldVisitor.visit_str(v).map($w) }
    };
    (@ bytes $w:expr) => {
        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> { FoldVisitor.visit_bytes(v).map($w) }
    };
    (@ seq $w:expr) => {
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> { FoldVisitor.visit_seq(seq).map($w) }
    };
    (@ map $w:expr) => {
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> { FoldVisitor.visit_map(map).map($w) }
    };
    (@ ext $w:expr) => {
        fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> { FoldVisitor.visit_newtype_struct(d).map($w) }
    };
}

impl<'de> Visitor<'de> for ExtraKeyVisitor {
    type Value = ExtraKey<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an extra key")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<ExtraKey<'de>, E> {
        Ok(ExtraKey::Str(v))
    }

    fold_into!(ExtraKey::Other; unit bool int float str bytes seq map ext);
}

impl<'de> Deserialize<'de> for ExtraKey<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ExtraKeyVisitor)
    }
}

/// Most string keys kept per block (vLLM has at most two: the LoRA name and the salt); more are
/// folded into the opaque part.
const MAX_BLOCK_STRS: usize = 4;

struct BlockExtraVisitor;

fn opaque_only<'de>(k: u64) -> BlockExtra<'de> {
    BlockExtra {
        strs: Default::default(),
        opaque: Some(k),
    }
}

impl<'de> Visitor<'de> for BlockExtraVisitor {
    type Value = BlockExtra<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a block's extra keys: a tuple or nil")
    }

    fn visit_unit<E: de::Error>(self) -> Result<BlockExtra<'de>, E> {
        Ok(BlockExtra::default())
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<BlockExtra<'de>, E> {
        let mut e = BlockExtra::default();
        e.strs.push(v);
        Ok(e)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<BlockExtra<'de>, A::Error> {
        let mut e = BlockExtra::default();
        while let Some(k) = seq.next_element::<ExtraKey<'de>>()? {
            match k {
                ExtraKey::Str(s) if e.strs.len() < MAX_BLOCK_STRS => e.strs.push(s),
                ExtraKey::Str(s) => e.opaque = Some(fold(e.opaque, fold_scalar(s.as_bytes(), 6))),
                ExtraKey::Other(x) => e.opaque = Some(fold(e.opaque, x)),
            }
        }
        Ok(e)
    }

    fold_into!(opaque_only; bool int float str bytes map ext);
}

impl<'de> Deserialize<'de> for BlockExtra<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BlockExtraVisitor)
    }
}

/// Position 9 of a stored array: Dynamo's `block_mm_infos` (an array, one entry per block, nil
/// for a block without multimodal content) or the first metadata field.
enum Ninth<'de> {
    MmInfos(Vec<Option<u64>>),
    Val(Val<'de>),
}

struct NinthVisitor;

impl<'de> Visitor<'de> for NinthVisitor {
    type Value = Ninth<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("block_mm_infos or group_idx")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Ninth<'de>, E> {
        Ok(Ninth::Val(Val::Nil))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Ninth<'de>, E> {
        Ok(Ninth::Val(Val::UInt(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Ninth<'de>, E> {
        Ok(Ninth::Val(match u64::try_from(v) {
            Ok(u) => Val::UInt(u),
            Err(_) => Val::Int(v),
        }))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Ninth<'de>, E> {
        Ok(Ninth::Val(Val::Float(v)))
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Ninth<'de>, E> {
        Ok(Ninth::Val(Val::Str(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Ninth<'de>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(Folded(x)) = seq.next_element()? {
            // A nil entry folds to the nil constant: no multimodal content in that block.
            out.push((x != fold_scalar(&[], 9)).then_some(x));
        }
        Ok(Ninth::MmInfos(out))
    }

    otherwise!(Ninth::Val(Val::Other); bool str bytes map ext);
}

impl<'de> Deserialize<'de> for Ninth<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NinthVisitor)
    }
}
