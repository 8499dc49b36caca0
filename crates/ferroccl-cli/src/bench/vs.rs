//! `ferroccl bench --vs-nccl`: ferroccl and NVIDIA's NCCL timed side by side, in one run, on
//! the same GPUs, the same buffers (unless `--register`) and the same CUDA streams, size by
//! size (ferroccl, then NCCL, then the next size), so that clock and thermal drift hit both.
//!
//! Each rank drives an NCCL communicator created beside its ferroccl one over the same ranks
//! (one id for the job, handed round through the ferroccl communicator when ranks are
//! processes). Both are timed the same way: host clock around back-to-back launches and one
//! stream synchronisation, or around replays of a CUDA graph holding the row's iterations.

use super::cuda::{self as cu, Stream};
use super::record::{LibResult, NcclInfo, RankMemory, VsOptions, VsRecord, VsRow};
use super::table::Measure;
use super::*;
use crate::machine::GpuMachine;
use crate::nccl::{sys::UniqueId, Nccl, NcclComm, Registration};
use ferroccl::mem::Gpu;
use std::ffi::c_void;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Register {
    Off,
    Local,
    Symmetric,
}

impl Register {
    fn parse(arg: Option<&str>, lib: &Nccl) -> Result<Register, String> {
        let r = match arg {
            None => return Ok(Register::Off),
            Some("auto") if lib.has_window_register() => Register::Symmetric,
            Some("auto") | Some("local") => Register::Local,
            Some("symmetric") | Some("window") => Register::Symmetric,
            Some(x) => return Err(format!("--register {x}: one of symmetric, local (or no value)")),
        };
        if !lib.has_mem_alloc() {
            return Err(format!("--register needs ncclMemAlloc, which NCCL {} lacks", lib.version_string()));
        }
        match r {
            Register::Symmetric if !lib.has_window_register() => {
                Err(format!("--register symmetric needs ncclCommWindowRegister (NCCL 2.27+); NCCL {} lacks it", lib.version_string()))
            }
            Register::Local if !lib.has_local_register() => Err(format!("--register local needs ncclCommRegister; NCCL {} lacks it", lib.version_string())),
            r => Ok(r),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Register::Off => "off",
            Register::Local => "local",
            Register::Symmetric => "symmetric",
        }
    }
}

/// NVLink multicast (NVLS) must stay off on the shared GPU hosts; NCCL reads this variable
/// when a communicator is created, so it is set before any is. A user who asks for NVLS is
/// refused rather than ignored.
fn ensure_nvls_off() -> Result<String, String> {
    match std::env::var("NCCL_NVLS_ENABLE") {
        Ok(v) if v.trim() == "0" => Ok("0 (already set)".into()),
        Ok(v) if !v.trim().is_empty() => Err(format!(
            "NCCL_NVLS_ENABLE={v}: NVLink multicast must stay off on these machines; unset it or set it to 0"
        )),
        _ => {
            // Set on the main thread before any NCCL or rank thread exists.
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
            Ok("0 (set by ferroccl bench)".into())
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lib {
    Ferroccl,
    Nccl,
}

/// Device base addresses of a rank's two buffers for one library.
#[derive(Clone, Copy, Debug)]
struct Side {
    send: u64,
    recv: u64,
}

/// What one rank needs to run either library.
struct RankCtx<'a> {
    comm: &'a Comm,
    nc: NcclComm,
    gpu: Gpu,
    stream: Stream,
    f: Side,
    n: Side,
}

// SAFETY: the stream and NCCL handles are used by one thread at a time (the one driving this
// rank, or the one driving all of them).
unsafe impl Send for RankCtx<'_> {}
unsafe impl Sync for RankCtx<'_> {}

impl RankCtx<'_> {
    fn side(&self, lib: Lib) -> Side {
        match lib {
            Lib::Ferroccl => self.f,
            Lib::Nccl => self.n,
        }
    }
}

/// The buffers a rank owns, freed (and deregistered) before the memory readings at the end.
struct RankBufs {
    f_send: DeviceBuffer,
    f_recv: DeviceBuffer,
    /// NCCL's own buffers under --register: (send, recv) from ncclMemAlloc and registrations.
    nccl: Option<(u64, u64, Vec<Registration>)>,
}

/// One library's result of one half of a row on this thread's ranks.
#[derive(Clone, Copy, Debug, Default)]
struct Half {
    time_us: f64,
    wrong: u64,
    blocks: u32,
}

/// NCCL defines no in-place all-to-all (its send/receive pairs would overwrite data not yet
/// sent); the sendrecv ring has no in-place form for either library.
fn nccl_has_in_place(op: BenchOp) -> bool {
    op.has_in_place() && op != BenchOp::AllToAll
}

struct Runner<'a> {
    lib: &'a Nccl,
    ranks: &'a [RankCtx<'a>],
    nranks: usize,
    spec: &'a Spec,
    graph: u64,
}

impl Runner<'_> {
    /// The ranks of this thread are not all the ranks: line up with the others (out of band)
    /// before a timed loop.
    fn barrier(&self) -> Result<(), Error> {
        if self.ranks.len() < self.nranks {
            self.ranks[0].comm.barrier()?;
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), Error> {
        self.ranks.iter().try_for_each(|r| cu::stream_sync(&r.gpu, r.stream))
    }

    /// Errors the libraries recorded while running (ferroccl's kernels' error word, NCCL's
    /// asynchronous error).
    fn errors(&self, lib: Lib) -> Result<(), Error> {
        for r in self.ranks {
            match lib {
                Lib::Ferroccl => r.comm.synchronize()?,
                Lib::Nccl => self.lib.async_error(r.nc)?,
            }
        }
        Ok(())
    }

    fn ptrs(side: Side, g: &Regions) -> (u64, u64) {
        let recv_base = if g.in_place { side.send } else { side.recv };
        (side.send + g.send_off as u64, recv_base + g.recv_off as u64)
    }

    /// One iteration of the row's operation on every rank of this thread.
    fn launch(&self, lib: Lib, rs: &RowSpec, lay: Layout, regs: &[Regions]) -> Result<(), Error> {
        match lib {
            Lib::Ferroccl => {
                let mut g = Group::new();
                for (r, reg) in self.ranks.iter().zip(regs) {
                    let (s, d) = Self::ptrs(r.f, reg);
                    for a in row_args(rs, lay, self.spec.root, self.nranks, r.comm.rank(), s as usize as *const u8, d as usize as *mut u8) {
                        // SAFETY: the buffers hold the largest row's regions and live until
                        // after the last synchronisation.
                        unsafe { g.push_raw(r.comm, a)? };
                    }
                }
                g.launch()
            }
            Lib::Nccl => {
                let grouped = self.ranks.len() > 1 || matches!(rs.op, BenchOp::AllToAll | BenchOp::Gather | BenchOp::Scatter | BenchOp::SendRecv);
                if grouped {
                    self.lib.group_start()?;
                }
                let res = self.ranks.iter().zip(regs).try_for_each(|(r, reg)| {
                    let (s, d) = Self::ptrs(r.n, reg);
                    // SAFETY: as above.
                    unsafe { nccl_call(self.lib, r, rs, lay, self.spec.root, self.nranks, s, d) }
                });
                // The group is closed even after a failed call, so NCCL's state stays sane.
                let end = if grouped { self.lib.group_end() } else { Ok(()) };
                res.and(end)
            }
        }
    }

    /// Fresh verifiable inputs and a poisoned output, one iteration, then the wrong elements.
    fn check(&self, lib: Lib, rs: &RowSpec, lay: Layout, regs: &[Regions], seed: u64) -> Result<u64, Error> {
        for (r, g) in self.ranks.iter().zip(regs) {
            let (input, _) = check_cases(rs, lay, self.spec.root, self.nranks, r.comm.rank(), seed);
            let (s, d) = Self::ptrs(r.side(lib), g);
            // Poison first: in place the input lies inside the output.
            cu::htod(&r.gpu, d, &vec![POISON; g.recv_len])?;
            let mut inp = vec![0u8; g.send_len];
            input.fill_input(&mut inp);
            cu::htod(&r.gpu, s, &inp)?;
        }
        self.barrier()?;
        self.launch(lib, rs, lay, regs)?;
        self.sync()?;
        self.errors(lib)?;
        let mut wrong = 0;
        for (r, g) in self.ranks.iter().zip(regs) {
            let (_, output) = check_cases(rs, lay, self.spec.root, self.nranks, r.comm.rank(), seed);
            let (_, d) = Self::ptrs(r.side(lib), g);
            let mut out = vec![0u8; g.recv_len];
            cu::dtoh(&r.gpu, &mut out, d)?;
            let mut first = None;
            let w = output.count_wrong(&out, &mut first) as u64;
            if let Some((j, got, want)) = first {
                tracing::warn!(
                    "{:?} {} {} count {} {}: rank {} element {j} is {got}, expected {want} ({w} wrong)",
                    lib,
                    rs.op.name(),
                    rs.dtype,
                    lay.count,
                    if g.in_place { "in place" } else { "out of place" },
                    r.comm.rank()
                );
            }
            wrong += w;
        }
        Ok(wrong)
    }

    /// Captures `n_ops` iterations on every stream of this thread. The captures are ended
    /// whatever happens, so that a failure leaves the streams usable.
    fn capture(&self, lib: Lib, rs: &RowSpec, lay: Layout, regs: &[Regions], n_ops: u64) -> Result<Vec<cu::Captured>, Error> {
        let mut begun = 0;
        let mut res = Ok(());
        for r in self.ranks {
            if let Err(e) = cu::begin_capture(&r.gpu, r.stream) {
                res = Err(e);
                break;
            }
            begun += 1;
        }
        if res.is_ok() {
            res = (0..n_ops).try_for_each(|_| self.launch(lib, rs, lay, regs));
        }
        let mut caps = Vec::new();
        for r in &self.ranks[..begun] {
            match cu::end_capture(&r.gpu, r.stream) {
                Ok(c) => caps.push(c),
                Err(e) => res = res.and(Err(e)),
            }
        }
        res.map(|()| caps)
    }

    /// Thread blocks of NCCL's kernels for one iteration, read from a captured copy of it
    /// (the grid NCCL chose: one block per channel). The copy is run once, as a warm-up.
    fn nccl_blocks_probe(&self, rs: &RowSpec, lay: Layout, regs: &[Regions]) -> Result<u32, Error> {
        let caps = self.capture(Lib::Nccl, rs, lay, regs, 1)?;
        let mut blocks = 0;
        for c in &caps {
            blocks = blocks.max(c.kernel_grids()?.into_iter().max().unwrap_or(0));
        }
        let graphs = caps.into_iter().map(|c| c.instantiate()).collect::<Result<Vec<_>, _>>()?;
        for (r, g) in self.ranks.iter().zip(&graphs) {
            g.launch(r.stream)?;
        }
        self.sync()?;
        Ok(blocks)
    }

    /// One library, one half of a row: check (with --check), warm up, time.
    fn measure(&self, lib: Lib, rs: &RowSpec, lay: Layout, in_place: bool) -> Result<Half, Error> {
        let regs = self
            .ranks
            .iter()
            .map(|r| Regions::new(rs.op, lay.count, rs.dtype, self.nranks, r.comm.rank(), self.spec.root, in_place))
            .collect::<Result<Vec<_>, _>>()?;
        let (iters, warmup) = self.spec.iters_for(rs.size);
        let mut half = Half::default();
        if self.spec.check {
            half.wrong = self.check(lib, rs, lay, &regs, mix(mix(rs.index) ^ in_place as u64))?;
        }
        // Rows whose count rounds down to 0 launch nothing in either library: there is no
        // graph to capture and no grid to read.
        let graph = if lay.count > 0 { self.graph } else { 0 };
        // A graph may hold only launches seen before: ferroccl uploads an operation's tables
        // (a synchronous copy) on its first call.
        let warmup = if graph > 0 { warmup.max(1) } else { warmup };
        for _ in 0..warmup {
            self.launch(lib, rs, lay, &regs)?;
        }
        self.sync()?;
        half.time_us = if graph > 0 {
            let caps = self.capture(lib, rs, lay, &regs, iters)?;
            if lib == Lib::Nccl {
                for c in &caps {
                    half.blocks = half.blocks.max(c.kernel_grids()?.into_iter().max().unwrap_or(0));
                }
            }
            let graphs = caps.into_iter().map(|c| c.instantiate()).collect::<Result<Vec<_>, _>>()?;
            // The first replay uploads the graph to the GPU: untimed.
            for (r, g) in self.ranks.iter().zip(&graphs) {
                g.launch(r.stream)?;
            }
            self.sync()?;
            self.barrier()?;
            let t = Instant::now();
            for _ in 0..graph {
                for (r, g) in self.ranks.iter().zip(&graphs) {
                    g.launch(r.stream)?;
                }
            }
            self.sync()?;
            t.elapsed().as_secs_f64() * 1e6 / (graph * iters) as f64
        } else {
            if lib == Lib::Nccl && lay.count > 0 {
                half.blocks = self.nccl_blocks_probe(rs, lay, &regs)?;
            }
            self.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                self.launch(lib, rs, lay, &regs)?;
            }
            self.sync()?;
            t.elapsed().as_secs_f64() * 1e6 / iters as f64
        };
        if lib == Lib::Ferroccl {
            half.blocks = self.ranks.iter().filter_map(|r| r.comm.last_launch_blocks()).max().unwrap_or(0);
        }
        self.errors(lib)?;
        Ok(half)
    }

    /// The whole sweep on this thread's ranks; rows go to `report` (rank 0's thread).
    fn sweep(&self, mut report: Option<&mut VsReporter>) -> Result<(u64, u64), Error> {
        let (mut fw, mut nw) = (0u64, 0u64);
        for &op in &self.spec.ops {
            if let Some(r) = report.as_deref_mut() {
                r.begin(op);
            }
            for rs in self.spec.rows(op) {
                let lay = op.layout(rs.size, rs.dtype, self.nranks);
                // ferroccl, then NCCL, for each half: both see the same moment of the machine.
                let f_oop = self.measure(Lib::Ferroccl, &rs, lay, false)?;
                let n_oop = self.measure(Lib::Nccl, &rs, lay, false)?;
                let f_ip = if op.has_in_place() { Some(self.measure(Lib::Ferroccl, &rs, lay, true)?) } else { None };
                let n_ip = if nccl_has_in_place(op) { Some(self.measure(Lib::Nccl, &rs, lay, true)?) } else { None };
                let h = |x: Option<Half>| x.unwrap_or_default();
                // The slowest rank's time, the most blocks, the wrong elements of all.
                let mut times = [f_oop.time_us, n_oop.time_us, h(f_ip).time_us, h(n_ip).time_us, f_oop.blocks as f64, n_oop.blocks as f64];
                let mut wrong = [f_oop.wrong, n_oop.wrong, h(f_ip).wrong, h(n_ip).wrong];
                if self.ranks.len() < self.nranks {
                    allreduce_max_f64(self.ranks[0].comm, &mut times)?;
                    allreduce_sum_u64(self.ranks[0].comm, &mut wrong)?;
                }
                fw += wrong[0] + wrong[2];
                nw += wrong[1] + wrong[3];
                if let Some(r) = report.as_deref_mut() {
                    let check = self.spec.check;
                    let m = |t: f64, w: u64| {
                        let (algbw, busbw) = bandwidths(op, lay.bytes, t, self.nranks);
                        Measure { time_us: t, algbw, busbw, wrong: check.then_some(w) }
                    };
                    let mut row = VsRow {
                        op: op.name().into(),
                        size: lay.bytes,
                        count: lay.count,
                        dtype: rs.dtype.name().into(),
                        redop: rs.redop.map_or("none", |o| o.name()).into(),
                        root: if op.has_root() { self.spec.root as i64 } else { -1 },
                        ferroccl: LibResult { out_of_place: m(times[0], wrong[0]), in_place: f_ip.map(|_| m(times[2], wrong[2])), blocks: Some(times[4] as u32) },
                        nccl: LibResult { out_of_place: m(times[1], wrong[1]), in_place: n_ip.map(|_| m(times[3], wrong[3])), blocks: Some(times[5] as u32) },
                        ratio_out_of_place: None,
                        ratio_in_place: None,
                    };
                    row.fill_ratios();
                    r.row(row);
                }
            }
            if let Some(r) = report.as_deref_mut() {
                r.end();
            }
        }
        Ok((fw, nw))
    }
}

/// NCCL's calls for one iteration of a row on one rank. All-to-all, gather and scatter are
/// NCCL collectives from 2.28 on; before that they are composed of sends and receives in a
/// group, as nccl-tests does.
///
/// # Safety
/// `s` and `d` address device memory of the rank's GPU holding the row's regions.
#[allow(clippy::too_many_arguments)]
unsafe fn nccl_call(lib: &Nccl, r: &RankCtx, rs: &RowSpec, lay: Layout, root: usize, n: usize, s: u64, d: u64) -> Result<(), Error> {
    let me = r.comm.rank();
    let (c, dt, st, nc) = (lay.count, rs.dtype.nccl_id(), r.stream, r.nc);
    let op = rs.redop.unwrap_or(ReduceOp::Sum).nccl_id();
    let blk = (c * rs.dtype.size()) as u64;
    let sp = |off: u64| (s + off) as usize as *const c_void;
    let dp = |off: u64| (d + off) as usize as *mut c_void;
    unsafe {
        match rs.op {
            BenchOp::AllReduce => lib.all_reduce(sp(0), dp(0), c, dt, op, nc, st),
            BenchOp::AllGather => lib.all_gather(sp(0), dp(0), c, dt, nc, st),
            BenchOp::ReduceScatter => lib.reduce_scatter(sp(0), dp(0), c, dt, op, nc, st),
            BenchOp::Broadcast => lib.broadcast(sp(0), dp(0), c, dt, root, nc, st),
            BenchOp::Reduce => lib.reduce(sp(0), dp(0), c, dt, op, root, nc, st),
            BenchOp::AllToAll => {
                if !lib.all_to_all(sp(0), dp(0), c, dt, nc, st)? {
                    for p in 0..n {
                        lib.send(sp(p as u64 * blk), c, dt, p, nc, st)?;
                        lib.recv(dp(p as u64 * blk), c, dt, p, nc, st)?;
                    }
                }
                Ok(())
            }
            BenchOp::Gather => {
                if !lib.gather(sp(0), dp(0), c, dt, root, nc, st)? {
                    lib.send(sp(0), c, dt, root, nc, st)?;
                    if me == root {
                        for p in 0..n {
                            lib.recv(dp(p as u64 * blk), c, dt, p, nc, st)?;
                        }
                    }
                }
                Ok(())
            }
            BenchOp::Scatter => {
                if !lib.scatter(sp(0), dp(0), c, dt, root, nc, st)? {
                    if me == root {
                        for p in 0..n {
                            lib.send(sp(p as u64 * blk), c, dt, p, nc, st)?;
                        }
                    }
                    lib.recv(dp(0), c, dt, root, nc, st)?;
                }
                Ok(())
            }
            BenchOp::SendRecv => {
                lib.send(sp(0), c, dt, (me + 1) % n, nc, st)?;
                lib.recv(dp(0), c, dt, (me + n - 1) % n, nc, st)
            }
        }
    }
}

/// Rank 0's printer and row keeper.
struct VsReporter {
    rows: Vec<VsRow>,
    section_start: usize,
    check: bool,
}

impl VsReporter {
    fn begin(&mut self, op: BenchOp) {
        self.section_start = self.rows.len();
        println!("#\n# {}\n{}", op.name(), vs_table::header(self.check));
    }
    fn row(&mut self, r: VsRow) {
        println!("{}", vs_table::format_row(&r, self.check));
        // Progress for logs and for scripts that watch a long sweep.
        let _ = std::io::Write::flush(&mut std::io::stdout());
        self.rows.push(r);
    }
    fn end(&mut self) {
        println!("{}", vs_table::footer(&self.rows[self.section_start..]));
    }
}

fn mib(b: i64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

fn free_of(gpus: &[Gpu]) -> Result<Vec<u64>, String> {
    gpus.iter().map(|g| cu::mem_info(g).map(|m| m.0).map_err(|e| e.to_string())).collect()
}

/// The buffer size every row fits in: the largest size (nccl-tests' convention makes it the
/// largest buffer of any operation), in whole 2 MiB granules so that symmetric registration
/// sees equal, aligned sizes on every rank.
fn buffer_bytes(spec: &Spec) -> usize {
    let max = spec.sizes.iter().copied().max().unwrap_or(0).max(1);
    max.div_ceil(2 << 20) * (2 << 20)
}

fn label(mode_short: &str, graph: u64, reg: Register, max_ctas: Option<usize>) -> String {
    let mut s = mode_short.to_string();
    if graph > 0 {
        s += ", graph";
    }
    if reg != Register::Off {
        s += &format!(", registered ({})", reg.name());
    }
    if let Some(n) = max_ctas {
        s += &format!(", max {n} CTAs");
    }
    s
}

pub fn main(args: &BenchArgs, config: &Config, spec: &Spec) -> Result<std::process::ExitCode, String> {
    if args.gpus == 0 {
        return Err("--vs-nccl compares GPU libraries: add -g N (N GPUs in this process, or -g 1 under a launcher)".into());
    }
    if spec.redops.iter().any(|o| matches!(o, ReduceOp::PreMulSum(_))) {
        return Err("--vs-nccl: premulsum is not compared (NCCL needs a per-communicator operator for it)".into());
    }
    let nvls = ensure_nvls_off()?;
    let path = args.vs_nccl.as_deref().filter(|p| !p.is_empty()).map(Path::new);
    let lib = Nccl::load(path)?;
    let reg = Register::parse(args.register.as_deref(), &lib)?;
    let launched = crate::launcher_env()?;
    if args.one_thread && launched.is_some() {
        return Err("--one-thread needs every rank in this process (not under a launcher)".into());
    }
    let ordinals: Vec<usize> = match &launched {
        Some(env) => vec![env.local_rank],
        None => (0..args.gpus).collect(),
    };
    // Contexts first, so that the free-memory deltas below are the communicators' alone.
    let gpus: Vec<Gpu> = ordinals.iter().map(|&o| Gpu::open(o).map_err(|e| format!("GPU {o}: {e}"))).collect::<Result<_, _>>()?;
    let free0 = free_of(&gpus)?;
    let (mode, comms) = make_comms(args, config)?;
    let (mode, short) = match (&launched, args.one_thread) {
        (Some(_), _) => (mode, "processes"),
        (None, true) => (format!("{mode}, one thread driving all"), "one thread"),
        (None, false) => (mode, "threads"),
    };
    let acc_init: Vec<u64> = comms.iter().map(|c| c.device_memory_bytes()).collect();
    let free1 = free_of(&gpus)?;
    let nranks = comms[0].nranks();
    if spec.root >= nranks && spec.ops.iter().any(|o| o.has_root()) {
        return Err(format!("root {} is not below the {nranks} ranks", spec.root));
    }
    let ncomms: Vec<NcclComm> = if launched.is_some() {
        let comm = &comms[0];
        // Rank 0's id reaches everyone through the ferroccl communicator's bootstrap.
        let mine = if comm.rank() == 0 { lib.unique_id().map_err(|e| e.to_string())?.to_bytes() } else { vec![0u8; 128] };
        let all = comm.allgather_bytes(&mine).map_err(|e| format!("sharing the NCCL id: {e}"))?;
        let id = UniqueId::from_bytes(&all[0]).ok_or("rank 0 sent an NCCL id of the wrong size")?;
        gpus[0].bind().map_err(|e| e.to_string())?;
        vec![lib.init_rank(nranks, &id, comm.rank()).map_err(|e| e.to_string())?]
    } else {
        lib.init_all(&ordinals).map_err(|e| e.to_string())?
    };
    let free2 = free_of(&gpus)?;

    let bytes = buffer_bytes(spec);
    let stats = MemStats::new();
    let mut bufs = Vec::new();
    for (i, g) in gpus.iter().enumerate() {
        let alloc = || DeviceBuffer::alloc(g, bytes, &[], &stats).map_err(|e| format!("GPU {}: {} bytes: {e}", ordinals[i], bytes));
        let (f_send, f_recv) = (alloc()?, alloc()?);
        // Any data will do for timing; a constant keeps floats finite for a while.
        for b in [&f_send, &f_recv] {
            cu::memset(g, b.device_ptr(), 0x3c, bytes).map_err(|e| e.to_string())?;
        }
        let nccl = if reg != Register::Off {
            g.bind().map_err(|e| e.to_string())?;
            let s = lib.mem_alloc(bytes).map_err(|e| e.to_string())? as u64;
            let r = lib.mem_alloc(bytes).map_err(|e| e.to_string())? as u64;
            for p in [s, r] {
                cu::memset(g, p, 0x3c, bytes).map_err(|e| e.to_string())?;
            }
            Some((s, r, Vec::new()))
        } else {
            None
        };
        bufs.push(RankBufs { f_send, f_recv, nccl });
    }
    if reg != Register::Off {
        register_all(&lib, &gpus, &ncomms, &mut bufs, bytes, reg == Register::Symmetric).map_err(|e| e.to_string())?;
        // ferroccl's buffers become windows too: zero-copy against NCCL's registered buffers.
        windows(&comms, &bufs, true).map_err(|e| e.to_string())?;
    }
    let ctxs: Vec<RankCtx> = comms
        .iter()
        .zip(&ncomms)
        .zip(&bufs)
        .zip(&gpus)
        .map(|(((comm, &nc), b), g)| {
            let f = Side { send: b.f_send.device_ptr(), recv: b.f_recv.device_ptr() };
            let n = b.nccl.as_ref().map_or(f, |(s, r, _)| Side { send: *s, recv: *r });
            RankCtx { comm, nc, gpu: g.clone(), stream: comm.cuda_stream(), f, n }
        })
        .collect();

    let is_rank0 = comms[0].rank() == 0;
    let check = spec.check;
    let mut reporter = is_rank0.then(|| VsReporter { rows: Vec::new(), section_start: 0, check });
    if is_rank0 {
        println!("{}", preamble(&comms[0], spec, &mode));
        println!(
            "# NCCL {} from {} (NCCL_NVLS_ENABLE={nvls}); all-to-all/gather/scatter: {}",
            lib.version_string(),
            lib.path(),
            if lib.has_native_all_to_all() { "NCCL's own calls" } else { "grouped ncclSend/ncclRecv" }
        );
        println!(
            "# timing: {}; buffers: {}; ferroccl GPU channels (blocks per collective): {}",
            if args.graph > 0 { format!("CUDA graph of each row's iterations, replayed {} times", args.graph) } else { "host launches".into() },
            match reg {
                Register::Off => "the same cuMem buffers for both".to_string(),
                r => format!("NCCL's from ncclMemAlloc, registered ({}); ferroccl's from ferroccl::mem, registered as windows (zero-copy)", r.name()),
            },
            config.gpu_channels
        );
    }

    let nccl_aborted = std::sync::atomic::AtomicBool::new(false);
    let result: Result<(u64, u64), Error> = if args.one_thread || ctxs.len() == 1 {
        let r = Runner { lib: &lib, ranks: &ctxs, nranks, spec, graph: args.graph };
        r.sweep(reporter.as_mut())
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = ctxs
                .iter()
                .enumerate()
                .map(|(i, ctx)| {
                    let mut rep = if ctx.comm.rank() == 0 { reporter.take() } else { None };
                    let (lib, ctxs, spec, nccl_aborted) = (&lib, &ctxs, spec, &nccl_aborted);
                    s.spawn(move || {
                        let r = Runner { lib, ranks: std::slice::from_ref(&ctxs[i]), nranks, spec, graph: args.graph };
                        let out = r.sweep(rep.as_mut());
                        if out.is_err() {
                            // The others would wait for this rank until the deadline (ferroccl)
                            // or for ever (NCCL): stop both libraries' kernels.
                            for c in ctxs {
                                c.comm.abort();
                            }
                            if !nccl_aborted.swap(true, std::sync::atomic::Ordering::AcqRel) {
                                for c in ctxs {
                                    let _ = lib.abort(c.nc);
                                }
                            }
                        }
                        (out, rep)
                    })
                })
                .collect();
            let mut total = Ok((0, 0));
            for h in handles {
                let (out, rep) = h.join().unwrap_or_else(|_| (Err(Error::Internal("a rank thread panicked".into())), None));
                if rep.is_some() {
                    reporter = rep;
                }
                total = match (total, out) {
                    // Every thread holds the job's totals (summed over ranks).
                    (Ok(a), Ok(b)) => Ok((a.0.max(b.0), a.1.max(b.1))),
                    (Err(e), _) | (_, Err(e)) => Err(e),
                };
            }
            total
        })
    };
    let (fw, nw) = match result {
        Ok(w) => w,
        Err(e) => {
            // NCCL kernels may wait for a peer that stopped: abort rather than destroy.
            if !nccl_aborted.load(std::sync::atomic::Ordering::Acquire) {
                for c in &ncomms {
                    let _ = lib.abort(*c);
                }
            }
            return Err(e.to_string());
        }
    };

    // Memory at the end: the benchmark's buffers go first, then each communicator, reading
    // the free memory after each step.
    let acc_end: Vec<u64> = comms.iter().map(|c| c.device_memory_bytes()).collect();
    drop(ctxs);
    if reg != Register::Off {
        windows(&comms, &bufs, false).map_err(|e| e.to_string())?;
    }
    free_buffers(&lib, &gpus, &ncomms, bufs, reg == Register::Symmetric).map_err(|e| e.to_string())?;
    let free_end = free_of(&gpus)?;
    for c in &ncomms {
        lib.destroy(*c).map_err(|e| e.to_string())?;
    }
    let free_nccl_gone = free_of(&gpus)?;
    let ranks_here: Vec<usize> = comms.iter().map(|c| c.rank()).collect();
    drop(comms);
    let free_gone = free_of(&gpus)?;
    let memory: Vec<RankMemory> = (0..gpus.len())
        .map(|i| RankMemory {
            rank: ranks_here[i],
            gpu: ordinals[i],
            ferroccl_accounted_init: acc_init[i],
            ferroccl_accounted_end: acc_end[i],
            ferroccl_init_delta: free0[i] as i64 - free1[i] as i64,
            nccl_init_delta: free1[i] as i64 - free2[i] as i64,
            nccl_held_end: free_nccl_gone[i] as i64 - free_end[i] as i64,
            ferroccl_held_end: free_gone[i] as i64 - free_nccl_gone[i] as i64,
            gpu_total: cu::mem_info(&gpus[i]).map(|m| m.1).unwrap_or(0),
        })
        .collect();
    // Every process prints its own ranks (under a launcher the others' figures cannot reach
    // rank 0 any more: the communicators are gone).
    for m in &memory {
        println!(
            "# GPU memory, rank {} (GPU {}): ferroccl holds {} by its own count ({} after init); free-memory deltas: init ferroccl {}, NCCL {}; given back at the end by NCCL {}, by ferroccl {}",
            m.rank,
            m.gpu,
            mib(m.ferroccl_accounted_end as i64),
            mib(m.ferroccl_accounted_init as i64),
            mib(m.ferroccl_init_delta),
            mib(m.nccl_init_delta),
            mib(m.nccl_held_end),
            mib(m.ferroccl_held_end)
        );
    }
    if let Some(rep) = &reporter {
        let wrong_note = if check { format!("# Wrong elements: ferroccl {fw}, NCCL {nw}") } else { "# Wrong elements: N/A (run with --check)".into() };
        println!("{wrong_note}");
        if let Some(p) = &args.json {
            let rec = VsRecord {
                tool: "ferroccl bench --vs-nccl".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                commit: GIT_COMMIT.into(),
                command: std::env::args().collect(),
                label: label(short, args.graph, reg, args.max_ctas),
                mode: mode.clone(),
                nranks,
                machine: Machine::probe(),
                gpu_machine: GpuMachine::probe(cu::driver_cuda_version()),
                nccl: NcclInfo { path: lib.path().into(), version: lib.version_string(), version_code: lib.version(), native_all_to_all: lib.has_native_all_to_all() },
                options: VsOptions {
                    ops: spec.ops.iter().map(|o| o.name().to_string()).collect(),
                    dtypes: spec.dtypes.iter().map(|d| d.name().to_string()).collect(),
                    redops: spec.redops.iter().map(|o| o.name().to_string()).collect(),
                    min_bytes: spec.sizes.first().copied().unwrap_or(0),
                    max_bytes: spec.sizes.last().copied().unwrap_or(0),
                    iters: spec.iters,
                    warmup: spec.warmup,
                    iter_budget: spec.iter_budget,
                    root: spec.root,
                    check,
                    graph: args.graph,
                    register: reg.name().into(),
                    ferroccl_register: if reg == Register::Off { "off".into() } else { "ferroccl::mem buffers registered as windows (Comm::register_buffer)".into() },
                    max_ctas: args.max_ctas,
                    gpu_channels: config.gpu_channels,
                    nvls: nvls.clone(),
                },
                memory,
                wrong_ferroccl: fw,
                wrong_nccl: nw,
                rows: rep.rows.clone(),
            };
            super::record::write(p, &rec)?;
        }
    }
    if check && (fw > 0 || nw > 0) {
        eprintln!("ferroccl bench: wrong results (ferroccl {fw}, NCCL {nw} elements)");
        return Ok(std::process::ExitCode::from(1));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Registers NCCL's buffers with its communicators. Symmetric windows are collective: with
/// several ranks in this process, one group spans them (a lone call would wait for the others).
fn register_all(lib: &Nccl, gpus: &[Gpu], ncomms: &[NcclComm], bufs: &mut [RankBufs], bytes: usize, symmetric: bool) -> Result<(), Error> {
    let grouped = symmetric && ncomms.len() > 1;
    if grouped {
        lib.group_start()?;
    }
    let mut res = Ok(());
    for ((g, &nc), b) in gpus.iter().zip(ncomms).zip(bufs.iter_mut()) {
        let Some((s, r, regs)) = b.nccl.as_mut() else { continue };
        res = g.bind().and_then(|()| {
            for p in [*s, *r] {
                // SAFETY: p is an ncclMemAlloc allocation of `bytes`, freed after deregistration.
                regs.push(unsafe { lib.register(nc, p as usize as *mut c_void, bytes, symmetric)? });
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

/// Registers (or deregisters) ferroccl's buffers of every rank of this process as windows: a
/// thread per communicator, since each call is collective.
fn windows(comms: &[Comm], bufs: &[RankBufs], register: bool) -> Result<(), Error> {
    super::on_each(comms.iter().zip(bufs), |(c, b)| {
        for buf in [&b.f_send, &b.f_recv] {
            if register { c.register_buffer(buf)? } else { c.deregister_window(buf.device_ptr())? }
        }
        Ok(())
    })
    .map(|_| ())
}

/// Deregisters and frees NCCL's buffers (grouped like registration) and drops ferroccl's.
fn free_buffers(lib: &Nccl, gpus: &[Gpu], ncomms: &[NcclComm], bufs: Vec<RankBufs>, symmetric: bool) -> Result<(), Error> {
    let grouped = symmetric && ncomms.len() > 1 && bufs.iter().any(|b| b.nccl.is_some());
    if grouped {
        lib.group_start()?;
    }
    let mut res = Ok(());
    for ((g, &nc), b) in gpus.iter().zip(ncomms).zip(&bufs) {
        if let Some((_, _, regs)) = &b.nccl {
            let _ = g.bind();
            for r in regs {
                res = res.and(lib.deregister(nc, *r));
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
        drop(b.f_send);
        drop(b.f_recv);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_whole_granules_that_hold_the_largest_row() {
        let mut a = crate::bench::tests::args();
        a.min = 3 << 20;
        a.max = 3 << 20;
        let spec = Spec::from_args(&a).unwrap();
        assert_eq!(buffer_bytes(&spec), 4 << 20);
        a.min = 8;
        a.max = 8;
        assert_eq!(buffer_bytes(&Spec::from_args(&a).unwrap()), 2 << 20);
    }

    #[test]
    fn labels_name_mode_and_options() {
        assert_eq!(label("threads", 0, Register::Off, None), "threads");
        assert_eq!(label("processes", 4, Register::Symmetric, Some(8)), "processes, graph, registered (symmetric), max 8 CTAs");
    }

    #[test]
    fn nccl_in_place_forms() {
        assert!(!nccl_has_in_place(BenchOp::AllToAll));
        assert!(!nccl_has_in_place(BenchOp::SendRecv));
        assert!(nccl_has_in_place(BenchOp::Gather));
        assert!(nccl_has_in_place(BenchOp::AllReduce));
    }

    #[test]
    fn nvls_request_is_refused() {
        // The variable is process-wide: this test only reads it when it is unset, and
        // restores it.
        let before = std::env::var("NCCL_NVLS_ENABLE").ok();
        std::env::set_var("NCCL_NVLS_ENABLE", "1");
        let e = ensure_nvls_off().unwrap_err();
        assert!(e.contains("NCCL_NVLS_ENABLE=1") && e.contains("must stay off"), "{e}");
        std::env::remove_var("NCCL_NVLS_ENABLE");
        assert!(ensure_nvls_off().unwrap().contains("set by ferroccl"));
        assert_eq!(std::env::var("NCCL_NVLS_ENABLE").unwrap(), "0");
        match before {
            Some(v) => std::env::set_var("NCCL_NVLS_ENABLE", v),
            None => std::env::remove_var("NCCL_NVLS_ENABLE"),
        }
    }
}
