//! Whether NVRTC can be loaded where the crate is built: the kernels_compile
//! test (every kernel through NVRTC, checked against the kernel table) then
//! runs; elsewhere it shows as ignored. CI installs NVRTC and runs that test
//! with `--include-ignored` as well, so a missing NVRTC fails there.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(lily_nvrtc)");
    println!("cargo::rerun-if-changed=build.rs");
    // the loader's search path decides whether dlopen finds it
    println!("cargo::rerun-if-env-changed=LD_LIBRARY_PATH");
    // the names cudarc tries for CUDA 13's NVRTC
    let found = ["libnvrtc.so", "libnvrtc.so.13"]
        .iter()
        // SAFETY: loading NVRTC runs no code of ours; the library is dropped at once.
        .any(|name| unsafe { libloading::Library::new(*name) }.is_ok());
    if found {
        println!("cargo::rustc-cfg=lily_nvrtc");
    }
}
