//! Where a model's chat template comes from, in the order vLLM and `transformers` look:
//! the configured file (`[models.NAME] chat_template`, vLLM's `--chat-template`), then
//! `chat_template` in `tokenizer_config.json`, then a `chat_template.jinja` beside
//! `tokenizer.json` (where recent `transformers` versions save it).

use crate::config::TokenizerConfig;
use crate::{ModelSpec, TokenizeError};

/// The templates, `(name, source)`, and the configuration field a template that does not
/// compile is reported under. Empty when the model has no chat template.
pub(crate) fn template_sources(
    model: &str,
    spec: &ModelSpec,
    config: &TokenizerConfig,
) -> Result<(Vec<(String, String)>, String), TokenizeError> {
    if let Some(path) = &spec.chat_template {
        let field = format!("models.{model}.chat_template");
        let source = std::fs::read_to_string(path).map_err(|e| {
            TokenizeError::new(&field, format!("cannot read {}: {e}", path.display()))
        })?;
        return Ok((vec![("default".to_string(), source)], field));
    }
    let field = format!("models.{model}.tokenizer");
    if !config.templates.is_empty() {
        return Ok((config.templates.clone(), field));
    }
    let jinja = spec.tokenizer.with_file_name("chat_template.jinja");
    match std::fs::read_to_string(&jinja) {
        Ok(source) => Ok((vec![("default".to_string(), source)], field)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Vec::new(), field)),
        Err(e) => Err(TokenizeError::new(
            field,
            format!("cannot read {}: {e}", jinja.display()),
        )),
    }
}
