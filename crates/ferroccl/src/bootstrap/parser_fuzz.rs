//! Every bootstrap parser fed arbitrary bytes: no panic, a clear error, and no allocation
//! beyond what the input itself justifies. Bounded case counts keep each to about a second.

use super::*;
use crate::testing::alloc_probe::largest_allocation_during;
use proptest::prelude::*;

/// Allocation a parser may make beyond the size of its input: error messages and a small
/// table, never anything a length field asked for.
const SLACK: usize = 4096;

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

/// Valid messages with some bytes changed, which reach deeper than random noise does.
fn mutated(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let n = valid.len();
    proptest::collection::vec((0..n.max(1), any::<u8>()), 0..4).prop_map(move |edits| {
        let mut v = valid.clone();
        for (i, b) in edits {
            if i < v.len() {
                v[i] = b;
            }
        }
        v
    })
}

fn sample_peer() -> PeerInfo {
    PeerInfo {
        rank: 1,
        addr: "10.1.2.3:4567".parse().unwrap(),
        host_id: 42,
        pid: 7,
        hostname: "node-17".into(),
    }
}

fn valid_hello() -> Vec<u8> {
    let mut e = Enc::default();
    e.u64(4);
    root::encode_peer(&mut e, &sample_peer());
    e.0
}

fn valid_reply() -> Vec<u8> {
    let mut e = Enc::default();
    e.u8(0).u64(99).u64(2);
    root::encode_peer(
        &mut e,
        &PeerInfo {
            rank: 0,
            ..sample_peer()
        },
    );
    root::encode_peer(&mut e, &sample_peer());
    e.0
}

/// Runs `parse` on `input` and checks that it neither panics nor allocates beyond the input.
fn bounded<T>(input: &[u8], parse: impl FnOnce(&[u8]) -> T) -> T {
    let (out, largest) = largest_allocation_during(|| parse(input));
    assert!(
        largest <= input.len() + SLACK,
        "a {}-byte input made the parser allocate {largest} bytes",
        input.len()
    );
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn announce(b in prop_oneof![bytes(64), mutated(listener::encode_announce(7, 3, 1, 9))]) {
        if let Err(e) = bounded(&b, listener::decode_announce) {
            prop_assert!(matches!(e, Error::Protocol(_)) && e.message().contains("announce"), "{e}");
        }
    }

    #[test]
    fn rendezvous_hello(b in prop_oneof![bytes(400), mutated(valid_hello())]) {
        if let Err(e) = bounded(&b, root::decode_hello) {
            prop_assert!(matches!(e, Error::Protocol(_)) && e.message().contains("rendezvous hello"), "{e}");
        }
    }

    #[test]
    fn rendezvous_reply(b in prop_oneof![bytes(400), mutated(valid_reply())], n in 0usize..4) {
        // Whatever it says about rank counts, the table is checked against the bytes present.
        let _ = bounded(&b, |b| root::decode_reply(b, n, "the root"));
    }

    #[test]
    fn unique_id(b in prop_oneof![bytes(200), mutated(UniqueId::compose("1.2.3.4:5".parse().unwrap(), &[3; 16]).as_bytes().to_vec())]) {
        if let Err(e) = bounded(&b, UniqueId::from_bytes) {
            prop_assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        }
    }

    #[test]
    fn codec_primitives(b in bytes(64), max in 0usize..300) {
        bounded(&b, |b| {
            let mut d = Dec::new(b, "fuzz");
            let _ = d.str(max);
            let _ = d.addr();
            let _ = d.usize();
            let _ = d.i32();
            let _ = d.finish();
        });
        if b.len() >= wire::ADDR_LEN {
            let _ = wire::decode_addr(b[..wire::ADDR_LEN].try_into().unwrap());
        }
    }

    #[test]
    fn check_mode_signatures(b in bytes(200)) {
        let _ = bounded(&b, |b| ferroccl_core::opsig::compare(&[b.to_vec(), b.to_vec()]));
    }
}

proptest! {
    // These go through real sockets (a frame reader, a handshake), so fewer cases.
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn frame_reader_on_arbitrary_streams(b in prop_oneof![bytes(64), bytes(8).prop_map(|mut v| { v.resize(8, 0xFF); v })]) {
        let (mut c, mut s) = super::tests::pair();
        std::io::Write::write_all(&mut c, &b).unwrap();
        drop(c);
        let r = wire::read_frame(&mut s, 4096, &super::tests::w(500), "fuzzer");
        if let Err(e) = r {
            prop_assert!(e.message().contains("fuzzer"), "{e}");
            prop_assert!(!matches!(e, Error::Timeout(_)), "EOF must end the read, not the deadline: {e}");
        }
    }

    #[test]
    fn handshake_server_on_arbitrary_clients(b in bytes(200)) {
        let (mut c, mut s) = super::tests::pair();
        let srv = std::thread::spawn(move || auth::server(&mut s, &[1; 16], &super::tests::w(500), "fuzzer"));
        let mut hello = [0u8; 40];
        std::io::Read::read_exact(&mut c, &mut hello).unwrap();
        let _ = std::io::Write::write_all(&mut c, &b);
        drop(c);
        let e = srv.join().unwrap().unwrap_err();
        prop_assert!(e.message().contains("fuzzer"), "{e}");
    }
}
