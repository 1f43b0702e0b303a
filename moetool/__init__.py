"""moetool: run Mixture-of-Experts language models on one memory-limited GPU."""

__version__ = "0.1.0"
