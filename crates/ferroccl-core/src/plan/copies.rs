//! A copy-engine operation as data: which bytes every rank copies where, and how each message
//! between two ranks is cut into pieces that take turns in the receiver's staging slots.
//!
//! The copy engine serves operations that only move data (all-gather, all-to-all, gather,
//! scatter, broadcast on 2 ranks): every output byte is one input byte of one rank, so the
//! operation is a list of [`Transfer`]s, each from one rank's input to one rank's output. A copy
//! between two ranks crosses the link into the receiver's staging piece by piece (the sender's
//! copy engine), and the receiver copies each piece out to its output; a copy within a rank is
//! one local copy (none when in place). The GPU backend enqueues these on its streams with
//! stream memory operations as the handshake (`backend/cuda/copy_engine.rs`); this module is
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

/// Bytes of one piece of a copy-and-fold reduction ([`folds`]): the sender's copy engines move
/// the copy into the receiver's output piece by piece, raising a word after each, and the
/// receiver's fold kernel reduces each piece as its word says it landed. Each piece costs about
/// 5.4 us that the other lane does not hide (the word's write waits for the copies to drain: 2,
/// 8 and 32 MiB pieces took a 2 GiB all-reduce to 198, 311 and 346-349 GB/s on 2 x H200), and the
/// last piece's fold is the tail no copy hides (64 MiB: 354-358 at 2 GiB but 311 at 512 MiB,
/// against 322-327 with 32 MiB; docs/PERFORMANCE.md section 21).
pub const FOLD_PIECE_BYTES: usize = 32 << 20;

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

/// A copy-and-fold reduction as data: the copy each rank receives from its peer, into its output
/// (`copy.dst`, always 0: the whole output), and where its own operand lies in its input (`local`,
/// bytes). The fold makes output = op(own operand, what landed) in an order every rank shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fold {
    /// What the peer copies into this rank's output.
    pub copy: Transfer,
    /// Byte offset of this rank's own operand in its input.
    pub local: usize,
}

/// Rank `me`'s fold of `kind` with NCCL's `count` of `elem` bytes on `nranks` ranks, or None where
/// [`fold_serves`] does not (in-place-ness aside, which only the buffers tell) or sizes overflow.
/// All-reduce: the peer's whole input lands in the output, and the own operand is the whole input.
/// Reduce-scatter: the peer's block `me` lands, and the own operand is this rank's block `me`.
pub fn folds(kind: CollKind, count: usize, elem: usize, nranks: usize, me: Rank) -> Option<Fold> {
    if !fold_serves(kind, nranks, false) || me >= nranks {
        return None;
    }
    let block = count.checked_mul(elem)?;
    block.checked_mul(nranks)?;
    let from = 1 - me;
    let (src, local) = match kind {
        CollKind::AllReduce => (0, 0),
        _ => (me * block, me * block),
    };
    Some(Fold {
        copy: Transfer {
            from,
            to: me,
            src,
            dst: 0,
            bytes: block,
        },
        local,
    })
}

/// Whether `kind` on `nranks` ranks takes the copy engines' zero-copy once the ranks have told
/// each other where their outputs are ([`rendezvous_far`]): gather and scatter, whose outputs no
/// rank can name from its own buffers (see [`zcopy_serves`]) but every rank can post.
pub fn rendezvous_serves(kind: CollKind, nranks: usize) -> bool {
    serves(kind, nranks) && matches!(kind, CollKind::Gather | CollKind::Scatter)
}

/// What a rank posts in the exchange before a launch of [`rendezvous_serves`]: where its output
/// lies, as a collective registration (numbered alike on every rank) and an offset in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Posted {
    /// The registration's number (every rank numbers its collective registrations alike).
    pub window: u64,
    /// The registration's length, the same on every rank for a symmetric window.
    pub len: u64,
    /// Byte offset of the output in it.
    pub offset: u64,
}

impl Posted {
    /// Bytes of one posting on the wire: a tag, then the three words.
    pub const LEN: usize = 25;

    /// `p` on the wire; None (no output, or one outside any window) is a zero tag and zeros.
    pub fn encode(p: Option<Posted>) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        if let Some(p) = p {
            b[0] = 1;
            b[1..9].copy_from_slice(&p.window.to_le_bytes());
            b[9..17].copy_from_slice(&p.len.to_le_bytes());
            b[17..25].copy_from_slice(&p.offset.to_le_bytes());
        }
        b
    }

    /// A posting off the wire; anything but [`Posted::LEN`] bytes with tag 0 or 1 (and zeros
    /// after tag 0) is refused: every rank gets the same bytes, so all refuse alike.
    pub fn decode(b: &[u8]) -> Result<Option<Posted>, String> {
        if b.len() != Self::LEN {
            return Err(format!(
                "an output posting of {} bytes, expected {}",
                b.len(),
                Self::LEN
            ));
        }
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        match b[0] {
            0 if b[1..].iter().all(|&x| x == 0) => Ok(None),
            1 => Ok(Some(Posted {
                window: word(1),
                len: word(9),
                offset: word(17),
            })),
            t => Err(format!("an output posting with tag {t} or stray bytes")),
        }
    }
}

/// Rank `me`'s view of a launch of `kind` (NCCL's `count` of `elem` bytes on `nranks` ranks,
/// `root` for the rooted kinds) once every rank has posted where its output lies
/// (`posted[q]`): for each rank q, the posting its copy engines must write into (`Some` only
/// where `me` sends q a copy), or None where the copy engines cannot take the launch: a kind
/// not served, sizes that overflow, or any receiver of a copy between two ranks whose output is
/// not posted or does not fit its window. Every rank decides from the same postings, so all
/// decide alike: all take the copies, or none.
pub fn rendezvous_far(
    kind: CollKind,
    count: usize,
    elem: usize,
    nranks: usize,
    root: Rank,
    me: Rank,
    posted: &[Option<Posted>],
) -> Option<Vec<Option<Posted>>> {
    if !rendezvous_serves(kind, nranks) || posted.len() != nranks || me >= nranks {
        return None;
    }
    let list = copies(kind, count, elem, nranks, root)?;
    let mut far = vec![None; nranks];
    for c in list.iter().filter(|c| c.from != c.to) {
        let (_, out) = kind.buffer_counts(count, nranks, c.to == root)?;
        let out = (out.checked_mul(elem)? as u64).max((c.dst + c.bytes) as u64);
        let p = posted[c.to]?;
        if p.offset.checked_add(out)? > p.len {
            return None;
        }
        if c.from == me {
            far[c.to] = Some(p);
        }
    }
    Some(far)
}

/// What a rank posts to a peer before a large receive from it (`tune::p2p_rendezvous_wanted`):
/// where its output lies (None: in no symmetric window), and its length in bytes, which the
/// matching send's must equal. Postings go out in the order of the receives, and the sender
/// reads them in the order of its sends to that rank: NCCL matches a pair's sends and
/// receives in order.
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
    /// engines where the output was posted in a window it fits, else by the kernels.
    pub fn by_copies(&self) -> bool {
        self.posted
            .is_some_and(|p| p.offset.checked_add(self.bytes).is_some_and(|e| e <= p.len))
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
        /// i, reduce-scatter element i of rank r from both inputs' element r * count + i.
        #[test]
        fn folds_bring_each_output_element_its_two_operands(
            kind in prop_oneof![Just(CollKind::AllReduce), Just(CollKind::ReduceScatter)],
            count in 0usize..50, elem in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
        ) {
            for me in 0..2 {
                let f = folds(kind, count, elem, 2, me).expect("served");
                let (sc, rc) = kind.buffer_counts(count, 2, false).unwrap();
                prop_assert_eq!(f.copy.to, me);
                prop_assert_eq!(f.copy.from, 1 - me);
                prop_assert_eq!(f.copy.bytes, rc * elem);
                prop_assert!(f.copy.src + f.copy.bytes <= sc * elem);
                prop_assert!(f.local + f.copy.bytes <= sc * elem);
                let want = if kind == CollKind::AllReduce { 0 } else { me * count * elem };
                // Output byte b: the peer's input byte src + b and this rank's local + b.
                prop_assert_eq!(f.copy.src, want);
                prop_assert_eq!(f.local, want);
            }
        }
    }

    #[test]
    fn folds_are_two_ranks_out_of_place_reductions_only() {
        for kind in CollKind::COLLECTIVES {
            let served = matches!(kind, CollKind::AllReduce | CollKind::ReduceScatter);
            assert_eq!(fold_serves(kind, 2, false), served, "{kind}");
            assert!(!fold_serves(kind, 2, true), "{kind} in place");
            assert!(!fold_serves(kind, 3, false), "{kind} on 3 ranks");
            assert_eq!(folds(kind, 4, 4, 2, 0).is_some(), served, "{kind}");
        }
        assert!(folds(CollKind::AllReduce, 4, 4, 2, 2).is_none());
        assert!(folds(CollKind::ReduceScatter, usize::MAX, 2, 2, 0).is_none());
    }

    fn posting() -> impl Strategy<Value = Option<Posted>> {
        prop_oneof![
            Just(None),
            (0u64..3, 0u64..300, 0u64..300).prop_map(|(window, len, offset)| Some(Posted {
                window,
                len,
                offset
            })),
        ]
    }

    proptest! {
        /// Every rank decides alike from the same postings; where they take the copies, each
        /// sender names exactly the receivers it copies to, every copy lands inside the
        /// receiver's posted window, and every receiver of a copy posted.
        #[test]
        fn rendezvous_postings_give_every_rank_one_decision_and_copies_inside_windows(
            gather in any::<bool>(), n in 1usize..6, count in 0usize..20,
            elem in prop_oneof![Just(1usize), Just(4)], root in 0usize..6,
            posted in proptest::collection::vec(posting(), 6),
        ) {
            let kind = if gather { CollKind::Gather } else { CollKind::Scatter };
            let (root, posted) = (root % n, &posted[..n]);
            let views: Vec<_> = (0..n)
                .map(|me| rendezvous_far(kind, count, elem, n, root, me, posted))
                .collect();
            if n == 1 {
                // Nothing crosses between ranks: the copy engines' zero-copy does not serve it.
                prop_assert!(views[0].is_none());
                return Ok(());
            }
            prop_assert!(views.iter().all(|v| v.is_some() == views[0].is_some()), "{views:?}");
            let list = copies(kind, count, elem, n, root).unwrap();
            match &views[0] {
                None => {
                    // Refused: some copy between two ranks has a receiver not posted, or whose
                    // whole output does not fit its window.
                    let unfit = |c: &Transfer| match posted[c.to] {
                        None => true,
                        Some(p) => {
                            let (_, out) = kind.buffer_counts(count, n, c.to == root).unwrap();
                            p.offset + (out * elem) as u64 > p.len
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
                        }
                        for c in list.iter().filter(|c| c.from == me && c.to != me) {
                            let p = v[c.to].unwrap();
                            prop_assert_eq!(Some(p), posted[c.to]);
                            prop_assert!(p.offset + (c.dst + c.bytes) as u64 <= p.len);
                        }
                    }
                }
            }
        }

        /// A posting survives the wire, and any other bytes are refused.
        #[test]
        fn postings_round_trip_and_stray_bytes_are_refused(
            p in posting(), junk in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            prop_assert_eq!(Posted::decode(&Posted::encode(p)), Ok(p));
            let ok = junk.len() == Posted::LEN
                && (junk[0] == 1 || (junk[0] == 0 && junk[1..].iter().all(|&x| x == 0)));
            prop_assert_eq!(Posted::decode(&junk).is_ok(), ok);
        }
    }

    #[test]
    fn rendezvous_serves_gather_and_scatter_only() {
        for kind in CollKind::COLLECTIVES {
            let served = matches!(kind, CollKind::Gather | CollKind::Scatter);
            assert_eq!(rendezvous_serves(kind, 2), served, "{kind}");
            assert!(!rendezvous_serves(kind, 1), "{kind} on 1 rank");
        }
        // A root in place (gather: its output holds its input at its own block) is named by its
        // posting like any other; an output missing, or past its window, refuses on every rank.
        let at = |offset| {
            Some(Posted {
                window: 4,
                len: 64,
                offset,
            })
        };
        let gather = |posted: &[Option<Posted>], me| {
            rendezvous_far(CollKind::Gather, 8, 4, 2, 1, me, posted)
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
            rendezvous_far(CollKind::Scatter, 8, 4, 2, 0, me, posted)
        };
        assert_eq!(scatter(&[at(32), at(8)], 0), Some(vec![None, at(8)]));
        assert_eq!(scatter(&[at(32), at(33)], 0), None, "past the window");
        assert_eq!(scatter(&[None, at(8)], 1), Some(vec![None, None]));
        assert_eq!(scatter(&[at(0), None], 0), None);
        assert_eq!(
            rendezvous_far(CollKind::AllGather, 8, 4, 2, 0, 0, &[at(0), at(0)]),
            None
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
                prop_assert!(q.offset + bytes <= q.len);
            }
            prop_assert_eq!(post.send_way(other).is_err(), other != bytes);
        }
    }
}
