//! Each process's bootstrap listener. A background thread accepts, authenticates and reads the
//! announce (comm_id, from, kind, tag) of every incoming connection, then parks it under that
//! key until `take` claims it, so connect and accept may happen in either order.
//!
//! announce frame: "FCAN" | comm_id u64 | from u64 | kind u8 | tag u64

use super::auth;
use super::gate::Gate;
use super::wire::{self, AbortSet, Dec, Enc, Wait, HANDSHAKE_MAX, POLL};
use ferroccl_core::Error;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

const ANNOUNCE_MAGIC: [u8; 4] = *b"FCAN";
const ANNOUNCE_LEN: usize = 4 + 8 + 8 + 1 + 8;

/// Connections made by `Bootstrap::connect` for its user.
pub(crate) const KIND_USER: u8 = 0;
/// The bootstrap's own ring; a separate kind so that user tags need no reserved values.
pub(crate) const KIND_RING: u8 = 1;
/// Heartbeat links between ring neighbours (`watch`).
pub(crate) const KIND_WATCH: u8 = 2;

pub(crate) type Key = (u64, usize, u8, u64);

#[derive(Default)]
struct State {
    parked: HashMap<Key, VecDeque<TcpStream>>,
    /// Communicators that were aborted or dropped: their late arrivals are closed at once.
    closed: HashSet<u64>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing in State can be left half-updated by a panic, so poisoning is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub(crate) struct Listener {
    addr: SocketAddr,
    /// The listening socket's twin, shut down at drop to wake the accept loop at once.
    wake: TcpListener,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

pub(crate) fn encode_announce(comm_id: u64, from: usize, kind: u8, tag: u64) -> Vec<u8> {
    let mut e = Enc::default();
    e.raw(&ANNOUNCE_MAGIC)
        .u64(comm_id)
        .u64(from as u64)
        .u8(kind)
        .u64(tag);
    e.0
}

pub(crate) fn decode_announce(b: &[u8]) -> Result<Key, Error> {
    let mut d = Dec::new(b, "connection announce");
    if d.take(4)? != ANNOUNCE_MAGIC {
        return Err(Error::Protocol(
            "connection announce has a bad magic".into(),
        ));
    }
    let k = (d.u64()?, d.usize()?, d.u8()?, d.u64()?);
    d.finish()?;
    Ok(k)
}

impl Listener {
    pub fn bind(ip: IpAddr, secret: [u8; 16], timeout: Duration) -> Result<Arc<Listener>, Error> {
        let l = TcpListener::bind((ip, 0)).map_err(|e| {
            Error::System(format!(
                "binding the bootstrap listener on {ip}: {e}{}",
                wire::fd_hint(&e)
            ))
        })?;
        let addr = l.local_addr().map_err(|e| {
            Error::System(format!(
                "bootstrap listener: {e}{}",
                super::wire::fd_hint(&e)
            ))
        })?;
        l.set_nonblocking(true).map_err(|e| {
            Error::System(format!(
                "bootstrap listener: {e}{}",
                super::wire::fd_hint(&e)
            ))
        })?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let wake = l.try_clone().map_err(|e| {
            Error::System(format!(
                "bootstrap listener: {e}{}",
                super::wire::fd_hint(&e)
            ))
        })?;
        let (sh, st) = (shared.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("ferroccl-listen".into())
            .spawn(move || serve(l, secret, timeout, sh, st))
            .map_err(|e| Error::System(format!("starting the bootstrap listener thread: {e}")))?;
        Ok(Arc::new(Listener {
            addr,
            wake,
            shared,
            stop,
            thread: Some(thread),
        }))
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for the connection parked under `key`; `peer` names its sender in errors.
    pub fn take(&self, key: Key, w: &Wait, peer: &str) -> Result<TcpStream, Error> {
        self.take_when(key, w, peer, |_| Ok(()))
    }

    /// Like `take`, for connections whose tag every rank must agree on (ring and heartbeat
    /// links): one parked under the same communicator and kind with another tag means that
    /// its sender disagrees with us (a shrink with another exclude list), which fails now
    /// rather than at the deadline.
    pub fn take_exact(&self, key: Key, w: &Wait, peer: &str) -> Result<TcpStream, Error> {
        self.take_when(key, w, peer, |parked| {
            if let Some(k) = parked.keys().find(|k| k.0 == key.0 && k.2 == key.2 && k.3 != key.3) {
                return Err(Error::InvalidArgument(format!(
                    "rank {} joined this communicator with a different set of members than ours (waiting for {peer}): \
                     every survivor of a shrink must pass the same exclude list",
                    k.1
                )));
            }
            Ok(())
        })
    }

    /// Waits for the connection parked under `key`; while none is, `refuse` may end the wait
    /// with an error from what else is parked.
    fn take_when(
        &self,
        key: Key,
        w: &Wait,
        peer: &str,
        refuse: impl Fn(&HashMap<Key, VecDeque<TcpStream>>) -> Result<(), Error>,
    ) -> Result<TcpStream, Error> {
        let mut st = self.shared.lock();
        loop {
            if let Some(q) = st.parked.get_mut(&key) {
                if let Some(s) = q.pop_front() {
                    if q.is_empty() {
                        st.parked.remove(&key);
                    }
                    return Ok(s);
                }
            }
            refuse(&st.parked)?;
            w.check(|| format!("waiting for a connection from {peer} (tag {})", key.3))?;
            st = self
                .shared
                .cv
                .wait_timeout(st, POLL)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Closes what is parked for `comm_id` and refuses its later arrivals, so that peers still
    /// talking to that communicator see EOF instead of waiting for their deadline.
    pub fn close_comm(&self, comm_id: u64) {
        let mut st = self.shared.lock();
        st.closed.insert(comm_id);
        st.parked.retain(|k, _| k.0 != comm_id);
        self.shared.cv.notify_all();
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // SAFETY: shutdown(2) on a socket we own; poll() in the accept loop returns at once.
        unsafe { libc::shutdown(self.wake.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    l: TcpListener,
    secret: [u8; 16],
    timeout: Duration,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
) {
    let gate = Gate::new();
    let mut spare = wire::SpareFd::new();
    while !stop.load(Ordering::Acquire) {
        let (stream, from) = match wire::poll_accept(&l, POLL) {
            Ok(Some(_)) if stop.load(Ordering::Acquire) => break,
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(_) if stop.load(Ordering::Acquire) => break,
            Err(e) => {
                if !spare.refuse_one(&l, &e, "bootstrap listener") {
                    tracing::warn!("bootstrap listener accept failed: {e}");
                    std::thread::sleep(POLL);
                }
                continue;
            }
        };
        let (shared, w) = (
            shared.clone(),
            Wait::new(timeout, AbortSet::new(stop.clone())).capped(HANDSHAKE_MAX),
        );
        gate.run(stream, from, move |mut stream, done| {
            let peer = from.to_string();
            let r = auth::server(&mut stream, &secret, &w, &peer)
                .and_then(|_| wire::read_frame(&mut stream, ANNOUNCE_LEN, &w, &peer))
                .and_then(|b| decode_announce(&b));
            match r {
                Ok(key) => {
                    done();
                    let mut st = shared.lock();
                    if !st.closed.contains(&key.0) {
                        st.parked.entry(key).or_default().push_back(stream);
                        shared.cv.notify_all();
                    }
                }
                Err(e) => {
                    tracing::warn!(remote = %from, "bootstrap listener dropped a connection: {e}")
                }
            }
        });
    }
}
