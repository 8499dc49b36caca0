//! Bootstrap: how the ranks of a job find each other, agree on a communicator, and exchange
//! the small out-of-band messages that transports need before they can talk directly.
//!
//! Every TCP connection of this module (to the root, between rank listeners) starts with the
//! mutual HMAC handshake of `auth`, then carries length-prefixed, bounded frames (`wire`).
//! Each process runs one listener thread per bootstrap (shared with the communicators split
//! from it) that authenticates incoming connections and parks them by (comm_id, from, tag).
//!
//! Wire protocol, all integers little-endian unless noted:
//! 1. handshake (fixed sizes, see `auth`): server MAGIC+nonce; client nonce+HMAC; server HMAC.
//! 2. frame: u64 length (checked against a per-message bound before allocating) + payload.
//! 3. rank -> root: hello = nranks, rank, listener addr, host_id, pid, hostname.
//! 4. root -> rank: 0, comm_id, n, n PeerInfo  |  1, error kind, message (bad rank, duplicate,
//!    nranks mismatch, or the list of ranks that never arrived).
//! 5. rank -> rank listener: announce = "FCAN", comm_id, from, kind (user|ring), tag.
//! 6. ring all-gather block: seq u64, origin rank u32, bytes.
//!
//! The root has no deadline before the first rank arrives (as with NCCL, ranks may take long
//! to start); from the first arrival on, it waits `config.timeout`.

mod auth;
mod gate;
pub(crate) mod health;
mod host;
mod listener;
mod root;
mod unique_id;
mod watch;
mod wire;

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod parser_fuzz;
#[cfg(test)]
mod tests;

pub use host::interface_ip;
pub use unique_id::UniqueId;

use ferroccl_core::config::LaunchEnv;
use ferroccl_core::{Config, Error};
use health::Health;
use listener::{Listener, KIND_RING, KIND_USER, KIND_WATCH};
use sha2::{Digest, Sha256};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use wire::{AbortSet, Dec, Enc, Wait};

/// The root may answer a little after a client's own deadline, because its deadline counts
/// from the first arrival; this grace lets clients receive its explanation instead of a bare
/// local timeout.
const ROOT_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// Header of one all-gather block on the ring: sequence number and originating rank.
const BLOCK_HEAD: usize = 12;

/// All-gather blocks up to this size are written without a helper thread (see `allgather`);
/// far below the smallest socket buffers an OS gives a TCP connection.
const INLINE_BLOCK: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    pub rank: usize,
    /// That rank's bootstrap listener.
    pub addr: SocketAddr,
    pub host_id: u64,
    pub pid: u32,
    pub hostname: String,
}

struct Ring {
    next: Mutex<TcpStream>,
    prev: Mutex<TcpStream>,
}

pub struct Bootstrap {
    rank: usize,
    nranks: usize,
    comm_id: u64,
    peers: Vec<PeerInfo>,
    secret: [u8; 16],
    config: Config,
    abort: AbortSet,
    /// The flag `abort()` sets; for a split child it is the child's own, so aborting a child
    /// leaves its parent usable while aborting the parent still stops the child's waits.
    own_abort: Arc<AtomicBool>,
    listener: Arc<Listener>,
    ring: Option<Ring>,
    /// Duplicates of the ring sockets, so `abort()` can shut them down while another thread
    /// holds the ring locks inside a wait.
    shutdown: Vec<TcpStream>,
    seq: AtomicU64,
    /// What this communicator knows about its peers' liveness; every wait here reads it.
    health: Arc<Health>,
    /// The heartbeat thread (none for a single rank).
    watch: Mutex<Option<watch::Watch>>,
    /// Shrinks made from this communicator so far: each gets its own communicator id.
    shrinks: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn describe(p: &PeerInfo) -> String {
    format!("rank {} ({})", p.rank, p.addr)
}

/// The long form, for failures: "rank 2 (host, pid 123, 10.0.0.2:41234)".
fn name_of(p: &PeerInfo) -> String {
    format!(
        "rank {} ({}, pid {}, {})",
        p.rank, p.hostname, p.pid, p.addr
    )
}

/// What a new communicator's bootstrap inherits or gets fresh (see `assemble`).
struct Parts {
    secret: [u8; 16],
    config: Config,
    abort: AbortSet,
    own_abort: Arc<AtomicBool>,
    listener: Arc<Listener>,
    health: Arc<Health>,
    /// Tag of the ring and heartbeat connections: 0, or for a shrink a hash of the survivors,
    /// so that ranks disagreeing on who survives never connect to each other.
    tag: u64,
}

impl Bootstrap {
    pub fn init(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        config: &Config,
        abort: Arc<AtomicBool>,
    ) -> Result<Bootstrap, Error> {
        if id.root_by_rank0() && rank == 0 && nranks > 0 {
            start_root(id.root_addr(), id.secret(), config)?;
        }
        Bootstrap::join(id.root_addr(), id.secret(), nranks, rank, config, abort)
    }

    pub fn init_from_launch(
        env: &LaunchEnv,
        config: &Config,
        abort: Arc<AtomicBool>,
    ) -> Result<Bootstrap, Error> {
        let addrs: Vec<SocketAddr> = (env.master_addr.as_str(), env.master_port)
            .to_socket_addrs()
            .map_err(|e| {
                Error::InvalidArgument(format!(
                    "{} environment: cannot resolve MASTER_ADDR '{}': {e}",
                    env.source, env.master_addr
                ))
            })?
            .collect();
        let root = addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or(addrs.first())
            .copied()
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "MASTER_ADDR '{}' resolves to no address",
                    env.master_addr
                ))
            })?;
        let secret = config.job_secret.unwrap_or([0u8; 16]);
        if env.rank == 0 && env.world_size > 0 {
            start_root(root, secret, config)?;
        }
        Bootstrap::join(root, secret, env.world_size, env.rank, config, abort)
    }

    fn join(
        root: SocketAddr,
        secret: [u8; 16],
        nranks: usize,
        rank: usize,
        config: &Config,
        abort: Arc<AtomicBool>,
    ) -> Result<Bootstrap, Error> {
        if nranks == 0 {
            return Err(Error::InvalidArgument("nranks must be at least 1".into()));
        }
        if rank >= nranks {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is not below nranks={nranks}"
            )));
        }
        let health = Arc::new(Health::default());
        let aset = AbortSet::new(abort.clone()).with_health(health.clone());
        let w = Wait::new(config.timeout, aset.clone());
        let ctx = |e: Error| e.context(format!("bootstrap of rank {rank} of {nranks}"));
        let peer = format!("the bootstrap root at {root}");
        let mut s = auth::connect(root, &secret, &w, "the bootstrap root", &peer).map_err(ctx)?;
        // Without an explicit address, listen where the route to the root leaves this host:
        // that interface is known to reach at least the root's network.
        let ip: IpAddr = match &config.bootstrap_addr {
            Some(_) => unique_id::local_ip(config)?,
            None => s
                .local_addr()
                .map_err(|e| Error::System(format!("root connection: {e}{}", wire::fd_hint(&e))))?
                .ip(),
        };
        let listener = Listener::bind(ip, secret, config.timeout)?;
        let me = PeerInfo {
            rank,
            addr: listener.addr(),
            host_id: host::host_id(),
            pid: std::process::id(),
            hostname: host::hostname(),
        };
        let mut rw = w.clone();
        rw.deadline += ROOT_GRACE;
        let (comm_id, peers) =
            root::rendezvous(&mut s, root, nranks, &me, config.max_bootstrap_msg, &rw)?;
        drop(s);
        let parts = Parts {
            secret,
            config: config.clone(),
            abort: aset,
            own_abort: abort,
            listener,
            health,
            tag: 0,
        };
        Bootstrap::assemble(rank, comm_id, peers, parts)
    }

    /// Builds a communicator from an agreed table: connects the ring (this rank to the next)
    /// and the heartbeat links to both ring neighbours.
    fn assemble(
        rank: usize,
        comm_id: u64,
        peers: Vec<PeerInfo>,
        p: Parts,
    ) -> Result<Bootstrap, Error> {
        let mut b = Bootstrap {
            rank,
            nranks: peers.len(),
            comm_id,
            peers,
            secret: p.secret,
            config: p.config,
            abort: p.abort,
            own_abort: p.own_abort,
            listener: p.listener,
            ring: None,
            shutdown: Vec::new(),
            seq: AtomicU64::new(0),
            health: p.health,
            watch: Mutex::new(None),
            shrinks: AtomicU64::new(0),
        };
        let n = b.nranks;
        if n > 1 {
            // Until the heartbeats run, a rank of this host that dies is seen by its process
            // going away: the waits below then fail naming it, instead of at their deadline.
            let init_watch = InitWatch::start(&b.peers, rank, b.health.clone());
            b.connect_ring(p.tag).map_err(|e| init_watch.explain(e))?;
        }
        Ok(b)
    }

    /// The ring connections and heartbeat links of [`Bootstrap::assemble`].
    fn connect_ring(&mut self, tag: u64) -> Result<(), Error> {
        let (rank, n, comm_id) = (self.rank, self.nranks, self.comm_id);
        let w = self.wait();
        let (next_rank, prev_rank) = ((rank + 1) % n, (rank + n - 1) % n);
        let pp = describe(&self.peers[prev_rank]);
        let next = self.connect_kind(next_rank, KIND_RING, tag, &w)?;
        let prev = self
            .listener
            .take_exact((comm_id, prev_rank, KIND_RING, tag), &w, &pp)?;
        let watch_next = self.connect_kind(next_rank, KIND_WATCH, tag, &w)?;
        let watch_prev =
            self.listener
                .take_exact((comm_id, prev_rank, KIND_WATCH, tag), &w, &pp)?;
        for s in [&next, &prev] {
            let d = s.try_clone().map_err(|e| {
                Error::System(format!(
                    "duplicating a bootstrap socket: {e}{}",
                    wire::fd_hint(&e)
                ))
            })?;
            self.shutdown.push(d);
        }
        self.ring = Some(Ring {
            next: Mutex::new(next),
            prev: Mutex::new(prev),
        });
        let spec = watch::WatchSpec {
            me: rank,
            names: self.peers.iter().map(name_of).collect(),
            interval: self.config.heartbeat_interval,
            misses: self.config.heartbeat_misses,
        };
        let links = vec![(next_rank, watch_next), (prev_rank, watch_prev)];
        *lock(&self.watch) = Some(watch::Watch::start(spec, links, self.health.clone())?);
        Ok(())
    }

    fn wait(&self) -> Wait {
        Wait::new(self.config.timeout, self.abort.clone())
    }
}

/// Rank 0's job where the root's address is fixed in advance (a launcher's MASTER_ADDR, NCCL's
/// NCCL_COMM_ID): listen there and run the rendezvous.
fn start_root(root: SocketAddr, secret: [u8; 16], config: &Config) -> Result<(), Error> {
    // std's TcpListener sets SO_REUSEADDR on Unix, so a port left in TIME_WAIT by the
    // previous job can be bound again right away.
    let l = TcpListener::bind(root).map_err(|e| {
        Error::System(format!(
            "rank 0 cannot bind the rendezvous on {root}: {e}{}",
            wire::fd_hint(&e)
        ))
    })?;
    if secret == [0u8; 16] {
        tracing::warn!(
            "bootstrap root at {root}: the job is unauthenticated (all-zero secret); any process that can reach this port may join. Set FERROCCL_JOB_SECRET"
        );
    }
    root::spawn(l, secret, config.clone())
}

/// Watches the processes of the other ranks on this host while a communicator is being
/// assembled, reporting a vanished one to the communicator's health; stops when dropped.
struct InitWatch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The ranks of this host: (rank, process id, name).
    local: Vec<(usize, u32, String)>,
    health: Arc<Health>,
}

/// How often the watcher looks; a death is named within this (plus the waits' own poll).
const INIT_WATCH_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// How long a failed assembly step waits for a neighbour that closed its connection to be
/// seen gone, before reporting the step's own error.
const EXIT_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

impl InitWatch {
    fn start(peers: &[PeerInfo], me: usize, health: Arc<Health>) -> InitWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let own = std::process::id();
        let local: Vec<(usize, u32, String)> = peers
            .iter()
            .enumerate()
            .filter(|&(q, p)| q != me && p.host_id == peers[me].host_id && p.pid != own)
            .map(|(q, p)| (q, p.pid, describe(p)))
            .collect();
        if local.is_empty() {
            return InitWatch {
                stop,
                thread: None,
                local,
                health,
            };
        }
        let (s, watched, h) = (stop.clone(), local.clone(), health.clone());
        let thread = std::thread::Builder::new()
            .name("ferroccl-init-watch".into())
            .spawn(move || {
                while !s.load(Ordering::Acquire) {
                    look(&watched, &h);
                    std::thread::sleep(INIT_WATCH_POLL);
                }
            })
            .ok();
        InitWatch {
            stop,
            thread,
            local,
            health,
        }
    }

    /// The error to report for a failed step of the assembly. A peer that died mid-step
    /// shows up as a connection closed in the middle of a handshake or a frame, which
    /// reads like a refusal ("rejected our authentication"); when a rank of this host is
    /// gone, that death is the truth, whatever the watcher's last poll saw.
    fn explain(&self, e: Error) -> Error {
        // A process closes its sockets on exit a moment before it stops existing: after a
        // closed connection, give a dying neighbour that moment.
        let closed = matches!(e, Error::Remote(_) | Error::Protocol(_));
        let until = std::time::Instant::now()
            + if closed {
                EXIT_GRACE
            } else {
                std::time::Duration::ZERO
            };
        loop {
            look(&self.local, &self.health);
            if !self.health.dead().is_empty() || std::time::Instant::now() >= until {
                break;
            }
            std::thread::sleep(INIT_WATCH_POLL / 4);
        }
        match self.health.failure() {
            Some(dead) if !self.health.dead().is_empty() && !matches!(e, Error::Aborted(_)) => dead,
            _ => e,
        }
    }
}

/// Reports each rank of `local` whose process has gone.
fn look(local: &[(usize, u32, String)], health: &Health) {
    for (q, pid, name) in local {
        if !crate::transport::pid_alive(*pid) {
            health.report_dead(
                *q,
                &format!(
                    "{name} died while the communicator was being created (process {pid} is gone)"
                ),
            );
        }
    }
}

impl Drop for InitWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Bootstrap {
    fn connect_kind(&self, peer: usize, kind: u8, tag: u64, w: &Wait) -> Result<TcpStream, Error> {
        let p = &self.peers[peer];
        let name = describe(p);
        let mut s = auth::connect(p.addr, &self.secret, w, &format!("rank {peer}"), &name)?;
        let a = listener::encode_announce(self.comm_id, self.rank, kind, tag);
        wire::write_frame(&mut s, &[&a], w, &name)?;
        Ok(s)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn nranks(&self) -> usize {
        self.nranks
    }

    pub fn peers(&self) -> &[PeerInfo] {
        &self.peers
    }

    pub fn comm_id(&self) -> u64 {
        self.comm_id
    }

    /// Test support: later connections to `rank` go to `addr` (a fault proxy in front of it).
    #[cfg(test)]
    pub(crate) fn redirect_peer(&mut self, rank: usize, addr: SocketAddr) {
        self.peers[rank].addr = addr;
    }

    /// Ring all-gather: in step s every rank forwards the block that originated s hops behind
    /// it, so each rank sends and receives n-1 messages.
    ///
    /// Small blocks are written inline before the step's read: a rank can only run ahead of
    /// its successor, never of its predecessor, so around the ring some successor is never
    /// behind, and frames of a few KiB cannot fill every socket buffer of the ring at once.
    /// A larger block is written from a second thread while this one reads, so ranks that all
    /// write before they read cannot deadlock. Small exchanges (check mode, setup) thus cost
    /// no thread.
    pub fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let max = self.config.max_bootstrap_msg;
        if mine.len() > max {
            return Err(Error::InvalidArgument(format!(
                "all-gather contribution of {} bytes exceeds max_bootstrap_msg={max}",
                mine.len()
            )));
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let (n, me) = (self.nranks, self.rank);
        let Some(ring) = &self.ring else {
            return Ok(vec![mine.to_vec()]);
        };
        let ctx = |e: Error| e.context(format!("bootstrap all-gather #{seq} on rank {me}"));
        let mut next = lock(&ring.next);
        let mut prev = lock(&ring.prev);
        let next_name = describe(&self.peers[(me + 1) % n]);
        let prev_name = describe(&self.peers[(me + n - 1) % n]);
        let mut out: Vec<Option<Vec<u8>>> = vec![None; n];
        out[me] = Some(mine.to_vec());
        for s in 0..n - 1 {
            let origin = (me + n - s) % n;
            let want = (me + n - s - 1) % n;
            let block = out[origin]
                .as_deref()
                .expect("forwarded blocks arrived in an earlier step");
            let mut head = Enc::default();
            head.u64(seq).u32(origin as u32);
            let read = |prev: &mut TcpStream, w: &Wait| -> Result<Vec<u8>, Error> {
                let mut f = wire::read_frame(prev, max + BLOCK_HEAD, w, &prev_name)?;
                let mut d = Dec::new(&f, "all-gather block");
                let (got_seq, got) = (d.u64()?, d.u32()? as usize);
                if got_seq != seq || got != want {
                    return Err(Error::Protocol(format!(
                        "{prev_name} sent block of rank {got} in collective #{got_seq}, expected rank {want} in #{seq} (mismatched bootstrap calls?)"
                    )));
                }
                f.drain(..BLOCK_HEAD);
                Ok(f)
            };
            let got = if block.len() <= INLINE_BLOCK {
                let w = self.wait();
                wire::write_frame(&mut next, &[&head.0, block], &w, &next_name)
                    .and_then(|_| read(&mut prev, &w))
            } else {
                // Either side failing stops the other at once instead of at the deadline.
                let failed = Arc::new(AtomicBool::new(false));
                let w = Wait::new(self.config.timeout, self.abort.with(failed.clone()));
                let first_err: Mutex<Option<Error>> = Mutex::new(None);
                let fail = |e: Error| {
                    lock(&first_err).get_or_insert(e);
                    failed.store(true, Ordering::Release);
                };
                let r = std::thread::scope(|sc| {
                    let (next, w2, fail, next_name, head) =
                        (&mut *next, &w, &fail, &next_name, &head);
                    sc.spawn(move || {
                        if let Err(e) = wire::write_frame(next, &[&head.0, block], w2, next_name) {
                            fail(e);
                        }
                    });
                    read(&mut prev, &w).map_err(fail).ok()
                });
                let e = lock(&first_err).take();
                match (r, e) {
                    (Some(b), None) => Ok(b),
                    (_, Some(e)) => Err(e),
                    (None, None) => Err(Error::Internal(
                        "all-gather step failed without a reason".into(),
                    )),
                }
            };
            match got {
                Ok(b) => out[want] = Some(b),
                Err(e) => {
                    // A ring left mid-message cannot carry another collective, and closing it
                    // tells the neighbours (and theirs, in turn) at once instead of at their
                    // deadlines.
                    for s in &self.shutdown {
                        let _ = s.shutdown(Shutdown::Both);
                    }
                    return Err(ctx(e));
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|b| b.expect("every block arrived"))
            .collect())
    }

    pub fn barrier(&self) -> Result<(), Error> {
        self.allgather(&[]).map(|_| ())
    }

    pub fn connect(&self, peer: usize, tag: u64) -> Result<TcpStream, Error> {
        self.check_peer(peer)?;
        let s = self
            .connect_kind(peer, KIND_USER, tag, &self.wait())
            .map_err(|e| {
                e.context(format!(
                    "rank {} connecting to rank {peer} (tag {tag})",
                    self.rank
                ))
            })?;
        wire::into_user_stream(s)
    }

    pub fn accept(&self, peer: usize, tag: u64) -> Result<TcpStream, Error> {
        self.check_peer(peer)?;
        let s = self
            .listener
            .take(
                (self.comm_id, peer, KIND_USER, tag),
                &self.wait(),
                &describe(&self.peers[peer]),
            )
            .map_err(|e| e.context(format!("rank {}", self.rank)))?;
        wire::into_user_stream(s)
    }

    /// A small message to `peer` on a stream of this communicator's (`connect` / `accept`),
    /// within the bootstrap's deadline and abort.
    pub(crate) fn send_msg(&self, s: &mut TcpStream, peer: usize, msg: &[u8]) -> Result<(), Error> {
        self.check_peer(peer)?;
        wire::write_frame(s, &[msg], &self.wait(), &describe(&self.peers[peer]))
    }

    /// The next message from `peer` on such a stream, refused above `max` bytes.
    pub(crate) fn recv_msg(
        &self,
        s: &mut TcpStream,
        peer: usize,
        max: usize,
    ) -> Result<Vec<u8>, Error> {
        self.check_peer(peer)?;
        wire::read_frame(s, max, &self.wait(), &describe(&self.peers[peer]))
    }

    fn check_peer(&self, peer: usize) -> Result<(), Error> {
        if peer >= self.nranks {
            return Err(Error::InvalidArgument(format!(
                "peer {peer} is not below nranks={}",
                self.nranks
            )));
        }
        Ok(())
    }

    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Bootstrap>, Error> {
        let nonce: [u8; 8] = auth::random_bytes()?;
        let mut e = Enc::default();
        e.u8(color.is_some() as u8)
            .u32(color.unwrap_or(0))
            .i32(key)
            .raw(&nonce);
        let all = self.allgather(&e.0)?;
        let mut members = Vec::new(); // (key, old rank, nonce)
        for (r, b) in all.iter().enumerate() {
            let mut d = Dec::new(b, "split request");
            let (has, c, k, nn) = (d.u8()?, d.u32()?, d.i32()?, d.u64()?);
            d.finish()?;
            if has == 1 && Some(c) == color {
                members.push((k, r, nn));
            }
        }
        let Some(c) = color else {
            return Ok(None);
        };
        members.sort_unstable_by_key(|&(k, r, _)| (k, r));
        let new_rank = members
            .iter()
            .position(|&(_, r, _)| r == self.rank)
            .expect("this rank is a member");
        // Every member hashes the same inputs, and the fresh nonces make the id unique even
        // when the same split is repeated.
        let mut h = Sha256::new();
        h.update(b"ferroccl split\0");
        h.update(self.comm_id.to_le_bytes());
        h.update(c.to_le_bytes());
        for &(_, _, nn) in &members {
            h.update(nn.to_le_bytes());
        }
        let comm_id = u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"));
        let peers = members
            .iter()
            .enumerate()
            .map(|(i, &(_, r, _))| PeerInfo {
                rank: i,
                ..self.peers[r].clone()
            })
            .collect();
        let own = Arc::new(AtomicBool::new(false));
        let health = Arc::new(Health::default());
        let parts = Parts {
            secret: self.secret,
            config: self.config.clone(),
            abort: self.abort.with(own.clone()).with_health(health.clone()),
            own_abort: own,
            listener: self.listener.clone(),
            health,
            tag: 0,
        };
        Bootstrap::assemble(new_rank, comm_id, peers, parts)
            .map(Some)
            .map_err(|e| e.context(format!("split of rank {} (color {c})", self.rank)))
    }

    /// A new communicator of every rank not in `exclude`, renumbered densely in the old order.
    /// Needs nothing from the old ring or from the excluded ranks, so it works after a failure:
    /// the survivors connect directly, from the addresses the old communicator learnt at init.
    /// Every survivor must pass the same set: ranks that disagree refuse each other's
    /// connections (their tags differ) and fail naming the mismatch.
    pub fn shrink(&self, exclude: &[usize]) -> Result<Bootstrap, Error> {
        if self.health.is_declared_dead() {
            // The others shrink without this rank; no list given here can bring it back.
            return Err(self
                .health
                .failure()
                .expect("declared dead is a failure")
                .context("shrink"));
        }
        let n = self.nranks;
        let mut ex = exclude.to_vec();
        ex.sort_unstable();
        ex.dedup();
        if let Some(&bad) = ex.iter().find(|&&r| r >= n) {
            return Err(Error::InvalidArgument(format!(
                "shrink: excluded rank {bad} is not below nranks={n}"
            )));
        }
        if ex.contains(&self.rank) {
            return Err(Error::InvalidArgument(format!(
                "shrink: rank {} is in its own exclude list {ex:?}; excluded ranks do not call shrink",
                self.rank
            )));
        }
        let unexcluded: Vec<usize> = self
            .health
            .dead()
            .into_iter()
            .filter(|r| !ex.contains(r))
            .collect();
        if !unexcluded.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "shrink: rank(s) {unexcluded:?} died but are not in the exclude list {ex:?}; exclude every dead rank"
            )));
        }
        let generation = self.shrinks.fetch_add(1, Ordering::Relaxed);
        let members: Vec<usize> = (0..n).filter(|r| !ex.contains(r)).collect();
        let new_rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("not excluded");
        let hash = |parts: &[&[u8]]| {
            let mut h = Sha256::new();
            for p in parts {
                h.update(p);
            }
            u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"))
        };
        let comm_id = hash(&[
            b"ferroccl shrink\0",
            &self.comm_id.to_le_bytes(),
            &generation.to_le_bytes(),
        ]);
        let member_bytes: Vec<u8> = members
            .iter()
            .flat_map(|&r| (r as u64).to_le_bytes())
            .collect();
        let tag = hash(&[b"ferroccl survivors\0", &member_bytes]);
        let peers = members
            .iter()
            .enumerate()
            .map(|(i, &r)| PeerInfo {
                rank: i,
                ..self.peers[r].clone()
            })
            .collect();
        // A fresh abort set: the old communicator is typically aborted or failed already.
        let own = Arc::new(AtomicBool::new(false));
        let health = Arc::new(Health::default());
        let parts = Parts {
            secret: self.secret,
            config: self.config.clone(),
            abort: AbortSet::new(own.clone()).with_health(health.clone()),
            own_abort: own,
            listener: self.listener.clone(),
            health,
            tag,
        };
        Bootstrap::assemble(new_rank, comm_id, peers, parts).map_err(|e| {
            let e = e.context(format!("shrink of rank {} of {n} excluding {ex:?}", self.rank));
            match e {
                Error::Timeout(m) => Error::Timeout(format!(
                    "{m}; do all survivors call shrink with the same exclude list, and is every dead rank in it?"
                )),
                e => e,
            }
        })
    }

    /// Liveness of this communicator's peers, as the heartbeats tell it.
    pub(crate) fn health(&self) -> &Arc<Health> {
        &self.health
    }

    /// The flag that `abort()` sets.
    pub(crate) fn abort_flag(&self) -> &Arc<AtomicBool> {
        &self.own_abort
    }

    /// Ends every wait of this communicator, tells the peers (they fail too, naming us), and
    /// stops the heartbeat thread.
    pub fn abort(&self) {
        self.own_abort.store(true, Ordering::Release);
        for s in &self.shutdown {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.listener.close_comm(self.comm_id);
        if let Some(mut w) = lock(&self.watch).take() {
            w.stop(true);
        }
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        // Goodbye first: neighbours then take our closing connections for what they are.
        if let Some(mut w) = lock(&self.watch).take() {
            w.stop(false);
        }
        self.listener.close_comm(self.comm_id);
    }
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bootstrap")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("comm_id", &format_args!("{:016x}", self.comm_id))
            .finish_non_exhaustive()
    }
}
