//! Host tensors: a dtype, a shape and the bytes behind them (a memory-mapped
//! checkpoint, an owned buffer, or a procedural generator for synthetic models).
//! Every consumer reads rows widened to f32; nothing here does arithmetic on bf16.

use std::sync::Arc;

use anyhow::{bail, Result};

use crate::quant::Quantized;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    BF16,
    F16,
    F32,
    /// float8_e4m3fn: the codes of a block-FP8 matrix (`quant`); never an
    /// activation dtype.
    F8E4M3,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F8E4M3 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::F8E4M3 => "F8_E4M3",
        }
    }

    pub fn from_safetensors(d: safetensors::Dtype) -> Result<DType> {
        Ok(match d {
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F8_E4M3 => DType::F8E4M3,
            other => bail!("unsupported dtype {other:?} (expected BF16, F16, F32, or F8_E4M3 with block scales)"),
        })
    }
}

/// Round an f32 to the nearest bf16 (ties to even), returned widened to f32.
/// Used to mirror HF's bf16 activations and to make synthetic weights exactly bf16.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

#[inline]
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Round a whole activation buffer to `dt` in place (no-op for f32).
pub fn round_to(dt: DType, xs: &mut [f32]) {
    match dt {
        // (F8E4M3 is a storage format; `Weights::dtype` is never it)
        DType::F32 | DType::F8E4M3 => {}
        DType::BF16 => xs.iter_mut().for_each(|x| *x = round_bf16(*x)),
        DType::F16 => xs.iter_mut().for_each(|x| *x = round_f16(*x)),
    }
}

/// A seeded procedural weight: element `i` is `mean + std * u(seed, i)` with `u`
/// uniform of unit variance, rounded to bf16. The same function can run in a GPU
/// kernel, so a synthetic model needs no host memory and both backends see the
/// same weights.
#[derive(Clone, Copy, Debug)]
pub struct Procedural {
    pub seed: u64,
    pub mean: f32,
    pub std: f32,
}

impl Procedural {
    #[inline]
    pub fn value(&self, i: u64) -> f32 {
        // splitmix64 finaliser over (seed, index): cheap, stateless, well mixed.
        let mut z = self.seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // top 24 bits -> uniform in [-sqrt3, sqrt3): unit variance
        let u = ((z >> 40) as f32) * (1.0 / 16_777_216.0);
        round_bf16(self.mean + self.std * (u * 2.0 - 1.0) * 1.732_050_8)
    }

    /// The power-of-two scale exponent of row `row` in a row-scaled tensor:
    /// popcount of 16 hashed bits minus 11, a binomial in -11..=5 whose 2^k is
    /// roughly log-normal with a spread of 2 octaves, like a trained
    /// unembedding's row norms (a narrower spread leaves the top logits of
    /// random weights so close that bf16 rounding alone decides the argmax on
    /// a few percent of rows). The offset puts the few high rows, which make
    /// the largest logits, at the scale of a model that samples with some
    /// variety at temperature 1. Powers of two keep the scaled values exact,
    /// so the GPU kernel and the torch rebuild match bit for bit.
    #[inline]
    pub fn row_octave(&self, row: u64) -> i32 {
        let mut z = (self.seed ^ ROW_SALT) ^ row.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z & 0xffff).count_ones() as i32 - 11
    }

    /// Element `i` of a row-scaled tensor with `cols` columns: `value(i) * 2^row_octave(i / cols)`.
    #[inline]
    pub fn value_rows(&self, i: u64, cols: u64) -> f32 {
        self.value(i) * (self.row_octave(i / cols) as f32).exp2()
    }
}

/// Salt of the row-scale hash, so it is independent of the element hash.
pub const ROW_SALT: u64 = 0x5851_F42D_4C95_7F2D;

#[derive(Clone)]
pub enum Storage {
    /// Bytes of a memory-mapped file (or an owned buffer), `offset..offset+len`.
    Bytes {
        buf: Arc<dyn AsRef<[u8]> + Send + Sync>,
        offset: usize,
        len: usize,
    },
    Procedural(Procedural),
    /// Procedural with a per-row power-of-two scale (`Procedural::value_rows`):
    /// the spread of row norms a trained output head has.
    ProceduralRows(Procedural),
    /// Codes and per-block scales (`quant`); the tensor's dtype is the codes'.
    Quantized(Arc<Quantized>),
}

/// A host tensor. Row-major, contiguous.
#[derive(Clone)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub storage: Storage,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {:?})", self.dtype.name(), self.shape)
    }
}

impl Tensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn from_f32(shape: Vec<usize>, data: &[f32]) -> Tensor {
        assert_eq!(shape.iter().product::<usize>(), data.len());
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let len = bytes.len();
        Tensor {
            dtype: DType::F32,
            shape,
            storage: Storage::Bytes {
                buf: Arc::new(bytes),
                offset: 0,
                len,
            },
        }
    }

    pub fn procedural(shape: Vec<usize>, p: Procedural) -> Tensor {
        Tensor {
            dtype: DType::BF16,
            shape,
            storage: Storage::Procedural(p),
        }
    }

    /// A procedural matrix whose rows carry power-of-two scales (`Procedural::value_rows`).
    pub fn procedural_rows(shape: Vec<usize>, p: Procedural) -> Tensor {
        Tensor {
            dtype: DType::BF16,
            shape,
            storage: Storage::ProceduralRows(p),
        }
    }

    /// Raw bytes, for backends that upload weights; procedural tensors have none.
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.storage {
            Storage::Bytes { buf, offset, len } => Some(&(**buf).as_ref()[*offset..*offset + *len]),
            Storage::Procedural(_) | Storage::ProceduralRows(_) | Storage::Quantized(_) => None,
        }
    }

    /// The codes and scales of a quantized tensor.
    pub fn quantized(&self) -> Option<&Quantized> {
        match &self.storage {
            Storage::Quantized(q) => Some(q),
            _ => None,
        }
    }

    /// Elements `start..start+out.len()` (flat index) widened to f32.
    pub fn read_f32(&self, start: usize, out: &mut [f32]) {
        match &self.storage {
            Storage::Procedural(p) => {
                for (k, o) in out.iter_mut().enumerate() {
                    *o = p.value((start + k) as u64);
                }
            }
            Storage::ProceduralRows(p) => {
                let cols = *self.shape.last().unwrap_or(&1) as u64;
                for (k, o) in out.iter_mut().enumerate() {
                    *o = p.value_rows((start + k) as u64, cols);
                }
            }
            Storage::Quantized(q) => {
                let cols = *self.shape.last().unwrap_or(&1);
                q.read_f32(cols, start, out)
            }
            Storage::Bytes { .. } => {
                let b = self.bytes().unwrap();
                let sz = self.dtype.size();
                let src = &b[start * sz..(start + out.len()) * sz];
                widen(self.dtype, src, out);
            }
        }
    }

    /// The whole tensor as f32 (small tensors only: norms, biases, gates).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.numel()];
        self.read_f32(0, &mut v);
        v
    }

    /// Turn a procedural tensor into owned bf16 bytes (worth it when it is read
    /// many times and fits in memory, as for the tiny synthetic model).
    pub fn materialize(&self) -> Tensor {
        match &self.storage {
            Storage::Bytes { .. } | Storage::Quantized(_) => self.clone(),
            Storage::Procedural(_) | Storage::ProceduralRows(_) => {
                use rayon::prelude::*;
                let n = self.numel();
                let mut bytes = vec![0u8; n * 2];
                bytes
                    .par_chunks_mut(2 * 4096)
                    .enumerate()
                    .for_each(|(c, chunk)| {
                        let mut vals = vec![0f32; chunk.len() / 2];
                        self.read_f32(c * 4096, &mut vals);
                        for (pair, &x) in chunk.chunks_exact_mut(2).zip(&vals) {
                            let v = half::bf16::from_f32(x);
                            pair.copy_from_slice(&v.to_bits().to_le_bytes());
                        }
                    });
                Tensor {
                    dtype: DType::BF16,
                    shape: self.shape.clone(),
                    storage: Storage::Bytes {
                        buf: Arc::new(bytes),
                        offset: 0,
                        len: n * 2,
                    },
                }
            }
        }
    }
}

/// Widen little-endian `src` of dtype `dt` into `out` (same element count).
#[inline]
pub fn widen(dt: DType, src: &[u8], out: &mut [f32]) {
    match dt {
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F8E4M3 => {
            let t = &*crate::quant::E4M3;
            for (o, &b) in out.iter_mut().zip(src) {
                *o = t[b as usize];
            }
        }
    }
}

/// A 2-D row window of a tensor: `rows x cols` starting at row `row0` of the
/// tensor viewed as [numel / cols, cols]. Lets per-expert and fused expert
/// layouts (and the interleaved gate_up) look the same to the compute code.
#[derive(Clone, Debug)]
pub struct Mat {
    pub t: Arc<Tensor>,
    pub row0: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Mat {
    pub fn whole(t: Arc<Tensor>) -> Mat {
        let cols = *t.shape.last().unwrap();
        let rows = t.numel() / cols;
        Mat {
            t,
            row0: 0,
            rows,
            cols,
        }
    }

    pub fn rows(&self, r0: usize, n: usize) -> Mat {
        assert!(r0 + n <= self.rows);
        Mat {
            t: self.t.clone(),
            row0: self.row0 + r0,
            rows: n,
            cols: self.cols,
        }
    }

    #[inline]
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        debug_assert!(r < self.rows && out.len() == self.cols);
        self.t.read_f32((self.row0 + r) * self.cols, out);
    }
}
