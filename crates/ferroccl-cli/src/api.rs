//! The library surface the CLI uses, in one place.

pub use ferroccl::{CollKind, Comm, Config, DataType, Device, Error, Group, OpArgs, ReduceOp};
