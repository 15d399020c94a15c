"""``python -m qwenft COMMAND [overrides]``: see :mod:`qwenft.cli`."""

from qwenft.cli import main

if __name__ == "__main__":
    main()
