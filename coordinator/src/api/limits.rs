//! Abuse limits of the client listeners: a global in-flight cap that sheds
//! overload at once, a separate cap for calls that need no key, and
//! per-API-key request-rate and in-flight caps.
//!
//! Every gRPC request but the health check takes a [`Permit`] before its
//! handler runs ([`Admission::admit_anonymous`] for a method that needs a
//! key, [`Admission::admit_public`] for one that does not; called by
//! [`super::auth`]); the
//! permit lives until the response body has been sent (a Watch stream keeps
//! its permit while it is open), see [`crate::util::net::Held`]. A request that finds no room is
//! answered RESOURCE_EXHAUSTED at once, without touching the database: the
//! server never queues work without bound.
//!
//! # Invariants
//! - At most `limits.max_in_flight_requests` admitted requests exist at any
//!   time, and at most a key's `max_in_flight` for that key; the counts are
//!   taken and released under one lock, so they can never be exceeded, and
//!   a dropped permit (finished, failed or cancelled request) always
//!   releases its share.
//! - A key's rate is a token bucket: `requests_per_sec` refill, a burst of
//!   twice that (at least 1), full again when the key's limit changes. A
//!   refused request takes no token.
//! - A call that needs no key (Models, Network, reflection) never holds one
//!   of the `max_in_flight_requests` slots: it takes one of
//!   `limits.max_public_in_flight`, so unauthenticated callers holding
//!   streams or slow calls open cannot starve authenticated ones.
//! - A call that needs a key takes its global slot only once its key is
//!   known. A key this replica knows (its key cache) is checked without the
//!   database; any other is looked up holding a slot of
//!   `limits.max_key_lookups_in_flight`, never a global one (as many more
//!   wait in line, the rest are refused at once), so a flood of made-up
//!   keys (each a database lookup) is bounded by that small cap and cannot
//!   take the slots of known keys. A call that finds no global slot
//!   free is refused before its key is looked up.
//! - Per-key state is bounded: entries of idle keys are dropped when the map
//!   holds more than [`MAX_TRACKED_KEYS`].
//!
//! # Failure
//! [`Refused`], mapped once to RESOURCE_EXHAUSTED with a message saying
//! which limit and its value.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Instant,
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use serde::Deserialize;

use crate::{api::error::ApiError, domain::Caller, util::lock};

/// Bounds on client input and on queued work.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Bytes of prompt text (sum of message contents for chat).
    pub max_prompt_bytes: usize,
    /// Largest `max_tokens` a job may ask for.
    pub max_tokens: u32,
    /// `max_tokens` used when a job asks for 0.
    pub default_max_tokens: u32,
    /// Largest gRPC request message the server decodes.
    pub max_request_bytes: usize,
    /// Submit is refused with RESOURCE_EXHAUSTED beyond this many queued jobs.
    pub max_queued_jobs: u64,
    /// Attempts per job before it fails for good.
    pub max_attempts: u32,
    /// Stop strings per job, and bytes per stop string.
    pub max_stop_strings: usize,
    pub max_stop_bytes: usize,
    /// Chat messages per job.
    pub max_chat_messages: usize,
    /// gRPC requests in flight at once (all keys); more are refused with
    /// RESOURCE_EXHAUSTED at once .
    pub max_in_flight_requests: usize,
    /// Requests to methods that need no key (Models, Network, reflection)
    /// in flight at once; more are refused with RESOURCE_EXHAUSTED at once.
    /// Counted apart from `max_in_flight_requests`, so unauthenticated
    /// callers cannot take the slots of authenticated ones.
    pub max_public_in_flight: usize,
    /// API keys looked up in the database at once (keys this replica does
    /// not know yet: new, expired from its cache, or made up); as many more
    /// wait in line, and past that they are refused with RESOURCE_EXHAUSTED
    /// at once. A lookup holds one of these slots, never one of
    /// `max_in_flight_requests`, so a flood of made-up keys cannot take the
    /// slots of callers whose keys are known. Keep it below the store's
    /// `max_connections`.
    pub max_key_lookups_in_flight: usize,
    /// Requests per second per API key (burst: twice that), unless the key
    /// has its own limit. 0 = unlimited.
    pub key_requests_per_sec: u32,
    /// Requests (open Watch streams included) in flight per API key, unless
    /// the key has its own limit. 0 = unlimited.
    pub key_max_in_flight: u32,
    /// Open connections per TCP listener (gRPC, HTTP); more are closed at
    /// accept.
    pub max_connections: usize,
    /// A gRPC request must be read and answered (a stream: started) within
    /// this; an HTTP request's headers must arrive within it.
    pub request_timeout_ms: u64,
    /// Largest HTTP request body (the HTTP API reads none larger); checked
    /// on `content-length` before anything is read.
    pub max_http_body_bytes: usize,
    /// HTTP requests in flight at once; more get 429.
    pub max_http_in_flight: usize,
    /// Node-link connections (QUIC) at once, handshakes included.
    pub max_node_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_prompt_bytes: 64 * 1024,
            max_tokens: 4096,
            default_max_tokens: 256,
            max_request_bytes: 1 << 20,
            max_queued_jobs: 10_000,
            max_attempts: 3,
            max_stop_strings: 8,
            max_stop_bytes: 64,
            max_chat_messages: 64,
            max_in_flight_requests: 512,
            max_public_in_flight: 64,
            max_key_lookups_in_flight: 8,
            key_requests_per_sec: 200,
            key_max_in_flight: 64,
            max_connections: 4096,
            request_timeout_ms: 30_000,
            max_http_body_bytes: 64 * 1024,
            max_http_in_flight: 256,
            max_node_connections: 10_000,
        }
    }
}

/// Per-key entries kept before idle ones are dropped.
pub const MAX_TRACKED_KEYS: usize = 100_000;

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    #[error("the coordinator is overloaded ({0} requests in flight); retry later")]
    Overloaded(usize),
    #[error(
        "the coordinator is overloaded ({0} requests without an API key in flight); \
         retry later"
    )]
    PublicOverloaded(usize),
    #[error(
        "the coordinator is overloaded ({0} API keys being checked, as many waiting); \
         retry later"
    )]
    LookupsBusy(usize),
    #[error("this API key's rate limit of {0} requests/s is exceeded; retry later")]
    RateLimited(u32),
    #[error("this API key already has {0} requests in flight (its limit); retry when one ends")]
    TooManyInFlight(u32),
}

impl From<Refused> for ApiError {
    fn from(r: Refused) -> Self {
        ApiError::ResourceExhausted(r.to_string())
    }
}

/// Limits of one key after its own settings and the config defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyQuota {
    /// 0 = unlimited.
    pub requests_per_sec: u32,
    /// 0 = unlimited.
    pub max_in_flight: u32,
}

#[derive(Debug)]
struct KeyState {
    /// The rate the bucket was filled for; a changed limit starts full.
    rate: u32,
    tokens: f64,
    refilled: Instant,
    in_flight: u32,
    /// Highest `in_flight` ever seen (what the limit tests check).
    peak: u32,
}

/// The admission controller of one listener.
#[derive(Debug)]
pub struct Admission {
    global: Arc<Semaphore>,
    global_max: usize,
    /// Slots of calls that need no key (apart from `global`).
    public: Arc<Semaphore>,
    public_max: usize,
    /// Slots of key lookups in the database (apart from `global`).
    lookups: Arc<Semaphore>,
    lookups_max: usize,
    /// Lookups waiting for a slot of `lookups` (at most `lookups_max`).
    lookups_waiting: Arc<std::sync::atomic::AtomicUsize>,
    defaults: KeyQuota,
    keys: Arc<Mutex<HashMap<String, KeyState>>>,
    queue: QueueDepth,
    /// Most admitted requests ever in flight at once.
    peak: std::sync::atomic::AtomicUsize,
}

/// How long a counted queue depth is used before it is counted again.
pub const QUEUE_RECOUNT: std::time::Duration = std::time::Duration::from_millis(250);

/// The queue depth Submit checks against `limits.max_queued_jobs`, without a
/// COUNT query per submit: the last count plus the submits accepted since,
/// recounted at most every [`QUEUE_RECOUNT`] by one caller while the others
/// use the estimate. It never undercounts by more than the submits in flight
/// (at most `limits.max_in_flight_requests`), so the queue bound holds to
/// within that.
#[derive(Debug)]
struct QueueDepth {
    state: Mutex<(u64, Option<Instant>)>,
    counting: tokio::sync::Mutex<()>,
}

/// What an admitted request holds until its response is sent.
#[derive(Debug)]
pub struct Permit {
    /// A slot of the global cap, or of the public one.
    _global: Option<OwnedSemaphorePermit>,
    key: Option<KeyPermit>,
}

#[derive(Debug)]
struct KeyPermit {
    keys: Arc<Mutex<HashMap<String, KeyState>>>,
    key_id: String,
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        if let Some(s) = lock(&self.keys).get_mut(&self.key_id) {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
    }
}

impl Admission {
    pub fn new(limits: &Limits) -> Self {
        let global_max = limits.max_in_flight_requests.max(1);
        let public_max = limits.max_public_in_flight.max(1);
        let lookups_max = limits.max_key_lookups_in_flight.max(1);
        Self {
            global: Arc::new(Semaphore::new(global_max)),
            global_max,
            public: Arc::new(Semaphore::new(public_max)),
            public_max,
            lookups: Arc::new(Semaphore::new(lookups_max)),
            lookups_max,
            lookups_waiting: Arc::default(),
            defaults: KeyQuota {
                requests_per_sec: limits.key_requests_per_sec,
                max_in_flight: limits.key_max_in_flight,
            },
            keys: Arc::default(),
            queue: QueueDepth {
                state: Mutex::new((0, None)),
                counting: tokio::sync::Mutex::new(()),
            },
            peak: Default::default(),
        }
    }

    /// Jobs queued now (see [`QueueDepth`]); `count` asks the store.
    pub async fn queued<F, Fut, E>(&self, count: F) -> Result<u64, E>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<u64, E>>,
    {
        let (estimate, counted) = *lock(&self.queue.state);
        let fresh = counted.is_some_and(|t| t.elapsed() < QUEUE_RECOUNT);
        if fresh {
            return Ok(estimate);
        }
        // One recount at a time; meanwhile others use the last estimate.
        let Ok(_counting) = self.queue.counting.try_lock() else {
            if counted.is_some() {
                return Ok(estimate);
            }
            let _wait = self.queue.counting.lock().await;
            return Ok(lock(&self.queue.state).0);
        };
        let started = Instant::now();
        let n = count().await?;
        // Submits accepted while counting may or may not be in `n`; keep
        // the larger view so the bound errs on the safe side.
        let mut state = lock(&self.queue.state);
        let since = state.0.saturating_sub(estimate);
        *state = (n + since, Some(started));
        Ok(state.0)
    }

    /// Counts one accepted submit into the queue estimate.
    pub fn note_queued(&self) {
        lock(&self.queue.state).0 += 1;
    }

    /// The quota of `caller`: its key's own limits, else the defaults.
    pub fn quota(&self, caller: &Caller) -> KeyQuota {
        KeyQuota {
            requests_per_sec: caller
                .limits
                .requests_per_sec
                .unwrap_or(self.defaults.requests_per_sec),
            max_in_flight: caller
                .limits
                .max_in_flight
                .unwrap_or(self.defaults.max_in_flight),
        }
    }

    /// A slot under the cap of calls that need no key, or
    /// [`Refused::PublicOverloaded`]; never one of the global slots.
    pub fn admit_public(&self) -> Result<Permit, Refused> {
        let public = Arc::clone(&self.public)
            .try_acquire_owned()
            .map_err(|_| Refused::PublicOverloaded(self.public_max))?;
        Ok(Permit {
            _global: Some(public),
            key: None,
        })
    }

    /// A slot of the cap of key lookups, held while a key this replica does
    /// not know is looked up in the database. When none is free, the call
    /// waits in line (first come, first served), but only behind as many
    /// others as there are slots; past that, [`Refused::LookupsBusy`]. (A
    /// burst of calls with one new good key: the first ones look it up,
    /// the ones in line then find it known.)
    pub async fn admit_lookup(&self) -> Result<OwnedSemaphorePermit, Refused> {
        use std::sync::atomic::Ordering;
        if let Ok(p) = Arc::clone(&self.lookups).try_acquire_owned() {
            return Ok(p);
        }
        let busy = || Refused::LookupsBusy(self.lookups_max);
        let waiting = Arc::clone(&self.lookups_waiting);
        if waiting.fetch_add(1, Ordering::SeqCst) >= self.lookups_max {
            waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(busy());
        }
        let got = Arc::clone(&self.lookups).acquire_owned().await;
        waiting.fetch_sub(1, Ordering::SeqCst);
        got.map_err(|_| busy())
    }

    /// [`Refused::Overloaded`] when no global slot is free now: checked
    /// before a key is looked up, so overload is shed before the database
    /// is asked.
    pub fn shed_overload(&self) -> Result<(), Refused> {
        if self.global.available_permits() == 0 {
            return Err(Refused::Overloaded(self.global_max));
        }
        Ok(())
    }

    /// A slot under the global cap for a request that needs a key, taken
    /// once its key is known, or [`Refused::Overloaded`].
    pub fn admit_anonymous(&self) -> Result<Permit, Refused> {
        let global = Arc::clone(&self.global)
            .try_acquire_owned()
            .map_err(|_| Refused::Overloaded(self.global_max))?;
        self.peak
            .fetch_max(self.in_flight(), std::sync::atomic::Ordering::Relaxed);
        Ok(Permit {
            _global: Some(global),
            key: None,
        })
    }

    /// Adds `caller`'s key to an anonymous permit: takes one rate token and
    /// one in-flight slot of the key, or refuses (taking neither).
    pub fn admit_key(&self, permit: &mut Permit, caller: &Caller) -> Result<(), Refused> {
        let quota = self.quota(caller);
        let now = Instant::now();
        let mut keys = lock(&self.keys);
        if keys.len() >= MAX_TRACKED_KEYS && !keys.contains_key(&caller.key_id) {
            keys.retain(|_, s| s.in_flight > 0);
        }
        let burst = f64::from(quota.requests_per_sec.saturating_mul(2).max(1));
        let state = keys
            .entry(caller.key_id.clone())
            .or_insert_with(|| KeyState {
                rate: quota.requests_per_sec,
                tokens: burst,
                refilled: now,
                in_flight: 0,
                peak: 0,
            });
        if quota.max_in_flight > 0 && state.in_flight >= quota.max_in_flight {
            return Err(Refused::TooManyInFlight(quota.max_in_flight));
        }
        if state.rate != quota.requests_per_sec {
            state.rate = quota.requests_per_sec;
            state.tokens = burst;
            state.refilled = now;
        }
        if quota.requests_per_sec > 0 {
            let elapsed = now.duration_since(state.refilled).as_secs_f64();
            state.tokens = (state.tokens + elapsed * f64::from(quota.requests_per_sec)).min(burst);
            state.refilled = now;
            if state.tokens < 1.0 {
                return Err(Refused::RateLimited(quota.requests_per_sec));
            }
            state.tokens -= 1.0;
        }
        state.in_flight += 1;
        state.peak = state.peak.max(state.in_flight);
        permit.key = Some(KeyPermit {
            keys: Arc::clone(&self.keys),
            key_id: caller.key_id.clone(),
        });
        Ok(())
    }

    /// Requests of `key_id` in flight now, and the most there ever were.
    pub fn key_in_flight(&self, key_id: &str) -> (u32, u32) {
        lock(&self.keys)
            .get(key_id)
            .map(|s| (s.in_flight, s.peak))
            .unwrap_or_default()
    }

    /// Admitted requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.global_max - self.global.available_permits()
    }

    /// Most admitted requests ever in flight at once.
    pub fn peak_in_flight(&self) -> usize {
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod lookup_flood_tests;
#[cfg(test)]
mod public_tests;
#[cfg(test)]
mod server_tests;
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::keys::{KeyLimits, Scopes};

    fn caller(key: &str, limits: KeyLimits) -> Caller {
        Caller {
            account_id: "acct".into(),
            key_id: key.into(),
            scopes: Scopes::ALL,
            limits,
            expires_at_ms: None,
        }
    }

    fn admission(global: usize, rate: u32, in_flight: u32) -> Admission {
        Admission::new(&Limits {
            max_in_flight_requests: global,
            key_requests_per_sec: rate,
            key_max_in_flight: in_flight,
            ..Limits::default()
        })
    }

    /// `n` admitted requests of `k`.
    fn admit_n(a: &Admission, k: &Caller, n: usize) -> Vec<Permit> {
        (0..n)
            .map(|_| {
                let mut p = a.admit_anonymous().unwrap();
                a.admit_key(&mut p, k).unwrap();
                p
            })
            .collect()
    }

    #[test]
    fn in_flight_caps_hold_and_dropped_permits_release_them() {
        let a = admission(3, 0, 2);
        let k = caller("k1", KeyLimits::default());
        let mut held = admit_n(&a, &k, 2);
        let mut p = a.admit_anonymous().unwrap();
        assert_eq!(a.admit_key(&mut p, &k), Err(Refused::TooManyInFlight(2)));
        // The third global slot is taken by `p`; a fourth request is shed.
        assert_eq!(a.admit_anonymous().unwrap_err(), Refused::Overloaded(3));
        drop(p);
        drop(held.pop());
        assert_eq!(a.key_in_flight("k1"), (1, 2));
        let mut p = a.admit_anonymous().unwrap();
        a.admit_key(&mut p, &k).unwrap();
        assert_eq!(a.in_flight(), 2);
    }

    #[test]
    fn the_rate_bucket_allows_its_burst_then_refuses_without_spending() {
        let a = admission(100, 5, 0);
        let k = caller("k", KeyLimits::default());
        let mut ok = 0;
        let mut refused = 0;
        let started = Instant::now();
        for _ in 0..40 {
            let mut p = a.admit_anonymous().unwrap();
            match a.admit_key(&mut p, &k) {
                Ok(()) => ok += 1,
                Err(Refused::RateLimited(5)) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        }
        // A burst of 10, plus what refilled at 5/s while the loop ran
        // (microseconds when idle; the bound follows the clock on a loaded
        // machine instead of assuming its speed).
        let refilled = (5.0 * started.elapsed().as_secs_f64()).ceil() as usize;
        assert!(
            (10..=10 + refilled).contains(&ok),
            "{ok}, {refilled} refilled"
        );
        assert_eq!(ok + refused, 40);
        // The refusals spent nothing: with the bucket's clock moved back by
        // one token's refill time (0.2 s at 5/s; moved, not waited for), the
        // next request is admitted.
        lock(&a.keys)
            .get_mut("k")
            .expect("the key's bucket")
            .refilled -= std::time::Duration::from_millis(200);
        let mut p = a.admit_anonymous().unwrap();
        assert_eq!(
            a.admit_key(&mut p, &k),
            Ok(()),
            "{refused} refused requests spent tokens"
        );
    }

    #[tokio::test]
    async fn the_queue_estimate_counts_accepted_submits_between_recounts() {
        let a = admission(8, 0, 0);
        let n = a.queued(|| async { Ok::<_, ()>(5) }).await.unwrap();
        assert_eq!(n, 5);
        a.note_queued();
        a.note_queued();
        // Fresh: no recount (the closure would say 100).
        assert_eq!(a.queued(|| async { Ok::<_, ()>(100) }).await.unwrap(), 7);
        lock(&a.queue.state).1 = Some(Instant::now() - QUEUE_RECOUNT * 2);
        assert_eq!(a.queued(|| async { Ok::<_, ()>(3) }).await.unwrap(), 3);
        assert_eq!(a.queued(|| async { Err::<u64, _>("db") }).await.unwrap(), 3);
    }

    #[test]
    fn a_key_own_limits_beat_the_defaults() {
        let a = admission(100, 0, 1);
        let k = caller(
            "own",
            KeyLimits {
                requests_per_sec: Some(1),
                max_in_flight: Some(3),
            },
        );
        assert_eq!(
            a.quota(&k),
            KeyQuota {
                requests_per_sec: 1,
                max_in_flight: 3
            }
        );
        let _held = admit_n(&a, &k, 2);
        let mut p = a.admit_anonymous().unwrap();
        assert_eq!(a.admit_key(&mut p, &k), Err(Refused::RateLimited(1)));
    }
}
