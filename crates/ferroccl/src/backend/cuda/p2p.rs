//! The plan kernel's point-to-point form (`kernels/p2p.cuh`): which launches it takes, and its
//! parameter.
//!
//! A launch whose encoded plan holds only sends and receives to other ranks, and copies for
//! sends to oneself (sendrecv, batched isend/irecv, pipeline stages, an all-to-all made of sends
//! and receives), can run on a kernel that knows nothing else. It executes the same steps on
//! the same connections, with the same protocols (LL or simple, as the plan says) and the same
//! piece cut as the plan kernel, so the peer at the other end of each connection may run either
//! kernel: whether a launch takes this form is decided by each rank for itself, from its own
//! plan, and changes no message. Everything the kernel needs sits in its parameter (each step
//! with its connection's addresses; a simple step reads its connection's length and head words
//! from the table), so a launch reads no step table. A lane's consecutive steps of one message
//! whose pieces fall where the plan kernel's would (every step but the last a whole number of
//! pieces) run as one step, so that large messages fit the parameter.

use super::tables::{
    Encoded, FcConn, FcOp, FcP2pHead, FcP2pN, FcP2pStep, FcStep, BUF_OUTPUT, CONN_RECV, CONN_SEND,
    FLAG_LL, LL_DATA_BYTES, P2P_COPY, P2P_MAX_STEPS, P2P_SMALL_STEPS, P2P_THREADS, STEP_COPY,
    STEP_RECV, STEP_SEND,
};

/// Where a buffer of a step lies in this call's operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Source {
    op: usize,
    output: bool,
    /// Bytes from the buffer's start.
    offset: u64,
}

impl Source {
    fn at(&self, ops: &[FcOp]) -> u64 {
        let op = &ops[self.op];
        (if self.output { op.recv } else { op.send }) + self.offset
    }
}

/// One step of the form: the kernel's step without this call's buffers, where its `buf` comes
/// from, and a copy's destination (its `base`).
type FormStep = (FcP2pStep, Source, Option<Source>);

/// A launch shape in the point-to-point form: its steps with everything but this call's
/// buffers, and the blocks it runs on (one per plan lane).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct P2pForm {
    /// In block order (the wide kernel finds a block's steps by binary search).
    steps: Vec<FormStep>,
    pub blocks: u32,
    /// Every step is LL or a copy (no simple-protocol slot to move with the block-wide loop).
    ll_only: bool,
}

/// The plan kernel's piece on a connection of `slot_bytes` for elements of `es` bytes, in bytes:
/// LL, `ll_piece_bytes` in fifo.cuh; simple, the slot; either cut to whole elements as
/// `run_lane` cuts it.
fn piece_bytes(slot_bytes: u32, es: u32, ll: bool) -> u32 {
    let b = if ll {
        slot_bytes.min(LL_DATA_BYTES as u32) & !7
    } else {
        slot_bytes
    };
    b.checked_div(es).map_or(0, |k| k * es)
}

/// A send to oneself as the point-to-point kernel copies it, or None for any other copy (one
/// that pre-multiplies or divides: collectives' own blocks).
fn self_copy(s: &FcStep, ops: &[FcOp], block: u16) -> Option<FormStep> {
    if s.flags & !FLAG_LL != 0 {
        return None;
    }
    let (src_op, dst_op) = (ops.get(s.op as usize)?, ops.get(s.dst_op as usize)?);
    let es = src_op.elem_size as u64;
    if dst_op.elem_size as u64 != es {
        return None;
    }
    let bytes = u32::try_from(s.count.checked_mul(es)?).ok()?;
    let src = Source {
        op: s.op as usize,
        output: s.src_buf == BUF_OUTPUT,
        offset: s.src_off.checked_mul(es)?,
    };
    let dst = Source {
        op: s.dst_op as usize,
        output: s.dst_buf == BUF_OUTPUT,
        offset: s.dst_off.checked_mul(es)?,
    };
    let step = FcP2pStep {
        bytes,
        conn: -1,
        peer: u32::MAX,
        block,
        dir: P2P_COPY,
        ..Default::default()
    };
    Some((step, src, Some(dst)))
}

/// Whether `next` continues `prev`'s message on the same connection and can join it: the same
/// buffer right after it, and `prev` a whole number of pieces, so the joined step cuts pieces
/// exactly where the plan kernel cuts the two.
fn joins(prev: &FormStep, next: &FormStep) -> bool {
    let ((a, sa, _), (b, sb, _)) = (prev, next);
    a.dir != P2P_COPY
        && (a.dir, a.conn, a.block, a.ll, a.piece) == (b.dir, b.conn, b.block, b.ll, b.piece)
        && (sa.op, sa.output) == (sb.op, sb.output)
        && sa.offset + a.bytes as u64 == sb.offset
        && a.bytes % a.piece == 0
        && (a.bytes as u64 + b.bytes as u64) <= u32::MAX as u64
}

/// The point-to-point form of `enc`, or None when the launch needs the plan kernel: a step that
/// is not a send, a receive or a plain copy (reductions, forwards, zero-copy posts and direct
/// writes, pre-multiplied sends), more than [`P2P_MAX_STEPS`] steps once joined, a connection
/// used by two lanes, or one the table lacks. `conns` is the communicator's connection table.
/// A launch of copies alone (sends to oneself) stays on the plan kernel: it has no messages to
/// speed up.
pub(crate) fn p2p_form(enc: &Encoded, conns: &[FcConn]) -> Option<P2pForm> {
    if enc.steps.is_empty() || enc.lanes.len() > u16::MAX as usize {
        return None;
    }
    let mut steps: Vec<FormStep> = Vec::new();
    // (connection, lane) of every step so far: a connection's counter has one owner.
    let mut owners: Vec<(i32, usize)> = Vec::new();
    for (li, lane) in enc.lanes.iter().enumerate() {
        let first = lane.first_step as usize;
        for s in enc.steps.get(first..first + lane.nsteps as usize)? {
            let step = if s.kind == STEP_COPY {
                self_copy(s, &enc.ops, li as u16)?
            } else {
                let ll = match s.flags {
                    FLAG_LL => true,
                    0 => false,
                    _ => return None,
                };
                let (conn, dir, buf, off) = match s.kind {
                    STEP_SEND => (s.send_conn, CONN_SEND, s.src_buf, s.src_off),
                    STEP_RECV if s.dst_op == s.op => (s.recv_conn, CONN_RECV, s.dst_buf, s.dst_off),
                    _ => return None,
                };
                let c = conns.get(usize::try_from(conn).ok()?)?;
                let base = if ll { c.ll } else { c.data };
                if c.dir != dir
                    || c.slots == 0
                    || base == 0
                    || (!ll && (c.lens == 0 || c.head == 0))
                {
                    return None;
                }
                match owners.iter().find(|o| o.0 == conn) {
                    Some(&(_, l)) if l != li => return None,
                    Some(_) => {}
                    None => owners.push((conn, li)),
                }
                let es = enc.ops.get(s.op as usize)?.elem_size;
                let piece = piece_bytes(c.slot_bytes, es, ll);
                if piece == 0 {
                    return None;
                }
                let p = FcP2pStep {
                    base,
                    tail: c.tail,
                    counter: c.counter,
                    buf: 0,
                    bytes: u32::try_from(s.count.checked_mul(es as u64)?).ok()?,
                    piece,
                    slots: c.slots,
                    conn,
                    peer: c.peer,
                    block: li as u16,
                    dir: dir as u8,
                    ll: ll as u8,
                };
                (
                    p,
                    Source {
                        op: s.op as usize,
                        output: buf == BUF_OUTPUT,
                        offset: off.checked_mul(es as u64)?,
                    },
                    None,
                )
            };
            match steps.last_mut() {
                Some(prev) if joins(prev, &step) => prev.0.bytes += step.0.bytes,
                _ => steps.push(step),
            }
            if steps.len() > P2P_MAX_STEPS {
                return None;
            }
        }
    }
    if owners.is_empty() {
        return None;
    }
    let ll_only = steps.iter().all(|(p, _, _)| p.dir == P2P_COPY || p.ll == 1);
    Some(P2pForm {
        steps,
        blocks: u32::try_from(enc.lanes.len()).ok()?,
        ll_only,
    })
}

impl P2pForm {
    /// Whether the small kernel takes it: LL steps and copies only (that kernel has no simple
    /// protocol, whose copy loop cost a small launch 0.5 us), few enough for its parameter.
    pub fn small(&self) -> bool {
        self.ll_only && self.steps.len() <= P2P_SMALL_STEPS
    }

    /// Threads per block: [`P2P_THREADS`] where a step moves simple-protocol slots with the
    /// block-wide copy loop; half where every step is LL or a copy, a few lines per thread at
    /// most (more threads only cost a small launch their start and exit).
    pub fn threads(&self) -> u32 {
        if self.ll_only {
            P2P_THREADS / 2
        } else {
            P2P_THREADS
        }
    }

    /// The kernel parameter (of room for `N` steps, at least as many as the form has) for this
    /// call's operations `ops`, on `head`'s table and status words.
    pub fn param<const N: usize>(&self, ops: &[FcOp], head: &FcP2pHead) -> FcP2pN<N> {
        assert!(
            self.steps.len() <= N,
            "a parameter of {N} steps for {} steps",
            self.steps.len()
        );
        let mut p = FcP2pN::<N> {
            conns: head.conns,
            abort: head.abort,
            error: head.error,
            timeout_ns: head.timeout_ns,
            rank: head.rank,
            nsteps: self.steps.len() as u32,
            ..Default::default()
        };
        for (slot, (step, src, dst)) in p.steps.iter_mut().zip(&self.steps) {
            *slot = FcP2pStep {
                buf: src.at(ops),
                ..*step
            };
            if let Some(d) = dst {
                slot.base = d.at(ops);
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::tables::{
        encode, FcLane, FcStep, OpDesc, FLAG_POST, FLAG_PRE, P2P_THREADS, STEP_COPY, STEP_RECV_COPY,
    };
    use ferroccl_core::algo::{build_launch, Algo, CollDesc, LaunchOp, Tuning};
    use ferroccl_core::plan::{ConnKey, Dir, P2P_CHANNEL_BASE};
    use ferroccl_core::{CollKind, DataType, ReduceOp};
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// A connection table of `nranks` ranks with `chans` channels per peer and direction, its
    /// words at recognisable addresses: index = ((peer * chans) + chan) * 2 + dir.
    fn conns(nranks: usize, chans: usize) -> Vec<FcConn> {
        let mut v = Vec::new();
        for peer in 0..nranks {
            for _ in 0..chans {
                for dir in [CONN_SEND, CONN_RECV] {
                    let i = v.len() as u64;
                    v.push(FcConn {
                        data: 0x1_0000_0000 + i * 0x10_0000,
                        lens: 0x2_0000_0000 + i * 64,
                        head: 0x3_0000_0000 + i * 128,
                        tail: 0x4_0000_0000 + i * 128,
                        counter: 0x5_0000_0000 + i * 128,
                        slots: 4,
                        slot_bytes: 128 << 10,
                        peer: peer as u32,
                        dir,
                        ll: 0x6_0000_0000 + i * 0x10_0000,
                        post: 0,
                    });
                }
            }
        }
        v
    }
    fn index(key: ConnKey, chans: usize) -> Option<u32> {
        let ch = key.channel.checked_sub(P2P_CHANNEL_BASE)? as usize;
        (ch < chans).then(|| {
            ((key.peer * chans + ch) * 2 + if key.dir == Dir::Send { 0 } else { 1 }) as u32
        })
    }

    struct Op {
        kind: CollKind,
        peer: usize,
        count: usize,
        dtype: DataType,
    }

    /// `ops` of rank `rank` planned and encoded as the GPU backend does, LL where `ll`.
    fn encoded(rank: usize, nranks: usize, chans: usize, ops: &[Op], ll: bool) -> Encoded {
        encoded_in_chunks(rank, nranks, chans, 1 << 20, ops, ll)
    }

    fn encoded_in_chunks(
        rank: usize,
        nranks: usize,
        chans: usize,
        chunk_elems: usize,
        ops: &[Op],
        ll: bool,
    ) -> Encoded {
        let launch: Vec<LaunchOp> = ops
            .iter()
            .map(|o| LaunchOp {
                desc: CollDesc {
                    kind: o.kind,
                    count: o.count,
                    root: o.peer,
                },
                dtype: o.dtype,
                tuning: Tuning {
                    algo: Algo::Direct,
                    channels: chans,
                    chunk_elems,
                },
            })
            .collect();
        let plan = build_launch(rank, nranks, &launch).unwrap();
        let descs: Vec<OpDesc> = ops
            .iter()
            .enumerate()
            .map(|(i, o)| OpDesc {
                send: 0x7_0000_0000 + (i as u64) * 0x100_0000,
                recv: 0x8_0000_0000 + (i as u64) * 0x100_0000,
                send_count: if o.kind == CollKind::Send { o.count } else { 0 },
                recv_count: if o.kind == CollKind::Recv { o.count } else { 0 },
                dtype: o.dtype,
                op: ReduceOp::Sum,
                scalar_dev: 0,
                ll,
                zero_copy: false,
                post_output: false,
            })
            .collect();
        encode(&plan, &descs, |k| index(k, chans), None).unwrap()
    }

    #[test]
    fn a_sendrecv_group_takes_the_form_with_every_message_where_the_plan_puts_it() {
        let (n, chans) = (2, 4);
        let t = conns(n, chans);
        let ops = [
            Op {
                kind: CollKind::Send,
                peer: 1,
                count: 1000,
                dtype: DataType::Float64,
            },
            Op {
                kind: CollKind::Recv,
                peer: 1,
                count: 1000,
                dtype: DataType::Float64,
            },
        ];
        let enc = encoded(0, n, chans, &ops, true);
        let form = p2p_form(&enc, &t).expect("LL sends and receives take the form");
        assert_eq!(form.blocks as usize, enc.lanes.len());
        // In block order, for the kernel's binary search; LL alone: half the threads.
        assert!(form.steps.windows(2).all(|w| w[0].0.block <= w[1].0.block));
        assert_eq!(form.threads(), P2P_THREADS / 2);
        assert_eq!(form.steps.len(), enc.steps.len());
        // Every plan step appears once, on its lane's block, with its connection's words.
        for (li, lane) in enc.lanes.iter().enumerate() {
            for s in &enc.steps[lane.first_step as usize..(lane.first_step + lane.nsteps) as usize]
            {
                let conn = if s.kind == STEP_SEND {
                    s.send_conn
                } else {
                    s.recv_conn
                };
                let (p, src, _) = form
                    .steps
                    .iter()
                    .find(|(p, _, _)| p.conn == conn && p.block == li as u16)
                    .expect("step kept");
                let c = &t[conn as usize];
                assert_eq!(
                    (p.base, p.tail, p.counter, p.slots, p.peer, p.ll),
                    (c.ll, c.tail, c.counter, c.slots, c.peer, 1)
                );
                assert_eq!(p.bytes as u64, s.count * 8);
                // 8 KiB LL pieces of whole float64 elements.
                assert_eq!(p.piece, 8192);
                let off = if s.kind == STEP_SEND {
                    s.src_off
                } else {
                    s.dst_off
                };
                assert_eq!((src.op, src.offset), (s.op as usize, off * 8));
                assert_eq!(src.output, s.kind == STEP_RECV);
            }
        }
        // The whole message is covered, each byte once, per direction.
        let mut sent: Vec<(u64, u64)> = form
            .steps
            .iter()
            .filter(|(p, _, _)| p.dir == CONN_SEND as u8)
            .map(|(p, s, _)| (s.offset, p.bytes as u64))
            .collect();
        sent.sort();
        assert_eq!(sent.iter().map(|x| x.1).sum::<u64>(), 8000);
        assert!(sent.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));

        // This call's buffers land in the parameter; nothing else changes between calls.
        let fc_ops = [
            FcOp {
                send: 0xa000,
                recv: 0xb000,
                elem_size: 8,
                ..Default::default()
            },
            FcOp {
                send: 0xc000,
                recv: 0xd000,
                elem_size: 8,
                ..Default::default()
            },
        ];
        let base = FcP2pHead {
            abort: 1,
            error: 2,
            timeout_ns: 3,
            rank: 0,
            ..Default::default()
        };
        let p = form.param::<P2P_MAX_STEPS>(&fc_ops, &base);
        assert!(form.small());
        assert_eq!(
            form.param::<P2P_SMALL_STEPS>(&fc_ops, &base).steps[..form.steps.len()],
            p.steps[..form.steps.len()]
        );
        assert_eq!(
            (p.abort, p.error, p.timeout_ns, p.nsteps as usize),
            (1, 2, 3, form.steps.len())
        );
        for (k, (step, src, dst)) in form.steps.iter().enumerate() {
            let want = if src.op == 0 { 0xa000 } else { 0xd000 } + src.offset;
            assert_eq!(*dst, None);
            assert_eq!(p.steps[k], FcP2pStep { buf: want, ..*step });
        }
        assert!(p.steps[form.steps.len()..]
            .iter()
            .all(|s| *s == FcP2pStep::default()));
    }

    #[test]
    fn pieces_are_the_plan_kernels_whole_elements() {
        assert_eq!(piece_bytes(128 << 10, 4, true), 8192);
        assert_eq!(piece_bytes(128 << 10, 8, true), 8192);
        // A slot smaller than the LL data, for 8-byte lines and then whole elements.
        assert_eq!(piece_bytes(100, 1, true), 96);
        assert_eq!(piece_bytes(100, 8, true), 96);
        assert_eq!(piece_bytes(4096 + 64, 8, true), 4160);
        assert_eq!(piece_bytes(4, 8, true), 0);
        // Simple: the whole slot, in whole elements.
        assert_eq!(piece_bytes(128 << 10, 8, false), 128 << 10);
        assert_eq!(piece_bytes(1000, 8, false), 1000);
        assert_eq!(piece_bytes(1000, 16, false), 992);
    }

    #[test]
    fn launches_with_anything_but_ll_sends_and_receives_stay_on_the_plan_kernel() {
        let (n, chans) = (3, 2);
        let t = conns(n, chans);
        let p2p = |kind, peer| Op {
            kind,
            peer,
            count: 64,
            dtype: DataType::Int32,
        };
        // The simple protocol too, on the data slots with their length and head words.
        let simple = p2p_form(&encoded(0, n, chans, &[p2p(CollKind::Send, 1)], false), &t)
            .expect("simple sends");
        assert!(simple
            .steps
            .iter()
            .all(|(p, _, _)| p.ll == 0 && p.base == t[p.conn as usize].data));
        assert_eq!(
            simple.threads(),
            P2P_THREADS,
            "the block-wide copy loop's threads"
        );
        assert!(!simple.small(), "the small kernel has no simple protocol");
        // Sends to oneself alone are copies, with no message to speed up.
        assert!(p2p_form(
            &encoded(
                0,
                n,
                chans,
                &[p2p(CollKind::Send, 0), p2p(CollKind::Recv, 0)],
                true
            ),
            &t
        )
        .is_none());
        // Several peers at once: fine.
        let ok = encoded(
            0,
            n,
            chans,
            &[
                p2p(CollKind::Send, 1),
                p2p(CollKind::Recv, 2),
                p2p(CollKind::Send, 2),
            ],
            true,
        );
        assert!(p2p_form(&ok, &t).is_some());

        // Hand-made tables for what the builder would not make.
        let base = p2p_form(&ok, &t).unwrap();
        let with = |f: &dyn Fn(&mut Encoded)| {
            let mut e = ok.clone();
            f(&mut e);
            p2p_form(&e, &t)
        };
        assert!(
            with(&|e| e.steps[0].flags |= FLAG_PRE).is_none(),
            "a pre-multiplied send"
        );
        assert!(
            with(&|e| {
                e.steps[0].kind = STEP_COPY;
                e.steps[0].flags |= FLAG_POST;
            })
            .is_none(),
            "a copy that divides (an average's own block)"
        );
        assert!(with(&|e| e.steps[0].kind = STEP_RECV_COPY).is_none());
        assert!(
            with(&|e| e.steps[0].send_conn = t.len() as i32).is_none(),
            "a connection the table lacks"
        );
        assert!(with(&|e| e.steps[0].send_conn = -1).is_none());
        // The send connection named as if it received.
        let recv_conn = ok
            .steps
            .iter()
            .find(|s| s.kind == STEP_RECV)
            .unwrap()
            .recv_conn;
        assert!(
            with(&|e| e.steps[0].send_conn = recv_conn).is_none(),
            "a receive connection used to send"
        );
        // A connection on two lanes: two blocks would own its counter.
        assert!(with(&|e| {
            let s: FcStep = e.steps[0];
            e.steps.push(s);
            e.lanes.push(FcLane {
                first_step: e.steps.len() as u32 - 1,
                nsteps: 1,
            });
        })
        .is_none());
        // Too many steps for the parameter.
        assert!(with(&|e| {
            let s = e.steps[0];
            let l = e.lanes[0];
            e.steps.splice(
                l.first_step as usize..l.first_step as usize,
                std::iter::repeat_n(s, P2P_MAX_STEPS),
            );
            for x in e.lanes.iter_mut() {
                if x.first_step > l.first_step {
                    x.first_step += P2P_MAX_STEPS as u32;
                }
            }
            e.lanes[0].nsteps += P2P_MAX_STEPS as u32;
        })
        .is_none());
        assert_eq!(base.blocks as usize, ok.lanes.len());
    }

    #[test]
    fn an_all_to_all_of_sends_and_receives_copies_its_own_block_into_the_matching_receive() {
        let (n, chans) = (3, 2);
        let t = conns(n, chans);
        // Rank 1: a send to and a receive from every rank, itself included (as PyTorch and
        // nccl-tests issue an all-to-all), each 40 int32.
        let mut ops = Vec::new();
        for q in 0..n {
            ops.push(Op {
                kind: CollKind::Send,
                peer: q,
                count: 40,
                dtype: DataType::Int32,
            });
            ops.push(Op {
                kind: CollKind::Recv,
                peer: q,
                count: 40,
                dtype: DataType::Int32,
            });
        }
        let enc = encoded(1, n, chans, &ops, true);
        let form = p2p_form(&enc, &t).expect("sends, receives and the copy to oneself");
        let copies: Vec<_> = form
            .steps
            .iter()
            .filter(|(p, _, _)| p.dir == P2P_COPY)
            .collect();
        assert_eq!(copies.len(), 1);
        let (c, src, dst) = copies[0];
        // From the send to rank 1 (op 2) into the receive from rank 1 (op 3), all 160 bytes.
        assert_eq!((src.op, src.output, src.offset), (2, false, 0));
        assert_eq!(dst.map(|d| (d.op, d.output, d.offset)), Some((3, true, 0)));
        assert_eq!((c.bytes, c.conn, c.base, c.counter), (160, -1, 0, 0));
        let fc_ops: Vec<FcOp> = (0..ops.len() as u64)
            .map(|i| FcOp {
                send: 0x1000 * (i + 1),
                recv: 0x10_0000 * (i + 1),
                elem_size: 4,
                ..Default::default()
            })
            .collect();
        let p = form.param::<P2P_MAX_STEPS>(&fc_ops, &FcP2pHead::default());
        let k = form
            .steps
            .iter()
            .position(|(p, _, _)| p.dir == P2P_COPY)
            .unwrap();
        assert_eq!((p.steps[k].buf, p.steps[k].base), (0x3000, 0x40_0000));
        // Every other step is a message to or from another rank.
        assert_eq!(
            form.steps
                .iter()
                .filter(|(p, _, _)| p.dir != P2P_COPY && p.peer != 1)
                .count(),
            form.steps.len() - 1
        );

        // A copy that multiplies is a collective's, not a send's: not this form.
        let mut e = enc.clone();
        let i = e.steps.iter().position(|s| s.kind == STEP_COPY).unwrap();
        e.steps[i].flags |= FLAG_PRE;
        assert!(p2p_form(&e, &t).is_none());
    }

    #[test]
    fn a_large_message_runs_as_one_step_per_lane_where_its_pieces_fall_alike() {
        let (n, chans) = (2, 4);
        let t = conns(n, chans);
        // 4 lanes, each 1 MiB of int64 in chunks of 256 KiB: four plan steps a lane, each two
        // 128 KiB slots: joined into one step a lane.
        let count = 4 * (1 << 20) / 8;
        let ops = [
            Op {
                kind: CollKind::Send,
                peer: 1,
                count,
                dtype: DataType::Int64,
            },
            Op {
                kind: CollKind::Recv,
                peer: 1,
                count,
                dtype: DataType::Int64,
            },
        ];
        let enc = encoded_in_chunks(0, n, chans, (256 << 10) / 8, &ops, false);
        assert_eq!(enc.steps.len(), 2 * chans * 4);
        let form = p2p_form(&enc, &t).expect("joined, it fits");
        assert_eq!(form.steps.len(), 2 * chans);
        for (p, src, _) in &form.steps {
            assert_eq!((p.bytes, p.piece), (1 << 20, 128 << 10));
            assert_eq!(src.offset % (1 << 20), 0);
        }
        // Chunks that end inside a slot (96 KiB chunks against 128 KiB slots) cut pieces the
        // joined step would not: kept apart, and then too many.
        let enc = encoded_in_chunks(0, n, chans, (96 << 10) / 8, &ops, false);
        assert!(enc.steps.len() > P2P_MAX_STEPS);
        assert!(p2p_form(&enc, &t).is_none());
        let small = [
            Op {
                kind: CollKind::Send,
                peer: 1,
                count: 3 * (96 << 10) / 8,
                dtype: DataType::Int64,
            },
            Op {
                kind: CollKind::Recv,
                peer: 1,
                count: 3 * (96 << 10) / 8,
                dtype: DataType::Int64,
            },
        ];
        let enc = encoded_in_chunks(0, n, 1, (96 << 10) / 8, &small, false);
        let form = p2p_form(&enc, &t).unwrap();
        assert_eq!(
            (enc.steps.len(), form.steps.len()),
            (6, 6),
            "96 KiB steps of 128 KiB slots stay apart"
        );
        // Two messages on one connection are never joined, even back to back in one buffer.
        let a = || Op {
            kind: CollKind::Send,
            peer: 1,
            count: 16 << 10,
            dtype: DataType::Int64,
        };
        let enc = encoded_in_chunks(0, n, 1, 1 << 20, &[a(), a()], false);
        let form = p2p_form(&enc, &t).unwrap();
        assert_eq!(form.steps.len(), 2);
    }

    /// Every message as the plan kernel cuts it: (block, connection, direction, op, output,
    /// byte offset, bytes) per piece, and copies whole, in lane and step order.
    type Piece = (u16, i32, u8, usize, bool, u64, u64);

    fn plan_pieces(enc: &Encoded, t: &[FcConn]) -> Vec<Piece> {
        let mut v = Vec::new();
        for (li, lane) in enc.lanes.iter().enumerate() {
            for s in &enc.steps[lane.first_step as usize..(lane.first_step + lane.nsteps) as usize]
            {
                let es = enc.ops[s.op as usize].elem_size as u64;
                if s.kind == STEP_COPY {
                    v.push((
                        li as u16,
                        -1,
                        P2P_COPY,
                        s.op as usize,
                        s.src_buf == BUF_OUTPUT,
                        s.src_off * es,
                        s.count * es,
                    ));
                    v.push((
                        li as u16,
                        -1,
                        P2P_COPY,
                        s.dst_op as usize,
                        s.dst_buf == BUF_OUTPUT,
                        s.dst_off * es,
                        s.count * es,
                    ));
                    continue;
                }
                let (conn, dir, buf, off) = if s.kind == STEP_SEND {
                    (s.send_conn, CONN_SEND, s.src_buf, s.src_off)
                } else {
                    (s.recv_conn, CONN_RECV, s.dst_buf, s.dst_off)
                };
                let c = &t[conn as usize];
                // run_lane's cut: whole elements of the LL or simple piece.
                let ll = s.flags & FLAG_LL != 0;
                let piece = (if ll {
                    (c.slot_bytes.min(LL_DATA_BYTES as u32) & !7) as u64
                } else {
                    c.slot_bytes as u64
                }) / es;
                let mut done = 0;
                while done < s.count {
                    let n = piece.min(s.count - done);
                    v.push((
                        li as u16,
                        conn,
                        dir as u8,
                        s.op as usize,
                        buf == BUF_OUTPUT,
                        (off + done) * es,
                        n * es,
                    ));
                    done += n;
                }
            }
        }
        v
    }

    fn form_pieces(form: &P2pForm) -> Vec<Piece> {
        let mut v = Vec::new();
        for (p, src, dst) in &form.steps {
            if p.dir == P2P_COPY {
                let d = dst.expect("a copy has a destination");
                v.push((
                    p.block,
                    -1,
                    P2P_COPY,
                    src.op,
                    src.output,
                    src.offset,
                    p.bytes as u64,
                ));
                v.push((
                    p.block,
                    -1,
                    P2P_COPY,
                    d.op,
                    d.output,
                    d.offset,
                    p.bytes as u64,
                ));
                continue;
            }
            assert!(dst.is_none());
            let mut off = 0u64;
            while off < p.bytes as u64 {
                let nb = (p.piece as u64).min(p.bytes as u64 - off);
                v.push((
                    p.block,
                    p.conn,
                    p.dir,
                    src.op,
                    src.output,
                    src.offset + off,
                    nb,
                ));
                off += nb;
            }
        }
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// Whatever the group (peers, sizes, types, protocols, channels, chunks, sends to
        /// oneself), where the form takes a launch it moves exactly the plan kernel's pieces on
        /// the same connections in the same order, each connection's on one block, the blocks'
        /// steps in block order: so the peer's kernel, either one, sees the same messages.
        #[test]
        fn the_form_moves_the_plan_kernels_pieces(
            n in 2usize..5,
            chans in 1usize..4,
            chunk_kib in prop::sample::select(vec![2usize, 3, 8, 64, 256]),
            slot in prop::sample::select(vec![1024u32, 4096, 128 << 10]),
            ops in prop::collection::vec((1usize..4, any::<bool>(), 0usize..40_000, 0usize..4, any::<bool>()), 1..7),
            selfs in prop::collection::vec((0usize..5_000, 0usize..4), 0..2),
        ) {
            let mut t = conns(n, chans);
            for c in t.iter_mut() {
                c.slot_bytes = slot;
            }
            let types = [DataType::Int64, DataType::Float16, DataType::Uint8, DataType::Float32];
            let (mut launch, mut descs) = (Vec::new(), Vec::new());
            let mut push = |kind, peer: usize, count: usize, dtype: DataType, ll: bool| {
                let es = dtype.size();
                launch.push(LaunchOp {
                    desc: CollDesc { kind, count, root: peer },
                    dtype,
                    tuning: Tuning { algo: Algo::Direct, channels: chans, chunk_elems: (chunk_kib << 10) / es },
                });
                let i = descs.len() as u64;
                descs.push(OpDesc {
                    send: 0x7_0000_0000 + i * 0x100_0000,
                    recv: 0x8_0000_0000 + i * 0x100_0000,
                    send_count: if kind == CollKind::Send { count } else { 0 },
                    recv_count: if kind == CollKind::Recv { count } else { 0 },
                    dtype,
                    op: ReduceOp::Sum,
                    scalar_dev: 0,
                    ll,
                    zero_copy: false,
                    post_output: false,
                });
            };
            // Rank 0's messages to and from other ranks; sends to itself come in pairs below.
            for &(peer, send, count, ty, ll) in ops.iter().filter(|o| o.0 % n != 0) {
                push(if send { CollKind::Send } else { CollKind::Recv }, peer % n, count, types[ty], ll);
            }
            for &(count, ty) in &selfs {
                push(CollKind::Send, 0, count, types[ty], true);
                push(CollKind::Recv, 0, count, types[ty], true);
            }
            prop_assume!(!launch.is_empty());
            let plan = build_launch(0, n, &launch).unwrap();
            let enc = encode(&plan, &descs, |k| index(k, chans), None).unwrap();
            if let Some(form) = p2p_form(&enc, &t) {
                prop_assert_eq!(form_pieces(&form), plan_pieces(&enc, &t));
                prop_assert!(form.steps.windows(2).all(|w| w[0].0.block <= w[1].0.block));
                prop_assert!(form.steps.len() <= P2P_MAX_STEPS);
                let mut owner: HashMap<i32, u16> = HashMap::new();
                for (p, _, _) in &form.steps {
                    if p.dir != P2P_COPY {
                        prop_assert_eq!(*owner.entry(p.conn).or_insert(p.block), p.block);
                    }
                }
                prop_assert_eq!(form.small(), form.steps.len() <= P2P_SMALL_STEPS && form.steps.iter().all(|(p, _, _)| p.dir == P2P_COPY || p.ll == 1));
            } else {
                // Only when it cannot hold the launch: too many steps, or copies alone.
                let messages = enc.steps.iter().filter(|s| s.kind != STEP_COPY).count();
                prop_assert!(messages == 0 || enc.steps.len() > P2P_MAX_STEPS, "refused {} steps", enc.steps.len());
            }
        }
    }
}
