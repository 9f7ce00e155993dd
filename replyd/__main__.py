"""``python -m replyd`` is the ``replyd`` command."""

from replyd.cli import main

main()
