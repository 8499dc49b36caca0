//! Log lines are plain text when stderr is not a terminal (a file, a pipe, a job's log): colour
//! codes there are noise for whoever reads or greps the log.

use std::net::TcpListener;
use std::process::Command;

/// `ferroccl info` as rank 0 of a one-rank job with no job secret: the rendezvous logs a warning
/// (the job is unauthenticated) on its way.
fn info_warning(extra_env: &[(&str, &str)]) -> String {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferroccl"));
    c.arg("info")
        .env_remove("FERROCCL_JOB_SECRET")
        .env_remove("NO_COLOR")
        .env_remove("FERROCCL_LOG")
        .env_remove("RUST_LOG")
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
        ])
        .envs(extra_env.iter().copied());
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        err.contains("WARN") && err.contains("unauthenticated"),
        "no warning logged ({:?}): {err}",
        out.status
    );
    err
}

#[test]
fn log_lines_to_a_pipe_carry_no_colour_codes() {
    let err = info_warning(&[]);
    assert!(
        !err.contains('\x1b'),
        "colour codes in a piped log: {err:?}"
    );
    // NO_COLOR changes nothing here (no terminal), and must not break logging either.
    let err = info_warning(&[("NO_COLOR", "1")]);
    assert!(!err.contains('\x1b'), "{err:?}");
}
