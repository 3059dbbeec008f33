"""ndweave.dmodule (in development: see README.md for what is coming)."""

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
