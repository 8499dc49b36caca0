//! The full correctness matrix with ranks as threads of this process, over shared memory and
//! over TCP.

mod common;

use common::Coverage;
use ferroccl::{Comm, Config, TransportChoice};
use std::time::{Duration, Instant};

pub const SIZES: [usize; 5] = [0, 1, 7, 4099, (1 << 20) + 3];

fn matrix(transport: TransportChoice, nranks: usize, coverage: Coverage) {
    let cfg = Config {
        transport,
        timeout: Duration::from_secs(60),
        ..Config::default()
    };
    let comms = Comm::init_all(nranks, &cfg).expect("init");
    let t = Instant::now();
    let results: Vec<(usize, Vec<String>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || common::run_matrix(c, &SIZES, coverage, 0x5eed + nranks as u64))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    let cases = results[0].0;
    let errors: Vec<&String> = results.iter().flat_map(|r| r.1.iter()).collect();
    eprintln!(
        "{transport:?} x {nranks} ranks, {coverage:?}: {cases} cases per rank in {:.1?}",
        t.elapsed()
    );
    assert!(
        errors.is_empty(),
        "{} failures, first: {:#?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    assert!(cases > 0);
}

macro_rules! matrix_tests {
    ($($name:ident: $t:expr, $n:expr, $c:expr;)*) => {$(
        #[test]
        fn $name() {
            matrix($t, $n, $c);
        }
    )*};
}

// The full product at one rank count (3: odd, and a ring with a middle rank), every pair of
// factors everywhere else; processes in matrix_processes.rs.
matrix_tests! {
    shm_threads_1: TransportChoice::Shm, 1, Coverage::Pairwise;
    shm_threads_2: TransportChoice::Shm, 2, Coverage::Pairwise;
    shm_threads_3_full: TransportChoice::Shm, 3, Coverage::Full;
    shm_threads_4: TransportChoice::Shm, 4, Coverage::Pairwise;
    shm_threads_5: TransportChoice::Shm, 5, Coverage::Pairwise;
    shm_threads_8: TransportChoice::Shm, 8, Coverage::Pairwise;
    tcp_threads_2: TransportChoice::Tcp, 2, Coverage::Pairwise;
    tcp_threads_3: TransportChoice::Tcp, 3, Coverage::Pairwise;
    tcp_threads_5: TransportChoice::Tcp, 5, Coverage::Pairwise;
    tcp_threads_8: TransportChoice::Tcp, 8, Coverage::Pairwise;
}

/// The pairwise matrix runs every (operation, type, reduction), every size and placement of
/// every operation, and every pair of values of any two factors, in a tenth of the cases.
#[test]
fn the_pairwise_matrix_covers_every_pair() {
    use std::collections::HashSet;
    let full = common::cases(SIZES.len(), Coverage::Full);
    let pairwise = common::cases(SIZES.len(), Coverage::Pairwise);
    let want: HashSet<String> = full.iter().flat_map(common::factor_pairs).collect();
    let got: HashSet<String> = pairwise.iter().flat_map(common::factor_pairs).collect();
    let missing: Vec<&String> = want.difference(&got).collect();
    assert!(missing.is_empty(), "pairs never met: {missing:?}");
    assert!(
        pairwise.iter().all(|c| full.contains(c)),
        "only valid cases"
    );
    let triples = |v: &[common::Case]| {
        v.iter()
            .map(|c| format!("{:?} {} {}", c.op, c.dtype, c.redop))
            .collect::<HashSet<_>>()
    };
    assert_eq!(triples(&pairwise), triples(&full));
    eprintln!("pairwise: {} cases of {}", pairwise.len(), full.len());
    assert!(
        pairwise.len() * 5 < full.len(),
        "{} of {}",
        pairwise.len(),
        full.len()
    );
}
