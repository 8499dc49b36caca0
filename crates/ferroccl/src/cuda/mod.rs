//! The CUDA driver layer: devices and contexts, memory through the cuMem virtual-memory API,
//! run-time kernel compilation with a disk cache, and passing the file descriptors that carry
//! cuMem allocations between processes of one host. The collective engine built on it lives in
//! `backend/cuda`; this layer knows nothing of communicators, and is what `ferroccl::cuda`
//! exposes to tools and tests that drive a GPU directly.
//!
//! Everything here builds and its host-side logic tests without CUDA: the driver and NVRTC are
//! loaded at run time (cudarc's `dynamic-loading`), and every entry point that needs them first
//! checks that they can be loaded, so a machine without them gets an error (or zero GPUs),
//! never a panic.

pub mod device;
pub mod fdpass;
pub mod hostpage;
pub mod mem;
mod modules;
pub mod nvrtc;
pub mod pinned;
pub mod stream;

pub use device::{current_device, gpu_count, Gpu};

use cudarc::driver::sys;
use ferroccl_core::{Error, Result};

/// Turns a driver call's status into ferroccl's error, naming the call and CUDA's own error name
/// so that a failure on a remote GPU machine can be read from the message alone.
pub fn cu_ok(call: &str, status: sys::CUresult) -> Result<()> {
    match status {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        s => Err(Error::System(format!("{call} failed: {}", describe(s)))),
    }
}

/// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)". The name comes from the binding's enum, so
/// it is there even when the driver cannot describe its own error.
pub(crate) fn describe(status: sys::CUresult) -> String {
    let text = cudarc::driver::result::DriverError(status)
        .error_string()
        .map(|c| c.to_string_lossy().into_owned());
    match text {
        Ok(t) => format!("{status:?} ({t})"),
        Err(_) => format!("{status:?}"),
    }
}
