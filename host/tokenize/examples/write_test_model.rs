//! Writes the test model of `kvroute_tokenize::testing` (`tokenizer.json`, `tokenizer_config.json`)
//! into a directory, for tools outside Rust: `testdata/parity/gen_vectors.py` serves it with vLLM to
//! record what vLLM computes for the same tokenizer.
//!
//! `cargo run -p kvroute-tokenize --example write_test_model -- DIR`

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: write_test_model DIR");
        std::process::exit(2);
    };
    let dir = std::path::PathBuf::from(dir);
    if let Err(e) = std::fs::create_dir_all(&dir)
        .and_then(|()| kvroute_tokenize::testing::write_test_model(&dir))
    {
        eprintln!("cannot write the test model into {}: {e}", dir.display());
        std::process::exit(1);
    }
}
