"""benchmarks/audit_sweep.py: reading an audit's printed output and replaying the model on it (CPU)."""

import json

import pytest

from benchmarks import audit_sweep

# two shapes as bench_sweep --audit prints them: the model's pick at M = 128 (64x128) is timed, at M = 32 on a small
# layer (64x32 swapped) it is not; one candidate is over the error tolerance and must not count
AUDIT = """floor: 3 TB/s, 1324.9 TFLOPS (measured); ratio = cuBLAS us / ours us
tensor           128  57344   8192 |    218.2     176.2  0.807 | t128x64sk128 c1x1      split  1 |  0.74 of HBM floor
    small_m      t128x64sk128 c1x1      split  1    217.4 us x 0.81 err 0.0e+00
    cooperative  t64x128k128 c1x1       split  1    173.2 us x 1.02 err 0.0e+00
    cooperative  t128x96k128 c1x1       split  1    150.0 us x 1.17 err 5.0e-01  ERROR over tolerance
tensor            32   3072   1536 |     10.7       8.1  0.756 | t128x32sk128 c1x1      split  2 |  0.10 of HBM floor
    small_m      t128x32sk128 c1x1      split  2     10.7 us x 0.76 err 0.0e+00
    small_m      t64x16sk128 c1x1       split  1      9.9 us x 0.82 err 0.0e+00
"""


def test_parse_and_replay(tmp_path, capsys):
    path = tmp_path / "audit_tensor.txt"
    path.write_text(AUDIT)
    shapes = audit_sweep.parse_audit(path)
    big = shapes[("tensor", 128, 57344, 8192)]
    assert big["pick"] == ("t128x64sk128 c1x1", 1) and big["cublas"] == 176.2
    assert big["timed"] == {("t128x64sk128 c1x1", 1): 217.4, ("t64x128k128 c1x1", 1): 173.2}
    assert audit_sweep.model_pick("tensor", 128, 57344, 8192, 132) == ("t64x128k128 c1x1", 1)
    untimed = audit_sweep.report_audit(shapes, 132)
    assert untimed == [("tensor", 32, 3072, 1536, ("t64x32sk128 c1x1", 1))]
    out = capsys.readouterr().out
    # one shape counts: best 173.2 over the recorded pick's 217.4, and over the model's 173.2
    assert "recorded picks 0.7967, model picks 1.0000 (1 shapes; 1 left out" in out
    assert audit_sweep.audit_commands(untimed) == [
        "python -m benchmarks.bench_sweep --audit --rounds 2 --recipes tensor --ms 32 --nk 3072x1536"]


def test_a_result_file_without_its_printed_output(tmp_path):
    columns = ["recipe", "layer", "M", "N", "K", "ours us", "cuBLAS us", "ratio", "instance", "splits", "best",
               "best splits", "best us", "best ratio"]
    row = ["row", "-", 64, 8192, 8192, 28.8, 36.5, 1.267, "t64x64sk128 c1x1", 1, "t64x128k128 c1x1", 1, 28.0, 1.3]
    path = tmp_path / "audit_row.json"
    path.write_text(json.dumps({"name": "audit_row", "columns": columns, "rows": [row]}))
    assert audit_sweep.parse_audit(path)[("row", 64, 8192, 8192)]["timed"] == {
        ("t64x64sk128 c1x1", 1): 28.8, ("t64x128k128 c1x1", 1): 28.0}
    path.write_text(json.dumps({"name": "sweep", "columns": columns[:10], "rows": [row[:10]]}))
    with pytest.raises(SystemExit, match="no 'best' column"):
        audit_sweep.parse_audit(path)
