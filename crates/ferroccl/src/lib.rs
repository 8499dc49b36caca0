//! ferroccl: collective communication for GPUs and hosts.

pub mod bootstrap;
pub mod transport;

pub use ferroccl_core::{CollKind, Config, DataType, Error, Rank, ReduceOp, Result, TransportChoice};
