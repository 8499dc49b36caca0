//! The `ferroccl` command: benchmarks (nccl-tests style), a local launcher, machine info.

mod api;
mod bench;
mod best;
mod info;
mod launch;
mod machine;
mod nccl;
mod nccl_path;
mod plot;
mod size;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "ferroccl",
    version,
    about = "ferroccl: collective communication, measured and launched"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Cmd {
    /// Measure an operation over a sweep of sizes, printing nccl-tests' table
    Bench(bench::BenchArgs),
    /// Start N local processes with launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, ...)
    Run(launch::RunArgs),
    /// Print the machine and the transports a communicator would use
    Info(info::InfoArgs),
    /// Draw bus bandwidth and latency against size from `bench --json` records (SVG)
    Plot(plot::PlotArgs),
    /// Each library's best figure per operation and size over records and both halves, and the
    /// ratio (the README's tables: --md)
    Best(best::BestArgs),
    /// Print the path of the drop-in libnccl.so.2 built beside this binary (docs/NCCL.md)
    NcclPath(nccl_path::NcclPathArgs),
}

/// Logging for the whole process, library included. The CLI, not the library, reads these
/// variables: FERROCCL_LOG wins over RUST_LOG so ferroccl can be tuned inside a program that
/// uses RUST_LOG for itself.
fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let spec = std::env::var("FERROCCL_LOG")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("RUST_LOG").ok());
    let filter = spec
        .and_then(|s| EnvFilter::try_new(s).ok())
        .unwrap_or_else(|| EnvFilter::new("warn"));
    let colour = log_in_colour(
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
        std::env::var_os("NO_COLOR"),
    );
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .try_init();
}

/// Colour only for a person at a terminal: in a file or a pipe (a job's log) the escape codes
/// are noise to whoever reads or greps it. NO_COLOR, when set and not empty, turns it off
/// everywhere (no-color.org).
fn log_in_colour(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// The launcher's description of this process, if one started it.
pub fn launcher_env() -> Result<Option<ferroccl_core::LaunchEnv>, String> {
    ferroccl_core::LaunchEnv::from_env().map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, which turns `ferroccl bench ... | head` into a panic; a command-line
    // tool should end quietly like any other when its reader goes away.
    // SAFETY: setting a signal disposition to the default before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    init_tracing();
    let cli = Cli::parse();
    if let Cmd::Bench(a) = &cli.cmd {
        if bench::shares_a_gpu(a.devices.as_deref())
            && std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none()
        {
            // SAFETY: no thread exists yet, and CUDA reads the variable when it initialises.
            unsafe {
                std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", bench::SHARED_GPU_CONNECTIONS)
            };
        }
    }
    let config = match ferroccl_core::Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ferroccl: {e}");
            return ExitCode::from(2);
        }
    };
    let r = match &cli.cmd {
        Cmd::Bench(a) => bench::main(a, &config),
        Cmd::Run(a) => launch::main(a).map(ExitCode::from),
        Cmd::Info(a) => info::main(a, &config).map(|()| ExitCode::SUCCESS),
        Cmd::Plot(a) => plot::main(a).map(|()| ExitCode::SUCCESS),
        Cmd::Best(a) => best::main(a).map(|()| ExitCode::SUCCESS),
        Cmd::NcclPath(a) => nccl_path::main(a).map(|()| ExitCode::SUCCESS),
    };
    r.unwrap_or_else(|e| {
        eprintln!("ferroccl: {e}");
        ExitCode::from(2)
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn logs_are_coloured_only_at_a_terminal_without_no_color() {
        use super::log_in_colour;
        assert!(log_in_colour(true, None));
        assert!(
            log_in_colour(true, Some("".into())),
            "an empty NO_COLOR does not count"
        );
        assert!(!log_in_colour(true, Some("1".into())));
        assert!(!log_in_colour(false, None));
        assert!(!log_in_colour(false, Some("1".into())));
    }
}
