"""specgen: speculative decoding for autoregressive image generators.

The Python API (`specgen.api`): `load_generator`, `load_drafter`, `load_strategy`, `generate`."""
__version__ = "0.1.0"
__all__ = ["load_generator", "load_drafter", "load_strategy", "generate", "Generation", "Strategy"]


def __getattr__(name: str):
    """The API on first use: `import specgen` alone stays light (no Hydra, no models)."""
    if name in __all__:
        from specgen import api

        return getattr(api, name)
    raise AttributeError(f"module 'specgen' has no attribute {name!r}")
