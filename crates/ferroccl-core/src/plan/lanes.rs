//! The copy engine's lanes as data: what each stream of a rank runs for one operation, command
//! by command ([`Cmd`]), and the flag words those commands wait on and store ([`CeFlags`]).
//!
//! Every message between two ranks is cut into pieces (`copies::pieces`) that take turns in the
//! receiver's staging slots (the peer engine's region for that sender, cut into `CE_SLOTS`
//! slots). Per piece, on the sender's lane stream: wait until the slot is free, mark it taken,
//! copy the piece into it over the link, raise the slot's `full` word at the receiver. On the
//! receiver's lane stream: wait for `full`, lower it, copy the piece out to the output, raise the
//! slot's `free` word at the sender. Every word goes back to where it started by the operation's
//! end, so the same memory operations replayed by a CUDA graph find the same state: no counter to
//! carry from call to call.
//!
//! Staging is shared with the peer engine, so two handshakes per operation and pair guard the
//! hand-over: the receiver's lanes first tell the sender it has entered the operation (`ready`:
//! all it did before, its own peer-engine reads of this region included, is done), and the
//! sender's lanes end by waiting until every slot they used is free again (the receiver has
//! copied out every piece), so that whatever the sender runs next may write the region.
//!
//! The same holds for the copies straight between symmetric windows ([`zcopy_schedule`]), the
//! copy-and-fold (`fold_schedule`) and posted sends and receives ([`p2p_schedule`]). The CUDA
//! backend issues these commands as stream memory operations and copies
//! (`backend/cuda/copy_engine.rs`); the tests here run every rank's lanes against a model of the
//! pages under any interleaving the streams could take, and check the handshakes.

use super::copies::{
    copies, fold_cuts, fold_kind, fold_list, pieces, rendezvous_serves, zcopy_serves, Fold, Piece,
    Taper, Transfer, CE_LANES, CE_SLOTS, FOLD_MAX_PIECES,
};
use crate::types::{CollKind, Rank};
use crate::Error;

/// Where the words are in a rank's flag page, for a communicator of `n` ranks.
pub struct CeFlags;

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
pub struct CeOp {
    /// The collective.
    pub kind: CollKind,
    /// NCCL's count (elements per rank's block, as NCCL counts it for `kind`).
    pub count: usize,
    /// Bytes of one element.
    pub elem: usize,
    /// The root of a rooted kind.
    pub root: Rank,
    /// This rank's input (a device address, as a cache key; the commands name offsets).
    pub send: u64,
    /// This rank's output.
    pub recv: u64,
}

/// One stream command of a lane, as data: what `enqueue` issues, and what the host tests check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmd {
    /// Wait until word `word` of rank `page`'s page is 1.
    Wait {
        /// The rank whose page holds the word.
        page: Rank,
        /// The word's index there (`CeFlags`).
        word: usize,
    },
    /// Store `value` into word `word` of rank `page`'s page.
    Write {
        /// The rank whose page holds the word.
        page: Rank,
        /// The word's index there (`CeFlags`).
        word: usize,
        /// What is stored.
        value: u32,
    },
    /// Copy `bytes` from `src` to `dst`.
    Copy {
        /// Where the bytes land.
        dst: Addr,
        /// Where they are read.
        src: Addr,
        /// How many.
        bytes: usize,
    },
    /// The fold kernel on `blocks` blocks: output = op(this rank's input at `src`, the output),
    /// `bytes` of each, in the pieces of `fold_pieces` (cut by `taper`): piece k once word
    /// `CeFlags::piece(from, lane)` of this rank's page reaches its `count`.
    Fold {
        /// The sender whose copy lands in the output.
        from: Rank,
        /// This rank's own operand: its offset in the input.
        src: usize,
        /// Bytes folded.
        bytes: usize,
        /// How the pieces are cut.
        taper: Taper,
        /// The fold kernel's blocks.
        blocks: usize,
    },
}

/// One piece of a copy-and-fold: its bytes in the copy, the lane that copies it, and the value
/// that lane's piece word holds once it landed (the lane's pieces so far). The sender's lanes
/// and the receiver's fold kernel cut alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FoldPiece {
    /// Its first byte in the copy.
    pub at: usize,
    /// Its length.
    pub bytes: usize,
    /// The lane that copies it.
    pub lane: usize,
    /// The lane's piece word once it landed.
    pub count: u32,
}

/// The pieces of a copy-and-fold of `bytes` as `taper` cuts them (`copies::fold_cuts`): piece k
/// on lane k % CE_LANES, the (k / CE_LANES + 1)-th of its lane (the fold kernel takes their ends
/// and the same rule).
pub fn fold_pieces(bytes: usize, taper: Taper) -> impl Iterator<Item = FoldPiece> {
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
pub fn fold_ends(
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

/// An address a command names: a user buffer at an offset, or a staging slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Addr {
    /// This rank's input at a byte offset.
    Send(usize),
    /// This rank's output at a byte offset.
    Recv(usize),
    /// Slot `slot` of sender `from`'s region in `owner`'s staging.
    Stage {
        /// The receiver whose staging holds the slot.
        owner: Rank,
        /// The sender whose region it is.
        from: Rank,
        /// The slot in that region.
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
pub enum Lane {
    /// Lane `lane` of the streams toward `peer`.
    Peer {
        /// The peer.
        peer: Rank,
        /// Which of its `CE_LANES` lanes.
        lane: usize,
    },
    /// This rank's own copy, on the caller's stream.
    Local,
}

/// Waits until word `word` of `page`'s page (this rank's own) is 1, then lowers it: a handshake
/// taken, the word back where it started.
fn take(v: &mut Vec<Cmd>, page: Rank, word: usize) {
    v.push(Cmd::Wait { page, word });
    v.push(Cmd::Write {
        page,
        word,
        value: 0,
    });
}

/// One side's turn with a slot (or a peer's output), the same on both sides: take this rank's
/// word `word`, make `copy`, then raise word `theirs` in `peer`'s page. The sender takes its
/// `free` (or `ready`) word and raises the receiver's `full`; the receiver the other way round.
fn slot_turn(v: &mut Vec<Cmd>, me: Rank, word: usize, copy: Cmd, peer: Rank, theirs: usize) {
    take(v, me, word);
    v.push(copy);
    v.push(Cmd::Write {
        page: peer,
        word: theirs,
        value: 1,
    });
}

/// The commands that move piece `p` of the message from `me` to `r` (src: its offset in this
/// rank's input), on the sender's side.
fn send_piece(v: &mut Vec<Cmd>, n: usize, me: Rank, r: Rank, src: usize, p: &Piece) {
    let copy = Cmd::Copy {
        dst: Addr::Stage {
            owner: r,
            from: me,
            slot: p.slot,
        },
        src: Addr::Send(src + p.at),
        bytes: p.bytes,
    };
    let (free, full) = (CeFlags::free(n, r, p.slot), CeFlags::full(n, me, p.slot));
    slot_turn(v, me, free, copy, r, full);
}

/// The commands that take piece `p` of the message from `s` to `me` out of the staging to
/// `dst` in this rank's output.
fn recv_piece(v: &mut Vec<Cmd>, n: usize, me: Rank, s: Rank, dst: usize, p: &Piece) {
    let copy = Cmd::Copy {
        dst: Addr::Recv(dst + p.at),
        src: Addr::Stage {
            owner: me,
            from: s,
            slot: p.slot,
        },
        bytes: p.bytes,
    };
    let (full, free) = (CeFlags::full(n, s, p.slot), CeFlags::free(n, me, p.slot));
    slot_turn(v, me, full, copy, s, free);
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
pub type Schedule = Vec<(Lane, Vec<Cmd>)>;

/// Rank `me`'s commands for `op`, per lane, in order. `slot_bytes` is every rank's slot.
///
/// On a peer's lane, piece k of what this rank sends goes before piece k of what it receives:
/// an all-to-all in place receives block q into the very bytes it sends q, so each piece must
/// have left before its peer's lands there (both messages have the same length and cut).
pub fn schedule(op: &CeOp, me: Rank, n: usize, slot_bytes: usize) -> Result<Schedule, Error> {
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
                take(&mut v, me, ready);
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
pub fn zcopy_schedule(
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
            let copy = Cmd::Copy {
                dst: Addr::Abs(far[q] + c.dst as u64),
                src: Addr::Send(c.src),
                bytes: c.bytes,
            };
            let (ready, full) = (CeFlags::ready(n, q, 0), CeFlags::full(n, me, 0));
            slot_turn(&mut v, me, ready, copy, q, full);
        }
        if inc.is_some() {
            let full = CeFlags::full(n, q, 0);
            take(&mut v, me, full);
        }
        lanes.push((Lane::Peer { peer: q, lane: 0 }, v));
    }
    Ok(lanes)
}

/// A send or receive of a launch that the copy engines take after the posted-receive
/// rendezvous (`plan::copies::RecvPost`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum P2pCopy {
    /// `bytes` from this rank's `src` into `far`, where this process maps the output `peer`
    /// posted.
    Send {
        /// The receiver.
        peer: Rank,
        /// The input, a device address of this process.
        src: u64,
        /// The receiver's posted output, as this process maps it.
        far: u64,
        /// How many bytes.
        bytes: usize,
    },
    /// A receive from `peer`, whose copy engines write it.
    Recv {
        /// The sender.
        peer: Rank,
    },
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
pub fn p2p_schedule(me: Rank, n: usize, p2p: &[P2pCopy]) -> Schedule {
    let mut lanes: Schedule = Vec::new();
    for c in p2p {
        let (lane, cmds) = match *c {
            P2pCopy::Send {
                peer,
                src,
                far,
                bytes,
            } => {
                let copy = Cmd::Copy {
                    dst: Addr::Abs(far),
                    src: Addr::Abs(src),
                    bytes,
                };
                let (ready, full) = (CeFlags::ready(n, peer, 0), CeFlags::full(n, me, 0));
                let mut cmds = Vec::with_capacity(4);
                slot_turn(&mut cmds, me, ready, copy, peer, full);
                let lane = Lane::Peer {
                    peer,
                    lane: P2P_SEND_LANE,
                };
                (lane, cmds)
            }
            P2pCopy::Recv { peer } => {
                let mut cmds = vec![Cmd::Write {
                    page: peer,
                    word: CeFlags::ready(n, me, 0),
                    value: 1,
                }];
                take(&mut cmds, me, CeFlags::full(n, peer, 0));
                let lane = Lane::Peer {
                    peer,
                    lane: P2P_RECV_LANE,
                };
                (lane, cmds)
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
            take(&mut v, me, CeFlags::ready(n, q, lane));
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
pub fn lone_lane_on_caller(lanes: &Schedule, kept: bool, local_copies: bool) -> bool {
    let peers = lanes.iter().filter(|(l, _)| *l != Lane::Local).count();
    peers == 1 && !local_copies && !kept
}

/// The stream of a peer's lane (None: the caller's stream).
pub fn lane_index(lane: Lane) -> Option<usize> {
    match lane {
        Lane::Peer { peer, lane } => Some(peer * CE_LANES + lane),
        Lane::Local => None,
    }
}

#[cfg(test)]
mod tests;
