//! Throughput of the CRC32C that FERROCCL_TCP_CRC computes on both ends of every frame.
//!
//! cargo run --release -p ferroccl --example crc32c_speed

use std::time::Instant;

fn main() {
    let buf: Vec<u8> = (0..(64usize << 20)).map(|i| (i * 31 % 251) as u8).collect();
    for slot in [4096usize, 256 << 10] {
        let mut best = f64::INFINITY;
        let mut sum = 0u32;
        for _ in 0..5 {
            let t = Instant::now();
            for chunk in buf.chunks(slot) {
                sum ^= ferroccl::transport::crc32c(chunk);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("CRC32C over {} KiB frames: {:.2} GB/s (checksum {sum:08x})", slot >> 10, buf.len() as f64 / best / 1e9);
    }
}
