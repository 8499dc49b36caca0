//! NVIDIA's NCCL, loaded at run time for `ferroccl bench --vs-nccl`.
//!
//! The library is opened with `dlopen` and its entry points looked up by name, never linked:
//! ferroccl builds and runs on machines without NCCL, and a machine with an NCCL too old or
//! not NCCL at all gets an error that says which file, which version and which symbol.
//! Everything here is the benchmark's view of NCCL: blocking communicators, the calls
//! nccl-tests makes, and the registration calls its `-R` option uses.

// The wrappers mirror NCCL's C signatures argument for argument, so that each call reads
// like the header's.
#![allow(clippy::too_many_arguments)]

pub mod find;
pub mod sys;

use crate::api::Error;
use std::ffi::{c_int, c_void, CStr, CString};
use std::path::Path;
use sys::*;

/// Entry points every comparison needs; loading fails naming any that is missing.
pub const REQUIRED: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommInitAll",
    "ncclCommDestroy",
    "ncclCommGetAsyncError",
    "ncclGetErrorString",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclAllReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclBroadcast",
    "ncclReduce",
    "ncclSend",
    "ncclRecv",
];

/// The resolved entry points. Optional ones are None where this NCCL lacks them.
struct Fns {
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    comm_init_all: CommInitAllFn,
    comm_destroy: CommFn,
    comm_get_async_error: CommGetAsyncErrorFn,
    get_error_string: GetErrorStringFn,
    group_start: GroupFn,
    group_end: GroupFn,
    all_reduce: AllReduceFn,
    all_gather: AllGatherFn,
    reduce_scatter: ReduceScatterFn,
    broadcast: BroadcastFn,
    reduce: ReduceFn,
    send: SendFn,
    recv: RecvFn,
    // 2.28 has these as collectives; older versions compose them from send/recv.
    all_to_all: Option<AllGatherFn>,
    gather: Option<BroadcastFn>,
    scatter: Option<BroadcastFn>,
    comm_abort: Option<CommFn>,
    get_last_error: Option<GetLastErrorFn>,
    comm_register: Option<CommRegisterFn>,
    comm_deregister: Option<CommDeregisterFn>,
    mem_alloc: Option<MemAllocFn>,
    mem_free: Option<MemFreeFn>,
    window_register: Option<CommWindowRegisterFn>,
    window_deregister: Option<CommWindowDeregisterFn>,
}

/// A loaded NCCL. The library stays loaded for the life of the process: NCCL starts threads
/// and registers CUDA callbacks that must never find their code unmapped.
pub struct Nccl {
    path: String,
    version: i32,
    f: Fns,
}

// SAFETY: the table holds plain function pointers into a library that is never unloaded;
// NCCL's entry points may be called from any thread.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

/// One NCCL communicator (blocking). Destroyed explicitly with [`Nccl::destroy`], so that
/// the caller decides when (after its streams are idle) and on which thread.
#[derive(Debug, Clone, Copy)]
pub struct NcclComm(pub RawComm);
// SAFETY: NCCL communicators may be used from any thread, one call at a time, which is how
// the benchmark uses each.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

/// A registration to undo before the communicator goes.
#[derive(Debug)]
pub enum Registration {
    /// `ncclCommRegister`'s handle.
    Local(*mut c_void),
    /// `ncclCommWindowRegister`'s window (symmetric), in a slot of its own on the heap: inside
    /// a group NCCL 2.28 keeps the out-pointer it was given and writes the window there only at
    /// `ncclGroupEnd`, so the slot must not move or die before then (a stack slot did: the
    /// process crashed before printing anything).
    Window(Box<RawWindow>),
}
// SAFETY: opaque NCCL handles, used under the same one-call-at-a-time rule.
unsafe impl Send for Registration {}
unsafe impl Sync for Registration {}

fn dlerror_string() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// An open handle from `dlopen`; closed on drop unless kept.
struct Handle(*mut c_void);

impl Handle {
    fn open(name: &str) -> Result<Handle, String> {
        let c =
            CString::new(name).map_err(|_| format!("library path {name:?} contains a NUL byte"))?;
        // SAFETY: c is a valid C string. RTLD_NOW: a library with unresolvable dependencies
        // fails here, with the loader's message, instead of at the first call.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err(dlerror_string());
        }
        Ok(Handle(h))
    }

    fn sym(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: the handle is open; the name is a valid C string.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    /// Keeps the library loaded for good (see [`Nccl`]).
    fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: opened by dlopen; nothing from it was called beyond ncclGetVersion.
        unsafe { libc::dlclose(self.0) };
    }
}

impl Nccl {
    /// Loads NCCL: from `explicit` when given, else the first of the loader's `libnccl.so.2`
    /// and the Python package's that loads and passes the checks. The error lists every
    /// place tried and why each failed.
    pub fn load(explicit: Option<&Path>) -> Result<Nccl, String> {
        let mut tried = Vec::new();
        for c in find::candidates(explicit) {
            let (name, what) = match &c {
                find::Candidate::Explicit(p) => (p.display().to_string(), p.display().to_string()),
                find::Candidate::Loader => (
                    find::SONAME.to_string(),
                    format!("{} (system loader)", find::SONAME),
                ),
                find::Candidate::Python(p) => (
                    p.display().to_string(),
                    format!("{} (Python package nvidia-nccl)", p.display()),
                ),
            };
            match Nccl::load_from(&name) {
                Ok(n) => return Ok(n),
                Err(e) => tried.push(format!("  {what}: {e}")),
            }
        }
        let hint = if explicit.is_some() {
            ""
        } else {
            "\n(no Python package nvidia/nccl/lib/libnccl.so.2 was found either; pass the library: --vs-nccl /path/to/libnccl.so.2)"
        };
        Err(format!("cannot load NCCL:\n{}{hint}", tried.join("\n")))
    }

    /// Loads the library at `name` (a path, or a soname for the loader to find) and checks
    /// its version and symbols.
    pub fn load_from(name: &str) -> Result<Nccl, String> {
        if name.contains('/') && !Path::new(name).exists() {
            return Err("no such file".into());
        }
        let h = Handle::open(name)?;
        let ver_sym = h
            .sym("ncclGetVersion")
            .ok_or_else(|| "lacks the symbol ncclGetVersion: not an NCCL library".to_string())?;
        // SAFETY: ncclGetVersion(int*) per nccl.h.
        let get_version: GetVersionFn =
            unsafe { std::mem::transmute::<*mut c_void, GetVersionFn>(ver_sym) };
        let mut version: c_int = 0;
        let r = unsafe { get_version(&mut version) };
        if r != SUCCESS {
            return Err(format!("ncclGetVersion failed: {}", result_name(r)));
        }
        if version < MIN_VERSION {
            return Err(format!(
                "NCCL {} is too old: the comparison needs NCCL {} or newer",
                version_string(version),
                version_string(MIN_VERSION)
            ));
        }
        let missing: Vec<&str> = REQUIRED
            .iter()
            .copied()
            .filter(|s| h.sym(s).is_none())
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "NCCL {} lacks the symbol{} {}",
                version_string(version),
                if missing.len() > 1 { "s" } else { "" },
                missing.join(", ")
            ));
        }
        macro_rules! req {
            ($name:literal, $t:ty) => {
                // SAFETY: the symbol exists (checked above) and has the type nccl.h declares,
                // which `$t` spells out.
                unsafe { std::mem::transmute::<*mut c_void, $t>(h.sym($name).expect("checked")) }
            };
        }
        macro_rules! opt {
            ($name:literal, $t:ty) => {
                // SAFETY: as above, where present.
                h.sym($name)
                    .map(|p| unsafe { std::mem::transmute::<*mut c_void, $t>(p) })
            };
        }
        let f = Fns {
            get_unique_id: req!("ncclGetUniqueId", GetUniqueIdFn),
            comm_init_rank: req!("ncclCommInitRank", CommInitRankFn),
            comm_init_all: req!("ncclCommInitAll", CommInitAllFn),
            comm_destroy: req!("ncclCommDestroy", CommFn),
            comm_get_async_error: req!("ncclCommGetAsyncError", CommGetAsyncErrorFn),
            get_error_string: req!("ncclGetErrorString", GetErrorStringFn),
            group_start: req!("ncclGroupStart", GroupFn),
            group_end: req!("ncclGroupEnd", GroupFn),
            all_reduce: req!("ncclAllReduce", AllReduceFn),
            all_gather: req!("ncclAllGather", AllGatherFn),
            reduce_scatter: req!("ncclReduceScatter", ReduceScatterFn),
            broadcast: req!("ncclBroadcast", BroadcastFn),
            reduce: req!("ncclReduce", ReduceFn),
            send: req!("ncclSend", SendFn),
            recv: req!("ncclRecv", RecvFn),
            all_to_all: opt!("ncclAlltoAll", AllGatherFn),
            gather: opt!("ncclGather", BroadcastFn),
            scatter: opt!("ncclScatter", BroadcastFn),
            comm_abort: opt!("ncclCommAbort", CommFn),
            get_last_error: opt!("ncclGetLastError", GetLastErrorFn),
            comm_register: opt!("ncclCommRegister", CommRegisterFn),
            comm_deregister: opt!("ncclCommDeregister", CommDeregisterFn),
            mem_alloc: opt!("ncclMemAlloc", MemAllocFn),
            mem_free: opt!("ncclMemFree", MemFreeFn),
            window_register: opt!("ncclCommWindowRegister", CommWindowRegisterFn),
            window_deregister: opt!("ncclCommWindowDeregister", CommWindowDeregisterFn),
        };
        let path = loaded_path(&h, "ncclGetVersion").unwrap_or_else(|| name.to_string());
        h.keep();
        Ok(Nccl { path, version, f })
    }

    /// The file the loader actually mapped.
    pub fn path(&self) -> &str {
        &self.path
    }
    pub fn version(&self) -> i32 {
        self.version
    }
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }
    /// Whether all-to-all, gather and scatter are NCCL collectives here (2.28+); otherwise the
    /// benchmark composes them from grouped sends and receives, as nccl-tests does.
    pub fn has_native_all_to_all(&self) -> bool {
        self.f.all_to_all.is_some()
    }
    pub fn has_window_register(&self) -> bool {
        self.f.window_register.is_some() && self.f.window_deregister.is_some()
    }
    pub fn has_local_register(&self) -> bool {
        self.f.comm_register.is_some() && self.f.comm_deregister.is_some()
    }
    pub fn has_mem_alloc(&self) -> bool {
        self.f.mem_alloc.is_some() && self.f.mem_free.is_some()
    }

    /// Turns a result into ferroccl's error, with NCCL's own text and, where a communicator
    /// is known, its last error message.
    fn check(&self, call: &str, r: NcclResult, comm: Option<RawComm>) -> Result<(), Error> {
        if r == SUCCESS {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string (or null from a broken library).
        let text = unsafe { (self.f.get_error_string)(r) };
        let text = if text.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        let last = match (comm, self.f.get_last_error) {
            (Some(c), Some(f)) => {
                let p = unsafe { f(c) };
                if p.is_null() {
                    String::new()
                } else {
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            }
            _ => String::new(),
        };
        let mut msg = format!("NCCL {call} failed: {} ({text})", result_name(r));
        if !last.is_empty() {
            msg += &format!(": {last}");
        }
        Err(match r {
            4 | 5 => Error::InvalidArgument(msg),
            6 => Error::Protocol(msg),
            _ => Error::System(msg),
        })
    }

    pub fn unique_id(&self) -> Result<UniqueId, Error> {
        let mut id = UniqueId::zeroed();
        self.check(
            "ncclGetUniqueId",
            unsafe { (self.f.get_unique_id)(&mut id) },
            None,
        )?;
        Ok(id)
    }

    /// Joins a communicator on the calling thread's current CUDA device (its current context).
    pub fn init_rank(&self, nranks: usize, id: &UniqueId, rank: usize) -> Result<NcclComm, Error> {
        let mut c: RawComm = std::ptr::null_mut();
        self.check(
            "ncclCommInitRank",
            unsafe { (self.f.comm_init_rank)(&mut c, nranks as c_int, *id, rank as c_int) },
            None,
        )?;
        Ok(NcclComm(c))
    }

    /// One communicator per device of this process, rank i on `devices[i]`.
    pub fn init_all(&self, devices: &[usize]) -> Result<Vec<NcclComm>, Error> {
        let devs: Vec<c_int> = devices.iter().map(|&d| d as c_int).collect();
        let mut comms: Vec<RawComm> = vec![std::ptr::null_mut(); devs.len()];
        self.check(
            "ncclCommInitAll",
            unsafe {
                (self.f.comm_init_all)(comms.as_mut_ptr(), devs.len() as c_int, devs.as_ptr())
            },
            None,
        )?;
        Ok(comms.into_iter().map(NcclComm).collect())
    }

    pub fn destroy(&self, c: NcclComm) -> Result<(), Error> {
        self.check(
            "ncclCommDestroy",
            unsafe { (self.f.comm_destroy)(c.0) },
            None,
        )
    }

    /// Stops a communicator whose peers may be gone (ncclCommAbort), else destroys it.
    pub fn abort(&self, c: NcclComm) -> Result<(), Error> {
        match self.f.comm_abort {
            Some(f) => self.check("ncclCommAbort", unsafe { f(c.0) }, None),
            None => self.destroy(c),
        }
    }

    /// An error NCCL recorded asynchronously (a kernel or proxy failure).
    pub fn async_error(&self, c: NcclComm) -> Result<(), Error> {
        let mut r = SUCCESS;
        self.check(
            "ncclCommGetAsyncError",
            unsafe { (self.f.comm_get_async_error)(c.0, &mut r) },
            Some(c.0),
        )?;
        if r == SUCCESS || r == IN_PROGRESS {
            return Ok(());
        }
        self.check("an earlier operation (asynchronous error)", r, Some(c.0))
    }

    pub fn group_start(&self) -> Result<(), Error> {
        self.check("ncclGroupStart", unsafe { (self.f.group_start)() }, None)
    }
    pub fn group_end(&self) -> Result<(), Error> {
        self.check("ncclGroupEnd", unsafe { (self.f.group_end)() }, None)
    }

    /// # Safety (for this and the calls below)
    /// The buffers must be device memory of the communicator's GPU, valid for the extents
    /// NCCL's documentation gives for the call, until the stream has run the operation.
    pub unsafe fn all_reduce(
        &self,
        s: *const c_void,
        r: *mut c_void,
        count: usize,
        dt: i32,
        op: i32,
        c: NcclComm,
        st: RawStream,
    ) -> Result<(), Error> {
        self.check(
            "ncclAllReduce",
            unsafe { (self.f.all_reduce)(s, r, count, dt, op, c.0, st) },
            Some(c.0),
        )
    }
    pub unsafe fn all_gather(
        &self,
        s: *const c_void,
        r: *mut c_void,
        count: usize,
        dt: i32,
        c: NcclComm,
        st: RawStream,
    ) -> Result<(), Error> {
        self.check(
            "ncclAllGather",
            unsafe { (self.f.all_gather)(s, r, count, dt, c.0, st) },
            Some(c.0),
        )
    }
    pub unsafe fn reduce_scatter(
        &self,
        s: *const c_void,
        r: *mut c_void,
        count: usize,
        dt: i32,
        op: i32,
        c: NcclComm,
        st: RawStream,
    ) -> Result<(), Error> {
        self.check(
            "ncclReduceScatter",
            unsafe { (self.f.reduce_scatter)(s, r, count, dt, op, c.0, st) },
            Some(c.0),
        )
    }
    pub unsafe fn broadcast(
        &self,
        s: *const c_void,
        r: *mut c_void,
        count: usize,
        dt: i32,
        root: usize,
        c: NcclComm,
        st: RawStream,
    ) -> Result<(), Error> {
        self.check(
            "ncclBroadcast",
            unsafe { (self.f.broadcast)(s, r, count, dt, root as c_int, c.0, st) },
            Some(c.0),
        )
    }
    pub unsafe fn reduce(
        &self,
        s: *const c_void,
        r: *mut c_void,
        count: usize,
        dt: i32,
        op: i32,
        root: usize,
        c: NcclComm,
        st: RawStream,
    ) -> Result<(), Error> {
        self.check(
            "ncclReduce",
            unsafe { (self.f.reduce)(s, r, count, dt, op, root as c_int, c.0, st) },
            Some(c.0),
        )
    }
    pub unsafe fn send(
        &self,
        s: *const c_void,
        count: usize,
        dt: i32,
        peer: usize,
        c: NcclComm,
        st: RawStream,
    ) -> Result<(), Error> {
        self.check(
            "ncclSend",
            unsafe { (self.f.send)(s, count, dt, peer as c_int, c.0, st) },
            Some(c.0),
        )
    }
    pub unsafe fn recv(
        &self,
        r: *mut c_void,
        count: usize,
        dt: i32,
        peer: usize,
        c: NcclComm,
        st: RawStream,
    ) -> Result<(), Error> {
        self.check(
            "ncclRecv",
            unsafe { (self.f.recv)(r, count, dt, peer as c_int, c.0, st) },
            Some(c.0),
        )
    }
    /// Returns false (and does nothing) when this NCCL has no ncclAlltoAll.
    pub unsafe fn all_to_all(
        &self,
        s: *const c_void,
        r: *mut c_void,
        count: usize,
        dt: i32,
        c: NcclComm,
        st: RawStream,
    ) -> Result<bool, Error> {
        let Some(f) = self.f.all_to_all else {
            return Ok(false);
        };
        self.check(
            "ncclAlltoAll",
            unsafe { f(s, r, count, dt, c.0, st) },
            Some(c.0),
        )
        .map(|()| true)
    }
    pub unsafe fn gather(
        &self,
        s: *const c_void,
        r: *mut c_void,
        count: usize,
        dt: i32,
        root: usize,
        c: NcclComm,
        st: RawStream,
    ) -> Result<bool, Error> {
        let Some(f) = self.f.gather else {
            return Ok(false);
        };
        self.check(
            "ncclGather",
            unsafe { f(s, r, count, dt, root as c_int, c.0, st) },
            Some(c.0),
        )
        .map(|()| true)
    }
    pub unsafe fn scatter(
        &self,
        s: *const c_void,
        r: *mut c_void,
        count: usize,
        dt: i32,
        root: usize,
        c: NcclComm,
        st: RawStream,
    ) -> Result<bool, Error> {
        let Some(f) = self.f.scatter else {
            return Ok(false);
        };
        self.check(
            "ncclScatter",
            unsafe { f(s, r, count, dt, root as c_int, c.0, st) },
            Some(c.0),
        )
        .map(|()| true)
    }

    /// Device memory from `ncclMemAlloc` (cuMem, suitable for registration), on the current
    /// device.
    pub fn mem_alloc(&self, bytes: usize) -> Result<*mut c_void, Error> {
        let f = self.f.mem_alloc.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "NCCL {} has no ncclMemAlloc",
                self.version_string()
            ))
        })?;
        let mut p = std::ptr::null_mut();
        self.check("ncclMemAlloc", unsafe { f(&mut p, bytes) }, None)?;
        Ok(p)
    }

    /// # Safety
    /// `p` came from `mem_alloc` and nothing uses it any more.
    pub unsafe fn mem_free(&self, p: *mut c_void) -> Result<(), Error> {
        let f = self
            .f
            .mem_free
            .ok_or_else(|| Error::Internal("ncclMemFree missing".into()))?;
        self.check("ncclMemFree", unsafe { f(p) }, None)
    }

    /// Registers a buffer: symmetrically (a window, collective over the ranks) when
    /// `symmetric`, else locally (ncclCommRegister).
    ///
    /// # Safety
    /// `p` is device memory of `bytes` bytes that outlives the registration.
    pub unsafe fn register(
        &self,
        c: NcclComm,
        p: *mut c_void,
        bytes: usize,
        symmetric: bool,
    ) -> Result<Registration, Error> {
        if symmetric {
            let f = self.f.window_register.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "NCCL {} has no ncclCommWindowRegister",
                    self.version_string()
                ))
            })?;
            let mut w: Box<RawWindow> = Box::new(std::ptr::null_mut());
            let slot: *mut RawWindow = &mut *w;
            self.check(
                "ncclCommWindowRegister",
                unsafe { f(c.0, p, bytes, slot, WIN_COLL_SYMMETRIC) },
                Some(c.0),
            )?;
            Ok(Registration::Window(w))
        } else {
            let f = self.f.comm_register.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "NCCL {} has no ncclCommRegister",
                    self.version_string()
                ))
            })?;
            let mut h = std::ptr::null_mut();
            self.check(
                "ncclCommRegister",
                unsafe { f(c.0, p, bytes, &mut h) },
                Some(c.0),
            )?;
            Ok(Registration::Local(h))
        }
    }

    /// Deregisters what `register` registered (a window only once its group has ended).
    pub fn deregister(&self, c: NcclComm, r: &Registration) -> Result<(), Error> {
        match r {
            Registration::Local(h) => match self.f.comm_deregister {
                Some(f) => self.check("ncclCommDeregister", unsafe { f(c.0, *h) }, Some(c.0)),
                None => Ok(()),
            },
            Registration::Window(w) if w.is_null() => Err(Error::Internal(
                "ncclCommWindowRegister gave no window".into(),
            )),
            Registration::Window(w) => match self.f.window_deregister {
                Some(f) => self.check(
                    "ncclCommWindowDeregister",
                    unsafe { f(c.0, **w) },
                    Some(c.0),
                ),
                None => Ok(()),
            },
        }
    }
}

/// The file that holds `sym`, as the loader mapped it (dladdr), so records name the real
/// library rather than a soname.
fn loaded_path(h: &Handle, sym: &str) -> Option<String> {
    let p = h.sym(sym)?;
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: p is an address inside a loaded object; info is writable.
    if unsafe { libc::dladdr(p, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    let s = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    Some(
        std::fs::canonicalize(&s)
            .map(|p| p.display().to_string())
            .unwrap_or(s),
    )
}

#[cfg(test)]
mod tests;
