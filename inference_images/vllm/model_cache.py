"""The machine's cache of trained test models: what ``train_eval_model.py`` and
``train_eval_adapter.py`` trained once, under their cache key, for every checkout on this machine.

Training is deterministic from the key (the script, its task modules, its config, the versions of
the libraries that train, and for an adapter its base's key), so a model trained in one checkout is
the model another would train: a clean clone (CI's, on the machine of the session that submitted)
copies it in seconds instead of spending ~450 CPU-s beside the suite, as podman's layer cache
spares it the image builds. A cold machine trains, as before, and stores the result.

Where: ``$AIBRIX_MODEL_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/aibrix-batch/models``;
``AIBRIX_MODEL_CACHE=off`` turns it off. An entry is a folder ``<name>-<key>`` holding the trained
folders by name; it appears whole (written beside, then renamed) or not at all.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

KEY_FILE = "train_key.txt"
KEEP = 3  # entries kept per model name: a branch switched back and forth finds its model


def library_versions(*names: str) -> str:
    """The installed versions of ``names`` (part of a cache key: another torch may train another
    model from the same script). Read from package metadata: no import of torch."""
    out = []
    for name in names:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} absent")
    return ";".join(out)


def cache_root() -> Path | None:
    """The cache's folder, or None when the environment turns it off."""
    explicit = os.environ.get("AIBRIX_MODEL_CACHE")
    if explicit:
        return None if explicit == "off" else Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aibrix-batch" / "models"


def restore(name: str, key: str, folders: list[Path]) -> bool:
    """Copy the entry ``name``-``key`` into ``folders`` (each by its name); False when there is none.

    Every folder's key file is written last, after its files: an interrupted copy leaves a folder
    whose key check fails, and the next run restores or trains again."""
    root = cache_root()
    entry = root / f"{name}-{key}" if root else None
    if entry is None or not all((entry / f.name).is_dir() for f in folders):
        return False
    for folder in folders:
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(entry / folder.name, folder, ignore=shutil.ignore_patterns(KEY_FILE))
    for folder in folders:
        if (entry / folder.name / KEY_FILE).exists():
            shutil.copy2(entry / folder.name / KEY_FILE, folder / KEY_FILE)
    print(f"{name}: restored from the machine's model cache ({entry})", flush=True)
    return True


def store(name: str, key: str, folders: list[Path]) -> None:
    """Keep ``folders`` as the entry ``name``-``key``, and the newest KEEP entries of ``name``.

    Best effort: a full disk or a read-only home costs the next clone a training, not this run."""
    root = cache_root()
    if root is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-{key}-", dir=root))
        for folder in folders:
            shutil.copytree(folder, staging / folder.name)
        try:
            staging.rename(root / f"{name}-{key}")
        except OSError:  # another checkout stored the same entry first
            shutil.rmtree(staging, ignore_errors=True)
        # Not a glob: "eval-llama-*" would take the adapter's "eval-llama-reverse-<key>" too.
        ours = re.compile(re.escape(name) + r"-[0-9a-f]+")
        entries = sorted((p for p in root.iterdir() if ours.fullmatch(p.name)),
                         key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        print(f"{name}: not kept in the machine's model cache ({exc})", flush=True)
