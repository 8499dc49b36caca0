//! What one communicator knows about its peers' liveness. The heartbeat thread (`watch`)
//! writes it; every wait of the communicator (executor, bootstrap collectives, connection
//! setup) reads it, so that a death anywhere in the job ends waits everywhere.

use ferroccl_core::{Error, Rank};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

#[derive(Default)]
struct State {
    /// Ranks whose process is gone or silent.
    dead: BTreeSet<Rank>,
    /// Ranks that aborted their communicator (alive, but out of this communicator).
    aborted: BTreeSet<Rank>,
    /// Ranks that destroyed their communicator cleanly: not a failure, but they will never
    /// take part in an operation again.
    left: BTreeSet<Rank>,
    /// The first failure, as reported (names the rank, its host, pid and address).
    first: Option<String>,
    /// The other ranks declared this rank dead (it was stopped or starved past their patience,
    /// or cut off): what they said, worded for this rank. It outranks everything else this
    /// rank sees, which is the others closing their connections and reporting its death.
    declared_dead: Option<String>,
}

/// Run once when the communicator first learns of a failure.
type Hook = std::sync::Arc<dyn Fn() + Send + Sync>;

#[derive(Default)]
pub(crate) struct Health {
    failed: AtomicBool,
    state: Mutex<State>,
    hooks: Mutex<Vec<Hook>>,
}

impl Health {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is a single insert; a panic cannot leave State inconsistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `rank` died; `why` names it and says how we know. True if it is news.
    pub fn report_dead(&self, rank: Rank, why: &str) -> bool {
        self.report(rank, why, true)
    }

    /// Records that `rank` aborted its communicator. True if it is news.
    pub fn report_aborted(&self, rank: Rank, why: &str) -> bool {
        self.report(rank, why, false)
    }

    /// Records that the other ranks declared this rank dead; `why` says so for this rank's
    /// user. True if it is news.
    pub fn report_declared_dead(&self, why: String) -> bool {
        let mut st = self.lock();
        if st.declared_dead.is_some() {
            return false;
        }
        tracing::warn!("{why}");
        st.first.get_or_insert_with(|| why.clone());
        st.declared_dead = Some(why);
        drop(st);
        self.failed_now();
        true
    }

    /// Whether the other ranks declared this rank dead: then the connections they close are
    /// their goodbye to us, not news of their death.
    pub fn is_declared_dead(&self) -> bool {
        self.lock().declared_dead.is_some()
    }

    fn report(&self, rank: Rank, why: &str, dead: bool) -> bool {
        let mut st = self.lock();
        let new = if dead {
            st.dead.insert(rank)
        } else {
            !st.dead.contains(&rank) && st.aborted.insert(rank)
        };
        if new {
            st.first.get_or_insert_with(|| why.to_string());
            tracing::warn!("{why}");
        }
        drop(st);
        if new {
            self.failed_now();
        }
        new
    }

    /// Marks the communicator failed; the first time, runs the hooks.
    fn failed_now(&self) {
        if !self.failed.swap(true, Ordering::AcqRel) {
            let hooks: Vec<Hook> = self.hooks.lock().unwrap_or_else(|p| p.into_inner()).clone();
            hooks.iter().for_each(|h| h());
        }
    }

    /// Runs `hook` when the first failure is reported (at once if one already was): what must
    /// react without anyone waiting, such as kernels spinning on a peer that died.
    pub fn on_failure(&self, hook: impl Fn() + Send + Sync + 'static) {
        let hook: Hook = std::sync::Arc::new(hook);
        self.hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook.clone());
        if self.is_failed() {
            hook();
        }
    }

    /// Records that `rank` destroyed its communicator. True if it is news.
    pub fn report_left(&self, rank: Rank) -> bool {
        self.lock().left.insert(rank)
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The failure every wait of the communicator reports, with what the caller can do.
    pub fn failure(&self) -> Option<Error> {
        if !self.is_failed() {
            return None;
        }
        let st = self.lock();
        if let Some(why) = &st.declared_dead {
            // No shrink to suggest: the others have shrunk (or will) without this rank.
            return Some(Error::Remote(format!(
                "{why}; this communicator cannot be used here any more and this rank cannot rejoin it: drop it"
            )));
        }
        let first = st.first.as_deref().unwrap_or("a peer failed");
        // Ranks that died or aborted take no further part: the others can go on without them.
        let gone: BTreeSet<Rank> = st.dead.iter().chain(&st.aborted).copied().collect();
        let advice = if gone.is_empty() {
            "the communicator cannot be used any more: drop it (or abort it) on every rank"
                .to_string()
        } else {
            let gone: Vec<Rank> = gone.into_iter().collect();
            let what = if st.aborted.iter().all(|r| st.dead.contains(r)) {
                "dead"
            } else {
                "failed"
            };
            format!(
                "the communicator cannot be used any more: drop it, or call shrink(&{gone:?}) on every surviving rank \
                 to continue without the {what} rank(s)"
            )
        };
        Some(Error::Remote(format!("{first}; {advice}")))
    }

    /// Why `rank` will never send again (it died or aborted), if we know. A rank that left
    /// cleanly is not included: the data it sent before leaving may still be on its way on
    /// another connection than the goodbye, and its connections' own close says when it ends.
    pub fn gone(&self, rank: Rank) -> Option<&'static str> {
        let st = self.lock();
        if st.dead.contains(&rank) {
            Some("died")
        } else if st.aborted.contains(&rank) {
            Some("aborted its communicator")
        } else {
            None
        }
    }

    pub fn dead(&self) -> Vec<Rank> {
        self.lock().dead.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_hooks_run_once_at_the_first_failure_or_at_once_if_late() {
        use std::sync::atomic::AtomicUsize;
        use std::sync::Arc;
        let h = Health::default();
        let early = Arc::new(AtomicUsize::new(0));
        let e = early.clone();
        h.on_failure(move || {
            e.fetch_add(1, Ordering::SeqCst);
        });
        h.report_left(3);
        assert_eq!(
            early.load(Ordering::SeqCst),
            0,
            "a clean leave is no failure"
        );
        assert!(h.report_aborted(1, "rank 1 aborted"));
        // An aborted rank takes no further part either: the others may shrink it out.
        let msg = h.failure().unwrap().to_string();
        assert!(
            msg.contains("rank 1 aborted")
                && msg.contains("shrink(&[1])")
                && msg.contains("failed rank(s)"),
            "{msg}"
        );
        assert!(h.report_dead(2, "rank 2 died"));
        assert_eq!(
            early.load(Ordering::SeqCst),
            1,
            "once, at the first failure"
        );
        let late = Arc::new(AtomicUsize::new(0));
        let l = late.clone();
        h.on_failure(move || {
            l.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(
            late.load(Ordering::SeqCst),
            1,
            "registered after the failure: run at once"
        );
    }

    #[test]
    fn being_declared_dead_outranks_every_other_report_and_suggests_no_shrink() {
        let h = Health::default();
        assert!(h.report_dead(1, "rank 1 died: its heartbeat connection closed"));
        assert!(!h.is_declared_dead());
        assert!(h.report_declared_dead(
            "this rank, rank 2, was declared dead by the other ranks".into()
        ));
        assert!(!h.report_declared_dead("again".into()));
        assert!(h.is_declared_dead() && h.is_failed());
        let msg = h.failure().unwrap().to_string();
        assert!(
            msg.contains("this rank, rank 2, was declared dead") && msg.contains("cannot rejoin"),
            "{msg}"
        );
        assert!(
            !msg.contains("shrink") && !msg.contains("rank 1 died"),
            "{msg}"
        );
    }

    #[test]
    fn first_report_wins_and_dead_outranks_aborted() {
        let h = Health::default();
        assert!(h.failure().is_none() && !h.is_failed());
        assert!(h.report_left(3) && !h.report_left(3));
        assert!(!h.is_failed(), "a clean goodbye is not a failure");
        assert!(
            h.gone(3).is_none(),
            "data sent before a goodbye may still be on its way"
        );
        assert!(h.report_aborted(1, "rank 1 aborted"));
        // An aborted rank takes no further part either: the others may shrink it out.
        let msg = h.failure().unwrap().to_string();
        assert!(
            msg.contains("rank 1 aborted")
                && msg.contains("shrink(&[1])")
                && msg.contains("failed rank(s)"),
            "{msg}"
        );
        assert!(h.report_dead(2, "rank 2 died"));
        assert!(!h.report_dead(2, "rank 2 died again"));
        assert!(h.report_dead(1, "rank 1 died after all"));
        assert!(!h.report_aborted(1, "too late"));
        let msg = h.failure().unwrap().to_string();
        assert!(
            msg.contains("rank 1 aborted") && msg.contains("shrink(&[1, 2])"),
            "{msg}"
        );
        assert_eq!(h.dead(), vec![1, 2]);
        assert_eq!(h.gone(2), Some("died"));
        assert_eq!(h.gone(0), None);
    }
}
