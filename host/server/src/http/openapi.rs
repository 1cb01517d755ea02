//! `GET /openapi.json`: API v1 in OpenAPI 3.1, written by hand from API.md.
//!
//! A test walks every path and method here against the running server, so the document cannot
//! drift from what is served.

use serde_json::{json, Value};

fn error_response(desc: &str) -> Value {
    json!({"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

/// A retryable rejection: the error body and `Retry-After` (seconds).
fn retryable(desc: &str) -> Value {
    let mut r = error_response(desc);
    r["headers"] = json!({"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer", "minimum": 0}}});
    r
}

fn json_body(schema: &str) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}})
}

fn ok(desc: &str, schema: Option<&str>) -> Value {
    match schema {
        Some(s) => {
            json!({"description": desc, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{s}")}}}})
        }
        None => json!({"description": desc}),
    }
}

/// The document, with the statuses every admin operation (401, 403), every operation with a
/// body (413, 415) and every write without one (400 for a body with fields) can answer added
/// uniformly.
pub fn document() -> Value {
    let mut doc = base_document();
    add_disaggregation(&mut doc);
    if let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) {
        for item in paths.values_mut() {
            let Some(item) = item.as_object_mut() else {
                continue;
            };
            for (method, op) in item.iter_mut() {
                if method == "parameters" {
                    continue;
                }
                let admin = op.get("security").is_some();
                let body = op.get("requestBody").is_some();
                // A component over the size limit is 400 `component_too_large` (API.md).
                let component = op
                    .pointer("/requestBody/content/application~1wasm")
                    .is_some();
                let Some(responses) = op.get_mut("responses").and_then(Value::as_object_mut) else {
                    continue;
                };
                let mut add = |code: &str, desc: &str| {
                    responses
                        .entry(code)
                        .or_insert_with(|| error_response(desc));
                };
                if admin {
                    add("401", "No bearer token (with `WWW-Authenticate: Bearer`).");
                    add("403", "Wrong admin token, or no token configured and the client is not on loopback.");
                }
                if body {
                    add("400", "Malformed body.");
                    if !component {
                        add("413", "Body over the configured limit.");
                    }
                    add(
                        "415",
                        "Wrong Content-Type, or a Content-Encoding (bodies are sent uncompressed).",
                    );
                } else if method != "get" {
                    add(
                        "400",
                        "A body with fields: this operation takes none (send nothing, or {}).",
                    );
                }
            }
        }
    }
    doc
}

/// Disaggregated prefill/decode (API.md): worker roles and topology, the request's
/// `disaggregation`, the decision's prefill half, bypass and merged constraints, the `role`
/// exclusion and the 503s. Added to the base document's schemas rather than written into them, so
/// the feature's part of the contract reads in one place.
fn add_disaggregation(doc: &mut Value) {
    let role = json!({"type": "string", "enum": ["prefill", "decode", "both"], "description": "Which half of a disaggregated request the worker takes (default both)."});
    let topology = json!({"type": "object", "additionalProperties": {"type": "string"}, "description": "Domain -> value (e.g. zone -> us-east-1a); each entry is the host-derived taint topology/<domain>=<value>. Client taints starting with topology/ are refused."});
    let constraints = json!({"type": "object", "required": ["required_taints", "preferred_taints"], "properties": {
        "required_taints": {"type": "array", "items": {"type": "string"}},
        "preferred_taints": {"type": "object", "additionalProperties": {"type": "number"}}}});
    let schemas = &mut doc["components"]["schemas"];
    for (schema, fields) in [
        (
            "WorkerSpec",
            vec![("role", role.clone()), ("topology", topology.clone())],
        ),
        (
            "WorkerPatch",
            vec![("role", role.clone()), ("topology", topology.clone())],
        ),
        ("Worker", vec![("role", role), ("topology", topology)]),
        (
            "RouteRequest",
            vec![(
                "disaggregation",
                json!({"type": "string", "enum": ["auto", "off", "required"], "description": "auto (default): split into a prefill and a decode step when the fleet has prefill-role workers (or [disaggregation] enforce is on); off: aggregated (400 when enforce is on); required: split or 503 no_prefill_worker."}),
            )],
        ),
        (
            "RouteDecision",
            vec![
                (
                    "disaggregated",
                    json!({"type": "boolean", "description": "Split into a prefill and a decode half; worker_id/dp_rank are always where the request decodes."}),
                ),
                (
                    "prefill",
                    json!({"type": "object", "required": ["worker_id", "dp_rank", "overlap_blocks", "cached_tokens", "policy", "fallback"], "description": "The prefill half, when split; with explain also answer, candidates and excluded of the prefill step.", "properties": {
                "worker_id": {"type": "integer"}, "dp_rank": {"type": "integer"}, "overlap_blocks": {"type": "integer"}, "cached_tokens": {"type": "integer"},
                "policy": {"type": "object"}, "fallback": {"type": "boolean"}, "fallback_reason": {"type": "string"},
                "answer": {"type": "string", "enum": ["costs", "pick", "native"]}, "candidates": {"type": "array"}, "excluded": {"type": "array"}}}),
                ),
                (
                    "bypass",
                    json!({"type": "string", "enum": ["isl_bounding", "prefill_load"], "description": "The bypass rule that kept the prefill on the decode worker."}),
                ),
                (
                    "topology_constraints",
                    json!({"description": "The KV transfer's constraints merged into the decode step's, when split.", "allOf": [constraints]}),
                ),
            ],
        ),
    ] {
        for (name, value) in fields {
            schemas[schema]["properties"][name] = value;
        }
    }
    if let Some(reasons) = schemas
        .pointer_mut("/RouteDecision/properties/excluded/items/properties/reason/enum")
        .and_then(Value::as_array_mut)
    {
        reasons.insert(0, json!("role"));
    }
    let route_503 = doc.pointer_mut("/paths/~1v1~1route/post/responses/503/description");
    if let Some(d) = route_503 {
        *d = json!("No eligible worker; with disaggregation also `no_prefill_worker`, `no_decode_worker_in_domain` (nothing booked) and `kv_transfer_domain_unknown`.");
    }
}

fn base_document() -> Value {
    let worker_id = json!({"name": "worker_id", "in": "path", "required": true, "schema": {"type": "integer", "format": "uint64", "minimum": 0}});
    let request_id =
        json!({"name": "request_id", "in": "path", "required": true, "schema": {"type": "string"}});
    let name =
        json!({"name": "name", "in": "path", "required": true, "schema": {"type": "string"}});
    let admin = json!([{"bearer": []}]);
    json!({
        "openapi": "3.1.0",
        "info": {"title": "kvroute", "version": "1", "description": "KV-cache-aware request router, HTTP API v1."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {
                    "code": {"type": "string"}, "message": {"type": "string"}, "field": {"type": "string"}}}}},
                "WorkerSpec": {"type": "object", "additionalProperties": false, "description": "Re-registering keeps the worker's draining flag, its bookings and its cached blocks (of the ranks it keeps); removed ranks lose theirs.", "properties": {
                    "worker_id": {"type": "integer", "description": "Optional: the path's id, repeated (400 if it differs)."},
                    "dp_start": {"type": "integer", "minimum": 0}, "dp_size": {"type": "integer", "minimum": 1},
                    "taints": {"type": "array", "items": {"type": "string"}},
                    "total_kv_blocks": {"type": "integer", "minimum": 0}, "max_num_batched_tokens": {"type": "integer", "minimum": 0},
                    "kv_events": {"type": "object", "additionalProperties": false, "required": ["endpoint"], "properties": {
                        "endpoint": {"type": "string", "description": "tcp://HOST:PORT of rank dp_start's publisher; rank r subscribes on PORT + r; a `*` host is connected as 127.0.0.1."}, "replay_endpoint": {"type": ["string", "null"]}, "topic": {"type": "string"}}}}},
                "WorkerPatch": {"type": "object", "additionalProperties": false, "properties": {
                    "taints": {"type": "array", "items": {"type": "string"}}, "draining": {"type": "boolean"}}},
                "Worker": {"type": "object", "required": ["worker_id", "dp_start", "dp_size", "taints", "draining", "ranks"], "properties": {
                    "worker_id": {"type": "integer"}, "dp_start": {"type": "integer"}, "dp_size": {"type": "integer"},
                    "taints": {"type": "array", "items": {"type": "string"}}, "draining": {"type": "boolean"},
                    "ranks": {"type": "array", "items": {"type": "object", "required": ["dp_rank", "active_prefill_tokens", "active_decode_blocks", "active_requests", "cached_blocks"], "properties": {
                        "dp_rank": {"type": "integer"}, "active_prefill_tokens": {"type": "integer"}, "active_decode_blocks": {"type": "integer"},
                        "active_requests": {"type": "integer"}, "cached_blocks": {"type": "integer"}}}}}},
                "WorkerList": {"type": "object", "required": ["workers"], "properties": {"workers": {"type": "array", "items": {"$ref": "#/components/schemas/Worker"}}}},
                "Event": {"type": "object", "additionalProperties": false, "required": ["worker_id", "event"], "properties": {
                    "worker_id": {"type": "integer"}, "storage_tier": {"type": "string", "enum": ["device", "host", "disk", "external"]},
                    "event": {"type": "object", "additionalProperties": false, "required": ["event_id", "data"], "properties": {
                        "event_id": {"type": "integer"}, "dp_rank": {"type": "integer"},
                        "data": {"oneOf": [
                            {"type": "string", "enum": ["cleared"]},
                            {"type": "object", "additionalProperties": false, "required": ["stored"], "properties": {"stored": {"type": "object", "required": ["blocks"], "properties": {
                                "parent_hash": {"type": ["integer", "null"]},
                                "blocks": {"type": "array", "items": {"type": "object", "required": ["block_hash", "tokens_hash"], "properties": {"block_hash": {"type": "integer"}, "tokens_hash": {"type": "integer"}}}}}}}},
                            {"type": "object", "additionalProperties": false, "required": ["removed"], "properties": {"removed": {"type": "object", "required": ["block_hashes"], "properties": {
                                "block_hashes": {"type": "array", "items": {"type": "integer"}}}}}}]}}}}},
                "EventsResult": {"type": "object", "required": ["applied", "dropped", "errors"], "properties": {
                    "applied": {"type": "integer"}, "dropped": {"type": "integer"},
                    "errors": {"type": "array", "items": {"type": "object", "required": ["index", "code", "message"], "properties": {"index": {"type": "integer"}, "code": {"type": "string"}, "message": {"type": "string"}}}}}},
                "RouteRequest": {"type": "object", "additionalProperties": false, "properties": {
                    "request_id": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4294967295u64}},
                    "block_hashes": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "lora_name": {"type": ["string", "null"]}, "cache_salt": {"type": ["string", "null"]}, "session_id": {"type": ["string", "null"]},
                    "routing_constraints": {"type": "object", "additionalProperties": false, "properties": {
                        "required_taints": {"type": "array", "items": {"type": "string"}},
                        "preferred_taints": {"type": "object", "additionalProperties": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1}}}},
                    "allowed_worker_ids": {"type": "array", "items": {"type": "integer"}},
                    "pinned_worker": {"type": "object", "additionalProperties": false, "required": ["worker_id"], "properties": {"worker_id": {"type": "integer"}, "dp_rank": {"type": "integer"}}},
                    "priority": {"type": "number", "minimum": 0}, "priority_class": {"type": "integer"},
                    "expected_output_tokens": {"type": "integer", "minimum": 0}, "temperature": {"type": "number", "minimum": 0},
                    "book": {"type": "boolean"}, "explain": {"type": "boolean"}}},
                "RouteDecision": {"type": "object", "required": ["request_id", "worker_id", "dp_rank", "overlap_blocks", "cached_tokens", "policy", "fallback", "queued_ms"], "properties": {
                    "request_id": {"type": "string"}, "worker_id": {"type": "integer"}, "dp_rank": {"type": "integer"},
                    "overlap_blocks": {"type": "integer"}, "cached_tokens": {"type": "integer"},
                    "policy": {"type": "object", "required": ["name", "version", "digest"], "properties": {"name": {"type": "string"}, "version": {"type": "integer", "description": "As in GET /v1/policies."}, "digest": {"type": "string"}}},
                    "fallback": {"type": "boolean"}, "fallback_reason": {"type": "string"}, "queued_ms": {"type": "integer"},
                    "answer": {"type": "string", "enum": ["costs", "pick", "native"], "description": "With explain: what the policy answered, or native when the native cost decided."},
                    "candidates": {"type": "array", "items": {"type": "object", "required": ["worker_id", "dp_rank", "overlap_blocks", "active_prefill_tokens", "active_decode_blocks", "taints", "cost"], "properties": {
                        "worker_id": {"type": "integer"}, "dp_rank": {"type": "integer"}, "overlap_blocks": {"type": "integer"},
                        "active_prefill_tokens": {"type": "integer"}, "active_decode_blocks": {"type": "integer"},
                        "taints": {"type": "array", "items": {"type": "string"}}, "cost": {"type": "number", "description": "What the pick was made from: the policy's cost when it answered costs, else the native cost."},
                        "chosen": {"type": "boolean"}}}},
                    "excluded": {"type": "array", "description": "With explain: the candidates considered (the pinned worker's ranks when pinned) that a hard rule kept out, with the first rule each failed.", "items": {"type": "object", "required": ["worker_id", "dp_rank", "reason", "overlap_blocks", "active_prefill_tokens"], "properties": {
                        "worker_id": {"type": "integer"}, "dp_rank": {"type": "integer"},
                        "reason": {"type": "string", "enum": ["not_allowed", "missing_required_taints", "draining", "busy"]},
                        "overlap_blocks": {"type": "integer"}, "active_prefill_tokens": {"type": "integer"}}}}}},
                "Lifecycle": {"type": "object", "required": ["request_id", "status"], "properties": {"request_id": {"type": "string"}, "status": {"type": "string"}, "worker_id": {"type": "integer"}, "dp_rank": {"type": "integer"}}},
                "Output": {"type": "object", "additionalProperties": false, "required": ["tokens"], "properties": {"tokens": {"type": "integer", "minimum": 0}}},
                "OverlapRequest": {"type": "object", "additionalProperties": false, "properties": {
                    "tokens": {"type": "array", "items": {"type": "integer"}}, "block_hashes": {"type": "array", "items": {"type": "integer"}},
                    "lora_name": {"type": ["string", "null"]}, "cache_salt": {"type": ["string", "null"]}}},
                "HashRequest": {"type": "object", "additionalProperties": false, "required": ["tokens"], "properties": {
                    "tokens": {"type": "array", "items": {"type": "integer"}},
                    "lora_name": {"type": ["string", "null"]}, "cache_salt": {"type": ["string", "null"]}}},
                "Hashes": {"type": "object", "required": ["block_size", "seed", "num_blocks", "local_hashes", "sequence_hashes"], "properties": {
                    "block_size": {"type": "integer"}, "seed": {"type": "integer", "format": "uint64"}, "num_blocks": {"type": "integer"},
                    "local_hashes": {"type": "array", "items": {"type": "integer", "format": "uint64"}},
                    "sequence_hashes": {"type": "array", "items": {"type": "integer", "format": "uint64"}}}},
                "Overlap": {"type": "object", "required": ["block_size", "num_blocks", "workers"], "properties": {
                    "block_size": {"type": "integer"}, "num_blocks": {"type": "integer"},
                    "workers": {"type": "array", "items": {"type": "object", "required": ["worker_id", "dp_rank", "device_blocks", "host_blocks", "disk_blocks"], "properties": {
                        "worker_id": {"type": "integer"}, "dp_rank": {"type": "integer"}, "device_blocks": {"type": "integer"}, "host_blocks": {"type": "integer"}, "disk_blocks": {"type": "integer"}}}}}},
                "Policy": {"type": "object", "required": ["name", "version", "digest", "loaded_at", "stats"], "properties": {
                    "name": {"type": "string"}, "version": {"type": "integer"}, "digest": {"type": "string"}, "loaded_at": {"type": "string"},
                    "stages": {"type": "array"}, "stats": {"type": "object", "required": ["calls", "errors", "fallbacks", "p50_us", "p99_us"], "properties": {
                        "calls": {"type": "integer"}, "errors": {"type": "integer"}, "fallbacks": {"type": "integer"}, "p50_us": {"type": "number"}, "p99_us": {"type": "number"}}}}},
                "PolicyList": {"type": "object", "required": ["active", "policies"], "properties": {"active": {"type": ["string", "null"]}, "policies": {"type": "array", "items": {"$ref": "#/components/schemas/Policy"}}}}
            }
        },
        "paths": {
            "/v1/workers": {"get": {"summary": "List workers with per-rank load and cache.", "responses": {"200": ok("The workers.", Some("WorkerList"))}}},
            "/v1/workers/{worker_id}": {
                "parameters": [worker_id],
                "put": {"summary": "Register or replace a worker.", "security": admin, "requestBody": json_body("WorkerSpec"),
                        "responses": {"200": ok("The worker.", Some("Worker")), "400": error_response("Invalid spec."), "401": error_response("No token."), "403": error_response("Wrong token.")}},
                "patch": {"summary": "Replace taints or set draining.", "security": admin, "requestBody": json_body("WorkerPatch"),
                          "responses": {"200": ok("The worker.", Some("Worker")), "400": error_response("Invalid patch."), "404": error_response("Unknown worker.")}},
                "delete": {"summary": "Remove a worker from index, load and eligibility.", "security": admin,
                           "responses": {"204": ok("Removed.", None), "404": error_response("Unknown worker.")}}
            },
            "/v1/events": {"post": {"summary": "Apply KV events (SPEC §3 shape).", "security": admin,
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "array", "items": {"$ref": "#/components/schemas/Event"}}}}},
                "responses": {"200": ok("Per-event outcome.", Some("EventsResult")), "400": error_response("Not a JSON array."), "413": error_response("Too many events.")}}},
            "/v1/route": {"post": {"summary": "Choose a worker for a request.", "requestBody": json_body("RouteRequest"),
                "responses": {"200": ok("The decision.", Some("RouteDecision")), "400": error_response("Bad input."), "404": error_response("Pinned worker unknown."),
                              "409": error_response("Pinned worker lacks required taints or is draining (`pinned_worker_draining`), duplicate request id (`duplicate_request_id`), or the request was cancelled while queued (`request_cancelled`)."), "429": retryable("Overloaded or queue full."),
                              "503": error_response("No eligible worker.")}}},
            "/v1/requests/{request_id}/prefill_complete": {"parameters": [request_id.clone()], "post": {"summary": "The first token arrived.",
                "responses": {"200": ok("Recorded.", Some("Lifecycle")), "404": error_response("Unknown request (never routed, freed, or its worker or rank was removed)."), "409": error_response("Still queued (`request_queued`): no worker yet.")}}},
            "/v1/requests/{request_id}/output": {"parameters": [request_id.clone()], "post": {"summary": "Output progress (total tokens so far).", "requestBody": json_body("Output"),
                "responses": {"200": ok("Recorded.", Some("Lifecycle")), "400": error_response("Bad body."), "404": error_response("Unknown request."), "409": error_response("Still queued (`request_queued`): no worker yet.")}}},
            "/v1/requests/{request_id}": {"parameters": [request_id], "delete": {"summary": "Free (done or cancelled).",
                "responses": {"200": ok("Freed or cancelled.", Some("Lifecycle")), "404": error_response("Unknown request.")}}},
            "/v1/overlap": {"post": {"summary": "Cached blocks of a prompt per worker and tier.", "requestBody": json_body("OverlapRequest"),
                "responses": {"200": ok("Overlaps.", Some("Overlap")), "400": error_response("Bad input.")}}},
            "/v1/hash": {"post": {"summary": "The local block hashes and sequence hashes of a prompt (SPEC §2), as u64 integers; nothing is read or booked.", "requestBody": json_body("HashRequest"),
                "responses": {"200": ok("Hashes.", Some("Hashes")), "400": error_response("Bad input.")}}},
            "/v1/policies": {"get": {"summary": "Loaded policies and the active one.", "responses": {"200": ok("Policies.", Some("PolicyList"))}}},
            "/v1/policies/{name}": {
                "parameters": [name.clone()],
                "put": {"summary": "Load a policy component. A new version under the active policy's name serves at once, as a new configuration does.", "security": admin,
                        "parameters": [{"name": "activate", "in": "query", "required": false, "schema": {"type": "boolean"}},
                                       {"name": "config", "in": "query", "required": false, "description": "JSON handed to the component's configure export (URL-encoded), so loading and configuring are one step; `{}` when absent.", "schema": {"type": "string"}}],
                        "requestBody": {"required": true, "content": {"application/wasm": {"schema": {"type": "string", "format": "binary"}}}},
                        "responses": {"201": ok("Loaded.", Some("Policy")), "400": error_response("Not a valid policy component: wrong world, missing export, over size (`component_too_large`), fails its self-test.")}},
                "delete": {"summary": "Remove a policy (not the active one).", "security": admin,
                           "responses": {"204": ok("Removed.", None), "404": error_response("Unknown policy."), "409": error_response("Active policy.")}}
            },
            "/v1/policies/{name}/config": {"parameters": [name.clone()], "put": {"summary": "Configure a policy (a new version, swapped atomically).", "security": admin,
                "requestBody": {"required": true, "content": {"application/json": {"schema": {}}}},
                "responses": {"200": ok("Configured.", Some("Policy")), "400": error_response("Rejected by the component."), "404": error_response("Unknown policy.")}}},
            "/v1/policies/{name}/activate": {"parameters": [name], "post": {"summary": "Make a policy active.", "security": admin,
                "responses": {"200": ok("Active.", Some("Policy")), "404": error_response("Unknown policy.")}}},
            "/v1/policies/rollback": {"post": {"summary": "Go back to the previously active policy.", "security": admin,
                "responses": {"200": ok("Active.", Some("Policy")), "409": error_response("Nothing to roll back to.")}}},
            "/healthz": {"get": {"summary": "Process up.", "responses": {"200": ok("Up.", None)}}},
            "/readyz": {"get": {"summary": "A policy is active and the server listens.", "responses": {"200": ok("Ready.", None), "503": error_response("Not ready.")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics.", "responses": {"200": {"description": "Text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document.", "responses": {"200": ok("OpenAPI 3.1.", None)}}}
        }
    })
}
