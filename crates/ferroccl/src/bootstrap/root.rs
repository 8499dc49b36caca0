//! The root rendezvous: one thread that collects every rank's `PeerInfo`, then sends everyone
//! the full table and a fresh communicator id, and exits.
//!
//! hello (client -> root): rank u64 | nranks u64 | PeerInfo fields
//! reply (root -> client): 0 | comm_id u64 | n u64 | n x PeerInfo     (success)
//!                         1 | kind u8 | message                       (failure)

use super::auth;
use super::gate::Gate;
use super::host::MAX_HOSTNAME;
use super::wire::{self, Dec, Enc, Wait, HANDSHAKE_MAX, POLL};
use super::PeerInfo;
use ferroccl_core::{Config, Error};
use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

/// A hello is a few hundred bytes; anything larger is not one of ours.
const MAX_HELLO: usize = 4096;

/// The accept loop's poll while hellos may be on their way from handshake threads.
const ARRIVAL_POLL: std::time::Duration = std::time::Duration::from_millis(1);

const KIND_INVALID: u8 = 1;
const KIND_TIMEOUT: u8 = 2;
const KIND_PROTOCOL: u8 = 3;

pub(crate) fn encode_peer(e: &mut Enc, p: &PeerInfo) {
    e.u64(p.rank as u64)
        .addr(p.addr)
        .u64(p.host_id)
        .u32(p.pid)
        .str(&p.hostname);
}

pub(crate) fn decode_peer(d: &mut Dec) -> Result<PeerInfo, Error> {
    Ok(PeerInfo {
        rank: d.usize()?,
        addr: d.addr()?,
        host_id: d.u64()?,
        pid: d.u32()?,
        hostname: d.str(MAX_HOSTNAME)?,
    })
}

/// A rank's hello: (nranks, its PeerInfo).
pub(crate) fn decode_hello(msg: &[u8]) -> Result<(usize, PeerInfo), Error> {
    let mut d = Dec::new(msg, "rendezvous hello");
    let nranks = d.usize()?;
    let info = decode_peer(&mut d)?;
    d.finish()?;
    Ok((nranks, info))
}

struct Arrival {
    stream: TcpStream,
    from: SocketAddr,
    nranks: usize,
    info: PeerInfo,
}

/// Starts the root thread on an already bound listener (so that bind errors reach the caller).
pub(crate) fn spawn(l: TcpListener, secret: [u8; 16], config: Config) -> Result<(), Error> {
    l.set_nonblocking(true).map_err(|e| {
        Error::System(format!(
            "bootstrap root socket: {e}{}",
            super::wire::fd_hint(&e)
        ))
    })?;
    std::thread::Builder::new()
        .name("ferroccl-root".into())
        .spawn(move || serve(l, secret, config))
        .map_err(|e| Error::System(format!("starting the bootstrap root thread: {e}")))?;
    Ok(())
}

fn reply_error(a: &mut Arrival, kind: u8, msg: &str, hs: &Wait) {
    let mut e = Enc::default();
    e.u8(1).u8(kind).str(msg);
    let peer = a.from.to_string();
    if let Err(err) = wire::write_frame(&mut a.stream, &[&e.0], hs, &peer) {
        tracing::warn!(remote = %a.from, "bootstrap root could not deliver an error ({msg}): {err}");
    }
}

fn serve(l: TcpListener, secret: [u8; 16], config: Config) {
    let root_addr = l
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    // Tells the handshake threads that nobody will take their connection any more.
    let done = Arc::new(AtomicBool::new(false));
    let gate = Gate::new();
    let mut spare = wire::SpareFd::new();
    let (tx, rx) = mpsc::channel::<Arrival>();
    let mut slots: Vec<Option<Arrival>> = Vec::new();
    let mut nranks: Option<(usize, usize, SocketAddr)> = None; // (n, announced by rank, from)
    let mut arrived = 0usize;
    // Ranks refused because they gave another job size than the first arrival: they did come,
    // and the report must say so (and why) rather than count them among the missing.
    let mut refused: BTreeMap<usize, usize> = BTreeMap::new(); // rank -> the nranks it gave
    let mut first_at: Option<Instant> = None;
    let hs_wait =
        || Wait::new(config.timeout, wire::AbortSet::new(done.clone())).capped(HANDSHAKE_MAX);

    // Hellos arrive from handshake threads, not through the socket poll(2) watches: once
    // connections come in, poll briefly so that the last hello is not left waiting a full POLL
    // (every init would pay for it).
    let mut poll = POLL;
    loop {
        match wire::poll_accept(&l, poll) {
            Ok(Some((stream, from))) => {
                poll = ARRIVAL_POLL;
                let tx = tx.clone();
                let w = hs_wait();
                gate.run(stream, from, move |mut stream, done| {
                    let peer = from.to_string();
                    let r = auth::server(&mut stream, &secret, &w, &peer)
                        .and_then(|_| wire::read_frame(&mut stream, MAX_HELLO, &w, &peer))
                        .and_then(|msg| decode_hello(&msg));
                    match r {
                        Ok((nranks, info)) => {
                            done();
                            let _ = tx.send(Arrival { stream, from, nranks, info });
                        }
                        Err(e) => tracing::warn!(remote = %from, "bootstrap root dropped a connection: {e}"),
                    }
                });
            }
            Ok(None) => {}
            Err(e) => {
                if !spare.refuse_one(&l, &e, "bootstrap root") {
                    tracing::warn!("bootstrap root accept failed: {e}");
                    std::thread::sleep(POLL);
                }
            }
        }

        while let Ok(mut a) = rx.try_recv() {
            let (r, n) = (a.info.rank, a.nranks);
            if n == 0 || r >= n {
                let m = format!("rank {r} from {} is not below nranks={n}", a.from);
                reply_error(&mut a, KIND_INVALID, &m, &hs_wait());
                continue;
            }
            match nranks {
                Some((n0, r0, from0)) if n0 != n => {
                    let m = format!(
                        "rank {r} ({}) joined with nranks={n}, but rank {r0} ({from0}) started the rendezvous with nranks={n0}",
                        a.from
                    );
                    reply_error(&mut a, KIND_INVALID, &m, &hs_wait());
                    refused.insert(r, n);
                    continue;
                }
                Some(_) => {}
                None => {
                    nranks = Some((n, r, a.from));
                    slots = (0..n).map(|_| None).collect();
                }
            }
            if let Some(first) = &slots[r] {
                let m = format!(
                    "rank {r} is already taken by {} (listener {}); {} tried to join as rank {r} too",
                    first.from, first.info.addr, a.from
                );
                reply_error(&mut a, KIND_INVALID, &m, &hs_wait());
                continue;
            }
            first_at.get_or_insert_with(Instant::now);
            slots[r] = Some(a);
            arrived += 1;
        }

        if let Some((n, _, _)) = nranks {
            if arrived == n {
                let comm_id = u64::from_le_bytes(auth::random_bytes().unwrap_or_else(|_| {
                    // Without OS randomness, a time-derived id still separates communicators.
                    let t = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap_or_default();
                    (t.as_nanos() as u64 ^ std::process::id() as u64).to_le_bytes()
                }));
                let mut e = Enc::default();
                e.u8(0).u64(comm_id).u64(n as u64);
                for a in slots.iter().flatten() {
                    encode_peer(&mut e, &a.info);
                }
                for a in slots.iter_mut().flatten() {
                    let peer = a.from.to_string();
                    if let Err(err) = wire::write_frame(&mut a.stream, &[&e.0], &hs_wait(), &peer) {
                        tracing::warn!(remote = %a.from, "bootstrap root could not send the peer table to rank {}: {err}", a.info.rank);
                    }
                }
                tracing::debug!("bootstrap root {root_addr}: rendezvous of {n} ranks complete");
                break;
            }
            // Not ended at a refusal: the refused rank's place may still be taken by a rank that
            // gives the right size (a stray process, then the real one).
            if first_at.is_some_and(|t| t.elapsed() >= config.timeout) {
                let missing: Vec<usize> = (0..n)
                    .filter(|&i| slots[i].is_none() && !refused.contains_key(&i))
                    .collect();
                let (r0, from0) = nranks.map(|x| (x.1, x.2)).expect("set with n");
                let mut parts = Vec::new();
                if !refused.is_empty() {
                    parts.push(format!(
                        "{}, but rank {r0} ({from0}) started the rendezvous at {root_addr} saying {n}: the number of ranks \
                         (WORLD_SIZE under a launcher) differs between ranks; give every rank the same",
                        size_claims(&refused)
                    ));
                }
                if !missing.is_empty() {
                    parts.push(format!(
                        "ranks {missing:?} of {n} never arrived at the rendezvous at {root_addr} within {:?}",
                        config.timeout
                    ));
                }
                let m = parts.join("; ");
                let kind = if refused.is_empty() {
                    KIND_TIMEOUT
                } else {
                    KIND_INVALID
                };
                tracing::warn!("{m}");
                for a in slots.iter_mut().flatten() {
                    reply_error(a, kind, &m, &hs_wait());
                }
                break;
            }
        }
    }
    done.store(true, Ordering::Release);
}

/// "ranks 1, 2 arrived saying the job has 4 ranks; rank 3 saying 5", from rank -> nranks given.
fn size_claims(refused: &BTreeMap<usize, usize>) -> String {
    let mut by_size: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for (r, n) in refused {
        by_size.entry(*n).or_default().push(r.to_string());
    }
    let claims: Vec<String> = by_size
        .iter()
        .enumerate()
        .map(|(i, (n, rs))| {
            let who = format!(
                "rank{} {}",
                if rs.len() > 1 { "s" } else { "" },
                rs.join(", ")
            );
            if i == 0 {
                format!("{who} arrived saying the job has {n} ranks")
            } else {
                format!("{who} saying {n}")
            }
        })
        .collect();
    claims.join("; ")
}

/// The client half: sends this rank's hello on an authenticated root connection and waits for
/// the table. Returns (comm_id, peers indexed by rank).
pub(crate) fn rendezvous(
    s: &mut TcpStream,
    root: SocketAddr,
    nranks: usize,
    me: &PeerInfo,
    max_msg: usize,
    w: &Wait,
) -> Result<(u64, Vec<PeerInfo>), Error> {
    let peer = format!("the bootstrap root at {root}");
    let mut e = Enc::default();
    e.u64(nranks as u64);
    encode_peer(&mut e, me);
    wire::write_frame(s, &[&e.0], w, &peer)?;
    let msg = wire::read_frame(s, max_msg, w, &peer).map_err(|err| match err {
        Error::Timeout(_) => Error::Timeout(format!(
            "rank {} of {nranks}: the rendezvous at {root} did not complete within {}",
            me.rank,
            w.limit()
        )),
        other => other,
    })?;
    decode_reply(&msg, nranks, &peer)
}

/// The root's answer: (comm_id, peers indexed by rank), or the error it reports.
pub(crate) fn decode_reply(
    msg: &[u8],
    nranks: usize,
    peer: &str,
) -> Result<(u64, Vec<PeerInfo>), Error> {
    let mut d = Dec::new(msg, "rendezvous reply");
    match d.u8()? {
        0 => {
            let comm_id = d.u64()?;
            let n = d.usize()?;
            if n != nranks {
                return Err(Error::Protocol(format!(
                    "{peer} sent a table of {n} ranks, expected {nranks}"
                )));
            }
            let mut peers = Vec::with_capacity(n.min(msg.len() / 40));
            for i in 0..n {
                let p = decode_peer(&mut d)?;
                if p.rank != i {
                    return Err(Error::Protocol(format!(
                        "{peer} sent a table with rank {} at position {i}",
                        p.rank
                    )));
                }
                peers.push(p);
            }
            d.finish()?;
            Ok((comm_id, peers))
        }
        1 => {
            let kind = d.u8()?;
            let m = d.str(u16::MAX as usize)?;
            Err(match kind {
                KIND_INVALID => Error::InvalidArgument(m),
                KIND_TIMEOUT => Error::Timeout(m),
                KIND_PROTOCOL => Error::Protocol(m),
                _ => Error::Remote(m),
            })
        }
        t => Err(Error::Protocol(format!(
            "{peer} sent an unknown reply type {t}"
        ))),
    }
}
