//! The few CUDA driver calls the benchmark makes itself: stream waits, filling raw device
//! pointers (NCCL's buffers are not ferroccl `DeviceBuffer`s), free-memory readings, and CUDA
//! graphs (capture, instantiate, replay, and reading the grid of captured kernels).

use crate::api::Error;
use cudarc::driver::sys;
use ferroccl::cuda::cu_ok;
use ferroccl::mem::Gpu;
use std::ffi::c_void;

pub type Stream = *mut c_void;

fn cu(s: Stream) -> sys::CUstream {
    s as sys::CUstream
}

/// Waits for everything queued on `stream`. Both libraries are timed up to this call, so that
/// neither pays for the other's way of reporting errors.
pub fn stream_sync(gpu: &Gpu, stream: Stream) -> Result<(), Error> {
    gpu.bind()?;
    cu_ok("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(cu(stream))
    })
}

/// (free, total) bytes of the GPU's memory, as the driver sees it now.
pub fn mem_info(gpu: &Gpu) -> Result<(u64, u64), Error> {
    gpu.bind()?;
    let (mut free, mut total) = (0usize, 0usize);
    cu_ok("cuMemGetInfo", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// The CUDA version of the driver ("13.0"), or None without a driver.
pub fn driver_cuda_version() -> Option<String> {
    ferroccl::cuda::device::init().ok()?;
    let mut v = 0;
    (unsafe { sys::cuDriverGetVersion(&mut v) } == sys::CUresult::CUDA_SUCCESS)
        .then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// Starts capturing `stream` into a graph. Thread-local mode: other threads (other ranks of
/// this process, NCCL's helpers) may keep making calls that are illegal during a global
/// capture.
pub fn begin_capture(gpu: &Gpu, stream: Stream) -> Result<(), Error> {
    gpu.bind()?;
    cu_ok("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(
            cu(stream),
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
    })
}

/// Ends a capture. Called on error paths too, so that the stream is usable again.
pub fn end_capture(gpu: &Gpu, stream: Stream) -> Result<Captured, Error> {
    gpu.bind()?;
    let mut g: sys::CUgraph = std::ptr::null_mut();
    cu_ok("cuStreamEndCapture", unsafe {
        sys::cuStreamEndCapture(cu(stream), &mut g)
    })?;
    Ok(Captured {
        gpu: gpu.clone(),
        graph: g,
    })
}

/// A captured, not yet instantiated graph.
pub struct Captured {
    gpu: Gpu,
    graph: sys::CUgraph,
}

// SAFETY: graph handles are not bound to a thread; every use binds the context first.
unsafe impl Send for Captured {}

impl Captured {
    /// The grid size (thread blocks) of every kernel in the graph, in node order. This is
    /// what a library really launched: for NCCL, one block per channel it chose.
    pub fn kernel_grids(&self) -> Result<Vec<u32>, Error> {
        self.gpu.bind()?;
        let mut n = 0usize;
        cu_ok("cuGraphGetNodes", unsafe {
            sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut n)
        })?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        if n > 0 {
            cu_ok("cuGraphGetNodes", unsafe {
                sys::cuGraphGetNodes(self.graph, nodes.as_mut_ptr(), &mut n)
            })?;
        }
        let mut grids = Vec::new();
        for &node in nodes.iter().take(n) {
            let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            cu_ok("cuGraphNodeGetType", unsafe {
                sys::cuGraphNodeGetType(node, &mut t)
            })?;
            if t != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
                continue;
            }
            let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
            cu_ok("cuGraphKernelNodeGetParams", unsafe {
                sys::cuGraphKernelNodeGetParams_v2(node, &mut p)
            })?;
            grids.push(p.gridDimX * p.gridDimY * p.gridDimZ);
        }
        Ok(grids)
    }

    pub fn instantiate(self) -> Result<Graph, Error> {
        self.gpu.bind()?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        cu_ok("cuGraphInstantiate", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, self.graph, 0)
        })?;
        Ok(Graph {
            exec,
            _captured: self,
        })
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        unsafe { sys::cuGraphDestroy(self.graph) };
    }
}

/// An instantiated graph, ready to replay.
pub struct Graph {
    exec: sys::CUgraphExec,
    _captured: Captured,
}

// SAFETY: as for Captured.
unsafe impl Send for Graph {}

impl Graph {
    pub fn launch(&self, stream: Stream) -> Result<(), Error> {
        self._captured.gpu.bind()?;
        cu_ok("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, cu(stream))
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self._captured.gpu.bind();
        unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}

/// Sets `len` bytes at `dst` to `byte` (synchronous with respect to the host).
/// GPU memory from `cuMemAlloc` (`--buffers driver`: what `cudaMalloc` and PyTorch's default
/// allocator give), freed on drop.
pub struct DriverAlloc {
    gpu: Gpu,
    ptr: u64,
}

impl DriverAlloc {
    /// `bytes` (at least 1) on `gpu`.
    pub fn new(gpu: &Gpu, bytes: usize) -> Result<DriverAlloc, Error> {
        gpu.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        cu_ok(&format!("cuMemAlloc({bytes} bytes)"), unsafe {
            sys::cuMemAlloc_v2(&mut ptr, bytes.max(1))
        })?;
        Ok(DriverAlloc {
            gpu: gpu.clone(),
            ptr,
        })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DriverAlloc {
    fn drop(&mut self) {
        let freed = self
            .gpu
            .bind()
            .and_then(|_| cu_ok("cuMemFree", unsafe { sys::cuMemFree_v2(self.ptr) }));
        if let Err(e) = freed {
            eprintln!("# freeing a cuMemAlloc buffer: {e}");
        }
    }
}

pub fn memset(gpu: &Gpu, dst: u64, byte: u8, len: usize) -> Result<(), Error> {
    if len == 0 {
        return Ok(());
    }
    gpu.bind()?;
    cu_ok("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(dst, byte, len) })?;
    cu_ok("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}
