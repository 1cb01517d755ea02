use std::collections::BTreeMap;

use super::{assert_error, TempDir};
use crate::testing::write_test_model;
use crate::{ModelRegistry, ModelSpec};

#[test]
fn a_registry_of_two_models_resolves_by_name() {
    let dir = TempDir::new();
    let path = write_test_model(dir.path()).unwrap();
    let mut specs = BTreeMap::new();
    specs.insert("alpha".to_string(), ModelSpec::new(&path));
    specs.insert(
        "beta".to_string(),
        ModelSpec {
            block_size: Some(32),
            ..ModelSpec::new(&path)
        },
    );
    let registry = ModelRegistry::load_all(&specs).unwrap();
    assert_eq!(registry.names(), ["alpha", "beta"]);
    assert_eq!(registry.get("beta").unwrap().name(), "beta");
    assert_eq!(registry.get("beta").unwrap().block_size(), Some(32));
    assert_eq!(registry.get("alpha").unwrap().block_size(), None);
    assert!(registry.get("gamma").is_none());
    // Two models: no default, a request must name one.
    assert!(registry.default_model().is_none());
    assert_error(
        registry.resolve(None).unwrap_err(),
        "model",
        "is required: 2 models",
    );
    assert_error(
        registry.resolve(Some("gamma")).unwrap_err(),
        "model",
        "unknown model \"gamma\"; served: alpha, beta",
    );
    assert_eq!(registry.resolve(Some("alpha")).unwrap().name(), "alpha");

    specs.remove("beta");
    let one = ModelRegistry::load_all(&specs).unwrap();
    assert_eq!(one.default_model().unwrap().name(), "alpha");
    assert_eq!(one.resolve(None).unwrap().name(), "alpha");
}

#[test]
fn a_missing_tokenizer_file_names_the_model_field() {
    let dir = TempDir::new();
    let good = write_test_model(dir.path()).unwrap();
    let missing = dir.path().join("nowhere").join("tokenizer.json");
    let mut specs = BTreeMap::new();
    specs.insert("alpha".to_string(), ModelSpec::new(&good));
    specs.insert("llama".to_string(), ModelSpec::new(&missing));
    let err = ModelRegistry::load_all(&specs).unwrap_err();
    assert_error(err.clone(), "models.llama.tokenizer", "cannot read");
    assert!(
        err.reason().contains(&missing.display().to_string()),
        "{err}"
    );

    // Not a tokenizer: the reason says so.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, "{\"not\": \"a tokenizer\"}").unwrap();
    specs.insert("llama".to_string(), ModelSpec::new(&junk));
    assert_error(
        ModelRegistry::load_all(&specs).unwrap_err(),
        "models.llama.tokenizer",
        "is not a Hugging Face tokenizer.json",
    );
    specs.insert(
        "llama".to_string(),
        ModelSpec {
            block_size: Some(0),
            ..ModelSpec::new(&good)
        },
    );
    assert_error(
        ModelRegistry::load_all(&specs).unwrap_err(),
        "models.llama.block_size",
        "at least 1",
    );
}

#[test]
fn model_specs_refuse_unknown_fields() {
    let spec: ModelSpec = serde_json::from_value(serde_json::json!({
        "tokenizer": "/m/tokenizer.json", "chat_template": "/m/t.jinja", "block_size": 16
    }))
    .unwrap();
    assert_eq!(spec.block_size, Some(16));
    let err = serde_json::from_value::<ModelSpec>(serde_json::json!({
        "tokenizer": "/m/tokenizer.json", "chat_templte": "/m/t.jinja"
    }))
    .unwrap_err();
    assert!(err.to_string().contains("chat_templte"), "{err}");
}
