//! Synthetic networks for the World page's bench, browser tests and demos:
//! plausible Macs around real cities, seeded so every run is the same.
//!
//! # Invariants
//! - The same `(count, seed)` gives the same nodes, ids included.
//! - About 5 % opt out of the map and about 2 % sit in pods of 2 to 4 Macs
//!   sharing one place, so the page's hidden-node and pod paths are exercised.

use rand::{rngs::StdRng, Rng, SeedableRng};

use super::model::{NodeView, PodRef, Status};

/// (place, latitude, longitude, weight) of the cities nodes gather around.
const CITIES: &[(&str, f64, f64, u32)] = &[
    ("San Francisco, US", 37.77, -122.42, 40),
    ("Seattle, US", 47.61, -122.33, 14),
    ("Los Angeles, US", 34.05, -118.24, 18),
    ("New York, US", 40.71, -74.01, 30),
    ("Boston, US", 42.36, -71.06, 12),
    ("Austin, US", 30.27, -97.74, 10),
    ("Chicago, US", 41.88, -87.63, 10),
    ("Toronto, CA", 43.65, -79.38, 10),
    ("Vancouver, CA", 49.28, -123.12, 6),
    ("Mexico City, MX", 19.43, -99.13, 6),
    ("São Paulo, BR", -23.55, -46.63, 8),
    ("Buenos Aires, AR", -34.60, -58.38, 4),
    ("Santiago, CL", -33.45, -70.67, 3),
    ("Bogotá, CO", 4.71, -74.07, 3),
    ("London, GB", 51.51, -0.13, 24),
    ("Paris, FR", 48.86, 2.35, 16),
    ("Lyon, FR", 45.76, 4.84, 4),
    ("Berlin, DE", 52.52, 13.40, 14),
    ("Munich, DE", 48.14, 11.58, 6),
    ("Amsterdam, NL", 52.37, 4.90, 8),
    ("Zürich, CH", 47.38, 8.54, 6),
    ("Stockholm, SE", 59.33, 18.07, 6),
    ("Oslo, NO", 59.91, 10.75, 3),
    ("Helsinki, FI", 60.17, 24.94, 3),
    ("Madrid, ES", 40.42, -3.70, 6),
    ("Lisbon, PT", 38.72, -9.14, 4),
    ("Milan, IT", 45.46, 9.19, 5),
    ("Warsaw, PL", 52.23, 21.01, 4),
    ("Kyiv, UA", 50.45, 30.52, 3),
    ("Istanbul, TR", 41.01, 28.98, 4),
    ("Tel Aviv, IL", 32.09, 34.78, 5),
    ("Dubai, AE", 25.20, 55.27, 4),
    ("Cairo, EG", 30.04, 31.24, 2),
    ("Lagos, NG", 6.52, 3.38, 3),
    ("Nairobi, KE", -1.29, 36.82, 2),
    ("Cape Town, ZA", -33.92, 18.42, 2),
    ("Mumbai, IN", 19.08, 72.88, 8),
    ("Bengaluru, IN", 12.97, 77.59, 10),
    ("Delhi, IN", 28.61, 77.21, 5),
    ("Singapore, SG", 1.35, 103.82, 8),
    ("Jakarta, ID", -6.21, 106.85, 3),
    ("Bangkok, TH", 13.76, 100.50, 3),
    ("Ho Chi Minh City, VN", 10.82, 106.63, 3),
    ("Hong Kong", 22.32, 114.17, 6),
    ("Shanghai, CN", 31.23, 121.47, 10),
    ("Beijing, CN", 39.90, 116.41, 8),
    ("Shenzhen, CN", 22.54, 114.06, 8),
    ("Taipei, TW", 25.03, 121.57, 6),
    ("Seoul, KR", 37.57, 126.98, 10),
    ("Tokyo, JP", 35.68, 139.69, 20),
    ("Osaka, JP", 34.69, 135.50, 6),
    ("Sydney, AU", -33.87, 151.21, 8),
    ("Melbourne, AU", -37.81, 144.96, 6),
    ("Auckland, NZ", -36.85, 174.76, 3),
    ("Reykjavík, IS", 64.15, -21.94, 1),
    ("Anchorage, US", 61.22, -149.90, 1),
];

/// (chip, memory choices in GiB, weight).
const CHIPS: &[(&str, &[u64], u32)] = &[
    ("Apple M1", &[8, 16], 10),
    ("Apple M1 Pro", &[16, 32], 6),
    ("Apple M1 Max", &[32, 64], 5),
    ("Apple M1 Ultra", &[64, 128], 2),
    ("Apple M2", &[8, 16, 24], 8),
    ("Apple M2 Pro", &[16, 32], 6),
    ("Apple M2 Max", &[32, 64, 96], 5),
    ("Apple M2 Ultra", &[64, 128, 192], 3),
    ("Apple M3", &[8, 16, 24], 7),
    ("Apple M3 Pro", &[18, 36], 6),
    ("Apple M3 Max", &[36, 48, 64, 128], 6),
    ("Apple M3 Ultra", &[96, 256, 512], 3),
    ("Apple M4", &[16, 24, 32], 10),
    ("Apple M4 Pro", &[24, 48, 64], 8),
    ("Apple M4 Max", &[36, 48, 64, 128], 6),
    ("Apple M5", &[16, 24, 32], 4),
];

fn pick<'a, T>(rng: &mut StdRng, items: &'a [T], weight: impl Fn(&T) -> u32) -> &'a T {
    let total: u32 = items.iter().map(&weight).sum();
    let mut x = rng.gen_range(0..total.max(1));
    for item in items {
        let w = weight(item);
        if x < w {
            return item;
        }
        x -= w;
    }
    &items[items.len() - 1]
}

/// `count` synthetic nodes, deterministic for `seed`.
pub fn network(count: usize, seed: u64) -> Vec<NodeView> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out: Vec<NodeView> = Vec::with_capacity(count);
    let mut pod_no = 0u32;
    while out.len() < count {
        let &(city, clat, clon, _) = pick(&mut rng, CITIES, |c| c.3);
        // Spread around the city: a few hundred km at most, denser near it.
        let spread = if rng.gen_bool(0.7) { 0.6 } else { 3.0 };
        let lat = (clat + (rng.gen::<f64>() + rng.gen::<f64>() - 1.0) * spread).clamp(-89.0, 89.0);
        let lon = (clon + (rng.gen::<f64>() + rng.gen::<f64>() - 1.0) * spread * 1.4)
            .clamp(-179.9, 179.9);
        let pod_size = if rng.gen_bool(0.006) {
            rng.gen_range(2..=4)
        } else {
            1
        };
        let pod_id = (pod_size > 1).then(|| {
            pod_no += 1;
            format!("pod-{pod_no:04}")
        });
        let first = out.len();
        for _ in 0..pod_size.min(count - out.len()) {
            let i = out.len();
            let &(chip, mems, _) = if pod_id.is_some() {
                // Pods are cabled Studios.
                pick(&mut rng, &CHIPS[11..12], |c| c.2)
            } else {
                pick(&mut rng, CHIPS, |c| c.2)
            };
            let mem = mems[rng.gen_range(0..mems.len())];
            let mut id = [0u8; 32];
            rng.fill(&mut id);
            let mut v = NodeView::new(
                hex::encode(id),
                &format!(
                    "{}-{i}",
                    city.split(',')
                        .next()
                        .unwrap_or("mac")
                        .to_lowercase()
                        .replace(' ', "-")
                ),
                chip,
                mem << 30,
            )
            .at(city, lat, lon);
            v.status = match rng.gen_range(0..100) {
                0..=29 => Status::Serving,
                30..=79 => Status::Idle,
                80..=89 => Status::Busy,
                _ => Status::Offline,
            };
            v.hidden = pod_id.is_none() && rng.gen_bool(0.05);
            v.jobs_served = rng.gen_range(0..5_000);
            v.tokens_produced = v.jobs_served * rng.gen_range(50..400);
            out.push(v);
        }
        if let Some(pod_id) = pod_id {
            let members: Vec<String> = out[first..].iter().map(|n| n.node_id.clone()).collect();
            for n in &mut out[first..] {
                n.pod = Some(PodRef {
                    pod_id: pod_id.clone(),
                    members: members.clone(),
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_network() {
        let a = network(500, 7);
        let b = network(500, 7);
        assert_eq!(a, b);
        assert_eq!(a.len(), 500);
        assert_ne!(network(500, 8)[0].node_id, a[0].node_id);
        assert!(a.iter().any(|n| n.hidden));
        assert!(network(5_000, 7).iter().any(|n| n.pod.is_some()));
    }
}
