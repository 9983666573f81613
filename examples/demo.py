"""Train a real Megatron optimizer stack, describe it, validate it, reset it, and show that
training after the reset is bitwise identical to training with a freshly built optimizer.

Run through ``bash scripts/demo`` (or ``python examples/demo.py --config NAME``).
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch

import opttree
from opttree import testing


def main() -> int:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="offload_0.75", choices=testing.available())
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    name: str = args.config
    k: int = args.steps

    print(f"== {name}: {testing.RECIPES[name].description}")
    stack = testing.build(name)
    losses = [stack.step(i) for i in range(k)]
    print(f"trained {k} steps with Megatron's own optimizer.step(); losses {[round(x, 4) for x in losses]}")
    print(opttree.describe(stack.optimizer))

    problems = opttree.validate(stack.optimizer)
    print(f"validate: {len(problems)} problems" + "".join(f"\n  {p}" for p in problems))

    masters = [p.clone() for p in stack.main_params()]
    report = opttree.reset(stack.optimizer)
    print(report)
    untouched = all(torch.equal(a, b) for a, b in zip(masters, stack.main_params(), strict=True))
    print(f"main (master) weights untouched by the reset: {untouched}")

    fresh = testing.build(name)
    fresh.copy_weights_from(stack)
    after = [stack.step(i) for i in range(k, 2 * k)]
    reference = [fresh.step(i) for i in range(k, 2 * k)]
    same = all(torch.equal(a, b) for a, b in zip(stack.main_params(), fresh.main_params(), strict=True))
    print(f"losses after reset   {after}")
    print(f"losses, fresh optim. {reference}")
    print(f"weights after {k} more steps bitwise equal to the fresh optimizer's: {same}")
    return 0 if untouched and same and after == reference else 1


if __name__ == "__main__":
    raise SystemExit(main())
