//! Runs ranks as child processes of the test binary itself, with a launcher's environment.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts `n` processes running test `test_name` of this binary as ranks of one job;
/// `role` selects what the child does (read from FERROCCL_TEST_ROLE).
pub fn spawn_ranks(n: usize, test_name: &str, role: &str, extra: &[(&str, String)]) -> Vec<Child> {
    let port = free_port();
    (0..n).map(|r| rank_command(test_name, role, r, n, port, extra).spawn().unwrap()).collect()
}

/// The command of rank `r` of `n` of a job whose root listens on `port`: this binary running
/// test `test_name` in role `role`, with a launcher's environment plus `extra`, output piped.
pub fn rank_command(test_name: &str, role: &str, r: usize, n: usize, port: u16, extra: &[(&str, String)]) -> Command {
    // Any secret every rank shares will do; from the port, so two jobs differ.
    let secret: String = (0..32).map(|i| b"0123456789abcdef"[(port as usize * 7 + i * 13) % 16] as char).collect();
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test_name, "--nocapture", "--test-threads=1"])
        .env("FERROCCL_TEST_ROLE", role)
        .env("RANK", r.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("LOCAL_RANK", r.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("FERROCCL_JOB_SECRET", &secret)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra {
        c.env(k, v);
    }
    c
}

/// The role this process plays, if it is a child.
pub fn role() -> Option<String> {
    std::env::var("FERROCCL_TEST_ROLE").ok()
}

/// Waits for every child; returns (exit success, stdout + stderr) per rank.
pub fn wait_all(children: Vec<Child>) -> Vec<(bool, String)> {
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            (out.status.success(), text)
        })
        .collect()
}
