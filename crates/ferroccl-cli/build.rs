//! Records the commit the binary was built from, so that every benchmark figure names it.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    if let Some(commit) = git(&["rev-parse", "HEAD"]) {
        println!("cargo:rustc-env=FERROCCL_GIT_COMMIT={commit}");
    }
    // Rebuild when HEAD moves: HEAD itself (branch switches, detached commits) and the refs
    // (new commits on the branch). In a worktree these live in different directories.
    if let Some(d) = git(&["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={d}/HEAD");
    }
    if let Some(d) = git(&["rev-parse", "--git-common-dir"]) {
        // A path that does not exist would make cargo rerun this script on every build.
        for p in [format!("{d}/refs/heads"), format!("{d}/packed-refs")] {
            if std::path::Path::new(&p).exists() {
                println!("cargo:rerun-if-changed={p}");
            }
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
