//! Ranks that disagree about an operation: with check mode on, every rank fails before
//! anything moves, naming who differs in what; with it off, the call may fail or produce
//! junk, but it ends by the deadline and never writes outside the caller's buffers.

use ferroccl::{CollKind, Comm, Config, DataType, Error, Group, OpArgs, ReduceOp, TransportChoice};
use std::time::{Duration, Instant};

/// Bytes of guard on each side of every buffer.
const GUARD: usize = 256;
const GUARD_BYTE: u8 = 0xA5;
const UNWRITTEN: u8 = 0x5A;

/// One buffer with guard bytes around it, 8-byte aligned for every element type.
struct Guarded {
    mem: Vec<u64>,
    len: usize,
}

impl Guarded {
    fn new(len: usize, fill: impl Fn(usize) -> u8) -> Guarded {
        let mut g = Guarded {
            mem: vec![0; (2 * GUARD + len).div_ceil(8)],
            len,
        };
        let bytes = g.all();
        bytes.fill(GUARD_BYTE);
        for i in 0..len {
            bytes[GUARD + i] = fill(i);
        }
        g
    }
    fn all(&mut self) -> &mut [u8] {
        // SAFETY: the Vec<u64> holds at least 2 * GUARD + len bytes.
        unsafe {
            std::slice::from_raw_parts_mut(self.mem.as_mut_ptr() as *mut u8, 2 * GUARD + self.len)
        }
    }
    fn ptr(&mut self) -> *mut u8 {
        self.all()[GUARD..].as_mut_ptr()
    }
    fn body(&mut self) -> Vec<u8> {
        let len = self.len;
        self.all()[GUARD..GUARD + len].to_vec()
    }
    fn guards_intact(&mut self) -> bool {
        let len = self.len;
        let b = self.all();
        b[..GUARD]
            .iter()
            .chain(&b[GUARD + len..])
            .all(|&x| x == GUARD_BYTE)
    }
}

#[derive(Clone, Copy, Debug)]
struct Call {
    kind: CollKind,
    dtype: DataType,
    count: usize,
    op: ReduceOp,
    root: usize,
}

fn call(kind: CollKind, dtype: DataType, count: usize) -> Call {
    Call {
        kind,
        dtype,
        count,
        op: ReduceOp::Sum,
        root: 0,
    }
}

fn input_byte(rank: usize, i: usize) -> u8 {
    // Small values, so that sums of any type stay exact and far from overflow.
    if i.is_multiple_of(4) {
        (rank + 1) as u8
    } else {
        0
    }
}

/// What one rank saw: its result, how long the call took, whether its buffers stayed
/// inside their bounds, whether its input survived, and what it received.
struct Seen {
    result: Result<(), Error>,
    took: Duration,
    in_bounds: bool,
    input_intact: bool,
    output: Vec<u8>,
}

/// Every rank runs `calls(rank)` (several calls make one group) on its own thread.
fn run(comms: &[Comm], calls: impl Fn(usize) -> Vec<Call> + Sync) -> Vec<Seen> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let calls = &calls;
                s.spawn(move || {
                    let (r, n) = (c.rank(), c.nranks());
                    let cs = calls(r);
                    let mut bufs: Vec<(Guarded, Guarded)> = cs
                        .iter()
                        .map(|a| {
                            let (sc, rc) = a.kind.buffer_counts(a.count, n, a.root == r).unwrap();
                            let es = a.dtype.size();
                            (
                                Guarded::new(sc * es, |i| input_byte(r, i)),
                                Guarded::new(rc * es, |_| UNWRITTEN),
                            )
                        })
                        .collect();
                    let t = Instant::now();
                    let result = {
                        let mut g = Group::new();
                        let mut pushed = Ok(());
                        for (a, (sb, rb)) in cs.iter().zip(bufs.iter_mut()) {
                            let args = OpArgs {
                                kind: a.kind,
                                send: sb.ptr(),
                                recv: rb.ptr(),
                                count: a.count,
                                dtype: a.dtype,
                                op: a.op,
                                root: a.root,
                                device_scalar: None,
                            };
                            // SAFETY: the buffers hold the extents of this rank's arguments and
                            // outlive the launch.
                            pushed = pushed.and_then(|_| unsafe { g.push_raw(c, args) });
                        }
                        pushed.and_then(|_| g.launch())
                    };
                    let took = t.elapsed();
                    let mut in_bounds = true;
                    let mut input_intact = true;
                    let mut output = Vec::new();
                    for (sb, rb) in bufs.iter_mut() {
                        in_bounds &= sb.guards_intact() && rb.guards_intact();
                        input_intact &= sb
                            .body()
                            .iter()
                            .enumerate()
                            .all(|(i, &x)| x == input_byte(r, i));
                        output.extend(rb.body());
                    }
                    Seen {
                        result,
                        took,
                        in_bounds,
                        input_intact,
                        output,
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn cfg(check: bool, transport: TransportChoice, timeout_ms: u64) -> Config {
    Config {
        timeout: Duration::from_millis(timeout_ms),
        bootstrap_addr: Some("127.0.0.1".into()),
        transport,
        check_mismatch: check,
        // Small slots and chunks, so that counts that differ by whole slots are exercised.
        slot_bytes: 4096,
        chunk_bytes: 8192,
        slots: 4,
        ..Config::default()
    }
}

fn f32_ar(count: usize) -> Call {
    call(CollKind::AllReduce, DataType::Float32, count)
}

#[test]
fn check_mode_fails_every_rank_before_anything_moves() {
    let comms = Comm::init_all(3, &cfg(true, TransportChoice::Auto, 5000)).unwrap();
    let pm = |s| Call {
        op: ReduceOp::PreMulSum(s),
        ..f32_ar(64)
    };
    let bc = |root| Call {
        root,
        ..call(CollKind::Broadcast, DataType::Int32, 64)
    };
    let send = |to, count| Call {
        root: to,
        ..call(CollKind::Send, DataType::Int32, count)
    };
    let recv = |from, count| Call {
        root: from,
        ..call(CollKind::Recv, DataType::Int32, count)
    };
    type Case = (&'static str, Box<dyn Fn(usize) -> Vec<Call> + Sync>);
    let cases: Vec<Case> = vec![
        (
            "count differs (ranks 0, 2: 1024; rank 1: 1000)",
            Box::new(|r| vec![f32_ar(if r == 1 { 1000 } else { 1024 })]),
        ),
        (
            "data type differs (ranks 0, 1: float; rank 2: double)",
            Box::new(|r| {
                vec![Call {
                    dtype: if r == 2 {
                        DataType::Float64
                    } else {
                        DataType::Float32
                    },
                    ..f32_ar(64)
                }]
            }),
        ),
        // The same bytes (64 floats, 32 doubles), which no length check can tell apart: the
        // types are compared, not their sizes.
        (
            "data type differs (ranks 0, 1: float; rank 2: double)",
            Box::new(|r| {
                vec![if r == 2 {
                    Call {
                        dtype: DataType::Float64,
                        ..f32_ar(32)
                    }
                } else {
                    f32_ar(64)
                }]
            }),
        ),
        (
            "data type differs (ranks 0, 2: float; rank 1: int32)",
            Box::new(|r| {
                vec![Call {
                    dtype: if r == 1 {
                        DataType::Int32
                    } else {
                        DataType::Float32
                    },
                    ..f32_ar(64)
                }]
            }),
        ),
        (
            "reduction differs (rank 0: max; ranks 1, 2: sum)",
            Box::new(|r| {
                vec![Call {
                    op: if r == 0 { ReduceOp::Max } else { ReduceOp::Sum },
                    ..f32_ar(64)
                }]
            }),
        ),
        (
            "reduction differs (ranks 0, 1: premulsum(0.5); rank 2: premulsum(0.25))",
            Box::new(move |r| vec![pm(if r == 2 { 0.25 } else { 0.5 })]),
        ),
        (
            "root differs (ranks 0, 1: 0; rank 2: 1)",
            Box::new(move |r| vec![bc(usize::from(r == 2))]),
        ),
        (
            "operation differs (ranks 0, 2: all_reduce; rank 1: all_gather)",
            Box::new(|r| {
                vec![if r == 1 {
                    call(CollKind::AllGather, DataType::Float32, 64)
                } else {
                    f32_ar(64)
                }]
            }),
        ),
        (
            "number of collectives in the launch differs (ranks 0, 1: 2; rank 2: 1)",
            Box::new(|r| {
                if r == 2 {
                    vec![f32_ar(8)]
                } else {
                    vec![f32_ar(8), f32_ar(8)]
                }
            }),
        ),
        (
            "message 1 from rank 0 to rank 1: sent as 16 x int32, received as 32 x int32",
            // Sends and receives are checked with the collectives of their launch.
            Box::new(move |r| match r {
                0 => vec![send(1, 16), f32_ar(8)],
                1 => vec![f32_ar(8), recv(0, 32)],
                _ => vec![f32_ar(8)],
            }),
        ),
    ];
    for (want, calls) in &cases {
        let seen = run(&comms, calls);
        for (r, s) in seen.iter().enumerate() {
            let e = s.result.as_ref().expect_err(want);
            eprintln!("check mode, {want}: rank {r} failed after {:?}", s.took);
            assert!(matches!(e, Error::InvalidArgument(_)), "rank {r}: {e}");
            assert!(e.message().contains(want), "rank {r}: want {want:?} in {e}");
            assert!(
                e.message().contains(&format!("on rank {r} of 3")),
                "rank {r}: {e}"
            );
            assert!(
                s.output.iter().all(|&b| b == UNWRITTEN),
                "rank {r} ({want}): an output was written"
            );
            assert!(s.in_bounds && s.input_intact, "rank {r} ({want})");
        }
    }
    // Nothing moved, so the communicator is still usable and its sequence numbers agree.
    let seen = run(&comms, |_| {
        vec![call(CollKind::AllReduce, DataType::Int32, 64)]
    });
    for s in &seen {
        s.result.as_ref().unwrap();
        let want: Vec<u8> = (0..256).map(|i| if i % 4 == 0 { 6 } else { 0 }).collect();
        assert_eq!(s.output, want);
    }
}

/// A disagreement that check mode is off for: how it may end.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// The ranks move different numbers of bytes: at least one rank must fail.
    Error,
    /// Same byte counts (a float read as an int, max instead of sum, two ranks that both
    /// think they are the root): undetectable without check mode; only bounds and time count.
    Anything,
    /// The same bytes in the same messages: every rank completes, none can notice.
    Completes,
}

#[test]
fn without_check_mode_a_mismatch_ends_by_the_deadline_inside_the_buffers() {
    const TIMEOUT_MS: u64 = 1500;
    let slot_f32 = 4096 / 4;
    type Case = (&'static str, Expect, Box<dyn Fn(usize) -> Vec<Call> + Sync>);
    let cases: Vec<Case> = vec![
        (
            "count",
            Expect::Error,
            Box::new(|r| vec![f32_ar(if r == 1 { 1000 } else { 1024 })]),
        ),
        // Whole slots more on one rank: its extra receives never come, so only the deadline ends them.
        (
            "count by whole slots",
            Expect::Error,
            Box::new(move |r| vec![f32_ar(if r == 0 { 8 * slot_f32 } else { 4 * slot_f32 })]),
        ),
        (
            "bigger count on the root",
            Expect::Error,
            Box::new(|r| {
                vec![call(
                    CollKind::Broadcast,
                    DataType::Int8,
                    if r == 0 { 5000 } else { 300 },
                )]
            }),
        ),
        (
            "float vs double",
            Expect::Error,
            Box::new(|r| {
                vec![Call {
                    dtype: if r == 1 {
                        DataType::Float64
                    } else {
                        DataType::Float32
                    },
                    ..f32_ar(512)
                }]
            }),
        ),
        // 2N floats against N doubles: the same bytes in every message, so the length check
        // passes; only check mode, which compares types, catches it.
        (
            "float vs double, same bytes",
            Expect::Completes,
            Box::new(|r| {
                vec![if r == 1 {
                    Call {
                        dtype: DataType::Float64,
                        ..f32_ar(256)
                    }
                } else {
                    f32_ar(512)
                }]
            }),
        ),
        (
            "float vs int32",
            Expect::Anything,
            Box::new(|r| {
                vec![Call {
                    dtype: if r == 1 {
                        DataType::Int32
                    } else {
                        DataType::Float32
                    },
                    ..f32_ar(512)
                }]
            }),
        ),
        (
            "sum vs max",
            Expect::Anything,
            Box::new(|r| {
                vec![Call {
                    op: if r == 0 { ReduceOp::Max } else { ReduceOp::Sum },
                    ..f32_ar(512)
                }]
            }),
        ),
        (
            "root of a broadcast",
            Expect::Anything,
            Box::new(|r| {
                vec![Call {
                    root: usize::from(r == 1),
                    ..call(CollKind::Broadcast, DataType::Int32, 300)
                }]
            }),
        ),
        (
            "root of a reduce",
            Expect::Anything,
            Box::new(|r| {
                vec![Call {
                    root: usize::from(r != 1),
                    ..call(CollKind::Reduce, DataType::Int32, 300)
                }]
            }),
        ),
        // Beyond the one-shot size: on 2 ranks one round of one block each way looks the same
        // for both, while the ring's messages differ (half a buffer against a block).
        (
            "all-reduce vs all-gather",
            Expect::Error,
            Box::new(|r| {
                vec![if r == 0 {
                    call(CollKind::AllGather, DataType::Float32, 40_000)
                } else {
                    f32_ar(40_000)
                }]
            }),
        ),
        (
            "all-reduce vs all-gather, one-shot",
            Expect::Anything,
            Box::new(|r| {
                vec![if r == 0 {
                    call(CollKind::AllGather, DataType::Float32, 700)
                } else {
                    f32_ar(700)
                }]
            }),
        ),
        (
            "send vs receive sizes",
            Expect::Error,
            Box::new(|r| {
                vec![if r == 0 {
                    Call {
                        root: 1,
                        ..call(CollKind::Send, DataType::Int32, 100)
                    }
                } else {
                    Call {
                        root: 0,
                        ..call(CollKind::Recv, DataType::Int32, 2000)
                    }
                }]
            }),
        ),
    ];
    // Cases run side by side (each on its own communicators), so the slow ones, which wait for
    // their deadline, cost one deadline in all.
    for transport in [TransportChoice::Auto, TransportChoice::Tcp] {
        let config = cfg(false, transport, TIMEOUT_MS);
        std::thread::scope(|s| {
            for (name, expect, calls) in &cases {
                let config = &config;
                s.spawn(move || {
                    let comms = Comm::init_all(2, config).unwrap();
                    let seen = run(&comms, calls);
                    for (r, x) in seen.iter().enumerate() {
                        eprintln!(
                            "{name} over {transport:?}: rank {r} {} after {:?}",
                            if x.result.is_ok() {
                                "completed"
                            } else {
                                "failed"
                            },
                            x.took
                        );
                        let ctx = format!("{name} over {transport:?}, rank {r}: {:?}", x.result);
                        assert!(x.in_bounds, "{ctx}: wrote outside its buffers");
                        assert!(x.input_intact, "{ctx}: changed its input");
                        assert!(
                            x.took < Duration::from_millis(TIMEOUT_MS + 1000),
                            "{ctx}: took {:?}",
                            x.took
                        );
                        if let Err(e) = &x.result {
                            // The error must point at the likely cause, or at the peer that failed.
                            let m = e.message();
                            assert!(
                                m.contains("same operations")
                                    || m.contains("different operation")
                                    || m.contains("rank"),
                                "{ctx}"
                            );
                        }
                    }
                    match expect {
                        Expect::Error => assert!(
                            seen.iter().any(|x| x.result.is_err()),
                            "{name} over {transport:?}: no rank noticed"
                        ),
                        Expect::Completes => assert!(
                            seen.iter().all(|x| x.result.is_ok()),
                            "{name} over {transport:?}: a rank noticed"
                        ),
                        Expect::Anything => {}
                    }
                });
            }
        });
    }
}

/// With check mode on, every rank reports the mismatch itself, even when the others abort
/// their communicators the moment they learn of it (as the bench and most programs do): data
/// that already arrived is read before a peer's abort ends a wait.
#[test]
fn every_rank_reports_the_mismatch_even_when_the_others_abort_at_once() {
    let config = Config {
        check_mismatch: true,
        timeout: Duration::from_secs(10),
        ..Config::default()
    };
    for round in 0..20 {
        let comms = Comm::init_all(4, &config).unwrap();
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let n = if c.rank() == 1 { 1000 } else { 1024 };
                        let mut v = vec![1f32; n];
                        let e = c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
                        c.abort();
                        e.to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, e) in errs.iter().enumerate() {
            assert!(
                e.contains("the ranks called different operations") && e.contains("count"),
                "round {round}, rank {r}: {e}"
            );
        }
    }
}
