"""torch's side of `burn-rlhf bench-products`: the same matrix products (Qwen2.5-0.5B's MLP 896 ->
4864 and LM head 896 -> 151936 over ROWS tokens: x.W, dy.Wt and xt.dy, transposes as views) with
`torch.matmul` (cuBLAS on a GPU), f32 (TF32 off, as burn-rlhf's exact default) and bf16, one JSON
line each in the same form.

Usage: python products.py [--rows 3072] [--reps 10] [--dtypes f32 bf16] [--device auto|cpu|cuda]
"""
import argparse, json, time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3072)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtypes", nargs="+", default=["f32", "bf16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a = ap.parse_args()
    dev = "cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    layers = [("mlp_up", 896, 4864), ("lm_head", 896, 151936)]
    for name in a.dtypes:
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]
        for layer, d_in, d_out in layers:
            rnd = lambda *s: (torch.randn(*s, device=dev) * 0.05).to(dtype)
            cases = {
                "x.W": (rnd(a.rows, d_in), rnd(d_in, d_out)),
                "dy.Wt": (rnd(a.rows, d_out), rnd(d_in, d_out).t()),
                "xt.dy": (rnd(a.rows, d_in).t(), rnd(a.rows, d_out)),
            }
            for role, (x, w) in cases.items():
                def run():
                    sync()
                    t0 = time.perf_counter()
                    out = x @ w
                    sync()
                    return time.perf_counter() - t0, out
                cold, _ = run()
                warm = sorted(run()[0] for _ in range(max(a.reps, 1)))
                median = warm[len(warm) // 2]
                m, k, n = x.shape[0], x.shape[1], w.shape[1]
                print(json.dumps({
                    "case": f"product_{layer}_{role}_{name}", "engine": "torch", "backend": dev,
                    "m": m, "k": k, "n": n, "dtype": name, "cold_s": cold, "median_s": median,
                    "unit_per_s": 2.0 * m * k * n / median / 1e12, "unit": "TFLOP/s",
                    "torch": torch.__version__,
                }), flush=True)


if __name__ == "__main__":
    main()
