//! ferroccl-gpucheck: exercises ferroccl's CUDA foundation on a GPU machine and says PASS
//! or FAIL. Run it with no arguments; it re-executes itself for the two-process check.
//!
//! What it checks: GPU listing and the peer-access matrix; cuMem buffers mapped for every
//! GPU; NVRTC compiling kernels for the GPU's own architecture; a kernel on one GPU reading
//! a peer's buffer through the mapping alone (no cudaMemcpyPeer, no peer contexts); and a
//! buffer exported as a file descriptor, passed to another process over fdpass, mapped and
//! written there. Every element is checked on the host.
//!
//! Never uses NVLink multicast.

use std::ffi::c_void;
use std::os::fd::AsFd;
use std::process::{Child, Command, ExitCode};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use ferroccl::cuda::cu_ok;
use ferroccl::cuda::device::{gpu_count, Gpu, LaunchDims, Module};
use ferroccl::cuda::fdpass::{FdChannel, FdListener};
use ferroccl::cuda::nvrtc::{self, CompileRequest, KernelCache};
use ferroccl::mem::{DeviceBuffer, MemStats};
use ferroccl::Result;

const BYTES: usize = 64 << 20;
const CHILD_ENV: &str = "FERROCCL_GPUCHECK_CHILD";
const DEADLINE: Duration = Duration::from_secs(60);
static NEVER: AtomicBool = AtomicBool::new(false);

const KERNELS: &str = r#"
typedef unsigned int u32;
typedef unsigned long long u64;

// The same function as pattern() on the host: every element distinct, none zero-heavy.
__device__ __forceinline__ u32 pattern(u64 i, u32 seed) {
    return (u32)i * 0x9E3779B1u ^ seed * 0x85EBCA77u ^ (u32)(i >> 32);
}

extern "C" __global__ void fill(u32* buf, u64 n, u64 first, u32 seed) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        buf[i] = pattern(first + i, seed);
}

// 16-byte loads and stores, four in flight per thread, so that a peer read over NVLink
// has enough outstanding requests to approach the link's bandwidth.
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, u64 n16) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
    }
    for (; i < n16; i += stride) dst[i] = src[i];
}
"#;

fn pattern(i: u64, seed: u32) -> u32 {
    (i as u32).wrapping_mul(0x9E37_79B1) ^ seed.wrapping_mul(0x85EB_CA77) ^ (i >> 32) as u32
}

/// The first mismatch, if any, of `buf[off..off+len]` against the pattern.
fn verify(
    buf: &DeviceBuffer,
    off_words: usize,
    words: usize,
    first: u64,
    seed: u32,
) -> Result<std::result::Result<(), String>> {
    let mut host = vec![0u8; words * 4];
    buf.copy_to_host(off_words * 4, &mut host)?;
    for (k, w) in host.chunks_exact(4).enumerate() {
        let got = u32::from_le_bytes(w.try_into().unwrap());
        let want = pattern(first + k as u64, seed);
        if got != want {
            return Ok(Err(format!(
                "element {} of GPU {}'s buffer: got {got:#010x}, want {want:#010x}",
                off_words + k,
                buf.gpu().ordinal()
            )));
        }
    }
    Ok(Ok(()))
}

struct Kernels {
    module: Module,
    sms: u32,
}

impl Kernels {
    fn load(gpu: &Gpu, image: &[u8]) -> Result<Kernels> {
        let sms = gpu
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as u32;
        Ok(Kernels {
            module: gpu.load_module(image)?,
            sms,
        })
    }

    fn dims(&self) -> LaunchDims {
        LaunchDims {
            grid: (self.sms * 4, 1, 1),
            block: (512, 1, 1),
            shared_bytes: 0,
            overlap_prior: false,
        }
    }

    fn fill(&self, ptr: u64, words: u64, first: u64, seed: u32) -> Result<()> {
        let (mut p, mut n, mut f, mut s) = (ptr, words, first, seed);
        let mut params = [
            ptr_of(&mut p),
            ptr_of(&mut n),
            ptr_of(&mut f),
            ptr_of(&mut s),
        ];
        // SAFETY: the parameters match `fill`'s signature and `ptr` maps `words` u32s for this GPU.
        unsafe {
            self.module
                .kernel("fill")?
                .launch(self.dims(), std::ptr::null_mut(), &mut params)
        }?;
        cu_ok("fill launch", unsafe { sys::cuCtxSynchronize() })
    }

    fn copy(&self, src: u64, dst: u64, bytes: u64) -> Result<()> {
        let (mut s, mut d, mut n) = (src, dst, bytes / 16);
        let mut params = [ptr_of(&mut s), ptr_of(&mut d), ptr_of(&mut n)];
        // SAFETY: as for fill; both ranges are mapped for this GPU and 16-byte aligned.
        unsafe {
            self.module
                .kernel("copy16")?
                .launch(self.dims(), std::ptr::null_mut(), &mut params)
        }
    }
}

fn ptr_of<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

/// Median GB/s of `reps` timed copies (after one warm-up), timed with device events.
fn time_copy(gpu: &Gpu, k: &Kernels, src: u64, dst: u64, bytes: u64, reps: usize) -> Result<f64> {
    gpu.bind()?;
    let mut ev = [std::ptr::null_mut(); 2];
    for e in &mut ev {
        cu_ok("cuEventCreate", unsafe { sys::cuEventCreate(e, 0) })?;
    }
    k.copy(src, dst, bytes)?;
    cu_ok("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
    let mut times = Vec::new();
    for _ in 0..reps {
        cu_ok("cuEventRecord", unsafe {
            sys::cuEventRecord(ev[0], std::ptr::null_mut())
        })?;
        k.copy(src, dst, bytes)?;
        cu_ok("cuEventRecord", unsafe {
            sys::cuEventRecord(ev[1], std::ptr::null_mut())
        })?;
        cu_ok("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(ev[1])
        })?;
        let mut ms = 0f32;
        cu_ok("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, ev[0], ev[1])
        })?;
        times.push(ms as f64);
    }
    for e in ev {
        unsafe { sys::cuEventDestroy_v2(e) };
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(bytes as f64 / (times[times.len() / 2] * 1e-3) / 1e9)
}

fn poison(buf: &DeviceBuffer) -> Result<()> {
    buf.gpu().bind()?;
    cu_ok("cuMemsetD32", unsafe {
        sys::cuMemsetD32_v2(buf.device_ptr(), 0xDEAD_BEEF, buf.mapped_len() / 4)
    })
}

fn compile_kernels(arch: &str) -> Result<Vec<u8>> {
    let config = ferroccl::Config::from_env()?;
    let req = CompileRequest {
        name: "gpucheck.cu",
        source: KERNELS,
        arch,
        include_dirs: &config.cuda_include,
        options: &[],
    };
    let cache = config.kernel_cache.map(KernelCache::new);
    let t = Instant::now();
    let v = nvrtc::nvrtc_version()?;
    let img = nvrtc::compile(&req)?;
    println!(
        "nvrtc: NVRTC {}.{} compiled {:?} for {arch}: {} bytes in {:.0} ms",
        v.0,
        v.1,
        img.kind,
        img.bytes.len(),
        t.elapsed().as_secs_f64() * 1e3
    );
    if let Some(c) = cache {
        let t = Instant::now();
        let (_, hit) = c.get_or_compile(&req, v, nvrtc::compile)?;
        let (_, hit2) = c.get_or_compile(&req, v, nvrtc::compile)?;
        println!(
            "nvrtc: cache {} (first {}, second {}), second lookup {:.2} ms",
            c.dir().display(),
            hit,
            hit2,
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(img.bytes)
}

struct Report {
    failures: Vec<String>,
}

impl Report {
    fn step(&mut self, what: &str, r: Result<std::result::Result<(), String>>) {
        match r {
            Ok(Ok(())) => println!("PASS {what}"),
            Ok(Err(m)) => {
                println!("FAIL {what}: {m}");
                self.failures.push(format!("{what}: {m}"));
            }
            Err(e) => {
                println!("FAIL {what}: {e}");
                self.failures.push(format!("{what}: {e}"));
            }
        }
    }
}

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(CHILD_ENV) {
        return match child(&role) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("[child {role}] FAIL: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut rep = Report {
        failures: Vec::new(),
    };
    let n = match gpu_count() {
        Ok(n) => n,
        Err(e) => {
            println!("FAIL gpu_count: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("gpus: {n}");
    if n == 0 {
        println!("FAIL: no GPU visible");
        return ExitCode::FAILURE;
    }
    if let Err(e) = single_process(n, &mut rep) {
        rep.step("single-process checks", Err(e));
    }
    if n >= 2 {
        rep.step(
            "two processes: fd export, fdpass, import, peer read and write",
            two_processes(),
        );
    } else {
        println!("SKIP two-process check: needs 2 GPUs");
    }
    println!();
    if rep.failures.is_empty() {
        println!("SUMMARY: PASS");
        ExitCode::SUCCESS
    } else {
        println!("SUMMARY: FAIL ({} failures)", rep.failures.len());
        for f in &rep.failures {
            println!("  - {f}");
        }
        ExitCode::FAILURE
    }
}

fn single_process(n: usize, rep: &mut Report) -> Result<()> {
    let gpus: Vec<Gpu> = (0..n).map(Gpu::open).collect::<Result<_>>()?;
    for g in &gpus {
        let (ma, mi) = g.compute_capability();
        println!(
            "gpu {}: {} sm_{ma}{mi} {:.1} GiB, cuMem+fd {}",
            g.ordinal(),
            g.name(),
            g.total_memory() as f64 / (1u64 << 30) as f64,
            g.supports_cumem_fd()?
        );
    }
    println!("peer matrix (row reads column): access/native-atomics/perf-rank");
    for a in &gpus {
        let mut line = format!("  gpu {}:", a.ordinal());
        for b in 0..n {
            let l = a.peer_link(b)?;
            line += &format!(
                "  {}{}{}",
                if l.access { "A" } else { "-" },
                if l.native_atomics { "N" } else { "-" },
                l.perf_rank
            );
        }
        println!("{line}");
    }
    let stats = MemStats::new();
    let all: Vec<usize> = (0..n).collect();
    let mut src = Vec::new();
    let mut dst = Vec::new();
    for g in &gpus {
        src.push(DeviceBuffer::alloc(g, BYTES, &all, &stats)?);
        dst.push(DeviceBuffer::alloc(g, BYTES, &all, &stats)?);
    }
    println!(
        "mem: {} buffers of {} MiB, granularity {} KiB, stats {:?}",
        2 * n,
        BYTES >> 20,
        ferroccl::cuda::mem::granularity(&gpus[0])? >> 10,
        stats.snapshot()
    );
    rep.step(
        "MemStats counts the allocations",
        Ok(if stats.allocated_bytes() == (2 * n * BYTES) as u64 {
            Ok(())
        } else {
            Err(format!("{:?}", stats.snapshot()))
        }),
    );

    let image = compile_kernels(&gpus[0].arch())?;
    let ks: Vec<Kernels> = gpus
        .iter()
        .map(|g| Kernels::load(g, &image))
        .collect::<Result<_>>()?;
    let words = BYTES / 4;
    for (i, (g, k)) in gpus.iter().zip(&ks).enumerate() {
        poison(&src[i])?;
        let r = k
            .fill(src[i].device_ptr(), words as u64, 0, i as u32 + 1)
            .and_then(|_| verify(&src[i], 0, words, 0, i as u32 + 1));
        rep.step(
            &format!("fill kernel on gpu {}, every element checked", g.ordinal()),
            r,
        );
    }
    for (i, k) in ks.iter().enumerate() {
        let gbs = time_copy(
            &gpus[i],
            k,
            src[i].device_ptr(),
            dst[i].device_ptr(),
            BYTES as u64,
            20,
        )?;
        println!("copy gpu {i} -> gpu {i} (local): {gbs:.1} GB/s (bytes copied / time; read+write is twice that)");
    }
    if n >= 2 {
        for d in 0..n {
            let s = (d + 1) % n;
            poison(&dst[d])?;
            let r = ks[d]
                .copy(src[s].device_ptr(), dst[d].device_ptr(), BYTES as u64)
                .and_then(|_| cu_ok("copy16", unsafe { sys::cuCtxSynchronize() }))
                .and_then(|_| verify(&dst[d], 0, words, 0, s as u32 + 1));
            rep.step(
                &format!("gpu {d} reads gpu {s}'s buffer through cuMemSetAccess alone"),
                r,
            );
            let gbs = time_copy(
                &gpus[d],
                &ks[d],
                src[s].device_ptr(),
                dst[d].device_ptr(),
                BYTES as u64,
                20,
            )?;
            println!("copy gpu {s} -> gpu {d} (peer read, 16-byte loads): {gbs:.1} GB/s");
        }
    }
    drop(ks);
    let freed = src.into_iter().chain(dst).try_for_each(ferroccl::mem::free);
    rep.step(
        "every buffer freed and uncounted",
        freed.map(|_| {
            if stats.snapshot().allocated_bytes == 0 {
                Ok(())
            } else {
                Err(format!("{:?}", stats.snapshot()))
            }
        }),
    );
    Ok(())
}

fn spawn(role: String) -> Result<Child> {
    let exe = std::env::current_exe()
        .map_err(|e| ferroccl::Error::System(format!("current_exe: {e}")))?;
    Command::new(exe)
        .env(CHILD_ENV, role)
        .env("NCCL_NVLS_ENABLE", "0")
        .spawn()
        .map_err(|e| ferroccl::Error::System(format!("spawning a child: {e}")))
}

fn wait_child(mut c: Child, what: &str, deadline: Instant) -> std::result::Result<(), String> {
    loop {
        match c.try_wait() {
            Ok(Some(s)) if s.success() => return Ok(()),
            Ok(Some(s)) => return Err(format!("{what} exited with {s}")),
            Ok(None) if Instant::now() > deadline => {
                let _ = c.kill();
                let _ = c.wait();
                return Err(format!("{what} did not finish in time (killed)"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("waiting for {what}: {e}")),
        }
    }
}

fn two_processes() -> Result<std::result::Result<(), String>> {
    let mut id = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut id))
        .map_err(|e| ferroccl::Error::System(format!("{e}")))?;
    let job = u64::from_le_bytes(id);
    let a = spawn(format!("export {job} 0"))?;
    let b = spawn(format!("import {job} 1"))?;
    let deadline = Instant::now() + DEADLINE + Duration::from_secs(10);
    let ra = wait_child(a, "exporter (gpu 0)", deadline);
    let rb = wait_child(b, "importer (gpu 1)", deadline);
    Ok(match (ra, rb) {
        (Ok(()), Ok(())) => Ok(()),
        (a, b) => Err(format!("{:?} / {:?}", a.err(), b.err())),
    })
}

const SEED_EXPORTER: u32 = 0xA0;
const SEED_IMPORTER: u32 = 0xB0;

/// The two halves of the two-process check. The exporter fills its whole buffer; the
/// importer checks the first half through its own mapping (host copy and a kernel on its
/// GPU), overwrites the second half from its GPU, and says so; the exporter then checks
/// both halves from its side.
fn child(role: &str) -> Result<()> {
    let bad = || ferroccl::Error::InvalidArgument(format!("child role {role:?}"));
    let mut it = role.split(' ');
    let (kind, job, ord) = (
        it.next().ok_or_else(bad)?,
        it.next().ok_or_else(bad)?,
        it.next().ok_or_else(bad)?,
    );
    let job: u64 = job.parse().map_err(|_| bad())?;
    let ord: usize = ord.parse().map_err(|_| bad())?;
    let gpu = Gpu::open(ord)?;
    let image = compile_kernels(&gpu.arch())?;
    let k = Kernels::load(&gpu, &image)?;
    let stats = MemStats::new();
    let deadline = Instant::now() + DEADLINE;
    let words = BYTES / 4;
    let half = words / 2;
    let tag = format!("[{kind} gpu {ord}]");
    let fail = |m: String| ferroccl::Error::Internal(format!("{tag} {m}"));
    match kind {
        "export" => {
            let buf = DeviceBuffer::alloc(&gpu, BYTES, &[], &stats)?;
            k.fill(buf.device_ptr(), words as u64, 0, SEED_EXPORTER)?;
            let listener = FdListener::bind(job, 0)?;
            let ch = listener.accept(deadline, &NEVER)?;
            let fd = buf.export_fd()?;
            ch.send_fds(
                &[fd.as_fd()],
                &(buf.mapped_len() as u64).to_le_bytes(),
                deadline,
                &NEVER,
            )?;
            drop(fd);
            let (_, reply) = ch.recv_fds(deadline, &NEVER)?;
            if reply != b"written" {
                return Err(fail(format!(
                    "importer said {:?}",
                    String::from_utf8_lossy(&reply)
                )));
            }
            verify(&buf, 0, half, 0, SEED_EXPORTER)?.map_err(&fail)?;
            verify(&buf, half, words - half, half as u64, SEED_IMPORTER)?.map_err(&fail)?;
            println!("{tag} PASS: first half intact, second half written by the importer's GPU");
            ch.send_fds(&[], b"bye", deadline, &NEVER)?;
        }
        "import" => {
            let ch = FdChannel::connect(job, 0, deadline, &NEVER)?;
            let (mut fds, payload) = ch.recv_fds(deadline, &NEVER)?;
            let (Some(fd), Ok(size)) = (fds.pop(), <[u8; 8]>::try_from(payload.as_slice())) else {
                return Err(fail("expected one fd and an 8-byte size".into()));
            };
            let size = u64::from_le_bytes(size) as usize;
            let t = Instant::now();
            let buf = DeviceBuffer::import(fd.as_fd(), size, &gpu, &[], &stats)?;
            drop(fd);
            println!(
                "{tag} imported {} MiB at {:#x} in {:.2} ms, stats {:?}",
                size >> 20,
                buf.device_ptr(),
                t.elapsed().as_secs_f64() * 1e3,
                stats.snapshot()
            );
            verify(&buf, 0, half, 0, SEED_EXPORTER)?.map_err(&fail)?;
            let local = DeviceBuffer::alloc(&gpu, BYTES, &[], &stats)?;
            poison(&local)?;
            k.copy(buf.device_ptr(), local.device_ptr(), (half * 4) as u64)?;
            cu_ok("copy16", unsafe { sys::cuCtxSynchronize() })?;
            verify(&local, 0, half, 0, SEED_EXPORTER)?.map_err(&fail)?;
            let gbs = time_copy(
                &gpu,
                &k,
                buf.device_ptr(),
                local.device_ptr(),
                BYTES as u64,
                20,
            )?;
            println!("{tag} copy from the other process's buffer (gpu 0 memory) into gpu {ord}: {gbs:.1} GB/s");
            k.fill(
                buf.device_ptr() + (half * 4) as u64,
                (words - half) as u64,
                half as u64,
                SEED_IMPORTER,
            )?;
            ch.send_fds(&[], b"written", deadline, &NEVER)?;
            // Keep the mapping until the exporter has checked, then unmap before it frees.
            let (_, bye) = ch.recv_fds(deadline, &NEVER)?;
            if bye != b"bye" {
                return Err(fail("no goodbye from the exporter".into()));
            }
            drop(buf);
            let s = stats.snapshot();
            if s.imported_bytes != 0 {
                return Err(fail(format!(
                    "imported bytes still counted after drop: {s:?}"
                )));
            }
            println!(
                "{tag} PASS: read the exporter's half (host and device), wrote the other half"
            );
        }
        _ => return Err(bad()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check's kernels compile in CI too, so a typo is not first found on the GPU machine.
    #[test]
    #[ignore = "needs libnvrtc and CUDA's headers (README: NVRTC)"]
    fn kernels_compile_with_nvrtc_for_sm90() {
        assert!(
            nvrtc::nvrtc_available(),
            "libnvrtc cannot be loaded (is its folder on LD_LIBRARY_PATH?)"
        );
        let inc = ferroccl::Config::from_env().unwrap().cuda_include;
        let req = CompileRequest {
            name: "gpucheck.cu",
            source: KERNELS,
            arch: "sm_90",
            include_dirs: &inc,
            options: &[],
        };
        let img = nvrtc::compile(&req).unwrap_or_else(|e| panic!("{e}"));
        assert!(img.bytes.starts_with(b"\x7fELF"));
    }

    #[test]
    fn host_pattern_matches_the_kernel_formula() {
        assert_eq!(pattern(0, 0), 0);
        assert_eq!(pattern(1, 0), 0x9E37_79B1);
        assert_eq!(pattern(1 << 32, 0), 1);
        assert_ne!(pattern(5, 1), pattern(5, 2));
    }
}
