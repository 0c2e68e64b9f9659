"""``python -m graphforge``: the CLI, as torchrun starts it (``torchrun ... -m graphforge train CONFIG``)."""

from graphforge.cli import main

main()
