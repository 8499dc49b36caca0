//! The host backend: "device memory" is host memory; plans run on the calling thread, over
//! shared-memory FIFOs between ranks of one host and TCP sockets between hosts.
//!
//! Its launch path ([`launch`]): plan every communicator's share (the tuner's choices, pure),
//! make the connections the plans need in two phases over all of them, run every plan in one
//! executor, and on failure find the explanation that names the cause (a dead peer, our own
//! abort, a peer's report) and poison every FIFO so that peers fail at once too.

pub(crate) mod conns;
pub(crate) mod exec;

use crate::bootstrap::Bootstrap;
use crate::info::{CommInfo, CommState};
use crate::ops::{plan_launch, OpArgs, Planned};
use crate::transport::FifoMem;
use conns::{ConnCtx, Conns};
use exec::{execute, OpBufs, Unit};
use ferroccl_core::numeric::Reducer;
use ferroccl_core::Error;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a failing launch waits for better explanations and for its own to go out.
const FAILURE_GRACE: Duration = Duration::from_millis(200);

/// How long `abort` waits for another thread's launch to let go of the connections.
const ABORT_RELEASE_WAIT: Duration = Duration::from_secs(2);

/// A host communicator's own state: its connections, made the first time a plan needs them.
pub(crate) struct HostComm {
    /// Every FIFO of the communicator, so that `abort` can poison them without taking the lock
    /// a running launch holds.
    fifos: Arc<Mutex<Vec<Arc<FifoMem>>>>,
    conns: Mutex<Conns>,
}

impl HostComm {
    pub fn new(boot: &Bootstrap) -> HostComm {
        let fifos = Arc::new(Mutex::new(Vec::new()));
        // A death names its segments' leftovers at once, whether or not a launch notices it:
        // a process that exits without dropping its communicator still leaves /dev/shm clean.
        // Weak: the health owns its hooks, and this one must not keep it alive.
        let (id, me, health) = (boot.comm_id(), boot.rank(), Arc::downgrade(boot.health()));
        boot.health().on_failure(move || {
            if let Some(h) = health.upgrade() {
                Conns::unlink_left_by(id, me, &h.dead());
            }
        });
        HostComm {
            conns: Mutex::new(Conns::new(fifos.clone())),
            fifos,
        }
    }

    /// Poisons every FIFO with `reason`, so that peers waiting on us fail at once.
    pub fn poison(&self, reason: &str) {
        Conns::poison_all(&self.fifos, reason);
    }

    /// After an abort: frees the connections once a launch running in another thread lets go
    /// of them (it sees the abort flag within milliseconds); after `ABORT_RELEASE_WAIT` they go
    /// with the drop.
    pub fn release(&self) {
        let until = Instant::now() + ABORT_RELEASE_WAIT;
        loop {
            match self.conns.try_lock() {
                Ok(mut c) => return c.release(),
                Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner().release(),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(std::sync::TryLockError::WouldBlock) => return,
            }
        }
    }

    /// Closes our ends of every connection: peers still reading what we sent keep their
    /// mapping, and learn that we are gone rather than slow.
    pub fn close(&self, boot: &Bootstrap) {
        if let Ok(mut c) = self.conns.lock() {
            c.send.clear();
            c.recv.clear();
        }
        // Ranks that died after the first failure (its hook ran once).
        Conns::unlink_left_by(boot.comm_id(), boot.rank(), &boot.health().dead());
    }
}

/// One communicator's share of a host launch, with its lock held by the caller.
pub(crate) struct HostLaunch<'a> {
    pub info: &'a CommInfo,
    pub boot: &'a Bootstrap,
    pub abort: &'a Arc<AtomicBool>,
    pub host: &'a HostComm,
    pub state: &'a mut CommState,
    pub args: &'a [OpArgs],
}

/// Runs every communicator's share of a launch on this thread and returns when all are done.
pub(crate) fn launch(members: &mut [HostLaunch]) -> Result<(), Error> {
    // Plans (pure) first: any inconsistency is an argument error before anything moves.
    let mut planned: Vec<Planned> = Vec::with_capacity(members.len());
    let mut bufs: Vec<Vec<OpBufs>> = Vec::with_capacity(members.len());
    for m in members.iter_mut() {
        let p = plan_launch(m.info, m.args, false, &|_| (false, false))?;
        m.state.log_choices(m.info, &p.shapes, &p.choices);
        planned.push(p);
        let ops = m.args.iter().map(|a| {
            Ok(OpBufs {
                send: a.send,
                recv: a.recv,
                reducer: Reducer::new(a.dtype, a.redop(), m.info.nranks)?,
            })
        });
        bufs.push(ops.collect::<Result<_, Error>>()?);
    }
    // Connections locked in address order, so that two launches over the same communicators
    // cannot deadlock each other.
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.sort_by_key(|&i| members[i].host as *const HostComm as usize);
    let mut guards: Vec<Option<MutexGuard<Conns>>> = (0..members.len()).map(|_| None).collect();
    for &i in &order {
        guards[i] = Some(
            members[i]
                .host
                .conns
                .lock()
                .map_err(|_| Error::Internal("connections lock poisoned".into()))?,
        );
    }
    let mut conns: Vec<MutexGuard<Conns>> =
        guards.into_iter().map(|g| g.expect("locked")).collect();

    let deadline = Instant::now()
        + members
            .iter()
            .map(|m| m.info.config.timeout)
            .min()
            .expect("a communicator");
    let labels: Vec<String> = members
        .iter_mut()
        .map(|m| {
            m.state.seq += 1;
            m.info.entered(m.state.seq);
            crate::ops::launch_label(m.args, m.state.seq, m.info)
        })
        .collect();

    let result = (|| {
        for phase in 0..2 {
            for (ci, m) in members.iter().enumerate() {
                let keys = planned[ci].plan.connections();
                let ctx = ConnCtx {
                    boot: m.boot,
                    info: m.info,
                    seq: m.state.seq,
                    abort: m.abort,
                    deadline,
                };
                if let Some(e) = m.boot.health().failure() {
                    return Err(e.context(&labels[ci]));
                }
                let c = &mut conns[ci];
                let r = if phase == 0 {
                    c.setup_phase1(&keys, &ctx)
                } else {
                    c.setup_phase2(&keys, &ctx)
                };
                r.map_err(|e| e.context(&labels[ci]))?;
            }
        }
        let mut units: Vec<Unit> = Vec::with_capacity(members.len());
        for (((m, p), c), (ops, label)) in members
            .iter()
            .zip(&planned)
            .zip(conns.iter_mut())
            .zip(bufs.drain(..).zip(&labels))
        {
            let (abort, health, seq) = (m.abort, m.boot.health(), m.state.seq);
            units.push(Unit {
                plan: &p.plan,
                ops,
                conns: c,
                abort,
                label: label.clone(),
                info: m.info,
                health,
                seq,
            });
        }
        execute(&mut units, deadline)
    })();

    result.map_err(|e| {
        // A dead peer is the cause that matters, whichever symptom showed first here; the
        // heartbeats name it within milliseconds of a death, so wait for them a moment.
        let e = if let Some(label) = members
            .iter()
            .zip(&labels)
            .find(|(m, _)| m.abort.load(Ordering::Acquire))
            .map(|x| x.1)
        {
            // Our own abort explains everything, including the poison it spread.
            Error::Aborted(format!(
                "{label}: the communicator was aborted (Comm::abort)"
            ))
        } else if let Some(d) = dead_peer_error(members, &labels, &e) {
            d
        } else {
            // Remote peers' reports arrive a moment after the bare EOF their exit causes.
            conns
                .first()
                .map(|c| c.explain(e.clone(), FAILURE_GRACE))
                .unwrap_or(e)
        };
        for m in members.iter_mut() {
            m.state.failed.get_or_insert_with(|| e.clone());
            Conns::poison_all(&m.host.fifos, &format!("rank {} failed: {e}", m.info.rank));
        }
        for c in &conns {
            c.flush_failure(FAILURE_GRACE);
        }
        e
    })
}

/// The failure the heartbeats report for one of `members`, as the error of this launch, when
/// `e` is the kind of error a dead peer causes (not a bad argument, not our own abort).
fn dead_peer_error(members: &[HostLaunch], labels: &[String], e: &Error) -> Option<Error> {
    if !matches!(e, Error::Remote(_) | Error::Timeout(_) | Error::Protocol(_)) {
        return None;
    }
    let until = Instant::now() + FAILURE_GRACE;
    loop {
        for (m, label) in members.iter().zip(labels) {
            if let Some(h) = m.boot.health().failure() {
                return Some(h.context(label));
            }
        }
        if Instant::now() >= until || matches!(e, Error::Timeout(_)) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
