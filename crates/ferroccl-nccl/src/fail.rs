//! Failures as the C API reports them: a result code, and a text `ncclGetLastError` returns.
//! Every entry point runs inside [`guard`], which also turns a panic into `ncclInternalError`
//! (a panic must never unwind into C).

use crate::abi::{self, NcclResult};
use ferroccl_core::Error;
use std::cell::UnsafeCell;
use std::ffi::c_char;
use std::sync::Mutex;

/// A failed call: NCCL's code and what to tell the user.
#[derive(Debug, Clone)]
pub struct Fail {
    pub code: NcclResult,
    pub msg: String,
}

impl Fail {
    pub fn arg(msg: impl Into<String>) -> Fail {
        Fail { code: abi::INVALID_ARGUMENT, msg: msg.into() }
    }
    pub fn usage(msg: impl Into<String>) -> Fail {
        Fail { code: abi::INVALID_USAGE, msg: msg.into() }
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail { code: e.nccl_result(), msg: e.to_string() }
    }
}

pub type Res<T = ()> = Result<T, Fail>;

/// The last error's text, NUL-terminated. NCCL keeps one per process and hands out a pointer
/// to it; so do we, into a fixed buffer that a later error overwrites in place (a pointer a
/// caller holds never dangles).
struct LastError(UnsafeCell<[u8; LAST_ERROR_BYTES]>);
// SAFETY: writes happen under WRITE; readers get a pointer, as NCCL's API defines.
unsafe impl Sync for LastError {}
const LAST_ERROR_BYTES: usize = 2048;
static LAST: LastError = LastError(UnsafeCell::new([0; LAST_ERROR_BYTES]));
static WRITE: Mutex<()> = Mutex::new(());

pub fn set_last_error(msg: &str) {
    let _g = WRITE.lock().unwrap_or_else(|p| p.into_inner());
    // Cut at a character boundary, leaving room for the NUL.
    let mut n = msg.len().min(LAST_ERROR_BYTES - 1);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: the buffer is written only under WRITE.
    let buf = unsafe { &mut *LAST.0.get() };
    buf[..n].copy_from_slice(&msg.as_bytes()[..n]);
    buf[n] = 0;
}

pub fn last_error_ptr() -> *const c_char {
    LAST.0.get() as *const c_char
}

/// Runs one entry point: its result as a code, its failure recorded (and logged at
/// NCCL_DEBUG=WARN), a panic caught.
pub fn guard(name: &str, f: impl FnOnce() -> Res) -> NcclResult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => abi::SUCCESS,
        Ok(Err(fail)) => {
            let msg = format!("{name}: {}", fail.msg);
            tracing::warn!("{msg}");
            set_last_error(&msg);
            fail.code
        }
        Err(p) => {
            let what = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
            let msg = format!("{name}: internal error (a panic in ferroccl, please report it): {what}");
            set_last_error(&msg);
            abi::INTERNAL_ERROR
        }
    }
}

/// NCCL's texts for its codes.
pub fn error_string(r: NcclResult) -> &'static std::ffi::CStr {
    match r {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the ferroccl developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        _ => c"unknown result code",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_and_failures_become_codes_and_texts() {
        assert_eq!(guard("ncclX", || Ok(())), abi::SUCCESS);
        assert_eq!(guard("ncclX", || Err(Fail::arg("count too large"))), abi::INVALID_ARGUMENT);
        let text = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }.to_str().unwrap().to_string();
        assert_eq!(text, "ncclX: count too large");
        assert_eq!(guard("ncclY", || panic!("boom")), abi::INTERNAL_ERROR);
        let text = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }.to_str().unwrap().to_string();
        assert!(text.contains("ncclY") && text.contains("boom"), "{text}");
        // A long text is cut at a character boundary, NUL-terminated.
        set_last_error(&"é".repeat(LAST_ERROR_BYTES));
        let text = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }.to_str().unwrap().to_string();
        assert!(text.len() < LAST_ERROR_BYTES && text.chars().all(|c| c == 'é'));
        assert_eq!(Fail::from(Error::Remote("x".into())).code, abi::REMOTE_ERROR);
    }
}
