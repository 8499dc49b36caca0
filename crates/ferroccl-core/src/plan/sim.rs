//! A symbolic, lock-step execution of all ranks' plans.
//!
//! Every element carries what it is made of instead of a number: which logical element, which
//! ranks contributed, whether the pre-multiplication and the final division were applied. Values
//! are stored as runs (a run of consecutive logical elements is one entry), so sizes up to
//! `usize::MAX / nranks` cost no more than small ones. Connections are FIFOs that hold at most
//! `capacity` messages, as a backend guarantees; when no step of any rank can move and work
//! remains, the plans deadlock and the simulation says where.

use super::zcopy::{may_post, posts_of_run, run_starts, step_ops, waits_of_run, RemoteDsts};
use super::{BufKind, Plan, Region, Step};
use crate::types::{CollKind, Rank};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// What one element is, symbolically.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sym {
    /// Never written: whatever the buffer held before the operation.
    Garbage,
    /// Logical element `idx` (of the contributing ranks' inputs), reduced over `contrib`.
    Val {
        /// The logical element.
        idx: usize,
        /// The ranks folded into it, a bit each.
        contrib: u32,
        /// Its contributions were pre'd (pre-multiplied).
        scaled: bool,
        /// The result was post'd (an average divided).
        posted: bool,
    },
}

impl Sym {
    fn advance(self, by: usize) -> Sym {
        match self {
            Sym::Val {
                idx,
                contrib,
                scaled,
                posted,
            } => Sym::Val {
                idx: idx + by,
                contrib,
                scaled,
                posted,
            },
            g => g,
        }
    }
    /// True when `next` continues `self` (of length `len`) so the two can be one run.
    fn continues(self, len: usize, next: Sym) -> bool {
        match (self, next) {
            (Sym::Garbage, Sym::Garbage) => true,
            (
                Sym::Val {
                    idx,
                    contrib,
                    scaled,
                    posted,
                },
                Sym::Val {
                    idx: i2,
                    contrib: c2,
                    scaled: s2,
                    posted: p2,
                },
            ) => idx.checked_add(len) == Some(i2) && contrib == c2 && scaled == s2 && posted == p2,
            _ => false,
        }
    }
}

/// A sequence of runs: (length, first element).
pub type Run = Vec<(usize, Sym)>;

fn run_len(r: &Run) -> usize {
    r.iter().map(|x| x.0).sum()
}

fn normalize(r: Run) -> Run {
    let mut out: Run = Vec::with_capacity(r.len());
    for (len, s) in r {
        if len == 0 {
            continue;
        }
        if let Some(last) = out.last_mut() {
            if last.1.continues(last.0, s) {
                last.0 += len;
                continue;
            }
        }
        out.push((len, s));
    }
    out
}

/// Symbolic memory: non-overlapping runs covering `[0, size)`.
#[derive(Clone, Debug)]
struct Mem {
    size: usize,
    runs: BTreeMap<usize, (usize, Sym)>,
}

impl Mem {
    fn new(size: usize) -> Mem {
        let mut runs = BTreeMap::new();
        if size > 0 {
            runs.insert(0, (size, Sym::Garbage));
        }
        Mem { size, runs }
    }
    fn split(&mut self, at: usize) {
        if at == 0 || at >= self.size {
            return;
        }
        let (&start, &(len, s)) = self.runs.range(..=at).next_back().expect("memory covered");
        if start < at && at < start + len {
            self.runs.insert(start, (at - start, s));
            self.runs
                .insert(at, (start + len - at, s.advance(at - start)));
        }
    }
    fn read(&mut self, off: usize, count: usize) -> Run {
        self.split(off);
        self.split(off + count);
        self.runs.range(off..off + count).map(|(_, &v)| v).collect()
    }
    fn write(&mut self, off: usize, data: &Run) {
        let count = run_len(data);
        self.split(off);
        self.split(off + count);
        let keys: Vec<usize> = self.runs.range(off..off + count).map(|(&k, _)| k).collect();
        for k in keys {
            self.runs.remove(&k);
        }
        let mut at = off;
        for &(len, s) in data {
            if len > 0 {
                self.runs.insert(at, (len, s));
                at += len;
            }
        }
    }
    fn all(&mut self) -> Run {
        normalize(self.read(0, self.size))
    }
}

/// Applies `f` elementwise to two runs of equal length, cutting runs where either changes.
fn zip(
    a: &Run,
    b: &Run,
    mut f: impl FnMut(Sym, Sym) -> Result<Sym, String>,
) -> Result<Run, String> {
    let mut out = Vec::new();
    let (mut i, mut j, mut ai, mut bj) = (0usize, 0usize, 0usize, 0usize);
    while i < a.len() && j < b.len() {
        let (la, sa) = a[i];
        let (lb, sb) = b[j];
        let take = (la - ai).min(lb - bj);
        out.push((take, f(sa.advance(ai), sb.advance(bj))?));
        ai += take;
        bj += take;
        if ai == la {
            i += 1;
            ai = 0;
        }
        if bj == lb {
            j += 1;
            bj = 0;
        }
    }
    Ok(out)
}

fn map(a: &Run, mut f: impl FnMut(Sym) -> Result<Sym, String>) -> Result<Run, String> {
    a.iter().map(|&(l, s)| Ok((l, f(s)?))).collect()
}

fn pre(s: Sym) -> Result<Sym, String> {
    match s {
        Sym::Val {
            idx,
            contrib,
            scaled: false,
            posted: false,
        } => Ok(Sym::Val {
            idx,
            contrib,
            scaled: true,
            posted: false,
        }),
        other => Err(format!("pre-multiplication applied to {other:?}")),
    }
}

fn post(s: Sym) -> Result<Sym, String> {
    match s {
        Sym::Val {
            idx,
            contrib,
            scaled,
            posted: false,
        } => Ok(Sym::Val {
            idx,
            contrib,
            scaled,
            posted: true,
        }),
        other => Err(format!("final division applied to {other:?}")),
    }
}

fn combine(a: Sym, b: Sym) -> Result<Sym, String> {
    match (a, b) {
        (
            Sym::Val {
                idx: i1,
                contrib: c1,
                scaled: true,
                posted: false,
            },
            Sym::Val {
                idx: i2,
                contrib: c2,
                scaled: true,
                posted: false,
            },
        ) if i1 == i2 && c1 & c2 == 0 => Ok(Sym::Val {
            idx: i1,
            contrib: c1 | c2,
            scaled: true,
            posted: false,
        }),
        _ => Err(format!("bad reduction of {a:?} with {b:?}")),
    }
}

/// One operation of one rank, as the caller issued it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimOp {
    /// The operation.
    pub kind: CollKind,
    /// NCCL's count.
    pub count: usize,
    /// Root, or peer of a send / receive.
    pub root: Rank,
    /// Whether its buffers follow NCCL's in-place convention.
    pub in_place: bool,
}

/// (memory size, input offset, input count, output offset, output count).
type Layout = (usize, usize, usize, usize, usize);

/// Where the input and output of an operation lie in the rank's memory for it.
fn layout(op: &SimOp, rank: Rank, n: usize) -> Layout {
    let (inp, out) = op
        .kind
        .buffer_counts(op.count, n, rank == op.root)
        .expect("sizes fit");
    if !op.in_place {
        return (inp + out, 0, inp, inp, out);
    }
    let c = op.count;
    let (in_off, out_off) = match op.kind {
        CollKind::AllGather => (rank * c, 0),
        CollKind::ReduceScatter => (0, rank * c),
        CollKind::Gather if rank == op.root => (rank * c, 0),
        CollKind::Scatter if rank == op.root => (0, rank * c),
        _ => (0, 0),
    };
    let size = (in_off + inp).max(out_off + out);
    (size, in_off, inp, out_off, out)
}

/// The output every rank must end with, as a normalized run; None where it must be untouched.
fn expected(op: &SimOp, rank: Rank, n: usize) -> Option<Run> {
    let c = op.count;
    let all: u32 = if n == 32 { u32::MAX } else { (1u32 << n) - 1 };
    let reduced = |idx| Sym::Val {
        idx,
        contrib: all,
        scaled: true,
        posted: true,
    };
    let from = |idx, r: Rank| Sym::Val {
        idx,
        contrib: 1 << r,
        scaled: false,
        posted: false,
    };
    let run = match op.kind {
        CollKind::AllReduce => vec![(c, reduced(0))],
        CollKind::ReduceScatter => vec![(c, reduced(rank * c))],
        CollKind::Reduce if rank == op.root => vec![(c, reduced(0))],
        CollKind::Reduce => return None,
        CollKind::Broadcast => vec![(c, from(0, op.root))],
        CollKind::AllGather => (0..n).map(|b| (c, from(0, b))).collect(),
        CollKind::AllToAll => (0..n).map(|b| (c, from(rank * c, b))).collect(),
        CollKind::Gather if rank == op.root => (0..n).map(|b| (c, from(0, b))).collect(),
        CollKind::Gather => return None,
        CollKind::Scatter => vec![(c, from(rank * c, op.root))],
        CollKind::Recv => vec![(c, from(0, op.root))],
        CollKind::Send => return None,
    };
    Some(normalize(run))
}

/// Runs every rank's plan; `ops[r]` are rank r's operations in plan op order. Returns the
/// number of lock-step rounds on success.
pub fn simulate(
    ops: &[Vec<SimOp>],
    plans: &[Plan],
    capacity: usize,
    seed: u64,
) -> Result<usize, String> {
    run(ops, plans, capacity, seed, None)
}

/// [`simulate`] with zero-copy (`zcopy.rs`): `remote[r]` marks rank r's messages that go
/// straight into the receiver's output. A receiving lane posts its output at the start of each
/// run of an operation's steps (or refuses, see `may_post`); a sending run with a direct message
/// to that peer waits for the post of the matching run (same first-message number), then writes
/// the data into the receiver's memory at once; the receiver checks where it landed and stores
/// nothing, and a forwarding receiver reads it back from its output when its step runs.
pub fn simulate_zero_copy(
    ops: &[Vec<SimOp>],
    plans: &[Plan],
    capacity: usize,
    seed: u64,
    remote: &[RemoteDsts],
) -> Result<usize, String> {
    simulate_zero_copy_with(ops, plans, capacity, seed, remote, may_post)
}

/// [`simulate_zero_copy`] with another rule for when a receiver posts (tests of the rule).
pub fn simulate_zero_copy_with(
    ops: &[Vec<SimOp>],
    plans: &[Plan],
    capacity: usize,
    seed: u64,
    remote: &[RemoteDsts],
    rule: PostRule,
) -> Result<usize, String> {
    let shape_ok = remote.len() == plans.len()
        && remote.iter().zip(plans).all(|(m, p)| {
            m.len() == p.lanes.len()
                && m.iter()
                    .zip(&p.lanes)
                    .all(|(a, l)| a.len() == l.steps.len())
        });
    if !shape_ok {
        return Err("remote destinations do not have the plans' shape".into());
    }
    run(ops, plans, capacity, seed, Some((remote, rule)))
}

/// Whether a receiver posts its output for an operation (kind, in place).
pub type PostRule = fn(CollKind, bool) -> bool;

/// A message in flight: its data, and where it was already written when it went direct.
type Msg = (Run, Option<usize>);

fn run(
    ops: &[Vec<SimOp>],
    plans: &[Plan],
    capacity: usize,
    seed: u64,
    zc: Option<(&[RemoteDsts], PostRule)>,
) -> Result<usize, String> {
    let n = plans.len();
    let remote = zc.map(|z| z.0);
    assert!(n <= 32 && ops.len() == n);
    // mems[r][op]; input and output offsets per (r, op).
    let mut mems: Vec<Vec<Mem>> = Vec::new();
    let mut lay: Vec<Vec<Layout>> = Vec::new();
    for (r, rops) in ops.iter().enumerate() {
        let mut m = Vec::new();
        let mut l = Vec::new();
        for op in rops {
            let lo = layout(op, r, n);
            let mut mem = Mem::new(lo.0);
            if lo.2 > 0 {
                mem.write(
                    lo.1,
                    &vec![(
                        lo.2,
                        Sym::Val {
                            idx: 0,
                            contrib: 1 << r,
                            scaled: false,
                            posted: false,
                        },
                    )],
                );
            }
            m.push(mem);
            l.push(lo);
        }
        mems.push(m);
        lay.push(l);
        let sizes: Vec<(usize, usize)> = lay[r].iter().map(|x| (x.2, x.4)).collect();
        plans[r].validate(&sizes)?;
        if plans[r].rank != r || plans[r].nranks != n {
            return Err(format!(
                "plan {r} is for rank {} of {}",
                plans[r].rank, plans[r].nranks
            ));
        }
    }
    let addr = |lay: &Vec<Vec<Layout>>, r: Rank, reg: &Region| -> usize {
        let l = lay[r][reg.op as usize];
        (if reg.buf == BufKind::Input { l.1 } else { l.3 }) + reg.offset
    };
    let mut queues: HashMap<(Rank, Rank, u32), VecDeque<Msg>> = HashMap::new();
    let mut cursor: Vec<Vec<usize>> = plans.iter().map(|p| vec![0; p.lanes.len()]).collect();
    // Zero-copy state: per rank and lane, each step's operation and run start, and the run last
    // posted; posts by (receiver, sender, channel) = (receiver's op, or None when it refused,
    // first message number); messages sent and received per connection; per sending (lane,
    // run, peer) the number of its first message, and the peers a run waits for.
    let lane_ops: Vec<Vec<Vec<u16>>> = plans
        .iter()
        .map(|p| p.lanes.iter().map(|l| step_ops(&l.steps)).collect())
        .collect();
    let lane_runs: Vec<Vec<Vec<usize>>> = lane_ops
        .iter()
        .map(|p| p.iter().map(|o| run_starts(o)).collect())
        .collect();
    let mut posted_run: Vec<Vec<Option<usize>>> =
        plans.iter().map(|p| vec![None; p.lanes.len()]).collect();
    let mut posts: HashMap<(Rank, Rank, u32), (Option<u16>, usize)> = HashMap::new();
    let mut sent: HashMap<(Rank, Rank, u32), usize> = HashMap::new();
    let mut recvd: HashMap<(Rank, Rank, u32), usize> = HashMap::new();
    let mut run_first: HashMap<(Rank, usize, usize, Rank), usize> = HashMap::new();
    let mut run_waits: HashMap<(Rank, usize, usize), Vec<Rank>> = HashMap::new();
    let mut rng = seed | 1;
    let mut rounds = 0;
    loop {
        let mut progressed = false;
        let mut remaining = false;
        for r in 0..n {
            let nl = plans[r].lanes.len();
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let rot = if nl > 0 { (rng as usize) % nl } else { 0 };
            for k in 0..nl {
                let li = (k + rot) % nl;
                let lane = &plans[r].lanes[li];
                let Some(step) = lane.steps.get(cursor[r][li]) else {
                    continue;
                };
                remaining = true;
                let ch = lane.channel;
                let si = cursor[r][li];
                let rs = lane_runs[r][li][si];
                if remote.is_some() && posted_run[r][li] != Some(rs) {
                    // The lane starts a run: every earlier run of it is complete, so the output
                    // regions this run stores into may be written by the peers from now on.
                    let op = lane_ops[r][li][rs];
                    let so = ops[r][op as usize];
                    let open = zc.is_some_and(|z| (z.1)(so.kind, so.in_place));
                    for from in posts_of_run(&lane.steps, &lane_ops[r][li], rs) {
                        posts.insert(
                            (r, from, ch),
                            (
                                open.then_some(op),
                                recvd.get(&(from, r, ch)).copied().unwrap_or(0),
                            ),
                        );
                    }
                    posted_run[r][li] = Some(rs);
                    progressed = true;
                }
                if let Some(from) = step.recv_from() {
                    if queues.get(&(from, r, ch)).is_none_or(|q| q.is_empty()) {
                        continue;
                    }
                }
                // Where this step's message goes straight to: (receiver's op, output offset).
                let mut direct_to: Option<(u16, usize)> = None;
                if let Some(to) = step.send_to() {
                    if queues
                        .get(&(r, to, ch))
                        .is_some_and(|q| q.len() >= capacity)
                    {
                        continue;
                    }
                    if let Some(rem) = remote {
                        let marks = &rem[r][li];
                        let waits = run_waits.entry((r, li, rs)).or_insert_with(|| {
                            waits_of_run(&lane.steps, &lane_ops[r][li], marks, rs)
                        });
                        if waits.contains(&to) {
                            let first = *run_first
                                .entry((r, li, rs, to))
                                .or_insert_with(|| sent.get(&(r, to, ch)).copied().unwrap_or(0));
                            match posts.get(&(to, r, ch)) {
                                Some(&(op, tag)) if tag == first => direct_to = op.zip(marks[si]),
                                _ => continue,
                            }
                        }
                    }
                }
                let ctx =
                    |e: String| format!("rank {r} lane {li} step {} {step:?}: {e}", cursor[r][li]);
                let mut take = |from: Rank, count: usize| -> Result<Msg, String> {
                    let msg = queues
                        .get_mut(&(from, r, ch))
                        .and_then(|q| q.pop_front())
                        .expect("checked");
                    *recvd.entry((from, r, ch)).or_insert(0) += 1;
                    if run_len(&msg.0) != count {
                        return Err(format!(
                            "received {} elements from {from}, expected {count}",
                            run_len(&msg.0)
                        ));
                    }
                    Ok(msg)
                };
                // A direct message must have landed where this step stores it.
                let landed = |at: Option<usize>, dst: Option<Region>| -> Result<bool, String> {
                    match (at, dst) {
                        (None, _) => Ok(false),
                        (Some(off), Some(d)) if d.buf == BufKind::Output && d.offset == off => Ok(true),
                        (Some(off), d) => {
                            Err(format!("a direct message landed at output offset {off}, but this step stores it at {d:?}"))
                        }
                    }
                };
                let mut outbox: Option<(Rank, Run)> = None;
                match *step {
                    Step::Send { to, src, pre: p } => {
                        let a = addr(&lay, r, &src);
                        let mut d = mems[r][src.op as usize].read(a, src.count);
                        if p {
                            d = map(&d, pre).map_err(ctx)?;
                        }
                        outbox = Some((to, d));
                    }
                    Step::Recv { from, dst } => {
                        let (d, at) = take(from, dst.count).map_err(ctx)?;
                        if !landed(at, Some(dst)).map_err(ctx)? {
                            let a = addr(&lay, r, &dst);
                            mems[r][dst.op as usize].write(a, &d);
                        }
                    }
                    Step::RecvReduce {
                        from,
                        local,
                        pre_local,
                        post: ps,
                        dst,
                        to,
                    } => {
                        let (got, at) = take(from, local.count).map_err(ctx)?;
                        if at.is_some() {
                            return Err(ctx(
                                "a message to be reduced went straight to the output".into()
                            ));
                        }
                        let a = addr(&lay, r, &local);
                        let mut l = mems[r][local.op as usize].read(a, local.count);
                        if pre_local {
                            l = map(&l, pre).map_err(ctx)?;
                        }
                        let mut v = zip(&got, &l, combine).map_err(ctx)?;
                        if ps {
                            v = map(&v, post).map_err(ctx)?;
                        }
                        if let Some(dst) = dst {
                            let a = addr(&lay, r, &dst);
                            mems[r][dst.op as usize].write(a, &v);
                        }
                        if let Some(to) = to {
                            outbox = Some((to, v));
                        }
                    }
                    Step::RecvCopy {
                        from,
                        count,
                        dst,
                        to,
                    } => {
                        let (mut v, at) = take(from, count).map_err(ctx)?;
                        if landed(at, dst).map_err(ctx)? {
                            // Forwarded from where it landed, as the kernel does.
                            let d = dst.expect("landed");
                            v = mems[r][d.op as usize].read(addr(&lay, r, &d), d.count);
                        } else if let Some(dst) = dst {
                            let a = addr(&lay, r, &dst);
                            mems[r][dst.op as usize].write(a, &v);
                        }
                        if let Some(to) = to {
                            outbox = Some((to, v));
                        }
                    }
                    Step::Copy {
                        src,
                        dst,
                        pre: p,
                        post: ps,
                    } => {
                        let a = addr(&lay, r, &src);
                        let mut v = mems[r][src.op as usize].read(a, src.count);
                        if p {
                            v = map(&v, pre).map_err(ctx)?;
                        }
                        if ps {
                            v = map(&v, post).map_err(ctx)?;
                        }
                        let a = addr(&lay, r, &dst);
                        mems[r][dst.op as usize].write(a, &v);
                    }
                }
                if let Some((to, v)) = outbox {
                    let mut at = None;
                    if let Some((op, off)) = direct_to {
                        let l = lay[to][op as usize];
                        if off.checked_add(run_len(&v)).is_none_or(|e| e > l.4) {
                            let e = format!("a direct write of {} elements at {off} overflows rank {to}'s output of {}", run_len(&v), l.4);
                            return Err(ctx(e));
                        }
                        mems[to][op as usize].write(l.3 + off, &v);
                        at = Some(off);
                    }
                    *sent.entry((r, to, ch)).or_insert(0) += 1;
                    queues.entry((r, to, ch)).or_default().push_back((v, at));
                }
                cursor[r][li] += 1;
                progressed = true;
            }
        }
        if !remaining {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = (0..n)
                .flat_map(|r| {
                    let cursor = &cursor;
                    plans[r]
                        .lanes
                        .iter()
                        .enumerate()
                        .filter_map(move |(li, l)| {
                            l.steps
                                .get(cursor[r][li])
                                .map(|s| format!("rank {r} lane {li} at {s:?}"))
                        })
                })
                .collect();
            return Err(format!(
                "deadlock after {rounds} rounds: {}",
                stuck.join("; ")
            ));
        }
        rounds += 1;
    }
    if let Some(((f, t, c), q)) = queues.iter().find(|(_, q)| !q.is_empty()) {
        return Err(format!(
            "{} unreceived message(s) from {f} to {t} on channel {c}",
            q.len()
        ));
    }
    for r in 0..n {
        for (oi, op) in ops[r].iter().enumerate() {
            let l = lay[r][oi];
            let got = normalize(mems[r][oi].read(l.3, l.4));
            match expected(op, r, n) {
                Some(want) => {
                    if got != want {
                        return Err(format!(
                            "rank {r} op {oi} {op:?}: output {got:?}, expected {want:?}"
                        ));
                    }
                }
                None => {
                    // Untouched: garbage out-of-place, the input in place.
                    let all = mems[r][oi].all();
                    let mut fresh = Mem::new(l.0);
                    if l.2 > 0 {
                        fresh.write(
                            l.1,
                            &vec![(
                                l.2,
                                Sym::Val {
                                    idx: 0,
                                    contrib: 1 << r,
                                    scaled: false,
                                    posted: false,
                                },
                            )],
                        );
                    }
                    if all != fresh.all() {
                        return Err(format!(
                            "rank {r} op {oi} {op:?}: memory changed where it must not"
                        ));
                    }
                }
            }
            // Inputs are read-only unless they alias the output.
            if !op.in_place && l.2 > 0 {
                let inp = normalize(mems[r][oi].read(l.1, l.2));
                let want = vec![(
                    l.2,
                    Sym::Val {
                        idx: 0,
                        contrib: 1 << r,
                        scaled: false,
                        posted: false,
                    },
                )];
                if inp != want {
                    return Err(format!("rank {r} op {oi} {op:?}: input was modified"));
                }
            }
        }
    }
    Ok(rounds)
}
