//! Per-source budgets on the node link: how many handshakes one source
//! address may start, and how many identities never seen before it may
//! register, per window.
//!
//! Any ed25519 key is a node, so a Sybil makes keys for free; each new key
//! costs the coordinator a node row, an operator link and a World entry.
//! These budgets bound that per source: past [`SourceLimitsConfig::max_new_identities`]
//! new keys in a window, a source's next new key is refused with a clear
//! reason, while every key the coordinator already knows (it has a node row)
//! still connects from it. Past [`SourceLimitsConfig::max_handshakes`]
//! connections in a window, the source's next connection is closed before
//! its handshake, known key or not.
//!
//! A source is an IPv4 address, or the /64 prefix of an IPv6 address (one
//! host usually holds a whole /64). Loopback is exempt by default
//! ([`SourceLimitsConfig::exempt_loopback`]): tests and the load simulator
//! run many nodes on 127.0.0.1, and a node beside its coordinator is the
//! operator's own.
//!
//! # Invariants
//! - At most [`SourceLimitsConfig::max_sources`] sources are tracked: a new
//!   one first drops every source whose window has ended, then the source
//!   whose window began first. Memory does not grow with the number of
//!   addresses that ever connected.
//! - A connection is counted only once its TLS handshake completed, so the
//!   address is the peer's own (QUIC validated it), not a spoofed one.
//!
//! # Failure
//! [`SourceRefusal`] says which budget ran out; the link sends it to the
//! node (as `Rejected`, or as the close reason) and counts it in metrics.
//! An attacker holding more addresses than `max_sources` can churn the table;
//! per-address budgets cannot stop one that holds that many.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv6Addr},
    sync::Mutex,
    time::{Duration, Instant},
};

use serde::Deserialize;

use crate::util::lock;

/// The `[node_sources]` section of the coordinator's config.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SourceLimitsConfig {
    /// The window the counts are kept over, in milliseconds.
    pub window_ms: u64,
    /// Connections one source may start per window (0: no limit). A
    /// reconnecting node uses one each time.
    pub max_handshakes: u32,
    /// Identities the coordinator has never seen that one source may
    /// register per window (0: no limit).
    pub max_new_identities: u32,
    /// Sources tracked at once.
    pub max_sources: usize,
    /// Connections from loopback are not counted.
    pub exempt_loopback: bool,
}

impl Default for SourceLimitsConfig {
    fn default() -> Self {
        Self {
            window_ms: 10 * 60 * 1000,
            max_handshakes: 120,
            max_new_identities: 8,
            max_sources: 16_384,
            exempt_loopback: true,
        }
    }
}

/// Why a source's connection or new identity was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SourceRefusal {
    #[error("too many handshakes from this address ({max} in {window_s} s); retry later")]
    HandshakeRate { max: u32, window_s: u64 },
    #[error(
        "too many new node identities from this address ({max} in {window_s} s); \
         retry later, or connect with an identity already registered"
    )]
    NewIdentities { max: u32, window_s: u64 },
}

/// What one source did in its current window.
#[derive(Clone, Copy, Debug)]
struct Window {
    start: Instant,
    handshakes: u32,
    new_identities: u32,
}

/// The budgets of every tracked source (one per node link).
#[derive(Debug)]
pub struct SourceLimits {
    config: SourceLimitsConfig,
    table: Mutex<HashMap<IpAddr, Window>>,
}

/// The key a source is counted under: an IPv4 address (IPv4-mapped IPv6
/// included), or an IPv6 address's /64 prefix.
fn source_of(addr: IpAddr) -> IpAddr {
    match addr.to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(prefix))
        }
        v4 => v4,
    }
}

impl SourceLimits {
    pub fn new(config: SourceLimitsConfig) -> Self {
        Self {
            config,
            table: Mutex::new(HashMap::new()),
        }
    }

    fn window(&self) -> Duration {
        Duration::from_millis(self.config.window_ms)
    }

    fn exempt(&self, addr: IpAddr) -> bool {
        self.config.exempt_loopback && addr.to_canonical().is_loopback()
    }

    /// Counts a connection from `addr` at `now`; refused past the rate.
    pub fn handshake(&self, addr: IpAddr, now: Instant) -> Result<(), SourceRefusal> {
        let (max, window_s) = (self.config.max_handshakes, self.window().as_secs());
        self.count(addr, now, |w| {
            if max > 0 && w.handshakes >= max {
                return Err(SourceRefusal::HandshakeRate { max, window_s });
            }
            w.handshakes += 1;
            Ok(())
        })
    }

    /// Counts an identity the coordinator has never seen, registering from
    /// `addr` at `now`; refused past the cap.
    pub fn new_identity(&self, addr: IpAddr, now: Instant) -> Result<(), SourceRefusal> {
        let (max, window_s) = (self.config.max_new_identities, self.window().as_secs());
        self.count(addr, now, |w| {
            if max > 0 && w.new_identities >= max {
                return Err(SourceRefusal::NewIdentities { max, window_s });
            }
            w.new_identities += 1;
            Ok(())
        })
    }

    /// Whether a new identity from `addr` is counted at all (when not, the
    /// caller need not ask the store whether the identity is new).
    pub fn counts_identities(&self, addr: IpAddr) -> bool {
        self.config.max_new_identities > 0 && !self.exempt(addr)
    }

    /// Sources tracked now.
    pub fn tracked(&self) -> usize {
        lock(&self.table).len()
    }

    fn count(
        &self,
        addr: IpAddr,
        now: Instant,
        step: impl FnOnce(&mut Window) -> Result<(), SourceRefusal>,
    ) -> Result<(), SourceRefusal> {
        if self.exempt(addr) {
            return Ok(());
        }
        let window = self.window();
        let ended = |w: &Window| now.saturating_duration_since(w.start) >= window;
        let source = source_of(addr);
        let mut table = lock(&self.table);
        if !table.contains_key(&source) && table.len() >= self.config.max_sources.max(1) {
            table.retain(|_, w| !ended(w));
            if table.len() >= self.config.max_sources.max(1) {
                let oldest = table.iter().min_by_key(|(_, w)| w.start).map(|(k, _)| *k);
                if let Some(oldest) = oldest {
                    table.remove(&oldest);
                }
            }
        }
        let fresh = Window {
            start: now,
            handshakes: 0,
            new_identities: 0,
        };
        let entry = table.entry(source).or_insert(fresh);
        if ended(entry) {
            *entry = fresh;
        }
        step(entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_handshakes: u32, max_new_identities: u32, max_sources: usize) -> SourceLimits {
        SourceLimits::new(SourceLimitsConfig {
            window_ms: 60_000,
            max_handshakes,
            max_new_identities,
            max_sources,
            exempt_loopback: true,
        })
    }

    fn v4(last: u8) -> IpAddr {
        IpAddr::from([203, 0, 113, last])
    }

    #[test]
    fn each_budget_runs_out_per_source_and_comes_back_with_the_next_window() {
        let l = limits(3, 2, 100);
        let t0 = Instant::now();
        for _ in 0..3 {
            l.handshake(v4(1), t0).unwrap();
        }
        assert_eq!(
            l.handshake(v4(1), t0),
            Err(SourceRefusal::HandshakeRate {
                max: 3,
                window_s: 60
            })
        );
        // Another address has its own budget.
        l.handshake(v4(2), t0).unwrap();
        l.new_identity(v4(1), t0).unwrap();
        l.new_identity(v4(1), t0).unwrap();
        assert!(matches!(
            l.new_identity(v4(1), t0),
            Err(SourceRefusal::NewIdentities { max: 2, .. })
        ));
        let later = t0 + Duration::from_secs(60);
        l.handshake(v4(1), later).unwrap();
        l.new_identity(v4(1), later).unwrap();
    }

    #[test]
    fn loopback_is_exempt_unless_configured_otherwise() {
        let l = limits(1, 1, 100);
        let t0 = Instant::now();
        for _ in 0..10 {
            l.handshake(IpAddr::from([127, 0, 0, 1]), t0).unwrap();
            l.new_identity("::1".parse().unwrap(), t0).unwrap();
            l.new_identity("::ffff:127.0.0.1".parse().unwrap(), t0)
                .unwrap();
        }
        assert_eq!(l.tracked(), 0);
        let strict = SourceLimits::new(SourceLimitsConfig {
            exempt_loopback: false,
            max_new_identities: 1,
            ..SourceLimitsConfig::default()
        });
        strict
            .new_identity(IpAddr::from([127, 0, 0, 1]), t0)
            .unwrap();
        assert!(strict
            .new_identity(IpAddr::from([127, 0, 0, 1]), t0)
            .is_err());
    }

    #[test]
    fn ipv6_addresses_of_one_slash_64_share_a_budget_and_mapped_ipv4_is_ipv4() {
        let l = limits(0, 1, 100);
        let t0 = Instant::now();
        l.new_identity("2001:db8::1".parse().unwrap(), t0).unwrap();
        assert!(l
            .new_identity("2001:db8::ffff:2".parse().unwrap(), t0)
            .is_err());
        l.new_identity("2001:db8:0:1::1".parse().unwrap(), t0)
            .unwrap();
        l.new_identity(v4(9), t0).unwrap();
        assert!(l
            .new_identity("::ffff:203.0.113.9".parse().unwrap(), t0)
            .is_err());
    }

    #[test]
    fn the_table_stays_bounded_dropping_ended_windows_then_the_oldest() {
        let l = limits(0, 1, 4);
        let t0 = Instant::now();
        for i in 0..4u8 {
            l.new_identity(v4(i), t0 + Duration::from_secs(u64::from(i)))
                .unwrap();
        }
        assert_eq!(l.tracked(), 4);
        // Full, nothing ended: the oldest source (.0) is forgotten.
        l.new_identity(v4(10), t0 + Duration::from_secs(5)).unwrap();
        assert_eq!(l.tracked(), 4);
        l.new_identity(v4(0), t0 + Duration::from_secs(6)).unwrap();
        assert!(l.new_identity(v4(3), t0 + Duration::from_secs(6)).is_err());
        // Thousands of addresses later, still at most 4.
        for i in 0..5_000u32 {
            let addr = IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000u32 + i));
            let _ = l.handshake(addr, t0 + Duration::from_secs(7));
        }
        assert_eq!(l.tracked(), 4);
        // Once every window has ended, a new source clears them out.
        l.new_identity(v4(200), t0 + Duration::from_secs(600))
            .unwrap();
        assert_eq!(l.tracked(), 1);
    }
}
