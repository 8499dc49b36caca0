//! One rank's GPU side: its device, the compiled plan kernel, its connections (the fabric), its
//! stream, its abort word and error record, and waiting for and aborting what it enqueued.

use super::copy_engine::CopyEngine;
use super::fabric::{Fabric, Geometry};
use super::kernels;
use super::launch::{Exchanged, PlanCache, StreamOrder};
use super::lazy::{LazyMaps, Live, Sweeper};
use super::mapper::Mapper;
use super::tables::{
    FcDirect, FcError, FcP2pHead, FcPeer, ERR_ABORTED, ERR_LENGTH, ERR_TIMEOUT, WHAT_DATA,
    WHAT_LENGTH, WHAT_POST, WHAT_ROOM, WHAT_SENT,
};
use super::window::Windows;
use crate::bootstrap::Bootstrap;
use crate::cuda::cu_ok;
use crate::cuda::device::{Gpu, KernelHandle, Module};
use crate::cuda::mem::{DeviceBuffer, Identity, MemStats};
use crate::cuda::nvrtc::Image;
use crate::cuda::pinned::MappedWord;
use crate::info::CommInfo;
use crate::ops::OpArgs;
use cudarc::driver::sys;
use ferroccl_core::plan::copies::{Posted, RecvPost};
use ferroccl_core::tune::Device;
use ferroccl_core::{CollKind, Config, DataType, Error, Rank};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// Threads per block of the plan kernel: one block per lane.
pub(super) const BLOCK_THREADS: u32 = kernels::PLAN_EXEC_DEFAULT_THREADS;

pub(crate) struct CudaComm {
    pub gpu: Gpu,
    pub(super) module: Module,
    pub stats: Arc<MemStats>,
    /// The copy engine (None: no staging, or FERROCCL_GPU_COPY_ENGINE_BYTES=0). Before the
    /// fabric: dropped first, so that its streams drain before the staging goes.
    pub(super) ce: Option<Arc<CopyEngine>>,
    pub(super) fabric: Fabric,
    stream: sys::CUstream,
    /// Plan tables on the GPU, by operation shape.
    pub(super) plans: Mutex<PlanCache>,
    /// A caller's stream, when set (else `stream`).
    user_stream: AtomicPtr<std::ffi::c_void>,
    /// The kernels' error record and abort word.
    pub(super) status: Arc<Status>,
    pub(super) timeout_ns: u64,
    rank: usize,
    /// Thread blocks (one per lane) of the latest launch, for tools that report how many SMs
    /// an operation occupied.
    pub(super) last_blocks: AtomicU32,
    /// The latest launch outside a capture, which the next one on another stream and any
    /// eviction of tables wait for (`launch.rs`).
    pub(super) order: Mutex<StreamOrder>,
    /// Blocks of the plan kernel the GPU holds at once: the most lanes one launch may have.
    pub(super) resident: u32,
    /// The plan kernel of `module`.
    pub(super) plan_fn: KernelHandle,
    /// The direct engine's module and kernels, and its parameter with this communicator's
    /// slots, acks, epochs and status words (None beyond the ranks it serves).
    pub(super) direct: Option<(Module, TypedKernels, FcDirect)>,
    /// The peer engine's module and kernels, and its parameter with this communicator's
    /// staging, flags, counters and status words (None: off).
    pub(super) peer: Option<(Vec<Module>, TypedKernels, FcPeer)>,
    /// The fold kernels of copy-and-fold reductions, in the peer engine's module (None with it).
    pub(super) fold: Option<TypedKernels>,
    /// The plan kernel's point-to-point form (in `module`): its small and wide kernels, and the
    /// part of their parameter this communicator fills once (None: FERROCCL_GPU_P2P_KERNEL=0).
    pub(super) p2p: Option<(KernelHandle, KernelHandle, FcP2pHead)>,
    /// Registered windows and local registrations (zero-copy).
    pub(super) windows: Mutex<Windows>,
    /// Outputs nobody registered, lent on the fly to the peers that write them (`lazy.rs`), and
    /// the thread that gives back those whose allocation was freed (None where the ranks do not
    /// post, `Fabric::ranks_post`, or FERROCCL_GPU_CE_MAP_UNREGISTERED=0).
    lazy: Arc<Mutex<LazyMaps<Identity>>>,
    _sweeper: Option<Sweeper>,
    /// Maps what peers of other processes register locally (None: every peer is in this
    /// process). Dropped before the fabric: its mappings are the peers' buffers.
    mapper: Option<Mapper>,
    comm_id: u64,
    /// Whether the engines' kernels are launched to start early, behind the kernel ahead of
    /// them (FERROCCL_GPU_EARLY_LAUNCH, on GPUs that can: compute capability 9.0 and up).
    pub(super) overlap_prior: bool,
}

/// An engine's kernels (direct, peer), by NCCL's type number, in each of the engine's shapes
/// (`kernels::Shape`): a launch takes the narrowest instance that serves its operation, which
/// holds less code (a launch fetches less of it) and folds without choosing the reduction per
/// element (docs/PERFORMANCE.md, section 12).
pub(super) struct TypedKernels {
    /// Narrowest first, as `kernels::DIRECT_SHAPES` and `PEER_SHAPES` list them.
    by_shape: Vec<(kernels::Shape, [KernelHandle; DataType::ALL.len()])>,
}

/// The module of `m` holding `t`'s kernels: the one module, or `t`'s part where the engine's
/// module comes in parts (`kernels::peer_part`).
fn module_of(m: &[Module], t: DataType) -> &Module {
    match m {
        [one] => one,
        parts => &parts[kernels::peer_part(t)],
    }
}

impl TypedKernels {
    /// `stem`'s kernels (`kernels::typed_kernel`) in `shapes`, loaded, each from its module
    /// (`module_of`).
    fn load(m: &[Module], stem: &str, shapes: &[kernels::Shape]) -> Result<TypedKernels, Error> {
        let load = |shape| -> Result<[KernelHandle; DataType::ALL.len()], Error> {
            let mut f = [None; DataType::ALL.len()];
            for t in DataType::ALL {
                let k = module_of(m, t).kernel(&kernels::typed_kernel(stem, t, shape))?;
                k.load()?;
                f[t.nccl_id() as usize] = Some(k.handle());
            }
            Ok(f.map(|h| h.expect("DataType::ALL holds every NCCL type number once")))
        };
        Ok(TypedKernels {
            by_shape: shapes
                .iter()
                .map(|&s| Ok((s, load(s)?)))
                .collect::<Result<_, Error>>()?,
        })
    }

    /// The kernel for `a`, in its module of `m` (the modules these kernels were loaded from).
    pub(super) fn kernel<'m>(
        &self,
        m: &'m [Module],
        a: &crate::ops::OpArgs,
    ) -> Result<crate::cuda::device::Kernel<'m>, Error> {
        Ok(module_of(m, a.dtype).kernel_at(self.pick(a)?))
    }

    /// The kernel for `a`.
    pub(super) fn pick(&self, a: &crate::ops::OpArgs) -> Result<KernelHandle, Error> {
        let t = a.dtype.nccl_id() as usize;
        self.by_shape
            .iter()
            .find(|(s, _)| s.serves(a.kind, a.op))
            .map(|(_, f)| f[t])
            .ok_or_else(|| {
                Error::Internal(format!(
                    "no engine kernel serves {} with {:?}",
                    a.kind, a.op
                ))
            })
    }
}

// SAFETY: the stream handle is only used with the context bound and through the driver,
// which is thread-safe; the tables are behind a mutex.
unsafe impl Send for CudaComm {}
unsafe impl Sync for CudaComm {}

/// What the kernels of a communicator report through (the first failure's record, in device
/// memory) and are told through (the abort word, in pinned host memory: raising it is a CPU
/// store, which no full launch queue can hold up, where a copy to the GPU would wait behind
/// the very kernels it must free).
/// The record comes first in a device allocation that also holds the fabric's connection table
/// (`Status::table_ptr`): GPU memory comes in 2 MiB granules, which one small allocation each
/// would spend twice on a few kilobytes.
pub(crate) struct Status {
    local: DeviceBuffer,
    table_bytes: usize,
    abort: MappedWord,
}

/// Where the connection table starts in the status allocation (past the record and the
/// counters, aligned for the kernels' loads).
const TABLE_OFF: usize = 256;
/// The peer engine's count of direct rounds received (`FcPeer::stats`), past the record.
const DIRECT_ROUNDS_OFF: usize = 128;
const _: () = assert!(
    std::mem::size_of::<FcError>() <= DIRECT_ROUNDS_OFF && DIRECT_ROUNDS_OFF + 8 <= TABLE_OFF
);

impl Status {
    /// The record, cleared, and room for a connection table of `table_bytes`.
    fn new(gpu: &Gpu, stats: &Arc<MemStats>, table_bytes: usize) -> Result<Status, Error> {
        let local = DeviceBuffer::alloc(gpu, TABLE_OFF + table_bytes, &[], stats)?;
        local.copy_from_host(0, &[0u8; TABLE_OFF])?;
        Ok(Status {
            local,
            table_bytes,
            abort: MappedWord::new(gpu)?,
        })
    }
    pub(super) fn error_ptr(&self) -> u64 {
        self.local.device_ptr()
    }
    /// The connection table's place (`Fabric::new` writes it).
    pub(super) fn table_ptr(&self) -> u64 {
        self.local.device_ptr() + TABLE_OFF as u64
    }
    /// Writes the connection table, which must fit the room made for it.
    pub(super) fn write_table(&self, bytes: &[u8]) -> Result<(), Error> {
        if bytes.len() > self.table_bytes {
            return Err(Error::Internal(format!(
                "a connection table of {} bytes where {} were made",
                bytes.len(),
                self.table_bytes
            )));
        }
        self.local.copy_from_host(TABLE_OFF, bytes)
    }
    /// The peer engine's direct-round counter (`FcPeer::stats`).
    pub(super) fn direct_rounds_ptr(&self) -> u64 {
        self.local.device_ptr() + DIRECT_ROUNDS_OFF as u64
    }
    fn direct_rounds(&self) -> Result<u64, Error> {
        let mut b = [0u8; 8];
        self.local.copy_to_host(DIRECT_ROUNDS_OFF, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    pub(super) fn abort_ptr(&self) -> u64 {
        self.abort.device_ptr()
    }
    fn raise(&self) {
        self.abort.set(1);
    }
    fn read_error(&self) -> Result<FcError, Error> {
        let mut rec = [0u8; std::mem::size_of::<FcError>()];
        self.local.copy_to_host(0, &mut rec)?;
        // SAFETY: FcError is plain old data of exactly this size.
        Ok(unsafe { std::ptr::read_unaligned(rec.as_ptr() as *const FcError) })
    }
}

impl CudaComm {
    pub fn new(
        ordinal: usize,
        boot: &Bootstrap,
        config: &Config,
        abort: &AtomicBool,
    ) -> Result<CudaComm, Error> {
        let gpu = Gpu::open(ordinal)?;
        // The modules this communicator needs, compiled at once (NVRTC is single-threaded): a
        // first start on a machine waits for the longest compile, not their sum; later starts
        // find them in the disk cache.
        let geo = Geometry::of(config, boot.nranks());
        let (image, peer_images, direct_image) = std::thread::scope(|s| {
            let compile = |name: String, source: fn() -> String, extra: Vec<String>| {
                let gpu = &gpu;
                s.spawn(move || kernels::compile_for(gpu, config, &name, &source(), &extra))
            };
            // The peer engine's module in its parts (kernels::PEER_PARTS), each on its thread.
            let peer: Vec<_> = match geo.has_peer() {
                true => (0..kernels::PEER_PARTS)
                    .map(|part| {
                        let (name, extra) = kernels::peer_part_compile(part);
                        compile(name, kernels::peer_source, extra)
                    })
                    .collect(),
                false => Vec::new(),
            };
            let direct = geo
                .has_direct()
                .then(|| compile("direct.cu".into(), kernels::direct_source, Vec::new()));
            let plan = kernels::compile_for(
                &gpu,
                config,
                "plan_exec.cu",
                &kernels::plan_exec_source(),
                &[],
            );
            let join = |h: std::thread::ScopedJoinHandle<'_, Result<Image, Error>>| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Internal("an NVRTC compile thread panicked".into()))
                })
            };
            let peer: Vec<Result<Image, Error>> = peer.into_iter().map(join).collect();
            (plan, peer, direct.map(join))
        });
        let module = gpu.load_module(&image?.bytes)?;
        let plan_fn = module.kernel(kernels::PLAN_EXEC_KERNEL)?;
        plan_fn.load()?;
        let resident = plan_fn.resident_blocks(BLOCK_THREADS)?;
        let plan_fn = plan_fn.handle();
        let stats = MemStats::new();
        let status = Arc::new(Status::new(&gpu, &stats, geo.conn_table_bytes())?);
        let mut fabric = Fabric::new(&gpu, boot, config, geo, &stats, abort, &status)?;
        let ce_slot = ferroccl_core::tune::ce_slot_bytes(config, boot.nranks());
        let lone_on_caller = fabric.ranks_post();
        let ce = match fabric.ce.take() {
            Some(f) => Some(Arc::new(CopyEngine::new(
                &gpu,
                boot.rank(),
                boot.nranks(),
                ce_slot,
                f,
                lone_on_caller,
            )?)),
            None => None,
        };
        let timeout_ns = config.timeout.as_nanos().min(u64::MAX as u128) as u64;
        let direct = match fabric.direct {
            Some(p) => {
                let image = direct_image.ok_or_else(|| {
                    Error::Internal("the direct engine's module was not compiled".into())
                })??;
                let m = gpu.load_module(&image.bytes)?;
                let f = TypedKernels::load(
                    std::slice::from_ref(&m),
                    kernels::DIRECT_KERNELS,
                    kernels::DIRECT_SHAPES,
                )?;
                let p = FcDirect {
                    abort: status.abort_ptr(),
                    error: status.error_ptr(),
                    timeout_ns,
                    ..p
                };
                Some((m, f, p))
            }
            None => None,
        };
        let mut fold = None;
        let peer = match fabric.peer {
            Some(p) => {
                if peer_images.len() != kernels::PEER_PARTS {
                    return Err(Error::Internal(
                        "the peer engine's module was not compiled".into(),
                    ));
                }
                let m = peer_images
                    .into_iter()
                    .map(|image| gpu.load_module(&image?.bytes))
                    .collect::<Result<Vec<Module>, Error>>()?;
                let f = TypedKernels::load(&m, kernels::PEER_KERNELS, kernels::PEER_SHAPES)?;
                fold = Some(TypedKernels::load(
                    &m,
                    kernels::FOLD_KERNELS,
                    kernels::FOLD_SHAPES,
                )?);
                Some((
                    m,
                    f,
                    FcPeer {
                        abort: status.abort_ptr(),
                        error: status.error_ptr(),
                        stats: status.direct_rounds_ptr(),
                        timeout_ns,
                        ..p
                    },
                ))
            }
            None => None,
        };
        let p2p = match config.gpu_p2p_kernel {
            true => {
                let k = module.kernel(kernels::P2P_KERNEL)?;
                k.load()?;
                let wide = module.kernel(kernels::P2P_WIDE_KERNEL)?;
                wide.load()?;
                let p = FcP2pHead {
                    conns: fabric.table,
                    abort: status.abort_ptr(),
                    error: status.error_ptr(),
                    timeout_ns,
                    rank: boot.rank() as u32,
                    ..Default::default()
                };
                Some((k.handle(), wide.handle(), p))
            }
            false => None,
        };
        let overlap_prior = config.gpu_early_launch && gpu.compute_capability() >= (9, 0);
        let mut stream = std::ptr::null_mut();
        gpu.bind()?;
        cu_ok("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        // No rank launches before every rank has loaded its kernels (the engines' modules load
        // after the fabric's barrier): ranks of one process on one GPU share a context,
        // and a rank still loading a module there waited for a rank already waiting for it in
        // its first operation (three ranks made by `init_rank` in one process's threads hung so
        // at their first operation, with either kernel; session 9).
        let pid = std::process::id();
        let mapper = match fabric.places.iter().any(|p| p.pid != pid) {
            true => Some(Mapper::start(
                &gpu,
                boot.comm_id(),
                boot.rank(),
                fabric.places.clone(),
                &stats,
            )?),
            false => None,
        };
        let lazy = Arc::new(Mutex::new(LazyMaps::default()));
        // Loans on the fly are made wherever ranks post (a peer of this process gets the lent
        // address itself, no mapper), and swept alike.
        let sweeper = match fabric.ranks_post() && config.gpu_ce_map_unregistered {
            true => Some(Sweeper::of_loans(
                lazy.clone(),
                gpu.clone(),
                boot.rank(),
                fabric.places.clone(),
                boot.comm_id(),
            )?),
            false => None,
        };
        boot.barrier()?;
        Ok(CudaComm {
            lazy,
            _sweeper: sweeper,
            mapper,
            comm_id: boot.comm_id(),
            gpu,
            module,
            stats,
            ce,
            fabric,
            stream,
            plans: Mutex::new(PlanCache::default()),
            user_stream: AtomicPtr::new(std::ptr::null_mut()),
            status,
            timeout_ns,
            rank: boot.rank(),
            last_blocks: AtomicU32::new(0),
            order: Mutex::new(StreamOrder::default()),
            resident,
            plan_fn,
            direct,
            peer,
            fold,
            p2p,
            windows: Mutex::new(Windows::default()),
            overlap_prior,
        })
    }

    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Makes later operations go to `stream` (null: back to the communicator's own).
    pub fn set_stream(&self, stream: sys::CUstream) {
        self.user_stream
            .store(stream as *mut std::ffi::c_void, Ordering::Release);
    }

    pub(crate) fn current_stream(&self) -> sys::CUstream {
        let s = self.user_stream.load(Ordering::Acquire);
        if s.is_null() {
            self.stream
        } else {
            s as sys::CUstream
        }
    }

    /// Whether every rank's GPU reaches the others by NVLink and is a Hopper GPU
    /// (`Fabric::carries_lines`, the same on every rank): the peer engine's line rounds count on
    /// a warp's 128-byte store crossing whole, which NVLink gives and PCIe does not promise, and
    /// were measured only there. The communicator turns them off elsewhere.
    pub fn lines_carried(&self) -> bool {
        self.fabric.carries_lines
    }

    /// Raises the abort word that every waiting block polls, so that kernels stuck on a dead
    /// or aborted peer leave and release the stream.
    /// Copy-engine streams stalled on the same peer are freed by a thread that stores into
    /// their words until they drain (`CopyEngine::release`).
    pub fn abort(&self) {
        self.status.raise();
        release_copies(&self.ce);
    }

    /// What raises the abort word from another thread (the heartbeat watcher, when it learns
    /// of a peer's death), valid for as long as it is kept: it holds the word's memory.
    pub fn abort_handle(&self) -> impl Fn() + Send + Sync + 'static {
        let status = self.status.clone();
        let ce = self.ce.clone();
        move || {
            status.raise();
            release_copies(&ce);
        }
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
            other => cu_ok("cuStreamQuery", other).map(|_| true),
        };
        let cause = poll_until_done(query, &failure, || self.abort())?;
        let e = self.status.read_error()?;
        // The kernels may have left because of a failure seen while nobody polled here (the
        // heartbeat watcher raised the word while the caller waited on the stream itself).
        let cause = cause.or_else(|| {
            if e.code == ERR_ABORTED {
                failure()
            } else {
                None
            }
        });
        if let Some(cause) = cause {
            return Err(cause);
        }
        if e.code == 0 {
            // Copy-engine operations record nothing: after an abort they ended because the
            // abort freed their waits, not because their peers delivered.
            if self.status.abort.get() != 0 {
                return Err(Error::Aborted(format!(
                    "GPU {} rank {}: the communicator was aborted",
                    self.gpu.ordinal(),
                    self.rank
                )));
            }
            return Ok(());
        }
        let what = match e.what {
            WHAT_DATA => "data from",
            WHAT_ROOM => "room in the connection to",
            WHAT_LENGTH => "a length check on data from",
            WHAT_POST => "the output address (zero-copy post) of",
            WHAT_SENT => "the send block (in place: the input it still sends) of",
            _ => "a consistent plan with",
        };
        let msg = if e.conn < 0 {
            // A one-kernel engine (direct, peer): a block waits for a flag that counts rounds.
            format!(
                "GPU {} rank {}: block {} waiting for {what} rank {} (for flag value {}; it was at {})",
                self.gpu.ordinal(),
                self.rank,
                e.lane,
                e.peer,
                e.wanted,
                e.seen
            )
        } else {
            // The point-to-point kernel on a connection also says which LL flag it waited for.
            let flag = if e.wanted != 0 {
                format!(" (LL flag {}; the line held {})", e.wanted, e.seen)
            } else {
                String::new()
            };
            format!(
                "GPU {} rank {}: lane {} step {} waiting for {what} rank {} (connection {}): expected {} got {}{flag}",
                self.gpu.ordinal(),
                self.rank,
                e.lane,
                e.step,
                e.peer,
                e.conn,
                e.expected,
                e.got
            )
        };
        Err(match e.code {
            ERR_ABORTED => Error::Aborted(msg),
            ERR_TIMEOUT => Error::Timeout(msg),
            ERR_LENGTH => Error::Protocol(msg),
            _ => Error::Internal(msg),
        })
    }

    /// Messages the peer engine moved without staging since creation: its senders' stores
    /// straight into this rank's outputs (direct rounds, counted per block, round and sender by
    /// the receiving kernels) and this rank's pulled rounds (per block and round); read after
    /// the work queued so far (a synchronous copy).
    pub fn direct_rounds(&self) -> Result<u64, Error> {
        self.drain()?;
        self.status.direct_rounds()
    }

    /// Thread blocks of the latest launch (0 before the first, or when it had no lanes).
    pub fn last_blocks(&self) -> u32 {
        self.last_blocks.load(Ordering::Relaxed)
    }

    /// Whether any window is registered (the tuner's `windows`).
    pub(crate) fn has_windows(&self) -> bool {
        self.windows.lock().map(|w| !w.is_empty()).unwrap_or(false)
    }

    /// The windows and local registrations, locked (every launch takes the lock too).
    pub(super) fn windows(&self) -> Result<std::sync::MutexGuard<'_, Windows>, Error> {
        self.windows
            .lock()
            .map_err(|_| Error::Internal("windows lock poisoned".into()))
    }

    /// Waits for the work queued so far on the current stream.
    fn drain(&self) -> Result<(), Error> {
        self.gpu.bind()?;
        cu_ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.current_stream())
        })
    }

    /// Registers a window with every rank (collective; see window.rs). Holds the windows lock,
    /// which every launch takes too, so no launch of this rank sees half a registration.
    pub fn register(
        &self,
        boot: &Bootstrap,
        ptr: u64,
        len: usize,
        symmetric: bool,
        abort: &AtomicBool,
        deadline: std::time::Instant,
    ) -> Result<(), Error> {
        let mut w = self.windows()?;
        w.register(
            &self.gpu,
            boot,
            ptr,
            len,
            symmetric,
            &self.stats,
            abort,
            deadline,
        )
    }

    /// For an operation the copy engine's zero-copy or copy-and-fold could take, whose output on
    /// this rank lies in a symmetric window: where this process maps every rank's output
    /// (`plan::lanes::zcopy_schedule`). What makes the tuner's `OpShape::symmetric`, which the
    /// peer engine's pulls (`tune::peer_pulls`, the copy-and-fold's shapes) go by too: both need
    /// the peer engine's fabric (the copy engine borrows it) and ranks that may name each
    /// other's windows (`Fabric::ranks_window`); which of them runs is the tuner's and its knobs'.
    pub(crate) fn symmetric_far(&self, a: &OpArgs, info: &CommInfo) -> Option<Vec<u64>> {
        self.windows
            .lock()
            .ok()
            .and_then(|w| self.far_in(&w, a, info))
    }

    /// Whether every rank's input of `a` lies in a symmetric window (`OpShape::inputs_symmetric`:
    /// what a reduce's pull reads), where the peer engine could read it: ranks apart.
    pub(crate) fn inputs_symmetric(&self, a: &OpArgs, info: &CommInfo) -> bool {
        self.windows
            .lock()
            .is_ok_and(|w| self.inputs_in(&w, a, info))
    }

    /// `inputs_symmetric` with the windows at hand (the launch path holds their lock). Only for
    /// the kinds whose every rank passes an input of one extent (`CollKind::uniform_input`; not a
    /// broadcast's or a scatter's, whose non-roots pass none): the symmetric contract then makes
    /// the answer every rank's.
    pub(super) fn inputs_in(&self, w: &Windows, a: &OpArgs, info: &CommInfo) -> bool {
        if w.is_empty() || self.peer.is_none() || !self.fabric.ranks_window() {
            return false;
        }
        a.kind
            .uniform_input(a.count, info.nranks)
            .and_then(|e| e.checked_mul(a.dtype.size()))
            .is_some_and(|bytes| w.symmetric_far(a.send as u64, bytes as u64).is_some())
    }

    /// `symmetric_far` with the windows at hand (the launch path holds their lock).
    pub(super) fn far_in(&self, w: &Windows, a: &OpArgs, info: &CommInfo) -> Option<Vec<u64>> {
        use ferroccl_core::plan::copies::{fold_serves, zcopy_serves};
        let fold = fold_serves(a.kind, info.nranks, a.is_in_place(info.rank));
        if w.is_empty()
            || self.peer.is_none()
            || !self.fabric.ranks_window()
            || !(zcopy_serves(a.kind, info.nranks) || fold)
        {
            return None;
        }
        let (send, recv) = a
            .kind
            .buffer_counts(a.count, info.nranks, a.root == info.rank)?;
        // A copy-and-fold needs the input in a symmetric window too: the symmetric contract then
        // puts every rank's input at one offset, so that in-place-ness (which decides it) is
        // every rank's alike (one rank in place and its peer not would choose differently).
        if fold {
            w.symmetric_far(a.send as u64, send.checked_mul(a.dtype.size())? as u64)?;
        }
        w.symmetric_far(a.recv as u64, recv.checked_mul(a.dtype.size())? as u64)
    }

    /// The rendezvous before a data-movement collective, a copy-and-fold reduction or a pulled
    /// reduce alone in its launch (`tune::rendezvous_wanted`): this rank's row of postings of
    /// where its output lies, one for each rank as reader (`Windows::post_output`: in a
    /// symmetric window, or mapped for its writers on the fly; none where neither, where a
    /// gather's non-root has no output, or an all-to-all or a fold is in place here), a reduce's
    /// non-root posting its input for its root instead (`tune::pull_rendezvous_wanted`), or None
    /// where the ranks exchange nothing. What decides is the same on every rank (`posts_possible`, the tuner's shape: the
    /// kinds that name their peers' outputs between symmetric windows need no exchange there, and
    /// the symmetric contract puts every rank's buffers in them alike).
    pub(crate) fn rendezvous_posting(
        &self,
        a: &OpArgs,
        info: &CommInfo,
        abort: &AtomicBool,
    ) -> Result<Option<Vec<u8>>, Error> {
        use ferroccl_core::plan::copies::{fold_serves, may_post, rendezvous_serves, writers_of};
        // The kinds, and the tuner as if every buffer could be posted (windows, no symmetric
        // contract: its most willing answer), first: every other launch, the many small ones
        // above all, goes on without taking the windows' lock.
        let wanted = |windows, symmetric, inputs| {
            ferroccl_core::tune::rendezvous_wanted(
                &a.shape(info, windows, symmetric, inputs),
                Device::Gpu,
                &info.config,
            )
        };
        if !rendezvous_serves(a.kind, info.nranks)
            || !self.posts_possible()
            || !wanted(true, false, false)
        {
            return Ok(None);
        }
        let w = self.windows()?;
        // Buffers in symmetric windows (the output, and a copy-and-fold's input too): the
        // symmetric contract puts every rank's there alike, and the launch names the peers'
        // outputs without an exchange.
        let (send, recv) = a
            .kind
            .buffer_counts(a.count, info.nranks, a.root == info.rank)
            .unwrap_or((0, 0));
        let windowed = |ptr: u64, count: usize| {
            count
                .checked_mul(a.dtype.size())
                .and_then(|b| w.symmetric_far(ptr, b as u64))
                .is_some()
        };
        let symmetric = windowed(a.recv as u64, recv)
            && (!fold_serves(a.kind, info.nranks, false) || windowed(a.send as u64, send));
        let outputs = ferroccl_core::tune::outputs_rendezvous_wanted(
            &a.shape(info, !w.is_empty(), symmetric, self.inputs_in(&w, a, info)),
            Device::Gpu,
            &info.config,
        );
        let pull = self.pull_wanted(&w, a, info);
        if !outputs && !pull {
            return Ok(None);
        }
        let bytes = recv.checked_mul(a.dtype.size()).unwrap_or(0);
        let writers = match outputs && bytes > 0 && may_post(a.kind, a.is_in_place(info.rank)) {
            true => writers_of(
                a.kind,
                a.count,
                a.dtype.size(),
                info.nranks,
                a.root,
                info.rank,
            ),
            false => Vec::new(),
        };
        let mut row = self.post_output(&w, info, abort, a.recv as u64, bytes as u64, &writers)?;
        // The reduce's pull (`tune::pull_rendezvous_wanted`): its non-root, which has no output
        // to post, posts its input for its root to read, in the root's place of its row.
        if pull && a.root != info.rank && a.root < row.len() && row[a.root].is_none() {
            let input = send.checked_mul(a.dtype.size()).unwrap_or(0) as u64;
            row[a.root] =
                self.post_output(&w, info, abort, a.send as u64, input, &[a.root])?[a.root];
        }
        Ok(Some(Posted::encode_row(&row)))
    }

    /// Whether the rendezvous before `a` carries the reduce's input for its root's pull
    /// (`tune::pull_rendezvous_wanted`), with the windows at hand: the same on every rank (the
    /// shape it reads is, and so is `posts_possible`).
    fn pull_wanted(&self, w: &Windows, a: &OpArgs, info: &CommInfo) -> bool {
        self.posts_possible()
            && ferroccl_core::tune::pull_rendezvous_wanted(
                &a.shape(info, !w.is_empty(), false, self.inputs_in(w, a, info)),
                Device::Gpu,
                &info.config,
            )
    }

    /// After the rendezvous (`rows[q]`: rank q's row of postings), what the launch takes
    /// (`Exchanged::Nothing` where neither the copies nor the pull can take it: every rank finds
    /// the same, from the same rows, and the launch runs on the kernels everywhere):
    /// - where every output a copy lands in was posted (`plan::copies::rendezvous_taken`, which
    ///   decides; a reduce's root out of place), where this process maps each peer's output that
    ///   this rank's copy engines write (0 for the others);
    /// - else, for the reduce's pull (`pull_wanted`; below the fold's floor, or a root in place),
    ///   where this process maps the non-root's input on the root, and on the non-root the
    ///   address of its own input, which it never reads (the kernel knows a pull by a non-zero
    ///   address).
    ///
    /// A row that does not parse is a protocol error, and so is a mapped posting this process's
    /// mapper does not hold; one naming a window this rank no longer holds (deregistered here
    /// only), an argument error.
    pub(crate) fn rendezvous_far(
        &self,
        a: &OpArgs,
        info: &CommInfo,
        rows: &[Vec<u8>],
    ) -> Result<Exchanged, Error> {
        let posted = rows
            .iter()
            .enumerate()
            .map(|(q, b)| {
                Posted::decode_row(b, info.nranks).map_err(|m| {
                    Error::Protocol(format!("rank {q}'s postings before a {}: {m}", a.kind))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        use ferroccl_core::plan::copies::{rendezvous_taken, Taken};
        let pull = self.pull_wanted(&*self.windows()?, a, info);
        let taken = rendezvous_taken(
            a.kind,
            a.count,
            a.dtype.size(),
            info.nranks,
            a.root,
            info.rank,
            &posted,
            pull,
        );
        match taken {
            None => Ok(Exchanged::Nothing),
            Some(Taken::Far(named)) => named
                .iter()
                .enumerate()
                .map(|(q, p)| p.map_or(Ok(0), |p| self.posted_far(p, q, info.rank)))
                .collect::<Result<Vec<_>, _>>()
                .map(Exchanged::Far),
            Some(Taken::Pull(None)) => Ok(Exchanged::Pull(a.send as u64)),
            Some(Taken::Pull(Some(p))) => Ok(Exchanged::Pull(self.posted_far(
                p,
                1 - a.root,
                info.rank,
            )?)),
        }
    }

    /// Whether this rank's copy engines can write a peer's posted output: the copy engine and
    /// the peer engine's fabric are there, and the ranks may post (`Fabric::ranks_post`: a
    /// process each, or ranks of one process on distinct GPUs). One thread driving several
    /// ranks posts for all of them before any reads (`launch::posts`), so their exchanges do
    /// not wait on each other within a launch. The same on every rank.
    fn posts_possible(&self) -> bool {
        self.ce.is_some() && self.peer.is_some() && self.fabric.ranks_post()
    }

    /// This rank's postings of its output `[ptr, ptr + bytes)` for its `writers` (or of a
    /// reduce's input for its root, which reads it) (`Windows::post_output`), lent on the fly
    /// where `FERROCCL_GPU_CE_MAP_UNREGISTERED` asks.
    fn post_output(
        &self,
        w: &Windows,
        info: &CommInfo,
        abort: &AtomicBool,
        ptr: u64,
        bytes: u64,
        writers: &[Rank],
    ) -> Result<Vec<Option<Posted>>, Error> {
        let Some(l) = self.lender(info, abort) else {
            return Ok(w.post_output(None, info.nranks, ptr, bytes, writers));
        };
        let mut maps = self
            .lazy
            .lock()
            .map_err(|_| Error::Internal("the loans' lock is poisoned".into()))?;
        Ok(w.post_output(Some((&mut maps, &l)), info.nranks, ptr, bytes, writers))
    }

    /// What lends this rank's outputs on the fly (`lazy.rs`), where
    /// `FERROCCL_GPU_CE_MAP_UNREGISTERED` asks for it; a lend waits at most the communicator's
    /// timeout, and 10 s.
    fn lender<'a>(&'a self, info: &CommInfo, abort: &'a AtomicBool) -> Option<Live<'a>> {
        info.config.gpu_ce_map_unregistered.then(|| Live {
            gpu: &self.gpu,
            me: self.rank,
            places: &self.fabric.places,
            comm_id: self.comm_id,
            abort,
            deadline: std::time::Instant::now()
                + info.config.timeout.min(std::time::Duration::from_secs(10)),
        })
    }

    /// Whether the send or receive `a` takes the posted-receive rendezvous (`launch/posts.rs`):
    /// the tuner's `p2p_rendezvous_wanted` where `posts_possible`. Both ends of a matched pair
    /// decide alike: one length, and every rank's setting the same.
    pub(crate) fn p2p_posts(&self, a: &OpArgs, info: &CommInfo) -> Result<bool, Error> {
        let wanted = |windows| {
            ferroccl_core::tune::p2p_rendezvous_wanted(
                &a.shape(info, windows, false, false),
                Device::Gpu,
                &info.config,
            )
        };
        // As if the communicator had windows first (the tuner's most willing answer): small
        // sends and receives go on without taking the windows' lock.
        if !matches!(a.kind, CollKind::Send | CollKind::Recv)
            || a.root == info.rank
            || !self.posts_possible()
            || !wanted(true)
        {
            return Ok(false);
        }
        Ok(wanted(!self.windows()?.is_empty()))
    }

    /// What this rank posts to its sender before the receive `a`: where its output lies for the
    /// sender (in a symmetric window, or mapped for it on the fly), and its length.
    pub(crate) fn recv_post(
        &self,
        a: &OpArgs,
        info: &CommInfo,
        abort: &AtomicBool,
    ) -> Result<RecvPost, Error> {
        let bytes = a
            .count
            .checked_mul(a.dtype.size())
            .ok_or_else(|| Error::InvalidArgument(format!("a receive of {} elements", a.count)))?;
        let w = self.windows()?;
        let row = self.post_output(&w, info, abort, a.recv as u64, bytes as u64, &[a.root])?;
        Ok(RecvPost {
            posted: row[a.root],
            bytes: bytes as u64,
        })
    }

    /// Where this process maps the output `peer` posted (`p`), for this rank's copy engines. A
    /// window's posting: an argument error where this rank no longer holds that window
    /// (deregistered here only). A mapped one: a protocol error unless it lies in what `peer`
    /// lent this process's mapper (a peer of this process posts its own address).
    pub(crate) fn posted_far(&self, p: Posted, peer: Rank, me: Rank) -> Result<u64, Error> {
        match p {
            Posted::Window { window, len, .. } => {
                self.windows()?.far_of(p, peer).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "rank {peer} posted its output in window registration #{window} ({len} bytes), which rank {me} no longer holds: deregister windows on every rank alike"
                    ))
                })
            }
            Posted::Mapped { addr, len } => {
                let here = self
                    .fabric
                    .places
                    .get(peer)
                    .is_some_and(|pl| pl.pid == std::process::id());
                let lent = self
                    .mapper
                    .as_ref()
                    .is_some_and(|m| m.holds(peer, addr, len));
                if here || lent {
                    Ok(addr)
                } else {
                    Err(Error::Protocol(format!(
                        "rank {peer} posted its output at {addr:#x} ({len} bytes), which it did not lend to rank {me}"
                    )))
                }
            }
        }
    }

    /// Registers `[ptr, ptr + len)` of this rank alone (see `Windows::register_local`).
    pub fn register_local(
        &self,
        ptr: u64,
        len: usize,
        abort: &AtomicBool,
        deadline: std::time::Instant,
    ) -> Result<(), Error> {
        let mut w = self.windows()?;
        w.register_local(
            &self.gpu,
            self.rank,
            &self.fabric.places,
            self.comm_id,
            ptr,
            len,
            abort,
            deadline,
        )
    }

    /// Forgets the latest local registration at `ptr` (see `Windows::deregister_local`), after
    /// the queued work that may use it.
    pub fn deregister_local(
        &self,
        ptr: u64,
        abort: &AtomicBool,
        deadline: std::time::Instant,
    ) -> Result<(), Error> {
        let mut w = self.windows()?;
        self.drain()?;
        w.deregister_local(
            self.rank,
            &self.fabric.places,
            self.comm_id,
            ptr,
            abort,
            deadline,
        )
    }

    /// Forgets the window at `ptr` on this rank (see `Windows::deregister`), after the queued
    /// work that may use it.
    pub fn deregister(&self, ptr: u64) -> Result<(), Error> {
        let mut w = self.windows()?;
        self.drain()?;
        w.deregister(ptr)
    }

    /// GPU memory this communicator allocated.
    pub fn memory_bytes(&self) -> u64 {
        self.stats.allocated_bytes()
    }

    /// Peers' GPU memory this communicator maps (other processes' arenas and windows).
    pub fn mapped_bytes(&self) -> u64 {
        self.stats.imported_bytes()
    }
}

/// Frees the copy engine's stalled streams from a thread of its own (an abort must not wait).
fn release_copies(ce: &Option<Arc<CopyEngine>>) {
    if let Some(ce) = ce.clone() {
        let _ = std::thread::Builder::new()
            .name("ferroccl-ce-release".into())
            .spawn(move || ce.release(std::time::Duration::from_secs(60)));
    }
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

impl Drop for CudaComm {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // The kernels still queued use the connections, tables and status freed after this:
        // they must be gone first, on the caller's stream as on ours (after a failure they
        // leave at their next poll of the abort word, which the failure raised).
        let user = self.user_stream.load(Ordering::Acquire);
        unsafe {
            if !user.is_null() {
                sys::cuStreamSynchronize(user as sys::CUstream);
            }
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
        let r = poll_until_done(
            || {
                Ok({
                    n.set(n.get() + 1);
                    n.get() > 3
                })
            },
            || None,
            || raised.set(raised.get() + 1),
        );
        assert!(matches!(r, Ok(None)));
        assert_eq!(raised.get(), 0);
        // A death is reported at poll 5; the kernel leaves 10 polls after the word is raised.
        let n = Cell::new(0);
        let at = Cell::new(None::<u32>);
        let r = poll_until_done(
            || {
                Ok({
                    n.set(n.get() + 1);
                    at.get().is_some_and(|a| n.get() >= a + 10)
                })
            },
            || (n.get() >= 5).then(|| Error::Remote("rank 1 died".into())),
            || {
                raised.set(raised.get() + 1);
                at.set(Some(n.get()))
            },
        );
        assert_eq!(raised.get(), 1, "raised once");
        assert!(
            matches!(r, Ok(Some(Error::Remote(ref m))) if m.contains("rank 1 died")),
            "{r:?}"
        );
        // A driver error ends the wait as an error.
        let r = poll_until_done(
            || {
                Err(Error::System(
                    "cuStreamQuery: CUDA_ERROR_LAUNCH_FAILED".into(),
                ))
            },
            || None,
            || {},
        );
        assert!(matches!(r, Err(Error::System(_))));
    }
}
