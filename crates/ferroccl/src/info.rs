//! What every backend's launch borrows from a communicator: who it is ([`CommInfo`], fixed at
//! creation) and what a launch changes ([`CommState`], behind the communicator's lock).

use ferroccl_core::topo::Topology;
use ferroccl_core::tune::{self, Choice, OpShape};
use ferroccl_core::{Config, Error, Rank};
use std::collections::HashSet;

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
                tracing::debug!(rank = info.rank, "{} of {} x {}{} on {} ranks: {c}", s.kind, s.count, s.dtype, if s.in_place { " in place" } else { "" }, s.nranks);
            }
        }
    }
}
