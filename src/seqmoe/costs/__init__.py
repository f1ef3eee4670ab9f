"""The cost model: what a model and a machine cost (docs/DESIGN.md, "Cost model").

`profiles` holds the model and hardware profiles and the times they give (a layer, a copy, a disk
read), `presets` the named profiles with their sources, `host_cost` the host CPU's time per expert,
`precision` the bytes of an expert at each stored precision and byte budgets. Pure functions of
numbers; imports only `base`.
"""
