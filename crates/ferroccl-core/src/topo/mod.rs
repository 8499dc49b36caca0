//! The topology model: where each rank runs, and so how each pair of ranks is linked.
//! (GPUs, NVLink, NUMA and NICs join this model with the CUDA backend.)

use crate::config::TransportChoice;
use crate::types::{Error, Rank};

/// Where one rank runs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankLocation {
    /// Identifies the host (hostname and boot id), so containers sharing a name differ.
    pub host_id: u64,
    /// The host's name, for messages.
    pub hostname: String,
    /// The process id.
    pub pid: u32,
}

/// How two ranks can reach each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Link {
    /// Threads of one process.
    SameProcess,
    /// Processes of one host.
    SameHost,
    /// Different hosts.
    Network,
}

/// The transport the host backend uses for a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum TransportKind {
    /// A FIFO in a POSIX shared-memory segment mapped by both ranks.
    Shm,
    /// A TCP socket.
    Tcp,
}

impl TransportKind {
    /// Its name in messages ("shm", "tcp").
    pub const fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
        }
    }
}

/// Where every rank of a communicator runs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Topology {
    /// Indexed by rank.
    pub ranks: Vec<RankLocation>,
}

impl Topology {
    /// How ranks `a` and `b` can reach each other.
    pub fn link(&self, a: Rank, b: Rank) -> Link {
        let (x, y) = (&self.ranks[a], &self.ranks[b]);
        if x.host_id != y.host_id {
            Link::Network
        } else if x.pid == y.pid {
            Link::SameProcess
        } else {
            Link::SameHost
        }
    }

    /// The transport between `a` and `b` under the configured choice.
    pub fn transport(
        &self,
        a: Rank,
        b: Rank,
        choice: TransportChoice,
    ) -> Result<TransportKind, Error> {
        let link = self.link(a, b);
        match (choice, link) {
            (TransportChoice::Tcp, _) | (TransportChoice::Auto, Link::Network) => {
                Ok(TransportKind::Tcp)
            }
            (TransportChoice::Shm | TransportChoice::Auto, Link::SameProcess | Link::SameHost) => {
                Ok(TransportKind::Shm)
            }
            (TransportChoice::Shm, Link::Network) => Err(Error::InvalidArgument(format!(
                "transport shm was forced, but ranks {a} ({}) and {b} ({}) are on different hosts",
                self.ranks[a].hostname, self.ranks[b].hostname
            ))),
        }
    }

    /// Number of distinct hosts.
    pub fn hosts(&self) -> usize {
        let mut ids: Vec<u64> = self.ranks.iter().map(|r| r.host_id).collect();
        ids.sort();
        ids.dedup();
        ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transports_follow_topology_and_choice() {
        let loc = |h, p| RankLocation {
            host_id: h,
            hostname: format!("h{h}"),
            pid: p,
        };
        let t = Topology {
            ranks: vec![loc(1, 10), loc(1, 10), loc(1, 11), loc(2, 10)],
        };
        assert_eq!(t.link(0, 1), Link::SameProcess);
        assert_eq!(t.link(0, 2), Link::SameHost);
        assert_eq!(t.link(0, 3), Link::Network);
        assert_eq!(
            t.transport(0, 2, TransportChoice::Auto).unwrap(),
            TransportKind::Shm
        );
        assert_eq!(
            t.transport(0, 3, TransportChoice::Auto).unwrap(),
            TransportKind::Tcp
        );
        assert_eq!(
            t.transport(0, 1, TransportChoice::Tcp).unwrap(),
            TransportKind::Tcp
        );
        assert!(t
            .transport(0, 3, TransportChoice::Shm)
            .unwrap_err()
            .to_string()
            .contains("different hosts"));
        assert_eq!(t.hosts(), 2);
    }
}
