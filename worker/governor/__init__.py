"""The VRAM governor (pure logic): which pending images make the next micro-batch, from token
costs, a calibrated memory model, an AIMD count limit and the paged KV cache's load."""
