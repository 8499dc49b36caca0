//! What every rank puts in and must get out of each operation, element by element, for the
//! correctness tests and `ferroccl bench --check` (nccl-tests' verifiable mode, for every op).

#[cfg(test)]
use super::element::store_f64;
use super::element::Element;
use super::verify::{
    data_value, data_values_into, expected_reduced, expected_reduced_into, fill_data, fill_input,
    input_value, Matcher,
};
use crate::types::{CollKind, DataType, Rank, ReduceOp};

/// Elements whose expected values `count_wrong` works out at a time.
const BLOCK: usize = 1024;

/// Where a run of output elements comes from: reduced at consecutive indices, or one rank's
/// data at consecutive indices.
#[derive(Clone, Copy)]
enum Source {
    Reduced(usize),
    Data(Rank, usize),
}

/// One operation as one rank sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankCase {
    /// The operation.
    pub kind: CollKind,
    /// The element type.
    pub dtype: DataType,
    /// The reduction (for those that reduce).
    pub op: ReduceOp,
    /// Ranks of the communicator.
    pub nranks: usize,
    /// This rank.
    pub rank: Rank,
    /// NCCL's count (see `CollKind::buffer_counts`).
    pub count: usize,
    /// Root, or the peer of a send / receive.
    pub root: Rank,
    /// The seed that makes the data fresh and reproducible.
    pub seed: u64,
}

impl RankCase {
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
        if self.kind.reduces() {
            fill_input(
                self.dtype,
                self.op,
                self.nranks,
                self.rank,
                0,
                self.seed,
                buf,
            )
        } else {
            fill_data(self.dtype, self.rank, 0, self.seed, buf)
        }
    }

    /// Where output elements `j..` come from, and for how many elements that run goes on
    /// (None where the operation leaves the output alone).
    fn source(&self, j: usize) -> Option<(Source, usize)> {
        let (c, r) = (self.count.max(1), self.rank);
        let all = usize::MAX;
        let seg = c - j % c;
        Some(match self.kind {
            CollKind::AllReduce => (Source::Reduced(j), all),
            CollKind::ReduceScatter => (Source::Reduced(r * self.count + j), all),
            CollKind::Reduce if r == self.root => (Source::Reduced(j), all),
            CollKind::Broadcast | CollKind::Recv => (Source::Data(self.root, j), all),
            CollKind::AllGather => (Source::Data(j / c, j % c), seg),
            CollKind::AllToAll => (Source::Data(j / c, r * self.count + j % c), seg),
            CollKind::Gather if r == self.root => (Source::Data(j / c, j % c), seg),
            CollKind::Scatter => (Source::Data(self.root, r * self.count + j), all),
            CollKind::Reduce | CollKind::Gather | CollKind::Send => return None,
        })
    }

    /// The value output element `j` must hold, or None where the operation leaves it alone.
    pub fn expected(&self, j: usize) -> Option<f64> {
        Some(match self.source(j)?.0 {
            Source::Reduced(idx) => {
                expected_reduced(self.dtype, self.op, self.nranks, idx, self.seed)
            }
            Source::Data(rank, idx) => data_value(self.dtype, rank, idx, self.seed),
        })
    }

    /// How an output element is compared with its expected value: moved data must be exact.
    pub fn matcher(&self) -> Matcher {
        if self.kind.reduces() {
            Matcher::new(self.dtype, self.op, self.nranks)
        } else {
            Matcher::Exact
        }
    }

    /// Counts the wrong elements of `out`; `first_bad` gets the first one (index, got, want).
    pub fn count_wrong(&self, out: &[u8], first_bad: &mut Option<(usize, f64, f64)>) -> usize {
        let len = out.len() / self.dtype.size();
        let matcher = self.matcher();
        let mut want = [0.0f64; BLOCK];
        let mut wrong = 0;
        let mut j = 0;
        while j < len {
            let Some((src, run)) = self.source(j) else {
                break;
            };
            let m = run.min(BLOCK).min(len - j);
            let want = &mut want[..m];
            match src {
                Source::Reduced(idx) => {
                    expected_reduced_into(self.dtype, self.op, self.nranks, idx, self.seed, want)
                }
                Source::Data(rank, idx) => data_values_into(self.dtype, rank, idx, self.seed, want),
            }
            wrong += compare(
                self.dtype,
                matcher,
                &out[j * self.dtype.size()..(j + m) * self.dtype.size()],
                want,
                j,
                first_bad,
            );
            j += m;
        }
        wrong
    }
}

/// Counts the elements of `got` (native endian) that do not match `want`; the first is reported
/// (with its index offset by `base`) unless one already was.
fn compare(
    dtype: DataType,
    matcher: Matcher,
    got: &[u8],
    want: &[f64],
    base: usize,
    first_bad: &mut Option<(usize, f64, f64)>,
) -> usize {
    let mut wrong = 0;
    with_element_type!(dtype, T => {
        for (i, (chunk, &w)) in got.chunks_exact(std::mem::size_of::<T>()).zip(want).enumerate() {
            // SAFETY: the chunk holds exactly one element of T, valid for any bit pattern.
            let g = unsafe { std::ptr::read_unaligned(chunk.as_ptr() as *const T) }.to_f64();
            if !matcher.ok(g, w) {
                wrong += 1;
                if first_bad.is_none() {
                    *first_bad = Some((base + i, g, w));
                }
            }
        }
    });
    wrong
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_output_is_counted() {
        let case = RankCase {
            kind: CollKind::AllGather,
            dtype: DataType::Float32,
            op: ReduceOp::Sum,
            nranks: 3,
            rank: 1,
            count: 5,
            root: 0,
            seed: 9,
        };
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
