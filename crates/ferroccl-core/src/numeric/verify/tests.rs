use super::*;
use crate::numeric::element::load_f64;
use crate::numeric::Reducer;

const COUNT: usize = 300;

fn ops_for(dtype: DataType) -> Vec<ReduceOp> {
    let mut ops = vec![
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
        ReduceOp::PreMulSum(2.0),
        ReduceOp::PreMulSum(3.0),
        ReduceOp::PreMulSum(0.5),
        ReduceOp::PreMulSum(0.3),
        ReduceOp::PreMulSum(-1.0),
        ReduceOp::PreMulSum(1000.0),
    ];
    ops.retain(|op| op.validate(dtype).is_ok());
    ops
}

fn inputs(dtype: DataType, op: ReduceOp, nranks: usize, seed: u64) -> Vec<Vec<u8>> {
    (0..nranks)
        .map(|r| {
            let mut b = vec![0u8; COUNT * dtype.size()];
            fill_input(dtype, op, nranks, r, 0, seed, &mut b);
            b
        })
        .collect()
}

/// Reduces the stored inputs through the host kernels, combining ranks in `order`: the first
/// rank's input is pre-multiplied into the accumulator, then each next one is folded in.
fn reduce_in_order(red: &Reducer, ins: &[Vec<u8>], order: &[usize]) -> Vec<u8> {
    let mut acc = vec![0u8; ins[0].len()];
    let last = order.len() - 1;
    unsafe {
        red.transform(
            &[acc.as_mut_ptr()],
            ins[order[0]].as_ptr(),
            COUNT,
            true,
            last == 0,
        );
        for (step, &r) in order.iter().enumerate().skip(1) {
            let p = acc.as_mut_ptr();
            red.reduce(&[p], p, ins[r].as_ptr(), COUNT, true, step == last);
        }
    }
    acc
}

#[test]
fn expected_matches_host_reduction_in_both_orders() {
    for dtype in DataType::ALL {
        for op in ops_for(dtype) {
            for nranks in 1..=16usize {
                let seed = 0x5eed ^ nranks as u64;
                let ins = inputs(dtype, op, nranks, seed);
                let red = Reducer::new(dtype, op, nranks).unwrap();
                let fwd: Vec<usize> = (0..nranks).collect();
                let rev: Vec<usize> = (0..nranks).rev().collect();
                let exact_case = !(dtype.is_float()
                    && (op == ReduceOp::Avg
                        || matches!(op, ReduceOp::PreMulSum(s) if !is_pow2(round_to(dtype, s).abs()))));
                let big_scalar =
                    matches!(op, ReduceOp::PreMulSum(s) if s.abs() > exact_limit(dtype) as f64);
                for order in [&fwd, &rev] {
                    let out = reduce_in_order(&red, &ins, order);
                    for i in 0..COUNT {
                        let want = expected_reduced(dtype, op, nranks, i, seed);
                        let got = load_f64(dtype, &out, i);
                        if big_scalar && !dtype.is_float() {
                            // A saturated scalar beyond the exact range: only the dtype's own wrapping
                            // arithmetic is promised, and f64 may not hold 64-bit results.
                            continue;
                        }
                        assert!(
                            matches(dtype, op, nranks, got, want),
                            "{dtype} {op:?} nranks {nranks} index {i} order {:?}: got {got}, expected {want}",
                            order.first()
                        );
                        if exact_case {
                            assert_eq!(got, want, "{dtype} {op:?} nranks {nranks} index {i}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn inputs_are_exact_nonzero_and_vary() {
    for dtype in DataType::ALL {
        for op in ops_for(dtype) {
            for nranks in 1..=16usize {
                let a = inputs(dtype, op, nranks, 1);
                let b = inputs(dtype, op, nranks, 2);
                // An unsigned type with a saturated scalar leaves each index one contributor of
                // value 1: only which rank it is varies.
                let degenerate = !dtype.is_signed()
                    && op != ReduceOp::Prod
                    && sum_budget(dtype, op, nranks) == 1;
                if degenerate {
                    continue;
                }
                assert_ne!(a, b, "{dtype} {op:?} nranks {nranks}: seeds do not matter");
                for r in 0..nranks {
                    let vals: Vec<f64> = (0..COUNT)
                        .map(|i| input_value(dtype, op, nranks, r, i, 1))
                        .collect();
                    assert!(
                        vals.iter().any(|&v| v != 0.0),
                        "{dtype} {op:?} nranks {nranks} rank {r}: all zero"
                    );
                    if op != ReduceOp::Prod || dtype.is_signed() {
                        assert!(
                            vals.iter().any(|&v| v != vals[0]),
                            "{dtype} {op:?} rank {r}: constant"
                        );
                    }
                    for (i, &v) in vals.iter().enumerate() {
                        assert_eq!(round_to(dtype, v), v, "{dtype} {op:?}: {v} is not exact");
                        assert_eq!(load_f64(dtype, &a[r], i), v);
                    }
                }
                if nranks > 1 && a[0] == a[1] {
                    panic!("{dtype} {op:?} nranks {nranks}: ranks 0 and 1 have the same data");
                }
                let ea: Vec<f64> = (0..COUNT)
                    .map(|i| expected_reduced(dtype, op, nranks, i, 1))
                    .collect();
                let eb: Vec<f64> = (0..COUNT)
                    .map(|i| expected_reduced(dtype, op, nranks, i, 2))
                    .collect();
                assert_ne!(ea, eb, "{dtype} {op:?} nranks {nranks}");
                if op != ReduceOp::Avg {
                    assert!(
                        ea.iter().any(|&v| v != 0.0),
                        "{dtype} {op:?} nranks {nranks}: results all zero"
                    );
                }
            }
        }
    }
}

#[test]
fn fill_input_honours_first_index() {
    for dtype in DataType::ALL {
        let mut b = vec![0u8; 10 * dtype.size()];
        fill_input(dtype, ReduceOp::Sum, 4, 2, 1000, 9, &mut b);
        for i in 0..10 {
            assert_eq!(
                load_f64(dtype, &b, i),
                input_value(dtype, ReduceOp::Sum, 4, 2, 1000 + i, 9)
            );
        }
    }
}

/// A missing or duplicated contribution, or reading the wrong index, must usually show.
#[test]
fn errors_change_results() {
    for dtype in DataType::ALL {
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::PreMulSum(2.0)] {
            for nranks in [2usize, 5, 16] {
                let inputs = Inputs::new(dtype, op, nranks);
                let combine = |a: f64, b: f64| match op {
                    ReduceOp::Prod => a * b,
                    _ => a + scalar_in(dtype, op) * b,
                };
                let (mut missing, mut dup, mut shifted) = (0, 0, 0);
                for i in 0..COUNT {
                    let want = expected_reduced(dtype, op, nranks, i, 3);
                    let r = i % nranks;
                    let v = inputs.value(r, i, 3);
                    // Undo / redo rank r's contribution (exact: values are small and powers of two).
                    let without = match op {
                        ReduceOp::Prod => want / v,
                        _ => want - scalar_in(dtype, op) * v,
                    };
                    missing += (without != want) as usize;
                    dup += (combine(want, v) != want) as usize;
                    let wrong = combine(without, inputs.value(r, i + 1, 3));
                    shifted += (wrong != want) as usize;
                }
                for (what, hits) in [
                    ("missing", missing),
                    ("duplicated", dup),
                    ("wrong index", shifted),
                ] {
                    assert!(hits * 10 > COUNT, "{dtype} {op:?} nranks {nranks}: a {what} contribution shows only {hits}/{COUNT} times");
                }
            }
        }
    }
}

#[test]
fn data_values_are_exact_and_distinct() {
    for dtype in DataType::ALL {
        let vals: Vec<f64> = (0..64).map(|i| data_value(dtype, 3, i, 7)).collect();
        for &v in &vals {
            assert_eq!(round_to(dtype, v), v);
            assert!(v.is_finite());
        }
        let distinct = vals.iter().filter(|&&v| v != vals[0]).count();
        assert!(distinct > 0, "{dtype}");
        assert_ne!(
            vals,
            (0..64)
                .map(|i| data_value(dtype, 4, i, 7))
                .collect::<Vec<_>>()
        );
        assert_ne!(
            vals,
            (0..64)
                .map(|i| data_value(dtype, 3, i, 8))
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn tolerances() {
    assert!(matches(DataType::Int32, ReduceOp::Avg, 3, 2.0, 2.0));
    assert!(!matches(DataType::Int32, ReduceOp::Avg, 3, 2.0, 3.0));
    assert!(matches(
        DataType::Float16,
        ReduceOp::Avg,
        3,
        1.0 / 3.0 + 2f64.powi(-13),
        1.0 / 3.0
    ));
    assert!(!matches(
        DataType::Float16,
        ReduceOp::Avg,
        3,
        1.0 / 3.0 + 2f64.powi(-8),
        1.0 / 3.0
    ));
    assert!(!matches(
        DataType::Float32,
        ReduceOp::Sum,
        3,
        1.0 + 2f64.powi(-23),
        1.0
    ));
    assert!(!matches(
        DataType::Float32,
        ReduceOp::Sum,
        3,
        f64::NAN,
        f64::NAN
    ));
    assert!(!matches(
        DataType::Float32,
        ReduceOp::PreMulSum(2.0),
        3,
        4.5,
        4.0
    ));
}
