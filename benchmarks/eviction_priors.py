"""Eviction alone (no forecast, no prefetch): how far each learned reuse prior gets toward Belady.

    python benchmarks/eviction_priors.py --trace TEST --train TRAIN [--model-profile P] [--max-tokens 4000]

Replays the first --max-tokens tokens of TEST with demand copies only and prints copies / Belady's
copies per residency for LRU and for probabilistic Belady over its prior beyond the forecast (here
the whole value, there being no forecast) with: the frequency class and the last gap (the prior
before issue 12), and with the recent-use count added (seqmoe's now). docs/LOG.md has the numbers.
"""

from __future__ import annotations

import argparse
import sys

from seqmoe.brain.policies import belady_misses
from seqmoe.brain.policies.forecast import ForecastPolicy
from seqmoe.brain.policies.lru import LRUPolicy
from seqmoe.brain.policies.reuse import NUM_COUNT_CLASSES
from seqmoe.config import DEFAULT_RESIDENCIES
from seqmoe.brain.manager import System, capacity_for, start_placement
from seqmoe.costs.profiles import get_hardware_profile, get_model_profile
from seqmoe.sim import simulate
from seqmoe.trace.io import load_trace

PRIORS = {"frequency + last gap": 1, "frequency + last gap + recent count": NUM_COUNT_CLASSES}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="the replayed (held-out) trace")
    p.add_argument("--train", required=True, help="the training trace the priors are fitted on")
    p.add_argument("--model-profile", default="deepseek-v2-lite")
    p.add_argument("--hardware", default="h100-pcie5")
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--residencies", default=",".join(map(str, DEFAULT_RESIDENCIES)))
    args = p.parse_args()
    train, test = load_trace(args.train), load_trace(args.trace).head(args.max_tokens)
    model, hw = get_model_profile(args.model_profile), get_hardware_profile(args.hardware)
    L, E, K = test.num_layers, test.num_experts, test.top_k
    print("| residency | Belady's copies | on-demand-lru | " + " | ".join(PRIORS) + " |")
    print("|---" * (len(PRIORS) + 3) + "|")
    for r in map(float, args.residencies.split(",")):
        C = capacity_for(r, L, E, K)
        start = start_placement(train, C)
        n_opt = belady_misses(test.uids(), C, start)
        systems = [System("lru", LRUPolicy())] + [
            System(name, ForecastPolicy.from_trace(train, num_count_classes=n)) for name, n in PRIORS.items()]
        copies = [simulate(test, s, model=model, hardware=hw, capacity=C, start=start).copies for s in systems]
        cells = " | ".join(f"{c / n_opt:.3f}" if n_opt else "-" for c in copies)
        print(f"| {r:g} | {n_opt} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
