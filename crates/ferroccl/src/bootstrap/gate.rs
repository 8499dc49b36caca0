//! Runs each incoming connection's handshake on its own small thread, so a silent or slow
//! client never stalls the accept loop, with a cap on how many run at once so that a flood
//! of connections costs bounded memory.
//!
//! When the cap is reached, the oldest unfinished handshake is cut off rather than the new
//! arrival refused: a real rank completes its handshake in well under a millisecond, so what
//! has waited longest is the likeliest to be a silent stranger, and a flood of them cannot
//! lock out the job. (A rank cut off anyway retries; see `auth::connect`.)

use std::collections::VecDeque;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Unfinished handshakes kept; beyond this, the oldest is cut off.
pub(crate) const MAX_PENDING: usize = 128;
/// Threads, including those of cut-off handshakes that have not exited yet (they exit at
/// their next read, within milliseconds); beyond this, new connections are dropped.
pub(crate) const MAX_THREADS: usize = 2 * MAX_PENDING;
/// A handshake needs little stack: a few fixed-size buffers and an HMAC state.
const STACK: usize = 256 << 10;

#[derive(Clone)]
pub(crate) struct Gate {
    threads: Arc<AtomicUsize>,
    /// Handshakes in progress, oldest first: (id, remote, a handle to cut it off).
    pending: Arc<Mutex<VecDeque<(u64, SocketAddr, TcpStream)>>>,
    next_id: Arc<AtomicU64>,
}

/// Held by a handshake thread: frees its place when the thread ends, however it ends.
struct Slot {
    id: u64,
    gate: Gate,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.threads.fetch_sub(1, Ordering::AcqRel);
        let mut p = self.gate.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.retain(|(id, _, _)| *id != self.id);
    }
}

impl Gate {
    pub fn new() -> Gate {
        Gate {
            threads: Arc::new(AtomicUsize::new(0)),
            pending: Arc::default(),
            next_id: Arc::default(),
        }
    }

    /// Runs `f(stream)` on a handshake thread. `f` hands the stream on when the handshake
    /// succeeds; it is then no longer counted as pending.
    pub fn run(
        &self,
        stream: TcpStream,
        from: SocketAddr,
        f: impl FnOnce(TcpStream, &dyn Fn()) + Send + 'static,
    ) {
        if self.threads.fetch_add(1, Ordering::AcqRel) >= MAX_THREADS {
            self.threads.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(remote = %from, "bootstrap listener: {MAX_THREADS} handshake threads busy, dropping a connection");
            return;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if p.len() >= MAX_PENDING {
                if let Some((_, old, s)) = p.pop_front() {
                    tracing::warn!(remote = %old, "bootstrap listener: {MAX_PENDING} handshakes pending, cutting off the oldest");
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
            match stream.try_clone() {
                Ok(h) => p.push_back((id, from, h)),
                // Without a handle it cannot be cut off, but it still times out on its own.
                Err(e) => {
                    tracing::warn!(remote = %from, "bootstrap listener: cannot track a handshake: {e}")
                }
            }
        }
        let slot = Slot {
            id,
            gate: self.clone(),
        };
        let done_gate = self.clone();
        let r = std::thread::Builder::new()
            .name("ferroccl-auth".into())
            .stack_size(STACK)
            .spawn(move || {
                let slot = slot;
                let done = || {
                    let mut p = done_gate.pending.lock().unwrap_or_else(|e| e.into_inner());
                    p.retain(|(i, _, _)| *i != slot.id);
                };
                f(stream, &done)
            });
        if let Err(e) = r {
            tracing::warn!(remote = %from, "bootstrap listener: cannot start a handshake thread: {e}");
        }
    }
}
