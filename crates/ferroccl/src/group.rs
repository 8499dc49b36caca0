//! Groups: several operations, on one or several communicators, launched as one.
//!
//! Within a group, sends and receives between any ranks in any order cannot deadlock (each peer
//! direction is its own lane), collectives run in issue order, and one thread can drive every
//! rank of a communicator (`Comm::init_all`) because all their plans run in one executor.

use crate::comm::Comm;
use crate::launch::launch;
use crate::ops::OpArgs;
use ferroccl_core::numeric::Element;
use ferroccl_core::tune::{estimate_launch_us, OpShape};
use ferroccl_core::{CollKind, Error, Rank, ReduceOp};
use std::marker::PhantomData;

/// Operations collected for one launch. The lifetime ties the group to the buffers it holds.
///
/// A group runs its operations together, like NCCL's `ncclGroupStart`/`ncclGroupEnd`: sends
/// and receives between any ranks in any order cannot deadlock, collectives run in the order
/// they were added, and one thread can drive every rank of [`Comm::init_all`] or
/// [`Comm::init_devices`] by adding each rank's share. Each operation is checked when added.
///
/// ```
/// use ferroccl::{Comm, Config, Group};
/// // A ring exchange driven by one thread: each rank sends to the next, receives from the last.
/// let comms = Comm::init_all(3, &Config::default())?;
/// let n = comms.len();
/// let sends: Vec<Vec<u64>> = (0..n).map(|r| vec![r as u64; 4]).collect();
/// let mut recvs = vec![vec![0u64; 4]; n];
/// let mut g = Group::new();
/// for (r, (c, out)) in comms.iter().zip(recvs.iter_mut()).enumerate() {
///     g.recv(c, out, (r + n - 1) % n)?;
///     g.send(c, &sends[r], (r + 1) % n)?;
/// }
/// g.launch()?;
/// assert_eq!(recvs[0], vec![2; 4]);
/// # Ok::<(), ferroccl::Error>(())
/// ```
#[derive(Default)]
pub struct Group<'a> {
    items: Vec<(&'a Comm, OpArgs)>,
    _buffers: PhantomData<&'a mut [u8]>,
}

/// The checks an operation passes before it joins a launch: its arguments against the
/// communicator, a device scalar only on a GPU one, and a communicator still usable.
pub(crate) fn check_op(comm: &Comm, args: &OpArgs) -> Result<(), Error> {
    args.validate(comm.info.rank, comm.info.nranks)
        .map_err(|e| e.context(format!("rank {} of {}", comm.info.rank, comm.info.nranks)))?;
    if args.device_scalar.is_some() && comm.backend.cuda().is_none() {
        return Err(Error::InvalidArgument(format!(
            "{}: a device pre-mul-sum scalar needs a GPU communicator; rank {} runs on the host (use ReduceOp::PreMulSum(value))",
            args.kind, comm.info.rank
        )));
    }
    comm.ensure_usable(args.kind.name())
}

impl<'a> Group<'a> {
    /// An empty group.
    pub fn new() -> Group<'a> {
        Group {
            items: Vec::new(),
            _buffers: PhantomData,
        }
    }

    /// Adds an operation on raw buffers, checking its arguments now (an invalid one is
    /// rejected and the group is unchanged).
    ///
    /// # Safety
    /// The buffers must stay valid, and untouched by others, until `launch` returns.
    pub unsafe fn push_raw(&mut self, comm: &'a Comm, args: OpArgs) -> Result<(), Error> {
        check_op(comm, &args)?;
        self.items.push((comm, args));
        Ok(())
    }

    /// Adds a typed operation (see [`Comm::run`] for how the count follows from the buffers).
    pub fn push<T: Element>(
        &mut self,
        comm: &'a Comm,
        kind: CollKind,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<(), Error> {
        comm.host_slices(kind)?;
        let args = OpArgs::typed(kind, send, recv, op, root, comm.info.rank, comm.info.nranks)?;
        // SAFETY: the slices are borrowed for 'a, which outlives the group.
        unsafe { self.push_raw(comm, args) }
    }

    /// Adds a typed in-place operation.
    pub fn push_in_place<T: Element>(
        &mut self,
        comm: &'a Comm,
        kind: CollKind,
        buf: &'a mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<(), Error> {
        comm.host_slices(kind)?;
        let args = OpArgs::in_place(kind, buf, op, root, comm.info.rank, comm.info.nranks)?;
        // SAFETY: as in `push`.
        unsafe { self.push_raw(comm, args) }
    }

    /// Adds a send of `buf` to `peer` (see [`Comm::send`]).
    pub fn send<T: Element>(
        &mut self,
        comm: &'a Comm,
        buf: &'a [T],
        peer: Rank,
    ) -> Result<(), Error> {
        self.push(comm, CollKind::Send, buf, &mut [], ReduceOp::Sum, peer)
    }
    /// Adds a receive into `buf` from `peer` (see [`Comm::recv`]).
    pub fn recv<T: Element>(
        &mut self,
        comm: &'a Comm,
        buf: &'a mut [T],
        peer: Rank,
    ) -> Result<(), Error> {
        self.push(comm, CollKind::Recv, &[], buf, ReduceOp::Sum, peer)
    }
    /// Adds an all-reduce (see [`Comm::all_reduce`]).
    pub fn all_reduce<T: Element>(
        &mut self,
        comm: &'a Comm,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.push(comm, CollKind::AllReduce, send, recv, op, 0)
    }

    /// Operations added so far.
    pub fn len(&self) -> usize {
        self.items.len()
    }
    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// A rough time the group would take, in microseconds, without running it: for each
    /// communicator the sum of the tuner's estimates for its operations
    /// ([`ferroccl_core::tune::estimate_us`]), the slowest communicator's (they run at once).
    pub fn estimate_us(&self) -> f64 {
        let mut per_comm: Vec<(&Comm, Vec<OpShape>)> = Vec::new();
        for (c, a) in &self.items {
            let windows = c.backend.cuda().is_some_and(|g| g.has_windows());
            let symmetric = c
                .backend
                .cuda()
                .is_some_and(|g| g.symmetric_far(a, &c.info).is_some());
            let inputs = c
                .backend
                .cuda()
                .is_some_and(|g| g.inputs_symmetric(a, &c.info));
            let s = a.shape(&c.info, windows, symmetric, inputs);
            match per_comm.iter_mut().find(|(x, _)| std::ptr::eq(*x, *c)) {
                Some((_, v)) => v.push(s),
                None => per_comm.push((c, vec![s])),
            }
        }
        per_comm
            .iter()
            .map(|(c, shapes)| estimate_launch_us(shapes, c.info.device, &c.info.config))
            .fold(0.0, f64::max)
    }

    /// Runs every operation of the group. Host communicators: returns when all are complete.
    /// GPU communicators: returns once every operation is enqueued on its stream.
    pub fn launch(self) -> Result<(), Error> {
        launch(&self.items)
    }
}
