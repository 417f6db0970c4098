//! Coordinator metrics, exported at `/metrics` in the OpenMetrics text
//! format through `prometheus-client` (the Prometheus project's Rust
//! client): counters of the job and node-link subsystems, latency
//! histograms of the steps a job goes through, and gauges.
//!
//! Counters only ever increase; gauges (nodes online, jobs queued) are set
//! from their source when rendered, so they cannot drift. Histograms are in
//! seconds, with buckets from 1 ms to about 65 s.
//!
//! Failure: none; a metric is never on a request's error path.

use std::time::Duration;

use prometheus_client::{
    encoding::text::encode,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};

/// The coordinator's metrics and the registry that renders them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Jobs accepted by Submit.
    pub jobs_submitted: Counter,
    /// Jobs completed with a verified result.
    pub jobs_completed: Counter,
    /// Jobs that failed for good.
    pub jobs_failed: Counter,
    /// Attempts that ended in a requeue.
    pub jobs_requeued: Counter,
    /// Results refused (bad signature, wrong node, job, attempt, model or input).
    pub results_refused: Counter,
    /// Node handshakes accepted.
    pub handshakes_accepted: Counter,
    /// Node handshakes refused.
    pub handshakes_refused: Counter,
    /// Node connections refused before their handshake because the link
    /// held `limits.max_node_connections` connections.
    pub connections_refused_at_cap: Counter,
    /// Node connections closed before their handshake: their source
    /// address was past its handshake rate (`node_sources.max_handshakes`).
    pub handshakes_rate_limited: Counter,
    /// Node identities never seen before refused: their source address had
    /// registered `node_sources.max_new_identities` in the window.
    pub identities_refused: Counter,
    /// Model tokens streamed from nodes.
    pub tokens_streamed: Counter,
    /// Node heartbeats recorded in the store (at most one per node per
    /// half heartbeat interval).
    pub heartbeats_written: Counter,
    /// Node heartbeats answered but not written (they came sooner).
    pub heartbeats_coalesced: Counter,
    /// Prompt tokens nodes say they served from their prefix caches (the
    /// growth of their heartbeats' counters; their word, never paid).
    pub prefix_hit_tokens: Counter,
    /// Jobs placed on a node that last ran a prefix of their input.
    pub prefix_affinity_placements: Counter,
    /// Prefix affinities dropped: a node reconnected or restarted, or a
    /// job placed for its prefix did not hit.
    pub prefix_affinity_dropped: Counter,
    /// A durable Submit: the job and its hold in one transaction.
    pub submit_seconds: Histogram,
    /// A job's wait in the queue (from its submit or requeue) until a node
    /// was assigned.
    pub placement_seconds: Histogram,
    /// From Submit to the first token of the job's first attempt, as the
    /// coordinator relays it (what a client waits for).
    pub first_token_seconds: Histogram,
    /// One settlement (pay, refund and fee of a job, in one transaction).
    pub settlement_seconds: Histogram,
    /// Leases of the singleton duties taken or renewed, per replica and
    /// lease ([`Metrics::lease_renewed`]).
    lease_renewals: Family<Vec<(String, String)>, Counter>,
    /// Leases lost (taken over by another replica, or a renewal failed),
    /// per replica and lease ([`Metrics::lease_lost`]).
    lease_losses: Family<Vec<(String, String)>, Counter>,
    /// Token-relay wake-ups (PostgreSQL notifications) received, per
    /// replica ([`Metrics::relay_notified`]).
    relay_notifications: Family<Vec<(String, String)>, Counter>,
    /// Batches of relayed token chunks written to the database, per
    /// replica ([`Metrics::relay_batch_written`]).
    relay_token_batches: Family<Vec<(String, String)>, Counter>,
    nodes_online: Gauge,
    jobs_queued: Gauge,
}

/// Gauges read at render time.
#[derive(Debug, Default, Clone, Copy)]
pub struct Gauges {
    pub nodes_online: u64,
    pub jobs_queued: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("mlxnet");
        let mut counter = |name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let jobs_submitted = counter("jobs_submitted", "Jobs accepted by Submit.");
        let jobs_completed = counter("jobs_completed", "Jobs completed with a verified result.");
        let jobs_failed = counter("jobs_failed", "Jobs that failed for good.");
        let jobs_requeued = counter("jobs_requeued", "Job attempts that ended in a requeue.");
        let results_refused = counter("results_refused", "Node results refused by verification.");
        let handshakes_accepted = counter("node_handshakes_accepted", "Node handshakes accepted.");
        let handshakes_refused = counter("node_handshakes_refused", "Node handshakes refused.");
        let connections_refused_at_cap = counter(
            "node_connections_refused_at_cap",
            "Node connections refused because the link held limits.max_node_connections connections.",
        );
        let handshakes_rate_limited = counter(
            "node_handshakes_rate_limited",
            "Node connections closed before their handshake: their source address was past node_sources.max_handshakes in the window.",
        );
        let identities_refused = counter(
            "node_identities_refused",
            "New node identities refused: their source address had registered node_sources.max_new_identities in the window.",
        );
        let tokens_streamed = counter("tokens_streamed", "Model tokens streamed from nodes.");
        let heartbeats_written = counter(
            "node_heartbeats_written",
            "Node heartbeats recorded in the store.",
        );
        let heartbeats_coalesced = counter(
            "node_heartbeats_coalesced",
            "Node heartbeats answered without a store write: they came within half an interval of the last written one.",
        );
        let prefix_hit_tokens = counter(
            "node_prefix_hit_tokens",
            "Prompt tokens nodes report serving from their prefix caches (unverified).",
        );
        let prefix_affinity_placements = counter(
            "prefix_affinity_placements",
            "Jobs placed on a node that last ran a prefix of their input.",
        );
        let prefix_affinity_dropped = counter(
            "prefix_affinity_dropped",
            "Prefix affinities dropped: the node reconnected or restarted, or a job placed for its prefix did not hit.",
        );
        let mut histogram = |name: &str, help: &str| {
            // 1 ms, 2 ms, ... 2^16 ms (about 65 s).
            let h = Histogram::new(exponential_buckets(0.001, 2.0, 17));
            registry.register(name, help, h.clone());
            h
        };
        let submit_seconds = histogram(
            "submit_seconds",
            "A durable Submit: the job and its hold in one transaction.",
        );
        let placement_seconds = histogram(
            "placement_seconds",
            "A job's wait in the queue, from its submit or requeue, until a node was assigned.",
        );
        let first_token_seconds = histogram(
            "first_token_seconds",
            "From Submit to the first token of a job's first attempt.",
        );
        let settlement_seconds = histogram(
            "settlement_seconds",
            "One settlement: a job's pay, refund and fee in one transaction.",
        );
        let lease_renewals = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "lease_renewals",
            "Leases of singleton duties taken or renewed, by replica and lease.",
            lease_renewals.clone(),
        );
        let lease_losses = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "lease_losses",
            "Leases of singleton duties lost (taken over, or a renewal failed), by replica and lease.",
            lease_losses.clone(),
        );
        let relay_notifications = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "relay_notifications",
            "Token-relay notifications (LISTEN/NOTIFY wake-ups) received, by replica.",
            relay_notifications.clone(),
        );
        let relay_token_batches = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "relay_token_batches",
            "Batches of running jobs' token chunks written to the database for other replicas, by replica.",
            relay_token_batches.clone(),
        );
        let nodes_online = Gauge::default();
        registry.register(
            "nodes_online",
            "Nodes with a live session.",
            nodes_online.clone(),
        );
        let jobs_queued = Gauge::default();
        registry.register(
            "jobs_queued",
            "Jobs waiting for a node.",
            jobs_queued.clone(),
        );
        Self {
            registry,
            jobs_submitted,
            jobs_completed,
            jobs_failed,
            jobs_requeued,
            results_refused,
            handshakes_accepted,
            handshakes_refused,
            connections_refused_at_cap,
            handshakes_rate_limited,
            identities_refused,
            tokens_streamed,
            heartbeats_written,
            heartbeats_coalesced,
            prefix_hit_tokens,
            prefix_affinity_placements,
            prefix_affinity_dropped,
            submit_seconds,
            placement_seconds,
            first_token_seconds,
            settlement_seconds,
            lease_renewals,
            lease_losses,
            relay_notifications,
            relay_token_batches,
            nodes_online,
            jobs_queued,
        }
    }
}

fn lease_labels(replica: &str, lease: &str) -> Vec<(String, String)> {
    vec![
        ("replica".to_owned(), replica.to_owned()),
        ("lease".to_owned(), lease.to_owned()),
    ]
}

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

impl Metrics {
    /// Records `elapsed` in `histogram`.
    pub fn observe(histogram: &Histogram, elapsed: Duration) {
        histogram.observe(elapsed.as_secs_f64());
    }

    /// Records the time since `since_ms` (a wall-clock time in ms) in
    /// `histogram`; a time in the future (a clock step) counts as zero.
    pub fn observe_since_ms(histogram: &Histogram, since_ms: i64, now_ms: i64) {
        let ms = now_ms.saturating_sub(since_ms).max(0);
        histogram.observe(ms as f64 / 1000.0);
    }

    /// Counts a grant or renewal of `lease` to `replica`.
    pub fn lease_renewed(&self, replica: &str, lease: &str) {
        self.lease_renewals
            .get_or_create(&lease_labels(replica, lease))
            .inc();
    }

    /// Counts a token-relay notification `replica` received.
    pub fn relay_notified(&self, replica: &str) {
        self.relay_notifications
            .get_or_create(&vec![("replica".to_owned(), replica.to_owned())])
            .inc();
    }

    /// Counts a batch of token chunks `replica` wrote.
    pub fn relay_batch_written(&self, replica: &str) {
        self.relay_token_batches
            .get_or_create(&vec![("replica".to_owned(), replica.to_owned())])
            .inc();
    }

    /// Counts a loss of `lease` by `replica`.
    pub fn lease_lost(&self, replica: &str, lease: &str) {
        self.lease_losses
            .get_or_create(&lease_labels(replica, lease))
            .inc();
    }

    /// The OpenMetrics text exposition ([`CONTENT_TYPE`]).
    pub fn render(&self, gauges: Gauges) -> String {
        self.nodes_online
            .set(i64::try_from(gauges.nodes_online).unwrap_or(i64::MAX));
        self.jobs_queued
            .set(i64::try_from(gauges.jobs_queued).unwrap_or(i64::MAX));
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histograms_and_gauges_as_openmetrics_text() {
        let m = Metrics::default();
        m.jobs_submitted.inc();
        m.jobs_submitted.inc();
        Metrics::observe(&m.submit_seconds, Duration::from_micros(1500));
        Metrics::observe_since_ms(&m.first_token_seconds, 1_000, 3_500);
        // A clock step back counts as zero, not as a negative wait.
        Metrics::observe_since_ms(&m.placement_seconds, 5_000, 4_000);
        let text = m.render(Gauges {
            nodes_online: 3,
            jobs_queued: 1,
        });
        assert!(text.contains("\nmlxnet_jobs_submitted_total 2\n"), "{text}");
        assert!(
            text.contains("# TYPE mlxnet_nodes_online gauge\nmlxnet_nodes_online 3\n"),
            "{text}"
        );
        // 1.5 ms: not in the 1 ms bucket, in the 2 ms one.
        assert!(
            text.contains("mlxnet_submit_seconds_bucket{le=\"0.001\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("mlxnet_submit_seconds_bucket{le=\"0.002\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("mlxnet_first_token_seconds_sum 2.5\n"),
            "{text}"
        );
        assert!(
            text.contains("mlxnet_placement_seconds_sum 0.0\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn lease_renewals_and_losses_are_counted_per_replica_and_lease() {
        let m = Metrics::default();
        m.lease_renewed("replica-a", "ledger-sweep");
        m.lease_renewed("replica-a", "ledger-sweep");
        m.lease_lost("replica-a", "ledger-sweep");
        let text = m.render(Gauges::default());
        assert!(
            text.contains(
                "\nmlxnet_lease_renewals_total{replica=\"replica-a\",lease=\"ledger-sweep\"} 2\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "\nmlxnet_lease_losses_total{replica=\"replica-a\",lease=\"ledger-sweep\"} 1\n"
            ),
            "{text}"
        );
    }
}
