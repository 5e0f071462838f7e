"""The peer side of the cargo benchmarks (`cargo bench -p burn-rlhf-algos / -models / -rollout`):
the same cases on the code a user would otherwise run, timed on this machine, one JSON line each:

    {"case": NAME, "peer": WHO, "median_s": S, "min_s": S, "max_s": S, "unit": U, "unit_per_s": X}

- `gae`, `grpo`, `ppo_loss`: verl 0.9.1's `core_algos` (PyTorch) on the shapes the Rust benches use
  (GAE over [256, 1024]; GRPO advantages for 1024 rows in groups of 8; the vanilla PPO loss forward
  and backward over [256, 1024]);
- `fwd_bwd`, `generate`: HF transformers on `--model` (an HF folder, or a folder with a `.gguf`
  such as SmolLM2's): the causal-LM loss forward and backward of 4 x 256 tokens; sampling 8 prompts
  of 64 tokens for exactly 128 new ones.

Set up with `benches/peers/setup.sh`. Usage:
    python benches/peers/cases.py --cases gae,grpo,ppo_loss,fwd_bwd,generate [--model DIR] [--threads N]
"""

import argparse
import json
import os
import statistics
import time


def timed(fn, reps=5, warmup=1):
    """Median, min and max seconds of `reps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def report(case, peer, seconds, unit, units):
    median, low, high = seconds
    line = {"case": case, "peer": peer, "median_s": median, "min_s": low, "max_s": high,
            "unit": unit, "unit_per_s": units / median}
    print(json.dumps(line), flush=True)


def algorithm_cases(cases, torch):
    import numpy as np
    import verl.trainer.ppo.core_algos as core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    peer = "verl core_algos (torch %s)" % torch.__version__
    rows, length = 256, 1024
    # Rows of random lengths between a quarter and all of `length`.
    lengths = torch.randint(length // 4, length + 1, (rows, 1))
    mask = (torch.arange(length)[None] < lengths).float()
    if "gae" in cases:
        rewards, values = torch.randn(rows, length) * mask, torch.randn(rows, length) * mask
        gamma, lam = torch.tensor(1.0), torch.tensor(0.95)
        seconds = timed(lambda: core_algos.compute_gae_advantage_return(rewards, values, mask, gamma, lam))
        report("gae_b256_t1024", peer, seconds, "tokens", rows * length)
    if "grpo" in cases:
        group, sequences = 8, 1024
        rewards = torch.zeros(sequences, length)
        rewards[:, -1] = torch.randint(0, 2, (sequences,)).float()
        index = np.repeat(np.arange(sequences // group), group)
        full = torch.ones(sequences, length)
        seconds = timed(lambda: core_algos.compute_grpo_outcome_advantage(rewards, full, index))
        report("grpo_b1024_n8_t1024", peer, seconds, "sequences", sequences)
    if "ppo_loss" in cases:
        config = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                             rollout_n=1, clip_ratio=0.2, policy_loss=PolicyLossConfig())
        old = -torch.rand(rows, length) * 3
        advantages = torch.randn(rows, length)
        new = (old + 0.1 * torch.randn(rows, length)).requires_grad_(True)
        loss_fn = core_algos.get_policy_loss_fn("vanilla")

        def forward_backward():
            loss, _ = loss_fn(old, new, advantages, mask, loss_agg_mode="token-mean", config=config)
            loss.backward()

        seconds = timed(forward_backward)
        report("ppo_loss_fwd_bwd_b256_t1024", peer, seconds, "tokens", rows * length)


def model_cases(cases, torch, model_dir):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    gguf = sorted(f for f in os.listdir(model_dir) if f.endswith(".gguf"))
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(model_dir))
    extra = {"gguf_file": gguf[0]} if gguf and not has_weights else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra)
    peer = "transformers %s (torch %s)" % (transformers.__version__, torch.__version__)
    vocab = model.config.vocab_size
    if "fwd_bwd" in cases:
        model.train()
        rows, length = 4, 256
        ids = torch.randint(3, vocab, (rows, length))

        def forward_backward():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        report("smollm2_fwd_bwd_b4_l256", peer, timed(forward_backward, reps=3), "tokens", rows * length)
    if "generate" in cases:
        model.eval()
        rows, prompt, new = 8, 64, 128
        ids = torch.randint(3, vocab, (rows, prompt))

        def sample():
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0,
                               top_k=0, pad_token_id=0)

        report("smollm2_generate_b8_p64_n128", peer, timed(sample, reps=3), "new_tokens", rows * new)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="gae,grpo,ppo_loss,fwd_bwd,generate")
    parser.add_argument("--model", default=os.environ.get("RLHF_SMOLLM2_DIR", "../shared/models/smollm2-135m-instruct"))
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cases = set(args.cases.split(","))
    if cases & {"gae", "grpo", "ppo_loss"}:
        algorithm_cases(cases, torch)
    if cases & {"fwd_bwd", "generate"}:
        model_cases(cases, torch, args.model)


if __name__ == "__main__":
    main()
