//! Tokenizer and chat template: `tokenizer.json` through the `tokenizers` crate, the chat template
//! (from `tokenizer_config.json`, `chat_template.jinja`, or GGUF metadata) rendered with minijinja
//! the way transformers' `apply_chat_template` renders it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ModelError;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }
}

/// A tokenizer with its special tokens and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Ids that end a response.
    pub eos_token_ids: Vec<u32>,
    /// Id used for padding.
    pub pad_token_id: u32,
    source: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab", &self.vocab_size())
            .finish()
    }
}

/// A special-token entry of `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// From a `tokenizer.json` document, an optional `tokenizer_config.json`, an optional template
    /// text, and the model config's eos/pad ids as fallbacks. `source` names it in messages.
    pub fn from_parts(
        tokenizer_json: &[u8],
        tokenizer_config: Option<&Value>,
        chat_template: Option<String>,
        config_eos: &[u32],
        config_pad: Option<u32>,
        source: &str,
    ) -> Result<Self, ModelError> {
        let err = |m: String| ModelError::Tokenizer {
            path: source.to_string(),
            message: m,
        };
        let inner = tokenizers::Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| err(format!("cannot read tokenizer.json: {e}")))?;
        let cfg = tokenizer_config.cloned().unwrap_or(Value::Null);
        let template = chat_template.or_else(|| match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: take `default`.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| {
                    t.get("template")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                }),
            _ => None,
        });
        let bos_token = token_string(cfg.get("bos_token"));
        let eos_token = token_string(cfg.get("eos_token"));
        let pad_token = token_string(cfg.get("pad_token"));
        let id = |t: &Option<String>| t.as_deref().and_then(|t| inner.token_to_id(t));
        let mut eos_token_ids = config_eos.to_vec();
        if let Some(e) = id(&eos_token) {
            if !eos_token_ids.contains(&e) {
                eos_token_ids.push(e);
            }
        }
        let pad_token_id = id(&pad_token)
            .or(config_pad)
            .or_else(|| eos_token_ids.first().copied())
            .unwrap_or(0);
        Ok(Self {
            inner,
            chat_template: template,
            bos_token,
            eos_token,
            eos_token_ids,
            pad_token_id,
            source: source.to_string(),
        })
    }

    /// From a model folder: `tokenizer.json`, with `tokenizer_config.json` and
    /// `chat_template.jinja` when present.
    pub fn from_dir(
        dir: &Path,
        config_eos: &[u32],
        config_pad: Option<u32>,
    ) -> Result<Self, ModelError> {
        let tj = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tj).map_err(|e| ModelError::io(&tj, e))?;
        let tc_path = dir.join("tokenizer_config.json");
        let tc = match std::fs::read_to_string(&tc_path) {
            Ok(text) => Some(
                serde_json::from_str::<Value>(&text)
                    .map_err(|e| ModelError::format(&tc_path, format!("not JSON: {e}")))?,
            ),
            Err(_) => None,
        };
        let template = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
        Self::from_parts(
            &bytes,
            tc.as_ref(),
            template,
            config_eos,
            config_pad,
            &dir.display().to_string(),
        )
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ModelError::Tokenizer {
                path: self.source.clone(),
                message: format!("cannot encode: {e}"),
            })
    }

    /// The text of `ids`; `skip_special_tokens` drops special tokens such as EOS.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer {
                path: self.source.clone(),
                message: format!("cannot decode: {e}"),
            })
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether `other` maps every token to the same id (added tokens included): ids of one
    /// mean the same text in the other.
    pub fn same_vocabulary(&self, other: &Tokenizer) -> bool {
        self.inner.get_vocab(true) == other.inner.get_vocab(true)
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Whether the tokenizer has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders `messages` with the chat template, as transformers' `apply_chat_template(...,
    /// tokenize=False)` does.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// Whether the chat template reads `tools` (renders tool schemas itself).
    pub fn template_renders_tools(&self) -> bool {
        self.chat_template
            .as_deref()
            .is_some_and(|t| t.contains("tools"))
    }

    /// [`apply_chat_template`](Self::apply_chat_template) with `tools` (OpenAI function
    /// schemas), as `apply_chat_template(messages, tools=...)`; a template that does not read
    /// `tools` ignores them, as in transformers.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.render_chat(
            minijinja::Value::from_serialize(messages),
            tools,
            add_generation_prompt,
            &serde_json::Map::new(),
        )
    }

    /// transformers' `apply_chat_template(messages, tools=tools, add_generation_prompt=...,
    /// tokenize=True, **kwargs)` for messages as they are stored in a dataset (any fields:
    /// `tool_calls`, `name`, `reasoning_content`), with extra template variables `kwargs`
    /// (verl's `apply_chat_template_kwargs`, `enable_thinking`).
    pub fn encode_chat_json(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<Vec<u32>, ModelError> {
        let text = self.render_chat(
            minijinja::Value::from_serialize(messages),
            tools,
            add_generation_prompt,
            kwargs,
        )?;
        self.encode(&text, false)
    }

    /// Renders the chat template over `messages` with `tools`, the generation prompt or not, and
    /// the extra variables `kwargs`.
    fn render_chat(
        &self,
        messages: minijinja::Value,
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String, ModelError> {
        let err = |m: String| ModelError::Tokenizer {
            path: self.source.clone(),
            message: m,
        };
        let template = self.chat_template.as_deref().ok_or_else(|| {
            err(
                "no chat template (tokenizer_config.json `chat_template` or chat_template.jinja)"
                    .into(),
            )
        })?;
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        // transformers' `tojson` is Python's `json.dumps` (", " and ": ", non-ASCII kept, keys
        // in their order), not minijinja's HTML-safe compact one: tool schemas render as there.
        env.add_filter(
            "tojson",
            |v: minijinja::Value,
             indent: Option<minijinja::Value>|
             -> Result<minijinja::Value, minijinja::Error> {
                let json = serde_json::to_value(&v).map_err(|e| {
                    minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
                })?;
                let indent = indent.and_then(|i| usize::try_from(i).ok());
                Ok(minijinja::Value::from_safe_string(python_json(
                    &json, indent,
                )))
            },
        );
        env.add_template("chat", template)
            .map_err(|e| err(format!("chat template does not parse: {e}")))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            tools => tools,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
            ..minijinja::Value::from_serialize(kwargs)
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| err(format!("chat template failed: {e}")))
    }

    /// The chat template's text tokenized without adding special tokens (the template has them),
    /// as `apply_chat_template(..., tokenize=True)`.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ModelError> {
        self.encode(
            &self.apply_chat_template(messages, add_generation_prompt)?,
            false,
        )
    }
}

/// `value` as Python's `json.dumps(value, ensure_ascii=False, indent=indent)` writes it.
pub fn python_json(value: &Value, indent: Option<usize>) -> String {
    fn string(out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    fn write(out: &mut String, v: &Value, indent: Option<usize>, depth: usize) {
        let newline = |out: &mut String, depth: usize| {
            if let Some(n) = indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * depth));
            }
        };
        let sep = if indent.is_some() { "," } else { ", " };
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => match n.as_f64() {
                // Python writes floats with a fraction or exponent: 1.0, not 1.
                Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 1e16 => {
                    out.push_str(&format!("{f:.1}"))
                }
                _ => out.push_str(&n.to_string()),
            },
            Value::String(s) => string(out, s),
            Value::Array(items) if items.is_empty() => out.push_str("[]"),
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(sep);
                    }
                    newline(out, depth + 1);
                    write(out, item, indent, depth + 1);
                }
                newline(out, depth);
                out.push(']');
            }
            Value::Object(map) if map.is_empty() => out.push_str("{}"),
            Value::Object(map) => {
                out.push('{');
                for (i, (k, item)) in map.iter().enumerate() {
                    if i > 0 {
                        out.push_str(sep);
                    }
                    newline(out, depth + 1);
                    string(out, k);
                    out.push_str(": ");
                    write(out, item, indent, depth + 1);
                }
                newline(out, depth);
                out.push('}');
            }
        }
    }
    let mut out = String::new();
    write(&mut out, value, indent, 0);
    out
}

impl Tokenizer {
    /// Writes `tokenizer.json`, `tokenizer_config.json` and (when there is one)
    /// `chat_template.jinja` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), ModelError> {
        let tj = dir.join("tokenizer.json");
        self.inner
            .save(&tj, false)
            .map_err(|e| ModelError::Tokenizer {
                path: tj.display().to_string(),
                message: format!("cannot write: {e}"),
            })?;
        let pad = self.inner.id_to_token(self.pad_token_id);
        let cfg = serde_json::json!({
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": pad,
            "chat_template": self.chat_template,
            "tokenizer_class": "PreTrainedTokenizerFast",
        });
        let tc = dir.join("tokenizer_config.json");
        std::fs::write(&tc, serde_json::to_string_pretty(&cfg).expect("JSON"))
            .map_err(|e| ModelError::io(&tc, e))?;
        if let Some(t) = &self.chat_template {
            let p = dir.join("chat_template.jinja");
            std::fs::write(&p, t).map_err(|e| ModelError::io(&p, e))?;
        }
        Ok(())
    }
}
