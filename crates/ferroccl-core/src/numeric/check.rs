//! What every rank puts in and must get out of each operation, element by element, for the
//! correctness tests and `ferroccl bench --check` (nccl-tests' verifiable mode, for every op).

use super::element::{load_f64, store_f64};
use super::verify::{data_value, expected_reduced, input_value, matches};
use crate::types::{CollKind, DataType, Rank, ReduceOp};

/// One operation as one rank sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CheckCase {
    pub kind: CollKind,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub nranks: usize,
    pub rank: Rank,
    pub count: usize,
    /// Root, or the peer of a send / receive.
    pub root: Rank,
    pub seed: u64,
}

impl CheckCase {
    /// Input element `i` of this rank.
    pub fn input(&self, i: usize) -> f64 {
        if self.kind.reduces() {
            input_value(self.dtype, self.op, self.nranks, self.rank, i, self.seed)
        } else {
            data_value(self.dtype, self.rank, i, self.seed)
        }
    }

    /// Fills `buf` (the input, `buf.len() / dtype.size()` elements).
    pub fn fill_input(&self, buf: &mut [u8]) {
        for i in 0..buf.len() / self.dtype.size() {
            store_f64(self.dtype, buf, i, self.input(i));
        }
    }

    /// The value output element `j` must hold, or None where the operation leaves it alone.
    pub fn expected(&self, j: usize) -> Option<f64> {
        let (c, r, d) = (self.count.max(1), self.rank, self.dtype);
        let red = |idx| expected_reduced(d, self.op, self.nranks, idx, self.seed);
        Some(match self.kind {
            CollKind::AllReduce => red(j),
            CollKind::ReduceScatter => red(r * self.count + j),
            CollKind::Reduce if r == self.root => red(j),
            CollKind::Broadcast => data_value(d, self.root, j, self.seed),
            CollKind::AllGather => data_value(d, j / c, j % c, self.seed),
            CollKind::AllToAll => data_value(d, j / c, r * self.count + j % c, self.seed),
            CollKind::Gather if r == self.root => data_value(d, j / c, j % c, self.seed),
            CollKind::Scatter => data_value(d, self.root, r * self.count + j, self.seed),
            CollKind::Recv => data_value(d, self.root, j, self.seed),
            CollKind::Reduce | CollKind::Gather | CollKind::Send => return None,
        })
    }

    /// Counts the wrong elements of `out`; `first_bad` gets the first one (index, got, want).
    pub fn count_wrong(&self, out: &[u8], first_bad: &mut Option<(usize, f64, f64)>) -> usize {
        let mut wrong = 0;
        for j in 0..out.len() / self.dtype.size() {
            let Some(want) = self.expected(j) else { continue };
            let got = load_f64(self.dtype, out, j);
            let ok = if self.kind.reduces() { matches(self.dtype, self.op, self.nranks, got, want) } else { got == want };
            if !ok {
                wrong += 1;
                if first_bad.is_none() {
                    *first_bad = Some((j, got, want));
                }
            }
        }
        wrong
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_output_is_counted() {
        let case = CheckCase { kind: CollKind::AllGather, dtype: DataType::Float32, op: ReduceOp::Sum, nranks: 3, rank: 1, count: 5, root: 0, seed: 9 };
        let mut out = vec![0u8; 15 * 4];
        for j in 0..15 {
            store_f64(DataType::Float32, &mut out, j, case.expected(j).unwrap());
        }
        let mut bad = None;
        assert_eq!(case.count_wrong(&out, &mut bad), 0);
        store_f64(DataType::Float32, &mut out, 7, case.expected(8).unwrap());
        assert!(case.count_wrong(&out, &mut bad) >= 1);
        assert_eq!(bad.unwrap().0, 7);
    }
}
