//! ferroccl: collective communication for GPUs and hosts.
//!
//! ```no_run
//! use ferroccl::{Comm, Config, ReduceOp};
//! let comms = Comm::init_all(4, &Config::default()).unwrap();
//! std::thread::scope(|s| {
//!     for c in &comms {
//!         s.spawn(move || {
//!             let mut v = vec![c.rank() as f32; 1024];
//!             c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
//!             assert_eq!(v[0], 6.0);
//!         });
//!     }
//! });
//! ```

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
/// kernels, with the values of `ferroccl_core::numeric::check::CheckCase`. See
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
pub use ferroccl_core::{CollKind, Config, DataType, Error, LaunchEnv, Rank, ReduceOp, Result, TransportChoice};
pub use group::Group;
pub use ops::OpArgs;
