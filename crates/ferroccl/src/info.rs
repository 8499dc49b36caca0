//! What every backend's launch borrows from a communicator: who it is ([`CommInfo`], fixed at
//! creation) and what a launch changes ([`CommState`], behind the communicator's lock).

use ferroccl_core::topo::Topology;
use ferroccl_core::tune::{self, Choice, OpShape};
use ferroccl_core::{Config, Error, Rank};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What a communicator is, fixed at creation.
#[derive(Debug)]
pub(crate) struct CommInfo {
    pub rank: Rank,
    pub nranks: usize,
    pub config: Config,
    pub topo: Topology,
    /// What the ranks run on, as the tuner sees it.
    pub device: tune::Device,
    /// "rank 2 (host, pid 123)" for each rank, for messages.
    pub peer_names: Vec<String>,
    /// Each rank's process id where it shares our host, else 0 (for liveness checks).
    pub peer_pids: Vec<u32>,
    /// The transport to each rank ("shm", "tcp"), for messages.
    pub peer_via: Vec<&'static str>,
    /// The ranks made together by one `Comm::init_all` / `init_devices` call, if this is one.
    pub siblings: Option<Arc<Siblings>>,
}

/// The communicators one `init_all` made, which this process drives. A rank that waits on a
/// sibling that never started the operation is the classic mistake of driving several ranks
/// one after the other from one thread: the first call waits for the others forever. Errors
/// and warnings say so.
#[derive(Debug)]
pub(crate) struct Siblings {
    /// The launch (sequence number) each rank last entered.
    entered: Vec<AtomicU64>,
}

impl Siblings {
    pub fn new(nranks: usize) -> Arc<Siblings> {
        Arc::new(Siblings {
            entered: (0..nranks).map(|_| AtomicU64::new(0)).collect(),
        })
    }
}

impl CommInfo {
    /// Records that this rank entered launch `seq`.
    pub fn entered(&self, seq: u64) {
        if let Some(s) = &self.siblings {
            s.entered[self.rank].store(seq, Ordering::Release);
        }
    }

    /// When `peer` is a rank of this process that has not started launch `seq`: why this rank
    /// may wait for it forever, and what to do.
    pub fn sibling_hint(&self, peer: Rank, seq: u64) -> Option<String> {
        let s = self.siblings.as_ref()?;
        let theirs = s.entered.get(peer)?.load(Ordering::Acquire);
        (theirs < seq).then(|| {
            format!(
                "rank {peer} is a rank of this process (Comm::init_all) and has not started this operation: if one \
                 thread drives several ranks one after the other, the first call waits for the others forever; use a \
                 Group to drive several ranks from one thread (or a thread per rank)"
            )
        })
    }
}

/// What a launch changes, under the communicator's lock.
#[derive(Default)]
pub(crate) struct CommState {
    /// Launches so far, named in errors so that one can tell which call failed.
    pub seq: u64,
    /// Set by the first failure that may have left peers or buffers half-way: later calls fail.
    pub failed: Option<Error>,
    /// Operation shapes whose choice was logged (only while debug logging is on).
    logged: HashSet<OpShape>,
    /// The posted-receive rendezvous' streams (`launch/posts.rs`), opened at first use: by peer
    /// and direction (true: this rank posts its receives from the peer; false: it reads the
    /// peer's postings for its sends).
    pub posts: std::collections::HashMap<(ferroccl_core::Rank, bool), std::net::TcpStream>,
}

impl CommState {
    /// Logs the tuner's choice for each shape not seen before, at debug level: once per shape,
    /// so that a training loop's log shows each of its operations once.
    pub fn log_choices(&mut self, info: &CommInfo, shapes: &[OpShape], choices: &[Choice]) {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        for (s, c) in shapes.iter().zip(choices) {
            if self.logged.insert(*s) {
                tracing::debug!(
                    rank = info.rank,
                    "{} of {} x {}{} on {} ranks: {c}",
                    s.kind,
                    s.count,
                    s.dtype,
                    if s.in_place { " in place" } else { "" },
                    s.nranks
                );
            }
        }
    }
}
