"""benchmarks.audit_picks reads tune_tiles' output and names dispatch's pick in tune_tiles' own format."""

import math

from benchmarks import audit_picks
from benchmarks.tune_tiles import tile_label
from cutedsl_gemm.selection import dispatch

# Lines as benchmarks.tune_tiles prints them on an H100, timings changed so each shape's pick and best
# tile differ and the geomeans are known.
SAMPLE = """\
tensor M=6144 N=576 K=7168: cuBLAS 44.0 us (1241 GB/s, 1140 TFLOPS)
   tune          t128x144k128 c2x1    promoted split  1    55.0 us   1072 GB/s  35.7%    985 TFLOPS x 0.86 err 1.7e-03
   tune          t128x128k128 c4x1    promoted split  1    48.8 us   1132 GB/s  37.7%   1040 TFLOPS x 0.91 err 1.7e-03
   tune          t128x192k128 c2x1lw  promoted split  4    44.0 us   1082 GB/s  36.1%    994 TFLOPS x 0.87 err 1.7e-03
tensor M=1024 N=1536 K=7168: cuBLAS 22.0 us (746 GB/s, 782 TFLOPS)
   tune          t128x96k128 c1x1     promoted split  1    24.2 us    912 GB/s  30.4%    837 TFLOPS x 0.73 err 1.7e-03
   tune          t128x128k128 c2x1    promoted split  1    22.0 us   1024 GB/s  34.1%    940 TFLOPS x 0.83 err 1.7e-03
"""


def test_audit_compares_dispatch_pick_with_best_tile(tmp_path, capsys):
    first, second = tmp_path / "r1.txt", tmp_path / "r2.txt"
    first.write_text(SAMPLE)
    second.write_text(SAMPLE.replace("48.8 us", "48.4 us"))  # each tile's fastest run counts
    runs, cublas = audit_picks.parse([first, second])
    assert cublas[("tensor", 6144, 576, 7168)] == [44.0, 44.0]
    assert runs[("tensor", "promoted", 6144, 576, 7168)]["t128x192k128 c2x1lw"] == [44.0, 44.0]
    # Dispatch's picks, named as tune_tiles prints them.
    assert audit_picks.dispatch_key("tensor", "promoted", 6144, 576, 7168, 132) == "t128x128k128 c4x1"
    assert audit_picks.dispatch_key("tensor", "promoted", 1024, 1536, 7168, 132) == "t128x96k128 c1x1"
    tall = dispatch.select_gemm("sm_90a", "tensor", "e4m3", "e4m3", "bf16", None, 8192, n=8192, sms=132, k=8192)
    assert tile_label(dispatch.last_wave_variant(tall)) == "t128x192k128 c2x1lw"
    # A fixed stage count is part of the name (the DeepSeek recipe's 128x192 row has 4).
    assert audit_picks.dispatch_key("1x128_128x128", "promoted", 8192, 8192, 8192, 132) == "t128x192k128 c2x1st4"
    audit_picks.main([str(first), str(second)])
    out = capsys.readouterr().out
    picks = math.sqrt(44.0 / 48.4 * 22.0 / 24.2)
    assert f"dispatch's picks {picks:.3f}, best tile per shape 1.000 (2 shapes)" in out
    assert "best t128x192k128 c2x1lw" in out and "pick t128x128k128 c4x1" in out
