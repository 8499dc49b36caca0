use ferroccl_core::numeric::check::CheckCase;
use ferroccl_core::{CollKind, DataType, ReduceOp};
fn main() {
    for (kind, dt) in [(CollKind::AllReduce, DataType::Float32), (CollKind::AllReduce, DataType::Bfloat16), (CollKind::AllGather, DataType::Float32)] {
        let c = CheckCase { kind, dtype: dt, op: ReduceOp::Sum, nranks: 4, rank: 1, count: 1 << 20, root: 0, seed: 5 };
        let mut buf = vec![0u8; (1 << 20) * dt.size()];
        let t = std::time::Instant::now();
        c.fill_input(&mut buf);
        let f = t.elapsed();
        let t = std::time::Instant::now();
        let mut b = None;
        let w = c.count_wrong(&buf, &mut b);
        println!("{kind} {dt}: fill {f:?} check {:?} ({w} wrong)", t.elapsed());
    }
}
