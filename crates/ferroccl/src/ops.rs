//! One operation's arguments, their validation before anything is touched, and the plan of a
//! launch of them, as the tuner chooses it.

use crate::info::CommInfo;
use ferroccl_core::algo::{build_launch, CollDesc, LaunchOp};
use ferroccl_core::numeric::Element;
use ferroccl_core::plan::Plan;
use ferroccl_core::tune::{choose_launch, Choice, OpShape};
use ferroccl_core::{CollKind, DataType, Error, Rank, ReduceOp};

/// An operation on raw buffers, with NCCL's conventions: `count` is per rank for all-gather,
/// the per-rank output for reduce-scatter, per peer for all-to-all, gather and scatter; `root`
/// is the root of rooted collectives and the peer of a send or receive. In place means
/// `send == recv` (all-reduce, broadcast, reduce, all-to-all), `send == recv + rank * count`
/// elements (all-gather, gather at the root), `recv == send + rank * count` elements
/// (reduce-scatter, scatter at the root).
#[derive(Clone, Copy, Debug)]
pub struct OpArgs {
    /// The operation.
    pub kind: CollKind,
    /// The input (unused, may be null: receive; scatter off the root).
    pub send: *const u8,
    /// The output (unused, may be null: send; reduce, gather off the root).
    pub recv: *mut u8,
    /// Elements, by NCCL's convention above.
    pub count: usize,
    /// Element type of both buffers.
    pub dtype: DataType,
    /// The reduction (ignored by operations that do not reduce).
    pub op: ReduceOp,
    /// Root of broadcast, reduce, gather and scatter; peer of send and receive.
    pub root: Rank,
    /// With `op = PreMulSum(_)`: the device address of the scalar, one element of `dtype`, read
    /// by the GPU when the operation runs rather than when it is enqueued (NCCL's
    /// `ncclScalarDevice`), so a captured graph replays with the scalar's current value. The
    /// value inside `PreMulSum` is then ignored. GPU communicators only.
    pub device_scalar: Option<u64>,
}

// SAFETY: the pointers are only dereferenced by the executor while the caller's unsafe
// contract (buffers valid for the operation's duration) holds.
unsafe impl Send for OpArgs {}
unsafe impl Sync for OpArgs {}

impl OpArgs {
    /// Checks everything that can be checked locally: ranks, sizes, overflow, pointers,
    /// alignment and aliasing. An error here changes nothing.
    pub(crate) fn validate(&self, rank: Rank, nranks: usize) -> Result<(), Error> {
        let k = self.kind;
        if (k.has_root() || matches!(k, CollKind::Send | CollKind::Recv)) && self.root >= nranks {
            let what = if k.has_root() { "root" } else { "peer" };
            return Err(Error::InvalidArgument(format!(
                "{k}: {what} {} is not a rank of this communicator of {nranks}",
                self.root
            )));
        }
        if k.reduces() {
            self.op.validate(self.dtype).map_err(|e| e.context(k))?;
        }
        if let Some(p) = self.device_scalar {
            if !k.reduces() || !matches!(self.op, ReduceOp::PreMulSum(_)) {
                return Err(Error::InvalidArgument(format!(
                    "{k}: a device scalar is only meaningful for a pre-mul-sum reduction, not {}",
                    self.op
                )));
            }
            if p == 0 || p % self.dtype.size() as u64 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{k}: device scalar address {p:#x} is null or not aligned to its {}-byte type {}",
                    self.dtype.size(),
                    self.dtype
                )));
            }
        }
        let (sc, rc) = k
            .buffer_counts(self.count, nranks, self.root == rank)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{k}: count {} times {nranks} ranks overflows",
                    self.count
                ))
            })?;
        let es = self.dtype.size();
        let bytes = |c: usize, which: &str| -> Result<usize, Error> {
            c.checked_mul(es)
                .filter(|&b| b <= isize::MAX as usize)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "{k}: {which} buffer of {c} x {} bytes exceeds isize::MAX",
                        self.dtype
                    ))
                })
        };
        let send_bytes = bytes(sc, "send")?;
        let recv_bytes = bytes(rc, "recv")?;
        for (p, b, which) in [
            (self.send, send_bytes, "send"),
            (self.recv as *const u8, recv_bytes, "recv"),
        ] {
            if b == 0 {
                continue;
            }
            if p.is_null() {
                return Err(Error::InvalidArgument(format!(
                    "{k}: {which} buffer is null but holds {b} bytes"
                )));
            }
            if !(p as usize).is_multiple_of(es) {
                return Err(Error::InvalidArgument(format!(
                    "{k}: {which} buffer {p:p} is not aligned to its {}-byte element type {}",
                    es, self.dtype
                )));
            }
            if (p as usize).checked_add(b).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "{k}: {which} buffer {p:p} + {b} bytes wraps the address space"
                )));
            }
        }
        if send_bytes > 0 && recv_bytes > 0 {
            let (s, r) = (self.send as usize, self.recv as usize);
            let overlap = s < r + recv_bytes && r < s + send_bytes;
            if overlap && !self.is_in_place(rank) {
                return Err(Error::InvalidArgument(format!(
                    "{k}: send [{s:#x}, +{send_bytes}) and recv [{r:#x}, +{recv_bytes}) overlap without being in place \
                     (in place means {})",
                    in_place_rule(k)
                )));
            }
        }
        Ok(())
    }

    /// True when the buffers follow NCCL's in-place convention for this operation.
    pub fn is_in_place(&self, rank: Rank) -> bool {
        let off = rank
            .wrapping_mul(self.count)
            .wrapping_mul(self.dtype.size());
        let (s, r) = (self.send as usize, self.recv as usize);
        match self.kind {
            CollKind::AllGather => s == r.wrapping_add(off),
            CollKind::Gather if rank == self.root => s == r.wrapping_add(off),
            CollKind::ReduceScatter => r == s.wrapping_add(off),
            CollKind::Scatter if rank == self.root => r == s.wrapping_add(off),
            _ => s == r,
        }
    }
}

impl OpArgs {
    /// The arguments of `kind` on typed buffers, the count following from their lengths (see
    /// [`Comm::run`](crate::Comm::run)).
    pub(crate) fn typed<T: Element>(
        kind: CollKind,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: Rank,
        rank: Rank,
        n: usize,
    ) -> Result<OpArgs, Error> {
        let count = match kind {
            CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce | CollKind::Send => {
                send.len()
            }
            CollKind::AllGather | CollKind::Gather => send.len(),
            CollKind::ReduceScatter | CollKind::Scatter | CollKind::Recv => recv.len(),
            CollKind::AllToAll => {
                if !send.len().is_multiple_of(n) {
                    return Err(Error::InvalidArgument(format!(
                        "alltoall: send length {} is not a multiple of {n} ranks",
                        send.len()
                    )));
                }
                send.len() / n
            }
        };
        let (sc, rc) = kind.buffer_counts(count, n, root == rank).ok_or_else(|| {
            Error::InvalidArgument(format!("{kind}: count {count} times {n} ranks overflows"))
        })?;
        if send.len() < sc || recv.len() < rc {
            return Err(Error::InvalidArgument(format!(
                "{kind}: buffers hold {} and {} elements, the operation needs {sc} and {rc}",
                send.len(),
                recv.len()
            )));
        }
        Ok(OpArgs {
            kind,
            send: send.as_ptr() as *const u8,
            recv: recv.as_mut_ptr() as *mut u8,
            count,
            dtype: T::DTYPE,
            op,
            root,
            device_scalar: None,
        })
    }

    /// The arguments of `kind` in place on `buf`, by NCCL's conventions (see
    /// [`Comm::run_in_place`](crate::Comm::run_in_place)).
    pub(crate) fn in_place<T: Element>(
        kind: CollKind,
        buf: &mut [T],
        op: ReduceOp,
        root: Rank,
        rank: Rank,
        n: usize,
    ) -> Result<OpArgs, Error> {
        let es = std::mem::size_of::<T>();
        let blocked = matches!(
            kind,
            CollKind::AllGather | CollKind::ReduceScatter | CollKind::AllToAll
        ) || (matches!(kind, CollKind::Gather | CollKind::Scatter) && rank == root);
        if matches!(kind, CollKind::Send | CollKind::Recv) {
            return Err(Error::InvalidArgument(format!(
                "{kind} has no in-place form"
            )));
        }
        let count = if blocked {
            if !buf.len().is_multiple_of(n) {
                return Err(Error::InvalidArgument(format!(
                    "{kind} in place: length {} is not a multiple of {n} ranks",
                    buf.len()
                )));
            }
            buf.len() / n
        } else {
            buf.len()
        };
        let base = buf.as_mut_ptr() as *mut u8;
        // SAFETY: offsets stay within `buf` (block `rank` of `n`).
        let block = unsafe { base.add(rank * count * es) };
        let (send, recv) = match kind {
            CollKind::AllGather => (block as *const u8, base),
            CollKind::Gather if rank == root => (block as *const u8, base),
            CollKind::ReduceScatter => (base as *const u8, block),
            CollKind::Scatter if rank == root => (base as *const u8, block),
            _ => (base as *const u8, base),
        };
        Ok(OpArgs {
            kind,
            send,
            recv,
            count,
            dtype: T::DTYPE,
            op,
            root,
            device_scalar: None,
        })
    }

    /// The operation as the tuner sees it on `info`'s rank (`symmetric`: see
    /// [`OpShape::symmetric`]).
    /// Its shape as the tuner sees it; `symmetric` and `inputs_symmetric` as `OpShape` says,
    /// found by the caller in its windows.
    pub(crate) fn shape(
        &self,
        info: &CommInfo,
        windows: bool,
        symmetric: bool,
        inputs_symmetric: bool,
    ) -> OpShape {
        OpShape {
            kind: self.kind,
            count: self.count,
            dtype: self.dtype,
            nranks: info.nranks,
            in_place: self.is_in_place(info.rank),
            windows,
            symmetric,
            inputs_symmetric,
            redop: self.redop().nccl_id(),
        }
    }

    /// The reduction the operation applies (Sum, unused, for those that do not reduce).
    pub(crate) fn redop(&self) -> ReduceOp {
        if self.kind.reduces() {
            self.op
        } else {
            ReduceOp::Sum
        }
    }
}

/// A launch of `args` on `info`'s rank: each operation's shape and the tuner's choice for it, and
/// the plan they make. Every rank builds the same messages from its own arguments (config and
/// shapes are shared), which is what lets a zero-copy sender build its peers' plans.
pub(crate) struct Planned {
    pub shapes: Vec<OpShape>,
    pub choices: Vec<Choice>,
    pub plan: Plan,
}

/// `symmetric` says of each operation whether its buffers lie in symmetric windows, and whether
/// every rank's input does (`OpShape::symmetric`, `OpShape::inputs_symmetric`).
pub(crate) fn plan_launch(
    info: &CommInfo,
    args: &[OpArgs],
    windows: bool,
    symmetric: &dyn Fn(&OpArgs) -> (bool, bool),
) -> Result<Planned, Error> {
    let shapes: Vec<OpShape> = args
        .iter()
        .map(|a| {
            let (s, inputs) = symmetric(a);
            a.shape(info, windows, s, inputs)
        })
        .collect();
    let choices: Vec<Choice> = choose_launch(&shapes, info.device, &info.config);
    let ops: Vec<LaunchOp> = args
        .iter()
        .zip(&choices)
        .map(|(a, c)| LaunchOp {
            desc: CollDesc {
                kind: a.kind,
                count: a.count,
                root: a.root,
            },
            dtype: a.dtype,
            tuning: c.tuning(),
        })
        .collect();
    // Only the plan kernel and the host executor run plans; the one-kernel engines and the
    // copy engine are specialised for their shapes (proved by the algorithms' and
    // `plan::copies`' own tests), and take one operation a launch.
    if !choices.iter().any(|c| c.engine.runs_plans()) {
        let plan = Plan {
            rank: info.rank,
            nranks: info.nranks,
            lanes: Vec::new(),
        };
        return Ok(Planned {
            shapes,
            choices,
            plan,
        });
    }
    let plan = build_launch(info.rank, info.nranks, &ops)?;
    if cfg!(debug_assertions) {
        let sizes: Vec<(usize, usize)> = args
            .iter()
            .map(|a| {
                a.kind
                    .buffer_counts(a.count, info.nranks, a.root == info.rank)
                    .expect("validated")
            })
            .collect();
        plan.validate(&sizes).map_err(Error::Internal)?;
    }
    Ok(Planned {
        shapes,
        choices,
        plan,
    })
}

/// "all_reduce #12 on rank 3 of 4": what the errors of launch `seq` of `args` are about.
pub(crate) fn launch_label(args: &[OpArgs], seq: u64, info: &CommInfo) -> String {
    let what = if args.len() == 1 {
        args[0].kind.name().to_string()
    } else {
        format!("group of {} operations", args.len())
    };
    format!("{what} #{seq} on rank {} of {}", info.rank, info.nranks)
}

fn in_place_rule(k: CollKind) -> &'static str {
    match k {
        CollKind::AllGather | CollKind::Gather => "send == recv + rank * count elements",
        CollKind::ReduceScatter | CollKind::Scatter => "recv == send + rank * count elements",
        _ => "send == recv",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(kind: CollKind, send: usize, recv: usize, count: usize, dtype: DataType) -> OpArgs {
        OpArgs {
            kind,
            send: send as *const u8,
            recv: recv as *mut u8,
            count,
            dtype,
            op: ReduceOp::Sum,
            root: 0,
            device_scalar: None,
        }
    }

    #[test]
    fn null_misaligned_overflowing_and_overlapping_buffers_are_rejected() {
        let f = DataType::Float32;
        assert!(args(CollKind::AllReduce, 0x1000, 0x2000, 4, f)
            .validate(0, 2)
            .is_ok());
        let e = args(CollKind::AllReduce, 0, 0x2000, 4, f)
            .validate(0, 2)
            .unwrap_err();
        assert!(e.to_string().contains("send buffer is null"), "{e}");
        // A null buffer of zero bytes is fine (NCCL allows count 0 with null pointers).
        assert!(args(CollKind::AllReduce, 0, 0, 0, f).validate(0, 2).is_ok());
        let e = args(CollKind::AllReduce, 0x1001, 0x2000, 4, f)
            .validate(0, 2)
            .unwrap_err();
        assert!(e.to_string().contains("not aligned"), "{e}");
        let e = args(CollKind::AllReduce, 0x1000, 0x2000, usize::MAX / 2, f)
            .validate(0, 2)
            .unwrap_err();
        assert!(e.to_string().contains("isize::MAX"), "{e}");
        let e = args(CollKind::AllGather, 0x1000, 0x2000, usize::MAX / 2, f)
            .validate(0, 4)
            .unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        let e = args(CollKind::AllReduce, 0x1000, 0x1004, 4, f)
            .validate(0, 2)
            .unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        // In place by NCCL's conventions.
        assert!(args(CollKind::AllReduce, 0x1000, 0x1000, 4, f)
            .validate(0, 2)
            .is_ok());
        assert!(args(CollKind::AllGather, 0x1000 + 16, 0x1000, 4, f)
            .validate(1, 2)
            .is_ok());
        assert!(args(CollKind::ReduceScatter, 0x1000, 0x1000 + 16, 4, f)
            .validate(1, 2)
            .is_ok());
        assert!(args(CollKind::AllGather, 0x1000, 0x1000, 4, f)
            .validate(1, 2)
            .is_err());
    }

    #[test]
    fn bad_roots_peers_and_ops_are_rejected() {
        let mut a = args(CollKind::Broadcast, 0x1000, 0x2000, 4, DataType::Int32);
        a.root = 2;
        assert!(a.validate(0, 2).unwrap_err().to_string().contains("root 2"));
        a.kind = CollKind::Send;
        assert!(a.validate(0, 2).unwrap_err().to_string().contains("peer 2"));
        let mut a = args(CollKind::AllReduce, 0x1000, 0x2000, 4, DataType::Int32);
        a.op = ReduceOp::PreMulSum(0.5);
        assert!(a
            .validate(0, 2)
            .unwrap_err()
            .to_string()
            .contains("not an integer"));
    }

    #[test]
    fn a_device_scalar_needs_a_premulsum_and_an_aligned_address() {
        let base = args(CollKind::AllReduce, 0x1000, 0x2000, 4, DataType::Float32);
        let with = |op, p| OpArgs {
            op,
            device_scalar: Some(p),
            ..base
        };
        assert!(with(ReduceOp::PreMulSum(0.0), 0x3000)
            .validate(0, 2)
            .is_ok());
        let e = with(ReduceOp::Sum, 0x3000).validate(0, 2).unwrap_err();
        assert!(
            e.to_string().contains("only meaningful for a pre-mul-sum"),
            "{e}"
        );
        let e = with(ReduceOp::PreMulSum(1.0), 0)
            .validate(0, 2)
            .unwrap_err();
        assert!(e.to_string().contains("null or not aligned"), "{e}");
        let e = with(ReduceOp::PreMulSum(1.0), 0x3002)
            .validate(0, 2)
            .unwrap_err();
        assert!(e.to_string().contains("4-byte type float"), "{e}");
        let e = OpArgs {
            kind: CollKind::AllGather,
            ..with(ReduceOp::PreMulSum(1.0), 0x3000)
        }
        .validate(0, 2)
        .unwrap_err();
        assert!(e.to_string().contains("only meaningful"), "{e}");
    }
}
