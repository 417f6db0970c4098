//! Calibration check: what the scheduler predicts for a SmolLM2 job on a node
//! whose `mlx-node bench --save` figures are given, against what a second
//! bench run (another prompt and generation length) measured.
//!
//! Run:
//! ```text
//! mlx-node bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --save /tmp/bench.json
//! mlx-node bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --prompt-tokens 32 --gen-tokens 256 > /tmp/run.json
//! cargo run -p mlxnet-coordinator --example calibrate -- /tmp/bench.json /tmp/run.json
//! ```
//! Prints the predicted and measured decode tokens/s and their ratio.

use anyhow::Context;
use mlxnet_coordinator::{
    catalogue::Catalogue,
    config::smollm2_135m_instruct,
    scheduler::{Decision, Fleet, Measured, Mode, NodeSpec, Policy},
};
use mlxnet_proto::ids::NodeId;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [saved, run] = args.as_slice() else {
        anyhow::bail!(
            "usage: calibrate <bench.json saved by --save> <bench output of another run>"
        );
    };
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(saved).context("reading the saved figures")?)?;
    let run: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run).context("reading the bench run")?)?;
    let field = |v: &serde_json::Value, k: &str| {
        v[k].as_f64()
            .with_context(|| format!("{k} missing from {v}"))
    };
    let measured = Measured {
        memory_bandwidth: Some(field(&saved, "memory_bandwidth_bytes_per_s")?),
        compute: Some(field(&saved, "compute_flops")?),
        internet: None,
    };
    let catalogue = Catalogue::new(&[smollm2_135m_instruct()])?;
    let model = catalogue
        .get("smollm2-135m-instruct")
        .context("test model in the catalogue")?;
    let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
    let mut spec = NodeSpec::new(
        NodeId::from_key(&key.verifying_key()),
        "this machine",
        64 << 30,
        Mode::Dedicated,
        &measured,
    );
    spec.cached = vec![model.sha256];
    let mut fleet = Fleet::new(Policy::default());
    fleet.add_node(spec)?;
    let prompt = field(&run, "prompt_tokens")? as u32;
    let gen = field(&run, "gen_tokens")? as u32;
    let job = mlxnet_coordinator::scheduler::JobShape {
        model: &model.shape,
        prompt_tokens: prompt,
        max_tokens: gen,
    };
    let Decision::Place(p) = fleet.decide(&job) else {
        anyhow::bail!("the node should take the job");
    };
    let predicted = p.estimate.tokens_per_s();
    let actual = field(&run, "decode_tok_s")?;
    println!("{}", p.reason);
    println!(
        "SmolLM2 prompt {prompt}, {gen} tokens: predicted decode {predicted:.1} tok/s, measured {actual:.1} tok/s, ratio {:.3}",
        predicted / actual
    );
    Ok(())
}
