//! GPU tests: ignored by default (CI has no GPU); on a GPU machine run them with
//! `FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored`. What they check: one thread driving every GPU with
//! one group (launches not serialised behind each other's completion), CUDA-graph capture of
//! operations, and a killed process making its peer's kernels fail by deadline, not hang.

mod common;

use common::launch::{role, spawn_ranks, wait_all};
use cudarc::driver::sys;
use ferroccl::cuda::{check, gpu_count};
use ferroccl::mem::{DeviceBuffer, MemStats};
use ferroccl::{CollKind, Comm, Config, Device, Error, Group, OpArgs, ReduceOp};
use std::time::{Duration, Instant};

fn gpus_for_test() -> Option<usize> {
    if std::env::var("FERROCCL_GPU_TEST").ok().as_deref() != Some("1") {
        eprintln!("skipped: set FERROCCL_GPU_TEST=1 on a machine with GPUs");
        return None;
    }
    let n = gpu_count().expect("CUDA driver");
    assert!(n >= 2, "GPU tests need at least 2 GPUs, found {n}");
    Some(n)
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; the slice is valid for its byte length.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn all_reduce_args(send: &DeviceBuffer, recv: &DeviceBuffer, count: usize) -> OpArgs {
    OpArgs {
        kind: CollKind::AllReduce,
        send: send.device_ptr() as *const u8,
        recv: recv.device_ptr() as *mut u8,
        count,
        dtype: ferroccl::DataType::Float32,
        op: ReduceOp::Sum,
        root: 0,
        device_scalar: None,
    }
}

#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn one_thread_drives_every_gpu_with_one_group() {
    let Some(n) = gpus_for_test() else { return };
    let comms = Comm::init_devices(&(0..n).map(Device::Cuda).collect::<Vec<_>>(), &Config::default()).unwrap();
    let stats = MemStats::new();
    let count = 64 << 20; // 256 MiB of f32 per rank
    let mut bufs = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        let gpu = c.gpu().unwrap();
        let send = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
        let recv = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
        let host: Vec<f32> = (0..count).map(|i| ((i % 1000) + r) as f32).collect();
        send.copy_from_host(0, f32_bytes(&host)).unwrap();
        bufs.push((send, recv));
    }
    let launch = || {
        let mut g = Group::new();
        for (c, (s, r)) in comms.iter().zip(&bufs) {
            // SAFETY: device buffers of count f32 on each rank's GPU, alive past synchronize.
            unsafe { g.push_raw(c, all_reduce_args(s, r, count)).unwrap() };
        }
        g.launch().unwrap();
    };
    launch(); // tables onto the GPUs
    for c in &comms {
        c.synchronize().unwrap();
    }
    let t = Instant::now();
    launch();
    let enqueue = t.elapsed();
    for c in &comms {
        c.synchronize().unwrap();
    }
    let total = t.elapsed();
    eprintln!("group of {n} all-reduces of 256 MiB: enqueued in {enqueue:?}, completed in {total:?}");
    // Launches to all GPUs return before any completes: a serialised launch would take the
    // whole operation time per GPU.
    assert!(enqueue * 10 < total, "enqueue {enqueue:?} vs total {total:?}");
    let nn = n as f32;
    for (s, r) in &bufs {
        let _ = s;
        let mut out = vec![0f32; count];
        // SAFETY: f32 slice as bytes for the copy.
        let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, count * 4) };
        r.copy_to_host(0, bytes).unwrap();
        for (i, v) in out.iter().enumerate() {
            let want = nn * (i % 1000) as f32 + (0..n).sum::<usize>() as f32;
            assert_eq!(*v, want, "element {i}");
        }
    }
}

#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn operations_can_be_captured_in_a_cuda_graph() {
    let Some(n) = gpus_for_test() else { return };
    let comms = Comm::init_devices(&(0..n).map(Device::Cuda).collect::<Vec<_>>(), &Config::default()).unwrap();
    let stats = MemStats::new();
    let count = 1 << 20;
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let stats = &stats;
                s.spawn(move || -> Result<(), String> {
                    let gpu = c.gpu().unwrap();
                    let buf = DeviceBuffer::alloc(gpu, count * 4, &[], stats).map_err(|e| e.to_string())?;
                    let ones = vec![1f32; count];
                    buf.copy_from_host(0, f32_bytes(&ones)).map_err(|e| e.to_string())?;
                    let args = all_reduce_args(&buf, &buf, count);
                    // Warm-up outside capture: the operation's tables go to the GPU once.
                    unsafe { c.run_raw(&args) }.map_err(|e| e.to_string())?;
                    c.synchronize().map_err(|e| e.to_string())?;
                    buf.copy_from_host(0, f32_bytes(&ones)).map_err(|e| e.to_string())?;
                    let stream = c.cuda_stream() as sys::CUstream;
                    gpu.bind().map_err(|e| e.to_string())?;
                    unsafe {
                        check("cuStreamBeginCapture", sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)).map_err(|e| e.to_string())?;
                        // Three in-place all-reduces of ones over n ranks give n^3.
                        for _ in 0..3 {
                            c.run_raw(&args).map_err(|e| e.to_string())?;
                        }
                        let mut graph = std::ptr::null_mut();
                        check("cuStreamEndCapture", sys::cuStreamEndCapture(stream, &mut graph)).map_err(|e| e.to_string())?;
                        let mut exec = std::ptr::null_mut();
                        check("cuGraphInstantiate", sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)).map_err(|e| e.to_string())?;
                        check("cuGraphLaunch", sys::cuGraphLaunch(exec, stream)).map_err(|e| e.to_string())?;
                        c.synchronize().map_err(|e| e.to_string())?;
                        sys::cuGraphExecDestroy(exec);
                        sys::cuGraphDestroy(graph);
                    }
                    let mut out = vec![0f32; count];
                    let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, count * 4) };
                    buf.copy_to_host(0, bytes).map_err(|e| e.to_string())?;
                    let want = (n * n * n) as f32;
                    match out.iter().position(|&v| v != want) {
                        None => Ok(()),
                        Some(i) => Err(format!("rank {r}: element {i} is {}, expected {want}", out[i])),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn a_device_scalar_is_read_when_the_graph_replays() {
    let Some(n) = gpus_for_test() else { return };
    let comms = Comm::init_devices(&(0..n).map(Device::Cuda).collect::<Vec<_>>(), &Config::default()).unwrap();
    let stats = MemStats::new();
    let count = 300_007; // odd: vector bodies and scalar tails
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let stats = &stats;
                s.spawn(move || -> Result<(), String> {
                    let e = |e: Error| e.to_string();
                    let gpu = c.gpu().unwrap();
                    let send = DeviceBuffer::alloc(gpu, count * 4, &[], stats).map_err(e)?;
                    let recv = DeviceBuffer::alloc(gpu, count * 4, &[], stats).map_err(e)?;
                    let scalar = DeviceBuffer::alloc(gpu, 4, &[], stats).map_err(e)?;
                    let input: Vec<f32> = (0..count).map(|i| ((i * 7 + r * 3) % 101) as f32).collect();
                    send.copy_from_host(0, f32_bytes(&input)).map_err(e)?;
                    let args = OpArgs {
                        op: ReduceOp::PreMulSum(123.0), // ignored: the device scalar rules
                        device_scalar: Some(scalar.device_ptr()),
                        ..all_reduce_args(&send, &recv, count)
                    };
                    let stream = c.cuda_stream() as sys::CUstream;
                    scalar.copy_from_host(0, f32_bytes(&[2.0])).map_err(e)?;
                    unsafe { c.run_raw(&args) }.map_err(e)?;
                    c.synchronize().map_err(e)?;
                    gpu.bind().map_err(e)?;
                    let exec = unsafe {
                        check("cuStreamBeginCapture", sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)).map_err(e)?;
                        c.run_raw(&args).map_err(e)?;
                        let mut graph = std::ptr::null_mut();
                        check("cuStreamEndCapture", sys::cuStreamEndCapture(stream, &mut graph)).map_err(e)?;
                        let mut exec = std::ptr::null_mut();
                        check("cuGraphInstantiate", sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)).map_err(e)?;
                        sys::cuGraphDestroy(graph);
                        exec
                    };
                    let mut outs = Vec::new();
                    // Eager with 2, then the same graph replayed with 2 and after a change to -0.5.
                    let mut out = vec![0f32; count];
                    let read = |out: &mut Vec<f32>| -> Result<(), String> {
                        let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, count * 4) };
                        recv.copy_to_host(0, bytes).map_err(e)
                    };
                    read(&mut out)?;
                    outs.push((2.0f32, out.clone()));
                    for k in [2.0f32, -0.5] {
                        // Every rank has set its scalar before any replays: the ranks agree.
                        c.barrier().map_err(e)?;
                        scalar.copy_from_host(0, f32_bytes(&[k])).map_err(e)?;
                        recv.copy_from_host(0, &vec![0xAB; count * 4]).map_err(e)?;
                        c.barrier().map_err(e)?;
                        unsafe { check("cuGraphLaunch", sys::cuGraphLaunch(exec, stream)).map_err(e)? };
                        c.synchronize().map_err(e)?;
                        read(&mut out)?;
                        outs.push((k, out.clone()));
                    }
                    unsafe { sys::cuGraphExecDestroy(exec) };
                    for (k, out) in outs {
                        for (i, v) in out.iter().enumerate() {
                            let sum: usize = (0..n).map(|q| (i * 7 + q * 3) % 101).sum();
                            let want = k * sum as f32; // small integers times 2 or -0.5: exact
                            if *v != want {
                                return Err(format!("rank {r}, scalar {k}: element {i} is {v}, expected {want}"));
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        r.unwrap();
    }
}

/// Child of the kill test: all-reduce on GPU LOCAL_RANK in a loop until an error.
#[test]
fn child_gpu_kill_loop() {
    if role().as_deref() != Some("gpu-kill") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env_gpu(&cfg).unwrap();
    let stats = MemStats::new();
    let count = 16 << 20;
    let buf = DeviceBuffer::alloc(comm.gpu().unwrap(), count * 4, &[], &stats).unwrap();
    let args = all_reduce_args(&buf, &buf, count);
    let t = Instant::now();
    loop {
        let r: Result<(), Error> = unsafe { comm.run_raw(&args) }.and_then(|_| comm.synchronize());
        if let Err(e) = r {
            println!("ERROR after {:?}: {e}", t.elapsed());
            std::process::exit(3);
        }
        if t.elapsed() > Duration::from_secs(60) {
            println!("never failed");
            std::process::exit(0);
        }
    }
}

#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn a_killed_gpu_process_fails_its_peers_by_deadline() {
    if role().is_some() {
        return;
    }
    let Some(_) = gpus_for_test() else { return };
    let mut kids = spawn_ranks(2, "child_gpu_kill_loop", "gpu-kill", &[("FERROCCL_TIMEOUT", "5".into())]);
    std::thread::sleep(Duration::from_secs(4));
    kids[1].kill().unwrap();
    let t = Instant::now();
    let out = wait_all(kids);
    let took = t.elapsed();
    let (ok, text) = &out[0];
    eprintln!("survivor after {took:?}: {text}");
    assert!(!ok && text.contains("ERROR"), "{text}");
    assert!(text.contains("rank 1"), "the error does not name the dead rank: {text}");
    assert!(took < Duration::from_secs(15), "{took:?}");
}
