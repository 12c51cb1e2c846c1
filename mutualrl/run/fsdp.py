"""FSDP2 for a policy trained by several ranks (``policies[i].fsdp: true``): its trainable weights,
their gradients and the optimizer states sharded over the ranks (``torch.distributed.fsdp.fully_shard``).

What is sharded and how the step stays the one a single worker takes:

- **Units**: each decoder block is one FSDP unit; the root unit is a thin module (:class:`LogprobRoot`)
  that owns the rest (embeddings, final norm, LM head, tied or not) and through which every training
  forward of the policy goes, so the embeddings and the head stay gathered from the forward to the
  end of its backward (the LM head runs in chunks: no collective per chunk).
- **Gradients** are reduce-scattered with a divide factor of 1 (a sum): each rank's loss is its rows'
  share of the whole step's loss (the counts are summed over the ranks, as for plain data
  parallelism), so the summed gradient is the one a single worker computes on the whole batch.
  Clipping sees the global norm (DTensor gradients).
- **Lockstep**: FSDP's collectives run inside forward and backward, so every rank makes the same
  forward and backward calls in the same order: the update gives a rank without rows of a phase a
  one-token dummy row with a zero loss, computes the reference for the whole phase in one forward,
  and always runs the backward (``mutualrl.algorithms.update``).
- **Sampling** does not go through the sharded model: the sampler (HF loop or vLLM) keeps a full,
  plain copy of the weights (:attr:`ShardedWeights.full`), refreshed after each optimizer step by
  gathering the trainable shards into it (``DTensor.full_tensor``, one all-gather per trainable
  tensor, the same order on every rank). This is what verl's rollout engine does; it lets each rank
  sample its own prompts for as long as they take, with no collective inside generation. The price
  is one full copy of the weights per rank beside the shards of weights, gradients and both AdamW
  moments: about ``1 + 4 / N`` copies of the weights per rank instead of ``4`` (fp32, full
  fine-tuning); under LoRA the full copy, ``1 / N`` of the base weights and the adapter's shards.
  Before sharding a rank briefly holds the model, its copy (and a KL reference): 8-12 bytes a
  parameter at start-up, which the planner does not count yet.
- **Checkpoints** are gathered state dicts, in the format one worker writes (``model.safetensors`` of
  the full weights, ``optimizer.pt`` keyed like ``torch.optim.Optimizer.state_dict``): rank 0 writes
  the full copy and the gathered optimizer states; on resume every rank reads them and keeps its
  shard (``distribute_tensor`` with no source rank: each rank slices locally). The checkpoint is
  then exported, evaluated and resumed like any other (``torch.distributed.checkpoint`` would spare
  rank 0 the full copy, but writes a pickled metadata file and a layout the rest of mutualrl does
  not read).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

try:  # public from torch 2.6; the package accepts older torch, which runs everything but fsdp: true
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - torch < 2.6
    FSDPModule = fully_shard = DTensor = distribute_tensor = None  # type: ignore[assignment,misc]


class LogprobRoot(torch.nn.Module):
    """The root FSDP unit: holds the model (``lm``) and runs ``fn(lm, *args)`` as its forward, so that
    the parameters outside the decoder blocks are gathered for the whole of a training forward."""

    def __init__(self, lm: torch.nn.Module, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.lm = lm
        self._fn = fn

    def forward(self, *args: Any) -> torch.Tensor:
        out = self._fn(self.lm, *args)
        return out.clone() if out._is_view() else out  # FSDP's backward hook must not sit on a view


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the largest ``ModuleList`` whose entries share one class
    (``model.layers`` of Llama-family models, ``transformer.h`` of GPT-2), through a peft wrapper."""
    best: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best) and len({type(b) for b in m}) == 1:
            best = list(m)
    if not best:
        raise ValueError(f"fsdp: found no repeated decoder blocks in {type(model).__name__} to shard")
    return best


def shard_module(model: torch.nn.Module, fn: Callable[..., torch.Tensor]) -> LogprobRoot:
    """Shard ``model`` in place (each decoder block a unit) under a :class:`LogprobRoot` running ``fn``;
    gradients are summed over the ranks, not averaged."""
    if fully_shard is None:
        raise RuntimeError(f"fsdp: true needs torch >= 2.6 (FSDP2's fully_shard); this is torch {torch.__version__}")
    for block in decoder_blocks(model):
        fully_shard(block)
    root = LogprobRoot(model, fn)
    fully_shard(root)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # a plain SUM (gloo has no pre-multiplied sum)
                m.set_force_sum_reduction_for_comms(True)
    return root


def full_value(t: Any) -> Any:
    """A DTensor's full value (a collective: every rank calls it), anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") and hasattr(t, "device_mesh") else t


class ShardedWeights:
    """A policy's FSDP state: the sharded model's root, the reference's, and the sampler's full copy.

    Args:
        model: the policy's model (sharded in place; its parameters become DTensors).
        fn: the training forward, ``fn(model, prompt_ids, completion_ids, width)``.
        reference: the frozen reference model (full fine-tuning with ``beta > 0``), sharded likewise.
    """

    def __init__(self, model: torch.nn.Module, fn: Callable[..., torch.Tensor],
                 reference: torch.nn.Module | None = None) -> None:
        self.full = copy.deepcopy(model).eval()
        """The sampler's plain copy of the weights (gathered after every optimizer step)."""
        for p in self.full.parameters():
            p.requires_grad_(False)
        self.root = shard_module(model, fn)
        self.model = model
        self.reference_root = shard_module(reference, fn) if reference is not None else None
        full_params = dict(self.full.named_parameters())
        self._pairs = [(p, full_params[n]) for n, p in model.named_parameters() if p.requires_grad]
        """(sharded trainable parameter, its full copy), in the same order on every rank."""

    def root_for(self, module: torch.nn.Module) -> LogprobRoot:
        """The root unit a forward of ``module`` (the model or its reference) goes through."""
        if module is self.model:
            return self.root
        if self.reference_root is not None and module is self.reference_root.lm:
            return self.reference_root
        raise ValueError("fsdp: a forward of a module that is not sharded")

    @torch.no_grad()
    def gather(self) -> None:
        """Copy the current trainable weights into :attr:`full` (every rank, same order)."""
        for sharded, full in self._pairs:
            full.copy_(full_value(sharded.detach()))

    @torch.no_grad()
    def scatter(self) -> None:
        """Take each rank's shard of the trainable weights from :attr:`full` (after a checkpoint was
        loaded into it); no communication. Writes through ``to_local()``: right only while the units are
        resharded (between steps, where checkpoints load)."""
        for sharded, full in self._pairs:
            local = distribute_tensor(full.detach().to(sharded.device), sharded.device_mesh, sharded.placements,
                                      src_data_rank=None)
            sharded.to_local().copy_(local.to_local())

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer, keep: bool = True) -> dict[str, Any] | None:
        """``optimizer.state_dict()`` with every sharded state gathered, on the CPU (every rank calls it:
        the gathers are collectives; only a rank with ``keep`` holds the result, the others get None)."""
        sd = optimizer.state_dict()
        state = {}
        for i, s in sorted(sd["state"].items()):
            full = {k: full_value(v) for k, v in s.items()}
            if keep:  # one tensor at a time off the device
                state[i] = {k: v.cpu() if torch.is_tensor(v) else v for k, v in full.items()}
        return {"state": state, "param_groups": sd["param_groups"]} if keep else None

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """A gathered optimizer state (:meth:`full_optimizer_state`, read back) cut to this rank's shards."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = {}
        for i, s in sd["state"].items():
            p = params[int(i)]
            state[i] = {k: (distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
                            if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape else v)
                        for k, v in s.items()}
        return {"state": state, "param_groups": sd["param_groups"]}
