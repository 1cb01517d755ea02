//! LoRA adapters learned from the engines (issue 34): each worker's own `GET /v1/models` lists the
//! adapters it serves as models whose `parent` is the base model (vLLM's `show_available_models`:
//! `{"id": "<adapter>", "parent": "<served model>", ...}`), statically loaded (`--lora-modules`) or
//! loaded at run time (`/v1/load_lora_adapter`).
//!
//! - **When**: a background task ([`Proxy::adapter_loop`](super::Proxy::adapter_loop)) polls a
//!   worker as soon as it is registered with an endpoint (the first tick after it joined), again
//!   every `proxy.adapter_poll_interval_ms`, and at once when its circuit breaker closes again.
//!   The request path only reads a lock-free snapshot; it never waits for a poll.
//! - **Bounded**: one poll at a time, each with a deadline (`ADAPTER_POLL_TIMEOUT`), an answer of
//!   at most `MAX_MODELS_BYTES`, at most `MAX_ADAPTERS_PER_WORKER` adapters kept per worker. A
//!   poll that fails keeps what the worker listed last (a worker that cannot answer cannot serve
//!   either; its breaker handles that).
//! - **What it means**: an adapter listed by a worker is served on that worker's model (the
//!   `model` it was registered with, or the only configured one). A request whose `model` names
//!   it is tokenized as that model, hashed with the adapter's name as its LoRA (as a configured
//!   `[models.NAME] adapters` entry is), and routed only to the workers that list it.
//!   `GET /v1/models` lists it with its parent.
//! - **Conflicts** are logged once each as errors naming both sides, and the adapter is not used
//!   (requests naming it get the unknown-model 404, as before): a listed adapter whose name is a
//!   configured model; one configured under another model; one listed by workers of two models.
//!   A configured adapter listed by its own model's workers is simply configured (it keeps being
//!   routed to every worker of its model).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use serde_json::Value;

use kvroute_core::candidate::WorkerId;
use kvroute_tokenize::ModelRegistry;

/// Deadline of one worker's `GET /v1/models`.
pub const ADAPTER_POLL_TIMEOUT: Duration = Duration::from_secs(2);
/// The most bytes of a `/v1/models` answer read.
pub const MAX_MODELS_BYTES: usize = 1 << 20;
/// The most adapters kept per worker (the rest are dropped, with a warning).
pub const MAX_ADAPTERS_PER_WORKER: usize = 1024;
/// The longest adapter name kept (as for configured ones).
const MAX_NAME_BYTES: usize = 256;

/// One learned adapter: the model it is served on and the workers that list it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LearnedAdapter {
    pub base: String,
    pub workers: BTreeSet<WorkerId>,
}

/// What one worker listed at its last successful poll.
#[derive(Clone, Debug)]
struct Listed {
    /// The kvroute model the worker serves (its adapters' base).
    base: String,
    /// `(adapter, parent as the engine names it)`.
    adapters: Vec<(String, String)>,
    polled: Instant,
}

/// The learned adapters: a snapshot the request path reads, and the per-worker listings.
#[derive(Default)]
pub struct LearnedAdapters {
    snap: ArcSwap<BTreeMap<String, LearnedAdapter>>,
    listed: Mutex<FxHashMap<WorkerId, Listed>>,
    /// Conflicts already logged (each once).
    logged: Mutex<FxHashSet<String>>,
}

impl LearnedAdapters {
    /// The learned adapter `name`, when it is usable.
    pub fn get(&self, name: &str) -> Option<LearnedAdapter> {
        self.snap.load().get(name).cloned()
    }

    /// Every usable learned adapter, by name.
    pub fn all(&self) -> Arc<BTreeMap<String, LearnedAdapter>> {
        self.snap.load_full()
    }

    /// When worker `w` was last polled successfully.
    pub(crate) fn polled_at(&self, w: WorkerId) -> Option<Instant> {
        self.listed.lock().get(&w).map(|l| l.polled)
    }

    /// Records worker `w`'s listing (its model `base`, the `(adapter, parent)` pairs of its
    /// `/v1/models`) and republishes.
    pub fn record(
        &self,
        w: WorkerId,
        base: &str,
        adapters: Vec<(String, String)>,
        models: &ModelRegistry,
    ) {
        self.listed.lock().insert(
            w,
            Listed {
                base: base.to_string(),
                adapters,
                polled: Instant::now(),
            },
        );
        self.rebuild(models);
    }

    /// Forgets the workers `keep` rejects (removed from the registry) and republishes.
    pub fn retain(&self, keep: impl Fn(WorkerId) -> bool, models: &ModelRegistry) {
        let before = {
            let mut l = self.listed.lock();
            let n = l.len();
            l.retain(|w, _| keep(*w));
            n != l.len()
        };
        if before {
            self.rebuild(models);
        }
    }

    /// Recomputes the usable adapters from every worker's listing and the configured models.
    fn rebuild(&self, models: &ModelRegistry) {
        let configured: BTreeMap<&str, &str> = models.adapters().collect();
        let mut claims: BTreeMap<String, BTreeMap<String, BTreeSet<WorkerId>>> = BTreeMap::new();
        {
            let listed = self.listed.lock();
            for (w, l) in listed.iter() {
                for (a, _) in &l.adapters {
                    claims
                        .entry(a.clone())
                        .or_default()
                        .entry(l.base.clone())
                        .or_default()
                        .insert(*w);
                }
            }
        }
        let mut out = BTreeMap::new();
        for (a, bases) in claims {
            let conflict = if models.get(&a).is_some() {
                Some(format!(
                    "worker(s) {} list LoRA adapter {a:?}, which is also the name of the configured model [models.{a}]: requests for {a:?} go to the model",
                    workers_of(&bases)
                ))
            } else if let Some(cfg) = configured.get(a.as_str()) {
                match bases.keys().find(|b| b.as_str() != *cfg) {
                    Some(other) => Some(format!(
                        "LoRA adapter {a:?} is configured under [models.{cfg}] but worker(s) {} of model {other:?} list it too: the configured parent is used",
                        workers_of(&bases)
                    )),
                    // Configured, and listed by its own model's workers: nothing to learn.
                    None => continue,
                }
            } else if bases.len() > 1 {
                Some(format!(
                    "LoRA adapter {a:?} is claimed by two parents: {}; requests naming it are refused until one parent remains",
                    bases
                        .iter()
                        .map(|(b, ws)| format!(
                            "model {b:?} (worker(s) {})",
                            ws.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(", ")
                        ))
                        .collect::<Vec<_>>()
                        .join(" and ")
                ))
            } else {
                None
            };
            if let Some(msg) = conflict {
                if self.logged.lock().insert(msg.clone()) {
                    tracing::error!(adapter = %a, "{msg}");
                }
                continue;
            }
            let (base, workers) = bases.into_iter().next().expect("a claim has a base");
            out.insert(a, LearnedAdapter { base, workers });
        }
        if out != **self.snap.load() {
            self.snap.store(Arc::new(out));
        }
    }
}

fn workers_of(bases: &BTreeMap<String, BTreeSet<WorkerId>>) -> String {
    bases
        .values()
        .flatten()
        .map(|w| w.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The adapters of a `/v1/models` answer: the entries whose `parent` is a string, as
/// `(id, parent)` (vLLM lists the base model with `parent: null`). At most
/// `MAX_ADAPTERS_PER_WORKER`; names over 256 bytes or with control characters are skipped.
pub fn parse_model_list(body: &[u8]) -> Result<Vec<(String, String)>, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let data = v
        .get("data")
        .and_then(Value::as_array)
        .ok_or("no `data` list")?;
    let mut out = Vec::new();
    for m in data {
        let (Some(id), Some(parent)) = (
            m.get("id").and_then(Value::as_str),
            m.get("parent").and_then(Value::as_str),
        ) else {
            continue;
        };
        if id.is_empty() || id.len() > MAX_NAME_BYTES || id.chars().any(char::is_control) {
            continue;
        }
        if out.len() == MAX_ADAPTERS_PER_WORKER {
            tracing::warn!(
                "an engine lists more than {MAX_ADAPTERS_PER_WORKER} LoRA adapters; the rest are ignored"
            );
            break;
        }
        out.push((id.to_string(), parent.to_string()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Models `base` (with the configured adapter `cfg`) and `other`.
    fn registry() -> ModelRegistry {
        let dir =
            std::env::temp_dir().join(format!("kvroute-adapters-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let spec = kvroute_tokenize::testing::test_model_spec(&dir).unwrap();
        let mut specs = BTreeMap::new();
        specs.insert(
            "base".to_string(),
            kvroute_tokenize::ModelSpec {
                adapters: vec!["cfg".into()],
                ..spec.clone()
            },
        );
        specs.insert("other".to_string(), spec);
        ModelRegistry::load_all(&specs).unwrap()
    }

    #[test]
    fn parses_vllms_listing() {
        let body = br#"{"object":"list","data":[
            {"id":"tiny","object":"model","root":"/m","parent":null},
            {"id":"tiny-lora","object":"model","root":"/l","parent":"tiny"},
            {"id":"","parent":"tiny"},
            {"id":"bad\u0001","parent":"tiny"}]}"#;
        assert_eq!(
            parse_model_list(body).unwrap(),
            vec![("tiny-lora".to_string(), "tiny".to_string())]
        );
        assert!(parse_model_list(b"{}").is_err());
        assert!(parse_model_list(b"nope").is_err());
    }

    #[test]
    fn learned_adapters_route_to_the_workers_that_list_them_and_conflicts_are_dropped() {
        let models = registry();
        let l = LearnedAdapters::default();
        let pair = |a: &str| (a.to_string(), "engine-name".to_string());
        l.record(
            1,
            "base",
            vec![pair("a"), pair("cfg"), pair("base")],
            &models,
        );
        l.record(2, "base", vec![pair("a")], &models);
        l.record(3, "other", vec![pair("b"), pair("cfg")], &models);
        let a = l.get("a").unwrap();
        assert_eq!(a.base, "base");
        assert_eq!(a.workers, BTreeSet::from([1, 2]));
        assert_eq!(l.get("b").unwrap().workers, BTreeSet::from([3]));
        // A model's name, and a configured adapter claimed by another model: not learned.
        assert!(l.get("base").is_none() && l.get("cfg").is_none());
        // Two parents: dropped until one remains.
        l.record(4, "other", vec![pair("a")], &models);
        assert!(l.get("a").is_none());
        l.retain(|w| w != 4, &models);
        assert_eq!(l.get("a").unwrap().workers, BTreeSet::from([1, 2]));
        // A worker that stops listing an adapter stops serving it.
        l.record(2, "base", vec![], &models);
        assert_eq!(l.get("a").unwrap().workers, BTreeSet::from([1]));
        assert_eq!(
            l.all().keys().cloned().collect::<Vec<_>>(),
            vec!["a".to_string(), "b".to_string()]
        );
    }
}
