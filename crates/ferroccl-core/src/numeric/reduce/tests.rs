use super::*;
use crate::numeric::element::{load_f64, round_to, store_f64};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        crate::numeric::splitmix64(&mut self.0)
    }
}

/// A buffer whose data starts `shift` bytes past a 64-byte boundary.
struct Buf {
    mem: Vec<u8>,
    start: usize,
    len: usize,
}
impl Buf {
    fn new(len: usize, shift: usize) -> Buf {
        let mem = vec![0u8; len + 128];
        let base = mem.as_ptr() as usize;
        let start = (64 - base % 64) % 64 + shift;
        Buf { mem, start, len }
    }
    fn bytes(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.mem[self.start..self.start + self.len]
    }
    fn ptr(&mut self) -> *mut u8 {
        self.bytes_mut().as_mut_ptr()
    }
}

fn load_int(dtype: DataType, b: &[u8], i: usize) -> i128 {
    let s = dtype.size();
    let c = &b[i * s..(i + 1) * s];
    match dtype {
        DataType::Int8 => c[0] as i8 as i128,
        DataType::Uint8 => c[0] as i128,
        DataType::Int32 => i32::from_ne_bytes(c.try_into().unwrap()) as i128,
        DataType::Uint32 => u32::from_ne_bytes(c.try_into().unwrap()) as i128,
        DataType::Int64 => i64::from_ne_bytes(c.try_into().unwrap()) as i128,
        DataType::Uint64 => u64::from_ne_bytes(c.try_into().unwrap()) as i128,
        _ => unreachable!(),
    }
}

fn wrap(dtype: DataType, v: i128) -> i128 {
    match dtype {
        DataType::Int8 => v as i8 as i128,
        DataType::Uint8 => v as u8 as i128,
        DataType::Int32 => v as i32 as i128,
        DataType::Uint32 => v as u32 as i128,
        DataType::Int64 => v as i64 as i128,
        DataType::Uint64 => v as u64 as i128,
        _ => unreachable!(),
    }
}

fn fill_random(dtype: DataType, b: &mut [u8], rng: &mut Rng) {
    let n = b.len() / dtype.size();
    for i in 0..n {
        if dtype.is_float() {
            // Moderate magnitudes so that products and sums mostly stay finite.
            let h = rng.next();
            let m = 1.0 + (h >> 12) as f64 / (1u64 << 52) as f64;
            let e = (h % 11) as i32 - 5;
            let s = if h & (1 << 8) != 0 { -1.0 } else { 1.0 };
            let v = if h.is_multiple_of(17) {
                0.0
            } else {
                s * m * 2f64.powi(e)
            };
            store_f64(dtype, b, i, v);
        } else {
            let h = rng.next().to_ne_bytes();
            let s = dtype.size();
            b[i * s..(i + 1) * s].copy_from_slice(&h[..s]);
        }
    }
}

/// Expected element bytes of combine(recv, pre(local)) then post, computed independently of the
/// kernels: i128 for integers, f64 rounded to f32 after each step for the types that compute in
/// f32 (f64 rounding then f32 rounding equals one f32 rounding for + * /).
#[allow(clippy::too_many_arguments)]
fn expected(
    op: ReduceOp,
    dtype: DataType,
    nranks: usize,
    recv: &[u8],
    local: Option<&[u8]>,
    i: usize,
    pre: bool,
    post: bool,
    out: &mut [u8],
) {
    let is_pms = matches!(op, ReduceOp::PreMulSum(_));
    let scalar = if let ReduceOp::PreMulSum(s) = op {
        s
    } else {
        1.0
    };
    if !dtype.is_float() {
        let s = wrap(dtype, {
            let mut t = vec![0u8; dtype.size()];
            store_f64(dtype, &mut t, 0, scalar);
            load_int(dtype, &t, 0)
        });
        let mut v = load_int(dtype, recv, i);
        if let Some(local) = local {
            let mut l = load_int(dtype, local, i);
            if pre && is_pms {
                l = wrap(dtype, l.wrapping_mul(s));
            }
            v = wrap(
                dtype,
                match op {
                    ReduceOp::Prod => v.wrapping_mul(l),
                    ReduceOp::Max => v.max(l),
                    ReduceOp::Min => v.min(l),
                    _ => v + l,
                },
            );
        } else if pre && is_pms {
            v = wrap(dtype, v.wrapping_mul(s));
        }
        if post && op == ReduceOp::Avg {
            v /= nranks as i128;
        }
        let bytes = (v as i64).to_ne_bytes();
        let sz = dtype.size();
        out[i * sz..(i + 1) * sz].copy_from_slice(&bytes[..sz]);
        return;
    }
    let narrow = dtype != DataType::Float64;
    let r = |x: f64| if narrow { x as f32 as f64 } else { x };
    let s = r(round_to(dtype, scalar));
    let mut v = load_f64(dtype, recv, i);
    if let Some(local) = local {
        let mut l = load_f64(dtype, local, i);
        if pre && is_pms {
            // The product in the compute type, then rounded to the element type.
            l = round_to(dtype, r(l * s));
        }
        v = match op {
            ReduceOp::Prod => r(v * l),
            ReduceOp::Max => {
                if v.is_nan() || v > l {
                    v
                } else {
                    l
                }
            }
            ReduceOp::Min => {
                if v.is_nan() || v < l {
                    v
                } else {
                    l
                }
            }
            _ => r(v + l),
        };
    } else if pre && is_pms {
        v = r(v * s);
    }
    if post && op == ReduceOp::Avg {
        v = r(v / nranks as f64);
    }
    store_f64(dtype, out, i, v);
}

fn same_element(dtype: DataType, a: &[u8], b: &[u8], i: usize) -> bool {
    let s = dtype.size();
    if a[i * s..(i + 1) * s] == b[i * s..(i + 1) * s] {
        return true;
    }
    dtype.is_float() && load_f64(dtype, a, i).is_nan() && load_f64(dtype, b, i).is_nan()
}

fn ops_for(dtype: DataType) -> Vec<ReduceOp> {
    let mut ops = vec![
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
        ReduceOp::PreMulSum(3.0),
    ];
    if dtype.is_float() {
        ops.push(ReduceOp::PreMulSum(0.3));
    }
    if dtype.is_signed() {
        ops.push(ReduceOp::PreMulSum(-2.0));
    }
    ops
}

#[derive(Clone, Copy, Debug)]
enum Layout {
    Separate,
    IntoLocal,
    IntoRecv,
    TwoDsts,
    TwoDstsOneLocal,
}

#[test]
fn reduce_matches_reference_for_every_dtype_op_and_layout() {
    let mut rng = Rng(1);
    let layouts = [
        Layout::Separate,
        Layout::IntoLocal,
        Layout::IntoRecv,
        Layout::TwoDsts,
        Layout::TwoDstsOneLocal,
    ];
    for dtype in DataType::ALL {
        for op in ops_for(dtype) {
            for nranks in [1usize, 3, 4] {
                let red = Reducer::new(dtype, op, nranks).unwrap();
                for n in [0usize, 1, 7, 1000] {
                    for shift in [0usize, 1, 3] {
                        for layout in layouts {
                            for pre in [false, true] {
                                for post in [false, true] {
                                    let len = n * dtype.size();
                                    let mut recv = Buf::new(len, shift);
                                    let mut local = Buf::new(len, shift);
                                    let mut d0 = Buf::new(len, shift);
                                    let mut d1 = Buf::new(len, (shift + 1) % 4);
                                    fill_random(dtype, recv.bytes_mut(), &mut rng);
                                    fill_random(dtype, local.bytes_mut(), &mut rng);
                                    let mut want = vec![0u8; len];
                                    for i in 0..n {
                                        expected(
                                            op,
                                            dtype,
                                            nranks,
                                            recv.bytes(),
                                            Some(local.bytes()),
                                            i,
                                            pre,
                                            post,
                                            &mut want,
                                        );
                                    }
                                    let (rp, lp) = (recv.ptr(), local.ptr());
                                    let dsts: Vec<*mut u8> = match layout {
                                        Layout::Separate => vec![d0.ptr()],
                                        Layout::IntoLocal => vec![lp],
                                        Layout::IntoRecv => vec![rp],
                                        Layout::TwoDsts => vec![d0.ptr(), d1.ptr()],
                                        Layout::TwoDstsOneLocal => vec![d1.ptr(), lp],
                                    };
                                    unsafe { red.reduce(&dsts, rp, lp, n, pre, post) };
                                    let outs: Vec<&[u8]> = match layout {
                                        Layout::Separate => vec![d0.bytes()],
                                        Layout::IntoLocal => vec![local.bytes()],
                                        Layout::IntoRecv => vec![recv.bytes()],
                                        Layout::TwoDsts => vec![d0.bytes(), d1.bytes()],
                                        Layout::TwoDstsOneLocal => vec![d1.bytes(), local.bytes()],
                                    };
                                    for out in outs {
                                        for i in 0..n {
                                            assert!(
                                                same_element(dtype, out, &want, i),
                                                "{dtype} {op:?} nranks {nranks} n {n} shift {shift} {layout:?} pre {pre} post {post} i {i}: got {} want {}",
                                                load_f64(dtype, out, i),
                                                load_f64(dtype, &want, i)
                                            );
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn transform_matches_reference() {
    let mut rng = Rng(2);
    for dtype in DataType::ALL {
        for op in ops_for(dtype) {
            let red = Reducer::new(dtype, op, 3).unwrap();
            for n in [0usize, 1, 7, 1000] {
                for shift in [0usize, 1] {
                    for in_place in [false, true] {
                        for two in [false, true] {
                            for pre in [false, true] {
                                for post in [false, true] {
                                    let len = n * dtype.size();
                                    let mut src = Buf::new(len, shift);
                                    let mut d0 = Buf::new(len, shift);
                                    let mut d1 = Buf::new(len, 2);
                                    fill_random(dtype, src.bytes_mut(), &mut rng);
                                    let mut want = vec![0u8; len];
                                    for i in 0..n {
                                        expected(
                                            op,
                                            dtype,
                                            3,
                                            src.bytes(),
                                            None,
                                            i,
                                            pre,
                                            post,
                                            &mut want,
                                        );
                                    }
                                    let sp = src.ptr();
                                    let mut dsts = vec![if in_place { sp } else { d0.ptr() }];
                                    if two {
                                        dsts.push(d1.ptr());
                                    }
                                    unsafe { red.transform(&dsts, sp, n, pre, post) };
                                    let mut outs =
                                        vec![if in_place { src.bytes() } else { d0.bytes() }];
                                    if two {
                                        outs.push(d1.bytes());
                                    }
                                    for out in outs {
                                        for i in 0..n {
                                            assert!(
                                                same_element(dtype, out, &want, i),
                                                "{dtype} {op:?} n {n} shift {shift} in_place {in_place} pre {pre} post {post} i {i}: got {} want {}",
                                                load_f64(dtype, out, i),
                                                load_f64(dtype, &want, i)
                                            );
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn nan_propagates_through_max_and_min() {
    for dtype in DataType::ALL.into_iter().filter(|d| d.is_float()) {
        for op in [ReduceOp::Max, ReduceOp::Min] {
            let red = Reducer::new(dtype, op, 2).unwrap();
            let sz = dtype.size();
            let mut a = vec![0u8; 4 * sz];
            let mut b = vec![0u8; 4 * sz];
            for (i, (x, y)) in [
                (f64::NAN, 1.0),
                (1.0, f64::NAN),
                (f64::NAN, f64::NAN),
                (-1.0, 2.0),
            ]
            .iter()
            .enumerate()
            {
                store_f64(dtype, &mut a, i, *x);
                store_f64(dtype, &mut b, i, *y);
            }
            let mut out = vec![0u8; 4 * sz];
            unsafe { red.reduce(&[out.as_mut_ptr()], a.as_ptr(), b.as_ptr(), 4, false, false) };
            for i in 0..3 {
                assert!(load_f64(dtype, &out, i).is_nan(), "{dtype} {op:?} {i}");
            }
            assert_eq!(
                load_f64(dtype, &out, 3),
                if op == ReduceOp::Max { 2.0 } else { -1.0 }
            );
        }
    }
}

#[test]
fn integer_avg_truncates_toward_zero() {
    let red = Reducer::new(DataType::Int32, ReduceOp::Avg, 4).unwrap();
    let a: [i32; 3] = [-7, 7, i32::MIN];
    let b: [i32; 3] = [0, 0, 0];
    let mut out = [0i32; 3];
    unsafe {
        red.reduce(
            &[out.as_mut_ptr() as *mut u8],
            a.as_ptr() as *const u8,
            b.as_ptr() as *const u8,
            3,
            false,
            true,
        )
    };
    assert_eq!(out, [-1, 1, i32::MIN / 4]);
    // More ranks than an i8 can count still divide correctly.
    let red = Reducer::new(DataType::Int8, ReduceOp::Avg, 128).unwrap();
    let src = [-128i8];
    let mut out = [0i8];
    unsafe {
        red.transform(
            &[out.as_mut_ptr() as *mut u8],
            src.as_ptr() as *const u8,
            1,
            false,
            true,
        )
    };
    assert_eq!(out, [-1]);
}

#[test]
fn new_rejects_bad_arguments() {
    assert!(matches!(
        Reducer::new(DataType::Float32, ReduceOp::Sum, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Reducer::new(DataType::Int32, ReduceOp::PreMulSum(0.5), 2),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Reducer::new(DataType::Float32, ReduceOp::PreMulSum(f64::INFINITY), 2),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(
        Reducer::new(DataType::Bfloat16, ReduceOp::Max, 2)
            .unwrap()
            .dtype(),
        DataType::Bfloat16
    );
}

/// Throughput of the hot case against a plain copy of the same bytes. Run with
/// `cargo test --release -p ferroccl-core reduce_throughput -- --ignored --nocapture`.
#[test]
#[ignore]
fn reduce_throughput() {
    let n = 16 << 20; // 64 MiB of f32
    let a = vec![1.0f32; n];
    let mut b = vec![2.0f32; n];
    let mut c = vec![0.0f32; n];
    let red = Reducer::new(DataType::Float32, ReduceOp::Sum, 2).unwrap();
    for (name, in_place) in [("separate", false), ("in place", true)] {
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            let dst = if in_place {
                b.as_mut_ptr() as *mut u8
            } else {
                c.as_mut_ptr() as *mut u8
            };
            unsafe {
                red.reduce(
                    &[dst],
                    a.as_ptr() as *const u8,
                    b.as_ptr() as *const u8,
                    n,
                    false,
                    false,
                )
            };
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "f32 sum {name}: {:.2} GB/s (3 x 64 MiB moved per call)",
            3.0 * (n * 4) as f64 / best / 1e9
        );
    }
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        c.copy_from_slice(&a);
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "memcpy: {:.2} GB/s (2 x 64 MiB moved)",
        2.0 * (n * 4) as f64 / best / 1e9
    );
    std::hint::black_box(&c);
}

/// A 2-rank one-shot fold (each rank folds its peer's stored product with its own operand, as the
/// GPU's peer engine and the host's one-shot do) gives both ranks the same bits under PreMulSum
/// with a scalar per rank, for every float type: each own product is rounded to the element type
/// as the peer's stored one was. Without that rounding the narrow types differ (checked below).
#[test]
fn two_rank_premulsum_folds_give_both_ranks_the_same_bits() {
    let mut rng = Rng(7);
    let n = 4096;
    for dtype in [
        DataType::Float16,
        DataType::Bfloat16,
        DataType::Float32,
        DataType::Float64,
        DataType::Float8E4M3,
        DataType::Float8E5M2,
    ] {
        let es = dtype.size();
        let (mut x0, mut x1) = (Buf::new(n * es, 0), Buf::new(n * es, 0));
        fill_random(dtype, x0.bytes_mut(), &mut rng);
        fill_random(dtype, x1.bytes_mut(), &mut rng);
        let r0 = Reducer::new(dtype, ReduceOp::PreMulSum(0.3), 2).unwrap();
        let r1 = Reducer::new(dtype, ReduceOp::PreMulSum(0.7), 2).unwrap();
        let (mut p0, mut p1) = (Buf::new(n * es, 0), Buf::new(n * es, 0));
        let (mut out0, mut out1) = (Buf::new(n * es, 0), Buf::new(n * es, 0));
        // SAFETY: every buffer holds n elements of the dtype.
        unsafe {
            r0.transform(&[p0.ptr()], x0.ptr(), n, true, false);
            r1.transform(&[p1.ptr()], x1.ptr(), n, true, false);
            r0.reduce(&[out0.ptr()], p1.ptr(), x0.ptr(), n, true, true);
            r1.reduce(&[out1.ptr()], p0.ptr(), x1.ptr(), n, true, true);
        }
        let differ = (0..n)
            .filter(|&i| !same_element(dtype, out0.bytes(), out1.bytes(), i))
            .count();
        assert_eq!(
            differ, 0,
            "{dtype:?}: {differ} of {n} elements differ between the ranks"
        );
        // The same folds with the own product unrounded (in the compute type) differ for the
        // narrow types: the rounding is what makes the ranks agree.
        if matches!(dtype, DataType::Float16 | DataType::Bfloat16) {
            let unrounded = (0..n)
                .filter(|&i| {
                    let f = |x: &Buf, s: f64, p: &Buf| {
                        let own = (load_f64(dtype, x.bytes(), i) as f32 * round_to(dtype, s) as f32)
                            as f64;
                        round_to(
                            dtype,
                            (load_f64(dtype, p.bytes(), i) as f32 + own as f32) as f64,
                        )
                    };
                    let (a, b) = (f(&x0, 0.3, &p1), f(&x1, 0.7, &p0));
                    a != b && !(a.is_nan() && b.is_nan())
                })
                .count();
            assert!(
                unrounded > 0,
                "{dtype:?}: no element tells the rounding apart"
            );
        }
    }
}
