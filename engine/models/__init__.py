"""Model definitions (the Llama family) and the loaders that fill them from GGUF or safetensors."""
