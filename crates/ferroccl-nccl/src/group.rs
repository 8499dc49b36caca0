//! NCCL's groups: between `ncclGroupStart` and `ncclGroupEnd` a thread's operations (on any of
//! its communicators) and communicator creations are collected, and the end runs them
//! together: the creations at once, each on a thread of its own (one thread may create every
//! rank of a job), then the operations as one ferroccl launch, where sends and receives in any
//! order cannot deadlock. Outside a group each operation is a group of one. Splits and shrinks
//! are creations too; those of one parent communicator run in call order, as its window
//! registrations do. A group holding a non-blocking creation ends with `ncclInProgress`, its
//! creations finishing on a thread of their own; a simulated end estimates and drops the
//! operations.

use crate::abi::RawStream;
use crate::fail::{Fail, Res};
use crate::handle::Handle;
use ferroccl::{Comm, Group, OpArgs};
use std::cell::RefCell;
use std::sync::Arc;

/// A creation waiting for its group's end. None: the rank takes part but gets no communicator
/// (a split without a color).
pub type InitJob = Box<dyn FnOnce() -> Result<Option<Comm>, Fail> + Send>;

/// A creation of the group: the communicator it splits or shrinks (its handle's address; None
/// for one made from a unique id), the new handle, and the job.
pub type Init = (Option<usize>, Arc<Handle>, InitJob);

/// A collective call on an existing communicator (window registration)
/// waiting for its group's end, where the group's such calls run a thread per communicator:
/// one thread may register a window on every rank it drives, and one communicator's calls keep
/// the order they were made in.
pub type CollJob = Box<dyn FnOnce() -> Res + Send>;

#[derive(Default)]
struct State {
    depth: u32,
    ops: Vec<(Arc<Handle>, OpArgs, RawStream)>,
    inits: Vec<Init>,
    /// By communicator (its handle's address), in call order.
    colls: Vec<(usize, CollJob)>,
    /// A creation in the group asked not to block: the group's end returns `ncclInProgress`
    /// and the creations finish in the background.
    nonblocking: bool,
}

/// `ncclInProgress`: not a failure; the caller polls `ncclCommGetAsyncError`.
pub fn in_progress() -> Fail {
    Fail {
        code: crate::abi::IN_PROGRESS,
        msg: String::new(),
    }
}

/// Runs `inits` (then `colls`) on a thread of their own; their handles report "in progress"
/// until done.
pub fn in_background(inits: Vec<Init>, colls: Vec<(usize, CollJob)>) -> Res {
    std::thread::Builder::new()
        .name("ferroccl-nccl-init".into())
        .spawn(move || {
            let _ = run_inits(inits);
            let _ = run_colls(colls);
        })
        .map(|_| ())
        .map_err(|e| Fail {
            code: crate::abi::SYSTEM_ERROR,
            msg: format!("starting a non-blocking creation: {e}"),
        })
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

pub fn in_group() -> bool {
    STATE.with(|s| s.borrow().depth > 0)
}

pub fn start() -> Res {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.depth = s
            .depth
            .checked_add(1)
            .ok_or_else(|| Fail::usage("groups nested too deep"))?;
        Ok(())
    })
}

/// Ends one level; the outermost runs what was collected.
pub fn end() -> Res {
    let (inits, colls, ops, nonblocking) = take_level()?;
    if nonblocking {
        in_background(inits, colls)?;
        if !ops.is_empty() {
            launch(&ops)?;
        }
        return Err(in_progress());
    }
    let inited = run_inits(inits);
    let collected = run_colls(colls);
    let launched = if ops.is_empty() { Ok(()) } else { launch(&ops) };
    inited.and(collected).and(launched)
}

/// Ends one level as `end` does, except that the outermost estimates its operations' time
/// instead of running them (they are dropped); creations in the group still happen. None for
/// an inner level, which estimates nothing (as NCCL: the outermost end decides).
pub fn simulate_end() -> Res<Option<f64>> {
    let outermost = STATE.with(|s| s.borrow().depth == 1);
    let (inits, colls, ops, nonblocking) = take_level()?;
    if nonblocking {
        in_background(inits, colls)?;
    } else {
        run_inits(inits)?;
        run_colls(colls)?;
    }
    if !outermost {
        return Ok(None);
    }
    let mut g = Group::new();
    for (h, args, _) in &ops {
        // SAFETY: nothing runs: the group is only estimated, then dropped.
        unsafe { g.push_raw(h.comm()?, *args) }?;
    }
    Ok(Some(g.estimate_us()))
}

/// What a group's end takes: its creations, its collective calls, its operations, whether a
/// creation is non-blocking.
type Level = (
    Vec<Init>,
    Vec<(usize, CollJob)>,
    Vec<(Arc<Handle>, OpArgs, RawStream)>,
    bool,
);

/// Leaves one level: what the outermost level collected, nothing for an inner one.
fn take_level() -> Res<Level> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.depth == 0 {
            return Err(Fail::usage(
                "ncclGroupEnd without a matching ncclGroupStart",
            ));
        }
        s.depth -= 1;
        if s.depth > 0 {
            return Ok((Vec::new(), Vec::new(), Vec::new(), false));
        }
        Ok((
            std::mem::take(&mut s.inits),
            std::mem::take(&mut s.colls),
            std::mem::take(&mut s.ops),
            std::mem::take(&mut s.nonblocking),
        ))
    })
}

/// Creates a communicator now, or at the group's end inside a group; a non-blocking one on a
/// thread of its own, answering `ncclInProgress` at once. `parent`: the communicator a split or
/// shrink runs on (its handle's address).
pub fn init(parent: Option<usize>, h: Arc<Handle>, blocking: bool, job: InitJob) -> Res {
    if in_group() {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.inits.push((parent, h, job));
            s.nonblocking |= !blocking;
        });
        return Ok(());
    }
    if !blocking {
        in_background(vec![(parent, h, job)], Vec::new())?;
        return Err(in_progress());
    }
    let r = job();
    let out = r.as_ref().map(|_| ()).map_err(Clone::clone);
    h.complete(r);
    out
}

/// The group's creations at once (`run_lanes`): the ranks of one job created from one thread
/// must meet in their rendezvous. Splits and shrinks of one parent communicator share a lane, in
/// call order: each is collective over the parent and pairs with its peers' by order, as window
/// registrations do (`run_colls`); a creation from a unique id has a lane of its own.
fn run_inits(inits: Vec<Init>) -> Res {
    let jobs = inits
        .into_iter()
        .map(|(parent, h, job)| -> (Option<usize>, CollJob) {
            (
                parent,
                Box::new(move || {
                    let r = job();
                    let out = r.as_ref().map(|_| ()).map_err(Clone::clone);
                    h.complete(r);
                    out
                }),
            )
        });
    run_lanes(lanes_by(jobs))
}

/// A collective call on communicator `comm` (its handle's address): now outside a group, at
/// the group's end inside one (after its creations, before its operations).
pub fn collective(comm: usize, job: CollJob) -> Res {
    if in_group() {
        STATE.with(|s| s.borrow_mut().colls.push((comm, job)));
        return Ok(());
    }
    job()
}

/// The group's collective calls, a lane per communicator in call order (`run_lanes`). Each
/// rank's calls are matched with its peers' by their order (two window registrations on one
/// communicator pair up first with first), so one communicator's calls must not race each
/// other: run at once, a rank could take its second registration first and pair its receive
/// buffer with its peer's send buffer (nccl-tests `-R 2` registers both in one group).
fn run_colls(colls: Vec<(usize, CollJob)>) -> Res {
    run_lanes(lanes_by(colls.into_iter().map(|(c, job)| (Some(c), job))))
}

/// Jobs in lanes: those of one communicator (`Some` key) in one lane, in order; each unkeyed
/// job in a lane of its own.
fn lanes_by(jobs: impl Iterator<Item = (Option<usize>, CollJob)>) -> Vec<Vec<CollJob>> {
    let mut lanes: Vec<(Option<usize>, Vec<CollJob>)> = Vec::new();
    for (key, job) in jobs {
        match lanes.iter_mut().find(|(k, _)| key.is_some() && *k == key) {
            Some((_, lane)) => lane.push(job),
            None => lanes.push((key, vec![job])),
        }
    }
    lanes.into_iter().map(|(_, lane)| lane).collect()
}

/// Runs every lane at once, a thread each, and a lane's jobs one after another in order: all
/// of them, a failed one too (its peers' calls wait for this rank's next ones); the first
/// failure is the group's.
fn run_lanes(lanes: Vec<Vec<CollJob>>) -> Res {
    let run = |lane: Vec<CollJob>| -> Res {
        let mut first = Ok(());
        for job in lane {
            let r = job();
            if first.is_ok() {
                first = r;
            }
        }
        first
    };
    match lanes.len() {
        0 => Ok(()),
        1 => run(lanes.into_iter().next().expect("one")),
        _ => std::thread::scope(|s| {
            let hs: Vec<_> = lanes
                .into_iter()
                .map(|lane| s.spawn(move || run(lane)))
                .collect();
            let results: Vec<Res> = hs
                .into_iter()
                .map(|j| {
                    j.join().unwrap_or_else(|_| {
                        Err(Fail {
                            code: crate::abi::INTERNAL_ERROR,
                            msg: "a collective call of the group panicked".into(),
                        })
                    })
                })
                .collect();
            results.into_iter().collect()
        }),
    }
}

/// An operation on `h`: checked now (a bad argument fails this call and is not kept), run now
/// outside a group, at the group's end inside one.
pub fn submit(h: Arc<Handle>, args: OpArgs, stream: RawStream) -> Res {
    if !in_group() {
        // The launch checks it as it adds it: nothing runs if the check fails.
        return launch(&[(h, args, stream)]);
    }
    {
        let comm = h.comm()?;
        let mut check = Group::new();
        // SAFETY: nothing runs: the group is dropped unlaunched; push_raw only checks.
        unsafe { check.push_raw(comm, args) }?;
    }
    STATE.with(|s| s.borrow_mut().ops.push((h, args, stream)));
    Ok(())
}

/// NCCL's stream 0 is the legacy default stream (CU_STREAM_LEGACY), which orders with the
/// caller's other work on it; ferroccl's null stream would be the communicator's own.
fn cuda_stream(s: RawStream) -> RawStream {
    if s.is_null() {
        0x1 as RawStream
    } else {
        s
    }
}

fn launch(ops: &[(Arc<Handle>, OpArgs, RawStream)]) -> Res {
    if let [(h, args, stream)] = ops {
        // One operation (every call outside a group): one stream, nothing to order.
        let comm = h.comm()?;
        if comm.gpu().is_some() {
            // SAFETY: the caller's stream, valid for its operation by NCCL's contract.
            unsafe { comm.set_stream(cuda_stream(*stream)) };
        }
        // SAFETY: the caller's buffers, valid until the operation completes (NCCL's contract).
        return unsafe { comm.run_raw(args) }.map_err(Fail::from);
    }
    // ferroccl enqueues a communicator's share of a launch as one kernel, on one stream: the
    // first its operations name. Where they name others too (NCCL allows it), the launch
    // stream first waits for those, and they wait for it after the launch, as NCCL orders
    // them. Host communicators have no streams.
    let mut streams: Vec<(&Handle, Vec<RawStream>)> = Vec::new();
    for (h, _, s) in ops {
        let s = cuda_stream(*s);
        match streams
            .iter_mut()
            .find(|(p, _)| std::ptr::eq(*p, Arc::as_ptr(h)))
        {
            Some((_, list)) if !list.contains(&s) => list.push(s),
            Some(_) => {}
            None => streams.push((h, vec![s])),
        }
    }
    let mut g = Group::new();
    for (h, list) in &streams {
        let comm = h.comm()?;
        if let Some(gpu) = comm.gpu() {
            let (main, others) = list.split_first().expect("one stream at least");
            for &o in others {
                // SAFETY: the caller's streams of this GPU, live by NCCL's contract.
                unsafe { ferroccl::cuda::stream::order_after(gpu, *main as _, o as _) }
                    .map_err(Fail::from)?;
            }
            // SAFETY: as above.
            unsafe { comm.set_stream(*main) };
        }
    }
    for (h, args, _) in ops {
        // SAFETY: the buffers are the caller's, valid until the operations complete (NCCL's
        // contract: on the host backend that is when this returns).
        unsafe { g.push_raw(h.comm()?, *args) }?;
    }
    g.launch().map_err(Fail::from)?;
    for (h, list) in &streams {
        let comm = h.comm()?;
        if let (Some(gpu), [main, others @ ..]) = (comm.gpu(), list.as_slice()) {
            for &o in others {
                // SAFETY: as above.
                unsafe { ferroccl::cuda::stream::order_after(gpu, o as _, *main as _) }
                    .map_err(Fail::from)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::Mutex;
    use std::time::Duration;

    /// One communicator's calls run in call order, however long the first takes, and every one
    /// of them runs though an earlier one failed; different communicators' calls run at once
    /// (each here waits for the other's word, which calls run one after another would never
    /// send).
    #[test]
    fn a_groups_calls_keep_their_order_per_communicator_and_run_at_once_across() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (to_b, from_a) = mpsc::channel::<()>();
        let (to_a, from_b) = mpsc::channel::<()>();
        let log = |what: &'static str, seen: &Arc<Mutex<Vec<&'static str>>>| {
            seen.lock().unwrap().push(what)
        };
        let (s1, s2, s3) = (seen.clone(), seen.clone(), seen.clone());
        let colls: Vec<(usize, CollJob)> = vec![
            (
                1,
                Box::new(move || {
                    to_b.send(()).unwrap();
                    from_b
                        .recv_timeout(Duration::from_secs(10))
                        .map_err(|_| Fail::usage("communicator 2's call never ran beside"))?;
                    std::thread::sleep(Duration::from_millis(50));
                    log("1: first", &s1);
                    Err(Fail::usage("the first call fails"))
                }),
            ),
            (
                2,
                Box::new(move || {
                    to_a.send(()).unwrap();
                    from_a
                        .recv_timeout(Duration::from_secs(10))
                        .map_err(|_| Fail::usage("communicator 1's call never ran beside"))?;
                    Ok(())
                }),
            ),
            (
                1,
                Box::new(move || {
                    log("1: second", &s2);
                    Ok(())
                }),
            ),
            (
                1,
                Box::new(move || {
                    log("1: third", &s3);
                    Ok(())
                }),
            ),
        ];
        let r = run_colls(colls);
        assert_eq!(r.unwrap_err().msg, "the first call fails");
        assert_eq!(*seen.lock().unwrap(), ["1: first", "1: second", "1: third"]);
    }

    /// Splits and shrinks of one parent run in call order; those of different parents, and
    /// creations from unique ids, at once (each pair here waits for the other's word): two
    /// creations from ids driven by one thread must meet, as two ranks' splits of their parents.
    #[test]
    fn a_groups_creations_keep_their_order_per_parent_and_run_at_once_across() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        // Two jobs that each need the other running beside it.
        let meet = || {
            let (a_tx, a_rx) = mpsc::channel::<()>();
            let (b_tx, b_rx) = mpsc::channel::<()>();
            let side = |tx: mpsc::Sender<()>, rx: mpsc::Receiver<()>| -> InitJob {
                Box::new(move || {
                    tx.send(()).unwrap();
                    rx.recv_timeout(Duration::from_secs(10))
                        .map_err(|_| Fail::usage("the other creation never ran beside"))?;
                    Ok(None)
                })
            };
            (side(a_tx, b_rx), side(b_tx, a_rx))
        };
        let (fresh_a, fresh_b) = meet();
        let (split_a, split_b) = meet();
        let logged = |what: &'static str, pause: u64| -> InitJob {
            let seen = seen.clone();
            Box::new(move || {
                std::thread::sleep(Duration::from_millis(pause));
                seen.lock().unwrap().push(what);
                Ok(None)
            })
        };
        let pending = || Arc::new(Handle::pending());
        let inits: Vec<Init> = vec![
            (None, pending(), fresh_a),
            (Some(7), pending(), split_a),
            (Some(7), pending(), logged("7: second", 50)),
            (Some(7), pending(), logged("7: third", 0)),
            (None, pending(), fresh_b),
            (Some(9), pending(), split_b),
        ];
        // Ok only if each pair met (a creation that waited in vain fails).
        run_inits(inits).unwrap();
        assert_eq!(*seen.lock().unwrap(), ["7: second", "7: third"]);
    }
}
