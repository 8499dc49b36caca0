//! A model of the point-to-point send whose last warp publishes while the others copy
//! (`p2p_send_simple_split` in `kernels/p2p.cuh`), with the receiver at the other end of the
//! connection, checked under the interleavings a random scheduler finds.
//!
//! Agents: the copying warps, the publishing warp and the receiving block, each step atomic.
//! Piece k alternates between named barriers 1 and 2 (k % 2): a copying warp waits until the
//! publisher has passed piece k - 2's barrier (`passed`), waits for room (the receiver freed
//! the slot's previous piece), copies its share into the slot and arrives; the publisher waits
//! for every copier's arrival, notes that it passed, and publishes the piece unless a copier
//! failed; the receiver waits for the head, reads the slot and frees it. A room wait may fail
//! (abort, deadline): that warp copies nothing more, still arrives everywhere, and no piece from
//! the failed one on is published.
//!
//! Checked: no warp arrives at a barrier whose previous phase is not complete (two phases at
//! once on a hardware barrier is undefined), no piece is published before every copier stored
//! its share, no slot is overwritten while it holds a piece not yet freed, the receiver reads
//! each piece whole, no piece at or after a failure is published, and every schedule ends.

use std::collections::HashSet;

#[derive(Clone, Copy, Debug, Default)]
struct Mutations {
    /// Copiers arrive without waiting for the publisher to pass piece k - 2's barrier.
    no_gate: bool,
    /// The publisher publishes without waiting at the barrier.
    no_barrier: bool,
}

#[derive(Clone, Copy, Debug)]
struct Setup {
    pieces: u64,
    slots: u64,
    warps: usize,
    /// (warp, piece) whose room wait fails.
    fail: Option<(usize, u64)>,
    mutations: Mutations,
}

/// A named barrier: the piece whose phase is open and which copiers arrived in it.
#[derive(Clone, Debug, Default)]
struct Barrier {
    open: Option<u64>,
    arrived: HashSet<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copier {
    Gate,
    Room,
    Copy,
    Arrive,
}

#[derive(Clone, Debug)]
struct World {
    s: Setup,
    passed: u64,
    failed: bool,
    bars: [Barrier; 2],
    /// Per slot: the piece it holds and the warps that stored their share of it.
    slot: Vec<(Option<u64>, HashSet<usize>)>,
    head: u64,
    tail: u64,
    /// Per copier: its piece, where it is in it, and whether it copies it.
    copier: Vec<(u64, Copier, bool)>,
    /// The publisher's next piece.
    publisher: u64,
    /// The receiver's next piece, and whether it has begun reading it.
    receiver: (u64, bool),
    /// The first piece a failure left unpublished (u64::MAX: none failed).
    failed_at: u64,
}

impl World {
    fn new(s: Setup) -> World {
        World {
            s,
            passed: 0,
            failed: false,
            bars: [Barrier::default(), Barrier::default()],
            slot: vec![(None, HashSet::new()); s.slots as usize],
            head: 0,
            tail: 0,
            copier: vec![(0, Copier::Gate, true); s.warps],
            publisher: 0,
            receiver: (0, false),
            failed_at: u64::MAX,
        }
    }

    fn done(&self) -> bool {
        self.copier.iter().all(|c| c.0 >= self.s.pieces)
            && self.publisher >= self.s.pieces
            && (self.receiver.0 >= self.s.pieces || self.failed)
    }

    /// Agents 0..warps: copiers; warps: the publisher; warps + 1: the receiver.
    fn enabled(&self, agent: usize) -> bool {
        let (p, s) = (self.s.pieces, self.s.slots);
        if agent < self.s.warps {
            let (k, at, _) = self.copier[agent];
            if k >= p {
                return false;
            }
            return match at {
                Copier::Gate => self.s.mutations.no_gate || k < 2 || self.passed + 1 >= k,
                // A wait ends with room, a failure of its own, or another's (the error record).
                Copier::Room => k < self.tail + s || self.failed || self.s.fail == Some((agent, k)),
                Copier::Copy | Copier::Arrive => true,
            };
        }
        if agent == self.s.warps {
            let k = self.publisher;
            if k >= p {
                return false;
            }
            if self.s.mutations.no_barrier {
                return true;
            }
            let b = &self.bars[(k % 2) as usize];
            return b.open == Some(k) && b.arrived.len() == self.s.warps;
        }
        let (k, reading) = self.receiver;
        k < p && (reading || self.head > k || self.failed)
    }

    fn take(&mut self, agent: usize) -> Result<(), String> {
        let (p, s) = (self.s.pieces, self.s.slots);
        if agent < self.s.warps {
            let (k, at, go) = self.copier[agent];
            self.copier[agent] = match at {
                Copier::Gate => (k, Copier::Room, !self.failed),
                Copier::Room => {
                    if !go {
                        (k, Copier::Arrive, false)
                    } else if self.failed || self.s.fail == Some((agent, k)) {
                        self.failed = true;
                        self.failed_at = self.failed_at.min(k);
                        (k, Copier::Arrive, false)
                    } else {
                        (k, Copier::Copy, true)
                    }
                }
                Copier::Copy => {
                    let (held, warps) = &mut self.slot[(k % s) as usize];
                    if let Some(j) = *held {
                        if j != k && j >= self.tail {
                            return Err(format!(
                                "warp {agent} stores piece {k} over piece {j}, not yet freed"
                            ));
                        }
                    }
                    if *held != Some(k) {
                        *held = Some(k);
                        warps.clear();
                    }
                    warps.insert(agent);
                    (k, Copier::Arrive, true)
                }
                Copier::Arrive => {
                    let b = &mut self.bars[(k % 2) as usize];
                    match b.open {
                        Some(j) if j != k => {
                            return Err(format!(
                                "warp {agent} arrives for piece {k} while barrier {} is in piece {j}'s phase",
                                k % 2 + 1
                            ))
                        }
                        _ => b.open = Some(k),
                    }
                    if !b.arrived.insert(agent) {
                        return Err(format!("warp {agent} arrives twice in piece {k}'s phase"));
                    }
                    (k + 1, Copier::Gate, true)
                }
            };
            return Ok(());
        }
        if agent == self.s.warps {
            let k = self.publisher;
            if !self.s.mutations.no_barrier {
                self.bars[(k % 2) as usize] = Barrier::default();
            }
            self.passed = k + 1;
            if !self.failed {
                let (held, warps) = &self.slot[(k % s) as usize];
                if *held != Some(k) || warps.len() != self.s.warps {
                    return Err(format!(
                        "piece {k} published with {} of {} shares stored",
                        if *held == Some(k) { warps.len() } else { 0 },
                        self.s.warps
                    ));
                }
                if k >= self.failed_at {
                    return Err(format!(
                        "piece {k} published after the failure at {}",
                        self.failed_at
                    ));
                }
                self.head = k + 1;
            }
            self.publisher += 1;
            return Ok(());
        }
        let (k, reading) = self.receiver;
        if !reading && self.head <= k {
            // The wait ended on the failure: the receiver leaves.
            self.receiver = (p, false);
            return Ok(());
        }
        if !reading {
            let (held, warps) = &self.slot[(k % s) as usize];
            if *held != Some(k) || warps.len() != self.s.warps {
                return Err(format!("the receiver reads piece {k} unfinished"));
            }
            self.receiver = (k, true);
        } else {
            let (held, _) = &self.slot[(k % s) as usize];
            if *held != Some(k) {
                return Err(format!(
                    "piece {k} was overwritten while the receiver read it"
                ));
            }
            self.tail = k + 1;
            self.receiver = (k + 1, false);
        }
        Ok(())
    }
}

/// Runs a schedule drawn from `seed`; the number of steps taken, or the broken rule.
fn run(s: Setup, seed: u64) -> Result<usize, String> {
    let mut w = World::new(s);
    let agents = s.warps + 2;
    let mut rng = seed | 1;
    let mut steps = 0usize;
    loop {
        if w.done() {
            return Ok(steps);
        }
        let ready: Vec<usize> = (0..agents).filter(|&a| w.enabled(a)).collect();
        if ready.is_empty() {
            return Err(format!("deadlock after {steps} steps: {w:?}"));
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        w.take(ready[(rng % ready.len() as u64) as usize])?;
        steps += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn setup(pieces: u64, slots: u64, warps: usize, fail: Option<(usize, u64)>) -> Setup {
        Setup {
            pieces,
            slots,
            warps,
            fail,
            mutations: Mutations::default(),
        }
    }

    proptest! {
        #[test]
        fn the_publishing_warp_keeps_every_piece_whole_in_any_interleaving(
            pieces in 1u64..24, slots in 1u64..6, warps in 1usize..5, seed in any::<u64>(),
        ) {
            let r = run(setup(pieces, slots, warps, None), seed);
            prop_assert!(r.is_ok(), "{r:?}");
        }

        #[test]
        fn a_failed_room_wait_ends_every_agent_and_publishes_nothing_after_it(
            pieces in 1u64..24, slots in 1u64..6, warps in 1usize..5, seed in any::<u64>(),
            who in any::<prop::sample::Index>(), at in any::<prop::sample::Index>(),
        ) {
            let fail = (who.index(warps), at.index(pieces as usize) as u64);
            let r = run(setup(pieces, slots, warps, Some(fail)), seed);
            prop_assert!(r.is_ok(), "{r:?}");
        }
    }

    /// The model finds what each rule of the design prevents, under some schedule.
    fn some_schedule_breaks(s: Setup, rule: &str) {
        let found = (1..2000u64).find_map(|seed| run(s, seed).err());
        let e = found.unwrap_or_else(|| panic!("no schedule broke {s:?}"));
        assert!(e.contains(rule), "{e}");
    }

    #[test]
    fn the_model_catches_copiers_running_past_an_unfinished_barrier_phase() {
        let mut s = setup(12, 4, 3, None);
        s.mutations.no_gate = true;
        some_schedule_breaks(s, "is in piece");
    }

    #[test]
    fn the_model_catches_a_publish_that_does_not_wait_for_the_copies() {
        let mut s = setup(8, 2, 3, None);
        s.mutations.no_barrier = true;
        some_schedule_breaks(s, "published with");
    }

    #[test]
    fn every_schedule_of_a_long_send_ends_with_every_piece_read() {
        for seed in 1..200u64 {
            let n = run(setup(40, 4, 4, None), seed).unwrap();
            // Every step of every agent: 4 per copier piece, 1 per publish, 2 per read.
            assert_eq!(n as u64, 40 * (4 * 4 + 1 + 2));
        }
    }
}
