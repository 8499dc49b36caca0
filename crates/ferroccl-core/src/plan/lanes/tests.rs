//! The lanes' model tests: every rank's schedules run against the flag pages under any
//! interleaving the streams could take.

use super::*;

/// The copy-and-folds' pieces in these tests: a few bytes' worth of the real taper, so that
/// an operation has body pieces, tapering ones and a ragged end.
const TAPER: Taper = Taper {
    max: 256 << 10,
    tail: 64 << 10,
    ramp: 150,
};
/// Bytes of the largest piece.
const PIECE: usize = TAPER.max;
use proptest::prelude::*;
use std::collections::HashMap;

/// Every rank's flag page at its start (`CeFlags::initial`).
fn initial_pages(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|_| {
            (0..CeFlags::words(n))
                .map(|i| CeFlags::initial(n, i))
                .collect()
        })
        .collect()
}

/// The (rank, lane) pairs whose next command can run now: any but a wait on a word not yet 1.
fn runnable_lanes(
    lanes: &[Vec<(Lane, Vec<Cmd>, usize)>],
    pages: &[Vec<u32>],
) -> Vec<(usize, usize)> {
    (0..lanes.len())
        .flat_map(|r| (0..lanes[r].len()).map(move |i| (r, i)))
        .filter(|&(r, i)| {
            let (_, cmds, pc) = &lanes[r][i];
            match cmds.get(*pc) {
                None => false,
                Some(Cmd::Wait { page, word }) => pages[*page][*word] == 1,
                Some(_) => true,
            }
        })
        .collect()
}

/// Every word back where it started (a CUDA graph's replay finds the state it expects).
fn words_back(pages: &[Vec<u32>]) -> Result<(), String> {
    let n = pages.len();
    for (r, page) in pages.iter().enumerate() {
        for (i, &w) in page.iter().enumerate() {
            if w != CeFlags::initial(n, i) {
                return Err(format!("rank {r}'s word {i} ends at {w}"));
            }
        }
    }
    Ok(())
}

/// A schedule drawn from `seed`: random among the runnable lanes, or (`ahead`) the first
/// runnable rank's lanes only, so that it runs as far ahead as it can.
fn picker(seed: Vec<u8>, ahead: bool) -> impl FnMut(&[(usize, usize)]) -> usize {
    let mut i = 0usize;
    move |runnable| {
        i += 1;
        let x = seed[i % seed.len()] as usize + i / seed.len();
        if ahead {
            runnable
                .iter()
                .position(|&(r, _)| r == runnable[0].0)
                .unwrap()
                + x % runnable
                    .iter()
                    .filter(|&&(r, _)| r == runnable[0].0)
                    .count()
        } else {
            x
        }
    }
}

/// Runs every rank's schedule of `ops` (one after another, as the caller's stream orders
/// them) command by command, `pick` choosing which runnable lane goes next, as streams of
/// different GPUs run at their own pace. Checks that a piece lands only in a slot whose last
/// piece was copied out, and only once its receiver has entered the same operation (so the
/// peer engine's reads of the region from earlier operations are over); that every copy out
/// finds the piece it expects; that a sender's lanes end only when their pieces were copied
/// out; that nothing deadlocks; and that every word is back where it started.
fn run_model(
    n: usize,
    ops: &[CeOp],
    slot: usize,
    pick: impl FnMut(&[(usize, usize)]) -> usize,
) -> Result<(), String> {
    run_model_with(
        n,
        ops,
        &|op, me| schedule(op, me, n, slot).expect("schedule"),
        pick,
    )
}

type Sched<'a> = &'a dyn Fn(&CeOp, Rank) -> Vec<(Lane, Vec<Cmd>)>;

fn run_model_with(
    n: usize,
    ops: &[CeOp],
    sched: Sched,
    mut pick: impl FnMut(&[(usize, usize)]) -> usize,
) -> Result<(), String> {
    let mut pages = initial_pages(n);
    // (owner, from, slot) -> (operation, byte of the copy) of the piece waiting there.
    let mut stage: HashMap<(Rank, Rank, usize), (usize, usize)> = HashMap::new();
    let mut at_op = vec![0usize; n];
    let mut lanes: Vec<Vec<(Lane, Vec<Cmd>, usize)>> = vec![Vec::new(); n];
    let load = |r: Rank, k: usize| -> Vec<(Lane, Vec<Cmd>, usize)> {
        sched(&ops[k], r)
            .into_iter()
            .map(|(l, c)| (l, c, 0))
            .collect()
    };
    for r in 0..n {
        lanes[r] = load(r, 0);
    }
    // Bytes of each rank's input its copies have yet to read in its current operation: in
    // an all-to-all in place (input and output one buffer) nothing may land on them.
    let unread_of = |r: Rank, k: usize| -> Vec<bool> {
        let o = &ops[k];
        let mut v = vec![false; o.count * o.elem * n];
        for c in copies(o.kind, o.count, o.elem, n, o.root)
            .unwrap()
            .iter()
            .filter(|c| c.from == r)
        {
            v[c.src..c.src + c.bytes].iter_mut().for_each(|b| *b = true);
        }
        v
    };
    let mut unread: Vec<Vec<bool>> = (0..n).map(|r| unread_of(r, 0)).collect();
    let copy_of = |k: usize, from: Rank, to: Rank| {
        let o = &ops[k];
        *copies(o.kind, o.count, o.elem, n, o.root)
            .unwrap()
            .iter()
            .find(|c| c.from == from && c.to == to)
            .expect("a copy")
    };
    loop {
        // Ranks whose lanes are all done move to their next operation.
        for r in 0..n {
            while lanes[r].iter().all(|(_, c, pc)| *pc == c.len()) && at_op[r] + 1 < ops.len() {
                at_op[r] += 1;
                lanes[r] = load(r, at_op[r]);
                unread[r] = unread_of(r, at_op[r]);
            }
        }
        let runnable = runnable_lanes(&lanes, &pages);
        if runnable.is_empty() {
            let done = (0..n).all(|r| {
                at_op[r] + 1 == ops.len() && lanes[r].iter().all(|(_, c, pc)| *pc == c.len())
            });
            if !done {
                return Err(format!("deadlock: ranks at operations {at_op:?}"));
            }
            break;
        }
        let (r, i) = runnable[pick(&runnable) % runnable.len()];
        let k = at_op[r];
        let (lane, cmds, pc) = &mut lanes[r][i];
        if let Cmd::Copy {
            src: Addr::Send(o),
            bytes,
            ..
        } = cmds[*pc]
        {
            unread[r][o..o + bytes].iter_mut().for_each(|b| *b = false);
        }
        if let Cmd::Copy {
            dst: Addr::Recv(o),
            bytes,
            ..
        } = cmds[*pc]
        {
            if ops[k].send == ops[k].recv && unread[r][o..o + bytes].iter().any(|&b| b) {
                return Err(format!("rank {r} receives into bytes {o}.. of its buffer before sending them (op {k}, in place)"));
            }
        }
        match cmds[*pc] {
            Cmd::Wait { .. } => {}
            Cmd::Write { page, word, value } => pages[page][word] = value,
            Cmd::Copy {
                dst: Addr::Stage { owner, from, slot },
                src: Addr::Send(o),
                ..
            } => {
                if at_op[owner] != k {
                    return Err(format!(
                        "rank {r} stores op {k} into rank {owner}'s staging while it is at op {}",
                        at_op[owner]
                    ));
                }
                let c = copy_of(k, from, owner);
                if let Some(old) = stage.insert((owner, from, slot), (k, o - c.src)) {
                    return Err(format!(
                        "rank {r} overwrites piece {old:?} in slot {slot} of rank {owner}"
                    ));
                }
            }
            Cmd::Copy {
                dst: Addr::Recv(o),
                src: Addr::Stage { owner, from, slot },
                ..
            } => {
                let c = copy_of(k, from, owner);
                let want = (k, o - c.dst);
                match stage.remove(&(owner, from, slot)) {
                    Some(got) if got == want => {}
                    got => {
                        return Err(format!(
                            "rank {r} copies out {got:?} from slot {slot}, expected {want:?}"
                        ))
                    }
                }
            }
            Cmd::Copy { .. } => {}
            Cmd::Fold { .. } => return Err(format!("rank {r}: a fold in a staged schedule")),
        }
        *pc += 1;
        if *pc == cmds.len() {
            if let Lane::Peer { peer: to, lane } = *lane {
                if let Some(left) = stage
                    .keys()
                    .find(|&&(o, f, s)| o == to && f == r && s % CE_LANES == lane)
                {
                    return Err(format!(
                        "rank {r}'s send lane to {to} ended with a piece still in slot {left:?}"
                    ));
                }
            }
        }
    }
    words_back(&pages)?;
    if !stage.is_empty() {
        return Err(format!("pieces never copied out: {stage:?}"));
    }
    Ok(())
}

fn op_strategy(n: usize) -> impl Strategy<Value = CeOp> {
    let kinds = if n == 2 {
        vec![
            CollKind::AllGather,
            CollKind::AllToAll,
            CollKind::Gather,
            CollKind::Scatter,
            CollKind::Broadcast,
        ]
    } else {
        vec![
            CollKind::AllGather,
            CollKind::AllToAll,
            CollKind::Gather,
            CollKind::Scatter,
        ]
    };
    // An all-to-all in place: input and output one buffer (send == recv).
    (prop::sample::select(kinds), 0usize..40, 0..n, any::<bool>()).prop_map(
        |(kind, count, root, in_place)| CeOp {
            kind,
            count,
            elem: 4,
            root,
            send: 0,
            recv: (!(in_place && kind == CollKind::AllToAll)) as u64,
        },
    )
}

fn case() -> impl Strategy<Value = (usize, Vec<CeOp>, usize, Vec<u8>, bool)> {
    (2usize..5).prop_flat_map(|n| {
        (
            Just(n),
            prop::collection::vec(op_strategy(n), 1..5),
            4usize..24,
            prop::collection::vec(any::<u8>(), 64),
            any::<bool>(),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// The handshake holds under any interleaving of the lanes: random, or one rank running
    /// as far ahead as it can (a GPU whose streams are not held up by its peers').
    #[test]
    fn the_copy_engine_handshake_holds_under_any_schedule((n, ops, slot, seed, ahead) in case()) {
        // Repeated: a CUDA graph replays the same commands on the state they left.
        let ops: Vec<CeOp> = ops.iter().chain(ops.iter()).copied().collect();
        let r = run_model(n, &ops, slot, picker(seed, ahead));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// The model finds what the handshake prevents: without the receiver's `ready`, a sender
/// stores into staging its receiver is not yet done with; without the final waits, a
/// sender's lane ends with pieces not yet copied out.
#[test]
fn the_model_catches_a_handshake_left_out() {
    let ops = [
        CeOp {
            kind: CollKind::Gather,
            count: 16,
            elem: 4,
            root: 0,
            send: 0,
            recv: 0,
        },
        CeOp {
            kind: CollKind::AllGather,
            count: 16,
            elem: 4,
            root: 0,
            send: 0,
            recv: 0,
        },
    ];
    // Rank 1 runs ahead of rank 0 whenever it can; rank 0 leaves its local copy for last.
    let ahead =
        |rn: &[(usize, usize)]| rn.iter().position(|&(r, _)| r == 1).unwrap_or(rn.len() - 1);
    assert!(run_model(2, &ops, 8, ahead).is_ok());
    let ready_word = |w: usize| w >= 2 * 2 * CE_SLOTS;
    let no_ready = |op: &CeOp, me: Rank| -> Vec<(Lane, Vec<Cmd>)> {
        let keep = |c: &Cmd| match *c {
            Cmd::Wait { word, .. } | Cmd::Write { word, .. } => !ready_word(word),
            Cmd::Copy { .. } | Cmd::Fold { .. } => true,
        };
        schedule(op, me, 2, 8)
            .unwrap()
            .into_iter()
            .map(|(l, c)| (l, c.into_iter().filter(keep).collect()))
            .collect()
    };
    let e = run_model_with(2, &ops, &no_ready, ahead).unwrap_err();
    assert!(e.contains("while it is at op 0"), "{e}");
    let no_drain = |op: &CeOp, me: Rank| -> Vec<(Lane, Vec<Cmd>)> {
        let cut = |(l, mut c): (Lane, Vec<Cmd>)| {
            if matches!(l, Lane::Peer { .. }) {
                while matches!(c.last(), Some(Cmd::Wait { .. })) {
                    c.pop();
                }
            }
            (l, c)
        };
        schedule(op, me, 2, 8)
            .unwrap()
            .into_iter()
            .map(cut)
            .collect()
    };
    let e = run_model_with(2, &ops, &no_drain, ahead).unwrap_err();
    assert!(e.contains("ended with a piece still in slot"), "{e}");
}

/// A copy as the zero-copy model checks it: (from, to, src, dst, bytes).
type Made = (Rank, Rank, usize, usize, usize);

/// Where the zero-copy model's ranks map rank q's far buffer: a tag the model reads back.
fn far_of(q: Rank) -> u64 {
    ((q as u64) + 1) << 40
}

/// Runs every rank's zero-copy schedule of `ops` as `run_model_with` runs the staged ones,
/// the copies between windows and the copy-and-folds (their fold kernel piece by piece: a
/// piece may fold once its lane's word reached its count), in the interleaving `pick` draws.
/// Checks that a copy touches a peer's buffer only while that peer is in the same operation
/// (it has entered it: its earlier work on the buffer is done; it has not left it: its later
/// work will see the copy), that every copy of every operation happens exactly once with the
/// addresses `copies` gives, that a piece never lands on one not yet folded and is folded
/// exactly once and only after it landed, that every byte of every fold lands, that nothing
/// deadlocks, and that every word ends where it started.
fn run_zcopy_model(
    n: usize,
    ops: &[CeOp],
    sched: Sched,
    mut pick: impl FnMut(&[(usize, usize)]) -> usize,
) -> Result<(), String> {
    let mut pages = initial_pages(n);
    let mut at_op = vec![0usize; n];
    // Per lane: its commands, the next one, and the next piece of a fold.
    type ZLane = (Lane, Vec<Cmd>, usize, usize);
    let load = |r: Rank, k: usize| -> Vec<ZLane> {
        sched(&ops[k], r)
            .into_iter()
            .map(|(l, c)| (l, c, 0, 0))
            .collect()
    };
    let mut lanes: Vec<Vec<ZLane>> = (0..n).map(|r| load(r, 0)).collect();
    let is_fold = |k: usize| fold_kind(ops[k].kind, n);
    // Per operation: the copies done, as (from, to, src, dst, bytes) (none listed for a
    // copy-and-fold: its pieces are checked apart).
    let mut done: Vec<Vec<Made>> = vec![Vec::new(); ops.len()];
    let want = |k: usize| -> Vec<Made> {
        let o = &ops[k];
        let mut v: Vec<_> = copies(o.kind, o.count, o.elem, n, o.root)
            .unwrap_or_default()
            .iter()
            .map(|c| (c.from, c.to, c.src, c.dst, c.bytes))
            .collect();
        v.sort_unstable();
        v
    };
    // Pieces landed and not yet folded: (rank, byte in its output) -> operation; bytes
    // landed and folded per operation and receiver.
    let mut landed: HashMap<(Rank, usize), usize> = HashMap::new();
    let mut bytes_in = vec![vec![0usize; n]; ops.len()];
    let mut bytes_folded = vec![vec![0usize; n]; ops.len()];
    let fold_next = |c: &Cmd, sub: usize| -> Option<FoldPiece> {
        match *c {
            Cmd::Fold { bytes, taper, .. } => fold_pieces(bytes, taper).nth(sub),
            _ => None,
        }
    };
    // The fold rank r makes in an operation, if any.
    let fold_of = |o: &CeOp, r: Rank| -> Option<Fold> {
        fold_list(o.kind, o.count, o.elem, n, o.root)?
            .into_iter()
            .find(|f| f.copy.to == r)
    };
    let finished = |l: &[ZLane]| l.iter().all(|(_, c, pc, _)| *pc == c.len());
    let far = |a: u64| ((a >> 40) as usize - 1, (a & ((1 << 40) - 1)) as usize);
    loop {
        for r in 0..n {
            while finished(&lanes[r]) && at_op[r] + 1 < ops.len() {
                let k = at_op[r];
                if let Some(c) = want(k)
                    .into_iter()
                    .find(|c| (c.0 == r || c.1 == r) && !done[k].contains(c))
                {
                    return Err(format!("rank {r} left op {k} before copy {c:?} was made"));
                }
                at_op[r] += 1;
                lanes[r] = load(r, at_op[r]);
            }
        }
        let runnable: Vec<(usize, usize)> = (0..n)
            .flat_map(|r| (0..lanes[r].len()).map(move |i| (r, i)))
            .filter(|&(r, i)| {
                let (_, cmds, pc, sub) = &lanes[r][i];
                match cmds.get(*pc) {
                    None => false,
                    Some(Cmd::Wait { page, word }) => pages[*page][*word] == 1,
                    Some(c @ Cmd::Fold { from, .. }) => fold_next(c, *sub)
                        .is_some_and(|p| pages[r][CeFlags::piece(n, *from, p.lane)] >= p.count),
                    Some(_) => true,
                }
            })
            .collect();
        if runnable.is_empty() {
            if !(0..n).all(|r| at_op[r] + 1 == ops.len() && finished(&lanes[r])) {
                return Err(format!("deadlock: ranks at operations {at_op:?}"));
            }
            break;
        }
        let (r, i) = runnable[pick(&runnable) % runnable.len()];
        let k = at_op[r];
        let (_, cmds, pc, sub) = &mut lanes[r][i];
        let c = cmds[*pc];
        match c {
            Cmd::Wait { .. } => {}
            Cmd::Write { page, word, value } => pages[page][word] = value,
            // A piece of a copy-and-fold, into its receiver's output.
            Cmd::Copy {
                dst: Addr::Abs(a),
                src: Addr::Send(o),
                bytes,
            } if is_fold(k) => {
                let (to, at) = far(a);
                if at_op[to] != k {
                    return Err(format!(
                        "rank {r} copies into rank {to}'s output for op {k} while it is at op {}",
                        at_op[to]
                    ));
                }
                let want = fold_of(&ops[k], to).ok_or(format!("rank {r} lands op {k} on {to}"))?;
                if want.copy.from != r || o != want.copy.src + at || at + bytes > want.copy.bytes {
                    return Err(format!(
                        "rank {r} copies {o}..+{bytes} to {at} for {want:?}"
                    ));
                }
                if let Some(old) = landed.insert((to, at), k) {
                    return Err(format!(
                        "rank {r} lands op {k} on rank {to}'s byte {at} before op {old} was folded there"
                    ));
                }
                bytes_in[k][to] += bytes;
            }
            Cmd::Copy { dst, src, bytes } if !is_fold(k) => {
                let c = match (src, dst) {
                    (Addr::Send(s), Addr::Recv(d)) => (r, r, s, d, bytes),
                    (Addr::Send(s), Addr::Abs(a)) => (r, far(a).0, s, far(a).1, bytes),
                    (Addr::Abs(a), Addr::Recv(d)) => (far(a).0, r, far(a).1, d, bytes),
                    other => return Err(format!("rank {r} copies {other:?}")),
                };
                let peer = if c.0 == r { c.1 } else { c.0 };
                if at_op[peer] != k {
                    return Err(format!(
                        "rank {r} copies {c:?} of op {k} while rank {peer} is at op {}",
                        at_op[peer]
                    ));
                }
                if done[k].contains(&c) {
                    return Err(format!("rank {r} makes copy {c:?} of op {k} twice"));
                }
                done[k].push(c);
            }
            Cmd::Fold { src, bytes, .. } if is_fold(k) => {
                let p = fold_next(&c, *sub).expect("runnable");
                let want = fold_of(&ops[k], r).ok_or(format!("rank {r} folds op {k}"))?;
                if src != want.local || bytes != want.copy.bytes {
                    return Err(format!("rank {r} folds {src}..+{bytes} for {want:?}"));
                }
                if landed.remove(&(r, p.at)) != Some(k) {
                    return Err(format!(
                        "rank {r} folds piece {} of op {k} before it landed",
                        p.at
                    ));
                }
                bytes_folded[k][r] += p.bytes;
                *sub += 1;
                if fold_next(&c, *sub).is_some() {
                    continue;
                }
            }
            other => return Err(format!("rank {r} runs {other:?} in op {k}")),
        }
        *pc += 1;
    }
    for k in 0..ops.len() {
        if !is_fold(k) {
            done[k].sort_unstable();
            if done[k] != want(k) {
                return Err(format!(
                    "op {k} made copies {:?}, expected {:?}",
                    done[k],
                    want(k)
                ));
            }
            continue;
        }
        for r in 0..n {
            let o = &ops[k];
            let want = fold_of(o, r).map_or(0, |f| f.copy.bytes);
            if bytes_in[k][r] != want || bytes_folded[k][r] != want {
                return Err(format!(
                    "op {k} rank {r}: {} bytes landed and {} folded of {want}",
                    bytes_in[k][r], bytes_folded[k][r]
                ));
            }
        }
    }
    words_back(&pages)?;
    Ok(())
}

fn zcopy_of(n: usize) -> impl Fn(&CeOp, Rank) -> Vec<(Lane, Vec<Cmd>)> {
    move |op, me| {
        let far: Vec<u64> = (0..n).map(far_of).collect();
        zcopy_schedule(op, me, n, &far, (4, TAPER)).expect("schedule")
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// The zero-copy handshake holds under any interleaving, as the staged one does, for
    /// every kind it takes (an all-to-all in place aside; gather and scatter with the
    /// outputs the ranks posted), in place or not, repeated.
    #[test]
    fn the_zero_copy_handshake_holds_under_any_schedule((n, ops, _slot, seed, ahead) in case()) {
        let served = |o: &&CeOp| (zcopy_serves(o.kind, n) || rendezvous_serves(o.kind, n))
            && !(o.kind == CollKind::AllToAll && o.send == o.recv);
        let ops: Vec<CeOp> = ops.iter().chain(ops.iter()).filter(served).copied().collect();
        prop_assume!(!ops.is_empty());
        let r = run_zcopy_model(n, &ops, &zcopy_of(n), picker(seed, ahead));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// The zero-copy model finds what each half of the handshake prevents, and the schedule
/// refuses an all-to-all in place.
#[test]
fn the_zero_copy_model_catches_a_handshake_left_out() {
    let ops = [
        CeOp {
            kind: CollKind::AllGather,
            count: 16,
            elem: 4,
            root: 0,
            send: 0,
            recv: 1,
        },
        CeOp {
            kind: CollKind::Broadcast,
            count: 16,
            elem: 4,
            root: 1,
            send: 0,
            recv: 1,
        },
        CeOp {
            kind: CollKind::AllToAll,
            count: 16,
            elem: 4,
            root: 0,
            send: 0,
            recv: 1,
        },
    ];
    // Rank 1 runs ahead of rank 0 whenever it can.
    let ahead =
        |rn: &[(usize, usize)]| rn.iter().position(|&(r, _)| r == 1).unwrap_or(rn.len() - 1);
    let behind =
        |rn: &[(usize, usize)]| rn.iter().position(|&(r, _)| r == 0).unwrap_or(rn.len() - 1);
    assert!(run_zcopy_model(2, &ops, &zcopy_of(2), ahead).is_ok());
    assert!(run_zcopy_model(2, &ops, &zcopy_of(2), behind).is_ok());
    let without = |drop_ready: bool| {
        move |op: &CeOp, me: Rank| -> Vec<(Lane, Vec<Cmd>)> {
            let ready = |w: usize| w >= 2 * 2 * CE_SLOTS;
            let keep = |c: &Cmd| match *c {
                Cmd::Wait { word, .. } | Cmd::Write { word, .. } => ready(word) != drop_ready,
                Cmd::Copy { .. } | Cmd::Fold { .. } => true,
            };
            zcopy_of(2)(op, me)
                .into_iter()
                .map(|(l, c)| (l, c.into_iter().filter(keep).collect()))
                .collect()
        }
    };
    let e = run_zcopy_model(2, &ops, &without(true), ahead).unwrap_err();
    assert!(e.contains("while rank 0 is at op"), "{e}");
    let e = run_zcopy_model(2, &ops, &without(false), ahead).unwrap_err();
    assert!(e.contains("before copy"), "{e}");
    let in_place = CeOp {
        kind: CollKind::AllToAll,
        count: 16,
        elem: 4,
        root: 0,
        send: 5,
        recv: 5,
    };
    assert!(zcopy_schedule(&in_place, 0, 2, &[0, far_of(1)], (4, TAPER)).is_err());
    assert!(
        zcopy_schedule(&ops[0], 0, 2, &[0], (4, TAPER)).is_err(),
        "an address per rank"
    );
    let reduce = CeOp {
        kind: CollKind::Reduce,
        count: 16,
        elem: 4,
        root: 0,
        send: 0,
        recv: 1,
    };
    assert!(
        zcopy_schedule(&reduce, 0, 3, &[0, far_of(1), far_of(2)], (4, TAPER)).is_err(),
        "not a kind it serves on 3 ranks"
    );
    // A reduce's root in place would fold into its own operand; its non-root's buffers
    // alike mean nothing (it has no output).
    let in_place = CeOp { recv: 0, ..reduce };
    assert!(zcopy_schedule(&in_place, 0, 2, &[0, far_of(1)], (4, TAPER)).is_err());
    assert!(zcopy_schedule(&in_place, 1, 2, &[far_of(0), 0], (4, TAPER)).is_ok());
    // The root only folds, the non-root only sends.
    let root = zcopy_schedule(&reduce, 0, 2, &[0, far_of(1)], (4, TAPER)).unwrap();
    let other = zcopy_schedule(&reduce, 1, 2, &[far_of(0), 0], (4, TAPER)).unwrap();
    let has = |s: &Schedule, f: &dyn Fn(&Cmd) -> bool| s.iter().any(|(_, c)| c.iter().any(f));
    assert!(has(&root, &|c| matches!(c, Cmd::Fold { .. })));
    assert!(!has(&root, &|c| matches!(
        c,
        Cmd::Copy { .. } | Cmd::Wait { .. }
    )));
    assert!(has(&other, &|c| matches!(c, Cmd::Copy { .. })));
    assert!(!has(&other, &|c| matches!(c, Cmd::Fold { .. })));
}

/// A copy-and-fold's operation of `count` 4-byte elements, out of place (a reduce's root 0).
fn fold_op(kind: CollKind, count: usize) -> CeOp {
    CeOp {
        kind,
        count,
        elem: 4,
        root: 0,
        send: 0,
        recv: 1,
    }
}

fn fold_op_strategy() -> impl Strategy<Value = CeOp> {
    (
        prop_oneof![
            Just(CollKind::AllReduce),
            Just(CollKind::ReduceScatter),
            Just(CollKind::Reduce)
        ],
        // Up to a few of the largest pieces: element counts of 4-byte elements.
        0usize..(5 * PIECE / 4),
        0usize..2,
    )
        .prop_map(|(kind, count, root)| CeOp {
            root,
            ..fold_op(kind, count)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// The copy-and-fold handshake holds under any interleaving of both ranks' lanes, for
    /// all-reduces, reduce-scatters and reduces (either root) of a few pieces, repeated.
    #[test]
    fn the_fold_handshake_holds_under_any_schedule(
        ops in proptest::collection::vec(fold_op_strategy(), 1..4),
        seed in proptest::collection::vec(any::<u8>(), 1..64),
        ahead in any::<bool>(),
    ) {
        let ops: Vec<CeOp> = ops.iter().chain(ops.iter()).copied().collect();
        let r = run_zcopy_model(2, &ops, &zcopy_of(2), picker(seed, ahead));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    /// The same with the movement operations between windows mixed in: they share the
    /// `ready` words, and every one of them still hands them back as it found them.
    #[test]
    fn folds_and_copies_between_windows_mix_under_any_schedule(
        ops in proptest::collection::vec(prop_oneof![fold_op_strategy(), op_strategy(2)], 1..6),
        seed in proptest::collection::vec(any::<u8>(), 1..64),
        ahead in any::<bool>(),
    ) {
        let served = |o: &&CeOp| fold_kind(o.kind, 2)
            || (zcopy_serves(o.kind, 2) && !(o.kind == CollKind::AllToAll && o.send == o.recv));
        let ops: Vec<CeOp> = ops.iter().chain(ops.iter()).filter(served).copied().collect();
        prop_assume!(!ops.is_empty());
        let r = run_zcopy_model(2, &ops, &zcopy_of(2), picker(seed, ahead));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// The zero-copy model finds, for the copy-and-fold, what the handshake's parts prevent:
/// without `ready` a rank lands a piece in an output its peer is not yet using for the
/// operation; without the resets the piece words carry over and a fold runs before its piece
/// landed; and the schedule refuses an in-place operation and a wrong address count.
#[test]
fn the_fold_model_catches_a_handshake_left_out() {
    let op = fold_op;
    let three = 3 * PIECE / 4;
    let ops = [
        op(CollKind::AllReduce, three),
        op(CollKind::ReduceScatter, three / 2),
        op(CollKind::AllReduce, three),
    ];
    let ahead =
        |rn: &[(usize, usize)]| rn.iter().position(|&(r, _)| r == 1).unwrap_or(rn.len() - 1);
    let behind =
        |rn: &[(usize, usize)]| rn.iter().position(|&(r, _)| r == 0).unwrap_or(rn.len() - 1);
    assert!(run_zcopy_model(2, &ops, &zcopy_of(2), ahead).is_ok());
    assert!(run_zcopy_model(2, &ops, &zcopy_of(2), behind).is_ok());
    let lanes = zcopy_of(2)(&ops[0], 0);
    assert_eq!(
        lanes.len(),
        CE_LANES + 1,
        "a lane per copy lane and the fold's"
    );
    assert!(lanes
        .iter()
        .any(|(l, c)| *l == Lane::Local && matches!(c[0], Cmd::Fold { blocks: 4, .. })));
    let without = |drop: fn(usize) -> bool| {
        move |op: &CeOp, me: Rank| -> Vec<(Lane, Vec<Cmd>)> {
            let keep = |c: &Cmd| match *c {
                Cmd::Wait { word, .. } | Cmd::Write { word, .. } => !drop(word),
                _ => true,
            };
            zcopy_of(2)(op, me)
                .into_iter()
                .map(|(l, c)| (l, c.into_iter().filter(keep).collect()))
                .collect()
        }
    };
    let is_ready = |w: usize| (0..2).any(|q| (0..CE_LANES).any(|l| CeFlags::ready(2, q, l) == w));
    // Some interleaving lands a piece of the next operation too early.
    let errs: Vec<String> = (0..64u8)
        .filter_map(|seed| {
            run_zcopy_model(
                2,
                &ops,
                &without(is_ready),
                picker(vec![seed, 7, seed / 3], false),
            )
            .err()
        })
        .collect();
    assert!(
        errs.iter()
            .any(|e| e.contains("while it is at op") || e.contains("before op")),
        "{errs:?}"
    );
    // Without the resets: drop only the writes of 0 to the piece words.
    let no_reset = |op: &CeOp, me: Rank| -> Vec<(Lane, Vec<Cmd>)> {
        let is_piece =
            |w: usize| (0..2).any(|q| (0..CE_LANES).any(|l| CeFlags::piece(2, q, l) == w));
        zcopy_of(2)(op, me)
            .into_iter()
            .map(|(l, c)| {
                let c = c
                    .into_iter()
                    .filter(|c| !matches!(*c, Cmd::Write { word, value: 0, .. } if is_piece(word)))
                    .collect();
                (l, c)
            })
            .collect()
    };
    let errs: Vec<String> = (0..64u8)
        .filter_map(|seed| {
            run_zcopy_model(2, &ops, &no_reset, picker(vec![seed, 3, seed / 5], false)).err()
        })
        .collect();
    assert!(
        errs.iter().any(|e| e.contains("before it landed")),
        "{errs:?}"
    );
    assert!(errs.len() == 64, "every run ends with the words changed");
    let mut in_place = ops[0];
    in_place.recv = in_place.send;
    assert!(zcopy_schedule(&in_place, 0, 2, &[0, far_of(1)], (4, TAPER)).is_err());
    // A reduce-scatter in place: rank r's output is its block r of the input.
    let mut rs = ops[1];
    for me in 0..2 {
        rs.send = 1 << 20;
        rs.recv = rs.send + (me * rs.count * rs.elem) as u64;
        let far = [far_of(0), far_of(1)];
        assert!(
            zcopy_schedule(&rs, me, 2, &far, (4, TAPER)).is_err(),
            "rank {me}"
        );
        rs.recv += 4096;
        assert!(zcopy_schedule(&rs, me, 2, &far, (4, TAPER)).is_ok());
    }
    assert!(zcopy_schedule(&ops[0], 0, 2, &[0], (4, TAPER)).is_err());
    assert!(zcopy_schedule(&ops[0], 0, 2, &[0, far_of(1)], (0, TAPER)).is_err());
    assert!(zcopy_schedule(&ops[0], 0, 3, &[0, far_of(1), far_of(2)], (4, TAPER)).is_err());
}

#[test]
fn flag_words_are_distinct_and_start_free() {
    for n in [2, 3, 16] {
        let mut seen = std::collections::HashSet::new();
        for q in 0..n {
            for s in 0..CE_SLOTS {
                assert!(seen.insert(CeFlags::full(n, q, s)));
                assert!(seen.insert(CeFlags::free(n, q, s)));
                assert_eq!(CeFlags::initial(n, CeFlags::free(n, q, s)), 1);
                assert_eq!(CeFlags::initial(n, CeFlags::full(n, q, s)), 0);
            }
            for l in 0..CE_LANES {
                assert!(seen.insert(CeFlags::ready(n, q, l)));
                assert_eq!(CeFlags::initial(n, CeFlags::ready(n, q, l)), 0);
                assert!(seen.insert(CeFlags::piece(n, q, l)));
                assert_eq!(CeFlags::initial(n, CeFlags::piece(n, q, l)), 0);
            }
        }
        assert_eq!(seen.len(), CeFlags::words(n));
        // The piece words map into a line per sender of the GPU-side area; the others not.
        let mut at = std::collections::HashSet::new();
        for q in 0..n {
            for l in 0..CE_LANES {
                let a = CeFlags::piece_at(n, CeFlags::piece(n, q, l)).unwrap();
                assert!(a / 128 == q && a.is_multiple_of(4) && at.insert(a));
            }
            assert_eq!(CeFlags::piece_at(n, CeFlags::ready(n, q, 0)), None);
            assert_eq!(CeFlags::piece_at(n, CeFlags::full(n, q, 0)), None);
        }
        assert!(seen.iter().all(|&w| w < CeFlags::words(n)));
    }
}

/// What a send's `far` names in the p2p model: the k-th receive at `to` from `from`.
fn p2p_id(to: Rank, from: Rank, k: usize) -> u64 {
    ((to as u64) << 40) | ((from as u64) << 20) | k as u64
}

/// Runs 2 ranks' launches of sends and receives by the copy engines (`sched`, as
/// `p2p_schedule`): a rank's launch starts once every lane of its previous one is done (the
/// caller's stream waits for them), and any runnable lane of the current launches steps, as
/// `pick` chooses. The k-th send from s to r copies into the k-th receive at r from s (what
/// the rendezvous gives it). Checks that every copy lands while its receive is open (its rank
/// raised `ready` for it and has not passed its `full`), exactly once, before the receive
/// ends, that nothing deadlocks and that every word ends where it began.
fn run_p2p_model(
    launches: &[Vec<Vec<P2pCopy>>; 2],
    sched: &dyn Fn(Rank, &[P2pCopy]) -> Schedule,
    mut pick: impl FnMut(&[(usize, usize)]) -> usize,
) -> Result<(), String> {
    let n = 2;
    let mut pages = initial_pages(n);
    let mut at = [0usize; 2];
    let load = |r: Rank, k: usize| -> Vec<(Lane, Vec<Cmd>, usize)> {
        launches[r]
            .get(k)
            .map(|l| sched(r, l).into_iter().map(|(a, c)| (a, c, 0)).collect())
            .unwrap_or_default()
    };
    let mut lanes: Vec<Vec<(Lane, Vec<Cmd>, usize)>> = (0..n).map(|r| load(r, 0)).collect();
    // Per (receiver, sender): receives opened so far, the one open now; copies made.
    let mut opened: HashMap<(Rank, Rank), usize> = HashMap::new();
    let mut open: HashMap<(Rank, Rank), usize> = HashMap::new();
    let mut copied: HashMap<u64, usize> = HashMap::new();
    loop {
        for r in 0..n {
            while lanes[r].iter().all(|(_, c, pc)| *pc == c.len()) && at[r] < launches[r].len() {
                at[r] += 1;
                lanes[r] = load(r, at[r]);
            }
        }
        let runnable = runnable_lanes(&lanes, &pages);
        if runnable.is_empty() {
            if (0..n).all(|r| at[r] >= launches[r].len()) {
                break;
            }
            return Err(format!(
                "deadlock: rank 0 at launch {}, rank 1 at launch {}",
                at[0], at[1]
            ));
        }
        let (r, i) = runnable[pick(&runnable) % runnable.len()];
        let (_, cmds, pc) = &mut lanes[r][i];
        let c = cmds[*pc];
        *pc += 1;
        match c {
            Cmd::Wait { word, .. } => {
                // A receive's end: its copy must have landed.
                if let Some(q) = (0..n).find(|&q| q != r && word == CeFlags::full(n, q, 0)) {
                    let k = open
                        .remove(&(r, q))
                        .ok_or("a full seen with no receive open")?;
                    if copied.get(&p2p_id(r, q, k)) != Some(&1) {
                        return Err(format!(
                            "rank {r} ended receive {k} from {q} before its copy"
                        ));
                    }
                }
            }
            Cmd::Write { page, word, value } => {
                if value == 1 && page != r && word == CeFlags::ready(n, r, 0) {
                    let k = opened.entry((r, page)).or_insert(0);
                    if open.insert((r, page), *k).is_some() {
                        return Err(format!("rank {r} opened two receives from {page} at once"));
                    }
                    *k += 1;
                }
                pages[page][word] = value;
            }
            Cmd::Copy {
                dst: Addr::Abs(far),
                ..
            } => {
                let (to, from, k) = (
                    (far >> 40) as usize,
                    ((far >> 20) & 0xfffff) as usize,
                    (far & 0xfffff) as usize,
                );
                if from != r || open.get(&(to, from)) != Some(&k) {
                    return Err(format!(
                        "rank {r} copies into receive {k} at rank {to} while it is not open"
                    ));
                }
                *copied.entry(far).or_insert(0) += 1;
            }
            c => return Err(format!("unexpected command {c:?}")),
        }
    }
    let sends: usize = launches
        .iter()
        .flatten()
        .flatten()
        .filter(|c| matches!(c, P2pCopy::Send { .. }))
        .count();
    if copied.len() != sends || copied.values().any(|&x| x != 1) {
        return Err(format!(
            "{} copies made for {sends} sends: {copied:?}",
            copied.len()
        ));
    }
    words_back(&pages)
}

/// Rounds of sends both ways between 2 ranks (`rounds[i]`: messages 0 -> 1 and 1 -> 0), as
/// launches: rank 0 groups each round, sends first; rank 1 groups it (`how` 0), or makes its
/// sends and its receives two launches, sends first (1) or receives first (2): each a
/// pattern NCCL runs without a deadlock. Each send names its matching receive.
fn p2p_launches(rounds: &[(usize, usize, u8)]) -> [Vec<Vec<P2pCopy>>; 2] {
    let mut out: [Vec<Vec<P2pCopy>>; 2] = [Vec::new(), Vec::new()];
    let mut sent = [0usize; 2];
    for &(a, b, how) in rounds {
        let mine = |me: Rank, sends: usize, recvs: usize, sent: &mut [usize; 2]| {
            let peer = 1 - me;
            let s: Vec<P2pCopy> = (0..sends)
                .map(|_| {
                    sent[me] += 1;
                    P2pCopy::Send {
                        peer,
                        src: 0,
                        far: p2p_id(peer, me, sent[me] - 1),
                        bytes: 4,
                    }
                })
                .collect();
            (s, vec![P2pCopy::Recv { peer }; recvs])
        };
        let (s0, r0) = mine(0, a, b, &mut sent);
        let (s1, r1) = mine(1, b, a, &mut sent);
        out[0].push(s0.into_iter().chain(r0).collect());
        match how % 3 {
            0 => out[1].push(s1.into_iter().chain(r1).collect()),
            1 => out[1].extend([s1, r1]),
            _ => out[1].extend([r1, s1]),
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// Sends and receives by the copy engines hold under any interleaving, whichever way the
    /// peer groups its side.
    #[test]
    fn posted_receives_hold_under_any_schedule(
        rounds in prop::collection::vec((0usize..3, 0usize..3, any::<u8>()), 1..5),
        seed in prop::collection::vec(any::<u8>(), 64), ahead in any::<bool>(),
    ) {
        let l = p2p_launches(&rounds);
        let r = run_p2p_model(&l, &|me, c| p2p_schedule(me, 2, c), picker(seed, ahead));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// The model finds what the two lanes per peer prevent: both directions on one stream
/// deadlock where the peer makes its sends and receives two launches, sends first.
#[test]
fn the_posted_receive_model_catches_one_lane_for_both_ways() {
    let l = p2p_launches(&[(1, 1, 1)]);
    // Both ways on one stream in issue order (each copy's commands as it comes alone).
    let one_lane = |me: Rank, c: &[P2pCopy]| -> Schedule {
        let mut v: Vec<Cmd> = Vec::new();
        for x in c {
            for (_, cmds) in p2p_schedule(me, 2, std::slice::from_ref(x)) {
                v.extend(cmds);
            }
        }
        vec![(
            Lane::Peer {
                peer: 1 - me,
                lane: 0,
            },
            v,
        )]
    };
    let first = |rn: &[(usize, usize)]| rn.len() - 1;
    assert!(run_p2p_model(&l, &|me, c| p2p_schedule(me, 2, c), first).is_ok());
    let e = run_p2p_model(&l, &one_lane, first).unwrap_err();
    assert!(e.contains("deadlock"), "{e}");
    // Without the receiver's ready, a copy lands in a receive not yet open.
    let no_ready = |me: Rank, c: &[P2pCopy]| -> Schedule {
        p2p_schedule(me, 2, c)
            .into_iter()
            .map(|(lane, cmds)| {
                let keep = |x: &Cmd| !matches!(x, Cmd::Wait { word, .. } | Cmd::Write { word, .. } if *word >= 2 * 2 * CE_SLOTS);
                (lane, cmds.into_iter().filter(keep).collect())
            })
            .collect()
    };
    let l = p2p_launches(&[(1, 0, 0)]);
    let e = run_p2p_model(&l, &no_ready, |_| 0).unwrap_err();
    assert!(e.contains("not open"), "{e}");
}

fn send_to(peer: Rank) -> P2pCopy {
    P2pCopy::Send {
        peer,
        src: 0x1000,
        far: 0x2000,
        bytes: 64,
    }
}

/// One send and one receive with the same peer share a lane, the receive's `ready` first and
/// its wait for `full` last, in either issue order; anything else keeps a lane per direction.
#[test]
fn a_sendrecv_with_one_peer_takes_one_lane_with_its_ready_first() {
    let (me, peer, n) = (0, 1, 2);
    let recv = P2pCopy::Recv { peer };
    let apart = |c: &[P2pCopy]| -> Vec<Cmd> {
        c.iter()
            .flat_map(|x| p2p_schedule(me, n, std::slice::from_ref(x)))
            .flat_map(|(_, cmds)| cmds)
            .collect()
    };
    let (s, r) = (apart(&[send_to(peer)]), apart(&[recv]));
    let want = [&r[..1], &s[..], &r[1..]].concat();
    for ops in [[send_to(peer), recv], [recv, send_to(peer)]] {
        let lanes = p2p_schedule(me, n, &ops);
        assert_eq!(lanes.len(), 1, "{ops:?}");
        assert_eq!(
            lanes[0].0,
            Lane::Peer {
                peer,
                lane: P2P_SEND_LANE
            }
        );
        assert_eq!(lanes[0].1, want);
        assert!(matches!(lanes[0].1[0], Cmd::Write { page, word, value: 1 }
                if page == peer && word == CeFlags::ready(n, me, 0)));
    }
    // Two sends and a receive, or a send and a receive with different peers: a lane each way.
    assert_eq!(
        p2p_schedule(me, n, &[send_to(peer), send_to(peer), recv]).len(),
        2
    );
    assert_eq!(
        p2p_schedule(0, 3, &[send_to(1), P2pCopy::Recv { peer: 2 }]).len(),
        2
    );
    // A send or a receive alone: one lane, as before.
    assert_eq!(p2p_schedule(me, n, &[recv]).len(), 1);
}

/// The merged sendrecv holds against every way the peer groups its side, under every
/// schedule the pickers give: the peer's sends first, its receives first, or grouped.
#[test]
fn a_merged_sendrecv_holds_however_the_peer_splits_it() {
    for how in 0u8..3 {
        for rounds in [
            vec![(1, 1, how)],
            vec![(1, 1, how), (1, 1, how), (1, 0, how)],
        ] {
            let l = p2p_launches(&rounds);
            for seed in 0u8..32 {
                for ahead in [false, true] {
                    let r = run_p2p_model(
                        &l,
                        &|me, c| p2p_schedule(me, 2, c),
                        picker(vec![seed, seed.wrapping_mul(7), 3], ahead),
                    );
                    assert!(r.is_ok(), "how {how}, seed {seed}: {}", r.unwrap_err());
                }
            }
        }
    }
}

/// Which lanes run on the caller's stream: its own lane always, a launch's only lane where
/// nothing runs beside it, no peer lane beside another.
#[test]
fn only_a_lone_lane_or_the_own_copy_runs_on_the_callers_stream() {
    // Per lane, whether it runs on the caller's stream (as `enqueue_with` places it).
    let on_callers_stream = |lanes: &Schedule, kept: bool, local_copies: bool| -> Vec<bool> {
        let alone = lone_lane_on_caller(lanes, kept, local_copies);
        lanes
            .iter()
            .map(|(l, _)| alone || lane_index(*l).is_none())
            .collect()
    };
    let peer = |p: Rank| (Lane::Peer { peer: p, lane: 0 }, Vec::new());
    let local = (Lane::Local, Vec::new());
    assert_eq!(on_callers_stream(&vec![peer(1)], false, false), [true]);
    assert_eq!(on_callers_stream(&vec![peer(1)], true, false), [false]);
    assert_eq!(on_callers_stream(&vec![local.clone()], false, true), [true]);
    // Out of place the own copy keeps the caller's stream; in place it copies nothing.
    assert_eq!(
        on_callers_stream(&vec![peer(1), local.clone()], false, true),
        [false, true]
    );
    assert_eq!(
        on_callers_stream(&vec![local.clone(), peer(1)], false, false),
        [true, true]
    );
    assert_eq!(
        on_callers_stream(&vec![local.clone(), peer(1)], true, false),
        [true, false]
    );
    assert_eq!(
        on_callers_stream(&vec![peer(1), peer(2)], false, false),
        [false, false]
    );
    assert_eq!(
        on_callers_stream(&vec![local, peer(2), peer(1)], false, false),
        [true, false, false]
    );
}
