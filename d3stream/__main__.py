"""``python -m d3stream``: the same commands as the ``d3stream`` console script."""

from d3stream.cli import main

raise SystemExit(main())
