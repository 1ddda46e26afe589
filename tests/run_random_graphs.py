"""Run the random-graph equivalence property on thousands of examples, on demand.

    .venv/bin/python tests/run_random_graphs.py --examples 3000 [--seed 0] [--max-nodes 16] [--shrink]

Each example is a random program from ``test_random_graphs.programs`` (a DAG
of differentiable ops, random xs / ys / grad_ys / checkpoints, sometimes
stop_gradients or unconnected_gradients='zero'), differentiated by
``tf.compat.v1.gradients``, by ``gradients()`` with two checkpoint lists
and by ``gradients()`` with every automatic strategy; all must agree
(None pattern, dense/sparse, dtype, values) and none may fall back to
``tf.gradients`` (the guard's ``FallbackWarning``).  Prints
``N examples ran clean`` at the end, or the first failing example (shrunk
with ``--shrink``; exit 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_random_graphs as rg
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-nodes", type=int, default=16)
    parser.add_argument("--function-every", type=int, default=10,
                        help="also check every k-th example inside a tf.function (0: never)")
    parser.add_argument("--shrink", action="store_true",
                        help="let hypothesis shrink a failing example (slow on big graphs); "
                             "the first failing example is printed either way")
    args = parser.parse_args(argv)
    logging.getLogger("memory_saving_gradients").setLevel(logging.ERROR)
    strategies = rg.msg.available_strategies()
    clean = {"examples": 0, "variants": 0, "in_function": 0}
    start = time.time()

    phases = list(Phase) if args.shrink else [Phase.generate]

    @hypothesis_seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=phases)
    @given(rg.programs(max_nodes=args.max_nodes))
    def prop(program):
        try:
            clean["variants"] += rg.check_program(program, strategies)
            if args.function_every and clean["examples"] % args.function_every == 0:
                clean["variants"] += rg.check_program_in_function(program, strategies)
                clean["in_function"] += 1
        except Exception as error:
            if not clean.get("printed"):
                clean["printed"] = True
                print(f"first failing example: {program!r}\n  {type(error).__name__}: "
                      f"{str(error)[:2000]}", flush=True)
            raise
        clean["examples"] += 1
        if clean["examples"] % 250 == 0:
            print(f"  {clean['examples']} examples clean ({time.time() - start:.0f} s)", flush=True)

    print(f"random graphs: up to {args.examples} examples, seed {args.seed}, "
          f"max {args.max_nodes} nodes, strategies {strategies}", flush=True)
    try:
        prop()
    except Exception as error:
        print(f"FAILED after {clean['examples']} clean examples: {type(error).__name__}: {error}")
        for note in getattr(error, "__notes__", []):  # hypothesis: the shrunk example
            print(note)
        return 1
    print(f"{clean['examples']} examples ran clean ({clean['in_function']} of them also in a "
          f"tf.function; {clean['variants']} gradients() calls compared with tf.gradients) "
          f"in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
