//! The copy engine: data-movement collectives (`plan::copies`) moved by the GPUs' copy engines,
//! with no thread block of ours.
//!
//! Every message between two ranks is cut into pieces (`plan::copies::pieces`) that take turns
//! in the receiver's staging slots (the peer engine's region for that sender, cut into
//! `CE_SLOTS` slots). Per piece, on the sender's lane stream: wait until the slot is free,
//! mark it taken, copy the piece into it over the link, raise the slot's `full` word at the
//! receiver. On the receiver's lane stream: wait for `full`, lower it, copy the piece out to the
//! output, raise the slot's `free` word at the sender. Every word goes back to where it started
//! by the operation's end, so the same memory operations replayed by a CUDA graph find the same
//! state: no counter to carry from call to call.
//!
//! Staging is shared with the peer engine, so two handshakes per operation and pair guard the
//! hand-over: the receiver's lanes first tell the sender it has entered the operation (`ready`:
//! all it did before, its own peer-engine reads of this region included, is done), and the
//! sender's lanes end by waiting until every slot they used is free again (the receiver has
//! copied out every piece), so that whatever the sender runs next may write the region.
//!
//! The words live in host memory (`cuda::hostpage`): a stream stalled on a word whose peer died
//! is freed by CPU stores (`release`), which no full GPU queue can hold up. Copy-engine waits
//! have no deadline of their own: a peer that hangs without dying holds them until the
//! communicator is aborted.

use super::fabric::CeFabric;
use crate::cuda::cu_ok;
use crate::cuda::device::Gpu;
use crate::cuda::hostpage::HostPage;
use cudarc::driver::sys;
use ferroccl_core::plan::copies::{
    copies, fold_cuts, fold_kind, fold_list, pieces, rendezvous_serves, zcopy_serves, Fold, Piece,
    Taper, Transfer, CE_LANES, CE_SLOTS, FOLD_MAX_PIECES,
};
use ferroccl_core::{CollKind, Error, Rank};
use std::time::{Duration, Instant};

/// Where the words are in a rank's flag page, for a communicator of `n` ranks.
pub(crate) struct CeFlags;

impl CeFlags {
    /// `full` of slot `slot` for sender `from`, in the receiver's page (set by the sender).
    pub fn full(n: usize, from: Rank, slot: usize) -> usize {
        debug_assert!(from < n && slot < CE_SLOTS);
        from * CE_SLOTS + slot
    }
    /// `free` of slot `slot` at receiver `to`, in the sender's page (set by the receiver).
    pub fn free(n: usize, to: Rank, slot: usize) -> usize {
        debug_assert!(to < n && slot < CE_SLOTS);
        n * CE_SLOTS + to * CE_SLOTS + slot
    }
    /// `ready` of lane `lane` of receiver `from`, in the sender's page (set by the receiver).
    pub fn ready(n: usize, from: Rank, lane: usize) -> usize {
        debug_assert!(from < n && lane < CE_LANES);
        2 * n * CE_SLOTS + from * CE_LANES + lane
    }
    /// `piece` of lane `lane` of sender `from`, in the receiver's page (set by the sender): how
    /// many of a copy-and-fold's pieces that lane has landed in the receiver's output (the fold
    /// kernel waits for it, the receiver's stream sets it back to 0). These words live apart from
    /// the host page, in the receiver's GPU memory (`CeFabric::fold`, `piece_at`), where the fold
    /// kernel polls them; the schedules and the model name them as page words all the same.
    pub fn piece(n: usize, from: Rank, lane: usize) -> usize {
        debug_assert!(from < n && lane < CE_LANES);
        2 * n * CE_SLOTS + n * CE_LANES + from * CE_LANES + lane
    }
    /// For a `piece` word: its byte offset in the owner's piece-word area (a 128-byte line per
    /// sender); None for the host page's words.
    pub fn piece_at(n: usize, word: usize) -> Option<usize> {
        let first = Self::piece(n, 0, 0);
        (first..first + n * CE_LANES)
            .contains(&word)
            .then(|| ((word - first) / CE_LANES) * 128 + ((word - first) % CE_LANES) * 4)
    }
    /// Words of a page.
    pub fn words(n: usize) -> usize {
        n * (2 * CE_SLOTS + 2 * CE_LANES)
    }
    /// A word's value between operations: every slot free, nothing full, nobody ready.
    pub fn initial(n: usize, i: usize) -> u32 {
        (n * CE_SLOTS..2 * n * CE_SLOTS).contains(&i) as u32
    }
}

/// One operation for the copy engine: NCCL's arguments.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CeOp {
    pub kind: CollKind,
    pub count: usize,
    pub elem: usize,
    pub root: Rank,
    pub send: u64,
    pub recv: u64,
}

/// One stream command of a lane, as data: what `enqueue` issues, and what the host tests check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cmd {
    /// Wait until word `word` of rank `page`'s page is 1.
    Wait { page: Rank, word: usize },
    /// Store `value` into word `word` of rank `page`'s page.
    Write { page: Rank, word: usize, value: u32 },
    /// Copy `bytes` from `src` to `dst`.
    Copy { dst: Addr, src: Addr, bytes: usize },
    /// The fold kernel on `blocks` blocks: output = op(this rank's input at `src`, the output),
    /// `bytes` of each, in the pieces of `fold_pieces` (cut by `taper`): piece k once word
    /// `CeFlags::piece(from, lane)` of this rank's page reaches its `count`.
    Fold {
        from: Rank,
        src: usize,
        bytes: usize,
        taper: Taper,
        blocks: usize,
    },
}

/// One piece of a copy-and-fold: its bytes in the copy, the lane that copies it, and the value
/// that lane's piece word holds once it landed (the lane's pieces so far). The sender's lanes
/// and the receiver's fold kernel cut alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FoldPiece {
    pub at: usize,
    pub bytes: usize,
    pub lane: usize,
    pub count: u32,
}

/// The pieces of a copy-and-fold of `bytes` as `taper` cuts them (`copies::fold_cuts`): piece k
/// on lane k % CE_LANES, the (k / CE_LANES + 1)-th of its lane (the fold kernel takes their ends
/// and the same rule).
pub(crate) fn fold_pieces(bytes: usize, taper: Taper) -> impl Iterator<Item = FoldPiece> {
    let mut at = 0;
    fold_cuts(bytes, taper)
        .into_iter()
        .enumerate()
        .map(move |(k, len)| {
            let p = FoldPiece {
                at,
                bytes: len,
                lane: k % CE_LANES,
                count: (k / CE_LANES + 1) as u32,
            };
            at += len;
            p
        })
}

/// The fold kernel's pieces for a copy-and-fold of `bytes` of `es`-byte elements (`FcFold::ends`
/// and `pieces`): where each piece of `fold_pieces` ends, in elements, as the copy lanes cut
/// them; an error where they would not fit the parameter (`copies::fold_cuts` keeps to it).
pub(crate) fn fold_ends(
    bytes: usize,
    taper: Taper,
    es: usize,
) -> Result<([u64; FOLD_MAX_PIECES], u64), Error> {
    let mut ends = [0u64; FOLD_MAX_PIECES];
    let mut k = 0;
    for p in fold_pieces(bytes, taper) {
        *ends.get_mut(k).ok_or_else(|| {
            Error::Internal(format!(
                "a fold of {bytes} bytes in more than {FOLD_MAX_PIECES} pieces"
            ))
        })? = ((p.at + p.bytes) / es.max(1)) as u64;
        k += 1;
    }
    Ok((ends, k as u64))
}

/// A fold kernel's launch, as `CopyEngine::enqueue` hands it to the launch path: device
/// addresses as this GPU maps them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FoldLaunch {
    /// The piece word of each lane in this rank's page.
    pub words: [u64; CE_LANES],
    /// This rank's own operand.
    pub mine: u64,
    /// The output, where the peer's copy lands.
    pub out: u64,
    pub bytes: usize,
    pub taper: Taper,
    pub blocks: usize,
}

/// An address a command names: a user buffer at an offset, or a staging slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Addr {
    Send(usize),
    Recv(usize),
    /// Slot `slot` of sender `from`'s region in `owner`'s staging.
    Stage {
        owner: Rank,
        from: Rank,
        slot: usize,
    },
    /// A device address as this process maps it: a peer's buffer in a symmetric window
    /// (`zcopy_schedule`; its schedules are kept per buffer address, but not those after a
    /// rendezvous), or either end of a send by the copies (`p2p_schedule`).
    Abs(u64),
}

/// Which stream of a rank runs a lane: a peer's lane carries both directions (what this rank
/// sends the peer and receives from it), piece by piece, or the local copy, which runs on the
/// caller's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Lane {
    Peer { peer: Rank, lane: usize },
    Local,
}

/// The commands that move piece `p` of the message from `me` to `r` (src: its offset in this
/// rank's input), on the sender's side.
fn send_piece(v: &mut Vec<Cmd>, n: usize, me: Rank, r: Rank, src: usize, p: &Piece) {
    let free = CeFlags::free(n, r, p.slot);
    v.push(Cmd::Wait {
        page: me,
        word: free,
    });
    v.push(Cmd::Write {
        page: me,
        word: free,
        value: 0,
    });
    v.push(Cmd::Copy {
        dst: Addr::Stage {
            owner: r,
            from: me,
            slot: p.slot,
        },
        src: Addr::Send(src + p.at),
        bytes: p.bytes,
    });
    v.push(Cmd::Write {
        page: r,
        word: CeFlags::full(n, me, p.slot),
        value: 1,
    });
}

/// The commands that take piece `p` of the message from `s` to `me` out of the staging to
/// `dst` in this rank's output.
fn recv_piece(v: &mut Vec<Cmd>, n: usize, me: Rank, s: Rank, dst: usize, p: &Piece) {
    let full = CeFlags::full(n, s, p.slot);
    v.push(Cmd::Wait {
        page: me,
        word: full,
    });
    v.push(Cmd::Write {
        page: me,
        word: full,
        value: 0,
    });
    v.push(Cmd::Copy {
        dst: Addr::Recv(dst + p.at),
        src: Addr::Stage {
            owner: me,
            from: s,
            slot: p.slot,
        },
        bytes: p.bytes,
    });
    v.push(Cmd::Write {
        page: s,
        word: CeFlags::free(n, me, p.slot),
        value: 1,
    });
}

/// The lane of `me`'s copy to itself, if the operation has one (it runs on the caller's stream).
fn local_lane(list: &[Transfer], me: Rank) -> Schedule {
    list.iter()
        .find(|c| c.from == me && c.to == me)
        .map(|c| {
            (
                Lane::Local,
                vec![Cmd::Copy {
                    dst: Addr::Recv(c.dst),
                    src: Addr::Send(c.src),
                    bytes: c.bytes,
                }],
            )
        })
        .into_iter()
        .collect()
}

/// What `me` sends `q` and receives from it.
fn between(list: &[Transfer], me: Rank, q: Rank) -> (Option<&Transfer>, Option<&Transfer>) {
    (
        list.iter().find(|c| c.from == me && c.to == q),
        list.iter().find(|c| c.from == q && c.to == me),
    )
}

/// A rank's commands for one operation shape, per lane, in order (`schedule`).
pub(crate) type Schedule = Vec<(Lane, Vec<Cmd>)>;

/// Rank `me`'s commands for `op`, per lane, in order. `slot_bytes` is every rank's slot.
///
/// On a peer's lane, piece k of what this rank sends goes before piece k of what it receives:
/// an all-to-all in place receives block q into the very bytes it sends q, so each piece must
/// have left before its peer's lands there (both messages have the same length and cut).
pub(crate) fn schedule(
    op: &CeOp,
    me: Rank,
    n: usize,
    slot_bytes: usize,
) -> Result<Schedule, Error> {
    let list = copies(op.kind, op.count, op.elem, n, op.root)
        .ok_or_else(|| Error::Internal(format!("the copy engine got {} on {n} ranks", op.kind)))?;
    let mut lanes = local_lane(&list, me);
    for q in (0..n).filter(|&q| q != me) {
        let (out, inc) = between(&list, me, q);
        for lane in 0..CE_LANES {
            let of = |c: Option<&Transfer>| -> Vec<Piece> {
                c.map_or(Vec::new(), |c| {
                    pieces(c.bytes, slot_bytes)
                        .filter(|p| p.lane == lane)
                        .collect()
                })
            };
            let (sends, recvs) = (of(out), of(inc));
            if sends.is_empty() && recvs.is_empty() {
                continue;
            }
            let mut v = Vec::new();
            // Tell the peer we are in this operation (our earlier reads of its region are
            // over), then wait until it says the same of ours.
            if !recvs.is_empty() {
                v.push(Cmd::Write {
                    page: q,
                    word: CeFlags::ready(n, me, lane),
                    value: 1,
                });
            }
            if !sends.is_empty() {
                let ready = CeFlags::ready(n, q, lane);
                v.push(Cmd::Wait {
                    page: me,
                    word: ready,
                });
                v.push(Cmd::Write {
                    page: me,
                    word: ready,
                    value: 0,
                });
            }
            for i in 0..sends.len().max(recvs.len()) {
                if let (Some(p), Some(c)) = (sends.get(i), out) {
                    send_piece(&mut v, n, me, q, c.src, p);
                }
                if let (Some(p), Some(c)) = (recvs.get(i), inc) {
                    recv_piece(&mut v, n, me, q, c.dst, p);
                }
            }
            // Done only once the peer copied every piece out: the region is free again.
            let mut used: Vec<usize> = sends.iter().map(|p| p.slot).collect();
            used.sort_unstable();
            used.dedup();
            v.extend(used.into_iter().map(|slot| Cmd::Wait {
                page: me,
                word: CeFlags::free(n, q, slot),
            }));
            lanes.push((Lane::Peer { peer: q, lane }, v));
        }
    }
    Ok(lanes)
}

/// Rank `me`'s commands for `op` when its output lies in a symmetric window
/// (`plan::copies::zcopy_serves`), or when the ranks posted their outputs to each other before
/// a gather or scatter (`plan::copies::rendezvous_serves`): every copy between two ranks goes
/// once, straight from the sender's input to the receiver's output over the link, by the
/// sender's copy engine. `far[q]` is where this process maps rank q's output (read only for the
/// ranks this one copies to).
///
/// One lane per peer, one handshake before and one after. The receiver first tells the sender
/// it has entered the operation (`ready`: all it did before, reads of that output included, is
/// done), and leaves the operation only once the sender says the copy is complete (`full` of
/// slot 0); the sender waits for `ready`, copies, raises `full`. Each word goes back to 0 by its
/// waiter, as a CUDA graph's replay wants. An all-to-all in place has no order that works (each
/// rank's output takes a peer's block before its own left for that peer) and is refused.
pub(crate) fn zcopy_schedule(
    op: &CeOp,
    me: Rank,
    n: usize,
    far: &[u64],
    fold: (usize, Taper),
) -> Result<Schedule, Error> {
    if fold_kind(op.kind, n) {
        return fold_schedule(op, me, n, far, fold);
    }
    let served = zcopy_serves(op.kind, n) || rendezvous_serves(op.kind, n);
    if !served || (op.kind == CollKind::AllToAll && op.send == op.recv) {
        return Err(Error::Internal(format!(
            "the copy engine's zero-copy got {}{} on {n} ranks",
            op.kind,
            if op.send == op.recv { " in place" } else { "" }
        )));
    }
    if far.len() != n {
        return Err(Error::Internal(format!(
            "the copy engine's zero-copy got {} peer addresses for {n} ranks",
            far.len()
        )));
    }
    let list = copies(op.kind, op.count, op.elem, n, op.root)
        .ok_or_else(|| Error::Internal(format!("the copy engine got {} on {n} ranks", op.kind)))?;
    let mut lanes = local_lane(&list, me);
    for q in (0..n).filter(|&q| q != me) {
        let (out, inc) = between(&list, me, q);
        if out.is_none() && inc.is_none() {
            continue;
        }
        let mut v = Vec::new();
        if inc.is_some() {
            v.push(Cmd::Write {
                page: q,
                word: CeFlags::ready(n, me, 0),
                value: 1,
            });
        }
        if let Some(c) = out {
            let ready = CeFlags::ready(n, q, 0);
            v.push(Cmd::Wait {
                page: me,
                word: ready,
            });
            v.push(Cmd::Write {
                page: me,
                word: ready,
                value: 0,
            });
            v.push(Cmd::Copy {
                dst: Addr::Abs(far[q] + c.dst as u64),
                src: Addr::Send(c.src),
                bytes: c.bytes,
            });
            v.push(Cmd::Write {
                page: q,
                word: CeFlags::full(n, me, 0),
                value: 1,
            });
        }
        if inc.is_some() {
            let full = CeFlags::full(n, q, 0);
            v.push(Cmd::Wait {
                page: me,
                word: full,
            });
            v.push(Cmd::Write {
                page: me,
                word: full,
                value: 0,
            });
        }
        lanes.push((Lane::Peer { peer: q, lane: 0 }, v));
    }
    Ok(lanes)
}

/// A send or receive of a launch that the copy engines take after the posted-receive
/// rendezvous (`plan::copies::RecvPost`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum P2pCopy {
    /// `bytes` from this rank's `src` into `far`, where this process maps the output `peer`
    /// posted.
    Send {
        peer: Rank,
        src: u64,
        far: u64,
        bytes: usize,
    },
    /// A receive from `peer`, whose copy engines write it.
    Recv { peer: Rank },
}

/// The lane of a peer that carries this rank's sends to it; its receives from that peer take
/// the other ([`P2P_RECV_LANE`]). A pair's sends are matched to its receives in order in each
/// direction, but nothing orders one direction against the other across launches (a rank may
/// group a send with a receive that its peer makes in two launches, in either order), so the
/// two directions never wait on one stream; but one send and one receive with the same peer,
/// the whole launch, share this lane with the receive's `ready` raised first (see
/// [`p2p_schedule`]).
const P2P_SEND_LANE: usize = 0;
/// See [`P2P_SEND_LANE`].
const P2P_RECV_LANE: usize = 1;

/// Rank `me`'s commands for the sends and receives of a launch that the copy engines take
/// (`p2p`, in issue order), on `n` ranks: the zero-copy handshake of [`zcopy_schedule`] one
/// direction at a time. A receive raises `ready` in its sender's page (this rank entered it:
/// all it did before with that output is done), then waits for `full` in its own page and lowers
/// it; a send waits for its receiver's `ready` and lowers it, copies, and raises `full` in the
/// receiver's page (the write's fence puts the copy before it). A peer's sends keep their order
/// on its send lane and its receives on its receive lane.
///
/// A launch of exactly one send and one receive with the same peer (a sendrecv, the usual
/// exchange) takes one lane: the receive's `ready` first, then the send, then the receive's wait
/// for `full`. Its send still waits for nothing but its receiver's `ready`, and its receive is
/// open from the lane's first command, so neither direction waits on anything the other's
/// launches on the peer could be waiting for, however the peer splits them; the
/// posted-receive model checks it (`posted_receives_hold_under_any_schedule`). One lane alone is
/// what lets the launch run it on the caller's stream (`CopyEngine::enqueue`): no fork, no join,
/// about 3 us a launch on 2 x H200 (docs/PERFORMANCE.md section 37).
pub(crate) fn p2p_schedule(me: Rank, n: usize, p2p: &[P2pCopy]) -> Schedule {
    let mut lanes: Schedule = Vec::new();
    for c in p2p {
        let (lane, cmds) = match *c {
            P2pCopy::Send {
                peer,
                src,
                far,
                bytes,
            } => {
                let ready = CeFlags::ready(n, peer, 0);
                let cmds = [
                    Cmd::Wait {
                        page: me,
                        word: ready,
                    },
                    Cmd::Write {
                        page: me,
                        word: ready,
                        value: 0,
                    },
                    Cmd::Copy {
                        dst: Addr::Abs(far),
                        src: Addr::Abs(src),
                        bytes,
                    },
                    Cmd::Write {
                        page: peer,
                        word: CeFlags::full(n, me, 0),
                        value: 1,
                    },
                ];
                let lane = Lane::Peer {
                    peer,
                    lane: P2P_SEND_LANE,
                };
                (lane, cmds.to_vec())
            }
            P2pCopy::Recv { peer } => {
                let full = CeFlags::full(n, peer, 0);
                let cmds = [
                    Cmd::Write {
                        page: peer,
                        word: CeFlags::ready(n, me, 0),
                        value: 1,
                    },
                    Cmd::Wait {
                        page: me,
                        word: full,
                    },
                    Cmd::Write {
                        page: me,
                        word: full,
                        value: 0,
                    },
                ];
                let lane = Lane::Peer {
                    peer,
                    lane: P2P_RECV_LANE,
                };
                (lane, cmds.to_vec())
            }
        };
        match lanes.iter_mut().find(|(l, _)| *l == lane) {
            Some((_, v)) => v.extend(cmds),
            None => lanes.push((lane, cmds)),
        }
    }
    // One send and one receive with the same peer, in either issue order: one lane, the
    // receive's `ready` (its first command) first.
    let peer_of = |c: &P2pCopy| match *c {
        P2pCopy::Send { peer, .. } | P2pCopy::Recv { peer } => peer,
    };
    let one_each = matches!(
        p2p,
        [P2pCopy::Send { .. }, P2pCopy::Recv { .. }] | [P2pCopy::Recv { .. }, P2pCopy::Send { .. }]
    );
    if one_each && peer_of(&p2p[0]) == peer_of(&p2p[1]) {
        let peer = peer_of(&p2p[0]);
        let of = |l: usize| {
            lanes
                .iter()
                .find(|(lane, _)| *lane == Lane::Peer { peer, lane: l })
                .map(|(_, cmds)| cmds.as_slice())
                .unwrap_or_default()
        };
        let (send, recv) = (of(P2P_SEND_LANE), of(P2P_RECV_LANE));
        let merged = [&recv[..1], send, &recv[1..]].concat();
        return vec![(
            Lane::Peer {
                peer,
                lane: P2P_SEND_LANE,
            },
            merged,
        )];
    }
    lanes
}

/// Rank `me`'s commands for a copy-and-fold reduction into posted outputs
/// (`plan::copies::fold_list`, 2 ranks, out of place): `far[q]` is where this process maps rank
/// q's output; `(blocks, taper)`: the fold kernel's blocks and how the copy is cut into pieces
/// (every rank's alike). A rank may fold (its output takes the peer's copy), send (its input
/// lands in the peer's output), or both (all-reduce, reduce-scatter; a reduce's root only folds,
/// its peer only sends).
///
/// On each lane with pieces: a rank that folds tells its peer it entered the operation (`ready`
/// of the lane: everything before, its reads of its output included, is done); a rank that sends
/// waits until its peer says so, then for each of the lane's pieces copies it from its input
/// straight into the peer's output and raises the lane's piece word in the peer's page to the
/// lane's count of pieces so far (the write's default fence puts the copy before it). On the
/// caller's stream of a rank that folds, concurrently: the fold kernel, which reduces each piece
/// once its lane's word says it landed, then the piece words set back to 0 (a graph's replay
/// writes the same values again). The peer's next writes into this output wait for this rank's
/// next `ready`, which its stream gives only after the fold and the reset.
fn fold_schedule(
    op: &CeOp,
    me: Rank,
    n: usize,
    far: &[u64],
    (blocks, taper): (usize, Taper),
) -> Result<Schedule, Error> {
    if far.len() != n || blocks == 0 || n != 2 || me >= n {
        return Err(Error::Internal(format!(
            "the copy engine's fold got {} peer addresses for {n} ranks and {blocks} blocks",
            far.len()
        )));
    }
    let list = fold_list(op.kind, op.count, op.elem, n, op.root).ok_or_else(|| {
        Error::Internal(format!(
            "the copy engine's fold got {} on {n} ranks",
            op.kind
        ))
    })?;
    let q = 1 - me;
    // What lands here (this rank folds), and what this rank sends (its peer folds).
    let mine = list
        .iter()
        .find(|f| f.copy.to == me)
        .filter(|f| f.copy.bytes > 0);
    let out = list
        .iter()
        .find(|f| f.copy.from == me)
        .filter(|f| f.copy.bytes > 0);
    // In place the landing area is this rank's own operand (reduce-scatter: its block of the
    // input, at `mine.local`).
    if mine.is_some_and(|m| op.recv == op.send.wrapping_add(m.local as u64)) {
        return Err(Error::Internal(format!(
            "the copy engine's fold got {} in place",
            op.kind
        )));
    }
    // The pieces of each copy, cut once; only lanes with pieces take part: a fold waits for a
    // piece of each, and so a rank that folds leaves the operation only after its peer took
    // every `ready` it gave (a second `ready` written onto one not yet taken would be lost).
    let cut = |f: Option<&Fold>| -> Vec<FoldPiece> {
        f.map_or(Vec::new(), |f| fold_pieces(f.copy.bytes, taper).collect())
    };
    let (landing, sent) = (cut(mine), cut(out));
    let used = |p: &[FoldPiece]| p.iter().map(|p| p.lane + 1).max().unwrap_or(0);
    let (lanes_in, lanes_out) = (used(&landing), used(&sent));
    let mut lanes: Schedule = Vec::new();
    for lane in 0..lanes_in.max(lanes_out) {
        let mut v = Vec::new();
        if lane < lanes_in {
            v.push(Cmd::Write {
                page: q,
                word: CeFlags::ready(n, me, lane),
                value: 1,
            });
        }
        if let Some(out) = out.filter(|_| lane < lanes_out).map(|f| f.copy) {
            v.push(Cmd::Wait {
                page: me,
                word: CeFlags::ready(n, q, lane),
            });
            v.push(Cmd::Write {
                page: me,
                word: CeFlags::ready(n, q, lane),
                value: 0,
            });
            for p in sent.iter().filter(|p| p.lane == lane) {
                v.push(Cmd::Copy {
                    dst: Addr::Abs(far[q] + (out.dst + p.at) as u64),
                    src: Addr::Send(out.src + p.at),
                    bytes: p.bytes,
                });
                v.push(Cmd::Write {
                    page: q,
                    word: CeFlags::piece(n, me, lane),
                    value: p.count,
                });
            }
        }
        lanes.push((Lane::Peer { peer: q, lane }, v));
    }
    if let Some(mine) = mine {
        let mut local = vec![Cmd::Fold {
            from: q,
            src: mine.local,
            bytes: mine.copy.bytes,
            taper,
            blocks,
        }];
        local.extend((0..lanes_in).map(|lane| Cmd::Write {
            page: me,
            word: CeFlags::piece(n, q, lane),
            value: 0,
        }));
        lanes.push((Lane::Local, local));
    }
    Ok(lanes)
}

/// A lane's run of consecutive stream memory operations, issued as one
/// `cuStreamBatchMemOp` (the driver runs a batch's operations in order, as it would the single
/// calls). A wait holds until its word is 1; a write's default flags put a system-wide fence
/// before its store, so the copy before it has landed when the peer sees the word. Held inline,
/// so that an enqueue allocates nothing: a run longer than [`MemOps::MAX`] (a receive lane's
/// handshakes for many receives from one peer in a launch) goes out as several batches, in
/// order.
struct MemOps {
    ops: [sys::CUstreamBatchMemOpParams; MemOps::MAX],
    len: usize,
}

// Within the driver's limit of a batch, checked when built.
const _: () = assert!(MemOps::MAX <= 255);

impl MemOps {
    /// The most operations one batch holds here (the driver takes up to 255): a collective's
    /// runs are one to three long.
    const MAX: usize = 16;

    fn new() -> MemOps {
        MemOps {
            // SAFETY: an all-zero parameter block is a valid value of the union.
            ops: unsafe { std::mem::zeroed() },
            len: 0,
        }
    }

    /// Whether the next operation must wait for an `issue`.
    fn full(&self) -> bool {
        self.len == Self::MAX
    }

    fn push(&mut self, p: sys::CUstreamBatchMemOpParams) {
        debug_assert!(!self.full());
        self.ops[self.len] = p;
        self.len += 1;
    }

    fn wait(&mut self, addr: u64) {
        // SAFETY: an all-zero parameter block is a valid start for any of the union's members.
        let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
        p.waitValue.operation = sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32;
        p.waitValue.address = addr;
        p.waitValue.__bindgen_anon_1.value = 1;
        p.waitValue.flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32;
        self.push(p);
    }

    fn write(&mut self, addr: u64, value: u32) {
        // SAFETY: as in `wait`.
        let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
        p.writeValue.operation = sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32;
        p.writeValue.address = addr;
        p.writeValue.__bindgen_anon_1.value = value;
        p.writeValue.flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        self.push(p);
    }

    /// What is pending, in order: the next batch.
    fn pending(&mut self) -> &mut [sys::CUstreamBatchMemOpParams] {
        &mut self.ops[..self.len]
    }

    /// Enqueues what is pending on `st` as one batch, if anything is, and empties it.
    ///
    /// # Safety
    /// `st` is a live stream of the bound context; every address is a word mapped for it.
    unsafe fn issue(&mut self, st: sys::CUstream) -> Result<(), Error> {
        if self.len > 0 {
            let batch = self.pending();
            cu_ok(
                "cuStreamBatchMemOp",
                sys::cuStreamBatchMemOp_v2(st, batch.len() as u32, batch.as_mut_ptr(), 0),
            )?;
            self.len = 0;
        }
        Ok(())
    }
}

/// A rank's streams for the copy engine and the events that order them after the caller's
/// stream (fork) and it after them (joins).
struct Streams {
    /// A stream per peer and lane, at `peer * CE_LANES + lane` (null for this rank itself).
    streams: Vec<sys::CUstream>,
    fork: sys::CUevent,
    joins: Vec<sys::CUevent>,
    /// Per lane, recorded just before its first copy (its opening handshake done): this rank's
    /// own copy on the caller's stream waits for it (see `enqueue_with`).
    opened: Vec<sys::CUevent>,
}

/// One rank's copy engine.
pub(crate) struct CopyEngine {
    gpu: Gpu,
    rank: Rank,
    nranks: usize,
    slot_bytes: usize,
    streams: Streams,
    fabric: CeFabric,
    /// Whether a launch's lone lane may run on the caller's stream (`lone_lane_on_caller`): only
    /// where no two ranks of one process share a GPU (`Fabric::ranks_post`). Ranks sharing a GPU in one process
    /// may find their callers' streams in one hardware queue, where one rank's wait for the other
    /// would stand in front of the other's commands for good (the staged copies' GPU test of
    /// ranks on one GPU hung so); the lanes' own streams, made early, get queues of their own.
    lone_on_caller: bool,
}

// SAFETY: stream and event handles are used through the thread-safe driver with the context
// bound; nothing changes after creation, and the communicator enqueues one launch at a time.
unsafe impl Send for CopyEngine {}
unsafe impl Sync for CopyEngine {}

impl CopyEngine {
    /// The streams are made here, at the communicator's creation, not at the first operation:
    /// the driver deals streams out to the GPU's hardware queues in turn
    /// (`CUDA_DEVICE_MAX_CONNECTIONS` of them), and a stream stalled in a wait holds up every
    /// other stream of its queue. Made together, early, this rank's lanes get queues of their
    /// own as far as there are queues (see docs/ENV.md on `CUDA_DEVICE_MAX_CONNECTIONS`).
    /// `slot_bytes` 0: no staged copies (`FERROCCL_GPU_COPY_ENGINE_BYTES=0`), only the copies
    /// between symmetric windows. `lone_on_caller`: no two ranks share a GPU in one process
    /// (`Fabric::ranks_post`; see the field).
    pub fn new(
        gpu: &Gpu,
        rank: Rank,
        nranks: usize,
        slot_bytes: usize,
        fabric: CeFabric,
        lone_on_caller: bool,
    ) -> Result<CopyEngine, Error> {
        if slot_bytes * CE_SLOTS > fabric.region_bytes {
            return Err(Error::Internal(format!(
                "copy-engine slots of {slot_bytes} bytes do not fit a region of {}",
                fabric.region_bytes
            )));
        }
        gpu.bind()?;
        let streams = Streams::new(rank, nranks)?;
        Ok(CopyEngine {
            gpu: gpu.clone(),
            rank,
            nranks,
            slot_bytes,
            streams,
            fabric,
            lone_on_caller,
        })
    }

    /// This rank's commands for `op` (every call of its shape enqueues the same: the launch
    /// path keeps them with the shape).
    pub fn schedule(&self, op: &CeOp) -> Result<Schedule, Error> {
        if self.slot_bytes == 0 {
            return Err(Error::Internal(
                "the copy engine's staging is off (FERROCCL_GPU_COPY_ENGINE_BYTES=0)".into(),
            ));
        }
        schedule(op, self.rank, self.nranks, self.slot_bytes)
    }

    /// This rank's commands for `op` between symmetric windows (`zcopy_schedule`; the launch
    /// path keeps them with the buffers' addresses).
    /// `fold`: the fold kernel's blocks and the pieces' taper, for the reductions (the tuner's
    /// channels and `tune::fold_taper`).
    pub fn zcopy_schedule(
        &self,
        op: &CeOp,
        far: &[u64],
        fold: (usize, Taper),
    ) -> Result<Schedule, Error> {
        zcopy_schedule(op, self.rank, self.nranks, far, fold)
    }

    fn addr(&self, a: Addr, op: &CeOp) -> u64 {
        match a {
            Addr::Send(o) => op.send + o as u64,
            Addr::Recv(o) => op.recv + o as u64,
            Addr::Stage { owner, from, slot } => {
                let region = if from < owner { from } else { from - 1 };
                self.fabric.stage[owner]
                    + (region * self.fabric.region_bytes + slot * self.slot_bytes) as u64
            }
            Addr::Abs(a) => a,
        }
    }

    fn word(&self, page: Rank, word: usize) -> u64 {
        match CeFlags::piece_at(self.nranks, word) {
            Some(at) => self.fabric.fold[page] + at as u64,
            None => self.fabric.pages[page] + 4 * word as u64,
        }
    }

    /// Enqueues `lanes` (`schedule` of `op`) on `op`'s buffers after everything on `user`, and
    /// makes `user` wait for it. `fold` launches the fold kernel a `Cmd::Fold` asks for on the
    /// stream given (the launch path owns the kernels).
    pub fn enqueue(
        &self,
        lanes: &Schedule,
        op: &CeOp,
        user: sys::CUstream,
        fold: &dyn Fn(FoldLaunch, sys::CUstream) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.enqueue_with(lanes, op, user, fold, None)
    }

    /// `enqueue`, with `beside` run after the lanes' commands and before `user` waits for them:
    /// what it enqueues on `user` runs alongside the lanes (the kernels' part of a launch whose
    /// sends and receives the copy engines share, which must not wait for the copies nor the
    /// copies for it: the peer may have put the matching halves in two launches either way).
    /// Its error is returned once `user` waits for the lanes all the same.
    pub fn enqueue_beside(
        &self,
        lanes: &Schedule,
        op: &CeOp,
        user: sys::CUstream,
        fold: &dyn Fn(FoldLaunch, sys::CUstream) -> Result<(), Error>,
        beside: &mut dyn FnMut() -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.enqueue_with(lanes, op, user, fold, Some(beside))
    }

    fn enqueue_with(
        &self,
        lanes: &Schedule,
        op: &CeOp,
        user: sys::CUstream,
        fold: &dyn Fn(FoldLaunch, sys::CUstream) -> Result<(), Error>,
        beside: Option<&mut dyn FnMut() -> Result<(), Error>>,
    ) -> Result<(), Error> {
        if lanes.is_empty() {
            return beside.map_or(Ok(()), |b| b());
        }
        self.gpu.bind()?;
        let s = &self.streams;
        // This rank's own copy (an out-of-place all-gather's or all-to-all's own block, a
        // root's) waits until every lane that copies has passed its opening handshake: on 2 x
        // H200 a local copy running through the handshakes' memory operations added about 13 us
        // to them whatever its size (docs/PERFORMANCE.md section 37), where beside the peer copy
        // alone it added nothing. So the peers' lanes go first, then the caller's stream's.
        let local_copies = lanes.iter().any(|(l, cmds)| {
            *l == Lane::Local
                && cmds.iter().any(|c| {
                    matches!(*c, Cmd::Copy { dst, src, .. } if self.addr(dst, op) != self.addr(src, op))
                })
        });
        let copies = |k: usize| lanes[k].1.iter().any(|c| matches!(c, Cmd::Copy { .. }));
        let kept = beside.is_some() || !self.lone_on_caller;
        let alone = lone_lane_on_caller(lanes, kept, local_copies);
        // Per lane, its own stream's index, or None where it runs on the caller's stream.
        let forked = |k: usize| lane_index(lanes[k].0).filter(|_| !alone);
        let stream_of = |k: usize| forked(k).map_or(user, |i| s.streams[i]);
        let order = (0..lanes.len())
            .filter(|&k| forked(k).is_some())
            .chain((0..lanes.len()).filter(|&k| forked(k).is_none()));
        // SAFETY: our streams and events, the caller's live stream; every address is the
        // caller's buffer (its contract), a staging slot or a flag word mapped for this GPU.
        unsafe {
            if (0..lanes.len()).any(|k| forked(k).is_some()) {
                cu_ok("cuEventRecord", sys::cuEventRecord(s.fork, user))?;
            }
            for i in (0..lanes.len()).filter_map(forked) {
                cu_ok(
                    "cuStreamWaitEvent",
                    sys::cuStreamWaitEvent(s.streams[i], s.fork, 0),
                )?;
            }
            for k in order {
                let cmds = &lanes[k].1;
                let st = stream_of(k);
                let mut copied = false;
                // A lane's consecutive waits and writes go to the stream as one batch: one
                // command for the GPU's front end to fetch and run instead of one per word.
                let mut memops = MemOps::new();
                for c in cmds {
                    if memops.full() {
                        memops.issue(st)?;
                    }
                    match *c {
                        Cmd::Wait { page, word } => memops.wait(self.word(page, word)),
                        Cmd::Write { page, word, value } => {
                            memops.write(self.word(page, word), value)
                        }
                        Cmd::Copy { dst, src, bytes } => {
                            memops.issue(st)?;
                            let (d, sr) = (self.addr(dst, op), self.addr(src, op));
                            if !copied && local_copies {
                                copied = true;
                                match forked(k) {
                                    Some(i) => {
                                        cu_ok("cuEventRecord", sys::cuEventRecord(s.opened[i], st))?
                                    }
                                    // Every forked lane that copies was enqueued above and has
                                    // recorded its event.
                                    None if d != sr => {
                                        for i in (0..lanes.len())
                                            .filter(|&j| copies(j))
                                            .filter_map(forked)
                                        {
                                            cu_ok(
                                                "cuStreamWaitEvent",
                                                sys::cuStreamWaitEvent(st, s.opened[i], 0),
                                            )?;
                                        }
                                    }
                                    None => {}
                                }
                            }
                            if d != sr {
                                cu_ok(
                                    "cuMemcpyDtoDAsync",
                                    sys::cuMemcpyDtoDAsync_v2(d, sr, bytes, st),
                                )?;
                            }
                        }
                        Cmd::Fold {
                            from,
                            src,
                            bytes,
                            taper,
                            blocks,
                        } => {
                            memops.issue(st)?;
                            fold(
                                FoldLaunch {
                                    words: std::array::from_fn(|lane| {
                                        self.word(
                                            self.rank,
                                            CeFlags::piece(self.nranks, from, lane),
                                        )
                                    }),
                                    mine: op.send + src as u64,
                                    out: op.recv,
                                    bytes,
                                    taper,
                                    blocks,
                                },
                                st,
                            )?
                        }
                    }
                }
                memops.issue(st)?;
            }
            let besides = beside.map_or(Ok(()), |b| b());
            for i in (0..lanes.len()).filter_map(forked) {
                cu_ok(
                    "cuEventRecord",
                    sys::cuEventRecord(s.joins[i], s.streams[i]),
                )?;
                cu_ok(
                    "cuStreamWaitEvent",
                    sys::cuStreamWaitEvent(user, s.joins[i], 0),
                )?;
            }
            besides
        }
    }

    /// Whether every stream of the engine has nothing left to run.
    fn idle(&self) -> bool {
        if self.gpu.bind().is_err() {
            return false;
        }
        // SAFETY: our live streams.
        self.streams
            .streams
            .iter()
            .filter(|st| !st.is_null())
            .all(|&st| unsafe { sys::cuStreamQuery(st) } == sys::CUresult::CUDA_SUCCESS)
    }

    /// Frees streams stalled on this rank's words (abort, a dead peer): stores 1 into every
    /// word of this rank's page, again and again, until the streams have drained or `limit`
    /// has passed (a lane lowers a word right after its wait, so one store may free one wait
    /// only). What the freed copies move is garbage: the communicator is failed by then.
    /// Returns whether the streams drained.
    pub fn release(&self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        loop {
            for i in 0..CeFlags::words(self.nranks) {
                self.fabric.mine.set(i, 1);
            }
            if self.idle() {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Whether a launch's peer lane runs on the caller's stream rather than a stream of its own (this
/// rank's own lane always does): where it is the launch's only lane, unless `kept` (something is
/// enqueued beside it, or two ranks of one process share a GPU: `CopyEngine::lone_on_caller`), which spares the
/// fork and the join (about 3 us a launch in CUDA graphs on 2 x H200, docs/PERFORMANCE.md section 37).
/// Never a peer lane beside another lane: two lanes of a launch may wait on each other's peers in
/// either order, and a lane's wait on the caller's stream would hold up the other lane's
/// commands wherever the driver put both streams in one hardware queue; nor beside the kernels'
/// part of a launch, which must run alongside the copies, not after their waits.
///
/// `local_copies`: whether this rank's own lane copies anything (in place its copy is skipped,
/// and its lane counts as none).
fn lone_lane_on_caller(lanes: &Schedule, kept: bool, local_copies: bool) -> bool {
    let peers = lanes.iter().filter(|(l, _)| *l != Lane::Local).count();
    peers == 1 && !local_copies && !kept
}

/// The stream of a peer's lane (None: the caller's stream).
fn lane_index(lane: Lane) -> Option<usize> {
    match lane {
        Lane::Peer { peer, lane } => Some(peer * CE_LANES + lane),
        Lane::Local => None,
    }
}

impl Streams {
    /// A stream and a join event per peer and lane (none for this rank itself: its local copy
    /// runs on the caller's stream), and the fork event, for rank `me` of `n`. The context must
    /// be bound.
    fn new(me: Rank, n: usize) -> Result<Streams, Error> {
        let count = n * CE_LANES;
        let mut s = Streams {
            streams: vec![std::ptr::null_mut(); count],
            fork: std::ptr::null_mut(),
            joins: vec![std::ptr::null_mut(); count],
            opened: vec![std::ptr::null_mut(); count],
        };
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: out pointers for new objects of the bound context; on error the ones made so
        // far are released when `s` drops.
        cu_ok("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut s.fork, flags)
        })?;
        for q in (0..n).filter(|&q| q != me) {
            for lane in 0..CE_LANES {
                let i = q * CE_LANES + lane;
                cu_ok("cuStreamCreate", unsafe {
                    sys::cuStreamCreate(
                        &mut s.streams[i],
                        sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    )
                })?;
                cu_ok("cuEventCreate", unsafe {
                    sys::cuEventCreate(&mut s.joins[i], flags)
                })?;
                cu_ok("cuEventCreate", unsafe {
                    sys::cuEventCreate(&mut s.opened[i], flags)
                })?;
            }
        }
        Ok(s)
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        // SAFETY: our objects; destroying a stream with work left lets that work finish first.
        unsafe {
            for &st in self.streams.iter().filter(|st| !st.is_null()) {
                sys::cuStreamDestroy_v2(st);
            }
            for &ev in self
                .joins
                .iter()
                .chain(&self.opened)
                .chain(std::iter::once(&self.fork))
            {
                if !ev.is_null() {
                    sys::cuEventDestroy_v2(ev);
                }
            }
        }
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        // Streams still waiting on our words would read them after the page is gone: free them
        // first; if they will not drain, keep the pages mapped (leaked) rather than fault.
        let drained = self.idle() || self.release(Duration::from_secs(2));
        // The streams are destroyed as the fields drop, with this context bound.
        let _ = self.gpu.bind();
        if !drained {
            tracing::warn!("copy-engine streams did not drain: leaving its flag pages mapped");
            self.fabric.mine.keep_mapped();
            self.fabric.imported.iter().for_each(HostPage::keep_mapped);
        }
    }
}

#[cfg(test)]
mod tests {
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

    /// A lane's memory operations reach the driver as it would take the single calls: in order,
    /// a wait for 1 with the equality test, every write behind the default (system-wide) fence
    /// that puts a copy before the word announcing it (the driver refuses writes without it in
    /// a batch on 2 x H200), and a batch full at `MemOps::MAX`, within the driver's 255.
    #[test]
    fn memops_keep_order_fences_and_the_batch_limit() {
        let mut m = MemOps::new();
        assert!(m.pending().is_empty() && !m.full());
        m.wait(0x1000);
        m.write(0x2000, 7);
        for i in 0..(MemOps::MAX - 2) as u32 {
            assert!(!m.full());
            m.write(0x3000 + 4 * u64::from(i), i);
        }
        assert!(m.full());
        let batch = m.pending();
        assert_eq!(batch.len(), MemOps::MAX);
        // SAFETY: each operation is read through the member it was built as.
        unsafe {
            let w = batch[0].waitValue;
            assert_eq!(
                w.operation,
                sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32
            );
            assert_eq!((w.address, w.__bindgen_anon_1.value), (0x1000, 1));
            assert_eq!(
                w.flags,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32
            );
            for (k, p) in batch[1..].iter().enumerate() {
                let x = p.writeValue;
                assert_eq!(
                    x.operation,
                    sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32
                );
                assert_eq!(
                    x.flags,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32
                );
                let want = if k == 0 {
                    (0x2000, 7)
                } else {
                    (0x3000 + 4 * (k as u64 - 1), k as u32 - 1)
                };
                assert_eq!((x.address, x.__bindgen_anon_1.value), want);
            }
        }
    }

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
                        return Err(format!("rank {r} stores op {k} into rank {owner}'s staging while it is at op {}", at_op[owner]));
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
                        return Err(format!("rank {r}'s send lane to {to} ended with a piece still in slot {left:?}"));
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
                    let want =
                        fold_of(&ops[k], to).ok_or(format!("rank {r} lands op {k} on {to}"))?;
                    if want.copy.from != r
                        || o != want.copy.src + at
                        || at + bytes > want.copy.bytes
                    {
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
        let is_ready =
            |w: usize| (0..2).any(|q| (0..CE_LANES).any(|l| CeFlags::ready(2, q, l) == w));
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
                        .filter(
                            |c| !matches!(*c, Cmd::Write { word, value: 0, .. } if is_piece(word)),
                        )
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
            assert!(CeFlags::words(n) * 4 <= crate::cuda::hostpage::PAGE_BYTES);
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
                while lanes[r].iter().all(|(_, c, pc)| *pc == c.len()) && at[r] < launches[r].len()
                {
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
                            return Err(format!(
                                "rank {r} opened two receives from {page} at once"
                            ));
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
}
