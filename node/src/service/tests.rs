//! Units from the config: quoting, the launchd plist read back with the
//! plist crate, and the committed `deploy/` units as this code writes them.

use super::*;

fn spec(config: &str) -> ServiceSpec {
    ServiceSpec::new(
        "/opt/mlx node/bin/mlx-node".into(),
        config.into(),
        "/home/ada/.mlx-node".into(),
        NodeMode::Idle,
    )
    .unwrap()
}

#[test]
fn systemd_words_are_quoted_and_specifiers_escaped() {
    assert_eq!(systemd_word("/usr/bin/mlx-node"), "/usr/bin/mlx-node");
    assert_eq!(systemd_word("/a b/c"), "\"/a b/c\"");
    assert_eq!(systemd_word("100%"), "100%%");
    assert_eq!(systemd_word("a\"b\\c$d"), "\"a\\\"b\\\\c$$d\"");
    let unit = systemd_unit(&spec("/home/ada/node.toml"), Scope::User);
    assert!(
        unit.contains(
            "ExecStart=\"/opt/mlx node/bin/mlx-node\" run --config /home/ada/node.toml \
             --data-dir /home/ada/.mlx-node\n"
        ),
        "{unit}"
    );
    assert!(unit.contains("WantedBy=default.target"), "{unit}");
    assert!(
        !unit.contains("User="),
        "a user unit runs as its user: {unit}"
    );
    assert!(matches!(
        ServiceSpec::new("mlx-node".into(), "/c".into(), "/d".into(), NodeMode::Idle),
        Err(ServiceError::Relative { what: "binary", .. })
    ));
}

#[test]
fn the_launchd_agent_parses_and_names_the_binary_and_config() {
    let s = spec("/Users/ada/Library/Application Support/mlx-node/node.toml");
    let text = launchd_plist(&s, Path::new("/Users/ada/Library/Logs/mlx-node")).unwrap();
    let v = plist::Value::from_reader_xml(text.as_bytes()).unwrap();
    let d = v.as_dictionary().unwrap();
    assert_eq!(d["Label"].as_string(), Some(LABEL));
    let args: Vec<&str> = d["ProgramArguments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_string().unwrap())
        .collect();
    assert_eq!(
        args,
        [
            "/opt/mlx node/bin/mlx-node",
            "run",
            "--config",
            "/Users/ada/Library/Application Support/mlx-node/node.toml",
            "--data-dir",
            "/home/ada/.mlx-node"
        ]
    );
    assert_eq!(d["RunAtLoad"].as_boolean(), Some(true));
    assert_eq!(d["ProcessType"].as_string(), Some("Background"));
    assert_eq!(
        d["StandardErrorPath"].as_string(),
        Some("/Users/ada/Library/Logs/mlx-node/mlx-node.log")
    );
    let keep = d["KeepAlive"].as_dictionary().unwrap();
    assert_eq!(keep["SuccessfulExit"].as_boolean(), Some(false));
}

#[test]
fn install_writes_and_uninstall_removes_the_unit_without_a_service_manager() {
    let dir = tempfile::tempdir().unwrap();
    let p = Paths {
        unit_file: dir.path().join("systemd/user/mlx-node.service"),
        logs: None,
    };
    let said = apply(Action::Install, &spec("/c/node.toml"), &p, false).unwrap();
    assert!(said.contains("mlx-node.service"), "{said}");
    let text = std::fs::read_to_string(&p.unit_file).unwrap();
    assert_eq!(text, systemd_unit(&spec("/c/node.toml"), Scope::User));
    apply(Action::Uninstall, &spec("/c/node.toml"), &p, false).unwrap();
    assert!(!p.unit_file.exists());
    // Removing what is not there is not an error.
    apply(Action::Uninstall, &spec("/c/node.toml"), &p, false).unwrap();
    let home = Path::new("/home/ada");
    if !cfg!(target_os = "macos") {
        assert_eq!(
            paths(home, None).unit_file,
            Path::new("/home/ada/.config/systemd/user/mlx-node.service")
        );
        assert_eq!(
            paths(home, Some(Path::new("/x"))).unit_file,
            Path::new("/x/systemd/user/mlx-node.service")
        );
    }
}

#[test]
fn the_deploy_units_are_what_this_code_writes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for (rel, want) in deploy_units().unwrap() {
        let got = std::fs::read_to_string(root.join(rel)).unwrap_or_default();
        assert_eq!(
            got, want,
            "{rel} differs from the generated unit: run `mlx-node service print --deploy deploy`"
        );
    }
}
