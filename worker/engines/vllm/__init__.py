"""HunyuanOCR on vLLM: in-process (``engine``) or through OpenAI-compatible servers (``server``,
started by ``launcher``), with the plugin that fixes each supported vLLM release (``plugin``)."""
