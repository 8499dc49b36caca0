//! The CUDA backend: the collective engine on top of the driver layer (`crate::cuda`).
//!
//! - `comm.rs`: one rank's GPU side (its device, stream, abort word and error record), its
//!   synchronisation and abort;
//! - `launch.rs`: the launch path: plan tables cached by operation shape in a pooled arena,
//!   buffer addresses carried in the kernel's parameter, one kernel launch per call;
//! - `tables.rs`: a plan as the `#[repr(C)]` tables the kernel reads, pinned against
//!   `kernels/types.cuh`;
//! - `fabric.rs`: the FIFOs between the ranks' GPUs, in peer-mapped cuMem memory;
//! - `window.rs`: registered windows (zero-copy);
//! - `mapper.rs`: the thread that maps what peers of other processes lend this rank;
//! - `lazy.rs`: outputs nobody registered, lent on the fly to the peers whose copy engines write
//!   them;
//! - `kernels.rs` and `kernels/`: the CUDA C sources and how NVRTC compiles them;
//! - `verify.rs`: the verifiable mode (inputs filled, outputs checked by kernels);
//! - `flow_model.rs` (tests): the peer and direct engines' flow control, model-checked on the host.

mod comm;
mod copy_engine;
pub(crate) mod fabric;
#[cfg(test)]
mod flow_model;
pub(crate) mod kernels;
mod launch;
mod lazy;
pub(crate) mod mapper;
mod p2p;
pub(crate) mod tables;
pub(crate) mod verify;
pub(crate) mod window;

pub(crate) use comm::CudaComm;
pub(crate) use ferroccl_core::plan::lanes::P2pCopy;
pub(crate) use launch::Exchanged;
