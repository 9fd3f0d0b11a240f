"""neorec: high-performance, distributed training of deep learning recommendation models."""

__version__ = "0.1.0"
