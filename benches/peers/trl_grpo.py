"""TRL's GRPOTrainer on the same model folder, data and sizes as `burn-rlhf bench-step`: the peer side
of the side-by-side GRPO step benchmark (run by it, or alone).

Prompts are GSM8K questions in verl's form (question + the "####" instruction as one user message,
the model's chat template), taken in file order (no shuffle) so both sides see the same prompts.
One step = one generation of `prompts x n` completions and one optimiser step over them (TRL's
`steps_per_generation` = gradient accumulation, so `micro` rows per forward/backward). No KL
(beta=0), one iteration, so TRL skips its old-log-prob pass, as burn-rlhf does when on-policy.

On a GPU (`--device cuda`, or `auto` when torch sees one) the model trains there; `--dtype bfloat16`
loads its weights in bf16 (and turns TRL's bf16 autocast on), as `model.dtype=bfloat16` does on our
side. Each step's clock stops after the device has finished (`torch.cuda.synchronize`).

Prints one JSON line: per step its seconds, generation and update seconds, CPU utilisation
(process CPU time / wall), plus the process's peak resident memory, on a GPU the device memory
PyTorch's allocator reserved at its peak (`peak_device_gb`, the figure comparable with CubeCL's
pool) and allocated, and the mean completion length.

Set up: benches/peers/setup.sh (a venv with torch, transformers, trl, datasets); on a GPU host
without network, see docs/gpu_host.md for carrying TRL and its pure-Python dependencies as wheels.
Usage: python trl_grpo.py --model DIR --data train.jsonl [--prompts 8 --n 4 --response 128 --micro 8
    --steps 2 --device auto --dtype float32]
"""
import argparse, json, os, re, resource, sys, time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="an HF folder (f32 safetensors + tokenizer)")
    ap.add_argument("--data", required=True, help="GSM8K jsonl ({question, answer} lines)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8, help="rows per forward/backward")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--gradient-checkpointing", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="/tmp/trl_grpo_peer")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = ap.parse_args()

    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    bf16 = a.dtype == "bfloat16"
    import transformers
    transformers.logging.set_verbosity_error()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    import trl
    from trl import GRPOConfig, GRPOTrainer

    instruction = "Let's think step by step and output the final answer after \"####\"."
    rows = []
    with open(a.data) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            truth = re.search(r"#### (\-?[0-9\.\,]+)", r["answer"]).group(1).replace(",", "")
            rows.append({"prompt": [{"role": "user", "content": f"{r['question']} {instruction}"}],
                         "ground_truth": truth})
            if len(rows) >= a.prompts * a.steps:
                break
    data = Dataset.from_list(rows)

    strict = re.compile(r"#### (\-?[0-9\.\,]+)")

    def gsm8k_reward(completions, ground_truth, **_):
        # verl's strict GSM8K score: the last "#### N" of the last 300 characters.
        out = []
        for c, t in zip(completions, ground_truth):
            text = c[0]["content"] if isinstance(c, list) else c
            found = strict.findall(text[-300:])
            out.append(1.0 if found and found[-1].replace(",", "").replace("$", "") == t else 0.0)
        return out

    if a.micro <= 0 or (a.prompts * a.n) % a.micro:
        sys.exit(f"--micro {a.micro} must divide prompts x n = {a.prompts * a.n}")
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if bf16 else torch.float32)
    config = GRPOConfig(
        output_dir=a.out, report_to="none", save_strategy="no", logging_steps=1, use_cpu=not cuda,
        bf16=bf16, fp16=False, seed=0, shuffle_dataset=False, max_steps=a.steps,
        per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.prompts * a.n // a.micro,
        num_generations=a.n, max_completion_length=a.response, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=a.lr, beta=0.0, num_iterations=1, gradient_checkpointing=bool(a.gradient_checkpointing),
        dataloader_num_workers=0, disable_dropout=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=gsm8k_reward, args=config, train_dataset=data,
                          processing_class=tok)

    steps, gen, lengths = [], [], []
    original = trainer._generate_and_score_completions

    def timed_generation(*args, **kwargs):
        synchronize()
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        synchronize()
        gen.append(time.perf_counter() - t0)
        lengths.append(float(out["completion_mask"].sum(1).float().mean()))
        return out

    trainer._generate_and_score_completions = timed_generation

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            synchronize()
            self.t0, self.cpu0 = time.perf_counter(), os.times()

        def on_step_end(self, *_, **__):
            synchronize()
            wall = time.perf_counter() - self.t0
            cpu1 = os.times()
            cpu = (cpu1.user - self.cpu0.user) + (cpu1.system - self.cpu0.system)
            steps.append({"step_s": wall, "cpu_util": cpu / wall})

    trainer.add_callback(StepClock())
    trainer.train()
    for s, g in zip(steps, gen):
        s["gen_s"] = g
        s["update_s"] = s["step_s"] - g
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    device = {"device": "cpu"}
    if cuda:
        device = {
            "device": torch.cuda.get_device_name(0),
            "peak_device_gb": torch.cuda.max_memory_reserved() / 1e9,
            "peak_device_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
        }
    print(json.dumps({
        "peer": f"TRL {trl.__version__} GRPOTrainer (torch {torch.__version__}, transformers "
                f"{transformers.__version__}, {a.dtype} on {device['device']})",
        "threads": torch.get_num_threads(), "steps": steps, "peak_rss_gb": peak_kb / 1e6,
        "mean_response_len": sum(lengths) / max(len(lengths), 1), "dtype": a.dtype, **device,
    }), flush=True)


if __name__ == "__main__":
    main()
