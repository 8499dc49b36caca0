//! Groups: several operations, on one or several communicators, launched as one.
//!
//! Within a group, sends and receives between any ranks in any order cannot deadlock (each peer
//! direction is its own lane), collectives run in issue order, and one thread can drive every
//! rank of a communicator (`Comm::init_all`) because all their plans run in one executor.

use crate::backend::host::conns::{ConnCtx, Conns};
use crate::backend::cuda::devplan::{ll_limit, use_ll, OpDesc};
use crate::backend::host::exec::{execute, OpBufs, Unit};
use crate::comm::{Comm, CommState};
use crate::mismatch::{self, CheckFailure};
use crate::ops::OpArgs;
use ferroccl_core::algo::{build, CollDesc, Tuning};
use ferroccl_core::numeric::{Element, Reducer};
use ferroccl_core::plan::zcopy::{may_post, peer_desc, remote_dsts};
use ferroccl_core::plan::{BufKind, Lane, Plan, Region, Step};
use ferroccl_core::{CollKind, Error, Rank, ReduceOp};
use std::marker::PhantomData;
use std::sync::MutexGuard;
use std::time::Instant;

/// Operations collected for one launch. The lifetime ties the group to the buffers it holds.
#[derive(Default)]
pub struct Group<'a> {
    items: Vec<(&'a Comm, OpArgs)>,
    _buffers: PhantomData<&'a mut [u8]>,
}

/// How long a failing launch waits for better explanations and for its own to go out.
const FAILURE_GRACE: std::time::Duration = std::time::Duration::from_millis(200);

/// Lane id of a rank's sends to itself (plain copies, no connection).
const SELF_LANE: u64 = u64::MAX;

impl<'a> Group<'a> {
    pub fn new() -> Group<'a> {
        Group { items: Vec::new(), _buffers: PhantomData }
    }

    /// Adds an operation on raw buffers, checking its arguments now (an invalid one is
    /// rejected and the group is unchanged).
    ///
    /// # Safety
    /// The buffers must stay valid, and untouched by others, until `launch` returns.
    pub unsafe fn push_raw(&mut self, comm: &'a Comm, args: OpArgs) -> Result<(), Error> {
        args.validate(comm.info.rank, comm.info.nranks)
            .map_err(|e| e.context(format!("rank {} of {}", comm.info.rank, comm.info.nranks)))?;
        if args.device_scalar.is_some() && comm.cuda.is_none() {
            return Err(Error::InvalidArgument(format!(
                "{}: a device pre-mul-sum scalar needs a GPU communicator; rank {} runs on the host (use ReduceOp::PreMulSum(value))",
                args.kind, comm.info.rank
            )));
        }
        comm.check_usable(args.kind.name())?;
        self.items.push((comm, args));
        Ok(())
    }

    /// Adds a typed operation (see [`Comm::run`] for how the count follows from the buffers).
    pub fn push<T: Element>(&mut self, comm: &'a Comm, kind: CollKind, send: &'a [T], recv: &'a mut [T], op: ReduceOp, root: Rank) -> Result<(), Error> {
        let args = comm.typed_args(kind, send, recv, op, root)?;
        // SAFETY: the slices are borrowed for 'a, which outlives the group.
        unsafe { self.push_raw(comm, args) }
    }

    /// Adds a typed in-place operation.
    pub fn push_in_place<T: Element>(&mut self, comm: &'a Comm, kind: CollKind, buf: &'a mut [T], op: ReduceOp, root: Rank) -> Result<(), Error> {
        let args = comm.in_place_args(kind, buf, op, root)?;
        // SAFETY: as in `push`.
        unsafe { self.push_raw(comm, args) }
    }

    pub fn send<T: Element>(&mut self, comm: &'a Comm, buf: &'a [T], peer: Rank) -> Result<(), Error> {
        self.push(comm, CollKind::Send, buf, &mut [], ReduceOp::Sum, peer)
    }
    pub fn recv<T: Element>(&mut self, comm: &'a Comm, buf: &'a mut [T], peer: Rank) -> Result<(), Error> {
        self.push(comm, CollKind::Recv, &[], buf, ReduceOp::Sum, peer)
    }
    pub fn all_reduce<T: Element>(&mut self, comm: &'a Comm, send: &'a [T], recv: &'a mut [T], op: ReduceOp) -> Result<(), Error> {
        self.push(comm, CollKind::AllReduce, send, recv, op, 0)
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// "all_reduce #12 on rank 3 of 4": what errors of launch `seq` on `comm` are about.
    fn label(&self, comm: &Comm, seq: u64) -> String {
        let args: Vec<&OpArgs> = self.items.iter().filter(|(c, _)| std::ptr::eq(*c, comm)).map(|(_, a)| a).collect();
        let what = if args.len() == 1 { args[0].kind.name().to_string() } else { format!("group of {} operations", args.len()) };
        format!("{what} #{seq} on rank {} of {}", comm.info.rank, comm.info.nranks)
    }

    /// Runs every operation of the group and returns when all are complete.
    pub fn launch(self) -> Result<(), Error> {
        if self.items.is_empty() {
            return Ok(());
        }
        // One entry per communicator, in first-use order; locks taken in address order so that
        // two groups over the same communicators cannot deadlock each other.
        let mut comms: Vec<&Comm> = Vec::new();
        for (c, _) in &self.items {
            if !comms.iter().any(|x| std::ptr::eq(*x, *c)) {
                comms.push(c);
            }
        }
        let mut order: Vec<usize> = (0..comms.len()).collect();
        order.sort_by_key(|&i| comms[i] as *const Comm as usize);
        let mut guards: Vec<Option<MutexGuard<CommState>>> = (0..comms.len()).map(|_| None).collect();
        for &i in &order {
            guards[i] = Some(comms[i].state.lock().map_err(|_| Error::Internal("communicator state poisoned".into()))?);
        }
        let mut guards: Vec<MutexGuard<CommState>> = guards.into_iter().map(|g| g.expect("locked")).collect();

        for (ci, comm) in comms.iter().enumerate() {
            if let Some(e) = &guards[ci].failed {
                return Err(Error::Aborted(format!("rank {}: the communicator failed earlier: {e}", comm.info.rank)));
            }
        }
        let checked: Vec<usize> = (0..comms.len())
            .filter(|&ci| {
                comms[ci].info.config.check_mismatch
                    && self.items.iter().any(|(c, a)| std::ptr::eq(*c, comms[ci]) && mismatch::involves_every_rank(a.kind))
            })
            .collect();
        if !checked.is_empty() {
            let sigs: Vec<Vec<u8>> = checked
                .iter()
                .map(|&ci| {
                    let args: Vec<OpArgs> = self.items.iter().filter(|(c, _)| std::ptr::eq(*c, comms[ci])).map(|(_, a)| *a).collect();
                    mismatch::signature(guards[ci].seq + 1, &args)
                })
                .collect();
            let cs: Vec<&Comm> = checked.iter().map(|&ci| comms[ci]).collect();
            let mut first: Option<Error> = None;
            for (&ci, r) in checked.iter().zip(mismatch::agree(&cs, &sigs)) {
                let comm = comms[ci];
                let label = self.label(comm, guards[ci].seq + 1);
                let e = match r {
                    Ok(()) => continue,
                    // Nothing moved and every rank fails alike: the communicator stays usable.
                    Err(CheckFailure::Mismatch(m)) => Error::InvalidArgument(format!(
                        "{label}: the ranks called different operations (found by FERROCCL_CHECK_MISMATCH before any data \
                         moved): {m}. Every rank must issue the same collectives, with the same count, data type, \
                         reduction and root, in the same order, and matching sends and receives"
                    )),
                    // The ring may be out of step now, so later calls must not trust it.
                    Err(CheckFailure::Exchange(e)) => {
                        let e = e.context(format!("{label}: exchanging operation signatures (FERROCCL_CHECK_MISMATCH)"));
                        guards[ci].failed.get_or_insert_with(|| e.clone());
                        e
                    }
                };
                first.get_or_insert(e);
            }
            if let Some(e) = first {
                return Err(e);
            }
        }

        // Plans (pure) first: any inconsistency is an argument error before anything moves.
        let mut plans = Vec::with_capacity(comms.len());
        let mut bufs = Vec::with_capacity(comms.len());
        for comm in comms.iter() {
            let args: Vec<OpArgs> = self.items.iter().filter(|(c, _)| std::ptr::eq(*c, *comm)).map(|(_, a)| *a).collect();
            // A GPU communicator plans an operation only the first time it sees it (the plan's
            // tables then stay on the GPU); the host executor needs the plan every call.
            plans.push(if comm.cuda.is_some() { Plan::default() } else { plan_for(comm, &args)? });
            bufs.push(args);
        }

        // GPU communicators: each plan goes to its GPU's stream, and the call returns; launches
        // to several GPUs from one thread are back to back, none waits for another's completion.
        if comms.iter().any(|c| c.cuda.is_some()) {
            if comms.iter().any(|c| c.cuda.is_none()) {
                return Err(Error::InvalidArgument("a group cannot mix GPU and host communicators".into()));
            }
            for (ci, comm) in comms.iter().enumerate() {
                guards[ci].seq += 1;
                let n = comm.info.nranks;
                let args = &bufs[ci];
                let key = op_key(args);
                let build = |zero_copy: bool| {
                    let plan = plan_for(comm, args)?;
                    // The peers' plans of the same operations say where each message lands.
                    let remote = zero_copy.then(|| {
                        remote_dsts(&plan, |op, peer| {
                            let a = &args[op as usize];
                            let desc = peer_desc(&CollDesc { kind: a.kind, count: a.count, root: a.root }, comm.info.rank)?;
                            Some(build(&desc, op, peer, n, &tuning_for(comm, a)))
                        })
                    });
                    let ops: Vec<OpDesc> = args
                        .iter()
                        .map(|a| {
                            let (sc, rc) = a.kind.buffer_counts(a.count, n, a.root == comm.info.rank).expect("validated");
                            OpDesc { send: a.send as u64, recv: a.recv as u64, send_count: sc, recv_count: rc, dtype: a.dtype,
                                op: if a.kind.reduces() { a.op } else { ReduceOp::Sum },
                                scalar_dev: if a.kind.reduces() { a.device_scalar.unwrap_or(0) } else { 0 },
                                ll: use_ll(a.kind, a.count, a.dtype, n, {
                                    let c = &comm.info.config;
                                    ll_limit(c.ll_max_bytes, c.slots, c.slot_bytes)
                                }),
                                // Validation let overlapping buffers through only in place.
                                may_post: may_post(a.kind, a.is_in_place(comm.info.rank)),
                            }
                        })
                        .collect();
                    Ok((plan, ops, remote))
                };
                let cuda = comm.cuda.as_ref().expect("checked");
                if let Err(e) = cuda.launch(key, build) {
                    guards[ci].failed.get_or_insert_with(|| e.clone());
                    return Err(e.context(format!("rank {} of {}", comm.info.rank, n)));
                }
            }
            return Ok(());
        }
        let mut bufs: Vec<Vec<OpBufs>> = bufs
            .iter()
            .zip(&comms)
            .map(|(args, comm)| {
                args.iter()
                    .map(|a| {
                        let op = if a.kind.reduces() { a.op } else { ReduceOp::Sum };
                        Ok(OpBufs { send: a.send, recv: a.recv, reducer: Reducer::new(a.dtype, op, comm.info.nranks)? })
                    })
                    .collect::<Result<Vec<_>, Error>>()
            })
            .collect::<Result<_, _>>()?;

        let deadline = Instant::now() + comms.iter().map(|c| c.info.config.timeout).min().expect("a communicator");
        let mut labels = Vec::new();
        for (ci, comm) in comms.iter().enumerate() {
            guards[ci].seq += 1;
            labels.push(self.label(comm, guards[ci].seq));
        }

        let result = (|| {
            for phase in 0..2 {
                for (ci, comm) in comms.iter().enumerate() {
                    let keys = plans[ci].connections();
                    let ctx = ConnCtx { boot: &comm.boot, topo: &comm.info.topo, config: &comm.info.config, abort: &comm.abort, deadline };
                    if let Some(e) = comm.boot.health().failure() {
                        return Err(e.context(&labels[ci]));
                    }
                    let conns = &mut guards[ci].conns;
                    let r = if phase == 0 { conns.setup_phase1(&keys, &ctx) } else { conns.setup_phase2(&keys, &ctx) };
                    r.map_err(|e| e.context(&labels[ci]))?;
                }
            }
            let mut units: Vec<Unit> = Vec::with_capacity(comms.len());
            for ((g, (comm, plan)), (ops, label)) in guards.iter_mut().zip(comms.iter().zip(plans.iter())).zip(bufs.drain(..).zip(labels.iter())) {
                units.push(Unit {
                    plan,
                    ops,
                    conns: &mut g.conns,
                    abort: &comm.abort,
                    label: label.clone(),
                    peer_names: &comm.info.peer_names,
                    peer_pids: &comm.info.peer_pids,
                    peer_via: &comm.info.peer_via,
                    health: comm.boot.health(),
                    slot_bytes: comm.info.config.slot_bytes,
                });
            }
            execute(&mut units, deadline)
        })();

        let result = result.map_err(|e| {
            // A dead peer is the cause that matters, whichever symptom showed first here; the
            // heartbeats name it within milliseconds of a death, so wait for them a moment.
            let aborted = comms.iter().zip(&labels).find(|(c, _)| c.abort.load(std::sync::atomic::Ordering::Acquire));
            let e = if let Some((_, label)) = aborted {
                // Our own abort explains everything, including the poison it spread.
                Error::Aborted(format!("{label}: the communicator was aborted (Comm::abort)"))
            } else if let Some(d) = dead_peer_error(&comms, &labels, &e) {
                d
            } else {
                // Remote peers' reports arrive a moment after the bare EOF their exit causes.
                guards.first().map(|g| g.conns.explain(e.clone(), FAILURE_GRACE)).unwrap_or(e)
            };
            for (ci, comm) in comms.iter().enumerate() {
                guards[ci].failed.get_or_insert_with(|| e.clone());
                Conns::poison_all(&comm.fifos, &format!("rank {} failed: {e}", comm.info.rank));
            }
            for g in &guards {
                g.conns.flush_failure(FAILURE_GRACE);
            }
            e
        });
        result
    }
}

/// The failure the heartbeats report for one of `comms`, as the error of this launch, when
/// `e` is the kind of error a dead peer causes (not a bad argument, not our own abort).
fn dead_peer_error(comms: &[&Comm], labels: &[String], e: &Error) -> Option<Error> {
    if !matches!(e, Error::Remote(_) | Error::Timeout(_) | Error::Protocol(_)) {
        return None;
    }
    let until = Instant::now() + FAILURE_GRACE;
    loop {
        for (c, label) in comms.iter().zip(labels) {
            if let Some(h) = c.boot.health().failure() {
                return Some(h.context(label));
            }
        }
        if Instant::now() >= until || matches!(e, Error::Timeout(_)) {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// The plan of one communicator's share of a group.
/// What identifies a launch's plan tables on the GPU: everything the encoded tables depend on
/// (the communicator's config is fixed for its life).
fn op_key(args: &[OpArgs]) -> Vec<u64> {
    args.iter()
        .flat_map(|a| {
            // The scalar apart from the op id: PreMulSum(0.0) must not look like Sum.
            let scalar = match a.op {
                ReduceOp::PreMulSum(s) => s.to_bits(),
                _ => 0,
            };
            [
                a.kind as u64,
                a.count as u64,
                a.dtype.nccl_id() as u64,
                a.op.nccl_id() as u64,
                scalar,
                a.device_scalar.unwrap_or(0),
                a.root as u64,
                a.send as u64,
                a.recv as u64,
            ]
        })
        .collect()
}

/// How an operation is cut up on this communicator: the same on every rank (config and
/// operation are), which is what lets a rank build its peers' plans (zero-copy).
fn tuning_for(comm: &Comm, a: &OpArgs) -> Tuning {
    let cfg = &comm.info.config;
    let p2p = matches!(a.kind, CollKind::Send | CollKind::Recv);
    // The host backend moves point-to-point data on one thread anyway; GPUs need blocks.
    let p2p_ch = if comm.cuda.is_some() { crate::backend::cuda::fabric::p2p_channels(cfg.channels) } else { 1 };
    // The two-shot all-reduce is proven by the simulator and checked on the host backend,
    // but has not yet run on 3 or more GPUs (no such machine was lent when it landed):
    // GPUs keep the ring until it has been checked element by element there.
    let direct = if comm.cuda.is_some() { 0 } else { cfg.direct_max_bytes };
    Tuning::for_elem_size(if p2p { p2p_ch } else { cfg.channels }, cfg.chunk_bytes, a.dtype.size())
        .with_direct_max_bytes(direct, a.dtype.size())
}

fn plan_for(comm: &Comm, args: &[OpArgs]) -> Result<Plan, Error> {
    let (rank, n) = (comm.info.rank, comm.info.nranks);
    let mut plan = Plan { rank, nranks: n, lanes: Vec::new() };
    let mut self_sends = Vec::new();
    let mut self_recvs = Vec::new();
    for (i, a) in args.iter().enumerate() {
        let i16 = u16::try_from(i).map_err(|_| Error::InvalidArgument("a group holds at most 65536 operations".into()))?;
        if matches!(a.kind, CollKind::Send | CollKind::Recv) && a.root == rank {
            if a.kind == CollKind::Send { self_sends.push(i) } else { self_recvs.push(i) }
            continue;
        }
        plan.append(build(&CollDesc { kind: a.kind, count: a.count, root: a.root }, i16, rank, n, &tuning_for(comm, a)));
    }
    // A send to oneself is a copy into the matching receive from oneself.
    if self_sends.len() != self_recvs.len() {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: {} sends to itself but {} receives from itself in one group",
            self_sends.len(),
            self_recvs.len()
        )));
    }
    let mut lane = Lane { id: SELF_LANE, channel: 0, steps: Vec::new() };
    for (&s, &r) in self_sends.iter().zip(&self_recvs) {
        let (a, b) = (&args[s], &args[r]);
        if a.count != b.count || a.dtype != b.dtype {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: a send to itself of {} x {} meets a receive of {} x {}",
                a.count, a.dtype, b.count, b.dtype
            )));
        }
        if a.count > 0 {
            lane.steps.push(Step::Copy {
                src: Region::new(s as u16, BufKind::Input, 0, a.count),
                dst: Region::new(r as u16, BufKind::Output, 0, a.count),
                pre: false,
                post: false,
            });
        }
    }
    if !lane.steps.is_empty() {
        plan.lanes.push(lane);
    }
    if cfg!(debug_assertions) {
        let sizes: Vec<(usize, usize)> =
            args.iter().map(|a| a.kind.buffer_counts(a.count, n, a.root == rank).expect("validated")).collect();
        plan.validate(&sizes).map_err(Error::Internal)?;
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferroccl_core::DataType;

    #[test]
    fn op_keys_differ_whenever_the_tables_would() {
        let base = OpArgs {
            kind: CollKind::AllReduce,
            send: 0x1000 as *const u8,
            recv: 0x2000 as *mut u8,
            count: 64,
            dtype: DataType::Float32,
            op: ReduceOp::Sum,
            root: 0,
            device_scalar: None,
        };
        let variants = [
            base,
            OpArgs { op: ReduceOp::PreMulSum(0.0), ..base },
            OpArgs { op: ReduceOp::PreMulSum(1.0), ..base },
            OpArgs { op: ReduceOp::PreMulSum(1.0), device_scalar: Some(0x3000), ..base },
            OpArgs { op: ReduceOp::PreMulSum(1.0), device_scalar: Some(0x3004), ..base },
            OpArgs { op: ReduceOp::Prod, ..base },
            OpArgs { kind: CollKind::Reduce, ..base },
            OpArgs { kind: CollKind::Reduce, root: 1, ..base },
            OpArgs { count: 65, ..base },
            OpArgs { dtype: DataType::Int32, ..base },
            OpArgs { send: 0x1100 as *const u8, ..base },
            OpArgs { recv: 0x2100 as *mut u8, ..base },
        ];
        let keys: Vec<Vec<u64>> = variants.iter().map(|a| op_key(std::slice::from_ref(a))).collect();
        for i in 0..keys.len() {
            for j in 0..i {
                assert_ne!(keys[i], keys[j], "{:?} and {:?} share tables", variants[i], variants[j]);
            }
        }
        // A group is keyed by all its operations, in order.
        assert_ne!(op_key(&[variants[0], variants[5]]), op_key(&[variants[5], variants[0]]));
        assert_eq!(op_key(&[base]), op_key(&[OpArgs { ..base }]));
    }
}
