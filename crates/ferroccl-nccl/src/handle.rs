//! Communicator handles. An `ncclComm_t` is the address of a [`Handle`] that the registry
//! holds; every call looks it up there first, so a null, destroyed or made-up handle is an
//! `ncclInvalidArgument` naming it instead of a crash, and a handle destroyed by one thread
//! while another still uses it stays alive until that use ends.

use crate::abi::{self, RawComm};
use crate::fail::{Fail, Res};
use ferroccl::{Comm, ReduceOp};
use ferroccl_core::numeric::element::load_f64;
use ferroccl_core::DataType;
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// A reduction made by `ncclRedOpCreatePreMulSum`, valid on its communicator only.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PreMul {
    /// The scalar, read when the handle was made.
    Host(f64),
    /// The device address of the scalar, read by the GPU when the operation runs.
    Device { ptr: u64, dtype: DataType },
}

/// One communicator of the C API.
pub struct Handle {
    /// Set once initialisation is done: inside a group that is at `ncclGroupEnd`.
    comm: OnceLock<Comm>,
    /// Why deferred initialisation failed, for the calls that use the handle afterwards.
    init_failed: Mutex<Option<Fail>>,
    /// Reduction handles: ncclNumOps + index, None once destroyed.
    redops: Mutex<Vec<Option<PreMul>>>,
    /// Raised by ncclCommAbort while the creation is still running (non-blocking, or in a
    /// group): the creation then ends at once instead of at its deadline.
    init_abort: Arc<AtomicBool>,
}

impl Handle {
    pub fn pending() -> Handle {
        Handle {
            comm: OnceLock::new(),
            init_failed: Mutex::new(None),
            redops: Mutex::new(Vec::new()),
            init_abort: Arc::new(AtomicBool::new(false)),
        }
    }

    pub fn ready(comm: Comm) -> Handle {
        let h = Handle::pending();
        let _ = h.comm.set(comm);
        h
    }

    /// The communicator, or why there is none yet.
    pub fn comm(&self) -> Res<&Comm> {
        if let Some(c) = self.comm.get() {
            return Ok(c);
        }
        match &*self.init_failed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(f) => Err(Fail { code: f.code, msg: format!("its initialisation failed: {}", f.msg) }),
            None => Err(Fail::usage(
                "the communicator is still being initialised: a non-blocking one until ncclCommGetAsyncError says ncclSuccess, \
                 one created inside a group until ncclGroupEnd",
            )),
        }
    }

    /// The flag a creation for this handle watches (see `init_abort`).
    pub fn init_abort(&self) -> Arc<AtomicBool> {
        self.init_abort.clone()
    }

    /// Aborts the communicator, or its creation if that is still running.
    pub fn abort(&self) {
        self.init_abort.store(true, Ordering::Release);
        if let Some(c) = self.comm.get() {
            c.abort();
        }
    }

    pub fn complete(&self, r: Result<Option<Comm>, Fail>) {
        match r {
            Ok(Some(c)) => {
                let _ = self.comm.set(c);
            }
            Ok(None) => {}
            Err(f) => *self.init_failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(f),
        }
    }

    /// ferroccl's reduction for NCCL's `op` on this communicator, and the device scalar's
    /// address if it has one.
    pub fn redop(&self, op: c_int, dtype: DataType) -> Res<(ReduceOp, Option<u64>)> {
        if (0..abi::NUM_BUILTIN_OPS).contains(&op) {
            return Ok((ReduceOp::from_nccl_id(op).map_err(Fail::from)?, None));
        }
        let i = op
            .checked_sub(abi::NUM_BUILTIN_OPS)
            .filter(|i| *i >= 0)
            .map(|i| i as usize);
        let list = self.redops.lock().unwrap_or_else(|p| p.into_inner());
        match i.and_then(|i| list.get(i).copied()) {
            Some(Some(PreMul::Host(v))) => Ok((ReduceOp::PreMulSum(v), None)),
            Some(Some(PreMul::Device { ptr, dtype: made_for })) => {
                if made_for != dtype {
                    return Err(Fail::arg(format!("reduction {op} was made for {made_for}, not {dtype}")));
                }
                Ok((ReduceOp::PreMulSum(0.0), Some(ptr)))
            }
            Some(None) => Err(Fail::arg(format!("reduction {op} was destroyed (ncclRedOpDestroy)"))),
            None => Err(Fail::arg(format!(
                "reduction {op} is neither NCCL's (0 to 4) nor one that ncclRedOpCreatePreMulSum made on this communicator"
            ))),
        }
    }

    /// `ncclRedOpCreatePreMulSum`: `scalar` is one element of `dtype`, host memory when
    /// `residence` is host-immediate, device memory otherwise.
    ///
    /// # Safety
    /// With host residence `scalar` must point to one readable element of `dtype`.
    pub unsafe fn create_premul(
        &self,
        scalar: *const u8,
        dtype: DataType,
        residence: c_int,
    ) -> Res<c_int> {
        if scalar.is_null() {
            return Err(Fail::arg("the scalar pointer is null"));
        }
        let def = match residence {
            abi::SCALAR_HOST_IMMEDIATE => {
                // SAFETY: the caller's contract: one element of dtype.
                let bytes = unsafe { std::slice::from_raw_parts(scalar, dtype.size()) };
                PreMul::Host(load_f64(dtype, bytes, 0))
            }
            abi::SCALAR_DEVICE => {
                if self.comm()?.gpu().is_none() {
                    return Err(Fail::arg("a device-resident scalar needs a GPU communicator; this one runs on the host (use ncclScalarHostImmediate)"));
                }
                PreMul::Device {
                    ptr: scalar as u64,
                    dtype,
                }
            }
            r => {
                return Err(Fail::arg(format!(
                    "residence {r} is neither ncclScalarDevice (0) nor ncclScalarHostImmediate (1)"
                )))
            }
        };
        let mut list = self.redops.lock().unwrap_or_else(|p| p.into_inner());
        let i = match list.iter().position(Option::is_none) {
            Some(free) => {
                list[free] = Some(def);
                free
            }
            None => {
                list.push(Some(def));
                list.len() - 1
            }
        };
        c_int::try_from(i)
            .ok()
            .and_then(|i| i.checked_add(abi::NUM_BUILTIN_OPS))
            .ok_or_else(|| Fail::usage("too many reduction handles"))
    }

    pub fn destroy_premul(&self, op: c_int) -> Res {
        if (0..abi::NUM_BUILTIN_OPS).contains(&op) {
            return Err(Fail::arg(format!(
                "reduction {op} is one of NCCL's own and cannot be destroyed"
            )));
        }
        let mut list = self.redops.lock().unwrap_or_else(|p| p.into_inner());
        match op
            .checked_sub(abi::NUM_BUILTIN_OPS)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| list.get_mut(i))
        {
            Some(slot @ Some(_)) => {
                *slot = None;
                Ok(())
            }
            _ => Err(Fail::arg(format!(
                "reduction {op} is not a live handle of this communicator"
            ))),
        }
    }
}

fn registry() -> &'static Mutex<HashMap<usize, Arc<Handle>>> {
    static R: OnceLock<Mutex<HashMap<usize, Arc<Handle>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Makes `h` a handle the API accepts; returns what the caller gets.
pub fn register(h: Handle) -> (RawComm, Arc<Handle>) {
    let h = Arc::new(h);
    let raw = Arc::as_ptr(&h) as RawComm;
    registry()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(raw as usize, h.clone());
    (raw, h)
}

pub fn lookup(raw: RawComm) -> Res<Arc<Handle>> {
    if raw.is_null() {
        return Err(Fail::arg("the communicator is null"));
    }
    registry()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(raw as usize))
        .cloned()
        .ok_or_else(|| Fail::arg(format!("{raw:p} is not a communicator (destroyed, aborted, or never made by ncclCommInit*)")))
}

/// Forgets `raw`: later calls with it fail. The communicator goes when the last call still
/// using it returns.
pub fn unregister(raw: RawComm) -> Res<Arc<Handle>> {
    lookup(raw)?;
    registry()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&(raw as usize))
        .ok_or_else(|| Fail::arg(format!("{raw:p} was destroyed meanwhile")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_checked_and_premul_handles_live_on_their_communicator() {
        assert_eq!(
            lookup(std::ptr::null_mut()).err().unwrap().code,
            abi::INVALID_ARGUMENT
        );
        assert!(lookup(0x1234 as RawComm)
            .err()
            .unwrap()
            .msg
            .contains("not a communicator"));
        let (raw, h) = register(Handle::pending());
        assert!(Arc::ptr_eq(&lookup(raw).unwrap(), &h));
        assert_eq!(
            h.comm().err().unwrap().code,
            abi::INVALID_USAGE,
            "pending until its group ends"
        );
        // Host scalars are read at once, in the element type.
        let two = 2.0f32.to_le_bytes();
        let op =
            unsafe { h.create_premul(two.as_ptr(), DataType::Float32, abi::SCALAR_HOST_IMMEDIATE) }
                .unwrap();
        assert_eq!(op, abi::NUM_BUILTIN_OPS);
        assert_eq!(
            h.redop(op, DataType::Float32).unwrap(),
            (ReduceOp::PreMulSum(2.0), None)
        );
        assert_eq!(h.redop(2, DataType::Float32).unwrap().0, ReduceOp::Max);
        assert!(h.redop(op + 1, DataType::Float32).is_err());
        assert!(h.redop(-3, DataType::Float32).is_err());
        assert!(unsafe { h.create_premul(two.as_ptr(), DataType::Float32, 7) }.is_err());
        assert!(unsafe {
            h.create_premul(
                std::ptr::null(),
                DataType::Float32,
                abi::SCALAR_HOST_IMMEDIATE,
            )
        }
        .is_err());
        h.destroy_premul(op).unwrap();
        assert!(h
            .redop(op, DataType::Float32)
            .unwrap_err()
            .msg
            .contains("destroyed"));
        assert!(h.destroy_premul(op).is_err() && h.destroy_premul(0).is_err());
        unregister(raw).unwrap();
        assert!(lookup(raw).is_err());
        assert!(unregister(raw).is_err());
    }
}
