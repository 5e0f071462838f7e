#!/usr/bin/env bash
# Runs a quickstart on several seeds and prints held-out accuracy after the warm-up, after RL, the
# gain and the time of each; exits 1 when a seed gains fewer than MIN_GAIN points (issue 59: every
# seed of a demo must show learning on any CPU).
#   examples/seeds.sh [quickstart|tool_quickstart] [SEEDS...]     (default: quickstart 1 2 3 4 5)
# Logs go to runs/seeds/<example>-<seed>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
example=${1:-quickstart}
shift || true
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(1 2 3 4 5)
min_gain=${MIN_GAIN:-20}
cargo build --release --example "$example" >/dev/null 2>&1 || cargo build --release --example "$example"
mkdir -p runs/seeds
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')
family=$(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
model=$(grep -m1 '^model\s*:' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
echo "$example on $(nproc) CPUs: $cpu (family $family model $model), $(date -u +%F)"
printf '%-6s %-12s %-10s %-8s %-8s\n' seed after-warmup after-RL gain time
failed=0
for seed in "${seeds[@]}"; do
    log=runs/seeds/$example-$seed.log
    start=$(date +%s.%N)
    target/release/examples/"$example" --seed "$seed" --out "runs/seeds/$example-$seed" >"$log" 2>&1
    secs=$(echo "$(date +%s.%N) - $start" | bc)
    line=$(grep 'held-out accuracy after SFT: .*, after' "$log" | tail -1)
    before=$(echo "$line" | sed -E 's/.*after SFT: ([0-9.]+)%.*/\1/')
    after=$(echo "$line" | sed -E 's/.*after (PPO|GRPO): ([0-9.]+)%.*/\2/')
    gain=$(echo "$after - $before" | bc)
    printf '%-6s %-12s %-10s %-8s %-8s\n' "$seed" "$before%" "$after%" "$gain" "$(printf '%.0f' "$secs") s"
    if (( $(echo "$gain < $min_gain" | bc) )); then failed=1; fi
done
[ $failed -eq 0 ] || { echo "a seed gained fewer than $min_gain points"; exit 1; }
