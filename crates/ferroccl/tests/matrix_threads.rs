//! The full correctness matrix with ranks as threads of this process, over shared memory and
//! over TCP.

mod common;

use ferroccl::{Comm, Config, TransportChoice};
use std::time::{Duration, Instant};

pub const SIZES: [usize; 5] = [0, 1, 7, 4099, (1 << 20) + 3];

fn matrix(transport: TransportChoice, nranks: usize, sizes: &[usize]) {
    let cfg = Config { transport, timeout: Duration::from_secs(60), ..Config::default() };
    let comms = Comm::init_all(nranks, &cfg).expect("init");
    let t = Instant::now();
    let results: Vec<(usize, Vec<String>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(move || common::run_matrix(c, sizes, 0x5eed + nranks as u64))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let cases = results[0].0;
    let errors: Vec<&String> = results.iter().flat_map(|r| r.1.iter()).collect();
    eprintln!("{transport:?} x {nranks} ranks: {cases} cases per rank in {:.1?}", t.elapsed());
    assert!(errors.is_empty(), "{} failures, first: {:#?}", errors.len(), &errors[..errors.len().min(5)]);
    assert!(cases > 0);
}

macro_rules! matrix_tests {
    ($($name:ident: $t:expr, $n:expr;)*) => {$(
        #[test]
        fn $name() {
            matrix($t, $n, &SIZES);
        }
    )*};
}

matrix_tests! {
    shm_threads_1: TransportChoice::Shm, 1;
    shm_threads_2: TransportChoice::Shm, 2;
    shm_threads_3: TransportChoice::Shm, 3;
    shm_threads_4: TransportChoice::Shm, 4;
    shm_threads_5: TransportChoice::Shm, 5;
    shm_threads_8: TransportChoice::Shm, 8;
    // TCP covers 4 and 8 ranks as processes (matrix_processes.rs), which keeps CI's time.
    tcp_threads_2: TransportChoice::Tcp, 2;
    tcp_threads_3: TransportChoice::Tcp, 3;
    tcp_threads_5: TransportChoice::Tcp, 5;
}
