//! The public API on the host backend: bad input, groups, one thread driving all ranks, split,
//! abort, deadlines, and dead peers.

mod common;

use common::launch::{role, spawn_ranks, wait_all};
use ferroccl::{
    CollKind, Comm, Config, DataType, Device, Error, Group, OpArgs, ReduceOp, TransportChoice,
    UniqueId,
};
use std::time::{Duration, Instant};

fn cfg(timeout_ms: u64) -> Config {
    Config {
        timeout: Duration::from_millis(timeout_ms),
        ..Config::default()
    }
}

/// Runs `f` on every rank's thread and returns the results in rank order.
fn on_all<T: Send>(comms: &[Comm], f: impl Fn(&Comm) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn sum_ok(c: &Comm) -> bool {
    let send = vec![c.rank() as i64 + 1; 1000];
    let mut recv = vec![0i64; 1000];
    let n = c.nranks() as i64;
    c.all_reduce(&send, &mut recv, ReduceOp::Sum).is_ok()
        && recv.iter().all(|&v| v == n * (n + 1) / 2)
}

#[test]
fn bad_arguments_fail_cleanly_and_the_communicator_stays_usable() {
    let comms = Comm::init_all(3, &cfg(20_000)).unwrap();
    let results = on_all(&comms, |c| {
        let mut out = vec![0f32; 64];
        let send = vec![1f32; 64];
        let mut errs: Vec<Error> = Vec::new();
        let out_ptr = out.as_mut_ptr() as *mut u8;
        let base = |kind| OpArgs {
            kind,
            send: send.as_ptr() as *const u8,
            recv: out_ptr,
            count: 64,
            dtype: DataType::Float32,
            op: ReduceOp::Sum,
            root: 0,
            device_scalar: None,
        };
        // SAFETY (all below): the calls must be rejected before touching any buffer.
        unsafe {
            errs.push(
                c.run_raw(&OpArgs {
                    send: std::ptr::null(),
                    ..base(CollKind::AllReduce)
                })
                .unwrap_err(),
            );
            errs.push(
                c.run_raw(&OpArgs {
                    recv: out_ptr.add(1),
                    ..base(CollKind::AllReduce)
                })
                .unwrap_err(),
            );
            errs.push(
                c.run_raw(&OpArgs {
                    count: usize::MAX / 2,
                    ..base(CollKind::AllReduce)
                })
                .unwrap_err(),
            );
            errs.push(
                c.run_raw(&OpArgs {
                    count: usize::MAX / 2,
                    ..base(CollKind::AllGather)
                })
                .unwrap_err(),
            );
            errs.push(
                c.run_raw(&OpArgs {
                    root: 3,
                    ..base(CollKind::Broadcast)
                })
                .unwrap_err(),
            );
            errs.push(
                c.run_raw(&OpArgs {
                    root: 7,
                    ..base(CollKind::Send)
                })
                .unwrap_err(),
            );
            errs.push(
                c.run_raw(&OpArgs {
                    dtype: DataType::Int32,
                    op: ReduceOp::PreMulSum(0.5),
                    ..base(CollKind::AllReduce)
                })
                .unwrap_err(),
            );
            errs.push(
                c.run_raw(&OpArgs {
                    recv: (send.as_ptr() as *mut u8).add(4),
                    ..base(CollKind::AllReduce)
                })
                .unwrap_err(),
            );
            // A device scalar on a host communicator: well-formed, but only a GPU can read it.
            let dev = send.as_ptr() as u64;
            errs.push(
                c.run_raw(&OpArgs {
                    op: ReduceOp::PreMulSum(1.0),
                    device_scalar: Some(dev),
                    ..base(CollKind::AllReduce)
                })
                .unwrap_err(),
            );
        }
        // Typed API: lengths that do not fit the operation.
        let mut small = vec![0f32; 10];
        errs.push(c.all_gather(&send, &mut small).unwrap_err());
        errs.push(c.all_to_all(&send[..62], &mut out).unwrap_err());
        let untouched = out.iter().all(|&v| v == 0.0);
        (errs, untouched, sum_ok(c))
    });
    for (r, (errs, untouched, ok_after)) in results.into_iter().enumerate() {
        for e in &errs {
            assert!(matches!(e, Error::InvalidArgument(_)), "rank {r}: {e}");
        }
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        for needle in [
            "null",
            "aligned",
            "isize::MAX",
            "overflows",
            "root 3",
            "peer 7",
            "not an integer",
            "overlap",
            "need",
            "multiple",
            "needs a GPU communicator",
        ] {
            assert!(
                text.iter().any(|t| t.contains(needle)),
                "rank {r}: no error mentions '{needle}': {text:#?}"
            );
        }
        assert!(untouched, "rank {r}: a rejected call wrote into the output");
        assert!(
            ok_after,
            "rank {r}: the communicator is not usable after invalid arguments"
        );
    }
    assert!(DataType::from_nccl_id(12).is_err());
    assert!(ReduceOp::from_nccl_id(9).is_err());
}

#[test]
fn bad_init_arguments() {
    let c = cfg(2000);
    let id = UniqueId::new(&c).unwrap();
    assert!(matches!(
        Comm::init_rank(&id, 0, 0, Device::Host, &c),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Comm::init_rank(&id, 2, 2, Device::Host, &c),
        Err(Error::InvalidArgument(_))
    ));
    assert!(Comm::init_all(0, &c).is_err());
    let bad = Config {
        chunk_bytes: 1 << 30,
        ..cfg(2000)
    };
    assert!(matches!(
        Comm::init_all(2, &bad),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn duplicate_rank_and_missing_rank_and_foreign_id() {
    // Two threads claim rank 1 of 3, rank 2 never comes: the duplicate is refused by name,
    // and everyone else times out naming the missing rank.
    let c = cfg(1500);
    let id = UniqueId::new(&c).unwrap();
    let t = Instant::now();
    let results: Vec<Result<Comm, Error>> = std::thread::scope(|s| {
        let hs: Vec<_> = [0usize, 1, 1]
            .iter()
            .map(|&r| {
                let (id, c) = (&id, &c);
                s.spawn(move || Comm::init_rank(id, 3, r, Device::Host, c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t.elapsed() < Duration::from_secs(5));
    let msgs: Vec<String> = results
        .iter()
        .map(|r| r.as_ref().unwrap_err().to_string())
        .collect();
    assert!(
        msgs.iter()
            .any(|m| m.contains("rank 1") && m.contains("already")),
        "{msgs:#?}"
    );
    assert!(
        msgs.iter().filter(|m| m.contains("[2]")).count() >= 1,
        "{msgs:#?}"
    );

    // A UniqueId with the right address but another job's secret is refused.
    let real = UniqueId::new(&c).unwrap();
    let mut bytes = *real.as_bytes();
    let forged = (0..128).find_map(|i| {
        let mut b = bytes;
        b[i] ^= 0xff;
        UniqueId::from_bytes(&b)
            .ok()
            .filter(|f| f.root_addr() == real.root_addr() && f != &real)
    });
    let forged = forged.expect("a byte of the secret can be changed");
    bytes.copy_from_slice(forged.as_bytes());
    let err = Comm::init_rank(
        &UniqueId::from_bytes(&bytes).unwrap(),
        1,
        0,
        Device::Host,
        &c,
    )
    .unwrap_err();
    assert!(
        matches!(err, Error::Protocol(_) | Error::Timeout(_)),
        "{err}"
    );
    // The real job still forms.
    let comm = Comm::init_rank(&real, 1, 0, Device::Host, &c).unwrap();
    assert!(sum_ok(&comm));
}

/// Ranks that set a knob the wire depends on differently fail at creation, all of them, naming
/// the knob and every rank's value (before, a chunk size set on one rank only gave millions of
/// wrong elements and exit code 0; a heartbeat interval, a death that never happened).
#[test]
fn ranks_that_disagree_on_a_wire_knob_fail_at_creation_naming_it() {
    let base = cfg(5000);
    let cases: [(&str, Config, &str); 3] = [
        (
            "FERROCCL_CHUNK_BYTES",
            Config {
                chunk_bytes: 131072,
                ..base.clone()
            },
            "131072 on rank(s) [0], 262144 on rank(s) [1, 2]",
        ),
        (
            "FERROCCL_HEARTBEAT_INTERVAL",
            Config {
                heartbeat_interval: Duration::from_millis(50),
                ..base.clone()
            },
            "0.05 on rank(s) [0]",
        ),
        (
            "FERROCCL_TRANSPORT",
            Config {
                transport: TransportChoice::Tcp,
                ..base.clone()
            },
            "tcp on rank(s) [0], auto on rank(s) [1, 2]",
        ),
    ];
    for (knob, odd, want) in cases {
        let id = UniqueId::new(&base).unwrap();
        let t = Instant::now();
        let results: Vec<Result<Comm, Error>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let (id, c) = (&id, if r == 0 { &odd } else { &base });
                    s.spawn(move || Comm::init_rank(id, 3, r, Device::Host, c))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{knob}: {:?}",
            t.elapsed()
        );
        for (r, res) in results.iter().enumerate() {
            let e = res
                .as_ref()
                .err()
                .unwrap_or_else(|| panic!("{knob}: rank {r} was created"));
            assert!(
                matches!(e, Error::InvalidArgument(_)),
                "{knob}, rank {r}: {e}"
            );
            assert!(
                e.to_string().contains(knob) && e.to_string().contains(want),
                "{knob}, rank {r}: {e}"
            );
        }
    }
}

#[test]
fn one_thread_drives_every_rank_with_a_group() {
    for transport in [TransportChoice::Shm, TransportChoice::Tcp] {
        let comms = Comm::init_all(
            4,
            &Config {
                transport,
                ..cfg(20_000)
            },
        )
        .unwrap();
        let sends: Vec<Vec<f64>> = (0..4)
            .map(|r| (0..5000).map(|i| (i * 4 + r) as f64).collect())
            .collect();
        let mut recvs: Vec<Vec<f64>> = vec![vec![0.0; 5000]; 4];
        let mut g = Group::new();
        for ((c, s), r) in comms.iter().zip(&sends).zip(recvs.iter_mut()) {
            g.all_reduce(c, s, r, ReduceOp::Max).unwrap();
        }
        g.launch().unwrap();
        for r in &recvs {
            for (i, v) in r.iter().enumerate() {
                assert_eq!(*v, (i * 4 + 3) as f64);
            }
        }
    }
}

#[test]
fn p2p_groups_in_any_order_do_not_deadlock() {
    // Every rank sends 3 MiB to every rank (itself included) and receives from every rank,
    // receives issued before sends, in one group: large enough to fill every FIFO.
    let n = 4;
    let comms = Comm::init_all(n, &cfg(30_000)).unwrap();
    let count = 3 << 18;
    let results = on_all(&comms, |c| {
        let r = c.rank();
        let sends: Vec<Vec<u32>> = (0..n)
            .map(|p| {
                (0..count)
                    .map(|i| (r * 1000 + p) as u32 ^ i as u32)
                    .collect()
            })
            .collect();
        let mut recvs: Vec<Vec<u32>> = vec![vec![0; count]; n];
        let mut g = Group::new();
        for (p, buf) in recvs.iter_mut().enumerate() {
            g.recv(c, buf, p).unwrap();
        }
        for (p, buf) in sends.iter().enumerate() {
            g.send(c, buf, p).unwrap();
        }
        g.launch().unwrap();
        recvs.iter().enumerate().all(|(p, buf)| {
            buf.iter()
                .enumerate()
                .all(|(i, &v)| v == (p * 1000 + r) as u32 ^ i as u32)
        })
    });
    assert!(results.iter().all(|&ok| ok));
}

#[test]
fn split_by_color_and_key() {
    let comms = Comm::init_all(5, &cfg(20_000)).unwrap();
    let results = on_all(&comms, |c| {
        let r = c.rank();
        let color = if r == 4 { None } else { Some((r % 2) as u32) };
        let sub = c.split(color, -(r as i32)).unwrap();
        sub.map(|s| {
            let mut v = vec![r as u64; 10];
            s.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            (s.rank(), s.nranks(), v[0])
        })
    });
    // Even ranks 0, 2 (reversed by key: 2 is rank 0); odd 1, 3; rank 4 in none.
    assert_eq!(results[0], Some((1, 2, 2)));
    assert_eq!(results[2], Some((0, 2, 2)));
    assert_eq!(results[1], Some((1, 2, 4)));
    assert_eq!(results[3], Some((0, 2, 4)));
    assert_eq!(results[4], None);
}

#[test]
fn abort_returns_waiters_promptly() {
    let comms = Comm::init_all(2, &cfg(60_000)).unwrap();
    let t = Instant::now();
    let err = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let mut v = vec![1f32; 1 << 16];
            comms[0].all_reduce_in_place(&mut v, ReduceOp::Sum)
        });
        std::thread::sleep(Duration::from_millis(200));
        comms[0].abort();
        waiter.join().unwrap().unwrap_err()
    });
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "abort took {:?}",
        t.elapsed()
    );
    assert!(matches!(err, Error::Aborted(_)), "{err}");
    // Later calls fail too, without waiting.
    let mut v = vec![1f32; 4];
    assert!(comms[0].all_reduce_in_place(&mut v, ReduceOp::Sum).is_err());
}

#[test]
fn a_missing_peer_is_a_timeout_naming_it() {
    let comms = Comm::init_all(3, &cfg(800)).unwrap();
    let t = Instant::now();
    // Rank 1 never joins the all-reduce; ranks 0 and 2 wait for it (directly or through the ring).
    let errs = std::thread::scope(|s| {
        let hs: Vec<_> = [0usize, 2]
            .iter()
            .map(|&r| {
                let c = &comms[r];
                s.spawn(move || {
                    let mut v = vec![1f32; 1 << 12];
                    c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err()
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert!(
        errs.iter()
            .any(|e| matches!(e, Error::Timeout(_)) && e.to_string().contains("rank 1")),
        "{errs:#?}"
    );
    for e in &errs {
        assert!(e.to_string().contains("all_reduce #1"), "{e}");
    }
}

/// The newcomer's mistake: one thread calling every rank of an `init_all` communicator one after
/// the other. The first call waits for ranks nobody drives; its deadline error says why and what
/// to do, over shared memory (waiting for the peer's segment) and TCP (for its connection), and
/// when the connections already exist (waiting for its data). A rank that is only late gets
/// no such hint.
#[test]
fn one_thread_calling_ranks_in_turn_is_told_to_use_a_group() {
    for transport in [TransportChoice::Shm, TransportChoice::Tcp] {
        let comms = Comm::init_all(
            2,
            &Config {
                transport,
                ..cfg(1000)
            },
        )
        .unwrap();
        let t = Instant::now();
        let mut v = vec![1f32; 64];
        let e = comms[0]
            .all_reduce_in_place(&mut v, ReduceOp::Sum)
            .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        assert!(matches!(e, Error::Timeout(_)), "{transport:?}: {e}");
        assert!(
            e.to_string()
                .contains("use a Group to drive several ranks from one thread"),
            "{transport:?}: {e}"
        );
    }
    // Connected first (threads), then the same mistake: the executor's deadline says it too.
    let comms = Comm::init_all(2, &cfg(1000)).unwrap();
    assert!(on_all(&comms, sum_ok).iter().all(|&ok| ok));
    let mut v = vec![1f32; 64];
    let e = comms[0]
        .all_reduce_in_place(&mut v, ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("use a Group"), "{e}");
    // A peer that started the operation and is slow is not called undriven.
    let comms = Comm::init_all(2, &cfg(1000)).unwrap();
    let errs = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let mut v = vec![1f32; 64];
            comms[0].all_reduce_in_place(&mut v, ReduceOp::Sum)
        });
        let mut w = vec![1f32; 32];
        // Rank 1 enters an all-reduce of another size: it has started, the ranks disagree.
        let r1 = comms[1].all_reduce_in_place(&mut w, ReduceOp::Sum);
        (h.join().unwrap(), r1)
    });
    for e in [errs.0, errs.1].into_iter().filter_map(Result::err) {
        assert!(!e.to_string().contains("use a Group"), "{e}");
    }
}

/// Child role for the kill test: all-reduce in a loop until an error, then report it.
#[test]
fn child_kill_loop() {
    if role().as_deref() != Some("kill") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env(&cfg).unwrap();
    let mut v = vec![1f32; 1 << 20];
    let t = Instant::now();
    loop {
        if let Err(e) = comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
            println!("ERROR after {:?}: {e}", t.elapsed());
            std::process::exit(3);
        }
        v.fill(1.0);
        if t.elapsed() > Duration::from_secs(60) {
            println!("never failed");
            std::process::exit(0);
        }
    }
}

#[test]
fn a_killed_peer_process_fails_every_survivor_promptly() {
    if role().is_some() {
        return;
    }
    for transport in ["shm", "tcp"] {
        let mut kids = spawn_ranks(
            4,
            "child_kill_loop",
            "kill",
            &[
                ("FERROCCL_TRANSPORT", transport.into()),
                ("FERROCCL_TIMEOUT", "30".into()),
            ],
        );
        std::thread::sleep(Duration::from_millis(1500));
        kids[2].kill().unwrap();
        let killed_at = Instant::now();
        let out = wait_all(kids);
        let took = killed_at.elapsed();
        // Heartbeats name the dead rank within milliseconds; 2 s covers the survivors' exit too.
        assert!(
            took < Duration::from_secs(2),
            "{transport}: survivors took {took:?}"
        );
        for (r, (ok, text)) in out.iter().enumerate() {
            if r == 2 {
                continue;
            }
            assert!(
                !ok && text.contains("ERROR"),
                "{transport} rank {r}: {text}"
            );
            assert!(
                text.contains("rank 2 (") && text.contains("died"),
                "{transport} rank {r} does not say who died: {text}"
            );
        }
    }
}
