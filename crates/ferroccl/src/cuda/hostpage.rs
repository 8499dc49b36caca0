//! A page of host memory that GPUs of several processes read and write through device
//! addresses, and the host with plain stores: where the copy engine keeps the words its stream
//! memory operations wait on. A stream stalled on a word in GPU memory could be freed only by
//! another command on the GPU's queues, which may sit behind the stall itself; a word in host
//! memory is freed by a CPU store (abort, a dead peer) whatever the queues hold.
//!
//! The page is a memfd mapped shared: its owner passes the descriptor to the processes of its
//! peers with the arena descriptors, and each process registers its mapping with CUDA
//! (portable: every context of the process sees it).

use super::cu_ok;
use super::device::Gpu;
use cudarc::driver::sys;
use ferroccl_core::{Error, Result};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Bytes of a page.
pub const PAGE_BYTES: usize = 4096;

/// A shared page of 32-bit words, mapped and registered in this process.
pub struct HostPage {
    gpu: Gpu,
    fd: OwnedFd,
    host: *mut u32,
    device: u64,
    /// Left mapped and registered at drop: GPU work may still read it.
    keep: std::sync::atomic::AtomicBool,
}

// SAFETY: the words are accessed with volatile loads and stores only; the mapping is released
// at drop.
unsafe impl Send for HostPage {}
unsafe impl Sync for HostPage {}

impl HostPage {
    /// A new page of zeros, registered for the GPUs of this process.
    pub fn create(gpu: &Gpu) -> Result<HostPage> {
        // SAFETY: a static, NUL-terminated name; flags as documented.
        let raw = unsafe { libc::memfd_create(c"ferroccl-ce-flags".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(Error::System(format!(
                "memfd_create for the copy engine's flags failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: a descriptor we just opened and own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), PAGE_BYTES as libc::off_t) } != 0 {
            return Err(Error::System(format!(
                "ftruncate of the copy engine's flag page failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        Self::map(fd, gpu)
    }

    /// Maps and registers a peer's page from its descriptor.
    pub fn import(fd: BorrowedFd<'_>, gpu: &Gpu) -> Result<HostPage> {
        let fd = fd.try_clone_to_owned().map_err(|e| {
            Error::System(format!("dup of a peer's flag page descriptor failed: {e}"))
        })?;
        Self::map(fd, gpu)
    }

    fn map(fd: OwnedFd, gpu: &Gpu) -> Result<HostPage> {
        // SAFETY: a fresh shared mapping of the page; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::System(format!(
                "mmap of a copy-engine flag page failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        let unmap = || unsafe { libc::munmap(p, PAGE_BYTES) };
        if let Err(e) = gpu.bind() {
            unmap();
            return Err(e);
        }
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: a page-aligned mapping of PAGE_BYTES that lives until drop.
        if let Err(e) = cu_ok("cuMemHostRegister(flag page)", unsafe {
            sys::cuMemHostRegister_v2(p, PAGE_BYTES, flags)
        }) {
            unmap();
            return Err(e);
        }
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: registered above.
        if let Err(e) = cu_ok("cuMemHostGetDevicePointer(flag page)", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, p, 0)
        }) {
            unsafe { sys::cuMemHostUnregister(p) };
            unmap();
            return Err(e);
        }
        Ok(HostPage {
            gpu: gpu.clone(),
            fd,
            host: p as *mut u32,
            device,
            keep: Default::default(),
        })
    }

    /// Leaves the page mapped and registered when dropped (leaked): for a page that stalled GPU
    /// work may still read.
    pub fn keep_mapped(&self) {
        self.keep.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The descriptor to pass to peers' processes.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The page's address for GPUs of this process.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Stores `v` into word `i`, ordered after the caller's earlier stores.
    pub fn set(&self, i: usize, v: u32) {
        assert!(i < PAGE_BYTES / 4);
        // SAFETY: inside our live mapping.
        unsafe { self.host.add(i).write_volatile(v) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for HostPage {
    fn drop(&mut self) {
        if self.keep.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        // SAFETY: registered and mapped in `map`; no GPU work may touch it any more (the
        // owner's contract: the copy engine leaks its pages while its streams may).
        let _ = self.gpu.bind();
        unsafe {
            sys::cuMemHostUnregister(self.host.cast());
            libc::munmap(self.host.cast(), PAGE_BYTES);
        }
    }
}
