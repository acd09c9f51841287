//! The device: driver context and stream, NVRTC-compiled kernel modules,
//! cuBLAS, and raw device buffers. The driver, NVRTC and cuBLAS are loaded at
//! run time, so this builds and runs on machines with no CUDA at all; there
//! `Gpu::new` returns an error instead of panicking.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaStream};

/// Kernel sources, one file per kernel family; `common.cuh` is spliced in
/// where a file includes it (NVRTC gets no include paths).
pub const KERNEL_FILES: &[(&str, &str)] = &[
    ("embed", include_str!("../kernels/embed.cu")),
    ("norm", include_str!("../kernels/norm.cu")),
    ("gemv", include_str!("../kernels/gemv.cu")),
    ("lm_head", include_str!("../kernels/lm_head.cu")),
    ("attention", include_str!("../kernels/attention.cu")),
    ("gdn", include_str!("../kernels/gdn.cu")),
    ("gdn_chunked", include_str!("../kernels/gdn_chunked.cu")),
    ("moe", include_str!("../kernels/moe.cu")),
    ("sampling", include_str!("../kernels/sampling.cu")),
];
const COMMON: &str = include_str!("../kernels/common.cuh");

/// Is a usable CUDA driver present? (cudarc panics on a missing library, so
/// every entry point asks first.)
pub fn cuda_available() -> Result<()> {
    // SAFETY: only probes whether the shared libraries can be opened.
    unsafe {
        if !drv_sys::is_culib_present() {
            bail!("CUDA is not available: the NVIDIA driver library (libcuda.so) was not found");
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            bail!("CUDA is not available: NVRTC (libnvrtc.so) was not found; install the CUDA runtime libraries");
        }
        if !cublas_sys::is_culib_present() {
            bail!("CUDA is not available: cuBLAS (libcublas.so) was not found");
        }
    }
    Ok(())
}

/// A raw device allocation. Freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
}

impl DevBuf {
    pub fn at(&self, byte_offset: usize) -> u64 {
        debug_assert!(byte_offset <= self.bytes);
        self.ptr + byte_offset as u64
    }
}

/// Page-locked host memory mapped into the device's address space: a kernel
/// stores into it directly (a decode step's chosen id), so the host reads the
/// value once that kernel is done, without a copy queued behind later work.
pub struct HostMapped {
    host: *mut i32,
    /// the device's address of the same memory
    pub dev: u64,
    len: usize,
}

// SAFETY: plain host memory; reads are volatile and ordered by event waits.
unsafe impl Send for HostMapped {}
unsafe impl Sync for HostMapped {}

impl HostMapped {
    /// Element `i`, as the device last wrote it (read after an event that
    /// follows the writing kernel).
    pub fn get(&self, i: usize) -> i32 {
        assert!(i < self.len);
        // SAFETY: i < len; the memory lives until drop.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in Gpu::alloc_mapped.
        unsafe {
            let _ = drv::free_host(self.host as _);
        }
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by cuMemAlloc in Gpu::alloc and not freed elsewhere.
            unsafe {
                let _ = drv::free_sync(self.ptr);
            }
        }
    }
}

/// One argument of a kernel launch, kept alive until the launch call returns.
pub enum Arg {
    Ptr(u64),
    I32(i32),
    U64(u64),
    F32(f32),
}

pub struct Gpu {
    /// a LILY_TRACE build's ticket counter and record ring (crate::trace);
    /// first, so that it is freed while the context is alive
    pub(crate) trace: Option<crate::trace::TraceBufs>,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: cublas_sys::cublasHandle_t,
    /// each kernel, and whether it is launched with programmatic stream
    /// serialization (its body waits on `pdl_wait()`; never when PDL is off)
    funcs: HashMap<String, (CudaFunction, bool)>,
    /// set by the ablation profile: launches are dropped while it holds
    skip: std::sync::atomic::AtomicBool,
    pub name: String,
}

// SAFETY: the cuBLAS handle is only used from the thread that owns the Gpu
// (the engine worker); the context is bound to that thread before use.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    pub fn new(ordinal: usize) -> Result<Gpu> {
        cuda_available()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| anyhow!("CUDA device {ordinal}: {e:?}"))?;
        let (major, minor) = (
            ctx.attribute(
                drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )?,
            ctx.attribute(
                drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )?,
        );
        if major < 9 {
            bail!("Lily's CUDA kernels target Hopper (compute capability 9.0); this GPU is {major}.{minor}");
        }
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow!("creating a stream: {e:?}"))?;
        let blas = cudarc::cublas::result::create_handle().map_err(|e| anyhow!("cuBLAS: {e:?}"))?;
        // SAFETY: handle and stream are valid; the stream outlives the handle's use.
        unsafe { cudarc::cublas::result::set_stream(blas, stream.cu_stream() as _) }
            .map_err(|e| anyhow!("cuBLAS: {e:?}"))?;
        let mut funcs = HashMap::new();
        let mut modules = Vec::new();
        let traced = kernel_defines()?
            .iter()
            .any(|d| d.starts_with("LILY_TRACE=") && d != "LILY_TRACE=0");
        // LILY_PDL=0 launches every kernel plainly (to measure what PDL saves)
        let pdl_on = std::env::var("LILY_PDL").map(|v| v != "0").unwrap_or(true);
        for CompiledFile { file, ptx, kernels } in compile_kernels()? {
            let module = ctx
                .load_module(ptx)
                .map_err(|e| anyhow!("loading kernels/{file}.cu: {e:?}"))?;
            for (name, waits) in kernels {
                let f = module
                    .load_function(&name)
                    .map_err(|e| anyhow!("kernel {name}: {e:?}"))?;
                funcs.insert(name, (f, waits && pdl_on));
            }
            modules.push(module);
        }
        let mut gpu = Gpu {
            ctx,
            stream,
            blas,
            funcs,
            skip: Default::default(),
            name,
            trace: None,
        };
        if traced {
            gpu.trace = Some(crate::trace::TraceBufs::new(&gpu, &modules)?);
        }
        Ok(gpu)
    }

    pub fn free_memory(&self) -> Result<(usize, usize)> {
        self.ctx.bind_to_thread()?;
        Ok(drv::mem_get_info()?)
    }

    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        self.ctx.bind_to_thread()?;
        if bytes == 0 {
            return Ok(DevBuf { ptr: 0, bytes: 0 });
        }
        // SAFETY: plain device allocation, freed by DevBuf::drop.
        let ptr = unsafe { drv::malloc_sync(bytes) }
            .map_err(|e| anyhow!("cuMemAlloc of {bytes} bytes: {e:?}"))?;
        Ok(DevBuf { ptr, bytes })
    }

    /// `len` i32 of page-locked host memory the device can write (zeroed).
    pub fn alloc_mapped(&self, len: usize) -> Result<HostMapped> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        // SAFETY: a fresh page-locked allocation, freed by HostMapped::drop;
        // zeroed before use; its device address comes from the driver.
        unsafe {
            let host = drv::malloc_host(len.max(1) * 4, sys::CU_MEMHOSTALLOC_DEVICEMAP)
                .map_err(|e| anyhow!("cuMemHostAlloc of {len} i32: {e:?}"))?
                as *mut i32;
            std::ptr::write_bytes(host, 0, len.max(1));
            let mut dev: sys::CUdeviceptr = 0;
            let r = sys::cuMemHostGetDevicePointer_v2(&mut dev, host as _, 0);
            if r != sys::CUresult::CUDA_SUCCESS {
                let _ = drv::free_host(host as _);
                bail!("cuMemHostGetDevicePointer: {r:?}");
            }
            Ok(HostMapped { host, dev, len })
        }
    }

    /// An event (no timing) to record on the stream and wait for.
    pub fn event(&self) -> Result<cudarc::driver::CudaEvent> {
        use cudarc::driver::sys::CUevent_flags;
        self.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| anyhow!("creating an event: {e:?}"))
    }

    pub fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: dst points to at least size_of_val(src) bytes (checked by callers).
        unsafe { drv::memcpy_htod_async(dst, src, self.stream.cu_stream()) }?;
        Ok(())
    }

    pub fn upload_new<T: Copy>(&self, src: &[T]) -> Result<DevBuf> {
        let b = self.alloc(std::mem::size_of_val(src))?;
        self.upload(b.ptr, src)?;
        Ok(b)
    }

    pub fn download<T: Copy + Default>(&self, src: u64, n: usize) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        self.ctx.bind_to_thread()?;
        // SAFETY: src holds n elements of T; the stream is synchronised before reading.
        unsafe { drv::memcpy_dtoh_async(&mut v[..], src, self.stream.cu_stream()) }?;
        self.sync()?;
        Ok(v)
    }

    pub fn zero(&self, dst: u64, bytes: usize) -> Result<()> {
        // SAFETY: dst holds `bytes` bytes.
        unsafe { drv::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }?;
        Ok(())
    }

    /// Device-to-device copy bandwidth in bytes/s (bytes read + written),
    /// the ceiling a bandwidth-bound kernel can reach on this GPU.
    pub fn copy_bandwidth(&self) -> Result<f64> {
        let n = 1usize << 30;
        let (a, b) = (self.alloc(n)?, self.alloc(n)?);
        self.zero(a.ptr, n)?;
        let copy = || unsafe { drv::memcpy_dtod_async(b.ptr, a.ptr, n, self.stream.cu_stream()) };
        copy()?;
        self.sync()?;
        let reps = 10;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            copy()?;
        }
        self.sync()?;
        Ok((2 * n * reps) as f64 / t.elapsed().as_secs_f64())
    }

    /// Drop kernel launches until cleared (the ablation profile's captures).
    pub fn set_skip(&self, on: bool) {
        self.skip.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether launches are being dropped now (`set_skip`).
    pub fn skipping(&self) -> bool {
        self.skip.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("CUDA error: {e:?}"))
    }

    /// Launch `name` on the stream. Arguments in the kernel's order.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let (f, pdl) = self
            .funcs
            .get(name)
            .with_context(|| format!("no kernel named {name}"))?;
        if self.skip.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let mut vals: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut b = [0u8; 8];
                match a {
                    Arg::Ptr(p) | Arg::U64(p) => b.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I32(i) => b[..4].copy_from_slice(&i.to_ne_bytes()),
                    Arg::F32(x) => b[..4].copy_from_slice(&x.to_ne_bytes()),
                }
                b
            })
            .collect();
        let mut params: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v.as_mut_ptr() as *mut c_void)
            .collect();
        self.ctx.bind_to_thread()?;
        if *pdl {
            return self.launch_pdl(name, f, grid, block, smem, &mut params);
        }
        // SAFETY: params point at values that live until this call returns; the
        // kernel's signature matches `args` (each launcher in ops.rs owns that).
        unsafe {
            drv::launch_kernel(
                f.cu_function(),
                grid,
                block,
                smem,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| anyhow!("launching {name}: {e:?}"))?;
        Ok(())
    }

    /// A launch that may start before the kernel ahead of it in the stream
    /// has finished (programmatic dependent launch): the kernel's own
    /// `pdl_wait()` orders it after its inputs are written.
    fn launch_pdl(
        &self,
        name: &str,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        use drv_sys::{
            CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue, CUlaunchConfig,
        };
        // SAFETY: a zeroed union is a valid "no value"; the field set is the one
        // the attribute id names.
        let mut value: CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let cfg = CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as in `launch`; cfg and attr live until the call returns.
        let r = unsafe {
            drv_sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if r != drv_sys::CUresult::CUDA_SUCCESS {
            bail!("launching {name} (programmatic dependent launch): {r:?}");
        }
        Ok(())
    }

    /// C[m, n] (f32, row-major) = A[m, k] (bf16, row-major) . B[n, k]^T (bf16, row-major):
    /// a linear layer over m tokens. cuBLAS is column-major, so this computes
    /// C^T = B . A^T with B transposed.
    pub fn gemm_bf16_f32(
        &self,
        a: u64,
        b: u64,
        c: u64,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.ctx.bind_to_thread()?;
        // SAFETY: pointers hold the stated shapes; cuBLAS runs on self.stream.
        let st = unsafe {
            cublas_sys::cublasGemmEx(
                self.blas,
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                b as *const c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                a as *const c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                cublas_sys::cudaDataType::CUDA_R_32F,
                n as i32,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if st != cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            bail!("cublasGemmEx({m}x{n}x{k}): {st:?}");
        }
        Ok(())
    }
}

/// One kernel file compiled by NVRTC.
pub struct CompiledFile {
    pub file: &'static str,
    pub ptx: cudarc::nvrtc::Ptx,
    /// its kernels, each with whether it takes part in programmatic dependent
    /// launch (`pdl_kernels`)
    pub kernels: Vec<(String, bool)>,
}

/// Compile every kernel file with NVRTC for sm_90a. Needs only libnvrtc, so CI
/// (no GPU, NVRTC from NVIDIA's PyPI wheel) compiles exactly what the GPU will.
pub fn compile_kernels() -> Result<Vec<CompiledFile>> {
    // SAFETY: probes whether libnvrtc can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!("NVRTC (libnvrtc.so) was not found");
    }
    let defines = kernel_defines()?;
    let mut out = Vec::new();
    for (file, src) in KERNEL_FILES {
        let source = src.replace("#include \"common.cuh\"", COMMON);
        let mut options = vec!["-default-device".into(), "--std=c++17".into()];
        options.extend(defines.iter().map(|d| format!("-D{d}")));
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some("sm_90a"),
            options,
            name: Some(format!("{file}.cu")),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(&source, opts).map_err(|e| match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                anyhow!(
                    "NVRTC could not compile kernels/{file}.cu:\n{}",
                    log.to_string_lossy()
                )
            }
            other => anyhow!("NVRTC could not compile kernels/{file}.cu: {other:?}"),
        })?;
        let waits = pdl_kernels(&source);
        let kernels = kernel_names(&source)
            .into_iter()
            .map(|n| {
                let w = waits.contains(&n);
                (n, w)
            })
            .collect();
        out.push(CompiledFile { file, ptx, kernels });
    }
    Ok(out)
}

/// `LILY_KERNEL_DEFINES`: NAME=VALUE macros for every kernel file, separated
/// by spaces or commas (the kernels' compile-time alternatives, e.g.
/// `LILY_WEIGHT_LOAD=1`, so that one build can measure them in turn; commas
/// let `tools/gpu_run.sh envs` give several in one setting).
fn kernel_defines() -> Result<Vec<String>> {
    let Ok(v) = std::env::var("LILY_KERNEL_DEFINES") else {
        return Ok(Vec::new());
    };
    v.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|d| !d.is_empty())
        .map(|d| {
            let ok = d.split_once('=').is_some_and(|(n, val)| {
                !n.is_empty()
                    && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && val.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            });
            if !ok {
                bail!("LILY_KERNEL_DEFINES: {d:?} is not NAME=VALUE (letters, digits, _)");
            }
            Ok(d.to_string())
        })
        .collect()
}

/// The kernels of a source file (common.cuh spliced in) that take part in
/// programmatic dependent launch: those whose body calls `pdl_wait()` or a
/// helper that does (`decode_dot`, `prefetched_dot`, `gate_up_dots`). A
/// kernel launched that way without waiting would race the kernel before it,
/// so only the body itself (braces matched) counts, not its neighbours.
pub fn pdl_kernels(src: &str) -> Vec<String> {
    const WAITS: [&str; 5] = [
        "pdl_wait(",
        "decode_dot(",
        "decode_dot_k<",
        "prefetched_dot<",
        "gate_up_dots<",
    ];
    let mut out = Vec::new();
    for (name, at) in kernel_names(src).into_iter().zip(kernel_starts(src)) {
        let body = kernel_body(&src[at..]);
        if WAITS.iter().any(|w| body.contains(w)) {
            out.push(name);
        }
    }
    out
}

/// Byte offsets of each `extern "C" __global__` kernel declaration.
fn kernel_starts(src: &str) -> Vec<usize> {
    src.match_indices("extern \"C\" __global__ void ")
        .map(|(i, _)| i)
        .collect()
}

/// The text of the first brace-matched `{ ... }` in `src` (a kernel body;
/// // comments are skipped so a brace in one does not count).
fn kernel_body(src: &str) -> &str {
    let Some(open) = src.find('{') else { return "" };
    let mut depth = 0usize;
    let mut in_comment = false;
    let b = src.as_bytes();
    let mut i = open;
    while i < b.len() {
        match b[i] {
            b'\n' => in_comment = false,
            b'/' if !in_comment && b.get(i + 1) == Some(&b'/') => in_comment = true,
            b'{' if !in_comment => depth += 1,
            b'}' if !in_comment => {
                depth -= 1;
                if depth == 0 {
                    return &src[open..=i];
                }
            }
            _ => {}
        }
        i += 1;
    }
    &src[open..]
}

/// Names of the `extern "C" __global__` kernels in a source file.
fn kernel_names(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for part in src.split("extern \"C\" __global__ void ").skip(1) {
        let mut rest = part.trim_start();
        // attributes before the name: __cluster_dims__(4, 1, 1) __launch_bounds__(256)
        while rest.starts_with("__") {
            let Some(open) = rest.find('(') else { break };
            let word = rest[..open].trim();
            if !(word.ends_with("__") && word.len() > 4) {
                break;
            }
            let Some(close) = rest[open..].find(')') else {
                break;
            };
            rest = rest[open + close + 1..].trim_start();
        }
        if let Some(end) = rest.find('(') {
            out.push(rest[..end].trim().to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_names_skip_attributes() {
        let src = "extern \"C\" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(256) k1(int a) {}\n\
                   extern \"C\" __global__ void k2(float* x) {}";
        assert_eq!(super::kernel_names(src), ["k1", "k2"]);
        for (file, src) in super::KERNEL_FILES {
            for n in super::kernel_names(src) {
                assert!(
                    !n.starts_with("__")
                        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                    "{file}.cu: bad kernel name {n:?}"
                );
            }
        }
    }

    /// The decode step's kernels wait on their inputs (PDL); kernels launched
    /// outside the decode graph or by cuBLAS-adjacent prefill code may not.
    #[test]
    fn pdl_kernels_are_the_decode_chain() {
        let mut all = Vec::new();
        for (_, src) in super::KERNEL_FILES {
            let src = src.replace("#include \"common.cuh\"", super::COMMON);
            assert_eq!(
                super::kernel_names(&src).len(),
                super::kernel_starts(&src).len()
            );
            all.extend(super::pdl_kernels(&src));
        }
        all.sort();
        let mut want = vec![
            "embed_kernel",
            "add_rmsnorm_kernel",
            "gemv_kernel",
            "gemv3_kernel",
            "gemv_add_norm_kernel",
            "qk_prep_kernel",
            "attention_decode_partial_kernel",
            "attention_decode_merge_kernel",
            "conv_silu_kernel",
            "gdn_decode_kernel",
            "router_decode_kernel",
            "moe_gate_up_kernel",
            "moe_down_norm_kernel",
            "argmax_blocks_kernel",
            "argmax_finish_kernel",
            "head_screen_kernel",
            "head_pick_kernel",
        ];
        want.sort();
        assert_eq!(all, want);
        let src = "extern \"C\" __global__ void a(int x) { if (x) { y(); } // }\n }\n\
                   __device__ void h() { pdl_wait(); }\n\
                   extern \"C\" __global__ void b(int x) { decode_dot(w, x, K, ok); }";
        assert_eq!(super::pdl_kernels(src), ["b"]);
    }

    #[test]
    fn every_kernel_file_declares_kernels() {
        for (file, src) in super::KERNEL_FILES {
            assert!(
                !super::kernel_names(src).is_empty(),
                "{file}.cu declares no kernels"
            );
        }
    }
}
