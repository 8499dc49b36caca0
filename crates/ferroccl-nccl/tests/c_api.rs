//! The C API through the real shared library: `libnccl.so` of this build is opened with
//! dlopen and called as a C program would, on the host backend (host buffers, streams
//! ignored), ranks as threads. Every result is checked element by element on fresh random
//! integers (exact in every reduction); bad arguments of every kind must return NCCL's code
//! and a text, and leave the communicator usable.

use ferroccl_core::nccl_abi::{self as abi, RawComm, UniqueId};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::{null, null_mut};

mod common;
use common::Lib;

/// What these tests add to the library handle: the host backend, and ranks as handles.
trait HostLib {
    fn open() -> Lib;
    fn init_rank(&self, n: usize, id: UniqueId, r: usize) -> Comm<'_>;
}

impl HostLib for Lib {
    /// The library on the host backend (host buffers, streams ignored).
    fn open() -> Lib {
        std::env::set_var("FERROCCL_NCCL_BACKEND", "host");
        Lib::dlopen()
    }

    fn init_rank(&self, n: usize, id: UniqueId, r: usize) -> Comm<'_> {
        let f: abi::CommInitRankFn = self.sym("ncclCommInitRank");
        let mut c: RawComm = null_mut();
        let res = unsafe { f(&mut c, n as c_int, id, r as c_int) };
        assert_eq!(res, abi::SUCCESS, "{}", self.last_error());
        Comm { lib: self, raw: c }
    }
}

/// A communicator handle; destroyed at drop.
struct Comm<'l> {
    lib: &'l Lib,
    raw: RawComm,
}
unsafe impl Send for Comm<'_> {}

impl Drop for Comm<'_> {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            let f: abi::CommFn = self.lib.sym("ncclCommDestroy");
            assert_eq!(unsafe { f(self.raw) }, abi::SUCCESS);
        }
    }
}

const FLOAT: c_int = 7;
const INT32: c_int = 2;
const SUM: c_int = 0;

fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Each rank's random small integers (as f32: every sum of a few is exact).
fn data(rank: usize, count: usize, seed: u64) -> Vec<f32> {
    let mut next = rng(seed * 131 + rank as u64 + 1);
    (0..count).map(|_| (next() % 200) as f32 - 100.0).collect()
}

/// Runs `f(rank, comm)` on `n` ranks, a thread each, after ncclCommInitRank.
fn job(lib: &Lib, n: usize, f: impl Fn(usize, &Comm) + Sync) {
    let id = lib.unique_id();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                s.spawn(move || {
                    let c = lib.init_rank(n, id, r);
                    f(r, &c);
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}

#[test]
fn version_ids_and_error_strings() {
    let lib = Lib::open();
    let v: abi::GetVersionFn = lib.sym("ncclGetVersion");
    let mut code = 0;
    assert_eq!(unsafe { v(&mut code) }, abi::SUCCESS);
    assert_eq!(code, abi::API_VERSION);
    assert_eq!(unsafe { v(null_mut()) }, abi::INVALID_ARGUMENT);
    assert!(
        lib.last_error().contains("ncclGetVersion") && lib.last_error().contains("null"),
        "{}",
        lib.last_error()
    );
    assert_ne!(
        lib.unique_id().to_bytes(),
        lib.unique_id().to_bytes(),
        "every id names a fresh rendezvous"
    );
    let s: abi::GetErrorStringFn = lib.sym("ncclGetErrorString");
    for r in 0..=8 {
        assert!(!unsafe { CStr::from_ptr(s(r)) }.to_bytes().is_empty());
    }
    // The profiling twins are the same functions.
    let pv: abi::GetVersionFn = lib.sym("pncclGetVersion");
    let mut code2 = 0;
    assert_eq!(unsafe { pv(&mut code2) }, abi::SUCCESS);
    assert_eq!(code2, code);
}

#[test]
fn every_collective_is_exact_through_the_c_api() {
    let lib = Lib::open();
    let n = 3;
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let reduce_scatter: abi::ReduceScatterFn = lib.sym("ncclReduceScatter");
    let all_gather: abi::AllGatherFn = lib.sym("ncclAllGather");
    let alltoall: abi::AllGatherFn = lib.sym("ncclAlltoAll");
    let broadcast: abi::BroadcastFn = lib.sym("ncclBroadcast");
    let bcast: abi::BcastFn = lib.sym("ncclBcast");
    let reduce: abi::ReduceFn = lib.sym("ncclReduce");
    let gather: abi::BroadcastFn = lib.sym("ncclGather");
    let scatter: abi::BroadcastFn = lib.sym("ncclScatter");
    let count_of: abi::CommIntFn = lib.sym("ncclCommCount");
    let rank_of: abi::CommIntFn = lib.sym("ncclCommUserRank");
    let dev_of: abi::CommIntFn = lib.sym("ncclCommCuDevice");
    let premul: abi::RedOpCreatePreMulSumFn = lib.sym("ncclRedOpCreatePreMulSum");
    let async_err: abi::CommGetAsyncErrorFn = lib.sym("ncclCommGetAsyncError");
    let ok = |r: c_int| assert_eq!(r, abi::SUCCESS, "{}", lib.last_error());
    job(&lib, n, |r, c| {
        let (mut k, mut me, mut dev, mut ae) = (0, 0, 0, 1);
        unsafe {
            ok(count_of(c.raw, &mut k));
            ok(rank_of(c.raw, &mut me));
            ok(dev_of(c.raw, &mut dev));
            ok(async_err(c.raw, &mut ae));
        }
        assert_eq!((k, me, dev, ae), (n as c_int, r as c_int, -1, abi::SUCCESS));
        let count = 1000 + 37;
        let all: Vec<Vec<f32>> = (0..n).map(|q| data(q, count * n, 1)).collect();
        let mine = &all[r];
        let sum: Vec<f32> = (0..count * n)
            .map(|i| all.iter().map(|v| v[i]).sum())
            .collect();
        let mut out = vec![f32::NAN; count * n];
        let sp = |v: &Vec<f32>| v.as_ptr() as *const c_void;
        let rp = |v: &mut Vec<f32>| v.as_mut_ptr() as *mut c_void;
        unsafe {
            // All-reduce: sum, then max (op 2), then pre-multiplied by 3 (a handle).
            ok(all_reduce(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                SUM,
                c.raw,
                null_mut(),
            ));
            assert_eq!(out[..count], sum[..count], "all-reduce sum");
            ok(all_reduce(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                2,
                c.raw,
                null_mut(),
            ));
            let max: Vec<f32> = (0..count)
                .map(|i| all.iter().map(|v| v[i]).fold(f32::MIN, f32::max))
                .collect();
            assert_eq!(out[..count], max[..], "all-reduce max");
            let mut op = 0;
            let three = 3.0f32;
            ok(premul(
                &mut op,
                &three as *const f32 as *mut c_void,
                FLOAT,
                abi::SCALAR_HOST_IMMEDIATE,
                c.raw,
            ));
            assert_eq!(op, abi::NUM_BUILTIN_OPS);
            ok(all_reduce(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                op,
                c.raw,
                null_mut(),
            ));
            let tripled: Vec<f32> = sum[..count].iter().map(|s| 3.0 * s).collect();
            assert_eq!(out[..count], tripled[..], "pre-multiplied sum");
            // Reduce-scatter: this rank's block of the sum.
            ok(reduce_scatter(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                SUM,
                c.raw,
                null_mut(),
            ));
            assert_eq!(
                out[..count],
                sum[r * count..(r + 1) * count],
                "reduce-scatter"
            );
            // All-gather: every rank's first block.
            ok(all_gather(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                c.raw,
                null_mut(),
            ));
            for q in 0..n {
                assert_eq!(
                    out[q * count..(q + 1) * count],
                    all[q][..count],
                    "all-gather block {q}"
                );
            }
            // All-to-all: block q of every rank's input lands as block p of rank q's output.
            ok(alltoall(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                c.raw,
                null_mut(),
            ));
            for q in 0..n {
                assert_eq!(
                    out[q * count..(q + 1) * count],
                    all[q][r * count..(r + 1) * count],
                    "all-to-all from {q}"
                );
            }
            // Broadcast from 1, then the in-place ncclBcast from 2.
            ok(broadcast(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                1,
                c.raw,
                null_mut(),
            ));
            assert_eq!(out[..count], all[1][..count], "broadcast");
            let mut buf = mine.clone();
            ok(bcast(rp(&mut buf), count, FLOAT, 2, c.raw, null_mut()));
            assert_eq!(buf[..count], all[2][..count], "bcast");
            // Reduce to 0; gather to 1; scatter from 2.
            out.fill(f32::NAN);
            ok(reduce(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                SUM,
                0,
                c.raw,
                null_mut(),
            ));
            if r == 0 {
                assert_eq!(out[..count], sum[..count], "reduce");
            }
            ok(gather(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                1,
                c.raw,
                null_mut(),
            ));
            if r == 1 {
                for q in 0..n {
                    assert_eq!(
                        out[q * count..(q + 1) * count],
                        all[q][..count],
                        "gather block {q}"
                    );
                }
            }
            ok(scatter(
                sp(mine),
                rp(&mut out),
                count,
                FLOAT,
                2,
                c.raw,
                null_mut(),
            ));
            assert_eq!(out[..count], all[2][r * count..(r + 1) * count], "scatter");
            // Integers, the average of which NCCL defines for floats only: sum of int32.
            let ints: Vec<i32> = mine.iter().map(|&x| x as i32).collect();
            let mut iout = vec![0i32; count];
            ok(all_reduce(
                ints.as_ptr() as *const c_void,
                iout.as_mut_ptr() as *mut c_void,
                count,
                INT32,
                SUM,
                c.raw,
                null_mut(),
            ));
            assert!(
                iout.iter().zip(&sum).all(|(a, b)| *a == *b as i32),
                "int32 all-reduce"
            );
        }
    });
}

/// nccl-tests' one-thread mode: the ranks created inside one group from one thread, then their
/// operations (here send/receive around a ring, and an all-reduce) grouped from that thread.
#[test]
fn one_thread_creates_and_drives_every_rank_through_groups() {
    let lib = Lib::open();
    let start: abi::GroupFn = lib.sym("ncclGroupStart");
    let end: abi::GroupFn = lib.sym("ncclGroupEnd");
    let init: abi::CommInitRankFn = lib.sym("ncclCommInitRank");
    let send: abi::SendFn = lib.sym("ncclSend");
    let recv: abi::RecvFn = lib.sym("ncclRecv");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let async_err: abi::CommGetAsyncErrorFn = lib.sym("ncclCommGetAsyncError");
    let ok = |r: c_int| assert_eq!(r, abi::SUCCESS, "{}", lib.last_error());
    let n = 4;
    let id = lib.unique_id();
    let mut raws: Vec<RawComm> = vec![null_mut(); n];
    unsafe {
        ok(start());
        for (r, c) in raws.iter_mut().enumerate() {
            ok(init(c, n as c_int, id, r as c_int));
        }
        // Before the group ends the handles exist and say they are in progress.
        let mut ae = 0;
        ok(async_err(raws[0], &mut ae));
        assert_eq!(ae, abi::IN_PROGRESS);
        ok(end());
    }
    let comms: Vec<Comm> = raws.iter().map(|&raw| Comm { lib: &lib, raw }).collect();
    let count = 513;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| data(r, count, 7)).collect();
    let mut outs: Vec<Vec<f32>> = vec![vec![f32::NAN; count]; n];
    unsafe {
        // Ring: rank r sends to r+1 and receives from r-1, posted in an order that would
        // deadlock without the group.
        ok(start());
        for r in 0..n {
            ok(recv(
                outs[r].as_mut_ptr() as *mut c_void,
                count,
                FLOAT,
                ((r + n - 1) % n) as c_int,
                comms[r].raw,
                null_mut(),
            ));
        }
        for r in 0..n {
            ok(send(
                inputs[r].as_ptr() as *const c_void,
                count,
                FLOAT,
                ((r + 1) % n) as c_int,
                comms[r].raw,
                null_mut(),
            ));
        }
        ok(end());
    }
    for r in 0..n {
        assert_eq!(outs[r], inputs[(r + n - 1) % n], "rank {r} received");
    }
    unsafe {
        ok(start());
        // Nested groups end at the outermost.
        ok(start());
        for r in 0..n {
            ok(all_reduce(
                inputs[r].as_ptr() as *const c_void,
                outs[r].as_mut_ptr() as *mut c_void,
                count,
                FLOAT,
                SUM,
                comms[r].raw,
                null_mut(),
            ));
        }
        ok(end());
        ok(end());
    }
    let sum: Vec<f32> = (0..count)
        .map(|i| inputs.iter().map(|v| v[i]).sum())
        .collect();
    for o in &outs {
        assert_eq!(o, &sum);
    }
}

#[test]
fn init_all_and_split() {
    let lib = Lib::open();
    let init_all: abi::CommInitAllFn = lib.sym("ncclCommInitAll");
    let split: abi::CommSplitFn = lib.sym("ncclCommSplit");
    let count_of: abi::CommIntFn = lib.sym("ncclCommCount");
    let rank_of: abi::CommIntFn = lib.sym("ncclCommUserRank");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let ok = |r: c_int| assert_eq!(r, abi::SUCCESS, "{}", lib.last_error());
    let n = 4;
    // A device list (as CuPy's initAll passes) on the host backend: checked, then ignored.
    let devs: Vec<c_int> = (0..n as c_int).collect();
    let mut listed = vec![null_mut(); n];
    unsafe { ok(init_all(listed.as_mut_ptr(), n as c_int, devs.as_ptr())) };
    drop(
        listed
            .iter()
            .map(|&raw| Comm { lib: &lib, raw })
            .collect::<Vec<_>>(),
    );
    let bad: Vec<c_int> = vec![0, -1, 2, 3];
    assert_eq!(
        unsafe { init_all(listed.as_mut_ptr(), n as c_int, bad.as_ptr()) },
        abi::INVALID_ARGUMENT
    );
    let mut raws = vec![null_mut(); n];
    unsafe { ok(init_all(raws.as_mut_ptr(), n as c_int, null())) };
    let comms: Vec<Comm> = raws.iter().map(|&raw| Comm { lib: &lib, raw }).collect();
    // Split by parity, keys reversing the order; rank 3 takes no part.
    let subs: Vec<Option<Comm>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let lib = &lib;
                let raw = c.raw as usize;
                s.spawn(move || {
                    let color = if r == 3 {
                        abi::SPLIT_NOCOLOR
                    } else {
                        (r % 2) as c_int
                    };
                    let mut sub: RawComm = null_mut();
                    let res = unsafe {
                        split(raw as RawComm, color, -(r as c_int), &mut sub, null_mut())
                    };
                    assert_eq!(res, abi::SUCCESS, "{}", lib.last_error());
                    (!sub.is_null()).then_some(sub as usize)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap().map(|raw| Comm {
                    lib: &lib,
                    raw: raw as RawComm,
                })
            })
            .collect()
    });
    assert!(
        subs[3].is_none(),
        "NCCL_SPLIT_NOCOLOR gives no communicator"
    );
    let (mut k, mut me) = (0, 0);
    unsafe {
        ok(count_of(subs[0].as_ref().unwrap().raw, &mut k));
        ok(rank_of(subs[0].as_ref().unwrap().raw, &mut me));
    }
    // Color 0 holds ranks 0 and 2; keys 0 and -2 put rank 2 first.
    assert_eq!((k, me), (2, 1));
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = [0usize, 2]
            .into_iter()
            .map(|r| {
                let raw = subs[r].as_ref().unwrap().raw as usize;
                s.spawn(move || {
                    let mine = vec![r as f32 + 1.0; 100];
                    let mut out = vec![0f32; 100];
                    let res = unsafe {
                        all_reduce(
                            mine.as_ptr() as *const c_void,
                            out.as_mut_ptr() as *mut c_void,
                            100,
                            FLOAT,
                            SUM,
                            raw as RawComm,
                            null_mut(),
                        )
                    };
                    assert_eq!(res, abi::SUCCESS);
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        results.iter().all(|o| o.iter().all(|&v| v == 4.0)),
        "1 + 3 over ranks 0 and 2"
    );
}

#[test]
fn bad_arguments_return_nccl_codes_and_change_nothing() {
    let lib = Lib::open();
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let send: abi::SendFn = lib.sym("ncclSend");
    let broadcast: abi::BroadcastFn = lib.sym("ncclBroadcast");
    let init_cfg: abi::CommInitRankConfigFn = lib.sym("ncclCommInitRankConfig");
    let init: abi::CommInitRankFn = lib.sym("ncclCommInitRank");
    let end: abi::GroupFn = lib.sym("ncclGroupEnd");
    let destroy: abi::CommFn = lib.sym("ncclCommDestroy");
    let redop_destroy: abi::RedOpDestroyFn = lib.sym("ncclRedOpDestroy");
    let count_of: abi::CommIntFn = lib.sym("ncclCommCount");
    let expect = |got: c_int, want: c_int, words: &[&str]| {
        let text = lib.last_error();
        assert_eq!(got, want, "{text}");
        for w in words {
            assert!(text.contains(w), "{text:?} does not say {w:?}");
        }
    };
    let v = [1f32; 16];
    let mut o = vec![0f32; 16];
    let (sp, rp) = (v.as_ptr() as *const c_void, o.as_mut_ptr() as *mut c_void);
    unsafe {
        // Handles that are not communicators.
        expect(
            all_reduce(sp, rp, 16, FLOAT, SUM, null_mut(), null_mut()),
            abi::INVALID_ARGUMENT,
            &["ncclAllReduce", "null"],
        );
        expect(
            all_reduce(sp, rp, 16, FLOAT, SUM, 0x1000 as RawComm, null_mut()),
            abi::INVALID_ARGUMENT,
            &["not a communicator"],
        );
        expect(
            end(),
            abi::INVALID_USAGE,
            &["without a matching ncclGroupStart"],
        );
        // Creation: rank out of range, null out pointer, an uninitialised config.
        let mut c: RawComm = null_mut();
        let id = lib.unique_id();
        expect(
            init(&mut c, 2, id, 2),
            abi::INVALID_ARGUMENT,
            &["rank 2 of 2"],
        );
        expect(
            init(null_mut(), 2, id, 0),
            abi::INVALID_ARGUMENT,
            &["comm", "null"],
        );
        let mut cfg = abi::Config::initializer();
        cfg.magic = 0;
        expect(
            init_cfg(&mut c, 1, id, 0, &mut cfg),
            abi::INVALID_ARGUMENT,
            &["magic", "NCCL_CONFIG_INITIALIZER"],
        );
        let mut cfg = abi::Config::initializer();
        cfg.blocking = 2;
        expect(
            init_cfg(&mut c, 1, id, 0, &mut cfg),
            abi::INVALID_ARGUMENT,
            &["config.blocking = 2"],
        );
        assert!(c.is_null(), "no handle from a failed creation");
    }
    // On a live communicator of 2: every bad argument fails alone, the next good call works.
    job(&lib, 2, |r, c| unsafe {
        let v = [r as f32 + 1.0; 16];
        let mut o = vec![0f32; 16];
        let (sp, rp) = (v.as_ptr() as *const c_void, o.as_mut_ptr() as *mut c_void);
        if r == 0 {
            expect(
                all_reduce(sp, rp, 16, 42, SUM, c.raw, null_mut()),
                abi::INVALID_ARGUMENT,
                &["datatype 42"],
            );
            expect(
                all_reduce(sp, rp, 16, FLOAT, 99, c.raw, null_mut()),
                abi::INVALID_ARGUMENT,
                &["reduction 99"],
            );
            expect(
                all_reduce(sp, rp, 16, FLOAT, -1, c.raw, null_mut()),
                abi::INVALID_ARGUMENT,
                &["reduction -1"],
            );
            expect(
                send(sp, 16, FLOAT, 5, c.raw, null_mut()),
                abi::INVALID_ARGUMENT,
                &["5"],
            );
            expect(
                send(sp, 16, FLOAT, -1, c.raw, null_mut()),
                abi::INVALID_ARGUMENT,
                &["peer -1"],
            );
            expect(
                broadcast(sp, rp, 16, FLOAT, 7, c.raw, null_mut()),
                abi::INVALID_ARGUMENT,
                &["7"],
            );
            expect(
                all_reduce(null(), rp, 16, FLOAT, SUM, c.raw, null_mut()),
                abi::INVALID_ARGUMENT,
                &[],
            );
            expect(
                redop_destroy(0, c.raw),
                abi::INVALID_ARGUMENT,
                &["NCCL's own"],
            );
            expect(
                count_of(c.raw, null_mut()),
                abi::INVALID_ARGUMENT,
                &["null"],
            );
        }
        // Still usable, and nothing ran: the sum is of this call alone.
        assert_eq!(
            all_reduce(sp, rp, 16, FLOAT, SUM, c.raw, null_mut()),
            abi::SUCCESS,
            "{}",
            lib.last_error()
        );
        assert!(o.iter().all(|&x| x == 3.0), "{o:?}");
    });
    // A destroyed communicator is refused, and destroying it again too.
    let id = lib.unique_id();
    let c = lib.init_rank(1, id, 0);
    let raw = c.raw;
    std::mem::forget(c);
    unsafe {
        assert_eq!(destroy(raw), abi::SUCCESS);
        expect(destroy(raw), abi::INVALID_ARGUMENT, &["not a communicator"]);
        expect(
            all_reduce(sp, rp, 16, FLOAT, SUM, raw, null_mut()),
            abi::INVALID_ARGUMENT,
            &["not a communicator"],
        );
    }
}

/// Our header, compiled by the C compiler, against the Rust definitions the library uses.
#[test]
fn the_header_matches_the_abi() {
    let dir = std::env::temp_dir().join(format!("ferroccl-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("abi.c");
    std::fs::write(
        &src,
        r#"#include <stdio.h>
#include <stddef.h>
#include "nccl.h"
int main(void) {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  printf("%zu %zu %zu %zu %zu %zu %zu\n", sizeof(ncclUniqueId), sizeof(ncclConfig_t), offsetof(ncclConfig_t, magic),
         offsetof(ncclConfig_t, blocking), offsetof(ncclConfig_t, netName), offsetof(ncclConfig_t, commName),
         offsetof(ncclConfig_t, nvlinkCentricSched));
  printf("%d %d %d %d %d %d %d\n", NCCL_VERSION_CODE, (int)ncclFloat8e5m2, (int)ncclBfloat16, (int)ncclAvg, (int)ncclNumOps,
         NCCL_SPLIT_NOCOLOR, (int)ncclInProgress);
  printf("%zu %x %u %d %d\n", c.size, c.magic, c.version, c.blocking, (int)ncclScalarHostImmediate);
  ncclSimInfo_t s = NCCL_SIM_INFO_INITIALIZER;
  printf("%zu %zu %zu %x %u %.1f\n", sizeof(ncclSimInfo_t), offsetof(ncclSimInfo_t, estimatedTime), s.size, s.magic, s.version,
         (double)s.estimatedTime);
  return 0;
}
"#,
    )
    .unwrap();
    let exe = dir.join("abi");
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
    let st = std::process::Command::new("cc")
        .args(["-std=c99", "-Wall", "-Werror", "-I", include, "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success(), "the header does not compile");
    let out = String::from_utf8(std::process::Command::new(&exe).output().unwrap().stdout).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    use std::mem::{offset_of, size_of};
    type C = abi::Config;
    assert_eq!(
        lines[0],
        format!(
            "{} {} {} {} {} {} {}",
            size_of::<UniqueId>(),
            size_of::<C>(),
            offset_of!(C, magic),
            offset_of!(C, blocking),
            offset_of!(C, net_name),
            offset_of!(C, comm_name),
            offset_of!(C, nvlink_centric_sched)
        )
    );
    assert_eq!(
        lines[1],
        format!(
            "{} 11 9 4 {} {} {}",
            abi::API_VERSION,
            abi::NUM_BUILTIN_OPS,
            abi::SPLIT_NOCOLOR,
            abi::IN_PROGRESS
        )
    );
    let init = C::initializer();
    assert_eq!(
        lines[2],
        format!(
            "{} {:x} {} {} {}",
            init.size,
            init.magic,
            init.version,
            init.blocking,
            abi::SCALAR_HOST_IMMEDIATE
        )
    );
    let sim = abi::SimInfo::initializer();
    assert_eq!(
        lines[3],
        format!(
            "{} {} {} {:x} {} {:.1}",
            size_of::<abi::SimInfo>(),
            offset_of!(abi::SimInfo, estimated_time),
            sim.size,
            sim.magic,
            sim.version,
            sim.estimated_time
        )
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let _ = c_char::default();
}

/// Survivors of a rank that aborted shrink without it and carry on; a revoked communicator
/// refuses work and reports it; scalable creation takes the first id.
#[test]
fn shrink_revoke_and_scalable_init() {
    let lib = Lib::open();
    let abort: abi::CommFn = lib.sym("ncclCommAbort");
    let shrink: abi::CommShrinkFn = lib.sym("ncclCommShrink");
    let revoke: abi::CommFlagsFn = lib.sym("ncclCommRevoke");
    let count_of: abi::CommIntFn = lib.sym("ncclCommCount");
    let rank_of: abi::CommIntFn = lib.sym("ncclCommUserRank");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let async_err: abi::CommGetAsyncErrorFn = lib.sym("ncclCommGetAsyncError");
    let scalable: abi::CommInitRankScalableFn = lib.sym("ncclCommInitRankScalable");
    let id = lib.unique_id();
    let n = 3;
    std::thread::scope(|s| {
        for r in 0..n {
            let lib = &lib;
            s.spawn(move || {
                let mut c = lib.init_rank(n, id, r);
                if r == 2 {
                    assert_eq!(unsafe { abort(c.raw) }, abi::SUCCESS);
                    c.raw = null_mut();
                    return;
                }
                let mut excl = [2 as c_int];
                let mut sub: RawComm = null_mut();
                let res = unsafe { shrink(c.raw, excl.as_mut_ptr(), 1, &mut sub, null_mut(), 0) };
                assert_eq!(res, abi::SUCCESS, "{}", lib.last_error());
                let sub = Comm { lib, raw: sub };
                let (mut k, mut me) = (0, 0);
                unsafe {
                    assert_eq!(count_of(sub.raw, &mut k), abi::SUCCESS);
                    assert_eq!(rank_of(sub.raw, &mut me), abi::SUCCESS);
                }
                assert_eq!((k, me), (2, r as c_int));
                let mine = data(r, 777, 3);
                let mut out = vec![0f32; 777];
                let res = unsafe {
                    all_reduce(
                        mine.as_ptr() as *const c_void,
                        out.as_mut_ptr() as *mut c_void,
                        777,
                        FLOAT,
                        SUM,
                        sub.raw,
                        null_mut(),
                    )
                };
                assert_eq!(res, abi::SUCCESS, "{}", lib.last_error());
                let want: Vec<f32> = (0..777)
                    .map(|i| data(0, 777, 3)[i] + data(1, 777, 3)[i])
                    .collect();
                assert_eq!(out, want);
                // Revoke: later work is refused, the async error says so, destroy still works.
                assert_eq!(unsafe { revoke(sub.raw, 0) }, abi::SUCCESS);
                let res = unsafe {
                    all_reduce(
                        mine.as_ptr() as *const c_void,
                        out.as_mut_ptr() as *mut c_void,
                        777,
                        FLOAT,
                        SUM,
                        sub.raw,
                        null_mut(),
                    )
                };
                assert_ne!(res, abi::SUCCESS);
                assert!(lib.last_error().contains("aborted"), "{}", lib.last_error());
                // Asked about the communicator, the text is its own failure.
                let of: abi::GetLastErrorFn = lib.sym("ncclGetLastError");
                let text = unsafe { CStr::from_ptr(of(sub.raw)) }
                    .to_string_lossy()
                    .into_owned();
                assert!(
                    text.starts_with("communicator failed") && text.contains("aborted"),
                    "{text}"
                );
                let mut ae = 0;
                assert_eq!(unsafe { async_err(sub.raw, &mut ae) }, abi::SUCCESS);
                assert_ne!(ae, abi::SUCCESS);
            });
        }
    });
    // Scalable creation: every rank passes the same list of ids.
    let mut ids = [lib.unique_id(), lib.unique_id()];
    let ids_addr = ids.as_mut_ptr() as usize;
    std::thread::scope(|s| {
        for r in 0..2 {
            let lib = &lib;
            s.spawn(move || {
                let mut c: RawComm = null_mut();
                let res =
                    unsafe { scalable(&mut c, 2, r, 2, ids_addr as *mut UniqueId, null_mut()) };
                assert_eq!(res, abi::SUCCESS, "{}", lib.last_error());
                drop(Comm { lib, raw: c });
            });
        }
    });
    let mut c: RawComm = null_mut();
    assert_eq!(
        unsafe { scalable(&mut c, 2, 0, 0, ids.as_mut_ptr(), null_mut()) },
        abi::INVALID_ARGUMENT
    );
}

#[test]
fn memory_and_registrations() {
    let lib = Lib::open();
    let mem_alloc: abi::MemAllocFn = lib.sym("ncclMemAlloc");
    let mem_free: abi::MemFreeFn = lib.sym("ncclMemFree");
    let register: abi::CommRegisterFn = lib.sym("ncclCommRegister");
    let deregister: abi::CommDeregisterFn = lib.sym("ncclCommDeregister");
    let win_register: abi::CommWindowRegisterFn = lib.sym("ncclCommWindowRegister");
    let win_deregister: abi::CommWindowDeregisterFn = lib.sym("ncclCommWindowDeregister");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let errors = std::sync::Mutex::new(());
    job(&lib, 2, |r, c| unsafe {
        let count = 4096;
        let mut p: *mut c_void = null_mut();
        assert_eq!(
            mem_alloc(&mut p, count * 4),
            abi::SUCCESS,
            "{}",
            lib.last_error()
        );
        let buf = std::slice::from_raw_parts_mut(p as *mut f32, count);
        buf.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (i % 50) as f32 + r as f32);
        let mut h: *mut c_void = null_mut();
        assert_eq!(register(c.raw, p, count * 4, &mut h), abi::SUCCESS);
        let mut w: abi::RawWindow = null_mut();
        assert_eq!(
            win_register(c.raw, p, count * 4, &mut w, abi::WIN_COLL_SYMMETRIC),
            abi::SUCCESS,
            "{}",
            lib.last_error()
        );
        assert_eq!(
            all_reduce(p, p, count, FLOAT, SUM, c.raw, null_mut()),
            abi::SUCCESS
        );
        assert!(buf
            .iter()
            .enumerate()
            .all(|(i, &x)| x == 2.0 * (i % 50) as f32 + 1.0));
        {
            // Each handle goes back through its own call: the other refuses it, keeping it.
            let _one_at_a_time = errors.lock().unwrap();
            assert_eq!(deregister(c.raw, w), abi::INVALID_ARGUMENT);
            assert!(
                lib.last_error().contains("ncclCommWindowDeregister"),
                "{}",
                lib.last_error()
            );
            assert_eq!(win_deregister(c.raw, h), abi::INVALID_ARGUMENT);
            assert!(
                lib.last_error().contains("ncclCommDeregister"),
                "{}",
                lib.last_error()
            );
        }
        assert_eq!(win_deregister(c.raw, w), abi::SUCCESS);
        assert_eq!(deregister(c.raw, h), abi::SUCCESS);
        assert_eq!(mem_free(p), abi::SUCCESS);
        // The last error is one per process (as NCCL's): the other rank's failing calls
        // must not land between ours and the check.
        let _one_at_a_time = errors.lock().unwrap();
        assert_eq!(win_deregister(c.raw, w), abi::INVALID_ARGUMENT);
        assert_eq!(deregister(c.raw, h), abi::INVALID_ARGUMENT);
        assert_eq!(mem_free(p), abi::INVALID_ARGUMENT);
        assert!(
            lib.last_error().contains("not returned by ncclMemAlloc"),
            "{}",
            lib.last_error()
        );
        assert_eq!(mem_alloc(null_mut(), 8), abi::INVALID_ARGUMENT);
    });
}

/// One thread registers a window on every rank it drives inside one group, as nccl-tests'
/// `-R 2 -g N` does: the registrations (collective) run at the group's end, where the handles
/// are filled (NCCL's rule); an all-reduce on the registered buffers is exact; deregistration
/// (this rank's own, as NCCL's) works in a group too, and the handles are gone after it.
#[test]
fn windows_registered_and_deregistered_inside_a_group_from_one_thread() {
    let lib = Lib::open();
    let start: abi::GroupFn = lib.sym("ncclGroupStart");
    let end: abi::GroupFn = lib.sym("ncclGroupEnd");
    let init_all: abi::CommInitAllFn = lib.sym("ncclCommInitAll");
    let mem_alloc: abi::MemAllocFn = lib.sym("ncclMemAlloc");
    let win_register: abi::CommWindowRegisterFn = lib.sym("ncclCommWindowRegister");
    let win_deregister: abi::CommWindowDeregisterFn = lib.sym("ncclCommWindowDeregister");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let ok = |r: c_int| assert_eq!(r, abi::SUCCESS, "{}", lib.last_error());
    let n = 3;
    let count = 777;
    let mut raws: Vec<RawComm> = vec![null_mut(); n];
    unsafe { ok(init_all(raws.as_mut_ptr(), n as c_int, std::ptr::null())) };
    let _comms: Vec<Comm> = raws.iter().map(|&raw| Comm { lib: &lib, raw }).collect();
    let mut bufs: Vec<*mut c_void> = vec![null_mut(); n];
    let mut wins: Vec<abi::RawWindow> = vec![null_mut(); n];
    unsafe {
        for b in bufs.iter_mut() {
            ok(mem_alloc(b, count * 4));
        }
        ok(start());
        for r in 0..n {
            ok(win_register(
                raws[r],
                bufs[r],
                count * 4,
                &mut wins[r],
                abi::WIN_COLL_SYMMETRIC,
            ));
        }
        assert!(
            wins.iter().all(|w| w.is_null()),
            "inside the group the handles are not filled yet"
        );
        ok(end());
        assert!(
            wins.iter().all(|w| !w.is_null()),
            "filled at the group's end"
        );
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| data(r, count, 31)).collect();
        for r in 0..n {
            std::ptr::copy_nonoverlapping(inputs[r].as_ptr(), bufs[r] as *mut f32, count);
        }
        ok(start());
        for r in 0..n {
            ok(all_reduce(
                bufs[r],
                bufs[r],
                count,
                FLOAT,
                SUM,
                raws[r],
                null_mut(),
            ));
        }
        ok(end());
        let want: Vec<f32> = (0..count)
            .map(|j| inputs.iter().map(|v| v[j]).sum())
            .collect();
        for r in 0..n {
            assert!(
                std::slice::from_raw_parts(bufs[r] as *const f32, count) == &want[..],
                "rank {r}"
            );
        }
        ok(start());
        for r in 0..n {
            ok(win_deregister(raws[r], wins[r]));
        }
        ok(end());
        assert_eq!(
            win_deregister(raws[0], wins[0]),
            abi::INVALID_ARGUMENT,
            "gone after the group"
        );
        let mem_free: abi::MemFreeFn = lib.sym("ncclMemFree");
        for b in bufs {
            ok(mem_free(b));
        }
    }
}

/// A simulated group estimates its operations' time without running them (the outputs stay
/// as they were); a bad simInfo is refused and leaves the group open; an inner level estimates
/// nothing; larger operations are estimated slower.
#[test]
fn group_simulate_end_estimates_without_running() {
    let lib = Lib::open();
    let start: abi::GroupFn = lib.sym("ncclGroupStart");
    let end: abi::GroupFn = lib.sym("ncclGroupEnd");
    let simulate: abi::GroupSimulateEndFn = lib.sym("ncclGroupSimulateEnd");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    job(&lib, 2, |r, c| unsafe {
        let estimate = |count: usize| {
            let mine = data(r, count, 9);
            let mut out = vec![-7f32; count];
            let mut sim = abi::SimInfo::initializer();
            assert_eq!(start(), abi::SUCCESS);
            assert_eq!(
                all_reduce(
                    mine.as_ptr() as *const c_void,
                    out.as_mut_ptr() as *mut c_void,
                    count,
                    FLOAT,
                    SUM,
                    c.raw,
                    null_mut()
                ),
                abi::SUCCESS
            );
            assert_eq!(simulate(&mut sim), abi::SUCCESS, "{}", lib.last_error());
            assert!(out.iter().all(|&x| x == -7.0), "a simulated operation ran");
            assert!(
                sim.estimated_time.is_finite() && sim.estimated_time > 0.0,
                "{sim:?}"
            );
            sim.estimated_time
        };
        let (small, large) = (estimate(2), estimate(1 << 20));
        assert!(
            large > 10.0 * small,
            "{small} us for 8 B, {large} us for 4 MiB"
        );

        // Refused: a wrong magic, a struct too small for the field, null. The group stays
        // open: its end then runs the operation, exactly.
        let mine = data(r, 100, 3);
        let mut out = vec![0f32; 100];
        assert_eq!(start(), abi::SUCCESS);
        assert_eq!(
            all_reduce(
                mine.as_ptr() as *const c_void,
                out.as_mut_ptr() as *mut c_void,
                100,
                FLOAT,
                SUM,
                c.raw,
                null_mut()
            ),
            abi::SUCCESS
        );
        let mut bad = abi::SimInfo {
            magic: 0xcafebeef,
            ..abi::SimInfo::initializer()
        };
        assert_eq!(simulate(&mut bad), abi::INVALID_ARGUMENT);
        let mut small_struct = abi::SimInfo {
            size: 16,
            ..abi::SimInfo::initializer()
        };
        assert_eq!(simulate(&mut small_struct), abi::INVALID_ARGUMENT);
        assert_eq!(small_struct.estimated_time, abi::UNDEF_FLOAT);
        assert_eq!(simulate(null_mut()), abi::INVALID_ARGUMENT);
        assert_eq!(end(), abi::SUCCESS, "{}", lib.last_error());
        let want: Vec<f32> = (0..100)
            .map(|i| data(0, 100, 3)[i] + data(1, 100, 3)[i])
            .collect();
        assert_eq!(out, want);

        // Nested: the inner simulated end estimates nothing; the outer end runs the operation.
        let mut out = vec![0f32; 100];
        let mut sim = abi::SimInfo::initializer();
        assert_eq!(start(), abi::SUCCESS);
        assert_eq!(start(), abi::SUCCESS);
        assert_eq!(
            all_reduce(
                mine.as_ptr() as *const c_void,
                out.as_mut_ptr() as *mut c_void,
                100,
                FLOAT,
                SUM,
                c.raw,
                null_mut()
            ),
            abi::SUCCESS
        );
        assert_eq!(simulate(&mut sim), abi::SUCCESS);
        assert_eq!(sim.estimated_time, abi::UNDEF_FLOAT);
        assert_eq!(end(), abi::SUCCESS);
        assert_eq!(out, want);
        // Outside a group: the same usage error as ncclGroupEnd's.
        assert_eq!(simulate(&mut sim), abi::INVALID_USAGE);
    });
}

/// Every libnccl symbol that PyTorch 2.11 and CuPy 14 import exists, with its profiling twin
/// (so their libraries load against ours); the device API's are refused with a clear text.
#[test]
fn every_symbol_pytorch_and_cupy_import_is_exported() {
    let lib = Lib::open();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/imports");
    let mut seen = 0;
    for file in ["torch-2.11.0-libtorch_cuda.txt", "cupy-cuda13x-14.2.0.txt"] {
        let list = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
        for name in list
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let _: *mut c_void = lib.sym(name);
            let _: *mut c_void = lib.sym(&format!("p{name}"));
            seen += 1;
        }
    }
    assert_eq!(seen, 38 + 22);
    let create: unsafe extern "C" fn(RawComm, *const c_void, *mut c_void) -> c_int =
        lib.sym("ncclDevCommCreate");
    let mut dev = [0u8; 256];
    assert_eq!(
        unsafe { create(null_mut(), null_mut(), dev.as_mut_ptr() as *mut c_void) },
        abi::INVALID_USAGE
    );
    assert!(
        lib.last_error()
            .contains("ncclDevCommCreate is not implemented"),
        "{}",
        lib.last_error()
    );
    assert!(dev.iter().all(|&b| b == 0));
}

/// Polls `ncclCommGetAsyncError` until the communicator is no longer in progress.
fn settle(lib: &Lib, comm: RawComm) -> c_int {
    let async_err: abi::CommGetAsyncErrorFn = lib.sym("ncclCommGetAsyncError");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let mut e = abi::IN_PROGRESS;
        assert_eq!(
            unsafe { async_err(comm, &mut e) },
            abi::SUCCESS,
            "{}",
            lib.last_error()
        );
        if e != abi::IN_PROGRESS || std::time::Instant::now() > until {
            return e;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Non-blocking communicators (config.blocking = 0): creation, split and shrink answer
/// ncclInProgress at once and finish in the background; the handle says "in progress" until
/// then, and works exactly after. Also one thread creating both ranks in one group.
#[test]
fn non_blocking_creation_split_and_shrink() {
    let lib = &Lib::open();
    let init_cfg: abi::CommInitRankConfigFn = lib.sym("ncclCommInitRankConfig");
    let split: abi::CommSplitFn = lib.sym("ncclCommSplit");
    let shrink: abi::CommShrinkFn = lib.sym("ncclCommShrink");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let start: abi::GroupFn = lib.sym("ncclGroupStart");
    let end: abi::GroupFn = lib.sym("ncclGroupEnd");
    let exact = &|c: RawComm, n: usize, r: usize, seed: u64, ranks: &[usize]| {
        let mine = data(r, 333, seed);
        let mut out = vec![0f32; 333];
        let res = unsafe {
            all_reduce(
                mine.as_ptr() as *const c_void,
                out.as_mut_ptr() as *mut c_void,
                333,
                FLOAT,
                SUM,
                c,
                null_mut(),
            )
        };
        assert_eq!(res, abi::SUCCESS, "{}", lib.last_error());
        let want: Vec<f32> = (0..333)
            .map(|i| ranks.iter().map(|&q| data(q, 333, seed)[i]).sum())
            .collect();
        assert_eq!(out, want, "{n} ranks");
    };
    let n = 3;
    let id = lib.unique_id();
    std::thread::scope(|s| {
        for r in 0..n {
            s.spawn(move || unsafe {
                let mut cfg = abi::Config::initializer();
                cfg.blocking = 0;
                let mut c: RawComm = null_mut();
                assert_eq!(
                    init_cfg(&mut c, n as c_int, id, r as c_int, &mut cfg),
                    abi::IN_PROGRESS,
                    "{}",
                    lib.last_error()
                );
                assert!(!c.is_null(), "the handle comes at once");
                assert_eq!(settle(lib, c), abi::SUCCESS, "{}", lib.last_error());
                let c = Comm { lib, raw: c };
                exact(c.raw, n, r, 5, &[0, 1, 2]);
                // Split: ranks 0 and 2 in color 1, rank 1 without a color (NULL at once).
                let mut sub: RawComm = null_mut();
                let color = if r == 1 { abi::SPLIT_NOCOLOR } else { 1 };
                assert_eq!(
                    split(c.raw, color, r as c_int, &mut sub, &mut cfg),
                    abi::IN_PROGRESS
                );
                if r == 1 {
                    assert!(sub.is_null());
                } else {
                    assert_eq!(settle(lib, sub), abi::SUCCESS, "{}", lib.last_error());
                    let sub = Comm { lib, raw: sub };
                    exact(sub.raw, 2, r / 2, 6, &[0, 1]);
                }
                // Shrink without rank 1, which makes no shrink call.
                if r != 1 {
                    let mut excl = [1 as c_int];
                    let mut sh: RawComm = null_mut();
                    assert_eq!(
                        shrink(c.raw, excl.as_mut_ptr(), 1, &mut sh, &mut cfg, 0),
                        abi::IN_PROGRESS
                    );
                    assert_eq!(settle(lib, sh), abi::SUCCESS, "{}", lib.last_error());
                    let sh = Comm { lib, raw: sh };
                    exact(sh.raw, 2, r / 2, 7, &[0, 1]);
                }
            });
        }
    });

    // One thread, both ranks, in one group: the end answers ncclInProgress.
    let id = lib.unique_id();
    let mut comms: [RawComm; 2] = [null_mut(); 2];
    unsafe {
        let mut cfg = abi::Config::initializer();
        cfg.blocking = 0;
        assert_eq!(start(), abi::SUCCESS);
        for (r, c) in comms.iter_mut().enumerate() {
            assert_eq!(
                init_cfg(c, 2, id, r as c_int, &mut cfg),
                abi::SUCCESS,
                "inside a group the creation waits for the end"
            );
        }
        assert_eq!(end(), abi::IN_PROGRESS, "{}", lib.last_error());
    }
    for c in comms {
        assert_eq!(settle(lib, c), abi::SUCCESS, "{}", lib.last_error());
    }
    let comms: Vec<Comm> = comms.into_iter().map(|raw| Comm { lib, raw }).collect();
    std::thread::scope(|s| {
        for (r, c) in comms.iter().enumerate() {
            let raw = c.raw as usize;
            s.spawn(move || exact(raw as RawComm, 2, r, 8, &[0, 1]));
        }
    });
}

/// NCCL_COMM_ID and NCCL_SOCKET_IFNAME, in child processes (the environment is the process's):
/// with an agreed address every rank makes its own id and the job runs, exact; a bad address or
/// an interface that does not exist is refused by ncclGetUniqueId with what to give.
#[test]
fn nccl_comm_id_and_socket_ifname_from_the_environment() {
    const ROLE: &str = "FERROCCL_NCCL_ENV_TEST";
    if let Ok(role) = std::env::var(ROLE) {
        let lib = Lib::open();
        let get_id: abi::GetUniqueIdFn = lib.sym("ncclGetUniqueId");
        let mut id = UniqueId::zeroed();
        let res = unsafe { get_id(&mut id) };
        match role.as_str() {
            "job" => {
                assert_eq!(res, abi::SUCCESS, "{}", lib.last_error());
                let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
                std::thread::scope(|s| {
                    for r in 0..2 {
                        let lib = &lib;
                        s.spawn(move || {
                            // Each rank its own id, as separate processes would.
                            let mut mine = UniqueId::zeroed();
                            assert_eq!(unsafe { get_id(&mut mine) }, abi::SUCCESS);
                            assert_eq!(mine.to_bytes(), id.to_bytes(), "the same id everywhere");
                            let c = lib.init_rank(2, mine, r);
                            let d = data(r, 500, 11);
                            let mut out = vec![0f32; 500];
                            let res = unsafe {
                                all_reduce(
                                    d.as_ptr() as *const c_void,
                                    out.as_mut_ptr() as *mut c_void,
                                    500,
                                    FLOAT,
                                    SUM,
                                    c.raw,
                                    null_mut(),
                                )
                            };
                            assert_eq!(res, abi::SUCCESS, "{}", lib.last_error());
                            let want: Vec<f32> = (0..500)
                                .map(|i| data(0, 500, 11)[i] + data(1, 500, 11)[i])
                                .collect();
                            assert_eq!(out, want);
                        });
                    }
                });
            }
            "bad-ifname" => {
                assert_eq!(res, abi::INVALID_ARGUMENT);
                let e = lib.last_error();
                assert!(
                    e.contains("NCCL_SOCKET_IFNAME=nosuchif0")
                        && e.contains("no interface that is up matches")
                        && e.contains("lo"),
                    "{e}"
                );
            }
            "bad-comm-id" => {
                assert_eq!(res, abi::INVALID_ARGUMENT);
                let e = lib.last_error();
                assert!(
                    e.contains("NCCL_COMM_ID=127.0.0.1") && e.contains("host:port"),
                    "{e}"
                );
            }
            other => panic!("unknown role {other}"),
        }
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let runs = [
        (
            "job",
            vec![
                ("NCCL_COMM_ID", format!("127.0.0.1:{port}")),
                ("NCCL_SOCKET_IFNAME", "lo".to_string()),
            ],
        ),
        (
            "bad-ifname",
            vec![("NCCL_SOCKET_IFNAME", "nosuchif0".to_string())],
        ),
        (
            "bad-comm-id",
            vec![("NCCL_COMM_ID", "127.0.0.1".to_string())],
        ),
    ];
    for (role, env) in runs {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "nccl_comm_id_and_socket_ifname_from_the_environment",
                "--exact",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(ROLE, role)
            .env("FERROCCL_NCCL_BACKEND", "host")
            .envs(env)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{role}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Threads of this process whose name starts with `prefix` (Linux cuts names to 15 bytes).
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|n| n.starts_with(prefix))
        .count()
}

/// ncclCommAbort on a non-blocking communicator whose creation still waits for a rank that
/// never comes ends the creation at once: its thread is gone within a second, not at the
/// deadline (60 s here). In a child process, so that no other test's threads count.
#[test]
fn aborting_a_non_blocking_creation_in_progress_ends_it() {
    const ROLE: &str = "FERROCCL_NCCL_ABORT_TEST";
    if std::env::var(ROLE).is_err() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "aborting_a_non_blocking_creation_in_progress_ends_it",
                "--exact",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(ROLE, "1")
            .env("FERROCCL_TIMEOUT", "60")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let lib = Lib::open();
    let init_cfg: abi::CommInitRankConfigFn = lib.sym("ncclCommInitRankConfig");
    let abort: abi::CommFn = lib.sym("ncclCommAbort");
    let async_err: abi::CommGetAsyncErrorFn = lib.sym("ncclCommGetAsyncError");
    let mut cfg = abi::Config::initializer();
    cfg.blocking = 0;
    let mut c: RawComm = null_mut();
    assert_eq!(
        unsafe { init_cfg(&mut c, 2, lib.unique_id(), 0, &mut cfg) },
        abi::IN_PROGRESS
    );
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut e = 0;
    assert_eq!(unsafe { async_err(c, &mut e) }, abi::SUCCESS);
    assert_eq!(e, abi::IN_PROGRESS, "rank 1 never comes");
    // The creation's thread, and any it started (unnamed threads take their creator's name).
    assert!(threads_named("ferroccl-nccl-i") >= 1);
    let t = std::time::Instant::now();
    assert_eq!(unsafe { abort(c) }, abi::SUCCESS, "{}", lib.last_error());
    while threads_named("ferroccl-nccl-i") > 0 {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(1),
            "the creation still runs {:?} after its abort",
            t.elapsed()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    eprintln!(
        "a non-blocking creation ended {:?} after ncclCommAbort",
        t.elapsed()
    );
    assert_eq!(
        unsafe { async_err(c, &mut e) },
        abi::INVALID_ARGUMENT,
        "the handle is gone"
    );
}

/// Split and shrink inside a group, from one thread driving every rank: the new handles come at
/// once, the communicators at the group's end (a split without a color gives NULL), and a group
/// of all-reduces on them is exact.
#[test]
fn split_and_shrink_inside_groups_from_one_thread() {
    let lib = Lib::open();
    let start: abi::GroupFn = lib.sym("ncclGroupStart");
    let end: abi::GroupFn = lib.sym("ncclGroupEnd");
    let init_all: abi::CommInitAllFn = lib.sym("ncclCommInitAll");
    let split: abi::CommSplitFn = lib.sym("ncclCommSplit");
    let shrink: abi::CommShrinkFn = lib.sym("ncclCommShrink");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let count_of: abi::CommIntFn = lib.sym("ncclCommCount");
    let ok = |r: c_int| assert_eq!(r, abi::SUCCESS, "{}", lib.last_error());
    let n = 5;
    let mut raws: Vec<RawComm> = vec![null_mut(); n];
    unsafe { ok(init_all(raws.as_mut_ptr(), n as c_int, std::ptr::null())) };
    let parents: Vec<Comm> = raws.iter().map(|&raw| Comm { lib: &lib, raw }).collect();
    // Exact all-reduces on `comms` (rank order), over the parents' ranks `members`.
    let check = |comms: &[RawComm], members: &[usize], seed: u64| unsafe {
        let count = 301;
        let inputs: Vec<Vec<f32>> = members.iter().map(|&r| data(r, count, seed)).collect();
        let mut outs = vec![vec![f32::NAN; count]; comms.len()];
        ok(start());
        for (i, &c) in comms.iter().enumerate() {
            ok(all_reduce(
                inputs[i].as_ptr() as *const c_void,
                outs[i].as_mut_ptr() as *mut c_void,
                count,
                FLOAT,
                SUM,
                c,
                null_mut(),
            ));
        }
        ok(end());
        let want: Vec<f32> = (0..count)
            .map(|j| inputs.iter().map(|v| v[j]).sum())
            .collect();
        assert!(outs.iter().all(|o| *o == want), "members {members:?}");
    };
    // Split: even ranks in color 0, odd in 1, rank 4 without a color.
    let mut subs: Vec<RawComm> = vec![null_mut(); n];
    unsafe {
        ok(start());
        for r in 0..n {
            let color = if r == 4 {
                abi::SPLIT_NOCOLOR
            } else {
                (r % 2) as c_int
            };
            ok(split(
                parents[r].raw,
                color,
                r as c_int,
                &mut subs[r],
                null_mut(),
            ));
            assert_eq!(subs[r].is_null(), r == 4, "handles come at once");
        }
        ok(end());
    }
    let subs: Vec<Comm> = subs
        .into_iter()
        .filter(|c| !c.is_null())
        .map(|raw| Comm { lib: &lib, raw })
        .collect();
    let mut k = 0;
    unsafe { ok(count_of(subs[0].raw, &mut k)) };
    assert_eq!(k, 2);
    check(&[subs[0].raw, subs[2].raw], &[0, 2], 21);
    check(&[subs[1].raw, subs[3].raw], &[1, 3], 22);
    // Shrink without rank 2 (which makes no call).
    let mut shrunk: Vec<RawComm> = vec![null_mut(); n];
    unsafe {
        ok(start());
        for r in [0, 1, 3, 4] {
            let mut excl = [2 as c_int];
            ok(shrink(
                parents[r].raw,
                excl.as_mut_ptr(),
                1,
                &mut shrunk[r],
                null_mut(),
                0,
            ));
        }
        ok(end());
    }
    let shrunk: Vec<Comm> = shrunk
        .into_iter()
        .filter(|c| !c.is_null())
        .map(|raw| Comm { lib: &lib, raw })
        .collect();
    assert_eq!(shrunk.len(), 4);
    check(
        &shrunk.iter().map(|c| c.raw).collect::<Vec<_>>(),
        &[0, 1, 3, 4],
        23,
    );
}

/// ncclCommAbort from another thread while an operation waits on the communicator (its peer
/// never calls): the waiting call returns an error within a second, the handle is gone after,
/// and the peer's next call and its async error report the abort.
#[test]
fn abort_from_another_thread_frees_a_waiting_call() {
    let lib = Lib::open();
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    let abort: abi::CommFn = lib.sym("ncclCommAbort");
    let async_err: abi::CommGetAsyncErrorFn = lib.sym("ncclCommGetAsyncError");
    let id = lib.unique_id();
    let comms: Vec<Comm> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                s.spawn({
                    let lib = &lib;
                    move || lib.init_rank(2, id, r)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut comms = comms.into_iter();
    let mut c0 = comms.next().unwrap();
    let c1 = comms.next().unwrap();
    let raw0 = c0.raw as usize;
    let mine = data(0, 1 << 16, 4);
    let mut out = vec![0f32; 1 << 16];
    let (res, took) = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let r = unsafe {
                all_reduce(
                    mine.as_ptr() as *const c_void,
                    out.as_mut_ptr() as *mut c_void,
                    1 << 16,
                    FLOAT,
                    SUM,
                    raw0 as RawComm,
                    null_mut(),
                )
            };
            (r, std::time::Instant::now())
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        let t = std::time::Instant::now();
        assert_eq!(
            unsafe { abort(raw0 as RawComm) },
            abi::SUCCESS,
            "{}",
            lib.last_error()
        );
        let (r, at) = waiter.join().unwrap();
        (r, at.saturating_duration_since(t))
    });
    c0.raw = null_mut();
    assert_ne!(res, abi::SUCCESS, "the waiting all-reduce was aborted");
    assert!(took < std::time::Duration::from_secs(1), "{took:?}");
    let mut e = 0;
    assert_eq!(
        unsafe { async_err(raw0 as RawComm, &mut e) },
        abi::INVALID_ARGUMENT,
        "the aborted handle is gone"
    );
    // The peer learns of it: its next call fails naming rank 0, and its async error says so.
    let res = unsafe {
        all_reduce(
            mine.as_ptr() as *const c_void,
            out.as_mut_ptr() as *mut c_void,
            16,
            FLOAT,
            SUM,
            c1.raw,
            null_mut(),
        )
    };
    assert_ne!(res, abi::SUCCESS);
    assert!(lib.last_error().contains("rank 0"), "{}", lib.last_error());
    assert_eq!(unsafe { async_err(c1.raw, &mut e) }, abi::SUCCESS);
    assert_ne!(e, abi::SUCCESS);
}

/// ncclConfig_t is read size-tolerantly: an older, shorter struct whose `size` ends before
/// `blocking` is blocking whatever lies beyond it; a newer, longer one and an older version
/// number are accepted; NULL is the default.
#[test]
fn configs_of_other_sizes_and_versions() {
    let lib = Lib::open();
    let init_cfg: abi::CommInitRankConfigFn = lib.sym("ncclCommInitRankConfig");
    let off = std::mem::offset_of!(abi::Config, blocking);
    // A buffer larger than our struct: a "newer" caller's.
    #[repr(C, align(8))]
    struct Big([u8; 256]);
    let make = |size: usize, version: u32, blocking: i32| {
        let mut b = Big([0xAB; 256]);
        let c = abi::Config {
            size,
            version,
            blocking,
            ..abi::Config::initializer()
        };
        unsafe {
            std::ptr::copy_nonoverlapping(
                &c as *const abi::Config as *const u8,
                b.0.as_mut_ptr(),
                std::mem::size_of::<abi::Config>(),
            )
        };
        b
    };
    let cases: [(Big, c_int); 4] = [
        // Ends before `blocking`: the 0 beyond its size is not read.
        (make(off, 21403, 0), abi::SUCCESS),
        // Newer and longer, blocking.
        (make(256, abi::API_VERSION as u32 + 100, 1), abi::SUCCESS),
        // Our size and an older version, undefined blocking.
        (
            make(
                std::mem::size_of::<abi::Config>(),
                21800,
                abi::CONFIG_UNDEF_INT,
            ),
            abi::SUCCESS,
        ),
        // Newer and longer, non-blocking.
        (
            make(256, abi::API_VERSION as u32 + 100, 0),
            abi::IN_PROGRESS,
        ),
    ];
    for (mut big, want) in cases {
        let mut c: RawComm = null_mut();
        let got = unsafe {
            init_cfg(
                &mut c,
                1,
                lib.unique_id(),
                0,
                big.0.as_mut_ptr() as *mut abi::Config,
            )
        };
        assert_eq!(got, want, "{}", lib.last_error());
        if want == abi::IN_PROGRESS {
            assert_eq!(settle(&lib, c), abi::SUCCESS);
        }
        drop(Comm { lib: &lib, raw: c });
    }
    let mut c: RawComm = null_mut();
    assert_eq!(
        unsafe { init_cfg(&mut c, 1, lib.unique_id(), 0, null_mut()) },
        abi::SUCCESS
    );
    drop(Comm { lib: &lib, raw: c });
}

/// Operations of one communicator inside one group may name different streams (the host
/// backend has none, so they only have to be accepted and run exactly; on GPUs the launch stream
/// and the others are ordered with events).
#[test]
fn one_group_may_use_several_streams_per_communicator() {
    let lib = Lib::open();
    let start: abi::GroupFn = lib.sym("ncclGroupStart");
    let end: abi::GroupFn = lib.sym("ncclGroupEnd");
    let all_reduce: abi::AllReduceFn = lib.sym("ncclAllReduce");
    job(&lib, 2, |r, c| unsafe {
        let (a, b) = (data(r, 64, 31), data(r, 96, 32));
        let (mut oa, mut ob) = (vec![0f32; 64], vec![0f32; 96]);
        assert_eq!(start(), abi::SUCCESS);
        assert_eq!(
            all_reduce(
                a.as_ptr() as *const c_void,
                oa.as_mut_ptr() as *mut c_void,
                64,
                FLOAT,
                SUM,
                c.raw,
                0x10 as abi::RawStream
            ),
            abi::SUCCESS
        );
        assert_eq!(
            all_reduce(
                b.as_ptr() as *const c_void,
                ob.as_mut_ptr() as *mut c_void,
                96,
                FLOAT,
                SUM,
                c.raw,
                0x20 as abi::RawStream
            ),
            abi::SUCCESS
        );
        assert_eq!(end(), abi::SUCCESS, "{}", lib.last_error());
        assert_eq!(
            oa,
            (0..64)
                .map(|i| data(0, 64, 31)[i] + data(1, 64, 31)[i])
                .collect::<Vec<_>>()
        );
        assert_eq!(
            ob,
            (0..96)
                .map(|i| data(0, 96, 32)[i] + data(1, 96, 32)[i])
                .collect::<Vec<_>>()
        );
    });
}
