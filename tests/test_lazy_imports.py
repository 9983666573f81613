"""``import opttree`` and a reset of an AdamW tree import none of the optional stacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

OPTIONAL = ("emerging_optimizers", "transformer_engine", "apex", "megatron.core.optimizer")

SCRIPT = """
import json, sys, torch
import opttree
net = torch.nn.Linear(3, 2)
optimizer = torch.optim.AdamW(net.parameters())
net(torch.ones(1, 3)).sum().backward()
optimizer.step()
opttree.tree(optimizer)
opttree.validate(optimizer)
opttree.describe(optimizer)
report = opttree.reset(optimizer)
print(json.dumps({"modules": sorted(sys.modules), "zeroed": report.tensors_zeroed}))
"""


def test_opttree_imports_no_optional_optimizer_stack() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(done.stdout.strip().splitlines()[-1])

    loaded = [m for m in result["modules"] if m.startswith(OPTIONAL)]
    assert loaded == []
    assert result["zeroed"] == 4


def test_muon_schema_resolves_once_megatron_defines_it() -> None:
    script = """
import importlib.metadata, importlib.util, json, sys, torch
import opttree
if importlib.util.find_spec("emerging_optimizers") is None:
    print(json.dumps(None)); sys.exit()
try:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon, TensorParallelAdaptiveMuon
except ImportError:
    try:
        from megatron.core.optimizer.muon import TensorParallelMuon
    except ImportError:  # megatron-core 0.15 and older
        print(json.dumps("this megatron-core has no TensorParallelMuon")); sys.exit()
    TensorParallelAdaptiveMuon = None
kinds = []
for cls in (TensorParallelMuon, TensorParallelAdaptiveMuon):
    if cls is None:
        continue
    try:
        optimizer = cls([torch.nn.Parameter(torch.ones(4, 4))], lr=0.1)
    except TypeError as e:  # megatron-core 0.16's against emerging-optimizers 0.3
        version = importlib.metadata.version("emerging-optimizers")
        print(json.dumps(f"this megatron-core's {cls.__name__} cannot be built over emerging-optimizers {version}: {e}"))
        sys.exit()
    optimizer.step()
    schema = opttree._registry.schema_for(cls)
    kinds.append(sorted(schema.zero))
print(json.dumps(kinds))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    kinds = json.loads(done.stdout.strip().splitlines()[-1])
    if kinds is None:
        assert "emerging_optimizers" not in sys.modules
        return
    if isinstance(kinds, str):
        pytest.skip(kinds)
    assert kinds[0] == ["momentum_buffer"]
    if len(kinds) > 1:
        assert kinds[1] == ["moment2_buffer", "momentum_buffer"]


BLOCK_MEGATRON = """
import importlib.abc, sys
class NoMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, NoMegatron())
"""


def test_opttree_works_where_megatron_core_is_not_installed() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCK_MEGATRON + SCRIPT], capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["zeroed"] == 4 and not [m for m in result["modules"] if m.startswith("megatron")]


def test_the_core_distribution_requires_torch_and_attrs_only() -> None:
    from importlib.metadata import requires

    core = sorted(r.split(">")[0].split("=")[0].split("<")[0].strip() for r in requires("opttree") or [] if "extra ==" not in r)
    assert core == ["attrs", "torch"]
    assert any(r.startswith("megatron-core") and "extra ==" in r and "megatron" in r.split("extra ==")[1] for r in requires("opttree") or [])


def test_the_opttree_logger_prints_nothing_unless_configured() -> None:
    # state for a tensor in no param group: the reset logs a warning
    script = """
import opttree, torch
o = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
o.state[torch.zeros(1)] = {"exp_avg": torch.zeros(1), "exp_avg_sq": torch.zeros(1), "step": torch.tensor(1.0)}
assert any(p.kind is opttree.ProblemKind.ORPHAN_STATE for p in opttree.validate(o))
opttree.reset(o)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert done.stderr == "" and done.stdout == ""
    import logging

    import opttree

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("opttree").handlers)
    assert opttree.__version__
