//! The CUDA C sources of the kernels and how NVRTC compiles them.
//!
//! Sources live in `kernels/*.cu` / `*.cuh` and are embedded at build time. NVRTC sees a single
//! translation unit: [`plan_exec_source`] splices our own headers (`#include "x.cuh"`) into the
//! `.cu` text, each once, with `#line` markers so that compiler messages name the real file and
//! line. System headers (`<cuda_fp16.h>` ...) are left to NVRTC and its include path. Splicing
//! keeps the whole program in one string, which is also what the on-disk kernel cache hashes.

use cudarc::nvrtc::CompileOptions;

/// Name of the plan-execution kernel (`extern "C"`, so unmangled).
pub(crate) const PLAN_EXEC_KERNEL: &str = "ferroccl_plan_exec";

/// The `.cu` file of the plan-execution kernel, before its headers are spliced in.
pub(crate) const PLAN_EXEC_SRC: &str = include_str!("kernels/plan_exec.cu");

/// Our headers, by the name the sources include them with.
pub(crate) const HEADERS: &[(&str, &str)] = &[
    ("types.cuh", include_str!("kernels/types.cuh")),
    ("fifo.cuh", include_str!("kernels/fifo.cuh")),
    ("reduce.cuh", include_str!("kernels/reduce.cuh")),
];

/// Threads per block the kernel is compiled to allow (`__launch_bounds__`); launch with at most
/// this many. 512 is the suggested launch size.
pub(crate) const PLAN_EXEC_MAX_THREADS: u32 = 1024;
pub(crate) const PLAN_EXEC_DEFAULT_THREADS: u32 = 512;

/// The plan-execution kernel as one self-contained source for NVRTC.
pub(crate) fn plan_exec_source() -> String {
    let mut out = String::with_capacity(PLAN_EXEC_SRC.len() + HEADERS.iter().map(|h| h.1.len() + 64).sum::<usize>());
    let mut seen = Vec::new();
    splice(&mut out, "plan_exec.cu", PLAN_EXEC_SRC, &mut seen);
    out
}

/// The header a line includes with quotes, if it is one of ours.
fn quoted_include(line: &str) -> Option<&'static (&'static str, &'static str)> {
    let rest = line.trim_start().strip_prefix('#')?.trim_start().strip_prefix("include")?.trim();
    let name = rest.strip_prefix('"')?.split('"').next()?;
    HEADERS.iter().find(|h| h.0 == name)
}

fn splice(out: &mut String, name: &str, text: &str, seen: &mut Vec<&'static str>) {
    out.push_str(&format!("#line 1 \"{name}\"\n"));
    for (i, line) in text.lines().enumerate() {
        if let Some(&(h, body)) = quoted_include(line) {
            // `#pragma once` would do the same inside NVRTC; skipping repeats here keeps the
            // spliced text free of duplicate definitions whatever the compiler does with it.
            if !seen.contains(&h) {
                seen.push(h);
                splice(out, h, body, seen);
            }
            out.push_str(&format!("#line {} \"{name}\"\n", i + 2));
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
}

/// NVRTC options for `arch` (e.g. "sm_90"). `cuda_include` is the folder holding
/// `cuda_fp16.h`, `cuda_bf16.h` and `cuda_fp8.h` (`/usr/local/cuda/include` on a CUDA machine);
/// the caller finds it (config.rs owns the environment).
///
/// No fast-math, no flush-to-zero, no FMA contraction: results must equal the host reduction
/// bit for bit (the kernel also uses the `_rn` intrinsics, so this is belt and braces).
pub(crate) fn compile_options(arch: &'static str, cuda_include: Option<&str>) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        arch: Some(arch),
        include_paths: cuda_include.map(|p| vec![p.to_string()]).unwrap_or_default(),
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
    fn splicing_inlines_each_header_once() {
        let src = plan_exec_source();
        assert!(!src.lines().any(|l| quoted_include(l).is_some()), "a quoted include survived");
        for (name, body) in HEADERS {
            assert_eq!(src.matches(&format!("#line 1 \"{name}\"")).count(), 1, "{name}");
            assert!(src.contains(body.lines().find(|l| l.starts_with("#pragma once")).unwrap_or("")));
        }
        assert!(src.contains("#include <cuda_fp8.h>"));
        assert!(src.contains(&format!("void __launch_bounds__(FC_MAX_THREADS, 1) {PLAN_EXEC_KERNEL}(")));
    }

    #[test]
    fn line_markers_point_back_into_the_cu_file() {
        let src = plan_exec_source();
        // After the last header, the next line must be the .cu line right after its include.
        let cu: Vec<&str> = PLAN_EXEC_SRC.lines().collect();
        let lines: Vec<&str> = src.lines().collect();
        let last = lines.iter().rposition(|l| l.starts_with("#line ") && l.ends_with("\"plan_exec.cu\"")).unwrap();
        let n: usize = lines[last].split_whitespace().nth(1).unwrap().parse().unwrap();
        assert_eq!(lines[last + 1], cu[n - 1]);
    }

    /// Compiles the kernel for sm_90 through NVRTC. Needs libnvrtc on the loader path and the
    /// CUDA headers in FERROCCL_CUDA_INCLUDE; skips without them unless FERROCCL_REQUIRE_NVRTC=1.
    #[test]
    fn kernels_compile_with_nvrtc() {
        let require = std::env::var("FERROCCL_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        let skip = |why: &str| {
            assert!(!require, "FERROCCL_REQUIRE_NVRTC=1 but {why}");
            eprintln!("kernels_compile_with_nvrtc: skipped: {why}");
        };
        let Ok(include) = std::env::var("FERROCCL_CUDA_INCLUDE") else {
            return skip("FERROCCL_CUDA_INCLUDE is not set");
        };
        // SAFETY: only probes whether the library loads.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return skip("libnvrtc could not be loaded (is its folder on LD_LIBRARY_PATH?)");
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers; the library is present.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        let t = std::time::Instant::now();
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(plan_exec_source(), compile_options("sm_90", Some(&include)));
        let took = t.elapsed();
        let ptx = match ptx {
            Ok(p) => p.to_src(),
            Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => {
                panic!("NVRTC rejected the kernel:\n{}", log.to_string_lossy())
            }
            Err(e) => panic!("NVRTC failed: {e:?}"),
        };
        eprintln!("NVRTC {major}.{minor}: plan_exec.cu -> {} bytes of PTX in {took:?}", ptx.len());
        assert!(ptx.contains(&format!(".entry {PLAN_EXEC_KERNEL}(")), "no entry {PLAN_EXEC_KERNEL} in the PTX");
        assert!(ptx.contains(".target sm_90"));
        // The FIFO protocol's ordering lives in these instructions; losing one is a silent race.
        assert!(ptx.contains("ld.acquire.sys.global.u64"));
        assert!(ptx.contains("st.release.sys.global.u64"));
        assert!(ptx.contains("%globaltimer"));
    }
}
