//! Host evidence that check.cuh computes what `RankCase` does, without a GPU: the header the
//! kernels are built from is compiled by the system C compiler (and as C++ where there is one)
//! into a shared library, whose per-element functions are compared with ferroccl-core's for
//! every dtype, reduction and operation kind over many ranks, indices and seeds. Fills and
//! conversions must agree bit for bit, expected values exactly, counts and first-bad records
//! exactly. What only the GPU runs (check.cu's loops and atomics) is left to the GPU test.
//!
//! Skips where no C compiler can be run (`CC`, else `cc`).

use super::{FcCheckCase, FcCheckResult};
use ferroccl_core::numeric::element::{load_f64, store_f64};
use ferroccl_core::numeric::expected::RankCase;
use ferroccl_core::numeric::verify::{fill_data, fill_input};
use ferroccl_core::numeric::{Element, F8E4M3, F8E5M2};
use ferroccl_core::{CollKind, DataType, ReduceOp};
use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The serial twin of check.cu's kernels, over the same check.cuh functions.
const HARNESS: &str = r#"
#include "check.cuh"

#ifdef __cplusplus
#define FCH_API extern "C"
#else
#define FCH_API
#endif

static fc_u64 keys_of(const FcCheckCase* c, const FcCheckKeys* k, fc_u64 nkeys, fc_u64* keys) {
    if (nkeys > c->n) nkeys = c->n;
    if (nkeys > 1024) nkeys = 1024;
    for (fc_u64 r = 0; r < nkeys; ++r) keys[r] = fc_ck_rank_key(k->key, r);
    return nkeys;
}

FCH_API void fch_fill(const FcCheckCase* c, fc_u64 first, fc_u64 n, unsigned char* out) {
    FcCheckKeys k = fc_ck_keys(c);
    fc_u32 s = fc_ck_size(c->dtype);
    for (fc_u64 i = 0; i < n; ++i) {
        fc_u64 b = fc_ck_fill_bits(c, &k, first + i);
        for (fc_u32 j = 0; j < s; ++j) out[i * s + j] = (unsigned char)(b >> (8 * j));
    }
}

FCH_API int fch_expected(const FcCheckCase* c, fc_u64 j, fc_u64 nkeys, double* want) {
    fc_u64 keys[1024];
    FcCheckKeys k = fc_ck_keys(c);
    nkeys = keys_of(c, &k, nkeys, keys);
    return fc_ck_expected(c, &k, keys, nkeys, j, want);
}

FCH_API void fch_count(const FcCheckCase* c, const unsigned char* out, FcCheckResult* res) {
    fc_u64 keys[1024];
    FcCheckKeys k = fc_ck_keys(c);
    fc_u64 nkeys = keys_of(c, &k, 1024, keys);
    fc_u32 s = fc_ck_size(c->dtype);
    res->wrong = 0;
    res->first = ~0ull;
    for (fc_u64 i = 0; i < c->len; ++i) {
        fc_u64 b = 0;
        for (fc_u32 j = 0; j < s; ++j) b |= (fc_u64)out[i * s + j] << (8 * j);
        if (fc_ck_wrong(c, &k, keys, nkeys, i, b)) {
            res->wrong++;
            if (res->first == ~0ull) {
                res->first = i;
                /* As ferroccl_check_first does it: without the key table. */
                fc_ck_expected(c, &k, 0, 0, i, &res->want);
                res->got = fc_ck_to_f64(c->dtype, b);
            }
        }
    }
}

FCH_API fc_u64 fch_from_f64(fc_u32 dtype, double v) { return fc_ck_from_f64(dtype, v); }
FCH_API double fch_to_f64(fc_u32 dtype, fc_u64 bits) { return fc_ck_to_f64(dtype, bits); }
"#;

type FillFn = unsafe extern "C" fn(*const FcCheckCase, u64, u64, *mut u8);
type ExpectedFn = unsafe extern "C" fn(*const FcCheckCase, u64, u64, *mut f64) -> i32;
type CountFn = unsafe extern "C" fn(*const FcCheckCase, *const u8, *mut FcCheckResult);
type FromF64Fn = unsafe extern "C" fn(u32, f64) -> u64;
type ToF64Fn = unsafe extern "C" fn(u32, u64) -> f64;

/// check.cuh as a loaded shared library.
struct Lib {
    name: String,
    fill: FillFn,
    expected: ExpectedFn,
    count: CountFn,
    from_f64: FromF64Fn,
    to_f64: ToF64Fn,
}

impl Lib {
    fn fill(&self, c: &FcCheckCase, first: u64, n: usize) -> Vec<u8> {
        let mut out = vec![0u8; n * size_of_dtype(c.dtype)];
        // SAFETY: out holds n elements of the case's dtype.
        unsafe { (self.fill)(c, first, n as u64, out.as_mut_ptr()) };
        out
    }
    fn expected(&self, c: &FcCheckCase, j: u64, nkeys: u64) -> Option<f64> {
        let mut w = 0.0;
        // SAFETY: plain values and one out-pointer.
        (unsafe { (self.expected)(c, j, nkeys, &mut w) } != 0).then_some(w)
    }
    fn count(&self, c: &FcCheckCase, out: &[u8]) -> FcCheckResult {
        assert_eq!(out.len() as u64, c.len * size_of_dtype(c.dtype) as u64);
        let mut r = FcCheckResult::default();
        // SAFETY: out holds c.len elements.
        unsafe { (self.count)(c, out.as_ptr(), &mut r) };
        r
    }
    fn bits_of(&self, d: DataType, v: f64) -> u64 {
        // SAFETY: plain values.
        unsafe { (self.from_f64)(d.nccl_id() as u32, v) }
    }
    fn value_of(&self, d: DataType, bits: u64) -> f64 {
        // SAFETY: plain values.
        unsafe { (self.to_f64)(d.nccl_id() as u32, bits) }
    }
}

fn size_of_dtype(code: u32) -> usize {
    DataType::ALL[code as usize].size()
}

fn temp_dir() -> PathBuf {
    let mut n = [0u8; 8];
    getrandom::getrandom(&mut n).unwrap();
    let d = std::env::temp_dir().join(format!(
        "ferroccl-check-cuh-{}-{:016x}",
        std::process::id(),
        u64::from_le_bytes(n)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Builds and loads the harness with `compiler` in `lang` ("c" or "c++"); None when that
/// compiler cannot be run here. A compiler that runs but rejects the header fails the test.
fn build(dir: &Path, compiler: &str, lang: &str) -> Option<Lib> {
    let so = dir.join(format!("libcheck-{}.so", lang.replace('+', "p")));
    let std = if lang == "c" {
        "-std=c11"
    } else {
        "-std=c++17"
    };
    let out = Command::new(compiler)
        .args([
            "-x",
            lang,
            std,
            "-O2",
            "-fPIC",
            "-shared",
            "-ffp-contract=off",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
        ])
        .arg(&so)
        .arg(dir.join("harness.c"))
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            eprintln!("check.cuh host test: cannot run {compiler}: {e}");
            return None;
        }
    };
    assert!(
        out.status.success(),
        "{compiler} -x {lang} rejected check.cuh:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = CString::new(so.to_str().unwrap()).unwrap();
    // SAFETY: a library we just built, with no initialisers of its own.
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "dlopen {}", so.display());
    let sym = |name: &str| -> *mut c_void {
        let n = CString::new(name).unwrap();
        // SAFETY: h is a loaded library.
        let p = unsafe { libc::dlsym(h, n.as_ptr()) };
        assert!(!p.is_null(), "{name} missing");
        p
    };
    // SAFETY: the symbols are the harness's functions, with these C signatures. The library
    // stays loaded for the rest of the process (never dlclosed).
    unsafe {
        Some(Lib {
            name: format!("{compiler} -x {lang}"),
            fill: std::mem::transmute::<*mut c_void, FillFn>(sym("fch_fill")),
            expected: std::mem::transmute::<*mut c_void, ExpectedFn>(sym("fch_expected")),
            count: std::mem::transmute::<*mut c_void, CountFn>(sym("fch_count")),
            from_f64: std::mem::transmute::<*mut c_void, FromF64Fn>(sym("fch_from_f64")),
            to_f64: std::mem::transmute::<*mut c_void, ToF64Fn>(sym("fch_to_f64")),
        })
    }
}

/// The harness built as C, and as C++ where a C++ compiler exists (NVRTC reads the header as
/// C++). Empty where there is no C compiler.
fn libs() -> &'static [Lib] {
    static LIBS: std::sync::OnceLock<Vec<Lib>> = std::sync::OnceLock::new();
    LIBS.get_or_init(|| {
        let dir = temp_dir();
        std::fs::write(dir.join("check.cuh"), include_str!("../kernels/check.cuh")).unwrap();
        std::fs::write(dir.join("ints.cuh"), include_str!("../kernels/ints.cuh")).unwrap();
        std::fs::write(dir.join("harness.c"), HARNESS).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let mut v = Vec::new();
        if let Some(l) = build(&dir, &cc, "c") {
            v.push(l);
            if let Some(l) = build(
                &dir,
                &std::env::var("CXX").unwrap_or_else(|_| "c++".into()),
                "c++",
            ) {
                v.push(l);
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        eprintln!(
            "check.cuh built by: {:?}",
            v.iter().map(|l| &l.name).collect::<Vec<_>>()
        );
        v
    })
}

/// SplitMix64, for reproducible test points.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        ferroccl_core::numeric::splitmix64(&mut self.0)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn same_f64(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// `<T as Element>::from_f64`, the conversion fills use, as bits. (Not `store_f64`: inside it
/// the element type is concrete, so half's own inherent `from_f64` is called for f16 and bf16,
/// which rounds differently near the subnormals.)
fn rust_bits(d: DataType, v: f64) -> u64 {
    fn bits<T: Element>(v: f64) -> u64 {
        let x = T::from_f64(v);
        let mut b = [0u8; 8];
        // SAFETY: T is plain data of at most 8 bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &x as *const T as *const u8,
                b.as_mut_ptr(),
                std::mem::size_of::<T>(),
            )
        };
        u64::from_le_bytes(b)
    }
    match d {
        DataType::Int8 => bits::<i8>(v),
        DataType::Uint8 => bits::<u8>(v),
        DataType::Int32 => bits::<i32>(v),
        DataType::Uint32 => bits::<u32>(v),
        DataType::Int64 => bits::<i64>(v),
        DataType::Uint64 => bits::<u64>(v),
        DataType::Float16 => bits::<half::f16>(v),
        DataType::Float32 => bits::<f32>(v),
        DataType::Float64 => bits::<f64>(v),
        DataType::Bfloat16 => bits::<half::bf16>(v),
        DataType::Float8E4M3 => bits::<F8E4M3>(v),
        DataType::Float8E5M2 => bits::<F8E5M2>(v),
    }
}

fn rust_value(d: DataType, bits: u64) -> f64 {
    load_f64(d, &bits.to_le_bytes()[..d.size()], 0)
}

/// Values where conversions decide something: every code of the narrow types, the midpoints
/// between neighbours and the f64s right beside them, range limits, and random bit patterns.
fn conversion_inputs() -> Vec<f64> {
    let mut v = vec![
        0.0,
        -0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        -f64::NAN,
        f64::MIN_POSITIVE,
        5e-324,
        -5e-324,
        f64::MAX,
        f64::MIN,
        1e300,
        -1e300,
        1e-300,
        65504.0,
        65519.99,
        65520.0,
        448.0,
        449.0,
        464.0,
        57344.0,
        61440.0,
        1e-30,
        127.5,
        -128.5,
        255.5,
        256.0,
        -1.0,
        -0.5,
        0.5,
        0.99,
        -0.99,
    ];
    for e in [7, 8, 31, 32, 53, 63, 64] {
        let p = 2f64.powi(e);
        v.extend([
            p,
            -p,
            p - 1.0,
            -p - 1.0,
            p + 2048.0,
            -p - 2048.0,
            f64::from_bits(p.to_bits() - 1),
        ]);
    }
    for e in -160..=130 {
        let p = 2f64.powi(e);
        v.extend([p, -p, p * 1.5, p * 1.25, p * 1.0625, -p * 1.75]);
    }
    for d in [
        DataType::Float16,
        DataType::Bfloat16,
        DataType::Float8E4M3,
        DataType::Float8E5M2,
    ] {
        let codes = if d.size() == 1 {
            0..256u64
        } else {
            0..65536u64
        };
        let vals: Vec<f64> = codes
            .map(|c| rust_value(d, c))
            .filter(|x| x.is_finite())
            .collect();
        for w in vals.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            v.extend([
                w[0],
                mid,
                f64::from_bits(mid.to_bits() + 1),
                f64::from_bits(mid.to_bits().wrapping_sub(1)),
            ]);
        }
    }
    let mut rng = Rng(7);
    for _ in 0..20000 {
        v.push(f64::from_bits(rng.next()));
        let m = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        v.push(
            m * 2f64.powi(rng.below(80) as i32 - 30) * if rng.next() & 1 == 1 { -1.0 } else { 1.0 },
        );
    }
    v
}

#[test]
fn conversions_match_element_rs() {
    let libs = libs();
    if libs.is_empty() {
        eprintln!("conversions_match_element_rs: skipped: no C compiler");
        return;
    }
    let inputs = conversion_inputs();
    for lib in libs {
        for d in DataType::ALL {
            for &x in &inputs {
                let (c, r) = (lib.bits_of(d, x), rust_bits(d, x));
                // NaN payloads of f32/f64 are the hardware's business (no fill makes a NaN).
                let nan_ok = matches!(d, DataType::Float32 | DataType::Float64)
                    && x.is_nan()
                    && rust_value(d, c).is_nan();
                assert!(
                    c == r || nan_ok,
                    "{}: {d} from {x:e} ({:#x}): {c:#x}, Rust {r:#x}",
                    lib.name,
                    x.to_bits()
                );
            }
            let mut rng = Rng(d as u64);
            let bits: Vec<u64> = match d.size() {
                1 => (0..256).collect(),
                2 => (0..65536).collect(),
                _ => (0..100_000)
                    .map(|_| rng.next())
                    .chain(inputs.iter().map(|x| rust_bits(d, *x)))
                    .collect(),
            };
            for b in bits {
                let b = if d.size() == 8 {
                    b
                } else {
                    b & ((1u64 << (8 * d.size())) - 1)
                };
                let (c, r) = (lib.value_of(d, b), rust_value(d, b));
                assert!(
                    same_f64(c, r),
                    "{}: {d} bits {b:#x}: {c:e}, Rust {r:e}",
                    lib.name
                );
            }
        }
    }
}

fn ops_for(d: DataType) -> Vec<ReduceOp> {
    let mut ops = ReduceOp::BUILTIN.to_vec();
    let scalars: &[f64] = if d.is_float() {
        &[0.5, 3.0, -1.75, 0.3, 1000.0, 0.0]
    } else {
        &[3.0, -2.0, 0.0, 1000.0, 1.0]
    };
    ops.extend(
        scalars
            .iter()
            .map(|&s| ReduceOp::PreMulSum(s))
            .filter(|o| o.validate(d).is_ok()),
    );
    ops
}

/// Every (dtype, op, kind, nranks, rank, root, seed) the comparisons run over: reductions with
/// every op, data movement with one (the op does not matter to them).
fn cases(nranks: &[usize], seeds: u64) -> Vec<RankCase> {
    let mut v = Vec::new();
    let mut rng = Rng(11);
    for dtype in DataType::ALL {
        for op in ops_for(dtype) {
            for kind in CollKind::ALL {
                if !kind.reduces() && op != ReduceOp::Sum {
                    continue;
                }
                for &n in nranks {
                    let mut ranks = vec![0, n / 2, n - 1];
                    ranks.dedup();
                    for rank in ranks {
                        for s in 0..seeds {
                            // Half the cases are the root's.
                            let root = if s % 2 == 0 {
                                rank
                            } else {
                                rng.below(n as u64) as usize
                            };
                            let count = [1, 13, 40][rng.below(3) as usize];
                            v.push(RankCase {
                                kind,
                                dtype,
                                op,
                                nranks: n,
                                rank,
                                count,
                                root,
                                seed: rng.next(),
                            });
                        }
                    }
                }
            }
        }
    }
    v
}

/// (input, output) element counts of a case's buffers.
fn lens(c: &RankCase) -> (usize, usize) {
    c.kind
        .buffer_counts(c.count, c.nranks, c.kind.has_root() && c.rank == c.root)
        .unwrap()
}

#[test]
fn fill_and_expected_match_check_case() {
    let libs = libs();
    if libs.is_empty() {
        eprintln!("fill_and_expected_match_check_case: skipped: no C compiler");
        return;
    }
    let cases = cases(&[1, 2, 3, 4, 5, 8, 16, 33], 2);
    let mut checked = (0usize, 0usize);
    for lib in libs {
        for case in &cases {
            let (inl, outl) = lens(case);
            let w = case.dtype.size();
            let c = FcCheckCase::new(case, 0, inl as u64, 0).unwrap();
            let mut want = vec![0u8; inl * w];
            case.fill_input(&mut want);
            assert!(
                lib.fill(&c, 0, inl) == want,
                "{}: fill of {case:?}",
                lib.name
            );
            // Far indices, through the functions RankCase::fill_input calls.
            let first = (1u64 << 33) + case.seed % 1000;
            let mut far = vec![0u8; 8 * w];
            if case.kind.reduces() {
                fill_input(
                    case.dtype,
                    case.op,
                    case.nranks,
                    case.rank,
                    first as usize,
                    case.seed,
                    &mut far,
                );
            } else {
                fill_data(case.dtype, case.rank, first as usize, case.seed, &mut far);
            }
            assert!(
                lib.fill(&c, first, 8) == far,
                "{}: fill at {first} of {case:?}",
                lib.name
            );
            checked.0 += inl + 8;

            let c = FcCheckCase::new(case, 0, outl as u64, 0).unwrap();
            let far = (1u64 << 40) + case.seed % 977;
            for j in (0..outl as u64).chain([far, far + 1]) {
                let r = case.expected(j as usize);
                // With the key table the kernel keeps, whole or in part, and without.
                for nkeys in [1024, 2, 0] {
                    let g = lib.expected(&c, j, nkeys);
                    let ok = match (g, r) {
                        (Some(g), Some(r)) => g.to_bits() == r.to_bits(),
                        (None, None) => true,
                        _ => false,
                    };
                    assert!(
                        ok,
                        "{}: expected[{j}] of {case:?} with {nkeys} keys: {g:?}, Rust {r:?}",
                        lib.name
                    );
                }
                checked.1 += 1;
            }
        }
    }
    eprintln!(
        "{} cases: {} filled and {} expected elements agree",
        cases.len(),
        checked.0,
        checked.1
    );
}

#[test]
fn count_wrong_matches_check_case() {
    let libs = libs();
    if libs.is_empty() {
        eprintln!("count_wrong_matches_check_case: skipped: no C compiler");
        return;
    }
    let cases = cases(&[1, 3, 8], 2);
    let mut rng = Rng(5);
    let mut planted = 0u64;
    for lib in libs {
        for case in &cases {
            let (_, outl) = lens(case);
            let w = case.dtype.size();
            // The right output (rounded to the dtype where the expected value is not exact),
            // poison where the operation leaves it alone.
            let mut out = vec![0xA5u8; outl * w];
            for j in 0..outl {
                if let Some(v) = case.expected(j) {
                    store_f64(case.dtype, &mut out, j, v);
                }
            }
            let c = FcCheckCase::new(case, 0, outl as u64, 0).unwrap();
            for round in 0..4 {
                if round > 0 && outl > 0 {
                    // Nudged by one code (inside a tolerance or not), flipped high, random, NaN.
                    for _ in 0..1 + rng.below(3) {
                        let j = rng.below(outl as u64) as usize;
                        let e = &mut out[j * w..(j + 1) * w];
                        match rng.below(4) {
                            0 => e[0] ^= 1,
                            1 => e[w - 1] ^= 0x40,
                            2 => e.iter_mut().for_each(|b| *b = rng.next() as u8),
                            _ => e.iter_mut().for_each(|b| *b = 0xff),
                        }
                        planted += 1;
                    }
                }
                let mut first = None;
                let want = case.count_wrong(&out, &mut first) as u64;
                let got = lib.count(&c, &out);
                assert_eq!(got.wrong, want, "{}: {case:?} round {round}", lib.name);
                match first {
                    None => assert_eq!(got.first, u64::MAX, "{}: {case:?}", lib.name),
                    Some((j, g, x)) => {
                        assert_eq!(got.first, j as u64, "{}: {case:?}", lib.name);
                        assert!(
                            same_f64(got.got, g) && same_f64(got.want, x),
                            "{}: {case:?}: {got:?} vs {first:?}",
                            lib.name
                        );
                    }
                }
            }
        }
    }
    eprintln!(
        "{} cases, {planted} planted errors: counts agree",
        cases.len()
    );
}
