"""The runtime's Triton kernels: the slot-or-host gather `core` uses on CUDA and the posted engine's
mailbox post (`mapped`),
the host relay's waits (`relay`, `relay_triton`) and cache-aware rerouting on the device
(`rerouting`). Each has a torch or host reference it is tested against, on the CPU under
`TRITON_INTERPRET=1`.
"""
