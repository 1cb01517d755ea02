//! The Jinja environment chat templates run in, made to behave like the one Hugging Face
//! `transformers` renders them with (vLLM calls `apply_chat_template`), because a template that
//! renders differently here gives the router other tokens than the engine and every block hash
//! after the difference is wrong:
//! - `trim_blocks` and `lstrip_blocks` on, `{% break %}`/`{% continue %}` available;
//! - `raise_exception(message)` fails the render with that message (templates use it to refuse
//!   a conversation), and [`raised`] tells such a failure from a template bug;
//! - `strftime_now(format)` (`strftime.rs`), the current UTC time;
//! - `tojson` as Python's `json.dumps(x, ensure_ascii=False)` (`tojson.rs`), not minijinja's
//!   HTML-safe one: tool schemas are rendered into prompts with it;
//! - Python's string, list and dict methods (`.strip()`, `.items()`, `.startswith()`...) from
//!   `minijinja-contrib`'s `pycompat`.

mod strftime;
mod tojson;

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value};

/// The prefix of a `raise_exception` error's detail, so [`raised`] can find it again.
const RAISED: &str = "raise_exception: ";

/// A fresh environment with Hugging Face's settings and globals, and no templates.
pub(crate) fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid"),
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime::strftime_now);
    env.add_filter("tojson", tojson::tojson);
    env
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{message}"),
    ))
}

/// The message of a failure that the template raised itself with `raise_exception`.
pub(crate) fn raised(err: &Error) -> Option<&str> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = next {
        if let Some(e) = e.downcast_ref::<Error>() {
            if let Some(message) = e.detail().and_then(|d| d.strip_prefix(RAISED)) {
                return Some(message);
            }
        }
        next = e.source();
    }
    None
}

/// A render or compile failure in one line: the error, its location and its causes.
pub(crate) fn describe(err: &Error) -> String {
    let mut out = err.to_string();
    let mut next = std::error::Error::source(err);
    while let Some(e) = next {
        out.push_str(": ");
        out.push_str(&e.to_string());
        next = e.source();
    }
    out
}

#[cfg(test)]
pub(crate) use strftime::strftime;
#[cfg(test)]
pub(crate) use tojson::to_python_json;
