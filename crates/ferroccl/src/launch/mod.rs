//! One launch: the operations of a call or a group, on one or several communicators.
//!
//! What every launch does before a backend sees it: lock each communicator (in address order,
//! so that two launches over the same communicators cannot deadlock), refuse a communicator
//! that failed earlier, compare the ranks' operations in check mode, then hand each backend its
//! communicators' operations. The backends plan and run them (`backend/host`, `backend/cuda`).

use crate::backend::cuda::Exchanged;
use crate::backend::host::{self, HostLaunch};
use crate::backend::Backend;
use crate::comm::Comm;
use crate::info::CommState;
use crate::mismatch::{self, Disagreement};
use crate::ops::{launch_label, OpArgs};
use ferroccl_core::Error;
use std::sync::MutexGuard;
use std::time::Duration;

mod fanout;
mod posts;

/// Runs `items` (each an operation on a communicator, in issue order) as one launch. GPU
/// communicators return once their work is enqueued; host ones once it is done.
pub(crate) fn launch(items: &[(&Comm, OpArgs)]) -> Result<(), Error> {
    match items {
        [] => Ok(()),
        // One operation on one communicator, the common call: nothing to group, sort or
        // collect, so it allocates nothing (the host cost of one call: docs/PERFORMANCE.md,
        // section 5).
        [(c, a)] => {
            let mut st = lock(c)?;
            run_locked(
                &[(c, std::slice::from_ref(a))],
                std::slice::from_mut(&mut st),
            )
        }
        _ => {
            // One entry per communicator, in first-use order, with its operations in issue
            // order.
            let mut grouped: Vec<(&Comm, Vec<OpArgs>)> = Vec::new();
            for (c, a) in items {
                match grouped.iter_mut().find(|(x, _)| std::ptr::eq(*x, *c)) {
                    Some((_, v)) => v.push(*a),
                    None => grouped.push((c, vec![*a])),
                }
            }
            let comms: Vec<(&Comm, &[OpArgs])> =
                grouped.iter().map(|(c, v)| (*c, v.as_slice())).collect();
            let mut order: Vec<usize> = (0..comms.len()).collect();
            order.sort_by_key(|&i| comms[i].0 as *const Comm as usize);
            let mut guards: Vec<Option<MutexGuard<CommState>>> =
                (0..comms.len()).map(|_| None).collect();
            for &i in &order {
                guards[i] = Some(lock(comms[i].0)?);
            }
            let mut states: Vec<MutexGuard<CommState>> =
                guards.into_iter().map(|g| g.expect("locked")).collect();
            run_locked(&comms, &mut states)
        }
    }
}

fn lock(c: &Comm) -> Result<MutexGuard<'_, CommState>, Error> {
    c.state
        .lock()
        .map_err(|_| Error::Internal("communicator state poisoned".into()))
}

/// The launch once every communicator is locked (`states[i]` is `comms[i]`'s).
fn run_locked(
    comms: &[(&Comm, &[OpArgs])],
    states: &mut [MutexGuard<CommState>],
) -> Result<(), Error> {
    for ((comm, _), st) in comms.iter().zip(states.iter()) {
        if let Some(e) = &st.failed {
            return Err(Error::Aborted(format!(
                "rank {}: the communicator failed earlier: {e}",
                comm.info.rank
            )));
        }
    }
    agree(comms, states)?;

    let gpus = comms
        .iter()
        .filter(|(c, _)| matches!(c.backend, Backend::Cuda(_)))
        .count();
    if gpus > 0 && gpus < comms.len() {
        return Err(Error::InvalidArgument(
            "a group cannot mix GPU and host communicators".into(),
        ));
    }
    if gpus == 0 {
        let mut members: Vec<HostLaunch> = comms
            .iter()
            .zip(states.iter_mut())
            .map(|((c, args), st)| {
                let Backend::Host(h) = &c.backend else {
                    unreachable!("counted above")
                };
                HostLaunch {
                    info: &c.info,
                    boot: &c.boot,
                    abort: &c.abort,
                    host: h,
                    state: st,
                    args,
                }
            })
            .collect();
        return host::launch(&mut members);
    }
    // Each GPU's work goes to its stream and the call returns; none waits for another's
    // completion. One communicator, the common call: launched here, nothing allocated.
    if let ([(c, args)], [st]) = (comms, &mut *states) {
        let exchanged = match rendezvous_one(c, st, args)? {
            Exchanged::Nothing => match posts::exchange(comms, std::slice::from_mut(st)) {
                None => Exchanged::Nothing,
                Some(mut v) => posted(v.pop().expect("one communicator"))?,
            },
            exchanged => exchanged,
        };
        return launch_one(c, st, args, exchanged);
    }
    let fars = rendezvous_many(comms, states);
    let mut posts = posts::exchange(comms, states).map(|v| v.into_iter());
    let mut fars: Vec<Result<Exchanged, Error>> = fars
        .into_iter()
        .map(|far| {
            let post = posts
                .as_mut()
                .map(|p| p.next().expect("one per communicator"));
            match (far?, post) {
                (Exchanged::Nothing, Some(p)) => posted(p),
                (exchanged, _) => Ok(exchanged),
            }
        })
        .collect();
    // Several communicators' launches from one thread are made at once by the launch helpers
    // where they are spinning (`fanout`), else here in turn. Every one is made; the first
    // failure, in the group's order of communicators, is returned (each failed communicator is
    // marked failed, as its peers may have launched their side).
    let mut results: Vec<Result<(), Error>> = comms.iter().map(|_| Ok(())).collect();
    {
        let mut jobs: Vec<_> = comms
            .iter()
            .zip(states.iter_mut())
            .zip(results.iter_mut())
            .zip(fars.iter_mut())
            .map(|((((c, args), st), out), far)| {
                let st: &mut CommState = st;
                // A communicator whose rendezvous failed is not launched (it is marked failed);
                // the others are, as their peers exchanged and launched alike.
                move || {
                    *out = match std::mem::replace(far, Ok(Exchanged::Nothing)) {
                        Ok(exchanged) => launch_one(c, st, args, exchanged),
                        Err(e) => Err(e),
                    }
                }
            })
            .collect();
        let mut erased: Vec<fanout::Job<'_>> =
            jobs.iter_mut().map(|j| j as fanout::Job<'_>).collect();
        let spin = Duration::from_micros(comms[0].0.info.config.launch_spin_us);
        fanout::run(spin, &mut erased);
    }
    results.into_iter().collect()
}

/// What the posted-receive rendezvous found for one communicator, as its launch takes it.
fn posted(r: Result<Option<posts::Ways>, Error>) -> Result<Exchanged, Error> {
    Ok(match r? {
        Some(ways) if ways.iter().any(Option::is_some) => Exchanged::Posted(ways),
        _ => Exchanged::Nothing,
    })
}

/// One GPU communicator's share of a launch, with what its ranks exchanged before it.
fn launch_one(
    c: &Comm,
    st: &mut CommState,
    args: &[OpArgs],
    exchanged: Exchanged,
) -> Result<(), Error> {
    let Backend::Cuda(cuda) = &c.backend else {
        unreachable!("counted above")
    };
    cuda.launch(&c.info, st, args, exchanged).map_err(|e| {
        // Peers may have launched their side already: this communicator cannot be trusted.
        st.failed.get_or_insert_with(|| e.clone());
        e.context(format!("rank {} of {}", c.info.rank, c.info.nranks))
    })
}

/// The rendezvous before a data-movement collective, a copy-and-fold reduction or a pulled reduce
/// alone in its launch on a GPU communicator (`CudaComm::rendezvous_posting`, which says whether
/// the ranks have one): every rank posts where its output (a pulled reduce's non-root: its input)
/// lies, over the bootstrap ring, and learns where its copy engines may write or its root may
/// read (`CudaComm::rendezvous_far`). The call waits for every rank's; a failed exchange leaves the
/// ring out of step, so the communicator is marked failed. Nothing is allocated where there is
/// no rendezvous (the common call).
fn rendezvous_one(c: &Comm, st: &mut CommState, args: &[OpArgs]) -> Result<Exchanged, Error> {
    let (Backend::Cuda(cuda), [a]) = (&c.backend, args) else {
        return Ok(Exchanged::Nothing);
    };
    match cuda.rendezvous_posting(a, &c.info, &c.abort) {
        Ok(Some(mine)) => exchange_postings(c, st, a, &mine),
        Ok(None) => Ok(Exchanged::Nothing),
        Err(e) => Err(failed(st, e)),
    }
}

/// Marks the communicator failed with `e` (its peers may be waiting in an exchange it left) and
/// gives `e` back.
fn failed(st: &mut CommState, e: Error) -> Error {
    st.failed.get_or_insert_with(|| e.clone());
    e
}

fn exchange_postings(
    c: &Comm,
    st: &mut CommState,
    a: &OpArgs,
    mine: &[u8],
) -> Result<Exchanged, Error> {
    let Backend::Cuda(cuda) = &c.backend else {
        unreachable!("a posting comes from a GPU communicator")
    };
    let label = launch_label(std::slice::from_ref(a), st.seq + 1, &c.info);
    let rows = c.boot.allgather(mine).map_err(|e| {
        failed(
            st,
            e.context(format!("{label}: exchanging outputs' places")),
        )
    })?;
    // Every rank got the same rows; a rank that cannot use them fails alone (its peers wait on
    // copies that never come): the communicator cannot be trusted.
    cuda.rendezvous_far(a, &c.info, &rows)
        .map_err(|e| failed(st, e.context(label)))
}

/// The rendezvous of each communicator of a launch of several (`rendezvous_one`), each on a
/// thread of its own where more than one has one: one thread driving ranks of one job in a
/// group, whose exchanges would wait on each other in turn, or processes that grouped their
/// communicators in different orders.
fn rendezvous_many(
    comms: &[(&Comm, &[OpArgs])],
    states: &mut [MutexGuard<CommState>],
) -> Vec<Result<Exchanged, Error>> {
    let postings: Vec<Result<Option<Vec<u8>>, Error>> = comms
        .iter()
        .map(|(c, args)| match (&c.backend, args) {
            (Backend::Cuda(cuda), [a]) => cuda.rendezvous_posting(a, &c.info, &c.abort),
            _ => Ok(None),
        })
        .collect();
    let wanted = postings.iter().filter(|p| matches!(p, Ok(Some(_)))).count();
    enum Pending<'s, T> {
        Done(T),
        Running(std::thread::ScopedJoinHandle<'s, T>),
    }
    std::thread::scope(|s| {
        let pending: Vec<_> = comms
            .iter()
            .zip(states.iter_mut())
            .zip(postings)
            .map(|(((c, args), st), p)| {
                let st: &mut CommState = st;
                match p {
                    Ok(Some(mine)) if wanted > 1 => {
                        Pending::Running(s.spawn(move || exchange_postings(c, st, &args[0], &mine)))
                    }
                    Ok(Some(mine)) => Pending::Done(exchange_postings(c, st, &args[0], &mine)),
                    Ok(None) => Pending::Done(Ok(Exchanged::Nothing)),
                    Err(e) => Pending::Done(Err(failed(st, e))),
                }
            })
            .collect();
        pending
            .into_iter()
            .map(|p| match p {
                Pending::Done(r) => r,
                Pending::Running(h) => h.join().unwrap_or_else(|_| {
                    Err(Error::Internal("a rendezvous thread panicked".into()))
                }),
            })
            .collect()
    })
}

/// Check mode (`FERROCCL_CHECK_MISMATCH`): the communicators that have it on and a collective
/// in this launch compare every rank's operations before anything moves.
fn agree(comms: &[(&Comm, &[OpArgs])], states: &mut [MutexGuard<CommState>]) -> Result<(), Error> {
    let checked: Vec<usize> = (0..comms.len())
        .filter(|&i| {
            comms[i].0.info.config.check_mismatch
                && comms[i]
                    .1
                    .iter()
                    .any(|a| mismatch::involves_every_rank(a.kind))
        })
        .collect();
    if checked.is_empty() {
        return Ok(());
    }
    let sigs: Vec<Vec<u8>> = checked
        .iter()
        .map(|&i| mismatch::signature(states[i].seq + 1, comms[i].1))
        .collect();
    let boots: Vec<_> = checked.iter().map(|&i| &comms[i].0.boot).collect();
    let mut first: Option<Error> = None;
    for (&i, r) in checked.iter().zip(mismatch::agree(&boots, &sigs)) {
        let (comm, args) = &comms[i];
        let label = launch_label(args, states[i].seq + 1, &comm.info);
        let e = match r {
            Ok(()) => continue,
            // Nothing moved and every rank fails alike: the communicator stays usable.
            Err(Disagreement::Mismatch(m)) => Error::InvalidArgument(format!(
                "{label}: the ranks called different operations (found by FERROCCL_CHECK_MISMATCH before any data \
                 moved): {m}. Every rank must issue the same collectives, with the same count, data type, \
                 reduction and root, in the same order, and matching sends and receives"
            )),
            // The ring may be out of step now, so later calls must not trust it.
            Err(Disagreement::Exchange(e)) => {
                let e = e.context(format!("{label}: exchanging operation signatures (FERROCCL_CHECK_MISMATCH)"));
                states[i].failed.get_or_insert_with(|| e.clone());
                e
            }
        };
        first.get_or_insert(e);
    }
    first.map_or(Ok(()), Err)
}
