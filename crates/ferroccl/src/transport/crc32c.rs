//! CRC32C (Castagnoli), the checksum of iSCSI and ext4, for the socket transport's optional
//! frame check: with SSE4.2's crc32 instruction where the CPU has it, else slicing-by-8
//! tables. Written here rather than taken from a crate because it is forty lines and the
//! test vectors of RFC 3720 pin it down.

/// The Castagnoli polynomial, bit-reflected.
const POLY: u32 = 0x82F6_3B78;

/// `TABLES[k][b]`: the CRC state change of byte `b` followed by `k` zero bytes, so eight
/// bytes can be folded in with eight independent lookups.
static TABLES: [[u32; 256]; 8] = make_tables();

const fn make_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut s = 1;
    while s < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[s - 1][i];
            t[s][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            i += 1;
        }
        s += 1;
    }
    t
}

/// The CRC32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    extend(0, data)
}

/// The CRC32C of the bytes `crc` was computed over followed by `data`.
pub fn extend(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU supports SSE4.2, checked just above.
        return !unsafe { state_sse42(!crc, data) };
    }
    !state_tables(!crc, data)
}

pub(crate) fn state_tables(mut state: u32, mut data: &[u8]) -> u32 {
    let t = &TABLES;
    while data.len() >= 8 {
        let lo = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) ^ state;
        let hi = u32::from_le_bytes([data[4], data[5], data[6], data[7]]);
        state = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][(hi & 0xff) as usize]
            ^ t[2][((hi >> 8) & 0xff) as usize]
            ^ t[1][((hi >> 16) & 0xff) as usize]
            ^ t[0][(hi >> 24) as usize];
        data = &data[8..];
    }
    for &b in data {
        state = (state >> 8) ^ t[0][((state ^ b as u32) & 0xff) as usize];
    }
    state
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
pub(crate) unsafe fn state_sse42(state: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut s = state as u64;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        s = _mm_crc32_u64(s, u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    let mut s = s as u32;
    for &b in words.remainder() {
        s = _mm_crc32_u8(s, b);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Both implementations, so that the one this CPU does not pick is tested too.
    fn both(data: &[u8]) -> Vec<u32> {
        let mut v = vec![!state_tables(!0, data)];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("sse4.2") {
            // SAFETY: checked just above.
            v.push(!unsafe { state_sse42(!0, data) });
        }
        v
    }

    #[test]
    fn rfc3720_test_vectors() {
        // RFC 3720, appendix B.4.
        let ascending: Vec<u8> = (0..32).collect();
        let descending: Vec<u8> = (0..32).rev().collect();
        let iscsi_read: [u8; 48] = [
            0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, //
            0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00,
            0x00, 0x18, //
            0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00,
        ];
        let cases: [(&[u8], u32); 6] = [
            (&[0u8; 32], 0x8A91_36AA),
            (&[0xFFu8; 32], 0x62A8_AB43),
            (&ascending, 0x46DD_794E),
            (&descending, 0x113F_DB5C),
            (&iscsi_read, 0xD996_3A56),
            (b"123456789", 0xE306_9283),
        ];
        for (data, want) in cases {
            assert_eq!(crc32c(data), want, "{data:02x?}");
            assert!(both(data).iter().all(|&c| c == want), "{data:02x?}");
        }
        assert_eq!(crc32c(&[]), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn implementations_agree_and_extend_concatenates(a in proptest::collection::vec(any::<u8>(), 0..300), b in proptest::collection::vec(any::<u8>(), 0..300)) {
            let whole = [a.as_slice(), &b].concat();
            let c = crc32c(&whole);
            prop_assert!(both(&whole).iter().all(|&x| x == c));
            prop_assert_eq!(extend(crc32c(&a), &b), c);
        }

        #[test]
        fn every_single_bit_flip_is_detected(data in proptest::collection::vec(any::<u8>(), 1..200), bit in any::<usize>()) {
            let mut bad = data.clone();
            let bit = bit % (bad.len() * 8);
            bad[bit / 8] ^= 1 << (bit % 8);
            prop_assert_ne!(crc32c(&bad), crc32c(&data));
        }
    }

    /// Throughput of the CRC32C that FERROCCL_TCP_CRC computes on both ends of every frame:
    /// `cargo test --release -p ferroccl crc32c_speed -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn crc32c_speed() {
        let buf: Vec<u8> = (0..(64usize << 20)).map(|i| (i * 31 % 251) as u8).collect();
        for slot in [4096usize, 256 << 10] {
            let mut best = f64::INFINITY;
            let mut sum = 0u32;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                for chunk in buf.chunks(slot) {
                    sum ^= crc32c(chunk);
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "CRC32C over {} KiB frames: {:.2} GB/s (checksum {sum:08x})",
                slot >> 10,
                buf.len() as f64 / best / 1e9
            );
        }
    }
}
