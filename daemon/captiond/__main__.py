"""`python -m captiond`: the `captiond` command (cli.main), run by the process's main thread."""

from captiond.cli import main

raise SystemExit(main())
