//! The vocabulary every layer shares: data types, reduce operations, collective kinds, errors.

use std::fmt;

/// A rank inside one communicator (0-based).
pub type Rank = usize;

/// The 12 element types of NCCL, with NCCL's own numbering so that the C ABI maps 1:1.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[repr(i32)]
pub enum DataType {
    /// Signed 8-bit integer (`ncclInt8`, `ncclChar`).
    Int8 = 0,
    /// Unsigned 8-bit integer (`ncclUint8`).
    Uint8 = 1,
    /// Signed 32-bit integer (`ncclInt32`).
    Int32 = 2,
    /// Unsigned 32-bit integer (`ncclUint32`).
    Uint32 = 3,
    /// Signed 64-bit integer (`ncclInt64`).
    Int64 = 4,
    /// Unsigned 64-bit integer (`ncclUint64`).
    Uint64 = 5,
    /// IEEE half precision (`ncclFloat16`).
    Float16 = 6,
    /// IEEE single precision (`ncclFloat32`).
    Float32 = 7,
    /// IEEE double precision (`ncclFloat64`).
    Float64 = 8,
    /// bfloat16 (`ncclBfloat16`).
    Bfloat16 = 9,
    /// OCP FP8 E4M3 (`ncclFloat8e4m3`).
    Float8E4M3 = 10,
    /// OCP FP8 E5M2 (`ncclFloat8e5m2`).
    Float8E5M2 = 11,
}

impl DataType {
    /// All twelve, in NCCL's order.
    pub const ALL: [DataType; 12] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float8E4M3,
        DataType::Float8E5M2,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8E4M3 | DataType::Float8E5M2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// Whether it is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::Float16
                | DataType::Float32
                | DataType::Float64
                | DataType::Bfloat16
                | DataType::Float8E4M3
                | DataType::Float8E5M2
        )
    }

    /// Whether it holds negative values (floats and signed integers).
    pub const fn is_signed(self) -> bool {
        !matches!(self, DataType::Uint8 | DataType::Uint32 | DataType::Uint64)
    }

    /// The NCCL enum value (`ncclDataType_t`).
    pub const fn nccl_id(self) -> i32 {
        self as i32
    }

    /// The type of an `ncclDataType_t` value (0 to 11).
    pub fn from_nccl_id(id: i32) -> Result<Self, Error> {
        DataType::ALL
            .iter()
            .copied()
            .find(|d| d.nccl_id() == id)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("unknown data type {id} (valid: 0..=11)"))
            })
    }

    /// Short name as nccl-tests prints it.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "int8",
            DataType::Uint8 => "uint8",
            DataType::Int32 => "int32",
            DataType::Uint32 => "uint32",
            DataType::Int64 => "int64",
            DataType::Uint64 => "uint64",
            DataType::Float16 => "half",
            DataType::Float32 => "float",
            DataType::Float64 => "double",
            DataType::Bfloat16 => "bfloat16",
            DataType::Float8E4M3 => "f8e4m3",
            DataType::Float8E5M2 => "f8e5m2",
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DataType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let l = s.to_ascii_lowercase();
        let d = match l.as_str() {
            "int8" | "i8" | "char" => DataType::Int8,
            "uint8" | "u8" => DataType::Uint8,
            "int32" | "i32" | "int" => DataType::Int32,
            "uint32" | "u32" => DataType::Uint32,
            "int64" | "i64" => DataType::Int64,
            "uint64" | "u64" => DataType::Uint64,
            "float16" | "half" | "f16" | "fp16" => DataType::Float16,
            "float32" | "float" | "f32" | "fp32" => DataType::Float32,
            "float64" | "double" | "f64" | "fp64" => DataType::Float64,
            "bfloat16" | "bf16" => DataType::Bfloat16,
            "f8e4m3" | "fp8e4m3" | "float8e4m3" | "e4m3" => DataType::Float8E4M3,
            "f8e5m2" | "fp8e5m2" | "float8e5m2" | "e5m2" => DataType::Float8E5M2,
            _ => return Err(Error::InvalidArgument(format!("unknown data type '{s}'"))),
        };
        Ok(d)
    }
}

/// A reduction. `PreMulSum` multiplies every rank's input by the scalar before summing
/// (NCCL's `ncclRedOpCreatePreMulSum`); the scalar is converted to the element type.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The product.
    Prod,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
    /// The sum divided by the number of ranks.
    Avg,
    /// The sum of every input multiplied by the scalar.
    PreMulSum(f64),
}

impl ReduceOp {
    /// The five fixed ops plus a pre-multiplied sum with a representative scalar.
    pub const BUILTIN: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// NCCL's `ncclRedOp_t` for the built-in ops; pre-multiplied sums are dynamic in NCCL (>= 5).
    pub const fn nccl_id(self) -> i32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Avg => 4,
            ReduceOp::PreMulSum(_) => 5,
        }
    }

    /// The reduction of a built-in `ncclRedOp_t` value (0 to 4).
    pub fn from_nccl_id(id: i32) -> Result<Self, Error> {
        match id {
            0 => Ok(ReduceOp::Sum),
            1 => Ok(ReduceOp::Prod),
            2 => Ok(ReduceOp::Max),
            3 => Ok(ReduceOp::Min),
            4 => Ok(ReduceOp::Avg),
            _ => Err(Error::InvalidArgument(format!(
                "unknown reduce op {id} (valid: 0..=4, or a created pre-mul-sum)"
            ))),
        }
    }

    /// Its name as the bench prints it ("sum", "prod", ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
            ReduceOp::PreMulSum(_) => "premulsum",
        }
    }

    /// Checks that the op is meaningful for `dtype` (a pre-mul-sum scalar must be finite,
    /// and integral and in range for integer types).
    pub fn validate(self, dtype: DataType) -> Result<(), Error> {
        if let ReduceOp::PreMulSum(s) = self {
            if !s.is_finite() {
                return Err(Error::InvalidArgument(format!(
                    "pre-mul-sum scalar {s} is not finite"
                )));
            }
            if !dtype.is_float() {
                if s.fract() != 0.0 {
                    return Err(Error::InvalidArgument(format!(
                        "pre-mul-sum scalar {s} is not an integer, but the data type is {dtype}"
                    )));
                }
                if !dtype.is_signed() && s < 0.0 {
                    return Err(Error::InvalidArgument(format!(
                        "pre-mul-sum scalar {s} is negative, but the data type {dtype} is unsigned"
                    )));
                }
            }
        }
        Ok(())
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "prod" => Ok(ReduceOp::Prod),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            "avg" => Ok(ReduceOp::Avg),
            "premulsum" | "pre-mul-sum" | "premul" => Ok(ReduceOp::PreMulSum(2.0)),
            _ => Err(Error::InvalidArgument(format!("unknown reduce op '{s}'"))),
        }
    }
}

/// The kind of a collective or point-to-point operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum CollKind {
    /// Every rank gets the reduction of all inputs.
    AllReduce,
    /// Every rank gets every rank's input, in rank order.
    AllGather,
    /// The reduction of all inputs, cut into one block per rank.
    ReduceScatter,
    /// The root's buffer to every rank.
    Broadcast,
    /// The reduction of all inputs, at the root.
    Reduce,
    /// Block `p` of every rank's input to rank `p`.
    AllToAll,
    /// Every rank's input to the root, in rank order.
    Gather,
    /// Block `r` of the root's input to rank `r`.
    Scatter,
    /// A send to one peer.
    Send,
    /// A receive from one peer.
    Recv,
}

impl CollKind {
    /// Every kind, collectives first. The order is part of the check mode's wire format
    /// (`opsig`): append, never reorder.
    pub const ALL: [CollKind; 10] = [
        CollKind::AllReduce,
        CollKind::AllGather,
        CollKind::ReduceScatter,
        CollKind::Broadcast,
        CollKind::Reduce,
        CollKind::AllToAll,
        CollKind::Gather,
        CollKind::Scatter,
        CollKind::Send,
        CollKind::Recv,
    ];

    /// The collectives: `ALL` without send and receive.
    pub const COLLECTIVES: [CollKind; 8] = {
        let mut v = [CollKind::AllReduce; 8];
        let mut i = 0;
        while i < v.len() {
            v[i] = Self::ALL[i];
            i += 1;
        }
        v
    };

    /// Its name in messages ("all_reduce", ...).
    pub const fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "all_reduce",
            CollKind::AllGather => "all_gather",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
            CollKind::AllToAll => "alltoall",
            CollKind::Gather => "gather",
            CollKind::Scatter => "scatter",
            CollKind::Send => "send",
            CollKind::Recv => "recv",
        }
    }

    /// Every rank of the communicator takes part (everything but send and receive).
    pub const fn is_collective(self) -> bool {
        !matches!(self, CollKind::Send | CollKind::Recv)
    }

    /// Whether it applies a reduction.
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce
        )
    }

    /// Whether it has a root (broadcast, reduce, gather, scatter).
    pub const fn has_root(self) -> bool {
        matches!(
            self,
            CollKind::Broadcast | CollKind::Reduce | CollKind::Gather | CollKind::Scatter
        )
    }

    /// Element counts of the send and receive buffers for a per-rank `count`, with NCCL's
    /// conventions: all-gather's `count` is per rank (recv = count * n), reduce-scatter's is the
    /// per-rank output (send = count * n), all-to-all / gather / scatter move `count` per peer.
    /// `is_root` matters for gather and scatter, where only the root has the large buffer.
    pub fn buffer_counts(
        self,
        count: usize,
        nranks: usize,
        is_root: bool,
    ) -> Option<(usize, usize)> {
        let big = || count.checked_mul(nranks);
        Some(match self {
            CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => (count, count),
            CollKind::AllGather => (count, big()?),
            CollKind::ReduceScatter => (big()?, count),
            CollKind::AllToAll => (big()?, big()?),
            CollKind::Gather => (count, if is_root { big()? } else { 0 }),
            CollKind::Scatter => (if is_root { big()? } else { 0 }, count),
            CollKind::Send => (count, 0),
            CollKind::Recv => (0, count),
        })
    }

    /// Elements of the input that every rank passes, where every rank passes one of the same
    /// extent (the reductions, all-gather, all-to-all, gather: `buffer_counts`' send size on
    /// any rank); None where only the root's input counts (broadcast, scatter) or one side's
    /// (send, receive), or the size overflows. What a rank may read of its peers' inputs.
    pub fn uniform_input(self, count: usize, nranks: usize) -> Option<usize> {
        match self {
            CollKind::AllReduce | CollKind::Reduce | CollKind::AllGather | CollKind::Gather => {
                Some(count)
            }
            CollKind::ReduceScatter | CollKind::AllToAll => count.checked_mul(nranks),
            CollKind::Broadcast | CollKind::Scatter | CollKind::Send | CollKind::Recv => None,
        }
    }
}

impl fmt::Display for CollKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CollKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let l = s.to_ascii_lowercase().replace('-', "_");
        Ok(match l.as_str() {
            "all_reduce" | "allreduce" => CollKind::AllReduce,
            "all_gather" | "allgather" => CollKind::AllGather,
            "reduce_scatter" | "reducescatter" => CollKind::ReduceScatter,
            "broadcast" | "bcast" => CollKind::Broadcast,
            "reduce" => CollKind::Reduce,
            "alltoall" | "all_to_all" => CollKind::AllToAll,
            "gather" => CollKind::Gather,
            "scatter" => CollKind::Scatter,
            "send" => CollKind::Send,
            "recv" => CollKind::Recv,
            _ => return Err(Error::InvalidArgument(format!("unknown operation '{s}'"))),
        })
    }
}

/// Errors of the whole library. Messages say what failed and where; callers add context
/// (op, sequence number, rank, peer) through the variants' fields.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum Error {
    /// A bad argument: nothing was changed and the communicator stays usable.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A wait ran past its deadline.
    #[error("timed out: {0}")]
    Timeout(String),
    /// A peer is gone (process died, connection closed) or reported its own failure.
    #[error("remote error: {0}")]
    Remote(String),
    /// The communicator was aborted (by `abort()` or by an earlier failure).
    #[error("aborted: {0}")]
    Aborted(String),
    /// Authentication or protocol violation on the bootstrap or a transport.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// An operating-system or resource failure (sockets, shared memory, threads).
    #[error("system error: {0}")]
    System(String),
    /// Something that should not happen: a bug in ferroccl.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// The NCCL `ncclResult_t` this error maps to in the C ABI.
    pub const fn nccl_result(&self) -> i32 {
        match self {
            Error::InvalidArgument(_) => 4,
            Error::Timeout(_) | Error::Remote(_) | Error::Aborted(_) => 6,
            Error::Protocol(_) => 6,
            Error::System(_) => 2,
            Error::Internal(_) => 3,
        }
    }

    /// Prefixes the message with context such as "all_reduce #12 on rank 3".
    pub fn context(self, ctx: impl fmt::Display) -> Error {
        match self {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{ctx}: {m}")),
            Error::Timeout(m) => Error::Timeout(format!("{ctx}: {m}")),
            Error::Remote(m) => Error::Remote(format!("{ctx}: {m}")),
            Error::Aborted(m) => Error::Aborted(format!("{ctx}: {m}")),
            Error::Protocol(m) => Error::Protocol(format!("{ctx}: {m}")),
            Error::System(m) => Error::System(format!("{ctx}: {m}")),
            Error::Internal(m) => Error::Internal(format!("{ctx}: {m}")),
        }
    }

    /// The message without the variant's prefix.
    pub fn message(&self) -> &str {
        match self {
            Error::InvalidArgument(m)
            | Error::Timeout(m)
            | Error::Remote(m)
            | Error::Aborted(m)
            | Error::Protocol(m)
            | Error::System(m)
            | Error::Internal(m) => m,
        }
    }
}

/// Results of the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `msg` shortened to at most `max` bytes, for the fixed-size fields a failure travels in
/// (a FIFO's poison reason, a heartbeat or TCP poison frame). Ranks chain each other's errors,
/// so the cut is often in the middle of a sentence: it falls at the end of a clause ("; ",
/// ": ", ", ") when one is near the end, else between words, and " …" marks it, so that a
/// reader never takes a cut word or an empty list for the message itself. Only a single
/// word longer than half the room is cut inside (at a character boundary).
pub fn clip_message(msg: &str, max: usize) -> std::borrow::Cow<'_, str> {
    const MARK: &str = " …";
    if msg.len() <= max {
        return msg.into();
    }
    let mut room = max.saturating_sub(MARK.len());
    while !msg.is_char_boundary(room) {
        room -= 1;
    }
    // Cutting before a space at `i` keeps msg[..i]: whole words only.
    let head = &msg[..room];
    let next_is_space = msg.as_bytes()[room] == b' ';
    let word = if next_is_space {
        Some(room)
    } else {
        head.rfind(' ')
    };
    let clause = head
        .rfind("; ")
        .into_iter()
        .chain(head.rfind(": "))
        .chain(head.rfind(", "))
        .max();
    let cut = match (clause, word) {
        (Some(c), _) if c >= room * 2 / 3 => c,
        (_, Some(w)) if w >= room / 2 => w,
        _ => room,
    };
    let kept = msg[..cut].trim_end_matches([' ', ',', ';', ':', '(', '[']);
    let mark = if cut == room && !next_is_space {
        "…"
    } else {
        MARK
    };
    format!("{kept}{mark}").into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clipped_message_ends_between_words_with_a_mark() {
        let m = "all_reduce #5 on rank 0 of 4: waited past the deadline (FERROCCL_TIMEOUT) for data from rank 1 \
                 (node-a, pid 4242, 10.0.0.2:41234) on channel 0 over shm; not heard from rank(s) [1]: they are stuck, \
                 slow, or called a different operation (raise FERROCCL_TIMEOUT if they are only slow)";
        assert_eq!(clip_message(m, m.len()), m, "what fits is left alone");
        for max in 20..m.len() {
            let c = clip_message(m, max);
            assert!(c.len() <= max, "{max}: {c}");
            let kept = c
                .strip_suffix(" …")
                .unwrap_or_else(|| panic!("{max}: no mark: {c}"));
            assert!(m.starts_with(kept), "{max}: {c}");
            // What follows the kept part in the message is a separator: no word was cut.
            let rest = &m[kept.len()..];
            assert!(
                rest.starts_with([' ', ',', ';', ':']),
                "{max}: cut mid-word: {c}"
            );
            // Nor is a list opened and left empty, or a clause left dangling on its separator.
            assert!(!kept.ends_with(['[', '(', ':', ';', ',']), "{max}: {c}");
        }
        assert_eq!(clip_message(m, 240), "all_reduce #5 on rank 0 of 4: waited past the deadline (FERROCCL_TIMEOUT) for data from rank 1 \
                 (node-a, pid 4242, 10.0.0.2:41234) on channel 0 over shm; not heard from rank(s) [1]: they are stuck, slow …");
        // One word longer than the room: cut inside it, at a character boundary, still marked.
        let long = format!("gave up {}", "é".repeat(100));
        let c = clip_message(&long, 51);
        assert!(
            c.len() <= 51 && c.starts_with("gave up éé") && c.ends_with("é…"),
            "{c}"
        );
    }

    #[test]
    fn nccl_numbering_round_trips() {
        for (i, d) in DataType::ALL.iter().enumerate() {
            assert_eq!(d.nccl_id(), i as i32);
            assert_eq!(DataType::from_nccl_id(i as i32).unwrap(), *d);
            assert_eq!(d.name().parse::<DataType>().unwrap(), *d);
        }
        assert!(DataType::from_nccl_id(12).is_err());
        assert!(DataType::from_nccl_id(-1).is_err());
        for op in ReduceOp::BUILTIN {
            assert_eq!(ReduceOp::from_nccl_id(op.nccl_id()).unwrap(), op);
        }
        assert!(ReduceOp::from_nccl_id(5).is_err());
    }

    #[test]
    fn premulsum_scalar_is_checked_against_dtype() {
        assert!(ReduceOp::PreMulSum(2.5).validate(DataType::Float32).is_ok());
        assert!(ReduceOp::PreMulSum(2.5).validate(DataType::Int32).is_err());
        assert!(ReduceOp::PreMulSum(-1.0).validate(DataType::Uint8).is_err());
        assert!(ReduceOp::PreMulSum(f64::NAN)
            .validate(DataType::Float64)
            .is_err());
    }

    #[test]
    fn uniform_inputs_are_every_ranks_send_buffer() {
        for k in CollKind::ALL {
            for n in 1..=5 {
                match k.uniform_input(7, n) {
                    Some(e) => {
                        // Every rank's send buffer, root or not, is that extent.
                        for root in [true, false] {
                            assert_eq!(k.buffer_counts(7, n, root).unwrap().0, e, "{k} {n}");
                        }
                        assert!(e > 0);
                    }
                    None => assert!(
                        matches!(
                            k,
                            CollKind::Broadcast
                                | CollKind::Scatter
                                | CollKind::Send
                                | CollKind::Recv
                        ),
                        "{k}"
                    ),
                }
            }
        }
        assert_eq!(CollKind::AllToAll.uniform_input(usize::MAX, 2), None);
    }

    #[test]
    fn buffer_counts_follow_nccl_conventions() {
        assert_eq!(
            CollKind::AllGather.buffer_counts(3, 4, false),
            Some((3, 12))
        );
        assert_eq!(
            CollKind::ReduceScatter.buffer_counts(3, 4, false),
            Some((12, 3))
        );
        assert_eq!(CollKind::Gather.buffer_counts(3, 4, false), Some((3, 0)));
        assert_eq!(CollKind::Gather.buffer_counts(3, 4, true), Some((3, 12)));
        assert_eq!(CollKind::AllToAll.buffer_counts(usize::MAX, 2, false), None);
    }
}
