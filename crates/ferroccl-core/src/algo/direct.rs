//! Direct algorithms: every rank talks to the peers it has data for. Used for all-to-all,
//! gather, scatter and point-to-point, where each byte has one source and one destination.

use super::{input, loops, output, ChannelCtx, CollDesc, Tuning};
use crate::plan::{Lane, Step};
use crate::types::{CollKind, Rank};

/// Own block input -> output at the block offsets.
fn copy_own(lane: &mut Lane, ctx: &ChannelCtx, src_block: usize, dst_block: usize) {
    let len = ctx.end - ctx.start;
    if len > 0 {
        lane.steps.push(Step::Copy {
            src: input(ctx.op, src_block * ctx.count + ctx.start, len),
            dst: output(ctx.op, dst_block * ctx.count + ctx.start, len),
            pre: false,
            post: false,
        });
    }
}

/// Peers in the order a rank visits them: starting after itself, so that at any moment
/// different ranks talk to different peers.
pub(crate) fn peers_after(rank: Rank, n: usize) -> impl Iterator<Item = Rank> {
    (1..n).map(move |k| (rank + k) % n)
}
fn peers_before(rank: Rank, n: usize) -> impl Iterator<Item = Rank> {
    (1..n).map(move |k| (rank + n - k) % n)
}

pub(crate) fn all_to_all(lane: &mut Lane, ctx: &ChannelCtx) {
    let (r, n, c) = (ctx.rank, ctx.nranks, ctx.count);
    copy_own(lane, ctx, r, r);
    // Per loop, all sends of a range come before the receives of the same range: this keeps an
    // in-place all-to-all correct (a block is sent before it is overwritten) and needs only one
    // message of room per connection.
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        for peer in peers_after(r, n) {
            lane.steps.push(Step::Send {
                to: peer,
                src: input(ctx.op, peer * c + off, len),
                pre: false,
            });
        }
        for peer in peers_before(r, n) {
            lane.steps.push(Step::Recv {
                from: peer,
                dst: output(ctx.op, peer * c + off, len),
            });
        }
    }
}

/// Two-shot all-reduce of one channel's slice, in rounds of at most `chunk` elements: in each
/// round rank q owns share q of the round; every rank sends each owner its share, each owner
/// reduces its share (its own input first, then the peers' in a fixed order) and sends the
/// result to every rank. The result of each element is computed once, by its owner, so every
/// rank gets the same bits. Per connection and round the messages are one share, then one
/// result. The plan kernel takes it with a single round (`two_shot_fits`); the GPU peer engine
/// runs these rounds with a slot per share.
pub(crate) fn all_reduce_two_shot(lane: &mut Lane, ctx: &ChannelCtx) {
    let (r, n) = (ctx.rank, ctx.nranks);
    for (start, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        let share = |q: Rank| {
            let (a, b) = super::channel_slice(len, n, q);
            (start + a, b - a)
        };
        for peer in peers_after(r, n) {
            let (off, l) = share(peer);
            if l > 0 {
                lane.steps.push(Step::Send {
                    to: peer,
                    src: input(ctx.op, off, l),
                    pre: true,
                });
            }
        }
        let (off, l) = share(r);
        if l > 0 {
            for (i, peer) in peers_after(r, n).enumerate() {
                let first = i == 0;
                lane.steps.push(Step::RecvReduce {
                    from: peer,
                    local: if first {
                        input(ctx.op, off, l)
                    } else {
                        output(ctx.op, off, l)
                    },
                    pre_local: first,
                    post: i == n - 2,
                    dst: Some(output(ctx.op, off, l)),
                    to: None,
                });
            }
            for peer in peers_after(r, n) {
                lane.steps.push(Step::Send {
                    to: peer,
                    src: output(ctx.op, off, l),
                    pre: false,
                });
            }
        }
        for peer in peers_before(r, n) {
            let (off, l) = share(peer);
            if l > 0 {
                lane.steps.push(Step::Recv {
                    from: peer,
                    dst: output(ctx.op, off, l),
                });
            }
        }
    }
}

pub(crate) fn gather(lane: &mut Lane, ctx: &ChannelCtx, root: Rank) {
    let (r, n, c) = (ctx.rank, ctx.nranks, ctx.count);
    if r == root {
        copy_own(lane, ctx, 0, r);
    }
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        if r == root {
            for peer in peers_after(r, n) {
                lane.steps.push(Step::Recv {
                    from: peer,
                    dst: output(ctx.op, peer * c + off, len),
                });
            }
        } else {
            lane.steps.push(Step::Send {
                to: root,
                src: input(ctx.op, off, len),
                pre: false,
            });
        }
    }
}

pub(crate) fn scatter(lane: &mut Lane, ctx: &ChannelCtx, root: Rank) {
    let (r, n, c) = (ctx.rank, ctx.nranks, ctx.count);
    if r == root {
        copy_own(lane, ctx, r, 0);
    }
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        if r == root {
            for peer in peers_after(r, n) {
                lane.steps.push(Step::Send {
                    to: peer,
                    src: input(ctx.op, peer * c + off, len),
                    pre: false,
                });
            }
        } else {
            lane.steps.push(Step::Recv {
                from: root,
                dst: output(ctx.op, off, len),
            });
        }
    }
}

/// One channel's slice of a send or a receive: one lane per peer, direction and channel.
pub(crate) fn p2p(
    lane: &mut Lane,
    desc: &CollDesc,
    op: u16,
    t: &Tuning,
    (start, end): (usize, usize),
) {
    for (off, len) in loops(start, end, t.chunk_elems) {
        let step = if desc.kind == CollKind::Send {
            Step::Send {
                to: desc.root,
                src: input(op, off, len),
                pre: false,
            }
        } else {
            Step::Recv {
                from: desc.root,
                dst: output(op, off, len),
            }
        };
        lane.steps.push(step);
    }
}
