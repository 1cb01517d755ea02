//! A small real tokenizer for tests and benchmarks, made on the spot so nothing is downloaded:
//! a byte-level BPE (the GPT-2 / Llama 3 / Qwen family's kind) trained with the `tokenizers`
//! crate on a few KB of English prose shipped in `testdata/prose.txt`, with a ChatML-like chat
//! template. Other crates' tests and the end-to-end tests use it through [`write_test_model`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

use crate::ModelSpec;

/// The training text (and a source of realistic prompts for tests and benchmarks).
pub const PROSE: &str = include_str!("../testdata/prose.txt");

pub const BOS: &str = "<s>";
pub const EOS: &str = "</s>";
const SPECIAL_TOKENS: [&str; 4] = [BOS, EOS, "<|im_start|>", "<|im_end|>"];

/// The test model's chat template: ChatML with the `bos_token` first, the tools (as JSON) in a
/// system turn, and `raise_exception` for an unknown role.
pub const CHAT_TEMPLATE: &str = "{{ bos_token }}\
{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}\
{% for message in messages %}\
{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\
{{ raise_exception('Unknown role: ' ~ message['role']) }}\
{% endif %}\
<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n\
{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Trains the test tokenizer and writes `tokenizer.json` and `tokenizer_config.json` (with
/// [`CHAT_TEMPLATE`], `bos_token` and `eos_token`) into `dir`, which must exist. The same
/// bytes every call. Returns the path of `tokenizer.json`.
pub fn write_test_model(dir: &Path) -> std::io::Result<PathBuf> {
    let tokenizer = train().map_err(std::io::Error::other)?;
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer)?;
    let mut config = BTreeMap::new();
    config.insert("bos_token", serde_json::json!(BOS));
    config.insert("eos_token", serde_json::json!(EOS));
    config.insert("chat_template", serde_json::json!(CHAT_TEMPLATE));
    config.insert(
        "tokenizer_class",
        serde_json::json!("PreTrainedTokenizerFast"),
    );
    let config = serde_json::to_string_pretty(&config).map_err(std::io::Error::other)?;
    std::fs::write(dir.join("tokenizer_config.json"), config)?;
    Ok(path)
}

/// [`write_test_model`] and a spec for it.
pub fn test_model_spec(dir: &Path) -> std::io::Result<ModelSpec> {
    Ok(ModelSpec::new(write_test_model(dir)?))
}

/// The trained tokenizer, serialized.
fn train() -> tokenizers::Result<String> {
    let byte_level = ByteLevel::new(false, true, true);
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(byte_level));
    tokenizer.with_decoder(Some(byte_level));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(1024)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(
            SPECIAL_TOKENS
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer.train(&mut trainer, PROSE.split("\n\n"))?;
    let bos = tokenizer
        .token_to_id(BOS)
        .ok_or("the trained tokenizer has no <s>")?;
    tokenizer.with_post_processor(Some(
        TemplateProcessing::builder()
            .try_single("<s> $A")?
            .try_pair("<s> $A <s> $B")?
            .special_tokens(vec![(BOS, bos)])
            .build()?,
    ));
    tokenizer.to_string(false)
}
