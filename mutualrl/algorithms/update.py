"""From a :class:`TrainBatch` to one optimizer step: GRPO surrogate + PRP off-policy + SGT NLL."""

from __future__ import annotations

import math

import torch

from mutualrl.algorithms.grpo import grpo_loss, sequence_nll
from mutualrl.algorithms.sharing import TrainBatch, TrainRow
from mutualrl.policy import Policy, pack_right, right_mask


def _chunk_weights(rows: list[TrainRow], cur_logp: torch.Tensor, width: int, clip: float
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token truncated importance weights of peer rows from THL chunk log-ratios."""
    w = torch.ones_like(cur_logp)
    ratios: list[float] = []
    peer_idx = [i for i, row in enumerate(rows) if row.kind == "peer" and row.peer_chunks]
    # one device-to-host copy of the peer rows, then plain Python sums per chunk
    cur_rows = cur_logp[peer_idx].detach().double().tolist() if peer_idx else []
    for i, cur in zip(peer_idx, cur_rows, strict=True):
        row = rows[i]
        off = width - len(row.completion_ids)
        w_row = [1.0] * width
        for a, b, peer_sum in row.peer_chunks:
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


def _rescue_loss(policy: Policy, rescue: list[TrainRow], lp: torch.Tensor, width: int,
                 n_prompts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lambda-weighted, length-normalised NLL of the rescue rows, summed, over the step's prompts."""
    mask = right_mask([len(r.completion_ids) for r in rescue], width).to(policy.device)
    nll = sequence_nll(lp, mask)
    lam = torch.tensor([r.weight for r in rescue], device=policy.device)
    return (lam * nll).sum() / max(1, n_prompts), nll


def _mismatch(logp: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's behavior log-probs are from the trainer's recompute, on real tokens."""
    d = (logp - behavior).abs()[mask]
    if d.numel() == 0:
        return {}
    ratio = torch.exp((logp - behavior)[mask])
    return {"logprob_mismatch_max": float(d.max()), "logprob_mismatch_mean": float(d.mean()),
            "logprob_ratio_outside_frac": float(((ratio < 0.9) | (ratio > 1.1)).float().mean())}


def train_on_batch(policy: Policy, batch: TrainBatch, *, prp_ratio_clip: float = 1.0,
                   rescue_lr: float | None = None, is_cap: float | None = None) -> dict[str, float]:
    """Run ``num_iterations`` optimizer steps on ``batch``; return loss statistics.

    Rescue rows (SGT) join the GRPO step's loss, or, with ``rescue_lr``, get an optimizer step of
    their own afterwards (``policy.rescue_optimizer`` at that learning rate). With ``is_cap`` the
    sampler/trainer mismatch is corrected: the clipped ratio is taken against the trainer's own
    recompute of the old log-probs, and each own token's loss is weighted by the truncated
    importance weight ``min(exp(trainer_old - behavior), is_cap)`` (as TRL and verl do for vLLM).
    """
    opts = policy.options
    rl_rows = [r for r in batch.rows if r.kind in ("own", "peer")]
    rescue = [r for r in batch.rows if r.kind == "rescue"]
    n_prompts = batch.n_prompts or max(1, len(rl_rows) // max(1, opts.num_generations))
    separate = rescue_lr is not None and bool(rescue)
    stats: dict[str, float] = {}
    if not rl_rows and not rescue:
        return {"loss": 0.0}
    model = policy.model
    model.train()
    width = max(max(len(r.completion_ids) for r in batch.rows), 1)
    if rl_rows:
        lens = [len(r.completion_ids) for r in rl_rows]
        mask = right_mask(lens, width).to(policy.device)
        adv = torch.tensor([r.advantage for r in rl_rows], dtype=torch.float32, device=policy.device)
        row_w = torch.tensor([r.weight for r in rl_rows], dtype=torch.float32, device=policy.device)
        offpolicy = torch.tensor([r.kind == "peer" for r in rl_rows], device=policy.device)
        old = pack_right([r.old_logprobs if r.old_logprobs is not None else [0.0] * len(r.completion_ids)
                          for r in rl_rows], width).to(policy.device)
        ref = None
        if opts.beta > 0:
            ref = policy.logprobs([r.prompt_ids for r in rl_rows], [r.completion_ids for r in rl_rows],
                                  width, reference=True)
        is_w = None
        has_peer = bool(offpolicy.any())
    # RL rows and (joined) rescue rows go through one forward pass (they share prompts: Policy.logprobs)
    all_rows = rl_rows + ([] if separate else rescue)
    for it in range(opts.num_iterations if all_rows else 0):
        policy.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=policy.device)
        lp_all = policy.logprobs([r.prompt_ids for r in all_rows], [r.completion_ids for r in all_rows], width)
        if rl_rows:
            logp = lp_all[:len(rl_rows)]
            if it == 0 and has_peer:
                # the weights are those before any step here, so iteration 0's own forward gives the
                # current log-probs of the peer rows: no separate no-grad pass
                is_w, s = _chunk_weights(rl_rows, logp.detach(), width, prp_ratio_clip)
                stats.update(s)
            if it == 0:
                own_mask = mask & ~offpolicy.unsqueeze(1)
                with torch.no_grad():
                    stats.update(_mismatch(logp.detach(), old, own_mask))
                if is_cap is not None:  # the trainer's old log-probs, and the sampler's weight against them
                    behavior = old
                    old = torch.where(own_mask, logp.detach(), old)
                    tok_w = torch.where(own_mask, torch.exp(old - behavior).clamp(max=is_cap),
                                        torch.ones_like(old))
                    stats["is_weight_mean"] = float(tok_w[own_mask].mean()) if bool(own_mask.any()) else 1.0
            out = grpo_loss(logp, old, adv, mask, epsilon=opts.epsilon, epsilon_high=opts.epsilon_high,
                            beta=opts.beta, ref_logp=ref, loss_type=opts.loss_type,
                            max_completion_length=opts.max_completion_length, is_weight=is_w,
                            offpolicy=offpolicy, row_weight=row_w,
                            token_weight=tok_w if is_cap is not None else None)
            total = total + out.loss
            stats.update({k: v for k, v in out.stats.items()})
            stats["pg_loss"] = float(out.loss.detach())
        if rescue and not separate:
            sgt, nll = _rescue_loss(policy, rescue, lp_all[len(rl_rows):], width, n_prompts)
            total = total + sgt
            stats["sgt_nll"] = float(nll.detach().mean())
        if not total.requires_grad:
            break
        total.backward()
        gn = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), opts.max_grad_norm)
        stats["grad_norm"] = float(gn)
        policy.optimizer.step()
        stats["loss"] = float(total.detach())
    if separate:
        opt = policy.enable_rescue_optimizer(rescue_lr)
        for group in opt.param_groups:
            group["lr"] = rescue_lr
        opt.zero_grad(set_to_none=True)
        rw = max(len(r.completion_ids) for r in rescue)
        lp = policy.logprobs([r.prompt_ids for r in rescue], [r.completion_ids for r in rescue], rw)
        sgt, nll = _rescue_loss(policy, rescue, lp, rw, n_prompts)
        sgt.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), opts.max_grad_norm)
        opt.step()
        stats["sgt_nll"] = float(nll.detach().mean())
        stats["sgt_loss"] = float(sgt.detach())
    return stats
