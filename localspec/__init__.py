"""localspec: lossless speculative decoding on llama.cpp for one consumer GPU."""

# llama_cpp before anything imports numpy: on a CUDA build the other order has crashed model loading (seen on the
# H200 image; shared/GPU.md). Every module of the package comes through here first, so the order always holds.
import llama_cpp  # noqa: F401

__version__ = "0.1.0"
