//! Heartbeats between ring neighbours, on authenticated connections of their own.
//!
//! A peer whose process dies is noticed at once, because the kernel closes its sockets; one
//! that hangs, or whose host or network goes away, is noticed after `interval * misses` of
//! silence. Each rank watches only its two ring neighbours and forwards what it learns to
//! the other one, so news of a death crosses the ring in a few hops (a ring minus one rank is
//! a path, and both of its ends know).
//!
//! frame: kind u8 | rank u32 | reason length u16 | reason (UTF-8, at most MAX_REASON bytes)
//!   HEARTBEAT  rank = sender; nothing else
//!   LEFT       rank destroyed its communicator (not a failure)
//!   DEAD       rank died; the reason names it and who noticed
//!   ABORTED    rank aborted its communicator
//!
//! Leaving (communicator dropped or aborted): send LEFT or ABORTED, half-close, and read
//! until the neighbour closes too, so that no unread byte turns our close into a reset that
//! could destroy the notice before the neighbour reads it.

use super::health::Health;
use ferroccl_core::{Error, Rank};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const HEARTBEAT: u8 = 1;
const LEFT: u8 = 2;
const DEAD: u8 = 3;
const ABORTED: u8 = 4;
const HEAD: usize = 1 + 4 + 2;
const MAX_REASON: usize = 512;
/// Unsent bytes beyond which further heartbeats to a neighbour are dropped: it reads nothing,
/// and its silence will be noticed the other way.
const MAX_QUEUED: usize = 64 << 10;
/// How long leaving waits for neighbours to read the notice and close.
const LEAVE_WAIT: Duration = Duration::from_millis(200);

/// Who we are and how to name everyone, for the messages the thread writes.
pub(crate) struct WatchSpec {
    pub me: Rank,
    /// "rank 2 (host, pid 123, 10.0.0.2:41234)" for every rank.
    pub names: Vec<String>,
    pub interval: Duration,
    pub misses: u32,
}

struct Link {
    peer: Rank,
    sock: TcpStream,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    heard: Instant,
    /// The neighbour said it is leaving (LEFT or its own ABORTED): its close is expected.
    leaving: bool,
    open: bool,
}

pub(crate) struct Watch {
    wake: UnixStream,
    abort: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    /// Starts the thread on the connections to the ring neighbours (`(peer, socket)`).
    pub fn start(
        spec: WatchSpec,
        links: Vec<(Rank, TcpStream)>,
        health: Arc<Health>,
    ) -> Result<Watch, Error> {
        let sys = |e: io::Error| {
            Error::System(format!(
                "rank {}: setting up heartbeats: {e}{}",
                spec.me,
                super::wire::fd_hint(&e)
            ))
        };
        let (wake, wake_rx) = UnixStream::pair().map_err(sys)?;
        wake_rx.set_nonblocking(true).map_err(sys)?;
        let now = Instant::now();
        let mut ls = Vec::with_capacity(links.len());
        for (peer, sock) in links {
            sock.set_nonblocking(true).map_err(sys)?;
            ls.push(Link {
                peer,
                sock,
                inbuf: Vec::new(),
                out: Vec::new(),
                heard: now,
                leaving: false,
                open: true,
            });
        }
        let abort = Arc::new(AtomicBool::new(false));
        let ab = abort.clone();
        let thread = std::thread::Builder::new()
            .name("ferroccl-watch".into())
            .spawn(move || {
                Watcher {
                    spec,
                    links: ls,
                    health,
                }
                .run(&wake_rx, &ab)
            })
            .map_err(|e| {
                Error::System(format!(
                    "starting the heartbeat thread: {e} (thread limit reached?)"
                ))
            })?;
        Ok(Watch {
            wake,
            abort,
            thread: Some(thread),
        })
    }

    /// Tells the neighbours we leave (`aborted`: because of an abort) and ends the thread.
    pub fn stop(&mut self, aborted: bool) {
        if let Some(t) = self.thread.take() {
            self.abort.store(aborted, Ordering::Release);
            // send, not write: MSG_NOSIGNAL, in case the watcher is already gone.
            // SAFETY: one byte from a live buffer to our own socket.
            let _ = unsafe {
                libc::send(
                    self.wake.as_raw_fd(),
                    [1u8].as_ptr().cast(),
                    1,
                    libc::MSG_NOSIGNAL,
                )
            };
            let _ = t.join();
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop(false);
    }
}

fn frame(kind: u8, rank: Rank, reason: &str) -> Vec<u8> {
    let reason = ferroccl_core::types::clip_message(reason, MAX_REASON);
    let n = reason.len();
    let mut f = Vec::with_capacity(HEAD + n);
    f.push(kind);
    f.extend_from_slice(&(rank as u32).to_le_bytes());
    f.extend_from_slice(&(n as u16).to_le_bytes());
    f.extend_from_slice(&reason.as_bytes()[..n]);
    f
}

enum Event {
    Frame(u8, Rank, String),
    Closed(String),
}

struct Watcher {
    spec: WatchSpec,
    links: Vec<Link>,
    health: Arc<Health>,
}

impl Watcher {
    fn run(mut self, wake: &UnixStream, abort: &AtomicBool) {
        let silence = self.spec.interval * self.spec.misses;
        let mut next_beat = Instant::now();
        loop {
            let now = Instant::now();
            if now >= next_beat {
                let hb = frame(HEARTBEAT, self.spec.me, "");
                for l in self
                    .links
                    .iter_mut()
                    .filter(|l| l.open && l.out.len() < MAX_QUEUED)
                {
                    l.out.extend_from_slice(&hb);
                }
                next_beat = now + self.spec.interval;
            }
            for i in 0..self.links.len() {
                let l = &self.links[i];
                if l.open && !l.leaving && now.duration_since(l.heard) >= silence {
                    // What already arrived counts: if this thread itself was not scheduled for
                    // a while, the neighbour's heartbeats are waiting in the socket.
                    for ev in read_link(&mut self.links[i]) {
                        self.handle(i, ev);
                    }
                }
                let l = &self.links[i];
                if l.open && !l.leaving && now.duration_since(l.heard) >= silence {
                    let why = format!(
                        "no heartbeat for {silence:?} (FERROCCL_HEARTBEAT_INTERVAL {:?} x FERROCCL_HEARTBEAT_MISSES {}): \
                         its process is hung or its host or network is down",
                        self.spec.interval, self.spec.misses
                    );
                    self.close(i, &why);
                }
            }
            for l in self.links.iter_mut().filter(|l| l.open) {
                flush(l);
            }

            let mut until = next_beat;
            for l in self.links.iter().filter(|l| l.open && !l.leaving) {
                until = until.min(l.heard + silence);
            }
            let mut fds = vec![libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            for l in &self.links {
                let fd = if l.open { l.sock.as_raw_fd() } else { -1 };
                let out = if l.out.is_empty() { 0 } else { libc::POLLOUT };
                fds.push(libc::pollfd {
                    fd,
                    events: libc::POLLIN | out,
                    revents: 0,
                });
            }
            let ms = until
                .saturating_duration_since(Instant::now())
                .as_millis()
                .clamp(1, 60_000) as libc::c_int;
            // SAFETY: `fds` is a valid array of pollfd; negative fds are ignored by poll.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if fds[0].revents != 0 {
                break;
            }
            for i in 0..self.links.len() {
                if fds[i + 1].revents != 0 && self.links[i].open {
                    for ev in read_link(&mut self.links[i]) {
                        self.handle(i, ev);
                    }
                }
            }
        }
        self.leave(abort.load(Ordering::Acquire));
    }

    fn handle(&mut self, i: usize, ev: Event) {
        let peer = self.links[i].peer;
        match ev {
            // Frames come only from authenticated peers: a bad rank is a bug or corruption.
            Event::Frame(k, r, _) if r >= self.spec.names.len() => self.close(
                i,
                &format!(
                    "sent a heartbeat frame (kind {k}) about rank {r}, outside the communicator"
                ),
            ),
            Event::Closed(detail) => self.close(i, &detail),
            Event::Frame(HEARTBEAT, ..) => {}
            Event::Frame(LEFT, r, _) => {
                if r == peer {
                    self.links[i].leaving = true;
                    self.retire(i);
                }
                if self.health.report_left(r) {
                    self.forward(i, &frame(LEFT, r, ""));
                }
            }
            Event::Frame(ABORTED, r, why) => {
                if r == peer {
                    self.links[i].leaving = true;
                    self.retire(i);
                }
                if self.health.report_aborted(r, &why) {
                    self.forward(i, &frame(ABORTED, r, &why));
                }
            }
            // About this rank: the others gave up on it (it was stopped or starved, say) and
            // are going on without it. Nothing to forward: they know.
            Event::Frame(DEAD, r, why) if r == self.spec.me => {
                self.health.report_declared_dead(self.declared_dead(&why));
            }
            Event::Frame(DEAD, r, why) => {
                if self.health.report_dead(r, &why) {
                    self.forward(i, &frame(DEAD, r, &why));
                }
            }
            Event::Frame(k, ..) => {
                self.close(i, &format!("sent an unknown heartbeat frame kind {k}"))
            }
        }
    }

    /// The link to a neighbour ended; without a goodbye first, that neighbour is dead, unless
    /// the others declared this rank dead: then this is their goodbye.
    fn close(&mut self, i: usize, detail: &str) {
        let news = !self.links[i].leaving && !self.health.is_declared_dead();
        let l = &mut self.links[i];
        if !l.open {
            return;
        }
        l.open = false;
        let peer = l.peer;
        let why = format!(
            "{} died: {detail}; noticed by rank {}",
            self.spec.names[peer], self.spec.me
        );
        if news {
            // Told to the neighbour itself too: if it is only stopped or starved, it reads this
            // when it runs again and learns that it was declared dead, by whom and why, instead
            // of taking our closed connection for our death.
            l.out.extend_from_slice(&frame(DEAD, peer, &why));
            flush(l);
        }
        let _ = l.sock.shutdown(Shutdown::Both);
        if news && self.health.report_dead(peer, &why) {
            self.forward(i, &frame(DEAD, peer, &why));
        }
    }

    /// This rank's own account of the others' report `why` that it died.
    fn declared_dead(&self, why: &str) -> String {
        let me = &self.spec.names[self.spec.me];
        let what = why.strip_prefix(&format!("{me} died: ")).unwrap_or(why);
        let hint = if what.contains("no heartbeat") {
            ". This process was most likely stopped (SIGSTOP, Ctrl-Z, a debugger) or starved of CPU for that long; \
             if such pauses are expected, raise FERROCCL_HEARTBEAT_INTERVAL or FERROCCL_HEARTBEAT_MISSES on every rank"
        } else {
            ""
        };
        format!("this rank, {me}, was declared dead by the other ranks, which have gone on without it ({what}){hint}")
    }

    /// A neighbour said goodbye: close our end so that its leave() sees EOF and returns.
    fn retire(&mut self, i: usize) {
        let l = &mut self.links[i];
        flush(l);
        l.open = false;
        let _ = l.sock.shutdown(Shutdown::Both);
    }

    fn forward(&mut self, from: usize, f: &[u8]) {
        for (j, l) in self.links.iter_mut().enumerate() {
            if j != from && l.open {
                l.out.extend_from_slice(f);
                flush(l);
            }
        }
    }

    fn leave(mut self, aborted: bool) {
        let me = self.spec.me;
        let f = if aborted {
            frame(
                ABORTED,
                me,
                &format!("{} aborted its communicator", self.spec.names[me]),
            )
        } else {
            frame(LEFT, me, "")
        };
        let until = Instant::now() + LEAVE_WAIT;
        for l in self.links.iter_mut().filter(|l| l.open) {
            l.out.extend_from_slice(&f);
        }
        // Send, half-close, then read until the neighbour closes (or the wait ends).
        loop {
            let mut pending = false;
            for l in self.links.iter_mut().filter(|l| l.open) {
                if !l.out.is_empty() {
                    flush(l);
                    if l.out.is_empty() {
                        let _ = l.sock.shutdown(Shutdown::Write);
                    }
                }
                let mut buf = [0u8; 512];
                loop {
                    match (&l.sock).read(&mut buf) {
                        Ok(0) => {
                            l.open = false;
                            break;
                        }
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(_) => {
                            l.open = false;
                            break;
                        }
                    }
                }
                pending |= l.open;
            }
            let now = Instant::now();
            if !pending || now >= until {
                break;
            }
            let mut fds: Vec<libc::pollfd> = self
                .links
                .iter()
                .filter(|l| l.open)
                .map(|l| libc::pollfd {
                    fd: l.sock.as_raw_fd(),
                    events: libc::POLLIN | if l.out.is_empty() { 0 } else { libc::POLLOUT },
                    revents: 0,
                })
                .collect();
            let ms = (until - now).as_millis().max(1) as libc::c_int;
            // SAFETY: valid pollfd array.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        }
        for l in &self.links {
            let _ = l.sock.shutdown(Shutdown::Both);
        }
    }
}

/// Writes what the socket takes now; the rest waits for POLLOUT.
fn flush(l: &mut Link) {
    while !l.out.is_empty() {
        match (&l.sock).write(&l.out) {
            Ok(0) => return,
            Ok(n) => {
                l.out.drain(..n);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // WouldBlock: later. Other errors: the read side reports the broken connection.
            Err(_) => return,
        }
    }
}

/// Reads what is available and splits it into frames.
fn read_link(l: &mut Link) -> Vec<Event> {
    let mut evs = Vec::new();
    let mut buf = [0u8; 4096];
    // A close is reported after the frames that came before it: a goodbye followed by EOF
    // is a goodbye, not a death.
    let mut closed = None;
    loop {
        match (&l.sock).read(&mut buf) {
            Ok(0) => {
                closed = Some("its heartbeat connection closed without a goodbye (process killed, crashed, or exited \
                               without destroying its communicator)"
                    .to_string());
                break;
            }
            Ok(n) => {
                l.heard = Instant::now();
                l.inbuf.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => {
                closed = Some(format!(
                    "its heartbeat connection failed ({e}): process killed or network cut"
                ));
                break;
            }
        }
    }
    let mut at = 0;
    while l.inbuf.len() - at >= HEAD {
        let b = &l.inbuf[at..];
        let kind = b[0];
        let rank = u32::from_le_bytes(b[1..5].try_into().expect("4 bytes")) as usize;
        let len = u16::from_le_bytes(b[5..7].try_into().expect("2 bytes")) as usize;
        if len > MAX_REASON {
            // Frames come only from authenticated peers: this is a bug or corruption.
            evs.push(Event::Closed(format!("its heartbeat connection carried a {len}-byte reason (limit {MAX_REASON}): corrupt stream")));
            break;
        }
        if b.len() < HEAD + len {
            break;
        }
        evs.push(Event::Frame(
            kind,
            rank,
            String::from_utf8_lossy(&b[HEAD..HEAD + len]).into_owned(),
        ));
        at += HEAD + len;
    }
    l.inbuf.drain(..at);
    evs.extend(closed.map(Event::Closed));
    evs
}
