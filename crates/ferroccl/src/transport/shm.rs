//! FIFOs in POSIX shared memory, for ranks that are separate processes on one host.
//!
//! The receiver creates the segment and the sender attaches to it. The sender removes the
//! name as soon as it has the mapping, so that a job killed later leaves nothing in /dev/shm:
//! the memory itself lives on until both mappings are gone.

use super::fifo::{Backing, FifoLayout, FifoMem, Header, READY_MAGIC};
use crate::Error;
use std::ffi::CString;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest nap between attempts to attach; also bounds how late an abort is noticed.
const OPEN_POLL_MAX: Duration = Duration::from_millis(10);

fn c_name(name: &str) -> Result<CString, Error> {
    let full = if name.starts_with('/') {
        name.to_string()
    } else {
        format!("/{name}")
    };
    // One leading slash and nothing else is portable; NAME_MAX is 255 on Linux.
    if full.len() < 2 || full.len() > 255 || full[1..].contains('/') {
        return Err(Error::InvalidArgument(format!(
            "shared-memory name '{name}' must be 1..=254 characters without '/' (except a leading one)"
        )));
    }
    CString::new(full).map_err(|_| {
        Error::InvalidArgument(format!("shared-memory name '{name}' contains a NUL byte"))
    })
}

/// Turns an errno from shm_open/ftruncate/mmap into an error that says what to do about it.
fn sys_error(what: &str, name: &str, err: io::Error) -> Error {
    let hint = match err.raw_os_error() {
        Some(libc::EMFILE) => " (this process has too many open files: raise `ulimit -n`)",
        Some(libc::ENFILE) => " (the system has too many open files: raise fs.file-max or close files)",
        Some(libc::ENOSPC) => {
            " (/dev/shm is full: remove stale segments there or enlarge it, e.g. `docker run --shm-size=...` \
             or `mount -o remount,size=... /dev/shm`; each connection takes FERROCCL_SLOTS x FERROCCL_SLOT_BYTES, \
             and each peer FERROCCL_CHANNELS connections, so lowering those shrinks it; FERROCCL_TRANSPORT=tcp uses none)"
        }
        Some(libc::EFBIG) => {
            " (larger than this process may create files: raise `ulimit -f`, or lower FERROCCL_SLOTS x FERROCCL_SLOT_BYTES)"
        }
        Some(libc::ENOMEM) => " (out of memory or mapping limit reached: check vm.max_map_count and memory limits)",
        Some(libc::EACCES) => " (permission denied on /dev/shm: are all ranks run by the same user?)",
        Some(libc::EEXIST) => {
            " (a segment with this name exists: a stale one from a crashed job can be removed from /dev/shm)"
        }
        _ => "",
    };
    Error::System(format!(
        "{what} of shared-memory segment {name} failed: {err}{hint}"
    ))
}

struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

fn map(fd: &Fd, len: usize, name: &str) -> Result<NonNull<u8>, Error> {
    // SAFETY: a fresh shared mapping of a descriptor we own; the kernel picks the address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.0,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(sys_error("mmap", name, io::Error::last_os_error()));
    }
    Ok(NonNull::new(p as *mut u8).expect("mmap does not return NULL on success"))
}

impl FifoMem {
    /// Receiver side: creates and initialises the segment, then marks it ready.
    pub fn shm_create(name: &str, layout: FifoLayout) -> Result<Arc<FifoMem>, Error> {
        layout.validate()?;
        let cname = c_name(name)?;
        let len = layout.total_bytes();
        // Errors name the size too: it is what a full /dev/shm could not hold.
        let what = format!("{name} ({len} bytes)");
        // SAFETY: plain syscall with a valid C string.
        let raw = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if raw < 0 {
            return Err(sys_error("creation", &what, io::Error::last_os_error()));
        }
        let fd = Fd(raw);
        let fail = |e: Error| {
            FifoMem::shm_unlink(name);
            e
        };
        // SAFETY: valid descriptor.
        if unsafe { libc::ftruncate(fd.0, len as libc::off_t) } != 0 {
            return Err(fail(sys_error("sizing", &what, io::Error::last_os_error())));
        }
        // tmpfs allocates pages lazily, so a full /dev/shm would otherwise surface as SIGBUS
        // on first touch of a slot; reserving now turns it into an error here.
        // SAFETY: valid descriptor; returns an errno value instead of setting errno.
        let r = unsafe { libc::posix_fallocate(fd.0, 0, len as libc::off_t) };
        if r != 0 && r != libc::EOPNOTSUPP && r != libc::EINVAL {
            return Err(fail(sys_error(
                "reserving space",
                &what,
                io::Error::from_raw_os_error(r),
            )));
        }
        let base = map(&fd, len, &what).map_err(fail)?;
        // SAFETY: `len` bytes, page-aligned, released by munmap in FifoMem::drop.
        let mem = unsafe { FifoMem::from_raw(base, len, layout, Backing::Shm) };
        mem.init_header();
        Ok(Arc::new(mem))
    }

    #[cfg(test)]
    /// Sender side: attaches to the receiver's segment once it is ready, then removes its name.
    pub fn shm_open(
        name: &str,
        layout: FifoLayout,
        deadline: Instant,
        abort: &std::sync::atomic::AtomicBool,
    ) -> Result<Arc<FifoMem>, Error> {
        let stop = || {
            abort
                .load(Ordering::Acquire)
                .then(|| Error::Aborted(format!("while waiting for shared-memory segment {name}")))
        };
        FifoMem::shm_open_until(name, layout, deadline, &stop)
    }

    /// `shm_open` that gives up as soon as `stop` returns an error (abort, a dead peer).
    pub fn shm_open_until(
        name: &str,
        layout: FifoLayout,
        deadline: Instant,
        stop: &dyn Fn() -> Option<Error>,
    ) -> Result<Arc<FifoMem>, Error> {
        layout.validate()?;
        let cname = c_name(name)?;
        let want = layout.total_bytes();
        let mut nap = Duration::from_micros(200);
        let mut last_state = "does not exist yet";
        loop {
            if let Some(e) = stop() {
                return Err(e);
            }
            if let Some(mem) = try_attach(&cname, name, layout, want, &mut last_state)? {
                FifoMem::shm_unlink(name);
                return Ok(mem);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(format!(
                    "shared-memory segment {name} {last_state}: the receiving rank did not create it in time"
                )));
            }
            std::thread::sleep(nap.min(deadline - now));
            nap = (nap * 2).min(OPEN_POLL_MAX);
        }
    }

    /// Removes the name if still present; a missing name is fine.
    pub fn shm_unlink(name: &str) {
        if let Ok(c) = c_name(name) {
            // SAFETY: plain syscall with a valid C string.
            if unsafe { libc::shm_unlink(c.as_ptr()) } != 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ENOENT) {
                    tracing::warn!("shm_unlink({name}): {e}");
                }
            }
        }
    }
}

/// One attempt: Ok(None) means "not there or not ready yet, try again".
fn try_attach(
    cname: &CString,
    name: &str,
    layout: FifoLayout,
    want: usize,
    state: &mut &'static str,
) -> Result<Option<Arc<FifoMem>>, Error> {
    // SAFETY: plain syscall with a valid C string.
    let raw = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
    if raw < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOENT) {
            return Ok(None);
        }
        return Err(sys_error("opening", name, e));
    }
    let fd = Fd(raw);
    // SAFETY: fstat fills the zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
        return Err(sys_error("fstat", name, io::Error::last_os_error()));
    }
    let size = st.st_size as usize;
    if size == 0 {
        // Created but not sized yet: the creator is between shm_open and ftruncate.
        *state = "exists but is not initialised yet";
        return Ok(None);
    }
    if size < std::mem::size_of::<Header>() {
        return Err(Error::Protocol(format!(
            "shared-memory segment {name} is {size} bytes, too small to be a ferroccl FIFO"
        )));
    }
    let base = map(&fd, size, name)?;
    // SAFETY: `size` bytes mapped just now; unmapped by drop if we return early.
    let mem = unsafe { FifoMem::from_raw(base, size, layout, Backing::Shm) };
    let meta = &mem.header().meta;
    let magic = meta.magic.load(Ordering::Acquire);
    if magic == 0 {
        *state = "exists but is not initialised yet";
        return Ok(None);
    }
    if magic != READY_MAGIC {
        return Err(Error::Protocol(format!(
            "shared-memory segment {name} is not a FIFO of this ferroccl version (magic {magic:#x}, expected {READY_MAGIC:#x})"
        )));
    }
    let (slots, slot_bytes) = (
        meta.slots.load(Ordering::Relaxed),
        meta.slot_bytes.load(Ordering::Relaxed),
    );
    if slots != layout.slots || slot_bytes != layout.slot_bytes as u64 || size != want {
        return Err(Error::Protocol(format!(
            "shared-memory segment {name} has {slots} slots x {slot_bytes} bytes ({size} bytes) but this rank expects \
             {} x {} ({want} bytes): ranks disagree on FERROCCL_SLOTS / FERROCCL_SLOT_BYTES",
            layout.slots, layout.slot_bytes
        )));
    }
    debug_assert_eq!(mem.mapped_len(), want);
    Ok(Some(Arc::new(mem)))
}
