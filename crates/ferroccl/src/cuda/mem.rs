//! GPU memory through the cuMem virtual-memory API, and nothing else.
//!
//! Why cuMem rather than cudaMalloc: the physical allocation, its virtual address range and
//! who may access it are separate objects. That lets one allocation be exported as a POSIX
//! file descriptor and mapped by another process (the p2p transport between processes),
//! lets peers be granted access per buffer instead of per context (cuCtxEnablePeerAccess
//! maps *every* allocation into every peer), and keeps the caching allocators of PyTorch
//! and friends out of ferroccl's buffers.
//!
//! Every buffer reports its size to a [`MemStats`] its creator passes in: there is no
//! process-wide counter, so two communicators (or a test and the code it tests) each see
//! their own usage.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;
use ferroccl_core::{Error, Result};

use super::cu_ok;
use super::device::{gpu_count, Gpu};

/// Bytes of GPU memory held through one set of buffers. Allocated bytes are physical memory
/// this process created; imported bytes are other processes' memory mapped here, which
/// costs address space but no memory of ours, and so is counted apart.
#[derive(Debug, Default)]
pub struct MemStats {
    allocated: AtomicU64,
    imported: AtomicU64,
    peak_allocated: AtomicU64,
    buffers: AtomicU64,
}

/// A consistent-enough copy of [`MemStats`] for printing (each counter is read once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemStatsSnapshot {
    /// Bytes allocated here and not yet freed.
    pub allocated_bytes: u64,
    /// Bytes of other processes' memory mapped here.
    pub imported_bytes: u64,
    /// The most bytes allocated at once.
    pub peak_allocated_bytes: u64,
    /// Buffers alive (allocated or imported).
    pub live_buffers: u64,
}

impl MemStats {
    /// Counters at zero, to share between the buffers they count.
    pub fn new() -> Arc<MemStats> {
        Arc::new(MemStats::default())
    }
    /// Bytes allocated here and not yet freed.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }
    /// Bytes of other processes' memory mapped here.
    pub fn imported_bytes(&self) -> u64 {
        self.imported.load(Ordering::Relaxed)
    }
    /// The most bytes allocated at once since creation.
    pub fn peak_allocated_bytes(&self) -> u64 {
        self.peak_allocated.load(Ordering::Relaxed)
    }
    /// Every counter, read once.
    pub fn snapshot(&self) -> MemStatsSnapshot {
        MemStatsSnapshot {
            allocated_bytes: self.allocated_bytes(),
            imported_bytes: self.imported_bytes(),
            peak_allocated_bytes: self.peak_allocated_bytes(),
            live_buffers: self.buffers.load(Ordering::Relaxed),
        }
    }

    fn add(&self, origin: Origin, bytes: u64) {
        self.buffers.fetch_add(1, Ordering::Relaxed);
        match origin {
            Origin::Allocated => {
                let now = self.allocated.fetch_add(bytes, Ordering::Relaxed) + bytes;
                self.peak_allocated.fetch_max(now, Ordering::Relaxed);
            }
            Origin::Imported => {
                self.imported.fetch_add(bytes, Ordering::Relaxed);
            }
        }
    }

    fn sub(&self, origin: Origin, bytes: u64) {
        self.buffers.fetch_sub(1, Ordering::Relaxed);
        match origin {
            Origin::Allocated => self.allocated.fetch_sub(bytes, Ordering::Relaxed),
            Origin::Imported => self.imported.fetch_sub(bytes, Ordering::Relaxed),
        };
    }
}

/// Where a buffer's physical memory came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Allocated by this process (`cuMemCreate`).
    Allocated,
    /// Another process's allocation, imported from its file descriptor.
    Imported,
}

/// Rounds a request up to the allocation granularity. Zero bytes is refused rather than
/// rounded to one granule: a zero-sized collective buffer is a caller bug worth seeing.
pub(crate) fn round_up(bytes: usize, granularity: usize) -> Result<usize> {
    if bytes == 0 {
        return Err(Error::InvalidArgument("GPU buffer of 0 bytes".into()));
    }
    if granularity == 0 || !granularity.is_power_of_two() {
        return Err(Error::Internal(format!(
            "allocation granularity {granularity} is not a power of two"
        )));
    }
    bytes
        .checked_add(granularity - 1)
        .map(|b| b & !(granularity - 1))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "GPU buffer of {bytes} bytes overflows the address space"
            ))
        })
}

/// The GPUs to grant read/write access: the owner first (a mapping its own GPU cannot
/// touch is useless, so it is always included), then each listed peer once.
pub(crate) fn access_ordinals(
    owner: usize,
    peers: &[usize],
    gpu_count: usize,
) -> Result<Vec<usize>> {
    let mut out = vec![owner];
    for &p in peers {
        if p >= gpu_count {
            return Err(Error::InvalidArgument(format!(
                "access for GPU {p}, but only {gpu_count} are visible"
            )));
        }
        if !out.contains(&p) {
            out.push(p);
        }
    }
    Ok(out)
}

fn device_location(ordinal: usize) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    }
}

pub(crate) fn access_descs(ordinals: &[usize]) -> Vec<sys::CUmemAccessDesc> {
    ordinals
        .iter()
        .map(|&o| sys::CUmemAccessDesc {
            location: device_location(o),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        })
        .collect()
}

/// Pinned device memory on `ordinal`, exportable as a POSIX file descriptor.
pub(crate) fn alloc_prop(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is the documented "no extra flags" value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = device_location(ordinal);
    prop
}

/// The recommended granularity of `gpu` for fd-exportable allocations, which is also what
/// every size and address is aligned to.
pub fn granularity(gpu: &Gpu) -> Result<usize> {
    let prop = alloc_prop(gpu.ordinal());
    let mut g = 0usize;
    cu_ok("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    Ok(g)
}

/// A range of device memory mapped in this process, from cuMemCreate or imported from
/// another process. Drop unmaps it, frees its addresses and releases the allocation.
pub struct DeviceBuffer {
    gpu: Gpu,
    ptr: sys::CUdeviceptr,
    len: usize,
    mapped: usize,
    handle: sys::CUmemGenericAllocationHandle,
    origin: Origin,
    stats: Arc<MemStats>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("gpu", &self.gpu.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("mapped", &self.mapped)
            .field("origin", &self.origin)
            .finish()
    }
}

impl DeviceBuffer {
    /// At least `bytes` of memory on `gpu`, readable and writable by `gpu` and every GPU in
    /// `access` (ordinals). The size is rounded up to the allocation granularity.
    pub fn alloc(
        gpu: &Gpu,
        bytes: usize,
        access: &[usize],
        stats: &Arc<MemStats>,
    ) -> Result<DeviceBuffer> {
        gpu.bind()?;
        let who = access_ordinals(gpu.ordinal(), access, gpu_count()?)?;
        let gran = granularity(gpu)?;
        let mapped = round_up(bytes, gran)?;
        let prop = alloc_prop(gpu.ordinal());
        let mut handle = 0;
        cu_ok(
            &format!("cuMemCreate({mapped} bytes on GPU {})", gpu.ordinal()),
            unsafe { sys::cuMemCreate(&mut handle, mapped, &prop, 0) },
        )?;
        match map_handle(handle, mapped, gran, &who) {
            Ok(ptr) => Ok(Self::adopt(
                gpu,
                ptr,
                bytes,
                mapped,
                handle,
                Origin::Allocated,
                stats,
            )),
            Err(e) => {
                unsafe { sys::cuMemRelease(handle) };
                Err(e)
            }
        }
    }

    /// Maps memory another process exported (see [`DeviceBuffer::export_fd`]) on `gpu`,
    /// with access for `gpu` and `access`. `bytes` is at most the exporter's size; the fd
    /// stays the caller's and may be closed once this returns.
    pub fn import(
        fd: BorrowedFd<'_>,
        bytes: usize,
        gpu: &Gpu,
        access: &[usize],
        stats: &Arc<MemStats>,
    ) -> Result<DeviceBuffer> {
        gpu.bind()?;
        let who = access_ordinals(gpu.ordinal(), access, gpu_count()?)?;
        let gran = granularity(gpu)?;
        let mapped = round_up(bytes, gran)?;
        let mut handle = 0;
        cu_ok("cuMemImportFromShareableHandle", unsafe {
            // The driver takes a POSIX fd as an integer smuggled in the pointer argument.
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        match map_handle(handle, mapped, gran, &who) {
            Ok(ptr) => Ok(Self::adopt(
                gpu,
                ptr,
                bytes,
                mapped,
                handle,
                Origin::Imported,
                stats,
            )),
            Err(e) => {
                unsafe { sys::cuMemRelease(handle) };
                Err(e)
            }
        }
    }

    fn adopt(
        gpu: &Gpu,
        ptr: sys::CUdeviceptr,
        len: usize,
        mapped: usize,
        handle: sys::CUmemGenericAllocationHandle,
        origin: Origin,
        stats: &Arc<MemStats>,
    ) -> DeviceBuffer {
        stats.add(origin, mapped as u64);
        DeviceBuffer {
            gpu: gpu.clone(),
            ptr,
            len,
            mapped,
            handle,
            origin,
            stats: stats.clone(),
        }
    }

    /// A new file descriptor for this allocation, for another process to
    /// [`import`](DeviceBuffer::import) after receiving it through `fdpass`.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        self.gpu.bind()?;
        export_handle(self.handle)
    }

    /// Grants read/write access to more GPUs (ordinals); earlier grants stay.
    pub fn grant_access(&self, peers: &[usize]) -> Result<()> {
        grant_range(&self.gpu, self.ptr, self.mapped, peers)
    }

    /// The device address, valid on every GPU granted access.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    /// The bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no bytes were asked for.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes mapped (the request rounded up to the granularity); all of it is usable.
    pub fn mapped_len(&self) -> usize {
        self.mapped
    }
    /// The GPU it is mapped for.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
    /// Whether this process allocated it or imported it.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    fn range_check(&self, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.mapped => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "copy of {n} bytes at offset {offset} outside a buffer of {} bytes",
                self.mapped
            ))),
        }
    }

    /// Synchronous copy from host memory, for setup and checks (not the data path).
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.range_check(offset, src.len())?;
        self.gpu.bind()?;
        cu_ok("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, src.as_ptr().cast(), src.len())
        })?;
        // From pageable memory the call may return once the bytes are staged, before the DMA
        // into the buffer is done (the driver's documented behaviour), and a kernel on a
        // non-blocking stream would then read the old contents. The DMA runs on the legacy
        // stream: waiting for that stream waits for it, and not for other streams' kernels
        // (which may be waiting for this thread: another rank on the same GPU).
        cu_ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(std::ptr::null_mut())
        })
    }

    /// Synchronous copy to host memory, for setup and checks (not the data path).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.range_check(offset, dst.len())?;
        self.gpu.bind()?;
        cu_ok("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + offset as u64, dst.len())
        })
    }

    /// Releases the buffer now, reporting failures that Drop can only log.
    pub fn free(mut self) -> Result<()> {
        let r = self.release();
        std::mem::forget(self);
        r
    }

    fn release(&mut self) -> Result<()> {
        self.stats.sub(self.origin, self.mapped as u64);
        let _ = self.gpu.bind();
        // Unmap before freeing the addresses, and release the handle last: the order the
        // driver documents, and the one that leaves nothing half-torn-down on an error.
        let a = cu_ok("cuMemUnmap", unsafe {
            sys::cuMemUnmap(self.ptr, self.mapped)
        });
        let b = cu_ok("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(self.ptr, self.mapped)
        });
        let c = cu_ok("cuMemRelease", unsafe { sys::cuMemRelease(self.handle) });
        a.and(b).and(c)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Stats (an Arc field) would drop after this: release() still sees them.
        if let Err(e) = self.release() {
            tracing::warn!("freeing a GPU buffer: {e}");
        }
    }
}

// SAFETY: the buffer is a device address plus driver handles, usable from any thread once
// the owning GPU's context is bound (every method binds it).
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

/// Reserves addresses for `handle`, maps it and sets access; undoes its own steps on error.
fn map_handle(
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
    align: usize,
    who: &[usize],
) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    cu_ok("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut ptr, size, align, 0, 0)
    })?;
    if let Err(e) = cu_ok("cuMemMap", unsafe {
        sys::cuMemMap(ptr, size, 0, handle, 0)
    }) {
        unsafe { sys::cuMemAddressFree(ptr, size) };
        return Err(e);
    }
    if let Err(e) = set_access(ptr, size, who) {
        unsafe {
            sys::cuMemUnmap(ptr, size);
            sys::cuMemAddressFree(ptr, size);
        }
        return Err(e);
    }
    Ok(ptr)
}

fn set_access(ptr: sys::CUdeviceptr, size: usize, who: &[usize]) -> Result<()> {
    let descs = access_descs(who);
    cu_ok(&format!("cuMemSetAccess(GPUs {who:?})"), unsafe {
        sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())
    })
}

/// The cuMem allocation that holds `[ptr, ptr + len)`, exported as a file descriptor for
/// other processes to map: (fd, allocation base, allocation size). Memory that is not a cuMem
/// allocation made with POSIX file-descriptor handles (cudaMalloc, a caching allocator's pool)
/// is refused, naming the allocator that makes suitable memory.
pub(crate) fn export_allocation(gpu: &Gpu, ptr: u64, len: usize) -> Result<(OwnedFd, u64, usize)> {
    let hint = "register memory from ferroccl::mem::alloc (ncclMemAlloc), or any cuMem allocation made with POSIX file-descriptor handles";
    let (base, size) = holding_range(gpu, ptr, len, hint)?;
    let handle = Retained::at(ptr).map_err(|e| {
        Error::InvalidArgument(format!("{ptr:#x} is not a cuMem allocation ({e}); {hint}"))
    })?;
    // The reference is released with `handle`; the allocation stays its owner's.
    let fd = handle.export().map_err(|e| {
        Error::InvalidArgument(format!(
            "the allocation at {base:#x} cannot be shared as a file descriptor ({e}); {hint}"
        ))
    })?;
    Ok((fd, base, size as usize))
}

/// The allocation that holds `[ptr, ptr + len)` as another process imports it: (its export, base,
/// size). A cuMem allocation with POSIX file-descriptor handles goes as a descriptor, `cuMemAlloc`
/// memory of `gpu` (`cudaMalloc`'s) as its CUDA IPC handle; other memory is refused.
pub(crate) fn export_lendable(gpu: &Gpu, ptr: u64, len: usize) -> Result<(Shared, u64, usize)> {
    let hint = "register device memory of this GPU: a cuMem allocation with POSIX file-descriptor handles (ferroccl::mem::alloc, ncclMemAlloc) or cudaMalloc's";
    let (base, size) = holding_range(gpu, ptr, len, hint)?;
    let shared = Identity::at(ptr, gpu.ordinal())
        .and_then(|id| id.export())
        .map_err(|e| {
            Error::InvalidArgument(format!(
                "the allocation at {base:#x} cannot be shared with other processes ({e}); {hint}"
            ))
        })?;
    Ok((shared, base, size as usize))
}

/// The allocation holding all of `[ptr, ptr + len)` (base, bytes), or why not (`hint`: what to
/// register instead).
fn holding_range(gpu: &Gpu, ptr: u64, len: usize, hint: &str) -> Result<(u64, u64)> {
    let (base, size) = allocation_range(gpu, ptr).map_err(|e| {
        Error::InvalidArgument(format!(
            "{ptr:#x} is not GPU memory of this process ({e}); {hint}"
        ))
    })?;
    if ptr.checked_add(len as u64).is_none_or(|e| e > base + size) {
        return Err(Error::InvalidArgument(format!(
            "{len} bytes at {ptr:#x} run past the end of their allocation ({size} bytes at {base:#x})"
        )));
    }
    Ok((base, size))
}

/// The allocation holding `ptr` (its base and bytes), or the driver's error where `ptr` is not
/// GPU memory of this process.
pub(crate) fn allocation_range(gpu: &Gpu, ptr: u64) -> Result<(u64, u64)> {
    gpu.bind()?;
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: out-pointers to locals; the driver checks the address.
    cu_ok("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    Ok((base, size as u64))
}

/// A reference to a cuMem allocation's handle (`cuMemRetainAllocationHandle`), released on drop.
/// The driver hands out the same handle for one allocation as long as it lives, and while a
/// reference is held the allocation lives (its memory too, if its owner unmaps and releases it),
/// so no other allocation can have that handle: two references are equal exactly when they name
/// the same allocation.
#[derive(Debug)]
pub(crate) struct Retained(sys::CUmemGenericAllocationHandle);

impl PartialEq for Retained {
    fn eq(&self, other: &Retained) -> bool {
        self.0 == other.0
    }
}

impl Retained {
    /// A reference to the cuMem allocation mapped at `ptr`, or the driver's error where none is
    /// (memory from `cudaMalloc`, or nothing mapped there).
    pub fn at(ptr: u64) -> Result<Retained> {
        let mut handle = 0;
        // SAFETY: an out-pointer to a local; the driver checks the address.
        cu_ok("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(&mut handle, ptr as *mut std::ffi::c_void)
        })?;
        Ok(Retained(handle))
    }

    /// A new POSIX file descriptor for the allocation (the owning GPU's context bound).
    pub fn export(&self) -> Result<OwnedFd> {
        export_handle(self.0)
    }
}

impl Drop for Retained {
    fn drop(&mut self) {
        // SAFETY: the reference `at` took, released once.
        unsafe { sys::cuMemRelease(self.0) };
    }
}

/// What names one allocation of this process for as long as it lives, so that a loan of it
/// can tell it from a later allocation at the same addresses.
#[derive(Debug, PartialEq)]
pub(crate) enum Identity {
    /// A cuMem allocation, by a reference to its handle (which also keeps it alive).
    CuMem(Retained),
    /// Memory of `cuMemAlloc` (`cudaMalloc`, a caching allocator's segments): the driver's buffer
    /// id, which it never hands out twice in a process, and the allocation's base. Nothing
    /// keeps it alive: a peer's IPC mapping of it keeps its memory (the driver frees it at the
    /// last close, measured in `docs/PERFORMANCE.md` section 45), never its addresses.
    Legacy { buffer: u64, base: u64 },
}

impl Identity {
    /// The allocation mapped at `ptr` on GPU `ordinal`: a cuMem allocation, or else device memory
    /// of `cuMemAlloc` on that GPU (not managed, not a host's); the driver's error or a refusal
    /// otherwise.
    pub fn at(ptr: u64, ordinal: usize) -> Result<Identity> {
        if let Ok(r) = Retained::at(ptr) {
            return Ok(Identity::CuMem(r));
        }
        // Each out-value at least as wide as the driver writes (the managed flag is a C `bool` or
        // an `unsigned int` by the header one reads: 4 bytes hold either).
        let (mut kind, mut buffer, mut managed, mut device, mut base) =
            (0u32, 0u64, 0u32, -1i32, 0u64);
        let mut attrs = [
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        ];
        let mut data: [*mut std::ffi::c_void; 5] = [
            (&mut kind as *mut u32).cast(),
            (&mut buffer as *mut u64).cast(),
            (&mut managed as *mut u32).cast(),
            (&mut device as *mut i32).cast(),
            (&mut base as *mut u64).cast(),
        ];
        // SAFETY: one out-pointer of the attribute's size for each attribute asked; the driver
        // checks the address (for memory it does not know it writes its defaults, a memory type
        // of 0 among them, and succeeds: refused below).
        cu_ok("cuPointerGetAttributes", unsafe {
            sys::cuPointerGetAttributes(5, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr)
        })?;
        let is_device = kind == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        if !is_device || managed != 0 || device != ordinal as i32 || buffer == 0 || base == 0 {
            return Err(Error::InvalidArgument(format!(
                "{ptr:#x} is not device memory of GPU {ordinal} (memory type {kind}, managed {managed}, device {device})"
            )));
        }
        Ok(Identity::Legacy { buffer, base })
    }

    /// What a peer process imports the allocation by (the owning GPU's context bound): a new
    /// POSIX file descriptor, or a CUDA IPC handle.
    pub fn export(&self) -> Result<Shared> {
        match self {
            Identity::CuMem(r) => r.export().map(Shared::Fd),
            Identity::Legacy { base, .. } => ipc_handle(*base).map(Shared::Ipc),
        }
    }
}

/// An allocation as another process imports it ([`Identity::export`]).
#[derive(Debug)]
pub(crate) enum Shared {
    /// A cuMem allocation's POSIX file descriptor, passed over a Unix socket.
    Fd(OwnedFd),
    /// A `cuMemAlloc` allocation's CUDA IPC handle: plain bytes, which name the allocation to a
    /// process of the same machine (the driver gives one allocation the same bytes every time).
    Ipc([u8; IPC_HANDLE_LEN]),
}

/// The bytes of a CUDA IPC memory handle.
pub(crate) const IPC_HANDLE_LEN: usize = 64;

/// The CUDA IPC handle of the `cuMemAlloc` allocation at `base` (the owning GPU's context bound).
fn ipc_handle(base: u64) -> Result<[u8; IPC_HANDLE_LEN]> {
    let mut h = sys::CUipcMemHandle {
        reserved: [0; IPC_HANDLE_LEN],
    };
    // SAFETY: an out-pointer to a local handle; the driver checks the address.
    cu_ok("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, base)
    })?;
    Ok(h.reserved.map(|b| b as u8))
}

/// Another process's `cuMemAlloc` allocation opened here by its CUDA IPC handle; closed on drop.
/// The driver counts opens of one allocation in a process (two mappers opening the same
/// handle get the same address, and each close undoes one open: checked on the machines,
/// `docs/PERFORMANCE.md` section 45), so each mapping closes its own open and no other's.
pub(crate) struct IpcMapping {
    gpu: Gpu,
    ptr: sys::CUdeviceptr,
    len: usize,
    stats: Arc<MemStats>,
}

impl IpcMapping {
    /// Opens `handle` on `gpu` (peer access enabled as the driver needs it); the mapping covers
    /// the whole allocation, whose length the driver reports.
    pub fn open(
        gpu: &Gpu,
        handle: &[u8; IPC_HANDLE_LEN],
        stats: &Arc<MemStats>,
    ) -> Result<IpcMapping> {
        gpu.bind()?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        // SAFETY: an out-pointer to a local; the handle is plain bytes the driver checks.
        cu_ok("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        let len = allocation_range(gpu, ptr).and_then(|(base, len)| {
            if base == ptr {
                Ok(len)
            } else {
                Err(Error::Internal(format!(
                    "an IPC mapping at {ptr:#x} lies in a range from {base:#x}"
                )))
            }
        });
        match len {
            Ok(len) => {
                stats.add(Origin::Imported, len);
                Ok(IpcMapping {
                    gpu: gpu.clone(),
                    ptr,
                    len: len as usize,
                    stats: stats.clone(),
                })
            }
            Err(e) => {
                // SAFETY: the open just made, closed once.
                unsafe { sys::cuIpcCloseMemHandle(ptr) };
                Err(e)
            }
        }
    }

    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        self.stats.sub(Origin::Imported, self.len as u64);
        let r = self.gpu.bind().and_then(|()| {
            // SAFETY: this mapping's own open, closed once.
            cu_ok("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(self.ptr)
            })
        });
        if let Err(e) = r {
            tracing::warn!("closing a peer's IPC mapping: {e}");
        }
    }
}

// SAFETY: a device address, usable from any thread once the GPU's context is bound (the drop
// binds it).
unsafe impl Send for IpcMapping {}

/// A new POSIX file descriptor for an allocation handle (the owning GPU's context bound).
fn export_handle(handle: sys::CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    let mut fd: i32 = -1;
    cu_ok("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut i32).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::System(
            "cuMemExportToShareableHandle returned no file descriptor".into(),
        ));
    }
    // SAFETY: the driver just created this descriptor for us to own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Lets GPU `reader` of this process reach the allocation `shared` names (`[base, base + size)`
/// of `gpu`) at the lender's own addresses: a cuMem allocation by a grant of its range,
/// `cuMemAlloc` memory by peer access to `gpu`'s context (`Gpu::let_reach`). What a peer of the
/// lender's process gets instead of a mapper's mapping.
pub(crate) fn reach_here(
    gpu: &Gpu,
    shared: &Shared,
    base: u64,
    size: usize,
    reader: usize,
) -> Result<()> {
    match shared {
        Shared::Fd(_) => grant_range(gpu, base, size, &[reader]),
        Shared::Ipc(_) => gpu.let_reach(reader),
    }
}

/// Grants read/write access to a mapped range (all of one allocation) to more GPUs of this
/// process; earlier grants stay.
pub(crate) fn grant_range(gpu: &Gpu, base: u64, size: usize, peers: &[usize]) -> Result<()> {
    gpu.bind()?;
    let who = access_ordinals(gpu.ordinal(), peers, gpu_count()?)?;
    set_access(base, size, &who)
}

/// ferroccl's counterpart of `ncclMemAlloc`: `bytes` on `gpu`, mapped for `gpu` and for
/// every other GPU that can reach it peer-to-peer, counted in `stats`.
pub fn alloc(gpu: &Gpu, bytes: usize, stats: &Arc<MemStats>) -> Result<DeviceBuffer> {
    let mut peers = Vec::new();
    for p in 0..gpu_count()? {
        if p != gpu.ordinal() && gpu.peer_link(p)?.access {
            peers.push(p);
        }
    }
    DeviceBuffer::alloc(gpu, bytes, &peers, stats)
}

/// The counterpart of `ncclMemFree`: frees now and reports any driver error.
pub fn free(buf: DeviceBuffer) -> Result<()> {
    buf.free()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB2: usize = 2 << 20;

    #[test]
    fn round_up_to_granularity() {
        assert_eq!(round_up(1, MIB2).unwrap(), MIB2);
        assert_eq!(round_up(MIB2, MIB2).unwrap(), MIB2);
        assert_eq!(round_up(MIB2 + 1, MIB2).unwrap(), 2 * MIB2);
        assert_eq!(round_up(64 << 20, MIB2).unwrap(), 64 << 20);
        assert!(matches!(round_up(0, MIB2), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            round_up(usize::MAX - 5, MIB2),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(round_up(10, 3), Err(Error::Internal(_))));
        assert!(matches!(round_up(10, 0), Err(Error::Internal(_))));
        // The largest size that still fits.
        let top = usize::MAX & !(MIB2 - 1);
        assert_eq!(round_up(top, MIB2).unwrap(), top);
    }

    #[test]
    fn access_list_owner_first_and_deduplicated() {
        assert_eq!(access_ordinals(2, &[], 4).unwrap(), vec![2]);
        assert_eq!(
            access_ordinals(2, &[0, 2, 3, 0, 1], 4).unwrap(),
            vec![2, 0, 3, 1]
        );
        assert!(matches!(
            access_ordinals(0, &[4], 4),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn access_descriptors_grant_read_write_per_device() {
        let d = access_descs(&[1, 0]);
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].location.id, 1);
        assert_eq!(d[1].location.id, 0);
        for x in &d {
            assert_eq!(
                x.location.type_,
                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
            );
            assert_eq!(
                x.flags,
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            );
        }
    }

    #[test]
    fn allocation_props_request_posix_fds() {
        let p = alloc_prop(3);
        assert_eq!(
            p.type_,
            sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
        );
        assert_eq!(
            p.requestedHandleTypes,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        );
        assert_eq!(p.location.id, 3);
        assert_eq!(p.allocFlags.gpuDirectRDMACapable, 0);
    }

    #[test]
    fn stats_track_peak_and_split_imports() {
        let s = MemStats::new();
        s.add(Origin::Allocated, 100);
        s.add(Origin::Allocated, 50);
        s.add(Origin::Imported, 7);
        s.sub(Origin::Allocated, 100);
        s.add(Origin::Allocated, 20);
        assert_eq!(
            s.snapshot(),
            MemStatsSnapshot {
                allocated_bytes: 70,
                imported_bytes: 7,
                peak_allocated_bytes: 150,
                live_buffers: 3
            }
        );
        s.sub(Origin::Imported, 7);
        assert_eq!(s.imported_bytes(), 0);
    }

    #[test]
    fn alloc_without_gpu_is_an_error_not_a_panic() {
        if gpu_count().unwrap() == 0 {
            assert!(Gpu::open(0).is_err());
        }
    }
}
