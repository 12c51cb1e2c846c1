"""Rollouts: a policy (its model, tokenizer, optimizer phases and log-probs), the engines that
sample its completions (mutualrl's KV-cache loop, vLLM) and the token tensors both share."""
