//! `GET /openapi.json`: API v1 in OpenAPI 3.1, written by hand from API.md.
//!
//! A test walks every path and method here against the running server and refuses any served
//! field the document does not declare, and a unit test refuses any field or parameter without a
//! description, so the document cannot drift from what is served. The bodies are in [`schemas`].

mod schemas;

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
    add_data_path(&mut doc);
    if let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) {
        for (path, item) in paths.iter_mut() {
            let persisted = path.starts_with("/v1/workers") || path.starts_with("/v1/policies");
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
                // Worker and policy writes are persisted with `--state-dir` and `--cluster`.
                if admin && persisted && method != "get" {
                    add(
                        "503",
                        "With --state-dir: the change could not be persisted \
                         (`state_unavailable`); with --cluster: the NATS server cannot be \
                         reached (`cluster_unavailable`, Retry-After: 1). The change was undone; \
                         nothing changed.",
                    );
                }
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
        "required_taints": {"type": "array", "items": {"type": "string"}, "description": "What the KV transfer added to the decode step's required taints: the prefill worker's `topology/<domain>=<value>` under required enforcement; empty otherwise."},
        "preferred_taints": {"type": "object", "additionalProperties": {"type": "number"}, "description": "What the KV transfer added to the decode step's preferred taints, with weights: the prefill worker's domain at kv_transfer_preferred_weight under preferred enforcement; empty otherwise."}}});
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
                "worker_id": {"type": "integer", "description": "The prefill worker."},
                "dp_rank": {"type": "integer", "description": "Its data-parallel rank."},
                "overlap_blocks": {"type": "integer", "description": "Prompt blocks the prefill worker already holds (device tier)."},
                "cached_tokens": {"type": "integer", "description": "Prompt tokens it need not compute: overlap_blocks × block size, at most the prompt."},
                "policy": {"type": "object", "description": "The policy that ranked the prefill step (as the decision's own policy)."},
                "fallback": {"type": "boolean", "description": "The prefill step fell back to the native cost."},
                "fallback_reason": {"type": "string", "description": "Why it fell back, when it did."},
                "answer": {"type": "string", "enum": ["costs", "pick", "native"], "description": "With explain: what the policy answered at the prefill step."},
                "candidates": {"type": "array", "description": "With explain: the prefill step's eligible candidates, as the decision's candidates."},
                "excluded": {"type": "array", "description": "With explain: the prefill step's excluded candidates, as the decision's excluded."}}}),
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

/// The data path (API.md, "Data path"): workers' `endpoint` and `model`, their proxy health, and
/// the OpenAI-compatible endpoints `serve --proxy` adds (their bodies are OpenAI's, passed through).
fn add_data_path(doc: &mut Value) {
    let endpoint = json!({"type": "string", "description": "The engine's OpenAI-compatible server, http://HOST:PORT (an optional path prefix; a trailing /v1 is not doubled): where serve --proxy forwards requests routed to this worker."});
    let model = json!({"type": "string", "description": "The model the worker serves (a [models.NAME] of the proxy). Without it, a worker serves the proxy's only model when exactly one is configured."});
    let health = json!({"type": "object", "required": ["state", "consecutive_failures"], "description": "With serve --proxy: the worker's circuit breaker.", "properties": {
        "state": {"type": "string", "enum": ["ok", "failing"], "description": "failing: proxy.failure_threshold failures in a row; the proxy skips the worker until a probe (GET {endpoint}/health) succeeds."},
        "consecutive_failures": {"type": "integer", "description": "Failures since the last success (connection failures, 5xx answers, streams cut short)."},
        "last_failure_ms_ago": {"type": ["integer", "null"], "description": "Milliseconds since the last failure (null: none)."}}});
    let schemas = &mut doc["components"]["schemas"];
    for schema in ["WorkerSpec", "Worker"] {
        schemas[schema]["properties"]["endpoint"] = endpoint.clone();
        schemas[schema]["properties"]["model"] = model.clone();
    }
    schemas["Worker"]["properties"]["health"] = health;
    let openai = |summary: &str| {
        json!({"post": {"summary": summary, "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "description": "OpenAI's request body, plus an optional `kvroute` object with the routing fields of RouteRequest (not tokens, block_hashes, book, explain, request_id); x-kvroute-* headers fill fields it leaves out."}}}},
            "responses": {"200": {"description": "The engine's answer, relayed (streamed when `stream` is true), with x-kvroute-worker: ID/RANK and x-request-id."},
                "400": {"description": "Bad body or routing field (OpenAI error shape, `param` names the field)."},
                "404": {"description": "Unknown model (`model_not_found`), or the server runs without --proxy (`not_found`)."},
                "429": {"description": "Overloaded or queue full (Retry-After)."},
                "502": {"description": "The engine could not be reached, after one retry elsewhere (`upstream_unreachable`)."},
                "503": {"description": "No eligible worker, none serving the model (`no_worker_for_model`), or all failing (`workers_failing`)."},
                "504": {"description": "No answer within proxy.request_timeout_ms (`upstream_timeout`)."}}}})
    };
    let paths = &mut doc["paths"];
    paths["/v1/completions"] =
        openai("serve --proxy: an OpenAI completion, tokenized, routed, booked and forwarded.");
    paths["/v1/chat/completions"] = openai("serve --proxy: an OpenAI chat completion, rendered with the model's chat template, tokenized, routed, booked and forwarded.");
    paths["/v1/responses"] = openai("serve --proxy: an OpenAI Responses request, its instructions and input rendered as vLLM renders them, tokenized, routed, booked and forwarded (its event stream relayed).");
    let mut messages = openai("serve --proxy: an Anthropic Messages request, converted to the chat request vLLM renders for it, tokenized, routed, booked and forwarded (Anthropic's event stream relayed). Errors in Anthropic's shape: {\"type\": \"error\", \"error\": {\"type\", \"message\", \"code\", \"param\"}}.");
    messages["post"]["requestBody"]["content"]["application/json"]["schema"]["description"] = json!("Anthropic's Messages request body, plus an optional `kvroute` object with the routing fields of RouteRequest (not tokens, block_hashes, book, explain, request_id); x-kvroute-* headers fill fields it leaves out.");
    messages["post"]["responses"]["400"]["description"] =
        json!("Bad body or routing field (Anthropic error shape, `error.param` names the field).");
    paths["/v1/messages"] = messages;
    paths["/v1/models"] = json!({"get": {"summary": "serve --proxy: the configured models, in OpenAI's list shape.", "responses": {"200": {"description": "{\"object\": \"list\", \"data\": [{\"id\", \"object\", \"created\", \"owned_by\"}]}"}, "404": {"description": "The server runs without --proxy (`not_found`)."}}}});
}

fn base_document() -> Value {
    let worker_id = json!({"name": "worker_id", "in": "path", "required": true, "description": "The worker's id (an unsigned 64-bit integer).", "schema": {"type": "integer", "format": "uint64", "minimum": 0}});
    let request_id = json!({"name": "request_id", "in": "path", "required": true, "description": "The request id given to (or generated by) POST /v1/route.", "schema": {"type": "string"}});
    let name = json!({"name": "name", "in": "path", "required": true, "description": "The policy's name: 1 to 64 of [A-Za-z0-9_.-], not starting with '.', not rollback.", "schema": {"type": "string"}});
    let admin = json!([{"bearer": []}]);
    json!({
        "openapi": "3.1.0",
        "info": {"title": "kvroute", "version": "1", "description": "KV-cache-aware request router, HTTP API v1."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas::schemas()
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
                "responses": {"200": ok("Per-event outcome.", Some("EventsResult")), "400": error_response("Not a JSON array."), "409": error_response("This router keeps no index (`no_local_index`, serve --remote-indexer): post events to its indexer."), "413": error_response("Too many events.")}}},
            "/v1/route": {"post": {"summary": "Choose a worker for a request.", "requestBody": json_body("RouteRequest"),
                "responses": {"200": ok("The decision.", Some("RouteDecision")), "400": error_response("Bad input."), "404": error_response("Pinned worker unknown."),
                              "409": error_response("Pinned worker lacks required taints (`pinned_worker_missing_taints`), is draining (`pinned_worker_draining`) or has a dead KV event feed under routing.dead_feed = drain (`pinned_worker_feed_dead`), duplicate request id (`duplicate_request_id`), or the request was cancelled while queued (`request_cancelled`)."), "429": retryable("Overloaded or queue full."),
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
            "/v1/policies": {"get": {"summary": "Loaded policies: every loaded version of each name, the active one and the rollback target.", "responses": {"200": ok("Policies.", Some("PolicyList"))}}},
            "/v1/policies/{name}": {
                "parameters": [name.clone()],
                "get": {"summary": "Every loaded version of a policy in full (with its trapping imports).",
                        "responses": {"200": ok("The policy's versions.", Some("PolicyDetail")), "400": error_response("Not a valid policy name."), "404": error_response("Unknown policy.")}},
                "put": {"summary": "Load a policy component. A new version under the active policy's name serves at once, as a new configuration does.", "security": admin,
                        "parameters": [{"name": "activate", "in": "query", "required": false, "description": "true (or empty, or 1): make it active once loaded (default false).", "schema": {"type": "boolean"}},
                                       {"name": "config", "in": "query", "required": false, "description": "JSON handed to the component's configure export (URL-encoded), so loading and configuring are one step; `{}` when absent.", "schema": {"type": "string"}}],
                        "requestBody": {"required": true, "content": {"application/wasm": {"schema": {"type": "string", "format": "binary"}}}},
                        "responses": {"201": ok("Loaded.", Some("Policy")), "400": error_response("Not a valid policy component: wrong world, missing export, over size (`component_too_large`), fails its self-test.")}},
                "delete": {"summary": "Remove a policy (not the active one).", "security": admin,
                           "responses": {"204": ok("Removed.", None), "404": error_response("Unknown policy."), "409": error_response("Active policy.")}}
            },
            "/v1/policies/{name}/config": {"parameters": [name.clone()], "put": {"summary": "Configure a policy (a new version, swapped atomically).", "security": admin,
                "requestBody": {"required": true, "content": {"application/json": {"schema": {}}}},
                "responses": {"200": ok("Configured.", Some("Policy")), "400": error_response("Rejected by the component."), "404": error_response("Unknown policy.")}}},
            "/v1/policies/{name}/activate": {"parameters": [name.clone()], "post": {"summary": "Make a policy active.", "security": admin,
                "responses": {"200": ok("Active.", Some("Policy")), "404": error_response("Unknown policy.")}}},
            "/v1/policies/{name}/shadow": {"parameters": [name.clone()],
                "get": {"summary": "The running shadow of a policy and its figures (`{\"shadow\": null}` when none runs).",
                        "responses": {"200": ok("The shadow.", None), "400": error_response("Not a valid policy name."), "404": error_response("Unknown policy.")}},
                "post": {"summary": "Shadow a loaded, non-active version: `{\"version\"?, \"sample\"?}`; evaluated beside the active one off the request path.", "security": admin,
                        "requestBody": {"required": false, "content": {"application/json": {"schema": {}}}},
                        "responses": {"200": ok("Shadow started (replacing any shadow of the name).", None), "400": error_response("Bad input, naming the field (`sample` out of (0, 1], an unknown `version`, the active version)."), "404": error_response("Unknown policy."), "409": error_response("With --cluster: another replica changed the rollout at the same moment (`rollout_conflict`); nothing changed here, and this replica now holds that change: retry.")}},
                "delete": {"summary": "Stop the shadow; its last figures.", "security": admin,
                        "responses": {"200": ok("Stopped.", None), "400": error_response("Not a valid policy name."), "404": error_response("No shadow of this policy runs (`no_shadow`)."), "409": error_response("With --cluster: another replica changed the rollout at the same moment (`rollout_conflict`); nothing changed here, and this replica now holds that change: retry.")}}},
            "/v1/policies/{name}/canary": {"parameters": [name.clone()],
                "get": {"summary": "The running canary of a policy (or null) with its arms and the confidence intervals of their differences, and the records of its ended canaries.",
                        "responses": {"200": ok("The canary.", None), "400": error_response("Not a valid policy name."), "404": error_response("Unknown policy.")}},
                "post": {"summary": "Start a canary: `{\"version\"?, \"fraction\", \"guardrails\"?, \"auto_promote\"?}`.", "security": admin,
                        "requestBody": {"required": true, "content": {"application/json": {"schema": {}}}},
                        "responses": {"200": ok("Canary started.", None), "400": error_response("Bad input, naming the field."), "404": error_response("Unknown policy."), "409": error_response("A canary is running (on any replica, with --cluster), or no policy is active, or another replica changed the rollout at the same moment (`rollout_conflict`).")}},
                "delete": {"summary": "Stop the canary (the active version takes every decision); its record.", "security": admin,
                        "responses": {"200": ok("Stopped.", None), "400": error_response("Not a valid policy name."), "404": error_response("No canary of this policy runs (`no_canary`)."), "409": error_response("With --cluster: another replica changed the rollout at the same moment (`rollout_conflict`); nothing changed here, and this replica now holds that change: retry.")}}},
            "/v1/policies/{name}/promote": {"parameters": [name.clone()], "post": {"summary": "Make the running canary's candidate the active version.", "security": admin,
                "responses": {"200": ok("Active.", Some("Policy")), "400": error_response("Not a valid policy name."), "404": error_response("No canary of this policy runs (`no_canary`)."), "409": error_response("With --cluster: another replica changed the rollout at the same moment (`rollout_conflict`); nothing changed here, and this replica now holds that change: retry.")}}},
            "/v1/policies/rollback": {"post": {"summary": "Go back to the previously active policy.", "security": admin,
                "responses": {"200": ok("Active.", Some("Policy")), "409": error_response("Nothing to roll back to.")}}},
            "/v1/cluster": {"get": {"summary": "This replica's view of its cluster (serve --cluster): its id, its NATS connection, and every replica heard from within replica_timeout_ms with its bookings.",
                "responses": {"200": ok("The cluster.", Some("Cluster")), "404": error_response("Not a cluster replica (`not_in_cluster`).")}}},
            "/v1/sessions": {"get": {"summary": "Live session bindings (SPEC §12), in session-id order, a page at a time.",
                "parameters": [{"name": "after", "in": "query", "required": false, "description": "List the sessions whose ids sort after this one (the previous page's next_after).", "schema": {"type": "string"}},
                               {"name": "limit", "in": "query", "required": false, "description": "Sessions per page, 1 to 1000 (default 100).", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}],
                "responses": {"200": ok("A page of bindings.", Some("SessionList")), "400": error_response("A bad query parameter (the field names it).")}}},
            "/v1/sessions/{session_id}": {"parameters": [{"name": "session_id", "in": "path", "required": true, "description": "The session's id.", "schema": {"type": "string"}}],
                "get": {"summary": "One live session binding.",
                "responses": {"200": ok("The binding.", Some("Session")), "404": error_response("No live binding (`unknown_session`: never bound, expired or evicted).")}}},
            "/v1/tenants": {"get": {"summary": "Tenants (SPEC §9): each one's fair-queueing weight and attained service, what it has waiting, and its budgets with what the last 60 s used; in name order, a page at a time.",
                "parameters": [{"name": "after", "in": "query", "required": false, "description": "List the tenants whose names sort after this one (the previous page's next_after).", "schema": {"type": "string"}},
                               {"name": "limit", "in": "query", "required": false, "description": "Tenants per page, 1 to 1000 (default 100).", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}],
                "responses": {"200": ok("A page of tenants.", Some("TenantList")), "400": error_response("A bad query parameter (the field names it).")}}},
            "/v1/tenants/{tenant}": {"parameters": [{"name": "tenant", "in": "path", "required": true, "description": "The tenant's name (1 to 128 bytes, no control characters).", "schema": {"type": "string"}}],
                "get": {"summary": "What applies to one tenant now, seen before or not.",
                "responses": {"200": ok("The tenant.", Some("Tenant")), "400": error_response("Not a valid tenant name (`invalid_field`, field tenant).")}}},
            "/healthz": {"get": {"summary": "Process up.", "responses": {"200": ok("Up.", Some("Health"))}}},
            "/readyz": {"get": {"summary": "A policy is active and the server listens.", "responses": {"200": ok("Ready.", Some("Ready")), "503": error_response("Not ready.")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics.", "responses": {"200": {"description": "Text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document.", "responses": {"200": ok("OpenAPI 3.1.", None)}}}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of every body, and every parameter, is described.
    #[test]
    fn no_field_lacks_a_description() {
        let doc = document();
        let mut props = Vec::new();
        schemas::properties(&doc["components"]["schemas"], "#", &mut props);
        assert!(props.len() > 150, "{} properties", props.len());
        let undescribed: Vec<&str> = props
            .iter()
            .filter(|(_, v)| {
                v.get("description")
                    .and_then(Value::as_str)
                    .is_none_or(|d| d.trim().is_empty())
            })
            .map(|(p, _)| p.as_str())
            .collect();
        assert!(
            undescribed.is_empty(),
            "fields without a description: {undescribed:?}"
        );
        let mut params = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for p in item["parameters"].as_array().into_iter().flatten() {
                params.push((path.clone(), p));
            }
            for op in item.as_object().unwrap().values() {
                for p in op
                    .get("parameters")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    params.push((path.clone(), p));
                }
            }
        }
        assert!(params.len() >= 9, "{params:?}");
        for (path, p) in params {
            assert!(
                p["description"].as_str().is_some_and(|d| !d.is_empty()),
                "{path}: parameter {} has no description",
                p["name"]
            );
        }
    }
}
