//! Cost of the correctness check per element: `RankCase::fill_input` and `count_wrong` over
//! about 1M elements, for a few ops, dtypes and rank counts (best of 3 runs).
//!
//! `cargo bench -p ferroccl-core --bench checkcost`
use ferroccl_core::numeric::element::store_f64;
use ferroccl_core::numeric::expected::RankCase;
use ferroccl_core::{CollKind, DataType, ReduceOp};
use std::time::Instant;

const N: usize = (1 << 20) + 3;

fn best_ns(elems: usize, mut f: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as f64 / elems.max(1) as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn run(kind: CollKind, dtype: DataType, op: ReduceOp, nranks: usize) {
    // `count` as the op takes it, so that the larger buffer holds about N elements.
    let count = match kind {
        CollKind::AllReduce => N,
        _ => N / nranks,
    };
    let case = RankCase {
        kind,
        dtype,
        op,
        nranks,
        rank: 1,
        count,
        root: 0,
        seed: 5,
    };
    let (send, recv) = kind.buffer_counts(count, nranks, true).unwrap();
    let mut input = vec![0u8; send * dtype.size()];
    let fill = best_ns(send, || case.fill_input(&mut input));
    let mut out = vec![0u8; recv * dtype.size()];
    for j in 0..recv {
        if let Some(v) = case.expected(j) {
            store_f64(dtype, &mut out, j, v);
        }
    }
    let mut wrong = 0;
    let check = best_ns(recv, || {
        let mut bad = None;
        wrong = case.count_wrong(&out, &mut bad);
    });
    let op = if kind.reduces() {
        format!("{op:?}")
    } else {
        String::new()
    };
    println!("{:<14} {:<10} {:<9} n={nranks}  fill {fill:6.2} ns/el  check {check:6.2} ns/el  ({wrong} wrong)", kind.to_string(), dtype.to_string(), op);
}

fn main() {
    for dtype in [
        DataType::Float32,
        DataType::Bfloat16,
        DataType::Float8E5M2,
        DataType::Int64,
    ] {
        run(CollKind::AllReduce, dtype, ReduceOp::Sum, 4);
        run(CollKind::AllReduce, dtype, ReduceOp::Sum, 8);
        run(CollKind::ReduceScatter, dtype, ReduceOp::Sum, 4);
        run(CollKind::AllGather, dtype, ReduceOp::Sum, 4);
        run(CollKind::AllToAll, dtype, ReduceOp::Sum, 4);
    }
    for op in [
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
        ReduceOp::PreMulSum(0.3),
    ] {
        run(CollKind::AllReduce, DataType::Float32, op, 4);
    }
}
