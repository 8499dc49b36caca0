//! NCCL's C ABI as far as the benchmark calls it: handle types, the 128-byte unique id, result
//! codes and the function-pointer types of the entry points. Written from the public header's
//! declarations (`nccl.h`, 2.19 to 2.28); enums are passed as C `int`s, as the C compiler does.
//!
//! The data-type and reduction numbering is ferroccl's own (`DataType::nccl_id`,
//! `ReduceOp::nccl_id`), which follows `ncclDataType_t` / `ncclRedOp_t`; a test pins the
//! values that matter here.

use std::ffi::{c_char, c_int, c_void};

/// `ncclComm_t`: an opaque pointer.
pub type RawComm = *mut c_void;
/// `ncclWindow_t` (2.27+): an opaque pointer.
pub type RawWindow = *mut c_void;
/// `cudaStream_t`, which is the driver's `CUstream` handle.
pub type RawStream = *mut c_void;
/// `ncclResult_t`.
pub type NcclResult = c_int;

pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: 128 opaque bytes, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

impl UniqueId {
    pub fn zeroed() -> UniqueId {
        UniqueId { internal: [0; UNIQUE_ID_BYTES] }
    }
    pub fn to_bytes(self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }
    pub fn from_bytes(b: &[u8]) -> Option<UniqueId> {
        if b.len() != UNIQUE_ID_BYTES {
            return None;
        }
        let mut id = UniqueId::zeroed();
        for (d, s) in id.internal.iter_mut().zip(b) {
            *d = *s as c_char;
        }
        Some(id)
    }
}

pub const SUCCESS: NcclResult = 0;
/// `ncclInProgress`: only non-blocking communicators return it; ours are blocking.
pub const IN_PROGRESS: NcclResult = 7;

/// The symbolic name of a result code, for messages that stay readable when
/// `ncclGetErrorString` says little.
pub fn result_name(r: NcclResult) -> &'static str {
    match r {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "unknown ncclResult_t",
    }
}

/// `NCCL_WIN_COLL_SYMMETRIC`: every rank registers a buffer of the same size, which lets NCCL
/// use its symmetric-memory kernels.
pub const WIN_COLL_SYMMETRIC: c_int = 0x01;

pub type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
pub type GetUniqueIdFn = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
pub type CommInitRankFn = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
pub type CommInitAllFn = unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> NcclResult;
pub type CommFn = unsafe extern "C" fn(RawComm) -> NcclResult;
pub type GroupFn = unsafe extern "C" fn() -> NcclResult;
pub type GetErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;
pub type GetLastErrorFn = unsafe extern "C" fn(RawComm) -> *const c_char;
pub type CommGetAsyncErrorFn = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
/// (send, recv, count, datatype, op, comm, stream)
pub type AllReduceFn = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
/// (send, recv, sendcount, datatype, comm, stream); also `ncclAlltoAll` (count per peer).
pub type AllGatherFn = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> NcclResult;
/// (send, recv, recvcount, datatype, op, comm, stream)
pub type ReduceScatterFn = AllReduceFn;
/// (send, recv, count, datatype, root, comm, stream); also `ncclGather` / `ncclScatter`.
pub type BroadcastFn = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
/// (send, recv, count, datatype, op, root, comm, stream)
pub type ReduceFn = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, RawComm, RawStream) -> NcclResult;
/// (send, count, datatype, peer, comm, stream)
pub type SendFn = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
/// (recv, count, datatype, peer, comm, stream)
pub type RecvFn = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
/// (comm, buffer, size, handle out)
pub type CommRegisterFn = unsafe extern "C" fn(RawComm, *mut c_void, usize, *mut *mut c_void) -> NcclResult;
pub type CommDeregisterFn = unsafe extern "C" fn(RawComm, *mut c_void) -> NcclResult;
pub type MemAllocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> NcclResult;
pub type MemFreeFn = unsafe extern "C" fn(*mut c_void) -> NcclResult;
/// (comm, buffer, size, window out, flags)
pub type CommWindowRegisterFn = unsafe extern "C" fn(RawComm, *mut c_void, usize, *mut RawWindow, c_int) -> NcclResult;
pub type CommWindowDeregisterFn = unsafe extern "C" fn(RawComm, RawWindow) -> NcclResult;

/// "2.28.9" from `ncclGetVersion`'s code. NCCL changed the encoding at 2.9: before it
/// X*1000 + Y*100 + Z, since X*10000 + Y*100 + Z.
pub fn version_string(code: i32) -> String {
    let (x, y, z) = version_parts(code);
    format!("{x}.{y}.{z}")
}

pub fn version_parts(code: i32) -> (i32, i32, i32) {
    if code >= 10000 {
        (code / 10000, (code % 10000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

/// The oldest NCCL the comparison accepts: 2.19 has every call used here that registration
/// needs (`ncclMemAlloc`, `ncclCommRegister`), and its `ncclConfig_t` era is the one we know.
pub const MIN_VERSION: i32 = 21900;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{DataType, ReduceOp};

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(version_string(22809), "2.28.9");
        assert_eq!(version_string(21000), "2.10.0");
        assert_eq!(version_string(2708), "2.7.8");
        assert_eq!(version_string(21903), "2.19.3");
    }

    #[test]
    fn enums_match_nccl_numbering() {
        // ncclFloat16 = 6, ncclFloat32 = 7, ncclBfloat16 = 9, ncclFloat8e5m2 = 11.
        assert_eq!(DataType::Float16.nccl_id(), 6);
        assert_eq!(DataType::Float32.nccl_id(), 7);
        assert_eq!(DataType::Bfloat16.nccl_id(), 9);
        assert_eq!(DataType::Float8E5M2.nccl_id(), 11);
        assert_eq!(DataType::Int8.nccl_id(), 0);
        // ncclSum = 0 .. ncclAvg = 4.
        assert_eq!(ReduceOp::Sum.nccl_id(), 0);
        assert_eq!(ReduceOp::Max.nccl_id(), 2);
        assert_eq!(ReduceOp::Avg.nccl_id(), 4);
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    }

    #[test]
    fn unique_id_bytes_round_trip() {
        let b: Vec<u8> = (0..128).map(|i| (i * 7) as u8).collect();
        let id = UniqueId::from_bytes(&b).unwrap();
        assert_eq!(id.to_bytes(), b);
        assert!(UniqueId::from_bytes(&b[..127]).is_none());
    }
}
