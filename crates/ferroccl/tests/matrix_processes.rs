//! The full correctness matrix with one process per rank (launcher environment, as torchrun or
//! `ferroccl run` set it), over shared memory and over TCP.

mod common;

use common::launch::{role, spawn_ranks, wait_all};
use common::Coverage;
use ferroccl::{Comm, Config};

const SIZES: [usize; 5] = [0, 1, 7, 4099, (1 << 20) + 3];

/// What each child process runs.
#[test]
fn child_rank() {
    if role().as_deref() != Some("matrix") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env(&cfg).unwrap();
    // The full product runs as threads (matrix_threads.rs); processes add the launcher, the
    // cross-process shared memory and sockets, which every pair of factors exercises.
    let (cases, errors) = common::run_matrix(
        &comm,
        &SIZES,
        Coverage::Pairwise,
        0xc0ffee + comm.nranks() as u64,
    );
    println!("rank {} ran {cases} cases", comm.rank());
    assert!(
        errors.is_empty(),
        "{} failures, first: {:#?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
}

fn matrix(transport: &str, n: usize) {
    let t = std::time::Instant::now();
    let kids = spawn_ranks(
        n,
        "child_rank",
        "matrix",
        &[
            ("FERROCCL_TRANSPORT", transport.into()),
            ("FERROCCL_TIMEOUT", "60".into()),
        ],
    );
    let results = wait_all(kids);
    for (r, (ok, out)) in results.iter().enumerate() {
        assert!(ok, "rank {r} of {n} over {transport} failed:\n{out}");
        assert!(
            out.contains(&format!("rank {r} ran")),
            "rank {r} did not run the matrix:\n{out}"
        );
    }
    eprintln!("{transport} x {n} processes: {:.1?}", t.elapsed());
}

macro_rules! matrix_tests {
    ($($name:ident: $t:expr, $n:expr;)*) => {$(
        #[test]
        fn $name() {
            if role().is_some() { return; }
            matrix($t, $n);
        }
    )*};
}

matrix_tests! {
    shm_processes_1: "shm", 1;
    shm_processes_2: "shm", 2;
    shm_processes_3: "shm", 3;
    shm_processes_4: "shm", 4;
    shm_processes_5: "shm", 5;
    shm_processes_8: "shm", 8;
    tcp_processes_2: "tcp", 2;
    tcp_processes_4: "tcp", 4;
    tcp_processes_8: "tcp", 8;
}
