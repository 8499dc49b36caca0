//! One call's launches to several GPUs, made at once by helper threads.
//!
//! A thread that drives several GPUs (a group over their communicators) would pay each GPU's
//! driver launch in turn, 2.5-3.7 us each on 2 x H200 (docs/PERFORMANCE.md, section 5), so its
//! call cost the sum where a thread per GPU pays one. Here the calling thread hands every job
//! but the first to a helper that is spinning, runs the first itself and waits for the helpers:
//! the call costs about the slowest launch plus a hand-over through one cache line.
//!
//! A helper spins for the caller's `spin` after its last job, then parks. A parked helper is not
//! woken for a job (a wake takes longer than the launch it would save); the caller runs that job
//! itself and wakes the helper for its next call. So a program that calls in a tight loop gets
//! the parallel launches, and one that calls rarely loses nothing but a wake-up now and then.
//! Callers on several threads at once: one holds the helpers, the others run their jobs in turn.

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// A job: one GPU's launch, borrowing the caller's state for the length of the call.
pub(crate) type Job<'a> = &'a mut (dyn FnMut() + Send + 'a);

/// The most helpers one call uses (a call on more GPUs runs the rest on the caller).
const MAX_HELPERS: usize = 63;

// A helper's state. Only the caller moves IDLE -> POSTED and DONE -> IDLE, and COLD -> IDLE
// (with an unpark); only the helper moves POSTED -> DONE and IDLE -> COLD.
/// Parked, or about to park: not to be given a job.
const COLD: u8 = 0;
/// Spinning, waiting for a job.
const IDLE: u8 = 1;
/// A job is in `Helper::job`.
const POSTED: u8 = 2;
/// The job has run; its panic, if any, is in `Helper::panic`.
const DONE: u8 = 3;

struct Helper {
    state: AtomicU8,
    /// Nanoseconds to spin after a job before parking (the last caller's `spin`).
    spin_ns: AtomicU64,
    /// Written by the caller before it publishes POSTED, read by the helper after it sees it.
    job: UnsafeCell<Option<Job<'static>>>,
    /// Written by the helper before it publishes DONE, taken by the caller after it sees it.
    panic: UnsafeCell<Option<Box<dyn Any + Send>>>,
    thread: Thread,
}

// SAFETY: `job` and `panic` are only touched by one side at a time, as `state` hands them over
// (Release on the store that hands over, Acquire on the load that receives). (Send comes from
// the fields: a `Send` job and panic payload.)
unsafe impl Sync for Helper {}

struct Pool {
    /// The process that made the helpers: a forked child has none of them running.
    pid: u32,
    helpers: Vec<Arc<Helper>>,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// Runs every job once, in parallel where helpers are spinning, and returns when all have run.
/// `spin` zero runs them all here, in order. A job's panic is resumed here after every job has
/// finished (the jobs borrow the caller's stack, so none may outlive this call).
pub(crate) fn run(spin: Duration, jobs: &mut [Job<'_>]) {
    let Some((first, rest)) = jobs.split_first_mut() else {
        return;
    };
    // `try_lock`: a caller that finds the helpers busy with another caller's jobs does not
    // wait for them. (A poisoned pool, which only a fault in this function could leave, is
    // never used again: its helpers' states cannot be trusted.)
    let mut guard = match (spin.is_zero() || rest.is_empty(), POOL.try_lock()) {
        (false, Ok(g)) => Some(g),
        _ => None,
    };
    let helpers: &[Arc<Helper>] = match guard.as_deref_mut() {
        Some(pool) => grow(pool, rest.len().min(MAX_HELPERS)),
        None => &[],
    };
    let spin_ns = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX);
    let mut handed = 0u64;
    for (i, (job, h)) in rest.iter_mut().zip(helpers).enumerate() {
        h.spin_ns.store(spin_ns, Ordering::Relaxed);
        // SAFETY: the helper reads `job` only in POSTED, which only the CAS below publishes;
        // the erased lifetime ends before this function returns, because every handed job is
        // waited for below, panics included.
        unsafe {
            *h.job.get() = Some(std::mem::transmute::<Job<'_>, Job<'static>>(&mut **job));
        }
        match h
            .state
            .compare_exchange(IDLE, POSTED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => handed |= 1 << i,
            Err(_) => {
                // SAFETY: not published; the helper cannot see it.
                unsafe { *h.job.get() = None };
                // Parked: warm it for the next call; this job runs here.
                if h.state
                    .compare_exchange(COLD, IDLE, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    h.thread.unpark();
                }
            }
        }
    }
    let is_handed = |i: usize| i < helpers.len() && handed & (1 << i) != 0;
    let mut panicked = catch(first);
    for (i, job) in rest.iter_mut().enumerate() {
        if !is_handed(i) {
            let p = catch(job);
            panicked = panicked.or(p);
        }
    }
    for (i, h) in helpers.iter().enumerate() {
        if !is_handed(i) {
            continue;
        }
        while h.state.load(Ordering::Acquire) != DONE {
            std::hint::spin_loop();
        }
        // SAFETY: DONE was published after the helper wrote `panic` and let go of the job.
        let p = unsafe { (*h.panic.get()).take() };
        panicked = panicked.or(p);
        h.state.store(IDLE, Ordering::Release);
    }
    drop(guard);
    if let Some(p) = panicked {
        panic::resume_unwind(p);
    }
}

fn catch(job: &mut Job<'_>) -> Option<Box<dyn Any + Send>> {
    panic::catch_unwind(AssertUnwindSafe(job)).err()
}

/// The pool's first `n` helpers, made where missing (and all made again in a forked child).
fn grow(pool: &mut Option<Pool>, n: usize) -> &[Arc<Helper>] {
    let pid = std::process::id();
    if pool.as_ref().is_some_and(|p| p.pid != pid) {
        // The parent's threads do not exist here; their helpers would never answer.
        *pool = None;
    }
    let pool = pool.get_or_insert_with(|| Pool {
        pid,
        helpers: Vec::new(),
    });
    while pool.helpers.len() < n {
        match spawn(pool.helpers.len()) {
            Some(h) => pool.helpers.push(h),
            // No thread to be had: the caller runs the rest itself.
            None => break,
        }
    }
    &pool.helpers[..n.min(pool.helpers.len())]
}

fn spawn(index: usize) -> Option<Arc<Helper>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = thread::Builder::new()
        .name(format!("ferroccl-launch-{index}"))
        .spawn(move || {
            let Ok(h) = rx.recv() else { return };
            serve(h)
        })
        .ok()?;
    let h = Arc::new(Helper {
        // Spinning from the start: the call that made it can use it at once.
        state: AtomicU8::new(IDLE),
        spin_ns: AtomicU64::new(0),
        job: UnsafeCell::new(None),
        panic: UnsafeCell::new(None),
        thread: handle.thread().clone(),
    });
    tx.send(h.clone()).ok()?;
    Some(h)
}

/// A helper's life: run posted jobs, spin between them, park when none came for a while.
fn serve(h: Arc<Helper>) {
    let mut since = Instant::now();
    loop {
        match h.state.load(Ordering::Acquire) {
            POSTED => {
                // SAFETY: POSTED was published after the caller wrote the job; the caller waits
                // for DONE before its borrow ends.
                let job = unsafe { (*h.job.get()).take() };
                let p = job.and_then(|mut j| catch(&mut j));
                // SAFETY: the caller reads `panic` only after DONE.
                unsafe { *h.panic.get() = p };
                h.state.store(DONE, Ordering::Release);
                since = Instant::now();
            }
            IDLE if since.elapsed().as_nanos() >= u128::from(h.spin_ns.load(Ordering::Relaxed)) => {
                if h.state
                    .compare_exchange(IDLE, COLD, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    while h.state.load(Ordering::Acquire) == COLD {
                        thread::park();
                    }
                    since = Instant::now();
                }
            }
            _ => std::hint::spin_loop(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::thread::ThreadId;

    // Tests share the process's one pool; each takes this lock so that helpers' states are
    // what the test set up.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `n` jobs that each record the thread they ran on and bump their own counter.
    fn run_recording(spin: Duration, n: usize, runs: &[AtomicUsize]) -> Vec<ThreadId> {
        let mut on: Vec<Option<ThreadId>> = vec![None; n];
        {
            let mut closures: Vec<_> = on
                .iter_mut()
                .zip(runs)
                .map(|(slot, count)| {
                    move || {
                        *slot = Some(thread::current().id());
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                })
                .collect();
            let mut jobs: Vec<Job<'_>> = closures.iter_mut().map(|c| c as Job<'_>).collect();
            run(spin, &mut jobs);
        }
        on.into_iter().map(|t| t.expect("every job ran")).collect()
    }

    fn counters(n: usize) -> Vec<AtomicUsize> {
        (0..n).map(|_| AtomicUsize::new(0)).collect()
    }

    #[test]
    fn spinning_helpers_take_every_job_but_the_first() {
        let _s = serial();
        let spin = Duration::from_secs(1);
        let runs = counters(4);
        // The first call may find helpers parked by an earlier test: it warms them.
        run_recording(spin, 4, &runs);
        let on = run_recording(spin, 4, &runs);
        let me = thread::current().id();
        assert_eq!(on[0], me, "the first job runs on the caller");
        for t in &on[1..] {
            assert_ne!(*t, me, "a spinning helper takes the job");
        }
        let mut others = on[1..].to_vec();
        others.sort_by_key(|t| format!("{t:?}"));
        others.dedup();
        assert_eq!(others.len(), 3, "one helper per job");
        for c in &runs {
            assert_eq!(c.load(Ordering::Relaxed), 2, "each job ran once per call");
        }
    }

    #[test]
    fn no_spin_runs_everything_on_the_caller_in_order() {
        let _s = serial();
        let order = Mutex::new(Vec::new());
        let mut closures: Vec<_> = (0..5)
            .map(|i| {
                let order = &order;
                move || order.lock().unwrap().push((i, thread::current().id()))
            })
            .collect();
        let mut jobs: Vec<Job<'_>> = closures.iter_mut().map(|c| c as Job<'_>).collect();
        run(Duration::ZERO, &mut jobs);
        let got = order.into_inner().unwrap();
        let me = thread::current().id();
        assert_eq!(
            got.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        assert!(got.iter().all(|(_, t)| *t == me));
    }

    #[test]
    fn a_parked_helper_is_not_waited_for_and_is_warmed_for_the_next_call() {
        let _s = serial();
        let short = Duration::from_micros(1);
        let runs = counters(2);
        run_recording(short, 2, &runs);
        // Far past the helper's spin: it parks.
        let parked = |h: &Helper| h.state.load(Ordering::Acquire) == COLD;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !POOL
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|p| parked(&p.helpers[0]))
        {
            assert!(Instant::now() < deadline, "the helper never parked");
            thread::sleep(Duration::from_millis(1));
        }
        let long = Duration::from_secs(1);
        let on = run_recording(long, 2, &runs);
        assert!(
            on.iter().all(|t| *t == thread::current().id()),
            "ran here, not waited for"
        );
        // Warmed: the call after takes it.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let on = run_recording(long, 2, &runs);
            if on[1] != thread::current().id() {
                break;
            }
            assert!(Instant::now() < deadline, "the helper never came back");
        }
    }

    #[test]
    fn a_helpers_panic_reaches_the_caller_after_every_job_ran_and_the_helper_stays() {
        let _s = serial();
        let spin = Duration::from_secs(1);
        let runs = counters(3);
        run_recording(spin, 3, &runs);
        let ran = AtomicUsize::new(0);
        let mut a = || {
            ran.fetch_add(1, Ordering::SeqCst);
        };
        let mut b = || panic!("job b fails");
        let mut c = || {
            thread::sleep(Duration::from_millis(20));
            ran.fetch_add(1, Ordering::SeqCst);
        };
        let mut jobs: Vec<Job<'_>> = vec![&mut a, &mut b, &mut c];
        let err = panic::catch_unwind(AssertUnwindSafe(|| run(spin, &mut jobs))).unwrap_err();
        assert_eq!(err.downcast_ref::<&str>(), Some(&"job b fails"));
        assert_eq!(
            ran.load(Ordering::SeqCst),
            2,
            "the other jobs finished before the panic came back"
        );
        let on = run_recording(spin, 3, &runs);
        assert_ne!(
            on[1],
            thread::current().id(),
            "the helper that panicked still serves"
        );
    }

    #[test]
    fn callers_on_several_threads_each_run_all_their_jobs_once() {
        let _s = serial();
        let spin = Duration::from_millis(1);
        let total = AtomicUsize::new(0);
        thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        let mut closures: Vec<_> = (0..3)
                            .map(|_| {
                                || {
                                    total.fetch_add(1, Ordering::Relaxed);
                                }
                            })
                            .collect();
                        let mut jobs: Vec<Job<'_>> =
                            closures.iter_mut().map(|c| c as Job<'_>).collect();
                        run(spin, &mut jobs);
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 3);
    }

    #[test]
    fn more_jobs_than_helpers_may_serve_still_all_run() {
        let _s = serial();
        let n = MAX_HELPERS + 3;
        let runs = counters(n);
        run_recording(Duration::from_millis(1), n, &runs);
        assert!(runs.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }
}
