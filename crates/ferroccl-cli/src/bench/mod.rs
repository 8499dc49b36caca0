//! `ferroccl bench`: nccl-tests' perf tests for every operation, on ferroccl.

mod cuda;
pub mod op;
pub mod record;
pub mod table;
mod vs;
mod vs_table;

use crate::api::{CollKind, Comm, Config, DataType, Device, Error, Group, OpArgs, ReduceOp};
use ferroccl::mem::{DeviceBuffer, MemStats};
use std::sync::Arc;
use crate::machine::{Machine, GIT_COMMIT};
use crate::size::{human, parse_size, sweep};
use ferroccl_core::numeric::check::CheckCase;
use indicatif::{ProgressBar, ProgressStyle};
use op::{bandwidths, BenchOp, Layout};
use serde::Serialize;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;
use table::{Measure, Row};

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// all-reduce, all-gather, reduce-scatter, broadcast, reduce, alltoall, gather, scatter,
    /// sendrecv, or all
    pub op: String,
    /// Smallest size in bytes (K, M, G suffixes; the largest buffer, as in nccl-tests)
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    pub min: usize,
    /// Largest size in bytes
    #[arg(short = 'e', long = "maxbytes", default_value = "8M", value_parser = parse_size)]
    pub max: usize,
    /// Multiply the size by this from one row to the next (1: add --stepbytes instead)
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub factor: usize,
    /// Bytes added from one row to the next when the factor is 1
    #[arg(short = 'i', long = "stepbytes", default_value = "1M", value_parser = parse_size)]
    pub step: usize,
    /// Timed iterations per row
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub iters: u64,
    /// Untimed iterations before them
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub warmup: u64,
    /// Element type (float, half, bfloat16, int32, ...; all for the 12 types)
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub dtype: String,
    /// Reduction (sum, prod, max, min, avg, premulsum (by 2); all for the six, as nccl-tests)
    #[arg(short = 'o', long = "redop", default_value = "sum")]
    pub redop: String,
    /// Root of broadcast, reduce, gather and scatter
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub root: usize,
    /// Fill inputs with verifiable data and count wrong output elements after every iteration
    #[arg(long)]
    pub check: bool,
    /// Ranks (threads of this process) when no launcher started us
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Run on this many GPUs of this host (one rank each, driven by this process); under a
    /// launcher, any value above 0 puts each process on GPU LOCAL_RANK. 0: host memory.
    /// Default: every GPU there is (under a launcher: GPU LOCAL_RANK), else host memory.
    #[arg(short = 'g', long = "gpus")]
    pub gpus_arg: Option<usize>,
    /// What `-g` resolved to (`BenchArgs::resolve`).
    #[arg(skip)]
    pub gpus: usize,
    /// One thread drives every rank of this process: each iteration is one group over all
    /// communicators (nccl-tests' -g). Default: a thread per rank (nccl-tests' -t).
    #[arg(long)]
    pub one_thread: bool,
    /// Also write every row, the machine and the commit to this JSON file
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Time NVIDIA's NCCL beside ferroccl on the same GPUs, buffers and streams (needs -g).
    /// PATH: libnccl.so.2 or its folder; default: the system loader's, then the Python
    /// package nvidia-nccl's
    #[arg(long = "vs-nccl", value_name = "PATH", num_args = 0..=1, default_missing_value = "")]
    pub vs_nccl: Option<String>,
    /// With --vs-nccl: capture each row's iterations in a CUDA graph and time N replays of
    /// it (nccl-tests' -G N), for both libraries
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub graph: u64,
    /// Registered buffers (nccl-tests' -R): ferroccl's from ferroccl::mem, registered as
    /// windows (zero-copy: peers write straight into them); with --vs-nccl NCCL's from
    /// ncclMemAlloc, registered as symmetric windows (default where NCCL has them) or with
    /// ncclCommRegister ("local")
    #[arg(long, value_name = "KIND", num_args = 0..=1, default_missing_value = "auto")]
    pub register: Option<String>,
    /// Run ferroccl with at most N thread blocks per collective (its GPU channels)
    #[arg(long = "max-ctas", value_name = "N")]
    pub max_ctas: Option<usize>,
    /// Fewer iterations for large rows: a row of S bytes runs min(-n, max(1, BYTES / S))
    /// timed iterations (and no more warm-ups than that)
    #[arg(long = "iter-budget", value_name = "BYTES", value_parser = parse_size)]
    pub iter_budget: Option<usize>,
}

/// Everything every rank must agree on, derived from the arguments.
#[derive(Clone, Debug)]
pub struct Spec {
    pub ops: Vec<BenchOp>,
    pub sizes: Vec<usize>,
    pub dtypes: Vec<DataType>,
    pub redops: Vec<ReduceOp>,
    pub root: usize,
    pub iters: u64,
    pub warmup: u64,
    pub check: bool,
    pub iter_budget: Option<usize>,
    /// GPU buffers from one registered pool per rank (zero-copy), else fresh per row.
    pub register: bool,
}

/// One row of the table before it is measured.
#[derive(Clone, Copy, Debug)]
struct RowSpec {
    op: BenchOp,
    size: usize,
    dtype: DataType,
    /// None for operations that do not reduce.
    redop: Option<ReduceOp>,
    /// Position in the whole run, so that every row gets its own check seeds.
    index: u64,
}

impl Spec {
    pub fn from_args(a: &BenchArgs) -> Result<Spec, String> {
        let dtypes = if a.dtype.eq_ignore_ascii_case("all") {
            DataType::ALL.to_vec()
        } else {
            // A comma list runs several types in one sweep (e.g. `-d float,bfloat16`).
            a.dtype.split(',').map(|d| d.trim().parse::<DataType>().map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?
        };
        let redops = if a.redop.eq_ignore_ascii_case("all") {
            // premulsum by 2: a scalar valid for every type, integers included.
            ReduceOp::BUILTIN.iter().copied().chain([ReduceOp::PreMulSum(2.0)]).collect()
        } else {
            vec![a.redop.parse::<ReduceOp>().map_err(|e| e.to_string())?]
        };
        for &d in &dtypes {
            for &o in &redops {
                o.validate(d).map_err(|e| e.to_string())?;
            }
        }
        if a.min > a.max {
            return Err(format!("-b {} is larger than -e {}", a.min, a.max));
        }
        Ok(Spec {
            ops: BenchOp::parse(&a.op)?,
            sizes: sweep(a.min, a.max, a.factor, a.step),
            dtypes,
            redops,
            root: a.root,
            iters: a.iters,
            warmup: a.warmup,
            check: a.check,
            iter_budget: a.iter_budget,
            register: a.register.is_some(),
        })
    }

    /// (timed, warm-up) iterations for a row of `size` bytes (see --iter-budget).
    fn iters_for(&self, size: usize) -> (u64, u64) {
        let iters = match self.iter_budget {
            Some(b) => self.iters.min((b / size.max(1)).max(1) as u64),
            None => self.iters,
        };
        (iters, self.warmup.min(iters))
    }

    /// nccl-tests' loop order: size, then type, then reduction.
    fn rows(&self, op: BenchOp) -> Vec<RowSpec> {
        let base = self.ops.iter().position(|&o| o == op).unwrap_or(0) as u64 * 1_000_000;
        let redops: Vec<Option<ReduceOp>> = if op.reduces() { self.redops.iter().copied().map(Some).collect() } else { vec![None] };
        let mut out = Vec::new();
        for &size in &self.sizes {
            for &dtype in &self.dtypes {
                for &redop in &redops {
                    out.push(RowSpec { op, size, dtype, redop, index: base + out.len() as u64 });
                }
            }
        }
        out
    }

    fn total_rows(&self) -> usize {
        self.ops.iter().map(|&o| self.rows(o).len()).sum()
    }
}

/// A well-mixed 64-bit value of `z` (one SplitMix64 step from it).
fn mix(mut z: u64) -> u64 {
    ferroccl_core::numeric::splitmix64(&mut z)
}

/// A byte buffer aligned for every element type (8 bytes).
struct Buf {
    words: Vec<u64>,
    len: usize,
}

impl Buf {
    fn new(len: usize) -> Buf {
        Buf { words: vec![0u64; len.div_ceil(8)], len }
    }
    fn ptr(&mut self, off: usize) -> *mut u8 {
        assert!(off <= self.len);
        // SAFETY: off is within the allocation (or one past its end for empty regions).
        unsafe { (self.words.as_mut_ptr() as *mut u8).add(off) }
    }
    fn bytes(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds, and u64 storage is valid as bytes.
        unsafe { std::slice::from_raw_parts((self.words.as_ptr() as *const u8).add(off), len) }
    }
    fn bytes_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len);
        // SAFETY: as in bytes, and the borrow is unique.
        unsafe { std::slice::from_raw_parts_mut((self.words.as_mut_ptr() as *mut u8).add(off), len) }
    }
}

/// The buffers of one operation on one rank: out of place two buffers, in place one buffer
/// with the input and output regions at NCCL's offsets.
struct Buffers {
    send: Buf,
    /// None in place: the output lives in `send`.
    recv: Option<Buf>,
    /// GPU communicators: device twins of `send` and `recv` (addresses), which the operations
    /// use and the GPU checker fills and checks (the host buffers stay untouched); in the
    /// registered pool, or in `owned`.
    dev: Option<(u64, Option<u64>)>,
    owned: Vec<DeviceBuffer>,
    send_off: usize,
    send_len: usize,
    recv_off: usize,
    recv_len: usize,
}

/// Where one rank's input and output lie, in bytes: out of place each at the start of its own
/// buffer; in place both in one buffer, at NCCL's offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Regions {
    pub send_off: usize,
    pub send_len: usize,
    pub recv_off: usize,
    pub recv_len: usize,
    pub in_place: bool,
}

impl Regions {
    pub fn new(op: BenchOp, count: usize, dtype: DataType, nranks: usize, rank: usize, root: usize, in_place: bool) -> Result<Regions, Error> {
        let w = dtype.size();
        let is_root = op.has_root() && rank == root;
        let (sc, rc) = match op {
            BenchOp::SendRecv => (count, count),
            _ => op
                .kind()
                .buffer_counts(count, nranks, is_root)
                .ok_or_else(|| Error::InvalidArgument(format!("{count} elements per rank overflow on {nranks} ranks")))?,
        };
        let (sl, rl) = (sc * w, rc * w);
        if !in_place {
            return Ok(Regions { send_off: 0, send_len: sl, recv_off: 0, recv_len: rl, in_place });
        }
        // NCCL's in-place conventions: the small buffer is this rank's slot of the large one.
        let slot = rank * count * w;
        let (so, ro) = match op {
            BenchOp::AllGather => (slot, 0),
            BenchOp::ReduceScatter => (0, slot),
            BenchOp::Gather if is_root => (slot, 0),
            BenchOp::Scatter if is_root => (0, slot),
            _ => (0, 0),
        };
        Ok(Regions { send_off: so, send_len: sl, recv_off: ro, recv_len: rl, in_place })
    }

    /// Bytes of the one in-place buffer, or of the send buffer out of place.
    pub fn send_buffer_len(&self) -> usize {
        if self.in_place { (self.send_off + self.send_len).max(self.recv_off + self.recv_len) } else { self.send_len }
    }
}

impl Buffers {
    fn new(op: BenchOp, count: usize, dtype: DataType, nranks: usize, rank: usize, root: usize, in_place: bool) -> Result<Buffers, Error> {
        let g = Regions::new(op, count, dtype, nranks, rank, root, in_place)?;
        let recv = (!in_place).then(|| Buf::new(g.recv_len));
        Ok(Buffers { send: Buf::new(g.send_buffer_len()), recv, dev: None, owned: Vec::new(), send_off: g.send_off, send_len: g.send_len, recv_off: g.recv_off, recv_len: g.recv_len })
    }

    /// Mirrors the buffers in `comm`'s GPU memory (cuMem), when it has a GPU: at the start of
    /// the registered pool's buffers, or in fresh allocations.
    fn on_device_of(mut self, comm: &Comm, stats: &Arc<MemStats>, pool: Option<&Pool>) -> Result<Buffers, Error> {
        let Some(gpu) = comm.gpu() else { return Ok(self) };
        if let Some(p) = pool {
            if self.send.len > p.send.len() || self.recv.as_ref().is_some_and(|r| r.len > p.recv.len()) {
                return Err(Error::Internal("a row needs more than the registered pool holds".into()));
            }
            self.dev = Some((p.send.device_ptr(), self.recv.as_ref().map(|_| p.recv.device_ptr())));
            return Ok(self);
        }
        let send = DeviceBuffer::alloc(gpu, self.send.len.max(1), &[], stats)?;
        let recv = match &self.recv {
            Some(r) => Some(DeviceBuffer::alloc(gpu, r.len.max(1), &[], stats)?),
            None => None,
        };
        self.dev = Some((send.device_ptr(), recv.as_ref().map(|r| r.device_ptr())));
        self.owned.push(send);
        self.owned.extend(recv);
        Ok(self)
    }

    /// Fills the input with `case`'s data, after poisoning the output when asked (first: in
    /// place the input lies inside the output). GPU buffers are written by the GPU checker on
    /// the communicator's stream, with nothing staged through the host; this returns once done.
    fn fill(&mut self, comm: &Comm, case: &CheckCase, poison: bool) -> Result<(), Error> {
        let Some(chk) = comm.gpu_verifier()? else {
            if poison {
                self.output_mut().fill(POISON);
            }
            case.fill_input(self.input_mut());
            return Ok(());
        };
        let (out, inp) = (self.recv_ptr(), self.send_ptr() as *mut u8);
        // SAFETY: device regions of this rank sized by Buffers::new; no operation is in flight.
        unsafe {
            if poison {
                chk.poison(out, self.recv_len, POISON)?;
            }
            chk.fill(case, inp, self.send_len / case.dtype.size())?;
        }
        comm.synchronize()
    }

    /// The wrong elements of the output for `case`, counted on the GPU for GPU buffers.
    fn count_wrong(&mut self, comm: &Comm, case: &CheckCase, first: &mut Option<(usize, f64, f64)>) -> Result<u64, Error> {
        let Some(chk) = comm.gpu_verifier()? else {
            return Ok(case.count_wrong(self.output(), first) as u64);
        };
        let out = self.recv_ptr();
        // SAFETY: the output region of this rank, on its GPU.
        let w = unsafe { chk.count_wrong(case, out, self.recv_len / case.dtype.size()) }?;
        *first = w.first;
        Ok(w.count)
    }

    fn send_ptr(&mut self) -> *const u8 {
        match &self.dev {
            Some((ds, _)) => (*ds as usize + self.send_off) as *const u8,
            None => self.send.ptr(self.send_off),
        }
    }

    fn recv_ptr(&mut self) -> *mut u8 {
        let off = self.recv_off;
        match &self.dev {
            Some((ds, dr)) => (dr.unwrap_or(*ds) as usize + off) as *mut u8,
            None => self.recv.as_mut().unwrap_or(&mut self.send).ptr(off),
        }
    }

    fn input_mut(&mut self) -> &mut [u8] {
        self.send.bytes_mut(self.send_off, self.send_len)
    }

    fn output_mut(&mut self) -> &mut [u8] {
        let (o, l) = (self.recv_off, self.recv_len);
        self.recv.as_mut().unwrap_or(&mut self.send).bytes_mut(o, l)
    }

    fn output(&self) -> &[u8] {
        self.recv.as_ref().unwrap_or(&self.send).bytes(self.recv_off, self.recv_len)
    }
}

/// Poison byte for outputs: 0xA5A5... is a large or NaN-free odd value in every type, unlikely
/// to be a right answer by chance.
const POISON: u8 = 0xA5;

/// One rank's registered buffers (`--register`): as large as the largest row needs, registered
/// as windows with every rank once, so that every row runs zero-copy.
struct Pool {
    send: DeviceBuffer,
    recv: DeviceBuffer,
}

impl Pool {
    /// Collective over `comm` (every rank registers); None without --register or a GPU.
    fn new(comm: &Comm, spec: &Spec, stats: &Arc<MemStats>) -> Result<Option<Pool>, Error> {
        if !spec.register {
            return Ok(None);
        }
        let Some(gpu) = comm.gpu() else {
            return Err(Error::InvalidArgument("--register registers GPU memory: this run is on the host backend".into()));
        };
        let (n, me) = (comm.nranks(), comm.rank());
        let (mut sl, mut rl) = (1, 1);
        for &op in &spec.ops {
            for rs in spec.rows(op) {
                let lay = op.layout(rs.size, rs.dtype, n);
                for in_place in [false, true] {
                    let g = Regions::new(op, lay.count, rs.dtype, n, me, spec.root, in_place)?;
                    sl = sl.max(g.send_buffer_len());
                    rl = rl.max(g.recv_len);
                }
            }
        }
        let pool = Pool { send: ferroccl::mem::alloc(gpu, sl, stats)?, recv: ferroccl::mem::alloc(gpu, rl, stats)? };
        comm.register_buffer(&pool.send)?;
        comm.register_buffer(&pool.recv)?;
        Ok(Some(pool))
    }

    /// Collective: deregisters both windows, then frees them.
    fn close(self, comm: &Comm) -> Result<(), Error> {
        comm.deregister_window(self.send.device_ptr())?;
        comm.deregister_window(self.recv.device_ptr())
    }
}

/// `f` on every item at once, a thread each: for calls that are collective over the ranks of
/// this process (window registration), which one thread cannot make for several ranks in turn.
pub(crate) fn on_each<I: Send, T: Send>(items: impl IntoIterator<Item = I>, f: impl Fn(I) -> Result<T, Error> + Sync) -> Result<Vec<T>, Error> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = items.into_iter().map(|i| s.spawn(move || f(i))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank's thread panicked".into())))).collect()
    })
}

/// One pool per communicator of this process (collective: `on_each`).
fn pools_for(comms: &[Comm], spec: &Spec, stats: &Arc<MemStats>) -> Result<Vec<Option<Pool>>, Error> {
    on_each(comms, |c| Pool::new(c, spec, stats))
}

fn close_pools(comms: &[Comm], pools: Vec<Option<Pool>>) -> Result<(), Error> {
    on_each(comms.iter().zip(pools), |(c, p)| p.map_or(Ok(()), |p| p.close(c))).map(|_| ())
}

struct RowRun<'a> {
    comm: &'a Comm,
    stats: Arc<MemStats>,
    pool: Option<&'a Pool>,
    rs: RowSpec,
    lay: Layout,
    root: usize,
}

/// The verifiable input of a rank and the output it must get (they differ for the send/recv
/// ring, whose input is a send and whose output a receive).
fn check_cases(rs: &RowSpec, lay: Layout, root: usize, n: usize, me: usize, seed: u64) -> (CheckCase, CheckCase) {
    let base = CheckCase {
        kind: rs.op.kind(),
        dtype: rs.dtype,
        op: rs.redop.unwrap_or(ReduceOp::Sum),
        nranks: n,
        rank: me,
        count: lay.count,
        root: if rs.op.has_root() { root } else { 0 },
        seed,
    };
    match rs.op {
        BenchOp::SendRecv => (
            CheckCase { kind: CollKind::Send, root: (me + 1) % n, ..base },
            CheckCase { kind: CollKind::Recv, root: (me + n - 1) % n, ..base },
        ),
        _ => (base, base),
    }
}

impl RowRun<'_> {
    fn cases(&self, seed: u64) -> (CheckCase, CheckCase) {
        check_cases(&self.rs, self.lay, self.root, self.comm.nranks(), self.comm.rank(), seed)
    }

    /// The operations of one iteration on this rank (two for the sendrecv ring).
    fn args(&self, b: &mut Buffers) -> Vec<OpArgs> {
        let (send, recv) = (b.send_ptr(), b.recv_ptr());
        row_args(&self.rs, self.lay, self.root, self.comm.nranks(), self.comm.rank(), send, recv)
    }

    fn launch(&self, b: &mut Buffers) -> Result<(), Error> {
        let mut g = Group::new();
        for a in self.args(b) {
            // SAFETY: Buffers sized the regions with CollKind::buffer_counts for this count,
            // rank and root, and they outlive the operation (synchronize before they drop).
            unsafe { g.push_raw(self.comm, a)? };
        }
        g.launch()
    }

    /// This rank's average time per iteration (us) and wrong elements.
    fn measure(&self, in_place: bool, iters: u64, warmup: u64, check: bool) -> Result<(f64, u64), Error> {
        let (n, me) = (self.comm.nranks(), self.comm.rank());
        let mut b = Buffers::new(self.rs.op, self.lay.count, self.rs.dtype, n, me, self.root, in_place)?.on_device_of(self.comm, &self.stats, self.pool)?;
        let seed_of = |it: u64| mix(mix(self.rs.index) ^ (it << 1 | in_place as u64));
        // Without --check any non-zero data will do; the check inputs are that.
        b.fill(self.comm, &self.cases(seed_of(u64::MAX)).0, false)?;
        for _ in 0..warmup {
            self.launch(&mut b)?;
        }
        self.comm.synchronize()?;
        if !check {
            self.comm.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                self.launch(&mut b)?;
            }
            // GPU operations return once enqueued: the time is until they all completed.
            self.comm.synchronize()?;
            return Ok((t.elapsed().as_secs_f64() * 1e6 / iters as f64, 0));
        }
        // Checked iterations are timed one by one, so that filling and checking stay out of
        // the figure; the time then includes no pipelining between iterations.
        let (mut total, mut wrong) = (0.0, 0u64);
        for it in 0..iters {
            let (input, output) = self.cases(seed_of(it));
            b.fill(self.comm, &input, true)?;
            self.comm.barrier()?;
            let t = Instant::now();
            self.launch(&mut b)?;
            self.comm.synchronize()?;
            total += t.elapsed().as_secs_f64() * 1e6;
            let mut first = None;
            let w = b.count_wrong(self.comm, &output, &mut first)?;
            if let Some((j, got, want)) = first {
                tracing::warn!(
                    "{} {} {} count {} {}: rank {me} element {j} is {got}, expected {want} ({w} wrong)",
                    self.rs.op.name(),
                    self.rs.dtype,
                    self.rs.redop.map_or("none", |o| o.name()),
                    self.lay.count,
                    if in_place { "in place" } else { "out of place" },
                );
            }
            wrong += w;
        }
        Ok((total / iters as f64, wrong))
    }
}

/// ferroccl's operations for one iteration of a row on rank `me` of `n` (two for the sendrecv
/// ring: to the next rank, from the previous one).
fn row_args(rs: &RowSpec, lay: Layout, root: usize, n: usize, me: usize, send: *const u8, recv: *mut u8) -> Vec<OpArgs> {
    let args = OpArgs {
        kind: rs.op.kind(),
        send,
        recv,
        count: lay.count,
        dtype: rs.dtype,
        op: rs.redop.unwrap_or(ReduceOp::Sum),
        root,
        device_scalar: None,
    };
    match rs.op {
        BenchOp::SendRecv => vec![
            OpArgs { kind: CollKind::Send, recv: std::ptr::null_mut(), root: (me + 1) % n, ..args },
            OpArgs { kind: CollKind::Recv, send: std::ptr::null(), root: (me + n - 1) % n, ..args },
        ],
        _ => vec![args],
    }
}

/// One thread, every rank: each iteration is one group over all communicators. Returns the
/// average time per iteration (us) and the wrong elements of all ranks.
fn measure_group(runs: &[RowRun], in_place: bool, iters: u64, warmup: u64, check: bool) -> Result<(f64, u64), Error> {
    let mut bufs = Vec::with_capacity(runs.len());
    for r in runs {
        let (n, me) = (r.comm.nranks(), r.comm.rank());
        bufs.push(Buffers::new(r.rs.op, r.lay.count, r.rs.dtype, n, me, r.root, in_place)?.on_device_of(r.comm, &r.stats, r.pool)?);
    }
    let seed_of = |r: &RowRun, it: u64| mix(mix(r.rs.index) ^ (it << 1 | in_place as u64));
    let launch = |bufs: &mut Vec<Buffers>| -> Result<(), Error> {
        let mut g = Group::new();
        for (r, b) in runs.iter().zip(bufs.iter_mut()) {
            for a in r.args(b) {
                // SAFETY: as in RowRun::launch.
                unsafe { g.push_raw(r.comm, a)? };
            }
        }
        g.launch()
    };
    let sync = || runs.iter().try_for_each(|r| r.comm.synchronize());
    for (r, b) in runs.iter().zip(bufs.iter_mut()) {
        b.fill(r.comm, &r.cases(seed_of(r, u64::MAX)).0, false)?;
    }
    for _ in 0..warmup {
        launch(&mut bufs)?;
    }
    sync()?;
    if !check {
        let t = Instant::now();
        for _ in 0..iters {
            launch(&mut bufs)?;
        }
        sync()?;
        return Ok((t.elapsed().as_secs_f64() * 1e6 / iters as f64, 0));
    }
    let (mut total, mut wrong) = (0.0, 0u64);
    for it in 0..iters {
        for (r, b) in runs.iter().zip(bufs.iter_mut()) {
            b.fill(r.comm, &r.cases(seed_of(r, it)).0, true)?;
        }
        let t = Instant::now();
        launch(&mut bufs)?;
        sync()?;
        total += t.elapsed().as_secs_f64() * 1e6;
        for (r, b) in runs.iter().zip(bufs.iter_mut()) {
            let mut first = None;
            wrong += b.count_wrong(r.comm, &r.cases(seed_of(r, it)).1, &mut first)?;
        }
    }
    Ok((total / iters as f64, wrong))
}

/// One row of the table from the (time us, wrong) of the out-of-place and in-place runs.
fn table_row(spec: &Spec, op: BenchOp, rs: RowSpec, lay: Layout, n: usize, oop: (f64, u64), ip: Option<(f64, u64)>) -> Row {
    let m = |(t, w): (f64, u64)| {
        let (algbw, busbw) = bandwidths(op, lay.bytes, t, n);
        Measure { time_us: t, algbw, busbw, wrong: spec.check.then_some(w) }
    };
    Row {
        op: op.name(),
        size: lay.bytes,
        count: lay.count,
        dtype: rs.dtype.name(),
        redop: rs.redop.map_or("none", |o| o.name()),
        root: if op.has_root() { spec.root as i64 } else { -1 },
        out_of_place: m(oop),
        in_place: ip.map(m),
    }
}

/// The whole sweep with one thread driving every rank of this process.
fn run_one_thread(comms: &[Comm], spec: &Spec, report: &mut Reporter) -> Result<RankOutcome, Error> {
    let n = comms[0].nranks();
    let stats = MemStats::new();
    let mut out = RankOutcome::default();
    let pools = pools_for(comms, spec, &stats)?;
    for &op in &spec.ops {
        report.begin(op);
        for rs in spec.rows(op) {
            let lay = op.layout(rs.size, rs.dtype, n);
            let runs: Vec<RowRun> =
                comms.iter().zip(&pools).map(|(comm, pool)| RowRun { comm, stats: stats.clone(), pool: pool.as_ref(), rs, lay, root: spec.root }).collect();
            let (iters, warmup) = spec.iters_for(rs.size);
            let oop = measure_group(&runs, false, iters, warmup, spec.check)?;
            let ip = if op.has_in_place() { Some(measure_group(&runs, true, iters, warmup, spec.check)?) } else { None };
            out.local_wrong += oop.1 + ip.map_or(0, |m| m.1);
            report.row(table_row(spec, op, rs, lay, n, oop, ip));
        }
        report.end();
    }
    close_pools(comms, pools)?;
    out.global_wrong = out.local_wrong;
    Ok(out)
}

/// Max of `v` over ranks, through the communicator.
fn allreduce_max_f64(comm: &Comm, v: &mut [f64]) -> Result<(), Error> {
    let mine: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    for other in comm.allgather_bytes(&mine)? {
        for (i, c) in other.chunks_exact(8).enumerate().take(v.len()) {
            v[i] = v[i].max(f64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
    }
    Ok(())
}

fn allreduce_sum_u64(comm: &Comm, v: &mut [u64]) -> Result<(), Error> {
    let mine: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut acc = vec![0u64; v.len()];
    for other in comm.allgather_bytes(&mine)? {
        for (i, c) in other.chunks_exact(8).enumerate().take(v.len()) {
            acc[i] = acc[i].wrapping_add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
    }
    v.copy_from_slice(&acc);
    Ok(())
}

/// Rank 0's side: prints the table and keeps the rows.
pub struct Reporter {
    rows: Vec<Row>,
    section_start: usize,
    pb: Option<ProgressBar>,
    check: bool,
}

impl Reporter {
    fn new(total_rows: usize, check: bool) -> Reporter {
        // A bar only helps a person watching a long sweep; logs and pipes get none.
        let pb = (std::io::stderr().is_terminal() && total_rows >= 12).then(|| {
            let pb = ProgressBar::new(total_rows as u64);
            if let Ok(s) = ProgressStyle::with_template("{bar:40} {pos}/{len} rows {elapsed_precise} {msg}") {
                pb.set_style(s);
            }
            pb
        });
        Reporter { rows: Vec::new(), section_start: 0, pb, check }
    }

    fn print(&self, s: &str) {
        match &self.pb {
            Some(pb) => pb.suspend(|| println!("{s}")),
            None => println!("{s}"),
        }
    }

    fn begin(&mut self, op: BenchOp) {
        self.section_start = self.rows.len();
        self.print(&format!("#\n# {}\n{}", op.name(), table::header()));
        if let Some(pb) = &self.pb {
            pb.set_message(op.name());
        }
    }

    fn row(&mut self, r: Row) {
        self.print(&table::format_row(&r));
        self.rows.push(r);
        if let Some(pb) = &self.pb {
            pb.inc(1);
        }
    }

    fn end(&mut self) {
        self.print(&table::footer(&self.rows[self.section_start..], self.check));
    }

    fn finish(&self) {
        if let Some(pb) = &self.pb {
            pb.finish_and_clear();
        }
    }
}

/// What one rank learned: its own wrong elements and the job's.
#[derive(Clone, Copy, Debug, Default)]
pub struct RankOutcome {
    pub local_wrong: u64,
    pub global_wrong: u64,
}

pub fn run_rank(comm: &Comm, spec: &Spec, mut report: Option<&mut Reporter>) -> Result<RankOutcome, Error> {
    let n = comm.nranks();
    let stats = MemStats::new();
    let mut out = RankOutcome::default();
    if spec.root >= n && spec.ops.iter().any(|o| o.has_root()) {
        return Err(Error::InvalidArgument(format!("root {} is not below the {n} ranks", spec.root)));
    }
    let pool = Pool::new(comm, spec, &stats)?;
    for &op in &spec.ops {
        if let Some(r) = report.as_deref_mut() {
            r.begin(op);
        }
        for rs in spec.rows(op) {
            let lay = op.layout(rs.size, rs.dtype, n);
            let run = RowRun { comm, stats: stats.clone(), pool: pool.as_ref(), rs, lay, root: spec.root };
            let (iters, warmup) = spec.iters_for(rs.size);
            let oop = run.measure(false, iters, warmup, spec.check)?;
            let ip = if op.has_in_place() { Some(run.measure(true, iters, warmup, spec.check)?) } else { None };
            out.local_wrong += oop.1 + ip.map_or(0, |m| m.1);
            let mut times = [oop.0, ip.map_or(0.0, |m| m.0)];
            let mut wrong = [oop.1, ip.map_or(0, |m| m.1)];
            allreduce_max_f64(comm, &mut times)?;
            allreduce_sum_u64(comm, &mut wrong)?;
            out.global_wrong += wrong[0] + wrong[1];
            if let Some(r) = report.as_deref_mut() {
                r.row(table_row(spec, op, rs, lay, n, (times[0], wrong[0]), ip.map(|_| (times[1], wrong[1]))));
            }
        }
        if let Some(r) = report.as_deref_mut() {
            r.end();
        }
    }
    if let Some(p) = pool {
        p.close(comm)?;
    }
    Ok(out)
}

#[derive(Serialize)]
struct JsonReport<'a> {
    tool: &'static str,
    version: &'static str,
    commit: &'static str,
    command: Vec<String>,
    mode: &'a str,
    nranks: usize,
    machine: Machine,
    ops: Vec<&'static str>,
    iters: u64,
    warmup: u64,
    check: bool,
    wrong: u64,
    /// Per operation: the mean bus bandwidth over its rows (both halves), as in the footer.
    avg_busbw: Vec<(&'static str, f64)>,
    rows: &'a [Row],
}

fn preamble(comm: &Comm, spec: &Spec, mode: &str) -> String {
    let topo = comm.topology();
    let mut s = format!(
        "# ferroccl bench {} (commit {})\n#  ranks: {} ({mode}), backend: {}, channels {}\n#  minBytes {} ({}) maxBytes {} ({}) sizes {} warmup iters: {} iters: {} check: {}\n#\n# Using devices\n",
        env!("CARGO_PKG_VERSION"),
        &GIT_COMMIT[..GIT_COMMIT.len().min(12)],
        comm.nranks(),
        match comm.gpu() {
            Some(g) => format!("CUDA ({})", g.name()),
            None => "host".to_string(),
        },
        comm.config().channels,
        spec.sizes.first().copied().unwrap_or(0),
        human(spec.sizes.first().copied().unwrap_or(0)),
        spec.sizes.last().copied().unwrap_or(0),
        human(spec.sizes.last().copied().unwrap_or(0)),
        spec.sizes.len(),
        spec.warmup,
        spec.iters,
        spec.check as u8
    );
    // Every rank's own device is known only to that rank: this one's is shown for all
    // of its process (one GPU per rank in rank order with -g; LOCAL_RANK under a launcher).
    let device = |r: usize| match comm.gpu() {
        Some(_) if topo.ranks[r].pid == topo.ranks[comm.rank()].pid => {
            format!("GPU {}", comm.gpu().map(|g| g.ordinal()).unwrap_or(0) + r - comm.rank())
        }
        Some(_) => "a GPU".to_string(),
        None => "host memory".to_string(),
    };
    for (r, loc) in topo.ranks.iter().enumerate() {
        s += &format!("#  Rank {r:>3} Pid {:>7} on {:>12} device {}\n", loc.pid, loc.hostname, device(r));
    }
    s.pop();
    s
}

fn write_json(path: &PathBuf, spec: &Spec, rows: &[Row], mode: &str, nranks: usize) -> Result<(), String> {
    let avg = spec
        .ops
        .iter()
        .map(|&op| {
            let bws: Vec<f64> = rows
                .iter()
                .filter(|r| r.op == op.name())
                .flat_map(|r| std::iter::once(r.out_of_place.busbw).chain(r.in_place.map(|m| m.busbw)))
                .collect();
            (op.name(), if bws.is_empty() { 0.0 } else { bws.iter().sum::<f64>() / bws.len() as f64 })
        })
        .collect();
    let rep = JsonReport {
        tool: "ferroccl bench",
        version: env!("CARGO_PKG_VERSION"),
        commit: GIT_COMMIT,
        command: std::env::args().collect(),
        mode,
        nranks,
        machine: Machine::probe(),
        ops: spec.ops.iter().map(|o| o.name()).collect(),
        iters: spec.iters,
        warmup: spec.warmup,
        check: spec.check,
        wrong: table::total_wrong(rows),
        avg_busbw: avg,
        rows,
    };
    let text = serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))
}

/// The communicators of this process for the launch mode the arguments and the environment
/// say, with a description of the mode.
fn make_comms(args: &BenchArgs, config: &Config) -> Result<(String, Vec<Comm>), String> {
    let launched = crate::launcher_env()?;
    Ok(match &launched {
        Some(env) if args.gpus > 0 => {
            let comm = Comm::from_env_gpu(config).map_err(|e| format!("joining the {} job on GPU {}: {e}", env.source, env.local_rank))?;
            (format!("one process per GPU, {} launcher", env.source), vec![comm])
        }
        Some(env) => {
            let comm = Comm::from_env(config).map_err(|e| format!("joining the {} job: {e}", env.source))?;
            (format!("one process per rank, {} launcher", env.source), vec![comm])
        }
        None if args.gpus > 0 => {
            let devices: Vec<Device> = (0..args.gpus).map(Device::Cuda).collect();
            let comms = Comm::init_devices(&devices, config).map_err(|e| format!("creating {} GPU ranks: {e}", args.gpus))?;
            (format!("{} GPUs driven by one process (a thread each)", args.gpus), comms)
        }
        None => {
            if args.ranks == 0 {
                return Err("--ranks must be at least 1".into());
            }
            let comms = Comm::init_all(args.ranks, config).map_err(|e| format!("creating {} ranks: {e}", args.ranks))?;
            ("threads of one process".to_string(), comms)
        }
    })
}

/// The configuration with the command's own limits applied (--max-ctas).
fn bench_config(args: &BenchArgs, config: &Config) -> Result<Config, String> {
    let mut c = config.clone();
    if let Some(n) = args.max_ctas {
        // One thread block per channel and lane: the channel count is the block budget of a
        // collective (point-to-point uses min(N, 8) per direction).
        c.gpu_channels = n;
        c.validate().map_err(|e| format!("--max-ctas {n}: {e}"))?;
    }
    Ok(c)
}

/// Runs the benchmark; the exit code says whether it ran and every element was right.
impl BenchArgs {
    /// Fills `gpus`: `-g` when given, else the GPUs this host has (`visible`), so the main job
    /// runs on GPUs wherever there are some and on the host backend elsewhere.
    pub fn resolve(mut self, visible: impl FnOnce() -> usize) -> BenchArgs {
        self.gpus = self.gpus_arg.unwrap_or_else(visible);
        self
    }
}

pub fn main(args: &BenchArgs, config: &Config) -> Result<std::process::ExitCode, String> {
    // No driver, or no GPU: the host backend.
    let args = &args.clone().resolve(|| ferroccl::cuda::gpu_count().unwrap_or(0));
    let spec = Spec::from_args(args)?;
    let config = &bench_config(args, config)?;
    if args.vs_nccl.is_some() {
        return vs::main(args, config, &spec);
    }
    if args.graph > 0 {
        return Err("--graph is an option of the comparison with NCCL: add --vs-nccl".into());
    }
    if args.register.as_deref().is_some_and(|r| r != "auto") {
        return Err(format!("--register {}: a kind of NCCL registration; add --vs-nccl (ferroccl itself registers windows)", args.register.as_deref().unwrap_or("")));
    }
    let (mode, comms) = make_comms(args, config)?;
    let mode = if args.one_thread { format!("{mode}, one thread driving all") } else { mode };
    let nranks = comms[0].nranks();
    let total_rows = spec.total_rows();
    let mut reporter = (comms[0].rank() == 0).then(|| Reporter::new(total_rows, spec.check));
    if reporter.is_some() {
        println!("{}", preamble(&comms[0], &spec, &mode));
    }

    if args.one_thread {
        let mut rep = reporter.take().ok_or("one thread needs every rank in this process (no launcher)")?;
        if comms.len() != nranks {
            return Err("--one-thread needs every rank in this process (not under a launcher)".into());
        }
        let r = run_one_thread(&comms, &spec, &mut rep);
        rep.finish();
        if let Some(path) = &args.json {
            write_json(path, &spec, &rep.rows, &mode, nranks)?;
        }
        let o = r.map_err(|e| e.to_string())?;
        if o.local_wrong > 0 {
            eprintln!("ferroccl bench: wrong results (see '#wrong' above)");
            return Ok(std::process::ExitCode::from(1));
        }
        return Ok(std::process::ExitCode::SUCCESS);
    }

    // Every rank on its own thread; the first failure aborts the others so that they fail
    // fast instead of waiting for the timeout.
    let results: Vec<Result<RankOutcome, Error>> = std::thread::scope(|s| {
        let comms = &comms;
        let spec = &spec;
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let rep = if comm.rank() == 0 { reporter.take() } else { None };
                s.spawn(move || {
                    let mut rep = rep;
                    let r = run_rank(comm, spec, rep.as_mut());
                    if r.is_err() {
                        for c in comms {
                            c.abort();
                        }
                    }
                    (r, rep)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (r, rep) = h.join().unwrap_or_else(|_| (Err(Error::Internal("a rank thread panicked".into())), None));
                if rep.is_some() {
                    reporter = rep;
                }
                r
            })
            .collect()
    });
    if let Some(r) = &reporter {
        r.finish();
    }
    let mut failed = Vec::new();
    let mut bad = false;
    for (i, r) in results.iter().enumerate() {
        match r {
            Ok(o) => bad |= o.local_wrong > 0 || o.global_wrong > 0,
            Err(e) => failed.push(format!("rank {}: {e}", comms[i].rank())),
        }
    }
    if let (Some(rep), Some(path)) = (&reporter, &args.json) {
        write_json(path, &spec, &rep.rows, &mode, nranks)?;
    }
    if !failed.is_empty() {
        return Err(failed.join("\n"));
    }
    if bad {
        eprintln!("ferroccl bench: wrong results (see '#wrong' above)");
        return Ok(std::process::ExitCode::from(1));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn in_place_regions_follow_nccl() {
        let f = DataType::Float32;
        let b = Buffers::new(BenchOp::AllGather, 3, f, 4, 2, 0, true).unwrap();
        assert_eq!((b.send_off, b.send_len, b.recv_off, b.recv_len, b.send.len), (24, 12, 0, 48, 48));
        let b = Buffers::new(BenchOp::ReduceScatter, 3, f, 4, 1, 0, true).unwrap();
        assert_eq!((b.send_off, b.send_len, b.recv_off, b.recv_len), (0, 48, 12, 12));
        let b = Buffers::new(BenchOp::Gather, 3, f, 4, 1, 1, true).unwrap();
        assert_eq!((b.send_off, b.recv_len), (12, 48));
        let b = Buffers::new(BenchOp::Gather, 3, f, 4, 2, 1, true).unwrap();
        assert_eq!((b.send_off, b.send_len, b.recv_len), (0, 12, 0));
        let b = Buffers::new(BenchOp::AllReduce, 3, f, 4, 2, 0, false).unwrap();
        assert!(b.recv.is_some());
    }

    /// Arguments as clap gives them with no options, for tests to adjust.
    pub fn args() -> BenchArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            a: BenchArgs,
        }
        P::parse_from(["bench", "all-reduce"]).a
    }

    #[test]
    fn iteration_budget_shrinks_large_rows_only() {
        let mut a = args();
        a.iters = 20;
        a.warmup = 5;
        a.iter_budget = Some(1 << 30);
        let spec = Spec::from_args(&a).unwrap();
        assert_eq!(spec.iters_for(8), (20, 5));
        assert_eq!(spec.iters_for(256 << 20), (4, 4));
        assert_eq!(spec.iters_for(2 << 30), (1, 1));
        a.iter_budget = None;
        assert_eq!(Spec::from_args(&a).unwrap().iters_for(2 << 30), (20, 5));
    }

    #[test]
    fn data_types_may_be_a_list() {
        let mut a = args();
        a.dtype = "float, bfloat16".into();
        assert_eq!(Spec::from_args(&a).unwrap().dtypes, vec![DataType::Float32, DataType::Bfloat16]);
        a.dtype = "float,nonsense".into();
        assert!(Spec::from_args(&a).is_err());
    }

    #[test]
    fn gpus_default_to_what_the_host_has() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            b: BenchArgs,
        }
        let parse = |v: &[&str]| Cli::try_parse_from(std::iter::once("bench").chain(v.iter().copied())).unwrap().b;
        assert_eq!(parse(&["all-reduce"]).resolve(|| 4).gpus, 4);
        assert_eq!(parse(&["all-reduce"]).resolve(|| 0).gpus, 0, "no GPU: the host backend");
        assert_eq!(parse(&["all-reduce", "-g", "0"]).resolve(|| 4).gpus, 0, "-g 0 forces the host");
        assert_eq!(parse(&["all-reduce", "-g", "2"]).resolve(|| 4).gpus, 2);
    }

    #[test]
    fn rows_get_distinct_seed_indices() {
        let a = BenchArgs {
            op: "all".into(),
            min: 8,
            max: 64,
            factor: 2,
            step: 1,
            iters: 1,
            warmup: 0,
            dtype: "all".into(),
            redop: "all".into(),
            root: 0,
            check: true,
            gpus_arg: None,
            gpus: 0,
            one_thread: false,
            ranks: 2,
            json: None,
            vs_nccl: None,
            graph: 0,
            register: None,
            max_ctas: None,
            iter_budget: None,
        };
        let spec = Spec::from_args(&a).unwrap();
        let mut idx: Vec<u64> = spec.ops.iter().flat_map(|&o| spec.rows(o)).map(|r| r.index).collect();
        let n = idx.len();
        // 4 sizes x 12 types x (6 reductions, pre-mul-sum included, for 3 ops + 1 for 6 ops).
        assert_eq!(n, 4 * 12 * (3 * 6 + 6));
        idx.sort();
        idx.dedup();
        assert_eq!(idx.len(), n);
    }
}
