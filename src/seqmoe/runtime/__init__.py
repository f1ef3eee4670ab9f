"""The offloading runtime: a transformers MoE model served from a C-slot device pool of experts.

    import seqmoe
    runtime = seqmoe.offload(model, residency=0.3, system="on-demand-lru")
    model.generate(input_ids, max_new_tokens=32)
    runtime.stats(); runtime.trace(); runtime.restore()

`offload` (offload.py) builds it all-or-nothing and returns an `OffloadRuntime` (handle.py);
`load` loads a checkpoint under it (`seqmoe.load`: experts streamed from disk; what generate and
serve load). The folders are its parts:
- `core/`: what both engines share: the pool and its slot table, the copy worker, the controller
  that drives the memory manager (`seqmoe.brain.manager`, the simulator's own state machine), the experts
  module swapped into the model and the front that finds each routed expert's weights; it imports
  neither engine (`offload` gives it their parts);
- `eager/`: the engine whose router hooks feed the controller inline, the host CPU executor;
- `posted/`: the engine whose decode steps post their routing to a mailbox and never wait for the
  host (its controller, the control thread, the slot fence, the host relay, `DecodeGraph`);
- `kernels/`: the Triton kernels (the gather `core` uses on CUDA, the posted engine's);
- `disk/`: experts streamed from the checkpoint (the dense part only, where each expert lies,
  O_DIRECT reads, the host cache); `timing/`: harnesses that time the runtime.
docs/decode.md tells one decode step end to end. Imports `base`, `trace`, `costs`, `arch`, `brain`
and `config`. Needs torch (and transformers for the models).
"""

from seqmoe.runtime.offload import OffloadRuntime, measure_profile, offload
from seqmoe.runtime.posted.graph import DecodeGraph

__all__ = ["offload", "OffloadRuntime", "DecodeGraph", "measure_profile"]
