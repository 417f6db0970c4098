//! `mlxnet`: the mlx-network client. Submits jobs and streams their tokens,
//! checks every result offline (`claim::verify_chain`: each signed claim,
//! that they are about the prompt that was sent and bind the job's grammar,
//! if it has one, and for a job resumed after
//! a hand-off that the drained nodes' partial claims and the result's cover
//! every token in order; `mlxnet verify <job>` later, also against the
//! catalogue's model digest), and shows jobs, models, the network, the
//! account's balance and history; manages API keys; and, with an admin key,
//! creates accounts and grants MLX tokens.
//!
//! Amounts print in MLX with six decimals (1 MLX = 1,000,000 micro-MLX).
//!
//! One function per subcommand, each given the connection (a channel whose
//! calls carry the API key); `main` parses the flags, connects and calls it.
//!
//! Exits non-zero with the gRPC status message on any error.

use std::{io::Write, process::ExitCode};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use mlxnet_proto::{
    bearer::{Authed, Bearer},
    money::mlx,
};
use mlxnet_proto::{
    claim,
    v1::{
        accounts_client::AccountsClient, job_event, job_input, jobs_client::JobsClient,
        models_client::ModelsClient, network_client::NetworkClient, BalanceRequest, ChatMessage,
        ChatMessages, CreateAccountRequest, CreateApiKeyRequest, GetJobRequest, GrantRequest,
        HistoryRequest, Job, JobInput, JobState, ListApiKeysRequest, ListJobsRequest,
        ListModelsRequest, NetworkStatsRequest, RevokeApiKeyRequest, SamplingParams,
        SubmitJobRequest, WatchJobRequest,
    },
};
use tonic::{transport::Channel, Status};

#[derive(Parser)]
#[command(name = "mlxnet", version, about = "mlx-network client")]
struct Cli {
    /// The coordinator's gRPC address.
    #[arg(
        long,
        global = true,
        env = "MLXNET_COORDINATOR",
        default_value = "http://127.0.0.1:7070"
    )]
    coordinator: String,
    /// API key, sent as `authorization: Bearer <key>`.
    #[arg(long, global = true, env = "MLXNET_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Submit a job, stream its tokens, and verify its signed result.
    Submit {
        /// Catalogue model id (see `mlxnet models`).
        #[arg(long)]
        model: String,
        /// Send the prompt as raw text instead of one user chat message.
        #[arg(long)]
        raw: bool,
        /// System message sent before the prompt (empty: none, so the model's
        /// template default applies). Small models answer far better with one.
        #[arg(long, default_value = "You are a helpful assistant.")]
        system: String,
        /// Most tokens to generate (0: the coordinator's default).
        #[arg(long, default_value_t = 0)]
        max_tokens: u32,
        /// Sampling temperature (0: greedy).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Seed for sampling (default: the coordinator picks and records one).
        #[arg(long)]
        seed: Option<u64>,
        /// Refuse the job if it may cost more than this many micro-MLX (0: no limit).
        #[arg(long, default_value_t = 0)]
        max_price: u64,
        /// 0 to 3: runs before this account's lower-priority queued jobs
        /// (other accounts keep their fair share).
        #[arg(long, default_value_t = 0)]
        priority: u32,
        /// The prompt.
        prompt: String,
    },
    /// Show one job.
    Job { id: String },
    /// Fetch a job's stored signed result and check it offline: the ed25519
    /// signature, that it names this job and the node that ran it, that its
    /// input digest is the job's input (or the prompt given here, built as
    /// `submit` builds it), and that its model digest is the catalogue's; for
    /// a job resumed after a hand-off, each drained node's partial claim too,
    /// and that the claims cover every token of the output in order.
    Verify {
        /// The job id.
        job: String,
        /// Check against this prompt (what you sent) instead of the input
        /// the coordinator returns.
        #[arg(long)]
        prompt: Option<String>,
        /// With --prompt: it was sent as raw text.
        #[arg(long)]
        raw: bool,
        /// With --prompt: the system message it was sent with (empty: none).
        #[arg(long, default_value = "You are a helpful assistant.")]
        system: String,
    },
    /// List recent jobs.
    Jobs {
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// List the model catalogue.
    Models,
    /// Show network totals.
    Network,
    /// Show the account balance.
    Balance,
    /// Show the account's recent transfers (newest first).
    History {
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// Manage API keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Create a client or operator account (admin key).
    CreateAccount {
        #[arg(long)]
        name: String,
        /// client or operator.
        #[arg(long, default_value = "client")]
        kind: String,
    },
    /// Grant MLX tokens from the treasury to an account (admin key).
    Grant {
        #[arg(long)]
        account: String,
        /// Amount in micro-MLX.
        #[arg(long)]
        micro_mlx: u64,
        /// Makes a retried grant move nothing more.
        #[arg(long)]
        idempotency_key: String,
        #[arg(long, default_value = "")]
        memo: String,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Create a key; it is printed once and never again.
    Create {
        /// Account (default: the caller's own; another needs an admin key).
        #[arg(long, default_value = "")]
        account: String,
        /// Comma-separated: submit, read, admin.
        #[arg(long, default_value = "submit,read")]
        scopes: String,
        #[arg(long, default_value = "")]
        label: String,
        /// Lifetime in seconds (0: never expires).
        #[arg(long, default_value_t = 0)]
        ttl_seconds: u64,
    },
    /// Revoke a key by its id (`key_...`).
    Revoke { key_id: String },
    /// List an account's keys (never their secrets).
    List {
        #[arg(long, default_value = "")]
        account: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            match e.downcast_ref::<Status>() {
                Some(s) => eprintln!("error: {} ({:?})", s.message(), s.code()),
                None => eprintln!("error: {e:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

/// A connection to the coordinator: the channel, and the same channel with
/// the API key on every call.
struct Conn {
    channel: Channel,
    authed: Authed,
}

impl Conn {
    async fn open(cli: &Cli) -> anyhow::Result<Self> {
        let bearer = Bearer::for_key(cli.api_key.as_deref())
            .context("the API key must be printable ASCII")?;
        let channel = Channel::from_shared(cli.coordinator.clone())
            .with_context(|| format!("invalid coordinator address {:?}", cli.coordinator))?
            .connect()
            .await
            .with_context(|| format!("cannot reach the coordinator at {}", cli.coordinator))?;
        Ok(Self {
            authed: mlxnet_proto::bearer::authed(channel.clone(), bearer),
            channel,
        })
    }

    fn jobs(&self) -> JobsClient<Authed> {
        JobsClient::new(self.authed.clone())
    }

    fn models(&self) -> ModelsClient<Authed> {
        ModelsClient::new(self.authed.clone())
    }

    fn accounts(&self) -> AccountsClient<Authed> {
        AccountsClient::new(self.authed.clone())
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let conn = Conn::open(&cli).await?;
    match cli.command {
        Command::Submit {
            model,
            raw,
            system,
            max_tokens,
            temperature,
            seed,
            max_price,
            priority,
            prompt,
        } => {
            let input = job_input_of(prompt, raw, system);
            let request = SubmitJobRequest {
                model,
                input: Some(input.clone()),
                sampling: Some(SamplingParams {
                    temperature,
                    seed,
                    max_tokens,
                    ..Default::default()
                }),
                max_price_micro_mlx: max_price,
                priority,
            };
            submit(conn.jobs(), request, &input).await
        }
        Command::Job { id } => job(&conn, id).await,
        Command::Verify {
            job,
            prompt,
            raw,
            system,
        } => verify(&conn, job, prompt.map(|p| job_input_of(p, raw, system))).await,
        Command::Jobs { limit } => jobs(&conn, limit).await,
        Command::Models => models(&conn).await,
        Command::Network => network(&conn).await,
        Command::Balance => balance(&conn).await,
        Command::History { limit } => history(&conn, limit).await,
        Command::Keys(KeysCommand::Create {
            account,
            scopes,
            label,
            ttl_seconds,
        }) => create_key(&conn, account, scopes, label, ttl_seconds).await,
        Command::Keys(KeysCommand::Revoke { key_id }) => revoke_key(&conn, key_id).await,
        Command::Keys(KeysCommand::List { account }) => list_keys(&conn, account).await,
        Command::CreateAccount { name, kind } => create_account(&conn, name, kind).await,
        Command::Grant {
            account,
            micro_mlx,
            idempotency_key,
            memo,
        } => grant(&conn, account, micro_mlx, idempotency_key, memo).await,
    }
}

/// `mlxnet job <id>`: the job, its output, and whether its claim verifies.
async fn job(conn: &Conn, id: String) -> anyhow::Result<()> {
    let job = conn
        .jobs()
        .get(GetJobRequest { job_id: id })
        .await?
        .into_inner();
    print_job(&job);
    if !job.output_text.is_empty() {
        println!("output: {}", job.output_text);
    }
    if job.result.is_some() {
        let input = job.input.clone().unwrap_or_default();
        match verify_job(&job, &input, None) {
            Ok(chain) => print_chain(&chain),
            Err(e) => println!("{e:#}"),
        }
    }
    Ok(())
}

/// `mlxnet verify <job>`: checks the stored signed result offline against
/// `sent` (or the job's own input) and the catalogue's model digest.
async fn verify(conn: &Conn, job: String, sent: Option<JobInput>) -> anyhow::Result<()> {
    let job = conn
        .jobs()
        .get(GetJobRequest { job_id: job })
        .await?
        .into_inner();
    let models = ModelsClient::new(conn.channel.clone())
        .list(ListModelsRequest {})
        .await?
        .into_inner()
        .models;
    let catalogue = models
        .iter()
        .find(|m| m.id == job.model)
        .map(|m| m.sha256.clone());
    let sent = sent.unwrap_or_else(|| job.input.clone().unwrap_or_default());
    print_job(&job);
    let chain = verify_job(&job, &sent, catalogue.as_deref())?;
    let c = job.result.as_ref().and_then(|r| r.claim.as_ref());
    if let Some(c) = c {
        println!(
            "claim: attempt {}, {} prompt + {} completion tokens, finish {}",
            c.attempt, c.prompt_tokens, c.completion_tokens, c.finish_reason
        );
    }
    if catalogue.is_none() {
        println!(
            "model {} is no longer in the catalogue: its digest was not checked",
            job.model
        );
    }
    print_chain(&chain);
    Ok(())
}

/// `mlxnet jobs`: recent jobs.
async fn jobs(conn: &Conn, limit: u32) -> anyhow::Result<()> {
    let jobs = conn
        .jobs()
        .list(ListJobsRequest { limit })
        .await?
        .into_inner()
        .jobs;
    println!("{:<36}  {:<10}  {:<24}  node", "job", "state", "model");
    for j in jobs {
        println!(
            "{:<36}  {:<10}  {:<24}  {}",
            j.id,
            state_name(j.state),
            j.model,
            short(&j.node_id)
        );
    }
    Ok(())
}

/// `mlxnet models`: the catalogue with prices and how many nodes serve each.
async fn models(conn: &Conn) -> anyhow::Result<()> {
    let models = conn
        .models()
        .list(ListModelsRequest {})
        .await?
        .into_inner()
        .models;
    println!(
        "{:<28}  {:<8}  {:>10}  {:>5}  {:>14}  {:>14}  sha256",
        "model", "arch", "size", "nodes", "MLX/M in", "MLX/M out"
    );
    for m in models {
        println!(
            "{:<28}  {:<8}  {:>7} MB  {:>5}  {:>14}  {:>14}  {}",
            m.id,
            m.architecture,
            m.size_bytes / 1_000_000,
            m.nodes_serving,
            mlx(m.price_input_micro_mlx_per_mtok as i64),
            mlx(m.price_output_micro_mlx_per_mtok as i64),
            hex::encode(&m.sha256)
        );
    }
    Ok(())
}

/// `mlxnet network`: totals over nodes and jobs.
async fn network(conn: &Conn) -> anyhow::Result<()> {
    let s = NetworkClient::new(conn.authed.clone())
        .stats(NetworkStatsRequest {})
        .await?
        .into_inner();
    println!("nodes online     {} of {}", s.nodes_online, s.nodes_total);
    println!(
        "memory online    {:.1} GiB",
        s.memory_bytes_online as f64 / (1u64 << 30) as f64
    );
    println!("jobs queued      {}", s.jobs_queued);
    println!("jobs running     {}", s.jobs_running);
    println!("jobs completed   {}", s.jobs_completed);
    println!("jobs failed      {}", s.jobs_failed);
    println!("tokens generated {}", s.tokens_generated);
    Ok(())
}

/// `mlxnet balance`: the account's balance, holds and what is available.
async fn balance(conn: &Conn) -> anyhow::Result<()> {
    let b = conn
        .accounts()
        .balance(BalanceRequest {})
        .await?
        .into_inner();
    println!("account    {} ({})", b.account_id, b.account);
    println!("balance    {} MLX", mlx(b.balance_micro_mlx));
    println!("held       {} MLX", mlx(b.held_micro_mlx));
    println!("available  {} MLX", mlx(b.available_micro_mlx));
    Ok(())
}

/// `mlxnet history`: the account's transfers, newest first.
async fn history(conn: &Conn, limit: u32) -> anyhow::Result<()> {
    let entries = conn
        .accounts()
        .history(HistoryRequest { limit })
        .await?
        .into_inner()
        .entries;
    println!(
        "{:<24}  {:<8}  {:>16}  {:<36}  {:>6}  counterparty",
        "when (UTC)", "what", "MLX", "job", "tokens"
    );
    for e in entries {
        println!(
            "{:<24}  {:<8}  {:>16}  {:<36}  {:>6}  {}",
            utc(e.created_at_ms),
            e.memo,
            mlx(e.amount_micro_mlx),
            e.job_id,
            e.tokens,
            e.counterparty
        );
    }
    Ok(())
}

/// `mlxnet keys create`: a new key, printed once.
async fn create_key(
    conn: &Conn,
    account: String,
    scopes: String,
    label: String,
    ttl_seconds: u64,
) -> anyhow::Result<()> {
    let k = conn
        .accounts()
        .create_api_key(CreateApiKeyRequest {
            account_id: account,
            scopes: scopes.split(',').map(|s| s.trim().to_owned()).collect(),
            label,
            ttl_seconds,
        })
        .await?
        .into_inner();
    println!("key id   {}", k.key_id);
    println!("account  {}", k.account_id);
    println!("scopes   {}", k.scopes.join(","));
    if k.expires_at_ms > 0 {
        println!("expires  {}", utc(k.expires_at_ms));
    }
    println!("api key  {}", k.api_key);
    eprintln!("(the key is shown this once; only its hash is kept)");
    Ok(())
}

/// `mlxnet keys revoke`.
async fn revoke_key(conn: &Conn, key_id: String) -> anyhow::Result<()> {
    conn.accounts()
        .revoke_api_key(RevokeApiKeyRequest {
            key_id: key_id.clone(),
        })
        .await?;
    println!("revoked {key_id}");
    Ok(())
}

/// `mlxnet keys list`: an account's keys, never their secrets.
async fn list_keys(conn: &Conn, account: String) -> anyhow::Result<()> {
    let keys = conn
        .accounts()
        .list_api_keys(ListApiKeysRequest {
            account_id: account,
        })
        .await?
        .into_inner()
        .keys;
    println!(
        "{:<18}  {:<18}  {:<24}  {:<10}  label",
        "key", "scopes", "created (UTC)", "status"
    );
    for k in keys {
        let status = if k.revoked_at_ms > 0 {
            "revoked"
        } else if k.expires_at_ms > 0 && k.expires_at_ms <= now_ms() {
            "expired"
        } else {
            "active"
        };
        println!(
            "{:<18}  {:<18}  {:<24}  {:<10}  {}",
            k.key_id,
            k.scopes.join(","),
            utc(k.created_at_ms),
            status,
            k.label
        );
    }
    Ok(())
}

/// `mlxnet create-account` (admin key).
async fn create_account(conn: &Conn, name: String, kind: String) -> anyhow::Result<()> {
    let a = conn
        .accounts()
        .create_account(CreateAccountRequest { name, kind })
        .await?
        .into_inner();
    println!("account {} ({}, {})", a.account_id, a.name, a.kind);
    Ok(())
}

/// `mlxnet grant` (admin key): MLX tokens from the treasury to an account.
async fn grant(
    conn: &Conn,
    account: String,
    micro_mlx: u64,
    idempotency_key: String,
    memo: String,
) -> anyhow::Result<()> {
    let g = conn
        .accounts()
        .grant(GrantRequest {
            account_id: account.clone(),
            amount_micro_mlx: micro_mlx,
            idempotency_key,
            memo,
        })
        .await?
        .into_inner();
    if !g.created {
        println!("(a grant with this idempotency key was already made; nothing more moved)");
    }
    println!("{account} balance {} MLX", mlx(g.balance_micro_mlx));
    Ok(())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `YYYY-MM-DD HH:MM:SS` in UTC.
fn utc(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// `mlxnet submit`: submits, streams the tokens, and verifies the result.
async fn submit(
    mut client: JobsClient<Authed>,
    request: SubmitJobRequest,
    sent: &JobInput,
) -> anyhow::Result<()> {
    let job = client.submit(request).await?.into_inner();
    // The id first (stderr, beside the answer): what `mlxnet job` and
    // `mlxnet verify` take, should the stream be cut.
    eprintln!("submitted job {}", job.id);
    let mut events = client
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await?
        .into_inner();
    let mut stdout = std::io::stdout();
    let mut done = None;
    // What was printed, chunk by chunk, to compare with the signed result.
    let mut shown: Vec<(u32, String)> = Vec::new();
    // Whether the screen holds dropped text (the stream rewound).
    let mut rewound = false;
    while let Some(event) = events.message().await? {
        match event.event {
            Some(job_event::Event::Tokens(t)) => {
                if shown.last().is_some_and(|(i, _)| t.index <= *i) {
                    // An attempt's unsigned tokens were dropped (its node
                    // failed or was refused): the stream goes on from here.
                    shown.retain(|(i, _)| *i < t.index);
                    rewound = true;
                    eprintln!(
                        "\n[the stream restarts at token {}: what followed it was not kept]",
                        t.index
                    );
                }
                print!("{}", t.text);
                stdout.flush()?;
                shown.push((t.index, t.text));
            }
            Some(job_event::Event::Queued(q)) if !q.reason.is_empty() => {
                eprintln!("\n[requeued as attempt {}: {}]", q.attempt, q.reason);
            }
            Some(job_event::Event::Completed(c)) => {
                done = c.job;
                break;
            }
            Some(job_event::Event::Failed(f)) => {
                println!();
                bail!("job {} failed: {}", job.id, f.reason);
            }
            Some(job_event::Event::Cancelled(_)) => {
                println!();
                bail!("job {} was cancelled", job.id);
            }
            _ => {}
        }
    }
    println!();
    let done = match done {
        Some(j) => j,
        None => bail!("the job's event stream ended before the job did"),
    };
    print_job(&done);
    let chain = verify_job(&done, sent, None)?;
    let streamed: String = shown.into_iter().map(|(_, t)| t).collect();
    if rewound || streamed != chain.text {
        // The screen holds dropped or unsigned text: show the signed
        // answer whole.
        println!("result: {}", chain.text);
    }
    print_chain(&chain);
    Ok(())
}

/// Checks `job` offline against the input the client sent, the grammar it
/// records and, when known, the catalogue's model digest: its hand-off
/// segments' partial claims and
/// its signed result are one unbroken chain covering every token
/// (`claim::verify_chain`), and its output text is exactly the text they
/// sign.
fn verify_job(
    job: &Job,
    sent: &JobInput,
    model_sha256: Option<&[u8]>,
) -> anyhow::Result<claim::Chain> {
    let signed = job
        .result
        .as_ref()
        .context("the job carries no signed result (not completed?)")?;
    // The claim must bind the grammar the job records (structured output,
    // tool calls), or none for a job without one.
    let grammar = job.sampling.as_ref().and_then(|s| s.grammar.as_ref());
    let facts = claim::JobFacts {
        job_id: &job.id,
        node_id: &job.node_id,
        input: sent,
        model_sha256,
        grammar_sha256: mlxnet_proto::grammar::claim_digest(grammar),
    };
    let chain = claim::verify_chain(&job.segments, signed, &facts).context("NOT VERIFIED")?;
    if chain.text != job.output_text {
        bail!("NOT VERIFIED: the job's output text is not the text its signed claims cover");
    }
    Ok(chain)
}

/// Says who signed which tokens of a verified job: each drained node's
/// segment, then the node that finished it.
fn print_chain(chain: &claim::Chain) {
    let Some(((finisher, first, count), segments)) = chain.parts.split_last() else {
        return;
    };
    for (i, (node, from, n)) in segments.iter().enumerate() {
        println!(
            "segment {}: tokens {from}..{} signed by {node} (hand-off)",
            i + 1,
            from + n
        );
    }
    if segments.is_empty() {
        println!("verified: signed by {finisher}");
    } else {
        println!(
            "verified: signed by {finisher} (tokens {first}..{}; with the {} segment(s) above, every token is signed)",
            first + count,
            segments.len()
        );
    }
}

/// A job's input as `submit` sends it: raw text, or a chat of an optional
/// system message and the prompt as the user's.
fn job_input_of(prompt: String, raw: bool, system: String) -> JobInput {
    if raw {
        return JobInput {
            kind: Some(job_input::Kind::Prompt(prompt)),
        };
    }
    let mut messages = Vec::new();
    if !system.is_empty() {
        messages.push(ChatMessage {
            role: "system".into(),
            content: system,
        });
    }
    messages.push(ChatMessage {
        role: "user".into(),
        content: prompt,
    });
    JobInput {
        kind: Some(job_input::Kind::Chat(ChatMessages { messages })),
    }
}

fn print_job(job: &Job) {
    println!("job: {}", job.id);
    println!("model: {}", job.model);
    println!("state: {}", state_name(job.state));
    if !job.node_id.is_empty() {
        println!("node: {}", job.node_id);
    }
    if job.attempt > 1 {
        println!("attempt: {}", job.attempt);
    }
    if !job.error.is_empty() {
        println!("error: {}", job.error);
    }
}

fn state_name(state: i32) -> &'static str {
    match JobState::try_from(state).unwrap_or(JobState::Unspecified) {
        JobState::Unspecified => "unknown",
        JobState::Queued => "queued",
        JobState::Assigned => "assigned",
        JobState::Running => "running",
        JobState::Completed => "completed",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
    }
}

fn short(node: &str) -> &str {
    node.get(..16).unwrap_or(node)
}
