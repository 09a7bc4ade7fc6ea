"""Tensor-parallel decode and prefill of Llama-3-70B's linear layers: per decoder layer the fused QKV (8192 -> 10240:
64 query and 8 key-value heads of 128) and gate+up (8192 -> 57344) column-parallel, O (8192 -> 8192) and down
(28672 -> 8192) row-parallel with their all-reduces, distinct random weights, bf16 activations; one step runs every
linear of ``--layers`` layers once on an (M, K) input of its local K. Variants, timed in turns: bf16 (``nn.Linear``
shards, the same all-reduces) and ours per recipe (``QuantizedLinear`` sharded by ``cutedsl_gemm.nn.parallel``'s
styles through ``parallelize_module``).

    python -m benchmarks.bench_tp                                       # TP=1
    torchrun --nproc-per-node 2 -m benchmarks.bench_tp --recipes row,deepseek

Decode at ``--batches`` tokens per step, prefill of ``--prefill`` tokens; each step runs as one captured CUDA graph
(``--mode eager``: eagerly, host cost included). Reported per step: ms (the slowest rank's median), tokens/s (tokens
per step / step time, for these layers), and the communication share: the step's all-reduces ((M, 8192) bf16, two
per layer) timed on their own, as a share of the step. The floor is one rank's quantized step without communication:
max(local weight and scale bytes + bf16 activations / HBM rate, FLOPs / FP8 rate) at the measured floors
(benchmarks.measure_floor). Rank 0 writes benchmarks/results/tp<world size>.json (``--name``, ``--no-save``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn import parallel as tp
from cutedsl_gemm.tools import models as M
from cutedsl_gemm.tools.cli import positive_int

from . import common
from .bench_model import positive_ints

HIDDEN = 8192
#: (name, N, K, kind) of one Llama-3-70B decoder layer's linears
LINEARS = (("qkv", 10240, HIDDEN, "colwise"), ("o", HIDDEN, HIDDEN, "rowwise"),
           ("gate_up", 57344, HIDDEN, "colwise"), ("down", HIDDEN, 28672, "rowwise"))
RECIPES = tuple(name for name, r in cnn.LINEAR_RECIPES.items() if "sm_90a" in r.archs)
COLUMNS = ["TP", "phase", "M", "variant", "ms per step", "ms per layer", "tokens/s", "x bf16", "comm ms", "comm %",
           "floor ms", "% of floor"]


def recipes(text: str) -> list:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in RECIPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(RECIPES)} (Hopper recipes), got {text!r}")
    return names


def _local_bf16(lin: torch.nn.Linear, kind: str, rank: int, world: int) -> torch.nn.Linear:
    """The bf16 shard of ``lin``; a row-parallel one all-reduces its output (the quantized styles' collective)."""
    n, k = lin.out_features, lin.in_features
    rows, cols = (slice(rank * n // world, (rank + 1) * n // world), slice(None)) if kind == "colwise" else (
        slice(None), slice(rank * k // world, (rank + 1) * k // world))
    w = lin.weight[rows, cols].clone(memory_format=torch.contiguous_format)
    local = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype).requires_grad_(False)
    local.weight.copy_(w)
    if kind == "rowwise" and world > 1:
        local.register_forward_hook(lambda mod, args, y: dist.all_reduce(y))
    return local


def build_stacks(layers: int, variants, mesh, rank: int, world: int, seed: int = 0) -> dict:
    """{variant: [local layers]}: ``layers`` x ``LINEARS``, the same random bf16 weights on every rank, sharded
    ``world`` ways (the quantized ones by ``parallelize_module``, no broadcast: the weights agree)."""
    torch.manual_seed(seed)
    stacks = {v: [] for v in variants}
    for _ in range(layers):
        for name, n, k, kind in LINEARS:
            lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
            for v in variants:
                if v == "bf16":
                    stacks[v].append(_local_bf16(lin, kind, rank, world))
                    continue
                box = torch.nn.ModuleDict({name: cnn.QuantizedLinear.from_linear(lin, recipe=v)})
                if world > 1:
                    style = tp.QuantizedColwiseParallel() if kind == "colwise" else tp.QuantizedRowwiseParallel()
                    parallelize_module(box, mesh, {name: style}, src_data_rank=None)
                stacks[v].append(box[name])
            del lin
    return stacks


def forward_fn(stack, inputs):
    def forward():
        for lin in stack:
            lin(inputs[lin.in_features])

    return forward


def comm_fn(m: int, layers: int):
    """The step's all-reduces alone: two (m, 8192) bf16 per layer."""
    bufs = [torch.zeros(m, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

    def comm():
        for _ in range(layers):
            for b in bufs:
                dist.all_reduce(b)

    return comm


def floor_ms(m: int, stack, floors: common.Floors) -> float:
    """One rank's quantized step without communication: bytes or FLOPs at the floors, whichever is longer."""
    nbytes = sum(t.numel() * t.element_size() for lin in stack for _, t in lin.named_buffers())
    nbytes += sum(2 * m * (lin.in_features + lin.out_features) for lin in stack)
    flops = sum(2 * m * lin.in_features * lin.out_features for lin in stack)
    return max(floors.stream_us(nbytes), floors.mma_us(flops)) / 1e3


def _slowest(x: float | None, world: int) -> float | None:
    """The largest of every rank's value (a step lasts as long as its slowest rank)."""
    if world == 1 or x is None:
        return x
    t = torch.tensor([x], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _round(x, digits):
    return None if x is None else round(x, digits)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers of four linears (default 4)")
    p.add_argument("--recipes", type=recipes, default=["row", "deepseek"], help="quantized variants (default "
                   "row,deepseek)")
    p.add_argument("--batches", type=positive_ints, default=[1, 16, 64], help="decode tokens per step (default "
                   "1,16,64)")
    p.add_argument("--prefill", type=int, default=4096, help="prefill tokens per step, 0 for none (default 4096)")
    p.add_argument("--mode", choices=("graph", "eager"), default="graph", help="CUDA graph per step (default) or eager")
    p.add_argument("--rounds", type=positive_int, default=10, help="timing rounds, variants in turns (default 10)")
    p.add_argument("--reps", type=positive_int, default=10, help="steps back to back per round (default 10)")
    common.add_result_options(p, None)
    args = p.parse_args(argv)
    common.require_gpu("bench_tp")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh, rank = None, 0
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        mesh, rank = init_device_mesh("cuda", (world,)), dist.get_rank()
    floors = common.measured_floors()
    variants = ["bf16", *args.recipes]
    stacks = build_stacks(args.layers, variants, mesh, rank, world)
    steps = [("decode", m) for m in args.batches] + ([("prefill", args.prefill)] if args.prefill > 0 else [])
    rows = []
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"TP={world}, {args.layers} Llama-3-70B layers ({4 * args.layers} linears), {args.mode}; ms per step")
    say(" ".join(f"{c:>{max(len(c), 9)}s}" for c in COLUMNS))
    for phase, m in steps:
        gen = torch.Generator(device="cuda").manual_seed(m)
        ks = {lin.in_features for stack in stacks.values() for lin in stack}
        inputs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) for k in ks}
        fns = {v: forward_fn(stack, inputs) for v, stack in stacks.items()}
        if world > 1:
            fns["comm"] = comm_fn(m, args.layers)
        runs = {name: fn if args.mode == "eager" else M.cuda_graph(fn)[0].replay for name, fn in fns.items()}
        t = {name: _slowest(ms, world) for name, ms in common.time_interleaved(runs, args.rounds, args.reps).items()}
        comm = t.get("comm")
        for v in variants:
            ms = t[v]
            floor = None if v == "bf16" else floor_ms(m, stacks[v], floors)
            rows.append([world, phase, m, v, _round(ms, 4), _round(ms / args.layers, 4), round(m / (ms * 1e-3), 1),
                         _round(t["bf16"] / ms, 3), _round(comm, 4), _round(comm and 100 * comm / ms, 1),
                         _round(floor, 4), _round(floor and 100 * floor / ms, 1)])
            say(" ".join(f"{'-' if x is None else x!s:>{max(len(c), 9)}s}" for x, c in zip(rows[-1], COLUMNS)))
        del runs, fns
        torch.cuda.empty_cache()
    notes = (f"TP={world}: {args.layers} Llama-3-70B decoder layers' linears (QKV 8192->10240 and gate+up "
             "8192->57344 column-parallel, O 8192->8192 and down 28672->8192 row-parallel, each row-parallel output "
             "all-reduced in bf16), distinct random weights, no bias; ms per step: the slowest rank's median of "
             f"{args.rounds} rounds of {args.reps} steps, variants in turns, {args.mode}; tokens/s: tokens per step / "
             "step time of these layers; comm ms: the step's all-reduces timed alone, comm %: their share of the step "
             "(no overlap); floor: one rank's quantized step without communication, weights + scales + activations "
             f"at {floors.hbm} or FLOPs at {floors.fp8}, whichever is longer")
    if rank == 0:
        common.save_result(args, f"tp{world}", f"Llama-3-70B linears at TP={world}: bf16 vs "
                           f"{', '.join(args.recipes)}", COLUMNS, rows, notes=notes)
    if world > 1:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
