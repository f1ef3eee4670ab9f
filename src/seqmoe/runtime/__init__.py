"""The offloading runtime: a transformers MoE model served from a C-slot device pool of experts.

    import seqmoe
    runtime = seqmoe.offload(model, residency=0.3, system="on-demand-lru")
    model.generate(input_ids, max_new_tokens=32)
    runtime.stats(); runtime.trace(); runtime.restore()

`offload` (offload.py) builds it all-or-nothing and returns an `OffloadRuntime` (handle.py). The
folders are its parts:
- `core/`: what every engine shares: the pool and its slot table, the copy worker, the controller
  that drives the memory manager (`seqmoe.brain.manager`, the simulator's own state machine), the experts
  module swapped into the model and the front that finds each routed expert's weights;
- `eager/`: the router hooks feeding the controller inline, the host CPU executor;
- `posted/`: decode steps that post their routing to a mailbox and never wait for the host (the
  control thread, the slot fence, the host relay, `DecodeGraph`'s CUDA graph);
- `kernels/`: the posted engine's Triton kernels.
docs/decode.md tells one decode step end to end. Needs torch (and transformers for the models).
"""

from seqmoe.runtime.posted.graph import DecodeGraph
from seqmoe.runtime.offload import OffloadRuntime, measure_profile, offload

__all__ = ["offload", "OffloadRuntime", "DecodeGraph", "measure_profile"]
