//! Forming the pod's TCP data plane from its config, and measuring each link.
//!
//! Rank `r` listens on `hosts[r].ips[0]` at `base_port + r` (distinct ports,
//! so a pod on one machine works too, as `mlx.launch` does with its
//! `--starting-port`). After the pod forms, rank 0 measures every link:
//! latency as the median round trip of a small message, bandwidth from the
//! round trip of a large one.
//!
//! # Failure
//! [`PodConfigError`] for a config without usable addresses;
//! [`CollectiveError`] when a member is lost during the measurement.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use super::hostfile::{PodConfig, PodConfigError};
use crate::collectives::{Collective, CollectiveError};

/// Where every rank listens.
pub fn addresses(cfg: &PodConfig, base_port: u16) -> Result<Vec<SocketAddr>, PodConfigError> {
    cfg.hosts
        .iter()
        .enumerate()
        .map(|(rank, h)| {
            let ip: IpAddr =
                h.ips
                    .first()
                    .and_then(|ip| ip.parse().ok())
                    .ok_or(PodConfigError::NoIp {
                        rank,
                        backend: "ring",
                    })?;
            let port = u16::try_from(base_port as usize + rank).map_err(|_| {
                PodConfigError::Json(format!("port {base_port} + rank {rank} exceeds 65535"))
            })?;
            Ok(SocketAddr::new(ip, port))
        })
        .collect()
}

/// One link's measured figures, from rank 0 to `peer`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkFigures {
    pub peer: usize,
    /// Median round trip of an 8-byte message.
    pub latency: Duration,
    /// Bytes per second, from the round trip of a `bulk`-byte message.
    pub bandwidth: f64,
}

/// Measures every link from rank 0 (all ranks call it; rank 0 gets the
/// figures, the others an empty list). `rounds` small round trips per link,
/// one round trip of `bulk` bytes.
pub fn measure_links(
    comm: &mut dyn Collective,
    rounds: usize,
    bulk: usize,
) -> Result<Vec<LinkFigures>, CollectiveError> {
    let (rank, n) = (comm.rank(), comm.size());
    let mut small = [0u8; 8];
    let mut big = vec![0u8; bulk];
    let mut out = Vec::new();
    for peer in 1..n {
        if rank == 0 {
            let mut times = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                let start = Instant::now();
                comm.send(&small, peer)?;
                comm.recv(&mut small, peer)?;
                times.push(start.elapsed());
            }
            let start = Instant::now();
            comm.send(&big, peer)?;
            comm.recv(&mut big, peer)?;
            out.push(figures(peer, times, start.elapsed(), bulk));
        } else if rank == peer {
            for _ in 0..rounds {
                comm.recv(&mut small, 0)?;
                comm.send(&small, 0)?;
            }
            comm.recv(&mut big, 0)?;
            comm.send(&big, 0)?;
        }
    }
    comm.barrier()?;
    Ok(out)
}

/// One link's figures from its measured round trips: latency is the median
/// small round trip; the bulk round trip moved `bulk` bytes twice, and the
/// time beyond one latency is what moving them took.
fn figures(peer: usize, mut small: Vec<Duration>, bulk_rtt: Duration, bulk: usize) -> LinkFigures {
    small.sort();
    let latency = small.get(small.len() / 2).copied().unwrap_or_default();
    let moving = bulk_rtt
        .saturating_sub(latency)
        .max(Duration::from_nanos(1));
    LinkFigures {
        peer,
        latency,
        bandwidth: (2 * bulk) as f64 / moving.as_secs_f64(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::tcp::TcpOptions;
    use crate::collectives::tests::tcp_pod;
    use crate::collectives::GroupOptions;

    #[test]
    fn addresses_come_from_the_hostfile() {
        let cfg = PodConfig::parse(
            r#"[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2", "10.0.1.2"]}]"#,
        )
        .unwrap();
        assert_eq!(
            addresses(&cfg, 5000).unwrap(),
            vec![
                "10.0.0.1:5000".parse::<SocketAddr>().unwrap(),
                "10.0.0.2:5001".parse().unwrap()
            ]
        );
        let no_ip =
            PodConfig::parse(r#"[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b"}]"#).unwrap();
        assert_eq!(
            addresses(&no_ip, 5000),
            Err(PodConfigError::NoIp {
                rank: 1,
                backend: "ring"
            })
        );
        let bad = PodConfig::parse(r#"[{"ssh": "a", "ips": ["m1.local"]}]"#).unwrap();
        assert!(addresses(&bad, 5000).is_err());
        assert!(addresses(&cfg, 65535).is_err());
    }

    #[test]
    fn rank_0_measures_every_link() {
        let pod = tcp_pod(3, TcpOptions::default(), GroupOptions::default());
        let handles: Vec<_> = pod
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || measure_links(c.as_mut(), 20, 1 << 20).unwrap())
            })
            .collect();
        let figures: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(
            figures[0].iter().map(|f| f.peer).collect::<Vec<_>>(),
            vec![1, 2]
        );
        // How fast loopback is here is not this test's business (a loaded
        // machine is slow); that every link got finite, positive figures is.
        for f in &figures[0] {
            assert!(f.latency > Duration::ZERO, "{f:?}");
            assert!(f.bandwidth.is_finite() && f.bandwidth > 0.0, "{f:?}");
            eprintln!("loopback link to rank {}: {f:?}", f.peer);
        }
        assert!(figures[1].is_empty() && figures[2].is_empty());
    }

    #[test]
    fn figures_are_the_median_round_trip_and_the_bulk_rate_beyond_it() {
        let ms = Duration::from_millis;
        // The median, not the fastest or the mean: one slow outlier and one
        // lucky round trip change nothing.
        let f = figures(
            2,
            vec![ms(9), ms(2), ms(3), ms(400), ms(1)],
            ms(103),
            50_000_000,
        );
        assert_eq!(f.peer, 2);
        assert_eq!(f.latency, ms(3));
        // 2 x 50 MB in the 100 ms beyond the latency: 1 GB/s.
        assert!((f.bandwidth - 1e9).abs() < 1.0, "{f:?}");
        // A bulk round trip no slower than the latency still gives a finite rate.
        let f = figures(1, vec![ms(5)], ms(5), 1000);
        assert!(f.bandwidth.is_finite() && f.bandwidth > 0.0, "{f:?}");
    }
}
