"""The stubs in ``stubs/`` against the megatron-core (and emerging-optimizers) of this lane.

``mypy.stubtest`` compares every stubbed module with the runtime and must find no
difference but those the allowlists name: ``stubs/stubtest-allowlist-common.txt`` and the
lane's own list, picked by the megatron-core release. stubtest also reports an allowlist
entry that matches nothing, so the lists cannot go stale.

stubtest does not check a dataclass's fields (a field the runtime lacks passes), nor a
constructor an allowlist names, so the stubbed dataclasses' fields and constructor
parameters are checked here as well: each must exist at runtime, with a default where
and as the runtime has one.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.helpers import megatron_release

STUBS = Path(__file__).resolve().parent.parent / "stubs"

LANES = {"0.16": "legacy", "0.19": "current"}
"""The allowlist for each megatron-core release the lanes pin (lanes/*.txt)."""

SINCE = {("megatron.core.optimizer.optimizer_config", "OptimizerConfig", "use_layer_wise_distributed_optimizer"): (0, 17)}
"""Fields the stubs declare as attributes only, not constructor arguments, because the
oldest release lacks them: the first release that has each."""


def lane() -> str:
    """The lane whose allowlist fits this megatron-core. Another release is not claimed:
    in the repository's own lanes (.venv-*) that fails, elsewhere (a wider matrix) it skips."""
    release = "{}.{}".format(*megatron_release())
    if release in LANES:
        return LANES[release]
    message = (
        f"the stubs are checked against megatron-core {' and '.join(LANES)}, not {release}: "
        "add stubs/stubtest-allowlist-<lane>.txt and its entry in LANES to check it"
    )
    prefix = Path(sys.prefix).resolve()
    if prefix.parent == STUBS.parent and prefix.name.startswith(".venv-"):
        pytest.fail(message)
    pytest.skip(message)


def test_stubtest_finds_no_difference_but_the_allowlisted(tmp_path: Path) -> None:
    packages = ["megatron"]
    if importlib.util.find_spec("emerging_optimizers") is not None:
        packages.append("emerging_optimizers")
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n")  # not the repository's: stubtest checks the stubs alone
    allowlists = [STUBS / "stubtest-allowlist-common.txt", STUBS / f"stubtest-allowlist-{lane()}.txt"]
    command = [sys.executable, "-m", "mypy.stubtest", "--concise", "--ignore-missing-stub", "--mypy-config-file", str(config)]
    for allowlist in allowlists:
        command += ["--allowlist", str(allowlist)]
    env = {**os.environ, "MYPYPATH": str(STUBS)}
    done = subprocess.run(command + packages, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    differences = done.stdout.strip()
    assert done.returncode == 0 and not differences, f"stubtest ({done.returncode}):\n{differences}\n{done.stderr[-2000:]}"


@dataclasses.dataclass(frozen=True)
class StubDataclass:
    module: str
    name: str
    fields: dict[str, ast.expr | None]
    """Declared fields, with the default each is given (None: none)."""
    init: dict[str, ast.expr | None] | None
    """An explicit ``__init__``'s parameters, with their defaults; None where there is none."""


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Name) and target.id == "dataclass":
            return True
    return False


def _parameters(function: ast.FunctionDef) -> dict[str, ast.expr | None]:
    args = function.args
    positional = args.posonlyargs + args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    found = {a.arg: d for a, d in zip(positional, defaults, strict=True)}
    found.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)})
    found.pop("self", None)
    return found


def stub_dataclasses() -> list[StubDataclass]:
    found = []
    for path in sorted((STUBS / "megatron").rglob("*.pyi")):
        parts = path.relative_to(STUBS).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.ClassDef) and _is_dataclass(node)):
                continue
            fields = {
                item.target.id: item.value
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
            inits = [item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"]
            found.append(StubDataclass(module, node.name, fields, _parameters(inits[0]) if inits else None))
    return found


def _stub_default(node: ast.expr | None) -> tuple[bool, object]:
    """(has a default, its value where the stub spells it out, else Ellipsis)."""
    if node is None:
        return False, None
    value = ast.literal_eval(node)
    return True, value


def _runtime_default(field: dataclasses.Field[object]) -> tuple[bool, object]:
    if field.default is not dataclasses.MISSING:
        return True, field.default
    if field.default_factory is not dataclasses.MISSING:
        return True, field.default_factory()
    return False, None


@pytest.mark.parametrize("stub", stub_dataclasses(), ids=lambda s: s.name)
def test_a_stubbed_dataclass_declares_runtime_fields_with_their_defaults(stub: StubDataclass) -> None:
    lane()
    runtime = getattr(importlib.import_module(stub.module), stub.name)
    assert dataclasses.is_dataclass(runtime)
    fields = {field.name: field for field in dataclasses.fields(runtime)}
    release = megatron_release()
    attribute_only = {
        name for (module, cls, name), since in SINCE.items() if (module, cls) == (stub.module, stub.name)
    }

    wrong = [
        f"{name}: declared in the stub, not a field of megatron-core {version('megatron-core')}"
        for name in stub.fields
        if name not in fields and not (name in attribute_only and release < SINCE[(stub.module, stub.name, name)])
    ]
    parameters = stub.fields if stub.init is None else stub.init
    if stub.init is not None and set(stub.init) != set(stub.fields) - attribute_only:
        wrong.append(f"the stub's __init__ and its fields disagree: {sorted(set(stub.init) ^ (set(stub.fields) - attribute_only))}")
    for name, node in parameters.items():
        field = fields.get(name)
        if field is None or not field.init:
            wrong.append(f"{name}: not a constructor argument at runtime")
            continue
        has_default, default = _stub_default(node)
        runtime_has_default, runtime_default = _runtime_default(field)
        if has_default != runtime_has_default:
            wrong.append(f"{name}: {'a' if has_default else 'no'} default in the stub, {'a' if runtime_has_default else 'none'} at runtime")
        elif has_default and default is not Ellipsis and default != runtime_default:
            wrong.append(f"{name}: default {default!r} in the stub, {runtime_default!r} at runtime")
    assert wrong == [], "\n".join(wrong)
