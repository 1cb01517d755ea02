//! The tokenizer cache: a long prompt whose history is unchanged since the last turn costs only
//! its new text, with ids identical to a full encode by construction.
//!
//! # Why a split is exact
//!
//! `tokenizers` 0.23 encodes a text in this order (`TokenizerImpl::encode_single_sequence`,
//! `AddedVocabulary::extract_and_normalize`):
//! 1. the added tokens with `normalized: false` are found in the raw text with a leftmost-longest
//!    Aho-Corasick automaton; each match becomes its token's id, and the text between matches
//!    becomes a piece (`find_matches`: `single_word` drops a match, `lstrip`/`rstrip` widen it
//!    over whitespace, `encode_special_tokens` skips special ones);
//! 2. each piece is normalized on its own and searched for the `normalized: true` tokens;
//! 3. the pre-tokenizer splits each remaining piece on its own, and the model tokenizes each of
//!    those words on its own;
//! 4. the post-processor adds the special tokens (`bos`...) around the whole.
//!
//! Nothing after step 1 looks across a step-1 match, and nothing looks at where a piece sits in
//! the text except Metaspace's `prepend_scheme: "first"`, which asks whether the piece starts at
//! offset 0. So the text can be cut just before a step-1 match of a "cut token" (one with none of
//! `single_word`, `lstrip`, `rstrip`, and not skipped by `encode_special_tokens`), each part
//! encoded alone (steps 1-3), and the parts' ids concatenated, provided each part after the first
//! keeps the cut token it starts with:
//! - the cut token in front gives the part's first words the same left neighbour (for
//!   `single_word`, `lstrip`) and a non-zero offset (for Metaspace "first") as in the whole text;
//! - the leftmost-longest search over a part finds the same matches as over the whole text: a
//!   match of the whole text that crossed the part's end would cover the next cut token's start,
//!   which is itself a match;
//! - a part's right end is the next cut token, which is kept from mattering: a cut token does not
//!   start with whitespace when some token has `rstrip` (which would eat into it), nor with a
//!   word character when some token has `single_word` (whose check reads the next character).
//!
//! Each part's ids are therefore a pure function of the part's text, cached under the text itself
//! (no hash collision can return another text's ids), and at run time a part must encode to ids
//! starting with its cut token's id, or the whole text is encoded instead (counted as a mismatch;
//! never seen). A tokenizer whose configuration breaks the argument is never split: a BPE with
//! dropout (random by design), a post-processor that changes ids without special tokens, two added
//! tokens with one content. Its texts are encoded whole (counted as `unsplit`).
//!
//! A whole request (a chat or completion body) is cached too, under a canonical encoding of its
//! JSON, when producing its prompt read nothing but the body (a chat template that called
//! `strftime_now` is rendered every time).
//!
//! Memory is bounded by a byte budget per model (`[models.NAME] tokenizer_cache_bytes`), entries
//! weighed by their key and ids; `quick_cache` (S3-FIFO, an LRU-like policy that resists scans)
//! evicts.

use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use quick_cache::sync::Cache;
use quick_cache::{DefaultHashBuilder, Equivalent, Lifecycle, Weighter};
use serde_json::Value as Json;
use tokenizers::{Encoding, ModelWrapper, Token, Tokenizer};

/// The default byte budget of one model's cache.
pub const DEFAULT_CACHE_BYTES: u64 = 64 << 20;

/// What a cache entry is keyed by: a part of a prompt text, or a request body.
const PART: u8 = 0;
pub(crate) const CHAT_REQUEST: u8 = 1;
pub(crate) const COMPLETION_REQUEST: u8 = 2;

/// A snapshot of one model's cache counters (monotonic, except the sizes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Parts of prompt texts found in the cache / encoded.
    pub part_hits: u64,
    pub part_misses: u64,
    /// Whole requests found in the cache / computed.
    pub request_hits: u64,
    pub request_misses: u64,
    /// Entries evicted (or refused for being larger than the budget allows).
    pub evictions: u64,
    /// Texts encoded whole because the tokenizer's configuration makes a split unsafe.
    pub unsplit: u64,
    /// Texts encoded whole because a part did not start with its cut token (never expected).
    pub mismatches: u64,
    /// Entries and their weight now; the budget.
    pub entries: u64,
    pub bytes: u64,
    pub capacity_bytes: u64,
}

#[derive(Default)]
struct Counters {
    part_hits: AtomicU64,
    part_misses: AtomicU64,
    request_hits: AtomicU64,
    request_misses: AtomicU64,
    evictions: AtomicU64,
    unsplit: AtomicU64,
    mismatches: AtomicU64,
}

#[derive(Hash, PartialEq, Eq)]
struct Key {
    kind: u8,
    bytes: Box<[u8]>,
}

/// A borrowed [`Key`] for look-ups: hashes as the `Key` it equals (derived `Hash` of `u8` then
/// `[u8]` in both).
#[derive(Hash)]
struct KeyRef<'a> {
    kind: u8,
    bytes: &'a [u8],
}

impl Equivalent<Key> for KeyRef<'_> {
    fn equivalent(&self, key: &Key) -> bool {
        self.kind == key.kind && *self.bytes == *key.bytes
    }
}

type Ids = Arc<[u32]>;

#[derive(Clone)]
struct Weigh;

impl Weighter<Key, Ids> for Weigh {
    fn weight(&self, key: &Key, ids: &Ids) -> u64 {
        // The key and ids on the heap, and the entry's own bookkeeping (roughly).
        (key.bytes.len() + ids.len() * 4 + 64) as u64
    }
}

#[derive(Clone)]
struct CountEvictions(Arc<Counters>);

impl Lifecycle<Key, Ids> for CountEvictions {
    type RequestState = ();
    fn begin_request(&self) {}
    fn on_evict(&self, _: &mut (), _: Key, _: Ids) {
        self.0.evictions.fetch_add(1, Relaxed);
    }
}

/// Where a text may be cut: every `normalized: false` added token (so the search matches the
/// tokenizer's own), and which of them are cut tokens.
struct Splitter {
    matcher: AhoCorasick,
    /// Per pattern: the token's id if it is a cut token.
    cut: Vec<Option<u32>>,
}

/// One model's tokenizer cache. `Send + Sync`.
pub(crate) struct TokenCache {
    /// `Err(reason)`: the tokenizer's configuration makes a split unsafe.
    splitter: Result<Splitter, String>,
    /// `None` when the budget is 0 (the cache is off; texts are encoded whole).
    cache: Option<Cache<Key, Ids, Weigh, DefaultHashBuilder, CountEvictions>>,
    capacity: u64,
    counters: Arc<Counters>,
}

impl TokenCache {
    pub fn new(tokenizer: &Tokenizer, budget_bytes: u64) -> TokenCache {
        let counters = Arc::new(Counters::default());
        let cache = (budget_bytes > 0).then(|| {
            let items = (budget_bytes / 2048).clamp(64, 1 << 20) as usize;
            Cache::with(
                items,
                budget_bytes,
                Weigh,
                DefaultHashBuilder::default(),
                CountEvictions(counters.clone()),
            )
        });
        TokenCache {
            splitter: Splitter::new(tokenizer),
            cache,
            capacity: budget_bytes,
            counters,
        }
    }

    /// Why texts are not split for this tokenizer, if they are not.
    pub fn unsplit_reason(&self) -> Option<&str> {
        self.splitter.as_ref().err().map(String::as_str)
    }

    pub fn stats(&self) -> CacheStats {
        let c = &self.counters;
        CacheStats {
            part_hits: c.part_hits.load(Relaxed),
            part_misses: c.part_misses.load(Relaxed),
            request_hits: c.request_hits.load(Relaxed),
            request_misses: c.request_misses.load(Relaxed),
            evictions: c.evictions.load(Relaxed),
            unsplit: c.unsplit.load(Relaxed),
            mismatches: c.mismatches.load(Relaxed),
            entries: self.cache.as_ref().map_or(0, |c| c.len() as u64),
            bytes: self.cache.as_ref().map_or(0, Cache::weight),
            capacity_bytes: self.capacity,
        }
    }

    /// A whole request's ids: from the cache, or `compute`d (which says whether its result
    /// depends on the body alone, and may then be kept).
    pub fn request<E>(
        &self,
        kind: u8,
        body: &Json,
        compute: impl FnOnce() -> Result<(Vec<u32>, bool), E>,
    ) -> Result<Vec<u32>, E> {
        let Some(cache) = &self.cache else {
            return compute().map(|(ids, _)| ids);
        };
        let mut key = Vec::with_capacity(256);
        canonical(body, &mut key);
        let look = KeyRef { kind, bytes: &key };
        if let Some(ids) = cache.get(&look) {
            self.counters.request_hits.fetch_add(1, Relaxed);
            return Ok(ids.to_vec());
        }
        self.counters.request_misses.fetch_add(1, Relaxed);
        let (ids, pure) = compute()?;
        if pure {
            let key = Key {
                kind,
                bytes: key.into_boxed_slice(),
            };
            cache.insert(key, Arc::from(ids.as_slice()));
        }
        Ok(ids)
    }

    /// `text`'s ids, as `tokenizer.encode_fast(text, add_special_tokens)` computes them.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> tokenizers::Result<Vec<u32>> {
        let (Some(cache), Ok(splitter)) = (&self.cache, &self.splitter) else {
            if self.cache.is_some() {
                self.counters.unsplit.fetch_add(1, Relaxed);
            }
            return full(tokenizer, text, add_special_tokens);
        };
        if text.is_empty() {
            return full(tokenizer, text, add_special_tokens);
        }
        let mut ids = Vec::with_capacity(text.len() / 3 + 8);
        let mut start = 0;
        let mut lead: Option<u32> = None;
        for m in splitter.matcher.find_iter(text) {
            let Some(id) = splitter.cut[m.pattern().as_usize()] else {
                continue;
            };
            if !self.part(cache, tokenizer, &text[start..m.start()], lead, &mut ids)? {
                return self.mismatch(tokenizer, text, add_special_tokens);
            }
            start = m.start();
            lead = Some(id);
        }
        if !self.part(cache, tokenizer, &text[start..], lead, &mut ids)? {
            return self.mismatch(tokenizer, text, add_special_tokens);
        }
        if add_special_tokens && tokenizer.get_post_processor().is_some() {
            return post_process(tokenizer, ids);
        }
        Ok(ids)
    }

    /// Appends `part`'s ids, which must start with `lead` (the cut token it starts with), if
    /// any; false if they do not.
    fn part(
        &self,
        cache: &Cache<Key, Ids, Weigh, DefaultHashBuilder, CountEvictions>,
        tokenizer: &Tokenizer,
        part: &str,
        lead: Option<u32>,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<bool> {
        if part.is_empty() {
            return Ok(true);
        }
        let look = KeyRef {
            kind: PART,
            bytes: part.as_bytes(),
        };
        let ids = match cache.get(&look) {
            Some(ids) => {
                self.counters.part_hits.fetch_add(1, Relaxed);
                ids
            }
            None => {
                self.counters.part_misses.fetch_add(1, Relaxed);
                let ids: Ids = tokenizer.encode_fast(part, false)?.get_ids().into();
                let key = Key {
                    kind: PART,
                    bytes: part.as_bytes().into(),
                };
                cache.insert(key, ids.clone());
                ids
            }
        };
        if lead.is_some() && ids.first().copied() != lead {
            return Ok(false);
        }
        out.extend_from_slice(&ids);
        Ok(true)
    }

    fn mismatch(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> tokenizers::Result<Vec<u32>> {
        self.counters.mismatches.fetch_add(1, Relaxed);
        full(tokenizer, text, add_special_tokens)
    }
}

/// The uncached path: what the tokenizer computes for the whole text.
pub(crate) fn full(
    tokenizer: &Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> tokenizers::Result<Vec<u32>> {
    Ok(tokenizer
        .encode_fast(text, add_special_tokens)?
        .get_ids()
        .to_vec())
}

/// The tokenizer's post-processor applied to `ids` (step 4), as `encode_fast` applies it: the
/// post-processors of `tokenizers` 0.23 place ids, never read token strings or offsets to choose
/// them.
fn post_process(tokenizer: &Tokenizer, ids: Vec<u32>) -> tokenizers::Result<Vec<u32>> {
    let tokens = ids
        .into_iter()
        .map(|id| Token::new(id, String::new(), (0, 0)))
        .collect();
    let encoding = Encoding::from_tokens(tokens, 0);
    Ok(tokenizer
        .post_process(encoding, None, true)?
        .get_ids()
        .to_vec())
}

impl Splitter {
    fn new(tokenizer: &Tokenizer) -> Result<Splitter, String> {
        if let ModelWrapper::BPE(bpe) = tokenizer.get_model() {
            if bpe.dropout.is_some_and(|p| p > 0.0) {
                return Err("the BPE model has dropout".into());
            }
        }
        if let Some(post) = tokenizer.get_post_processor() {
            let json = serde_json::to_value(post).map_err(|e| e.to_string())?;
            if !keeps_ids(&json) {
                return Err("the post-processor changes ids without special tokens".into());
            }
        }
        let mut tokens: Vec<(u32, tokenizers::AddedToken)> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| !t.normalized && !t.content.is_empty())
            .collect();
        tokens.sort_by_key(|(id, _)| *id);
        let mut contents: Vec<&str> = tokens.iter().map(|(_, t)| t.content.as_str()).collect();
        contents.sort_unstable();
        if contents.windows(2).any(|w| w[0] == w[1]) {
            return Err("two added tokens have the same content".into());
        }
        let any_single_word = tokens.iter().any(|(_, t)| t.single_word);
        let any_rstrip = tokens.iter().any(|(_, t)| t.rstrip);
        let skip_special = tokenizer.get_encode_special_tokens();
        static WORD_START: std::sync::LazyLock<regex::Regex> =
            std::sync::LazyLock::new(|| regex::Regex::new(r"^\w").unwrap());
        static SPACE_START: std::sync::LazyLock<regex::Regex> =
            std::sync::LazyLock::new(|| regex::Regex::new(r"^\s").unwrap());
        let cut = tokens
            .iter()
            .map(|(id, t)| {
                let cuts = !t.single_word
                    && !t.lstrip
                    && !t.rstrip
                    && !(t.special && skip_special)
                    && !(any_single_word && WORD_START.is_match(&t.content))
                    && !(any_rstrip && SPACE_START.is_match(&t.content));
                cuts.then_some(*id)
            })
            .collect();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(_, t)| t.content.as_str()))
            .map_err(|e| e.to_string())?;
        Ok(Splitter { matcher, cut })
    }
}

/// Whether a post-processor (as `tokenizer.json` serializes it) leaves ids as they are when no
/// special tokens are added: Bert, Roberta and ByteLevel return early; a template does when its
/// single-sequence form holds the sequence once.
fn keeps_ids(post: &Json) -> bool {
    match post.get("type").and_then(Json::as_str) {
        Some("BertProcessing" | "RobertaProcessing" | "ByteLevel") => true,
        Some("TemplateProcessing") => post["single"].as_array().is_some_and(|pieces| {
            pieces
                .iter()
                .filter(|p| p.get("Sequence").is_some())
                .count()
                == 1
        }),
        Some("Sequence") => post["processors"]
            .as_array()
            .is_some_and(|list| list.iter().all(keeps_ids)),
        _ => false,
    }
}

/// An injective encoding of a JSON value (object keys in their order, which reaches templates):
/// two bodies have one key only if they are equal.
fn canonical(value: &Json, out: &mut Vec<u8>) {
    fn len(n: usize, out: &mut Vec<u8>) {
        out.extend_from_slice(&(n as u64).to_le_bytes());
    }
    match value {
        Json::Null => out.push(0),
        Json::Bool(b) => out.push(1 + u8::from(*b)),
        Json::Number(n) => {
            if let Some(u) = n.as_u64() {
                out.push(3);
                out.extend_from_slice(&u.to_le_bytes());
            } else if let Some(i) = n.as_i64() {
                out.push(4);
                out.extend_from_slice(&i.to_le_bytes());
            } else {
                out.push(5);
                out.extend_from_slice(&n.as_f64().unwrap_or(f64::NAN).to_bits().to_le_bytes());
            }
        }
        Json::String(s) => {
            out.push(6);
            len(s.len(), out);
            out.extend_from_slice(s.as_bytes());
        }
        Json::Array(items) => {
            out.push(7);
            len(items.len(), out);
            for item in items {
                canonical(item, out);
            }
        }
        Json::Object(map) => {
            out.push(8);
            len(map.len(), out);
            for (k, v) in map {
                len(k.len(), out);
                out.extend_from_slice(k.as_bytes());
                canonical(v, out);
            }
        }
    }
}
