"""OCR engines behind one interface (``base.Engine``): RapidOCR and a simulated engine here,
HunyuanOCR on vLLM (``vllm/``) and on transformers (``transformers/``). ``worker.engine_kinds``
picks one from settings."""
