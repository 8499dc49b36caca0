//! One rank's GPU side: its device, the compiled plan kernel, its connections, its stream,
//! and the launch of plans on that stream.

use super::devplan::{
    encode, DeviceTables, FcError, OpDesc, ZeroCopy, ERR_ABORTED, ERR_LENGTH, ERR_TIMEOUT, WHAT_DATA, WHAT_LENGTH, WHAT_POST,
    WHAT_ROOM,
};
use super::window::Windows;
use super::device::{Gpu, KernelHandle, LaunchDims, Module};
use super::fabric::Fabric;
use super::mem::{DeviceBuffer, MemStats};
use super::{check, gpucheck, kernels};
use crate::bootstrap::Bootstrap;
use cudarc::driver::sys;
use ferroccl_core::plan::zcopy::RemoteDsts;
use ferroccl_core::plan::Plan;
use ferroccl_core::{Config, Error};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// Threads per block of the plan kernel: one block per lane.
const BLOCK_THREADS: u32 = kernels::PLAN_EXEC_DEFAULT_THREADS;

pub(crate) struct CudaRank {
    pub gpu: Gpu,
    module: Module,
    pub stats: Arc<MemStats>,
    fabric: Fabric,
    stream: sys::CUstream,
    /// Encoded plans on the GPU, by operation key.
    tables: Mutex<HashMap<Vec<u64>, Tables>>,
    /// A caller's stream, when set (else `stream`).
    user_stream: AtomicPtr<std::ffi::c_void>,
    /// FcError record, then the abort word.
    status: Arc<DeviceBuffer>,
    timeout_ns: u64,
    rank: usize,
    /// Thread blocks (one per lane) of the latest launch, for tools that report how many SMs
    /// an operation occupied.
    last_blocks: AtomicU32,
    /// Blocks of the plan kernel the GPU holds at once: the most lanes one launch may have.
    resident: u32,
    /// The plan kernel of `module`.
    plan_fn: KernelHandle,
    /// The verifiable mode's kernels, loaded on first use (gpucheck.rs).
    pub(crate) check: gpucheck::CheckSlot,
    /// Registered windows (zero-copy).
    windows: Mutex<Windows>,
}

/// What `launch` builds for an operation seen for the first time: the plan, its operations, and
/// with zero-copy on, where each message may land in its receiver's output.
pub(crate) type Built = (Plan, Vec<OpDesc>, Option<RemoteDsts>);

// SAFETY: the stream handle is only used with the context bound and through the driver,
// which is thread-safe; the tables are behind a mutex.
unsafe impl Send for CudaRank {}
unsafe impl Sync for CudaRank {}

const ABORT_OFF: usize = 64;

/// Distinct operations whose tables stay on the GPU (a training loop has a handful).
const TABLE_CACHE: usize = 256;

/// One encoded plan on the GPU and the launch parameter that points at it.
struct Tables {
    param: super::devplan::FcLaunch,
    nlanes: u32,
    _buf: DeviceBuffer,
}

impl CudaRank {
    pub fn new(ordinal: usize, boot: &Bootstrap, config: &Config, abort: &AtomicBool) -> Result<CudaRank, Error> {
        let gpu = Gpu::open(ordinal)?;
        let image = kernels::compile_for(&gpu, "plan_exec.cu", &kernels::plan_exec_source())?;
        let module = gpu.load_module(&image.bytes)?;
        let plan_fn = module.kernel(kernels::PLAN_EXEC_KERNEL)?;
        let resident = plan_fn.resident_blocks(BLOCK_THREADS)?;
        let plan_fn = plan_fn.handle();
        let stats = MemStats::new();
        let fabric = Fabric::new(&gpu, boot, config, &stats, abort)?;
        let status = Arc::new(DeviceBuffer::alloc(&gpu, 128, &[], &stats)?);
        status.copy_from_host(0, &[0u8; 128])?;
        let mut stream = std::ptr::null_mut();
        gpu.bind()?;
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) })?;
        Ok(CudaRank {
            gpu,
            module,
            stats,
            fabric,
            stream,
            tables: Mutex::new(HashMap::new()),
            user_stream: AtomicPtr::new(std::ptr::null_mut()),
            status,
            timeout_ns: config.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: boot.rank(),
            last_blocks: AtomicU32::new(0),
            resident,
            plan_fn,
            check: gpucheck::CheckSlot::new(),
            windows: Mutex::new(Windows::default()),
        })
    }

    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Enqueues an operation on the stream (the communicator's, or the one set with
    /// `set_stream`) and returns. `key` identifies the operation and its buffers: the tables of
    /// a key seen before are already on the GPU, so a repeated call is one kernel launch (no
    /// host-device copy, nothing synchronous: legal inside CUDA graph capture). `build` makes
    /// the plan for a key seen for the first time.
    pub fn launch(&self, mut key: Vec<u64>, build: impl FnOnce(bool) -> Result<Built, Error>) -> Result<(), Error> {
        let stream = self.current_stream();
        let windows = self.windows.lock().map_err(|_| Error::Internal("windows lock poisoned".into()))?;
        // Tables encoded under another set of windows post other addresses.
        key.push(windows.epoch());
        let mut cache = self.tables.lock().map_err(|_| Error::Internal("GPU tables lock poisoned".into()))?;
        if !cache.contains_key(&key) {
            if cache.len() >= TABLE_CACHE {
                // Tables in use by queued kernels must outlive them: drain before freeing.
                self.gpu.bind()?;
                check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) })?;
                cache.clear();
            }
            let (plan, ops, remote) = build(!windows.is_empty())?;
            let entry = self.upload(&plan, &ops, remote.as_ref(), &windows)?;
            cache.insert(key.clone(), entry);
        }
        let entry = cache.get(&key).expect("present");
        self.last_blocks.store(entry.nlanes, Ordering::Relaxed);
        if entry.nlanes == 0 {
            return Ok(());
        }
        check_residency(entry.nlanes, self.resident)?;
        let mut param = entry.param;
        let kernel = self.module.kernel_at(self.plan_fn);
        let dims = LaunchDims { grid: (entry.nlanes, 1, 1), block: (BLOCK_THREADS, 1, 1), shared_bytes: 0 };
        let mut params = [&mut param as *mut _ as *mut std::ffi::c_void];
        // SAFETY: the kernel takes one FcLaunch by value; every address in it is device memory
        // of this GPU or mapped for it, valid while the cache entry (tables) and the
        // communicator (connections, status) live.
        unsafe { kernel.launch(dims, stream, &mut params) }
    }

    /// Encodes a plan and puts its tables on the GPU.
    fn upload(&self, plan: &Plan, ops: &[OpDesc], remote: Option<&RemoteDsts>, windows: &Windows) -> Result<Tables, Error> {
        let geo = self.fabric.geo;
        let post = |op: usize, peer: usize| -> (u64, u64) {
            let o = &ops[op];
            let bytes = (o.recv_count * o.dtype.size()) as u64;
            let addr = if o.may_post { windows.view(o.recv, bytes, peer).unwrap_or(0) } else { 0 };
            (addr, bytes)
        };
        let zc = remote.filter(|_| !windows.is_empty()).map(|remote| ZeroCopy { remote, post: &post });
        let enc = encode(plan, ops, |k| geo.conn_index(k), zc.as_ref())?;
        let as_bytes = |p: *const u8, n: usize| unsafe { std::slice::from_raw_parts(p, n) };
        let parts = [
            as_bytes(enc.steps.as_ptr() as *const u8, std::mem::size_of_val(&enc.steps[..])),
            as_bytes(enc.lanes.as_ptr() as *const u8, std::mem::size_of_val(&enc.lanes[..])),
            as_bytes(enc.ops.as_ptr() as *const u8, std::mem::size_of_val(&enc.ops[..])),
        ];
        let mut offs = [0usize; 3];
        let mut total = 0;
        for (i, p) in parts.iter().enumerate() {
            offs[i] = total;
            total = (total + p.len()).div_ceil(64) * 64;
        }
        let mut blob = vec![0u8; total.max(64)];
        for (i, p) in parts.iter().enumerate() {
            blob[offs[i]..offs[i] + p.len()].copy_from_slice(p);
        }
        let buf = DeviceBuffer::alloc(&self.gpu, blob.len(), &[], &self.stats)?;
        buf.copy_from_host(0, &blob)?;
        let base = buf.device_ptr();
        let at = DeviceTables {
            steps: base + offs[0] as u64,
            lanes: base + offs[1] as u64,
            ops: base + offs[2] as u64,
            conns: self.fabric.table.device_ptr(),
            nconns: self.fabric.nconns,
            abort: self.status.device_ptr() + ABORT_OFF as u64,
            error: self.status.device_ptr(),
            timeout_ns: self.timeout_ns,
        };
        Ok(Tables { param: enc.launch(&at), nlanes: enc.lanes.len() as u32, _buf: buf })
    }

    /// Makes later operations go to `stream` (null: back to the communicator's own).
    pub fn set_stream(&self, stream: sys::CUstream) {
        self.user_stream.store(stream as *mut std::ffi::c_void, Ordering::Release);
    }

    pub(crate) fn current_stream(&self) -> sys::CUstream {
        let s = self.user_stream.load(Ordering::Acquire);
        if s.is_null() { self.stream } else { s as sys::CUstream }
    }

    /// Raises the abort word that every waiting block polls, so that kernels stuck on a dead
    /// or aborted peer leave and release the stream.
    pub fn abort(&self) {
        raise_abort_word(&self.status);
    }

    /// What raises the abort word from another thread (the heartbeat watcher, when it learns
    /// of a peer's death), valid for as long as it is kept: it holds the word's memory.
    pub fn abort_handle(&self) -> impl Fn() + Send + Sync + 'static {
        let status = self.status.clone();
        move || raise_abort_word(&status)
    }

    /// Waits for everything enqueued, then reports a failure the kernel recorded. While it
    /// waits it watches `failure` (a peer's death or abort, as the heartbeats report it): the
    /// kernels of this rank may be spinning on that peer, so the abort word is raised and they
    /// leave at once instead of at their deadline; the peer's failure is then the error.
    pub fn synchronize(&self, failure: impl Fn() -> Option<Error>) -> Result<(), Error> {
        self.gpu.bind()?;
        let stream = self.current_stream();
        let query = || match unsafe { sys::cuStreamQuery(stream) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuStreamQuery", other).map(|_| true),
        };
        let cause = poll_until_done(query, &failure, || self.abort())?;
        let mut rec = [0u8; std::mem::size_of::<FcError>()];
        self.status.copy_to_host(0, &mut rec)?;
        // SAFETY: FcError is plain old data of exactly this size.
        let e: FcError = unsafe { std::ptr::read_unaligned(rec.as_ptr() as *const FcError) };
        // The kernels may have left because of a failure seen while nobody polled here (the
        // heartbeat watcher raised the word while the caller waited on the stream itself).
        let cause = cause.or_else(|| if e.code == ERR_ABORTED { failure() } else { None });
        if let Some(cause) = cause {
            return Err(cause);
        }
        if e.code == 0 {
            return Ok(());
        }
        let what = match e.what {
            WHAT_DATA => "data from",
            WHAT_ROOM => "room in the connection to",
            WHAT_LENGTH => "a length check on data from",
            WHAT_POST => "the output address (zero-copy post) of",
            _ => "a consistent plan with",
        };
        let msg = format!(
            "GPU {} rank {}: lane {} step {} waiting for {what} rank {} (connection {}): expected {} got {}",
            self.gpu.ordinal(),
            self.rank,
            e.lane,
            e.step,
            e.peer,
            e.conn,
            e.expected,
            e.got
        );
        Err(match e.code {
            ERR_ABORTED => Error::Aborted(msg),
            ERR_TIMEOUT => Error::Timeout(msg),
            ERR_LENGTH => Error::Protocol(msg),
            _ => Error::Internal(msg),
        })
    }

    /// Thread blocks of the latest launch (0 before the first, or when it had no lanes).
    pub fn last_blocks(&self) -> u32 {
        self.last_blocks.load(Ordering::Relaxed)
    }

    /// Registers a window with every rank (collective; see window.rs). Holds the windows lock,
    /// which every launch takes too, so no launch of this rank sees half a registration.
    pub fn register(&self, boot: &Bootstrap, ptr: u64, len: usize, abort: &AtomicBool, deadline: std::time::Instant) -> Result<(), Error> {
        let mut w = self.windows.lock().map_err(|_| Error::Internal("windows lock poisoned".into()))?;
        w.register(&self.gpu, boot, ptr, len, &self.stats, abort, deadline)
    }

    /// Forgets the window at `ptr` (collective), after the queued work that may use it.
    pub fn deregister(&self, boot: &Bootstrap, ptr: u64) -> Result<(), Error> {
        let mut w = self.windows.lock().map_err(|_| Error::Internal("windows lock poisoned".into()))?;
        self.gpu.bind()?;
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.current_stream()) })?;
        w.deregister(boot, ptr)
    }

    pub fn memory_bytes(&self) -> u64 {
        self.stats.allocated_bytes() + self.stats.imported_bytes()
    }
}

fn raise_abort_word(status: &DeviceBuffer) {
    // The copy is synchronous on the legacy stream, which our non-blocking streams do not wait
    // for, so it lands while the kernel still runs.
    let _ = status.copy_from_host(ABORT_OFF, &1u32.to_le_bytes());
}

/// Polls `ready` until the stream is idle: spinning first (short operations finish within
/// microseconds), then sleeping in short steps. The first time `failure` reports something,
/// `raise` is called (once) and the failure is returned when the stream is idle.
fn poll_until_done(
    mut ready: impl FnMut() -> Result<bool, Error>,
    failure: impl Fn() -> Option<Error>,
    mut raise: impl FnMut(),
) -> Result<Option<Error>, Error> {
    const SPINS: u32 = 2000;
    let mut seen: Option<Error> = None;
    let mut polls = 0u32;
    while !ready()? {
        if seen.is_none() {
            if let Some(e) = failure() {
                raise();
                seen = Some(e);
            }
        }
        polls = polls.saturating_add(1);
        if polls < SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }
    Ok(seen)
}

/// Every lane of a launch may wait on a peer that waits on another lane of ours, so all of them
/// must run at once: a launch the GPU cannot hold whole would hang, and is refused instead.
fn check_residency(lanes: u32, resident: u32) -> Result<(), Error> {
    if lanes > resident {
        return Err(Error::InvalidArgument(format!(
            "this launch needs {lanes} thread blocks at once but the GPU holds {resident}: \
             lower FERROCCL_GPU_CHANNELS, or split the group"
        )));
    }
    Ok(())
}

impl Drop for CudaRank {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        unsafe {
            sys::cuStreamSynchronize(self.stream);
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_failure_seen_while_waiting_raises_the_abort_word_once() {
        use std::cell::Cell;
        // Idle after 3 polls, nothing failed.
        let n = Cell::new(0);
        let raised = Cell::new(0);
        let r = poll_until_done(|| Ok({ n.set(n.get() + 1); n.get() > 3 }), || None, || raised.set(raised.get() + 1));
        assert!(matches!(r, Ok(None)));
        assert_eq!(raised.get(), 0);
        // A death is reported at poll 5; the kernel leaves 10 polls after the word is raised.
        let n = Cell::new(0);
        let at = Cell::new(None::<u32>);
        let r = poll_until_done(
            || Ok({ n.set(n.get() + 1); at.get().is_some_and(|a| n.get() >= a + 10) }),
            || (n.get() >= 5).then(|| Error::Remote("rank 1 died".into())),
            || { raised.set(raised.get() + 1); at.set(Some(n.get())) },
        );
        assert_eq!(raised.get(), 1, "raised once");
        assert!(matches!(r, Ok(Some(Error::Remote(ref m))) if m.contains("rank 1 died")), "{r:?}");
        // A driver error ends the wait as an error.
        let r = poll_until_done(|| Err(Error::System("cuStreamQuery: CUDA_ERROR_LAUNCH_FAILED".into())), || None, || {});
        assert!(matches!(r, Err(Error::System(_))));
    }

    #[test]
    fn a_launch_larger_than_the_gpu_holds_is_refused_with_the_knob() {
        assert!(check_residency(132, 132).is_ok());
        let e = check_residency(133, 132).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(e.to_string().contains("133 thread blocks") && e.to_string().contains("FERROCCL_GPU_CHANNELS"), "{e}");
    }
}
