"""The posted engine (`control="thread"`, CUDA's default): a decode step posts its routing to a
mailbox in mapped host memory and never waits for the host; a control thread runs the memory
manager from the mailbox, a slot fence says when a released slot may be refilled, the host relay
brings the host CPU's experts into the step, and `DecodeGraph` captures the step as one CUDA
graph. docs/decode.md tells its decode step.
"""
