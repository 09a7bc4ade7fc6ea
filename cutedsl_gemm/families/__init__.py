"""Kernel families: one module per family owns, for its instances of the table, what a call must be (its checks and
description), which instance runs it, the compile entry (kernel object and fake arguments) and the launch plan.
The runtime's one compile path (``runtime.compile.instance_entry``) and the ops reach a family through these
modules; only they (and the runtime) import ``cutedsl_gemm.kernels``, and only when compiling."""
