//! An all-reduce over ranks that are processes, started by a launcher:
//!
//! cargo build --release -p ferroccl --example allreduce_processes
//! ferroccl run -n 4 target/release/examples/allreduce_processes
//! torchrun --nproc-per-node 4 target/release/examples/allreduce_processes   # the same
//!
//! Each process reads its rank, the job size and where rank 0 runs the rendezvous from the
//! launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; FERROCCL_JOB_SECRET
//! authenticates the job), checks the result element by element, and exits non-zero if any
//! element is wrong. Ranks on one host talk through shared memory, across hosts through TCP.

use ferroccl::{Comm, Config, ReduceOp};
use std::process::ExitCode;

fn main() -> ExitCode {
    let config = Config::from_env().expect("FERROCCL_* settings");
    let comm = match Comm::from_env(&config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, n) = (comm.rank(), comm.nranks());
    let count = 1 << 20;
    let mut v: Vec<f64> = (0..count).map(|i| (rank * count + i) as f64).collect();
    if let Err(e) = comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
        eprintln!("rank {rank}: {e}");
        return ExitCode::FAILURE;
    }
    // sum over r of (r*count + i) = count*n(n-1)/2 + n*i: integers, exact in f64.
    let want = |i: usize| (count * n * (n - 1) / 2 + n * i) as f64;
    let wrong = v.iter().enumerate().filter(|&(i, &x)| x != want(i)).count();
    println!("rank {rank} of {n}: {wrong} wrong elements");
    if wrong == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
