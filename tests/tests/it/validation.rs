//! Bad client input gets a clear gRPC status and creates no job.

use mlxnet_proto::v1::{
    grammar::Kind, job_input, Grammar, JobInput, ListJobsRequest, LogitBias, SamplingParams,
};
use mlxnet_tests::{chat_job, coordinator_config, prompt_job, spawn_coordinator};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_and_create_nothing() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(dir.path())).await?;
    let mut client = coord.client().await?;

    let mut unknown = chat_job("hi", 8);
    unknown.model = "gpt-17".into();
    let mut empty = prompt_job("", 8);
    empty.input = Some(JobInput {
        kind: Some(job_input::Kind::Prompt(String::new())),
    });
    let mut no_input = chat_job("hi", 8);
    no_input.input = None;
    let mut too_many = chat_job("hi", 8);
    too_many.sampling = Some(SamplingParams {
        max_tokens: 10_000_000,
        ..Default::default()
    });
    let mut bad_temp = chat_job("hi", 8);
    bad_temp.sampling = Some(SamplingParams {
        temperature: -1.0,
        max_tokens: 8,
        ..Default::default()
    });
    let mut bad_penalty = chat_job("hi", 8);
    bad_penalty.sampling = Some(SamplingParams {
        presence_penalty: 2.5,
        max_tokens: 8,
        ..Default::default()
    });
    let bias = |token_id, bias| {
        let mut job = chat_job("hi", 8);
        job.sampling = Some(SamplingParams {
            max_tokens: 8,
            logit_bias: vec![LogitBias { token_id, bias }],
            ..Default::default()
        });
        job
    };
    let mut twice = bias(3, 1.0);
    if let Some(s) = twice.sampling.as_mut() {
        s.logit_bias.push(LogitBias {
            token_id: 3,
            bias: 2.0,
        });
    }
    let grammar = |kind: Kind, json_schema: &str| {
        let mut job = chat_job("hi", 8);
        job.sampling = Some(SamplingParams {
            max_tokens: 8,
            grammar: Some(Grammar {
                kind: kind as i32,
                json_schema: json_schema.into(),
                ..Grammar::default()
            }),
            ..Default::default()
        });
        job
    };
    let huge = prompt_job(&"a".repeat(8 << 20), 8);
    // The gRPC layer refuses a request larger than the configured limit
    // before decoding it, and says which limit.
    let limit = coord.config.limits.max_request_bytes.to_string();

    let cases = [
        ("unknown model", unknown, Code::NotFound, "gpt-17"),
        (
            "empty prompt",
            empty,
            Code::InvalidArgument,
            "prompt is empty",
        ),
        (
            "no input",
            no_input,
            Code::InvalidArgument,
            "input is required",
        ),
        ("max_tokens", too_many, Code::InvalidArgument, "max_tokens"),
        (
            "temperature",
            bad_temp,
            Code::InvalidArgument,
            "temperature",
        ),
        (
            "presence_penalty",
            bad_penalty,
            Code::InvalidArgument,
            "presence_penalty",
        ),
        (
            "bias past the vocabulary",
            bias(49_152, -100.0),
            Code::InvalidArgument,
            "vocabulary of 49152",
        ),
        (
            "bias out of range",
            bias(5, 100.5),
            Code::InvalidArgument,
            "between -100 and 100",
        ),
        ("bias twice", twice, Code::InvalidArgument, "twice"),
        (
            "grammar llguidance refuses",
            grammar(Kind::JsonSchema, r#"{"type":"array","uniqueItems":true}"#),
            Code::InvalidArgument,
            "cannot be enforced",
        ),
        (
            "grammar not json",
            grammar(Kind::JsonSchema, "{\"type\":"),
            Code::InvalidArgument,
            "not json",
        ),
        (
            "grammar without a kind",
            grammar(Kind::Unspecified, "{}"),
            Code::InvalidArgument,
            "grammar kind",
        ),
        (
            "grammar too large",
            grammar(
                Kind::JsonSchema,
                &format!("{{\"description\":\"{}\"}}", "d".repeat(40_000)),
            ),
            Code::InvalidArgument,
            "the limit is 32768",
        ),
        ("oversized request", huge, Code::OutOfRange, limit.as_str()),
    ];
    for (what, request, code, mentions) in cases {
        assert!(!mentions.is_empty());
        let status = client
            .jobs
            .submit(request)
            .await
            .expect_err(&format!("{what} was accepted"));
        assert_eq!(
            status.code(),
            code,
            "{what}: got {:?}: {}",
            status.code(),
            status.message()
        );
        assert!(
            status.message().to_lowercase().contains(mentions),
            "{what}: message {:?} does not mention {mentions:?}",
            status.message()
        );
    }

    let jobs = client
        .jobs
        .list(ListJobsRequest { limit: 100 })
        .await?
        .into_inner()
        .jobs;
    assert!(jobs.is_empty(), "refused requests created jobs: {jobs:?}");
    Ok(())
}
