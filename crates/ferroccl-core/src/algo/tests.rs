use super::*;
use crate::plan::sim::{simulate, simulate_zero_copy, simulate_zero_copy_with, SimOp};
use crate::plan::zcopy::{may_post, peer_desc, remote_dsts, RemoteDsts};
use crate::plan::{Plan, Step};
use proptest::prelude::*;

/// How the tests cut operations: like the tuner, every op of a launch by the same channels and
/// chunk; collectives one-shot when `one_shot`, else all-reduces of at most `direct_max`
/// elements two-shot where that algorithm fits.
#[derive(Clone, Copy, Debug)]
struct Cut {
    channels: usize,
    chunk_elems: usize,
    direct_max: usize,
    one_shot: bool,
    /// As the GPU peer engine cuts them: all-reduce two-shot in rounds of any chunk, on any
    /// rank count, or one-shot on 2 ranks (the tuner picks by size; here odd counts, so that
    /// both are proved); the other collectives one-shot (broadcast and reduce too, on any rank count).
    peer: bool,
}

impl Cut {
    fn plain(channels: usize, chunk_elems: usize) -> Cut {
        Cut {
            channels,
            chunk_elems,
            direct_max: 0,
            one_shot: false,
            peer: false,
        }
    }
    fn tuning(&self, kind: CollKind, n: usize, count: usize) -> Tuning {
        let two_shot = kind == CollKind::AllReduce
            && count <= self.direct_max
            && two_shot_fits(n, count, self.chunk_elems);
        let peer = self.peer && crate::tune::peer_engine_serves(kind, n);
        let algo = if peer && kind == CollKind::AllReduce && !(n == 2 && count % 2 == 1) {
            Algo::TwoShot
        } else if peer || (self.one_shot && kind.is_collective()) {
            Algo::OneShot
        } else if two_shot {
            Algo::TwoShot
        } else {
            Algo::default_for(kind)
        };
        Tuning {
            algo,
            channels: self.channels,
            chunk_elems: self.chunk_elems,
        }
    }
    fn build(&self, desc: &CollDesc, op: u16, rank: Rank, n: usize) -> Plan {
        build(desc, op, rank, n, &self.tuning(desc.kind, n, desc.count))
    }
}

fn plans_for(ops: &[Vec<SimOp>], t: &Cut) -> Vec<Plan> {
    let n = ops.len();
    (0..n)
        .map(|r| {
            let launch: Vec<LaunchOp> = ops[r]
                .iter()
                .map(|op| {
                    let desc = CollDesc {
                        kind: op.kind,
                        count: op.count,
                        root: op.root,
                    };
                    validate(&desc, r, n).expect("valid description");
                    LaunchOp {
                        desc,
                        dtype: crate::types::DataType::Float32,
                        tuning: t.tuning(op.kind, n, op.count),
                    }
                })
                .collect();
            build_launch(r, n, &launch).expect("a launch plan")
        })
        .collect()
}

fn run_collective(
    kind: CollKind,
    n: usize,
    count: usize,
    root: Rank,
    in_place: bool,
    t: Cut,
    seed: u64,
) -> Result<usize, String> {
    let ops: Vec<Vec<SimOp>> = (0..n)
        .map(|_| {
            vec![SimOp {
                kind,
                count,
                root,
                in_place,
            }]
        })
        .collect();
    simulate(&ops, &plans_for(&ops, &t), CAP, seed)
}

/// Every rank's zero-copy marks, each computed as a rank does at run time: from its own plan
/// and the plans it builds for its peers.
fn remote_for(ops: &[Vec<SimOp>], plans: &[Plan], t: &Cut) -> Vec<RemoteDsts> {
    let n = ops.len();
    (0..n)
        .map(|r| {
            remote_dsts(&plans[r], |op, p| {
                let o = ops[r][op as usize];
                let d = peer_desc(
                    &CollDesc {
                        kind: o.kind,
                        count: o.count,
                        root: o.root,
                    },
                    r,
                )?;
                Some(t.build(&d, op, p, n))
            })
        })
        .collect()
}

/// Runs `ops` through the FIFOs, or with every message zero-copy that may be.
fn run_both(ops: &[Vec<SimOp>], t: &Cut, seed: u64, zero_copy: bool) -> Result<usize, String> {
    let plans = plans_for(ops, t);
    if zero_copy {
        simulate_zero_copy(ops, &plans, CAP, seed, &remote_for(ops, &plans, t))
            .map_err(|e| format!("zero-copy: {e}"))
    } else {
        simulate(ops, &plans, CAP, seed)
    }
}

const CAP: usize = crate::config::PLAN_FIFO_MESSAGES;

const PRIMES: [usize; 8] = [2, 3, 5, 7, 13, 61, 4099, 65537];

fn count_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        Just(1usize),
        prop::sample::select(PRIMES.to_vec()),
        0usize..200_000,
        // Huge: offsets near the top of the address space must not overflow.
        (1usize << 40)..(1usize << 44),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    /// Every collective, any ranks/channels/sizes/chunks/roots, in place or not: every output
    /// element gets exactly the right contributions once, inputs stay intact, no deadlock with
    /// one message of room per connection.
    #[test]
    fn collectives_deliver_exactly_once_without_deadlock(
        kind in prop::sample::select(CollKind::COLLECTIVES.to_vec()),
        n in 1usize..=16,
        channels in 1usize..=4,
        count in count_strategy(),
        chunk_div in 1usize..=6,
        root_pick in any::<usize>(),
        in_place in any::<bool>(),
        seed in any::<u64>(),
        direct in any::<bool>(),
        one_shot in any::<bool>(),
        zero_copy in any::<bool>(),
        peer in any::<bool>(),
    ) {
        // Keep the number of loops small for huge sizes; tiny chunks for small sizes.
        // Any chunk size, but never more than ~64 loops per channel: the simulation's cost grows
        // with steps, and what it checks does not change with more of the same loop.
        let chunk = [1, 3, 64, 1000, 4096, 1 << 20][chunk_div - 1].max(count / (64 * n) + 1);
        // Half the cases allow the direct small-size algorithms wherever they apply.
        let t = Cut { channels, chunk_elems: chunk, direct_max: if direct { usize::MAX } else { 0 }, one_shot, peer };
        let root = root_pick % n;
        let ops: Vec<Vec<SimOp>> = (0..n).map(|_| vec![SimOp { kind, count, root, in_place }]).collect();
        let r = run_both(&ops, &t, seed, zero_copy);
        prop_assert!(r.is_ok(), "{kind} n={n} ch={channels} count={count} chunk={chunk} root={root} in_place={in_place}: {}", r.unwrap_err());
    }

    /// Random groups of sends and receives (any pattern, any order of issue) never deadlock and
    /// deliver every message to the right place.
    #[test]
    fn p2p_groups_never_deadlock(
        n in 2usize..=8,
        pairs in prop::collection::vec((any::<usize>(), any::<usize>(), 0usize..5000), 1..12),
        chunk in prop::sample::select(vec![1usize, 7, 512, 100_000]),
        shuffle in any::<u64>(),
    ) {
        let mut ops: Vec<Vec<SimOp>> = vec![Vec::new(); n];
        for (a, b, count) in pairs {
            let (a, b) = (a % n, b % n);
            if a == b { continue; }
            ops[a].push(SimOp { kind: CollKind::Send, count, root: b, in_place: false });
            ops[b].push(SimOp { kind: CollKind::Recv, count, root: a, in_place: false });
        }
        // Each rank may issue its sends and receives in any order relative to each other,
        // provided the per-peer order of sends (and of receives) is kept.
        for (r, rops) in ops.iter_mut().enumerate() {
            let key = shuffle.rotate_left(r as u32);
            let (mut s, mut v): (Vec<SimOp>, Vec<SimOp>) = rops.drain(..).partition(|o| o.kind == CollKind::Send);
            if key & 1 == 1 { std::mem::swap(&mut s, &mut v); }
            rops.extend(s);
            rops.extend(v);
        }
        let t = Cut::plain(1 + (shuffle % 3) as usize, chunk);
        let r = run_both(&ops, &t, shuffle, shuffle & 2 == 2);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    /// A group of several collectives runs them in issue order on every channel.
    #[test]
    fn groups_of_collectives_compose(
        n in 1usize..=6,
        kinds in prop::collection::vec(prop::sample::select(CollKind::COLLECTIVES.to_vec()), 1..5),
        counts in prop::collection::vec(0usize..3000, 5),
        channels in 1usize..=3,
        seed in any::<u64>(),
    ) {
        let ops: Vec<Vec<SimOp>> = (0..n)
            .map(|_| kinds.iter().enumerate().map(|(i, &k)| SimOp { kind: k, count: counts[i], root: i % n, in_place: i % 2 == 0 }).collect())
            .collect();
        let t = Cut { channels, chunk_elems: 97, direct_max: if seed & 4 == 4 { 3000 } else { 0 }, one_shot: seed & 8 == 8, peer: seed & 16 == 16 };
        let r = run_both(&ops, &t, seed, seed & 1 == 1);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn channel_slices_tile_the_range(count in any::<usize>(), channels in 1usize..=64) {
        let mut at = 0;
        for c in 0..channels {
            let (s, e) = channel_slice(count, channels, c);
            prop_assert_eq!(s, at);
            prop_assert!(e >= s);
            at = e;
        }
        prop_assert_eq!(at, count);
    }
}

#[test]
fn the_simulator_catches_a_wrong_plan() {
    // A ring all-reduce that forgets the final division is caught, and so is one that
    // sends a chunk twice, and a pair that both receive first (deadlock).
    let n = 3;
    let ops: Vec<Vec<SimOp>> = (0..n)
        .map(|_| {
            vec![SimOp {
                kind: CollKind::AllReduce,
                count: 30,
                root: 0,
                in_place: false,
            }]
        })
        .collect();
    let t = Cut::plain(1, 10);
    let good = plans_for(&ops, &t);
    assert!(simulate(&ops, &good, CAP, 1).is_ok());

    let mut no_post = good.clone();
    for lane in &mut no_post[1].lanes {
        for s in &mut lane.steps {
            if let Step::RecvReduce { post, .. } = s {
                *post = false;
            }
        }
    }
    assert!(simulate(&ops, &no_post, CAP, 1)
        .unwrap_err()
        .contains("output"));

    let mut dup = good.clone();
    let first = dup[0].lanes[0].steps[0];
    dup[0].lanes[0].steps.insert(0, first);
    assert!(simulate(&ops, &dup, CAP, 1).is_err());

    // Both ranks receive before they send, in one lane: a deadlock.
    let two: Vec<Vec<SimOp>> = (0..2)
        .map(|r| {
            vec![
                SimOp {
                    kind: CollKind::Recv,
                    count: 5,
                    root: 1 - r,
                    in_place: false,
                },
                SimOp {
                    kind: CollKind::Send,
                    count: 5,
                    root: 1 - r,
                    in_place: false,
                },
            ]
        })
        .collect();
    let mut plans = plans_for(&two, &t);
    for p in plans.iter_mut() {
        let send = p.lanes.pop().unwrap();
        p.lanes[0].steps.extend(send.steps);
        p.lanes[0].channel = 7;
    }
    let err = simulate(&two, &plans, CAP, 1).unwrap_err();
    assert!(err.contains("deadlock"), "{err}");
}

#[test]
fn ring_all_reduce_moves_the_optimal_volume() {
    // Each rank sends 2(n-1)/n of the buffer: the bandwidth bound that busbw assumes.
    for n in [2usize, 3, 4, 8] {
        let count = 1 << 16;
        let plan = Cut::plain(2, 1024).build(
            &CollDesc {
                kind: CollKind::AllReduce,
                count,
                root: 0,
            },
            0,
            0,
            n,
        );
        let sent: usize = plan
            .lanes
            .iter()
            .flat_map(|l| l.steps.iter())
            .filter(|s| s.send_to().is_some())
            .map(|s| s.count())
            .sum();
        let ideal = 2 * (n - 1) * count / n;
        assert!(
            sent >= ideal && sent <= ideal + 2 * n * 64,
            "n={n}: sent {sent}, ideal {ideal}"
        );
    }
}

#[test]
fn bad_descriptions_are_rejected() {
    let d = |kind, count, root| CollDesc { kind, count, root };
    assert!(validate(&d(CollKind::Broadcast, 1, 4), 0, 4).is_err());
    assert!(validate(&d(CollKind::Send, 1, 9), 0, 4).is_err());
    assert!(validate(&d(CollKind::AllGather, usize::MAX / 2, 0), 0, 4).is_err());
    assert!(validate(&d(CollKind::AllReduce, 1, 0), 4, 4).is_err());
    assert!(validate(&d(CollKind::AllReduce, 1, 0), 0, 0).is_err());
    assert!(validate(&d(CollKind::AllReduce, usize::MAX, 0), 0, 4).is_ok());
}

/// The two-shot all-reduce is chosen for small counts from 3 ranks on, delivers exactly once
/// without deadlock in place and not, and takes two dependent messages: no step forwards.
#[test]
fn small_all_reduces_go_two_shot() {
    for n in 3..=9 {
        for channels in 1..=3 {
            for count in [0, 1, 7, 64, 65, 200, 4099] {
                let t = Cut {
                    channels,
                    chunk_elems: 4099,
                    direct_max: 4099,
                    one_shot: false,
                    peer: false,
                };
                for in_place in [false, true] {
                    let r =
                        run_collective(CollKind::AllReduce, n, count, 0, in_place, t, 7 + n as u64);
                    assert!(
                        r.is_ok(),
                        "n={n} ch={channels} count={count} in_place={in_place}: {}",
                        r.unwrap_err()
                    );
                }
                let plans: Vec<Plan> = (0..n)
                    .map(|r| {
                        t.build(
                            &CollDesc {
                                kind: CollKind::AllReduce,
                                count,
                                root: 0,
                            },
                            0,
                            r,
                            n,
                        )
                    })
                    .collect();
                let steps: Vec<&Step> = plans
                    .iter()
                    .flat_map(|p| &p.lanes)
                    .flat_map(|l| &l.steps)
                    .collect();
                assert!(
                    steps.iter().all(|s| !matches!(
                        s,
                        Step::RecvReduce { to: Some(_), .. } | Step::RecvCopy { .. }
                    )),
                    "n={n} count={count}: a ring step"
                );
                // Some rank owns the data (shares are cut at multiples of 64 elements).
                if count > 0 {
                    assert!(steps.iter().any(|s| matches!(s, Step::RecvReduce { .. })));
                }
            }
        }
    }
    // Not for 2 ranks (the ring is two messages too), nor above the limit.
    for (n, count) in [(2, 10), (4, 4100)] {
        let t = Cut {
            channels: 1,
            chunk_elems: 1 << 20,
            direct_max: 4099,
            one_shot: false,
            peer: false,
        };
        let plan = t.build(
            &CollDesc {
                kind: CollKind::AllReduce,
                count,
                root: 0,
            },
            0,
            0,
            n,
        );
        assert!(
            plan.lanes
                .iter()
                .flat_map(|l| &l.steps)
                .any(|s| matches!(s, Step::RecvReduce { to: Some(_), .. })),
            "n={n} count={count}"
        );
    }
}

/// Zero-copy into an in-place all-to-all's output would overwrite blocks not yet sent: the
/// simulator sees it when the receivers post anyway, which is why `may_post` refuses.
#[test]
fn zero_copy_catches_the_in_place_all_to_all_hazard() {
    assert!(!may_post(CollKind::AllToAll, true) && may_post(CollKind::AllToAll, false));
    let t = Cut::plain(1, 4);
    let ops: Vec<Vec<SimOp>> = (0..3)
        .map(|_| {
            vec![SimOp {
                kind: CollKind::AllToAll,
                count: 8,
                root: 0,
                in_place: true,
            }]
        })
        .collect();
    assert!(run_both(&ops, &t, 3, true).is_ok());
    // With every receiver posting, a peer's block lands before this rank sent its own.
    let plans = plans_for(&ops, &t);
    let remote = remote_for(&ops, &plans, &t);
    assert!(
        remote.iter().flatten().flatten().any(|m| m.is_some()),
        "all-to-all sends are stored by their receivers"
    );
    let err = simulate_zero_copy_with(&ops, &plans, CAP, 3, &remote, |_, _| true).unwrap_err();
    assert!(err.contains("output"), "{err}");
}

/// One-shot plans: one round of messages per loop, every send of a loop before its receives,
/// each rank sending a peer at most one message per loop and lane (what the GPU's direct
/// engine needs when a slice is one loop), and every collective delivered exactly once.
#[test]
fn one_shot_plans_are_one_round_per_loop() {
    for &kind in &CollKind::COLLECTIVES {
        for n in 1..=9 {
            for count in [0, 1, 63, 64, 1000] {
                let t = Cut {
                    channels: 2,
                    chunk_elems: 1 << 20,
                    direct_max: 0,
                    one_shot: true,
                    peer: false,
                };
                for in_place in [false, true] {
                    let r = run_collective(kind, n, count, n / 2, in_place, t, 11);
                    assert!(
                        r.is_ok(),
                        "{kind} n={n} count={count} in_place={in_place}: {}",
                        r.unwrap_err()
                    );
                }
                for rank in 0..n {
                    let plan = t.build(
                        &CollDesc {
                            kind,
                            count,
                            root: n / 2,
                        },
                        0,
                        rank,
                        n,
                    );
                    for lane in &plan.lanes {
                        let first_recv = lane
                            .steps
                            .iter()
                            .position(|s| s.recv_from().is_some())
                            .unwrap_or(lane.steps.len());
                        assert!(
                            lane.steps[first_recv..]
                                .iter()
                                .all(|s| s.send_to().is_none()),
                            "{kind} n={n}: a send after a receive"
                        );
                        let mut to: Vec<Rank> =
                            lane.steps.iter().filter_map(|s| s.send_to()).collect();
                        let mut from: Vec<Rank> =
                            lane.steps.iter().filter_map(|s| s.recv_from()).collect();
                        let (nt, nf) = (to.len(), from.len());
                        to.sort();
                        to.dedup();
                        from.sort();
                        from.dedup();
                        assert_eq!(
                            (to.len(), from.len()),
                            (nt, nf),
                            "{kind} n={n}: two messages to one peer in a lane"
                        );
                    }
                }
            }
        }
    }
}
