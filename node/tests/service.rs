//! `mlx-node service` with the real binary: the systemd user unit it
//! installs passes `systemd-analyze verify`, and the launchd agent it
//! writes parses as a plist naming this binary and the config.

// A test crate: its helpers panic on a broken fixture, as its tests do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// `mlx-node <args>` with `home` as HOME and no node variables.
fn mlx_node(home: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mlx-node"));
    cmd.args(args)
        .env("HOME", home)
        .env_remove("XDG_CONFIG_HOME");
    for (k, _) in std::env::vars() {
        if k.starts_with("MLX_NODE__") {
            cmd.env_remove(k);
        }
    }
    cmd.output().expect("mlx-node runs")
}

/// [`mlx_node`] that must succeed: its stdout.
fn mlx_node_ok(home: &Path, args: &[&str]) -> Vec<u8> {
    let out = mlx_node(home, args);
    assert!(
        out.status.success(),
        "mlx-node {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// `mlx-node service <action> --no-activate --config <cfg> --data-dir <data>`.
fn service(home: &Path, action: &str, cfg: &Path, data: &Path) {
    mlx_node_ok(
        home,
        &[
            "service",
            action,
            "--no-activate",
            "--config",
            cfg.to_str().unwrap(),
            "--data-dir",
            data.to_str().unwrap(),
        ],
    );
}

/// A node config in a folder whose name has a space (as "Application Support").
fn config(dir: &Path) -> PathBuf {
    let folder = dir.join("my config");
    std::fs::create_dir_all(&folder).unwrap();
    let file = folder.join("node.toml");
    std::fs::write(
        &file,
        "coordinator = \"coord.example:7071\"\nmode = \"idle\"\n[lending]\nmin_idle_s = 120\n",
    )
    .unwrap();
    file
}

fn binary() -> String {
    std::fs::canonicalize(env!("CARGO_BIN_EXE_mlx-node"))
        .unwrap()
        .display()
        .to_string()
}

#[test]
fn the_installed_systemd_user_unit_passes_systemd_analyze_verify() {
    if cfg!(target_os = "macos") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let cfg = config(dir.path());
    let data = dir.path().join("data");
    service(&home, "install", &cfg, &data);
    let unit = home.join(".config/systemd/user/mlx-node.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    let exec = text
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap();
    let cfg = std::fs::canonicalize(&cfg).unwrap();
    assert_eq!(
        exec,
        format!(
            "{} run --config \"{}\" --data-dir {}",
            binary(),
            cfg.display(),
            std::fs::canonicalize(&data).unwrap().display()
        )
    );
    let verify = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze runs (apt-get install systemd)");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    assert!(
        verify.status.success(),
        "systemd-analyze verify: {said}\n{text}"
    );
    assert!(
        !said.contains("mlx-node.service:"),
        "warnings about the unit: {said}"
    );

    service(&home, "uninstall", &cfg, &data);
    assert!(!unit.exists());
}

#[test]
fn the_launchd_agent_parses_and_names_the_real_binary_and_config() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let cfg = config(dir.path());
    let out = mlx_node_ok(
        &home,
        &[
            "service",
            "print",
            "--launchd",
            "--config",
            cfg.to_str().unwrap(),
        ],
    );
    let v = plist::Value::from_reader_xml(&out[..]).expect("a plist");
    let d = v.as_dictionary().unwrap();
    let args: Vec<&str> = d["ProgramArguments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_string().unwrap())
        .collect();
    assert_eq!(args[0], binary());
    assert!(Path::new(args[0]).is_file());
    assert_eq!(args[1..3], ["run", "--config"]);
    assert_eq!(
        args[3],
        std::fs::canonicalize(&cfg).unwrap().to_str().unwrap()
    );
    assert_eq!(d["Label"].as_string(), Some("network.mlx.node"));
    // The config's mode (idle) makes it a background process.
    assert_eq!(d["ProcessType"].as_string(), Some("Background"));
    // Without a config file there is nothing to install.
    let out = mlx_node(
        &home,
        &["service", "print", "--config", "/nonexistent/node.toml"],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("write that config first"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
