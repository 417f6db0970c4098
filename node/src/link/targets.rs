//! The coordinator addresses a node dials, in turn: the replicas of one
//! coordinator, each configured `host:port` (a name that resolves to
//! several addresses gives several).
//!
//! The link takes the next target for every session it opens, so a node
//! whose replica went away (or told it to move, see
//! `mlxnet.v1.Reconnect`) dials another one next. Once every target of a
//! round was tried, the entries are resolved again: DNS may have changed.
//!
//! # Invariants
//! - Targets come in configured order; within an entry, in the order the
//!   resolver gave; an address appears once per round.
//! - An entry that does not resolve is skipped for the round (logged);
//!   only a round with no address at all is an error.

use std::{collections::VecDeque, net::SocketAddr};

use super::LinkError;
use crate::config::split_host_port;

/// One address to dial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The configured entry it came from (`host:port`).
    pub entry: String,
    /// The entry's host: sent as SNI (the pin, not the name, authenticates).
    pub host: String,
    pub addr: SocketAddr,
}

/// The round of targets left to try.
#[derive(Debug)]
pub struct Targets {
    entries: Vec<String>,
    round: VecDeque<Target>,
}

impl Targets {
    pub fn new(entries: Vec<String>) -> Self {
        Self {
            entries,
            round: VecDeque::new(),
        }
    }

    /// The next address to dial, resolving a new round when this one is used up.
    pub async fn next(&mut self) -> Result<Target, LinkError> {
        if self.round.is_empty() {
            self.round = self.resolve().await?;
        }
        self.round
            .pop_front()
            .ok_or_else(|| LinkError::NoAddress(self.entries.join(",")))
    }

    async fn resolve(&self) -> Result<VecDeque<Target>, LinkError> {
        let mut round: VecDeque<Target> = VecDeque::new();
        let mut last_error = None;
        for entry in &self.entries {
            let (host, _) = split_host_port(entry)?;
            match tokio::net::lookup_host(entry).await {
                Ok(addrs) => {
                    for addr in addrs {
                        if !round.iter().any(|t| t.addr == addr) {
                            round.push_back(Target {
                                entry: entry.clone(),
                                host: host.to_owned(),
                                addr,
                            });
                        }
                    }
                }
                Err(source) => {
                    tracing::warn!(coordinator = %entry, error = %source, "cannot resolve a coordinator address");
                    last_error = Some(LinkError::Resolve {
                        addr: entry.clone(),
                        source,
                    });
                }
            }
        }
        match (round.is_empty(), last_error) {
            (true, Some(e)) => Err(e),
            (true, None) => Err(LinkError::NoAddress(self.entries.join(","))),
            (false, _) => Ok(round),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn targets_go_round_in_order_without_duplicates_and_resolve_again() {
        let mut t = Targets::new(vec![
            "127.0.0.1:7001".into(),
            "127.0.0.1:7002".into(),
            "127.0.0.1:7001".into(),
            "[::1]:7003".into(),
        ]);
        let mut seen = Vec::new();
        for _ in 0..6 {
            seen.push(t.next().await.unwrap().addr.to_string());
        }
        assert_eq!(
            seen,
            [
                "127.0.0.1:7001",
                "127.0.0.1:7002",
                "[::1]:7003",
                "127.0.0.1:7001",
                "127.0.0.1:7002",
                "[::1]:7003"
            ]
        );
    }

    #[tokio::test]
    async fn a_name_resolving_to_several_addresses_counts_as_several() {
        // `localhost` resolves to 127.0.0.1 and, where IPv6 is configured,
        // ::1: every address it gives is a target of its own.
        let resolved: Vec<SocketAddr> = tokio::net::lookup_host("localhost:7001")
            .await
            .unwrap()
            .collect();
        let mut t = Targets::new(vec!["localhost:7001".into()]);
        let mut seen = Vec::new();
        for _ in 0..resolved.len() {
            let target = t.next().await.unwrap();
            assert_eq!(target.host, "localhost");
            seen.push(target.addr);
        }
        let mut unique = resolved.clone();
        unique.dedup();
        assert_eq!(seen, unique);
    }

    #[tokio::test]
    async fn an_entry_that_does_not_resolve_is_skipped() {
        let mut t = Targets::new(vec![
            "no-such-host.invalid:7001".into(),
            "127.0.0.1:7002".into(),
        ]);
        assert_eq!(t.next().await.unwrap().addr.to_string(), "127.0.0.1:7002");
        let mut none = Targets::new(vec!["no-such-host.invalid:7001".into()]);
        assert!(matches!(none.next().await, Err(LinkError::Resolve { .. })));
    }
}
