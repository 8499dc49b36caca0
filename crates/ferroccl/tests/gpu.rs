//! GPU tests: ignored by default (CI has no GPU); on a GPU machine run them with
//! `FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored`. What they check: one thread driving every GPU with
//! one group (launches not serialised behind each other's completion), CUDA-graph capture of
//! operations, a killed process making its peer's kernels fail within seconds (heartbeats raise the abort word), and the
//! GPU checker (`Comm::gpu_verifier`) agreeing with `RankCase` on the host.

mod common;

use common::gpus_for_test;
use common::launch::{assert_all_print, role, spawn_ranks, wait_all};
use cudarc::driver::sys;
use ferroccl::cuda::cu_ok;
use ferroccl::mem::{DeviceBuffer, MemStats};
use ferroccl::{CollKind, Comm, Config, Device, Error, Group, OpArgs, ReduceOp};
use ferroccl_core::tune::{self, OpShape};
use std::time::{Duration, Instant};

fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; the slice is valid for its byte length.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// `count` f32 values of a device buffer.
fn read_f32(b: &DeviceBuffer, count: usize) -> Result<Vec<f32>, Error> {
    let mut out = vec![0f32; count];
    // SAFETY: the f32 slice as bytes, for the copy.
    let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, count * 4) };
    b.copy_to_host(0, bytes)?;
    Ok(out)
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

/// A 2-rank fold of float32 operands (rank 0's, rank 1's), as a reduction gives it.
type Fold = fn(f32, f32) -> f32;

/// Sum, Prod, Max, Min and Avg with their 2-rank folds: exact for the small integers the tests
/// put in (their sums, products and halves are floats exactly).
const PAIR_FOLDS: [(ReduceOp, Fold); 5] = [
    (ReduceOp::Sum, |a, b| a + b),
    (ReduceOp::Prod, |a, b| a * b),
    (ReduceOp::Max, f32::max),
    (ReduceOp::Min, f32::min),
    (ReduceOp::Avg, |a, b| (a + b) / 2.0),
];

/// The tuner's view of a float32 operation of `count` elements on `nranks` ranks, on buffers
/// that are not windows (Sum: the tuner's default reduction).
fn f32_shape(kind: CollKind, count: usize, nranks: usize, in_place: bool) -> OpShape {
    OpShape {
        kind,
        count,
        dtype: ferroccl::DataType::Float32,
        nranks,
        in_place,
        windows: false,
        symmetric: false,
        inputs_symmetric: false,
        redop: 0,
    }
}

/// Rank `q`'s float bits at element `i`, where Max and Min may pick either operand's bits:
/// signed zeros and NaN payloads that differ between the ranks, a NaN against a number, and
/// ordinary values.
fn edge_bits(q: usize, i: usize) -> u32 {
    let nan = |p: u32| 0x7fc0_0000u32 | p;
    match i % 4 {
        0 if (i / 4 + q).is_multiple_of(2) => 0,
        0 => 0x8000_0000,
        1 => nan((q as u32 + 1) * 0x111 + (i as u32 & 0xff)),
        2 if q == 0 => nan(0x2a),
        2 => ((i % 97) as f32).to_bits(),
        _ => (((i * 7 + q * 13) % 101) as f32 - 50.0).to_bits(),
    }
}

/// Gathers every rank's `count` floats of `out` into `both` (unregistered: on the kernels) and
/// asserts that all ranks hold the same bits.
fn assert_ranks_agree(
    comm: &Comm,
    out: &DeviceBuffer,
    both: &DeviceBuffer,
    count: usize,
    what: &str,
) {
    let a = OpArgs {
        kind: CollKind::AllGather,
        ..all_reduce_args(out, both, count)
    };
    let mut g = Group::new();
    // SAFETY: device buffers of count and nranks x count f32, alive past synchronize.
    unsafe { g.push_raw(comm, a).unwrap() };
    g.launch().unwrap();
    comm.synchronize().unwrap();
    let got: Vec<u32> = read_f32(both, comm.nranks() * count)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert!(
        got.chunks(count).all(|c| c == &got[..count]),
        "{what}: the ranks' results differ"
    );
}

/// Rank `q`'s words of a round, from a seed every rank shares (xorshift: fresh, never all zeros).
fn words(seed: u64, round: u64, q: usize, len: usize) -> Vec<u32> {
    let mut x = seed ^ (round << 32) ^ ((q as u64 + 1) * 0x9e37_79b9_7f4a_7c15);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u32
        })
        .collect()
}

/// Writes `v` at word `at` of `b`.
fn put_words(b: &DeviceBuffer, at: usize, v: &[u32]) {
    let f: Vec<f32> = v.iter().map(|&x| f32::from_bits(x)).collect();
    b.copy_from_host(at * 4, f32_bytes(&f)).unwrap();
}

/// The first `len` words of `b`.
fn read_words(b: &DeviceBuffer, len: usize) -> Vec<u32> {
    read_f32(b, len)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Runs one float32 operation alone in its launch and waits for it; the launch's thread blocks
/// (`Some(0)`: the copy engines alone).
fn run_alone(
    comm: &Comm,
    kind: CollKind,
    send: u64,
    recv: u64,
    count: usize,
    root: usize,
    op: ReduceOp,
) -> Option<u32> {
    let a = OpArgs {
        kind,
        send: send as *const u8,
        recv: recv as *mut u8,
        count,
        dtype: ferroccl::DataType::Float32,
        op,
        root,
        device_scalar: None,
    };
    let mut g = Group::new();
    // SAFETY: the callers' buffers hold the operation's elements and outlive the synchronize.
    unsafe { g.push_raw(comm, a).unwrap() };
    g.launch().unwrap();
    let blocks = comm.last_launch_blocks();
    comm.synchronize().unwrap();
    blocks
}

#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn one_thread_drives_every_gpu_with_one_group() {
    let Some(n) = gpus_for_test() else { return };
    let comms = Comm::init_devices(
        &(0..n).map(Device::Cuda).collect::<Vec<_>>(),
        &Config::default(),
    )
    .unwrap();
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
    eprintln!(
        "group of {n} all-reduces of 256 MiB: enqueued in {enqueue:?}, completed in {total:?}"
    );
    // Launches to all GPUs return before any completes: a serialised launch would take the
    // whole operation time per GPU.
    assert!(
        enqueue * 10 < total,
        "enqueue {enqueue:?} vs total {total:?}"
    );
    let nn = n as f32;
    for (s, r) in &bufs {
        let _ = s;
        let out = read_f32(r, count).unwrap();
        for (i, v) in out.iter().enumerate() {
            let want = nn * (i % 1000) as f32 + (0..n).sum::<usize>() as f32;
            assert_eq!(*v, want, "element {i}");
        }
    }
}

/// Zero-copy windows, a thread per GPU: memory that is not a cuMem allocation is refused on
/// every rank with an error naming the allocator, and the communicator stays usable; registered
/// buffers then take in-place and out-of-place all-gathers and all-reduces straight into the
/// peers' outputs (exact results checked, twice: posts and waits across launches); an unknown
/// window cannot be deregistered; deregistered buffers go back to the FIFO path.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn registered_windows_take_data_straight_into_the_output() {
    let Some(n) = gpus_for_test() else { return };
    let id = ferroccl::UniqueId::new(&Config::default()).unwrap();
    let count = (3 << 20) + 17; // several pieces per channel, an odd tail
    std::thread::scope(|s| {
        for r in 0..n {
            let id = id.clone();
            s.spawn(move || {
                let comm = Comm::init_rank(&id, n, r, Device::Cuda(r), &Config::default()).unwrap();
                let gpu = comm.gpu().unwrap().clone();
                let stats = MemStats::new();
                // Not GPU memory at all: refused everywhere, nothing registered.
                let host = vec![0u8; 4096];
                let e =
                    unsafe { comm.register_window(host.as_ptr() as u64, host.len()) }.unwrap_err();
                assert!(e.to_string().contains("ferroccl::mem::alloc"), "{e}");
                let send = ferroccl::mem::alloc(&gpu, count * 4, &stats).unwrap();
                let recv = ferroccl::mem::alloc(&gpu, n * count * 4, &stats).unwrap();
                comm.register_buffer(&send).unwrap();
                comm.register_buffer(&recv).unwrap();
                let read = |b: &DeviceBuffer, len: usize| read_f32(b, len).unwrap();
                let val =
                    |q: usize, i: usize, round: usize| ((i * 7 + q * 3 + round) % 1024) as f32;
                let run = |kind: CollKind, send_ptr: u64, recv_ptr: u64, cnt: usize| {
                    let a = OpArgs {
                        kind,
                        send: send_ptr as *const u8,
                        recv: recv_ptr as *mut u8,
                        count: cnt,
                        dtype: ferroccl::DataType::Float32,
                        op: ReduceOp::Sum,
                        root: 0,
                        device_scalar: None,
                    };
                    let mut g = Group::new();
                    unsafe { g.push_raw(&comm, a).unwrap() };
                    g.launch().unwrap();
                    comm.synchronize().unwrap();
                };
                for round in 0..2 {
                    let mine: Vec<f32> = (0..count).map(|i| val(r, i, round)).collect();
                    // All-gather out of place, then in place (our block inside recv).
                    send.copy_from_host(0, f32_bytes(&mine)).unwrap();
                    run(
                        CollKind::AllGather,
                        send.device_ptr(),
                        recv.device_ptr(),
                        count,
                    );
                    let got = read(&recv, n * count);
                    for q in 0..n {
                        assert!(
                            (0..count).all(|i| got[q * count + i] == val(q, i, round)),
                            "round {round}: all-gather block {q}"
                        );
                    }
                    recv.copy_from_host(0, &vec![0u8; n * count * 4]).unwrap();
                    recv.copy_from_host(r * count * 4, f32_bytes(&mine))
                        .unwrap();
                    run(
                        CollKind::AllGather,
                        recv.device_ptr() + (r * count * 4) as u64,
                        recv.device_ptr(),
                        count,
                    );
                    let got = read(&recv, n * count);
                    for q in 0..n {
                        assert!(
                            (0..count).all(|i| got[q * count + i] == val(q, i, round)),
                            "round {round}: in-place all-gather block {q}"
                        );
                    }
                    // All-reduce in place.
                    send.copy_from_host(0, f32_bytes(&mine)).unwrap();
                    run(
                        CollKind::AllReduce,
                        send.device_ptr(),
                        send.device_ptr(),
                        count,
                    );
                    let got = read(&send, count);
                    assert!(
                        (0..count).all(|i| got[i] == (0..n).map(|q| val(q, i, round)).sum::<f32>()),
                        "round {round}: all-reduce"
                    );
                }
                let e = comm
                    .deregister_window(recv.device_ptr() + 4096)
                    .unwrap_err();
                assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
                comm.deregister_window(send.device_ptr()).unwrap();
                comm.deregister_window(recv.device_ptr()).unwrap();
                // Through the FIFOs again.
                let mine: Vec<f32> = (0..count).map(|i| val(r, i, 9)).collect();
                send.copy_from_host(0, f32_bytes(&mine)).unwrap();
                run(
                    CollKind::AllGather,
                    send.device_ptr(),
                    recv.device_ptr(),
                    count,
                );
                let got = read(&recv, n * count);
                assert!((0..n).all(|q| (0..count).all(|i| got[q * count + i] == val(q, i, 9))));
            });
        }
    });
}

/// Which of the copy engines' paths `symmetric_windows_body` expects to take its operations.
#[derive(Clone, Copy)]
struct Ce {
    /// Those between symmetric windows, which exchange nothing at a launch (all-gather,
    /// all-to-all, broadcast, the copy-and-fold of all-reduces and reduce-scatters):
    /// `Fabric::ranks_window`.
    windows: bool,
    /// Those after a rendezvous (gather, scatter, sends and receives, the reduce's
    /// copy-and-fold): `Fabric::ranks_post`.
    posted: bool,
}

impl Ce {
    const ALL: Ce = Ce {
        windows: true,
        posted: true,
    };
    const NONE: Ce = Ce {
        windows: false,
        posted: false,
    };
}

/// One rank's part of the symmetric-window tests: all-gather, all-to-all and (2 ranks)
/// broadcast between symmetric windows, out of place and in place, exact on fresh data; by the
/// copy engines (no thread block) where `ce` says, else by kernels; lengths that differ between
/// ranks refused; in-place all-to-alls and deregistered buffers on kernels.
fn symmetric_windows_body(comm: &Comm, ce: Ce, seed: u64) {
    let (n, r) = (comm.nranks(), comm.rank());
    let count = (1 << 20) + 17; // an odd tail
    let by_ce = |blocks: Option<u32>| blocks == Some(0);
    let gpu = comm.gpu().unwrap().clone();
    let stats = MemStats::new();
    // Lengths that differ between ranks: refused on every rank.
    let odd = ferroccl::mem::alloc(&gpu, (4 << 20) + r * 4096, &stats).unwrap();
    let e = comm.register_symmetric_buffer(&odd).unwrap_err();
    assert!(e.to_string().contains("one length on every rank"), "{e}");
    let send = ferroccl::mem::alloc(&gpu, n * count * 4, &stats).unwrap();
    let recv = ferroccl::mem::alloc(&gpu, n * count * 4, &stats).unwrap();
    comm.register_symmetric_buffer(&send).unwrap();
    comm.register_symmetric_buffer(&recv).unwrap();
    let read = read_words;
    let put = put_words;
    // Every rank's data of a round, from the shared seed: rank q's element i.
    let data = |round: u64, q: usize, len: usize| words(seed, round, q, len);
    let run_op = |kind: CollKind, send_ptr: u64, recv_ptr: u64, cnt: usize, root: usize, op| {
        run_alone(comm, kind, send_ptr, recv_ptr, cnt, root, op)
    };
    let run = |kind, send_ptr, recv_ptr, cnt, root| {
        run_op(kind, send_ptr, recv_ptr, cnt, root, ReduceOp::Sum)
    };
    let scrub = |b: &DeviceBuffer| put(b, 0, &data(99, r, n * count));
    for round in 0..2u64 {
        // All-gather, out of place and in place.
        put(&send, 0, &data(round, r, count));
        scrub(&recv);
        assert_eq!(
            by_ce(run(
                CollKind::AllGather,
                send.device_ptr(),
                recv.device_ptr(),
                count,
                0
            )),
            ce.windows,
            "all-gather by copy engines"
        );
        let got = read(&recv, n * count);
        for q in 0..n {
            assert!(
                got[q * count..(q + 1) * count] == data(round, q, count)[..],
                "round {round}: all-gather block {q}"
            );
        }
        scrub(&recv);
        put(&recv, r * count, &data(round + 10, r, count));
        assert_eq!(
            by_ce(run(
                CollKind::AllGather,
                recv.device_ptr() + (r * count * 4) as u64,
                recv.device_ptr(),
                count,
                0
            )),
            ce.windows
        );
        let got = read(&recv, n * count);
        for q in 0..n {
            assert!(
                got[q * count..(q + 1) * count] == data(round + 10, q, count)[..],
                "round {round}: in-place all-gather block {q}"
            );
        }
        // All-to-all: block p of rank q's input lands at block q of rank p's output.
        put(&send, 0, &data(round + 20, r, n * count));
        scrub(&recv);
        assert_eq!(
            by_ce(run(
                CollKind::AllToAll,
                send.device_ptr(),
                recv.device_ptr(),
                count,
                0
            )),
            ce.windows,
            "all-to-all by copy engines"
        );
        let got = read(&recv, n * count);
        for q in 0..n {
            let theirs = data(round + 20, q, n * count);
            assert!(
                got[q * count..(q + 1) * count] == theirs[r * count..(r + 1) * count],
                "round {round}: all-to-all block {q}"
            );
        }
        // In place: a kernel, not the copy engines.
        put(&recv, 0, &data(round + 30, r, n * count));
        assert_ne!(
            run(
                CollKind::AllToAll,
                recv.device_ptr(),
                recv.device_ptr(),
                count,
                0
            ),
            Some(0),
            "in place takes a kernel"
        );
        let got = read(&recv, n * count);
        for q in 0..n {
            let theirs = data(round + 30, q, n * count);
            assert!(
                got[q * count..(q + 1) * count] == theirs[r * count..(r + 1) * count],
                "round {round}: in-place all-to-all block {q}"
            );
        }
        // Gather and scatter: the ranks post their outputs to each other first (a process per
        // GPU), so the copy engines take them whatever the offsets: a root in place, peers'
        // outputs at other offsets than the root's.
        let untouched = |b: &DeviceBuffer, from: usize, to: usize, what: &str| {
            let got = read(b, n * count);
            assert!(
                got[from..to] == data(99, r, n * count)[from..to],
                "round {round}: {what} wrote outside its output"
            );
        };
        let plain = ferroccl::mem::alloc(&gpu, n * count * 4, &stats).unwrap();
        for root in 0..n {
            let tag = round + 60 + 10 * root as u64;
            // Out of place.
            put(&send, 0, &data(tag, r, count));
            scrub(&recv);
            assert_eq!(
                by_ce(run(
                    CollKind::Gather,
                    send.device_ptr(),
                    recv.device_ptr(),
                    count,
                    root
                )),
                ce.posted,
                "gather by copy engines"
            );
            if r == root {
                let got = read(&recv, n * count);
                for q in 0..n {
                    assert!(
                        got[q * count..(q + 1) * count] == data(tag, q, count)[..],
                        "round {round}: gather to {root}, block {q}"
                    );
                }
            } else {
                untouched(&recv, 0, n * count, "a gather's non-root");
            }
            // The root in place (its input its own block of its output), the others from their
            // send buffers: offsets that differ by rank.
            scrub(&recv);
            let input = if r == root {
                put(&recv, r * count, &data(tag + 1, r, count));
                recv.device_ptr() + (r * count * 4) as u64
            } else {
                put(&send, 0, &data(tag + 1, r, count));
                send.device_ptr()
            };
            assert_eq!(
                by_ce(run(CollKind::Gather, input, recv.device_ptr(), count, root)),
                ce.posted,
                "gather to a root in place"
            );
            if r == root {
                let got = read(&recv, n * count);
                for q in 0..n {
                    assert!(
                        got[q * count..(q + 1) * count] == data(tag + 1, q, count)[..],
                        "round {round}: gather in place to {root}, block {q}"
                    );
                }
            }
            // A root whose output lies in no window: nothing to post, the kernels on every rank.
            put(&send, 0, &data(tag + 2, r, count));
            let out = if r == root {
                plain.device_ptr()
            } else {
                recv.device_ptr()
            };
            assert_ne!(
                run(CollKind::Gather, send.device_ptr(), out, count, root),
                Some(0),
                "a gather into an unregistered output"
            );
            if r == root {
                let got = read(&plain, n * count);
                for q in 0..n {
                    assert!(
                        got[q * count..(q + 1) * count] == data(tag + 2, q, count)[..],
                        "round {round}: gather into plain memory, block {q}"
                    );
                }
            }
            // Scatter out of place, each rank's output at its own offset of its window.
            put(&send, 0, &data(tag + 3, r, n * count));
            scrub(&recv);
            let at = recv.device_ptr() + (r * count * 4) as u64;
            assert_eq!(
                by_ce(run(CollKind::Scatter, send.device_ptr(), at, count, root)),
                ce.posted,
                "scatter by copy engines"
            );
            let got = read(&recv, n * count);
            assert!(
                got[r * count..(r + 1) * count]
                    == data(tag + 3, root, n * count)[r * count..(r + 1) * count],
                "round {round}: scatter from {root}"
            );
            untouched(&recv, 0, r * count, "a scatter");
            untouched(&recv, (r + 1) * count, n * count, "a scatter");
            // The root in place (its output its own block of its input), the others at 0.
            scrub(&recv);
            let (input, output) = if r == root {
                put(&recv, 0, &data(tag + 4, r, n * count));
                (
                    recv.device_ptr(),
                    recv.device_ptr() + (r * count * 4) as u64,
                )
            } else {
                (send.device_ptr(), recv.device_ptr())
            };
            assert_eq!(
                by_ce(run(CollKind::Scatter, input, output, count, root)),
                ce.posted,
                "scatter from a root in place"
            );
            let got = read(&recv, n * count);
            let mine = if r == root { r * count } else { 0 };
            assert!(
                got[mine..mine + count]
                    == data(tag + 4, root, n * count)[r * count..(r + 1) * count],
                "round {round}: scatter in place from {root}"
            );
        }
        // Sends and receives (2 ranks): the receiver posts its output to its sender first, and
        // the sender's copy engines copy straight into it where it lies in a window; grouped on
        // both ranks, or one rank's send and receive in two launches in either order; a
        // receive into plain memory takes the kernels while the other way takes the copies.
        if n == 2 {
            let peer = 1 - r;
            let p2p = |kind, ptr: u64| OpArgs {
                kind,
                send: ptr as *const u8,
                recv: ptr as *mut u8,
                count,
                dtype: ferroccl::DataType::Float32,
                op: ReduceOp::Sum,
                root: peer,
                device_scalar: None,
            };
            let launch = |ops: &[OpArgs]| {
                let mut g = Group::new();
                for a in ops {
                    unsafe { g.push_raw(comm, *a).unwrap() };
                }
                g.launch().unwrap();
                comm.last_launch_blocks()
            };
            // Ways: 0 grouped on both ranks; 1 and 2 rank 1's send and receive in two launches,
            // send first or receive first; 3 rank 1's output in plain memory (its receive on the
            // kernels, rank 0's by copies, each rank's launch mixed); 4 and 5 rank 0's output in
            // plain memory and rank 1's two launches, send first (the kernels' part) or receive
            // first: rank 0's grouped launch must run its copies and its kernels side by side,
            // or one waits on a launch of rank 1 that waits on the other.
            for way in 0u8..6 {
                let tag = round + 90 + way as u64;
                put(&send, 0, &data(tag, r, count));
                scrub(&recv);
                scrub(&plain);
                let plain_out = match way {
                    3 => r == 1,
                    4 | 5 => r == 0,
                    _ => false,
                };
                let (out, at) = if plain_out {
                    (&plain, 0)
                } else {
                    (&recv, r * count)
                };
                let send_op = p2p(CollKind::Send, send.device_ptr());
                let recv_op = p2p(CollKind::Recv, out.device_ptr() + (at * 4) as u64);
                let blocks = match (way, r) {
                    (1 | 4, 1) => [launch(&[send_op]), launch(&[recv_op])][1],
                    (2 | 5, 1) => [launch(&[recv_op]), launch(&[send_op])][1],
                    _ => launch(&[send_op, recv_op]),
                };
                comm.synchronize().unwrap();
                let got = read(out, n * count);
                assert!(
                    got[at..at + count] == data(tag, peer, count)[..],
                    "round {round}: sendrecv way {way}"
                );
                assert!(
                    got[..at] == data(99, r, n * count)[..at],
                    "round {round}: sendrecv way {way} wrote outside its output"
                );
                // The last launch by the copy engines alone where every output of it lies in a
                // window; a launch with a receive into plain memory, or a send to one, has a
                // kernels' part.
                let copies = match (way, r) {
                    (3, _) | (4 | 5, 0) => false,
                    (4, 1) => true,
                    (5, 1) => false,
                    _ => true,
                };
                assert_eq!(by_ce(blocks), ce.posted && copies, "sendrecv way {way}");
            }
        }
        if n == 2 {
            for root in 0..2 {
                put(&send, 0, &data(round + 40, r, count));
                scrub(&recv);
                assert_eq!(
                    by_ce(run(
                        CollKind::Broadcast,
                        send.device_ptr(),
                        recv.device_ptr(),
                        count,
                        root
                    )),
                    ce.windows,
                    "broadcast by copy engines"
                );
                assert!(
                    read(&recv, count) == data(round + 40, root, count),
                    "round {round}: broadcast from {root}"
                );
                put(&recv, 0, &data(round + 50, r, count));
                assert_eq!(
                    by_ce(run(
                        CollKind::Broadcast,
                        recv.device_ptr(),
                        recv.device_ptr(),
                        count,
                        root
                    )),
                    ce.windows
                );
                assert!(
                    read(&recv, count) == data(round + 50, root, count),
                    "round {round}: in-place broadcast from {root}"
                );
            }
            // All-reduce and reduce-scatter out of place: the peer's share copied into the output
            // and folded there by tune::FOLD_BLOCKS blocks (with the copy engines), else a kernel;
            // exact on small integers as floats, the same bits on both ranks.
            let small = |round: u64, q: usize, len: usize| -> Vec<u32> {
                data(round, q, len)
                    .iter()
                    .map(|&x| ((x % 2048) as f32 - 1024.0).to_bits())
                    .collect()
            };
            let fold_blocks = Some(tune::FOLD_BLOCKS as u32);
            // The reduce folds on blocks of its own (FERROCCL_GPU_FOLD_REDUCE_BLOCKS).
            let reduce_fold = Some(tune::FOLD_REDUCE_BLOCKS as u32);
            // An all-reduce of `send` into a scrubbed `recv`, out of place, on the copy-and-fold
            // where `folds` says.
            let all_reduce = |op: ReduceOp, folds: bool| {
                scrub(&recv);
                let blocks = run_op(
                    CollKind::AllReduce,
                    send.device_ptr(),
                    recv.device_ptr(),
                    n * count,
                    0,
                    op,
                );
                assert_eq!(
                    blocks == fold_blocks,
                    folds,
                    "all-reduce {op:?}: {blocks:?} blocks"
                );
            };
            let redops = PAIR_FOLDS
                .into_iter()
                .filter(|(op, _)| matches!(op, ReduceOp::Sum | ReduceOp::Max | ReduceOp::Avg));
            for (i, (op, f)) in redops.enumerate() {
                let tag = round + 60 + 10 * i as u64;
                put(&send, 0, &small(tag, r, n * count));
                // Avg too (float32 here: the fold takes Avg of 4- and 8-byte elements, dividing
                // after the sum; tune::fold_pays).
                let folds = ce.windows;
                all_reduce(op, folds);
                let (a, b) = (small(tag, 0, n * count), small(tag, 1, n * count));
                let want: Vec<u32> = (0..n * count)
                    .map(|j| f(f32::from_bits(a[j]), f32::from_bits(b[j])).to_bits())
                    .collect();
                assert!(
                    read(&recv, n * count) == want,
                    "round {round}: all-reduce {op:?}"
                );
                scrub(&recv);
                let blocks = run_op(
                    CollKind::ReduceScatter,
                    send.device_ptr(),
                    recv.device_ptr(),
                    count,
                    0,
                    op,
                );
                assert_eq!(
                    blocks == fold_blocks,
                    folds,
                    "reduce-scatter {op:?}: {blocks:?} blocks"
                );
                assert!(
                    read(&recv, count) == want[r * count..(r + 1) * count],
                    "round {round}: reduce-scatter {op:?}"
                );
            }
            // Reduce to either root between windows: after the rendezvous (the root posts its
            // window), the non-root's input copied into the root's output and folded there by
            // the root's fold kernel (with the copy engines); else a kernel. Exact.
            let tag = round + 95;
            put(&send, 0, &small(tag, r, n * count));
            let (a, b) = (small(tag, 0, n * count), small(tag, 1, n * count));
            let want: Vec<u32> = (0..n * count)
                .map(|j| (f32::from_bits(a[j]) + f32::from_bits(b[j])).to_bits())
                .collect();
            for root in 0..n {
                scrub(&recv);
                let blocks = run(
                    CollKind::Reduce,
                    send.device_ptr(),
                    recv.device_ptr(),
                    n * count,
                    root,
                );
                if ce.posted {
                    let fold = if r == root { reduce_fold } else { Some(0) };
                    assert_eq!(blocks, fold, "round {round}: reduce to {root}");
                }
                if r == root {
                    assert!(
                        read(&recv, n * count) == want,
                        "round {round}: reduce to {root}"
                    );
                }
            }
            // In place: a kernel, exact.
            put(&recv, 0, &small(round + 90, r, count));
            assert_ne!(
                run(
                    CollKind::AllReduce,
                    recv.device_ptr(),
                    recv.device_ptr(),
                    count,
                    0
                ),
                fold_blocks,
                "in place takes a kernel"
            );
            let (a, b) = (small(round + 90, 0, count), small(round + 90, 1, count));
            let want: Vec<u32> = (0..count)
                .map(|j| (f32::from_bits(a[j]) + f32::from_bits(b[j])).to_bits())
                .collect();
            assert!(
                read(&recv, count) == want,
                "round {round}: in-place all-reduce"
            );
            // Signed zeros and NaN payloads that differ between the ranks: Max and Min must give
            // both ranks the same bits (rank 1 folds with its operands swapped). Each rank's
            // result reaches every rank by an all-gather (on the kernels: its output is not
            // registered), and the two are compared bit for bit.
            if round == 0 {
                let both = ferroccl::mem::alloc(&gpu, n * n * count * 4, &stats).unwrap();
                let edges: Vec<u32> = (0..n * count).map(|i| edge_bits(r, i)).collect();
                for op in [ReduceOp::Max, ReduceOp::Min] {
                    put(&send, 0, &edges);
                    all_reduce(op, ce.windows);
                    assert_ranks_agree(comm, &recv, &both, n * count, &format!("{op:?}"));
                }
            }
        }
    }
    comm.deregister_window(send.device_ptr()).unwrap();
    comm.deregister_window(recv.device_ptr()).unwrap();
    // Unregistered again: a kernel, exact.
    put(&send, 0, &data(7, r, count));
    assert_ne!(
        run(
            CollKind::AllGather,
            send.device_ptr(),
            recv.device_ptr(),
            count,
            0
        ),
        Some(0)
    );
    let got = read(&recv, n * count);
    assert!((0..n).all(|q| got[q * count..(q + 1) * count] == data(7, q, count)[..]));
}

/// The settings of the copy engines' tests: the copies at every size, and the copy-and-fold in
/// pieces of 1 MiB tapering to 64 KiB (an 8 MiB all-reduce: 14 pieces, the last with a ragged end
/// of 136 bytes).
const COPIES: &[(&str, &str)] = &[
    ("FERROCCL_GPU_CE_WINDOW_BYTES", "1"),
    ("FERROCCL_GPU_CE_RENDEZVOUS_BYTES", "1"),
    ("FERROCCL_GPU_CE_GATHER_BYTES", "1"),
    ("FERROCCL_GPU_CE_BROADCAST_BYTES", "1"),
    ("FERROCCL_GPU_CE_P2P_BYTES", "1"),
    ("FERROCCL_GPU_FOLD_MIN_BYTES", "1"),
    ("FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES", "1"),
    ("FERROCCL_GPU_FOLD_PIECE_BYTES", "1048576"),
    ("FERROCCL_GPU_FOLD_TAIL_BYTES", "65536"),
    ("FERROCCL_TIMEOUT", "60"),
];

/// With [`COPIES`], between symmetric windows only: an output in plain memory takes the kernels
/// (the mapping on the fly has its own test).
const WINDOWS_ONLY: (&str, &str) = ("FERROCCL_GPU_CE_MAP_UNREGISTERED", "0");

/// The pull tests' settings: pulls at every size up to 1 GiB (the reduce's from 1 byte), no
/// copy-and-fold.
const PULLS: &[(&str, &str)] = &[
    ("FERROCCL_GPU_PEER_PULL_MIN_BYTES", "0"),
    ("FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES", "1"),
    ("FERROCCL_GPU_PEER_PULL_MAX_BYTES", "1073741824"),
    ("FERROCCL_GPU_FOLD_MIN_BYTES", "0"),
    ("FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES", "0"),
    ("FERROCCL_TIMEOUT", "60"),
];

/// `vars` as `spawn_ranks` takes them.
fn owned<'a>(vars: &[(&'a str, &str)]) -> Vec<(&'a str, String)> {
    vars.iter().map(|&(k, v)| (k, v.to_string())).collect()
}

/// Symmetric windows across processes (a process per GPU): large data movement by the copy
/// engines straight into the peers' outputs.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn symmetric_windows_move_data_by_copy_engines_straight_into_outputs() {
    if role().is_some() {
        return;
    }
    let Some(_) = gpus_for_test() else { return };
    let env = owned(&[COPIES, &[WINDOWS_ONLY]].concat());
    let kids = spawn_ranks(2, "child_symmetric_windows", "symmetric-windows", &env);
    assert_all_print(kids, "SYMMETRIC WINDOWS OK");
}

/// Child of the test above.
#[test]
fn child_symmetric_windows() {
    if role().as_deref() != Some("symmetric-windows") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env_gpu(&cfg).unwrap();
    symmetric_windows_body(&comm, Ce::ALL, comm.id());
    println!("SYMMETRIC WINDOWS OK");
}

/// Symmetric windows across processes (a process per GPU) where the peer engine moves the data
/// (sizes under the copies' windows): with the senders waiting for their receivers' posts at a
/// launch's start (`FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES`) the operations are exact and some
/// rounds go straight into the outputs from the first round (the later rank to start always
/// finds the earlier one's post); without it these sizes (8 MiB at most, under the looks' 32 MiB)
/// go through the staging only.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn symmetric_windows_go_direct_from_the_first_round_when_senders_wait() {
    if role().is_some() {
        return;
    }
    let Some(_) = gpus_for_test() else { return };
    for wait in ["1", "0"] {
        let env = [
            ("FERROCCL_GPU_PEER_WAIT_POSTS_MIN_BYTES", wait.to_string()),
            ("FERROCCL_TIMEOUT", "60".to_string()),
            // Windows only: an output in plain memory takes the kernels.
            ("FERROCCL_GPU_CE_MAP_UNREGISTERED", "0".to_string()),
        ];
        let kids = spawn_ranks(2, "child_wait_posts", "wait-posts", &env);
        let mut direct = 0u64;
        for (r, (ok, text)) in wait_all(kids).into_iter().enumerate() {
            let d = text
                .lines()
                .find_map(|l| l.split("WAIT POSTS OK direct=").nth(1))
                .and_then(|d| d.trim().parse::<u64>().ok());
            assert!(ok && d.is_some(), "wait {wait}, rank {r}:\n{text}");
            direct += d.unwrap_or(0);
        }
        assert_eq!(
            direct > 0,
            wait == "1",
            "wait {wait}: {direct} direct rounds"
        );
    }
}

/// Child of the test above.
#[test]
fn child_wait_posts() {
    if role().as_deref() != Some("wait-posts") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env_gpu(&cfg).unwrap();
    symmetric_windows_body(&comm, Ce::NONE, comm.id());
    println!(
        "WAIT POSTS OK direct={}",
        comm.direct_rounds().unwrap().unwrap()
    );
}

/// Outputs nobody registered, a process per GPU: once the ranks posted their outputs mapped for
/// their writers on the fly (`backend/cuda/lazy.rs`), the copy engines take large data movement
/// straight into them, every kind and root, in place where the kind allows it, twice over (the
/// second time on the loans the first made), and so do the copy-and-fold reductions of 2 ranks
/// (all-reduce, reduce-scatter, and reduce to either root); an all-to-all, all-reduce or reduce's
/// root in place, and memory that is not a cuMem allocation, take the kernels; an output freed
/// gives its memory back within the sweeper's period though no operation follows, and one
/// allocated anew (at the same address, where the driver gives it again) gets its data, not the
/// old allocation. Exact on fresh data.
fn mapped_on_the_fly_body(comm: &Comm, seed: u64) {
    let (n, r) = (comm.nranks(), comm.rank());
    let count = (1 << 20) + 17;
    let by_ce = |blocks: Option<u32>| blocks == Some(0);
    let gpu = comm.gpu().unwrap().clone();
    let stats = MemStats::new();
    let send = ferroccl::mem::alloc(&gpu, n * count * 4, &stats).unwrap();
    let recv = ferroccl::mem::alloc(&gpu, n * count * 4, &stats).unwrap();
    let data = |round: u64, q: usize, len: usize| words(seed, round, q, len);
    let run = |kind, s: u64, o: u64, root| run_alone(comm, kind, s, o, count, root, ReduceOp::Sum);
    let scrub = |b: &DeviceBuffer| put_words(b, 0, &data(99, r, n * count));
    for round in 0..2u64 {
        let recv = &recv;
        let (sp, rp) = (send.device_ptr(), recv.device_ptr());
        put_words(&send, 0, &data(round, r, n * count));
        scrub(recv);
        assert!(by_ce(run(CollKind::AllGather, sp, rp, 0)), "all-gather");
        let got = read_words(recv, n * count);
        for q in 0..n {
            assert!(
                got[q * count..(q + 1) * count] == data(round, q, n * count)[..count],
                "round {round}: all-gather block {q}"
            );
        }
        put_words(recv, r * count, &data(round + 1, r, count));
        let mine = rp + (r * count * 4) as u64;
        assert!(
            by_ce(run(CollKind::AllGather, mine, rp, 0)),
            "all-gather in place"
        );
        let got = read_words(recv, n * count);
        for q in 0..n {
            assert!(
                got[q * count..(q + 1) * count] == data(round + 1, q, count)[..],
                "round {round}: in-place all-gather block {q}"
            );
        }
        scrub(recv);
        assert!(by_ce(run(CollKind::AllToAll, sp, rp, 0)), "all-to-all");
        let got = read_words(recv, n * count);
        for q in 0..n {
            let theirs = data(round, q, n * count);
            assert!(
                got[q * count..(q + 1) * count] == theirs[r * count..(r + 1) * count],
                "round {round}: all-to-all block {q}"
            );
        }
        put_words(recv, 0, &data(round + 2, r, n * count));
        assert!(
            !by_ce(run(CollKind::AllToAll, rp, rp, 0)),
            "all-to-all in place"
        );
        let got = read_words(recv, n * count);
        for q in 0..n {
            let theirs = data(round + 2, q, n * count);
            assert!(
                got[q * count..(q + 1) * count] == theirs[r * count..(r + 1) * count],
                "round {round}: in-place all-to-all block {q}"
            );
        }
        for root in 0..n {
            let tag = round + 10 + 10 * root as u64;
            put_words(&send, 0, &data(tag, r, n * count));
            scrub(recv);
            assert!(
                by_ce(run(CollKind::Gather, sp, rp, root)),
                "gather to {root}"
            );
            let got = read_words(recv, n * count);
            for q in 0..n {
                let want = match r == root {
                    true => data(tag, q, n * count)[..count].to_vec(),
                    false => data(99, r, n * count)[q * count..(q + 1) * count].to_vec(),
                };
                assert!(
                    got[q * count..(q + 1) * count] == want[..],
                    "round {round}: gather to {root}, block {q}"
                );
            }
            scrub(recv);
            assert!(
                by_ce(run(CollKind::Scatter, sp, rp, root)),
                "scatter from {root}"
            );
            let got = read_words(recv, n * count);
            assert!(
                got[..count] == data(tag, root, n * count)[r * count..(r + 1) * count],
                "round {round}: scatter from {root}"
            );
            assert!(
                got[count..] == data(99, r, n * count)[count..],
                "round {round}: scatter from {root} wrote past its output"
            );
            if n == 2 {
                scrub(recv);
                assert!(by_ce(run(CollKind::Broadcast, sp, rp, root)), "broadcast");
                assert!(
                    read_words(recv, count) == data(tag, root, n * count)[..count],
                    "round {round}: broadcast from {root}"
                );
            }
        }
        if n == 2 {
            // Sendrecv, grouped: each receive posted to its sender mapped on the fly.
            let peer = 1 - r;
            scrub(recv);
            let p2p = |kind, ptr: u64| OpArgs {
                kind,
                send: ptr as *const u8,
                recv: ptr as *mut u8,
                count,
                dtype: ferroccl::DataType::Float32,
                op: ReduceOp::Sum,
                root: peer,
                device_scalar: None,
            };
            let mut g = Group::new();
            // SAFETY: buffers of n x count words, alive past the synchronize.
            unsafe {
                g.push_raw(comm, p2p(CollKind::Send, sp)).unwrap();
                g.push_raw(comm, p2p(CollKind::Recv, rp)).unwrap();
            }
            g.launch().unwrap();
            assert!(by_ce(comm.last_launch_blocks()), "sendrecv");
            comm.synchronize().unwrap();
            let got = read_words(recv, n * count);
            assert!(
                got[..count] == data(round + 10 + 10 * (n - 1) as u64, peer, n * count)[..count],
                "round {round}: sendrecv"
            );
        }
        if n == 2 {
            // All-reduce and reduce-scatter of 2 ranks out of place: the peer's share copied
            // into this rank's output, mapped on the fly, and folded there by the fold kernel's
            // blocks; in place, the kernels. Small integers as floats: exact.
            let small = |tag: u64, q: usize| -> Vec<u32> {
                data(tag, q, n * count)
                    .iter()
                    .map(|&x| ((x % 2048) as f32 - 1024.0).to_bits())
                    .collect()
            };
            let fold_blocks = Some(tune::FOLD_BLOCKS as u32);
            // The reduce folds on blocks of its own (FERROCCL_GPU_FOLD_REDUCE_BLOCKS).
            let reduce_fold = Some(tune::FOLD_REDUCE_BLOCKS as u32);
            let tag = round + 80;
            put_words(&send, 0, &small(tag, r));
            let (a, b) = (small(tag, 0), small(tag, 1));
            let want: Vec<u32> = (0..n * count)
                .map(|j| (f32::from_bits(a[j]) + f32::from_bits(b[j])).to_bits())
                .collect();
            let reduce =
                |kind, s: u64, cnt: usize| run_alone(comm, kind, s, rp, cnt, 0, ReduceOp::Sum);
            scrub(recv);
            assert_eq!(
                reduce(CollKind::AllReduce, sp, n * count),
                fold_blocks,
                "all-reduce"
            );
            assert!(
                read_words(recv, n * count) == want,
                "round {round}: all-reduce"
            );
            scrub(recv);
            assert_eq!(
                reduce(CollKind::ReduceScatter, sp, count),
                fold_blocks,
                "reduce-scatter"
            );
            assert!(
                read_words(recv, count) == want[r * count..(r + 1) * count],
                "round {round}: reduce-scatter"
            );
            put_words(recv, 0, &small(tag, r));
            assert_ne!(
                reduce(CollKind::AllReduce, rp, n * count),
                fold_blocks,
                "in place"
            );
            assert!(
                read_words(recv, n * count) == want,
                "round {round}: all-reduce in place"
            );
            // Reduce to either root: the non-root's input copied into the root's output, mapped
            // on the fly, and folded there by the root's fold kernel (the non-root runs no
            // kernel). In the second round the non-root passes its input as its output too (it
            // has none: the root's posting alone decides). A root in place: the kernels.
            put_words(&send, 0, &small(tag, r));
            for root in 0..n {
                scrub(recv);
                let o = if round == 1 && r != root { sp } else { rp };
                let blocks = run_alone(
                    comm,
                    CollKind::Reduce,
                    sp,
                    o,
                    n * count,
                    root,
                    ReduceOp::Sum,
                );
                let fold = if r == root { reduce_fold } else { Some(0) };
                assert_eq!(blocks, fold, "round {round}: reduce to {root}");
                if r == root {
                    assert!(
                        read_words(recv, n * count) == want,
                        "round {round}: reduce to {root}"
                    );
                }
                put_words(recv, 0, &small(tag, r));
                let blocks = run_alone(
                    comm,
                    CollKind::Reduce,
                    rp,
                    rp,
                    n * count,
                    root,
                    ReduceOp::Sum,
                );
                assert!(
                    blocks != reduce_fold && blocks != Some(0),
                    "round {round}: reduce in place to {root}: {blocks:?} blocks"
                );
                if r == root {
                    assert!(
                        read_words(recv, n * count) == want,
                        "round {round}: reduce in place to {root}"
                    );
                }
                put_words(&send, 0, &small(tag, r));
            }
        }
    }
    // Freed and allocated anew: the loan of the old allocation is dropped, the new one lent.
    // Its memory, which the loan and the peer's mapping of it hold, comes back within the
    // sweeper's period though no operation follows.
    let old = recv.device_ptr();
    let free_bytes = || {
        gpu.bind().unwrap();
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals.
        unsafe { cu_ok("cuMemGetInfo", sys::cuMemGetInfo_v2(&mut free, &mut total)).unwrap() };
        free
    };
    let before = free_bytes();
    ferroccl::mem::free(recv).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let back = free_bytes().saturating_sub(before);
    assert!(
        back >= n * count * 4,
        "{back} bytes came back after freeing an output of {} lent on the fly",
        n * count * 4
    );
    let recv = ferroccl::mem::alloc(&gpu, n * count * 4, &stats).unwrap();
    println!(
        "rank {r}: the output allocated anew {} the freed one's address",
        if recv.device_ptr() == old {
            "at"
        } else {
            "away from"
        }
    );
    for round in 0..2u64 {
        put_words(&send, 0, &data(round + 50, r, count));
        scrub(&recv);
        let blocks = run(CollKind::AllGather, send.device_ptr(), recv.device_ptr(), 0);
        assert!(by_ce(blocks), "all-gather into a new allocation");
        let got = read_words(&recv, n * count);
        for q in 0..n {
            assert!(
                got[q * count..(q + 1) * count] == data(round + 50, q, count)[..],
                "round {round}: all-gather into a new allocation, block {q}"
            );
        }
    }
    // Memory from cuMemAlloc (`cudaMalloc`'s): lent by its CUDA IPC handle, so the copy engines
    // write it, exact. Freed and allocated anew (the driver's buffer id tells the two apart even
    // at one address): the new one lent, exact, and the freed one's memory, which the peer's IPC
    // mapping held, back within the sweeper's period.
    gpu.bind().unwrap();
    let bytes = n * count * 4;
    let legacy_alloc = || {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: a fresh allocation of the output's size, freed below.
        unsafe { cu_ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut p, bytes)).unwrap() };
        p
    };
    let read_at = |p: sys::CUdeviceptr| {
        let mut got = vec![0u32; n * count];
        // SAFETY: `p` holds `bytes`, read after the operation's synchronize.
        unsafe {
            cu_ok(
                "cuMemcpyDtoH",
                sys::cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), p, bytes),
            )
            .unwrap()
        };
        got
    };
    let all_gather_into = |p: sys::CUdeviceptr, tag: u64, want_ce: bool, what: &str| {
        put_words(&send, 0, &data(tag, r, count));
        // SAFETY: `p` holds `bytes`.
        unsafe {
            cu_ok(
                "cuMemsetD32",
                sys::cuMemsetD32_v2(p, 0xdead_beef, n * count),
            )
            .unwrap();
        }
        let blocks = run(CollKind::AllGather, send.device_ptr(), p, 0);
        assert_eq!(
            by_ce(blocks),
            want_ce,
            "an all-gather into {what}: {blocks:?}"
        );
        let got = read_at(p);
        for q in 0..n {
            assert!(
                got[q * count..(q + 1) * count] == data(tag, q, count)[..],
                "all-gather into {what}, block {q}"
            );
        }
    };
    let legacy = legacy_alloc();
    all_gather_into(legacy, 70, true, "cuMemAlloc memory");
    all_gather_into(legacy, 71, true, "cuMemAlloc memory, its loan again");
    let before = free_bytes();
    // SAFETY: the operations on it completed (run_alone synchronizes).
    unsafe { cu_ok("cuMemFree", sys::cuMemFree_v2(legacy)).unwrap() };
    let again = legacy_alloc();
    println!(
        "rank {r}: cuMemAlloc memory allocated anew {} the freed one's address",
        if again == legacy { "at" } else { "away from" }
    );
    all_gather_into(again, 72, true, "cuMemAlloc memory allocated anew");
    // SAFETY: as above.
    unsafe { cu_ok("cuMemFree", sys::cuMemFree_v2(again)).unwrap() };
    std::thread::sleep(Duration::from_millis(500));
    let back = free_bytes().saturating_sub(before);
    assert!(
        back >= bytes,
        "{back} bytes came back after freeing cuMemAlloc outputs of {bytes} lent by IPC"
    );
    // Managed memory cannot be lent: the kernels, exact.
    let mut managed: sys::CUdeviceptr = 0;
    // SAFETY: a fresh managed allocation of the output's size, freed below.
    unsafe {
        cu_ok(
            "cuMemAllocManaged",
            sys::cuMemAllocManaged(&mut managed, bytes, 1 /* CU_MEM_ATTACH_GLOBAL */),
        )
        .unwrap()
    };
    all_gather_into(managed, 73, false, "managed memory");
    // SAFETY: as above.
    unsafe { cu_ok("cuMemFree", sys::cuMemFree_v2(managed)).unwrap() };
}

/// Outputs nobody registered move by the copy engines, mapped on the fly (a process per GPU).
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn unregistered_outputs_are_mapped_on_the_fly_for_the_copy_engines() {
    if role().is_some() {
        return;
    }
    let Some(_) = gpus_for_test() else { return };
    let kids = spawn_ranks(
        2,
        "child_mapped_on_the_fly",
        "mapped-on-the-fly",
        &owned(COPIES),
    );
    assert_all_print(kids, "MAPPED ON THE FLY OK");
}

/// Child of the test above.
#[test]
fn child_mapped_on_the_fly() {
    if role().as_deref() != Some("mapped-on-the-fly") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env_gpu(&cfg).unwrap();
    mapped_on_the_fly_body(&comm, comm.id() ^ 0x1a2b);
    println!("MAPPED ON THE FLY OK");
}

/// The same between threads of one process (a thread per GPU): a writer of this process reaches
/// a lent output at its own address, `cuMemAlloc` memory once its GPU has peer access to the
/// lender's context.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn unregistered_outputs_are_mapped_on_the_fly_in_one_process() {
    let Some(_) = gpus_for_test() else { return };
    in_threads(COPIES, |c| mapped_on_the_fly_body(c, c.id() ^ 0x3c4d));
}

/// All-reduces between symmetric windows on 2 ranks pull (`tune::peer_pulls`, here at every size
/// the peer engine takes): each rank reads its peer's input straight out of the peer's window.
/// Exact on fresh data for Sum, Prod, Max, Min and Avg at three sizes (odd tails), the same bits
/// on both ranks for Max and Min over signed zeros and NaN payloads that differ by rank; in
/// place and PreMulSum (a scalar per rank) run staged, exact; each launch counted where it pulled.
/// Reduces pull likewise, every root, in place or not: exact at the root, the non-root's output
/// untouched; a PreMulSum staged. Then on inputs nobody registered, lent to the root at a
/// rendezvous: the same, twice on one loan and on a new allocation; a PreMulSum and managed
/// memory (nothing to lend) on the rounds, exact; memory from cuMemAlloc lent by IPC and pulled.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn symmetric_windows_pull_all_reduces_from_the_peer_input() {
    if role().is_some() {
        return;
    }
    let Some(_) = gpus_for_test() else { return };
    let kids = spawn_ranks(2, "child_pull", "pull", &owned(PULLS));
    assert_all_print(kids, "PULL OK");
}

/// Child of the test above.
#[test]
fn child_pull() {
    if role().as_deref() != Some("pull") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env_gpu(&cfg).unwrap();
    pull_body(&comm, true);
    println!("PULL OK");
}

/// One rank's part of the pull tests (the process test above, the thread test below);
/// `windows`: the pulls between symmetric windows first, which ranks of one process take only
/// with `FERROCCL_GPU_WINDOWS_IN_PROCESS` (`Fabric::ranks_window`).
fn pull_body(comm: &Comm, windows: bool) {
    let (n, r) = (comm.nranks(), comm.rank());
    assert_eq!(n, 2);
    let gpu = comm.gpu().unwrap().clone();
    let stats = MemStats::new();
    let most = (4 << 20) + 3;
    let send = ferroccl::mem::alloc(&gpu, most * 4, &stats).unwrap();
    let recv = ferroccl::mem::alloc(&gpu, most * 4, &stats).unwrap();
    let both = ferroccl::mem::alloc(&gpu, 2 * most * 4, &stats).unwrap();
    if windows {
        comm.register_symmetric_buffer(&send).unwrap();
        comm.register_symmetric_buffer(&recv).unwrap();
    }
    let seed = comm.id();
    let put = |b: &DeviceBuffer, v: &[u32]| {
        let f: Vec<f32> = v.iter().map(|&x| f32::from_bits(x)).collect();
        b.copy_from_host(0, f32_bytes(&f)).unwrap();
    };
    let read = |b: &DeviceBuffer, len: usize| -> Vec<u32> {
        read_f32(b, len)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    // Rank q's small integers (exact as floats under every reduction here) for `tag`.
    let small = |tag: u64, q: usize, len: usize| -> Vec<f32> {
        let mut x = seed ^ (tag << 32) ^ ((q as u64 + 1) * 0x9e37_79b9_7f4a_7c15);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 64) as f32 - 32.0
            })
            .collect()
    };
    let pulled = || comm.direct_rounds().unwrap().unwrap();
    // Runs `a` (into `recv`) to its end: whether it pulled.
    let run = |a: OpArgs| {
        let before = pulled();
        let mut g = Group::new();
        unsafe { g.push_raw(comm, a).unwrap() };
        g.launch().unwrap();
        comm.synchronize().unwrap();
        pulled() > before
    };
    // An all-reduce of `input` into `recv`: whether it pulled.
    let all_reduce = |input: &DeviceBuffer, count: usize, op: ReduceOp| {
        let pull = run(OpArgs {
            op,
            ..all_reduce_args(input, &recv, count)
        });
        // A pull runs on tune::PEER_PULL_BLOCKS blocks here, whatever the staging's cut: every
        // count below is past PEER_PULL_BLOCKS x PEER_BLOCK_BYTES (one block per 8 KiB).
        if pull {
            let blocks = comm.last_launch_blocks().unwrap();
            assert_eq!(
                blocks as usize,
                tune::PEER_PULL_BLOCKS,
                "{count}: {blocks} blocks"
            );
        }
        pull
    };
    // Between symmetric windows (ranks in processes of their own only).
    for (k, count) in [(64 << 10) + 17, (1 << 20) + 1, most]
        .into_iter()
        .enumerate()
        .filter(|_| windows)
    {
        for (i, (op, f)) in PAIR_FOLDS.into_iter().enumerate() {
            let tag = (k * 10 + i) as u64;
            let mine = small(tag, r, count);
            send.copy_from_host(0, f32_bytes(&mine)).unwrap();
            put(&recv, &vec![0x7fc0_0bad; count]);
            assert!(all_reduce(&send, count, op), "{count} {op:?} did not pull");
            let (a, b) = (small(tag, 0, count), small(tag, 1, count));
            let want: Vec<u32> = (0..count).map(|j| f(a[j], b[j]).to_bits()).collect();
            assert!(read(&recv, count) == want, "{count} {op:?}");
        }
        // PreMulSum with a scalar per rank: staged (the peer's input would need its scalar).
        let mine = small(100 + k as u64, r, count);
        send.copy_from_host(0, f32_bytes(&mine)).unwrap();
        assert!(!all_reduce(
            &send,
            count,
            ReduceOp::PreMulSum(r as f64 + 2.0)
        ));
        let (a, b) = (
            small(100 + k as u64, 0, count),
            small(100 + k as u64, 1, count),
        );
        let want: Vec<u32> = (0..count)
            .map(|j| (a[j] * 2.0 + b[j] * 3.0).to_bits())
            .collect();
        assert!(read(&recv, count) == want, "{count} PreMulSum");
        // In place: staged, exact.
        let mine = small(200 + k as u64, r, count);
        recv.copy_from_host(0, f32_bytes(&mine)).unwrap();
        assert!(!all_reduce(&recv, count, ReduceOp::Sum));
        let (a, b) = (
            small(200 + k as u64, 0, count),
            small(200 + k as u64, 1, count),
        );
        let want: Vec<u32> = (0..count).map(|j| (a[j] + b[j]).to_bits()).collect();
        assert!(read(&recv, count) == want, "{count} in place");
    }
    // Max and Min over signed zeros and NaN payloads that differ by rank: both ranks' results,
    // gathered (an all-gather into an unregistered buffer), are the same bits.
    let count = (1 << 20) + 1;
    let edges: Vec<u32> = (0..count).map(|i| edge_bits(r, i)).collect();
    for op in [ReduceOp::Max, ReduceOp::Min]
        .into_iter()
        .filter(|_| windows)
    {
        put(&send, &edges);
        assert!(all_reduce(&send, count, op));
        assert_ranks_agree(comm, &recv, &both, count, &format!("pulled {op:?}"));
    }
    // Reduces pull too (their inputs lie in symmetric windows): the root reads its peer's input
    // and folds it into its output, in place or not; the non-root's output is left alone.
    let reduce = |input: &DeviceBuffer, count: usize, op: ReduceOp, root: usize| {
        run(OpArgs {
            kind: CollKind::Reduce,
            op,
            root,
            ..all_reduce_args(input, &recv, count)
        })
    };
    // A reduce of `count` fresh elements from `input` into `recv` for each of Sum to Avg (tags
    // from `tag0`), pulled: exact at the root, the non-root's output untouched.
    let reduces_pull = |input: &DeviceBuffer, count: usize, root: usize, tag0: u64, label: &str| {
        for (i, (op, f)) in PAIR_FOLDS.into_iter().enumerate() {
            let tag = tag0 + i as u64;
            input
                .copy_from_host(0, f32_bytes(&small(tag, r, count)))
                .unwrap();
            put(&recv, &vec![0x7fc0_0bad; count]);
            assert!(
                reduce(input, count, op, root),
                "{label} {count} {op:?} root {root} did not pull"
            );
            let (a, b) = (small(tag, 0, count), small(tag, 1, count));
            let want: Vec<u32> = if r == root {
                (0..count).map(|j| f(a[j], b[j]).to_bits()).collect()
            } else {
                vec![0x7fc0_0bad; count]
            };
            assert!(
                read(&recv, count) == want,
                "{label} {count} {op:?} root {root}"
            );
        }
    };
    // The same in place, a Sum (the root's output its input; the non-root's in place says
    // nothing, its buffer left as it was).
    let reduce_in_place_pulls = |count: usize, root: usize, tag: u64, label: &str| {
        recv.copy_from_host(0, f32_bytes(&small(tag, r, count)))
            .unwrap();
        assert!(
            reduce(&recv, count, ReduceOp::Sum, root),
            "{label} in place {count} root {root} did not pull"
        );
        let (a, b) = (small(tag, 0, count), small(tag, 1, count));
        let mine = if r == 0 { &a } else { &b };
        let want: Vec<u32> = if r == root {
            (0..count).map(|j| (a[j] + b[j]).to_bits()).collect()
        } else {
            mine.iter().map(|v| v.to_bits()).collect()
        };
        assert!(
            read(&recv, count) == want,
            "{label} in place {count} root {root}"
        );
    };
    for root in (0..n).filter(|_| windows) {
        for (k, count) in [(64 << 10) + 17, most].into_iter().enumerate() {
            reduces_pull(
                &send,
                count,
                root,
                (300 + root * 100 + k * 10) as u64,
                "reduce",
            );
            reduce_in_place_pulls(count, root, (400 + root * 100 + k) as u64, "reduce");
        }
    }
    // A PreMulSum (a scalar per rank) never pulls: staged, exact at the root.
    let premulsum_staged = |count: usize, root: usize, tag: u64, label: &str| {
        send.copy_from_host(0, f32_bytes(&small(tag, r, count)))
            .unwrap();
        assert!(
            !reduce(&send, count, ReduceOp::PreMulSum(r as f64 + 2.0), root),
            "{label} PreMulSum pulled"
        );
        if r == root {
            let (a, b) = (small(tag, 0, count), small(tag, 1, count));
            let want: Vec<u32> = (0..count)
                .map(|j| (a[j] * 2.0 + b[j] * 3.0).to_bits())
                .collect();
            assert!(read(&recv, count) == want, "{label} PreMulSum");
        }
    };
    if windows {
        premulsum_staged((1 << 20) + 1, 0, 500, "reduce");
        comm.deregister_window(send.device_ptr()).unwrap();
        comm.deregister_window(recv.device_ptr()).unwrap();
    }
    // Inputs nobody registered: the non-root lends its input to its root at the rendezvous
    // (`tune::pull_rendezvous_wanted`), and the root pulls from it; twice on one loan, on a new
    // allocation, every root, in place or not.
    let fresh = ferroccl::mem::alloc(&gpu, most * 4, &stats).unwrap();
    for (k, input) in [&send, &send, &fresh].into_iter().enumerate() {
        for root in 0..n {
            let label = format!("lent reduce {k}");
            reduces_pull(
                input,
                most - k,
                root,
                (600 + k * 100 + root * 10) as u64,
                &label,
            );
            reduce_in_place_pulls(most, root, (700 + k * 100 + root) as u64, &label);
        }
    }
    // A PreMulSum does not exchange for the pull.
    premulsum_staged(most, 1, 800, "lent reduce");
    // Memory from cuMemAlloc: lent by its CUDA IPC handle, so the root pulls it, exact. Managed
    // memory cannot be lent: both ranks run the rounds, exact.
    let legacy_reduce = |managed: bool, tag: u64| {
        let mut input: sys::CUdeviceptr = 0;
        // SAFETY: a fresh allocation of `most` floats, freed below after the synchronize.
        unsafe {
            if managed {
                cu_ok(
                    "cuMemAllocManaged",
                    sys::cuMemAllocManaged(&mut input, most * 4, 1 /* CU_MEM_ATTACH_GLOBAL */),
                )
                .unwrap()
            } else {
                cu_ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut input, most * 4)).unwrap()
            }
        };
        let mine = small(tag, r, most);
        // SAFETY: `input` holds `most` floats.
        unsafe {
            cu_ok(
                "cuMemcpyHtoD",
                sys::cuMemcpyHtoD_v2(input, mine.as_ptr().cast(), most * 4),
            )
            .unwrap()
        };
        let before = pulled();
        let blocks = run_alone(
            comm,
            CollKind::Reduce,
            input,
            recv.device_ptr(),
            most,
            0,
            ReduceOp::Sum,
        );
        let what = if managed { "managed" } else { "cuMemAlloc" };
        if managed {
            assert!(
                blocks.is_some_and(|b| b > 0) && pulled() == before,
                "{what} input: rounds, {blocks:?} blocks"
            );
        } else if r == 0 {
            assert!(pulled() > before, "{what} input: pulled");
        }
        if r == 0 {
            let (a, b) = (small(tag, 0, most), small(tag, 1, most));
            let want: Vec<u32> = (0..most).map(|j| (a[j] + b[j]).to_bits()).collect();
            assert!(read(&recv, most) == want, "reduce from {what} memory");
        }
        // SAFETY: the operation on it completed (run_alone synchronizes).
        unsafe { cu_ok("cuMemFree", sys::cuMemFree_v2(input)).unwrap() };
    };
    legacy_reduce(false, 900);
    legacy_reduce(false, 901);
    legacy_reduce(true, 902);
}

/// The pull test's inputs nobody registered between threads of one process (a thread per
/// GPU): the root, a peer of this process, reads the lent input at its own address, `cuMemAlloc`
/// memory once its GPU has peer access to the lender's context.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn pulls_take_inputs_lent_in_one_process() {
    let Some(_) = gpus_for_test() else { return };
    in_threads(PULLS, |c| pull_body(c, false));
}

/// Runs `body` on 2 ranks that are threads of one process, GPUs 0 and 1, configured by `vars`
/// (as the environment would); a panic on either rank fails the test.
fn in_threads(vars: &[(&str, &str)], body: fn(&Comm)) {
    let vars: std::collections::HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let cfg = Config::from_vars(&vars).unwrap();
    let id = ferroccl::UniqueId::new(&cfg).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (id, cfg) = (id.clone(), cfg.clone());
                s.spawn(move || {
                    let comm = Comm::init_rank(&id, 2, r, Device::Cuda(r), &cfg).unwrap();
                    body(&comm);
                })
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            assert!(h.join().is_ok(), "rank {r} failed");
        }
    });
}

/// The reduce of 2 ranks from the copy-and-fold's floor, a process per GPU, on buffers nobody
/// registered: out of place the non-root's copy engines land its input in the root's output and
/// the root folds it (nothing pulled); in place, where the root refuses the fold, the root pulls
/// the input its non-root lent it in the same exchange. Both roots, twice on the same loans,
/// beyond the all-reduce's pull maximum (which the reduce does not read); then in place between
/// symmetric windows, pulled without an exchange of inputs. Exact on fresh data; the non-root's
/// buffer untouched in place.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn reduces_fold_out_of_place_and_pull_in_place_from_the_folds_floor() {
    if role().is_some() {
        return;
    }
    let Some(_) = gpus_for_test() else { return };
    let env = [
        ("FERROCCL_GPU_PEER_PULL_REDUCE_MIN_BYTES", "1".to_string()),
        ("FERROCCL_GPU_PEER_PULL_MAX_BYTES", "1048576".to_string()),
        ("FERROCCL_GPU_FOLD_REDUCE_MIN_BYTES", "1".to_string()),
        ("FERROCCL_GPU_FOLD_PIECE_BYTES", "1048576".to_string()),
        ("FERROCCL_GPU_FOLD_TAIL_BYTES", "65536".to_string()),
        ("FERROCCL_TIMEOUT", "60".to_string()),
    ];
    let kids = spawn_ranks(2, "child_fold_or_pull", "fold-or-pull", &env);
    assert_all_print(kids, "FOLD OR PULL OK");
}

/// Child of the test above.
#[test]
fn child_fold_or_pull() {
    if role().as_deref() != Some("fold-or-pull") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env_gpu(&cfg).unwrap();
    let (n, r) = (comm.nranks(), comm.rank());
    assert_eq!(n, 2);
    let seed = comm.id() ^ 0x5eed;
    let gpu = comm.gpu().unwrap().clone();
    let stats = MemStats::new();
    let count = (2 << 20) + 5;
    let send = ferroccl::mem::alloc(&gpu, count * 4, &stats).unwrap();
    let recv = ferroccl::mem::alloc(&gpu, count * 4, &stats).unwrap();
    // Rank q's small integers as floats for `tag` (sums exact).
    let small = |tag: u64, q: usize| -> Vec<u32> {
        words(seed, tag, q, count)
            .iter()
            .map(|&x| ((x % 2048) as f32 - 1024.0).to_bits())
            .collect()
    };
    let sum = |tag: u64| -> Vec<u32> {
        let (a, b) = (small(tag, 0), small(tag, 1));
        (0..count)
            .map(|j| (f32::from_bits(a[j]) + f32::from_bits(b[j])).to_bits())
            .collect()
    };
    let pulled = || comm.direct_rounds().unwrap().unwrap();
    let reduce = |s: &DeviceBuffer, o: &DeviceBuffer, root: usize| {
        let before = pulled();
        let blocks = run_alone(
            &comm,
            CollKind::Reduce,
            s.device_ptr(),
            o.device_ptr(),
            count,
            root,
            ReduceOp::Sum,
        );
        (blocks, pulled() > before)
    };
    for round in 0..2u64 {
        for root in 0..n {
            let tag = 10 * round + root as u64;
            put_words(&send, 0, &small(tag, r));
            put_words(&recv, 0, &vec![0x7fc0_0bad; count]);
            let (blocks, pull) = reduce(&send, &recv, root);
            let folded = if r == root {
                Some(tune::FOLD_REDUCE_BLOCKS as u32)
            } else {
                Some(0)
            };
            assert!(
                !pull && blocks == folded,
                "round {round}: reduce to {root} out of place: {blocks:?} blocks, pulled {pull}"
            );
            if r == root {
                assert!(
                    read_words(&recv, count) == sum(tag),
                    "round {round}: folded to {root}"
                );
            }
            let tag = tag + 100;
            put_words(&recv, 0, &small(tag, r));
            let (_, pull) = reduce(&recv, &recv, root);
            assert!(
                pull,
                "round {round}: reduce to {root} in place did not pull"
            );
            let want = if r == root { sum(tag) } else { small(tag, r) };
            assert!(
                read_words(&recv, count) == want,
                "round {round}: pulled to {root} in place"
            );
        }
    }
    comm.register_symmetric_buffer(&recv).unwrap();
    for root in 0..n {
        let tag = 300 + root as u64;
        put_words(&recv, 0, &small(tag, r));
        let (_, pull) = reduce(&recv, &recv, root);
        assert!(
            pull,
            "reduce to {root} in place between windows did not pull"
        );
        let want = if r == root { sum(tag) } else { small(tag, r) };
        assert!(
            read_words(&recv, count) == want,
            "pulled to {root} in place between windows"
        );
    }
    comm.deregister_window(recv.device_ptr()).unwrap();
    println!("FOLD OR PULL OK");
}

/// Ranks of one process (threads) keep the copies between windows off by default
/// (`Fabric::ranks_window`): those operations run on kernels, exact; the gathers, scatters,
/// sends and the reduce take the copies after a rendezvous (`Fabric::ranks_post`), as processes
/// do. The process test's settings.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn symmetric_windows_in_one_process_take_kernels() {
    let Some(_) = gpus_for_test() else { return };
    in_threads(&[COPIES, &[WINDOWS_ONLY]].concat(), |c| {
        let ce = Ce {
            windows: false,
            posted: true,
        };
        symmetric_windows_body(c, ce, c.id())
    });
}

/// With `FERROCCL_GPU_WINDOWS_IN_PROCESS`, ranks of one process (a thread per GPU) take the
/// copies and pulls between symmetric windows as processes do: the same bodies as the process
/// tests (`symmetric_windows_move_data_by_copy_engines_straight_into_outputs`, the pull test's
/// windows part), by the copy engines, exact.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn symmetric_windows_in_one_process_take_copies_when_let() {
    let Some(_) = gpus_for_test() else { return };
    let let_in = ("FERROCCL_GPU_WINDOWS_IN_PROCESS", "1");
    in_threads(&[COPIES, &[WINDOWS_ONLY, let_in]].concat(), |c| {
        symmetric_windows_body(c, Ce::ALL, c.id())
    });
    in_threads(&[PULLS, &[let_in]].concat(), |c| pull_body(c, true));
}

#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn operations_can_be_captured_in_a_cuda_graph() {
    let Some(n) = gpus_for_test() else { return };
    let comms = Comm::init_devices(
        &(0..n).map(Device::Cuda).collect::<Vec<_>>(),
        &Config::default(),
    )
    .unwrap();
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
                    let buf = DeviceBuffer::alloc(gpu, count * 4, &[], stats)
                        .map_err(|e| e.to_string())?;
                    let ones = vec![1f32; count];
                    buf.copy_from_host(0, f32_bytes(&ones))
                        .map_err(|e| e.to_string())?;
                    let args = all_reduce_args(&buf, &buf, count);
                    // Warm-up outside capture: the operation's tables go to the GPU once.
                    unsafe { c.run_raw(&args) }.map_err(|e| e.to_string())?;
                    c.synchronize().map_err(|e| e.to_string())?;
                    buf.copy_from_host(0, f32_bytes(&ones))
                        .map_err(|e| e.to_string())?;
                    let stream = c.cuda_stream() as sys::CUstream;
                    gpu.bind().map_err(|e| e.to_string())?;
                    unsafe {
                        cu_ok(
                            "cuStreamBeginCapture",
                            sys::cuStreamBeginCapture_v2(
                                stream,
                                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                            ),
                        )
                        .map_err(|e| e.to_string())?;
                        // Three in-place all-reduces of ones over n ranks give n^3.
                        for _ in 0..3 {
                            c.run_raw(&args).map_err(|e| e.to_string())?;
                        }
                        let mut graph = std::ptr::null_mut();
                        cu_ok(
                            "cuStreamEndCapture",
                            sys::cuStreamEndCapture(stream, &mut graph),
                        )
                        .map_err(|e| e.to_string())?;
                        let mut exec = std::ptr::null_mut();
                        cu_ok(
                            "cuGraphInstantiate",
                            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                        )
                        .map_err(|e| e.to_string())?;
                        cu_ok("cuGraphLaunch", sys::cuGraphLaunch(exec, stream))
                            .map_err(|e| e.to_string())?;
                        c.synchronize().map_err(|e| e.to_string())?;
                        sys::cuGraphExecDestroy(exec);
                        sys::cuGraphDestroy(graph);
                    }
                    let out = read_f32(&buf, count).map_err(|e| e.to_string())?;
                    let want = (n * n * n) as f32;
                    match out.iter().position(|&v| v != want) {
                        None => Ok(()),
                        Some(i) => Err(format!(
                            "rank {r}: element {i} is {}, expected {want}",
                            out[i]
                        )),
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
    let comms = Comm::init_devices(
        &(0..n).map(Device::Cuda).collect::<Vec<_>>(),
        &Config::default(),
    )
    .unwrap();
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
                    let input: Vec<f32> =
                        (0..count).map(|i| ((i * 7 + r * 3) % 101) as f32).collect();
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
                        cu_ok(
                            "cuStreamBeginCapture",
                            sys::cuStreamBeginCapture_v2(
                                stream,
                                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                            ),
                        )
                        .map_err(e)?;
                        c.run_raw(&args).map_err(e)?;
                        let mut graph = std::ptr::null_mut();
                        cu_ok(
                            "cuStreamEndCapture",
                            sys::cuStreamEndCapture(stream, &mut graph),
                        )
                        .map_err(e)?;
                        let mut exec = std::ptr::null_mut();
                        cu_ok(
                            "cuGraphInstantiate",
                            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                        )
                        .map_err(e)?;
                        sys::cuGraphDestroy(graph);
                        exec
                    };
                    let mut outs = Vec::new();
                    // Eager with 2, then the same graph replayed with 2 and after a change to -0.5.
                    outs.push((2.0f32, read_f32(&recv, count).map_err(e)?));
                    for k in [2.0f32, -0.5] {
                        // Every rank has set its scalar before any replays: the ranks agree.
                        c.barrier().map_err(e)?;
                        scalar.copy_from_host(0, f32_bytes(&[k])).map_err(e)?;
                        recv.copy_from_host(0, &vec![0xAB; count * 4]).map_err(e)?;
                        c.barrier().map_err(e)?;
                        unsafe {
                            cu_ok("cuGraphLaunch", sys::cuGraphLaunch(exec, stream)).map_err(e)?
                        };
                        c.synchronize().map_err(e)?;
                        outs.push((k, read_f32(&recv, count).map_err(e)?));
                    }
                    unsafe { sys::cuGraphExecDestroy(exec) };
                    for (k, out) in outs {
                        for (i, v) in out.iter().enumerate() {
                            let sum: usize = (0..n).map(|q| (i * 7 + q * 3) % 101).sum();
                            let want = k * sum as f32; // small integers times 2 or -0.5: exact
                            if *v != want {
                                return Err(format!(
                                    "rank {r}, scalar {k}: element {i} is {v}, expected {want}"
                                ));
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
    // RAW_SYNC=1: wait on the stream with the driver, as a framework does, so that only the
    // heartbeat watcher can free the kernels.
    let raw = std::env::var("RAW_SYNC").as_deref() == Ok("1");
    let stream = comm.cuda_stream() as sys::CUstream;
    let t = Instant::now();
    loop {
        let r: Result<(), Error> = unsafe { comm.run_raw(&args) }.and_then(|_| {
            if raw {
                comm.gpu().unwrap().bind()?;
                cu_ok("cuStreamSynchronize", unsafe {
                    sys::cuStreamSynchronize(stream)
                })?;
            }
            comm.synchronize()
        });
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

/// Kills rank 1 of a 2-process GPU job after 4 s; returns the survivor's output and how long
/// it took to fail. The deadline is far beyond what the tests accept: the survivor must learn
/// of the death from the heartbeats, whose news raises its kernels' abort word.
fn kill_rank_1(extra: &[(&str, String)]) -> (String, Duration) {
    let mut env = vec![("FERROCCL_TIMEOUT", "30".to_string())];
    env.extend(extra.iter().cloned());
    let mut kids = spawn_ranks(2, "child_gpu_kill_loop", "gpu-kill", &env);
    std::thread::sleep(Duration::from_secs(4));
    kids[1].kill().unwrap();
    let t = Instant::now();
    let out = wait_all(kids);
    let took = t.elapsed();
    let (ok, text) = &out[0];
    eprintln!("survivor after {took:?}: {text}");
    assert!(!ok && text.contains("ERROR"), "{text}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    (text.clone(), took)
}

#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn a_killed_gpu_process_fails_its_peers_within_seconds() {
    if role().is_some() {
        return;
    }
    let Some(_) = gpus_for_test() else { return };
    let (text, _) = kill_rank_1(&[]);
    assert!(
        text.contains("rank 1"),
        "the error does not name the dead rank: {text}"
    );
}

#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn a_killed_peer_frees_kernels_a_framework_waits_on() {
    if role().is_some() {
        return;
    }
    let Some(_) = gpus_for_test() else { return };
    let (text, _) = kill_rank_1(&[("RAW_SYNC", "1".into())]);
    assert!(
        text.contains("rank 1") && text.contains("died"),
        "the error does not say that rank 1 died: {text}"
    );
}

mod gpu_verifier {
    use super::gpus_for_test;
    use ferroccl::mem::{DeviceBuffer, MemStats};
    use ferroccl::{CollKind, Comm, Config, DataType, Device, ReduceOp};
    use ferroccl_core::numeric::element::store_f64;
    use ferroccl_core::numeric::expected::RankCase;
    use std::time::Instant;

    fn same(a: f64, b: f64) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    fn ops(d: DataType) -> Vec<ReduceOp> {
        let mut v = ReduceOp::BUILTIN.to_vec();
        v.push(ReduceOp::PreMulSum(if d.is_float() { 0.3 } else { 3.0 }));
        v
    }

    /// Fills on the GPU equal RankCase::fill_input byte for byte (every dtype, every value
    /// stream, aligned and not); counts find exactly the planted wrong elements and report the
    /// first as the host does; and both run at a useful speed on 256 MiB.
    #[test]
    #[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
    fn gpu_verifier_matches_the_host_reference() {
        let Some(_) = gpus_for_test() else { return };
        let comms = Comm::init_devices(&[Device::Cuda(0)], &Config::default()).unwrap();
        let comm = &comms[0];
        let t = Instant::now();
        let chk = comm
            .gpu_verifier()
            .unwrap()
            .expect("a GPU communicator has a checker");
        eprintln!("checker ready in {:?}", t.elapsed());
        let gpu = comm.gpu().unwrap();
        let stats = MemStats::new();
        let mut seed = 1u64;
        for dtype in DataType::ALL {
            let w = dtype.size();
            // Odd: a tail after the packs; large enough for many blocks.
            let len = 300_007usize;
            let buf = DeviceBuffer::alloc(gpu, (len + 1) * w, &[], &stats).unwrap();
            let mut inputs: Vec<(CollKind, ReduceOp)> = ops(dtype)
                .into_iter()
                .map(|o| (CollKind::AllReduce, o))
                .collect();
            inputs.push((CollKind::AllGather, ReduceOp::Sum));
            for (kind, op) in inputs {
                for shift in [0, w] {
                    seed += 1;
                    let case = RankCase {
                        kind,
                        dtype,
                        op,
                        nranks: 5,
                        rank: 3,
                        count: len,
                        root: 0,
                        seed,
                    };
                    let ptr = (buf.device_ptr() as usize + shift) as *mut u8;
                    unsafe { chk.fill(&case, ptr, len) }.unwrap();
                    comm.synchronize().unwrap();
                    let mut got = vec![0u8; len * w];
                    buf.copy_to_host(shift, &mut got).unwrap();
                    let mut want = vec![0u8; len * w];
                    case.fill_input(&mut want);
                    if let Some(i) =
                        (0..len).find(|&i| got[i * w..(i + 1) * w] != want[i * w..(i + 1) * w])
                    {
                        panic!(
                            "{case:?} at +{shift}: element {i} is {:x?}, host {:x?}",
                            &got[i * w..(i + 1) * w],
                            &want[i * w..(i + 1) * w]
                        );
                    }
                }
            }

            let count = 7001;
            let outs = [
                RankCase {
                    kind: CollKind::AllReduce,
                    dtype,
                    op: ReduceOp::Sum,
                    nranks: 4,
                    rank: 1,
                    count,
                    root: 0,
                    seed,
                },
                RankCase {
                    kind: CollKind::AllReduce,
                    dtype,
                    op: ReduceOp::Avg,
                    nranks: 3,
                    rank: 0,
                    count,
                    root: 0,
                    seed,
                },
                RankCase {
                    kind: CollKind::ReduceScatter,
                    dtype,
                    op: ReduceOp::Prod,
                    nranks: 4,
                    rank: 2,
                    count,
                    root: 0,
                    seed,
                },
                RankCase {
                    kind: CollKind::Reduce,
                    dtype,
                    op: ReduceOp::Min,
                    nranks: 5,
                    rank: 2,
                    count,
                    root: 2,
                    seed,
                },
                RankCase {
                    kind: CollKind::AllReduce,
                    dtype,
                    op: ops(dtype)[5],
                    nranks: 6,
                    rank: 5,
                    count,
                    root: 0,
                    seed,
                },
                RankCase {
                    kind: CollKind::AllGather,
                    dtype,
                    op: ReduceOp::Sum,
                    nranks: 4,
                    rank: 3,
                    count,
                    root: 0,
                    seed,
                },
                RankCase {
                    kind: CollKind::AllToAll,
                    dtype,
                    op: ReduceOp::Sum,
                    nranks: 3,
                    rank: 1,
                    count,
                    root: 0,
                    seed,
                },
                RankCase {
                    kind: CollKind::Recv,
                    dtype,
                    op: ReduceOp::Sum,
                    nranks: 2,
                    rank: 1,
                    count,
                    root: 0,
                    seed,
                },
            ];
            for case in outs {
                let len = case
                    .kind
                    .buffer_counts(count, case.nranks, case.rank == case.root)
                    .unwrap()
                    .1;
                let mut out = vec![0u8; len * w];
                for j in 0..len {
                    store_f64(dtype, &mut out, j, case.expected(j).unwrap());
                }
                // Planted: distinct indices, the first of them odd so that it is not a pack's first.
                let planted: Vec<usize> = (0..37).map(|k| (101 + k * 7919) % len).collect();
                for &j in &planted {
                    let x = case.expected(j).unwrap();
                    // 64 away: beyond every tolerance (fp8 pre-mul-sums by 0.3 accept a sign flip
                    // of small values), and still 60 away after rounding to fp8.
                    store_f64(
                        dtype,
                        &mut out,
                        j,
                        if x > 0.0 { x - 64.0 } else { x + 64.0 },
                    );
                }
                let mut host_first = None;
                let host = case.count_wrong(&out, &mut host_first) as u64;
                assert_eq!(
                    host,
                    planted.len() as u64,
                    "{case:?}: the host reference does not see the planted elements"
                );
                for shift in [0, w] {
                    buf.copy_from_host(shift, &out).unwrap();
                    let ptr = (buf.device_ptr() as usize + shift) as *const u8;
                    let got = unsafe { chk.count_wrong(&case, ptr, len) }.unwrap();
                    assert_eq!(got.count, host, "{case:?} at +{shift}");
                    let ((gj, gg, gw), (hj, hg, hw)) = (got.first.unwrap(), host_first.unwrap());
                    assert!(
                        gj == hj && same(gg, hg) && same(gw, hw),
                        "{case:?}: first {:?}, host {:?}",
                        got.first,
                        host_first
                    );
                }
            }
            // A rank whose output the operation leaves alone has nothing wrong, whatever it holds.
            let idle = RankCase {
                kind: CollKind::Gather,
                dtype,
                op: ReduceOp::Sum,
                nranks: 3,
                rank: 1,
                count,
                root: 0,
                seed,
            };
            assert_eq!(
                unsafe { chk.count_wrong(&idle, buf.device_ptr() as *const u8, count) }
                    .unwrap()
                    .count,
                0
            );
        }

        // Speed on 256 MiB: a broadcast's output is the root's data, an all-reduce over one rank
        // its own input, so filling as the source and counting as the receiver finds nothing.
        let bytes = 256usize << 20;
        let buf = DeviceBuffer::alloc(gpu, bytes, &[], &stats).unwrap();
        for dtype in [
            DataType::Float32,
            DataType::Bfloat16,
            DataType::Float8E4M3,
            DataType::Int64,
        ] {
            let len = bytes / dtype.size();
            for (src, dst) in [
                (
                    RankCase {
                        kind: CollKind::Broadcast,
                        dtype,
                        op: ReduceOp::Sum,
                        nranks: 4,
                        rank: 0,
                        count: len,
                        root: 0,
                        seed: 9,
                    },
                    RankCase {
                        kind: CollKind::Broadcast,
                        dtype,
                        op: ReduceOp::Sum,
                        nranks: 4,
                        rank: 2,
                        count: len,
                        root: 0,
                        seed: 9,
                    },
                ),
                (
                    RankCase {
                        kind: CollKind::AllReduce,
                        dtype,
                        op: ReduceOp::Sum,
                        nranks: 1,
                        rank: 0,
                        count: len,
                        root: 0,
                        seed: 9,
                    },
                    RankCase {
                        kind: CollKind::AllReduce,
                        dtype,
                        op: ReduceOp::Sum,
                        nranks: 1,
                        rank: 0,
                        count: len,
                        root: 0,
                        seed: 9,
                    },
                ),
            ] {
                let ptr = buf.device_ptr() as *mut u8;
                unsafe { chk.fill(&src, ptr, len) }.unwrap();
                comm.synchronize().unwrap();
                let t = Instant::now();
                unsafe { chk.fill(&src, ptr, len) }.unwrap();
                comm.synchronize().unwrap();
                let fill = t.elapsed();
                let t = Instant::now();
                let w = unsafe { chk.count_wrong(&dst, ptr, len) }.unwrap();
                let count = t.elapsed();
                assert_eq!(w.count, 0, "{dst:?}: {w:?}");
                let gbs = |d: std::time::Duration| bytes as f64 / d.as_secs_f64() / 1e9;
                eprintln!(
                    "{dtype} {:?}: fill {fill:?} ({:.0} GB/s), count {count:?} ({:.0} GB/s)",
                    src.kind,
                    gbs(fill),
                    gbs(count)
                );
            }
        }
    }
}

/// Typed slices are host memory: a GPU communicator refuses them in every typed entry point,
/// naming run_raw, and stays usable.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn gpu_communicators_refuse_host_slices() {
    let Some(n) = gpus_for_test() else { return };
    let comms = Comm::init_devices(
        &(0..n).map(Device::Cuda).collect::<Vec<_>>(),
        &Config::default(),
    )
    .unwrap();
    let c = &comms[0];
    let (a, mut b) = (vec![1f32; 8], vec![0f32; 8 * n]);
    let refused = |e: Error| {
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("host memory") && m.contains("run_raw")),
            "{e}"
        )
    };
    refused(c.all_reduce(&a, &mut b, ReduceOp::Sum).unwrap_err());
    refused(c.all_gather(&a, &mut b).unwrap_err());
    refused(c.all_reduce_in_place(&mut b, ReduceOp::Sum).unwrap_err());
    let mut g = Group::new();
    refused(g.all_reduce(c, &a, &mut b, ReduceOp::Sum).unwrap_err());
    assert!(g.is_empty());
    assert!(c.failure().is_none());
}

/// `n` ranks on GPU 0 (one context) under `config`, with a 20 s deadline so that a hang fails
/// fast; None (skipped) unless FERROCCL_GPU_TEST=1.
fn ranks_on_one_gpu(n: usize, config: Config) -> Option<Vec<Comm>> {
    if !common::one_gpu_for_test() {
        return None;
    }
    let config = Config {
        timeout: Duration::from_secs(20),
        ..config
    };
    Some(Comm::init_devices(&vec![Device::Cuda(0); n], &config).unwrap())
}

fn two_ranks_on_one_gpu() -> Option<Vec<Comm>> {
    ranks_on_one_gpu(2, Config::default())
}

/// Runs `f(rank, comm)` on a thread per rank (the ranks of one process wait for each other
/// inside their operations) and returns what each returned, in rank order; a panic on any
/// rank fails the caller.
fn on_each_rank<T: Send>(comms: &[Comm], f: impl Fn(usize, &Comm) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| s.spawn(move || f(r, c)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Two ranks on one GPU (one context), a thread each, through thousands of new operation
/// shapes: the plan-table pool fills and is evicted again and again while the other rank's
/// kernel of the same operation is already queued, waiting for this rank. Evicting used to wait
/// for the whole context (`cuCtxSynchronize`), that is for the other rank's kernel, which waits
/// for this rank's launch: a deadlock until the deadline. Now it waits for this communicator's
/// own kernels only. Memory stays bounded (the pool is evicted, not grown) and the last
/// operation is exact. Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn ranks_sharing_a_gpu_evict_tables_without_waiting_for_each_other() {
    // The plan kernel's tables: the peer engine (which has none) off.
    let Some(comms) = ranks_on_one_gpu(
        2,
        Config {
            gpu_peer_bytes: 0,
            ..Config::default()
        },
    ) else {
        return;
    };
    // Beyond the direct engine (256 KiB per rank), so every shape has plan tables.
    let (base, shapes) = (70_000usize, 3000usize);
    let max = base + 3 * shapes;
    let t = Instant::now();
    let held: Vec<(u64, u64)> = on_each_rank(&comms, |r, c| {
        let stats = MemStats::new();
        let gpu = c.gpu().unwrap();
        let send = DeviceBuffer::alloc(gpu, max * 4, &[], &stats).unwrap();
        let recv = DeviceBuffer::alloc(gpu, max * 4, &[], &stats).unwrap();
        let host: Vec<f32> = (0..max).map(|i| ((i % 7) + r) as f32).collect();
        send.copy_from_host(0, f32_bytes(&host)).unwrap();
        c.synchronize().unwrap();
        let at_start = c.device_memory_bytes();
        let mut most = at_start;
        for k in 0..shapes {
            // SAFETY: device buffers of max >= count f32, alive past synchronize.
            unsafe {
                c.run_raw(&all_reduce_args(&send, &recv, base + 3 * k))
                    .unwrap()
            };
            most = most.max(c.device_memory_bytes());
        }
        c.synchronize().unwrap();
        let out = read_f32(&recv, base + 3 * (shapes - 1)).unwrap();
        for (i, v) in out.iter().enumerate() {
            assert_eq!(*v, (2 * (i % 7) + 1) as f32, "rank {r} element {i}");
        }
        (at_start, most)
    });
    eprintln!("{shapes} new shapes on two ranks of one GPU in {:?}; memory (at start, most) per rank: {held:?}", t.elapsed());
    for (start, most) in held {
        // The 8 MiB pool, and a slab of slack: evicted and refilled, never grown past it.
        assert!(
            most <= start + (10 << 20),
            "grew from {start} to {most} bytes"
        );
    }
}

/// Sends to oneself inside a group (an all-to-all made of sends and receives, as PyTorch and
/// nccl-tests issue it: every rank sends to and receives from every rank, itself included), two
/// ranks on one GPU: the send to oneself is a copy into the matching receive, another operation
/// of the group. It used to be resolved against the send's own (null) output: an illegal
/// address that killed the context. Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn sends_to_oneself_land_in_the_matching_receive() {
    let Some(comms) = two_ranks_on_one_gpu() else {
        return;
    };
    let n = comms.len();
    // Below and beyond the LL limit, so both protocols carry the sends to the other rank.
    for count in [1000usize, 300_000] {
        let value = |from: usize, to: usize, i: usize| (from * 1000 + to * 100 + i % 50) as f32;
        on_each_rank(&comms, |r, c| {
            let stats = MemStats::new();
            let gpu = c.gpu().unwrap();
            let send = DeviceBuffer::alloc(gpu, n * count * 4, &[], &stats).unwrap();
            let recv = DeviceBuffer::alloc(gpu, n * count * 4, &[], &stats).unwrap();
            let host: Vec<f32> = (0..n * count)
                .map(|i| value(r, i / count, i % count))
                .collect();
            send.copy_from_host(0, f32_bytes(&host)).unwrap();
            recv.copy_from_host(0, &vec![0xff; n * count * 4]).unwrap();
            let mut g = Group::new();
            for q in 0..n {
                let at = (q * count * 4) as u64;
                let base = all_reduce_args(&send, &recv, count);
                let s_args = OpArgs {
                    kind: CollKind::Send,
                    send: (send.device_ptr() + at) as *const u8,
                    recv: std::ptr::null_mut(),
                    root: q,
                    ..base
                };
                let r_args = OpArgs {
                    kind: CollKind::Recv,
                    send: std::ptr::null(),
                    recv: (recv.device_ptr() + at) as *mut u8,
                    root: q,
                    ..base
                };
                // SAFETY: device buffers of n x count f32, alive past synchronize.
                unsafe {
                    g.push_raw(c, s_args).unwrap();
                    g.push_raw(c, r_args).unwrap();
                }
            }
            g.launch().unwrap();
            c.synchronize().unwrap();
            let out = read_f32(&recv, n * count).unwrap();
            for (i, v) in out.iter().enumerate() {
                let (from, k) = (i / count, i % count);
                assert_eq!(
                    *v,
                    value(from, r, k),
                    "count {count}: rank {r} element {k} from rank {from}"
                );
            }
        });
    }
}

/// The peer engine's rounds, on 2 and 3 ranks sharing one GPU: every collective it takes
/// (broadcast and reduce on 3 ranks at every size here, by the knob; rooted ones with the last
/// rank as root), in place (NCCL's convention for each) and out of place, at sizes of one
/// round, many rounds with an odd tail, and different block counts, launched back to back in a
/// mixed order (the round
/// counters, slot parities and acknowledgements carry from one operation to the next, and
/// blocks that sit out a launch must stay in step): every element exact on every rank, and the
/// output of a reduce's non-roots untouched. The smallest slots (16 KiB) make many rounds.
/// Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn the_peer_engine_is_exact_across_kinds_sizes_and_back_to_back_launches() {
    use CollKind::*;
    for n in [2usize, 3] {
        // 16 KiB slots: blocks (64 on 2 ranks, 32 on 3) x (n - 1) peers x 4 slots; no copy engine.
        let blocks = tune::peer_blocks(&Config::default(), n);
        let cfg = Config {
            gpu_peer_bytes: (n - 1) * blocks * 4 * (16 << 10),
            gpu_copy_engine_bytes: 0,
            gpu_peer_rooted_max_bytes: usize::MAX,
            ..Config::default()
        };
        assert_eq!(tune::peer_slot_bytes(&cfg, n), 16 << 10);
        let kinds = [
            AllReduce,
            ReduceScatter,
            AllGather,
            AllToAll,
            Gather,
            Scatter,
            Broadcast,
            Reduce,
        ];
        engine_is_exact(n, &cfg, &kinds, &|_| tune::Engine::PeerKernel);
        if n == 2 {
            // The all-reduce two-shot at every size as well (one-shot by default, at every size).
            let two = Config {
                gpu_peer_oneshot_max_bytes: 0,
                ..cfg.clone()
            };
            engine_is_exact(n, &two, &[AllReduce, ReduceScatter, AllReduce], &|_| {
                tune::Engine::PeerKernel
            });
            // The one-shot in line rounds (to 16 MiB here, past the default 1 MiB) among every
            // other kind's rounds.
            let lines = Config {
                gpu_peer_lines_max_bytes: 16 << 20,
                ..cfg.clone()
            };
            engine_is_exact(n, &lines, &kinds, &|_| tune::Engine::PeerKernel);
        }
        // Staging cut for an odd number of blocks: the slots' block stride is the kernel's
        // parameter, not its largest grid (on 3 ranks the sender's index multiplies it too).
        let odd = Config {
            gpu_peer_blocks: 7,
            gpu_peer_bytes: (n - 1) * 7 * 4 * (16 << 10),
            ..cfg.clone()
        };
        assert_eq!(
            (tune::peer_blocks(&odd, n), tune::peer_slot_bytes(&odd, n)),
            (7, 16 << 10)
        );
        engine_is_exact(
            n,
            &odd,
            &[AllGather, AllReduce, Gather, ReduceScatter],
            &|_| tune::Engine::PeerKernel,
        );
        // Split launches (FERROCCL_GPU_PEER_SPLIT): every kind, mixed with two-shot
        // all-reduces (3 ranks); in-place all-to-alls and one-shot all-reduces split too, their
        // receive blocks behind their send blocks (on one rank alone, its peer out of place).
        let split = Config {
            gpu_peer_split: Some(true),
            ..cfg
        };
        engine_is_exact(n, &split, &kinds, &|_| tune::Engine::PeerKernel);
    }
}

/// A one-shot all-reduce on the peer engine folds both contributions on both ranks: Max and Min
/// must still give both the same bits where the order of the operands decides the result (a
/// +0 against a -0, two NaNs with different payloads), and so must every other reduction. The
/// two-shot (each element reduced once) is the reference. Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn the_one_shot_all_reduce_gives_both_ranks_the_same_bits() {
    let count = 100_003usize; // 400 KB: the peer engine, one-shot by default
                              // Rank r's element i: signed zeros and NaNs that differ between the ranks, and ordinary values.
    let val = |r: usize, i: usize| f32::from_bits(edge_bits(r, i));
    // The one-shot in lines (to 4 MiB here, past the default 1 MiB), staged, and the two-shot.
    for (oneshot, lines) in [(true, true), (true, false), (false, false)] {
        let cfg = Config {
            gpu_peer_oneshot_max_bytes: if oneshot { 4 << 20 } else { 0 },
            gpu_peer_lines_max_bytes: if lines { 4 << 20 } else { 0 },
            gpu_copy_engine_bytes: 0,
            ..Config::default()
        };
        let shape = f32_shape(CollKind::AllReduce, count, 2, false);
        let c = tune::choose(&shape, tune::Device::Gpu, &cfg);
        assert_eq!(
            (
                c.engine,
                c.algo == tune::Algo::OneShot,
                c.protocol == tune::Protocol::LL128
            ),
            (tune::Engine::PeerKernel, oneshot, lines),
            "{c}"
        );
        let Some(comms) = ranks_on_one_gpu(2, cfg) else {
            return;
        };
        for op in [
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Avg,
        ] {
            let outs = on_each_rank(&comms, |r, comm| {
                let stats = MemStats::new();
                let gpu = comm.gpu().unwrap();
                let send = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
                let recv = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
                let mine: Vec<f32> = (0..count).map(|i| val(r, i)).collect();
                send.copy_from_host(0, f32_bytes(&mine)).unwrap();
                let a = OpArgs {
                    op,
                    ..all_reduce_args(&send, &recv, count)
                };
                // SAFETY: device buffers of count f32, alive past synchronize.
                unsafe { comm.run_raw(&a).unwrap() };
                comm.synchronize().unwrap();
                read_f32(&recv, count)
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<u32>>()
            });
            let differ = (0..count).filter(|&i| outs[0][i] != outs[1][i]).count();
            assert_eq!(differ, 0, "{op:?} one-shot {oneshot}: {differ} elements differ between the ranks, first at {:?}",
                (0..count).find(|&i| outs[0][i] != outs[1][i]));
            // And the ordinary elements are right.
            for i in (3..count).step_by(4) {
                let (x, y) = (val(0, i), val(1, i));
                let want = match op {
                    ReduceOp::Max => x.max(y),
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Sum => x + y,
                    ReduceOp::Prod => x * y,
                    _ => (x + y) / 2.0,
                };
                assert_eq!(
                    f32::from_bits(outs[0][i]),
                    want,
                    "{op:?} one-shot {oneshot} element {i}"
                );
            }
        }
        // PreMulSum on bfloat16 with a scalar per rank (0.3, 0.7): each rank's own product is
        // rounded to bfloat16 before the sum, as its peer's stored product was, so both ranks get
        // the same bits (summed in float, the two folds differed).
        let outs = on_each_rank(&comms, |r, comm| {
            let stats = MemStats::new();
            let gpu = comm.gpu().unwrap();
            let send = DeviceBuffer::alloc(gpu, count * 2, &[], &stats).unwrap();
            let recv = DeviceBuffer::alloc(gpu, count * 2, &[], &stats).unwrap();
            // bfloat16 bits: the high half of f32 values that it holds exactly.
            let mine: Vec<u8> = (0..count)
                .flat_map(|i| {
                    let v = ((i * 37 + r * 101) % 509) as f32 * 0.0625 - 15.0;
                    ((v.to_bits() >> 16) as u16).to_le_bytes()
                })
                .collect();
            send.copy_from_host(0, &mine).unwrap();
            let a = OpArgs {
                dtype: ferroccl::DataType::Bfloat16,
                op: ReduceOp::PreMulSum(if r == 0 { 0.3 } else { 0.7 }),
                ..all_reduce_args(&send, &recv, count)
            };
            // SAFETY: device buffers of count bfloat16, alive past synchronize.
            unsafe { comm.run_raw(&a).unwrap() };
            comm.synchronize().unwrap();
            let mut out = vec![0u8; count * 2];
            recv.copy_to_host(0, &mut out).unwrap();
            out
        });
        let differ = (0..count)
            .filter(|&i| outs[0][2 * i..2 * i + 2] != outs[1][2 * i..2 * i + 2])
            .count();
        assert_eq!(
            differ, 0,
            "bfloat16 PreMulSum one-shot {oneshot} lines {lines}: {differ} elements differ between the ranks"
        );
    }
}

/// The folds' packed words (reduce.cuh: 8-bit integers four to a word, bfloat16 and half as a
/// pair, fp8 as two pairs) give the bits of folding one element at a time, on this GPU: every pair
/// of 8-bit values in every position of a word (every scalar for PreMulSum) and every pair of
/// 16-bit values in both halves of a word (six scalars for PreMulSum), for Sum, Prod, Max, Min,
/// Avg by 2, 3, 8 and 256 and PreMulSum, the fold and the transform (`tests/kernels/fold_bits.cuh`,
/// compiled with the kernels' own NVRTC options). Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn packed_folds_give_the_bits_of_one_element_at_a_time() {
    use ferroccl::cuda::{device::LaunchDims, nvrtc, Gpu};
    const HEADERS: [(&str, &str); 4] = [
        (
            "ints.cuh",
            include_str!("../src/backend/cuda/kernels/ints.cuh"),
        ),
        (
            "types.cuh",
            include_str!("../src/backend/cuda/kernels/types.cuh"),
        ),
        (
            "reduce.cuh",
            include_str!("../src/backend/cuda/kernels/reduce.cuh"),
        ),
        ("fold_bits.cuh", include_str!("kernels/fold_bits.cuh")),
    ];
    const SRC: &str = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n#include \"types.cuh\"\n#include \"fold_bits.cuh\"\n";
    if !common::one_gpu_for_test() {
        return;
    }
    // (k, pre, post, n, name): as fold_rate.cu's variants (k: the reduction's NCCL number, which
    // the kernels' FC_OP_* are).
    let k = |op: ReduceOp| op.nccl_id() as u32;
    let variants: [(u32, u32, u32, u32, &str); 9] = [
        (k(ReduceOp::Sum), 0, 0, 2, "sum"),
        (k(ReduceOp::Prod), 0, 0, 2, "prod"),
        (k(ReduceOp::Max), 0, 0, 2, "max"),
        (k(ReduceOp::Min), 0, 0, 2, "min"),
        (k(ReduceOp::Avg), 0, 1, 2, "avg/2"),
        (k(ReduceOp::Avg), 0, 1, 3, "avg/3"),
        (k(ReduceOp::Avg), 0, 1, 8, "avg/8"),
        (k(ReduceOp::Avg), 0, 1, 256, "avg/256"),
        (k(ReduceOp::PreMulSum(0.0)), 1, 0, 2, "premulsum"),
    ];
    let gpu = Gpu::open(0).unwrap();
    let dir = std::env::temp_dir().join(format!("ferroccl-fold-bits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in HEADERS {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let config = Config::default();
    let mut include_dirs = vec![dir.clone()];
    include_dirs.extend(config.cuda_include.iter().cloned());
    let options: Vec<String> = nvrtc::EXACT_OPTIONS.iter().map(|s| s.to_string()).collect();
    let arch = gpu.arch();
    let image = nvrtc::compile(&nvrtc::CompileRequest {
        name: "fold_bits.cu",
        source: SRC,
        arch: &arch,
        include_dirs: &include_dirs,
        options: &options,
    });
    std::fs::remove_dir_all(&dir).ok();
    let module = gpu.load_module(&image.unwrap().bytes).unwrap();
    let stats = MemStats::new();
    // FoldBad: count, checked (u64), then r, l, got, want, scalar bits, transform (u32).
    let bad = DeviceBuffer::alloc(&gpu, 40, &[], &stats).unwrap();
    let run = |kernel: &str,
               grid: (u32, u32, u32),
               block: u32,
               v: (u32, u32, u32, u32, &str),
               sbits: Option<u32>| {
        bad.copy_from_host(0, &[0u8; 40]).unwrap();
        let k = module.kernel(kernel).unwrap();
        let (mut kk, mut pre, mut post, mut n, mut s, mut p) =
            (v.0, v.1, v.2, v.3, sbits.unwrap_or(0), bad.device_ptr());
        let mut params: Vec<*mut std::ffi::c_void> = vec![
            &mut kk as *mut _ as *mut _,
            &mut pre as *mut _ as *mut _,
            &mut post as *mut _ as *mut _,
            &mut n as *mut _ as *mut _,
        ];
        if sbits.is_some() {
            params.push(&mut s as *mut _ as *mut _);
        }
        params.push(&mut p as *mut _ as *mut _);
        let dims = LaunchDims {
            grid,
            block: (block, 1, 1),
            shared_bytes: 0,
            overlap_prior: false,
        };
        // SAFETY: the kernel takes (u32 k, u32 pre, u32 post, u32 n[, u32 sbits], FoldBad*), and
        // `bad` holds a FoldBad, alive past the synchronize.
        unsafe { k.launch(dims, std::ptr::null_mut(), &mut params) }.unwrap();
        gpu.synchronize().unwrap();
        let mut b = [0u8; 40];
        bad.copy_to_host(0, &mut b).unwrap();
        let word = |i: usize| u32::from_le_bytes(b[16 + 4 * i..20 + 4 * i].try_into().unwrap());
        let count = u64::from_le_bytes(b[0..8].try_into().unwrap());
        let checked = u64::from_le_bytes(b[8..16].try_into().unwrap());
        assert_eq!(
            count, 0,
            "{kernel} {} scalar {sbits:?}: {count} words differ, the first {} r {:#010x} l {:#010x}: packed {:#010x}, one at a time {:#010x}",
            v.4,
            if word(5) != 0 { "transform" } else { "fold" },
            word(0),
            word(1),
            word(2),
            word(3)
        );
        checked
    };
    for t in ["int8", "uint8", "f8e4m3", "f8e5m2"] {
        for v in variants {
            let checked = run(&format!("fold_bits8_{t}"), (256, 4, 1), 256, v, None);
            assert_eq!(
                checked,
                4 * 65536 * if v.1 != 0 { 256 } else { 1 },
                "{t} {}",
                v.4
            );
        }
    }
    // 1, -0.5, 3, about 1e-3, the largest finite, the smallest subnormal.
    for (t, scalars) in [
        (
            "bfloat16",
            [0x3f80u32, 0xbf00, 0x4040, 0x3a83, 0x7f7f, 0x0001],
        ),
        ("half", [0x3c00, 0xb800, 0x4200, 0x1419, 0x7bff, 0x0001]),
    ] {
        for v in variants {
            let ss: &[u32] = if v.1 != 0 { &scalars } else { &[0] };
            for &s in ss {
                let checked = run(
                    &format!("fold_bits16_{t}"),
                    (132 * 8, 1, 1),
                    512,
                    v,
                    Some(s),
                );
                assert_eq!(checked, 2 << 32, "{t} {} scalar {s:#x}", v.4);
            }
        }
    }
}

/// Line rounds (the peer engine's one-shot all-reduce, reduce-scatter and reduce in 128-byte
/// lines, 2 ranks): every reduction (PreMulSum with a scalar per rank), in place and out, buffers
/// 16-byte aligned or not, counts that end mid-line and mid-warp, one round a block and two,
/// each all-reduce after a rooted operation's rounds (whose acknowledgements its first round
/// must wait for) and each reduce-scatter and reduce after the other (the reduce's senders wait
/// for its root's acknowledgement of every round); a reduce writes nothing on the rank that is
/// not its root; Max and Min give both ranks the same bits; int8 sums wrap exactly from odd byte
/// offsets. Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn line_rounds_are_exact_across_reductions_alignments_and_tails() {
    // Lines to 16 MiB (past the default 1 MiB): two rounds a block at the largest count, for
    // the all-reduce and the reduce-scatter (whose input holds two shares), in 64 KiB slots.
    let cfg = Config {
        gpu_copy_engine_bytes: 0,
        gpu_peer_lines_max_bytes: 16 << 20,
        gpu_peer_bytes: 16 << 20,
        ..Config::default()
    };
    let Some(comms) = ranks_on_one_gpu(2, cfg) else {
        return;
    };
    // 128 KiB + 4 (17 blocks), 1.2 MB, 8 MiB - 20 (two rounds a block), as f32.
    let counts = [32_769usize, 300_007, (1 << 21) - 5];
    let most = counts[2] + 2;
    // And PreMulSum: rank 0's scalar 2, rank 1's 3 (below).
    let premul: (ReduceOp, Fold) = (ReduceOp::PreMulSum(0.0), |a, b| a * 2.0 + b * 3.0);
    let redops: Vec<(ReduceOp, Fold)> = PAIR_FOLDS.into_iter().chain([premul]).collect();
    let outs = on_each_rank(&comms, |r, c| {
        let stats = MemStats::new();
        let gpu = c.gpu().unwrap();
        let send = DeviceBuffer::alloc(gpu, most * 4, &[], &stats).unwrap();
        let recv = DeviceBuffer::alloc(gpu, most * 4, &[], &stats).unwrap();
        let other = DeviceBuffer::alloc(gpu, most * 4, &[], &stats).unwrap();
        // A reduce-scatter's input: two shares.
        let wide = DeviceBuffer::alloc(gpu, 2 * most * 4, &[], &stats).unwrap();
        // Rank q's small integers for `tag` (exact under every reduction here).
        let small = |tag: usize, q: usize, len: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i * 31 + q * 977 + tag * 131) % 61) as f32) - 30.0)
                .collect()
        };
        let run = |a: OpArgs| {
            // SAFETY: device buffers of `most` f32, alive past synchronize.
            unsafe { c.run_raw(&a).unwrap() };
            c.synchronize().unwrap();
        };
        let mut edges_out = Vec::new();
        let mut tag = 0;
        for &count in &counts {
            let shape = f32_shape(CollKind::AllReduce, count, 2, false);
            let choice = tune::choose(&shape, tune::Device::Gpu, c.config());
            assert_eq!(
                (choice.engine, choice.protocol),
                (tune::Engine::PeerKernel, tune::Protocol::LL128),
                "{choice}"
            );
            for &(op, f) in &redops {
                let op = match op {
                    ReduceOp::PreMulSum(_) => ReduceOp::PreMulSum(r as f64 + 2.0),
                    op => op,
                };
                // Element offset 0 (aligned) and 1 (4 bytes: no 16-byte loads or stores).
                for (in_place, skip) in [(false, 0usize), (true, 0), (false, 1), (true, 1)] {
                    tag += 1;
                    // A rooted operation first: the lines' first round must look for room.
                    other
                        .copy_from_host(0, f32_bytes(&small(tag, r, count)))
                        .unwrap();
                    run(OpArgs {
                        kind: CollKind::Reduce,
                        root: tag % 2,
                        ..all_reduce_args(&other, &other, count)
                    });
                    let mine = small(tag, r, count);
                    let (input, output) = if in_place {
                        (&recv, &recv)
                    } else {
                        (&send, &recv)
                    };
                    recv.copy_from_host(0, f32_bytes(&vec![f32::from_bits(0x7fc0_0bad); most]))
                        .unwrap();
                    input.copy_from_host(skip * 4, f32_bytes(&mine)).unwrap();
                    run(OpArgs {
                        op,
                        send: (input.device_ptr() + (skip * 4) as u64) as *const u8,
                        recv: (output.device_ptr() + (skip * 4) as u64) as *mut u8,
                        ..all_reduce_args(&send, &recv, count)
                    });
                    let got = read_f32(&recv, count + skip + 1).unwrap();
                    let (a, b) = (small(tag, 0, count), small(tag, 1, count));
                    let what = format!(
                        "rank {r}, {count} x f32 {op:?}, in place {in_place}, offset {skip}"
                    );
                    for i in 0..count {
                        assert_eq!(
                            got[skip + i].to_bits(),
                            f(a[i], b[i]).to_bits(),
                            "{what}: element {i}"
                        );
                    }
                    // Nothing written past the output.
                    assert_eq!(
                        got[skip + count].to_bits(),
                        0x7fc0_0bad,
                        "{what}: past the end"
                    );
                    if skip == 1 && !in_place {
                        assert_eq!(got[0].to_bits(), 0x7fc0_0bad, "{what}: before the start");
                    }
                    // Then the reduce-scatter (the peer's share out, the own share folded) and
                    // the reduce (into the root), each after the other.
                    tag += 1;
                    let sentinel = vec![f32::from_bits(0x7fc0_0bad); 2 * most];
                    // Reduce-scatter: rank r's result is share r of the two inputs' fold; in
                    // place its output is its input's share r.
                    let shape = f32_shape(CollKind::ReduceScatter, count, 2, in_place);
                    let choice = tune::choose(&shape, tune::Device::Gpu, c.config());
                    assert_eq!(choice.protocol, tune::Protocol::LL128, "{choice}");
                    let ins: Vec<Vec<f32>> = (0..2).map(|q| small(tag, q, 2 * count)).collect();
                    wide.copy_from_host(0, f32_bytes(&sentinel)).unwrap();
                    recv.copy_from_host(0, f32_bytes(&sentinel[..most]))
                        .unwrap();
                    wide.copy_from_host(skip * 4, f32_bytes(&ins[r])).unwrap();
                    let base = wide.device_ptr() + (skip * 4) as u64;
                    let (out_buf, out_at) = if in_place {
                        (&wide, skip + r * count)
                    } else {
                        (&recv, skip)
                    };
                    run(OpArgs {
                        kind: CollKind::ReduceScatter,
                        op,
                        send: base as *const u8,
                        recv: (out_buf.device_ptr() + (out_at * 4) as u64) as *mut u8,
                        ..all_reduce_args(&send, &recv, count)
                    });
                    let got = read_f32(out_buf, out_at + count + 1).unwrap();
                    let what =
                        format!("rank {r}, reduce-scatter of {count} x f32 {op:?}, in place {in_place}, offset {skip}");
                    for i in 0..count {
                        let j = r * count + i;
                        assert_eq!(
                            got[out_at + i].to_bits(),
                            f(ins[0][j], ins[1][j]).to_bits(),
                            "{what}: element {i}"
                        );
                    }
                    // Past the output: the sentinel, or in place on rank 0 share 1 of its input,
                    // which it sent and must not have changed.
                    let after = if in_place && r == 0 {
                        ins[0][count]
                    } else {
                        f32::from_bits(0x7fc0_0bad)
                    };
                    assert_eq!(
                        got[out_at + count].to_bits(),
                        after.to_bits(),
                        "{what}: past the end"
                    );
                    // Reduce into root tag % 2, out of place on the other rank's unused output
                    // too: it must stay as it was.
                    let root = tag % 2;
                    // (Smaller reduces take the split rounds: the same bits either way.)
                    let shape = f32_shape(CollKind::Reduce, count, 2, in_place);
                    let choice = tune::choose(&shape, tune::Device::Gpu, c.config());
                    assert_eq!(
                        choice.protocol == tune::Protocol::LL128,
                        count * 4 >= tune::PEER_LINES_REDUCE_MIN_BYTES,
                        "{choice}"
                    );
                    let mine = small(tag + 7, r, count);
                    let (input, output) = if in_place {
                        (&recv, &recv)
                    } else {
                        (&send, &recv)
                    };
                    recv.copy_from_host(0, f32_bytes(&sentinel[..most]))
                        .unwrap();
                    input.copy_from_host(skip * 4, f32_bytes(&mine)).unwrap();
                    run(OpArgs {
                        kind: CollKind::Reduce,
                        op,
                        root,
                        send: (input.device_ptr() + (skip * 4) as u64) as *const u8,
                        recv: (output.device_ptr() + (skip * 4) as u64) as *mut u8,
                        ..all_reduce_args(&send, &recv, count)
                    });
                    let got = read_f32(&recv, count + skip + 1).unwrap();
                    let (a, b) = (small(tag + 7, 0, count), small(tag + 7, 1, count));
                    let what = format!(
                        "rank {r}, reduce to {root} of {count} x f32 {op:?}, in place {in_place}, offset {skip}"
                    );
                    for i in 0..count {
                        let want = if r == root {
                            f(a[i], b[i])
                        } else if in_place {
                            mine[i]
                        } else {
                            f32::from_bits(0x7fc0_0bad)
                        };
                        assert_eq!(
                            got[skip + i].to_bits(),
                            want.to_bits(),
                            "{what}: element {i}"
                        );
                    }
                    assert_eq!(
                        got[skip + count].to_bits(),
                        0x7fc0_0bad,
                        "{what}: past the end"
                    );
                }
            }
            // Max and Min over signed zeros and NaN payloads that differ by rank.
            let edges: Vec<f32> = (0..count)
                .map(|i| f32::from_bits(edge_bits(r, i)))
                .collect();
            for op in [ReduceOp::Max, ReduceOp::Min] {
                send.copy_from_host(0, f32_bytes(&edges)).unwrap();
                run(OpArgs {
                    op,
                    ..all_reduce_args(&send, &recv, count)
                });
                edges_out.push(
                    read_f32(&recv, count)
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<u32>>(),
                );
            }
            // int8 sums from an odd byte offset, wrapping.
            let bytes: Vec<i8> = (0..count)
                .map(|i| ((i * 37 + r * 101) % 256) as u8 as i8)
                .collect();
            // SAFETY: i8 as bytes.
            let raw = unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const u8, count) };
            send.copy_from_host(3, raw).unwrap();
            run(OpArgs {
                dtype: ferroccl::DataType::Int8,
                send: (send.device_ptr() + 3) as *const u8,
                recv: (recv.device_ptr() + 5) as *mut u8,
                ..all_reduce_args(&send, &recv, count)
            });
            let mut back = vec![0u8; count];
            recv.copy_to_host(5, &mut back).unwrap();
            for (i, &v) in back.iter().enumerate() {
                let want = (((i * 37) % 256) as u8).wrapping_add(((i * 37 + 101) % 256) as u8);
                assert_eq!(v, want, "rank {r}, {count} x int8 sum: element {i}");
            }
        }
        edges_out
    });
    assert_eq!(outs[0].len(), outs[1].len());
    for (k, (a, b)) in outs[0].iter().zip(&outs[1]).enumerate() {
        let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert_eq!(
            differ, 0,
            "edge case {k}: {differ} elements differ between the ranks"
        );
    }
}

/// The copy engine, the same way: every kind it takes on 2 and 3 ranks, in place and out, one
/// piece, many pieces with a tail, on its smallest slots (512 KiB), its operations between the
/// peer engine's (which shares its staging) in the order the kinds come. Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn the_copy_engine_is_exact_across_kinds_sizes_and_back_to_back_launches() {
    use CollKind::*;
    for n in [2usize, 3] {
        // 32 blocks: 16 KiB peer slots, so that a sender's region (2 MiB) makes 512 KiB pieces.
        let cfg = Config {
            gpu_peer_bytes: (n - 1) * (2 << 20),
            gpu_peer_blocks: 32,
            gpu_copy_engine_bytes: 1,
            ..Config::default()
        };
        assert_eq!(tune::ce_slot_bytes(&cfg, n), 512 << 10);
        let mut kinds = vec![
            AllReduce,
            AllGather,
            ReduceScatter,
            AllToAll,
            Gather,
            Scatter,
        ];
        if n == 2 {
            kinds.extend([Broadcast, Reduce]);
        }
        let engine = move |k| {
            if ferroccl_core::plan::copies::serves(k, n) {
                tune::Engine::CopyEngine
            } else {
                tune::Engine::PeerKernel
            }
        };
        engine_is_exact(n, &cfg, &kinds, &engine);
    }
}

/// Every rank of `n` on one GPU runs every kind of `kinds` at three sizes, in place and out and
/// with rank 0 alone in place, and checks every element; the tuner must give each to `engine`.
fn engine_is_exact(
    n: usize,
    cfg: &Config,
    kinds: &[CollKind],
    engine: &(dyn Fn(CollKind) -> tune::Engine + Sync),
) {
    use CollKind::*;
    let Some(comms) = ranks_on_one_gpu(n, cfg.clone()) else {
        return;
    };
    // Per-rank counts: one round of one block, many rounds with a tail, a different grid.
    let counts = [70_001usize, (3 << 20) + 17, 300_003];
    let max = n * counts.iter().max().unwrap();
    let t = n - 1;
    on_each_rank(&comms, |r, c| {
        let stats = MemStats::new();
        let gpu = c.gpu().unwrap();
        let send = DeviceBuffer::alloc(gpu, max * 4, &[], &stats).unwrap();
        let recv = DeviceBuffer::alloc(gpu, max * 4, &[], &stats).unwrap();
        // Exact in f32: small integers, different per rank, element and step.
        let val = |q: usize, i: usize, step: usize| ((i * 7 + q * 131 + step * 17) % 2039) as f32;
        let poison = f32::from_bits(0x7fc0_dead);
        let mut step = 0;
        for &count in &counts {
            for &kind in kinds {
                // Out of place, in place, and rank 0 alone in place: a rank's in-place-ness is
                // its own, and every rank must still choose and cut its rounds as its peers do.
                for mode in 0..3 {
                    let in_place = match mode {
                        0 => false,
                        1 => true,
                        _ => r == 0,
                    };
                    step += 1;
                    // Elements of this rank's input and output.
                    let (sc, rc) = match kind {
                        AllReduce | Broadcast | Reduce => (count, count),
                        ReduceScatter => (n * count, count),
                        AllGather => (count, n * count),
                        AllToAll => (n * count, n * count),
                        Gather => (count, if r == t { n * count } else { 0 }),
                        _ => (if r == t { n * count } else { 0 }, count),
                    };
                    let mine: Vec<f32> = (0..sc).map(|i| val(r, i, step)).collect();
                    // The output starts poisoned; in place, the input lies inside it
                    // where NCCL's convention puts it (the larger buffer holds both).
                    let whole = sc.max(rc);
                    recv.copy_from_host(0, f32_bytes(&vec![poison; whole]))
                        .unwrap();
                    let (sp, rp, out_at) = if in_place {
                        let (in_at, out_at) = match kind {
                            AllGather => (r * count, 0),
                            Gather if r == t => (r * count, 0),
                            ReduceScatter => (0, r * count),
                            Scatter if r == t => (0, r * count),
                            _ => (0, 0),
                        };
                        recv.copy_from_host(in_at * 4, f32_bytes(&mine)).unwrap();
                        (
                            recv.device_ptr() + (in_at * 4) as u64,
                            recv.device_ptr() + (out_at * 4) as u64,
                            out_at,
                        )
                    } else {
                        send.copy_from_host(0, f32_bytes(&mine)).unwrap();
                        (send.device_ptr(), recv.device_ptr(), 0)
                    };
                    let a = OpArgs {
                        kind,
                        send: sp as *const u8,
                        recv: rp as *mut u8,
                        count,
                        root: t,
                        ..all_reduce_args(&send, &recv, count)
                    };
                    // SAFETY: device buffers of max >= every count used, alive past synchronize.
                    unsafe { c.run_raw(&a).unwrap() };
                    c.synchronize().unwrap();
                    // The peer engine ran it, on the tuner's grid.
                    let shape = f32_shape(kind, count, n, in_place);
                    let choice = tune::choose(&shape, tune::Device::Gpu, cfg);
                    assert_eq!(choice.engine, engine(kind), "{choice}");
                    assert_eq!(c.last_launch_blocks(), Some(choice.channels as u32));
                    let got = read_f32(&recv, whole).unwrap();
                    let what = format!(
                        "{n} ranks, {kind} of {count} (in place {in_place}, mode {mode}): rank {r}"
                    );
                    if kind == Reduce && r != t {
                        // A non-root's output is not written (in place it is its input).
                        let want: Vec<f32> = if in_place {
                            mine.clone()
                        } else {
                            vec![poison; whole]
                        };
                        assert!(
                            got.iter()
                                .zip(&want)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{what}: a non-root's output changed"
                        );
                        continue;
                    }
                    for i in 0..rc {
                        let want = match kind {
                            AllReduce | Reduce => (0..n).map(|q| val(q, i, step)).sum::<f32>(),
                            ReduceScatter => {
                                (0..n).map(|q| val(q, r * count + i, step)).sum::<f32>()
                            }
                            AllGather | Gather => val(i / count, i % count, step),
                            AllToAll => val(i / count, r * count + i % count, step),
                            Broadcast => val(t, i, step),
                            _ => val(t, r * count + i, step),
                        };
                        assert_eq!(got[out_at + i], want, "{what} element {i}");
                    }
                }
            }
        }
    });
}

/// The copy engine inside CUDA graphs: two ranks on one GPU each capture an all-gather and an
/// all-to-all in place (many pieces each), then replay the graph three times on fresh inputs:
/// every replay exact, so the handshake words are back where they started after each (the
/// replays run the very commands captured). Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn the_copy_engine_replays_in_cuda_graphs() {
    let n = 2;
    let cfg = Config {
        gpu_peer_bytes: 2 << 20,
        gpu_peer_blocks: 32,
        gpu_copy_engine_bytes: 1,
        ..Config::default()
    };
    let Some(comms) = ranks_on_one_gpu(n, cfg) else {
        return;
    };
    let count = (3 << 20) + 5; // 12 MiB a block: 24 pieces of 512 KiB
    let val = |q: usize, i: usize, rep: usize| ((i * 5 + q * 977 + rep * 31) % 4093) as f32;
    on_each_rank(&comms, |r, c| {
        let stats = MemStats::new();
        let gpu = c.gpu().unwrap();
        let send = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
        let gathered = DeviceBuffer::alloc(gpu, n * count * 4, &[], &stats).unwrap();
        let a2a = DeviceBuffer::alloc(gpu, n * count * 4, &[], &stats).unwrap();
        let ag = OpArgs {
            kind: CollKind::AllGather,
            ..all_reduce_args(&send, &gathered, count)
        };
        let at = OpArgs {
            kind: CollKind::AllToAll,
            ..all_reduce_args(&a2a, &a2a, count)
        };
        let stream = c.cuda_stream() as sys::CUstream;
        gpu.bind().unwrap();
        let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: buffers alive past every replay's synchronize; our stream.
        unsafe {
            cu_ok(
                "cuStreamBeginCapture",
                sys::cuStreamBeginCapture_v2(
                    stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
            )
            .unwrap();
            c.run_raw(&ag).unwrap();
            c.run_raw(&at).unwrap();
            cu_ok(
                "cuStreamEndCapture",
                sys::cuStreamEndCapture(stream, &mut graph),
            )
            .unwrap();
            cu_ok(
                "cuGraphInstantiate",
                sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
            )
            .unwrap();
        }
        assert_eq!(c.last_launch_blocks(), Some(0), "no thread block");
        for rep in 0..3 {
            let mine: Vec<f32> = (0..count).map(|i| val(r, i, rep)).collect();
            send.copy_from_host(0, f32_bytes(&mine)).unwrap();
            let blocks: Vec<f32> = (0..n * count).map(|i| val(r, i, rep + 10)).collect();
            a2a.copy_from_host(0, f32_bytes(&blocks)).unwrap();
            gpu.bind().unwrap();
            // SAFETY: as above.
            unsafe { cu_ok("cuGraphLaunch", sys::cuGraphLaunch(exec, stream)).unwrap() };
            c.synchronize().unwrap();
            let g = read_f32(&gathered, n * count).unwrap();
            let t = read_f32(&a2a, n * count).unwrap();
            for i in 0..n * count {
                assert_eq!(
                    g[i],
                    val(i / count, i % count, rep),
                    "rank {r} replay {rep}: all-gather element {i}"
                );
                assert_eq!(
                    t[i],
                    val(i / count, r * count + i % count, rep + 10),
                    "rank {r} replay {rep}: all-to-all element {i}"
                );
            }
        }
        // SAFETY: ours, no replay in flight.
        unsafe {
            sys::cuGraphExecDestroy(exec);
            sys::cuGraphDestroy(graph);
        }
    });
}

/// One communicator's operations on two streams run one after the other, as NCCL runs them:
/// two ranks on one GPU each enqueue an all-gather on one stream and at once an all-reduce on
/// another (both on the peer engine, which shares its staging between them), three times over,
/// with no wait between; every element of every output is right. Without the ordering the two
/// kernels of a rank run together on the same staging. Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn operations_on_two_streams_run_in_call_order() {
    let n = 2;
    let Some(comms) = ranks_on_one_gpu(n, Config::default()) else {
        return;
    };
    let count = (1 << 20) + 3; // 4 MiB a rank: many rounds of the peer engine
    let val = |q: usize, i: usize, rep: usize| ((i * 3 + q * 101 + rep * 7) % 1021) as f32;
    on_each_rank(&comms, |r, c| {
        let stats = MemStats::new();
        let gpu = c.gpu().unwrap();
        gpu.bind().unwrap();
        let mut streams = [std::ptr::null_mut(); 2];
        for st in &mut streams {
            // SAFETY: an out pointer for a new stream of the bound context.
            unsafe { cu_ok("cuStreamCreate", sys::cuStreamCreate(st, 1)).unwrap() };
        }
        let reps = 3;
        let ins: Vec<DeviceBuffer> = (0..reps)
            .map(|_| DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap())
            .collect();
        let gathered: Vec<DeviceBuffer> = (0..reps)
            .map(|_| DeviceBuffer::alloc(gpu, n * count * 4, &[], &stats).unwrap())
            .collect();
        let reduced: Vec<DeviceBuffer> = (0..reps)
            .map(|_| DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap())
            .collect();
        for rep in 0..reps {
            let mine: Vec<f32> = (0..count).map(|i| val(r, i, rep)).collect();
            ins[rep].copy_from_host(0, f32_bytes(&mine)).unwrap();
        }
        for rep in 0..reps {
            // SAFETY: our streams; buffers alive past the synchronizations below.
            unsafe {
                c.set_stream(streams[0] as _);
                c.run_raw(&OpArgs {
                    kind: CollKind::AllGather,
                    ..all_reduce_args(&ins[rep], &gathered[rep], count)
                })
                .unwrap();
                c.set_stream(streams[1] as _);
                c.run_raw(&all_reduce_args(&ins[rep], &reduced[rep], count))
                    .unwrap();
            }
        }
        gpu.bind().unwrap();
        for &st in &streams {
            // SAFETY: our live streams.
            unsafe { cu_ok("cuStreamSynchronize", sys::cuStreamSynchronize(st)).unwrap() };
        }
        for rep in 0..reps {
            let g = read_f32(&gathered[rep], n * count).unwrap();
            let a = read_f32(&reduced[rep], count).unwrap();
            for i in 0..n * count {
                assert_eq!(
                    g[i],
                    val(i / count, i % count, rep),
                    "rank {r} rep {rep}: all-gather element {i}"
                );
            }
            for i in 0..count {
                assert_eq!(
                    a[i],
                    (0..n).map(|q| val(q, i, rep)).sum::<f32>(),
                    "rank {r} rep {rep}: all-reduce element {i}"
                );
            }
        }
        // SAFETY: back to the communicator's own stream before ours go.
        unsafe { c.set_stream(std::ptr::null_mut()) };
        for &st in &streams {
            // SAFETY: ours, idle.
            unsafe { sys::cuStreamDestroy_v2(st) };
        }
    });
}

/// A rank's first launch does not wait for another rank's kernel on the same GPU: rank 0
/// launches a peer-engine all-reduce, which spins until rank 1 joins; rank 1 joins 300 ms later
/// with its first launch of that kernel. Anything on that launch path that waits for the
/// context (an allocation, a lazy kernel load: CUDA loads kernels at their first launch by
/// default, and says such a load may synchronize the context) would wait for rank 0's kernel,
/// which waits for rank 1: a deadlock until the deadline (5 s here). The kernels are loaded at
/// creation (`Kernel::load`). On driver 580 a lazy load did not wait (exp27: the same test
/// with the loads switched off passed too), so this guards the launch path as a whole.
/// Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn a_first_launch_does_not_wait_for_a_spinning_kernel_of_the_same_gpu() {
    if !common::one_gpu_for_test() {
        return;
    }
    // The kernels' compile (NVRTC, first run on a machine) would outlast a short deadline.
    drop(Comm::init_devices(&[Device::Cuda(0), Device::Cuda(0)], &Config::default()).unwrap());
    let cfg = Config {
        timeout: Duration::from_secs(5),
        ..Config::default()
    };
    let comms = Comm::init_devices(&[Device::Cuda(0), Device::Cuda(0)], &cfg).unwrap();
    let count = 1 << 20;
    let shape = f32_shape(CollKind::AllReduce, count, 2, false);
    assert_eq!(
        tune::choose(&shape, tune::Device::Gpu, &cfg).engine,
        tune::Engine::PeerKernel
    );
    let t = Instant::now();
    let took: Vec<(Duration, Duration)> = on_each_rank(&comms, |r, c| {
        let stats = MemStats::new();
        let gpu = c.gpu().unwrap();
        let send = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
        let recv = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
        send.copy_from_host(0, f32_bytes(&vec![(r + 1) as f32; count]))
            .unwrap();
        if r == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        let t0 = Instant::now();
        // SAFETY: device buffers of count f32, alive past synchronize.
        unsafe { c.run_raw(&all_reduce_args(&send, &recv, count)).unwrap() };
        let launched = t0.elapsed();
        c.synchronize().unwrap();
        assert!(
            read_f32(&recv, count).unwrap().iter().all(|&v| v == 3.0),
            "rank {r}"
        );
        (launched, t0.elapsed())
    });
    eprintln!(
        "launch, launch to done, per rank: {took:?}; all done after {:?}",
        t.elapsed()
    );
    assert!(
        took[1].0 < Duration::from_millis(500),
        "rank 1's launch waited {:?}",
        took[1].0
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

/// The copy engine's waits end at an abort: two ranks on one GPU, only rank 0 enqueues a 4 MiB
/// all-gather (the copy engine: its send lanes wait for rank 1's `ready`, which never comes);
/// an abort from another thread frees them (CPU stores into the host page they wait on), the
/// synchronize reports the abort within a second and a half, and the communicator refuses
/// later calls. Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn the_copy_engine_is_freed_by_an_abort() {
    let count = 1 << 20;
    let config = Config {
        gpu_copy_engine_bytes: 1,
        ..Config::default()
    };
    let shape = f32_shape(CollKind::AllGather, count, 2, false);
    assert_eq!(
        tune::choose(&shape, tune::Device::Gpu, &config).engine,
        tune::Engine::CopyEngine
    );
    let Some(comms) = ranks_on_one_gpu(2, config) else {
        return;
    };
    let c = &comms[0];
    let stats = MemStats::new();
    let gpu = c.gpu().unwrap();
    let send = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
    let recv = DeviceBuffer::alloc(gpu, 2 * count * 4, &[], &stats).unwrap();
    let a = OpArgs {
        kind: CollKind::AllGather,
        ..all_reduce_args(&send, &recv, count)
    };
    // SAFETY: device buffers of the sizes an all-gather of `count` needs, alive past synchronize.
    unsafe { c.run_raw(&a).unwrap() };
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    c.abort();
    let e = c.synchronize().unwrap_err();
    let took = t.elapsed();
    eprintln!("copy engine: failed {took:?} after the abort: {e}");
    assert!(matches!(e, Error::Aborted(_)), "{e}");
    assert!(took < Duration::from_millis(1500), "{took:?}");
    // SAFETY: as above.
    assert!(
        unsafe { c.run_raw(&a) }.is_err(),
        "an aborted communicator refuses calls"
    );
    drop(comms);
}

/// The peer engine's waits end: two ranks on one GPU, only rank 0 launches a 4 MiB all-reduce
/// (the peer engine: it waits for rank 1's flags, which never come). With a 2 s deadline its
/// synchronize fails with a timeout naming rank 1 within seconds, and the communicator refuses
/// later calls; on a second pair, an abort from another thread ends the same wait at once.
/// Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn the_peer_engine_gives_up_on_a_silent_peer() {
    if !common::one_gpu_for_test() {
        return;
    }
    let count = 1 << 20; // 4 MiB of f32: beyond the direct engine
                         // The kernels' compile (NVRTC, first run on a machine) outlasts a 2 s deadline at init:
                         // one communicator with the default deadline fills the disk cache first.
    drop(Comm::init_devices(&[Device::Cuda(0), Device::Cuda(0)], &Config::default()).unwrap());
    let config = Config {
        timeout: Duration::from_secs(2),
        ..Config::default()
    };
    let shape = f32_shape(CollKind::AllReduce, count, 2, false);
    assert_eq!(
        tune::choose(&shape, tune::Device::Gpu, &config).engine,
        tune::Engine::PeerKernel
    );
    for abort in [false, true] {
        let comms = Comm::init_devices(&[Device::Cuda(0), Device::Cuda(0)], &config).unwrap();
        let c = &comms[0];
        let stats = MemStats::new();
        let gpu = c.gpu().unwrap();
        let send = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
        let recv = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
        // SAFETY: device buffers of count f32, alive past synchronize.
        unsafe { c.run_raw(&all_reduce_args(&send, &recv, count)).unwrap() };
        let t = Instant::now();
        let e = std::thread::scope(|s| {
            if abort {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    c.abort();
                });
            }
            c.synchronize().unwrap_err()
        });
        let took = t.elapsed();
        eprintln!("abort {abort}: failed after {took:?}: {e}");
        if abort {
            assert!(matches!(e, Error::Aborted(_)), "{e}");
            assert!(took < Duration::from_millis(1500), "{took:?}");
        } else {
            assert!(matches!(e, Error::Timeout(_)), "{e}");
            assert!(e.to_string().contains("rank 1"), "{e}");
            // The first round's flag, never raised: what the wait was for and what it saw.
            assert!(
                e.to_string().contains("for flag value 1; it was at 0"),
                "{e}"
            );
            assert!(
                took >= Duration::from_millis(1500) && took < Duration::from_secs(10),
                "{took:?}"
            );
        }
        // SAFETY: as above.
        assert!(
            unsafe { c.run_raw(&all_reduce_args(&send, &recv, count)) }.is_err(),
            "a failed communicator refuses calls"
        );
        drop(comms);
    }
}

/// A launch that starts early (programmatic dependent launch, the engines' default on compute
/// capability 9.0 and up) still sees what the kernel ahead of it wrote: on each rank's stream a
/// producer, itself launched to start early, lets the next launch start at once
/// (`griddepcontrol.launch_dependents` first thing), spins for 200 us and only then writes the
/// input; the all-reduce behind it (the direct engine at 8 KiB, the peer engine at 4 MiB) must
/// reduce the new values. Were an engine's kernel not to wait (`griddepcontrol.wait`) before
/// its first load, it would read the old ones. Two ranks on one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn an_early_started_operation_waits_for_the_kernel_ahead() {
    use ferroccl::cuda::{device::LaunchDims, nvrtc};
    const SRC: &str = "extern \"C\" __global__ void produce(float* x, unsigned long long n, float v, unsigned long long spin_ns) {\n\
        asm volatile(\"griddepcontrol.launch_dependents;\" ::: \"memory\");\n\
        unsigned long long t0, t;\n\
        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t0));\n\
        do { asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); } while (t - t0 < spin_ns);\n\
        for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = v;\n\
    }\n";
    let Some(comms) = two_ranks_on_one_gpu() else {
        return;
    };
    let gpu = comms[0].gpu().unwrap();
    if gpu.compute_capability() < (9, 0) {
        eprintln!(
            "skipped: early launch needs compute capability 9.0 (this GPU: {:?})",
            gpu.compute_capability()
        );
        return;
    }
    let config = Config::default();
    assert!(config.gpu_early_launch, "early launch is the default");
    let arch = gpu.arch();
    let req = nvrtc::CompileRequest {
        name: "produce.cu",
        source: SRC,
        arch: &arch,
        include_dirs: &config.cuda_include,
        options: &[],
    };
    let image = nvrtc::compile(&req).unwrap();
    let module = gpu.load_module(&image.bytes).unwrap();
    for (count, engine) in [
        (2048usize, tune::Engine::DirectKernel),
        (1 << 20, tune::Engine::PeerKernel),
    ] {
        let shape = f32_shape(CollKind::AllReduce, count, 2, false);
        assert_eq!(
            tune::choose(&shape, tune::Device::Gpu, &config).engine,
            engine
        );
        on_each_rank(&comms, |r, c| {
            let stats = MemStats::new();
            let send = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
            let recv = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
            send.copy_from_host(0, f32_bytes(&vec![(r + 1) as f32; count]))
                .unwrap();
            let stream = c.cuda_stream() as sys::CUstream;
            for round in 0..3u32 {
                let k = module.kernel("produce").unwrap();
                let (mut x, mut n, mut v, mut spin) = (
                    send.device_ptr(),
                    count as u64,
                    (10 * (r + 1)) as f32 + round as f32,
                    200_000u64,
                );
                let mut params = [
                    &mut x as *mut _ as *mut std::ffi::c_void,
                    &mut n as *mut _ as *mut std::ffi::c_void,
                    &mut v as *mut _ as *mut std::ffi::c_void,
                    &mut spin as *mut _ as *mut std::ffi::c_void,
                ];
                let dims = LaunchDims {
                    grid: (8, 1, 1),
                    block: (256, 1, 1),
                    shared_bytes: 0,
                    overlap_prior: true,
                };
                // SAFETY: produce(float*, u64, float, u64) with a device buffer of `count` f32.
                unsafe { k.launch(dims, stream, &mut params) }.unwrap();
                // SAFETY: device buffers of count f32, alive past synchronize.
                unsafe { c.run_raw(&all_reduce_args(&send, &recv, count)).unwrap() };
                c.synchronize().unwrap();
                let want = 30.0 + 2.0 * round as f32;
                let got = read_f32(&recv, count).unwrap();
                let wrong = got.iter().filter(|&&g| g != want).count();
                assert_eq!(wrong, 0, "{engine:?}, rank {r}, round {round}: {wrong} of {count} elements wrong (first {}, want {want})", got[0]);
            }
        });
    }
}

/// The plan kernel's point-to-point form and the plan kernel itself at the two ends of the same
/// connections: three processes on one GPU in a ring, rank 1 with the form off
/// (`FERROCCL_GPU_P2P_KERNEL=0`), the others with it on, through hundreds of launches of sends
/// and receives (small LL messages that the form takes, larger simple-protocol ones that stay
/// on the plan kernel, groups with two messages per connection), with 1 KiB slots so that
/// messages span several slots and wrap the FIFO, and element sizes 8, 2 and 1 with odd counts
/// (whole elements per piece), every fifth launch with a send to oneself too (a copy in the
/// same launch). Every byte exact, nothing written past a message. Then a CUDA graph of such
/// launches, replayed. Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn the_point_to_point_form_and_the_plan_kernel_share_connections() {
    if role().is_some() || !common::one_gpu_for_test() {
        return;
    }
    let n = 3usize;
    let port = common::launch::free_port();
    let kids: Vec<_> = (0..n)
        .map(|r| {
            let env = [
                ("LOCAL_RANK", "0".to_string()),
                (
                    "FERROCCL_GPU_P2P_KERNEL",
                    if r == 1 { "0" } else { "1" }.to_string(),
                ),
                ("FERROCCL_SLOT_BYTES", "1024".to_string()),
                ("FERROCCL_CHUNK_BYTES", "2048".to_string()),
                ("FERROCCL_GPU_CHANNEL_BYTES", (1 << 20).to_string()),
                ("FERROCCL_TIMEOUT", "20".to_string()),
                ("CUDA_DEVICE_MAX_CONNECTIONS", "32".to_string()),
            ];
            common::launch::rank_command("child_p2p_mix", "p2p-mix", r, n, port, &env)
                .spawn()
                .unwrap()
        })
        .collect();
    assert_all_print(kids, "P2P MIX OK");
}

/// Child of the test above: one rank of the ring.
#[test]
fn child_p2p_mix() {
    use ferroccl::DataType;
    if role().as_deref() != Some("p2p-mix") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env_gpu(&cfg).unwrap();
    let (n, r) = (comm.nranks(), comm.rank());
    let (iters, most) = (240usize, 1500usize);
    let dtypes = [DataType::Int64, DataType::Float16, DataType::Uint8];
    // What rank `from` sends in launch k, byte i; and how many elements.
    let byte = |k: usize, from: usize, i: usize| ((k * 31 + from * 7 + i * 13) % 251) as u8;
    let count = |k: usize, from: usize| 1 + (k * 37 + from * 11) % most;
    let gpu = comm.gpu().unwrap().clone();
    let stats = MemStats::new();
    let cap = most * 8 + 64;
    let send = DeviceBuffer::alloc(&gpu, cap, &[], &stats).unwrap();
    let recv = DeviceBuffer::alloc(&gpu, cap, &[], &stats).unwrap();
    let own = DeviceBuffer::alloc(&gpu, cap, &[], &stats).unwrap();
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let p2p = |kind, buf: &DeviceBuffer, at: usize, cnt: usize, dtype, peer| {
        let p = buf.device_ptr() + at as u64;
        OpArgs {
            kind,
            send: p as *const u8,
            recv: p as *mut u8,
            count: cnt,
            dtype,
            op: ReduceOp::Sum,
            root: peer,
            device_scalar: None,
        }
    };
    let mut out = vec![0u8; cap];
    for k in 0..iters {
        let dtype = dtypes[k % dtypes.len()];
        let es = dtype.size();
        let (cs, cr) = (count(k, r), count(k, prev));
        let host: Vec<u8> = (0..cs * es).map(|i| byte(k, r, i)).collect();
        send.copy_from_host(0, &host).unwrap();
        recv.copy_from_host(0, &vec![0xee; cap]).unwrap();
        own.copy_from_host(0, &vec![0xee; cap]).unwrap();
        let to_self = k % 5 == 4;
        let mut g = Group::new();
        // Every fourth launch splits each message in two: two steps per connection.
        let halves = |c: usize| {
            if k % 4 == 3 && c > 1 {
                vec![(0, c / 2), (c / 2, c - c / 2)]
            } else {
                vec![(0, c)]
            }
        };
        // SAFETY: device buffers of `cap` bytes, alive past synchronize.
        unsafe {
            for (at, c) in halves(cs) {
                g.push_raw(&comm, p2p(CollKind::Send, &send, at * es, c, dtype, next))
                    .unwrap();
            }
            for (at, c) in halves(cr) {
                g.push_raw(&comm, p2p(CollKind::Recv, &recv, at * es, c, dtype, prev))
                    .unwrap();
            }
            if to_self {
                g.push_raw(&comm, p2p(CollKind::Send, &send, 0, cs, dtype, r))
                    .unwrap();
                g.push_raw(&comm, p2p(CollKind::Recv, &own, 0, cs, dtype, r))
                    .unwrap();
            }
        }
        g.launch().unwrap();
        comm.synchronize().unwrap_or_else(|e| {
            panic!(
                "launch {k} ({dtype}, send {cs} receive {cr}, to itself {to_self}): rank {r}: {e}"
            )
        });
        recv.copy_to_host(0, &mut out).unwrap();
        for (i, b) in out.iter().enumerate() {
            let want = if i < cr * es { byte(k, prev, i) } else { 0xee };
            assert_eq!(
                *b, want,
                "launch {k} ({dtype}, {cr} elements): rank {r} byte {i}"
            );
        }
        own.copy_to_host(0, &mut out).unwrap();
        for (i, b) in out.iter().enumerate() {
            let want = if to_self && i < cs * es {
                byte(k, r, i)
            } else {
                0xee
            };
            assert_eq!(
                *b, want,
                "launch {k} ({dtype}, {cs} elements to itself): rank {r} byte {i}"
            );
        }
    }

    // The same kinds of launches captured in a graph, replayed: the counters move on from
    // replay to replay.
    let dtype = DataType::Int64;
    let c = 300usize; // 2400 bytes: LL, three 1 KiB pieces
    let host: Vec<u8> = (0..c * 8).map(|i| byte(1000, r, i)).collect();
    send.copy_from_host(0, &host).unwrap();
    let stream = comm.cuda_stream() as sys::CUstream;
    gpu.bind().unwrap();
    let mut exec = std::ptr::null_mut();
    // SAFETY: our stream, captured by this thread only; the graph is replayed and destroyed
    // before the buffers go.
    unsafe {
        cu_ok(
            "cuStreamBeginCapture",
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            ),
        )
        .unwrap();
        for _ in 0..3 {
            let mut g = Group::new();
            g.push_raw(&comm, p2p(CollKind::Send, &send, 0, c, dtype, next))
                .unwrap();
            g.push_raw(&comm, p2p(CollKind::Recv, &recv, 0, c, dtype, prev))
                .unwrap();
            g.launch().unwrap();
        }
        let mut graph = std::ptr::null_mut();
        cu_ok(
            "cuStreamEndCapture",
            sys::cuStreamEndCapture(stream, &mut graph),
        )
        .unwrap();
        cu_ok(
            "cuGraphInstantiate",
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
        )
        .unwrap();
        sys::cuGraphDestroy(graph);
    }
    for replay in 0..5 {
        recv.copy_from_host(0, &vec![0xee; cap]).unwrap();
        // SAFETY: the graph made above, on our stream.
        unsafe { cu_ok("cuGraphLaunch", sys::cuGraphLaunch(exec, stream)).unwrap() };
        comm.synchronize()
            .unwrap_or_else(|e| panic!("graph replay {replay}: rank {r}: {e}"));
        recv.copy_to_host(0, &mut out).unwrap();
        for (i, b) in out.iter().enumerate() {
            let want = if i < c * 8 { byte(1000, prev, i) } else { 0xee };
            assert_eq!(*b, want, "graph replay {replay}: rank {r} byte {i}");
        }
    }
    // SAFETY: nothing replays it any more.
    unsafe { sys::cuGraphExecDestroy(exec) };
    println!("P2P MIX OK rank {r}");
}

/// A communicator made on a GPU while another communicator's kernel there waits for its peer:
/// two ranks sharing GPU 0, rank 0's all-reduce launched and waiting for rank 1's, which comes
/// only after a second pair of ranks has been made on the same GPU. Loading a module waits for
/// every kernel of the context and holds back every launch into it (docs/RELIABILITY.md, last
/// section), so a second pair that loaded its own modules waited for rank 0's kernel until its
/// deadline (20 s here; the all-reduce then failed); the second pair shares the first's modules
/// (the same images on the same GPU) and loads none. The all-reduce and one on the second pair
/// are exact. Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn a_communicator_made_while_a_kernel_waits_does_not_wait_for_it() {
    let Some(first) = ranks_on_one_gpu(2, Config::default()) else {
        return;
    };
    let count = 1000usize;
    let stats = MemStats::new();
    let gpu = first[0].gpu().unwrap();
    let bufs: Vec<(DeviceBuffer, DeviceBuffer)> = (0..2)
        .map(|r| {
            let send = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
            let recv = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
            put_words(&send, 0, &words(0x5eed, 0, r, count));
            (send, recv)
        })
        .collect();
    let args = |r: usize| OpArgs {
        dtype: ferroccl::DataType::Uint32,
        ..all_reduce_args(&bufs[r].0, &bufs[r].1, count)
    };
    // Rank 0's kernel, waiting for rank 1's.
    // SAFETY: the buffers hold count words and outlive the synchronize below.
    unsafe { first[0].run_raw(&args(0)).unwrap() };
    let t = Instant::now();
    let second = Comm::init_devices(
        &[Device::Cuda(0), Device::Cuda(0)],
        &Config {
            timeout: Duration::from_secs(20),
            ..Config::default()
        },
    )
    .unwrap();
    let made = t.elapsed();
    // SAFETY: as above.
    unsafe { first[1].run_raw(&args(1)).unwrap() };
    for c in &first {
        c.synchronize().unwrap();
    }
    eprintln!("second pair made in {made:?} while rank 0's kernel waited");
    assert!(
        made < Duration::from_secs(10),
        "making the second pair waited {made:?} for the first pair's kernel"
    );
    let sum = |round: u64| -> Vec<u32> {
        let (a, b) = (
            words(0x5eed, round, 0, count),
            words(0x5eed, round, 1, count),
        );
        a.iter().zip(&b).map(|(x, y)| x.wrapping_add(*y)).collect()
    };
    let want = sum(0);
    for (r, (_, recv)) in bufs.iter().enumerate() {
        assert_eq!(read_words(recv, count), want, "the first pair's rank {r}");
    }
    // The second pair works too (on the modules it shares).
    let out: Vec<Vec<u32>> = on_each_rank(&second, |r, c| {
        let stats = MemStats::new();
        let gpu = c.gpu().unwrap();
        let send = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
        let recv = DeviceBuffer::alloc(gpu, count * 4, &[], &stats).unwrap();
        put_words(&send, 0, &words(0x5eed, 1, r, count));
        let a = OpArgs {
            dtype: ferroccl::DataType::Uint32,
            ..all_reduce_args(&send, &recv, count)
        };
        // SAFETY: as above.
        unsafe { c.run_raw(&a).unwrap() };
        c.synchronize().unwrap();
        read_words(&recv, count)
    });
    let want = sum(1);
    for (r, got) in out.iter().enumerate() {
        assert_eq!(got, &want, "the second pair's rank {r}");
    }
}

/// Three ranks of one GPU made by `Comm::init_rank` in three threads of one process (one
/// context), each launching as soon as its own communicator exists: a sendrecv ring (LL and
/// simple) and an all-reduce, exact. They used to hang at the first operation: a rank still
/// loading a module after the fabric's barrier waited for a rank already waiting for it
/// (docs/PERFORMANCE.md, section 11). Needs one GPU.
#[test]
#[ignore = "needs a GPU: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn ranks_of_one_gpu_made_by_init_rank_in_threads_run_at_once() {
    if !common::one_gpu_for_test() {
        return;
    }
    let n = 3usize;
    let id = ferroccl::UniqueId::new(&Config::default()).unwrap();
    let cfg = Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    std::thread::scope(|s| {
        for r in 0..n {
            let (id, cfg) = (id.clone(), cfg.clone());
            s.spawn(move || {
                let comm = Comm::init_rank(&id, n, r, Device::Cuda(0), &cfg).unwrap();
                let gpu = comm.gpu().unwrap().clone();
                let stats = MemStats::new();
                for count in [2usize, 100_000] {
                    let send = DeviceBuffer::alloc(&gpu, count * 4, &[], &stats).unwrap();
                    let recv = DeviceBuffer::alloc(&gpu, count * 4, &[], &stats).unwrap();
                    let mine: Vec<f32> = (0..count).map(|i| (r * 1000 + i % 997) as f32).collect();
                    send.copy_from_host(0, f32_bytes(&mine)).unwrap();
                    let base = all_reduce_args(&send, &recv, count);
                    let mut g = Group::new();
                    // SAFETY: device buffers of `count` f32, alive past synchronize.
                    unsafe {
                        g.push_raw(
                            &comm,
                            OpArgs {
                                kind: CollKind::Send,
                                root: (r + 1) % n,
                                ..base
                            },
                        )
                        .unwrap();
                        g.push_raw(
                            &comm,
                            OpArgs {
                                kind: CollKind::Recv,
                                root: (r + n - 1) % n,
                                ..base
                            },
                        )
                        .unwrap();
                    }
                    g.launch().unwrap();
                    comm.synchronize()
                        .unwrap_or_else(|e| panic!("rank {r}, sendrecv of {count}: {e}"));
                    let got = read_f32(&recv, count).unwrap();
                    let prev = (r + n - 1) % n;
                    for (i, v) in got.iter().enumerate() {
                        assert_eq!(
                            *v,
                            (prev * 1000 + i % 997) as f32,
                            "rank {r} sendrecv of {count}, element {i}"
                        );
                    }
                    // SAFETY: as above.
                    unsafe { comm.run_raw(&base).unwrap() };
                    comm.synchronize()
                        .unwrap_or_else(|e| panic!("rank {r}, all-reduce of {count}: {e}"));
                    let got = read_f32(&recv, count).unwrap();
                    for (i, v) in got.iter().enumerate() {
                        let want: f32 = (0..n).map(|q| (q * 1000 + i % 997) as f32).sum();
                        assert_eq!(*v, want, "rank {r} all-reduce of {count}, element {i}");
                    }
                }
            });
        }
    });
}

/// One rank's part of the local-registration tests: the five movement kinds on outputs
/// registered by this rank alone (`Comm::register_local`, NCCL's `ncclCommRegister`), large
/// enough for several peer-engine rounds a block, exact on fresh data each time; the peers'
/// direct rounds land in them (counted), and none before registration or after
/// deregistration; host memory is refused. `legacy`: the outputs are `cuMemAlloc` memory
/// (`cudaMalloc`'s), which peers in other processes map by its IPC handle and peers in this
/// process reach at its own address (peer access). `direct_wanted`: whether direct rounds must
/// land. Returns the direct rounds received.
fn local_register_body(comm: &Comm, legacy: bool, direct_wanted: bool) -> Result<u64, String> {
    use ferroccl::DataType;
    let (n, r) = (comm.nranks(), comm.rank());
    let gpu = comm.gpu().unwrap().clone();
    let stats = MemStats::new();
    // 64 MiB a rank's block: 4 rounds of 256 KiB per block of 64.
    let count = (16 << 20) + 5;
    let bytes = n * count * 4;
    let send = ferroccl::mem::alloc(&gpu, bytes, &stats).map_err(|e| e.to_string())?;
    let cumem = ferroccl::mem::alloc(&gpu, bytes, &stats).map_err(|e| e.to_string())?;
    // The output: the cuMem buffer, or cuMemAlloc memory freed on the way out.
    struct Legacy(sys::CUdeviceptr);
    impl Drop for Legacy {
        fn drop(&mut self) {
            // SAFETY: its own allocation, freed once after the last synchronize.
            unsafe { sys::cuMemFree_v2(self.0) };
        }
    }
    let legacy_out = legacy.then(|| {
        gpu.bind().unwrap();
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: a fresh allocation, freed by the guard.
        unsafe { cu_ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut p, bytes)).unwrap() };
        Legacy(p)
    });
    let out_ptr = legacy_out.as_ref().map_or(cumem.device_ptr(), |l| l.0);
    let fill_out = |b: &[u8]| -> Result<(), String> {
        if legacy {
            gpu.bind().map_err(|e| e.to_string())?;
            // SAFETY: the output holds `bytes`, at least `b.len()`.
            unsafe {
                cu_ok(
                    "cuMemcpyHtoD",
                    sys::cuMemcpyHtoD_v2(out_ptr, b.as_ptr().cast(), b.len()),
                )
            }
            .map_err(|e| e.to_string())
        } else {
            cumem.copy_from_host(0, b).map_err(|e| e.to_string())
        }
    };
    let read_out = |count: usize| -> Result<Vec<f32>, String> {
        if legacy {
            let mut v = vec![0f32; count];
            gpu.bind().map_err(|e| e.to_string())?;
            // SAFETY: the output holds `bytes`, at least `count` floats.
            unsafe {
                cu_ok(
                    "cuMemcpyDtoH",
                    sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), out_ptr, count * 4),
                )
            }
            .map_err(|e| e.to_string())?;
            Ok(v)
        } else {
            read_f32(&cumem, count).map_err(|e| e.to_string())
        }
    };
    let host = vec![0u8; 4096];
    let e = unsafe { comm.register_local(host.as_ptr() as u64, host.len()) }.unwrap_err();
    if !e.to_string().contains("not GPU memory") {
        return Err(format!("host memory: {e}"));
    }
    // Counted from this call's start: a communicator may run this more than once.
    let start = comm.direct_rounds().unwrap().map_err(|e| e.to_string())?;
    let direct = || {
        comm.direct_rounds()
            .unwrap()
            .map(|d| d - start)
            .map_err(|e| e.to_string())
    };
    // Fresh for every run, the same on every rank: the communicator's random id.
    let seed = comm.id() as usize + legacy as usize;
    let mut round = 0usize;
    let mut run_all = |what: &str| -> Result<(), String> {
        for kind in [
            CollKind::AllGather,
            CollKind::AllToAll,
            CollKind::Broadcast,
            CollKind::Gather,
            CollKind::Scatter,
        ] {
            round += 1;
            // Exact small integers, new every launch; the same formula on every rank.
            let val =
                |q: usize, i: usize| ((i * 7 + q * 13 + round * 31 + seed % 997) % 2039) as f32;
            let root = round % n;
            let sends = if matches!(kind, CollKind::AllToAll | CollKind::Scatter) {
                n * count
            } else {
                count
            };
            let mine: Vec<f32> = (0..sends).map(|i| val(r, i)).collect();
            send.copy_from_host(0, f32_bytes(&mine))
                .map_err(|e| e.to_string())?;
            fill_out(&vec![0xffu8; bytes])?;
            let a = OpArgs {
                kind,
                send: send.device_ptr() as *const u8,
                recv: out_ptr as *mut u8,
                count,
                dtype: DataType::Float32,
                op: ReduceOp::Sum,
                root,
                device_scalar: None,
            };
            unsafe { comm.run_raw(&a) }.map_err(|e| e.to_string())?;
            comm.synchronize().map_err(|e| e.to_string())?;
            let got = read_out(n * count)?;
            // Element i of the output: which rank's input, which of its elements.
            let want = |i: usize| -> Option<f32> {
                match kind {
                    CollKind::AllGather => Some(val(i / count, i % count)),
                    CollKind::AllToAll => Some(val(i / count, r * count + i % count)),
                    CollKind::Broadcast => (i < count).then(|| val(root, i)),
                    CollKind::Gather => (r == root).then(|| val(i / count, i % count)),
                    _ => (i < count).then(|| val(root, r * count + i)),
                }
            };
            if let Some(i) = (0..n * count).find(|&i| want(i).is_some_and(|w| got[i] != w)) {
                return Err(format!(
                    "{what}, {kind} (root {root}): element {i} is {}, expected {:?}",
                    got[i],
                    want(i)
                ));
            }
        }
        Ok(())
    };
    run_all("unregistered")?;
    let before = direct()?;
    if before != 0 {
        return Err(format!("{before} direct rounds into unregistered outputs"));
    }
    unsafe { comm.register_local(out_ptr, bytes) }.map_err(|e| e.to_string())?;
    run_all("registered")?;
    run_all("registered, again")?;
    let during = direct()?;
    if (during > 0) != direct_wanted {
        return Err(format!(
            "{during} direct rounds into a registered output ({} wanted)",
            if direct_wanted { "some" } else { "none" }
        ));
    }
    comm.deregister_local(out_ptr).map_err(|e| e.to_string())?;
    if comm.deregister_local(out_ptr).is_ok() {
        return Err("deregistered twice".into());
    }
    run_all("deregistered")?;
    let after = direct()?;
    if after != during {
        return Err(format!(
            "{} direct rounds after deregistration",
            after - during
        ));
    }
    Ok(during)
}

/// Local registrations across processes: each rank's mapper maps what the other lends it, a
/// cuMem allocation by its descriptor and then `cuMemAlloc` memory by its IPC handle.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn locally_registered_outputs_take_direct_rounds_across_processes() {
    if role().is_some() {
        return;
    }
    let Some(_) = gpus_for_test() else { return };
    // The peer engine's direct rounds are what this test counts: the copy engines, which would
    // take these sizes on outputs posted in the rendezvous, stay out.
    let kids = spawn_ranks(
        2,
        "child_local_register",
        "local-register",
        &[
            ("FERROCCL_TIMEOUT", "60".to_string()),
            ("FERROCCL_GPU_CE_RENDEZVOUS_BYTES", "0".to_string()),
        ],
    );
    assert_all_print(kids, "LOCAL REGISTER OK");
}

/// Child of the test above.
#[test]
fn child_local_register() {
    if role().as_deref() != Some("local-register") {
        return;
    }
    let cfg = Config::from_env().unwrap();
    let comm = Comm::from_env_gpu(&cfg).unwrap();
    let both = local_register_body(&comm, false, true).and_then(|a| {
        local_register_body(&comm, true, true)
            .map_err(|e| format!("cuMemAlloc: {e}"))
            .map(|b| (a, b))
    });
    match both {
        Ok((a, b)) => println!("LOCAL REGISTER OK direct={a} cuMemAlloc direct={b}"),
        Err(e) => {
            println!("rank {}: {e}", comm.rank());
            std::process::exit(3);
        }
    }
}

/// Local registrations between threads of one process: peers reach the buffer at its own
/// address once their GPU may (a cuMem buffer's range granted, `cuMemAlloc` memory by peer
/// access to the registering GPU's context), and their direct rounds land in it.
#[test]
#[ignore = "needs 2+ GPUs: FERROCCL_GPU_TEST=1 cargo test -p ferroccl --test gpu -- --ignored"]
fn locally_registered_outputs_take_direct_rounds_in_one_process() {
    let Some(n) = gpus_for_test() else { return };
    let id = ferroccl::UniqueId::new(&Config::default()).unwrap();
    let results: Vec<Result<u64, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let id = id.clone();
                s.spawn(move || {
                    let comm =
                        Comm::init_rank(&id, n, r, Device::Cuda(r), &Config::default()).unwrap();
                    local_register_body(&comm, false, true).and_then(|d| {
                        local_register_body(&comm, true, true)
                            .map_err(|e| format!("cuMemAlloc: {e}"))
                            .map(|l| d.min(l))
                    })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, res) in results.into_iter().enumerate() {
        assert!(res.as_ref().is_ok_and(|&d| d > 0), "rank {r}: {res:?}");
    }
}
