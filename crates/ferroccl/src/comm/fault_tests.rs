//! Faults on the wire between two ranks, injected by a proxy on rank 0's connections to
//! rank 1: what each becomes, and how long it takes.

use super::*;
use crate::testing::fault_proxy::{Fault, FaultProxy};
use ferroccl_core::ReduceOp;
use std::time::{Duration, Instant};

const COUNT: usize = 16 << 10;

/// Over TCP, on the ring: its all-gather half makes each rank depend on the other's receipt,
/// so a fault on rank 0's sends reaches both ranks (one round of messages, the one-shot
/// all-reduce, would let rank 0 finish on what rank 1 sent it).
fn config(timeout_ms: u64, crc: bool) -> Config {
    Config {
        timeout: Duration::from_millis(timeout_ms),
        bootstrap_addr: Some("127.0.0.1".into()),
        transport: ferroccl_core::TransportChoice::Tcp,
        tcp_crc: crc,
        direct_max_bytes: 0,
        ..Config::default()
    }
}

/// Two ranks over TCP; everything rank 0 sends to rank 1 passes through the returned proxy
/// (the bootstrap ring, made before the redirection, does not).
fn proxied_pair(config: &Config) -> (Vec<Comm>, FaultProxy) {
    let id = UniqueId::new(config).unwrap();
    let aborts: Vec<Arc<AtomicBool>> = (0..2).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let mut boots: Vec<Bootstrap> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (id, a) = (&id, aborts[r].clone());
                s.spawn(move || Bootstrap::init(id, 2, r, config, a).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let proxy = FaultProxy::start(boots[1].peers()[1].addr);
    boots[0].redirect_peer(1, proxy.addr());
    // Together: creating a communicator compares every rank's settings.
    let comms = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .zip(aborts)
            .map(|(b, a)| {
                s.spawn(move || {
                    Comm::from_bootstrap(b, Device::Host, config.clone(), a, None).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (comms, proxy)
}

/// One all-reduce (sum of rank + 1) on both ranks: each rank's result and how long it took.
fn all_reduce(comms: &[Comm]) -> Vec<(Result<Vec<i32>, Error>, Duration)> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let send: Vec<i32> = (0..COUNT)
                        .map(|i| (c.rank() as i32 + 1) * (i as i32 % 7))
                        .collect();
                    let mut recv = vec![0i32; COUNT];
                    let t = Instant::now();
                    let r = c.all_reduce(&send, &mut recv, ReduceOp::Sum).map(|_| recv);
                    (r, t.elapsed())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn expected() -> Vec<i32> {
    (0..COUNT).map(|i| 3 * (i as i32 % 7)).collect()
}

/// Past the handshake (64 bytes), the announce frame (37) and the preamble and first frame
/// header (8): inside the first frame's payload.
const PAYLOAD_BYTE: u64 = 1000;

#[test]
fn with_crc_corruption_is_an_error_naming_the_peer_not_data() {
    let (comms, proxy) = proxied_pair(&config(10_000, true));
    proxy.set(Fault::Corrupt { at: PAYLOAD_BYTE });
    let out = all_reduce(&comms);
    assert_eq!(proxy.corrupted(), 1);
    for (r, (res, took)) in out.iter().enumerate() {
        let e = res.as_ref().expect_err("corruption must not be delivered");
        eprintln!("corrupt byte, CRC on: rank {r} failed after {took:?}");
        assert!(*took < Duration::from_secs(2), "rank {r} took {took:?}");
        // Rank 0 learns it from rank 1's report, or, where rank 1 closes the channel before its
        // report arrives (seen once under CI's load), from the closed channel to rank 1: named
        // either way, never delivered as data.
        assert!(
            e.message().contains("CRC32C mismatch")
                || (r == 0 && e.message().contains("rank 1 failed"))
                || (r == 0
                    && e.message().contains("rank 1 (")
                    && e.message().contains("connection closed")),
            "rank {r}: {e}"
        );
    }
    let e = out[1].0.as_ref().unwrap_err();
    assert!(matches!(e, Error::Protocol(_)), "{e}");
    assert!(
        e.message().contains("rank 0 (")
            && e.message().contains("127.0.0.1:")
            && e.message().contains("over tcp"),
        "{e}"
    );
}

#[test]
fn without_crc_the_same_corruption_is_delivered_as_data() {
    // Why the check exists: TCP accepted the flipped bit, and so did the reduction.
    let (comms, proxy) = proxied_pair(&config(10_000, false));
    proxy.set(Fault::Corrupt { at: PAYLOAD_BYTE });
    let out = all_reduce(&comms);
    assert_eq!(proxy.corrupted(), 1);
    for (r, (res, _)) in out.iter().enumerate() {
        let got = res.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_ne!(got, &expected(), "rank {r}");
    }
}

#[test]
fn delayed_bytes_still_arrive_intact() {
    let (comms, proxy) = proxied_pair(&config(10_000, true));
    proxy.set(Fault::Delay(Duration::from_millis(3)));
    for _ in 0..3 {
        for (r, (res, _)) in all_reduce(&comms).into_iter().enumerate() {
            assert_eq!(res.unwrap_or_else(|e| panic!("rank {r}: {e}")), expected());
        }
    }
    assert!(proxy.forwarded() > (3 * COUNT * 4 / 2) as u64);
}

#[test]
fn reset_connection_fails_both_ranks_at_once_naming_the_peer() {
    let (comms, proxy) = proxied_pair(&config(10_000, true));
    for (res, _) in all_reduce(&comms) {
        assert_eq!(res.unwrap(), expected());
    }
    proxy.set(Fault::Reset);
    let out = all_reduce(&comms);
    for (r, (res, took)) in out.iter().enumerate() {
        let e = res.as_ref().expect_err("a reset connection cannot deliver");
        eprintln!("connection reset: rank {r} failed after {took:?}");
        // Far below the 10 s deadline: a reset is noticed, not waited out.
        assert!(
            *took < Duration::from_secs(2),
            "rank {r} took {took:?}: {e}"
        );
        let peer = 1 - r;
        assert!(
            e.message().contains(&format!("rank {peer}")),
            "rank {r}: {e}"
        );
    }
}

#[test]
fn black_hole_fails_by_the_deadline_naming_the_peer() {
    let (comms, proxy) = proxied_pair(&config(1500, true));
    for (res, _) in all_reduce(&comms) {
        assert_eq!(res.unwrap(), expected());
    }
    proxy.set(Fault::Drop);
    let out = all_reduce(&comms);
    for (r, (res, took)) in out.iter().enumerate() {
        let e = res
            .as_ref()
            .expect_err("nothing arrives through a black hole");
        eprintln!("black hole, 1.5 s deadline: rank {r} failed after {took:?}");
        assert!(
            *took < Duration::from_millis(1500 + 1000),
            "rank {r} took {took:?}: {e}"
        );
        assert!(
            e.message().contains(&format!("rank {}", 1 - r)),
            "rank {r}: {e}"
        );
    }
    // The rank that waited for the swallowed data says so.
    let e = out[1].0.as_ref().unwrap_err();
    assert!(
        matches!(e, Error::Timeout(_)) && e.message().contains("data from rank 0"),
        "{e}"
    );
}
