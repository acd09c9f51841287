//! Helpers shared by the CLI test files (each says `mod support;`).
#![allow(dead_code)]

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

/// Run `lily` with `args`, which write a logits file to `out`; the file's f32
/// tensor `logits` as (shape, values), or the error output when lily fails.
/// A panic fails the test.
pub fn run_logits(args: &[OsString], out: &Path) -> Result<(Vec<usize>, Vec<f32>), String> {
    let res = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&res.stderr).to_string();
    assert!(!err.contains("panicked"), "lily panicked:\n{err}");
    if !res.status.success() {
        return Err(err);
    }
    let bytes = std::fs::read(out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    Ok((t.shape().to_vec(), f32s(t.data())))
}

/// Little-endian f32 bytes as values.
pub fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
