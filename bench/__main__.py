"""Entry point: `python -m bench` (or `task bench -- --quick`)."""

from bench.cli import main

raise SystemExit(main())
