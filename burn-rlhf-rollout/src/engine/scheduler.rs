//! The scheduler: the sequences, their block tables, and what each step runs. Host-only; the
//! engine runs the model on its plans.
//!
//! Each step, as vLLM's scheduler: the running sequences first, oldest first, each its next
//! token (decode) or the next chunk of its prefill under the step's token budget; then waiting
//! sequences are admitted in order while a slot (`max_num_seqs`), budget and blocks are free.
//! A running sequence that needs a block when none is free first frees the kept prompts of
//! groups (below), then preempts the youngest running sequence: its blocks are freed and it
//! waits at the front of the queue to be recomputed (its tokens so far prefilled again; its
//! random stream goes on where it was, so it samples what it would have).
//!
//! The `n` samples of a request share its prompt: one of them (the leader) prefills it, the
//! others admitted meanwhile attach to it (a slot, no work) and, when the prompt is done, take
//! the leader's blocks (shared, the last partly filled one copied when first written) and
//! sample their first token from the same logits. Samples admitted later take the prompt's
//! blocks and logits kept for them until the last one is admitted.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use rand::rngs::StdRng;

use super::blocks::BlockManager;
use super::request::{FinishReason, Finished, RequestId, SeqId};
use crate::params::SamplingParams;
use crate::sample::Picked;

/// Where a sampled row's logits come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogitsOf {
    /// The last token of `work[i]` in this step's pass.
    Work(usize),
    /// The kept prompt logits of a request.
    Kept(RequestId),
}

/// One sequence's tokens in a step's pass.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Work {
    pub seq: SeqId,
    /// Positions before these tokens (in its blocks already).
    pub past: usize,
    /// The tokens to run.
    pub tokens: Vec<u32>,
    /// Its block table after this step's allocations.
    pub blocks: Vec<u32>,
    /// Whether its last token's logits sample its next token.
    pub samples: bool,
    /// Its request's prompt length (the prompt's rotary frequencies, see
    /// `PagedSeq::rope_floor`).
    pub prompt_len: usize,
}

/// What one step runs.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// Decodes first (one token each), then prefill chunks.
    pub work: Vec<Work>,
    /// Blocks to copy before the pass (`from`, `to`).
    pub copies: Vec<(u32, u32)>,
    /// The sequences that sample this step and from which logits.
    pub sampling: Vec<(SeqId, LogitsOf)>,
    /// Requests whose prompt logits (the last token of `work[i]`) are to be kept.
    pub keep_logits: Vec<(RequestId, usize)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Running,
    /// Holding a slot until its leader's prefill of the shared prompt is done.
    Attached(SeqId),
    /// Finished; holds its blocks only when retained.
    Done,
}

/// A sequence.
pub(crate) struct Seq {
    /// Every token: the prompt, then generated and appended ones.
    tokens: Vec<u32>,
    /// Positions whose keys and values are in its blocks.
    computed: usize,
    blocks: Vec<u32>,
    /// Where this turn's generated tokens begin in `tokens`.
    turn: usize,
    /// This turn's token budget.
    max_new: usize,
    logprobs: Vec<f32>,
    /// Each sampled token's entropy, where the sampler computed one.
    entropies: Vec<Option<f32>>,
    state: State,
    /// Admission order (the youngest is preempted first).
    admitted: u64,
    retain: bool,
    /// Its random stream.
    pub rng: StdRng,
    pub params: Arc<SamplingParams>,
}

/// A request's samples and what they share.
struct Group {
    prompt_len: usize,
    samples: usize,
    /// The sample prefilling the prompt for the others.
    leader: Option<SeqId>,
    /// The prompt's blocks, kept (referenced) for samples not admitted yet.
    kept: Option<Vec<u32>>,
}

/// The scheduler's limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub chunked_prefill: bool,
    /// A prompt must be shorter than this (the model's context).
    pub max_len: usize,
}

pub(crate) struct Scheduler {
    limits: Limits,
    pub(crate) blocks: BlockManager,
    seqs: BTreeMap<SeqId, Seq>,
    groups: BTreeMap<RequestId, Group>,
    waiting: VecDeque<SeqId>,
    /// Running and attached sequences, in admission order.
    running: Vec<SeqId>,
    clock: u64,
    /// Requests whose kept prompt was given up since the engine last asked.
    released_kept: Vec<RequestId>,
    pub(crate) copied: usize,
    pub(crate) preemptions: usize,
    pub(crate) shared_prefills: usize,
    pub(crate) peak_running: usize,
}

impl Scheduler {
    pub(crate) fn new(limits: Limits, num_blocks: usize) -> Self {
        Self {
            limits,
            blocks: BlockManager::new(num_blocks),
            seqs: BTreeMap::new(),
            groups: BTreeMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            clock: 0,
            released_kept: Vec::new(),
            copied: 0,
            preemptions: 0,
            shared_prefills: 0,
            peak_running: 0,
        }
    }

    /// Queues request `id`'s `params.n` samples of `prompt`, sample `j` drawing from
    /// `streams[j]`.
    pub(crate) fn add(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        params: Arc<SamplingParams>,
        streams: Vec<StdRng>,
        retain: bool,
    ) {
        let n = streams.len();
        self.groups.insert(
            id,
            Group {
                prompt_len: prompt.len(),
                samples: n,
                leader: None,
                kept: None,
            },
        );
        for (sample, rng) in streams.into_iter().enumerate() {
            let seq = SeqId {
                request: id,
                sample,
            };
            self.seqs.insert(
                seq,
                Seq {
                    tokens: prompt.to_vec(),
                    computed: 0,
                    blocks: Vec::new(),
                    turn: prompt.len(),
                    max_new: params.max_new_tokens,
                    logprobs: Vec::new(),
                    entropies: Vec::new(),
                    state: State::Waiting,
                    admitted: 0,
                    retain,
                    rng,
                    params: params.clone(),
                },
            );
            self.waiting.push_back(seq);
        }
    }

    /// Whether any sequence waits or runs.
    pub(crate) fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Sequences waiting and running (attached ones included).
    pub(crate) fn counts(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    pub(crate) fn seq_mut(&mut self, id: SeqId) -> Option<&mut Seq> {
        self.seqs.get_mut(&id)
    }

    /// Requests whose kept prompt logits are no longer needed.
    pub(crate) fn take_released_kept(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.released_kept)
    }

    /// Whether `id` is a fresh sample (nothing generated, prompt not in its blocks).
    fn fresh(&self, id: SeqId) -> bool {
        let s = &self.seqs[&id];
        s.tokens.len() == self.groups[&id.request].prompt_len && s.computed == 0
    }

    /// Fresh samples of `request` still waiting for the prompt's blocks.
    fn pending(&self, request: RequestId) -> usize {
        let n = self.groups[&request].samples;
        (0..n)
            .map(|sample| SeqId { request, sample })
            .filter(|id| {
                self.seqs.get(id).is_some_and(|s| {
                    matches!(s.state, State::Waiting | State::Attached(_)) && self.fresh(*id)
                })
            })
            .count()
    }

    /// The next step's plan.
    pub(crate) fn plan(&mut self) -> Plan {
        let mut plan = Plan::default();
        let mut budget = self.limits.max_num_batched_tokens;
        // Running sequences, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            if matches!(self.seqs[&id].state, State::Attached(_)) {
                i += 1;
                continue;
            }
            let need = {
                let s = &self.seqs[&id];
                s.tokens.len() - s.computed
            };
            let n = need.min(budget);
            let mut preempted_self = false;
            while !self.reserve(id, n, &mut plan.copies) {
                if self.release_one_kept() {
                    continue;
                }
                let victim = *self
                    .running
                    .iter()
                    .rev()
                    .find(|v| !matches!(self.seqs[v].state, State::Attached(_)))
                    .expect("the sequence itself runs");
                self.preempt(victim);
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                continue;
            }
            self.schedule(id, n, &mut plan);
            budget -= n;
            i += 1;
        }
        // Admissions, in queue order.
        while budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let fresh = self.fresh(id);
            let group = &self.groups[&id.request];
            if fresh && group.kept.is_some() {
                let kept = group.kept.clone().expect("checked");
                self.admit(id, State::Running);
                for &b in &kept {
                    self.blocks.share(b);
                }
                let s = self.seqs.get_mut(&id).expect("admitted");
                s.blocks = kept;
                s.computed = s.tokens.len();
                self.shared_prefills += 1;
                plan.sampling.push((id, LogitsOf::Kept(id.request)));
                if self.pending(id.request) == 0 {
                    self.release_kept(id.request);
                }
                continue;
            }
            if let (true, Some(leader)) = (fresh, group.leader) {
                self.admit(id, State::Attached(leader));
                continue;
            }
            let need = {
                let s = &self.seqs[&id];
                s.tokens.len() - s.computed
            };
            // Without chunked prefill a new prompt waits for a step it fits whole.
            if fresh && !self.limits.chunked_prefill && need > budget {
                break;
            }
            let n = need.min(budget);
            if !self.reserve(id, n, &mut plan.copies) {
                break;
            }
            self.admit(id, State::Running);
            if fresh {
                self.groups.get_mut(&id.request).expect("its group").leader = Some(id);
            }
            self.schedule(id, n, &mut plan);
            budget -= n;
        }
        self.peak_running = self.peak_running.max(self.running.len());
        // Decodes first: the reference path batches runs of single-token sequences.
        plan.work.sort_by_key(|w| w.tokens.len() != 1);
        for (w, work) in plan.work.iter().enumerate() {
            if work.samples {
                plan.sampling.push((work.seq, LogitsOf::Work(w)));
            }
        }
        self.fork_completed_prompts(&mut plan);
        plan
    }

    /// Leaders whose prompt completes this step hand it to their attached samples (and keep it
    /// for samples not admitted yet).
    fn fork_completed_prompts(&mut self, plan: &mut Plan) {
        for w in 0..plan.work.len() {
            let (leader, samples) = (plan.work[w].seq, plan.work[w].samples);
            let group = &self.groups[&leader.request];
            if !samples || group.leader != Some(leader) {
                continue;
            }
            self.groups
                .get_mut(&leader.request)
                .expect("its group")
                .leader = None;
            let blocks = self.seqs[&leader].blocks.clone();
            let computed = self.seqs[&leader].computed;
            let attached: Vec<SeqId> = self
                .running
                .iter()
                .copied()
                .filter(|id| self.seqs[id].state == State::Attached(leader))
                .collect();
            for id in attached {
                for &b in &blocks {
                    self.blocks.share(b);
                }
                let s = self.seqs.get_mut(&id).expect("attached");
                s.blocks = blocks.clone();
                s.computed = computed;
                s.state = State::Running;
                self.shared_prefills += 1;
                plan.sampling.push((id, LogitsOf::Work(w)));
            }
            if self.pending(leader.request) > 0 {
                for &b in &blocks {
                    self.blocks.share(b);
                }
                self.groups
                    .get_mut(&leader.request)
                    .expect("its group")
                    .kept = Some(blocks);
                plan.keep_logits.push((leader.request, w));
            }
        }
    }

    fn admit(&mut self, id: SeqId, state: State) {
        self.waiting.pop_front();
        self.clock += 1;
        let s = self.seqs.get_mut(&id).expect("queued");
        s.state = state;
        s.admitted = self.clock;
        self.running.push(id);
    }

    /// `n` more tokens of `id` in this step's pass (its blocks already reserved).
    fn schedule(&mut self, id: SeqId, n: usize, plan: &mut Plan) {
        let prompt_len = self.groups[&id.request].prompt_len;
        let s = self.seqs.get_mut(&id).expect("scheduled");
        let past = s.computed;
        s.computed += n;
        plan.work.push(Work {
            seq: id,
            past,
            tokens: s.tokens[past..past + n].to_vec(),
            blocks: s.blocks.clone(),
            samples: s.computed == s.tokens.len(),
            prompt_len,
        });
    }

    /// Blocks for `n` more positions of `id` (a shared block it writes into copied first);
    /// false, changing nothing, when the pool has too few free.
    fn reserve(&mut self, id: SeqId, n: usize, copies: &mut Vec<(u32, u32)>) -> bool {
        let bs = self.limits.block_size;
        let s = &self.seqs[&id];
        let (start, end) = (s.computed, s.computed + n);
        let grow = end.div_ceil(bs).saturating_sub(s.blocks.len());
        let shared_tail = start % bs != 0 && self.blocks.refs(s.blocks[start / bs]) > 1;
        if self.blocks.free() < grow + shared_tail as usize {
            return false;
        }
        let mut blocks = std::mem::take(&mut self.seqs.get_mut(&id).expect("known").blocks);
        if shared_tail {
            let old = blocks[start / bs];
            let new = self.blocks.alloc().expect("counted");
            copies.push((old, new));
            self.copied += 1;
            self.blocks.release(&[old]);
            blocks[start / bs] = new;
        }
        for _ in 0..grow {
            blocks.push(self.blocks.alloc().expect("counted"));
        }
        self.seqs.get_mut(&id).expect("known").blocks = blocks;
        true
    }

    /// Gives up one group's kept prompt; false when none is kept.
    fn release_one_kept(&mut self) -> bool {
        let Some(request) = self
            .groups
            .iter()
            .find(|(_, g)| g.kept.is_some())
            .map(|(r, _)| *r)
        else {
            return false;
        };
        self.release_kept(request);
        true
    }

    fn release_kept(&mut self, request: RequestId) {
        if let Some(blocks) = self.groups.get_mut(&request).and_then(|g| g.kept.take()) {
            self.blocks.release(&blocks);
            self.released_kept.push(request);
        }
    }

    /// Frees `id`'s blocks and queues it first, to be recomputed; a leader's attached samples
    /// queue right behind it.
    fn preempt(&mut self, id: SeqId) {
        self.preemptions += 1;
        let mut back = vec![id];
        if self.groups[&id.request].leader == Some(id) {
            self.groups.get_mut(&id.request).expect("its group").leader = None;
            back.extend(
                self.running
                    .iter()
                    .copied()
                    .filter(|a| self.seqs[a].state == State::Attached(id)),
            );
        }
        for &s in back.iter().rev() {
            self.running.retain(|r| *r != s);
            let seq = self.seqs.get_mut(&s).expect("running");
            let blocks = std::mem::take(&mut seq.blocks);
            seq.computed = 0;
            seq.state = State::Waiting;
            self.blocks.release(&blocks);
            self.waiting.push_front(s);
        }
    }

    /// Records the token `picked` by `id`; the turn it ends, if it does.
    pub(crate) fn commit(&mut self, id: SeqId, picked: Picked) -> Option<Finished> {
        let s = self.seqs.get_mut(&id).expect("sampling sequence");
        let token = picked.token;
        s.tokens.push(token);
        s.logprobs.push(picked.logprob);
        s.entropies.push(picked.entropy);
        let reason = if s.params.stop_token_ids.contains(&token) {
            FinishReason::Stop
        } else if s.tokens.len() - s.turn >= s.max_new {
            FinishReason::Length
        } else {
            return None;
        };
        Some(self.finish(id, reason))
    }

    /// Ends `id`'s turn: out of the queues, its blocks freed unless retained.
    fn finish(&mut self, id: SeqId, reason: FinishReason) -> Finished {
        self.running.retain(|r| *r != id);
        self.waiting.retain(|r| *r != id);
        let s = self.seqs.get_mut(&id).expect("finishing");
        s.state = State::Done;
        let out = Finished {
            seq: id,
            tokens: s.tokens[s.turn..].to_vec(),
            logprobs: std::mem::take(&mut s.logprobs),
            entropies: std::mem::take(&mut s.entropies),
            reason,
        };
        if !s.retain || reason == FinishReason::Aborted {
            let blocks = std::mem::take(&mut s.blocks);
            self.blocks.release(&blocks);
            self.seqs.remove(&id);
            self.forget_group_if_done(id.request);
        }
        out
    }

    /// Drops a request's group once none of its sequences is left.
    fn forget_group_if_done(&mut self, request: RequestId) {
        let n = self.groups.get(&request).map_or(0, |g| g.samples);
        let any = (0..n).any(|sample| self.seqs.contains_key(&SeqId { request, sample }));
        if !any {
            self.release_kept(request);
            self.groups.remove(&request);
        }
    }

    /// Ends every sequence of `request` still waiting or running (what each generated so far)
    /// and frees every block it holds.
    pub(crate) fn abort(&mut self, request: RequestId) -> Vec<Finished> {
        let n = self.groups.get(&request).map_or(0, |g| g.samples);
        let mut out = Vec::new();
        for sample in 0..n {
            let id = SeqId { request, sample };
            let Some(s) = self.seqs.get(&id) else {
                continue;
            };
            if s.state == State::Done {
                self.release(id);
            } else {
                out.push(self.finish(id, FinishReason::Aborted));
            }
        }
        self.release_kept(request);
        self.forget_group_if_done(request);
        out
    }

    /// Whether `id` finished and holds its blocks for a next turn.
    pub(crate) fn is_retained(&self, id: SeqId) -> bool {
        self.seqs.get(&id).is_some_and(|s| s.state == State::Done)
    }

    /// Every token of a retained sequence so far.
    pub(crate) fn tokens(&self, id: SeqId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.tokens.as_slice())
    }

    /// A next turn of retained `id`: `appended` after its tokens, then up to `max_new` new
    /// ones; it keeps its blocks and prefills only what they do not hold.
    pub(crate) fn continue_seq(&mut self, id: SeqId, appended: &[u32], max_new: usize) {
        let s = self.seqs.get_mut(&id).expect("retained");
        s.tokens.extend_from_slice(appended);
        s.turn = s.tokens.len();
        s.max_new = max_new;
        s.state = State::Waiting;
        self.waiting.push_back(id);
    }

    /// Frees a retained sequence's blocks.
    pub(crate) fn release(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.get_mut(&id) {
            if s.state == State::Done {
                let blocks = std::mem::take(&mut s.blocks);
                self.blocks.release(&blocks);
                self.seqs.remove(&id);
                self.forget_group_if_done(id.request);
            }
        }
    }

    /// Blocks a sequence of `len` positions needs.
    pub(crate) fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.limits.block_size)
    }

    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }
}
