use serde_json::json;

use super::{assert_error, test_model};

#[test]
fn a_string_prompt_is_encoded_with_special_tokens() {
    let (model, _dir) = test_model();
    let text = "Bread is one of the oldest things people make.";
    let ids = model
        .completion_tokens(&json!({"model": "test", "prompt": text}))
        .unwrap();
    assert_eq!(ids, model.encode(text, true).unwrap());
    // vLLM's switch: add_special_tokens false leaves the bos out.
    let plain = model
        .completion_tokens(&json!({"prompt": text, "add_special_tokens": false}))
        .unwrap();
    assert_eq!(plain, model.encode(text, false).unwrap());
    assert_eq!(plain.len() + 1, ids.len());
    // An array of one string is the same prompt.
    assert_eq!(
        model.completion_tokens(&json!({"prompt": [text]})).unwrap(),
        ids
    );
}

#[test]
fn token_id_prompts_pass_through_unchanged() {
    let (model, _dir) = test_model();
    let ids = model.encode("Rivers begin as small things", false).unwrap();
    assert_eq!(
        model.completion_tokens(&json!({"prompt": ids})).unwrap(),
        ids
    );
    assert_eq!(
        model.completion_tokens(&json!({"prompt": [ids]})).unwrap(),
        ids
    );
}

#[test]
fn wrong_prompts_name_the_field() {
    let (model, _dir) = test_model();
    let vocab = model.vocab_size();
    let cases = [
        (json!({"model": "test"}), "prompt", "is required"),
        (json!({"prompt": null}), "prompt", "is required"),
        (
            json!({"prompt": 42}),
            "prompt",
            "expected a string or an array of token ids",
        ),
        (
            json!({"prompt": {"text": "hi"}}),
            "prompt",
            "expected a string",
        ),
        (json!({"prompt": []}), "prompt", "is empty"),
        (
            json!({"prompt": ["one", "two"]}),
            "prompt",
            "batch of 2 prompts",
        ),
        (
            json!({"prompt": [[1, 2], [3]]}),
            "prompt",
            "batch of 2 prompts",
        ),
        (
            json!({"prompt": [1, "two"]}),
            "prompt",
            "expected a string or an array",
        ),
        (
            json!({"prompt": [5, -1]}),
            "prompt[1]",
            "expected a token id",
        ),
        (
            json!({"prompt": [5, 1.5]}),
            "prompt[1]",
            "expected a token id",
        ),
        (
            json!({"prompt": [5, vocab]}),
            "prompt[1]",
            &format!("0 to {}", vocab - 1),
        ),
        (
            json!({"prompt": [[5, vocab]]}),
            "prompt[0][1]",
            "expected a token id",
        ),
        (
            json!({"prompt": [{}]}),
            "prompt[0]",
            "expected a string or an array",
        ),
        (
            json!({"prompt": "x", "add_special_tokens": "yes"}),
            "add_special_tokens",
            "expected a boolean",
        ),
        (
            json!({"prompt": "", "add_special_tokens": false}),
            "prompt",
            "encodes to no tokens",
        ),
        (json!(["prompt"]), "body", "expected a JSON object"),
    ];
    for (body, field, reason) in cases {
        let err = model.completion_tokens(&body).expect_err(&body.to_string());
        assert_error(err, field, reason);
    }
}
