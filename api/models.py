"""The API's request and response bodies (what ``/openapi.json`` says and every response matches)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ocrq.messages import TASKS
from ocrq.names import JOB_PATTERN
from producer.name_filter import MAX_PATTERNS, NameFilter

State = Literal["queued", "running", "finalizing", "succeeded", "partial", "failed", "cancelling", "cancelled"]
Task = Literal[TASKS]  # type: ignore[valid-type]


class JobCreate(BaseModel):
    """A new job: its refs (paths, ``s3://`` keys and prefixes, http(s) URLs), as ``ocrq submit``
    takes them."""

    model_config = ConfigDict(extra="forbid")

    refs: list[str] = Field(min_length=1, max_length=100_000,
                            description="image refs; more than this: upload a manifest (multipart)")
    name: str | None = Field(default=None, pattern=f"^{JOB_PATTERN}$",
                             description="the job's name (unique for the tenant); unset: made from the "
                                         "Idempotency-Key, or a new one")
    task: Task = "text"
    params: dict[str, Any] = Field(default_factory=dict)
    priority: int | None = Field(default=None, ge=0, le=9, description="0 is the most urgent")
    webhook_url: str | None = Field(default=None, max_length=2048)
    metadata: dict[str, str] = Field(default_factory=dict, max_length=16)
    parquet: bool = False
    match: list[str] = Field(default_factory=list, max_length=MAX_PATTERNS,
                             description="shell patterns on a file's name (any case; any one is enough): which "
                                         "files found in folders and s3:// prefixes to take, the rest counted as "
                                         "skipped; files named on their own are always taken")

    @field_validator("match")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        NameFilter.of(value)  # a ValueError says what is wrong: a 422 naming the field
        return value


class Counts(BaseModel):
    total: int
    done: int
    cached: int
    failed: int
    cancelled: int
    queued: int
    running: int
    retrying: int
    skipped: int


class Cost(BaseModel):
    #: seconds of engine time the job's images shared, named by what measured them
    engine_seconds: float
    #: "GPU-s" | "CPU-s" | "engine-s" (both, or not noted)
    unit: str
    device: str
    usd: float
    usd_per_1000_images: float
    store_usd_per_1000_images: float


class Export(BaseModel):
    location: str
    written: bool
    files: list[str]


class Job(BaseModel):
    id: str
    object: Literal["job"] = "job"
    state: State
    created_at: int
    task: str
    params: dict[str, Any]
    priority: int | None
    counts: Counts
    #: share of the images final, or finished by an engine and about to be recorded
    progress: float
    #: images finished a second over the last ~10 s (ocrq.jobs.progress), and over the job's life
    images_per_second: float | None
    average_images_per_second: float
    eta_seconds: float | None
    cost: Cost
    export: Export
    metadata: dict[str, Any]
    webhook_url: str | None
    cancelled_at: float | None
    finished_at: float | None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Job]
    has_more: bool
    #: pass as ``after`` for the next page
    next: str | None = None


class FailedImage(BaseModel):
    id: str
    ref: str
    error: dict[str, Any] | None
    attempts: int
    failed_at: float
    row: dict[str, Any] | None = None


class FailedList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FailedImage]
    has_more: bool


class Reprocessed(BaseModel):
    id: str
    reprocessed: int


class Delivery(BaseModel):
    event: str
    type: str
    attempt: int
    at: float
    url: str
    status: int | None = None
    error: str | None = None
    seconds: float | None = None
    delivered: bool = False


class DeliveryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Delivery]
    pending: list[dict[str, Any]]


class ErrorDetail(BaseModel):
    type: str
    code: str
    message: str
    refused: list[dict[str, str]] | None = None
    counts: dict[str, int] | None = None


class Error(BaseModel):
    error: ErrorDetail


#: the error bodies each route may answer with, for the schema
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": Error} for code in (400, 401, 404, 409, 413, 422, 429, 503)}
