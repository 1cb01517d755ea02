//! `kvroute mock-engine`'s command line, and the engine model's settings made from it.
//!
//! The engine knobs have vLLM's names and defaults (`--num-gpu-blocks`, `--max-num-seqs`,
//! `--max-num-batched-tokens`); step times are the replay's fitted curves (SPEC §10), divided by
//! `--speed`.

use std::path::PathBuf;

use kvroute_replay::SimConfig;

/// `kvroute mock-engine` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct MockEngineArgs {
    /// Address of the OpenAI-compatible HTTP server (port 0: any free port, printed on stdout).
    #[arg(long)]
    pub listen: String,
    /// ZMQ PUB endpoint of the KV events, as vLLM's `kv_events_config.endpoint`
    /// (`tcp://*:5557`; port 0: any free port, printed on stdout).
    #[arg(long)]
    pub kv_events: String,
    /// ZMQ ROUTER endpoint answering replay requests from the buffer of recent KV event messages.
    #[arg(long)]
    pub replay: Option<String>,
    /// Topic of the KV event messages.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Messages kept for replay.
    #[arg(long, default_value_t = 10_000)]
    pub replay_buffer: usize,
    /// The served model's name (requests naming another get 404).
    #[arg(long)]
    pub model: String,
    /// A LoRA adapter name the engine also serves (repeatable): `/v1/models` lists it with the
    /// model as `parent`, as vLLM does, and requests naming it are served as the model's.
    #[arg(long = "lora-adapter")]
    pub lora_adapters: Vec<String>,
    /// The model's Hugging Face `tokenizer.json`.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// A Jinja chat template [default: the `chat_template` of the `tokenizer_config.json` next to
    /// the tokenizer].
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Tokens per KV block (the router's block size must be the same).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Divide every step time by this (10 = ten times faster than the modelled GPU).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// KV blocks of the engine.
    #[arg(long, default_value_t = 16_384)]
    pub num_gpu_blocks: u32,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: u32,
    /// Token budget of one step (chunked prefill beyond it).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: u32,
    /// Tokens generated when a request sets no `max_tokens`.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u32,
    /// Milliseconds each render endpoint (`POST /v1/chat/completions/render`, ...) waits before
    /// it answers, to show a router's render deadline.
    #[arg(long, default_value_t = 0)]
    pub render_delay_ms: u64,
}

impl MockEngineArgs {
    /// The engine model's settings, checked.
    pub fn sim(&self) -> Result<SimConfig, String> {
        let sim = SimConfig {
            num_gpu_blocks: self.num_gpu_blocks,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            speedup: self.speed,
            kv_event_lag_ms: 0.0,
            ..SimConfig::default()
        };
        sim.validate().map_err(|e| {
            if e.contains("speed-up") {
                format!("--speed must be a positive number, got {}", self.speed)
            } else {
                format!("engine settings: {e}")
            }
        })?;
        if self.default_max_tokens == 0 {
            return Err("--default-max-tokens must be at least 1".into());
        }
        Ok(sim)
    }
}
