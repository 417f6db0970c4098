//! Samples in the tools' output format: `ibv_devices` as MLX's docs show it
//! on an M3 Ultra, `ibv_devinfo` as rdma-core prints it (Thunderbolt devices
//! named `rdma_enN`, one port each).

use super::*;

const IBV_DEVICES_M3_ULTRA: &str = "    device                 node GUID
    ------              ----------------
    rdma_en2            8096a9d9edbaac05
    rdma_en3            8196a9d9edbaac05
    rdma_en5            8396a9d9edbaac05
    rdma_en4            8296a9d9edbaac05
    rdma_en6            8496a9d9edbaac05
    rdma_en7            8596a9d9edbaac05
";

const IBV_DEVINFO: &str = "hca_id:\trdma_en3
\ttransport:\t\t\tInfiniBand (0)
\tfw_ver:\t\t\t\t0.0.0
\tnode_guid:\t\t\t8196:a9d9:edba:ac05
\tvendor_id:\t\t\t0x05ac
\tphys_port_cnt:\t\t\t1
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tmax_mtu:\t\t4096 (5)
\t\t\tactive_mtu:\t\t4096 (5)
\t\t\tlink_layer:\t\tEthernet

hca_id:\trdma_en4
\ttransport:\t\t\tInfiniBand (0)
\tphys_port_cnt:\t\t\t1
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_DOWN (1)
\t\t\tactive_mtu:\t\t1024 (3)
\t\t\tlink_layer:\t\tEthernet

hca_id:\trdma_en5
\ttransport:\t\t\tInfiniBand (0)
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tactive_mtu:\t\t4096 (5)
\t\t\tlink_layer:\t\tEthernet
";

#[test]
fn ibv_devices_lists_every_thunderbolt_port() {
    let d = parse_ibv_devices(IBV_DEVICES_M3_ULTRA).unwrap();
    assert_eq!(d.len(), 6);
    assert_eq!(d[2].name, "rdma_en5");
    assert_eq!(d[2].node_guid, "8396a9d9edbaac05");
    assert_eq!(
        parse_ibv_devices(
            "    device                 node GUID\n    ------              ----------------\n"
        )
        .unwrap(),
        vec![]
    );
    assert_eq!(
        parse_ibv_devices("command not found"),
        Err(DoctorError::NoDeviceTable)
    );
    assert_eq!(parse_ibv_devices(""), Err(DoctorError::NoDeviceTable));
}

#[test]
fn ibv_devinfo_gives_port_states() {
    let info = parse_ibv_devinfo(IBV_DEVINFO).unwrap();
    assert_eq!(info.len(), 3);
    assert_eq!(info[0].name, "rdma_en3");
    assert_eq!(info[0].transport.as_deref(), Some("InfiniBand (0)"));
    assert_eq!(info[0].ports[0].state, "PORT_ACTIVE");
    assert_eq!(info[0].ports[0].active_mtu, Some(4096));
    assert!(info[0].is_active());
    assert!(!info[1].is_active());
    assert!(matches!(
        parse_ibv_devinfo("\t\t\tstate:\tPORT_ACTIVE (4)"),
        Err(DoctorError::DevInfo { line: 1, .. })
    ));
    assert!(matches!(
        parse_ibv_devinfo("hca_id: x\n\t\tport:\tone"),
        Err(DoctorError::DevInfo { line: 2, .. })
    ));
}

#[test]
fn cabling_is_checked_against_the_pod_config() {
    let info = parse_ibv_devinfo(IBV_DEVINFO).unwrap();
    // Rank 0 of a 3-mesh uses rdma_en3 towards 1 and rdma_en4 towards 2.
    let m = DeviceMatrix::parse(
        r#"[[null, "rdma_en3", "rdma_en4"], ["rdma_en3", null, "rdma_en4"], ["rdma_en4", "rdma_en3", null]]"#,
    )
    .unwrap();
    assert_eq!(
        check_cabling(&m, 0, &info).unwrap(),
        vec![
            Finding::LinkUp {
                peer: 1,
                device: "rdma_en3".into()
            },
            Finding::LinkDown {
                peer: 2,
                device: "rdma_en4".into()
            },
            Finding::Unused {
                device: "rdma_en5".into()
            },
        ]
    );
    let wrong = DeviceMatrix::parse(r#"[[null, "rdma_en9"], ["rdma_en3", null]]"#).unwrap();
    assert_eq!(
        check_cabling(&wrong, 0, &info),
        Err(PodConfigError::UnknownDevice {
            rank: 0,
            device: "rdma_en9".into()
        })
    );
}

#[test]
fn report_names_each_link() {
    let cfg = r#"{"backend": "jaccl", "hosts": [
        {"ssh": "a", "ips": ["10.0.0.1"], "rdma": [null, "rdma_en3", "rdma_en4"]},
        {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", null, "rdma_en4"]},
        {"ssh": "c", "ips": ["10.0.0.3"], "rdma": ["rdma_en4", "rdma_en3", null]}]}"#;
    let lines = report(cfg, 0, Some(IBV_DEVINFO)).unwrap();
    assert!(lines.contains(&"config: valid".to_string()), "{lines:?}");
    assert!(
        lines.contains(&"link to rank 1 via rdma_en3: up".to_string()),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("link to rank 2 via rdma_en4: DOWN")),
        "{lines:?}"
    );
    let no_tools = report(cfg, 1, None).unwrap();
    assert!(no_tools.last().unwrap().contains("TCP only"));
    assert!(matches!(
        report(cfg, 3, None),
        Err(DoctorReportError::Config(
            PodConfigError::RankOutOfRange { .. }
        ))
    ));
}
