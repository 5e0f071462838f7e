"""HF transformers on the cases of `burn-rlhf bench` (same model folder, same sizes, f32): sampling
`prompts` random prompts of `prompt` tokens for `new` new tokens each (no stop: every row runs to
`new`), and the forward and backward of the language-model loss over `rows` random sequences of
`len` tokens. One JSON line per case, in `burn-rlhf bench`'s form (`case`, `median_s`,
`unit_per_s`, `unit`), so the two read side by side.

On a GPU (`--device cuda`, or `auto` when torch sees one) the model runs there, each timing after
`torch.cuda.synchronize`; `--dtype bfloat16` loads its weights in bf16 (as `model.dtype=bfloat16`).

Set up: benches/peers/setup.sh. Usage:
  python hf_model.py --model DIR [--generate 8 64 128] [--fwd-bwd 4 256] [--gradient-checkpointing 0]
      [--device auto] [--dtype float32]
"""
import argparse, json, statistics, time


def timed(fn, reps, sync=lambda: None):
    fn()  # warm-up, as burn-rlhf's "cold" run
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--generate", type=int, nargs=3, default=[8, 64, 128])
    ap.add_argument("--fwd-bwd", type=int, nargs=2, default=[4, 256])
    ap.add_argument("--gradient-checkpointing", type=int, default=0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = ap.parse_args()
    import torch, transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    dev = "cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    m = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(dev)
    vocab = m.config.vocab_size
    where = torch.cuda.get_device_name(0) if dev == "cuda" else f"{torch.get_num_threads()} threads"
    peer = f"transformers {transformers.__version__} (torch {torch.__version__}, {a.dtype}, {where})"
    rows, prompt, new = a.generate
    if rows:
        ids = torch.randint(3, vocab, (rows, prompt)).to(dev)
        m.eval()

        def gen():
            with torch.no_grad():
                m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                           top_k=0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

        s = timed(gen, a.reps, sync)
        print(json.dumps({"case": f"generate_b{rows}_p{prompt}_n{new}", "peer": peer, "median_s": s,
                          "unit_per_s": rows * new / s, "unit": "new tokens"}), flush=True)
    rows, length = a.fwd_bwd
    if rows:
        seq = torch.randint(3, vocab, (rows, length)).to(dev)
        m.train()
        if a.gradient_checkpointing:
            m.gradient_checkpointing_enable()

        def fwd_bwd():
            m(seq, labels=seq).loss.backward()
            m.zero_grad(set_to_none=True)

        s = timed(fwd_bwd, a.reps, sync)
        print(json.dumps({"case": f"fwd_bwd_{rows}x{length}", "peer": peer, "median_s": s,
                          "unit_per_s": rows * length / s, "unit": "tokens"}), flush=True)


if __name__ == "__main__":
    main()
