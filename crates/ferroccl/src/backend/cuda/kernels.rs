//! The CUDA C sources of the kernels and how NVRTC compiles them.
//!
//! Sources live in `kernels/*.cu` / `*.cuh` and are embedded at build time. NVRTC sees a single
//! translation unit: [`plan_exec_source`] splices our own headers (`#include "x.cuh"`) into the
//! `.cu` text, each once, with `#line` markers so that compiler messages name the real file and
//! line. System headers (`<cuda_fp16.h>` ...) are left to NVRTC and its include path. Splicing
//! keeps the whole program in one string, which is also what the on-disk kernel cache hashes.

#[cfg(test)]
use cudarc::nvrtc::CompileOptions;

/// Name of the plan-execution kernel (`extern "C"`, so unmangled).
pub(crate) const PLAN_EXEC_KERNEL: &str = "ferroccl_plan_exec";

/// The `.cu` file of the plan-execution kernel, before its headers are spliced in.
pub(crate) const PLAN_EXEC_SRC: &str = include_str!("kernels/plan_exec.cu");

/// Name stem of the peer engine's kernels, in their own module (`kernels/peer.cu`): see
/// `typed_kernel`.
pub(crate) const PEER_KERNELS: &str = "ferroccl_peer";
/// Name stem of the fold kernels of copy-and-fold reductions, in the peer engine's module
/// (`kernels/peer.cu`).
pub(crate) const FOLD_KERNELS: &str = "ferroccl_fold";
/// Name stem of the direct engine's kernels, in their own module (`kernels/direct.cu`).
pub(crate) const DIRECT_KERNELS: &str = "ferroccl_direct";

/// Name of the plan kernel's point-to-point form, in its module (`kernels/p2p.cuh`).
pub(crate) const P2P_KERNEL: &str = "ferroccl_p2p";
/// The same with room for more steps in its parameter.
pub(crate) const P2P_WIDE_KERNEL: &str = "ferroccl_p2p_wide";

/// Which operations an instance of an engine's kernel serves (`FC_SHAPE_*` and `shape_serves`
/// in `reduce.cuh`, the kernels' guard). The narrower its shape, the less code a launch of it
/// fetches, and a known reduction folds without a choice per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Every kind and reduction.
    Any,
    /// Every kind, with Sum or no reduction at all.
    Plain,
    /// All-reduce with Sum.
    AllReduceSum,
}

impl Shape {
    /// Whether this instance serves `kind` with `op`.
    pub(crate) fn serves(self, kind: ferroccl_core::CollKind, op: ferroccl_core::ReduceOp) -> bool {
        let sum = matches!(op, ferroccl_core::ReduceOp::Sum);
        match self {
            Shape::Any => true,
            Shape::Plain => sum || !kind.reduces(),
            Shape::AllReduceSum => sum && kind == ferroccl_core::CollKind::AllReduce,
        }
    }
    fn suffix(self) -> &'static str {
        match self {
            Shape::Any => "",
            Shape::Plain => "_plain",
            Shape::AllReduceSum => "_sum",
        }
    }
}

/// The instances of the direct engine's kernels, narrowest first.
pub(crate) const DIRECT_SHAPES: &[Shape] = &[Shape::AllReduceSum, Shape::Plain, Shape::Any];
/// The peer engine's, narrowest first (its loops choose the reduction once per piece anyway,
/// so a Plain instance would only save code, and NVRTC time on the longest compile).
pub(crate) const PEER_SHAPES: &[Shape] = &[Shape::AllReduceSum, Shape::Any];

/// The fold kernel's (a reduction always: Plain serves Sum).
pub(crate) const FOLD_SHAPES: &[Shape] = &[Shape::Plain, Shape::Any];

/// Name of an engine's (`stem`'s) kernel for elements of `dtype` (one per type, named as
/// nccl-tests names the type) in `shape`.
pub(crate) fn typed_kernel(stem: &str, dtype: ferroccl_core::DataType, shape: Shape) -> String {
    format!("{stem}_{}{}", dtype.name(), shape.suffix())
}

/// The `.cu` file of the direct engine (one-shot collectives).
pub(crate) const DIRECT_SRC: &str = include_str!("kernels/direct.cu");

/// The `.cu` file of the peer engine (collectives in rounds through peer-mapped staging).
pub(crate) const PEER_SRC: &str = include_str!("kernels/peer.cu");

/// The peer engine's kernels come in this many modules, each the kernels of every
/// `PEER_PARTS`-th type (`FC_TYPE_PART` in `reduce.cuh`, which must agree): NVRTC compiles one
/// module on one thread, and the peer engine's was the longest compile by far (its 48 typed
/// kernels about 200 s on one of CI's cores, 90 s on the GPU machine's), so its parts compile
/// at once on as many threads as the machine has.
pub(crate) const PEER_PARTS: usize = 4;

/// The part of the peer engine's kernels that holds `dtype`'s (see [`PEER_PARTS`]).
pub(crate) fn peer_part(dtype: ferroccl_core::DataType) -> usize {
    dtype.nccl_id() as usize % PEER_PARTS
}

/// The name and extra options NVRTC compiles part `part` of the peer engine's module with.
pub(crate) fn peer_part_compile(part: usize) -> (String, Vec<String>) {
    (
        format!("peer.cu part {part}"),
        vec![format!("-DFC_TYPE_PART={part}")],
    )
}

/// The `.cu` file of the GPU checker's kernels (`verify.rs`).
pub(crate) const CHECK_SRC: &str = include_str!("kernels/check.cu");

/// Our headers, by the name the sources include them with.
pub(crate) const HEADERS: &[(&str, &str)] = &[
    ("ints.cuh", include_str!("kernels/ints.cuh")),
    ("types.cuh", include_str!("kernels/types.cuh")),
    ("fifo.cuh", include_str!("kernels/fifo.cuh")),
    ("reduce.cuh", include_str!("kernels/reduce.cuh")),
    ("p2p.cuh", include_str!("kernels/p2p.cuh")),
    ("check.cuh", include_str!("kernels/check.cuh")),
];

/// Threads per block the kernel is compiled to allow (`__launch_bounds__`); launch with at most
/// this many. At 1024, ptxas had 64 registers and spilled thread 0's lane state (298 bytes of
/// spill stores); at 512 it uses 122 and spills nothing, and every launch uses 512 anyway.
pub(crate) const PLAN_EXEC_MAX_THREADS: u32 = 512;
pub(crate) const PLAN_EXEC_DEFAULT_THREADS: u32 = 512;

/// The plan-execution kernel as one self-contained source for NVRTC.
pub(crate) fn plan_exec_source() -> String {
    spliced("plan_exec.cu", PLAN_EXEC_SRC)
}

/// The direct engine's kernels as one self-contained source for NVRTC.
pub(crate) fn direct_source() -> String {
    spliced("direct.cu", DIRECT_SRC)
}

/// The peer engine's kernels as one self-contained source for NVRTC.
pub(crate) fn peer_source() -> String {
    spliced("peer.cu", PEER_SRC)
}

/// The GPU checker's kernels as one self-contained source for NVRTC.
pub(crate) fn check_source() -> String {
    spliced("check.cu", CHECK_SRC)
}

fn spliced(name: &str, text: &str) -> String {
    let mut out =
        String::with_capacity(text.len() + HEADERS.iter().map(|h| h.1.len() + 64).sum::<usize>());
    let mut seen = Vec::new();
    splice(&mut out, name, text, &mut seen);
    out
}

/// The header a line includes with quotes, if it is one of ours.
fn quoted_include(line: &str) -> Option<&'static (&'static str, &'static str)> {
    let rest = line
        .trim_start()
        .strip_prefix('#')?
        .trim_start()
        .strip_prefix("include")?
        .trim();
    let name = rest.strip_prefix('"')?.split('"').next()?;
    HEADERS.iter().find(|h| h.0 == name)
}

fn splice(out: &mut String, name: &str, text: &str, seen: &mut Vec<&'static str>) {
    out.push_str(&format!("#line 1 \"{name}\"\n"));
    let total = text.lines().count();
    for (i, line) in text.lines().enumerate() {
        if let Some(&(h, body)) = quoted_include(line) {
            // `#pragma once` would do the same inside NVRTC; skipping repeats here keeps the
            // spliced text free of duplicate definitions whatever the compiler does with it.
            if !seen.contains(&h) {
                seen.push(h);
                splice(out, h, body, seen);
            }
            // (No marker after an include on the file's last line: it would name a line past
            // the end.)
            if i + 1 < total {
                out.push_str(&format!("#line {} \"{name}\"\n", i + 2));
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
}

/// A kernel source compiled for `gpu` by NVRTC with the project's flags and `extra` options
/// (a module's part: [`peer_part_compile`]), through the disk cache.
pub(crate) fn compile_for(
    gpu: &crate::cuda::Gpu,
    config: &ferroccl_core::Config,
    name: &str,
    source: &str,
    extra: &[String],
) -> Result<crate::cuda::nvrtc::Image, ferroccl_core::Error> {
    use crate::cuda::nvrtc;
    let arch = gpu.arch();
    let mut options = nvrtc_flags();
    options.extend(extra.iter().cloned());
    options.extend(config.kernel_defines.iter().cloned());
    let req = nvrtc::CompileRequest {
        name,
        source,
        arch: &arch,
        include_dirs: &config.cuda_include,
        options: &options,
    };
    let cache = config.kernel_cache.clone().map(nvrtc::KernelCache::new);
    nvrtc::compile_cached(&req, cache.as_ref())
}

/// The flags of [`compile_options`] as NVRTC command-line options, for `nvrtc::compile`
/// (which adds the architecture and include directories itself).
pub(crate) fn nvrtc_flags() -> Vec<String> {
    crate::cuda::nvrtc::EXACT_OPTIONS
        .iter()
        .map(|s| s.to_string())
        .chain(std::iter::once(format!(
            "-DFC_MAX_THREADS={PLAN_EXEC_MAX_THREADS}"
        )))
        .collect()
}

/// NVRTC options for `arch` (e.g. "sm_90"). `cuda_include` holds the folders with `cuda_fp16.h`,
/// `cuda_bf16.h` and `cuda_fp8.h` (`Config::cuda_include`).
///
/// No fast-math, no flush-to-zero, no FMA contraction: results must equal the host reduction
/// bit for bit (the kernel also uses the `_rn` intrinsics, so this is belt and braces).
#[cfg(test)]
pub(crate) fn compile_options(
    arch: &'static str,
    cuda_include: &[std::path::PathBuf],
) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        arch: Some(arch),
        include_paths: cuda_include
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect(),
        options: vec![
            "--std=c++17".into(),
            "-default-device".into(),
            format!("-DFC_MAX_THREADS={PLAN_EXEC_MAX_THREADS}"),
        ],
        name: Some("plan_exec.cu".into()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_operation_takes_the_narrowest_instance_that_serves_it() {
        use ferroccl_core::{CollKind, ReduceOp};
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
            ReduceOp::PreMulSum(2.0),
        ];
        for shapes in [DIRECT_SHAPES, PEER_SHAPES] {
            assert_eq!(
                shapes.last(),
                Some(&Shape::Any),
                "every operation has an instance"
            );
            for kind in CollKind::COLLECTIVES {
                for op in ops {
                    let pick = shapes.iter().find(|s| s.serves(kind, op)).unwrap();
                    let sum = matches!(op, ReduceOp::Sum);
                    let want = if kind == CollKind::AllReduce && sum {
                        Shape::AllReduceSum
                    } else if shapes.contains(&Shape::Plain) && (sum || !kind.reduces()) {
                        Shape::Plain
                    } else {
                        Shape::Any
                    };
                    assert_eq!(*pick, want, "{kind} {op:?}");
                }
            }
        }
        // A reducing kind with another reduction never takes a Sum instance.
        assert!(!Shape::Plain.serves(CollKind::ReduceScatter, ReduceOp::Max));
        assert!(!Shape::AllReduceSum.serves(CollKind::AllReduce, ReduceOp::Avg));
        assert!(Shape::Plain.serves(CollKind::AllGather, ReduceOp::Max));
    }

    /// `reduce.cuh` puts each type's kernels in the part `peer_part` loads them from, in as many
    /// parts as `PEER_PARTS` says: a type in the wrong part would fail every communicator's
    /// start (its kernel not found in that module).
    #[test]
    fn the_headers_type_parts_agree_with_the_loader() {
        let reduce = HEADERS
            .iter()
            .find(|h| h.0 == "reduce.cuh")
            .expect("reduce.cuh")
            .1;
        let parts: usize = reduce
            .lines()
            .find_map(|l| l.strip_prefix("#define FC_TYPE_PARTS "))
            .expect("FC_TYPE_PARTS")
            .trim()
            .parse()
            .expect("a number");
        assert_eq!(parts, PEER_PARTS);
        let mut seen = Vec::new();
        for l in reduce.lines() {
            let Some(rest) = l.trim().strip_prefix("FC_IN_PART") else {
                continue;
            };
            let Some((part, rest)) = rest.split_once("(X(") else {
                continue;
            };
            let part: usize = part.parse().expect("a part number");
            let name = rest.split(',').next().expect("a type name");
            let t = ferroccl_core::DataType::ALL
                .into_iter()
                .find(|t| t.name() == name)
                .unwrap_or_else(|| panic!("{name} is no type"));
            assert_eq!(peer_part(t), part, "{name}");
            seen.push(t);
        }
        assert_eq!(seen.len(), ferroccl_core::DataType::ALL.len(), "{seen:?}");
        for t in ferroccl_core::DataType::ALL {
            assert!(seen.contains(&t), "{t:?} in no part");
        }
    }

    #[test]
    fn splicing_inlines_each_header_once() {
        for (src, uses) in [
            (
                plan_exec_source(),
                &["ints.cuh", "types.cuh", "fifo.cuh", "reduce.cuh", "p2p.cuh"][..],
            ),
            (
                peer_source(),
                &["ints.cuh", "types.cuh", "fifo.cuh", "reduce.cuh"][..],
            ),
            (
                direct_source(),
                &["ints.cuh", "types.cuh", "fifo.cuh", "reduce.cuh"][..],
            ),
            (check_source(), &["ints.cuh", "check.cuh"][..]),
        ] {
            assert!(
                !src.lines().any(|l| quoted_include(l).is_some()),
                "a quoted include survived"
            );
            for (name, body) in HEADERS {
                let want = uses.contains(name) as usize;
                assert_eq!(
                    src.matches(&format!("#line 1 \"{name}\"")).count(),
                    want,
                    "{name}"
                );
                if want == 1 {
                    assert!(src.contains(
                        body.lines()
                            .find(|l| l.starts_with("#pragma once"))
                            .unwrap_or("")
                    ));
                }
            }
        }
        let src = plan_exec_source();
        assert!(src.contains("#include <cuda_fp8.h>"));
        assert!(src.contains(&format!(
            "void __launch_bounds__(FC_MAX_THREADS, 1) {PLAN_EXEC_KERNEL}("
        )));
    }

    #[test]
    fn line_markers_point_back_into_the_cu_file() {
        let src = plan_exec_source();
        // After the last header, the next line must be the .cu line right after its include.
        let cu: Vec<&str> = PLAN_EXEC_SRC.lines().collect();
        let lines: Vec<&str> = src.lines().collect();
        let last = lines
            .iter()
            .rposition(|l| l.starts_with("#line ") && l.ends_with("\"plan_exec.cu\""))
            .unwrap();
        let n: usize = lines[last]
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(lines[last + 1], cu[n - 1]);
    }

    /// Avg's division (reduce.cuh's `divn`, every element type) compiled for the CPU by the
    /// system's C++ compiler (`$CXX`, else `c++`), with the CUDA intrinsics it uses mapped to
    /// their IEEE round-to-nearest equivalents, must give the quotient the host computes (the
    /// dividend widened to 64 bits, integers truncated toward zero, floats divided and rounded
    /// once): integers for every rank count from 1 to 1100 and a few up to 2^31 (every 8-bit
    /// value, edge and random 32- and 64-bit ones), floats and doubles for 16 counts, powers of
    /// two up to 2^31 among them (random bit patterns, subnormals and infinities included, NaN
    /// aside). What it tests is the shift and reciprocal paths and the 32-bit divisions; a
    /// non-power-of-two float or 64-bit count divides as the reference does.
    #[test]
    fn avg_division_gives_the_hosts_quotient_for_every_type_and_rank_count() {
        let out = run_cpp(
            "divn",
            &DIVN_HARNESS.replace(
                "@DIVN@",
                reduce_part(
                    "__device__ __forceinline__ bool pow2n",
                    "__ddiv_rn(a, (double)n);\n}",
                ),
            ),
        );
        assert!(out.contains("bad 0"), "{out}");
    }

    /// The text of reduce.cuh from `first` to the end of `last`.
    fn reduce_part(first: &str, last: &str) -> &'static str {
        let reduce = HEADERS.iter().find(|(n, _)| *n == "reduce.cuh").unwrap().1;
        let a = reduce.find(first).expect(first);
        let b = reduce[a..].find(last).expect(last) + a + last.len();
        &reduce[a..b]
    }

    /// Compiles `src` with the system's C++ compiler (`$CXX`, else `c++`), runs it, and gives
    /// what it printed; panics if either step fails (the program's exit status included).
    fn run_cpp(name: &str, src: &str) -> String {
        let dir = std::env::temp_dir().join(format!("ferroccl-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join(format!("{name}.cpp"));
        std::fs::write(&file, src).unwrap();
        let exe = dir.join(name);
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let cc = std::process::Command::new(&cxx)
            .args(["-O2", "-std=c++17", "-o"])
            .arg(&exe)
            .arg(&file)
            .output();
        let run = cc
            .as_ref()
            .ok()
            .filter(|c| c.status.success())
            .map(|_| std::process::Command::new(&exe).output());
        std::fs::remove_dir_all(&dir).ok();
        let cc = cc.unwrap_or_else(|e| panic!("a C++ compiler ({cxx}) to run: {e}"));
        assert!(
            cc.status.success(),
            "{}",
            String::from_utf8_lossy(&cc.stderr)
        );
        let run = run.expect("compiled").expect("the compiled test ran");
        let out = String::from_utf8_lossy(&run.stdout).into_owned();
        assert!(run.status.success(), "{out}");
        out
    }

    /// The 8-bit integers' packed arithmetic (reduce.cuh's `bytes_` functions: four bytes to a
    /// 32-bit word, which the folds of int8 and uint8 use) compiled for the CPU must give, in
    /// every byte of the word, what one byte alone gives (the host's arithmetic: wrapping sums and
    /// products by a scalar, signed and unsigned max and min, quotients truncated toward zero): every pair of
    /// bytes in each of the four positions, the other three bytes random, every scalar for the
    /// pre-multiplication and every power-of-two divisor from 1 to 2^9.
    #[test]
    fn packed_bytes_give_each_bytes_own_result() {
        let out = run_cpp(
            "bytes",
            &BYTES_HARNESS.replace(
                "@BYTES@",
                reduce_part(
                    "#define FC_BYTES_TOP",
                    "// (end of the part compiled for the CPU)",
                ),
            ),
        );
        assert!(out.contains("bad 0"), "{out}");
        // Every pair, position, scalar and divisor (the harness counts what it compared).
        assert!(out.contains("checked 93323264,"), "{out}");
    }

    const BYTES_HARNESS: &str = r#"
#include <cstdint>
#include <cstdio>
#include <random>
typedef unsigned fc_u32;
#define __device__
#define __forceinline__ inline
@BYTES@
static fc_u32 put(fc_u32 w, int j, fc_u32 b) { return (w & ~(0xffu << (8 * j))) | ((b & 0xffu) << (8 * j)); }
static fc_u32 at(fc_u32 w, int j) { return (w >> (8 * j)) & 0xffu; }
static int s8(fc_u32 b) { return (int)(signed char)(unsigned char)b; }
int main() {
    long bad = 0, checked = 0;
    std::mt19937 rng(11);
    for (int j = 0; j < 4; j++)
        for (fc_u32 a = 0; a < 256; a++)
            for (fc_u32 b = 0; b < 256; b++) {
                const fc_u32 x = put((fc_u32)rng(), j, a), y = put((fc_u32)rng(), j, b);
                // Every byte of the word is checked, the random ones too (a carry or a borrow
                // out of a byte shows in its neighbour).
                for (int i = 0; i < 4; i++) {
                    const fc_u32 p = at(x, i), q = at(y, i);
                    const int sp = s8(p), sq = s8(q);
                    bad += at(bytes_add(x, y), i) != ((p + q) & 0xffu);
                    bad += at(bytes_max<false>(x, y), i) != (p > q ? p : q);
                    bad += at(bytes_min<false>(x, y), i) != (p < q ? p : q);
                    bad += at(bytes_max<true>(x, y), i) != ((fc_u32)(sp > sq ? sp : sq) & 0xffu);
                    bad += at(bytes_min<true>(x, y), i) != ((fc_u32)(sp < sq ? sp : sq) & 0xffu);
                    checked += 5;
                }
                for (fc_u32 s = 0; s < 256; s++) {
                    bad += at(bytes_mul_by(x, s), j) != ((a * s) & 0xffu);
                    checked++;
                }
                for (int sh = 0; sh <= 9; sh++) {
                    const int n = 1 << sh;
                    for (int i = 0; i < 4; i++) {
                        bad += at(bytes_div_pow2<false>(x, sh), i) != at(x, i) / (fc_u32)n;
                        bad += at(bytes_div_pow2<true>(x, sh), i) != ((fc_u32)(s8(at(x, i)) / n) & 0xffu);
                        checked += 2;
                    }
                }
            }
    printf("checked %ld, bad %ld\n", checked, bad);
    return bad != 0;
}
"#;

    const DIVN_HARNESS: &str = r#"
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <random>
typedef signed char fc_i8; typedef unsigned char fc_u8; typedef int fc_i32; typedef unsigned fc_u32;
typedef long long fc_i64; typedef unsigned long long fc_u64;
#define __device__
#define __forceinline__ inline
static int __ffs(int x) { return __builtin_ffs(x); }
static float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static double __longlong_as_double(long long i) { double f; memcpy(&f, &i, 8); return f; }
static float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
static double __ddiv_rn(double a, double b) { volatile double r = a / b; return r; }
@DIVN@
static uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static uint64_t dbits(double f) { uint64_t u; memcpy(&u, &f, 8); return u; }
int main() {
    long bad = 0, checked = 0;
    std::mt19937_64 rng(7);
    const unsigned far[] = {65535, 65536, 65537, 1u << 20, (1u << 31) - 1, 1u << 31};
    for (unsigned i = 1; i <= 1100 + 6; i++) {
        const unsigned n = i <= 1100 ? i : far[i - 1101];
        for (int a = -128; a < 128; a++, checked++) bad += divn((fc_i8)a, n) != (fc_i8)((fc_i64)a / (fc_i64)n);
        for (int a = 0; a < 256; a++, checked++) bad += divn((fc_u8)a, n) != (fc_u8)((fc_u64)a / (fc_u64)n);
        const fc_i32 e32[] = {INT32_MIN, INT32_MIN + 1, -1, 0, 1, INT32_MAX, -(fc_i32)n, (fc_i32)n};
        const fc_i64 e64[] = {INT64_MIN, INT64_MIN + 1, -1, 0, 1, INT64_MAX, -(fc_i64)n, (fc_i64)n};
        for (int k = 0; k < 2000; k++, checked += 4) {
            fc_i32 a = k < 8 ? e32[k] : (fc_i32)rng();
            fc_i64 l = k < 8 ? e64[k] : (fc_i64)rng();
            fc_u32 u = (fc_u32)rng();
            fc_u64 v = rng();
            bad += divn(a, n) != (fc_i32)((fc_i64)a / (fc_i64)n);
            bad += divn(u, n) != (fc_u32)((fc_u64)u / (fc_u64)n);
            bad += divn(l, n) != l / (fc_i64)n;
            bad += divn(v, n) != v / (fc_u64)n;
        }
    }
    const unsigned ns[] = {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 64, 128, 1024, 65536, 1u << 20, 1u << 31};
    for (unsigned n : ns) {
        for (int k = 0; k < 200000; k++) {
            uint32_t fb = k < 1000 ? (uint32_t)k : (uint32_t)rng();
            uint64_t db = k < 1000 ? (uint64_t)k : rng();
            float a; memcpy(&a, &fb, 4);
            double d; memcpy(&d, &db, 8);
            if (!std::isnan(a)) { checked++; bad += fbits(divn(a, n)) != fbits(__fdiv_rn(a, (float)n)); }
            if (!std::isnan(d)) { checked++; bad += dbits(divn(d, n)) != dbits(__ddiv_rn(d, (double)n)); }
        }
    }
    printf("checked %ld, bad %ld\n", checked, bad);
    return bad != 0;
}
"#;

    /// A line round's error record names the round a stale line held by multiplying its flag
    /// (salt removed) by the inverse of the flag's multiplier: the two constants in peer.cu must
    /// stay each other's inverse mod 2^64, or the record names a wrong round.
    #[test]
    fn the_line_record_inverts_the_line_flags_multiplier() {
        let constant_after = |marker: &str| -> u64 {
            let at = PEER_SRC.find(marker).expect(marker) + marker.len();
            let rest = &PEER_SRC[at..];
            let hex = rest.trim_start().trim_start_matches("0x");
            let end = hex.find(|c: char| !c.is_ascii_hexdigit()).unwrap();
            u64::from_str_radix(&hex[..end], 16).unwrap()
        };
        let mul = constant_after("return P.lines ^ (s *");
        let inv = constant_after("return (flag ^ P.lines) *");
        assert_eq!(mul.wrapping_mul(inv), 1, "{mul:#x} x {inv:#x}");
        // A flag of round s made with any salt reads back as s.
        let salt = 0x1234_5678_9abc_def1u64;
        for s in [0u64, 1, 2, 1 << 40, u64::MAX] {
            assert_eq!(((salt ^ s.wrapping_mul(mul)) ^ salt).wrapping_mul(inv), s);
        }
    }

    /// Compiles the kernel for sm_90 through NVRTC. Needs libnvrtc on the loader path and the
    /// CUDA headers (FERROCCL_CUDA_INCLUDE or /usr/local/cuda/include).
    #[test]
    #[ignore = "needs libnvrtc and CUDA's headers (README: NVRTC)"]
    fn kernels_compile_with_nvrtc() {
        let include = ferroccl_core::Config::from_env()
            .expect("a valid environment")
            .cuda_include;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers; the library is present.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        let compile = |name: &str, src: String, extra: &[String]| {
            let t = std::time::Instant::now();
            let mut options = compile_options("sm_90", &include);
            options.options.extend(extra.iter().cloned());
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, options)
                .unwrap_or_else(|e| match e {
                    cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                        panic!("NVRTC rejected {name}:\n{}", log.to_string_lossy())
                    }
                    e => panic!("NVRTC failed on {name}: {e:?}"),
                })
                .to_src();
            eprintln!(
                "NVRTC {major}.{minor}: {name} -> {} bytes of PTX in {:?}",
                ptx.len(),
                t.elapsed()
            );
            ptx
        };
        // Every module at once, the peer engine's in its parts, as a communicator compiles them
        // (each NVRTC compile runs on one thread): on CI's 2 cores the test waits for about half
        // their sum.
        let (ptx, direct, parts) = std::thread::scope(|s| {
            let direct = s.spawn(|| compile("direct.cu", direct_source(), &[]));
            let parts: Vec<_> = (0..PEER_PARTS)
                .map(|part| {
                    s.spawn(move || {
                        let (name, extra) = peer_part_compile(part);
                        compile(&name, peer_source(), &extra)
                    })
                })
                .collect();
            let plan = compile("plan_exec.cu", plan_exec_source(), &[]);
            let join = |h: std::thread::ScopedJoinHandle<'_, String>| {
                h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
            };
            let parts: Vec<String> = parts.into_iter().map(join).collect();
            (plan, join(direct), parts)
        });
        assert!(
            ptx.contains(&format!(".entry {PLAN_EXEC_KERNEL}(")),
            "no entry {PLAN_EXEC_KERNEL} in the PTX"
        );
        assert!(ptx.contains(".target sm_90"));
        // The FIFO protocol's ordering lives in these instructions; losing one is a silent race.
        assert!(ptx.contains("ld.acquire.sys.global.u64"));
        assert!(ptx.contains("st.release.sys.global.u64"));
        assert!(ptx.contains("%globaltimer"));
        // The point-to-point form shares the module.
        assert!(
            ptx.contains(&format!(".entry {P2P_KERNEL}(")),
            "no entry {P2P_KERNEL} in the PTX"
        );
        assert!(
            ptx.contains(&format!(".entry {P2P_WIDE_KERNEL}(")),
            "no entry {P2P_WIDE_KERNEL} in the PTX"
        );
        // Each engine's kernels: one per type, and one per type for all-reduces with Sum; the
        // peer engine's each in its type's part, and in no other.
        let typed = |stem: &str, shapes: &[Shape], part: Option<usize>| -> Vec<String> {
            ferroccl_core::DataType::ALL
                .iter()
                .filter(|&&t| part.is_none_or(|p| peer_part(t) == p))
                .flat_map(|&t| shapes.iter().map(move |&s| typed_kernel(stem, t, s)))
                .collect()
        };
        let direct_entries = typed(DIRECT_KERNELS, DIRECT_SHAPES, None);
        let plan_entries = vec![
            PLAN_EXEC_KERNEL.to_string(),
            P2P_KERNEL.to_string(),
            P2P_WIDE_KERNEL.to_string(),
        ];
        let mut modules: Vec<(&String, Vec<String>)> =
            vec![(&ptx, plan_entries), (&direct, direct_entries)];
        for (part, peer) in parts.iter().enumerate() {
            let mut entries = typed(PEER_KERNELS, PEER_SHAPES, Some(part));
            entries.extend(typed(FOLD_KERNELS, FOLD_SHAPES, Some(part)));
            let mut others = typed(PEER_KERNELS, PEER_SHAPES, None);
            others.extend(typed(FOLD_KERNELS, FOLD_SHAPES, None));
            others.retain(|e| !entries.contains(e));
            for e in &others {
                assert!(
                    !peer.contains(&format!(".entry {e}(")),
                    "{e} in part {part}"
                );
            }
            modules.push((peer, entries));
        }
        for (src, entries) in &modules {
            for e in entries {
                assert!(src.contains(&format!(".entry {e}(")), "no entry {e}");
            }
        }
        // The peer engine's flags are released after the block's stores and acquired by the
        // receivers.
        for peer in &parts {
            assert!(
                peer.contains("st.release.sys.global.u64")
                    && peer.contains("ld.acquire.sys.global.u64")
            );
        }
        // The epochs' acknowledgements are system-scope stores (relaxed: the kernel boundary
        // orders them), read with acquire; LL lines are 16-byte volatile stores.
        assert!(
            direct.contains("st.relaxed.sys.global.u64")
                && direct.contains("ld.acquire.sys.global.u64")
        );
        assert!(direct.contains("st.volatile.global.v4.u32"));
        // Every engine's kernel is launched to start early on sm_90: each must wait for the
        // kernel ahead of it before its first access to memory (a missing wait is a silent race
        // with the caller's producer kernel).
        for (src, entries) in &modules {
            for e in entries {
                let body = &src[src.find(&format!(".entry {e}(")).expect("entry")..];
                let body = &body[..body.find("\n}\n").unwrap_or(body.len())];
                let wait = body
                    .find("griddepcontrol.wait")
                    .unwrap_or_else(|| panic!("{e} never waits for the kernel ahead"));
                let first_load = body
                    .find("ld.global")
                    .or(body.find("ld.volatile.global"))
                    .unwrap_or(usize::MAX);
                assert!(
                    wait < first_load,
                    "{e} reads global memory before it waits for the kernel ahead"
                );
            }
        }
    }
}

/// Runs the kernel for real: several ranks of a ring all-reduce as concurrent launches on one
/// GPU, their FIFOs in that GPU's memory, checked byte for byte against the host Reducer for
/// every dtype and op; then a lone rank that must time out with a complete error record.
/// Skips unless FERROCCL_GPU_TEST=1 (needs a GPU, libcuda, libnvrtc, FERROCCL_CUDA_INCLUDE).
#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::backend::cuda::tables::*;
    use cudarc::driver::{
        result as drv, CudaContext, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use ferroccl_core::algo::{build, Algo, CollDesc, Tuning};
    use ferroccl_core::numeric::{Element, Reducer};
    use ferroccl_core::plan::zcopy::remote_dsts;
    use ferroccl_core::plan::{ConnKey, Dir, Plan};
    use ferroccl_core::{CollKind, DataType, ReduceOp};
    use std::collections::HashMap;
    use std::sync::Arc;

    // SAFETY: plain #[repr(C)] data of integers, passed by value as the kernel's parameter.
    unsafe impl DeviceRepr for FcLaunch {}

    /// Bump allocator over one device allocation, so that no per-buffer tracking by cudarc
    /// orders the ranks' streams against each other.
    struct Arena {
        base: u64,
        used: u64,
        cap: u64,
    }
    impl Arena {
        fn take(&mut self, bytes: usize) -> u64 {
            let at = self.base + self.used;
            self.used += (bytes as u64).div_ceil(256) * 256;
            assert!(self.used <= self.cap);
            at
        }
        fn put<T>(&mut self, v: &[T]) -> u64 {
            let at = self.take(std::mem::size_of_val(v).max(1));
            unsafe { drv::memcpy_htod_sync(at, v) }.unwrap();
            at
        }
    }

    fn bytes_of<T: Element>(vals: &[f64]) -> Vec<u8> {
        let v: Vec<T> = vals.iter().map(|&x| T::from_f64(x)).collect();
        // SAFETY: element types are plain data.
        unsafe {
            std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(&v[..]))
        }
        .to_vec()
    }
    fn to_bytes(d: DataType, vals: &[f64]) -> Vec<u8> {
        use ferroccl_core::numeric::{F8E4M3, F8E5M2};
        match d {
            DataType::Int8 => bytes_of::<i8>(vals),
            DataType::Uint8 => bytes_of::<u8>(vals),
            DataType::Int32 => bytes_of::<i32>(vals),
            DataType::Uint32 => bytes_of::<u32>(vals),
            DataType::Int64 => bytes_of::<i64>(vals),
            DataType::Uint64 => bytes_of::<u64>(vals),
            DataType::Float16 => bytes_of::<half::f16>(vals),
            DataType::Float32 => bytes_of::<f32>(vals),
            DataType::Float64 => bytes_of::<f64>(vals),
            DataType::Bfloat16 => bytes_of::<half::bf16>(vals),
            DataType::Float8E4M3 => bytes_of::<F8E4M3>(vals),
            DataType::Float8E5M2 => bytes_of::<F8E5M2>(vals),
        }
    }

    struct Gpu {
        ctx: Arc<CudaContext>,
        func: cudarc::driver::CudaFunction,
    }

    fn gpu() -> Option<Gpu> {
        if std::env::var("FERROCCL_GPU_TEST").ok().as_deref() != Some("1") {
            eprintln!("gpu test skipped: FERROCCL_GPU_TEST is not 1");
            return None;
        }
        let include = ferroccl_core::Config::from_env()
            .expect("a valid environment")
            .cuda_include;
        let ctx = CudaContext::new(0).unwrap();
        // SAFETY: the test orders everything itself (synchronous copies, explicit syncs).
        unsafe { ctx.disable_event_tracking() };
        let t = std::time::Instant::now();
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(
            plan_exec_source(),
            compile_options("sm_90", &include),
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        let t_nvrtc = t.elapsed();
        let module = ctx.load_module(ptx).unwrap();
        let func = module.load_function(PLAN_EXEC_KERNEL).unwrap();
        eprintln!("NVRTC {t_nvrtc:?}, module load {:?}", t.elapsed() - t_nvrtc);
        Some(Gpu { ctx, func })
    }

    const SLOTS: u32 = 4;
    const SLOT_BYTES: u32 = 256;

    /// FIFOs for every connection of every plan, laid out in `arena`; returns each rank's
    /// FcConn table and numbering.
    fn make_conns(
        arena: &mut Arena,
        plans: &[Plan],
        slot_bytes: u32,
    ) -> Vec<(Vec<FcConn>, Vec<ConnKey>)> {
        // One FIFO per (sender, receiver, channel).
        let mut fifos: HashMap<(usize, usize, u32), FcConn> = HashMap::new();
        for p in plans {
            for k in p.connections() {
                let (s, r) = if k.dir == Dir::Send {
                    (p.rank, k.peer)
                } else {
                    (k.peer, p.rank)
                };
                fifos.entry((s, r, k.channel)).or_insert_with(|| FcConn {
                    data: arena.take((SLOTS * slot_bytes) as usize),
                    lens: arena.put(&[0u32; SLOTS as usize]),
                    head: arena.put(&[0u64]),
                    tail: arena.put(&[0u64]),
                    counter: 0,
                    slots: SLOTS,
                    slot_bytes,
                    peer: 0,
                    dir: 0,
                    ll: arena.take(SLOTS as usize * 2 * LL_DATA_BYTES),
                    post: arena.put(&[0u64; 3]),
                });
            }
        }
        let mut counters: HashMap<(usize, usize, u32, Dir), u64> = HashMap::new();
        plans
            .iter()
            .map(|p| {
                let keys = p.connections();
                let table = keys
                    .iter()
                    .map(|k| {
                        let (s, r) = if k.dir == Dir::Send {
                            (p.rank, k.peer)
                        } else {
                            (k.peer, p.rank)
                        };
                        let mut c = fifos[&(s, r, k.channel)];
                        c.peer = k.peer as u32;
                        c.dir = if k.dir == Dir::Send {
                            CONN_SEND
                        } else {
                            CONN_RECV
                        };
                        c.counter = *counters
                            .entry((s, r, k.channel, k.dir))
                            .or_insert_with(|| arena.put(&[0u64]));
                        c
                    })
                    .collect();
                (table, keys)
            })
            .collect()
    }

    struct RankRun {
        launch: FcLaunch,
        nlanes: u32,
        out: u64,
        error: u64,
    }

    fn launch_all(g: &Gpu, streams: &[Arc<CudaStream>], runs: &[RankRun]) {
        // Synchronous copies from pageable memory may still be in flight on the legacy stream,
        // which the ranks' streams do not wait for.
        g.ctx.synchronize().unwrap();
        for (r, s) in runs.iter().zip(streams) {
            let cfg = LaunchConfig {
                grid_dim: (r.nlanes, 1, 1),
                block_dim: (PLAN_EXEC_DEFAULT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = s.launch_builder(&g.func);
            b.arg(&r.launch);
            unsafe { b.launch(cfg) }.unwrap();
        }
        for s in streams {
            s.synchronize().unwrap();
        }
    }

    fn read_error(at: u64) -> FcError {
        let mut e = [FcError::default()];
        unsafe { drv::memcpy_dtoh_sync(&mut e, at) }.unwrap();
        e[0]
    }

    #[test]
    #[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --lib gpu_ -- --ignored"]
    fn gpu_ring_all_reduce_matches_host() {
        let Some(g) = gpu() else { return };
        let nranks = 3;
        let count = 4099; // odd: exercises scalar tails and uneven chunks
        let streams: Vec<_> = (0..nranks).map(|_| g.ctx.new_stream().unwrap()).collect();
        let mut ops: Vec<ReduceOp> = ReduceOp::BUILTIN.to_vec();
        ops.push(ReduceOp::PreMulSum(2.0));
        let mut checked = 0;
        let arena_bytes = 64 << 20;
        let arena_alloc = g
            .ctx
            .default_stream()
            .alloc_zeros::<u8>(arena_bytes)
            .unwrap();
        let arena_base = {
            use cudarc::driver::DevicePtr;
            arena_alloc.device_ptr(&g.ctx.default_stream()).0
        };
        // Simple, LL, and simple with zero-copy (every rank's output posted to its senders).
        for (dtype, ll, zc) in DataType::ALL
            .into_iter()
            .flat_map(|d| [(d, false, false), (d, true, false), (d, false, true)])
        {
            for &op in &ops {
                if op.validate(dtype).is_err() {
                    continue;
                }
                let es = dtype.size();
                // Fresh zeroes for every combination: FIFO words and counters start at zero.
                unsafe { drv::memset_d8_sync(arena_base, 0, arena_bytes) }.unwrap();
                let mut arena = Arena {
                    base: arena_base,
                    used: 0,
                    cap: arena_bytes as u64,
                };
                // A FIFO must hold PLAN_FIFO_MESSAGES chunks, as config.rs demands on the host: a
                // ring step forwards into a FIFO that may still hold the previous chunk.
                let chunk_bytes =
                    (SLOTS * SLOT_BYTES) as usize / ferroccl_core::config::PLAN_FIFO_MESSAGES;
                let t = Tuning {
                    algo: Algo::Ring,
                    channels: 2,
                    chunk_elems: chunk_bytes / es,
                };
                let plans: Vec<Plan> = (0..nranks)
                    .map(|r| {
                        build(
                            &CollDesc {
                                kind: CollKind::AllReduce,
                                count,
                                root: 0,
                            },
                            0,
                            r,
                            nranks,
                            &t,
                        )
                    })
                    .collect();
                let tables = make_conns(&mut arena, &plans, SLOT_BYTES);
                // Values whose sums, products and averages are exact in every type (so the ring's
                // order of reduction cannot matter), positive for unsigned types.
                let val = |r: usize, i: usize| -> f64 {
                    let k = ((i * 7 + r * 3) % 5) as f64;
                    match (op, dtype.is_signed()) {
                        (ReduceOp::Prod, true) => [1.0, -1.0, 2.0, 1.0, -2.0][k as usize],
                        (ReduceOp::Prod, false) => [1.0, 1.0, 2.0, 1.0, 2.0][k as usize],
                        (_, true) => k - 2.0,
                        (_, false) => k,
                    }
                };
                let inputs: Vec<Vec<u8>> = (0..nranks)
                    .map(|r| to_bytes(dtype, &(0..count).map(|i| val(r, i)).collect::<Vec<_>>()))
                    .collect();
                // The host's answer: the same transforms, folded in rank order.
                let red = Reducer::new(dtype, op, nranks).unwrap();
                let mut want = inputs[0].clone();
                unsafe {
                    let p = want.as_mut_ptr();
                    red.transform(&[p], p, count, true, false);
                    for (r, inp) in inputs.iter().enumerate().skip(1) {
                        red.reduce(&[p], p, inp.as_ptr(), count, true, r == nranks - 1);
                    }
                }
                let mut runs = Vec::new();
                let recvs: Vec<u64> = (0..nranks).map(|_| arena.take(count * es)).collect();
                for (r, plan) in plans.iter().enumerate() {
                    let (conns, keys) = &tables[r];
                    let send = arena.put(&inputs[r]);
                    let recv = recvs[r];
                    let desc = OpDesc {
                        send,
                        recv,
                        send_count: count,
                        recv_count: count,
                        dtype,
                        op,
                        scalar_dev: 0,
                        ll,
                        zero_copy: zc,
                        post_output: zc,
                    };
                    let remote = remote_dsts(plan, |op, p| {
                        Some(build(
                            &CollDesc {
                                kind: CollKind::AllReduce,
                                count,
                                root: 0,
                            },
                            op,
                            p,
                            nranks,
                            &t,
                        ))
                    });
                    // One GPU: every rank's output is at the same address for all.
                    let post = |_: usize, _: usize| (recv, (count * es) as u64);
                    let z = ZeroCopy {
                        remote: &remote,
                        post: &post,
                    };
                    let e = encode(
                        plan,
                        &[desc],
                        |k| keys.iter().position(|c| *c == k).map(|i| i as u32),
                        zc.then_some(&z),
                    )
                    .unwrap();
                    if zc {
                        assert!(
                            e.steps.iter().any(|s| s.kind == STEP_POST)
                                && e.steps.iter().any(|s| s.flags & FLAG_RDST != 0)
                        );
                    }
                    let at = DeviceTables {
                        steps: arena.put(&e.steps),
                        lanes: arena.put(&e.lanes),
                        nsteps: e.steps.len() as u32,
                        nlanes: e.lanes.len() as u32,
                        ops: 0,
                        conns: arena.put(conns),
                        nconns: conns.len() as u32,
                        abort: 0,
                        error: arena.put(&[FcError::default()]),
                        timeout_ns: 5_000_000_000,
                        rank: e.rank,
                    };
                    runs.push(RankRun {
                        launch: FcLaunch::new(&at, &e.ops),
                        nlanes: e.lanes.len() as u32,
                        out: recv,
                        error: at.error,
                    });
                }
                // Twice: the second launch starts from the counters the first one left.
                for round in 0..2 {
                    let t0 = std::time::Instant::now();
                    launch_all(&g, &streams, &runs);
                    let took = t0.elapsed();
                    for (r, run) in runs.iter().enumerate() {
                        let e = read_error(run.error);
                        assert_eq!(e.code, 0, "{dtype} {op:?} ll {ll} zc {zc} round {round} rank {r}: kernel error {e:?}");
                        let mut got = vec![0u8; count * es];
                        unsafe { drv::memcpy_dtoh_sync(&mut got, run.out) }.unwrap();
                        if let Some(i) = (0..count)
                            .find(|&i| got[i * es..(i + 1) * es] != want[i * es..(i + 1) * es])
                        {
                            panic!(
                                "{dtype} {op:?} ll {ll} zc {zc} round {round} rank {r}: element {i}: got {:?} want {:?}",
                                &got[i * es..(i + 1) * es],
                                &want[i * es..(i + 1) * es]
                            );
                        }
                    }
                    if dtype == DataType::Float32 && op == ReduceOp::Sum {
                        eprintln!("f32 sum, ll {ll}, zero-copy {zc}, {nranks} ranks x {count}: round {round} {took:?}");
                    }
                }
                checked += 1;
            }
        }
        drop(arena_alloc);
        eprintln!("checked {checked} dtype x op combinations");
    }

    #[test]
    #[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --lib gpu_ -- --ignored"]
    fn gpu_lone_rank_times_out_with_a_record() {
        let Some(g) = gpu() else { return };
        let s = g.ctx.default_stream();
        let arena_alloc = s.alloc_zeros::<u8>(1 << 20).unwrap();
        let base = {
            use cudarc::driver::DevicePtr;
            arena_alloc.device_ptr(&s).0
        };
        let mut arena = Arena {
            base,
            used: 0,
            cap: 1 << 20,
        };
        let plans: Vec<Plan> = (0..2)
            .map(|r| {
                build(
                    &CollDesc {
                        kind: CollKind::AllReduce,
                        count: 1000,
                        root: 0,
                    },
                    0,
                    r,
                    2,
                    &Tuning {
                        algo: Algo::Ring,
                        channels: 2,
                        chunk_elems: 100,
                    },
                )
            })
            .collect();
        let tables = make_conns(&mut arena, &plans, 256);
        let (conns, keys) = &tables[0];
        let send = arena.take(4000);
        let recv = arena.take(4000);
        let desc = OpDesc {
            send,
            recv,
            send_count: 1000,
            recv_count: 1000,
            dtype: DataType::Float32,
            op: ReduceOp::Sum,
            scalar_dev: 0,
            ll: false,
            zero_copy: false,
            post_output: false,
        };
        let e = encode(
            &plans[0],
            &[desc],
            |k| keys.iter().position(|c| *c == k).map(|i| i as u32),
            None,
        )
        .unwrap();
        let at = DeviceTables {
            steps: arena.put(&e.steps),
            lanes: arena.put(&e.lanes),
            nsteps: e.steps.len() as u32,
            nlanes: e.lanes.len() as u32,
            ops: 0,
            conns: arena.put(conns),
            nconns: conns.len() as u32,
            abort: 0,
            error: arena.put(&[FcError::default()]),
            timeout_ns: 50_000_000,
            rank: e.rank,
        };
        let t0 = std::time::Instant::now();
        launch_all(
            &g,
            std::slice::from_ref(&s),
            &[RankRun {
                launch: FcLaunch::new(&at, &e.ops),
                nlanes: 2,
                out: recv,
                error: at.error,
            }],
        );
        let took = t0.elapsed();
        let rec = read_error(at.error);
        eprintln!("lone rank: {rec:?} after {took:?}");
        assert_eq!(rec.code, ERR_TIMEOUT);
        assert_eq!(rec.claimed, 1);
        assert_eq!(rec.peer, 1);
        assert!(rec.what == WHAT_DATA || rec.what == WHAT_ROOM);
        assert!(rec.got >= 50_000_000);
        assert!(took < std::time::Duration::from_secs(5), "{took:?}");
        drop(arena_alloc);
    }
}
