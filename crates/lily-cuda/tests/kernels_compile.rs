//! Every kernel compiles with NVRTC for sm_90a (the compiler the GPU uses at
//! start-up), and the compiled code agrees with the kernel table
//! (`lily_cuda::kernels::KERNELS`): each file's kernels are exactly the
//! table's, a kernel waits on its predecessor (`griddepcontrol.wait`) exactly
//! when the table launches it with PDL, and in the trace build a kernel
//! records its timeline exactly when the table gives it a trace id.
//!
//! Needs only libnvrtc, no GPU: ignored where the build found no NVRTC
//! (build.rs); CI installs NVIDIA's nvidia-cuda-nvrtc wheel and runs it with
//! `--include-ignored`, so there a missing NVRTC is a failure.

use std::collections::BTreeSet;

use lily_cuda::kernels::{compile, Build, KERNELS};

/// The PTX of each `.entry` (a kernel) in a module: name -> its text up to
/// the next entry (device functions are inlined: a kernel's instructions are
/// its entry's).
fn entries(ptx: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let starts: Vec<usize> = ptx.match_indices(".entry ").map(|(i, _)| i).collect();
    for (n, &at) in starts.iter().enumerate() {
        let end = starts.get(n + 1).copied().unwrap_or(ptx.len());
        let text = &ptx[at..end];
        let name = text[".entry ".len()..]
            .split(|c: char| c == '(' || c.is_whitespace())
            .next()
            .unwrap()
            .to_string();
        out.push((name, text.to_string()));
    }
    out
}

fn compiled(build: &Build) -> Vec<(&'static str, Vec<(String, String)>)> {
    compile(build)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .into_iter()
        .map(|c| (c.file, entries(&c.ptx.to_src())))
        .collect()
}

#[test]
#[cfg_attr(
    not(lily_nvrtc),
    ignore = "needs NVRTC (libnvrtc.so): none was found at build time"
)]
fn every_kernel_compiles_and_matches_the_table() {
    let files = compiled(&Build::default());
    let mut all = 0;
    for (file, kernels) in &files {
        let got: BTreeSet<&str> = kernels.iter().map(|(n, _)| n.as_str()).collect();
        let want: BTreeSet<&str> = KERNELS
            .iter()
            .filter(|k| k.file == *file)
            .map(|k| k.name)
            .collect();
        assert_eq!(
            got, want,
            "kernels/{file}.cu: the compiled kernels against the table's"
        );
        for (name, text) in kernels {
            let k = KERNELS.iter().find(|k| k.name == name).unwrap();
            assert_eq!(
                text.contains("griddepcontrol.wait"),
                k.pdl,
                "{name}: the table says pdl = {}, its code {} pdl_wait()",
                k.pdl,
                if k.pdl { "never calls" } else { "calls" }
            );
            // no timeline diagnostics outside the trace build
            assert!(
                !text.contains("%globaltimer"),
                "{name} reads the timer in the product build"
            );
        }
        all += kernels.len();
    }
    assert_eq!(all, KERNELS.len());
    eprintln!(
        "compiled {} kernel files ({all} kernels) with NVRTC",
        files.len()
    );
}

#[test]
#[cfg_attr(
    not(lily_nvrtc),
    ignore = "needs NVRTC (libnvrtc.so): none was found at build time"
)]
fn the_trace_build_records_exactly_the_traced_kernels() {
    for mark in [0, 1] {
        let build = Build {
            trace: true,
            trace_mark: mark,
        };
        for (_, kernels) in compiled(&build) {
            for (name, text) in kernels {
                let k = KERNELS.iter().find(|k| k.name == name).unwrap();
                // a traced kernel writes its record to the ring
                assert_eq!(
                    text.contains("lily_trace_ring"),
                    k.trace != 0,
                    "{name}: trace id {} in the table",
                    k.trace
                );
            }
        }
    }
}
