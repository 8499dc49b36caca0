//! Algorithms: pure functions from an operation description to one rank's [`Plan`].
//!
//! All algorithms share the same shape: the element range of the operation is cut into
//! contiguous channel slices (each channel its own lane and its own ring order), and each
//! channel's slice is processed in loops of at most `chunk_elems` elements per message, so that
//! a message always fits in a connection's FIFO and a ring never waits on itself.

mod chain;
mod direct;
mod oneshot;
mod ring;

use crate::plan::{BufKind, Dir, Lane, Plan, Region, Step};
pub use crate::tune::Algo;
use crate::types::{CollKind, DataType, Error, Rank};

/// One operation, as every rank of the communicator describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollDesc {
    /// The operation.
    pub kind: CollKind,
    /// NCCL's count: see [`CollKind::buffer_counts`].
    pub count: usize,
    /// Root of rooted collectives; the peer of a send or receive; ignored otherwise.
    pub root: Rank,
}

/// How an operation is cut up, from the tuner's [`Choice`](crate::tune::Choice): the same on
/// every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// The plan builder that makes its steps.
    pub algo: Algo,
    /// Channels (lanes) it is spread over.
    pub channels: usize,
    /// Elements one message carries at most (the pipeline unit).
    pub chunk_elems: usize,
}

impl Tuning {
    /// The default algorithm for `kind`, cut into `channels` and `chunk_elems`.
    pub fn default_for(kind: CollKind, channels: usize, chunk_elems: usize) -> Tuning {
        Tuning {
            algo: Algo::default_for(kind),
            channels,
            chunk_elems,
        }
    }
}

/// Whether the two-shot all-reduce can run `count` elements on `nranks` with messages of
/// `chunk_elems` through FIFOs (the host and the plan kernel): it needs a third rank to gain
/// anything over the ring there, and one round (every share one message), so that every rank
/// can send all of them before receiving any. The GPU peer engine runs it in rounds on any
/// rank count: its staging holds a round's shares whole.
pub fn two_shot_fits(nranks: usize, count: usize, chunk_elems: usize) -> bool {
    nranks >= 3 && count <= chunk_elems
}

/// Channel slices are cut at multiples of this many elements so that vector loads stay aligned.
const SLICE_ALIGN: usize = 64;

/// The element range `[start, end)` of channel `c` out of `channels` over `count` elements.
pub fn channel_slice(count: usize, channels: usize, c: usize) -> (usize, usize) {
    let cut = |i: usize| -> usize {
        if i >= channels {
            return count;
        }
        let raw = (count as u128 * i as u128 / channels as u128) as usize;
        raw.div_ceil(SLICE_ALIGN)
            .saturating_mul(SLICE_ALIGN)
            .min(count)
    };
    (cut(c), cut(c + 1))
}

/// The ring order of channel `c`: even channels go up, odd channels go down, so that two
/// channels load both directions of every link.
pub fn ring_order(nranks: usize, c: usize) -> Vec<Rank> {
    let mut v: Vec<Rank> = (0..nranks).collect();
    if c % 2 == 1 {
        v.reverse();
    }
    v
}

/// Successive `(offset, len)` pieces of at most `chunk` elements covering `[start, end)`.
pub(crate) fn loops(
    start: usize,
    end: usize,
    chunk: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    let mut at = start;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let len = (end - at).min(chunk);
        let r = (at, len);
        at += len;
        Some(r)
    })
}

pub(crate) fn input(op: u16, offset: usize, count: usize) -> Region {
    Region::new(op, BufKind::Input, offset, count)
}
pub(crate) fn output(op: u16, offset: usize, count: usize) -> Region {
    Region::new(op, BufKind::Output, offset, count)
}

/// Checks a description against the communicator: root/peer in range, buffer sizes computable.
pub fn validate(desc: &CollDesc, rank: Rank, nranks: usize) -> Result<(), Error> {
    if nranks == 0 {
        return Err(Error::InvalidArgument("communicator of 0 ranks".into()));
    }
    if rank >= nranks {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} is not below nranks {nranks}"
        )));
    }
    match desc.kind {
        CollKind::Send | CollKind::Recv if desc.root >= nranks => {
            return Err(Error::InvalidArgument(format!(
                "{} peer {} is not below nranks {nranks}",
                desc.kind, desc.root
            )));
        }
        k if k.has_root() && desc.root >= nranks => {
            return Err(Error::InvalidArgument(format!(
                "{k} root {} is not below nranks {nranks}",
                desc.root
            )));
        }
        _ => {}
    }
    if desc.kind.buffer_counts(desc.count, nranks, true).is_none() {
        return Err(Error::InvalidArgument(format!(
            "{} count {} times {nranks} ranks overflows",
            desc.kind, desc.count
        )));
    }
    Ok(())
}

/// The plan of `rank` for `desc`, whose buffers are operation `op` of the launch, by the
/// algorithm `t` names (which must support the operation: the tuner only names those).
pub fn build(desc: &CollDesc, op: u16, rank: Rank, nranks: usize, t: &Tuning) -> Plan {
    assert!(
        t.algo.supports(desc.kind),
        "{} has no {} plan",
        desc.kind,
        t.algo.name()
    );
    let mut plan = Plan {
        rank,
        nranks,
        lanes: Vec::new(),
    };
    if let CollKind::Send | CollKind::Recv = desc.kind {
        let dir = if desc.kind == CollKind::Send {
            Dir::Send
        } else {
            Dir::Recv
        };
        // Like a collective, the message is cut into channel slices, each its own lane.
        for c in 0..t.channels {
            let mut lane = Lane::p2p(desc.root, dir, c);
            direct::p2p(
                &mut lane,
                desc,
                op,
                t,
                channel_slice(desc.count, t.channels, c),
            );
            plan.lanes.push(lane);
        }
        return plan;
    }
    // Every channel of a collective exists on every rank even when its slice is empty, so that
    // groups compose lanes identically everywhere. Slices cut the per-rank block (the whole
    // buffer for all-reduce, broadcast and reduce).
    for c in 0..t.channels {
        let (s, e) = channel_slice(desc.count, t.channels, c);
        let mut lane = Lane::collective(c);
        let order = ring_order(nranks, c);
        let ctx = ChannelCtx {
            op,
            rank,
            nranks,
            order: &order,
            start: s,
            end: e,
            chunk: t.chunk_elems,
            count: desc.count,
        };
        match (t.algo, desc.kind) {
            (Algo::TwoShot, _) => direct::all_reduce_two_shot(&mut lane, &ctx),
            (Algo::Ring, CollKind::AllReduce) => ring::all_reduce(&mut lane, &ctx),
            (Algo::Ring, CollKind::ReduceScatter) => ring::reduce_scatter(&mut lane, &ctx),
            (Algo::Ring, _) => ring::all_gather(&mut lane, &ctx),
            (Algo::Chain, CollKind::Broadcast) => chain::broadcast(&mut lane, &ctx, desc.root),
            (Algo::Chain, _) => chain::reduce(&mut lane, &ctx, desc.root),
            (Algo::Direct, CollKind::AllToAll) => direct::all_to_all(&mut lane, &ctx),
            (Algo::Direct, CollKind::Gather) => direct::gather(&mut lane, &ctx, desc.root),
            (Algo::Direct, _) => direct::scatter(&mut lane, &ctx, desc.root),
            (Algo::OneShot, CollKind::AllReduce) => oneshot::all_reduce(&mut lane, &ctx),
            (Algo::OneShot, CollKind::ReduceScatter) => oneshot::reduce_scatter(&mut lane, &ctx),
            (Algo::OneShot, CollKind::Reduce) => oneshot::reduce(&mut lane, &ctx, desc.root),
            (Algo::OneShot, CollKind::AllGather) => oneshot::all_gather(&mut lane, &ctx),
            (Algo::OneShot, CollKind::Broadcast) => oneshot::broadcast(&mut lane, &ctx, desc.root),
            (Algo::OneShot, CollKind::AllToAll) => oneshot::all_to_all(&mut lane, &ctx),
            (Algo::OneShot, CollKind::Gather) => oneshot::gather(&mut lane, &ctx, desc.root),
            (Algo::OneShot, _) => oneshot::scatter(&mut lane, &ctx, desc.root),
        }
        plan.lanes.push(lane);
    }
    plan
}

/// One operation of a launch, as [`build_launch`] plans it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchOp {
    /// The operation.
    pub desc: CollDesc,
    /// Its element type.
    pub dtype: DataType,
    /// How it is cut up.
    pub tuning: Tuning,
}

/// Lane id of a rank's sends to itself (plain copies, no connection).
pub const SELF_LANE: u64 = u64::MAX;

/// The plan of `rank` for a launch of `ops` (one operation, or a group): each operation's lanes
/// concatenated by lane id, so that every rank issues the same messages in the same order on
/// every connection. A send to oneself is a copy into the matching receive from oneself, in
/// issue order; they must pair up in count and type.
pub fn build_launch(rank: Rank, nranks: usize, ops: &[LaunchOp]) -> Result<Plan, Error> {
    let mut plan = Plan {
        rank,
        nranks,
        lanes: Vec::new(),
    };
    let mut self_sends = Vec::new();
    let mut self_recvs = Vec::new();
    for (i, o) in ops.iter().enumerate() {
        let i16 = u16::try_from(i)
            .map_err(|_| Error::InvalidArgument("a group holds at most 65536 operations".into()))?;
        if matches!(o.desc.kind, CollKind::Send | CollKind::Recv) && o.desc.root == rank {
            if o.desc.kind == CollKind::Send {
                self_sends.push(i)
            } else {
                self_recvs.push(i)
            }
            continue;
        }
        plan.append(build(&o.desc, i16, rank, nranks, &o.tuning));
    }
    if self_sends.len() != self_recvs.len() {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: {} sends to itself but {} receives from itself in one group",
            self_sends.len(),
            self_recvs.len()
        )));
    }
    let mut lane = Lane {
        id: SELF_LANE,
        channel: 0,
        steps: Vec::new(),
    };
    for (&s, &r) in self_sends.iter().zip(&self_recvs) {
        let (a, b) = (&ops[s], &ops[r]);
        if a.desc.count != b.desc.count || a.dtype != b.dtype {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: a send to itself of {} x {} meets a receive of {} x {}",
                a.desc.count, a.dtype, b.desc.count, b.dtype
            )));
        }
        if a.desc.count > 0 {
            lane.steps.push(Step::Copy {
                src: Region::new(s as u16, BufKind::Input, 0, a.desc.count),
                dst: Region::new(r as u16, BufKind::Output, 0, a.desc.count),
                pre: false,
                post: false,
            });
        }
    }
    if !lane.steps.is_empty() {
        plan.lanes.push(lane);
    }
    Ok(plan)
}

/// What a channel's algorithm needs to know.
pub(crate) struct ChannelCtx<'a> {
    pub op: u16,
    pub rank: Rank,
    pub nranks: usize,
    pub order: &'a [Rank],
    /// The channel's slice of the per-rank element range.
    pub start: usize,
    pub end: usize,
    pub chunk: usize,
    /// The operation's count (block size for all-gather, reduce-scatter, all-to-all, ...).
    pub count: usize,
}

impl ChannelCtx<'_> {
    pub fn pos(&self) -> usize {
        self.order
            .iter()
            .position(|&r| r == self.rank)
            .expect("rank in ring order")
    }
    pub fn at(&self, pos: isize) -> Rank {
        self.order[pos.rem_euclid(self.nranks as isize) as usize]
    }
}

#[cfg(test)]
mod tests;
