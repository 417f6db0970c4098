//! The real coordinator of the load runs, in a child process of the same
//! binary (`--coordinator-child DIR`), so its CPU time and memory are read
//! from `/proc` and it can be killed with SIGKILL and started again.
//!
//! The child builds `Application` on its data directory (SQLite, audits
//! off; or on `--database-url`), makes the load's client account and API key once (kept in
//! `DIR/load-key`, so a restarted child serves the same client), prints one
//! `READY <grpc> <quic> <fingerprint> <key>` line and runs until its stdin
//! closes. Started with `--grpc-port`/`--quic-port` it binds those ports
//! on 127.0.0.1, so nodes and clients find a restarted child where the
//! killed one was; the certificate is kept in the data directory.
//!
//! Failure: a child that does not print `READY` is an error naming the line
//! it printed instead.

use std::{
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{anyhow, bail, Context, Result};
use mlxnet_coordinator::{
    app::Application,
    config::CoordinatorConfig,
    ledger::{keys::Scopes, AccountKind},
};

use crate::{Args, GRANT};

/// The client key's file in the child's data directory.
const KEY_FILE: &str = "load-key";

/// Builds the coordinator on `dir`, makes the load's client (account,
/// grant, key), prints one `READY` line and runs until stdin closes.
pub(crate) async fn child(dir: PathBuf, args: &Args) -> Result<()> {
    let mut config = CoordinatorConfig::for_data_dir(dir.clone());
    let local = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
    config.grpc_addr = local(args.grpc_port);
    config.quic_addr = local(args.quic_port);
    config.database_url = args.database_url.clone();
    config.heartbeat_interval_ms = args.heartbeat_ms;
    config.heartbeat_timeout_ms = args.heartbeat_ms * 3;
    config.limits.max_node_connections = args.nodes + 64;
    config.limits.key_requests_per_sec = 0;
    config.limits.key_max_in_flight = 0;
    config.limits.max_in_flight_requests = 100_000;
    config.limits.max_queued_jobs = 1_000_000;
    let app = Application::build(config).await?;
    let key_file = dir.join(KEY_FILE);
    let secret = match std::fs::read_to_string(&key_file) {
        Ok(secret) => secret,
        Err(_) => {
            let ledger = app.ledger().clone();
            let account = ledger
                .create_account("load client", AccountKind::Client)
                .await?;
            ledger.grant("load", &account.id, GRANT, "load run").await?;
            let key = ledger
                .create_key(
                    &account.id,
                    Scopes::from_list(["submit", "read"]).map_err(|e| anyhow!("{e:?}"))?,
                    "load",
                    None,
                )
                .await?;
            let part = dir.join(format!("{KEY_FILE}.part"));
            std::fs::write(&part, key.secret())?;
            std::fs::rename(&part, &key_file)?;
            key.secret().to_owned()
        }
    };
    println!(
        "READY {} {} {} {}",
        app.grpc_addr(),
        app.quic_addr(),
        app.cert_fingerprint(),
        secret
    );
    app.run_until(async {
        // The parent holds stdin: its end (or death) stops the child.
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            std::io::stdin().read_to_end(&mut sink)
        })
        .await;
    })
    .await?;
    Ok(())
}

/// A running child and what its `READY` line said.
pub(crate) struct Coordinator {
    child: Child,
    pub(crate) grpc: String,
    pub(crate) quic: std::net::SocketAddr,
    pub(crate) fingerprint: String,
    pub(crate) key: String,
}

impl Coordinator {
    /// Starts a child on `dir`; `ports` (gRPC, QUIC) pins where it binds,
    /// `None` lets it choose.
    pub(crate) fn start(dir: &Path, args: &Args, ports: Option<(u16, u16)>) -> Result<Self> {
        let (grpc_port, quic_port) = ports.unwrap_or((0, 0));
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .arg("--coordinator-child")
            .arg(dir)
            .arg("--nodes")
            .arg(args.nodes.to_string())
            .arg("--heartbeat-ms")
            .arg(args.heartbeat_ms.to_string())
            .arg("--grpc-port")
            .arg(grpc_port.to_string())
            .arg("--quic-port")
            .arg(quic_port.to_string())
            .args(
                args.database_url
                    .iter()
                    .flat_map(|url| ["--database-url", url.as_str()]),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the coordinator child")?;
        let out = child.stdout.take().context("the child's stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let parts: Vec<&str> = line.split_whitespace().collect();
        let ["READY", grpc, quic, fingerprint, key] = parts[..] else {
            let _ = child.kill();
            bail!("the coordinator child did not start: {line:?}");
        };
        Ok(Self {
            grpc: format!("http://{grpc}"),
            quic: quic.parse()?,
            fingerprint: fingerprint.to_owned(),
            key: key.to_owned(),
            child,
        })
    }

    /// Resident memory (bytes) and CPU time (user + system, seconds).
    pub(crate) fn usage(&self) -> Result<(u64, f64)> {
        let pid = self.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let rss_kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .context("VmRSS")?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // Fields after the command name (which may hold spaces): utime and
        // stime are the 14th and 15th fields overall, in clock ticks
        // (USER_HZ, 100 on Linux).
        let rest = stat.rsplit_once(')').map(|(_, r)| r).context("stat")?;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
            + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
        Ok((rss_kb * 1024, ticks as f64 / 100.0))
    }
}

impl Coordinator {
    /// The ports it bound (gRPC, QUIC).
    pub(crate) fn ports(&self) -> Result<(u16, u16)> {
        let grpc: std::net::SocketAddr = self
            .grpc
            .trim_start_matches("http://")
            .parse()
            .context("the child's gRPC address")?;
        Ok((grpc.port(), self.quic.port()))
    }

    /// SIGKILL: the process stops dead, whatever it was writing.
    pub(crate) fn kill(mut self) -> Result<()> {
        self.child.kill().context("killing the coordinator child")?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}
