//! Link arguments of the shared library: NCCL's SONAME, so that programs linked against
//! NVIDIA's libnccl.so.2 load this one in its place, and a version script that exports the
//! nccl*/pnccl* entry points and nothing else (no Rust symbol can clash with the program's).
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/exports.map");
    println!("cargo:rerun-if-changed=exports.map");
}
