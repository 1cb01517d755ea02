//! Every configured model by name: `GET /v1/models` lists them, a request's `model` picks one.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::{Model, ModelSpec, TokenizeError};

/// The loaded models of a `[models]` section.
#[derive(Debug, Default, Clone)]
pub struct ModelRegistry {
    models: BTreeMap<String, Arc<Model>>,
}

impl ModelRegistry {
    /// Loads every model; the first failure (in name order) is the error, and nothing is kept.
    pub fn load_all(specs: &BTreeMap<String, ModelSpec>) -> Result<ModelRegistry, TokenizeError> {
        let models = specs
            .iter()
            .map(|(name, spec)| Ok((name.clone(), Arc::new(Model::load(name, spec)?))))
            .collect::<Result<_, TokenizeError>>()?;
        Ok(ModelRegistry { models })
    }

    /// A registry of models loaded elsewhere (tests, embedding).
    pub fn from_models(models: impl IntoIterator<Item = Model>) -> ModelRegistry {
        ModelRegistry {
            models: models
                .into_iter()
                .map(|m| (m.name().to_string(), Arc::new(m)))
                .collect(),
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
                TokenizeError::new(
                    "model",
                    format!(
                        "unknown model {name:?}; served: {}",
                        self.names().join(", ")
                    ),
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
