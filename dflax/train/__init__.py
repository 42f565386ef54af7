"""Drafter training: data the target regenerates from ShareGPT prompts (make_data, dataset) and its use."""
