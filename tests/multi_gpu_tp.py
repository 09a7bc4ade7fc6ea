"""Tensor parallelism on GPUs, one process per GPU (NCCL): a column-parallel layer's output is, bit for bit, its
slice of the whole layer's; a row-parallel layer's all-reduced output matches the whole layer's within the rounding
of its partial sums (and of its activation scales, per shard for the per-token / per-tensor recipes) and is the same
on every rank; a tiny Llama's logits sharded match its logits whole. Every Hopper recipe.

    torchrun --nproc-per-node 2 tests/multi_gpu_tp.py

Exits 1 when a check fails on any rank (each failure printed with its rank), 0 after "all tensor-parallel checks
passed". ``tests/test_parallel.py`` runs it where two GPUs are visible.
"""

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from cutedsl_gemm.nn import LINEAR_RECIPES, QuantizedLinear, convert
from cutedsl_gemm.nn import parallel as TP

HOPPER = [name for name, r in LINEAR_RECIPES.items() if "sm_90a" in r.archs]
N, K = 1024, 2048
MS = (1, 16, 300)  # decode rows, and a ragged prefill
#: relative L2 error allowed for a row-parallel output: per-shard activation scales (per token, per tensor) change
#: the activations' codes; the other recipes differ only by the bf16 rounding of the partial sums
ROW_TOLERANCE = {"row": 0.05, "tensor": 0.05, "int8": 0.05}
ROUNDING_TOLERANCE = 0.02
MODEL_TOLERANCE = 0.1  # logits through two decoder layers
MODEL_RECIPES = ("row", "deepseek", "int8", "int4_weight")
TINY = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)  # every projection splits 2 ways on 128-row blocks


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def layer(recipe: str) -> QuantizedLinear:
    """The same layer on every rank (seeded weights), on this rank's GPU."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, device="cuda", generator=g) * 0.05)
        lin.bias.copy_(torch.randn(N, device="cuda", generator=g))
    return QuantizedLinear.from_linear(lin, recipe)


def inputs(m: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(m)
    return torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=g)


def check_colwise(mesh, recipe):
    rank, world = mesh.get_local_rank(), mesh.size()
    whole, box = layer(recipe), torch.nn.ModuleDict({"lin": layer(recipe)})
    parallelize_module(box, mesh, {"lin": TP.QuantizedColwiseParallel()})
    part = slice(rank * N // world, (rank + 1) * N // world)
    for m in MS:
        x = inputs(m)
        want, got = whole(x)[:, part], box.lin(x)
        assert torch.equal(got, want), (f"{recipe} colwise M={m}: not bit-equal to the whole layer's slice (max "
                                        f"difference {(got.float() - want.float()).abs().max().item():g})")


def check_rowwise(mesh, recipe):
    rank, world = mesh.get_local_rank(), mesh.size()
    whole, box = layer(recipe), torch.nn.ModuleDict({"lin": layer(recipe)})
    parallelize_module(box, mesh, {"lin": TP.QuantizedRowwiseParallel()})
    part = slice(rank * K // world, (rank + 1) * K // world)
    tolerance = ROW_TOLERANCE.get(recipe, ROUNDING_TOLERANCE)
    for m in MS:
        x = inputs(m)
        want, got = whole(x), box.lin(x[:, part].contiguous())  # the input arrives sharded (Shard(-1))
        err = rel_err(got, want)
        assert err <= tolerance, f"{recipe} rowwise M={m}: relative error {err:.4f} > {tolerance}"
        everyone = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(everyone, got.contiguous())
        assert all(torch.equal(e, everyone[0]) for e in everyone), f"{recipe} rowwise M={m}: ranks differ"


def check_model(mesh, recipe):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).to("cuda", torch.bfloat16).eval()
    convert(model, recipe)
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        whole = model(ids).logits
        TP.parallelize(model, mesh)
        sharded = model(ids).logits
    err = rel_err(sharded, whole)
    assert err <= MODEL_TOLERANCE, f"{recipe} tiny Llama: logits' relative error {err:.4f} > {MODEL_TOLERANCE}"


def main() -> int:
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    rank = dist.get_rank()
    checks = [(f"colwise {r}", check_colwise, r) for r in HOPPER] + [(f"rowwise {r}", check_rowwise, r) for r in HOPPER]
    checks += [(f"tiny Llama {r}", check_model, r) for r in MODEL_RECIPES]
    failures = []
    for name, fn, recipe in checks:
        try:
            fn(mesh, recipe)
        except Exception:
            failures.append(f"{name}: {traceback.format_exc()}")
    for failure in failures:
        print(f"rank {rank}: FAILED {failure}", flush=True)
    count = torch.tensor([len(failures)], device="cuda")
    dist.all_reduce(count)
    if rank == 0:
        print(f"{len(checks)} checks on {mesh.size()} GPUs: " +
              ("all tensor-parallel checks passed" if count.item() == 0 else f"{count.item()} failures over the ranks"),
              flush=True)
    dist.destroy_process_group()
    return 1 if count.item() else 0


if __name__ == "__main__":
    sys.exit(main())
