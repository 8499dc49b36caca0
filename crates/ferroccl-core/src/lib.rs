//! ferroccl-core: the pure logic of ferroccl. No I/O here: no sockets, files, clocks, threads or
//! CUDA. The runtime crate (`ferroccl`) drives what is defined here.

#![warn(missing_docs)]

pub mod algo;
pub mod config;
pub mod ifname;
pub mod nccl_abi;
pub mod numeric;
pub mod opsig;
pub mod plan;
pub mod topo;
pub mod tune;
pub mod types;

pub use config::{Config, LaunchEnv, TransportChoice};
pub use types::{CollKind, DataType, Error, Rank, ReduceOp, Result};
