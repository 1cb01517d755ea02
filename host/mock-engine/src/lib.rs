//! `kvroute mock-engine`: a simulated LLM engine for demos and tests without GPUs.
//!
//! It runs the replay's engine model (`kvroute_replay::engine`: KV blocks, prefix cache,
//! chunked-prefill scheduling, preemption, step times) in real time behind an OpenAI-compatible
//! server, and publishes its KV events over ZMQ exactly as vLLM does, so a router in front of a
//! few of these exercises its real data path: tokenization, routing on real KV events (its
//! ingestion is the production one), streaming and the request lifecycle.
//!
//! # Pieces (each calls only those below it)
//! - [`config`]: the command line and the engine model's settings.
//! - [`http`]: the OpenAI routes; [`openai`] the wire types ([`agent_apis`] those of Anthropic's
//!   Messages and OpenAI's Responses APIs); [`error`] the error body;
//!   [`metrics`] the Prometheus text.
//! - [`engine_loop`]: the task that steps the engine in real time and delivers tokens.
//! - `table`: each live request's block hashes and its blocks' tokens (KV events carry tokens).
//! - [`publisher`]: the ZMQ PUB socket and the replay ROUTER socket.
//! - [`tokenizer`]: the tokenizer as the server needs it ([`PromptTokenizer`]).

pub mod agent_apis;
pub mod config;
pub mod engine_loop;
pub mod error;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod publisher;
mod table;
pub mod tokenizer;

use std::process::ExitCode;
use std::sync::Arc;

pub use config::MockEngineArgs;
pub use tokenizer::PromptTokenizer;

/// Capacity of each request's token channel (beyond it tokens wait in the request's own buffer).
const CHANNEL_CAPACITY: usize = 64;

/// Entry point of `kvroute mock-engine`.
pub fn cli_main(args: MockEngineArgs) -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

async fn serve(args: MockEngineArgs) -> Result<(), String> {
    let sim = args.sim()?;
    let spec = kvroute_tokenize::ModelSpec {
        chat_template: args.chat_template.clone(),
        block_size: Some(args.block_size),
        ..kvroute_tokenize::ModelSpec::new(args.tokenizer.clone())
    };
    let model = kvroute_tokenize::Model::load(&args.model, &spec).map_err(|e| {
        // The tokenize crate names configuration fields; here they are flags.
        let flag = if e.field.ends_with("chat_template") {
            "--chat-template"
        } else {
            "--tokenizer"
        };
        format!("{flag}: {}", e.reason)
    })?;
    let (bound, events) = publisher::start(publisher::PublisherConfig {
        kv_events: args.kv_events.clone(),
        replay: args.replay.clone(),
        topic: args.topic.clone(),
        buffer: args.replay_buffer,
        dp_rank: 0,
    })
    .await?;
    let engine = engine_loop::EngineLoop::spawn(sim, CHANNEL_CAPACITY, Some(events));
    let mut state = http::AppState::new(
        engine,
        Arc::new(model),
        args.model.clone(),
        args.default_max_tokens,
    );
    state.adapters = args.lora_adapters.clone();
    state.render_delay = std::time::Duration::from_millis(args.render_delay_ms);
    let state = Arc::new(state);
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    // The last line says everything is up (tests and scripts wait for it).
    println!("kv events on {}", bound.kv_events);
    if let Some(r) = &bound.replay {
        println!("kv events replay on {r}");
    }
    println!("kvroute mock-engine listening on http://{addr}");
    tracing::info!(%addr, model = %args.model, kv_events = %bound.kv_events, "mock engine serving");
    axum::serve(listener, http::router(state))
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(|e| format!("serving: {e}"))
}

async fn shutdown() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
