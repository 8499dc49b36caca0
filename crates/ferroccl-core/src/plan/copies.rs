//! A copy-engine operation as data: which bytes every rank copies where, and how each message
//! between two ranks is cut into pieces that take turns in the receiver's staging slots.
//!
//! The copy engine serves operations that only move data (all-gather, all-to-all, gather,
//! scatter, broadcast on 2 ranks): every output byte is one input byte of one rank, so the
//! operation is a list of [`Transfer`]s, each from one rank's input to one rank's output. A copy
//! between two ranks crosses the link into the receiver's staging piece by piece (the sender's
//! copy engine), and the receiver copies each piece out to its output; a copy within a rank is
//! one local copy (none when in place). The GPU backend enqueues these on its streams with
//! stream memory operations as the handshake (`plan::lanes`, issued by `backend/cuda/copy_engine.rs`); this module is
//! the part every rank must compute alike, and what the tests prove: every output byte written
//! exactly once, from the right input byte, and both ends of a message cutting it the same.

use crate::types::{CollKind, Rank};

/// Staging slots per (receiver, sender): pieces take them in turn, so that a sender can copy
/// piece k+1 while its receiver copies piece k out.
pub const CE_SLOTS: usize = 4;
/// Streams per peer and direction: piece k goes on lane k % CE_LANES, so that one lane's
/// handshake overlaps the other's copy. Divides [`CE_SLOTS`]: a slot always belongs to one lane.
pub const CE_LANES: usize = 2;

/// One copy of an operation (a transfer): `bytes` from rank `from`'s input at byte `src` to rank `to`'s
/// output at byte `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The rank whose input is read.
    pub from: Rank,
    /// The rank whose output is written.
    pub to: Rank,
    /// Byte offset in `from`'s input.
    pub src: usize,
    /// Byte offset in `to`'s output.
    pub dst: usize,
    /// Bytes copied.
    pub bytes: usize,
}

/// Every copy of `kind` with NCCL's `count` of `elem` bytes on `nranks` ranks (`root` for the
/// rooted ones), or None for an operation the copy engine cannot run (a reduction, a send or
/// receive, broadcast beyond 2 ranks) or sizes that overflow. Copies of no bytes are left out.
/// In-place operations still list the own copy: the backend skips a copy whose source is its
/// destination.
pub fn copies(
    kind: CollKind,
    count: usize,
    elem: usize,
    nranks: usize,
    root: Rank,
) -> Option<Vec<Transfer>> {
    let block = count.checked_mul(elem)?;
    block.checked_mul(nranks)?;
    let rooted = matches!(
        kind,
        CollKind::Gather | CollKind::Scatter | CollKind::Broadcast
    );
    if nranks == 0 || (rooted && root >= nranks) {
        return None;
    }
    let mut v = Vec::new();
    let mut add = |from: Rank, to: Rank, src: usize, dst: usize| {
        if block > 0 {
            v.push(Transfer {
                from,
                to,
                src,
                dst,
                bytes: block,
            });
        }
    };
    match kind {
        // Each rank's block to every rank, at the sender's place in the output.
        CollKind::AllGather => {
            (0..nranks).for_each(|s| (0..nranks).for_each(|r| add(s, r, 0, s * block)))
        }
        // Block r of each sender's input to rank r, at the sender's place.
        CollKind::AllToAll => {
            (0..nranks).for_each(|s| (0..nranks).for_each(|r| add(s, r, r * block, s * block)))
        }
        CollKind::Gather => (0..nranks).for_each(|s| add(s, root, 0, s * block)),
        CollKind::Scatter => (0..nranks).for_each(|r| add(root, r, r * block, 0)),
        // One-shot from the root: its link carries n-1 copies where a chain carries one.
        CollKind::Broadcast if nranks <= 2 => (0..nranks).for_each(|r| add(root, r, 0, 0)),
        _ => return None,
    }
    Some(v)
}

/// Whether the copy engine runs `kind` on `nranks` ranks (sizes aside): see [`copies`].
pub fn serves(kind: CollKind, nranks: usize) -> bool {
    nranks >= 2
        && match kind {
            CollKind::AllGather | CollKind::AllToAll | CollKind::Gather | CollKind::Scatter => true,
            CollKind::Broadcast => nranks == 2,
            _ => false,
        }
}

/// Whether the copy engine's zero-copy runs `kind` on `nranks` ranks between symmetric
/// windows: each sender's copy engine writes straight into the receiver's output, which it
/// names by its own output's offset in the window of the same registration. So every rank must
/// pass an output of the same role: all-gather, all-to-all and broadcast on 2 ranks (whose
/// outputs are whole buffers on every rank, in place or not). Not gather or scatter: a root in
/// place has its output inside its input (or the reverse), at another offset than its peers'
/// buffers, and a non-root's output (gather) or input (scatter) need not exist.
pub fn zcopy_serves(kind: CollKind, nranks: usize) -> bool {
    serves(kind, nranks)
        && matches!(
            kind,
            CollKind::AllGather | CollKind::AllToAll | CollKind::Broadcast
        )
}

/// One piece of a message between two ranks: bytes `[at, at + bytes)` of the copy, through
/// staging slot `slot`, on lane `lane` of both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Byte offset of the piece in the copy.
    pub at: usize,
    /// Bytes of the piece (a slot's at most).
    pub bytes: usize,
    /// Staging slot it passes through.
    pub slot: usize,
    /// Lane (stream) that moves it, at both ends.
    pub lane: usize,
}

/// The pieces of a message of `bytes` through slots of `slot_bytes`, in order: piece k takes
/// slot k % CE_SLOTS and lane k % CE_LANES. Sender and receiver compute the same.
pub fn pieces(bytes: usize, slot_bytes: usize) -> impl Iterator<Item = Piece> {
    let slot_bytes = slot_bytes.max(1);
    (0..bytes.div_ceil(slot_bytes)).map(move |k| {
        let at = k * slot_bytes;
        Piece {
            at,
            bytes: slot_bytes.min(bytes - at),
            slot: k % CE_SLOTS,
            lane: k % CE_LANES,
        }
    })
}

/// Bytes of the largest piece of a copy-and-fold reduction ([`fold_list`], [`fold_cuts`]): the
/// sender's copy engines move the copy into the receiver's output piece by piece, raising a word
/// after each, and the receiver's fold kernel reduces each piece as its word says it landed. Each
/// piece costs about 5.4 us that the other lane does not hide (the word's write waits for the
/// copies to drain: uniform 2, 8 and 32 MiB pieces took a 2 GiB all-reduce to 198, 311 and
/// 346-349 GB/s on 2 x H200), and the last piece's fold is the tail no copy hides (uniform 64
/// MiB: 354-358 at 2 GiB but 311 at 512 MiB; docs/PERFORMANCE.md section 21). So the pieces
/// taper ([`Taper`]): large in the body, where nothing waits on their folds, small at the end.
pub const FOLD_PIECE_BYTES: usize = 128 << 20;

/// Bytes of the last piece of a copy-and-fold before its ragged end ([`Taper::tail`]).
pub const FOLD_TAIL_BYTES: usize = 4 << 20;

/// How much each piece of a copy-and-fold may grow over the one after it, in per cent
/// ([`Taper::ramp`]): a piece's fold must be done by the time the next piece has landed, or the
/// folds fall behind the copies and the tail grows. On 2 x H200 (docs/PERFORMANCE.md section 36,
/// 16 fold blocks with 8 pairs of loads in flight a thread, graphs, float32, GB/s at 512 MiB / 2
/// GiB, ramp 120 / 140 / 160): all-reduce 350 / 373, 318 / 363, 310 / 359; reduce 359 / 383,
/// 328 / 372, 321 / 370; reduce-scatter 321 / 365, 293 / 343, 283 / 340. With 4 pairs in flight the
/// pieces' times fit a fold of about 410 GB/s a piece against the link's 376-394.
pub const FOLD_RAMP: usize = 120;

/// [`FOLD_RAMP`] for the reduce of 2 ranks, whose root alone folds what one direction of the
/// link brings, on [`crate::tune::FOLD_REDUCE_BLOCKS`] blocks: a fold twice as wide keeps up with
/// pieces that grow faster, so fewer pieces pay their fixed cost. On 2 x H200 (a process per
/// GPU, plain buffers, graphs, float32, GB/s at 256 MiB / 512 MiB / 1 GiB; docs/PERFORMANCE.md
/// section 39): 32 blocks at 140 % 361 / 376 / 383-384, 16 at 120 % 337-338 / 362 / 374-376,
/// 64 at 200 % 335-336 / 361-362 / 376-377, 64 at 300 % 333 / 355 / 373.
pub const FOLD_REDUCE_RAMP: usize = 140;

/// Pieces a copy-and-fold has at most: the fold kernel's parameter holds their ends
/// (`FC_FOLD_MAX_PIECES`).
pub const FOLD_MAX_PIECES: usize = 32;

/// How a copy-and-fold cuts its copy into pieces ([`fold_cuts`]): pieces of at most `max`
/// bytes, tapering towards the end by `ramp` per cent a piece down to `tail` bytes. Each piece
/// costs a fixed few microseconds on the link, and the last piece's fold waits on nothing but
/// itself: the body wants few large pieces, the end a small one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Taper {
    /// Bytes of the largest piece.
    pub max: usize,
    /// Bytes of the last piece (its ragged end aside).
    pub tail: usize,
    /// Each piece at most this many per cent of the one after it (more than 100).
    pub ramp: usize,
}

/// The byte lengths, in order, of the pieces a copy-and-fold of `bytes` lands and folds under
/// `t`: every piece but the last a multiple of 4 KiB (so that every piece starts as aligned as
/// the buffer), none empty, at most [`FOLD_MAX_PIECES`] of them (where more would be needed the
/// largest piece grows, then the tail), built from the end: the last piece `tail` bytes (plus
/// the copy's ragged end under 4 KiB), each piece before it `ramp` per cent of the one after it
/// up to `max`, and the first piece whatever is left, joined to the second where it is under
/// half of it (a small first piece would pay a piece's fixed cost for little). Sender and
/// receiver compute the same.
pub fn fold_cuts(bytes: usize, t: Taper) -> Vec<usize> {
    const ALIGN: usize = 4096;
    let body = bytes / ALIGN * ALIGN;
    let ragged = bytes - body;
    let round = |b: usize| b.max(ALIGN).div_ceil(ALIGN).saturating_mul(ALIGN);
    let ramp = t.ramp.max(101);
    let (mut max, mut tail) = (round(t.max), round(t.tail));
    let mut back = loop {
        let mut back = Vec::new();
        let (mut s, mut rem) = (tail.min(max), body);
        while rem > 0 && back.len() <= FOLD_MAX_PIECES {
            let p = s.min(rem);
            back.push(p);
            rem -= p;
            s = round(s.saturating_mul(ramp) / 100).clamp(s, max.max(s));
        }
        if back.len() <= FOLD_MAX_PIECES {
            break back;
        }
        if max < body {
            max = max.saturating_mul(2);
        } else {
            tail = tail.saturating_mul(2);
        }
    };
    back.reverse();
    if back.len() >= 2 && back[0] < back[1] / 2 {
        let first = back.remove(0);
        back[0] += first;
    }
    match back.last_mut() {
        Some(last) => *last += ragged,
        None if ragged > 0 => back.push(ragged),
        None => {}
    }
    back
}

/// Whether the copy engines with a fold kernel run `kind` between symmetric windows on `nranks`
/// ranks (sizes aside): all-reduce and reduce-scatter on 2 ranks, out of place. Each rank's copy
/// engine copies what its peer must reduce (the peer's share of this rank's input) straight into
/// the peer's output, which serves as the landing area, and each rank folds its own operand into
/// what landed: the link carries each byte once, by the engines (391-395 GB/s a direction on 2 x
/// H200 against 363 for SM stores both ways at once), and the fold is a local pass over HBM on a
/// few blocks. In place the landing area would be this rank's own operand. Beyond 2 ranks a rank
/// would need n-1 landing areas: not offered.
pub fn fold_serves(kind: CollKind, nranks: usize, in_place: bool) -> bool {
    nranks == 2 && !in_place && matches!(kind, CollKind::AllReduce | CollKind::ReduceScatter)
}

/// Whether the copy-and-fold takes `kind` on `nranks` ranks only after the ranks posted their
/// outputs to each other ([`rendezvous_far`]), never between symmetric windows named without it:
/// the reduce of 2 ranks, whose non-root copies its whole input into the root's output and whose
/// root folds its own input into it. The non-root has no output and cannot tell whether the root
/// is in place (the landing area would then be the root's operand); the root's posting says so,
/// as it refuses in place ([`may_post`]).
pub fn posted_fold_serves(kind: CollKind, nranks: usize) -> bool {
    nranks == 2 && kind == CollKind::Reduce
}

/// Whether `kind` on `nranks` ranks is a copy-and-fold reduction by either way in
/// ([`fold_serves`] out of place, [`posted_fold_serves`]): what [`fold_list`] describes.
pub fn fold_kind(kind: CollKind, nranks: usize) -> bool {
    fold_serves(kind, nranks, false) || posted_fold_serves(kind, nranks)
}

/// One rank's fold in a copy-and-fold reduction, as data: the copy it receives from its peer,
/// into its output (`copy.dst`, always 0: the whole output), and where its own operand lies in
/// its input (`local`, bytes). The fold makes output = op(own operand, what landed) in an order
/// every rank shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fold {
    /// What the peer copies into this rank's output (`copy.to`: the rank that folds).
    pub copy: Transfer,
    /// Byte offset of this rank's own operand in its input.
    pub local: usize,
}

/// Every fold of a copy-and-fold `kind` ([`fold_kind`]) with NCCL's `count` of `elem` bytes on
/// `nranks` ranks (`root` for the reduce; the others have none, and ignore it), one per rank that
/// folds, or None for other kinds, a reduce's root out of range or sizes that overflow. All-reduce: each rank's output takes its peer's
/// whole input, and its own operand is its whole input. Reduce-scatter: rank r's output takes
/// its peer's block r, and its own operand is its block r. Reduce: only the root folds, its
/// output taking the non-root's whole input, its own operand its whole input.
pub fn fold_list(
    kind: CollKind,
    count: usize,
    elem: usize,
    nranks: usize,
    root: Rank,
) -> Option<Vec<Fold>> {
    if !fold_kind(kind, nranks) || (kind == CollKind::Reduce && root >= nranks) {
        return None;
    }
    let block = count.checked_mul(elem)?;
    block.checked_mul(nranks)?;
    let fold = |me: Rank| {
        let at = match kind {
            CollKind::ReduceScatter => me * block,
            _ => 0,
        };
        Fold {
            copy: Transfer {
                from: 1 - me,
                to: me,
                src: at,
                dst: 0,
                bytes: block,
            },
            local: at,
        }
    };
    Some(match kind {
        CollKind::Reduce => vec![fold(root)],
        _ => (0..nranks).map(fold).collect(),
    })
}

/// Whether `kind` on `nranks` ranks can take the copy engines once the ranks have told each other
/// where their outputs are ([`rendezvous_far`]): every kind the copy engines serve, and the
/// copy-and-fold reductions ([`fold_serves`]). Gather and scatter need it whatever the buffers
/// (no rank can name their outputs from its own, see [`zcopy_serves`]); the others where their
/// buffers lie in no symmetric window (the backend posts outputs mapped for their writers on the
/// fly then).
pub fn rendezvous_serves(kind: CollKind, nranks: usize) -> bool {
    serves(kind, nranks) || fold_kind(kind, nranks)
}

/// Whether a rank whose buffers are in place (`in_place`) may post its output for `kind`: not
/// for an all-to-all in place, whose output would take a peer's block before its own block for
/// that peer left (no staging breaks the cycle), nor for a copy-and-fold reduction in place
/// (the reduce's root: only it has an output to post), whose landing area would be its own
/// operand. Every other rank finds the posting missing and all run the kernels.
pub fn may_post(kind: CollKind, in_place: bool) -> bool {
    !(in_place
        && matches!(
            kind,
            CollKind::AllToAll | CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce
        ))
}

/// Every copy that crosses between ranks or within one in a launch of [`rendezvous_serves`]:
/// [`copies`] for data movement, each rank's [`Fold`] copy for the copy-and-fold reductions;
/// None for other kinds or sizes that overflow.
pub fn crossings(
    kind: CollKind,
    count: usize,
    elem: usize,
    nranks: usize,
    root: Rank,
) -> Option<Vec<Transfer>> {
    if fold_kind(kind, nranks) {
        let list = fold_list(kind, count, elem, nranks, root)?;
        return Some(
            list.iter()
                .map(|f| f.copy)
                .filter(|c| c.bytes > 0)
                .collect(),
        );
    }
    copies(kind, count, elem, nranks, root)
}

/// The ranks whose copy engines write rank `me`'s output in `kind` (NCCL's `count` of `elem` bytes
/// on `nranks` ranks, `root` for the rooted kinds): the readers its posting must serve.
pub fn writers_of(
    kind: CollKind,
    count: usize,
    elem: usize,
    nranks: usize,
    root: Rank,
    me: Rank,
) -> Vec<Rank> {
    let mut v: Vec<Rank> = crossings(kind, count, elem, nranks, root)
        .unwrap_or_default()
        .iter()
        .filter(|c| c.to == me && c.from != me)
        .map(|c| c.from)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Where a rank's output lies, as it posts it to a rank whose copy engines write it: in the
/// exchange before a launch of [`rendezvous_serves`], and before a large receive ([`RecvPost`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Posted {
    /// In a symmetric window, which every process mapped at registration.
    Window {
        /// The registration's number (every rank numbers its collective registrations alike).
        window: u64,
        /// The registration's length, the same on every rank.
        len: u64,
        /// The output's byte offset in it.
        offset: u64,
    },
    /// Mapped for the writer on the fly (an output nobody registered).
    Mapped {
        /// The output's address in the writer's process.
        addr: u64,
        /// The output's bytes.
        len: u64,
    },
}

impl Posted {
    /// Bytes of one posting on the wire: a tag, then three words.
    pub const LEN: usize = 25;

    /// Whether an output of `bytes` from the posted place lies inside what was posted.
    pub fn fits(&self, bytes: u64) -> bool {
        match *self {
            Posted::Window { len, offset, .. } => {
                offset.checked_add(bytes).is_some_and(|e| e <= len)
            }
            Posted::Mapped { addr, len } => bytes <= len && addr.checked_add(len).is_some(),
        }
    }

    /// `p` on the wire; None (no output, or none this rank can post) is a zero tag and zeros.
    pub fn encode(p: Option<Posted>) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        let (tag, words) = match p {
            None => return b,
            Some(Posted::Window {
                window,
                len,
                offset,
            }) => (1, [window, len, offset]),
            Some(Posted::Mapped { addr, len }) => (2, [addr, len, 0]),
        };
        b[0] = tag;
        for (i, w) in words.iter().enumerate() {
            b[1 + 8 * i..9 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// A posting off the wire; anything but [`Posted::LEN`] bytes with tag 0 (and zeros), 1, or
    /// 2 (and a zero third word) is refused: every rank gets the same bytes, so all refuse alike.
    pub fn decode(b: &[u8]) -> Result<Option<Posted>, String> {
        if b.len() != Self::LEN {
            return Err(format!(
                "an output posting of {} bytes, expected {}",
                b.len(),
                Self::LEN
            ));
        }
        let word =
            |i: usize| u64::from_le_bytes(b[1 + 8 * i..9 + 8 * i].try_into().expect("8 bytes"));
        match b[0] {
            0 if b[1..].iter().all(|&x| x == 0) => Ok(None),
            1 => Ok(Some(Posted::Window {
                window: word(0),
                len: word(1),
                offset: word(2),
            })),
            2 if word(2) == 0 => Ok(Some(Posted::Mapped {
                addr: word(0),
                len: word(1),
            })),
            t => Err(format!("an output posting with tag {t} or stray bytes")),
        }
    }

    /// A rank's row in the exchange before a launch: its posting for each rank as reader
    /// (`row[r]`: where rank r's copy engines write this rank's output), in rank order.
    pub fn encode_row(row: &[Option<Posted>]) -> Vec<u8> {
        row.iter().flat_map(|&p| Posted::encode(p)).collect()
    }

    /// A row off the wire, for `nranks` readers; a row of another length or with a posting
    /// that does not decode is refused.
    pub fn decode_row(b: &[u8], nranks: usize) -> Result<Vec<Option<Posted>>, String> {
        if Some(b.len()) != nranks.checked_mul(Self::LEN) {
            return Err(format!(
                "a row of postings of {} bytes, expected {nranks} of {}",
                b.len(),
                Self::LEN
            ));
        }
        b.chunks(Self::LEN).map(Posted::decode).collect()
    }
}

/// Rank `me`'s view of a launch of `kind` (NCCL's `count` of `elem` bytes on `nranks` ranks,
/// `root` for the rooted kinds) once every rank has posted where its output lies
/// (`posted[q][r]`: rank q's output as rank r's copy engines reach it): for each rank q, the
/// posting its copy engines must write into (`Some` only where `me` sends q a copy), or None
/// where the copy engines cannot take the launch: a kind not served, sizes that overflow, a
/// row missing, or any copy between two ranks whose receiver did not post its output for the
/// sender, or posted one its whole output does not fit. Every rank decides from the same
/// postings, so all decide alike: all take the copies, or none.
pub fn rendezvous_far(
    kind: CollKind,
    count: usize,
    elem: usize,
    nranks: usize,
    root: Rank,
    me: Rank,
    posted: &[Vec<Option<Posted>>],
) -> Option<Vec<Option<Posted>>> {
    if !rendezvous_serves(kind, nranks) || !rows_whole(posted, nranks) || me >= nranks {
        return None;
    }
    let list = crossings(kind, count, elem, nranks, root)?;
    let mut far = vec![None; nranks];
    for c in list.iter().filter(|c| c.from != c.to) {
        let (_, out) = kind.buffer_counts(count, nranks, c.to == root)?;
        let out = (out.checked_mul(elem)? as u64).max((c.dst + c.bytes) as u64);
        let p = posted[c.to][c.from]?;
        if !p.fits(out) {
            return None;
        }
        if c.from == me {
            far[c.to] = Some(p);
        }
    }
    Some(far)
}

/// Rank `me`'s view of the reduce of 2 ranks' pull after its rendezvous
/// (`tune::pull_rendezvous_wanted`), NCCL's `count` of `elem` bytes to `root`: the non-root posts
/// its input for its root to read (`posted[non-root][root]`, in a window or lent on the fly), and
/// the root, whose peer engine folds what it reads with its own input into its output, posts
/// nothing for it (from the copy-and-fold's floor it posts its output for the fold, which
/// [`rendezvous_far`] takes first where it was posted). For the root: the non-root's posting;
/// for the non-root: None (it reads nothing, and
/// only flags and waits). None where the pull cannot take the launch: not 2 ranks, `root` or `me`
/// out of range, a row missing or of another length, sizes that overflow, or the input not posted
/// for the root or posted where it does not fit. Every rank decides from the same rows, so both
/// pull, or neither (both run the kernels' rounds).
pub fn rendezvous_pull(
    count: usize,
    elem: usize,
    nranks: usize,
    root: Rank,
    me: Rank,
    posted: &[Vec<Option<Posted>>],
) -> Option<Option<Posted>> {
    if nranks != 2 || root >= nranks || me >= nranks || !rows_whole(posted, nranks) {
        return None;
    }
    let bytes = count.checked_mul(elem)? as u64;
    let input = posted[1 - root][root]?;
    if !input.fits(bytes) {
        return None;
    }
    Some((me == root).then_some(input))
}

/// What a launch takes after its rendezvous ([`rendezvous_taken`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Taken {
    /// The copies straight into the posted outputs: [`rendezvous_far`]'s postings.
    Far(Vec<Option<Posted>>),
    /// The reduce's pull: [`rendezvous_pull`]'s posting (the root's; None on the non-root).
    Pull(Option<Posted>),
}

/// Rank `me`'s view of a launch after its rendezvous (the arguments as [`rendezvous_far`]'s;
/// `pull`: whether the exchange carried the reduce's input for its root, which every rank
/// decides alike): the copies where every output they land in was posted, else the pull where
/// `pull` and the input was posted for the root, else None (the kernels' rounds, on every
/// rank: all decide from the same rows).
#[allow(clippy::too_many_arguments)]
pub fn rendezvous_taken(
    kind: CollKind,
    count: usize,
    elem: usize,
    nranks: usize,
    root: Rank,
    me: Rank,
    posted: &[Vec<Option<Posted>>],
    pull: bool,
) -> Option<Taken> {
    if let Some(far) = rendezvous_far(kind, count, elem, nranks, root, me, posted) {
        return Some(Taken::Far(far));
    }
    if !pull || kind != CollKind::Reduce {
        return None;
    }
    rendezvous_pull(count, elem, nranks, root, me, posted).map(Taken::Pull)
}

/// Whether a rendezvous's `posted` rows are every rank's, each with a posting for every rank.
fn rows_whole(posted: &[Vec<Option<Posted>>], nranks: usize) -> bool {
    posted.len() == nranks && posted.iter().all(|row| row.len() == nranks)
}

/// What a rank posts to a peer before a large receive from it (`tune::p2p_rendezvous_wanted`):
/// where its output lies for that peer (None: nowhere the peer can write), and its length in
/// bytes, which the matching send's must equal. Postings go out in the order of the receives,
/// and the sender reads them in the order of its sends to that rank: NCCL matches a pair's sends
/// and receives in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvPost {
    /// Where the output lies.
    pub posted: Option<Posted>,
    /// The receive's bytes.
    pub bytes: u64,
}

impl RecvPost {
    /// Bytes of one on the wire: the posting, then the length.
    pub const LEN: usize = Posted::LEN + 8;

    /// On the wire.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..Posted::LEN].copy_from_slice(&Posted::encode(self.posted));
        b[Posted::LEN..].copy_from_slice(&self.bytes.to_le_bytes());
        b
    }

    /// Off the wire; anything but [`RecvPost::LEN`] bytes with a valid posting is refused.
    pub fn decode(b: &[u8]) -> Result<RecvPost, String> {
        if b.len() != Self::LEN {
            return Err(format!(
                "a receive's posting of {} bytes, expected {}",
                b.len(),
                Self::LEN
            ));
        }
        Ok(RecvPost {
            posted: Posted::decode(&b[..Posted::LEN])?,
            bytes: u64::from_le_bytes(b[Posted::LEN..].try_into().expect("8 bytes")),
        })
    }

    /// The receive's way, which its sender's ([`RecvPost::send_way`]) matches: by the copy
    /// engines where the output was posted and fits what was posted, else by the kernels.
    pub fn by_copies(&self) -> bool {
        self.posted.is_some_and(|p| p.fits(self.bytes))
    }

    /// The matching send's way, `bytes` long: the posting its copy engines write into, None for
    /// the kernels, or why not (the lengths differ: the peer waits on a receive this send cannot
    /// satisfy either way).
    pub fn send_way(&self, bytes: u64) -> Result<Option<Posted>, String> {
        if bytes != self.bytes {
            return Err(format!(
                "a send of {bytes} bytes meets a receive of {} bytes: the counts and types of a matched send and receive must agree",
                self.bytes
            ));
        }
        Ok(self.posted.filter(|_| self.by_copies()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What rank `r`'s output holds at byte `b` after `kind`, as (source rank, input byte), from
    /// NCCL's definitions; None where the output has no such byte.
    fn reference(
        kind: CollKind,
        block: usize,
        n: usize,
        root: Rank,
        r: Rank,
        b: usize,
    ) -> Option<(Rank, usize)> {
        let (blk, off) = (b / block, b % block);
        match kind {
            CollKind::AllGather => (blk < n).then_some((blk, off)),
            CollKind::AllToAll => (blk < n).then_some((blk, r * block + off)),
            CollKind::Gather => (r == root && blk < n).then_some((blk, off)),
            CollKind::Scatter => (blk == 0).then_some((root, r * block + off)),
            CollKind::Broadcast => (blk == 0).then_some((root, off)),
            _ => None,
        }
    }

    fn kinds() -> impl Strategy<Value = CollKind> {
        prop_oneof![
            Just(CollKind::AllGather),
            Just(CollKind::AllToAll),
            Just(CollKind::Gather),
            Just(CollKind::Scatter),
            Just(CollKind::Broadcast),
        ]
    }

    proptest! {
        /// Every output byte of every rank is written exactly once, with the input byte NCCL's
        /// definition puts there, and every copy stays inside both buffers.
        #[test]
        fn copies_write_every_output_byte_once_from_the_right_input(
            kind in kinds(), n in 1usize..6, count in 0usize..40, elem in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)], root in 0usize..6,
        ) {
            let root = root % n;
            let got = copies(kind, count, elem, n, root);
            if kind == CollKind::Broadcast && n > 2 {
                prop_assert!(got.is_none());
                return Ok(());
            }
            let got = got.expect("a data-movement operation");
            let block = count * elem;
            for r in 0..n {
                let (sc, rc) = kind.buffer_counts(count, n, r == root).unwrap();
                let mut seen = vec![None; rc * elem];
                for c in got.iter().filter(|c| c.to == r) {
                    let (fsc, _) = kind.buffer_counts(count, n, c.from == root).unwrap();
                    prop_assert!(c.src + c.bytes <= fsc * elem, "{c:?} reads past rank {}'s input", c.from);
                    prop_assert!(c.dst + c.bytes <= rc * elem, "{c:?} writes past rank {r}'s output");
                    for i in 0..c.bytes {
                        prop_assert!(seen[c.dst + i].is_none(), "byte {} of rank {r} written twice", c.dst + i);
                        seen[c.dst + i] = Some((c.from, c.src + i));
                    }
                }
                let _ = sc;
                for (b, s) in seen.iter().enumerate() {
                    prop_assert_eq!(*s, reference(kind, block.max(1), n, root, r, b), "rank {} byte {}", r, b);
                }
            }
        }

        /// Pieces tile the message in order, within a slot each, and a slot always serves the
        /// same lane (so a lane's waits on its slots never wait on the other lane).
        #[test]
        fn pieces_tile_the_message_and_keep_each_slot_on_one_lane(bytes in 0usize..100_000, slot in 1usize..20_000) {
            let mut at = 0;
            for (k, p) in pieces(bytes, slot).enumerate() {
                prop_assert_eq!(p.at, at);
                prop_assert!(p.bytes >= 1 && p.bytes <= slot);
                prop_assert_eq!(p.slot, k % CE_SLOTS);
                prop_assert_eq!(p.lane, p.slot % CE_LANES);
                at += p.bytes;
            }
            prop_assert_eq!(at, bytes);
        }
    }

    #[test]
    fn only_data_movement_is_served() {
        for k in [
            CollKind::AllReduce,
            CollKind::ReduceScatter,
            CollKind::Reduce,
            CollKind::Send,
            CollKind::Recv,
        ] {
            assert!(!serves(k, 2));
            assert!(copies(k, 8, 4, 2, 0).is_none());
        }
        assert!(serves(CollKind::Broadcast, 2) && !serves(CollKind::Broadcast, 3));
        assert!(!serves(CollKind::AllGather, 1));
        assert!(
            copies(CollKind::AllToAll, usize::MAX / 2, 4, 2, 0).is_none(),
            "overflow"
        );
        assert!(
            copies(CollKind::Gather, 8, 4, 2, 2).is_none(),
            "root out of range"
        );
        assert_eq!(copies(CollKind::AllGather, 0, 4, 3, 0), Some(vec![]));
    }

    proptest! {
        /// A fold's copy and own operand stay inside both ranks' buffers, and together give each
        /// output element exactly NCCL's operands: all-reduce element i from both inputs' element
        /// i, reduce-scatter element i of rank r from both inputs' element r * count + i, reduce
        /// element i of the root (the only rank that folds) from both inputs' element i.
        #[test]
        fn folds_bring_each_output_element_its_two_operands(
            kind in prop_oneof![
                Just(CollKind::AllReduce),
                Just(CollKind::ReduceScatter),
                Just(CollKind::Reduce)
            ],
            count in 0usize..50, elem in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
            root in 0usize..2,
        ) {
            let list = fold_list(kind, count, elem, 2, root).expect("served");
            let folders: Vec<Rank> = list.iter().map(|f| f.copy.to).collect();
            let want_folders = if kind == CollKind::Reduce { vec![root] } else { vec![0, 1] };
            prop_assert_eq!(folders, want_folders);
            for f in &list {
                let me = f.copy.to;
                let (sc, rc) = kind.buffer_counts(count, 2, me == root).unwrap();
                prop_assert_eq!(f.copy.from, 1 - me);
                prop_assert_eq!(f.copy.dst, 0);
                prop_assert_eq!(f.copy.bytes, rc * elem);
                prop_assert!(f.copy.src + f.copy.bytes <= sc * elem);
                prop_assert!(f.local + f.copy.bytes <= sc * elem);
                let want = if kind == CollKind::ReduceScatter { me * count * elem } else { 0 };
                // Output byte b: the peer's input byte src + b and this rank's local + b.
                prop_assert_eq!(f.copy.src, want);
                prop_assert_eq!(f.local, want);
            }
        }
    }

    proptest! {
        /// A copy-and-fold's pieces tile its bytes in order, none empty, every one but the last
        /// a multiple of 4 KiB (each starts aligned), never more than the kernel holds; from the
        /// second on each is at most `ramp` per cent of the next (rounded up to 4 KiB), so the
        /// fold of a piece is done while the next lands; and the last is the tail (with the
        /// ragged end) where the bytes reach that far and the taper was not widened.
        #[test]
        fn fold_cuts_tile_the_copy_and_taper_to_the_tail(
            bytes in prop_oneof![0usize..300_000, 0usize..(64 << 20), Just(usize::MAX / 4)],
            max in 1usize..64, tail in 1usize..16, ramp in 110usize..=400,
        ) {
            let t = Taper { max: max << 14, tail: tail << 14, ramp };
            let cuts = fold_cuts(bytes, t);
            prop_assert!(cuts.len() <= FOLD_MAX_PIECES);
            prop_assert!(cuts.iter().all(|&c| c > 0));
            prop_assert_eq!(cuts.iter().sum::<usize>(), bytes);
            if let Some((_, body)) = cuts.split_last() {
                prop_assert!(body.iter().all(|c| c % 4096 == 0));
            }
            for w in cuts.windows(2).skip(1) {
                let grown = (w[1] as u128 * ramp as u128 / 100).div_ceil(4096) * 4096;
                prop_assert!(w[0] as u128 <= grown + 4096, "{:?}", cuts);
            }
            // Widened: the largest piece grew past `max` (the first may hold a remainder, the last a
            // ragged end), which happens only where the pieces would pass what the kernel holds.
            let widened = cuts.len() == FOLD_MAX_PIECES
                || cuts.iter().skip(1).any(|&c| c > t.max + 4095);
            if bytes >= 2 * t.tail.min(t.max) && !widened {
                let last = *cuts.last().unwrap();
                prop_assert_eq!(last / 4096 * 4096, t.tail.min(t.max), "{:?}", cuts);
            }
        }
    }

    /// Pieces of `bytes` each, as the copy-and-fold cut before the taper.
    fn uniform(bytes: usize) -> Taper {
        Taper {
            max: bytes,
            tail: bytes,
            ramp: 200,
        }
    }

    #[test]
    fn fold_cuts_by_default_are_few_and_end_small() {
        let t = Taper {
            max: FOLD_PIECE_BYTES,
            tail: FOLD_TAIL_BYTES,
            ramp: FOLD_RAMP,
        };
        let cuts = fold_cuts(2 << 30, t);
        // 2 GiB: under 32 pieces of at most 128 MiB (the first may take a remainder under half
        // a piece), 4 MiB last: a 32 MiB uniform cut had 64.
        assert!((16..=FOLD_MAX_PIECES).contains(&cuts.len()), "{cuts:?}");
        assert_eq!(*cuts.last().unwrap(), FOLD_TAIL_BYTES);
        assert!(
            cuts.iter().all(|&c| c <= FOLD_PIECE_BYTES * 3 / 2),
            "{cuts:?}"
        );
        assert!(
            cuts.iter().filter(|&&c| c == FOLD_PIECE_BYTES).count() >= 8,
            "{cuts:?}"
        );
        // A uniform taper: pieces of one size, whatever is left first.
        let u = fold_cuts(9 << 20, uniform(4 << 20));
        assert_eq!(u, vec![5 << 20, 4 << 20]);
        let u = fold_cuts(10 << 20, uniform(4 << 20));
        assert_eq!(u, vec![2 << 20, 4 << 20, 4 << 20]);
        assert_eq!(fold_cuts(12 << 20, uniform(4 << 20)), vec![4 << 20; 3]);
        // A ragged end joins the last piece; a copy under 4 KiB is one piece.
        assert_eq!(
            fold_cuts((8 << 20) + 6, uniform(4 << 20)),
            vec![4 << 20, (4 << 20) + 6]
        );
        assert_eq!(fold_cuts(100, t), vec![100]);
        assert!(fold_cuts(0, t).is_empty());
        // A huge copy widens the pieces to stay within what the kernel holds.
        let huge = fold_cuts(1 << 40, t);
        assert!(huge.len() <= FOLD_MAX_PIECES && huge.iter().sum::<usize>() == 1 << 40);
    }

    #[test]
    fn folds_are_two_ranks_out_of_place_reductions_only() {
        for kind in CollKind::COLLECTIVES {
            let served = matches!(kind, CollKind::AllReduce | CollKind::ReduceScatter);
            let posted = kind == CollKind::Reduce;
            assert_eq!(fold_serves(kind, 2, false), served, "{kind}");
            assert!(!fold_serves(kind, 2, true), "{kind} in place");
            assert!(!fold_serves(kind, 3, false), "{kind} on 3 ranks");
            assert_eq!(posted_fold_serves(kind, 2), posted, "{kind}");
            assert!(!posted_fold_serves(kind, 3), "{kind} on 3 ranks");
            assert_eq!(fold_kind(kind, 2), served || posted, "{kind}");
            assert_eq!(
                fold_list(kind, 4, 4, 2, 0).is_some(),
                served || posted,
                "{kind}"
            );
        }
        assert!(
            fold_list(CollKind::Reduce, 4, 4, 2, 2).is_none(),
            "root out of range"
        );
        // The kinds without a root ignore it, as NCCL does.
        assert_eq!(
            fold_list(CollKind::AllReduce, 4, 4, 2, 9),
            fold_list(CollKind::AllReduce, 4, 4, 2, 0)
        );
        assert!(fold_list(CollKind::ReduceScatter, 4, 4, 2, 9).is_some());
        assert!(fold_list(CollKind::ReduceScatter, usize::MAX, 2, 2, 0).is_none());
        // A reduce's copy goes to its root only; no bytes, no copy.
        let c = crossings(CollKind::Reduce, 4, 4, 2, 1).unwrap();
        assert_eq!(
            c,
            vec![Transfer {
                from: 0,
                to: 1,
                src: 0,
                dst: 0,
                bytes: 16
            }]
        );
        assert_eq!(writers_of(CollKind::Reduce, 4, 4, 2, 1, 1), vec![0]);
        assert!(writers_of(CollKind::Reduce, 4, 4, 2, 1, 0).is_empty());
        assert_eq!(crossings(CollKind::Reduce, 0, 4, 2, 1), Some(vec![]));
    }

    fn posting() -> impl Strategy<Value = Option<Posted>> {
        prop_oneof![
            Just(None),
            (0u64..3, 0u64..300, 0u64..300).prop_map(|(window, len, offset)| Some(
                Posted::Window {
                    window,
                    len,
                    offset
                }
            )),
            (1u64..1 << 40, 0u64..300).prop_map(|(addr, len)| Some(Posted::Mapped { addr, len })),
        ]
    }

    /// The data-movement kinds and the copy-and-fold ones.
    fn all_kinds() -> impl Strategy<Value = CollKind> {
        prop_oneof![
            kinds(),
            Just(CollKind::AllReduce),
            Just(CollKind::ReduceScatter),
            Just(CollKind::Reduce),
        ]
    }

    proptest! {
        /// Every rank decides alike from the same postings; where they take the copies, each
        /// sender names exactly the receivers it copies to, with the posting the receiver made
        /// for it, every copy lands inside what was posted, and every receiver of a copy posted
        /// for its sender.
        #[test]
        fn rendezvous_postings_give_every_rank_one_decision_and_copies_inside_them(
            kind in all_kinds(), n in 1usize..6, count in 0usize..20,
            elem in prop_oneof![Just(1usize), Just(4)], root in 0usize..6,
            posted in proptest::collection::vec(proptest::collection::vec(posting(), 6), 6),
        ) {
            let root = root % n;
            let posted: Vec<Vec<Option<Posted>>> = posted[..n].iter().map(|r| r[..n].to_vec()).collect();
            let views: Vec<_> = (0..n)
                .map(|me| rendezvous_far(kind, count, elem, n, root, me, &posted))
                .collect();
            if !rendezvous_serves(kind, n) {
                // A reduce, a reduction beyond 2 ranks, broadcast beyond 2 ranks, or nothing
                // crossing between ranks.
                prop_assert!(views.iter().all(Option::is_none));
                return Ok(());
            }
            prop_assert!(views.iter().all(|v| v.is_some() == views[0].is_some()), "{views:?}");
            let list = crossings(kind, count, elem, n, root).unwrap();
            match &views[0] {
                None => {
                    // Refused: some copy between two ranks has a receiver that did not post for
                    // its sender, or whose whole output does not fit what it posted.
                    let unfit = |c: &Transfer| match posted[c.to][c.from] {
                        None => true,
                        Some(p) => {
                            let (_, out) = kind.buffer_counts(count, n, c.to == root).unwrap();
                            !p.fits((out * elem) as u64)
                        }
                    };
                    let refused = list.iter().filter(|c| c.from != c.to).any(unfit);
                    prop_assert!(refused);
                }
                Some(_) => {
                    for (me, v) in views.iter().enumerate() {
                        let v = v.as_ref().unwrap();
                        for (q, named) in v.iter().enumerate() {
                            let sends = list.iter().any(|c| c.from == me && c.to == q && q != me);
                            prop_assert_eq!(named.is_some(), sends, "rank {} names rank {}", me, q);
                            prop_assert_eq!(sends, q != me && writers_of(kind, count, elem, n, root, q).contains(&me));
                        }
                        for c in list.iter().filter(|c| c.from == me && c.to != me) {
                            let p = v[c.to].unwrap();
                            prop_assert_eq!(Some(p), posted[c.to][me]);
                            prop_assert!(p.fits((c.dst + c.bytes) as u64));
                        }
                    }
                }
            }
        }

        /// A posting and a row of them survive the wire, and any other bytes are refused.
        #[test]
        fn postings_round_trip_and_stray_bytes_are_refused(
            p in posting(), row in proptest::collection::vec(posting(), 0..5),
            junk in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            prop_assert_eq!(Posted::decode(&Posted::encode(p)), Ok(p));
            prop_assert_eq!(Posted::decode_row(&Posted::encode_row(&row), row.len()), Ok(row.clone()));
            prop_assert!(Posted::decode_row(&Posted::encode_row(&row), row.len() + 1).is_err());
            let ok = junk.len() == Posted::LEN
                && match junk[0] {
                    0 => junk[1..].iter().all(|&x| x == 0),
                    1 => true,
                    2 => junk[17..].iter().all(|&x| x == 0),
                    _ => false,
                };
            prop_assert_eq!(Posted::decode(&junk).is_ok(), ok);
        }
    }

    #[test]
    fn rendezvous_serves_data_movement_and_the_folds() {
        for kind in CollKind::COLLECTIVES {
            let folds = matches!(
                kind,
                CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce
            );
            assert_eq!(
                rendezvous_serves(kind, 2),
                serves(kind, 2) || folds,
                "{kind}"
            );
            assert!(!rendezvous_serves(kind, 1), "{kind} on 1 rank");
            assert_eq!(
                rendezvous_serves(kind, 3),
                serves(kind, 3),
                "{kind} on 3 ranks"
            );
        }
        assert!(!rendezvous_serves(CollKind::Broadcast, 3));
        for kind in [
            CollKind::AllToAll,
            CollKind::AllReduce,
            CollKind::ReduceScatter,
            CollKind::Reduce,
        ] {
            assert!(!may_post(kind, true) && may_post(kind, false), "{kind}");
        }
        assert!(may_post(CollKind::AllGather, true) && may_post(CollKind::Gather, true));
        // A root in place (gather: its output holds its input at its own block) is named by its
        // posting like any other; an output missing, or past its window, refuses on every rank.
        let at = |offset| {
            Some(Posted::Window {
                window: 4,
                len: 64,
                offset,
            })
        };
        let rows = |p: &[Option<Posted>]| -> Vec<Vec<Option<Posted>>> {
            p.iter().map(|&x| vec![x; p.len()]).collect()
        };
        let gather = |posted: &[Option<Posted>], me| {
            rendezvous_far(CollKind::Gather, 8, 4, 2, 1, me, &rows(posted))
        };
        assert_eq!(gather(&[None, at(0)], 0), Some(vec![None, at(0)]));
        assert_eq!(gather(&[None, at(0)], 1), Some(vec![None, None]));
        assert_eq!(gather(&[None, at(1)], 0), None, "past the window");
        assert_eq!(
            gather(&[at(0), None], 0),
            None,
            "the root's output not posted"
        );
        assert_eq!(gather(&[at(0)], 0), None, "a posting missing");
        let scatter = |posted: &[Option<Posted>], me| {
            rendezvous_far(CollKind::Scatter, 8, 4, 2, 0, me, &rows(posted))
        };
        assert_eq!(scatter(&[at(32), at(8)], 0), Some(vec![None, at(8)]));
        assert_eq!(scatter(&[at(32), at(33)], 0), None, "past the window");
        assert_eq!(scatter(&[None, at(8)], 1), Some(vec![None, None]));
        assert_eq!(scatter(&[at(0), None], 0), None);
        // Mapped postings are per reader: each sender gets the one its receiver made for it.
        let m = |addr| Some(Posted::Mapped { addr, len: 64 });
        let ag = vec![
            vec![None, m(0x100), m(0x200)],
            vec![m(0x300), None, m(0x400)],
            vec![m(0x500), m(0x600), None],
        ];
        assert_eq!(
            rendezvous_far(CollKind::AllGather, 4, 4, 3, 0, 1, &ag),
            Some(vec![m(0x100), None, m(0x600)])
        );
        let mut short = ag.clone();
        short[2][1] = Some(Posted::Mapped {
            addr: 0x600,
            len: 47,
        });
        assert_eq!(
            rendezvous_far(CollKind::AllGather, 4, 4, 3, 0, 0, &short),
            None,
            "an output past its mapping"
        );
        let mut missing = ag.clone();
        missing[0][2] = None;
        assert_eq!(
            rendezvous_far(CollKind::AllGather, 4, 4, 3, 0, 1, &missing),
            None,
            "one reader not served"
        );
        // The folds: each rank's copy lands on its peer's whole output.
        assert_eq!(
            rendezvous_far(CollKind::AllReduce, 8, 4, 2, 0, 0, &rows(&[at(0), at(32)])),
            Some(vec![None, at(32)])
        );
        assert_eq!(
            rendezvous_far(CollKind::AllReduce, 8, 4, 2, 0, 0, &rows(&[at(0), at(33)])),
            None
        );
        assert_eq!(
            rendezvous_far(
                CollKind::ReduceScatter,
                8,
                4,
                2,
                0,
                1,
                &rows(&[at(32), at(0)])
            ),
            Some(vec![at(32), None])
        );
        // A reduce: the non-root names its root's output; the root names nothing; a root that
        // posted nothing (in place) sends both to the kernels.
        assert_eq!(
            rendezvous_far(CollKind::Reduce, 8, 4, 2, 0, 1, &rows(&[at(0), None])),
            Some(vec![at(0), None])
        );
        assert_eq!(
            rendezvous_far(CollKind::Reduce, 8, 4, 2, 0, 0, &rows(&[at(0), None])),
            Some(vec![None, None])
        );
        for me in 0..2 {
            assert_eq!(
                rendezvous_far(CollKind::Reduce, 8, 4, 2, 0, me, &rows(&[None, at(0)])),
                None
            );
        }
        // The reduce's pull: the root reads the non-root's posted input; the non-root reads
        // nothing; an input not posted for the root, or too short, sends both to the kernels.
        let input = |p: Option<Posted>| vec![vec![None, None], vec![p, None]];
        assert_eq!(rendezvous_pull(8, 4, 2, 0, 0, &input(at(32))), Some(at(32)));
        assert_eq!(rendezvous_pull(8, 4, 2, 0, 1, &input(at(32))), Some(None));
        let to_root1 = vec![vec![None, at(0)], vec![None, None]];
        assert_eq!(rendezvous_pull(8, 4, 2, 1, 1, &to_root1), Some(at(0)));
        for me in 0..2 {
            assert_eq!(
                rendezvous_pull(8, 4, 2, 0, me, &input(at(33))),
                None,
                "past the window"
            );
            assert_eq!(
                rendezvous_pull(8, 4, 2, 0, me, &input(None)),
                None,
                "not posted"
            );
            assert_eq!(
                rendezvous_pull(8, 4, 2, 1, me, &input(at(0))),
                None,
                "posted for the wrong rank"
            );
            assert_eq!(
                rendezvous_pull(17, 4, 2, 0, me, &input(m(0x100))),
                None,
                "past its mapping"
            );
            assert_eq!(
                rendezvous_pull(16, 4, 2, 0, me, &input(m(0x100))),
                Some((me == 0).then_some(m(0x100).unwrap()))
            );
            assert_eq!(
                rendezvous_pull(8, 4, 2, 2, me, &input(at(0))),
                None,
                "root out of range"
            );
            assert_eq!(
                rendezvous_pull(8, 4, 2, 0, me, &input(at(0))[..1]),
                None,
                "a row missing"
            );
            assert_eq!(
                rendezvous_pull(usize::MAX, 4, 2, 0, me, &input(at(0))),
                None
            );
        }
        assert_eq!(
            rendezvous_pull(8, 4, 2, 0, 2, &input(at(0))),
            None,
            "me out of range"
        );
        let three = vec![vec![None; 3]; 3];
        assert_eq!(rendezvous_pull(8, 4, 3, 0, 0, &three), None, "2 ranks only");
        // What a launch takes: the copies where the outputs were posted (the root's output out
        // of place, here beside the non-root's input), else the pull where the exchange was for
        // it, else nothing; on both ranks alike.
        let both = vec![vec![None, at(0)], vec![at(32), None]];
        let in_place = input(at(32));
        for me in 0..2 {
            let taken = |rows: &[Vec<Option<Posted>>], pull| {
                rendezvous_taken(CollKind::Reduce, 8, 4, 2, 0, me, rows, pull)
            };
            let far = rendezvous_far(CollKind::Reduce, 8, 4, 2, 0, me, &both).unwrap();
            assert_eq!(taken(&both, true), Some(Taken::Far(far.clone())));
            assert_eq!(taken(&both, false), Some(Taken::Far(far)));
            assert_eq!(
                taken(&in_place, true),
                Some(Taken::Pull((me == 0).then_some(at(32).unwrap())))
            );
            assert_eq!(taken(&in_place, false), None, "not exchanged for the pull");
            assert_eq!(taken(&input(None), true), None, "the input not posted");
            assert_eq!(
                rendezvous_taken(CollKind::AllReduce, 8, 4, 2, 0, me, &in_place, true),
                None,
                "the pull's rendezvous is the reduce's alone"
            );
        }
        assert_eq!(writers_of(CollKind::AllReduce, 4, 4, 2, 0, 1), vec![0]);
        assert_eq!(
            writers_of(CollKind::ReduceScatter, 0, 4, 2, 0, 1),
            Vec::<Rank>::new()
        );
        assert_eq!(writers_of(CollKind::Gather, 4, 4, 3, 1, 1), vec![0, 2]);
        assert_eq!(
            writers_of(CollKind::Gather, 4, 4, 3, 1, 0),
            Vec::<Rank>::new()
        );
        assert_eq!(writers_of(CollKind::Scatter, 4, 4, 3, 1, 2), vec![1]);
        assert_eq!(writers_of(CollKind::AllToAll, 4, 4, 3, 1, 2), vec![0, 1]);
        assert_eq!(
            writers_of(CollKind::AllGather, 0, 4, 3, 1, 2),
            Vec::<Rank>::new(),
            "nothing moves"
        );
    }

    proptest! {
        /// A receive's posting survives the wire; both ends choose the same way from it; a
        /// send of another length is refused.
        #[test]
        fn receive_postings_round_trip_and_both_ends_choose_alike(
            p in posting(), bytes in 0u64..400, other in 0u64..400,
            junk in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let post = RecvPost { posted: p, bytes };
            prop_assert_eq!(RecvPost::decode(&post.encode()), Ok(post));
            prop_assert_eq!(RecvPost::decode(&junk).is_ok(), junk.len() == RecvPost::LEN
                && Posted::decode(&junk[..Posted::LEN]).is_ok());
            let way = post.send_way(bytes).unwrap();
            prop_assert_eq!(way.is_some(), post.by_copies());
            if let Some(q) = way {
                prop_assert!(q.fits(bytes));
            }
            prop_assert_eq!(post.send_way(other).is_err(), other != bytes);
        }
    }
}
