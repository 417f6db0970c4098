//! `devnet`: a whole mlx-network on this machine, for trying it out.
//!
//! Fetches the test model if it is absent (through the project's own script),
//! starts a coordinator on the embedded SQLite default and one node serving
//! the model, creates a demo client account with a starting balance and an
//! API key (kept in the data directory, so every run has the same key) and
//! an operator account the node earns for, prints their addresses and the
//! key, runs a sample chat job and prints its streamed answer, its verified
//! claim, what it cost and what the node earned. Then it keeps running, so `mlxnet`
//! and other nodes can use it, until Ctrl-C (or exits at once with
//! `--exit-after-sample`).
//!
//! It also serves `models/` as a catalogue mirror (HTTP with Range) and lists
//! Gemma 3 270M in its catalogue, so a newcomer's node can pull a model and
//! serve it: `mlx-node models pull gemma3-270m --mirror http://<mirror>/`,
//! then `mlx-node run --coordinator ... --fingerprint ...`.

use std::{io::Write, net::SocketAddr, path::PathBuf, process::Command};

use anyhow::{bail, Context};
use clap::Parser;
use mlx_node::config::Location;
use mlxnet_proto::{claim, v1::job_event, v1::WatchJobRequest};
use mlxnet_tests::{
    catalogue_model, chat_job, coordinator_config, repo_root, spawn_coordinator, spawn_node,
    TestCoordinator,
};

#[derive(Parser)]
#[command(about = "Run a local mlx-network: coordinator, one node, a sample job")]
struct Args {
    /// Where the coordinator's database and certificate and the node's key live.
    #[arg(long, default_value = ".devnet")]
    data_dir: PathBuf,
    /// gRPC address for clients (`mlxnet --coordinator http://ADDR`).
    #[arg(long, default_value = "127.0.0.1:7070")]
    grpc_addr: SocketAddr,
    /// QUIC address nodes dial (UDP).
    #[arg(long, default_value = "127.0.0.1:7071")]
    quic_addr: SocketAddr,
    /// HTTP address (health, metrics, World page).
    #[arg(long, default_value = "127.0.0.1:7080")]
    http_addr: SocketAddr,
    /// HTTP address of the model mirror (the files of `models/`).
    #[arg(long, default_value = "127.0.0.1:7090")]
    mirror_addr: SocketAddr,
    /// Let the OS pick every port (for tests and busy machines).
    #[arg(long)]
    ephemeral_ports: bool,
    /// The sample question.
    #[arg(long, default_value = "What is the capital of France?")]
    question: String,
    /// Stop once the sample job has been shown.
    #[arg(long)]
    exit_after_sample: bool,
    /// Where the devnet's node says it is (coarse; shown on the World page).
    #[arg(long, default_value = "Lyon, France")]
    place: String,
    #[arg(long, default_value_t = 45.76, allow_hyphen_values = true)]
    lat: f64,
    #[arg(long, default_value_t = 4.84, allow_hyphen_values = true)]
    lon: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .init();
    }
    ensure_test_model()?;

    let coord_dir = args.data_dir.join("coordinator");
    std::fs::create_dir_all(&coord_dir)
        .with_context(|| format!("creating {}", coord_dir.display()))?;
    let mut config = coordinator_config(&coord_dir);
    if !args.ephemeral_ports {
        config.grpc_addr = args.grpc_addr;
        config.quic_addr = args.quic_addr;
        config.http_addr = args.http_addr;
    }
    // Every built-in catalogue model the devnet has the file of.
    let models_dir = repo_root().join("models");
    for entry in mlxnet_proto::catalogue::Catalogue::builtin().models {
        let present = models_dir.join(&entry.primary_file().name).is_file();
        if present && !config.catalogue.iter().any(|m| m.id == entry.id) {
            config.catalogue.push(catalogue_model(&entry));
        }
    }
    let mirror_addr = if args.ephemeral_ports {
        SocketAddr::from(([127, 0, 0, 1], 0))
    } else {
        args.mirror_addr
    };
    let mirror = mlxnet_tests::mirror::serve_dir(
        models_dir,
        tokio::net::TcpListener::bind(mirror_addr)
            .await
            .with_context(|| format!("binding the model mirror on {mirror_addr}"))?,
    )?;
    let coordinator = spawn_coordinator(config).await?;
    println!("coordinator");
    println!("  grpc   http://{}", coordinator.grpc_addr);
    println!("  quic   {}", coordinator.quic_addr);
    println!("  http   http://{}", coordinator.http_addr);
    println!("  certificate sha256 {}", coordinator.fingerprint);
    println!("model mirror {}", mirror.base_url());
    for m in &config_catalogue(&coordinator) {
        println!("  catalogue: {m}");
    }
    let accounts = coordinator.accounts.clone();
    println!("demo client account {}", accounts.client_account);
    println!("  API key (submit, read)  {}", accounts.client_key);
    println!(
        "operator account {} (the node earns into it)",
        accounts.operator_account
    );
    println!("  API key (read)          {}", accounts.operator_key);
    println!("admin API key             {}", accounts.admin_key);

    let node_dir = args.data_dir.join("node");
    let mut node_config = coordinator.node_config(&node_dir, "devnet-node");
    // A place, so a newcomer's World page shows the devnet's Mac on the map.
    node_config.location = Some(Location {
        place: Some(args.place.clone()),
        lat: Some(args.lat),
        lon: Some(args.lon),
        hidden: None,
    });
    let mut node = spawn_node(node_config).await?;
    node.registered().await?;
    println!("node {} registered at {}", node.id, args.place);
    match world_on_map(coordinator.http_addr).await {
        Ok(n) => println!(
            "World page http://{}/: {n} Mac(s) on the map",
            coordinator.http_addr
        ),
        Err(e) => println!("World page: cannot read its totals: {e:#}"),
    }

    let mut client = coordinator.client().await?;
    let request = chat_job(&args.question, 64);
    let sent_input = request.input.clone().unwrap_or_default();
    let job = client.jobs.submit(request).await?.into_inner();
    println!("\njob {} ({})", job.id, job.model);
    println!("> {}", args.question);
    let mut events = client
        .jobs
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await?
        .into_inner();
    let mut done = None;
    while let Some(event) = events.message().await? {
        match event.event {
            Some(job_event::Event::Tokens(t)) => {
                print!("{}", t.text);
                std::io::stdout().flush()?;
            }
            Some(job_event::Event::Completed(c)) => {
                done = c.job;
                break;
            }
            Some(job_event::Event::Failed(f)) => bail!("job failed: {}", f.reason),
            Some(job_event::Event::Cancelled(_)) => bail!("job cancelled"),
            _ => {}
        }
    }
    let job = done.context("the job's stream ended without a result")?;
    let signed = job
        .result
        .context("completed job carries no signed claim")?;
    let signer = claim::verify(&signed).context("the result's signature does not verify")?;
    let c = signed.claim.unwrap_or_default();
    if c.prompt_sha256 != claim::input_digest(&sent_input) {
        bail!("the claim is about another prompt");
    }
    println!("\n");
    println!(
        "completed: {} tokens in, {} out; prefill {:.0} ms, decode {:.0} ms",
        c.prompt_tokens,
        c.completion_tokens,
        c.prefill_micros as f64 / 1e3,
        c.decode_micros as f64 / 1e3
    );
    println!("verified: signed by {signer}");
    let balance = client
        .accounts
        .balance(mlxnet_proto::v1::BalanceRequest {})
        .await?
        .into_inner();
    println!(
        "balance: {} micro-MLX ({} held)",
        balance.balance_micro_mlx, balance.held_micro_mlx
    );
    let earned = coordinator
        .client_with(Some(&accounts.operator_key))
        .await?
        .accounts
        .earnings(mlxnet_proto::v1::EarningsRequest {})
        .await?
        .into_inner();
    let all = earned.all_time.unwrap_or_default();
    println!(
        "operator earned: {} micro-MLX for {} jobs, {} tokens (all time)",
        all.micro_mlx, all.jobs, all.tokens
    );

    if args.exit_after_sample {
        node.stop().await?;
        coordinator.stop().await?;
        return Ok(());
    }
    println!(
        "\nthe network keeps running; try:\n  export MLXNET_API_KEY={}\n  cargo run --bin mlxnet -- --coordinator http://{} submit --model smollm2-135m-instruct \"Tell me about Macs\"\n  cargo run --bin mlxnet -- --coordinator http://{} balance",
        accounts.client_key, coordinator.grpc_addr, coordinator.grpc_addr
    );
    println!(
        "a second node of your own, with a model pulled from the mirror:\n  cargo run --release --bin mlx-node -- models --data-dir /tmp/newcomer pull gemma3-270m --mirror {}\n  MLX_NODE__OPERATOR_ACCOUNT={} cargo run --release --bin mlx-node -- run --data-dir /tmp/newcomer --coordinator {} --fingerprint {}\n  cargo run --bin mlxnet -- --coordinator http://{} submit --model gemma3-270m --raw \"The capital of France is\"\nCtrl-C stops it.",
        mirror.base_url(),
        accounts.operator_account,
        coordinator.quic_addr,
        coordinator.fingerprint,
        coordinator.grpc_addr
    );
    tokio::signal::ctrl_c().await?;
    node.stop().await?;
    coordinator.stop().await?;
    Ok(())
}

/// The catalogue the coordinator was started with, one line per model.
fn config_catalogue(coordinator: &TestCoordinator) -> Vec<String> {
    coordinator
        .config
        .catalogue
        .iter()
        .map(|m| {
            format!(
                "{} ({}, {} bytes, sha256 {})",
                m.id, m.architecture, m.size_bytes, m.sha256
            )
        })
        .collect()
}

/// `macs_on_map` of the World page's totals (`/api/world/totals`), read
/// with a plain HTTP/1.1 GET.
async fn world_on_map(addr: SocketAddr) -> anyhow::Result<u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let head =
        format!("GET /api/world/totals HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let (_, body) = text
        .split_once("\r\n\r\n")
        .context("no HTTP body in the World API's answer")?;
    let totals: serde_json::Value = serde_json::from_str(body.trim())?;
    totals["macs_on_map"]
        .as_u64()
        .context("no macs_on_map in the World totals")
}

/// Runs `scripts/fetch-test-model.sh` (idempotent) so a fresh clone works.
fn ensure_test_model() -> anyhow::Result<()> {
    let script = repo_root().join("scripts/fetch-test-model.sh");
    let status = Command::new("bash")
        .arg(&script)
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("{} failed ({status})", script.display());
    }
    Ok(())
}
