//! Pipelined chains along the channel's ring order, starting (broadcast) or ending (reduce) at
//! the root. Each chunk flows down the chain while the next one follows, so a large message
//! costs about one chain traversal of one chunk plus its size over one link.

use super::ring::copy_all;
use super::{input, loops, output, ChannelCtx};
use crate::plan::{Lane, Step};
use crate::types::Rank;

/// Distance from the root along the ring order.
fn depth(ctx: &ChannelCtx, root: Rank) -> usize {
    let root_pos = ctx
        .order
        .iter()
        .position(|&r| r == root)
        .expect("root in ring order");
    (ctx.pos() + ctx.nranks - root_pos) % ctx.nranks
}

pub(crate) fn broadcast(lane: &mut Lane, ctx: &ChannelCtx, root: Rank) {
    let n = ctx.nranks;
    let d = depth(ctx, root);
    if d == 0 {
        copy_all(lane, ctx, false);
    }
    if n == 1 {
        return;
    }
    let p = ctx.pos() as isize;
    let next = ctx.at(p + 1);
    let prev = ctx.at(p - 1);
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        if d == 0 {
            lane.steps.push(Step::Send {
                to: next,
                src: input(ctx.op, off, len),
                pre: false,
            });
        } else {
            lane.steps.push(Step::RecvCopy {
                from: prev,
                count: len,
                dst: Some(output(ctx.op, off, len)),
                to: (d < n - 1).then_some(next),
            });
        }
    }
}

pub(crate) fn reduce(lane: &mut Lane, ctx: &ChannelCtx, root: Rank) {
    let n = ctx.nranks;
    if n == 1 {
        copy_all(lane, ctx, true);
        return;
    }
    let d = depth(ctx, root);
    let p = ctx.pos() as isize;
    // Data flows against the ring order, from the rank farthest from the root to the root.
    let toward_root = ctx.at(p - 1);
    let away = ctx.at(p + 1);
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        let local = input(ctx.op, off, len);
        let step = if d == n - 1 {
            Step::Send {
                to: toward_root,
                src: local,
                pre: true,
            }
        } else if d == 0 {
            Step::RecvReduce {
                from: away,
                local,
                pre_local: true,
                post: true,
                dst: Some(output(ctx.op, off, len)),
                to: None,
            }
        } else {
            Step::RecvReduce {
                from: away,
                local,
                pre_local: true,
                post: false,
                dst: None,
                to: Some(toward_root),
            }
        };
        lane.steps.push(step);
    }
}
