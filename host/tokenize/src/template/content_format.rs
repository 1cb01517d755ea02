//! Which form a chat template takes message contents in, decided from the template's syntax as
//! vLLM decides it (its "content format" detection, `--chat-template-content-format auto`):
//! - [`ContentFormat::Parts`] ("openai") when the template loops over a message's content: a
//!   `{% for x in message.content %}` (or `message['content']`, through filters, tests or a
//!   slice), where `message` is the target of a loop over `messages` (or over a variable set from
//!   it); a loop inside a macro over a parameter that some call passes a message's content in;
//!   or, outside macros, a loop over a variable named `content`.
//! - [`ContentFormat::String`] otherwise, and also when the template uses a shape vLLM's walk
//!   gives up on (a loop or assignment over messages whose target is not a plain name): vLLM
//!   then falls back to the string form.
//!
//! The walk runs over minijinja's parse tree, read as JSON (`unstable_machinery_serde`), so it
//! needs no code per node kind: every node is an object tagged `"stmt"` or `"expr"` whose fields
//! are in `inner[0]`.

use std::collections::BTreeSet;

use minijinja::machinery::parse;
use minijinja::syntax::SyntaxConfig;
use serde_json::Value as Json;

/// How message contents reach the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ContentFormat {
    /// A string: text parts joined with "\n" (vLLM's "string").
    String,
    /// A list of parts, `{"type": "text", "text": ...}` (vLLM's "openai").
    Parts,
}

/// The content format of `source`; a template that does not parse is taken as `String`.
pub(crate) fn detect(source: &str, syntax: SyntaxConfig) -> ContentFormat {
    let Ok(ast) = parse(source, "chat_template", syntax) else {
        return ContentFormat::String;
    };
    let Ok(tree) = serde_json::to_value(&ast) else {
        return ContentFormat::String;
    };
    match has_content_loop(&tree) {
        Some(true) => ContentFormat::Parts,
        Some(false) | None => ContentFormat::String,
    }
}

/// A node's kind and fields, if `v` is a node.
fn node(v: &Json) -> Option<(&str, &Json)> {
    let obj = v.as_object()?;
    let kind = obj
        .get("stmt")
        .or_else(|| obj.get("expr"))
        .and_then(Json::as_str)?;
    let fields = obj.get("inner")?.as_array()?.first()?;
    Some((kind, fields))
}

/// Every node of `kind` under `root` (itself included), in document order.
fn find_all<'a>(root: &'a Json, kind: &str, out: &mut Vec<&'a Json>) {
    if let Some((k, fields)) = node(root) {
        if k == kind {
            out.push(fields);
        }
    }
    match root {
        Json::Array(items) => items.iter().for_each(|v| find_all(v, kind, out)),
        Json::Object(map) => map.values().for_each(|v| find_all(v, kind, out)),
        _ => {}
    }
}

fn all<'a>(root: &'a Json, kind: &str) -> Vec<&'a Json> {
    let mut out = Vec::new();
    find_all(root, kind, &mut out);
    out
}

/// The name a `Var` node loads.
fn var_name(v: &Json) -> Option<&str> {
    match node(v)? {
        ("Var", fields) => fields.get("id")?.as_str(),
        _ => None,
    }
}

/// `expr` is `name`, `name.key` or `name['key']` (with `key`), possibly under filters, tests
/// and slices: vLLM's `_is_var_or_elems_access`.
fn accesses(expr: &Json, name: &str, key: Option<&str>) -> bool {
    let Some((kind, fields)) = node(expr) else {
        return false;
    };
    match kind {
        "Filter" | "Test" | "Slice" => fields
            .get("expr")
            .is_some_and(|inner| accesses(inner, name, key)),
        "GetAttr" => {
            key.is_some()
                && fields.get("name").and_then(Json::as_str) == key
                && fields.get("expr").and_then(var_name) == Some(name)
        }
        "GetItem" => {
            let Some(key) = key else { return false };
            let subscript = fields.get("subscript_expr").and_then(node);
            let is_key = matches!(subscript, Some(("Const", c))
                if c.get("value").and_then(Json::as_str) == Some(key));
            is_key && fields.get("expr").and_then(var_name) == Some(name)
        }
        "Var" => key.is_none() && fields.get("id").and_then(Json::as_str) == Some(name),
        _ => false,
    }
}

/// Names bound to `messages` or to something taken from it (`{% set m = messages[1:] %}`),
/// transitively. `None` when such an assignment has a target that is not a plain name.
fn message_lists(tree: &Json) -> Option<Vec<String>> {
    let sets = all(tree, "Set");
    let mut names = vec!["messages".to_string()];
    let mut queue = vec!["messages".to_string()];
    let mut seen: BTreeSet<String> = BTreeSet::new();
    while let Some(name) = queue.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        for set in &sets {
            let (Some(target), Some(value)) = (set.get("target"), set.get("expr")) else {
                continue;
            };
            if accesses(value, &name, None) {
                let target = var_name(target)?.to_string();
                if !names.contains(&target) {
                    names.push(target.clone());
                }
                queue.push(target);
            }
        }
    }
    Some(names)
}

/// Loop variables that run over a message list. `None` when one is not a plain name.
fn message_vars(tree: &Json, lists: &[String]) -> Option<Vec<String>> {
    let mut vars = Vec::new();
    for lp in all(tree, "ForLoop") {
        let Some(iter) = lp.get("iter") else { continue };
        if lists.iter().any(|list| accesses(iter, list, None)) {
            vars.push(var_name(lp.get("target")?)?.to_string());
        }
    }
    Some(vars)
}

/// Whether some loop runs over a message's content; `None` where vLLM's walk fails.
fn has_content_loop(tree: &Json) -> Option<bool> {
    let lists = message_lists(tree)?;
    let vars = message_vars(tree, &lists)?;
    let is_content = |expr: &Json| vars.iter().any(|v| accesses(expr, v, Some("content")));

    // Loops inside macros, and the macro parameters that some call passes a content in.
    let calls = all(tree, "Call");
    let mut in_macros: Vec<*const Json> = Vec::new();
    let mut content_params: Vec<(*const Json, BTreeSet<String>)> = Vec::new();
    for mac in all(tree, "Macro") {
        let name = mac.get("name").and_then(Json::as_str).unwrap_or_default();
        let params: Vec<&str> = mac
            .get("args")
            .and_then(Json::as_array)
            .map(|args| args.iter().filter_map(var_name).collect())
            .unwrap_or_default();
        let mut passed: BTreeSet<String> = BTreeSet::new();
        for call in &calls {
            if call.get("expr").and_then(var_name) != Some(name) {
                continue;
            }
            let args = call.get("args").and_then(Json::as_array);
            let mut position = 0;
            for arg in args.into_iter().flatten() {
                // CallArg is an externally tagged enum: {"Pos": expr} or {"Kwarg": [name, expr]}.
                if let Some(expr) = arg.get("Pos") {
                    if position < params.len() && is_content(expr) {
                        passed.insert(params[position].to_string());
                    }
                    position += 1;
                } else if let Some(kw) = arg.get("Kwarg").and_then(Json::as_array) {
                    if let (Some(key), Some(expr)) = (kw.first().and_then(Json::as_str), kw.get(1))
                    {
                        if params.contains(&key) && is_content(expr) {
                            passed.insert(key.to_string());
                        }
                    }
                }
            }
        }
        for lp in all(mac, "ForLoop") {
            in_macros.push(lp as *const Json);
            if !passed.is_empty() {
                content_params.push((lp as *const Json, passed.clone()));
            }
        }
    }

    for lp in all(tree, "ForLoop") {
        let Some(iter) = lp.get("iter") else { continue };
        let target = lp.get("target");
        if is_content(iter) {
            return target.and_then(var_name).map(|_| true);
        }
        let iter_name = var_name(iter);
        let ptr = lp as *const Json;
        if let Some((_, params)) = content_params.iter().find(|(p, _)| *p == ptr) {
            if iter_name.is_some_and(|n| params.contains(n)) {
                return target.and_then(var_name).map(|_| true);
            }
        }
        if !in_macros.contains(&ptr) && iter_name == Some("content") {
            return target.and_then(var_name).map(|_| true);
        }
    }
    Some(false)
}
