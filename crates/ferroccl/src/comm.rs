//! The communicator: who it is ([`CommInfo`]), its bootstrap, its backend, and the calls that
//! make, split, shrink and abort it. The collectives themselves are in `collectives.rs`.

use crate::backend::cuda::CudaComm;
use crate::backend::host::HostComm;
use crate::backend::Backend;
use crate::bootstrap::{Bootstrap, UniqueId};
use crate::info::{CommInfo, CommState, Siblings};
use ferroccl_core::config::compare_shared;
use ferroccl_core::numeric::Element;
use ferroccl_core::topo::{RankLocation, Topology, TransportKind};
use ferroccl_core::{Config, DataType, Error, LaunchEnv, Rank};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Where a rank's buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host memory (the host backend).
    Host,
    /// A GPU of this host, by CUDA ordinal: buffers are device memory, operations are enqueued
    /// on the communicator's stream and return at once.
    Cuda(usize),
}

/// A communicator: a set of ranks that run collectives together.
pub struct Comm {
    pub(crate) info: CommInfo,
    pub(crate) boot: Bootstrap,
    pub(crate) state: Mutex<CommState>,
    pub(crate) abort: Arc<AtomicBool>,
    pub(crate) backend: Backend,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Comm(rank {} of {}, id {:016x})",
            self.info.rank,
            self.info.nranks,
            self.boot.comm_id()
        )
    }
}

impl Comm {
    /// Joins the communicator `id` as `rank` of `nranks` (every rank calls this, typically one
    /// per process or thread).
    pub fn init_rank(
        id: &UniqueId,
        nranks: usize,
        rank: Rank,
        device: Device,
        config: &Config,
    ) -> Result<Comm, Error> {
        Comm::init_rank_with_abort(
            id,
            nranks,
            rank,
            device,
            config,
            Arc::new(AtomicBool::new(false)),
            None,
        )
    }

    /// [`Comm::init_rank`] that another thread can end: raising `abort` while the ranks
    /// assemble makes this return `Error::Aborted` (a non-blocking creation being abandoned);
    /// the flag stays the communicator's abort flag afterwards.
    pub fn init_rank_abortable(
        id: &UniqueId,
        nranks: usize,
        rank: Rank,
        device: Device,
        config: &Config,
        abort: Arc<AtomicBool>,
    ) -> Result<Comm, Error> {
        Comm::init_rank_with_abort(id, nranks, rank, device, config, abort, None)
    }

    fn init_rank_with_abort(
        id: &UniqueId,
        nranks: usize,
        rank: Rank,
        device: Device,
        config: &Config,
        abort: Arc<AtomicBool>,
        siblings: Option<Arc<Siblings>>,
    ) -> Result<Comm, Error> {
        config.validate()?;
        let boot = Bootstrap::init(id, nranks, rank, config, abort.clone())?;
        Comm::from_bootstrap(boot, device, config.clone(), abort, siblings)
    }

    /// Joins the job described by the launcher's environment on GPU `LOCAL_RANK`.
    pub fn from_env_gpu(config: &Config) -> Result<Comm, Error> {
        let env = LaunchEnv::from_env()?
            .ok_or_else(|| Error::InvalidArgument("no launcher environment".into()))?;
        config.validate()?;
        let abort = Arc::new(AtomicBool::new(false));
        let boot = Bootstrap::init_from_launch(&env, config, abort.clone())?;
        Comm::from_bootstrap(
            boot,
            Device::Cuda(env.local_rank),
            config.clone(),
            abort,
            None,
        )
    }

    /// One process driving `nranks` ranks: returns the communicators indexed by rank. Use a
    /// [`Group`](crate::Group) to issue an operation on all of them from one thread.
    pub fn init_all(nranks: usize, config: &Config) -> Result<Vec<Comm>, Error> {
        if nranks == 0 {
            return Err(Error::InvalidArgument(
                "init_all: nranks must be at least 1".into(),
            ));
        }
        Comm::init_devices(&vec![Device::Host; nranks], config)
    }

    /// One process driving one rank per entry of `devices` (e.g. every GPU of the host):
    /// returns the communicators indexed by rank.
    pub fn init_devices(devices: &[Device], config: &Config) -> Result<Vec<Comm>, Error> {
        let nranks = devices.len();
        if nranks == 0 {
            return Err(Error::InvalidArgument(
                "init_devices: at least one device is needed".into(),
            ));
        }
        let id = UniqueId::new(config)?;
        // One rank failing to start stops the others at once, rather than leaving them to wait
        // for it until the deadline.
        let aborts: Vec<Arc<AtomicBool>> = (0..nranks)
            .map(|_| Arc::new(AtomicBool::new(false)))
            .collect();
        let siblings = Siblings::new(nranks);
        let results: Vec<Result<Comm, Error>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..nranks)
                .map(|r| {
                    let (id, aborts, siblings) = (&id, &aborts, &siblings);
                    let dev = devices[r];
                    std::thread::Builder::new()
                        .name(format!("ferroccl-init-{r}"))
                        .spawn_scoped(s, move || {
                            let c = Comm::init_rank_with_abort(
                                id,
                                nranks,
                                r,
                                dev,
                                config,
                                aborts[r].clone(),
                                Some(siblings.clone()),
                            );
                            if c.is_err() {
                                aborts.iter().for_each(|a| a.store(true, Ordering::Release));
                            }
                            c
                        })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err(Error::Internal("init thread panicked".into()))),
                    Err(e) => Err(Error::System(format!("cannot start an init thread: {e}"))),
                })
                .collect()
        });
        // The cause, not the aborts it set off in the other ranks; and a resource or system
        // failure before the protocol errors it causes in its peers (a rank out of descriptors
        // drops a half-made connection, which its peer sees as a refused handshake).
        let errs: Vec<&Error> = results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .filter(|e| !matches!(e, Error::Aborted(_)))
            .collect();
        let cause = errs
            .iter()
            .find(|e| matches!(e, Error::System(_)))
            .or_else(|| errs.first())
            .map(|e| (*e).clone());
        match cause {
            Some(e) => Err(e),
            None => results.into_iter().collect(),
        }
    }

    /// Joins the job described by the launcher's environment (torchrun, mpirun, `ferroccl run`).
    pub fn from_env(config: &Config) -> Result<Comm, Error> {
        let env = LaunchEnv::from_env()?.ok_or_else(|| {
            Error::InvalidArgument("no launcher environment: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or use `ferroccl run`".into())
        })?;
        Comm::from_launch(&env, config)
    }

    /// Joins the job described by `env`.
    pub fn from_launch(env: &LaunchEnv, config: &Config) -> Result<Comm, Error> {
        config.validate()?;
        let abort = Arc::new(AtomicBool::new(false));
        let boot = Bootstrap::init_from_launch(env, config, abort.clone())?;
        Comm::from_bootstrap(boot, Device::Host, config.clone(), abort, None)
    }

    fn from_bootstrap(
        boot: Bootstrap,
        device: Device,
        config: Config,
        abort: Arc<AtomicBool>,
        siblings: Option<Arc<Siblings>>,
    ) -> Result<Comm, Error> {
        // Knobs that decide the plans, the wire or failure detection must agree, or the ranks
        // would exchange messages they cut differently (wrong results, or a deadline that never
        // names the cause): every rank compares everyone's, and all fail alike.
        let all = boot.allgather(&config.encode_shared())?;
        compare_shared(&all).map_err(|e| {
            e.context(format!(
                "creating the communicator on rank {} of {}",
                boot.rank(),
                boot.nranks()
            ))
        })?;
        let peers = boot.peers();
        let me = &peers[boot.rank()];
        let topo = Topology {
            ranks: peers
                .iter()
                .map(|p| RankLocation {
                    host_id: p.host_id,
                    hostname: p.hostname.clone(),
                    pid: p.pid,
                })
                .collect(),
        };
        let peer_names = peers
            .iter()
            .map(|p| {
                format!(
                    "rank {} ({}, pid {}, {})",
                    p.rank, p.hostname, p.pid, p.addr
                )
            })
            .collect();
        let peer_pids = peers
            .iter()
            .map(|p| if p.host_id == me.host_id { p.pid } else { 0 })
            .collect();
        // A forced transport that cannot work fails now, not at the first collective.
        let mut peer_via = Vec::with_capacity(boot.nranks());
        for p in 0..boot.nranks() {
            peer_via.push(topo.transport(boot.rank(), p, config.transport)?.name());
        }
        let tuner_device = match device {
            Device::Host => ferroccl_core::tune::Device::Host,
            Device::Cuda(_) => ferroccl_core::tune::Device::Gpu,
        };
        let mut info = CommInfo {
            rank: boot.rank(),
            nranks: boot.nranks(),
            config,
            topo,
            device: tuner_device,
            peer_names,
            peer_pids,
            peer_via,
            siblings,
        };
        let backend = match device {
            Device::Host => Backend::Host(HostComm::new(&boot)),
            Device::Cuda(ordinal) => {
                let c = CudaComm::new(ordinal, &boot, &info.config, &abort)?;
                // The tuner offers line rounds only where every link carries them (every rank
                // learnt the same from the fabric, so all decide alike).
                if !c.lines_carried() {
                    info.config.gpu_peer_lines_max_bytes = 0;
                }
                // A peer's death must free this rank's kernels even when nobody is in
                // synchronize (a framework waiting on the stream itself).
                boot.health().on_failure(c.abort_handle());
                Backend::Cuda(Box::new(c))
            }
        };
        Ok(Comm {
            info,
            boot,
            state: Mutex::new(CommState::default()),
            abort,
            backend,
        })
    }

    /// The device this communicator's rank runs on.
    pub fn device(&self) -> Device {
        match &self.backend {
            Backend::Host(_) => Device::Host,
            Backend::Cuda(c) => Device::Cuda(c.gpu.ordinal()),
        }
    }

    /// This rank, in `0..nranks()`.
    pub fn rank(&self) -> Rank {
        self.info.rank
    }
    /// Ranks of the communicator.
    pub fn nranks(&self) -> usize {
        self.info.nranks
    }
    /// The configuration it was made with.
    pub fn config(&self) -> &Config {
        &self.info.config
    }
    /// Where every rank runs (host, process), which decides the transports.
    pub fn topology(&self) -> &Topology {
        &self.info.topo
    }
    /// A random id shared by all ranks of this communicator.
    pub fn id(&self) -> u64 {
        self.boot.comm_id()
    }

    /// The transport used between this rank and `peer`.
    pub fn transport_to(&self, peer: Rank) -> Result<TransportKind, Error> {
        if peer >= self.info.nranks {
            return Err(Error::InvalidArgument(format!(
                "peer {peer} is not below nranks {}",
                self.info.nranks
            )));
        }
        self.info
            .topo
            .transport(self.info.rank, peer, self.info.config.transport)
    }

    /// GPU communicators: waits until every operation enqueued so far completed, and reports
    /// a failure the kernels recorded. Host communicators: nothing to wait for.
    pub fn synchronize(&self) -> Result<(), Error> {
        let r = match &self.backend {
            Backend::Cuda(c) => c.synchronize(|| self.boot.health().failure()),
            Backend::Host(_) => Ok(()),
        };
        // A kernel that gave up (deadline, abort) left its connections and counters in an
        // unknown state: later calls are refused, and `failure` reports it, as for a failure
        // seen at launch.
        if let Err(e) = &r {
            if let Ok(mut st) = self.state.lock() {
                st.failed.get_or_insert_with(|| e.clone());
            }
        }
        r
    }

    /// The CUDA stream operations of a GPU communicator are enqueued on (null for host ones).
    pub fn cuda_stream(&self) -> *mut std::ffi::c_void {
        self.backend
            .cuda()
            .map(|c| c.stream() as *mut std::ffi::c_void)
            .unwrap_or(std::ptr::null_mut())
    }

    /// GPU communicators: later operations are enqueued on `stream` (a `CUstream`; null: the
    /// communicator's own stream again).
    ///
    /// # Safety
    /// `stream` must be a stream of this communicator's GPU context that lives until the
    /// communicator is dropped or given another stream. Dropping waits for the work queued on
    /// the stream it holds then; work left on an earlier stream must be complete by then.
    pub unsafe fn set_stream(&self, stream: *mut std::ffi::c_void) {
        if let Some(c) = self.backend.cuda() {
            c.set_stream(stream as _);
        }
    }

    /// Registers `bytes` of GPU memory at `ptr` as a window of this rank, with every rank of the
    /// communicator: collective (every rank registers one buffer, in the same order relative to
    /// its operations, like `ncclCommWindowRegister`). From then on, an operation whose output on
    /// a receiving rank lies in one of its windows gets its data written there by the sending
    /// GPUs directly (zero-copy), instead of through the connection's FIFO and a copy. The memory
    /// must be a cuMem allocation with POSIX file-descriptor handles: [`crate::mem::alloc`], or
    /// any other; other memory is refused with an error on every rank, and nothing changes.
    ///
    /// # Safety
    /// The range must stay allocated until [`Comm::deregister_window`] (or the communicator's
    /// drop): peers write into it.
    pub unsafe fn register_window(&self, ptr: u64, bytes: usize) -> Result<(), Error> {
        // SAFETY: the caller's contract.
        unsafe { self.register(ptr, bytes, false) }
    }

    /// [`Comm::register_window`] for a symmetric window (NCCL's `NCCL_WIN_COLL_SYMMETRIC`): every
    /// rank registers a buffer of the same length, and promises that each operation's buffers lie
    /// at the same offset of their windows on every rank (as the ranks' buffers do when each
    /// allocates the same sizes in the same order). Large data movement between such windows
    /// (all-gather, all-to-all, gather, scatter; broadcast on 2 ranks) then goes straight from
    /// input to output by the GPUs' copy engines, with no thread block
    /// (`FERROCCL_GPU_CE_WINDOW_BYTES`). Ranks that register differently (one symmetric, one
    /// not, or other lengths) all get an error, and nothing is registered.
    ///
    /// # Safety
    /// As [`Comm::register_window`]; and an operation whose buffers break the promise has its
    /// peers' copy engines write into (or read from) the windows at this rank's offsets, inside
    /// them but not where the peers' buffers are.
    pub unsafe fn register_symmetric_window(&self, ptr: u64, bytes: usize) -> Result<(), Error> {
        // SAFETY: the caller's contract.
        unsafe { self.register(ptr, bytes, true) }
    }

    /// [`Comm::register_symmetric_window`] for a whole ferroccl buffer.
    pub fn register_symmetric_buffer(&self, buf: &crate::mem::DeviceBuffer) -> Result<(), Error> {
        // SAFETY: as `register_buffer`; the symmetric promise is the caller's, as documented.
        unsafe { self.register_symmetric_window(buf.device_ptr(), buf.len()) }
    }

    /// # Safety
    /// As [`Comm::register_window`].
    unsafe fn register(&self, ptr: u64, bytes: usize, symmetric: bool) -> Result<(), Error> {
        let c = self.gpu_backend("windows")?;
        let _state = self.live_state()?;
        let deadline = std::time::Instant::now() + self.info.config.timeout;
        c.register(&self.boot, ptr, bytes, symmetric, &self.abort, deadline)
            .map_err(|e| e.context(format!("rank {}: registering a window", self.info.rank)))
    }

    /// [`Comm::register_window`] for a whole ferroccl buffer, which is what it is made for.
    pub fn register_buffer(&self, buf: &crate::mem::DeviceBuffer) -> Result<(), Error> {
        // SAFETY: the buffer's owner must keep it until deregistration, as documented; a buffer
        // dropped early unmaps only this process's view (peers keep the memory mapped).
        unsafe { self.register_window(buf.device_ptr(), buf.len()) }
    }

    /// Forgets the window registered at `ptr`, on this rank (not collective, as NCCL's
    /// deregistration), once the work queued on the communicator's stream is done. Every rank
    /// must have deregistered its buffer of that registration before the buffers take part in
    /// an operation again.
    pub fn deregister_window(&self, ptr: u64) -> Result<(), Error> {
        let c = self.gpu_backend("windows")?;
        let _state = self.state()?;
        c.deregister(ptr)
    }

    /// Registers `bytes` of GPU memory at `ptr` for this rank alone (NCCL's `ncclCommRegister`:
    /// not collective; peers take no part in the call). Where an operation's output on this rank
    /// lies in it, the peers that could map it store their messages straight into it (the peer
    /// engine's direct rounds: all-gather, all-to-all, broadcast, gather, scatter), skipping this
    /// rank's copy out of its staging; the others stage as for any buffer. Peers of this process
    /// reach it at its own address, peers of other processes through their mapper threads, which
    /// map it when this call hands it to them. The memory must be device memory of this rank's
    /// GPU: a cuMem allocation with POSIX file-descriptor handles ([`crate::mem::alloc`],
    /// `ncclMemAlloc`, PyTorch's expandable segments, ...), or `cudaMalloc`'s (PyTorch's default
    /// allocator's), which peers in other processes map by its CUDA IPC handle and peers in this
    /// process reach through peer access to this GPU's context; anything else is refused, and
    /// nothing changes. The same buffer may be registered more than once; each
    /// [`Comm::deregister_local`] undoes one.
    ///
    /// # Safety
    /// The range must stay allocated until [`Comm::deregister_local`] (or the communicator's
    /// drop), and not take part in an operation after its memory is freed: peers write into it.
    pub unsafe fn register_local(&self, ptr: u64, bytes: usize) -> Result<(), Error> {
        let c = self.gpu_backend("registrations")?;
        let _state = self.live_state()?;
        c.register_local(ptr, bytes, &self.abort, self.loan_deadline())
            .map_err(|e| {
                e.context(format!(
                    "rank {}: registering {bytes} bytes at {ptr:#x}",
                    self.info.rank
                ))
            })
    }

    /// Undoes the latest [`Comm::register_local`] of `ptr`, once the work queued on the
    /// communicator's stream is done; peers of other processes are asked to unmap it.
    pub fn deregister_local(&self, ptr: u64) -> Result<(), Error> {
        let c = self.gpu_backend("registrations")?;
        let _state = self.state()?;
        c.deregister_local(ptr, &self.abort, self.loan_deadline())
    }

    /// How long a local registration waits for a peer's mapper: not the communicator's whole
    /// timeout, as one unreachable peer only costs that peer's direct rounds.
    fn loan_deadline(&self) -> std::time::Instant {
        std::time::Instant::now()
            + self
                .info
                .config
                .timeout
                .min(std::time::Duration::from_secs(10))
    }

    /// The GPU backend, or an argument error: `what` (windows, registrations) are GPU memory.
    fn gpu_backend(&self, what: &str) -> Result<&CudaComm, Error> {
        self.backend.cuda().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{what} are GPU memory: this communicator runs on the host"
            ))
        })
    }

    /// The state, locked.
    fn state(&self) -> Result<std::sync::MutexGuard<'_, CommState>, Error> {
        self.state
            .lock()
            .map_err(|_| Error::Internal("communicator state poisoned".into()))
    }

    /// The state, refused when the communicator failed earlier.
    fn live_state(&self) -> Result<std::sync::MutexGuard<'_, CommState>, Error> {
        let state = self.state()?;
        if let Some(e) = &state.failed {
            return Err(Error::Aborted(format!(
                "rank {}: the communicator failed earlier: {e}",
                self.info.rank
            )));
        }
        Ok(state)
    }

    /// GPU memory this communicator allocated. The peers' memory it maps (their arenas and
    /// windows, from other processes) is theirs and not counted: [`Comm::device_memory_mapped_bytes`].
    pub fn device_memory_bytes(&self) -> u64 {
        self.backend.cuda().map(|c| c.memory_bytes()).unwrap_or(0)
    }

    /// Peers' GPU memory this communicator maps from other processes (address space, not memory
    /// of this GPU's own).
    pub fn device_memory_mapped_bytes(&self) -> u64 {
        self.backend.cuda().map(|c| c.mapped_bytes()).unwrap_or(0)
    }

    /// GPU communicators: the thread blocks (one per plan lane, each on its own SM while it
    /// runs) of this communicator's latest kernel launch; None for host communicators. A
    /// group launches one kernel per communicator, so this counts every operation of the
    /// group on this rank.
    pub fn last_launch_blocks(&self) -> Option<u32> {
        self.backend.cuda().map(|c| c.last_blocks())
    }

    /// GPU communicators: how many messages moved straight between registered buffers without
    /// staging since creation, after the work queued so far: peers' stores into this rank's
    /// outputs (the peer engine's direct rounds: a block's round from one sender each) and this
    /// rank's reads of its peer's input (a pulling all-reduce: a block's round each); None for
    /// host communicators. A diagnostic: it tells whether registering paid off.
    pub fn direct_rounds(&self) -> Option<Result<u64, Error>> {
        self.backend.cuda().map(|c| c.direct_rounds())
    }

    /// The GPU of a GPU communicator.
    pub fn gpu(&self) -> Option<&crate::cuda::Gpu> {
        self.backend.cuda().map(|c| &c.gpu)
    }

    /// GPU communicators: the verifiable mode on this communicator's GPU and stream, its kernels
    /// compiled (or found in the disk cache) and loaded by this call: make one and keep it.
    /// Host communicators: None (check host buffers with `RankCase` directly).
    pub fn gpu_verifier(&self) -> Result<Option<crate::verify::GpuVerifier<'_>>, Error> {
        self.backend
            .cuda()
            .map(|c| crate::verify::GpuVerifier::new(c, &self.info.config))
            .transpose()
    }

    /// Out-of-band barrier over the bootstrap connections.
    pub fn barrier(&self) -> Result<(), Error> {
        self.boot.barrier()
    }

    /// Out-of-band all-gather of small byte strings (setup, benchmarks' timing exchange).
    pub fn allgather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        self.boot.allgather(mine)
    }

    /// Collective: ranks passing the same `Some(color)` form a new communicator, ordered by
    /// `key` then by rank here; `None` joins none and returns `Ok(None)`.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Comm>, Error> {
        self.ensure_usable("split")?;
        let Some(boot) = self.boot.split(color, key)? else {
            return Ok(None);
        };
        let abort = Arc::new(AtomicBool::new(false));
        Comm::from_bootstrap(boot, self.device(), self.info.config.clone(), abort, None).map(Some)
    }

    /// Collective over the survivors: a new communicator of every rank not in `exclude`
    /// (NCCL's `ncclCommShrink`), ranks renumbered densely in the old order. Works on a failed
    /// or aborted communicator: the survivors connect afresh from what this one learnt at init,
    /// needing nothing from the excluded ranks. Every survivor must pass the same list
    /// (typically [`Comm::dead_ranks`]), and excluded ranks do not call it.
    pub fn shrink(&self, exclude: &[Rank]) -> Result<Comm, Error> {
        let boot = self.boot.shrink(exclude)?;
        let abort = boot.abort_flag().clone();
        Comm::from_bootstrap(boot, self.device(), self.info.config.clone(), abort, None)
    }

    /// Ranks this communicator knows to have died (their process ended or went silent), in
    /// increasing order: what every survivor passes to [`Comm::shrink`]. News of a death
    /// crosses the job within milliseconds, so a rank that just failed may briefly see fewer.
    pub fn dead_ranks(&self) -> Vec<Rank> {
        self.boot.health().dead()
    }

    /// Stops every operation of this communicator, from any thread: waiting calls return
    /// `Error::Aborted` promptly, peers waiting on us see the failure, and later calls fail.
    /// Its connections (shared memory, sockets, threads) are freed before this returns,
    /// except while another thread's call still holds them after `ABORT_RELEASE_WAIT`: then
    /// they go when the communicator is dropped.
    pub fn abort(&self) {
        self.abort.store(true, Ordering::Release);
        match &self.backend {
            Backend::Cuda(c) => c.abort(),
            Backend::Host(h) => {
                h.poison(&format!("rank {} aborted its communicator", self.info.rank))
            }
        }
        self.boot.abort();
        if let Backend::Host(h) = &self.backend {
            h.release();
        }
    }

    /// The DataType of `T`, for callers building raw arguments.
    pub fn dtype_of<T: Element>() -> DataType {
        T::DTYPE
    }

    /// Why this communicator cannot be used any more (aborted, a peer dead, an earlier failure),
    /// without waiting for anything: what NCCL's `ncclCommGetAsyncError` reports. GPU kernels'
    /// own failures (a device deadline) surface at [`Comm::synchronize`].
    pub fn failure(&self) -> Option<Error> {
        self.ensure_usable("ncclCommGetAsyncError").err()
    }

    /// Refuses a call (`what`: "all_reduce", "split") on an aborted or failed communicator,
    /// naming the call as its launch would have ("all_reduce #13 on rank 1 of 4").
    pub(crate) fn ensure_usable(&self, what: &str) -> Result<(), Error> {
        let (rank, n) = (self.info.rank, self.info.nranks);
        // Another thread may be inside an operation: then the number is left out, not waited for.
        let label = || match self.state.try_lock() {
            Ok(st) => format!("{what} #{} on rank {rank} of {n}", st.seq + 1),
            Err(_) => format!("{what} on rank {rank} of {n}"),
        };
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::Aborted(format!(
                "{}: the communicator was aborted (Comm::abort); drop it",
                label()
            )));
        }
        if let Some(e) = self.boot.health().failure() {
            return Err(e.context(label()));
        }
        let failed = self.state()?.failed.clone();
        if let Some(e) = failed {
            return Err(Error::Aborted(format!(
                "{}: the communicator failed earlier and cannot be used: {e}",
                label()
            )));
        }
        Ok(())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if let Backend::Host(h) = &self.backend {
            h.close(&self.boot);
        }
    }
}

#[cfg(test)]
mod fault_tests;
