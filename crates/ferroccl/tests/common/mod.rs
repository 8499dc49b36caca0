//! The correctness matrix that every rank runs, whatever the launch mode and transport.
#![allow(dead_code)]

pub mod launch;

/// GPUs for the GPU tests: None (skipped, said so) unless FERROCCL_GPU_TEST=1; at least 2.
pub fn gpus_for_test() -> Option<usize> {
    gpus_at_least(2)
}

/// For the tests that need one GPU (several ranks may share it): false (skipped, said so)
/// unless FERROCCL_GPU_TEST=1.
pub fn one_gpu_for_test() -> bool {
    gpus_at_least(1).is_some()
}

/// The GPUs there are, when FERROCCL_GPU_TEST=1 (asserting at least `min`); else None, said so.
fn gpus_at_least(min: usize) -> Option<usize> {
    if std::env::var("FERROCCL_GPU_TEST").ok().as_deref() != Some("1") {
        eprintln!("skipped: set FERROCCL_GPU_TEST=1 on a machine with GPUs");
        return None;
    }
    let n = ferroccl::cuda::gpu_count().expect("CUDA driver");
    assert!(
        n >= min,
        "these GPU tests need at least {min} GPUs, found {n}"
    );
    Some(n)
}

use ferroccl::{CollKind, Comm, DataType, Group, OpArgs, ReduceOp};
use ferroccl_core::numeric::expected::RankCase;

/// The operations of the matrix: every collective plus a ring of send/recv in one group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MatrixOp {
    Coll(CollKind),
    SendRecv,
}

pub fn all_ops() -> Vec<MatrixOp> {
    let mut v: Vec<MatrixOp> = CollKind::COLLECTIVES
        .iter()
        .map(|&k| MatrixOp::Coll(k))
        .collect();
    v.push(MatrixOp::SendRecv);
    v
}

pub fn reduce_ops(kind: CollKind) -> Vec<ReduceOp> {
    if kind.reduces() {
        vec![
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
            ReduceOp::PreMulSum(2.0),
        ]
    } else {
        vec![ReduceOp::Sum]
    }
}

/// 8-byte aligned scratch memory, reused across cases (fresh pages for every case would cost
/// more in page faults than the collectives themselves).
struct Buf(Vec<u64>);
thread_local! {
    static ARENA: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}
impl Buf {
    fn new(bytes: usize) -> Buf {
        let words = bytes.div_ceil(8).max(1);
        let mut v = ARENA.with(|a| std::mem::take(&mut *a.borrow_mut()));
        if v.len() < words {
            v.resize(words, 0);
        }
        Buf(v)
    }
    fn ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr() as *mut u8
    }
    fn bytes(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.0.len() * 8);
        // SAFETY: checked to lie within the allocation.
        unsafe { std::slice::from_raw_parts_mut(self.ptr().add(off), len) }
    }
}
impl Drop for Buf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        ARENA.with(|a| *a.borrow_mut() = v);
    }
}

/// Runs one case on this rank; returns the number of wrong output elements (and the first).
pub fn run_case(
    comm: &Comm,
    op: MatrixOp,
    dtype: DataType,
    redop: ReduceOp,
    count: usize,
    in_place: bool,
    seed: u64,
) -> Result<(usize, String), String> {
    let (r, n) = (comm.rank(), comm.nranks());
    let es = dtype.size();
    let root = (seed as usize) % n;
    let (kind, case_root) = match op {
        MatrixOp::Coll(k) => (k, root),
        MatrixOp::SendRecv => (CollKind::Recv, (r + n - 1) % n),
    };
    let send_case = RankCase {
        kind: if op == MatrixOp::SendRecv {
            CollKind::Send
        } else {
            kind
        },
        dtype,
        op: redop,
        nranks: n,
        rank: r,
        count,
        root: case_root,
        seed,
    };
    let recv_case = RankCase {
        kind,
        root: case_root,
        ..send_case
    };
    let (sc, rc) = match op {
        MatrixOp::Coll(k) => k.buffer_counts(count, n, r == root).unwrap(),
        MatrixOp::SendRecv => (count, count),
    };
    let (sb, rb) = (sc * es, rc * es);
    // In place: one buffer laid out by NCCL's conventions.
    let (mut mem, send_off, recv_off) = if in_place {
        let blk = r * count * es;
        let (so, ro) = match kind {
            CollKind::AllGather => (blk, 0),
            CollKind::Gather if r == root => (blk, 0),
            CollKind::ReduceScatter => (0, blk),
            CollKind::Scatter if r == root => (0, blk),
            _ => (0, 0),
        };
        (Buf::new((so + sb).max(ro + rb)), so, ro)
    } else {
        (Buf::new(sb + rb), 0, sb)
    };
    mem.bytes(recv_off, rb).fill(0xA5);
    send_case.fill_input(mem.bytes(send_off, sb));
    let base = mem.ptr();
    // SAFETY: offsets lie within `mem`.
    let (send, recv) = unsafe { (base.add(send_off) as *const u8, base.add(recv_off)) };
    let result = match op {
        MatrixOp::Coll(k) => {
            let args = OpArgs {
                kind: k,
                send,
                recv,
                count,
                dtype,
                op: redop,
                root,
                device_scalar: None,
            };
            // SAFETY: buffers are valid for the extents computed above.
            unsafe { comm.run_raw(&args) }
        }
        MatrixOp::SendRecv => {
            let mut g = Group::new();
            let s = OpArgs {
                kind: CollKind::Send,
                send,
                recv: std::ptr::null_mut(),
                count,
                dtype,
                op: redop,
                root: (r + 1) % n,
                device_scalar: None,
            };
            let v = OpArgs {
                kind: CollKind::Recv,
                send: std::ptr::null(),
                recv,
                count,
                dtype,
                op: redop,
                root: (r + n - 1) % n,
                device_scalar: None,
            };
            // SAFETY: as above.
            unsafe {
                g.push_raw(comm, s)
                    .and_then(|_| g.push_raw(comm, v))
                    .and_then(|_| g.launch())
            }
        }
    };
    result.map_err(|e| {
        format!("rank {r}: {op:?} {dtype} {redop} count {count} in_place {in_place}: {e}")
    })?;
    let mut first = None;
    let wrong = recv_case.count_wrong(mem.bytes(recv_off, rb), &mut first);
    let detail = match first {
        Some((j, got, want)) => format!(
            "rank {r} of {n}: {op:?} {dtype} {redop} count {count} root {root} in_place {in_place}: {wrong} wrong, first at {j}: got {got}, want {want}"
        ),
        None => String::new(),
    };
    Ok((wrong, detail))
}

/// One case of the matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Case {
    pub op: MatrixOp,
    pub dtype: DataType,
    pub redop: ReduceOp,
    /// Index into the matrix's sizes.
    pub size: usize,
    pub in_place: bool,
}

/// How much of the cross product of operations, types, reductions, sizes and placements a
/// matrix runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coverage {
    /// Every combination.
    Full,
    /// Every (operation, type, reduction) once, and every pair of values of any two of the five
    /// factors at least once: a tenth of the cases, and what a bug that needs two of them to
    /// meet cannot escape. The rank counts and transports that run it are covered by the full
    /// product elsewhere.
    Pairwise,
}

fn in_place_forms(op: MatrixOp) -> &'static [bool] {
    if op == MatrixOp::SendRecv {
        &[false]
    } else {
        &[false, true]
    }
}

fn kind_of(op: MatrixOp) -> CollKind {
    match op {
        MatrixOp::Coll(k) => k,
        MatrixOp::SendRecv => CollKind::Send,
    }
}

/// The cases of a matrix over `nsizes` sizes, in a fixed order.
pub fn cases(nsizes: usize, coverage: Coverage) -> Vec<Case> {
    let mut full = Vec::new();
    for op in all_ops() {
        for dtype in DataType::ALL {
            for redop in reduce_ops(kind_of(op)) {
                for size in 0..nsizes {
                    for &in_place in in_place_forms(op) {
                        full.push(Case {
                            op,
                            dtype,
                            redop,
                            size,
                            in_place,
                        });
                    }
                }
            }
        }
    }
    if coverage == Coverage::Full {
        return full;
    }
    // Every (operation, type, reduction) once, sizes and placements rotating through them;
    // then, for any pair of factor values no case has met yet, the first case of the full
    // product that has it.
    let mut out = Vec::new();
    let mut k = 0;
    for op in all_ops() {
        for dtype in DataType::ALL {
            for redop in reduce_ops(kind_of(op)) {
                let forms = in_place_forms(op);
                out.push(Case {
                    op,
                    dtype,
                    redop,
                    size: k % nsizes,
                    in_place: forms[(k / nsizes) % forms.len()],
                });
                k += 1;
            }
        }
    }
    let mut met: std::collections::HashSet<String> = out.iter().flat_map(factor_pairs).collect();
    for c in &full {
        let pairs = factor_pairs(c);
        if pairs.iter().any(|p| !met.contains(p)) {
            met.extend(pairs);
            out.push(*c);
        }
    }
    out
}

/// The pairs of factor values a case covers, as (factor, value, factor, value) strings.
pub fn factor_pairs(c: &Case) -> Vec<String> {
    let f = [
        format!("op={:?}", c.op),
        format!("dtype={}", c.dtype),
        format!("redop={}", c.redop),
        format!("size={}", c.size),
        format!("in_place={}", c.in_place),
    ];
    let mut v = Vec::new();
    for i in 0..f.len() {
        for j in i + 1..f.len() {
            v.push(format!("{} {}", f[i], f[j]));
        }
    }
    v
}

/// The cases of `coverage` over `sizes` on this rank. Returns (cases, errors).
pub fn run_matrix(
    comm: &Comm,
    sizes: &[usize],
    coverage: Coverage,
    seed: u64,
) -> (usize, Vec<String>) {
    let mut errors = Vec::new();
    let mut s = seed;
    let all = cases(sizes.len(), coverage);
    for (i, c) in all.iter().enumerate() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        match run_case(
            comm,
            c.op,
            c.dtype,
            c.redop,
            sizes[c.size],
            c.in_place,
            s >> 16,
        ) {
            Ok((0, _)) => {}
            Ok((_, detail)) => errors.push(detail),
            Err(e) => {
                errors.push(e);
                // The communicator is unusable after a failure.
                return (i + 1, errors);
            }
        }
    }
    (all.len(), errors)
}
