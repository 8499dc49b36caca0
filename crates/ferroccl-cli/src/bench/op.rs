//! What `ferroccl bench` measures: the operations, their buffer layouts, and nccl-tests' way of
//! turning a time into bandwidths (doc/PERFORMANCE.md of nccl-tests).

use crate::api::{CollKind, DataType, Error};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BenchOp {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AllToAll,
    Gather,
    Scatter,
    /// A ring of point-to-point transfers: every rank sends to rank+1 and receives from rank-1
    /// in one group (nccl-tests' sendrecv_perf).
    SendRecv,
}

impl BenchOp {
    pub const ALL: [BenchOp; 9] = [
        BenchOp::AllReduce,
        BenchOp::AllGather,
        BenchOp::ReduceScatter,
        BenchOp::Broadcast,
        BenchOp::Reduce,
        BenchOp::AllToAll,
        BenchOp::Gather,
        BenchOp::Scatter,
        BenchOp::SendRecv,
    ];

    pub fn parse(s: &str) -> Result<Vec<BenchOp>, String> {
        let l = s.to_ascii_lowercase().replace('_', "-");
        match l.as_str() {
            "all" => return Ok(BenchOp::ALL.to_vec()),
            "sendrecv" | "send-recv" => return Ok(vec![BenchOp::SendRecv]),
            _ => {}
        }
        // The collectives' names are the library's (CollKind); send and recv alone are not
        // benchmarks.
        let kind: Option<CollKind> = l.parse().ok();
        BenchOp::ALL
            .iter()
            .find(|b| **b != BenchOp::SendRecv && Some(b.kind()) == kind)
            .map(|b| vec![*b])
            .ok_or_else(|| {
                format!(
                    "unknown operation '{s}' (one of all-reduce, all-gather, reduce-scatter, broadcast, reduce, alltoall, gather, scatter, sendrecv, all)"
                )
            })
    }

    pub const fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all-reduce",
            BenchOp::AllGather => "all-gather",
            BenchOp::ReduceScatter => "reduce-scatter",
            BenchOp::Broadcast => "broadcast",
            BenchOp::Reduce => "reduce",
            BenchOp::AllToAll => "alltoall",
            BenchOp::Gather => "gather",
            BenchOp::Scatter => "scatter",
            BenchOp::SendRecv => "sendrecv",
        }
    }

    /// The library operation; the send/recv ring posts a `Send` and a `Recv` per rank.
    pub const fn kind(self) -> CollKind {
        match self {
            BenchOp::AllReduce => CollKind::AllReduce,
            BenchOp::AllGather => CollKind::AllGather,
            BenchOp::ReduceScatter => CollKind::ReduceScatter,
            BenchOp::Broadcast => CollKind::Broadcast,
            BenchOp::Reduce => CollKind::Reduce,
            BenchOp::AllToAll => CollKind::AllToAll,
            BenchOp::Gather => CollKind::Gather,
            BenchOp::Scatter => CollKind::Scatter,
            BenchOp::SendRecv => CollKind::Send,
        }
    }

    pub const fn reduces(self) -> bool {
        self.kind().reduces()
    }

    pub const fn has_root(self) -> bool {
        self.kind().has_root()
    }

    /// The send/recv ring has no in-place form whose result is defined (a rank would overwrite
    /// data it has yet to send), so its in-place columns stay empty. All-to-all in place is
    /// defined by ferroccl (send == recv) and measured.
    pub const fn has_in_place(self) -> bool {
        !matches!(self, BenchOp::SendRecv)
    }

    /// nccl-tests' bus-bandwidth factor: busbw = algbw * factor, the fraction of the data each
    /// rank must move over its busiest link for an optimal algorithm, so that busbw is
    /// comparable with the hardware's link bandwidth whatever the rank count.
    pub fn busbw_factor(self, nranks: usize) -> f64 {
        let n = nranks as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather
            | BenchOp::ReduceScatter
            | BenchOp::AllToAll
            | BenchOp::Gather
            | BenchOp::Scatter => (n - 1.0) / n,
            BenchOp::Broadcast | BenchOp::Reduce | BenchOp::SendRecv => 1.0,
        }
    }

    /// The layout of one row for a requested `size` in bytes.
    ///
    /// As in nccl-tests, `size` is the largest buffer of the operation: for all-gather the
    /// total output (n * count elements), for reduce-scatter the total input (n * count), for
    /// alltoall / gather / scatter the n * count block; the per-rank `count` is that divided by
    /// n, rounded down, and the printed size is rounded down with it. The "count" column is
    /// the `count` argument of the call (per rank for those five ops), again as nccl-tests
    /// prints it. algbw divides the printed size by the time.
    pub fn layout(self, size: usize, dtype: DataType, nranks: usize) -> Layout {
        let w = dtype.size();
        let elems = size / w;
        let per_rank_split = matches!(
            self,
            BenchOp::AllGather
                | BenchOp::ReduceScatter
                | BenchOp::AllToAll
                | BenchOp::Gather
                | BenchOp::Scatter
        );
        let (count, total) = if per_rank_split {
            let c = elems / nranks;
            (c, c * nranks)
        } else {
            (elems, elems)
        };
        Layout {
            count,
            bytes: total * w,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The `count` argument of the call.
    pub count: usize,
    /// The printed size, also the bytes algbw counts.
    pub bytes: usize,
}

/// Where one rank's input and output lie, in bytes: out of place each at the start of its own
/// buffer; in place both in one buffer, at NCCL's offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Regions {
    pub send_off: usize,
    pub send_len: usize,
    pub recv_off: usize,
    pub recv_len: usize,
    pub in_place: bool,
}

impl Regions {
    pub fn new(
        op: BenchOp,
        count: usize,
        dtype: DataType,
        nranks: usize,
        rank: usize,
        root: usize,
        in_place: bool,
    ) -> Result<Regions, Error> {
        let w = dtype.size();
        let is_root = op.has_root() && rank == root;
        let (sc, rc) = match op {
            BenchOp::SendRecv => (count, count),
            _ => op
                .kind()
                .buffer_counts(count, nranks, is_root)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "{count} elements per rank overflow on {nranks} ranks"
                    ))
                })?,
        };
        let (sl, rl) = (sc * w, rc * w);
        if !in_place {
            return Ok(Regions {
                send_off: 0,
                send_len: sl,
                recv_off: 0,
                recv_len: rl,
                in_place,
            });
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
        Ok(Regions {
            send_off: so,
            send_len: sl,
            recv_off: ro,
            recv_len: rl,
            in_place,
        })
    }

    /// Bytes of the one in-place buffer, or of the send buffer out of place.
    pub fn send_buffer_len(&self) -> usize {
        if self.in_place {
            (self.send_off + self.send_len).max(self.recv_off + self.recv_len)
        } else {
            self.send_len
        }
    }
}

/// (algbw, busbw) in GB/s (10^9 bytes per second) of `bytes` moved in `time_us`.
pub fn bandwidths(op: BenchOp, bytes: usize, time_us: f64, nranks: usize) -> (f64, f64) {
    if time_us <= 0.0 {
        return (0.0, 0.0);
    }
    let alg = bytes as f64 / 1e3 / time_us;
    (alg, alg * op.busbw_factor(nranks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busbw_factors_are_nccl_tests_ones() {
        let f = |op: BenchOp, n| op.busbw_factor(n);
        assert_eq!(f(BenchOp::AllReduce, 4), 1.5);
        assert_eq!(f(BenchOp::AllReduce, 2), 1.0);
        assert_eq!(f(BenchOp::AllReduce, 1), 0.0);
        for op in [
            BenchOp::AllGather,
            BenchOp::ReduceScatter,
            BenchOp::AllToAll,
            BenchOp::Gather,
            BenchOp::Scatter,
        ] {
            assert_eq!(f(op, 4), 0.75, "{op:?}");
            assert_eq!(f(op, 8), 0.875, "{op:?}");
        }
        for op in [BenchOp::Broadcast, BenchOp::Reduce, BenchOp::SendRecv] {
            assert_eq!(f(op, 4), 1.0, "{op:?}");
        }
        // 1 GB in 1 s on 4 ranks.
        let (alg, bus) = bandwidths(BenchOp::AllReduce, 1_000_000_000, 1e6, 4);
        assert!((alg - 1.0).abs() < 1e-12 && (bus - 1.5).abs() < 1e-12);
        assert_eq!(bandwidths(BenchOp::AllReduce, 8, 0.0, 4), (0.0, 0.0));
    }

    #[test]
    fn layouts_follow_nccl_tests_size_conventions() {
        let f = DataType::Float32;
        assert_eq!(
            BenchOp::AllReduce.layout(1024, f, 4),
            Layout {
                count: 256,
                bytes: 1024
            }
        );
        assert_eq!(
            BenchOp::AllGather.layout(1024, f, 4),
            Layout {
                count: 64,
                bytes: 1024
            }
        );
        assert_eq!(
            BenchOp::ReduceScatter.layout(1000, f, 3),
            Layout {
                count: 83,
                bytes: 996
            }
        );
        assert_eq!(
            BenchOp::AllGather.layout(8, f, 4),
            Layout { count: 0, bytes: 0 }
        );
        assert_eq!(
            BenchOp::Broadcast.layout(7, DataType::Float64, 4),
            Layout { count: 0, bytes: 0 }
        );
        assert_eq!(
            BenchOp::SendRecv.layout(64, DataType::Int8, 4),
            Layout {
                count: 64,
                bytes: 64
            }
        );
    }

    #[test]
    fn names_parse_back() {
        for op in BenchOp::ALL {
            assert_eq!(BenchOp::parse(op.name()).unwrap(), vec![op]);
        }
        assert_eq!(BenchOp::parse("all").unwrap().len(), 9);
        assert_eq!(
            BenchOp::parse("all_reduce").unwrap(),
            vec![BenchOp::AllReduce]
        );
        assert!(BenchOp::parse("allsum").is_err());
    }

    #[test]
    fn in_place_regions_follow_nccl() {
        let f = DataType::Float32;
        let g = Regions::new(BenchOp::AllGather, 3, f, 4, 2, 0, true).unwrap();
        assert_eq!(
            (
                g.send_off,
                g.send_len,
                g.recv_off,
                g.recv_len,
                g.send_buffer_len()
            ),
            (24, 12, 0, 48, 48)
        );
        let g = Regions::new(BenchOp::ReduceScatter, 3, f, 4, 1, 0, true).unwrap();
        assert_eq!(
            (g.send_off, g.send_len, g.recv_off, g.recv_len),
            (0, 48, 12, 12)
        );
        let g = Regions::new(BenchOp::Gather, 3, f, 4, 1, 1, true).unwrap();
        assert_eq!((g.send_off, g.recv_len), (12, 48));
        let g = Regions::new(BenchOp::Gather, 3, f, 4, 2, 1, true).unwrap();
        assert_eq!((g.send_off, g.send_len, g.recv_len), (0, 12, 0));
        let g = Regions::new(BenchOp::AllReduce, 3, f, 4, 2, 0, false).unwrap();
        assert_eq!(
            (g.send_off, g.recv_off, g.recv_len, g.send_buffer_len()),
            (0, 0, 12, 12)
        );
    }
}
