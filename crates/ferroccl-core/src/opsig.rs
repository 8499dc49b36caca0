//! What every rank must agree on before a launch moves any data, in a fixed-size wire form,
//! and the comparison that names who disagrees about what.
//!
//! Check mode (`Config::check_mismatch`) all-gathers each rank's launch signature and runs
//! `compare` on every rank over the same bytes, so every rank reaches the same verdict and
//! either all run the launch or all fail it with the same message.
//!
//! launch signature: "FCSG" | seq u64 | n u32 | n x op (24 bytes each)
//! op: kind u8 | dtype u8 | redop u8 | 0 u8 | root u32 | count u64 | pre-mul-sum scalar (f64 bits)

use crate::types::{CollKind, DataType, ReduceOp};
use std::collections::BTreeMap;
use std::fmt::Display;

const MAGIC: [u8; 4] = *b"FCSG";
const HEAD: usize = 4 + 8 + 4;
/// Bytes of one encoded operation.
pub const OP_BYTES: usize = 24;
/// Differences named in one message: enough to see the pattern, short enough to read.
const MAX_REPORTED: usize = 8;

/// One operation as the other ranks must see it. Fields that do not affect an operation
/// (the reduction of a broadcast, the root of an all-reduce) are normalised away, so that
/// ranks passing different junk there still agree.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpSig {
    /// The operation.
    pub kind: CollKind,
    /// The element type.
    pub dtype: DataType,
    /// NCCL's count.
    pub count: u64,
    /// The reduction (Sum where the operation does not reduce).
    pub op: ReduceOp,
    /// Root of a rooted collective, peer of a send or receive, else 0.
    pub root: u32,
}

impl OpSig {
    /// The signature of one operation, with what does not affect it normalised away.
    pub fn new(kind: CollKind, dtype: DataType, count: usize, op: ReduceOp, root: usize) -> OpSig {
        let p2p = matches!(kind, CollKind::Send | CollKind::Recv);
        OpSig {
            kind,
            dtype,
            count: count as u64,
            op: if kind.reduces() { op } else { ReduceOp::Sum },
            root: if kind.has_root() || p2p {
                root as u32
            } else {
                0
            },
        }
    }

    fn is_p2p(&self) -> bool {
        matches!(self.kind, CollKind::Send | CollKind::Recv)
    }

    fn encode(&self, out: &mut Vec<u8>) {
        let kind = CollKind::ALL
            .iter()
            .position(|&k| k == self.kind)
            .expect("every kind is listed") as u8;
        let scalar = match self.op {
            ReduceOp::PreMulSum(s) => s.to_bits(),
            _ => 0,
        };
        out.extend_from_slice(&[kind, self.dtype.nccl_id() as u8, self.op.nccl_id() as u8, 0]);
        out.extend_from_slice(&self.root.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&scalar.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Option<OpSig> {
        let kind = *CollKind::ALL.get(b[0] as usize)?;
        let dtype = DataType::from_nccl_id(b[1] as i32).ok()?;
        let scalar = f64::from_bits(u64::from_le_bytes(b[16..24].try_into().ok()?));
        let op = match b[2] {
            5 => ReduceOp::PreMulSum(scalar),
            id => ReduceOp::from_nccl_id(id as i32).ok()?,
        };
        let root = u32::from_le_bytes(b[4..8].try_into().ok()?);
        let count = u64::from_le_bytes(b[8..16].try_into().ok()?);
        Some(OpSig {
            kind,
            dtype,
            count,
            op,
            root,
        })
    }

    /// "premulsum(0.5)" rather than "premulsum": the scalar is part of what must match.
    fn op_name(&self) -> String {
        match self.op {
            ReduceOp::PreMulSum(s) => format!("premulsum({s})"),
            o => o.name().to_string(),
        }
    }
}

/// The bytes one rank contributes for a launch that is its `seq`-th.
pub fn encode_launch(seq: u64, ops: &[OpSig]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + ops.len() * OP_BYTES);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(ops.len() as u32).to_le_bytes());
    for o in ops {
        o.encode(&mut out);
    }
    out
}

/// A launch signature back from bytes; `None` when they are not one (a peer of another
/// version, or a rank whose bootstrap all-gather was out of step with ours).
pub fn decode_launch(b: &[u8]) -> Option<(u64, Vec<OpSig>)> {
    if b.len() < HEAD || b[..4] != MAGIC {
        return None;
    }
    let seq = u64::from_le_bytes(b[4..12].try_into().ok()?);
    let n = u32::from_le_bytes(b[12..16].try_into().ok()?) as usize;
    // Checked against the bytes actually present, so a lying count allocates nothing.
    if (b.len() - HEAD) / OP_BYTES != n || !(b.len() - HEAD).is_multiple_of(OP_BYTES) {
        return None;
    }
    let ops = b[HEAD..]
        .chunks_exact(OP_BYTES)
        .map(OpSig::decode)
        .collect::<Option<Vec<_>>>()?;
    Some((seq, ops))
}

/// "ranks 0, 2-5" for messages.
fn ranks_list(rs: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < rs.len() {
        let mut j = i;
        while j + 1 < rs.len() && rs[j + 1] == rs[j] + 1 {
            j += 1;
        }
        parts.push(if j > i + 1 {
            format!("{}-{}", rs[i], rs[j])
        } else if j == i + 1 {
            format!("{}, {}", rs[i], rs[j])
        } else {
            rs[i].to_string()
        });
        i = j + 1;
    }
    let noun = if rs.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", parts.join(", "))
}

/// "count differs: ranks 0, 2: 1024; rank 1: 1000", or None when every rank agrees.
fn field_diff<V: PartialEq + Display>(field: &str, vals: &[(usize, V)]) -> Option<String> {
    let mut groups: Vec<(&V, Vec<usize>)> = Vec::new();
    for (r, v) in vals {
        match groups.iter_mut().find(|(g, _)| *g == v) {
            Some((_, rs)) => rs.push(*r),
            None => groups.push((v, vec![*r])),
        }
    }
    if groups.len() < 2 {
        return None;
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(v, rs)| format!("{}: {v}", ranks_list(rs)))
        .collect();
    Some(format!("{field} differs ({})", parts.join("; ")))
}

/// Compares every rank's signature (indexed by rank). `Err` holds one message naming the
/// ranks and fields that differ; every rank computes the same one from the same bytes.
pub fn compare(all: &[Vec<u8>]) -> Result<(), String> {
    let mut launches = Vec::with_capacity(all.len());
    for (r, b) in all.iter().enumerate() {
        match decode_launch(b) {
            Some(l) => launches.push(l),
            None => {
                return Err(format!(
                    "rank {r} sent {} bytes that are not an operation signature (does every rank set FERROCCL_CHECK_MISMATCH \
                     the same way, and run the same ferroccl version?)",
                    b.len()
                ))
            }
        }
    }
    let mut diffs: Vec<String> = Vec::new();
    let seqs: Vec<(usize, u64)> = launches.iter().enumerate().map(|(r, l)| (r, l.0)).collect();
    if let Some(d) = field_diff("launch sequence number", &seqs) {
        diffs.push(format!("{d}: a rank skipped or added a launch"));
    }
    compare_collectives(&launches, &mut diffs);
    compare_p2p(&launches, &mut diffs);
    if diffs.is_empty() {
        return Ok(());
    }
    let more = diffs.len().saturating_sub(MAX_REPORTED);
    diffs.truncate(MAX_REPORTED);
    let tail = if more > 0 {
        format!("; and {more} more")
    } else {
        String::new()
    };
    Err(format!("{}{tail}", diffs.join("; ")))
}

fn compare_collectives(launches: &[(u64, Vec<OpSig>)], diffs: &mut Vec<String>) {
    let colls: Vec<Vec<&OpSig>> = launches
        .iter()
        .map(|(_, ops)| ops.iter().filter(|o| !o.is_p2p()).collect())
        .collect();
    let lens: Vec<(usize, usize)> = colls
        .iter()
        .enumerate()
        .map(|(r, c)| (r, c.len()))
        .collect();
    if let Some(d) = field_diff("number of collectives in the launch", &lens) {
        let lists: Vec<String> = colls
            .iter()
            .enumerate()
            .map(|(r, c)| {
                format!(
                    "rank {r}: [{}]",
                    c.iter()
                        .map(|o| o.kind.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
            .collect();
        diffs.push(format!("{d} ({})", lists.join("; ")));
        return;
    }
    let n = lens.first().map(|l| l.1).unwrap_or(0);
    for i in 0..n {
        let at = |f: &dyn Fn(&OpSig) -> String| -> Vec<(usize, String)> {
            colls
                .iter()
                .enumerate()
                .map(|(r, c)| (r, f(c[i])))
                .collect()
        };
        let which = if n == 1 {
            String::new()
        } else {
            format!("collective {} of {n}: ", i + 1)
        };
        let fields: [(&str, Vec<(usize, String)>); 5] = [
            ("operation", at(&|o| o.kind.name().to_string())),
            ("data type", at(&|o| o.dtype.name().to_string())),
            ("count", at(&|o| o.count.to_string())),
            ("reduction", at(&|o| o.op_name())),
            ("root", at(&|o| o.root.to_string())),
        ];
        for (name, vals) in &fields {
            if let Some(d) = field_diff(name, vals) {
                diffs.push(format!("{which}{d}"));
            }
        }
    }
}

/// A send from r to p must meet a receive on p from r of the same count and type, in order.
fn compare_p2p(launches: &[(u64, Vec<OpSig>)], diffs: &mut Vec<String>) {
    let n = launches.len();
    // (from, to) -> messages in issue order, as the sender and as the receiver see them.
    let mut sends: BTreeMap<(usize, usize), Vec<&OpSig>> = BTreeMap::new();
    let mut recvs: BTreeMap<(usize, usize), Vec<&OpSig>> = BTreeMap::new();
    for (r, (_, ops)) in launches.iter().enumerate() {
        for o in ops {
            let peer = o.root as usize;
            match o.kind {
                CollKind::Send => sends.entry((r, peer)).or_default().push(o),
                CollKind::Recv => recvs.entry((peer, r)).or_default().push(o),
                _ => {}
            }
        }
    }
    let pairs: std::collections::BTreeSet<(usize, usize)> =
        sends.keys().chain(recvs.keys()).copied().collect();
    for (from, to) in pairs {
        if from >= n || to >= n {
            diffs.push(format!(
                "a send or receive names rank {} of a communicator of {n}",
                from.max(to)
            ));
            continue;
        }
        let s = sends.get(&(from, to)).map(|v| v.as_slice()).unwrap_or(&[]);
        let r = recvs.get(&(from, to)).map(|v| v.as_slice()).unwrap_or(&[]);
        if s.len() != r.len() {
            diffs.push(format!(
                "rank {from} sends {} message(s) to rank {to}, which receives {} from it",
                s.len(),
                r.len()
            ));
            continue;
        }
        for (i, (a, b)) in s.iter().zip(r).enumerate() {
            if a.count != b.count || a.dtype != b.dtype {
                diffs.push(format!(
                    "message {} from rank {from} to rank {to}: sent as {} x {}, received as {} x {}",
                    i + 1,
                    a.count,
                    a.dtype,
                    b.count,
                    b.dtype
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ar(count: usize) -> OpSig {
        OpSig::new(
            CollKind::AllReduce,
            DataType::Float32,
            count,
            ReduceOp::Sum,
            0,
        )
    }

    fn check(per_rank: &[(u64, Vec<OpSig>)]) -> Result<(), String> {
        let all: Vec<Vec<u8>> = per_rank.iter().map(|(s, o)| encode_launch(*s, o)).collect();
        compare(&all)
    }

    #[test]
    fn agreeing_ranks_pass_and_irrelevant_fields_are_ignored() {
        let bc = |op, root| OpSig::new(CollKind::Broadcast, DataType::Int8, 7, op, root);
        let ag = |root| OpSig::new(CollKind::AllGather, DataType::Int8, 7, ReduceOp::Sum, root);
        check(&[
            (3, vec![ar(5), bc(ReduceOp::Max, 1), ag(0)]),
            (3, vec![ar(5), bc(ReduceOp::Min, 1), ag(1)]),
        ])
        .unwrap();
        check(&[(0, vec![])]).unwrap();
    }

    #[test]
    fn each_field_is_named_with_the_ranks_that_hold_each_value() {
        let e = check(&[
            (1, vec![ar(1024)]),
            (1, vec![ar(1000)]),
            (1, vec![ar(1024)]),
        ])
        .unwrap_err();
        assert_eq!(e, "count differs (ranks 0, 2: 1024; rank 1: 1000)");
        let f64_ = OpSig::new(CollKind::AllReduce, DataType::Float64, 4, ReduceOp::Sum, 0);
        let e = check(&[(1, vec![ar(4)]), (1, vec![f64_])]).unwrap_err();
        assert!(
            e.contains("data type differs (rank 0: float; rank 1: double)"),
            "{e}"
        );
        let pm = |s| {
            OpSig::new(
                CollKind::AllReduce,
                DataType::Float32,
                4,
                ReduceOp::PreMulSum(s),
                0,
            )
        };
        let e = check(&[(1, vec![pm(0.5)]), (1, vec![pm(0.25)])]).unwrap_err();
        assert!(
            e.contains("reduction differs (rank 0: premulsum(0.5); rank 1: premulsum(0.25))"),
            "{e}"
        );
        let red = |root| OpSig::new(CollKind::Reduce, DataType::Float32, 4, ReduceOp::Sum, root);
        let e = check(&[
            (1, vec![red(0)]),
            (1, vec![red(1)]),
            (1, vec![red(1)]),
            (1, vec![red(1)]),
        ])
        .unwrap_err();
        assert!(e.contains("root differs (rank 0: 0; ranks 1-3: 1)"), "{e}");
        let bc = OpSig::new(CollKind::Broadcast, DataType::Float32, 4, ReduceOp::Sum, 0);
        let e = check(&[(1, vec![ar(4)]), (1, vec![bc])]).unwrap_err();
        assert_eq!(
            e,
            "operation differs (rank 0: all_reduce; rank 1: broadcast)"
        );
        let e = check(&[(4, vec![ar(4)]), (5, vec![ar(4)])]).unwrap_err();
        assert!(
            e.contains("launch sequence number differs (rank 0: 4; rank 1: 5)"),
            "{e}"
        );
    }

    #[test]
    fn groups_compare_the_whole_list_and_match_sends_with_receives() {
        let send = |to, c| OpSig::new(CollKind::Send, DataType::Int32, c, ReduceOp::Sum, to);
        let recv = |from, c| OpSig::new(CollKind::Recv, DataType::Int32, c, ReduceOp::Sum, from);
        // A ring exchange, collectives interleaved differently with the point-to-point calls.
        check(&[
            (1, vec![send(1, 3), ar(2), recv(1, 4)]),
            (1, vec![ar(2), recv(0, 3), send(0, 4)]),
        ])
        .unwrap();
        let e = check(&[(1, vec![send(1, 3)]), (1, vec![recv(0, 5)])]).unwrap_err();
        assert!(
            e.contains("message 1 from rank 0 to rank 1: sent as 3 x int32, received as 5 x int32"),
            "{e}"
        );
        let e = check(&[(1, vec![send(1, 3), send(1, 3)]), (1, vec![recv(0, 3)])]).unwrap_err();
        assert!(
            e.contains("rank 0 sends 2 message(s) to rank 1, which receives 1 from it"),
            "{e}"
        );
        let e = check(&[(1, vec![ar(1), ar(1)]), (1, vec![ar(1)])]).unwrap_err();
        assert!(
            e.contains("number of collectives in the launch differs (rank 0: 2; rank 1: 1)"),
            "{e}"
        );
        assert!(e.contains("rank 0: [all_reduce, all_reduce]"), "{e}");
        let e = check(&[(1, vec![ar(1), ar(2)]), (1, vec![ar(1), ar(3)])]).unwrap_err();
        assert!(e.starts_with("collective 2 of 2: count differs"), "{e}");
    }

    #[test]
    fn junk_from_a_peer_is_a_clear_error() {
        let e = compare(&[encode_launch(1, &[ar(1)]), b"hello".to_vec()]).unwrap_err();
        assert!(
            e.contains("rank 1 sent 5 bytes that are not an operation signature"),
            "{e}"
        );
        let mut lying = encode_launch(1, &[ar(1)]);
        lying[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_launch(&lying).is_none());
    }

    #[test]
    fn long_reports_are_cut() {
        let a: Vec<OpSig> = (0..20).map(ar).collect();
        let b: Vec<OpSig> = (0..20).map(|c| ar(c + 1)).collect();
        let e = check(&[(1, a), (1, b)]).unwrap_err();
        assert!(e.ends_with("; and 12 more"), "{e}");
    }

    fn any_sig() -> impl Strategy<Value = OpSig> {
        (
            0..10usize,
            0..12usize,
            any::<u64>(),
            0..6usize,
            any::<f64>(),
            any::<u32>(),
        )
            .prop_map(|(k, d, count, o, s, root)| {
                let op = if o == 5 {
                    ReduceOp::PreMulSum(s)
                } else {
                    ReduceOp::BUILTIN[o]
                };
                OpSig::new(CollKind::ALL[k], DataType::ALL[d], 0, op, root as usize)
                    .with_count(count)
            })
    }

    impl OpSig {
        fn with_count(mut self, c: u64) -> OpSig {
            self.count = c;
            self
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn signatures_round_trip(seq in any::<u64>(), ops in proptest::collection::vec(any_sig(), 0..8)) {
            let (s, back) = decode_launch(&encode_launch(seq, &ops)).unwrap();
            prop_assert_eq!(s, seq);
            prop_assert_eq!(back.len(), ops.len());
            for (a, b) in back.iter().zip(&ops) {
                // NaN scalars compare unequal; their bits must still survive.
                prop_assert_eq!(format!("{a:?}"), format!("{b:?}"));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200), other in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_launch(&bytes);
            let _ = compare(&[bytes.clone(), other]);
            let mut framed = encode_launch(0, &[]);
            framed.extend_from_slice(&bytes);
            let _ = compare(&[framed.clone(), framed]);
        }
    }
}
