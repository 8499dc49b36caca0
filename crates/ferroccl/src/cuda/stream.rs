//! Ordering between CUDA streams of one GPU, with events: what NCCL does for a group whose
//! operations on one communicator name several streams (the launch stream waits for the others
//! before the operations, and the others wait for it after them). Works inside CUDA-graph
//! capture too, where an event record and wait become the graph's fork and join.

use super::cu_ok;
use super::device::Gpu;
use cudarc::driver::sys;
use ferroccl_core::Result;

/// Makes `waiter` wait for everything queued on `on` so far (a fresh event, recorded on `on`,
/// waited on by `waiter`, then released: the driver keeps it until the wait is done).
///
/// # Safety
/// Both must be live streams of `gpu`'s context.
pub unsafe fn order_after(gpu: &Gpu, waiter: sys::CUstream, on: sys::CUstream) -> Result<()> {
    if waiter == on {
        return Ok(());
    }
    gpu.bind()?;
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: an out pointer for a new event of the current context.
    cu_ok("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    })?;
    // SAFETY: the event is ours and the streams live (the caller's contract).
    let r = cu_ok("cuEventRecord", unsafe { sys::cuEventRecord(ev, on) }).and_then(|()| {
        cu_ok("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(waiter, ev, 0)
        })
    });
    // SAFETY: destroying a recorded event is allowed; its resources go once the wait is done.
    unsafe { sys::cuEventDestroy_v2(ev) };
    r
}
