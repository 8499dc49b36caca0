//! The collective calls of a communicator: one operation each, launched as a group of one.

use crate::comm::Comm;
use crate::group::Group;
use crate::ops::OpArgs;
use ferroccl_core::numeric::Element;
use ferroccl_core::{CollKind, Error, Rank, ReduceOp};

impl Comm {
    /// Runs one operation on raw host buffers.
    ///
    /// # Safety
    /// `args.send` and `args.recv` must be valid for reads / writes of the extents the operation
    /// implies (see [`OpArgs`]) until the call returns, and not be accessed by others meanwhile.
    pub unsafe fn run_raw(&self, args: &OpArgs) -> Result<(), Error> {
        let mut g = Group::new();
        g.push_raw(self, *args)?;
        g.launch()
    }

    /// Runs `kind` with typed buffers; the count comes from the buffer sizes (see
    /// [`CollKind::buffer_counts`]): all-reduce, broadcast, reduce, send: `send.len()`;
    /// recv: `recv.len()`; all-gather, gather: `send.len()` per rank; reduce-scatter, scatter:
    /// `recv.len()` per rank; all-to-all: `send.len() / nranks` per peer.
    pub fn run<T: Element>(&self, kind: CollKind, send: &[T], recv: &mut [T], op: ReduceOp, root: Rank) -> Result<(), Error> {
        let args = OpArgs::typed(kind, send, recv, op, root, self.info.rank, self.info.nranks)?;
        // SAFETY: the slices are valid and exclusively borrowed for the call, and their lengths
        // were checked against the operation's extents.
        unsafe { self.run_raw(&args) }
    }

    /// Runs `kind` in place on `buf` (NCCL's in-place conventions: all-gather and gather read
    /// this rank's block of `buf`; reduce-scatter and scatter write it).
    pub fn run_in_place<T: Element>(&self, kind: CollKind, buf: &mut [T], op: ReduceOp, root: Rank) -> Result<(), Error> {
        let args = OpArgs::in_place(kind, buf, op, root, self.info.rank, self.info.nranks)?;
        // SAFETY: as in `run`.
        unsafe { self.run_raw(&args) }
    }

    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), Error> {
        self.run(CollKind::AllReduce, send, recv, op, 0)
    }
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), Error> {
        self.run_in_place(CollKind::AllReduce, buf, op, 0)
    }
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), Error> {
        self.run(CollKind::AllGather, send, recv, ReduceOp::Sum, 0)
    }
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), Error> {
        self.run(CollKind::ReduceScatter, send, recv, op, 0)
    }
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: Rank) -> Result<(), Error> {
        self.run_in_place(CollKind::Broadcast, buf, ReduceOp::Sum, root)
    }
    pub fn reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp, root: Rank) -> Result<(), Error> {
        self.run(CollKind::Reduce, send, recv, op, root)
    }
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), Error> {
        self.run(CollKind::AllToAll, send, recv, ReduceOp::Sum, 0)
    }
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: Rank) -> Result<(), Error> {
        self.run(CollKind::Gather, send, recv, ReduceOp::Sum, root)
    }
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: Rank) -> Result<(), Error> {
        self.run(CollKind::Scatter, send, recv, ReduceOp::Sum, root)
    }
    pub fn send<T: Element>(&self, buf: &[T], peer: Rank) -> Result<(), Error> {
        self.run(CollKind::Send, buf, &mut [], ReduceOp::Sum, peer)
    }
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: Rank) -> Result<(), Error> {
        self.run(CollKind::Recv, &[], buf, ReduceOp::Sum, peer)
    }
}
