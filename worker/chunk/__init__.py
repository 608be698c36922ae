"""One attempt at a chunk, one module per step, each taking the attempt (worker.chunk.attempt) and
returning it one step on: ``fetch`` (fetch + hash, PDFs rendered), ``cache_check`` (one MGET),
``decode`` (the misses only), ``infer`` (the engine loop), ``store`` (cache entries, the result
part and the failed mirrors in one store call, then the job index). worker.tasks.process_chunk
calls them in order, one log line each. Beside them: an image's record and the settling of its
error (``records``), what an attempt reports (``report``), the retry policy (``retry``), a chunk
failed as a whole (``whole``), per-image work over the fetch pool (``fanout``), and what the steps
need of the worker (``needs``: protocols the worker's context meets)."""
