//! Check mode (`Config::check_mismatch`): before a launch moves anything, every rank
//! all-gathers its launch signature over the bootstrap ring and compares them all
//! (`ferroccl_core::opsig`). Every rank sees the same bytes, so all of them run the launch or
//! all of them fail it with the same message, and no user buffer has been touched.
//!
//! Only launches with at least one collective are checked: a launch of sends and receives
//! involves only some ranks, and the others would never join the all-gather. Its sends and
//! receives are checked along with the collectives of the launch.

use crate::bootstrap::Bootstrap;
use crate::ops::OpArgs;
use ferroccl_core::opsig::{compare, encode_launch, OpSig};
use ferroccl_core::{CollKind, Error};

/// Why the ranks did not agree to run a launch.
pub(crate) enum Disagreement {
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
    let ops: Vec<OpSig> = args
        .iter()
        .map(|a| OpSig::new(a.kind, a.dtype, a.count, a.op, a.root))
        .collect();
    encode_launch(seq, &ops)
}

fn agree_one(boot: &Bootstrap, sig: &[u8]) -> Result<(), Disagreement> {
    let all = boot.allgather(sig).map_err(Disagreement::Exchange)?;
    compare(&all).map_err(Disagreement::Mismatch)
}

/// Runs the comparison for each communicator (its bootstrap) with its signature. Several communicators in one
/// launch are usually ranks of one job driven by one thread: their all-gathers must run at
/// the same time or they would wait on each other, hence a thread each.
pub(crate) fn agree(boots: &[&Bootstrap], sigs: &[Vec<u8>]) -> Vec<Result<(), Disagreement>> {
    if boots.len() == 1 {
        return vec![agree_one(boots[0], &sigs[0])];
    }
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .iter()
            .zip(sigs)
            .map(|(b, sig)| s.spawn(move || agree_one(b, sig)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Disagreement::Exchange(Error::Internal(
                        "mismatch check thread panicked".into(),
                    )))
                })
            })
            .collect()
    })
}
