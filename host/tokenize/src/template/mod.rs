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
//!   `minijinja-contrib`'s `pycompat`;
//! - the tests `iterable` and `sequence` as Jinja2 defines them (Python's `iter()` and
//!   `len()`+`__getitem__`): `none is iterable` is false (minijinja says true, and templates
//!   such as Hermes' and Qwen3-Coder's then take `none | length` and fail on every request
//!   without tools), `"text" is sequence` and `{} is sequence` are true;
//! - `{% generation %}...{% endgeneration %}` (`transformers`' assistant-mask tag) renders its
//!   body, as it does when no mask is asked for ([`prepare`]).
//!
//! `content_format.rs` tells, from a template's syntax, whether it takes message contents as
//! strings or as lists of parts, as vLLM decides it.

mod content_format;
mod strftime;
mod tojson;

pub(crate) use content_format::{detect as content_format, ContentFormat};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, Value};

/// The prefix of a `raise_exception` error's detail, so [`raised`] can find it again.
const RAISED: &str = "raise_exception: ";

/// A fresh environment with Hugging Face's settings and globals, and no templates.
pub(crate) fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(syntax());
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime::strftime_now);
    env.add_filter("tojson", tojson::tojson);
    env.add_test("iterable", is_iterable);
    env.add_test("sequence", is_sequence);
    env
}

/// The syntax chat templates are written in: Jinja's delimiters, `trim_blocks` and
/// `lstrip_blocks` on.
pub(crate) fn syntax() -> SyntaxConfig {
    SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .expect("the default delimiters are valid")
}

/// Jinja2's `iterable`: whether Python's `iter()` takes the value. An undefined value is (Jinja2's
/// `Undefined` iterates as empty); none, booleans and numbers are not.
fn is_iterable(value: &Value) -> bool {
    match value.kind() {
        ValueKind::Undefined => true,
        ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
        _ => value.try_iter().is_ok(),
    }
}

/// Jinja2's `sequence`: whether the value has a length and items (`len()` and `__getitem__`):
/// strings, lists and mappings are, and so is an undefined value (Jinja2's `Undefined` has both).
fn is_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined | ValueKind::String | ValueKind::Seq | ValueKind::Map
    )
}

/// The source as minijinja can compile it: `transformers`' `{% generation %}` and
/// `{% endgeneration %}` tags (which mark the assistant's tokens and otherwise render their body,
/// as a call block: in a scope of its own) become `{% with %}` and `{% endwith %}`, keeping their
/// whitespace control.
pub(crate) fn prepare(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let replaced = tag.find("%}").and_then(|close| {
            let inside = &tag[2..close];
            let open_ctl = inside.strip_prefix(['-', '+']).map(|_| &inside[..1]);
            let inside = &inside[open_ctl.map_or(0, str::len)..];
            let close_ctl = inside
                .strip_suffix(['-', '+'])
                .map(|_| &inside[inside.len() - 1..]);
            let word = inside[..inside.len() - close_ctl.map_or(0, str::len)].trim();
            let replacement = match word {
                "generation" => "with",
                "endgeneration" => "endwith",
                _ => return None,
            };
            let tag = format!(
                "{{%{} {replacement} {}%}}",
                open_ctl.unwrap_or(""),
                close_ctl.unwrap_or("")
            );
            Some((tag, close + 2))
        });
        match replaced {
            Some((tag, len)) => {
                out.push_str(&tag);
                rest = &rest[at + len..];
            }
            None => {
                out.push_str("{%");
                rest = &rest[at + 2..];
            }
        }
    }
    out.push_str(rest);
    out
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

pub(crate) use strftime::clock_reads;
#[cfg(test)]
pub(crate) use strftime::{strftime, FIXED_NOW};
#[cfg(test)]
pub(crate) use tojson::to_python_json;
