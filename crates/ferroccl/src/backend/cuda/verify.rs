//! The verifiable mode on the GPU: a rank's inputs written, and its outputs counted, by kernels
//! (`kernels/check.cu`) on the communicator's stream, with the values of
//! `ferroccl_core::numeric::expected::RankCase` bit for bit. Staging buffers through the host
//! costs two PCIe copies and a single-threaded pass per buffer; on the GPU a check runs at
//! close to memory speed.
//!
//! A [`GpuVerifier`] is made on request ([`Comm::gpu_verifier`](crate::Comm::gpu_verifier)):
//! its module is compiled (NVRTC, disk cache) and loaded then, so communicators that never check
//! pay nothing, and the communicator knows nothing of it.

use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::sys;
use ferroccl_core::numeric::expected::RankCase;
use ferroccl_core::numeric::verify::{value_params, Matcher, DATA_TAG};
use ferroccl_core::{CollKind, Config, Error, Result};

use super::kernels;
use super::CudaComm;
use crate::cuda::cu_ok;
use crate::cuda::device::{Gpu, LaunchDims, Module};
use crate::cuda::mem::DeviceBuffer;
use crate::cuda::nvrtc;

pub(crate) const FILL_KERNEL: &str = "ferroccl_check_fill";
pub(crate) const COUNT_KERNEL: &str = "ferroccl_check_count";
pub(crate) const FIRST_KERNEL: &str = "ferroccl_check_first";

/// Threads per block: check.cu's FC_CK_THREADS, its launch bound.
const THREADS: u32 = 256;
/// Resident blocks per SM worth launching; the grid-stride loops take any further work.
const BLOCKS_PER_SM: u32 = 8;

/// check.cuh's FcCheckCase: one RankCase on one buffer with the reference's per-buffer
/// constants, so the kernels repeat only the per-element functions.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FcCheckCase {
    pub data: u64,
    pub len: u64,
    pub result: u64,
    pub seed: u64,
    pub count: u64,
    pub n: u64,
    pub rank: u64,
    pub root: u64,
    pub budget: u64,
    pub q_all: u64,
    pub twos: u64,
    pub halves: u64,
    pub mask: u64,
    pub tag: u64,
    pub scalar_wrap: u64,
    pub scalar: f64,
    pub tol: f64,
    pub kind: u32,
    pub dtype: u32,
    pub redop: u32,
    pub is_signed: u32,
    pub matcher: u32,
    pub match_p: i32,
    pub match_emin: i32,
    pub reserved: u32,
}

/// check.cuh's FcCheckResult.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FcCheckResult {
    pub wrong: u64,
    pub first: u64,
    pub got: f64,
    pub want: f64,
}

macro_rules! layout {
    ($($t:ident: $size:literal { $($f:ident @ $off:literal),* $(,)? })*) => {
        $(
            const _: () = assert!(std::mem::size_of::<$t>() == $size);
            $( const _: () = assert!(std::mem::offset_of!($t, $f) == $off); )*
        )*
        /// (struct, field or "" for the size, bytes), to compare with check.cuh's FC_CK_* lines.
        #[cfg(test)]
        const LAYOUT: &[(&str, &str, usize)] = &[
            $( (stringify!($t), "", $size), $( (stringify!($t), stringify!($f), $off), )* )*
        ];
    };
}

// `matcher` is `match` in C (a Rust keyword).
layout! {
    FcCheckCase: 168 { data @ 0, len @ 8, result @ 16, seed @ 24, count @ 32, n @ 40, rank @ 48, root @ 56,
                       budget @ 64, q_all @ 72, twos @ 80, halves @ 88, mask @ 96, tag @ 104, scalar_wrap @ 112,
                       scalar @ 120, tol @ 128, kind @ 136, dtype @ 140, redop @ 144, is_signed @ 148,
                       matcher @ 152, match_p @ 156, match_emin @ 160, reserved @ 164 }
    FcCheckResult: 32 { wrong @ 0, first @ 8, got @ 16, want @ 24 }
}

pub(crate) const MATCH_EXACT: u32 = 0;
pub(crate) const MATCH_AVG: u32 = 1;
pub(crate) const MATCH_WITHIN: u32 = 2;

/// check.cuh's FC_CK_<kind>: CollKind in declaration order.
pub(crate) fn kind_code(kind: CollKind) -> u32 {
    match kind {
        CollKind::AllReduce => 0,
        CollKind::AllGather => 1,
        CollKind::ReduceScatter => 2,
        CollKind::Broadcast => 3,
        CollKind::Reduce => 4,
        CollKind::AllToAll => 5,
        CollKind::Gather => 6,
        CollKind::Scatter => 7,
        CollKind::Send => 8,
        CollKind::Recv => 9,
    }
}

impl FcCheckCase {
    /// `case` on the `len` elements at device address `data`; `result` is the FcCheckResult of a
    /// count (0 for a fill).
    pub(crate) fn new(case: &RankCase, data: u64, len: u64, result: u64) -> Result<FcCheckCase> {
        if case.nranks == 0 {
            return Err(Error::InvalidArgument(
                "a check case needs at least one rank".into(),
            ));
        }
        let p = value_params(case.dtype, case.op, case.nranks);
        let (matcher, match_p, match_emin, tol) = match case.matcher() {
            Matcher::Exact => (MATCH_EXACT, 0, 0, 0.0),
            Matcher::Avg { p, emin } => (MATCH_AVG, p, emin, 0.0),
            Matcher::Within(tol) => (MATCH_WITHIN, 0, 0, tol),
        };
        Ok(FcCheckCase {
            data,
            len,
            result,
            seed: case.seed,
            count: case.count as u64,
            n: p.n,
            rank: case.rank as u64,
            root: case.root as u64,
            budget: p.budget,
            q_all: p.q_all,
            twos: p.twos,
            halves: p.halves,
            mask: p.mask,
            tag: if case.kind.reduces() { p.tag } else { DATA_TAG },
            scalar_wrap: p.scalar_wrap,
            scalar: p.scalar,
            tol,
            kind: kind_code(case.kind),
            dtype: case.dtype.nccl_id() as u32,
            redop: case.op.nccl_id() as u32,
            is_signed: p.signed as u32,
            matcher,
            match_p,
            match_emin,
            reserved: 0,
        })
    }
}

/// check.cu compiled for `gpu` through the same path and disk cache as the plan kernel.
pub(crate) fn compile(gpu: &Gpu, config: &Config) -> Result<nvrtc::Image> {
    kernels::compile_for(gpu, config, "check.cu", &kernels::check_source(), &[])
}

/// What a count found: the wrong elements, and the first of them (index, got, expected) as
/// `RankCase::count_wrong` reports it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Wrong {
    /// Elements that differ from what they must be.
    pub count: u64,
    /// The first of them: (index, value found, value expected).
    pub first: Option<(usize, f64, f64)>,
}

/// The verifiable mode on a GPU communicator's device, enqueued on its current stream (its
/// own, or the one given to `Comm::set_stream`): [`Comm::gpu_verifier`](crate::Comm::gpu_verifier).
///
/// Pointers are device addresses on this communicator's GPU, as in [`OpArgs`](crate::OpArgs).
pub struct GpuVerifier<'c> {
    comm: &'c CudaComm,
    module: Module,
    /// The FcCheckResult every count reuses; `busy` serialises its users.
    result: DeviceBuffer,
    busy: Mutex<()>,
    max_blocks: u32,
}

impl<'c> GpuVerifier<'c> {
    /// Compiles (or finds in the disk cache) and loads the checker's kernels on `comm`'s GPU.
    pub(crate) fn new(comm: &'c CudaComm, config: &Config) -> Result<GpuVerifier<'c>> {
        let gpu = &comm.gpu;
        let module = gpu.load_module(&compile(gpu, config)?.bytes)?;
        // Loaded now: a lazy load at the first launch can wait for a collective kernel of this
        // GPU that waits for this very rank (`Kernel::load`).
        for k in [FILL_KERNEL, COUNT_KERNEL, FIRST_KERNEL] {
            module.kernel(k)?.load()?;
        }
        let sms = gpu
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as u32;
        let result =
            DeviceBuffer::alloc(gpu, std::mem::size_of::<FcCheckResult>(), &[], &comm.stats)?;
        Ok(GpuVerifier {
            comm,
            module,
            result,
            busy: Mutex::new(()),
            max_blocks: sms * BLOCKS_PER_SM,
        })
    }

    fn stream(&self) -> sys::CUstream {
        self.comm.current_stream()
    }

    /// Sets `bytes` bytes at `dst` to `byte` (enqueued).
    ///
    /// # Safety
    /// `dst..dst + bytes` must be device memory of this GPU that nothing else uses meanwhile.
    pub unsafe fn poison(&self, dst: *mut u8, bytes: usize, byte: u8) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.comm.gpu.bind()?;
        cu_ok("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst as u64, byte, bytes, self.stream())
        })
    }

    /// Writes this rank's input for `case` (`RankCase::fill_input`) into the `len` elements
    /// at `dst` (enqueued).
    ///
    /// # Safety
    /// `dst` must hold `len` elements of `case.dtype` in device memory of this GPU that nothing
    /// else uses meanwhile.
    pub unsafe fn fill(&self, case: &RankCase, dst: *mut u8, len: usize) -> Result<()> {
        let c = self.case(case, dst as u64, len, 0)?;
        self.launch(FILL_KERNEL, self.grid(case, len), THREADS, &c)
    }

    /// Counts the wrong elements among the `len` at `out` (`RankCase::count_wrong`), after
    /// everything enqueued before; waits for the result.
    ///
    /// # Safety
    /// `out` must hold `len` elements of `case.dtype` in device memory of this GPU.
    pub unsafe fn count_wrong(&self, case: &RankCase, out: *const u8, len: usize) -> Result<Wrong> {
        let _busy = self
            .busy
            .lock()
            .map_err(|_| Error::Internal("GPU checker lock poisoned".into()))?;
        let res = self.result.device_ptr();
        let c = self.case(case, out as u64, len, res)?;
        let stream = self.stream();
        self.comm.gpu.bind()?;
        // wrong = 0, first = none.
        cu_ok("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(res, 0, 8, stream)
        })?;
        cu_ok("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(res + 8, 0xff, 8, stream)
        })?;
        if len > 0 {
            self.launch(COUNT_KERNEL, self.grid(case, len), THREADS, &c)?;
            self.launch(FIRST_KERNEL, 1, 1, &c)?;
        }
        let mut host = FcCheckResult::default();
        let bytes = std::mem::size_of::<FcCheckResult>();
        self.comm.gpu.bind()?;
        cu_ok("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2((&mut host as *mut FcCheckResult).cast(), res, bytes, stream)
        })?;
        cu_ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream)
        })?;
        Ok(Wrong {
            count: host.wrong,
            first: (host.wrong > 0).then_some((host.first as usize, host.got, host.want)),
        })
    }

    fn case(&self, case: &RankCase, data: u64, len: usize, result: u64) -> Result<FcCheckCase> {
        let size = case.dtype.size() as u64;
        if len > 0 && (data == 0 || !data.is_multiple_of(size)) {
            return Err(Error::InvalidArgument(format!(
                "check buffer {data:#x} is null or not aligned to {}",
                case.dtype
            )));
        }
        FcCheckCase::new(case, data, len as u64, result)
    }

    /// Blocks for `len` elements: one 16-byte pack per thread, up to what the GPU holds at once.
    fn grid(&self, case: &RankCase, len: usize) -> u32 {
        let packs = (len as u64).div_ceil(16 / case.dtype.size() as u64);
        packs
            .div_ceil(THREADS as u64)
            .clamp(1, self.max_blocks as u64) as u32
    }

    fn launch(&self, name: &str, grid: u32, block: u32, c: &FcCheckCase) -> Result<()> {
        if c.len == 0 {
            return Ok(());
        }
        let kernel = self.module.kernel(name)?;
        let mut param = *c;
        let mut params = [&mut param as *mut FcCheckCase as *mut c_void];
        let dims = LaunchDims {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_bytes: 0,
            overlap_prior: false,
        };
        // SAFETY: every check kernel takes one FcCheckCase by value; its buffers are the
        // caller's (see the public methods' contracts) and `result` is ours.
        unsafe { kernel.launch(dims, self.stream(), &mut params) }
    }
}

#[cfg(test)]
mod host_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use ferroccl_core::{DataType, ReduceOp};

    const CHECK_CUH: &str = include_str!("kernels/check.cuh");

    /// Every FC_CK_SIZE / FC_CK_OFFSET line of check.cuh, as (struct, field, bytes).
    fn cuda_layout() -> Vec<(String, String, usize)> {
        let mut v = Vec::new();
        for line in CHECK_CUH.lines().map(str::trim) {
            let (field, args) = if let Some(a) = line.strip_prefix("FC_CK_SIZE(") {
                (false, a)
            } else if let Some(a) = line.strip_prefix("FC_CK_OFFSET(") {
                (true, a)
            } else {
                continue;
            };
            let args: Vec<&str> = args
                .trim_end_matches(");")
                .split(',')
                .map(str::trim)
                .collect();
            let (t, f, n) = if field {
                (args[0], args[1], args[2])
            } else {
                (args[0], "", args[1])
            };
            let f = if f == "match" { "matcher" } else { f };
            v.push((t.to_string(), f.to_string(), n.parse().unwrap()));
        }
        v
    }

    #[test]
    fn cuda_header_pins_the_same_layout() {
        let mut cuda = cuda_layout();
        let mut rust: Vec<(String, String, usize)> = LAYOUT
            .iter()
            .map(|&(t, f, n)| (t.to_string(), f.to_string(), n))
            .collect();
        cuda.sort();
        rust.sort();
        assert_eq!(cuda, rust);
        assert_eq!(LAYOUT.iter().filter(|e| e.1.is_empty()).count(), 2);
    }

    fn header_define(name: &str) -> u32 {
        CHECK_CUH
            .lines()
            .find_map(|l| {
                let mut w = l.strip_prefix("#define ")?.split_whitespace();
                (w.next()? == name).then(|| w.next()?.strip_suffix('u')?.parse().ok())?
            })
            .unwrap_or_else(|| panic!("{name} not in check.cuh"))
    }

    #[test]
    fn constants_match_the_header() {
        let kinds = [
            ("ALL_REDUCE", CollKind::AllReduce),
            ("ALL_GATHER", CollKind::AllGather),
            ("REDUCE_SCATTER", CollKind::ReduceScatter),
            ("BROADCAST", CollKind::Broadcast),
            ("REDUCE", CollKind::Reduce),
            ("ALL_TO_ALL", CollKind::AllToAll),
            ("GATHER", CollKind::Gather),
            ("SCATTER", CollKind::Scatter),
            ("SEND", CollKind::Send),
            ("RECV", CollKind::Recv),
        ];
        for (n, k) in kinds {
            assert_eq!(header_define(&format!("FC_CK_{n}")), kind_code(k), "{n}");
        }
        let names = [
            "INT8", "UINT8", "INT32", "UINT32", "INT64", "UINT64", "FLOAT16", "FLOAT32", "FLOAT64",
            "BFLOAT16", "FP8E4M3", "FP8E5M2",
        ];
        for (n, d) in names.iter().zip(DataType::ALL) {
            assert_eq!(
                header_define(&format!("FC_CK_{n}")) as i32,
                d.nccl_id(),
                "{n}"
            );
        }
        for (n, op) in [
            ("SUM", ReduceOp::Sum),
            ("PROD", ReduceOp::Prod),
            ("MAX", ReduceOp::Max),
            ("MIN", ReduceOp::Min),
            ("AVG", ReduceOp::Avg),
            ("PREMULSUM", ReduceOp::PreMulSum(2.0)),
        ] {
            assert_eq!(
                header_define(&format!("FC_CK_OP_{n}")) as i32,
                op.nccl_id(),
                "{n}"
            );
        }
        assert_eq!(header_define("FC_CK_MATCH_EXACT"), MATCH_EXACT);
        assert_eq!(header_define("FC_CK_MATCH_AVG"), MATCH_AVG);
        assert_eq!(header_define("FC_CK_MATCH_WITHIN"), MATCH_WITHIN);
        let threads = kernels::CHECK_SRC
            .lines()
            .find_map(|l| l.strip_prefix("#define FC_CK_THREADS "))
            .unwrap();
        assert_eq!(threads.trim().parse::<u32>().unwrap(), THREADS);
    }

    /// check.cu through NVRTC for sm_90, as `compile` does at run time (same flags), then as PTX
    /// to read what it became.
    #[test]
    #[ignore = "needs libnvrtc and CUDA's headers (README: NVRTC)"]
    fn check_kernels_compile_with_nvrtc() {
        let source = kernels::check_source();
        let options = kernels::nvrtc_flags();
        let include_dirs = Config::from_env()
            .expect("a valid environment")
            .cuda_include;
        let req = nvrtc::CompileRequest {
            name: "check.cu",
            source: &source,
            arch: "sm_90",
            include_dirs: &include_dirs,
            options: &options,
        };
        let t = std::time::Instant::now();
        let img = nvrtc::compile(&req).unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "check.cu -> {:?} of {} bytes in {:?}",
            img.kind,
            img.bytes.len(),
            t.elapsed()
        );
        for k in [FILL_KERNEL, COUNT_KERNEL, FIRST_KERNEL] {
            assert!(
                img.bytes.windows(k.len()).any(|w| w == k.as_bytes()),
                "no {k} in the image"
            );
        }
        let text = cudarc::nvrtc::compile_ptx_with_opts(
            source,
            kernels::compile_options("sm_90", &include_dirs),
        )
        .unwrap_or_else(|e| panic!("{e:?}"))
        .to_src();
        for k in [FILL_KERNEL, COUNT_KERNEL, FIRST_KERNEL] {
            assert!(text.contains(&format!(".entry {k}(")), "no entry {k}");
        }
        // The expected sums must round like the host's: no fused multiply-add on f64.
        assert!(!text.contains("fma.rn.f64"), "an f64 FMA in the checker");
        // 16-byte packs: the fill's stores and the count's loads are vectorised.
        assert!(
            text.contains("st.global.v4.u32") || text.contains("st.global.v4.b32"),
            "no vector store"
        );
        assert!(
            text.contains("ld.global.cs.v4.u32") || text.contains("ld.global.cs.v4.b32"),
            "no vector load"
        );
    }
}
