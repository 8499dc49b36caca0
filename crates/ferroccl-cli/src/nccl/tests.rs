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
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    let e = Nccl::load(Some(Path::new("/nonexistent/dir/libnccl.so.2")))
        .err()
        .expect("must fail");
    assert!(
        e.contains("/nonexistent/dir/libnccl.so.2") && e.contains("no such file"),
        "{e}"
    );
    // A file that exists but is no library: the loader's own words come through.
    let d = workdir("garbage");
    let f = d.join("libnccl.so.2");
    std::fs::write(&f, b"not an ELF file").unwrap();
    let e = Nccl::load(Some(&f)).err().expect("must fail");
    assert!(e.contains(&f.display().to_string()), "{e}");
    assert!(
        e.to_lowercase().contains("elf") || e.contains("too short") || e.contains("invalid"),
        "{e}"
    );
    // A folder is searched for the library.
    let e = Nccl::load(Some(&d.join("nothing-here")))
        .err()
        .expect("must fail");
    assert!(e.contains("nothing-here"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_library_without_nccl_symbols_names_them() {
    let d = workdir("missing");
    // Not NCCL at all: no ncclGetVersion.
    let Some(lib) = build_lib(&d, "libnotnccl", "int something_else(void) { return 1; }\n") else {
        return;
    };
    let e = Nccl::load(Some(&lib)).err().expect("must fail");
    assert!(
        e.contains("ncclGetVersion") && e.contains("not an NCCL library"),
        "{e}"
    );
    // NCCL-like, but without two of the entry points the comparison calls.
    let some: Vec<&str> = REQUIRED
        .iter()
        .copied()
        .filter(|s| *s != "ncclAllReduce" && *s != "ncclRecv")
        .collect();
    let lib = build_lib(&d, "libpartial", &fake_source(22809, &some)).unwrap();
    let e = Nccl::load(Some(&lib)).err().expect("must fail");
    assert!(
        e.contains("NCCL 2.28.9 lacks the symbols ncclAllReduce, ncclRecv"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_old_nccl_is_refused_with_its_version() {
    let d = workdir("old");
    let Some(lib) = build_lib(&d, "libold", &fake_source(21000, REQUIRED)) else {
        return;
    };
    let e = Nccl::load(Some(&lib)).err().expect("must fail");
    assert!(
        e.contains("NCCL 2.10.0 is too old") && e.contains("2.19.0 or newer"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_complete_library_loads_and_reports_errors_by_name() {
    let d = workdir("ok");
    let Some(lib) = build_lib(&d, "libgood", &fake_source(22809, REQUIRED)) else {
        return;
    };
    let n = Nccl::load(Some(&lib)).expect("loads");
    assert_eq!(n.version_string(), "2.28.9");
    assert_eq!(n.version(), 22809);
    assert!(n.path().ends_with("libgood.so"), "{}", n.path());
    // The optional collectives and registration calls are absent from this fake.
    assert!(!n.has_native_all_to_all() && !n.has_window_register() && !n.has_mem_alloc());
    let e = n.unique_id().err().expect("the fake fails ncclGetUniqueId");
    let s = e.to_string();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(
        s.contains("ncclGetUniqueId failed: ncclInvalidArgument (invalid argument (fake))"),
        "{s}"
    );
    assert!(n
        .mem_alloc(64)
        .unwrap_err()
        .to_string()
        .contains("has no ncclMemAlloc"));
    std::fs::remove_dir_all(&d).unwrap();
}

/// NCCL 2.28 queues a window registration made inside a group and writes the window through
/// the caller's out-pointer only at ncclGroupEnd (its dev_runtime's registration task keeps
/// the pointer). The bench registers both buffers of every rank in one group, so each window
/// needs a slot that outlives the call: a stack slot was written after its frame was gone, and
/// `bench --register --vs-nccl` on 2 GPUs died before printing a line. This fake defers the
/// writes the same way and checks that every window comes back to deregistration.
#[test]
fn windows_registered_in_a_group_are_written_at_its_end_and_deregistered() {
    let d = workdir("window");
    let generic: Vec<&str> = REQUIRED
        .iter()
        .copied()
        .filter(|s| *s != "ncclGroupStart" && *s != "ncclGroupEnd")
        .collect();
    let src = fake_source(22809, &generic)
        + r#"
#include <stddef.h>
static int in_group = 0, queued = 0, live = 0;
static void** outs[16];
static void* bufs[16];
int ncclGroupStart(void) { in_group++; return 0; }
int ncclGroupEnd(void) {
    if (in_group == 0) return 5;
    if (--in_group == 0) {
        for (int i = 0; i < queued; i++) { *outs[i] = (char*)bufs[i] + 1; live++; }
        queued = 0;
    }
    return 0;
}
int ncclMemAlloc(void** p, size_t n) { return 0; }
int ncclMemFree(void* p) { return 0; }
int ncclCommWindowRegister(void* comm, void* buf, size_t n, void** win, int flags) {
    if (win == NULL || flags != 1 || queued == 16) return 4;
    if (in_group) { outs[queued] = win; bufs[queued] = buf; queued++; }
    else { *win = (char*)buf + 1; live++; }
    return 0;
}
int ncclCommWindowDeregister(void* comm, void* win) {
    if (win == NULL || live == 0) return 4;
    live--;
    return 0;
}
"#;
    let Some(lib) = build_lib(&d, "libwin", &src) else {
        return;
    };
    let n = Nccl::load(Some(&lib)).expect("loads");
    assert!(n.has_window_register());
    let comm = NcclComm(std::ptr::dangling_mut::<c_void>());
    n.group_start().unwrap();
    // Room for one: every push after the first moves the registrations already in it, before
    // the group ends, and the windows' slots must not move with them.
    let mut regs = Vec::with_capacity(1);
    for buf in [0x1000usize, 0x2000, 0x3000] {
        // SAFETY: the fake never touches the buffer.
        regs.push(unsafe { n.register(comm, buf as *mut c_void, 64, true) }.unwrap());
    }
    n.group_end().unwrap();
    for (r, buf) in regs.iter().zip([0x1000usize, 0x2000, 0x3000]) {
        match r {
            Registration::Window(w) => assert_eq!(
                **w as usize,
                buf + 1,
                "the window NCCL wrote at ncclGroupEnd"
            ),
            Registration::Local(_) => panic!("a symmetric registration gave a local one"),
        }
    }
    for r in &regs {
        n.deregister(comm, r).unwrap();
    }
    // A window NCCL never wrote is an error, not a null handle passed back to it.
    let empty = Registration::Window(Box::new(std::ptr::null_mut()));
    assert!(n
        .deregister(comm, &empty)
        .unwrap_err()
        .to_string()
        .contains("gave no window"));
    std::fs::remove_dir_all(&d).unwrap();
}
