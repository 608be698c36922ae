"""HunyuanOCR through transformers: chunked prefill and a static-KV greedy decoder (``engine``)."""
