//! The CUDA backend's foundation: devices and contexts, memory through the cuMem
//! virtual-memory API, run-time kernel compilation with a disk cache, and passing the
//! file descriptors that carry cuMem allocations between processes of one host.
//!
//! Everything here builds and its host-side logic tests without CUDA: the driver and
//! NVRTC are loaded at run time (cudarc's `dynamic-loading`), and every entry point that
//! needs them first checks that they can be loaded, so a machine without them gets an
//! error (or zero GPUs), never a panic.

pub(crate) mod devplan;
pub mod device;
pub(crate) mod fabric;
pub mod fdpass;
pub(crate) mod gpucheck;
pub(crate) mod kernels;
pub mod mem;
pub mod nvrtc;
pub(crate) mod rank;
pub(crate) mod window;

use cudarc::driver::sys;
use ferroccl_core::{Error, Result};

/// Turns a driver status into ferroccl's error, naming the call and CUDA's own error name
/// so that a failure on a remote GPU machine can be read from the message alone.
pub fn check(call: &str, status: sys::CUresult) -> Result<()> {
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
