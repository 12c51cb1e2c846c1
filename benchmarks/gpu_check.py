"""GPU check: two policies of real shapes train together on the devices the MWRA plan assigns.

    python benchmarks/gpu_check.py               # on a machine with a CUDA GPU (under 8 minutes)
    python benchmarks/gpu_check.py --trl         # and mutualrl against TRL's GRPOTrainer (minutes more)
    python benchmarks/gpu_check.py --dry-run     # the same plumbing on the CPU with tiny shapes (seconds)

Two randomly initialised causal LMs built from configs (no download): a Qwen2.5-0.5B-shaped and a
Llama-3.2-1B-shaped model (real widths, depths, head counts and vocabulary sizes; a synthetic
word-level tokenizer of the same vocabulary size, so generation and the LM head cost what they
cost), bf16 (``dtype: auto``), through the local scheduler (one process per policy, each given its
GPU with ``CUDA_VISIBLE_DEVICES`` and its planned share of the memory), ``--steps`` GRPO steps with
a dense reward. Per policy: sampled and trained tokens/s, peak CUDA memory, the sampler/trainer
log-prob mismatch. With ``--trl``, mutualrl against TRL's GRPOTrainer on each model with the same
settings (``benchmarks/vs_trl.py``'s two children, alternated), as a tokens/s ratio.

First, the real-size smoke (:mod:`_real_size_smoke`): on the Qwen2.5-0.5B shape, update variants
(base at 256 rows; gradient checkpointing, LoRA, LoRA with checkpointing, ``beta > 0`` and two PPO
iterations with ``imitate``'s own phase at 64 rows) of 128 + 512 tokens, each in its own process
under a time limit: finite loss, peak memory beside the plan's prediction, the sampler/trainer
mismatch, micro-batches; then a checkpoint written on the GPU is loaded where no GPU is visible.

With two GPUs or more it also checks a policy on 2 data-parallel ranks over nccl (``--ranks``, on by
default where it can run): the rank script of ``tests/test_data_parallel.py`` on ``cuda:0`` and
``cuda:1``, replicated (DDP-style all-reduce) and sharded (FSDP2), against one rank on the whole batch
(max parameter difference, the suite's 1e-5 bound on gloo). On one GPU it is skipped and says so: nccl
refuses two ranks on one device.

Writes ``benchmarks/results/gpu_check.json`` (``gpu_check_dry_run.json`` with ``--dry-run``).
Target: ratio >= 1.0 for each policy (``--trl``). This file is produced only by a run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
import _real_size_smoke
from _common import git_rev, machine, write_result

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's widths, depth, heads and vocabulary on a Llama config (no q/k/v bias): with model
    # type qwen2, transformers' AutoTokenizer would load the synthetic vocabulary as a Qwen2 BPE
    "qwen2_5-0_5b": {"arch": "llama", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "llama-3_2-1b": {"arch": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "tie_word_embeddings": True},
}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 512}


def synthetic_model(name: str, root: Path, tiny: bool) -> Path:
    """A random model of ``SHAPES[name]`` (``TINY`` sizes with ``tiny``) and a word-level tokenizer
    ``t0 .. t<V-1>`` of the same vocabulary size, saved as a Hugging Face directory."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    shape = dict(SHAPES[name])
    arch = shape.pop("arch")
    if tiny:
        shape.update(TINY)
    v = shape["vocab_size"]
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [f"t{i}" for i in range(v - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(specials)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>")
    cfg_cls, model_cls = ((tf.Qwen2Config, tf.Qwen2ForCausalLM) if arch == "qwen2"
                          else (tf.LlamaConfig, tf.LlamaForCausalLM))
    cfg = cfg_cls(**shape, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_cls(cfg)
    d = root / name
    model.save_pretrained(d)
    fast.save_pretrained(d)
    return d


def task_file(root: Path, n: int = 400) -> Path:
    """Prompts of random synthetic words (the reward is dense, so the answer column is unused)."""
    import random

    rng = random.Random(0)
    path = root / "prompts.jsonl"
    with open(path, "w") as fh:
        for i in range(n):
            q = " ".join(f"t{rng.randrange(4, 400)}" for _ in range(24))
            fh.write(json.dumps({"question": f"{q} q{i}", "answer": "t4"}) + "\n")
    return path


def run_config(dirs: dict[str, Path], data: Path, steps: int, dry: bool) -> dict[str, Any]:
    return {
        "policies": [{"name": n, "model": str(d), "prompt_template": "{question}"} for n, d in dirs.items()],
        "task": {"datasets": [{"path": str(data), "alias": "syn"}], "test_size": 8, "train_size": 300,
                 "answer_extraction": "raw", "reward_functions": ["_gpu_rewards:even_tokens"]},
        "grpo": {"num_generations": 8, "learning_rate": 1e-6, "max_completion_length": 16 if dry else 128,
                 "dynamic_sampling": "off", "dtype": "float32" if dry else "auto"},
        "steps": steps, "prompts_per_step": 2 if dry else 8, "eval_every": 10**6, "eval_size": 8,
        "checkpoint_every": 10**6, "scheduler": "local", "device": "cpu" if dry else "auto", "seed": 0,
    }


def ranks_check(root: Path, dry: bool) -> dict[str, Any]:
    """A tiny policy's update on 2 ranks (nccl on ``cuda:0``/``cuda:1``; gloo on the CPU with
    ``--dry-run``), replicated and with FSDP2, against one rank on the whole batch: the largest
    parameter difference and whether the two ranks hold the same weights."""
    import subprocess

    import torch

    from mutualrl.run.distributed import serve_store
    from mutualrl.zoo.models import build_tiny_models

    gpus = torch.cuda.device_count()
    if not dry and gpus < 2:
        return {"skipped": f"{gpus} GPU: nccl needs a device per rank (two ranks on one GPU are refused)"}
    script = HERE.parent / "tests" / "_dp_rank.py"
    model = build_tiny_models(root / "tiny")["tiny-gpt2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DP_LOSS="grpo", PYTHONPATH=str(HERE.parent),
               **({} if dry else {"DP_DEVICE": "cuda"}))
    out: dict[str, Any] = {"backend": "gloo" if dry else "nccl"}
    for layout, extra in (("replicated", {}), ("fsdp", {"DP_FSDP": "1"})):
        results = {}
        for world in (1, 2):
            store = serve_store("127.0.0.1", 60) if world > 1 else None
            rv = f"tcp://127.0.0.1:{store.port}/p" if store is not None else "-"
            procs = [subprocess.Popen([sys.executable, str(script), str(model), "imitate", str(r), str(world), rv,
                                       str(root / f"{layout}-{world}-{r}.pt")],
                                      env={**env, **(extra if world > 1 else {})}) for r in range(world)]
            codes = [p.wait(timeout=300) for p in procs]
            if codes != [0] * world:
                out[layout] = {"failed": f"exit codes {codes} on {world} rank(s)"}
                break
            results[world] = [torch.load(root / f"{layout}-{world}-{r}.pt") for r in range(world)]
        else:
            one = results[1][0]["params"]
            diff = max(float((r["params"] - one).abs().max()) for r in results[2])
            out[layout] = {"max_param_diff": diff, "ranks_equal": bool(torch.equal(results[2][0]["params"],
                                                                                    results[2][1]["params"])),
                           "within_1e-5": diff <= 1e-5}
        print(f"2 ranks ({out['backend']}, {layout}): {out[layout]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the plumbing only")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="TRL/mutualrl alternations")
    ap.add_argument("--no-ranks", dest="ranks", action="store_false",
                    help="skip the 2-rank (nccl) update check")
    ap.add_argument("--no-real-size", dest="real_size", action="store_false",
                    help="skip the real-size smoke (update variants at 64-256 rows of 128 + 512 tokens)")
    ap.add_argument("--trl", action="store_true", help="also compare with TRL's GRPOTrainer (off: minutes more)")
    args = ap.parse_args()

    import torch

    from mutualrl.config.resolve import load_config
    from mutualrl.run.trainer import MutualTrainer

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU (or --dry-run); nothing written")
    steps = args.steps or (2 if dry else 10)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])  # the workers' reward
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    dirs = {n: synthetic_model(n, root, dry) for n in SHAPES}
    real_size = _real_size_smoke.run(dirs["qwen2_5-0_5b"], root / "real_size", dry) if args.real_size else None
    cfg = load_config(run_config(dirs, task_file(root), steps, dry))
    trainer = MutualTrainer(cfg, root / "run", progress=False)
    trainer.train()
    infos = json.loads((root / "run" / "policies.json").read_text())
    plan = json.loads((root / "run" / "allocation.json").read_text())
    out: dict[str, Any] = {"policies": {}, "real_size": real_size}
    for info in infos:
        rows = [r for r in trainer.history if r.get("policy") == info["name"] and r.get("event") is None][1:] or \
            [r for r in trainer.history if r.get("policy") == info["name"] and r.get("event") is None]
        out["policies"][info["name"]] = {
            "params": info["params"], "device": info["device"], "dtype": info["dtype"],
            "gen_tokens_per_s": statistics.fmean(r["gen_tokens"] / r["generate_s"] for r in rows),
            "train_tokens_per_s": statistics.fmean(r["train_tokens"] / r["train_s"] for r in rows),
            "step_s": statistics.fmean(r["step_s"] for r in rows),
            "cuda_peak_mb": max((r.get("cuda_peak_mb", 0.0) for r in rows), default=0.0),
            "logprob_mismatch_max": max(r["logprob_mismatch_max"] for r in rows),
            "logprob_mismatch_mean": statistics.fmean(r["logprob_mismatch_mean"] for r in rows),
        }
    out["plan"] = plan["plans"][-1] if plan.get("plans") else plan
    if args.ranks:
        out["ranks"] = ranks_check(root, dry)
    if not dry and args.trl:
        import vs_trl

        for name, d in dirs.items():
            s = {"model": str(d), "dtype": "bfloat16", "threads": 4, "device": "cuda", "prompts_per_step": 8,
                 "num_generations": 8, "max_completion_length": 128, "temperature": 1.0, "learning_rate": 1e-6,
                 "beta": 0.0, "epsilon": 0.2, "num_iterations": 1, "loss_type": "dr_grpo", "scale_rewards": "group",
                 "max_grad_norm": 1.0, "steps": 5, "warmup": 1, "seed": 0}
            case = vs_trl.run_case(name, s, args.repeats)
            out["policies"][name]["vs_trl"] = {k: case.get(k) for k in ("ratio", "ratio_generated", "ratio_trained",
                                                                        "mutualrl_tokens_per_s", "trl_tokens_per_s",
                                                                        "mutualrl_peak_mb", "trl_peak_mb")}
            out["policies"][name]["ratio"] = case.get("ratio")
    for name, p in out["policies"].items():
        print(f"{name:14s} {p['device']:8s} {p['dtype']:9s} gen {p['gen_tokens_per_s']:.0f} tok/s  train "
              f"{p['train_tokens_per_s']:.0f} tok/s  peak {p['cuda_peak_mb']:.0f} MB  mismatch max "
              f"{p['logprob_mismatch_max']:.2e}" + (f"  vs TRL {p['ratio']:.2f}x" if p.get("ratio") else ""))
    info = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    write_result("gpu_check" + ("_dry_run" if dry else ""), {
        **out, "steps": steps, "shapes": SHAPES, "dry_run": dry, "device_info": info,
        "targets": {"ratio_each_policy": 1.0}, "machine": machine(), "quick": dry,
        "wall_s": time.perf_counter() - t0, "git_rev": git_rev(),
    })


if __name__ == "__main__":
    main()
