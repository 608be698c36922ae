"""The benchmark scenarios, one table: what each measures, the command it runs, whether it needs a
GPU and the document its figures go to. ``python -m bench <name>`` runs one (bench/__main__.py).

A command is either a module of this package (run with the driver's own Python) or a step of
bench/h200_vllm.sh (the GPU host's steps: each fits one 10-minute device command). ``{run}`` in a
command is the run's directory, where the manifest goes too (bench/manifest.py); the h200 steps
write under ``$OUT``, which the driver sets to it.
"""

from __future__ import annotations

from dataclasses import dataclass

H200 = "bench/h200_vllm.sh"


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    #: ``-m module args...`` (this Python) or ``bash bench/h200_vllm.sh STEP`` (a GPU host step)
    command: tuple[str, ...]
    gpu: bool
    #: the document its figures go to
    doc: str

    @property
    def module(self) -> str | None:
        return self.command[1] if self.command[0] == "-m" else None

    @property
    def step(self) -> str | None:
        return self.command[2] if self.command[:2] == ("bash", H200) else None


def _m(module: str, *args: str) -> tuple[str, ...]:
    return ("-m", module, *args)


def _step(step: str) -> tuple[str, ...]:
    return ("bash", H200, step)


def _gpu(name: str, about: str, step: str, doc: str = "docs/bench/gpu-vllm.md") -> Scenario:
    """A step of bench/h200_vllm.sh on a GPU host."""
    return Scenario(name, about, _step(step), True, doc)


_VLLM = "docs/bench/gpu-vllm.md"
_WORKER = "docs/bench/gpu-worker.md"
_GOV = "docs/bench/gpu-governor.md"

SCENARIOS: tuple[Scenario, ...] = (
    # --- CPU: this machine, a local redis-server ---
    Scenario("overhead", "the queue's own cost per image: ocrq (first pass, all-cache-hit pass) vs plain Celery",
             _m("bench.overhead", "--images", "20000"), False, "docs/bench/overhead.md"),
    Scenario("scale", "Redis over the life of one 1,000,000-image job; writes docs/bench/scale.{json,md,png}",
             _m("bench.scale", "--images", "1000000"), False, "docs/bench/scale.md"),
    Scenario("reliability", "the chaos suite, full form: kills, Redis crashes, S3 outage, failover, security",
             _m("bench.chaos", "--json", "{run}/chaos.json"), False, "docs/reliability.md"),
    Scenario("reliability-quick", "the chaos suite, quick form (short reaper timings; part of `make test`)",
             _m("bench.chaos", "--quick", "--json", "{run}/chaos.json"), False, "docs/reliability.md"),
    Scenario("api", "the HTTP API: a 1,000,000-line manifest over HTTP vs Client.submit, GET latency under 50 "
             "connections, results streamed vs `ocrq results`; writes docs/bench/api.md",
             _m("bench.api", "--out", "docs/bench/api.md"), False, "docs/bench/api.md"),
    Scenario("submit", "refs/s into Redis, one ref per message vs chunks; writes docs/bench/submit.md",
             _m("bench.submit_throughput", "--refs", "20000", "--out", "docs/bench/submit.md"), False,
             "docs/bench/submit.md"),
    Scenario("hashing", "sha256 vs BLAKE3, JSON vs msgpack; rewrites docs/bench/hashing.md's measured part",
             _m("bench.hashing", "--out", "docs/bench/hashing.md"), False, "docs/bench/hashing.md"),
    Scenario("pipeline", "RapidOCR directly vs through the queue; writes docs/bench/pipeline.md",
             _m("bench.pipeline_overhead", "--images", "40", "--out", "docs/bench/pipeline.md"), False,
             "docs/bench/pipeline.md"),
    Scenario("decode-isolation", "decoding in child processes vs in-process, decode only and end to end",
             _m("bench.decode_isolation", "--images", "600", "--photos", "32", "--out", "{run}/decode-isolation.md"),
             False, "docs/bench/decode-isolation.md"),
    Scenario("pages", "the jobs pages: GET / and /jobs/{id} of a tenant with 10,000 jobs beside 10 (p50/p99)",
             _m("bench.pages", "--jobs", "10000", "--out", "docs/bench/pages.md"), False, "docs/bench/pages.md"),
    Scenario("decode-memory", "peak RSS of the decoding children on decompression-bomb-shaped files, limits off"
             " vs on", _m("bench.decode_memory", "--json", "{run}/decode-memory.json"), False, "docs/reliability.md"),
    Scenario("quality", "the CPU engine's CER on the research corpus; writes docs/quality.md",
             _m("bench.quality"), False, "docs/quality.md"),
    Scenario("server-bodies", "vllm-server request bodies (JSON vs spliced PPM) against the worker's GIL",
             _m("bench.server_bodies"), False, _VLLM),
    Scenario("gpu-multi-simulated", "two workers vs one on the simulated engine (CPU stand-in for two GPUs)",
             _m("bench.gpu_multi", "--simulated", "0.84", "--out", "docs/bench/gpu-multi-simulated.json"), False,
             "docs/bench/gpu-multi.md"),
    Scenario("gpu-worker-simulated", "the real worker on a padded simulated engine (CPU stand-in for gpu-worker)",
             _m("bench.gpu_worker", "--simulated", "1.0", "--sim-image-s", "0.065", "--size", "tiny",
                "--out", "{run}/gpu_worker.json"), False, _WORKER),
    # --- GPU, one module (machine set up by bench/gpu_setup.sh) ---
    Scenario("gpu-worker", "the real worker, transformers engine, cold then warm start, 200 images each",
             _m("bench.gpu_worker", "--out", "{run}/gpu_worker.json"), True, _WORKER),
    Scenario("gpu-multi", "one worker per GPU on one queue: one GPU vs two (needs two GPUs)",
             _m("bench.gpu_multi", "--out", "{run}/gpu-multi.json", "--work", "/tmp/ocrq-gpu-multi"), True,
             "docs/bench/gpu-multi.md"),
    Scenario("gpu-governor", "transformers engine in-process: governor cold/warm vs static batches (24 GiB cap)",
             _m("bench.gpu_governor", "runs", "--governor", "--budget-s", "20", "--out", "{run}/runs.json"), True,
             _GOV),
    Scenario("gpu-decode-step", "decode step times (HF generate, hf, graph) and token equivalence",
             _m("bench.gpu_governor", "decode", "--out", "{run}/decode.json"), True, _GOV),
    Scenario("gpu-governor-hf", "the mixed workload with the engine's `hf` decode mode: governor vs static 8",
             _m("bench.gpu_governor", "runs", "--decode", "hf", "--governor", "--batches", "8", "--budget-upto", "8",
                "--budget-s", "200", "--no-seeds", "--out", "{run}/runs_hf.json"), True, _GOV),
    Scenario("gpu-governor-generate", "the governor against HF `generate` at batch 8 (the hand-rolled script row)",
             _m("bench.gpu_governor", "runs", "--governor", "--static", "generate", "--batches", "8", "--budget-upto",
                "8", "--budget-s", "60", "--no-seeds", "--out", "{run}/seeds_baseline.json"), True, _GOV),
    Scenario("gpu-invariance", "batch invariance of the transformers engine in bf16 on the GPU",
             _m("bench.gpu_governor", "invariance", "--out", "{run}/invariance.json"), True, _GOV),
    Scenario("gpu-parity", "fp32 parity: the engine's step against HF's forward on the GPU",
             _m("bench.gpu_governor", "parity", "--dtype", "float32", "--out", "{run}/parity_fp32.json"), True, _GOV),
    Scenario("gpu-profile-engine", "torch.profiler kernels of one prefill and one decode step (transformers engine)",
             _m("bench.profile_engine", "--out", "{run}/profile.json"), True, _GOV),
    # --- GPU, steps of bench/h200_vllm.sh (one H200; the step's setup installs what the host lacks) ---
    _gpu("gpu-tests", "the `vllm` tier (tiny, fp32), then tests/gpu (full size, bf16, CUDA graphs)", "all-tests"),
    _gpu("gpu-graphs-tests", "tests/gpu/test_vllm_graphs_gpu.py (engine.vision_cuda_graphs)", "graphs-tests"),
    _gpu("gpu-start", "start time: plain vLLM vs `ocrq worker`, cold then warm compile cache", "start"),
    _gpu("gpu-profile", "vLLM's engine alone, where its time goes, at 16384 and 65536 batched tokens", "profile"),
    _gpu("gpu-rows", "vllm-default + ocrq-vllm at the profile's better token budget (MNBT=... to force)", "rows"),
    _gpu("gpu-worker-plain", "ocrq-vllm, then vllm-default, at 65536 batched tokens", "worker-plain"),
    _gpu("gpu-worker-plain-diag", "vm_memory, then the same pair, three sets each (ocrq-vllm under DIAG)",
         "worker-plain-diag"),
    _gpu("gpu-worker-diag", "ocrq-vllm under DIAG: thread CPU, py-spy, the engine core's warm set, NVML",
         "worker-diag"),
    _gpu("gpu-first-job", "vm_memory, then a worker's first and second job under py-spy (DIAG)", "firstset"),
    _gpu("gpu-groups", "ocrq-vllm with the grouped vision tower, then its GPU tests", "groups"),
    _gpu("gpu-groups-ab", "grouped tower, then vLLM's loop (no DIAG)", "groups-ab"),
    _gpu("gpu-graphs", "ocrq-vllm with the vision tower as CUDA graphs, then eager", "graphs"),
    _gpu("gpu-graph-row", "one ocrq-vllm row, the tower as CUDA graphs (NAME=...)", "graph-row"),
    _gpu("gpu-eager-row", "one ocrq-vllm row, vLLM's eager tower (NAME=...)", "eager-row"),
    _gpu("gpu-engine-graphs", "the engine alone (pre-rendered pages), tower as graphs, then eager", "engine-graphs"),
    _gpu("gpu-batches", "admission's grain: 8 batches in flight (default) vs 32 smaller ones", "batches"),
    _gpu("gpu-everything", "the worker giving vLLM every page (no KV admission), then admission", "everything"),
    _gpu("gpu-server", "ocrq-vllm-server at 65536 (DIAG), default API processes", "server"),
    _gpu("gpu-server1", "ocrq-vllm-server with one API process", "server1"),
    _gpu("gpu-server-quick", "the server row, two sets (no small job, no DIAG)", "server-quick"),
    _gpu("gpu-seqs8-server", "vllm-seeds (max_num_seqs 8, as deployment guides set it), then ocrq-vllm-server",
         "seqs8-server"),
    _gpu("gpu-preempt", "vllm-default-8g + ocrq-vllm-8g: admission vs giving vLLM everything, 8 GiB", "preempt"),
    _gpu("gpu-pair", "two engines on the GPU (engine.engines_per_gpu 2), then one (SINGLE=0: not)", "pair"),
    _gpu("gpu-pair-mps", "the pair under NVIDIA MPS", "pair-mps"),
    _gpu("gpu-single", "one engine, chunks of 16 (the pair's reference)", "single"),
    _gpu("gpu-ratio", "in-process governor vs the real worker, transformers engine (IMAGES=, SPY=1)", "ratio", _WORKER),
    _gpu("gpu-ratio-ab", "the ratio on this code, on the code before .ab/new.patch, and with a 1500 ms wait",
         "ratio-ab", _WORKER),
)

BY_NAME = {s.name: s for s in SCENARIOS}
