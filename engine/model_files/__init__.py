"""Model files as they come: GGUF files read in place, Hugging Face directories in their dtype, and
random-weight models of real shapes for benchmarks and tests."""
