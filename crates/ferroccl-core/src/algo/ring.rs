//! Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two back to back.
//!
//! In a ring of n ranks, at step s the rank at ring position p sends chunk (p - s) mod n to its
//! successor. After n - 1 reducing steps, position p holds the fully reduced chunk (p + 1) mod n;
//! n - 1 forwarding steps then give every rank every chunk. Each rank moves 2(n-1)/n of the data,
//! the bandwidth optimum for rings.

use super::{input, loops, output, ChannelCtx};
use crate::plan::{Lane, Region, Step};

/// How chunk `i` of a ring loop maps to buffer regions.
trait ChunkMap {
    fn input(&self, i: usize) -> Region;
    fn output(&self, i: usize) -> Region;
}

/// Reduce-scatter steps of one loop; `forward_final` continues into an all-gather.
fn reduce_scatter_loop(lane: &mut Lane, ctx: &ChannelCtx, map: &dyn ChunkMap, forward_final: bool) {
    let n = ctx.nranks as isize;
    let p = ctx.pos() as isize;
    let next = ctx.at(p + 1);
    let prev = ctx.at(p - 1);
    let chunk = |s: isize| (p - s).rem_euclid(n) as usize;
    let c0 = map.input(chunk(0));
    if c0.count > 0 {
        lane.steps.push(Step::Send {
            to: next,
            src: c0,
            pre: true,
        });
    }
    for s in 1..n {
        let c = chunk(s);
        let local = map.input(c);
        if local.count == 0 {
            continue;
        }
        let last = s == n - 1;
        lane.steps.push(Step::RecvReduce {
            from: prev,
            local,
            pre_local: true,
            post: last,
            dst: last.then(|| map.output(c)),
            to: (!last || forward_final).then_some(next),
        });
    }
}

/// All-gather steps of one loop after the rank's own chunk was sent.
fn all_gather_loop(lane: &mut Lane, ctx: &ChannelCtx, map: &dyn ChunkMap) {
    let n = ctx.nranks as isize;
    let p = ctx.pos() as isize;
    let next = ctx.at(p + 1);
    let prev = ctx.at(p - 1);
    for t in 1..n {
        let dst = map.output((p - t + 1).rem_euclid(n) as usize);
        if dst.count == 0 {
            continue;
        }
        lane.steps.push(Step::RecvCopy {
            from: prev,
            count: dst.count,
            dst: Some(dst),
            to: (t < n - 1).then_some(next),
        });
    }
}

/// All-reduce: one loop covers n chunks of the same buffer range.
struct AllReduceLoop {
    op: u16,
    base: usize,
    len: usize,
    per: usize,
}
impl AllReduceLoop {
    fn range(&self, i: usize) -> (usize, usize) {
        let lo = (i * self.per).min(self.len);
        let hi = ((i + 1) * self.per).min(self.len);
        (self.base + lo, hi - lo)
    }
}
impl ChunkMap for AllReduceLoop {
    fn input(&self, i: usize) -> Region {
        let (o, c) = self.range(i);
        input(self.op, o, c)
    }
    fn output(&self, i: usize) -> Region {
        let (o, c) = self.range(i);
        output(self.op, o, c)
    }
}

pub(crate) fn all_reduce(lane: &mut Lane, ctx: &ChannelCtx) {
    let n = ctx.nranks;
    if n == 1 {
        copy_all(lane, ctx, true);
        return;
    }
    let loop_elems = ctx.chunk.saturating_mul(n);
    for (base, len) in loops(ctx.start, ctx.end, loop_elems) {
        let map = AllReduceLoop {
            op: ctx.op,
            base,
            len,
            per: len.div_ceil(n),
        };
        reduce_scatter_loop(lane, ctx, &map, true);
        all_gather_loop(lane, ctx, &map);
    }
}

/// Reduce-scatter and all-gather: chunk i of a loop is the same range of rank-block `block(i)`.
struct BlockLoop<'a> {
    op: u16,
    ctx: &'a ChannelCtx<'a>,
    off: usize,
    len: usize,
    /// Reduce-scatter (blocks in the input) or all-gather (blocks in the output).
    rs: bool,
}
impl BlockLoop<'_> {
    /// Position p holds chunk p + 1 at the turn of the ring, so chunk i is the block of the rank
    /// at position i - 1: reduce-scatter ends with each rank's own block where it belongs, and
    /// all-gather starts from it.
    fn block(&self, i: usize) -> usize {
        self.ctx.at(i as isize - 1)
    }
}
impl ChunkMap for BlockLoop<'_> {
    fn input(&self, i: usize) -> Region {
        if self.rs {
            input(self.op, self.block(i) * self.ctx.count + self.off, self.len)
        } else {
            input(self.op, self.off, self.len)
        }
    }
    fn output(&self, i: usize) -> Region {
        if self.rs {
            output(self.op, self.off, self.len)
        } else {
            output(self.op, self.block(i) * self.ctx.count + self.off, self.len)
        }
    }
}

pub(crate) fn reduce_scatter(lane: &mut Lane, ctx: &ChannelCtx) {
    if ctx.nranks == 1 {
        copy_all(lane, ctx, true);
        return;
    }
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        let map = BlockLoop {
            op: ctx.op,
            ctx,
            off,
            len,
            rs: true,
        };
        reduce_scatter_loop(lane, ctx, &map, false);
    }
}

pub(crate) fn all_gather(lane: &mut Lane, ctx: &ChannelCtx) {
    let len = ctx.end - ctx.start;
    if len > 0 {
        let own = ctx.rank * ctx.count + ctx.start;
        lane.steps.push(Step::Copy {
            src: input(ctx.op, ctx.start, len),
            dst: output(ctx.op, own, len),
            pre: false,
            post: false,
        });
    }
    if ctx.nranks == 1 {
        return;
    }
    let next = ctx.at(ctx.pos() as isize + 1);
    for (off, len) in loops(ctx.start, ctx.end, ctx.chunk) {
        let map = BlockLoop {
            op: ctx.op,
            ctx,
            off,
            len,
            rs: false,
        };
        lane.steps.push(Step::Send {
            to: next,
            src: map.input(0),
            pre: false,
        });
        all_gather_loop(lane, ctx, &map);
    }
}

/// A one-rank reduction (or the rank's own block): input to output with both transforms.
pub(crate) fn copy_all(lane: &mut Lane, ctx: &ChannelCtx, reduce: bool) {
    let len = ctx.end - ctx.start;
    if len > 0 {
        lane.steps.push(Step::Copy {
            src: input(ctx.op, ctx.start, len),
            dst: output(ctx.op, ctx.start, len),
            pre: reduce,
            post: reduce,
        });
    }
}
