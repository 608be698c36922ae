"""The HTTP front door: ``ocrq serve`` (jobs API, OpenAI Files and Batches, webhooks, the jobs page)."""
