"""The eager engine: the router hooks feed the controller inline (the host reads each layer's
routing as it is computed), and misses the memory manager sends to the host CPU run on the host
executor. It serves every prompt forward, and every decode step with `control="inline"` (the
CPU's default). docs/decode.md tells its decode step.
"""
