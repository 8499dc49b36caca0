//! Sends and receives in a group: every rank sends to each of the others and receives from
//! each of them, all in one group per rank, in an order that would deadlock without it (every
//! rank posts its sends first). Ranks are threads of this process.
//!
//! cargo run --release -p ferroccl --example group_sendrecv [RANKS]

use ferroccl::{Comm, Config, Group};
use std::process::ExitCode;

fn main() -> ExitCode {
    let nranks: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4);
    let comms = Comm::init_all(nranks, &Config::from_env().expect("FERROCCL_* settings"))
        .expect("creating the communicators");
    let count = 100_000;
    // What rank `from` sends to rank `to`.
    let message = |from: usize, to: usize| -> Vec<u32> {
        (0..count as u32)
            .map(|i| (from * 1000 + to) as u32 ^ i)
            .collect()
    };
    let wrong: usize = std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let me = c.rank();
                    let peers: Vec<usize> = (0..c.nranks()).filter(|&p| p != me).collect();
                    let outgoing: Vec<Vec<u32>> = peers.iter().map(|&p| message(me, p)).collect();
                    let mut incoming = vec![vec![0u32; count]; peers.len()];
                    let mut g = Group::new();
                    for (&p, buf) in peers.iter().zip(&outgoing) {
                        g.send(c, buf, p).expect("send");
                    }
                    for (&p, buf) in peers.iter().zip(incoming.iter_mut()) {
                        g.recv(c, buf, p).expect("recv");
                    }
                    g.launch().expect("the group");
                    peers
                        .iter()
                        .zip(&incoming)
                        .map(|(&p, got)| {
                            got.iter()
                                .zip(message(p, me))
                                .filter(|(a, b)| **a != *b)
                                .count()
                        })
                        .sum::<usize>()
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .sum()
    });
    println!("{nranks} ranks exchanged {count} x u32 with every other rank in one group each: {wrong} wrong elements");
    if wrong == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
