//! The model's chat template (`tokenizer.chat_template`, or `chat_template` in
//! `tokenizer_config.json`), rendered with minijinja the way Hugging Face's
//! `apply_chat_template` renders it: `messages`, `add_generation_prompt=true`,
//! `bos_token`, `eos_token` and a `raise_exception` function, plus Python
//! string methods (`.strip()`, `.startswith()`, ...) through pycompat.
//!
//! # Failure
//! [`EngineError::Template`]: the file's template does not compile (when the
//! model is loaded), the model has none, or the template refuses the
//! conversation (`raise_exception`, e.g. roles that do not alternate); the
//! latter is the client's fault.

use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

use super::{ChatTurn, EngineError};

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'a str,
    content: &'a str,
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(_format: String) -> String {
    // Templates (Llama 3.1) print today's date; a fixed date keeps outputs
    // reproducible across nodes.
    "26 Jul 2024".to_string()
}

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(source: &str) -> Result<Self, EngineError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| {
                EngineError::Template(format!("the model's chat template does not compile: {e}"))
            })?;
        Ok(ChatTemplate { env })
    }

    /// Renders `turns` followed by the assistant's generation prompt.
    pub fn render(
        &self,
        turns: &[ChatTurn],
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, EngineError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::Template(e.to_string()))?;
        let messages: Vec<Message<'_>> = turns
            .iter()
            .map(|t| Message {
                role: &t.role,
                content: &t.content,
            })
            .collect();
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => bos_token,
            eos_token => eos_token,
        })
        .map_err(|e| {
            let detail = e
                .detail()
                .map(str::to_string)
                .unwrap_or_else(|| e.to_string());
            EngineError::Template(format!(
                "the model's chat template rejected the conversation: {detail}"
            ))
        })
    }
}
