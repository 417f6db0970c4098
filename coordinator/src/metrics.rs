//! Coordinator counters, exported as Prometheus text at `/metrics`.
//!
//! Counters only ever increase; gauges (nodes online, jobs queued) are read
//! from their source when rendered, so they cannot drift.

use std::{
    fmt::Write,
    sync::atomic::{AtomicU64, Ordering},
};

/// Counters of the job and node-link subsystems.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Jobs accepted by Submit.
    pub jobs_submitted: AtomicU64,
    /// Jobs completed with a verified result.
    pub jobs_completed: AtomicU64,
    /// Jobs that failed for good.
    pub jobs_failed: AtomicU64,
    /// Attempts that ended in a requeue.
    pub jobs_requeued: AtomicU64,
    /// Results refused (bad signature, wrong node, job, attempt, model or input).
    pub results_refused: AtomicU64,
    /// Node handshakes accepted.
    pub handshakes_accepted: AtomicU64,
    /// Node handshakes refused.
    pub handshakes_refused: AtomicU64,
    /// Model tokens streamed from nodes.
    pub tokens_streamed: AtomicU64,
}

/// Gauges read at render time.
#[derive(Debug, Default, Clone, Copy)]
pub struct Gauges {
    pub nodes_online: u64,
    pub jobs_queued: u64,
}

impl Metrics {
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Prometheus text exposition format.
    pub fn render(&self, gauges: Gauges) -> String {
        let counters: [(&str, &str, &AtomicU64); 8] = [
            (
                "mlxnet_jobs_submitted_total",
                "Jobs accepted by Submit.",
                &self.jobs_submitted,
            ),
            (
                "mlxnet_jobs_completed_total",
                "Jobs completed with a verified result.",
                &self.jobs_completed,
            ),
            (
                "mlxnet_jobs_failed_total",
                "Jobs that failed for good.",
                &self.jobs_failed,
            ),
            (
                "mlxnet_jobs_requeued_total",
                "Job attempts that ended in a requeue.",
                &self.jobs_requeued,
            ),
            (
                "mlxnet_results_refused_total",
                "Node results refused by verification.",
                &self.results_refused,
            ),
            (
                "mlxnet_node_handshakes_accepted_total",
                "Node handshakes accepted.",
                &self.handshakes_accepted,
            ),
            (
                "mlxnet_node_handshakes_refused_total",
                "Node handshakes refused.",
                &self.handshakes_refused,
            ),
            (
                "mlxnet_tokens_streamed_total",
                "Model tokens streamed from nodes.",
                &self.tokens_streamed,
            ),
        ];
        let mut out = String::new();
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                value.load(Ordering::Relaxed)
            );
        }
        let gauges = [
            (
                "mlxnet_nodes_online",
                "Nodes with a live session.",
                gauges.nodes_online,
            ),
            (
                "mlxnet_jobs_queued",
                "Jobs waiting for a node.",
                gauges.jobs_queued,
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_gauges_as_prometheus_text() {
        let m = Metrics::default();
        Metrics::inc(&m.jobs_submitted);
        Metrics::inc(&m.jobs_submitted);
        let text = m.render(Gauges {
            nodes_online: 3,
            jobs_queued: 1,
        });
        assert!(text.contains("\nmlxnet_jobs_submitted_total 2\n"), "{text}");
        assert!(
            text.contains("# TYPE mlxnet_nodes_online gauge\nmlxnet_nodes_online 3\n"),
            "{text}"
        );
    }
}
