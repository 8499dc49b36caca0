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
        Fail {
            code: abi::INVALID_ARGUMENT,
            msg: msg.into(),
        }
    }
    pub fn usage(msg: impl Into<String>) -> Fail {
        Fail {
            code: abi::INVALID_USAGE,
            msg: msg.into(),
        }
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail {
            code: e.nccl_result(),
            msg: e.to_string(),
        }
    }
}

pub type Res<T = ()> = Result<T, Fail>;

/// The last error's text, NUL-terminated, kept twice: for the thread whose call failed, and
/// for the process. `ncclGetLastError` answers with the calling thread's own last failure
/// (so one thread per GPU never reads another's), else the process's latest (a watchdog
/// thread asking about a failure it did not cause itself). Both are fixed buffers a later
/// error overwrites in place, so a pointer a caller holds never dangles (the thread's
/// lives as long as its thread).
struct Text(UnsafeCell<[u8; LAST_ERROR_BYTES]>);
// SAFETY: the process's buffer is written only under WRITE; a thread's only by its thread.
// Readers get a pointer, as NCCL's API defines.
unsafe impl Sync for Text {}
const LAST_ERROR_BYTES: usize = 2048;
static PROCESS: Text = Text(UnsafeCell::new([0; LAST_ERROR_BYTES]));
static WRITE: Mutex<()> = Mutex::new(());
thread_local! {
    static THREAD: Box<Text> = Box::new(Text(UnsafeCell::new([0; LAST_ERROR_BYTES])));
}

/// Copies `msg` into `buf`, cut at a character boundary, leaving room for the NUL.
fn store(buf: &mut [u8; LAST_ERROR_BYTES], msg: &str) {
    let mut n = msg.len().min(LAST_ERROR_BYTES - 1);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    buf[..n].copy_from_slice(&msg.as_bytes()[..n]);
    buf[n] = 0;
}

pub fn set_last_error(msg: &str) {
    set_thread_error(msg);
    let _g = WRITE.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: the buffer is written only under WRITE.
    store(unsafe { &mut *PROCESS.0.get() }, msg);
}

/// Records `msg` as this thread's last error only.
pub fn set_thread_error(msg: &str) {
    // SAFETY: only this thread writes its buffer.
    THREAD.with(|t| store(unsafe { &mut *t.0.get() }, msg));
}

/// The text `ncclGetLastError` hands out: this thread's last failure, else the process's.
pub fn last_error_ptr() -> *const c_char {
    let own = THREAD.with(|t| {
        // SAFETY: only this thread writes its buffer, and it is not writing now.
        let first = unsafe { (*t.0.get())[0] };
        (first != 0).then(|| t.0.get() as *const c_char)
    });
    own.unwrap_or(PROCESS.0.get() as *const c_char)
}

/// Runs one entry point: its result as a code, its failure recorded (and logged at
/// NCCL_DEBUG=WARN), a panic caught.
pub fn guard(name: &str, f: impl FnOnce() -> Res) -> NcclResult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => abi::SUCCESS,
        // Not a failure: the work goes on in the background.
        Ok(Err(fail)) if fail.code == abi::IN_PROGRESS => fail.code,
        Ok(Err(fail)) => {
            let msg = format!("{name}: {}", fail.msg);
            tracing::warn!("{msg}");
            set_last_error(&msg);
            fail.code
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let msg =
                format!("{name}: internal error (a panic in ferroccl, please report it): {what}");
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

    /// The process's text is shared by the tests of this module under `cargo test`.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    #[test]
    fn panics_and_failures_become_codes_and_texts() {
        let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(guard("ncclX", || Ok(())), abi::SUCCESS);
        assert_eq!(
            guard("ncclX", || Err(Fail::arg("count too large"))),
            abi::INVALID_ARGUMENT
        );
        let text = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(text, "ncclX: count too large");
        assert_eq!(guard("ncclY", || panic!("boom")), abi::INTERNAL_ERROR);
        let text = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }
            .to_str()
            .unwrap()
            .to_string();
        assert!(text.contains("ncclY") && text.contains("boom"), "{text}");
        // A long text is cut at a character boundary, NUL-terminated.
        set_last_error(&"é".repeat(LAST_ERROR_BYTES));
        let text = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }
            .to_str()
            .unwrap()
            .to_string();
        assert!(text.len() < LAST_ERROR_BYTES && text.chars().all(|c| c == 'é'));
        assert_eq!(
            Fail::from(Error::Remote("x".into())).code,
            abi::REMOTE_ERROR
        );
    }

    fn text() -> String {
        unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn each_thread_reads_its_own_failure_and_others_the_latest() {
        let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (back, got) = std::sync::mpsc::channel::<String>();
        let a = std::thread::spawn(move || {
            guard("ncclA", || Err(Fail::arg("a's mistake")));
            back.send(text()).unwrap();
            rx.recv().unwrap();
            // B failed meanwhile: A still reads its own.
            back.send(text()).unwrap();
        });
        assert_eq!(got.recv().unwrap(), "ncclA: a's mistake");
        let b = std::thread::spawn(move || {
            // B never failed: it reads the process's latest (a watchdog's view).
            let before = text();
            guard("ncclB", || Err(Fail::usage("b's mistake")));
            (before, text())
        });
        let (before, after) = b.join().unwrap();
        assert_eq!(before, "ncclA: a's mistake");
        assert_eq!(after, "ncclB: b's mistake");
        tx.send(()).unwrap();
        assert_eq!(got.recv().unwrap(), "ncclA: a's mistake");
        a.join().unwrap();
    }
}
