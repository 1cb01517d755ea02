//! The tokenizer cache (`cache.rs`) against full encodes: ids identical, always, over tokenizers
//! configured every way the split argument depends on (overlapping added tokens, `lstrip`,
//! `rstrip`, `single_word`, normalized added tokens, whitespace tokens, `encode_special_tokens`,
//! Metaspace "first", a prepending normalizer, lowercasing, Roberta and template
//! post-processors), random texts (special-token strings whole and cut, non-ASCII, whitespace at
//! every boundary), and every vendored chat template over random multi-turn conversations.

use std::path::Path;
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::{json, Value as Json};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::normalizers::{Lowercase, Prepend, Replace, Sequence as NormSeq, NFKC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::processors::roberta::RobertaProcessing;
use tokenizers::processors::sequence::Sequence as PostSeq;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, Tokenizer};

use super::TempDir;
use crate::cache::{full, TokenCache};
use crate::template::FIXED_NOW;
use crate::testing::{write_test_model, PROSE};
use crate::{Model, ModelSpec};

fn testdata() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata"))
}

/// The special-token strings the vendored chat templates write.
fn template_specials() -> &'static [String] {
    static SPECIALS: OnceLock<Vec<String>> = OnceLock::new();
    SPECIALS.get_or_init(|| {
        let re = regex::Regex::new(
            r"<\|[A-Za-z0-9_]+\|>|<｜[^｜]+｜>|\[/?[A-Z_]+\]|</?[a-z_]+>|<start_of_turn>|<end_of_turn>",
        )
        .unwrap();
        let mut out = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir(testdata().join("templates")).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) == Some("jinja") {
                let source = std::fs::read_to_string(&path).unwrap();
                out.extend(re.find_iter(&source).map(|m| m.as_str().to_string()));
            }
        }
        for t in ["<s>", "</s>", "<|im_start|>", "<|im_end|>"] {
            out.insert(t.to_string());
        }
        out.into_iter().collect()
    })
}

/// Added tokens beyond the specials, each exercising one rule of the tokenizer's split.
fn odd_tokens() -> Vec<AddedToken> {
    vec![
        // Longer than `<|im_start|>` from the same position: leftmost-longest wins.
        AddedToken::from("<|im_start|>user", true),
        AddedToken::from("<mask>", true).lstrip(true),
        AddedToken::from("<sep>", true).rstrip(true),
        AddedToken::from("word", false)
            .single_word(true)
            .normalized(false),
        AddedToken::from("  ", false).normalized(false),
        AddedToken::from("\n<|x|>", true),
        AddedToken::from("ab]", false).normalized(false),
        AddedToken::from("hello world", false),
        AddedToken::from("Ünïcode", false),
    ]
}

fn bpe_trained(
    normalizer: Option<NormalizerWrapper>,
    pre: Option<PreTokenizerWrapper>,
) -> Tokenizer {
    let mut tokenizer = Tokenizer::new(BPE::default());
    if let Some(n) = normalizer {
        tokenizer.with_normalizer(Some(n)).unwrap();
    }
    tokenizer.with_pre_tokenizer(pre);
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(600)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![
            AddedToken::from("<s>", true),
            AddedToken::from("</s>", true),
        ])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer.train(&mut trainer, PROSE.split("\n\n")).unwrap();
    tokenizer
}

fn bos_template(tokenizer: &Tokenizer) -> TemplateProcessing {
    let bos = tokenizer.token_to_id("<s>").unwrap();
    TemplateProcessing::builder()
        .try_single("<s> $A </s>")
        .unwrap()
        .special_tokens(vec![
            ("<s>", bos),
            ("</s>", tokenizer.token_to_id("</s>").unwrap()),
        ])
        .build()
        .unwrap()
}

/// Every tokenizer configuration the property tests run on, by name.
fn tokenizers() -> &'static Vec<(&'static str, Tokenizer)> {
    static ALL: OnceLock<Vec<(&'static str, Tokenizer)>> = OnceLock::new();
    ALL.get_or_init(|| {
        let dir = TempDir::new();
        let base = Tokenizer::from_file(write_test_model(dir.path()).unwrap()).unwrap();
        let specials: Vec<AddedToken> = template_specials()
            .iter()
            .map(|s| AddedToken::from(s.as_str(), true))
            .collect();
        let mut many = base.clone();
        many.add_special_tokens(specials.clone()).unwrap();
        many.add_tokens(odd_tokens()).unwrap();
        let mut skip_special = many.clone();
        skip_special.set_encode_special_tokens(true);
        let mut lower = many.clone();
        lower
            .with_normalizer(Some(NormSeq::new(vec![NFKC.into(), Lowercase.into()])))
            .unwrap();
        let mut roberta = many.clone();
        roberta.with_post_processor(Some(PostSeq::new(vec![
            ByteLevel::default().into(),
            RobertaProcessing::new(("</s>".into(), 2), ("<s>".into(), 1)).into(),
        ])));
        // Llama 2 / Mistral style: Metaspace, prefix "▁" on the text's first piece only.
        let mut metaspace = bpe_trained(
            None,
            Some(Metaspace::new('▁', PrependScheme::First, false).into()),
        );
        metaspace.add_special_tokens(specials.clone()).unwrap();
        metaspace.add_tokens(odd_tokens()).unwrap();
        let post = bos_template(&metaspace);
        metaspace.with_post_processor(Some(post));
        let mut metaspace_split = bpe_trained(
            None,
            Some(Metaspace::new('▁', PrependScheme::Always, true).into()),
        );
        metaspace_split
            .add_special_tokens(specials.clone())
            .unwrap();
        // Llama 2 "legacy": a normalizer that prepends "▁" to every piece and no pre-tokenizer.
        let legacy_norm: NormalizerWrapper = NormSeq::new(vec![
            Prepend::new("▁".into()).into(),
            Replace::new(" ", "▁").unwrap().into(),
        ])
        .into();
        let mut legacy = bpe_trained(Some(legacy_norm), None);
        legacy.add_special_tokens(specials).unwrap();
        legacy.add_tokens(odd_tokens()).unwrap();
        vec![
            ("base", base),
            ("many", many),
            ("encode_special_tokens", skip_special),
            ("nfkc_lowercase", lower),
            ("roberta", roberta),
            ("metaspace_first", metaspace),
            ("metaspace_split", metaspace_split),
            ("llama2_legacy", legacy),
        ]
    })
}

/// Texts made of the pieces a split could go wrong on.
fn text() -> impl Strategy<Value = String> {
    let mut specials: Vec<String> = template_specials().to_vec();
    specials.extend(odd_tokens().into_iter().map(|t| t.content));
    let cut = specials.clone();
    let words: Vec<&'static str> = PROSE.split_whitespace().take(400).collect();
    let piece = prop_oneof![
        4 => prop::sample::select(specials),
        1 => (prop::sample::select(cut), any::<prop::sample::Index>()).prop_map(|(s, i)| {
            let bounds: Vec<usize> = (0..=s.len()).filter(|b| s.is_char_boundary(*b)).collect();
            let b = bounds[i.index(bounds.len())];
            if b.is_multiple_of(2) { s[..b].to_string() } else { s[b..].to_string() }
        }),
        4 => prop::sample::select(words).prop_map(str::to_string),
        3 => prop::sample::select(vec![
            " ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n", "\u{a0}", "\u{3000}", "\n  ",
        ])
        .prop_map(str::to_string),
        2 => prop::sample::select(vec![
            "é", "日本語", "🙂", "ß", "e\u{301}", "Ω", "ﬁ", "ǅ", "١٢٣", "𝔘", "ÜNÏCODE", "Hello World",
            "hello world", "123", "4.5", "!!", "'s", "``", "word", "words", "<", ">", "|", "▁",
        ])
        .prop_map(str::to_string),
        1 => "\\PC{0,6}",
    ];
    prop::collection::vec(piece, 0..28).prop_map(|pieces| pieces.concat())
}

fn check_text(cache: &TokenCache, tokenizer: &Tokenizer, name: &str, text: &str) {
    for add in [false, true] {
        let expected = full(tokenizer, text, add).unwrap();
        // Cold, then warm (every part a hit).
        for round in ["cold", "warm"] {
            let ours = cache.encode(tokenizer, text, add).unwrap();
            assert_eq!(
                ours, expected,
                "{name} ({round}, add_special_tokens {add}): {text:?}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Any text, on every tokenizer: the cache's ids are the full encode's, cold and warm, and
    /// a text that extends a cached one (the next turn) too.
    #[test]
    fn cached_ids_are_the_full_encodes(a in text(), b in text()) {
        for (name, tokenizer) in tokenizers() {
            let cache = TokenCache::new(tokenizer, 1 << 20);
            check_text(&cache, tokenizer, name, &a);
            check_text(&cache, tokenizer, name, &format!("{a}{b}"));
            check_text(&cache, tokenizer, name, &format!("{b}{a}"));
            prop_assert_eq!(cache.stats().mismatches, 0, "{}", name);
        }
    }

    /// Under a budget too small for the texts, entries are evicted and ids stay exact.
    #[test]
    fn evicting_keeps_ids_exact(texts in prop::collection::vec(text(), 1..6)) {
        let (name, tokenizer) = &tokenizers()[1];
        let cache = TokenCache::new(tokenizer, 2048);
        for _ in 0..2 {
            for t in &texts {
                check_text(&cache, tokenizer, name, t);
            }
        }
    }
}

#[test]
fn the_split_is_taken_on_every_test_configuration() {
    for (name, tokenizer) in tokenizers() {
        let cache = TokenCache::new(tokenizer, 1 << 20);
        assert_eq!(cache.unsplit_reason(), None, "{name}");
    }
}

#[test]
fn unsafe_configurations_are_encoded_whole_and_counted() {
    let dir = TempDir::new();
    let base = Tokenizer::from_file(write_test_model(dir.path()).unwrap()).unwrap();
    // A template holding the sequence twice changes ids even without special tokens.
    let mut twice = base.clone();
    twice.with_post_processor(Some(
        TemplateProcessing::builder()
            .try_single("$A $A")
            .unwrap()
            .build()
            .unwrap(),
    ));
    let cache = TokenCache::new(&twice, 1 << 20);
    assert!(cache.unsplit_reason().unwrap().contains("post-processor"));
    let text = "<|im_start|>user\nhi<|im_end|>";
    assert_eq!(
        cache.encode(&twice, text, false).unwrap(),
        full(&twice, text, false).unwrap()
    );
    assert_eq!(cache.stats().unsplit, 1);

    let json = base.to_string(false).unwrap();
    let mut value: Json = serde_json::from_str(&json).unwrap();
    value["model"]["dropout"] = json!(0.5);
    let dropout: Tokenizer = value.to_string().parse().unwrap();
    let cache = TokenCache::new(&dropout, 1 << 20);
    assert!(cache.unsplit_reason().unwrap().contains("dropout"));
}

/// A chat body of `turns` random messages (system first sometimes), alternating user and
/// assistant, the contents random texts.
fn conversation() -> impl Strategy<Value = Vec<Json>> {
    (any::<bool>(), prop::collection::vec(text(), 2..7)).prop_map(|(system, contents)| {
        let mut messages = Vec::new();
        if system {
            messages.push(json!({"role": "system", "content": "You are helpful.\n"}));
        }
        for (i, content) in contents.into_iter().enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": content}));
        }
        messages
    })
}

/// The "many" tokenizer (every template's special tokens added) with each vendored template.
fn template_models() -> &'static Vec<(String, Model)> {
    static MODELS: OnceLock<(TempDir, Vec<(String, Model)>)> = OnceLock::new();
    &MODELS
        .get_or_init(|| {
            let dir = TempDir::new();
            write_test_model(dir.path()).unwrap();
            let (_, many) = &tokenizers()[1];
            let path = dir.path().join("tokenizer.json");
            many.save(&path, false).unwrap();
            let mut models = Vec::new();
            for entry in std::fs::read_dir(testdata().join("templates")).unwrap() {
                let template = entry.unwrap().path();
                if template.extension().and_then(|e| e.to_str()) != Some("jinja") {
                    continue;
                }
                let mut spec = ModelSpec::new(&path);
                spec.chat_template = Some(template.clone());
                let name = template.file_name().unwrap().to_string_lossy().into_owned();
                models.push((name, Model::load("m", &spec).unwrap()));
            }
            models.sort_by(|a, b| a.0.cmp(&b.0));
            (dir, models)
        })
        .1
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Every vendored template, a conversation and its next turn: `chat_tokens` (request and
    /// part caches) gives the full encode of the rendered prompt, each turn, twice.
    #[test]
    fn chat_tokens_are_the_full_encodes_over_every_template(
        messages in conversation(),
        next in text(),
    ) {
        FIXED_NOW.with(|n| n.set(Some(1_764_000_000)));
        for (name, model) in template_models() {
            assert_eq!(model.cache_unsplit_reason(), None);
            let mut turn = messages.clone();
            let body = json!({"messages": turn});
            let mut bodies = vec![body];
            turn.push(json!({"role": "assistant", "content": "Sure.\n"}));
            turn.push(json!({"role": "user", "content": next}));
            bodies.push(json!({"messages": turn, "add_generation_prompt": true}));
            for body in &bodies {
                let rendered = model.render_chat(body);
                for _ in 0..2 {
                    match (&rendered, model.chat_tokens(body)) {
                        (Ok(text), Ok(ids)) => {
                            let expected = model.encode_uncached(text, false).unwrap();
                            prop_assert_eq!(&ids, &expected, "{}: {:?}", name, text);
                        }
                        (Err(_), Err(_)) => {}
                        (Ok(text), Err(e)) => {
                            // An empty prompt is refused after encoding.
                            prop_assert!(text.is_empty(), "{}: {}", name, e);
                        }
                        (Err(e), Ok(_)) => prop_assert!(false, "{}: render failed ({}), tokens did not", name, e),
                    }
                }
            }
            prop_assert_eq!(model.cache_stats().mismatches, 0);
        }
    }
}

#[test]
fn a_repeated_request_is_a_request_hit_and_a_next_turn_reuses_parts() {
    let (model, _dir) = super::test_model();
    let history: Vec<Json> = (0..20)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": PROSE[i * 100..i * 100 + 300]})
        })
        .collect();
    let body = json!({"messages": history});
    let first = model.chat_tokens(&body).unwrap();
    let stats = model.cache_stats();
    assert_eq!((stats.request_hits, stats.request_misses), (0, 1));
    assert_eq!(model.chat_tokens(&body).unwrap(), first);
    let stats = model.cache_stats();
    assert_eq!((stats.request_hits, stats.request_misses), (1, 1));

    let mut next = history.clone();
    next.push(json!({"role": "user", "content": "And then?"}));
    let body = json!({"messages": next});
    let ids = model.chat_tokens(&body).unwrap();
    let text = model.render_chat(&body).unwrap();
    assert_eq!(ids, model.encode_uncached(&text, false).unwrap());
    let after = model.cache_stats();
    assert_eq!(after.request_misses, 2);
    // Every earlier message is a hit; the new message and the tail are new parts.
    assert!(after.part_hits - stats.part_hits >= 20, "{after:?}");
    assert!(after.part_misses - stats.part_misses <= 2, "{after:?}");
    assert!(after.bytes > 0 && after.bytes <= after.capacity_bytes);
}

#[test]
fn completions_are_cached_by_request_and_token_prompts_are_not() {
    let (model, _dir) = super::test_model();
    let body = json!({"prompt": "<s>Hello there<|im_end|> world"});
    let ids = model.completion_tokens(&body).unwrap();
    assert_eq!(
        ids,
        model
            .encode_uncached("<s>Hello there<|im_end|> world", true)
            .unwrap()
    );
    assert_eq!(model.completion_tokens(&body).unwrap(), ids);
    assert_eq!(model.cache_stats().request_hits, 1);
    let body = json!({"prompt": [1, 2, 3]});
    model.completion_tokens(&body).unwrap();
    model.completion_tokens(&body).unwrap();
    assert_eq!(model.cache_stats().request_misses, 1);
}

#[test]
fn a_prompt_that_read_the_clock_is_not_kept() {
    let dir = TempDir::new();
    let tokenizer = write_test_model(dir.path()).unwrap();
    let template = dir.path().join("clock.jinja");
    std::fs::write(
        &template,
        "{{ bos_token }}Today: {{ strftime_now('%d %b %Y') }}\n\
         {% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
    )
    .unwrap();
    let mut spec = ModelSpec::new(tokenizer);
    spec.chat_template = Some(template);
    let model = Model::load("m", &spec).unwrap();
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    FIXED_NOW.with(|n| n.set(Some(0)));
    let day0 = model.chat_tokens(&body).unwrap();
    FIXED_NOW.with(|n| n.set(Some(86_400 * 400)));
    let day400 = model.chat_tokens(&body).unwrap();
    assert_ne!(day0, day400);
    let stats = model.cache_stats();
    assert_eq!((stats.request_hits, stats.request_misses), (0, 2));
    FIXED_NOW.with(|n| n.set(None));
}

#[test]
fn a_zero_budget_turns_the_cache_off() {
    let dir = TempDir::new();
    let mut spec = ModelSpec::new(write_test_model(dir.path()).unwrap());
    spec.tokenizer_cache_bytes = Some(0);
    let model = Model::load("m", &spec).unwrap();
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let ids = model.chat_tokens(&body).unwrap();
    assert_eq!(model.chat_tokens(&body).unwrap(), ids);
    let stats = model.cache_stats();
    assert_eq!(stats, crate::CacheStats::default());
}

#[test]
fn equal_bodies_only_share_a_request_key() {
    let (model, _dir) = super::test_model();
    // Same strings, different structure: no collision of the canonical keys.
    let a = json!({"prompt": "ab", "x": "c"});
    let b = json!({"prompt": "ab", "xc": ""});
    let c = json!({"prompt": "ab", "x": 1});
    let d = json!({"prompt": "ab", "x": 1.0});
    for body in [&a, &b, &c, &d] {
        model.completion_tokens(body).unwrap();
    }
    assert_eq!(model.cache_stats().request_misses, 4);
    assert_eq!(model.cache_stats().request_hits, 0);
}
