//! `ferroccl bench`: nccl-tests' perf tests for every operation, on ferroccl alone or beside
//! NVIDIA's NCCL (`--vs-nccl`: both timed in one run, on the same GPUs, the same buffers unless
//! `--register`, and the same CUDA streams, size by size, so that clock and thermal drift hit
//! both).
//!
//! One runner for both: `setup` builds the job (the launch mode's communicators, NCCL's beside
//! them, every rank's buffers), `sweep` measures every row with each library in turn, `report`
//! prints the table, `memory` reads what each library held beside NCCL, and `record` writes the
//! JSON record.

mod cuda;
mod libs;
mod memory;
pub mod op;
mod rank;
pub mod record;
mod report;
mod setup;
mod spec;
mod sweep;
pub mod table;
mod vs_table;

use crate::api::Config;
use crate::size::parse_size;
use libs::NcclSide;
use record::VsRecord;
use report::{Reporter, Rows};
use setup::Job;
use spec::Spec;
use std::path::PathBuf;
use std::process::ExitCode;
use sweep::Runner;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// all-reduce, all-gather, reduce-scatter, broadcast, reduce, alltoall, gather, scatter,
    /// sendrecv, or all
    pub op: String,
    /// Smallest size in bytes (K, M, G suffixes; the largest buffer, as in nccl-tests)
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    pub min: usize,
    /// Largest size in bytes
    #[arg(short = 'e', long = "maxbytes", default_value = "8M", value_parser = parse_size)]
    pub max: usize,
    /// Multiply the size by this from one row to the next (1: add --stepbytes instead)
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub factor: usize,
    /// Bytes added from one row to the next when the factor is 1
    #[arg(short = 'i', long = "stepbytes", default_value = "1M", value_parser = parse_size)]
    pub step: usize,
    /// Timed iterations per row
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub iters: u64,
    /// Untimed iterations before them
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub warmup: u64,
    /// Element type (float, half, bfloat16, int32, ...; all for the 12 types)
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub dtype: String,
    /// Reduction (sum, prod, max, min, avg, premulsum (by 2); all for the six, as nccl-tests)
    #[arg(short = 'o', long = "redop", default_value = "sum")]
    pub redop: String,
    /// Root of broadcast, reduce, gather and scatter
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub root: usize,
    /// Fill inputs with verifiable data and count wrong output elements after every iteration
    #[arg(long)]
    pub check: bool,
    /// Ranks (threads of this process) when no launcher started us
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Run on this many GPUs of this host (one rank each, driven by this process); under a
    /// launcher, any value above 0 puts each process on GPU LOCAL_RANK. 0: host memory.
    /// Default: every GPU there is (under a launcher: GPU LOCAL_RANK), else host memory.
    #[arg(short = 'g', long = "gpus")]
    pub gpus_arg: Option<usize>,
    /// What `-g` resolved to (`BenchArgs::resolve`).
    #[arg(skip)]
    pub gpus: usize,
    /// One rank per listed GPU ordinal, driven by this process (instead of -g): an ordinal may
    /// repeat, so that a one-GPU machine runs several ranks (`--devices 0,0`) to check the
    /// kernels' multi-rank paths. Not with a launcher or --vs-nccl
    #[arg(long, value_name = "ORDINALS", value_delimiter = ',', conflicts_with_all = ["gpus_arg", "vs_nccl"])]
    pub devices: Option<Vec<usize>>,
    /// One thread drives every rank of this process: each iteration is one group over all
    /// communicators (nccl-tests' -g). Default: a thread per rank (nccl-tests' -t).
    #[arg(long)]
    pub one_thread: bool,
    /// Also write every row, the machine and the commit to this JSON file
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Time NVIDIA's NCCL beside ferroccl on the same GPUs, buffers and streams (needs -g).
    /// PATH: libnccl.so.2 or its folder; default: the system loader's, then the Python
    /// package nvidia-nccl's
    #[arg(long = "vs-nccl", value_name = "PATH", num_args = 0..=1, default_missing_value = "")]
    pub vs_nccl: Option<String>,
    /// Capture each row's iterations in a CUDA graph and time N replays of it (nccl-tests'
    /// -G N); beside NCCL for both libraries. GPUs only; alone, not with --check
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub graph: u64,
    /// Registered buffers (nccl-tests' -R): ferroccl's from ferroccl::mem, registered as
    /// windows (zero-copy: peers write straight into them); with --vs-nccl NCCL's from
    /// ncclMemAlloc, registered as symmetric windows (default where NCCL has them) or with
    /// ncclCommRegister ("local")
    #[arg(long, value_name = "KIND", num_args = 0..=1, default_missing_value = "auto")]
    pub register: Option<String>,
    /// Where unregistered GPU buffers come from, for both libraries: `cumem` (cuMemCreate with
    /// POSIX fd handles, which ferroccl lends to its peers on the fly by descriptor) or `driver`
    /// (cuMemAlloc, as cudaMalloc and PyTorch's default allocator give: lent by CUDA IPC handle to
    /// peers in other processes, reached through peer access by peers in this one). Not with
    /// --register
    #[arg(long, value_enum, default_value_t = spec::Buffers::Cumem)]
    pub buffers: spec::Buffers,
    /// Run ferroccl with at most N thread blocks per collective (its GPU channels)
    #[arg(long = "max-ctas", value_name = "N")]
    pub max_ctas: Option<usize>,
    /// Fewer iterations for large rows: a row of S bytes runs min(-n, max(1, BYTES / S))
    /// timed iterations (and no more warm-ups than that)
    #[arg(long = "iter-budget", value_name = "BYTES", value_parser = parse_size)]
    pub iter_budget: Option<usize>,
}

impl BenchArgs {
    /// Fills `gpus`: `-g` when given, else the GPUs this host has (`visible`), so the main job
    /// runs on GPUs wherever there are some and on the host backend elsewhere.
    pub fn resolve(mut self, visible: impl FnOnce() -> usize) -> BenchArgs {
        self.gpus = match &self.devices {
            Some(d) => d.len(),
            None => self.gpus_arg.unwrap_or_else(visible),
        };
        self
    }
}

/// Whether `--devices` puts several ranks on one GPU.
pub fn shares_a_gpu(devices: Option<&[usize]>) -> bool {
    devices.is_some_and(|d| d.iter().enumerate().any(|(i, g)| d[..i].contains(g)))
}

/// `CUDA_DEVICE_MAX_CONNECTIONS` when ranks share a GPU (unless the user set it). Every rank's
/// kernel waits for the other ranks' kernels of the same operation, which run on other streams
/// of the same context; the driver feeds streams to the GPU through a few hardware queues (8 by
/// default), and two ranks' streams sharing one queue can put one rank's next kernel in front
/// of the other rank's current one, which it waits for: a hang until the deadline. Measured on
/// one H100 (`bench/results/h100x1-2026-11-25-s7-copy-engine/`, exp32): with one queue, 4 of 6
/// fresh runs hung; with 32, none of 6 (and 3 of 44 in other runs: more streams than queues
/// still share).
pub const SHARED_GPU_CONNECTIONS: &str = "32";

/// Runs the benchmark; the exit code says whether it ran and every element was right.
pub fn main(args: &BenchArgs, config: &Config) -> Result<ExitCode, String> {
    // No driver, or no GPU: the host backend.
    let args = &args
        .clone()
        .resolve(|| ferroccl::cuda::gpu_count().unwrap_or(0));
    let spec = Spec::from_args(args)?;
    let config = &setup::bench_config(args, config)?;
    let nccl = NcclSide::from_args(args, &spec)?;
    let mut job = Job::open(args, config, &spec, nccl)?;
    let mut reporter = (job.comms[0].rank() == 0).then(|| Reporter::new(&spec, job.nccl.is_some()));
    if reporter.is_some() {
        println!("{}", report::preamble(&job.comms, &spec, &job.mode));
        if let Some(n) = &job.nccl {
            println!(
                "{}",
                report::nccl_preamble(n, args.graph, args.buffers, config.gpu_channels)
            );
        }
    }
    let ctxs = job.contexts(spec.check)?;
    let libs = job.libs();
    let runner = Runner {
        libs: &libs,
        ranks: &ctxs,
        nranks: job.nranks,
        spec: &spec,
        graph: args.graph,
    };
    let wrong = runner.run(args.one_thread, reporter.as_mut());
    drop(ctxs);
    if let Some(r) = &reporter {
        r.finish();
    }
    let rows = reporter.map(|r| r.rows);
    // ferroccl's rows are written whatever happened after them; beside NCCL the record needs
    // the memory readings of a run that ended well.
    if let (Some(Rows::Alone(rows)), Some(path)) = (&rows, &args.json) {
        record::write_alone(path, &spec, rows, &job.mode, job.nranks)?;
    }
    let wrong = wrong?;
    let memory = job.close()?;
    memory::print(&memory);
    if let Some(Rows::VsNccl(rows)) = rows {
        let (fw, nw) = (wrong[0], wrong[1]);
        println!(
            "{}",
            if spec.check {
                format!("# Wrong elements: ferroccl {fw}, NCCL {nw}")
            } else {
                "# Wrong elements: N/A (run with --check)".into()
            }
        );
        if let Some(p) = &args.json {
            record::write(
                p,
                &VsRecord::new(args, &spec, config, &job, memory, &wrong, rows)?,
            )?;
        }
    }
    if wrong.iter().all(|&w| w == 0) {
        return Ok(ExitCode::SUCCESS);
    }
    match &wrong[..] {
        [fw, nw] => eprintln!("ferroccl bench: wrong results (ferroccl {fw}, NCCL {nw} elements)"),
        _ => eprintln!("ferroccl bench: wrong results (see '#wrong' above)"),
    }
    Ok(ExitCode::from(1))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Arguments as clap parses `bench ARGS...`.
    fn parse(v: &[&str]) -> BenchArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            a: BenchArgs,
        }
        P::try_parse_from(std::iter::once("bench").chain(v.iter().copied()))
            .unwrap()
            .a
    }

    /// Arguments as clap gives them with no options, for tests to adjust.
    pub fn args() -> BenchArgs {
        parse(&["all-reduce"])
    }

    #[test]
    fn gpus_default_to_what_the_host_has() {
        assert_eq!(parse(&["all-reduce"]).resolve(|| 4).gpus, 4);
        assert_eq!(
            parse(&["all-reduce"]).resolve(|| 0).gpus,
            0,
            "no GPU: the host backend"
        );
        assert_eq!(
            parse(&["all-reduce", "-g", "0"]).resolve(|| 4).gpus,
            0,
            "-g 0 forces the host"
        );
        assert_eq!(parse(&["all-reduce", "-g", "2"]).resolve(|| 4).gpus, 2);
    }

    /// Graphs alone: on GPU ranks and without --check (which times each checked iteration on
    /// its own); refused on the host backend.
    #[test]
    fn graphs_alone_need_gpus_and_no_check() {
        let side = |argv: &[&str]| {
            let a = parse(argv).resolve(|| 0);
            let spec = Spec::from_args(&a).unwrap();
            NcclSide::from_args(&a, &spec).map(|s| s.is_none())
        };
        assert_eq!(
            side(&["all-reduce", "--graph", "10", "--devices", "0,0"]),
            Ok(true)
        );
        assert_eq!(side(&["all-reduce", "--graph", "10", "-g", "2"]), Ok(true));
        assert!(
            side(&["all-reduce", "--graph", "10"])
                .unwrap_err()
                .contains("GPU ranks"),
            "the host backend has no graphs"
        );
        assert!(side(&["all-reduce", "--graph", "10", "-g", "2", "--check"])
            .unwrap_err()
            .contains("--check"));
        assert_eq!(side(&["all-reduce", "-g", "2", "--check"]), Ok(true));
    }

    /// `--buffers`: cuMem by default; `driver` (cuMemAlloc) on GPU ranks, not with --register
    /// (windows are ferroccl::mem's buffers) nor on the host backend.
    #[test]
    fn buffers_come_from_cumem_unless_asked_and_driver_memory_is_for_plain_gpu_runs() {
        let spec = |argv: &[&str], gpus: usize| Spec::from_args(&parse(argv).resolve(|| gpus));
        assert_eq!(
            spec(&["all-reduce"], 2).unwrap().buffers,
            spec::Buffers::Cumem
        );
        assert_eq!(
            spec(&["all-reduce", "--buffers", "driver"], 2)
                .unwrap()
                .buffers,
            spec::Buffers::Driver
        );
        let e = spec(&["all-reduce", "--buffers", "driver", "--register"], 2).unwrap_err();
        assert!(e.contains("--register"), "{e}");
        let e = spec(&["all-reduce", "--buffers", "driver"], 0).unwrap_err();
        assert!(e.contains("GPU ranks only"), "{e}");
        assert!(spec(&["all-reduce", "--buffers", "cumem", "--register"], 2).is_ok());
    }

    #[test]
    fn ranks_share_a_gpu_only_when_an_ordinal_repeats() {
        assert!(shares_a_gpu(Some(&[0, 0])));
        assert!(shares_a_gpu(Some(&[0, 1, 2, 1])));
        assert!(!shares_a_gpu(Some(&[0, 1, 2])));
        assert!(!shares_a_gpu(Some(&[3])));
        assert!(!shares_a_gpu(None));
    }

    #[test]
    fn devices_give_one_rank_per_ordinal_repeats_allowed() {
        let a = parse(&["all-reduce", "--devices", "0,0,1"]).resolve(|| 1);
        assert_eq!(
            (a.gpus, a.devices.as_deref()),
            (3, Some(&[0usize, 0, 1][..]))
        );
        let refused = |v: &[&str]| {
            use clap::Parser;
            #[derive(Parser)]
            struct P {
                #[command(flatten)]
                a: BenchArgs,
            }
            P::try_parse_from(std::iter::once("bench").chain(v.iter().copied()))
                .err()
                .map(|e| e.to_string())
        };
        assert!(
            refused(&["all-reduce", "-g", "2", "--devices", "0,0"]).is_some(),
            "-g and --devices together are refused"
        );
        // Not beside NCCL (which refuses two ranks on a GPU), not under a launcher.
        let e = refused(&["all-reduce", "--devices", "0,0", "--vs-nccl"])
            .expect("--devices with --vs-nccl is refused");
        assert!(e.contains("--devices"), "{e}");
        let v = parse(&["all-reduce", "--devices", "0,0"]).resolve(|| 1);
        let env = ferroccl::LaunchEnv {
            rank: 0,
            world_size: 2,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            source: "test",
        };
        let err = setup::make_comms(&v, &ferroccl::Config::default(), Some(&env))
            .err()
            .unwrap();
        assert!(err.contains("--devices"), "{err}");
    }
}
