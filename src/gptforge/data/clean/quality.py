"""GPT-3's quality classifier: a linear model over hashed word and character n-grams learns to tell reference
documents (label 1) from a seeded sample of the corpus being prepared (label 0); each document's score is its
probability of being reference-like, and a document is kept by GPT-3's Pareto rule or above a threshold.
FineWeb-Edu's form learns scores given to documents (`--quality-labels`) with a linear regressor instead.

The vectorizer hashes (no vocabulary to fit) and the model is small, so it pickles to the worker processes, which
score their batches; the parent decides, per document, from a generator seeded by the document's name, so the
verdict depends neither on the worker count nor on the order batches finish in.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gptforge.errors import GptforgeError
from gptforge.inputs import read_jsonl, require_regular_file

SAMPLE_DOCS = 20_000  # documents learned from on each side, at most: bounds the parent's time and memory
LABELLED_DOCS = 2 * SAMPLE_DOCS  # --quality-labels rows learned from, at most: as many as --quality's two sides
TEXT_CHARS = 10_000  # characters of a document read, for learning and for scoring alike (the same features)
PARETO_ALPHA = 9  # GPT-3's shape: a document scoring s is kept with probability (2 - s) ** -9
INSTALL = "--quality needs its extra: pip install 'gptforge[quality]'"


@dataclass(frozen=True)
class QualitySettings:
    """--quality REF or --quality-labels FILE.jsonl (both None: no classifier) and --quality-threshold (None:
    GPT-3's Pareto rule)."""

    reference: str | None = None
    threshold: float | None = None
    labels: str | None = None
    state: str | None = None  # a digest of what it learns from: a changed REF or labels file is a change

    @property
    def flag(self) -> str | None:
        """The flag that asks for a classifier, to name in messages; None without one."""
        return "--quality" if self.reference is not None else "--quality-labels" if self.labels is not None else None


def check_quality(settings: QualitySettings) -> QualitySettings:
    """The settings, or one line naming the flag whose value cannot work."""
    if settings.reference is not None and settings.labels is not None:
        raise GptforgeError(f"--quality {settings.reference} and --quality-labels {settings.labels}: pass one of them")
    if settings.threshold is not None and settings.flag is None:
        raise GptforgeError(
            f"--quality-threshold {settings.threshold}: needs --quality REF or --quality-labels FILE (what it cuts)"
        )
    if settings.threshold is not None and not 0 <= settings.threshold <= 1:
        raise GptforgeError(f"--quality-threshold must be in [0, 1], got {settings.threshold}")
    for flag, value in (("--quality", settings.reference), ("--quality-labels", settings.labels)):
        if value is not None and not value.strip():
            raise GptforgeError(f"{flag} {value!r}: empty (expected a name)")
    return settings


def sample(texts: Iterable[str], n: int, seed: int) -> list[str]:
    """A seeded uniform sample of at most `n` texts (reservoir sampling: one pass, `n` texts held), each cut to
    TEXT_CHARS."""
    return _reservoir((text[:TEXT_CHARS] for text in texts), n, seed)


def _reservoir(items: Iterable[Any], n: int, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    held: list[Any] = []
    for i, item in enumerate(items):
        if i < n:
            held.append(item)
        elif (j := int(rng.integers(0, i + 1))) < n:
            held[j] = item
    return held


@dataclass(frozen=True)
class Linear:
    """A fitted linear model's weights alone: sklearn's averaged SGD keeps three copies (50 MB to pickle to each
    worker at 2^21 features), and predict_proba is this logistic of the decision function."""

    weights: np.ndarray  # float32: half the bytes, scores within 1e-6
    bias: float
    logistic: bool  # a classifier's probability; else a regressor's prediction, clipped to the labels' [0, 1]

    @classmethod
    def of(cls, model: Any, logistic: bool) -> Linear:
        return cls(model.coef_.ravel().astype(np.float32), float(np.ravel(model.intercept_)[0]), logistic)

    def __call__(self, features: Any) -> np.ndarray:
        z = features @ self.weights + self.bias
        return 1 / (1 + np.exp(-z)) if self.logistic else np.clip(z, 0, 1)


class Classifier:
    """The fitted model, and the rule that turns a score into a verdict (picklable: it travels to the workers)."""

    def __init__(self, model: Linear | None, vectorizer: Any, settings: QualitySettings, seed: int) -> None:
        self.model, self.vectorizer, self.settings, self.seed = model, vectorizer, settings, seed

    def scores(self, texts: list[str]) -> list[float]:
        """Each text's probability of being reference-like, in [0, 1]; one call for a batch (sklearn's overhead is
        per call, not per document)."""
        if not texts:
            return []
        features = self.vectorizer.transform([t[:TEXT_CHARS] for t in texts])
        return [float(p) for p in self.model(features)]

    def keeps(self, score: float, name: str) -> bool:
        """Whether a document scoring `score` is kept: above the threshold, or GPT-3's rule with a draw seeded by
        the run's seed and the document's name."""
        if self.settings.threshold is not None:
            return score >= self.settings.threshold
        return bool(_rng(self.seed, name).pareto(PARETO_ALPHA) > 1 - score)


def _rng(seed: int, name: str) -> np.random.Generator:
    key = int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return np.random.default_rng([seed, key])


def train(
    reference: list[str], corpus: list[str], settings: QualitySettings, seed: int, skipped: Iterable[tuple] = ()
) -> Classifier:
    """A classifier of `reference` (label 1) against `corpus` (label 0), seeded; one line when a side is empty.
    `skipped`: REF's files read without text, as (name, bytes, why), said when no document is left."""
    if not reference:
        whys = Counter(why for _, _, why in skipped)
        said = f" (skipped: {', '.join(f'{n:,} {why}' for why, n in whys.items())})" if whys else ""
        raise GptforgeError(f"--quality {settings.reference}: no reference documents with text{said}")
    if not corpus:
        raise GptforgeError(f"--quality {settings.reference}: the corpus has no documents to learn against")
    sklearn = _sklearn()
    vectorizer = _vectorizer(sklearn)
    labels = np.array([1] * len(reference) + [0] * len(corpus))
    # Balanced classes: a reference a tenth of the corpus's size must not pull every score towards 0.
    # Strong regularization: the corpus side holds the very documents scored later, and a weaker one (sklearn's
    # 1e-4) learns each of them by its names as label 0 (good code in a small corpus then scored 0.0-0.1, not 0.6).
    # Averaged SGD: the last iterate alone moved those scores by 0.2 from one seed to the next.
    model = sklearn["SGDClassifier"](
        loss="log_loss", alpha=3e-3, average=True, class_weight="balanced", random_state=seed
    )
    model.fit(vectorizer.transform(reference + corpus), labels)
    return Classifier(Linear.of(model, logistic=True), vectorizer, settings, seed)


def labelled(path: str, seed: int) -> tuple[list[str], list[float]]:
    """A seeded sample (LABELLED_DOCS at most) of --quality-labels' rows, each a JSON object with a string "text" and
    a number "score" in [0, 1]; every row is checked, a bad one is one line naming its file and line."""
    rows = _reservoir(_labelled_rows(path), LABELLED_DOCS, seed)
    if not rows:
        raise GptforgeError(f"--quality-labels {path}: no labelled documents")
    return [text for text, _ in rows], [score for _, score in rows]


def _labelled_rows(path: str) -> Iterable[tuple[str, float]]:
    for where, row in read_jsonl(require_regular_file(path, "--quality-labels")):
        text, score = (row.get("text"), row.get("score")) if isinstance(row, dict) else (None, None)
        if not isinstance(text, str) or isinstance(score, bool) or not isinstance(score, int | float):
            raise GptforgeError(f'--quality-labels {where}: expected {{"text": string, "score": number}}')
        if not 0 <= score <= 1:
            raise GptforgeError(f"--quality-labels {where}: score {score} is outside [0, 1]")
        try:  # JSON's \ud800 escapes make lone surrogates, which the vectorizer cannot encode
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise GptforgeError(
                f"--quality-labels {where}: text holds a lone surrogate \\u{ord(text[e.start]):04x} (not text)"
            ) from None
        yield text[:TEXT_CHARS], float(score)


def train_regressor(texts: list[str], scores: list[float], settings: QualitySettings, seed: int) -> Classifier:
    """FineWeb-Edu's form: a linear regressor of the given scores over the same features, seeded."""
    sklearn = _sklearn()
    vectorizer = _vectorizer(sklearn)
    model = sklearn["SGDRegressor"](alpha=1e-4, average=True, random_state=seed)
    model.fit(vectorizer.transform(texts), np.array(scores))
    return Classifier(Linear.of(model, logistic=False), vectorizer, settings, seed)


def _sklearn() -> dict[str, Any]:
    """scikit-learn's pieces, imported only when a classifier is asked for (an optional extra)."""
    try:
        from sklearn.feature_extraction.text import HashingVectorizer
        from sklearn.linear_model import SGDClassifier, SGDRegressor
        from sklearn.pipeline import make_union
    except ImportError as e:
        raise GptforgeError(f"{INSTALL} (missing {e.name})") from None
    return {"HashingVectorizer": HashingVectorizer, "SGDClassifier": SGDClassifier, "SGDRegressor": SGDRegressor,
            "make_union": make_union}  # fmt: skip


def _vectorizer(sklearn: dict[str, Any]) -> Any:
    # Words say what a document is about, character n-grams how it is written (minified code, markup, mojibake).
    hashing = sklearn["HashingVectorizer"]
    return sklearn["make_union"](
        hashing(analyzer="word", ngram_range=(1, 2), n_features=1 << 20, alternate_sign=False),
        hashing(analyzer="char_wb", ngram_range=(2, 4), n_features=1 << 20, alternate_sign=False),
    )
