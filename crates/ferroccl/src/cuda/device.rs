//! GPUs and their primary contexts, over cudarc's `sys` layer.
//!
//! The primary context (the one the runtime API and every framework share) is used rather
//! than a context of our own: a library that creates contexts doubles the per-GPU memory
//! overhead of its host application and cannot exchange pointers with it.

use std::ffi::{c_void, CStr};
use std::mem::MaybeUninit;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use ferroccl_core::{Error, Result};

use super::cu_ok;

/// What loading and initialising the driver found, decided once per process: neither
/// outcome can change while the process lives.
enum Driver {
    /// `libcuda` could not be loaded (a machine without the NVIDIA driver).
    Absent,
    /// The driver loaded but reports no GPU (`CUDA_ERROR_NO_DEVICE`).
    NoDevice,
    Ready,
    Failed(String),
}

fn driver() -> &'static Driver {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    DRIVER.get_or_init(|| {
        // cudarc panics, rather than returning an error, when the library or a symbol is
        // missing; a panic must never be how a CPU-only machine learns it has no GPU.
        let present =
            std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
        if !present {
            return Driver::Absent;
        }
        match std::panic::catch_unwind(|| unsafe { sys::cuInit(0) }) {
            Ok(sys::CUresult::CUDA_SUCCESS) => Driver::Ready,
            Ok(sys::CUresult::CUDA_ERROR_NO_DEVICE) => Driver::NoDevice,
            Ok(s) => Driver::Failed(format!("cuInit failed: {}", super::describe(s))),
            Err(_) => Driver::Failed("cuInit failed: the CUDA driver library lacks cuInit".into()),
        }
    })
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    !matches!(driver(), Driver::Absent)
}

/// Initialises the driver, or says why it cannot be used.
pub fn init() -> Result<()> {
    match driver() {
        Driver::Ready => Ok(()),
        Driver::Absent => Err(Error::System(
            "CUDA driver library (libcuda.so) not found".into(),
        )),
        Driver::NoDevice => Err(Error::System(
            "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device)".into(),
        )),
        Driver::Failed(m) => Err(Error::System(m.clone())),
    }
}

/// How many GPUs this process can use: 0, not an error, where there is no driver or no GPU,
/// so that callers can pick the host backend without special cases.
pub fn gpu_count() -> Result<usize> {
    match driver() {
        Driver::Absent | Driver::NoDevice => Ok(0),
        Driver::Failed(m) => Err(Error::System(m.clone())),
        Driver::Ready => {
            let mut n = 0;
            cu_ok("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
            Ok(n.max(0) as usize)
        }
    }
}

/// The GPU of the context current on this thread (what the CUDA runtime's `cudaSetDevice`
/// selects), or None where there is no driver, no GPU or no current context: NCCL's API picks
/// a communicator's GPU this way.
pub fn current_device() -> Result<Option<usize>> {
    match driver() {
        Driver::Absent | Driver::NoDevice => Ok(None),
        Driver::Failed(m) => Err(Error::System(m.clone())),
        Driver::Ready => {
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            cu_ok("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
            if ctx.is_null() {
                return Ok(None);
            }
            let mut dev: sys::CUdevice = 0;
            cu_ok("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
            Ok(Some(dev.max(0) as usize))
        }
    }
}

/// How two GPUs reach each other, as far as the driver says cheaply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLink {
    /// Loads and stores through peer-mapped memory work (`cuDeviceCanAccessPeer`).
    pub access: bool,
    /// Atomics on peer memory are native; true over NVLink, usually false over PCIe, so it
    /// stands in for "NVLink" until topology detection reads NVML.
    pub native_atomics: bool,
    /// The driver's relative performance rank of the link (lower is better).
    pub perf_rank: i32,
}

/// One GPU with its retained primary context. Cheap to clone; the context is released
/// when the last clone (and every buffer and module made on it) is gone.
#[derive(Clone)]
pub struct Gpu(Arc<GpuInner>);

struct GpuInner {
    ordinal: usize,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    cc: (u32, u32),
    total_mem: usize,
}

// SAFETY: a CUcontext is a handle the driver lets any thread make current; the struct
// holds nothing thread-bound.
unsafe impl Send for GpuInner {}
unsafe impl Sync for GpuInner {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Gpu({}: {}, sm_{}{})",
            self.0.ordinal, self.0.name, self.0.cc.0, self.0.cc.1
        )
    }
}

impl Gpu {
    /// GPU `ordinal` (as CUDA numbers the visible ones), its primary context retained.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        init()?;
        let count = gpu_count()?;
        if ordinal >= count {
            return Err(Error::InvalidArgument(format!(
                "GPU {ordinal} does not exist ({count} visible)"
            )));
        }
        let mut dev = 0;
        cu_ok("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal as i32)
        })?;
        let mut name = [0u8; 256];
        cu_ok("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr().cast(), name.len() as i32, dev)
        })?;
        let name = CStr::from_bytes_until_nul(&name)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut total_mem = 0usize;
        cu_ok("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut total_mem, dev)
        })?;
        let major = attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )?;
        let minor = attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        )?;
        let mut ctx = std::ptr::null_mut();
        cu_ok("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        let gpu = Gpu(Arc::new(GpuInner {
            ordinal,
            dev,
            ctx,
            name,
            cc: (major as u32, minor as u32),
            total_mem,
        }));
        gpu.bind()?;
        Ok(gpu)
    }

    /// Its CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }
    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.0.name
    }
    /// (major, minor), e.g. (9, 0) on Hopper.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.0.cc
    }
    /// The NVRTC architecture for this GPU's own machine code, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.0.cc.0, self.0.cc.1)
    }
    /// Bytes of device memory.
    pub fn total_memory(&self) -> usize {
        self.0.total_mem
    }

    /// Makes this GPU's context current on the calling thread. Every call that touches the
    /// GPU does this first, so callers never depend on which thread last used which GPU.
    pub fn bind(&self) -> Result<()> {
        cu_ok("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.0.ctx)
        })
    }

    /// A device attribute (`cuDeviceGetAttribute`).
    pub fn attribute(&self, attr: sys::CUdevice_attribute) -> Result<i32> {
        attribute(self.0.dev, attr)
    }

    /// Whether this GPU can map cuMem allocations and exchange them as POSIX file
    /// descriptors: the two things the p2p transport needs.
    pub fn supports_cumem_fd(&self) -> Result<bool> {
        use sys::CUdevice_attribute::*;
        Ok(
            self.attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)? != 0
                && self
                    .attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?
                    != 0,
        )
    }

    /// Whether this process sees another GPU and every other GPU it sees and reaches through
    /// peer access is joined to this one by a link with native atomics: NVLink, as far as CUDA
    /// says cheaply ([`PeerLink::native_atomics`]). False where it sees no other GPU (one GPU per
    /// process by `CUDA_VISIBLE_DEVICES`): that says nothing of the link, and a caller that must
    /// not run over PCIe cannot take it for NVLink.
    pub fn peers_on_nvlink(&self) -> Result<bool> {
        let mut seen = false;
        for p in (0..gpu_count()?).filter(|&p| p != self.0.ordinal) {
            let l = self.peer_link(p)?;
            if l.access && !l.native_atomics {
                return Ok(false);
            }
            seen |= l.access;
        }
        Ok(seen)
    }

    /// How this GPU reaches `peer` (by ordinal). A GPU reaches itself trivially.
    pub fn peer_link(&self, peer: usize) -> Result<PeerLink> {
        if peer == self.0.ordinal {
            return Ok(PeerLink {
                access: true,
                native_atomics: true,
                perf_rank: 0,
            });
        }
        let mut pdev = 0;
        cu_ok("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut pdev, peer as i32)
        })?;
        let mut can = 0;
        cu_ok("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, self.0.dev, pdev)
        })?;
        let p2p = |a| -> Result<i32> {
            let mut v = 0;
            cu_ok("cuDeviceGetP2PAttribute", unsafe {
                sys::cuDeviceGetP2PAttribute(&mut v, a, self.0.dev, pdev)
            })?;
            Ok(v)
        };
        use sys::CUdevice_P2PAttribute::*;
        Ok(PeerLink {
            access: can != 0,
            native_atomics: p2p(CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0,
            perf_rank: p2p(CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
        })
    }

    /// Lets GPU `reader` (by ordinal, in this process) reach this GPU's `cuMemAlloc` memory at
    /// its own addresses: peer access from the reader's primary context to this one
    /// (`cuCtxEnablePeerAccess`, called in the reader's context). cuMem allocations are granted
    /// by range instead (`mem::grant_range`); `cuMemAlloc` memory knows no grant of its own, and
    /// peer access covers all of this context's, present and future, in one go. NCCL turns it
    /// on for its peers of one process as well. It is never turned off: another communicator,
    /// or the application, may rely on it. Asked of the driver once per pair; a pair the
    /// application enabled already is left as it is. The calling thread ends with this GPU's
    /// context current.
    pub fn let_reach(&self, reader: usize) -> Result<()> {
        static ENABLED: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());
        let pair = (reader, self.0.ordinal);
        if reader == self.0.ordinal {
            return Ok(());
        }
        let mut enabled = ENABLED
            .lock()
            .map_err(|_| Error::Internal("the peer-access list is poisoned".into()))?;
        if enabled.contains(&pair) {
            return Ok(());
        }
        // Opening and asking bind the reader's context: this one is bound again whatever they
        // answer.
        let asked = (|| {
            let r = Gpu::open(reader)?;
            if !r.peer_link(self.0.ordinal)?.access {
                return Err(Error::System(format!(
                    "GPU {reader} cannot reach GPU {}'s memory peer to peer",
                    self.0.ordinal
                )));
            }
            r.bind()?;
            // SAFETY: this GPU's retained primary context, from the reader's, made current above.
            match unsafe { sys::cuCtxEnablePeerAccess(self.0.ctx, 0) } {
                sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
                s => cu_ok("cuCtxEnablePeerAccess", s),
            }
        })();
        self.bind()?;
        asked?;
        enabled.push(pair);
        Ok(())
    }

    /// Waits for all work on this GPU's context.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        cu_ok("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Loads a cubin or PTX image (as `nvrtc::compile` returns it) into this GPU's context, or
    /// shares the module of the same image loaded there already in this process (`modules.rs`:
    /// a load and an unload wait for every kernel of the context).
    pub fn load_module(&self, image: &[u8]) -> Result<Module> {
        let loaded = LOADED.get_or_load(self.0.ctx as usize, image, || self.load_new(image))?;
        Ok(Module {
            gpu: self.clone(),
            loaded,
        })
    }

    fn load_new(&self, image: &[u8]) -> Result<Loaded> {
        self.bind()?;
        // PTX is text the driver reads up to its NUL; a cubin is an ELF image with its own
        // length, and must not be touched.
        let data: std::borrow::Cow<[u8]> =
            if !image.starts_with(b"\x7fELF") && image.last() != Some(&0) {
                let mut v = image.to_vec();
                v.push(0);
                v.into()
            } else {
                image.into()
            };
        let mut module = std::ptr::null_mut();
        cu_ok("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, data.as_ptr().cast())
        })?;
        Ok(Loaded {
            gpu: self.clone(),
            module,
        })
    }
}

impl Drop for GpuInner {
    fn drop(&mut self) {
        let s = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        if s != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!("cuDevicePrimaryCtxRelease failed: {}", super::describe(s));
        }
    }
}

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = MaybeUninit::uninit();
    cu_ok("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(v.as_mut_ptr(), attr, dev)
    })?;
    Ok(unsafe { v.assume_init() })
}

/// Code loaded on one GPU; unloaded when the last `Module` of its image there is dropped.
pub struct Module {
    gpu: Gpu,
    loaded: Arc<Loaded>,
}

/// A module as the driver loaded it, shared by the `Module`s of its image in its context.
struct Loaded {
    gpu: Gpu,
    module: sys::CUmodule,
}

// SAFETY: module handles are context-wide, not thread-bound.
unsafe impl Send for Loaded {}
unsafe impl Sync for Loaded {}

/// This process's modules, by context and image.
static LOADED: super::modules::Shared<Loaded> = super::modules::Shared::new();

impl Module {
    /// The GPU it is loaded on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// An `extern "C"` kernel of this module.
    pub fn kernel(&self, name: &str) -> Result<Kernel<'_>> {
        let cname = std::ffi::CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("kernel name {name:?}")))?;
        let mut f = std::ptr::null_mut();
        cu_ok(&format!("cuModuleGetFunction({name})"), unsafe {
            sys::cuModuleGetFunction(&mut f, self.loaded.module, cname.as_ptr())
        })?;
        Ok(Kernel { f, module: self })
    }

    /// The kernel of a handle taken from `kernel` earlier: no driver lookup, for launch paths.
    pub fn kernel_at(&self, h: KernelHandle) -> Kernel<'_> {
        Kernel {
            f: h.0,
            module: self,
        }
    }
}

/// A kernel's function handle, kept so that launches skip `cuModuleGetFunction`; valid with the
/// module it came from.
#[derive(Clone, Copy, Debug)]
pub struct KernelHandle(sys::CUfunction);

// SAFETY: a CUfunction is a context-wide handle, usable from any thread with the context bound.
unsafe impl Send for KernelHandle {}
unsafe impl Sync for KernelHandle {}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        let s = unsafe { sys::cuModuleUnload(self.module) };
        if s != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!("cuModuleUnload failed: {}", super::describe(s));
        }
    }
}

/// A kernel, valid while its module is loaded.
pub struct Kernel<'m> {
    f: sys::CUfunction,
    module: &'m Module,
}

/// Launch geometry.
#[derive(Debug, Clone, Copy)]
pub struct LaunchDims {
    /// Thread blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
    /// May start while the kernel ahead of it in the stream finishes (programmatic dependent
    /// launch, compute capability 9.0 and up): its launch is then hidden behind that kernel.
    /// The kernel must execute `griddepcontrol.wait` before it touches global memory.
    pub overlap_prior: bool,
}

impl Kernel<'_> {
    /// Loads the kernel now rather than at its first launch. CUDA loads kernels lazily by
    /// default (`CUDA_MODULE_LOADING=LAZY`), and a lazy load may wait for the whole context: for
    /// a kernel of another communicator on this GPU (another rank of this process, another
    /// process group of a framework) that spins until this one is launched, a deadlock that
    /// lasts until that kernel's deadline. Drivers before CUDA 12.4 have no `cuFuncLoad`; they
    /// load eagerly unless told otherwise, and are left alone.
    pub fn load(&self) -> Result<()> {
        let mut v = 0;
        // SAFETY: an out pointer.
        cu_ok("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut v)
        })?;
        if v < 12040 {
            return Ok(());
        }
        // SAFETY: a function of a loaded module.
        cu_ok("cuFuncLoad", unsafe { sys::cuFuncLoad(self.f) })
    }

    /// A handle to launch it again without a lookup ([`Module::kernel_at`]).
    pub fn handle(&self) -> KernelHandle {
        KernelHandle(self.f)
    }

    /// How many blocks of `threads` threads the whole GPU keeps resident at once: a launch whose
    /// blocks wait for each other (through peers) must not be larger.
    pub fn resident_blocks(&self, threads: u32) -> Result<u32> {
        self.module.gpu.bind()?;
        let mut per_sm = 0i32;
        cu_ok("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, self.f, threads as i32, 0)
        })?;
        let sms = self
            .module
            .gpu
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok((per_sm.max(0) as u32).saturating_mul(sms.max(0) as u32))
    }

    /// Launches on `stream` (null: the context's default stream).
    ///
    /// # Safety
    /// `params` must point to one value per kernel parameter, of the kernel's parameter
    /// types, and every pointer the kernel dereferences must be valid on this GPU.
    pub unsafe fn launch(
        &self,
        dims: LaunchDims,
        stream: sys::CUstream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.module.gpu.bind()?;
        let (g, b) = (dims.grid, dims.block);
        if dims.overlap_prior {
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                // SAFETY: a plain-data union; zero is a valid value of each member.
                value: unsafe { std::mem::zeroed() },
            };
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: g.0,
                gridDimY: g.1,
                gridDimZ: g.2,
                blockDimX: b.0,
                blockDimY: b.1,
                blockDimZ: b.2,
                sharedMemBytes: dims.shared_bytes,
                hStream: stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: the config and its one attribute outlive the call; params as below.
            return cu_ok("cuLaunchKernelEx", unsafe {
                sys::cuLaunchKernelEx(&config, self.f, params.as_mut_ptr(), std::ptr::null_mut())
            });
        }
        cu_ok("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.f,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                dims.shared_bytes,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_count_never_panics() {
        // On CI (no driver) this is Ok(0); on a GPU machine, the number of GPUs.
        let n = gpu_count().expect("gpu_count");
        if !driver_present() {
            assert_eq!(n, 0);
            assert!(init().is_err());
            assert!(Gpu::open(0).is_err());
        }
    }
}
