use super::{test_model, TempDir};
use crate::testing::{write_test_model, BOS, PROSE};
use crate::Model;

#[test]
fn the_test_model_is_the_same_bytes_every_time() {
    let (a, b) = (TempDir::new(), TempDir::new());
    write_test_model(a.path()).unwrap();
    write_test_model(b.path()).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        let left = std::fs::read(a.path().join(file)).unwrap();
        let right = std::fs::read(b.path().join(file)).unwrap();
        assert!(left.len() > 1000 || file != "tokenizer.json");
        assert_eq!(left, right, "{file} differs between two calls");
    }
}

#[test]
fn the_trained_tokenizer_merges_words_and_round_trips_text() {
    let (model, _dir) = test_model();
    let paragraph = PROSE.split("\n\n").next().unwrap();
    let ids = model.encode(paragraph, false).unwrap();
    // BPE learned merges: fewer than half as many tokens as bytes (one token per byte without).
    assert!(
        ids.len() * 2 < paragraph.len(),
        "{} tokens for {} bytes",
        ids.len(),
        paragraph.len()
    );
    assert_eq!(model.decode(&ids).unwrap(), paragraph);
    // Byte-level: text the training never saw still round-trips.
    let unseen = "Naïve café — 東京 🚂 {\"json\": [1, 2]}\n\ttabs";
    assert_eq!(
        model.decode(&model.encode(unseen, false).unwrap()).unwrap(),
        unseen
    );
}

#[test]
fn special_tokens_add_exactly_the_bos() {
    let (model, _dir) = test_model();
    let bos = model.encode(BOS, false).unwrap();
    assert_eq!(bos.len(), 1, "<s> is one special token");
    let plain = model.encode("The river rises in spring.", false).unwrap();
    let special = model.encode("The river rises in spring.", true).unwrap();
    assert_eq!(special[0], bos[0]);
    assert_eq!(&special[1..], &plain[..]);
    assert_eq!(model.token_text(bos[0]), BOS);
    // decode leaves special tokens out, as vLLM's output does.
    assert_eq!(
        model.decode(&special).unwrap(),
        "The river rises in spring."
    );
}

#[test]
fn token_texts_and_the_text_stream_rebuild_the_text() {
    let (model, _dir) = test_model();
    let text = "The market opened at seven, café 東京.";
    let ids = model.encode(text, false).unwrap();
    let mut stream = model.text_stream();
    let mut streamed = String::new();
    for id in &ids {
        if let Some(piece) = stream.step(*id).unwrap() {
            streamed.push_str(&piece);
        }
    }
    assert_eq!(streamed, text);
    // ASCII tokens alone are their own text.
    let ascii = model.encode("The market", false).unwrap();
    let joined: String = ascii.iter().map(|id| model.token_text(*id)).collect();
    assert_eq!(joined, "The market");
}

#[test]
fn a_model_is_send_and_sync() {
    fn shareable<T: Send + Sync + 'static>() {}
    shareable::<Model>();
    shareable::<std::sync::Arc<Model>>();
}
