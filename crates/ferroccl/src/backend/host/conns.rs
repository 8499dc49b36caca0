//! The connections of one communicator on the host backend, made the first time a plan needs
//! them and kept for the communicator's life.
//!
//! Setup runs in two phases over every communicator of a launch, so that one thread driving
//! several ranks (or ranks that reach a collective at different times) never waits on itself:
//! phase 1 does what needs no peer (create the shared-memory FIFOs we receive on, connect the
//! sockets we send on: a peer's listener accepts in the background); phase 2 does what waits for
//! a peer's phase 1 (map the peers' FIFOs, take the accepted sockets).

use crate::bootstrap::Bootstrap;
use crate::info::CommInfo;
use crate::transport::{
    tcp_receiver_joinable, tcp_sender_joinable, Consumer, FifoLayout, FifoMem, FrameCheck, Producer,
};
use ferroccl_core::plan::{ConnKey, Dir};
use ferroccl_core::topo::TransportKind;
use ferroccl_core::{Config, Error, Rank};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// Everything a connection setup needs to know about its communicator.
pub(crate) struct ConnCtx<'a> {
    pub boot: &'a Bootstrap,
    pub info: &'a CommInfo,
    /// The launch that needs the connections, for the hint a timeout gives.
    pub seq: u64,
    pub abort: &'a Arc<AtomicBool>,
    pub deadline: Instant,
}

impl ConnCtx<'_> {
    /// A timeout waiting for `peer` explained, when the peer is a rank of this process that
    /// never started the launch.
    fn explain(&self, e: Error, peer: Rank) -> Error {
        match (&e, self.info.sibling_hint(peer, self.seq)) {
            (Error::Timeout(_), Some(hint)) => Error::Timeout(format!("{e}. {hint}")),
            _ => e,
        }
    }
}

pub(crate) struct Conns {
    pub send: HashMap<(Rank, u32), Producer>,
    pub recv: HashMap<(Rank, u32), Consumer>,
    /// Shared-memory names we created, unlinked at teardown in case a peer never opened them.
    created: Vec<String>,
    /// Send connections bridged to sockets by a thread (whose flush a failure waits for).
    tcp_send: Vec<(Rank, u32)>,
    /// The socket bridge threads, joined when an abort releases the connections.
    threads: Vec<JoinHandle<()>>,
    /// Every FIFO of the communicator, so that `abort` can poison them without taking the lock
    /// an executing operation holds.
    pub fifos: Arc<Mutex<Vec<Arc<FifoMem>>>>,
}

impl Conns {
    pub fn new(fifos: Arc<Mutex<Vec<Arc<FifoMem>>>>) -> Conns {
        Conns {
            send: HashMap::new(),
            recv: HashMap::new(),
            created: Vec::new(),
            tcp_send: Vec::new(),
            threads: Vec::new(),
            fifos,
        }
    }

    fn layout(config: &Config) -> FifoLayout {
        FifoLayout {
            slots: config.slots as u32,
            slot_bytes: config.slot_bytes,
        }
    }

    fn shm_name(boot: &Bootstrap, from: Rank, to: Rank, channel: u32) -> String {
        format!("/ferroccl-{:016x}-{from}-{to}-{channel}", boot.comm_id())
    }

    fn label(ctx: &ConnCtx, peer: Rank, channel: u32, kind: TransportKind) -> String {
        let p = &ctx.boot.peers()[peer];
        format!(
            "rank {peer} ({}, pid {}, {}) channel {channel} over {}",
            p.hostname,
            p.pid,
            p.addr,
            kind.name()
        )
    }

    fn register(&self, mem: &Arc<FifoMem>) {
        self.fifos.lock().expect("fifo list").push(mem.clone());
    }

    /// Phase 1 for `keys`: what needs nothing from the peer.
    pub fn setup_phase1(&mut self, keys: &[ConnKey], ctx: &ConnCtx) -> Result<(), Error> {
        let me = ctx.boot.rank();
        for k in keys {
            let kind = ctx
                .info
                .topo
                .transport(me, k.peer, ctx.info.config.transport)?;
            match (k.dir, kind) {
                (Dir::Recv, TransportKind::Shm)
                    if !self.recv.contains_key(&(k.peer, k.channel)) =>
                {
                    let name = Self::shm_name(ctx.boot, k.peer, me, k.channel);
                    let mem = FifoMem::shm_create(&name, Self::layout(&ctx.info.config))
                        .map_err(|e| e.context(Self::label(ctx, k.peer, k.channel, kind)))?;
                    self.created.push(name);
                    self.register(&mem);
                    self.recv.insert((k.peer, k.channel), Consumer::new(mem));
                }
                (Dir::Send, TransportKind::Tcp)
                    if !self.send.contains_key(&(k.peer, k.channel)) =>
                {
                    let label = Self::label(ctx, k.peer, k.channel, kind);
                    let stream = ctx
                        .boot
                        .connect(k.peer, k.channel as u64)
                        .map_err(|e| e.context(&label))?;
                    let check = FrameCheck::from_config(ctx.info.config.tcp_crc);
                    let (p, t) = tcp_sender_joinable(
                        stream,
                        Self::layout(&ctx.info.config),
                        check,
                        label,
                        ctx.abort.clone(),
                    )?;
                    self.threads.push(t);
                    self.register(p.mem());
                    self.tcp_send.push((k.peer, k.channel));
                    self.send.insert((k.peer, k.channel), p);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Phase 2 for `keys`: what waits for the peer's phase 1.
    pub fn setup_phase2(&mut self, keys: &[ConnKey], ctx: &ConnCtx) -> Result<(), Error> {
        let me = ctx.boot.rank();
        for k in keys {
            let kind = ctx
                .info
                .topo
                .transport(me, k.peer, ctx.info.config.transport)?;
            match (k.dir, kind) {
                (Dir::Send, TransportKind::Shm)
                    if !self.send.contains_key(&(k.peer, k.channel)) =>
                {
                    let name = Self::shm_name(ctx.boot, me, k.peer, k.channel);
                    // The receiver creates the segment; if it died first, its death ends this wait.
                    let health = ctx.boot.health();
                    let (since, warned) = (Instant::now(), std::cell::Cell::new(false));
                    let stop = || {
                        if ctx.abort.load(Ordering::Acquire) {
                            return Some(Error::Aborted(format!(
                                "while waiting for shared-memory segment {name}"
                            )));
                        }
                        if !warned.get() && since.elapsed() >= super::exec::SIBLING_WARN_AFTER {
                            warned.set(true);
                            if let Some(h) = ctx.info.sibling_hint(k.peer, ctx.seq) {
                                tracing::warn!("rank {me}: waiting for the shared-memory segment of rank {}. {h}", k.peer);
                            }
                        }
                        health.failure()
                    };
                    let mem = FifoMem::shm_open_until(
                        &name,
                        Self::layout(&ctx.info.config),
                        ctx.deadline,
                        &stop,
                    )
                    .map_err(|e| {
                        ctx.explain(e.context(Self::label(ctx, k.peer, k.channel, kind)), k.peer)
                    })?;
                    self.register(&mem);
                    self.send.insert((k.peer, k.channel), Producer::new(mem));
                }
                (Dir::Recv, TransportKind::Tcp)
                    if !self.recv.contains_key(&(k.peer, k.channel)) =>
                {
                    let label = Self::label(ctx, k.peer, k.channel, kind);
                    let stream = ctx
                        .boot
                        .accept(k.peer, k.channel as u64)
                        .map_err(|e| ctx.explain(e.context(&label), k.peer))?;
                    let check = FrameCheck::from_config(ctx.info.config.tcp_crc);
                    let (c, t) = tcp_receiver_joinable(
                        stream,
                        Self::layout(&ctx.info.config),
                        check,
                        label,
                        ctx.abort.clone(),
                    )?;
                    self.threads.push(t);
                    self.register(c.mem());
                    self.recv.insert((k.peer, k.channel), c);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Unlinks the names of the segments between `me` and dead ranks: a receiver creates its
    /// segment and the sender unlinks the name once attached, so a pair broken before that
    /// leaves the name behind unless the survivor removes it, whichever side it was on (the
    /// segment's memory goes with the last mapping).
    pub fn unlink_left_by(comm_id: u64, me: Rank, dead: &[Rank]) {
        if dead.is_empty() {
            return;
        }
        let Ok(dir) = std::fs::read_dir("/dev/shm") else {
            return;
        };
        // Every channel of each pair: the names differ only in their last field.
        let prefixes: Vec<String> = dead
            .iter()
            .flat_map(|q| {
                [
                    format!("ferroccl-{comm_id:016x}-{me}-{q}-"),
                    format!("ferroccl-{comm_id:016x}-{q}-{me}-"),
                ]
            })
            .collect();
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if prefixes.iter().any(|p| name.starts_with(p.as_str())) {
                FifoMem::shm_unlink(&format!("/{name}"));
            }
        }
    }

    /// Marks every FIFO failed so that peers stop waiting for us.
    pub fn poison_all(fifos: &Mutex<Vec<Arc<FifoMem>>>, reason: &str) {
        if let Ok(list) = fifos.lock() {
            for f in list.iter() {
                f.poison(reason);
            }
        }
    }
}

impl Conns {
    /// After a failure: gives the socket threads a moment to tell remote peers why (their
    /// poison frame), so that a process exiting right after the error still informs the job.
    pub fn flush_failure(&self, within: std::time::Duration) {
        let until = Instant::now() + within;
        for key in &self.tcp_send {
            if let Some(p) = self.send.get(key) {
                while !p.peer_closed() && Instant::now() < until {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
            }
        }
    }

    /// The most informative failure among our FIFOs within `grace`: a peer's own report of
    /// what went wrong (which names the rank that died) beats a bare "connection closed".
    pub fn explain(&self, first: Error, grace: std::time::Duration) -> Error {
        let informative =
            |e: &Error| e.message().contains("failed") || e.message().contains("died");
        if informative(&first) {
            return first;
        }
        let until = Instant::now() + grace;
        loop {
            if let Ok(list) = self.fifos.lock() {
                if let Some(e) = list
                    .iter()
                    .filter_map(|f| f.poison_error())
                    .find(informative)
                {
                    return first.clone().context(format!("{e}; and"));
                }
            }
            if Instant::now() >= until {
                return first;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

impl Conns {
    /// After an abort: frees every connection now (shared-memory mappings and names, sockets,
    /// bridge threads) instead of when the communicator is dropped.
    pub fn release(&mut self) {
        self.send.clear();
        self.recv.clear();
        self.tcp_send.clear();
        for name in self.created.drain(..) {
            FifoMem::shm_unlink(&name);
        }
        if let Ok(mut l) = self.fifos.lock() {
            l.clear();
        }
        // The abort flag is set, so each thread returns within its poll interval.
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Conns {
    fn drop(&mut self) {
        for name in &self.created {
            FifoMem::shm_unlink(name);
        }
        // Socket senders still flushing the end of the last operation must finish before the
        // communicator is gone (a process may exit right after): a peer still needs that data.
        // They stop once it is sent, or at an error, or after LINGER without progress.
        self.send.clear();
        self.recv.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
