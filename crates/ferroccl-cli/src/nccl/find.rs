//! Where `libnccl.so.2` is: the path the user gave, else the system loader's, else the one the
//! machine's Python `nvidia-nccl` package ships (`site-packages/nvidia/nccl/lib`), which is
//! where PyTorch installs put it.

use std::path::{Path, PathBuf};
use std::process::Command;

pub const SONAME: &str = "libnccl.so.2";

/// What to try to load, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Candidate {
    /// A path the user named (a file, or a folder holding `libnccl.so.2` or `lib/libnccl.so.2`).
    Explicit(PathBuf),
    /// The bare soname, resolved by the dynamic loader (LD_LIBRARY_PATH, ld.so.cache).
    Loader,
    /// Found under a Python package folder.
    Python(PathBuf),
}

/// The file to load for a user-given path: a folder is searched for the library.
pub fn resolve_explicit(p: &Path) -> PathBuf {
    if p.is_dir() {
        for rel in [SONAME, "lib/libnccl.so.2", "libnccl.so"] {
            let c = p.join(rel);
            if c.exists() {
                return c;
            }
        }
        return p.join(SONAME);
    }
    p.to_path_buf()
}

/// Folders where Python keeps packages, asked of `python3` itself (it knows its virtual
/// environments and user site); empty when there is no python3.
fn python_package_dirs() -> Vec<PathBuf> {
    // The nvidia.nccl package is a namespace package in some releases (no __file__), so its
    // __path__ is asked first; the site folders cover installs that import fails on.
    let script = "import sys, site\n\
        try:\n    import nvidia.nccl as n; print(list(n.__path__)[0] + '/..')\nexcept Exception:\n    pass\n\
        d = []\n\
        try:\n    d += site.getsitepackages() + [site.getusersitepackages()]\nexcept Exception:\n    pass\n\
        print('\\n'.join(p + '/nvidia' for p in d + sys.path if p))\n";
    let Ok(out) = Command::new("python3").arg("-c").arg(script).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| PathBuf::from(l.trim()))
        .filter(|p| !p.as_os_str().is_empty())
        .collect()
}

/// `<nvidia>/nccl/lib/libnccl.so.2` for each `nvidia` package folder that has one, deduplicated.
pub fn python_candidates_in(nvidia_dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for d in nvidia_dirs {
        let c = d.join("nccl").join("lib").join(SONAME);
        if c.exists() {
            let c = c.canonicalize().unwrap_or(c);
            if !out.contains(&c) {
                out.push(c);
            }
        }
    }
    out
}

/// The search order for `--vs-nccl [PATH]`.
pub fn candidates(explicit: Option<&Path>) -> Vec<Candidate> {
    if let Some(p) = explicit {
        return vec![Candidate::Explicit(resolve_explicit(p))];
    }
    let mut v = vec![Candidate::Loader];
    v.extend(
        python_candidates_in(&python_package_dirs())
            .into_iter()
            .map(Candidate::Python),
    );
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_layout_is_found_and_deduplicated() {
        let t = std::env::temp_dir().join(format!("ferroccl-find-{}", std::process::id()));
        let lib = t.join("site/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join(SONAME), b"x").unwrap();
        let nv = t.join("site/nvidia");
        let found = python_candidates_in(&[nv.clone(), nv.clone(), t.join("elsewhere/nvidia")]);
        assert_eq!(found.len(), 1);
        assert!(
            found[0].ends_with("nvidia/nccl/lib/libnccl.so.2"),
            "{found:?}"
        );
        // A folder given by the user is searched for the library.
        assert!(resolve_explicit(&t.join("site/nvidia/nccl")).ends_with("nccl/lib/libnccl.so.2"));
        assert_eq!(resolve_explicit(&lib.join(SONAME)), lib.join(SONAME));
        std::fs::remove_dir_all(&t).unwrap();
    }

    #[test]
    fn explicit_path_is_the_only_candidate() {
        let c = candidates(Some(Path::new("/nonexistent/libnccl.so.2")));
        assert_eq!(
            c,
            vec![Candidate::Explicit(PathBuf::from(
                "/nonexistent/libnccl.so.2"
            ))]
        );
    }
}
