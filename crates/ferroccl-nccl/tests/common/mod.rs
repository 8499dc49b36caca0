//! The library under test, opened as a C program opens it.
#![allow(dead_code)]

use ferroccl_core::nccl_abi::{self as abi, UniqueId};
use std::ffi::{c_void, CStr, CString};
use std::path::PathBuf;

/// This build's libnccl.so (cargo builds the cdylib beside the integration tests).
pub fn library_path() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [
        deps.join("libnccl.so"),
        deps.parent().unwrap().join("libnccl.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .expect("libnccl.so next to the test binary (cargo builds the cdylib for integration tests)")
}

/// The library, dlopened.
pub struct Lib(pub *mut c_void);
unsafe impl Send for Lib {}
unsafe impl Sync for Lib {}

impl Lib {
    /// Opens it (once per process: dlopen returns the same handle after).
    pub fn dlopen() -> Lib {
        let path = library_path();
        let c = CString::new(path.to_str().unwrap()).unwrap();
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!h.is_null(), "dlopen {}", path.display());
        Lib(h)
    }

    /// An exported function, as `T` (a function pointer type).
    pub fn sym<T: Copy>(&self, name: &str) -> T {
        let c = CString::new(name).unwrap();
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        assert!(!p.is_null(), "{name} is not exported");
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
        unsafe { std::mem::transmute_copy(&p) }
    }

    /// `ncclGetLastError(NULL)`.
    pub fn last_error(&self) -> String {
        let f: abi::GetLastErrorFn = self.sym("ncclGetLastError");
        unsafe { CStr::from_ptr(f(std::ptr::null_mut())) }
            .to_string_lossy()
            .into_owned()
    }

    /// A fresh `ncclGetUniqueId`.
    pub fn unique_id(&self) -> UniqueId {
        let f: abi::GetUniqueIdFn = self.sym("ncclGetUniqueId");
        let mut id = UniqueId::zeroed();
        assert_eq!(unsafe { f(&mut id) }, abi::SUCCESS, "{}", self.last_error());
        id
    }
}
