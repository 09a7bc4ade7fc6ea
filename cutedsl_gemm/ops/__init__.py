"""The public ops, one module each with its torch operators beside it: ``scaled_mm`` (``scaled_mm``,
``quantize_scaled_mm``, ``scaled_mm_fp8_out``), ``quantize`` (``quantize_fp8``, ``quantize_int8``, ``quantize_mx``,
``quantize_nvfp4``), ``gated`` (``silu_mul_quantize_fp8``), ``weight_only`` (``mm_weight_only``), ``grouped``
(``grouped_scaled_mm``) and ``moe_route`` (``route_quantize_fp8``, ``sum_routed_pairs``); ``library`` holds what
their definitions share and imports none of them."""
