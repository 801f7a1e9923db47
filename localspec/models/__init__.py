"""Model files: named pairs, downloads, GGUF headers, tokenizer compatibility, the memory plan and placement."""
