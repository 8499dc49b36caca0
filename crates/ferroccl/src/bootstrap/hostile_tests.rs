//! Hostile traffic against the bootstrap while a real job initialises and runs: port scans,
//! silent connections by the hundred, wrong and partial secrets, replayed handshakes, absurd
//! lengths, and a second job on the same host. The job must go on, strangers must be turned
//! away and logged, and the listener's threads must stay bounded.

use super::gate::MAX_THREADS;
use super::tests::{cfg, check_allgather, flag, init_all, on_ranks, w};
use super::*;
use crate::testing::fault_proxy::FaultProxy;
use std::io::{Read, Write};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

/// Every warning or error the library logs, with its fields, captured process-wide (the
/// listener logs from its own threads). Tests look for the addresses of their own hostile
/// connections, so tests running side by side do not disturb each other.
fn logged() -> &'static Mutex<Vec<String>> {
    static LOG: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    static INSTALLED: OnceLock<()> = OnceLock::new();
    let log = LOG.get_or_init(|| Mutex::new(Vec::new()));
    INSTALLED.get_or_init(|| {
        let _ = tracing::subscriber::set_global_default(Capture);
    });
    log
}

struct Capture;
struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        let _ = write!(self.0, "{}={:?} ", f.name(), v);
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        *m.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        let mut f = Fields(String::new());
        e.record(&mut f);
        lock(logged()).push(f.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Whether a warning naming `addr` (and containing `what`) is logged within `within`.
fn warned(addr: SocketAddr, what: &str, within: Duration) -> bool {
    let a = addr.to_string();
    let until = Instant::now() + within;
    loop {
        if lock(logged())
            .iter()
            .any(|l| l.contains(&a) && l.contains(what))
        {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn threads_now() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The strangers of one attack, and where each came from.
#[derive(Default)]
struct Strangers {
    wrong_secret: Vec<SocketAddr>,
    partial: Vec<SocketAddr>,
    garbage: Vec<SocketAddr>,
}

/// One round of every kind of stranger against `target`: returns where they came from.
fn attack(target: SocketAddr) -> Strangers {
    let mut out = Strangers::default();
    for _ in 0..50 {
        // A port scan: connect and close.
        drop(TcpStream::connect(target));
    }
    for i in 0..3 {
        // A client with the wrong secret.
        let mut s = TcpStream::connect(target).unwrap();
        out.wrong_secret.push(s.local_addr().unwrap());
        assert!(auth::client(&mut s, &[0xEE ^ i; 16], &w(3000), "target").is_err());
        // Half a handshake, then gone.
        let mut s = TcpStream::connect(target).unwrap();
        out.partial.push(s.local_addr().unwrap());
        let mut hello = [0u8; 40];
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        s.read_exact(&mut hello).unwrap();
        s.write_all(&[7u8; 30]).unwrap();
        drop(s);
        // Not our protocol at all.
        let mut s = TcpStream::connect(target).unwrap();
        out.garbage.push(s.local_addr().unwrap());
        s.write_all(&[0xAB; 200]).unwrap();
    }
    out
}

fn assert_logged(s: &Strangers) {
    for &a in &s.wrong_secret {
        assert!(
            warned(a, "failed authentication", Duration::from_secs(3)),
            "no warning for wrong secret from {a}"
        );
    }
    for &a in s.partial.iter().chain(&s.garbage) {
        assert!(
            warned(a, "", Duration::from_secs(3)),
            "no warning for stranger {a}"
        );
    }
}

#[test]
fn strangers_are_turned_away_and_logged_while_the_job_starts_and_runs() {
    logged();
    let c = cfg(10_000);
    let id = UniqueId::new(&c).unwrap();
    let root = id.root_addr();
    // Hundreds of silent connections, more than the listener will run handshakes for.
    let silent: Vec<TcpStream> = (0..700)
        .map(|_| TcpStream::connect(root).unwrap())
        .collect();
    // The listener accepts them in the background; give it time to take them all in.
    thread::sleep(Duration::from_millis(300));
    let peak = threads_now();
    // Ranks 0 and 1 start while the strangers come in; rank 2 only after the attack, since
    // the root stops listening once every rank has arrived.
    let strangers = Mutex::new(None);
    let bs = on_ranks(3, |r| {
        if r == 2 {
            *lock(&strangers) = Some(attack(root));
        }
        Bootstrap::init(&id, 3, r, &c, flag()).unwrap()
    });
    let strangers = strangers.into_inner().unwrap().unwrap();
    // Without the cap this would be a thread per silent connection.
    assert!(
        peak < MAX_THREADS + 150,
        "{peak} threads with 700 silent connections open"
    );
    check_allgather(&bs);
    assert_logged(&strangers);
    drop(silent);

    // The same against a rank's own listener, while the job talks.
    let target = bs[1].peers()[1].addr;
    let silent: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(target).unwrap())
        .collect();
    let bsr = &bs;
    let strangers = thread::scope(|s| {
        let h = s.spawn(|| attack(target));
        for tag in 0..5 {
            let acc = s.spawn(move || bs_accept(bsr, tag));
            let mut a = bs[0].connect(1, tag).unwrap();
            let mut b = acc.join().unwrap();
            a.write_all(&[tag as u8; 3]).unwrap();
            let mut got = [0u8; 3];
            b.read_exact(&mut got).unwrap();
            assert_eq!(got, [tag as u8; 3]);
            check_allgather(&bs);
        }
        h.join().unwrap()
    });
    assert_logged(&strangers);
    drop(silent);
}

fn bs_accept(bs: &[Bootstrap], tag: u64) -> TcpStream {
    bs[1].accept(0, tag).unwrap()
}

#[test]
fn a_recorded_handshake_replayed_is_rejected() {
    logged();
    let mut bs = init_all(2, &cfg(1500));
    let real = bs[1].peers()[1].addr;
    let proxy = FaultProxy::start(real);
    bs[0].redirect_peer(1, proxy.addr());
    // A real connection, recorded on the way.
    let (mut a, mut b) = thread::scope(|s| {
        let h = s.spawn(|| bs[1].accept(0, 9).unwrap());
        (bs[0].connect(1, 9).unwrap(), h.join().unwrap())
    });
    a.write_all(b"x").unwrap();
    b.read_exact(&mut [0u8; 1]).unwrap();
    let rec = proxy.recorded();
    assert_eq!(rec.len(), 1);
    // Client proof (64 bytes) and announce frame (8 + 29), then our "x".
    assert!(rec[0].len() >= 64 + 37, "{}", rec[0].len());

    // Replayed word for word to the rank's listener: its fresh nonce makes the proof stale.
    let mut s = TcpStream::connect(real).unwrap();
    let me = s.local_addr().unwrap();
    let mut hello = [0u8; 40];
    s.read_exact(&mut hello).unwrap();
    s.write_all(&rec[0][..64 + 37]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    assert!(
        matches!(s.read(&mut [0u8; 32]), Ok(0) | Err(_)),
        "the replay got an answer"
    );
    assert!(warned(me, "failed authentication", Duration::from_secs(3)));
    // Nothing was parked under the replayed announce: an accept for it finds nothing.
    let e = Bootstrap::accept(&bs[1], 0, 9).unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
}

#[test]
fn absurd_lengths_from_an_authenticated_peer_are_refused_before_allocating() {
    logged();
    let c = cfg(5000);
    let bs = init_all(2, &c);
    let target = bs[1].peers()[1].addr;
    let mut froms = Vec::new();
    for len in [u64::MAX, 1 << 40, listener_announce_len() as u64 + 1] {
        let mut s = wire::connect_retry(target, &w(1000), "rank 1").unwrap();
        froms.push(s.local_addr().unwrap());
        auth::client(&mut s, &bs[0].secret, &w(1000), "rank 1").unwrap();
        s.write_all(&len.to_le_bytes()).unwrap();
    }
    for a in froms {
        assert!(warned(a, "above the limit", Duration::from_secs(3)), "{a}");
    }
    check_allgather(&bs);
}

fn listener_announce_len() -> usize {
    listener::encode_announce(0, 0, 0, 0).len()
}

#[test]
fn two_jobs_on_one_host_keep_to_themselves() {
    let c = cfg(5000);
    let (a, b) = (UniqueId::new(&c).unwrap(), UniqueId::new(&c).unwrap());
    let jobs = on_ranks(7, |i| match i {
        // Job A's ranks come a little later, so that its root is still taking connections
        // when the stray knocks (the root closes once its job has gathered).
        0..=2 => {
            std::thread::sleep(Duration::from_millis(300));
            Ok(Some(Bootstrap::init(&a, 3, i, &c, flag()).unwrap()))
        }
        3..=5 => Ok(Some(Bootstrap::init(&b, 3, i - 3, &c, flag()).unwrap())),
        // A rank of job B given job A's address (a wrong MASTER_PORT, say).
        _ => Bootstrap::init(
            &UniqueId::compose(a.root_addr(), &b.secret()),
            3,
            1,
            &c,
            flag(),
        )
        .map(|_| None),
    });
    let mut jobs = jobs.into_iter();
    let ja: Vec<Bootstrap> = jobs.by_ref().take(3).map(|r| r.unwrap().unwrap()).collect();
    let jb: Vec<Bootstrap> = jobs.by_ref().take(3).map(|r| r.unwrap().unwrap()).collect();
    let e = jobs.next().unwrap().unwrap_err();
    // Refused for its secret; or, on a loaded machine where it knocked only after job A had
    // gathered and its root had closed, unable to connect at all. Never admitted.
    let refused = matches!(e, Error::Protocol(_)) && e.message().contains("wrong job secret");
    let too_late = matches!(e, Error::Timeout(_))
        && e.message()
            .contains("could not connect to the bootstrap root");
    assert!(refused || too_late, "{e}");
    assert!(e.message().contains(&a.root_addr().to_string()), "{e}");
    assert_ne!(ja[0].comm_id(), jb[0].comm_id());
    check_allgather(&ja);
    check_allgather(&jb);
    // A rank of one job cannot reach into the other's listeners either.
    let mut s = wire::connect_retry(ja[0].peers()[0].addr, &w(1000), "job A rank 0").unwrap();
    assert!(auth::client(&mut s, &b.secret(), &w(1000), "job A rank 0").is_err());
}
