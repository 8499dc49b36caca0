//! The Plan IR: what one rank does for one operation (or one group of operations), as data.
//!
//! A plan is a set of *lanes*. A lane is an ordered list of steps that a backend executes one
//! after another; different lanes progress independently (a channel of a collective is a lane,
//! and so is each peer direction of a group of sends and receives). Every step moves at most one
//! *message* over a connection, and a connection is identified by (peer, lane channel, direction),
//! so the messages between two ranks on one connection are matched purely by their order.
//!
//! Backends never invent data movement: the host backend interprets steps directly, and the CUDA
//! backend will interpret the same steps in its kernels. The simulator in [`sim`] executes all
//! ranks' plans symbolically, which is how the property tests prove delivery and liveness.

pub mod copies;
pub mod lanes;
pub mod sim;
pub mod zcopy;

use crate::types::Rank;

/// Which buffer of which operation a region lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufKind {
    /// The operation's input buffer.
    Input,
    /// The operation's output buffer.
    Output,
}

/// A contiguous range of elements of one operation's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    /// Index of the operation inside the plan (`Plan::ops`), which fixes dtype and buffers.
    pub op: u16,
    /// Input or output.
    pub buf: BufKind,
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub count: usize,
}

impl Region {
    /// `count` elements of `op`'s `buf` from element `offset`.
    pub const fn new(op: u16, buf: BufKind, offset: usize, count: usize) -> Region {
        Region {
            op,
            buf,
            offset,
            count,
        }
    }
    /// One past its last element.
    pub const fn end(&self) -> usize {
        self.offset + self.count
    }
}

/// One step. Reduction semantics (see `numeric::reduce`): `pre` scales a rank's own input for a
/// pre-multiplied sum before it enters a reduction, `post` finishes a fully reduced value (the
/// division of an average). Each contribution is pre'd once and each result post'd once.
#[derive(Clone, Copy, Debug, PartialEq)]
#[allow(missing_docs)] // each variant's comment says what its fields are
pub enum Step {
    /// Send `src` to `to`.
    Send { to: Rank, src: Region, pre: bool },
    /// Receive a message of `dst.count` elements from `from` into `dst`.
    Recv { from: Rank, dst: Region },
    /// Receive `local.count` elements from `from`, combine each with `local` (pre'd first when
    /// `pre_local`), post the result when `post`, then store it into `dst` and/or forward it to `to`.
    RecvReduce {
        from: Rank,
        local: Region,
        pre_local: bool,
        post: bool,
        dst: Option<Region>,
        to: Option<Rank>,
    },
    /// Receive `count` elements from `from`, store them into `dst` and/or forward them to `to`.
    RecvCopy {
        from: Rank,
        count: usize,
        dst: Option<Region>,
        to: Option<Rank>,
    },
    /// Copy `src` to `dst` locally (same element count), with the reduction transforms.
    Copy {
        src: Region,
        dst: Region,
        pre: bool,
        post: bool,
    },
}

impl Step {
    /// The peer this step receives from, if any.
    pub fn recv_from(&self) -> Option<Rank> {
        match *self {
            Step::Recv { from, .. }
            | Step::RecvReduce { from, .. }
            | Step::RecvCopy { from, .. } => Some(from),
            _ => None,
        }
    }
    /// The peer this step sends to, if any.
    pub fn send_to(&self) -> Option<Rank> {
        match *self {
            Step::Send { to, .. } => Some(to),
            Step::RecvReduce { to, .. } | Step::RecvCopy { to, .. } => to,
            _ => None,
        }
    }
    /// Elements moved (received and/or sent, or copied).
    pub fn count(&self) -> usize {
        match *self {
            Step::Send { src, .. } => src.count,
            Step::Recv { dst, .. } => dst.count,
            Step::RecvReduce { local, .. } => local.count,
            Step::RecvCopy { count, .. } => count,
            Step::Copy { src, .. } => src.count,
        }
    }
    /// The operation this step belongs to.
    pub fn op(&self) -> u16 {
        match *self {
            Step::Send { src, .. } => src.op,
            Step::Recv { dst, .. } => dst.op,
            Step::RecvReduce { local, .. } => local.op,
            Step::Copy { src, .. } => src.op,
            Step::RecvCopy { dst: Some(d), .. } => d.op,
            Step::RecvCopy { .. } => 0,
        }
    }
}

/// An ordered list of steps. `channel` selects the connections its steps use (with the peers
/// the steps name); `id` says which lanes of successive operations in a group are one lane.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Lane {
    /// Which lanes of successive operations in a group are one lane.
    pub id: u64,
    /// The channel whose connections its steps use.
    pub channel: u32,
    /// The steps, executed in order.
    pub steps: Vec<Step>,
}

impl Lane {
    /// The lane of channel `c` of a collective.
    pub fn collective(c: usize) -> Lane {
        Lane {
            id: c as u64,
            channel: c as u32,
            steps: Vec::new(),
        }
    }
    /// The lane of point-to-point channel `c` of the sends to (`dir == Send`) or receives from
    /// `peer` of a group.
    pub fn p2p(peer: Rank, dir: Dir, c: usize) -> Lane {
        let d = if dir == Dir::Send { 0 } else { 1 };
        Lane {
            id: (1 << 40) | ((c as u64) << 32) | ((peer as u64) << 1) | d,
            channel: P2P_CHANNEL_BASE + c as u32,
            steps: Vec::new(),
        }
    }
}

/// Channel numbers at or above this are used by point-to-point lanes (base + channel), so that
/// sends and receives in a group never share a connection with a collective's ring.
pub const P2P_CHANNEL_BASE: u32 = 1 << 16;

/// Direction of a connection, seen from the rank that owns the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dir {
    /// This rank sends on it.
    Send,
    /// This rank receives on it.
    Recv,
}

/// A connection of a plan: (peer, channel, direction).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnKey {
    /// The other rank.
    pub peer: Rank,
    /// The channel (collective channel, or `P2P_CHANNEL_BASE` + channel).
    pub channel: u32,
    /// Sending or receiving, from the plan's rank.
    pub dir: Dir,
}

/// Everything one rank executes for one launch.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Plan {
    /// The rank that executes it.
    pub rank: Rank,
    /// Ranks of the communicator.
    pub nranks: usize,
    /// The lanes, which progress independently.
    pub lanes: Vec<Lane>,
}

impl Plan {
    /// Every connection the plan uses, each once, sorted.
    pub fn connections(&self) -> Vec<ConnKey> {
        let mut v = Vec::new();
        for lane in &self.lanes {
            for s in &lane.steps {
                if let Some(p) = s.recv_from() {
                    v.push(ConnKey {
                        peer: p,
                        channel: lane.channel,
                        dir: Dir::Recv,
                    });
                }
                if let Some(p) = s.send_to() {
                    v.push(ConnKey {
                        peer: p,
                        channel: lane.channel,
                        dir: Dir::Send,
                    });
                }
            }
        }
        v.sort();
        v.dedup();
        v
    }

    /// Checks the structural rules backends rely on: peers in range and not self, no two lanes
    /// sharing a connection, regions inside their buffers (`sizes[op] = (input, output)` elements).
    pub fn validate(&self, sizes: &[(usize, usize)]) -> Result<(), String> {
        let mut owner: std::collections::HashMap<ConnKey, usize> = std::collections::HashMap::new();
        for (li, lane) in self.lanes.iter().enumerate() {
            for s in &lane.steps {
                for (peer, dir) in [(s.recv_from(), Dir::Recv), (s.send_to(), Dir::Send)] {
                    let Some(peer) = peer else { continue };
                    if peer >= self.nranks || peer == self.rank {
                        return Err(format!("rank {}: step {s:?} names peer {peer}", self.rank));
                    }
                    let key = ConnKey {
                        peer,
                        channel: lane.channel,
                        dir,
                    };
                    if let Some(&o) = owner.get(&key) {
                        if o != li {
                            return Err(format!(
                                "rank {}: lanes {o} and {li} share connection {key:?}",
                                self.rank
                            ));
                        }
                    }
                    owner.insert(key, li);
                }
                let regions: [Option<Region>; 2] = match *s {
                    Step::Send { src, .. } => [Some(src), None],
                    Step::Recv { dst, .. } => [Some(dst), None],
                    Step::RecvReduce { local, dst, .. } => [Some(local), dst],
                    Step::RecvCopy { dst, .. } => [dst, None],
                    Step::Copy { src, dst, .. } => [Some(src), Some(dst)],
                };
                for r in regions.into_iter().flatten() {
                    let (inp, out) = *sizes.get(r.op as usize).ok_or_else(|| {
                        format!("rank {}: region of unknown op {}", self.rank, r.op)
                    })?;
                    let cap = if r.buf == BufKind::Input { inp } else { out };
                    if r.offset.checked_add(r.count).is_none_or(|e| e > cap) {
                        return Err(format!(
                            "rank {}: region {r:?} outside its buffer of {cap} elements",
                            self.rank
                        ));
                    }
                    if r.count != s.count() {
                        return Err(format!("rank {}: step {s:?} mixes region sizes", self.rank));
                    }
                }
            }
        }
        Ok(())
    }

    /// Appends the lanes of `other` (a plan for the same rank): lanes with the same id are
    /// concatenated, so that operations in a group run in the order they were issued on every
    /// connection, exactly as every other rank runs them.
    pub fn append(&mut self, other: Plan) {
        for lane in other.lanes {
            match self.lanes.iter_mut().find(|l| l.id == lane.id) {
                Some(l) => l.steps.extend(lane.steps),
                None => self.lanes.push(lane),
            }
        }
    }

    /// Steps over all lanes.
    pub fn step_count(&self) -> usize {
        self.lanes.iter().map(|l| l.steps.len()).sum()
    }
}
