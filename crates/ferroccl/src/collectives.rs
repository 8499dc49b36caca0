//! The collective calls of a communicator: one operation each, launched as a group of one.
//!
//! What every call does and how it ends:
//! - **Buffers.** The typed calls take host slices, for host communicators (those of
//!   [`Comm::init_all`], [`Comm::init_rank`] with [`Device::Host`](crate::Device::Host),
//!   [`Comm::from_env`]); a GPU communicator refuses them with `InvalidArgument` and takes
//!   device memory through [`Comm::run_raw`] ([`OpArgs`] with device addresses, e.g. of a
//!   [`crate::mem::DeviceBuffer`]). The count follows from the slices' lengths, NCCL's way:
//!   all-reduce, broadcast, reduce and send move `send.len()` elements; all-gather and gather
//!   take `send.len()` from each rank into a `recv` of `nranks x send.len()` (at the root for
//!   gather); reduce-scatter and scatter give each rank `recv.len()` from a `send` of
//!   `nranks x recv.len()`; all-to-all sends `send.len() / nranks` to each peer. A buffer
//!   shorter than the operation needs is refused before anything moves.
//! - **In place** (the `_in_place` calls and [`Comm::run_in_place`]): one buffer is input and
//!   output; all-gather and gather read this rank's block of it (`rank x count` onwards),
//!   reduce-scatter and scatter write that block.
//! - **Returns.** Host communicators: when this rank's part is complete (outputs ready).
//!   GPU communicators: as soon as the operation is enqueued on the communicator's stream
//!   ([`Comm::set_stream`]); wait with [`Comm::synchronize`] or on the stream.
//! - **Errors.** `InvalidArgument` for a bad root, peer, reduction or buffer: nothing changed,
//!   the communicator stays usable. `Timeout` when a peer does not take part by
//!   `Config::timeout`, `Remote` when a peer died or failed, `Aborted` after [`Comm::abort`]:
//!   the communicator is then unusable (drop it, or [`Comm::shrink`] without the dead ranks).
//!   Every message names the operation, its sequence number and the peer.

use crate::comm::Comm;
use crate::ops::OpArgs;
use ferroccl_core::numeric::Element;
use ferroccl_core::{CollKind, Error, Rank, ReduceOp};

impl Comm {
    /// Typed slices are host memory: a GPU communicator's kernels cannot take them.
    pub(crate) fn host_slices(&self, kind: CollKind) -> Result<(), Error> {
        if self.backend.cuda().is_some() {
            return Err(Error::InvalidArgument(format!(
                "{kind}: rank {} runs on a GPU and slices are host memory: pass device buffers through run_raw \
                 (OpArgs with device addresses, e.g. of a ferroccl::mem::DeviceBuffer)",
                self.info.rank
            )));
        }
        Ok(())
    }

    /// Runs one operation on raw buffers: host memory for host communicators, device memory
    /// (of this GPU, or mapped for it) for GPU ones.
    ///
    /// # Safety
    /// `args.send` and `args.recv` must be valid for reads / writes of the extents the operation
    /// implies (see [`OpArgs`]) until the call returns, and not be accessed by others meanwhile.
    pub unsafe fn run_raw(&self, args: &OpArgs) -> Result<(), Error> {
        // A group of one, without the group's vector.
        crate::group::check_op(self, args)?;
        crate::launch::launch(&[(self, *args)])
    }

    /// Runs `kind` with typed buffers; the count comes from the buffer sizes (see
    /// [`CollKind::buffer_counts`]): all-reduce, broadcast, reduce, send: `send.len()`;
    /// recv: `recv.len()`; all-gather, gather: `send.len()` per rank; reduce-scatter, scatter:
    /// `recv.len()` per rank; all-to-all: `send.len() / nranks` per peer.
    pub fn run<T: Element>(
        &self,
        kind: CollKind,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<(), Error> {
        self.host_slices(kind)?;
        let args = OpArgs::typed(kind, send, recv, op, root, self.info.rank, self.info.nranks)?;
        // SAFETY: the slices are valid and exclusively borrowed for the call, and their lengths
        // were checked against the operation's extents.
        unsafe { self.run_raw(&args) }
    }

    /// Runs `kind` in place on `buf` (NCCL's in-place conventions: all-gather and gather read
    /// this rank's block of `buf`; reduce-scatter and scatter write it).
    pub fn run_in_place<T: Element>(
        &self,
        kind: CollKind,
        buf: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<(), Error> {
        self.host_slices(kind)?;
        let args = OpArgs::in_place(kind, buf, op, root, self.info.rank, self.info.nranks)?;
        // SAFETY: as in `run`.
        unsafe { self.run_raw(&args) }
    }

    /// Every rank gets, in `recv`, the reduction by `op` of all ranks' `send` (element by
    /// element; `send.len()` elements, `recv` at least as long). The same bits on every rank.
    ///
    /// ```
    /// use ferroccl::{Comm, Config, ReduceOp};
    /// let comms = Comm::init_all(3, &Config::default())?;
    /// std::thread::scope(|s| {
    ///     for c in &comms {
    ///         s.spawn(move || {
    ///             let mine = vec![c.rank() as i32 + 1; 5];
    ///             let mut sum = vec![0; 5];
    ///             c.all_reduce(&mine, &mut sum, ReduceOp::Sum).unwrap();
    ///             assert_eq!(sum, vec![6; 5]);
    ///         });
    ///     }
    /// });
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn all_reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.run(CollKind::AllReduce, send, recv, op, 0)
    }
    /// [`Comm::all_reduce`] with `buf` as input and output.
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.run_in_place(CollKind::AllReduce, buf, op, 0)
    }
    /// Every rank gets every rank's `send` in `recv`, in rank order: rank `r`'s block at
    /// `r x send.len()` (`recv` holds `nranks x send.len()`).
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), Error> {
        self.run(CollKind::AllGather, send, recv, ReduceOp::Sum, 0)
    }
    /// The reduction by `op` of all ranks' `send` (`nranks x recv.len()` elements), cut into
    /// `nranks` blocks: rank `r` gets block `r` in `recv`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.run(CollKind::ReduceScatter, send, recv, op, 0)
    }
    /// `root`'s `buf` is copied into every other rank's `buf` (of the same length).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: Rank) -> Result<(), Error> {
        self.run_in_place(CollKind::Broadcast, buf, ReduceOp::Sum, root)
    }
    /// `root` gets, in `recv`, the reduction by `op` of all ranks' `send`; other ranks' `recv`
    /// is not written (it may be empty).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<(), Error> {
        self.run(CollKind::Reduce, send, recv, op, root)
    }
    /// Block `p` of this rank's `send` (blocks of `send.len() / nranks`) goes to rank `p`, which
    /// stores it as block `rank` of its `recv`.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), Error> {
        self.run(CollKind::AllToAll, send, recv, ReduceOp::Sum, 0)
    }
    /// `root` gets every rank's `send` in `recv` (`nranks x send.len()`, in rank order); other
    /// ranks' `recv` is not used.
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: Rank) -> Result<(), Error> {
        self.run(CollKind::Gather, send, recv, ReduceOp::Sum, root)
    }
    /// Block `r` of `root`'s `send` (`nranks x recv.len()`) goes to rank `r`'s `recv`; other
    /// ranks' `send` is not used.
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: Rank) -> Result<(), Error> {
        self.run(CollKind::Scatter, send, recv, ReduceOp::Sum, root)
    }
    /// Sends `buf` to `peer`, which must post a [`Comm::recv`] of the same length. Alone, a
    /// send completes when the peer has received it; to exchange with several peers, or both
    /// ways with one, put the sends and receives in one [`Group`](crate::Group) (any order, no
    /// deadlock).
    pub fn send<T: Element>(&self, buf: &[T], peer: Rank) -> Result<(), Error> {
        self.run(CollKind::Send, buf, &mut [], ReduceOp::Sum, peer)
    }
    /// Receives `buf.len()` elements from `peer`'s [`Comm::send`].
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: Rank) -> Result<(), Error> {
        self.run(CollKind::Recv, &[], buf, ReduceOp::Sum, peer)
    }
}
