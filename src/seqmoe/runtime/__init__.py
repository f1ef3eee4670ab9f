"""The offloading runtime: a transformers MoE model served from a C-slot device pool of experts.

    import seqmoe
    runtime = seqmoe.offload(model, residency=0.3, system="on-demand-lru")
    model.generate(input_ids, max_new_tokens=32)
    runtime.stats(); runtime.trace(); runtime.restore()

Data plane: `pool` (host blocks, slots, slot table; the slot fence's argument), `fence` (table
versions the device acknowledged, forwards it completed), `experts` (the swapped-in experts
module), `mapped` (host memory the device reads in place; the slot-or-host gather), `copier` (the
copy worker). Control plane: `control` drives the memory manager (`seqmoe.manager`, the
simulator's state machine) from the routers' outputs (`hooks`) through the simulator's own driver
loop, so the decisions are the simulator's, either inline in the hooks or on its own thread
(`control_thread`) fed by the routing `mailbox`; `graph` captures the decode step as a CUDA graph.
`offload` builds it all-or-nothing (`build`), `handle` is what it returns, `signals` keeps teardown
whole under Ctrl-C. Needs torch (and transformers for the models).
"""

from seqmoe.manager.systems import live_systems
from seqmoe.runtime.graph import DecodeGraph
from seqmoe.runtime.offload import OffloadRuntime, measure_profile, offload

__all__ = ["offload", "OffloadRuntime", "DecodeGraph", "live_systems", "measure_profile"]
