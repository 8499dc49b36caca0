//! Numerics shared by every backend: the 8-bit float formats, typed access to element buffers,
//! the host reduction kernels, and verifiable inputs with exactly known results.

/// Runs `$body` with `$T` bound to the Rust element type of `$dtype`.
macro_rules! with_element_type {
    ($dtype:expr, $T:ident => $body:expr) => {{
        use $crate::types::DataType as D;
        match $dtype {
            D::Int8 => {
                type $T = i8;
                $body
            }
            D::Uint8 => {
                type $T = u8;
                $body
            }
            D::Int32 => {
                type $T = i32;
                $body
            }
            D::Uint32 => {
                type $T = u32;
                $body
            }
            D::Int64 => {
                type $T = i64;
                $body
            }
            D::Uint64 => {
                type $T = u64;
                $body
            }
            D::Float16 => {
                type $T = half::f16;
                $body
            }
            D::Float32 => {
                type $T = f32;
                $body
            }
            D::Float64 => {
                type $T = f64;
                $body
            }
            D::Bfloat16 => {
                type $T = half::bf16;
                $body
            }
            D::Float8E4M3 => {
                type $T = $crate::numeric::fp8::F8E4M3;
                $body
            }
            D::Float8E5M2 => {
                type $T = $crate::numeric::fp8::F8E5M2;
                $body
            }
        }
    }};
}

pub mod element;
pub mod expected;
pub mod fp8;
pub mod reduce;
pub mod verify;

pub use element::Element;
pub use fp8::{F8E4M3, F8E5M2};
pub use reduce::Reducer;
pub use verify::splitmix64;
