//! The NCCL C ABI over ferroccl (`libnccl.so.2`). Not implemented yet: this crate only reserves
//! its place in the workspace so that the layout of `docs/ARCHITECTURE.md` is visible.

pub use ferroccl;
