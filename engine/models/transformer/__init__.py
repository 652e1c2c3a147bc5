"""The transformer baseline: the PSSA article's peer and the Llama-style peers of the NS presets."""
