"""From a :class:`TrainBatch` to optimizer steps: the GRPO surrogate on own rows, off-policy
policy gradients on peer rows (``prp``, ``guide``) and likelihood on rescue rows (``sgt``).

The PPO reference of own rows is the trainer's own forward before the first optimizer step (as
TRL does), so the ratio is exactly 1 at the first iteration whatever the sampler did (``top_p``,
another engine, float rounding). The sampler's log-probs serve two purposes only: the logged
sampler/trainer mismatch and, when asked for, the truncated importance correction of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mutualrl.algorithms.grpo import grpo_loss, sequence_nll
from mutualrl.algorithms.sharing import TrainBatch, TrainRow
from mutualrl.policy import Policy, pack_right, right_mask

RL_KINDS = ("own", "peer", "guide")
"""Row kinds trained by the policy gradient (the others are likelihood rows)."""
OFF_POLICY_KINDS = ("peer", "guide")


def chunk_weights(rows: list[TrainRow], cur_logp: torch.Tensor, width: int, clip: float
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token truncated importance weights of PRP rows from THL chunk log-ratios (1 elsewhere)."""
    w = torch.ones_like(cur_logp)
    ratios: list[float] = []
    peer_idx = [i for i, row in enumerate(rows) if row.kind == "peer" and row.peer_chunks]
    # one device-to-host copy of the peer rows, then plain Python sums per chunk
    cur_rows = cur_logp[peer_idx].detach().double().tolist() if peer_idx else []
    for i, cur in zip(peer_idx, cur_rows, strict=True):
        row = rows[i]
        off = width - len(row.completion_ids)
        w_row = [1.0] * width
        for a, b, peer_sum in row.peer_chunks or ():
            lr = math.fsum(cur[off + a:off + b]) - peer_sum
            r = math.exp(min(lr, 50.0))
            ratios.append(r)
            w_row[off + a:off + b] = [min(r, clip)] * (b - a)
        w[i] = torch.tensor(w_row, dtype=w.dtype, device=w.device)
    stats: dict[str, float] = {}
    if ratios:
        t = torch.tensor(ratios, dtype=torch.float64)
        trunc = t.clamp(max=clip)
        stats = {"prp_ratio_mean": float(t.mean()), "prp_ratio_max": float(t.max()),
                 "prp_ratio_truncated_frac": float((t > clip).double().mean()),
                 "prp_ess_frac": float(trunc.sum() ** 2 / (trunc.pow(2).sum() * len(ratios)).clamp(min=1e-12))}
    return w, stats


def shaping_weights(cur_logp: torch.Tensor, gamma: float) -> torch.Tensor:
    """LUFFY's policy shaping as a per-token weight on ``grad log p``: the gradient of
    ``f(p) = p / (p + gamma)`` is ``gamma * p / (p + gamma)**2 * grad log p``; ``gamma = 0`` gives 1."""
    if gamma <= 0:
        return torch.ones_like(cur_logp)
    p = cur_logp.detach().exp()
    return gamma * p / (p + gamma) ** 2


def mismatch_stats(logp: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's behavior log-probs are from the trainer's recompute, on real tokens."""
    d = (logp - behavior).abs()[mask]
    if d.numel() == 0:
        return {}
    ratio = torch.exp((logp - behavior)[mask])
    return {"logprob_mismatch_max": float(d.max()), "logprob_mismatch_mean": float(d.mean()),
            "logprob_ratio_outside_frac": float(((ratio < 0.9) | (ratio > 1.1)).float().mean())}


@dataclass
class _RLTensors:
    """The policy-gradient rows of a batch as right-aligned tensors."""

    mask: torch.Tensor
    advantages: torch.Tensor
    row_weight: torch.Tensor
    offpolicy: torch.Tensor
    behavior: torch.Tensor
    """The sampler's log-probs of own rows (0 on off-policy rows)."""
    guide: torch.Tensor
    """``[B]`` rows that are ``guide`` rows."""

    @classmethod
    def build(cls, rows: list[TrainRow], width: int, device: torch.device) -> _RLTensors:
        mask = right_mask([len(r.completion_ids) for r in rows], width).to(device)

        def flags(kinds: tuple[str, ...]) -> torch.Tensor:
            return torch.tensor([r.kind in kinds for r in rows], device=device)

        return cls(mask, torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
                   torch.tensor([r.weight for r in rows], dtype=torch.float32, device=device),
                   flags(OFF_POLICY_KINDS),
                   pack_right([r.old_logprobs if r.old_logprobs is not None else [0.0] * len(r.completion_ids)
                               for r in rows], width).to(device),
                   flags(("guide",)))

    @property
    def own_mask(self) -> torch.Tensor:
        return self.mask & ~self.offpolicy.unsqueeze(1)


def _rescue_loss(rescue: list[TrainRow], lp: torch.Tensor, width: int, n_prompts: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """lambda-weighted, length-normalised NLL of the rescue rows, summed, over the step's prompts."""
    mask = right_mask([len(r.completion_ids) for r in rescue], width).to(device)
    nll = sequence_nll(lp, mask)
    lam = torch.tensor([r.weight for r in rescue], device=device)
    return (lam * nll).sum() / max(1, n_prompts), nll


def _policy_steps(policy: Policy, rl: list[TrainRow], rescue: list[TrainRow], n_prompts: int, *,
                  prp_ratio_clip: float, is_cap: float | None, shaping_gamma: float) -> dict[str, float]:
    """``num_iterations`` optimizer steps on the policy-gradient rows plus any rescue rows joined
    to them (one forward pass for both: they share prompts)."""
    opts, dev = policy.options, policy.device
    rows = rl + rescue
    width = max(max(len(r.completion_ids) for r in rows), 1)
    t = _RLTensors.build(rl, width, dev) if rl else None
    ref = None
    if t is not None and opts.beta > 0:
        ref = policy.logprobs([r.prompt_ids for r in rl], [r.completion_ids for r in rl], width, reference=True)
    old: torch.Tensor | None = None
    tok_w: torch.Tensor | None = None
    stats: dict[str, float] = {}
    for it in range(opts.num_iterations):
        policy.optimizer.zero_grad(set_to_none=True)
        lp_all = policy.logprobs([r.prompt_ids for r in rows], [r.completion_ids for r in rows], width)
        total = torch.zeros((), device=dev)
        if t is not None:
            logp = lp_all[:len(rl)]
            cur = logp.detach()
            if it == 0:  # before any step here: the trainer's own log-probs are the PPO reference
                old = cur
                stats.update(mismatch_stats(cur, t.behavior, t.own_mask))
                if is_cap is not None:  # the sampler's weight against the trainer's reference
                    own = t.own_mask
                    tok_w = torch.where(own, torch.exp(cur - t.behavior).clamp(max=is_cap), torch.ones_like(cur))
                    stats["is_weight_mean"] = float(tok_w[own].mean()) if bool(own.any()) else 1.0
            # off-policy weights from this pass's log-probs (the policy moved since the last pass)
            is_w, prp_stats = chunk_weights(rl, cur, width, prp_ratio_clip)
            if bool(t.guide.any()):
                is_w = torch.where(t.guide.unsqueeze(1), shaping_weights(cur, shaping_gamma), is_w)
            if it == 0:
                stats.update(prp_stats)
            assert old is not None
            out = grpo_loss(logp, old, t.advantages, t.mask, epsilon=opts.epsilon, epsilon_high=opts.epsilon_high,
                            beta=opts.beta, ref_logp=ref, loss_type=opts.loss_type,
                            max_completion_length=opts.max_completion_length, is_weight=is_w,
                            offpolicy=t.offpolicy, row_weight=t.row_weight, token_weight=tok_w)
            total = total + out.loss
            stats.update(out.stats)
            stats["pg_loss"] = float(out.loss.detach())
        if rescue:
            sgt, nll = _rescue_loss(rescue, lp_all[len(rl):], width, n_prompts, dev)
            total = total + sgt
            stats["sgt_nll"] = float(nll.detach().mean())
        if not total.requires_grad:
            break
        total.backward()
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), opts.max_grad_norm))
        policy.optimizer.step()
        stats["loss"] = float(total.detach())
    return stats


def _rescue_step(policy: Policy, rescue: list[TrainRow], lr: float, n_prompts: int) -> dict[str, float]:
    """One step of the rescue optimizer (AdamW at ``lr``) on the rescue rows alone."""
    opt = policy.enable_rescue_optimizer(lr)
    opt.zero_grad(set_to_none=True)
    width = max(len(r.completion_ids) for r in rescue)
    lp = policy.logprobs([r.prompt_ids for r in rescue], [r.completion_ids for r in rescue], width)
    sgt, nll = _rescue_loss(rescue, lp, width, n_prompts, policy.device)
    sgt.backward()
    torch.nn.utils.clip_grad_norm_(policy.model.parameters(), policy.options.max_grad_norm)
    opt.step()
    return {"sgt_nll": float(nll.detach().mean()), "sgt_loss": float(sgt.detach())}


def train_on_batch(policy: Policy, batch: TrainBatch, *, prp_ratio_clip: float = 1.0,
                   rescue_lr: float | None = None, is_cap: float | None = None,
                   shaping_gamma: float = 0.0) -> dict[str, float]:
    """Run ``num_iterations`` optimizer steps on ``batch``; return loss statistics.

    Rescue rows (SGT) join the policy-gradient steps' loss, or, with ``rescue_lr``, get an
    optimizer step of their own afterwards (``policy.rescue_optimizer``). With ``is_cap`` each own
    token's loss is weighted by the truncated importance weight ``min(exp(trainer - sampler),
    is_cap)`` of the sampler/trainer mismatch (as TRL and verl offer for vLLM). ``shaping_gamma``
    shapes ``guide`` rows (LUFFY).
    """
    rl = [r for r in batch.rows if r.kind in RL_KINDS]
    rescue = [r for r in batch.rows if r.kind == "rescue"]
    if not rl and not rescue:
        return {"loss": 0.0}
    n_prompts = batch.n_prompts or max(1, len(rl) // max(1, policy.options.num_generations))
    separate = rescue_lr is not None and bool(rescue)
    policy.model.train()
    stats: dict[str, float] = {}
    if rl or not separate:
        stats.update(_policy_steps(policy, rl, [] if separate else rescue, n_prompts, prp_ratio_clip=prp_ratio_clip,
                                   is_cap=is_cap, shaping_gamma=shaping_gamma))
    if separate:
        assert rescue_lr is not None
        stats.update(_rescue_step(policy, rescue, rescue_lr, n_prompts))
    return stats
