//! Block-FP8 checkpoints through `lily logits` on the CPU: the committed cases
//! (`fixtures/models-fp8`), layouts made here from them that the fixture
//! script never wrote (another sharding, f16 and f32 scales, the
//! quantization_config inside text_config), and the bad variants, each refused
//! with a message that names what is wrong.

mod support;

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use support::{f32s, run_logits};

use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Of the largest logit: the exact dequantization leaves summation order only
/// (measured ~5e-7); ignoring the scales moves logits by 0.1-0.3 of it.
const FP8_TOL: f32 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models-fp8")
}

/// The reference's tokens and all-prefill logits.
fn reference(case: &str) -> (Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(fixtures().join(case).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tokens = st
        .tensor("tokens")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    (tokens, f32s(st.tensor("logits").unwrap().data()))
}

/// `lily logits` on the CPU in f32; Ok(logits) or Err(stderr). Never a panic.
fn logits(dir: &Path, tokens: &[u32]) -> Result<Vec<f32>, String> {
    logits_with(dir, tokens, &[])
}

fn logits_with(dir: &Path, tokens: &[u32], extra: &[&str]) -> Result<Vec<f32>, String> {
    let ids: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    let out_path = std::env::temp_dir().join(format!(
        "lily-fp8-{}-{}.safetensors",
        dir.file_name().unwrap().to_string_lossy(),
        std::process::id()
    ));
    let mut args: Vec<OsString> = ["logits", "--device", "cpu", "--f32-activations", "--model"]
        .iter()
        .map(OsString::from)
        .collect();
    args.push(dir.into());
    args.extend(["--tokens".into(), ids.join(",").into(), "--out".into()]);
    args.push(out_path.clone().into());
    args.extend(extra.iter().map(OsString::from));
    let res = run_logits(&args, &out_path).map(|(_, v)| v);
    std::fs::remove_file(&out_path).ok();
    res
}

fn check(dir: &Path, case: &str) {
    check_with(dir, case, &[])
}

fn check_with(dir: &Path, case: &str, extra: &[&str]) {
    let (tokens, want) = reference(case);
    let got = logits_with(dir, &tokens, extra).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_eq!(got.len(), want.len());
    let max_logit = want.iter().fold(0f32, |a, x| a.max(x.abs()));
    let diff = got
        .iter()
        .zip(&want)
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    println!(
        "{}: max|diff|/max|logit| {:.2e}",
        dir.display(),
        diff / max_logit
    );
    assert!(
        diff / max_logit <= FP8_TOL,
        "{}: max|diff| {diff} of max|logit| {max_logit}",
        dir.display()
    );
}

#[test]
fn the_committed_fp8_cases_match_their_reference() {
    for case in ["fp8-bf16scale-sharded", "fp8-f32scale-partial", "fp8-tiny"] {
        check(&fixtures().join(case), case);
    }
}

/// Every tensor of a checkpoint directory: name -> (dtype, shape, bytes).
type Tensors = HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn read_all(dir: &Path) -> Tensors {
    let mut out = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors")
            && p.file_name().unwrap() != "reference.safetensors"
        {
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (n, v) in st.iter() {
                out.insert(
                    n.to_string(),
                    (v.dtype(), v.shape().to_vec(), v.data().to_vec()),
                );
            }
        }
    }
    out
}

/// Write `tensors` into `dir` as the shards `shard_of` names, with an index.
fn write_sharded(dir: &Path, tensors: &Tensors, shard_of: impl Fn(&str) -> String) {
    let mut shards: HashMap<String, HashMap<String, TensorView>> = HashMap::new();
    let mut weight_map = serde_json::Map::new();
    for (n, (d, s, b)) in tensors {
        let f = shard_of(n);
        weight_map.insert(n.clone(), f.clone().into());
        shards
            .entry(f)
            .or_default()
            .insert(n.clone(), TensorView::new(*d, s.clone(), b).unwrap());
    }
    for (f, map) in shards {
        safetensors::serialize_to_file(map, None, &dir.join(f)).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// Scale bytes re-encoded from bf16 to `to` (exact: scales are bf16 values
/// well inside f16's normal range).
fn reencode(d: Dtype, b: &[u8], to: Dtype) -> Vec<u8> {
    assert_eq!(d, Dtype::BF16);
    b.chunks_exact(2)
        .flat_map(|c| {
            let x = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            match to {
                Dtype::F16 => {
                    let h = half::f16::from_f32(x);
                    assert_eq!(h.to_f32(), x, "scale {x} not exact in f16");
                    h.to_bits().to_le_bytes().to_vec()
                }
                Dtype::F32 => x.to_le_bytes().to_vec(),
                _ => unreachable!(),
            }
        })
        .collect()
}

fn fresh(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lily-fp8-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn layouts_the_fixture_script_never_wrote_load_the_same() {
    let case = "fp8-bf16scale-sharded";
    let src = fixtures().join(case);
    let tensors = read_all(&src);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for (tag, scale_dtype) in [("f16-scales", Dtype::F16), ("f32-scales", Dtype::F32)] {
        let dir = fresh(tag);
        let mut t = tensors.clone();
        for (n, (d, _, b)) in t.iter_mut() {
            if n.ends_with("weight_scale_inv") {
                *b = reencode(*d, b, scale_dtype);
                *d = scale_dtype;
            }
        }
        // every scale in a shard of its own, apart from its weight; the
        // experts in another
        write_sharded(&dir, &t, |n| {
            if n.ends_with("_scale_inv") {
                "scales.safetensors".into()
            } else if n.contains(".experts.") {
                "experts.safetensors".into()
            } else {
                "rest.safetensors".into()
            }
        });
        // the quantization_config inside text_config instead of beside it
        let mut cfg = config.clone();
        let q = cfg
            .as_object_mut()
            .unwrap()
            .remove("quantization_config")
            .unwrap();
        cfg["text_config"]["quantization_config"] = q;
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        check(&dir, case);
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn bad_fp8_checkpoints_are_refused_with_the_reason() {
    let cases: [(&str, &[&str]); 5] = [
        (
            "bad-missing-scale-inv",
            &[
                "model.language_model.layers.0.mlp.experts.1.down_proj.weight",
                "has no",
                "weight_scale_inv",
            ],
        ),
        (
            "bad-block-size-64",
            &["weight_block_size", "[64, 64]", "128"],
        ),
        (
            "bad-activation-static",
            &["activation_scheme", "static", "not supported"],
        ),
        (
            "bad-input-scale",
            &[
                "model.language_model.layers.1.self_attn.q_proj.input_scale",
                "static activation scales are not supported",
            ],
        ),
        (
            "bad-scale-shape",
            &[
                "model.language_model.layers.1.self_attn.o_proj.weight_scale_inv",
                "[1, 2]",
                "needs [1, 1]",
            ],
        ),
    ];
    for (dir, needles) in cases {
        let err = logits(&fixtures().join(dir), &[1, 2, 3]).expect_err(dir);
        for n in needles {
            assert!(err.contains(n), "{dir}: the error should say {n:?}:\n{err}");
        }
    }
}

#[test]
fn fp8_tensors_without_a_quantization_config_are_refused() {
    let src = fixtures().join("fp8-tiny");
    let dir = fresh("no-qconfig");
    for f in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let err = logits(&dir, &[1, 2, 3]).unwrap_err();
    assert!(
        err.contains("F8_E4M3") && err.contains("quantization_config"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `--quantize fp8` on the bf16 model fp8-tiny was quantized from
/// (`fp8-tiny-base`, written by the same script) makes the same codes and
/// scales bit for bit, so the same logits as the FP8 checkpoint's reference.
#[test]
fn quantizing_at_load_matches_the_released_rule() {
    check_with(
        &fixtures().join("fp8-tiny-base"),
        "fp8-tiny",
        &["--quantize", "fp8"],
    );
    // and quantizing an FP8 checkpoint again is refused
    let (tokens, _) = reference("fp8-tiny");
    let err = logits_with(
        &fixtures().join("fp8-tiny"),
        &tokens,
        &["--quantize", "fp8"],
    )
    .unwrap_err();
    assert!(err.contains("already"), "{err}");
}
