//! An all-reduce of GPU memory, one rank per GPU of this host, driven by one thread, each
//! rank's operation enqueued on a CUDA stream of the program's own.
//!
//! cargo run --release -p ferroccl --example gpu_allreduce_stream
//!
//! Without a GPU (or a driver) it says so and exits 0. With GPUs it checks every element of
//! every rank's result and exits non-zero if one is wrong.

use cudarc::driver::sys;
use ferroccl::mem::MemStats;
use ferroccl::{Comm, Config, DataType, Device, Group, OpArgs, ReduceOp};
use std::process::ExitCode;

fn main() -> ExitCode {
    let gpus = ferroccl::cuda::gpu_count().unwrap_or(0);
    if gpus == 0 {
        println!("no GPU here: nothing to run (the host backend's examples are allreduce_threads and allreduce_processes)");
        return ExitCode::SUCCESS;
    }
    match run(gpus) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(wrong) => {
            eprintln!("{wrong} wrong elements");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn run(gpus: usize) -> Result<usize, Box<dyn std::error::Error>> {
    let devices: Vec<Device> = (0..gpus).map(Device::Cuda).collect();
    let comms = Comm::init_devices(&devices, &Config::from_env()?)?;
    let stats = MemStats::new();
    let count = 16 << 20; // f32 per rank: 64 MiB
    let mut ranks = Vec::new();
    for c in &comms {
        let gpu = c.gpu().expect("a GPU communicator");
        // Memory from cuMem, as every ferroccl GPU buffer (ncclMemAlloc's counterpart).
        let send = ferroccl::mem::alloc(gpu, count * 4, &stats)?;
        let recv = ferroccl::mem::alloc(gpu, count * 4, &stats)?;
        let host: Vec<f32> = (0..count).map(|i| (c.rank() + i % 1024) as f32).collect();
        send.copy_from_host(0, bytes_of(&host))?;
        // A stream of our own (the framework's, in a real program): the operation is ordered
        // after what was queued on it before and before what comes after.
        gpu.bind()?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: an out pointer for a new stream of the current context (this GPU's).
        let r = unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuStreamCreate: {r:?}").into());
        }
        // SAFETY: the stream lives until after the communicator is dropped (below).
        unsafe { c.set_stream(stream as *mut std::ffi::c_void) };
        ranks.push((send, recv, stream));
    }
    // One thread drives every GPU: one group, one kernel per GPU, all enqueued at once.
    let mut g = Group::new();
    for (c, (send, recv, _)) in comms.iter().zip(&ranks) {
        let args = OpArgs {
            kind: ferroccl::CollKind::AllReduce,
            send: send.device_ptr() as *const u8,
            recv: recv.device_ptr() as *mut u8,
            count,
            dtype: DataType::Float32,
            op: ReduceOp::Sum,
            root: 0,
            device_scalar: None,
        };
        // SAFETY: device buffers of `count` f32 on this rank's GPU, kept until after the
        // synchronize below.
        unsafe { g.push_raw(c, args)? };
    }
    g.launch()?; // returns once enqueued
    for c in &comms {
        c.synchronize()?; // waits for this rank's stream, and reports a failure the kernels saw
    }
    let n = gpus;
    let mut wrong = 0;
    for (_, recv, _) in &ranks {
        let mut out = vec![0f32; count];
        recv.copy_to_host(0, bytes_of_mut(&mut out))?;
        // sum over r of (r + i % 1024) = n(n-1)/2 + n (i % 1024)
        wrong += out
            .iter()
            .enumerate()
            .filter(|&(i, &x)| x != (n * (n - 1) / 2 + n * (i % 1024)) as f32)
            .count();
    }
    println!("all-reduce of {count} x f32 over {n} GPUs on the program's streams: {wrong} wrong elements");
    let streams: Vec<sys::CUstream> = ranks.iter().map(|r| r.2).collect();
    drop(comms);
    for s in streams {
        // SAFETY: the communicators that used it are gone.
        unsafe { sys::cuStreamDestroy_v2(s) };
    }
    Ok(wrong)
}

fn bytes_of(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; the byte view covers the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn bytes_of_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above; every byte pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}
