//! The Anthropic Messages and OpenAI Responses bodies as the chat bodies vLLM converts them to
//! (`chat/anthropic.rs`, `chat/responses.rs`), rule by rule, and rendered with the test template.

use serde_json::{json, Value};

use super::{assert_error, test_model, TempDir};
use crate::chat::{anthropic, responses};
use crate::testing::write_test_model;
use crate::{Model, ModelSpec};

fn messages(v: &Value) -> Value {
    anthropic::to_chat(v, false, "none").unwrap()["messages"].clone()
}

#[test]
fn anthropic_system_string_and_blocks_become_one_first_system_message() {
    let chat = messages(&json!({"system": "Be brief.", "messages": [
        {"role": "user", "content": "hi"}]}));
    assert_eq!(
        chat,
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    );
    // Blocks joined with "", empty ones and Claude Code's billing header dropped whole.
    let chat = messages(&json!({"system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc\nstill dropped"},
        {"type": "text", "text": "One."},
        {"type": "text", "text": ""},
        {"type": "text", "text": "Two.", "cache_control": {"type": "ephemeral"}},
    ], "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(chat[0], json!({"role": "system", "content": "One.Two."}));
    // An empty system is none.
    let chat = messages(&json!({"system": "", "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(chat, json!([{"role": "user", "content": "hi"}]));
}

#[test]
fn anthropic_inline_system_messages_stay_in_place_or_merge_when_the_template_needs_it() {
    let body = json!({"system": "S.", "messages": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "R1"}, {"type": "text", "text": "R2"}]},
        {"role": "system", "content": "x-anthropic-billing-header: z"},
        {"role": "user", "content": "b"},
    ]});
    let kept = anthropic::to_chat(&body, false, "none").unwrap();
    assert_eq!(
        kept["messages"],
        json!([{"role": "system", "content": "S."}, {"role": "user", "content": "a"},
               {"role": "system", "content": "R1R2"}, {"role": "user", "content": "b"}])
    );
    let merged = anthropic::to_chat(&body, true, "none").unwrap();
    assert_eq!(
        merged["messages"],
        json!([{"role": "system", "content": "S.R1R2"}, {"role": "user", "content": "a"},
               {"role": "user", "content": "b"}])
    );
}

#[test]
fn anthropic_blocks_text_thinking_tool_use_and_results_convert_as_vllm_does() {
    let chat = messages(&json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Let me ", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "thinking", "thinking": "add.", "signature": "s"},
            {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "tu_1", "name": "add", "input": {"a": 2, "b": 2}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "tu_1", "content": [
                {"type": "text", "text": "4"}, {"type": "text", "text": "(exact)"}]},
            {"type": "text", "text": "Thanks"},
            {"type": "text", "text": "!"},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_2", "content": "only"}]},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x",
            "content": [{"type": "text", "text": "it's"}]}]},
    ]}));
    assert_eq!(
        chat,
        json!([
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "reasoning": "Let me add.", "tool_calls": [
                {"id": "tu_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}],
             "content": "Calling."},
            // The tool result goes before the user's own message, whose texts stay parts.
            {"role": "tool", "tool_call_id": "tu_1", "content": "4\n(exact)"},
            {"role": "user", "content": [{"type": "text", "text": "Thanks"}, {"type": "text", "text": "!"}]},
            // A user message with nothing else is dropped.
            {"role": "tool", "tool_call_id": "tu_2", "content": "only"},
            // An assistant's tool result is Python's str() of its content.
            {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': \"it's\"}]"},
        ])
    );
}

#[test]
fn anthropic_tools_choice_and_thinking_map_to_chat_fields() {
    let body = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "add", "description": "Adds.", "input_schema": {"properties": {"a": {"type": "integer"}}}}],
        "tool_choice": {"type": "any"}, "output_config": {"effort": "high"},
        "chat_template_kwargs": {"k": 1}, "cache_salt": "s"});
    let chat = anthropic::to_chat(&body, false, "none").unwrap();
    assert_eq!(
        chat["tools"],
        json!([{"type": "function", "function": {"name": "add", "description": "Adds.",
            "parameters": {"properties": {"a": {"type": "integer"}}, "type": "object"},
            "strict": null, "defer_loading": null}}])
    );
    assert_eq!(chat["tool_choice"], "required");
    assert_eq!(chat["reasoning_effort"], "high");
    assert_eq!(chat["chat_template_kwargs"], json!({"k": 1}));
    assert_eq!(chat["cache_salt"], "s");
    // No tool_choice with tools: auto. A named tool: a named function.
    let mut b = body.clone();
    b.as_object_mut().unwrap().remove("tool_choice");
    assert_eq!(
        anthropic::to_chat(&b, false, "none").unwrap()["tool_choice"],
        "auto"
    );
    b["tool_choice"] = json!({"type": "tool", "name": "add"});
    assert_eq!(
        anthropic::to_chat(&b, false, "none").unwrap()["tool_choice"],
        json!({"type": "function", "function": {"name": "add"}})
    );
    // thinking disabled is the probed effort, over output_config's.
    b["thinking"] = json!({"type": "disabled"});
    assert_eq!(
        anthropic::to_chat(&b, false, "low").unwrap()["reasoning_effort"],
        "low"
    );
    b["thinking"] = json!({"type": "enabled", "budget_tokens": 2048});
    assert_eq!(
        anthropic::to_chat(&b, false, "low").unwrap()["reasoning_effort"],
        "high"
    );
    // Tool changes in system messages: added by value, removed by reference.
    let b = json!({"messages": [
        {"role": "system", "content": [
            {"type": "tool_addition", "tool": {"type": "tool_definition", "definition":
                {"name": "mul", "input_schema": {"type": "object"}}}},
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "add"}}]},
        {"role": "user", "content": "hi"}],
        "tools": [{"name": "add", "input_schema": {"type": "object"}}]});
    let chat = anthropic::to_chat(&b, false, "none").unwrap();
    let names: Vec<&str> = chat["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["mul"]);
}

#[test]
fn anthropic_bodies_vllm_refuses_are_refused_naming_the_field() {
    let e = anthropic::to_chat(
        &json!({"messages": [{"role": "tool", "content": "x"}]}),
        false,
        "none",
    );
    assert_error(e.unwrap_err(), "messages[0].role", "expected");
    let e = anthropic::to_chat(
        &json!({"messages": [{"role": "user", "content": [{"type": "video"}]}]}),
        false,
        "none",
    );
    assert_error(
        e.unwrap_err(),
        "messages[0].content[0].type",
        "expected one of",
    );
    let e = anthropic::to_chat(
        &json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "a"}]}),
        false,
        "none",
    );
    assert_error(e.unwrap_err(), "tools[0].input_schema", "is required");
    let e = anthropic::to_chat(
        &json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}),
        false,
        "none",
    );
    assert_error(e.unwrap_err(), "tool_choice.name", "is required");
}

#[test]
fn python_repr_and_dumps_match_python() {
    assert_eq!(
        anthropic::python_repr(&json!({"a": [1, true, null, "x'y\"z"]})),
        "{'a': [1, True, None, 'x\\'y\"z']}"
    );
    assert_eq!(
        anthropic::python_json_dumps(&json!({"k": "é\n", "n": [1.5, false]})),
        "{\"k\": \"\\u00e9\\n\", \"n\": [1.5, false]}"
    );
}

/// A template that refuses a system message anywhere but first (Qwen's guard).
fn system_first_model() -> (Model, TempDir) {
    let dir = TempDir::new();
    let path = write_test_model(dir.path()).unwrap();
    let file = dir.path().join("t.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}\
        {{ raise_exception('System message must be at the beginning.') }}{% endif %}\
        [{{ m.role }}]{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let mut spec = ModelSpec::new(path);
    spec.chat_template = Some(file);
    (Model::load("m", &spec).unwrap(), dir)
}

#[test]
fn messages_tokens_render_the_converted_body_and_probe_the_template() {
    let (model, _dir) = test_model();
    let body = json!({"model": "test", "max_tokens": 8, "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Have you seen any whales?"}]}]});
    let chat = json!({"model": "test", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Have you seen any whales?"}]});
    assert_eq!(
        model.messages_tokens(&body).unwrap(),
        model.chat_tokens(&chat).unwrap()
    );
    // The test template takes inline system messages and ignores reasoning_effort.
    assert!(model.messages_as_chat(&body).is_ok());
    assert_eq!(model.disabled_thinking_effort(), "low");
    let (guarded, _d) = system_first_model();
    let inline = json!({"system": "S", "messages": [{"role": "user", "content": "a"},
        {"role": "system", "content": "R"}, {"role": "user", "content": "b"}]});
    assert_eq!(
        guarded
            .render_chat(&guarded.messages_as_chat(&inline).unwrap())
            .unwrap(),
        "[system]SR[user]a[user]b"
    );
}

#[test]
fn responses_input_string_and_instructions() {
    let chat = responses::to_chat(
        &json!({"model": "m", "input": "hi", "instructions": "Be brief.",
        "reasoning": {"effort": "low"}, "cache_salt": "s"}),
    )
    .unwrap();
    assert_eq!(
        chat,
        json!({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"}], "add_special_tokens": true,
            (crate::chat::messages::RAW_TOOL_CALLS): true, "cache_salt": "s",
            "reasoning_effort": "low"})
    );
}

#[test]
fn responses_items_merge_into_assistant_turns_as_vllm_does() {
    let chat = responses::to_chat(&json!({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Add."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\":2}", "namespace": "math"},
        {"type": "function_call", "call_id": "c2", "name": "mul", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "It is 4.", "annotations": []}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}]},
        {"role": "user", "content": "thanks"},
    ]})).unwrap();
    assert_eq!(
        chat["messages"],
        json!([
            {"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
            {"role": "assistant", "reasoning": "Add.", "tool_calls": [
                {"id": "c1", "function": {"name": "math__add", "arguments": "{\"a\":2}"}, "type": "function"},
                {"id": "c2", "function": {"name": "mul", "arguments": "{}"}, "type": "function"}]},
            {"role": "tool", "content": "4", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It is 4.", "reasoning": "S"},
            {"role": "user", "content": "thanks"},
        ])
    );
    assert!(chat.get("continue_final_message").is_none());
    // A last assistant message in progress is continued.
    let chat = responses::to_chat(&json!({"input": [{"role": "user", "content": "a"},
        {"type": "message", "role": "assistant", "status": "in_progress",
         "content": [{"type": "output_text", "text": "Once"}]}]}))
    .unwrap();
    assert_eq!(chat["continue_final_message"], true);
    assert_eq!(chat["add_generation_prompt"], false);
}

#[test]
fn responses_tools_are_flattened_function_tools() {
    let chat = responses::to_chat(&json!({"input": "x", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true},
        {"type": "web_search"},
        {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]},
        {"type": "custom", "name": "c"},
    ]}))
    .unwrap();
    let tools = chat["tools"].as_array().unwrap();
    let names: Vec<&str> = tools
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["f", "ns__g", "c"]);
    assert_eq!(tools[0]["function"]["strict"], true);
    assert_eq!(
        tools[2]["function"]["parameters"]["required"],
        json!(["input"])
    );
    // No tools, or none the model sees: no tools at all.
    let chat = responses::to_chat(&json!({"input": "x", "tools": []})).unwrap();
    assert!(chat.get("tools").is_none());
    let e = responses::to_chat(
        &json!({"input": [{"type": "reasoning", "encrypted_content": "zz", "summary": []}]}),
    );
    assert_error(
        e.unwrap_err(),
        "input[0].encrypted_content",
        "not supported",
    );
    let e = responses::to_chat(&json!({"input": [{"type": "web_search_call", "id": "x"}]}));
    assert_error(
        e.unwrap_err(),
        "input[0].type",
        "unsupported input item type",
    );
}

#[test]
fn responses_tokens_render_the_converted_body() {
    let (model, _dir) = test_model();
    let ids = model
        .responses_tokens(
            &json!({"model": "test", "input": "Have you seen any whales?",
        "instructions": "Be brief."}),
        )
        .unwrap();
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Have you seen any whales?"}]});
    let chat_ids = model.chat_tokens(&chat).unwrap();
    // Encoded with the special tokens again, as vLLM's Responses path does: a second BOS.
    let bos = model.encode(crate::testing::BOS, false).unwrap()[0];
    assert_eq!(ids[0], bos);
    assert_eq!(&ids[1..], &chat_ids[..]);
}
