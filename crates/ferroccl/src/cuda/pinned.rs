//! A word of pinned host memory that kernels read through a device address: the way to tell a
//! running kernel something without any driver call. A copy to device memory is a command on
//! the GPU's queues, and it waits behind those queues when they are full (a thread blocked in
//! `cuLaunchKernel` behind a thousand launches that wait on a dead peer); a store to this word
//! is a plain CPU store that the next poll over PCIe sees.

use super::cu_ok;
use super::device::Gpu;
use cudarc::driver::sys;
use ferroccl_core::Result;
use std::sync::atomic::{fence, Ordering};

/// One 32-bit word of pinned host memory that kernels on a GPU can read (the abort word): the
/// host writes it with a plain store, however full the GPU's launch queue is.
pub struct MappedWord {
    gpu: Gpu,
    host: *mut u32,
    device: u64,
}

// SAFETY: the word is written with volatile stores and read by kernels; the pointer is only
// freed at drop.
unsafe impl Send for MappedWord {}
unsafe impl Sync for MappedWord {}

impl MappedWord {
    /// A zeroed word, mapped for `gpu` (and portable to every context of this process).
    pub fn new(gpu: &Gpu) -> Result<MappedWord> {
        gpu.bind()?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        cu_ok("cuMemHostAlloc(4 bytes, mapped)", unsafe {
            sys::cuMemHostAlloc(&mut p, 4, flags)
        })?;
        let host = p as *mut u32;
        // SAFETY: 4 fresh bytes of pinned memory.
        unsafe { host.write_volatile(0) };
        let mut device: sys::CUdeviceptr = 0;
        if let Err(e) = cu_ok("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, p, 0)
        }) {
            unsafe { sys::cuMemFreeHost(p) };
            return Err(e);
        }
        Ok(MappedWord {
            gpu: gpu.clone(),
            host,
            device,
        })
    }

    /// The address kernels poll.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Stores `v`, ordered after the caller's earlier writes.
    pub fn set(&self, v: u32) {
        // SAFETY: our own live allocation.
        unsafe { self.host.write_volatile(v) };
        // Ordered after what the caller wrote before; PCIe delivers it to the next poll.
        fence(Ordering::SeqCst);
    }

    /// The word's current value.
    pub fn get(&self) -> u32 {
        // SAFETY: as in `set`.
        unsafe { self.host.read_volatile() }
    }
}

impl Drop for MappedWord {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        unsafe { sys::cuMemFreeHost(self.host as *mut std::ffi::c_void) };
    }
}
