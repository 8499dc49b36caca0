use super::fifo::{Header, Meta};
use super::tcp::{tcp_receiver, tcp_sender};
use super::*;
use crate::Error;
use std::io::{Read, Write};
use std::mem::{offset_of, size_of};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// Period of the test byte pattern; prime, so a slot delivered at the wrong offset or twice
/// cannot match by accident.
const PERIOD: usize = 251;

fn pattern(max_len: usize) -> Vec<u8> {
    (0..max_len + PERIOD).map(|i| (i % PERIOD) as u8).collect()
}

fn msg_len(k: usize, slot_bytes: usize, vary: bool) -> usize {
    if vary {
        1 + (k.wrapping_mul(7919) % slot_bytes)
    } else {
        slot_bytes
    }
}

/// Streams `total` numbered bytes; with `vary`, message sizes cycle through odd lengths.
fn send_stream(p: &mut Producer, total: usize, vary: bool) -> Result<(), Error> {
    let sb = p.slot_bytes();
    let pat = pattern(sb);
    let (mut pos, mut k) = (0usize, 0usize);
    while pos < total {
        let slot = loop {
            match p.try_reserve()? {
                Some(s) => break s,
                None => p.wait(Duration::from_millis(10)),
            }
        };
        let len = msg_len(k, sb, vary).min(total - pos);
        let off = pos % PERIOD;
        // SAFETY: a reserved slot has slot_bytes writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(pat[off..].as_ptr(), slot, len) };
        p.commit(len);
        pos += len;
        k += 1;
    }
    Ok(())
}

/// Receives and checks `total` numbered bytes.
fn recv_stream(c: &mut Consumer, total: usize) -> Result<(), Error> {
    let pat = pattern(c.slot_bytes());
    let mut pos = 0usize;
    while pos < total {
        let Some((p, len)) = c.try_peek()? else {
            c.wait(Duration::from_millis(10));
            continue;
        };
        assert!(len <= total - pos, "overlong message at byte {pos}");
        // SAFETY: a peeked slot holds `len` published bytes until release.
        let got = unsafe { std::slice::from_raw_parts(p, len) };
        let off = pos % PERIOD;
        if got != &pat[off..off + len] {
            let i = got
                .iter()
                .zip(&pat[off..])
                .position(|(a, b)| a != b)
                .unwrap();
            panic!(
                "mismatch at stream byte {}: got {} expected {}",
                pos + i,
                got[i],
                pat[off + i]
            );
        }
        c.release();
        pos += len;
    }
    Ok(())
}

fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        thread::sleep(Duration::from_millis(2));
    }
    cond()
}

fn unique_name(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "/ferroccl-test-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn dev_shm_has(name: &str) -> bool {
    std::path::Path::new("/dev/shm")
        .join(name.trim_start_matches('/'))
        .exists()
}

fn mib_per_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64()
}

// ---------------------------------------------------------------------------------------
// Child processes: the test binary re-runs itself with only `child_process_entry` selected
// and the role in an environment variable.

const CHILD_ENV: &str = "FERROCCL_TRANSPORT_TEST_CHILD";

fn spawn_child(role: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "transport::tests::child_process_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, role)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn child test process")
}

#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return;
    };
    let args: Vec<&str> = role.split(' ').collect();
    let layout = FifoLayout {
        slots: args[2].parse().unwrap(),
        slot_bytes: args[3].parse().unwrap(),
    };
    let never = AtomicBool::new(false);
    let mem = FifoMem::shm_open(
        args[1],
        layout,
        Instant::now() + Duration::from_secs(30),
        &never,
    )
    .unwrap();
    let mut p = Producer::new(mem);
    match args[0] {
        "send" => send_stream(&mut p, args[4].parse().unwrap(), false).unwrap(),
        "hold" => {
            send_stream(&mut p, 1, false).unwrap();
            thread::sleep(Duration::from_secs(60));
        }
        "poison" => {
            thread::sleep(Duration::from_millis(100));
            p.poison("child process gave up");
            // The FIFO must still be poisoned after we are gone.
        }
        r => panic!("unknown child role {r}"),
    }
}

// ---------------------------------------------------------------------------------------
// Layout

#[test]
fn header_layout_is_stable() {
    // Two processes built from different commits must agree on this; bump READY_MAGIC on change.
    assert_eq!(size_of::<Meta>(), 64);
    assert_eq!(offset_of!(Meta, magic), 0);
    assert_eq!(offset_of!(Meta, slots), 4);
    assert_eq!(offset_of!(Meta, slot_bytes), 8);
    assert_eq!(offset_of!(Meta, producer_pid), 16);
    assert_eq!(offset_of!(Meta, consumer_pid), 20);
    assert_eq!(offset_of!(Meta, producer_closed), 24);
    assert_eq!(offset_of!(Meta, consumer_closed), 28);
    assert_eq!(offset_of!(Meta, poison), 32);
    assert_eq!(offset_of!(Meta, reason_len), 36);
    assert_eq!(offset_of!(Header, meta), 0);
    assert_eq!(offset_of!(Header, head), 64);
    assert_eq!(offset_of!(Header, tail), 128);
    assert_eq!(offset_of!(Header, consumer_wait), 192);
    assert_eq!(offset_of!(Header, producer_wait), 256);
    assert_eq!(offset_of!(Header, reason), 320);
    assert_eq!(size_of::<Header>(), 576);
    let l = FifoLayout {
        slots: 8,
        slot_bytes: 4096,
    };
    assert_eq!(l.data_offset(), 640);
    assert_eq!(l.total_bytes(), 640 + 8 * 4096);
    let odd = FifoLayout {
        slots: 3,
        slot_bytes: 100,
    };
    assert_eq!(odd.total_bytes() % 64, 0);
    assert!(odd.total_bytes() >= 576 + 12 + 300);
}

#[test]
fn invalid_layouts_are_rejected() {
    for l in [
        FifoLayout {
            slots: 0,
            slot_bytes: 64,
        },
        FifoLayout {
            slots: 4,
            slot_bytes: 0,
        },
        FifoLayout {
            slots: u32::MAX,
            slot_bytes: usize::MAX / 2,
        },
    ] {
        assert!(
            matches!(FifoMem::heap(l), Err(Error::InvalidArgument(_))),
            "{l:?}"
        );
    }
    assert!(matches!(
        FifoMem::shm_create(
            "a/b",
            FifoLayout {
                slots: 1,
                slot_bytes: 64
            }
        ),
        Err(Error::InvalidArgument(_))
    ));
}

// ---------------------------------------------------------------------------------------
// Heap FIFOs between threads

fn heap_stream(slots: u32, slot_bytes: usize, total: usize, vary: bool) -> Duration {
    let mem = FifoMem::heap(FifoLayout { slots, slot_bytes }).unwrap();
    let mut p = Producer::new(mem.clone());
    let mut c = Consumer::new(mem);
    assert_eq!(p.peer_pid(), std::process::id());
    assert_eq!(c.peer_pid(), std::process::id());
    let t0 = Instant::now();
    let tx = thread::spawn(move || send_stream(&mut p, total, vary).unwrap());
    recv_stream(&mut c, total).unwrap();
    tx.join().unwrap();
    let d = t0.elapsed();
    // The producer was dropped with everything delivered: the consumer now sees the close.
    assert!(matches!(c.try_peek(), Err(Error::Remote(_))));
    d
}

#[test]
fn heap_fifo_one_slot_streams_10mb() {
    heap_stream(1, 4096, 10_000_000, true);
}

#[test]
fn heap_fifo_eight_slots_streams_10mb() {
    heap_stream(8, 64 << 10, 10_000_000, true);
}

#[test]
fn heap_fifo_throughput() {
    let total = 64 << 20;
    let d = heap_stream(8, 256 << 10, total, false);
    println!(
        "heap FIFO, 8 x 256 KiB slots, 64 MiB between threads: {:.0} MiB/s",
        mib_per_s(total, d)
    );
}

#[test]
fn counters_wrap_around_with_odd_slot_count() {
    let mem = FifoMem::heap(FifoLayout {
        slots: 3,
        slot_bytes: 64,
    })
    .unwrap();
    let start = u32::MAX - 4;
    mem.header().head.value.store(start, Ordering::Relaxed);
    mem.header().tail.value.store(start, Ordering::Relaxed);
    let mut p = Producer::new(mem.clone());
    let mut c = Consumer::new(mem.clone());
    let tx = thread::spawn(move || send_stream(&mut p, 20_000, true).unwrap());
    recv_stream(&mut c, 20_000).unwrap();
    tx.join().unwrap();
    assert!(
        mem.header().head.value.load(Ordering::Relaxed) < 1000,
        "head did not wrap"
    );
}

#[test]
fn reserve_is_idempotent_and_full_fifo_reports_none() {
    let mem = FifoMem::heap(FifoLayout {
        slots: 2,
        slot_bytes: 64,
    })
    .unwrap();
    let mut p = Producer::new(mem.clone());
    let mut c = Consumer::new(mem);
    let a = p.try_reserve().unwrap().unwrap();
    assert_eq!(p.try_reserve().unwrap().unwrap(), a);
    p.commit(10);
    let b = p.try_reserve().unwrap().unwrap();
    assert_ne!(a, b);
    p.commit(64);
    assert_eq!(p.try_reserve().unwrap(), None);
    let t0 = Instant::now();
    p.wait(Duration::from_millis(30));
    assert!(
        t0.elapsed() >= Duration::from_millis(25),
        "wait on a full FIFO returned early"
    );
    assert_eq!(c.try_peek().unwrap().unwrap(), (a as *const u8, 10));
    assert_eq!(c.try_peek().unwrap().unwrap(), (a as *const u8, 10));
    c.release();
    assert_eq!(p.try_reserve().unwrap().unwrap(), a);
    assert_eq!(c.try_peek().unwrap().unwrap(), (b as *const u8, 64));
    c.release();
    assert_eq!(c.try_peek().unwrap(), None);
}

#[test]
fn waiter_is_woken_by_commit_and_release() {
    let mem = FifoMem::heap(FifoLayout {
        slots: 1,
        slot_bytes: 64,
    })
    .unwrap();
    let mut p = Producer::new(mem.clone());
    let mut c = Consumer::new(mem);
    let rx = thread::spawn(move || {
        while c.try_peek().unwrap().is_none() {
            c.wait(Duration::from_secs(5));
        }
        let woke = Instant::now();
        c.release();
        woke
    });
    thread::sleep(Duration::from_millis(100));
    p.try_reserve().unwrap().unwrap();
    let committed = Instant::now();
    p.commit(1);
    // Woken by the commit, not by the 5 s timeout; the margin covers a loaded 2-core machine
    // running the whole suite at once.
    let after = rx.join().unwrap().saturating_duration_since(committed);
    assert!(
        after < Duration::from_secs(1),
        "consumer woke {after:?} after the commit"
    );
}

fn assert_remote(r: Result<impl std::fmt::Debug, Error>, needle: &str) {
    assert_remote_any(r, &[needle]);
}

/// A Remote error whose reason contains one of `needles`.
fn assert_remote_any(r: Result<impl std::fmt::Debug, Error>, needles: &[&str]) {
    match r {
        Err(Error::Remote(m)) => assert!(
            needles.iter().any(|n| m.contains(n)),
            "reason '{m}' lacks each of {needles:?}"
        ),
        other => panic!("expected Remote error containing one of {needles:?}, got {other:?}"),
    }
}

#[test]
fn poison_from_producer_wakes_consumer_and_reports_reason() {
    let mem = FifoMem::heap(FifoLayout {
        slots: 4,
        slot_bytes: 64,
    })
    .unwrap();
    let mut p = Producer::new(mem.clone());
    let mut c = Consumer::new(mem);
    // Published data is still delivered before the error.
    p.try_reserve().unwrap().unwrap();
    p.commit(5);
    let rx = thread::spawn(move || {
        assert_eq!(c.try_peek().unwrap().unwrap().1, 5);
        c.release();
        assert!(c.try_peek().unwrap().is_none());
        c.wait(Duration::from_secs(5));
        let woke = Instant::now();
        (woke, c.try_peek().map(|o| o.map(|(_, n)| n)))
    });
    thread::sleep(Duration::from_millis(100));
    let poisoned = Instant::now();
    p.poison("rank 2 failed: out of memory");
    let (woke, r) = rx.join().unwrap();
    // Woken by the poison, not by the 5 s timeout (the margin is for a loaded CI machine).
    assert!(
        woke.duration_since(poisoned) < Duration::from_secs(1),
        "woke {:?} after poison",
        woke - poisoned
    );
    assert_remote(r, "rank 2 failed: out of memory");
    assert!(p.try_reserve().is_err());
}

#[test]
fn poison_from_consumer_wakes_producer_and_reports_reason() {
    let mem = FifoMem::heap(FifoLayout {
        slots: 1,
        slot_bytes: 64,
    })
    .unwrap();
    let mut p = Producer::new(mem.clone());
    let c = Consumer::new(mem);
    p.try_reserve().unwrap().unwrap();
    p.commit(1);
    let tx = thread::spawn(move || {
        assert!(p.try_reserve().unwrap().is_none());
        p.wait(Duration::from_secs(5));
        let woke = Instant::now();
        (woke, p.try_reserve().map(|o| o.is_some()))
    });
    thread::sleep(Duration::from_millis(100));
    let poisoned = Instant::now();
    // A long multi-byte reason is cut at a character boundary, not mid-character.
    let reason = format!("consumer gave up {}", "é".repeat(200));
    c.poison(&reason);
    let (woke, r) = tx.join().unwrap();
    assert!(
        woke.duration_since(poisoned) < Duration::from_secs(1),
        "woke {:?} after poison",
        woke - poisoned
    );
    match r {
        Err(Error::Remote(m)) => {
            assert!(m.starts_with("consumer gave up é"));
            assert!(
                m.len() <= 240 && reason.starts_with(m.strip_suffix('…').unwrap()),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// A peer's error as it is spread (a chained message longer than a poison reason holds), the
/// one a user saw cut to "called a d; and: ..." and "not heard from rank(s) ;".
fn long_reason() -> String {
    "rank 1 failed: all_reduce #5 on rank 1 of 4: waited past the deadline (FERROCCL_TIMEOUT) for data from rank 2 \
     (node-a, pid 4242, 10.0.0.2:41234) on channel 0 over shm; not heard from rank(s) [2]: they are stuck, slow, or \
     called a different operation (raise FERROCCL_TIMEOUT if they are only slow)"
        .to_string()
}

/// The message ends with the clip mark after a whole word of `reason`: no cut word, no empty list.
fn assert_clipped_between_words(m: &str, reason: &str) {
    let kept = m
        .strip_suffix(" …")
        .unwrap_or_else(|| panic!("no clip mark: {m}"));
    let last = kept.rsplit(' ').next().unwrap();
    let words: Vec<&str> = reason.split(' ').collect();
    assert!(
        words
            .iter()
            .any(|w| w.trim_end_matches([',', ';', ':']) == last),
        "cut mid-word ({last:?}): {m}"
    );
    assert!(!kept.ends_with(['[', '(', ':', ';', ',']), "{m}");
}

#[test]
fn a_long_poison_reason_is_clipped_between_words_over_shm_and_tcp() {
    let reason = long_reason();
    assert!(reason.len() > 240);
    // Shared memory (here on the heap: the same header).
    let mem = FifoMem::heap(FifoLayout {
        slots: 1,
        slot_bytes: 64,
    })
    .unwrap();
    let mut c = Consumer::new(mem.clone());
    mem.poison(&reason);
    let m = c.try_peek().unwrap_err().message().to_string();
    assert!(
        m.len() <= 240 && reason.starts_with(m.strip_suffix(" …").unwrap_or(&m)),
        "{m}"
    );
    assert_clipped_between_words(&m, &reason);
    // TCP: the sender's poison frame, then the receiver's own FIFO.
    let layout = FifoLayout {
        slots: 2,
        slot_bytes: 64,
    };
    let (a, b) = socket_pair();
    let p = tcp_sender(
        a,
        layout,
        FrameCheck::None,
        "rank 1 channel 0".into(),
        no_abort(),
    )
    .unwrap();
    let mut c = tcp_receiver(
        b,
        layout,
        FrameCheck::None,
        "rank 0 channel 0".into(),
        no_abort(),
    )
    .unwrap();
    p.poison(&reason);
    let r = loop {
        match c.try_peek() {
            Ok(None) => c.wait(Duration::from_millis(100)),
            other => break other,
        }
    };
    let m = r.unwrap_err().message().to_string();
    assert!(
        m.contains("the peer failed") && m.contains("rank 1 failed: all_reduce #5"),
        "{m}"
    );
    assert_clipped_between_words(&m, &reason);
}

#[test]
fn first_poison_wins() {
    let mem = FifoMem::heap(FifoLayout {
        slots: 1,
        slot_bytes: 64,
    })
    .unwrap();
    let mut c = Consumer::new(mem.clone());
    mem.poison("first");
    mem.poison("second");
    assert_remote(c.try_peek(), "first");
}

#[test]
fn dropped_consumer_fails_producer() {
    let mem = FifoMem::heap(FifoLayout {
        slots: 1,
        slot_bytes: 64,
    })
    .unwrap();
    let mut p = Producer::new(mem.clone());
    drop(Consumer::new(mem));
    assert!(p.peer_closed());
    assert_remote(p.try_reserve(), "closed");
}

#[test]
fn pid_alive_basics() {
    assert!(pid_alive(std::process::id()));
    assert!(pid_alive(1)); // init exists; EPERM counts as alive
    assert!(!pid_alive(u32::MAX));
    assert!(pid_alive(0), "unattached peer is not reported dead");
}

// ---------------------------------------------------------------------------------------
// Shared memory

#[test]
fn shm_fifo_between_processes_streams_64mib() {
    let name = unique_name("stream");
    let (slots, sb, total) = (8u32, 256usize << 10, 64usize << 20);
    let mem = FifoMem::shm_create(
        &name,
        FifoLayout {
            slots,
            slot_bytes: sb,
        },
    )
    .unwrap();
    let mut c = Consumer::new(mem);
    let mut child = spawn_child(&format!("send {name} {slots} {sb} {total}"));
    // Time from the first slot, so process start-up is not counted.
    while c.try_peek().unwrap().is_none() {
        c.wait(Duration::from_millis(10));
    }
    let t0 = Instant::now();
    recv_stream(&mut c, total).unwrap();
    let d = t0.elapsed();
    assert_eq!(c.peer_pid(), child.id());
    assert!(child.wait().unwrap().success());
    assert!(!dev_shm_has(&name), "sender should have unlinked the name");
    FifoMem::shm_unlink(&name);
    println!(
        "shm FIFO, 8 x 256 KiB slots, 64 MiB between processes: {:.0} MiB/s",
        mib_per_s(total, d)
    );
}

#[test]
fn shm_open_retries_until_created_then_unlinks() {
    let name = unique_name("late");
    let layout = FifoLayout {
        slots: 4,
        slot_bytes: 1024,
    };
    let n2 = name.clone();
    let opener = thread::spawn(move || {
        let never = AtomicBool::new(false);
        let mem = FifoMem::shm_open(
            &n2,
            layout,
            Instant::now() + Duration::from_secs(10),
            &never,
        )
        .unwrap();
        let mut p = Producer::new(mem);
        send_stream(&mut p, 100_000, true).unwrap();
    });
    thread::sleep(Duration::from_millis(100));
    let mem = FifoMem::shm_create(&name, layout).unwrap();
    let mut c = Consumer::new(mem);
    recv_stream(&mut c, 100_000).unwrap();
    opener.join().unwrap();
    assert!(!dev_shm_has(&name));
    FifoMem::shm_unlink(&name); // already gone: must be harmless
}

#[test]
fn shm_name_is_removed_once_sender_has_mapped_it() {
    let name = unique_name("unlink");
    let layout = FifoLayout {
        slots: 2,
        slot_bytes: 256,
    };
    let rmem = FifoMem::shm_create(&name, layout).unwrap();
    assert!(dev_shm_has(&name));
    let never = AtomicBool::new(false);
    let smem = FifoMem::shm_open(
        &name,
        layout,
        Instant::now() + Duration::from_secs(1),
        &never,
    )
    .unwrap();
    assert!(!dev_shm_has(&name));
    // The memory itself is still shared after the name is gone.
    let mut p = Producer::new(smem);
    let mut c = Consumer::new(rmem);
    send_stream(&mut p, 300, false).unwrap();
    recv_stream(&mut c, 300).unwrap();
}

#[test]
fn shm_open_times_out_promptly_when_nobody_creates() {
    let name = unique_name("never");
    let never = AtomicBool::new(false);
    let t0 = Instant::now();
    let r = FifoMem::shm_open(
        &name,
        FifoLayout {
            slots: 1,
            slot_bytes: 64,
        },
        t0 + Duration::from_millis(200),
        &never,
    );
    let d = t0.elapsed();
    assert!(
        matches!(r, Err(Error::Timeout(ref m)) if m.contains(&name)),
        "{r:?}"
    );
    assert!(
        d >= Duration::from_millis(200) && d < Duration::from_millis(1200),
        "took {d:?}"
    );
}

#[test]
fn shm_open_stops_on_abort() {
    let name = unique_name("abort");
    let abort = Arc::new(AtomicBool::new(false));
    let a2 = abort.clone();
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(50));
        a2.store(true, Ordering::Release);
        Instant::now()
    });
    let r = FifoMem::shm_open(
        &name,
        FifoLayout {
            slots: 1,
            slot_bytes: 64,
        },
        Instant::now() + Duration::from_secs(10),
        &abort,
    );
    let seen = Instant::now();
    let set = setter.join().unwrap();
    assert!(matches!(r, Err(Error::Aborted(_))), "{r:?}");
    // Seen at the next poll, long before the 10 s deadline.
    assert!(
        seen.duration_since(set) < Duration::from_secs(1),
        "{:?}",
        seen.duration_since(set)
    );
}

#[test]
fn shm_layout_mismatch_is_an_error() {
    let name = unique_name("mismatch");
    let _mem = FifoMem::shm_create(
        &name,
        FifoLayout {
            slots: 4,
            slot_bytes: 4096,
        },
    )
    .unwrap();
    let never = AtomicBool::new(false);
    let r = FifoMem::shm_open(
        &name,
        FifoLayout {
            slots: 8,
            slot_bytes: 4096,
        },
        Instant::now() + Duration::from_secs(1),
        &never,
    );
    assert!(
        matches!(r, Err(Error::Protocol(ref m)) if m.contains("4 slots")),
        "{r:?}"
    );
    FifoMem::shm_unlink(&name);
    assert!(!dev_shm_has(&name));
}

#[test]
fn shm_create_of_existing_name_is_a_system_error() {
    let name = unique_name("dup");
    let layout = FifoLayout {
        slots: 1,
        slot_bytes: 64,
    };
    let _a = FifoMem::shm_create(&name, layout).unwrap();
    let r = FifoMem::shm_create(&name, layout);
    assert!(
        matches!(r, Err(Error::System(ref m)) if m.contains(&name) && m.contains("stale")),
        "{r:?}"
    );
    FifoMem::shm_unlink(&name);
}

#[test]
fn shm_poison_crosses_processes() {
    let name = unique_name("poison");
    let layout = FifoLayout {
        slots: 2,
        slot_bytes: 64,
    };
    let mem = FifoMem::shm_create(&name, layout).unwrap();
    let mut c = Consumer::new(mem);
    let mut child = spawn_child(&format!("poison {name} 2 64"));
    let t0 = Instant::now();
    let r = loop {
        match c.try_peek() {
            Ok(None) => c.wait(Duration::from_secs(1)),
            other => break other,
        }
    };
    assert_remote(r, "child process gave up");
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert!(child.wait().unwrap().success());
    FifoMem::shm_unlink(&name);
}

#[test]
fn killed_producer_process_is_detected_by_pid() {
    let name = unique_name("kill");
    let mem = FifoMem::shm_create(
        &name,
        FifoLayout {
            slots: 2,
            slot_bytes: 64,
        },
    )
    .unwrap();
    let mut c = Consumer::new(mem);
    let mut child = spawn_child(&format!("hold {name} 2 64"));
    assert!(wait_for(Duration::from_secs(20), || c
        .try_peek()
        .unwrap()
        .is_some()));
    let pid = c.peer_pid();
    assert_eq!(pid, child.id());
    assert!(pid_alive(pid));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(!pid_alive(pid));
    FifoMem::shm_unlink(&name);
}

// ---------------------------------------------------------------------------------------
// TCP bridges

fn socket_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

fn no_abort() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}

#[test]
fn tcp_bridge_streams_20mb() {
    let layout = FifoLayout {
        slots: 8,
        slot_bytes: 64 << 10,
    };
    let (a, b) = socket_pair();
    let mut p = tcp_sender(
        a,
        layout,
        FrameCheck::None,
        "rank 1 (tx) channel 0".into(),
        no_abort(),
    )
    .unwrap();
    let mut c = tcp_receiver(
        b,
        layout,
        FrameCheck::None,
        "rank 0 (rx) channel 0".into(),
        no_abort(),
    )
    .unwrap();
    let total = 20_000_000;
    let t0 = Instant::now();
    let tx = thread::spawn(move || {
        send_stream(&mut p, total, true).unwrap();
        // Dropping right after the last commit must still deliver everything.
    });
    recv_stream(&mut c, total).unwrap();
    let d = t0.elapsed();
    tx.join().unwrap();
    // The sender shut the socket down after draining, which ends the receiving side too.
    assert!(wait_for(Duration::from_secs(5), || c.peer_closed()));
    assert_remote(c.try_peek(), "rank 0 (rx) channel 0: connection closed");
    println!(
        "TCP bridge over loopback, 8 x 64 KiB slots, 20 MB: {:.0} MiB/s",
        mib_per_s(total, d)
    );
}

#[test]
fn tcp_peer_closing_mid_stream_fails_the_consumer() {
    let layout = FifoLayout {
        slots: 4,
        slot_bytes: 1024,
    };
    let (mut raw, b) = socket_pair();
    let label = "rank 3 (10.0.0.5:4242) channel 0".to_string();
    let mut c = tcp_receiver(b, layout, FrameCheck::None, label.clone(), no_abort()).unwrap();
    raw.write_all(b"FCT0").unwrap();
    // One whole frame, then half of the next.
    raw.write_all(&3u32.to_le_bytes()).unwrap();
    raw.write_all(b"abc").unwrap();
    raw.write_all(&100u32.to_le_bytes()).unwrap();
    raw.write_all(&[7u8; 40]).unwrap();
    drop(raw);
    assert!(
        wait_for(Duration::from_secs(5), || c.peer_closed()),
        "bridge thread did not exit"
    );
    let (p, len) = c.try_peek().unwrap().unwrap();
    assert_eq!(unsafe { std::slice::from_raw_parts(p, len) }, b"abc");
    c.release();
    assert_remote(
        c.try_peek(),
        &format!("{label}: connection closed by peer after 40 of 100 bytes"),
    );
}

#[test]
fn tcp_peer_closing_mid_stream_fails_the_producer() {
    let layout = FifoLayout {
        slots: 4,
        slot_bytes: 16 << 10,
    };
    let (a, mut raw) = socket_pair();
    let label = "rank 5 (10.0.0.7:4242) channel 1".to_string();
    let mut p = tcp_sender(a, layout, FrameCheck::None, label.clone(), no_abort()).unwrap();
    let reader = thread::spawn(move || {
        let mut buf = vec![0u8; 100_000];
        raw.read_exact(&mut buf).unwrap();
        // Dropped with unread data in flight: the sender sees a reset or EOF.
    });
    let t0 = Instant::now();
    let r = send_stream(&mut p, 1 << 30, false);
    reader.join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_remote(r, &label);
    assert!(
        wait_for(Duration::from_secs(5), || p.peer_closed()),
        "bridge thread did not exit"
    );
}

#[test]
fn tcp_idle_sender_notices_closed_peer() {
    let layout = FifoLayout {
        slots: 2,
        slot_bytes: 64,
    };
    let (a, raw) = socket_pair();
    let mut p = tcp_sender(
        a,
        layout,
        FrameCheck::None,
        "rank 9 channel 0".into(),
        no_abort(),
    )
    .unwrap();
    drop(raw);
    assert!(wait_for(Duration::from_secs(2), || p.peer_closed()));
    // The dropped end still held the sender's opening frame unread, so its kernel may answer
    // with a reset rather than (or right after) the close: either says the peer went away (seen
    // both ways under CI's load).
    assert_remote_any(
        p.try_reserve(),
        &[
            "rank 9 channel 0: connection closed by peer",
            "rank 9 channel 0: connection reset by peer",
        ],
    );
}

#[test]
fn tcp_oversized_frame_is_a_protocol_error() {
    let layout = FifoLayout {
        slots: 2,
        slot_bytes: 4096,
    };
    let (mut raw, b) = socket_pair();
    let mut c = tcp_receiver(
        b,
        layout,
        FrameCheck::None,
        "rank 4 channel 2".into(),
        no_abort(),
    )
    .unwrap();
    raw.write_all(b"FCT0").unwrap();
    raw.write_all(&4097u32.to_le_bytes()).unwrap();
    let r = loop {
        match c.try_peek() {
            Ok(None) => c.wait(Duration::from_millis(100)),
            other => break other,
        }
    };
    assert!(
        matches!(r, Err(Error::Protocol(ref m)) if m.contains("rank 4 channel 2") && m.contains("4097")),
        "{r:?}"
    );
    assert!(wait_for(Duration::from_secs(2), || c.peer_closed()));
    // The bridge closed its socket.
    raw.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    assert!(matches!(raw.read(&mut [0u8; 8]), Ok(0) | Err(_)));
}

#[test]
fn tcp_abort_stops_both_bridges() {
    let layout = FifoLayout {
        slots: 2,
        slot_bytes: 64,
    };
    let abort = no_abort();
    let (a, _keep_a) = socket_pair();
    let (b, _keep_b) = socket_pair();
    let mut p = tcp_sender(a, layout, FrameCheck::None, "tx".into(), abort.clone()).unwrap();
    let mut c = tcp_receiver(b, layout, FrameCheck::None, "rx".into(), abort.clone()).unwrap();
    thread::sleep(Duration::from_millis(30));
    let t0 = Instant::now();
    abort.store(true, Ordering::Release);
    assert!(wait_for(Duration::from_secs(1), || p.peer_closed()
        && c.peer_closed()));
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "bridges took {:?} to stop",
        t0.elapsed()
    );
    assert!(matches!(p.try_reserve(), Err(Error::Aborted(ref m)) if m.contains("tx")));
    assert!(matches!(c.try_peek(), Err(Error::Aborted(ref m)) if m.contains("rx")));
}

#[test]
fn tcp_dropping_the_local_end_stops_the_bridge() {
    let layout = FifoLayout {
        slots: 2,
        slot_bytes: 64,
    };
    let (mut raw, b) = socket_pair();
    let c = tcp_receiver(b, layout, FrameCheck::None, "rx".into(), no_abort()).unwrap();
    drop(c);
    raw.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let t0 = Instant::now();
    assert!(matches!(raw.read(&mut [0u8; 8]), Ok(0) | Err(_)));
    assert!(t0.elapsed() < Duration::from_millis(500));
}

#[test]
fn tcp_ranks_that_disagree_on_the_crc_fail_at_once() {
    let layout = FifoLayout {
        slots: 2,
        slot_bytes: 4096,
    };
    let (a, b) = socket_pair();
    let mut p = tcp_sender(
        a,
        layout,
        FrameCheck::Crc32c,
        "rank 1 channel 0".into(),
        no_abort(),
    )
    .unwrap();
    let mut c = tcp_receiver(
        b,
        layout,
        FrameCheck::None,
        "rank 0 (10.0.0.1:7) channel 0".into(),
        no_abort(),
    )
    .unwrap();
    let slot = loop {
        if let Some(s) = p.try_reserve().unwrap() {
            break s;
        }
    };
    // SAFETY: a reserved slot holds slot_bytes writable bytes.
    unsafe { slot.write_bytes(1, 64) };
    p.commit(64);
    let r = loop {
        match c.try_peek() {
            Ok(None) => c.wait(Duration::from_millis(50)),
            other => break other,
        }
    };
    let want = "rank 0 (10.0.0.1:7) channel 0: the peer sends with FERROCCL_TCP_CRC on but this rank expects it off";
    assert!(
        matches!(r, Err(Error::Protocol(ref m)) if m.contains(want)),
        "{r:?}"
    );
}

#[test]
fn tcp_bridge_with_crc_streams_varied_frames() {
    let layout = FifoLayout {
        slots: 4,
        slot_bytes: 16 << 10,
    };
    let (a, b) = socket_pair();
    let mut p = tcp_sender(a, layout, FrameCheck::Crc32c, "tx".into(), no_abort()).unwrap();
    let mut c = tcp_receiver(b, layout, FrameCheck::Crc32c, "rx".into(), no_abort()).unwrap();
    let total = 3 << 20;
    let h = thread::spawn(move || send_stream(&mut p, total, true));
    recv_stream(&mut c, total).unwrap();
    h.join().unwrap().unwrap();
}

/// A socket sender whose peer died must fail, not kill the process with SIGPIPE, whatever the
/// program's disposition: the child restores the default one (as the `ferroccl` command does)
/// and writes frames to a peer that closed its end.
#[test]
fn a_dead_peer_never_raises_sigpipe() {
    const ROLE: &str = "FERROCCL_SIGPIPE_TEST_CHILD";
    if std::env::var(ROLE).is_ok() {
        // SAFETY: the child is a process of its own, running this test alone.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        drop(l.accept().unwrap().0);
        let layout = FifoLayout {
            slots: 4,
            slot_bytes: 4096,
        };
        let mut p = tcp_sender(
            a,
            layout,
            FrameCheck::None,
            "to a dead peer".into(),
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        let e = loop {
            if let Err(e) = send_stream(&mut p, 1 << 20, false) {
                break e;
            }
            assert!(Instant::now() < until, "the dead peer was never noticed");
        };
        println!("survived: {e}");
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "transport::tests::a_dead_peer_never_raises_sigpipe",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        None,
        "the sender was killed by signal {:?}:\n{text}",
        out.status.signal()
    );
    assert!(out.status.success() && text.contains("survived"), "{text}");
}
