"""Choosing tokens: the sampler, speculative decoding (n-gram drafts, the adaptive rule), structured output and its
JSON bounds."""
