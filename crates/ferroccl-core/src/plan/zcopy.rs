//! Zero-copy: which messages of a plan a sender may write straight into the receiver's output
//! instead of into the connection's FIFO, and the handshake that makes it safe.
//!
//! A message can go straight to its final place when the receiving step only stores it there
//! (a `Recv`, or a `RecvCopy` with an output `dst`): the receiver then skips its copy out of the
//! FIFO, and a `RecvCopy` forwards from its output. The sender does not know the receiver's
//! steps, but it can build them: every rank plans an operation from the same description, so
//! the peer's plan for the same operation is a pure function of shared values ([`peer_desc`]).
//! Matching the k-th message the sender sends on a connection with the k-th message the peer
//! receives on it gives the element offset in the peer's output ([`remote_dsts`]).
//!
//! The readiness handshake: the receiver's output may still be in use by the work queued before
//! this operation, so the receiver *posts* it when its lane starts the operation's run of steps
//! on that connection (every earlier operation of the lane is then complete), and the sender's
//! first message of that run waits for the post. Posting is per run, not per message, so a
//! ring is never a chain of rendezvous: a lane posts before its first step can block. The
//! simulator ([`super::sim::simulate_zero_copy`]) runs plans under exactly these rules and
//! checks delivery, inputs and liveness with them.

use super::{BufKind, Plan, Step};
use crate::algo::CollDesc;
use crate::types::{CollKind, Rank};
use std::collections::{HashMap, HashSet};

/// Whether a receiver may post its output for an operation of `kind`. Everything is safe out of
/// place. In place, a peer's direct write must never reach an output region before this rank
/// has read the input it aliases: for the reductions and rings that holds by causality (a value
/// that arrives already includes what this rank sent from there), but an in-place all-to-all
/// receives block q while block q of its input may not have left yet. The simulator finds that
/// case when this rule is relaxed (`algo/tests.rs`). A refused post still answers the sender
/// (with no address), which then uses the FIFO.
pub fn may_post(kind: CollKind, in_place: bool) -> bool {
    !(in_place && kind == CollKind::AllToAll)
}

/// Per lane, per step: the element offset in the receiving peer's output of the same operation
/// where that step's outgoing message may be written directly (None: through the FIFO).
pub type RemoteDsts = Vec<Vec<Option<usize>>>;

/// The description the peer plans the matching operation from: a send to `peer` is a receive
/// from `me` there; collectives are the same everywhere. None when `desc` sends nothing.
pub fn peer_desc(desc: &CollDesc, me: Rank) -> Option<CollDesc> {
    match desc.kind {
        CollKind::Send => Some(CollDesc {
            kind: CollKind::Recv,
            count: desc.count,
            root: me,
        }),
        CollKind::Recv => None,
        _ => Some(*desc),
    }
}

/// The operation a step belongs to, with a `RecvCopy` that stores nothing taking the
/// operation of the step before it (such a step names no region).
pub fn step_ops(steps: &[Step]) -> Vec<u16> {
    let mut last = 0u16;
    steps
        .iter()
        .map(|s| {
            let op = match *s {
                Step::RecvCopy { dst: None, .. } => last,
                _ => s.op(),
            };
            last = op;
            op
        })
        .collect()
}

/// Where the receiver stores a message in its output, if it only stores it there.
fn output_store(s: &Step) -> Option<usize> {
    match *s {
        Step::Recv { dst, .. } if dst.buf == BufKind::Output => Some(dst.offset),
        Step::RecvCopy { dst: Some(dst), .. } if dst.buf == BufKind::Output => Some(dst.offset),
        _ => None,
    }
}

/// Which steps of `plan` may write their message straight into the receiver's output.
/// `peer_plan(op, peer)` is the peer's plan for operation `op` alone (None when there is none:
/// its messages then go through the FIFO). Messages are matched in order per operation, peer and
/// channel; a pair whose lengths differ is left to the FIFO, whose length check reports it.
pub fn remote_dsts(
    plan: &Plan,
    mut peer_plan: impl FnMut(u16, Rank) -> Option<Plan>,
) -> RemoteDsts {
    // (op, peer, channel) -> the peer's receipts from us, in order: (count, output offset).
    type Receipts = HashMap<(u16, Rank, u32), Vec<(usize, Option<usize>)>>;
    let mut receipts: Receipts = HashMap::new();
    let mut built: HashSet<(u16, Rank)> = HashSet::new();
    let mut next: HashMap<(u16, Rank, u32), usize> = HashMap::new();
    let mut out = Vec::with_capacity(plan.lanes.len());
    for lane in &plan.lanes {
        let ops = step_ops(&lane.steps);
        let mut v = Vec::with_capacity(lane.steps.len());
        for (s, &op) in lane.steps.iter().zip(&ops) {
            let Some(to) = s.send_to() else {
                v.push(None);
                continue;
            };
            if built.insert((op, to)) {
                if let Some(pp) = peer_plan(op, to) {
                    for pl in &pp.lanes {
                        for ps in &pl.steps {
                            if ps.recv_from() == Some(plan.rank) {
                                receipts
                                    .entry((op, to, pl.channel))
                                    .or_default()
                                    .push((ps.count(), output_store(ps)));
                            }
                        }
                    }
                }
            }
            let key = (op, to, lane.channel);
            let k = next.entry(key).or_insert(0);
            let got = receipts.get(&key).and_then(|r| r.get(*k)).copied();
            *k += 1;
            v.push(match got {
                Some((count, off)) if count == s.count() => off,
                _ => None,
            });
        }
        out.push(v);
    }
    out
}

/// The first index of each step's run: the steps of one operation, contiguous in a lane.
pub fn run_starts(ops: &[u16]) -> Vec<usize> {
    let mut starts = Vec::with_capacity(ops.len());
    for i in 0..ops.len() {
        starts.push(if i > 0 && ops[i] == ops[i - 1] {
            starts[i - 1]
        } else {
            i
        });
    }
    starts
}

/// The peers a lane posts its output to at the start of the run beginning at `start`: those it
/// receives a message from that a step of the run only stores into the output.
pub fn posts_of_run(steps: &[Step], ops: &[u16], start: usize) -> Vec<Rank> {
    let mut peers = Vec::new();
    let mut i = start;
    while i < steps.len() && ops[i] == ops[start] {
        if let (Some(from), Some(_)) = (steps[i].recv_from(), output_store(&steps[i])) {
            if !peers.contains(&from) {
                peers.push(from);
            }
        }
        i += 1;
    }
    peers
}

/// The peers whose post a lane's sends of the run beginning at `start` wait for: those it sends
/// at least one direct message to in the run.
pub fn waits_of_run(
    steps: &[Step],
    ops: &[u16],
    remote: &[Option<usize>],
    start: usize,
) -> Vec<Rank> {
    let mut peers = Vec::new();
    let mut i = start;
    while i < steps.len() && ops[i] == ops[start] {
        if let (Some(to), Some(_)) = (steps[i].send_to(), remote[i]) {
            if !peers.contains(&to) {
                peers.push(to);
            }
        }
        i += 1;
    }
    peers
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::{build, Algo, Tuning};
    use crate::plan::Region;

    fn plans(desc: CollDesc, n: usize, t: &Tuning) -> Vec<Plan> {
        (0..n).map(|r| build(&desc, 0, r, n, t)).collect()
    }

    #[test]
    fn ring_all_gather_forwards_go_direct_and_match_the_receivers_offsets() {
        let t = Tuning {
            algo: Algo::Ring,
            channels: 2,
            chunk_elems: 100,
        };
        let (n, count) = (4, 1000);
        let desc = CollDesc {
            kind: CollKind::AllGather,
            count,
            root: 0,
        };
        let all = plans(desc, n, &t);
        for r in 0..n {
            let rd = remote_dsts(&all[r], |op, p| {
                Some(build(&peer_desc(&desc, r).unwrap(), op, p, n, &t))
            });
            let mut direct = 0;
            for (lane, marks) in all[r].lanes.iter().zip(&rd) {
                for (s, m) in lane.steps.iter().zip(marks) {
                    if s.send_to().is_none() {
                        assert_eq!(*m, None);
                        continue;
                    }
                    // Every all-gather message is stored by its receiver into the output, at the
                    // offset of the block it carries: the same offset as in the sender's output.
                    let off = m.expect("direct");
                    let src = match *s {
                        Step::Send { src, .. } => src,
                        Step::RecvCopy { dst: Some(d), .. } => d,
                        _ => panic!("{s:?}"),
                    };
                    let mine = if src.buf == BufKind::Input {
                        r * count + src.offset
                    } else {
                        src.offset
                    };
                    assert_eq!(off, mine, "{s:?}");
                    direct += 1;
                }
            }
            assert!(direct > 0);
        }
    }

    #[test]
    fn reductions_received_into_a_sum_never_go_direct() {
        let t = Tuning {
            algo: Algo::Ring,
            channels: 1,
            chunk_elems: 64,
        };
        let n = 3;
        let desc = CollDesc {
            kind: CollKind::AllReduce,
            count: 600,
            root: 0,
        };
        let all = plans(desc, n, &t);
        let rd = remote_dsts(&all[1], |op, p| Some(build(&desc, op, p, n, &t)));
        let steps = &all[1].lanes[0].steps;
        for (s, m) in steps.iter().zip(&rd[0]) {
            // The reduce-scatter half's messages are reduced by their receiver; the all-gather
            // half's are stored: only those may go direct.
            match *s {
                Step::Send { .. } => assert_eq!(*m, None, "first send feeds a reduction"),
                Step::RecvReduce { post: false, .. } => assert_eq!(*m, None),
                Step::RecvReduce { post: true, .. } | Step::RecvCopy { to: Some(_), .. } => {
                    assert!(m.is_some(), "{s:?}")
                }
                _ => assert_eq!(*m, None),
            }
        }
    }

    #[test]
    fn a_send_matches_the_peers_receive_and_a_missing_peer_plan_means_fifo() {
        let t = Tuning {
            algo: Algo::Direct,
            channels: 2,
            chunk_elems: 10,
        };
        let send = CollDesc {
            kind: CollKind::Send,
            count: 55,
            root: 3,
        };
        let plan = build(&send, 2, 1, 4, &t);
        let pd = peer_desc(&send, 1).unwrap();
        assert_eq!(
            pd,
            CollDesc {
                kind: CollKind::Recv,
                count: 55,
                root: 1
            }
        );
        let rd = remote_dsts(&plan, |op, p| {
            assert_eq!((op, p), (2, 3));
            Some(build(&pd, op, p, 4, &t))
        });
        for (lane, marks) in plan.lanes.iter().zip(&rd) {
            for (s, m) in lane.steps.iter().zip(marks) {
                let Step::Send { src, .. } = *s else { panic!() };
                assert_eq!(*m, Some(src.offset));
            }
        }
        assert!(rd.iter().flatten().all(|m| m.is_some()));
        let none = remote_dsts(&plan, |_, _| None);
        assert!(none.iter().flatten().all(|m| m.is_none()));
        // A peer planning other sizes: lengths differ, so the FIFO (and its length check) decides.
        let other = remote_dsts(&plan, |op, p| {
            Some(build(&CollDesc { count: 56, ..pd }, op, p, 4, &t))
        });
        assert!(other.iter().flatten().any(|m| m.is_none()));
        assert_eq!(
            peer_desc(
                &CollDesc {
                    kind: CollKind::Recv,
                    count: 5,
                    root: 0
                },
                1
            ),
            None
        );
    }

    #[test]
    fn runs_posts_and_waits() {
        let out = |off| Region::new(1, BufKind::Output, off, 4);
        let steps = vec![
            Step::Send {
                to: 2,
                src: Region::new(0, BufKind::Input, 0, 4),
                pre: false,
            },
            Step::Recv {
                from: 2,
                dst: Region::new(0, BufKind::Output, 0, 4),
            },
            Step::Recv {
                from: 3,
                dst: out(0),
            },
            Step::RecvCopy {
                from: 2,
                count: 4,
                dst: None,
                to: Some(3),
            },
            Step::RecvReduce {
                from: 4,
                local: out(4),
                pre_local: false,
                post: false,
                dst: Some(out(4)),
                to: None,
            },
            Step::Recv {
                from: 3,
                dst: out(8),
            },
        ];
        let ops = step_ops(&steps);
        assert_eq!(ops, vec![0, 0, 1, 1, 1, 1]);
        assert_eq!(run_starts(&ops), vec![0, 0, 2, 2, 2, 2]);
        assert_eq!(posts_of_run(&steps, &ops, 0), vec![2]);
        // A reduction's source is never posted; a peer is posted once per run.
        assert_eq!(posts_of_run(&steps, &ops, 2), vec![3]);
        let remote = vec![Some(0), None, None, Some(7), None, None];
        assert_eq!(waits_of_run(&steps, &ops, &remote, 0), vec![2]);
        assert_eq!(waits_of_run(&steps, &ops, &remote, 2), vec![3]);
    }
}
