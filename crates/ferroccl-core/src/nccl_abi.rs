//! NCCL's C ABI, written from the public API's documentation (2.19 to 2.28): handle types, the
//! 128-byte unique id, result codes, the configuration struct, constants and the signatures of
//! the entry points. One definition for both sides of it: the drop-in `libnccl.so.2`
//! (`ferroccl-nccl`) exports functions of these types, and `ferroccl bench --vs-nccl` loads
//! NVIDIA's library through them. `include/nccl.h` of ferroccl-nccl declares the same, and a
//! test compiles it to check every size, offset and value against this file.
//!
//! Enums travel as C `int`s, as the C compiler passes them. The data-type and reduction
//! numbering is `DataType::nccl_id` / `ReduceOp::nccl_id`.

use std::ffi::{c_char, c_int, c_void};

/// `ncclComm_t`: an opaque pointer.
pub type RawComm = *mut c_void;
/// `ncclWindow_t` (2.27+): an opaque pointer.
pub type RawWindow = *mut c_void;
/// `cudaStream_t`, which is the driver's `CUstream` handle.
pub type RawStream = *mut c_void;
/// `ncclResult_t`.
pub type NcclResult = c_int;

/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: 128 opaque bytes, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    /// The id's bytes, opaque to the caller.
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

impl UniqueId {
    /// An id of zeros (an out parameter to fill).
    pub fn zeroed() -> UniqueId {
        UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        }
    }
    /// The id's bytes.
    pub fn to_bytes(self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }
    /// The id from exactly `UNIQUE_ID_BYTES` bytes; None for any other length.
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

/// `ncclSuccess`.
pub const SUCCESS: NcclResult = 0;
/// `ncclUnhandledCudaError`: a CUDA call failed.
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
/// `ncclSystemError`: a system call or resource failed.
pub const SYSTEM_ERROR: NcclResult = 2;
/// `ncclInternalError`: a bug in the library.
pub const INTERNAL_ERROR: NcclResult = 3;
/// `ncclInvalidArgument`: a bad argument.
pub const INVALID_ARGUMENT: NcclResult = 4;
/// `ncclInvalidUsage`: a call the API does not allow here.
pub const INVALID_USAGE: NcclResult = 5;
/// `ncclRemoteError`: a peer failed, died or went away.
pub const REMOTE_ERROR: NcclResult = 6;
/// `ncclInProgress`: a non-blocking communicator's operation still under way.
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

/// `NCCL_SPLIT_NOCOLOR`: a rank that takes part in no communicator of a split.
pub const SPLIT_NOCOLOR: c_int = -1;
/// `NCCL_CONFIG_UNDEF_INT`: a configuration field left to the library.
pub const CONFIG_UNDEF_INT: c_int = i32::MIN;
/// The `magic` of an initialised `ncclConfig_t`.
pub const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `ncclNumOps`: reduction handles from `ncclRedOpCreatePreMulSum` start here.
pub const NUM_BUILTIN_OPS: c_int = 5;
/// `ncclScalarResidence_t`.
pub const SCALAR_DEVICE: c_int = 0;
/// `ncclScalarHostImmediate`: the pre-multiplied-sum scalar is read from host memory at the call.
pub const SCALAR_HOST_IMMEDIATE: c_int = 1;
/// `NCCL_SHRINK_ABORT`: abort the parent's operations before shrinking.
pub const SHRINK_ABORT: c_int = 0x01;
/// `NCCL_WIN_COLL_SYMMETRIC`: every rank registers a buffer of the same size, which lets NCCL
/// use its symmetric-memory kernels.
pub const WIN_COLL_SYMMETRIC: c_int = 0x01;

/// The API level the drop-in library implements, as `ncclGetVersion` reports it: 2.28.9, so
/// that clients take their 2.28 paths.
pub const API_VERSION: c_int = 22809;

/// `ncclConfig_t` as far as `include/nccl.h` declares it (the 2.27 fields). Callers compiled
/// against a newer header pass a larger `size` and a higher `version`; the library reads only
/// the fields that both the caller's size and this struct cover.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Bytes of the caller's struct (`sizeof(ncclConfig_t)` where it was compiled).
    pub size: usize,
    /// Must be `CONFIG_MAGIC`: the struct was initialised with `NCCL_CONFIG_INITIALIZER`.
    pub magic: u32,
    /// The API version the caller was compiled against.
    pub version: u32,
    /// 1: calls block until done; 0: non-blocking (`ncclInProgress`).
    pub blocking: c_int,
    /// CUDA thread-block cluster size for NCCL's kernels.
    pub cga_cluster_size: c_int,
    /// Fewest thread blocks (CTAs) NCCL may use.
    pub min_ctas: c_int,
    /// Most thread blocks (CTAs) NCCL may use.
    pub max_ctas: c_int,
    /// Network plugin to use, by name.
    pub net_name: *const c_char,
    /// Whether a split shares its parent's resources.
    pub split_share: c_int,
    /// Traffic class for network packets.
    pub traffic_class: c_int,
    /// The communicator's name, for logs.
    pub comm_name: *const c_char,
    /// Whether CollNet (in-network reduction) may be used.
    pub collnet_enable: c_int,
    /// CTA policy (`NCCL_CTA_POLICY_*`).
    pub cta_policy: c_int,
    /// Whether a shrink shares its parent's resources.
    pub shrink_share: c_int,
    /// Thread blocks for NVLS collectives.
    pub nvls_ctas: c_int,
    /// Channels per network peer.
    pub n_channels_per_net_peer: c_int,
    /// Whether NVLink-centric scheduling is on.
    pub nvlink_centric_sched: c_int,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER`: every field undefined.
    pub fn initializer() -> Config {
        let u = CONFIG_UNDEF_INT;
        Config {
            size: std::mem::size_of::<Config>(),
            magic: CONFIG_MAGIC,
            version: API_VERSION as u32,
            blocking: u,
            cga_cluster_size: u,
            min_ctas: u,
            max_ctas: u,
            net_name: std::ptr::null(),
            split_share: u,
            traffic_class: u,
            comm_name: std::ptr::null(),
            collnet_enable: u,
            cta_policy: u,
            shrink_share: u,
            nvls_ctas: u,
            n_channels_per_net_peer: u,
            nvlink_centric_sched: u,
        }
    }
}

/// `ncclGetVersion`.
pub type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
/// `ncclGetUniqueId`.
pub type GetUniqueIdFn = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
/// `ncclCommInitRank`.
pub type CommInitRankFn = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
/// `ncclCommInitRankConfig`.
pub type CommInitRankConfigFn =
    unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut Config) -> NcclResult;
/// `ncclCommInitAll`.
pub type CommInitAllFn = unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> NcclResult;
/// (comm, color, key, new comm out, config)
pub type CommSplitFn =
    unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut Config) -> NcclResult;
/// A call taking only a communicator: `ncclCommDestroy`, `ncclCommAbort`, `ncclCommFinalize`.
pub type CommFn = unsafe extern "C" fn(RawComm) -> NcclResult;
/// (comm, exclude list, its length, new comm out, config, flags)
pub type CommShrinkFn = unsafe extern "C" fn(
    RawComm,
    *mut c_int,
    c_int,
    *mut RawComm,
    *mut Config,
    c_int,
) -> NcclResult;
/// (comm, flags): ncclCommRevoke.
pub type CommFlagsFn = unsafe extern "C" fn(RawComm, c_int) -> NcclResult;
/// (comm out, nranks, rank, number of ids, ids, config)
pub type CommInitRankScalableFn = unsafe extern "C" fn(
    *mut RawComm,
    c_int,
    c_int,
    c_int,
    *mut UniqueId,
    *mut Config,
) -> NcclResult;
/// (comm, int out): ncclCommCount, ncclCommCuDevice, ncclCommUserRank.
pub type CommIntFn = unsafe extern "C" fn(RawComm, *mut c_int) -> NcclResult;
/// `ncclGroupStart`, `ncclGroupEnd`.
pub type GroupFn = unsafe extern "C" fn() -> NcclResult;
/// `ncclGetErrorString`.
pub type GetErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;
/// `ncclGetLastError`.
pub type GetLastErrorFn = unsafe extern "C" fn(RawComm) -> *const c_char;
/// `ncclCommGetAsyncError`.
pub type CommGetAsyncErrorFn = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
/// (send, recv, count, datatype, op, comm, stream)
pub type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> NcclResult;
/// (send, recv, sendcount, datatype, comm, stream); also `ncclAlltoAll` (count per peer).
pub type AllGatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    RawComm,
    RawStream,
) -> NcclResult;
/// (send, recv, recvcount, datatype, op, comm, stream)
pub type ReduceScatterFn = AllReduceFn;
/// (send, recv, count, datatype, root, comm, stream); also `ncclGather` / `ncclScatter`.
pub type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> NcclResult;
/// (buffer, count, datatype, root, comm, stream): the in-place `ncclBcast`.
pub type BcastFn =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
/// (send, recv, count, datatype, op, root, comm, stream)
pub type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> NcclResult;
/// (send, count, datatype, peer, comm, stream)
pub type SendFn =
    unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
/// (recv, count, datatype, peer, comm, stream)
pub type RecvFn =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
/// (op out, scalar, datatype, residence, comm)
pub type RedOpCreatePreMulSumFn =
    unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, c_int, RawComm) -> NcclResult;
/// (op, comm)
pub type RedOpDestroyFn = unsafe extern "C" fn(c_int, RawComm) -> NcclResult;
/// (comm, buffer, size, handle out)
pub type CommRegisterFn =
    unsafe extern "C" fn(RawComm, *mut c_void, usize, *mut *mut c_void) -> NcclResult;
/// `ncclCommDeregister`.
pub type CommDeregisterFn = unsafe extern "C" fn(RawComm, *mut c_void) -> NcclResult;
/// `ncclMemAlloc`.
pub type MemAllocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> NcclResult;
/// `ncclMemFree`.
pub type MemFreeFn = unsafe extern "C" fn(*mut c_void) -> NcclResult;
/// (comm, buffer, size, window out, flags)
pub type CommWindowRegisterFn =
    unsafe extern "C" fn(RawComm, *mut c_void, usize, *mut RawWindow, c_int) -> NcclResult;
/// `ncclCommWindowDeregister`.
pub type CommWindowDeregisterFn = unsafe extern "C" fn(RawComm, RawWindow) -> NcclResult;

/// `ncclSimInfo_t`: what `ncclGroupSimulateEnd` fills in. Read size-tolerantly, as the
/// config: the caller's `size` says which fields it has.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimInfo {
    /// Bytes of the caller's struct.
    pub size: usize,
    /// Must be `SIM_INFO_MAGIC` (`NCCL_SIM_INFO_INITIALIZER`).
    pub magic: u32,
    /// The API version the caller was compiled against.
    pub version: u32,
    /// Microseconds.
    pub estimated_time: f32,
}

/// The magic of an initialised `ncclSimInfo_t`.
pub const SIM_INFO_MAGIC: u32 = 0x7468_5283;
/// NCCL's "undefined" float (`NCCL_UNDEF_FLOAT`).
pub const UNDEF_FLOAT: f32 = -1.0;

impl SimInfo {
    /// What `NCCL_SIM_INFO_INITIALIZER` gives.
    pub fn initializer() -> SimInfo {
        SimInfo {
            size: std::mem::size_of::<SimInfo>(),
            magic: SIM_INFO_MAGIC,
            version: API_VERSION as u32,
            estimated_time: UNDEF_FLOAT,
        }
    }
}

/// `ncclGroupSimulateEnd`.
pub type GroupSimulateEndFn = unsafe extern "C" fn(*mut SimInfo) -> NcclResult;

/// "2.28.9" from `ncclGetVersion`'s code. NCCL changed the encoding at 2.9: before it
/// X*1000 + Y*100 + Z, since X*10000 + Y*100 + Z.
pub fn version_string(code: i32) -> String {
    let (x, y, z) = version_parts(code);
    format!("{x}.{y}.{z}")
}

/// (major, minor, patch) of an `ncclGetVersion` code, in either encoding.
pub fn version_parts(code: i32) -> (i32, i32, i32) {
    if code >= 10000 {
        (code / 10000, (code % 10000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{DataType, ReduceOp};

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(version_string(22809), "2.28.9");
        assert_eq!(version_string(21000), "2.10.0");
        assert_eq!(version_string(2708), "2.7.8");
        assert_eq!(version_string(21903), "2.19.3");
        assert_eq!(version_string(API_VERSION), "2.28.9");
    }

    #[test]
    fn enums_match_nccl_numbering() {
        // ncclFloat16 = 6, ncclFloat32 = 7, ncclBfloat16 = 9, ncclFloat8e5m2 = 11.
        assert_eq!(DataType::Float16.nccl_id(), 6);
        assert_eq!(DataType::Float32.nccl_id(), 7);
        assert_eq!(DataType::Bfloat16.nccl_id(), 9);
        assert_eq!(DataType::Float8E5M2.nccl_id(), 11);
        assert_eq!(DataType::Int8.nccl_id(), 0);
        // ncclSum = 0 .. ncclAvg = 4, then the created ones.
        assert_eq!(ReduceOp::Sum.nccl_id(), 0);
        assert_eq!(ReduceOp::Max.nccl_id(), 2);
        assert_eq!(ReduceOp::Avg.nccl_id(), 4);
        assert_eq!(NUM_BUILTIN_OPS, 5);
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    }

    #[test]
    fn the_config_struct_has_the_documented_layout() {
        // size, magic, version, then ints and pointers at their C alignment (LP64).
        assert_eq!(std::mem::offset_of!(Config, magic), 8);
        assert_eq!(std::mem::offset_of!(Config, blocking), 16);
        assert_eq!(std::mem::offset_of!(Config, net_name), 32);
        assert_eq!(std::mem::offset_of!(Config, comm_name), 48);
        assert_eq!(std::mem::offset_of!(Config, nvlink_centric_sched), 76);
        assert_eq!(std::mem::size_of::<Config>(), 80);
        let c = Config::initializer();
        assert_eq!(
            (c.size, c.magic, c.blocking),
            (80, CONFIG_MAGIC, CONFIG_UNDEF_INT)
        );
    }

    #[test]
    fn unique_id_bytes_round_trip() {
        let b: Vec<u8> = (0..128).map(|i| (i * 7) as u8).collect();
        let id = UniqueId::from_bytes(&b).unwrap();
        assert_eq!(id.to_bytes(), b);
        assert!(UniqueId::from_bytes(&b[..127]).is_none());
    }
}
