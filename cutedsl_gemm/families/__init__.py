"""Kernel families: one module per family owns, for its instances of the table, the kernel's configuration, its
checks (``check``), its compile entry (``entry``: kernel entry and fake arguments), its shared-memory plan
(``resources``) and, where the family has them, what a call must be, which instance runs it and the launch plan.

``registry.py`` maps each (arch, op) of the table to its family: the runtime's one compile path
(``runtime.compile.instance_entry``), the table's validation (``selection.instances.validate``) and the PTX
inspection (``tools.ptx_inspect.kernel_resources``) look the family up there. ``keys.py`` holds the archs and ops
the families are keyed by. The families are the host code that imports ``cutedsl_gemm.kernels``, inside their
functions (importing a family loads no DSL)."""
