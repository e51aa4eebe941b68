"""Reading model files: the GGUF container, Q8_0 blocks and the typed model configuration."""
