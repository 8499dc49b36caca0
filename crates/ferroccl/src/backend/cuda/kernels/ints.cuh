// Fixed-width integer names for every kernel source: NVRTC has no C library headers, and
// check.cuh is also compiled as plain C and C++ on the host, so the names are spelled out once
// here (and nothing else: both compilers must accept this file alone).
#pragma once

typedef signed char fc_i8;
typedef unsigned char fc_u8;
typedef unsigned short fc_u16;
typedef int fc_i32;
typedef unsigned int fc_u32;
typedef long long fc_i64;
typedef unsigned long long fc_u64;
