//! The OpenAI-compatible API against a real coordinator and a real node,
//! driven by the official `openai` Python package (tests/openai/
//! client_check.py, in the venv `scripts/openai-venv.sh` makes; CI makes it
//! in `.ci/run`) and by `curl`: chat (streamed and not, the usage chunk),
//! completions, models, seeds, stop strings, and every error status with
//! OpenAI's body shape. A refused request holds no tokens and creates no
//! job; the answers name jobs whose signed claims gRPC returns; the same
//! request through gRPC gives the same tokens and price.

use std::{
    path::PathBuf,
    process::{Command, Output},
};

use anyhow::{ensure, Context};
use mlxnet_coordinator::{domain::KeyLimits, ledger::keys::Scopes, ledger::AccountKind};
use mlxnet_proto::{
    claim,
    v1::{
        job_input, BalanceRequest, ChatMessage, ChatMessages, GetJobRequest, JobInput,
        ListJobsRequest, LogitBias, SamplingParams, SubmitJobRequest,
    },
};
use mlxnet_tests::{
    coordinator_config, price_of, repo_root, spawn_coordinator, spawn_node, test_model,
    TEST_MODEL_ID,
};
use serde_json::Value;

const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The venv with the `openai` package, or None (skip) outside CI.
fn venv_python() -> Option<PathBuf> {
    let dir = std::env::var_os("MLXNET_OPENAI_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv-openai"));
    let python = dir.join("bin/python");
    if python.is_file() {
        return Some(python);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{} is missing: run scripts/openai-venv.sh",
        python.display()
    );
    eprintln!(
        "SKIPPED: no openai venv at {} (run scripts/openai-venv.sh)",
        dir.display()
    );
    None
}

/// One curl call: status, headers (lowercased names), body.
struct Reply {
    status: u16,
    headers: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    /// Asserts an OpenAI-shaped error with `status`.
    fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{} {}", self.headers, self.body);
        let e = self.json()["error"].clone();
        for k in ["message", "type", "param", "code"] {
            assert!(e.get(k).is_some(), "{k} missing from {}", self.body);
        }
        assert!(
            self.headers
                .to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{}",
            self.headers
        );
        e
    }

    fn retry_after(&self) -> bool {
        self.headers.to_ascii_lowercase().contains("retry-after: 1")
    }
}

async fn curl(args: Vec<String>) -> anyhow::Result<Reply> {
    let out: Output = tokio::task::spawn_blocking(move || {
        Command::new("curl")
            .args(["-sS", "-i", "--max-time", "60"])
            .args(&args)
            .output()
    })
    .await??;
    ensure!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (headers, body) = text.split_once("\r\n\r\n").context("an HTTP reply")?;
    let status = headers
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("a status line")?;
    Ok(Reply {
        status,
        headers: headers.to_owned(),
        body: body.to_owned(),
    })
}

fn post(url: &str, key: Option<&str>, body: &str) -> Vec<String> {
    let mut a = vec![
        "-X".into(),
        "POST".into(),
        url.into(),
        "-H".into(),
        "content-type: application/json".into(),
        "--data-binary".into(),
        body.into(),
    ];
    if let Some(k) = key {
        a.extend(["-H".into(), format!("authorization: Bearer {k}")]);
    }
    a
}

fn chat_body(max_tokens: u32) -> String {
    serde_json::json!({
        "model": TEST_MODEL_ID,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 7,
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_clients_use_the_network() -> anyhow::Result<()> {
    test_model();
    let Some(python) = venv_python() else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let base = format!("http://{}/v1", coord.http_addr);
    let chat_url = format!("{base}/chat/completions");
    let key = coord.accounts.client_key.clone();
    let mut grpc = coord.client().await?;
    let balance = |b: mlxnet_proto::v1::BalanceResponse| b.available_micro_mlx;
    let before = balance(grpc.accounts.balance(BalanceRequest {}).await?.into_inner());

    // 503: no node serves the model yet (an HTTP client waits on its answer,
    // so the job is refused rather than queued).
    let r = curl(post(&chat_url, Some(&key), &chat_body(4))).await?;
    assert_eq!(r.error(503)["code"], "no_node_available");
    assert!(r.retry_after(), "{}", r.headers);

    let mut node = spawn_node(coord.node_config(&dir.path().join("n"), "n")).await?;
    node.registered().await?;

    // 401: no key, a bad key, and a key without the submit scope (403).
    let r = curl(post(&chat_url, None, &chat_body(4))).await?;
    assert_eq!(r.error(401)["code"], "invalid_api_key");
    let r = curl(post(&chat_url, Some("mlx_bogus"), &chat_body(4))).await?;
    r.error(401);
    let r = curl(post(
        &chat_url,
        Some(&coord.accounts.operator_key),
        &chat_body(4),
    ))
    .await?;
    r.error(403);
    // 400: not JSON; 404: unknown model and route; 413: over the body limit.
    let r = curl(post(&chat_url, Some(&key), "{not json")).await?;
    assert_eq!(r.error(400)["type"], "invalid_request_error");
    // 400: logprobs out of range (more than 20 alternatives, negative);
    // penalties and biases out of range, a token past the vocabulary (found
    // at submission, against the catalogue: no parameter named).
    let with = |extra: &str| chat_body(4).replace("\"seed\"", &format!("{extra},\"seed\""));
    let completions_url = format!("{base}/completions");
    for (url, body, param) in [
        (
            &chat_url,
            with("\"logprobs\":true,\"top_logprobs\":21"),
            Value::from("top_logprobs"),
        ),
        (
            &chat_url,
            with("\"logprobs\":true,\"top_logprobs\":-1"),
            Value::from("top_logprobs"),
        ),
        (
            &completions_url,
            format!("{{\"model\":\"{TEST_MODEL_ID}\",\"prompt\":\"a\",\"logprobs\":21}}"),
            Value::from("logprobs"),
        ),
        (
            &chat_url,
            with("\"presence_penalty\":2.5"),
            Value::from("presence_penalty"),
        ),
        (
            &completions_url,
            format!(
                "{{\"model\":\"{TEST_MODEL_ID}\",\"prompt\":\"a\",\"logit_bias\":{{\"5\":-101}}}}"
            ),
            Value::from("logit_bias"),
        ),
        (
            &chat_url,
            with("\"logit_bias\":{\"49152\":-100}"),
            Value::Null,
        ),
        // Structured output: a schema llguidance refuses, one that is not
        // an object, one past the size limit.
        (
            &chat_url,
            with(
                r#""response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"array","uniqueItems":true}}}"#,
            ),
            Value::from("response_format"),
        ),
        (
            &chat_url,
            with(
                r#""response_format":{"type":"json_schema","json_schema":{"name":"x","schema":[1]}}"#,
            ),
            Value::from("response_format"),
        ),
        (
            &chat_url,
            with(&format!(
                r#""response_format":{{"type":"json_schema","json_schema":{{"name":"x","schema":{{"type":"object","description":"{}"}}}}}}"#,
                "d".repeat(40_000)
            )),
            Value::from("response_format"),
        ),
    ] {
        let r = curl(post(url, Some(&key), &body)).await?;
        let e = r.error(400);
        assert_eq!(e["param"], param, "{body}");
        if param.is_null() {
            let m = e["message"].as_str().unwrap_or_default();
            assert!(m.contains("vocabulary of 49152"), "{m}");
        }
    }
    let unknown = chat_body(4).replace(TEST_MODEL_ID, "no-such-model");
    let r = curl(post(&chat_url, Some(&key), &unknown)).await?;
    assert_eq!(r.error(404)["code"], "model_not_found");
    let r = curl(vec![format!("{base}/embeddings")]).await?;
    r.error(404);
    let big = dir.path().join("big.json");
    std::fs::write(
        &big,
        vec![b' '; coord.config.limits.max_http_body_bytes + 1],
    )?;
    let mut args = post(&chat_url, Some(&key), "");
    let at = args.len() - 3;
    args[at] = format!("@{}", big.display());
    let r = curl(args).await?;
    assert_eq!(r.error(413)["code"], "request_too_large");
    // 402: an account with nothing to pay with.
    let poor = coord
        .ledger
        .create_account("poor client", AccountKind::Client)
        .await?;
    let poor_key = coord
        .ledger
        .create_key(&poor.id, Scopes::from_list(["submit"])?, "t", None)
        .await?;
    let r = curl(post(&chat_url, Some(poor_key.secret()), &chat_body(4))).await?;
    assert_eq!(r.error(402)["type"], "insufficient_quota");
    // 429: a key limited to 1 request/s (a burst of 2) sending 10 at once.
    let slow = coord
        .ledger
        .create_key(
            &coord.accounts.client_account,
            Scopes::from_list(["submit"])?,
            "t",
            None,
        )
        .await?;
    coord
        .ledger
        .set_key_limits(
            &slow.id,
            KeyLimits {
                requests_per_sec: Some(1),
                max_in_flight: None,
            },
        )
        .await?;
    let mut limited = None;
    for _ in 0..10 {
        let r = curl(post(&chat_url, Some(slow.secret()), "{}")).await?;
        if r.status == 429 {
            limited = Some(r);
            break;
        }
        r.error(400);
    }
    let r = limited.context("a 429 within 10 requests of a 1/s key")?;
    assert_eq!(r.error(429)["type"], "rate_limit_error");
    assert!(r.retry_after(), "{}", r.headers);

    // Nothing refused held tokens or made a job.
    let after = balance(grpc.accounts.balance(BalanceRequest {}).await?.into_inner());
    assert_eq!(before, after, "a refused request moved the balance");
    let jobs = grpc
        .jobs
        .list(ListJobsRequest { limit: 10 })
        .await?
        .into_inner();
    assert!(jobs.jobs.is_empty(), "refused requests made jobs: {jobs:?}");

    // curl, streamed: chunks, [DONE] last, the job header.
    let stream_body = chat_body(6).replace("\"seed\"", "\"stream\":true,\"seed\"");
    let mut args = post(&chat_url, Some(&key), &stream_body);
    args.insert(0, "-N".into());
    let r = curl(args).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.headers.to_ascii_lowercase().contains("x-mlxnet-job-id: "),
        "{}",
        r.headers
    );
    let events: Vec<&str> = r
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{}", r.body);
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e)?;
        assert_eq!(v["object"], "chat.completion.chunk", "{e}");
    }

    // Anthropic's Messages API: x-api-key, its body and its stream events.
    let msg_url = format!("{base}/messages");
    let msg = serde_json::json!({
        "model": TEST_MODEL_ID,
        "max_tokens": 6,
        "system": "You are a helpful assistant.",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
    });
    let with_key = |body: &Value, key: &str| {
        let mut a = post(&msg_url, None, &body.to_string());
        a.extend([
            "-H".into(),
            format!("x-api-key: {key}"),
            "-H".into(),
            "anthropic-version: 2023-06-01".into(),
        ]);
        a
    };
    let r = curl(with_key(&msg, &key)).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "message", "{v}");
    assert_eq!(v["content"][0]["type"], "text", "{v}");
    assert!(
        v["content"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{v}"
    );
    assert!(
        ["end_turn", "max_tokens"].contains(&v["stop_reason"].as_str().unwrap_or("")),
        "{v}"
    );
    assert!(
        v["usage"]["output_tokens"].as_u64().is_some_and(|n| n > 0),
        "{v}"
    );
    let mut streamed = msg.clone();
    streamed["stream"] = Value::Bool(true);
    let r = curl(with_key(&streamed, &key)).await?;
    let names: Vec<&str> = r
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"), "{}", r.body);
    assert_eq!(names.last(), Some(&"message_stop"), "{}", r.body);
    for want in [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
    ] {
        assert!(names.contains(&want), "{want} missing: {}", r.body);
    }
    let r = curl(with_key(&msg, "mlx_bogus")).await?;
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["type"], "error", "{}", r.body);
    assert_eq!(
        r.json()["error"]["type"],
        "authentication_error",
        "{}",
        r.body
    );

    // The same request through gRPC (compared below with the client's: the
    // same tokens, the same price); its first token is the one the client's
    // logit_bias bans.
    let same = SubmitJobRequest {
        model: TEST_MODEL_ID.into(),
        input: Some(JobInput {
            kind: Some(job_input::Kind::Chat(ChatMessages {
                messages: vec![ChatMessage {
                    role: "user".into(),
                    content: "What is the capital of France?".into(),
                }],
            })),
        }),
        sampling: Some(SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: Some(7),
            max_tokens: 12,
            ..SamplingParams::default()
        }),
        max_price_micro_mlx: 0,
        priority: 0,
    };
    let run = grpc.run_job(same.clone()).await?;
    let (grpc_claim, model) = grpc.claim_and_model(&run.job).await?;
    let greedy_first = *grpc_claim
        .output_token_ids
        .first()
        .context("a greedy token")?;

    // The official client.
    let summary = client_script(
        python,
        "client_check.py",
        vec![
            ("MLXNET_BASE_URL", base.clone()),
            ("MLXNET_API_KEY", key.clone()),
            ("MLXNET_MODEL_SHA256", MODEL_SHA256.into()),
            ("MLXNET_GREEDY_FIRST_TOKEN", greedy_first.to_string()),
        ],
    )
    .await?;

    // The answer names a job whose signed claim gRPC returns, with its text.
    let id = summary["chat"]["id"]
        .as_str()
        .context("chat id")?
        .to_owned();
    let job = grpc
        .jobs
        .get(GetJobRequest { job_id: id.clone() })
        .await?
        .into_inner();
    let signed = job.result.clone().context("a signed claim")?;
    claim::verify(&signed).map_err(|e| anyhow::anyhow!("claim: {e:?}"))?;
    assert_eq!(
        job.output_text,
        summary["chat"]["text"].as_str().unwrap_or_default()
    );
    let http_claim = signed.claim.clone().context("claim")?;
    assert_eq!(
        u64::from(http_claim.completion_tokens),
        summary["chat"]["usage"]["completion_tokens"]
            .as_u64()
            .unwrap_or(0)
    );
    // The logprobs job's claim binds its ids (not the logprobs): the same
    // ids as the same request without them, signed and verified.
    let lp_job = grpc
        .jobs
        .get(GetJobRequest {
            job_id: summary["logprobs_id"]
                .as_str()
                .context("logprobs id")?
                .to_owned(),
        })
        .await?
        .into_inner();
    let lp_signed = lp_job.result.context("the logprobs job's claim")?;
    claim::verify(&lp_signed).map_err(|e| anyhow::anyhow!("claim: {e:?}"))?;
    assert_eq!(
        lp_signed.claim.context("claim")?.output_token_ids,
        http_claim.output_token_ids
    );
    assert_eq!(
        lp_job.sampling.and_then(|s| s.logprobs),
        Some(5),
        "the job records what it asked"
    );
    // The logit_bias job: recorded as asked (what an audit re-scores
    // against), its claim verifies, its first token is not the banned one.
    let bias_job = grpc
        .jobs
        .get(GetJobRequest {
            job_id: summary["bias_id"].as_str().context("bias id")?.to_owned(),
        })
        .await?
        .into_inner();
    let s = bias_job.sampling.clone().context("sampling")?;
    assert_eq!(
        s.logit_bias
            .iter()
            .map(|b| (b.token_id, b.bias))
            .collect::<Vec<_>>(),
        vec![(greedy_first, -100.0)]
    );
    let bias_signed = bias_job.result.context("the bias job's claim")?;
    claim::verify(&bias_signed).map_err(|e| anyhow::anyhow!("claim: {e:?}"))?;
    let bias_ids = bias_signed.claim.context("claim")?.output_token_ids;
    assert_ne!(bias_ids.first(), Some(&greedy_first), "{bias_ids:?}");
    assert!(!bias_ids.contains(&greedy_first), "{bias_ids:?}");
    // The same biased request through gRPC Submit: the same tokens.
    let mut biased = same.clone();
    if let Some(s) = biased.sampling.as_mut() {
        s.logit_bias = vec![LogitBias {
            token_id: greedy_first,
            bias: -100.0,
        }];
    }
    let run = grpc.run_job(biased).await?;
    let (grpc_bias, _) = grpc.claim_and_model(&run.job).await?;
    assert_eq!(grpc_bias.output_token_ids, bias_ids);

    // A structured-output job: recorded with its grammar (what the node
    // masked with and an audit replays), its claim verifies and its text is
    // the client's.
    let (schema_job, text) = job_and_schema(&mut grpc, &summary, "schema_id").await?;
    assert!(text.contains("\"maxLength\":12"), "{text}");
    // The claim binds the grammar's digest, checked as `mlxnet verify`
    // checks it.
    assert_eq!(verified_as_the_client_does(&schema_job)?.len(), 32);
    let schema_signed = schema_job.result.context("the schema job's claim")?;
    claim::verify(&schema_signed).map_err(|e| anyhow::anyhow!("claim: {e:?}"))?;
    assert_eq!(
        schema_job.output_text,
        summary["schema_text"].as_str().unwrap_or_default()
    );
    // The plain chat job's claim binds no grammar.
    let plain_job = grpc
        .jobs
        .get(GetJobRequest { job_id: id.clone() })
        .await?
        .into_inner();
    assert_eq!(verified_as_the_client_does(&plain_job)?, Vec::<u8>::new());

    // The same request through gRPC: the same tokens, the same price.
    assert_eq!(grpc_claim.output_token_ids, http_claim.output_token_ids);
    assert_eq!(grpc_claim.prompt_sha256, http_claim.prompt_sha256);
    assert_eq!(price_of(&grpc_claim, &model), price_of(&http_claim, &model));
    Ok(())
}

/// Runs tests/openai/`script` with the venv's Python (the model named in
/// `MLXNET_MODEL`, and `env`); its summary (the last line of its output).
async fn client_script(
    python: PathBuf,
    script: &'static str,
    env: Vec<(&'static str, String)>,
) -> anyhow::Result<Value> {
    let out = tokio::task::spawn_blocking(move || {
        Command::new(&python)
            .arg(repo_root().join("tests/openai").join(script))
            .env("MLXNET_MODEL", TEST_MODEL_ID)
            .envs(env)
            .output()
    })
    .await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_str(
        stdout.lines().last().context("a summary")?,
    )?)
}

/// The job (gRPC Get) whose id the client's summary holds under `key`, and
/// the JSON schema text of the grammar it records (what the node masked
/// with and an audit replays).
async fn job_and_schema(
    grpc: &mut mlxnet_tests::Client,
    summary: &Value,
    key: &str,
) -> anyhow::Result<(mlxnet_proto::v1::Job, String)> {
    let job_id = summary[key].as_str().context("a job id")?.to_owned();
    let job = grpc.jobs.get(GetJobRequest { job_id }).await?.into_inner();
    let g = job
        .sampling
        .as_ref()
        .and_then(|s| s.grammar.clone())
        .context("the job records its grammar")?;
    let c = mlxnet_proto::grammar::Constraint::from_wire(&g)?;
    let mlxnet_proto::grammar::Constraint::JsonSchema(text) = c else {
        anyhow::bail!("the grammar recorded is {c:?}, not a schema");
    };
    Ok((job, text))
}

/// Checks `job`'s signed claims as `mlxnet verify` does
/// (`claim::verify_chain` against the job's own record: its input, the
/// catalogue's model digest and its grammar's digest); returns the grammar
/// digest the claim binds.
fn verified_as_the_client_does(job: &mlxnet_proto::v1::Job) -> anyhow::Result<Vec<u8>> {
    let signed = job.result.as_ref().context("a signed claim")?;
    let model = hex::decode(MODEL_SHA256)?;
    let grammar = job.sampling.as_ref().and_then(|s| s.grammar.as_ref());
    let facts = claim::JobFacts {
        job_id: &job.id,
        node_id: &job.node_id,
        input: job.input.as_ref().context("the job's input")?,
        model_sha256: Some(&model),
        grammar_sha256: mlxnet_proto::grammar::claim_digest(grammar),
    };
    claim::verify_chain(&job.segments, signed, &facts)?;
    let bound = signed.claim.as_ref().map(|c| c.grammar_sha256.clone());
    bound.context("a claim")
}

/// Tool calls with the official client (tests/openai/tool_check.py):
/// required calls and a named one whose `arguments` parse and validate
/// against their tool's schema (greedy and 4 seeds at temperature 1), one
/// call only with `parallel_tool_calls: false`, several allowed otherwise
/// (a two-part question), the streamed calls reassembled by the client and
/// from the raw chunks by index, the agent loop (the calls and their
/// results fed back), `auto` (text or valid calls; streamed the same; 3
/// seeds), and the 400s. Then through gRPC: the call's job records the
/// tools' grammar, its signed claim binds that grammar's digest and
/// verifies as `mlxnet verify` checks it, and its text is the calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_tool_calls() -> anyhow::Result<()> {
    test_model();
    let Some(python) = venv_python() else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let base = format!("http://{}/v1", coord.http_addr);
    let key = coord.accounts.client_key.clone();
    let mut grpc = coord.client().await?;
    let mut node = spawn_node(coord.node_config(&dir.path().join("n"), "n")).await?;
    node.registered().await?;

    let summary = client_script(
        python,
        "tool_check.py",
        vec![("MLXNET_BASE_URL", base), ("MLXNET_API_KEY", key)],
    )
    .await?;

    // The call's job: its grammar is the tools' (what the node masked with
    // and an audit replays), its claim verifies, its text is the call.
    let (job, text) = job_and_schema(&mut grpc, &summary, "required_id").await?;
    assert!(
        text.contains(r#""const":"get_weather""#) && text.contains(r#""const":"get_time""#),
        "{text}"
    );
    assert_eq!(verified_as_the_client_does(&job)?.len(), 32);
    let signed = job.result.context("the call's claim")?;
    claim::verify(&signed).map_err(|e| anyhow::anyhow!("claim: {e:?}"))?;
    // Its text is the calls, one per line.
    let calls: Vec<String> = summary["required_calls"]
        .as_array()
        .context("the calls")?
        .iter()
        .map(|call| {
            format!(
                r#"{{"name":"{}","arguments":{}}}"#,
                call[0].as_str().unwrap_or_default(),
                call[1].as_str().unwrap_or_default()
            )
        })
        .collect();
    assert_eq!(job.output_text, calls.join("\n"));
    Ok(())
}
