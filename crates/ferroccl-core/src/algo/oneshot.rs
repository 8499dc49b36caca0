//! One-shot algorithms: every rank sends each peer what that peer needs of its data, then
//! combines what it received. One round of messages, all of a rank's sends before its
//! receives, so latency is one message whatever the rank count; each rank moves (n-1) times
//! the data, so they are for small operations (the tuner's choice). Each loop of at most
//! `chunk` elements is one such round; the GPU's direct engine runs plans of a single round.
//!
//! Reductions combine this rank's contribution first and then the peers' in rank order; the
//! direct engine folds all contributions in rank order instead, so that every rank gets the
//! same bits (the plan says what moves and what is combined, not in which order).

use super::direct::{self, peers_after};
use super::{input, loops, output, ChannelCtx};
use crate::plan::{Lane, Step};
use crate::types::Rank;

/// The peers other than `r`, in rank order.
fn others(r: Rank, n: usize) -> impl Iterator<Item = Rank> {
    (0..n).filter(move |&q| q != r)
}

/// Folds the peers' messages of `len` elements into `out`, which holds this rank's own
/// contribution; the last fold finishes the result (`post`).
fn fold_peers(lane: &mut Lane, ctx: &ChannelCtx, out: usize, len: usize) {
    let peers: Vec<Rank> = others(ctx.rank, ctx.nranks).collect();
    for (i, &q) in peers.iter().enumerate() {
        let o = output(ctx.op, out, len);
        let post = i + 1 == peers.len();
        lane.steps.push(Step::RecvReduce {
            from: q,
            local: o,
            pre_local: false,
            post,
            dst: Some(o),
            to: None,
        });
    }
}

/// All-reduce: each rank sends its slice to every peer and reduces all of them.
pub(crate) fn all_reduce(lane: &mut Lane, ctx: &ChannelCtx) {
    reduce_to(lane, ctx, None, |_| 0, 0)
}

/// Reduce-scatter: block q of each rank's input goes to rank q, which reduces them.
pub(crate) fn reduce_scatter(lane: &mut Lane, ctx: &ChannelCtx) {
    let c = ctx.count;
    reduce_to(lane, ctx, None, move |q| q * c, ctx.rank * c)
}

/// Reduce: every rank sends its slice to the root, which reduces them.
pub(crate) fn reduce(lane: &mut Lane, ctx: &ChannelCtx, root: Rank) {
    reduce_to(lane, ctx, Some(root), |_| 0, 0)
}

/// The reductions' common shape: rank q reduces what every rank sends it from input offset
/// `src(q)` (every rank when `root` is None, else only the root), its own from `own`.
fn reduce_to(
    lane: &mut Lane,
    ctx: &ChannelCtx,
    root: Option<Rank>,
    src: impl Fn(Rank) -> usize,
    own: usize,
) {
    let (r, n) = (ctx.rank, ctx.nranks);
    let receives = root.is_none_or(|t| t == r);
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        let targets: Vec<Rank> = match root {
            None => peers_after(r, n).collect(),
            Some(t) if t != r => vec![t],
            Some(_) => Vec::new(),
        };
        for q in targets {
            lane.steps.push(Step::Send {
                to: q,
                src: input(ctx.op, src(q) + off, len),
                pre: true,
            });
        }
        if receives {
            let out = output(ctx.op, off, len);
            lane.steps.push(Step::Copy {
                src: input(ctx.op, own + off, len),
                dst: out,
                pre: true,
                post: n == 1,
            });
            fold_peers(lane, ctx, off, len);
        }
    }
}

/// All-gather: each rank sends its block to every peer.
pub(crate) fn all_gather(lane: &mut Lane, ctx: &ChannelCtx) {
    let (r, n, c) = (ctx.rank, ctx.nranks, ctx.count);
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        for q in peers_after(r, n) {
            lane.steps.push(Step::Send {
                to: q,
                src: input(ctx.op, off, len),
                pre: false,
            });
        }
        lane.steps.push(Step::Copy {
            src: input(ctx.op, off, len),
            dst: output(ctx.op, r * c + off, len),
            pre: false,
            post: false,
        });
        for q in others(r, n) {
            lane.steps.push(Step::Recv {
                from: q,
                dst: output(ctx.op, q * c + off, len),
            });
        }
    }
}

/// Broadcast: the root sends its buffer to every peer.
pub(crate) fn broadcast(lane: &mut Lane, ctx: &ChannelCtx, root: Rank) {
    let (r, n) = (ctx.rank, ctx.nranks);
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        if r == root {
            for q in peers_after(r, n) {
                lane.steps.push(Step::Send {
                    to: q,
                    src: input(ctx.op, off, len),
                    pre: false,
                });
            }
            lane.steps.push(Step::Copy {
                src: input(ctx.op, off, len),
                dst: output(ctx.op, off, len),
                pre: false,
                post: false,
            });
        } else {
            lane.steps.push(Step::Recv {
                from: root,
                dst: output(ctx.op, off, len),
            });
        }
    }
}

/// All-to-all, gather and scatter are one-shot already: the direct algorithms.
pub(crate) fn all_to_all(lane: &mut Lane, ctx: &ChannelCtx) {
    direct::all_to_all(lane, ctx)
}
pub(crate) fn gather(lane: &mut Lane, ctx: &ChannelCtx, root: Rank) {
    direct::gather(lane, ctx, root)
}
pub(crate) fn scatter(lane: &mut Lane, ctx: &ChannelCtx, root: Rank) {
    direct::scatter(lane, ctx, root)
}
