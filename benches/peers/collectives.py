"""Peer of `burn-rlhf bench-collectives`: torch.distributed's collectives over gloo (its CPU
backend) between WORLD processes on this host, timed as burn-rlhf times its own: per operation
and size (4 KiB x 4 up to --max-bytes), each repetition alone between barriers, the median of
the slowest rank. One JSON line per case (`case`, `bytes`, `ranks`, `median_s`), the bytes
counted as nccl-tests counts them (all-gather: the gathered whole; reduce-scatter: the input).

gloo has no reduce-scatter; like burn-rlhf's default it is an all-reduce that each rank keeps its
chunk of.

Set-up: benches/peers/setup.sh. Usage: python collectives.py --world 2 --max-bytes 67108864
"""
import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPERATIONS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


def sizes(max_bytes):
    b = 4096
    while b <= max(max_bytes, 4096):
        yield b
        b *= 4


def repetitions(nbytes):
    return min(max(64 * 1024 * 1024 // nbytes, 5), 50)


def run(rank, world, max_bytes, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for op in OPERATIONS:
        for nbytes in sizes(max_bytes):
            floats = nbytes // 4
            part = floats // world
            times = []
            for rep in range(repetitions(nbytes) + 1):
                data = torch.full((floats,), float(rank + 1))
                dist.barrier()
                start = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(data)
                elif op == "all_gather":
                    mine = data[:part].clone()
                    gathered = [torch.empty(part) for _ in range(world)]
                    dist.all_gather(gathered, mine)
                elif op == "reduce_scatter":
                    dist.all_reduce(data)
                    _ = data[rank * part:(rank + 1) * part].clone()
                else:
                    dist.broadcast(data, src=0)
                took = time.perf_counter() - start
                if rep > 0:
                    times.append(took)
            median = torch.tensor([statistics.median_low(sorted(times))], dtype=torch.float64)
            dist.all_reduce(median, op=dist.ReduceOp.MAX)
            rows.append({"case": op, "bytes": part * world * 4, "ranks": world,
                         "median_s": median.item()})
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run, args=(r, args.world, args.max_bytes, port, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    rows = out.get()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"rank process exited with {p.exitcode}")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
