//! The single-producer single-consumer slot FIFO shared by every transport.
//!
//! All state lives in one block of memory (`FifoMem`) so that the same code works whether
//! the block is on the heap (threads of one process, TCP bridges) or in a POSIX shared-memory
//! segment mapped by two processes. Nothing in the block may be a pointer or anything
//! process-local; everything is an atomic or plain bytes at a fixed offset.

use crate::Error;
use std::cell::UnsafeCell;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Stored last by the creator, so a peer that sees it knows the header is complete.
pub(crate) const READY_MAGIC: u32 = 0x4643_4331; // "FCC1": bump the digit when the header changes

/// Longest poison reason kept; longer ones are clipped between words (`clip_message`).
pub(crate) const REASON_CAP: usize = 240;

/// How many times a waiter re-checks before paying for a futex syscall. A slot hand-off
/// between two busy cores usually lands within a few microseconds, which this covers.
const SPIN_ITERS: u32 = 300;

const CACHE_LINE: usize = 64;

// Poison states. `WRITING` exists because both ends may poison at once: the winner of the
// 0 -> WRITING race owns the reason bytes until it publishes the final kind.
const POISON_NONE: u32 = 0;
const POISON_WRITING: u32 = 1;
const POISON_REMOTE: u32 = 2;
const POISON_PROTOCOL: u32 = 3;
const POISON_ABORTED: u32 = 4;

/// What kind of error a poisoned FIFO reports to the other side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoisonKind {
    Remote,
    Protocol,
    Aborted,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FifoLayout {
    pub slots: u32,
    pub slot_bytes: usize,
}

const fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl FifoLayout {
    /// Offset of the per-slot length array.
    pub(crate) const LENS_OFFSET: usize = std::mem::size_of::<Header>();

    pub(crate) fn data_offset(&self) -> usize {
        round_up(Self::LENS_OFFSET + self.slots as usize * 4, CACHE_LINE)
    }

    fn checked_total(&self) -> Option<usize> {
        let data = (self.slots as usize).checked_mul(self.slot_bytes)?;
        let end = self.data_offset().checked_add(data)?;
        end.checked_add(CACHE_LINE - 1)
            .map(|e| e / CACHE_LINE * CACHE_LINE)
    }

    /// Header + slot lengths + data, rounded up to a cache line.
    ///
    /// Panics only for layouts that `validate` rejects (sizes overflowing the address space).
    pub fn total_bytes(&self) -> usize {
        self.checked_total()
            .expect("FifoLayout::total_bytes: layout overflows usize")
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.slots == 0 || self.slot_bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "FIFO layout {} slots x {} bytes: need at least one slot of at least one byte",
                self.slots, self.slot_bytes
            )));
        }
        // Lengths are stored as u32 and framed as u32 on TCP.
        if self.slot_bytes > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "FIFO slot size {} bytes exceeds the 4 GiB limit",
                self.slot_bytes
            )));
        }
        if !matches!(self.checked_total(), Some(t) if t <= isize::MAX as usize) {
            return Err(Error::InvalidArgument(format!(
                "FIFO layout {} slots x {} bytes is too large",
                self.slots, self.slot_bytes
            )));
        }
        Ok(())
    }
}

/// Fields read on every operation by both sides but written rarely (set-up, poison, close).
#[repr(C, align(64))]
pub(crate) struct Meta {
    pub(crate) magic: AtomicU32,
    pub(crate) slots: AtomicU32,
    pub(crate) slot_bytes: AtomicU64,
    pub(crate) producer_pid: AtomicU32,
    pub(crate) consumer_pid: AtomicU32,
    pub(crate) producer_closed: AtomicU32,
    pub(crate) consumer_closed: AtomicU32,
    pub(crate) poison: AtomicU32,
    pub(crate) reason_len: AtomicU32,
}

/// A counter alone on its cache line, so that the producer's writes to `head` do not
/// invalidate the line the consumer writes `tail` to, and vice versa.
#[repr(C, align(64))]
pub(crate) struct Counter {
    pub(crate) value: AtomicU32,
}

/// One side's sleeping state. The sleeper waits on `wake` rather than on head/tail because
/// poison and close must also wake it, and they change neither counter: a futex only
/// notices a wake that races with going to sleep if the watched word changed.
#[repr(C, align(64))]
pub(crate) struct WaitWord {
    pub(crate) waiting: AtomicU32,
    pub(crate) wake: AtomicU32,
}

#[repr(C)]
pub(crate) struct Header {
    pub(crate) meta: Meta,
    /// Slots published so far (wrapping); written by the producer only.
    pub(crate) head: Counter,
    /// Slots freed so far (wrapping); written by the consumer only.
    pub(crate) tail: Counter,
    /// The consumer sleeps here when empty; the producer wakes it.
    pub(crate) consumer_wait: WaitWord,
    /// The producer sleeps here when full; the consumer wakes it.
    pub(crate) producer_wait: WaitWord,
    /// UTF-8 poison reason; owned by whoever won the poison race, read after it is published.
    pub(crate) reason: UnsafeCell<[u8; 256]>,
}

/// Where the bytes of a `FifoMem` came from, i.e. how to give them back.
pub(crate) enum Backing {
    Heap(std::alloc::Layout),
    Shm,
}

/// The memory of one FIFO (header + slots), either heap (4096-aligned) or a mapped shm segment.
pub struct FifoMem {
    base: NonNull<u8>,
    len: usize,
    layout: FifoLayout,
    backing: Backing,
}

// SAFETY: every field of the block that both ends touch is an atomic; slot bytes and the
// poison reason are handed over through Release/Acquire on head/tail/poison.
unsafe impl Send for FifoMem {}
unsafe impl Sync for FifoMem {}

impl std::fmt::Debug for FifoMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FifoMem")
            .field("layout", &self.layout)
            .field("shm", &matches!(self.backing, Backing::Shm))
            .finish()
    }
}

impl FifoMem {
    pub fn heap(layout: FifoLayout) -> Result<Arc<FifoMem>, Error> {
        layout.validate()?;
        let len = layout.total_bytes();
        let alloc = std::alloc::Layout::from_size_align(len, 4096)
            .map_err(|e| Error::InvalidArgument(format!("FIFO of {len} bytes: {e}")))?;
        // Zeroed memory is a valid header (all counters and flags zero) before init.
        // SAFETY: len > 0 since the header alone is several hundred bytes.
        let p = unsafe { std::alloc::alloc_zeroed(alloc) };
        let base = NonNull::new(p).ok_or_else(|| {
            Error::System(format!(
                "out of memory allocating a {len}-byte FIFO ({} x {} bytes)",
                layout.slots, layout.slot_bytes
            ))
        })?;
        // SAFETY: freshly allocated, len bytes, 4096-aligned.
        let mem = unsafe { FifoMem::from_raw(base, len, layout, Backing::Heap(alloc)) };
        mem.init_header();
        Ok(Arc::new(mem))
    }

    /// SAFETY: `base` must point to `len >= layout.total_bytes()` bytes, 64-aligned, that stay
    /// valid until `backing` releases them in Drop.
    pub(crate) unsafe fn from_raw(
        base: NonNull<u8>,
        len: usize,
        layout: FifoLayout,
        backing: Backing,
    ) -> FifoMem {
        debug_assert!(len >= std::mem::size_of::<Header>());
        FifoMem {
            base,
            len,
            layout,
            backing,
        }
    }

    /// Writes the layout and publishes the ready magic. The memory must be zeroed.
    pub(crate) fn init_header(&self) {
        let m = &self.header().meta;
        m.slots.store(self.layout.slots, Ordering::Relaxed);
        m.slot_bytes
            .store(self.layout.slot_bytes as u64, Ordering::Relaxed);
        m.magic.store(READY_MAGIC, Ordering::Release);
    }

    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the block starts with a Header and is at least 64-aligned (heap: 4096,
        // mmap: page); all of the Header's shared fields are atomics or UnsafeCell.
        unsafe { &*(self.base.as_ptr() as *const Header) }
    }

    pub(crate) fn mapped_len(&self) -> usize {
        self.len
    }

    fn len_word(&self, slot: u32) -> &AtomicU32 {
        debug_assert!(slot < self.layout.slots);
        // SAFETY: the length array lies inside the block (total_bytes covers it) and is
        // 4-aligned because the header size is a multiple of 64.
        unsafe {
            &*(self
                .base
                .as_ptr()
                .add(FifoLayout::LENS_OFFSET + slot as usize * 4)
                as *const AtomicU32)
        }
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        debug_assert!(slot < self.layout.slots);
        // SAFETY: inside the block by construction of total_bytes.
        unsafe {
            self.base
                .as_ptr()
                .add(self.layout.data_offset() + slot as usize * self.layout.slot_bytes)
        }
    }

    /// Marks the FIFO failed so that the other end stops waiting; the first reason wins.
    pub fn poison(&self, reason: &str) {
        self.poison_kind(PoisonKind::Remote, reason);
    }

    pub(crate) fn poison_kind(&self, kind: PoisonKind, reason: &str) {
        let m = &self.header().meta;
        // Clipped before the race: readers spin while the winner writes.
        let reason = ferroccl_core::types::clip_message(reason, REASON_CAP);
        if m.poison
            .compare_exchange(
                POISON_NONE,
                POISON_WRITING,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            let n = reason.len();
            // SAFETY: winning the CAS makes us the only writer; readers look only after the
            // Release store of the final state below.
            unsafe {
                let buf = &mut *self.header().reason.get();
                buf[..n].copy_from_slice(&reason.as_bytes()[..n]);
            }
            m.reason_len.store(n as u32, Ordering::Relaxed);
            let state = match kind {
                PoisonKind::Remote => POISON_REMOTE,
                PoisonKind::Protocol => POISON_PROTOCOL,
                PoisonKind::Aborted => POISON_ABORTED,
            };
            m.poison.store(state, Ordering::Release);
            tracing::debug!(reason = %reason, "FIFO poisoned");
        }
        // Wake both ends even if someone else poisoned first: cheap, rare, and harmless.
        let h = self.header();
        wake_always(&h.consumer_wait);
        wake_always(&h.producer_wait);
    }

    pub(crate) fn is_poisoned(&self) -> bool {
        self.header().meta.poison.load(Ordering::Acquire) != POISON_NONE
    }

    /// The error a poisoned FIFO reports, or None when it is not poisoned.
    pub(crate) fn poison_error(&self) -> Option<Error> {
        let m = &self.header().meta;
        let mut state = m.poison.load(Ordering::Acquire);
        if state == POISON_NONE {
            return None;
        }
        // The poisoner is between its CAS and its publish: a handful of stores.
        let mut spins = 0;
        while state == POISON_WRITING && spins < 100_000 {
            std::hint::spin_loop();
            spins += 1;
            state = m.poison.load(Ordering::Acquire);
        }
        let reason = if state == POISON_WRITING {
            "the connection was marked failed by the other end".to_string()
        } else {
            let n = (m.reason_len.load(Ordering::Relaxed) as usize).min(REASON_CAP);
            // SAFETY: published with Release before `state`, never written again.
            let buf = unsafe { &*self.header().reason.get() };
            String::from_utf8_lossy(&buf[..n]).into_owned()
        };
        Some(match state {
            POISON_PROTOCOL => Error::Protocol(reason),
            POISON_ABORTED => Error::Aborted(reason),
            _ => Error::Remote(reason),
        })
    }
}

impl Drop for FifoMem {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: allocated in `heap` with exactly this layout.
            Backing::Heap(l) => unsafe { std::alloc::dealloc(self.base.as_ptr(), l) },
            Backing::Shm => {
                // SAFETY: mapped by shm_create/shm_open with this length; no references outlive
                // the last Arc.
                unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len) };
            }
        }
    }
}

#[cfg(target_os = "linux")]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // Not FUTEX_PRIVATE: the word may be in memory shared with another process.
    // SAFETY: the word is a valid, aligned u32 for the duration of the call. EAGAIN
    // (value changed), EINTR and ETIMEDOUT are all plain returns for the caller, which re-checks.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(target_os = "linux")]
fn futex_wake(word: &AtomicU32) {
    // SAFETY: as above; waking a word nobody sleeps on is harmless.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

// Elsewhere there is no cross-process wait primitive as cheap; a short nap keeps waits correct.
#[cfg(not(target_os = "linux"))]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    if word.load(Ordering::Acquire) == expected {
        std::thread::sleep(timeout.min(Duration::from_micros(200)));
    }
}

#[cfg(not(target_os = "linux"))]
fn futex_wake(_word: &AtomicU32) {}

/// Sleeps until `ready()` or the timeout. Lost wakeups are impossible because `wake` is
/// sampled before `waiting` is raised and `ready()` re-checked: a waker that missed the flag
/// published its change before our re-check (the two SeqCst fences order flag vs. state),
/// and a waker that saw it bumps `wake` after our sample, so FUTEX_WAIT returns at once.
fn wait_until(w: &WaitWord, timeout: Duration, ready: impl Fn() -> bool) {
    for _ in 0..SPIN_ITERS {
        if ready() {
            return;
        }
        std::hint::spin_loop();
    }
    if timeout.is_zero() {
        return;
    }
    let seen = w.wake.load(Ordering::SeqCst);
    w.waiting.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    if !ready() {
        futex_wait(&w.wake, seen, timeout);
    }
    w.waiting.store(0, Ordering::Relaxed);
}

/// The waker's half: call after publishing the state change the sleeper is waiting for.
/// Skips the syscall when nobody sleeps, which is the common case under load.
#[inline]
fn wake_if_waiting(w: &WaitWord) {
    fence(Ordering::SeqCst);
    if w.waiting.load(Ordering::Relaxed) != 0 {
        wake_always(w);
    }
}

fn wake_always(w: &WaitWord) {
    w.wake.fetch_add(1, Ordering::SeqCst);
    futex_wake(&w.wake);
}

/// True if a process with this pid exists and is not a zombie (a killed rank stays a zombie
/// until its launcher reaps it, which may be after the survivors gave up waiting). 0 means
/// "peer not attached yet", which is not evidence of death, so it reports alive.
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return true;
    }
    // kill() with a pid that is negative after the cast would signal a process group.
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks existence and permissions.
    let r = unsafe { libc::kill(p, 0) };
    let exists = r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && !is_zombie(pid)
}

/// Reads the state field of /proc/PID/stat ("pid (comm) S ..."; comm may contain spaces and
/// parentheses, so the state is the first field after the last ')').
fn is_zombie(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].trim_start().chars().next());
    matches!(state, Some('Z') | Some('X'))
}

pub struct Producer {
    mem: Arc<FifoMem>,
    /// Our own copy of head: only we write it, so we never need to read it back.
    head: u32,
    /// Index of the slot `head` points at (head mod slots, kept separately because slots
    /// need not divide 2^32 and head wraps).
    idx: u32,
    /// Last tail seen; refreshed only when the FIFO looks full, to keep the consumer's line
    /// out of our cache in the common case.
    tail_seen: u32,
}

impl Producer {
    pub fn new(mem: Arc<FifoMem>) -> Producer {
        let h = mem.header();
        h.meta
            .producer_pid
            .store(std::process::id(), Ordering::Release);
        let head = h.head.value.load(Ordering::Acquire);
        let tail_seen = h.tail.value.load(Ordering::Acquire);
        let idx = head % mem.layout.slots;
        Producer {
            mem,
            head,
            idx,
            tail_seen,
        }
    }

    pub fn slot_bytes(&self) -> usize {
        self.mem.layout.slot_bytes
    }

    pub(crate) fn mem(&self) -> &Arc<FifoMem> {
        &self.mem
    }

    fn has_space(&self, tail: u32) -> bool {
        self.head.wrapping_sub(tail) < self.mem.layout.slots
    }

    /// A free slot (pointer to slot_bytes writable bytes), or None if the FIFO is full.
    /// Calling it again before commit returns the same slot.
    pub fn try_reserve(&mut self) -> Result<Option<*mut u8>, Error> {
        let m = &self.mem.header().meta;
        if let Some(e) = self.mem.poison_error() {
            return Err(e);
        }
        if m.consumer_closed.load(Ordering::Acquire) != 0 {
            return Err(Error::Remote(
                "the receiving end of the connection was closed".into(),
            ));
        }
        if !self.has_space(self.tail_seen) {
            self.tail_seen = self.mem.header().tail.value.load(Ordering::Acquire);
            if !self.has_space(self.tail_seen) {
                return Ok(None);
            }
        }
        Ok(Some(self.mem.slot_ptr(self.idx)))
    }

    /// Publishes the reserved slot holding `len` bytes and wakes a waiting consumer.
    ///
    /// Panics if `len > slot_bytes` or no slot is free (commit without a successful reserve).
    pub fn commit(&mut self, len: usize) {
        assert!(
            len <= self.mem.layout.slot_bytes,
            "commit of {len} bytes into {}-byte slots",
            self.mem.layout.slot_bytes
        );
        assert!(
            self.has_space(self.tail_seen),
            "Producer::commit without a reserved slot"
        );
        let h = self.mem.header();
        self.mem
            .len_word(self.idx)
            .store(len as u32, Ordering::Relaxed);
        self.head = self.head.wrapping_add(1);
        self.idx = if self.idx + 1 == self.mem.layout.slots {
            0
        } else {
            self.idx + 1
        };
        // Release: slot bytes and length become visible no later than the new head.
        h.head.value.store(self.head, Ordering::Release);
        wake_if_waiting(&h.consumer_wait);
    }

    /// Blocks until the consumer frees a slot, the FIFO is poisoned or closed, or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        let h = self.mem.header();
        wait_until(&h.producer_wait, timeout, || {
            self.has_space(h.tail.value.load(Ordering::Acquire))
                || h.meta.poison.load(Ordering::Acquire) != POISON_NONE
                || h.meta.consumer_closed.load(Ordering::Acquire) != 0
        });
    }

    #[cfg(test)]
    /// The consumer's pid (0 if not yet attached).
    pub fn peer_pid(&self) -> u32 {
        self.mem.header().meta.consumer_pid.load(Ordering::Acquire)
    }

    #[cfg(test)]
    pub fn poison(&self, reason: &str) {
        self.mem.poison(reason);
    }

    /// Whether the consumer has been dropped (for TCP: its bridge thread has exited).
    pub fn peer_closed(&self) -> bool {
        self.mem
            .header()
            .meta
            .consumer_closed
            .load(Ordering::Acquire)
            != 0
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        let h = self.mem.header();
        h.meta.producer_closed.store(1, Ordering::Release);
        wake_always(&h.consumer_wait);
    }
}

pub struct Consumer {
    mem: Arc<FifoMem>,
    tail: u32,
    idx: u32,
    head_seen: u32,
}

impl Consumer {
    pub fn new(mem: Arc<FifoMem>) -> Consumer {
        let h = mem.header();
        h.meta
            .consumer_pid
            .store(std::process::id(), Ordering::Release);
        let tail = h.tail.value.load(Ordering::Acquire);
        let head_seen = h.head.value.load(Ordering::Acquire);
        let idx = tail % mem.layout.slots;
        Consumer {
            mem,
            tail,
            idx,
            head_seen,
        }
    }

    #[cfg(test)]
    pub fn slot_bytes(&self) -> usize {
        self.mem.layout.slot_bytes
    }

    pub(crate) fn mem(&self) -> &Arc<FifoMem> {
        &self.mem
    }

    /// The oldest published slot (pointer, len), or None if empty. Data published before a
    /// poison or close is still delivered; the error comes once the FIFO is empty.
    pub fn try_peek(&mut self) -> Result<Option<(*const u8, usize)>, Error> {
        if self.head_seen == self.tail {
            let h = self.mem.header();
            // Flags first, head second: anything the producer published before it poisoned
            // or closed is then visible in the head we read, so we never drop it.
            let poisoned = h.meta.poison.load(Ordering::Acquire) != POISON_NONE;
            let closed = h.meta.producer_closed.load(Ordering::Acquire) != 0;
            self.head_seen = h.head.value.load(Ordering::Acquire);
            if self.head_seen == self.tail {
                if poisoned {
                    return Err(self.mem.poison_error().expect("poison is never cleared"));
                }
                if closed {
                    return Err(Error::Remote(
                        "the sending end of the connection was closed".into(),
                    ));
                }
                return Ok(None);
            }
        }
        let len = self.mem.len_word(self.idx).load(Ordering::Relaxed) as usize;
        Ok(Some((
            self.mem.slot_ptr(self.idx) as *const u8,
            len.min(self.mem.layout.slot_bytes),
        )))
    }

    /// Frees the slot returned by try_peek and wakes a waiting producer.
    ///
    /// Panics if nothing is available to release.
    pub fn release(&mut self) {
        assert!(
            self.head_seen != self.tail,
            "Consumer::release without a peeked slot"
        );
        let h = self.mem.header();
        self.tail = self.tail.wrapping_add(1);
        self.idx = if self.idx + 1 == self.mem.layout.slots {
            0
        } else {
            self.idx + 1
        };
        // Release: our reads of the slot finish before the producer may overwrite it.
        h.tail.value.store(self.tail, Ordering::Release);
        wake_if_waiting(&h.producer_wait);
    }

    /// Blocks until a slot is published, the FIFO is poisoned or closed, or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        let h = self.mem.header();
        wait_until(&h.consumer_wait, timeout, || {
            h.head.value.load(Ordering::Acquire) != self.tail
                || h.meta.poison.load(Ordering::Acquire) != POISON_NONE
                || h.meta.producer_closed.load(Ordering::Acquire) != 0
        });
    }

    #[cfg(test)]
    /// The producer's pid (0 if not yet attached).
    pub fn peer_pid(&self) -> u32 {
        self.mem.header().meta.producer_pid.load(Ordering::Acquire)
    }

    #[cfg(test)]
    pub fn poison(&self, reason: &str) {
        self.mem.poison(reason);
    }

    /// Whether the producer has been dropped (for TCP: its bridge thread has exited).
    pub fn peer_closed(&self) -> bool {
        self.mem
            .header()
            .meta
            .producer_closed
            .load(Ordering::Acquire)
            != 0
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let h = self.mem.header();
        h.meta.consumer_closed.store(1, Ordering::Release);
        wake_always(&h.producer_wait);
    }
}
