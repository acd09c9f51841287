//! Lily's CUDA kernels: one `.cu` file per kernel family, and beside it a
//! Rust module whose typed functions are the only way to launch its kernels
//! (each takes named arguments, checks the shapes its kernel supports and
//! owns its grid), so the model and the tests call the same launchers.
//!
//! This module holds the kernel table, the one list of every kernel with its
//! file, whether it takes part in programmatic dependent launch, its trace id
//! and its profile group, and the NVRTC build of the sources. `common.cuh` is
//! spliced into each file where it is included (NVRTC gets no include paths).

use anyhow::{anyhow, bail, Result};

pub mod attention;
pub mod embed;
pub mod gdn;
pub mod gdn_chunked;
pub mod gemv;
pub mod lm_head;
pub mod moe;
pub mod moe_grouped;
pub mod norm;
pub mod sampling;

/// Kernel sources, one file per kernel family.
pub const FILES: &[(&str, &str)] = &[
    ("embed", include_str!("embed.cu")),
    ("norm", include_str!("norm.cu")),
    ("gemv", include_str!("gemv.cu")),
    ("lm_head", include_str!("lm_head.cu")),
    ("attention", include_str!("attention.cu")),
    ("gdn", include_str!("gdn.cu")),
    ("gdn_chunked", include_str!("gdn_chunked.cu")),
    ("moe", include_str!("moe.cu")),
    ("moe_grouped", include_str!("moe_grouped.cu")),
    ("sampling", include_str!("sampling.cu")),
];
const COMMON: &str = include_str!("common.cuh");

/// One row of the kernel table.
#[derive(Clone, Copy, Debug)]
pub struct KernelInfo {
    pub kernel: Kernel,
    /// the `extern "C"` name in its file
    pub name: &'static str,
    /// its file in [`FILES`]
    pub file: &'static str,
    /// Launched with programmatic stream serialization (PDL): its body calls
    /// `pdl_wait()` before it reads what an earlier kernel wrote (the decode
    /// step's chain). A kernel launched that way without waiting would race
    /// the kernel before it; the kernels_compile test checks each one's PTX.
    pub pdl: bool,
    /// Its id in the decode-step timeline (crate::trace; 0: not traced). The
    /// build defines `LILY_TK_<name>` to it, which the kernel's `TRACE(name)` reads.
    pub trace: u32,
    /// The kernel's role in a step, which `--trace` summaries group by (the
    /// decode roofline's rows split the projections further, by mixer).
    pub group: &'static str,
}

macro_rules! kernel_table {
    ($($k:ident: $name:literal in $file:literal, pdl $pdl:literal, trace $trace:literal, $group:literal;)+) => {
        /// Every kernel Lily launches, in table order.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel { $($k),+ }

        /// The kernel table, indexed by [`Kernel`].
        pub const KERNELS: &[KernelInfo] = &[
            $(KernelInfo { kernel: Kernel::$k, name: $name, file: $file, pdl: $pdl, trace: $trace, group: $group }),+
        ];
    };
}

kernel_table! {
    Embed: "embed_kernel" in "embed", pdl true, trace 1, "embed";
    ProceduralFill: "procedural_fill_kernel" in "embed", pdl false, trace 0, "weights";
    ProceduralRowsFill: "procedural_rows_fill_kernel" in "embed", pdl false, trace 0, "weights";
    AddRmsnorm: "add_rmsnorm_kernel" in "norm", pdl true, trace 0, "norms";
    GatedRmsnorm: "gated_rmsnorm_kernel" in "norm", pdl false, trace 0, "gdn core";
    Gemv: "gemv_kernel" in "gemv", pdl true, trace 11, "lm_head";
    Gemv3: "gemv3_kernel" in "gemv", pdl true, trace 2, "in proj";
    GemvAdd: "gemv_add_kernel" in "gemv", pdl true, trace 4, "out proj";
    HeadQuantize: "head_quantize_kernel" in "lm_head", pdl false, trace 0, "weights";
    HeadScreen: "head_screen_kernel" in "lm_head", pdl true, trace 14, "lm_head screen";
    HeadPick: "head_pick_kernel" in "lm_head", pdl true, trace 15, "lm_head screen";
    QkPrep: "qk_prep_kernel" in "attention", pdl true, trace 8, "attn qk prep";
    AttentionPrefill: "attention_prefill_kernel" in "attention", pdl false, trace 0, "attn core";
    AttentionDecodePartial: "attention_decode_partial_kernel" in "attention", pdl true, trace 9, "attn core";
    AttentionDecodeMerge: "attention_decode_merge_kernel" in "attention", pdl true, trace 10, "attn core";
    ConvSilu: "conv_silu_kernel" in "gdn", pdl true, trace 0, "gdn conv";
    GdnDecode: "gdn_decode_kernel" in "gdn", pdl true, trace 3, "gdn core";
    GdnChunkPrep: "gdn_chunk_prep_kernel" in "gdn_chunked", pdl false, trace 0, "gdn core";
    GdnChunkScan: "gdn_chunk_scan_kernel" in "gdn_chunked", pdl false, trace 0, "gdn core";
    RouterTopk: "router_topk_kernel" in "moe", pdl false, trace 0, "moe router";
    RouterDecode: "router_decode_kernel" in "moe", pdl true, trace 5, "moe router";
    MoeGateUp: "moe_gate_up_kernel" in "moe", pdl true, trace 6, "moe gate/up";
    MoeDownNorm: "moe_down_norm_kernel" in "moe", pdl true, trace 7, "moe down";
    MoeCount: "moe_count_kernel" in "moe", pdl false, trace 0, "moe experts";
    MoeAssign: "moe_assign_kernel" in "moe", pdl false, trace 0, "moe experts";
    MoeTiles: "moe_tiles_kernel" in "moe_grouped", pdl false, trace 0, "moe experts";
    MoeGateUpGrouped: "moe_gate_up_grouped_kernel" in "moe_grouped", pdl false, trace 0, "moe experts";
    MoeDownGrouped: "moe_down_grouped_kernel" in "moe_grouped", pdl false, trace 0, "moe experts";
    MoeCombine: "moe_combine_kernel" in "moe", pdl false, trace 0, "moe experts";
    Argmax: "argmax_kernel" in "sampling", pdl false, trace 0, "sampling";
    Sample: "sample_kernel" in "sampling", pdl false, trace 0, "sampling";
    PenaltyFeed: "penalty_feed_kernel" in "sampling", pdl false, trace 0, "sampling";
    LogitBias: "logit_bias_kernel" in "sampling", pdl false, trace 0, "sampling";
    Penalize: "penalize_kernel" in "sampling", pdl false, trace 0, "sampling";
    LogprobsPartial: "logprobs_partial_kernel" in "sampling", pdl false, trace 0, "sampling";
    LogprobsFinish: "logprobs_finish_kernel" in "sampling", pdl false, trace 0, "sampling";
    ArgmaxBlocks: "argmax_blocks_kernel" in "sampling", pdl true, trace 12, "lm_head";
    ArgmaxFinish: "argmax_finish_kernel" in "sampling", pdl true, trace 13, "lm_head";
}

impl Kernel {
    pub fn info(self) -> &'static KernelInfo {
        &KERNELS[self as usize]
    }

    /// The traced kernel with timeline id `id`, if any.
    pub fn traced(id: u32) -> Option<Kernel> {
        KERNELS
            .iter()
            .find(|k| k.trace != 0 && k.trace == id)
            .map(|k| k.kernel)
    }
}

/// How the kernels are built: the product build, or one of the diagnostic
/// builds `lily bench` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Build {
    /// The decode-step timeline records (`lily bench --trace`): every traced
    /// kernel's blocks record when they start, pass their PDL wait and exit
    /// (crate::trace). Costs a few registers and stores: never timed.
    pub trace: bool,
    /// With `trace`, the phase mark kept (`TRACE_MARK(n)` in a kernel; 0 none).
    pub trace_mark: u32,
}

impl Build {
    /// The NVRTC defines of this build: the trace ids of the kernel table,
    /// and the trace switches.
    pub fn defines(&self) -> Vec<String> {
        let mut d: Vec<String> = KERNELS
            .iter()
            .filter(|k| k.trace != 0)
            .map(|k| format!("LILY_TK_{}={}", k.name, k.trace))
            .collect();
        if self.trace {
            d.push("LILY_TRACE=1".into());
            d.push(format!("LILY_TRACE_MARK={}", self.trace_mark));
        }
        d
    }
}

/// One kernel file compiled by NVRTC.
pub struct CompiledFile {
    pub file: &'static str,
    pub ptx: cudarc::nvrtc::Ptx,
}

/// A source file with common.cuh spliced in.
pub fn source(file: &str) -> Result<String> {
    let src = FILES
        .iter()
        .find(|(f, _)| *f == file)
        .ok_or_else(|| anyhow!("no kernel file {file}"))?
        .1;
    Ok(src.replace("#include \"common.cuh\"", COMMON))
}

/// Compile every kernel file with NVRTC for sm_90a. Needs only libnvrtc, so CI
/// (no GPU, NVRTC from NVIDIA's PyPI wheel) compiles exactly what the GPU will.
pub fn compile(build: &Build) -> Result<Vec<CompiledFile>> {
    // SAFETY: probes whether libnvrtc can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!("NVRTC (libnvrtc.so) was not found");
    }
    let defines = build.defines();
    let mut out = Vec::new();
    for (file, _) in FILES {
        let mut options = vec!["-default-device".into(), "--std=c++17".into()];
        options.extend(defines.iter().map(|d| format!("-D{d}")));
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some("sm_90a"),
            options,
            name: Some(format!("{file}.cu")),
            ..Default::default()
        };
        let ptx =
            cudarc::nvrtc::compile_ptx_with_opts(source(file)?, opts).map_err(|e| match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    anyhow!(
                        "NVRTC could not compile kernels/{file}.cu:\n{}",
                        log.to_string_lossy()
                    )
                }
                other => anyhow!("NVRTC could not compile kernels/{file}.cu: {other:?}"),
            })?;
        out.push(CompiledFile { file, ptx });
    }
    Ok(out)
}

/// Checks of the table against itself (the kernels_compile test checks it
/// against the compiled PTX).
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_indexed_by_kernel() {
        for (i, k) in KERNELS.iter().enumerate() {
            assert_eq!(k.kernel as usize, i, "{}", k.name);
            assert!(
                FILES.iter().any(|(f, _)| *f == k.file),
                "{}: no file {}",
                k.name,
                k.file
            );
        }
    }

    #[test]
    fn names_and_trace_ids_are_unique() {
        for (i, a) in KERNELS.iter().enumerate() {
            for b in &KERNELS[i + 1..] {
                assert_ne!(a.name, b.name);
                assert!(
                    a.trace == 0 || a.trace != b.trace,
                    "{} and {}",
                    a.name,
                    b.name
                );
            }
        }
        assert_eq!(Kernel::traced(3), Some(Kernel::GdnDecode));
        assert_eq!(Kernel::traced(0), None);
    }

    #[test]
    fn every_kernel_is_declared_in_its_file() {
        for k in KERNELS {
            let src = source(k.file).unwrap();
            let declared = src.match_indices(&format!(" {}(", k.name)).any(|(at, _)| {
                let before = &src[..at];
                let decl = before.rfind("extern \"C\" __global__").unwrap_or(0);
                decl > 0 && !before[decl..].contains(['{', ';'])
            });
            assert!(declared, "{} is not a kernel of {}.cu", k.name, k.file);
        }
    }
}
