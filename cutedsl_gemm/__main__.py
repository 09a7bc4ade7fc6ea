from cutedsl_gemm.cli import main

raise SystemExit(main())
