//! Check mode (`Config::check_mismatch`): before a launch moves anything, every rank
//! all-gathers its launch signature over the bootstrap ring and compares them all
//! (`ferroccl_core::opsig`). Every rank sees the same bytes, so all of them run the launch or
//! all of them fail it with the same message, and no user buffer has been touched.
//!
//! Only launches with at least one collective are checked: a launch of sends and receives
//! involves only some ranks, and the others would never join the all-gather. Its sends and
//! receives are checked along with the collectives of the launch.

use crate::comm::Comm;
use crate::ops::OpArgs;
use ferroccl_core::opsig::{compare, encode_launch, OpSig};
use ferroccl_core::{CollKind, Error};

/// Why a check did not pass.
pub(crate) enum CheckFailure {
    /// The ranks disagree: an argument error on every rank; the communicator stays usable.
    Mismatch(String),
    /// The exchange itself failed (a peer died, timed out, or is out of step).
    Exchange(Error),
}

/// Whether every rank of the communicator takes part (so may be asked to compare).
pub(crate) fn involves_every_rank(kind: CollKind) -> bool {
    !matches!(kind, CollKind::Send | CollKind::Recv)
}

pub(crate) fn signature(seq: u64, args: &[OpArgs]) -> Vec<u8> {
    let ops: Vec<OpSig> = args.iter().map(|a| OpSig::new(a.kind, a.dtype, a.count, a.op, a.root)).collect();
    encode_launch(seq, &ops)
}

fn agree_one(comm: &Comm, sig: &[u8]) -> Result<(), CheckFailure> {
    let all = comm.boot.allgather(sig).map_err(CheckFailure::Exchange)?;
    compare(&all).map_err(CheckFailure::Mismatch)
}

/// Runs the check for each communicator with its signature. Several communicators in one
/// launch are usually ranks of one job driven by one thread: their all-gathers must run at
/// the same time or they would wait on each other, hence a thread each.
pub(crate) fn agree(comms: &[&Comm], sigs: &[Vec<u8>]) -> Vec<Result<(), CheckFailure>> {
    if comms.len() == 1 {
        return vec![agree_one(comms[0], &sigs[0])];
    }
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().zip(sigs).map(|(c, sig)| s.spawn(move || agree_one(c, sig))).collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(CheckFailure::Exchange(Error::Internal("mismatch check thread panicked".into())))))
            .collect()
    })
}
