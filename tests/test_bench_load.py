"""benchmarks.bench_load on the CPU: the FP8 checkpoint it writes (block scales, shards), its arguments, and one
tiny run end to end (two checkpoints, four ways each in a child process) into a temporary results directory."""

import json

import pytest
import torch

from benchmarks import bench_load as B
from benchmarks import common

pytest.importorskip("transformers")

TINY = ["--tiny", "--device", "cpu", "--layers", "2"]


def test_block_quantization_and_shards():
    torch.manual_seed(0)
    w = torch.randn(300, 200, dtype=torch.bfloat16)
    w[256:, 128:] = 0  # a block of zeros: its scale stays above 0, its codes 0
    q, s = B.quantize_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 200)
    assert s.dtype == torch.float32 and s.shape == (3, 2) and s[2, 1] == B.MIN_SCALE and (s > 0).all()
    full = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    back = q.float() * full
    assert (back - w.float()).abs().max() <= (full * 32).max()  # e4m3: 3 mantissa bits, codes up to 448
    assert (back - w.float()).norm() / w.float().norm() < 0.05
    for i in range(2):  # each block's largest magnitude is a code of 448
        assert q[i * 128:(i + 1) * 128, :128].float().abs().amax() == B.E4M3_MAX
    assert B.shards({"a": 4, "b": 4, "c": 9, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]
    assert B.shards({"a": 4}, 1) == [["a"]]


def test_arguments():
    args = B.parse_args([])
    assert (args.layers, args.hidden, args.intermediate, args.vocab) == (8, 4096, 14336, 128256)
    assert args.device == "cuda" and args.name == "load" and args.save and args.shard_gb == 5.0
    config = B.model_config(args, args.layers)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    args = B.parse_args(TINY)
    assert (args.layers, args.hidden, args.intermediate, args.vocab) == (2, 256, 512, 512)
    assert args.name is None  # a check keeps no file unless --name
    assert B.parse_args(["--device", "cpu", "--name", "mine"]).name == "mine"


@pytest.mark.parametrize("argv, error", [
    (["--layers", "0"], "expected a whole number >= 1, got 0"),
    (["--hidden", "100"], "expected a multiple of 128"),
    (["--vocab", "x"], "expected a whole number >= 1, got 'x'"),
    (["--shard-gb", "0"], "expected a number > 0"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--workdir", "/nonexistent/dir"], "no such directory"),
])
def test_bad_arguments_are_refused(argv, error, capsys):
    with pytest.raises(SystemExit) as e:
        B.main(TINY + argv)
    assert e.value.code == 2 and error in capsys.readouterr().err


def test_cuda_without_a_gpu_stops_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(B, "write_checkpoints", lambda *a: pytest.fail("nothing is written without a GPU"))
    with pytest.raises(SystemExit, match="bench_load needs a CUDA GPU"):
        B.main(["--tiny"])


def test_tiny_run_end_to_end(tmp_path, monkeypatch, capsys):
    results, work = tmp_path / "results", tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(common, "RESULTS_DIR", results)
    written, qconfigs, real_write = [], [], B.write_checkpoints

    def write(config, root, shard_bytes, seed):  # what each checkpoint directory holds, before it is removed
        dirs = real_write(config, root, shard_bytes, seed)
        written.append({kind: sorted(f.name for f in d.iterdir()) for kind, d in dirs.items()})
        qconfigs.append(json.loads((dirs["fp8"] / "config.json").read_text())["quantization_config"])
        return dirs

    monkeypatch.setattr(B, "write_checkpoints", write)
    rows = B.main(TINY + ["--shard-gb", "0.001", "--workdir", str(work), "--name", "load"])
    out = capsys.readouterr().out
    assert list(work.iterdir()) == []  # the checkpoints are removed
    model, warm = written  # the model's checkpoints, then the warm-up's
    assert qconfigs == [B.QUANTIZATION_CONFIG] * 2
    for files in (model["bf16"], model["fp8"]):  # both sharded, with an index
        assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) >= 2
    assert "config.json" in warm["fp8"]

    got = json.loads((results / "load.json").read_text())
    assert got["columns"] == B.COLUMNS and got["rows"] == rows and got["gpu"] == "no GPU"
    cells = {row[0]: dict(zip(B.COLUMNS, row)) for row in rows}
    assert list(cells) == [B.BF16_ROW, B.HF_CONVERT, B.FP8, B.HF_BF16] == list(B.WAYS)
    base = cells[B.HF_CONVERT]["load s"]
    for way, c in cells.items():
        assert c["device"] == "cpu" and c["checkpoint GB"] > 0 and c["peak GPU MiB"] is None
        assert c["load s"] > 0 and c["import s"] > 0 and c["warm-up s"] > 0
        # (a tiny model's load can fit in heap memory the warm-up load freed: its peak above the base may be 0)
        assert c["peak host MiB"] >= 0 and c["held MiB"] > 0
        assert c[B.RATIO] == pytest.approx(base / c["load s"], abs=1e-3)
        assert way in out
    assert cells[B.HF_CONVERT][B.RATIO] == 1
    assert cells[B.FP8]["checkpoint GB"] < cells[B.HF_BF16]["checkpoint GB"]
    for way in (B.FP8, B.BF16_ROW):
        assert cells[way]["held MiB"] < cells[B.HF_BF16]["held MiB"]
    # every linear of the 2 layers (7 each) quantized, the LM head too where the model is quantized on the CPU
    assert [c["QuantizedLinear layers"] for c in cells.values()] == [15, 15, 14, 0]

    summary = got["summary"]
    assert summary[f"load s: {B.FP8}"] == cells[B.FP8]["load s"]
    assert summary[f"{B.BF16_ROW} {B.RATIO}"] == cells[B.BF16_ROW][B.RATIO]
    assert summary[f"{B.FP8} {B.RATIO}"] == cells[B.FP8][B.RATIO]
    assert "2 layers" in got["notes"] and "page cache" in got["notes"] and "fresh process" in got["notes"]
    assert "failed" not in got["notes"]


def test_a_failed_way_is_reported_and_left_blank(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    failed = B.run_way(B.FP8, empty, empty, "cpu", timeout=120)  # no config.json: the child exits with the error
    assert list(failed) == ["error"] and failed["error"].startswith("exit 1: ") and "config.json" in failed["error"]
    ok = {"load_s": 2.0, "import_s": 1.0, "warmup_s": 0.5, "peak_host": 3 * B.MiB, "peak_gpu": None,
          "held": B.MiB, "quantized_layers": 7}
    rows = B.rows_of({B.BF16_ROW: ok, B.HF_CONVERT: {**ok, "load_s": 3.0}, B.FP8: failed}, {"bf16": 2e9, "fp8": 1e9},
                     "cpu")
    assert rows[0] == [B.BF16_ROW, "cpu", 2.0, 2.0, 1.5, 1.0, 0.5, 3.0, None, 1.0, 7]
    assert rows[2] == [B.FP8, "cpu", 1.0] + [None] * 8
    rows = B.rows_of({B.BF16_ROW: ok, B.HF_CONVERT: failed}, {"bf16": 2e9}, "cpu")
    assert rows[0][3] == 2.0 and rows[0][4] is None  # no ratio without the transformers + convert time
