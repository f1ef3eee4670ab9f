"""Experts streamed from the checkpoint on disk: the model built with its dense part only
(`skeleton`), where each routed expert lies in the safetensors files (`index`, `checkpoint`),
O_DIRECT reads (`reader`), the runtime's host cache of expert rows (`host_cache`), and what
`offload` builds for it (`plan`). The host cache's policy and the disk on the virtual clock are the
brain's (`seqmoe.brain.manager.host_tier`, `disk_clock`); `seqmoe.load` is `seqmoe.runtime.load`.
"""
