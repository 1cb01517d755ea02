//! `POST /v1/hash`: the block hashes kvroute computes for a prompt (SPEC §2), so a client that
//! sends `block_hashes`, or an engine integration that reports KV events, can check its own
//! hashing against the router's instead of against a table of vectors. Nothing is read from or
//! written to the index.

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::error::{ApiError, ApiJson};
use super::AppState;
use kvroute_core::hashing;

/// The request body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HashBody {
    pub tokens: Vec<u32>,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// The answer: every hash as a JSON integer (u64, decimal).
#[derive(Debug, Serialize)]
pub struct HashResponse {
    pub block_size: u32,
    /// The request's seed (1337 folded with the LoRA name and cache salt).
    pub seed: u64,
    /// Complete blocks (the tail that does not fill a block is not hashed).
    pub num_blocks: u32,
    pub local_hashes: Vec<u64>,
    pub sequence_hashes: Vec<u64>,
}

pub async fn hash(
    State(s): State<AppState>,
    ApiJson(body): ApiJson<HashBody>,
) -> Result<Json<HashResponse>, ApiError> {
    let config = s.router.config();
    if body.tokens.is_empty() {
        return Err(ApiError::invalid_field("tokens", "the prompt is empty"));
    }
    if body.tokens.len() > config.max_prompt_tokens {
        return Err(ApiError::invalid_field(
            "tokens",
            format!(
                "{} tokens; at most {} are accepted",
                body.tokens.len(),
                config.max_prompt_tokens
            ),
        ));
    }
    let seed = hashing::request_seed(body.lora_name.as_deref(), body.cache_salt.as_deref());
    let local = hashing::local_block_hashes(&body.tokens, config.block_size as usize, seed);
    let sequence = hashing::sequence_hashes(&local);
    Ok(Json(HashResponse {
        block_size: config.block_size,
        seed,
        num_blocks: local.len() as u32,
        local_hashes: local,
        sequence_hashes: sequence,
    }))
}
