use ferroccl::{Comm, Config, ReduceOp, TransportChoice};

#[test]
fn all_reduce_over_threads() {
    for transport in [TransportChoice::Shm, TransportChoice::Tcp] {
        let cfg = Config {
            transport,
            timeout: std::time::Duration::from_secs(20),
            ..Config::default()
        };
        let comms = Comm::init_all(4, &cfg).unwrap();
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    let send: Vec<f32> = (0..100_003)
                        .map(|i| (i % 7) as f32 + c.rank() as f32)
                        .collect();
                    let mut recv = vec![0f32; send.len()];
                    c.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
                    for (i, v) in recv.iter().enumerate() {
                        assert_eq!(*v, 4.0 * (i % 7) as f32 + 6.0, "element {i}");
                    }
                });
            }
        });
    }
}
