"""localspec: lossless speculative decoding on llama.cpp for one consumer GPU."""

__version__ = "0.1.0"
