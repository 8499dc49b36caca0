//! The ways docs/NCCL.md tells users to switch a program to ferroccl, tried on a program built
//! the way PyTorch's wheels are: linked against `libnccl.so.2` with an RPATH (not RUNPATH) to
//! the directory of "NVIDIA's" library (here a stand-in that reports version 1). The RPATH
//! beats LD_LIBRARY_PATH, so that alone does not switch it; LD_PRELOAD does, and so does
//! copying ours over the file the RPATH points at.

mod common;

use common::library_path as ours;
use std::path::Path;
use std::process::Command;

fn cc(args: &[&str]) {
    let st = Command::new("cc")
        .args(args)
        .status()
        .expect("a C compiler");
    assert!(st.success(), "cc {args:?}");
}

/// Runs the program; what it prints: the version the loaded libnccl reports.
fn run(prog: &Path, env: &[(&str, &str)]) -> String {
    let out = Command::new(prog)
        .env("FERROCCL_NCCL_BACKEND", "host")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn ld_preload_or_replacing_the_rpath_target_switches_ld_library_path_does_not() {
    let dir = std::env::temp_dir().join(format!("ferroccl-switch-{}", std::process::id()));
    let nvidia = dir.join("site-packages/nvidia/nccl/lib");
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(&nvidia).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    // The stand-in for NVIDIA's library: same SONAME, version 1.
    let fake_c = dir.join("fake.c");
    std::fs::write(
        &fake_c,
        "int ncclGetVersion(int* v) { *v = 1; return 0; }\n",
    )
    .unwrap();
    let fake = nvidia.join("libnccl.so.2");
    cc(&[
        "-shared",
        "-fPIC",
        "-Wl,-soname,libnccl.so.2",
        "-o",
        fake.to_str().unwrap(),
        fake_c.to_str().unwrap(),
    ]);
    // The program, linked as PyTorch's libtorch_cuda.so is: NEEDED libnccl.so.2, RPATH there.
    let prog_c = dir.join("prog.c");
    std::fs::write(
        &prog_c,
        "#include <stdio.h>\n#include \"nccl.h\"\nint main(void) { int v = 0; if (ncclGetVersion(&v) != ncclSuccess) return 1; printf(\"%d\\n\", v); return 0; }\n",
    )
    .unwrap();
    let prog = dir.join("prog");
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
    let rpath = format!("-Wl,-rpath,{}", nvidia.display());
    cc(&[
        "-I",
        include,
        "-o",
        prog.to_str().unwrap(),
        prog_c.to_str().unwrap(),
        "-L",
        nvidia.to_str().unwrap(),
        "-l:libnccl.so.2",
        &rpath,
        "-Wl,--disable-new-dtags",
    ]);
    let version = ferroccl_core::nccl_abi::API_VERSION.to_string();
    assert_eq!(run(&prog, &[]), "1", "the program runs on the stand-in");

    // LD_LIBRARY_PATH: loses to the RPATH.
    std::os::unix::fs::symlink(ours(), elsewhere.join("libnccl.so.2")).unwrap();
    assert_eq!(
        run(&prog, &[("LD_LIBRARY_PATH", elsewhere.to_str().unwrap())]),
        "1"
    );
    // LD_PRELOAD: ours answers (its SONAME satisfies the program's NEEDED entry).
    let ours = ours();
    assert_eq!(
        run(&prog, &[("LD_PRELOAD", ours.to_str().unwrap())]),
        version
    );
    // Replacing the file the RPATH points at (keeping the original aside).
    std::fs::rename(&fake, nvidia.join("libnccl.so.2.nvidia")).unwrap();
    std::fs::copy(&ours, &fake).unwrap();
    assert_eq!(run(&prog, &[]), version);
    std::fs::remove_dir_all(&dir).unwrap();
}
