//! The drop-in library on GPUs, driven as a CUDA program drives NCCL: plain `cuMemAlloc`
//! buffers (what PyTorch's caching allocator hands out without expandable segments, not cuMem),
//! the program's own streams, `ncclCommInitAll` over every GPU from one thread, then a group
//! of all-reduces with each communicator's two operations on two different streams. Every
//! element checked. On a one-GPU machine two ranks share the GPU (NCCL refuses a device list
//! with repeats; ferroccl takes it). FERROCCL_GPU_TEST=1 cargo test -p ferroccl-nccl --test
//! gpu_c_api -- --ignored

mod common;

use common::Lib;
use cudarc::driver::sys;
use ferroccl_core::nccl_abi::{self as abi, RawComm, RawStream};
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

fn ok(call: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call}");
}

#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl-nccl --test gpu_c_api -- --ignored"]
fn plain_cuda_buffers_and_two_streams_per_communicator() {
    if std::env::var("FERROCCL_GPU_TEST").ok().as_deref() != Some("1") {
        eprintln!("skipped: set FERROCCL_GPU_TEST=1 on a machine with GPUs");
        return;
    }
    std::env::remove_var("FERROCCL_NCCL_BACKEND");
    let gpus = ferroccl::cuda::gpu_count().expect("CUDA driver");
    assert!(gpus >= 1, "no GPU");
    // One rank per GPU; two on GPU 0 where there is only one.
    let devs: Vec<c_int> = if gpus >= 2 {
        (0..gpus as c_int).collect()
    } else {
        vec![0, 0]
    };
    let n = devs.len();
    let lib = Lib::dlopen();
    let init_all: abi::CommInitAllFn = lib.sym("ncclCommInitAll");
    let start: abi::GroupFn = lib.sym("ncclGroupStart");
    let end: abi::GroupFn = lib.sym("ncclGroupEnd");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let destroy: abi::CommFn = lib.sym("ncclCommDestroy");
    let count = (1 << 20) + 7; // odd, beyond the direct engine
    let small = 1000; // on the direct engine
    let mut ctxs = Vec::new();
    // Per GPU: (send, recv, send2, recv2, stream a, stream b).
    let mut bufs = Vec::new();
    unsafe {
        ok("cuInit", sys::cuInit(0));
        for d in 0..n {
            let mut dev = 0;
            ok("cuDeviceGet", sys::cuDeviceGet(&mut dev, devs[d]));
            let mut ctx = null_mut();
            ok(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            );
            ok("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
            let alloc = |elems: usize, fill: Option<f32>| {
                let mut p: sys::CUdeviceptr = 0;
                ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut p, elems * 4));
                if let Some(base) = fill {
                    let host: Vec<f32> = (0..elems).map(|i| base + (i % 997) as f32).collect();
                    ok(
                        "cuMemcpyHtoD",
                        sys::cuMemcpyHtoD_v2(p, host.as_ptr() as *const c_void, elems * 4),
                    );
                }
                p
            };
            let (s1, r1, s2, r2) = (
                alloc(count, Some(d as f32)),
                alloc(count, None),
                alloc(small, Some(10.0 * d as f32)),
                alloc(small, None),
            );
            let (mut a, mut b): (sys::CUstream, sys::CUstream) = (null_mut(), null_mut());
            ok("cuStreamCreate", sys::cuStreamCreate(&mut a, 1));
            ok("cuStreamCreate", sys::cuStreamCreate(&mut b, 1));
            ctxs.push(ctx);
            bufs.push((s1, r1, s2, r2, a, b));
        }
        let mut comms: Vec<RawComm> = vec![null_mut(); n];
        assert_eq!(
            init_all(comms.as_mut_ptr(), n as c_int, devs.as_ptr()),
            abi::SUCCESS,
            "{}",
            lib.last_error()
        );
        for round in 0..3 {
            assert_eq!(start(), abi::SUCCESS);
            for (d, c) in comms.iter().enumerate() {
                let (s1, r1, s2, r2, a, b) = bufs[d];
                ok("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctxs[d]));
                assert_eq!(
                    all_reduce(
                        s1 as *const c_void,
                        r1 as *mut c_void,
                        count,
                        7,
                        0,
                        *c,
                        a as RawStream
                    ),
                    abi::SUCCESS
                );
                assert_eq!(
                    all_reduce(
                        s2 as *const c_void,
                        r2 as *mut c_void,
                        small,
                        7,
                        0,
                        *c,
                        b as RawStream
                    ),
                    abi::SUCCESS
                );
            }
            assert_eq!(end(), abi::SUCCESS, "round {round}: {}", lib.last_error());
            for (d, &(_, r1, _, r2, a, b)) in bufs.iter().enumerate() {
                ok("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctxs[d]));
                // Waiting on stream b alone must see both results: the group ordered them.
                ok("cuStreamSynchronize", sys::cuStreamSynchronize(b));
                let mut out = vec![0f32; count];
                ok(
                    "cuMemcpyDtoH",
                    sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, r1, count * 4),
                );
                let wrong = out
                    .iter()
                    .enumerate()
                    .filter(|&(i, &x)| x != (n * (n - 1) / 2) as f32 + (n * (i % 997)) as f32)
                    .count();
                assert_eq!(wrong, 0, "GPU {d} round {round}: large all-reduce");
                let mut out = vec![0f32; small];
                ok(
                    "cuMemcpyDtoH",
                    sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, r2, small * 4),
                );
                let want = |i: usize| {
                    (0..n)
                        .map(|q| 10.0 * q as f32 + (i % 997) as f32)
                        .sum::<f32>()
                };
                assert!(
                    out.iter().enumerate().all(|(i, &x)| x == want(i)),
                    "GPU {d} round {round}: small all-reduce"
                );
                ok("cuStreamSynchronize", sys::cuStreamSynchronize(a));
            }
        }
        for c in comms {
            assert_eq!(destroy(c), abi::SUCCESS);
        }
    }
}
