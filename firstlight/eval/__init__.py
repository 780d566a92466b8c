"""Quality measures: perplexity and divergence from a reference model."""
