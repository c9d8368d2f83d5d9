"""hybridmoe: run big Mixture-of-Experts LLMs on machines whose GPUs can't hold them."""
__version__ = "0.1.0"


def load(path, **options):
    """Load a GGUF model (or `synth:PRESET`). Options: the CLI's long names with underscores."""
    from .model import load as _load
    return _load(path, **options)


__all__ = ["load", "__version__"]
