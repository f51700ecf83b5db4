"""The web page at `/` and the JSON it polls: the runs under PATH, their curves, latest samples and config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gptforge.checkpoint import META, read_meta, step_of
from gptforge.config import config_from_dict, to_toml
from gptforge.errors import GptforgeError
from gptforge.inputs import printable, read_jsonl, read_text
from gptforge.rundir import CONFIG, METRICS, SAMPLES, finite_number, read_metrics, val_sources
from gptforge.serve.api import error_response
from gptforge.serve.protocol import ApiError
from gptforge.serve.runs import FolderGone, Source, find_sources

STATIC = Path(__file__).parent / "static"
MAX_POINTS = 2000  # per curve: more than a screen shows; longer runs are averaged in buckets
CURVES = {
    "train": ("loss", "lr", "tokens_per_s"),
    "val": ("loss", "bpb"),
    "code": ("infill_exact", "prefix_exact", "span_infill_exact", "span_prefix_exact", "parse_rate"),
    "rl": ("reward", "pass_rate", "reply_tokens", "kl"),
    "tasks": ("pass@1",),
}
SHOWN_SAMPLES = 4


class NoSuchRun(Exception):
    """A run name that is not (or no longer) under PATH: answered 404."""


def routes(root: Path) -> list:
    cache: dict[str, tuple[str, dict]] = {}

    def source(request: Request) -> Source:
        found = find_sources(root).get(request.path_params["run"])
        if found is None:
            raise NoSuchRun(f"no run named {request.path_params['run']!r} under the served folder")
        return found

    def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    def runs(request: Request) -> Response:
        return JSONResponse({"root": printable(root.name), "runs": [_describe(s) for s in find_sources(root).values()]})

    def metrics(request: Request) -> Response:
        run = source(request)
        path = run.file(METRICS)
        version = _version(path) if path else None
        if version is not None and version == request.query_params.get("version"):
            return JSONResponse({"version": version, "unchanged": True})
        if version is None:
            return JSONResponse({"version": None, **{kind: {} for kind in CURVES}})
        if cache.get(run.name, ("",))[0] != version:
            records = read_metrics(run.folder, tuple(CURVES))
            columns = {
                kind: _columns(records[kind], (*keys, *_source_keys(records[kind]))) for kind, keys in CURVES.items()
            }
            cache[run.name] = (version, columns)
        return JSONResponse({"version": version, **cache[run.name][1]})

    def samples(request: Request) -> Response:
        path = source(request).file(SAMPLES)
        records = [r for _, r in read_jsonl(path, torn_tail_ok=True)] if path else []
        return JSONResponse({"samples": records[-SHOWN_SAMPLES:][::-1]})

    def config(request: Request) -> Response:
        run = source(request)
        if run.is_checkpoint:
            return JSONResponse({"toml": _checkpoint_toml(run.folder)})
        path = run.file(CONFIG)
        return JSONResponse({"toml": read_text(path) if path else ""})

    return [
        Route("/", index),
        Route("/api/runs", _errors(runs)),
        Route("/api/runs/{run}/metrics", _errors(metrics)),
        Route("/api/runs/{run}/samples", _errors(samples)),
        Route("/api/runs/{run}/config", _errors(config)),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]


def _errors(handler):
    """A missing run is a 404, a run file that cannot be read (a bad line) a 422, the served folder gone a 503: in
    OpenAI's form, as the API's errors (the page shows their message).
    The handlers are plain functions, which Starlette runs on its thread pool: reading a long metrics.jsonl
    does not hold up the tokens streaming to other clients."""

    def wrapped(request: Request) -> Response:
        try:
            return handler(request)
        except NoSuchRun as e:
            return error_response(ApiError(404, str(e), None, "run_not_found"))
        except FolderGone as e:
            return error_response(ApiError(503, str(e), None, "served_folder_gone"))
        except GptforgeError as e:
            return error_response(ApiError(422, str(e), None, "unreadable_run_file"))

    return wrapped


def _describe(source: Source) -> dict[str, Any]:
    ckpt = source.newest_checkpoint()
    return {
        "id": source.name,
        "is_checkpoint": source.is_checkpoint,
        "checkpoint": ckpt.name if ckpt else None,
        "checkpoint_step": step_of(ckpt) if ckpt else None,
        "has_metrics": source.file(METRICS) is not None,
    }


def _checkpoint_toml(ckpt: Path) -> str:
    """The config in a lone checkpoint's meta.json, as TOML."""
    try:
        return to_toml(config_from_dict(read_meta(ckpt)["config"]))
    except (OSError, ValueError, KeyError, TypeError) as e:  # a hand-edited meta.json
        raise GptforgeError(f"{ckpt / META}: unreadable ({type(e).__name__}: {e})") from None


def _version(path: Path) -> str | None:
    """Changes whenever training appends a line: the page asks for the curves again only then."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return f"{st.st_mtime_ns}-{st.st_size}"


def _source_keys(records: list[dict]) -> tuple[str, ...]:
    """A mix's per-folder val curves (`loss/NAME`, `bpb/NAME`)."""
    return tuple(f"{key}/{name}" for name in val_sources(records) for key in ("loss", "bpb"))


def _columns(records: list[dict], keys: tuple[str, ...]) -> dict[str, list]:
    """{"step": [...], key: [...]} with at most MAX_POINTS entries: consecutive records averaged in equal buckets."""
    size = max(1, -(-len(records) // MAX_POINTS))  # ceil: 1 until a run logs more than MAX_POINTS records
    out: dict[str, list] = {"step": []} | {k: [] for k in keys}
    for start in range(0, len(records), size):
        bucket = records[start : start + size]
        out["step"].append(bucket[-1]["step"])
        for k in keys:
            values = [r[k] for r in bucket if finite_number(r.get(k))]
            out[k].append(sum(values) / len(values) if values else None)
    return out
