"""One rank of tests/test_data_parallel.py's update: ``python tests/_dp_rank.py MODEL STRATEGY RANK WORLD
RENDEZVOUS OUT`` trains a tiny policy on its share (prompts ``rank::world``) of one fixed batch and
writes its trainable weights to OUT (``torch.save`` of one flat tensor). ``WORLD`` 1 is the
single-worker reference; RENDEZVOUS ``-`` when there is none. ``DP_FSDP=1`` shards the policy over the
ranks (FSDP2); ``DP_LORA=1`` trains a LoRA adapter, ``DP_CHECKPOINTING=1`` with gradient checkpointing,
``DP_BETA`` sets the KL weight, ``DP_IDLE_RANK1=1`` leaves rank 1's prompts without rows (it joins
every phase, the KL reference included, with dummy rows); ``DP_RESUME=1`` saves the policy's state after the first update, loads
it into a fresh policy and takes the second update there (a checkpoint must resume the optimizer).
``DP_MICRO=N`` gives the ranks (not the single-worker reference, which
runs each phase in one forward) micro-batches of at most N forward tokens. ``DP_DEVICE=cuda`` puts rank r on ``cuda:r`` (the process group is then nccl: what
``benchmarks/gpu_check.py --ranks`` runs on a machine with two GPUs or more).

``python tests/_dp_rank.py --cases MODEL RANK WORLD STORE OUTDIR CASES`` runs several such updates in
one process, one after the other (what the tests do: the process start and imports are paid once):
``CASES`` is a JSON list of ``{"name", "strategy", "env"}``, each case's ``env`` (the ``DP_*`` variables
above) replacing the previous case's, its ranks meeting under the prefix ``name`` of the TCPStore at
``STORE`` (``HOST:PORT``, or ``-`` for the reference) and its result written to
``OUTDIR/NAME/WORLD-RANK.pt``. A failing case writes ``WORLD-RANK.err`` (its traceback) there and stops
the process: its peer rank may be left in a collective, so the cases after it are not run."""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from mutualrl.algorithms.registry import OWN
from mutualrl.algorithms.sharing import TrainBatch, TrainRow, parse_strategy
from mutualrl.algorithms.update import train_on_batch
from mutualrl.config import GRPOOptions, PeftConfig
from mutualrl.rollout.policy import Policy
from mutualrl.run.checkpoint import load_policy_state, save_policy_state
from mutualrl.run.distributed import RankGroup
from mutualrl.run.fsdp import full_value

PROMPTS, G = 5, 4
"""Five prompts: rank 0 takes three, rank 1 two (uneven shares)."""


def fixed_batch(strategy: str, vocab: int, settings: dict) -> tuple[list[list[TrainRow]], dict]:
    """Rows per prompt, the same on every rank (a generator of its own): G own rows each of random
    lengths, and for ``imitate`` a supervised row on every second prompt."""
    gen = torch.Generator().manual_seed(1234)
    kinds = parse_strategy(strategy).kinds(settings)
    extra = next((k for k in kinds if k != OWN), None)
    per_prompt = []
    for p in range(PROMPTS):
        prompt = torch.randint(3, vocab, (5 + p % 3,), generator=gen).tolist()
        rows = []
        idle = os.environ.get("DP_IDLE_RANK1") == "1" and p % 2 == 1  # rank 1's prompts: no row at all
        for j in range(0 if idle else G):
            n = 2 + int(torch.randint(0, 5, (1,), generator=gen))
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            adv = float(torch.randn((), generator=gen))
            rows.append(TrainRow(prompt, ids, adv, [-2.0] * n, OWN))
        if extra is not None and p % 2 == 0:  # rank 0's prompts only: rank 1 has no row of imitate's phase
            rows.append(TrainRow(prompt, torch.randint(3, vocab, (4 + p % 3,), generator=gen).tolist(), 0.0, None,
                                 extra, None, 1.0))
        per_prompt.append(rows)
    return per_prompt, kinds


def run(model: str, strategy: str, rank: int, world: int, rendezvous: str, out: str) -> None:
    """One update of ``strategy`` on this rank (settings from the ``DP_*`` variables), saved to ``out``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    opts = GRPOOptions(num_generations=G, max_completion_length=8, num_iterations=2, learning_rate=1e-3,
                       loss_type=os.environ.get("DP_LOSS", "dr_grpo"), beta=float(os.environ.get("DP_BETA", "0")),
                       gradient_checkpointing=os.environ.get("DP_CHECKPOINTING") == "1", dtype="float32",
                       micro_batch_tokens=int(os.environ["DP_MICRO"]) if os.environ.get("DP_MICRO") and world > 1
                       else None)
    peft = PeftConfig(r=4, target_modules=["c_attn"]) if os.environ.get("DP_LORA") == "1" else None
    settings = {"imitate": {"learning_rate": 3e-4, "weight": 1.0}} if strategy == "imitate" else {}
    device = f"cuda:{rank}" if os.environ.get("DP_DEVICE") == "cuda" else "cpu"
    ranks = RankGroup(rank, world, None if rendezvous == "-" else rendezvous, device, timeout_s=60)

    def fresh() -> Policy:
        torch.manual_seed(0)
        pol = Policy("p", model, opts, seed=0, peft=peft, device=device)
        ranks.broadcast_parameters(pol.model)
        if os.environ.get("DP_FSDP") == "1" and ranks.active:
            pol.shard()
            assert all(hasattr(p, "device_mesh") for p in pol.model.parameters()), "not sharded"
        for phase, lr in parse_strategy(strategy).optimizer_phases(settings).items():
            pol.add_optimizer(phase, lr)
        return pol

    pol = fresh()
    per_prompt, kinds = fixed_batch(strategy, min(len(pol.tokenizer), pol.model.config.vocab_size), settings)
    mine = ranks.shard(per_prompt)
    for update in range(2):  # two updates: the optimizers' moments carry over alike
        if update == 1 and os.environ.get("DP_RESUME") == "1":
            ck = os.path.dirname(out) + f"/ck-{world}"
            save_policy_state(ck, pol, {}, rank=rank, world=world)
            pol = fresh()
            load_policy_state(ck, pol, rank=rank, world=world)
        batch = TrainBatch([r for rows in mine for r in rows], n_prompts=len(mine), kinds=kinds)
        stats = train_on_batch(pol, batch, ranks=ranks)
        pol.sync_engine()
    flat = torch.cat([full_value(p.detach()).reshape(-1).cpu() for p in pol.model.parameters() if p.requires_grad])
    sampler = torch.cat([p.detach().reshape(-1).cpu() for n, p in pol.sampler_model.named_parameters()
                         if dict(pol.model.named_parameters())[n].requires_grad])
    assert torch.equal(flat, sampler), "the sampler's copy lags the trained weights"
    keep = {k: v for k, v in stats.items() if k.endswith(("loss", "grad_norm", "optimizer_steps", "micro_batches"))}
    torch.save({"params": flat, "stats": keep}, out)
    ranks.close()


DP_VARS = ("DP_LOSS", "DP_FSDP", "DP_LORA", "DP_CHECKPOINTING", "DP_BETA", "DP_IDLE_RANK1", "DP_RESUME", "DP_MICRO")


def run_cases(model: str, rank: int, world: int, store: str, outdir: str, cases: list[dict]) -> int:
    """Every case in turn (see the module's docstring); 0, or 1 at the first case that fails."""
    for case in cases:
        for k in DP_VARS:
            os.environ.pop(k, None)
        os.environ.update(case.get("env", {}))
        folder = os.path.join(outdir, case["name"])
        os.makedirs(folder, exist_ok=True)
        rendezvous = "-" if store == "-" else f"tcp://{store}/{case['name']}"
        try:
            run(model, case["strategy"], rank, world, rendezvous, os.path.join(folder, f"{world}-{rank}.pt"))
        except Exception:  # noqa: BLE001 - shown by the test that reads this case's result
            with open(os.path.join(folder, f"{world}-{rank}.err"), "w") as f:
                f.write(traceback.format_exc())
            return 1
    return 0


def main() -> None:
    if sys.argv[1] == "--cases":
        model, rank, world, store, outdir, cases = sys.argv[2:8]
        sys.exit(run_cases(model, int(rank), int(world), store, outdir, json.loads(cases)))
    model, strategy, rank, world, rendezvous, out = sys.argv[1:7]
    run(model, strategy, int(rank), int(world), rendezvous, out)


if __name__ == "__main__":
    main()
