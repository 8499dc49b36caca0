//! Host reduction kernels.
//!
//! They work on raw pointers because collectives run in place: a destination may be the very
//! buffer being read. The contract is that a destination is either exactly equal to an input or
//! disjoint from it, never partially overlapping, so element `i` of the output depends only on
//! element `i` of the inputs.
//!
//! Each call dispatches once on (dtype, op, flags) to a monomorphized loop. The loop works in
//! blocks: it computes a block into a stack buffer, then copies that to every destination. The
//! stack buffer cannot alias the inputs, so LLVM vectorizes the compute loop without runtime
//! overlap checks (which would otherwise send the in-place case, the common one, down the
//! scalar path), and the copy-out handles one or two destinations and any alignment.
//! Loads use `read_unaligned`, which compiles to the same vector loads as aligned ones on
//! x86_64 and aarch64, so the aligned case needs no separate path.
//!
//! Arithmetic: integers wrap; f32 and f64 compute natively; f16, bf16 and the fp8 types compute
//! in f32 and round to nearest even when stored (fp8 saturating), as GPU kernels do.
//! Max and min propagate NaN when either operand is NaN; with equal operands (including -0 vs
//! +0) they return the received value.

use std::mem::size_of;
use std::ptr;

use half::{bf16, f16};

use super::element::Element;
use super::fp8::{F8E4M3, F8E5M2};
use crate::types::{DataType, Error, ReduceOp};

/// Arithmetic of a compute type.
trait Arith: Copy {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    /// Avg's final step: truncating division for integers, division for floats.
    fn div_n(self, n: usize) -> Self;
}

macro_rules! arith_int {
    ($($t:ty => $wide:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)]
            fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            #[inline(always)]
            fn max(self, o: Self) -> Self { Ord::max(self, o) }
            #[inline(always)]
            fn min(self, o: Self) -> Self { Ord::min(self, o) }
            #[inline(always)]
            fn div_n(self, n: usize) -> Self {
                // Widened so that a rank count beyond the type's range still divides correctly
                // (e.g. i8 -128 / 128 = -1).
                (self as $wide / n as $wide) as $t
            }
        }
    )*};
}
arith_int!(i8 => i64, u8 => u64, i32 => i64, u32 => u64, i64 => i128, u64 => u128);

macro_rules! arith_float {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self { self + o }
            #[inline(always)]
            fn mul(self, o: Self) -> Self { self * o }
            // One select on an or'ed condition, which vectorizes: NaN in self returns self,
            // NaN in o fails the comparison and returns o.
            #[inline(always)]
            fn max(self, o: Self) -> Self { if self.is_nan() | (self > o) { self } else { o } }
            #[inline(always)]
            fn min(self, o: Self) -> Self { if self.is_nan() | (self < o) { self } else { o } }
            #[inline(always)]
            fn div_n(self, n: usize) -> Self { self / n as $t }
        }
    )*};
}
arith_float!(f32, f64);

/// An element type together with the type its arithmetic is done in.
trait Lane: Element {
    type C: Arith;
    fn load(self) -> Self::C;
    fn store(c: Self::C) -> Self;
}

macro_rules! lane_native {
    ($($t:ty),*) => {$(
        impl Lane for $t {
            type C = $t;
            #[inline(always)]
            fn load(self) -> $t { self }
            #[inline(always)]
            fn store(c: $t) -> $t { c }
        }
    )*};
}
lane_native!(i8, u8, i32, u32, i64, u64, f32, f64);

macro_rules! lane_f32 {
    ($($t:ty),*) => {$(
        impl Lane for $t {
            type C = f32;
            #[inline(always)]
            fn load(self) -> f32 { self.to_f32() }
            #[inline(always)]
            fn store(c: f32) -> $t { <$t>::from_f32(c) }
        }
    )*};
}
lane_f32!(f16, bf16, F8E4M3, F8E5M2);

/// The combining function of an op (Avg and PreMulSum combine as Sum).
trait Combine<C: Arith> {
    fn f(recv: C, local: C) -> C;
}
struct Sum;
struct Prod;
struct Max;
struct Min;
impl<C: Arith> Combine<C> for Sum {
    #[inline(always)]
    fn f(a: C, b: C) -> C {
        a.add(b)
    }
}
impl<C: Arith> Combine<C> for Prod {
    #[inline(always)]
    fn f(a: C, b: C) -> C {
        a.mul(b)
    }
}
impl<C: Arith> Combine<C> for Max {
    #[inline(always)]
    fn f(a: C, b: C) -> C {
        a.max(b)
    }
}
impl<C: Arith> Combine<C> for Min {
    #[inline(always)]
    fn f(a: C, b: C) -> C {
        a.min(b)
    }
}

/// Elements per block: 4 KiB for f64, small enough for L1 with the inputs streaming past.
const BLOCK: usize = 512;

#[inline(always)]
unsafe fn copy_out<T>(dsts: &[*mut u8], buf: &[T], first: usize) {
    for &d in dsts {
        ptr::copy_nonoverlapping(
            buf.as_ptr() as *const u8,
            d.add(first * size_of::<T>()),
            std::mem::size_of_val(buf),
        );
    }
}

unsafe fn reduce_loop<T: Lane, O: Combine<T::C>, const PRE: bool, const POST: bool>(
    scalar: T::C,
    nranks: usize,
    dsts: &[*mut u8],
    recv: *const u8,
    local: *const u8,
    n: usize,
) {
    let recv = recv as *const T;
    let local = local as *const T;
    let mut buf = [T::default(); BLOCK];
    let mut i = 0;
    while i < n {
        let len = BLOCK.min(n - i);
        let r = recv.add(i);
        let l = local.add(i);
        for (j, out) in buf[..len].iter_mut().enumerate() {
            let mut lv = ptr::read_unaligned(l.add(j)).load();
            if PRE {
                // Rounded to the element type as a sender's stored product is (transform), so a
                // fold of two ranks' contributions gives the same bits whichever rank makes it
                // (the GPU kernels' reduce_elem does the same).
                lv = T::store(lv.mul(scalar)).load();
            }
            let mut v = O::f(ptr::read_unaligned(r.add(j)).load(), lv);
            if POST {
                v = v.div_n(nranks);
            }
            *out = T::store(v);
        }
        copy_out(dsts, &buf[..len], i);
        i += len;
    }
}

unsafe fn transform_loop<T: Lane, const PRE: bool, const POST: bool>(
    scalar: T::C,
    nranks: usize,
    dsts: &[*mut u8],
    src: *const u8,
    n: usize,
) {
    let src = src as *const T;
    let mut buf = [T::default(); BLOCK];
    let mut i = 0;
    while i < n {
        let len = BLOCK.min(n - i);
        let s = src.add(i);
        for (j, out) in buf[..len].iter_mut().enumerate() {
            let mut v = ptr::read_unaligned(s.add(j)).load();
            if PRE {
                v = v.mul(scalar);
            }
            if POST {
                v = v.div_n(nranks);
            }
            *out = T::store(v);
        }
        copy_out(dsts, &buf[..len], i);
        i += len;
    }
}

/// Host reduction for one (dtype, op, nranks). Cheap to create and copy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reducer {
    dtype: DataType,
    op: ReduceOp,
    nranks: usize,
}

impl Reducer {
    /// Errors (Error::InvalidArgument) for nranks == 0 or an op invalid for dtype.
    pub fn new(dtype: DataType, op: ReduceOp, nranks: usize) -> Result<Reducer, Error> {
        if nranks == 0 {
            return Err(Error::InvalidArgument(
                "a reduction needs at least one rank".into(),
            ));
        }
        op.validate(dtype)?;
        Ok(Reducer { dtype, op, nranks })
    }

    /// The element type it reduces.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// The reduction.
    pub fn op(&self) -> ReduceOp {
        self.op
    }

    /// Ranks whose contributions it folds (an average divides by this).
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// For i in 0..n: `v = src[i]`; if pre { `v = pre(v)` }; if post { `v = post(v)` }; write v to
    /// every dst in dsts.
    ///
    /// pre multiplies by the PreMulSum scalar (converted to the element type), post divides by
    /// nranks for Avg; both are the identity for other ops.
    ///
    /// # Safety
    /// `src` must be readable and every dst writable for `n` elements of the dtype; alignment is
    /// not required. A dst may be exactly `src` but must not partially overlap it or another dst.
    pub unsafe fn transform(
        &self,
        dsts: &[*mut u8],
        src: *const u8,
        n: usize,
        pre: bool,
        post: bool,
    ) {
        if n == 0 || dsts.is_empty() {
            return;
        }
        with_element_type!(self.dtype, T => self.transform_typed::<T>(dsts, src, n, pre, post))
    }

    /// For i in 0..n: `l = local[i]`; if pre_local { `l = pre(l)` }; `v = combine(recv[i], l)`;
    /// if post { v = post(v) }; write v to every dst.
    ///
    /// # Safety
    /// `recv` and `local` must be readable and every dst writable for `n` elements of the dtype;
    /// alignment is not required. A dst may be exactly `recv` or `local` but must not partially
    /// overlap them or another dst.
    pub unsafe fn reduce(
        &self,
        dsts: &[*mut u8],
        recv: *const u8,
        local: *const u8,
        n: usize,
        pre_local: bool,
        post: bool,
    ) {
        if n == 0 || dsts.is_empty() {
            return;
        }
        with_element_type!(self.dtype, T => self.reduce_typed::<T>(dsts, recv, local, n, pre_local, post))
    }

    fn scalar<T: Lane>(&self) -> T::C {
        match self.op {
            ReduceOp::PreMulSum(s) => T::from_f64(s).load(),
            _ => T::default().load(),
        }
    }

    #[inline(always)]
    unsafe fn transform_typed<T: Lane>(
        &self,
        dsts: &[*mut u8],
        src: *const u8,
        n: usize,
        pre: bool,
        post: bool,
    ) {
        let pre = pre && matches!(self.op, ReduceOp::PreMulSum(_));
        let post = post && self.op == ReduceOp::Avg;
        let (s, k) = (self.scalar::<T>(), self.nranks);
        match (pre, post) {
            (false, false) => transform_loop::<T, false, false>(s, k, dsts, src, n),
            (true, false) => transform_loop::<T, true, false>(s, k, dsts, src, n),
            (false, true) => transform_loop::<T, false, true>(s, k, dsts, src, n),
            (true, true) => transform_loop::<T, true, true>(s, k, dsts, src, n),
        }
    }

    #[inline(always)]
    unsafe fn reduce_typed<T: Lane>(
        &self,
        dsts: &[*mut u8],
        recv: *const u8,
        local: *const u8,
        n: usize,
        pre: bool,
        post: bool,
    ) {
        let (s, k) = (self.scalar::<T>(), self.nranks);
        match self.op {
            ReduceOp::Sum => reduce_loop::<T, Sum, false, false>(s, k, dsts, recv, local, n),
            ReduceOp::Prod => reduce_loop::<T, Prod, false, false>(s, k, dsts, recv, local, n),
            ReduceOp::Max => reduce_loop::<T, Max, false, false>(s, k, dsts, recv, local, n),
            ReduceOp::Min => reduce_loop::<T, Min, false, false>(s, k, dsts, recv, local, n),
            ReduceOp::Avg if post => reduce_loop::<T, Sum, false, true>(s, k, dsts, recv, local, n),
            ReduceOp::Avg => reduce_loop::<T, Sum, false, false>(s, k, dsts, recv, local, n),
            ReduceOp::PreMulSum(_) if pre => {
                reduce_loop::<T, Sum, true, false>(s, k, dsts, recv, local, n)
            }
            ReduceOp::PreMulSum(_) => {
                reduce_loop::<T, Sum, false, false>(s, k, dsts, recv, local, n)
            }
        }
    }
}

#[cfg(test)]
mod tests;
