//! The device: driver context and stream, NVRTC-compiled kernel modules,
//! cuBLAS, and raw device buffers. The driver, NVRTC and cuBLAS are loaded at
//! run time, so this builds and runs on machines with no CUDA at all; there
//! `Gpu::new` returns an error instead of panicking.

use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaStream};

use crate::kernels::{compile, Build, CompiledFile, Kernel, KERNELS};

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

/// A weight matrix as the kernels read it: bf16, or block FP8 (`data` holds
/// e4m3 codes, a byte each, and `scales` f32 [rows / 128, cols / 128]
/// row-major, the scale rows of stacked matrices stacked in the same order).
/// Derefs to its data, so code that handles bf16 only reads it as a `DevBuf`.
pub struct DevMat {
    pub data: DevBuf,
    pub scales: Option<DevBuf>,
}

impl DevMat {
    pub fn bf16(data: DevBuf) -> DevMat {
        DevMat { data, scales: None }
    }

    pub fn is_fp8(&self) -> bool {
        self.scales.is_some()
    }

    /// The scales' address; 0 (a null pointer to the kernels) for bf16.
    pub fn scales_ptr(&self) -> u64 {
        self.scales.as_ref().map_or(0, |s| s.ptr)
    }

    /// Bytes a weight takes: 2 (bf16) or 1 (e4m3).
    pub fn elem_bytes(&self) -> usize {
        if self.is_fp8() {
            1
        } else {
            2
        }
    }

    /// Bytes of the codes and the scales.
    pub fn total_bytes(&self) -> usize {
        self.data.bytes + self.scales.as_ref().map_or(0, |s| s.bytes)
    }
}

impl std::ops::Deref for DevMat {
    type Target = DevBuf;
    fn deref(&self) -> &DevBuf {
        &self.data
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

/// How the GPU is set up: the product setting, or a diagnostic of `lily bench`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuOptions {
    /// Launch the decode chain's kernels with programmatic dependent launch
    /// (the kernel table's `pdl`); off only to measure what it saves
    /// (`lily bench --no-pdl`).
    pub pdl: bool,
    /// How the kernels are built (the trace diagnostic, `lily bench --trace`).
    pub build: Build,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            pdl: true,
            build: Build::default(),
        }
    }
}

/// One argument of a kernel launch, kept alive until the launch call returns
/// (written only by the typed launchers of crate::kernels).
pub(crate) enum Arg {
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
    /// each kernel of the table (by `Kernel`), and whether it is launched
    /// with programmatic stream serialization (never when PDL is off)
    funcs: Vec<(CudaFunction, bool)>,
    /// the dynamic shared memory each kernel has been allowed (bytes past the
    /// default 48 KiB must be asked for once per kernel)
    smem_allowed: Vec<std::sync::atomic::AtomicU32>,
    /// set by the ablation profile: launches are dropped while it holds
    skip: std::sync::atomic::AtomicBool,
    pub name: String,
}

// SAFETY: the cuBLAS handle is only used from the thread that owns the Gpu
// (the engine worker); the context is bound to that thread before use.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    pub fn new(ordinal: usize, opts: &GpuOptions) -> Result<Gpu> {
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
        let mut modules = Vec::new();
        for CompiledFile { file, ptx } in compile(&opts.build)? {
            let module = ctx
                .load_module(ptx)
                .map_err(|e| anyhow!("loading kernels/{file}.cu: {e:?}"))?;
            modules.push((file, module));
        }
        let funcs = KERNELS
            .iter()
            .map(|k| {
                let (_, module) = modules.iter().find(|(f, _)| *f == k.file).unwrap();
                let f = module
                    .load_function(k.name)
                    .map_err(|e| anyhow!("kernel {} of kernels/{}.cu: {e:?}", k.name, k.file))?;
                Ok((f, k.pdl && opts.pdl))
            })
            .collect::<Result<Vec<_>>>()?;
        let modules: Vec<_> = modules.into_iter().map(|(_, m)| m).collect();
        let mut gpu = Gpu {
            ctx,
            stream,
            blas,
            smem_allowed: (0..KERNELS.len()).map(|_| Default::default()).collect(),
            funcs,
            skip: Default::default(),
            name,
            trace: None,
        };
        if opts.build.trace {
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

    /// Copy `bytes` bytes from `src` to `dst` on the device, in stream order.
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: both hold `bytes` bytes (checked by callers) and do not overlap.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }?;
        Ok(())
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

    /// Launch `kernel` on the stream, its arguments in the kernel's order
    /// (only a typed launcher of crate::kernels writes them).
    pub(crate) fn launch(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let (f, pdl) = &self.funcs[kernel as usize];
        let name = kernel.info().name;
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
        let allowed = &self.smem_allowed[kernel as usize];
        if smem > 48 << 10 && smem > allowed.load(std::sync::atomic::Ordering::Relaxed) {
            // past 48 KiB a kernel's dynamic shared memory must be asked for
            f.set_attribute(
                drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| anyhow!("{name}: {smem} bytes of shared memory: {e:?}"))?;
            allowed.store(smem, std::sync::atomic::Ordering::Relaxed);
        }
        if *pdl {
            return self.launch_pdl(name, f, grid, block, smem, &mut params);
        }
        // SAFETY: params point at values that live until this call returns; the
        // kernel's signature matches `args` (its typed launcher owns that).
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
