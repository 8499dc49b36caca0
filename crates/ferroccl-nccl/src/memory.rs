//! `ncclMemAlloc` / `ncclMemFree` and registrations. Memory from `ncclMemAlloc` is ferroccl's
//! cuMem allocation (POSIX fd handles, mapped for every GPU that can reach it), which windows
//! can use for zero-copy; on the host backend it is page-aligned host memory. Allocations are
//! kept here by address, so that `ncclMemFree` of an address we did not hand out is an error,
//! not a crash.

use crate::fail::{Fail, Res};
use ferroccl::mem::{DeviceBuffer, Gpu, MemStats};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

enum Allocation {
    Device(#[allow(dead_code)] DeviceBuffer),
    Host(#[allow(dead_code)] Vec<u64>),
}

// SAFETY: DeviceBuffer is only freed (dropped) here; the host vector is plain memory.
unsafe impl Send for Allocation {}

fn table() -> &'static Mutex<HashMap<usize, Allocation>> {
    static T: OnceLock<Mutex<HashMap<usize, Allocation>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

fn stats() -> &'static Arc<MemStats> {
    static S: OnceLock<Arc<MemStats>> = OnceLock::new();
    S.get_or_init(MemStats::new)
}

/// `bytes` on the GPU current on this thread (or host memory where there is none).
pub fn alloc(bytes: usize, on_gpu: Option<usize>) -> Res<*mut u8> {
    if bytes == 0 {
        return Err(Fail::arg("size 0"));
    }
    let (ptr, a) = match on_gpu {
        Some(d) => {
            let gpu = Gpu::open(d).map_err(Fail::from)?;
            let b = ferroccl::mem::alloc(&gpu, bytes, stats()).map_err(Fail::from)?;
            (b.device_ptr() as usize, Allocation::Device(b))
        }
        None => {
            // Words, so that every element type is aligned.
            let mut v = vec![0u64; bytes.div_ceil(8)];
            (v.as_mut_ptr() as usize, Allocation::Host(v))
        }
    };
    table()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(ptr, a);
    Ok(ptr as *mut u8)
}

pub fn free(ptr: *mut u8) -> Res {
    if ptr.is_null() {
        return Err(Fail::arg("the pointer is null"));
    }
    let a = table()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&(ptr as usize));
    match a {
        Some(a) => {
            drop(a);
            Ok(())
        }
        None => Err(Fail::arg(format!(
            "{ptr:p} was not returned by ncclMemAlloc (or was freed already)"
        ))),
    }
}

/// A registration handle (`ncclCommRegister`) or a window (`ncclCommWindowRegister`): what
/// the caller gets back, checked when it returns it.
#[derive(Debug)]
pub struct Registration {
    /// The communicator handle it was made on.
    pub comm: usize,
    pub ptr: u64,
    /// Which call made it (and so which call takes it back).
    pub kind: RegKind,
    /// ferroccl registered the memory (a GPU communicator's local registration or window),
    /// which deregistration undoes; host communicators keep the handle only.
    pub made: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegKind {
    /// `ncclCommRegister`.
    Buffer,
    /// `ncclCommWindowRegister`.
    Window,
}

fn registrations() -> &'static Mutex<HashMap<usize, Box<Registration>>> {
    static T: OnceLock<Mutex<HashMap<usize, Box<Registration>>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

pub fn remember(r: Registration) -> *mut std::ffi::c_void {
    let b = Box::new(r);
    let key = &*b as *const Registration as usize;
    registrations()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, b);
    key as *mut std::ffi::c_void
}

/// Takes back a handle of `kind` made on `comm`; anything else is refused and changes nothing.
pub fn forget(handle: *mut std::ffi::c_void, comm: usize, kind: RegKind) -> Res<Box<Registration>> {
    let mut t = registrations().lock().unwrap_or_else(|p| p.into_inner());
    match t.get(&(handle as usize)) {
        None => Err(Fail::arg(format!("{handle:p} is not a registration handle (deregistered already, or never returned by ncclCommRegister / ncclCommWindowRegister)"))),
        Some(r) if r.comm != comm => Err(Fail::arg(format!("{handle:p} was registered on another communicator"))),
        Some(r) if r.kind != kind => Err(Fail::arg(match r.kind {
            RegKind::Buffer => format!("{handle:p} came from ncclCommRegister: take it back with ncclCommDeregister"),
            RegKind::Window => format!("{handle:p} is a window from ncclCommWindowRegister: take it back with ncclCommWindowDeregister"),
        })),
        Some(_) => Ok(t.remove(&(handle as usize)).expect("present")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_allocations_are_tracked_and_registrations_checked() {
        let p = alloc(100, None).unwrap();
        assert_eq!(p as usize % 8, 0);
        // Writable for its whole size.
        unsafe { std::ptr::write_bytes(p, 7, 100) };
        free(p).unwrap();
        assert!(free(p)
            .unwrap_err()
            .msg
            .contains("not returned by ncclMemAlloc"));
        assert!(alloc(0, None).is_err());
        let h = remember(Registration {
            comm: 1,
            ptr: 0x1000,
            kind: RegKind::Buffer,
            made: false,
        });
        assert!(forget(h, 2, RegKind::Buffer)
            .unwrap_err()
            .msg
            .contains("another communicator"));
        assert!(forget(h, 1, RegKind::Window)
            .unwrap_err()
            .msg
            .contains("take it back with ncclCommDeregister"));
        assert_eq!(forget(h, 1, RegKind::Buffer).unwrap().ptr, 0x1000);
        assert!(forget(h, 1, RegKind::Buffer).is_err());
        let w = remember(Registration {
            comm: 1,
            ptr: 0x2000,
            kind: RegKind::Window,
            made: true,
        });
        assert!(forget(w, 1, RegKind::Buffer)
            .unwrap_err()
            .msg
            .contains("ncclCommWindowDeregister"));
        assert!(forget(w, 1, RegKind::Window).unwrap().made);
    }
}
