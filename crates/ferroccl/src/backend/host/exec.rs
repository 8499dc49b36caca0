//! The host executor: runs the plans of one launch (one or several communicators) on one thread.
//!
//! Each lane is a cursor over its steps; a step moves one FIFO slot (a *piece*) at a time. The
//! executor polls every lane without blocking and only sleeps, on one FIFO with a short
//! timeout, when no lane anywhere could move. So a group of sends and receives, or one thread
//! driving all ranks of a communicator, never waits on itself, and chunks flow through a ring
//! piece by piece (a rank forwards the first slot of a chunk while the next slot is arriving).

use super::conns::Conns;
use crate::bootstrap::health::Health;
use crate::info::CommInfo;
use crate::transport::{pid_alive, Consumer, Producer};
use ferroccl_core::numeric::Reducer;
use ferroccl_core::plan::{BufKind, Plan, Region, Step};
use ferroccl_core::{Error, Rank};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The buffers and arithmetic of one operation of a plan.
pub(crate) struct OpBufs {
    pub send: *const u8,
    pub recv: *mut u8,
    pub reducer: Reducer,
}

/// One communicator's share of a launch.
pub(crate) struct Unit<'a> {
    pub plan: &'a Plan,
    pub ops: Vec<OpBufs>,
    pub conns: &'a mut Conns,
    pub abort: &'a AtomicBool,
    /// "all_reduce #12 on rank 3 of 4": what the errors of this unit are about.
    pub label: String,
    /// The communicator: how to name each peer in errors, their processes (to notice a dead
    /// one), the transports, and the slot size (a piece).
    pub info: &'a CommInfo,
    /// What the heartbeats know about the peers.
    pub health: &'a Health,
    /// The launch's sequence number on this communicator.
    pub seq: u64,
}

#[derive(Clone, Copy, Default)]
struct Cursor {
    step: usize,
    /// Elements of the current step already moved.
    done: usize,
}

/// Where a lane is stuck.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Blocked {
    Recv(Rank, u32),
    Send(Rank, u32),
}

enum Moved {
    Yes,
    Blocked(Blocked),
}

fn region_ptr(ops: &[OpBufs], r: &Region, skip: usize) -> *mut u8 {
    let o = &ops[r.op as usize];
    let es = o.reducer.dtype().size();
    let base = if r.buf == BufKind::Input {
        o.send as *mut u8
    } else {
        o.recv
    };
    // SAFETY: regions were validated against the buffer extents when the plan was built.
    unsafe { base.add((r.offset + skip) * es) }
}

fn recv_port(conns: &mut Conns, peer: Rank, ch: u32) -> Result<&mut Consumer, Error> {
    conns.recv.get_mut(&(peer, ch)).ok_or_else(|| {
        Error::Internal(format!(
            "no receive connection from rank {peer} channel {ch}"
        ))
    })
}
fn send_port(conns: &mut Conns, peer: Rank, ch: u32) -> Result<&mut Producer, Error> {
    conns
        .send
        .get_mut(&(peer, ch))
        .ok_or_else(|| Error::Internal(format!("no send connection to rank {peer} channel {ch}")))
}

/// Tries to move the next piece of `step`. Never blocks.
fn try_piece(u: &mut Unit, ch: u32, step: &Step, cur: &mut Cursor) -> Result<Moved, Error> {
    let es = u.ops[step.op() as usize].reducer.dtype().size();
    let piece_elems = (u.info.config.slot_bytes / es).max(1);
    let left = step.count() - cur.done;
    if let Step::Copy {
        src,
        dst,
        pre,
        post,
    } = *step
    {
        let (s, d) = (region_ptr(&u.ops, &src, 0), region_ptr(&u.ops, &dst, 0));
        if pre || post {
            let red = &u.ops[src.op as usize].reducer;
            // SAFETY: both regions lie inside validated buffers; equal pointers are allowed.
            unsafe { red.transform(&[d], s, src.count, pre, post) };
        } else if s != d {
            // SAFETY: as above; `copy` tolerates overlap.
            unsafe { std::ptr::copy(s, d, src.count * es) };
        }
        cur.done = step.count();
        return Ok(Moved::Yes);
    }
    let n = left.min(piece_elems);
    let bytes = n * es;
    // Reserve the outgoing slot first: a full peer must not make us consume the incoming one.
    let out_slot = match step.send_to() {
        Some(to) => match send_port(u.conns, to, ch)?.try_reserve()? {
            Some(p) => Some(p),
            None => return Ok(Moved::Blocked(Blocked::Send(to, ch))),
        },
        None => None,
    };
    let incoming = match step.recv_from() {
        Some(from) => {
            let port = recv_port(u.conns, from, ch)?;
            match port.try_peek()? {
                Some((p, len)) => {
                    if len != bytes {
                        return Err(Error::Protocol(format!(
                            "received {len} bytes from {} on channel {ch}, expected {bytes}: do all ranks call the same \
                             operations with the same counts, types and roots, in the same order?",
                            u.info.peer_names[from]
                        )));
                    }
                    Some(p)
                }
                None => return Ok(Moved::Blocked(Blocked::Recv(from, ch))),
            }
        }
        None => None,
    };
    // SAFETY: slots hold `slot_bytes >= bytes`; regions are inside validated buffers; a slot
    // never overlaps a user buffer.
    unsafe {
        match *step {
            Step::Send { src, pre, .. } => {
                let s = region_ptr(&u.ops, &src, cur.done);
                let d = out_slot.expect("send slot");
                if pre {
                    u.ops[src.op as usize]
                        .reducer
                        .transform(&[d], s, n, true, false);
                } else {
                    std::ptr::copy_nonoverlapping(s, d, bytes);
                }
            }
            Step::Recv { dst, .. } => {
                std::ptr::copy_nonoverlapping(
                    incoming.expect("recv slot"),
                    region_ptr(&u.ops, &dst, cur.done),
                    bytes,
                );
            }
            Step::RecvReduce {
                local,
                pre_local,
                post,
                dst,
                ..
            } => {
                let l = region_ptr(&u.ops, &local, cur.done);
                let mut dsts: [*mut u8; 2] = [std::ptr::null_mut(); 2];
                let mut nd = 0;
                if let Some(d) = dst {
                    dsts[nd] = region_ptr(&u.ops, &d, cur.done);
                    nd += 1;
                }
                if let Some(s) = out_slot {
                    dsts[nd] = s;
                    nd += 1;
                }
                u.ops[local.op as usize].reducer.reduce(
                    &dsts[..nd],
                    incoming.expect("recv slot"),
                    l,
                    n,
                    pre_local,
                    post,
                );
            }
            Step::RecvCopy { dst, .. } => {
                let inc = incoming.expect("recv slot");
                if let Some(d) = dst {
                    std::ptr::copy_nonoverlapping(inc, region_ptr(&u.ops, &d, cur.done), bytes);
                }
                if let Some(s) = out_slot {
                    std::ptr::copy_nonoverlapping(inc, s, bytes);
                }
            }
            Step::Copy { .. } => unreachable!("handled above"),
        }
    }
    if let Some(from) = step.recv_from() {
        recv_port(u.conns, from, ch)?.release();
    }
    if let Some(to) = step.send_to() {
        send_port(u.conns, to, ch)?.commit(bytes);
    }
    cur.done += n;
    Ok(Moved::Yes)
}

/// Pieces a lane may move before the executor turns to the next lane, so that one busy lane
/// cannot starve the others (and their peers).
const BURST: usize = 16;

/// How long an operation may sit without progress once a rank of its communicator is known to
/// be dead, when the lane it waits on is not the dead rank's: an operation that still moves
/// (one that only needs live ranks, or finishing the tail of its work) completes, one that
/// waits on a rank that waits on the dead one fails. The peer it waits on fails too, so this
/// rarely matters; it bounds the case where that peer is not in a call at all.
const STALL_AFTER_DEATH: Duration = Duration::from_millis(50);

/// How long a launch waits for a rank of this process that never started it before it warns
/// that one thread may be driving both (the deadline error says it again).
pub(crate) const SIBLING_WARN_AFTER: Duration = Duration::from_secs(3);

/// Runs every unit to completion, or fails them all on the first error (after poisoning their
/// connections so that peers fail promptly instead of at their deadline).
pub(crate) fn execute(units: &mut [Unit], deadline: Instant) -> Result<(), Error> {
    let mut cursors: Vec<Vec<Cursor>> = units
        .iter()
        .map(|u| vec![Cursor::default(); u.plan.lanes.len()])
        .collect();
    let mut idle_rounds = 0u32;
    let mut last_check = Instant::now();
    let mut last_progress = Instant::now();
    let mut blocked: Vec<(usize, Blocked)> = Vec::new();
    let mut warned = false;
    loop {
        let mut moved = false;
        let mut remaining = false;
        blocked.clear();
        for (ui, u) in units.iter_mut().enumerate() {
            let plan = u.plan;
            for (li, lane) in plan.lanes.iter().enumerate() {
                let cur = &mut cursors[ui][li];
                let mut burst = 0;
                while let Some(step) = lane.steps.get(cur.step) {
                    match try_piece(u, lane.channel, step, cur).map_err(|e| e.context(&u.label))? {
                        Moved::Yes => {
                            moved = true;
                            if cur.done >= step.count() {
                                cur.step += 1;
                                cur.done = 0;
                            }
                            burst += 1;
                            if burst >= BURST {
                                break;
                            }
                        }
                        Moved::Blocked(b) => {
                            blocked.push((ui, b));
                            break;
                        }
                    }
                }
                if cur.step < lane.steps.len() {
                    remaining = true;
                }
            }
        }
        if !remaining {
            return Ok(());
        }
        if moved {
            idle_rounds = 0;
            continue;
        }
        idle_rounds += 1;
        let (ui, b) = *blocked
            .first()
            .expect("a remaining lane that did not move is blocked");
        let now = Instant::now();
        if idle_rounds == 1 {
            last_progress = now;
        }
        if now.duration_since(last_check) >= Duration::from_millis(20)
            || idle_rounds.is_multiple_of(64)
        {
            last_check = now;
            // The heartbeats' verdict on every peer we wait on (an atomic load while nobody
            // died); the process check (two syscalls) for the first one only: the heartbeats
            // cover the others within milliseconds anyway.
            for (i, &(ui, b)) in blocked.iter().enumerate() {
                check_health(&units[ui], b, now.duration_since(last_progress), i == 0)
                    .map_err(|e| e.context(&units[ui].label))?;
            }
            if now >= deadline {
                return Err(timeout_error(units, &blocked));
            }
            if !warned && now.duration_since(last_progress) >= SIBLING_WARN_AFTER {
                warned = true;
                let u = &units[ui];
                if let Some(h) = u.info.sibling_hint(waiting_for(u, b).0, u.seq) {
                    tracing::warn!("{}: waiting for {:?}. {h}", u.label, waiting_for(u, b).1);
                }
            }
        }
        if idle_rounds < 32 {
            std::hint::spin_loop();
            continue;
        }
        // One blocked lane: sleep on its FIFO until it moves. Several: sleep briefly, since the
        // one we sleep on may not be the one that moves first.
        let timeout = if blocked.len() == 1 {
            Duration::from_millis(10)
        } else {
            Duration::from_micros(100)
        };
        let u = &mut units[ui];
        match b {
            Blocked::Recv(p, ch) => recv_port(u.conns, p, ch)?.wait(timeout),
            Blocked::Send(p, ch) => send_port(u.conns, p, ch)?.wait(timeout),
        }
    }
}

fn waiting_for(u: &Unit, b: Blocked) -> (Rank, String) {
    match b {
        Blocked::Recv(p, ch) => (
            p,
            format!(
                "data from {} on channel {ch} over {}",
                u.info.peer_names[p], u.info.peer_via[p]
            ),
        ),
        Blocked::Send(p, ch) => (
            p,
            format!(
                "room in the connection to {} on channel {ch} over {}",
                u.info.peer_names[p], u.info.peer_via[p]
            ),
        ),
    }
}

/// Abort flag and peer liveness, checked while waiting on `b` for `stalled`; `process`: also
/// whether the peer's process still exists (same host only).
fn check_health(u: &Unit, b: Blocked, stalled: Duration, process: bool) -> Result<(), Error> {
    if u.abort.load(Ordering::Acquire) {
        return Err(Error::Aborted(
            "the communicator was aborted (Comm::abort)".into(),
        ));
    }
    if !u.health.is_failed() && !process {
        return Ok(());
    }
    let (peer, what) = waiting_for(u, b);
    let pid = u.info.peer_pids[peer];
    if process && pid != 0 && pid != std::process::id() && !pid_alive(pid) {
        return Err(Error::Remote(format!(
            "{} died (process {pid} is gone) while we waited for {what}",
            u.info.peer_names[peer]
        )));
    }
    if let Some(how) = u.health.gone(peer) {
        let e = u.health.failure().unwrap_or_else(|| {
            Error::Remote(format!(
                "{} {how}, so it will not take part in this operation (do all ranks call the same operations?)",
                u.info.peer_names[peer]
            ))
        });
        return Err(e.context(format!("waiting for {what}")));
    }
    if stalled >= STALL_AFTER_DEATH {
        if let Some(e) = u.health.failure() {
            return Err(e.context(format!("waiting for {what}")));
        }
    }
    Ok(())
}

/// The deadline passed: names every peer not heard from, so that the stuck rank stands out.
fn timeout_error(units: &[Unit], blocked: &[(usize, Blocked)]) -> Error {
    let (ui, _) = blocked[0];
    let mut peers: Vec<Rank> = blocked
        .iter()
        .filter(|(u, _)| *u == ui)
        .map(|(_, b)| waiting_for(&units[ui], *b).0)
        .collect();
    peers.sort_unstable();
    peers.dedup();
    let whats: Vec<String> = blocked
        .iter()
        .filter(|(u, _)| *u == ui)
        .map(|(_, b)| waiting_for(&units[ui], *b).1)
        .take(4)
        .collect();
    let u = &units[ui];
    let hint = peers
        .iter()
        .find_map(|&p| u.info.sibling_hint(p, u.seq))
        .map(|h| format!(". {h}"))
        .unwrap_or_default();
    Error::Timeout(format!(
        "{}: waited past the deadline (FERROCCL_TIMEOUT) for {}; not heard from rank(s) {peers:?}: they are stuck, \
         slow, or called a different operation (raise FERROCCL_TIMEOUT if they are only slow){hint}",
        u.label,
        whats.join("; ")
    ))
}
