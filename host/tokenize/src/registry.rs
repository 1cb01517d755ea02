//! Every configured model by name: `GET /v1/models` lists them, a request's `model` picks one.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::{Model, ModelSpec, TokenizeError};

/// The loaded models of a `[models]` section.
#[derive(Debug, Default, Clone)]
pub struct ModelRegistry {
    models: BTreeMap<String, Arc<Model>>,
    /// Adapter name → the model it is served on (`[models.NAME] adapters`).
    adapters: BTreeMap<String, String>,
}

/// What a request's `model` names: a model, or a LoRA adapter served on one.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The model to tokenize with and whose workers serve the request.
    pub model: Arc<Model>,
    /// The adapter's name, when `model` named an adapter: the request's `lora_name`.
    pub lora_name: Option<String>,
}

impl ModelRegistry {
    /// Loads every model; the first failure (in name order) is the error, and nothing is kept.
    pub fn load_all(specs: &BTreeMap<String, ModelSpec>) -> Result<ModelRegistry, TokenizeError> {
        let adapters = adapters_of(specs)?;
        let models = specs
            .iter()
            .map(|(name, spec)| Ok((name.clone(), Arc::new(Model::load(name, spec)?))))
            .collect::<Result<_, TokenizeError>>()?;
        Ok(ModelRegistry { models, adapters })
    }

    /// Adds adapters to a registry built with [`ModelRegistry::from_models`]: `(adapter, base)`.
    pub fn with_adapters<'a>(
        mut self,
        adapters: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<ModelRegistry, TokenizeError> {
        for (a, base) in adapters {
            let field = format!("models.{base}.adapters");
            check_adapter(a, &field)?;
            if !self.models.contains_key(base) {
                return Err(TokenizeError::new(field, format!("no model {base:?}")));
            }
            if self.models.contains_key(a) || self.adapters.contains_key(a) {
                return Err(TokenizeError::new(
                    field,
                    format!("{a:?} already names a model or an adapter"),
                ));
            }
            self.adapters.insert(a.to_string(), base.to_string());
        }
        Ok(self)
    }

    /// The adapters and the model each is served on, by adapter name.
    pub fn adapters(&self) -> impl Iterator<Item = (&str, &str)> {
        self.adapters.iter().map(|(a, b)| (a.as_str(), b.as_str()))
    }

    /// Like [`ModelRegistry::resolve`], and a LoRA adapter's name resolves to the model it is
    /// served on, with the adapter as the request's `lora_name`.
    pub fn resolve_request(&self, model: Option<&str>) -> Result<Resolved, TokenizeError> {
        if let Some(base) = model.and_then(|m| self.adapters.get(m)) {
            return Ok(Resolved {
                model: self.resolve(Some(base))?,
                lora_name: model.map(str::to_string),
            });
        }
        Ok(Resolved {
            model: self.resolve(model)?,
            lora_name: None,
        })
    }

    /// A registry of models loaded elsewhere (tests, embedding).
    pub fn from_models(models: impl IntoIterator<Item = Model>) -> ModelRegistry {
        ModelRegistry {
            models: models
                .into_iter()
                .map(|m| (m.name().to_string(), Arc::new(m)))
                .collect(),
            adapters: BTreeMap::new(),
        }
    }

    pub fn get(&self, name: &str) -> Option<Arc<Model>> {
        self.models.get(name).cloned()
    }

    /// The names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.models.keys().map(String::as_str).collect()
    }

    pub fn len(&self) -> usize {
        self.models.len()
    }

    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// The model a request without a `model` field means: the only one, when exactly one is
    /// configured.
    pub fn default_model(&self) -> Option<Arc<Model>> {
        match self.models.len() {
            1 => self.models.values().next().cloned(),
            _ => None,
        }
    }

    /// The model a request's `model` field names, or the default one when it names none.
    /// Errors name the field `model`.
    pub fn resolve(&self, model: Option<&str>) -> Result<Arc<Model>, TokenizeError> {
        match model {
            Some(name) => self.get(name).ok_or_else(|| {
                let mut served = self.names();
                served.extend(self.adapters.keys().map(String::as_str));
                TokenizeError::new(
                    "model",
                    format!("unknown model {name:?}; served: {}", served.join(", ")),
                )
            }),
            None => self.default_model().ok_or_else(|| {
                TokenizeError::new(
                    "model",
                    format!(
                        "is required: {} models are served ({})",
                        self.len(),
                        self.names().join(", ")
                    ),
                )
            }),
        }
    }
}

fn check_adapter(a: &str, field: &str) -> Result<(), TokenizeError> {
    if a.is_empty() || a.len() > 256 || a.chars().any(char::is_control) {
        return Err(TokenizeError::new(
            field,
            format!("{a:?}: an adapter name is 1 to 256 bytes without control characters"),
        ));
    }
    Ok(())
}

/// Every `[models.NAME] adapters` entry, checked: a valid name, not a model's, not twice.
fn adapters_of(
    specs: &BTreeMap<String, ModelSpec>,
) -> Result<BTreeMap<String, String>, TokenizeError> {
    let mut out = BTreeMap::new();
    for (base, spec) in specs {
        let field = format!("models.{base}.adapters");
        for a in &spec.adapters {
            check_adapter(a, &field)?;
            if specs.contains_key(a) {
                return Err(TokenizeError::new(
                    field,
                    format!("{a:?} is also a [models.{a}]: a name is a model or an adapter"),
                ));
            }
            if let Some(other) = out.insert(a.clone(), base.clone()) {
                return Err(TokenizeError::new(
                    field,
                    format!("adapter {a:?} is listed under models.{other} too"),
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod adapter_tests {
    use super::*;

    fn spec(adapters: &[&str]) -> ModelSpec {
        let mut s = ModelSpec::new("/nonexistent/tokenizer.json");
        s.adapters = adapters.iter().map(|a| a.to_string()).collect();
        s
    }

    #[test]
    fn adapters_are_checked_by_name() {
        let mut specs = BTreeMap::new();
        specs.insert("base".to_string(), spec(&["sql", "chat"]));
        assert_eq!(adapters_of(&specs).unwrap()["sql"], "base");
        specs.insert("other".to_string(), spec(&["sql"]));
        let e = adapters_of(&specs).unwrap_err();
        assert!(e.to_string().contains("models.other.adapters"), "{e}");
        specs.remove("other");
        specs.insert("chat".to_string(), spec(&[]));
        let e = adapters_of(&specs).unwrap_err();
        assert!(e.to_string().contains("also a [models.chat]"), "{e}");
        specs.remove("chat");
        specs.insert("x".to_string(), spec(&[""]));
        assert!(adapters_of(&specs)
            .unwrap_err()
            .to_string()
            .contains("models.x.adapters"));
    }
}
