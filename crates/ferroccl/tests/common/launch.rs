//! Runs ranks as child processes of the test binary itself, with a launcher's environment.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `n` processes running test `test_name` of this binary as ranks of one job;
/// `role` selects what the child does (read from FERROCCL_TEST_ROLE).
pub fn spawn_ranks(n: usize, test_name: &str, role: &str, extra: &[(&str, String)]) -> Vec<Child> {
    let port = free_port();
    (0..n)
        .map(|r| {
            rank_command(test_name, role, r, n, port, extra)
                .spawn()
                .unwrap()
        })
        .collect()
}

/// The command of rank `r` of `n` of a job whose root listens on `port`: this binary running
/// test `test_name` in role `role`, with a launcher's environment plus `extra`, output piped.
pub fn rank_command(
    test_name: &str,
    role: &str,
    r: usize,
    n: usize,
    port: u16,
    extra: &[(&str, String)],
) -> Command {
    // Any secret every rank shares will do; from the port, so two jobs differ.
    let secret: String = (0..32)
        .map(|i| b"0123456789abcdef"[(port as usize * 7 + i * 13) % 16] as char)
        .collect();
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
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (out.status.success(), text)
        })
        .collect()
}

/// Waits for every child and asserts that each exited 0 having printed `marker`.
pub fn assert_all_print(children: Vec<Child>, marker: &str) {
    for (r, (ok, text)) in wait_all(children).into_iter().enumerate() {
        assert!(ok && text.contains(marker), "rank {r}:\n{text}");
    }
}

/// A running job of rank processes whose output lines arrive with timestamps, rank by rank:
/// reports are "@@WORD ..." (libtest may print before them on the line) and are kept as
/// "WORD ..."; every other line is kept as "# line", for the transcript.
pub struct Job {
    kids: Vec<Child>,
    lines: std::sync::mpsc::Receiver<(usize, std::time::Instant, String)>,
    /// Every rank's lines so far.
    pub seen: Vec<Vec<(std::time::Instant, String)>>,
}

impl Job {
    /// `n` ranks running test `test_name` of this binary in role `role`, with `env` added.
    pub fn spawn(n: usize, test_name: &str, role: &str, env: &[(&str, String)]) -> Job {
        use std::io::{BufRead, BufReader};
        let port = free_port();
        let (tx, rx) = std::sync::mpsc::channel();
        let kids = (0..n)
            .map(|r| {
                let mut child = rank_command(test_name, role, r, n, port, env)
                    .stdin(Stdio::null())
                    .spawn()
                    .unwrap();
                for out in [
                    Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
                    Box::new(child.stderr.take().unwrap()),
                ] {
                    let tx = tx.clone();
                    std::thread::spawn(move || {
                        for line in BufReader::new(out).lines().map_while(Result::ok) {
                            let l = match line.find("@@") {
                                Some(i) => line[i + 2..].to_string(),
                                None => format!("# {line}"),
                            };
                            let _ = tx.send((r, std::time::Instant::now(), l));
                        }
                    });
                }
                child
            })
            .collect();
        Job {
            kids,
            lines: rx,
            seen: vec![Vec::new(); n],
        }
    }

    /// Collects lines until `pred` holds for those seen so far (true) or `until` passes (false).
    pub fn wait_for(
        &mut self,
        until: std::time::Instant,
        pred: impl Fn(&[Vec<(std::time::Instant, String)>]) -> bool,
    ) -> bool {
        loop {
            if pred(&self.seen) {
                return true;
            }
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            if let Ok((r, t, l)) = self
                .lines
                .recv_timeout(left.min(std::time::Duration::from_millis(20)))
            {
                self.seen[r].push((t, l));
            }
        }
    }

    /// Rank `r`'s first line starting with `prefix`.
    pub fn first(&self, r: usize, prefix: &str) -> Option<&(std::time::Instant, String)> {
        self.seen[r].iter().find(|(_, l)| l.starts_with(prefix))
    }

    /// Every line so far, for a failure's message.
    pub fn transcript(&self) -> String {
        let mut s = String::new();
        for (r, ls) in self.seen.iter().enumerate() {
            for (_, l) in ls {
                s += &format!("  [{r}] {l}\n");
            }
        }
        s
    }

    /// Sends `sig` to rank `r`'s process.
    pub fn signal(&self, r: usize, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.kids[r].id() as libc::pid_t, sig) };
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for k in &mut self.kids {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}

/// Whether every rank of `who` has printed a line starting with `prefix`.
pub fn has_all(seen: &[Vec<(std::time::Instant, String)>], who: &[usize], prefix: &str) -> bool {
    who.iter()
        .all(|&r| seen[r].iter().any(|(_, l)| l.starts_with(prefix)))
}
