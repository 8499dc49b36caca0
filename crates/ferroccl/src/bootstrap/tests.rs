use super::wire::{self, AbortSet, Wait};
use super::*;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

pub(super) fn cfg(timeout_ms: u64) -> Config {
    Config {
        timeout: Duration::from_millis(timeout_ms),
        bootstrap_addr: Some("127.0.0.1".into()),
        ..Config::default()
    }
}

pub(super) fn flag() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}

/// Runs `f(rank)` on `n` threads and returns the results indexed by rank.
pub(super) fn on_ranks<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn({
                    let f = &f;
                    move || f(r)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

pub(super) fn init_all(n: usize, c: &Config) -> Vec<Bootstrap> {
    let id = UniqueId::new(c).unwrap();
    on_ranks(n, |r| Bootstrap::init(&id, n, r, c, flag()).unwrap())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn data_of(r: usize) -> Vec<u8> {
    (0..r * 37 + r % 2).map(|i| (i * 7 + r) as u8).collect()
}

pub(super) fn check_allgather(bs: &[Bootstrap]) {
    let n = bs.len();
    let outs = on_ranks(n, |r| {
        let a = bs[r].allgather(&data_of(r)).unwrap();
        bs[r].barrier().unwrap();
        let b = bs[r].allgather(&[r as u8; 3]).unwrap();
        (a, b)
    });
    for (a, b) in outs {
        assert_eq!(a, (0..n).map(data_of).collect::<Vec<_>>());
        assert_eq!(b, (0..n).map(|r| vec![r as u8; 3]).collect::<Vec<_>>());
    }
}

#[test]
fn bootstrap_is_send_and_sync() {
    fn ok<T: Send + Sync>() {}
    ok::<Bootstrap>();
    ok::<UniqueId>();
}

#[test]
fn unique_id_layout_and_validation() {
    let secret = [7u8; 16];
    let addr: SocketAddr = "10.0.0.5:4242".parse().unwrap();
    let id = UniqueId::compose(addr, &secret);
    let b = id.as_bytes();
    assert_eq!(&b[..8], b"FERROCID");
    assert_eq!(u16::from_le_bytes([b[8], b[9]]), 1);
    assert_eq!(b[10], 4);
    assert_eq!(&b[11..15], &[10, 0, 0, 5]);
    assert_eq!(&b[27..29], &4242u16.to_be_bytes());
    assert_eq!(&b[29..45], &secret);
    assert!(b[45..].iter().all(|&x| x == 0));
    let back = UniqueId::from_bytes(b).unwrap();
    assert_eq!(back.root_addr(), addr);
    assert_eq!(back.secret(), secret);
    assert!(
        !format!("{back:?}").contains("7, 7"),
        "Debug must not show the secret"
    );

    let v6: SocketAddr = "[fe80::1234:5678]:9".parse().unwrap();
    assert_eq!(
        UniqueId::from_bytes(UniqueId::compose(v6, &secret).as_bytes())
            .unwrap()
            .root_addr(),
        v6
    );

    assert!(matches!(
        UniqueId::from_bytes(&b[..127]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        UniqueId::from_bytes(&[b.as_slice(), &[0]].concat()),
        Err(Error::InvalidArgument(_))
    ));
    let mut bad = *b;
    bad[0] ^= 1;
    assert!(UniqueId::from_bytes(&bad)
        .unwrap_err()
        .message()
        .contains("magic"));
    let mut bad = *b;
    bad[8] = 2;
    assert!(UniqueId::from_bytes(&bad)
        .unwrap_err()
        .message()
        .contains("version"));
    let mut bad = *b;
    bad[100] = 1;
    assert!(UniqueId::from_bytes(&bad).is_err());
    let mut bad = *b;
    bad[10] = 5;
    assert!(UniqueId::from_bytes(&bad).is_err());
    // An id at an agreed address carries the flag that rank 0 starts the root; unknown flags
    // are refused.
    let at = UniqueId::at(addr, secret);
    assert_eq!(at.as_bytes()[45], 1);
    assert!(UniqueId::from_bytes(at.as_bytes()).unwrap().root_by_rank0() && !back.root_by_rank0());
    let mut bad = *at.as_bytes();
    bad[45] = 2;
    assert!(UniqueId::from_bytes(&bad)
        .unwrap_err()
        .message()
        .contains("flags"));
    // Arbitrary input never panics, whatever it holds after a valid header.
    for i in 0..2000u32 {
        let mut r: [u8; 128] = auth::random_bytes().unwrap();
        if i % 2 == 0 {
            r[..10].copy_from_slice(&b[..10]);
        }
        let _ = UniqueId::from_bytes(&r);
        let _ = UniqueId::from_bytes(&r[..(i as usize % 129)]);
    }
}

#[test]
fn host_identity() {
    assert_ne!(
        host::host_id_of("node", "boot-a"),
        host::host_id_of("node", "boot-b")
    );
    assert_ne!(
        host::host_id_of("node-a", "boot"),
        host::host_id_of("node-b", "boot")
    );
    assert_eq!(host::host_id_of("n", "b"), host::host_id_of("n", "b"));
    assert_eq!(host::host_id(), host::host_id());
    assert!(!host::hostname().is_empty());
    if let Some(ip) = host::first_ipv4() {
        assert!(!ip.is_loopback());
    }
}

/// A connected pair of sockets: (client side, server side).
pub(super) fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

pub(super) fn w(ms: u64) -> Wait {
    Wait::new(Duration::from_millis(ms), AbortSet::new(flag()))
}

#[test]
fn frames_are_bounded_and_truncation_names_the_peer() {
    let (mut c, mut s) = pair();
    c.write_all(&u64::MAX.to_le_bytes()).unwrap();
    let e = wire::read_frame(&mut s, 4096, &w(1000), "rank 9 (1.2.3.4:5)").unwrap_err();
    assert!(matches!(e, Error::Protocol(_)), "{e}");
    assert!(e.message().contains("rank 9 (1.2.3.4:5)"), "{e}");

    let (mut c, mut s) = pair();
    c.write_all(&100u64.to_le_bytes()).unwrap();
    c.write_all(&[1u8; 10]).unwrap();
    drop(c);
    let e = wire::read_frame(&mut s, 4096, &w(1000), "peer 1.2.3.4:5").unwrap_err();
    assert!(matches!(e, Error::Remote(_)), "{e}");
    assert!(
        e.message().contains("1.2.3.4:5") && e.message().contains("10 of 100"),
        "{e}"
    );

    let (mut c, mut s) = pair();
    wire::write_frame(&mut c, &[b"ab", b"cde"], &w(1000), "x").unwrap();
    let big = vec![3u8; 200_000];
    wire::write_frame(&mut c, &[&big], &w(1000), "x").unwrap();
    assert_eq!(
        wire::read_frame(&mut s, 4096, &w(1000), "x").unwrap(),
        b"abcde"
    );
    assert_eq!(
        wire::read_frame(&mut s, 200_000, &w(1000), "x").unwrap(),
        big
    );

    // A silent peer: the read ends at the deadline.
    let t = Instant::now();
    let e = wire::read_frame(&mut s, 4096, &w(300), "x").unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(t.elapsed() < Duration::from_millis(800));
}

/// A handshake gives up at its own cap, shorter than FERROCCL_TIMEOUT: the message names that
/// cap and says where it comes from, not FERROCCL_TIMEOUT's name beside the cap's value.
#[test]
fn an_expired_handshake_names_its_own_limit_not_ferroccl_timeout() {
    let (_c, mut s) = pair();
    let hs =
        Wait::new(Duration::from_secs(30), AbortSet::new(flag())).capped(Duration::from_millis(50));
    let e = wire::read_exact(&mut s, &mut [0u8; 8], &hs, "a stranger").unwrap_err();
    let m = e.message();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(
        m.contains("within 50ms (the limit on a bootstrap handshake; FERROCCL_TIMEOUT is 30s)"),
        "{m}"
    );
    // Not capped (the cap is beyond the deadline): FERROCCL_TIMEOUT is the limit, and says so.
    let full =
        Wait::new(Duration::from_millis(50), AbortSet::new(flag())).capped(Duration::from_secs(10));
    let e = wire::read_exact(&mut s, &mut [0u8; 8], &full, "a stranger").unwrap_err();
    assert!(
        e.message().contains("within 50ms (FERROCCL_TIMEOUT)"),
        "{e}"
    );
}

#[test]
fn handshake_is_mutual_and_resists_replay() {
    let run = |ks: [u8; 16], kc: [u8; 16]| {
        let (mut c, mut s) = pair();
        let srv = thread::spawn(move || auth::server(&mut s, &ks, &w(2000), "client"));
        let cr = auth::client(&mut c, &kc, &w(2000), "server");
        (srv.join().unwrap(), cr)
    };
    let (a, b) = run([1; 16], [1; 16]);
    a.unwrap();
    b.unwrap();
    let (a, b) = run([1; 16], [2; 16]);
    assert!(matches!(a, Err(Error::Protocol(_))), "{a:?}");
    assert!(matches!(b, Err(Error::Protocol(_))), "{b:?}");

    // Replay: a response that was valid for one server nonce fails against a fresh one.
    let secret = [5u8; 16];
    let (mut c, mut s) = pair();
    let srv = thread::spawn(move || auth::server(&mut s, &secret, &w(2000), "c"));
    let mut hello = [0u8; 40];
    c.read_exact(&mut hello).unwrap();
    let old_nonce = [9u8; 32];
    let cn = [4u8; 32];
    use hmac::Mac;
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(&secret).unwrap();
    m.update(b"client");
    m.update(&old_nonce);
    m.update(&cn);
    c.write_all(&[cn.as_slice(), &m.finalize().into_bytes()].concat())
        .unwrap();
    assert!(matches!(srv.join().unwrap(), Err(Error::Protocol(_))));
}

#[test]
fn init_allgather_barrier_for_various_sizes() {
    for n in [1, 2, 3, 5, 8] {
        let bs = init_all(n, &cfg(5000));
        let id0 = bs[0].comm_id();
        for (r, b) in bs.iter().enumerate() {
            assert_eq!((b.rank(), b.nranks(), b.comm_id()), (r, n, id0));
            assert_eq!(b.peers(), bs[0].peers());
            assert_eq!(b.peers()[r].rank, r);
            assert_eq!(b.peers()[r].pid, std::process::id());
            assert_eq!(b.peers()[r].host_id, host::host_id());
        }
        check_allgather(&bs);
    }
}

#[test]
fn default_address_selection_works() {
    let c = Config {
        timeout: Duration::from_secs(5),
        ..Config::default()
    };
    let bs = init_all(2, &c);
    check_allgather(&bs);
    assert!(matches!(
        UniqueId::new(&Config {
            bootstrap_addr: Some("not-an-ip".into()),
            ..cfg(1000)
        }),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn allgather_of_large_blocks_does_not_deadlock() {
    let bs = init_all(3, &cfg(10_000));
    let outs = on_ranks(3, |r| bs[r].allgather(&vec![r as u8; 3 << 20]).unwrap());
    for o in outs {
        for (r, b) in o.iter().enumerate() {
            assert_eq!(b.len(), 3 << 20);
            assert!(b.iter().all(|&x| x == r as u8));
        }
    }
    let small = Config {
        max_bootstrap_msg: 4096,
        ..cfg(1000)
    };
    let bs = init_all(1, &small);
    assert!(matches!(
        bs[0].allgather(&[0; 5000]),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn allgather_of_mixed_small_and_large_blocks() {
    // Small blocks go out inline and large ones from a helper thread; a ring mixing both, with
    // every rank far ahead of or behind its successor, must neither deadlock nor reorder.
    let bs = init_all(5, &cfg(10_000));
    let size = |r: usize, round: usize| {
        if (r + round).is_multiple_of(3) {
            200_000 + r
        } else {
            r * 100
        }
    };
    let outs = on_ranks(5, |r| {
        (0..6)
            .map(|round| {
                bs[r]
                    .allgather(&vec![(r * 10 + round) as u8; size(r, round)])
                    .unwrap()
            })
            .collect::<Vec<_>>()
    });
    for o in outs {
        for (round, all) in o.iter().enumerate() {
            for (r, b) in all.iter().enumerate() {
                assert_eq!(b, &vec![(r * 10 + round) as u8; size(r, round)]);
            }
        }
    }
}

#[test]
fn init_from_launch_with_and_without_secret() {
    for secret in [Some([0x42u8; 16]), None] {
        let port = free_port();
        let c = Config {
            job_secret: secret,
            ..cfg(5000)
        };
        let bs = on_ranks(4, |r| {
            // Rank 0 (the root) comes last: the others must keep retrying until it listens.
            if r == 0 {
                thread::sleep(Duration::from_millis(300));
            }
            let env = LaunchEnv {
                rank: r,
                world_size: 4,
                local_rank: r,
                master_addr: "127.0.0.1".into(),
                master_port: port,
                source: "test",
            };
            Bootstrap::init_from_launch(&env, &c, flag()).unwrap()
        });
        check_allgather(&bs);
    }
}

#[test]
fn wrong_secret_is_rejected_and_the_job_goes_on() {
    let c = cfg(3000);
    let id = UniqueId::new(&c).unwrap();
    let fake = UniqueId::compose(id.root_addr(), &[0xEE; 16]);
    let e = Bootstrap::init(&fake, 2, 0, &c, flag()).unwrap_err();
    assert!(matches!(e, Error::Protocol(_)), "{e}");
    let bs = on_ranks(2, |r| Bootstrap::init(&id, 2, r, &c, flag()).unwrap());
    check_allgather(&bs);
    // A rank listener rejects the wrong secret too, and keeps serving.
    let mut s = wire::connect_retry(bs[1].peers()[1].addr, &w(1000), "rank 1").unwrap();
    assert!(auth::client(&mut s, &[0xEE; 16], &w(1000), "rank 1").is_err());
    let (a, b) = thread::scope(|sc| {
        let h = sc.spawn(|| bs[1].accept(0, 3).unwrap());
        (bs[0].connect(1, 3).unwrap(), h.join().unwrap())
    });
    drop((a, b));
}

#[test]
fn junk_connections_do_not_disturb_the_root() {
    let c = cfg(3000);
    let id = UniqueId::new(&c).unwrap();
    let root = id.root_addr();
    drop(TcpStream::connect(root).unwrap()); // connects and leaves
    let mut g = TcpStream::connect(root).unwrap();
    g.write_all(&[0xAB; 200]).unwrap(); // garbage instead of a handshake
    let mut h = TcpStream::connect(root).unwrap();
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.resize(64, 0xFF);
    h.write_all(&huge).unwrap(); // a "frame" with an absurd length
    let _silent = TcpStream::connect(root).unwrap(); // says nothing, stays open
                                                     // Authenticated, then an oversized hello frame.
    let mut a = wire::connect_retry(root, &w(1000), "root").unwrap();
    auth::client(&mut a, &id.secret(), &w(1000), "root").unwrap();
    a.write_all(&u64::MAX.to_le_bytes()).unwrap();
    // Authenticated, then a malformed hello.
    let mut m = wire::connect_retry(root, &w(1000), "root").unwrap();
    auth::client(&mut m, &id.secret(), &w(1000), "root").unwrap();
    wire::write_frame(&mut m, &[b"short"], &w(1000), "root").unwrap();

    let bs = on_ranks(3, |r| Bootstrap::init(&id, 3, r, &c, flag()).unwrap());
    check_allgather(&bs);
}

#[test]
fn argument_errors() {
    let c = cfg(1000);
    let id = UniqueId::compose("127.0.0.1:1".parse().unwrap(), &[0; 16]);
    let t = Instant::now();
    assert!(matches!(
        Bootstrap::init(&id, 0, 0, &c, flag()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Bootstrap::init(&id, 4, 4, &c, flag()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "checked before contacting the root (the deadline is 1 s)"
    );
}

#[test]
fn root_rejects_bad_ranks_and_keeps_the_first_of_a_duplicate() {
    let c = cfg(3000);
    let id = UniqueId::new(&c).unwrap();
    let root = id.root_addr();
    // A hello that bypasses the local checks: rank 5 of 2.
    let mut s = wire::connect_retry(root, &w(1000), "root").unwrap();
    auth::client(&mut s, &id.secret(), &w(1000), "root").unwrap();
    let me = PeerInfo {
        rank: 5,
        addr: "127.0.0.1:9".parse().unwrap(),
        host_id: 1,
        pid: 2,
        hostname: "h".into(),
    };
    let e = root::rendezvous(&mut s, root, 2, &me, 1 << 20, &w(2000)).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.message().contains("rank 5"),
        "{e}"
    );

    thread::scope(|sc| {
        let first = sc.spawn(|| Bootstrap::init(&id, 2, 0, &c, flag()));
        thread::sleep(Duration::from_millis(300));
        let e = Bootstrap::init(&id, 2, 0, &c, flag()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(
            e.message()
                .contains("rank 0 is already taken by 127.0.0.1:"),
            "{e}"
        );
        let e = Bootstrap::init(&id, 3, 1, &c, flag()).unwrap_err();
        assert!(
            e.message().contains("nranks=3") && e.message().contains("nranks=2"),
            "{e}"
        );
        let second = Bootstrap::init(&id, 2, 1, &c, flag()).unwrap();
        let first = first.join().unwrap().unwrap();
        let _ = (first, second);
    });
}

/// Ranks given another job size than the root's first arrival came, and were refused: at the
/// deadline the ranks that were let in are told so, not that those ranks never arrived.
#[test]
fn ranks_refused_for_another_job_size_are_reported_as_such() {
    let c = cfg(1500);
    let id = UniqueId::new(&c).unwrap();
    let t = Instant::now();
    let rs = on_ranks(4, |r| {
        // Rank 0 first, so that its size is the one the root goes by.
        if r > 0 {
            thread::sleep(Duration::from_millis(200));
        }
        Bootstrap::init(&id, if r == 0 { 3 } else { 4 }, r, &c, flag())
            .map(|_| ())
            .unwrap_err()
    });
    let m = rs[0].message();
    eprintln!(
        "root given 3 ranks, the others 4: rank 0 after {:?}: {m}",
        t.elapsed()
    );
    assert!(matches!(rs[0], Error::InvalidArgument(_)), "{m}");
    assert!(
        m.contains("ranks 1, 2, 3 arrived saying the job has 4 ranks, but rank 0 ("),
        "{m}"
    );
    assert!(
        m.contains(
            "saying 3: the number of ranks (WORLD_SIZE under a launcher) differs between ranks"
        ),
        "{m}"
    );
    assert!(!m.contains("never arrived"), "{m}");
    for e in &rs[1..] {
        assert!(
            e.message().contains("joined with nranks=4, but rank 0"),
            "{e}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn missing_rank_times_out_everywhere_with_its_name() {
    let c = cfg(2000);
    let id = UniqueId::new(&c).unwrap();
    let t = Instant::now();
    let rs = on_ranks(3, |r| {
        if r == 2 {
            None
        } else {
            Some(Bootstrap::init(&id, 4, r, &c, flag()))
        }
    });
    for r in rs.into_iter().flatten() {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Timeout(_)), "{e}");
        let want = format!(
            "ranks [2, 3] of 4 never arrived at the rendezvous at {} within 2s",
            id.root_addr()
        );
        assert!(e.message().contains(&want), "{e}");
    }
    assert!(
        t.elapsed() < Duration::from_millis(3000),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn unreachable_root_times_out() {
    let id = UniqueId::compose(
        format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        &[0; 16],
    );
    let t = Instant::now();
    let e = Bootstrap::init(&id, 2, 1, &cfg(500), flag()).unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(t.elapsed() < Duration::from_millis(1500));
}

#[test]
fn abort_interrupts_every_wait() {
    let c = cfg(20_000);
    // During init (the root waits for a rank that never comes).
    let id = UniqueId::new(&c).unwrap();
    let f = flag();
    let t = thread::scope(|sc| {
        let h = sc.spawn(|| Bootstrap::init(&id, 2, 0, &c, f.clone()));
        thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        f.store(true, Ordering::Release);
        assert!(matches!(h.join().unwrap(), Err(Error::Aborted(_))));
        t.elapsed()
    });
    assert!(t < Duration::from_secs(1), "{t:?}");

    let bs = init_all(2, &c);
    // During accept.
    thread::scope(|sc| {
        let h = sc.spawn(|| bs[0].accept(1, 77));
        thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        bs[0].abort();
        assert!(matches!(h.join().unwrap(), Err(Error::Aborted(_))));
        assert!(t.elapsed() < Duration::from_secs(1));
    });
    let e = bs[0].allgather(b"x").unwrap_err();
    assert!(matches!(e, Error::Aborted(_)), "{e}");

    // A peer blocked on the aborted rank sees the connection close instead of waiting 20 s.
    let bs = init_all(2, &c);
    thread::scope(|sc| {
        let h = sc.spawn(|| bs[1].allgather(b"y"));
        thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        bs[0].abort();
        let e = h.join().unwrap().unwrap_err();
        assert!(matches!(e, Error::Remote(_)), "{e}");
        assert!(e.message().contains("rank 0"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1));
    });

    // The caller's flag stops an all-gather whose peer never joins.
    let f = flag();
    let id = UniqueId::new(&c).unwrap();
    let bs = on_ranks(2, |r| {
        Bootstrap::init(&id, 2, r, &c, if r == 0 { f.clone() } else { flag() }).unwrap()
    });
    thread::scope(|sc| {
        let h = sc.spawn(|| bs[0].barrier());
        thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        f.store(true, Ordering::Release);
        assert!(matches!(h.join().unwrap(), Err(Error::Aborted(_))));
        assert!(t.elapsed() < Duration::from_secs(1));
    });
}

fn exchange(a: &mut TcpStream, b: &mut TcpStream, tag: u64) {
    a.write_all(&tag.to_le_bytes()).unwrap();
    let mut got = [0u8; 8];
    b.read_exact(&mut got).unwrap();
    assert_eq!(u64::from_le_bytes(got), tag);
}

#[test]
fn connect_and_accept_in_either_order_with_tags() {
    let bs = init_all(3, &cfg(3000));
    // Silent and garbage connections to a rank listener do not hold up real ones.
    let _silent = TcpStream::connect(bs[2].peers()[2].addr).unwrap();
    let mut junk = TcpStream::connect(bs[2].peers()[2].addr).unwrap();
    junk.write_all(&[0xFF; 100]).unwrap();
    // connect first, accept later
    let mut c = bs[0].connect(2, 1).unwrap();
    thread::sleep(Duration::from_millis(100));
    let mut a = bs[2].accept(0, 1).unwrap();
    exchange(&mut c, &mut a, 1);
    exchange(&mut a, &mut c, 1);
    // accept first, connect later
    thread::scope(|sc| {
        let h = sc.spawn(|| bs[1].accept(2, 2).unwrap());
        thread::sleep(Duration::from_millis(200));
        let mut c = bs[2].connect(1, 2).unwrap();
        let mut a = h.join().unwrap();
        exchange(&mut c, &mut a, 2);
    });
    // several tags, accepted in another order than connected
    let mut cs: Vec<_> = [5u64, 6, 7]
        .iter()
        .map(|&t| (t, bs[1].connect(0, t).unwrap()))
        .collect();
    for &t in &[7u64, 5, 6] {
        let mut a = bs[0].accept(1, t).unwrap();
        let c = &mut cs.iter_mut().find(|(ct, _)| *ct == t).unwrap().1;
        exchange(c, &mut a, t);
    }
    // a tag nobody connected times out, naming the peer
    let e = Bootstrap::accept(&bs[0], 2, 99).unwrap_err();
    assert!(
        matches!(e, Error::Timeout(_)) && e.message().contains("rank 2"),
        "{e}"
    );
    assert!(matches!(
        bs[0].connect(3, 0),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn split_by_color_and_reversed_key() {
    let n = 6;
    let bs = init_all(n, &cfg(5000));
    let kids = on_ranks(n, |r| {
        let color = if r == 5 { None } else { Some((r % 2) as u32) };
        bs[r].split(color, -(r as i32)).unwrap()
    });
    assert!(kids[5].is_none());
    // color 0: old ranks 0, 2, 4 ordered by key -r => 4, 2, 0. color 1: 1, 3 => 3, 1.
    let expect = [
        (0usize, 2usize, 3usize),
        (1, 1, 2),
        (2, 1, 3),
        (3, 0, 2),
        (4, 0, 3),
    ];
    for &(old, new, size) in &expect {
        let k = kids[old].as_ref().unwrap();
        assert_eq!((k.rank(), k.nranks()), (new, size), "old rank {old}");
        assert_eq!(k.peers()[new].addr, bs[old].peers()[old].addr);
    }
    let c0 = kids[0].as_ref().unwrap().comm_id();
    let c1 = kids[1].as_ref().unwrap().comm_id();
    assert_ne!(c0, c1);
    assert_ne!(c0, bs[0].comm_id());
    assert_eq!(kids[2].as_ref().unwrap().comm_id(), c0);
    assert_eq!(kids[3].as_ref().unwrap().comm_id(), c1);

    let outs = on_ranks(n, |r| {
        kids[r]
            .as_ref()
            .map(|k| k.allgather(&[r as u8; 2]).unwrap())
    });
    assert_eq!(
        outs[0].as_ref().unwrap(),
        &vec![vec![4u8; 2], vec![2; 2], vec![0; 2]]
    );
    assert_eq!(outs[1].as_ref().unwrap(), &vec![vec![3u8; 2], vec![1; 2]]);
    // Children have their own connections; the parent still works, and aborting a child
    // leaves the parent alone.
    kids[1].as_ref().unwrap().abort();
    check_allgather(&bs);
    let grand = on_ranks(n, |r| {
        kids[r]
            .as_ref()
            .filter(|_| r % 2 == 0)
            .map(|k| k.split(Some(0), 0).unwrap().unwrap())
    });
    let g: Vec<_> = grand.into_iter().flatten().collect();
    assert_eq!(g.len(), 3);
    let outs = on_ranks(3, |i| g[i].allgather(&[g[i].rank() as u8]).unwrap());
    assert!(outs.iter().all(|o| o == &vec![vec![0u8], vec![1], vec![2]]));
}

/// A rank that dies after the rendezvous and before its ring connections (here: a child process
/// that joins the rendezvous and exits) is named by the others within two seconds, as dead,
/// instead of their waiting out the deadline and blaming a healthy rank.
#[test]
fn a_rank_dying_between_rendezvous_and_the_ring_is_named_at_once() {
    const ROLE: &str = "FERROCCL_BOOTSTRAP_TEST_CHILD";
    let c = cfg(20_000);
    if let Ok(hex) = std::env::var(ROLE) {
        // The child: rank 2 of 3 joins the rendezvous with this id, then dies.
        let bytes: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let id = UniqueId::from_bytes(&bytes).unwrap();
        let w = Wait::new(c.timeout, AbortSet::new(flag()));
        let mut s = auth::connect(
            id.root_addr(),
            &id.secret(),
            &w,
            "the bootstrap root",
            "root",
        )
        .unwrap();
        let listener =
            Listener::bind("127.0.0.1".parse().unwrap(), id.secret(), c.timeout).unwrap();
        let me = PeerInfo {
            rank: 2,
            addr: listener.addr(),
            host_id: host::host_id(),
            pid: std::process::id(),
            hostname: host::hostname(),
        };
        root::rendezvous(&mut s, id.root_addr(), 3, &me, c.max_bootstrap_msg, &w).unwrap();
        std::process::exit(0);
    }
    let id = UniqueId::new(&c).unwrap();
    let hex: String = id.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "bootstrap::tests::a_rank_dying_between_rendezvous_and_the_ring_is_named_at_once",
            "--exact",
            "--test-threads=1",
        ])
        .env(ROLE, hex)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let errs = on_ranks(2, |r| {
        Bootstrap::init(&id, 3, r, &c, flag())
            .map(|_| ())
            .unwrap_err()
    });
    let took = t.elapsed();
    let _ = child.wait();
    eprintln!("rank 2 died after the rendezvous: {took:?}: {errs:#?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    for e in &errs {
        let m = e.to_string();
        assert!(
            m.contains("rank 2") && m.contains("died while the communicator was being created"),
            "{m}"
        );
    }
}

/// Ids made independently by every rank for an address agreed in advance (NCCL_COMM_ID): rank 0
/// starts the root there, whoever arrives first; an address already taken fails rank 0 at
/// once, naming it.
#[test]
fn ids_at_an_agreed_address_need_no_shipping() {
    let c = cfg(10_000);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let n = 3;
    let bs = on_ranks(n, |r| {
        // Rank 0 last: the others wait for the root to appear.
        if r == 0 {
            thread::sleep(Duration::from_millis(200));
        }
        Bootstrap::init(&UniqueId::at(addr, [3u8; 16]), n, r, &c, flag()).unwrap()
    });
    check_allgather(&bs);
    // The address taken by something else: rank 0 says so at once.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap();
    let e = Bootstrap::init(&UniqueId::at(busy, [3u8; 16]), 2, 0, &c, flag())
        .map(|_| ())
        .unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("cannot bind the rendezvous on {busy}")),
        "{e}"
    );
}
