use serde_json::json;

use super::{assert_error, test_model, TempDir};
use crate::testing::{write_test_model, BOS};
use crate::{Model, ModelSpec};

fn conversation() -> serde_json::Value {
    json!({"model": "test", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Have you seen any whales?"},
    ]})
}

#[test]
fn the_test_template_renders_chatml_with_bos_and_a_generation_prompt() {
    let (model, _dir) = test_model();
    assert!(model.has_chat_template());
    assert_eq!(
        model.render_chat(&conversation()).unwrap(),
        "<s><|im_start|>system\nBe brief.<|im_end|>\n\
         <|im_start|>user\nHave you seen any whales?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let mut body = conversation();
    body["add_generation_prompt"] = json!(false);
    assert_eq!(
        model.render_chat(&body).unwrap(),
        "<s><|im_start|>system\nBe brief.<|im_end|>\n\
         <|im_start|>user\nHave you seen any whales?<|im_end|>\n"
    );
}

#[test]
fn chat_tokens_encode_the_rendering_without_a_second_bos() {
    let (model, _dir) = test_model();
    let ids = model.chat_tokens(&conversation()).unwrap();
    let rendered = model.render_chat(&conversation()).unwrap();
    assert_eq!(ids, model.encode(&rendered, false).unwrap());
    let bos = model.encode(BOS, false).unwrap()[0];
    assert_eq!(ids[0], bos);
    assert_eq!(ids.iter().filter(|id| **id == bos).count(), 1);
    // The chat markers are single special tokens.
    let im_start = model.encode("<|im_start|>", false).unwrap();
    assert_eq!(im_start.len(), 1);
    assert_eq!(ids[1], im_start[0]);
}

#[test]
fn text_parts_are_joined_and_other_parts_refused() {
    let (model, _dir) = test_model();
    let body = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "First part."},
        {"type": "text", "text": "Second part."},
    ]}]});
    assert_eq!(
        model.render_chat(&body).unwrap(),
        "<s><|im_start|>user\nFirst part.\nSecond part.<|im_end|>\n<|im_start|>assistant\n"
    );
    let image = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
    ]}]});
    assert_error(
        model.chat_tokens(&image).unwrap_err(),
        "messages[0].content[1].type",
        "only text parts",
    );
    let cases = [
        (json!({"model": "test"}), "messages", "is required"),
        (json!({"messages": "hi"}), "messages", "expected an array"),
        (
            json!({"messages": ["hi"]}),
            "messages[0]",
            "expected an object",
        ),
        (
            json!({"messages": [{"content": "hi"}]}),
            "messages[0].role",
            "is required",
        ),
        (
            json!({"messages": [{"role": 1, "content": "hi"}]}),
            "messages[0].role",
            "expected a string",
        ),
        (
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": 7}]}),
            "messages[2].content",
            "expected a string or an array of text parts",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content[0].text",
            "expected a string",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}),
            "messages[0].content[0]",
            "expected a {\"type\": \"text\"",
        ),
        (
            json!({"messages": [], "tools": {}}),
            "tools",
            "expected an array",
        ),
        (
            json!({"messages": [], "add_generation_prompt": "maybe"}),
            "add_generation_prompt",
            "expected a boolean",
        ),
        (json!({"messages": []}), "messages", "an empty conversation"),
        (
            json!({"messages": [], "continue_final_message": true}),
            "continue_final_message",
            "cannot be true together with add_generation_prompt",
        ),
        (
            json!({"messages": [], "chat_template_kwargs": []}),
            "chat_template_kwargs",
            "expected an object",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls[0].id",
            "is required",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
            "expected a JSON object encoded as a string",
        ),
        (
            json!({"messages": [{"role": "user", "content": null}]}),
            "messages[0].content",
            "not null",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "name": 5}]}),
            "messages[0].name",
            "expected a string",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"description": "no name"}}]}),
            "tools[0].function.name",
            "is required",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools[0].type",
            "expected \"function\"",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"}),
            "reasoning_effort",
            "expected one of",
        ),
        (json!("text"), "body", "expected a JSON object"),
    ];
    for (body, field, reason) in cases {
        let err = model.chat_tokens(&body).expect_err(&body.to_string());
        assert_error(err, field, reason);
    }
}

#[test]
fn a_template_that_raises_carries_its_message() {
    let (model, _dir) = test_model();
    let body = json!({"messages": [{"role": "robot", "content": "beep"}]});
    let err = model.chat_tokens(&body).unwrap_err();
    assert_error(err, "messages", "Unknown role: robot");
}

#[test]
fn tools_are_rendered_as_python_json() {
    let (model, _dir) = test_model();
    let body = json!({
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather <now> & 'later' in ü",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }}],
    });
    let rendered = model.render_chat(&body).unwrap();
    // Python's json.dumps(ensure_ascii=False): ", " and ": ", nothing HTML-escaped, keys in the
    // order the request sent them (as vLLM's parsed request keeps them).
    assert!(
        rendered.starts_with(
            "<s><|im_start|>system\nTools: [{\"type\": \"function\", \"function\": {\"name\": \
             \"get_weather\", \"description\": \"Weather <now> & 'later' in ü\", \"parameters\": \
             {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}]<|im_end|>\n\
             <|im_start|>user\n"
        ),
        "{rendered}"
    );
}

/// Writes the test tokenizer with `config` as its tokenizer_config.json (or none).
fn model_with_config(
    config: Option<serde_json::Value>,
    spec: impl Fn(&mut ModelSpec),
) -> (Result<Model, crate::TokenizeError>, TempDir) {
    let dir = TempDir::new();
    let path = write_test_model(dir.path()).unwrap();
    let config_path = dir.path().join("tokenizer_config.json");
    match config {
        Some(config) => std::fs::write(&config_path, config.to_string()).unwrap(),
        None => std::fs::remove_file(&config_path).unwrap(),
    }
    let mut model_spec = ModelSpec::new(path);
    spec(&mut model_spec);
    (Model::load("m", &model_spec), dir)
}

#[test]
fn the_list_form_picks_default_and_tool_use_for_tools() {
    let config = json!({
        "bos_token": {"content": "<s>", "special": true},
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}D:{% for m in messages %}{{ m.content }}{% endfor %}"},
            {"name": "tool_use", "template": "T:{{ tools | length }}:{% for m in messages %}{{ m.content }}{% endfor %}"},
        ],
    });
    let (model, _dir) = model_with_config(Some(config), |_| {});
    let model = model.unwrap();
    let plain = json!({"messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(model.render_chat(&plain).unwrap(), "<s>D:hi");
    let tools = json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]});
    assert_eq!(model.render_chat(&tools).unwrap(), "T:1:hi");

    let (only_tools, _dir) = model_with_config(
        Some(json!({"chat_template": [{"name": "tool_use", "template": "x"}]})),
        |_| {},
    );
    assert_error(
        only_tools.unwrap().render_chat(&plain).unwrap_err(),
        "messages",
        "none named \"default\"",
    );
    let (bad, _dir) = model_with_config(
        Some(json!({"chat_template": [{"name": "default"}]})),
        |_| {},
    );
    assert_error(
        bad.unwrap_err(),
        "models.m.tokenizer",
        "expected {\"name\": string, \"template\": string}",
    );
}

#[test]
fn a_chat_template_file_overrides_the_tokenizer_config() {
    let dir = TempDir::new();
    let file = dir.path().join("override.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}\n[{{ m.role | upper }}] {{ m.content.strip() }}\n{% endfor %}\n{% if add_generation_prompt %}>{% endif %}",
    )
    .unwrap();
    let (model, _model_dir) =
        model_with_config(None, |spec| spec.chat_template = Some(file.clone()));
    let model = model.unwrap();
    let body = json!({"messages": [{"role": "user", "content": "  hello  "}, {"role": "assistant", "content": "hi"}]});
    // trim_blocks/lstrip_blocks as in transformers: block lines leave no newline behind.
    assert_eq!(
        model.render_chat(&body).unwrap(),
        "[USER] hello\n[ASSISTANT] hi\n>"
    );

    std::fs::write(&file, "{% for m in messages %}").unwrap();
    let (broken, _d) = model_with_config(None, |spec| spec.chat_template = Some(file.clone()));
    assert_error(
        broken.unwrap_err(),
        "models.m.chat_template",
        "does not compile",
    );
    let missing = dir.path().join("missing.jinja");
    let (missing, _d) = model_with_config(None, |spec| spec.chat_template = Some(missing.clone()));
    assert_error(
        missing.unwrap_err(),
        "models.m.chat_template",
        "cannot read",
    );
}

#[test]
fn chat_template_jinja_beside_the_tokenizer_is_the_fallback() {
    let (model, dir) = model_with_config(Some(json!({"bos_token": "<s>"})), |_| {});
    assert!(!model.unwrap().has_chat_template());
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ bos_token }}{{ messages[0].content }}",
    )
    .unwrap();
    let model = Model::load("m", &ModelSpec::new(dir.path().join("tokenizer.json"))).unwrap();
    assert_eq!(
        model
            .render_chat(&json!({"messages": [{"role": "user", "content": "x"}]}))
            .unwrap(),
        "<s>x"
    );
}

#[test]
fn a_model_without_a_chat_template_refuses_chat_clearly() {
    let (model, _dir) = model_with_config(None, |_| {});
    let model = model.unwrap();
    assert!(!model.has_chat_template());
    assert_error(
        model.chat_tokens(&conversation()).unwrap_err(),
        "messages",
        "has no chat template",
    );
    // Completions still work.
    assert!(!model
        .completion_tokens(&json!({"prompt": "hi"}))
        .unwrap()
        .is_empty());
}

#[test]
fn tool_call_arguments_kwargs_and_continue_final_message_reach_the_template() {
    let dir = TempDir::new();
    let file = dir.path().join("t.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}{{ m.role }}:{{ m.content }}\
         {% if m.tool_calls %}[{{ m.tool_calls[0].function.arguments.city }}]{% endif %}\
         {% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}\
         {% if thinking %}THINK{% endif %}{% if add_generation_prompt %}NEXT{% endif %}",
    )
    .unwrap();
    let (model, _d) = model_with_config(None, |spec| spec.chat_template = Some(file.clone()));
    let model = model.unwrap();
    let body = json!({
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Oslo\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        ],
        "chat_template_kwargs": {"thinking": true},
    });
    assert_eq!(
        model.render_chat(&body).unwrap(),
        "user:Weather?;assistant:[Oslo];tool:rain#c1;THINKNEXT"
    );
    let cont = json!({
        "messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello, "}],
        "add_generation_prompt": false,
        "continue_final_message": true,
    });
    assert_eq!(
        model.render_chat(&cont).unwrap(),
        // transformers 5 cuts at a mark it appended to the text: the trailing space stays.
        "user:Say hi;assistant:Hello, "
    );
}

/// A template in the style of shipped tool-calling templates (testdata/tools_template.jinja);
/// the expected text is what jinja2 set up as `transformers` does renders for the same body once
/// vLLM's tool model has normalized its tools (`name`, `description`, `parameters`; the
/// vectors of `parity.rs` check the same against a real vLLM).
#[test]
fn a_tool_calling_template_renders_as_jinja2_does() {
    let file =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tools_template.jinja");
    let (model, _d) = model_with_config(
        Some(json!({"bos_token": "<s>", "eos_token": "</s>"})),
        |spec| spec.chat_template = Some(file.clone()),
    );
    let model = model.unwrap();
    let body = json!({"messages": [
        {"role": "system", "content": "  You check the weather.  "},
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}},
            {"id": "b", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Bergen\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "rain, 4.5 °C"},
        {"role": "tool", "tool_call_id": "b", "content": "sun"},
        {"role": "user", "content": "  Thanks!  "}],
     "tools": [{"type": "function", "function": {"description": "Weather <today>", "name": "weather",
        "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}}]});
    let jinja2 = "<s><|im_start|>system\nYou check the weather.\n\n# Tools\n<tools>\n\
        {\"name\": \"weather\", \"description\": \"Weather <today>\", \"parameters\": \
        {\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"], \"type\": \"object\"}}\n\
        </tools><|im_end|>\n<|im_start|>user\nWeather in Oslo and Bergen?<|im_end|>\n\
        <|im_start|>assistant\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n\
        <tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Bergen\", \"days\": 2}}\n</tool_call><|im_end|>\n\
        <|im_start|>user\n<tool_response>\nrain, 4.5 °C\n</tool_response>\n<tool_response>\nsun\n</tool_response><|im_end|>\n\
        <|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(model.render_chat(&body).unwrap(), jinja2);

    let mut bad = body.clone();
    bad["messages"][1]["role"] = json!("narrator");
    assert_error(
        model.render_chat(&bad).unwrap_err(),
        "messages",
        "roles must be user, assistant or tool after the system message, not narrator",
    );
}

/// `[models.NAME] chat_template_content_format` and `chat_template_kwargs`, as vLLM's
/// `--chat-template-content-format` and `--default-chat-template-kwargs`: the format forces the
/// parts form on a template that would take strings; the server's kwargs are under the request's
/// (a request's null does not unset a server default: vLLM drops unset request values).
#[test]
fn server_content_format_and_default_kwargs_act_as_vllms_flags() {
    let dir = TempDir::new();
    let file = dir.path().join("t.jinja");
    std::fs::write(&file, "{{ messages[0].content }}|{{ a }}|{{ b }}").unwrap();
    let body = json!({"messages": [{"role": "user", "content": "hi"}],
                      "chat_template_kwargs": {"a": null, "b": "request"}});
    let load = |format: Option<&str>| {
        model_with_config(Some(json!({"bos_token": "<s>"})), |spec| {
            spec.chat_template = Some(file.clone());
            spec.chat_template_content_format = format.map(String::from);
            spec.chat_template_kwargs = Some(
                json!({"a": "server", "b": "server"})
                    .as_object()
                    .unwrap()
                    .clone(),
            );
        })
    };
    let (auto, _d) = load(None);
    assert_eq!(
        auto.unwrap().render_chat(&body).unwrap(),
        "hi|server|request"
    );
    let (parts, _d) = load(Some("openai"));
    assert_eq!(
        parts.unwrap().render_chat(&body).unwrap(),
        "[{'type': 'text', 'text': 'hi'}]|server|request"
    );
    let (bad, _d) = load(Some("parts"));
    assert_error(
        bad.unwrap_err(),
        "models.m.chat_template_content_format",
        "expected \"auto\", \"string\" or \"openai\"",
    );
}

/// A chat with an image: only the messages before the first message holding a media part can
/// match cached blocks; their tokens are the same conversation's tokens without it, and the
/// prompt's length is estimated from its text.
#[test]
fn a_chat_with_an_image_is_cacheable_only_before_its_first_media_message() {
    let (model, _dir) = test_model();
    let image = json!({"type": "image_url", "image_url": {"url": "data:,"}});
    let body = json!({"messages": [
        {"role": "system", "content": "Be brief. Describe what you are shown, in a few words."},
        {"role": "user", "content": "Here is a picture of the harbour at dawn, taken from the hill."},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image]},
    ]});
    let m = model
        .chat_media_prompt(&body)
        .unwrap()
        .expect("a media prompt");
    assert_eq!(m.first_media_message, 3);
    // The first three messages as the whole conversation renders them, less the last token.
    let full_text = model
        .chat_tokens(&json!({"messages": [
            body["messages"][0], body["messages"][1], body["messages"][2],
            {"role": "user", "content": "And this one?"},
        ]}))
        .unwrap();
    assert!(m.prefix.len() > 20, "{m:?}");
    assert_eq!(&full_text[..m.prefix.len()], &m.prefix[..]);
    // What follows the prefix in the text-only rendering is the next message's start.
    assert_eq!(m.estimated_tokens, full_text.len());
    // An image in the first message: nothing can match.
    let first = json!({"messages": [{"role": "user", "content": [image, {"type": "text", "text": "Hi?"}]}]});
    let m = model.chat_media_prompt(&first).unwrap().unwrap();
    assert_eq!((m.first_media_message, m.prefix.len()), (0, 0));
    assert!(m.estimated_tokens >= 1);
    // No media: not a media prompt; chat_tokens still refuses a media part, as before.
    assert!(model.chat_media_prompt(&conversation()).unwrap().is_none());
    assert!(model.chat_tokens(&body).is_err());
    // A non-text part that is not media is still refused.
    let odd = json!({"messages": [{"role": "user", "content": [{"type": "hologram"}, image]}]});
    assert!(model.chat_media_prompt(&odd).is_err());
    // The stand-in the mock engine uses differs per image.
    let other = json!({"type": "image_url", "image_url": {"url": "data:,x"}});
    assert_ne!(
        crate::media::media_stand_in(&image),
        crate::media::media_stand_in(&other)
    );
}
