//! Runs each incoming connection's handshake on its own small thread, so a silent or slow
//! client never stalls the accept loop, with a cap on how many run at once so that a flood
//! of connections costs bounded memory.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Beyond this many unfinished handshakes, new connections are dropped on arrival.
const MAX_PENDING: usize = 128;
/// A handshake needs little stack: a few fixed-size buffers and an HMAC state.
const STACK: usize = 256 << 10;

#[derive(Clone)]
pub(crate) struct Gate {
    pending: Arc<AtomicUsize>,
}

struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gate {
    pub fn new() -> Gate {
        Gate { pending: Arc::new(AtomicUsize::new(0)) }
    }

    pub fn run(&self, from: SocketAddr, f: impl FnOnce() + Send + 'static) {
        if self.pending.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(remote = %from, "bootstrap listener: {MAX_PENDING} handshakes pending, dropping a connection");
            return;
        }
        let slot = Slot(self.pending.clone());
        let r = std::thread::Builder::new().name("ferroccl-auth".into()).stack_size(STACK).spawn(move || {
            let _slot = slot;
            f()
        });
        if let Err(e) = r {
            tracing::warn!(remote = %from, "bootstrap listener: cannot start a handshake thread: {e}");
        }
    }
}
