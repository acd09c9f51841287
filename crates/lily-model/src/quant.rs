//! How a checkpoint stores its linear weights: dense (bf16, f16, f32) or
//! quantized (codes plus per-block scales). `WeightFormat` is what config.json
//! declares; [`Quantized`] is one quantized matrix, which every host consumer
//! reads through `Tensor::read_f32` as exactly dequantized f32; [`pair`] joins
//! each quantized weight with its scales after the shards are mapped.
//!
//! Block FP8 (Qwen's `-FP8` releases, DeepSeek-V3's format): each quantized
//! `<module>.weight` is `F8_E4M3` [out, in] with a sibling
//! `<module>.weight_scale_inv` [ceil(out/128), ceil(in/128)] (bf16, f16 or
//! f32) that, despite its name, multiplies: `w[r][c] = f32(q[r][c]) *
//! f32(scale[r/128][c/128])`. Which matrices are quantized is read from each
//! tensor's dtype, never from a list of module names (releases differ).
//!
//! A new scheme (e.g. MLX affine 4-bit: packed u32 codes, a scale and a bias
//! per group of 64) is a `Scheme` variant, its config parsing in
//! `WeightFormat::from_config` and its pairing and dequantization here; the
//! weights' typed structs and the CPU model do not change.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};

use anyhow::{bail, Result};
use serde_json::Value;

use crate::tensor::{DType, Storage, Tensor};

/// The block of Lily's FP8 kernels: [rows, cols] of the weight per scale.
pub const FP8_BLOCK: [usize; 2] = [128, 128];

/// The storage format config.json declares for the linear weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// Every tensor in a float dtype (bf16, f16, f32).
    Dense,
    /// Block FP8 (`quant_method: "fp8"`, e4m3 codes, dynamic activations).
    Fp8Block { block: [usize; 2] },
}

impl WeightFormat {
    /// From config.json's `quantization_config`, at the top level (the
    /// released `Qwen3_5MoeForConditionalGeneration` layout) or inside
    /// `text_config`. No such key: dense.
    pub fn from_config(root: &Value) -> Result<WeightFormat> {
        let q = root.get("quantization_config").or_else(|| {
            root.get("text_config")
                .and_then(|t| t.get("quantization_config"))
        });
        let q = match q {
            None | Some(Value::Null) => return Ok(WeightFormat::Dense),
            Some(q) if q.is_object() => q,
            Some(other) => bail!("quantization_config must be an object, got {other}"),
        };
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        if method != "fp8" {
            bail!(
                "quantization_config.quant_method {method:?} is not supported: Lily loads bf16, f16 \
                 or f32 checkpoints and block FP8 ones (quant_method \"fp8\", as Qwen's -FP8 releases)"
            );
        }
        if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
            if fmt != "e4m3" {
                bail!("quantization_config.fmt {fmt:?} is not supported: Lily's FP8 is e4m3 (float8_e4m3fn)");
            }
        }
        // transformers' FineGrainedFP8Config defaults: dynamic, [128, 128]
        let scheme = q
            .get("activation_scheme")
            .and_then(Value::as_str)
            .unwrap_or("dynamic");
        if scheme != "dynamic" {
            bail!(
                "quantization_config.activation_scheme {scheme:?} is not supported: static \
                 activation scales are not read; Lily loads block FP8 with dynamic activations \
                 (activation_scheme \"dynamic\")"
            );
        }
        let block = match q.get("weight_block_size") {
            None | Some(Value::Null) => FP8_BLOCK,
            Some(Value::Array(a)) if a.len() == 2 && a.iter().all(|x| x.as_u64().is_some()) => [
                a[0].as_u64().unwrap() as usize,
                a[1].as_u64().unwrap() as usize,
            ],
            Some(other) => bail!(
                "quantization_config.weight_block_size must be two integers [rows, cols], got {other}"
            ),
        };
        if block != FP8_BLOCK {
            bail!(
                "quantization_config.weight_block_size {block:?} is not supported: Lily's FP8 \
                 kernels use {FP8_BLOCK:?} blocks (the layout of Qwen's FP8 releases)"
            );
        }
        Ok(WeightFormat::Fp8Block { block })
    }

    pub fn describe(&self) -> String {
        match self {
            WeightFormat::Dense => "dense".to_string(),
            WeightFormat::Fp8Block { block } => {
                format!("fp8 e4m3, {}x{} blocks", block[0], block[1])
            }
        }
    }
}

/// A quantization scheme: how codes and scales make a weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// `w[r][c] = code[r][c] * scale[r / block[0]][c / block[1]]`, e4m3 codes.
    Fp8Block { block: [usize; 2] },
}

/// One quantized matrix [rows, cols]: its codes as mapped from the file and
/// its scales widened to f32 (one per block: a few per million weights).
pub struct Quantized {
    pub scheme: Scheme,
    /// The codes, row-major [rows, cols] (e4m3: one byte each).
    pub codes: Tensor,
    /// The scale tensor as stored (for backends that upload it as is).
    pub scales: Tensor,
    /// `scales` widened, row-major [scale_rows, scale_cols].
    pub scale_f32: Vec<f32>,
    pub scale_cols: usize,
}

impl Quantized {
    /// Elements `start..start + out.len()` (flat index into [rows, cols]),
    /// dequantized exactly: an e4m3 value times a bf16 scale has at most
    /// 12 significant bits, so the f32 product is the weight itself.
    pub fn read_f32(&self, cols: usize, start: usize, out: &mut [f32]) {
        let Scheme::Fp8Block { block: [br, bc] } = self.scheme;
        let codes = self.codes.bytes().expect("FP8 codes are file bytes");
        let table = &*E4M3;
        let mut k = 0;
        while k < out.len() {
            let idx = start + k;
            let (r, c0) = (idx / cols, idx % cols);
            let n = (cols - c0).min(out.len() - k);
            let srow = &self.scale_f32[(r / br) * self.scale_cols..(r / br + 1) * self.scale_cols];
            for (j, o) in out[k..k + n].iter_mut().enumerate() {
                let c = c0 + j;
                *o = table[codes[idx + j] as usize] * srow[c / bc];
            }
            k += n;
        }
    }
}

/// float8_e4m3fn, every byte: sign, 4 exponent bits (bias 7), 3 mantissa bits;
/// no infinities; 0x7f and 0xff are NaN.
pub static E4M3: LazyLock<[f32; 256]> = LazyLock::new(|| {
    let mut t = [0f32; 256];
    for (b, v) in t.iter_mut().enumerate() {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((b >> 3) & 15) as i32;
        let m = (b & 7) as f32;
        *v = if e == 15 && b & 7 == 7 {
            f32::NAN
        } else if e == 0 {
            sign * m / 8.0 * (-6f32).exp2()
        } else {
            sign * (1.0 + m / 8.0) * ((e - 7) as f32).exp2()
        };
    }
    t
});

/// Tensors of a checkpoint by name, with the file each came from.
pub type TensorMap = HashMap<String, (Arc<Tensor>, PathBuf)>;

/// Join every quantized weight of `map` with its scales, in place: the weight
/// becomes one `Storage::Quantized` tensor and its scale entry goes. Every
/// problem is pushed to `errs`, naming the tensor and its file: an FP8 tensor
/// without a quantization_config, a weight without its scale, a scale of the
/// wrong shape or dtype, a scale without its weight, activation scales.
pub fn pair(format: WeightFormat, map: &mut TensorMap, dir: &Path, errs: &mut Vec<String>) {
    let mut names: Vec<String> = map.keys().cloned().collect();
    names.sort();
    for name in &names {
        let (t, file) = &map[name];
        let file = file.display();
        for suffix in [".input_scale", ".activation_scale", ".weight_scale"] {
            if name.ends_with(suffix) {
                errs.push(format!(
                    "tensor {name} in {file}: {} scales are not supported; Lily loads block FP8 \
                     (weight_scale_inv per 128x128 block) with dynamic activation quantization",
                    if suffix == ".weight_scale" {
                        "per-tensor or per-channel weight"
                    } else {
                        "static activation"
                    }
                ));
            }
        }
        if let Some(weight) = name.strip_suffix("_scale_inv") {
            match map.get(weight) {
                None => errs.push(format!(
                    "tensor {name} in {file} scales {weight}, which is in no safetensors file of {}",
                    dir.display()
                )),
                Some((w, _)) if w.dtype != DType::F8E4M3 => errs.push(format!(
                    "tensor {name} in {file} scales {weight}, which is {} rather than F8_E4M3",
                    w.dtype.name()
                )),
                Some(_) => {}
            }
        }
        if t.dtype != DType::F8E4M3 {
            continue;
        }
        let block = match format {
            WeightFormat::Fp8Block { block } => block,
            WeightFormat::Dense => {
                errs.push(format!(
                    "tensor {name} in {file} is F8_E4M3, but config.json declares no \
                     quantization_config (quant_method \"fp8\")"
                ));
                continue;
            }
        };
        if !name.ends_with(".weight") || t.shape.len() != 2 {
            errs.push(format!(
                "tensor {name} in {file} is F8_E4M3 {:?}: block FP8 is read for 2-D <module>.weight \
                 matrices only",
                t.shape
            ));
            continue;
        }
        let sname = format!("{name}_scale_inv");
        let Some((s, sfile)) = map.get(&sname) else {
            errs.push(format!(
                "F8_E4M3 weight {name} in {file} has no {sname} (in no safetensors file of {}): \
                 its block scales are needed to read it",
                dir.display()
            ));
            continue;
        };
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let want = [rows.div_ceil(block[0]), cols.div_ceil(block[1])];
        if s.shape != want {
            errs.push(format!(
                "tensor {sname} in {} has shape {:?}; weight {name} [{rows}, {cols}] in {}x{} blocks \
                 needs [{}, {}]",
                sfile.display(),
                s.shape,
                block[0],
                block[1],
                want[0],
                want[1]
            ));
            continue;
        }
        if !matches!(s.dtype, DType::BF16 | DType::F16 | DType::F32) {
            errs.push(format!(
                "tensor {sname} in {} is {}; FP8 block scales are BF16, F16 or F32",
                sfile.display(),
                s.dtype.name()
            ));
            continue;
        }
        let scale_f32 = s.to_f32_vec();
        if let Some(i) = scale_f32.iter().position(|x| !x.is_finite()) {
            errs.push(format!(
                "tensor {sname} in {} holds a non-finite scale ({}) at block [{}, {}]",
                sfile.display(),
                scale_f32[i],
                i / want[1],
                i % want[1]
            ));
            continue;
        }
        let q = Quantized {
            scheme: Scheme::Fp8Block { block },
            codes: (**t).clone(),
            scales: (**s).clone(),
            scale_f32,
            scale_cols: want[1],
        };
        let joined = Tensor {
            dtype: DType::F8E4M3,
            shape: t.shape.clone(),
            storage: Storage::Quantized(Arc::new(q)),
        };
        let f = map[name].1.clone();
        map.insert(name.clone(), (Arc::new(joined), f));
    }
    // the scales now live inside their weights
    for name in names {
        if name.ends_with("_scale_inv") {
            let joined = name
                .strip_suffix("_scale_inv")
                .and_then(|w| map.get(w))
                .is_some_and(|(w, _)| matches!(w.storage, Storage::Quantized(_)));
            if joined {
                map.remove(&name);
            }
        }
    }
}

/// `x` as float8_e4m3fn, rounded to nearest even and saturated to +-448
/// (PTX `cvt.rn.satfinite.e4m3x2.f32`, torch's cast after a clamp); NaN stays NaN.
pub fn to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    // the binade's exponent, at least the subnormals' -6; `a` in units of the
    // e4m3 spacing there, 2^(e - 3) (a power-of-two scaling: exact)
    let e = ((a.to_bits() >> 23) as i32 - 127).max(-6);
    let n = (a * ((3 - e) as f32).exp2()).round_ties_even() as u8;
    // n < 8: a subnormal code; else exponent e with mantissa n - 8 (n = 16
    // carries into the next binade by the same sum)
    sign | if n < 8 {
        n
    } else {
        (((e + 7) as u8) << 3) + n - 8
    }
}

/// A dense [rows, cols] matrix as block FP8 with the rule of Qwen's releases
/// (and DeepSeek-V3's): per block, s = amax / 448 rounded to bf16 (1 for an
/// all-zero block), codes e4m3(w / s). `row` reads row r widened to f32.
pub fn quantize_fp8_block(rows: usize, cols: usize, row: &dyn Fn(usize, &mut [f32])) -> Tensor {
    let [br, bc] = FP8_BLOCK;
    let (sr, sc) = (rows.div_ceil(br), cols.div_ceil(bc));
    let mut codes = vec![0u8; rows * cols];
    let mut scale_f32 = vec![0f32; sr * sc];
    let mut band = vec![0f32; br * cols];
    for b in 0..sr {
        let r0 = b * br;
        let n = br.min(rows - r0);
        for i in 0..n {
            row(r0 + i, &mut band[i * cols..(i + 1) * cols]);
        }
        for c in 0..sc {
            let (c0, c1) = (c * bc, ((c + 1) * bc).min(cols));
            let amax = (0..n)
                .flat_map(|i| &band[i * cols + c0..i * cols + c1])
                .fold(0f32, |m, x| m.max(x.abs()));
            let s = if amax == 0.0 {
                1.0
            } else {
                crate::tensor::round_bf16(amax / 448.0)
            };
            scale_f32[b * sc + c] = s;
            for i in 0..n {
                for col in c0..c1 {
                    codes[(r0 + i) * cols + col] = to_e4m3(band[i * cols + col] / s);
                }
            }
        }
    }
    let scale_bytes: Vec<u8> = scale_f32
        .iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
        .collect();
    let owned = |dtype: DType, shape: Vec<usize>, bytes: Vec<u8>| Tensor {
        dtype,
        shape,
        storage: Storage::Bytes {
            len: bytes.len(),
            buf: Arc::new(bytes),
            offset: 0,
        },
    };
    let q = Quantized {
        scheme: Scheme::Fp8Block { block: FP8_BLOCK },
        codes: owned(DType::F8E4M3, vec![rows, cols], codes),
        scales: owned(DType::BF16, vec![sr, sc], scale_bytes),
        scale_f32,
        scale_cols: sc,
    };
    Tensor {
        dtype: DType::F8E4M3,
        shape: vec![rows, cols],
        storage: Storage::Quantized(Arc::new(q)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn e4m3_decodes_every_class_of_byte() {
        let t = &*E4M3;
        assert_eq!(t[0x00], 0.0);
        assert_eq!(t[0x80], -0.0);
        assert_eq!(t[0x01], 2f32.powi(-9)); // smallest subnormal
        assert_eq!(t[0x07], 7.0 * 2f32.powi(-9)); // largest subnormal
        assert_eq!(t[0x08], 2f32.powi(-6)); // smallest normal
        assert_eq!(t[0x38], 1.0);
        assert_eq!(t[0x3c], 1.5);
        assert_eq!(t[0xb8], -1.0);
        assert_eq!(t[0x7e], 448.0); // largest finite
        assert_eq!(t[0xfe], -448.0);
        assert!(t[0x7f].is_nan() && t[0xff].is_nan());
        // the finite values agree with half's independent decoder
        for b in 0..=255u8 {
            if b & 0x7f != 0x7f {
                assert_eq!(t[b as usize], f8_via_f16(b), "byte {b:#04x}");
            }
        }
    }

    /// e4m3 re-biased into an f16 bit pattern (exponent bias 7 -> 15, the 3
    /// mantissa bits on top of f16's 10): exact for every finite e4m3 value.
    fn f8_via_f16(b: u8) -> f32 {
        let sign = ((b & 0x80) as u16) << 8;
        let e = ((b >> 3) & 15) as u16;
        let m = (b & 7) as u16;
        if e == 0 {
            let v = m as f32 * 2f32.powi(-9);
            return if sign != 0 { -v } else { v };
        }
        half::f16::from_bits(sign | ((e + 8) << 10) | (m << 7)).to_f32()
    }

    #[test]
    fn config_declares_the_format() {
        let fp8 = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]});
        let top = json!({"quantization_config": fp8.clone(), "text_config": {}});
        let nested = json!({"text_config": {"quantization_config": fp8}});
        for root in [top, nested] {
            assert_eq!(
                WeightFormat::from_config(&root).unwrap(),
                WeightFormat::Fp8Block { block: [128, 128] }
            );
        }
        assert_eq!(
            WeightFormat::from_config(&json!({})).unwrap(),
            WeightFormat::Dense
        );
        let bad = [
            (json!({"quant_method": "gptq"}), "gptq"),
            (json!({"quant_method": "fp8", "fmt": "e5m2"}), "e5m2"),
            (
                json!({"quant_method": "fp8", "activation_scheme": "static"}),
                "static",
            ),
            (
                json!({"quant_method": "fp8", "weight_block_size": [64, 64]}),
                "[64, 64]",
            ),
            (
                json!({"quant_method": "fp8", "weight_block_size": 128}),
                "two integers",
            ),
        ];
        for (q, needle) in bad {
            let e = WeightFormat::from_config(&json!({ "quantization_config": q }))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn e4m3_rounding_is_nearest_even_and_saturates() {
        let t = &*E4M3;
        // every finite code round-trips, both signs
        for b in 0..=255u8 {
            if b & 0x7f != 0x7f {
                assert_eq!(
                    to_e4m3(t[b as usize]),
                    b,
                    "code {b:#04x} = {}",
                    t[b as usize]
                );
            }
        }
        // midpoints between neighbours go to the even code; just off them, to the nearer
        for b in 0..0x7eu8 {
            let (lo, hi) = (t[b as usize], t[b as usize + 1]);
            let mid = (lo + hi) / 2.0; // exact: one more bit than e4m3
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(to_e4m3(mid), even, "midpoint of {b:#04x}");
            assert_eq!(to_e4m3(-mid), even | 0x80);
            assert_eq!(to_e4m3(f32::from_bits(mid.to_bits() - 1)), b);
            assert_eq!(to_e4m3(f32::from_bits(mid.to_bits() + 1)), b + 1);
        }
        assert_eq!(to_e4m3(1000.0), 0x7e);
        assert_eq!(to_e4m3(-460.0), 0xfe);
        assert_eq!(to_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(to_e4m3(1e-30), 0x00);
        assert_eq!(to_e4m3(-0.0), 0x80);
        assert_eq!(to_e4m3(f32::NAN), 0x7f);
    }

    #[test]
    fn quantized_blocks_hold_every_weight_to_half_a_step() {
        // 200 x 300: partial blocks both ways; rows of different magnitudes,
        // one all-zero block (rows 128.., columns 256..)
        let (rows, cols) = (200usize, 300usize);
        let w = |r: usize, c: usize| -> f32 {
            if r >= 128 && c >= 256 {
                return 0.0;
            }
            let x = ((r * 7919 + c * 104_729) % 1000) as f32 / 500.0 - 1.0;
            x * (1 + r % 5) as f32 * 0.01
        };
        let t = quantize_fp8_block(rows, cols, &|r, out| {
            for (c, o) in out.iter_mut().enumerate() {
                *o = w(r, c);
            }
        });
        let q = t.quantized().unwrap();
        assert_eq!(q.scales.shape, vec![2, 3]);
        assert_eq!(q.scale_f32[5], 1.0, "an all-zero block's scale is 1");
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            t.read_f32(r * cols, &mut row);
            for (c, &got) in row.iter().enumerate() {
                let s = q.scale_f32[(r / 128) * 3 + c / 128];
                let x = w(r, c) / s; // within +-448 (the scale is amax/448, rounded)
                                     // e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value
                                     // (2^-10 in the subnormal range), times the scale
                let step = (x.abs().max(2f32.powi(-6))).log2().floor().exp2() / 16.0;
                assert!(
                    (got - w(r, c)).abs() <= step * s * 1.0001,
                    "[{r}, {c}]: {} -> {got}",
                    w(r, c)
                );
            }
        }
    }
}
