"""See the plan before anything runs, and fit a memory budget.

    python examples/budget_plan.py                # tiny: runs in seconds
    python examples/budget_plan.py --scale 4      # 4x the batch

`memory_saving_gradients.plan()` predicts, without running anything, the
peak of plain `tf.gradients` and of the checkpointed backward pass, and what
it recomputes.  `memory_budget=` asks for the plan with the least
recomputation whose predicted peak fits the budget (a `ValueError` names the
smallest reachable peak when none does).  The script plans a CIFAR ResNet at
three budgets, then measures each plan's real peak in a session.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tensorflow as tf

import memory_saving_gradients as msg
import test_models
from memory_saving_gradients import profiling


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="batch multiplier")
    parser.add_argument("--depth", type=int, default=20, help="ResNet depth (6n+2)")
    args = parser.parse_args(argv)
    batch = 8 * args.scale
    rows = []
    with tf.Graph().as_default():
        model = test_models.build("resnet", depth=args.depth, batch=batch)
        first = msg.plan(model.loss, model.params, checkpoints="memory")
        print(first)
        baseline = first.baseline_peak_bytes
        for fraction in (0.3, 0.5, 0.8):
            budget = int(fraction * baseline)
            try:
                the_plan = msg.plan(model.loss, model.params, checkpoints="memory",
                                    memory_budget=budget)
            except ValueError as error:
                print(f"budget {budget / 2**20:.1f} MB: {error}")
                continue
            grads = msg.gradients(model.loss, model.params, checkpoints="memory",
                                  memory_budget=budget)
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                _, metadata = profiling.traced_run(session, grads, model.feed_dict)
            measured = sum(msg.peak_memory(metadata).values())
            rows.append((budget, the_plan.predicted_peak_bytes, measured,
                         the_plan.recompute_cost))
            print(f"budget {budget / 2**20:6.1f} MB: predicted {the_plan.predicted_peak_bytes / 2**20:6.1f}"
                  f" MB, measured {measured / 2**20:6.1f} MB, recomputes "
                  f"{the_plan.recompute_cost:.2f} of a forward pass")
    return {"baseline": baseline, "rows": rows}


if __name__ == "__main__":
    main()
