"""Loading a multi-GB checkpoint: ``cutedsl_gemm.nn.from_pretrained`` against transformers' load then ``convert``.

    python -m benchmarks.bench_load [--layers 8] [--device cuda] [--workdir DIR] [--shard-gb 5]
    python -m benchmarks.bench_load --tiny --device cpu --layers 2 --name load_tiny    (a check on the CPU)

A random-weight Llama-shaped model (Llama-3-8B dimensions, ``--layers`` decoder layers: 8 make a ~5.6 GB bf16
checkpoint; ``--hidden``, ``--intermediate``, ``--vocab`` change them, ``--tiny`` takes a small config) is built in
bf16 on the CPU and saved twice in a temporary directory under ``--workdir`` (removed at the end): the bf16
checkpoint as ``save_pretrained`` writes it (``--shard-gb`` per shard), and a FineGrainedFP8 checkpoint of the same
weights (every nn.Linear but the LM head as e4m3 codes with fp32 ``weight_scale_inv`` per 128x128 block, as
DeepSeek-V3 and Qwen3-FP8 ship theirs). The model is freed, then four ways of loading are timed, each in a fresh
process, the checkpoint's files read once just before so that the page cache holds them:

* ``from_pretrained bf16 -> row``: ``cnn.from_pretrained(bf16, "row", device=DEV)``, quantized layer by layer;
* ``transformers bf16 + convert``: ``AutoModelForCausalLM.from_pretrained(bf16).to(DEV)``, then ``cnn.convert``;
* ``from_pretrained FP8 (adopted)``: ``cnn.from_pretrained(fp8, device=DEV)``, the FP8 bytes and scales as stored;
* ``transformers bf16 (no quantization)``: the plain bf16 load, for reference.

Each process imports torch, transformers and the library (``import s``), loads a one-layer checkpoint of the same
dimensions once (``warm-up s``: the first calls, which compile the kernels or load them from the compile cache), then
times the load (``load s``, the GPU synchronized) while a thread samples its anonymous resident memory (RssAnon) every
~1 ms (``peak host MiB``: the peak above the value before the load; ``MALLOC_MMAP_THRESHOLD_`` is set so that freed
large blocks go back to the system; the mapped safetensors files are file-backed, so tensors that stay views of them
on the CPU are not counted); on CUDA ``peak GPU MiB`` is ``torch.cuda.max_memory_allocated()`` above the memory
allocated before the load. ``held MiB``: the loaded model's state_dict tensors. ``x transformers+convert``: the
transformers + convert load time over the way's (> 1: faster). The table goes to benchmarks/results/load.json
(``--name``, ``--no-save``); ``--tiny`` and ``--device cpu`` runs write a file only with ``--name``.
"""

from __future__ import annotations

# Only the standard library at the top: each child process imports this module first and then times the import of
# torch, transformers and the library itself.
import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAME = "load"

BF16_ROW = "from_pretrained bf16 -> row"
HF_CONVERT = "transformers bf16 + convert"
FP8 = "from_pretrained FP8 (adopted)"
HF_BF16 = "transformers bf16 (no quantization)"
#: way -> the checkpoint it loads
WAYS = {BF16_ROW: "bf16", HF_CONVERT: "bf16", FP8: "fp8", HF_BF16: "bf16"}
RATIO = "x transformers+convert"
COLUMNS = ["way", "device", "checkpoint GB", "load s", RATIO, "import s", "warm-up s", "peak host MiB",
           "peak GPU MiB", "held MiB", "QuantizedLinear layers"]

BLOCK = 128  # FineGrainedFP8's weight_block_size
E4M3_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero block's scale: codes of zero, no division by zero
QUANTIZATION_CONFIG = dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[BLOCK, BLOCK],
                           modules_to_not_convert=["lm_head"])
WARM_VOCAB = 2048  # the warm-up checkpoint's vocabulary at most: its LM head's K is the model's, N matters little
MARK = "bench_load result: "  # the child's line of results on its stdout
MiB = 1 << 20


# ---- the checkpoints ----------------------------------------------------------------------------------------------


def model_config(args, layers: int, vocab: int | None = None):
    """The LlamaConfig of the run: Llama-3-8B's dimensions (``--tiny``: the small test config) with ``--hidden``,
    ``--intermediate``, ``vocab`` (default ``--vocab``) and ``layers`` decoder layers."""
    from cutedsl_gemm.tools import models as M

    base = M.TINY_LLAMA if args.tiny else M.LLAMA3_8B
    dims = dict(base, hidden_size=args.hidden, intermediate_size=args.intermediate, vocab_size=vocab or args.vocab,
                head_dim=args.hidden // base["num_attention_heads"])
    return M.llama_config(layers, dims)


def quantize_block(w):
    """FineGrainedFP8's (codes, scale) of a weight (N, K): e4m3 codes, and per 128x128 block the fp32 scale
    ``weight_scale_inv`` (ceil(N/128), ceil(K/128)) that multiplies them (block amax / 448)."""
    import torch

    n, k = w.shape
    bn, bk = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.nn.functional.pad(w.float(), (0, bk * BLOCK - k, 0, bn * BLOCK - n))
    blocks = padded.view(bn, BLOCK, bk, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=MIN_SCALE)
    codes = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(bn * BLOCK, bk * BLOCK)[:n, :k].contiguous(), scale


def quantized_names(model) -> set:
    """The layers an FP8 checkpoint stores quantized: every nn.Linear but the LM head."""
    import torch

    return {name for name, m in model.named_modules() if type(m) is torch.nn.Linear and name != "lm_head"}


def shards(sizes: dict, shard_bytes: int) -> list:
    """The keys of ``sizes`` (key -> bytes) in order, in groups of at most ``shard_bytes`` (a larger tensor alone)."""
    groups, size = [[]], 0
    for key, nbytes in sizes.items():
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def write_fp8(model, path: Path, shard_bytes: int) -> None:
    """The FineGrainedFP8 checkpoint of ``model``: config.json with its quantization_config, and safetensors shards
    (with model.safetensors.index.json when more than one) quantized one shard at a time."""
    from safetensors.torch import save_file

    quantized = quantized_names(model)
    state = model.state_dict()
    sizes = {}
    for key, t in state.items():
        layer = key[: -len(".weight")]
        if key.endswith(".weight") and layer in quantized:
            n, k = t.shape
            sizes[key] = n * k
            sizes[f"{layer}.weight_scale_inv"] = -(-n // BLOCK) * -(-k // BLOCK) * 4
        else:
            sizes[key] = t.numel() * t.element_size()
    groups = shards(sizes, shard_bytes)
    files = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    path.mkdir(parents=True)
    weight_map = {}
    for keys, file in zip(groups, files):
        tensors = {}
        for key in keys:
            layer = key[: -len(".weight_scale_inv")] if key.endswith(".weight_scale_inv") else key[: -len(".weight")]
            if layer not in quantized:
                tensors[key] = state[key].contiguous()
            elif key.endswith(".weight"):
                tensors[key], tensors[f"{layer}.weight_scale_inv"] = quantize_block(state[key])
            weight_map[key] = file
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_checkpoints(config, root: Path, shard_bytes: int, seed: int) -> dict:
    """The bf16 and FP8 checkpoints of one random model under ``root``: {"bf16": dir, "fp8": dir}; the model is
    built in bf16 on the CPU and freed before returning."""
    import torch

    from cutedsl_gemm.tools import models as M

    model = M.random_llama(config, "cpu", torch.bfloat16, seed=seed)
    dirs = {"bf16": root / "bf16", "fp8": root / "fp8"}
    model.save_pretrained(dirs["bf16"], max_shard_size=shard_bytes)
    write_fp8(model, dirs["fp8"], shard_bytes)
    del model
    gc.collect()
    return dirs


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def warm_page_cache(path: Path, chunk: int = 64 * MiB) -> None:
    """Read every file of the checkpoint once, so that the timed load reads them from the page cache."""
    buf = bytearray(chunk)
    for f in sorted(Path(path).iterdir()):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# ---- one way, in a child process ----------------------------------------------------------------------------------


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes (RssAnon of /proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) * 1024


def load(way: str, path: str, device: str):
    """The model ``path`` loaded the way ``way`` says, on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    from cutedsl_gemm import nn as cnn

    if way == BF16_ROW:
        return cnn.from_pretrained(path, "row", device=device)[0]
    if way == FP8:
        return cnn.from_pretrained(path, device=device)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    if way == HF_CONVERT:
        cnn.convert(model, "row")
    return model


def child(t0: float, argv=None) -> None:
    """A child process's run (argv: way, checkpoint, warm-up checkpoint, device): the imports, one warm-up load, the
    timed load; prints one line of results (MARK, then JSON)."""
    way, path, warm, device = argv if argv is not None else sys.argv[1:5]
    import torch
    import transformers  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401  (imported by the first load otherwise)

    from cutedsl_gemm import nn as cnn

    cuda = device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.zeros(1, device="cuda")  # the CUDA context, counted with the imports
        sync()
    t1 = time.perf_counter()
    model = load(way, warm, device)
    sync()
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t2 = time.perf_counter()
    gpu_base = torch.cuda.memory_allocated() if cuda else 0
    base = rss_anon()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = load(way, path, device)
    sync()
    load_s = time.perf_counter() - start
    done.set()
    sampler.join()
    peak[0] = max(peak[0], rss_anon())
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    layers = sum(isinstance(m, cnn.QuantizedLinear) for m in model.modules())
    print(MARK + json.dumps({
        "import_s": t1 - t0, "warmup_s": t2 - t1, "load_s": load_s, "peak_host": peak[0] - base,
        "peak_gpu": torch.cuda.max_memory_allocated() - gpu_base if cuda else None, "held": held,
        "quantized_layers": layers}), flush=True)


CHILD = "import time; t0 = time.perf_counter(); from benchmarks.bench_load import child; child(t0)"


def run_way(way: str, path: Path, warm: Path, device: str, timeout: float) -> dict:
    """One way in a fresh process, its checkpoint's files read just before: the child's results, or
    {"error": why}."""
    warm_page_cache(path)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, way, str(path), str(warm), device], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1][len(MARK):])


# ---- the run ------------------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    # the CLI's rule, imported when the arguments are parsed: the children time their imports from a clean start
    from cutedsl_gemm.tools.cli import positive_int as whole_number

    return whole_number(text)


def block_multiple(text: str) -> int:
    value = positive_int(text)
    if value % BLOCK:
        raise argparse.ArgumentTypeError(f"expected a multiple of {BLOCK} (the FP8 blocks, the kernels' tiles), "
                                         f"got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def parse_args(argv=None):
    from . import common

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=None, metavar="N",
                   help="decoder layers (default 8: a ~5.6 GB bf16 checkpoint; 2 with --tiny)")
    p.add_argument("--hidden", type=block_multiple, default=None, help="hidden size (default 4096; 256 with --tiny)")
    p.add_argument("--intermediate", type=block_multiple, default=None,
                   help="MLP intermediate size (default 14336; 512 with --tiny)")
    p.add_argument("--vocab", type=positive_int, default=None, help="vocabulary (default 128256; 512 with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a small config of the same architecture (a check)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where the loaded layers go (default cuda; cpu: the CPU builds and fills them)")
    p.add_argument("--workdir", default=None,
                   help="the checkpoints go in a new temporary directory under it (default: the system's temp)")
    p.add_argument("--shard-gb", type=positive_float, default=5.0,
                   help="largest safetensors shard of both checkpoints, GB (default 5, as hub checkpoints)")
    p.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds per way (default 1800)")
    p.add_argument("--seed", type=int, default=0)
    common.add_result_options(p)
    args = p.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 8)
    args.hidden = args.hidden or (256 if args.tiny else 4096)
    args.intermediate = args.intermediate or (512 if args.tiny else 14336)
    args.vocab = args.vocab or (512 if args.tiny else 128256)
    if args.workdir is not None and not Path(args.workdir).is_dir():
        p.error(f"--workdir {args.workdir}: no such directory")
    if args.name is None and not (args.tiny or args.device == "cpu"):
        args.name = NAME
    return args


def table_line(cells) -> str:
    widths = (36, 6, 13, 8, 22, 8, 9, 13, 12, 9, 22)
    shown = ["n/a" if c is None else f"{c:g}" if isinstance(c, float) else str(c) for c in cells]
    return " | ".join(f"{s:>{w}s}" if i else f"{s:{w}s}" for i, (s, w) in enumerate(zip(shown, widths)))


def rounded(value, digits: int, unit: float = 1.0):
    """``value / unit`` to ``digits`` decimals; None for a way that failed."""
    return None if value is None else round(value / unit, digits)


def rows_of(results: dict, sizes: dict, device: str) -> list:
    """The table's rows, one per way, from the children's results ({way: result})."""
    base = rounded(results.get(HF_CONVERT, {}).get("load_s"), 4)  # the ratios of the times the table shows
    rows = []
    for way, r in results.items():
        load_s = rounded(r.get("load_s"), 4)
        ratio = round(base / load_s, 3) if base and load_s else None
        rows.append([way, device, round(sizes[WAYS[way]] / 1e9, 3), load_s, ratio, rounded(r.get("import_s"), 2),
                     rounded(r.get("warmup_s"), 2), rounded(r.get("peak_host"), 1, MiB),
                     rounded(r.get("peak_gpu"), 1, MiB), rounded(r.get("held"), 1, MiB), r.get("quantized_layers")])
    return rows


def main(argv=None):
    args = parse_args(argv)
    from . import common

    if args.device == "cuda":
        common.require_gpu("bench_load")
    config = model_config(args, args.layers)
    shard_bytes = max(1, int(args.shard_gb * 1e9))
    root = Path(tempfile.mkdtemp(prefix="bench_load_", dir=args.workdir))
    started = time.perf_counter()
    try:
        print(f"writing the checkpoints under {root}: {args.layers} layers, hidden {args.hidden}, intermediate "
              f"{args.intermediate}, vocab {args.vocab}", flush=True)
        dirs = write_checkpoints(config, root, shard_bytes, args.seed)
        # the warm-up checkpoints: one layer of the same shapes (a smaller vocabulary), so that each child's first
        # calls (kernels loaded from the compile cache, lazy imports) come before its timed load
        warm = write_checkpoints(model_config(args, 1, min(args.vocab, WARM_VOCAB)), root / "warm", shard_bytes,
                                 args.seed + 1)
        sizes = {kind: checkpoint_bytes(d) for kind, d in dirs.items()}
        print(f"bf16 {sizes['bf16'] / 1e9:.3f} GB, FP8 {sizes['fp8'] / 1e9:.3f} GB in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
        print(table_line(COLUMNS))
        results = {}
        for way, kind in WAYS.items():
            results[way] = run_way(way, dirs[kind], warm[kind], args.device, args.timeout)
            if "error" in results[way]:
                print(f"{way}: failed ({results[way]['error']})", flush=True)
        rows = rows_of(results, sizes, args.device)
        for row in rows:
            print(table_line(row))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    by_way = {row[0]: dict(zip(COLUMNS, row)) for row in rows}
    summary = {f"load s: {way}": by_way[way]["load s"] for way in WAYS}
    summary.update({f"{way} {RATIO}": by_way[way][RATIO] for way in (BF16_ROW, FP8)})
    summary.update({"checkpoint GB bf16": round(sizes["bf16"] / 1e9, 3), "checkpoint GB FP8":
                    round(sizes["fp8"] / 1e9, 3)})
    failed = "; ".join(f"{way} failed: {r['error']}" for way, r in results.items() if "error" in r)
    notes = (f"Llama-shaped model, random weights, {args.layers} layers, hidden {args.hidden}, intermediate "
             f"{args.intermediate}, {config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, vocab "
             f"{args.vocab}{' (tiny config)' if args.tiny else ''}; shards of at most {args.shard_gb:g} GB; FP8: "
             f"FineGrainedFP8, 128x128 blocks, lm_head bf16; each way in a fresh process after a warm-up load of a "
             f"one-layer checkpoint of the same dimensions; the page cache warmed by reading the checkpoint's files "
             f"once before each way; load s excludes the imports (import s); peak host: RssAnon sampled every ~1 ms "
             f"above its value before the load (MALLOC_MMAP_THRESHOLD_=65536; the mapped safetensors files, which "
             f"tensors loaded as stored on the CPU may stay views of, are file-backed and not counted); peak GPU: "
             f"torch.cuda.max_memory_allocated above the memory allocated before the load; held: the loaded "
             f"model's state_dict bytes" + (f"; {failed}" if failed else ""))
    title = f"Loading a {sizes['bf16'] / 1e9:.3g} GB Llama-shaped checkpoint into QuantizedLinear layers"
    if args.name:
        common.save_result(args, NAME, title, COLUMNS, rows, summary=summary, notes=notes)
    elif args.save:
        print("no result file (--tiny / --device cpu runs are checks; --name keeps one)")
    return rows


if __name__ == "__main__":
    main()
