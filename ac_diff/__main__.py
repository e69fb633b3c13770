"""`python -m ac_diff ...` (also `torchrun ... -m ac_diff run train.py`)."""

from .cli import entry

entry()
