//! The loader against small fake libraries built here with the C compiler: every way NCCL can
//! be missing or wrong must end in an error that names the file, the version or the symbol.

use super::*;
use std::path::PathBuf;
use std::process::Command;

/// A temp folder for this test's libraries.
fn workdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferroccl-nccl-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compiles `c_source` into a shared library, or None (test skipped) without a C compiler.
fn build_lib(dir: &Path, name: &str, c_source: &str) -> Option<PathBuf> {
    if Command::new("cc").arg("--version").output().is_err() {
        eprintln!("skipped: no C compiler (cc) to build a fake libnccl");
        return None;
    }
    let src = dir.join(format!("{name}.c"));
    let lib = dir.join(format!("{name}.so"));
    std::fs::write(&src, c_source).unwrap();
    let out = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&src).output().unwrap();
    assert!(out.status.success(), "cc failed: {}", String::from_utf8_lossy(&out.stderr));
    Some(lib)
}

/// C for a library that reports `version` and defines `symbols` (each returning success).
fn fake_source(version: i32, symbols: &[&str]) -> String {
    let mut s = format!("int ncclGetVersion(int* v) {{ *v = {version}; return 0; }}\n");
    for sym in symbols {
        if *sym == "ncclGetVersion" {
            continue;
        }
        if *sym == "ncclGetErrorString" {
            s += "const char* ncclGetErrorString(int r) { return r == 4 ? \"invalid argument (fake)\" : \"fake error\"; }\n";
        } else if *sym == "ncclGetUniqueId" {
            // Fails with ncclInvalidArgument, to test the error path.
            s += "int ncclGetUniqueId(void* id) { return 4; }\n";
        } else {
            s += &format!("int {sym}() {{ return 0; }}\n");
        }
    }
    s
}

#[test]
fn missing_library_is_a_clear_error() {
    let e = Nccl::load(Some(Path::new("/nonexistent/dir/libnccl.so.2"))).err().expect("must fail");
    assert!(e.contains("/nonexistent/dir/libnccl.so.2") && e.contains("no such file"), "{e}");
    // A file that exists but is no library: the loader's own words come through.
    let d = workdir("garbage");
    let f = d.join("libnccl.so.2");
    std::fs::write(&f, b"not an ELF file").unwrap();
    let e = Nccl::load(Some(&f)).err().expect("must fail");
    assert!(e.contains(&f.display().to_string()), "{e}");
    assert!(e.to_lowercase().contains("elf") || e.contains("too short") || e.contains("invalid"), "{e}");
    // A folder is searched for the library.
    let e = Nccl::load(Some(&d.join("nothing-here"))).err().expect("must fail");
    assert!(e.contains("nothing-here"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_library_without_nccl_symbols_names_them() {
    let d = workdir("missing");
    // Not NCCL at all: no ncclGetVersion.
    let Some(lib) = build_lib(&d, "libnotnccl", "int something_else(void) { return 1; }\n") else { return };
    let e = Nccl::load(Some(&lib)).err().expect("must fail");
    assert!(e.contains("ncclGetVersion") && e.contains("not an NCCL library"), "{e}");
    // NCCL-like, but without two of the entry points the comparison calls.
    let some: Vec<&str> = REQUIRED.iter().copied().filter(|s| *s != "ncclAllReduce" && *s != "ncclRecv").collect();
    let lib = build_lib(&d, "libpartial", &fake_source(22809, &some)).unwrap();
    let e = Nccl::load(Some(&lib)).err().expect("must fail");
    assert!(e.contains("NCCL 2.28.9 lacks the symbols ncclAllReduce, ncclRecv"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_old_nccl_is_refused_with_its_version() {
    let d = workdir("old");
    let Some(lib) = build_lib(&d, "libold", &fake_source(21000, REQUIRED)) else { return };
    let e = Nccl::load(Some(&lib)).err().expect("must fail");
    assert!(e.contains("NCCL 2.10.0 is too old") && e.contains("2.19.0 or newer"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_complete_library_loads_and_reports_errors_by_name() {
    let d = workdir("ok");
    let Some(lib) = build_lib(&d, "libgood", &fake_source(22809, REQUIRED)) else { return };
    let n = Nccl::load(Some(&lib)).expect("loads");
    assert_eq!(n.version_string(), "2.28.9");
    assert_eq!(n.version(), 22809);
    assert!(n.path().ends_with("libgood.so"), "{}", n.path());
    // The optional collectives and registration calls are absent from this fake.
    assert!(!n.has_native_all_to_all() && !n.has_window_register() && !n.has_mem_alloc());
    let e = n.unique_id().err().expect("the fake fails ncclGetUniqueId");
    let s = e.to_string();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(s.contains("ncclGetUniqueId failed: ncclInvalidArgument (invalid argument (fake))"), "{s}");
    assert!(n.mem_alloc(64).unwrap_err().to_string().contains("has no ncclMemAlloc"));
    std::fs::remove_dir_all(&d).unwrap();
}
