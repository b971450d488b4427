"""The model: attention backends, the network (models/), its config, weights and tokenizer loaders (safetensors, GGUF),
the runner that executes a scheduled batch."""
