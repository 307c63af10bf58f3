"""Where a model or tokenizer lives: a local directory or a Hugging Face Hub id (``org/name``).

``model.path`` and ``model.tokenizer`` take either. A value that names an existing directory is
that directory. A value that looks like a path (it starts with ``/``, ``./``, ``../`` or ``~``,
has more than one ``/``, or its first part exists here) and does not exist is a missing
directory. Anything else is a Hub id, resolved through ``huggingface_hub``'s cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``): downloaded when
online, read from the cache when offline (``HF_HUB_OFFLINE=1`` or ``TRANSFORMERS_OFFLINE=1``).

Three user errors, each its own text (:class:`ModelLocationError`, ``kind``):

``no_dir``      a path that does not exist
``not_cached``  a Hub id that is not in the cache while offline (or with the Hub unreachable);
                the message gives the command that fetches it
``not_model``   a directory or snapshot that is not a model (no ``config.json``) or, for
                ``model.tokenizer``, holds no tokenizer files
``remote_code`` a directory whose configs name Python code to import (``auto_map`` entries
                ``module.Class``, transformers' "remote code"): rlcli never runs code from a
                model directory, so it refuses the directory before anything loads it

plus ``hub`` for what the Hub itself answers (no such repository, gated, no such revision).
``validate`` checks without downloading weights: a cached snapshot is read as is; online, an
uncached id fetches ``config.json`` only (or the tokenizer's config, for ``model.tokenizer``).
A snapshot already in the cache is used as it is, without asking the Hub for a newer revision
(``hf download`` updates it).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Literal

Need = Literal["model", "tokenizer"]
# Files a model download leaves out: other frameworks' and other runtimes' copies of the weights.
# And Python files: rlcli never runs a model's own code (remote code), so it does not fetch it.
_IGNORE = ["*.gguf", "*.onnx", "*.h5", "*.msgpack", "*.ot", "*.tflite", "original/*", "onnx/*", "*.py"]
_CODE_CONFIGS = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
_TOKENIZER_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelLocationError(ValueError):
    """A ``model.path`` / ``model.tokenizer`` that cannot be used; ``kind`` says which of the
    module doc's cases, ``field`` the recipe key, the message the fix."""

    def __init__(self, field: str, kind: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.kind, self.message = field, kind, message


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``, read now (not at import, as huggingface_hub does)."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> Path:
    """The Hub cache huggingface_hub would use, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` is meant as a local path rather than a Hub id."""
    if spec.startswith(("/", "./", "../", "~", ".\\")) or spec in (".", "..") or "\\" in spec:
        return True
    if spec.count("/") > 1 or not _REPO_ID.match(spec):
        return True
    first = spec.split("/", 1)[0]
    return "/" in spec and Path(first).exists()  # models/qwen where ./models exists: a path


def fetch_hint(repo_id: str) -> str:
    return (f"fetch it with `hf download {repo_id}` (huggingface_hub >= 1.0; older: `huggingface-cli "
            f"download {repo_id}`) into the same cache, or unset HF_HUB_OFFLINE to let rlcli download it")


def remote_code(path: str | Path) -> list[str]:
    """The ``auto_map`` entries of ``path``'s config files that name Python code (``module.Class``,
    which transformers imports from the directory with ``trust_remote_code``), as ``file: key = value``.
    A bare class name (``PreTrainedTokenizerFast``) names one of transformers' own classes: not code."""
    found = []
    for name in _CODE_CONFIGS:
        try:
            data = json.loads((Path(path) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        amap = data.get("auto_map") if isinstance(data, dict) else None
        items = amap.items() if isinstance(amap, dict) else [("", amap)]
        for key, value in items:
            for v in value if isinstance(value, list) else [value]:
                if v is not None and (not isinstance(v, str) or "." in v):  # anything but a bare class name
                    found.append(f"{name}: auto_map{'.' + key if key else ''} = {v}")
    return found


def check_no_remote_code(path: Path, where: str, field: str) -> None:
    """Raise :class:`ModelLocationError` (``remote_code``) when ``path`` asks for code of its own to run."""
    code = remote_code(path)
    if code:
        raise ModelLocationError(field, "remote_code", f"{where} names Python code to run ({'; '.join(code[:3])}); "
                                 "rlcli never runs code from a model directory: use a model whose architecture "
                                 "transformers ships, or remove auto_map from its configs")


def _check_dir(path: Path, spec: str, field: str, need: Need) -> Path:
    where = f"{spec} ({path})" if str(path) != spec else spec
    check_no_remote_code(path, where, field)
    if need == "model" and not (path / "config.json").is_file():
        raise ModelLocationError(field, "not_model", f"{where} is not a Hugging Face model: no config.json in it "
                                 "(point it at the directory that holds config.json and the weights)")
    if need == "tokenizer" and not any((path / f).is_file() for f in _TOKENIZER_MARKERS):
        raise ModelLocationError(field, "not_model", f"{where} is not a Hugging Face tokenizer: none of "
                                 f"{', '.join(_TOKENIZER_MARKERS)} in it")
    return path


def locate(spec: str, *, field: str = "model.path", need: Need = "model", download: bool = True) -> Path:
    """The local directory for ``spec`` (see the module doc); :class:`ModelLocationError` otherwise.

    ``download=False`` (validation): never fetch weights; an uncached Hub id, online, fetches
    only its config file so the recipe can be checked against the model's shape.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return _check_dir(path, spec, field, need)
    if path.exists():
        raise ModelLocationError(field, "no_dir", f"{spec} is a file; expected a model directory or a Hub id (org/name)")
    if looks_like_path(spec):
        shown = spec if str(path.absolute()) == spec else f"{spec} ({path.absolute()})"
        raise ModelLocationError(field, "no_dir", f"no such directory: {shown} (a local path; a Hub model id "
                                 "looks like org/name)")
    snapshot = _snapshot(spec, field, need, download, is_offline(), str(hub_cache_dir()))
    return _check_dir(snapshot, spec, field, need)


@functools.lru_cache(maxsize=32)
def _snapshot(repo_id: str, field: str, need: Need, download: bool, offline: bool, cache: str) -> Path:
    """The cached (or downloaded) snapshot directory of ``repo_id``; remembered per process."""
    import huggingface_hub as hh
    from huggingface_hub import errors

    patterns = {"allow_patterns": _TOKENIZER_FILES} if need == "tokenizer" else {"ignore_patterns": _IGNORE}
    try:
        try:
            found = Path(hh.snapshot_download(repo_id, cache_dir=cache, local_files_only=True, **patterns))
            if download and need == "model" and (found / "config.json").is_file() and not any(
                    next(found.glob(p), None) for p in _WEIGHTS):  # a config fetched by validate alone
                raise errors.LocalEntryNotFoundError("no weights in the cached snapshot")
            return found
        except errors.LocalEntryNotFoundError:
            if offline:
                raise
        if download:
            return Path(hh.snapshot_download(repo_id, cache_dir=cache, **patterns))
        config = "config.json" if need == "model" else "tokenizer_config.json"
        return Path(hh.hf_hub_download(repo_id, config, cache_dir=cache)).parent
    except errors.LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE=1 forbids downloading" if offline else f"the Hub could not be reached ({exc})"
        incomplete = getattr(errors, "IncompleteSnapshotError", ())  # huggingface_hub >= 1.x
        partly = "is only partly in" if isinstance(exc, incomplete) or "no weights" in str(exc) else "is not in"
        local = "" if "/" in repo_id else f" (if a local directory was meant: no such directory ./{repo_id})"
        raise ModelLocationError(field, "not_cached", f"{repo_id} {partly} the Hugging Face cache ({cache}) and "
                                 f"{why}; {fetch_hint(repo_id)}{local}") from None
    except errors.GatedRepoError:
        raise ModelLocationError(field, "hub", f"{repo_id} is gated on the Hub: accept its terms on "
                                 f"https://huggingface.co/{repo_id} and log in with `hf auth login`") from None
    except errors.RepositoryNotFoundError:
        raise ModelLocationError(field, "hub", f"no model {repo_id} on the Hugging Face Hub (or it is private: "
                                 "log in with `hf auth login`); a local directory must exist") from None
    except (errors.EntryNotFoundError, getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)):
        raise ModelLocationError(field, "not_model", f"{repo_id} on the Hub is not a Hugging Face "
                                 f"{'model: it has no config.json' if need == 'model' else 'tokenizer'}") from None
    except (errors.HfHubHTTPError, errors.HFValidationError, OSError) as exc:
        raise ModelLocationError(field, "hub", f"cannot fetch {repo_id} from the Hub: {exc}") from None
