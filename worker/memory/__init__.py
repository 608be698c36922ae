"""Device memory, the vocabulary engines and the governor share: what work costs (tokens, bytes)
and what the device has free (NVML)."""
