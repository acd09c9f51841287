//! Bad checkpoints and bad input: each gives a clear error naming what is wrong
//! (the tensor, the file) and a non-zero exit, never a panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::tensor::TensorView;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/f32-text-perexpert")
}

/// A fresh copy of the small text-layout fixture in a temp directory.
fn copy_fixture(tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("lily-bad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(f), dst.join(f)).unwrap();
    }
    dst
}

/// Rewrite model.safetensors through `edit(name, dtype, shape, bytes)`, which
/// may drop a tensor (None) or change it.
fn rewrite(
    dir: &Path,
    edit: impl Fn(
        &str,
        safetensors::Dtype,
        Vec<usize>,
        Vec<u8>,
    ) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .iter()
        .filter_map(|(n, v)| {
            edit(n, v.dtype(), v.shape().to_vec(), v.data().to_vec())
                .map(|(d, s, b)| (n.to_string(), d, s, b))
        })
        .collect();
    let map: HashMap<String, TensorView> = kept
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(map, None, &path).unwrap();
}

/// Run `lily logits` on `dir`; return (success, stderr).
fn logits(dir: &Path, tokens: &str) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["logits", "--model"])
        .arg(dir)
        .args(["--tokens", tokens, "--out"])
        .arg(dir.join("out.safetensors"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!err.contains("panicked"), "lily panicked:\n{err}");
    (out.status.success(), err)
}

fn expect_error(dir: &Path, needles: &[&str]) {
    let (ok, err) = logits(dir, "1,2,3");
    assert!(!ok, "expected failure, got success");
    for n in needles {
        assert!(err.contains(n), "error should mention {n:?}, got:\n{err}");
    }
}

#[test]
fn the_fixture_itself_runs() {
    let dir = copy_fixture("ok");
    let (ok, err) = logits(&dir, "1,2,3");
    assert!(ok, "{err}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture("missing");
    let gone = "model.layers.2.linear_attn.in_proj_z.weight";
    rewrite(
        &dir,
        |n, d, s, b| if n == gone { None } else { Some((d, s, b)) },
    );
    expect_error(&dir, &[gone, "missing", dir.to_str().unwrap()]);
}

#[test]
fn misshaped_tensor_is_named_with_both_shapes() {
    let dir = copy_fixture("shape");
    let name = "model.layers.3.self_attn.k_proj.weight";
    rewrite(&dir, |n, d, s, b| {
        if n == name {
            let cut = s[1] * 4 * 2; // drop two rows
            Some((d, vec![s[0] - 2, s[1]], b[..b.len() - cut].to_vec()))
        } else {
            Some((d, s, b))
        }
    });
    expect_error(
        &dir,
        &[
            name,
            "model.safetensors",
            "shape [30, 32]",
            "expected [32, 32]",
        ],
    );
}

#[test]
fn unsupported_dtype_is_named() {
    let dir = copy_fixture("dtype");
    let name = "model.norm.weight";
    rewrite(&dir, |n, d, s, b| {
        if n == name {
            Some((safetensors::Dtype::I32, s, b))
        } else {
            Some((d, s, b))
        }
    });
    expect_error(&dir, &[name, "I32", "model.safetensors"]);
}

#[test]
fn truncated_file_is_an_error() {
    let dir = copy_fixture("trunc");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    expect_error(&dir, &["model.safetensors", "truncated"]);
}

#[test]
fn corrupt_header_is_an_error() {
    let dir = copy_fixture("header");
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    for b in &mut bytes[8..40] {
        *b = b'#';
    }
    std::fs::write(&path, &bytes).unwrap();
    expect_error(&dir, &["model.safetensors", "corrupt"]);
    // and a header length that points past the end of the file
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    expect_error(&dir, &["model.safetensors"]);
}

#[test]
fn index_pointing_to_a_missing_shard_is_named() {
    let dir = copy_fixture("index");
    let st_bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
    let mut map = serde_json::Map::new();
    for n in st.names() {
        let shard = if n.contains("layers.1.") {
            "model-00002-of-00002.safetensors"
        } else {
            "model.safetensors"
        };
        map.insert(n.to_string(), serde_json::Value::String(shard.into()));
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    expect_error(
        &dir,
        &[
            "model-00002-of-00002.safetensors",
            "does not exist",
            "model.layers.1.",
        ],
    );
}

#[test]
fn unsupported_model_type_is_rejected() {
    let dir = copy_fixture("mtype");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("qwen3_5_moe_text", "llama"),
    )
    .unwrap();
    expect_error(&dir, &["unsupported model_type", "llama"]);
}

#[test]
fn inconsistent_sizes_are_all_listed() {
    let dir = copy_fixture("sizes");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["num_key_value_heads"] = 3.into(); // 4 heads not a multiple of 3
    cfg["num_experts_per_tok"] = 99.into(); // more than the experts
    cfg["num_hidden_layers"] = 7.into(); // layer_types has 4
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    expect_error(
        &dir,
        &[
            "num_key_value_heads (3)",
            "num_experts_per_tok (99)",
            "layer_types has 4 entries",
            "3 problem(s)",
        ],
    );
}

#[test]
fn missing_config_and_missing_dir() {
    let dir = copy_fixture("nocfg");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    expect_error(&dir, &["config.json"]);
    expect_error(
        Path::new("/nonexistent/lily-model"),
        &["/nonexistent/lily-model", "does not exist"],
    );
}

#[test]
fn bad_tokens_are_errors_not_panics() {
    let dir = copy_fixture("tokens");
    let (ok, err) = logits(&dir, "1,2,999999");
    assert!(!ok);
    assert!(
        err.contains("999999") && err.contains("out of range"),
        "{err}"
    );
    let (ok, _) = logits(&dir, "1,x,3");
    assert!(!ok);
}
