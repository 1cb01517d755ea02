use minijinja::Value;
use serde_json::json;

use crate::template::{strftime, to_python_json};

#[test]
fn strftime_formats_utc_like_c() {
    assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
    // 2023-11-14T22:13:20Z, a Tuesday.
    let t = 1_700_000_000;
    assert_eq!(
        strftime("%A %-d %B %Y %H:%M:%S %j %a %y-%m %I%p %%", t).unwrap(),
        "Tuesday 14 November 2023 22:13:20 318 Tue 23-11 10PM %"
    );
    // A leap day.
    assert_eq!(
        strftime("%F %T", 951_782_400).unwrap(),
        "2000-02-29 00:00:00"
    );
    assert!(strftime("%Q", 0).is_err());
}

#[test]
fn tojson_is_pythons_json_dumps() {
    let value = Value::from(minijinja::value::Serde(json!({
        "b": [1, 2.0, 0.5, 1e20, 1.5e-7, -3],
        "a": "quote \" backslash \\ newline \n <tag> & ü",
        "c": {},
        "d": [],
        "e": null,
        "f": true,
    })));
    assert_eq!(
        to_python_json(&value).unwrap(),
        // Keys in insertion order, as Python's dicts keep them.
        "{\"b\": [1, 2.0, 0.5, 1e+20, 1.5e-07, -3], \
         \"a\": \"quote \\\" backslash \\\\ newline \\n <tag> & ü\", \"c\": {}, \"d\": [], \"e\": null, \"f\": true}"
    );
}

#[test]
fn tojson_takes_pythons_indent_and_separators() {
    let env = crate::template::environment();
    let ctx = minijinja::context! { x => Value::from(minijinja::value::Serde(json!({"k": [1, 2], "z": {}}))) };
    assert_eq!(
        env.render_str("{{ x | tojson(indent=2) }}", &ctx).unwrap(),
        "{\n  \"k\": [\n    1,\n    2\n  ],\n  \"z\": {}\n}"
    );
    assert_eq!(
        env.render_str("{{ x | tojson(separators=(',', ':')) }}", &ctx)
            .unwrap(),
        "{\"k\":[1,2],\"z\":{}}"
    );
    assert_eq!(
        env.render_str("{{ 'é' | tojson(ensure_ascii=true) }}", &ctx)
            .unwrap(),
        "\"\\u00e9\""
    );
}

#[test]
fn python_string_methods_and_loop_controls_work() {
    let env = crate::template::environment();
    let out = env
        .render_str(
            "{% for w in s.split(' ') %}{% if w.startswith('x') %}{% continue %}{% endif %}\
             {{ w.upper() }}{% if loop.index == 3 %}{% break %}{% endif %}{% endfor %}\
             |{{ d.items() | list | length }}",
            minijinja::context! { s => "a xb c d e", d => Value::from(minijinja::value::Serde(json!({"k": 1}))) },
        )
        .unwrap();
    // "xb" is skipped, the loop breaks at its third item ("c").
    assert_eq!(out, "AC|1");
}
