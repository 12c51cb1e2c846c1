"""Example custom reward function (TRL signature) used by examples/user_data.yaml."""


def short_answer_bonus(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """A small bonus for completions of at most 6 characters (discourages rambling)."""
    return [0.1 if len(c.strip()) <= 6 else 0.0 for c in completions]
