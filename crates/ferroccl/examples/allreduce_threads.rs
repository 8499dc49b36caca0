//! An all-reduce over ranks that are threads of one process, on the host backend.
//!
//! cargo run --release -p ferroccl --example allreduce_threads [RANKS]
//!
//! Every rank contributes `rank + i` at index `i`; each checks the sum it gets element by
//! element and the program exits non-zero if any element is wrong.

use ferroccl::{Comm, Config, ReduceOp};
use std::process::ExitCode;

fn main() -> ExitCode {
    let nranks: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4);
    // Config::from_env() reads the FERROCCL_* knobs (docs/ENV.md); defaults otherwise.
    let config = Config::from_env().expect("FERROCCL_* settings");
    let comms = Comm::init_all(nranks, &config).expect("creating the communicators");
    let count = 1 << 20;
    let wrong: usize = std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mine: Vec<i64> = (0..count as i64).map(|i| c.rank() as i64 + i).collect();
                    let mut sum = vec![0i64; count];
                    c.all_reduce(&mine, &mut sum, ReduceOp::Sum)
                        .expect("all-reduce");
                    let n = c.nranks() as i64;
                    // sum over r of (r + i) = n*i + n(n-1)/2
                    sum.iter()
                        .enumerate()
                        .filter(|&(i, &x)| x != n * i as i64 + n * (n - 1) / 2)
                        .count()
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .sum()
    });
    println!("all-reduce of {count} x i64 over {nranks} threads: {wrong} wrong elements");
    if wrong == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
