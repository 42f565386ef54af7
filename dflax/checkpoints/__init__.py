"""Checkpoints: locating model files, reading GGUF and HF directories, tokenizers."""
