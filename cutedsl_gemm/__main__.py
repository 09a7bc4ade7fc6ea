from cutedsl_gemm.tools.cli import main

raise SystemExit(main())
