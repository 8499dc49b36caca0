//! `ferroccl nccl-path`: where the drop-in libnccl.so.2 built beside this binary is, and the
//! ways to make a program use it.

use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct NcclPathArgs {}

/// Where cargo and an install put the library, relative to this executable's directory.
pub fn candidates(exe_dir: &Path) -> Vec<PathBuf> {
    vec![
        exe_dir.join("libnccl.so"),
        exe_dir.join("libnccl.so.2"),
        exe_dir.join("../lib/libnccl.so.2"),
        exe_dir.join("../lib/libnccl.so"),
    ]
}

pub fn main(_: &NcclPathArgs) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let dir = exe.parent().ok_or("this program has no directory")?;
    let Some(lib) = candidates(dir).into_iter().find(|p| p.is_file()) else {
        return Err(format!(
            "no libnccl.so beside {} (looked for {}): build it with `cargo build --release -p ferroccl-nccl`",
            exe.display(),
            candidates(dir).iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ));
    };
    let lib = lib.canonicalize().unwrap_or(lib);
    println!("{}", lib.display());
    eprintln!("use it with: LD_PRELOAD={} <program>   (or copy it over site-packages/nvidia/nccl/lib/libnccl.so.2 for PyTorch; see docs/NCCL.md)", lib.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_is_looked_for_beside_the_binary_and_in_lib() {
        let c = candidates(Path::new("/opt/x/bin"));
        assert_eq!(c[0], Path::new("/opt/x/bin/libnccl.so"));
        assert!(c
            .iter()
            .any(|p| p == Path::new("/opt/x/bin/../lib/libnccl.so.2")));
    }
}
