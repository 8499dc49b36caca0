//! A bench job from the arguments: the communicators of the launch mode (a thread per rank, one
//! thread driving every rank, or one process per rank under a launcher), NCCL's beside them,
//! one pair of buffers per rank and library (registered under --register), and the ranks'
//! contexts; at the end all of it taken down again, beside NCCL with the memory readings
//! around each step.

use super::cuda as cu;
use super::libs::{Lib, NcclSide, Register};
use super::memory::{free_of, Readings};
use super::rank::{RankCtx, Side};
use super::record::RankMemory;
use super::spec::{Buffers, Spec};
use super::BenchArgs;
use crate::api::{Comm, Config, Device, Error};
use crate::nccl::{sys::UniqueId, Nccl, NcclComm, Registration};
use ferroccl::mem::{DeviceBuffer, Gpu, MemStats};
use ferroccl_core::LaunchEnv;
use std::ffi::c_void;
use std::sync::Arc;

/// Any data will do for timing (--check fills its own); a constant keeps floats finite for a
/// while.
const FILL: u8 = 0x3c;

/// The configuration with the command's own limits applied (--max-ctas).
pub fn bench_config(args: &BenchArgs, config: &Config) -> Result<Config, String> {
    let mut c = config.clone();
    if let Some(n) = args.max_ctas {
        // One thread block per channel and lane: the channel count is the block budget of a
        // collective, and of each direction of a send or receive.
        c.gpu_channels = n;
        c.gpu_p2p_channels = c.gpu_p2p_channels.min(n);
        // The peer engine's staging is then cut for at most as many blocks (larger slots; fewer
        // blocks where slots would fall under 16 KiB: tune::peer_blocks).
        c.gpu_peer_blocks = n.min(ferroccl_core::tune::PEER_MAX_BLOCKS);
        c.validate().map_err(|e| format!("--max-ctas {n}: {e}"))?;
    }
    Ok(c)
}

/// The communicators of this process for the launch mode the arguments and the environment
/// say, with a description of the mode.
pub(super) fn make_comms(
    args: &BenchArgs,
    config: &Config,
    launched: Option<&LaunchEnv>,
) -> Result<(String, Vec<Comm>), String> {
    // (--vs-nccl, whose NCCL refuses two ranks on one GPU, is refused with it by the parser.)
    if args.devices.is_some() && launched.is_some() {
        return Err("--devices: ranks on chosen GPUs are for one process alone, not under a launcher (each rank takes GPU LOCAL_RANK there)".into());
    }
    Ok(match launched {
        Some(env) if args.gpus > 0 => {
            let comm = Comm::from_env_gpu(config).map_err(|e| {
                format!(
                    "joining the {} job on GPU {}: {e}",
                    env.source, env.local_rank
                )
            })?;
            (
                format!("one process per GPU, {} launcher", env.source),
                vec![comm],
            )
        }
        Some(env) => {
            let comm = Comm::from_env(config)
                .map_err(|e| format!("joining the {} job: {e}", env.source))?;
            (
                format!("one process per rank, {} launcher", env.source),
                vec![comm],
            )
        }
        None if args.gpus > 0 => {
            let ordinals: Vec<usize> = args
                .devices
                .clone()
                .unwrap_or_else(|| (0..args.gpus).collect());
            let devices: Vec<Device> = ordinals.iter().map(|&o| Device::Cuda(o)).collect();
            let comms = Comm::init_devices(&devices, config)
                .map_err(|e| format!("creating {} GPU ranks: {e}", args.gpus))?;
            let what = match &args.devices {
                Some(d) => format!(
                    "{} ranks on GPUs {d:?} driven by one process (a thread each)",
                    d.len()
                ),
                None => format!("{} GPUs driven by one process (a thread each)", args.gpus),
            };
            (what, comms)
        }
        None => {
            if args.ranks == 0 {
                return Err("--ranks must be at least 1".into());
            }
            let comms = Comm::init_all(args.ranks, config)
                .map_err(|e| format!("creating {} ranks: {e}", args.ranks))?;
            ("threads of one process".to_string(), comms)
        }
    })
}

/// `f` on every item at once, a thread each: for calls that are collective over the ranks of
/// this process (window registration), which one thread cannot make for several ranks in turn.
fn on_each<I: Send, T: Send>(
    items: impl IntoIterator<Item = I>,
    f: impl Fn(I) -> Result<T, Error> + Sync,
) -> Result<Vec<T>, Error> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = items.into_iter().map(|i| s.spawn(move || f(i))).collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Internal("a rank's thread panicked".into())))
            })
            .collect()
    })
}

/// One buffer of a rank, reached through `addr` by both libraries and the checks.
struct Buffer {
    addr: u64,
    /// What `addr` points into on the host backend: words, so that every element type is aligned.
    _host: Vec<u64>,
    dev: Option<DeviceBuffer>,
    /// What `addr` points into under `--buffers driver`.
    _driver: Option<cu::DriverAlloc>,
}

impl Buffer {
    fn new(
        gpu: Option<&Gpu>,
        bytes: usize,
        register: bool,
        buffers: Buffers,
        stats: &Arc<MemStats>,
    ) -> Result<Buffer, Error> {
        let Some(g) = gpu else {
            let mut host = vec![u64::from_ne_bytes([FILL; 8]); bytes.div_ceil(8)];
            return Ok(Buffer {
                addr: host.as_mut_ptr() as u64,
                _host: host,
                dev: None,
                _driver: None,
            });
        };
        if buffers == Buffers::Driver && !register {
            let d = cu::DriverAlloc::new(g, bytes)?;
            cu::memset(g, d.ptr(), FILL, bytes)?;
            return Ok(Buffer {
                addr: d.ptr(),
                _host: Vec::new(),
                dev: None,
                _driver: Some(d),
            });
        }
        // Windows are made of ferroccl::mem's buffers, as --register promises.
        let b = if register {
            ferroccl::mem::alloc(g, bytes, stats)?
        } else {
            DeviceBuffer::alloc(g, bytes, &[], stats)?
        };
        cu::memset(g, b.device_ptr(), FILL, bytes)?;
        Ok(Buffer {
            addr: b.device_ptr(),
            _host: Vec::new(),
            dev: Some(b),
            _driver: None,
        })
    }
}

/// The buffers a rank owns, freed (and deregistered) before the memory readings at the end.
struct RankBufs {
    send: Buffer,
    recv: Buffer,
    /// NCCL's own buffers under --register: (send, recv) from ncclMemAlloc and registrations.
    nccl: Option<(u64, u64, Vec<Registration>)>,
}

pub struct Job {
    pub comms: Vec<Comm>,
    pub mode: String,
    /// The launch mode in a word, for plot legends.
    pub short: &'static str,
    pub nranks: usize,
    pub nccl: Option<NcclSide>,
    ncomms: Vec<NcclComm>,
    /// The GPU of each communicator of this process; none on the host backend.
    gpus: Vec<Gpu>,
    bytes: usize,
    register: bool,
    buffers: Buffers,
    bufs: Vec<RankBufs>,
    mem: Readings,
}

impl Job {
    pub fn open(
        args: &BenchArgs,
        config: &Config,
        spec: &Spec,
        nccl: Option<NcclSide>,
    ) -> Result<Job, String> {
        let launched = crate::launcher_env()?;
        if args.one_thread && launched.is_some() {
            return Err(
                "--one-thread needs every rank in this process (not under a launcher)".into(),
            );
        }
        let mut mem = Readings::default();
        // Beside NCCL the GPUs' contexts come first, so that the free-memory deltas below are
        // the communicators' alone.
        let opened: Vec<Gpu> =
            match (&nccl, &launched) {
                (None, _) => Vec::new(),
                (Some(_), Some(env)) => vec![Gpu::open(env.local_rank)
                    .map_err(|e| format!("GPU {}: {e}", env.local_rank))?],
                (Some(_), None) => (0..args.gpus)
                    .map(|o| Gpu::open(o).map_err(|e| format!("GPU {o}: {e}")))
                    .collect::<Result<_, _>>()?,
            };
        mem.free_start = free_of(&opened)?;
        let (mode, comms) = make_comms(args, config, launched.as_ref())?;
        let (mode, short) = match (&launched, args.one_thread) {
            (Some(_), _) => (mode, "processes"),
            (None, true) => (format!("{mode}, one thread driving all"), "one thread"),
            (None, false) => (mode, "threads"),
        };
        let gpus = if nccl.is_some() {
            opened
        } else {
            comms.iter().filter_map(|c| c.gpu().cloned()).collect()
        };
        let mut job = Job {
            nranks: comms[0].nranks(),
            comms,
            mode,
            short,
            nccl,
            ncomms: Vec::new(),
            gpus,
            bytes: spec.buffer_bytes(),
            register: spec.register,
            buffers: spec.buffers,
            bufs: Vec::new(),
            mem,
        };
        job.mem.accounted_init = job.comms.iter().map(|c| c.device_memory_bytes()).collect();
        if job.nccl.is_some() {
            job.mem.free_ferroccl = free_of(&job.gpus)?;
        }
        if spec.root >= job.nranks && spec.ops.iter().any(|o| o.has_root()) {
            return Err(format!(
                "root {} is not below the {} ranks",
                spec.root, job.nranks
            ));
        }
        if let Some(n) = &job.nccl {
            job.ncomms = job.nccl_comms(&n.lib, launched.is_some())?;
            job.mem.free_nccl = free_of(&job.gpus)?;
        }
        job.alloc_buffers()?;
        Ok(job)
    }

    fn nccl_comms(&self, lib: &Nccl, launched: bool) -> Result<Vec<NcclComm>, String> {
        if !launched {
            let ordinals: Vec<usize> = self.gpus.iter().map(|g| g.ordinal()).collect();
            return lib.init_all(&ordinals).map_err(|e| e.to_string());
        }
        let comm = &self.comms[0];
        // Rank 0's id reaches everyone through the ferroccl communicator's bootstrap.
        let mine = if comm.rank() == 0 {
            lib.unique_id().map_err(|e| e.to_string())?.to_bytes()
        } else {
            vec![0u8; 128]
        };
        let all = comm
            .allgather_bytes(&mine)
            .map_err(|e| format!("sharing the NCCL id: {e}"))?;
        let id = UniqueId::from_bytes(&all[0]).ok_or("rank 0 sent an NCCL id of the wrong size")?;
        self.gpus[0].bind().map_err(|e| e.to_string())?;
        Ok(vec![lib
            .init_rank(self.nranks, &id, comm.rank())
            .map_err(|e| e.to_string())?])
    }

    fn alloc_buffers(&mut self) -> Result<(), String> {
        let (bytes, stats) = (self.bytes, MemStats::new());
        for i in 0..self.comms.len() {
            let gpu = self.gpus.get(i);
            let place = gpu.map_or("host".to_string(), |g| format!("GPU {}", g.ordinal()));
            let alloc = || {
                Buffer::new(gpu, bytes, self.register, self.buffers, &stats)
                    .map_err(|e| format!("{place}: {bytes} bytes: {e}"))
            };
            let (send, recv) = (alloc()?, alloc()?);
            let nccl = match (&self.nccl, gpu) {
                (Some(n), Some(g)) if n.reg != Register::Off => {
                    g.bind().map_err(|e| e.to_string())?;
                    let s = n.lib.mem_alloc(bytes).map_err(|e| e.to_string())? as u64;
                    let r = n.lib.mem_alloc(bytes).map_err(|e| e.to_string())? as u64;
                    for p in [s, r] {
                        cu::memset(g, p, FILL, bytes).map_err(|e| e.to_string())?;
                    }
                    Some((s, r, Vec::new()))
                }
                _ => None,
            };
            self.bufs.push(RankBufs { send, recv, nccl });
        }
        if self.register {
            if let Some(n) = &self.nccl {
                register_all(
                    &n.lib,
                    &self.gpus,
                    &self.ncomms,
                    &mut self.bufs,
                    bytes,
                    n.reg == Register::Symmetric,
                )
                .map_err(|e| e.to_string())?;
            }
            // ferroccl's buffers become windows: zero-copy (beside NCCL: against its registered
            // buffers).
            windows(&self.comms, &self.bufs, true).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// ferroccl, and NCCL beside it.
    pub fn libs(&self) -> Vec<Lib<'_>> {
        std::iter::once(Lib::Ferroccl)
            .chain(self.nccl.as_ref().map(|n| Lib::Nccl(&n.lib)))
            .collect()
    }

    /// The ranks of this process as the sweep drives them. Under --check each GPU rank's
    /// verifier is taken here, once, so that no row pays for it.
    pub fn contexts(&self, check: bool) -> Result<Vec<RankCtx<'_>>, String> {
        let mut out = Vec::new();
        for (i, comm) in self.comms.iter().enumerate() {
            let b = &self.bufs[i];
            let ferroccl = Side {
                send: b.send.addr,
                recv: b.recv.addr,
            };
            let nccl = self.ncomms.get(i).map(|&nc| {
                (
                    nc,
                    b.nccl
                        .as_ref()
                        .map_or(ferroccl, |(s, r, _)| Side { send: *s, recv: *r }),
                )
            });
            let gpu = self.gpus.get(i).map(|g| (g.clone(), comm.cuda_stream()));
            let check = if check {
                comm.gpu_verifier()
                    .map_err(|e| format!("rank {}: the GPU verifier: {e}", comm.rank()))?
            } else {
                None
            };
            out.push(RankCtx {
                comm,
                gpu,
                check,
                ferroccl,
                nccl,
                bytes: self.bytes,
            });
        }
        Ok(out)
    }

    /// Takes the job down after a sweep that ended well: the benchmark's buffers go first, then
    /// NCCL's communicators, then ferroccl's. Beside NCCL, what each rank's GPU memory was
    /// at each step.
    pub fn close(&mut self) -> Result<Vec<RankMemory>, String> {
        let bufs = std::mem::take(&mut self.bufs);
        let ranks: Vec<usize> = self.comms.iter().map(|c| c.rank()).collect();
        self.mem.accounted_end = self.comms.iter().map(|c| c.device_memory_bytes()).collect();
        if self.register {
            // Whether registering paid: messages peers stored straight into each rank's outputs.
            for c in &self.comms {
                if let Some(Ok(d)) = c.direct_rounds() {
                    println!("# direct rounds received, rank {}: {d}", c.rank());
                }
            }
            windows(&self.comms, &bufs, false).map_err(|e| e.to_string())?;
        }
        let Some(n) = &self.nccl else {
            // Alone: ferroccl's own count is all there is to say (free-memory deltas need the
            // readings taken around NCCL).
            if !self.gpus.is_empty() {
                super::memory::print_alone(
                    &ranks,
                    &self.gpus,
                    &self.mem.accounted_init,
                    &self.mem.accounted_end,
                );
            }
            return Ok(Vec::new());
        };
        free_buffers(
            &n.lib,
            &self.gpus,
            &self.ncomms,
            bufs,
            n.reg == Register::Symmetric,
        )
        .map_err(|e| e.to_string())?;
        self.mem.free_end = free_of(&self.gpus)?;
        for c in self.ncomms.drain(..) {
            n.lib.destroy(c).map_err(|e| e.to_string())?;
        }
        self.mem.free_nccl_gone = free_of(&self.gpus)?;
        self.comms.clear();
        self.mem.free_gone = free_of(&self.gpus)?;
        Ok(self.mem.per_rank(&ranks, &self.gpus))
    }
}

/// Registers NCCL's buffers with its communicators. Symmetric windows are collective: with
/// several ranks in this process, one group spans them (a lone call would wait for the others).
fn register_all(
    lib: &Nccl,
    gpus: &[Gpu],
    ncomms: &[NcclComm],
    bufs: &mut [RankBufs],
    bytes: usize,
    symmetric: bool,
) -> Result<(), Error> {
    let grouped = symmetric && ncomms.len() > 1;
    if grouped {
        lib.group_start()?;
    }
    let mut res = Ok(());
    for ((g, &nc), b) in gpus.iter().zip(ncomms).zip(bufs.iter_mut()) {
        let Some((s, r, regs)) = b.nccl.as_mut() else {
            continue;
        };
        res = g.bind().and_then(|()| {
            for p in [*s, *r] {
                // SAFETY: p is an ncclMemAlloc allocation of `bytes`, freed after deregistration.
                regs.push(unsafe {
                    lib.register(nc, p as usize as *mut c_void, bytes, symmetric)?
                });
            }
            Ok(())
        });
        if res.is_err() {
            break;
        }
    }
    let end = if grouped { lib.group_end() } else { Ok(()) };
    res.and(end)
}

/// Registers (or deregisters) ferroccl's buffers of every rank of this process as symmetric
/// windows: a thread per communicator, since each call is collective.
fn windows(comms: &[Comm], bufs: &[RankBufs], register: bool) -> Result<(), Error> {
    on_each(comms.iter().zip(bufs), |(c, b)| {
        for buf in [&b.send.dev, &b.recv.dev] {
            let buf = buf.as_ref().ok_or_else(|| {
                Error::InvalidArgument(
                    "--register registers GPU memory: this run is on the host backend".into(),
                )
            })?;
            // Every rank allocates the same sizes in the same order: symmetric windows.
            if register {
                c.register_symmetric_buffer(buf)?
            } else {
                c.deregister_window(buf.device_ptr())?
            }
        }
        Ok(())
    })
    .map(|_| ())
}

/// Deregisters and frees NCCL's buffers (grouped like registration) and drops ferroccl's.
fn free_buffers(
    lib: &Nccl,
    gpus: &[Gpu],
    ncomms: &[NcclComm],
    bufs: Vec<RankBufs>,
    symmetric: bool,
) -> Result<(), Error> {
    let grouped = symmetric && ncomms.len() > 1 && bufs.iter().any(|b| b.nccl.is_some());
    if grouped {
        lib.group_start()?;
    }
    let mut res = Ok(());
    for ((g, &nc), b) in gpus.iter().zip(ncomms).zip(&bufs) {
        if let Some((_, _, regs)) = &b.nccl {
            let _ = g.bind();
            for r in regs {
                res = res.and(lib.deregister(nc, r));
            }
        }
    }
    let end = if grouped { lib.group_end() } else { Ok(()) };
    res = res.and(end);
    for (g, b) in gpus.iter().zip(bufs) {
        if let Some((s, r, _)) = b.nccl {
            g.bind()?;
            // SAFETY: deregistered above; no stream uses them any more.
            unsafe {
                res = res.and(lib.mem_free(s as usize as *mut c_void));
                res = res.and(lib.mem_free(r as usize as *mut c_void));
            }
        }
        drop(b.send);
        drop(b.recv);
    }
    res
}
