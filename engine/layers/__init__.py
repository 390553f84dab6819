"""Building blocks of the model code: attention, rotary embeddings, norms, MLPs, sampling."""
