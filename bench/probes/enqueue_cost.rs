//! The host cost of one call: how long `Comm::run_raw` takes to return, for an all-reduce of
//! 8 bytes, with the same shape and buffers every time, with new buffers every time (new
//! addresses, as a framework's caching allocator hands out), and with a new shape every time
//! (a new element count). Median and 90th percentile over the calls of the slowest rank. Then
//! one thread driving every rank: a group of one all-reduce per rank, the same shape and buffers
//! every time (`FERROCCL_LAUNCH_SPIN_US=0` makes its launches one after the other).
//!
//! cargo bench -p ferroccl --bench enqueue_cost [-- CALLS]
//!
//! On GPUs (one rank per GPU of this host, a thread each) a call returns once the operation is
//! enqueued: the figure is the enqueue cost, the "<= 2 us". Beside it, the driver's
//! floor on the same GPU and stream: `cuLaunchKernel` of an empty kernel whose parameter is 8
//! bytes, as large as the direct engine's (376 bytes, also launched to start early as the
//! engines are on compute capability 9.0 and up) and the plan kernel's (528), and
//! `cuStreamIsCapturing`, which every launch asks; what is left is ferroccl's own. Without GPUs it runs two
//! host ranks, where a call returns when the operation is done: the figure is then the whole
//! operation, not an enqueue cost, and says what the host backend's path costs.

use ferroccl::mem::{DeviceBuffer, MemStats};
use ferroccl::{CollKind, Comm, Config, DataType, Device, Group, OpArgs, ReduceOp};
use std::time::Instant;

/// Which addresses and shapes the calls use.
#[derive(Clone, Copy, Debug)]
enum Case {
    Repeat,
    NewBuffers,
    NewShape,
}

/// Bytes between the buffers of successive calls with new buffers (an allocator's alignment).
const STRIDE: usize = 512;

fn args(base_send: u64, base_recv: u64, case: Case, i: usize) -> OpArgs {
    let (off, count) = match case {
        Case::Repeat => (0, 2),
        Case::NewBuffers => (i * STRIDE, 2),
        // 2, 3, 4, ... floats: each call a shape not seen before.
        Case::NewShape => (0, 2 + i),
    };
    OpArgs {
        kind: CollKind::AllReduce,
        send: (base_send as usize + off) as *const u8,
        recv: (base_recv as usize + off) as *mut u8,
        count,
        dtype: DataType::Float32,
        op: ReduceOp::Sum,
        root: 0,
        device_scalar: None,
    }
}

/// Per-call times (us) of `calls` calls of `case` on `c`, whose buffers start at the bases.
fn time_calls(c: &Comm, send: u64, recv: u64, case: Case, calls: usize) -> Vec<f64> {
    // Warm the repeated shape (and the engine) up first, as a framework's first step does.
    for i in 0..16 {
        // SAFETY: the buffers hold every call's extent (see `main`).
        unsafe { c.run_raw(&args(send, recv, Case::Repeat, i)) }.expect("warm-up");
    }
    c.synchronize().expect("synchronize");
    c.barrier().expect("barrier");
    let mut t = Vec::with_capacity(calls);
    for i in 0..calls {
        let a = args(send, recv, case, i);
        let start = Instant::now();
        // SAFETY: as above.
        unsafe { c.run_raw(&a) }.expect("all-reduce");
        t.push(start.elapsed().as_secs_f64() * 1e6);
        // Keep the GPU's queue short: the figure is the call, not a full launch queue's wait.
        if i % 256 == 255 {
            c.synchronize().expect("synchronize");
        }
    }
    c.synchronize().expect("synchronize");
    t
}

/// Per-call times (us) of `calls` groups, each an all-reduce on every communicator, from this
/// one thread.
fn time_groups(comms: &[Comm], bases: &[(u64, u64)], calls: usize) -> Vec<f64> {
    let group = || {
        let mut g = Group::new();
        for (c, &(s, r)) in comms.iter().zip(bases) {
            // SAFETY: the buffers hold every call's extent (see `main`).
            unsafe { g.push_raw(c, args(s, r, Case::Repeat, 0)) }.expect("push");
        }
        g
    };
    let sync = || {
        comms
            .iter()
            .for_each(|c| c.synchronize().expect("synchronize"))
    };
    for _ in 0..16 {
        group().launch().expect("warm-up");
    }
    sync();
    let mut t = Vec::with_capacity(calls);
    for i in 0..calls {
        let g = group();
        let start = Instant::now();
        g.launch().expect("all-reduce group");
        t.push(start.elapsed().as_secs_f64() * 1e6);
        if i % 256 == 255 {
            sync();
        }
    }
    sync();
    t
}

/// The driver's own cost on `c`'s GPU and stream, per call (us, median): an empty kernel with
/// a parameter of each size, and asking whether the stream is being captured.
fn driver_floor(c: &Comm, config: &Config, calls: usize) -> Vec<(String, f64)> {
    use cudarc::driver::sys;
    use ferroccl::cuda::{cu_ok, device::LaunchDims, nvrtc};
    const SRC: &str = "struct P8 { unsigned long long w[1]; }; struct P376 { unsigned long long w[47]; }; struct P528 { unsigned long long w[66]; };\n\
        extern \"C\" __global__ void empty8(const __grid_constant__ P8 p) { if (p.w[0] == 1) p.w[0]; }\n\
        extern \"C\" __global__ void empty376(const __grid_constant__ P376 p) { if (p.w[46] == 1) p.w[0]; }\n\
        extern \"C\" __global__ void empty528(const __grid_constant__ P528 p) { if (p.w[65] == 1) p.w[0]; }\n";
    let gpu = c.gpu().expect("a GPU rank");
    let arch = gpu.arch();
    let req = nvrtc::CompileRequest {
        name: "empty.cu",
        source: SRC,
        arch: &arch,
        include_dirs: &config.cuda_include,
        options: &[],
    };
    let image = nvrtc::compile(&req).expect("NVRTC");
    let module = gpu.load_module(&image.bytes).expect("module");
    let stream = c.cuda_stream() as sys::CUstream;
    let median = |mut t: Vec<f64>| percentile(&mut t, 0.5);
    let mut out = Vec::new();
    // The 8-byte parameter says what the parameter's size costs; the early start (programmatic
    // dependent launch, `cuLaunchKernelEx` with one attribute) what the engines' launch adds.
    let early = gpu.compute_capability() >= (9, 0);
    for (name, bytes, overlap_prior) in [
        ("empty8", 8usize, false),
        ("empty376", 376, false),
        ("empty376", 376, early),
        ("empty528", 528, false),
    ] {
        let k = module.kernel(name).expect("kernel");
        let mut param = vec![0u64; bytes / 8];
        let mut t = Vec::with_capacity(calls);
        for i in 0..calls {
            let mut params = [param.as_mut_ptr() as *mut std::ffi::c_void];
            let start = Instant::now();
            // SAFETY: the kernel takes one struct of `bytes` by value; it reads nothing else.
            unsafe {
                k.launch(
                    LaunchDims {
                        grid: (1, 1, 1),
                        block: (32, 1, 1),
                        shared_bytes: 0,
                        overlap_prior,
                    },
                    stream,
                    &mut params,
                )
            }
            .expect("launch");
            t.push(start.elapsed().as_secs_f64() * 1e6);
            if i % 256 == 255 {
                c.synchronize().expect("synchronize");
            }
        }
        c.synchronize().expect("synchronize");
        let how = if overlap_prior {
            "cuLaunchKernelEx (early start)"
        } else {
            "cuLaunchKernel"
        };
        out.push((format!("{how}, {bytes} B parameter"), median(t)));
    }
    let mut t = Vec::with_capacity(calls);
    for _ in 0..calls {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let start = Instant::now();
        // SAFETY: the communicator's live stream and an out pointer.
        cu_ok("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(stream, &mut status)
        })
        .expect("capture status");
        t.push(start.elapsed().as_secs_f64() * 1e6);
    }
    out.push(("cuStreamIsCapturing".into(), median(t)));
    // What every launch adds around the kernel's: the ordering event recorded after it
    // (StreamOrder::after) and binding the GPU's context, already current.
    let mut event = std::ptr::null_mut();
    // SAFETY: an out pointer for a new event of the bound context.
    cu_ok("cuEventCreate", unsafe {
        sys::cuEventCreate(
            &mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
        )
    })
    .expect("event");
    let mut t = Vec::with_capacity(calls);
    for _ in 0..calls {
        let start = Instant::now();
        // SAFETY: our event and the communicator's live stream.
        cu_ok("cuEventRecord", unsafe {
            sys::cuEventRecord(event, stream)
        })
        .expect("record");
        t.push(start.elapsed().as_secs_f64() * 1e6);
    }
    out.push(("cuEventRecord".into(), median(t)));
    // SAFETY: our event, recorded; destroying it is allowed.
    unsafe { sys::cuEventDestroy_v2(event) };
    let mut t = Vec::with_capacity(calls);
    for _ in 0..calls {
        let start = Instant::now();
        gpu.bind().expect("bind");
        t.push(start.elapsed().as_secs_f64() * 1e6);
    }
    out.push(("cuCtxSetCurrent (already current)".into(), median(t)));
    out
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    // `cargo bench` adds "--bench" to the arguments: take the first number given.
    let calls: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2000);
    let gpus = ferroccl::cuda::gpu_count().unwrap_or(0);
    let config = Config::from_env().expect("FERROCCL_* settings");
    // FERROCCL_PROBE_DEVICES=0,0: these GPU ordinals, one rank each (ranks may share a GPU), to
    // time the multi-rank engines' path on a one-GPU machine.
    let ordinals: Vec<usize> = match std::env::var("FERROCCL_PROBE_DEVICES") {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|d| {
                d.trim()
                    .parse()
                    .expect("FERROCCL_PROBE_DEVICES: GPU ordinals")
            })
            .collect(),
        _ => (0..gpus).collect(),
    };
    let gpus = if gpus > 0 { ordinals.len() } else { 0 };
    let comms = if gpus > 0 {
        Comm::init_devices(
            &ordinals
                .iter()
                .map(|&d| Device::Cuda(d))
                .collect::<Vec<_>>(),
            &config,
        )
    } else {
        Comm::init_all(2, &config)
    }
    .expect("creating the communicators");
    // Room for every call: new buffers walk `calls` strides, new shapes grow to 2 + calls floats.
    let bytes = (calls + 2) * STRIDE.max(4) + 4096;
    let stats = MemStats::new();
    let mut host = Vec::new();
    let mut dev: Vec<(DeviceBuffer, DeviceBuffer)> = Vec::new();
    for c in &comms {
        match c.gpu() {
            Some(g) => dev.push((
                ferroccl::mem::alloc(g, bytes, &stats).unwrap(),
                ferroccl::mem::alloc(g, bytes, &stats).unwrap(),
            )),
            None => host.push((vec![1u8; bytes], vec![0u8; bytes])),
        }
    }
    let bases: Vec<(u64, u64)> = if gpus > 0 {
        dev.iter()
            .map(|(s, r)| (s.device_ptr(), r.device_ptr()))
            .collect()
    } else {
        host.iter_mut()
            .map(|(s, r)| (s.as_ptr() as u64, r.as_mut_ptr() as u64))
            .collect()
    };
    let what = if gpus > 0 {
        format!("{gpus} GPU(s), enqueue cost")
    } else {
        "2 host ranks, whole operation".into()
    };
    println!("host time of one all-reduce call ({what}), {calls} calls, slowest rank, us");
    println!("{:<12} {:>8} {:>8}", "case", "median", "p90");
    for case in [Case::Repeat, Case::NewBuffers, Case::NewShape] {
        let per_rank: Vec<Vec<f64>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .zip(&bases)
                .map(|(c, &(sb, rb))| s.spawn(move || time_calls(c, sb, rb, case, calls)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect()
        });
        let (mut med, mut p90) = (0f64, 0f64);
        for mut t in per_rank {
            med = med.max(percentile(&mut t, 0.5));
            p90 = p90.max(percentile(&mut t, 0.9));
        }
        println!("{:<12} {med:>8.2} {p90:>8.2}", format!("{case:?}"));
    }
    if comms.len() > 1 {
        let mut t = time_groups(&comms, &bases, calls);
        let (med, p90) = (percentile(&mut t, 0.5), percentile(&mut t, 0.9));
        println!(
            "{:<12} {med:>8.2} {p90:>8.2}   (one thread, a group over all {} ranks, spin {} us)",
            "OneThread",
            comms.len(),
            config.launch_spin_us
        );
    }
    if gpus > 0 {
        println!("the driver's floor on rank 0's GPU and stream, median us:");
        for (what, us) in driver_floor(&comms[0], &config, calls) {
            println!("  {what:<40} {us:>6.2}");
        }
    }
}
