//! Pod set-up on recorded `system_profiler` / `networksetup` output, plans
//! for meshes, rings and missing cables, and discovery over real mDNS.

use super::*;
use crate::pod::hostfile::PodConfig;

fn sample(name: &str) -> String {
    let path = format!(
        "{}/src/pod/setup/samples/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn studio(id: &str, host: &str, profile: &str, rdma: bool) -> Member {
    let buses = parse_thunderbolt(&sample(profile)).unwrap();
    let hw = parse_hardware_ports(&sample("networksetup-studio.txt"));
    Member {
        node_id: id.into(),
        host: host.into(),
        lan_ip: format!("10.0.0.{}", id.len()),
        rdma,
        ports: ports(&buses, &hw),
    }
}

#[test]
fn thunderbolt_ports_and_their_far_ends_are_read_from_system_profiler() {
    let buses = parse_thunderbolt(&sample("sp-thunderbolt-studio-a.json")).unwrap();
    assert_eq!(buses.len(), 3);
    assert_eq!(buses[0].tag, "1");
    assert_eq!(
        buses[0].connected_to.as_deref(),
        Some("C3D9A7B2-5E1F-4A80-8F3C-6B2E9D0A1C57")
    );
    assert_eq!(buses[1].connected_to, None, "nothing plugged in");
    assert_eq!(buses[2].connected_to, None, "a display is not a Mac");
    let hw = parse_hardware_ports(&sample("networksetup-studio.txt"));
    assert_eq!(hw["Thunderbolt 1"], "en2");
    assert_eq!(hw["Thunderbolt Bridge"], "bridge0");
    let p = ports(&buses, &hw);
    assert_eq!(
        p.iter().map(|p| p.iface.as_str()).collect::<Vec<_>>(),
        ["en2", "en3", "en4"]
    );
    assert!(parse_thunderbolt("{}").is_err());
    assert!(parse_thunderbolt("not json").is_err());
}

#[test]
fn two_cabled_studios_with_rdma_get_a_jaccl_hostfile() {
    let a = studio("aaaa", "studio-a", "sp-thunderbolt-studio-a.json", true);
    let b = studio("bbbbbb", "studio-b", "sp-thunderbolt-studio-b.json", true);
    // Order of discovery does not matter: both Macs write the same plan.
    let plan = super::plan(&[b.clone(), a.clone()], false).unwrap();
    assert_eq!(plan, super::plan(&[a.clone(), b.clone()], false).unwrap());
    assert_eq!(plan.topology, Topology::RdmaMesh);
    assert_eq!(plan.rank_of("aaaa"), Some(0));
    assert_eq!(plan.links, vec![vec![0, 1], vec![1, 0]]);
    let cfg = PodConfig::parse(&plan.hostfile.to_string()).unwrap();
    cfg.validate().unwrap();
    cfg.devices().check_mesh().unwrap();
    assert_eq!(cfg.hosts[0].rdma[1], vec!["rdma_en2".to_string()]);
    assert_eq!(cfg.hosts[1].rdma[0], vec!["rdma_en3".to_string()]);
    assert_eq!(
        plan.commands(0),
        [
            "ifconfig bridge0 down",
            "ifconfig en2 inet 192.168.0.1 netmask 255.255.255.252",
            "route change 192.168.0.2 -interface en2"
        ]
    );
    assert_eq!(
        plan.commands(1)[1],
        "ifconfig en3 inet 192.168.0.2 netmask 255.255.255.252"
    );

    // RDMA off on one Mac: asked for, it is refused with the fix; else TCP.
    let b_off = Member {
        rdma: false,
        ..b.clone()
    };
    let err = super::plan(&[a.clone(), b_off.clone()], true).unwrap_err();
    assert!(err.to_string().contains("rdma_ctl enable"), "{err}");
    assert!(err.to_string().contains("studio-b"), "{err}");
    let tcp = super::plan(&[a, b_off], false).unwrap();
    assert_eq!(tcp.topology, Topology::ThunderboltRing);
    let cfg = PodConfig::parse(&tcp.hostfile.to_string()).unwrap();
    assert!(!cfg.has_rdma());
}

/// `n` members cabled by `cables` (pairs of ranks), every member RDMA-enabled.
fn cabled(n: usize, cables: &[(usize, usize)]) -> Vec<Member> {
    let mut members: Vec<Member> = (0..n)
        .map(|i| Member {
            node_id: format!("{i:02}"),
            host: format!("mac-{i}"),
            lan_ip: format!("10.0.0.{}", i + 1),
            rdma: true,
            ports: Vec::new(),
        })
        .collect();
    for (k, &(i, j)) in cables.iter().enumerate() {
        let (ui, uj) = (format!("U{k}-{i}"), format!("U{k}-{j}"));
        let pi = members[i].ports.len();
        let pj = members[j].ports.len();
        members[i].ports.push(Port {
            iface: format!("en{}", pi + 2),
            uuid: ui.clone(),
            connected_to: Some(uj.clone()),
        });
        members[j].ports.push(Port {
            iface: format!("en{}", pj + 2),
            uuid: uj,
            connected_to: Some(ui),
        });
    }
    members
}

#[test]
fn cabling_decides_between_mesh_ring_and_lan_and_names_a_missing_cable() {
    // Four Macs, all six cables: RDMA mesh.
    let mesh = cabled(4, &[(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]);
    let p = plan(&mesh, true).unwrap();
    assert_eq!(p.topology, Topology::RdmaMesh);
    PodConfig::parse(&p.hostfile.to_string())
        .unwrap()
        .devices()
        .check_mesh()
        .unwrap();
    // One cable short: RDMA asked for names the pair; else a ring remains.
    let ring = cabled(4, &[(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)]);
    let err = plan(&ring, true).unwrap_err();
    assert!(
        err.to_string().contains("mac-1 and mac-3 are not cabled"),
        "{err}"
    );
    let p = plan(&ring, false).unwrap();
    assert_eq!(p.topology, Topology::ThunderboltRing);
    let cfg = PodConfig::parse(&p.hostfile.to_string()).unwrap();
    cfg.validate().unwrap();
    // Each rank listens on its cable from the previous rank of the ring.
    for (k, h) in cfg.hosts.iter().enumerate() {
        assert_eq!(h.ips.len(), 1, "rank {k}");
        assert!(h.ips[0].starts_with("192.168."), "{:?}", h.ips);
    }
    // A chain is no ring: the LAN it is.
    let chain = cabled(3, &[(0, 1), (1, 2)]);
    let p = plan(&chain, false).unwrap();
    assert_eq!(p.topology, Topology::Lan);
    assert!(p.commands(0).is_empty());
    let cfg = PodConfig::parse(&p.hostfile.to_string()).unwrap();
    assert_eq!(cfg.hosts[2].ips, vec!["10.0.0.3".to_string()]);
    assert!(matches!(
        plan(&chain[..1], false),
        Err(SetupError::TooFew(1))
    ));
}

#[test]
fn adverts_round_trip_through_txt_properties() {
    let m = studio("ab12", "studio-a", "sp-thunderbolt-studio-a.json", true);
    let props: BTreeMap<String, String> = m.properties().into_iter().collect();
    assert!(props.values().all(|v| v.len() < 255));
    let back = Member::from_properties(&|k| props.get(k).cloned()).unwrap();
    assert_eq!(back, m);
    let mut broken = props.clone();
    broken.insert("p0".into(), "en2".into());
    assert!(Member::from_properties(&|k| broken.get(k).cloned()).is_err());
    broken.remove("id");
    assert!(Member::from_properties(&|k| broken.get(k).cloned()).is_err());
}

#[test]
fn two_members_find_each_other_over_mdns_write_one_hostfile_and_measure_their_link() {
    let dir = tempfile::tempdir().unwrap();
    // Rank r listens on `port + r`: two free ports side by side, so a run
    // beside another (another suite, another checkout) does not collide.
    let port = free_port_pair();
    let me = |id: &str, host: &str| SetupArgs {
        me: Member {
            node_id: id.into(),
            host: host.into(),
            lan_ip: "127.0.0.1".into(),
            rdma: false,
            ports: Vec::new(),
        },
        members: 2,
        timeout: Duration::from_secs(60),
        port,
        output: dir.path().join(format!("{host}.json")),
        require_rdma: false,
        apply: false,
        measure: true,
    };
    let (a, b) = (me("aa01", "mac-a"), me("bb02", "mac-b"));
    let (ta, tb) = (a.clone(), b.clone());
    let ha = std::thread::spawn(move || run(&ta));
    let hb = std::thread::spawn(move || run(&tb));
    let (la, lb) = match (ha.join().unwrap(), hb.join().unwrap()) {
        (Ok(a), Ok(b)) => (a, b),
        (a, b) => panic!("set-up failed: {a:?} / {b:?}"),
    };
    assert!(la[0].contains("rank 0"), "{la:?}");
    assert!(lb[0].contains("rank 1"), "{lb:?}");
    // Both wrote the same hostfile, which the pod then reads.
    let fa = std::fs::read_to_string(&a.output).unwrap();
    assert_eq!(fa, std::fs::read_to_string(&b.output).unwrap());
    let cfg = PodConfig::parse(&fa).unwrap();
    assert_eq!(
        cfg.hosts.iter().map(|h| h.ssh.as_str()).collect::<Vec<_>>(),
        ["mac-a", "mac-b"]
    );
    // Rank 0 measured the link.
    assert!(
        la.iter()
            .any(|l| l.starts_with("link rank 0 - rank 1: latency")),
        "{la:?}"
    );
}

/// A port p with p and p + 1 both free on 127.0.0.1 just now.
fn free_port_pair() -> u16 {
    loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = first.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
}
