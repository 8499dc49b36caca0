//! The exported entry points. Each `nccl<Name>` has a `pnccl<Name>` twin (what profilers
//! interpose on), and each checks its arguments before it changes anything.

#![allow(non_snake_case)]
// The C signatures, argument for argument.
#![allow(clippy::too_many_arguments)]
// Entry points called from C: their safety contract is NCCL's documentation.
#![allow(clippy::missing_safety_doc)]

use crate::abi::{self, NcclResult, RawComm, RawStream, UniqueId};
use crate::fail::{error_string, guard, last_error_ptr, set_thread_error, Fail, Res};
use crate::group;
use crate::handle::{lookup, register, unregister, Handle};
use crate::logging;
use crate::memory::{self, RegKind, Registration};
use ferroccl::{CollKind, Comm, Config, DataType, Device, OpArgs, ReduceOp};
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Defines `ncclX` and `pncclX`, the body run under [`guard`].
macro_rules! export {
    ($( $(#[$doc:meta])* fn $name:ident / $pname:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block )*) => {$(
        $(#[$doc])*
        #[no_mangle]
        pub unsafe extern "C" fn $pname($($arg: $ty),*) -> NcclResult {
            guard(stringify!($name), || -> Res { $body })
        }
        $(#[$doc])*
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> NcclResult {
            $pname($($arg),*)
        }
    )*};
}

/// A symbol that exists so that programs load, but does nothing here.
fn not_implemented(name: &str) -> Fail {
    Fail::usage(format!(
        "{name} is not implemented by ferroccl's libnccl.so.2 (NCCL's device API is out of its scope; see docs/NCCL.md)"
    ))
}

fn out<T>(p: *mut T, what: &str) -> Res<*mut T> {
    if p.is_null() {
        Err(Fail::arg(format!("{what} is a null pointer")))
    } else {
        Ok(p)
    }
}

fn dtype(d: c_int) -> Res<DataType> {
    DataType::from_nccl_id(d)
        .map_err(|_| Fail::arg(format!("datatype {d} is not an ncclDataType_t (0 to 11)")))
}

fn rank_arg(v: c_int, what: &str) -> Res<usize> {
    usize::try_from(v).map_err(|_| Fail::arg(format!("{what} {v} is negative")))
}

/// Where a communicator made now runs: the GPU current on this thread, else the host.
fn device() -> Res<Device> {
    match std::env::var("FERROCCL_NCCL_BACKEND").as_deref() {
        Ok("host") => return Ok(Device::Host),
        Ok("gpu") | Ok("") | Err(_) => {}
        Ok(other) => {
            return Err(Fail::arg(format!(
                "FERROCCL_NCCL_BACKEND={other}: use host or gpu"
            )))
        }
    }
    let current = ferroccl::cuda::current_device().map_err(Fail::from)?;
    match (current, std::env::var("FERROCCL_NCCL_BACKEND").as_deref()) {
        (Some(d), _) => Ok(Device::Cuda(d)),
        (None, Ok("gpu")) => Err(Fail { code: abi::UNHANDLED_CUDA_ERROR, msg: "FERROCCL_NCCL_BACKEND=gpu but no CUDA context is current on this thread (call cudaSetDevice first)".into() }),
        (None, _) => Ok(Device::Host),
    }
}

/// ferroccl's settings, with the NCCL_* variables that mean something here checked.
fn config() -> Res<Config> {
    logging::init();
    nvls_setting(std::env::var("NCCL_NVLS_ENABLE").ok().as_deref())?;
    let mut cfg = Config::from_env().map_err(Fail::from)?;
    // NCCL_SOCKET_IFNAME picks the interface the bootstrap listens on, unless ferroccl's own
    // FERROCCL_BOOTSTRAP_ADDR names an address.
    if cfg.bootstrap_addr.is_none() {
        if let Some(spec) = std::env::var("NCCL_SOCKET_IFNAME")
            .ok()
            .filter(|s| !s.trim().is_empty())
        {
            let ip = ferroccl::interface_ip(&spec)
                .map_err(|e| Fail::arg(format!("NCCL_SOCKET_IFNAME={spec}: {}", e.message())))?;
            cfg.bootstrap_addr = Some(ip.to_string());
        }
    }
    Ok(cfg)
}

/// NCCL_COMM_ID ("host:port", "[v6 address]:port"): where rank 0 runs the rendezvous, agreed in
/// advance, so that ranks need not ship a unique id to each other.
fn comm_id_addr(v: &str) -> Res<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    let bad = |why: String| {
        Fail::arg(format!(
            "NCCL_COMM_ID={v}: {why}; give host:port, e.g. 10.0.0.1:29500"
        ))
    };
    let addrs: Vec<std::net::SocketAddr> = v
        .trim()
        .to_socket_addrs()
        .map_err(|e| bad(e.to_string()))?
        .collect();
    let a = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| bad("resolves to no address".into()))?;
    if a.port() == 0 {
        return Err(bad("port 0 cannot be agreed on".into()));
    }
    Ok(a)
}

/// NCCL_NVLS_ENABLE asks for NVLink multicast (NVLS), which ferroccl never uses: any value but
/// 0 is refused rather than silently ignored.
fn nvls_setting(v: Option<&str>) -> Res {
    match v.map(str::trim) {
        None | Some("0") => Ok(()),
        Some(v) => Err(Fail::usage(format!(
            "NCCL_NVLS_ENABLE={v}: ferroccl never uses NVLink multicast; unset it or set 0"
        ))),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn comm_id_is_an_address_with_a_port() {
        assert_eq!(
            super::comm_id_addr("127.0.0.1:29500").unwrap().to_string(),
            "127.0.0.1:29500"
        );
        assert_eq!(
            super::comm_id_addr(" [::1]:7 ").unwrap().to_string(),
            "[::1]:7"
        );
        assert!(super::comm_id_addr("localhost:29500")
            .unwrap()
            .ip()
            .is_loopback());
        for bad in [
            "127.0.0.1",
            "127.0.0.1:0",
            "127.0.0.1:port",
            "",
            "no.such.host.invalid:1",
        ] {
            let e = super::comm_id_addr(bad).unwrap_err();
            assert_eq!(e.code, crate::abi::INVALID_ARGUMENT);
            assert!(
                e.msg.contains("NCCL_COMM_ID") && e.msg.contains("host:port"),
                "{bad}: {}",
                e.msg
            );
        }
    }

    #[test]
    fn nvls_is_refused_unless_off() {
        assert!(super::nvls_setting(None).is_ok());
        assert!(super::nvls_setting(Some("0")).is_ok());
        let e = super::nvls_setting(Some("1")).unwrap_err();
        assert_eq!(e.code, crate::abi::INVALID_USAGE);
        assert!(e.msg.contains("NVLink multicast"));
    }
}

/// Reads what ferroccl uses of an `ncclConfig_t`: only fields the caller's `size` covers.
/// Rejects a struct that was never initialised (its magic). Returns whether the communicator
/// is blocking: `config.blocking`, else NCCL_COMM_BLOCKING, else blocking.
unsafe fn read_config(c: *const abi::Config) -> Res<bool> {
    let default = || -> Res<bool> {
        match std::env::var("NCCL_COMM_BLOCKING")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            None | Some("") => Ok(true),
            Some("0") => Ok(false),
            Some("1") => Ok(true),
            Some(v) => Err(Fail::arg(format!("NCCL_COMM_BLOCKING={v}: give 0 or 1"))),
        }
    };
    if c.is_null() {
        return default();
    }
    // SAFETY: the caller's struct; size, magic and version are the first 16 bytes of every
    // version of it.
    let (size, magic) = unsafe { ((*c).size, (*c).magic) };
    if magic != abi::CONFIG_MAGIC {
        return Err(Fail::arg(format!("the ncclConfig_t's magic is {magic:#x}, not 0xcafebeef: initialise it with NCCL_CONFIG_INITIALIZER")));
    }
    let covers = |off: usize| size >= off + 4;
    // SAFETY: read only when the caller's struct reaches the field.
    let blocking = if covers(std::mem::offset_of!(abi::Config, blocking)) {
        unsafe { (*c).blocking }
    } else {
        abi::CONFIG_UNDEF_INT
    };
    match blocking {
        abi::CONFIG_UNDEF_INT => default(),
        0 => Ok(false),
        1 => Ok(true),
        v => Err(Fail::arg(format!(
            "config.blocking = {v}: give 0 (non-blocking) or 1"
        ))),
    }
}

fn make_comm(
    id: UniqueId,
    nranks: c_int,
    rank: c_int,
    device: Device,
    cfg: &Config,
    abort: Arc<AtomicBool>,
) -> Result<Comm, Fail> {
    let fid = ferroccl::UniqueId::from_bytes(&id.to_bytes()).map_err(Fail::from)?;
    Comm::init_rank_abortable(&fid, nranks as usize, rank as usize, device, cfg, abort)
        .map_err(Fail::from)
}

unsafe fn init_rank(
    comm: *mut RawComm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    c: *const abi::Config,
) -> Res {
    let comm = out(comm, "comm")?;
    if nranks < 1 || rank < 0 || rank >= nranks {
        return Err(Fail::arg(format!(
            "rank {rank} of {nranks}: need 0 <= rank < nranks"
        )));
    }
    let blocking = unsafe { read_config(c) }?;
    let cfg = config()?;
    let dev = device()?;
    // The creation ends early when ncclCommAbort raises the handle's flag.
    let job = |h: &Handle| -> group::InitJob {
        let abort = h.init_abort();
        Box::new(move || make_comm(id, nranks, rank, dev, &cfg, abort).map(Some))
    };
    unsafe { create(comm, true, blocking, None, job) }
}

/// A communicator's creation (from a unique id, or by split or shrink of `parent`): `*newcomm`
/// gets its handle at once (NULL when `gets_one` is false: a split without a color still takes
/// part), and the job `job` makes for that handle runs now, at the group's end, or in the
/// background. A creation that fails at once leaves NULL.
unsafe fn create(
    newcomm: *mut RawComm,
    gets_one: bool,
    blocking: bool,
    parent: Option<RawComm>,
    job: impl FnOnce(&Handle) -> group::InitJob,
) -> Res {
    let (raw, h) = if gets_one {
        register(Handle::pending())
    } else {
        (std::ptr::null_mut(), Arc::new(Handle::pending()))
    };
    // SAFETY: the caller checked it non-null.
    unsafe { *newcomm = raw };
    let job = job(&h);
    let r = group::init(parent.map(|p| p as usize), h, blocking, job);
    if r.as_ref().is_err_and(|f| f.code != abi::IN_PROGRESS) && !group::in_group() && !raw.is_null()
    {
        let _ = unregister(raw);
        unsafe { *newcomm = std::ptr::null_mut() };
    }
    r
}

unsafe fn op(
    kind: CollKind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: c_int,
    redop: c_int,
    root: c_int,
    comm: RawComm,
    stream: RawStream,
) -> Res {
    let h = lookup(comm)?;
    let dtype = dtype(dt)?;
    let (op, device_scalar) = if kind.reduces() {
        h.redop(redop, dtype)?
    } else {
        (ReduceOp::Sum, None)
    };
    let root = rank_arg(
        root,
        if matches!(kind, CollKind::Send | CollKind::Recv) {
            "peer"
        } else {
            "root"
        },
    )?;
    let args = OpArgs {
        kind,
        send: send as *const u8,
        recv: recv as *mut u8,
        count,
        dtype,
        op,
        root,
        device_scalar,
    };
    group::submit(h, args, stream)
}

fn comm_int(comm: RawComm, v: *mut c_int, f: impl FnOnce(&Comm) -> i64) -> Res {
    let h = lookup(comm)?;
    let v = out(v, "the result pointer")?;
    let x = f(h.comm()?);
    // SAFETY: checked non-null; the caller's out parameter.
    unsafe { *v = x as c_int };
    Ok(())
}

export! {
    fn ncclGetVersion / pncclGetVersion(version: *mut c_int) {
        let v = out(version, "version")?;
        unsafe { *v = abi::API_VERSION };
        Ok(())
    }

    fn ncclGetUniqueId / pncclGetUniqueId(unique_id: *mut UniqueId) {
        let p = out(unique_id, "uniqueId")?;
        let cfg = config()?;
        let id = match std::env::var("NCCL_COMM_ID").ok().filter(|s| !s.trim().is_empty()) {
            // Every rank makes the same id; rank 0 starts the rendezvous when it joins.
            Some(v) => ferroccl::UniqueId::at(comm_id_addr(&v)?, cfg.job_secret.unwrap_or([0u8; 16])),
            None => ferroccl::UniqueId::new(&cfg).map_err(Fail::from)?,
        };
        let raw = UniqueId::from_bytes(id.as_bytes()).ok_or_else(|| Fail { code: abi::INTERNAL_ERROR, msg: "a unique id of the wrong size".into() })?;
        unsafe { *p = raw };
        Ok(())
    }

    fn ncclCommInitRank / pncclCommInitRank(comm: *mut RawComm, nranks: c_int, id: UniqueId, rank: c_int) {
        unsafe { init_rank(comm, nranks, id, rank, std::ptr::null()) }
    }

    fn ncclCommInitRankConfig / pncclCommInitRankConfig(comm: *mut RawComm, nranks: c_int, id: UniqueId, rank: c_int, config: *mut abi::Config) {
        unsafe { init_rank(comm, nranks, id, rank, config) }
    }

    fn ncclCommInitAll / pncclCommInitAll(comms: *mut RawComm, ndev: c_int, devlist: *const c_int) {
        let comms = out(comms, "comms")?;
        if ndev < 1 {
            return Err(Fail::arg(format!("ndev {ndev}: at least 1")));
        }
        let n = ndev as usize;
        // SAFETY: NCCL's contract: ndev entries when not null.
        let list = (!devlist.is_null()).then(|| unsafe { std::slice::from_raw_parts(devlist, n) });
        let gpus: Option<Vec<usize>> = list.map(|l| l.iter().map(|&d| rank_arg(d, "device")).collect::<Res<_>>()).transpose()?;
        // FERROCCL_NCCL_BACKEND=host wins over a device list (whose entries are checked but name
        // no GPU then); otherwise a list, or no GPU current on this thread, decides.
        let forced_host = std::env::var("FERROCCL_NCCL_BACKEND").as_deref() == Ok("host");
        let devices: Vec<Device> = match gpus {
            _ if forced_host => vec![Device::Host; n],
            Some(g) => g.into_iter().map(Device::Cuda).collect(),
            None if matches!(device()?, Device::Host) => vec![Device::Host; n],
            None => (0..n).map(Device::Cuda).collect(),
        };
        let made = Comm::init_devices(&devices, &config()?).map_err(Fail::from)?;
        for (i, c) in made.into_iter().enumerate() {
            let (raw, _) = register(Handle::ready(c));
            unsafe { *comms.add(i) = raw };
        }
        Ok(())
    }

    fn ncclCommSplit / pncclCommSplit(comm: RawComm, color: c_int, key: c_int, newcomm: *mut RawComm, config: *mut abi::Config) {
        let h = lookup(comm)?;
        let newcomm = out(newcomm, "newcomm")?;
        if color < 0 && color != abi::SPLIT_NOCOLOR {
            return Err(Fail::arg(format!("color {color}: a color is non-negative, or NCCL_SPLIT_NOCOLOR (-1)")));
        }
        let blocking = unsafe { read_config(config) }?;
        let color = (color >= 0).then_some(color as u32);
        h.comm()?;
        // The new handle (none without a color: known now) completes as a creation does: at
        // once, at the group's end, or in the background.
        let job: group::InitJob = Box::new(move || h.comm()?.split(color, key).map_err(Fail::from));
        unsafe { create(newcomm, color.is_some(), blocking, Some(comm), |_| job) }
    }

    fn ncclCommFinalize / pncclCommFinalize(comm: RawComm) {
        lookup(comm)?.comm()?.synchronize().map_err(Fail::from)
    }

    fn ncclCommDestroy / pncclCommDestroy(comm: RawComm) {
        // The communicator goes when the last call using it returns; dropping waits for its
        // queued work.
        drop(unregister(comm)?);
        Ok(())
    }

    fn ncclCommAbort / pncclCommAbort(comm: RawComm) {
        unregister(comm)?.abort();
        Ok(())
    }

    fn ncclCommGetAsyncError / pncclCommGetAsyncError(comm: RawComm, async_error: *mut NcclResult) {
        let h = lookup(comm)?;
        let p = out(async_error, "asyncError")?;
        let r = match h.comm() {
            Ok(c) => match c.failure() {
                None => abi::SUCCESS,
                // The thread that asks (PyTorch's watchdog) reads the text next.
                Some(e) => {
                    set_thread_error(&format!("communicator failed: {e}"));
                    e.nccl_result()
                }
            },
            // Still inside its group: NCCL says "in progress"; a failed creation is its error.
            Err(f) if f.code == abi::INVALID_USAGE => abi::IN_PROGRESS,
            Err(f) => f.code,
        };
        unsafe { *p = r };
        Ok(())
    }

    fn ncclCommCount / pncclCommCount(comm: RawComm, count: *mut c_int) {
        comm_int(comm, count, |c| c.nranks() as i64)
    }

    /// The communicator's CUDA device; -1 for one on the host backend.
    fn ncclCommCuDevice / pncclCommCuDevice(comm: RawComm, device: *mut c_int) {
        comm_int(comm, device, |c| match c.device() { Device::Cuda(d) => d as i64, Device::Host => -1 })
    }

    fn ncclCommUserRank / pncclCommUserRank(comm: RawComm, rank: *mut c_int) {
        comm_int(comm, rank, |c| c.rank() as i64)
    }

    fn ncclRedOpCreatePreMulSum / pncclRedOpCreatePreMulSum(op: *mut c_int, scalar: *mut c_void, datatype: c_int, residence: c_int, comm: RawComm) {
        let h = lookup(comm)?;
        let op = out(op, "op")?;
        let id = unsafe { h.create_premul(scalar as *const u8, dtype(datatype)?, residence) }?;
        unsafe { *op = id };
        Ok(())
    }

    fn ncclRedOpDestroy / pncclRedOpDestroy(op: c_int, comm: RawComm) {
        lookup(comm)?.destroy_premul(op)
    }

    fn ncclAllReduce / pncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::AllReduce, send, recv, count, datatype, op, 0, comm, stream) }
    }

    fn ncclReduce / pncclReduce(send: *const c_void, recv: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::Reduce, send, recv, count, datatype, op, root, comm, stream) }
    }

    fn ncclBroadcast / pncclBroadcast(send: *const c_void, recv: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::Broadcast, send, recv, count, datatype, 0, root, comm, stream) }
    }

    /// The in-place broadcast of NCCL's first API.
    fn ncclBcast / pncclBcast(buff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::Broadcast, buff, buff, count, datatype, 0, root, comm, stream) }
    }

    fn ncclReduceScatter / pncclReduceScatter(send: *const c_void, recv: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::ReduceScatter, send, recv, recvcount, datatype, op, 0, comm, stream) }
    }

    fn ncclAllGather / pncclAllGather(send: *const c_void, recv: *mut c_void, sendcount: usize, datatype: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::AllGather, send, recv, sendcount, datatype, 0, 0, comm, stream) }
    }

    fn ncclAlltoAll / pncclAlltoAll(send: *const c_void, recv: *mut c_void, count: usize, datatype: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::AllToAll, send, recv, count, datatype, 0, 0, comm, stream) }
    }

    fn ncclGather / pncclGather(send: *const c_void, recv: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::Gather, send, recv, count, datatype, 0, root, comm, stream) }
    }

    fn ncclScatter / pncclScatter(send: *const c_void, recv: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::Scatter, send, recv, count, datatype, 0, root, comm, stream) }
    }

    fn ncclSend / pncclSend(send: *const c_void, count: usize, datatype: c_int, peer: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::Send, send, std::ptr::null_mut(), count, datatype, 0, peer, comm, stream) }
    }

    fn ncclRecv / pncclRecv(recv: *mut c_void, count: usize, datatype: c_int, peer: c_int, comm: RawComm, stream: RawStream) {
        unsafe { self::op(CollKind::Recv, std::ptr::null(), recv, count, datatype, 0, peer, comm, stream) }
    }

    /// One id is enough for ferroccl's rendezvous: the first is used (every rank passes the
    /// same list).
    fn ncclCommInitRankScalable / pncclCommInitRankScalable(comm: *mut RawComm, nranks: c_int, rank: c_int, n_id: c_int, ids: *mut UniqueId, config: *mut abi::Config) {
        let ids = out(ids, "commIds")?;
        if n_id < 1 {
            return Err(Fail::arg(format!("nId {n_id}: at least one id")));
        }
        unsafe { init_rank(comm, nranks, *ids, rank, config) }
    }

    fn ncclCommShrink / pncclCommShrink(comm: RawComm, exclude: *mut c_int, n_exclude: c_int, newcomm: *mut RawComm, config: *mut abi::Config, flags: c_int) {
        let h = lookup(comm)?;
        let newcomm = out(newcomm, "newcomm")?;
        if n_exclude < 0 || (n_exclude > 0 && exclude.is_null()) {
            return Err(Fail::arg(format!("excludeRanksCount {n_exclude} with {} list", if exclude.is_null() { "a null" } else { "a" })));
        }
        if flags & !abi::SHRINK_ABORT != 0 {
            return Err(Fail::arg(format!("shrinkFlags {flags:#x}: only NCCL_SHRINK_DEFAULT (0) and NCCL_SHRINK_ABORT (1)")));
        }
        let blocking = unsafe { read_config(config) }?;
        let list: Vec<usize> = if n_exclude == 0 { Vec::new() } else { unsafe { std::slice::from_raw_parts(exclude, n_exclude as usize) }.iter().map(|&r| rank_arg(r, "excluded rank")).collect::<Res<_>>()? };
        let c = h.comm()?;
        if flags & abi::SHRINK_ABORT != 0 {
            c.abort();
        }
        let job: group::InitJob = Box::new(move || h.comm()?.shrink(&list).map(Some).map_err(Fail::from));
        unsafe { create(newcomm, true, blocking, Some(comm), |_| job) }
    }

    /// Stops the communicator's operations (its kernels leave, waiting calls fail) and keeps
    /// the handle for destroy, split or shrink.
    fn ncclCommRevoke / pncclCommRevoke(comm: RawComm, flags: c_int) {
        if flags != 0 {
            return Err(Fail::arg(format!("revokeFlags {flags:#x}: only 0 is defined")));
        }
        lookup(comm)?.comm()?.abort();
        Ok(())
    }

    fn ncclMemAlloc / pncclMemAlloc(ptr: *mut *mut c_void, size: usize) {
        let p = out(ptr, "ptr")?;
        let on = match device()? { Device::Cuda(d) => Some(d), Device::Host => None };
        let m = memory::alloc(size, on)?;
        unsafe { *p = m as *mut c_void };
        Ok(())
    }

    fn ncclMemFree / pncclMemFree(ptr: *mut c_void) {
        memory::free(ptr as *mut u8)
    }

    /// This rank alone: GPU memory (cuMem, or `cudaMalloc`'s by its IPC handle to peers in other
    /// processes) is lent to the peers, which then store an operation's messages straight into
    /// it where it is the output (`Comm::register_local`); other memory is refused. Host
    /// communicators keep a handle only.
    fn ncclCommRegister / pncclCommRegister(comm: RawComm, buff: *mut c_void, size: usize, handle: *mut *mut c_void) {
        let h = lookup(comm)?;
        let c = h.comm()?;
        let handle = out(handle, "handle")?;
        if buff.is_null() || size == 0 {
            return Err(Fail::arg(format!("buffer {buff:p} of {size} bytes")));
        }
        let made = c.gpu().is_some();
        if made {
            // SAFETY: NCCL's contract: the buffer stays allocated until deregistration.
            unsafe { c.register_local(buff as u64, size) }.map_err(Fail::from)?;
        }
        unsafe { *handle = memory::remember(Registration { comm: comm as usize, ptr: buff as u64, kind: RegKind::Buffer, made }) };
        Ok(())
    }

    fn ncclCommDeregister / pncclCommDeregister(comm: RawComm, handle: *mut c_void) {
        let h = lookup(comm)?;
        let r = memory::forget(handle, comm as usize, RegKind::Buffer)?;
        if !r.made {
            return Ok(());
        }
        h.comm()?.deregister_local(r.ptr).map_err(Fail::from)
    }

    /// Collective: every rank registers its buffer; GPU memory from ncclMemAlloc (cuMem) is
    /// then written by peers directly (zero-copy). Host communicators keep a handle only.
    fn ncclCommWindowRegister / pncclCommWindowRegister(comm: RawComm, buff: *mut c_void, size: usize, win: *mut abi::RawWindow, flags: c_int) {
        let h = lookup(comm)?;
        let win = out(win, "win")?;
        if buff.is_null() || size == 0 {
            return Err(Fail::arg(format!("buffer {buff:p} of {size} bytes")));
        }
        if flags & !abi::WIN_COLL_SYMMETRIC != 0 {
            return Err(Fail::arg(format!("winFlags {flags:#x}: only NCCL_WIN_DEFAULT and NCCL_WIN_COLL_SYMMETRIC")));
        }
        let symmetric = flags & abi::WIN_COLL_SYMMETRIC != 0;
        let comm_key = comm as usize;
        // The pointer travels to the group's end (NCCL fills the handle there inside a group).
        let win = win as usize;
        let buff = buff as usize;
        let job = move || -> Res {
            let c = h.comm()?;
            let window = c.gpu().is_some();
            if window {
                // SAFETY: NCCL's contract: the buffer stays allocated until deregistration.
                // NCCL_WIN_COLL_SYMMETRIC carries NCCL's promise (every rank's buffers at the
                // same offsets of windows of one size), which lets large data movement skip
                // every copy but one (`Comm::register_symmetric_window`).
                if symmetric {
                    unsafe { c.register_symmetric_window(buff as u64, size) }.map_err(Fail::from)?;
                } else {
                    unsafe { c.register_window(buff as u64, size) }.map_err(Fail::from)?;
                }
            }
            // SAFETY: checked non-null above; the caller's handle lives until the call (or its
            // group) returns.
            unsafe { *(win as *mut abi::RawWindow) = memory::remember(Registration { comm: comm_key, ptr: buff as u64, kind: RegKind::Window, made: window }) };
            Ok(())
        };
        // Collective: inside a group it runs at the group's end, beside the group's other
        // collective calls, so that one thread may register on every rank it drives.
        group::collective(comm_key, Box::new(job))
    }

    fn ncclCommWindowDeregister / pncclCommWindowDeregister(comm: RawComm, win: abi::RawWindow) {
        let h = lookup(comm)?;
        let r = memory::forget(win, comm as usize, RegKind::Window)?;
        if !r.made {
            return Ok(());
        }
        // This rank only (as NCCL's: nccl-tests deregisters every rank in turn from one thread).
        h.comm()?.deregister_window(r.ptr).map_err(Fail::from)
    }

    fn ncclGroupStart / pncclGroupStart() {
        group::start()
    }

    fn ncclGroupEnd / pncclGroupEnd() {
        group::end()
    }

    /// NCCL's device API (kernels that communicate through a device communicator, LSA/GIN)
    /// is not part of ferroccl's drop-in library: present so that programs linked against
    /// it load, refused when called.
    fn ncclDevCommCreate / pncclDevCommCreate(_comm: RawComm, _reqs: *const c_void, _out: *mut c_void) {
        Err(not_implemented("ncclDevCommCreate"))
    }

    fn ncclDevCommDestroy / pncclDevCommDestroy(_comm: RawComm, _dev_comm: *const c_void) {
        Err(not_implemented("ncclDevCommDestroy"))
    }

    /// Ends a group as ncclGroupEnd does, but the operations are checked, estimated and
    /// dropped instead of run; the estimate (microseconds, from the tuner's cost model) goes
    /// to `simInfo->estimatedTime` when the outermost group ends.
    fn ncclGroupSimulateEnd / pncclGroupSimulateEnd(sim_info: *mut abi::SimInfo) {
        let p = out(sim_info, "simInfo")?;
        // Only the fields the caller's struct has: size and magic first.
        let (size, magic) = unsafe { ((*p).size, (*p).magic) };
        if magic != abi::SIM_INFO_MAGIC {
            return Err(Fail::arg(format!(
                "simInfo has magic {magic:#x}, not {:#x}: initialise it with NCCL_SIM_INFO_INITIALIZER",
                abi::SIM_INFO_MAGIC
            )));
        }
        let field = std::mem::offset_of!(abi::SimInfo, estimated_time) + std::mem::size_of::<f32>();
        if size < field {
            return Err(Fail::arg(format!("simInfo is {size} bytes, too small for estimatedTime (needs {field})")));
        }
        if let Some(us) = group::simulate_end()? {
            unsafe { (*p).estimated_time = us as f32 };
        }
        Ok(())
    }
}

#[no_mangle]
pub unsafe extern "C" fn pncclGetErrorString(result: NcclResult) -> *const c_char {
    error_string(result).as_ptr()
}
#[no_mangle]
pub unsafe extern "C" fn ncclGetErrorString(result: NcclResult) -> *const c_char {
    error_string(result).as_ptr()
}
/// The last failure's text: the failure of `comm` when it is a communicator that has failed,
/// else this thread's last failed call, else the process's latest.
#[no_mangle]
pub unsafe extern "C" fn pncclGetLastError(comm: RawComm) -> *const c_char {
    last_error_of(comm)
}
#[no_mangle]
pub unsafe extern "C" fn ncclGetLastError(comm: RawComm) -> *const c_char {
    last_error_of(comm)
}

fn last_error_of(comm: RawComm) -> *const c_char {
    // Never panic into C; a lookup that fails (NULL, unknown) just falls back.
    let failed = std::panic::catch_unwind(|| {
        let h = lookup(comm).ok()?;
        let c = h.comm().ok()?;
        c.failure()
    });
    if let Ok(Some(e)) = failed {
        set_thread_error(&format!("communicator failed: {e}"));
    }
    last_error_ptr()
}

// The exported functions have exactly the signatures the loader's types say (one definition of
// the ABI): a mismatch fails to compile.
const _: () = {
    let _: abi::GetVersionFn = ncclGetVersion;
    let _: abi::GetUniqueIdFn = ncclGetUniqueId;
    let _: abi::CommInitRankFn = ncclCommInitRank;
    let _: abi::CommInitRankConfigFn = ncclCommInitRankConfig;
    let _: abi::CommInitAllFn = ncclCommInitAll;
    let _: abi::CommSplitFn = ncclCommSplit;
    let _: abi::CommFn = ncclCommDestroy;
    let _: abi::CommFn = ncclCommAbort;
    let _: abi::CommFn = ncclCommFinalize;
    let _: abi::CommIntFn = ncclCommCount;
    let _: abi::CommIntFn = ncclCommCuDevice;
    let _: abi::CommIntFn = ncclCommUserRank;
    let _: abi::CommGetAsyncErrorFn = ncclCommGetAsyncError;
    let _: abi::GroupFn = ncclGroupStart;
    let _: abi::GroupFn = ncclGroupEnd;
    let _: abi::GroupSimulateEndFn = ncclGroupSimulateEnd;
    let _: abi::GetErrorStringFn = ncclGetErrorString;
    let _: abi::GetLastErrorFn = ncclGetLastError;
    let _: abi::AllReduceFn = ncclAllReduce;
    let _: abi::ReduceScatterFn = ncclReduceScatter;
    let _: abi::AllGatherFn = ncclAllGather;
    let _: abi::AllGatherFn = ncclAlltoAll;
    let _: abi::BroadcastFn = ncclBroadcast;
    let _: abi::BroadcastFn = ncclGather;
    let _: abi::BroadcastFn = ncclScatter;
    let _: abi::BcastFn = ncclBcast;
    let _: abi::ReduceFn = ncclReduce;
    let _: abi::SendFn = ncclSend;
    let _: abi::RecvFn = ncclRecv;
    let _: abi::RedOpCreatePreMulSumFn = ncclRedOpCreatePreMulSum;
    let _: abi::RedOpDestroyFn = ncclRedOpDestroy;
    let _: abi::CommShrinkFn = ncclCommShrink;
    let _: abi::CommFlagsFn = ncclCommRevoke;
    let _: abi::CommInitRankScalableFn = ncclCommInitRankScalable;
    let _: abi::MemAllocFn = ncclMemAlloc;
    let _: abi::MemFreeFn = ncclMemFree;
    let _: abi::CommRegisterFn = ncclCommRegister;
    let _: abi::CommDeregisterFn = ncclCommDeregister;
    let _: abi::CommWindowRegisterFn = ncclCommWindowRegister;
    let _: abi::CommWindowDeregisterFn = ncclCommWindowDeregister;
};
