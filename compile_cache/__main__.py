"""`python -m compile_cache ls|du|verify|gc|evict|clear`."""

from compile_cache.cli import main

raise SystemExit(main())
