//! Resource limits reached on purpose: too few file descriptors, a full /dev/shm, a file-size
//! limit below a FIFO's size. Each runs in a child process (this test binary again), so the
//! limits touch nothing else. The promise: an error that names the resource and the knob to
//! change, quickly, and no shared-memory segment left behind.

use ferroccl::{Comm, Config, Error, ReduceOp, TransportChoice};
use std::process::Command;
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "FERROCCL_LIMITS_TEST_CHILD";

fn config(transport: TransportChoice, timeout_s: u64) -> Config {
    Config {
        timeout: Duration::from_secs(timeout_s),
        bootstrap_addr: Some("127.0.0.1".into()),
        transport,
        ..Config::default()
    }
}

/// Every rank of `comms` runs one all-reduce on its own thread: every rank's error, if any,
/// and when the first of them came.
fn all_reduce(comms: &[Comm], t: Instant) -> Result<(), (String, Duration)> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut v = vec![1.0f32; 100_000];
                    c.all_reduce_in_place(&mut v, ReduceOp::Sum)
                        .map_err(|e| (e, t.elapsed()))
                })
            })
            .collect();
        let errs: Vec<(String, Duration)> = hs
            .into_iter()
            .enumerate()
            .filter_map(|(r, h)| {
                h.join()
                    .unwrap()
                    .err()
                    .map(|(e, d)| (format!("rank {r}: {e}"), d))
            })
            .collect();
        match errs.iter().map(|e| e.1).min() {
            None => Ok(()),
            Some(first) => Err((
                errs.iter()
                    .map(|e| e.0.as_str())
                    .collect::<Vec<_>>()
                    .join(" | "),
                first,
            )),
        }
    })
}

/// Our segments still in /dev/shm (the prefix holds the communicator id).
fn leftover_segments(comm_id: u64) -> usize {
    let prefix = format!("ferroccl-{comm_id:016x}");
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                .count()
        })
        .unwrap_or(0)
}

fn set_limit(resource: libc::__rlimit_resource_t, value: u64) {
    let r = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: setrlimit with a valid struct; lowering a limit needs no privilege.
    assert_eq!(
        unsafe { libc::setrlimit(resource, &r) },
        0,
        "setrlimit: {}",
        std::io::Error::last_os_error()
    );
}

/// What a child reports: "RESULT ok|err <ms to first error> <ms in all> <leftover segments> <message>".
struct Report {
    ok: bool,
    first_ms: u64,
    total_ms: u64,
    leftover: usize,
    message: String,
}

fn report(t: Instant, r: Result<(), (String, Duration)>, leftover: usize) {
    let total = t.elapsed().as_millis();
    match r {
        Ok(()) => println!("RESULT ok {total} {total} {leftover} "),
        Err((m, first)) => println!(
            "RESULT err {} {total} {leftover} {}",
            first.as_millis(),
            m.replace('\n', " ")
        ),
    }
}

fn parse(out: &std::process::Output) -> Report {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.find("RESULT ").map(|i| &l[i..]))
        .unwrap_or_else(|| {
            panic!(
                "child printed no result: {text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        });
    let mut it = line.splitn(6, ' ').skip(1);
    Report {
        ok: it.next() == Some("ok"),
        first_ms: it.next().unwrap().parse().unwrap(),
        total_ms: it.next().unwrap().parse().unwrap(),
        leftover: it.next().unwrap().parse().unwrap(),
        message: it.next().unwrap_or("").to_string(),
    }
}

#[test]
fn child_entry() {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return;
    };
    let args: Vec<&str> = role.split(' ').collect();
    match args[0] {
        // Descriptors: only `extra` more than are open now.
        "nofile" => {
            let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
            set_limit(libc::RLIMIT_NOFILE, open + args[1].parse::<u64>().unwrap());
            let t = Instant::now();
            let r = Comm::init_all(4, &config(TransportChoice::Tcp, 2))
                .map_err(|e: Error| (e.to_string(), t.elapsed()))
                .and_then(|c| all_reduce(&c, t));
            report(t, r, 0);
        }
        // "fsize": no file larger than 64 KiB (a FIFO is 512 KiB). "shm": run inside a mount
        // namespace whose /dev/shm is a small tmpfs. Either way segments cannot be made whole.
        "fsize" | "shm" => {
            if args[0] == "fsize" {
                // SAFETY: ignoring SIGXFSZ turns an oversized write into EFBIG instead of death.
                unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
                set_limit(libc::RLIMIT_FSIZE, 64 << 10);
            }
            let t = Instant::now();
            let comms = Comm::init_all(2, &config(TransportChoice::Shm, 3)).unwrap();
            let id = comms[0].id();
            let r = all_reduce(&comms, t);
            drop(comms);
            report(t, r, leftover_segments(id));
        }
        r => panic!("unknown role {r}"),
    }
}

fn run_child(role: &str, wrap: &[&str]) -> std::process::Output {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = if wrap.is_empty() {
        Command::new(&exe)
    } else {
        Command::new(wrap[0])
    };
    if !wrap.is_empty() {
        cmd.args(&wrap[1..]).arg(&exe);
    }
    cmd.args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, role);
    cmd.output().expect("start the child")
}

#[test]
fn too_few_file_descriptors_fail_fast_naming_ulimit() {
    // From hopeless to just enough: whichever call runs out first must say so at once.
    let mut failures = 0;
    for extra in [1, 10, 20, 24, 28, 32, 40] {
        let r = parse(&run_child(&format!("nofile {extra}"), &[]));
        eprintln!(
            "{extra} spare descriptors: ok={} first error after {} ms, all done after {} ms: {}",
            r.ok, r.first_ms, r.total_ms, r.message
        );
        if !r.ok {
            failures += 1;
            assert!(
                r.message.contains("ulimit -n"),
                "{extra} spare: {}",
                r.message
            );
            // Running out is reported at once, not waited out.
            assert!(
                r.first_ms < 1000,
                "{extra} spare descriptors: {} ms: {}",
                r.first_ms,
                r.message
            );
        }
        // A rank waiting for a connection that its out-of-descriptors peer never made learns
        // of it only at its 2 s deadline; nothing waits longer.
        assert!(
            r.total_ms < 2000 + 1500,
            "{extra} spare descriptors: {} ms: {}",
            r.total_ms,
            r.message
        );
    }
    assert!(
        failures > 0,
        "no limit was low enough to fail: the test tests nothing"
    );
}

#[test]
fn segment_above_the_file_size_limit_names_the_limit_and_leaves_nothing() {
    let r = parse(&run_child("fsize", &[]));
    assert!(
        !r.ok,
        "a 512 KiB FIFO was created under a 64 KiB file-size limit"
    );
    for want in [
        "shared-memory segment",
        "bytes)",
        "ulimit -f",
        "FERROCCL_SLOT_BYTES",
    ] {
        assert!(r.message.contains(want), "{want:?} missing: {}", r.message);
    }
    assert!(r.first_ms < 1000, "{} ms: {}", r.first_ms, r.message);
    assert_eq!(r.leftover, 0, "segments left in /dev/shm");
}

#[test]
fn full_dev_shm_names_it_and_the_knobs_and_leaves_nothing() {
    // A private /dev/shm of 768 KiB (two FIFOs of 4 x 128 KiB slots do not fit) needs a user
    // and mount namespace; where the system forbids
    // them, the file-size test above covers the same error path.
    let probe = Command::new("unshare").args(["-Urm", "true"]).output();
    if !matches!(&probe, Ok(o) if o.status.success()) {
        eprintln!("skipped: unprivileged user namespaces are not available here");
        return;
    }
    let wrap = [
        "unshare",
        "-Urm",
        "sh",
        "-c",
        "mount -t tmpfs -o size=768k tmpfs /dev/shm && exec \"$@\"",
        "sh",
    ];
    let r = parse(&run_child("shm", &wrap));
    assert!(!r.ok, "two 512 KiB FIFOs fit in a 768 KiB /dev/shm?");
    for want in [
        "/dev/shm is full",
        "FERROCCL_SLOTS",
        "FERROCCL_SLOT_BYTES",
        "FERROCCL_TRANSPORT=tcp",
        "bytes)",
    ] {
        assert!(r.message.contains(want), "{want:?} missing: {}", r.message);
    }
    assert!(r.first_ms < 1000, "{} ms: {}", r.first_ms, r.message);
    // The rank whose segment fitted waits for its peer's until the 3 s deadline.
    assert!(r.total_ms < 3000 + 1000, "{} ms: {}", r.total_ms, r.message);
    assert_eq!(r.leftover, 0, "segments left in /dev/shm");
}
