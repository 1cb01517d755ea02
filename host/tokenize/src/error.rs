//! The one error type of the crate: which field of a request body or of the configuration is at
//! fault and why, so the HTTP layer can answer 400 (or refuse to start) with both.

/// An error naming the field at fault (`messages[2].content`, `prompt`,
/// `models.llama.tokenizer`) and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct TokenizeError {
    /// The field, as a path into the request body or the configuration.
    pub field: String,
    /// Why it was refused, for a person.
    pub reason: String,
}

impl TokenizeError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The field at fault.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// Why.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}
