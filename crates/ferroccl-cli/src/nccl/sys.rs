//! NCCL's C ABI as the benchmark calls it: ferroccl-core's `nccl_abi`, the one definition the
//! drop-in library exports too, plus what only the loader needs.

pub use ferroccl_core::nccl_abi::*;

/// The oldest NCCL the comparison accepts: 2.19 has every call used here that registration
/// needs (`ncclMemAlloc`, `ncclCommRegister`), and its `ncclConfig_t` era is the one we know.
pub const MIN_VERSION: i32 = 21900;
