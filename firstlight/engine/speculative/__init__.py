"""Speculative decoding: proposers (ngram, draft, heads, mtp) and the lossless rejection sampler.

A proposer guesses k next tokens per request cheaply; the target model scores all of them in one
pass over the paged cache; `rejection_sample` keeps the longest prefix that the target agrees with
(Leviathan et al. 2023, Chen et al. 2023), so the output distribution is exactly the target's.
Proposers are registered by name (registry.py), one module each.
"""
