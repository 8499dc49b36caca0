//! A model of the peer and direct engines' flow control (`kernels/peer.cu`,
//! `kernels/direct.cu`), checked under every kind of interleaving a random scheduler finds: one
//! block per rank runs launches of operations as the kernels do (acknowledgements of the
//! previous launch's last round at a launch's start, room checks, slot stores, flags, waits,
//! reads; the direct engine is one round a launch, its flags in the lines), each step
//! atomic, the ranks' steps interleaved at random or one rank running ahead as far as it can
//! (as ranks of different processes do, time-sliced on one GPU). It checks that no slot is
//! written while its receiver may still be reading it or before it read the round there, that
//! every read finds the round it waited for, and that every schedule ends (no deadlock). Its
//! programs take each launch's starting round as given; `run_counters` checks that the blocks'
//! counter words give them that round in any interleaving of a split launch's blocks.
//!
//! Direct rounds (the peer engine's, `FcPeer::direct`): receivers post their output at a launch's
//! start (some do, some do not), senders look for the posts after every round and store
//! straight into a posted output two rounds on (or from the first round, where they look before
//! it: `FcPeer::direct` 2), skipping the room check there, and mark their first direct round; a
//! receiver takes a round from its output when the mark says so, else from the slot. The model
//! checks that a direct store lands only in an output whose owner is in that very launch (its
//! earlier operations complete, as its post promised) and that every read finds its round where
//! the mark says it is. Split launches in place (`Launch::in_place`): the receive warps write a
//! round over the input only once their send warps said they stored it.
//!
//! Read rounds (the peer engine's one-phase rounds with `FcPeer::read`): a round's message lies
//! in its sender's own staging, in the region the sender keeps for that receiver, where a stored
//! round puts it in the receiver's region for that sender. The protocol is the same; the slot of
//! the ordered pair (sender, receiver) is the one the pair (receiver, sender) uses for stored
//! rounds. The model keys slots by where they lie, so launches of both kinds in any mix check
//! that no region is written while the rank that reads it may still be reading it.
//!
//! Pulls (the peer engine's all-reduce between symmetric windows, `FcPeer::pull`): no slot; each
//! rank flags that its input is there, waits for its peers' flags, reads their inputs straight
//! out of their windows, flags that it read them, and at its last round waits for its peers' same
//! flag. The model checks that a rank reads only inputs of the operation it is in and that no
//! rank's launch ends (after which its caller may overwrite its input) while a peer still reads
//! that input; and that the rounds after a pull, which count on its flags for room, stay safe.
//!
//! Line rounds (the peer engine's one-shot all-reduce in 128-byte lines, `FcPeer::lines`): no flag
//! word; a rank stores its round into its peers' slots with the round in every line, reads its
//! own slots once they hold the round (a line's flag is the round it carries), and ends every
//! round in a barrier. The model checks that the barriers alone keep the slots safe: a rank's
//! stores of round s + 2 come after it read its peers' round s + 1, which they stored after
//! the barrier that ended their reads of round s. A reduce's line rounds (`LinesToRoot`) have no
//! such return traffic: the root acknowledges each round after its barrier, and the senders
//! look for room before every round, as in the staged rooted rounds.
//!
//! What a step is: between two block barriers a block's threads store and load at will, so a
//! read of a slot lasts from the wait that allowed it to the block's next barrier (the next
//! signal, or the launch's end); a store is checked against every read in progress.

use proptest::prelude::*;
use std::collections::HashMap;

/// What an operation's rounds look like to the flow control.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Two phases, every rank to every rank.
    AllReduce,
    /// Reduce-scatter, all-gather, all-to-all and the one-shot all-reduce (2 ranks on the GPU,
    /// any count here): one phase, every rank to every rank (on the peer engine, like every
    /// one-shot round, into both phases' slots of the parity).
    Symmetric,
    /// Broadcast, scatter: the root to every rank.
    FromRoot,
    /// Reduce, gather: every rank to the root.
    ToRoot,
    /// The pulling all-reduce (2 ranks on the GPU, any count here): every rank reads every
    /// peer's input in place, one round a block.
    Pull,
    /// The pulling reduce: the all-reduce's pull, whose flags every rank raises and waits for
    /// alike, but only the root reads its peers' inputs.
    PullToRoot,
    /// The one-shot all-reduce and the reduce-scatter in line rounds (2 ranks on the GPU, any
    /// count here): every rank stores into every peer's slots (both phases'), the flag in the
    /// data.
    Lines,
    /// The reduce in line rounds (2 ranks on the GPU, any count here): every rank but the root
    /// stores into the root's slots (both phases'), the flag in the data; the root reads them as
    /// they land and acknowledges each round once its barrier ends the reads.
    LinesToRoot,
}

#[derive(Clone, Copy, Debug)]
struct Launch {
    kind: Kind,
    rounds: u64,
    root: usize,
    /// `Engine::PeerSplit` only: whether a one-phase launch is split (in and out of place
    /// alike); two-shot all-reduces never are.
    split: bool,
    /// The peer engines: senders look for posts (the movement kinds; not all-reduces).
    direct: bool,
    /// Which ranks post their output (bit r: rank r's output lies in a window).
    posts: u32,
    /// The peer engines' one-phase rounds (symmetric, from and to the root) as read rounds:
    /// each message in its sender's own region for its receiver (never with direct rounds).
    read: bool,
    /// Which ranks run a `Symmetric` launch in place (bit r: rank r), an all-to-all's or
    /// one-shot all-reduce's output its input: its receive side writes round s over the input
    /// its send side reads in round s. A split launch's receive warps wait for their send warps'
    /// word first (`peer.cu`, `split_in_place`); a whole block stores before it reads.
    in_place: u32,
}

impl Launch {
    /// `rounds` rounds of `kind` rooted at 0, whole, stored, no direct rounds or posts, nobody
    /// in place: the tests' starting point.
    fn of(kind: Kind, rounds: u64) -> Launch {
        Launch {
            kind,
            rounds,
            root: 0,
            split: false,
            direct: false,
            posts: 0,
            read: false,
            in_place: 0,
        }
    }

    /// Whether `engine` runs this launch's rounds as read rounds: the peer engines' one-phase
    /// rounds only (not the two-shot all-reduce's, pulls or lines), as the tuner chooses them.
    fn reads(&self, engine: Engine) -> bool {
        self.read
            && engine != Engine::Direct
            && matches!(self.kind, Kind::Symmetric | Kind::FromRoot | Kind::ToRoot)
    }
}

/// A slot's life: stored round s, being read (until the reader's next barrier), released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Written(u64),
    Reading(u64),
    Released(u64),
}

/// A slot: (owner, the other rank of the pair, phase, parity); the other rank is the sender
/// of a stored round, the receiver of a read round (the owner its sender).
type Key = (usize, usize, usize, u64);

/// The slot of round `s`'s message from `from` to `to` in `phase`: the receiver's region for
/// the sender, or (`read`) the sender's region for the receiver.
fn slot_key(from: usize, to: usize, phase: usize, s: u64, read: bool) -> Key {
    if read {
        (from, to, phase, s & 1)
    } else {
        (to, from, phase, s & 1)
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// Wait until every rank in `peers` acknowledged round `s - 2` (this rank's lines).
    Room { peers: Vec<usize>, s: u64 },
    /// Store round `s` into these ranks' slots of `phases` (`read`: this rank's slots for them).
    Store {
        to: Vec<usize>,
        phases: &'static [usize],
        s: u64,
        read: bool,
    },
    /// A barrier: the reads in progress end; then acknowledge round `ack` to every peer (0:
    /// none) and raise the `phase` flag to `s` at these ranks.
    Barrier {
        ack: u64,
        flag: Option<(usize, Vec<usize>)>,
        s: u64,
    },
    /// Wait for the `phase` flags of these ranks to reach `s`, then read their slots of
    /// `slots` (the phase's own, or both for a one-shot all-reduce).
    WaitRead {
        from: Vec<usize>,
        phase: usize,
        slots: &'static [usize],
        s: u64,
        read: bool,
    },
    /// The split block's two warp groups meet at a kernel boundary: launch `id` starts once
    /// both finished everything before it.
    Join { id: usize },
    /// A launch starts at round `s0` (this rank's output is now that operation's); one of
    /// direct rounds (`direct`) posts this rank's output to every peer (`post`) and forgets the
    /// last launch's direct choices.
    Start { s0: u64, direct: bool, post: bool },
    /// After round `s`'s barrier: for each of `to` not yet direct whose post of this launch is
    /// there, store directly from round `s + 2` on.
    Look { to: Vec<usize>, s: u64 },
    /// Before the launch's first round (`FcPeer::direct` 2, a bounded wait): for each of `to`
    /// whose post of this launch is there, store directly from that first round on. The model
    /// takes it in every launch of direct rounds: a look that finds nothing is the kernel that
    /// does not wait, or waited in vain.
    LookAtStart { to: Vec<usize> },
    /// A pull: read these ranks' inputs in place (until the block's next barrier).
    ReadInputs { from: Vec<usize> },
    /// Line rounds: wait until these ranks' slots of `slots` hold round `s` (the lines' flags),
    /// then read them (until the block's next barrier).
    WaitLines {
        from: Vec<usize>,
        slots: &'static [usize],
        s: u64,
    },
    /// The launch is over: its caller may overwrite this rank's input from here.
    Finish,
    /// The send warps of a split launch in place, after round `s`'s barrier: they say they
    /// stored it (a word of this rank's own memory).
    Sent { s: u64 },
    /// The receive warps of a split launch in place: wait for that word to reach `s`.
    WaitSent { s: u64 },
    /// In place: round `s` of the output is written over the same round of the input.
    Overwrite { s: u64 },
}

/// Which kernel's launches a program is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    Peer,
    /// One round a launch, no acknowledgement inside a launch, one phase for every kind.
    Direct,
    /// The peer engine's split launches (`FERROCCL_GPU_PEER_SPLIT`, off by default): one-phase
    /// rounds (every kind but the two-shot all-reduce) on two blocks a slice, one sending and
    /// one receiving at its own pace (the model's two agents of a rank: "warps" below), so that
    /// the link is busy while the receiver copies out. The send warps check for room before every round and
    /// flag it at their own barrier; the receive warps wait, read, and at their own barrier
    /// acknowledge every round to every peer. Two-shot all-reduces run as `Peer` does, in the
    /// send warps' program, the receive warps idle.
    PeerSplit,
}

/// Rank `me`'s steps for `launches` of the peer engine, as its kernel runs them (one block).
fn program(me: usize, n: usize, launches: &[Launch]) -> Vec<Step> {
    program_of(Engine::Peer, me, n, launches)
}

fn program_of(engine: Engine, me: usize, n: usize, launches: &[Launch]) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut s = 0u64;
    // Whether the block's last round exchanged with every peer (both kernels keep it in their
    // counter's top bit): its flags then stand for the acknowledgements.
    let mut after_symmetric = false;
    for l in launches {
        push_launch(engine, me, n, l, &mut s, &mut after_symmetric, &mut steps);
    }
    steps
}

/// Who rank `me` stores into and reads from in a round of `kind` (`root`: a rooted kind's).
fn ends(kind: Kind, me: usize, n: usize, root: usize) -> (Vec<usize>, Vec<usize>) {
    let peers: Vec<usize> = (0..n).filter(|&q| q != me).collect();
    match kind {
        Kind::AllReduce | Kind::Symmetric | Kind::Pull | Kind::PullToRoot | Kind::Lines => {
            (peers.clone(), peers)
        }
        Kind::FromRoot if me == root => (peers, Vec::new()),
        Kind::FromRoot => (Vec::new(), vec![root]),
        Kind::ToRoot | Kind::LinesToRoot if me == root => (Vec::new(), peers),
        Kind::ToRoot | Kind::LinesToRoot => (vec![root], Vec::new()),
    }
}

/// Appends rank `me`'s steps for launch `l` run whole by one block, its rounds counted on from
/// `s`, as the kernel runs them.
fn push_launch(
    engine: Engine,
    me: usize,
    n: usize,
    l: &Launch,
    s: &mut u64,
    after_symmetric: &mut bool,
    steps: &mut Vec<Step>,
) {
    let peers: Vec<usize> = (0..n).filter(|&q| q != me).collect();
    // The direct engine's launches: `rounds` 0 stands for one without this block (fewer
    // blocks), 1 for one that exchanges lines, 2 or more for one whose slice of this block
    // is empty (it counts the epoch and acknowledges, but stores and reads nothing).
    let empty_slice = engine == Engine::Direct && l.rounds >= 2;
    let rounds = if engine == Engine::Direct {
        l.rounds.min(1)
    } else {
        l.rounds
    };
    // The launch's start: the previous launch, complete, acknowledged to every peer (its
    // reads ended at its end, a step of this program before this one). A launch of no
    // rounds stands for one without this block (fewer blocks), which acknowledges nothing.
    if *s > 0 && rounds > 0 {
        steps.push(Step::Barrier {
            ack: *s,
            flag: None,
            s: *s,
        });
    }
    if empty_slice {
        *s += 1;
        *after_symmetric = false;
        return;
    }
    let direct = l.direct
        && engine == Engine::Peer
        && !matches!(
            l.kind,
            Kind::AllReduce | Kind::Pull | Kind::PullToRoot | Kind::Lines | Kind::LinesToRoot
        );
    let read = l.reads(engine);
    if rounds > 0 {
        steps.push(Step::Start {
            s0: *s + 1,
            direct,
            post: direct && l.posts >> me & 1 == 1,
        });
        let (targets, _) = ends(l.kind, me, n, l.root);
        if direct && !targets.is_empty() {
            steps.push(Step::LookAtStart { to: targets });
        }
    }
    let symmetric = matches!(
        l.kind,
        Kind::AllReduce | Kind::Symmetric | Kind::Pull | Kind::PullToRoot | Kind::Lines
    );
    for k in 0..rounds {
        *s += 1;
        let s = *s;
        if matches!(l.kind, Kind::Pull | Kind::PullToRoot) {
            // Input there; the peers' too; read theirs; read; at the end, they read this one's.
            // A reduce's non-root reads nothing: it only flags and waits.
            steps.push(Step::Barrier {
                ack: 0,
                flag: Some((0, peers.clone())),
                s,
            });
            steps.push(Step::WaitRead {
                from: peers.clone(),
                phase: 0,
                slots: &[],
                s,
                read: false,
            });
            if l.kind == Kind::Pull || me == l.root {
                steps.push(Step::ReadInputs {
                    from: peers.clone(),
                });
            }
            steps.push(Step::Barrier {
                ack: 0,
                flag: Some((1, peers.clone())),
                s,
            });
            if k + 1 == rounds {
                steps.push(Step::WaitRead {
                    from: peers.clone(),
                    phase: 1,
                    slots: &[],
                    s,
                    read: false,
                });
            }
            continue;
        }
        let check_room = (k == 0 && !*after_symmetric) || !symmetric;
        if l.kind == Kind::Lines {
            // Stores with the flag in every line, reads as the lines land, a barrier to end
            // the round: no flag word, no acknowledgement.
            if check_room {
                steps.push(Step::Room {
                    peers: peers.clone(),
                    s,
                });
            }
            steps.push(Step::Store {
                to: peers.clone(),
                phases: &[0, 1],
                s,
                read: false,
            });
            steps.push(Step::WaitLines {
                from: peers.clone(),
                slots: &[0, 1],
                s,
            });
            steps.push(Step::Barrier {
                ack: 0,
                flag: None,
                s,
            });
            continue;
        }
        if l.kind == Kind::LinesToRoot {
            // The senders look for room before every round (nothing comes back to say the root
            // read the last one), store their lines; the root waits for them as they land and,
            // once the round's barrier has ended its reads, acknowledges it.
            let (targets, sources) = ends(l.kind, me, n, l.root);
            if !targets.is_empty() {
                steps.push(Step::Room {
                    peers: targets.clone(),
                    s,
                });
                steps.push(Step::Store {
                    to: targets,
                    phases: &[0, 1],
                    s,
                    read: false,
                });
            }
            let receives = !sources.is_empty();
            if receives {
                steps.push(Step::WaitLines {
                    from: sources,
                    slots: &[0, 1],
                    s,
                });
            }
            steps.push(Step::Barrier {
                ack: if receives { s } else { 0 },
                flag: None,
                s,
            });
            continue;
        }
        let ack = if symmetric || engine == Engine::Direct {
            0
        } else {
            s - 1
        };
        let (targets, sources) = ends(l.kind, me, n, l.root);
        if check_room && !targets.is_empty() {
            steps.push(Step::Room {
                peers: targets.clone(),
                s,
            });
        }
        // The direct engine's one-shot is one line per peer whatever the kind; the peer
        // engine's one-shot rounds (every kind but the two-shot all-reduce) fill both
        // phases' slots of their parity.
        let slots: &'static [usize] = if l.kind != Kind::AllReduce && engine == Engine::Peer {
            &[0, 1]
        } else {
            &[0]
        };
        if !targets.is_empty() {
            steps.push(Step::Store {
                to: targets.clone(),
                phases: slots,
                s,
                read,
            });
        }
        let flag = (!targets.is_empty()).then_some((0, targets.clone()));
        steps.push(Step::Barrier { ack, flag, s });
        // The kernel looks after every round's barrier but its last.
        if direct && !targets.is_empty() && k + 1 < rounds {
            steps.push(Step::Look { to: targets, s });
        }
        if !sources.is_empty() {
            steps.push(Step::WaitRead {
                from: sources,
                phase: 0,
                slots,
                s,
                read,
            });
            if l.kind == Kind::Symmetric && l.in_place >> me & 1 == 1 {
                steps.push(Step::Overwrite { s });
            }
        }
        if l.kind == Kind::AllReduce && engine == Engine::Peer {
            // The owner's result into every peer's result slot, after reading the inputs.
            steps.push(Step::Store {
                to: peers.clone(),
                phases: &[1],
                s,
                read: false,
            });
            steps.push(Step::Barrier {
                ack: 0,
                flag: Some((1, peers.clone())),
                s,
            });
            steps.push(Step::WaitRead {
                from: peers.clone(),
                phase: 1,
                slots: &[1],
                s,
                read: false,
            });
        }
    }
    // The launch's end: its reads are over (acknowledged at the next launch's start), and the
    // caller may overwrite its input.
    if rounds > 0 {
        steps.push(Step::Barrier {
            ack: 0,
            flag: None,
            s: *s,
        });
        steps.push(Step::Finish);
        *after_symmetric = symmetric;
    }
}

/// The split design's two programs for rank `me`: its send warps' and its receive warps'.
fn split_programs(me: usize, n: usize, launches: &[Launch]) -> [Vec<Step>; 2] {
    let (mut send, mut recv) = (Vec::new(), Vec::new());
    let mut s = 0u64;
    let mut after_symmetric = false;
    for (id, l) in launches.iter().enumerate() {
        // A launch of no rounds stands for one without this block: nothing, not even a join.
        if l.rounds == 0 {
            continue;
        }
        send.push(Step::Join { id });
        recv.push(Step::Join { id });
        if matches!(
            l.kind,
            Kind::AllReduce | Kind::Pull | Kind::PullToRoot | Kind::Lines | Kind::LinesToRoot
        ) || !l.split
        {
            // Whole, as `Peer` runs it, on the send warps (its first round looks for room unless
            // the round before was this block's own whole symmetric one: a split round's flags
            // say nothing of the receive warps).
            push_launch(
                Engine::Peer,
                me,
                n,
                l,
                &mut s,
                &mut after_symmetric,
                &mut send,
            );
            continue;
        }
        // The previous launch's last round, acknowledged at the start (a whole launch's: its
        // reads ended at its kernel's end; a split launch's receive warps acknowledged it
        // already) by the receive warps, whose later acknowledgements must not be overtaken by
        // this one.
        if s > 0 {
            recv.push(Step::Barrier {
                ack: s,
                flag: None,
                s,
            });
        }
        let read = l.reads(Engine::PeerSplit);
        // The receive warps post; the send warps look.
        recv.push(Step::Start {
            s0: s + 1,
            direct: l.direct,
            post: l.direct && l.posts >> me & 1 == 1,
        });
        send.push(Step::Start {
            s0: s + 1,
            direct: l.direct,
            post: false,
        });
        let (targets, _) = ends(l.kind, me, n, l.root);
        if l.direct && !targets.is_empty() {
            send.push(Step::LookAtStart { to: targets });
        }
        let in_place = l.kind == Kind::Symmetric && l.in_place >> me & 1 == 1;
        for k in 0..l.rounds {
            s += 1;
            let (targets, sources) = ends(l.kind, me, n, l.root);
            if !targets.is_empty() {
                send.push(Step::Room {
                    peers: targets.clone(),
                    s,
                });
                send.push(Step::Store {
                    to: targets.clone(),
                    phases: &[0, 1],
                    s,
                    read,
                });
                send.push(Step::Barrier {
                    ack: 0,
                    flag: Some((0, targets.clone())),
                    s,
                });
                if in_place {
                    send.push(Step::Sent { s });
                }
                if l.direct && k + 1 < l.rounds {
                    send.push(Step::Look { to: targets, s });
                }
            }
            if !sources.is_empty() {
                recv.push(Step::WaitRead {
                    from: sources,
                    phase: 0,
                    slots: &[0, 1],
                    s,
                    read,
                });
                if in_place {
                    recv.push(Step::WaitSent { s });
                    recv.push(Step::Overwrite { s });
                }
            }
            // Every round acknowledged to every peer, read or not, so that the counters move alike.
            recv.push(Step::Barrier {
                ack: s,
                flag: None,
                s,
            });
        }
        after_symmetric = false;
    }
    [send, recv]
}

struct World {
    n: usize,
    slots: HashMap<Key, Slot>,
    /// flags[owner][from][phase]: phase 2 holds `from`'s acknowledgement to `owner`.
    flags: Vec<Vec<[u64; 3]>>,
    /// The slots each agent is reading until its next barrier (an agent: a rank's block, or
    /// one of its warp groups in the split design: `agents` per rank).
    reading: Vec<Vec<Key>>,
    agents: usize,
    /// Direct rounds: posts[sender][receiver], the first round of the receiver's posted launch.
    posts: Vec<Vec<u64>>,
    /// Per agent: the first round of its current launch of direct rounds (0: none).
    launch: Vec<u64>,
    /// Per rank: the first round of the launch it is in (its output belongs to that operation).
    current: Vec<u64>,
    /// Per agent and peer: the first round it stores directly into the peer's output.
    direct_at: Vec<Vec<Option<u64>>>,
    /// marks[receiver][sender]: the sender's first direct round (its mark in the flag line).
    marks: Vec<Vec<u64>>,
    /// Rounds stored straight into outputs: (receiver, sender, round).
    outputs: std::collections::HashSet<(usize, usize, u64)>,
    /// Per rank: the first round of the launch whose input the rank holds (0: between launches,
    /// its caller's to overwrite).
    inputs: Vec<u64>,
    /// Per agent: the ranks whose inputs it is reading until its next barrier (a pull).
    reading_inputs: Vec<Vec<usize>>,
    /// Per rank: the last round whose input its senders read (stored), and the last its split
    /// send warps said they stored (`Step::Sent`).
    input_read: Vec<u64>,
    sent: Vec<u64>,
    /// Mutations, for the model's own tests: senders that go direct without a post, receivers
    /// that ignore the marks, receive warps that write in place without waiting for `Sent`.
    ignore_posts: bool,
    ignore_marks: bool,
    ignore_sent: bool,
}

impl World {
    fn new(n: usize) -> World {
        World::with_agents(n, 1)
    }
    fn with_agents(n: usize, agents: usize) -> World {
        World {
            n,
            slots: HashMap::new(),
            flags: vec![vec![[0; 3]; n]; n],
            reading: vec![Vec::new(); n * agents],
            agents,
            posts: vec![vec![0; n]; n],
            launch: vec![0; n * agents],
            current: vec![0; n],
            direct_at: vec![vec![None; n]; n * agents],
            marks: vec![vec![0; n]; n],
            outputs: std::collections::HashSet::new(),
            inputs: vec![0; n],
            reading_inputs: vec![Vec::new(); n * agents],
            input_read: vec![0; n],
            sent: vec![0; n],
            ignore_posts: false,
            ignore_marks: false,
            ignore_sent: false,
        }
    }

    /// Whether agent `agent` (of rank `agent / agents`) can take `step` now (joins are the
    /// scheduler's: they depend on the other agent's place in its program).
    fn enabled(&self, agent: usize, step: &Step) -> bool {
        let me = agent / self.agents;
        match step {
            Step::Room { peers, s } => peers.iter().all(|&q| {
                self.flags[me][q][2] + 2 >= *s || self.direct_at[agent][q].is_some_and(|d| d <= *s)
            }),
            Step::WaitRead { from, phase, s, .. } => {
                from.iter().all(|&q| self.flags[me][q][*phase] >= *s)
            }
            Step::WaitLines { from, slots, s } => from.iter().all(|&q| {
                slots
                    .iter()
                    .all(|&ph| self.slots.get(&(me, q, ph, s & 1)) == Some(&Slot::Written(*s)))
            }),
            Step::WaitSent { s } => self.sent[me] >= *s || self.ignore_sent,
            _ => true,
        }
    }

    /// Takes `step` for agent `agent`; an error names a broken rule.
    fn take(&mut self, agent: usize, step: &Step) -> Result<(), String> {
        let me = agent / self.agents;
        match step {
            Step::Room { .. } | Step::Join { .. } | Step::WaitSent { .. } => {}
            Step::Sent { s } => self.sent[me] = self.sent[me].max(*s),
            Step::Overwrite { s } => {
                if self.input_read[me] < *s {
                    return Err(format!(
                        "rank {me} writes round {s} over its input, which it sent only to round {}",
                        self.input_read[me]
                    ));
                }
            }
            Step::Start { s0, direct, post } => {
                self.launch[agent] = if *direct { *s0 } else { 0 };
                self.current[me] = *s0;
                self.inputs[me] = *s0;
                self.direct_at[agent] = vec![None; self.n];
                if *post {
                    for q in (0..self.n).filter(|&q| q != me) {
                        self.posts[q][me] = *s0;
                    }
                }
            }
            Step::LookAtStart { to } => {
                let s0 = self.launch[agent];
                for &q in to {
                    if self.posts[me][q] == s0 || self.ignore_posts {
                        self.direct_at[agent][q] = Some(s0);
                    }
                }
            }
            Step::Look { to, s } => {
                let s0 = self.launch[agent];
                for &q in to {
                    if self.direct_at[agent][q].is_none()
                        && (self.posts[me][q] == s0 || self.ignore_posts)
                    {
                        self.direct_at[agent][q] = Some(s + 2);
                    }
                }
            }
            Step::Store {
                to,
                phases,
                s,
                read,
            } => {
                // The stores read this round of the input (every kind's that sends).
                self.input_read[me] = self.input_read[me].max(*s);
                for &q in to {
                    if self.direct_at[agent][q].is_some_and(|d| d <= *s) {
                        // Straight into q's output: q must be in this very launch.
                        let s0 = self.launch[agent];
                        if self.current[q] != s0 {
                            return Err(format!("rank {me} stores round {s} straight into rank {q}'s output, which is in the launch from round {} (not {s0})", self.current[q]));
                        }
                        if self.marks[q][me] < s0 {
                            self.marks[q][me] = *s;
                        }
                        self.outputs.insert((q, me, *s));
                        continue;
                    }
                    for &phase in *phases {
                        let key = slot_key(me, q, phase, *s, *read);
                        match self.slots.get(&key) {
                            None | Some(Slot::Released(_)) => {}
                            Some(other) => {
                                return Err(format!(
                                "rank {me} stores round {s} into {key:?} while it holds {other:?}"
                            ))
                            }
                        }
                        self.slots.insert(key, Slot::Written(*s));
                    }
                }
            }
            Step::WaitLines { from, slots, s } => {
                for &q in from {
                    for &phase in *slots {
                        let key = (me, q, phase, s & 1);
                        self.slots.insert(key, Slot::Reading(*s));
                        self.reading[agent].push(key);
                    }
                }
            }
            Step::ReadInputs { from } => {
                for &q in from {
                    if self.inputs[q] != self.current[me] {
                        return Err(format!(
                            "rank {me} in the launch from round {} reads rank {q}'s input, which is the launch's from round {} (0: none)",
                            self.current[me], self.inputs[q]
                        ));
                    }
                    self.reading_inputs[agent].push(q);
                }
            }
            Step::Finish => {
                if let Some(a) =
                    (0..self.reading_inputs.len()).find(|&a| self.reading_inputs[a].contains(&me))
                {
                    return Err(format!(
                        "rank {me}'s launch ends while rank {} still reads its input",
                        a / self.agents
                    ));
                }
                self.inputs[me] = 0;
            }
            Step::Barrier { ack, flag, s } => {
                self.reading_inputs[agent].clear();
                for key in std::mem::take(&mut self.reading[agent]) {
                    if let Some(Slot::Reading(r)) = self.slots.get(&key).copied() {
                        self.slots.insert(key, Slot::Released(r));
                    }
                }
                if *ack > 0 {
                    for q in (0..self.n).filter(|&q| q != me) {
                        let a = &mut self.flags[q][me][2];
                        *a = (*a).max(*ack);
                    }
                }
                if let Some((phase, to)) = flag {
                    for &q in to {
                        let f = &mut self.flags[q][me][*phase];
                        *f = (*f).max(*s);
                    }
                }
            }
            Step::WaitRead {
                from,
                slots,
                s,
                read,
                ..
            } => {
                for &q in from {
                    let s0 = self.launch[agent];
                    let m = self.marks[me][q];
                    if s0 > 0 && m >= s0 && m <= *s && !self.ignore_marks {
                        if !self.outputs.contains(&(me, q, *s)) {
                            return Err(format!("rank {me} takes round {s} from its output, where rank {q} did not store it"));
                        }
                        continue;
                    }
                    for &phase in *slots {
                        let key = slot_key(q, me, phase, *s, *read);
                        match self.slots.get(&key) {
                            Some(Slot::Written(r)) if r == s => {}
                            other => {
                                return Err(format!(
                                    "rank {me} reads round {s} from {key:?} but finds {other:?}"
                                ))
                            }
                        }
                        self.slots.insert(key, Slot::Reading(*s));
                        self.reading[agent].push(key);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Runs every rank's program under a schedule drawn from `seed`: at each point a rank that can
/// move is picked at random, or (`greedy`) the same rank keeps moving while it can. Returns the
/// number of steps, or the first broken rule, or the deadlock.
fn run(n: usize, launches: &[Launch], seed: u64, greedy: bool) -> Result<usize, String> {
    run_engine(Engine::Peer, n, launches, seed, greedy)
}

fn run_engine(
    engine: Engine,
    n: usize,
    launches: &[Launch],
    seed: u64,
    greedy: bool,
) -> Result<usize, String> {
    let programs: Vec<Vec<Step>> = if engine == Engine::PeerSplit {
        (0..n)
            .flat_map(|r| split_programs(r, n, launches))
            .collect()
    } else {
        (0..n).map(|r| program_of(engine, r, n, launches)).collect()
    };
    run_programs(n, &programs, seed, greedy)
}

/// Runs `programs` (`programs.len() / n` agents per rank, rank r's agents next to each other)
/// under a schedule drawn from `seed`, as `run` does.
fn run_programs(
    n: usize,
    programs: &[Vec<Step>],
    seed: u64,
    greedy: bool,
) -> Result<usize, String> {
    run_world(
        &mut World::with_agents(n, programs.len() / n),
        programs,
        seed,
        greedy,
    )
}

/// `run_programs` in a world of the caller's (its mutations, and what it holds after).
fn run_world(
    w: &mut World,
    programs: &[Vec<Step>],
    seed: u64,
    greedy: bool,
) -> Result<usize, String> {
    let agents = w.agents;
    let total = programs.len();
    let mut pc = vec![0usize; total];
    let mut joined: Vec<Option<usize>> = vec![None; total];
    let mut rng = seed | 1;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut current = 0usize;
    let mut steps = 0;
    // A join passes once every agent of the rank has reached it (or passed it).
    let can_join = |a: usize, id: usize, pc: &[usize], joined: &[Option<usize>]| {
        let rank = a / agents;
        (rank * agents..(rank + 1) * agents)
            .filter(|&b| b != a)
            .all(|b| {
                joined[b].is_some_and(|j| j >= id)
                    || programs[b]
                        .get(pc[b])
                        .is_some_and(|st| matches!(st, Step::Join { id: x } if *x == id))
            })
    };
    loop {
        let ready: Vec<usize> = (0..total)
            .filter(|&a| {
                pc[a] < programs[a].len()
                    && match &programs[a][pc[a]] {
                        Step::Join { id } => can_join(a, *id, &pc, &joined),
                        st => w.enabled(a, st),
                    }
            })
            .collect();
        if ready.is_empty() {
            if (0..total).all(|a| pc[a] == programs[a].len()) {
                return Ok(steps);
            }
            let stuck: Vec<String> = (0..total)
                .filter(|&a| pc[a] < programs[a].len())
                .map(|a| {
                    format!(
                        "rank {} agent {} at {:?}",
                        a / agents,
                        a % agents,
                        programs[a][pc[a]]
                    )
                })
                .collect();
            return Err(format!("deadlock: {}", stuck.join("; ")));
        }
        let a = if greedy && ready.contains(&current) && next() % 8 != 0 {
            current
        } else {
            ready[(next() % ready.len() as u64) as usize]
        };
        current = a;
        if let Step::Join { id } = programs[a][pc[a]] {
            joined[a] = Some(id);
        }
        w.take(a, &programs[a][pc[a]])?;
        pc[a] += 1;
        steps += 1;
    }
}

fn kind_strategy() -> impl Strategy<Value = Kind> {
    prop::sample::select(vec![
        Kind::AllReduce,
        Kind::Symmetric,
        Kind::FromRoot,
        Kind::ToRoot,
    ])
}

/// The peer engine's kinds: the direct engine's and pulls.
fn peer_kind_strategy() -> impl Strategy<Value = Kind> {
    prop::sample::select(vec![
        Kind::AllReduce,
        Kind::Symmetric,
        Kind::FromRoot,
        Kind::ToRoot,
        Kind::Pull,
        Kind::PullToRoot,
        Kind::Lines,
        Kind::LinesToRoot,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Any mix of operations, round counts and roots, on 2 to 5 ranks, with direct rounds or
    /// not and any ranks posting, under random and run-ahead schedules: no slot overwritten
    /// before its receiver is done with it, no direct store into an output of another
    /// operation, every read finds its round, no deadlock.
    #[test]
    fn the_peer_engine_flow_control_holds_in_any_interleaving(
        n in 2usize..=5,
        ops in prop::collection::vec((peer_kind_strategy(), 0u64..=6, any::<usize>(), 0u8..3, any::<u32>(), any::<u32>()), 1..8),
        seed in any::<u64>(),
        greedy in any::<bool>(),
    ) {
        // Rounds stored, direct (1) or read (2), as the tuner picks one of them; any ranks in
        // place.
        let launches: Vec<Launch> = ops.iter().map(|&(kind, rounds, root, mode, posts, in_place)| Launch { kind, rounds, root: root % n, split: true, direct: mode == 1, posts: posts & !in_place, read: mode == 2, in_place }).collect();
        let r = run(n, &launches, seed, greedy);
        prop_assert!(r.is_ok(), "{n} ranks, {launches:?}, greedy {greedy}: {}", r.unwrap_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// The direct engine (one round a launch, whatever the operation; all-reduce one-shot; some
    /// launches without this block or with an empty slice of it): the same rules hold for any
    /// mix on 2 to 5 ranks, under random and run-ahead schedules.
    #[test]
    fn the_direct_engine_flow_control_holds_in_any_interleaving(
        n in 2usize..=5,
        ops in prop::collection::vec((kind_strategy(), prop::sample::select(vec![0u64, 1, 1, 1, 2]), any::<usize>()), 1..10),
        seed in any::<u64>(),
        greedy in any::<bool>(),
    ) {
        // rounds: 0 a launch without this block, 1 one that exchanges, 2 an empty slice.
        let launches: Vec<Launch> = ops.iter().map(|&(kind, rounds, root)| Launch { kind, rounds, root: root % n, split: true, direct: false, posts: 0, read: false, in_place: 0 }).collect();
        let r = run_engine(Engine::Direct, n, &launches, seed, greedy);
        prop_assert!(r.is_ok(), "{n} ranks, {launches:?}, greedy {greedy}: {}", r.unwrap_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// The split design (send warps and receive warps of a block at their own pace, every
    /// one-phase round acknowledged by the receive warps, every round checked for room by the
    /// send warps; two-shot all-reduces unsplit between them): any mix on 2 to 5 ranks, under
    /// random and run-ahead schedules, keeps the same rules.
    #[test]
    fn the_split_peer_engine_design_holds_in_any_interleaving(
        n in 2usize..=5,
        ops in prop::collection::vec((peer_kind_strategy(), 0u64..=6, any::<usize>(), prop::bool::weighted(0.75), 0u8..3, any::<u32>(), any::<u32>()), 1..8),
        seed in any::<u64>(),
        greedy in any::<bool>(),
    ) {
        // Any ranks in place, each its own (split or whole alike on every rank).
        let launches: Vec<Launch> = ops.iter().map(|&(kind, rounds, root, split, mode, posts, in_place)| Launch { kind, rounds, root: root % n, split, direct: mode == 1, posts: posts & !in_place, read: mode == 2, in_place }).collect();
        let r = run_engine(Engine::PeerSplit, n, &launches, seed, greedy);
        prop_assert!(r.is_ok(), "{n} ranks, {launches:?}, greedy {greedy}: {}", r.unwrap_err());
    }
}

/// The split design needs both its safeguards: without the send warps' room checks a sender
/// overwrites a slot its peer's receive warps still read (all-gather rounds now ride ahead of
/// the copy-out, which the unsplit kernel's flags ruled out); without the receive warps'
/// acknowledgements the senders wait forever.
#[test]
fn the_model_catches_a_broken_split_design() {
    let n = 2;
    let ag = [Launch {
        split: true,
        ..Launch::of(Kind::Symmetric, 6)
    }];
    for seed in 1..200 {
        assert!(run_engine(Engine::PeerSplit, n, &ag, seed, seed % 2 == 0).is_ok());
    }
    let programs = |f: &dyn Fn(Step) -> Option<Step>| -> Vec<Vec<Step>> {
        (0..n)
            .flat_map(|r| split_programs(r, n, &ag))
            .map(|p| p.into_iter().filter_map(f).collect())
            .collect()
    };
    let no_room = programs(&|st| (!matches!(st, Step::Room { .. })).then_some(st));
    let broke = (1..400).find_map(|seed| run_programs(n, &no_room, seed, true).err());
    assert!(
        broke.as_ref().is_some_and(|e| e.contains("while it holds")),
        "no overwrite found: {broke:?}"
    );
    let no_ack = programs(&|st| {
        Some(match st {
            Step::Barrier { flag, s, .. } => Step::Barrier { ack: 0, flag, s },
            st => st,
        })
    });
    let e = run_programs(n, &no_ack, 7, false).unwrap_err();
    assert!(e.starts_with("deadlock") && e.contains("Room"), "{e}");
}

/// A split launch in place (an all-to-all whose output is its input on rank 0 only, as a rank's
/// in-place-ness is its own): the receive warps write round s over the input the send warps
/// read in round s. With their wait for the send warps' word every schedule holds and ends;
/// without it a schedule in which the send warps lag writes over input not yet sent.
#[test]
fn split_rounds_in_place_wait_for_their_own_sends() {
    let n = 2;
    let a2a = Launch {
        split: true,
        in_place: 0b01,
        ..Launch::of(Kind::Symmetric, 6)
    };
    let mixes = [
        vec![a2a],
        vec![
            a2a,
            Launch {
                split: false,
                ..a2a
            },
            a2a,
        ],
        vec![
            Launch {
                read: true,
                in_place: 0b11,
                ..a2a
            },
            a2a,
        ],
    ];
    for launches in &mixes {
        for seed in 1..300 {
            for engine in [Engine::Peer, Engine::PeerSplit] {
                let r = run_engine(engine, n, launches, seed, seed % 2 == 0);
                assert!(r.is_ok(), "{engine:?} {launches:?}: {r:?}");
            }
        }
    }
    let programs: Vec<Vec<Step>> = (0..n).flat_map(|r| split_programs(r, n, &[a2a])).collect();
    assert!(programs[0].iter().any(|s| matches!(s, Step::Sent { .. })));
    assert!(!programs[2]
        .iter()
        .any(|s| matches!(s, Step::Sent { .. } | Step::WaitSent { .. })));
    let broke = (1..400).find_map(|seed| {
        let mut w = World::with_agents(n, 2);
        w.ignore_sent = true;
        run_world(&mut w, &programs, seed, seed % 2 == 0).err()
    });
    assert!(
        broke
            .as_ref()
            .is_some_and(|e| e.contains("rank 0 writes round") && e.contains("over its input")),
        "no overwrite found: {broke:?}"
    );
}

/// Read rounds keep the stored rounds' safeguards, in the sender's own region: a reduce's
/// sender that reads (its rounds in its region for the root) and skips its room checks
/// overwrites round 1 with round 3 before the root read it; with them, read rounds after and
/// before stored ones of the reverse pair (which use the same region) hold under any schedule.
#[test]
fn read_rounds_keep_the_room_checks_in_the_senders_region() {
    let n = 2;
    let reduce = Launch {
        read: true,
        ..Launch::of(Kind::ToRoot, 4)
    };
    let bcast = Launch {
        kind: Kind::FromRoot,
        read: false,
        ..reduce
    };
    for seed in 1..200 {
        let mixes = [
            vec![reduce],
            vec![reduce, bcast, reduce],
            vec![bcast, reduce, bcast],
        ];
        for launches in &mixes {
            for engine in [Engine::Peer, Engine::PeerSplit] {
                let r = run_engine(engine, n, launches, seed, seed % 2 == 0);
                assert!(r.is_ok(), "{engine:?} {launches:?}: {r:?}");
            }
        }
    }
    // The sender's program without its room checks, run ahead alone: it finds its own region's
    // round 1 unread when it stores round 3 there.
    let sender: Vec<Step> = program(1, n, &[reduce])
        .into_iter()
        .filter(|s| !matches!(s, Step::Room { .. }))
        .collect();
    assert!(
        first_fault_alone(n, 1, &sender).is_some_and(|e| e.contains("stores round 3 into (1, 0,")),
        "the sender ran ahead unnoticed"
    );
}

/// Runs rank `me`'s `steps` alone from a fresh world of `n` ranks, as far as they can go (a rank
/// running ahead of its peers): the first broken rule, if any.
fn first_fault_alone(n: usize, me: usize, steps: &[Step]) -> Option<String> {
    let mut w = World::new(n);
    for step in steps {
        if !w.enabled(me, step) {
            return None;
        }
        if let Err(e) = w.take(me, step) {
            return Some(e);
        }
    }
    None
}

/// The model catches the protocol without its safeguards: rooted rounds that skip their room
/// checks overwrite a slot still unread, and never acknowledging makes senders wait forever.
#[test]
fn the_model_catches_a_broken_flow_control() {
    let n = 2;
    let bcast = Launch::of(Kind::FromRoot, 4);
    // As the kernel runs it: fine under any schedule tried.
    for seed in 1..200 {
        assert!(run(n, &[bcast], seed, seed % 2 == 0).is_ok());
    }
    // Without room checks in rooted rounds, a root that runs ahead overwrites round 1's slot
    // with round 3 before the receiver read it.
    let strip_room = |p: Vec<Step>| -> Vec<Step> {
        p.into_iter()
            .filter(|s| !matches!(s, Step::Room { .. }))
            .collect()
    };
    let programs: Vec<Vec<Step>> = (0..n)
        .map(|r| strip_room(program(r, n, &[bcast])))
        .collect();
    assert!(
        first_fault_alone(n, 0, &programs[0]).is_some_and(|e| e.contains("stores round 3")),
        "the root ran ahead unnoticed"
    );
    // Without any acknowledgement, the root's third round waits forever.
    let no_ack = |p: Vec<Step>| -> Vec<Step> {
        p.into_iter()
            .map(|s| match s {
                Step::Barrier { flag, s, .. } => Step::Barrier { ack: 0, flag, s },
                s => s,
            })
            .collect()
    };
    let programs: Vec<Vec<Step>> = (0..n).map(|r| no_ack(program(r, n, &[bcast]))).collect();
    let mut w = World::new(n);
    let mut pc = [0usize; 2];
    while let Some(r) =
        (0..n).find(|&r| pc[r] < programs[r].len() && w.enabled(r, &programs[r][pc[r]]))
    {
        w.take(r, &programs[r][pc[r]]).unwrap();
        pc[r] += 1;
    }
    assert!(
        pc[0] < programs[0].len(),
        "the root finished without acknowledgements"
    );
    // The direct engine alike: a root running ahead through three broadcasts without room
    // checks overwrites the first one's lines unread.
    let bcasts = [Launch::of(Kind::FromRoot, 1); 3];
    let root: Vec<Step> = strip_room(program_of(Engine::Direct, 0, n, &bcasts));
    let mut w = World::new(n);
    let broke = root
        .iter()
        .try_for_each(|step| w.take(0, step))
        .unwrap_err();
    assert!(broke.contains("stores round 3"), "{broke}");
    // With them, the root waits at its third launch until the receiver's second started.
    let root = program_of(Engine::Direct, 0, n, &bcasts);
    let mut w = World::new(n);
    let ran = root
        .iter()
        .take_while(|step| w.enabled(0, step) && w.take(0, step).is_ok())
        .count();
    assert!(
        matches!(root[ran], Step::Room { s: 3, .. }),
        "the root stopped at {:?}",
        root.get(ran)
    );
}

/// Where a block of a slice keeps its round counter between launches (`kernels/peer.cu`,
/// `peer_main`): the words it reads at its start and writes at its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Counters {
    /// As the kernel does: a split launch's receive block has a word of its own; a whole
    /// launch's block reads the send word and writes both.
    PerRole,
    /// One word per slice, written by the block that sends (or does both): what the kernel did
    /// before session 14, which the programs above take as given.
    Shared,
}

/// One slice's round counters on one rank over `launches` (rounds, split), its blocks' reads
/// and writes interleaved as `pick` chooses among the blocks of the current launch that can
/// move (each block: read its word, run, write its word(s); a launch starts once every block
/// of the one before ended, the kernel boundary). Checks that every block starts from the
/// rounds all earlier launches counted, which its flags, acknowledgements and slots depend on.
fn run_counters(
    launches: &[(u64, bool)],
    counters: Counters,
    mut pick: impl FnMut(usize) -> usize,
) -> Result<(), String> {
    // words[0]: the send (or whole) word; words[1]: the receive word.
    let mut words = [0u64; 2];
    let mut counted = 0u64;
    for (i, &(rounds, split)) in launches.iter().enumerate() {
        // A block's role: 0 whole, 1 send, 2 receive; its next action: 0 read, 1 write, 2 done.
        let roles: Vec<usize> = if split { vec![1, 2] } else { vec![0] };
        let mut next = vec![0usize; roles.len()];
        let mut seen = vec![0u64; roles.len()];
        while let Some(b) = {
            let live: Vec<usize> = (0..roles.len()).filter(|&b| next[b] < 2).collect();
            (!live.is_empty()).then(|| live[pick(live.len()) % live.len()])
        } {
            let role = roles[b];
            let own = if role == 2 && counters == Counters::PerRole {
                1
            } else {
                0
            };
            if next[b] == 0 {
                seen[b] = words[own];
                if seen[b] != counted {
                    return Err(format!("launch {i}: block of role {role} starts at round {} where {counted} were counted", seen[b]));
                }
            } else {
                let end = seen[b] + rounds;
                match (role, counters) {
                    (0, Counters::PerRole) => words = [end, end],
                    (0, Counters::Shared) | (1, _) => words[0] = end,
                    (2, Counters::PerRole) => words[1] = end,
                    _ => {}
                }
            }
            next[b] += 1;
        }
        counted += rounds;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Split and whole launches in any mix and any interleaving of a split launch's two blocks:
    /// every block starts from the rounds counted before it, with the receive blocks' own words.
    #[test]
    fn split_launches_start_every_block_from_the_rounds_counted_before(
        launches in prop::collection::vec((1u64..=4, any::<bool>()), 1..10),
        seed in any::<u64>(),
    ) {
        let mut rng = seed | 1;
        let r = run_counters(&launches, Counters::PerRole, |_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng as usize
        });
        prop_assert!(r.is_ok(), "{launches:?}: {}", r.unwrap_err());
    }
}

/// With one word per slice (the kernel before session 14), a send block that ends before its
/// receive block starts (a reduce's root has nothing to wait for; on one GPU shared by two
/// ranks not every block starts at once) moves the word on, and the receive block starts a
/// launch late: found by the GPU test, now by the model.
#[test]
fn the_model_catches_a_shared_round_counter() {
    let launches = [(3u64, true), (2, true)];
    // The send block first, to its end, then the receive block.
    let e = run_counters(&launches, Counters::Shared, |_| 0).unwrap_err();
    assert!(
        e.contains("launch 0: block of role 2 starts at round 3 where 0 were counted"),
        "{e}"
    );
    // The receive block first: no harm in that order.
    assert!(run_counters(&launches, Counters::Shared, |live| live - 1).is_ok());
    assert!(run_counters(&launches, Counters::PerRole, |_| 0).is_ok());
}

/// Direct rounds need both their rules: a sender that goes direct without its receiver's post
/// of this launch stores into an output still the previous operation's, and a receiver that
/// ignores the marks looks for a direct round in its slot. As the kernel runs them, both hold.
#[test]
fn the_model_catches_direct_rounds_without_posts_or_marks() {
    let n = 2;
    // A broadcast that posts nothing on the receiver, then one that does: only the second goes
    // direct, from its first round (where the look at its start finds the post) or its third.
    let mut bcasts = [Launch {
        direct: true,
        ..Launch::of(Kind::FromRoot, 12)
    }; 2];
    bcasts[1].posts = 0b10;
    let programs: Vec<Vec<Step>> = (0..n).map(|r| program(r, n, &bcasts)).collect();
    let (mut direct_seen, mut first_seen) = (false, false);
    for seed in 1..200 {
        let mut w = World::new(n);
        let r = run_world(&mut w, &programs, seed, seed % 2 == 0);
        assert!(r.is_ok(), "seed {seed}: {r:?}");
        assert!(
            !w.outputs.iter().any(|&(_, _, s)| s <= 12),
            "the first broadcast went direct without a post"
        );
        direct_seen |= !w.outputs.is_empty();
        first_seen |= w.outputs.iter().any(|&(_, _, s)| s == 13);
    }
    assert!(direct_seen, "no schedule went direct");
    assert!(first_seen, "no schedule went direct from the first round");
    // The root running ahead, going direct without a post: it stores into the receiver's
    // output while the receiver is still in the launch before.
    let broke = (1..400).find_map(|seed| {
        let mut w = World::new(n);
        w.ignore_posts = true;
        run_world(&mut w, &programs, seed, true).err()
    });
    assert!(
        broke
            .as_ref()
            .is_some_and(|e| e.contains("straight into rank 1's output")),
        "{broke:?}"
    );
    // A receiver ignoring the marks reads a direct round from its slot.
    let broke = (1..400).find_map(|seed| {
        let mut w = World::new(n);
        w.ignore_marks = true;
        run_world(&mut w, &programs, seed, seed % 2 == 0).err()
    });
    assert!(
        broke.as_ref().is_some_and(|e| e.contains("reads round")),
        "{broke:?}"
    );
}

/// Every rank's program for `launches`, less its waits for the phase flag `phase`.
fn programs_without_waits(n: usize, launches: &[Launch], phase: usize) -> Vec<Vec<Step>> {
    (0..n)
        .map(|r| {
            program(r, n, launches)
                .into_iter()
                .filter(|st| !matches!(st, Step::WaitRead { phase: p, .. } if *p == phase))
                .collect()
        })
        .collect()
}

/// Whether some schedule (random or run-ahead, over many seeds) of `programs` breaks the rule
/// named (others may break it otherwise, or not at all).
fn some_schedule_breaks(n: usize, programs: &[Vec<Step>], rule: &str) -> bool {
    (1..2000)
        .any(|seed| run_programs(n, programs, seed, seed % 2 == 0).is_err_and(|e| e.contains(rule)))
}

/// A pull needs both its waits: without the wait for the peer's "read" flag at its end, a rank
/// that runs ahead ends its launch (its caller may then overwrite the input) while its peer still
/// reads that input; without the wait for the peer's "there" flag, a rank reads its peer's input
/// before the peer's launch holds it. As the kernel runs them, neither happens; and the staged
/// rounds after pulls (whose first round counts on the pull's flags for room) stay safe.
#[test]
fn the_model_catches_a_pull_without_its_waits() {
    let n = 2;
    let pull = Launch::of(Kind::Pull, 1);
    let mixed = [
        pull,
        Launch {
            kind: Kind::Symmetric,
            rounds: 3,
            ..pull
        },
        pull,
        pull,
        Launch {
            kind: Kind::AllReduce,
            rounds: 2,
            ..pull
        },
    ];
    for seed in 1..300 {
        let r = run(n, &mixed, seed, seed % 2 == 0);
        assert!(r.is_ok(), "seed {seed}: {r:?}");
    }
    let without = |phase| programs_without_waits(n, &[pull, pull, pull], phase);
    assert!(some_schedule_breaks(
        n,
        &without(1),
        "still reads its input"
    ));
    assert!(some_schedule_breaks(n, &without(0), "reads rank 1's input"));
}

/// A reduce's pull: only the root reads, but its peer's launch must still wait for the root's
/// "read" flag at its end (its caller may overwrite the input the root reads), and the root for
/// its peer's "there" flag; both roots, among the rooted and symmetric rounds that follow it.
#[test]
fn the_model_catches_a_reduce_pull_without_its_waits() {
    let n = 2;
    for root in 0..n {
        let pull = Launch {
            root,
            ..Launch::of(Kind::PullToRoot, 2)
        };
        let mixed = [
            pull,
            Launch {
                kind: Kind::ToRoot,
                rounds: 3,
                ..pull
            },
            pull,
            Launch {
                kind: Kind::Pull,
                rounds: 1,
                ..pull
            },
            pull,
            Launch {
                kind: Kind::Symmetric,
                rounds: 2,
                ..pull
            },
        ];
        for seed in 1..300 {
            let r = run(n, &mixed, seed, seed % 2 == 0);
            assert!(r.is_ok(), "root {root}, seed {seed}: {r:?}");
        }
        let without = |phase| programs_without_waits(n, &[pull, pull, pull], phase);
        let peer = 1 - root;
        assert!(
            some_schedule_breaks(n, &without(1), "still reads its input"),
            "root {root}"
        );
        assert!(
            some_schedule_breaks(n, &without(0), &format!("reads rank {peer}'s input")),
            "root {root}"
        );
    }
}

/// A reduce's line rounds: nothing comes back from the root within a launch, so the senders
/// must look for room before every round and the root must acknowledge every round after the
/// barrier that ends its reads. With both, mixes with the other kinds hold; without the look a
/// sender two rounds on stores into slots the root still reads, and without the root's
/// acknowledgements the senders wait forever.
#[test]
fn the_model_catches_rooted_line_rounds_without_room_or_acknowledgement() {
    let n = 2;
    let reduce = Launch {
        root: 1,
        ..Launch::of(Kind::LinesToRoot, 5)
    };
    let mixed = [
        reduce,
        Launch {
            kind: Kind::Lines,
            rounds: 3,
            ..reduce
        },
        Launch { root: 0, ..reduce },
        Launch {
            kind: Kind::ToRoot,
            rounds: 2,
            ..reduce
        },
        reduce,
        Launch {
            kind: Kind::Symmetric,
            rounds: 2,
            ..reduce
        },
        Launch {
            kind: Kind::FromRoot,
            rounds: 3,
            root: 0,
            ..reduce
        },
        Launch {
            rounds: 1,
            ..reduce
        },
    ];
    for seed in 1..300 {
        let r = run(n, &mixed, seed, seed % 2 == 0);
        assert!(r.is_ok(), "seed {seed}: {r:?}");
    }
    let edited = |keep: &dyn Fn(&Step) -> Option<Step>| -> Vec<Vec<Step>> {
        (0..n)
            .map(|r| program(r, n, &[reduce]).iter().filter_map(keep).collect())
            .collect()
    };
    let roomless = edited(&|st| (!matches!(st, Step::Room { .. })).then(|| st.clone()));
    assert!(
        (1..2000).any(|seed| run_programs(n, &roomless, seed, seed % 2 == 0)
            .is_err_and(|e| e.contains("while it holds")))
    );
    // The root's per-round acknowledgements dropped (the launch's start still acknowledges
    // the launch before, which this one has not).
    let silent = edited(&|st| {
        Some(match st {
            Step::Barrier { ack, flag: None, s } if ack == s => Step::Barrier {
                ack: 0,
                flag: None,
                s: *s,
            },
            other => other.clone(),
        })
    });
    for seed in 1..50 {
        let r = run_programs(n, &silent, seed, seed % 2 == 0);
        assert!(
            r.as_ref().is_err_and(|e| e.contains("deadlock")),
            "seed {seed}: {r:?}"
        );
    }
}

/// Line rounds need their barrier at every round's end: without it a rank's reads of a round
/// last to its launch's end, and its peer, two rounds on, stores into slots it still reads. With
/// it, mixes of line rounds with staged and rooted rounds hold.
#[test]
fn the_model_catches_line_rounds_without_their_barriers() {
    let n = 2;
    let lines = Launch::of(Kind::Lines, 4);
    let mixed = [
        lines,
        Launch {
            kind: Kind::ToRoot,
            rounds: 3,
            root: 1,
            ..lines
        },
        lines,
        Launch {
            kind: Kind::Symmetric,
            rounds: 2,
            ..lines
        },
        Launch { rounds: 1, ..lines },
        Launch {
            kind: Kind::AllReduce,
            rounds: 3,
            ..lines
        },
    ];
    for seed in 1..300 {
        let r = run(n, &mixed, seed, seed % 2 == 0);
        assert!(r.is_ok(), "seed {seed}: {r:?}");
    }
    // The round-ending barriers dropped (those of no flag and no acknowledgement; the launch's
    // start acknowledges, and so stays).
    let unbarred: Vec<Vec<Step>> = (0..n)
        .map(|r| {
            program(r, n, &[lines])
                .into_iter()
                .filter(|st| {
                    !matches!(
                        st,
                        Step::Barrier {
                            ack: 0,
                            flag: None,
                            ..
                        }
                    )
                })
                .collect()
        })
        .collect();
    for seed in 1..50 {
        let r = run_programs(n, &unbarred, seed, seed % 2 == 0);
        assert!(
            r.as_ref()
                .is_err_and(|e| e.contains("while it holds Reading")),
            "seed {seed}: {r:?}"
        );
    }
    // And a line launch after a rooted one must look for room first.
    let roomless: Vec<Vec<Step>> = (0..n)
        .map(|r| {
            program(r, n, &[mixed[1], lines])
                .into_iter()
                .filter(|st| !matches!(st, Step::Room { .. }))
                .collect()
        })
        .collect();
    assert!(
        (1..2000).any(|seed| run_programs(n, &roomless, seed, seed % 2 == 0)
            .is_err_and(|e| e.contains("while it holds")))
    );
}
