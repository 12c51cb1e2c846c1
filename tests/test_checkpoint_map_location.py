"""Checkpoints read onto the host: every ``torch.load`` in the package passes ``map_location="cpu"``
(a checkpoint written on ``cuda:1`` must load where that GPU is absent, hidden, or numbered
otherwise), and a policy's state written and read back through it is the same, each optimizer
state on its parameter's device."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import mutualrl
from mutualrl.config import GRPOOptions
from mutualrl.rollout.policy import Policy
from mutualrl.run import checkpoint


def _torch_load_calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "load" and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"]


def test_every_torch_load_in_the_package_maps_to_the_cpu():
    root = Path(mutualrl.__file__).parent
    seen = 0
    for path in sorted(root.rglob("*.py")):
        for call in _torch_load_calls(ast.parse(path.read_text(encoding="utf-8"))):
            seen += 1
            kw = {k.arg: k.value for k in call.keywords}
            where = f"{path.relative_to(root.parent)}:{call.lineno}"
            assert "map_location" in kw, f"torch.load without map_location at {where}"
            value = kw["map_location"]
            is_cpu = isinstance(value, ast.Constant) and value.value == "cpu"
            assert is_cpu, f"map_location is not 'cpu' at {where}"
    assert seen >= 4  # checkpoint.py's own: the check finds what it is meant to


def test_a_policy_state_round_trips_through_host_loads(tiny_models, tmp_path, monkeypatch):
    def policy() -> Policy:
        return Policy("p", str(tiny_models["tiny-gpt2"]), GRPOOptions(learning_rate=1e-2), seed=1)

    pol = policy()
    loss = pol.model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.square().mean()
    loss.backward()
    pol.optimizer.step()
    checkpoint.save_policy_state(tmp_path / "ck", pol, {"step": 1})

    calls = []
    real = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("map_location"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    other = policy()
    assert checkpoint.load_policy_state(tmp_path / "ck", other) == {"step": 1}
    assert calls and set(calls) == {"cpu"}
    want, got = pol.optimizer.state_dict(), other.optimizer.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for key, state in want["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(got["state"][key][name], value, rtol=0, atol=0)
    param_device = {p.device for p in other.model.parameters()}
    moments = {v.device for s in other.optimizer.state.values() for n, v in s.items() if n != "step"}
    assert moments == param_device
    for a, b in zip(pol.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
