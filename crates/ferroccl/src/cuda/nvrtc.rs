//! Run-time compilation of CUDA C kernels with NVRTC, for the GPU in hand, with a disk
//! cache.
//!
//! Kernels are compiled for the device's own architecture (`sm_90` gives a cubin that uses
//! Hopper's instructions; no PTX JIT at load time). Where this NVRTC cannot emit a cubin for
//! the architecture, it falls back to `compute_XX` PTX, which the driver compiles at load.
//!
//! The cache key covers the source text, the options (include directories included), the
//! architecture and the NVRTC version. It does not read headers on disk: ferroccl's own
//! kernel headers should be part of the source given here (embedded with `include_str!`),
//! so that editing them changes the key; system headers change with the NVRTC version.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::sys;
use ferroccl_core::{Error, Result};
use sha2::{Digest, Sha256};

/// What NVRTC produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// Machine code for one architecture (an ELF image).
    Cubin,
    /// PTX text (NUL-terminated), compiled by the driver when loaded.
    Ptx,
}

impl ImageKind {
    fn extension(self) -> &'static str {
        match self {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        }
    }
}

/// A compiled module, ready for `Gpu::load_module`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// Machine code or PTX.
    pub kind: ImageKind,
    /// The image as the driver loads it.
    pub bytes: Vec<u8>,
}

/// The options every ferroccl kernel compiles with (and a test kernel built from its headers
/// should): no flush to zero, IEEE division and square root, no contraction of a multiplication
/// and an add into one rounding, C++17, device code by default. The reductions must give the
/// host's bits.
pub const EXACT_OPTIONS: [&str; 6] = [
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--fmad=false",
    "--std=c++17",
    "-default-device",
];

/// One compilation.
#[derive(Debug, Clone)]
pub struct CompileRequest<'a> {
    /// The program's name in diagnostics (e.g. "allreduce.cu").
    pub name: &'a str,
    /// The CUDA C++ source.
    pub source: &'a str,
    /// `sm_90`, `sm_90a`, `sm_100` ...: what `Gpu::arch()` returns, or a suffixed variant.
    pub arch: &'a str,
    /// Directories searched for `#include`, CUDA's own headers among them.
    pub include_dirs: &'a [PathBuf],
    /// Further NVRTC options, e.g. `-DFOO=1`, `--use_fast_math`.
    pub options: &'a [String],
}

/// The compute capability digits of an `sm_XX[a|f]` architecture ("90a" -> "90a"), checked
/// so that nothing odd reaches NVRTC's command line.
pub fn parse_arch(arch: &str) -> Result<&str> {
    let bad = || {
        Error::InvalidArgument(format!(
            "GPU architecture {arch:?} is not of the form sm_90 / sm_90a"
        ))
    };
    let rest = arch.strip_prefix("sm_").ok_or_else(bad)?;
    let digits = rest.trim_end_matches(['a', 'f']);
    if digits.len() < 2
        || digits.len() > 3
        || !digits.bytes().all(|b| b.is_ascii_digit())
        || rest.len() > digits.len() + 1
    {
        return Err(bad());
    }
    Ok(rest)
}

/// The NVRTC command line for `req`, producing `kind`.
pub fn compiler_options(req: &CompileRequest<'_>, kind: ImageKind) -> Result<Vec<String>> {
    let cc = parse_arch(req.arch)?;
    let mut o = vec![
        match kind {
            ImageKind::Cubin => format!("--gpu-architecture=sm_{cc}"),
            ImageKind::Ptx => format!("--gpu-architecture=compute_{cc}"),
        },
        "--std=c++17".to_string(),
    ];
    for d in req.include_dirs {
        let d = d
            .to_str()
            .ok_or_else(|| Error::InvalidArgument(format!("include path {d:?} is not UTF-8")))?;
        o.push(format!("--include-path={d}"));
    }
    o.extend(req.options.iter().cloned());
    Ok(o)
}

/// Whether libnvrtc can be loaded here.
pub fn nvrtc_available() -> bool {
    // cudarc panics when the library is missing; that must be a "no", not a crash.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

fn ensure_loaded() -> Result<()> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(Error::System(
            "NVRTC library (libnvrtc.so) not found: put CUDA's lib directory on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    ensure_loaded()?;
    let (mut major, mut minor) = (0, 0);
    nv("nvrtcVersion", unsafe {
        sys::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

fn nv(call: &str, r: sys::nvrtcResult) -> Result<()> {
    match r {
        sys::nvrtcResult::NVRTC_SUCCESS => Ok(()),
        e => Err(Error::System(format!("{call} failed: {e:?}"))),
    }
}

/// Destroys the program on every path out of `compile_as`.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

impl Program {
    fn log(&self) -> String {
        let mut n = 0usize;
        if unsafe { sys::nvrtcGetProgramLogSize(self.0, &mut n) } != sys::nvrtcResult::NVRTC_SUCCESS
            || n == 0
        {
            return String::new();
        }
        let mut buf = vec![0u8; n];
        if unsafe { sys::nvrtcGetProgramLog(self.0, buf.as_mut_ptr().cast()) }
            != sys::nvrtcResult::NVRTC_SUCCESS
        {
            return String::new();
        }
        CStr::from_bytes_until_nul(&buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

fn compile_as(
    req: &CompileRequest<'_>,
    kind: ImageKind,
) -> std::result::Result<Image, (sys::nvrtcResult, Error)> {
    let sys_err = |e: Error| (sys::nvrtcResult::NVRTC_ERROR_INTERNAL_ERROR, e);
    let src = CString::new(req.source)
        .map_err(|_| sys_err(Error::InvalidArgument("kernel source contains NUL".into())))?;
    let name = CString::new(req.name)
        .map_err(|_| sys_err(Error::InvalidArgument("kernel name contains NUL".into())))?;
    let opts = compiler_options(req, kind).map_err(sys_err)?;
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| sys_err(Error::InvalidArgument("NVRTC option contains NUL".into())))?;
    let ptrs: Vec<*const std::ffi::c_char> = copts.iter().map(|c| c.as_ptr()).collect();

    let mut raw = std::ptr::null_mut();
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    nv("nvrtcCreateProgram", r).map_err(|e| (r, e))?;
    let prog = Program(raw);
    let r = unsafe { sys::nvrtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        let msg = format!(
            "NVRTC compilation of {} for {} failed: {r:?}\noptions: {}\n{}",
            req.name,
            req.arch,
            opts.join(" "),
            prog.log()
        );
        return Err((r, Error::System(msg)));
    }
    let what = match kind {
        ImageKind::Cubin => "nvrtcGetCUBIN",
        ImageKind::Ptx => "nvrtcGetPTX",
    };
    let mut n = 0usize;
    let r = unsafe {
        match kind {
            ImageKind::Cubin => sys::nvrtcGetCUBINSize(prog.0, &mut n),
            ImageKind::Ptx => sys::nvrtcGetPTXSize(prog.0, &mut n),
        }
    };
    nv(what, r).map_err(|e| (r, e))?;
    let mut bytes = vec![0u8; n];
    let r = unsafe {
        match kind {
            ImageKind::Cubin => sys::nvrtcGetCUBIN(prog.0, bytes.as_mut_ptr().cast()),
            ImageKind::Ptx => sys::nvrtcGetPTX(prog.0, bytes.as_mut_ptr().cast()),
        }
    };
    nv(what, r).map_err(|e| (r, e))?;
    if bytes.is_empty() {
        return Err((
            sys::nvrtcResult::NVRTC_ERROR_INTERNAL_ERROR,
            Error::System(format!("{what} returned an empty image")),
        ));
    }
    Ok(Image { kind, bytes })
}

/// Compiles without the cache: a cubin for `req.arch`, or PTX where this NVRTC rejects
/// the architecture as a real target.
pub fn compile(req: &CompileRequest<'_>) -> Result<Image> {
    ensure_loaded()?;
    match compile_as(req, ImageKind::Cubin) {
        Ok(img) => Ok(img),
        Err((sys::nvrtcResult::NVRTC_ERROR_INVALID_OPTION, first)) => {
            compile_as(req, ImageKind::Ptx)
                .map_err(|(_, e)| Error::System(format!("{e}\n(after sm_ was refused: {first})")))
        }
        Err((_, e)) => Err(e),
    }
}

/// The cache key: hex SHA-256 over every input that can change the output. Each field is
/// length-prefixed so that moving text between fields changes the key.
pub fn cache_key(req: &CompileRequest<'_>, nvrtc_version: (i32, i32)) -> Result<String> {
    let mut h = Sha256::new();
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(b"ferroccl-nvrtc-cache-v1");
    field(format!("{}.{}", nvrtc_version.0, nvrtc_version.1).as_bytes());
    field(req.arch.as_bytes());
    field(req.name.as_bytes());
    field(req.source.as_bytes());
    // The options as NVRTC will see them, include paths and all (kind-independent part).
    for o in compiler_options(req, ImageKind::Cubin)? {
        field(o.as_bytes());
    }
    let digest = h.finalize();
    Ok(digest.iter().map(|b| format!("{b:02x}")).collect())
}

/// Compiled kernels on disk, one file per key. Writers go through a temporary file and a
/// rename, so concurrent processes (the ranks of one job start together) never read a
/// half-written image; two that miss together both compile, and the last rename wins with
/// identical bytes.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    /// A cache in `dir` (made on first store).
    pub fn new(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache { dir: dir.into() }
    }

    /// Where the images are kept.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str, kind: ImageKind) -> PathBuf {
        self.dir.join(format!("{key}.{}", kind.extension()))
    }

    /// The cached image for `key`, if a complete one is there.
    pub fn lookup(&self, key: &str) -> Option<Image> {
        [ImageKind::Cubin, ImageKind::Ptx]
            .into_iter()
            .find_map(|kind| {
                let bytes = std::fs::read(self.path(key, kind)).ok()?;
                (!bytes.is_empty()).then_some(Image { kind, bytes })
            })
    }

    /// Stores `img` under `key`.
    pub fn store(&self, key: &str, img: &Image) -> Result<()> {
        let io = |what: &str, e: std::io::Error| {
            Error::System(format!("kernel cache {}: {what}: {e}", self.dir.display()))
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| io("create", e))?;
        let mut nonce = [0u8; 8];
        let _ = getrandom::getrandom(&mut nonce);
        let tmp = self.dir.join(format!(
            ".{key}.{}.{:016x}.tmp",
            std::process::id(),
            u64::from_le_bytes(nonce)
        ));
        let r = std::fs::write(&tmp, &img.bytes)
            .and_then(|_| std::fs::rename(&tmp, self.path(key, img.kind)));
        if let Err(e) = r {
            let _ = std::fs::remove_file(&tmp);
            return Err(io("write", e));
        }
        Ok(())
    }

    /// The image for `req` from the cache, or from `compile` (then stored). Returns whether
    /// it was a hit. A cache that cannot be written only costs a warning: the compiled image
    /// is still good.
    pub fn get_or_compile(
        &self,
        req: &CompileRequest<'_>,
        nvrtc_version: (i32, i32),
        compile: impl FnOnce(&CompileRequest<'_>) -> Result<Image>,
    ) -> Result<(Image, bool)> {
        let key = cache_key(req, nvrtc_version)?;
        if let Some(img) = self.lookup(&key) {
            return Ok((img, true));
        }
        let img = compile(req)?;
        if let Err(e) = self.store(&key, &img) {
            tracing::warn!("{e}");
        }
        Ok((img, false))
    }
}

/// Images this process already has, by cache key. The ranks of one process (a thread per GPU,
/// one thread driving several, several communicators) need the same modules at the same moment:
/// the first compiles (or reads the disk cache), the others wait for it on the key's lock
/// instead of compiling again beside it. Failures are not kept: the next caller tries again.
#[derive(Default)]
pub(crate) struct ProcessImages {
    by_key: std::sync::Mutex<
        std::collections::HashMap<String, std::sync::Arc<std::sync::Mutex<Option<Image>>>>,
    >,
}

impl ProcessImages {
    /// The image under `key`, from this process's earlier call or from `make`.
    pub(crate) fn get_or_make(
        &self,
        key: &str,
        make: impl FnOnce() -> Result<Image>,
    ) -> Result<Image> {
        let slot = {
            let mut map = self.by_key.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(key.to_string()).or_default().clone()
        };
        let mut img = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = img.as_ref() {
            return Ok(i.clone());
        }
        let made = make()?;
        *img = Some(made.clone());
        Ok(made)
    }
}

fn process_images() -> &'static ProcessImages {
    static IMAGES: std::sync::OnceLock<ProcessImages> = std::sync::OnceLock::new();
    IMAGES.get_or_init(ProcessImages::default)
}

/// Compiles through `cache` when given (keyed by this NVRTC's version), else directly; once per
/// process for each key (`ProcessImages`).
pub fn compile_cached(req: &CompileRequest<'_>, cache: Option<&KernelCache>) -> Result<Image> {
    let version = nvrtc_version()?;
    let key = cache_key(req, version)?;
    process_images().get_or_make(&key, || match cache {
        Some(c) => Ok(c.get_or_compile(req, version, compile)?.0),
        None => compile(req),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn req<'a>(
        src: &'a str,
        arch: &'a str,
        inc: &'a [PathBuf],
        opts: &'a [String],
    ) -> CompileRequest<'a> {
        CompileRequest {
            name: "t.cu",
            source: src,
            arch,
            include_dirs: inc,
            options: opts,
        }
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let mut n = [0u8; 8];
        getrandom::getrandom(&mut n).unwrap();
        std::env::temp_dir().join(format!(
            "ferroccl-nvrtc-{tag}-{}-{:016x}",
            std::process::id(),
            u64::from_le_bytes(n)
        ))
    }

    #[test]
    fn arch_strings() {
        assert_eq!(parse_arch("sm_90").unwrap(), "90");
        assert_eq!(parse_arch("sm_90a").unwrap(), "90a");
        assert_eq!(parse_arch("sm_100f").unwrap(), "100f");
        for bad in [
            "90",
            "sm_",
            "sm_9",
            "sm_9x",
            "compute_90",
            "sm_90aa",
            "sm_90 -G",
            "sm_1000",
        ] {
            assert!(parse_arch(bad).is_err(), "{bad}");
        }
        let o = compiler_options(
            &req("", "sm_90", &[PathBuf::from("/x")], &["-DA=1".into()]),
            ImageKind::Ptx,
        )
        .unwrap();
        assert_eq!(
            o,
            [
                "--gpu-architecture=compute_90",
                "--std=c++17",
                "--include-path=/x",
                "-DA=1"
            ]
        );
    }

    #[test]
    fn cache_key_is_stable_and_sensitive() {
        let inc = [PathBuf::from("/usr/local/cuda/include")];
        let opts = ["-DN=4".to_string()];
        let base = cache_key(&req("k", "sm_90", &inc, &opts), (13, 0)).unwrap();
        assert_eq!(base.len(), 64);
        assert_eq!(
            base,
            cache_key(&req("k", "sm_90", &inc, &opts), (13, 0)).unwrap()
        );
        let others = [
            cache_key(&req("k2", "sm_90", &inc, &opts), (13, 0)).unwrap(),
            cache_key(&req("k", "sm_90a", &inc, &opts), (13, 0)).unwrap(),
            cache_key(&req("k", "sm_90", &[], &opts), (13, 0)).unwrap(),
            cache_key(&req("k", "sm_90", &inc, &[]), (13, 0)).unwrap(),
            cache_key(&req("k", "sm_90", &inc, &opts), (13, 1)).unwrap(),
            cache_key(&req("k", "sm_90", &inc, &opts), (12, 9)).unwrap(),
        ];
        for (i, o) in others.iter().enumerate() {
            assert_ne!(&base, o, "variant {i} did not change the key");
        }
        // Moving text between fields must not collide.
        let a = cache_key(
            &req("k", "sm_90", &[], &["-DA".into(), "B".into()]),
            (13, 0),
        )
        .unwrap();
        let b = cache_key(&req("k", "sm_90", &[], &["-DAB".into()]), (13, 0)).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn a_process_makes_each_image_once_while_its_threads_wait() {
        let images = ProcessImages::default();
        let made = std::sync::atomic::AtomicUsize::new(0);
        let img = |b: u8| Image {
            kind: ImageKind::Cubin,
            bytes: vec![b; 4],
        };
        let got: Vec<Image> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        images.get_or_make("k", || {
                            made.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_millis(50));
                            Ok(img(1))
                        })
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert_eq!(
            made.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "one thread compiled, the others waited"
        );
        assert!(got.iter().all(|i| *i == img(1)));
        // Another key is made apart; a failure is not kept.
        assert!(images
            .get_or_make("bad", || Err(Error::System("nvrtc failed".into())))
            .is_err());
        assert_eq!(images.get_or_make("bad", || Ok(img(2))).unwrap(), img(2));
        assert_eq!(images.get_or_make("k", || Ok(img(3))).unwrap(), img(1));
    }

    #[test]
    fn cache_hits_after_a_miss_and_survives_garbage() {
        let dir = temp_dir("cache");
        let cache = KernelCache::new(&dir);
        let r = req("__global__ void k() {}", "sm_90", &[], &[]);
        let calls = Cell::new(0);
        let fake = |_: &CompileRequest<'_>| {
            calls.set(calls.get() + 1);
            Ok(Image {
                kind: ImageKind::Cubin,
                bytes: b"\x7fELF fake".to_vec(),
            })
        };
        let (a, hit) = cache.get_or_compile(&r, (13, 0), fake).unwrap();
        assert!(!hit);
        let (b, hit) = cache.get_or_compile(&r, (13, 0), fake).unwrap();
        assert!(hit);
        assert_eq!(a, b);
        assert_eq!(calls.get(), 1);
        // Another NVRTC version is another entry.
        let (_, hit) = cache.get_or_compile(&r, (13, 1), fake).unwrap();
        assert!(!hit);
        assert_eq!(calls.get(), 2);
        // No temporary files are left behind.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names
            .iter()
            .all(|n| n.to_string_lossy().ends_with(".cubin")));
        // A truncated entry is a miss, and a failed compile is not cached.
        let key = cache_key(&r, (13, 0)).unwrap();
        std::fs::write(dir.join(format!("{key}.cubin")), b"").unwrap();
        let failing = |_: &CompileRequest<'_>| Err(Error::System("boom".into()));
        assert!(cache.get_or_compile(&r, (13, 0), failing).is_err());
        let (_, hit) = cache.get_or_compile(&r, (13, 0), fake).unwrap();
        assert!(!hit);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unwritable_cache_still_compiles() {
        let cache = KernelCache::new("/proc/ferroccl-cannot-write-here");
        let r = req("x", "sm_90", &[], &[]);
        let (img, hit) = cache
            .get_or_compile(&r, (13, 0), |_| {
                Ok(Image {
                    kind: ImageKind::Ptx,
                    bytes: b"ptx\0".to_vec(),
                })
            })
            .unwrap();
        assert!(!hit);
        assert_eq!(img.kind, ImageKind::Ptx);
    }

    const HALF_KERNEL: &str = r#"
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
extern "C" __global__ void mixed(const __half* a, const __nv_bfloat16* b, const __nv_fp8_e4m3* c, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __half2float(a[i]) + __bfloat162float(b[i]) + float(c[i]);
}
"#;

    /// Really compiles with NVRTC (ignored by default; CI runs every NVRTC test).
    #[test]
    #[ignore = "needs libnvrtc and CUDA's headers (README: NVRTC)"]
    fn nvrtc_compiles_fp16_bf16_fp8_for_sm90() {
        assert!(
            nvrtc_available(),
            "libnvrtc cannot be loaded (is its folder on LD_LIBRARY_PATH?)"
        );
        let inc = ferroccl_core::Config::from_env()
            .expect("a valid environment")
            .cuda_include;
        let v = nvrtc_version().unwrap();
        eprintln!("NVRTC {}.{}, include dirs {inc:?}", v.0, v.1);
        let r = CompileRequest {
            name: "mixed.cu",
            source: HALF_KERNEL,
            arch: "sm_90",
            include_dirs: &inc,
            options: &[],
        };
        let dir = temp_dir("real");
        let cache = KernelCache::new(&dir);
        let t = std::time::Instant::now();
        let img = compile_cached(&r, Some(&cache)).unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "compiled to {:?} ({} bytes) in {:?}",
            img.kind,
            img.bytes.len(),
            t.elapsed()
        );
        match img.kind {
            ImageKind::Cubin => assert!(img.bytes.starts_with(b"\x7fELF")),
            ImageKind::Ptx => assert!(String::from_utf8_lossy(&img.bytes).contains(".entry mixed")),
        }
        let (again, hit) = cache
            .get_or_compile(&r, v, |_| panic!("should be cached"))
            .unwrap();
        assert!(hit);
        assert_eq!(again, img);

        // A syntax error comes back with NVRTC's log in the message.
        let bad = CompileRequest {
            source: "extern \"C\" __global__ void k() { int x = ; }",
            ..r.clone()
        };
        let e = compile(&bad).unwrap_err().to_string();
        assert!(
            e.contains("NVRTC_ERROR_COMPILATION") && e.contains("expected an expression"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
