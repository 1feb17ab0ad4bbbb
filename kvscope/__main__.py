"""``python -m kvscope``: the ``kvscope`` command."""

from kvscope.cli.main import main

raise SystemExit(main())
