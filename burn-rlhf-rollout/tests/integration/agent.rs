//! Multi-turn rollouts: a conversation's ids, built turn by turn from the model's tokens and each
//! appended turn's rendering, are transformers' `apply_chat_template(messages, tools=...)` of the
//! same messages (Qwen2.5's and SmolLM2's templates); the tool loop runs calls, answers bad ones
//! with errors and counts them; a loop registered by a library user drives conversations on
//! the engine, whose continued turns prefill only the new tokens and decode as a fresh request
//! over the whole conversation would.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use burn::backend::Flex;
use burn_rlhf_models::{load_pretrained, CausalLm, ChatMessage, Tokenizer, TransformerConfig};
use burn_rlhf_rollout::agent::render::ChatRenderer;
use burn_rlhf_rollout::agent::tool_agent::{MultiTurnSettings, ToolAgent, TruncateSide};
use burn_rlhf_rollout::agent::{
    run_conversations, AgentJob, AgentLoop, AgentLoopRegistry, Conversation, ConversationStats,
    Next, TurnRole,
};
use burn_rlhf_rollout::data::ExtraInfo;
use burn_rlhf_rollout::interactions::gsm8k::Gsm8kInteraction;
use burn_rlhf_rollout::interactions::Interaction;
use burn_rlhf_rollout::tools::calculator::Calculator;
use burn_rlhf_rollout::tools::gsm8k::Gsm8kTool;
use burn_rlhf_rollout::tools::Tool;
use burn_rlhf_rollout::{
    Engine, EngineConfig, FinishReason, PromptRecord, RolloutError, SamplingParams,
};
use serde_json::{json, Value};

type B = Flex;

fn tokenizer_for(name: &str, test: &str) -> Option<Tokenizer> {
    let dir = match name {
        "smollm2" => burn_rlhf_test_assets::smollm2_dir(test)?,
        "qwen2.5" => burn_rlhf_test_assets::qwen25_tokenizer_dir(test)?,
        other => panic!("tool_chat fixture for an unknown tokenizer `{other}` (smollm2, qwen2.5)"),
    };
    Some(Tokenizer::from_dir(&dir, &[], None).unwrap_or_else(|e| panic!("{e}")))
}

fn message(v: &Value) -> ChatMessage {
    ChatMessage {
        role: v["role"].as_str().unwrap().into(),
        content: v["content"].as_str().unwrap().into(),
    }
}

/// Every prefix of every fixture conversation where the model speaks next: the prompt through
/// the renderer, then per model turn its content's tokens and the end-of-turn token (what the
/// model samples), then the appended turn's ids, equal transformers' ids of that prefix.
#[test]
fn conversations_render_as_transformers_does() {
    let dir = burn_rlhf_test_assets::fixtures_subdir_or_own("tool_chat");
    for file in burn_rlhf_test_assets::files_with_ext(&dir, ".json") {
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let name = doc["tokenizer"].as_str().unwrap();
        let Some(tokenizer) = tokenizer_for(name, "conversations_render_as_transformers_does")
        else {
            continue;
        };
        assert_eq!(
            tokenizer.template_renders_tools(),
            doc["template_reads_tools"].as_bool().unwrap(),
            "{name}"
        );
        let eot = "<|im_end|>";
        let eot_id = tokenizer.token_to_id(eot).unwrap();
        let tools: Vec<Value> = doc["tools"].as_array().unwrap().clone();
        let renderer = ChatRenderer::new(tokenizer.clone(), tools);
        for (c, case) in doc["cases"].as_array().unwrap().iter().enumerate() {
            let messages: Vec<ChatMessage> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(message)
                .collect();
            let prefixes = case["prefixes"].as_array().unwrap();
            let first = prefixes[0]["k"].as_u64().unwrap() as usize;
            // The fixture's messages carry the tools' system text already for a template
            // without tools; the renderer adds it to the original messages.
            let original: Vec<ChatMessage> = match tokenizer.template_renders_tools() {
                true => messages[..first].to_vec(),
                false => strip_tools_text(&messages[..first]),
            };
            assert_eq!(
                renderer.prompt_messages(&original),
                messages[..first],
                "{name} case {c}"
            );
            let mut ids = renderer.prompt_ids(&original).unwrap();
            let want = |k: usize| -> Vec<u32> {
                let p = prefixes
                    .iter()
                    .find(|p| p["k"].as_u64() == Some(k as u64))
                    .unwrap();
                p["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            };
            assert_eq!(ids, want(first), "{name} case {c}: the prompt");
            let mut history = messages[..first].to_vec();
            let mut k = first;
            while k < messages.len() {
                // The model's turn as sampled: its text's tokens, then the end of turn.
                let model = &messages[k];
                assert_eq!(model.role, "assistant");
                ids.extend(tokenizer.encode(&model.content, false).unwrap());
                ids.push(eot_id);
                history.push(model.clone());
                k += 1;
                let turn: Vec<ChatMessage> = messages[k..]
                    .iter()
                    .take_while(|m| m.role != "assistant")
                    .cloned()
                    .collect();
                if turn.is_empty() {
                    break;
                }
                ids.extend(renderer.turn_ids(&history, &turn, Some(eot)).unwrap());
                history.extend(turn.iter().cloned());
                k += turn.len();
                assert_eq!(ids, want(k), "{name} case {c}: after message {k}");
            }
        }
    }
}

/// The first system message without the tools' text the renderer adds (and without the system
/// message when that text was all of it).
fn strip_tools_text(messages: &[ChatMessage]) -> Vec<ChatMessage> {
    let mut out = messages.to_vec();
    let content = out[0].content.clone();
    match content.find("# Tools") {
        Some(0) => {
            out.remove(0);
        }
        Some(at) => out[0].content = content[..at].trim_end_matches('\n').to_string(),
        None => {}
    }
    out
}

fn record(prompt: &str, ground_truth: &str, tools_kwargs: Value) -> PromptRecord {
    PromptRecord {
        data_source: "openai/gsm8k".into(),
        prompt: vec![ChatMessage::user(prompt)],
        ability: "math".into(),
        reward_style: "rule".into(),
        ground_truth: ground_truth.into(),
        extra_info: ExtraInfo {
            tools_kwargs: tools_kwargs.as_object().cloned().unwrap_or_default(),
            ..Default::default()
        },
        agent_name: None,
    }
}

fn gsm8k_schema() -> Value {
    json!({"type": "function", "function": {"name": "calc_gsm8k_reward",
        "description": "Scores an answer.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
            "required": ["answer"]}}})
}

/// A tool that panics on every call (a library user's tool with a bug).
struct Panics;

impl Tool for Panics {
    fn schema(&self) -> &Value {
        static SCHEMA: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
        SCHEMA.get_or_init(|| {
            json!({"type": "function", "function": {"name": "flaky",
            "parameters": {"type": "object", "properties": {}}}})
        })
    }
    fn create(
        &self,
        _: &serde_json::Map<String, Value>,
    ) -> Result<Box<dyn burn_rlhf_rollout::tools::ToolState>, String> {
        panic!("flaky is broken")
    }
}

/// The tool loop on Qwen2.5's tokenizer (and SmolLM2's), as verl 0.9.1's `ToolAgentLoop` runs
/// it: a call runs and its response comes back as the template's tool turn; arguments of
/// another type than the schema's reach the tool (verl checks no schema); unknown tools, failing
/// and panicking tools, and a failing `create` answer with verl's texts and are counted;
/// malformed calls are dropped (a turn of only those ends the conversation); a long response is
/// cut on verl 0.9.1's side; the loop ends at `max_assistant_turns` (0: no limit); an
/// interaction asks again after a wrong answer and, after a right one, its last message is
/// appended and the conversation ends; a row without `interaction_kwargs.name` is refused.
#[test]
fn the_tool_loop_runs_calls_as_verl_does() {
    for name in ["qwen2.5", "smollm2"] {
        let Some(tokenizer) = tokenizer_for(name, "the_tool_loop_runs_calls_as_verl_does") else {
            continue;
        };
        let eot = tokenizer.token_to_id("<|im_end|>").unwrap();
        let tools: Vec<Arc<dyn Tool>> = vec![
            Arc::new(Calculator::new(&Default::default(), Calculator::default_schema()).unwrap()),
            Arc::new(Gsm8kTool::new(&Default::default(), gsm8k_schema()).unwrap()),
            Arc::new(Panics),
        ];
        let schemas = tools.iter().map(|t| t.schema().clone()).collect();
        let renderer = ChatRenderer::new(tokenizer.clone(), schemas);
        let settings = MultiTurnSettings {
            max_assistant_turns: Some(12),
            max_parallel_calls: 2,
            max_tool_response_length: 200,
            tool_response_truncate_side: TruncateSide::Left,
            ..Default::default()
        };
        let agent = ToolAgent::new(
            renderer.clone(),
            tools.clone(),
            BTreeMap::new(),
            settings.clone(),
        );
        let row = record(
            "What is 12 * 34?",
            "408",
            json!({"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "408"}}}),
        );
        let prompt = agent.prompt_ids(&row).unwrap();
        let text = tokenizer.decode(&prompt, false).unwrap();
        assert!(
            text.contains("\"name\": \"calculator\""),
            "{name}: the schemas are in the prompt"
        );
        let mut conv = agent.start(&row).unwrap();
        let say = |t: &str| {
            let mut ids = tokenizer.encode(t, false).unwrap();
            ids.push(eot);
            ids
        };
        let turn = |conv: &mut Box<dyn Conversation>, t: &str| -> Option<String> {
            match conv
                .after_model_turn(&say(t), FinishReason::Stop, 10_000)
                .unwrap()
            {
                Next::Continue { tokens, role } => {
                    assert_eq!(role, TurnRole::Tool);
                    Some(tokenizer.decode(&tokens, false).unwrap())
                }
                Next::End => None,
                Next::Finish { .. } => panic!("{name}: only an interaction finishes"),
            }
        };
        let call = |n: &str, args: &str| {
            format!("<tool_call>\n{{\"name\": \"{n}\", \"arguments\": {args}}}\n</tool_call>")
        };
        let out = turn(
            &mut conv,
            &call("calculator", "{\"expression\": \"12 * 34\"}"),
        )
        .unwrap();
        assert!(
            out.contains("408") && out.ends_with("assistant\n"),
            "{name}: {out:?}"
        );
        // The schema says string; verl's tools take a number all the same.
        let out = turn(&mut conv, &call("calc_gsm8k_reward", "{\"answer\": 408}")).unwrap();
        assert!(
            out.contains("Current parsed answer='408' reward=1.0"),
            "{name}: {out:?}"
        );
        let bad = [
            (
                call("shell", "{\"cmd\": \"ls\"}"),
                "Unknown function 'shell'. Available tools: ['calculator', 'calc_gsm8k_reward', 'flaky']",
            ),
            (
                call("calculator", "{\"expr\": \"1\"}"),
                "Error executing tool 'calculator': expected {\"expression\"",
            ),
            (
                call("calculator", "{\"expression\": \"1 / 0\"}"),
                "Error executing tool 'calculator': division by zero",
            ),
            (
                call("calculator", "\"1 + 1\""),
                "Error executing tool 'calculator': arguments must be a JSON object",
            ),
            (
                call("flaky", "{}"),
                "Error executing tool 'flaky': the tool panicked: flaky is broken",
            ),
        ];
        for (text, want) in &bad {
            let out = turn(&mut conv, text).unwrap();
            assert!(out.contains(want), "{name}: {out:?}");
        }
        // Two calls in one turn (max_parallel_calls 2); the third is ignored, and so is the
        // malformed one beside them.
        let three = format!(
            "{}\n<tool_call>{{oops}}</tool_call>\n{}\n{}",
            call("calculator", "{\"expression\": \"1+1\"}"),
            call("calc_gsm8k_reward", "{\"answer\": \"408\"}"),
            call("calculator", "{\"expression\": \"3+3\"}")
        );
        let out = turn(&mut conv, &three).unwrap();
        assert!(
            out.contains("2") && out.contains("reward=1.0") && !out.contains("6\n"),
            "{name}: {out:?}"
        );
        // Each call makes its own instance: the same right answer again is not "no better".
        let out = turn(
            &mut conv,
            &call("calc_gsm8k_reward", "{\"answer\": \"408\"}"),
        )
        .unwrap();
        assert!(out.contains("reward=1.0"), "{name}: {out:?}");
        let stats: &ConversationStats = conv.stats();
        assert_eq!(stats.tool_reward, 0.0, "{name}: right answers cost nothing");
        // A turn of malformed calls only has no call: the conversation ends.
        assert!(
            turn(&mut conv, "<tool_call>{not json}</tool_call>").is_none(),
            "{name}: malformed calls are dropped"
        );
        let stats: &ConversationStats = conv.stats();
        assert_eq!((stats.tool_calls, stats.tool_errors), (12, 7), "{name}");
        // A tool whose create fails (no ground truth): the call's error, not the row's.
        let no_truth = record(
            "q",
            "408",
            json!({"calc_gsm8k_reward": {"create_kwargs": {}}}),
        );
        let mut conv = agent.start(&no_truth).unwrap();
        let out = turn(
            &mut conv,
            &call("calc_gsm8k_reward", "{\"answer\": \"408\"}"),
        )
        .unwrap();
        assert!(
            out.contains(
                "Error executing tool 'calc_gsm8k_reward': create_kwargs.ground_truth is missing"
            ),
            "{name}: {out:?}"
        );
        // Truncation: verl 0.9.1's `left` cuts the start.
        let cut = MultiTurnSettings {
            max_tool_response_length: 5,
            ..settings.clone()
        };
        let agent = ToolAgent::new(renderer.clone(), tools.clone(), BTreeMap::new(), cut);
        let mut conv = agent.start(&row).unwrap();
        let out = turn(&mut conv, &call("calc_gsm8k_reward", "{\"answer\": \"7\"}")).unwrap();
        assert!(out.contains("(truncated)...d=0.0"), "{name}: {out:?}");
        assert_eq!(conv.stats().truncated_tool_responses, 1);
        // An error text is not cut (verl returns it before cutting).
        let out = turn(&mut conv, &call("shell", "{}")).unwrap();
        assert!(
            out.contains("Unknown function 'shell'. Available tools: ["),
            "{name}: {out:?}"
        );
        assert_eq!(conv.stats().truncated_tool_responses, 1);
        assert_eq!(
            conv.stats().tool_reward,
            -0.05,
            "a wrong answer: verl's penalty"
        );
        // max_assistant_turns: the second model turn ends it, calls or not.
        let two = MultiTurnSettings {
            max_assistant_turns: Some(2),
            ..settings.clone()
        };
        let agent = ToolAgent::new(renderer.clone(), tools.clone(), BTreeMap::new(), two);
        let mut conv = agent.start(&row).unwrap();
        let c = call("calculator", "{\"expression\": \"1\"}");
        assert!(turn(&mut conv, &c).is_some());
        assert!(turn(&mut conv, &c).is_none());
        // 0 is no limit, as verl reads it (`if self.max_assistant_turns and ...`), for user
        // turns too.
        let zero = MultiTurnSettings {
            max_assistant_turns: Some(0),
            max_user_turns: Some(0),
            ..settings.clone()
        };
        let agent = ToolAgent::new(renderer.clone(), tools.clone(), BTreeMap::new(), zero);
        let mut conv = agent.start(&row).unwrap();
        for _ in 0..3 {
            assert!(turn(&mut conv, &c).is_some(), "{name}: 0 turns is no limit");
        }
        // An interaction: wrong, then right.
        let mut interactions: BTreeMap<String, Arc<dyn Interaction>> = BTreeMap::new();
        interactions.insert("gsm8k".into(), Arc::new(Gsm8kInteraction));
        let agent = ToolAgent::new(
            renderer.clone(),
            tools.clone(),
            interactions,
            settings.clone(),
        );
        let unnamed = agent
            .start(&row)
            .err()
            .expect("a row without a name")
            .to_string();
        assert!(
            unnamed.contains("interaction_kwargs has no `name`") && unnamed.contains("gsm8k"),
            "{name}: {unnamed}"
        );
        assert_eq!(agent.check(&row).unwrap_err().to_string(), unnamed);
        let mut named = row.clone();
        named.extra_info.interaction_kwargs = json!({"name": "gsm8k"}).as_object().unwrap().clone();
        agent.check(&named).unwrap();
        let mut conv = agent.start(&named).unwrap();
        match conv
            .after_model_turn(&say("#### 407"), FinishReason::Stop, 10_000)
            .unwrap()
        {
            Next::Continue { tokens, role } => {
                assert_eq!(role, TurnRole::User);
                let text = tokenizer.decode(&tokens, false).unwrap();
                assert!(
                    text.contains("user\nYour response is incorrect!"),
                    "{name}: {text:?}"
                );
            }
            other => panic!("{name}: a wrong answer gets feedback, not {other:?}"),
        }
        match conv
            .after_model_turn(&say("#### 408"), FinishReason::Stop, 10_000)
            .unwrap()
        {
            Next::Finish { tokens, role } => {
                assert_eq!(role, TurnRole::User);
                let text = tokenizer.decode(&tokens, false).unwrap();
                assert!(
                    text.contains("user\nYour response is correct!"),
                    "{name}: the last message is kept, as verl keeps it: {text:?}"
                );
            }
            other => panic!("{name}: a right answer ends the conversation, not {other:?}"),
        }
        assert_eq!(conv.stats().interaction_reward, Some(1.0));
    }
}

fn load(dir: &Path) -> (CausalLm<B>, TransformerConfig) {
    let pre = load_pretrained(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    let config = pre.config.clone();
    (pre.causal_lm(&Default::default()).unwrap(), config)
}

/// A library user's loop: after each model turn it appends `turn` (a user's turn of fixed ids)
/// until it has done so `turns` times; then, with `finish`, appends it once more and ends.
struct Echo {
    prompt: Vec<u32>,
    turn: Vec<u32>,
    turns: usize,
    finish: bool,
}

struct EchoConversation {
    turn: Vec<u32>,
    left: usize,
    finish: bool,
    stats: ConversationStats,
}

impl AgentLoop for Echo {
    fn name(&self) -> &str {
        "echo"
    }
    fn prompt_ids(&self, _: &PromptRecord) -> Result<Vec<u32>, RolloutError> {
        Ok(self.prompt.clone())
    }
    fn start(&self, _: &PromptRecord) -> Result<Box<dyn Conversation>, RolloutError> {
        Ok(Box::new(EchoConversation {
            turn: self.turn.clone(),
            left: self.turns,
            finish: self.finish,
            stats: ConversationStats::default(),
        }))
    }
}

impl Conversation for EchoConversation {
    fn after_model_turn(
        &mut self,
        _: &[u32],
        _: FinishReason,
        _: usize,
    ) -> Result<Next, RolloutError> {
        if self.left == 0 {
            return Ok(match self.finish {
                true => Next::Finish {
                    tokens: self.turn.clone(),
                    role: TurnRole::User,
                },
                false => Next::End,
            });
        }
        self.left -= 1;
        Ok(Next::Continue {
            tokens: self.turn.clone(),
            role: TurnRole::User,
        })
    }
    fn stats(&self) -> &ConversationStats {
        &self.stats
    }
}

/// Conversations of a registered loop on the engine: each response is the model's turns and the
/// appended turns in order, masked 1 and 0, with log-probs 0 on the appended tokens; the budget
/// counts both; the engine prefills each prompt once and each continued turn's new tokens only
/// (plus the last sampled token, whose keys were never computed); and a conversation's last
/// model turn is what a fresh request over the whole conversation decodes greedily.
#[test]
fn a_registered_loop_drives_conversations_on_the_engine() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        let (model, config) = load(&dir);
        let v = config.vocab_size as u32;
        let (prompt, turn) = (vec![5 % v, 17 % v], vec![21 % v, 22 % v]);
        // Every id stops a turn: each model turn is one token, and there are several.
        let stops: Vec<u32> = (0..v).collect();
        let budget = (config.max_model_len() - prompt.len()).min(9);
        let mut agents = AgentLoopRegistry::default();
        agents.register(Arc::new(Echo {
            prompt: prompt.clone(),
            turn: turn.clone(),
            turns: 2,
            finish: false,
        }));
        let agent = agents.get("echo").unwrap();
        let rows = [record("a", "", json!({})), record("b", "", json!({}))];
        let jobs: Vec<AgentJob<'_>> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| AgentJob {
                agent: agent.clone(),
                record: r,
                prompt: prompt.clone(),
                key: i as u64,
            })
            .collect();
        let params = Arc::new(SamplingParams {
            n: 2,
            greedy: true,
            max_new_tokens: budget,
            stop_token_ids: stops.clone(),
            ..Default::default()
        });
        let engine = EngineConfig {
            block_size: 4,
            num_blocks: 64,
            ..Default::default()
        };
        let mut e = Engine::new(&model, &config, 0, engine.clone(), &Default::default()).unwrap();
        let out = run_conversations(&mut e, &jobs, &params).unwrap();
        assert_eq!(out.len(), 4);
        let mut continued = 0;
        for s in &out {
            let (tokens, mask) = (&s.sample.tokens, &s.sample.mask);
            assert!(tokens.len() <= budget, "{}", dir.display());
            assert_eq!(mask.len(), tokens.len());
            let spans: usize = s.stats.turns.iter().map(|t| t.1).sum();
            assert_eq!(spans, tokens.len());
            let mut at = 0;
            for &(role, len) in &s.stats.turns {
                let m = u8::from(role == TurnRole::Assistant);
                assert!(mask[at..at + len].iter().all(|&x| x == m));
                if role == TurnRole::User {
                    assert_eq!(&tokens[at..at + len], &turn[..]);
                    assert!(s.sample.logprobs[at..at + len].iter().all(|&l| l == 0.0));
                    continued += 1;
                }
                at += len;
            }
            // The last model turn, decoded by a fresh request over everything before it.
            let (last_role, last_len) = *s.stats.turns.last().unwrap();
            if last_role == TurnRole::Assistant && s.stats.turns.len() > 1 {
                let history: Vec<u32> = prompt
                    .iter()
                    .chain(&tokens[..tokens.len() - last_len])
                    .copied()
                    .collect();
                let fresh = SamplingParams {
                    n: 1,
                    max_new_tokens: last_len,
                    ..(*params).clone()
                };
                let mut f =
                    Engine::new(&model, &config, 0, engine.clone(), &Default::default()).unwrap();
                let got = f
                    .generate(&[history], &[0], &Arc::new(fresh), &mut |_, _| {})
                    .unwrap();
                assert_eq!(
                    &got[0].tokens[..],
                    &tokens[tokens.len() - last_len..],
                    "{}",
                    dir.display()
                );
            }
        }
        assert!(
            continued > 0,
            "{}: some conversation went on",
            dir.display()
        );
        // One prefill per prompt (its samples share it), then per continued turn its new tokens
        // and the last sampled one.
        let stats = e.stats();
        assert_eq!(
            stats.prefill_tokens,
            rows.len() * prompt.len() + continued * (turn.len() + 1),
            "{}: no turn prefills the conversation again",
            dir.display()
        );
        assert_eq!(e.blocks().0, e.blocks().1, "every block is released");
    }
}

/// Runs `agent`'s conversation of one prompt (one sample) on `model`, each model turn one token
/// (every id stops), with `budget` response tokens.
fn converse(
    model: &CausalLm<B>,
    config: &TransformerConfig,
    agent: Echo,
    budget: usize,
) -> burn_rlhf_rollout::agent::AgentSample {
    let prompt = agent.prompt.clone();
    let agent: Arc<dyn AgentLoop> = Arc::new(agent);
    let row = record("a", "", json!({}));
    let jobs = [AgentJob {
        agent,
        record: &row,
        prompt,
        key: 0,
    }];
    let params = Arc::new(SamplingParams {
        n: 1,
        greedy: true,
        max_new_tokens: budget,
        stop_token_ids: (0..config.vocab_size as u32).collect(),
        ..Default::default()
    });
    let engine = EngineConfig {
        block_size: 4,
        num_blocks: 256,
        ..Default::default()
    };
    let mut e = Engine::new(model, config, 0, engine, &Default::default()).unwrap();
    let mut out = run_conversations(&mut e, &jobs, &params).unwrap();
    assert_eq!(e.blocks().0, e.blocks().1, "every block is released");
    out.pop().unwrap()
}

/// Where a conversation ends: a turn that does not fit the rest of the response budget, or
/// would fill the model's context, ends it before that turn (nothing of it is appended); a last
/// turn ([`Next::Finish`], a terminating interaction's message) is appended cut to the budget.
#[test]
fn conversations_end_at_the_budget_and_the_context() {
    for dir in burn_rlhf_test_assets::fixture_models() {
        let (model, config) = load(&dir);
        let v = config.vocab_size as u32;
        let turn: Vec<u32> = (0..3).map(|i| (30 + i) % v).collect();
        let echo = |prompt: Vec<u32>, turns: usize, finish: bool| Echo {
            prompt,
            turn: turn.clone(),
            turns,
            finish,
        };
        let roles = |s: &burn_rlhf_rollout::agent::AgentSample| -> Vec<(TurnRole, usize)> {
            s.stats.turns.clone()
        };
        let (a, u) = (TurnRole::Assistant, TurnRole::User);
        // Budget 9: model 1, user 3, model 1, user 3 would leave 1; the second user turn needs
        // 3 < 9 - 5 = 4 left, so it fits; then the model's 1 fills the budget exactly.
        let s = converse(&model, &config, echo(vec![5 % v], 5, false), 9);
        assert_eq!(roles(&s), vec![(a, 1), (u, 3), (a, 1), (u, 3), (a, 1)]);
        // Budget 8: after model 1, user 3, model 1 (5 used), the user turn of 3 does not fit the
        // 3 left (the model must be able to answer it): the conversation ends before it.
        let s = converse(&model, &config, echo(vec![5 % v], 5, false), 8);
        assert_eq!(roles(&s), vec![(a, 1), (u, 3), (a, 1)]);
        assert_eq!(s.sample.tokens.len(), 5);
        assert_eq!(s.sample.mask, vec![1, 0, 0, 0, 1]);
        // A last turn is cut to the budget: after model 1 (7 left) it fits whole; with a
        // budget of 3 only 2 of its 3 tokens are kept.
        let s = converse(&model, &config, echo(vec![5 % v], 0, true), 8);
        assert_eq!(roles(&s), vec![(a, 1), (u, 3)]);
        let s = converse(&model, &config, echo(vec![5 % v], 0, true), 3);
        assert_eq!(roles(&s), vec![(a, 1), (u, 2)]);
        assert_eq!(&s.sample.tokens[1..], &turn[..2]);
        assert_eq!(s.sample.mask, vec![1, 0, 0]);
        // The context: a prompt that leaves 4 positions; after the model's 1 token, 3 are left,
        // and a turn of 3 would fill them with nothing left to answer: it ends there, whatever
        // the budget.
        let context = config.max_model_len();
        let long = vec![5 % v; context - 4];
        let s = converse(&model, &config, echo(long.clone(), 5, false), 50);
        assert_eq!(roles(&s), vec![(a, 1)], "{}", dir.display());
        // One position more and the turn fits.
        let shorter = long[1..].to_vec();
        let s = converse(&model, &config, echo(shorter, 1, false), 50);
        assert_eq!(roles(&s)[..2], [(a, 1), (u, 3)], "{}", dir.display());
    }
}
