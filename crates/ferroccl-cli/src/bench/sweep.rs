//! The sweep: every row of every operation, each library in turn on the same buffers and
//! streams, warmed up, checked and timed on the ranks one thread drives; and the threads of the
//! launch modes around it.

use super::cuda as cu;
use super::libs::{Call, Lib};
use super::op::{bandwidths, Regions};
use super::rank::RankCtx;
use super::record::LibResult;
use super::report::Reporter;
use super::spec::Spec;
use super::table::Measure;
use crate::api::{Comm, Error};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// A well-mixed 64-bit value of `z` (one SplitMix64 step from it).
fn mix(mut z: u64) -> u64 {
    ferroccl_core::numeric::splitmix64(&mut z)
}

/// One library's result of one half of a row on this thread's ranks.
#[derive(Clone, Copy, Debug, Default)]
struct Half {
    time_us: f64,
    wrong: u64,
    blocks: u32,
}

#[derive(Clone, Copy)]
pub struct Runner<'a> {
    pub libs: &'a [Lib<'a>],
    /// The ranks this thread drives: one, or all of this process's.
    pub ranks: &'a [RankCtx<'a>],
    pub nranks: usize,
    pub spec: &'a Spec,
    /// CUDA-graph replays per row (--graph), 0 for host launches.
    pub graph: u64,
}

impl Runner<'_> {
    fn beside_nccl(&self) -> bool {
        self.libs.len() > 1
    }

    /// The ranks of this thread are not all the ranks: line up with the others (out of band)
    /// before a timed loop.
    fn barrier(&self) -> Result<(), Error> {
        if self.ranks.len() < self.nranks {
            self.ranks[0].comm.barrier()?;
        }
        Ok(())
    }

    /// Waits for everything launched on this thread's ranks. Beside NCCL the clock stops at the
    /// bare stream both libraries share, so that neither pays for the other's way of reporting
    /// errors (`Lib::errors` asks afterwards); alone it stops at `Comm::synchronize`, where
    /// ferroccl's users wait.
    fn sync(&self) -> Result<(), Error> {
        self.ranks.iter().try_for_each(|r| match &r.gpu {
            Some((gpu, stream)) if self.beside_nccl() => cu::stream_sync(gpu, *stream),
            _ => r.comm.synchronize(),
        })
    }

    fn regions(&self, call: &Call, in_place: bool) -> Result<Vec<Regions>, Error> {
        let (rs, n) = (&call.rs, self.nranks);
        self.ranks
            .iter()
            .map(|r| {
                r.regions(Regions::new(
                    rs.op,
                    call.lay.count,
                    rs.dtype,
                    n,
                    r.comm.rank(),
                    call.root,
                    in_place,
                )?)
            })
            .collect()
    }

    /// One iteration with fresh verifiable inputs and poisoned outputs: its time (us) and the
    /// wrong elements of this thread's ranks.
    fn checked(
        &self,
        lib: Lib,
        call: &Call,
        regs: &[Regions],
        seed: u64,
    ) -> Result<(f64, u64), Error> {
        for (r, g) in self.ranks.iter().zip(regs) {
            r.fill(lib, g, &call.check_cases(r.comm.rank(), seed).0)?;
        }
        self.barrier()?;
        let t = Instant::now();
        lib.launch(call, self.ranks, regs)?;
        self.sync()?;
        let time = t.elapsed().as_secs_f64() * 1e6;
        lib.errors(self.ranks)?;
        let mut wrong = 0;
        for (r, g) in self.ranks.iter().zip(regs) {
            let w = r.count_wrong(lib, g, &call.check_cases(r.comm.rank(), seed).1)?;
            if let Some((j, got, want)) = w.first {
                tracing::warn!(
                    "{} {} {} {} count {} {}: rank {} element {j} is {got}, expected {want} ({} wrong)",
                    lib.name(),
                    call.rs.op.name(),
                    call.rs.dtype,
                    call.rs.redop.map_or("none", |o| o.name()),
                    call.lay.count,
                    if g.in_place { "in place" } else { "out of place" },
                    r.comm.rank(),
                    w.count
                );
            }
            wrong += w.count;
        }
        Ok((time, wrong))
    }

    /// Captures `n_ops` iterations on every stream of this thread. The captures are ended
    /// whatever happens, so that a failure leaves the streams usable.
    fn capture(
        &self,
        lib: Lib,
        call: &Call,
        regs: &[Regions],
        n_ops: u64,
    ) -> Result<Vec<cu::Captured>, Error> {
        let mut begun = 0;
        let mut res = Ok(());
        for r in self.ranks {
            if let Err(e) = r
                .on_gpu()
                .and_then(|(gpu, stream)| cu::begin_capture(gpu, stream))
            {
                res = Err(e);
                break;
            }
            begun += 1;
        }
        if res.is_ok() {
            res = (0..n_ops).try_for_each(|_| lib.launch(call, self.ranks, regs));
        }
        let mut caps = Vec::new();
        for r in &self.ranks[..begun] {
            match r
                .on_gpu()
                .and_then(|(gpu, stream)| cu::end_capture(gpu, stream))
            {
                Ok(c) => caps.push(c),
                Err(e) => res = res.and(Err(e)),
            }
        }
        res.map(|()| caps)
    }

    /// The most thread blocks of any kernel in `caps` (the grid NCCL chose: one block per
    /// channel).
    fn grid(caps: &[cu::Captured]) -> Result<u32, Error> {
        let mut blocks = 0;
        for c in caps {
            blocks = blocks.max(c.kernel_grids()?.into_iter().max().unwrap_or(0));
        }
        Ok(blocks)
    }

    /// Instantiates one graph per stream and replays each once: the first replay uploads the
    /// graph to the GPU.
    fn replay_once(&self, caps: Vec<cu::Captured>) -> Result<Vec<cu::Graph>, Error> {
        let graphs = caps
            .into_iter()
            .map(|c| c.instantiate())
            .collect::<Result<Vec<_>, _>>()?;
        for (r, g) in self.ranks.iter().zip(&graphs) {
            g.launch(r.stream())?;
        }
        self.sync()?;
        Ok(graphs)
    }

    /// One library, one half of a row: checked (--check), warmed up, timed.
    fn measure(&self, lib: Lib, call: &Call, in_place: bool) -> Result<Half, Error> {
        let regs = self.regions(call, in_place)?;
        let (iters, warmup) = self.spec.iters_for(call.rs.size);
        let seed = |it: u64| mix(mix(call.rs.index) ^ (it << 1 | in_place as u64));
        let mut half = Half::default();
        // Beside NCCL one checked iteration comes first and the timed ones run unchecked, back
        // to back (or in graphs) as without --check; alone, every timed iteration is checked.
        let check_each = self.spec.check && !self.beside_nccl();
        if self.spec.check && self.beside_nccl() {
            half.wrong = self.checked(lib, call, &regs, seed(0))?.1;
        }
        // Rows whose count rounds down to 0 launch nothing in either library: there is no
        // graph to capture and no grid to read.
        let graph = if call.lay.count > 0 { self.graph } else { 0 };
        // A graph may hold only launches seen before: ferroccl uploads an operation's tables
        // (a synchronous copy) on its first call.
        let warmup = if graph > 0 { warmup.max(1) } else { warmup };
        for _ in 0..warmup {
            lib.launch(call, self.ranks, &regs)?;
        }
        self.sync()?;
        half.time_us = if check_each {
            // Each checked iteration is timed on its own, so that filling and checking stay out
            // of the figure; the time then includes no pipelining between iterations.
            let mut total = 0.0;
            for it in 0..iters {
                let (t, w) = self.checked(lib, call, &regs, seed(it))?;
                total += t;
                half.wrong += w;
            }
            total / iters as f64
        } else if graph > 0 {
            let caps = self.capture(lib, call, &regs, iters)?;
            if let Lib::Nccl(_) = lib {
                half.blocks = Self::grid(&caps)?;
            }
            let graphs = self.replay_once(caps)?;
            self.barrier()?;
            let t = Instant::now();
            for _ in 0..graph {
                for (r, g) in self.ranks.iter().zip(&graphs) {
                    g.launch(r.stream())?;
                }
            }
            self.sync()?;
            t.elapsed().as_secs_f64() * 1e6 / (graph * iters) as f64
        } else {
            if matches!(lib, Lib::Nccl(_)) && call.lay.count > 0 {
                // NCCL's blocks are read from a captured copy of one iteration, which is then
                // run once more as a warm-up.
                let caps = self.capture(lib, call, &regs, 1)?;
                half.blocks = Self::grid(&caps)?;
                self.replay_once(caps)?;
            }
            self.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                lib.launch(call, self.ranks, &regs)?;
            }
            // GPU operations return once enqueued: the time is until they all completed.
            self.sync()?;
            t.elapsed().as_secs_f64() * 1e6 / iters as f64
        };
        if let Lib::Ferroccl = lib {
            half.blocks = self
                .ranks
                .iter()
                .filter_map(|r| r.comm.last_launch_blocks())
                .max()
                .unwrap_or(0);
        }
        lib.errors(self.ranks)?;
        Ok(half)
    }

    /// The whole sweep on this thread's ranks; rows go to `report` (rank 0's thread). Returns
    /// the job's wrong elements per library.
    fn sweep(&self, mut report: Option<&mut Reporter>) -> Result<Vec<u64>, Error> {
        let (spec, n) = (self.spec, self.nranks);
        let mut total = vec![0u64; self.libs.len()];
        for &op in &spec.ops {
            if let Some(r) = report.as_deref_mut() {
                r.begin(op);
            }
            for rs in spec.rows(op) {
                let call = Call {
                    rs,
                    lay: op.layout(rs.size, rs.dtype, n),
                    root: spec.root,
                    nranks: n,
                };
                // Each half in turn, ferroccl then NCCL: both see the same moment of the machine.
                let mut halves = vec![[None, None]; self.libs.len()];
                for (h, in_place) in [false, true].into_iter().enumerate() {
                    for (l, &lib) in self.libs.iter().enumerate() {
                        if !in_place || lib.has_in_place(op) {
                            halves[l][h] = Some(self.measure(lib, &call, in_place)?);
                        }
                    }
                }
                // The slowest rank's time, the most blocks (out of place), the wrong elements of
                // all.
                let h = |x: Option<Half>| x.unwrap_or_default();
                let mut times: Vec<f64> = halves
                    .iter()
                    .flat_map(|&[o, i]| [h(o).time_us, h(i).time_us, h(o).blocks as f64])
                    .collect();
                let mut wrong: Vec<u64> = halves
                    .iter()
                    .flat_map(|&[o, i]| [h(o).wrong, h(i).wrong])
                    .collect();
                if self.ranks.len() < n {
                    allreduce_max_f64(self.ranks[0].comm, &mut times)?;
                    allreduce_sum_u64(self.ranks[0].comm, &mut wrong)?;
                }
                let m = |t: f64, w: u64| {
                    let (algbw, busbw) = bandwidths(op, call.lay.bytes, t, n);
                    Measure {
                        time_us: t,
                        algbw,
                        busbw,
                        wrong: spec.check.then_some(w),
                    }
                };
                let mut results = Vec::new();
                for (l, [_, ip]) in halves.iter().enumerate() {
                    total[l] += wrong[2 * l] + wrong[2 * l + 1];
                    results.push(LibResult {
                        out_of_place: m(times[3 * l], wrong[2 * l]),
                        in_place: ip.map(|_| m(times[3 * l + 1], wrong[2 * l + 1])),
                        blocks: Some(times[3 * l + 2] as u32),
                    });
                }
                if let Some(r) = report.as_deref_mut() {
                    r.row(&call, results);
                }
            }
            if let Some(r) = report.as_deref_mut() {
                r.end();
            }
        }
        Ok(total)
    }

    /// The sweep on this process's ranks, by one thread driving them all or by a thread each
    /// (one, under a launcher). Returns the job's wrong elements per library.
    pub fn run(&self, one_thread: bool, report: Option<&mut Reporter>) -> Result<Vec<u64>, String> {
        let nccl_aborted = AtomicBool::new(false);
        // After a failure the others would wait for the failed rank until the deadline
        // (ferroccl) or for ever (NCCL): both libraries' kernels are stopped, NCCL's
        // communicators once (an aborted one is gone).
        let abort = || {
            for c in self.ranks {
                c.comm.abort();
            }
            if !nccl_aborted.swap(true, Ordering::AcqRel) {
                for lib in self.libs {
                    if let Lib::Nccl(nccl) = lib {
                        for (nc, _) in self.ranks.iter().filter_map(|c| c.nccl) {
                            let _ = nccl.abort(nc);
                        }
                    }
                }
            }
        };
        if one_thread {
            return self.sweep(report).map_err(|e| {
                abort();
                e.to_string()
            });
        }
        let results: Vec<Result<Vec<u64>, Error>> = std::thread::scope(|s| {
            let mut report = report;
            let handles: Vec<_> = self
                .ranks
                .iter()
                .map(|ctx| {
                    let rep = if ctx.comm.rank() == 0 {
                        report.take()
                    } else {
                        None
                    };
                    let runner = Runner {
                        ranks: std::slice::from_ref(ctx),
                        ..*self
                    };
                    let abort = &abort;
                    s.spawn(move || {
                        let out = runner.sweep(rep);
                        if out.is_err() {
                            abort();
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Internal("a rank thread panicked".into())))
                })
                .collect()
        });
        let mut wrong = vec![0; self.libs.len()];
        let mut failed = Vec::new();
        for (ctx, r) in self.ranks.iter().zip(results) {
            match r {
                // Every thread holds the job's totals (summed over ranks).
                Ok(w) => wrong.iter_mut().zip(w).for_each(|(a, b)| *a = (*a).max(b)),
                Err(e) => failed.push(format!("rank {}: {e}", ctx.comm.rank())),
            }
        }
        if !failed.is_empty() {
            return Err(failed.join("\n"));
        }
        Ok(wrong)
    }
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
