"""The ac-diff version, in one place (read by pyproject.toml, the trace header and `ac-diff --version`)."""

__version__ = "0.2.0"
