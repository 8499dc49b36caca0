//! `ferroccl run -n N CMD...`: a local launcher in the torchrun convention, so that any
//! program using `Comm::from_env` (and the bench itself) runs as N processes on this host.

use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// The SIGTERM or SIGINT the launcher received (0: none), for its loop to pass on to the ranks.
static FORWARD: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    FORWARD.store(sig, Ordering::SeqCst);
}

/// SIGTERM and SIGINT go to the ranks rather than ending the launcher (which would orphan them).
fn catch_signals() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// A rank's command: it dies with the launcher. If the launcher is killed (SIGKILL gives it no
/// chance to pass anything on), the kernel sends every rank SIGKILL instead of leaving it
/// running under init; a rank whose launcher died before the request took effect exits at once.
fn rank_command(cmd: &[String], env: Vec<(String, String)>) -> Command {
    let launcher = std::process::id() as libc::pid_t;
    let mut c = Command::new(&cmd[0]);
    c.args(&cmd[1..]).envs(env);
    // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid, _exit).
    unsafe {
        c.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    c
}

#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Number of processes (ranks)
    #[arg(short = 'n', long = "nproc", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub n: u32,
    /// Seconds the other ranks get to exit on their own after one fails, before they are killed
    #[arg(long, default_value_t = 10.0)]
    pub grace: f64,
    /// The program and its arguments
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true, num_args = 1..)]
    pub cmd: Vec<String>,
}

/// The environment of rank `rank`: torchrun's variables plus the job secret that makes the
/// rendezvous authenticated.
pub fn child_env(rank: usize, n: usize, port: u16, secret: &[u8; 16]) -> Vec<(String, String)> {
    let secret_hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    vec![
        ("RANK".into(), rank.to_string()),
        ("WORLD_SIZE".into(), n.to_string()),
        ("LOCAL_RANK".into(), rank.to_string()),
        ("LOCAL_WORLD_SIZE".into(), n.to_string()),
        ("MASTER_ADDR".into(), "127.0.0.1".into()),
        ("MASTER_PORT".into(), port.to_string()),
        ("FERROCCL_JOB_SECRET".into(), secret_hex),
        // Messages and headers name this launcher, not torchrun, whose variables it shares.
        ("FERROCCL_LAUNCHER".into(), "ferroccl run".into()),
    ]
}

/// A port that was free a moment ago. Rank 0 binds it again shortly; another process could take
/// it in between, which then shows as a clear bind error in rank 0, not as a hang.
fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| format!("finding a free port: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

fn new_secret() -> Result<[u8; 16], String> {
    let mut s = [0u8; 16];
    getrandom::getrandom(&mut s).map_err(|e| format!("no randomness for the job secret: {e}"))?;
    Ok(s)
}

pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!(
            "signal {s}{}",
            signal_name(s).map_or(String::new(), |n| format!(" ({n})"))
        ),
        _ => format!("{status}"),
    }
}

fn signal_name(s: i32) -> Option<&'static str> {
    Some(match s {
        libc::SIGINT => "SIGINT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGPIPE => "SIGPIPE",
        _ => return None,
    })
}

/// Runs the job; Ok(code) is this launcher's exit code.
pub fn main(a: &RunArgs) -> Result<u8, String> {
    let n = a.n as usize;
    let port = free_port()?;
    let secret = new_secret()?;
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    catch_signals();
    for rank in 0..n {
        let spawned = rank_command(&a.cmd, child_env(rank, n, port, &secret)).spawn();
        match spawned {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("starting rank {rank} ('{}'): {e}", a.cmd[0]));
            }
        }
    }
    tracing::debug!(
        "started {n} ranks of {:?}, rendezvous on 127.0.0.1:{port}",
        a.cmd
    );

    let grace = Duration::from_secs_f64(a.grace.max(0.0));
    let mut first_failure: Option<(usize, String)> = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    let mut forwarded = 0;
    while children.iter().any(Option::is_some) {
        let sig = FORWARD.swap(0, Ordering::SeqCst);
        if sig != 0 {
            eprintln!(
                "ferroccl run: {} received; passing it on to every rank",
                signal_name(sig).unwrap_or("a signal")
            );
            for c in children.iter().flatten() {
                // SAFETY: a signal to a child of ours that has not been reaped yet.
                unsafe { libc::kill(c.id() as libc::pid_t, sig) };
            }
            forwarded = sig;
            kill_at.get_or_insert(Instant::now() + grace);
        }
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            match c.try_wait() {
                Ok(Some(st)) => {
                    *slot = None;
                    if !st.success() && first_failure.is_none() {
                        let d = describe(st);
                        eprintln!("ferroccl run: rank {rank} failed ({d}); the other ranks get {:.0} s to exit", grace.as_secs_f64());
                        first_failure = Some((rank, d));
                        kill_at = Some(Instant::now() + grace);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("ferroccl run: waiting for rank {rank}: {e}");
                    *slot = None;
                    first_failure.get_or_insert((rank, format!("wait error: {e}")));
                    kill_at.get_or_insert(Instant::now() + grace);
                }
            }
        }
        if !killed && kill_at.is_some_and(|t| Instant::now() >= t) {
            killed = true;
            for (rank, c) in children.iter_mut().enumerate() {
                if let Some(c) = c {
                    eprintln!("ferroccl run: killing rank {rank} (pid {})", c.id());
                    let _ = c.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if forwarded != 0 {
        eprintln!(
            "ferroccl run: ended by {}",
            signal_name(forwarded).unwrap_or("a signal")
        );
        return Ok(128 + forwarded as u8);
    }
    match first_failure {
        None => Ok(0),
        Some((rank, d)) => {
            eprintln!("ferroccl run: failed: rank {rank} ended with {d}");
            Ok(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn child_environment_is_torchrun_compatible() {
        let secret: [u8; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0xff];
        let env: HashMap<String, String> = child_env(2, 4, 29500, &secret).into_iter().collect();
        assert_eq!(env["RANK"], "2");
        assert_eq!(env["WORLD_SIZE"], "4");
        assert_eq!(env["LOCAL_RANK"], "2");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "4");
        assert_eq!(env["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(env["MASTER_PORT"], "29500");
        assert_eq!(
            env["FERROCCL_JOB_SECRET"],
            "000102030405060708090a0b0c0d0eff"
        );
        // What the library will make of it.
        let l = ferroccl_core::LaunchEnv::from_vars(&env).unwrap().unwrap();
        assert_eq!(
            (l.rank, l.world_size, l.master_port, l.source),
            (2, 4, 29500, "ferroccl run")
        );
        let c = ferroccl_core::Config::from_vars(&env).unwrap();
        assert_eq!(c.job_secret, Some(secret));
    }

    #[test]
    fn secrets_are_fresh() {
        assert_ne!(new_secret().unwrap(), new_secret().unwrap());
    }

    #[test]
    fn statuses_name_signals() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(describe(ExitStatus::from_raw(3 << 8)), "exit code 3");
        assert_eq!(
            describe(ExitStatus::from_raw(libc::SIGKILL)),
            "signal 9 (SIGKILL)"
        );
    }
}
