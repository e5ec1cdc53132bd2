"""Local parquet files -> the Hugging Face datasets cache, so lmms-eval's stock tasks run offline.

lmms-eval's built-in tasks load ``datasets.load_dataset(dataset_path, dataset_name)`` (e.g.
``lmms-lab-encoder/MME``). Offline, ``datasets`` cannot ask the Hub and falls back to the
*prepared* copy of that repository in the datasets cache (``<cache>/<namespace>___<name>/<config>/
<version>/<hash>/``, "Using the latest cached version of the dataset"). This module writes that
copy from local parquet files with datasets' own parquet builder, so the stock task, unchanged,
reads the local rows: nothing in the installed lmms-eval is edited and no task YAML is copied.

    python -m eval_suites.stock_data --task mme --split test=/data/lmms/MME/data/test-*.parquet
    python -m eval_suites.stock_data --repo lmms-lab-encoder/ScienceQA --config ScienceQA-IMG \\
        --split test=/data/lmms/ScienceQA/ScienceQA-IMG/test-*.parquet

The cache folder is the one lmms-eval reads: ``$LMMS_EVAL_DATASETS_CACHE``, else
``$HF_DATASETS_CACHE``, else ``$HF_HOME/datasets`` (``--cache-dir`` to override). Run the
evaluation with the same variables (``HF_HOME=... make eval TASKS=mme``). The parquet files must
have the columns the task reads (the data set's own schema, e.g. a ``huggingface-cli download``
copy). Re-running replaces the cached copy of that repository/config.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil
import sys


def lmms_eval_datasets_cache() -> str:
    """The datasets cache folder lmms-eval hands to ``load_dataset`` (same environment variables)."""
    try:
        from lmms_eval.api.task import _resolve_hf_datasets_cache_dir

        return _resolve_hf_datasets_cache_dir.__wrapped__()  # not the process-wide lru_cache value
    except (ImportError, AttributeError):  # pragma: no cover - another lmms-eval layout
        explicit = os.environ.get("LMMS_EVAL_DATASETS_CACHE", "").strip()
        if explicit:
            return os.path.expanduser(explicit)
        home = os.path.expanduser(os.environ.get("HF_HOME", "~/.cache/huggingface"))
        return os.path.expanduser(os.environ.get("HF_DATASETS_CACHE", os.path.join(home, "datasets")))


def _task_yaml(task: str) -> str:
    """The YAML file of stock task ``task``: the installed task files that name it are tried first
    (quick), lmms-eval's task index (a few seconds to build) settles the rest."""
    import lmms_eval
    import yaml
    from lmms_eval.utils import load_yaml_config

    root = os.path.join(os.path.dirname(lmms_eval.__file__), "tasks")
    needles = (f"task: {task}\n", f'task: "{task}"', f"task: '{task}'", f'"task": "{task}"')
    for path in sorted(glob.glob(os.path.join(root, "**", "*.yaml"), recursive=True)):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if any(n in text for n in needles):
            try:
                config = load_yaml_config(path, mode="simple")
            except (OSError, ValueError, TypeError, AssertionError, yaml.YAMLError):  # unreadable for lmms-eval too
                config = {}
            if isinstance(config, dict) and config.get("task") == task:
                return path
    from lmms_eval.tasks import TaskManager

    entry = TaskManager().task_index.get(task)
    if not entry or not isinstance(entry.get("yaml_path"), str):
        raise ValueError(f"{task!r} is not a single lmms-eval task (for a group, populate each member task)")
    return entry["yaml_path"]


def task_source(task: str) -> dict:
    """``{"repo": dataset_path, "config": dataset_name, "splits": [...]}`` of a stock lmms-eval task.

    Read from the task's YAML (``include`` followed, ``!function`` tags not imported). ``splits``
    are the splits the task opens: test / validation / training / few-shot split.
    """
    from lmms_eval.utils import load_yaml_config

    config = load_yaml_config(_task_yaml(task), mode="simple")
    repo = config.get("dataset_path")
    if not repo or repo.count("/") != 1 or os.path.exists(repo):
        raise ValueError(f"task {task!r} does not load a Hub dataset (dataset_path={repo!r})")
    splits = [config[k] for k in ("test_split", "validation_split", "training_split", "fewshot_split")
              if config.get(k)]
    return {"repo": repo, "config": config.get("dataset_name"), "splits": list(dict.fromkeys(splits))}


def _expand(split_files: dict) -> dict[str, list[str]]:
    out = {}
    for split, patterns in split_files.items():
        patterns = [patterns] if isinstance(patterns, (str, os.PathLike)) else list(patterns)
        files = []
        for pattern in patterns:
            matched = sorted(glob.glob(os.path.expanduser(os.fspath(pattern))))
            if not matched:
                raise FileNotFoundError(f"split {split!r}: no file matches {os.fspath(pattern)}")
            files += [os.path.abspath(f) for f in matched]
        if not all(f.endswith(".parquet") for f in files):
            raise ValueError(f"split {split!r}: only .parquet files are supported, got {files}")
        out[split] = files
    if not out:
        raise ValueError("no splits given (e.g. test=/data/MME/test-*.parquet)")
    return out


def _content_hash(files: dict[str, list[str]]) -> str:
    h = hashlib.sha256()
    for split in sorted(files):
        for path in files[split]:
            h.update(split.encode() + b"\0" + os.path.basename(path).encode() + b"\0")
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return "local-" + h.hexdigest()[:16]


def _builder_class():
    from datasets.packaged_modules.parquet.parquet import Parquet

    class LocalParquet(Parquet):
        """datasets' parquet builder, told its files after construction: a builder given a
        ``repo_id`` (which names the cache folder) refuses data files outside that repository."""

        def __init__(self, *args, local_files: dict, **kwargs):
            self._local_files = local_files
            super().__init__(*args, **kwargs)

        def _split_generators(self, dl_manager):
            self.config.data_files = self._local_files
            return super()._split_generators(dl_manager)

    return LocalParquet


def populate(repo: str, split_files: dict, config: str | None = None, cache_dir: str | None = None) -> str:
    """Write the prepared copy of Hub dataset ``repo`` (config ``config``, or the default one) from
    local parquet files (``{split: path, glob or list}``) into the datasets cache; return its folder.

    An earlier copy of the same repository/config is removed first, so the cache holds exactly
    these rows. Offline, ``load_dataset(repo, config)`` then returns them.
    """
    if not isinstance(repo, str) or repo.count("/") != 1:
        raise ValueError(f"repo must be a Hub dataset id 'namespace/name', got {repo!r}")
    files = _expand(split_files)
    cache_dir = os.path.abspath(cache_dir or lmms_eval_datasets_cache())
    config_name = config or "default"
    builder = _builder_class()(local_files=files, cache_dir=cache_dir, dataset_name=repo.split("/")[1],
                               config_name=config_name, repo_id=repo, hash=_content_hash(files))
    config_root = os.path.dirname(os.path.dirname(builder.cache_dir))  # <cache>/<ns>___<name>/<config>
    if os.path.isdir(config_root):
        shutil.rmtree(config_root)
    builder.download_and_prepare()
    return builder.cache_dir


def _parse_splits(items: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        split, sep, pattern = item.partition("=")
        if not sep or not split.strip() or not pattern.strip():
            raise ValueError(f"--split wants NAME=FILES, got {item!r}")
        out.setdefault(split.strip(), []).append(pattern.strip())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", help="a stock lmms-eval task: its dataset_path / dataset_name are used")
    source.add_argument("--repo", help="Hub dataset id, e.g. lmms-lab-encoder/MME")
    parser.add_argument("--config", default=None, help="dataset config (the task's dataset_name), with --repo")
    parser.add_argument("--split", action="append", default=[], metavar="NAME=FILES",
                        help="split and its parquet file(s) (glob); repeat per split / file")
    parser.add_argument("--cache-dir", default=None, help="datasets cache (default: the folder lmms-eval reads)")
    args = parser.parse_args(argv)
    try:
        split_files = _parse_splits(args.split)
        if args.task:
            if args.config:
                raise ValueError("--config goes with --repo (a task names its own config)")
            src = task_source(args.task)
            repo, config = src["repo"], src["config"]
            missing = [s for s in src["splits"] if s not in split_files]
            if missing:
                raise ValueError(f"task {args.task} reads split(s) {src['splits']}; missing: {missing}")
        else:
            repo, config = args.repo, args.config
        path = populate(repo, split_files, config=config, cache_dir=args.cache_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{repo}{'/' + config if config else ''}: {', '.join(f'{s} ({len(f)} file(s))' for s, f in split_files.items())} "
          f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
