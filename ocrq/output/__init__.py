"""A job's documents in the store: result parts (one per stored chunk) and the results index
that says which of them are current (``parts``), a finished job's export and its request
(``export``), the OpenAI Batch output and error files (``openai_responses``). Above the job
index and the store: what both the workers (writing parts, exporting) and the producer
(reading results) use."""
