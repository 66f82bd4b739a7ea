from nemo_dcr.cli.main import main

raise SystemExit(main())
