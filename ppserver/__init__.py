"""ppserver: a long-running data postprocessing service on ZeroMQ."""

# One version for both distributions, written once in client/ppclient/_version.py: ppserver requires
# the ppclient of its own version (pyproject.toml).
from ppclient._version import __version__

__all__ = ["__version__"]
