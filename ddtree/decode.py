"""Greedy decoding: plain autoregressive (AR), one target forward per token."""

from __future__ import annotations

import numpy as np


def check_prompt(model, prompt, max_new_tokens: int) -> np.ndarray:
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt must be a non-empty 1-D integer array, got shape {prompt.shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    limit = model.config.max_position_embeddings
    if prompt.size + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt.size}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({limit})")
    return prompt.astype(np.int64)


# --8<-- [start:generate_ar]
def generate_ar(model, prompt, max_new_tokens: int, return_logits: bool = False):
    """Greedy AR decoding: prefill the prompt, then one decode forward per new token.

    Returns the new tokens (int64); with ``return_logits`` also the logits that chose each.
    ``model.forward_count`` counts the target forwards (1 prefill + max_new_tokens - 1 decodes).
    """
    prompt = check_prompt(model, prompt, max_new_tokens)
    tokens, step_logits = [], []
    if max_new_tokens == 0:
        return (np.zeros(0, np.int64), np.zeros((0, model.config.vocab_size), np.float32)) \
            if return_logits else np.zeros(0, np.int64)
    cache = model.new_cache(prompt.size + max_new_tokens)
    logits = model.forward(cache, prompt)[-1]                   # [V] next-token logits
    while True:
        token = int(model.ops.argmax(logits[None])[0])
        tokens.append(token)
        step_logits.append(logits)
        if len(tokens) == max_new_tokens:
            break
        logits = model.forward(cache, np.array([token]))[0]     # [V]
    tokens = np.array(tokens, dtype=np.int64)
    return (tokens, np.stack(step_logits)) if return_logits else tokens
# --8<-- [end:generate_ar]
