"""The package's version, defined once: the facade re-exports it as ``nanreplay.__version__`` and
the bundle writer records it (``meta["versions"]["nanreplay"]``); keep it equal to
``pyproject.toml``'s."""

__all__ = ["__version__"]

__version__ = "0.1.0"
