//! Samples written as MLX writes them (`mlx.distributed_config` output, the
//! ring hostfile of MLX's docs, JACCL's `MLX_IBV_DEVICES` file).

use std::collections::BTreeSet;

use super::*;

/// `mlx.distributed_config --backend jaccl` for four M3 Ultras (full mesh).
const JACCL_MESH_4: &str = r#"{
    "backend": "jaccl",
    "envs": ["MLX_METAL_FAST_SYNCH=1"],
    "hosts": [
        {"ssh": "m3-ultra-1", "ips": ["192.168.1.10"], "rdma": [null, "rdma_en5", "rdma_en4", "rdma_en3"]},
        {"ssh": "m3-ultra-2", "ips": ["192.168.1.11"], "rdma": ["rdma_en5", null, "rdma_en3", "rdma_en4"]},
        {"ssh": "m3-ultra-3", "ips": ["192.168.1.12"], "rdma": ["rdma_en4", "rdma_en3", null, "rdma_en5"]},
        {"ssh": "m3-ultra-4", "ips": ["192.168.1.13"], "rdma": ["rdma_en3", "rdma_en4", "rdma_en5", null]}
    ]
}"#;

/// MLX's ring hostfile (list form, no backend key).
const RING_4: &str = r#"[
    {"ssh": "hostname1", "ips": ["123.123.123.1"]},
    {"ssh": "hostname2", "ips": ["123.123.123.2"]},
    {"ssh": "hostname3", "ips": ["123.123.123.3"]},
    {"ssh": "hostname4", "ips": ["123.123.123.4"]}
]"#;

/// `--backend jaccl-ring` with two cables per link (device lists).
const JACCL_RING_4: &str = r#"{
    "backend": "jaccl-ring",
    "envs": [],
    "hosts": [
        {"ssh": "a", "ips": ["10.0.0.1"], "rdma": [null, ["rdma_en2", "rdma_en3"], null, ["rdma_en4", "rdma_en5"]]},
        {"ssh": "b", "ips": ["10.0.0.2"], "rdma": [["rdma_en2", "rdma_en3"], null, ["rdma_en4", "rdma_en5"], null]},
        {"ssh": "c", "ips": ["10.0.0.3"], "rdma": [null, ["rdma_en2", "rdma_en3"], null, ["rdma_en4", "rdma_en5"]]},
        {"ssh": "d", "ips": ["10.0.0.4"], "rdma": [["rdma_en2", "rdma_en3"], null, ["rdma_en4", "rdma_en5"], null]}
    ]
}"#;

/// JACCL's bare device file from MLX's docs.
const IBV_DEVICES_4: &str = r#"[
   [null, "rdma_en5", "rdma_en4", "rdma_en3"],
   ["rdma_en5", null, "rdma_en3", "rdma_en4"],
   ["rdma_en4", "rdma_en3", null, "rdma_en5"],
   ["rdma_en3", "rdma_en4", "rdma_en5", null]
]"#;

#[test]
fn mlx_jaccl_hostfile_parses_and_is_a_mesh() {
    let cfg = PodConfig::parse(JACCL_MESH_4).unwrap();
    assert_eq!(cfg.backend, Some(PodBackend::Jaccl));
    assert_eq!(cfg.envs, vec!["MLX_METAL_FAST_SYNCH=1".to_string()]);
    assert_eq!(cfg.size(), 4);
    assert_eq!(cfg.hosts[1].ssh, "m3-ultra-2");
    assert_eq!(cfg.hosts[0].rdma[2], vec!["rdma_en4".to_string()]);
    assert!(cfg.hosts[0].rdma[0].is_empty());
    assert!(cfg.has_rdma());
    cfg.validate().unwrap();
}

#[test]
fn mlx_ring_hostfile_parses_without_rdma() {
    let cfg = PodConfig::parse(RING_4).unwrap();
    assert_eq!(cfg.backend, None);
    assert!(!cfg.has_rdma());
    assert_eq!(cfg.hosts[3].ips, vec!["123.123.123.4".to_string()]);
    cfg.validate().unwrap();
}

#[test]
fn jaccl_ring_with_two_cables_per_link_is_a_ring_not_a_mesh() {
    let cfg = PodConfig::parse(JACCL_RING_4).unwrap();
    assert_eq!(cfg.backend, Some(PodBackend::JacclRing));
    assert_eq!(cfg.hosts[0].rdma[1].len(), 2);
    cfg.validate().unwrap();
    assert_eq!(
        cfg.devices().check_mesh(),
        Err(PodConfigError::MeshIncomplete { from: 0, to: 2 })
    );
}

#[test]
fn bare_device_file_equals_the_hostfile_matrix() {
    let m = DeviceMatrix::parse(IBV_DEVICES_4).unwrap();
    assert_eq!(m, PodConfig::parse(JACCL_MESH_4).unwrap().devices());
    m.check_mesh().unwrap();
    m.check_ring().unwrap();
}

#[test]
fn missing_cable_in_a_mesh_is_named() {
    let json = JACCL_MESH_4
        .replace(
            r#"[null, "rdma_en5", "rdma_en4", "rdma_en3"]"#,
            r#"[null, "rdma_en5", null, "rdma_en3"]"#,
        )
        .replace(
            r#"["rdma_en4", "rdma_en3", null, "rdma_en5"]"#,
            r#"[null, "rdma_en3", null, "rdma_en5"]"#,
        );
    let cfg = PodConfig::parse(&json).unwrap();
    assert_eq!(
        cfg.validate(),
        Err(PodConfigError::MeshIncomplete { from: 0, to: 2 })
    );
}

#[test]
fn one_sided_cable_is_asymmetric() {
    let m = DeviceMatrix::parse(r#"[[null, "rdma_en2", "rdma_en3"], [null, null, "rdma_en3"], ["rdma_en3", "rdma_en3", null]]"#).unwrap();
    assert_eq!(
        m.check_symmetric(),
        Err(PodConfigError::Asymmetric {
            from: 0,
            to: 1,
            forward: 1,
            backward: 0
        })
    );
    // The mesh check reports the missing direction first.
    assert_eq!(
        m.check_mesh(),
        Err(PodConfigError::MeshIncomplete { from: 1, to: 0 })
    );
}

#[test]
fn broken_ring_names_the_gap() {
    // 0-1 and 1-2 cabled, 2-3 missing, 3-0 cabled.
    let m = DeviceMatrix::parse(
        r#"[[null, "a", null, "b"], ["a", null, "c", null], [null, "c", null, null], ["b", null, null, null]]"#,
    )
    .unwrap();
    assert_eq!(
        m.check_ring(),
        Err(PodConfigError::RingBroken { from: 2, to: 3 })
    );
}

#[test]
fn unknown_device_is_named() {
    let m = DeviceMatrix::parse(IBV_DEVICES_4).unwrap();
    let here: BTreeSet<String> = ["rdma_en3", "rdma_en5"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        m.check_devices(0, &here),
        Err(PodConfigError::UnknownDevice {
            rank: 0,
            device: "rdma_en4".into()
        })
    );
    let all: BTreeSet<String> = ["rdma_en3", "rdma_en4", "rdma_en5"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    m.check_devices(3, &all).unwrap();
    assert_eq!(
        m.check_devices(4, &all),
        Err(PodConfigError::RankOutOfRange { rank: 4, hosts: 4 })
    );
}

#[test]
fn malformed_files_are_rejected_with_their_reason() {
    assert!(matches!(
        PodConfig::parse("{"),
        Err(PodConfigError::Json(_))
    ));
    assert!(matches!(
        PodConfig::parse(r#"[{"ips": ["1.2.3.4"]}]"#),
        Err(PodConfigError::Json(_))
    ));
    assert_eq!(PodConfig::parse("[]"), Err(PodConfigError::NoHosts));
    assert_eq!(
        PodConfig::parse(r#"{"hosts": []}"#),
        Err(PodConfigError::NoHosts)
    );
    assert_eq!(
        PodConfig::parse(r#"[{"ssh": "", "ips": []}]"#),
        Err(PodConfigError::EmptyHostName { rank: 0 })
    );
    assert_eq!(
        PodConfig::parse(
            r#"[{"ssh": "a", "rdma": [null, "x", "y"]}, {"ssh": "b", "rdma": ["x", null]}]"#
        ),
        Err(PodConfigError::MatrixSize {
            rank: 0,
            len: 3,
            hosts: 2
        })
    );
    assert_eq!(
        PodConfig::parse(
            r#"[{"ssh": "a", "rdma": ["x", "y"]}, {"ssh": "b", "rdma": ["y", null]}]"#
        ),
        Err(PodConfigError::SelfLink { rank: 0 })
    );
    assert_eq!(
        DeviceMatrix::parse(r#"[[null, ""], ["x", null]]"#),
        Err(PodConfigError::EmptyDevice { rank: 0 })
    );
    assert_eq!(
        PodConfig::parse(
            r#"{"backend": "ring", "hosts": [{"ssh": "a", "ips": ["1.1.1.1"]}, {"ssh": "b"}]}"#
        )
        .unwrap()
        .validate(),
        Err(PodConfigError::NoIp {
            rank: 1,
            backend: "ring"
        })
    );
}

#[test]
fn each_rank_picks_its_device_towards_every_peer() {
    let m = PodConfig::parse(JACCL_MESH_4).unwrap().devices();
    let some = |d: &str| Some(d.to_string());
    assert_eq!(
        m.peer_devices(0).unwrap(),
        vec![None, some("rdma_en5"), some("rdma_en4"), some("rdma_en3")]
    );
    assert_eq!(
        m.peer_devices(2).unwrap(),
        vec![some("rdma_en4"), some("rdma_en3"), None, some("rdma_en5")]
    );
    // Two cables per link: the first cable's device.
    let two = DeviceMatrix::parse(
        r#"[[null, ["rdma_en2", "rdma_en3"]], [["rdma_en4", "rdma_en5"], null]]"#,
    )
    .unwrap();
    assert_eq!(two.peer_devices(1).unwrap(), vec![some("rdma_en4"), None]);
    // A ring is not enough for the verbs transport's direct exchanges.
    let ring = PodConfig::parse(JACCL_RING_4).unwrap().devices();
    assert_eq!(
        ring.peer_devices(1),
        Err(PodConfigError::MeshIncomplete { from: 0, to: 2 })
    );
    assert_eq!(
        m.peer_devices(4),
        Err(PodConfigError::RankOutOfRange { rank: 4, hosts: 4 })
    );
}
