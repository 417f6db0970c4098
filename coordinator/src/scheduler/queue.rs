//! The queue of jobs waiting for placement: priorities, fair share across
//! accounts, a bound on its size.
//!
//! # Order
//! Two kinds of priority:
//! - **Levels**, set by the coordinator, never by clients: a higher level
//!   goes first, strictly (requeued jobs resuming a client's interrupted
//!   stream use one).
//! - **Ranks**, a client's job priority (0 to [`MAX_RANK`]): within one
//!   level they order only the submitting account's own jobs (higher rank
//!   first, then submission order). They do not change whose turn it is, so
//!   no rank can take a placement from another account, and ranks are free.
//!
//! Within a level, accounts take turns round-robin and each account offers
//! its jobs in rank, then submission order. A pass offers
//! each account's jobs in turn; a job that cannot be placed now is passed
//! over for this pass (smaller jobs behind it may go), and the account keeps
//! its turn for its next job. An account served moves to the back of the
//! ring, and the ring persists across passes.
//!
//! # Fair share bound
//! Within one priority, between two placements for an account, every other
//! account that had a placeable job at its turn received one. So two accounts
//! continuously backlogged with jobs of the same shape differ by at most one
//! placement, at every moment, however many jobs either submitted.
//!
//! # Invariants
//! - `len() <= capacity()`: a push beyond it fails with
//!   [`QueueError::Full`] and changes nothing.
//! - Every job pushed is returned by exactly one pass, or is still queued.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// Highest client rank (job priority).
pub const MAX_RANK: u8 = 3;

/// Why a job was not queued.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueError {
    #[error("the queue is full ({capacity} jobs waiting); try again later")]
    Full { capacity: usize },
}

/// What the placement callback did with one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    Placed,
    /// Cannot go now; stays queued.
    Blocked,
}

#[derive(Debug)]
struct Level<T> {
    /// Accounts with queued jobs, next to serve first.
    ring: VecDeque<String>,
    /// Per account: (rank, job), highest rank first, then oldest first.
    jobs: HashMap<String, VecDeque<(u8, T)>>,
}

impl<T> Default for Level<T> {
    fn default() -> Self {
        Level {
            ring: VecDeque::new(),
            jobs: HashMap::new(),
        }
    }
}

/// A bounded queue with priorities and fair share.
#[derive(Debug)]
pub struct Queue<T> {
    capacity: usize,
    len: usize,
    /// Keyed by `u8::MAX - priority`, so iteration is highest first.
    levels: BTreeMap<u8, Level<T>>,
}

impl<T> Queue<T> {
    pub fn new(capacity: usize) -> Self {
        Queue {
            capacity,
            len: 0,
            levels: BTreeMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Queues `job` for `account` at `priority` (a level: higher goes
    /// first), rank 0.
    pub fn push(&mut self, account: &str, priority: u8, job: T) -> Result<(), QueueError> {
        self.push_ranked(account, priority, 0, job)
    }

    /// Queues `job` for `account` at level `priority` with the client's
    /// `rank` (clamped to [`MAX_RANK`]): it goes after the account's jobs of
    /// the same or a higher rank and before its lower-ranked ones.
    pub fn push_ranked(
        &mut self,
        account: &str,
        priority: u8,
        rank: u8,
        job: T,
    ) -> Result<(), QueueError> {
        let rank = rank.min(MAX_RANK);
        if self.len >= self.capacity {
            return Err(QueueError::Full {
                capacity: self.capacity,
            });
        }
        let level = self.levels.entry(u8::MAX - priority).or_default();
        let jobs = match level.jobs.get_mut(account) {
            Some(j) => j,
            None => {
                level.ring.push_back(account.to_owned());
                level.jobs.entry(account.to_owned()).or_default()
            }
        };
        let at = jobs
            .iter()
            .position(|(r, _)| *r < rank)
            .unwrap_or(jobs.len());
        jobs.insert(at, (rank, job));
        self.len += 1;
        Ok(())
    }

    /// One placement pass: offers jobs in priority and fair-share order to
    /// `offer` until no account has a job left to offer. Returns the placed
    /// jobs, in the order they were placed.
    pub fn pass(&mut self, mut offer: impl FnMut(&T) -> Offer) -> Vec<T> {
        let mut placed = Vec::new();
        for level in self.levels.values_mut() {
            // Per account: how many of its leading jobs were blocked this pass.
            let mut tried: HashMap<String, usize> = HashMap::new();
            loop {
                let mut progress = false;
                let round: Vec<String> = level.ring.iter().cloned().collect();
                for account in round {
                    let Some(jobs) = level.jobs.get_mut(&account) else {
                        continue;
                    };
                    let skip = tried.entry(account.clone()).or_insert(0);
                    let mut hit = None;
                    while *skip < jobs.len() {
                        if offer(&jobs[*skip].1) == Offer::Placed {
                            hit = Some(*skip);
                            break;
                        }
                        *skip += 1;
                    }
                    let Some(i) = hit else { continue };
                    if let Some((_, job)) = jobs.remove(i) {
                        placed.push(job);
                        self.len -= 1;
                    }
                    progress = true;
                    let empty = jobs.is_empty();
                    if let Some(pos) = level.ring.iter().position(|a| *a == account) {
                        level.ring.remove(pos);
                    }
                    if empty {
                        level.jobs.remove(&account);
                    } else {
                        level.ring.push_back(account);
                    }
                }
                if !progress {
                    break;
                }
            }
        }
        self.levels.retain(|_, l| !l.jobs.is_empty());
        placed
    }

    /// Removes every job `pred` matches (cancelled, for instance).
    pub fn remove_where(&mut self, mut pred: impl FnMut(&T) -> bool) -> usize {
        let mut removed = 0;
        for level in self.levels.values_mut() {
            for jobs in level.jobs.values_mut() {
                let before = jobs.len();
                jobs.retain(|(_, j)| !pred(j));
                removed += before - jobs.len();
            }
            level.jobs.retain(|_, j| !j.is_empty());
            let jobs = &level.jobs;
            level.ring.retain(|a| jobs.contains_key(a));
        }
        self.levels.retain(|_, l| !l.jobs.is_empty());
        self.len -= removed;
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn higher_priority_first_then_round_robin_across_accounts() {
        let mut q = Queue::new(100);
        for i in 0..5 {
            q.push("alice", 0, format!("a{i}")).unwrap();
        }
        q.push("bob", 0, "b0".to_string()).unwrap();
        q.push("bob", 0, "b1".to_string()).unwrap();
        q.push("carol", 3, "c0".to_string()).unwrap();
        let placed = q.pass(|_| Offer::Placed);
        assert_eq!(placed, ["c0", "a0", "b0", "a1", "b1", "a2", "a3", "a4"]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_rank_reorders_only_its_own_accounts_jobs() {
        let mut q = Queue::new(100);
        q.push_ranked("alice", 0, 0, "a0").unwrap();
        q.push_ranked("alice", 0, 0, "a1").unwrap();
        q.push_ranked("bob", 0, 0, "b0").unwrap();
        q.push_ranked("bob", 0, 0, "b1").unwrap();
        // Bob's urgent jobs jump his own queue, in submission order among
        // themselves, but Alice still gets every other turn.
        q.push_ranked("bob", 0, 3, "b-urgent").unwrap();
        q.push_ranked("bob", 0, 1, "b-soon").unwrap();
        q.push_ranked("bob", 0, 3, "b-urgent2").unwrap();
        q.push_ranked("alice", 0, 9, "a-clamped").unwrap();
        let placed = q.pass(|_| Offer::Placed);
        assert_eq!(
            placed,
            [
                "a-clamped",
                "b-urgent",
                "a0",
                "b-urgent2",
                "a1",
                "b-soon",
                "b0",
                "b1"
            ]
        );
    }

    #[test]
    fn ranks_cannot_starve_another_account() {
        // One account floods the queue at the top rank; another submits at
        // rank 0. Placements alternate while both have jobs.
        let mut q = Queue::new(1000);
        for i in 0..200 {
            q.push_ranked("flood", 0, MAX_RANK, ("flood", i)).unwrap();
        }
        for i in 0..20 {
            q.push_ranked("modest", 0, 0, ("modest", i)).unwrap();
        }
        let mut budget = 40;
        let placed = q.pass(|_| {
            if budget == 0 {
                return Offer::Blocked;
            }
            budget -= 1;
            Offer::Placed
        });
        let modest = placed.iter().filter(|(a, _)| *a == "modest").count();
        assert_eq!(modest, 20, "every other placement was the modest account's");
        assert!(placed.chunks(2).all(|pair| pair[0].0 != pair[1].0));
    }

    #[test]
    fn a_full_queue_refuses_and_keeps_what_it_has() {
        let mut q = Queue::new(2);
        q.push("a", 0, 1).unwrap();
        q.push("b", 0, 2).unwrap();
        assert_eq!(q.push("a", 9, 3), Err(QueueError::Full { capacity: 2 }));
        assert_eq!(q.len(), 2);
        assert_eq!(
            QueueError::Full { capacity: 2 }.to_string(),
            "the queue is full (2 jobs waiting); try again later"
        );
    }

    #[test]
    fn blocked_jobs_stay_and_smaller_ones_behind_them_go() {
        let mut q = Queue::new(10);
        for size in [50, 10, 60, 5] {
            q.push("a", 0, size).unwrap();
        }
        let mut room = 20;
        let placed = q.pass(|&s| {
            if s <= room {
                room -= s;
                Offer::Placed
            } else {
                Offer::Blocked
            }
        });
        assert_eq!(placed, [10, 5]);
        assert_eq!(q.len(), 2);
        assert_eq!(q.remove_where(|&s| s == 60), 1);
        assert_eq!(q.pass(|_| Offer::Placed), [50]);
        assert!(q.is_empty());
    }
}
