//! What rank 0 prints: the preamble, then per operation a table (nccl-tests' for ferroccl
//! alone, the side-by-side one beside NCCL) row by row as they are measured, and its footer.
//! The rows are kept for the JSON record.

use super::libs::{Call, NcclSide, Register};
use super::op::BenchOp;
use super::record::{LibResult, VsRow};
use super::spec::{Buffers, Spec};
use super::table::{self, Row};
use super::vs_table;
use crate::api::Comm;
use crate::machine::GIT_COMMIT;
use crate::size::human;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// The rows so far, in the table of the run.
pub enum Rows {
    Alone(Vec<Row>),
    VsNccl(Vec<VsRow>),
}

pub struct Reporter {
    pub rows: Rows,
    section_start: usize,
    pb: Option<ProgressBar>,
    check: bool,
}

impl Reporter {
    pub fn new(spec: &Spec, vs_nccl: bool) -> Reporter {
        // A bar only helps a person watching a long sweep; logs and pipes get none.
        let pb = (std::io::stderr().is_terminal() && spec.total_rows() >= 12).then(|| {
            let pb = ProgressBar::new(spec.total_rows() as u64);
            if let Ok(s) =
                ProgressStyle::with_template("{bar:40} {pos}/{len} rows {elapsed_precise} {msg}")
            {
                pb.set_style(s);
            }
            pb
        });
        let rows = if vs_nccl {
            Rows::VsNccl(Vec::new())
        } else {
            Rows::Alone(Vec::new())
        };
        Reporter {
            rows,
            section_start: 0,
            pb,
            check: spec.check,
        }
    }

    fn print(&self, s: &str) {
        match &self.pb {
            Some(pb) => pb.suspend(|| println!("{s}")),
            None => println!("{s}"),
        }
    }

    fn len(&self) -> usize {
        match &self.rows {
            Rows::Alone(v) => v.len(),
            Rows::VsNccl(v) => v.len(),
        }
    }

    pub fn begin(&mut self, op: BenchOp) {
        self.section_start = self.len();
        let header = match self.rows {
            Rows::Alone(_) => table::header(),
            Rows::VsNccl(_) => vs_table::header(self.check),
        };
        self.print(&format!("#\n# {}\n{header}", op.name()));
        if let Some(pb) = &self.pb {
            pb.set_message(op.name());
        }
    }

    /// A measured row: `libs` holds ferroccl's result, then NCCL's beside it.
    pub fn row(&mut self, call: &Call, libs: Vec<LibResult>) {
        let (op, rs) = (call.rs.op, &call.rs);
        let redop = rs.redop.map_or("none", |o| o.name());
        let root = if op.has_root() { call.root as i64 } else { -1 };
        let line = match &mut self.rows {
            Rows::Alone(v) => {
                let f = &libs[0];
                let r = Row {
                    op: op.name(),
                    size: call.lay.bytes,
                    count: call.lay.count,
                    dtype: rs.dtype.name(),
                    redop,
                    root,
                    out_of_place: f.out_of_place,
                    in_place: f.in_place,
                };
                let line = table::format_row(&r);
                v.push(r);
                line
            }
            Rows::VsNccl(v) => {
                let mut libs = libs.into_iter();
                let (Some(ferroccl), Some(nccl)) = (libs.next(), libs.next()) else {
                    return;
                };
                let mut r = VsRow {
                    op: op.name().into(),
                    size: call.lay.bytes,
                    count: call.lay.count,
                    dtype: rs.dtype.name().into(),
                    redop: redop.into(),
                    root,
                    ferroccl,
                    nccl,
                    ratio_out_of_place: None,
                    ratio_in_place: None,
                };
                r.fill_ratios();
                let line = vs_table::format_row(&r, self.check);
                v.push(r);
                line
            }
        };
        self.print(&line);
        if let Some(pb) = &self.pb {
            pb.inc(1);
        }
    }

    pub fn end(&mut self) {
        let footer = match &self.rows {
            Rows::Alone(v) => table::footer(&v[self.section_start..], self.check),
            Rows::VsNccl(v) => vs_table::footer(&v[self.section_start..]),
        };
        self.print(&footer);
    }

    pub fn finish(&self) {
        if let Some(pb) = &self.pb {
            pb.finish_and_clear();
        }
    }
}

/// nccl-tests' preamble: the run's parameters and where every rank runs. `comms`: this
/// process's communicators (every rank of a one-process run, one under a launcher).
pub fn preamble(comms: &[Comm], spec: &Spec, mode: &str) -> String {
    let comm = &comms[0];
    let topo = comm.topology();
    let mut s = format!(
        "# ferroccl bench {} (commit {})\n#  ranks: {} ({mode}), backend: {}, {}\n#  minBytes {} ({}) maxBytes {} ({}) sizes {} warmup iters: {} iters: {} check: {}\n#\n# Using devices\n",
        env!("CARGO_PKG_VERSION"),
        &GIT_COMMIT[..GIT_COMMIT.len().min(12)],
        comm.nranks(),
        match comm.gpu() {
            Some(g) => format!("CUDA ({})", g.name()),
            None => "host".to_string(),
        },
        // The most the tuner gives an operation; smaller ones take fewer (the blocks column).
        match comm.gpu() {
            Some(_) => format!("up to {} blocks per operation", comm.config().gpu_channels),
            None => format!("channels {}", comm.config().channels),
        },
        spec.sizes.first().copied().unwrap_or(0),
        human(spec.sizes.first().copied().unwrap_or(0)),
        spec.sizes.last().copied().unwrap_or(0),
        human(spec.sizes.last().copied().unwrap_or(0)),
        spec.sizes.len(),
        spec.warmup,
        spec.iters,
        spec.check as u8
    );
    // A rank's device is known to its own process only: ranks of other processes show as
    // "a GPU" (`--devices 0,0` puts two ranks of this process on GPU 0).
    let device = |r: usize| match (
        comm.gpu(),
        comms.iter().find(|c| c.rank() == r).and_then(|c| c.gpu()),
    ) {
        (Some(_), Some(g)) => format!("GPU {}", g.ordinal()),
        (Some(_), None) => "a GPU".to_string(),
        (None, _) => "host memory".to_string(),
    };
    for (r, loc) in topo.ranks.iter().enumerate() {
        s += &format!(
            "#  Rank {r:>3} Pid {:>7} on {:>12} device {}\n",
            loc.pid,
            loc.hostname,
            device(r)
        );
    }
    s.pop();
    s
}

/// The preamble's lines about NCCL and how both libraries are run beside each other.
pub fn nccl_preamble(n: &NcclSide, graph: u64, buffers: Buffers, gpu_channels: usize) -> String {
    let lib = &n.lib;
    format!(
        "# NCCL {} from {} (NCCL_NVLS_ENABLE={}); all-to-all/gather/scatter: {}\n# timing: {}; buffers: {}; ferroccl: up to {} blocks per operation",
        lib.version_string(),
        lib.path(),
        n.nvls,
        if lib.has_native_all_to_all() { "NCCL's own calls" } else { "grouped ncclSend/ncclRecv" },
        if graph > 0 { format!("CUDA graph of each row's iterations, replayed {graph} times") } else { "host launches".into() },
        match n.reg {
            Register::Off => match buffers {
                Buffers::Cumem => "the same cuMem buffers for both".to_string(),
                Buffers::Driver => "the same cuMemAlloc buffers for both (nothing ferroccl can lend)".to_string(),
            },
            r => format!("NCCL's from ncclMemAlloc, registered ({}); ferroccl's from ferroccl::mem, registered as symmetric windows (zero-copy; copy engines from FERROCCL_GPU_CE_WINDOW_BYTES)", r.name()),
        },
        gpu_channels
    )
}
