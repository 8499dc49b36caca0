//! `ferroccl run` ends with its ranks: SIGTERM and SIGINT are passed on to them, and a launcher
//! killed outright takes them along (the kernel's parent-death signal), instead of leaving them
//! running under init.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Starts `ferroccl run -n 2` on ranks that write their pid and sleep; returns the launcher and
/// the ranks' pids.
fn start(dir: &std::path::Path) -> (Child, Vec<i32>) {
    let pids = dir.join("pids");
    let launcher = Command::new(env!("CARGO_BIN_EXE_ferroccl"))
        .args([
            "run",
            "-n",
            "2",
            "sh",
            "-c",
            &format!("echo $$ >> {}; exec sleep 60", pids.display()),
        ])
        .spawn()
        .unwrap();
    let mut launcher = launcher;
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let got: Vec<i32> = std::fs::read_to_string(&pids)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if got.len() == 2 {
            return (launcher, got);
        }
        if Instant::now() >= until {
            // Not left running (nor as a zombie) by a failed test.
            let _ = launcher.kill();
            let _ = launcher.wait();
            panic!("the ranks did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Gone, or a zombie waiting for a reaper: either way no longer running.
fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

fn all_end_within(pids: &[i32], limit: Duration) -> Duration {
    let t = Instant::now();
    while pids.iter().any(|&p| running(p)) {
        assert!(
            t.elapsed() < limit,
            "ranks {pids:?} still running after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    t.elapsed()
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferroccl-run-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn sigterm_and_sigint_reach_the_ranks() {
    for (sig, tag) in [(libc::SIGTERM, "term"), (libc::SIGINT, "int")] {
        let dir = temp_dir(tag);
        let (mut launcher, pids) = start(&dir);
        // SAFETY: a signal to the launcher we started.
        unsafe { libc::kill(launcher.id() as i32, sig) };
        let took = all_end_within(&pids, Duration::from_secs(2));
        let st = launcher.wait().unwrap();
        eprintln!("signal {sig}: ranks gone after {took:?}; launcher {st:?}");
        assert_eq!(
            st.code(),
            Some(128 + sig),
            "the launcher reports the signal"
        );
    }
}

#[test]
fn a_killed_launcher_takes_its_ranks_along() {
    let dir = temp_dir("kill");
    let (mut launcher, pids) = start(&dir);
    launcher.kill().unwrap();
    let _ = launcher.wait();
    let took = all_end_within(&pids, Duration::from_secs(2));
    eprintln!("SIGKILL to the launcher: ranks gone after {took:?}");
}

/// The bench's header names the launcher that started it: `ferroccl run`, not torchrun (whose
/// variables it sets).
#[test]
fn the_bench_under_ferroccl_run_names_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferroccl"))
        .args([
            "run",
            "-n",
            "2",
            env!("CARGO_BIN_EXE_ferroccl"),
            "bench",
            "all-reduce",
            "-b",
            "8",
            "-e",
            "64",
            "-n",
            "1",
            "-w",
            "0",
        ])
        .env("FERROCCL_TRANSPORT", "tcp")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("ferroccl run launcher") && !text.contains("torchrun"),
        "{text}"
    );
}
