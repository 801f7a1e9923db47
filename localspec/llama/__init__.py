"""The one wall around llama.cpp: every call into llama-cpp-python goes through this package, one module per job.

`backend` (the process: log, Ctrl-C in callbacks, ggml's devices and RPC servers, the quantizer), `model` (a model
and its context: load, decode, rewind, vocabulary), `batch` (the batch a decode fills), `ubatch` (how a decode of
several sequences is cut into ubatches, around an upstream bug), `samplers` (device sampler chains and their rows),
`recurrent` (a hybrid model's recurrent state: snapshots, rollback, checkpoints), `hidden` (hidden states per
token), `mtp_head` (a model's MTP head in a context of its own), `grammar` (the GBNF sampler as a token mask, JSON
schemas to GBNF), `templates` (chat templates). Each module imports llama_cpp before numpy: on CUDA builds the other
order can segfault (docs/gpu.md).
"""
