//! Algorithms: pure functions from an operation description to one rank's [`Plan`].
//!
//! All algorithms share the same shape: the element range of the operation is cut into
//! contiguous channel slices (each channel its own lane and its own ring order), and each
//! channel's slice is processed in loops of at most `chunk_elems` elements per message, so that
//! a message always fits in a connection's FIFO and a ring never waits on itself.

mod chain;
mod direct;
mod ring;

use crate::plan::{BufKind, Dir, Lane, Plan, Region};
use crate::types::{CollKind, Error, Rank};

/// One operation, as every rank of the communicator describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollDesc {
    pub kind: CollKind,
    /// NCCL's count: see [`CollKind::buffer_counts`].
    pub count: usize,
    /// Root of rooted collectives; the peer of a send or receive; ignored otherwise.
    pub root: Rank,
}

/// How an operation is cut up: chosen by the tuner, identical on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    pub channels: usize,
    /// Elements one message carries at most (the pipeline unit).
    pub chunk_elems: usize,
    /// All-reduces of at most this many elements (and at most one message per rank's share)
    /// take the two-shot direct algorithm: 2 dependent messages instead of the ring's 2(n-1).
    pub direct_max_elems: usize,
}

impl Tuning {
    /// The tuning for an element size from byte-level knobs.
    pub fn for_elem_size(channels: usize, chunk_bytes: usize, elem_size: usize) -> Tuning {
        Tuning { channels: channels.max(1), chunk_elems: (chunk_bytes / elem_size).max(1), direct_max_elems: 0 }
    }
    /// Small all-reduces of up to `bytes` go direct (see `direct_max_elems`).
    pub fn with_direct_max_bytes(self, bytes: usize, elem_size: usize) -> Tuning {
        Tuning { direct_max_elems: bytes / elem_size.max(1), ..self }
    }
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
        raw.div_ceil(SLICE_ALIGN).saturating_mul(SLICE_ALIGN).min(count)
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
pub(crate) fn loops(start: usize, end: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
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
        return Err(Error::InvalidArgument(format!("rank {rank} is not below nranks {nranks}")));
    }
    match desc.kind {
        CollKind::Send | CollKind::Recv
            if desc.root >= nranks => {
                return Err(Error::InvalidArgument(format!("{} peer {} is not below nranks {nranks}", desc.kind, desc.root)));
            }
        k if k.has_root()
            && desc.root >= nranks => {
                return Err(Error::InvalidArgument(format!("{k} root {} is not below nranks {nranks}", desc.root)));
            }
        _ => {}
    }
    if desc.kind.buffer_counts(desc.count, nranks, true).is_none() {
        return Err(Error::InvalidArgument(format!("{} count {} times {nranks} ranks overflows", desc.kind, desc.count)));
    }
    Ok(())
}

/// The plan of `rank` for `desc`, whose buffers are operation `op` of the launch.
pub fn build(desc: &CollDesc, op: u16, rank: Rank, nranks: usize, t: &Tuning) -> Plan {
    let mut plan = Plan { rank, nranks, lanes: Vec::new() };
    match desc.kind {
        CollKind::Send | CollKind::Recv => {
            let dir = if desc.kind == CollKind::Send { Dir::Send } else { Dir::Recv };
            // Like a collective, the message is cut into channel slices, each its own lane.
            for c in 0..t.channels {
                let mut lane = Lane::p2p(desc.root, dir, c);
                direct::p2p(&mut lane, desc, op, t, channel_slice(desc.count, t.channels, c));
                plan.lanes.push(lane);
            }
            return plan;
        }
        _ => {}
    }
    // Every channel of every collective exists on every rank even when its slice is empty, so
    // that groups compose lanes identically everywhere.
    let per_channel_count = match desc.kind {
        CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => desc.count,
        _ => desc.count, // per-rank block size for the others
    };
    for c in 0..t.channels {
        let (s, e) = channel_slice(per_channel_count, t.channels, c);
        let mut lane = Lane::collective(c);
        let order = ring_order(nranks, c);
        let ctx = ChannelCtx { op, rank, nranks, order: &order, start: s, end: e, chunk: t.chunk_elems, count: desc.count };
        match desc.kind {
            // Two shots beat the ring's 2(n-1) hops when latency is all there is; a share
            // must be one message, so that every rank can send all of them before receiving.
            CollKind::AllReduce if nranks >= 3 && desc.count <= t.direct_max_elems && desc.count <= t.chunk_elems => {
                direct::all_reduce_two_shot(&mut lane, &ctx)
            }
            CollKind::AllReduce => ring::all_reduce(&mut lane, &ctx),
            CollKind::ReduceScatter => ring::reduce_scatter(&mut lane, &ctx),
            CollKind::AllGather => ring::all_gather(&mut lane, &ctx),
            CollKind::Broadcast => chain::broadcast(&mut lane, &ctx, desc.root),
            CollKind::Reduce => chain::reduce(&mut lane, &ctx, desc.root),
            CollKind::AllToAll => direct::all_to_all(&mut lane, &ctx),
            CollKind::Gather => direct::gather(&mut lane, &ctx, desc.root),
            CollKind::Scatter => direct::scatter(&mut lane, &ctx, desc.root),
            CollKind::Send | CollKind::Recv => unreachable!("handled above"),
        }
        plan.lanes.push(lane);
    }
    plan
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
        self.order.iter().position(|&r| r == self.rank).expect("rank in ring order")
    }
    pub fn at(&self, pos: isize) -> Rank {
        self.order[pos.rem_euclid(self.nranks as isize) as usize]
    }
}

#[cfg(test)]
mod tests;
