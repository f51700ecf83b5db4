"""`gptforge prepare`: tokenize a corpus in worker processes into EOT-delimited shards plus a manifest.

Shards end at document boundaries (a document longer than a shard gets one of its own), so a shard holds
whole documents and records the last one's index. `progress.json` marks the folder unfinished from the start
and saves what is done after each shard; a crashed run started again with the same settings skips finished
shards and the documents in them. Other settings replace a folder only with --force, built beside it and
swapped in once complete.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptforge.data import pipeline
from gptforge.data.clean import quality
from gptforge.data.clean.decontaminate import eval_ngrams
from gptforge.data.clean.dedup import Deduplicator, DedupSettings
from gptforge.data.clean.filters import build_filters
from gptforge.data.engine import LOCAL, WORK_DIR, EngineSettings, Share, check_engine, datatrove_outcomes
from gptforge.data.outdir import (
    REPORT_FILE,
    TOKENIZER_FILE,
    WRITE_ERRNOS,
    already_prepared,
    destination,
    finished,
    holds_own_data,
    marked_if_failed,
    read_json,
    read_own,
    refuse_other_settings,
    remove_own_files,
    remove_stale_temps,
    removed_if_failed,
)
from gptforge.data.pipeline import Job, Outcome, is_validation, judge
from gptforge.data.prepare_settings import PrepareSettings, tokenizer_digest
from gptforge.data.report import REMOVED_FILE, Report, render
from gptforge.data.shards import MANIFEST, PROGRESS, SPLITS, ShardWriter, dtype_for_vocab, write_manifest
from gptforge.data.sources import Document, documents, local_paths, resolve, source_bytes, source_state
from gptforge.errors import GptforgeError
from gptforge.files import atomic_write, swap_dir
from gptforge.outputs import check_output_dir, locked, output_folder
from gptforge.tokens.tokenizer import Tokenizer, load_tokenizer, train_bpe


@dataclass(frozen=True)
class _Run:
    """Where the per-document work runs: not part of the data's settings, since every choice writes the same shards."""

    workers: int | None
    engine: EngineSettings


def _split(name: str, index: int, settings: PrepareSettings) -> str:
    return "val" if is_validation(name, index, settings.val_fraction, settings.seed) else "train"


def _tokenizer_for(
    out: Path,
    settings: PrepareSettings,
    resuming: bool,
    given: Tokenizer | None,
    ngrams: frozenset[int],
    workers: int | None,
    scorer: quality.Classifier | None,
) -> Tokenizer:
    """The `given` tokenizer (GPT-2 or a file), or a BPE trained on the training documents the run keeps (so that
    copies and filtered junk do not shape its vocabulary); file-based ones go to OUT."""
    if given is None:
        if resuming and (out / TOKENIZER_FILE).is_file():
            return load_tokenizer(TOKENIZER_FILE, out)
        kept = _kept_training_docs(settings, ngrams, workers=workers, scorer=scorer)
        docs = pipeline.nonempty(documents(settings.source, settings.text_field, extensions=settings.extensions))
        train_docs = (
            text
            for i, (name, text) in enumerate(docs)
            if (i in kept if kept is not None else not is_validation(name, i, settings.val_fraction, settings.seed))
        )
        print(f"training a {settings.trained_vocab}-token byte-level BPE on {settings.source}", flush=True)
        return train_bpe(train_docs, settings.trained_vocab, out / TOKENIZER_FILE)
    if given.path is not None and given.path.resolve() != (out / TOKENIZER_FILE).resolve():
        atomic_write(out / TOKENIZER_FILE, given.path.read_bytes())  # the data folder carries its own tokenizer
        return load_tokenizer(TOKENIZER_FILE, out)
    return given


def _kept_training_docs(
    settings: PrepareSettings, ngrams: frozenset[int], *, workers: int | None, scorer: quality.Classifier | None
) -> set[int] | None:
    """Indexes of the training documents the run keeps (filters, quality, duplicates, contamination), judged
    without tokenizing; None when nothing is removed."""
    filters = build_filters(settings.clean_mode, settings.clean)
    if settings.dedup.mode == "none" and not filters and not ngrams and scorer is None:
        return None
    docs = pipeline.nonempty(documents(settings.source, settings.text_field, extensions=settings.extensions))
    jobs = (Job(i, _split(name, i, settings), name, text, tokenize=False) for i, (name, text) in enumerate(docs))
    dedup, report, names, kept = Deduplicator(settings.dedup), Report(), {}, set()
    print("judging the documents first, so that the tokenizer learns from those kept", flush=True)
    with pipeline.start_pool(pipeline.worker_count(workers), None, ngrams, filters, settings.dedup, scorer) as pool:
        for batch, _ in pool.imap(pipeline.encode, pipeline.batched(jobs)):
            kept.update(o.index for o in batch if judge(o, dedup, report, names, quality=scorer) and o.split == "train")
    return kept


def prepare(
    settings: PrepareSettings,
    out_dir: str | Path,
    *,
    workers: int | None = None,
    force: bool = False,
    engine: EngineSettings = LOCAL,
) -> dict[str, Any]:
    """Tokenize `settings.source` (PrepareSettings.from_flags: what prepare's flags ask) into `out_dir`; returns the
    manifest (also written, last, as manifest.json). `workers`: the local engine's processes; `force`: replace a
    folder holding anything else; `engine`: where the per-document work runs."""
    if workers is not None and workers <= 0:
        raise GptforgeError(f"--workers must be positive, got {workers}")
    engine = check_engine(engine)
    source = settings.source
    skipped: list[tuple[str, int, str]] = []  # (name, bytes, why): filled as the documents are read
    docs = documents(source, settings.text_field, extensions=settings.extensions, skipped=skipped)  # missing: fails
    out = output_folder(out_dir)
    # Never the folder read from; a folder of other files is refused before the lock file goes into it.
    holds_data = holds_own_data(out)
    given_file = [] if settings.trained_vocab is not None or settings.tokenizer == "gpt2" else [settings.tokenizer]
    reference = [Path(settings.quality.labels)] if settings.quality.labels is not None else []
    reference += local_paths(settings.quality.reference) if settings.quality.reference is not None else []
    check_output_dir(out, force or holds_data, [*local_paths(source), *settings.decontaminate, *given_file, *reference])
    settings = dataclasses.replace(
        settings,
        corpus=source_state(source, settings.extensions),
        tokenizer_sha256=tokenizer_digest(settings.tokenizer),
        quality=_quality_state(settings),
    )
    done = finished(out, settings)
    if done is not None and not force:
        return already_prepared(out, done, locked)  # decided reading only, so a finished read-only folder works
    docs, tok, ngrams = _checked_inputs(pipeline.nonempty(docs, skipped), settings)
    refuse_other_settings(out, settings, force)  # checked again under the lock
    scorer = _classifier(settings)  # trained once, here, before the folder exists: a bad REF writes nothing
    created = not (out.exists() or out.is_symlink())
    try:
        with removed_if_failed(out, created), locked(out, "prepare"):
            folder = destination(out, settings, force)
            if folder is None:  # another prepare finished it since the check above
                return already_prepared(out, read_json(out / MANIFEST), locked)
            with marked_if_failed(folder):
                run = _Run(workers, engine)
                manifest = _build((docs, skipped), folder, settings, given=tok, ngrams=ngrams, scorer=scorer, run=run)
            if folder != out:
                swap_dir(folder, out.resolve())
            return manifest
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        raise GptforgeError(
            f"cannot write {out}: {e.strerror}; fix that and run the same command again (it resumes)"
        ) from None


def _checked_inputs(
    docs: Iterator[Document], settings: PrepareSettings
) -> tuple[Iterator[Document], Tokenizer | None, frozenset[int]]:
    """The documents (with text: the first one read), the given tokenizer and the evaluation n-grams: a wrong
    --tokenizer, --decontaminate or --text-field, or a corpus without text, fails before the folder exists."""
    tok = load_tokenizer(settings.tokenizer) if settings.trained_vocab is None else None
    ngrams = eval_ngrams(list(settings.decontaminate)) if settings.decontaminate else frozenset()
    first = next(docs, None)
    if first is None:
        raise GptforgeError(f"{settings.source}: empty corpus (no documents with text were found)")
    return itertools.chain([first], docs), tok, ngrams


def _quality_state(settings: PrepareSettings) -> quality.QualitySettings:
    """The classifier's settings with a digest of REF (its files' names, sizes and times) or of the labels file."""
    q = settings.quality
    if q.reference is not None:
        try:
            state = source_state(resolve(q.reference, settings.text_field)[0], settings.extensions)
        except GptforgeError as e:
            raise GptforgeError(f"--quality: {e}") from None
        return dataclasses.replace(q, state=state[2] if state else None)
    return dataclasses.replace(q, state=tokenizer_digest(q.labels)) if q.labels is not None else q


def _classifier(settings: PrepareSettings) -> quality.Classifier | None:
    """--quality's classifier, learned from a seeded sample of REF's documents against one of the corpus's, or
    --quality-labels' regressor; None without either. A missing or empty REF is one line naming --quality."""
    if settings.quality.labels is not None:
        texts, scores = quality.labelled(settings.quality.labels, settings.seed)
        print(f"quality regressor: {len(texts):,} labelled document{'s' * (len(texts) != 1)}", flush=True)
        return quality.train_regressor(texts, scores, settings.quality, settings.seed)
    if settings.quality.reference is None:
        return None
    ref, text_field = resolve(settings.quality.reference, settings.text_field)
    skipped: list[tuple[str, int, str]] = []  # REF's files without text: said when none had any

    def texts(source: str, skips: list | None = None) -> Iterator[str]:
        docs = documents(source, text_field, extensions=settings.extensions, skipped=skips)
        return (text for _, text in pipeline.nonempty(docs, skips))

    try:
        reference = quality.sample(texts(ref, skipped), quality.SAMPLE_DOCS, settings.seed)
    except GptforgeError as e:
        raise GptforgeError(f"--quality: {e}") from None
    # Another stream of the same seed: a document in both REF and the corpus is not drawn in step on both sides.
    corpus = quality.sample(texts(settings.source), quality.SAMPLE_DOCS, settings.seed + 1)
    print(
        f"quality classifier: {len(reference):,} reference document{'s' * (len(reference) != 1)} against "
        f"{len(corpus):,} of the corpus",
        flush=True,
    )
    return quality.train(reference, corpus, settings.quality, settings.seed, skipped=skipped)


def _build(
    read: tuple[Iterator[Document], list[tuple[str, int, str]]],
    out: Path,
    settings: PrepareSettings,
    given: Tokenizer | None,
    ngrams: frozenset[int],
    scorer: quality.Classifier | None,
    run: _Run,
) -> dict[str, Any]:
    """Tokenize into `out`, resuming what a same-settings run saved in progress.json; returns the manifest."""
    remove_stale_temps(out)
    progress = read_own(out / PROGRESS)
    resuming = progress is not None and settings.matches(progress.get("settings"))
    if not resuming:  # the marker goes first: until the manifest replaces it, the folder is unfinished
        remove_own_files(out)  # an earlier attempt's shards must not outlive it among the new ones
        shutil.rmtree(out / WORK_DIR, ignore_errors=True)
        atomic_write(out / PROGRESS, json.dumps({"settings": settings.to_json(), "shards": []}))
    tok = _tokenizer_for(out, settings, resuming, given, ngrams=ngrams, workers=run.workers, scorer=scorer)
    writers = {s: ShardWriter(out, s, settings.shard_tokens, dtype_for_vocab(tok.vocab_size)) for s in SPLITS}
    if resuming and progress.get("shards"):
        for split, w in writers.items():
            w.restore([s for s in progress["shards"] if s["split"] == split])
        print(f"resuming: {sum(len(w.shards) for w in writers.values())} shard(s) already written", flush=True)
    report = _tokenize(read, tok, ngrams, writers, settings, out, run, scorer=scorer)
    for name, n_bytes, why in read[1]:
        report.skipped(name, why, n_bytes)
    _check_kept(settings, writers, report)
    if settings.decontaminate:
        print(
            f"decontamination: dropped {report.docs['decontaminated']:,} training document(s) sharing a 13-gram "
            f"with {', '.join(settings.decontaminate)}",
            flush=True,
        )
    manifest = {
        "format": "gptforge-shards/1",
        "source": settings.source,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot},
        "val_fraction": settings.val_fraction,
        "seed": settings.seed,
        "settings": settings.to_json(),
        "splits": {s: {"docs": w.docs, "tokens": w.tokens, "bytes": w.bytes} for s, w in writers.items()},
        "decontamination": {"files": list(settings.decontaminate), "dropped_docs": report.docs["decontaminated"]},
        "report": report.to_json(),
        "shards": writers["train"].shards + writers["val"].shards,
    }
    atomic_write(out / REMOVED_FILE, report.removed)
    atomic_write(out / REPORT_FILE, render(manifest["report"], manifest["settings"]))
    write_manifest(out, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    shutil.rmtree(out / WORK_DIR, ignore_errors=True)
    return manifest


def _check_kept(settings: PrepareSettings, writers: dict[str, ShardWriter], report: Report) -> None:
    """One line when nothing is left to train on: the stage (the classifier, or the filter) that removed most, or
    why the corpus is empty."""
    source, read, held = settings.source, report.docs["read"], writers["val"].docs
    if writers["train"].docs:
        return
    # The first document always validates: a stage that took every other one is still what emptied the split.
    left = f"; the {held:,} kept {'is' if held == 1 else 'are'} held out for validation" if held else ""
    filtered, scored_out = sum(n for n, _ in report.filters.values()), report.docs["quality"]
    others = read - held - filtered - scored_out  # copies and contaminated documents: those stages are not named
    if report.filters and filtered >= max(scored_out, others):
        rule, (n, _) = max(report.filters.items(), key=lambda item: item[1][0])
        counts = ", ".join(f"{name} {d:,}" for name, (d, _) in report.filters.items())
        removed = "every document" if filtered == read else f"{filtered:,} of {read:,} documents"
        if scored_out:  # the filters took most, not all: the classifier took some too
            removed += f" and {settings.quality.flag} {scored_out:,}"
        raise GptforgeError(
            f"{source}: --clean {settings.clean_mode} removed {removed} (filter {rule} removed {n:,} of "
            f"{read:,}; {counts}){left}; relax it with --clean-set or pass --clean none"
        )
    if scored_out and scored_out >= others:
        # No report.md is written: the scores' spread is what a threshold can be picked by.
        deciles = report.quality()["deciles"]
        spread = f"scores ranged {deciles[0]:.3f}-{deciles[-1]:.3f}, median {deciles[5]:.3f}"
        lower = "lower --quality-threshold" if settings.quality.threshold is not None else "pass a --quality-threshold"
        other = "pick another REF" if settings.quality.reference is not None else "give other labels"
        raise GptforgeError(
            f"{source}: {settings.quality.flag} removed {scored_out:,} of {read:,} documents and nothing "
            f"else is left to train on{left}; {spread}: {lower} or {other}"
        )
    if held == 0:
        raise GptforgeError(f"{source}: empty corpus (no documents with text were found)")
    raise GptforgeError(
        f"{source}: only {held} document(s) kept, all held out for validation (add documents, or pass --val-fraction 0)"
    )


def _tokenize(
    read: tuple[Iterator[Document], list[tuple[str, int, str]]],
    tok: Tokenizer,
    ngrams: frozenset[int],
    writers: dict[str, ShardWriter],
    settings: PrepareSettings,
    out: Path,
    run: _Run,
    *,
    scorer: quality.Classifier | None,
) -> Report:
    """Judge every document in order and tokenize those kept that are not yet in a shard into the writers,
    saving progress after each shard. Documents already in shards are judged again (not written), so the
    deduplicator and the report are rebuilt exactly on resume. `read`: the documents, and the files skipped."""
    docs, skipped = read

    def jobs() -> Iterator[Job]:
        for index, (name, text) in enumerate(docs):  # documents with text (`_checked_inputs`)
            split = _split(name, index, settings)
            yield Job(index, split, name, text, tokenize=index >= writers[split].next_doc)

    def save_progress() -> None:
        state = {"settings": settings.to_json(), "shards": [s for w in writers.values() for s in w.shards]}
        atomic_write(out / PROGRESS, json.dumps(state))

    spec = str(tok.path) if tok.path else tok.name
    filters = build_filters(settings.clean_mode, settings.clean)
    if run.engine.name == "datatrove":
        share = Share(settings.source, settings.text_field, frozenset(settings.extensions), settings.val_fraction,
                      settings.seed, spec, ngrams, filters, settings.dedup, str(out / WORK_DIR), scorer)  # fmt: skip
        batches = datatrove_outcomes(share, run.engine, skipped)
    else:
        batches = _local_outcomes(jobs(), spec, (ngrams, filters, settings.dedup, scorer), run.workers)
    dedup, report, names = Deduplicator(settings.dedup), Report(), {}
    bar = tqdm(
        total=source_bytes(settings.source), desc=f"prepare {settings.source}", unit="B", unit_scale=True, disable=None
    )
    for batch, tokens in batches:
        offset = 0
        for o in batch:
            kept = (
                judge(o, dedup, report, names, quality=scorer) and o.n_tokens and o.index >= writers[o.split].next_doc
            )
            if kept and writers[o.split].add(o.index, tokens[offset : offset + o.n_tokens], o.n_bytes):
                save_progress()
            offset += o.n_tokens
            bar.update(o.n_bytes)
        bar.set_postfix(docs=writers["train"].docs + writers["val"].docs, tokens=writers["train"].tokens, refresh=False)
    bar.close()
    for w in writers.values():
        w.flush()
    return report


def _local_outcomes(
    jobs: Iterator[Job], spec: str, stages: tuple[frozenset[int], list, DedupSettings, Any], workers: int | None
) -> Iterator[tuple[list[Outcome], np.ndarray]]:
    """The outcomes and tokens of this machine's worker processes, batch by batch in document order; `stages`: the
    n-grams, filters, dedup settings and quality classifier each worker judges with."""
    with pipeline.start_pool(pipeline.worker_count(workers), spec, *stages) as pool:
        yield from pool.imap(pipeline.encode, pipeline.batched(jobs))
