"""Speculative decoding: draft tokens proposed per request, verified by the target model in one forward pass.

``config.SpeculativeConfig`` is the setting; ``ngram.propose`` finds drafts in a request's own tokens;
``drafter.Drafter`` owns each request's back-off; ``verify.verify_drafts`` accepts or rejects a
step's drafts token by token (docs/speculative_decoding.md).
"""
