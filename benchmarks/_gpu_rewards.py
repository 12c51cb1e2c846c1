"""A dense reward for gpu_check's random models (their verifier would always say 0)."""


def even_tokens(prompts: list[str], completions: list[str], **columns: object) -> list[float]:
    """Share of completion tokens ``t<even>`` (the synthetic vocabulary's words)."""
    out = []
    for c in completions:
        words = [w for w in c.split() if w.startswith("t") and w[1:].isdigit()]
        out.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(1, len(words)))
    return out
