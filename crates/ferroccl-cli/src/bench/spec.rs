//! What every rank must agree on, derived from the arguments: the rows of the sweep in
//! nccl-tests' order, the iterations of each, and the buffer size that holds them all.

use super::op::BenchOp;
use super::BenchArgs;
use crate::api::{DataType, ReduceOp};
use crate::size::sweep;

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
    /// ferroccl's GPU buffers registered as symmetric windows (zero-copy).
    pub register: bool,
    /// Where unregistered GPU buffers come from (--buffers).
    pub buffers: Buffers,
}

/// Where the benchmark's unregistered GPU buffers come from (`--buffers`): what a user's
/// allocator gives decides which of ferroccl's zero-copy paths can take them, as ferroccl lends
/// only cuMem allocations with POSIX file-descriptor handles to its peers on the fly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Buffers {
    /// `cuMemCreate` with POSIX file-descriptor handles (ferroccl's own allocator, and PyTorch's
    /// with expandable segments): lent on the fly to the peers that write (or, a reduce's input,
    /// read) them.
    #[default]
    Cumem,
    /// `cuMemAlloc`, what `cudaMalloc` and PyTorch's default caching allocator give: nothing
    /// ferroccl can lend, so its operations run on the kernels' staged rounds.
    Driver,
}

impl Buffers {
    /// Its name in records and preambles.
    pub fn name(self) -> &'static str {
        match self {
            Buffers::Cumem => "cumem",
            Buffers::Driver => "driver",
        }
    }
}

/// One row of the table before it is measured.
#[derive(Clone, Copy, Debug)]
pub struct RowSpec {
    pub op: BenchOp,
    pub size: usize,
    pub dtype: DataType,
    /// None for operations that do not reduce.
    pub redop: Option<ReduceOp>,
    /// Position in the whole run, so that every row gets its own check seeds.
    pub index: u64,
}

impl Spec {
    pub fn from_args(a: &BenchArgs) -> Result<Spec, String> {
        let dtypes = if a.dtype.eq_ignore_ascii_case("all") {
            DataType::ALL.to_vec()
        } else {
            // A comma list runs several types in one sweep (e.g. `-d float,bfloat16`).
            a.dtype
                .split(',')
                .map(|d| d.trim().parse::<DataType>().map_err(|e| e.to_string()))
                .collect::<Result<Vec<_>, _>>()?
        };
        let redops = if a.redop.eq_ignore_ascii_case("all") {
            // premulsum by 2: a scalar valid for every type, integers included.
            ReduceOp::BUILTIN
                .iter()
                .copied()
                .chain([ReduceOp::PreMulSum(2.0)])
                .collect()
        } else {
            vec![a.redop.parse::<ReduceOp>().map_err(|e| e.to_string())?]
        };
        for &d in &dtypes {
            for &o in &redops {
                o.validate(d).map_err(|e| e.to_string())?;
            }
        }
        if a.buffers != Buffers::Cumem && a.gpus == 0 {
            return Err(format!(
                "--buffers {}: GPU ranks only (the host backend's buffers are host memory)",
                a.buffers.name()
            ));
        }
        if a.register.is_some() && a.buffers != Buffers::Cumem {
            return Err(format!(
                "--buffers {} with --register: windows are made of ferroccl::mem's buffers",
                a.buffers.name()
            ));
        }
        if a.min > a.max {
            return Err(format!("-b {} is larger than -e {}", a.min, a.max));
        }
        // Both would walk the sizes a byte at a time, or not at all, where a user meant steps.
        if a.factor == 0 {
            return Err("-f 0: the step factor must be at least 1 (-f 2 doubles the size each row; -f 1 -i N adds N bytes)".into());
        }
        if a.factor == 1 && a.step == 0 {
            return Err("-f 1 -i 0: with a factor of 1 each row adds -i bytes, which must be more than 0 (or give -f 2 or more)".into());
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
            buffers: a.buffers,
        })
    }

    /// (timed, warm-up) iterations for a row of `size` bytes (see --iter-budget).
    pub fn iters_for(&self, size: usize) -> (u64, u64) {
        let iters = match self.iter_budget {
            Some(b) => self.iters.min((b / size.max(1)).max(1) as u64),
            None => self.iters,
        };
        (iters, self.warmup.min(iters))
    }

    /// nccl-tests' loop order: size, then type, then reduction.
    pub fn rows(&self, op: BenchOp) -> Vec<RowSpec> {
        let base = self.ops.iter().position(|&o| o == op).unwrap_or(0) as u64 * 1_000_000;
        let redops: Vec<Option<ReduceOp>> = if op.reduces() {
            self.redops.iter().copied().map(Some).collect()
        } else {
            vec![None]
        };
        let mut out = Vec::new();
        for &size in &self.sizes {
            for &dtype in &self.dtypes {
                for &redop in &redops {
                    out.push(RowSpec {
                        op,
                        size,
                        dtype,
                        redop,
                        index: base + out.len() as u64,
                    });
                }
            }
        }
        out
    }

    pub fn total_rows(&self) -> usize {
        self.ops.iter().map(|&o| self.rows(o).len()).sum()
    }

    /// The size of each of a rank's buffers, which every row fits in: the largest size
    /// (nccl-tests' convention makes it the largest buffer of any operation), in whole 2 MiB
    /// granules so that symmetric registration sees equal, aligned sizes on every rank.
    pub fn buffer_bytes(&self) -> usize {
        let max = self.sizes.iter().copied().max().unwrap_or(0).max(1);
        max.div_ceil(2 << 20) * (2 << 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::tests::args;

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
    fn a_sweep_that_cannot_step_is_refused() {
        let mut a = args();
        a.factor = 0;
        assert!(Spec::from_args(&a).unwrap_err().contains("-f 0"));
        (a.factor, a.step) = (1, 0);
        assert!(Spec::from_args(&a).unwrap_err().contains("-i 0"));
        // -f 1 -i N adds N bytes a row, every row distinct.
        (a.min, a.max, a.step) = (1 << 20, 4 << 20, 1 << 20);
        assert_eq!(
            Spec::from_args(&a).unwrap().sizes,
            vec![1 << 20, 2 << 20, 3 << 20, 4 << 20]
        );
    }

    #[test]
    fn data_types_may_be_a_list() {
        let mut a = args();
        a.dtype = "float, bfloat16".into();
        assert_eq!(
            Spec::from_args(&a).unwrap().dtypes,
            vec![DataType::Float32, DataType::Bfloat16]
        );
        a.dtype = "float,nonsense".into();
        assert!(Spec::from_args(&a).is_err());
    }

    #[test]
    fn rows_get_distinct_seed_indices() {
        let mut a = args();
        (a.op, a.max, a.iters, a.warmup, a.dtype, a.redop, a.check) =
            ("all".into(), 64, 1, 0, "all".into(), "all".into(), true);
        let spec = Spec::from_args(&a).unwrap();
        let mut idx: Vec<u64> = spec
            .ops
            .iter()
            .flat_map(|&o| spec.rows(o))
            .map(|r| r.index)
            .collect();
        let n = idx.len();
        // 4 sizes x 12 types x (6 reductions, pre-mul-sum included, for 3 ops + 1 for 6 ops).
        assert_eq!(n, 4 * 12 * (3 * 6 + 6));
        idx.sort();
        idx.dedup();
        assert_eq!(idx.len(), n);
    }

    #[test]
    fn buffers_are_whole_granules_that_hold_the_largest_row() {
        let mut a = args();
        a.min = 3 << 20;
        a.max = 3 << 20;
        let spec = Spec::from_args(&a).unwrap();
        assert_eq!(spec.buffer_bytes(), 4 << 20);
        a.min = 8;
        a.max = 8;
        assert_eq!(Spec::from_args(&a).unwrap().buffer_bytes(), 2 << 20);
    }
}
