//! What the server needs of a tokenizer, as a small trait: a request body's prompt tokens (as
//! vLLM computes them, so the KV blocks the mock engine caches and reports are the ones the
//! router hashes for the same body) and the text of a generated token.
//!
//! The real implementation is `kvroute_tokenize::Model` (a Hugging Face `tokenizer.json` and a
//! chat template); the trait keeps the server and its tests independent of how tokens are made
//! (the crate's own tests use a byte tokenizer).

use serde_json::Value;

/// A request body's field that could not be read, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub reason: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// A model's tokenizer, as the mock engine uses it.
pub trait PromptTokenizer: Send + Sync + 'static {
    /// `/v1/completions`: the prompt's token ids.
    fn completion_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError>;
    /// `/v1/chat/completions`: the chat template's rendering of the body, tokenized.
    fn chat_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError>;
    /// `/v1/messages` (Anthropic): the chat rendering of the chat request vLLM converts it to.
    fn messages_tokens(&self, _body: &Value) -> Result<Vec<u32>, FieldError> {
        Err(FieldError::new(
            "messages",
            "this tokenizer has no chat template",
        ))
    }
    /// `/v1/responses`: the chat rendering of its instructions and input.
    fn responses_tokens(&self, _body: &Value) -> Result<Vec<u32>, FieldError> {
        Err(FieldError::new(
            "input",
            "this tokenizer has no chat template",
        ))
    }
    /// One token's text.
    fn token_text(&self, id: u32) -> String;
    /// A special token (`<s>`, `<|im_start|>`...): generated text leaves these out.
    fn is_special(&self, _id: u32) -> bool {
        false
    }
}

impl PromptTokenizer for kvroute_tokenize::Model {
    fn completion_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError> {
        kvroute_tokenize::Model::completion_tokens(self, body)
            .map_err(|e| FieldError::new(e.field, e.reason))
    }

    /// Media parts (images...) are tokenized as a stand-in text per media content
    /// (`kvroute_tokenize::media::media_stand_in`): the mock has no vision model, and its blocks
    /// past an image then differ per image, as vLLM's do (it keys them with the image's hash).
    fn chat_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError> {
        use kvroute_tokenize::media;
        let stood_in;
        let body = if media::first_media_message(body).is_some() {
            stood_in = media::map_media_parts(body, |p| Some(media::media_stand_in(p)));
            &stood_in
        } else {
            body
        };
        kvroute_tokenize::Model::chat_tokens(self, body)
            .map_err(|e| FieldError::new(e.field, e.reason))
    }

    fn messages_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError> {
        kvroute_tokenize::Model::messages_tokens(self, body)
            .map_err(|e| FieldError::new(e.field, e.reason))
    }

    fn responses_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError> {
        kvroute_tokenize::Model::responses_tokens(self, body)
            .map_err(|e| FieldError::new(e.field, e.reason))
    }

    fn token_text(&self, id: u32) -> String {
        kvroute_tokenize::Model::token_text(self, id)
    }

    fn is_special(&self, id: u32) -> bool {
        // Decoding leaves special tokens out (vLLM's default for generated text).
        self.decode(&[id]).is_ok_and(|t| t.is_empty())
    }
}

/// A tokenizer for tests: a completion prompt's (or each chat message's content's) bytes are its
/// tokens, and token `i`'s text is the byte `i` as a character.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl PromptTokenizer for ByteTokenizer {
    fn completion_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError> {
        match body.get("prompt") {
            Some(Value::String(s)) => Ok(s.bytes().map(u32::from).collect()),
            Some(_) => Err(FieldError::new("prompt", "must be a string")),
            None => Err(FieldError::new("prompt", "is required")),
        }
    }

    fn chat_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError> {
        let Some(Value::Array(msgs)) = body.get("messages") else {
            return Err(FieldError::new("messages", "must be an array"));
        };
        let mut out = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            let Some(Value::String(c)) = m.get("content") else {
                return Err(FieldError::new(
                    format!("messages[{i}].content"),
                    "must be a string",
                ));
            };
            out.extend(c.bytes().map(u32::from));
        }
        Ok(out)
    }

    /// The messages' string contents' bytes (as for chat).
    fn messages_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError> {
        self.chat_tokens(body)
    }

    /// A string `input`'s bytes.
    fn responses_tokens(&self, body: &Value) -> Result<Vec<u32>, FieldError> {
        match body.get("input") {
            Some(Value::String(s)) => Ok(s.bytes().map(u32::from).collect()),
            _ => Err(FieldError::new("input", "must be a string")),
        }
    }

    fn token_text(&self, id: u32) -> String {
        char::from_u32(id).map(String::from).unwrap_or_default()
    }
}
