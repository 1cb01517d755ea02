//! The request and response bodies of `/openapi.json`, every field with its description (the
//! words of docs/API.md). A unit test refuses a field without one; the HTTP walk in
//! `tests/http.rs` refuses a served field the document does not declare, so a field added to a
//! handler's answer without a description here fails a test.

use serde_json::{json, Value};

/// A property: its schema with a description.
fn d(mut schema: Value, description: &str) -> Value {
    schema["description"] = description.into();
    schema
}

fn int(description: &str) -> Value {
    d(json!({"type": "integer", "minimum": 0}), description)
}

fn u64_int(description: &str) -> Value {
    d(
        json!({"type": "integer", "format": "uint64", "minimum": 0}),
        description,
    )
}

fn num(description: &str) -> Value {
    d(json!({"type": "number"}), description)
}

fn string(description: &str) -> Value {
    d(json!({"type": "string"}), description)
}

fn opt_string(description: &str) -> Value {
    d(json!({"type": ["string", "null"]}), description)
}

fn boolean(description: &str) -> Value {
    d(json!({"type": "boolean"}), description)
}

fn strings(description: &str) -> Value {
    d(
        json!({"type": "array", "items": {"type": "string"}}),
        description,
    )
}

fn ints(description: &str) -> Value {
    d(
        json!({"type": "array", "items": {"type": "integer", "format": "uint64", "minimum": 0}}),
        description,
    )
}

/// An object schema from its required fields and its properties.
fn object(required: &[&str], properties: Value) -> Value {
    json!({"type": "object", "required": required, "properties": properties})
}

fn array_of(items: Value, description: &str) -> Value {
    d(json!({"type": "array", "items": items}), description)
}

/// A closed request object (unknown fields are a 400).
fn request(required: &[&str], properties: Value) -> Value {
    let mut o = object(required, properties);
    o["additionalProperties"] = false.into();
    o
}

fn merge(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

fn prompt_fields() -> Value {
    json!({
        "tokens": d(json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4294967295u64}}),
            "The prompt's token ids (exactly one of tokens / block_hashes); non-empty, at most limits.max_prompt_tokens."),
        "block_hashes": ints("The prompt as local block hashes (SPEC §2, as POST /v1/hash gives them); its length is then taken as count × block size."),
        "lora_name": opt_string("LoRA adapter name: part of the hash seed (SPEC §2); with tokens only."),
        "cache_salt": opt_string("Cache salt: part of the hash seed (SPEC §2); with tokens only."),
    })
}

/// The fields of a policy version (the listing leaves `trapping_imports` out).
fn policy_fields(trapping_imports: bool) -> Value {
    let stats = d(
        object(
            &["calls", "errors", "fallbacks", "p50_us", "p99_us"],
            json!({
                "calls": int("Decisions this version was asked for."),
                "errors": int("Failed decisions (trap, deadline, invalid answer, ...), all kinds together."),
                "fallbacks": int("Decisions answered with the native cost because of a failure."),
                "errors_by_kind": d(json!({"type": "object", "additionalProperties": {"type": "integer"}}), "Failures by kind (trap, deadline, memory_limit, ...); kinds with zero are left out."),
                "log_dropped": int("Plugin log lines dropped by the rate limit."),
                "p50_us": num("Median decision latency through the policy, in microseconds."),
                "p99_us": num("99th percentile decision latency, in microseconds."),
                "recent_failure_rate": num("Share of failed decisions among the last policy_runtime.failure_window."),
            }),
        ),
        "Counters of this version over its life.",
    );
    let plugin = d(
        object(
            &["name", "version", "abi_version", "deterministic", "kind"],
            json!({
                "name": string("The component's own name."),
                "version": string("The component's own version."),
                "abi_version": int("The policy interface version it was built against."),
                "deterministic": boolean("Whether it declares the same answer for the same input."),
                "kind": d(json!({"type": "string", "enum": ["scorer", "selector", "mixed"]}), "What it answers: costs (scorer), a pick (selector), or either."),
            }),
        ),
        "Single components: the component's description of itself.",
    );
    let mut f = json!({
        "name": string("The name it was loaded under."),
        "version": int("1 for the first load of a name, +1 per reload or reconfiguration."),
        "digest": string("sha256 of the component, hex (a pipeline: of its stages' digests, weights and configurations)."),
        "loaded_at": string("When it was loaded, RFC 3339, UTC."),
        "active": boolean("Whether this version serves decisions."),
        "config": string("The configuration JSON (a pipeline: its declaration)."),
        "plugin": plugin.clone(),
        "stages": array_of(object(&["role", "digest", "plugin", "config"], json!({
            "role": d(json!({"type": "string", "enum": ["scorer", "selector"]}), "What the stage does in the pipeline."),
            "digest": string("sha256 of the stage's component, hex."),
            "plugin": d(plugin, "The stage component's description of itself."),
            "weight": num("A scorer stage's weight in the sum."),
            "config": string("The stage's configuration JSON."),
        })), "Pipelines: their stages, scorers then the selector."),
        "instances": int("Instances alive."),
        "stats": stats,
    });
    if trapping_imports {
        f["trapping_imports"] = strings(
            "Imports linked as traps (e.g. WASI interfaces): calling one fails the decision.",
        );
    }
    f
}

const POLICY_REQUIRED: &[&str] = &["name", "version", "digest", "loaded_at", "active", "stats"];

fn version_marks() -> Value {
    json!({
        "current": boolean("The version PUT …/config and POST …/activate act on (the latest loaded)."),
        "rollback_target": boolean("The version POST /v1/policies/rollback would restore now."),
    })
}

/// `components.schemas`.
pub fn schemas() -> Value {
    let policy_ref = d(
        object(
            &["name", "version", "digest"],
            json!({
                "name": string("The policy's name."),
                "version": int("Its version, as in GET /v1/policies."),
                "digest": string("sha256 of the component, hex."),
            }),
        ),
        "The policy version that decided.",
    );
    json!({
        "Error": object(&["error"], json!({"error": d(object(&["code", "message"], json!({
            "code": string("Stable snake_case error code (docs/API.md §2)."),
            "message": string("What went wrong and what to do, for a person."),
            "field": string("The JSON path of the one field at fault, when one is."),
            "missing_taints": array_of(object(&["worker_id", "missing"], json!({
                "worker_id": u64_int("A worker the required taints kept out."),
                "missing": strings("The required taints it lacks."),
            })), "On a refusal for required_taints: each worker they kept out and the required taints it lacks."),
        })), "The error.")})),
        "WorkerSpec": d(request(&[], json!({
            "worker_id": u64_int("Optional: the path's id, repeated (400 if it differs)."),
            "dp_start": int("First data-parallel rank (default 0)."),
            "dp_size": d(json!({"type": "integer", "minimum": 1}), "Number of ranks, each a routing candidate (default 1)."),
            "taints": strings("Labels requests can require or prefer (duplicates removed)."),
            "total_kv_blocks": u64_int("KV capacity in blocks; 0 = unknown."),
            "max_num_batched_tokens": int("Prefill budget per engine step; 0 = unknown (never busy)."),
            "kv_events": d(request(&["endpoint"], json!({
                "endpoint": string("tcp://HOST:PORT of rank dp_start's publisher; rank r subscribes on PORT + r; a `*` host is connected as 127.0.0.1."),
                "replay_endpoint": opt_string("The engine's replay socket, offset per rank like endpoint (\"\" or null = none)."),
                "topic": string("ZMQ topic prefix filter (default \"\": everything)."),
            })), "Subscribe to the engine's KV events (SPEC §4)."),
        })), "Re-registering keeps the worker's draining flag, its bookings and its cached blocks (of the ranks it keeps); removed ranks lose theirs."),
        "WorkerPatch": request(&[], json!({
            "taints": strings("Replaces the worker's taints."),
            "draining": boolean("true: no new routes (bookings stay); false: routable again."),
        })),
        "Worker": object(&["worker_id", "dp_start", "dp_size", "taints", "draining", "total_kv_blocks", "max_num_batched_tokens", "learned", "ranks"], json!({
            "worker_id": u64_int("The worker's id."),
            "dp_start": int("First data-parallel rank."),
            "dp_size": int("Number of ranks."),
            "taints": strings("Its taints."),
            "draining": boolean("Whether it is draining (receives no new routes)."),
            "total_kv_blocks": u64_int("KV capacity in blocks; 0 = unknown."),
            "max_num_batched_tokens": int("Prefill budget per step; 0 = unknown."),
            "kv_events": d(object(&["endpoint", "topic"], json!({
                "endpoint": string("The engine's publisher, as registered."),
                "replay_endpoint": opt_string("The engine's replay socket, if any."),
                "topic": string("ZMQ topic prefix filter."),
            })), "Present when the worker was registered with kv_events."),
            "learned": d(object(&["prefill_ms_per_token", "queued_ms_per_token", "prefill_base_ms", "decode_step_ms", "prefill_samples", "decode_samples"], json!({
                "prefill_ms_per_token": num("Learned prefill ms per uncached prompt token (0: not learned yet)."),
                "queued_ms_per_token": num("Learned ms each prefill token booked ahead adds to the time to first token."),
                "prefill_base_ms": num("The fixed part of a time to first token, in ms."),
                "decode_step_ms": num("Learned ms per output token once decoding (0: not learned yet)."),
                "prefill_samples": u64_int("Time-to-first-token samples behind the prefill figures."),
                "decode_samples": u64_int("Output progress samples behind the decode figure."),
            })), "The worker's step times as the router learned them from the request lifecycle (SPEC §8.1); each figure 0 until 16 samples."),
            "ranks": array_of(object(&["dp_rank", "active_prefill_tokens", "active_decode_blocks", "active_requests", "cached_blocks", "host_cached_blocks", "disk_cached_blocks"], json!({
                "dp_rank": int("The rank."),
                "active_prefill_tokens": u64_int("Booked prompt tokens not yet prefilled (SPEC §8)."),
                "active_decode_blocks": u64_int("Booked KV blocks (SPEC §8)."),
                "active_requests": int("Bookings."),
                "cached_blocks": u64_int("Blocks the index holds for this rank on device."),
                "host_cached_blocks": u64_int("… in host memory."),
                "disk_cached_blocks": u64_int("… on disk and external storage."),
                "kv_feed": d(object(&["connected", "last_event_age_ms", "last_seq", "dead", "trust"], json!({
                    "connected": boolean("The subscription is connected to the engine's publisher."),
                    "last_event_age_ms": d(json!({"type": ["integer", "null"]}), "Milliseconds since its last message (null: none yet)."),
                    "last_seq": d(json!({"type": ["integer", "null"]}), "Sequence number of its last message (null: none yet)."),
                    "dead": boolean("Down for routing.dead_feed_after_ms: routing.dead_feed applies (SPEC §4.4)."),
                    "trust": d(json!({"type": "string", "enum": ["exact", "recovering", "degraded"]}), "How far the rank's index can be trusted to be the engine's cache (SPEC §4.4)."),
                    "engine_block_size": d(json!({"type": "integer"}), "Present while the engine's stores carry another block size than the router's: the engine's (its stores are dropped)."),
                })), "With kv_events only: the rank's KV event subscription."),
            })), "One per rank, in order."),
        })),
        "WorkerList": object(&["workers"], json!({"workers": array_of(json!({"$ref": "#/components/schemas/Worker"}), "Every worker, by increasing worker_id.")})),
        "Event": request(&["worker_id", "event"], json!({
            "worker_id": u64_int("The worker that stored or removed the blocks."),
            "storage_tier": string("device (default), host, disk, external, or an engine medium name (GPU, CPU_PINNED, NVME, …), case-insensitive."),
            "event": d(request(&["event_id", "data"], json!({
                "event_id": u64_int("Carried, not interpreted."),
                "dp_rank": int("The rank (default: the worker's dp_start)."),
                "data": d(json!({"oneOf": [
                    {"type": "string", "enum": ["cleared"]},
                    request(&["stored"], json!({"stored": d(object(&["blocks"], json!({
                        "parent_hash": d(json!({"type": ["integer", "null"]}), "The engine's handle of the block these follow (null: from the start)."),
                        "blocks": array_of(object(&["block_hash", "tokens_hash"], json!({
                            "block_hash": u64_int("The engine's handle of the block (SPEC §3.1)."),
                            "tokens_hash": u64_int("The block's local hash (SPEC §2), as POST /v1/hash gives it."),
                        })), "The blocks stored, in order."),
                    })), "Blocks the engine stored.")})),
                    request(&["removed"], json!({"removed": d(object(&["block_hashes"], json!({
                        "block_hashes": ints("Handles of the blocks removed."),
                    })), "Blocks the engine evicted.")})),
                ]}), "\"cleared\", {\"stored\": …} or {\"removed\": …} (SPEC §3.4)."),
            })), "The event."),
        })),
        "EventsResult": object(&["applied", "dropped", "errors"], json!({
            "applied": int("Events applied."),
            "dropped": int("Events dropped (each listed in errors)."),
            "errors": array_of(object(&["index", "code", "message"], json!({
                "index": int("The event's position in the array."),
                "code": string("Per-event code (docs/API.md §3.5)."),
                "message": string("What was wrong with it."),
            })), "One per dropped event."),
        })),
        "RouteRequest": request(&[], merge(prompt_fields(), json!({
            "request_id": string("Unique among booked and queued requests while booking (default: generated, kvr- + 16 hex digits)."),
            "tenant": opt_string("Who the request is for: fair queueing's tenant and the budget it counts against (SPEC §9; default: `default`)."),
            "session_id": opt_string("The request's session (1 to 256 bytes, no control characters): bound to the worker of its first booked turn ([sessions], SPEC §12); fair queueing's inner flow (SPEC §9). When absent, read from the headers x-kvroute-session-id, x-session-id, X-Dynamo-Session-ID, X-SMG-Routing-Key (the first present)."),
            "parent_session_id": opt_string("A subagent's parent session: a new session starts on its parent's worker unless that worker is busy. When absent, read from x-kvroute-parent-session-id or X-Dynamo-Parent-Session-ID."),
            "routing_constraints": d(request(&[], json!({
                "required_taints": strings("Hard: candidates must have every one (SPEC §6)."),
                "preferred_taints": d(json!({"type": "object", "additionalProperties": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1}}), "Soft preferences by taint, each weight strictly between −1 and 1; positive = preferred (SPEC §7)."),
            })), "Hard and soft taint constraints."),
            "allowed_worker_ids": ints("Hard: only these workers."),
            "pinned_worker": d(request(&["worker_id"], json!({
                "worker_id": u64_int("The worker."),
                "dp_rank": int("The rank (default: any of its ranks)."),
            })), "Route to this worker (or rank) or fail (SPEC §6)."),
            "priority": d(json!({"type": "number", "minimum": 0}), "Within-class queue boost (SPEC §9); passed to the policy."),
            "priority_class": d(json!({"type": "integer"}), "Strict queue class, higher served first (SPEC §9)."),
            "expected_output_tokens": int("Passed to the policy."),
            "temperature": d(json!({"type": "number", "minimum": 0}), "Picker temperature (SPEC §7; default routing.default_temperature)."),
            "book": boolean("false = ask only: nothing is booked, nothing queues (default true)."),
            "explain": boolean("Add every candidate's figures and the excluded ones to the answer."),
        }))),
        "RouteDecision": object(&["request_id", "worker_id", "dp_rank", "overlap_blocks", "overlap_source", "cached_tokens", "policy", "fallback", "queued_ms"], json!({
            "request_id": string("Given or generated."),
            "worker_id": u64_int("The chosen worker."),
            "dp_rank": int("The chosen rank."),
            "overlap_blocks": int("Prompt blocks the chosen candidate holds on device (SPEC §5)."),
            "overlap_source": d(json!({"type": "string", "enum": ["local", "remote", "none"]}), "Where the overlaps came from: this router's index (local), the remote indexer of serve --remote-indexer (remote), or nowhere because the remote indexer failed or timed out (none: every candidate was scored with zero overlap)."),
            "cached_tokens": int("min(overlap_blocks × block size, prompt tokens)."),
            "policy": policy_ref,
            "fallback": boolean("Whether the native cost answered because the policy failed."),
            "fallback_reason": string("Present when fallback: why (trap, deadline, invalid_answer, ...)."),
            "queued_ms": int("Time spent in the queue (0 when routed at once)."),
            "answer": d(json!({"type": "string", "enum": ["costs", "pick", "native"]}), "With explain: what the policy answered, or native when the native cost decided."),
            "candidates": array_of(object(&["worker_id", "dp_rank", "overlap_blocks", "active_prefill_tokens", "active_decode_blocks", "taints", "cost"], json!({
                "worker_id": u64_int("The candidate's worker."),
                "dp_rank": int("Its rank."),
                "overlap_blocks": int("Prompt blocks it holds on device: the deeper of the index's and the predicted overlap."),
                "predicted_overlap_blocks": int("Prompt blocks predict-on-route assumes it holds (routed there within routing.predict_ttl_ms, not contradicted by its KV events); 0 when off."),
                "host_overlap_blocks": int("… in host memory."),
                "disk_overlap_blocks": int("… on disk (the deeper of disk and external)."),
                "active_prefill_tokens": u64_int("Booked prompt tokens not yet prefilled."),
                "active_decode_blocks": u64_int("Booked KV blocks."),
                "active_requests": int("Bookings."),
                "kv_feed_trust": d(json!({"type": "string", "enum": ["exact", "recovering", "degraded"]}), "How far its overlaps can be trusted: its KV event feed's trust state (exact without a feed; SPEC §4.4), the policy column kv-feed-trust."),
                "session_bound": d(json!({"type": "integer", "enum": [0, 1, 2]}), "The policy column session-bound (SPEC §12): 1 the candidate holds the request's session binding, 2 its parent session's (a subagent's first turn), 0 neither."),
                "taints": strings("Its taints."),
                "base_cost": num("Native cost without preferences (SPEC §7)."),
                "cost": num("What the pick was made from: the policy's cost when it answered costs, else the native cost (ranks for non-admin clients, docs/API.md §3.6)."),
                "chosen": boolean("The candidate the decision chose."),
            })), "With explain: every eligible candidate."),
            "excluded": array_of(object(&["worker_id", "dp_rank", "reason", "overlap_blocks", "active_prefill_tokens"], json!({
                "worker_id": u64_int("The candidate's worker."),
                "dp_rank": int("Its rank."),
                "reason": d(json!({"type": "string", "enum": ["not_allowed", "missing_required_taints", "draining", "kv_feed_dead", "busy"]}), "The first hard rule it failed (SPEC §6)."),
                "missing_taints": strings("With missing_required_taints only: the required taints the candidate lacks."),
                "overlap_blocks": int("Prompt blocks it holds on device."),
                "active_prefill_tokens": u64_int("Booked prompt tokens not yet prefilled."),
            })), "With explain: the candidates considered (the pinned worker's ranks when pinned) that a hard rule kept out, with the first rule each failed."),
        })),
        "Lifecycle": object(&["request_id", "status"], json!({
            "request_id": string("The request."),
            "status": d(json!({"type": "string", "enum": ["prefill_complete", "output_recorded", "freed", "cancelled"]}), "What was recorded."),
            "worker_id": u64_int("Its worker (absent when a queued request was cancelled)."),
            "dp_rank": int("Its rank (absent when a queued request was cancelled)."),
        })),
        "Output": request(&["tokens"], json!({"tokens": int("Output tokens so far (a total, not a delta; a smaller total is ignored).")})),
        "OverlapRequest": request(&[], prompt_fields()),
        "HashRequest": request(&["tokens"], json!({
            "tokens": d(json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4294967295u64}}), "The prompt's token ids; non-empty, at most limits.max_prompt_tokens."),
            "lora_name": opt_string("LoRA adapter name: part of the hash seed (SPEC §2)."),
            "cache_salt": opt_string("Cache salt: part of the hash seed (SPEC §2)."),
        })),
        "Hashes": object(&["block_size", "seed", "num_blocks", "local_hashes", "sequence_hashes"], json!({
            "block_size": int("The router's block size."),
            "seed": u64_int("The request's seed: 1337 with the LoRA name and cache salt folded in (SPEC §2)."),
            "num_blocks": int("Complete blocks (the tail that does not fill one is not hashed)."),
            "local_hashes": ints("Each block's local hash: what block_hashes expects and KV events carry as tokens_hash."),
            "sequence_hashes": ints("Each block's hash chained with everything before it."),
        })),
        "Overlap": object(&["block_size", "num_blocks", "workers"], json!({
            "block_size": int("The router's block size."),
            "num_blocks": int("Complete blocks in the prompt."),
            "workers": array_of(object(&["worker_id", "dp_rank", "device_blocks", "host_blocks", "disk_blocks"], json!({
                "worker_id": u64_int("The candidate's worker."),
                "dp_rank": int("Its rank."),
                "device_blocks": int("Prompt blocks it holds on device, from the first."),
                "host_blocks": int("… in host memory."),
                "disk_blocks": int("… on disk (the deeper of disk and external)."),
            })), "Every candidate holding at least the first block in some tier."),
        })),
        "Policy": object(POLICY_REQUIRED, policy_fields(true)),
        "PolicyList": object(&["active", "rollback_target", "policies"], json!({
            "active": opt_string("The active policy's name (null: the native cost serves)."),
            "rollback_target": d(json!({"type": ["object", "null"], "required": ["name", "version"], "properties": {
                "name": string("Its name."),
                "version": int("Its version."),
            }}), "The version POST /v1/policies/rollback would restore now (null: none)."),
            "policies": array_of(object(POLICY_REQUIRED, merge(policy_fields(false), json!({
                "versions": array_of(object(&["version", "digest", "loaded_at", "active", "current", "rollback_target"], merge(json!({
                    "version": int("The version."),
                    "digest": string("sha256 of its component, hex."),
                    "loaded_at": string("When it was loaded, RFC 3339, UTC."),
                    "active": boolean("Whether it serves decisions."),
                }), version_marks())), "Every loaded version of the name, by version."),
            }))), "The current version of every loaded name, plus the active version if it is an older one."),
        })),
        "PolicyDetail": object(&["name", "versions"], json!({
            "name": string("The policy's name."),
            "versions": array_of(object(POLICY_REQUIRED, merge(policy_fields(true), version_marks())), "Every loaded version of the name in full, by version."),
        })),
        "Session": object(&["session_id", "worker_id", "dp_rank", "age_ms", "idle_ms", "turns", "moves"], json!({
            "session_id": string("The session's id."),
            "worker_id": u64_int("The worker it is bound to."),
            "dp_rank": int("The rank it is bound to."),
            "parent_session_id": opt_string("Its parent session, when it was bound as a subagent."),
            "age_ms": u64_int("Since the binding was made."),
            "idle_ms": u64_int("Since its last booked turn (it expires at [sessions] ttl_ms)."),
            "turns": u64_int("Booked turns seen (in a cluster, other replicas' too)."),
            "moves": u64_int("Times it moved to another worker."),
        })),
        "SessionList": object(&["mode", "live", "sessions", "next_after"], json!({
            "mode": d(json!({"type": "string", "enum": ["hard", "soft", "off"]}), "[sessions] mode."),
            "live": int("Bindings held now."),
            "sessions": array_of(json!({"$ref": "#/components/schemas/Session"}), "This page."),
            "next_after": opt_string("Pass as after for the next page; null on the last page."),
        })),
        "Tenant": object(&["tenant", "weight", "attained_tokens", "waiting_requests", "waiting_prompt_tokens", "budget"], json!({
            "tenant": string("The tenant's name (requests without one are the tenant default)."),
            "weight": d(json!({"type": ["number", "null"]}), "Its fair-queueing weight ([fairness.tenants.NAME] weight, else [fairness] default_weight); null without fair queueing."),
            "attained_tokens": d(json!({"type": ["number", "null"]}), "Its attained service, tokens (uncached prompt plus output tokens of its booked requests), decayed with [fairness] half_life_secs; null without fair queueing."),
            "waiting_requests": int("Its requests waiting in the router's queue."),
            "waiting_prompt_tokens": u64_int("Their prompt tokens."),
            "budget": d(json!({"type": ["object", "null"], "required": ["requests_per_minute", "tokens_per_minute", "used_requests", "used_tokens"], "properties": {
                "requests_per_minute": d(json!({"type": ["integer", "null"]}), "[fairness.tenants.NAME] requests_per_minute (null: no limit)."),
                "tokens_per_minute": d(json!({"type": ["integer", "null"]}), "[fairness.tenants.NAME] tokens_per_minute (null: no limit)."),
                "used_requests": u64_int("Requests admitted in the last 60 s."),
                "used_tokens": u64_int("Their tokens (prompt plus expected output) in the last 60 s."),
            }}), "Its budgets and the sliding minute's use (null: it has none)."),
        })),
        "TenantList": object(&["fair_queue", "tenants", "next_after"], json!({
            "fair_queue": boolean("Whether [fairness] queue is on (weights and attained service apply)."),
            "tenants": array_of(json!({"$ref": "#/components/schemas/Tenant"}), "This page: the configured tenants, those with an account of attained service and those with a request waiting."),
            "next_after": opt_string("Pass as after for the next page; null on the last page."),
        })),
        "Cluster": object(&["cluster_name", "replica_id", "nats", "replica_timeout_ms", "replicas"], json!({
            "cluster_name": string("The cluster's name (`cluster_name`)."),
            "replica_id": string("This replica's id, random at each start: the origin tag of its writes and booking messages."),
            "nats": d(json!({"type": "string", "enum": ["connected", "reconnecting"]}), "This replica's connection to the NATS server."),
            "replica_timeout_ms": u64_int("A replica not heard from for this long is forgotten and its bookings dropped."),
            "replicas": array_of(object(&["replica_id", "last_seen_ms", "bookings"], json!({
                "replica_id": string("The replica's id."),
                "last_seen_ms": u64_int("Milliseconds since this replica last heard from it (0 for itself)."),
                "bookings": u64_int("Requests that replica booked itself and still holds, as its last heartbeat said."),
            })), "This replica and every other one heard from within replica_timeout_ms, sorted by replica_id."),
        })),
        "Health": object(&["status"], json!({"status": d(json!({"type": "string", "enum": ["ok"]}), "Always ok while the process serves.")})),
        "Ready": object(&["status", "policy"], json!({
            "status": d(json!({"type": "string", "enum": ["ready"]}), "Ready to route."),
            "policy": d(object(&["name", "version", "digest"], json!({
                "name": string("The active policy's name."),
                "version": int("Its version."),
                "digest": string("sha256 of its component, hex."),
            })), "The active policy."),
        })),
    })
}

/// Every property, at any depth, of `schema`, with its path (for the description test).
#[cfg(test)]
pub fn properties<'a>(schema: &'a Value, at: &str, out: &mut Vec<(String, &'a Value)>) {
    match schema {
        Value::Object(o) => {
            if let Some(Value::Object(props)) = o.get("properties") {
                for (k, v) in props {
                    let path = format!("{at}.{k}");
                    out.push((path.clone(), v));
                    properties(v, &path, out);
                }
            }
            for (k, v) in o.iter().filter(|(k, _)| *k != "properties") {
                properties(v, &format!("{at}/{k}"), out);
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                properties(v, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}
