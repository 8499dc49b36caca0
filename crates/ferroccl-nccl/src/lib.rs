//! `libnccl.so.2` built from ferroccl: NCCL's C API (`include/nccl.h`), so that programs
//! written for NCCL (nccl-tests, PyTorch, CuPy) run on ferroccl unchanged.
//!
//! This crate holds no algorithm: each entry point checks its arguments, turns NCCL's handles
//! and enums into ferroccl's and calls the library. What lives here is what the C API itself
//! adds: handles that may be invalid ([`handle`]), NCCL's groups and their deferred
//! initialisation ([`group`]), reduction handles, the last-error text and the result codes
//! ([`fail`]).
//!
//! Communicators run on the GPU current on the calling thread (the CUDA runtime's
//! `cudaSetDevice`), or on the host backend where there is none (or with
//! `FERROCCL_NCCL_BACKEND=host`), where buffers are host memory and streams are ignored: that
//! is how the C API is tested without a GPU.

pub mod api;
pub mod fail;
pub mod group;
pub mod handle;
pub mod logging;
pub mod memory;

pub use ferroccl_core::nccl_abi as abi;
