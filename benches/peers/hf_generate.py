"""HF transformers' side of `burn-rlhf bench --rollout`: the same prompts (token ids, as burn-rlhf
rendered them), `n` samples each at temperature 1 (top-k and top-p off), up to `max_new` new tokens,
ending at the `--eos` ids (none given: every row runs to `max_new`), with `model.generate` on
batches of `--batch-rows` rows (`batch_rows / n` prompts, left-padded): a static batch, as HF
generates. One JSON line in `burn-rlhf bench`'s form: new tokens per second, CPU utilisation (CPU
seconds per wall second), peak resident memory, and the KV cache's bytes at the end of the batch
whose cache was largest.

Set up: benches/peers/setup.sh. Usage:
  python hf_generate.py --model DIR --prompts FILE.json --n 4 --max-new 512 --batch-rows 32 \
      [--eos ID ...] [--pad ID] [--case NAME]
"""
import argparse
import json
import os
import resource
import time


def load(model_dir, torch):
    from transformers import AutoModelForCausalLM

    files = os.listdir(model_dir)
    gguf = sorted(f for f in files if f.endswith(".gguf"))
    has_weights = any(f.endswith(".safetensors") for f in files)
    extra = {"gguf_file": gguf[0]} if gguf and not has_weights else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra)


def cache_bytes(cache):
    """Bytes of the key and value tensors a generate call's cache holds."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--batch-rows", type=int, default=32)
    ap.add_argument("--eos", type=int, nargs="*", default=[])
    ap.add_argument("--pad", type=int, default=0)
    ap.add_argument("--case", default="rollout")
    a = ap.parse_args()
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(1)
    model = load(a.model, torch).eval()
    prompts = json.load(open(a.prompts))
    per_batch = max(1, a.batch_rows // a.n)
    peer = "transformers %s (torch %s, %d threads)" % (
        transformers.__version__, torch.__version__, torch.get_num_threads())

    def batch(group):
        width = max(len(p) for p in group)
        ids = torch.tensor([[a.pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=a.max_new,
                      num_return_sequences=a.n, pad_token_id=a.pad, return_dict_in_generate=True)
        if a.eos:
            kwargs["eos_token_id"] = a.eos
        else:
            kwargs["min_new_tokens"] = a.max_new
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **kwargs)
        new = out.sequences[:, width:]
        if a.eos:
            # A row's length: up to and with its first EOS; after it, HF pads.
            eos = torch.isin(new, torch.tensor(a.eos))
            first = torch.where(eos.any(1), eos.int().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
            lengths = first.tolist()
        else:
            lengths = [new.shape[1]] * new.shape[0]
        return lengths, cache_bytes(out.past_key_values)

    batch([prompts[0]])  # warm-up
    cpu0 = time.process_time()
    start = time.perf_counter()
    lengths, kv = [], 0
    for i in range(0, len(prompts), per_batch):
        got, cache = batch(prompts[i:i + per_batch])
        lengths += got
        kv = max(kv, cache)
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    tokens = sum(lengths)
    print(json.dumps({
        "case": a.case, "impl": peer, "median_s": seconds, "unit_per_s": tokens / seconds,
        "unit": "new tokens", "cpu_util": cpu / seconds,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "peak_kv_gb": kv / 1e9, "mean_response": tokens / len(lengths), "max_response": max(lengths),
    }), flush=True)


if __name__ == "__main__":
    main()
