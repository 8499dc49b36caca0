//! ferroccl: collective communication for GPUs and hosts, as NCCL does it (all-reduce,
//! all-gather, reduce-scatter, all-to-all, broadcast, reduce, gather, scatter, send and
//! receive between the ranks of a job), in every NCCL data type and reduction.
//!
//! A [`Comm`] is one rank's handle on a communicator. Make one for each rank:
//! - threads of one process: [`Comm::init_all`] (host memory) or [`Comm::init_devices`]
//!   (one GPU each);
//! - processes started by a launcher (`ferroccl run`, torchrun, `mpirun`): [`Comm::from_env`]
//!   (host) or [`Comm::from_env_gpu`] (GPU `LOCAL_RANK`);
//! - anything else: one process makes a [`UniqueId`] and ships its bytes to all; each rank
//!   calls [`Comm::init_rank`].
//!
//! Then call the collectives on it ([`Comm::all_reduce`] and the others: see their module
//! notes for the buffer-size rules, in-place conventions, what returns when, and the errors),
//! or put several operations, on one or several communicators, into a [`Group`]. Host
//! communicators take slices and return when the operation is complete; GPU ones take device
//! memory ([`mem::DeviceBuffer`], through [`Comm::run_raw`]) and return once the operation is
//! enqueued on their CUDA stream ([`Comm::set_stream`], [`Comm::synchronize`]).
//!
//! Failures are errors that name the operation and the peer, never hangs: every wait has a
//! deadline ([`Config`]'s `timeout`), a dead peer is noticed within milliseconds,
//! [`Comm::abort`] frees every waiting call, and the survivors of a failure can go on with
//! [`Comm::shrink`].
//!
//! ```
//! use ferroccl::{Comm, Config, ReduceOp};
//! // Four ranks as threads of this process, on the host backend.
//! let comms = Comm::init_all(4, &Config::default())?;
//! std::thread::scope(|s| {
//!     for c in &comms {
//!         s.spawn(move || {
//!             let mut v = vec![c.rank() as f32; 1024];
//!             c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
//!             assert!(v.iter().all(|&x| x == 6.0)); // 0 + 1 + 2 + 3
//!         });
//!     }
//! });
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! `examples/` in this crate holds programs to copy: an all-reduce over threads and over
//! processes, a GPU all-reduce on a CUDA stream, a group of sends and receives, and abort and
//! shrink after a failure.

#![warn(missing_docs)]

mod backend;
mod bootstrap;
mod collectives;
mod comm;
pub mod cuda;
mod group;
mod info;
mod launch;
mod mismatch;
mod ops;
#[cfg(test)]
mod testing;
mod transport;

/// The verifiable mode (`ferroccl bench --check`) on GPUs: inputs filled and outputs checked by
/// kernels, with the values of `ferroccl_core::numeric::expected::RankCase`. See
/// [`Comm::gpu_verifier`].
pub mod verify {
    pub use crate::backend::cuda::verify::{GpuVerifier, Wrong};
}

/// GPU memory for users: the counterpart of `ncclMemAlloc` / `ncclMemFree`. Buffers come
/// from the cuMem API, are mapped for every GPU that can reach them, and are counted in
/// the [`mem::MemStats`] passed in.
pub mod mem {
    pub use crate::cuda::device::Gpu;
    pub use crate::cuda::mem::{alloc, free, DeviceBuffer, MemStats, MemStatsSnapshot, Origin};
}

pub use bootstrap::{interface_ip, UniqueId};
pub use comm::{Comm, Device};
pub use ferroccl_core::numeric::{Element, F8E4M3, F8E5M2};
pub use ferroccl_core::{
    CollKind, Config, DataType, Error, LaunchEnv, Rank, ReduceOp, Result, TransportChoice,
};
pub use group::Group;
pub use ops::OpArgs;
