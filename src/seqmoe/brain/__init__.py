"""The brain: what decides which experts are resident, shared by the simulator and the runtime.

    trace ──► predict ──► schedule ──► policies ──► manager ──► sim | runtime
             (what next,  (which copies,  (who is      (slots, the copy channel, the miss
              how likely)  by when)        evicted)     paths and the clock: one state machine)

- `predict/`: forecasters of the routing (the seq2seq forecaster, learned offline or online; the
  baselines' predictors);
- `schedule/`: prefetch schedulers (deadline job sequencing, the baselines');
- `policies/`: eviction policies behind `policies.base.EvictionPolicy`;
- `manager/`: the memory manager (the reference `state` and its compiled twin `compiled/`), the
  named systems (`systems`), the miss paths (`miss_paths`), the disk tier's host cache policy and
  clock (`host_tier`, `disk_clock`);
- `rerouting`: cache-aware routing within a KL budget; `admission`: which waiting request joins a batch.

Imports `base`, `trace` and `costs` only: no torch at import, no simulator, no runtime.
"""
