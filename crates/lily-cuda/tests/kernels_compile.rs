//! Every kernel compiles with NVRTC for sm_90a: the compiler the GPU uses at
//! start-up. Runs wherever libnvrtc can be loaded (CI installs NVIDIA's
//! nvidia-cuda-nvrtc wheel for it); elsewhere it says so and skips.

#[test]
fn all_kernels_compile_with_nvrtc() {
    // SAFETY: probes whether libnvrtc can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("skipping: libnvrtc not found (set LD_LIBRARY_PATH to a CUDA 13 NVRTC)");
        return;
    }
    let compiled = lily_cuda::gpu::compile_kernels().unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(compiled.len(), lily_cuda::gpu::KERNEL_FILES.len());
    let names: usize = compiled.iter().map(|c| c.kernels.len()).sum();
    eprintln!(
        "compiled {} kernel files ({names} kernels) with NVRTC",
        compiled.len()
    );
}
