//! Surviving a failed rank: four ranks (threads) run all-reduces; one of them fails and
//! aborts its communicator mid-job. The others' call fails within milliseconds, naming that
//! rank, instead of hanging; they shrink the communicator without it and carry on, exact.
//!
//! cargo run --release -p ferroccl --example abort_and_shrink
//!
//! A rank whose process dies (kill -9) is handled the same way: the survivors learn of the
//! death from their heartbeats and `Comm::dead_ranks` names it.

use ferroccl::{Comm, Config, ReduceOp};
use std::process::ExitCode;
use std::time::Instant;

fn main() -> ExitCode {
    let n = 4;
    let failing = 2;
    let comms = Comm::init_all(n, &Config::from_env().expect("FERROCCL_* settings"))
        .expect("creating the communicators");
    let ok = std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || -> Result<(), String> {
                    let mut v = vec![1u64; 1024];
                    c.all_reduce_in_place(&mut v, ReduceOp::Sum)
                        .map_err(|e| e.to_string())?;
                    if c.rank() == failing {
                        // This rank gives up (in a real job: it hit an error of its own).
                        c.abort();
                        return Ok(());
                    }
                    // The next all-reduce cannot complete: it fails, naming the aborted rank.
                    let t = Instant::now();
                    let e = c
                        .all_reduce_in_place(&mut v, ReduceOp::Sum)
                        .expect_err("rank 2 aborted");
                    println!("rank {}: failed after {:?}: {e}", c.rank(), t.elapsed());
                    // Every survivor passes the same list; the failed rank does not call shrink.
                    let survivors = c.shrink(&[failing]).map_err(|e| e.to_string())?;
                    let mut w = vec![c.rank() as u64; 1024];
                    survivors
                        .all_reduce_in_place(&mut w, ReduceOp::Sum)
                        .map_err(|e| e.to_string())?;
                    let want = (0..n as u64).filter(|&r| r != failing as u64).sum::<u64>();
                    if w.iter().any(|&x| x != want) {
                        return Err(format!("rank {}: wrong sum after the shrink", c.rank()));
                    }
                    println!(
                        "rank {} is rank {} of {} after the shrink: exact",
                        c.rank(),
                        survivors.rank(),
                        survivors.nranks()
                    );
                    Ok(())
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect::<Result<Vec<()>, String>>()
    });
    match ok {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
