//! The posted-receive rendezvous: before a launch's large sends and receives on GPUs
//! (`tune::p2p_rendezvous_wanted`), each receiver posts to its sender where its output lies
//! (`plan::copies::RecvPost`), and where it lies in a symmetric window, or is mapped for the
//! sender on the fly (`backend/cuda/lazy.rs`), the sender's copy engines copy straight into it
//! (`plan::lanes::p2p_schedule`); the rest run on the kernels.
//!
//! Postings travel on a stream per ordered pair of ranks of the communicator, opened at first
//! use through the bootstrap's listener (the receiver connects, the sender accepts) and kept in
//! the communicator's state. A pair's receives post in their order and its sends read in theirs:
//! NCCL matches a pair's sends and receives in order, whatever the grouping. Every launch first
//! posts all of its receives, on every communicator of the launch, and only then reads for its
//! sends, so a receiver never waits and a sender waits only for its receiver's call: two ranks
//! that each group a send with the matching receive, or one of them in two launches, go through;
//! sends both ways in separate launches ahead of their receives wait on each other, as NCCL's
//! kernels would (bounded here by the bootstrap's deadline).

use crate::backend::cuda::P2pCopy;
use crate::backend::Backend;
use crate::comm::Comm;
use crate::info::CommState;
use crate::ops::{launch_label, OpArgs};
use ferroccl_core::plan::copies::RecvPost;
use ferroccl_core::{CollKind, Error, Rank};
use std::sync::MutexGuard;

/// Names the postings' streams among the communicator's bootstrap connections.
const POST_TAG: u64 = 0xfecc_0000_5053_5452;

/// What a communicator's rendezvous found for its share of a launch, one entry per operation:
/// the copy engines' part (`Some`), the kernels' (`None`).
pub(crate) type Ways = Vec<Option<P2pCopy>>;

/// Whether any operation of `args` on `c` takes the rendezvous (nothing allocated to find out).
fn wanted(c: &Comm, args: &[OpArgs]) -> Result<bool, Error> {
    let Backend::Cuda(cuda) = &c.backend else {
        return Ok(false);
    };
    for a in args {
        if cuda.p2p_posts(a, &c.info)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The rendezvous of every communicator of a launch: for each, its ways (None: nothing took
/// part), or its error (it is then marked failed: its peers may wait on a posting or a copy).
pub(crate) fn exchange(
    comms: &[(&Comm, &[OpArgs])],
    states: &mut [MutexGuard<CommState>],
) -> Option<Vec<Result<Option<Ways>, Error>>> {
    // Most launches have nothing to post: found out without allocating (the common call's
    // launch allocates nothing, docs/PERFORMANCE.md section 5).
    if !comms
        .iter()
        .any(|(c, args)| wanted(c, args).unwrap_or(true))
    {
        return None;
    }
    let mut out: Vec<Result<Option<Ways>, Error>> = comms
        .iter()
        .map(|(c, args)| wanted(c, args).map(|_| None))
        .collect();
    // Receives first, on every communicator, then sends.
    for ((c, args), (st, r)) in comms.iter().zip(states.iter_mut().zip(out.iter_mut())) {
        if r.is_ok() {
            *r = post(c, st, args).map(Some);
        }
    }
    for ((c, args), (st, r)) in comms.iter().zip(states.iter_mut().zip(out.iter_mut())) {
        if let Ok(Some(ways)) = r {
            if let Err(e) = read(c, st, args, ways) {
                *r = Err(e);
            }
        }
    }
    for ((c, args), (st, r)) in comms.iter().zip(states.iter_mut().zip(out.iter_mut())) {
        if let Err(e) = r {
            let e = e.clone().context(launch_label(args, st.seq + 1, &c.info));
            st.failed.get_or_insert_with(|| e.clone());
            *r = Err(e);
        }
    }
    Some(out)
}

/// The postings' stream with `peer`, opened at first use: this rank connects where it posts
/// (`posting`), and takes the peer's connection from the bootstrap's listener where it reads.
fn stream<'a>(
    c: &Comm,
    st: &'a mut CommState,
    peer: Rank,
    posting: bool,
) -> Result<&'a mut std::net::TcpStream, Error> {
    Ok(match st.posts.entry((peer, posting)) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(if posting {
            c.boot.connect(peer, POST_TAG)?
        } else {
            c.boot.accept(peer, POST_TAG)?
        }),
    })
}

/// Posts this rank's receives that take part, in order; their ways.
fn post(c: &Comm, st: &mut CommState, args: &[OpArgs]) -> Result<Ways, Error> {
    let Backend::Cuda(cuda) = &c.backend else {
        unreachable!("run_locked posts for GPU communicators only")
    };
    let mut ways: Ways = vec![None; args.len()];
    for (a, way) in args.iter().zip(ways.iter_mut()) {
        if a.kind != CollKind::Recv || !cuda.p2p_posts(a, &c.info)? {
            continue;
        }
        let peer = a.root;
        let post = cuda.recv_post(a, &c.info, &c.abort)?;
        let s = stream(c, st, peer, true)?;
        c.boot
            .send_msg(s, peer, &post.encode())
            .map_err(|e| e.context(format!("posting a receive to rank {peer}")))?;
        if post.by_copies() {
            *way = Some(P2pCopy::Recv { peer });
        }
    }
    Ok(ways)
}

/// Reads the postings for this rank's sends that take part, in order, into their ways.
fn read(c: &Comm, st: &mut CommState, args: &[OpArgs], ways: &mut Ways) -> Result<(), Error> {
    let Backend::Cuda(cuda) = &c.backend else {
        unreachable!("run_locked posts for GPU communicators only")
    };
    for (a, way) in args.iter().zip(ways.iter_mut()) {
        if a.kind != CollKind::Send || !cuda.p2p_posts(a, &c.info)? {
            continue;
        }
        let peer = a.root;
        let s = stream(c, st, peer, false)?;
        let msg = c
            .boot
            .recv_msg(s, peer, RecvPost::LEN)
            .map_err(|e| e.context(format!("reading rank {peer}'s posted receive")))?;
        let post = RecvPost::decode(&msg)
            .map_err(|m| Error::Protocol(format!("rank {peer}'s posted receive: {m}")))?;
        let bytes = (a.count * a.dtype.size()) as u64;
        let target = post
            .send_way(bytes)
            .map_err(|m| Error::InvalidArgument(format!("a send to rank {peer}: {m}")))?;
        if let Some(p) = target {
            *way = Some(P2pCopy::Send {
                peer,
                src: a.send as u64,
                far: cuda.posted_far(p, peer, c.info.rank)?,
                bytes: bytes as usize,
            });
        }
    }
    Ok(())
}
