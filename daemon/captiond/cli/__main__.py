"""`python -m captiond.cli`: the `captiond` command, run by the process's main thread."""

from captiond.cli import main

raise SystemExit(main())
