//! The command-line programs as their users run them, against a real
//! coordinator and a real node on the test model: the `mlxnet` client
//! (`submit`, `verify`, `job`, `balance`, `history`, `keys`) and the owner's
//! `mlx-node earnings`. Each command's exit code (0, or 1 with `error: ...`
//! naming what went wrong) and the figures it prints, checked against the
//! ledger's own numbers.
//!
//! The binaries are the ones Cargo built beside this test binary
//! ([`mlxnet_binary`], [`mlx_node_binary`]): never a stale one.
//!
//! Every step waits on an event (the job's end, the hold's settlement);
//! nothing is timed.

use std::{path::Path, process::Output};

use anyhow::Context;
use mlxnet_proto::{
    ids::JobId,
    money::mlx,
    v1::{BalanceRequest, GetJobRequest},
};
use mlxnet_tests::{
    coordinator_config, mlx_node_binary, mlxnet_binary, price_of, spawn_coordinator, spawn_node,
    within, TestCoordinator, CLIENT_GRANT, TEST_MODEL_ID,
};

/// The prompt `mlxnet submit` sends (raw text; greedy).
const PROMPT: &str = "The capital of France is";
/// Tokens it asks for.
const MAX_TOKENS: &str = "8";

/// What a command printed and how it ended.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn of(out: Output) -> Self {
        Self {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Fails unless it exited 0; returns its standard output.
    fn ok(&self) -> &str {
        assert_eq!(self.code, Some(0), "{self}");
        &self.stdout
    }

    /// Fails unless it exited 1 with an error line containing each of
    /// `words`.
    fn failed_with(&self, words: &[&str]) {
        assert_eq!(self.code, Some(1), "{self}");
        let line = self
            .stderr
            .lines()
            .find(|l| l.starts_with("error: "))
            .unwrap_or_else(|| panic!("no `error:` line: {self}"));
        for w in words {
            assert!(line.contains(w), "{w:?} is not in {line:?}");
        }
    }
}

impl std::fmt::Display for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\nstdout:\n{}\nstderr:\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// Runs `mlxnet` against `coord` with `key` (none: no key at all).
async fn mlxnet(coord: &TestCoordinator, key: Option<&str>, args: &[&str]) -> anyhow::Result<Ran> {
    let mut cmd = tokio::process::Command::new(mlxnet_binary()?);
    cmd.env_remove("MLXNET_API_KEY")
        .env_remove("MLXNET_COORDINATOR")
        .arg("--coordinator")
        .arg(format!("http://{}", coord.grpc_addr));
    if let Some(key) = key {
        cmd.arg("--api-key").arg(key);
    }
    let out = within("mlxnet", cmd.args(args).output()).await??;
    let ran = Ran::of(out);
    eprintln!("mlxnet {args:?}: {ran}");
    Ok(ran)
}

/// Runs `mlx-node earnings` for the node whose data dir is `node_dir`.
async fn earnings(coord: &TestCoordinator, key: &str, node_dir: &Path) -> anyhow::Result<Ran> {
    let out = within(
        "mlx-node earnings",
        tokio::process::Command::new(mlx_node_binary()?)
            .env_remove("MLXNET_API_KEY")
            .env_remove("MLXNET_COORDINATOR")
            .arg("earnings")
            .arg("--grpc")
            .arg(format!("http://{}", coord.grpc_addr))
            .arg("--api-key")
            .arg(key)
            .arg("--data-dir")
            .arg(node_dir)
            .output(),
    )
    .await??;
    let ran = Ran::of(out);
    eprintln!("mlx-node earnings: {ran}");
    Ok(ran)
}

/// The value after `label` on the line that starts with it.
fn field<'a>(out: &'a str, label: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(label))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {label:?} line in:\n{out}"))
}

/// Micro-MLX from the printed `[-]N.NNNNNN`.
fn micro(printed: &str) -> i64 {
    let (sign, digits) = match printed.strip_prefix('-') {
        Some(rest) => (-1, rest),
        None => (1, printed),
    };
    let (whole, frac) = digits.split_once('.').expect("six decimals");
    assert_eq!(frac.len(), 6, "{printed:?}");
    sign * (whole.parse::<i64>().expect("whole MLX") * 1_000_000
        + frac.parse::<i64>().expect("micro-MLX"))
}

/// A user's session with `mlxnet`: balance, submit (streamed and verified),
/// verify (with the job's input, and with a prompt it was not about), job,
/// the balance and history after the job, and the errors a user meets (an
/// unknown model or job, a priority out of range, no key, a read-only key,
/// a revoked key), then `mlx-node earnings` of the node that ran it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mlxnet_and_mlx_node_earnings_against_a_real_network() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let node_dir = dir.path().join("node");
    let mut node = spawn_node(coord.node_config(&node_dir, "cli")).await?;
    node.registered().await?;
    let node_id = node.id.to_string();
    let key = coord.accounts.client_key.as_str();

    // The starting balance, as the grant made it.
    let out = mlxnet(&coord, Some(key), &["balance"]).await?;
    let before = out.ok();
    assert!(
        field(before, "account").starts_with(&coord.accounts.client_account),
        "{before}"
    );
    assert_eq!(
        field(before, "balance"),
        format!("{} MLX", mlx(CLIENT_GRANT))
    );
    assert_eq!(field(before, "held"), "0.000000 MLX");

    // submit: the tokens stream to stdout, the job id to stderr, and the
    // signed result is verified.
    let out = mlxnet(
        &coord,
        Some(key),
        &[
            "submit",
            "--model",
            TEST_MODEL_ID,
            "--raw",
            "--max-tokens",
            MAX_TOKENS,
            PROMPT,
        ],
    )
    .await?;
    let submitted = out.ok();
    let job_id = field(&out.stderr, "submitted job").to_owned();
    let mut client = coord.client().await?;
    let job = client
        .jobs
        .get(GetJobRequest {
            job_id: job_id.clone(),
        })
        .await?
        .into_inner();
    assert!(!job.output_text.is_empty(), "{job:?}");
    assert!(
        submitted.starts_with(&job.output_text),
        "the stream printed first is the job's output {:?}:\n{submitted}",
        job.output_text
    );
    assert_eq!(field(submitted, "state:"), "completed");
    assert_eq!(field(submitted, "node:"), node_id);
    assert_eq!(field(submitted, "verified: signed by"), node_id);

    // verify, later, against the input the coordinator returns and the
    // catalogue's model digest; then against a prompt the job was not
    // about.
    let out = mlxnet(&coord, Some(key), &["verify", &job_id]).await?;
    let verified = out.ok();
    assert_eq!(field(verified, "verified: signed by"), node_id);
    let (claim, model) = client.claim_and_model(&job).await?;
    assert_eq!(
        field(verified, "claim:"),
        format!(
            "attempt 1, {} prompt + {} completion tokens, finish {}",
            claim.prompt_tokens, claim.completion_tokens, claim.finish_reason
        )
    );
    let out = mlxnet(
        &coord,
        Some(key),
        &[
            "verify",
            &job_id,
            "--raw",
            "--prompt",
            "The capital of Spain is",
        ],
    )
    .await?;
    out.failed_with(&["NOT VERIFIED", "another input"]);
    // The same prompt, sent as a chat message instead of raw text, is
    // another input too.
    let out = mlxnet(&coord, Some(key), &["verify", &job_id, "--prompt", PROMPT]).await?;
    out.failed_with(&["NOT VERIFIED", "another input"]);
    let out = mlxnet(&coord, Some(key), &["job", &job_id]).await?;
    let shown = out.ok();
    assert!(
        shown.contains(&format!("\noutput: {}\n", job.output_text)),
        "the whole output is shown:\n{shown}"
    );
    assert_eq!(field(shown, "verified: signed by"), node_id);

    // The job's price left the balance once its hold settled; history shows
    // the hold and the post, which add up to the price.
    let (price, fee) = price_of(&claim, &model);
    within("the job's hold to settle", async {
        loop {
            let b = client
                .accounts
                .balance(BalanceRequest {})
                .await?
                .into_inner();
            if b.held_micro_mlx == 0 {
                return anyhow::Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await??;
    let out = mlxnet(&coord, Some(key), &["balance"]).await?;
    let after = out.ok();
    assert_eq!(
        field(after, "balance"),
        format!("{} MLX", mlx(CLIENT_GRANT - price))
    );
    assert_eq!(
        field(after, "available"),
        format!("{} MLX", mlx(CLIENT_GRANT - price))
    );
    let out = mlxnet(&coord, Some(key), &["history"]).await?;
    let history = out.ok();
    let mut of_job = Vec::new();
    for line in history.lines().filter(|l| l.contains(&job_id)) {
        // when (date, time), what, MLX, job, ...
        let f: Vec<&str> = line.split_whitespace().collect();
        of_job.push((f[2].to_owned(), micro(f[3])));
    }
    let memos: Vec<&str> = of_job.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(memos, ["post", "hold"], "newest first:\n{history}");
    assert_eq!(
        of_job.iter().map(|(_, a)| a).sum::<i64>(),
        -price,
        "{history}"
    );
    assert!(
        history.contains("starting balance") || history.contains("grant"),
        "the grant is listed:\n{history}"
    );

    // Errors a user meets: each exits 1 and says what was wrong.
    let out = mlxnet(
        &coord,
        Some(key),
        &["submit", "--model", "no-such-model", "--raw", PROMPT],
    )
    .await?;
    out.failed_with(&["unknown model \"no-such-model\"", "NotFound"]);
    let out = mlxnet(
        &coord,
        Some(key),
        &[
            "submit",
            "--model",
            TEST_MODEL_ID,
            "--priority",
            "4",
            "--raw",
            PROMPT,
        ],
    )
    .await?;
    out.failed_with(&["priority must be 0 to 3, got 4", "InvalidArgument"]);
    let unknown = JobId::new().to_string();
    let out = mlxnet(&coord, Some(key), &["job", &unknown]).await?;
    out.failed_with(&[&format!("no job {unknown}"), "NotFound"]);
    let out = mlxnet(&coord, Some(key), &["verify", &unknown]).await?;
    out.failed_with(&[&format!("no job {unknown}"), "NotFound"]);
    let out = mlxnet(&coord, None, &["balance"]).await?;
    out.failed_with(&["missing or invalid API key", "Unauthenticated"]);

    // keys: a read-only key reads but cannot submit; revoked, it reads
    // nothing.
    let out = mlxnet(
        &coord,
        Some(key),
        &["keys", "create", "--scopes", "read", "--label", "cli-test"],
    )
    .await?;
    let created = out.ok();
    let key_id = field(created, "key id").to_owned();
    let secret = field(created, "api key").to_owned();
    assert!(key_id.starts_with("key_"), "{created}");
    assert_eq!(field(created, "scopes"), "read");
    assert!(out.stderr.contains("shown this once"), "{out}");
    let listed = mlxnet(&coord, Some(key), &["keys", "list"]).await?;
    let row = listed
        .ok()
        .lines()
        .find(|l| l.starts_with(&key_id))
        .with_context(|| format!("{key_id} is not listed: {listed}"))?
        .split_whitespace()
        .collect::<Vec<_>>();
    assert_eq!(
        (row[1], row[4], row[5]),
        ("read", "active", "cli-test"),
        "{row:?}"
    );
    assert!(
        !listed.stdout.contains(&secret),
        "a key's secret is never listed"
    );
    let out = mlxnet(&coord, Some(&secret), &["balance"]).await?;
    assert_eq!(
        field(out.ok(), "balance"),
        format!("{} MLX", mlx(CLIENT_GRANT - price))
    );
    let out = mlxnet(
        &coord,
        Some(&secret),
        &["submit", "--model", TEST_MODEL_ID, "--raw", PROMPT],
    )
    .await?;
    out.failed_with(&["this API key lacks the submit scope", "PermissionDenied"]);
    let out = mlxnet(
        &coord,
        Some(&secret),
        &["keys", "create", "--scopes", "read"],
    )
    .await?;
    out.failed_with(&["this API key lacks the submit scope", "PermissionDenied"]);
    // Nor can a key make one with more scopes than its own.
    let out = mlxnet(&coord, Some(key), &["keys", "create", "--scopes", "admin"]).await?;
    out.failed_with(&[
        "a new key cannot have scopes the caller's key lacks",
        "PermissionDenied",
    ]);
    let out = mlxnet(&coord, Some(key), &["keys", "revoke", &key_id]).await?;
    assert_eq!(out.ok().trim(), format!("revoked {key_id}"));
    let listed = mlxnet(&coord, Some(key), &["keys", "list"]).await?;
    let status = listed
        .ok()
        .lines()
        .find(|l| l.starts_with(&key_id))
        .and_then(|l| l.split_whitespace().nth(4))
        .map(str::to_owned);
    assert_eq!(status.as_deref(), Some("revoked"), "{listed}");
    let out = mlxnet(&coord, Some(&secret), &["balance"]).await?;
    out.failed_with(&["missing or invalid API key", "Unauthenticated"]);

    // The owner's view: the node's payout for the job, its one job and its
    // tokens, marked as this node.
    let out = earnings(&coord, &coord.accounts.operator_key, &node_dir).await?;
    let report = out.ok();
    assert_eq!(
        field(report, "operator account"),
        coord.accounts.operator_account
    );
    let all_time = |from: &str| {
        let line = from
            .lines()
            .find(|l| l.trim_start().starts_with("all time"))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no all-time row:\n{from}"));
        line.split_whitespace()
            .skip(2)
            .collect::<Vec<_>>()
            .join(" ")
    };
    let paid = format!(
        "{} MLX 1 jobs {} tokens",
        mlx(price - fee),
        claim.completion_tokens
    );
    assert_eq!(all_time(report), paid, "{report}");
    let (_, this_node) = report
        .split_once(&format!("node {node_id} (this node)"))
        .with_context(|| format!("this node is not marked:\n{report}"))?;
    assert_eq!(all_time(this_node), paid, "{report}");
    // A client key is not an operator's: the client account earned nothing.
    let out = earnings(&coord, key, &node_dir).await?;
    assert!(
        all_time(out.ok()).starts_with("0.000000 MLX 0 jobs"),
        "{out}"
    );
    // A revoked key reads nothing: `mlx-node` errors exit 1 too.
    let out = earnings(&coord, &secret, &node_dir).await?;
    assert_eq!(out.code, Some(1), "{out}");
    assert!(
        out.stderr.contains("missing or invalid API key")
            && out.stderr.contains("(Unauthenticated)"),
        "{out}"
    );

    node.stop().await?;
    coord.stop().await?;
    Ok(())
}
