//! Scratch harness: renders `[{template, body}]` (a JSON file) with kvroute's chat rendering.
use kvroute_tokenize::{testing::write_test_model, Model, ModelSpec};

fn main() {
    let path = std::env::args().nth(1).expect("cases.json");
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("render-cases-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tok = write_test_model(&dir).unwrap();
    let mut out = Vec::new();
    for case in cases {
        let mut spec = ModelSpec::new(&tok);
        spec.chat_template = Some(case["template"].as_str().unwrap().into());
        let r = match Model::load("m", &spec) {
            Err(e) => serde_json::json!({"err": e.to_string()}),
            Ok(model) => match model.render_chat(&case["body"]) {
                Ok(s) => serde_json::json!({"ok": s}),
                Err(e) => serde_json::json!({"err": e.to_string()}),
            },
        };
        out.push(r);
    }
    println!("{}", serde_json::to_string_pretty(&out).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}
