"""Pooling models: embedders (BERT, XLM-RoBERTa, decoder embedding models) and cross-encoder rerankers.

``model_config`` reads what a model's own files say (its task, pooling, normalization, prompt
prefixes, max length); ``tokens`` tokenizes inputs in batches, cut before the tokenizer sees a
whole long page; ``encoder`` runs BERT-family encoders and ``decoder`` Qwen2/Qwen3 embedding models
over packed variable-length batches with no KV cache; ``pooling_queue`` gathers requests into token-budget batches, one batch a step.
"""
