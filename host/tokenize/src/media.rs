//! Chats with media parts (images, audio, video): what kvroute can say about their prompt.
//!
//! vLLM renders a media part as the model's placeholder tokens, expanded to the media's feature
//! size, and keys every KV block from the first of them on with the media's content hash
//! (`extra_keys`): kvroute has neither the model's processor nor the media's bytes, so it cannot
//! hash those blocks as vLLM does. It treats such a request as **uncached past its first media
//! part**: only the blocks wholly inside the rendering of the messages *before* the first message
//! that holds a media part can match, and they match exactly (they are text, keyed as the same
//! text of any other request). The cut is at that message's start, not at the part itself,
//! because where the placeholder lands inside its message is the model's business (vLLM puts the
//! placeholders of a string-content template before the message's text, for one).
//!
//! [`Model::chat_media_prompt`] gives that prefix, tokenized, and an estimate of the whole
//! prompt's length from its text alone (media parts dropped) for load accounting. The prefix is
//! the rendering of the truncated conversation without a generation prompt; its last token is
//! dropped (tokenized alone, it might merge with what follows). A template that refuses the
//! truncated conversation gives an empty prefix: nothing is counted as cached.

use serde_json::{Map, Value as Json};

use crate::{Model, TokenizeError};

/// Content part types that carry media (vLLM's parsers know each); any other non-text part is
/// still refused as before.
pub const MEDIA_PART_TYPES: [&str; 10] = [
    "image_url",
    "image_embeds",
    "image_pil",
    "input_image",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "video_embeds",
    "file",
];

/// What kvroute knows of a chat with media parts (see the module).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MediaPrompt {
    /// Index of the first message holding a media part.
    pub first_media_message: usize,
    /// The token ids that can match cached blocks: the rendering of the messages before it.
    pub prefix: Vec<u32>,
    /// The prompt's length as its text alone renders (media parts dropped), at least
    /// `prefix.len() + 1`: the images' own tokens are not counted.
    pub estimated_tokens: usize,
}

/// Whether a content part is a media part.
pub fn is_media_part(part: &Json) -> bool {
    part.get("type")
        .and_then(Json::as_str)
        .is_some_and(|t| MEDIA_PART_TYPES.contains(&t))
}

/// The index of the first message whose content list holds a media part.
pub fn first_media_message(body: &Json) -> Option<usize> {
    body.get("messages")?.as_array()?.iter().position(|m| {
        m.get("content")
            .and_then(Json::as_array)
            .is_some_and(|parts| parts.iter().any(is_media_part))
    })
}

/// `body` with every message's media parts replaced by `replace(part)` (`None`: dropped).
pub fn map_media_parts(body: &Json, replace: impl Fn(&Json) -> Option<Json>) -> Json {
    let mut out = body.clone();
    if let Some(messages) = out.get_mut("messages").and_then(Json::as_array_mut) {
        for m in messages {
            if let Some(parts) = m.get_mut("content").and_then(Json::as_array_mut) {
                let kept: Vec<Json> = parts
                    .iter()
                    .filter_map(|p| {
                        if is_media_part(p) {
                            replace(p)
                        } else {
                            Some(p.clone())
                        }
                    })
                    .collect();
                *parts = kept;
            }
        }
    }
    out
}

impl Model {
    /// For a chat body with media parts, the prefix that can match cached blocks and an
    /// estimate of the prompt's length (the module says how); `None` for a body without media
    /// parts (use [`Model::chat_tokens`]). Errors are the text's: the body with its media parts
    /// dropped is checked and rendered as any chat.
    pub fn chat_media_prompt(&self, body: &Json) -> Result<Option<MediaPrompt>, TokenizeError> {
        let Some(first) = first_media_message(body) else {
            return Ok(None);
        };
        let text_only = self.chat_tokens(&map_media_parts(body, |_| None))?;
        let mut prefix = if first == 0 {
            Vec::new()
        } else {
            let mut cut = body.clone();
            if let Some(Json::Array(messages)) = cut.get_mut("messages") {
                messages.truncate(first);
            }
            if let Some(obj) = cut.as_object_mut() {
                obj.insert("add_generation_prompt".into(), Json::Bool(false));
                obj.insert("continue_final_message".into(), Json::Bool(false));
            }
            self.chat_tokens(&cut).unwrap_or_default()
        };
        prefix.pop();
        Ok(Some(MediaPrompt {
            first_media_message: first,
            estimated_tokens: text_only.len().max(prefix.len() + 1),
            prefix,
        }))
    }
}

/// A stand-in text part for a media part, distinct per media content: what the mock engine
/// tokenizes in its place (it has no vision model), so two different images make different
/// blocks and the same image the same ones.
pub fn media_stand_in(part: &Json) -> Json {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    part.to_string().hash(&mut h);
    let kind = part.get("type").and_then(Json::as_str).unwrap_or("media");
    let mut m = Map::new();
    m.insert("type".into(), Json::String("text".into()));
    m.insert(
        "text".into(),
        Json::String(format!("[{kind} {:016x}]", h.finish())),
    );
    Json::Object(m)
}
