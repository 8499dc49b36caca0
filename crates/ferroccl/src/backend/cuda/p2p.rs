//! The plan kernel's point-to-point form (`kernels/p2p.cuh`): which launches it takes, and its
//! parameter.
//!
//! A launch whose encoded plan holds only LL sends and receives to other ranks (small send/recv
//! groups: sendrecv, batched isend/irecv, pipeline stages) can run on a kernel that knows
//! nothing else. It executes the same steps on the same connections, with the same LL protocol
//! and the same piece cut as the plan kernel, so the peer at the other end of each connection
//! may run either kernel: whether a launch takes this form is decided by each rank for itself,
//! from its own plan, and changes no message. Everything the kernel needs sits in its
//! parameter (each step with its connection's addresses), so a launch reads no table.

use super::tables::{
    Encoded, FcConn, FcOp, FcP2p, FcP2pStep, FcStep, BUF_OUTPUT, CONN_RECV, CONN_SEND, FLAG_LL, LL_DATA_BYTES, P2P_COPY, P2P_MAX_STEPS, STEP_COPY,
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

/// A launch shape in the point-to-point form: its steps with everything but this call's
/// buffers (where `buf`, and a copy's `dst`, come from), and the blocks it runs on (one per
/// plan lane).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct P2pForm {
    steps: Vec<(FcP2pStep, Source, Option<Source>)>,
    pub blocks: u32,
}

/// The plan kernel's LL piece on a connection of `slot_bytes` for elements of `es` bytes, in
/// bytes (`ll_piece_bytes` in fifo.cuh, cut to whole elements as `run_lane` cuts it).
fn piece_bytes(slot_bytes: u32, es: u32) -> u32 {
    let ll = slot_bytes.min(LL_DATA_BYTES as u32) & !7;
    ll.checked_div(es).map_or(0, |k| k * es)
}

/// A send to oneself as the point-to-point kernel copies it, or None for any other copy (one
/// that pre-multiplies or divides: collectives' own blocks).
fn self_copy(s: &FcStep, ops: &[FcOp], block: u32) -> Option<(FcP2pStep, Source, Option<Source>)> {
    if s.flags & !FLAG_LL != 0 {
        return None;
    }
    let (src_op, dst_op) = (ops.get(s.op as usize)?, ops.get(s.dst_op as usize)?);
    let es = src_op.elem_size as u64;
    if dst_op.elem_size as u64 != es {
        return None;
    }
    let bytes = u32::try_from(s.count.checked_mul(es)?).ok()?;
    let src = Source { op: s.op as usize, output: s.src_buf == BUF_OUTPUT, offset: s.src_off.checked_mul(es)? };
    let dst = Source { op: s.dst_op as usize, output: s.dst_buf == BUF_OUTPUT, offset: s.dst_off.checked_mul(es)? };
    let step = FcP2pStep { bytes, conn: -1, peer: u32::MAX, block, dir: P2P_COPY, ..Default::default() };
    Some((step, src, Some(dst)))
}

/// The point-to-point form of `enc`, or None when the launch needs the plan kernel: a step that
/// is not an LL send or receive or a plain copy (reductions, forwards, zero-copy marks,
/// pre-multiplied sends), more than [`P2P_MAX_STEPS`] steps, a connection used by two lanes,
/// or one the table lacks. `conns` is the communicator's connection table. A launch of copies
/// alone (sends to oneself) stays on the plan kernel: it has no messages to speed up.
pub(crate) fn p2p_form(enc: &Encoded, conns: &[FcConn]) -> Option<P2pForm> {
    if enc.steps.is_empty() || enc.steps.len() > P2P_MAX_STEPS {
        return None;
    }
    let mut steps = Vec::with_capacity(enc.steps.len());
    // (connection, lane) of every step so far: a connection's counter has one owner.
    let mut owners: Vec<(i32, usize)> = Vec::new();
    for (li, lane) in enc.lanes.iter().enumerate() {
        let first = lane.first_step as usize;
        for s in enc.steps.get(first..first + lane.nsteps as usize)? {
            if s.kind == STEP_COPY {
                steps.push(self_copy(s, &enc.ops, li as u32)?);
                continue;
            }
            if s.flags != FLAG_LL {
                return None;
            }
            let (conn, dir, buf, off) = match s.kind {
                STEP_SEND => (s.send_conn, CONN_SEND, s.src_buf, s.src_off),
                STEP_RECV if s.dst_op == s.op => (s.recv_conn, CONN_RECV, s.dst_buf, s.dst_off),
                _ => return None,
            };
            let c = conns.get(usize::try_from(conn).ok()?)?;
            if c.dir != dir || c.slots == 0 || c.ll == 0 {
                return None;
            }
            match owners.iter().find(|o| o.0 == conn) {
                Some(&(_, l)) if l != li => return None,
                Some(_) => {}
                None => owners.push((conn, li)),
            }
            let op = enc.ops.get(s.op as usize)?;
            let es = op.elem_size;
            let piece = piece_bytes(c.slot_bytes, es);
            let bytes = u32::try_from(s.count.checked_mul(es as u64)?).ok()?;
            if piece == 0 {
                return None;
            }
            let step = FcP2pStep {
                ll: c.ll,
                tail: c.tail,
                counter: c.counter,
                buf: 0,
                dst: 0,
                bytes,
                piece,
                slots: c.slots,
                conn,
                peer: c.peer,
                block: li as u32,
                dir,
                reserved: 0,
            };
            steps.push((step, Source { op: s.op as usize, output: buf == BUF_OUTPUT, offset: off.checked_mul(es as u64)? }, None));
        }
    }
    if owners.is_empty() {
        return None;
    }
    Some(P2pForm { steps, blocks: u32::try_from(enc.lanes.len()).ok()? })
}

impl P2pForm {
    /// The kernel parameter for this call's operations `ops`, on `base`'s status words.
    pub fn param(&self, ops: &[FcOp], base: &FcP2p) -> FcP2p {
        let mut p = FcP2p { nsteps: self.steps.len() as u32, ..*base };
        for (slot, (step, src, dst)) in p.steps.iter_mut().zip(&self.steps) {
            *slot = FcP2pStep { buf: src.at(ops), dst: dst.map_or(0, |d| d.at(ops)), ..*step };
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::tables::{encode, FcLane, FcStep, OpDesc, FLAG_POST, FLAG_PRE, STEP_COPY, STEP_RECV_COPY};
    use ferroccl_core::algo::{build_launch, Algo, CollDesc, LaunchOp, Tuning};
    use ferroccl_core::plan::{ConnKey, Dir, P2P_CHANNEL_BASE};
    use ferroccl_core::{CollKind, DataType, ReduceOp};

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
        (ch < chans).then(|| ((key.peer * chans + ch) * 2 + if key.dir == Dir::Send { 0 } else { 1 }) as u32)
    }

    struct Op {
        kind: CollKind,
        peer: usize,
        count: usize,
        dtype: DataType,
    }

    /// `ops` of rank `rank` planned and encoded as the GPU backend does, LL where `ll`.
    fn encoded(rank: usize, nranks: usize, chans: usize, ops: &[Op], ll: bool) -> Encoded {
        let launch: Vec<LaunchOp> = ops
            .iter()
            .map(|o| LaunchOp {
                desc: CollDesc { kind: o.kind, count: o.count, root: o.peer },
                dtype: o.dtype,
                tuning: Tuning { algo: Algo::Direct, channels: chans, chunk_elems: 1 << 20 },
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
            Op { kind: CollKind::Send, peer: 1, count: 1000, dtype: DataType::Float64 },
            Op { kind: CollKind::Recv, peer: 1, count: 1000, dtype: DataType::Float64 },
        ];
        let enc = encoded(0, n, chans, &ops, true);
        let form = p2p_form(&enc, &t).expect("LL sends and receives take the form");
        assert_eq!(form.blocks as usize, enc.lanes.len());
        assert_eq!(form.steps.len(), enc.steps.len());
        // Every plan step appears once, on its lane's block, with its connection's words.
        for (li, lane) in enc.lanes.iter().enumerate() {
            for s in &enc.steps[lane.first_step as usize..(lane.first_step + lane.nsteps) as usize] {
                let conn = if s.kind == STEP_SEND { s.send_conn } else { s.recv_conn };
                let (p, src, _) = form.steps.iter().find(|(p, _, _)| p.conn == conn && p.block == li as u32).expect("step kept");
                let c = &t[conn as usize];
                assert_eq!((p.ll, p.tail, p.counter, p.slots, p.peer), (c.ll, c.tail, c.counter, c.slots, c.peer));
                assert_eq!(p.bytes as u64, s.count * 8);
                // 8 KiB LL pieces of whole float64 elements.
                assert_eq!(p.piece, 8192);
                let off = if s.kind == STEP_SEND { s.src_off } else { s.dst_off };
                assert_eq!((src.op, src.offset), (s.op as usize, off * 8));
                assert_eq!(src.output, s.kind == STEP_RECV);
            }
        }
        // The whole message is covered, each byte once, per direction.
        let mut sent: Vec<(u64, u64)> = form.steps.iter().filter(|(p, _, _)| p.dir == CONN_SEND).map(|(p, s, _)| (s.offset, p.bytes as u64)).collect();
        sent.sort();
        assert_eq!(sent.iter().map(|x| x.1).sum::<u64>(), 8000);
        assert!(sent.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));

        // This call's buffers land in the parameter; nothing else changes between calls.
        let fc_ops = [
            FcOp { send: 0xa000, recv: 0xb000, elem_size: 8, ..Default::default() },
            FcOp { send: 0xc000, recv: 0xd000, elem_size: 8, ..Default::default() },
        ];
        let base = FcP2p { abort: 1, error: 2, timeout_ns: 3, rank: 0, ..Default::default() };
        let p = form.param(&fc_ops, &base);
        assert_eq!((p.abort, p.error, p.timeout_ns, p.nsteps as usize), (1, 2, 3, form.steps.len()));
        for (k, (step, src, dst)) in form.steps.iter().enumerate() {
            let want = if src.op == 0 { 0xa000 } else { 0xd000 } + src.offset;
            assert_eq!(*dst, None);
            assert_eq!(p.steps[k], FcP2pStep { buf: want, ..*step });
        }
        assert!(p.steps[form.steps.len()..].iter().all(|s| *s == FcP2pStep::default()));
    }

    #[test]
    fn pieces_are_the_plan_kernels_whole_elements() {
        assert_eq!(piece_bytes(128 << 10, 4), 8192);
        assert_eq!(piece_bytes(128 << 10, 8), 8192);
        // A slot smaller than the LL data, for 8-byte lines and then whole elements.
        assert_eq!(piece_bytes(100, 1), 96);
        assert_eq!(piece_bytes(100, 8), 96);
        assert_eq!(piece_bytes(4096 + 64, 8), 4160);
        assert_eq!(piece_bytes(4, 8), 0);
    }

    #[test]
    fn launches_with_anything_but_ll_sends_and_receives_stay_on_the_plan_kernel() {
        let (n, chans) = (3, 2);
        let t = conns(n, chans);
        let p2p = |kind, peer| Op { kind, peer, count: 64, dtype: DataType::Int32 };
        // Simple protocol: not this form.
        assert!(p2p_form(&encoded(0, n, chans, &[p2p(CollKind::Send, 1)], false), &t).is_none());
        // Sends to oneself alone are copies, with no message to speed up.
        assert!(p2p_form(&encoded(0, n, chans, &[p2p(CollKind::Send, 0), p2p(CollKind::Recv, 0)], true), &t).is_none());
        // Several peers at once: fine.
        let ok = encoded(0, n, chans, &[p2p(CollKind::Send, 1), p2p(CollKind::Recv, 2), p2p(CollKind::Send, 2)], true);
        assert!(p2p_form(&ok, &t).is_some());

        // Hand-made tables for what the builder would not make.
        let base = p2p_form(&ok, &t).unwrap();
        let with = |f: &dyn Fn(&mut Encoded)| {
            let mut e = ok.clone();
            f(&mut e);
            p2p_form(&e, &t)
        };
        assert!(with(&|e| e.steps[0].flags |= FLAG_PRE).is_none(), "a pre-multiplied send");
        assert!(with(&|e| {
            e.steps[0].kind = STEP_COPY;
            e.steps[0].flags |= FLAG_POST;
        })
        .is_none(), "a copy that divides (an average's own block)");
        assert!(with(&|e| e.steps[0].kind = STEP_RECV_COPY).is_none());
        assert!(with(&|e| e.steps[0].send_conn = t.len() as i32).is_none(), "a connection the table lacks");
        assert!(with(&|e| e.steps[0].send_conn = -1).is_none());
        // The send connection named as if it received.
        let recv_conn = ok.steps.iter().find(|s| s.kind == STEP_RECV).unwrap().recv_conn;
        assert!(with(&|e| e.steps[0].send_conn = recv_conn).is_none(), "a receive connection used to send");
        // A connection on two lanes: two blocks would own its counter.
        assert!(with(&|e| {
            let s: FcStep = e.steps[0];
            e.steps.push(s);
            e.lanes.push(FcLane { first_step: e.steps.len() as u32 - 1, nsteps: 1 });
        })
        .is_none());
        // Too many steps for the parameter.
        assert!(with(&|e| {
            let s = e.steps[0];
            let l = e.lanes[0];
            e.steps.splice(l.first_step as usize..l.first_step as usize, std::iter::repeat_n(s, P2P_MAX_STEPS));
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
            ops.push(Op { kind: CollKind::Send, peer: q, count: 40, dtype: DataType::Int32 });
            ops.push(Op { kind: CollKind::Recv, peer: q, count: 40, dtype: DataType::Int32 });
        }
        let enc = encoded(1, n, chans, &ops, true);
        let form = p2p_form(&enc, &t).expect("sends, receives and the copy to oneself");
        let copies: Vec<_> = form.steps.iter().filter(|(p, _, _)| p.dir == P2P_COPY).collect();
        assert_eq!(copies.len(), 1);
        let (c, src, dst) = copies[0];
        // From the send to rank 1 (op 2) into the receive from rank 1 (op 3), all 160 bytes.
        assert_eq!((src.op, src.output, src.offset), (2, false, 0));
        assert_eq!(dst.map(|d| (d.op, d.output, d.offset)), Some((3, true, 0)));
        assert_eq!((c.bytes, c.conn, c.ll, c.counter), (160, -1, 0, 0));
        let fc_ops: Vec<FcOp> = (0..ops.len() as u64).map(|i| FcOp { send: 0x1000 * (i + 1), recv: 0x10_0000 * (i + 1), elem_size: 4, ..Default::default() }).collect();
        let p = form.param(&fc_ops, &FcP2p::default());
        let k = form.steps.iter().position(|(p, _, _)| p.dir == P2P_COPY).unwrap();
        assert_eq!((p.steps[k].buf, p.steps[k].dst), (0x3000, 0x40_0000));
        // Every other step is a message to or from another rank.
        assert_eq!(form.steps.iter().filter(|(p, _, _)| p.dir != P2P_COPY && p.peer != 1).count(), form.steps.len() - 1);

        // A copy that multiplies is a collective's, not a send's: not this form.
        let mut e = enc.clone();
        let i = e.steps.iter().position(|s| s.kind == STEP_COPY).unwrap();
        e.steps[i].flags |= FLAG_PRE;
        assert!(p2p_form(&e, &t).is_none());
    }
}
